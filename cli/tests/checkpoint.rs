//! Checkpoints, resume and rollback end to end (`tidewire train
//! --checkpoint-dir`, `--resume`, `--fault-kill`): real rank processes killed
//! with SIGKILL, the launcher rolling every rank back to the newest complete
//! checkpoint, and the final parameters compared bit for bit with an
//! uninterrupted run's (and with the single-process reference, `--verify`).
//!
//! The randomized test draws clusters, sync modes, consistency, checkpoint
//! periods and faults from a seed (`TIDEWIRE_CKPT_SEED`, printed).

mod support;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Instant;

use support::{report, s, serial, tidewire, Rng, TrainReport};

fn run(args: &[String]) -> (Output, f64) {
    let t = Instant::now();
    let mut c = tidewire();
    c.args(["train", "--json"]);
    if !args.iter().any(|a| a == "--model") {
        c.args(["--model", "vgg19-mini"]);
    }
    let out = c.args(args).output().expect("tidewire runs");
    (out, t.elapsed().as_secs_f64())
}

fn train(args: &[String]) -> TrainReport {
    let (out, wall) = run(args);
    assert!(
        out.status.success(),
        "tidewire train {} failed ({}):\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    println!("  train {}: wall {wall:.1} s", args.join(" "));
    report(&out.stdout)
}

fn fails(args: &[String]) -> String {
    let (out, _) = run(args);
    assert!(!out.status.success(), "tidewire train {} succeeded", args.join(" "));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn tmp(tag: &str) -> PathBuf {
    support::tmp(&format!("ckpt-{tag}"))
}

fn steps(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The acceptance test: in a 20-iteration `--verify --checkpoint-every 4`
/// run, a worker and then a server are killed with SIGKILL at iteration 5.
/// The job rolls back twice to iteration 4, completes, and its parameters
/// equal the uninterrupted run's bit for bit.
#[test]
fn a_killed_worker_and_then_server_roll_back_to_the_uninterrupted_result() {
    let _g = serial();
    let base = s(&["--iters", "20", "--workers", "2", "--servers", "1", "--verify"]);
    let plain = train(&base);
    assert_eq!(plain.verified, Some(true));
    let dir = tmp("acceptance");
    let mut a = base.clone();
    a.extend(s(&[
        "--checkpoint-dir",
        dir.to_str().unwrap(),
        "--checkpoint-every",
        "4",
    ]));
    a.extend(s(&["--fault-kill", "1@5", "--fault-kill", "2@5"]));
    let r = train(&a);
    let restarts = &r.restarts;
    assert_eq!(restarts.len(), 2, "{restarts:#?}");
    for (x, rank) in restarts.iter().zip([1, 2]) {
        assert_eq!(x.resumed_from, 4, "{x:#?}");
        let cause = &x.cause;
        assert!(
            cause.contains(&format!("rank {rank} was killed (SIGKILL) at iteration ")),
            "{cause}"
        );
        println!(
            "  rollback: {} (resumed from 4 in {:.2} s)",
            cause.lines().next().unwrap(),
            x.recovery_s
        );
    }
    assert_eq!(r.resumed_from, Some(4));
    assert_eq!(r.verified, Some(true));
    assert_eq!(r.digests, plain.digests, "the rolled-back run's parameters differ");
    // The run's last iterations were checkpointed and the oldest removed (keep 2).
    assert_eq!(steps(&dir), vec!["step-00000016", "step-00000020"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The launcher restarts its ranks from the file it was started from, even
/// once that path is gone: its binary is removed (as a rebuild's re-link
/// does) after the first checkpoint, and a rank killed later is restarted.
/// (With the path, the restart failed: "cannot start rank 1: No such file or
/// directory".)
#[test]
fn a_restart_after_the_binary_was_replaced_starts_the_same_build() {
    let _g = serial();
    let dir = tmp("replaced");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("tidewire-copy");
    std::fs::copy(env!("CARGO_BIN_EXE_tidewire"), &exe).unwrap();
    let ckpt = dir.join("ckpt");
    // 20 iterations: the kill waits for the checkpoint due by iteration 8,
    // which a loaded machine may finish iterations later.
    let child = std::process::Command::new(&exe)
        .args([
            "train",
            "--json",
            "--model",
            "vgg19-mini",
            "--workers",
            "2",
            "--servers",
            "1",
            "--iters",
            "20",
        ])
        .args([
            "--verify",
            "--checkpoint-every",
            "4",
            "--fault-kill",
            "1@8",
            "--checkpoint-dir",
        ])
        .arg(&ckpt)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !ckpt.join("step-00000004").exists() && t.elapsed().as_secs() < 120 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        ckpt.join("step-00000004").exists(),
        "no checkpoint at iteration 4 in 120 s"
    );
    std::fs::remove_file(&exe).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "train failed after its binary was removed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&out.stdout);
    assert_eq!(r.restarts.len(), 1, "{:#?}", r.restarts);
    assert_eq!(r.verified, Some(true));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run stopped at iteration 12 and resumed to 20 (another command, as a
/// user would) gives the 20-iteration run's parameters; checkpoints of
/// another run, a damaged file and a full directory are refused with the reason.
#[test]
fn resume_goes_on_bitwise_and_refuses_what_does_not_fit() {
    let _g = serial();
    let dir = tmp("resume");
    let d = dir.to_str().unwrap().to_string();
    let cluster = s(&["--workers", "3", "--colocate", "--sync", "p3", "--chunk-bytes", "65536"]);
    let mut plain = cluster.clone();
    plain.extend(s(&["--iters", "20", "--verify"]));
    let plain = train(&plain);
    let mut first = cluster.clone();
    first.extend(s(&["--iters", "12", "--checkpoint-dir", &d, "--checkpoint-every", "6"]));
    let r = train(&first);
    assert!(r.restarts.is_empty());
    assert_eq!(steps(&dir), vec!["step-00000006", "step-00000012"]);

    // The same command again would overwrite: refused, naming the way on.
    let why = fails(&first);
    assert!(
        why.contains("already holds checkpoints") && why.contains("--resume"),
        "{why}"
    );

    let mut again = cluster.clone();
    again.extend(s(&[
        "--iters",
        "20",
        "--verify",
        "--checkpoint-dir",
        &d,
        "--checkpoint-every",
        "6",
    ]));
    again.extend(s(&["--resume", &d]));
    let r = train(&again);
    assert_eq!(r.resumed_from, Some(12));
    assert_eq!(r.verified, Some(true));
    assert_eq!(r.digests, plain.digests);

    // Another seed is another run: the trainer's state saved with the checkpoint says so.
    let mut other = cluster.clone();
    other.extend(s(&[
        "--iters",
        "24",
        "--seed",
        "7",
        "--resume",
        &format!("{d}/step-00000018"),
    ]));
    let why = fails(&other);
    assert!(why.contains("another run"), "{why}");
    // Another model's checkpoint.
    let why = fails(&s(&[
        "--model",
        "alexnet",
        "--iters",
        "30",
        "--colocate",
        "--resume",
        &d,
    ]));
    assert!(why.contains("another model") || why.contains("shape"), "{why}");
    // A damaged model file: a clear error naming it, not a panic.
    let model = dir.join("step-00000018/model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let mut damaged = cluster.clone();
    damaged.extend(s(&["--iters", "24", "--resume", &format!("{d}/step-00000018")]));
    let why = fails(&damaged);
    assert!(why.contains("model.safetensors") && !why.contains("panicked"), "{why}");
    // SSP and the other aggregation triggers are refused with checkpoints.
    let why = fails(&s(&[
        "--iters",
        "8",
        "--consistency",
        "ssp:1",
        "--checkpoint-dir",
        &format!("{d}-x"),
    ]));
    assert!(why.contains("needs BSP"), "{why}");
    let why = fails(&s(&[
        "--iters",
        "8",
        "--sync",
        "p3",
        "--trigger",
        "quorum:1",
        "--checkpoint-dir",
        &format!("{d}-y"),
    ]));
    assert!(why.contains("--trigger all"), "{why}");
    // Nothing left to run.
    let mut done = cluster.clone();
    done.extend(s(&["--iters", "18", "--resume", &format!("{d}/step-00000018")]));
    let why = fails(&done);
    assert!(why.contains("raise --iters"), "{why}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Random clusters, modes, periods and kills (any rank, any iteration): the
/// runs must end bitwise equal to the single-process reference. Every rollback resumes from the newest checkpoint due by
/// the kill.
#[test]
fn random_faults_roll_back_and_complete() {
    let _g = serial();
    let seed = support::testkit::seed("TIDEWIRE_CKPT_SEED");
    let cases: u64 = std::env::var("TIDEWIRE_CKPT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    println!("{cases} cases");
    let mut rng = Rng(seed);
    for case in 0..cases {
        let workers = 1 + rng.below(3);
        let colocate = rng.below(3) == 0;
        let servers = if colocate { 0 } else { 1 + rng.below(2) };
        let world = workers + servers;
        let iters = 8 + rng.below(10);
        let every = 2 + rng.below(4);
        // Checkpoints need BSP (refused under SSP: see the refusals test).
        let ssp = false;
        let sync = rng.pick(&["full", "p3", "wfbp", "hybrid", "fifo-ps"]);
        let op = rng.pick(&["sgd", "sgd", "mean"]);
        let dir = tmp(&format!("random-{case}"));
        let mut a = s(&[
            "--workers",
            &workers.to_string(),
            "--iters",
            &iters.to_string(),
            "--sync",
            sync,
        ]);
        a.extend(s(&["--op", op, "--time-scale", rng.pick(&["0.5", "1"])]));
        a.extend(s(&["--chunk-bytes", rng.pick(&["65536", "262144", "2097152"])]));
        if colocate {
            a.push("--colocate".into());
        } else {
            a.extend(s(&["--servers", &servers.to_string()]));
        }
        if ssp {
            a.extend(s(&["--consistency", "ssp:1"]));
        } else {
            a.push("--verify".into());
        }
        a.extend(s(&[
            "--checkpoint-dir",
            dir.to_str().unwrap(),
            "--checkpoint-every",
            &every.to_string(),
        ]));
        let kills = 1 + rng.below(2);
        let mut want = Vec::new();
        for i in 0..kills {
            let rank = rng.below(world);
            // The first before the second-to-last iteration, so that it surely fires.
            let at = 1 + rng.below(if i == 0 { iters - 2 } else { iters - 1 });
            a.extend(s(&["--fault-kill", &format!("{rank}@{at}")]));
            want.push((rank, at));
        }
        println!("case {case}: {}", a.join(" "));
        let r = train(&a);
        let restarts = &r.restarts;
        // The first fault comes before the last iteration, so it fires; a later
        // one may find its rank finished (then nothing is killed).
        assert!((1..=want.len()).contains(&restarts.len()), "case {case}: {restarts:#?}");
        let mut floor = 0;
        for (x, (rank, at)) in restarts.iter().zip(&want) {
            let cause = &x.cause;
            assert!(
                cause.contains(&format!("rank {rank} was killed")),
                "case {case}: {cause}"
            );
            // At least the newest checkpoint due by the kill's iteration, and
            // never before the checkpoint the attempt resumed from.
            let from = x.resumed_from;
            floor = floor.max(at / every * every);
            assert!(
                from >= floor && from % every == 0 && from < iters,
                "case {case}: {x:#?}"
            );
            floor = from;
        }
        if !ssp {
            assert_eq!(r.verified, Some(true), "case {case}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
