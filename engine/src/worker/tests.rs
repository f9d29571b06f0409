//! The worker core's tests: credits, broadcasts, kvstore's push order.

use super::*;
use crate::book::{BookConfig, Cluster, LayerKind, LayerSpec};

/// A kvstore worker (rank 0, FIFO, an unbounded credit window) with every
/// chunk's initial values in, and the pushes of `layer`'s hand-in, each
/// checked to go to its chunk's server: `(slice, server)`.
fn kvstore_pushes(book: &Arc<Book>, layer: u32) -> Vec<(u32, u32)> {
    use crate::config::SyncMode;
    let sched = SchedConfig {
        order: SyncMode::KvStore.order(),
        credit_bytes: usize::MAX,
        ..SchedConfig::default()
    };
    let mut w = Worker::new(book.clone(), 0, sched).unwrap();
    for c in 0..book.chunks().len() as u32 {
        w.handle_params(c).unwrap();
    }
    while w.poll_command().is_some() {}
    w.grad_ready(layer).unwrap();
    std::iter::from_fn(|| w.poll_command())
        .filter_map(|c| match c {
            WorkerCommand::Push { slice, server, .. } => {
                assert_eq!(
                    book.chunks()[book.slices()[slice as usize].chunk as usize].server,
                    server
                );
                Some((slice, server))
            }
            _ => None,
        })
        .collect()
}

/// Kvstore splits a big array into one part a server, each part several
/// wire slices; the worker sends the parts side by side (round-robin over
/// the servers), as MXNet's `ZPush` sends every server its part at once,
/// never one part whole before the next.
#[test]
fn kvstore_pushes_a_big_array_s_parts_to_every_server_at_once() {
    use crate::config::SyncMode;
    for (p2, chunk_bytes) in [(3, 4096), (2, 64 << 10), (4, 256 << 10)] {
        let cfg = SyncMode::KvStore.book_config(BookConfig {
            chunk_bytes,
            ..Default::default()
        });
        let book = Arc::new(
            Book::new(
                Cluster::split(1, p2).unwrap(),
                vec![
                    LayerSpec::new("small", LayerKind::Conv, 8, 27),
                    LayerSpec::new("fc6", LayerKind::Fc, 1000, 1003),
                ],
                cfg,
            )
            .unwrap(),
        );
        let parts = book.layer_chunks(1);
        assert_eq!(parts.len(), p2, "one part a server");
        assert!(
            parts.clone().all(|c| book.chunk_slices(c).len() > 1),
            "parts of several slices"
        );
        let servers: Vec<u32> = kvstore_pushes(&book, 1).into_iter().map(|(_, s)| s).collect();
        // Every slot of every server was lent at the start: the first
        // round goes to each server once, and so does every later one.
        let per_round = p2;
        assert!(servers.len() >= 2 * per_round, "p2 {p2}: {servers:?}");
        for round in servers.chunks(per_round).filter(|r| r.len() == per_round) {
            let mut r = round.to_vec();
            r.sort_unstable();
            r.dedup();
            assert_eq!(r.len(), per_round, "p2 {p2}: a round took a server twice: {servers:?}");
        }
    }
}

/// Parts of unequal slice counts: 1,000,001 parameters over 2 servers
/// are parts of 500,001 and 500,000, cut into slices of 500,000. The
/// longer part's last slice goes after both parts' first.
#[test]
fn kvstore_alternates_parts_of_unequal_slice_counts() {
    use crate::config::SyncMode;
    let cfg = SyncMode::KvStore.book_config(BookConfig {
        chunk_bytes: 2_000_000,
        ..Default::default()
    });
    let layers = vec![LayerSpec::new("fc", LayerKind::Fc, 101, 9901)];
    let book = Arc::new(Book::new(Cluster::split(1, 2).unwrap(), layers, cfg).unwrap());
    let parts: Vec<_> = book.layer_chunks(0).map(|c| book.chunk_slices(c)).collect();
    assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), [2, 1], "{parts:?}");
    let order: Vec<u32> = kvstore_pushes(&book, 0).into_iter().map(|(s, _)| s).collect();
    assert_eq!(order, [parts[0].start, parts[1].start, parts[0].start + 1]);
}

#[test]
fn only_a_server_lends_credit() {
    // Ranks 0 and 1 work, rank 2 serves.
    let book = Book::new(
        Cluster::split(2, 1).unwrap(),
        vec![LayerSpec::new("l", LayerKind::Conv, 1, 8)],
        BookConfig::default(),
    )
    .unwrap();
    let mut w = Worker::new(Arc::new(book), 0, SchedConfig::default()).unwrap();
    let free = w.free_credits();
    for (from, what) in [(1, "a worker"), (7, "a rank outside the cluster")] {
        match w.handle_credit(from, 0) {
            Err(EngineError::Protocol {
                rank,
                violation: ProtocolViolation::CreditFromOutside,
            }) => assert_eq!(rank, from),
            other => panic!("credit from {what}: {other:?}"),
        }
    }
    // The server's own slots are all free at the start: a credit for
    // one of them was not lent.
    assert!(matches!(
        w.handle_credit(2, 0),
        Err(EngineError::Protocol {
            violation: ProtocolViolation::CreditNotLent { slot: 0 },
            ..
        })
    ));
    assert_eq!(w.free_credits(), free, "nothing was taken in");
}

#[test]
fn under_bsp_a_chunk_broadcast_twice_in_an_iteration_is_a_violation() {
    // Two chunks, so that the worker is still being seeded after the first.
    let book = Book::new(
        Cluster::split(2, 1).unwrap(),
        vec![LayerSpec::new("l", LayerKind::Conv, 1, 8)],
        BookConfig {
            chunk_bytes: 16,
            slice_params: 4,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(book.chunks().len(), 2);
    let mut w = Worker::new(Arc::new(book), 0, SchedConfig::default()).unwrap();
    w.handle_params(0).unwrap();
    match w.handle_params(0) {
        Err(EngineError::Protocol {
            violation: ProtocolViolation::ParamsTwice { chunk: 0, updates: 2 },
            ..
        }) => {}
        other => panic!("chunk 0's initial values twice: {other:?}"),
    }
    // The other chunk's first values are still taken.
    w.handle_params(1).unwrap();
}

/// Momentum that moves: a layer that leaves the PS at 1 is rebuilt at 1
/// only once its server's momentum of both chunks is in; momentum from
/// another rank, for an iteration without a switch, or twice is refused.
#[test]
fn leaving_the_ps_the_reconstruction_waits_for_the_servers_momentum() {
    let book = Book::new(
        Cluster::split(2, 1).unwrap(),
        vec![LayerSpec::new("fc", LayerKind::Fc, 1, 8)],
        BookConfig {
            chunk_bytes: 16,
            slice_params: 4,
            policy: crate::book::SchemePolicy::Ps,
            ..Default::default()
        },
    )
    .unwrap()
    .with_switches(&[crate::plan::Switch {
        layer: 0,
        iter: 1,
        scheme: Scheme::Sfb,
    }])
    .unwrap();
    assert_eq!(book.chunks().len(), 2);
    let mut w = Worker::new(Arc::new(book), 1, SchedConfig::default())
        .unwrap()
        .with_momentum(true);
    let drain = |w: &mut Worker| std::iter::from_fn(|| w.poll_command()).collect::<Vec<_>>();
    for c in 0..2 {
        w.handle_params(c).unwrap();
    }
    // Iteration 0 by the PS: both slices pushed, both chunks broadcast.
    w.grad_ready(0).unwrap();
    for cmd in drain(&mut w) {
        if let WorkerCommand::Push { slice, .. } = cmd {
            w.handle_push_done(slice).unwrap();
        }
    }
    for c in 0..2 {
        w.handle_params(c).unwrap();
    }
    assert!(drain(&mut w).contains(&WorkerCommand::LayerReady { layer: 0, iter: 0 }));
    // Iteration 1 by SFB: every worker's factors are in, the momentum is not.
    w.sf_ready(0).unwrap();
    drain(&mut w);
    w.handle_factors_sent(0, 0).unwrap();
    // This worker's own factors count at its hand-in; the peer's come.
    w.handle_factors_arrived(0, 1, 0).unwrap();
    let rebuilds = |cmds: &[WorkerCommand]| {
        cmds.iter()
            .filter(|c| matches!(c, WorkerCommand::Reconstruct { .. }))
            .count()
    };
    assert_eq!(rebuilds(&drain(&mut w)), 0, "no momentum yet");
    let unexpected = |r: Result<()>, want: ProtocolViolation| match r {
        Err(EngineError::Protocol { violation, .. }) => assert_eq!(violation, want),
        other => panic!("{other:?}, where {want:?} was due"),
    };
    unexpected(
        w.accept_momentum(0, 1, 0),
        ProtocolViolation::MomentumUnexpected { chunk: 0, iter: 1 },
    );
    unexpected(
        w.accept_momentum(0, 2, 2),
        ProtocolViolation::MomentumUnexpected { chunk: 0, iter: 2 },
    );
    unexpected(
        w.handle_momentum_in(1, 1, 2),
        ProtocolViolation::MomentumUnexpected { chunk: 1, iter: 1 },
    );
    w.accept_momentum(0, 1, 2).unwrap();
    unexpected(
        w.accept_momentum(0, 1, 2),
        ProtocolViolation::MomentumTwice { chunk: 0, iter: 1 },
    );
    w.handle_momentum_in(0, 1, 2).unwrap();
    assert_eq!(rebuilds(&drain(&mut w)), 0, "one chunk's momentum of two");
    w.accept_momentum(1, 1, 2).unwrap();
    w.handle_momentum_in(1, 1, 2).unwrap();
    assert_eq!(drain(&mut w), [WorkerCommand::Reconstruct { layer: 0, iter: 1 }]);
}

/// Under P3's priority order a factor message goes ahead of every
/// push, even a lower layer's: its receiver still has the rebuild to run.
/// A window of one item at a time shows the order item by item.
#[test]
fn under_priority_factors_go_ahead_of_every_push() {
    let book = Book::new(
        Cluster::split(3, 1).unwrap(),
        vec![
            LayerSpec::new("conv", LayerKind::Conv, 1, 12),
            LayerSpec::new("fc", LayerKind::Fc, 4, 4),
        ],
        BookConfig {
            chunk_bytes: 16,
            slice_params: 4,
            policy: crate::book::SchemePolicy::Sfb,
            batch: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let conv_slices = book.layer_slices(0);
    assert_eq!(conv_slices.len(), 3, "three slices of the conv layer");
    let chunks = book.chunks().len() as u32;
    let sched = SchedConfig {
        order: QueueOrder::Priority,
        credit_bytes: 1,
        ..SchedConfig::default()
    };
    let mut w = Worker::new(Arc::new(book), 0, sched).unwrap();
    let drain = |w: &mut Worker| std::iter::from_fn(|| w.poll_command()).collect::<Vec<_>>();
    for c in 0..chunks {
        w.handle_params(c).unwrap();
    }
    drain(&mut w);
    // The conv layer's gradient first: its first slice goes, alone.
    w.grad_ready(0).unwrap();
    let first = drain(&mut w);
    assert!(
        matches!(first[..], [WorkerCommand::Push { slice, .. }] if slice == conv_slices.start),
        "{first:?}"
    );
    // Then the FC layer's factors: queued behind a lower layer's slices,
    // they still go next, one per peer, before the conv's other slices.
    assert!(w.sf_ready(1).unwrap());
    assert!(drain(&mut w).is_empty(), "the window holds one item");
    w.handle_push_done(conv_slices.start).unwrap();
    let mut order = Vec::new();
    for _ in 0..4 {
        let cmds = drain(&mut w);
        assert_eq!(cmds.len(), 1, "one item at a time: {cmds:?}");
        match cmds[0] {
            WorkerCommand::SendFactors { peer, layer, .. } => {
                order.push(format!("factors to {peer}"));
                w.handle_factors_sent(layer, peer).unwrap();
            }
            WorkerCommand::Push { slice, .. } => {
                order.push(format!("slice {slice}"));
                w.handle_push_done(slice).unwrap();
            }
            ref other => panic!("{other:?}"),
        }
    }
    let want = [
        "factors to 1".to_string(),
        "factors to 2".into(),
        format!("slice {}", conv_slices.start + 1),
        format!("slice {}", conv_slices.start + 2),
    ];
    assert_eq!(order, want);
}
