//! The aggregation triggers in the simulated cluster (issue 19): a straggler
//! costs BSP its pace but not a quorum or a timeout; a crashed worker fails a
//! BSP job with an error naming it, and the others go on under the other
//! triggers. Virtual time, so the figures are exact and repeatable.

use std::sync::Arc;
use std::time::Duration;

use tidewire_engine::book::{LayerKind, LayerSpec};
use tidewire_engine::node::{Node, NodeConfig};
use tidewire_engine::{Book, BookConfig, Cluster, EngineError, SchemePolicy, SyncMode, Trigger};
use tidewire_sim::{Sim, SimConfig, SimError, SimReport};

/// Four workers and two servers on hosts of their own, a small PS-only model.
fn job(trigger: Trigger, slow: Option<(u32, f64)>, crash: Option<(u32, u64)>) -> SimConfig {
    let layers = vec![
        LayerSpec::new("conv1", LayerKind::Conv, 8, 27),
        LayerSpec::new("conv2", LayerKind::Conv, 16, 72),
        LayerSpec::new("fc", LayerKind::Fc, 64, 80),
    ];
    let mode = SyncMode::P3;
    let bc = BookConfig {
        batch: 2,
        chunk_bytes: 1024,
        slice_params: 50,
        ..mode.book_config(BookConfig::default())
    };
    let book = Arc::new(Book::new(Cluster::split(4, 2).unwrap(), layers, bc).unwrap());
    let mut cfg = SimConfig::new(book, mode, vec![(200_000, 400_000); 3], 12);
    cfg.values = true;
    cfg.bandwidth_bps = 1e9;
    cfg.sched.trigger = trigger;
    if let Some((r, f)) = slow {
        cfg.faults.slow = vec![(r, f, 0, u64::MAX)];
    }
    cfg.faults.crash = crash;
    cfg
}

fn run(cfg: SimConfig) -> SimReport {
    Sim::run(cfg).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_straggler_slows_bsp_to_its_pace_but_not_a_quorum_or_a_timeout() {
    let plain = run(job(Trigger::All, None, None));
    let base = plain.updates_ns as f64;
    let slow = Some((1, 5.0));
    let bsp = run(job(Trigger::All, slow, None));
    let quorum = run(job(Trigger::Quorum(3), slow, None));
    // The timeout is on the critical path of every round the straggler
    // misses: it must be small against the iteration (1.8 ms of compute here).
    let timeouts: Vec<(u64, SimReport)> = [50, 100, 300]
        .iter()
        .map(|&us| (us, run(job(Trigger::Timeout(Duration::from_micros(us)), slow, None))))
        .collect();
    let timeout = &timeouts[1].1;
    let asynch = run(job(Trigger::Async, slow, None));
    // Model updates per unit of time, relative to the run without a straggler.
    let rel = |r: &SimReport| base / r.updates_ns as f64;
    let ts: Vec<String> = timeouts
        .iter()
        .map(|(us, r)| format!("timeout:{us}µs {:.3}", rel(r)))
        .collect();
    println!(
        "relative update rate with worker 1 five times slower: all {:.3}, quorum:3 {:.3}, {}, async {:.3} (last update; async folds the straggler's gradients until it ends)",
        rel(&bsp),
        rel(&quorum),
        ts.join(", "),
        rel(&asynch)
    );
    assert!(rel(&bsp) < 0.3, "BSP waits for the straggler: {}", rel(&bsp));
    assert!(rel(&quorum) >= 0.9, "quorum: {}", rel(&quorum));
    assert!(rel(timeout) >= 0.9, "timeout: {}", rel(timeout));
    assert!(
        quorum.dropped > 0 && timeout.dropped > 0,
        "the straggler's gradients come late"
    );
    assert_eq!((asynch.dropped, bsp.dropped), (0, 0));
    assert!(asynch.late_folded > 0);
    // Under async the model changes until the straggler's last gradient is
    // in; the others run at their own pace: worker 0's iterations, relative.
    let pace = plain.worker_done_ns[0] as f64 / asynch.worker_done_ns[0] as f64;
    println!("async: worker 0 runs at {pace:.3} of its pace without a straggler");
    assert!(pace >= 0.9, "async: {pace}");
}

#[test]
fn a_crashed_worker_fails_bsp_naming_it_and_the_others_go_on_otherwise() {
    match Sim::run(job(Trigger::All, None, Some((2, 5)))) {
        Err(SimError::Rank { error, .. }) => {
            assert!(
                matches!(error, EngineError::PeerLost { rank: 2, .. }) || error.to_string().contains("rank 2"),
                "{error}"
            );
        }
        other => panic!("{other:?}"),
    }
    for t in [
        Trigger::Quorum(3),
        Trigger::Async,
        Trigger::Timeout(Duration::from_micros(500)),
    ] {
        let r = run(job(t, None, Some((2, 5))));
        assert_eq!(r.worker_iters, vec![12, 12, 5, 12], "{t:?}");
    }
    // A quorum of all four cannot be reached once one crashed: a clear error naming it.
    match Sim::run(job(Trigger::Quorum(4), None, Some((2, 5)))) {
        Err(SimError::Rank {
            error: EngineError::PeerLost { rank: 2, reason },
            ..
        }) => assert!(reason.contains("quorum"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_crashed_worker_rejoins_takes_the_current_parameters_and_counts_again() {
    for t in [
        Trigger::Quorum(3),
        Trigger::Async,
        Trigger::Timeout(Duration::from_micros(500)),
    ] {
        let gone = run(job(t, None, Some((2, 3))));
        let mut cfg = job(t, None, Some((2, 3)));
        cfg.faults.rejoin_after_ns = Some(1);
        let r = run(cfg);
        assert_eq!(r.rejoined, 1, "{t:?}");
        // Its gradients count again (on time, or folded under async).
        let (before, after) = (gone.accumulated_by_worker[2], r.accumulated_by_worker[2]);
        println!("{t:?}: worker 2's slices accumulated: {before} without the rejoin, {after} with it");
        assert!(after > before, "{t:?}: {before} -> {after}");
        // It ran the iterations it had left, and its pushes counted again.
        assert_eq!(r.worker_iters, vec![12, 12, 12, 12], "{t:?}");
        assert!(r.applies > 0);
    }
    // Under all, a crash ends the job: nothing to rejoin.
    let mut cfg = job(Trigger::All, None, Some((2, 3)));
    cfg.faults.rejoin_after_ns = Some(1);
    assert!(Sim::run(cfg).is_err());
}

#[test]
fn sfb_layers_are_refused_under_the_other_triggers() {
    let layers = vec![LayerSpec::new("fc", LayerKind::Fc, 64, 80)];
    let bc = BookConfig {
        policy: SchemePolicy::Sfb,
        ..BookConfig::default()
    };
    let book = Arc::new(Book::new(Cluster::colocated(2).unwrap(), layers, bc).unwrap());
    let mut nc = NodeConfig::new(book, 0);
    nc.sched.trigger = Trigger::Quorum(1);
    match Node::new(nc) {
        Err(EngineError::InvalidConfig(m)) => assert!(m.contains("SFB"), "{m}"),
        other => panic!("{other:?}"),
    }
}
