//! The randomized simulation (in the manner of TigerBeetle's VOPR): every
//! seed draws a whole job — a random layer table, P1 and P2, colocation,
//! chunk, slice, credit window, slots, batch, sync mode, scheme policy,
//! consistency, aggregation order, the transport's limits — and faults
//! (delays, a straggler, a dead rank, a partition that heals, `WouldBlock`s),
//! runs it on the product's `Node`s in the simulator with real values, and
//! checks the invariants:
//! - BSP values are exact after every layer's iteration, and every run that
//!   finishes leaves every worker with the last iteration's sum (BSP and SSP);
//! - no contribution is lost or applied twice (every chunk applied once per iteration);
//! - no bound is exceeded (outstanding transmits, message and write caps,
//!   landing slots, the credit window);
//! - every run finishes, or fails with a typed error when a rank dies; none hangs.
//!
//! `TIDEWIRE_VOPR_SEEDS=N` runs N seeds (default 200) from `TIDEWIRE_VOPR_FROM` (default 1),
//! `TIDEWIRE_VOPR_SEED=S` runs one seed and prints its configuration. A
//! failure prints the seed and the configuration.

use std::sync::Arc;

use tidewire_engine::book::{LayerKind, LayerSpec, Placement};
use tidewire_engine::node::Limits;
use tidewire_engine::testkit::Rng;
use tidewire_engine::{
    ApplyOp, Book, BookConfig, Cluster, Consistency, EngineError, SchedConfig, SchemePolicy, SyncMode, Trigger,
};
use tidewire_sim::{Faults, Sim, SimConfig, SimError};

/// A whole job drawn from `seed`, and whether a rank dies in it.
fn draw(seed: u64) -> Result<(SimConfig, bool), EngineError> {
    let mut r = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5eed);
    let nl = r.range(1, 6) as usize;
    let mut layers = Vec::with_capacity(nl);
    for i in 0..nl {
        let kind = r.pick(&[LayerKind::Conv, LayerKind::Fc, LayerKind::Fc, LayerKind::Other]);
        let (m, n) = match kind {
            LayerKind::Fc => (r.range(1, 48) as usize, r.range(1, 64) as usize),
            LayerKind::Conv => (r.range(1, 32) as usize, r.range(1, 72) as usize),
            LayerKind::Other => (r.range(1, 2) as usize, r.range(1, 40) as usize),
        };
        layers.push(LayerSpec::new(format!("l{i}"), kind, m, n));
    }
    let cluster = if r.chance(0.3) {
        Cluster::colocated(r.range(1, 5) as usize)?
    } else {
        Cluster::split(r.range(1, 5) as usize, r.range(1, 4) as usize)?
    };
    let mode = r.pick(&SyncMode::ALL);
    let mut bc = mode.book_config(BookConfig {
        batch: r.range(1, 4) as usize,
        chunk_bytes: 4 * r.range(1, 512) as usize,
        slice_params: r.range(1, 300) as usize,
        ..Default::default()
    });
    if r.chance(0.3) {
        bc.policy = if bc.placement == Placement::Chunked {
            r.pick(&[
                SchemePolicy::Hybrid,
                SchemePolicy::Ps,
                SchemePolicy::Sfb,
                SchemePolicy::Adam,
            ])
        } else {
            r.pick(&[SchemePolicy::Hybrid, SchemePolicy::Ps, SchemePolicy::Sfb])
        };
    }
    let mut book = Book::new(cluster, layers, bc)?;
    // HybComm in seconds (the adaptive choice) in a third of the jobs, from
    // rates drawn on a stream of their own so that the rest of a seed's job
    // is the one it drew before rates existed: links from 10 MB/s to 10 GB/s,
    // GEMMs from a slow CPU's to a GPU's, so either scheme can win.
    let mut rr = Rng(seed ^ 0x7a7e_5eed_0000_0001);
    let msg_ns = if rr.chance(0.33) {
        let rates = tidewire_engine::cost::Rates {
            link_bytes_per_s: rr.pick(&[1e7, 1e8, 1e9, 1e10]),
            msg_s: rr.pick(&[0.0, 1e-6, 2e-5, 1e-3]),
            sum_bytes_per_s: rr.pick(&[1e8, 1e9, 1e10]),
            gemm_flop_per_s: rr.pick(&[1e6, 1e8, 1e10, 5e13]),
            host_ranks: rr.pick(&[1, 2, 16]),
            link_on_host: rr.chance(0.5),
            ps_builds_grad: rr.chance(0.5),
        };
        book = book.with_rates(rates)?;
        (rates.msg_s * 1e9) as u64
    } else {
        0
    };
    let book = Arc::new(book);
    let nlayers = book.layers().len();
    let layer_ns: Vec<(u64, u64)> = (0..nlayers)
        .map(|_| {
            let f = r.range(1_000, 50_000);
            (f, 2 * f)
        })
        .collect();
    let iters = r.range(1, 5);
    let mut cfg = SimConfig::new(book.clone(), mode, layer_ns, iters);
    cfg.seed = seed;
    cfg.values = true;
    cfg.fc_factors = r.chance(0.3);
    // The apply op, on a stream of its own (the rest of a seed's job is the one
    // it drew before): the sum in half the jobs (every bit checked), the mean
    // and SGD in the others (against the checker's f64 oracle), so that the
    // shipped apply kernel's every arm runs under the VOPR.
    let mut ra = Rng(seed ^ 0x0a99_1e5e_ed00_0002);
    cfg.apply = match ra.range(0, 6) {
        0..=2 => ApplyOp::Sum,
        3 => ApplyOp::Mean,
        _ => ApplyOp::Sgd {
            lr: ra.pick(&[0.01, 0.1, 0.5]),
            momentum: ra.pick(&[0.0, 0.9]),
            weight_decay: ra.pick(&[0.0, 0.01, 0.1]),
        },
    };
    cfg.sched = SchedConfig {
        order: mode.order(),
        credit_bytes: if r.chance(0.2) {
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
        // Kvstore (MXNet's dist_sync) and Adam are BSP only: Node::new refuses SSP.
        consistency: if r.chance(0.6) || mode == SyncMode::KvStore || bc.policy == SchemePolicy::Adam {
            Consistency::Bsp
        } else {
            Consistency::Ssp(r.range(0, 3) as u32)
        },
        deterministic: r.chance(0.5),
        // Fold groups (a flat run standing in for Nexus's local learners),
        // and learners behind each worker (the mean's divisor).
        fold_group: if r.chance(0.3) {
            r.range(2, book.p1() as u64 + 2) as u32
        } else {
            1
        },
        learners: 1,
        trigger: Trigger::All,
    };
    let limits = |r: &mut Rng| Limits {
        max_outstanding: r.pick(&[1, 2, 3, 4, 8, 256]),
        max_message_bytes: r.pick(&[256, 300, 1024, 4096, 65536, 16 << 20]),
        max_write_bytes: r.pick(&[4, 8, 60, 512, 4096, 1 << 30]),
    };
    cfg.limits = limits(&mut r);
    if r.chance(0.2) {
        // Ranks whose transports differ: each end's limits hold.
        cfg.rank_limits = Some((0..book.cluster().world()).map(|_| limits(&mut r)).collect());
    }
    cfg.bandwidth_bps = r.pick(&[1e8, 1e9, 1e10]);
    cfg.latency_ns = r.range(1_000, 100_000);
    cfg.agg_bytes_per_s = r.pick(&[1e9, 1e10]);
    cfg.copy_bytes_per_s = r.pick(&[1e9, 1e10]);
    cfg.gemm_flops = r.pick(&[1e9, 1e12]);
    // The runtime's cost per post, where the rates gave one.
    cfg.msg_ns = msg_ns;
    // Virtual time is cheap: a long liveness timeout, so that only a real hang trips it.
    cfg.stall_ns = 5_000_000_000;
    let world = book.cluster().world() as u32;
    // Nexus's local learners behind each worker (their aggregation and fan-out
    // delay the hand-ins and the next forward passes), and ranks sharing hosts
    // (a flat run of learners: one NIC, loopback between them).
    if r.chance(0.25) {
        cfg.local_learners = r.range(2, 4) as u32;
        cfg.local_bytes_per_s = r.pick(&[1e8, 1e9, 1e10]);
    }
    if r.chance(0.25) {
        let per = r.range(2, 4) as u32;
        cfg.hosts = Some((0..world).map(|x| x / per).collect());
        // Their loopback copies and their jobs on the host's shared cores
        // (`sim --loopback`): every job's end moves with the others.
        if r.chance(0.5) {
            cfg.host_cpu = Some((r.pick(&[1.0, 2.0, 4.0]), r.pick(&[1e8, 1e9, 1e10])));
        }
    }
    let mut faults = Faults {
        detect_ns: r.range(10_000, 5_000_000),
        ..Faults::default()
    };
    if r.chance(0.5) {
        faults.delay_prob = r.range(1, 50) as f64 / 100.0;
        faults.delay_max_ns = r.range(1_000, 2_000_000);
    }
    if r.chance(0.3) {
        faults.block_prob = r.range(1, 40) as f64 / 100.0;
    }
    if r.chance(0.3) {
        let w = book.cluster().workers()[r.below(book.p1() as u64) as usize];
        faults.stragglers = vec![(w, r.range(2, 6) as f64)];
    }
    if r.chance(0.2) && world > 1 {
        let side: Vec<u32> = (0..world).filter(|_| r.chance(0.5)).collect();
        let from = r.range(0, 2_000_000);
        faults.partition = Some((side, from, from + r.range(1_000, 20_000_000)));
    }
    let dies = r.chance(0.1) && world > 1;
    if dies {
        faults.dead = Some((r.below(world as u64) as u32, r.range(0, 20_000_000)));
    }
    cfg.faults = faults;
    draw_switches(seed, &mut cfg)?;
    Ok((cfg, dies))
}

/// Scheme switches mid-run (PS ↔ SFB at iteration boundaries), on a stream
/// of their own so that the rest of a seed's job is the one it drew before.
/// Of the jobs that can switch (BSP, the all trigger, the chunked placement,
/// no Adam; with SGD's momentum too, which moves with the layer), a third
/// keep their schemes, a
/// third switch each dense FC layer at up to three drawn iterations given
/// up front, and a third are adaptive: worker 0 decides every two or three
/// iterations, at random, and the protocol carries each decision (late,
/// some of them).
fn draw_switches(seed: u64, cfg: &mut SimConfig) -> Result<(), EngineError> {
    let mut rs = Rng(seed ^ 0x5317_c4e5_0000_0003);
    let book = &cfg.book;
    let can = cfg.sched.consistency == Consistency::Bsp
        && cfg.sched.trigger == Trigger::All
        && book.config().placement == Placement::Chunked
        && book.config().policy != SchemePolicy::Adam
        && cfg.iters > 1;
    if !can {
        return Ok(());
    }
    match rs.below(3) {
        0 => return Ok(()),
        1 => {
            // Adaptive: worker 0 decides every 2 or 3 iterations, at random.
            let every = rs.range(2, 3);
            cfg.book = Arc::new((**book).clone().with_adaptive(every)?);
            cfg.decide_seed = Some(rs.next_u64());
            return Ok(());
        }
        _ => {}
    }
    let mut switches = Vec::new();
    for (l, spec) in book.layers().iter().enumerate() {
        if spec.kind != LayerKind::Fc || spec.sparse || !rs.chance(0.7) {
            continue;
        }
        let mut at = 0;
        for _ in 0..rs.range(1, 3) {
            at += rs.range(1, 2);
            if at >= cfg.iters {
                break;
            }
            let now = book.plan().scheme(l as u32, at);
            let now = switches
                .iter()
                .rfind(|s: &&tidewire_engine::Switch| s.layer == l as u32 && s.iter <= at)
                .map_or(now, |s| s.scheme);
            let scheme = if now == tidewire_engine::Scheme::Ps {
                tidewire_engine::Scheme::Sfb
            } else {
                tidewire_engine::Scheme::Ps
            };
            switches.push(tidewire_engine::Switch {
                layer: l as u32,
                iter: at,
                scheme,
            });
        }
    }
    cfg.book = Arc::new((**book).clone().with_switches(&switches)?);
    Ok(())
}

fn describe(cfg: &SimConfig) -> String {
    let b = &cfg.book;
    let layers: Vec<String> = b
        .layers()
        .iter()
        .map(|l| format!("{}:{:?}{}x{}", l.name, l.kind, l.m, l.n))
        .collect();
    format!(
        "roles {:?}; layers [{}]; {:?}; rates {:?} (schemes {:?}, switches [{}], {} ns a post); {:?}; wait_free {} fc_factors {}; {:?} (by rank {:?}); iters {}; bw {} lat {}; local learners {} at {} B/s; hosts {:?} cpu {:?}; faults {:?}",
        b.cluster().roles(),
        layers.join(" "),
        b.config(),
        b.rates(),
        (0..b.layers().len() as u32).map(|l| b.scheme(l, 0)).collect::<Vec<_>>(),
        b.plan().switches().map(|s| s.to_string()).collect::<Vec<_>>().join(", "),
        cfg.msg_ns,
        cfg.sched,
        cfg.wait_free,
        cfg.fc_factors,
        cfg.limits,
        cfg.rank_limits,
        cfg.iters,
        cfg.bandwidth_bps,
        cfg.latency_ns,
        cfg.local_learners,
        cfg.local_bytes_per_s,
        cfg.hosts,
        cfg.host_cpu,
        cfg.faults
    )
}

/// Runs one seed; `Err` is a failed invariant, with the seed and the configuration.
fn run_seed(seed: u64) -> Result<&'static str, String> {
    let (cfg, dies) = match draw(seed) {
        Ok(x) => x,
        // A drawn table the book refuses is a valid outcome of the draw, not a failure.
        Err(EngineError::InvalidConfig(_)) => return Ok("refused"),
        Err(e) => return Err(format!("seed {seed}: drawing the job failed: {e}")),
    };
    let what = describe(&cfg);
    let book = cfg.book.clone();
    let (slots, credit, limits) = (cfg.sched.slots, cfg.sched.credit_bytes, cfg.limits);
    let landing_slots = u64::from(cfg.sched.resolve(&book).landing_slots());
    let rank_limits = cfg.rank_limits.clone();
    let fail = |m: String| Err(format!("{m}\n  configuration: {what}"));
    match Sim::run(cfg) {
        Ok(rep) => {
            let k = book.config().batch;
            let biggest = book
                .layers()
                .iter()
                .filter(|l| l.kind == LayerKind::Fc)
                .map(|l| k * (l.m + l.n) * 4)
                .chain(std::iter::once(book.max_slice_len() * 4))
                .max()
                .unwrap_or(0);
            if rep.max_slots_held > slots {
                return fail(format!(
                    "seed {seed}: {} slots held, {slots} granted",
                    rep.max_slots_held
                ));
            }
            if rep.max_bytes_in_flight > credit.max(biggest) {
                return fail(format!(
                    "seed {seed}: {} bytes in flight, window {credit}",
                    rep.max_bytes_in_flight
                ));
            }
            let all = rank_limits.unwrap_or_else(|| vec![limits]);
            let cap = |f: fn(&Limits) -> usize| all.iter().map(f).max().unwrap_or(0);
            if rep.max_outstanding > cap(|l| l.max_outstanding)
                || rep.max_message as usize > cap(|l| l.max_message_bytes)
                || rep.max_write as usize > cap(|l| l.max_write_bytes)
            {
                return fail(format!("seed {seed}: transport limits exceeded: {rep:?}"));
            }
            // A server's landing memory: credits × slot × peers, a slot at most
            // one wire slice (under kvstore too, whose chunk may be a whole layer).
            let bc = book.config();
            let slot_max = bc.slice_params.min(bc.chunk_bytes / 4) as u64 * 4;
            if rep.landing_bytes > book.p1() as u64 * landing_slots * slot_max {
                return fail(format!(
                    "seed {seed}: {} landing bytes at a server, {landing_slots} slots of at most {slot_max} B",
                    rep.landing_bytes
                ));
            }
            if rep.checks == 0 {
                return fail(format!("seed {seed}: a finished run checked no value"));
            }
            Ok(if rep.switches > 0 {
                "finished, switched"
            } else {
                "finished"
            })
        }
        Err(e @ SimError::Rank { .. }) if dies => match &e {
            SimError::Rank {
                error: EngineError::PeerLost { .. } | EngineError::PeerAborted { .. },
                ..
            } => Ok("failed as expected"),
            _ => fail(format!("{e} (a rank died: expected a lost peer)")),
        },
        Err(e) => fail(e.to_string()),
    }
}

#[test]
fn randomized_jobs_keep_every_invariant() {
    let seeds: Vec<u64> = match std::env::var("TIDEWIRE_VOPR_SEED") {
        Ok(s) => vec![s.trim().parse().expect("TIDEWIRE_VOPR_SEED must be a number")],
        Err(_) => {
            let num = |name: &str, default: u64| -> u64 {
                std::env::var(name)
                    .ok()
                    .map(|s| s.trim().parse().unwrap_or_else(|_| panic!("{name} must be a number")))
                    .unwrap_or(default)
            };
            let (from, n) = (num("TIDEWIRE_VOPR_FROM", 1), num("TIDEWIRE_VOPR_SEEDS", 200));
            (from..from + n).collect()
        }
    };
    if seeds.len() == 1 {
        if let Ok((cfg, _)) = draw(seeds[0]) {
            println!("seed {}: {}", seeds[0], describe(&cfg));
        }
    }
    let started = std::time::Instant::now();
    let (mut finished, mut expected, mut refused) = (0u64, 0u64, 0u64);
    // Jobs that decided in seconds, and how their FC layers went: the rates
    // must lead to both schemes, or the adaptive choice was never drawn.
    let (mut in_seconds, mut fc_sfb, mut fc_ps) = (0u64, 0u64, 0u64);
    // Kvstore jobs whose chunks travel as several wire slices.
    let mut kv_sliced = 0u64;
    // Jobs whose FC layers switch schemes mid-run, and their switches each way.
    let (mut switching, mut to_sfb, mut to_ps) = (0u64, 0u64, 0u64);
    // Adaptive jobs, and those whose decisions switched a layer (finished runs).
    let (mut adaptive, mut decided_switching) = (0u64, 0u64);
    // Of those that switch or decide, the ones whose op keeps momentum (it moves too).
    let mut with_momentum = 0u64;
    let mut violations = Vec::new();
    for &seed in &seeds {
        if let Ok((cfg, _)) = draw(seed) {
            let b = &cfg.book;
            if b.plan().every() > 0 {
                adaptive += 1;
            }
            if (b.plan().every() > 0 || b.plan().has_switches()) && cfg.apply.needs_momentum() {
                with_momentum += 1;
            }
            if b.plan().has_switches() {
                switching += 1;
                for s in b.plan().switches() {
                    match s.scheme {
                        tidewire_engine::Scheme::Sfb => to_sfb += 1,
                        _ => to_ps += 1,
                    }
                }
            }
            if b.config().placement == Placement::KvStore && b.slices().len() > b.chunks().len() {
                kv_sliced += 1;
            }
            if b.rates().is_some() {
                in_seconds += 1;
                for l in 0..b.layers().len() as u32 {
                    if b.seconds(l).is_some() && b.config().policy == SchemePolicy::Hybrid {
                        match b.scheme(l, 0) {
                            tidewire_engine::Scheme::Sfb => fc_sfb += 1,
                            _ => fc_ps += 1,
                        }
                    }
                }
            }
        }
        match run_seed(seed) {
            Ok("finished") => finished += 1,
            Ok("finished, switched") => {
                finished += 1;
                decided_switching += 1;
            }
            Ok("failed as expected") => expected += 1,
            Ok(_) => refused += 1,
            Err(e) => {
                eprintln!("VIOLATION {e}");
                violations.push(seed);
            }
        }
    }
    println!(
        "vopr: {} seeds ({}..={}) in {:.1} s: {finished} finished, {expected} failed with a typed error after a rank died, {refused} drawn tables refused by the book, {} violations",
        seeds.len(),
        seeds.first().unwrap_or(&0),
        seeds.last().unwrap_or(&0),
        started.elapsed().as_secs_f64(),
        violations.len()
    );
    println!(
        "vopr: {in_seconds} jobs decided HybComm in seconds from drawn rates: {fc_sfb} FC layers by SFB, {fc_ps} by the PS"
    );
    println!("vopr: {kv_sliced} kvstore jobs sent chunks as several wire slices");
    println!("vopr: {switching} jobs switched schemes mid-run: {to_sfb} switches to SFB, {to_ps} back to the PS");
    println!("vopr: {adaptive} jobs decided schemes in the run (worker 0, carried by the protocol): {decided_switching} finished runs switched");
    println!("vopr: {with_momentum} of the jobs that switch or decide keep SGD's momentum, which moves with the layer");
    if seeds.len() >= 200 {
        assert!(
            in_seconds > 0 && fc_sfb > 0 && fc_ps > 0,
            "the drawn rates never led to both schemes ({in_seconds} jobs, {fc_sfb} SFB, {fc_ps} PS)"
        );
        assert!(kv_sliced > 0, "no kvstore job with chunks of several slices was drawn");
        assert!(
            decided_switching > 0,
            "no adaptive run switched a layer ({adaptive} adaptive jobs)"
        );
        assert!(with_momentum > 0, "no job that switches kept momentum");
        assert!(
            to_sfb > 0 && to_ps > 0,
            "no job switched both ways ({switching} jobs, {to_sfb} to SFB, {to_ps} to the PS)"
        );
    }
    assert!(
        violations.is_empty(),
        "violating seeds: {violations:?} (rerun one with TIDEWIRE_VOPR_SEED=<seed>)"
    );
}
