//! `tidewire train --comm-every T --comm-mode accumulate|average` and the
//! quality-guided `--freq-max`: real local clusters, each checked bit for bit
//! against the single-process reference that accumulates (or averages) the
//! same way (`--verify`), with the exchanges counted by the workers.

use std::process::Command;

use serde_json::Value;
use tidewire_engine::testkit;

/// These start clusters of processes: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(args: &[&str]) -> std::process::Output {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    Command::new(env!("CARGO_BIN_EXE_tidewire"))
        .arg("train")
        .args(["--model", "vgg19-mini", "--time-scale", "0", "--json"])
        .args(args)
        .output()
        .expect("tidewire runs")
}

fn train(args: &[&str]) -> Value {
    let out = run(args);
    assert!(
        out.status.success(),
        "tidewire train {} failed ({}):\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(
        r["log_warnings"].as_array().map(Vec::len),
        Some(0),
        "{:#}",
        r["log_warnings"]
    );
    assert_eq!(
        r["verified"],
        Value::Bool(true),
        "train {}: layers {}",
        args.join(" "),
        r["mismatched_layers"]
    );
    r
}

fn t_per_step(r: &Value) -> Vec<u64> {
    r["comm"]["t_per_step"]
        .as_array()
        .expect("t_per_step")
        .iter()
        .map(|v| v.as_u64().expect("a number"))
        .collect()
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
            assert_eq!(r["comm"]["exchanges"], 4, "{mode} {split:?}: {:#}", r["comm"]);
            assert_eq!(t_per_step(&r), vec![3; 10]);
        }
    }
}

#[test]
fn randomized_fixed_t_verifies() {
    let seed = testkit::seed("TIDEWIRE_COMM_SEED");
    let mut s = seed;
    for _ in 0..3 {
        let t = (1 + testkit::next(&mut s) % 5).to_string();
        let iters = (3 + testkit::next(&mut s) % 12).to_string();
        let workers = (1 + testkit::next(&mut s) % 3).to_string();
        let mode = ["accumulate", "average"][(testkit::next(&mut s) % 2) as usize];
        let op = ["sgd", "mean", "sum"][(testkit::next(&mut s) % 3) as usize];
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
            assert!(r["comm"].is_null(), "seed {seed}: {a:?}");
        } else {
            assert_eq!(r["comm"]["exchanges"], want, "seed {seed}: {a:?}");
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
        let decisions: Vec<&str> = r["comm"]["decisions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_str().unwrap())
            .collect();
        assert!(
            decisions.iter().any(|d| d.contains("rejects T 8, back to 4")),
            "{decisions:?}"
        );
        assert!(decisions.last().unwrap().contains("revert to T 1"), "{decisions:?}");
        let ex = r["comm"]["exchanges"].as_u64().unwrap();
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
