//! The server core's tests: rank order, triggers, spares, seeding.

use super::*;
use crate::book::{BookConfig, Cluster, LayerKind, LayerSpec};
use crate::config::Consistency;

/// Three workers (ranks 0..3) and one server (rank 3), one chunk of two slices.
fn server(trigger: Trigger) -> Server {
    let book = Book::new(
        Cluster::split(3, 1).unwrap(),
        vec![LayerSpec::new("l", LayerKind::Conv, 1, 8)],
        BookConfig {
            chunk_bytes: 1024,
            slice_params: 4,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(book.chunk_slices(0).len(), 2);
    let cfg = SchedConfig {
        trigger,
        ..SchedConfig::default()
    };
    let mut s = Server::new(Arc::new(book), 3, cfg).unwrap();
    s.handle_init(0, 0).unwrap();
    s.drain();
    for w in 0..3 {
        s.handle_broadcast_done(0, w).unwrap();
    }
    s
}

impl Server {
    fn drain(&mut self) -> Vec<ServerCommand> {
        std::iter::from_fn(|| self.poll_command()).collect()
    }
    fn applies(cmds: &[ServerCommand]) -> Vec<(u64, u32)> {
        cmds.iter()
            .filter_map(|c| match c {
                ServerCommand::Apply { iter, gradients, .. } => Some((*iter, *gradients)),
                _ => None,
            })
            .collect()
    }
    /// Worker `w` pushes both slices (slots 0 and 1).
    fn push(&mut self, w: u32) -> Vec<ServerCommand> {
        self.handle_landed(w, 0, 0).unwrap();
        self.handle_landed(w, 1, 1).unwrap();
        self.drain()
    }
    fn bcast_done(&mut self) {
        for w in 0..3 {
            if !self.is_lost(w as usize) {
                self.handle_broadcast_done(0, w).unwrap();
            }
        }
    }
}

#[test]
fn a_chunk_seeded_twice_is_refused_and_not_counted_for_another() {
    // One server (rank 2) holding two chunks of 4 parameters.
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
    assert_eq!(book.server_chunks(2).len(), 2);
    let mut s = Server::new(Arc::new(book), 2, SchedConfig::default()).unwrap();
    s.handle_init(0, 0).unwrap();
    match s.handle_init(1, 0) {
        Err(EngineError::Protocol {
            rank: 1,
            violation: ProtocolViolation::InitTwice { chunk: 0 },
        }) => {}
        other => panic!("a second seeding of chunk 0: {other:?}"),
    }
    // Chunk 1 is still unseeded: nothing is broadcast until it comes.
    assert!(!s.drain().iter().any(|c| matches!(c, ServerCommand::Broadcast { .. })));
}

#[test]
fn rank_order_parks_early_pushes_and_lends_a_spare_in_their_place() {
    let book = server(Trigger::All).book.clone();
    let cfg = SchedConfig {
        slots: 1,
        spare_slots: 1,
        ..SchedConfig::default()
    };
    let mut s = Server::new(book, 3, cfg).unwrap();
    s.handle_init(0, 0).unwrap();
    s.drain();
    s.bcast_done();
    let accs = |cmds: &[ServerCommand]| -> Vec<(u32, u32, bool)> {
        cmds.iter()
            .filter_map(|c| match *c {
                ServerCommand::Accumulate {
                    worker, slot, credit, ..
                } => Some((worker, slot, credit)),
                _ => None,
            })
            .collect()
    };
    // Worker 2's slice 0 lands first: parked, and its spare (slot 1) is lent at once.
    s.handle_landed(2, 0, 0).unwrap();
    assert_eq!(s.drain(), vec![ServerCommand::Credit { worker: 2, slot: 1 }]);
    // Its slice 1 in that spare: no spare is left, so it holds its credit.
    s.handle_landed(2, 1, 1).unwrap();
    assert!(s.drain().is_empty());
    assert_eq!(
        (s.stats().parked, s.stats().held_for_order, s.stats().max_spares_used),
        (1, 1, 1)
    );
    // Workers 0 and 1: the parked slot is read in rank order, without a credit.
    s.handle_landed(0, 0, 0).unwrap();
    assert_eq!(accs(&s.drain()), vec![(0, 0, true)]);
    s.handle_landed(1, 0, 0).unwrap();
    assert_eq!(accs(&s.drain()), vec![(1, 0, true), (2, 0, false)]);
    s.handle_parked_read(2, 0).unwrap();
    assert!(s.handle_parked_read(2, 0).is_err(), "a parked slot freed twice");
    s.handle_landed(0, 0, 1).unwrap();
    s.handle_landed(1, 0, 1).unwrap();
    let cmds = s.drain();
    assert_eq!(accs(&cmds), vec![(0, 0, true), (1, 0, true), (2, 1, true)]);
    assert_eq!(Server::applies(&cmds), vec![(0, 3)]);
    // A slot beyond slots + spares is refused.
    s.bcast_done();
    assert!(s.handle_landed(0, 2, 0).is_err());
}

#[test]
fn adam_sums_every_worker_s_factors_then_applies_the_whole_layer() {
    use crate::book::SchemePolicy;
    // Two workers, two servers; a conv layer (PS, sharded) and an FC layer
    // of 3 chunks (Adam: all on one server).
    let book = Arc::new(
        Book::new(
            Cluster::split(2, 2).unwrap(),
            vec![
                LayerSpec::new("conv", LayerKind::Conv, 4, 8),
                LayerSpec::new("fc", LayerKind::Fc, 6, 10),
            ],
            BookConfig {
                chunk_bytes: 80,
                policy: SchemePolicy::Adam,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    assert_eq!(book.scheme(0, 0), Scheme::Ps);
    assert_eq!(book.scheme(1, 0), Scheme::Adam);
    let fc = book.layer_chunks(1);
    assert_eq!(fc.len(), 3);
    let holder = book.chunks()[fc.start as usize].server;
    assert!(
        fc.clone().all(|c| book.chunks()[c as usize].server == holder),
        "the layer is whole on one server"
    );
    let other = if holder == 2 { 3 } else { 2 };
    let mut s = Server::new(book.clone(), holder, SchedConfig::default()).unwrap();
    assert!(
        s.handle_factors(0, 1, 0).is_err(),
        "factors before the shard was seeded"
    );
    for c in book.server_chunks(holder).to_vec() {
        s.handle_init(0, c).unwrap();
    }
    s.drain();
    for c in book.server_chunks(holder).to_vec() {
        for w in 0..2 {
            s.handle_broadcast_done(c, w).unwrap();
        }
    }
    assert!(s.handle_factors(0, 0, 0).is_err(), "a PS layer has no factors");
    assert!(s.handle_factors(0, 1, 1).is_err(), "an iteration ahead of the layer's");
    assert!(s.handle_factors(holder, 1, 0).is_err(), "a server is not a worker");
    s.handle_factors(1, 1, 0).unwrap();
    assert!(s.drain().is_empty(), "one worker's of two");
    assert!(s.handle_factors(1, 1, 0).is_err(), "a second block from one worker");
    s.handle_factors(0, 1, 0).unwrap();
    let cmds = s.drain();
    assert_eq!(
        cmds[0],
        ServerCommand::SumFactors {
            layer: 1,
            iter: 0,
            window: 0
        },
        "the sum runs before the applies: {cmds:?}"
    );
    let applied: Vec<u32> = cmds
        .iter()
        .filter_map(|c| match *c {
            ServerCommand::Apply {
                chunk,
                iter: 0,
                gradients: 2,
                ..
            } => Some(chunk),
            _ => None,
        })
        .collect();
    assert_eq!(applied, fc.clone().collect::<Vec<_>>());
    assert_eq!((s.stats().factor_blocks, s.stats().factor_sums), (2, 1));
    // Iteration 1 is the next; iteration 0 again is refused.
    assert!(s.handle_factors(0, 1, 0).is_err());
    s.handle_factors(0, 1, 1).unwrap();
    // Iteration 1 is summed while version 1's broadcasts are still out:
    // its applies wait, and a resent block of iteration 1 is refused.
    s.handle_factors(1, 1, 1).unwrap();
    let cmds = s.drain();
    assert!(cmds.contains(&ServerCommand::SumFactors {
        layer: 1,
        iter: 1,
        window: 0
    }));
    assert!(Server::applies(&cmds).is_empty(), "{cmds:?}");
    assert!(
        s.handle_factors(1, 1, 1).is_err(),
        "a block of an iteration already summed"
    );
    for c in fc.clone() {
        for w in 0..2 {
            s.handle_broadcast_done(c, w).unwrap();
        }
    }
    assert_eq!(Server::applies(&s.drain()), vec![(1, 2); fc.len()]);
    // The server that does not hold the layer refuses its factors.
    let mut o = Server::new(book.clone(), other, SchedConfig::default()).unwrap();
    for c in book.server_chunks(other).to_vec() {
        o.handle_init(0, c).unwrap();
    }
    assert!(o.handle_factors(0, 1, 0).is_err());
}

#[test]
fn a_quorum_applies_at_k_and_drops_late_contributions_with_their_credits() {
    let mut s = server(Trigger::Quorum(2));
    assert!(Server::applies(&s.push(0)).is_empty(), "one of two");
    // Half of worker 1 is in: not yet complete.
    s.handle_landed(1, 0, 0).unwrap();
    assert!(Server::applies(&s.drain()).is_empty());
    s.handle_landed(1, 1, 1).unwrap();
    assert_eq!(
        Server::applies(&s.drain()),
        vec![(0, 2)],
        "two contributions, mean over two"
    );
    s.bcast_done();
    // Worker 2's iteration 0 comes late: dropped, credits back at once.
    let cmds = s.push(2);
    assert!(Server::applies(&cmds).is_empty());
    let drops = cmds
        .iter()
        .filter(|c| matches!(c, ServerCommand::Drop { worker: 2, .. }))
        .count();
    assert_eq!(drops, 2);
    assert_eq!(s.stats().dropped, 2);
    assert_eq!(s.stats().partial_applies, 1);
}

#[test]
fn async_folds_late_contributions_into_the_next_round() {
    let mut s = server(Trigger::Async);
    assert_eq!(Server::applies(&s.push(0)), vec![(0, 1)]);
    s.bcast_done();
    // Workers 1 and 2 are late for iteration 0: folded into round 1.
    assert_eq!(Server::applies(&s.push(1)), vec![(1, 1)]);
    // A broadcast is out: the next round waits for it, and holds two.
    assert!(Server::applies(&s.push(2)).is_empty());
    assert!(Server::applies(&s.push(0)).is_empty());
    s.bcast_done();
    assert_eq!(Server::applies(&s.drain()), vec![(2, 2)]);
    // Late: workers 1 and 2's iteration 0, and worker 0's iteration 1 (round 1 was applied).
    assert_eq!((s.stats().dropped, s.stats().late_folded), (0, 6));
}

#[test]
fn a_timeout_applies_what_is_in_no_earlier_than_its_deadline() {
    let d = Duration::from_millis(5);
    let mut s = server(Trigger::Timeout(d));
    s.set_now(Duration::from_millis(100));
    assert!(Server::applies(&s.push(0)).is_empty());
    assert_eq!(s.next_deadline(), Some(Duration::from_millis(105)));
    s.set_now(Duration::from_millis(104));
    s.handle_tick();
    assert!(Server::applies(&s.drain()).is_empty(), "before the deadline");
    s.set_now(Duration::from_millis(105));
    s.handle_tick();
    assert_eq!(Server::applies(&s.drain()), vec![(0, 1)]);
    s.bcast_done();
    // Workers 1 and 2's iteration 0 is late now: dropped.
    s.set_now(Duration::from_millis(200));
    s.push(1);
    s.push(2);
    assert_eq!(s.stats().dropped, 4);
    // Everyone's iteration 1 in: at once, without waiting.
    s.push(0);
    s.push(1);
    assert_eq!(Server::applies(&s.push(2)), vec![(1, 3)]);
}

#[test]
fn a_lost_worker_stops_counting_or_fails_the_round_it_left_half_done() {
    let mut s = server(Trigger::Quorum(2));
    s.handle_worker_lost(2).unwrap();
    assert_eq!(s.live_workers(), 2);
    s.push(0);
    assert_eq!(Server::applies(&s.push(1)), vec![(0, 2)]);
    // Below the quorum: a clear error naming the rank.
    let e = s.handle_worker_lost(1).unwrap_err();
    assert!(matches!(e, EngineError::PeerLost { rank: 1, .. }), "{e}");

    let mut s = server(Trigger::Async);
    s.handle_landed(1, 0, 0).unwrap();
    let e = s.handle_worker_lost(1).unwrap_err();
    assert!(e.to_string().contains("1 of the 2 slices"), "{e}");

    let mut s = server(Trigger::All);
    assert!(s.handle_worker_lost(0).is_err(), "all: any loss fails");
}

#[test]
fn triggers_refuse_what_they_cannot_keep_sound() {
    let ssp = SchedConfig {
        trigger: Trigger::Async,
        consistency: Consistency::Ssp(1),
        ..SchedConfig::default()
    };
    assert!(ssp.validate().is_err());
    let fold = SchedConfig {
        trigger: Trigger::Quorum(1),
        fold_group: 2,
        ..SchedConfig::default()
    };
    assert!(fold.validate().is_err());
    for t in [Trigger::Quorum(0), Trigger::Timeout(Duration::ZERO)] {
        let c = SchedConfig {
            trigger: t,
            ..SchedConfig::default()
        };
        assert!(c.validate().is_err(), "{t:?}");
    }
    let book = server(Trigger::All).book.clone();
    let big = SchedConfig {
        trigger: Trigger::Quorum(4),
        ..SchedConfig::default()
    };
    assert!(Server::new(book, 3, big).is_err(), "a quorum above P1");
    for (s, t) in [
        ("all", Trigger::All),
        ("quorum:3", Trigger::Quorum(3)),
        ("async", Trigger::Async),
        ("timeout:2.5", Trigger::Timeout(Duration::from_micros(2500))),
    ] {
        assert_eq!(Trigger::parse(s), Some(t));
        assert_eq!(Trigger::parse(&t.name()), Some(t));
    }
    for bad in ["quorum:", "quorum:x", "timeout:0", "timeout:-1", "some"] {
        assert_eq!(Trigger::parse(bad), None, "{bad}");
    }
}

/// Three workers and one server, one FC layer of 8 parameters on the PS:
/// one chunk of two slices.
fn fc_book() -> Book {
    Book::new(
        Cluster::split(3, 1).unwrap(),
        vec![LayerSpec::new("fc", LayerKind::Fc, 1, 8)],
        BookConfig {
            chunk_bytes: 1024,
            slice_params: 4,
            policy: crate::book::SchemePolicy::Ps,
            ..Default::default()
        },
    )
    .unwrap()
}

/// The FC layer of [`fc_book`] to SFB at 1 and back to the PS at 3.
const SFB_AT_1_PS_AT_3: [crate::plan::Switch; 2] = [
    crate::plan::Switch {
        layer: 0,
        iter: 1,
        scheme: Scheme::Sfb,
    },
    crate::plan::Switch {
        layer: 0,
        iter: 3,
        scheme: Scheme::Ps,
    },
];

/// A layer that switches to SFB at 1 and back to the PS at 3: its rounds
/// are iterations 0, 3, 4; round 3 waits for worker 0's values (a write
/// from another worker, or a second one, is refused), then applies.
#[test]
fn back_from_sfb_a_round_waits_for_worker_0s_values() {
    let book = fc_book().with_switches(&SFB_AT_1_PS_AT_3).unwrap();
    let mut s = Server::new(Arc::new(book), 3, SchedConfig::default()).unwrap();
    s.handle_init(0, 0).unwrap();
    s.drain();
    s.bcast_done();
    let round = |s: &mut Server| (0..3).flat_map(|w| s.push(w)).collect::<Vec<_>>();
    assert_eq!(Server::applies(&round(&mut s)), [(0, 3)]);
    s.bcast_done();
    // Iteration 3's contributions are in, but the shard still holds iteration 0's values.
    assert_eq!(Server::applies(&round(&mut s)), []);
    let refused = s.handle_init(1, 0).unwrap_err();
    assert!(
        matches!(
            refused,
            EngineError::Protocol {
                rank: 1,
                violation: ProtocolViolation::ReseedUnexpected { chunk: 0, round: 1 }
            }
        ),
        "{refused:?}"
    );
    s.handle_init(0, 0).unwrap();
    assert_eq!(Server::applies(&s.drain()), [(3, 3)]);
    assert!(s.handle_init(0, 0).is_err(), "a second write of the values");
    s.bcast_done();
    assert_eq!(Server::applies(&round(&mut s)), [(4, 3)]);
    assert_eq!(s.applied(0), Some(3));
}

/// One FC layer on the PS, decided every 2 iterations: rounds 0 and 1 are
/// iterations 0 and 1.
fn adaptive_server() -> Server {
    let book = fc_book().with_adaptive(2).unwrap();
    let mut s = Server::new(Arc::new(book), 3, SchedConfig::default()).unwrap();
    s.handle_init(0, 0).unwrap();
    s.drain();
    s.bcast_done();
    let round = |s: &mut Server| (0..3).flat_map(|w| s.push(w)).collect::<Vec<_>>();
    for t in 0..2 {
        assert_eq!(Server::applies(&round(&mut s)), [(t, 3)]);
        s.bcast_done();
    }
    s
}

/// Worker 0's write back lands before both decisions (SFB at 2, the PS again
/// at 4; writes and messages are not ordered), and so do round 2's pushes:
/// the round is applied for iteration 4 once the last decision comes.
#[test]
fn a_write_back_before_its_decisions_waits_for_them() {
    let mut s = adaptive_server();
    s.handle_init(0, 0).unwrap();
    assert_eq!(Server::applies(&(0..3).flat_map(|w| s.push(w)).collect::<Vec<_>>()), []);
    s.decide(2, 1).unwrap();
    assert_eq!(Server::applies(&s.drain()), [], "the layer is on SFB at 2 and 3");
    s.decide(4, 0).unwrap();
    assert_eq!(Server::applies(&s.drain()), [(4, 3)]);
}

/// Pushes first, then both decisions, then the write back.
#[test]
fn pushes_then_decisions_then_the_write_back() {
    let mut s = adaptive_server();
    assert_eq!(Server::applies(&(0..3).flat_map(|w| s.push(w)).collect::<Vec<_>>()), []);
    s.decide(2, 1).unwrap();
    s.decide(4, 0).unwrap();
    assert_eq!(Server::applies(&s.drain()), []);
    s.handle_init(0, 0).unwrap();
    assert_eq!(Server::applies(&s.drain()), [(4, 3)]);
}

/// A write back that came early and that no decision asks for is refused
/// when the decision comes; a decision for another point is refused whole.
#[test]
fn an_early_write_back_no_decision_asks_for_is_refused() {
    let mut s = adaptive_server();
    s.handle_init(0, 0).unwrap();
    assert!(matches!(
        s.decide(4, 0),
        Err(EngineError::Protocol {
            violation: ProtocolViolation::BadDecision { at: 4, .. },
            ..
        })
    ));
    let e = s.decide(2, 0).unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::Protocol {
                rank: 0,
                violation: ProtocolViolation::ReseedUnexpected { chunk: 0, round: 2 }
            }
        ),
        "{e:?}"
    );
}

/// The server's sends of momentum in a list of commands: (chunk, iteration).
fn momentum_sends(cmds: &[ServerCommand]) -> Vec<(u32, u64)> {
    cmds.iter()
        .filter_map(|c| match c {
            ServerCommand::SendMomentum { chunk, iter } => Some((*chunk, *iter)),
            _ => None,
        })
        .collect()
}

/// With momentum that moves: the layer leaves the PS at 1 and comes back at
/// 3. Round 0's apply sends the shard's momentum to the workers once (for
/// iteration 1); round 3 waits for worker 0's values and its momentum, in
/// either order, and momentum from another worker, or twice, is refused.
#[test]
fn momentum_leaves_with_the_layer_and_comes_back_with_worker_0s_values() {
    for momentum_first in [false, true] {
        let book = fc_book().with_switches(&SFB_AT_1_PS_AT_3).unwrap();
        let mut s = Server::new(Arc::new(book), 3, SchedConfig::default())
            .unwrap()
            .with_momentum(true);
        s.handle_init(0, 0).unwrap();
        assert_eq!(momentum_sends(&s.drain()), [], "the initial values send no momentum");
        s.bcast_done();
        let round = |s: &mut Server| (0..3).flat_map(|w| s.push(w)).collect::<Vec<_>>();
        let cmds = round(&mut s);
        assert_eq!(Server::applies(&cmds), [(0, 3)]);
        assert_eq!(momentum_sends(&cmds), [(0, 1)], "momentum {momentum_first}");
        s.bcast_done();
        assert_eq!(Server::applies(&round(&mut s)), []);
        let refused = s.accept_momentum(2, 0, 3).unwrap_err();
        assert!(
            matches!(
                refused,
                EngineError::Protocol {
                    rank: 2,
                    violation: ProtocolViolation::MomentumUnexpected { chunk: 0, iter: 3 }
                }
            ),
            "{refused:?}"
        );
        assert!(s.handle_momentum(0, 0).is_err(), "placed without being taken in");
        assert!(s.accept_momentum(0, 0, 4).is_err(), "for another round than the next");
        s.accept_momentum(0, 0, 3).unwrap();
        assert!(matches!(
            s.accept_momentum(0, 0, 3),
            Err(EngineError::Protocol {
                violation: ProtocolViolation::MomentumTwice { chunk: 0, iter: 3 },
                ..
            })
        ));
        if momentum_first {
            s.handle_momentum(0, 0).unwrap();
            assert_eq!(Server::applies(&s.drain()), [], "the values are not back yet");
            s.handle_init(0, 0).unwrap();
        } else {
            s.handle_init(0, 0).unwrap();
            assert_eq!(Server::applies(&s.drain()), [], "the momentum is not back yet");
            s.handle_momentum(0, 0).unwrap();
        }
        let cmds = s.drain();
        assert_eq!(Server::applies(&cmds), [(3, 3)]);
        assert_eq!(momentum_sends(&cmds), [], "the layer stays on the PS after 3");
        // Once more for a round already applied: not the chunk's next.
        assert!(matches!(
            s.accept_momentum(0, 0, 3),
            Err(EngineError::Protocol {
                violation: ProtocolViolation::MomentumUnexpected { chunk: 0, iter: 3 },
                ..
            })
        ));
    }
}

/// Decided in the run: the decision that puts the layer on SFB at 2 comes
/// after round 1 was applied, and it sends the momentum then; without
/// momentum that moves, none is sent and a momentum block is refused.
#[test]
fn a_decision_after_the_last_ps_round_sends_the_momentum_then() {
    let book = fc_book().with_adaptive(2).unwrap();
    let mut s = Server::new(Arc::new(book), 3, SchedConfig::default())
        .unwrap()
        .with_momentum(true);
    s.handle_init(0, 0).unwrap();
    s.drain();
    s.bcast_done();
    for t in 0..2 {
        let cmds: Vec<_> = (0..3).flat_map(|w| s.push(w)).collect();
        assert_eq!(Server::applies(&cmds), [(t, 3)]);
        assert_eq!(momentum_sends(&cmds), []);
        s.bcast_done();
    }
    s.decide(2, 1).unwrap();
    assert_eq!(momentum_sends(&s.drain()), [(0, 2)]);
    let mut plain = adaptive_server();
    plain.decide(2, 1).unwrap();
    assert_eq!(momentum_sends(&plain.drain()), []);
    assert!(matches!(
        plain.accept_momentum(0, 0, 4),
        Err(EngineError::Protocol {
            violation: ProtocolViolation::MomentumUnexpected { .. },
            ..
        })
    ));
}

/// Kvstore: the server answers every worker's pull of a chunk at once, as
/// MXNet's does (each answer on that worker's own connection, sharing the
/// server's link), not one worker after another within the broadcast
/// window: with a window of one answer's bytes, all three still go.
#[test]
fn kvstore_answers_every_pull_at_once() {
    use crate::config::SyncMode;
    let cfg = SyncMode::KvStore.book_config(BookConfig {
        chunk_bytes: 16,
        ..Default::default()
    });
    let layers = vec![LayerSpec::new("l", LayerKind::Conv, 1, 8)];
    let book = Arc::new(Book::new(Cluster::split(3, 1).unwrap(), layers, cfg).unwrap());
    assert_eq!((book.chunks().len(), book.chunk_slices(0).len()), (1, 2));
    for (credit_bytes, answers) in [(32, 3), (1, 3), (8 << 20, 3)] {
        let sched = SchedConfig {
            credit_bytes,
            ..SchedConfig::default()
        };
        let mut s = Server::new(book.clone(), 3, sched).unwrap();
        s.handle_init(0, 0).unwrap();
        s.drain();
        s.bcast_done();
        let cmds: Vec<ServerCommand> = (0..3).flat_map(|w| s.push(w)).collect();
        assert_eq!(Server::applies(&cmds), vec![(0, 3)]);
        let notified = cmds
            .iter()
            .filter(|c| matches!(c, ServerCommand::Notify { version: 1, .. }))
            .count();
        assert_eq!(notified, 3, "{cmds:?}");
        for w in 0..3 {
            s.handle_pull(w, 0, 1).unwrap();
        }
        let sent: Vec<u32> = s
            .drain()
            .into_iter()
            .filter_map(|c| match c {
                ServerCommand::Broadcast { chunk: 0, worker } => Some(worker),
                _ => None,
            })
            .collect();
        assert_eq!(sent.len(), answers, "credit {credit_bytes}: {sent:?}");
        assert_eq!(sent, vec![0, 1, 2], "in the order the pulls came");
    }
}
