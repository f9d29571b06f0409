//! `include/tidewire.h` is what cbindgen makes of the sources today.
//!
//! The header is checked in (C programs build against it without cbindgen);
//! this test regenerates it with `cbindgen.toml` and fails on any difference.
//! `TIDEWIRE_BLESS=1 cargo test -p tidewire-capi --test header` rewrites it.

use std::path::Path;

#[test]
fn header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("capi/cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen parses capi/src");
    let mut fresh = Vec::new();
    bindings.write(&mut fresh);
    let fresh = String::from_utf8(fresh).expect("the header is UTF-8");
    let path = dir.join("include/tidewire.h");
    if std::env::var_os("TIDEWIRE_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("write include/tidewire.h");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != fresh {
        let line = checked_in
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| checked_in.lines().count().min(fresh.lines().count()));
        panic!(
            "capi/include/tidewire.h is out of date (first difference at line {}): regenerate it with \
             `TIDEWIRE_BLESS=1 cargo test -p tidewire-capi --test header` and commit it",
            line + 1
        );
    }
}
