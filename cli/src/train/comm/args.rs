//! The flags of the communication frequency ([`CommArgs`]) and what a run's
//! communication looked like ([`CommSummary`]): the types the rest of `train`
//! holds, apart from the loop and the reference, which use `train`'s.

use clap::Args;
use serde::{Deserialize, Serialize};
use tidewire::freq::{quality_layer, Guide};
use tidewire_engine::freq::{CommConfig, CommMode, FreqConfig};
use tidewire_engine::models::Model;
use tidewire_gpu::cpu::ApplyOp;

use crate::error::{Error, Result};

/// The communication frequency flags of `tidewire train`.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct CommArgs {
    /// Exchange every T iterations (Nexus's communication frequency; 1: every one).
    #[arg(long, default_value_t = 1)]
    pub comm_every: u32,
    /// Between exchanges: accumulate (sum gradients locally, push the sum on the
    /// T-th) or average (local --op steps, models averaged by the servers every T).
    #[arg(long, default_value = "accumulate", value_parser = parse_mode)]
    pub comm_mode: String,
    /// Quality-guided adjustment of T (Nexus) up to this T; the workers report the
    /// synthetic loss. Off when absent.
    #[arg(long)]
    pub freq_max: Option<u32>,
    /// Exchanges per measurement window of the adjustment (baseline or trial).
    #[arg(long, default_value_t = 4)]
    pub freq_period: u32,
    /// Relative loss increase over the baseline at which a worker rejects a proposal.
    #[arg(long, default_value_t = 0.02)]
    pub freq_tolerance: f64,
    /// Back to --comm-every for good from this fraction of --iters on.
    #[arg(long, default_value_t = 0.85)]
    pub freq_revert_at: f64,
    /// The synthetic loss model's largest T without quality loss.
    #[arg(long, default_value_t = 4)]
    pub synthetic_ok_t: u32,
}

fn parse_mode(s: &str) -> std::result::Result<String, String> {
    CommMode::parse(s)
        .map(|m| m.name().to_string())
        .ok_or_else(|| "use accumulate or average".into())
}

impl CommArgs {
    /// Whether anything differs from "every iteration, gradients".
    pub fn active(&self) -> bool {
        self.comm_every != 1 || self.freq_max.is_some() || self.mode() == CommMode::Average
    }
    fn mode(&self) -> CommMode {
        CommMode::parse(&self.comm_mode).unwrap_or(CommMode::Accumulate)
    }
    fn guided(&self) -> bool {
        self.freq_max.is_some_and(|m| m > self.comm_every)
    }
    /// The agreed configuration for a run of `iters` iterations.
    pub fn config(&self, iters: u64) -> Result<CommConfig> {
        if !(0.0..=1.0).contains(&self.freq_revert_at) {
            return Err(Error::Usage(
                "--freq-revert-at is a fraction of --iters, in 0..=1".into(),
            ));
        }
        if self.synthetic_ok_t == 0 {
            return Err(Error::Usage("--synthetic-ok-t must be at least 1".into()));
        }
        let freq = FreqConfig {
            t_initial: self.comm_every,
            t_max: self.freq_max.unwrap_or(self.comm_every).max(self.comm_every),
            period: self.freq_period,
            tolerance: self.freq_tolerance,
            revert_at_step: self
                .guided()
                .then(|| (self.freq_revert_at * iters as f64).round() as u64),
        };
        freq.validate()
            .map_err(|e| Error::Usage(format!("--comm-every/--freq-*: {e}")))?;
        Ok(CommConfig {
            mode: self.mode(),
            freq,
        })
    }
    /// What the servers apply: the average of the models in average mode, `op` otherwise.
    pub fn server_op(&self, op: ApplyOp) -> ApplyOp {
        match self.mode() {
            CommMode::Average => ApplyOp::Mean,
            CommMode::Accumulate => op,
        }
    }
    /// Checks the flags against the run's op: the quality figures need servers that reduce.
    pub fn validate(&self, op: ApplyOp, iters: u64) -> Result<()> {
        let c = self.config(iters)?;
        Guide::new(c, self.server_op(op), 0, 1).map_err(|e| {
            Error::Usage(format!(
                "{e} (--freq-max with --comm-mode accumulate needs --op mean or sum; average mode reduces with mean)"
            ))
        })?;
        Ok(())
    }
    /// The layer table of the run: the model's, and the quality layer when T adjusts.
    pub fn layers(&self, model: &Model, p1: usize) -> Vec<tidewire_engine::book::LayerSpec> {
        let mut l = model.layers.clone();
        if self.guided() {
            l.push(quality_layer(p1));
        }
        l
    }
}

/// What a run's communication looked like (worker rank 0's view; every worker's is the same).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CommSummary {
    /// Iterations.
    pub steps: u64,
    /// Exchanges, the final forced one included.
    pub exchanges: u64,
    /// Bytes this worker handed in over all exchanges (gradients or parameters, and figures).
    pub handed_in_bytes: u64,
    /// T at every iteration.
    pub t_per_step: Vec<u32>,
    /// The controller's decisions other than keep.
    pub decisions: Vec<String>,
}
