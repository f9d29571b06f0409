//! Aggregation triggers against a straggler, end to end (`tidewire train
//! --trigger ... --slow-rank 1 --slow-factor 5`): real rank processes, one
//! worker computing five times slower. Under BSP (`all`) every worker goes at
//! the straggler's pace; with a quorum of P1 − 1, the timeout trigger or
//! async, the other workers keep at least 0.9× their pace without a
//! straggler, and the servers say which contributions they dropped or folded.
//!
//! Compute is slept (`--time-scale 4`: 80 ms per iteration of vgg19-mini),
//! so the paces compared do not depend on the machine's load.

use std::process::Command;

use serde_json::Value;

fn train(trigger: &str, straggler: bool) -> Value {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tidewire"));
    c.args([
        "train",
        "--json",
        "--model",
        "vgg19-mini",
        "--workers",
        "4",
        "--servers",
        "1",
    ]);
    c.args([
        "--sync",
        "p3",
        "--iters",
        "20",
        "--time-scale",
        "4",
        "--trigger",
        trigger,
    ]);
    if straggler {
        c.args(["--slow-rank", "1", "--slow-factor", "5"]);
    }
    let out = c.output().expect("tidewire runs");
    assert!(
        out.status.success(),
        "--trigger {trigger} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// The mean iteration of the workers other than rank 1 (the straggler).
fn others(r: &Value) -> f64 {
    let w: Vec<f64> = r["worker_iteration_s"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(w.len(), 4);
    (w[0] + w[2] + w[3]) / 3.0
}

#[test]
fn quorum_timeout_and_async_keep_the_pace_bsp_takes_the_stragglers() {
    let base = train("all", false);
    let pace = others(&base);
    let bsp = train("all", true);
    println!(
        "no straggler: {pace:.4} s per iteration; BSP with one at 5x: {:.4} s ({:.3}x)",
        others(&bsp),
        pace / others(&bsp)
    );
    assert!(others(&bsp) > 2.0 * pace, "BSP should wait for the straggler");
    assert_eq!(bsp["dropped"], 0);
    for t in ["quorum:3", "timeout:5", "async"] {
        let r = train(t, true);
        let ratio = pace / others(&r);
        println!(
            "{t}: {:.4} s per iteration, {ratio:.3}x the pace without a straggler; straggler {:.4} s; \
             {} partial applies, {} dropped, {} folded",
            others(&r),
            r["worker_iteration_s"][1].as_f64().unwrap(),
            r["partial_applies"],
            r["dropped"],
            r["late_folded"]
        );
        assert!(ratio >= 0.9, "{t}: {ratio:.3}x the pace without a straggler");
        assert!(
            r["partial_applies"].as_u64().unwrap() > 0,
            "{t}: no round went without the straggler"
        );
        if t == "async" {
            assert!(r["late_folded"].as_u64().unwrap() > 0, "{t}: nothing folded");
            assert_eq!(r["dropped"], 0, "async folds, never drops");
        } else {
            assert!(
                r["dropped"].as_u64().unwrap() > 0,
                "{t}: the straggler's late gradients were not dropped"
            );
        }
    }
    // The refusals say why.
    let out = Command::new(env!("CARGO_BIN_EXE_tidewire"))
        .args([
            "train",
            "--model",
            "vgg19-mini",
            "--iters",
            "2",
            "--trigger",
            "quorum:1",
        ])
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && why.contains("through the PS"), "{why}");
    let out = Command::new(env!("CARGO_BIN_EXE_tidewire"))
        .args([
            "train",
            "--model",
            "vgg19-mini",
            "--iters",
            "2",
            "--sync",
            "p3",
            "--trigger",
            "quorum:x",
        ])
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && why.contains("quorum:K"), "{why}");
}
