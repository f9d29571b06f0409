//! What a run is given ([`SimConfig`], [`Faults`]) and how it fails ([`SimError`]).

use std::sync::Arc;

use tidewire_engine::book::Book;
use tidewire_engine::config::{ApplyOp, SchedConfig, SyncMode};
use tidewire_engine::error::EngineError;
use tidewire_engine::node::{Limits, CELL_BYTES};
use tidewire_engine::sparse::SparseCosts;

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
    /// What servers do with a complete chunk. The value checks are exact under
    /// `Sum`, and against an f64 oracle under the mean and SGD.
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
    /// How worker 0's driver decides the schemes when the book is adaptive
    /// ([`tidewire_engine::plan`]): `None` runs the runtime's policy
    /// ([`tidewire_engine::adapt`]) on virtual time and the modelled GEMM and
    /// sum rates; a seed draws each decision at random (the VOPR: switches
    /// both ways, some of them late).
    pub decide_seed: Option<u64>,
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
    /// `(cores, one loopback stream's bytes/s)`: every host's loopback
    /// copies and its executors' jobs share its cores ([`crate::net::Net::host_cpu`]);
    /// the jobs' rates are then one core's. None: they do not interact.
    pub host_cpu: Option<(f64, f64)>,
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
            decide_seed: None,
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
            host_cpu: None,
            sparse_density: 1.0,
            sparse: SparseCosts::default(),
            trace_bin_ns: None,
        }
    }
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
