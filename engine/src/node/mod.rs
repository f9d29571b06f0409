//! One rank, sans-IO: its worker and server cores and the whole wire
//! protocol between ranks.
//!
//! The Node owns what the ranks say to each other and how: the hello and the
//! agreement on the job configuration, the addressing of every one-sided
//! write (landing slots, shards, parameter buffers), the wire encoding of
//! every message ([`crate::wire`]), landing-slot credits, factor blocks split
//! to the transport's message cap, seeding, flow control within the
//! transport's limits, and the goodbye. It does no I/O and keeps no clock:
//! the runtime (the `tidewire` crate) and the simulator (the `tidewire-sim` crate) feed
//! it [`Input`]s with the time and execute its [`Output`]s, so both run the
//! same protocol.
//!
//! # Files
//! - `mod.rs`: the Node, its inputs' dispatch, queueing of transmits and jobs;
//! - [`types`]: inputs, outputs, jobs, regions, limits;
//! - [`flow`]: per-peer windows, control cells, back-pressure;
//! - [`factors`]: factor blocks kept, in the buffers they came in, until
//!   reconstructed; how a sender cuts them;
//! - `setup`: hellos, agreement, the limits both ends take;
//! - `worker_side`, `server_side`: the cores' commands turned into outputs;
//! - `arrivals`: completions, peers' writes and messages;
//! - `lifecycle`: readiness and the goodbye;
//! - `checks`: what the Node asserts about itself (debug builds): its
//!   invariants after every input, and every job and transmit inside the
//!   regions of both ends.
//!
//! # Driving it
//! 1. [`Node::new`], then [`Node::set_keys`] with the keys of the regions
//!    allocated as [`Node::region_bytes`] says.
//! 2. Call [`Node::handle`] with every input, then drain
//!    [`Node::poll_output`] until it returns `None`, executing each output:
//!    post each `Transmit` (and report its completion with its token), run
//!    each `Job` on its queue (jobs of one queue in order), and tell the
//!    caller about `LayerReady`.
//! 3. Call `handle(now, Input::Tick)` when [`Node::poll_timeout`] passes.
//!
//! Back-pressure stays in the driver: a transmit the transport refuses for now
//! (`WouldBlock`) is held there, with every later one to that peer behind it,
//! and posted again when the transport takes more ([`held::HeldTransmits`], which both
//! the runtime and the simulator use). The Node never hears of it: a held
//! transmit is in flight until its completion.
//!
//! # Bounds
//! - Per peer, at most [`Limits::max_outstanding`] transmits are posted and
//!   not complete; messages are at most [`Limits::max_message_bytes`] (factor
//!   blocks are split into fragments, at the U/V boundary first:
//!   [`factors::fragments`]), writes at most
//!   [`Limits::max_write_bytes`] (larger ones are split; the last piece
//!   carries the immediate).
//! - A worker has at most `credit_bytes` of pushes and factor sends in flight
//!   (one item more when nothing else is), and at most `slots` landing slots
//!   per server. A server keeps `(slots + spare_slots) × P1` landing slots
//!   (the spares hold pushes parked for the rank order:
//!   [`SchedConfig::spare_slots`]), `s + 1` accumulators under SSP(s), has at
//!   most `credit_bytes` of broadcasts in flight (under kvstore, an answer of
//!   its largest part to every worker: MXNet answers every pull at once; the
//!   answers are written from its shard, with no copy), and hands its driver at most
//!   [`SERVER_JOBS_OUT`] server jobs at once (the rest wait in its receive
//!   priority queue). Inline control messages use at most [`flow::CELLS`] cells.
//!   No memory grows with P1 × model size.
//!
//! # Shutdown
//! After [`Input::Shutdown`], a worker waits until its layers in flight are
//! synced, then tells every peer `Finished` (no more pushes or factors, with
//! the number of writes it made to that peer). A server is done once every
//! worker finished, their writes landed, and its broadcasts are placed. A
//! rank that is done says `Bye`, and leaves ([`Output::Finished`]) once
//! every peer said `Bye` and its own transmits and jobs are complete. So no
//! rank leaves while a peer still needs it, under BSP or SSP, colocated or not.
//!
//! # Aggregation triggers
//! Under a trigger other than [`Trigger::All`] (see its docs for the
//! semantics) the runtime has three things to do, all additive:
//! - divide by [`JobKind::Apply`]'s `gradients` (the gradients in the sum:
//!   the round's contributors × learners) rather than by a fixed P1 ×
//!   learners; under `All` the two are equal;
//! - keep calling `handle(now, Input::Tick)` when [`Node::poll_timeout`]
//!   passes after setup too: a server's round timeouts come that way;
//! - report a lost connection as it does now (`Input::Closed` with an
//!   error, or `Input::Failed`): when the lost peer is a worker that holds no
//!   shard, the Node stops counting it and goes on, and says `Finished` when
//!   the others are done, without waiting for that peer's goodbye.
//!
//! A worker's caller reads a published view under these triggers, as under
//! SSP ([`Node::is_staged`]), since a slow worker receives newer versions
//! while it computes.
//!
//! A lost worker without a shard may come back as a new process: its new
//! Node calls [`Node::rejoin`] before any input, and connects to every peer
//! as at the start. Every peer must have seen it go first (its connection
//! failed and was reported); a peer then takes the new connection
//! (`Input::Connected`) as a fresh peer, its servers count it again once it
//! is open and send it every chunk's current version, and its pushes count
//! from each chunk's iteration at that moment. The runtime's part is to
//! accept that new connection from a rank it lost.

mod arrivals;
mod checks;
mod decide;
pub mod factors;
pub mod flow;
pub mod held;
mod layout;
mod life;
mod lifecycle;
mod momentum;
mod server_side;
mod setup;
pub mod types;
mod worker_side;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

pub use flow::{CELLS, CELL_BYTES};
pub use held::HeldTransmits;
pub use layout::check_switches;
pub use types::{
    Blob, Input, Job, JobKind, Limits, Loc, LocalRegion, Output, Payload, Queue, RemoteLoc, SendSrc, Transmit, TxOp,
    DEFAULT_STARTUP,
};

use crate::agree::JobConfig;
use crate::book::{Book, LayerKind, Role, Scheme};
use crate::config::{ApplyOp, QueueOrder, SchedConfig, Trigger};
use crate::error::{EngineError, JobFailure, ProtocolViolation, Result};
use crate::fxhash::{FxHashMap as HashMap, FxHashSet as HashSet};
use crate::server::{Server, ServerCommand};
use crate::sparse::{SparseCosts, SparseLayerStats, SparsePolicy};
use crate::wire::{self, Hello, Kind, Msg};
use crate::worker::{Worker, WorkerCommand};
use factors::Inbox;
use flow::{Flow, Op};
use layout::region_index;
use life::Life;

/// How a [`Node`] is set up.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The information book every rank builds the same way.
    pub book: Arc<Book>,
    /// This rank.
    pub rank: u32,
    /// Scheduling, credits and consistency.
    pub sched: SchedConfig,
    /// What servers do with a complete chunk.
    pub apply: ApplyOp,
    /// The transport's limits.
    pub limits: Limits,
    /// The transport's kind (`"tcp"`, `"rdma"`, `"sim"`): every rank must use the same.
    pub transport: String,
    /// Byte offset of each layer in the caller's parameter buffer; layers
    /// must be back to back from the first (servers write by offset).
    /// `None`: contiguous from 0.
    pub params: Option<Vec<u64>>,
    /// Byte offset of each layer in the caller's gradient buffer. `None`: contiguous from 0.
    pub grads: Option<Vec<u64>>,
    /// How long setup (connections, hellos, initial parameters) may take.
    pub startup_timeout: Duration,
    /// The costs the automatic sparse/dense choice of sparse layers weighs
    /// ([`crate::sparse`]). Local: ranks need not agree on it.
    pub sparse: SparseCosts,
    /// Communication frequency and mode: the caller's to carry out (the
    /// engine syncs what is handed in); here so that every rank agrees on it.
    pub comm: crate::freq::CommConfig,
    /// A fingerprint of the caller's checkpoint settings and resumed
    /// iteration (0: none), agreed at rendezvous ([`crate::agree::Field::Checkpoint`]).
    pub checkpoint: u64,
}

impl NodeConfig {
    /// Defaults for `rank` of `book`: default scheduling, mean, TCP limits, contiguous buffers.
    pub fn new(book: Arc<Book>, rank: u32) -> Self {
        NodeConfig {
            book,
            rank,
            sched: SchedConfig::default(),
            apply: ApplyOp::Mean,
            limits: Limits::default(),
            transport: "tcp".into(),
            params: None,
            grads: None,
            startup_timeout: DEFAULT_STARTUP,
            sparse: SparseCosts::default(),
            comm: crate::freq::CommConfig::default(),
            checkpoint: 0,
        }
    }
}

/// Counters of one Node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Slices pushed.
    pub pushes: u64,
    /// Factor blocks sent.
    pub factor_sends: u64,
    /// Kvstore pull requests this rank's worker sent.
    pub pulls: u64,
    /// Slices accumulated by this rank's server.
    pub accumulated: u64,
    /// Chunk applies.
    pub applies: u64,
    /// Chunk broadcasts.
    pub broadcasts: u64,
    /// Most transmits outstanding to one peer at once.
    pub max_outstanding: usize,
    /// Most bytes of pushes and factor sends in flight at once.
    pub max_bytes_in_flight: usize,
    /// Most landing slots of one worker held at once by this server.
    pub max_slots_held: u32,
    /// Contributions this server parked for the rank order (their credit
    /// went back at once; [`SchedConfig::spare_slots`]).
    pub parked: u64,
    /// Contributions that held their credit waiting for a lower rank's
    /// (every spare slot of their worker was parked).
    pub held_for_order: u64,
    /// Most spare slots of one worker parked at once.
    pub max_spares_used: u32,
    /// Scheme decisions taken (adaptive schemes, [`crate::plan`]).
    pub decisions: u64,
    /// Switches those decisions made.
    pub switches: u64,
    /// Largest message emitted, bytes.
    pub max_message: u64,
    /// Largest write emitted, bytes.
    pub max_write: u64,
    /// Most factor blocks held at once.
    pub max_factor_blocks: usize,
    /// Late contributions this rank's server dropped ([`Trigger`]).
    pub dropped: u64,
    /// Late contributions this rank's server folded into a later round.
    pub late_folded: u64,
    /// Applies with fewer contributions than live workers.
    pub partial_applies: u64,
    /// Worker peers lost and no longer counted (triggers other than `All`).
    pub lost_workers: u32,
}

#[derive(Debug, Clone, Copy)]
enum Track {
    Ctrl,
    /// The last fragment of a chunk's momentum (`reseed`: worker 0's, on
    /// the way back to the PS; else a server's to a worker).
    Momentum {
        chunk: u32,
        reseed: bool,
    },
    Init {
        chunk: u32,
    },
    Push {
        slice: u32,
    },
    Bcast {
        chunk: u32,
        worker: u32,
    },
    Factors {
        layer: u32,
        peer: u32,
    },
    Piece,
}

/// A transmit that waits for its peer to open: split to the peer's limits then.
#[derive(Debug, Clone, Copy)]
enum Early {
    Write {
        src: Loc,
        dst: RemoteLoc,
        len: u64,
        imm: u32,
        track: Track,
    },
    Factors {
        layer: u32,
        iter: u64,
    },
}

/// Server jobs handed to the driver at once, at most: the rest wait in the
/// Node's receive priority queue (P3's server: the slice the next forward
/// pass needs first is summed, applied and broadcast first), so a burst of
/// low-priority accumulates never delays a high-priority one by more than
/// this many jobs. Under a trigger other than `all`, server jobs go out as
/// they come: a round is timed from its contributions' arrival, and its
/// accumulates run when they arrive.
///
/// Sized by measurement in the real runtime, where every completion travels
/// back through the runtime thread before the next job goes out (the
/// simulator charges nothing for that): `tidewire train --model vgg19
/// --workers 4 --colocate --sync p3 --fast` under `ci/netem/netem.sh run
/// 5gbe 4`, on the 2-core development VM, gave 50.4 and 49.1 samples/s with
/// 2 jobs out, 63.7 and 67.1 with 16, 60.7 and 61.1 with 64 (WFBP: 62.8 and
/// 60.0). 16 jobs of one 200 kB slice each are about 3 MB of summing: well
/// under a millisecond of delay for the highest-priority slice.
pub const SERVER_JOBS_OUT: usize = 16;

#[derive(Debug, Clone, Copy)]
enum JobTrack {
    Accumulate {
        worker: u32,
        slot: u32,
        credit: bool,
    },
    FoldPartial,
    Encode {
        server: u32,
        slot: u32,
        slice: u32,
    },
    Apply {
        chunk: u32,
    },
    InitCopy {
        chunk: u32,
    },
    LocalBcast {
        chunk: u32,
    },
    FormGrad {
        layer: u32,
    },
    Capture {
        layer: u32,
        iter: u64,
        len: usize,
    },
    Reconstruct {
        layer: u32,
        iter: u64,
    },
    Publish {
        layer: u32,
        iter: Option<u64>,
    },
    SumFactors,
    /// A chunk's momentum placed for the switch at `iter`, sent by `from`:
    /// into the shard's (`to_server`) or a worker's.
    MomentumIn {
        chunk: u32,
        iter: u64,
        from: u32,
        to_server: bool,
    },
}

impl JobTrack {
    fn queue(&self) -> Queue {
        match self {
            JobTrack::Accumulate { .. }
            | JobTrack::FoldPartial
            | JobTrack::Apply { .. }
            | JobTrack::SumFactors
            | JobTrack::MomentumIn { to_server: true, .. }
            | JobTrack::InitCopy { .. } => Queue::Server,
            _ => Queue::Worker,
        }
    }
}

#[derive(Debug, Default, Clone)]
struct Peer {
    connected: bool,
    hello: bool,
    keys: [u32; 3],
    params_base: u64,
    /// The peer's transport limits, from its hello: nothing larger goes to it.
    max_message: u64,
    max_write: u64,
    open: bool,
    /// `Finished` arrived, with the writes the peer made to us.
    finished: Option<u64>,
    /// `Bye` arrived, with the writes the peer made to us.
    bye: Option<u64>,
    closed: bool,
    /// A worker lost under a trigger other than `All`: no longer counted,
    /// nothing more goes to it, and the goodbye does not wait for it.
    lost: bool,
    /// A lost worker that connected again: counted again once it is open.
    rejoined: bool,
}

#[derive(Debug)]
struct WorkerSide {
    core: Worker,
    forming: Vec<bool>,
    want: HashSet<(u32, u64)>,
    publish_started: bool,
    publish_left: usize,
}

#[derive(Debug)]
struct ServerSide {
    core: Server,
    apply_running: HashMap<u32, u64>,
    deferred: HashMap<u32, Vec<u32>>,
    /// Kvstore notifications (worker, version) waiting for their chunk's apply to run.
    deferred_notify: HashMap<u32, Vec<(u32, u64)>>,
    /// Momentum at switches: sends that wait for an apply, or in flight.
    momentum: ServerMomentum,
    credit_out: BTreeMap<u32, Vec<u32>>,
    local_slots: HashMap<u32, u32>,
}

/// A server's momentum traffic ([`ServerSide`]).
#[derive(Debug, Default)]
struct ServerMomentum {
    /// Per chunk: a send to the workers (for the switch at the iteration)
    /// waiting for the chunk's apply to run.
    deferred: HashMap<u32, u64>,
    /// Per chunk: sends to workers (and local copies) reading the shard's
    /// momentum, not yet complete.
    reading: HashMap<u32, u32>,
    /// Per chunk: the placement of worker 0's momentum (a `Place`, or a
    /// `Copy` from this rank's own worker), waiting for those reads to end.
    held: HashMap<u32, (JobKind, JobTrack)>,
}

/// The checks of a configuration before anything is built, in order: the
/// rank inside the cluster (its role, returned), the transport's limits, the
/// modes and the switches (see [`layout::check_limits`], [`layout::check_modes`]
/// and [`check_switches`]).
fn check_config(cfg: &NodeConfig) -> Result<Role> {
    let (book, rank) = (&cfg.book, cfg.rank);
    let world = book.cluster().world();
    let role = book
        .cluster()
        .role(rank)
        .ok_or_else(|| EngineError::InvalidConfig(format!("rank {rank} is outside the cluster of {world}")))?;
    debug_assert!((rank as usize) < world, "rank {rank} in a world of {world}");
    layout::check_limits(&cfg.limits)?;
    layout::check_modes(book, &cfg.sched)?;
    layout::check_switches(book, &cfg.sched, cfg.apply)?;
    Ok(role)
}

/// This rank's worker side and server side, each where its role has one
/// (the worker's core first).
fn sides(
    book: &Arc<Book>,
    rank: u32,
    role: Role,
    sched: SchedConfig,
    moves_momentum: bool,
) -> Result<(Option<WorkerSide>, Option<ServerSide>)> {
    let worker = if role.is_worker() {
        Some(WorkerSide {
            core: Worker::new(book.clone(), rank, sched)?.with_momentum(moves_momentum),
            forming: vec![false; book.layers().len()],
            want: HashSet::default(),
            publish_started: false,
            publish_left: 0,
        })
    } else {
        None
    };
    let server = if role.is_server() {
        Some(ServerSide {
            core: Server::new(book.clone(), rank, sched)?.with_momentum(moves_momentum),
            apply_running: HashMap::default(),
            deferred: HashMap::default(),
            momentum: ServerMomentum::default(),
            deferred_notify: HashMap::default(),
            credit_out: BTreeMap::new(),
            local_slots: HashMap::default(),
        })
    } else {
        None
    };
    debug_assert!(worker.is_some() || server.is_some(), "rank {rank} has a role");
    Ok((worker, server))
}

/// One rank of a job. See the module docs.
#[derive(Debug)]
pub struct Node {
    book: Arc<Book>,
    /// The schemes by iteration: the book's, and worker 0's decisions since.
    plan: crate::plan::Plan,
    /// Per layer: a hand-in that waits for a decision (whether by factors).
    parked_in: Vec<Option<bool>>,
    /// Worker 0: the decision point its `DecisionDue` went out for.
    due: Option<u64>,
    rank: u32,
    sched: SchedConfig,
    limits: Limits,
    job: JobConfig,
    keys: [u32; 3],
    staged: bool,
    param_off: Vec<u64>,
    view_off: Vec<u64>,
    grad_off: Vec<u64>,
    factor_off: Vec<Option<u64>>,
    /// Per layer: its staging in the `Sparse` region (sparse layers of a worker).
    sparse_off: Vec<Option<u64>>,
    /// Where momentum lies when it moves at switches (`None`: it does not).
    moments: Option<layout::Moments>,
    sparse_costs: SparseCosts,
    sparse_policy: SparsePolicy,
    /// Per layer: this worker's sparse-push counters.
    sparse_stats: Vec<SparseLayerStats>,
    /// (worker, slot) → pairs, for landing slots that hold a sparse push.
    landing_sparse: HashMap<(u32, u32), u32>,
    bytes: [u64; 9],
    slot_bytes: u64,
    worker: Option<WorkerSide>,
    server: Option<ServerSide>,
    peers: Vec<Peer>,
    flow: Flow<Track>,
    inbox: Inbox,
    jobs: HashMap<u64, JobTrack>,
    next_job: u64,
    /// Server jobs not yet handed out, best first: (iteration, layer, id).
    srv_queue: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u32, u64)>>,
    srv_jobs: HashMap<u64, Job>,
    /// Server jobs handed out and not completed.
    srv_out: usize,
    out: VecDeque<Output>,
    now: Duration,
    startup_timeout: Duration,
    deadline: Option<Duration>,
    /// Setup, running, the goodbye's steps: only ever forward ([`Life`]).
    life: Life,
    fatal: Option<EngineError>,
    imm_sent: Vec<u64>,
    landed_from: Vec<u64>,
    /// A worker (this rank's, or a peer) has finished: the stranded check is on.
    any_finished: bool,
    /// Something the stranded check reads changed since it last ran.
    stranded_dirty: bool,
    /// Transmits to peers that left after their goodbye: complete them.
    moot: Vec<(u32, Track)>,
    /// Per peer: writes and factor blocks waiting for it to open (its limits).
    early: Vec<Vec<Early>>,
    /// Peers that are open (hello and regions known).
    open_peers: usize,
    stats: NodeStats,
}

impl Node {
    /// The Node for `cfg.rank`. Fails on a configuration that cannot work:
    /// the rank outside the cluster, bad buffer layouts, or transport limits
    /// too small for the protocol's control messages.
    pub fn new(mut cfg: NodeConfig) -> Result<Self> {
        cfg.sched.validate()?;
        cfg.sched = cfg.sched.resolve(&cfg.book);
        let book = cfg.book.clone();
        let rank = cfg.rank;
        let role = check_config(&cfg)?;
        let l = cfg.limits;
        // SGD's momentum moves with a layer that switches schemes ([`crate::plan`]).
        let moves = cfg.apply.needs_momentum() && (book.plan().has_switches() || book.plan().every() > 0);
        let buffers = (cfg.params.take(), cfg.grads.take());
        let lay = layout::Layout::new(&book, rank, role, &cfg.sched, buffers, moves)?;
        // A landing slot holds the largest slice: `landed` divides offsets by it.
        debug_assert!(
            lay.slot_bytes >= 4 && lay.slot_bytes % 4 == 0,
            "slot of {} bytes",
            lay.slot_bytes
        );
        let (worker, server) = sides(&book, rank, role, cfg.sched, moves)?;
        let world = book.cluster().world();
        let mut peers = vec![Peer::default(); world];
        peers[rank as usize].open = true;
        let mut flow = Flow::new(world, l.max_outstanding);
        flow.open(rank);
        let node = Node {
            job: JobConfig::new(&book, &cfg.sched, cfg.apply, &cfg.transport)
                .with_comm(&cfg.comm)
                .with_checkpoint(cfg.checkpoint),
            inbox: Inbox::new(world, book.p1()),
            sched: cfg.sched,
            limits: l,
            keys: [0; 3],
            staged: lay.staged,
            param_off: lay.param_off,
            view_off: lay.view_off,
            grad_off: lay.grad_off,
            factor_off: lay.factor_off,
            sparse_off: lay.sparse_off,
            moments: lay.moments,
            sparse_costs: cfg.sparse,
            sparse_policy: SparsePolicy::new(&book),
            sparse_stats: vec![SparseLayerStats::default(); book.layers().len()],
            landing_sparse: HashMap::default(),
            bytes: lay.bytes,
            slot_bytes: lay.slot_bytes,
            worker,
            server,
            peers,
            flow,
            jobs: HashMap::default(),
            next_job: 1,
            srv_queue: std::collections::BinaryHeap::new(),
            srv_jobs: HashMap::default(),
            srv_out: 0,
            out: VecDeque::new(),
            now: Duration::ZERO,
            startup_timeout: cfg.startup_timeout,
            deadline: None,
            life: Life::Setup { shutdown: false },
            fatal: None,
            imm_sent: vec![0; world],
            landed_from: vec![0; world],
            any_finished: false,
            stranded_dirty: false,
            moot: Vec::new(),
            early: (0..world).map(|_| Vec::new()).collect(),
            open_peers: 0,
            stats: NodeStats::default(),
            plan: book.plan().clone(),
            parked_in: vec![None; book.layers().len()],
            due: None,
            book,
            rank,
        };
        // The hello carries every agreed field.
        debug_assert_eq!(node.job.fields().len(), crate::agree::Field::COUNT);
        Ok(node)
    }

    /// The keys of this rank's Params, Shard and Landing regions (0 where it
    /// has none), announced in the hello. Call before the first `Connected`.
    pub fn set_keys(&mut self, keys: [u32; 3]) {
        debug_assert!(self.peers.iter().all(|p| !p.connected), "keys are set before any hello");
        self.keys = keys;
    }

    /// Bytes the runtime allocates for `region` (0: none).
    pub fn region_bytes(&self, region: LocalRegion) -> u64 {
        self.bytes[region_index(region)]
    }

    /// Where `layer`'s parameters, gradient and factors (U then V) live, as
    /// the caller sees them: `(params, grad, factors)`. Under SSP the
    /// parameters are in `View`.
    pub fn layer_locs(&self, layer: u32) -> Option<(Loc, Loc, Option<Loc>)> {
        self.worker.as_ref()?;
        let l = layer as usize;
        let params = if self.staged {
            Loc {
                region: LocalRegion::View,
                offset: *self.view_off.get(l)?,
            }
        } else {
            Loc {
                region: LocalRegion::Params,
                offset: *self.param_off.get(l)?,
            }
        };
        let grad = Loc {
            region: LocalRegion::Grads,
            offset: self.grad_off[l],
        };
        debug_assert_eq!(
            self.factor_off[l].is_some(),
            self.book.layers()[l].kind == LayerKind::Fc
        );
        let f = self.factor_off[l].map(|o| Loc {
            region: LocalRegion::Factors,
            offset: o,
        });
        // The caller's layer lies inside the regions the runtime allocates.
        let bytes = self.book.layers()[l].params() as u64 * 4;
        debug_assert!(params.offset + bytes <= self.bytes[region_index(params.region)]);
        debug_assert!(grad.offset + bytes <= self.bytes[region_index(LocalRegion::Grads)]);
        Some((params, grad, f))
    }

    /// Where `layer`'s parameters land in the `Params` region (the caller's
    /// view under BSP; the landing zone under SSP). The initial values go here.
    pub fn params_loc(&self, layer: u32) -> Option<Loc> {
        self.worker.as_ref()?;
        let at = Loc {
            region: LocalRegion::Params,
            offset: *self.param_off.get(layer as usize)?,
        };
        let bytes = self.book.layers()[layer as usize].params() as u64 * 4;
        debug_assert!(at.offset + bytes <= self.bytes[region_index(LocalRegion::Params)]);
        Some(at)
    }

    /// Accumulator copies of the shard a server keeps (`s + 1` under SSP(s)).
    pub fn windows(&self) -> usize {
        self.server.as_ref().map_or(0, |s| s.core.windows())
    }
    /// Whether this rank's callers read a published view (SSP workers).
    pub fn is_staged(&self) -> bool {
        debug_assert!(!self.staged || self.worker.is_some(), "only a worker reads a view");
        self.staged
    }
    /// The book.
    pub fn book(&self) -> &Arc<Book> {
        &self.book
    }
    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }
    /// The job configuration this rank agrees on.
    pub fn job_config(&self) -> &JobConfig {
        &self.job
    }
    /// The transport limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }
    /// Setup is complete.
    pub fn is_ready(&self) -> bool {
        debug_assert!(
            !self.life.ready() || self.open_peers + 1 == self.peers.len(),
            "ready with every peer open"
        );
        self.life.ready()
    }
    /// The goodbye is complete.
    pub fn is_finished(&self) -> bool {
        debug_assert!(
            self.life != Life::Done || self.jobs.is_empty(),
            "done with nothing running"
        );
        self.life == Life::Done
    }
    /// The fatal error, once one happened.
    pub fn fatal(&self) -> Option<&EngineError> {
        self.fatal.as_ref()
    }
    /// Iterations of `layer` completed by this rank's worker.
    pub fn completed(&self, layer: u32) -> u64 {
        self.worker.as_ref().map_or(0, |w| w.core.completed(layer))
    }
    /// Whether `layer` is handed in and not yet synced.
    pub fn is_in_flight(&self, layer: u32) -> bool {
        self.worker
            .as_ref()
            .is_some_and(|w| w.core.is_in_flight(layer) || w.forming.get(layer as usize).copied().unwrap_or(false))
            || self.is_parked(layer)
    }
    /// The scheme `layer` syncs by at its next hand-in.
    pub fn next_scheme(&self, layer: u32) -> Result<Scheme> {
        match &self.worker {
            Some(w) => w.core.next_scheme(layer),
            None => Err(EngineError::InvalidConfig(format!(
                "rank {} is not a worker",
                self.rank
            ))),
        }
    }
    /// Counters.
    pub fn stats(&self) -> NodeStats {
        let mut s = self.stats;
        if let Some(w) = &self.worker {
            let ws = w.core.stats();
            s.pushes = ws.pushes;
            s.factor_sends = ws.factor_sends;
            s.pulls = ws.pulls;
            s.max_bytes_in_flight = ws.max_bytes_in_flight;
        }
        if let Some(sv) = &self.server {
            let st = sv.core.stats();
            s.accumulated = st.accumulated;
            s.applies = st.applies;
            s.broadcasts = st.broadcasts;
            s.max_slots_held = st.max_slots_held;
            s.parked = st.parked;
            s.held_for_order = st.held_for_order;
            s.max_spares_used = st.max_spares_used;
            s.dropped = st.dropped;
            s.late_folded = st.late_folded;
            s.partial_applies = st.partial_applies;
            s.lost_workers = st.lost;
        }
        s.max_outstanding = self.flow.max_out_seen;
        s.max_factor_blocks = self.inbox.max_held();
        // The transport's limits, which the Node never exceeds.
        debug_assert!(s.max_outstanding <= self.limits.max_outstanding, "{s:?}");
        debug_assert!(s.max_message <= self.limits.max_message_bytes as u64, "{s:?}");
        debug_assert!(s.max_write <= self.limits.max_write_bytes as u64, "{s:?}");
        s
    }
    /// Per layer: this worker's sparse-push counters (all zero for layers
    /// without the sparse hint, and on ranks that are not workers).
    pub fn sparse_stats(&self) -> &[SparseLayerStats] {
        &self.sparse_stats
    }
    /// The costs the sparse/dense choice weighs.
    pub fn sparse_costs(&self) -> SparseCosts {
        self.sparse_costs
    }
    /// This rank is a worker that comes back after it was lost (a new
    /// process, under a trigger other than [`Trigger::All`]): call it right
    /// after [`Node::new`], before any input. It does not seed the servers
    /// (they hold the current parameters); they count it again once it
    /// connected, and send it every chunk's current version, which is its
    /// start. Its iterations count from there.
    pub fn rejoin(&mut self) -> Result<()> {
        if self.sched.trigger == Trigger::All {
            return Err(EngineError::InvalidConfig(
                "a worker can rejoin only under a trigger other than `all`".into(),
            ));
        }
        match self.worker.as_mut() {
            Some(w) if self.server.is_none() => {
                debug_assert!(self.peers.iter().all(|p| !p.connected), "rejoin comes before any input");
                w.core.skip_seeding();
                Ok(())
            }
            _ => Err(EngineError::InvalidConfig(format!(
                "rank {} is not a worker without a shard: it cannot rejoin",
                self.rank
            ))),
        }
    }
    /// Landing-slot credits this rank's worker holds now (`None` on a rank
    /// that is not a worker): `slots × P2` once every push is accounted for.
    pub fn free_credits(&self) -> Option<usize> {
        self.worker.as_ref().map(|w| w.core.free_credits())
    }
    /// Applies completed by this rank's server for `chunk`.
    pub fn applied(&self, chunk: u32) -> Option<u64> {
        self.server.as_ref()?.core.applied(chunk)
    }

    /// The next output.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }
    /// Whether an output is waiting.
    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    /// When the Node next needs an [`Input::Tick`], if ever.
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.fatal.is_some() || self.life == Life::Done {
            return None;
        }
        let d = if self.life.ready() { None } else { self.deadline };
        let rounds = self.server.as_ref().and_then(|s| s.core.next_deadline());
        [d, rounds].into_iter().flatten().min()
    }

    /// Feeds one input at time `now` (any monotonic clock; the simulator's
    /// is virtual). Errors are the caller's: a bad hand-in. Everything that
    /// fails the rank comes out as [`Output::Fatal`].
    pub fn handle(&mut self, now: Duration, input: Input) -> Result<()> {
        debug_assert!(now >= self.now, "the clock goes forward: {now:?} after {:?}", self.now);
        self.now = now;
        if let Some(s) = self.server.as_mut() {
            s.core.set_now(now);
        }
        if self.deadline.is_none() {
            self.deadline = Some(now + self.startup_timeout);
        }
        if let Some(e) = &self.fatal {
            return match input {
                Input::HandIn { .. } | Input::Shutdown | Input::Decide { .. } => Err(e.clone()),
                _ => Ok(()),
            };
        }
        let r = match input {
            Input::HandIn { layer, factors } => self.hand_in(layer, factors),
            Input::Decide { at, sfb } => self.decide_here(at, sfb),
            Input::Shutdown => {
                self.life.request_shutdown();
                Ok(())
            }
            other => {
                if let Err(e) = self.input(other) {
                    self.fail(e);
                }
                Ok(())
            }
        };
        self.drive();
        if self.fatal.is_none() {
            self.debug_invariants();
        }
        r
    }

    fn input(&mut self, input: Input) -> Result<()> {
        match input {
            Input::HandIn { .. } | Input::Shutdown | Input::Decide { .. } => unreachable!("handled by the caller"),
            Input::Connected { peer } => self.connected(peer),
            Input::PeerRegionsKnown { peer } => self.regions_known(peer),
            Input::Done { token } => match self.flow.done(token) {
                Some((_, track)) => self.tx_done(track),
                None if self.flow.was_dropped(token) => Ok(()),
                None => Err(EngineError::protocol(
                    self.rank,
                    ProtocolViolation::UnknownTransmit { token },
                )),
            },
            Input::Failed { token, reason } => self.tx_failed(token, reason),
            Input::Landed {
                peer,
                region,
                offset,
                len,
                imm,
            } => self.landed(peer, region, offset, len, imm),
            Input::Message { peer, tag, data } => self.message(peer, tag, data),
            Input::Closed { peer, error } => self.peer_closed(peer, error),
            Input::JobDone { id, data } => self.job_done(id, data),
            Input::JobFailed { id, error } => Err(EngineError::Job(JobFailure::Failed { id, cause: error })),
            Input::Abort { reason } => Err(EngineError::Aborted(reason)),
            Input::Tick => {
                if let Some(s) = self.server.as_mut() {
                    s.core.handle_tick();
                }
                if !self.life.ready() && self.deadline.is_some_and(|d| self.now >= d) {
                    return Err(EngineError::Timeout {
                        what: self.waiting_for(),
                        after: self.startup_timeout,
                    });
                }
                Ok(())
            }
        }
    }

    fn waiting_for(&self) -> String {
        debug_assert!(!self.life.ready(), "only setup waits");
        let missing: Vec<u32> = (0..self.peers.len() as u32)
            .filter(|&r| r != self.rank && !self.peers[r as usize].open)
            .collect();
        if !missing.is_empty() {
            format!("connections and hellos from ranks {missing:?}")
        } else {
            "the initial parameters from worker rank 0".into()
        }
    }

    /// Whether the job goes on without `peer` when its connection fails: a
    /// trigger other than `All`, setup complete, and the peer a worker that
    /// holds no shard.
    fn may_lose(&self, peer: u32) -> bool {
        self.sched.trigger != Trigger::All
            && self.life.ready()
            && self
                .book
                .cluster()
                .role(peer)
                .is_some_and(|r| r.is_worker() && !r.is_server())
    }

    /// Stops counting the worker `peer` (see [`Trigger`]): what was queued
    /// or in flight to it counts as delivered, and this rank's server goes
    /// on without it (or fails, when its rounds cannot complete without it).
    fn lose_worker(&mut self, peer: u32) -> Result<()> {
        debug_assert!(self.may_lose(peer), "rank {peer} is a worker the job goes on without");
        let p = &mut self.peers[peer as usize];
        if p.lost {
            return Ok(());
        }
        p.lost = true;
        p.closed = true;
        self.stranded_dirty = true;
        self.early[peer as usize].clear();
        for track in self.flow.drop_peer(peer) {
            self.tx_done(track)?;
        }
        debug_assert_eq!(self.flow.pending_to(peer), 0, "nothing goes to a lost worker");
        if let Some(s) = self.server.as_mut() {
            let wi = self.book.cluster().worker_index(peer).expect("a worker");
            s.core.handle_worker_lost(wi)?;
        }
        Ok(())
    }

    fn peer_mut(&mut self, peer: u32) -> Result<&mut Peer> {
        let me = self.rank;
        match self.peers.get_mut(peer as usize) {
            Some(p) if peer != me => Ok(p),
            _ => Err(EngineError::protocol(peer, ProtocolViolation::NotAPeer { peer, me })),
        }
    }

    fn fail(&mut self, e: EngineError) {
        if self.fatal.is_some() {
            return;
        }
        // The caller's mistakes go back to it; only failures end the rank.
        debug_assert!(
            !matches!(
                e,
                EngineError::LayerBusy { .. } | EngineError::NeedsFactors { .. } | EngineError::Shutdown
            ),
            "{e}"
        );
        let (tag, bytes) = wire::encode(&Msg::Abort(e.to_string()));
        for p in 0..self.peers.len() as u32 {
            let peer = &self.peers[p as usize];
            if p != self.rank && peer.connected && !peer.closed && peer.bye.is_none() {
                self.flow.urgent(p, tag, bytes.clone(), Track::Ctrl, &mut self.out);
            }
        }
        self.out.push_back(Output::Fatal(e.clone()));
        self.fatal = Some(e);
    }

    fn new_job(&mut self, queue: Queue, kind: JobKind, track: JobTrack) {
        debug_assert!(queue == Queue::Worker || track.queue() == Queue::Server);
        self.new_job_at(queue, (0, 0), kind, track);
    }

    /// A job; a server job waits in the receive priority queue with priority
    /// `prio` (iteration, forward index: lowest first; FIFO among equals,
    /// which keeps one chunk's accumulates, fold and apply in order).
    fn new_job_at(&mut self, queue: Queue, prio: (u64, u32), kind: JobKind, track: JobTrack) {
        let id = self.next_job;
        self.next_job += 1;
        let reused = self.jobs.insert(id, track);
        debug_assert!(reused.is_none(), "job id {id} given twice");
        if cfg!(debug_assertions) {
            self.debug_job(&kind);
        }
        let job = Job { id, queue, kind };
        if queue == Queue::Server && self.sched.trigger == Trigger::All {
            // P3's priority only where the worker sends by priority: the FIFO
            // modes (the papers' baselines) keep their servers in arrival order.
            let prio = match self.sched.order {
                QueueOrder::Priority => prio,
                QueueOrder::Fifo => (0, 0),
            };
            self.srv_jobs.insert(id, job);
            self.srv_queue.push(std::cmp::Reverse((prio.0, prio.1, id)));
            self.pump_server_jobs();
        } else {
            self.out.push_back(Output::Job(job));
        }
    }

    /// Hands out the best server jobs while fewer than [`SERVER_JOBS_OUT`] run.
    fn pump_server_jobs(&mut self) {
        while self.srv_out < SERVER_JOBS_OUT {
            let Some(std::cmp::Reverse((_, _, id))) = self.srv_queue.pop() else {
                return;
            };
            let job = self.srv_jobs.remove(&id).expect("queued with its job");
            self.srv_out += 1;
            debug_assert!(self.srv_out <= SERVER_JOBS_OUT);
            self.out.push_back(Output::Job(job));
        }
    }

    fn send_ctrl(&mut self, peer: u32, msg: &Msg) {
        debug_assert!(!matches!(msg, Msg::FactorData), "factor data goes from its region");
        let (tag, bytes) = wire::encode(msg);
        debug_assert!(bytes.len() <= CELL_BYTES);
        self.stats.max_message = self.stats.max_message.max(bytes.len() as u64);
        let gated = !matches!(msg, Msg::Hello(_));
        self.enqueue(peer, Op::SendInline { tag, bytes }, Track::Ctrl, gated);
    }

    /// Queues a transmit. To a peer that left after its goodbye, nothing
    /// goes: it needs nothing more, so the transmit counts as delivered.
    fn enqueue(&mut self, peer: u32, op: Op, track: Track, gated: bool) {
        // What stays on this rank goes through jobs, never the transport.
        debug_assert_ne!(peer, self.rank, "a transmit to oneself: {track:?}");
        if self.flow.is_gone(peer) {
            self.moot.push((peer, track));
        } else {
            self.flow.push(peer, op, track, gated);
        }
    }

    /// Queues a write, split into pieces of at most the transport's write cap;
    /// the last piece carries the immediate and the track.
    fn write(&mut self, peer: u32, src: Loc, dst: RemoteLoc, len: u64, imm: u32, track: Track) {
        // Into a region the peer announced a key for, in whole words (f32s, or sparse pairs).
        debug_assert!(dst.region.remote_write() && len % 4 == 0, "{dst:?}+{len}");
        if !self.peers[peer as usize].open {
            // Split once the peer's limits are known.
            self.early[peer as usize].push(Early::Write {
                src,
                dst,
                len,
                imm,
                track,
            });
            return;
        }
        let max = self.write_cap(peer);
        // An empty write would count an immediate that never lands; a cap
        // under 4 bytes would never end.
        debug_assert!(len > 0 && max >= 4, "a write of {len} bytes, cap {max}");
        let mut off = 0;
        while off < len {
            let n = (len - off).min(max);
            let last = off + n == len;
            debug_assert!(last || n % 4 == 0, "pieces keep whole f32s");
            self.stats.max_write = self.stats.max_write.max(n);
            self.enqueue(
                peer,
                Op::Write {
                    src: Loc {
                        region: src.region,
                        offset: src.offset + off,
                    },
                    dst: RemoteLoc {
                        region: dst.region,
                        offset: dst.offset + off,
                    },
                    len: n,
                    imm: last.then_some(imm),
                },
                if last { track } else { Track::Piece },
                true,
            );
            off += n;
        }
        debug_assert_eq!(off, len, "the pieces cover the write");
        self.imm_sent[peer as usize] += 1;
    }

    // ----- core commands ---------------------------------------------------------

    fn drive(&mut self) {
        loop {
            let mut progressed = false;
            for (_, track) in std::mem::take(&mut self.moot) {
                progressed = true;
                if let Err(e) = self.tx_done(track) {
                    self.fail(e);
                }
            }
            while let Some(cmd) = self.worker.as_mut().and_then(|w| w.core.poll_command()) {
                progressed = true;
                if let Err(e) = self.worker_cmd(cmd) {
                    self.fail(e);
                }
            }
            while let Some(cmd) = self.server.as_mut().and_then(|s| s.core.poll_command()) {
                progressed = true;
                if let Err(e) = self.server_cmd(cmd) {
                    self.fail(e);
                }
            }
            if !progressed {
                break;
            }
        }
        if self.fatal.is_some() {
            return;
        }
        self.flush_credits();
        self.check_ready();
        if let Some(e) = self.check_stranded() {
            self.fail(e);
            return;
        }
        self.check_shutdown();
        // Writes into a peer's parameters are addressed from the base its hello announced.
        let start = self.out.len();
        self.flow.pump(&mut self.out);
        for o in self.out.range_mut(start..) {
            if let Output::Transmit(Transmit {
                peer,
                op: TxOp::Write { dst, .. },
                ..
            }) = o
            {
                if dst.region == LocalRegion::Params {
                    // The base came with its hello: writes wait for the peer to open.
                    debug_assert!(self.peers[*peer as usize].open);
                    dst.offset += self.peers[*peer as usize].params_base;
                }
            }
        }
        if cfg!(debug_assertions) {
            for o in self.out.range(start..) {
                if let Output::Transmit(t) = o {
                    self.debug_transmit(t);
                }
            }
        }
    }

    /// Transmits queued or in flight to `peer` (for tests and reports).
    pub fn pending_to(&self, peer: u32) -> usize {
        self.flow.pending_to(peer)
    }
    /// Transmits outstanding to `peer`.
    pub fn outstanding(&self, peer: u32) -> usize {
        self.flow.outstanding(peer)
    }
}
