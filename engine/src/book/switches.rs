//! The book's scheme switches ([`crate::plan`]): given up front, decided in
//! the run, or replayed from a run's report.

use super::*;

impl Book {
    /// This book with `layer`s switching schemes as `switches` say (in
    /// iteration order per layer; see [`crate::plan`]). Only a dense FC
    /// layer switches, between PS and SFB. The switches are part of the
    /// book's hash: every rank must be given the same.
    pub fn with_switches(mut self, switches: &[crate::plan::Switch]) -> Result<Self> {
        if self.plan.every() > 0 {
            return Err(EngineError::InvalidConfig(
                "switches given up front and decisions in the run do not go together (see Book::replayed)".into(),
            ));
        }
        for sw in switches {
            let l = self.layer(sw.layer)?;
            if l.kind != LayerKind::Fc || l.sparse {
                return Err(EngineError::InvalidConfig(format!(
                    "switch {sw}: {} is not a dense fully connected layer, which always syncs through the PS",
                    l.name
                )));
            }
            let name = l.name.clone();
            self.plan
                .add(*sw)
                .map_err(|e| EngineError::InvalidConfig(format!("{e} ({name})")))?;
        }
        self.hash = self.compute_hash();
        Ok(self)
    }

    /// This book with HybComm deciding again every `every` iterations, in
    /// the run (see [`crate::plan::Plan`]): worker index 0 decides each
    /// dense FC layer's scheme at every decision point and the protocol
    /// carries the decision to every rank. Not with switches given up front,
    /// nor with Adam; at most 64 such layers. Part of the book's hash.
    pub fn with_adaptive(mut self, every: u64) -> Result<Self> {
        let contested: Vec<u32> = (0..self.layers.len() as u32)
            .filter(|&l| {
                let s = &self.layers[l as usize];
                s.kind == LayerKind::Fc && !s.sparse
            })
            .collect();
        let why = if every < 2 {
            "a decision period of at least 2 iterations (a window is timed over all of them but the first)"
        } else if self.plan.has_switches() {
            "no switches given up front"
        } else if self.cfg.policy == SchemePolicy::Adam {
            "a policy other than adam"
        } else if contested.len() > 64 {
            "at most 64 dense FC layers"
        } else {
            ""
        };
        if !why.is_empty() {
            return Err(EngineError::InvalidConfig(format!("adaptive schemes need {why}")));
        }
        self.plan.adaptive(every, contested);
        self.hash = self.compute_hash();
        Ok(self)
    }

    /// This adaptive book as its run went: no more decisions, and the
    /// switches they made (a run's report), given up front. What a reference
    /// that replays the run computes with.
    pub fn replayed(mut self, switches: &[crate::plan::Switch]) -> Result<Self> {
        self.plan.settle_all();
        self.with_switches(switches)
    }
}
