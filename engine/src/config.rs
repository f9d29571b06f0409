//! Scheduling and consistency settings shared by the worker and server cores.

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// Consistency model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    /// Bulk synchronous: iteration t+1 starts on parameters that include every
    /// worker's iteration-t gradients.
    Bsp,
    /// Stale synchronous with bound `s`: a worker may run at most `s`
    /// iterations ahead of the slowest worker's pushed gradients.
    Ssp(u32),
}

impl Consistency {
    /// The staleness bound (0 for BSP).
    pub fn staleness(self) -> u64 {
        match self {
            Consistency::Bsp => 0,
            Consistency::Ssp(s) => u64::from(s),
        }
    }
}

/// The order in which a worker's queued slices go out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueOrder {
    /// P3: the layer the next forward pass needs first goes first
    /// (forward index, then slice sequence; earlier iterations before later).
    Priority,
    /// In the order the gradients became ready (WFBP without priorities).
    Fifo,
}

/// Settings of the worker and server cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SchedConfig {
    /// Send order.
    pub order: QueueOrder,
    /// Credit window: bytes a worker (and a server's broadcaster) may have in
    /// flight. One item larger than the window still goes when nothing else is
    /// in flight.
    pub credit_bytes: usize,
    /// Landing slots each server keeps per worker; a worker holds one credit per slot.
    pub slots: u32,
    /// Consistency model.
    pub consistency: Consistency,
    /// Sum in fixed worker-rank order (bitwise reproducible) rather than arrival
    /// order. Applies under BSP; SSP always sums in arrival order.
    pub deterministic: bool,
    /// Deterministic order in groups (Nexus's nodes): workers `g·G..(g+1)·G`
    /// are summed in rank order into a partial sum first, and the partial sums
    /// are folded in group order, exactly as a node-local aggregator with `G`
    /// learners and its leader would. So a flat run with `fold_group = G`
    /// gives bitwise the parameters of the hierarchical run with `G` local
    /// learners per worker. 1 (the default) is the plain worker order.
    pub fold_group: u32,
    /// Learners behind every worker rank (Nexus's local learners: a worker
    /// pushes the sum of its node's `learners` gradients). The mean and SGD
    /// divide the sum by workers × learners, the number of gradients in it.
    pub learners: u32,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            order: QueueOrder::Priority,
            credit_bytes: 8 << 20,
            slots: 8,
            consistency: Consistency::Bsp,
            deterministic: true,
            fold_group: 1,
            learners: 1,
        }
    }
}

impl SchedConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        if self.slots == 0 {
            return Err(EngineError::InvalidConfig("slots must be at least 1".into()));
        }
        if self.credit_bytes == 0 {
            return Err(EngineError::InvalidConfig("credit_bytes must be at least 1".into()));
        }
        if self.fold_group == 0 || self.learners == 0 {
            return Err(EngineError::InvalidConfig(
                "fold_group and learners must be at least 1".into(),
            ));
        }
        if self.consistency.staleness() > 64 {
            return Err(EngineError::InvalidConfig(
                "SSP staleness above 64 is not supported".into(),
            ));
        }
        Ok(())
    }
}

/// The sync modes the papers ablate, as one switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncMode {
    /// Compute the whole backward pass, then communicate (PS only, no slicing).
    FifoPs,
    /// Wait-free backprop: each layer syncs as soon as its backward ends (PS, FIFO).
    Wfbp,
    /// WFBP + HybComm (PS or SFB per layer, FIFO).
    Hybrid,
    /// WFBP + P3 slicing, sent in the order the slices became ready (PS
    /// only): P3's "slicing only" ablation.
    Sliced,
    /// WFBP + P3 slicing + priority (PS only).
    P3,
    /// Everything: WFBP + HybComm + slicing + priority.
    Full,
}

impl SyncMode {
    /// All modes, in the papers' order.
    pub const ALL: [SyncMode; 6] = [
        SyncMode::FifoPs,
        SyncMode::Wfbp,
        SyncMode::Hybrid,
        SyncMode::Sliced,
        SyncMode::P3,
        SyncMode::Full,
    ];

    /// Parses `fifo-ps`, `wfbp`, `hybrid`, `sliced`, `p3` or `full`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "fifo-ps" => SyncMode::FifoPs,
            "wfbp" => SyncMode::Wfbp,
            "hybrid" => SyncMode::Hybrid,
            "sliced" => SyncMode::Sliced,
            "p3" => SyncMode::P3,
            "full" => SyncMode::Full,
            _ => return None,
        })
    }
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            SyncMode::FifoPs => "fifo-ps",
            SyncMode::Wfbp => "wfbp",
            SyncMode::Hybrid => "hybrid",
            SyncMode::Sliced => "sliced",
            SyncMode::P3 => "p3",
            SyncMode::Full => "full",
        }
    }
    /// The scheme policy.
    pub fn policy(self) -> crate::book::SchemePolicy {
        match self {
            SyncMode::Hybrid | SyncMode::Full => crate::book::SchemePolicy::Hybrid,
            _ => crate::book::SchemePolicy::Ps,
        }
    }
    /// The queue order.
    pub fn order(self) -> QueueOrder {
        match self {
            SyncMode::P3 | SyncMode::Full => QueueOrder::Priority,
            _ => QueueOrder::Fifo,
        }
    }
    /// Whether layers are cut into P3 slices (otherwise a slice is a whole chunk).
    pub fn sliced(self) -> bool {
        matches!(self, SyncMode::Sliced | SyncMode::P3 | SyncMode::Full)
    }
    /// Whether a layer is handed in as soon as its backward ends.
    pub fn wait_free(self) -> bool {
        self != SyncMode::FifoPs
    }
    /// The book sizes for this mode, from the sliced defaults.
    pub fn book_config(self, mut base: crate::book::BookConfig) -> crate::book::BookConfig {
        base.policy = self.policy();
        if !self.sliced() {
            base.slice_params = base.chunk_bytes / 4;
        }
        base
    }
}

/// What a server does with a chunk once every contribution is summed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum ApplyOp {
    /// Reduce only: the output is the sum of the gradients.
    Sum,
    /// Reduce only: the output is the mean (sum × 1/P1).
    Mean,
    /// Caffe/Poseidon SGD on the mean gradient g:
    /// `v = momentum·v + lr·(g + weight_decay·w); w -= v`.
    Sgd {
        /// Learning rate.
        lr: f32,
        /// Momentum.
        momentum: f32,
        /// L2 weight decay.
        weight_decay: f32,
    },
}

impl ApplyOp {
    /// Whether the op keeps a momentum buffer.
    pub fn needs_momentum(&self) -> bool {
        matches!(self, ApplyOp::Sgd { momentum, .. } if *momentum != 0.0)
    }
}
