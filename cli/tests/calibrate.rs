//! `tidewire calibrate` and HybComm in seconds end to end: the profile a
//! new user writes, `train --profile` and `sim --profile` reading it, the
//! decision following the rates, and `--verify` holding either way.

mod support;

use std::process::Output;

use serde_json::Value;
use support::{serial, tidewire, TrainReport};
use tidewire_engine::book::{LayerKind, Scheme};

fn succeeded(out: &Output) {
    assert!(
        out.status.success(),
        "tidewire failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn json(out: &Output) -> Value {
    succeeded(out);
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// The FC layers' names and schemes.
fn schemes(r: &TrainReport) -> Vec<(String, Scheme)> {
    r.layers
        .iter()
        .filter(|l| l.kind == LayerKind::Fc)
        .map(|l| (l.name.clone(), l.scheme))
        .collect()
}

fn train(extra: &[&str]) -> TrainReport {
    let out = tidewire()
        .args(["train", "--model", "vgg19-mini", "--workers", "3", "--servers", "1"])
        .args([
            "--batch",
            "64",
            "--iters",
            "2",
            "--time-scale",
            "0.05",
            "--verify",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    succeeded(&out);
    support::report(&out.stdout)
}

#[test]
fn a_profile_is_written_read_and_refused_when_bad() {
    let _s = serial();
    let dir = support::tmp("calibrate");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("profile.json");
    let p = json(
        &tidewire()
            .args(["calibrate", "--ms", "20", "--json", "--out"])
            .arg(&path)
            .output()
            .unwrap(),
    );
    for k in ["link_bytes_per_s", "msg_s", "sum_bytes_per_s", "gemm_flop_per_s"] {
        let v = p["rates"][k].as_f64().unwrap_or(f64::NAN);
        assert!(v.is_finite() && v >= 0.0, "{k} = {v}");
    }
    assert!(p["cores"].as_u64().unwrap() >= 1);
    assert_eq!(p["link"], "loopback");
    let written: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(written, p, "--out writes what --json prints");

    // The GEMM at every batch, rising in K.
    let curve = p["gemm_by_k"].as_array().expect("gemm_by_k");
    let ks: Vec<f64> = curve.iter().map(|kf| kf[0].as_f64().unwrap()).collect();
    assert_eq!(ks, [16.0, 32.0, 64.0, 128.0, 256.0]);

    // train reads it: the report carries the rates, shared among the 4 ranks,
    // its GEMM the curve's at the run's batch (64, a measured point).
    let r = train(&["--profile", path.to_str().unwrap()]);
    assert_eq!(r.verified, Some(true));
    let cores = p["cores"].as_f64().unwrap();
    let share = (cores / 4.0).min(1.0);
    let gemm = r.rates.expect("rates").gemm_flop_per_s;
    let want = curve[2][1].as_f64().unwrap() * share;
    assert!((gemm - want).abs() <= 1e-6 * want, "{gemm} vs {want}");
    for l in &r.layers {
        assert_eq!(l.cost_s.is_some(), l.kind == LayerKind::Fc, "{l:?}");
    }

    // sim reads it too, and says so.
    let s = json(
        &tidewire()
            .args([
                "sim",
                "--model",
                "vgg19-mini",
                "--workers",
                "3",
                "--servers",
                "1",
                "--iters",
                "2",
            ])
            .args(["--json", "--profile"])
            .arg(&path)
            .output()
            .unwrap(),
    );
    assert!(s["cpu"].as_str().unwrap().contains("profile"), "{}", s["cpu"]);

    // Bad input: a clear error naming the flag, and nothing started.
    std::fs::write(dir.join("bad.json"), "{\"cores\": 2}").unwrap();
    for (args, says) in [
        (vec!["train", "--profile", "/nonexistent/profile.json"], "--profile"),
        (
            vec!["train", "--profile", dir.join("bad.json").to_str().unwrap()],
            "not a tidewire calibrate profile",
        ),
        (vec!["train", "--cost-model", "flops"], "--cost-model"),
        (
            vec!["train", "--cost-model", "bytes", "--profile", path.to_str().unwrap()],
            "--profile",
        ),
        (vec!["sim", "--profile", "/nonexistent/profile.json"], "--profile"),
        (vec!["calibrate", "--ms", "0"], "--ms"),
        (vec!["calibrate", "--rounds", "0"], "--rounds"),
    ] {
        let out = tidewire().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hybcomm_follows_the_rates_and_verifies_either_way() {
    let _s = serial();
    // A slow CPU's GEMM beside a fast link: rebuilding the peers' gradients
    // costs more than moving them, so every FC layer goes through the PS.
    let cpu = r#"{"link_bytes_per_s":3e9,"msg_s":1e-5,"sum_bytes_per_s":3e9,"gemm_flop_per_s":1e8}"#;
    let r = train(&["--rates", cpu]);
    assert_eq!(r.verified, Some(true));
    assert!(schemes(&r).iter().all(|(_, s)| *s == Scheme::Ps), "{:?}", schemes(&r));
    for l in r.layers.iter().filter(|l| l.kind == LayerKind::Fc) {
        let (ps, sfb) = l.cost_s.unwrap();
        assert!(ps < sfb, "{l:?}");
    }
    // A GPU's GEMM on a 100 Mbit/s link: SFB, as Poseidon's bytes say.
    let gpu = r#"{"link_bytes_per_s":1.25e7,"msg_s":1e-5,"sum_bytes_per_s":1e11,"gemm_flop_per_s":5e13}"#;
    let g = train(&["--rates", gpu]);
    assert_eq!(g.verified, Some(true));
    let b = train(&["--cost-model", "bytes"]);
    assert!(b.rates.is_none());
    assert_eq!(schemes(&g), schemes(&b));
    assert!(schemes(&g).iter().all(|(_, s)| *s == Scheme::Sfb), "{:?}", schemes(&g));
    // Rates out of range are refused before anything starts.
    let out = tidewire()
        .args([
            "train",
            "--rates",
            r#"{"link_bytes_per_s":0,"msg_s":0,"sum_bytes_per_s":1,"gemm_flop_per_s":1}"#,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("link_bytes_per_s"));
}
