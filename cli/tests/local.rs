//! Nexus's local aggregation end to end (`tidewire train --local-learners L`):
//! real learner processes sharing memory with their node's leader rank, against
//! the flat run of the same learners (`--flat`: every learner a rank).
//!
//! Randomized and seeded (`TIDEWIRE_LOCAL_SEED`, printed): nodes, learners,
//! sync mode, chunk and slice sizes, transport, and whether servers are
//! colocated. Every run verifies bit for bit against the single-process
//! reference; the local-aggregation run and the flat run agree bit for bit on
//! every layer both sync through the PS; and with separate servers each node's
//! NIC carries L times less with local aggregation (the transports' counters).

mod support;

use std::process::Command;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use support::{report, serial, tidewire, Rng, TrainReport};
use tidewire_engine::book::Scheme;

fn train(args: &[String]) -> TrainReport {
    let t = Instant::now();
    let out = tidewire()
        .arg("train")
        .args(["--json", "--model", "vgg19-mini", "--time-scale", "0"])
        .args(args)
        .output()
        .expect("tidewire runs");
    assert!(
        out.status.success(),
        "tidewire train {} failed ({}):\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&out.stdout);
    println!("  train {}: wall {:.1} s", args.join(" "), t.elapsed().as_secs_f64());
    assert_eq!(r.log_warnings.len(), 0, "{:#?}", r.log_warnings);
    r
}

fn seed() -> u64 {
    std::env::var("TIDEWIRE_LOCAL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 % 1_000_000)
}

fn f64s(v: &[u64]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[test]
fn local_aggregation_equals_the_flat_run_and_cuts_each_nic_by_l() {
    let _serial = serial();
    let seed = seed();
    let cases: u64 = std::env::var("TIDEWIRE_LOCAL_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    println!("local learners: seed {seed} (rerun with TIDEWIRE_LOCAL_SEED={seed}), {cases} cases");
    let mut r = Rng(seed);
    for case in 0..cases {
        let nodes = 1 + r.below(3);
        let l = 2 + r.below(3);
        let colocate = r.below(4) == 0;
        let sync = r.pick(&["fifo-ps", "wfbp", "sliced", "p3", "hybrid", "full"]);
        let mut common: Vec<String> = vec![
            "--workers".into(),
            nodes.to_string(),
            "--servers".into(),
            (1 + r.below(3)).to_string(),
            "--iters".into(),
            (2 + r.below(3)).to_string(),
            "--sync".into(),
            sync.into(),
            "--op".into(),
            r.pick(&["sgd", "mean", "sum"]).into(),
            "--chunk-bytes".into(),
            r.pick(&["65536", "262144", "2097152"]).into(),
            "--slice-params".into(),
            r.pick(&["5000", "50000"]).into(),
            "--transport".into(),
            r.pick(&["tcp", "portable"]).into(),
            "--seed".into(),
            (seed + case).to_string(),
            "--local-learners".into(),
            l.to_string(),
            "--verify".into(),
        ];
        if colocate {
            common.push("--colocate".into());
        }
        println!("case {case}: {nodes} nodes x {l} learners, {sync}, colocate {colocate}");
        let local = train(&common);
        let mut flat_args = common.clone();
        flat_args.push("--flat".into());
        let flat = train(&flat_args);
        for run in [&local, &flat] {
            assert_eq!(
                run.verified,
                Some(true),
                "seed {seed} case {case}: {:?}",
                run.mismatched_layers
            );
        }
        // Bitwise the same parameters on every layer both runs sync through the PS.
        let (dl, df) = (&local.digests, &flat.digests);
        let (sl, sf) = (&local.layers, &flat.layers);
        let mut compared = 0;
        for ((a, b), (la, lf)) in dl.iter().zip(df).zip(sl.iter().zip(sf)) {
            if la.scheme == Scheme::Ps && lf.scheme == Scheme::Ps {
                assert_eq!(
                    a, b,
                    "seed {seed} case {case}: layer {} differs from the flat run",
                    la.name
                );
                compared += 1;
            }
        }
        assert!(
            compared > 0,
            "seed {seed} case {case}: no layer went through the PS in both runs"
        );
        // Each node's NIC: L times the bytes in the flat run (separate servers:
        // a node's traffic is its learners' pushes and the broadcasts to them).
        if !colocate && sync != "hybrid" && sync != "full" {
            let (tl, tf) = (f64s(&local.node_tx_bytes), f64s(&flat.node_tx_bytes));
            let (rl, rf) = (f64s(&local.node_rx_bytes), f64s(&flat.node_rx_bytes));
            for n in 0..nodes as usize {
                let (tx, rx) = (tf[n] / tl[n], rf[n] / rl[n]);
                println!("  node {n}: flat/local NIC bytes: sent {tx:.3}x, received {rx:.3}x (L = {l})");
                for (what, x) in [("sent", tx), ("received", rx)] {
                    assert!(
                        (x / l as f64 - 1.0).abs() < 0.02,
                        "seed {seed} case {case}: node {n} {what} {x:.3}x, not L = {l}x"
                    );
                }
            }
        }
    }
}

/// The parameter cache: learners that may read parameters one version old
/// finish, and every learner ends with the node leader's final parameters.
#[test]
fn a_stale_parameter_cache_finishes_and_ends_in_agreement() {
    let _serial = serial();
    let args: Vec<String> =
        "--workers 2 --servers 1 --iters 5 --local-learners 3 --cache-staleness 1 --slow-rank 0 --slow-factor 2"
            .split(' ')
            .map(str::to_string)
            .collect();
    let r = train(&args);
    assert_eq!(r.digests.len(), r.layers.len());
    let bad = tidewire()
        .args(["train", "--local-learners", "2", "--cache-staleness", "1", "--verify"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--cache-staleness 0"));
}

/// `tidewire sim --local-learners L`: in the simulator too, each node's NIC
/// carries L times less with local aggregation than the flat run of the same
/// learners (separate servers, every layer through the PS), and the report
/// has the speedup over the flat run and the dissection.
#[test]
fn sim_local_learners_cut_each_nic_by_l() {
    for (l, workers, sync) in [(2, 3, "wfbp"), (4, 2, "p3"), (3, 4, "fifo-ps")] {
        let out = tidewire()
            .args([
                "sim",
                "--model",
                "vgg19-mini",
                "--servers",
                "2",
                "--iters",
                "3",
                "--json",
            ])
            .args([
                "--workers",
                &workers.to_string(),
                "--local-learners",
                &l.to_string(),
                "--sync",
                sync,
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        let f = &r["flat_run"];
        assert_eq!(f["workers"], workers * l, "{r:#}");
        assert_eq!(f["flat"], true);
        for i in 0..2 {
            let x =
                f["node_nic_bytes_per_iter"][i].as_f64().unwrap() / r["node_nic_bytes_per_iter"][i].as_f64().unwrap();
            println!("sim L={l} {sync}: flat/local node NIC bytes [{i}] = {x:.4}");
            assert!((x / l as f64 - 1.0).abs() < 0.01, "L={l} {sync}: {x}");
        }
        assert!(r["speedup_over_flat"].as_f64().unwrap() > 0.0);
        assert!(r["local_agg_s"].as_f64().unwrap() > 0.0 && r["fanout_s"].as_f64().unwrap() > 0.0);
        assert_eq!(f["local_agg_s"].as_f64(), Some(0.0));
    }
}

/// The children of process `pid`, in the order it started them (Linux).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect()
}

/// Kills child `pick` of a running `train --local-learners 3` (ranks first,
/// then the learners) and returns the launcher's stderr.
fn kill_one(pick: impl Fn(&[u32]) -> u32) -> String {
    let c = tidewire()
        .args([
            "train",
            "--model",
            "vgg19-mini",
            "--workers",
            "1",
            "--servers",
            "1",
            "--local-learners",
            "3",
        ])
        .args(["--iters", "100000", "--time-scale", "0.2", "--timeout-s", "3"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    // Rank 0 and 1, then learners 1 and 2 of node 0, once they train.
    let kids = loop {
        let k = children(c.id());
        if k.len() == 4 || t.elapsed().as_secs() > 30 {
            break k;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(kids.len(), 4, "the launcher started {kids:?}");
    std::thread::sleep(std::time::Duration::from_secs(2));
    let victim = pick(&kids);
    assert!(Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap()
        .success());
    let out = c.wait_with_output().unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A learner that dies: its leader's wait for its gradient ends with a
/// timeout naming it, and the job fails. A leader that dies: its learners
/// see it is gone (its process id is in the shared header), without waiting
/// for their timeout.
#[test]
fn a_dead_learner_or_leader_fails_the_node_clearly() {
    let _serial = serial();
    let err = kill_one(|k| k[3]);
    assert!(err.contains("local learner 2 of node 0 exited with signal: 9"), "{err}");
    assert!(err.contains("waiting for local learner 2 to hand in layer"), "{err}");
    let err = kill_one(|k| k[0]);
    assert!(err.contains("rank 0 exited with signal: 9"), "{err}");
    assert!(err.contains("the node's leader (process"), "{err}");
    assert!(err.contains("is gone"), "{err}");
}
