//! One rank, sans-IO: its worker and server cores and the whole wire
//! protocol between ranks.
//!
//! The Node owns what the ranks say to each other and how: the hello and the
//! agreement on the job configuration, the addressing of every one-sided
//! write (landing slots, shards, parameter buffers), the wire encoding of
//! every message ([`crate::wire`]), landing-slot credits, factor blocks split
//! to the transport's message cap, seeding, flow control within the
//! transport's limits, and the goodbye. It does no I/O and keeps no clock:
//! the runtime (the `tidewire` crate) and the simulator ([`crate::sim`]) feed
//! it [`Input`]s with the time and execute its [`Output`]s, so both run the
//! same protocol.
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
//! When a transmit to a peer comes back `Blocked`, the runtime reports every
//! later transmit to that peer from the same drain as `Blocked` too, without
//! posting it, and feeds these `Blocked` inputs before any other input: the
//! Node requeues them in order, so writes and messages to a peer still go
//! out in the order they were queued.
//!
//! # Bounds
//! - Per peer, at most [`Limits::max_outstanding`] transmits are posted and
//!   not complete; messages are at most [`Limits::max_message_bytes`] (factor
//!   blocks are split into fragments), writes at most
//!   [`Limits::max_write_bytes`] (larger ones are split; the last piece
//!   carries the immediate).
//! - A worker has at most `credit_bytes` of pushes and factor sends in flight
//!   (one item more when nothing else is), and at most `slots` landing slots
//!   per server. A server keeps `slots × P1` landing slots, `s + 1`
//!   accumulators under SSP(s), and has at most `credit_bytes` of broadcasts
//!   in flight. Inline control messages use at most [`flow::CELLS`] cells.
//!   Nothing grows with P1 × model size.
//!
//! # Shutdown
//! After [`Input::Shutdown`], a worker waits until its layers in flight are
//! synced, then tells every peer `Finished` (no more pushes or factors, with
//! the number of writes it made to that peer). A server is done once every
//! worker finished, their writes landed, and its broadcasts are placed. A
//! rank that is done says `Bye`, and leaves ([`Output::Finished`]) once
//! every peer said `Bye` and its own transmits and jobs are complete. So no
//! rank leaves while a peer still needs it, under BSP or SSP, colocated or not.

pub mod factors;
pub mod flow;
pub mod types;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

pub use flow::{CELLS, CELL_BYTES};
pub use types::{
    Blob, Input, Job, JobKind, Limits, Loc, LocalRegion, Output, Payload, Queue, RemoteLoc, SendSrc, Transmit, TxOp,
    DEFAULT_STARTUP,
};

use crate::agree::JobConfig;
use crate::book::{Book, LayerKind, Scheme};
use crate::config::{ApplyOp, Consistency, SchedConfig};
use crate::error::{EngineError, Result};
use crate::fxhash::{FxHashMap as HashMap, FxHashSet as HashSet};
use crate::server::{Server, ServerCommand};
use crate::wire::{self, Hello, Kind, Msg};
use crate::worker::{Worker, WorkerCommand};
use factors::Inbox;
use flow::{Flow, Op};

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
    /// Largest message emitted, bytes.
    pub max_message: u64,
    /// Largest write emitted, bytes.
    pub max_write: u64,
    /// Most factor blocks held at once.
    pub max_factor_blocks: usize,
}

#[derive(Debug, Clone, Copy)]
enum Track {
    Ctrl,
    Init,
    Push { slice: u32 },
    Bcast { chunk: u32, worker: u32 },
    Factors { layer: u32, peer: u32 },
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

#[derive(Debug, Clone, Copy)]
enum JobTrack {
    Accumulate { worker: u32, slot: u32 },
    Apply { chunk: u32 },
    InitCopy { chunk: u32 },
    LocalBcast { chunk: u32 },
    FormGrad { layer: u32 },
    Capture { layer: u32, iter: u64, len: usize },
    Reconstruct { layer: u32, iter: u64 },
    Publish { layer: u32, iter: Option<u64> },
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
    credit_out: BTreeMap<u32, Vec<u32>>,
    local_slots: HashMap<u32, u32>,
}

/// One rank of a job. See the module docs.
#[derive(Debug)]
pub struct Node {
    book: Arc<Book>,
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
    bytes: [u64; 7],
    slot_bytes: u64,
    worker: Option<WorkerSide>,
    server: Option<ServerSide>,
    peers: Vec<Peer>,
    flow: Flow<Track>,
    inbox: Inbox,
    jobs: HashMap<u64, JobTrack>,
    next_job: u64,
    out: VecDeque<Output>,
    now: Duration,
    startup_timeout: Duration,
    deadline: Option<Duration>,
    ready: bool,
    shutdown: bool,
    finished_sent: bool,
    bye_sent: bool,
    done: bool,
    fatal: Option<EngineError>,
    imm_sent: Vec<u64>,
    landed_from: Vec<u64>,
    /// Transmits to peers that left after their goodbye: complete them.
    moot: Vec<(u32, Track)>,
    /// Per peer: writes and factor blocks waiting for it to open (its limits).
    early: Vec<Vec<Early>>,
    /// Peers that are open (hello and regions known).
    open_peers: usize,
    stats: NodeStats,
}

fn extent(book: &Book, offs: &[u64]) -> u64 {
    offs.iter()
        .zip(book.layers())
        .map(|(o, l)| o + l.params() as u64 * 4)
        .max()
        .unwrap_or(0)
}

fn check_offsets(book: &Book, offs: &[u64], what: &str, contiguous: bool) -> Result<()> {
    let bad = |m: String| Err(EngineError::InvalidConfig(format!("{what} buffer: {m}")));
    if offs.len() != book.layers().len() {
        return bad(format!("{} offsets for {} layers", offs.len(), book.layers().len()));
    }
    let mut ranges: Vec<(u64, u64, usize)> = Vec::new();
    for (i, (&o, l)) in offs.iter().zip(book.layers()).enumerate() {
        if o % 4 != 0 {
            return bad(format!("layer {i} ({}) starts at {o}, not a multiple of 4", l.name));
        }
        if contiguous && o - offs[0].min(o) != book.layer_offset(i as u32) as u64 * 4 {
            return bad(format!(
                "layer {i} starts at {o}, but parameters must be back to back from {} (expected {})",
                offs[0],
                offs[0] + book.layer_offset(i as u32) as u64 * 4
            ));
        }
        ranges.push((o, o + l.params() as u64 * 4, i));
    }
    ranges.sort();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return bad(format!(
                "layers {} ({}) and {} ({}) overlap",
                w[0].2,
                book.layers()[w[0].2].name,
                w[1].2,
                book.layers()[w[1].2].name
            ));
        }
    }
    Ok(())
}

fn region_index(r: LocalRegion) -> usize {
    LocalRegion::ALL.iter().position(|x| *x == r).expect("listed")
}

impl Node {
    /// The Node for `cfg.rank`. Fails on a configuration that cannot work:
    /// the rank outside the cluster, bad buffer layouts, or transport limits
    /// too small for the protocol's control messages.
    pub fn new(cfg: NodeConfig) -> Result<Self> {
        cfg.sched.validate()?;
        let book = cfg.book.clone();
        let rank = cfg.rank;
        let role = book.cluster().role(rank).ok_or_else(|| {
            EngineError::InvalidConfig(format!(
                "rank {rank} is outside the cluster of {}",
                book.cluster().world()
            ))
        })?;
        let l = cfg.limits;
        if l.max_outstanding == 0 {
            return Err(EngineError::InvalidConfig(
                "the transport's max_outstanding must be at least 1".into(),
            ));
        }
        if l.max_message_bytes < wire::MAX_CONTROL || l.max_write_bytes < 4 {
            return Err(EngineError::InvalidConfig(format!(
                "the transport's limits are too small: messages of {} bytes (at least {} needed), writes of {} bytes",
                l.max_message_bytes,
                wire::MAX_CONTROL,
                l.max_write_bytes
            )));
        }
        let nl = book.layers().len();
        let contiguous: Vec<u64> = (0..nl as u32).map(|i| book.layer_offset(i) as u64 * 4).collect();
        let user_params = match cfg.params {
            Some(p) => {
                check_offsets(&book, &p, "parameter", true)?;
                p
            }
            None => contiguous.clone(),
        };
        let grad_off = match cfg.grads {
            Some(g) => {
                check_offsets(&book, &g, "gradient", false)?;
                g
            }
            None => contiguous.clone(),
        };
        // Under SSP a server may write a layer the caller holds: the caller
        // reads a view published from the landing zone instead.
        let staged = role.is_worker() && cfg.sched.consistency != Consistency::Bsp;
        let (param_off, view_off) = if staged {
            (contiguous.clone(), user_params)
        } else {
            (user_params, Vec::new())
        };
        let k = book.config().batch as u64;
        let mut factor_off = Vec::with_capacity(nl);
        let mut factors_bytes = 0u64;
        for spec in book.layers() {
            if spec.kind == LayerKind::Fc && role.is_worker() {
                factor_off.push(Some(factors_bytes));
                factors_bytes += k * (spec.m + spec.n) as u64 * 4;
            } else {
                factor_off.push(None);
            }
        }
        let slot_bytes = book.max_slice_len() as u64 * 4;
        let mut bytes = [0u64; 7];
        if role.is_worker() {
            bytes[region_index(LocalRegion::Params)] = extent(&book, &param_off);
            bytes[region_index(LocalRegion::View)] = if staged { extent(&book, &view_off) } else { 0 };
            bytes[region_index(LocalRegion::Grads)] = extent(&book, &grad_off);
            bytes[region_index(LocalRegion::Factors)] = factors_bytes;
        }
        if role.is_server() {
            bytes[region_index(LocalRegion::Shard)] = book.shard_len(rank) as u64 * 4;
            bytes[region_index(LocalRegion::Landing)] = book.p1() as u64 * u64::from(cfg.sched.slots) * slot_bytes;
        }
        bytes[region_index(LocalRegion::Ctrl)] = (CELLS * CELL_BYTES) as u64;
        let worker = if role.is_worker() {
            Some(WorkerSide {
                core: Worker::new(book.clone(), rank, cfg.sched)?,
                forming: vec![false; nl],
                want: HashSet::default(),
                publish_started: false,
                publish_left: 0,
            })
        } else {
            None
        };
        let server = if role.is_server() {
            Some(ServerSide {
                core: Server::new(book.clone(), rank, cfg.sched)?,
                apply_running: HashMap::default(),
                deferred: HashMap::default(),
                credit_out: BTreeMap::new(),
                local_slots: HashMap::default(),
            })
        } else {
            None
        };
        let world = book.cluster().world();
        let mut peers = vec![Peer::default(); world];
        peers[rank as usize].open = true;
        let mut flow = Flow::new(world, l.max_outstanding);
        flow.open(rank);
        Ok(Node {
            job: JobConfig::new(&book, &cfg.sched, cfg.apply, &cfg.transport),
            inbox: Inbox::new(world, book.p1()),
            sched: cfg.sched,
            limits: l,
            keys: [0; 3],
            staged,
            param_off,
            view_off,
            grad_off,
            factor_off,
            bytes,
            slot_bytes,
            worker,
            server,
            peers,
            flow,
            jobs: HashMap::default(),
            next_job: 1,
            out: VecDeque::new(),
            now: Duration::ZERO,
            startup_timeout: cfg.startup_timeout,
            deadline: None,
            ready: false,
            shutdown: false,
            finished_sent: false,
            bye_sent: false,
            done: false,
            fatal: None,
            imm_sent: vec![0; world],
            landed_from: vec![0; world],
            moot: Vec::new(),
            early: (0..world).map(|_| Vec::new()).collect(),
            open_peers: 0,
            stats: NodeStats::default(),
            book,
            rank,
        })
    }

    /// The keys of this rank's Params, Shard and Landing regions (0 where it
    /// has none), announced in the hello. Call before the first `Connected`.
    pub fn set_keys(&mut self, keys: [u32; 3]) {
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
        let f = self.factor_off[l].map(|o| Loc {
            region: LocalRegion::Factors,
            offset: o,
        });
        Some((params, grad, f))
    }

    /// Where `layer`'s parameters land in the `Params` region (the caller's
    /// view under BSP; the landing zone under SSP). The initial values go here.
    pub fn params_loc(&self, layer: u32) -> Option<Loc> {
        self.worker.as_ref()?;
        Some(Loc {
            region: LocalRegion::Params,
            offset: *self.param_off.get(layer as usize)?,
        })
    }

    /// Accumulator copies of the shard a server keeps (`s + 1` under SSP(s)).
    pub fn windows(&self) -> usize {
        self.server.as_ref().map_or(0, |s| s.core.windows())
    }
    /// Whether this rank's callers read a published view (SSP workers).
    pub fn is_staged(&self) -> bool {
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
        self.ready
    }
    /// The goodbye is complete.
    pub fn is_finished(&self) -> bool {
        self.done
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
            s.max_bytes_in_flight = ws.max_bytes_in_flight;
        }
        if let Some(sv) = &self.server {
            let st = sv.core.stats();
            s.accumulated = st.accumulated;
            s.applies = st.applies;
            s.broadcasts = st.broadcasts;
            s.max_slots_held = st.max_slots_held;
        }
        s.max_outstanding = self.flow.max_out_seen;
        s
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
        if self.fatal.is_some() || self.done {
            return None;
        }
        let d = if self.ready { None } else { self.deadline };
        match (d, self.flow.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Feeds one input at time `now` (any monotonic clock; the simulator's
    /// is virtual). Errors are the caller's: a bad hand-in. Everything that
    /// fails the rank comes out as [`Output::Fatal`].
    pub fn handle(&mut self, now: Duration, input: Input) -> Result<()> {
        self.now = now;
        if self.deadline.is_none() {
            self.deadline = Some(now + self.startup_timeout);
        }
        if let Some(e) = &self.fatal {
            return match input {
                Input::HandIn { .. } | Input::Shutdown => Err(e.clone()),
                _ => Ok(()),
            };
        }
        let r = match input {
            Input::HandIn { layer, factors } => self.hand_in(layer, factors),
            Input::Shutdown => {
                self.shutdown = true;
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
        r
    }

    fn input(&mut self, input: Input) -> Result<()> {
        match input {
            Input::HandIn { .. } | Input::Shutdown => unreachable!("handled by the caller"),
            Input::Connected { peer } => self.connected(peer),
            Input::PeerRegionsKnown { peer } => {
                let p = self.peer_mut(peer)?;
                if !p.hello {
                    return Err(EngineError::Protocol {
                        rank: peer,
                        what: "regions known before its hello".into(),
                    });
                }
                if !p.open {
                    p.open = true;
                    self.open_peers += 1;
                }
                self.flow.open(peer);
                for e in std::mem::take(&mut self.early[peer as usize]) {
                    match e {
                        Early::Write {
                            src,
                            dst,
                            len,
                            imm,
                            track,
                        } => self.write(peer, src, dst, len, imm, track),
                        Early::Factors { layer, iter } => self.send_factors(peer, layer, iter),
                    }
                }
                Ok(())
            }
            Input::Done { token } => match self.flow.done(token) {
                Some((peer, track)) => self.tx_done(peer, track),
                None if self.flow.was_dropped(token) => Ok(()),
                None => Err(EngineError::Protocol {
                    rank: self.rank,
                    what: format!("completion of unknown transmit {token}"),
                }),
            },
            Input::Failed { token, reason } => {
                if self.flow.was_dropped(token) {
                    return Ok(());
                }
                let peer = self.flow.done(token).map_or(u32::MAX, |(p, _)| p);
                Err(EngineError::PeerLost {
                    rank: peer,
                    reason: format!("an operation failed: {reason}"),
                })
            }
            Input::Blocked { token } => {
                if self.flow.blocked(token, self.now) || self.flow.was_dropped(token) {
                    Ok(())
                } else {
                    Err(EngineError::Protocol {
                        rank: self.rank,
                        what: format!("back-pressure on unknown transmit {token}"),
                    })
                }
            }
            Input::Landed {
                peer,
                region,
                offset,
                len,
                imm,
            } => self.landed(peer, region, offset, len, imm),
            Input::Message { peer, tag, data } => self.message(peer, tag, data),
            Input::Closed { peer, error } => {
                let p = self.peer_mut(peer)?;
                p.closed = true;
                if p.bye.is_some() {
                    // It needs nothing more: what was still on its way to it
                    // (a peer that died after its goodbye) counts as delivered.
                    for track in self.flow.drop_peer(peer) {
                        self.tx_done(peer, track)?;
                    }
                    return Ok(());
                }
                Err(EngineError::PeerLost {
                    rank: peer,
                    reason: match error {
                        Some(e) => e,
                        None => "it closed the connection without saying goodbye (did the process exit?)".into(),
                    },
                })
            }
            Input::JobDone { id, data } => self.job_done(id, data),
            Input::JobFailed { id, reason } => Err(EngineError::Job(format!("job {id}: {reason}"))),
            Input::Abort { reason } => Err(EngineError::Aborted(reason)),
            Input::Tick => {
                self.flow.tick(self.now);
                if !self.ready && self.deadline.is_some_and(|d| self.now >= d) {
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
        let missing: Vec<u32> = (0..self.peers.len() as u32)
            .filter(|&r| r != self.rank && !self.peers[r as usize].open)
            .collect();
        if !missing.is_empty() {
            format!("connections and hellos from ranks {missing:?}")
        } else {
            "the initial parameters from worker rank 0".into()
        }
    }

    fn peer_mut(&mut self, peer: u32) -> Result<&mut Peer> {
        let me = self.rank;
        match self.peers.get_mut(peer as usize) {
            Some(p) if peer != me => Ok(p),
            _ => Err(EngineError::Protocol {
                rank: peer,
                what: format!("an event names rank {peer}, which is not a peer of rank {me}"),
            }),
        }
    }

    fn fail(&mut self, e: EngineError) {
        if self.fatal.is_some() {
            return;
        }
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
        let id = self.next_job;
        self.next_job += 1;
        self.jobs.insert(id, track);
        self.out.push_back(Output::Job(Job { id, queue, kind }));
    }

    fn send_ctrl(&mut self, peer: u32, msg: &Msg) {
        let (tag, bytes) = wire::encode(msg);
        debug_assert!(bytes.len() <= CELL_BYTES);
        self.stats.max_message = self.stats.max_message.max(bytes.len() as u64);
        let gated = !matches!(msg, Msg::Hello(_));
        self.enqueue(peer, Op::SendInline { tag, bytes }, Track::Ctrl, gated);
    }

    /// Queues a transmit. To a peer that left after its goodbye, nothing
    /// goes: it needs nothing more, so the transmit counts as delivered.
    fn enqueue(&mut self, peer: u32, op: Op, track: Track, gated: bool) {
        if self.flow.is_gone(peer) {
            self.moot.push((peer, track));
        } else {
            self.flow.push(peer, op, track, gated);
        }
    }

    /// Queues a write, split into pieces of at most the transport's write cap;
    /// the last piece carries the immediate and the track.
    fn write(&mut self, peer: u32, src: Loc, dst: RemoteLoc, len: u64, imm: u32, track: Track) {
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
        let mut off = 0;
        while off < len {
            let n = (len - off).min(max);
            let last = off + n == len;
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
        self.imm_sent[peer as usize] += 1;
    }

    /// The largest message to `peer`: the smaller of the two transports'
    /// caps (the peer's is known once it is open: transmits that need it
    /// wait in `early` until then).
    fn message_cap(&self, peer: u32) -> u64 {
        (self.limits.max_message_bytes as u64).min(self.peers[peer as usize].max_message)
    }

    /// The largest write to `peer`, a multiple of 4.
    fn write_cap(&self, peer: u32) -> u64 {
        (self.limits.max_write_bytes as u64).min(self.peers[peer as usize].max_write) / 4 * 4
    }

    // ----- setup -------------------------------------------------------------

    fn connected(&mut self, peer: u32) -> Result<()> {
        let world = self.peers.len() as u32;
        let p = self.peer_mut(peer)?;
        if p.connected {
            return Err(EngineError::Protocol {
                rank: peer,
                what: "connected twice".into(),
            });
        }
        p.connected = true;
        let hello = Msg::Hello(Hello {
            version: u16::from(wire::VERSION),
            rank: self.rank,
            world,
            keys: self.keys,
            params_base: self.param_off.first().copied().unwrap_or(0),
            max_message: self.limits.max_message_bytes as u64,
            max_write: self.limits.max_write_bytes as u64,
            fields: self.job.fields().to_vec(),
        });
        self.send_ctrl(peer, &hello);
        Ok(())
    }

    fn hello(&mut self, peer: u32, h: Hello) -> Result<()> {
        let bad = |what: String| EngineError::Protocol { rank: peer, what };
        if h.version != u16::from(wire::VERSION) {
            return Err(bad(format!(
                "it speaks protocol version {}, this rank {}",
                h.version,
                wire::VERSION
            )));
        }
        if h.rank != peer {
            return Err(bad(format!("its hello names rank {}", h.rank)));
        }
        if h.world as usize != self.peers.len() {
            return Err(EngineError::Disagree {
                rank: peer,
                field: "world size",
                theirs: h.world.to_string(),
                reference: "this rank".into(),
                ours: self.peers.len().to_string(),
            });
        }
        self.job.check(peer, &h.fields)?;
        let role = self.book.cluster().role(peer).expect("in the world");
        for (i, needed) in [role.is_worker(), role.is_server(), role.is_server()]
            .into_iter()
            .enumerate()
        {
            if needed && h.keys[i] == 0 && self.needs_region(peer, i) {
                return Err(bad(format!(
                    "it announced no {} region",
                    ["parameter", "shard", "landing"][i]
                )));
            }
        }
        if h.max_message < wire::MAX_CONTROL as u64 || h.max_write < 4 {
            return Err(bad(format!(
                "its transport takes messages of {} bytes and writes of {} (the protocol needs at least {} and 4)",
                h.max_message,
                h.max_write,
                wire::MAX_CONTROL
            )));
        }
        let p = self.peer_mut(peer)?;
        p.hello = true;
        p.keys = h.keys;
        p.params_base = h.params_base;
        p.max_message = h.max_message;
        p.max_write = h.max_write;
        self.out.push_back(Output::PeerKeys { peer, keys: h.keys });
        Ok(())
    }

    /// Whether this rank writes into `peer`'s region `i` (0 params, 1 shard, 2 landing).
    fn needs_region(&self, peer: u32, i: usize) -> bool {
        match i {
            0 => self.server.is_some(),
            1 => self.worker.as_ref().is_some_and(|w| w.core.index() == 0) && self.book.shard_len(peer) > 0,
            _ => self.worker.is_some() && self.book.shard_len(peer) > 0,
        }
    }

    // ----- the caller --------------------------------------------------------

    fn hand_in(&mut self, layer: u32, factors: bool) -> Result<()> {
        if self.shutdown {
            return Err(EngineError::Shutdown);
        }
        let spec = self.book.layer(layer)?.clone();
        let rank = self.rank;
        let k = self.book.config().batch as u64;
        let staged = self.staged;
        let Some(w) = self.worker.as_mut() else {
            return Err(EngineError::InvalidConfig(format!("rank {rank} is not a worker")));
        };
        if w.forming[layer as usize] || w.core.is_in_flight(layer) {
            return Err(EngineError::LayerBusy {
                layer,
                name: spec.name.clone(),
                iter: w.core.completed(layer),
            });
        }
        let _ = staged;
        if !factors {
            return w.core.grad_ready(layer);
        }
        if spec.kind != LayerKind::Fc {
            return Err(EngineError::NotFullyConnected {
                layer,
                name: spec.name.clone(),
            });
        }
        let f = Loc {
            region: LocalRegion::Factors,
            offset: self.factor_off[layer as usize].expect("FC layers have factors"),
        };
        match w.core.next_scheme(layer)? {
            Scheme::Sfb => {
                let iter = w.core.completed(layer);
                let len = k * (spec.m + spec.n) as u64 * 4;
                w.core.sf_ready(layer)?;
                self.new_job(
                    Queue::Worker,
                    JobKind::CaptureFactors { layer, factors: f, len },
                    JobTrack::Capture {
                        layer,
                        iter,
                        len: len as usize,
                    },
                );
            }
            Scheme::Ps => {
                w.forming[layer as usize] = true;
                let grad = Loc {
                    region: LocalRegion::Grads,
                    offset: self.grad_off[layer as usize],
                };
                self.new_job(
                    Queue::Worker,
                    JobKind::FactorsToGrad {
                        layer,
                        factors: f,
                        grad,
                    },
                    JobTrack::FormGrad { layer },
                );
            }
        }
        Ok(())
    }

    // ----- core commands ---------------------------------------------------------

    fn drive(&mut self) {
        loop {
            let mut progressed = false;
            for (peer, track) in std::mem::take(&mut self.moot) {
                progressed = true;
                if let Err(e) = self.tx_done(peer, track) {
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
        self.check_shutdown();
        self.stats.max_factor_blocks = self.stats.max_factor_blocks.max(self.inbox.held());
        // Writes into a peer's parameters are addressed from the base its hello announced.
        let start = self.out.len();
        self.flow.pump(self.now, &mut self.out);
        for o in self.out.range_mut(start..) {
            if let Output::Transmit(Transmit {
                peer,
                op: TxOp::Write { dst, .. },
                ..
            }) = o
            {
                if dst.region == LocalRegion::Params {
                    dst.offset += self.peers[*peer as usize].params_base;
                }
            }
        }
    }

    fn worker_cmd(&mut self, cmd: WorkerCommand) -> Result<()> {
        let book = self.book.clone();
        let me = self.rank;
        match cmd {
            WorkerCommand::InitPush { server, chunk } => {
                let ch = book.chunks()[chunk as usize];
                let src = Loc {
                    region: LocalRegion::Params,
                    offset: self.param_off[ch.layer as usize] + ch.offset as u64 * 4,
                };
                let len = ch.len as u64 * 4;
                let shard_at = ch.shard_offset as u64 * 4;
                if server == me {
                    let dst = Loc {
                        region: LocalRegion::Shard,
                        offset: shard_at,
                    };
                    self.new_job(
                        Queue::Server,
                        JobKind::Copy { src, dst, len },
                        JobTrack::InitCopy { chunk },
                    );
                } else {
                    let dst = RemoteLoc {
                        region: LocalRegion::Shard,
                        offset: shard_at,
                    };
                    self.write(server, src, dst, len, chunk, Track::Init);
                }
            }
            WorkerCommand::Push {
                server, slot, slice, ..
            } => {
                let si = book.slices()[slice as usize];
                if server == me {
                    let s = self.server.as_mut().expect("colocated");
                    s.local_slots.insert(slot, slice);
                    s.core.handle_landed(me, slot, slice)?;
                } else {
                    let wi = self.worker.as_ref().expect("worker").core.index() as u64;
                    let src = Loc {
                        region: LocalRegion::Grads,
                        offset: self.grad_off[si.layer as usize] + si.offset as u64 * 4,
                    };
                    let dst = RemoteLoc {
                        region: LocalRegion::Landing,
                        offset: (wi * u64::from(self.sched.slots) + u64::from(slot)) * self.slot_bytes,
                    };
                    self.write(server, src, dst, si.len as u64 * 4, slice, Track::Push { slice });
                }
            }
            WorkerCommand::SendFactors { peer, layer, iter } => {
                if !self.peers[peer as usize].open {
                    self.early[peer as usize].push(Early::Factors { layer, iter });
                    return Ok(());
                }
                self.send_factors(peer, layer, iter);
            }
            WorkerCommand::Reconstruct { layer, iter } => self.reconstruct(layer, iter),
            WorkerCommand::LayerReady { layer, iter } => {
                if self.staged {
                    self.publish(layer, Some(iter));
                } else {
                    self.out.push_back(Output::LayerReady { layer, iter });
                }
            }
        }
        Ok(())
    }

    /// Queues a factor block: its begin message, then fragments of at most
    /// the message cap, sent zero-copy from the factor region.
    fn send_factors(&mut self, peer: u32, layer: u32, iter: u64) {
        let spec = &self.book.layers()[layer as usize];
        let total = self.book.config().batch as u64 * (spec.m + spec.n) as u64 * 4;
        let base = self.factor_off[layer as usize].expect("FC");
        self.send_ctrl(peer, &Msg::FactorsBegin { layer, iter, total });
        let frag = self.message_cap(peer);
        let mut off = 0;
        while off < total {
            let n = (total - off).min(frag);
            let last = off + n == total;
            self.stats.max_message = self.stats.max_message.max(n);
            let track = if last {
                Track::Factors { layer, peer }
            } else {
                Track::Piece
            };
            let at = Loc {
                region: LocalRegion::Factors,
                offset: base + off,
            };
            let tag = Kind::FactorData.tag();
            self.enqueue(peer, Op::SendRegion { tag, at, len: n }, track, true);
            off += n;
        }
    }

    fn publish(&mut self, layer: u32, iter: Option<u64>) {
        let len = self.book.layers()[layer as usize].params() as u64 * 4;
        let src = Loc {
            region: LocalRegion::Params,
            offset: self.param_off[layer as usize],
        };
        let dst = Loc {
            region: LocalRegion::View,
            offset: self.view_off[layer as usize],
        };
        self.new_job(
            Queue::Worker,
            JobKind::Publish { layer, src, dst, len },
            JobTrack::Publish { layer, iter },
        );
    }

    fn reconstruct(&mut self, layer: u32, iter: u64) {
        match self.inbox.take(layer, iter) {
            Some(factors) => {
                let params = Loc {
                    region: LocalRegion::Params,
                    offset: self.param_off[layer as usize],
                };
                self.new_job(
                    Queue::Worker,
                    JobKind::Reconstruct {
                        layer,
                        iter,
                        params,
                        factors,
                    },
                    JobTrack::Reconstruct { layer, iter },
                );
            }
            None => {
                self.worker.as_mut().expect("worker").want.insert((layer, iter));
            }
        }
    }

    fn factors_in(&mut self, layer: u32, iter: u64, wi: usize, blob: Blob) -> Result<()> {
        let from = self.book.cluster().workers()[wi];
        self.inbox
            .put(layer, iter, wi, blob)
            .map_err(|what| EngineError::Protocol { rank: from, what })?;
        let w = self.worker.as_mut().expect("worker");
        if from != self.rank {
            w.core.handle_factors_arrived(layer, iter, from)?;
        }
        if w.want.remove(&(layer, iter)) {
            self.reconstruct(layer, iter);
        }
        Ok(())
    }

    fn server_cmd(&mut self, cmd: ServerCommand) -> Result<()> {
        let book = self.book.clone();
        let me = self.rank;
        match cmd {
            ServerCommand::Accumulate {
                worker,
                slot,
                slice,
                window,
                first,
            } => {
                let si = book.slices()[slice as usize];
                let ch = book.chunks()[si.chunk as usize];
                let src = if worker == me {
                    Loc {
                        region: LocalRegion::Grads,
                        offset: self.grad_off[si.layer as usize] + si.offset as u64 * 4,
                    }
                } else {
                    let wi = book.cluster().worker_index(worker).expect("checked by the core") as u64;
                    Loc {
                        region: LocalRegion::Landing,
                        offset: (wi * u64::from(self.sched.slots) + u64::from(slot)) * self.slot_bytes,
                    }
                };
                self.new_job(
                    Queue::Server,
                    JobKind::Accumulate {
                        window,
                        chunk: si.chunk,
                        acc_at: ch.shard_offset + (si.offset - ch.offset),
                        src,
                        len: si.len,
                        first,
                        contributions: book.p1(),
                    },
                    JobTrack::Accumulate { worker, slot },
                );
            }
            ServerCommand::Apply { chunk, iter, window } => {
                let ch = book.chunks()[chunk as usize];
                let id = self.next_job;
                self.new_job(
                    Queue::Server,
                    JobKind::Apply {
                        window,
                        chunk,
                        iter,
                        shard_at: ch.shard_offset,
                        len: ch.len,
                    },
                    JobTrack::Apply { chunk },
                );
                self.server.as_mut().expect("server").apply_running.insert(chunk, id);
            }
            ServerCommand::Broadcast { chunk, worker } => {
                let s = self.server.as_mut().expect("server");
                if s.apply_running.contains_key(&chunk) {
                    s.deferred.entry(chunk).or_default().push(worker);
                } else {
                    self.broadcast(chunk, worker);
                }
            }
        }
        Ok(())
    }

    fn broadcast(&mut self, chunk: u32, worker: u32) {
        let book = self.book.clone();
        let ch = book.chunks()[chunk as usize];
        let src = Loc {
            region: LocalRegion::Shard,
            offset: ch.shard_offset as u64 * 4,
        };
        let len = ch.len as u64 * 4;
        if worker == self.rank {
            let dst = Loc {
                region: LocalRegion::Params,
                offset: self.param_off[ch.layer as usize] + ch.offset as u64 * 4,
            };
            self.new_job(
                Queue::Worker,
                JobKind::Copy { src, dst, len },
                JobTrack::LocalBcast { chunk },
            );
        } else {
            // Relative to the worker's base; `drive` adds it when the write goes out.
            let dst = RemoteLoc {
                region: LocalRegion::Params,
                offset: (book.layer_offset(ch.layer) + ch.offset) as u64 * 4,
            };
            self.write(worker, src, dst, len, chunk, Track::Bcast { chunk, worker });
        }
    }

    fn flush_credits(&mut self) {
        let Some(s) = self.server.as_mut() else { return };
        if s.credit_out.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut s.credit_out);
        for (w, slots) in pending {
            for part in slots.chunks(wire::MAX_CREDITS) {
                self.send_ctrl(w, &Msg::Credit(part.to_vec()));
            }
        }
    }

    // ----- completions ------------------------------------------------------------

    fn tx_done(&mut self, _peer: u32, track: Track) -> Result<()> {
        match track {
            Track::Ctrl | Track::Init | Track::Piece => Ok(()),
            Track::Push { slice } => self.worker.as_mut().expect("worker").core.handle_push_done(slice),
            Track::Bcast { chunk, worker } => self
                .server
                .as_mut()
                .expect("server")
                .core
                .handle_broadcast_done(chunk, worker),
            Track::Factors { layer, peer } => self
                .worker
                .as_mut()
                .expect("worker")
                .core
                .handle_factors_sent(layer, peer),
        }
    }

    fn job_done(&mut self, id: u64, data: Option<Vec<u8>>) -> Result<()> {
        let me = self.rank;
        let track = self.jobs.remove(&id).ok_or_else(|| EngineError::Protocol {
            rank: me,
            what: format!("completion of unknown job {id}"),
        })?;
        match track {
            JobTrack::Accumulate { worker, slot } => {
                if worker == me {
                    let s = self.server.as_mut().expect("server");
                    let slice = s.local_slots.remove(&slot).ok_or_else(|| EngineError::Protocol {
                        rank: me,
                        what: format!("local slot {slot} was not taken"),
                    })?;
                    let w = self.worker.as_mut().expect("colocated");
                    w.core.handle_push_done(slice)?;
                    w.core.handle_credit(me, slot)?;
                } else {
                    self.server
                        .as_mut()
                        .expect("server")
                        .credit_out
                        .entry(worker)
                        .or_default()
                        .push(slot);
                }
            }
            JobTrack::Apply { chunk } => {
                let s = self.server.as_mut().expect("server");
                s.apply_running.remove(&chunk);
                for w in s.deferred.remove(&chunk).unwrap_or_default() {
                    self.broadcast(chunk, w);
                }
            }
            JobTrack::InitCopy { chunk } => self.server.as_mut().expect("server").core.handle_init(me, chunk)?,
            JobTrack::LocalBcast { chunk } => {
                self.worker.as_mut().expect("worker").core.handle_params(chunk)?;
                self.server
                    .as_mut()
                    .expect("server")
                    .core
                    .handle_broadcast_done(chunk, me)?;
            }
            JobTrack::FormGrad { layer } => {
                let w = self.worker.as_mut().expect("worker");
                w.forming[layer as usize] = false;
                w.core.grad_ready(layer)?;
            }
            JobTrack::Capture { layer, iter, len } => {
                let blob = match data {
                    Some(b) if b.len() == len => Blob::Bytes(b),
                    Some(b) => {
                        return Err(EngineError::Job(format!(
                            "captured {} bytes of factors of layer {layer}, expected {len}",
                            b.len()
                        )))
                    }
                    None => Blob::Opaque(len),
                };
                let wi = self.worker.as_ref().expect("worker").core.index();
                self.factors_in(layer, iter, wi, blob)?;
            }
            JobTrack::Reconstruct { layer, iter } => self
                .worker
                .as_mut()
                .expect("worker")
                .core
                .handle_factors_applied(layer, iter)?,
            JobTrack::Publish { layer, iter } => match iter {
                Some(iter) => self.out.push_back(Output::LayerReady { layer, iter }),
                None => self.worker.as_mut().expect("worker").publish_left -= 1,
            },
        }
        Ok(())
    }

    // ----- arrivals -------------------------------------------------------------

    fn landed(&mut self, peer: u32, region: LocalRegion, offset: u64, len: u64, imm: u32) -> Result<()> {
        self.peer_mut(peer)?;
        self.landed_from[peer as usize] += 1;
        let bad = |what: String| EngineError::Protocol { rank: peer, what };
        let book = self.book.clone();
        let slots = u64::from(self.sched.slots);
        let slot_bytes = self.slot_bytes;
        match region {
            LocalRegion::Landing => {
                let s = self
                    .server
                    .as_mut()
                    .ok_or_else(|| bad("a push to a rank that is not a server".into()))?;
                let wi = book
                    .cluster()
                    .worker_index(peer)
                    .ok_or_else(|| bad("a push from a rank that is not a worker".into()))?
                    as u64;
                let si = book
                    .slices()
                    .get(imm as usize)
                    .ok_or_else(|| bad(format!("a push of unknown slice {imm}")))?;
                let g = offset / slot_bytes;
                let start = g * slot_bytes;
                if g / slots != wi || len == 0 || offset + len != start + si.len as u64 * 4 {
                    return Err(bad(format!(
                        "a push of slice {imm} ({} bytes) at offset {offset}+{len}, outside the sender's landing slots",
                        si.len * 4
                    )));
                }
                s.core.handle_landed(peer, (g % slots) as u32, imm)
            }
            LocalRegion::Shard => {
                let s = self
                    .server
                    .as_mut()
                    .ok_or_else(|| bad("seeding a rank that is not a server".into()))?;
                let ch = book
                    .chunks()
                    .get(imm as usize)
                    .ok_or_else(|| bad(format!("seeding unknown chunk {imm}")))?;
                let (a, b) = (ch.shard_offset as u64 * 4, (ch.shard_offset + ch.len) as u64 * 4);
                if ch.server != self.rank || len == 0 || offset < a || offset + len != b {
                    return Err(bad(format!("seeding chunk {imm} at {offset}+{len}, outside it")));
                }
                s.core.handle_init(peer, imm)
            }
            LocalRegion::Params => {
                let base = self.param_off.first().copied().unwrap_or(0);
                let w = self
                    .worker
                    .as_mut()
                    .ok_or_else(|| bad("parameters for a rank that is not a worker".into()))?;
                let ch = book
                    .chunks()
                    .get(imm as usize)
                    .ok_or_else(|| bad(format!("parameters of unknown chunk {imm}")))?;
                let a = base + (book.layer_offset(ch.layer) + ch.offset) as u64 * 4;
                let b = a + ch.len as u64 * 4;
                if ch.server != peer || len == 0 || offset < a || offset + len != b {
                    return Err(bad(format!("parameters of chunk {imm} at {offset}+{len}, outside it")));
                }
                w.core.handle_params(imm)
            }
            other => Err(bad(format!("a write into the {other:?} region"))),
        }
    }

    fn message(&mut self, peer: u32, tag: u32, data: Payload) -> Result<()> {
        let bad = |what: String| EngineError::Protocol { rank: peer, what };
        let kind = wire::kind_of(tag).map_err(|e| bad(e.to_string()))?;
        let hello_seen = self.peer_mut(peer)?.hello;
        if kind != Kind::Hello && !hello_seen {
            return Err(bad(format!("a {kind:?} message before its hello")));
        }
        if kind == Kind::FactorData {
            if self.worker.is_none() {
                return Err(bad("factors sent to a rank that is not a worker".into()));
            }
            if let Some((layer, iter, blob)) = self.inbox.data(peer, data).map_err(bad)? {
                let wi = self.book.cluster().worker_index(peer).expect("checked at begin");
                self.factors_in(layer, iter, wi, blob)?;
            }
            return Ok(());
        }
        let Payload::Bytes(bytes) = data else {
            return Err(bad(format!("a {kind:?} message without bytes")));
        };
        match wire::decode(tag, &bytes).map_err(|e| bad(e.to_string()))? {
            Msg::Hello(h) => {
                if hello_seen {
                    return Err(bad("a second hello".into()));
                }
                self.hello(peer, h)
            }
            Msg::Credit(slots) => {
                let w = self
                    .worker
                    .as_mut()
                    .ok_or_else(|| bad("credit sent to a rank that is not a worker".into()))?;
                for s in slots {
                    w.core.handle_credit(peer, s)?;
                }
                Ok(())
            }
            Msg::FactorsBegin { layer, iter, total } => {
                let book = self.book.clone();
                let w = self
                    .worker
                    .as_ref()
                    .ok_or_else(|| bad("factors sent to a rank that is not a worker".into()))?;
                let _ = w;
                if book.cluster().worker_index(peer).is_none() {
                    return Err(bad("factors from a rank that is not a worker".into()));
                }
                let spec = book.layer(layer).map_err(|e| bad(e.to_string()))?;
                let want = book.config().batch as u64 * (spec.m + spec.n) as u64 * 4;
                if spec.kind != LayerKind::Fc || book.scheme(layer, iter) != Scheme::Sfb || total != want {
                    return Err(bad(format!(
                        "a factor block of {total} bytes for layer {layer} ({}), which syncs by {:?} ({want} bytes expected)",
                        spec.name,
                        book.scheme(layer, iter)
                    )));
                }
                self.inbox.begin(peer, layer, iter, total as usize).map_err(bad)
            }
            Msg::FactorData => unreachable!("handled above"),
            Msg::Finished { writes } => {
                let p = self.peer_mut(peer)?;
                if p.finished.is_some() {
                    return Err(bad("finished twice".into()));
                }
                p.finished = Some(writes);
                Ok(())
            }
            Msg::Bye { writes } => {
                let p = self.peer_mut(peer)?;
                if p.bye.is_some() {
                    return Err(bad("said goodbye twice".into()));
                }
                p.bye = Some(writes);
                Ok(())
            }
            Msg::Abort(reason) => Err(EngineError::PeerAborted { rank: peer, reason }),
        }
    }

    // ----- lifecycle --------------------------------------------------------------

    fn check_ready(&mut self) {
        if self.ready {
            return;
        }
        if self.open_peers + 1 < self.peers.len() {
            return;
        }
        let initialized = match (&mut self.worker, &self.server) {
            (Some(w), _) => {
                if !w.core.is_initialized() {
                    false
                } else if !self.staged {
                    true
                } else if !w.publish_started {
                    w.publish_started = true;
                    w.publish_left = self.book.layers().len();
                    for l in 0..self.book.layers().len() as u32 {
                        self.publish(l, None);
                    }
                    false
                } else {
                    self.worker.as_ref().expect("worker").publish_left == 0
                }
            }
            (None, Some(s)) => s.core.is_initialized(),
            (None, None) => true,
        };
        if initialized {
            self.ready = true;
            self.out.push_back(Output::Ready);
        }
    }

    fn pending_jobs(&self, queue: Queue) -> usize {
        self.jobs
            .values()
            .filter(|t| {
                let q = match t {
                    JobTrack::Accumulate { .. } | JobTrack::Apply { .. } | JobTrack::InitCopy { .. } => Queue::Server,
                    _ => Queue::Worker,
                };
                q == queue
            })
            .count()
    }

    fn peer_done(&self, p: u32, count: Option<u64>) -> bool {
        count.is_some_and(|n| self.landed_from[p as usize] >= n)
    }

    fn check_shutdown(&mut self) {
        if !self.shutdown || !self.ready || self.done {
            return;
        }
        let world = self.peers.len() as u32;
        let me = self.rank;
        if !self.finished_sent {
            let idle = match &self.worker {
                None => true,
                Some(w) => {
                    (0..self.book.layers().len() as u32).all(|l| !w.core.is_in_flight(l))
                        && !w.forming.contains(&true)
                        && w.core.bytes_in_flight() == 0
                        && self.pending_jobs(Queue::Worker) == 0
                }
            };
            if !idle {
                return;
            }
            self.finished_sent = true;
            if self.worker.is_some() {
                for p in (0..world).filter(|&p| p != me) {
                    let writes = self.imm_sent[p as usize];
                    self.send_ctrl(p, &Msg::Finished { writes });
                }
            }
        }
        if !self.bye_sent {
            let server_done = match &self.server {
                None => true,
                Some(s) => {
                    let workers_done = self
                        .book
                        .cluster()
                        .workers()
                        .iter()
                        .all(|&w| w == self.rank || self.peer_done(w, self.peers[w as usize].finished));
                    workers_done
                        && s.core.is_quiet()
                        && s.apply_running.is_empty()
                        && s.deferred.is_empty()
                        && s.credit_out.is_empty()
                        && self.pending_jobs(Queue::Server) == 0
                }
            };
            if !server_done {
                return;
            }
            self.bye_sent = true;
            for p in (0..world).filter(|&p| p != me) {
                let writes = self.imm_sent[p as usize];
                self.send_ctrl(p, &Msg::Bye { writes });
            }
        }
        let everyone = (0..world).all(|p| p == self.rank || self.peer_done(p, self.peers[p as usize].bye));
        if everyone && self.flow.idle() && self.jobs.is_empty() {
            self.done = true;
            self.out.push_back(Output::Finished);
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
