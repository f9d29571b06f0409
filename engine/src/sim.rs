//! A deterministic discrete-event simulation of a whole cluster. Every rank
//! is the product's own [`Node`]: the same protocol, wire encoding, flow
//! control, limits and goodbye that the runtime executes over a transport.
//!
//! - Virtual time in nanoseconds; ties break by event sequence, so a run is a
//!   pure function of its [`SimConfig`] (including the seed).
//! - The transport is modelled with its limits ([`Limits`]): a transmit
//!   beyond `max_outstanding` per connection, a message over
//!   `max_message_bytes` or a write over `max_write_bytes` is a violation.
//!   Messages on a connection arrive in order, and so do writes; the two
//!   classes are not ordered with each other, as on the real transports.
//! - Full-duplex NICs ([`crate::net`]): each rank has a transmit and a
//!   receive side of one link's bandwidth, shared fairly between the
//!   connections using it; every transfer pays the latency.
//! - Jobs run on two FIFO executors per rank (server, worker), each with a
//!   throughput model.
//! - Worker compute follows a layer-time table (forward, backward per layer).
//! - Seeded faults: random extra delays, stragglers, a dead rank (its peers
//!   see the connection fail `detect_ns` later), a partition that heals, and
//!   transport back-pressure (`WouldBlock`) on random transmits.
//! - With `values`, real f32 data moves through every rank's regions and the
//!   invariants are checked as it runs: the seeding reaches every worker, BSP
//!   values are exact after every layer's iteration, and at the end every
//!   worker holds the last iteration's sum and every chunk was applied once
//!   per iteration (BSP and SSP).
//!
//! A run that fails returns a [`SimError`] whose message starts with the seed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Duration;

use crate::book::{Book, LayerKind};
use crate::config::{ApplyOp, Consistency, SchedConfig, SyncMode, Trigger};
use crate::error::EngineError;
use crate::fxhash::{FxHashMap as HashMap, FxHashSet as HashSet};
use crate::net::Net;
use crate::node::{
    Blob, Input, Job, JobKind, Limits, Loc, LocalRegion, Node, NodeConfig, Output, Payload, Queue, SendSrc, TxOp,
    CELL_BYTES,
};
use crate::sparse::{self, EncodeReport, SparseCosts, SparseLayerStats};
use crate::wire::Kind;

/// Faults to inject.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Probability that a transfer gets an extra random delay.
    pub delay_prob: f64,
    /// Largest extra delay, ns.
    pub delay_max_ns: u64,
    /// (worker rank, compute slowdown factor).
    pub stragglers: Vec<(u32, f64)>,
    /// (rank, time ns): the rank dies then; nothing it sends or is sent arrives.
    pub dead: Option<(u32, u64)>,
    /// How long after a death its peers see their connections fail, ns.
    pub detect_ns: u64,
    /// (ranks on one side, from ns, to ns): traffic across the cut waits until `to`.
    pub partition: Option<(Vec<u32>, u64, u64)>,
    /// Probability that the transport refuses a transmit for now (`WouldBlock`).
    pub block_prob: f64,
    /// Slow spans: (worker rank, compute factor, from iteration, to
    /// iteration, exclusive). The worker's compute is multiplied by the
    /// factor in those iterations (on top of `stragglers`).
    pub slow: Vec<(u32, f64, u64, u64)>,
    /// (worker rank, iteration): the worker crashes at that iteration
    /// boundary, once its earlier iterations are synced (nothing of it is
    /// half pushed); its peers see their connections fail `detect_ns` later.
    /// Under [`Trigger::All`], or when the rank is also a server, the job
    /// must fail with an error naming it; under the other triggers the
    /// others go on.
    pub crash: Option<(u32, u64)>,
    /// With `crash`: the crashed worker comes back (a new process, a fresh
    /// Node that [`Node::rejoin`]s) this long after it crashed, ns — at
    /// least `2 × detect_ns + 1 ms`, so that its peers saw it go and the old
    /// process's traffic is gone. It takes the current parameters, is
    /// counted again, and runs the iterations it has left. Only a worker
    /// that holds no shard, under a trigger other than `All`, and only while
    /// no other worker has finished (the job still runs); otherwise it stays away.
    pub rejoin_after_ns: Option<u64>,
}

/// A simulation run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The information book (cluster, layers, sizes).
    pub book: Arc<Book>,
    /// Scheduling settings.
    pub sched: SchedConfig,
    /// What servers do with a complete chunk. The value checks need `Sum`.
    pub apply: ApplyOp,
    /// The transport's limits.
    pub limits: Limits,
    /// Per-rank limits instead of `limits` (ranks whose transports differ):
    /// a message or write must then fit both ends.
    pub rank_limits: Option<Vec<Limits>>,
    /// Whether layers are handed in as their backward ends (WFBP) or after the whole pass.
    pub wait_free: bool,
    /// Hand FC layers in by their factors even when they sync through the PS
    /// (the Node forms the gradient), as a framework with SF hooks would.
    pub fc_factors: bool,
    /// Per-layer (forward, backward) compute, ns.
    pub layer_ns: Vec<(u64, u64)>,
    /// Link bandwidth, bit/s.
    pub bandwidth_bps: f64,
    /// One-way latency per transfer, ns.
    pub latency_ns: u64,
    /// Server aggregation throughput, bytes/s.
    pub agg_bytes_per_s: f64,
    /// Local copies (seeding and broadcasts to oneself, publishing, capture), bytes/s.
    pub copy_bytes_per_s: f64,
    /// SF reconstruction GEMM throughput, FLOP/s.
    pub gemm_flops: f64,
    /// CPU time the runtime spends on each transmit it posts, ns: the
    /// sender's posts are serialized through it (one runtime thread per
    /// rank), so many small slices cost time that few large ones do not.
    /// 0 (the ideal machine) unless a calibration profile sets it.
    pub msg_ns: u64,
    /// Iterations.
    pub iters: u64,
    /// Seed for the faults.
    pub seed: u64,
    /// Faults.
    pub faults: Faults,
    /// Move real values and check them.
    pub values: bool,
    /// A run with no progress for this long fails (a liveness timeout), ns.
    pub stall_ns: u64,
    /// Rank → host (`None`: every rank on a host of its own). The ranks of a
    /// host share its NIC, and talk to each other inside it at
    /// `local_bytes_per_s`: a flat run of Nexus's learners, L ranks per node.
    pub hosts: Option<Vec<u32>>,
    /// Learners behind each worker rank (Nexus's local aggregation). The
    /// learners compute in parallel with it; before layer l goes out, the
    /// L-1 others' gradients (or factors) reach the leader and are summed,
    /// `(L-1)·bytes / local_bytes_per_s`, and once it is synced its parameters
    /// are published into the node's cache and read by the learners,
    /// `2·bytes / local_bytes_per_s`, before their next forward pass can use
    /// it. Both run on one FIFO per node, beside the compute. Set
    /// `sched.learners` to the same (the mean's divisor).
    pub local_learners: u32,
    /// Memory bandwidth between a node's learners (shared memory, PCIe or
    /// NVLink), bytes/s; also the loopback rate of `hosts`.
    pub local_bytes_per_s: f64,
    /// Fraction of nonzero gradient elements of the layers with the sparse
    /// hint ([`sparse_grad_value`]); without `values`, an encode job finds
    /// `density × len` of them.
    pub sparse_density: f64,
    /// The costs every rank's sparse/dense choice weighs (also the modelled
    /// time of encode and densify jobs).
    pub sparse: SparseCosts,
    /// Trace every NIC's bytes per bin of this many ns of virtual time
    /// ([`SimReport::nic_trace`]); `None` (the default): no trace.
    pub trace_bin_ns: Option<u64>,
}

impl SimConfig {
    /// A run of `book` in `mode` with sensible rates: 10 Gbit/s, 5 µs, 10 GB/s
    /// aggregation and copies, 5 TFLOP/s GEMM, the TCP transport's limits, no faults.
    pub fn new(book: Arc<Book>, mode: SyncMode, layer_ns: Vec<(u64, u64)>, iters: u64) -> Self {
        SimConfig {
            book,
            sched: SchedConfig {
                order: mode.order(),
                ..SchedConfig::default()
            },
            apply: ApplyOp::Sum,
            limits: Limits::default(),
            rank_limits: None,
            wait_free: mode.wait_free(),
            fc_factors: false,
            layer_ns,
            bandwidth_bps: 10e9,
            latency_ns: 5_000,
            agg_bytes_per_s: 10e9,
            copy_bytes_per_s: 10e9,
            gemm_flops: 5e12,
            msg_ns: 0,
            iters,
            seed: 1,
            faults: Faults {
                detect_ns: 1_000_000,
                ..Faults::default()
            },
            values: false,
            stall_ns: 60_000_000_000,
            hosts: None,
            local_learners: 1,
            local_bytes_per_s: 10e9,
            sparse_density: 1.0,
            sparse: SparseCosts::default(),
            trace_bin_ns: None,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct SimReport {
    /// Virtual time from the start of iteration 0 to the last layer synced, ns.
    pub total_ns: u64,
    /// `total_ns / iters`, seconds.
    pub iteration_s: f64,
    /// Time workers spent blocked waiting for layers (mean per worker per iteration), s.
    pub wait_s: f64,
    /// Largest lead of one worker's clock over another's at any hand-in.
    pub max_lead: u64,
    /// Events processed.
    pub events: u64,
    /// Value checks that passed.
    pub checks: u64,
    /// Landing slots of one worker held at one server at once, at most.
    pub max_slots_held: u32,
    /// Contributions parked for the rank order, every server together.
    pub parked: u64,
    /// Contributions that held their credit for the rank order (every spare
    /// slot of their worker parked), every server together.
    pub held_for_order: u64,
    /// Most spare slots of one worker parked at one server at once.
    pub max_spares_used: u32,
    /// Bytes in flight from one worker at once, at most.
    pub max_bytes_in_flight: usize,
    /// Transmits outstanding on one connection at once, at most.
    pub max_outstanding: usize,
    /// Largest message, bytes.
    pub max_message: u64,
    /// Largest write, bytes.
    pub max_write: u64,
    /// Factor blocks held by one worker at once, at most.
    pub max_factor_blocks: usize,
    /// `WouldBlock`s injected.
    pub blocked: u64,
    /// Virtual time when the last rank finished its goodbye, ns.
    pub goodbye_ns: u64,
    /// Per host (per rank without `hosts`): payload bytes its NIC sent and
    /// received over the whole run.
    pub nic_bytes: Vec<[u64; 2]>,
    /// Local aggregation (learners' gradients to the leader and summed), mean
    /// per worker rank per iteration, s.
    pub local_agg_s: f64,
    /// Publishing parameters to the node's learners, mean per worker rank per iteration, s.
    pub fanout_s: f64,
    /// Per layer: sparse-push counters of every worker together.
    pub sparse: Vec<SparseLayerStats>,
    /// With `values`: every worker's parameter region at the end, as bits
    /// (by worker index), for bitwise comparisons of two runs.
    pub params_bits: Vec<Vec<u32>>,
    /// Chunk applies, every server together.
    pub applies: u64,
    /// Kvstore pull requests, every worker together (0 in the other modes).
    pub pulls: u64,
    /// Crashed workers that came back.
    pub rejoined: u32,
    /// Per worker index: its slices accumulated into a round (not dropped).
    pub accumulated_by_worker: Vec<u64>,
    /// Virtual time from the start of iteration 0 to the last apply issued
    /// by any server, ns: when the model holds its last version. Under a
    /// trigger other than `all` the slowest worker may still be computing
    /// then (its late contributions are dropped or folded).
    pub updates_ns: u64,
    /// Applies with fewer contributions than live workers.
    pub partial_applies: u64,
    /// Late contributions dropped, every server together.
    pub dropped: u64,
    /// Late contributions folded into a later round.
    pub late_folded: u64,
    /// Iterations completed by each worker (by worker index) at its end.
    pub worker_iters: Vec<u64>,
    /// Per worker (by worker index): when it finished its last iteration, ns
    /// from the start (0 for a crashed one).
    pub worker_done_ns: Vec<u64>,
    /// Virtual time when iteration 0 started (after the set-up), ns from
    /// time 0: where `total_ns` and the worker times are counted from.
    pub start_ns: u64,
    /// With `trace_bin_ns`: per host (per rank without `hosts`), the bytes
    /// its NIC sent and received in each bin, `[sent, received]`, bin `i`
    /// covering `[i·bin, (i+1)·bin)` ns from time 0 (set-up included; see
    /// [`crate::net::Net::traced`]). Empty without.
    pub nic_trace: Vec<[Vec<u64>; 2]>,
}

/// Why a run failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The configuration cannot run.
    #[error("seed {seed}: invalid configuration: {error}")]
    Config { seed: u64, error: EngineError },
    /// A rank failed with a typed error (expected with a dead rank).
    #[error("seed {seed}: rank {rank} failed at {at_ns} ns: {error}")]
    Rank {
        seed: u64,
        rank: u32,
        at_ns: u64,
        error: EngineError,
    },
    /// No progress for `stall_ns` (a liveness timeout).
    #[error("seed {seed}: no progress for {stall_ms} ms of virtual time (a liveness timeout): {stuck}")]
    Stalled { seed: u64, stall_ms: u64, stuck: String },
    /// An invariant broke: a bug in the protocol or the simulator.
    #[error("seed {seed}: violation at {at_ns} ns: {what}")]
    Violation { seed: u64, at_ns: u64, what: String },
}

impl SimError {
    /// Whether this is an invariant violation (rather than a rank's typed failure or a stall).
    pub fn is_violation(&self) -> bool {
        matches!(self, SimError::Violation { .. } | SimError::Config { .. })
    }
}

/// Transfers this small or smaller skip the NIC queues (credits, acks).
pub const CONTROL_BYTES: usize = CELL_BYTES;

/// Gradient element `i` of `layer` from worker index `w` in iteration `t`:
/// small integers plus a worker-specific quarter, so every sum is exact in f32
/// and a lost or doubled contribution changes it.
pub fn grad_value(w: usize, t: u64, layer: u32, i: usize) -> f32 {
    ((w * 7 + t as usize * 3 + layer as usize * 5 + i) % 5) as f32 + 0.25 * (w as f32 + 1.0)
}

/// Gradient element `i` of a layer with the sparse hint: with probability
/// `density` (by a hash of the arguments) [`grad_value`], its negation, or
/// `-0.0` (a nonzero by its bits), and `+0.0` otherwise. Sums stay exact.
pub fn sparse_grad_value(w: usize, t: u64, layer: u32, i: usize, density: f64) -> f32 {
    let mut h = ((w as u64) << 48) ^ (t << 32) ^ (u64::from(layer) << 24) ^ i as u64;
    let x = crate::testkit::next(&mut h);
    if (x >> 11) as f64 / (1u64 << 53) as f64 >= density {
        return 0.0;
    }
    match x % 5 {
        0 => -0.0,
        1 => -grad_value(w, t, layer, i),
        _ => grad_value(w, t, layer, i),
    }
}

/// Initial value of element `i` of `layer`.
pub fn init_value(layer: u32, i: usize) -> f32 {
    ((layer as usize + i) % 3) as f32
}

/// Factor element: small integers.
pub fn factor_value(w: usize, t: u64, which: u32, i: usize) -> f32 {
    ((w + t as usize + which as usize * 2 + i) % 3) as f32
}

#[derive(Debug, Clone)]
enum Ev {
    /// The worker's compute timer: exactly one is pending per running worker.
    Step(u32),
    /// Something the worker may be blocked on changed.
    Wake(u32),
    /// An input for a rank's Node.
    Input(u32, Input),
    /// A write's bytes arrive at `to`.
    WriteArrive {
        from: u32,
        to: u32,
        token: u64,
        src: Loc,
        dst: Loc,
        len: u64,
        imm: Option<u32>,
    },
    /// A message arrives at `to`.
    MsgArrive {
        from: u32,
        to: u32,
        tag: u32,
        data: Payload,
    },
    /// A send left `from`.
    Sent { from: u32, token: u64 },
    /// A job finished on its executor.
    JobDone(u32, Job),
    /// The crash fault strikes a worker at an iteration boundary.
    Crash(u32),
    /// The crashed worker comes back.
    Rejoin(u32),
    /// A rank that left closes its connection to `to` gracefully: after
    /// everything it sent on it, like TCP's FIN.
    Fin { from: u32, to: u32 },
    /// The dead fault strikes.
    Kill(u32),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    Fwd(u32),
    Bwd(u32),
    Done,
}

#[derive(Debug)]
struct WLoop {
    phase: Phase,
    iter: u64,
    waiting: Option<(u32, u64)>,
    deferred: Vec<u32>,
    slow: f64,
    /// The slow span's factor in the current iteration.
    span: f64,
    wait_ns: u64,
    finished: Option<u64>,
    shutdown_sent: bool,
    /// A worker that came back: it starts at the model's newest iteration
    /// once it is ready.
    rejoined: bool,
}

#[derive(Debug)]
struct Rank {
    node: Node,
    /// Region memory, by `LocalRegion::ALL` index (values mode).
    mem: Vec<Vec<u8>>,
    /// Server-side state of the executor: accumulators and momentum.
    acc: Vec<Vec<f32>>,
    /// Fold groups' partial sums, shaped like `acc` (values mode, `fold_group > 1`).
    partial: Vec<Vec<f32>>,
    momentum: Vec<f32>,
    busy: [u64; 2],
    /// The runtime thread is busy posting until then ([`SimConfig::msg_ns`]).
    post_busy: u64,
    /// Transmits posted and not complete, per peer.
    posted: Vec<usize>,
    tokens: HashMap<u64, u32>,
    worker: Option<WLoop>,
    dead: bool,
    fatal: Option<(u64, EngineError)>,
    finished: Option<u64>,
    /// The Node's timer, as last scheduled.
    tick_at: Option<u64>,
    /// The node's local FIFO (aggregation, fan-out) is busy until then.
    local_busy: u64,
    /// Per layer: when its newest parameters reach the node's learners.
    local_avail: Vec<u64>,
    /// Time spent on local aggregation and on fan-out, ns.
    local_ns: [u64; 2],
    /// Trigger checks: per local chunk of this server, per worker index,
    /// slices accumulated into the round in progress, and when its first came.
    round: HashMap<u32, (Vec<u32>, u64)>,
    /// Trigger checks: applies seen per chunk of this server.
    applies_seen: HashMap<u32, u64>,
    /// Values mode: (address, length) of the factor fragments delivered to
    /// this rank and not yet reconstructed from. A reconstruction must read
    /// peers' factors in these very buffers: a copy on the way is a violation.
    delivered: HashSet<(usize, usize)>,
}

/// The simulator.
#[derive(Debug)]
pub struct Sim {
    cfg: SimConfig,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    evs: Vec<Option<Ev>>,
    free_evs: Vec<usize>,
    ranks: Vec<Rank>,
    net: Net<Ev>,
    net_out: Vec<(u64, Ev)>,
    /// Per (from, to, class: 0 writes, 1 messages): last arrival time, at
    /// `(from × world + to) × 2 + class`.
    order: Vec<u64>,
    /// Per (from, to): messages in the network, at `from × world + to`.
    msgs_in_net: Vec<usize>,
    rng: u64,
    report: SimReport,
    start: Option<u64>,
    last_progress: u64,
    /// `TIDEWIRE_SIM_TRACE=1`: every input and output on stderr.
    trace: bool,
    /// Ranks done, failed or dead.
    settled: usize,
    /// Graceful closes still in the network (the last ones outlive the run).
    fins_in_net: usize,
    /// Accumulate jobs emitted, every server together.
    accumulates: u64,
    /// The crash fault struck (once), at this iteration.
    crashed_at: Option<u64>,
    /// Pushes of worker processes that were replaced (a crash and a rejoin).
    retired_pushes: u64,
    /// Sends that left at once (control messages on an idle connection):
    /// their completions, fed after the drain that posted them.
    sent_now: Vec<(u32, u64)>,
}

fn brief_input(i: &Input) -> String {
    match i {
        Input::Message { peer, tag, data } => format!("Message from {peer} tag {tag:#x} ({} bytes)", data.len()),
        Input::JobDone { id, data } => format!("JobDone {id} ({} bytes)", data.as_ref().map_or(0, Vec::len)),
        other => format!("{other:?}"),
    }
}

fn brief_output(o: &Output) -> String {
    match o {
        Output::Transmit(t) => match &t.op {
            TxOp::Send { tag, src } => format!("Send#{} to {} tag {tag:#x} ({} bytes)", t.token, t.peer, src.len()),
            op => format!("Transmit#{} to {}: {op:?}", t.token, t.peer),
        },
        Output::Job(j) => match &j.kind {
            JobKind::Reconstruct { layer, iter, .. } => format!("Job {} Reconstruct layer {layer} iter {iter}", j.id),
            JobKind::SumFactors { layer, iter, .. } => format!("Job {} SumFactors layer {layer} iter {iter}", j.id),
            k => format!("Job {} {k:?}", j.id),
        },
        other => format!("{other:?}"),
    }
}

fn ridx(r: LocalRegion) -> usize {
    LocalRegion::ALL.iter().position(|x| *x == r).expect("listed")
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

fn put_f32s(dst: &mut [u8], v: &[f32]) {
    for (d, x) in dst.chunks_exact_mut(4).zip(v) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

/// Rank `r`'s Node, memory and worker loop, as at the start of a run.
fn make_rank(cfg: &SimConfig, r: u32) -> Result<Rank, SimError> {
    let seed = cfg.seed;
    let config = |error| SimError::Config { seed, error };
    let book = cfg.book.clone();
    let world = book.cluster().world();
    let mut nc = NodeConfig::new(book.clone(), r);
    nc.sched = cfg.sched;
    nc.apply = cfg.apply;
    nc.limits = cfg
        .rank_limits
        .as_ref()
        .and_then(|l| l.get(r as usize).copied())
        .unwrap_or(cfg.limits);
    nc.transport = "sim".into();
    nc.sparse = cfg.sparse;
    // Setup may take long in virtual time (tiny writes, many retries):
    // the liveness check is `stall_ns` without progress.
    nc.startup_timeout = Duration::from_nanos(cfg.stall_ns.saturating_mul(100));
    let mut node = Node::new(nc).map_err(config)?;
    let keys = [LocalRegion::Params, LocalRegion::Shard, LocalRegion::Landing].map(|x| {
        if node.region_bytes(x) > 0 {
            ridx(x) as u32 + 1
        } else {
            0
        }
    });
    node.set_keys(keys);
    let mem = if cfg.values {
        LocalRegion::ALL
            .iter()
            .map(|&x| vec![0u8; node.region_bytes(x) as usize])
            .collect()
    } else {
        vec![Vec::new(); LocalRegion::ALL.len()]
    };
    let n = if cfg.values { book.shard_len(r) } else { 0 };
    let role = book.cluster().role(r).expect("in the cluster");
    let worker = role.is_worker().then(|| WLoop {
        phase: Phase::Fwd(0),
        iter: 0,
        waiting: None,
        deferred: Vec::new(),
        slow: cfg.faults.stragglers.iter().find(|(w, _)| *w == r).map_or(1.0, |s| s.1),
        span: 1.0,
        wait_ns: 0,
        finished: None,
        shutdown_sent: false,
        rejoined: false,
    });
    let windows = node.windows();
    let mut rank = Rank {
        node,
        mem,
        acc: vec![vec![0.0; n]; windows],
        partial: if cfg.values && cfg.sched.fold_group > 1 {
            vec![vec![0.0; n]; windows]
        } else {
            Vec::new()
        },
        momentum: if cfg.apply.needs_momentum() {
            vec![0.0; n]
        } else {
            Vec::new()
        },
        busy: [0; 2],
        post_busy: 0,
        posted: vec![0; world],
        tokens: HashMap::default(),
        worker,
        dead: false,
        fatal: None,
        finished: None,
        tick_at: None,
        local_busy: 0,
        local_avail: vec![0; book.layers().len()],
        local_ns: [0; 2],
        round: HashMap::default(),
        applies_seen: HashMap::default(),
        delivered: HashSet::default(),
    };
    if cfg.values && role.is_worker() {
        // Every worker fills its parameters; rank 0's values reach everyone.
        // Parameters are contiguous here (no caller layout): layer l at its flat offset.
        for (l, spec) in book.layers().iter().enumerate() {
            let off = book.layer_offset(l as u32) * 4;
            let v: Vec<f32> = (0..spec.params()).map(|i| init_value(l as u32, i)).collect();
            put_f32s(&mut rank.mem[ridx(LocalRegion::Params)][off..off + v.len() * 4], &v);
        }
    }
    Ok(rank)
}

const EVENT_BUDGET: u64 = 400_000_000;

impl Sim {
    /// Runs a simulation to the end.
    pub fn run(cfg: SimConfig) -> Result<SimReport, SimError> {
        let mut sim = Sim::new(cfg)?;
        sim.go()?;
        Ok(sim.report)
    }

    fn new(mut cfg: SimConfig) -> Result<Self, SimError> {
        cfg.sched = cfg.sched.resolve(&cfg.book);
        let seed = cfg.seed;
        let config = |error| SimError::Config { seed, error };
        let book = cfg.book.clone();
        if cfg.layer_ns.len() != book.layers().len() {
            return Err(config(EngineError::InvalidConfig(format!(
                "{} layer times for {} layers",
                cfg.layer_ns.len(),
                book.layers().len()
            ))));
        }
        let world = book.cluster().world();
        let mut ranks = Vec::with_capacity(world);
        for r in 0..world as u32 {
            ranks.push(make_rank(&cfg, r)?);
        }
        let hosts = match &cfg.hosts {
            Some(h) if h.len() == world => h.clone(),
            Some(h) => {
                return Err(SimError::Config {
                    seed: cfg.seed,
                    error: EngineError::InvalidConfig(format!("{} hosts given for {world} ranks", h.len())),
                })
            }
            None => (0..world as u32).collect(),
        };
        if cfg.local_learners == 0 || cfg.local_bytes_per_s.is_nan() || cfg.local_bytes_per_s <= 0.0 {
            return Err(SimError::Config {
                seed: cfg.seed,
                error: EngineError::InvalidConfig("local_learners ≥ 1 and local_bytes_per_s > 0".into()),
            });
        }
        let mut net = Net::with_hosts(hosts, cfg.bandwidth_bps, cfg.latency_ns, cfg.local_bytes_per_s);
        if let Some(bin) = cfg.trace_bin_ns {
            net.trace(bin);
        }
        Ok(Sim {
            rng: cfg.seed ^ 0x9e37_79b9_7f4a_7c15,
            cfg,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            evs: Vec::new(),
            free_evs: Vec::new(),
            ranks,
            net,
            net_out: Vec::new(),
            order: vec![0; world * world * 2],
            msgs_in_net: vec![0; world * world],
            report: SimReport::default(),
            start: None,
            last_progress: 0,
            trace: std::env::var_os("TIDEWIRE_SIM_TRACE").is_some(),
            settled: 0,
            fins_in_net: 0,
            accumulates: 0,
            crashed_at: None,
            retired_pushes: 0,
            sent_now: Vec::new(),
        })
    }

    fn rand(&mut self) -> u64 {
        crate::testkit::next(&mut self.rng)
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.rand() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        let idx = match self.free_evs.pop() {
            Some(i) => {
                self.evs[i] = Some(ev);
                i
            }
            None => {
                self.evs.push(Some(ev));
                self.evs.len() - 1
            }
        };
        self.queue.push(Reverse((t, self.seq, idx)));
    }

    fn violation(&self, what: String) -> SimError {
        SimError::Violation {
            seed: self.cfg.seed,
            at_ns: self.now,
            what,
        }
    }

    fn go(&mut self) -> Result<(), SimError> {
        let world = self.ranks.len() as u32;
        if let Some((r, t)) = self.cfg.faults.dead {
            if r < world {
                self.at(t, Ev::Kill(r));
            }
        }
        if let Some((r, _)) = self.cfg.faults.crash {
            if self.cfg.book.cluster().worker_index(r).is_none() {
                return Err(SimError::Config {
                    seed: self.cfg.seed,
                    error: EngineError::InvalidConfig(format!("the crash fault names rank {r}, which is not a worker")),
                });
            }
        }
        for r in 0..world {
            for p in (0..world).filter(|&p| p != r) {
                self.at(0, Ev::Input(r, Input::Connected { peer: p }));
            }
            if self.ranks[r as usize].worker.is_some() {
                self.at(0, Ev::Step(r));
            } else {
                self.at(0, Ev::Input(r, Input::Shutdown));
            }
            // A rank alone has no connection to wait for.
            self.at(0, Ev::Input(r, Input::Tick));
        }
        loop {
            // The network's timers run before the cluster's events of the same time.
            let next_ev = self.queue.peek().map(|Reverse((t, _, _))| *t);
            let next_net = self.net.next_time();
            let t = match (next_ev, next_net) {
                (None, None) => break,
                (Some(a), Some(b)) => a.min(b),
                (a, b) => a.or(b).expect("one is set"),
            };
            if t.saturating_sub(self.last_progress) > self.cfg.stall_ns {
                break;
            }
            if self.all_settled() {
                break;
            }
            self.now = t;
            if next_net == Some(t) {
                let mut out = std::mem::take(&mut self.net_out);
                self.net.advance(t, &mut out);
                for (at, ev) in out.drain(..) {
                    self.arrival(at, ev, true);
                }
                self.net_out = out;
                continue;
            }
            let Some(Reverse((_, _, idx))) = self.queue.pop() else {
                break;
            };
            self.report.events += 1;
            if self.report.events > EVENT_BUDGET {
                return Err(self.violation("event budget exhausted (a livelock?)".into()));
            }
            let ev = self.evs[idx].take().expect("each event runs once");
            self.free_evs.push(idx);
            self.handle(ev)?;
        }
        self.finish()
    }

    /// Every rank is done, failed or dead.
    fn all_settled(&self) -> bool {
        self.settled == self.ranks.len()
    }

    /// Counts a rank that just became done, failed or dead (once).
    fn settle(&mut self, r: u32) {
        let rank = &self.ranks[r as usize];
        let n = usize::from(rank.dead) + usize::from(rank.fatal.is_some()) + usize::from(rank.finished.is_some());
        if n == 1 {
            self.settled += 1;
        }
    }

    fn finish(&mut self) -> Result<(), SimError> {
        let seed = self.cfg.seed;
        // A rank's typed failure, earliest first (a dead peer makes the others fail).
        if let Some((r, (at, e))) = self
            .ranks
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.fatal.clone().map(|f| (i, f)))
            .min_by_key(|(i, (at, _))| (*at, *i))
        {
            return Err(SimError::Rank {
                seed,
                rank: r as u32,
                at_ns: at,
                error: e,
            });
        }
        let stuck: Vec<String> = self
            .ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.dead && r.finished.is_none())
            .map(|(i, r)| match &r.worker {
                Some(w) => format!("rank {i} in iteration {} {:?}", w.iter, w.phase),
                None => format!("rank {i} (server)"),
            })
            .collect();
        if !stuck.is_empty() {
            return Err(SimError::Stalled {
                seed,
                stall_ms: self.cfg.stall_ns / 1_000_000,
                stuck: stuck.join(", "),
            });
        }
        if self.net.in_flight() > self.fins_in_net {
            return Err(self.violation(format!(
                "{} transfers still in the network after every rank left",
                self.net.in_flight() - self.fins_in_net
            )));
        }
        let end = self
            .ranks
            .iter()
            .filter_map(|r| r.worker.as_ref()?.finished)
            .max()
            .unwrap_or(0);
        let start = self.start.unwrap_or(0);
        self.report.total_ns = end.saturating_sub(start);
        self.report.goodbye_ns = self.ranks.iter().filter_map(|r| r.finished).max().unwrap_or(0);
        self.report.iteration_s = self.report.total_ns as f64 / 1e9 / self.cfg.iters.max(1) as f64;
        let workers: Vec<&WLoop> = self.ranks.iter().filter_map(|r| r.worker.as_ref()).collect();
        let n = workers.len() as f64 * self.cfg.iters.max(1) as f64;
        self.report.wait_s = workers.iter().map(|w| w.wait_ns as f64).sum::<f64>() / 1e9 / n;
        let local = |i: usize| self.ranks.iter().map(|r| r.local_ns[i] as f64).sum::<f64>() / 1e9 / n;
        self.report.local_agg_s = local(0);
        self.report.fanout_s = local(1);
        self.report.nic_bytes = (0..self.net.hosts()).map(|h| self.net.nic_bytes(h)).collect();
        self.report.start_ns = self.start.unwrap_or(0);
        if let Some((_, t)) = self.net.traced() {
            let bytes = |v: &[f64]| v.iter().map(|b| b.round() as u64).collect::<Vec<u64>>();
            self.report.nic_trace = t.iter().map(|[tx, rx]| [bytes(tx), bytes(rx)]).collect();
        }
        let start = self.start.unwrap_or(0);
        for r in &self.ranks {
            if let Some(w) = &r.worker {
                self.report.worker_iters.push(w.iter);
                self.report.worker_done_ns.push(if r.dead {
                    0
                } else {
                    w.finished.unwrap_or(0).saturating_sub(start)
                });
            }
            let s = r.node.stats();
            self.report.applies += s.applies;
            self.report.pulls += s.pulls;
            self.report.partial_applies += s.partial_applies;
            self.report.dropped += s.dropped;
            self.report.late_folded += s.late_folded;
            self.report.max_slots_held = self.report.max_slots_held.max(s.max_slots_held);
            self.report.parked += s.parked;
            self.report.held_for_order += s.held_for_order;
            self.report.max_spares_used = self.report.max_spares_used.max(s.max_spares_used);
            self.report.max_bytes_in_flight = self.report.max_bytes_in_flight.max(s.max_bytes_in_flight);
            self.report.max_outstanding = self.report.max_outstanding.max(s.max_outstanding);
            self.report.max_message = self.report.max_message.max(s.max_message);
            self.report.max_write = self.report.max_write.max(s.max_write);
            self.report.max_factor_blocks = self.report.max_factor_blocks.max(s.max_factor_blocks);
            let st = r.node.sparse_stats();
            self.report.sparse.resize(st.len(), SparseLayerStats::default());
            for (a, b) in self.report.sparse.iter_mut().zip(st) {
                a.add(b);
            }
        }
        if self.cfg.values {
            self.report.params_bits = self
                .ranks
                .iter()
                .filter(|r| r.worker.is_some())
                .map(|r| {
                    f32s(&r.mem[ridx(LocalRegion::Params)])
                        .iter()
                        .map(|v| v.to_bits())
                        .collect()
                })
                .collect();
        }
        self.check_end()
    }

    /// After a clean goodbye: every chunk applied once per iteration, and with
    /// values every worker holds the last iteration's sum (BSP and SSP).
    fn check_end(&mut self) -> Result<(), SimError> {
        let book = self.cfg.book.clone();
        let iters = self.cfg.iters;
        let trigger = self.cfg.sched.trigger;
        // Every push was either accumulated or dropped, once.
        let (mut pushes, mut accumulated, mut dropped) = (self.retired_pushes, 0, 0);
        for r in &self.ranks {
            let s = r.node.stats();
            pushes += s.pushes;
            accumulated += s.accumulated;
            dropped += s.dropped;
        }
        if pushes != accumulated + dropped || accumulated != self.accumulates {
            return Err(self.violation(format!(
                "{pushes} pushes, {accumulated} accumulated ({} accumulate jobs seen), {dropped} dropped",
                self.accumulates
            )));
        }
        if matches!(trigger, Trigger::All | Trigger::Async) && dropped != 0 {
            return Err(self.violation(format!(
                "{dropped} contributions dropped under the {} trigger",
                trigger.name()
            )));
        }
        // Every live worker holds all its landing-slot credits again.
        let all = self.cfg.sched.slots as usize * book.p2();
        for (i, r) in self.ranks.iter().enumerate() {
            if let (false, Some(n)) = (r.dead, r.node.free_credits()) {
                if n != all {
                    return Err(self.violation(format!(
                        "rank {i} holds {n} landing-slot credits at the end, of {all} (a credit was not returned)"
                    )));
                }
            }
        }
        for (c, ch) in book.chunks().iter().enumerate() {
            if !book.scheme(ch.layer, 0).server_held() {
                continue;
            }
            let got = self.ranks[ch.server as usize].node.applied(c as u32);
            let ok = match (trigger, got) {
                (Trigger::Async, Some(n)) => n >= iters && n <= iters * book.p1() as u64,
                _ => got == Some(iters),
            };
            if !ok {
                return Err(self.violation(format!(
                    "chunk {c} was applied {got:?} times over {iters} iterations (lost or doubled contributions)"
                )));
            }
        }
        if !self.cfg.values || self.cfg.apply != ApplyOp::Sum || iters == 0 || trigger != Trigger::All {
            return Ok(());
        }
        for r in 0..self.ranks.len() {
            // A rank that died after its goodbye stopped receiving: nothing to check there.
            if self.ranks[r].worker.is_none() || self.ranks[r].dead {
                continue;
            }
            for l in 0..book.layers().len() as u32 {
                let off = self.params_offset(r, l, false);
                self.check_values(r, l, iters - 1, LocalRegion::Params, off)?;
            }
        }
        Ok(())
    }

    /// Byte offset of layer `l` in rank `r`'s Params region (or its caller view).
    fn params_offset(&self, r: usize, l: u32, view: bool) -> u64 {
        let node = &self.ranks[r].node;
        if view || !node.is_staged() {
            node.layer_locs(l).expect("worker").0.offset
        } else {
            self.cfg.book.layer_offset(l) as u64 * 4
        }
    }

    fn expected(&self, l: u32, iter: u64, i: usize) -> f64 {
        let book = &self.cfg.book;
        let spec = &book.layers()[l as usize];
        let p1 = book.p1();
        if self.by_factors(l, iter) {
            let k = book.config().batch;
            let (row, col) = (i / spec.n, i % spec.n);
            (0..p1)
                .map(|wi| {
                    (0..k)
                        .map(|kk| {
                            factor_value(wi, iter, 0, kk * spec.m + row) as f64
                                * factor_value(wi, iter, 1, kk * spec.n + col) as f64
                        })
                        .sum::<f64>()
                })
                .sum()
        } else {
            (0..p1).map(|wi| self.grad(wi, iter, l, i) as f64).sum()
        }
    }

    /// Worker `wi`'s gradient element `i` of layer `l` in `iter`.
    fn grad(&self, wi: usize, iter: u64, l: u32, i: usize) -> f32 {
        if self.cfg.book.layers()[l as usize].sparse {
            sparse_grad_value(wi, iter, l, i, self.cfg.sparse_density)
        } else {
            grad_value(wi, iter, l, i)
        }
    }

    /// Whether layer `l` is handed in by its factors in `iter`.
    fn by_factors(&self, l: u32, iter: u64) -> bool {
        let book = &self.cfg.book;
        book.layers()[l as usize].kind == LayerKind::Fc && (self.cfg.fc_factors || book.scheme(l, iter).takes_factors())
    }

    fn check_values(&mut self, r: usize, l: u32, iter: u64, region: LocalRegion, off: u64) -> Result<(), SimError> {
        let n = self.cfg.book.layers()[l as usize].params();
        let m = &self.ranks[r].mem[ridx(region)];
        let got = f32s(&m[off as usize..off as usize + n * 4]);
        for (i, g) in got.iter().enumerate() {
            let want = self.expected(l, iter, i);
            if f64::from(*g) != want {
                return Err(self.violation(format!(
                    "rank {r} layer {l} element {i} after iteration {iter}: {g} != {want} (lost or doubled contribution)"
                )));
            }
        }
        self.report.checks += 1;
        Ok(())
    }

    fn dead(&self, rank: u32) -> bool {
        self.ranks[rank as usize].dead
    }

    fn handle(&mut self, ev: Ev) -> Result<(), SimError> {
        match ev {
            Ev::Step(r) => self.step(r)?,
            Ev::Wake(r) => {
                let w = self.ranks[r as usize].worker.as_ref().expect("worker");
                if w.waiting.is_some() || w.phase == Phase::Done {
                    self.step(r)?;
                }
            }
            Ev::Input(r, input) => self.feed(r, input)?,
            Ev::WriteArrive {
                from,
                to,
                token,
                src,
                dst,
                len,
                imm,
            } => {
                if self.dead(to) || self.dead(from) {
                    return Ok(());
                }
                if self.cfg.values {
                    let data = self.ranks[from as usize].mem[ridx(src.region)]
                        [src.offset as usize..(src.offset + len) as usize]
                        .to_vec();
                    let end = (dst.offset + len) as usize;
                    let have = self.ranks[to as usize].mem[ridx(dst.region)].len();
                    if end > have {
                        return Err(self.violation(format!(
                            "rank {from} wrote {len} bytes at {} into rank {to}'s {:?} of {have} bytes",
                            dst.offset, dst.region
                        )));
                    }
                    self.ranks[to as usize].mem[ridx(dst.region)][dst.offset as usize..end].copy_from_slice(&data);
                }
                if let Some(imm) = imm {
                    self.feed(
                        to,
                        Input::Landed {
                            peer: from,
                            region: dst.region,
                            offset: dst.offset,
                            len,
                            imm,
                        },
                    )?;
                }
                // The writer learns of the placement one latency later.
                let at = self.now + self.cfg.latency_ns;
                self.at(at, Ev::Input(from, Input::Done { token }));
            }
            Ev::MsgArrive { from, to, tag, data } => {
                if !self.dead(to) && !self.dead(from) {
                    if let (true, Payload::Bytes(b)) = (tag == Kind::FactorData.tag(), &data) {
                        self.ranks[to as usize].delivered.insert((b.as_ptr() as usize, b.len()));
                    }
                    self.feed(to, Input::Message { peer: from, tag, data })?;
                }
            }
            Ev::Fin { from, to } => {
                if !self.dead(to) {
                    self.feed(
                        to,
                        Input::Closed {
                            peer: from,
                            error: None,
                        },
                    )?;
                }
            }
            Ev::Sent { from, token } => {
                if !self.dead(from) {
                    self.feed(from, Input::Done { token })?;
                }
            }
            Ev::JobDone(r, job) => {
                if self.dead(r) {
                    return Ok(());
                }
                let data = self.execute(r, &job)?;
                self.feed(r, Input::JobDone { id: job.id, data })?;
            }
            Ev::Crash(r) => {
                let w = self.ranks[r as usize].worker.as_ref().expect("a worker");
                let nl = self.cfg.book.layers().len() as u32;
                let busy = (0..nl).any(|l| self.ranks[r as usize].node.is_in_flight(l));
                if self.dead(r) || w.phase == Phase::Done {
                    return Ok(());
                }
                if busy {
                    // Its last iteration is still syncing: crash once it is.
                    let at = self.now + 10_000;
                    self.at(at, Ev::Crash(r));
                    return Ok(());
                }
                self.crashed_at = Some(w.iter);
                self.handle(Ev::Kill(r))?;
                if let Some(after) = self.cfg.faults.rejoin_after_ns {
                    let after = after.max(2 * self.cfg.faults.detect_ns + 1_000_000);
                    let at = self.now + after;
                    self.at(at, Ev::Rejoin(r));
                }
            }
            Ev::Rejoin(r) => self.rejoin(r)?,
            Ev::Kill(r) => {
                if !self.ranks[r as usize].dead {
                    self.ranks[r as usize].dead = true;
                    self.settle(r);
                }
                let detect = self.now + self.cfg.faults.detect_ns;
                for p in 0..self.ranks.len() as u32 {
                    if p != r {
                        self.at(
                            detect,
                            Ev::Input(
                                p,
                                Input::Closed {
                                    peer: r,
                                    error: Some(format!("connection reset: rank {r} died")),
                                },
                            ),
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// A delivery, in per-connection order of its class. `from_net`: it
    /// went through the NIC queues (rather than the control shortcut).
    fn arrival(&mut self, at: u64, ev: Ev, from_net: bool) {
        let world = self.ranks.len();
        let key = match &ev {
            Ev::WriteArrive { from, to, .. } => (*from as usize * world + *to as usize) * 2,
            Ev::MsgArrive { from, to, .. } => {
                let c = *from as usize * world + *to as usize;
                if from_net {
                    self.msgs_in_net[c] -= 1;
                }
                c * 2 + 1
            }
            Ev::Fin { from, to } => {
                // After every write and message on the connection.
                self.fins_in_net -= 1;
                let c = *from as usize * world + *to as usize;
                let at = at.max(self.order[c * 2]).max(self.order[c * 2 + 1]);
                self.order[c * 2 + 1] = at;
                self.at(at, ev);
                return;
            }
            _ => {
                self.at(at, ev);
                return;
            }
        };
        let at = at.max(self.order[key]);
        self.order[key] = at;
        self.at(at, ev);
    }

    /// Feeds an input to a rank's Node and executes what comes out.
    fn feed(&mut self, r: u32, input: Input) -> Result<(), SimError> {
        let rank = &mut self.ranks[r as usize];
        if rank.dead || rank.fatal.is_some() {
            return Ok(());
        }
        if self.trace {
            eprintln!("{:>12} r{r} <- {}", self.now, brief_input(&input));
        }
        if let Input::Done { token } | Input::Blocked { token } = &input {
            if let Some(p) = rank.tokens.remove(token) {
                rank.posted[p as usize] -= 1;
            }
        }
        let now = Duration::from_nanos(self.now);
        // Kept for the report of a refusal; a message's bytes go to the Node
        // as they are (moved: the receive path copies nothing, see `delivered`).
        let shown = match &input {
            Input::Message { peer, tag, data } => Input::Message {
                peer: *peer,
                tag: *tag,
                data: Payload::Opaque(data.len()),
            },
            other => other.clone(),
        };
        if let Err(e) = rank.node.handle(now, input) {
            return Err(self.violation(format!("rank {r} refused {shown:?}: {e}")));
        }
        self.drain(r)
    }

    fn drain(&mut self, r: u32) -> Result<(), SimError> {
        let mut blocked: HashSet<u32> = HashSet::default();
        let mut refused: Vec<u64> = Vec::new();
        while let Some(out) = self.ranks[r as usize].node.poll_output() {
            self.last_progress = self.now;
            if self.trace {
                eprintln!("{:>12} r{r} -> {}", self.now, brief_output(&out));
            }
            match out {
                Output::Transmit(t) => {
                    let peer = t.peer;
                    if blocked.contains(&peer) || self.chance(self.cfg.faults.block_prob) {
                        blocked.insert(peer);
                        self.report.blocked += 1;
                        let rank = &mut self.ranks[r as usize];
                        rank.posted[peer as usize] += 1;
                        rank.tokens.insert(t.token, peer);
                        refused.push(t.token);
                        continue;
                    }
                    self.transmit(r, t)?;
                }
                Output::Job(job) => {
                    self.check_trigger(r, &job)?;
                    let q = match job.queue {
                        Queue::Server => 0,
                        Queue::Worker => 1,
                    };
                    let dt = self.job_ns(&job);
                    let rank = &mut self.ranks[r as usize];
                    let start = self.now.max(rank.busy[q]);
                    rank.busy[q] = start + dt;
                    self.at(start + dt, Ev::JobDone(r, job));
                }
                Output::PeerKeys { peer, .. } => {
                    self.at(self.now, Ev::Input(r, Input::PeerRegionsKnown { peer }));
                }
                Output::LayerReady { layer, iter } => {
                    if self.cfg.values
                        && self.cfg.sched.consistency == Consistency::Bsp
                        && self.cfg.sched.trigger == Trigger::All
                        && self.cfg.apply == ApplyOp::Sum
                    {
                        let off = self.params_offset(r as usize, layer, true);
                        let region = if self.ranks[r as usize].node.is_staged() {
                            LocalRegion::View
                        } else {
                            LocalRegion::Params
                        };
                        self.check_values(r as usize, layer, iter, region, off)?;
                    }
                    let nl = self.cfg.book.layers().len() as u32;
                    let fan = if self.cfg.local_learners > 1 {
                        let bytes = self.cfg.book.layers()[layer as usize].params() as f64 * 4.0;
                        (2.0 * bytes / self.cfg.local_bytes_per_s * 1e9) as u64
                    } else {
                        0
                    };
                    let now = self.now;
                    let rank = &mut self.ranks[r as usize];
                    let avail = if fan > 0 {
                        let start = now.max(rank.local_busy);
                        rank.local_busy = start + fan;
                        rank.local_ns[1] += fan;
                        start + fan
                    } else {
                        now
                    };
                    rank.local_avail[layer as usize] = rank.local_avail[layer as usize].max(avail);
                    let synced = (0..nl).all(|l| !rank.node.is_in_flight(l));
                    let w = rank.worker.as_mut().expect("worker");
                    if w.phase == Phase::Done && w.finished.is_none() && synced {
                        w.finished = Some(avail.max(rank.local_busy));
                    }
                    if matches!(w.waiting, Some((l, _)) if l == layer) {
                        self.at(avail, Ev::Wake(r));
                    }
                }
                Output::Ready => {
                    // Under the other triggers, a worker ready late may start
                    // from a version the others already made: no seeding check.
                    if self.cfg.values
                        && self.ranks[r as usize].worker.is_some()
                        && self.cfg.sched.trigger == Trigger::All
                    {
                        self.check_seeding(r as usize)?;
                    }
                    if self.ranks[r as usize].worker.as_ref().is_some_and(|w| w.rejoined) {
                        // A worker that came back goes on from the model's
                        // newest iteration (each chunk counts its pushes from
                        // where it was when the worker came back: never past
                        // the job's last round).
                        let book = self.cfg.book.clone();
                        let newest = (0..book.chunks().len() as u32)
                            .filter_map(|c| self.ranks[book.chunks()[c as usize].server as usize].node.applied(c))
                            .max()
                            .unwrap_or(0);
                        let iters = self.cfg.iters;
                        let w = self.ranks[r as usize].worker.as_mut().expect("a worker");
                        w.iter = w.iter.max(newest).min(iters);
                        if w.iter == iters {
                            w.phase = Phase::Done;
                        }
                    }
                    if self.ranks[r as usize].worker.is_some() {
                        self.at(self.now, Ev::Wake(r));
                    }
                }
                Output::Finished => {
                    if self.ranks[r as usize].finished.is_none() {
                        self.ranks[r as usize].finished = Some(self.now);
                        self.settle(r);
                        // The rank leaves: it closes its connections gracefully.
                        for p in (0..self.ranks.len() as u32).filter(|&p| p != r) {
                            if !self.dead(p) {
                                self.fins_in_net += 1;
                                self.net.send(self.now, r, p, 1, Ev::Fin { from: r, to: p }, None, 0);
                            }
                        }
                    }
                }
                Output::Fatal(e) => {
                    if self.ranks[r as usize].fatal.is_none() {
                        self.ranks[r as usize].fatal = Some((self.now, e));
                        self.settle(r);
                    }
                }
            }
        }
        // This drain's sends that completed at once (only this rank's: a drain
        // posts for its own rank), taken before feeding anything back.
        let done_now = std::mem::take(&mut self.sent_now);
        // Refusals go back before any other input, as the runtime reports them.
        for token in refused {
            self.feed(r, Input::Blocked { token })?;
        }
        for (_, token) in done_now {
            self.feed(r, Input::Done { token })?;
        }
        // The Node's timer (retries after back-pressure, the setup deadline).
        let rank = &mut self.ranks[r as usize];
        if let Some(t) = rank.node.poll_timeout() {
            let t = (t.as_nanos() as u64).max(self.now);
            if rank.tick_at != Some(t) {
                rank.tick_at = Some(t);
                self.at(t, Ev::Input(r, Input::Tick));
            }
        }
        Ok(())
    }

    /// After setup, every worker's view holds rank 0's initial values.
    fn check_seeding(&mut self, r: usize) -> Result<(), SimError> {
        let book = self.cfg.book.clone();
        for (l, spec) in book.layers().iter().enumerate() {
            let off = self.params_offset(r, l as u32, true) as usize;
            let region = if self.ranks[r].node.is_staged() {
                LocalRegion::View
            } else {
                LocalRegion::Params
            };
            let got = f32s(&self.ranks[r].mem[ridx(region)][off..off + spec.params() * 4]);
            if let Some(i) = (0..spec.params()).find(|&i| got[i] != init_value(l as u32, i)) {
                return Err(self.violation(format!(
                    "rank {r} layer {l} element {i} after seeding: {} != {}",
                    got[i],
                    init_value(l as u32, i)
                )));
            }
        }
        self.report.checks += 1;
        Ok(())
    }

    /// The crashed worker `r` comes back: a new process with a fresh Node
    /// that rejoins, at the iteration it crashed in.
    fn rejoin(&mut self, r: u32) -> Result<(), SimError> {
        let role = self.cfg.book.cluster().role(r).expect("in the cluster");
        let running = self
            .ranks
            .iter()
            .all(|x| x.finished.is_none() && x.worker.as_ref().map_or(true, |w| !w.shutdown_sent || x.dead));
        if self.cfg.sched.trigger == Trigger::All || role.is_server() || !running || !self.dead(r) {
            return Ok(());
        }
        let iter = self.crashed_at.expect("it crashed");
        self.retired_pushes += self.ranks[r as usize].node.stats().pushes;
        let mut rank = make_rank(&self.cfg, r)?;
        let (seed, now) = (self.cfg.seed, self.now);
        rank.node.rejoin().map_err(|error| SimError::Rank {
            seed,
            rank: r,
            at_ns: now,
            error,
        })?;
        let w = rank.worker.as_mut().expect("a worker");
        w.iter = iter;
        w.rejoined = true;
        self.ranks[r as usize] = rank;
        self.settled -= 1;
        // What the others posted to the old process never completes: their
        // Nodes dropped it with the connection.
        for x in &mut self.ranks {
            x.posted[r as usize] = 0;
            x.tokens.retain(|_, p| *p != r);
        }
        self.report.rejoined += 1;
        for p in (0..self.ranks.len() as u32).filter(|&p| p != r) {
            if !self.dead(p) {
                self.at(self.now, Ev::Input(p, Input::Connected { peer: r }));
                self.at(self.now, Ev::Input(r, Input::Connected { peer: p }));
            }
        }
        self.at(self.now, Ev::Step(r));
        self.at(self.now, Ev::Input(r, Input::Tick));
        Ok(())
    }

    /// The aggregation trigger's semantics, checked on every job a server
    /// emits, from what the simulator saw (not the server's own counters):
    /// applies of a chunk come once per iteration, in order; no worker's
    /// contribution is half in; the apply divides by the gradients in it;
    /// `All` takes every worker, `Quorum(k)` at least k, `Async` at least
    /// one, and `Timeout(d)` every live worker or else no earlier than `d`
    /// after the round's first contribution.
    fn check_trigger(&mut self, r: u32, job: &Job) -> Result<(), SimError> {
        let book = self.cfg.book.clone();
        let p1 = book.p1();
        match &job.kind {
            JobKind::Accumulate { chunk, src, .. } => {
                self.accumulates += 1;
                let wi = if src.region == LocalRegion::Landing {
                    let slot_bytes = book.max_slice_len() as u64 * 4;
                    (src.offset / (u64::from(self.cfg.sched.landing_slots()) * slot_bytes)) as usize
                } else {
                    book.cluster()
                        .worker_index(r)
                        .expect("a local push comes from this rank's worker")
                };
                let now = self.now;
                let e = self.ranks[r as usize]
                    .round
                    .entry(*chunk)
                    .or_insert_with(|| (vec![0; p1], now));
                if e.0.iter().all(|&c| c == 0) {
                    e.1 = now;
                }
                e.0[wi] += 1;
                let by = &mut self.report.accumulated_by_worker;
                by.resize(p1, 0);
                by[wi] += 1;
            }
            JobKind::SumFactors { layer, factors, .. } => {
                // Adam: every worker's whole contribution to each of the
                // layer's chunks at once (one factor block per worker).
                if factors.len() != p1 {
                    return Err(self.violation(format!(
                        "layer {layer}: a sum of {} factor blocks, of {p1} workers",
                        factors.len()
                    )));
                }
                let now = self.now;
                for c in book.layer_chunks(*layer) {
                    let n = book.chunk_slices(c).len() as u32;
                    let e = self.ranks[r as usize]
                        .round
                        .entry(c)
                        .or_insert_with(|| (vec![0; p1], now));
                    for x in e.0.iter_mut() {
                        *x += n;
                    }
                }
            }
            JobKind::Apply {
                chunk, iter, gradients, ..
            } => {
                self.report.updates_ns = self.now.saturating_sub(self.start.unwrap_or(0));
                let seen = self.ranks[r as usize].applies_seen.entry(*chunk).or_insert(0);
                if *iter != *seen {
                    let s = *seen;
                    return Err(self.violation(format!(
                        "chunk {chunk} applied for iteration {iter} after {s} applies (applied twice or skipped)"
                    )));
                }
                *seen += 1;
                let (counts, t0) = self.ranks[r as usize]
                    .round
                    .remove(chunk)
                    .unwrap_or((vec![0; p1], self.now));
                if self.cfg.sched.consistency != Consistency::Bsp {
                    return Ok(());
                }
                let n = book.chunk_slices(*chunk).len() as u32;
                if let Some(wi) = counts.iter().position(|&c| c % n != 0) {
                    return Err(self.violation(format!(
                        "chunk {chunk} iteration {iter} applied with {} of the {n} slices of worker {wi}'s contribution",
                        counts[wi]
                    )));
                }
                let contributions: u32 = counts.iter().sum::<u32>() / n;
                if *gradients != contributions * self.cfg.sched.learners {
                    return Err(self.violation(format!(
                        "chunk {chunk} iteration {iter}: the apply divides by {gradients} gradients, the sum holds {contributions} contributions × {} learners",
                        self.cfg.sched.learners
                    )));
                }
                let workers = book.cluster().workers();
                let complete = counts.iter().filter(|&&c| c >= n).count();
                // A worker that came back counts from when it is ready (the
                // servers count it a little earlier, when it connected: a
                // weaker check in between, never a false alarm).
                let live_w = |w: u32| {
                    let x = &self.ranks[w as usize];
                    !x.dead && (!x.worker.as_ref().is_some_and(|l| l.rejoined) || x.node.is_ready())
                };
                let live = workers.iter().filter(|&&w| live_w(w)).count();
                let live_in = (0..p1).filter(|&i| counts[i] >= n && live_w(workers[i])).count();
                let ok = match self.cfg.sched.trigger {
                    Trigger::All => counts.iter().all(|&c| c == n),
                    Trigger::Quorum(k) => complete >= k as usize,
                    Trigger::Async => complete >= 1,
                    Trigger::Timeout(d) => complete >= 1 && (live_in >= live || self.now >= t0 + d.as_nanos() as u64),
                };
                if !ok {
                    return Err(self.violation(format!(
                        "chunk {chunk} iteration {iter} applied with contributions {counts:?} (of {n} slices each), {} ns after the round's first, under the {} trigger",
                        self.now - t0,
                        self.cfg.sched.trigger.name()
                    )));
                }
                // Counted as value checks where no value is checked (the
                // other triggers); under `all` the values are, as before.
                if self.cfg.sched.trigger != Trigger::All {
                    self.report.checks += 1;
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn limits_of(&self, r: u32) -> Limits {
        self.cfg
            .rank_limits
            .as_ref()
            .and_then(|l| l.get(r as usize).copied())
            .unwrap_or(self.cfg.limits)
    }

    fn transmit(&mut self, r: u32, t: crate::node::Transmit) -> Result<(), SimError> {
        let peer = t.peer;
        let (mine, theirs) = (self.limits_of(r), self.limits_of(peer));
        // The sender's bound on requests in flight; messages and writes must fit both ends.
        let limits = Limits {
            max_outstanding: mine.max_outstanding,
            max_message_bytes: mine.max_message_bytes.min(theirs.max_message_bytes),
            max_write_bytes: mine.max_write_bytes.min(theirs.max_write_bytes),
        };
        {
            let rank = &mut self.ranks[r as usize];
            rank.posted[peer as usize] += 1;
            rank.tokens.insert(t.token, peer);
            if rank.posted[peer as usize] > limits.max_outstanding {
                let n = rank.posted[peer as usize];
                return Err(self.violation(format!(
                    "rank {r} has {n} transmits outstanding to rank {peer} (the transport allows {})",
                    limits.max_outstanding
                )));
            }
        }
        if peer == r || peer as usize >= self.ranks.len() {
            return Err(self.violation(format!("rank {r} transmits to rank {peer}")));
        }
        if self.dead(r) || self.dead(peer) {
            return Ok(());
        }
        let now = self.now;
        let mut extra = 0;
        if self.chance(self.cfg.faults.delay_prob) && self.cfg.faults.delay_max_ns > 0 {
            extra = self.rand() % self.cfg.faults.delay_max_ns;
        }
        let mut post_at = now;
        if self.cfg.msg_ns > 0 {
            let rank = &mut self.ranks[r as usize];
            rank.post_busy = rank.post_busy.max(now) + self.cfg.msg_ns;
            post_at = rank.post_busy;
        }
        if let Some((side, a, b)) = &self.cfg.faults.partition {
            if now >= *a && now < *b && side.contains(&r) != side.contains(&peer) {
                post_at = *b;
            }
        }
        match t.op {
            TxOp::Write { src, dst, len, imm } => {
                if len as usize > limits.max_write_bytes || len == 0 {
                    return Err(self.violation(format!(
                        "rank {r} wrote {len} bytes (the transport allows {})",
                        limits.max_write_bytes
                    )));
                }
                let ev = Ev::WriteArrive {
                    from: r,
                    to: peer,
                    token: t.token,
                    src,
                    dst: Loc {
                        region: dst.region,
                        offset: dst.offset,
                    },
                    len,
                    imm,
                };
                self.net.send(post_at, r, peer, len as usize, ev, None, extra);
            }
            TxOp::Send { tag, src } => {
                let len = src.len();
                if len as usize > limits.max_message_bytes {
                    return Err(self.violation(format!(
                        "rank {r} sent a message of {len} bytes (the transport allows {})",
                        limits.max_message_bytes
                    )));
                }
                let data = match src {
                    SendSrc::Inline { bytes, .. } => {
                        if bytes.len() > CELL_BYTES {
                            return Err(self.violation(format!("an inline message of {} bytes", bytes.len())));
                        }
                        Payload::Bytes(bytes)
                    }
                    SendSrc::Region { at, len } => {
                        if self.cfg.values {
                            let m = &self.ranks[r as usize].mem[ridx(at.region)];
                            Payload::Bytes(m[at.offset as usize..(at.offset + len) as usize].to_vec())
                        } else {
                            Payload::Opaque(len as usize)
                        }
                    }
                };
                let arrive = Ev::MsgArrive {
                    from: r,
                    to: peer,
                    tag,
                    data,
                };
                let sent = Ev::Sent {
                    from: r,
                    token: t.token,
                };
                let conn = r as usize * self.ranks.len() + peer as usize;
                let in_net = self.msgs_in_net[conn];
                // Control messages interleave with bulk data at packet
                // granularity, so they pay latency only, unless a message is
                // ahead of them on the connection.
                if len as usize <= CONTROL_BYTES && in_net == 0 {
                    if post_at == self.now {
                        // It has left already: complete it after this drain, without an event.
                        self.sent_now.push((r, t.token));
                    } else {
                        self.at(post_at, sent);
                    }
                    self.arrival(post_at + self.cfg.latency_ns, arrive, false);
                } else {
                    self.msgs_in_net[conn] += 1;
                    self.net.send(post_at, r, peer, len as usize, arrive, Some(sent), extra);
                }
            }
        }
        Ok(())
    }

    fn job_ns(&self, job: &Job) -> u64 {
        let c = &self.cfg;
        let book = &c.book;
        let secs = match &job.kind {
            JobKind::Accumulate { len, pairs: None, .. } | JobKind::FoldPartial { len, .. } => {
                *len as f64 * 4.0 / c.agg_bytes_per_s
            }
            JobKind::Accumulate {
                len, pairs: Some(n), ..
            } => {
                *len as f64 * 4.0 / c.agg_bytes_per_s
                    + (*len as f64 * c.sparse.densify_ns_per_elem + f64::from(*n) * c.sparse.densify_ns_per_pair) / 1e9
            }
            JobKind::EncodeSparse { len, .. } => {
                let pairs = c.sparse_density * *len as f64;
                (*len as f64 * c.sparse.encode_ns_per_elem + pairs * c.sparse.encode_ns_per_pair) / 1e9
            }
            JobKind::Apply { len, .. } => *len as f64 * 8.0 / c.agg_bytes_per_s,
            JobKind::Copy { len, .. } | JobKind::CaptureFactors { len, .. } | JobKind::Publish { len, .. } => {
                *len as f64 / c.copy_bytes_per_s
            }
            JobKind::FactorsToGrad { layer, .. } => {
                let l = &book.layers()[*layer as usize];
                2.0 * (book.config().batch * l.m * l.n) as f64 / c.gemm_flops
            }
            JobKind::Reconstruct { layer, .. } | JobKind::SumFactors { layer, .. } => {
                let l = &book.layers()[*layer as usize];
                2.0 * (book.config().batch * l.m * l.n * book.p1()) as f64 / c.gemm_flops
            }
        };
        (secs * 1e9) as u64
    }

    /// Performs a job on the rank's memory (values mode); returns captured bytes.
    fn execute(&mut self, r: u32, job: &Job) -> Result<Option<Vec<u8>>, SimError> {
        let book = self.cfg.book.clone();
        let k = book.config().batch;
        let values = self.cfg.values;
        let op = self.cfg.apply;
        // The mean and SGD divide by every gradient in the sum.
        let p1 = book.p1() * self.cfg.sched.learners as usize;
        let (seed, now) = (self.cfg.seed, self.now);
        let rank = &mut self.ranks[r as usize];
        match &job.kind {
            JobKind::CaptureFactors { factors, len, .. } => {
                if !values {
                    return Ok(None);
                }
                let m = &rank.mem[ridx(factors.region)];
                Ok(Some(
                    m[factors.offset as usize..(factors.offset + len) as usize].to_vec(),
                ))
            }
            JobKind::EncodeSparse { len, cap, .. } if !values => {
                let n = (self.cfg.sparse_density * *len as f64).round() as usize;
                let pairs = (n <= *cap).then_some(n as u32);
                let scanned = if pairs.is_some() { *len as u64 } else { 0 };
                Ok(Some(EncodeReport { pairs, scanned }.to_bytes()))
            }
            _ if !values => Ok(None),
            JobKind::EncodeSparse { src, len, dst, cap, .. } => {
                let data = f32s(&rank.mem[ridx(src.region)][src.offset as usize..src.offset as usize + len * 4]);
                let mut enc = Vec::new();
                let pairs = sparse::encode(&data, *cap, &mut enc);
                let m = &mut rank.mem[ridx(dst.region)];
                m[dst.offset as usize..dst.offset as usize + enc.len()].copy_from_slice(&enc);
                let scanned = if pairs.is_some() { *len as u64 } else { 0 };
                Ok(Some(
                    EncodeReport {
                        pairs: pairs.map(|n| n as u32),
                        scanned,
                    }
                    .to_bytes(),
                ))
            }
            JobKind::Accumulate {
                window,
                acc_at,
                src,
                len,
                first,
                partial,
                pairs,
                ..
            } => {
                let m = &rank.mem[ridx(src.region)];
                let data = match pairs {
                    None => f32s(&m[src.offset as usize..src.offset as usize + len * 4]),
                    Some(n) => {
                        let bytes = sparse::encoded_bytes(*n as usize);
                        let words: Vec<u32> = m[src.offset as usize..src.offset as usize + bytes]
                            .chunks_exact(4)
                            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect();
                        let mut d = vec![0f32; *len];
                        sparse::densify(&words, *n as usize, &mut d)
                            .map_err(|e| self.violation(format!("rank {r}: {e}")))?;
                        d
                    }
                };
                let rank = &mut self.ranks[r as usize];
                let into = if *partial { &mut rank.partial } else { &mut rank.acc };
                let acc = &mut into[*window as usize][*acc_at..acc_at + len];
                if *first {
                    acc.copy_from_slice(&data);
                } else {
                    for (a, d) in acc.iter_mut().zip(&data) {
                        *a += *d;
                    }
                }
                Ok(None)
            }
            JobKind::FoldPartial {
                window, acc_at, len, ..
            } => {
                let w = *window as usize;
                for i in *acc_at..acc_at + len {
                    rank.acc[w][i] += rank.partial[w][i];
                }
                Ok(None)
            }
            JobKind::Apply {
                window,
                shard_at,
                len,
                gradients,
                ..
            } => {
                let p1 = *gradients as usize;
                let acc = rank.acc[*window as usize][*shard_at..shard_at + len].to_vec();
                let m = &mut rank.mem[ridx(LocalRegion::Shard)];
                let range = shard_at * 4..(shard_at + len) * 4;
                let mut w = f32s(&m[range.clone()]);
                let mom = if rank.momentum.is_empty() {
                    &mut [][..]
                } else {
                    &mut rank.momentum[*shard_at..shard_at + len]
                };
                apply_ref(op, p1, &acc, &mut w, mom);
                put_f32s(&mut m[range], &w);
                Ok(None)
            }
            JobKind::Copy { src, dst, len } | JobKind::Publish { src, dst, len, .. } => {
                let data = rank.mem[ridx(src.region)][src.offset as usize..(src.offset + len) as usize].to_vec();
                rank.mem[ridx(dst.region)][dst.offset as usize..(dst.offset + len) as usize].copy_from_slice(&data);
                Ok(None)
            }
            JobKind::FactorsToGrad { layer, factors, grad } => {
                let l = &book.layers()[*layer as usize];
                let fm = &rank.mem[ridx(factors.region)];
                let uv = f32s(&fm[factors.offset as usize..factors.offset as usize + k * (l.m + l.n) * 4]);
                let g = outer_sum(&[(&uv[..k * l.m], &uv[k * l.m..])], k, l.m, l.n);
                let gm = &mut rank.mem[ridx(grad.region)];
                put_f32s(&mut gm[grad.offset as usize..grad.offset as usize + g.len() * 4], &g);
                Ok(None)
            }
            JobKind::Reconstruct {
                layer, params, factors, ..
            } => {
                let sum = factor_sum(&mut rank.delivered, r, &book, *layer, factors)
                    .map_err(|what| SimError::Violation { seed, at_ns: now, what })?;
                let pm = &mut rank.mem[ridx(params.region)];
                let range = params.offset as usize..params.offset as usize + sum.len() * 4;
                let mut w = f32s(&pm[range.clone()]);
                let mut mom = vec![0.0; if op.needs_momentum() { w.len() } else { 0 }];
                apply_ref(op, p1, &sum, &mut w, &mut mom);
                put_f32s(&mut pm[range], &w);
                Ok(None)
            }
            JobKind::SumFactors {
                layer,
                window,
                acc_at,
                factors,
                ..
            } => {
                let sum = factor_sum(&mut rank.delivered, r, &book, *layer, factors)
                    .map_err(|what| SimError::Violation { seed, at_ns: now, what })?;
                rank.acc[*window as usize][*acc_at..acc_at + sum.len()].copy_from_slice(&sum);
                Ok(None)
            }
        }
    }

    fn step(&mut self, r: u32) -> Result<(), SimError> {
        let now = self.now;
        if self.dead(r) || self.ranks[r as usize].fatal.is_some() {
            return Ok(());
        }
        let iters = self.cfg.iters;
        let nl = self.cfg.book.layers().len() as u32;
        let rank = &mut self.ranks[r as usize];
        let ready = rank.node.is_ready();
        let w = rank.worker.as_mut().expect("worker");
        match w.phase {
            Phase::Fwd(l) => {
                let avail = rank.local_avail[l as usize];
                let node_wait = rank.node.is_in_flight(l) || !ready;
                if node_wait || avail > now {
                    if w.waiting.is_none() {
                        w.waiting = Some((l, now));
                    }
                    if !node_wait {
                        // Only the node's learners are behind (a local hand-in
                        // or fan-out): nothing else will wake it.
                        self.at(avail, Ev::Wake(r));
                    }
                    return Ok(());
                }
                if let Some((_, since)) = w.waiting.take() {
                    // Waiting for the initial parameters is not training time.
                    if w.iter > 0 || l > 0 {
                        w.wait_ns += now - since;
                    }
                }
                if l == 0 && w.iter == 0 && self.start.is_none() {
                    self.start = Some(now);
                }
                if l == 0 && self.cfg.faults.crash == Some((r, w.iter)) && w.iter < iters && self.crashed_at.is_none() {
                    // It stops here: the crash takes it once its last iteration synced.
                    self.at(now, Ev::Crash(r));
                    return Ok(());
                }
                let span = self
                    .cfg
                    .faults
                    .slow
                    .iter()
                    .filter(|(x, _, a, b)| *x == r && (*a..*b).contains(&w.iter))
                    .map(|s| s.1)
                    .product::<f64>();
                if iters == 0 {
                    w.phase = Phase::Done;
                    self.at(now, Ev::Step(r));
                    return Ok(());
                }
                // The step after the last forward fires when the last layer's backward ends.
                let slow = w.slow * span;
                let mut dt = (self.cfg.layer_ns[l as usize].0 as f64 * slow) as u64;
                if l + 1 == nl {
                    dt += (self.cfg.layer_ns[l as usize].1 as f64 * slow) as u64;
                }
                w.span = span;
                w.phase = if l + 1 < nl {
                    Phase::Fwd(l + 1)
                } else {
                    Phase::Bwd(nl - 1)
                };
                self.at(now + dt, Ev::Step(r));
            }
            Phase::Bwd(l) => {
                // The backward of l is done: hand it in (WFBP) or defer it.
                if self.cfg.wait_free {
                    self.hand_in(r, l)?;
                } else {
                    self.ranks[r as usize].worker.as_mut().expect("worker").deferred.push(l);
                }
                let w = self.ranks[r as usize].worker.as_mut().expect("worker");
                if l > 0 {
                    w.phase = Phase::Bwd(l - 1);
                    let dt = (self.cfg.layer_ns[l as usize - 1].1 as f64 * w.slow * w.span) as u64;
                    self.at(now + dt, Ev::Step(r));
                } else {
                    let deferred = std::mem::take(&mut w.deferred);
                    for d in deferred {
                        self.hand_in(r, d)?;
                    }
                    let w = self.ranks[r as usize].worker.as_mut().expect("worker");
                    w.iter += 1;
                    w.phase = if w.iter == iters { Phase::Done } else { Phase::Fwd(0) };
                    self.at(now, Ev::Step(r));
                }
            }
            Phase::Done => {
                if w.finished.is_none() && (0..nl).all(|l| !rank.node.is_in_flight(l)) {
                    w.finished = Some(now.max(rank.local_busy));
                }
                if !w.shutdown_sent && rank.local_busy > now {
                    // A local hand-in is still on its way to the Node.
                    let at = rank.local_busy;
                    self.at(at, Ev::Step(r));
                    return Ok(());
                }
                if !w.shutdown_sent {
                    w.shutdown_sent = true;
                    self.feed(r, Input::Shutdown)?;
                }
            }
        }
        Ok(())
    }

    fn hand_in(&mut self, r: u32, l: u32) -> Result<(), SimError> {
        let (lo, hi) = self
            .ranks
            .iter()
            .filter_map(|x| x.worker.as_ref().map(|w| w.iter))
            .fold((u64::MAX, 0), |(lo, hi), i| (lo.min(i), hi.max(i)));
        self.report.max_lead = self.report.max_lead.max(hi - lo.min(hi));
        let book = self.cfg.book.clone();
        let iter = self.ranks[r as usize].node.completed(l);
        let factors = self.by_factors(l, iter);
        if self.cfg.values {
            let wi = book.cluster().worker_index(r).expect("worker");
            let spec = &book.layers()[l as usize];
            let rank = &mut self.ranks[r as usize];
            let (_, grad, f) = rank.node.layer_locs(l).expect("worker");
            if factors {
                let k = book.config().batch;
                let f = f.expect("FC layers have factors");
                let mut uv: Vec<f32> = (0..k * spec.m).map(|i| factor_value(wi, iter, 0, i)).collect();
                uv.extend((0..k * spec.n).map(|i| factor_value(wi, iter, 1, i)));
                let m = &mut rank.mem[ridx(LocalRegion::Factors)];
                put_f32s(&mut m[f.offset as usize..f.offset as usize + uv.len() * 4], &uv);
            } else {
                let g: Vec<f32> = (0..spec.params()).map(|i| self.grad(wi, iter, l, i)).collect();
                let rank = &mut self.ranks[r as usize];
                let m = &mut rank.mem[ridx(LocalRegion::Grads)];
                put_f32s(&mut m[grad.offset as usize..grad.offset as usize + g.len() * 4], &g);
            }
        }
        let lrn = self.cfg.local_learners as usize;
        if lrn > 1 {
            // The node's other learners' gradients (or factors) reach the
            // leader and are summed (stacked) before the one hand-in.
            let spec = &book.layers()[l as usize];
            let per = if factors {
                (book.config().batch / lrn) * (spec.m + spec.n)
            } else {
                spec.params()
            } as f64
                * 4.0;
            let d = ((lrn - 1) as f64 * per / self.cfg.local_bytes_per_s * 1e9) as u64;
            let now = self.now;
            let rank = &mut self.ranks[r as usize];
            let start = now.max(rank.local_busy);
            rank.local_busy = start + d;
            rank.local_ns[0] += d;
            // Until the hand-in, the layer's next forward cannot start: the
            // Node does not know yet that it is in flight.
            rank.local_avail[l as usize] = rank.local_avail[l as usize].max(start + d);
            self.at(start + d, Ev::Input(r, Input::HandIn { layer: l, factors }));
            return Ok(());
        }
        self.feed(r, Input::HandIn { layer: l, factors })
    }
}

/// Every worker's (U, V) of `layer`, in worker order, read where rank `r`
/// received them; a peer's must be a received message's buffer (`delivered`),
/// not a copy. `me`: `r`'s own worker index (its own block was captured).
type FactorRefs<'a> = Vec<(&'a [f32], &'a [f32])>;
fn factor_refs<'a>(
    delivered: &mut HashSet<(usize, usize)>,
    r: u32,
    me: Option<usize>,
    layer: u32,
    factors: &'a [Blob],
    (k, m, n): (usize, usize, usize),
    scratch: &'a mut [[Vec<f32>; 2]],
) -> Result<FactorRefs<'a>, String> {
    let mut refs = Vec::with_capacity(factors.len());
    for (wi, (b, [su, sv])) in factors.iter().zip(scratch.iter_mut()).enumerate() {
        if Some(wi) != me {
            for p in b.pieces() {
                if !delivered.remove(&(p.as_ptr() as usize, p.len())) {
                    return Err(format!(
                        "rank {r} sums layer {layer} from {} bytes of worker {wi}'s factors \
                         that are not a received message's buffer (a copy on the receive path)",
                        p.len()
                    ));
                }
            }
        }
        let whole = b.len() == k * (m + n) * 4;
        match (b.f32s(0, k * m, su), b.f32s(k * m * 4, k * n, sv)) {
            (Some((u, _)), Some((v, _))) if whole => refs.push((u, v)),
            _ => return Err(format!("the sum of layer {layer} got factors {b:?}")),
        }
    }
    Ok(refs)
}

/// Σ_p U_pᵀ·V_p of `layer` over every worker's factors, in worker order,
/// read where rank `r` received them ([`factor_refs`]).
fn factor_sum(
    delivered: &mut HashSet<(usize, usize)>,
    r: u32,
    book: &Book,
    layer: u32,
    factors: &[Blob],
) -> Result<Vec<f32>, String> {
    let (k, l) = (book.config().batch, &book.layers()[layer as usize]);
    let me = book.cluster().worker_index(r);
    let mut scratch = vec![[Vec::new(), Vec::new()]; factors.len()];
    let refs = factor_refs(delivered, r, me, layer, factors, (k, l.m, l.n), &mut scratch)?;
    Ok(outer_sum(&refs, k, l.m, l.n))
}

/// Σ_p U_pᵀ·V_p (K×M and K×N each) in f32, in order.
fn outer_sum(parts: &[(&[f32], &[f32])], k: usize, m: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for (u, v) in parts {
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] += (0..k).map(|kk| u[kk * m + i] * v[kk * n + j]).sum::<f32>();
            }
        }
    }
    out
}

/// The apply ops, as `tidewire_gpu::cpu::apply` computes them.
fn apply_ref(op: ApplyOp, p1: usize, acc: &[f32], params: &mut [f32], momentum: &mut [f32]) {
    let inv = 1.0f32 / p1 as f32;
    match op {
        ApplyOp::Sum => params.copy_from_slice(acc),
        ApplyOp::Mean => {
            for (w, a) in params.iter_mut().zip(acc) {
                *w = *a * inv;
            }
        }
        ApplyOp::Sgd {
            lr,
            momentum: mu,
            weight_decay: wd,
        } => {
            for (i, (w, a)) in params.iter_mut().zip(acc).enumerate() {
                if mu == 0.0 || momentum.is_empty() {
                    *w -= lr * (*a * inv + wd * *w);
                } else {
                    let v = &mut momentum[i];
                    *v = mu * *v + lr * (*a * inv + wd * *w);
                    *w -= *v;
                }
            }
        }
    }
}
