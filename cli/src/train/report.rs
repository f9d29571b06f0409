//! What ranks report ([`NodeResult`]), the launcher's summary ([`TrainReport`]),
//! and its text ([`render`]).

use std::fmt::Write;

use serde::{Deserialize, Serialize};
use tidewire_engine::book::{LayerKind, Scheme};

use tidewire::session::SessionStats;

use super::comm::CommSummary;
use crate::resilience::{self, Restart};

/// One iteration as a worker saw it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IterStat {
    /// Iteration index.
    pub iter: u64,
    /// Wall time from this iteration's forward pass to the next one's (the
    /// last iteration ends when every layer is synced).
    pub seconds: f64,
    /// Time this iteration's forward pass blocked waiting for parameters.
    pub blocked_s: f64,
    /// Wall time from this iteration's first hand-in to its last layer synced.
    pub sync_span_s: f64,
    /// Of that span, the time the worker waited (in the next forward pass, or the final wait).
    pub exposed_s: f64,
    /// Unix time when this iteration's forward pass had every parameter it waited for.
    pub forward_done_unix: f64,
    /// Unix time just before the last hand-in of this iteration.
    pub backward_done_unix: f64,
}

/// What one rank reports when it finishes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeResult {
    /// Rank.
    pub rank: u32,
    /// Whether it ran a worker.
    pub worker: bool,
    /// Per iteration (workers).
    pub iters: Vec<IterStat>,
    /// SHA-256 of each layer's final parameters (workers).
    pub digests: Vec<String>,
    /// Session counters.
    pub stats: SessionStats,
    /// The transport this rank used and why ("tcp: ..." or "rdma: ...").
    #[serde(default)]
    pub transport: String,
    /// (node, local rank) of a local learner that is not a rank (`--local-learners`).
    #[serde(default)]
    pub local: Option<(u32, u32)>,
    /// Bytes the transport sent before the first iteration (rendezvous, keys,
    /// seeding the servers' shards).
    #[serde(default)]
    pub setup_tx_bytes: u64,
    /// Bytes received before the first iteration.
    #[serde(default)]
    pub setup_rx_bytes: u64,
    /// Exchanges and T per iteration, with a communication frequency (workers).
    #[serde(default)]
    pub comm: Option<CommSummary>,
    /// What this rank's checkpoints cost (--checkpoint-dir).
    #[serde(default)]
    pub checkpoint: Option<tidewire::checkpoint::CheckpointStats>,
    /// The iteration boundary a worker removed as a straggler left at
    /// (--remove-stragglers); its process ends without the goodbye.
    #[serde(default)]
    pub removed_at: Option<u64>,
    /// The switches this rank's session knew at the end (given up front, or
    /// decided in the run), and on worker index 0 of an adaptive run its decisions.
    #[serde(default)]
    pub switches: Vec<tidewire_engine::Switch>,
    #[serde(default)]
    pub decisions: Vec<tidewire::Decision>,
}

/// The sparse-push counters of a `tidewire train` run, over all workers.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct SparseSummary {
    /// Slices sent as index/value pairs.
    pub pushes: u64,
    /// Slices of sparse layers sent dense.
    pub dense_pushes: u64,
    /// Nonzeros of the slices sent as pairs.
    pub nonzeros: u64,
    /// Elements of the slices sent as pairs.
    pub elements: u64,
    /// Bytes sent as pairs.
    pub bytes: u64,
    /// Bytes of sparse layers sent dense.
    pub dense_bytes: u64,
}

/// The launcher's summary.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainReport {
    /// Model.
    pub model: String,
    /// --trigger.
    #[serde(default)]
    pub trigger: String,
    /// Workers removed as stragglers (--remove-stragglers).
    #[serde(default)]
    pub removed: Vec<resilience::Removed>,
    /// Each worker's mean iteration, seconds, by rank (a straggler's own pace
    /// apart from the others' under the quorum, timeout and async triggers).
    #[serde(default)]
    pub worker_iteration_s: Vec<f64>,
    /// Over the servers: late contributions dropped, folded into the next
    /// round, and rounds applied without every worker's contribution.
    #[serde(default)]
    pub dropped: u64,
    #[serde(default)]
    pub late_folded: u64,
    #[serde(default)]
    pub partial_applies: u64,
    /// What the last attempt's checkpoints cost (--checkpoint-dir).
    #[serde(default)]
    pub checkpoint: Option<resilience::CheckpointSummary>,
    /// Rollbacks: every attempt that lost a rank, and where the next one resumed
    /// (--checkpoint-dir). The iteration figures are the last attempt's.
    #[serde(default)]
    pub restarts: Vec<Restart>,
    /// The iteration the last attempt resumed from (--resume, or a rollback).
    #[serde(default)]
    pub resumed_from: Option<u64>,
    /// Every WARN or ERROR line the ranks logged (a healthy run has none), as `rank N: line`.
    pub log_warnings: Vec<String>,
    /// Where the servers' sums ran (Nexus's CPU/GPU scheduler), over all ranks.
    pub aggregation: AggregationShare,
    /// The slice size, parameters (`--slice-params`, or from the rates).
    pub slice_params: usize,
    /// Most requests any rank had in flight to one peer (within the transport's bound).
    pub max_outstanding: u64,
    /// Largest message any rank sent, bytes (within the transport's cap).
    pub max_message_bytes: u64,
    /// Transmits the transports refused for now and the engine retried, over all ranks.
    pub would_block: u64,
    /// Slices the workers pushed to servers, over all ranks and iterations
    /// (each one message; `bench/slice-cost.sh` divides CPU time by it).
    #[serde(default)]
    pub slices_pushed: u64,
    /// Chunk broadcasts, one per chunk and worker, over all ranks and
    /// iterations (a message, or a copy to a colocated server's own worker).
    #[serde(default)]
    pub broadcasts: u64,
    /// Send operations the ranks' transports handed to the kernel or the NIC,
    /// over all ranks, set-up included: a gathered send of several slices or
    /// frames counts once (`bench/slice-cost.sh` reads it per slice).
    #[serde(default)]
    pub tx_sends: u64,
    /// Peers' factor bytes the SF reconstructions read in place, in the buffers
    /// the transports received them in, over all ranks.
    pub factor_bytes_in_place: u64,
    /// Peers' factor bytes decoded into scratch first (U or V over the message
    /// cap, so split over messages), over all ranks. 0 when every U and V fits a message.
    pub factor_bytes_decoded: u64,
    /// Learners per worker node (`--local-learners`), and whether each was a
    /// rank of its own (`--flat`) rather than behind a local aggregator.
    pub local_learners: usize,
    /// See `local_learners`.
    pub flat: bool,
    /// Per worker node: payload bytes its NIC sent and received while training
    /// (the transports' counters, summed over the node's ranks: one with local
    /// aggregation, L with --flat; a colocated node's server traffic included;
    /// the set-up before the first iteration, such as seeding, not counted).
    pub node_tx_bytes: Vec<u64>,
    /// See `node_tx_bytes`.
    pub node_rx_bytes: Vec<u64>,
    /// The --sparse-layers' pushes over all workers: slices sent as pairs and
    /// dense, the nonzeros and elements of those sent as pairs, and the bytes of each form.
    pub sparse: SparseSummary,
    /// Sync mode.
    pub sync: String,
    /// Consistency.
    pub consistency: String,
    /// P1.
    pub workers: usize,
    /// P2.
    pub servers: usize,
    /// Colocated nodes.
    pub colocate: bool,
    /// Batch per worker.
    pub batch: usize,
    /// Iterations.
    pub iters: u64,
    /// Compute time scale.
    pub time_scale: f64,
    /// Calibrated compute per iteration (scaled), s.
    pub compute_s: f64,
    /// From the start of iteration 0 to the end of the last sync, divided by
    /// the iterations (as `tidewire sim` measures it), s.
    pub iteration_s: f64,
    /// P1 × K / iteration_s.
    pub throughput_samples_s: f64,
    /// Share of each iteration's sync span that the workers did not wait for
    /// (mean over iterations after the first).
    pub hidden_fraction: f64,
    /// Per-iteration figures of the slowest worker.
    pub per_iteration: Vec<IterStat>,
    /// Every worker's per-iteration figures, by worker rank.
    pub workers_detail: Vec<Vec<IterStat>>,
    /// The scheme of every layer at the start (see `switches`).
    pub layers: Vec<LayerRow>,
    /// Where FC layers switched schemes mid-run (`--switch`), by layer then iteration.
    #[serde(default)]
    pub switches: Vec<tidewire_engine::Switch>,
    /// Worker 0's scheme decisions in the run (`--adapt-every`): the
    /// iteration each took effect at, the SFB bits, and the window time it came from.
    #[serde(default)]
    pub decisions: Vec<tidewire::Decision>,
    /// Iterations between worker 0's decisions (0: the start-up choice holds).
    #[serde(default)]
    pub adapt_every: u64,
    /// Why a run of a mode with HybComm does not decide in the run (no
    /// `--adapt-every` given and the run has what decisions do not support).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapt_off: Option<String>,
    /// Factor blocks the workers sent (SFB's, to each peer worker), over all
    /// ranks and iterations.
    #[serde(default)]
    pub factor_sends: u64,
    /// The rates HybComm decided with (`--cost-model seconds`), per rank.
    #[serde(default)]
    pub rates: Option<tidewire_engine::cost::Rates>,
    /// The rates the executors reached in this run, per executor-second,
    /// beside the `rates` HybComm decided with.
    #[serde(default)]
    pub measured: MeasuredRates,
    /// `Some(true)` when every worker's parameters equal the reference bit for bit.
    pub verified: Option<bool>,
    /// Layers that differ (name), when verification failed.
    pub mismatched_layers: Vec<String>,
    /// SHA-256 of every layer's final parameters on worker rank 0, to compare
    /// runs (a flat run and a local-aggregation one give the same, for
    /// example).
    pub digests: Vec<String>,
    /// Wall time of the whole run, s.
    pub wall_s: f64,
    /// The transports the ranks used, each with the reason (distinct lines; with
    /// the ranks that use each when they differ, as with `--transport mixed`).
    pub transport: Vec<String>,
    /// With a communication frequency: the first worker's exchanges, T per iteration and decisions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm: Option<CommSummary>,
}

/// Where the servers' sums ran: bytes and chunks on the CPU and the GPU
/// (`--aggregate`). Rebuilding a gradient from sufficient factors runs on
/// the CPU: the runtime has no GPU path for it yet.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AggregationShare {
    /// Contribution bytes summed on the CPU.
    pub cpu_bytes: u64,
    /// Contribution bytes summed on the GPU.
    pub gpu_bytes: u64,
    /// Chunks the scheduler placed on the CPU.
    pub cpu_chunks: u64,
    /// Chunks the scheduler placed on the GPU.
    pub gpu_chunks: u64,
}

/// What the executors of every rank reached in this run: each kind of
/// job's work over the time they spent on it, summed over the ranks
/// (`None` where no such job ran). Set beside [`TrainReport::rates`], it
/// shows how far the calibrated rates HybComm decided with were from what
/// the jobs got while the ranks shared the cores.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MeasuredRates {
    /// Rebuilding gradients from sufficient factors (`cpu::sf_rows`, `sf_sum`).
    pub gemm_flop_per_s: Option<f64>,
    /// Folding contributions into the servers' accumulators.
    pub sum_bytes_per_s: Option<f64>,
    /// Applying updates (servers' chunks, SFB layers).
    pub apply_params_per_s: Option<f64>,
}

impl MeasuredRates {
    /// Work over time, summed over the ranks' `(work, ns)`.
    pub fn from_totals(gemm: (u64, u64), sum: (u64, u64), apply: (u64, u64)) -> MeasuredRates {
        let rate = |(work, ns): (u64, u64)| (ns > 0).then(|| work as f64 * 1e9 / ns as f64);
        MeasuredRates {
            gemm_flop_per_s: rate(gemm),
            sum_bytes_per_s: rate(sum),
            apply_params_per_s: rate(apply),
        }
    }
}

/// One row of the scheme table.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerRow {
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: LayerKind,
    /// M×N.
    pub shape: (usize, usize),
    /// Scheme.
    pub scheme: Scheme,
    /// Seconds the PS and SFB would cost the busiest node for this FC layer
    /// at the agreed rates (`--cost-model seconds`), as HybComm weighed them.
    #[serde(default)]
    pub cost_s: Option<(f64, f64)>,
}

/// The report as text.
pub fn render(r: &TrainReport) -> String {
    let mut s = String::new();
    render_header(&mut s, r);
    render_resilience(&mut s, r);
    render_setup(&mut s, r);
    render_schemes(&mut s, r);
    render_iterations(&mut s, r);
    render_traffic(&mut s, r);
    render_outcome(&mut s, r);
    s
}

/// The run's shape and the transports.
fn render_header(s: &mut String, r: &TrainReport) {
    let _ = writeln!(
        s,
        "{} | {} workers, {} servers{} | sync {} | {} | K={} | compute {:.3} s/iter (time scale {})",
        r.model,
        r.workers,
        r.servers,
        if r.colocate { " (colocated)" } else { "" },
        r.sync,
        r.consistency,
        r.batch,
        r.compute_s,
        r.time_scale
    );
    for t in &r.transport {
        let _ = writeln!(s, "transport {t}");
    }
}

/// Rollbacks, the trigger's figures, removed stragglers and checkpoints.
fn render_resilience(s: &mut String, r: &TrainReport) {
    for (i, x) in r.restarts.iter().enumerate() {
        let _ = writeln!(
            s,
            "rollback {}: {}; resumed from iteration {} ({:.2} s to restart)",
            i + 1,
            x.cause.lines().next().unwrap_or(""),
            x.resumed_from,
            x.recovery_s
        );
    }
    render_trigger(s, r);
    for x in &r.removed {
        let _ = writeln!(
            s,
            "removed rank {} as a straggler: {}; it left at iteration {}, and the job went on with one worker fewer{}",
            x.rank,
            x.why,
            x.left_at.map_or("?".to_string(), |i| i.to_string()),
            x.replaced_for.map_or(String::new(), |n| format!(
                "; a replacement joined for the last {n} iterations"
            ))
        );
    }
    if let Some(c) = &r.checkpoint {
        let _ = writeln!(
            s,
            "checkpoints every {} iterations: {} written ({:.1} MB); copying them cost the iterations {:.3} s \
             ({:.3}% of the run), writing took {:.2} s on the checkpoint threads",
            c.every,
            c.written.len(),
            c.bytes as f64 / 1e6,
            c.copy_s,
            100.0 * c.cost_fraction,
            c.write_s
        );
        for f in &c.failed {
            let _ = writeln!(s, "  a checkpoint could not be written: {f}");
        }
    }
    if let Some(k) = r.resumed_from {
        let _ = writeln!(
            s,
            "the last attempt resumed from iteration {k}; its iterations are below"
        );
    }
}

/// The workers' paces and the servers' partial rounds, under a trigger other
/// than all or when the paces differ by a fifth (a straggler).
fn render_trigger(s: &mut String, r: &TrainReport) {
    let (lo, hi) = r
        .worker_iteration_s
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &w| (lo.min(w), hi.max(w)));
    if r.trigger != "all" || hi > 1.2 * lo {
        let list: Vec<String> = r.worker_iteration_s.iter().map(|w| format!("{w:.3}")).collect();
        let _ = writeln!(
            s,
            "trigger {}: mean iteration per worker {} s; {} rounds applied without every worker, {} late \
             contributions dropped, {} folded into the next round",
            r.trigger,
            list.join(" / "),
            r.partial_applies,
            r.dropped,
            r.late_folded
        );
    }
}

/// The local learners' traffic, where the servers' sums ran, and the rates.
fn render_setup(s: &mut String, r: &TrainReport) {
    if r.local_learners > 1 {
        let mb = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64 / 1e6;
        let _ = writeln!(
            s,
            "{} learners per node ({}): each node's NIC sent {:.1} MB and received {:.1} MB on average",
            r.local_learners,
            if r.flat {
                "flat: every learner is a rank"
            } else {
                "local aggregation: one rank per node"
            },
            mb(&r.node_tx_bytes),
            mb(&r.node_rx_bytes)
        );
    }
    let a = &r.aggregation;
    if a.cpu_bytes + a.gpu_bytes > 0 {
        let _ = writeln!(
            s,
            "server sums: {:.1} MB on the CPU ({} chunks), {:.1} MB on the GPU ({} chunks); SF rebuilds on the CPU",
            a.cpu_bytes as f64 / 1e6,
            a.cpu_chunks,
            a.gpu_bytes as f64 / 1e6,
            a.gpu_chunks,
        );
    }
    if let Some(rt) = &r.rates {
        let host = match (rt.host_ranks, rt.link_on_host) {
            (0 | 1, _) => String::new(),
            (n, true) => format!(" ({n} ranks share a host, its loopback too: HybComm weighs the host's whole work)"),
            (n, false) => format!(" ({n} ranks share a host: HybComm weighs the host's whole work)"),
        };
        let _ = writeln!(
            s,
            "rates per rank (HybComm in seconds): link {:.2} GB/s, {:.1} µs a message, sum {:.1} GB/s, GEMM {:.1} GFLOP/s; slices of {} parameters{host}",
            rt.link_bytes_per_s / 1e9,
            rt.msg_s * 1e6,
            rt.sum_bytes_per_s / 1e9,
            rt.gemm_flop_per_s / 1e9,
            r.slice_params
        );
    }
    let m = &r.measured;
    let parts: Vec<String> = [
        m.gemm_flop_per_s.map(|x| format!("GEMM {:.1} GFLOP/s", x / 1e9)),
        m.sum_bytes_per_s.map(|x| format!("sum {:.2} GB/s", x / 1e9)),
        m.apply_params_per_s
            .map(|x| format!("apply {:.0} M parameters/s", x / 1e6)),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !parts.is_empty() {
        let _ = writeln!(s, "reached by the jobs, per executor-second: {}", parts.join(", "));
    }
}

/// How many layers go through each scheme, and every FC layer's.
fn render_schemes(s: &mut String, r: &TrainReport) {
    let count = |x: Scheme| r.layers.iter().filter(|l| l.scheme == x).count();
    let (sfb, adam) = (count(Scheme::Sfb), count(Scheme::Adam));
    let when = if r.switches.is_empty() {
        "every iteration"
    } else {
        "from the start"
    };
    let _ = write!(
        s,
        "schemes ({when}): {} layers PS, {sfb} layers SFB",
        r.layers.len() - sfb - adam
    );
    if adam > 0 {
        let _ = write!(s, ", {adam} layers Adam");
    }
    let _ = writeln!(s);
    for l in r.layers.iter().filter(|l| l.kind == LayerKind::Fc) {
        let cost = match l.cost_s {
            Some((ps, sfb)) => format!("   (PS {ps:.3} s, SFB {sfb:.3} s at the rates above)"),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "  {:<10} fc {:>6}×{:<6} {:?}{cost}",
            l.name, l.shape.0, l.shape.1, l.scheme
        );
    }
    if !r.switches.is_empty() {
        let each: Vec<String> = r
            .switches
            .iter()
            .map(|w| {
                let name = r.layers.get(w.layer as usize).map_or("?", |l| l.name.as_str());
                format!("{name} to {:?} at iteration {}", w.scheme, w.iter)
            })
            .collect();
        let _ = writeln!(
            s,
            "switches: {} ({} factor blocks sent in all)",
            each.join(", "),
            r.factor_sends
        );
    }
    if r.adapt_every > 0 && r.decisions.is_empty() {
        let _ = writeln!(
            s,
            "decisions: every {} iterations, none in this run's {}",
            r.adapt_every,
            r.per_iteration.len()
        );
    }
    if let Some(why) = &r.adapt_off {
        let _ = writeln!(s, "decisions: none, the start-up choice holds ({why})");
    }
    if !r.decisions.is_empty() {
        let each: Vec<String> = r
            .decisions
            .iter()
            .map(|d| format!("{}: {:#b} after {:.3} s/iter", d.at, d.sfb, d.window_s))
            .collect();
        let _ = writeln!(
            s,
            "decisions (iteration: SFB bits of the FC layers, after the window's time): {}",
            each.join(", ")
        );
    }
}

/// The table of the slowest worker's iterations, and their mean.
fn render_iterations(s: &mut String, r: &TrainReport) {
    let _ = writeln!(
        s,
        "{:>5} {:>10} {:>12} {:>10} {:>10} {:>8}",
        "iter", "seconds", "samples/s", "blocked s", "sync s", "hidden"
    );
    for i in &r.per_iteration {
        let hidden = if i.sync_span_s > 0.0 {
            format!("{:.0}%", 100.0 * (1.0 - i.exposed_s / i.sync_span_s).clamp(0.0, 1.0))
        } else {
            "-".into()
        };
        let _ = writeln!(
            s,
            "{:>5} {:>10.3} {:>12.1} {:>10.3} {:>10.3} {:>8}",
            i.iter,
            i.seconds,
            (r.workers * r.batch * if r.flat { 1 } else { r.local_learners.max(1) }) as f64 / i.seconds,
            i.blocked_s,
            i.sync_span_s,
            hidden
        );
    }
    let _ = writeln!(
        s,
        "mean iteration {:.3} s, {:.1} samples/s, {:.0}% of communication hidden behind compute",
        r.iteration_s,
        r.throughput_samples_s,
        100.0 * r.hidden_fraction
    );
}

/// The sparse layers' pushes and the communication frequency's exchanges.
fn render_traffic(s: &mut String, r: &TrainReport) {
    let sp = &r.sparse;
    if sp.pushes + sp.dense_pushes > 0 {
        let _ = writeln!(
            s,
            "sparse layers: {} slices as pairs (density {:.2}%, {} bytes), {} slices dense ({} bytes)",
            sp.pushes,
            if sp.elements > 0 {
                100.0 * sp.nonzeros as f64 / sp.elements as f64
            } else {
                0.0
            },
            sp.bytes,
            sp.dense_pushes,
            sp.dense_bytes
        );
    }
    if let Some(c) = &r.comm {
        let _ = writeln!(
            s,
            "communication: {} exchanges in {} iterations ({:.2}x fewer than every iteration), {} bytes handed in per worker",
            c.exchanges,
            c.steps,
            c.steps as f64 / c.exchanges.max(1) as f64,
            c.handed_in_bytes
        );
        for d in &c.decisions {
            let _ = writeln!(s, "  {d}");
        }
    }
}

/// The verification's verdict and the ranks' warnings.
fn render_outcome(s: &mut String, r: &TrainReport) {
    match r.verified {
        Some(true) => {
            let _ = writeln!(
                s,
                "verify: every worker's parameters equal the single-process reference, bit for bit"
            );
        }
        Some(false) => {
            let _ = writeln!(s, "verify: FAILED on layers {:?}", r.mismatched_layers);
        }
        None => {}
    }
    if !r.log_warnings.is_empty() {
        let _ = writeln!(s, "the ranks logged {} warnings or errors:", r.log_warnings.len());
        for w in r.log_warnings.iter().take(20) {
            let _ = writeln!(s, "  {w}");
        }
    }
}
