//! Adaptive schemes ([`crate::plan`]): worker index 0's decisions, taken in
//! on every rank, and the hand-ins that wait for them.
//!
//! Worker 0's driver is asked for each decision ([`Output::DecisionDue`])
//! when worker 0 hands in a layer of the iteration before the point, and
//! answers with [`Input::Decide`]; the Node sends it to every other rank
//! (`Msg::Decide`). A hand-in of a contested layer for an iteration not yet
//! decided waits here (parked) until the decision comes; so does a
//! server's apply of such a round (in its core). Under BSP no rank gets
//! more than an iteration past worker 0, so the wait is at most the skew
//! between worker 0 and the others.

use super::*;

impl Node {
    /// The schemes by iteration, as this rank knows them now.
    pub fn plan(&self) -> &crate::plan::Plan {
        // The cores' copies follow the Node's (each takes every decision).
        debug_assert!(self.worker.as_ref().map_or(true, |w| w.core.plan() == &self.plan));
        &self.plan
    }

    fn decider(&self) -> u32 {
        let d = self.book.cluster().workers()[0];
        debug_assert_eq!(self.book.cluster().worker_index(d), Some(0));
        d
    }

    /// Worker 0's driver decided (`Input::Decide`).
    pub(super) fn decide_here(&mut self, at: u64, sfb: u64) -> Result<()> {
        if self.rank != self.decider() {
            return Err(EngineError::InvalidConfig(format!(
                "rank {} is not worker index 0: only it decides the schemes",
                self.rank
            )));
        }
        if self.plan.next_point() != Some(at) {
            return Err(EngineError::InvalidConfig(format!(
                "a decision for iteration {at}, where the next decision point is {:?}",
                self.plan.next_point()
            )));
        }
        let peers: Vec<u32> = (0..self.book.cluster().world() as u32)
            .filter(|&p| p != self.rank)
            .collect();
        for p in peers {
            self.send_ctrl(p, &Msg::Decide { at, sfb });
        }
        self.take_decision(self.rank, at, sfb)
    }

    /// `peer` sent worker 0's decision.
    pub(super) fn decision_from(&mut self, peer: u32, at: u64, sfb: u64) -> Result<()> {
        if peer != self.decider() || self.rank == self.decider() {
            return Err(EngineError::protocol(peer, ProtocolViolation::DecisionFromNonDecider));
        }
        debug_assert_ne!(peer, self.rank, "a decision comes from a peer");
        self.take_decision(peer, at, sfb)
    }

    /// Every copy of the plan takes the decision, then the hand-ins that
    /// waited for it go in.
    fn take_decision(&mut self, from: u32, at: u64, sfb: u64) -> Result<()> {
        let made = self
            .plan
            .decide(at, sfb)
            .map_err(|e| EngineError::protocol(from, ProtocolViolation::BadDecision { at, why: e.to_string() }))?;
        if let Some(w) = self.worker.as_mut() {
            w.core.decide(at, sfb)?;
            debug_assert_eq!(w.core.plan(), &self.plan, "the worker's plan is the Node's");
        }
        if let Some(s) = self.server.as_mut() {
            s.core.decide(at, sfb)?;
            debug_assert_eq!(s.core.plan(), &self.plan, "the server's plan is the Node's");
        }
        self.stats.decisions += 1;
        self.stats.switches += made.len() as u64;
        for layer in 0..self.parked_in.len() as u32 {
            if let Some(factors) = self.parked_in[layer as usize].take() {
                self.hand_in_now(layer, factors)?;
            }
        }
        Ok(())
    }

    /// Before a hand-in of `layer` for iteration `iter`: worker 0 asks its
    /// driver for the next decision one iteration ahead; a hand-in of a
    /// contested layer not yet decided waits (it must come as factors: the
    /// decision may put it on SFB). Returns whether it waits.
    pub(super) fn park_undecided(&mut self, layer: u32, iter: u64, factors: bool) -> Result<bool> {
        if let Some(p) = self.plan.next_point() {
            if self.rank == self.decider() && iter + 1 >= p && self.due != Some(p) {
                self.due = Some(p);
                self.out.push_back(Output::DecisionDue { at: p });
            }
        }
        if self.plan.settled(layer, iter) {
            return Ok(false);
        }
        if !factors {
            return Err(EngineError::NeedsFactors {
                layer,
                name: self.book.layers()[layer as usize].name.clone(),
            });
        }
        debug_assert!(self.parked_in[layer as usize].is_none(), "layer {layer} waits once");
        self.parked_in[layer as usize] = Some(factors);
        Ok(true)
    }

    /// Whether a hand-in of `layer` waits for a decision.
    pub(super) fn is_parked(&self, layer: u32) -> bool {
        let parked = self.parked_in.get(layer as usize).is_some_and(Option::is_some);
        // Only a layer the decisions cover waits for one.
        debug_assert!(!parked || self.plan.contested().contains(&layer));
        parked
    }
}
