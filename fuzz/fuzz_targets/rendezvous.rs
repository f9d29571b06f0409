//! The rendezvous lines (src/rendezvous.rs): rank 0 parses every rank's join
//! line and checks its configuration; every rank parses rank 0's reply and
//! turns an error in it into the error `join` returns. Anyone who reaches the
//! port can send the outer (signed) lines, so the real checks of those run on
//! every input too; the inner lines are reached by signing the input with the
//! job secret.
//!
//! Input: one line, as `read_line` hands it over (any bytes; invalid UTF-8 is
//! what `read_line` refuses, so it is skipped here). Invariants:
//! - parsing, checking and rendering errors never panic;
//! - a line the fuzzer did not sign is refused; the input signed with the secret
//!   is accepted exactly when it parses (see `fuzz_parse_line`);
//! - what parses re-encodes to a line that parses again and re-encodes to the
//!   same text (a fixed point after one normalisation).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tidewire::rendezvous::fuzz_parse_line;
use tidewire_engine::agree::JobConfig;
use tidewire_engine::book::{Book, BookConfig, Cluster, LayerKind, LayerSpec};
use tidewire_engine::{ApplyOp, SchedConfig};
use tidewire_transport::JobSecret;

fn config() -> &'static JobConfig {
    static C: OnceLock<JobConfig> = OnceLock::new();
    C.get_or_init(|| {
        let book = Book::new(
            Cluster::split(2, 1).expect("cluster"),
            vec![LayerSpec::new("fc", LayerKind::Fc, 10, 20)],
            BookConfig::default(),
        )
        .expect("book");
        JobConfig::new(&book, &SchedConfig::default(), ApplyOp::Mean, "tcp")
    })
}

fn secret() -> &'static JobSecret {
    static S: OnceLock<JobSecret> = OnceLock::new();
    S.get_or_init(|| JobSecret::new(b"fuzz job secret".to_vec()))
}

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else { return };
    let (join, reply) = fuzz_parse_line(line, config(), secret());
    if let Some(j) = join {
        let (again, _) = fuzz_parse_line(&j, config(), secret());
        assert_eq!(
            again.as_deref(),
            Some(j.as_str()),
            "a re-encoded join does not parse to itself"
        );
    }
    if let Some(r) = reply {
        let (_, again) = fuzz_parse_line(&r, config(), secret());
        assert_eq!(
            again.as_deref(),
            Some(r.as_str()),
            "a re-encoded reply does not parse to itself"
        );
    }
});
