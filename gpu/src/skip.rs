//! The skip line of tests that need what this machine lacks (re-exported at the
//! crate root), in its own module so that every module's tests can use it
//! without importing the root.

/// Prints a loud skip line for a test that needs what this machine lacks.
/// It writes to stderr directly, because the test harness captures
/// `eprintln!`, so the line shows in `cargo test` output and in CI logs.
pub fn print_skip(what: &str, why: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {what}: {why}");
}
