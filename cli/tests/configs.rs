//! Ordinary configurations of `tidewire train` that used to crash (the
//! driver's protocol ran into the transport's outstanding bound and message
//! cap, and colocated SSP ranks left while their server half was still
//! needed), and the other settings a new user reaches for: every sync mode,
//! a tiny credit window, small slices, and a transport whose limits are
//! lowered. Each run must exit 0, verify bit for bit where it is BSP with
//! `--verify`, and log no WARN or ERROR line.

mod support;

use std::time::Instant;

use support::{report, serial, tidewire, TrainReport};
use tidewire_engine::book::Scheme;

fn train(args: &[&str]) -> TrainReport {
    let _serial = serial();
    let t = Instant::now();
    let out = tidewire()
        .arg("train")
        .args(["--time-scale", "0.05", "--json"])
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
    println!(
        "train {}: iteration {:.3} s, verified {:?}, wall {:.1} s",
        args.join(" "),
        r.iteration_s,
        r.verified,
        t.elapsed().as_secs_f64()
    );
    assert_eq!(
        r.log_warnings.len(),
        0,
        "train {}: a healthy run logs no WARN or ERROR: {:#?}",
        args.join(" "),
        r.log_warnings
    );
    if args.contains(&"--verify") {
        assert_eq!(
            r.verified,
            Some(true),
            "train {}: layers {:?}",
            args.join(" "),
            r.mismatched_layers
        );
    }
    assert!(r.throughput_samples_s > 0.0);
    r
}

#[test]
fn runs_that_crashed_now_finish() {
    for run in [
        &["--model", "vgg19", "--workers", "2", "--servers", "1"][..],
        &["--model", "resnet-152", "--workers", "2", "--servers", "1"],
        &["--model", "vgg19-22k", "--workers", "2", "--servers", "1"],
        &["--model", "vgg19", "--workers", "8", "--servers", "1"],
        &[
            "--model",
            "resnet-50",
            "--workers",
            "4",
            "--servers",
            "2",
            "--chunk-bytes",
            "65536",
            "--verify",
        ],
        // fc6's factors at K = 256 are 29.9 MB, over the 16 MiB message cap: split.
        &["--model", "vgg19", "--workers", "2", "--servers", "2", "--batch", "256"],
        // Ranks that finish first stay until every peer that needs them is done.
        &[
            "--model",
            "alexnet",
            "--workers",
            "4",
            "--colocate",
            "--consistency",
            "ssp:2",
        ],
    ] {
        let mut a = vec!["--iters", "3"];
        a.extend_from_slice(run);
        train(&a);
    }
}

#[test]
fn every_sync_mode_verifies_with_three_workers_and_three_servers() {
    for sync in ["fifo-ps", "wfbp", "hybrid", "sliced", "p3", "full"] {
        train(&[
            "--iters",
            "2",
            "--workers",
            "3",
            "--servers",
            "3",
            "--sync",
            sync,
            "--verify",
        ]);
    }
}

#[test]
fn a_tiny_window_small_slices_and_lowered_transport_limits() {
    train(&["--iters", "2", "--credit-bytes", "4096"]);
    train(&["--iters", "2", "--slice-params", "1000", "--sync", "p3", "--verify"]);
    // At most 4 requests in flight per connection and 64 KiB messages: fc6's
    // 3.7 MB factor blocks go as 57 fragments, and everything queues.
    let r = train(&[
        "--iters",
        "2",
        "--workers",
        "2",
        "--servers",
        "2",
        "--max-outstanding",
        "4",
        "--max-message-bytes",
        "65536",
        // Poseidon's bytes, whatever this machine's rates: fc6 goes by SFB.
        "--cost-model",
        "bytes",
        "--verify",
    ]);
    assert!(
        r.layers.iter().any(|l| l.scheme == Scheme::Sfb),
        "the run must send factor blocks to exercise the message cap"
    );
    assert!(r.max_outstanding <= 4, "{}", r.max_outstanding);
    assert!(r.max_message_bytes <= 65536, "{}", r.max_message_bytes);
}

#[test]
fn factor_blocks_split_at_any_message_cap_verify() {
    // vgg19-mini's fc6 factor block is 466944 bytes (U 65536, V 401408). At
    // 409600 it goes as two messages, U and V, each read in place by the
    // receivers; at 1001, a cap that is no multiple of 4, as 66 + 402 fragments
    // of whole f32s.
    for cap in ["409600", "1001"] {
        let r = train(&[
            "--model",
            "vgg19-mini",
            "--iters",
            "2",
            "--workers",
            "3",
            "--servers",
            "1",
            "--max-message-bytes",
            cap,
            "--cost-model",
            "bytes",
            "--verify",
        ]);
        assert!(
            r.layers.iter().any(|l| l.scheme == Scheme::Sfb),
            "the run must send factor blocks"
        );
        let max = r.max_message_bytes;
        assert!(max <= cap.parse().unwrap(), "{max}");
    }
}
