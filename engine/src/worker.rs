//! The worker side of the core: per-layer readiness, the priority queue, the
//! credit window and landing-slot credits, and SFB bookkeeping.
//!
//! # Driving it
//! 1. [`Worker::new`], then, on the worker of index 0 only, execute the
//!    [`WorkerCommand::InitPush`] commands it emits (the initial parameters
//!    go to the servers, which broadcast them to everyone).
//! 2. Feed completions and arrivals with the `handle_*` methods, hand layers in
//!    with [`Worker::grad_ready`] / [`Worker::sf_ready`], and after every call
//!    drain [`Worker::poll_command`] until it returns `None`.
//! 3. A layer may be handed in again once a [`WorkerCommand::LayerReady`] for
//!    it came out (or before its first hand-in, once [`Worker::is_initialized`]).
//!
//! The core keeps no clock; liveness timeouts belong to whoever drives it.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use crate::book::{Book, LayerKind, Placement, Scheme};
use crate::config::{QueueOrder, SchedConfig};
use crate::error::{EngineError, ProtocolViolation, Result};
use crate::fxhash::FxHashMap as HashMap;

/// What the worker core asks its driver to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerCommand {
    /// Write this worker's values of `chunk` into the owning server's
    /// parameter shard (worker index 0 only): its initial values, once at
    /// the start, and again wherever the chunk's layer comes back from SFB
    /// to the PS ([`crate::plan::Plan::reseeds_at`]), after this worker's
    /// last reconstruction of it.
    InitPush { server: u32, chunk: u32 },
    /// Write the gradient of `slice` into landing slot `slot` on `server`, with
    /// the slice id as the immediate. Report it with [`Worker::handle_push_done`].
    Push {
        server: u32,
        slot: u32,
        slice: u32,
        iter: u64,
    },
    /// Send this layer's sufficient factors (U, V) of `iter` to rank `peer`:
    /// a peer worker (SFB), or the server holding the layer
    /// ([`Scheme::Adam`]), which may be this rank itself (then the driver
    /// hands them to its own server). Report it with [`Worker::handle_factors_sent`].
    SendFactors { peer: u32, layer: u32, iter: u64 },
    /// Send this worker's momentum of `chunk` to its server `server` for the
    /// switch back to the PS at `iter` (worker index 0, beside its
    /// [`WorkerCommand::InitPush`], where the op keeps momentum: see
    /// [`Worker::with_momentum`]). Report it with [`Worker::handle_seed_done`].
    SendMomentum { server: u32, chunk: u32, iter: u64 },
    /// Every worker's factors of `iter` for `layer` are here: sum Σ_p U_pᵀV_p in
    /// worker-rank order, apply it to the layer's parameters, and report it with
    /// [`Worker::handle_factors_applied`].
    Reconstruct { layer: u32, iter: u64 },
    /// The layer's iteration `iter` is synced: its buffers are the caller's again.
    LayerReady { layer: u32, iter: u64 },
    /// Kvstore ([`Placement::KvStore`]): ask `server` for `chunk` at
    /// `version`. Every chunk of the layer was notified; the server answers
    /// with the values ([`Worker::handle_params`]).
    Pull { server: u32, chunk: u32, version: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Item {
    Push { slice: u32 },
    Factors { layer: u32 },
}

#[derive(Debug, Clone, Default)]
struct LayerState {
    in_flight: bool,
    /// Iterations handed in and completed; the one in flight is `done`.
    done: u64,
    scheme: Option<Scheme>,
    pushes_left: u32,
    sends_left: u32,
}

/// Counters for tests and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Slices pushed.
    pub pushes: u64,
    /// Factor messages sent.
    pub factor_sends: u64,
    /// Kvstore pull requests sent.
    pub pulls: u64,
    /// Largest number of bytes in flight seen.
    pub max_bytes_in_flight: usize,
}

/// The worker core of one rank.
#[derive(Debug)]
pub struct Worker {
    book: Arc<Book>,
    rank: u32,
    index: usize,
    cfg: SchedConfig,
    layers: Vec<LayerState>,
    chunk_updates: Vec<u64>,
    sf_applied: Vec<u64>,
    sf_arrived: HashMap<(u32, u64), u32>,
    sf_emitted: Vec<Option<u64>>,
    /// The schemes by iteration: the book's, and the decisions since ([`crate::plan`]).
    plan: crate::plan::Plan,
    /// Factors that came for an iteration not yet decided: a sender of each
    /// (layer, iteration), to blame if the decision puts it on the PS.
    early_from: HashMap<(u32, u64), u32>,
    /// Per layer: chunks whose values worker 0 is still writing back to
    /// their servers (a switch back to the PS); the layer is not ready
    /// before (the caller could change the parameters being read).
    reseeding: Vec<u32>,
    /// Whether momentum moves at switches ([`Worker::with_momentum`]).
    moves_momentum: bool,
    /// Servers' momentum taken in for a switch to SFB, per (layer,
    /// iteration): chunks in, and a sender to blame if the decision does not
    /// switch the layer then.
    momentum_in: HashMap<(u32, u64), (u32, u32)>,
    /// Per chunk: the iteration its latest momentum came for.
    momentum_seen: Vec<Option<u64>>,
    /// Items that may go, best first: (iteration, key, item, destination).
    ready: BinaryHeap<Reverse<(u64, u64, Item, u32)>>,
    /// Per destination: pushes that wait for a landing slot, best first.
    parked: Vec<BinaryHeap<Reverse<(u64, u64, Item)>>>,
    free_slots: Vec<Vec<u32>>,
    bytes_in_flight: usize,
    fifo_seq: u64,
    uninitialized: usize,
    /// Kvstore: per chunk, the latest version notified (empty otherwise).
    notified: Vec<u64>,
    out: VecDeque<WorkerCommand>,
    stats: WorkerStats,
}

impl Worker {
    /// The worker core for `rank`, which must be a worker in the book's cluster.
    pub fn new(book: Arc<Book>, rank: u32, cfg: SchedConfig) -> Result<Self> {
        cfg.validate()?;
        let cfg = cfg.resolve(&book);
        cfg.validate()?;
        let index = book
            .cluster()
            .worker_index(rank)
            .ok_or_else(|| EngineError::InvalidConfig(format!("rank {rank} is not a worker in this cluster")))?;
        debug_assert_eq!(book.cluster().workers()[index], rank);
        let world = book.cluster().world();
        let mut free_slots = vec![Vec::new(); world];
        for &s in book.cluster().servers() {
            free_slots[s as usize] = (0..cfg.slots).rev().collect();
        }
        let mut w = Worker {
            layers: vec![LayerState::default(); book.layers().len()],
            chunk_updates: vec![0; book.chunks().len()],
            sf_applied: vec![0; book.layers().len()],
            sf_arrived: HashMap::default(),
            sf_emitted: vec![None; book.layers().len()],
            reseeding: vec![0; book.layers().len()],
            moves_momentum: false,
            momentum_in: HashMap::default(),
            momentum_seen: vec![None; book.chunks().len()],
            plan: book.plan().clone(),
            early_from: HashMap::default(),
            ready: BinaryHeap::new(),
            parked: (0..world).map(|_| BinaryHeap::new()).collect(),
            free_slots,
            bytes_in_flight: 0,
            fifo_seq: 0,
            uninitialized: book.chunks().len(),
            notified: if book.config().placement == Placement::KvStore {
                vec![0; book.chunks().len()]
            } else {
                Vec::new()
            },
            out: VecDeque::new(),
            stats: WorkerStats::default(),
            book,
            rank,
            index,
            cfg,
        };
        if index == 0 {
            for (c, ch) in w.book.chunks().iter().enumerate() {
                w.out.push_back(WorkerCommand::InitPush {
                    server: ch.server,
                    chunk: c as u32,
                });
            }
        }
        // Every landing slot of every server starts as this worker's credit.
        debug_assert_eq!(w.free_credits(), w.cfg.slots as usize * w.book.p2());
        debug_assert_eq!(w.out.len(), if index == 0 { w.book.chunks().len() } else { 0 });
        Ok(w)
    }

    /// Momentum moves at scheme switches (an op that keeps it, and a plan
    /// with switches or decisions): worker index 0 sends its momentum with
    /// its values where a layer comes back to the PS, and a layer's first
    /// reconstruction after the PS waits for the servers' momentum
    /// ([`Worker::handle_momentum_in`]).
    pub fn with_momentum(mut self, moves: bool) -> Self {
        self.moves_momentum = moves;
        self
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }
    /// This worker's index among the workers (its place in the aggregation order).
    pub fn index(&self) -> usize {
        debug_assert_eq!(self.book.cluster().workers()[self.index], self.rank);
        self.index
    }
    /// The book.
    pub fn book(&self) -> &Arc<Book> {
        &self.book
    }
    /// Whether every chunk's initial parameters have arrived.
    pub fn is_initialized(&self) -> bool {
        debug_assert!(self.uninitialized <= self.book.chunks().len());
        self.uninitialized == 0
    }
    /// Whether the layer is handed in and not yet synced.
    pub fn is_in_flight(&self, layer: u32) -> bool {
        self.layers.get(layer as usize).is_some_and(|l| l.in_flight)
    }
    /// Iterations of `layer` completed.
    pub fn completed(&self, layer: u32) -> u64 {
        self.layers.get(layer as usize).map_or(0, |l| l.done)
    }
    /// The worker's clock: iterations completed by every layer.
    pub fn clock(&self) -> u64 {
        self.layers.iter().map(|l| l.done).min().unwrap_or(0)
    }
    /// Bytes currently in flight (pushes and factor sends).
    pub fn bytes_in_flight(&self) -> usize {
        debug_assert!(self.bytes_in_flight == 0 || self.layers.iter().any(|l| l.in_flight));
        self.bytes_in_flight
    }
    /// Forgets the seeding (a worker that rejoins: the servers hold the
    /// parameters already). Call it before draining any command.
    pub fn skip_seeding(&mut self) {
        debug_assert_eq!(
            self.uninitialized,
            self.book.chunks().len(),
            "skip_seeding after parameters arrived"
        );
        self.out.retain(|c| !matches!(c, WorkerCommand::InitPush { .. }));
    }
    /// Landing-slot credits this worker holds now, over every server (all
    /// `slots × P2` of them when nothing is in flight).
    pub fn free_credits(&self) -> usize {
        let n = self.free_slots.iter().map(Vec::len).sum();
        debug_assert!(
            n <= self.cfg.slots as usize * self.book.p2(),
            "never more credits than lent"
        );
        n
    }
    /// Counters.
    pub fn stats(&self) -> WorkerStats {
        self.stats
    }
    /// The scheme `layer` will sync by at its next hand-in.
    pub fn next_scheme(&self, layer: u32) -> Result<Scheme> {
        self.book.layer(layer)?;
        let iter = self.completed(layer);
        if !self.plan.settled(layer, iter) {
            return Err(EngineError::Undecided { layer, iter });
        }
        Ok(self.plan.scheme(layer, iter))
    }

    /// The next command for the driver.
    pub fn poll_command(&mut self) -> Option<WorkerCommand> {
        self.out.pop_front()
    }

    fn check_hand_in(&self, layer: u32) -> Result<()> {
        let spec = self.book.layer(layer)?;
        let st = &self.layers[layer as usize];
        if !st.in_flight && !self.plan.settled(layer, st.done) {
            return Err(EngineError::Undecided { layer, iter: st.done });
        }
        if st.in_flight {
            return Err(EngineError::LayerBusy {
                layer,
                name: spec.name.clone(),
                iter: st.done,
            });
        }
        // A layer not in flight owes no push and no send.
        debug_assert!(st.pushes_left == 0 && st.sends_left == 0, "layer {layer}: {st:?}");
        Ok(())
    }

    /// The layer's gradient is in its registered buffer: queue its slices.
    /// Fails with `NeedsFactors` when the layer syncs by SFB this iteration.
    pub fn grad_ready(&mut self, layer: u32) -> Result<()> {
        self.check_hand_in(layer)?;
        let iter = self.layers[layer as usize].done;
        if self.plan.scheme(layer, iter).takes_factors() {
            return Err(EngineError::NeedsFactors {
                layer,
                name: self.book.layers()[layer as usize].name.clone(),
            });
        }
        let slices = self.book.layer_slices(layer);
        debug_assert!(!slices.is_empty(), "a layer has parameters, so slices");
        if self.book.config().placement == Placement::KvStore {
            // Kvstore cuts a big array into one part a server, each of several
            // wire slices. MXNet's worker (ps-lite's `ZPush`) sends every
            // server its part at once, each on its own connection, so the
            // parts share the worker's link: a slice of each part in turn. In
            // part order every worker pushed its first part whole to one
            // server, then the next: the servers took a layer one after
            // another, 7 workers into one link (VGG19 on 8 machines at
            // 10 Gbit/s: 95 samples/s, where P3 made 222).
            let chunks = self.book.layer_chunks(layer);
            let rounds = chunks
                .clone()
                .map(|c| self.book.chunk_slices(c).len())
                .max()
                .unwrap_or(0);
            let mut queued = 0;
            for r in 0..rounds {
                for c in chunks.clone() {
                    if let Some(s) = self.book.chunk_slices(c).nth(r) {
                        self.queue_push(iter, s);
                        queued += 1;
                    }
                }
            }
            debug_assert_eq!(queued, slices.len(), "every slice of the layer, once");
        } else {
            // In slice order: under FIFO each chunk is complete (and can be
            // applied and broadcast) as early as it can be.
            for s in slices.clone() {
                self.queue_push(iter, s);
            }
        }
        let st = &mut self.layers[layer as usize];
        st.in_flight = true;
        st.scheme = Some(Scheme::Ps);
        st.pushes_left = slices.len() as u32;
        st.sends_left = 0;
        self.pump();
        Ok(())
    }

    /// The layer's sufficient factors are in its registered factor buffer.
    /// Fails with `NotFullyConnected` for conv/other layers. When the layer
    /// syncs by the PS this iteration, the driver must turn the factors into a
    /// gradient and call [`Worker::grad_ready`] instead; this returns `Ok(false)` then.
    pub fn sf_ready(&mut self, layer: u32) -> Result<bool> {
        self.check_hand_in(layer)?;
        let spec = &self.book.layers()[layer as usize];
        if spec.kind != LayerKind::Fc {
            return Err(EngineError::NotFullyConnected {
                layer,
                name: spec.name.clone(),
            });
        }
        let iter = self.layers[layer as usize].done;
        let scheme = self.plan.scheme(layer, iter);
        if scheme == Scheme::Ps {
            return Ok(false);
        }
        // Factors go ahead of every push (key 0; among themselves, lower
        // layers first): a factor's receiver still has its GEMM to run before
        // the layer is ready, so its deadline is earlier than its layer's
        // place in the forward pass says. Queued behind the PS slices of
        // every lower layer, as P3's order would put them, a large factor
        // message waited for an empty credit window while the rebuild that
        // bounds the iteration idled: `full` ran at 0.93x `hybrid` on VGG19
        // 4+1 at batch 128 and 1 Gbit/s.
        let key = self.key(0);
        if scheme == Scheme::Adam {
            // One destination: the server holding the whole layer. The layer
            // is then synced as through the PS: by its chunks' broadcasts.
            let server = self.book.chunks()[self.book.layer_chunks(layer).start as usize].server;
            debug_assert!(self
                .book
                .layer_chunks(layer)
                .all(|c| self.book.chunks()[c as usize].server == server));
            self.ready.push(Reverse((iter, key, Item::Factors { layer }, server)));
            let st = &mut self.layers[layer as usize];
            st.in_flight = true;
            st.scheme = Some(Scheme::Adam);
            st.pushes_left = 0;
            st.sends_left = 1;
            self.pump();
            return Ok(true);
        }
        let peers: Vec<u32> = self
            .book
            .cluster()
            .workers()
            .iter()
            .copied()
            .filter(|&w| w != self.rank)
            .collect();
        debug_assert_eq!(peers.len() + 1, self.book.p1(), "this worker and its peers");
        for &p in &peers {
            self.ready.push(Reverse((iter, key, Item::Factors { layer }, p)));
        }
        let st = &mut self.layers[layer as usize];
        st.in_flight = true;
        st.scheme = Some(Scheme::Sfb);
        st.pushes_left = 0;
        st.sends_left = peers.len() as u32;
        self.handle_factors_arrived(layer, iter, self.rank)?;
        self.pump();
        Ok(true)
    }

    /// The queue key of an item of priority `prio`: 0 for factors, a
    /// slice's id + 1 for its push (P3's order: lower layers first).
    fn key(&mut self, prio: u64) -> u64 {
        debug_assert!(
            prio <= self.book.slices().len() as u64,
            "a priority is 0 or a slice id + 1"
        );
        match self.cfg.order {
            QueueOrder::Priority => prio,
            QueueOrder::Fifo => {
                self.fifo_seq += 1;
                self.fifo_seq
            }
        }
    }

    fn item_bytes(&self, item: Item) -> usize {
        match item {
            Item::Push { slice } => self.book.slices()[slice as usize].len * 4,
            Item::Factors { layer } => {
                let l = &self.book.layers()[layer as usize];
                debug_assert_eq!(l.kind, LayerKind::Fc, "only FC layers have factors");
                self.book.config().batch * (l.m + l.n) * 4
            }
        }
    }

    /// Queues `slice`'s push for `iter`, to its chunk's server.
    fn queue_push(&mut self, iter: u64, s: u32) {
        let info = self.book.slices()[s as usize];
        let server = self.book.chunks()[info.chunk as usize].server;
        debug_assert!(self.book.cluster().server_index(server).is_some());
        debug_assert!(
            self.layers[info.layer as usize].pushes_left == 0,
            "queued before the layer is in flight"
        );
        let key = self.key(s as u64 + 1);
        self.ready.push(Reverse((iter, key, Item::Push { slice: s }, server)));
    }

    /// Sends the best eligible items while the credit window allows. A push
    /// whose server has no free landing slot waits (parked) until a credit
    /// returns; the best item that may go goes, as P3's priority queue says.
    fn pump(&mut self) {
        while let Some(&Reverse((iter, key, item, dst))) = self.ready.peek() {
            if matches!(item, Item::Push { .. }) && self.free_slots[dst as usize].is_empty() {
                self.ready.pop();
                self.parked[dst as usize].push(Reverse((iter, key, item)));
                continue;
            }
            // What is queued is owed by a layer in flight, for the iteration it was handed in.
            let st = &self.layers[match item {
                Item::Push { slice } => self.book.slices()[slice as usize].layer,
                Item::Factors { layer } => layer,
            } as usize];
            debug_assert!(st.in_flight && st.done == iter, "{item:?} of iteration {iter}: {st:?}");
            debug_assert!(st.pushes_left + st.sends_left > 0, "{item:?}: {st:?}");
            let bytes = self.item_bytes(item);
            if self.bytes_in_flight > 0 && self.bytes_in_flight + bytes > self.cfg.credit_bytes {
                break;
            }
            self.ready.pop();
            self.bytes_in_flight += bytes;
            // The credit window: never exceeded, but by one item alone.
            debug_assert!(self.bytes_in_flight <= self.cfg.credit_bytes || self.bytes_in_flight == bytes);
            self.stats.max_bytes_in_flight = self.stats.max_bytes_in_flight.max(self.bytes_in_flight);
            match item {
                Item::Push { slice } => {
                    let slot = self.free_slots[dst as usize].pop().expect("checked");
                    debug_assert!(slot < self.cfg.landing_slots(), "slot {slot} of server {dst}");
                    self.stats.pushes += 1;
                    self.out.push_back(WorkerCommand::Push {
                        server: dst,
                        slot,
                        slice,
                        iter,
                    });
                }
                Item::Factors { layer } => {
                    debug_assert!(
                        dst != self.rank || self.layers[layer as usize].scheme == Some(Scheme::Adam),
                        "factors go to peers (SFB), or to the layer's server (Adam)"
                    );
                    self.stats.factor_sends += 1;
                    self.out
                        .push_back(WorkerCommand::SendFactors { peer: dst, layer, iter });
                }
            }
        }
        self.debug_invariants();
    }

    /// What every input leaves true (O(layers + ranks)), checked after each.
    fn debug_invariants(&self) {
        debug_assert_eq!(self.book.cluster().workers()[self.index], self.rank);
        debug_assert!(self.uninitialized <= self.chunk_updates.len());
        debug_assert!(self.free_slots.iter().all(|f| f.len() <= self.cfg.slots as usize));
        debug_assert_eq!(
            self.notified.is_empty(),
            self.book.config().placement != Placement::KvStore
        );
        debug_assert!(self.fifo_seq == 0 || self.cfg.order == QueueOrder::Fifo);
        for (l, st) in self.layers.iter().enumerate() {
            // A layer owes pushes and sends only while in flight, and only by its scheme.
            debug_assert!(st.in_flight || st.pushes_left + st.sends_left == 0, "layer {l}: {st:?}");
            debug_assert!(
                st.pushes_left == 0 || st.scheme == Some(Scheme::Ps),
                "layer {l}: {st:?}"
            );
            debug_assert!(
                st.sends_left == 0 || st.scheme.is_some_and(Scheme::takes_factors),
                "layer {l}: {st:?}"
            );
            // The reconstruction asked for is the next one to apply, or the one before it.
            debug_assert!(
                self.sf_emitted[l].map_or(self.sf_applied[l] == 0, |e| e + 1 == self.sf_applied[l]
                    || Some(e) == self.plan.next_sfb(l as u32, self.sf_applied[l])),
                "layer {l}: emitted {:?}, applied {}",
                self.sf_emitted[l],
                self.sf_applied[l]
            );
        }
    }

    fn protocol(&self, rank: u32, violation: ProtocolViolation) -> EngineError {
        EngineError::protocol(rank, violation)
    }

    /// A push's data is placed at the server (its source may be reused).
    pub fn handle_push_done(&mut self, slice: u32) -> Result<()> {
        let info = *self
            .book
            .slices()
            .get(slice as usize)
            .ok_or_else(|| self.protocol(self.rank, ProtocolViolation::PushDoneUnknownSlice { slice }))?;
        let st = &mut self.layers[info.layer as usize];
        if !st.in_flight || st.pushes_left == 0 {
            return Err(self.protocol(self.rank, ProtocolViolation::PushDoneNotInFlight { slice }));
        }
        debug_assert_eq!(st.scheme, Some(Scheme::Ps), "only PS layers push");
        debug_assert!(
            self.bytes_in_flight >= info.len * 4,
            "a push's bytes were counted when it went"
        );
        st.pushes_left -= 1;
        // It counts down from the layer's slices, and reaches 0 once.
        debug_assert!((st.pushes_left as usize) < self.book.layer_slices(info.layer).len());
        self.bytes_in_flight -= info.len * 4;
        self.check_ready(info.layer);
        self.pump();
        Ok(())
    }

    /// A factor message to `peer` left (its source may be reused).
    pub fn handle_factors_sent(&mut self, layer: u32, peer: u32) -> Result<()> {
        self.book.layer(layer)?;
        let bytes = self.item_bytes(Item::Factors { layer });
        let st = &mut self.layers[layer as usize];
        if !st.in_flight || st.sends_left == 0 {
            return Err(self.protocol(peer, ProtocolViolation::FactorsSentNotInFlight { layer }));
        }
        debug_assert!(
            matches!(st.scheme, Some(Scheme::Sfb | Scheme::Adam)),
            "only SFB and Adam layers send factors"
        );
        debug_assert!(
            self.bytes_in_flight >= bytes,
            "a send's bytes were counted when it went"
        );
        st.sends_left -= 1;
        // SFB sends to P1 - 1 peers, Adam to one server.
        debug_assert!((st.sends_left as usize) < self.book.p1().max(2) - 1);
        self.bytes_in_flight -= bytes;
        self.check_ready(layer);
        self.pump();
        Ok(())
    }

    /// `server` returned the landing slot `slot`.
    pub fn handle_credit(&mut self, server: u32, slot: u32) -> Result<()> {
        // Only a server lends slots: a credit from any other rank is not one
        // (it would land in a free list no push reads).
        if self.book.cluster().server_index(server).is_none() {
            return Err(EngineError::protocol(server, ProtocolViolation::CreditFromOutside));
        }
        let free = self
            .free_slots
            .get_mut(server as usize)
            .ok_or(EngineError::protocol(server, ProtocolViolation::CreditFromOutside))?;
        if slot >= self.cfg.landing_slots() || free.contains(&slot) || free.len() >= self.cfg.slots as usize {
            return Err(self.protocol(server, ProtocolViolation::CreditNotLent { slot }));
        }
        free.push(slot);
        debug_assert!(
            free.len() <= self.cfg.slots as usize,
            "credits never exceed the slots lent"
        );
        // As many of the server's parked pushes as it has free slots may go
        // again, best first (the rest stay parked: no re-sorting per credit).
        for _ in 0..free.len() {
            let Some(Reverse((iter, key, item))) = self.parked[server as usize].pop() else {
                break;
            };
            debug_assert!(matches!(item, Item::Push { .. }), "only pushes wait for a slot");
            self.ready.push(Reverse((iter, key, item, server)));
        }
        self.pump();
        Ok(())
    }

    /// Kvstore: `server` applied `chunk`, which is now at `version`. Once
    /// every chunk of the layer is notified for the iteration in flight, the
    /// layer is pulled: one [`WorkerCommand::Pull`] per chunk, in chunk order.
    pub fn handle_notify(&mut self, server: u32, chunk: u32, version: u64) -> Result<()> {
        let ch = *self
            .book
            .chunks()
            .get(chunk as usize)
            .ok_or_else(|| self.protocol(server, ProtocolViolation::NotifyUnknownChunk { chunk }))?;
        if self.notified.is_empty() {
            return Err(self.protocol(server, ProtocolViolation::NotifyNotKvstore));
        }
        let st = &self.layers[ch.layer as usize];
        if ch.server != server
            || !st.in_flight
            || version != st.done + 1
            || self.notified[chunk as usize] + 1 != version
        {
            return Err(self.protocol(
                server,
                ProtocolViolation::NotifyOutOfStep {
                    chunk,
                    layer: ch.layer,
                    version,
                    waits_for: st.in_flight.then_some(st.done + 1),
                    owner: ch.server,
                },
            ));
        }
        debug_assert_eq!(self.book.config().placement, Placement::KvStore);
        self.notified[chunk as usize] = version;
        let chunks = self.book.layer_chunks(ch.layer);
        if chunks.clone().all(|c| self.notified[c as usize] >= version) {
            // A layer's chunks are notified one version at a time, together.
            debug_assert!(chunks.clone().all(|c| self.notified[c as usize] == version));
            for c in chunks {
                self.stats.pulls += 1;
                self.out.push_back(WorkerCommand::Pull {
                    server: self.book.chunks()[c as usize].server,
                    chunk: c,
                    version,
                });
            }
        }
        self.debug_invariants();
        Ok(())
    }

    /// The layer of `chunk`, a chunk id that came from outside (checked).
    fn chunk_layer(&self, chunk: u32) -> Result<u32> {
        let c = self
            .book
            .chunks()
            .get(chunk as usize)
            .ok_or_else(|| self.protocol(self.rank, ProtocolViolation::ParamsForUnknownChunk { chunk }))?;
        debug_assert!((c.layer as usize) < self.layers.len());
        Ok(c.layer)
    }

    /// A server wrote a new version of `chunk` into the parameter buffer.
    pub fn handle_params(&mut self, chunk: u32) -> Result<()> {
        let layer = self.chunk_layer(chunk)?;
        if !self.notified.is_empty()
            && self.chunk_updates[chunk as usize] > 0
            && self.chunk_updates[chunk as usize] > self.notified[chunk as usize]
        {
            return Err(self.protocol(self.rank, ProtocolViolation::ParamsWithoutPull { chunk }));
        }
        let held = self.uninitialized == 0 && !self.layers[layer as usize].in_flight;
        if held
            && self.cfg.consistency == crate::config::Consistency::Bsp
            && self.cfg.trigger == crate::config::Trigger::All
        {
            // Under BSP a chunk changes only while its layer is handed in: this
            // write landed in memory the caller may hold.
            return Err(self.protocol(self.rank, ProtocolViolation::ParamsWhileHeld { chunk, layer }));
        }
        let st = &self.layers[layer as usize];
        // The initial values, then one broadcast per server round handed in.
        let (updates, bound) = (
            self.chunk_updates[chunk as usize] + 1,
            1 + self.plan.server_rounds(layer, st.done + u64::from(st.in_flight)),
        );
        if self.cfg.consistency == crate::config::Consistency::Bsp
            && self.cfg.trigger == crate::config::Trigger::All
            && updates > bound
        {
            // One broadcast per hand-in, and the initial values: a second
            // one in an iteration is the server's (here the core cannot tell
            // which rank wrote; the node names it).
            return Err(self.protocol(self.rank, ProtocolViolation::ParamsTwice { chunk, updates }));
        }
        self.chunk_updates[chunk as usize] = updates;
        if self.chunk_updates[chunk as usize] == 1 {
            debug_assert!(
                self.uninitialized > 0,
                "chunk {chunk}: a first update, but every chunk has one"
            );
            self.uninitialized -= 1;
        }
        self.check_ready(layer);
        self.debug_invariants();
        Ok(())
    }

    /// Worker rank `from`'s factors of `layer` for `iter` are stored by the driver.
    pub fn handle_factors_arrived(&mut self, layer: u32, iter: u64, from: u32) -> Result<()> {
        self.book.layer(layer)?;
        if self.book.cluster().worker_index(from).is_none() {
            return Err(self.protocol(from, ProtocolViolation::FactorsFromNonWorker));
        }
        if iter < self.sf_applied[layer as usize] {
            return Err(self.protocol(from, ProtocolViolation::FactorsAlreadyApplied { layer, iter }));
        }
        let n = self.sf_arrived.entry((layer, iter)).or_insert(0);
        *n += 1;
        if *n as usize > self.book.p1() {
            return Err(self.protocol(from, ProtocolViolation::TooManyFactors { layer, iter }));
        }
        // Factors come to workers for SFB only (Adam's go to the layer's server);
        // for an iteration not decided yet, checked once it is ([`Worker::decide`]).
        if self.plan.settled(layer, iter) && self.plan.scheme(layer, iter) != Scheme::Sfb {
            return Err(self.protocol(from, ProtocolViolation::FactorsNotSfb { layer, iter }));
        }
        if !self.plan.settled(layer, iter) {
            self.early_from.entry((layer, iter)).or_insert(from);
        }
        self.maybe_reconstruct(layer);
        Ok(())
    }

    fn maybe_reconstruct(&mut self, layer: u32) {
        // The next SFB iteration (switches may leave PS iterations between).
        let Some(next) = self.plan.next_sfb(layer, self.sf_applied[layer as usize]) else {
            return;
        };
        if self.sf_emitted[layer as usize] == Some(next) {
            return;
        }
        let momentum = !self.moves_momentum
            || !self.plan.leaves_ps_at(layer, next)
            || self.momentum_in.get(&(layer, next)).map(|m| m.0) == Some(self.book.layer_chunks(layer).len() as u32);
        if momentum && self.sf_arrived.get(&(layer, next)).copied().unwrap_or(0) as usize == self.book.p1() {
            // Reconstructions are asked for one iteration after the other.
            debug_assert!(self.sf_emitted[layer as usize].map_or(true, |e| e < next));
            self.sf_emitted[layer as usize] = Some(next);
            self.momentum_in.remove(&(layer, next));
            self.out.push_back(WorkerCommand::Reconstruct { layer, iter: next });
        }
    }

    /// The driver applied the reconstructed gradient of `layer` for `iter`.
    pub fn handle_factors_applied(&mut self, layer: u32, iter: u64) -> Result<()> {
        self.book.layer(layer)?;
        let next = self.plan.next_sfb(layer, self.sf_applied[layer as usize]);
        if self.sf_emitted[layer as usize] != Some(iter) || next != Some(iter) {
            return Err(self.protocol(self.rank, ProtocolViolation::ApplyNotAsked { layer, iter }));
        }
        debug_assert_eq!(
            self.sf_arrived.get(&(layer, iter)).map(|&n| n as usize),
            Some(self.book.p1()),
            "a reconstruction is asked for once every worker's factors arrived"
        );
        self.sf_applied[layer as usize] = iter + 1;
        self.sf_arrived.remove(&(layer, iter));
        if self.plan.settled(layer, iter + 1) {
            self.maybe_reseed(layer, iter + 1);
        }
        self.check_ready(layer);
        self.maybe_reconstruct(layer);
        self.debug_invariants();
        Ok(())
    }

    /// The schemes by iteration, as this worker knows them.
    pub fn plan(&self) -> &crate::plan::Plan {
        debug_assert_eq!(
            self.plan.contested(),
            self.book.plan().contested(),
            "decisions change schemes, not layers"
        );
        &self.plan
    }

    /// Worker index 0's decision for the point `at` ([`crate::plan::Plan::decide`]),
    /// taken in: factors that came early for the iterations it decides must
    /// be of layers it put on SFB.
    pub fn decide(&mut self, at: u64, sfb: u64) -> Result<Vec<crate::plan::Switch>> {
        let decider = self.book.cluster().workers()[0];
        let made = self
            .plan
            .decide(at, sfb)
            .map_err(|e| self.protocol(decider, ProtocolViolation::BadDecision { at, why: e.to_string() }))?;
        let early = self
            .early_from
            .iter()
            .find(|&(&(l, t), _)| self.plan.is_decided(t) && self.plan.scheme(l, t) != Scheme::Sfb);
        if let Some((&(layer, iter), &from)) = early {
            // A peer sent factors for an iteration this decision put on the PS.
            return Err(self.protocol(from, ProtocolViolation::FactorsNotSfb { layer, iter }));
        }
        let stray = self
            .momentum_in
            .iter()
            .find(|&(&(l, t), _)| self.plan.is_decided(t) && !self.plan.leaves_ps_at(l, t));
        if let Some((&(layer, iter), &(_, from))) = stray {
            // A server sent momentum for a switch this decision did not make.
            let chunk = self.book.layer_chunks(layer).start;
            return Err(self.protocol(from, ProtocolViolation::MomentumUnexpected { chunk, iter }));
        }
        let plan = &self.plan;
        self.early_from.retain(|&(_, t), _| !plan.is_decided(t));
        for l in 0..self.layers.len() as u32 {
            if self.sf_applied[l as usize] == at && self.reseeding[l as usize] == 0 {
                // The reconstruction of `at - 1` ran before the decision.
                self.maybe_reseed(l, at);
            }
            self.check_ready(l);
            self.maybe_reconstruct(l);
        }
        self.debug_invariants();
        Ok(made)
    }

    /// A write of `chunk`'s values into its server's shard ([`WorkerCommand::InitPush`]),
    /// or the send of its momentum ([`WorkerCommand::SendMomentum`]), was
    /// placed: at the start nothing to do, and on a switch back to the PS
    /// one fewer to wait for before the layer is ready.
    pub fn handle_seed_done(&mut self, chunk: u32) -> Result<()> {
        let layer = self.chunk_layer(chunk)?;
        // Worker 0 alone seeds the shards, at the start and on the way back to the PS.
        debug_assert_eq!(self.index, 0, "chunk {chunk}");
        let left = &mut self.reseeding[layer as usize];
        if *left > 0 {
            *left -= 1;
            self.check_ready(layer);
        }
        // At most the layer's chunks are owed, each with its momentum.
        debug_assert!(
            self.reseeding[layer as usize]
                < self.book.layer_chunks(layer).len() as u32 * (1 + u32::from(self.moves_momentum))
        );
        Ok(())
    }

    /// Worker 0, once its reconstruction of `iter - 1` ran and `iter` is
    /// decided: where `layer` comes back to the PS at `iter`, its values
    /// seed the shards again.
    fn maybe_reseed(&mut self, layer: u32, iter: u64) {
        debug_assert!(self.plan.settled(layer, iter) && self.sf_applied[layer as usize] == iter);
        if self.index != 0 || !self.plan.reseeds_at(layer, iter) {
            return;
        }
        debug_assert_eq!(self.reseeding[layer as usize], 0, "layer {layer}: one reseed at a time");
        let chunks = self.book.layer_chunks(layer);
        self.reseeding[layer as usize] = chunks.len() as u32 * (1 + u32::from(self.moves_momentum));
        for c in chunks {
            let server = self.book.chunks()[c as usize].server;
            self.out.push_back(WorkerCommand::InitPush { server, chunk: c });
            if self.moves_momentum {
                self.out
                    .push_back(WorkerCommand::SendMomentum { server, chunk: c, iter });
            }
        }
    }

    /// The server of `chunk` (rank `from`) begins to send its momentum for
    /// `iter`, where the chunk's layer leaves the PS: taken, before any of
    /// it is placed, unless it comes from another rank than the chunk's
    /// server, for an iteration the plan does not switch the layer to SFB
    /// at (checked at the decision where it is not decided yet), or twice.
    pub fn accept_momentum(&mut self, chunk: u32, iter: u64, from: u32) -> Result<()> {
        let layer = self.chunk_layer(chunk)?;
        let unexpected = ProtocolViolation::MomentumUnexpected { chunk, iter };
        let asked = !self.plan.settled(layer, iter) || self.plan.leaves_ps_at(layer, iter);
        if !self.moves_momentum || from != self.book.chunks()[chunk as usize].server || !asked {
            return Err(self.protocol(from, unexpected));
        }
        if iter < self.sf_applied[layer as usize] || self.momentum_seen[chunk as usize] == Some(iter) {
            return Err(self.protocol(from, ProtocolViolation::MomentumTwice { chunk, iter }));
        }
        self.momentum_seen[chunk as usize] = Some(iter);
        // Taken in for a switch after the start, by the chunk's owner.
        debug_assert!(iter > 0 && self.book.chunks()[chunk as usize].server == from);
        Ok(())
    }

    /// The momentum of `chunk` for `iter` taken in ([`Worker::accept_momentum`])
    /// is placed: once every chunk's is in, the layer's reconstruction of
    /// `iter` may run.
    pub fn handle_momentum_in(&mut self, chunk: u32, iter: u64, from: u32) -> Result<()> {
        let layer = self.chunk_layer(chunk)?;
        if self.momentum_seen[chunk as usize] != Some(iter) {
            // Placed without being taken in: the driver's mistake, or a stray.
            return Err(self.protocol(from, ProtocolViolation::MomentumUnexpected { chunk, iter }));
        }
        let e = self.momentum_in.entry((layer, iter)).or_insert((0, from));
        e.0 += 1;
        // One per chunk of the layer, at most.
        debug_assert!(e.0 <= self.book.layer_chunks(layer).len() as u32);
        self.maybe_reconstruct(layer);
        self.debug_invariants();
        Ok(())
    }

    fn check_ready(&mut self, layer: u32) {
        let s = self.cfg.consistency.staleness();
        let st = &self.layers[layer as usize];
        if !st.in_flight || st.pushes_left > 0 || st.sends_left > 0 || self.reseeding[layer as usize] > 0 {
            return;
        }
        let t = st.done;
        let ready = match st.scheme {
            Some(Scheme::Ps | Scheme::Adam) => {
                // The initial values and a broadcast per server round
                // through `t` (under SSP(s), through `t - s`).
                let n = (t + 2).saturating_sub(s);
                let need = if n == 0 {
                    0
                } else {
                    1 + self.plan.server_rounds(layer, n - 1)
                };
                self.book
                    .layer_chunks(layer)
                    .all(|c| self.chunk_updates[c as usize] >= need)
            }
            // Worker 0 may owe the servers the layer's values after `t`:
            // not ready until `t + 1` is decided.
            Some(Scheme::Sfb) => {
                self.sf_applied[layer as usize] >= (t + 1).saturating_sub(s)
                    && (self.index != 0 || self.plan.settled(layer, t + 1))
            }
            None => false,
        };
        if ready {
            // The scheme taken at the hand-in is the book's for the iteration.
            debug_assert_eq!(st.scheme, Some(self.plan.scheme(layer, t)));
            // A reconstruction needs this worker's factors too: none runs ahead of its hand-ins.
            debug_assert!(self.sf_applied[layer as usize] <= t + 1, "layer {layer} at {t}");
            let st = &mut self.layers[layer as usize];
            st.in_flight = false;
            st.done += 1;
            self.out.push_back(WorkerCommand::LayerReady { layer, iter: t });
        }
    }
}

#[cfg(test)]
mod tests;
