//! `tidewire train --switch` and `--adapt-every`: FC layers switching
//! between the PS and SFB mid-run, given up front or decided by worker 0 in
//! the run, end to end over real processes on loopback, checked bit for bit
//! against the single-process reference (`--verify`).

mod support;

use std::process::Output;

use support::{serial, tidewire, TrainReport};
use tidewire_engine::book::Scheme;

fn report(out: &Output) -> TrainReport {
    assert!(
        out.status.success(),
        "tidewire failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    support::report(&out.stdout)
}

/// `train` with SGD at `momentum` (its momentum moves with a layer that switches).
fn train_with(momentum: &str, layout: &[&str], extra: &[&str]) -> Output {
    let mut args = vec!["train", "--model", "vgg19-mini"];
    args.extend_from_slice(layout);
    args.extend_from_slice(&[
        "--iters",
        "6",
        "--batch",
        "8",
        "--time-scale",
        "0.05",
        "--op",
        "sgd",
        "--momentum",
        momentum,
        "--verify",
        "--json",
    ]);
    args.extend_from_slice(extra);
    tidewire().args(&args).output().unwrap()
}

fn train(layout: &[&str], extra: &[&str]) -> Output {
    train_with("0", layout, extra)
}

/// Switches both ways, split and colocated, with and without SGD's
/// momentum: the parameters (and the momentum) move at each boundary (a
/// missing write back to the servers fails `--verify`), and the factor
/// blocks sent are exactly the SFB iterations' (3 workers, 2 peers each).
#[test]
fn switches_given_up_front_hold_bit_for_bit() {
    let _g = serial();
    for (layout, momentum) in [
        (&["--workers", "3", "--servers", "2"][..], "0"),
        (&["--workers", "3", "--colocate"][..], "0"),
        (&["--workers", "3", "--servers", "2"][..], "0.9"),
        (&["--workers", "3", "--colocate"][..], "0.9"),
    ] {
        let r = report(&train_with(
            momentum,
            layout,
            &[
                "--sync",
                "wfbp",
                "--switch",
                "fc6@2:sfb,fc6@4:ps",
                "--switch",
                "fc8@1:sfb",
            ],
        ));
        let what = format!("{layout:?}, momentum {momentum}");
        assert_eq!(r.verified, Some(true), "{what}: {:?}", r.mismatched_layers);
        let got: Vec<(u64, Scheme)> = r.switches.iter().map(|s| (s.iter, s.scheme)).collect();
        assert_eq!(got, [(2, Scheme::Sfb), (4, Scheme::Ps), (1, Scheme::Sfb)], "{what}");
        // fc6 by SFB in iterations 2 and 3, fc8 in 1 to 5: 7 iterations × 3 workers × 2 peers.
        assert_eq!(r.factor_sends, 7 * 3 * 2, "{what}");
    }
}

/// Decided in the run: with the cost model in bytes (no rates), at batch
/// 256 the model is unsure of some FC layer (its two traffics within 2x), so
/// after measuring the start-up choice worker 0 tries that layer the other
/// way; each decision is in the report, the switches it made are replayed by
/// the reference, and every rank ends equal to it.
#[test]
fn decisions_in_the_run_are_carried_to_every_rank_and_replayed() {
    let _g = serial();
    let mut args = vec!["--batch", "256"];
    args.extend_from_slice(&["--sync", "hybrid", "--cost-model", "bytes", "--adapt-every", "2"]);
    let out = tidewire()
        .args([
            "train",
            "--model",
            "vgg19-mini",
            "--workers",
            "2",
            "--servers",
            "1",
            "--iters",
            "6",
        ])
        .args(["--time-scale", "0.05", "--op", "mean", "--verify", "--json"])
        .args(&args)
        .output()
        .unwrap();
    let r = report(&out);
    assert_eq!(r.verified, Some(true), "{:?}", r.mismatched_layers);
    let points: Vec<u64> = r.decisions.iter().map(|d| d.at).collect();
    assert_eq!(points, [2, 4, 6], "a decision one iteration before each point");
    // The start-up choice, then an alternative, each timed.
    assert_ne!(r.decisions[0].sfb, r.decisions[1].sfb, "{:?}", r.decisions);
    assert!(
        r.decisions[1].window_s > 0.0 && r.decisions[2].window_s > 0.0,
        "{:?}",
        r.decisions
    );
    assert!(
        !r.switches.is_empty() && r.switches.iter().all(|s| s.iter >= 4),
        "{:?}",
        r.switches
    );
}

/// What switches cannot do yet is refused before any rank starts, by name.
#[test]
fn switches_outside_what_they_support_are_refused_up_front() {
    let _g = serial();
    for (extra, want) in [
        (&["--sync", "wfbp", "--switch", "fc9@2:sfb"][..], "no layer \"fc9\""),
        (
            &["--sync", "wfbp", "--switch", "conv1_1@2:sfb"][..],
            "not a dense fully connected layer",
        ),
        (&["--sync", "wfbp", "--switch", "fc6@0:sfb"][..], "iteration 1 or later"),
        (&["--sync", "wfbp", "--switch", "fc6@2"][..], "no :SCHEME"),
        (
            &["--sync", "wfbp", "--consistency", "ssp:1", "--adapt-every", "2"][..],
            "BSP",
        ),
    ] {
        let out = train(&["--workers", "2", "--servers", "1"], extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{extra:?}: {err}");
        assert!(
            !err.contains("rank 0 exited"),
            "{extra:?}: refused only after the launch: {err}"
        );
    }
}

/// The launcher checks `--switch` on the book the ranks build, at the rates
/// it measured (here a profile whose GEMM is so slow that HybComm in
/// seconds starts every FC layer on the PS, where the model in bytes starts
/// fc6 by SFB): a switch the ranks can make runs, and one they cannot is
/// refused before any rank starts, with either cost model.
#[test]
fn switches_are_checked_at_the_rates_the_ranks_decide_with() {
    let _g = serial();
    let dir = support::tmp("switch-rates");
    std::fs::create_dir_all(&dir).unwrap();
    let profile = dir.join("slow-gemm.json");
    std::fs::write(
        &profile,
        r#"{"cores": 2, "link": "loopback", "mem_bytes_per_s": 1.0e10, "rates": {"link_bytes_per_s": 3.0e9,
            "msg_s": 2.0e-5, "sum_bytes_per_s": 6.0e9, "gemm_flop_per_s": 1.0e6, "host_ranks": 1, "link_on_host": true}}"#,
    )
    .unwrap();
    let seconds = ["--sync", "hybrid", "--profile", profile.to_str().unwrap()];
    let bytes = ["--sync", "hybrid", "--cost-model", "bytes"];
    for (model, runs, refused) in [(&seconds, "fc6@2:sfb", "fc6@2:ps"), (&bytes, "fc6@2:ps", "fc6@2:sfb")] {
        let layout = ["--workers", "2", "--servers", "1"];
        let mut extra = model.to_vec();
        extra.extend_from_slice(&["--switch", runs]);
        let r = report(&train(&layout, &extra));
        assert_eq!(r.verified, Some(true), "{model:?} {runs}: {:?}", r.mismatched_layers);
        assert_eq!(r.switches.len(), 1, "{model:?} {runs}: {:?}", r.switches);
        let mut extra = model.to_vec();
        extra.extend_from_slice(&["--switch", refused]);
        let out = train(&layout, &extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("already syncs by that scheme"),
            "{model:?} {refused}: {err}"
        );
        assert!(
            !err.contains("exited"),
            "{model:?} {refused}: refused only after the launch: {err}"
        );
    }
}

/// `--sync full` decides every 10 iterations unless told otherwise, where
/// the run supports it, and says why not where it does not: no decision
/// under SSP or with `--adapt-every 0`, and `--verify` holds across them.
#[test]
fn full_decides_every_ten_iterations_by_default_where_it_can() {
    let _g = serial();
    let run = |extra: &[&str]| {
        report(
            &tidewire()
                .args(["train", "--model", "vgg19-mini", "--workers", "2", "--servers", "1"])
                .args(["--iters", "12", "--batch", "8", "--time-scale", "0.05", "--json"])
                .args(extra)
                .output()
                .unwrap(),
        )
    };
    let r = run(&["--verify"]);
    assert_eq!(r.verified, Some(true), "{:?}", r.mismatched_layers);
    assert_eq!((r.adapt_every, r.adapt_off.as_deref()), (10, None));
    let points: Vec<u64> = r.decisions.iter().map(|d| d.at).collect();
    assert_eq!(points, [10], "{:?}", r.decisions);

    let r = run(&["--adapt-every", "0"]);
    assert_eq!((r.adapt_every, r.adapt_off.as_deref()), (0, None));
    assert!(r.decisions.is_empty(), "{:?}", r.decisions);

    let r = run(&["--consistency", "ssp:1"]);
    assert_eq!(r.adapt_every, 0);
    assert!(
        r.adapt_off.as_deref().is_some_and(|w| w.contains("BSP")),
        "{:?}",
        r.adapt_off
    );
    assert!(r.decisions.is_empty() && r.switches.is_empty(), "{:?}", r.decisions);
}
