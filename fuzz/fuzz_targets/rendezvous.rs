//! The rendezvous lines (src/rendezvous.rs): rank 0 parses every rank's join
//! line and checks its configuration; every rank parses rank 0's reply and
//! turns an error in it into the error `join` returns. The rendezvous is
//! unauthenticated, so anyone who reaches the port can send these bytes.
//!
//! Input: one line, as `read_line` hands it over (any bytes; invalid UTF-8 is
//! what `read_line` refuses, so it is skipped here). Invariants:
//! - parsing, checking and rendering errors never panic;
//! - what parses re-encodes to a line that parses again and re-encodes to the
//!   same text (a fixed point after one normalisation).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tidewire::rendezvous::fuzz_parse_line;
use tidewire_engine::agree::JobConfig;
use tidewire_engine::book::{Book, BookConfig, Cluster, LayerKind, LayerSpec};
use tidewire_engine::{ApplyOp, SchedConfig};

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

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else { return };
    let (join, reply) = fuzz_parse_line(line, config());
    if let Some(j) = join {
        let (again, _) = fuzz_parse_line(&j, config());
        assert_eq!(
            again.as_deref(),
            Some(j.as_str()),
            "a re-encoded join does not parse to itself"
        );
    }
    if let Some(r) = reply {
        let (_, again) = fuzz_parse_line(&r, config());
        assert_eq!(
            again.as_deref(),
            Some(r.as_str()),
            "a re-encoded reply does not parse to itself"
        );
    }
});
