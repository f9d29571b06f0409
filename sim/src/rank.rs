//! One rank of the simulated cluster: its Node, its memory and executors'
//! clocks, and its worker loop's state.

use std::collections::VecDeque;
use std::time::Duration;

use tidewire_engine::fxhash::FxHashMap as HashMap;
use tidewire_engine::node::{HeldTransmits, Job, LocalRegion, Node, NodeConfig};
use tidewire_engine::EngineError;

use crate::config::{SimConfig, SimError};
use crate::exec::{put_f32s, ridx, Store};
use crate::values::init_value;

/// One executor of a rank, where the host's cores are shared ([`crate::cpu`]).
#[derive(Debug, Default)]
pub(crate) struct Exec {
    pub(crate) waiting: VecDeque<Job>,
    pub(crate) running: Option<Running>,
    /// Bumped on each schedule of the running job's end; older ends are stale.
    pub(crate) gen: u64,
}

#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) job: Job,
    /// Work left, ns at a whole core.
    pub(crate) left: f64,
    /// Since when it has run at `speed`.
    pub(crate) since: u64,
    pub(crate) speed: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Phase {
    Fwd(u32),
    Bwd(u32),
    Done,
}

#[derive(Debug)]
pub(crate) struct WLoop {
    pub(crate) phase: Phase,
    pub(crate) iter: u64,
    pub(crate) waiting: Option<(u32, u64)>,
    pub(crate) deferred: Vec<u32>,
    pub(crate) slow: f64,
    /// The slow span's factor in the current iteration.
    pub(crate) span: f64,
    pub(crate) wait_ns: u64,
    pub(crate) finished: Option<u64>,
    pub(crate) shutdown_sent: bool,
    /// A worker that came back: it starts at the model's newest iteration
    /// once it is ready.
    pub(crate) rejoined: bool,
}

#[derive(Debug)]
pub(crate) struct Rank {
    pub(crate) node: Node,
    /// Its memory and the executors' state (values mode).
    pub(crate) store: Store,
    pub(crate) busy: [u64; 2],
    /// With the host's cores shared: each executor's queue and running job.
    pub(crate) cpu: [Exec; 2],
    /// The runtime thread is busy posting until then ([`SimConfig::msg_ns`]).
    pub(crate) post_busy: u64,
    /// Transmits posted and not complete, per peer.
    pub(crate) posted: Vec<usize>,
    pub(crate) tokens: HashMap<u64, u32>,
    /// Transmits the modelled transport refused for now, as the runtime holds them.
    pub(crate) held: HeldTransmits,
    /// A retry of `held` is scheduled.
    pub(crate) retry_at: Option<u64>,
    pub(crate) worker: Option<WLoop>,
    pub(crate) dead: bool,
    pub(crate) fatal: Option<(u64, EngineError)>,
    pub(crate) finished: Option<u64>,
    /// The Node's timer, as last scheduled.
    pub(crate) tick_at: Option<u64>,
    /// The node's local FIFO (aggregation, fan-out) is busy until then.
    pub(crate) local_busy: u64,
    /// Per layer: when its newest parameters reach the node's learners.
    pub(crate) local_avail: Vec<u64>,
    /// Time spent on local aggregation and on fan-out, ns.
    pub(crate) local_ns: [u64; 2],
    /// Trigger checks: per local chunk of this server, per worker index,
    /// slices accumulated into the round in progress, and when its first came.
    pub(crate) round: HashMap<u32, (Vec<u32>, u64)>,
    /// Trigger checks: applies seen per chunk of this server.
    pub(crate) applies_seen: HashMap<u32, u64>,
}

impl WLoop {
    /// Worker `r`'s loop at the start of a run: the first forward pass next.
    fn new(cfg: &SimConfig, r: u32) -> WLoop {
        WLoop {
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
        }
    }
}

/// Rank `r`'s Node, memory and worker loop, as at the start of a run.
pub(crate) fn make_rank(cfg: &SimConfig, r: u32) -> Result<Rank, SimError> {
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
    let role = book.cluster().role(r).expect("in the cluster");
    let worker = role.is_worker().then(|| WLoop::new(cfg, r));
    let mut rank = Rank {
        store: Store::new(cfg, &node, r),
        node,
        busy: [0; 2],
        cpu: Default::default(),
        post_busy: 0,
        posted: vec![0; world],
        tokens: HashMap::default(),
        held: HeldTransmits::new(world),
        retry_at: None,
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
    };
    if cfg.values && role.is_worker() {
        // Every worker fills its parameters; rank 0's values reach everyone.
        // Parameters are contiguous here (no caller layout): layer l at its flat offset.
        for (l, spec) in book.layers().iter().enumerate() {
            let off = book.layer_offset(l as u32) * 4;
            let v: Vec<f32> = (0..spec.params()).map(|i| init_value(l as u32, i)).collect();
            put_f32s(
                &mut rank.store.mem[ridx(LocalRegion::Params)][off..off + v.len() * 4],
                &v,
            );
        }
    }
    Ok(rank)
}
