//! The randomized simulation of the aggregation triggers and of worker
//! faults (issue 19): every seed draws a job — layer table, P1 and P2,
//! colocation, chunk and slice sizes, credits, slots, the transport's
//! limits — a trigger (`all`, `quorum:k`, `async`, `timeout:d`), and faults:
//! a slow span (a worker's compute ×F for some iterations), a straggler, a
//! crash at an iteration boundary (and, where the job goes on without it, a
//! rejoin: the worker comes back, takes the current parameters and is
//! counted again), delays and `WouldBlock`s. It runs the
//! product's `Node`s in the simulator with real values and checks, besides
//! every check of the simulator itself (bounds, applies once per iteration,
//! BSP values exact under `all`):
//! - each trigger's semantics on every apply (the simulator's
//!   `check_trigger`): `all` takes every worker, `quorum:k` at least k,
//!   `async` at least one, `timeout:d` every live worker or no earlier than
//!   d after the round's first contribution; no worker's contribution is half
//!   in; the apply divides by the gradients in it; nothing applied twice;
//! - every push is accumulated or dropped exactly once, dropped only under
//!   `quorum`/`timeout`, and every live worker holds all its credits at the end;
//! - every run completes, except a crash under `all` (or of a rank that is
//!   also a server, or below the quorum), which must fail with an error
//!   naming the crashed rank; none hangs.
//!
//! `TIDEWIRE_VOPR_SEEDS=N` runs N seeds (default 1000) from
//! `TIDEWIRE_VOPR_FROM` (default 1); `TIDEWIRE_VOPR_SEED=S` runs one and
//! prints its configuration.

use std::sync::Arc;
use std::time::Duration;

use tidewire_engine::book::{LayerKind, LayerSpec};
use tidewire_engine::node::Limits;
use tidewire_engine::testkit::Rng;
use tidewire_engine::{
    Book, BookConfig, Cluster, Consistency, EngineError, SchedConfig, SchemePolicy, SyncMode, Trigger,
};
use tidewire_sim::{Faults, Sim, SimConfig, SimError};

/// What a seed's run must end in.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    Completes,
    /// Fails with an error that names this rank.
    FailsNaming(u32),
}

fn draw(seed: u64) -> Result<(SimConfig, Expect), EngineError> {
    let mut r = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x7219);
    let nl = r.range(1, 5) as usize;
    let mut layers = Vec::with_capacity(nl);
    for i in 0..nl {
        let kind = r.pick(&[LayerKind::Conv, LayerKind::Fc, LayerKind::Other]);
        let (m, n) = (r.range(1, 24) as usize, r.range(1, 48) as usize);
        layers.push(LayerSpec::new(format!("l{i}"), kind, m, n));
    }
    let cluster = if r.chance(0.3) {
        Cluster::colocated(r.range(1, 5) as usize)?
    } else {
        Cluster::split(r.range(1, 6) as usize, r.range(1, 3) as usize)?
    };
    let p1 = cluster.workers().len() as u32;
    let trigger = match r.below(4) {
        0 => Trigger::All,
        1 => Trigger::Quorum(r.range(1, u64::from(p1)) as u32),
        2 => Trigger::Async,
        _ => Trigger::Timeout(Duration::from_nanos(r.range(1_000, 3_000_000))),
    };
    let mode = r.pick(&[SyncMode::FifoPs, SyncMode::Wfbp, SyncMode::Sliced, SyncMode::P3]);
    let mut bc = mode.book_config(BookConfig {
        batch: r.range(1, 4) as usize,
        chunk_bytes: 4 * r.range(1, 256) as usize,
        slice_params: r.range(1, 200) as usize,
        ..Default::default()
    });
    bc.policy = SchemePolicy::Ps;
    let book = Arc::new(Book::new(cluster, layers, bc)?);
    let iters = r.range(1, 8);
    let layer_ns: Vec<(u64, u64)> = (0..book.layers().len())
        .map(|_| (r.range(1_000, 200_000), r.range(1_000, 400_000)))
        .collect();
    let mut cfg = SimConfig::new(book.clone(), mode, layer_ns, iters);
    cfg.seed = seed;
    cfg.values = true;
    cfg.sched = SchedConfig {
        order: mode.order(),
        credit_bytes: if r.chance(0.3) {
            8 << 20
        } else {
            r.range(1, 4096) as usize
        },
        slots: r.range(1, 4) as u32,
        // Spare landing slots for the rank order: none (a landed push holds
        // its credit until its turn), a few, or sized from the book.
        spare_slots: if r.chance(0.3) {
            tidewire_engine::SPARE_AUTO
        } else {
            r.range(0, 4) as u32
        },
        consistency: if trigger == Trigger::All && r.chance(0.3) {
            Consistency::Ssp(r.range(0, 2) as u32)
        } else {
            Consistency::Bsp
        },
        deterministic: r.chance(0.5),
        trigger,
        ..SchedConfig::default()
    };
    cfg.limits = Limits {
        max_outstanding: r.pick(&[1, 2, 4, 256]),
        max_message_bytes: r.pick(&[256, 1024, 65536, 16 << 20]),
        max_write_bytes: r.pick(&[4, 60, 4096, 1 << 30]),
    };
    cfg.bandwidth_bps = r.pick(&[1e8, 1e9, 1e10]);
    cfg.latency_ns = r.range(1_000, 50_000);
    cfg.stall_ns = 5_000_000_000;
    let mut faults = Faults {
        detect_ns: r.range(10_000, 2_000_000),
        ..Faults::default()
    };
    let workers = book.cluster().workers().to_vec();
    if r.chance(0.4) {
        faults.delay_prob = r.range(1, 40) as f64 / 100.0;
        faults.delay_max_ns = r.range(1_000, 1_000_000);
    }
    if r.chance(0.2) {
        faults.block_prob = r.range(1, 30) as f64 / 100.0;
    }
    if r.chance(0.5) {
        let from = r.below(iters);
        faults.slow = vec![(r.pick(&workers), r.range(2, 8) as f64, from, from + r.range(1, iters))];
    }
    if r.chance(0.2) {
        faults.stragglers = vec![(r.pick(&workers), r.range(2, 5) as f64)];
    }
    let mut expect = Expect::Completes;
    if r.chance(0.35) && iters > 1 && book.cluster().world() > 1 {
        let w = r.pick(&workers);
        faults.crash = Some((w, r.range(1, iters - 1)));
        let server = book.cluster().role(w).is_some_and(|x| x.is_server());
        let tolerated = match trigger {
            Trigger::All => false,
            Trigger::Quorum(k) => k < p1,
            _ => p1 > 1,
        };
        if server || !tolerated {
            expect = Expect::FailsNaming(w);
        } else if r.chance(0.5) {
            // It comes back (when the job still runs then).
            faults.rejoin_after_ns = Some(r.range(0, 20_000_000));
        }
    }
    cfg.faults = faults;
    // Every rank on one host, its loopback copies and its jobs sharing the
    // cores (`sim --loopback`): a crashed worker's executors stop, and the one
    // that rejoins starts afresh.
    if r.chance(0.25) {
        cfg.hosts = Some(vec![0; book.cluster().world()]);
        cfg.host_cpu = Some((r.pick(&[1.0, 2.0, 4.0]), r.pick(&[1e8, 1e9, 1e10])));
    }
    Ok((cfg, expect))
}

fn describe(cfg: &SimConfig) -> String {
    let b = &cfg.book;
    format!(
        "P1={} P2={} world={} layers={} chunks={} slices={} iters={} trigger={} sched={:?} limits={:?} host cpu {:?} faults={:?}",
        b.p1(),
        b.p2(),
        b.cluster().world(),
        b.layers().len(),
        b.chunks().len(),
        b.slices().len(),
        cfg.iters,
        cfg.sched.trigger.name(),
        cfg.sched,
        cfg.limits,
        cfg.host_cpu,
        cfg.faults
    )
}

/// Totals over the seeds, to show the faults bit.
static TOTALS: std::sync::Mutex<[u64; 4]> = std::sync::Mutex::new([0; 4]);

fn run_seed(seed: u64) -> Result<&'static str, String> {
    let (cfg, expect) = match draw(seed) {
        Ok(x) => x,
        Err(EngineError::InvalidConfig(_)) => return Ok("refused"),
        Err(e) => return Err(format!("seed {seed}: drawing the job failed: {e}")),
    };
    let what = describe(&cfg);
    let (trigger, iters, p1) = (cfg.sched.trigger, cfg.iters, cfg.book.p1());
    let crash = cfg.faults.crash;
    let fail = |m: String| Err(format!("seed {seed}: {m}\n  configuration: {what}"));
    match (Sim::run(cfg), expect) {
        (Ok(rep), Expect::Completes) => {
            if rep.checks == 0 {
                return fail("a finished run checked no value".into());
            }
            // Everyone but a crashed worker (that did not come back) ran every iteration.
            for (i, &n) in rep.worker_iters.iter().enumerate() {
                let crashed = crash.is_some_and(|(_, at)| n == at) && rep.rejoined == 0;
                if n != iters && !crashed {
                    return fail(format!("worker {i} ran {n} of {iters} iterations"));
                }
            }
            if trigger == Trigger::All && (rep.dropped > 0 || rep.partial_applies > 0) {
                return fail(format!(
                    "`all` dropped {} and applied {} partial rounds",
                    rep.dropped, rep.partial_applies
                ));
            }
            let _ = p1;
            let mut t = TOTALS.lock().unwrap();
            t[0] += rep.applies;
            t[1] += rep.partial_applies;
            t[2] += rep.dropped;
            t[3] += rep.late_folded;
            if rep.rejoined > 0 {
                return Ok("completed after a crash and a rejoin");
            }
            if crash.is_some() {
                return Ok("completed after a crash");
            }
            Ok("completed")
        }
        (Err(SimError::Rank { error, .. }), Expect::FailsNaming(w)) => {
            let named = matches!(&error, EngineError::PeerLost { rank, .. } if *rank == w)
                || error.to_string().contains(&format!("rank {w}"));
            if named {
                Ok("failed naming the crashed rank")
            } else {
                fail(format!("failed, but not naming the crashed rank {w}: {error}"))
            }
        }
        (Ok(_), Expect::FailsNaming(w)) => fail(format!("completed although rank {w} crashed")),
        (Err(e), _) => fail(e.to_string()),
    }
}

#[test]
fn triggers_and_faults_keep_their_semantics() {
    let seeds: Vec<u64> = match std::env::var("TIDEWIRE_VOPR_SEED") {
        Ok(s) => vec![s.trim().parse().expect("TIDEWIRE_VOPR_SEED must be a number")],
        Err(_) => {
            let num = |name: &str, default: u64| -> u64 {
                std::env::var(name)
                    .ok()
                    .map(|s| s.trim().parse().unwrap_or_else(|_| panic!("{name} must be a number")))
                    .unwrap_or(default)
            };
            let (from, n) = (num("TIDEWIRE_VOPR_FROM", 1), num("TIDEWIRE_VOPR_SEEDS", 1000));
            (from..from + n).collect()
        }
    };
    if seeds.len() == 1 {
        if let Ok((cfg, e)) = draw(seeds[0]) {
            println!("seed {}: {} expect {e:?}", seeds[0], describe(&cfg));
        }
    }
    let started = std::time::Instant::now();
    let mut outcomes = std::collections::BTreeMap::<&str, u64>::new();
    let mut violations = Vec::new();
    for &seed in &seeds {
        match run_seed(seed) {
            Ok(o) => *outcomes.entry(o).or_default() += 1,
            Err(e) => {
                eprintln!("VIOLATION {e}");
                violations.push(seed);
            }
        }
    }
    println!(
        "vopr-triggers: {} seeds ({}..={}) in {:.1} s: {outcomes:?}; applies, partial applies, dropped, late folded: {:?}; {} violations",
        seeds.len(),
        seeds.first().unwrap_or(&0),
        seeds.last().unwrap_or(&0),
        started.elapsed().as_secs_f64(),
        *TOTALS.lock().unwrap(),
        violations.len()
    );
    assert!(
        violations.is_empty(),
        "violating seeds: {violations:?} (rerun one with TIDEWIRE_VOPR_SEED=<seed>)"
    );
}
