//! The server core's part in scheme switches ([`crate::plan`]): worker 0's
//! values written back where a layer comes back to the PS, worker 0's
//! decisions, and the iteration a round stands for.

use super::*;

impl Server {
    /// Momentum moves at scheme switches (an op that keeps it, and a plan
    /// with switches or decisions): a round that comes back from SFB waits
    /// for worker 0's momentum as for its values ([`Server::handle_momentum`]),
    /// and the last round before SFB sends the shard's momentum to the
    /// workers ([`ServerCommand::SendMomentum`]).
    pub fn with_momentum(mut self, moves: bool) -> Self {
        self.moves_momentum = moves;
        self
    }

    /// Worker index 0 (rank `from`) begins to send its momentum of `chunk`
    /// for its layer's switch back to the PS at `iter`: taken, before any
    /// of it is placed, unless momentum does not move, it comes from
    /// another rank, for an iteration that does not bring the layer back
    /// (where decided), for another than the chunk's next round (where
    /// that is decided), or twice.
    pub fn accept_momentum(&mut self, from: u32, chunk: u32, iter: u64) -> Result<()> {
        let lc = self.local_chunk(from, chunk)?;
        let layer = self.book.chunks()[chunk as usize].layer;
        let from0 = self.book.cluster().worker_index(from) == Some(0);
        let asked = !self.plan.settled(layer, iter) || self.plan.reseeds_at(layer, iter);
        let next = self
            .plan
            .round_iter(layer, self.applied[lc])
            .filter(|&t| self.plan.settled(layer, t));
        if !self.moves_momentum || !from0 || !asked || next.is_some_and(|t| t != iter) {
            return Err(self.err(from, ProtocolViolation::MomentumUnexpected { chunk, iter }));
        }
        if self.momentum_in[lc] == Some(iter) {
            return Err(self.err(from, ProtocolViolation::MomentumTwice { chunk, iter }));
        }
        self.momentum_in[lc] = Some(iter);
        // Worker 0's, for a switch back (an iteration after the start).
        debug_assert!(iter > 0 && from0);
        Ok(())
    }

    /// Worker index 0's momentum of `chunk`, taken in ([`Server::accept_momentum`]),
    /// is placed in the shard's momentum: with its values, the chunk's next
    /// round may be applied.
    pub fn handle_momentum(&mut self, from: u32, chunk: u32) -> Result<()> {
        let lc = self.local_chunk(from, chunk)?;
        let Some(iter) = self.momentum_in[lc] else {
            let layer = self.book.chunks()[chunk as usize].layer;
            let iter = self.plan.round_iter(layer, self.applied[lc]).unwrap_or(u64::MAX);
            return Err(self.err(from, ProtocolViolation::MomentumUnexpected { chunk, iter }));
        };
        debug_assert!(self.moves_momentum, "taken in only where momentum moves");
        self.handle_reseed(from, chunk, lc, Reseed::Momentum)
            .map_err(|_| self.err(from, ProtocolViolation::MomentumUnexpected { chunk, iter }))
    }

    /// Worker index 0's values of `chunk`, written again where its layer
    /// comes back from SFB ([`Server::handle_init`] once seeded).
    pub(super) fn handle_values_back(&mut self, from: u32, chunk: u32, lc: usize) -> Result<()> {
        debug_assert!(self.is_initialized(), "chunk {chunk}: seeded before it comes back");
        self.handle_reseed(from, chunk, lc, Reseed::Values)
    }

    /// Worker index 0's values (or momentum) of `chunk` for its layer's
    /// switch back to the PS: the chunk's next round may be applied once
    /// both are here.
    fn handle_reseed(&mut self, from: u32, chunk: u32, lc: usize, what: Reseed) -> Result<()> {
        let w = what as usize;
        let layer = self.book.chunks()[chunk as usize].layer;
        let round = self.applied[lc];
        let t = self.plan.round_iter(layer, round);
        let from0 = self.book.cluster().worker_index(from) == Some(0);
        if from0 && !t.is_some_and(|t| self.plan.settled(layer, t)) && !self.reseed_early[lc][w] {
            // The decision that brings the layer back has not come yet (messages
            // and writes are not ordered): taken in when it comes.
            self.reseed_early[lc][w] = true;
            return Ok(());
        }
        let ok = from0 && t.is_some_and(|t| self.plan.reseeds_at(layer, t) && self.reseeded[lc][w] != Some(t));
        if !ok {
            return Err(self.err(from, what.unexpected(chunk, round, t)));
        }
        self.reseeded[lc][w] = t;
        // Taken for the round it came for, not early.
        debug_assert!(self.reseeded[lc][w].is_some() && !self.reseed_early[lc][w]);
        self.try_apply(chunk);
        Ok(())
    }

    /// Where `chunk`'s latest applied round is its layer's last on the PS
    /// before SFB (decided), and momentum moves: the shard's momentum goes
    /// to the workers, once.
    pub(super) fn maybe_send_momentum(&mut self, chunk: u32) {
        let lc = self.chunk_local[chunk as usize] as usize;
        let layer = self.book.chunks()[chunk as usize].layer;
        let Some(last) = self.applied[lc].checked_sub(1) else {
            return;
        };
        let Some(next) = self.plan.round_iter(layer, last).map(|t| t + 1) else {
            return;
        };
        if !self.moves_momentum || !self.plan.settled(layer, next) || !self.plan.leaves_ps_at(layer, next) {
            return;
        }
        // The switch's iteration follows the round applied last.
        debug_assert!(self.plan.scheme(layer, next - 1) == Scheme::Ps);
        if self.momentum_out[lc] != Some(next) {
            // Sent once per switch, after the round before it.
            debug_assert!(self.momentum_out[lc].map_or(true, |o| o < next));
            self.momentum_out[lc] = Some(next);
            self.out.push_back(ServerCommand::SendMomentum { chunk, iter: next });
        }
    }

    /// The schemes by iteration, as this server knows them.
    pub fn plan(&self) -> &crate::plan::Plan {
        debug_assert_eq!(
            self.plan.contested(),
            self.book.plan().contested(),
            "decisions change schemes, not layers"
        );
        &self.plan
    }

    /// Worker index 0's decision for the point `at` ([`crate::plan::Plan::decide`]):
    /// the rounds it settles may be applied, and values of chunks that came
    /// early must be for a switch back to the PS.
    pub fn decide(&mut self, at: u64, sfb: u64) -> Result<Vec<crate::plan::Switch>> {
        let decider = self.book.cluster().workers()[0];
        let made = self
            .plan
            .decide(at, sfb)
            .map_err(|e| self.err(decider, ProtocolViolation::BadDecision { at, why: e.to_string() }))?;
        let chunks: Vec<u32> = self.book.server_chunks(self.rank).to_vec();
        let worker0 = decider;
        for (lc, &c) in chunks.iter().enumerate() {
            let layer = self.book.chunks()[c as usize].layer;
            let t = self.plan.round_iter(layer, self.applied[lc]);
            for what in [Reseed::Values, Reseed::Momentum] {
                let w = what as usize;
                if self.reseed_early[lc][w] && t.is_some_and(|t| self.plan.settled(layer, t)) {
                    self.reseed_early[lc][w] = false;
                    if !t.is_some_and(|t| self.plan.reseeds_at(layer, t)) {
                        // Worker 0 wrote for a switch back its own decision did not make.
                        return Err(self.err(worker0, what.unexpected(c, self.applied[lc], t)));
                    }
                    self.reseeded[lc][w] = t;
                }
            }
        }
        for c in chunks {
            self.try_apply(c);
            self.maybe_send_momentum(c);
        }
        debug_assert!(self.plan.is_decided(at));
        Ok(made)
    }

    /// The iteration of `layer`'s round `k` as the plan says now: final where
    /// decided, else provisional (for ordering only), or the next decision
    /// point where the plan has the layer on SFB from then on.
    pub(super) fn round_label(&self, layer: u32, k: u64) -> u64 {
        let t = self.plan.round_iter(layer, k);
        // Without decisions, a round asked for is one the plan has.
        debug_assert!(self.plan.every() > 0 || t.is_some(), "layer {layer} round {k}");
        t.or(self.plan.next_point()).unwrap_or(u64::MAX)
    }
}

/// What worker index 0 hands back to a server where a layer comes back from
/// SFB to the PS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reseed {
    /// Its parameters, written into the shard.
    Values = 0,
    /// Its momentum, sent by message.
    Momentum = 1,
}

impl Reseed {
    /// The violation of one that no switch asked for: at the chunk's round
    /// `round`, of iteration `t` where it has one.
    fn unexpected(self, chunk: u32, round: u64, t: Option<u64>) -> ProtocolViolation {
        match self {
            Reseed::Values => ProtocolViolation::ReseedUnexpected { chunk, round },
            Reseed::Momentum => ProtocolViolation::MomentumUnexpected {
                chunk,
                iter: t.unwrap_or(round),
            },
        }
    }
}
