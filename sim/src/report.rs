//! What a run measured.

use tidewire_engine::sparse::SparseLayerStats;

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
    /// Scheme decisions worker 0 took (adaptive books), and the switches they made.
    pub decisions: u64,
    /// See `decisions`.
    pub switches: u64,
    /// Value checks that passed.
    pub checks: u64,
    /// Landing slots of one worker held at one server at once, at most.
    pub max_slots_held: u32,
    /// Bytes of the largest landing region of one server (what the runtime
    /// allocates for incoming gradients: [`tidewire_engine::SchedConfig::landing_bytes`]).
    pub landing_bytes: u64,
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
