//! What the command's tests share (each test file has `mod support;`): the
//! command, `tidewire train`'s JSON report read into [`TrainReport`] (typed
//! fields, not string lookups), the workspace's one seeded RNG, one cluster
//! at a time, and scratch directories.

// Each test file uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
pub use tidewire_cli::train::TrainReport;
#[allow(unused_imports)] // Not every test file draws.
pub use tidewire_engine::testkit::{self, Rng};

/// Tests that start clusters of processes take this first: one cluster at a
/// time (within one test file), so that a 2-core machine does not turn their
/// timeouts into flakes.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The `tidewire` binary under test.
pub fn tidewire() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tidewire"))
}

/// `tidewire train --json`'s report on `stdout`, typed. It must hold every
/// field of the JSON: serialized again, it equals what was read.
#[track_caller]
pub fn report(stdout: &[u8]) -> TrainReport {
    let v: Value = serde_json::from_slice(stdout).expect("JSON on stdout");
    let r: TrainReport =
        serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("not a TrainReport ({e}):\n{v:#}"));
    assert_eq!(
        serde_json::to_value(&r).expect("serializable"),
        v,
        "the typed report differs from the JSON it was read from"
    );
    r
}

/// `args` as owned strings.
pub fn s(args: &[&str]) -> Vec<String> {
    args.iter().map(|x| x.to_string()).collect()
}

/// A fresh path in the temporary directory for this process and `tag` (removed
/// if it was there).
pub fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tidewire-cli-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}
