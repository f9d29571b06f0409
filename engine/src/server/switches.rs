//! The server core's part in scheme switches ([`crate::plan`]): worker 0's
//! values written back where a layer comes back to the PS, worker 0's
//! decisions, and the iteration a round stands for.

use super::*;

impl Server {
    /// Worker index 0's values of `chunk` for its layer's switch back to the
    /// PS: the chunk's next round may be applied once they are here.
    pub(super) fn handle_reseed(&mut self, from: u32, chunk: u32, lc: usize) -> Result<()> {
        let layer = self.book.chunks()[chunk as usize].layer;
        let round = self.applied[lc];
        let t = self.plan.round_iter(layer, round);
        let from0 = self.book.cluster().worker_index(from) == Some(0);
        if from0 && !t.is_some_and(|t| self.plan.settled(layer, t)) && !self.reseed_early[lc] {
            // The decision that brings the layer back has not come yet (messages
            // and writes are not ordered): taken in when it comes.
            self.reseed_early[lc] = true;
            return Ok(());
        }
        let ok = from0 && t.is_some_and(|t| self.plan.reseeds_at(layer, t) && self.reseeded[lc] != Some(t));
        if !ok {
            return Err(self.err(from, ProtocolViolation::ReseedUnexpected { chunk, round }));
        }
        self.reseeded[lc] = t;
        // Taken for the round it came for, not early.
        debug_assert!(self.reseeded[lc].is_some() && !self.reseed_early[lc]);
        self.try_apply(chunk);
        Ok(())
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
        for (lc, &c) in chunks.iter().enumerate() {
            let layer = self.book.chunks()[c as usize].layer;
            let t = self.plan.round_iter(layer, self.applied[lc]);
            if self.reseed_early[lc] && t.is_some_and(|t| self.plan.settled(layer, t)) {
                self.reseed_early[lc] = false;
                if !t.is_some_and(|t| self.plan.reseeds_at(layer, t)) {
                    let round = self.applied[lc];
                    return Err(self.err(decider, ProtocolViolation::ReseedUnexpected { chunk: c, round }));
                }
                self.reseeded[lc] = t;
            }
        }
        for c in chunks {
            self.try_apply(c);
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
