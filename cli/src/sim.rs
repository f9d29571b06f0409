//! `tidewire sim`: the engine's own sans-IO core driven by the simulator (the
//! `tidewire-sim` crate) over a discrete-event network of full-duplex NICs, at any scale.
//!
//! ```text
//! tidewire sim --model vgg19 --nodes 16 --bandwidth 10gbit --sync full --json
//! # P3 with 100k-parameter slices, and each NIC's bytes per 1 ms (in the JSON)
//! tidewire sim --model vgg19 --nodes 4 --bandwidth 10gbit --sync p3 --slice-params 100000 --trace-bin-us 1000 --json
//! tidewire sim --model resnet-50 --workers 4 --servers 4 --bandwidth 5gbit --sync p3
//! # Nexus's local aggregation: 8 nodes of 4 learners (GPUs), against the flat 32-rank run
//! tidewire sim --model vgg19 --nodes 8 --local-learners 4 --bandwidth 10gbit
//! ```
//!
//! With `--local-learners L` each worker rank leads L learners that compute in
//! parallel; their gradients reach it over `--local-bandwidth` and are summed
//! before one push, and the synced parameters are published back to them (see
//! [`SimConfig::local_learners`]). The flat run of the same learners (every
//! learner a rank, L ranks sharing each node's NIC, servers summing each
//! node's gradients first) runs too, for the speedup and the dissection of
//! the sync time (Nexus's Fig. 12); `--flat` runs only the flat one.
//!
//! Every rank's NIC has one link's bandwidth in each direction, shared fairly
//! by the transfers queued on it, and every transfer pays the latency. The
//! report has the iteration time, the throughput in samples per second, and
//! the speedup over one node of the same profile (which syncs only with itself:
//! its iteration is its compute plus the local sync of the last layer).

use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use serde::Serialize;
use tidewire_engine::book::{Book, BookConfig, Cluster};
use tidewire_engine::config::{Consistency, SyncMode, Trigger};
use tidewire_engine::cost::Rates;
use tidewire_engine::models::{self, Model};
use tidewire_sim::{Faults, Sim, SimConfig, SimReport};

use crate::error::{Error, Result};
use crate::job::JobArgs;

/// Flags of `tidewire sim`.
#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// The job: model, iterations, sync mode, consistency, trigger, sizes (shared with `train`).
    #[command(flatten)]
    pub job: JobArgs,
    /// GPU the compute stands for: titan-x (the Poseidon paper's single-GPU throughputs) or p4000
    /// (P3's Quadro P4000: the Titan X rates × its FP32 peak over the Titan X's, 5.30 / 6.60 TFLOPS).
    #[arg(long, default_value = "titan-x", value_parser = parse_gpu)]
    pub gpu: models::Calibration,
    /// Nodes, each a worker and a server (P1 = P2 = nodes), as in Poseidon's runs.
    #[arg(long, conflicts_with_all = ["workers", "servers"])]
    pub nodes: Option<usize>,
    /// Workers (P1), with --servers, on separate nodes.
    #[arg(long, requires = "servers")]
    pub workers: Option<usize>,
    /// Servers (P2), with --workers.
    #[arg(long, requires = "workers")]
    pub servers: Option<usize>,
    /// Link bandwidth per direction: e.g. 10gbit, 40gbe, 56gbit, 500mbit, or bits/s.
    #[arg(long, default_value = "10gbit", value_parser = parse_bandwidth)]
    pub bandwidth: f64,
    /// One-way latency per transfer in microseconds.
    #[arg(long, default_value_t = 5.0)]
    pub latency_us: f64,
    /// Landing slots each server keeps per worker (default: the engine's).
    #[arg(long)]
    pub slots: Option<u32>,
    /// Spare landing slots per worker at each server, for the rank order
    /// (default: the engine's): a push that lands before a lower rank's is
    /// parked in place and the worker gets a spare's credit at once.
    #[arg(long)]
    pub spare_slots: Option<u32>,
    /// Memory bandwidth between a node's learners (gradients to the leader,
    /// parameters back; also traffic between ranks of one node), e.g. 10gbyte
    /// is given as 80gbit; default 10 GB/s.
    #[arg(long, default_value = "80gbit", value_parser = parse_bandwidth)]
    pub local_bandwidth: f64,
    /// A fault, repeatable: slow:RANK:FACTOR[:FROM-TO] (worker RANK computes
    /// FACTOR× slower, in iterations FROM..TO, default all), or
    /// crash:RANK:ITER or crash:RANK:ITER:REJOIN_MS (worker RANK crashes at
    /// iteration ITER; with --trigger all the job fails naming it; with
    /// REJOIN_MS it comes
    /// back that long after, takes the current parameters and is counted
    /// again: a worker without a shard, under the other triggers).
    #[arg(long = "fault")]
    pub faults: Vec<String>,
    /// A straggler: worker rank to slow down for the whole run (same as
    /// --fault slow:RANK:FACTOR).
    #[arg(long, requires = "slow_factor")]
    pub slow_rank: Option<u32>,
    /// Its compute slowdown factor.
    #[arg(long, requires = "slow_rank")]
    pub slow_factor: Option<f64>,
    /// Slice size in parameters (P3's scheduling unit; modes with slices:
    /// sliced, p3, full). Slices never cross a 2 MiB chunk, so sizes above
    /// 524,288 act as 524,288. Default: P3's 50,000, or with `--profile` the
    /// size `train` takes at the profile's rates (`cost::slice_params_for`).
    #[arg(long)]
    pub slice_params: Option<usize>,
    /// Decide FC layers' schemes again every N iterations (0: never), as
    /// `train --adapt-every` does: worker 0 runs the same policy on virtual
    /// time (see `docs/src/switches.md`). Unlike `train`, where `full` and
    /// `hybrid` decide every 10 by default, the simulator decides only when asked.
    #[arg(long, default_value_t = 0)]
    pub adapt_every: u64,
    /// Trace every NIC's bytes sent and received per bin of this many µs of
    /// virtual time, set-up included (`nic_trace` in the JSON).
    #[arg(long)]
    pub trace_bin_us: Option<f64>,
    /// Charge the CPU as the machine of this `tidewire calibrate --out`
    /// profile does, with every rank of the run sharing its cores as `tidewire
    /// train` runs them: its GEMM rebuilds SF gradients, its sum folds, its
    /// per-message cost delays each post, and the link is `--bandwidth`
    /// capped at what the shared cores move over loopback. HybComm then
    /// decides in seconds at those rates, as `train` does. Without it the
    /// machine is ideal: 10 GB/s sums and copies, the model's GPU GEMM, no
    /// per-message cost, and HybComm decides in bytes.
    #[arg(long)]
    pub profile: Option<std::path::PathBuf>,
    /// With `--profile`: every rank on the profiled machine's loopback, as
    /// `train` runs without `--netns`. Their messages share one host-wide
    /// loopback (the profile's TCP stream, which keeps two cores busy, times
    /// half the cores), instead of a `--bandwidth` NIC each, and HybComm
    /// weighs the host's whole work, as `train` does there.
    #[arg(long, requires = "profile")]
    pub loopback: bool,
}

impl SimArgs {
    /// The slice size in parameters: `--slice-params`, or P3's.
    pub fn slice(&self) -> usize {
        self.slice_params.unwrap_or(tidewire_engine::cost::P3_SLICE_PARAMS)
    }
}

impl Default for SimArgs {
    /// `tidewire sim`'s defaults.
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Sim {
            #[command(flatten)]
            args: SimArgs,
        }
        <Sim as clap::Parser>::parse_from(["sim"]).args
    }
}

/// Parses `--fault` values (and `--slow-rank`/`--slow-factor`) into the simulator's faults.
pub fn faults_of(args: &SimArgs) -> Result<Faults> {
    let mut f = Faults::default();
    let bad = |v: &str| {
        Error::Usage(format!(
            "--fault {v:?}: use slow:RANK:FACTOR[:FROM-TO] or crash:RANK:ITER[:REJOIN_MS]"
        ))
    };
    for v in &args.faults {
        let parts: Vec<&str> = v.split(':').collect();
        match parts.as_slice() {
            ["slow", rank, factor, rest @ ..] if rest.len() <= 1 => {
                let rank: u32 = rank.parse().map_err(|_| bad(v))?;
                let factor: f64 = factor.parse().map_err(|_| bad(v))?;
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(bad(v));
                }
                let (from, to) = match rest.first() {
                    None => (0, u64::MAX),
                    Some(span) => {
                        let (a, b) = span.split_once('-').ok_or_else(|| bad(v))?;
                        (a.parse().map_err(|_| bad(v))?, b.parse().map_err(|_| bad(v))?)
                    }
                };
                f.slow.push((rank, factor, from, to));
            }
            ["crash", rank, iter, rest @ ..] if rest.len() <= 1 => {
                if f.crash.is_some() {
                    return Err(Error::Usage("one crash fault per run".into()));
                }
                f.crash = Some((rank.parse().map_err(|_| bad(v))?, iter.parse().map_err(|_| bad(v))?));
                if let Some(ms) = rest.first() {
                    let ms: f64 = ms.parse().map_err(|_| bad(v))?;
                    if !(ms.is_finite() && ms >= 0.0) {
                        return Err(bad(v));
                    }
                    f.rejoin_after_ns = Some((ms * 1e6) as u64);
                }
            }
            _ => return Err(bad(v)),
        }
    }
    if let (Some(r), Some(x)) = (args.slow_rank, args.slow_factor) {
        if !(x.is_finite() && x > 0.0) {
            return Err(Error::Usage("--slow-factor must be a finite number > 0".into()));
        }
        f.slow.push((r, x, 0, u64::MAX));
    }
    Ok(f)
}

fn parse_gpu(s: &str) -> std::result::Result<models::Calibration, String> {
    models::Calibration::parse(s).ok_or_else(|| format!("use {}", models::Calibration::NAMES.join(" or ")))
}

/// Parses a bandwidth: `10gbit`, `10gbe`, `10g`, `500mbit`, `2.5gbit/s`, or plain bits per second.
pub fn parse_bandwidth(s: &str) -> Result<f64> {
    let t = s.trim().to_ascii_lowercase();
    let t = t.strip_suffix("/s").unwrap_or(&t);
    let (num, mult) = [
        ("gbit", 1e9),
        ("gbe", 1e9),
        ("gb", 1e9),
        ("g", 1e9),
        ("mbit", 1e6),
        ("mb", 1e6),
        ("m", 1e6),
        ("kbit", 1e3),
        ("k", 1e3),
    ]
    .iter()
    .find_map(|(suf, m)| t.strip_suffix(suf).map(|n| (n, *m)))
    .unwrap_or((t, 1.0));
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| Error::Usage(format!("{s:?}: give a bandwidth like 10gbit, 40gbe or 500mbit")))?;
    let bps = v * mult;
    if !(bps.is_finite() && bps >= 1e3) {
        return Err(Error::Usage(format!("{s:?}: give at least 1 kbit/s")));
    }
    Ok(bps)
}

/// What `tidewire sim` reports.
#[derive(Debug, Clone, Serialize)]
pub struct SimResult {
    /// How the CPU is charged: a calibration profile (`--profile`) or the ideal machine.
    #[serde(default)]
    pub cpu: String,
    /// The aggregation trigger (`--trigger`).
    pub trigger: String,
    /// Virtual time to the last apply (the model's last version), per
    /// iteration, s: with a straggler under a trigger other than all, the
    /// model is done before the straggler finishes computing.
    pub updates_iteration_s: f64,
    /// Late contributions dropped (quorum, timeout).
    pub dropped: u64,
    /// Late contributions folded into a later round (async).
    pub late_folded: u64,
    /// Applies with fewer contributions than live workers.
    pub partial_applies: u64,
    /// Chunk applies in all.
    pub applies: u64,
    /// Crashed workers that came back.
    pub rejoined: u32,
    /// Rank order: contributions parked in spare landing slots (their
    /// credit went back at once), and ones that held their credit because
    /// every spare of their worker was parked.
    pub parked: u64,
    pub held_for_order: u64,
    /// Most spare slots of one worker parked at one server at once.
    pub max_spares_used: u32,
    /// Bytes of one server's landing region (the largest; what `train`
    /// allocates and registers for incoming gradients): P1 × slots × the
    /// largest slice, bounded by credits, never P1 × the model.
    pub landing_bytes_per_server: u64,
    pub model: String,
    pub sync: String,
    pub consistency: String,
    /// Summed in arrival order (`--fast`) rather than rank order.
    pub fast: bool,
    pub workers: usize,
    pub servers: usize,
    pub colocated: bool,
    pub bandwidth_gbps: f64,
    pub latency_us: f64,
    pub batch: usize,
    pub iters: u64,
    /// Mean virtual seconds per iteration.
    pub iteration_s: f64,
    /// Samples per virtual second over all workers.
    pub throughput_samples_s: f64,
    /// Throughput over one node of the same profile.
    pub speedup: f64,
    /// One node's iteration, s.
    pub single_node_iteration_s: f64,
    /// The compute alone, per iteration, s.
    pub compute_s: f64,
    /// Mean time a worker was blocked per iteration, s.
    pub blocked_s: f64,
    /// Learners per worker node, and whether they ran flat (each a rank).
    pub local_learners: usize,
    /// See `local_learners`.
    pub flat: bool,
    /// Per worker node per iteration: payload bytes its NIC sent and received
    /// (mean over nodes; the set-up before the first iteration, seeding the
    /// servers, not counted: a run with no iterations measures it).
    pub node_nic_bytes_per_iter: [f64; 2],
    /// Per host (workers first, then server-only nodes): payload bytes its
    /// NIC sent and received per iteration (set-up not counted). Shows how
    /// even the load is: Adam's layer servers stand out (Poseidon's Fig. 10).
    pub host_nic_bytes_per_iter: Vec<[f64; 2]>,
    /// Local aggregation per node per iteration, s (0 without local learners).
    pub local_agg_s: f64,
    /// Parameter fan-out to the node's learners per iteration, s.
    pub fanout_s: f64,
    /// With local learners: the flat run of the same learners, for comparison.
    pub flat_run: Option<Box<SimResult>>,
    /// The flat run's iteration over this one's (> 1: local aggregation is faster).
    pub speedup_over_flat: Option<f64>,
    /// Events the simulator processed.
    pub events: u64,
    /// Worker 0's scheme decisions (`--adapt-every`), and the switches they made.
    #[serde(default)]
    pub decisions: u64,
    #[serde(default)]
    pub switches: u64,
    /// Wall-clock seconds the simulation took here.
    pub wall_s: f64,
    /// Slice size in parameters (`--slice-params`; modes without slices use the chunk).
    pub slice_params: usize,
    /// With `--trace-bin-us`: the bin, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_bin_us: Option<f64>,
    /// Virtual time when iteration 0 started (after the set-up), s: bins
    /// before it are the set-up's.
    pub start_s: f64,
    /// With `--trace-bin-us`: per node (hosts in rank order: the workers,
    /// then separate servers), `[sent, received]` bytes of its NIC in each
    /// bin from time 0. Where a sender is the bottleneck the receive side
    /// runs ahead of it (the model's simplification of max-min fairness).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nic_trace: Vec<[Vec<u64>; 2]>,
}

/// How the learners map onto ranks: L behind each worker rank, or flat
/// (each learner a rank; `hosts` puts L of them on each node).
struct Layout {
    learners: usize,
    fold_group: usize,
    hosts: Option<Vec<u32>>,
}

fn one_run(
    model: &Model,
    cluster: Cluster,
    args: &SimArgs,
    mode: SyncMode,
    batch: usize,
    lay: &Layout,
    main: bool,
) -> Result<SimReport> {
    let ranks = processes(&cluster, lay, args.job.flat);
    let world = cluster.world();
    let mut book = Book::new(
        cluster,
        model.layers.clone(),
        mode.book_config(BookConfig {
            batch: batch * lay.learners,
            slice_params: args.slice(),
            chunk_bytes: args
                .job
                .chunk_bytes
                .unwrap_or_else(|| mode.default_chunk_bytes(args.slice())),
            ..Default::default()
        }),
    )?;
    let rates = rates_of(args, ranks, batch * lay.learners)?;
    if let Some((r, _)) = &rates {
        book = book.with_rates(*r)?;
    }
    if args.adapt_every > 0 {
        book = book.with_adaptive(args.adapt_every)?;
    }
    let times: Vec<(u64, u64)> = model
        .layer_times(batch, args.job.time_scale)
        .iter()
        .map(|(f, b)| (f.as_nanos() as u64, b.as_nanos() as u64))
        .collect();
    let mut cfg = SimConfig::new(Arc::new(book), mode, times, args.job.iters);
    set_machine(&mut cfg, model, args, rates.as_ref().map(|r| &r.0));
    set_schedule(&mut cfg, args, lay)?;
    if let Some((_, p)) = rates.filter(|_| args.loopback) {
        // One host: every message between ranks goes over its loopback, and
        // its copies and the ranks' jobs share its cores, each job at one
        // core's rates while the cores go round.
        cfg.hosts = Some(vec![0; world]);
        cfg.host_cpu = Some((p.cores as f64, p.rates.link_bytes_per_s));
        cfg.gemm_flops = p.rates.gemm_flop_per_s;
        cfg.agg_bytes_per_s = p.rates.sum_bytes_per_s;
        cfg.copy_bytes_per_s = p.rates.sum_bytes_per_s;
    }
    // The run measured (not the one-node reference or the set-up alone).
    if main {
        cfg.trace_bin_ns = args.trace_bin_us.map(|us| ((us * 1000.0).round() as u64).max(1));
        cfg.sched.trigger = args.job.trigger;
        let f = faults_of(args)?;
        cfg.faults.slow = f.slow;
        cfg.faults.crash = f.crash;
        cfg.faults.rejoin_after_ns = f.rejoin_after_ns;
    }
    Ok(Sim::run(cfg)?)
}

/// Processes on the profiled machine: every rank of `cluster`, and each
/// worker's other learners (ranks of their own with `flat`).
fn processes(cluster: &Cluster, lay: &Layout, flat: bool) -> usize {
    cluster.world() + cluster.workers().len() * if flat { 0 } else { lay.learners - 1 }
}

/// With `--profile`: the rates of one of `ranks` processes sharing the
/// profiled machine (as `train` runs FC layers: handed in as factors, a PS
/// layer's gradient formed from them, `cfg.fc_factors` in `set_machine`),
/// and the profile, its GEMM at batch `k` ([`Profile::at_batch`]).
///
/// [`Profile::at_batch`]: tidewire::calibrate::Profile::at_batch
fn rates_of(args: &SimArgs, ranks: usize, k: usize) -> Result<Option<(Rates, tidewire::calibrate::Profile)>> {
    let Some(path) = &args.profile else {
        return Ok(None);
    };
    let p = tidewire::calibrate::Profile::load(path)
        .map_err(|e| Error::Usage(format!("--profile: {e}")))?
        .at_batch(k);
    let link = if args.loopback {
        None
    } else {
        Some(args.bandwidth / 8.0)
    };
    let rates = Rates {
        ps_builds_grad: true,
        ..p.node_rates(ranks, link)
    };
    Ok(Some((rates, p)))
}

/// The links and the CPU: `--bandwidth`, `--latency-us` and the model's GEMM,
/// or the profile's `rates`.
fn set_machine(cfg: &mut SimConfig, model: &Model, args: &SimArgs, rates: Option<&Rates>) {
    cfg.bandwidth_bps = args.bandwidth;
    cfg.latency_ns = (args.latency_us * 1000.0).round() as u64;
    cfg.gemm_flops = model.calibrated_flop_rate() / args.job.time_scale.max(1e-9);
    if let Some(r) = rates {
        // `train` hands FC layers in as factors, so its PS pays the GEMM
        // that forms their gradient; the model charges it where the rates say.
        cfg.fc_factors = r.ps_builds_grad;
        cfg.gemm_flops = r.gemm_flop_per_s;
        cfg.agg_bytes_per_s = r.sum_bytes_per_s;
        cfg.copy_bytes_per_s = r.sum_bytes_per_s;
        cfg.msg_ns = (r.msg_s * 1e9).round() as u64;
        cfg.bandwidth_bps = r.link_bytes_per_s * 8.0;
    }
}

/// The scheduler's flags, and the learners' layout `lay`.
fn set_schedule(cfg: &mut SimConfig, args: &SimArgs, lay: &Layout) -> Result<()> {
    cfg.sched.consistency = args.job.consistency;
    cfg.sched.deterministic = !args.job.fast;
    cfg.sched.learners = lay.learners as u32;
    cfg.sched.fold_group = lay.fold_group as u32;
    cfg.local_learners = lay.learners as u32;
    cfg.local_bytes_per_s = args.local_bandwidth / 8.0;
    cfg.hosts = lay.hosts.clone();
    if let Some(c) = args.job.credit_bytes {
        cfg.sched.credit_bytes = c;
    }
    if let Some(n) = args.slots {
        cfg.sched.slots = n;
    }
    if let Some(n) = args.spare_slots {
        cfg.sched.spare_slots = n;
    }
    Ok(())
}

/// Whether `tidewire sim --model NAME` has a profile for `name`.
pub fn known_model(name: &str) -> bool {
    models::profile(name).is_some()
}

/// Runs the simulation (and the one-node reference for the speedup).
pub fn run(args: &SimArgs) -> Result<SimResult> {
    let model = args.job.profile()?.on(args.gpu);
    check_flags(args)?;
    let t0 = Instant::now();
    let mode = args.job.sync;
    check_baseline(args, mode)?;
    let batch = args.job.batch.unwrap_or(model.batch);
    let (workers, servers, colocated) = nodes_of(args);
    let job_of = |args, single_iteration_s| Job {
        model: &model,
        args,
        mode,
        batch,
        workers,
        servers,
        colocated,
        single_iteration_s,
    };
    // The slice size train takes at the profile's rates, for every rank of the job.
    let mut resolved;
    let args = if args.slice_params.is_none() && mode.sliced() && args.profile.is_some() {
        let (cluster, lay) = job_of(args, 0.0).layout(args.job.flat)?;
        let ranks = processes(&cluster, &lay, args.job.flat);
        resolved = args.clone();
        resolved.slice_params =
            rates_of(args, ranks, batch * lay.learners)?.map(|(r, _)| tidewire_engine::cost::slice_params_for(&r));
        &resolved
    } else {
        args
    };
    let single = one_run(
        &model,
        Cluster::colocated(1)?,
        args,
        mode,
        batch,
        &Layout {
            learners: 1,
            fold_group: 1,
            hosts: None,
        },
        false,
    )?;
    let job = job_of(args, single.iteration_s);
    let mut r = job.run(args.job.flat)?;
    if args.job.local_learners > 1 && !args.job.flat {
        let f = job.run(true)?;
        r.speedup_over_flat = Some(f.iteration_s / r.iteration_s);
        r.flat_run = Some(Box::new(f));
    }
    r.wall_s = t0.elapsed().as_secs_f64();
    Ok(r)
}

/// (workers, servers, colocated): `--nodes` colocated, `--workers` and
/// `--servers` apart, or one colocated node.
fn nodes_of(args: &SimArgs) -> (usize, usize, bool) {
    match (args.nodes, args.workers, args.servers) {
        (Some(n), _, _) => (n, n, true),
        (None, Some(w), Some(s)) => (w, s, false),
        _ => (1, 1, true),
    }
}

/// Checks the flags' values (clap checked their forms).
fn check_flags(args: &SimArgs) -> Result<()> {
    if args.job.iters == 0 {
        return Err(Error::Usage("--iters must be at least 1".into()));
    }
    if !(args.latency_us >= 0.0 && args.latency_us.is_finite()) {
        return Err(Error::Usage("--latency-us must be a finite number ≥ 0".into()));
    }
    if !(args.job.time_scale > 0.0 && args.job.time_scale.is_finite()) {
        return Err(Error::Usage("--time-scale must be a finite number > 0".into()));
    }
    let (workers, servers, _) = nodes_of(args);
    if workers == 0 || servers == 0 || workers > 4096 || servers > 4096 {
        return Err(Error::Usage(format!(
            "{workers} workers and {servers} servers: give 1 to 4096 of each"
        )));
    }
    if args.job.local_learners == 0 || args.job.local_learners > 64 {
        return Err(Error::Usage("--local-learners: give 1 to 64".into()));
    }
    if args.job.flat && args.job.local_learners < 2 {
        return Err(Error::Usage("--flat needs --local-learners L with L ≥ 2".into()));
    }
    if args.local_bandwidth.is_nan() || args.local_bandwidth < 1e6 {
        return Err(Error::Usage("--local-bandwidth: give at least 1mbit".into()));
    }
    if args.job.chunk_bytes.is_some_and(|b| b < 4 || b % 4 != 0) {
        return Err(Error::Usage("--chunk-bytes: give a positive multiple of 4".into()));
    }
    if args.slice_params == Some(0) {
        return Err(Error::Usage("--slice-params: give at least 1".into()));
    }
    if let Some(us) = args.trace_bin_us {
        if !(us.is_finite() && us >= 0.001) {
            return Err(Error::Usage("--trace-bin-us: give at least 0.001 (1 ns)".into()));
        }
    }
    Ok(())
}

/// The papers' baselines keep one version per iteration: the servers of
/// kvstore are pulled every version, Adam's rebuild each layer from every
/// worker's factors of one iteration. BSP and `--trigger all` only.
fn check_baseline(args: &SimArgs, mode: SyncMode) -> Result<()> {
    if matches!(mode, SyncMode::KvStore | SyncMode::Adam)
        && (args.job.consistency != Consistency::Bsp || args.job.trigger != Trigger::All)
    {
        return Err(Error::Usage(format!(
            "--sync {} is a BSP baseline: it needs --consistency bsp and --trigger all, not --consistency {} --trigger {}",
            mode.name(),
            args.job.consistency.name(),
            args.job.trigger.name()
        )));
    }
    Ok(())
}

/// The job a `tidewire sim` measures, with its local learners behind each
/// worker rank or flat.
struct Job<'a> {
    model: &'a Model,
    args: &'a SimArgs,
    mode: SyncMode,
    batch: usize,
    /// Worker nodes.
    workers: usize,
    /// Separate servers (or the nodes, colocated).
    servers: usize,
    colocated: bool,
    /// The one-node reference's iteration, s.
    single_iteration_s: f64,
}

impl Job<'_> {
    /// The cluster and the learners' layout: L learners behind each worker
    /// rank, or with `flat` every learner a rank.
    fn layout(&self, flat: bool) -> Result<(Cluster, Layout)> {
        let (workers, servers, l) = (self.workers, self.servers, self.args.job.local_learners);
        let p1 = if flat { workers * l } else { workers };
        let cluster = if self.colocated {
            Cluster::colocated(p1)?
        } else {
            Cluster::split(p1, servers)?
        };
        let lay = if flat && l > 1 {
            // Worker rank r on node r / L; separate servers on hosts of their own.
            let mut hosts: Vec<u32> = (0..p1).map(|r| (r / l) as u32).collect();
            if !self.colocated {
                hosts.extend((0..servers).map(|s| (workers + s) as u32));
            }
            Layout {
                learners: 1,
                fold_group: l,
                hosts: Some(hosts),
            }
        } else {
            Layout {
                learners: l,
                fold_group: 1,
                hosts: None,
            }
        };
        Ok((cluster, lay))
    }

    /// Simulates the job, and the same job with no iterations: the set-up
    /// (seeding the servers and the first broadcast), whose bytes are not
    /// the iterations'.
    fn run(&self, flat: bool) -> Result<SimResult> {
        let (model, args, mode, batch) = (self.model, self.args, self.mode, self.batch);
        let (cluster, lay) = self.layout(flat)?;
        let (p1, p2) = (cluster.workers().len(), cluster.servers().len());
        let rep = one_run(model, cluster.clone(), args, mode, batch, &lay, true)?;
        let setup = one_run(
            model,
            cluster,
            &SimArgs {
                job: JobArgs {
                    iters: 0,
                    ..args.job.clone()
                },
                ..args.clone()
            },
            mode,
            batch,
            &lay,
            false,
        )?;
        Ok(self.result(flat, p1, p2, rep, &setup))
    }

    /// The report of the run `rep`, less its set-up's bytes.
    fn result(&self, flat: bool, p1: usize, p2: usize, rep: SimReport, setup: &SimReport) -> SimResult {
        let (args, batch, l) = (self.args, self.batch, self.args.job.local_learners);
        let compute_s = self.model.iteration_compute(batch, args.job.time_scale).as_secs_f64();
        let throughput = (self.workers * l) as f64 * batch as f64 / rep.iteration_s;
        let single_tp = batch as f64 / self.single_iteration_s;
        SimResult {
            cpu: cpu_of(args, batch * if flat { 1 } else { l.max(1) }),
            model: args.job.model.clone(),
            sync: self.mode.name().into(),
            consistency: args.job.consistency.name(),
            fast: args.job.fast,
            workers: p1,
            servers: p2,
            colocated: self.colocated,
            bandwidth_gbps: args.bandwidth / 1e9,
            latency_us: args.latency_us,
            batch,
            iters: args.job.iters,
            iteration_s: rep.iteration_s,
            throughput_samples_s: throughput,
            speedup: throughput / single_tp,
            single_node_iteration_s: self.single_iteration_s,
            compute_s,
            blocked_s: rep.wait_s,
            local_learners: l,
            flat: flat && l > 1,
            node_nic_bytes_per_iter: node_nic_per_iter(&rep, setup, self.workers, args.job.iters),
            host_nic_bytes_per_iter: host_nic_per_iter(&rep, setup, args.job.iters),
            local_agg_s: rep.local_agg_s,
            fanout_s: rep.fanout_s,
            flat_run: None,
            speedup_over_flat: None,
            events: rep.events,
            decisions: rep.decisions,
            switches: rep.switches,
            trigger: args.job.trigger.name(),
            updates_iteration_s: rep.updates_ns as f64 / 1e9 / args.job.iters as f64,
            dropped: rep.dropped,
            late_folded: rep.late_folded,
            partial_applies: rep.partial_applies,
            applies: rep.applies,
            rejoined: rep.rejoined,
            parked: rep.parked,
            held_for_order: rep.held_for_order,
            max_spares_used: rep.max_spares_used,
            landing_bytes_per_server: rep.landing_bytes,
            wall_s: 0.0,
            slice_params: args.slice(),
            trace_bin_us: args.trace_bin_us,
            start_s: rep.start_ns as f64 / 1e9,
            nic_trace: rep.nic_trace,
        }
    }
}

/// How the CPU is charged: from `--profile` (with its GEMM at batch `k`),
/// or the ideal machine.
fn cpu_of(args: &SimArgs, k: usize) -> String {
    let gemm = |p: &std::path::Path| match tidewire::calibrate::Profile::load(p) {
        Ok(prof) => format!("; GEMM {:.1} GFLOP/s a core at K = {k}", prof.gemm_at(k) / 1e9),
        Err(_) => String::new(),
    };
    match &args.profile {
        Some(p) if args.loopback => format!(
            "charged from the profile {} (every rank on its cores and its loopback, copies and jobs sharing the cores, as train runs them{})",
            p.display(),
            gemm(p)
        ),
        Some(p) => format!(
            "charged from the profile {} (every rank on its cores, as train runs them; a --bandwidth link each{})",
            p.display(),
            gemm(p)
        ),
        None => "ideal machine (no --profile): 10 GB/s sums and copies, the model's GPU GEMM, no per-message cost; HybComm in bytes".into(),
    }
}

/// Bytes a worker node's NIC sent and received per iteration, on average
/// over the worker nodes (hosts 0..workers either way), the set-up's left out.
fn node_nic_per_iter(rep: &SimReport, setup: &SimReport, workers: usize, iters: u64) -> [f64; 2] {
    let nic: Vec<[u64; 2]> = rep.nic_bytes.iter().take(workers).copied().collect();
    let base: Vec<[u64; 2]> = setup.nic_bytes.iter().take(workers).copied().collect();
    let per_iter = |i: usize| {
        nic.iter()
            .zip(&base)
            .map(|(b, s)| b[i].saturating_sub(s[i]) as f64)
            .sum::<f64>()
            / nic.len().max(1) as f64
            / iters as f64
    };
    [per_iter(0), per_iter(1)]
}

/// Bytes each host's NIC sent and received per iteration, the set-up's left out.
fn host_nic_per_iter(rep: &SimReport, setup: &SimReport, iters: u64) -> Vec<[f64; 2]> {
    rep.nic_bytes
        .iter()
        .zip(setup.nic_bytes.iter().chain(std::iter::repeat(&[0, 0])))
        .map(|(b, s)| {
            let d = |i: usize| b[i].saturating_sub(s[i]) as f64 / iters.max(1) as f64;
            [d(0), d(1)]
        })
        .collect()
}

/// The text report.
pub fn render(r: &SimResult) -> String {
    let mut s = format!(
        "sim {model}: {w} workers, {s} servers{col}, {bw:.3} Gbit/s, {lat} µs, {sync} {cons}, batch {k}, {it} iterations\n",
        model = r.model,
        w = r.workers,
        s = r.servers,
        col = if r.colocated { " (colocated)" } else { "" },
        bw = r.bandwidth_gbps,
        lat = r.latency_us,
        sync = r.sync,
        cons = r.consistency,
        k = r.batch,
        it = r.iters,
    );
    s.push_str(&body(r));
    s.push_str(&format!("cpu              {}\n", r.cpu));
    if let (Some(f), Some(x)) = (&r.flat_run, r.speedup_over_flat) {
        s.push_str(&format!(
            "flat run         every learner a rank ({} ranks, {} per node's NIC)\n",
            f.workers, f.local_learners
        ));
        s.push_str(&body(f).lines().map(|l| format!("  {l}\n")).collect::<String>());
        s.push_str(&format!("local aggregation {x:.2}x the flat run's speed\n"));
    }
    if let Some(us) = r.trace_bin_us {
        s.push_str(&format!(
            "NIC trace        {} bins of {us} µs per node, iteration 0 from {:.4} s (in --json)\n",
            r.nic_trace.first().map_or(0, |t| t[0].len()),
            r.start_s
        ));
    }
    if r.decisions > 0 {
        s.push_str(&format!(
            "decisions        {} by worker 0, {} switches\n",
            r.decisions, r.switches
        ));
    }
    s.push_str(&format!("simulated in     {:.2} s ({} events)\n", r.wall_s, r.events));
    s
}

fn body(r: &SimResult) -> String {
    let mut s = format!(
        "iteration        {its:.4} s (compute {cs:.4} s, blocked {bs:.4} s)\n\
         throughput       {tp:.1} samples/s\n\
         speedup          {sp:.2}x over one node ({one:.4} s per iteration)\n",
        its = r.iteration_s,
        cs = r.compute_s,
        bs = r.blocked_s,
        tp = r.throughput_samples_s,
        sp = r.speedup,
        one = r.single_node_iteration_s,
    );
    if r.trigger != "all" || r.dropped > 0 || r.partial_applies > 0 {
        s.push_str(&format!(
            "trigger          {}: model updated every {:.4} s ({:.1} iterations/s); {} applies, {} partial, {} late contributions dropped, {} folded\n",
            r.trigger,
            r.updates_iteration_s,
            1.0 / r.updates_iteration_s,
            r.applies,
            r.partial_applies,
            r.dropped,
            r.late_folded,
        ));
    } else {
        s.push_str(&format!(
            "model updates    every {:.4} s ({:.1} iterations/s)\n",
            r.updates_iteration_s,
            1.0 / r.updates_iteration_s
        ));
    }
    s.push_str(&format!(
        "landing memory   {:.1} MB per server ({:.2} MB per worker), for incoming gradients\n",
        r.landing_bytes_per_server as f64 / 1e6,
        r.landing_bytes_per_server as f64 / 1e6 / r.workers as f64,
    ));
    let load: Vec<f64> = r.host_nic_bytes_per_iter.iter().map(|[a, b]| a + b).collect();
    if let (Some((hi, max)), Some((lo, min))) = (
        load.iter().copied().enumerate().max_by(|a, b| a.1.total_cmp(&b.1)),
        load.iter().copied().enumerate().min_by(|a, b| a.1.total_cmp(&b.1)),
    ) {
        s.push_str(&format!(
            "NIC per node     {:.1} MB (node {hi}) to {:.1} MB (node {lo}) sent + received per iteration{}\n",
            max / 1e6,
            min / 1e6,
            if min > 0.0 {
                format!(", busiest/least {:.2}", max / min)
            } else {
                String::new()
            }
        ));
    }
    if r.local_learners > 1 {
        s.push_str(&format!(
            "learners         {} per node{}; local aggregation {:.4} s, fan-out {:.4} s per iteration\n\
             node NIC         {:.1} MB sent, {:.1} MB received per iteration\n",
            r.local_learners,
            if r.flat {
                " (flat: each a rank)"
            } else {
                " behind one rank"
            },
            r.local_agg_s,
            r.fanout_s,
            r.node_nic_bytes_per_iter[0] / 1e6,
            r.node_nic_bytes_per_iter[1] / 1e6,
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidths_parse() {
        assert_eq!(parse_bandwidth("10gbit").unwrap(), 10e9);
        assert_eq!(parse_bandwidth("40GbE").unwrap(), 40e9);
        assert_eq!(parse_bandwidth("2.5gbit/s").unwrap(), 2.5e9);
        assert_eq!(parse_bandwidth("500mbit").unwrap(), 500e6);
        assert_eq!(parse_bandwidth("1000000").unwrap(), 1e6);
        assert!(parse_bandwidth("fast").is_err());
        assert!(parse_bandwidth("0gbit").is_err());
    }

    #[test]
    fn slices_and_the_trace_reach_the_run() {
        let d = SimArgs::default();
        let a = SimArgs {
            job: JobArgs {
                model: "vgg19-mini".into(),
                sync: SyncMode::P3,
                iters: 2,
                ..d.job.clone()
            },
            nodes: Some(2),
            trace_bin_us: Some(100.0),
            ..d
        };
        assert_eq!(SimArgs::default().slice(), 50_000);
        let r = run(&a).unwrap();
        assert_eq!(r.nic_trace.len(), 2);
        let sent: u64 = r.nic_trace[0][0].iter().sum();
        assert!(sent > 0 && r.start_s > 0.0, "{sent} {}", r.start_s);
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["nic_trace"].is_array());
        let plain = run(&SimArgs {
            trace_bin_us: None,
            ..a.clone()
        })
        .unwrap();
        assert!(plain.nic_trace.is_empty());
        assert_eq!(plain.iteration_s, r.iteration_s);
        assert!(serde_json::to_value(&plain).unwrap().get("nic_trace").is_none());
        // Smaller slices: more, smaller messages, and a different timeline.
        let small = run(&SimArgs {
            slice_params: Some(1_000),
            trace_bin_us: None,
            ..a
        })
        .unwrap();
        assert!(small.events > plain.events, "{} vs {}", small.events, plain.events);
    }

    #[test]
    fn on_loopback_the_ranks_share_the_hosts_copies_and_slices_follow_the_profile() {
        // A 2-core machine whose loopback moves 1 GB/s: 4 colocated nodes on it,
        // every one sending to every other, share that, where a NIC of their
        // own gives each its share of the cores' copies (0.5 GB/s) each way.
        let dir = std::env::temp_dir().join(format!("tw-sim-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("profile.json");
        let rates = r#"{"link_bytes_per_s":1e9,"msg_s":2e-5,"sum_bytes_per_s":4e9,"gemm_flop_per_s":3e10}"#;
        std::fs::write(&path, format!(r#"{{"cores":2,"rates":{rates},"link":"loopback"}}"#)).unwrap();
        let d = SimArgs::default();
        let a = SimArgs {
            job: JobArgs {
                model: "vgg19-mini".into(),
                sync: SyncMode::P3,
                iters: 3,
                ..d.job.clone()
            },
            nodes: Some(4),
            bandwidth: 8e9,
            profile: Some(path.clone()),
            ..d
        };
        let own = run(&a).unwrap();
        let shared = run(&SimArgs {
            loopback: true,
            ..a.clone()
        })
        .unwrap();
        assert!(
            shared.iteration_s > own.iteration_s,
            "one host's loopback {} s against a NIC each {} s",
            shared.iteration_s,
            own.iteration_s
        );
        // The slice train's launcher takes for these 4 ranks on this machine
        // (over P3's 50,000: 20 µs a message is dear here).
        let p = tidewire::calibrate::Profile::load(&path).unwrap();
        let train = tidewire_engine::cost::slice_params_for(&p.node_rates(4, None));
        assert!(train > 50_000, "{train}");
        assert_eq!(shared.slice_params, train);
        let given = run(&SimArgs {
            slice_params: Some(60_000),
            loopback: true,
            ..a
        })
        .unwrap();
        assert_eq!(given.slice_params, 60_000);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
