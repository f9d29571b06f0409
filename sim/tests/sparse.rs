//! Nexus's sparse push in the simulated cluster with real values: the same job
//! run dense, sparse and with the automatic choice ends with bitwise the same
//! parameters on every worker, at densities 0, tiny, around the threshold and
//! 1.0. Every failure names the seed; replay one with
//! `TIDEWIRE_SPARSE_SEED=<seed> cargo test -p tidewire-sim --test sparse`.

use std::sync::Arc;

use tidewire_engine::book::{LayerKind, LayerSpec};
use tidewire_engine::sparse::SparseCosts;
use tidewire_engine::testkit::Rng;
use tidewire_engine::{Book, BookConfig, Cluster, Consistency, SyncMode};
use tidewire_sim::{Sim, SimConfig, SimReport};

/// Costs under which sparse always pays (a slow link: the cap is the slot's).
fn always_sparse() -> SparseCosts {
    SparseCosts::default().with_link(1e3)
}

/// Costs under which sparse never pays (scanning costs more than sending).
fn never_sparse() -> SparseCosts {
    SparseCosts::default().with_link(1e15)
}

fn book(cluster: Cluster, mode: SyncMode, rng: &mut Rng) -> Arc<Book> {
    let layers = vec![
        LayerSpec::new("emb", LayerKind::Other, 40 + rng.below(60) as usize, 8).sparse(true),
        LayerSpec::new("conv", LayerKind::Conv, 8, 27),
        // A sparse FC layer goes through the PS whatever the scheme policy.
        LayerSpec::new("fc", LayerKind::Fc, 24, 20).sparse(true),
    ];
    let base = BookConfig {
        batch: 2,
        chunk_bytes: 4 * (64 + rng.below(512) as usize),
        slice_params: 20 + rng.below(200) as usize,
        ..Default::default()
    };
    Arc::new(Book::new(cluster, layers, mode.book_config(base)).expect("valid book"))
}

fn run(book: Arc<Book>, mode: SyncMode, seed: u64, density: f64, costs: SparseCosts, det: bool) -> SimReport {
    run_with(book, mode, seed, density, costs, det, Consistency::Bsp)
}

fn run_with(
    book: Arc<Book>,
    mode: SyncMode,
    seed: u64,
    density: f64,
    costs: SparseCosts,
    det: bool,
    consistency: Consistency,
) -> SimReport {
    let n = book.layers().len();
    let mut cfg = SimConfig::new(book, mode, vec![(20_000, 40_000); n], 3);
    cfg.values = true;
    cfg.seed = seed;
    cfg.bandwidth_bps = 1e9;
    cfg.sched.slots = 2;
    cfg.sched.credit_bytes = 2000;
    cfg.sched.deterministic = det;
    cfg.sched.consistency = consistency;
    cfg.sparse_density = density;
    cfg.sparse = costs;
    match Sim::run(cfg) {
        Ok(r) => r,
        Err(e) => panic!("seed {seed}, density {density}: {e}"),
    }
}

#[test]
fn sparse_and_dense_pushes_give_bitwise_the_same_parameters() {
    let seed = tidewire_engine::testkit::seed("TIDEWIRE_SPARSE_SEED");
    let mut rng = Rng(seed);
    for case in 0..10 {
        let cluster = if rng.below(2) == 0 {
            Cluster::colocated(2 + rng.below(3) as usize).expect("cluster")
        } else {
            Cluster::split(1 + rng.below(3) as usize, 1 + rng.below(3) as usize).expect("cluster")
        };
        let mode = [SyncMode::P3, SyncMode::Full, SyncMode::Wfbp][rng.below(3) as usize];
        let book = book(cluster, mode, &mut rng);
        // 0, tiny, around the default costs' threshold at 10 GbE, dense-ish, every element.
        let slice = book.slices()[0].len;
        let around = SparseCosts::default().threshold(slice);
        let density = [0.0, 0.002, around, 0.3, 1.0][case % 5];
        let sim_seed = seed.wrapping_add(case as u64);
        let dense = run(book.clone(), mode, sim_seed, density, never_sparse(), true);
        let sparse = run(book.clone(), mode, sim_seed, density, always_sparse(), true);
        let auto = run(book.clone(), mode, sim_seed, density, SparseCosts::default(), true);
        let what = format!(
            "seed {seed} case {case} ({:?}, {mode:?}, density {density})",
            book.cluster().roles()
        );
        assert!(!dense.params_bits.is_empty(), "{what}");
        assert_eq!(
            dense.params_bits, sparse.params_bits,
            "{what}: sparse differs from dense"
        );
        assert_eq!(dense.params_bits, auto.params_bits, "{what}: auto differs from dense");
        // Where pushes cross the network, the forced runs took the path they were given.
        let pushes = |r: &SimReport| r.sparse.iter().map(|s| s.sparse_pushes + s.dense_pushes).sum::<u64>();
        let sparse_pushes = |r: &SimReport| r.sparse.iter().map(|s| s.sparse_pushes).sum::<u64>();
        assert_eq!(sparse_pushes(&dense), 0, "{what}");
        // (A slice cut short by a chunk's end may hold too few elements for
        // even one pair beside its header: a nonzero there goes dense.)
        let roomy = book
            .slices()
            .iter()
            .all(|s| tidewire_engine::sparse::pair_limit(s.len) >= 8);
        if pushes(&sparse) > 0 && density < 0.05 && roomy {
            assert_eq!(
                sparse_pushes(&sparse),
                pushes(&sparse),
                "{what}: not every push went sparse"
            );
        }
        if density == 1.0 {
            // Over the slot's limit: every try falls back to dense.
            assert_eq!(sparse_pushes(&sparse), 0, "{what}");
        }
        for s in sparse.sparse.iter().filter(|s| s.sparse_pushes > 0) {
            assert!(
                (s.density() - density).abs() < 0.2 + density,
                "{what}: density {}",
                s.density()
            );
            assert!(s.sparse_bytes < s.sparse_pushes * 8 * 1000, "{what}");
        }
    }
}

#[test]
fn sparse_pushes_pass_the_value_checks_in_arrival_order_and_under_ssp() {
    let seed = tidewire_engine::testkit::seed("TIDEWIRE_SPARSE_SEED");
    let mut rng = Rng(seed);
    for case in 0..6 {
        let cluster = Cluster::colocated(2 + rng.below(3) as usize).expect("cluster");
        let mode = SyncMode::P3;
        let b = book(cluster, mode, &mut rng);
        let consistency = if case % 2 == 1 {
            Consistency::Ssp(1)
        } else {
            Consistency::Bsp
        };
        let density = [0.0, 0.01, 0.2][case % 3];
        let r = run_with(
            b,
            mode,
            seed ^ case as u64,
            density,
            always_sparse(),
            false,
            consistency,
        );
        assert!(r.checks > 0, "seed {seed} case {case}");
        assert!(
            r.sparse.iter().map(|s| s.sparse_pushes).sum::<u64>() > 0,
            "seed {seed} case {case}: no sparse push"
        );
    }
}

mod hostile {
    //! A server's checks of sparse landing notices, with two Nodes driven by
    //! hand: rank 0 a worker, rank 1 a server.
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::time::Duration;

    use tidewire_engine::book::{LayerKind, LayerSpec};
    use tidewire_engine::node::{Input, JobKind, LocalRegion, Node, NodeConfig, Output, Payload, SendSrc, TxOp};
    use tidewire_engine::sparse::{pair_limit, SPARSE_IMM};
    use tidewire_engine::{Book, BookConfig, Cluster, EngineError};

    struct Pair {
        nodes: [Node; 2],
        /// Accumulate jobs the server emitted: their `pairs`.
        accumulates: Vec<Option<u32>>,
        fatal: Option<EngineError>,
        /// Deliver nothing more to the worker (its credits come back for
        /// pushes it never made).
        mute_worker: bool,
    }

    impl Pair {
        fn new() -> (Pair, Arc<Book>) {
            let book = Arc::new(
                Book::new(
                    Cluster::split(1, 1).expect("cluster"),
                    vec![
                        LayerSpec::new("emb", LayerKind::Other, 100, 4).sparse(true),
                        LayerSpec::new("conv", LayerKind::Conv, 4, 25),
                    ],
                    BookConfig {
                        slice_params: 100,
                        ..Default::default()
                    },
                )
                .expect("book"),
            );
            let nodes = [0, 1].map(|r| {
                let mut n = Node::new(NodeConfig::new(book.clone(), r)).expect("node");
                n.set_keys([1, 2, 3]);
                n
            });
            let mut p = Pair {
                nodes,
                accumulates: Vec::new(),
                fatal: None,
                mute_worker: false,
            };
            for r in 0..2 {
                p.feed(r, Input::Connected { peer: 1 - r });
            }
            p.run();
            assert!(p.nodes[0].is_ready() && p.nodes[1].is_ready(), "{:?}", p.fatal);
            (p, book)
        }

        fn feed(&mut self, r: u32, i: Input) {
            self.nodes[r as usize].handle(Duration::ZERO, i).expect("input");
        }

        /// Delivers every output until both are quiet.
        fn run(&mut self) {
            let mut q: VecDeque<(u32, Input)> = VecDeque::new();
            loop {
                for r in 0..2u32 {
                    while let Some(o) = self.nodes[r as usize].poll_output() {
                        match o {
                            Output::Transmit(t) => {
                                let to = t.peer;
                                match t.op {
                                    TxOp::Send { tag, src } => {
                                        let data = match src {
                                            SendSrc::Inline { bytes, .. } => Payload::Bytes(bytes),
                                            SendSrc::Region { len, .. } => Payload::Opaque(len as usize),
                                        };
                                        q.push_back((to, Input::Message { peer: r, tag, data }));
                                    }
                                    TxOp::Write { dst, len, imm, .. } => {
                                        if let Some(imm) = imm {
                                            q.push_back((
                                                to,
                                                Input::Landed {
                                                    peer: r,
                                                    region: dst.region,
                                                    offset: dst.offset,
                                                    len,
                                                    imm,
                                                },
                                            ));
                                        }
                                    }
                                }
                                q.push_back((r, Input::Done { token: t.token }));
                            }
                            Output::Job(j) => {
                                if let JobKind::Accumulate { pairs, .. } = j.kind {
                                    self.accumulates.push(pairs);
                                }
                                q.push_back((r, Input::JobDone { id: j.id, data: None }));
                            }
                            Output::PeerKeys { peer, .. } => q.push_back((r, Input::PeerRegionsKnown { peer })),
                            Output::Fatal(e) if r == 1 => {
                                self.fatal.get_or_insert(e);
                            }
                            _ => {}
                        }
                    }
                }
                let Some((r, i)) = q.pop_front() else { break };
                if self.nodes[r as usize].fatal().is_none() && !(r == 0 && self.mute_worker) {
                    self.feed(r, i);
                }
            }
        }

        /// Rank 0 "wrote" `len` bytes at `offset` of the server's landing region.
        fn land(&mut self, offset: u64, len: u64, imm: u32) -> Option<EngineError> {
            self.mute_worker = true;
            self.feed(
                1,
                Input::Landed {
                    peer: 0,
                    region: LocalRegion::Landing,
                    offset,
                    len,
                    imm,
                },
            );
            self.run();
            self.fatal.clone()
        }
    }

    fn violation(e: Option<EngineError>, what: &str) {
        match e {
            Some(EngineError::Protocol {
                rank: 0,
                violation: tidewire_engine::ProtocolViolation::SparsePushMalformed { .. },
            }) => {}
            other => panic!("{what}: want a malformed sparse push by rank 0, got {other:?}"),
        }
    }

    #[test]
    fn a_well_formed_sparse_push_is_accumulated_with_its_pair_count() {
        let (mut p, book) = Pair::new();
        let first_emb = book.layer_slices(0).start;
        assert_eq!(p.land(0, 8 + 8 * 3, first_emb | SPARSE_IMM), None);
        assert_eq!(p.accumulates.last(), Some(&Some(3)));
        // The last piece of a write split at the transport's cap: the pairs
        // count from the slot's start (here slot 2, 8 + 8·2 bytes in all).
        let slot_bytes = book.max_slice_len() as u64 * 4;
        assert_eq!(p.land(2 * slot_bytes + 16, 8, (first_emb + 1) | SPARSE_IMM), None);
        assert_eq!(p.accumulates.last(), Some(&Some(2)));
        let conv = book.layer_slices(1).start;
        let len = book.slices()[conv as usize].len as u64 * 4;
        assert_eq!(p.land(slot_bytes, len, conv), None);
        assert_eq!(p.accumulates.last(), Some(&None));
    }

    #[test]
    fn a_push_whose_end_overflows_is_a_violation_not_a_panic() {
        // offset + len past u64::MAX: the check is of the end, so it must not
        // wrap (in release, a wrapped end could equal the slot's end).
        let (mut p, book) = Pair::new();
        let conv = book.layer_slices(1).start;
        let slot_bytes = book.max_slice_len() as u64 * 4;
        for (offset, len) in [(16, u64::MAX), (slot_bytes - 4, u64::MAX - slot_bytes + 8)] {
            let (mut q, _) = Pair::new();
            match q.land(offset, len, conv) {
                Some(EngineError::Protocol {
                    rank: 0,
                    violation: tidewire_engine::ProtocolViolation::PushOutsideSlots { .. },
                }) => {}
                other => panic!("offset {offset}, len {len}: want PushOutsideSlots, got {other:?}"),
            }
        }
        // The well-formed push of the same slice is taken.
        let len = book.slices()[conv as usize].len as u64 * 4;
        assert_eq!(p.land(0, len, conv), None);
    }

    #[test]
    fn malformed_sparse_pushes_are_violations() {
        type Case = fn(&Book) -> (u64, u64, u32);
        let cases: [(&str, Case); 6] = [
            ("a sparse push of a layer without the hint", |b| {
                (0, 16, b.layer_slices(1).start | SPARSE_IMM)
            }),
            ("a length that is not 8 + 8n", |b| {
                (0, 12, b.layer_slices(0).start | SPARSE_IMM)
            }),
            ("no header", |b| (0, 0, b.layer_slices(0).start | SPARSE_IMM)),
            ("more pairs than the slot's limit", |b| {
                let s = b.layer_slices(0).start;
                let n = pair_limit(b.slices()[s as usize].len) as u64 + 1;
                (0, 8 + 8 * n, s | SPARSE_IMM)
            }),
            ("in another worker's slots", |b| {
                let slot_bytes = b.max_slice_len() as u64 * 4;
                let slots = u64::from(tidewire_engine::SchedConfig::default().resolve(b).landing_slots());
                (slots * slot_bytes, 16, b.layer_slices(0).start | SPARSE_IMM)
            }),
            ("ending before its header", |b| {
                (4, 2, b.layer_slices(0).start | SPARSE_IMM)
            }),
        ];
        for (what, case) in cases {
            let (mut p, book) = Pair::new();
            let (offset, len, imm) = case(&book);
            violation(p.land(offset, len, imm), what);
        }
    }
}
