//! `tidewire train --comm-every T --comm-mode accumulate|average` and the
//! quality-guided `--freq-max`: real local clusters, each checked bit for bit
//! against the single-process reference that accumulates (or averages) the
//! same way (`--verify`), with the exchanges counted by the workers.

mod support;

use support::{report, serial, testkit, tidewire, Rng, TrainReport};

fn run(args: &[&str]) -> std::process::Output {
    let _serial = serial();
    tidewire()
        .arg("train")
        .args(["--model", "vgg19-mini", "--time-scale", "0", "--json"])
        .args(args)
        .output()
        .expect("tidewire runs")
}

fn train(args: &[&str]) -> TrainReport {
    let out = run(args);
    assert!(
        out.status.success(),
        "tidewire train {} failed ({}):\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&out.stdout);
    assert_eq!(r.log_warnings.len(), 0, "{:#?}", r.log_warnings);
    assert_eq!(
        r.verified,
        Some(true),
        "train {}: layers {:?}",
        args.join(" "),
        r.mismatched_layers
    );
    r
}

fn t_per_step(r: &TrainReport) -> &[u32] {
    &r.comm.as_ref().expect("t_per_step").t_per_step
}

/// The run's exchanges (None without a communication summary).
fn exchanges(r: &TrainReport) -> Option<u64> {
    r.comm.as_ref().map(|c| c.exchanges)
}

#[test]
fn fixed_t_verifies_in_both_modes_with_the_exchanges_counted() {
    for mode in ["accumulate", "average"] {
        for split in [
            &["--workers", "2", "--colocate"][..],
            &["--workers", "2", "--servers", "1"][..],
        ] {
            let mut a = vec!["--iters", "10", "--comm-every", "3", "--comm-mode", mode, "--verify"];
            a.extend_from_slice(split);
            let r = train(&a);
            // Exchanges at iterations 2, 5 and 8, and the final one at 9.
            assert_eq!(exchanges(&r), Some(4), "{mode} {split:?}: {:#?}", r.comm);
            assert_eq!(t_per_step(&r), vec![3; 10]);
        }
    }
}

#[test]
fn randomized_fixed_t_verifies() {
    let seed = testkit::seed("TIDEWIRE_COMM_SEED");
    let mut rng = Rng(seed);
    for _ in 0..3 {
        let t = (1 + rng.below(5)).to_string();
        let iters = (3 + rng.below(12)).to_string();
        let workers = (1 + rng.below(3)).to_string();
        let mode = rng.pick(&["accumulate", "average"]);
        let op = rng.pick(&["sgd", "mean", "sum"]);
        let a = [
            "--iters",
            &iters,
            "--comm-every",
            &t,
            "--comm-mode",
            mode,
            "--op",
            op,
            "--workers",
            &workers,
            "--colocate",
            "--verify",
        ];
        println!("seed {seed}: train {}", a.join(" "));
        let r = train(&a);
        let (t, iters): (u64, u64) = (t.parse().unwrap(), iters.parse().unwrap());
        let want = iters / t + u64::from(iters % t != 0);
        if t == 1 && mode == "accumulate" {
            // Every iteration, gradients: the plain trainer, with no communication summary.
            assert!(r.comm.is_none(), "seed {seed}: {a:?}");
        } else {
            assert_eq!(exchanges(&r), Some(want), "seed {seed}: {a:?}");
        }
    }
}

#[test]
fn quality_guided_adjusts_rejects_and_reverts_and_verifies() {
    // The synthetic loss degrades beyond T = 4: the controller climbs 1, 2, 4, is
    // rejected at 8 and 6 (then 5), and returns to T = 1 at 85% of the run.
    for mode in [&["--op", "mean"][..], &["--comm-mode", "average"][..]] {
        let mut a = vec![
            "--iters",
            "120",
            "--workers",
            "3",
            "--colocate",
            "--freq-max",
            "16",
            "--verify",
        ];
        a.extend_from_slice(mode);
        let r = train(&a);
        let ts = t_per_step(&r);
        assert_eq!(ts.len(), 120);
        assert!(ts.iter().all(|t| (1..=16).contains(t)), "{ts:?}");
        assert!(ts.contains(&4) && !ts[..101].contains(&16), "{ts:?}");
        assert!(ts[102..].iter().all(|t| *t == 1), "{ts:?}");
        let decisions = &r.comm.as_ref().expect("comm").decisions;
        assert!(
            decisions.iter().any(|d| d.contains("rejects T 8, back to 4")),
            "{decisions:?}"
        );
        assert!(decisions.last().unwrap().contains("revert to T 1"), "{decisions:?}");
        let ex = exchanges(&r).unwrap();
        assert!(ex * 3 < 120 * 2, "{ex} exchanges: at least 1.5x fewer than 120");
    }
}

#[test]
fn bad_comm_flags_are_clear_errors() {
    for (a, want) in [
        (&["--freq-max", "8"][..], "needs servers that reduce"),
        (&["--comm-every", "2", "--consistency", "ssp:1"][..], "need BSP"),
        (&["--comm-every", "0"][..], "T = 0"),
        (&["--comm-mode", "gossip"][..], "accumulate or average"),
        (&["--freq-max", "8", "--op", "mean", "--freq-period", "0"][..], "period"),
    ] {
        let out = run(a);
        assert!(!out.status.success(), "{a:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{a:?}: {err}");
    }
}
