//! What the fuzz targets found outside fuzz/, as regression tests (see
//! fuzz/RESULTS.md). Both findings are fixed: auth.rs keys its MACs with SHA-256
//! of the secret and its length, and `Dest::encode` refuses fields wider than
//! perftest's format. Run with `cargo test --release --manifest-path
//! fuzz/Cargo.toml --test findings`; the workspace's tests hold the same checks
//! (transport/src/auth.rs, bench/src/perf/oob.rs), and those run in CI.
use tidewire_bench::perf::oob::Dest;
use tidewire_transport::auth::{prove, verify, Role, Transcript};
use tidewire_transport::JobSecret;

fn transcript() -> Transcript {
    Transcript {
        job_id: 7,
        client_rank: 1,
        server_rank: 0,
        client_nonce: [1; 32],
        server_nonce: [2; 32],
        token: 99,
    }
}

/// handshake target (input in fuzz/RESULTS.md): HMAC pads
/// a key shorter than its 64-byte block with zeros, so two job secrets that differ
/// only by trailing NUL bytes are one key, and a peer holding either passes the
/// other's challenge (likewise a secret over 64 bytes and its SHA-256).
#[test]
fn secrets_differing_by_trailing_nuls_are_different_keys() {
    let t = transcript();
    for (a, b) in [(&b""[..], &b"\0"[..]), (b"job secret", b"job secret\0\0")] {
        let mac = prove(&JobSecret::new(a.to_vec()), Role::Server, &t);
        assert!(
            !verify(&JobSecret::new(b.to_vec()), Role::Server, &t, &mac),
            "secret {b:?} verifies a proof made with {a:?}"
        );
    }
}

/// perf_oob target: a Dest whose fields are wider than perftest's format (QPN or PSN
/// of 2^24 and over, more than 0xffff outstanding reads) encodes into more than the
/// fixed message size, and `encode` cuts it: the peer then parses another SRQN.
#[test]
fn an_out_of_range_dest_is_not_silently_truncated() {
    let d = Dest {
        qpn: 1 << 24,
        psn: 1 << 24,
        srqn: 0x1234_5678,
        ..Default::default()
    };
    // Refused with an error, not cut.
    assert!(d.encode(false).is_err());
    assert!(d.encode(true).is_err());
}
