//! Tier 2: the engine core in a deterministic simulated cluster, with seeded
//! faults. Every failure message starts with the seed; rerun one seed with
//! `TIDEWIRE_SIM_SEED=<seed> cargo test -p tidewire-sim --test sim`.

use std::sync::Arc;

use tidewire_engine::book::{LayerKind, LayerSpec};
use tidewire_engine::EngineError;
use tidewire_engine::{models, Book, BookConfig, Cluster, Consistency, SyncMode};
use tidewire_sim::{Faults, Sim, SimConfig, SimError, SimReport};

fn seeds() -> Vec<u64> {
    match std::env::var("TIDEWIRE_SIM_SEED") {
        Ok(s) => vec![s.parse().expect("TIDEWIRE_SIM_SEED must be a number")],
        Err(_) => (1..=12).collect(),
    }
}

/// A small model with every kind of layer; chunks of 1 KiB and slices of 50
/// parameters, so layers span several chunks, servers and slices.
fn small_book(cluster: Cluster, mode: SyncMode) -> Arc<Book> {
    let layers = vec![
        LayerSpec::new("conv1", LayerKind::Conv, 8, 27),
        LayerSpec::new("conv2", LayerKind::Conv, 16, 72),
        LayerSpec::new("bn", LayerKind::Other, 2, 16),
        LayerSpec::new("fc1", LayerKind::Fc, 96, 80),
        LayerSpec::new("fc2", LayerKind::Fc, 10, 96),
    ];
    let base = BookConfig {
        batch: 2,
        chunk_bytes: 1024,
        slice_params: 50,
        ..Default::default()
    };
    Arc::new(Book::new(cluster, layers, mode.book_config(base)).unwrap())
}

fn small_run(book: Arc<Book>, mode: SyncMode, seed: u64) -> SimConfig {
    let n = book.layers().len();
    let mut cfg = SimConfig::new(book, mode, vec![(20_000, 40_000); n], 4);
    cfg.values = true;
    cfg.seed = seed;
    cfg.bandwidth_bps = 1e9;
    cfg.sched.slots = 2;
    cfg.sched.credit_bytes = 600;
    cfg.faults.delay_prob = 0.3;
    cfg.faults.delay_max_ns = 200_000;
    cfg
}

/// Value checks of a clean run with values: seeding (one per worker), every
/// layer after every iteration, and every layer at the end.
fn checks(p1: u64, layers: u64, iters: u64) -> u64 {
    p1 * (1 + layers * iters + layers)
}

fn check(r: Result<SimReport, SimError>) -> SimReport {
    match r {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn bsp_values_are_exact_in_every_mode_and_layout() {
    for seed in seeds() {
        for mode in SyncMode::ALL {
            for cluster in [Cluster::split(3, 2).unwrap(), Cluster::colocated(3).unwrap()] {
                let book = small_book(cluster, mode);
                let rep = check(Sim::run(small_run(book.clone(), mode, seed)));
                // Every worker checked every layer of every iteration.
                assert_eq!(rep.checks, checks(3, 5, 4), "seed {seed} {mode:?}");
                assert!(rep.max_slots_held <= 2, "seed {seed}: credits exceeded");
                let fc1 = &book.layers()[3];
                let biggest = (book.max_slice_len() * 4).max(2 * (fc1.m + fc1.n) * 4);
                assert!(
                    rep.max_bytes_in_flight <= 600.max(biggest),
                    "seed {seed}: window exceeded"
                );
            }
        }
    }
}

/// `--sync kvstore` (MXNet's KVStore, P3 §4.1): whole layers on one server,
/// a layer of 10^6 parameters or more split across every server, notify then
/// pull. Several models and cluster sizes; values are exact (the simulator
/// checks every layer of every iteration) and bitwise those of WFBP, which
/// sums the same gradients in the same rank order.
#[test]
fn kvstore_notifies_pulls_and_is_exact() {
    let models: [(&str, Vec<LayerSpec>); 3] = [
        (
            "small",
            vec![
                LayerSpec::new("conv1", LayerKind::Conv, 8, 27),
                LayerSpec::new("fc1", LayerKind::Fc, 96, 80),
                LayerSpec::new("fc2", LayerKind::Fc, 10, 96),
            ],
        ),
        (
            // One layer over the 10^6 bound: split across every server.
            "big-fc",
            vec![
                LayerSpec::new("conv", LayerKind::Conv, 16, 27),
                LayerSpec::new("fc6", LayerKind::Fc, 1000, 1003),
                LayerSpec::new("bias", LayerKind::Other, 1, 7),
                LayerSpec::new("fc7", LayerKind::Fc, 10, 1000),
            ],
        ),
        (
            "many",
            (0..9)
                .map(|i| LayerSpec::new(format!("l{i}"), LayerKind::Conv, 3 + i, 40 + 7 * i))
                .collect(),
        ),
    ];
    for seed in seeds() {
        for (name, layers) in &models {
            for cluster in [
                Cluster::split(3, 2).unwrap(),
                Cluster::colocated(4).unwrap(),
                Cluster::split(2, 3).unwrap(),
                Cluster::colocated(1).unwrap(),
            ] {
                let run = |mode: SyncMode| {
                    let bc = mode.book_config(BookConfig {
                        batch: 2,
                        chunk_bytes: 4096,
                        slice_params: 100,
                        ..Default::default()
                    });
                    let book = Arc::new(Book::new(cluster.clone(), layers.clone(), bc).unwrap());
                    let mut cfg = small_run(book.clone(), mode, seed);
                    cfg.iters = 3;
                    cfg.sched.slots = 2;
                    let landing = cfg.sched.resolve(&book).landing_bytes(&book);
                    let rep =
                        Sim::run(cfg).unwrap_or_else(|e| panic!("{name} {:?} {}: {e}", cluster.roles(), mode.name()));
                    (book, rep, landing)
                };
                let (book, kv, landing) = run(SyncMode::KvStore);
                let (p1, nl) = (book.p1() as u64, layers.len() as u64);
                // Chunks travel as wire slices of at most chunk_bytes (fc6's 1,003,000
                // parameters over two servers: 490 slices a chunk): a landing slot is one.
                assert!(book.slices().len() > book.chunks().len(), "{name}");
                assert!(book.max_slice_len() <= 1024, "{name}");
                assert_eq!(kv.landing_bytes, landing, "{name}");
                // Credits × slot × peers: 2 credits and at most 256 spares of at most
                // chunk_bytes per worker, whatever the largest chunk (2 MB here).
                assert!(landing <= p1 * (2 + 256) * 4096, "{name}: {landing} B");
                assert_eq!(kv.checks, checks(p1, nl, 3), "seed {seed} {name}");
                // One pull per chunk per worker per iteration, one apply per chunk per iteration.
                let nc = book.chunks().len() as u64;
                assert_eq!(kv.pulls, nc * p1 * 3, "seed {seed} {name}");
                assert_eq!(kv.applies, nc * 3, "seed {seed} {name}");
                let (_, wfbp, _) = run(SyncMode::Wfbp);
                assert_eq!(wfbp.pulls, 0);
                assert_eq!(kv.params_bits, wfbp.params_bits, "seed {seed} {name}: kvstore ≠ wfbp");
            }
        }
    }
}

/// `--sync adam` (Project Adam, Poseidon §3.2): each FC layer whole on one
/// server, which rebuilds the gradient from every worker's factors. Values
/// are exact, and bitwise those of WFBP handing FC layers in as factors
/// (each worker's Uᵀ·V summed in rank order: the same sums). The layer's
/// server carries the traffic: it receives every worker's factors and sends
/// every worker the full matrix, so the servers' loads are far less even
/// than under the sharded PS.
#[test]
fn adam_is_bitwise_the_ps_and_loads_the_layer_s_server() {
    let layers = vec![
        LayerSpec::new("conv", LayerKind::Conv, 8, 27),
        LayerSpec::new("fc1", LayerKind::Fc, 200, 300),
        LayerSpec::new("bias", LayerKind::Other, 1, 7),
        LayerSpec::new("fc2", LayerKind::Fc, 10, 200),
    ];
    for seed in seeds() {
        for cluster in [
            Cluster::split(3, 2).unwrap(),
            Cluster::split(4, 3).unwrap(),
            Cluster::colocated(3).unwrap(),
            Cluster::colocated(1).unwrap(),
        ] {
            let run = |mode: SyncMode| {
                let bc = mode.book_config(BookConfig {
                    batch: 2,
                    chunk_bytes: 4096,
                    ..Default::default()
                });
                let book = Arc::new(Book::new(cluster.clone(), layers.clone(), bc).unwrap());
                let mut cfg = small_run(book.clone(), mode, seed);
                cfg.iters = 3;
                cfg.fc_factors = true;
                let rep = Sim::run(cfg).unwrap_or_else(|e| panic!("{:?} {}: {e}", cluster.roles(), mode.name()));
                (book, rep)
            };
            let (book, adam) = run(SyncMode::Adam);
            let (_, ps) = run(SyncMode::Wfbp);
            let what = format!("seed {seed} {:?}", cluster.roles());
            assert_eq!(adam.checks, checks(book.p1() as u64, 4, 3), "{what}");
            assert_eq!(adam.params_bits, ps.params_bits, "{what}: adam ≠ wfbp");
            let fc1 = book.layer_chunks(1);
            let holder = book.chunks()[fc1.start as usize].server as usize;
            assert!(
                fc1.clone().all(|c| book.chunks()[c as usize].server as usize == holder),
                "{what}"
            );
            if cluster.is_colocated() || book.p2() < 2 {
                continue;
            }
            // Bytes each server moved (sent + received), and their spread.
            let load = |r: &tidewire_sim::SimReport| -> Vec<u64> {
                book.cluster()
                    .servers()
                    .iter()
                    .map(|&s| r.nic_bytes[s as usize].iter().sum())
                    .collect()
            };
            let spread = |l: &[u64]| *l.iter().max().unwrap() as f64 / *l.iter().min().unwrap() as f64;
            let (la, lp) = (load(&adam), load(&ps));
            let busiest = book
                .cluster()
                .servers()
                .iter()
                .position(|&s| s as usize == holder)
                .unwrap();
            assert_eq!(la.iter().max(), Some(&la[busiest]), "{what}: {la:?}");
            assert!(spread(&la) > 2.0 * spread(&lp), "{what}: adam {la:?}, ps {lp:?}");
        }
    }
}

/// Kvstore is MXNet's `dist_sync`: SSP and the other aggregation triggers
/// are refused with a typed error that says why.
#[test]
fn kvstore_refuses_ssp_and_triggers() {
    let book = small_book(Cluster::split(2, 1).unwrap(), SyncMode::KvStore);
    let mut ssp = small_run(book.clone(), SyncMode::KvStore, 1);
    ssp.sched.consistency = Consistency::Ssp(1);
    match Sim::run(ssp) {
        Err(SimError::Config {
            error: EngineError::InvalidConfig(m),
            ..
        }) => assert!(m.contains("kvstore") && m.contains("SSP"), "{m}"),
        other => panic!("{other:?}"),
    }
    let mut quorum = small_run(book, SyncMode::KvStore, 1);
    quorum.sched.trigger = tidewire_engine::Trigger::Quorum(1);
    match Sim::run(quorum) {
        Err(SimError::Config {
            error: EngineError::InvalidConfig(m),
            ..
        }) => assert!(m.contains("kvstore") && m.contains("quorum:1"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn arrival_order_mode_is_exact_too() {
    for seed in seeds() {
        let book = small_book(Cluster::split(4, 3).unwrap(), SyncMode::Full);
        let mut cfg = small_run(book, SyncMode::Full, seed);
        cfg.sched.deterministic = false;
        let rep = check(Sim::run(cfg));
        assert_eq!(rep.checks, checks(4, 5, 4));
    }
}

#[test]
fn stragglers_and_a_healing_partition_still_finish() {
    for seed in seeds() {
        let book = small_book(Cluster::split(3, 2).unwrap(), SyncMode::Full);
        let mut cfg = small_run(book, SyncMode::Full, seed);
        cfg.faults.stragglers = vec![(1, 3.0)];
        cfg.faults.partition = Some((vec![0, 3], 100_000, 2_000_000));
        let rep = check(Sim::run(cfg));
        assert_eq!(rep.checks, checks(3, 5, 4));
        assert!(
            rep.total_ns > 2_000_000,
            "seed {seed}: the partition must have cost time"
        );
    }
}

#[test]
fn a_dead_worker_is_a_typed_error_not_a_hang() {
    for seed in seeds() {
        let book = small_book(Cluster::split(3, 2).unwrap(), SyncMode::Full);
        let mut cfg = small_run(book, SyncMode::Full, seed);
        cfg.faults.dead = Some((2, 300_000));
        cfg.stall_ns = 50_000_000;
        let err = Sim::run(cfg).expect_err("a dead worker cannot finish");
        assert!(err.to_string().starts_with(&format!("seed {seed}:")), "{err}");
        // The peers see the connection fail and end with a typed error.
        assert!(
            matches!(
                &err,
                SimError::Rank {
                    error: EngineError::PeerLost { rank: 2, .. } | EngineError::PeerAborted { .. },
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn ssp_bounds_the_lead_of_fast_workers() {
    for seed in seeds() {
        for s in [1u32, 2] {
            let book = small_book(Cluster::split(3, 2).unwrap(), SyncMode::Full);
            let mut cfg = small_run(book, SyncMode::Full, seed);
            cfg.iters = 10;
            cfg.sched.consistency = Consistency::Ssp(s);
            cfg.faults.stragglers = vec![(0, 4.0)];
            let rep = check(Sim::run(cfg));
            assert!(
                rep.max_lead <= u64::from(s) + 1,
                "seed {seed}: lead {} with s={s}",
                rep.max_lead
            );
            assert!(
                rep.max_lead >= u64::from(s),
                "seed {seed}: SSP({s}) never let a worker run ahead"
            );
        }
        // BSP keeps everyone within one iteration of each other.
        let book = small_book(Cluster::split(3, 2).unwrap(), SyncMode::Full);
        let mut cfg = small_run(book, SyncMode::Full, seed);
        cfg.faults.stragglers = vec![(0, 4.0)];
        let rep = check(Sim::run(cfg));
        assert!(rep.max_lead <= 1, "seed {seed}: BSP lead {}", rep.max_lead);
    }
}

/// Poseidon's and P3's ordering on VGG19, 8 colocated nodes (P1 = P2 = 8), 10 Gbit/s.
#[test]
fn vgg19_modes_order_as_in_the_papers() {
    let model = models::profile("vgg19").unwrap();
    let times: Vec<(u64, u64)> = model
        .layer_times(32, 1.0)
        .iter()
        .map(|(f, b)| (f.as_nanos() as u64, b.as_nanos() as u64))
        .collect();
    let mut it = std::collections::HashMap::new();
    for mode in SyncMode::ALL {
        let book = Arc::new(
            Book::new(
                Cluster::colocated(8).unwrap(),
                model.layers.clone(),
                mode.book_config(BookConfig::default()),
            )
            .unwrap(),
        );
        let mut cfg = SimConfig::new(book, mode, times.clone(), 3);
        cfg.gemm_flops = model.calibrated_flop_rate();
        // The papers' systems sum in arrival order.
        cfg.sched.deterministic = false;
        let rep = check(Sim::run(cfg));
        println!(
            "vgg19 8 nodes 10 Gbit/s {:>8}: iteration {:.3} s, blocked {:.3} s/iter",
            mode.name(),
            rep.iteration_s,
            rep.wait_s
        );
        it.insert(mode, rep.iteration_s);
    }
    let t = |m| it[&m];
    assert!(t(SyncMode::FifoPs) > t(SyncMode::Wfbp), "{it:?}");
    assert!(t(SyncMode::Wfbp) > t(SyncMode::Hybrid), "{it:?}");
    assert!(t(SyncMode::Hybrid) >= t(SyncMode::Full), "{it:?}");
    assert!(t(SyncMode::P3) < t(SyncMode::Wfbp), "{it:?}");
}

#[test]
fn compute_only_when_the_network_is_free() {
    // One worker, its own server: iteration time is the compute time.
    let book = small_book(Cluster::colocated(1).unwrap(), SyncMode::Full);
    let n = book.layers().len() as u64;
    let mut cfg = small_run(book, SyncMode::Full, 1);
    cfg.faults = Faults::default();
    cfg.agg_bytes_per_s = f64::INFINITY;
    cfg.gemm_flops = f64::INFINITY;
    cfg.copy_bytes_per_s = f64::INFINITY;
    let rep = check(Sim::run(cfg));
    assert_eq!(rep.total_ns, 4 * n * 60_000);
}

/// The credit window trades head-of-line blocking (too large: a big
/// low-priority send holds the wire) against idle gaps (too small). The
/// default was chosen from this sweep: VGG19 and ResNet-50, 8 colocated nodes
/// at 10 Gbit/s, P3 and full modes. The test keeps the default within 2% of
/// the best window of the sweep.
#[test]
fn credit_window_sweep() {
    let windows = [256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20];
    let default = tidewire_engine::SchedConfig::default().credit_bytes;
    for name in ["vgg19", "resnet-50"] {
        let model = models::profile(name).unwrap();
        let times: Vec<(u64, u64)> = model
            .layer_times(model.batch, 1.0)
            .iter()
            .map(|(f, b)| (f.as_nanos() as u64, b.as_nanos() as u64))
            .collect();
        for mode in [SyncMode::P3, SyncMode::Full] {
            let mut row = Vec::new();
            for &w in windows.iter().chain(std::iter::once(&default)) {
                let book = Arc::new(
                    Book::new(
                        Cluster::colocated(8).unwrap(),
                        model.layers.clone(),
                        mode.book_config(BookConfig {
                            batch: model.batch,
                            ..Default::default()
                        }),
                    )
                    .unwrap(),
                );
                let mut cfg = SimConfig::new(book, mode, times.clone(), 3);
                cfg.sched.credit_bytes = w;
                cfg.sched.deterministic = false;
                cfg.gemm_flops = model.calibrated_flop_rate();
                row.push((w, check(Sim::run(cfg)).iteration_s));
            }
            let best = row.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
            let line: Vec<String> = row[..windows.len()]
                .iter()
                .map(|(w, t)| format!("{}K:{:.4}", w >> 10, t))
                .collect();
            println!("credit sweep {name} {}: {}", mode.name(), line.join(" "));
            let d = row.last().unwrap().1;
            assert!(
                d <= best * 1.02,
                "{name} {mode:?}: default window {default} gives {d:.4} s, best {best:.4} s"
            );
        }
    }
}

#[test]
fn the_nic_trace_adds_up_and_changes_nothing() {
    let mode = SyncMode::P3;
    let book = small_book(Cluster::colocated(3).unwrap(), mode);
    let mut cfg = small_run(book, mode, 1);
    cfg.faults.delay_prob = 0.0;
    let plain = check(Sim::run(cfg.clone()));
    assert!(plain.nic_trace.is_empty(), "off by default");
    cfg.trace_bin_ns = Some(50_000);
    let traced = check(Sim::run(cfg));
    assert_eq!(traced.total_ns, plain.total_ns, "tracing changed the run");
    assert_eq!(traced.nic_trace.len(), 3);
    // 1 Gbit/s: at most 6250 bytes in a 50 µs bin.
    for (h, [tx, rx]) in traced.nic_trace.iter().enumerate() {
        for (dir, bins) in [tx, rx].into_iter().enumerate() {
            let sum: u64 = bins.iter().sum();
            let want = traced.nic_bytes[h][dir];
            assert!(
                sum.abs_diff(want) <= bins.len() as u64,
                "host {h} dir {dir}: {sum} vs {want}"
            );
            assert!(bins.iter().all(|&b| b <= 6_251), "host {h} dir {dir}: {bins:?}");
        }
    }
    assert!(traced.start_ns > 0, "the set-up comes before iteration 0");
}
