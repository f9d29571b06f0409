//! The server side of the core: one KV-store shard. Per-slice contribution
//! counters, landing-slot credits, aggregation order, apply gating and the
//! P3-style broadcast of every chunk the moment it is complete, highest
//! priority first.
//!
//! # Driving it
//! Execute each [`ServerCommand`] in the order [`Server::poll_command`] returns
//! them: `Accumulate` and `Apply` of one shard run in that order (one FIFO
//! executor), and a `Broadcast` of a chunk starts only once the chunk's
//! latest `Apply` has run. A landing slot's credit goes back to its worker
//! once its `Accumulate` has run. Report landed writes with
//! [`Server::handle_landed`] / [`Server::handle_init`], and finished broadcasts
//! with [`Server::handle_broadcast_done`]. [`crate::node::Node`] does all this.
//!
//! # Memory
//! Incoming gradients land in `slots × P1` landing slots of
//! [`Book::max_slice_len`] elements; accumulators hold `s + 1` copies of the
//! shard under SSP(s) (one under BSP). Nothing grows with P1 × model size.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::book::{Book, Placement, Scheme};
use crate::config::{SchedConfig, Trigger};
use crate::error::{EngineError, ProtocolViolation, Result};

/// What the server core asks its driver to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerCommand {
    /// Fold the slice in landing slot `slot` of `worker` into accumulator
    /// `window` (`acc = data` when `first`, else `acc += data`), at the slice's
    /// place in the shard. When it has run, the slot is free again: with
    /// `credit`, its credit goes back to `worker`; without (a parked slot,
    /// whose credit went back when it was parked), report it with
    /// [`Server::handle_parked_read`].
    Accumulate {
        worker: u32,
        slot: u32,
        slice: u32,
        window: u32,
        first: bool,
        /// Into the group's partial sum rather than the accumulator
        /// ([`SchedConfig::fold_group`]): the same place in a second buffer.
        partial: bool,
        /// Return the slot's credit once this has run (false: it was parked).
        credit: bool,
        /// The iteration it belongs to (with the slice's layer, its priority).
        iter: u64,
    },
    /// Give `worker` the credit for its landing slot `slot` now (a spare
    /// slot, in exchange for a parked one; or, for this rank's own worker,
    /// whose pushes are read from its gradient, the parked slot itself).
    /// Nothing to run.
    Credit { worker: u32, slot: u32 },
    /// A fold group's partial sum of `slice` is complete: `acc[window] +=
    /// partial[window]` over the slice (never the first contribution: group 0
    /// folds straight into the accumulator).
    FoldPartial { slice: u32, window: u32, iter: u64 },
    /// Every contribution to `chunk` for `iter` is summed in accumulator
    /// `window` (under a trigger other than [`Trigger::All`], the ones its
    /// round took): apply it to the shard's parameters. `gradients` is how
    /// many gradients the sum holds (contributions × learners): the mean and
    /// SGD divide by it. Under `All` it is always P1 × learners.
    Apply {
        chunk: u32,
        iter: u64,
        window: u32,
        gradients: u32,
    },
    /// A late contribution (for an iteration already applied) in landing
    /// slot `slot` of `worker` is dropped ([`Trigger::Quorum`],
    /// [`Trigger::Timeout`]): nothing to run; the slot's credit goes back to
    /// `worker` at once.
    Drop { worker: u32, slot: u32 },
    /// Write the shard's current values of `chunk` into `worker`'s parameter
    /// buffer, with the chunk id as the immediate. Report it with
    /// [`Server::handle_broadcast_done`].
    Broadcast { chunk: u32, worker: u32 },
    /// Adam ([`Scheme::Adam`]): every worker's sufficient factors of `layer`
    /// for `iter` are here. Write Σ_p U_pᵀ·V_p, summed in worker order (the
    /// first term written, each later one added, as the PS folds gradients),
    /// into accumulator `window` over the whole layer: its chunks lie
    /// together in this shard from the layer's first chunk's place. The
    /// chunks' `Apply` commands follow it and must run after it.
    SumFactors { layer: u32, iter: u64, window: u32 },
    /// Kvstore ([`Placement::KvStore`]): tell `worker` that `chunk` was
    /// applied and is now at `version`, once that apply has run. The worker
    /// pulls it ([`Server::handle_pull`]); the answer is a `Broadcast`.
    Notify { chunk: u32, worker: u32, version: u64 },
    /// Send the shard's momentum of `chunk` to every worker, once the
    /// chunk's latest `Apply` has run: its layer leaves the PS at `iter`
    /// (momentum moves: see [`Server::with_momentum`]). Nothing to report.
    SendMomentum { chunk: u32, iter: u64 },
}

/// Counters for tests and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Slices accumulated.
    pub accumulated: u64,
    /// Chunk applies.
    pub applies: u64,
    /// Chunk broadcasts.
    pub broadcasts: u64,
    /// Most landing slots of one worker occupied at once.
    pub max_slots_held: u32,
    /// Late contributions dropped (their credits went back at once).
    pub dropped: u64,
    /// Late contributions folded into a later round ([`Trigger::Async`]).
    pub late_folded: u64,
    /// Applies with fewer contributions than live workers.
    pub partial_applies: u64,
    /// Workers lost and no longer counted.
    pub lost: u32,
    /// Contributions parked (landed before a lower rank's, their credit
    /// exchanged for a spare slot's at once; [`SchedConfig::spare_slots`]).
    pub parked: u64,
    /// Contributions that waited for a lower rank's while holding their
    /// credit (every spare slot of their worker was parked).
    pub held_for_order: u64,
    /// Most spare slots of one worker parked at once.
    pub max_spares_used: u32,
    /// Lost workers that came back and are counted again.
    pub rejoined: u32,
    /// Adam: factor blocks received.
    pub factor_blocks: u64,
    /// Adam: layer gradients rebuilt from every worker's factors.
    pub factor_sums: u64,
}

/// The server core of one rank.
#[derive(Debug)]
pub struct Server {
    book: Arc<Book>,
    rank: u32,
    cfg: SchedConfig,
    p1: usize,
    window: usize,
    /// Global slice id → local index (u32::MAX when not ours).
    slice_local: Vec<u32>,
    /// Global chunk id → local index.
    chunk_local: Vec<u32>,
    /// Per (local slice, window): contributions folded in.
    folded: Vec<u32>,
    /// Per (local slice, window): the iteration the window holds.
    win_iter: Vec<u64>,
    /// Per (local slice, window, worker index): a landed slot waiting for its
    /// turn, and whether it is parked (its credit already went back).
    held: Vec<Option<(u32, bool)>>,
    /// Per worker index: spare landing slots free (see [`SchedConfig::spare_slots`]).
    spare_free: Vec<Vec<u32>>,
    /// Per (worker index, local slice): contributions received (the next one's iteration).
    received: Vec<u64>,
    /// Per (local chunk, window): slices complete.
    chunk_done: Vec<u32>,
    /// Per local chunk: the next iteration to apply.
    applied: Vec<u64>,
    /// Per local chunk: broadcasts queued or in flight.
    bcast_pending: Vec<u32>,
    /// Per worker index: slots currently held.
    slots_held: Vec<u32>,
    /// Chunks still to be seeded with their initial values.
    init_left: usize,
    /// Per local chunk: whether its initial values came (a second seeding
    /// of one chunk is refused, not counted for another's).
    seeded: Vec<bool>,
    /// Per local chunk, for worker 0's values and its momentum (a switch
    /// back from SFB, [`crate::plan::Plan::reseeds_at`]): the iteration the
    /// latest came for.
    reseeded: Vec<[Option<u64>; 2]>,
    /// Per local chunk, likewise: it came before the decision that says
    /// whether the chunk's next round comes back from SFB (checked then).
    reseed_early: Vec<[bool; 2]>,
    /// Whether momentum moves at switches ([`Server::with_momentum`]).
    moves_momentum: bool,
    /// Per local chunk: the iteration its momentum was last sent to the
    /// workers for (a switch to SFB), and worker 0's last taken in (back).
    momentum_out: Vec<Option<u64>>,
    momentum_in: Vec<Option<u64>>,
    /// The schemes by iteration: the book's, and the decisions since ([`crate::plan`]).
    plan: crate::plan::Plan,
    bcast_queue: BinaryHeap<Reverse<(u64, u32, u32)>>,
    bcast_bytes: usize,
    /// Bytes of broadcasts out at once ([`SchedConfig::bcast_window`]).
    bcast_window: usize,
    out: VecDeque<ServerCommand>,
    stats: ServerStats,
    /// Triggers other than `All`: per (local chunk, worker index), slices
    /// folded into the chunk's round in progress.
    got: Vec<u32>,
    /// Per local chunk: when the round's first contribution came (timeout).
    round_first: Vec<Option<Duration>>,
    /// Timeout wake-ups: (deadline, local chunk), stale ones skipped.
    deadlines: BinaryHeap<Reverse<(Duration, u32)>>,
    /// Per worker index: lost, no longer counted.
    lost: Vec<bool>,
    live: usize,
    /// The time of the input being handled (the Node's clock).
    now: Duration,
    /// Kvstore: per (local chunk, worker index), a notification sent and not
    /// yet pulled (empty otherwise).
    owed: Vec<bool>,
    /// Kvstore: arrival number of the next pull (pulls are answered FIFO).
    pull_seq: u64,
    /// Adam: per layer held here, the workers whose factors for the layer's
    /// next iteration are in.
    factors_got: crate::fxhash::FxHashMap<u32, Vec<bool>>,
    /// Adam: per layer held here, the next iteration to sum (absent: 0).
    factors_next: crate::fxhash::FxHashMap<u32, u64>,
}

/// The local index of each of the book's slices and chunks on `rank`'s
/// server (`u32::MAX` for those of other servers), in shard order, and the
/// number of its slices.
fn local_indices(book: &Book, rank: u32) -> (Vec<u32>, Vec<u32>, usize) {
    let mut slice_local = vec![u32::MAX; book.slices().len()];
    let mut chunk_local = vec![u32::MAX; book.chunks().len()];
    let mut nls = 0u32;
    for (lc, &c) in book.server_chunks(rank).iter().enumerate() {
        chunk_local[c as usize] = lc as u32;
        for s in book.chunk_slices(c) {
            slice_local[s as usize] = nls;
            nls += 1;
        }
    }
    // Every chunk of the shard has its own local index.
    debug_assert_eq!(
        chunk_local.iter().filter(|&&c| c != u32::MAX).count(),
        book.server_chunks(rank).len()
    );
    // The book's shard length is its chunks' (placement and shard agree).
    debug_assert_eq!(
        book.server_chunks(rank)
            .iter()
            .map(|&c| book.chunks()[c as usize].len)
            .sum::<usize>(),
        book.shard_len(rank)
    );
    (slice_local, chunk_local, nls as usize)
}

impl Server {
    /// The server core for `rank`, which must be a server in the book's cluster.
    pub fn new(book: Arc<Book>, rank: u32, cfg: SchedConfig) -> Result<Self> {
        cfg.validate()?;
        let cfg = cfg.resolve(&book);
        cfg.validate()?;
        if book.cluster().server_index(rank).is_none() {
            return Err(EngineError::InvalidConfig(format!(
                "rank {rank} is not a server in this cluster"
            )));
        }
        let p1 = book.p1();
        if let Trigger::Quorum(k) = cfg.trigger {
            if k as usize > p1 {
                return Err(EngineError::InvalidConfig(format!(
                    "a quorum of {k} workers, but the cluster has {p1}"
                )));
            }
        }
        let window = cfg.consistency.staleness() as usize + 1;
        let (slice_local, chunk_local, nls) = local_indices(&book, rank);
        let nlc = book.server_chunks(rank).len();
        debug_assert!((1..=65).contains(&window), "SSP staleness is at most 64");
        Ok(Server {
            p1,
            window,
            slice_local,
            chunk_local,
            folded: vec![0; nls * window],
            win_iter: (0..nls * window).map(|i| (i % window) as u64).collect(),
            held: vec![None; nls * window * p1],
            received: vec![0; p1 * nls],
            chunk_done: vec![0; nlc * window],
            applied: vec![0; nlc],
            bcast_pending: vec![0; nlc],
            slots_held: vec![0; p1],
            spare_free: vec![(cfg.slots..cfg.landing_slots()).rev().collect(); p1],
            init_left: nlc,
            seeded: vec![false; nlc],
            reseeded: vec![[None; 2]; nlc],
            reseed_early: vec![[false; 2]; nlc],
            moves_momentum: false,
            momentum_out: vec![None; nlc],
            momentum_in: vec![None; nlc],
            plan: book.plan().clone(),
            bcast_queue: BinaryHeap::new(),
            bcast_bytes: 0,
            bcast_window: cfg.bcast_window(&book, rank),
            out: VecDeque::new(),
            stats: ServerStats::default(),
            got: if cfg.trigger == Trigger::All {
                Vec::new()
            } else {
                vec![0; nlc * p1]
            },
            round_first: vec![None; nlc],
            deadlines: BinaryHeap::new(),
            lost: vec![false; p1],
            live: p1,
            now: Duration::ZERO,
            owed: if book.config().placement == Placement::KvStore {
                vec![false; nlc * p1]
            } else {
                Vec::new()
            },
            pull_seq: 1,
            factors_got: Default::default(),
            factors_next: Default::default(),
            book,
            rank,
            cfg,
        })
    }

    /// This server's rank.
    pub fn rank(&self) -> u32 {
        debug_assert!(self.book.cluster().server_index(self.rank).is_some());
        self.rank
    }
    /// Accumulator copies of the shard the driver must keep (s + 1).
    pub fn windows(&self) -> usize {
        debug_assert_eq!(self.window as u64, self.cfg.consistency.staleness() + 1);
        self.window
    }
    /// Whether every chunk of the shard has its initial values.
    pub fn is_initialized(&self) -> bool {
        debug_assert!(self.init_left <= self.applied.len());
        self.init_left == 0
    }
    /// Counters.
    pub fn stats(&self) -> ServerStats {
        self.stats
    }
    /// The next command for the driver.
    pub fn poll_command(&mut self) -> Option<ServerCommand> {
        self.out.pop_front()
    }
    /// No broadcast is queued or in flight: nothing is owed to any worker now.
    pub fn is_quiet(&self) -> bool {
        // Pending counts every broadcast queued or in flight.
        debug_assert!(
            self.bcast_pending.iter().any(|&n| n > 0) || (self.bcast_queue.is_empty() && self.bcast_bytes == 0)
        );
        self.bcast_queue.is_empty() && self.bcast_bytes == 0 && self.bcast_pending.iter().all(|&n| n == 0)
    }
    /// Iterations applied to `chunk` so far.
    pub fn applied(&self, chunk: u32) -> Option<u64> {
        let lc = *self.chunk_local.get(chunk as usize)?;
        (lc != u32::MAX).then(|| self.applied[lc as usize])
    }
    /// The per-worker clocks: iterations each worker has fully pushed to this shard.
    pub fn worker_clocks(&self) -> Vec<u64> {
        let nls = self.received.len() / self.p1.max(1);
        (0..self.p1)
            .map(|wi| {
                self.received[wi * nls..(wi + 1) * nls]
                    .iter()
                    .copied()
                    .min()
                    .unwrap_or(0)
            })
            .collect()
    }

    /// A slice that a finished worker can no longer complete: some other
    /// worker pushed an iteration of it that the finished one (`finished(wi)`:
    /// it pushes nothing more) never pushed, so its accumulator would wait
    /// forever. Returns (worker index, global slice, iteration). One pass over
    /// the shard's slices and workers.
    pub fn stranded(&self, finished: impl Fn(usize) -> bool) -> Option<(usize, u32, u64)> {
        if self.cfg.trigger != Trigger::All {
            return self.stranded_round(finished);
        }
        let nls = self.received.len() / self.p1.max(1);
        let done: Vec<usize> = (0..self.p1).filter(|&w| finished(w)).collect();
        if done.is_empty() {
            return None;
        }
        for ls in 0..nls {
            let max = (0..self.p1).map(|w| self.received[w * nls + ls]).max().unwrap_or(0);
            if let Some(&wi) = done.iter().find(|&&w| self.received[w * nls + ls] < max) {
                let global = self.slice_local.iter().position(|&l| l == ls as u32)? as u32;
                return Some((wi, global, self.received[wi * nls + ls]));
            }
        }
        None
    }

    /// How many folds the accumulator of a slice receives per iteration: one
    /// per worker, or with fold groups ([`SchedConfig::fold_group`]) one per
    /// member of group 0 and one per later group (its partial sum).
    pub fn acc_contributions(&self) -> usize {
        let g = self.cfg.fold_group.max(1) as usize;
        if !self.deterministic() || g == 1 || self.p1 <= g {
            return self.p1;
        }
        let groups = self.p1.div_ceil(g);
        // Group 0's g members, then one fold per later group.
        let n = g + groups - 1;
        debug_assert!(n <= self.p1, "every later group has a member");
        n
    }

    /// Whether contributions are folded in worker order. Only under BSP: under
    /// SSP a slow worker would hold every faster worker's slots, which would
    /// undo the staleness bound, and SSP values depend on timing anyway.
    pub fn deterministic(&self) -> bool {
        self.cfg.deterministic && self.window == 1 && self.cfg.trigger == Trigger::All
    }

    fn err(&self, rank: u32, violation: ProtocolViolation) -> EngineError {
        EngineError::protocol(rank, violation)
    }

    /// Worker index 0 wrote the initial values of `chunk` into the shard,
    /// or (once every chunk is seeded) its values again where the chunk's
    /// layer comes back from SFB to the PS.
    pub fn handle_init(&mut self, from: u32, chunk: u32) -> Result<()> {
        let lc = self.local_chunk(from, chunk)?;
        if self.init_left == 0 && (self.plan.has_switches() || self.plan.every() > 0) {
            return self.handle_values_back(from, chunk, lc);
        }
        if self.applied[lc] != 0 || self.init_left == 0 || self.seeded[lc] {
            return Err(self.err(from, ProtocolViolation::InitTwice { chunk }));
        }
        self.seeded[lc] = true;
        self.init_left -= 1;
        debug_assert!(self.init_left < self.seeded.len());
        if self.init_left == 0 {
            // Nothing is applied before every chunk has its initial values.
            debug_assert!(self.applied.iter().all(|&a| a == 0));
            let chunks: Vec<u32> = self.book.server_chunks(self.rank).to_vec();
            for c in chunks {
                self.queue_broadcast(0, c);
            }
            // Every worker gets every chunk's initial values.
            debug_assert!(self.bcast_pending.iter().all(|&n| n as usize == self.live));
            self.pump_broadcasts();
        }
        Ok(())
    }

    fn local_chunk(&self, from: u32, chunk: u32) -> Result<usize> {
        match self.chunk_local.get(chunk as usize) {
            Some(&lc) if lc != u32::MAX => Ok(lc as usize),
            _ => Err(self.err(
                from,
                ProtocolViolation::ChunkNotInShard {
                    chunk,
                    server: self.rank,
                },
            )),
        }
    }

    /// A worker's write of `slice` landed in its slot `slot`.
    pub fn handle_landed(&mut self, worker: u32, slot: u32, slice: u32) -> Result<()> {
        let (wi, ls) = self.check_landed(worker, slot, slice)?;
        if self.cfg.trigger != Trigger::All {
            return self.landed_triggered(wi, worker, slot, slice, ls);
        }
        let nls = self.folded.len() / self.window;
        let iter = self.received[wi * nls + ls];
        let w = (iter % self.window as u64) as usize;
        let sw = ls * self.window + w;
        if self.win_iter[sw] != iter {
            return Err(self.err(
                worker,
                ProtocolViolation::SliceTooEarly {
                    slice,
                    iter,
                    applied: self.win_iter[sw],
                },
            ));
        }
        // Each worker's contribution lands once per iteration: the window
        // never has all of them before this one.
        debug_assert!(
            (self.folded[sw] as usize) < self.p1,
            "slice {slice}: {} folds",
            self.folded[sw]
        );
        self.received[wi * nls + ls] += 1;
        self.slots_held[wi] += 1;
        self.stats.max_slots_held = self.stats.max_slots_held.max(self.slots_held[wi]);
        if self.slots_held[wi] > self.cfg.slots {
            return Err(self.err(worker, ProtocolViolation::CreditsExceeded));
        }
        if self.deterministic() {
            self.fold_in_rank_order(wi, worker, slot, slice, sw, w);
        } else {
            self.fold(wi, slot, slice, sw, w, true);
        }
        // A worker is at most the window's iterations ahead of the chunk's apply (SSP's bound).
        let lc = self.chunk_local[self.book.slices()[slice as usize].chunk as usize] as usize;
        debug_assert!(self.received[wi * nls + ls] <= self.applied[lc] + self.window as u64);
        self.debug_invariants();
        Ok(())
    }

    /// The worker index of `worker` and the local index of `slice`, for its
    /// write that landed in slot `slot`: checked that it comes from a
    /// worker, after every chunk's seeding, into a landing slot, and holds
    /// a slice of this shard.
    fn check_landed(&self, worker: u32, slot: u32, slice: u32) -> Result<(usize, usize)> {
        let wi = self
            .book
            .cluster()
            .worker_index(worker)
            .ok_or_else(|| self.err(worker, ProtocolViolation::PushFromNonWorker))?;
        if self.init_left != 0 {
            return Err(self.err(worker, ProtocolViolation::PushBeforeInit));
        }
        if slot >= self.cfg.landing_slots() {
            return Err(self.err(
                worker,
                ProtocolViolation::SlotOutOfRange {
                    slot,
                    slots: self.cfg.landing_slots(),
                },
            ));
        }
        let ls = match self.slice_local.get(slice as usize) {
            Some(&ls) if ls != u32::MAX => ls as usize,
            _ => {
                return Err(self.err(
                    worker,
                    ProtocolViolation::SliceNotInShard {
                        slice,
                        server: self.rank,
                    },
                ))
            }
        };
        debug_assert!(ls * self.window < self.folded.len(), "slice {slice} is local");
        Ok((wi, ls))
    }

    /// The deterministic order: the contribution of `worker` (index `wi`) in `slot`
    /// to `slice` (window slot `sw`, window `w`) waits for the lower ranks'
    /// (parked where it is not its turn, and its credit exchanged for a
    /// spare's), and every held contribution whose turn has come folds, in
    /// worker order.
    fn fold_in_rank_order(&mut self, wi: usize, worker: u32, slot: u32, slice: u32, sw: usize, w: usize) {
        debug_assert!(self.folded[sw] as usize <= wi, "worker {wi} folded out of rank order");
        debug_assert!(
            self.held[sw * self.p1 + wi].is_none(),
            "worker {wi} holds two slots of slice {slice}"
        );
        // Not its turn: park it, so that rank order holds no credit.
        let parked = if self.folded[sw] as usize != wi {
            self.park(wi, worker)
        } else {
            None
        };
        if let Some(spare) = parked {
            self.out.push_back(ServerCommand::Credit {
                worker,
                slot: spare.unwrap_or(slot),
            });
        }
        self.held[sw * self.p1 + wi] = Some((slot, parked.is_some()));
        // Fold every held contribution whose turn has come, in worker order.
        while (self.folded[sw] as usize) < self.p1 {
            let next = self.folded[sw] as usize;
            let Some((s, parked)) = self.held[sw * self.p1 + next].take() else {
                break;
            };
            self.fold(next, s, slice, sw, w, !parked);
        }
    }

    /// Parks a landed contribution of worker index `wi` that must wait for a
    /// lower rank's: `Some(Some(spare))` to credit a spare slot in its place;
    /// `Some(None)` for this rank's own worker (read from its gradient, so its
    /// slot's credit goes back as it is); `None` when every spare is parked
    /// (it holds its credit until its turn).
    fn park(&mut self, wi: usize, worker: u32) -> Option<Option<u32>> {
        let spare = if worker == self.rank {
            None
        } else {
            match self.spare_free[wi].pop() {
                Some(y) => {
                    debug_assert!(y < self.cfg.landing_slots(), "spare slot {y}");
                    Some(y)
                }
                None => {
                    self.stats.held_for_order += 1;
                    return None;
                }
            }
        };
        debug_assert!(self.slots_held[wi] > 0, "a parked contribution held a slot");
        self.slots_held[wi] -= 1;
        self.stats.parked += 1;
        let used = self.cfg.spare_slots - self.spare_free[wi].len() as u32;
        self.stats.max_spares_used = self.stats.max_spares_used.max(used);
        Some(spare)
    }

    /// A parked slot's `Accumulate` (one without `credit`) ran: the slot is a
    /// spare again. Nothing for this rank's own worker (its slots are tokens).
    pub fn handle_parked_read(&mut self, worker: u32, slot: u32) -> Result<()> {
        // Only the deterministic order parks (the Node reports the parked reads it ran).
        debug_assert!(self.deterministic(), "a parked slot without the rank order");
        if worker == self.rank {
            return Ok(());
        }
        let wi = self
            .book
            .cluster()
            .worker_index(worker)
            .ok_or_else(|| self.err(worker, ProtocolViolation::ParkedFromNonWorker))?;
        let total = self.cfg.landing_slots() as usize;
        if slot as usize >= total
            || self.spare_free[wi].contains(&slot)
            || self.spare_free[wi].len() >= self.cfg.spare_slots as usize
        {
            return Err(self.err(worker, ProtocolViolation::ParkedFreedTwice { slot }));
        }
        self.spare_free[wi].push(slot);
        self.debug_invariants();
        Ok(())
    }

    fn fold(&mut self, wi: usize, slot: u32, slice: u32, sw: usize, w: usize, credit: bool) {
        let worker = self.book.cluster().workers()[wi];
        debug_assert!(slot < self.cfg.landing_slots(), "slot {slot} of worker {wi}");
        // Fold groups (deterministic order only, where `wi == folded[sw]`):
        // group 0 sums straight into the accumulator; every later group of two
        // or more sums into the partial buffer, which joins the accumulator
        // once the group is complete. That is what a node's local aggregator
        // and then the server compute for the same learners.
        let g = self.cfg.fold_group.max(1) as usize;
        // The deterministic order: worker index wi is the next to fold.
        debug_assert!(!self.deterministic() || self.folded[sw] as usize == wi);
        debug_assert!((self.folded[sw] as usize) < self.p1);
        let grouped = self.deterministic() && g > 1 && wi >= g && self.p1.min(wi / g * g + g) - wi / g * g > 1;
        let pos = wi % g;
        // The round's iteration (switches leave SFB iterations out of a layer's rounds).
        let layer = self.book.slices()[slice as usize].layer;
        let iter = self.round_label(layer, self.win_iter[sw]);
        self.out.push_back(ServerCommand::Accumulate {
            worker,
            slot,
            slice,
            window: w as u32,
            first: if grouped { pos == 0 } else { self.folded[sw] == 0 },
            partial: grouped,
            credit,
            iter,
        });
        if grouped && (pos == g - 1 || wi == self.p1 - 1) {
            self.out.push_back(ServerCommand::FoldPartial {
                slice,
                window: w as u32,
                iter,
            });
        }
        if credit {
            debug_assert!(self.slots_held[wi] > 0, "the folded slot was held");
            self.slots_held[wi] -= 1;
        }
        self.stats.accumulated += 1;
        self.folded[sw] += 1;
        if self.folded[sw] as usize == self.p1 {
            let chunk = self.book.slices()[slice as usize].chunk;
            let lc = self.chunk_local[chunk as usize] as usize;
            debug_assert!(self.chunk_done[lc * self.window + w] < self.nslices(chunk));
            self.chunk_done[lc * self.window + w] += 1;
            self.try_apply(chunk);
        }
    }

    fn try_apply(&mut self, chunk: u32) {
        if self.cfg.trigger != Trigger::All {
            self.try_apply_triggered(chunk);
            return;
        }
        let lc = self.chunk_local[chunk as usize] as usize;
        let t = self.applied[lc];
        let w = (t % self.window as u64) as usize;
        let nslices = self.book.chunk_slices(chunk).len() as u32;
        if self.chunk_done[lc * self.window + w] != nslices || self.bcast_pending[lc] != 0 {
            return;
        }
        // Round t's iteration; back from SFB, the shard needs worker 0's values first.
        let layer = self.book.chunks()[chunk as usize].layer;
        let Some(real) = self.plan.round_iter(layer, t).filter(|&r| self.plan.settled(layer, r)) else {
            // The round's iteration waits for worker 0's decision.
            return;
        };
        let back = self.plan.reseeds_at(layer, real);
        if back && (self.reseeded[lc][0] != Some(real) || (self.moves_momentum && self.reseeded[lc][1] != Some(real))) {
            return;
        }
        self.out.push_back(ServerCommand::Apply {
            chunk,
            iter: real,
            window: w as u32,
            gradients: (self.p1 * self.cfg.learners as usize) as u32,
        });
        self.stats.applies += 1;
        self.chunk_done[lc * self.window + w] = 0;
        let adam = self.plan.scheme(layer, real) == Scheme::Adam;
        for s in self.book.chunk_slices(chunk) {
            let sw = self.slice_local[s as usize] as usize * self.window + w;
            // Every worker's contribution to every slice is in (Adam sums factors instead),
            // and the window holds the iteration applied.
            debug_assert!(
                adam || self.folded[sw] as usize == self.p1,
                "slice {s}: {} folds",
                self.folded[sw]
            );
            debug_assert_eq!(self.win_iter[sw], t, "slice {s}");
            self.folded[sw] = 0;
            self.win_iter[sw] = t + self.window as u64;
        }
        self.applied[lc] = t + 1;
        self.queue_broadcast(t + 1, chunk);
        self.pump_broadcasts();
        self.maybe_send_momentum(chunk);
    }

    fn queue_broadcast(&mut self, version: u64, chunk: u32) {
        let lc = self.chunk_local[chunk as usize] as usize;
        debug_assert_eq!(
            version, self.applied[lc],
            "chunk {chunk}: the version broadcast is the one applied"
        );
        // Broadcasts go out by the iteration they finish (round `version - 1`'s).
        let layer = self.book.chunks()[chunk as usize].layer;
        let key = version
            .checked_sub(1)
            .map_or(0, |k| self.round_label(layer, k).saturating_add(1));
        for wi in 0..self.p1 {
            if self.lost[wi] {
                continue;
            }
            if !self.owed.is_empty() && version > 0 {
                // Kvstore: a notification now, the values when pulled. The
                // pull counts as pending until its write is placed, so the
                // next iteration's apply waits for every worker's pull.
                debug_assert!(!self.owed[lc * self.p1 + wi], "one notification per version");
                self.owed[lc * self.p1 + wi] = true;
                self.bcast_pending[lc] += 1;
                self.out.push_back(ServerCommand::Notify {
                    chunk,
                    worker: self.book.cluster().workers()[wi],
                    version,
                });
                continue;
            }
            self.bcast_queue.push(Reverse((key, chunk, wi as u32)));
            self.bcast_pending[lc] += 1;
        }
        // At most one broadcast (or notification) of a chunk per worker is owed.
        debug_assert!(self.bcast_pending[lc] as usize <= self.p1, "chunk {chunk}");
    }

    fn pump_broadcasts(&mut self) {
        while let Some(&Reverse((_, chunk, wi))) = self.bcast_queue.peek() {
            let bytes = self.book.chunks()[chunk as usize].len * 4;
            if self.bcast_bytes > 0 && self.bcast_bytes + bytes > self.bcast_window {
                break;
            }
            self.bcast_queue.pop();
            debug_assert!(!self.lost[wi as usize], "nothing is queued for a lost worker");
            debug_assert!(self.bcast_pending[self.chunk_local[chunk as usize] as usize] > 0);
            self.bcast_bytes += bytes;
            // The broadcast window: never exceeded, but by one chunk alone.
            debug_assert!(self.bcast_bytes <= self.bcast_window || self.bcast_bytes == bytes);
            self.stats.broadcasts += 1;
            self.out.push_back(ServerCommand::Broadcast {
                chunk,
                worker: self.book.cluster().workers()[wi as usize],
            });
        }
        self.debug_invariants();
    }

    /// What every input leaves true (O(workers)), checked after each.
    fn debug_invariants(&self) {
        debug_assert_eq!(self.live, self.lost.iter().filter(|&&l| !l).count(), "live workers");
        debug_assert!(self.init_left <= self.applied.len());
        debug_assert!(self.spare_free.iter().all(|f| f.len() <= self.cfg.spare_slots as usize));
        // A worker never has more slots held here than the credits it was lent.
        debug_assert!(
            self.slots_held.iter().all(|&h| h <= self.cfg.slots),
            "{:?}",
            self.slots_held
        );
        // Each mode's state exists exactly in its mode.
        let per_chunk_worker = self.applied.len() * self.p1;
        let kvstore = self.book.config().placement == Placement::KvStore;
        debug_assert_eq!(self.owed.len(), if kvstore { per_chunk_worker } else { 0 });
        debug_assert_eq!(
            self.got.len(),
            if self.cfg.trigger == Trigger::All {
                0
            } else {
                per_chunk_worker
            }
        );
        debug_assert!(
            self.window == 1 || self.cfg.trigger == Trigger::All,
            "SSP needs the all trigger"
        );
    }

    /// Adam ([`Scheme::Adam`]): `worker`'s sufficient factors of `layer` for
    /// `iter` are stored by the driver. Once every worker's are, the layer's
    /// gradient is rebuilt ([`ServerCommand::SumFactors`]) and each of its
    /// chunks applied and broadcast as after the PS's last fold.
    ///
    /// BSP with [`Trigger::All`] only (what [`crate::node::Node::new`]
    /// allows for Adam): anything else is refused here too.
    pub fn handle_factors(&mut self, worker: u32, layer: u32, iter: u64) -> Result<()> {
        if self.cfg.trigger != Trigger::All || self.window != 1 {
            return Err(EngineError::InvalidConfig(
                "adam factors need BSP and the all trigger".into(),
            ));
        }
        let wi = self
            .book
            .cluster()
            .worker_index(worker)
            .ok_or_else(|| self.err(worker, ProtocolViolation::FactorsFromNonWorker))?;
        if self.init_left != 0 {
            return Err(self.err(worker, ProtocolViolation::FactorsBeforeInit));
        }
        if self.book.layer(layer).is_err() || self.plan.scheme(layer, iter) != Scheme::Adam {
            return Err(self.err(worker, ProtocolViolation::FactorsNotAdam { layer }));
        }
        let chunks = self.book.layer_chunks(layer);
        let mut lcs = Vec::with_capacity(chunks.len());
        for c in chunks.clone() {
            lcs.push(self.local_chunk(worker, c)?);
        }
        // Under BSP a worker sends iteration t + 1 only once it has the
        // layer's version t + 1: every chunk applied t. And each iteration
        // is summed once: a block for one already summed (its apply may
        // still wait for broadcasts) is refused.
        let next = self.factors_next.get(&layer).copied().unwrap_or(0);
        if iter != next || lcs.iter().any(|&lc| self.applied[lc] != iter) {
            return Err(self.err(
                worker,
                ProtocolViolation::FactorsOutOfOrder {
                    layer,
                    iter,
                    next: self.applied[lcs[0]],
                },
            ));
        }
        let p1 = self.p1;
        let got = self.factors_got.entry(layer).or_insert_with(|| vec![false; p1]);
        if std::mem::replace(&mut got[wi], true) {
            return Err(self.err(worker, ProtocolViolation::SecondFactorBlock { layer, iter }));
        }
        self.stats.factor_blocks += 1;
        if !got.iter().all(|&g| g) {
            return Ok(());
        }
        self.factors_got.remove(&layer);
        self.factors_next.insert(layer, iter + 1);
        self.stats.factor_sums += 1;
        let w = (iter % self.window as u64) as usize;
        self.out.push_back(ServerCommand::SumFactors {
            layer,
            iter,
            window: w as u32,
        });
        for (c, lc) in chunks.zip(lcs) {
            debug_assert_eq!(
                self.chunk_done[lc * self.window + w],
                0,
                "chunk {c}: its last iteration was applied"
            );
            self.chunk_done[lc * self.window + w] = self.nslices(c);
            self.try_apply(c);
        }
        Ok(())
    }

    /// A broadcast of `chunk` to `worker` was placed.
    pub fn handle_broadcast_done(&mut self, chunk: u32, worker: u32) -> Result<()> {
        let lc = self.local_chunk(worker, chunk)?;
        if self.bcast_pending[lc] == 0 {
            return Err(self.err(worker, ProtocolViolation::BroadcastNotSent { chunk }));
        }
        debug_assert!(self.bcast_bytes >= self.book.chunks()[chunk as usize].len * 4);
        self.bcast_pending[lc] -= 1;
        debug_assert!((self.bcast_pending[lc] as usize) < self.p1);
        self.bcast_bytes -= self.book.chunks()[chunk as usize].len * 4;
        self.pump_broadcasts();
        // A later iteration may have completed while this broadcast was out.
        self.try_apply(chunk);
        Ok(())
    }
}

/// Triggers other than [`Trigger::All`] (see its docs): arrival-order
/// folding, late contributions, partial applies, timeouts and lost workers.
impl Server {
    /// The clock of the input being handled (the Node sets it before every input).
    pub fn set_now(&mut self, now: Duration) {
        debug_assert!(now >= self.now, "time goes forward: {now:?} after {:?}", self.now);
        self.now = now;
    }

    /// When the server next needs [`Server::handle_tick`] (a round's timeout).
    pub fn next_deadline(&self) -> Option<Duration> {
        self.deadlines.peek().map(|Reverse((t, _))| *t)
    }

    /// Time passed: applies the rounds whose timeout expired.
    pub fn handle_tick(&mut self) {
        debug_assert!(matches!(self.cfg.trigger, Trigger::Timeout(_)) || self.deadlines.is_empty());
        while let Some(&Reverse((t, lc))) = self.deadlines.peek() {
            if t > self.now {
                break;
            }
            self.deadlines.pop();
            let chunk = self.book.server_chunks(self.rank)[lc as usize];
            self.try_apply(chunk);
        }
    }

    /// Live workers (not lost).
    pub fn live_workers(&self) -> usize {
        debug_assert!(self.live <= self.p1);
        self.live
    }

    /// Whether worker index `wi` was lost.
    pub fn is_lost(&self, wi: usize) -> bool {
        self.lost.get(wi).copied().unwrap_or(false)
    }

    fn nslices(&self, chunk: u32) -> u32 {
        debug_assert_eq!(
            self.book.chunks()[chunk as usize].server,
            self.rank,
            "chunk {chunk} is in this shard"
        );
        self.book.chunk_slices(chunk).len() as u32
    }

    fn landed_triggered(&mut self, wi: usize, worker: u32, slot: u32, slice: u32, ls: usize) -> Result<()> {
        let nls = self.folded.len();
        debug_assert!(self.window == 1 && self.got.len() == self.applied.len() * self.p1);
        let iter = self.received[wi * nls + ls];
        self.received[wi * nls + ls] += 1;
        let chunk = self.book.slices()[slice as usize].chunk;
        let lc = self.chunk_local[chunk as usize] as usize;
        let cur = self.applied[lc];
        if iter > cur {
            return Err(self.err(
                worker,
                ProtocolViolation::SliceTooEarly {
                    slice,
                    iter,
                    applied: cur,
                },
            ));
        }
        self.slots_held[wi] += 1;
        self.stats.max_slots_held = self.stats.max_slots_held.max(self.slots_held[wi]);
        if self.slots_held[wi] > self.cfg.slots {
            return Err(self.err(worker, ProtocolViolation::CreditsExceeded));
        }
        let late = iter < cur;
        if self.lost[wi] || (late && self.cfg.trigger != Trigger::Async) {
            self.slots_held[wi] -= 1;
            self.stats.dropped += 1;
            self.out.push_back(ServerCommand::Drop { worker, slot });
            return Ok(());
        }
        if late {
            self.stats.late_folded += 1;
        }
        self.out.push_back(ServerCommand::Accumulate {
            worker,
            slot,
            slice,
            window: 0,
            first: self.folded[ls] == 0,
            partial: false,
            credit: true,
            iter: cur,
        });
        self.slots_held[wi] -= 1;
        self.stats.accumulated += 1;
        self.folded[ls] += 1;
        self.got[lc * self.p1 + wi] += 1;
        if let Trigger::Timeout(d) = self.cfg.trigger {
            if self.round_first[lc].is_none() {
                self.round_first[lc] = Some(self.now);
                self.deadlines.push(Reverse((self.now + d, lc as u32)));
            }
        }
        self.try_apply(chunk);
        Ok(())
    }

    /// (workers whose whole contribution is in, contributions in the sum,
    /// whether a worker's contribution is half in) for the round in progress.
    fn round(&self, lc: usize, n: u32) -> (usize, u32, bool) {
        debug_assert!(n > 0);
        let got = &self.got[lc * self.p1..(lc + 1) * self.p1];
        let complete = got.iter().filter(|&&g| g >= n).count();
        let half = got.iter().any(|&g| g % n != 0);
        let sum: u32 = got.iter().sum();
        (complete, sum / n, half)
    }

    fn try_apply_triggered(&mut self, chunk: u32) {
        let lc = self.chunk_local[chunk as usize] as usize;
        if self.bcast_pending[lc] != 0 {
            return;
        }
        let n = self.nslices(chunk);
        let (complete, contributions, half) = self.round(lc, n);
        if half || complete == 0 {
            return;
        }
        let fire = match self.cfg.trigger {
            Trigger::All => unreachable!("the All path"),
            Trigger::Quorum(k) => complete >= (k as usize).min(self.live),
            Trigger::Async => true,
            Trigger::Timeout(d) => {
                let got = &self.got[lc * self.p1..(lc + 1) * self.p1];
                let live_in = (0..self.p1).filter(|&w| !self.lost[w] && got[w] >= n).count();
                live_in >= self.live || self.round_first[lc].is_some_and(|t0| self.now >= t0 + d)
            }
        };
        if !fire {
            return;
        }
        let t = self.applied[lc];
        // A worker's whole contribution is in: the mean divides by a positive count.
        debug_assert!(contributions > 0 && complete <= self.p1);
        if complete < self.live {
            self.stats.partial_applies += 1;
        }
        self.out.push_back(ServerCommand::Apply {
            chunk,
            iter: t,
            window: 0,
            gradients: contributions * self.cfg.learners,
        });
        self.stats.applies += 1;
        for s in self.book.chunk_slices(chunk) {
            let ls = self.slice_local[s as usize] as usize;
            self.folded[ls] = 0;
            self.win_iter[ls] = t + 1;
        }
        self.got[lc * self.p1..(lc + 1) * self.p1].fill(0);
        debug_assert!(self.round_first[lc].is_none() || matches!(self.cfg.trigger, Trigger::Timeout(_)));
        self.round_first[lc] = None;
        self.applied[lc] = t + 1;
        self.queue_broadcast(t + 1, chunk);
        self.pump_broadcasts();
    }

    /// Worker index `wi` is lost (its connection failed). Under a trigger
    /// other than `All`, the server stops counting it and goes on; it fails
    /// when the round cannot be completed without it: the worker was lost
    /// with half its contribution to a chunk in, or too few workers remain
    /// for the quorum. Broadcasts queued for it are forgotten (the ones in
    /// flight complete as the Node drops its connection).
    pub fn handle_worker_lost(&mut self, wi: usize) -> Result<()> {
        let rank = self.book.cluster().workers()[wi];
        let lost = |reason: String| EngineError::PeerLost { rank, reason };
        if self.cfg.trigger == Trigger::All {
            return Err(lost("a worker was lost and the aggregation trigger is `all`".into()));
        }
        if self.lost[wi] {
            return Ok(());
        }
        self.lost[wi] = true;
        debug_assert!(self.live > 0, "worker {wi} was counted live");
        self.live -= 1;
        self.stats.lost += 1;
        let chunks: Vec<u32> = self.book.server_chunks(self.rank).to_vec();
        for (lc, &c) in chunks.iter().enumerate() {
            let g = self.got[lc * self.p1 + wi];
            if g % self.nslices(c) != 0 {
                return Err(lost(format!(
                    "it was lost with {g} of the {} slices of its contribution to chunk {c} (iteration {}) in, so that round cannot be applied",
                    self.nslices(c),
                    self.applied[lc]
                )));
            }
        }
        if self.live == 0 {
            return Err(lost("no worker is left".into()));
        }
        if let Trigger::Quorum(k) = self.cfg.trigger {
            if self.live < k as usize {
                return Err(lost(format!(
                    "the quorum of {k} workers cannot be reached: {} are left",
                    self.live
                )));
            }
        }
        let wi32 = wi as u32;
        let queue = std::mem::take(&mut self.bcast_queue);
        for Reverse((v, c, w)) in queue {
            if w == wi32 {
                debug_assert!(self.bcast_pending[self.chunk_local[c as usize] as usize] > 0);
                self.bcast_pending[self.chunk_local[c as usize] as usize] -= 1;
            } else {
                self.bcast_queue.push(Reverse((v, c, w)));
            }
        }
        for c in chunks {
            self.try_apply(c);
        }
        self.pump_broadcasts();
        Ok(())
    }

    /// Worker index `wi`, lost before, is back (a new process, connected and
    /// open): it is counted again from the round in progress. Its pushes
    /// count from every chunk's current iteration, and every chunk's current
    /// values go to it, highest priority first (its starting parameters).
    pub fn handle_worker_rejoined(&mut self, wi: usize) -> Result<()> {
        let rank = self.book.cluster().workers()[wi];
        if !self.lost[wi] {
            return Err(self.err(rank, ProtocolViolation::RejoinNotLost));
        }
        debug_assert!(self.live < self.p1, "worker {wi} was not counted");
        self.lost[wi] = false;
        self.live += 1;
        self.stats.rejoined += 1;
        self.slots_held[wi] = 0;
        let nls = self.folded.len() / self.window;
        let chunks: Vec<u32> = self.book.server_chunks(self.rank).to_vec();
        for (lc, &c) in chunks.iter().enumerate() {
            for s in self.book.chunk_slices(c) {
                let ls = self.slice_local[s as usize] as usize;
                self.received[wi * nls + ls] = self.applied[lc];
            }
            self.bcast_queue.push(Reverse((self.applied[lc], c, wi as u32)));
            self.bcast_pending[lc] += 1;
            debug_assert!(
                self.bcast_pending[lc] as usize <= self.p1,
                "chunk {c}: one broadcast per worker"
            );
        }
        self.pump_broadcasts();
        Ok(())
    }

    /// Under a quorum: once every live worker finished, a round that holds
    /// contributions and fewer than `k` complete ones can never be applied.
    fn stranded_round(&self, finished: impl Fn(usize) -> bool) -> Option<(usize, u32, u64)> {
        let Trigger::Quorum(k) = self.cfg.trigger else {
            return None;
        };
        if !(0..self.p1).all(|w| self.lost[w] || finished(w)) {
            return None;
        }
        for (lc, &c) in self.book.server_chunks(self.rank).iter().enumerate() {
            let (complete, contributions, _) = self.round(lc, self.nslices(c));
            if contributions > 0 && complete < (k as usize).min(self.live) {
                let wi = (0..self.p1).find(|&w| !self.lost[w] && self.got[lc * self.p1 + w] == 0)?;
                return Some((wi, self.book.chunk_slices(c).start, self.applied[lc]));
            }
        }
        None
    }
}

mod kvstore;
mod switches;
#[cfg(test)]
mod tests;
