//! `tidewire sim`: the engine core on a simulated network, from the command line.

mod support;

use std::process::Output;

use serde_json::Value;
use support::tidewire;

fn sim(args: &[&str]) -> Output {
    tidewire().arg("sim").args(args).output().unwrap()
}

fn json(args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    let out = sim(&a);
    assert!(
        out.status.success(),
        "{:?}: {}",
        args,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

#[test]
fn one_node_is_its_compute_and_speedup_one() {
    let j = json(&["--model", "googlenet", "--nodes", "1", "--iters", "2"]);
    let (it, compute) = (j["iteration_s"].as_f64().unwrap(), j["compute_s"].as_f64().unwrap());
    // The compute, plus the local sync of the last layer (microseconds).
    assert!(it >= compute && (it - compute) / compute < 1e-3, "{j}");
    assert!((j["speedup"].as_f64().unwrap() - 1.0).abs() < 1e-9);
    let tp = j["throughput_samples_s"].as_f64().unwrap();
    assert!((tp - j["batch"].as_f64().unwrap() / it).abs() < 1e-6);
}

#[test]
fn hybcomm_needs_less_bandwidth_than_the_ps_for_vgg19() {
    // Poseidon's effect: at 2 Gbit/s, 16 nodes, full (WFBP + HybComm) scales far
    // better than WFBP alone; at 30 Gbit/s both are near linear.
    let s = |sync: &str, bw: &str| {
        json(&[
            "--model",
            "vgg19",
            "--nodes",
            "16",
            "--bandwidth",
            bw,
            "--sync",
            sync,
            "--iters",
            "3",
        ])["speedup"]
            .as_f64()
            .unwrap()
    };
    let (wfbp2, full2) = (s("wfbp", "2gbit"), s("full", "2gbit"));
    assert!(full2 > 2.0 * wfbp2, "full {full2} vs wfbp {wfbp2} at 2 Gbit/s");
    assert!(s("full", "30gbit") > 15.0);
    assert!(s("wfbp", "30gbit") > 15.0);
}

#[test]
fn separate_workers_and_servers() {
    let j = json(&[
        "--model",
        "resnet-50",
        "--workers",
        "4",
        "--servers",
        "2",
        "--sync",
        "p3",
        "--iters",
        "2",
    ]);
    assert_eq!(
        (j["workers"].as_u64(), j["servers"].as_u64(), j["colocated"].as_bool()),
        (Some(4), Some(2), Some(false))
    );
    assert!(j["speedup"].as_f64().unwrap() > 0.0);
}

#[test]
fn bad_flags_are_clear_errors() {
    for (args, want) in [
        (vec!["--model", "lenet"], "unknown model"),
        (vec!["--bandwidth", "fast"], "give a bandwidth like"),
        (vec!["--sync", "ring"], "use fifo-ps, wfbp"),
        (vec!["--nodes", "0"], "give 1 to 4096"),
        (vec!["--workers", "4"], "--servers"),
        (vec!["--consistency", "ssp"], "use bsp or ssp:S"),
        (vec!["--iters", "0"], "at least 1"),
        (
            vec!["--sync", "adam", "--consistency", "ssp:1"],
            "--sync adam is a BSP baseline",
        ),
        (
            vec!["--sync", "kvstore", "--trigger", "async"],
            "--sync kvstore is a BSP baseline",
        ),
    ] {
        let out = sim(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn triggers_and_faults_from_the_command_line() {
    let base = [
        "--model",
        "vgg19-mini",
        "--workers",
        "4",
        "--servers",
        "2",
        "--sync",
        "p3",
        "--iters",
        "6",
    ];
    let run = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        json(&a)
    };
    let plain = run(&[]);
    let quorum = run(&["--trigger", "quorum:3", "--slow-rank", "1", "--slow-factor", "5"]);
    let bsp = run(&["--fault", "slow:1:5"]);
    let rate = |j: &Value| plain["updates_iteration_s"].as_f64().unwrap() / j["updates_iteration_s"].as_f64().unwrap();
    assert!(rate(&quorum) >= 0.9, "{quorum}");
    assert!(rate(&bsp) < 0.5, "{bsp}");
    assert!(quorum["dropped"].as_u64().unwrap() > 0, "{quorum}");
    assert_eq!(quorum["trigger"], "quorum:3");
    // A crash: the others go on under async; under all, an error naming the rank.
    let a = run(&["--trigger", "async", "--fault", "crash:2:3"]);
    assert_eq!(a["trigger"], "async");
    let back = run(&["--trigger", "quorum:3", "--fault", "crash:2:2:5"]);
    assert_eq!(back["rejoined"], 1, "{back}");
    let mut args = base.to_vec();
    args.extend_from_slice(&["--fault", "crash:2:3"]);
    let out = sim(&args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 2"), "{err}");
    for bad in [
        &["--trigger", "quorum:x"][..],
        &["--fault", "slow:1"],
        &["--fault", "crash:1:2:3"],
        &["--slow-rank", "1"],
        &["--trigger", "quorum:5"],
    ] {
        let mut args = base.to_vec();
        args.extend_from_slice(bad);
        let out = sim(&args);
        assert!(!out.status.success(), "{bad:?} was accepted");
        assert!(!out.stderr.is_empty());
    }
    // SFB layers need every worker's factors: refused with the reason.
    let out = sim(&[
        "--model",
        "vgg19-mini",
        "--workers",
        "4",
        "--servers",
        "2",
        "--sync",
        "full",
        "--trigger",
        "async",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("SFB"));
}

/// Poseidon's Fig. 10 from the command line: under `--sync adam` the server
/// holding fc6 moves every worker's factors in and the full matrix out to
/// every worker, so one node carries many times another's traffic; the
/// sharded PS (`wfbp`) keeps the nodes even, and HybComm moves less than
/// Adam on its busiest node. The per-node loads are in the JSON.
#[test]
fn adam_loads_one_server_and_hybcomm_beats_it() {
    let busiest = |sync: &str| -> (f64, f64, f64) {
        let j = json(&[
            "--model",
            "vgg19",
            "--workers",
            "4",
            "--servers",
            "4",
            "--iters",
            "2",
            "--sync",
            sync,
        ]);
        let load: Vec<f64> = j["host_nic_bytes_per_iter"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h[0].as_f64().unwrap() + h[1].as_f64().unwrap())
            .collect();
        assert_eq!(load.len(), 8, "{j}");
        let max = load.iter().copied().fold(0.0, f64::max);
        let min = load.iter().copied().fold(f64::INFINITY, f64::min);
        (max, max / min, j["throughput_samples_s"].as_f64().unwrap())
    };
    let (adam, adam_spread, adam_tp) = busiest("adam");
    let (_, ps_spread, _) = busiest("wfbp");
    let (hyb, _, hyb_tp) = busiest("hybrid");
    assert!(
        adam_spread > 5.0,
        "adam's busiest node over its least busy: {adam_spread}"
    );
    assert!(ps_spread < 1.5, "the sharded PS: {ps_spread}");
    assert!(
        hyb < adam && hyb_tp > adam_tp,
        "hybcomm {hyb} B, {hyb_tp}/s; adam {adam} B, {adam_tp}/s"
    );
}
