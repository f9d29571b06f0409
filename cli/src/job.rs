//! The job flags `tidewire train` and `tidewire sim` share ([`JobArgs`]),
//! declared once and parsed once, into the engine's enums.

use clap::Args;
use serde::{Deserialize, Serialize};
use tidewire_engine::models;
use tidewire_engine::{Consistency, SyncMode, Trigger};

/// What a training job is, for `train` and `sim` alike (`#[command(flatten)]`).
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct JobArgs {
    /// Model profile: vgg19, vgg19-22k, googlenet, inception-v3, resnet-50,
    /// resnet-152, alexnet, vgg19-mini, sockeye (P3's LSTM translation model;
    /// batch 32 sentences).
    #[arg(long, default_value = "vgg19")]
    pub model: String,
    /// Iterations.
    #[arg(long, default_value_t = 10)]
    pub iters: u64,
    /// fifo-ps, wfbp, hybrid, sliced, p3, full, kvstore (MXNet's KVStore,
    /// P3's baseline: whole layers per server, notify then pull; BSP only)
    /// or adam (Project Adam, Poseidon's baseline: FC layers' factors to the
    /// one server holding the layer, full matrices back; BSP only).
    #[arg(long, default_value = "full", value_parser = parse_sync)]
    pub sync: SyncMode,
    /// Batch size K per worker (per learner with --local-learners; default:
    /// the profile's).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Multiplies every layer's compute time (1.0 = the calibrated
    /// single-GPU time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// bsp, or ssp:S for stale synchronous with bound S.
    #[arg(long, default_value = "bsp", value_parser = parse_consistency)]
    pub consistency: Consistency,
    /// When servers apply a chunk's round (Nexus's aggregation triggers):
    /// all (BSP: every worker's gradient, the default), quorum:K (the first K
    /// workers' whole contributions; later ones are dropped), async (every
    /// contribution on arrival, Downpour; late ones join the next round) or
    /// timeout:MS (what is in MS after the round's first contribution, the
    /// mean over the contributors). Not all: BSP, PS layers only (--sync p3,
    /// sliced, wfbp or fifo-ps).
    #[arg(long, default_value = "all", value_parser = parse_trigger)]
    pub trigger: Trigger,
    /// Sum in arrival order instead of fixed rank order. Rank order holds a
    /// landing slot until the lower ranks' contributions are in, which costs
    /// throughput when workers send in different orders.
    #[arg(long)]
    pub fast: bool,
    /// Credit window in bytes (default: the engine's).
    #[arg(long)]
    pub credit_bytes: Option<usize>,
    /// KV chunk size in bytes: the unit a server applies and broadcasts, and
    /// that the unsliced modes push. Default: one slice in sliced, p3 and full
    /// (P3's server applies and broadcasts per slice; slices under 64 KiB are
    /// grouped to at least 64 KiB, and a chunk stays within 2 MiB), Poseidon's
    /// 2 MiB in the other modes.
    #[arg(long)]
    pub chunk_bytes: Option<usize>,
    /// Learners per worker node (Nexus's local aggregation): one rank per
    /// node sums its learners' gradients and pushes once for all of them;
    /// `--workers` counts nodes.
    #[arg(long, default_value_t = 1)]
    pub local_learners: usize,
    /// With --local-learners L: the flat baseline, every learner a rank of
    /// its own (L of them per node), the servers summing each node's L
    /// gradients first as the local aggregator does.
    #[arg(long)]
    pub flat: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

impl JobArgs {
    /// The model profile named by --model, or a usage error listing the known ones.
    pub fn profile(&self) -> crate::error::Result<models::Model> {
        let m = models::profile(&self.model).ok_or_else(|| {
            crate::error::Error::Usage(format!(
                "unknown model {:?}; known: {}",
                self.model,
                models::NAMES.join(", ")
            ))
        })?;
        debug_assert!(!m.layers.is_empty(), "{}: a profile has layers", m.name);
        Ok(m)
    }
}

fn parse_sync(s: &str) -> Result<SyncMode, String> {
    SyncMode::parse(s).ok_or_else(|| "use fifo-ps, wfbp, hybrid, sliced, p3, full, kvstore or adam".into())
}

fn parse_consistency(s: &str) -> Result<Consistency, String> {
    Consistency::parse(s).ok_or_else(|| "use bsp or ssp:S (e.g. ssp:2)".into())
}

fn parse_trigger(s: &str) -> Result<Trigger, String> {
    Trigger::parse(s).ok_or_else(|| "use all, quorum:K, async or timeout:MS".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        job: JobArgs,
    }

    #[test]
    fn flags_parse_into_the_engines_enums_and_bad_ones_are_refused() {
        let d = Cmd::parse_from(["x"]).job;
        assert_eq!(
            (d.sync, d.consistency, d.trigger, d.iters, d.model.as_str()),
            (SyncMode::Full, Consistency::Bsp, Trigger::All, 10, "vgg19")
        );
        let j = Cmd::parse_from(["x", "--sync", "p3", "--consistency", "ssp:3", "--trigger", "quorum:2"]).job;
        assert_eq!(
            (j.sync, j.consistency, j.trigger),
            (SyncMode::P3, Consistency::Ssp(3), Trigger::Quorum(2))
        );
        assert_eq!(
            (j.consistency.name(), j.trigger.name()),
            ("ssp:3".into(), "quorum:2".into())
        );
        for bad in [["--sync", "p4"], ["--consistency", "ssp"], ["--trigger", "most"]] {
            let e = Cmd::try_parse_from(["x", bad[0], bad[1]]).err().expect("refused");
            assert!(e.to_string().contains(bad[1]), "{e}");
        }
    }
}
