//! End-to-end tests of `tidewire train` and `tidewire plan`: real processes
//! on loopback over the io_uring TCP transport.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{serial, tidewire, TrainReport};
use tidewire_cli::train::pipe::ToLauncher;
use tidewire_engine::book::Scheme;

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

/// `tidewire train --json`'s report, typed.
fn report(out: &Output) -> TrainReport {
    succeeded(out);
    support::report(&out.stdout)
}

#[test]
fn plan_reproduces_poseidons_worked_example() {
    let out = tidewire()
        .args([
            "plan",
            "--model",
            "vgg19",
            "--workers",
            "8",
            "--servers",
            "8",
            "--batch",
            "32",
            "--json",
        ])
        .output()
        .unwrap();
    let p = json(&out);
    let fc7 = p["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "fc7")
        .unwrap();
    assert_eq!((fc7["m"].as_u64(), fc7["n"].as_u64()), (Some(4096), Some(4096)));
    assert_eq!(fc7["ps_params_both"].as_u64(), Some(58_720_256), "2MN(P1+P2-2)/P2");
    assert_eq!(fc7["sfb_params"].as_u64(), Some(3_670_016), "2K(P1-1)(M+N)");
    assert_eq!(fc7["scheme"], "sfb");
    for l in p["layers"].as_array().unwrap() {
        if l["kind"] != "fc" {
            assert_eq!(l["scheme"], "ps", "{}", l["name"]);
        }
    }
}

/// The acceptance run: VGG19, N workers and 2 servers, 10 iterations, BSP with
/// deterministic aggregation: every worker's parameters equal the
/// single-process reference bit for bit.
#[test]
fn vgg19_bsp_matches_the_single_process_reference_bitwise() {
    let _serial = serial();
    for n in ["1", "2", "4"] {
        let t = Instant::now();
        let out = tidewire()
            .args([
                "train",
                "--model",
                "vgg19",
                "--workers",
                n,
                "--servers",
                "2",
                "--iters",
                "10",
                "--verify",
                "--json",
            ])
            .output()
            .unwrap();
        let r = report(&out);
        println!(
            "vgg19 workers={n}: verified={:?} iteration {:.3} s, wall {:.1} s",
            r.verified,
            r.iteration_s,
            t.elapsed().as_secs_f64()
        );
        assert_eq!(r.verified, Some(true), "workers={n}: {:?}", r.mismatched_layers);
        assert_eq!(r.per_iteration.len(), 10);
        assert!(r.throughput_samples_s > 0.0);
    }
}

#[test]
fn colocated_and_every_sync_mode_verify() {
    let _serial = serial();
    for sync in ["fifo-ps", "wfbp", "hybrid", "sliced", "p3", "full", "kvstore", "adam"] {
        let out = tidewire()
            .args([
                "train",
                "--model",
                "alexnet",
                "--workers",
                "2",
                "--colocate",
                "--iters",
                "3",
                "--batch",
                "8",
                "--time-scale",
                "0.05",
                "--sync",
                sync,
                "--verify",
                "--json",
            ])
            .output()
            .unwrap();
        let r = report(&out);
        assert_eq!(r.verified, Some(true), "sync {sync}: {:?}", r.mismatched_layers);
    }
}

/// The papers' baselines over real processes: `--sync kvstore` (MXNet's
/// KVStore, P3's baseline: whole layers, fc6 of vgg19-mini split over both
/// servers, notify then pull) and `--sync adam` (Project Adam, Poseidon's:
/// FC layers' factors to the one server holding the layer, which rebuilds
/// the gradient). Each verifies against the single-process reference and
/// ends with exactly the parameters of `--sync wfbp` (the same sums in the
/// same order), split and colocated; the help lists both. With local
/// learners behind each worker, Adam's server sums each node's stacked
/// factors (one Uᵀ·V of K·learners rows per node) where the PS sums the
/// learners' gradients: it verifies, but other roundings than WFBP's.
#[test]
fn the_papers_baselines_train_to_the_parameters_of_wfbp() {
    let _serial = serial();
    let help = tidewire().args(["train", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    assert!(help.contains("kvstore") && help.contains("adam"), "{help}");
    for (layout, modes) in [
        (&["--workers", "3", "--servers", "2"][..], &["kvstore", "adam"][..]),
        (&["--workers", "3", "--colocate"][..], &["kvstore", "adam"][..]),
        (
            &["--workers", "2", "--servers", "1", "--local-learners", "2"][..],
            &["adam"][..],
        ),
    ] {
        let run = |sync: &str| {
            let mut args = vec!["train", "--model", "vgg19-mini"];
            args.extend_from_slice(layout);
            args.extend_from_slice(&[
                "--iters",
                "3",
                "--batch",
                "8",
                "--time-scale",
                "0.05",
                "--sync",
                sync,
                "--verify",
                "--json",
            ]);
            let r = report(&tidewire().args(&args).output().unwrap());
            assert_eq!(r.sync, sync);
            assert_eq!(r.verified, Some(true), "{layout:?} {sync}: {:?}", r.mismatched_layers);
            (r.digests, r.layers, r.factor_bytes_in_place)
        };
        let (wfbp, _, _) = run("wfbp");
        for &mode in modes {
            let (digests, layers, in_place) = run(mode);
            assert_eq!(digests.len(), 19, "{layout:?}");
            if !layout.contains(&"--local-learners") {
                assert_eq!(digests, wfbp, "{layout:?}: {mode} and wfbp end with other parameters");
            }
            if mode == "adam" {
                // Every FC layer (fc6, fc7, fc8) syncs by Adam's strategy.
                let adam: Vec<&str> = layers
                    .iter()
                    .filter(|l| l.scheme == Scheme::Adam)
                    .map(|l| l.name.as_str())
                    .collect();
                assert_eq!(adam, ["fc6", "fc7", "fc8"], "{layout:?}");
                // The layer's server reads the workers' factors where they were received.
                assert!(in_place > 0, "{layout:?}: {in_place:?}");
            }
        }
    }
}

/// A job that mixes the two TCP backends (odd ranks portable, even ranks
/// io_uring) trains and verifies bit for bit, and each rank reports its backend;
/// `--transport portable` alone does too.
#[test]
fn mixed_and_portable_transports_verify() {
    let _serial = serial();
    if std::env::var_os("TIDEWIRE_TRANSPORT").is_some() {
        eprintln!("SKIPPED: TIDEWIRE_TRANSPORT is set and would override --transport");
        return;
    }
    for transport in ["mixed", "portable"] {
        let out = tidewire()
            .args([
                "train",
                "--model",
                "googlenet",
                "--workers",
                "3",
                "--servers",
                "2",
                "--iters",
                "2",
                "--time-scale",
                "0.05",
                "--transport",
                transport,
                "--verify",
                "--json",
            ])
            .output()
            .unwrap();
        let r = report(&out);
        assert_eq!(r.verified, Some(true), "--transport {transport}");
        let used = r.transport;
        if transport == "mixed" && tidewire_transport::select::uring_usable().is_ok() {
            // Each line names the ranks that use it: odd ones portable, even ones io_uring.
            assert!(
                used.iter().any(|t| t.starts_with("portable on ranks 1, 3:")),
                "{used:?}"
            );
            assert!(used.iter().any(|t| t.starts_with("tcp on ranks 0, 2, 4:")), "{used:?}");
        } else {
            assert!(used.iter().any(|t| t.starts_with("portable")), "{transport}: {used:?}");
        }
    }
}

/// SSP(2) with one worker four times slower: the others run ahead of it, by at
/// most 2 iterations, and the run completes.
#[test]
fn ssp_bounds_how_far_fast_workers_run_ahead() {
    let _serial = serial();
    let out = tidewire()
        .args([
            "train",
            "--model",
            "googlenet",
            "--workers",
            "3",
            "--servers",
            "1",
            "--iters",
            "8",
            "--consistency",
            "ssp:2",
            "--slow-rank",
            "0",
            "--slow-factor",
            "4",
            "--time-scale",
            "0.2",
            "--json",
        ])
        .output()
        .unwrap();
    let r = report(&out);
    let w = &r.workers_detail;
    let slow = &w[0];
    let mut lead_max = 0i64;
    for fast in &w[1..] {
        for (i, it) in fast.iter().enumerate() {
            // When a fast worker may start iteration i's compute, how many
            // iterations has the slow worker finished handing in?
            let t = it.forward_done_unix;
            let c_slow = slow.iter().filter(|j| j.backward_done_unix <= t).count() as i64;
            lead_max = lead_max.max(i as i64 - c_slow);
        }
    }
    println!("SSP(2): largest lead over the slow worker: {lead_max} iterations");
    assert!(lead_max <= 2, "a worker ran {lead_max} iterations ahead under SSP(2)");
    assert!(
        lead_max >= 1,
        "SSP(2) never let a fast worker run ahead of the slow one"
    );
    assert_eq!(r.per_iteration.len(), 8);
}

fn spawn_node(rank: usize, world: usize, port: u16, args: &[&str]) -> Child {
    tidewire()
        .arg("train-node")
        .args(args)
        .env("TIDEWIRE_RANK", rank.to_string())
        .env("TIDEWIRE_WORLD_SIZE", world.to_string())
        .env("TIDEWIRE_MASTER", format!("127.0.0.1:{port}"))
        .env("TIDEWIRE_SECRET", "test-secret")
        .env("TIDEWIRE_SERVERS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn free_port() -> u16 {
    tidewire::rendezvous::free_port(std::net::Ipv4Addr::LOCALHOST.into()).unwrap()
}

/// Kills (or freezes) worker rank 1 mid-run; every other rank must fail with
/// an error that names it (or a timeout) within the configured timeout.
fn lose_a_worker(signal: &str) {
    let port = free_port();
    let args = [
        "--model",
        "googlenet",
        "--workers",
        "3",
        "--servers",
        "1",
        "--iters",
        "100000",
        "--time-scale",
        "0.05",
        "--timeout-s",
        "5",
    ];
    let mut nodes: Vec<Child> = (0..4).map(|r| spawn_node(r, 4, port, &args)).collect();
    // Wait until rank 1 is well into training.
    let out = nodes[1].stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    loop {
        let l = lines.next().expect("rank 1 ended before training").unwrap();
        if matches!(ToLauncher::parse(&l), Some(ToLauncher::Progress(3))) {
            break;
        }
    }
    let pid = nodes[1].id().to_string();
    assert!(Command::new("kill").args([signal, &pid]).status().unwrap().success());
    let t = Instant::now();
    let limit = Duration::from_secs(5 + 10);
    for (r, n) in nodes.iter_mut().enumerate() {
        if r == 1 {
            continue;
        }
        let status = loop {
            if let Some(s) = n.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > limit {
                let _ = n.kill();
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
                panic!("rank {r} still running {limit:?} after rank 1 got {signal}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(n.stderr.as_mut().unwrap(), &mut err).unwrap();
        println!(
            "rank {r} after {:.2} s: {status}: {}",
            t.elapsed().as_secs_f64(),
            err.lines().last().unwrap_or("")
        );
        assert!(!status.success(), "rank {r} exited 0 after losing a peer");
        assert!(
            err.contains("rank 1") || err.contains("timed out") || err.contains("was lost") || err.contains("aborted"),
            "rank {r}: {err}"
        );
    }
    let _ = nodes[1].kill();
    let _ = nodes[1].wait();
}

#[test]
fn a_killed_worker_fails_every_other_rank_quickly() {
    let _serial = serial();
    lose_a_worker("-KILL");
}

#[test]
fn a_frozen_worker_fails_every_other_rank_within_the_timeout() {
    let _serial = serial();
    lose_a_worker("-STOP");
}

#[test]
fn bad_flags_are_clear_errors() {
    let _serial = serial();
    for (args, want) in [
        (vec!["train", "--model", "nope"], "unknown model"),
        (
            vec!["train", "--verify", "--consistency", "ssp:2"],
            "--verify needs BSP",
        ),
        (vec!["train", "--workers", "0"], "--workers must be at least 1"),
        (vec!["train", "--batch", "0"], "batch must be at least 1"),
        (
            vec!["train", "--chunk-bytes", "6"],
            "chunk_bytes 6 must be a positive multiple of 4",
        ),
        (
            vec!["train", "--sync", "fast"],
            "use fifo-ps, wfbp, hybrid, sliced, p3, full, kvstore or adam",
        ),
        (
            vec!["train", "--sync", "adam", "--consistency", "ssp:1"],
            "--sync adam rebuilds each FC layer on its server",
        ),
        (
            vec!["train", "--sync", "adam", "--trigger", "async"],
            "it needs BSP and --trigger all",
        ),
        (
            vec!["train", "--sync", "kvstore", "--consistency", "ssp:1"],
            "--sync kvstore is MXNet's dist_sync",
        ),
        (
            vec!["train", "--sync", "kvstore", "--trigger", "quorum:1"],
            "needs another --sync mode",
        ),
        (
            vec!["train", "--netns", "a,b", "--netns-addrs", "10.77.0.1"],
            "give one address per namespace",
        ),
        (
            vec!["train", "--netns", "a", "--netns-addrs", "host"],
            "is not an IPv4 address",
        ),
        (vec!["train", "--netns", "a"], "--netns-addrs"),
        (
            vec![
                "plan",
                "--model",
                "vgg19",
                "--workers",
                "2",
                "--servers",
                "3",
                "--batch",
                "8",
                "--colocate",
            ],
            "colocated",
        ),
    ] {
        let out = tidewire().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(
            !err.contains("the local cluster failed"),
            "{args:?} was launched: {err}"
        );
    }
}

/// `--sparse-layers`: the marked layers' slices go as index/value pairs, the
/// summary counts them, and the parameters still equal the single-process
/// reference bit for bit.
#[test]
fn sparse_layers_push_pairs_and_verify() {
    let _serial = serial();
    for (density, any_pairs) in [("0.01", true), ("1.0", false)] {
        let out = tidewire()
            .args([
                "train",
                "--model",
                "alexnet",
                "--workers",
                "3",
                "--colocate",
                "--iters",
                "3",
                "--batch",
                "8",
                "--time-scale",
                "0.05",
                "--sparse-layers",
                "conv4,conv5",
                "--sparse-density",
                density,
                "--verify",
                "--json",
            ])
            .output()
            .unwrap();
        let r = report(&out);
        assert_eq!(r.verified, Some(true), "density {density}: {:?}", r.mismatched_layers);
        let sp = r.sparse;
        let pairs = sp.pushes;
        assert_eq!(pairs > 0, any_pairs, "density {density}: {sp:?}");
        if any_pairs {
            let (nz, el) = (sp.nonzeros, sp.elements);
            assert!(nz > 0 && (nz as f64) < 0.05 * el as f64, "density {density}: {sp:?}");
            assert!(sp.bytes < el, "{sp:?}");
        } else {
            assert!(sp.dense_pushes > 0, "{sp:?}");
        }
    }
}
