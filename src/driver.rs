//! The driver: runs one rank's engine cores over its transport on a dedicated
//! thread, executes their commands (writes, sends, accumulate, apply,
//! reconstruct) and feeds completions back. The [`Session`](crate::Session)
//! talks to it over a channel.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use tidewire_engine::book::LayerKind;
use tidewire_engine::{Book, EngineError, Server, ServerCommand, Worker, WorkerCommand};
use tidewire_gpu::agg::Aggregator;
use tidewire_gpu::cpu::{self, ApplyOp};
use tidewire_transport::select::{self, Preference};
use tidewire_transport::{
    Access, ConnId, Event, PinOptions, PinnedBuffer, Region, RemoteRegion, ReqId, Slice, TcpConfig, Transport,
};

use crate::cluster::ClusterSpec;
use crate::error::{Error, Result};
use crate::rendezvous;
use crate::session::{Builder, LayerBuffers, SessionStats, Shared, TransportKind};

const TAG_HELLO: u32 = 1;
const TAG_CREDIT: u32 = 2;
const TAG_FACTORS: u32 = 3;
const TAG_BYE: u32 = 4;
const TAG_ABORT: u32 = 5;
const CELL: usize = 256;
const CELLS: usize = 1024;
/// Bytes before U in a factor block: layer (u32), reserved (u32), iteration (u64).
const SF_HEADER: usize = 16;

/// A call from the session.
pub(crate) enum Request {
    HandIn {
        buf: LayerBuffers,
        factors: bool,
    },
    Wait {
        layer: u32,
        reply: Sender<Result<LayerBuffers>>,
    },
    WaitAll {
        reply: Sender<Result<Vec<LayerBuffers>>>,
    },
    Stats {
        reply: Sender<Result<SessionStats>>,
    },
    Shutdown {
        reply: Sender<Result<()>>,
    },
    Abort(String),
}

#[derive(Debug, Clone, Copy)]
enum Pending {
    Push { slice: u32 },
    Init,
    Factors { layer: u32, peer: u32 },
    Bcast { chunk: u32, worker: u32 },
    Ctrl { cell: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    User,
    InFlight,
    Ready,
}

#[derive(Debug, Clone, Copy)]
enum Retry {
    LocalBcast { chunk: u32 },
    Reconstruct { layer: u32, iter: u64 },
}

#[derive(Debug, Default, Clone, Copy)]
struct Keys {
    params: u32,
    shard: u32,
    landing: u32,
    /// Where layer 0 starts in the parameter region (layers follow contiguously).
    params_base: u64,
}

#[derive(Debug, Default)]
struct Peer {
    conn: Option<ConnId>,
    keys: Option<Keys>,
    params: Option<RemoteRegion>,
    shard: Option<RemoteRegion>,
    landing: Option<RemoteRegion>,
    bye: bool,
    closed: bool,
}

/// (U, V) of one worker's FC layer.
type Factors = (Vec<f32>, Vec<f32>);

struct WorkerPart {
    core: Worker,
    params: Region,
    param_off: Vec<usize>,
    grads: Region,
    grad_off: Vec<usize>,
    factors: Option<Region>,
    /// Byte offset of each FC layer's factor block.
    sf_off: Vec<Option<usize>>,
    held: Vec<Held>,
    synced_at: Vec<Option<Instant>>,
    waiters: HashMap<u32, Sender<Result<LayerBuffers>>>,
    wait_all: Option<Sender<Result<Vec<LayerBuffers>>>>,
    sf_store: HashMap<(u32, u64, u32), Factors>,
    momentum: HashMap<u32, Vec<f32>>,
    scratch: Vec<f32>,
}

struct ServerPart {
    core: Server,
    shard: Region,
    landing: Region,
    slot_bytes: usize,
    acc: Vec<Vec<f32>>,
    momentum: Vec<f32>,
    local_slots: HashMap<u32, u32>,
    agg: Aggregator,
}

struct Node {
    t: Box<dyn Transport>,
    book: Arc<Book>,
    rank: u32,
    op: ApplyOp,
    slots: u32,
    peers: Vec<Peer>,
    conn_rank: HashMap<ConnId, u32>,
    pending: HashMap<ReqId, Pending>,
    ctrl: Region,
    free_cells: Vec<usize>,
    credit_out: HashMap<u32, Vec<u32>>,
    retry: VecDeque<Retry>,
    worker: Option<WorkerPart>,
    server: Option<ServerPart>,
    shared: Arc<Shared>,
    fatal: Option<Error>,
    shutdown: Option<Sender<Result<()>>>,
    shutdown_at: Option<Instant>,
    bye_sent: bool,
    timeout: Duration,
    stats: SessionStats,
}

/// A zeroed f32 vector whose pages are already faulted in, so that the first
/// iteration does not pay for them.
fn touched(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    // black_box: otherwise LLVM folds allocation + zero fill into calloc,
    // whose pages stay lazy.
    v.resize(n, std::hint::black_box(0.0));
    v
}

/// Faults a region's pages in (registration does not, for the TCP backend).
fn prefault(r: &Region) -> Result<()> {
    Ok(r.fill(0, r.len(), 0)?)
}

fn pinned(len: usize) -> Result<PinnedBuffer> {
    // The TCP backend does not need locked pages; RDMA registration will.
    Ok(PinnedBuffer::with_options(
        len.max(4096),
        PinOptions {
            lock: false,
            ..Default::default()
        },
    )?)
}

/// Starts the driver thread. Setup (rendezvous, connections, registration,
/// the initial broadcast) runs on it; `ready` gets the layer buffers or the error.
pub(crate) fn spawn(
    b: Builder,
    book: Arc<Book>,
    spec: ClusterSpec,
    rx: Receiver<Request>,
    shared: Arc<Shared>,
    ready: Sender<Result<Vec<LayerBuffers>>>,
) -> Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("tidewire-driver-{}", spec.rank))
        .spawn(move || {
            let mut node = match Node::setup(b, book, &spec, shared.clone()) {
                Ok(n) => n,
                Err(e) => {
                    shared.set_fatal(e.clone());
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            node.run(rx, ready);
        })
        .map_err(|e| Error::Transport(format!("cannot start the driver thread: {e}")))
}

fn preference(kind: TransportKind) -> Preference {
    match kind {
        TransportKind::Auto => Preference::Auto,
        TransportKind::Tcp => Preference::Tcp,
        TransportKind::Rdma => Preference::Rdma,
    }
}

/// The largest message this job sends: sufficient factors of the widest FC layer.
fn max_message(book: &Book) -> usize {
    let k = book.config().batch;
    book.layers()
        .iter()
        .filter(|l| l.kind == LayerKind::Fc)
        .map(|l| SF_HEADER + k * (l.m + l.n) * 4)
        .max()
        .unwrap_or(0)
        .max(CELL)
}

impl Node {
    fn setup(b: Builder, book: Arc<Book>, spec: &ClusterSpec, shared: Arc<Shared>) -> Result<Self> {
        let rank = spec.rank;
        let world = book.cluster().world();
        let role = book.cluster().role(rank).expect("checked");
        let secret = b.secret.clone().expect("set by build");
        let mut cfg = TcpConfig::new(b.job, rank, secret);
        cfg.busy_poll = Duration::ZERO;
        cfg.peer_timeout = b.timeout;
        cfg.handshake_timeout = b.connect_timeout;
        let host = if rank == 0 && world > 1 {
            Some(rendezvous::Host::bind(spec.master)?)
        } else {
            None
        };
        let max_msg = max_message(&book);
        #[cfg(feature = "rdma")]
        let tweak = move |c: &mut tidewire_transport::RdmaConfig| {
            // Receive buffers hold the largest factor message; keep them near 64 MiB a peer.
            c.max_message_bytes = c.max_message_bytes.max(max_msg);
            c.rx_depth = ((64usize << 20) / c.max_message_bytes).clamp(4, 64) as u32;
        };
        #[cfg(not(feature = "rdma"))]
        let tweak = move |_: &mut ()| {
            let _ = max_msg;
        };
        let selected = select::open(preference(b.transport), cfg, &tweak).map_err(|e| match e {
            tidewire_transport::Error::RdmaUnavailable { reason } => Error::TransportUnavailable(format!(
                "RDMA was requested but is unavailable: {reason}; use TIDEWIRE_TRANSPORT=tcp or auto"
            )),
            o => o.into(),
        })?;
        tracing::info!(rank, transport = selected.kind, reason = %selected.reason, "transport");
        shared.set_transport(selected.kind, &selected.reason);
        let mut t = selected.transport;
        let ip = match b.listen_ip {
            Some(ip) => ip,
            None => rendezvous::local_ip_towards(spec.master)?,
        };
        let listener = t.listen(SocketAddr::new(ip, 0))?;
        let me = t.listener_addr(listener)?;
        let ctrl = t.register(pinned(CELL * CELLS)?, Access::LOCAL)?;

        let worker = if role.is_worker() {
            let (pbuf, param_off) = match b.params {
                Some(l) => (l.buffer, l.offsets),
                None => contiguous(&book)?,
            };
            let (gbuf, grad_off) = match b.grads {
                Some(l) => (l.buffer, l.offsets),
                None => contiguous(&book)?,
            };
            let params = t.register(pbuf, Access::REMOTE_WRITE)?;
            let grads = t.register(gbuf, Access::LOCAL)?;
            prefault(&params)?;
            prefault(&grads)?;
            let k = book.config().batch;
            let mut sf_off = Vec::new();
            let mut sf_len = 0usize;
            for l in book.layers() {
                if l.kind == LayerKind::Fc {
                    sf_off.push(Some(sf_len));
                    sf_len += SF_HEADER + k * (l.m + l.n) * 4;
                } else {
                    sf_off.push(None);
                }
            }
            let factors = if sf_len > 0 {
                let r = t.register(pinned(sf_len)?, Access::LOCAL)?;
                prefault(&r)?;
                Some(r)
            } else {
                None
            };
            // Layers that sync by SFB are applied here: their momentum and the
            // reconstruction scratch live on the worker.
            let sfb: Vec<u32> = (0..book.layers().len() as u32)
                .filter(|&l| book.scheme(l, 0) == tidewire_engine::Scheme::Sfb)
                .collect();
            let momentum: HashMap<u32, Vec<f32>> = if b.op.needs_momentum() {
                sfb.iter()
                    .map(|&l| (l, touched(book.layers()[l as usize].params())))
                    .collect()
            } else {
                HashMap::new()
            };
            let scratch = touched(
                sfb.iter()
                    .map(|&l| book.layers()[l as usize].params())
                    .max()
                    .unwrap_or(0),
            );
            if let Some(init) = &b.init {
                for (i, l) in book.layers().iter().enumerate() {
                    let mut lease = params.lease_f32(param_off[i] / 4, l.params())?;
                    init(i as u32, lease.as_f32_mut()?);
                }
            }
            Some(WorkerPart {
                core: Worker::new(book.clone(), rank, b.sched)?,
                held: vec![Held::User; book.layers().len()],
                synced_at: vec![None; book.layers().len()],
                params,
                param_off,
                grads,
                grad_off,
                factors,
                sf_off,
                waiters: HashMap::new(),
                wait_all: None,
                sf_store: HashMap::new(),
                momentum,
                scratch,
            })
        } else {
            None
        };
        let server = if role.is_server() {
            let core = Server::new(book.clone(), rank, b.sched)?;
            let n = book.shard_len(rank);
            let slot_bytes = book.max_slice_len() * 4;
            let shard = t.register(pinned(n * 4)?, Access::REMOTE_WRITE)?;
            let landing = t.register(
                pinned(book.p1() * b.sched.slots as usize * slot_bytes)?,
                Access::REMOTE_WRITE,
            )?;
            let agg = Aggregator::new(b.aggregation)?;
            tracing::info!(rank, "{}", agg.describe());
            Some(ServerPart {
                agg,
                acc: (0..core.windows()).map(|_| vec![0f32; n]).collect(),
                momentum: if b.op.needs_momentum() {
                    vec![0f32; n]
                } else {
                    Vec::new()
                },
                core,
                shard,
                landing,
                slot_bytes,
                local_slots: HashMap::new(),
            })
        } else {
            None
        };

        let addrs = match host {
            Some(h) => h.run(b.job, world, me, book.hash(), b.connect_timeout)?,
            None if world > 1 => rendezvous::join(spec.master, b.job, rank, world, me, book.hash(), b.connect_timeout)?,
            None => vec![me],
        };
        let mut node = Node {
            t,
            rank,
            op: b.op,
            slots: b.sched.slots,
            peers: (0..world).map(|_| Peer::default()).collect(),
            conn_rank: HashMap::new(),
            pending: HashMap::new(),
            ctrl,
            free_cells: (0..CELLS).rev().collect(),
            credit_out: HashMap::new(),
            retry: VecDeque::new(),
            worker,
            server,
            shared,
            fatal: None,
            shutdown: None,
            shutdown_at: None,
            bye_sent: false,
            timeout: b.timeout,
            stats: SessionStats::default(),
            book,
        };
        node.connect_all(&addrs, listener, b.connect_timeout)?;
        Ok(node)
    }

    fn connect_all(
        &mut self,
        addrs: &[SocketAddr],
        listener: tidewire_transport::ListenerId,
        timeout: Duration,
    ) -> Result<()> {
        let world = addrs.len();
        if world == 1 {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        let mut dialing: HashMap<ConnId, u32> = HashMap::new();
        for (j, addr) in addrs.iter().enumerate().take(self.rank as usize) {
            dialing.insert(self.t.connect(*addr)?, j as u32);
        }
        let mut evs = Vec::new();
        let keys = self.keys();
        let mut hello_sent = vec![false; world];
        loop {
            let connected = self
                .peers
                .iter()
                .enumerate()
                .filter(|(r, p)| *r as u32 != self.rank && p.conn.is_some())
                .count();
            let me = self.rank;
            let mut ready = true;
            for r in (0..world as u32).filter(|&r| r != me) {
                ready &= self.peers[r as usize].keys.is_some() && self.remote_ready(r);
            }
            let said_hello = (0..world).all(|r| r as u32 == me || hello_sent[r]);
            if connected == world - 1 && ready && said_hello {
                return Ok(());
            }
            if Instant::now() > deadline {
                let missing: Vec<u32> = (0..world as u32)
                    .filter(|&r| r != self.rank && self.peers[r as usize].keys.is_none())
                    .collect();
                return Err(Error::Timeout {
                    what: format!("connections and hellos from ranks {missing:?}"),
                    after: timeout,
                });
            }
            while let Some((conn, peer)) = self.t.accept(listener)? {
                self.attach(conn, peer.rank)?;
            }
            for (r, sent) in hello_sent.iter_mut().enumerate() {
                if let (Some(conn), false) = (self.peers[r].conn, *sent) {
                    let mut msg = Vec::with_capacity(24);
                    msg.extend_from_slice(&self.rank.to_le_bytes());
                    msg.extend_from_slice(&self.book.hash().to_le_bytes());
                    msg.extend_from_slice(&keys.params.to_le_bytes());
                    msg.extend_from_slice(&keys.shard.to_le_bytes());
                    msg.extend_from_slice(&keys.landing.to_le_bytes());
                    msg.extend_from_slice(&keys.params_base.to_le_bytes());
                    self.send_ctrl(conn, TAG_HELLO, &msg)?;
                    tracing::debug!(rank = self.rank, peer = r, "hello sent");
                    *sent = true;
                }
            }
            evs.clear();
            self.t.wait(&mut evs, 256, Duration::from_millis(5))?;
            for ev in evs.drain(..) {
                match ev {
                    Event::Connected { conn, peer } => {
                        let want = dialing.get(&conn).copied();
                        if want != Some(peer.rank) {
                            return Err(Error::Cluster(format!(
                                "dialed rank {want:?} at {} but rank {} answered",
                                peer.addr, peer.rank
                            )));
                        }
                        self.attach(conn, peer.rank)?;
                    }
                    // Attach at once: the peer may already have sent a message, and it can
                    // sit in this same batch (over RDMA it travels apart from the handshake).
                    Event::Incoming { listener: l, .. } => {
                        while let Some((conn, peer)) = self.t.accept(l)? {
                            self.attach(conn, peer.rank)?;
                        }
                    }
                    Event::PeerRejected { addr, error, .. } => {
                        tracing::warn!(%addr, %error, "refused a peer during setup");
                    }
                    Event::Closed { conn, error } => {
                        let r = self
                            .conn_rank
                            .get(&conn)
                            .copied()
                            .or_else(|| dialing.get(&conn).copied());
                        return Err(Error::PeerLost {
                            rank: r.unwrap_or(u32::MAX),
                            reason: format!(
                                "connection closed during setup: {}",
                                error.map_or("no error".into(), |e| e.to_string())
                            ),
                        });
                    }
                    other => self.event(other),
                }
                if let Some(e) = self.fatal.take() {
                    return Err(e);
                }
            }
        }
    }

    fn attach(&mut self, conn: ConnId, rank: u32) -> Result<()> {
        let p = self
            .peers
            .get_mut(rank as usize)
            .ok_or_else(|| Error::Cluster(format!("a peer claims rank {rank}, outside the world")))?;
        if p.conn.is_some() || rank == self.rank {
            return Err(Error::Cluster(format!("rank {rank} connected twice")));
        }
        p.conn = Some(conn);
        self.conn_rank.insert(conn, rank);
        Ok(())
    }

    fn keys(&self) -> Keys {
        Keys {
            params: self.worker.as_ref().map_or(0, |w| w.params.key()),
            shard: self.server.as_ref().map_or(0, |s| s.shard.key()),
            landing: self.server.as_ref().map_or(0, |s| s.landing.key()),
            params_base: self.worker.as_ref().map_or(0, |w| w.param_off[0] as u64),
        }
    }

    /// Whether the regions the peer announced in its hello are known.
    fn remote_ready(&mut self, r: u32) -> bool {
        let (Some(conn), Some(keys)) = (self.peers[r as usize].conn, self.peers[r as usize].keys) else {
            return false;
        };
        let Ok(regions) = self.t.remote_regions(conn) else {
            return false;
        };
        let find = |k: u32| regions.iter().find(|x| x.rkey == k).copied();
        let p = &mut self.peers[r as usize];
        p.params = find(keys.params);
        p.shard = find(keys.shard);
        p.landing = find(keys.landing);
        (keys.params == 0 || p.params.is_some())
            && (keys.shard == 0 || p.shard.is_some())
            && (keys.landing == 0 || p.landing.is_some())
    }

    fn send_ctrl(&mut self, conn: ConnId, tag: u32, data: &[u8]) -> Result<()> {
        let cell = self
            .free_cells
            .pop()
            .ok_or_else(|| Error::Transport("control cells exhausted".into()))?;
        let len = data.len().min(CELL);
        self.ctrl.write_at(cell * CELL, &data[..len])?;
        let req = self.t.send(conn, &self.ctrl.slice(cell * CELL, len)?, tag)?;
        self.pending.insert(req, Pending::Ctrl { cell });
        Ok(())
    }

    fn fail(&mut self, e: Error) {
        if self.fatal.is_none() {
            tracing::error!(rank = self.rank, error = %e, "fatal");
            self.shared.set_fatal(e.clone());
            self.fatal = Some(e);
        }
    }

    fn run(&mut self, rx: Receiver<Request>, ready: Sender<Result<Vec<LayerBuffers>>>) {
        let mut ready = Some(ready);
        let mut evs = Vec::new();
        let started = Instant::now();
        loop {
            // Requests.
            loop {
                match rx.try_recv() {
                    Ok(Request::Abort(why)) => {
                        self.abort(&why);
                        return;
                    }
                    Err(TryRecvError::Disconnected) => {
                        self.abort("its session was dropped without shutdown");
                        return;
                    }
                    Ok(r) => self.request(r),
                    Err(TryRecvError::Empty) => break,
                }
            }
            self.pump();
            if let Some(r) = ready.as_ref() {
                let init = match (&self.worker, &self.server) {
                    (Some(w), _) => w.core.is_initialized(),
                    (None, Some(s)) => s.core.is_initialized(),
                    (None, None) => true,
                };
                if init {
                    let layers = self.all_layers();
                    let _ = r.send(layers);
                    ready = None;
                } else if started.elapsed() > self.timeout {
                    self.fail(Error::Timeout {
                        what: "the initial parameters from rank 0".into(),
                        after: self.timeout,
                    });
                }
            }
            if let Some(e) = self.fatal.clone() {
                if let Some(r) = ready.take() {
                    let _ = r.send(Err(e.clone()));
                }
                self.abort(&e.to_string());
                return;
            }
            if self.shutdown_done() {
                return;
            }
            // Wait for progress.
            evs.clear();
            let busy = !self.retry.is_empty();
            if self.conn_rank.is_empty() {
                if !busy {
                    match rx.recv_timeout(Duration::from_millis(20)) {
                        Ok(Request::Abort(why)) => {
                            self.abort(&why);
                            return;
                        }
                        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                            self.abort("its session was dropped without shutdown");
                            return;
                        }
                        Ok(r) => self.request(r),
                        Err(_) => {}
                    }
                }
                continue;
            }
            let idle = self.pending.is_empty() && !busy;
            let wait = if busy {
                Duration::ZERO
            } else if idle {
                Duration::from_millis(1)
            } else {
                Duration::from_micros(100)
            };
            if let Err(e) = self.t.wait(&mut evs, 512, wait) {
                self.fail(e.into());
                continue;
            }
            for ev in evs.drain(..) {
                self.event(ev);
            }
        }
    }

    fn all_layers(&mut self) -> Result<Vec<LayerBuffers>> {
        let Some(w) = self.worker.as_mut() else {
            return Ok(Vec::new());
        };
        (0..w.held.len() as u32)
            .map(|l| make_buffers(&self.book, w, l))
            .collect()
    }

    fn abort(&mut self, why: &str) {
        let conns: Vec<(u32, ConnId)> = self
            .peers
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.closed)
            .filter_map(|(r, p)| p.conn.map(|c| (r as u32, c)))
            .collect();
        for (_, c) in &conns {
            let _ = self.send_ctrl(*c, TAG_ABORT, why.as_bytes());
        }
        // Flush the aborts briefly; dropping the transport closes everything.
        let deadline = Instant::now() + Duration::from_millis(200);
        let mut evs = Vec::new();
        while Instant::now() < deadline && self.pending.values().any(|p| matches!(p, Pending::Ctrl { .. })) {
            evs.clear();
            if self.t.wait(&mut evs, 256, Duration::from_millis(10)).is_err() {
                break;
            }
            for ev in evs.drain(..) {
                if let Event::SendDone { req, .. } = ev {
                    self.pending.remove(&req);
                }
            }
        }
        let e = self.fatal.clone().unwrap_or(Error::Shutdown);
        self.fail_waiters(e);
    }

    fn fail_waiters(&mut self, e: Error) {
        if let Some(w) = self.worker.as_mut() {
            for (_, r) in w.waiters.drain() {
                let _ = r.send(Err(e.clone()));
            }
            if let Some(r) = w.wait_all.take() {
                let _ = r.send(Err(e.clone()));
            }
        }
        if let Some(r) = self.shutdown.take() {
            let _ = r.send(Err(e));
        }
    }

    fn shutdown_done(&mut self) -> bool {
        let Some(at) = self.shutdown_at else { return false };
        let idle = self.worker.as_ref().map_or(true, |w| !w.held.contains(&Held::InFlight));
        if !idle {
            if at.elapsed() > self.timeout {
                self.fail(Error::Timeout {
                    what: "in-flight layers to sync before shutdown".into(),
                    after: self.timeout,
                });
            }
            return false;
        }
        if !self.bye_sent {
            self.bye_sent = true;
            let conns: Vec<ConnId> = self.peers.iter().filter_map(|p| p.conn).collect();
            for c in conns {
                if let Err(e) = self.send_ctrl(c, TAG_BYE, &[]) {
                    self.fail(e);
                    return false;
                }
            }
        }
        let everyone = self
            .peers
            .iter()
            .enumerate()
            .all(|(r, p)| r as u32 == self.rank || p.bye);
        let flushed = self.pending.is_empty() && self.credit_out.is_empty();
        if everyone && flushed {
            if let Some(r) = self.shutdown.take() {
                let _ = r.send(Ok(()));
            }
            return true;
        }
        false
    }

    fn request(&mut self, r: Request) {
        if self.shutdown_at.is_some() && !matches!(r, Request::Stats { .. }) {
            reply_err(r, Error::Shutdown);
            return;
        }
        match r {
            Request::HandIn { buf, factors } => {
                if let Err(e) = self.hand_in(buf, factors) {
                    self.fail(e);
                }
            }
            Request::Wait { layer, reply } => {
                let Some(w) = self.worker.as_mut() else { return };
                match w.held[layer as usize] {
                    Held::User => {
                        let _ = reply.send(Err(Error::NotHandedIn { layer }));
                    }
                    Held::Ready => {
                        let b = make_buffers(&self.book, w, layer);
                        let _ = reply.send(b);
                    }
                    Held::InFlight => {
                        w.waiters.insert(layer, reply);
                    }
                }
            }
            Request::WaitAll { reply } => {
                let Some(w) = self.worker.as_mut() else { return };
                w.wait_all = Some(reply);
                self.try_wait_all();
            }
            Request::Stats { reply } => {
                let mut s = self.stats;
                if let Some(w) = &self.worker {
                    s.pushes = w.core.stats().pushes;
                    s.factor_sends = w.core.stats().factor_sends;
                }
                if let Some(sv) = &self.server {
                    let st = sv.core.stats();
                    s.accumulated = st.accumulated;
                    s.applies = st.applies;
                    s.broadcasts = st.broadcasts;
                    let ag = sv.agg.stats();
                    s.cpu_aggregated_bytes = ag.cpu_bytes;
                    s.gpu_aggregated_bytes = ag.gpu_bytes;
                }
                let ts = self.t.counters();
                s.rx_direct_bytes = ts.rx_direct_bytes;
                s.rx_copied_bytes = ts.rx_copied_bytes;
                let _ = reply.send(Ok(s));
            }
            Request::Shutdown { reply } => {
                self.shutdown = Some(reply);
                self.shutdown_at = Some(Instant::now());
            }
            Request::Abort(_) => {}
        }
    }

    fn try_wait_all(&mut self) {
        let Some(w) = self.worker.as_mut() else { return };
        if w.wait_all.is_none() || w.held.contains(&Held::InFlight) {
            return;
        }
        let reply = w.wait_all.take().expect("checked");
        let ready: Vec<u32> = (0..w.held.len() as u32)
            .filter(|&l| w.held[l as usize] == Held::Ready)
            .collect();
        let bufs: Result<Vec<LayerBuffers>> = ready.into_iter().map(|l| make_buffers(&self.book, w, l)).collect();
        let _ = reply.send(bufs);
    }

    fn hand_in(&mut self, buf: LayerBuffers, factors: bool) -> Result<()> {
        let book = self.book.clone();
        let me = self.rank;
        let w = self.worker.as_mut().expect("checked by the session");
        let layer = buf.layer;
        let (pr, gr) = buf.regions();
        if !pr.same(&w.params) || !gr.same(&w.grads) {
            return Err(Error::Layout(format!(
                "layer {layer}'s buffers belong to another session"
            )));
        }
        if w.held[layer as usize] != Held::User {
            let name = book.layers()[layer as usize].name.clone();
            return Err(EngineError::LayerBusy {
                layer,
                name,
                iter: w.core.completed(layer),
            }
            .into());
        }
        drop(buf);
        w.held[layer as usize] = Held::InFlight;
        if !factors {
            w.core.grad_ready(layer)?;
            return Ok(());
        }
        let spec = &book.layers()[layer as usize];
        let k = book.config().batch;
        let iter = w.core.completed(layer);
        let off = w.sf_off[layer as usize].expect("FC layers have a factor block");
        let fr = w.factors.as_ref().expect("FC layers have factors");
        let (u, v) = {
            let l = fr.lease_f32(off / 4, 4 + k * (spec.m + spec.n))?;
            let f = l.as_f32()?;
            (f[4..4 + k * spec.m].to_vec(), f[4 + k * spec.m..].to_vec())
        };
        let mut hdr = [0u8; SF_HEADER];
        hdr[..4].copy_from_slice(&layer.to_le_bytes());
        hdr[8..].copy_from_slice(&iter.to_le_bytes());
        fr.write_at(off, &hdr)?;
        if w.core.sf_ready(layer)? {
            // A hand-in counts our own factors as arrived: keep a copy, since the
            // caller may overwrite U and V before every peer's factors are here.
            w.sf_store.insert((layer, iter, me), (u, v));
        } else {
            // The layer syncs through the PS: form the gradient Uᵀ·V in place.
            let mut g = w.grads.lease_f32(w.grad_off[layer as usize] / 4, spec.params())?;
            cpu::sf_rows(&u, &v, k, spec.m, spec.n, 0, g.as_f32_mut()?);
            drop(g);
            w.core.grad_ready(layer)?;
        }
        Ok(())
    }

    fn pump(&mut self) {
        loop {
            let mut progressed = false;
            let n = self.retry.len();
            for _ in 0..n {
                let r = self.retry.pop_front().expect("counted");
                progressed |= self.run_retry(r);
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
            if !progressed || self.fatal.is_some() {
                break;
            }
        }
        if let Err(e) = self.flush_credits() {
            self.fail(e);
        }
    }

    fn conn(&self, rank: u32) -> Result<ConnId> {
        self.peers[rank as usize].conn.ok_or(Error::PeerLost {
            rank,
            reason: "no connection".into(),
        })
    }

    fn post_write(&mut self, to: u32, src: &Slice, dst: RemoteRegion, off: u64, imm: u32, p: Pending) -> Result<()> {
        let conn = self.conn(to)?;
        let req = self.t.write(conn, src, &dst, off, Some(imm))?;
        self.pending.insert(req, p);
        Ok(())
    }

    fn worker_cmd(&mut self, cmd: WorkerCommand) -> Result<()> {
        let book = self.book.clone();
        let me = self.rank;
        match cmd {
            WorkerCommand::InitPush { server, chunk } => {
                let ch = book.chunks()[chunk as usize];
                let w = self.worker.as_ref().expect("worker");
                let src_off = w.param_off[ch.layer as usize] + ch.offset * 4;
                if server == me {
                    let src = w.params.lease(src_off, ch.len * 4)?;
                    let s = self.server.as_mut().expect("colocated");
                    let mut dst = s.shard.lease(ch.shard_offset * 4, ch.len * 4)?;
                    dst.as_bytes_mut().copy_from_slice(src.as_bytes());
                    drop((src, dst));
                    s.core.handle_init(me, chunk)?;
                } else {
                    let src = w.params.slice(src_off, ch.len * 4)?;
                    let dst = self.peers[server as usize]
                        .shard
                        .ok_or_else(|| no_region(server, "shard"))?;
                    self.post_write(server, &src, dst, (ch.shard_offset * 4) as u64, chunk, Pending::Init)?;
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
                    let w = self.worker.as_ref().expect("worker");
                    let src = w
                        .grads
                        .slice(w.grad_off[si.layer as usize] + si.offset * 4, si.len * 4)?;
                    let dst = self.peers[server as usize]
                        .landing
                        .ok_or_else(|| no_region(server, "landing"))?;
                    let wi = w.core.index();
                    let slot_bytes = book.max_slice_len() * 4;
                    let off = (wi * self.slots as usize + slot as usize) * slot_bytes;
                    self.post_write(server, &src, dst, off as u64, slice, Pending::Push { slice })?;
                }
            }
            WorkerCommand::SendFactors { peer, layer, .. } => {
                let w = self.worker.as_ref().expect("worker");
                let spec = &book.layers()[layer as usize];
                let off = w.sf_off[layer as usize].expect("FC");
                let len = SF_HEADER + book.config().batch * (spec.m + spec.n) * 4;
                let src = w.factors.as_ref().expect("FC").slice(off, len)?;
                let conn = self.conn(peer)?;
                let req = self.t.send(conn, &src, TAG_FACTORS)?;
                self.pending.insert(req, Pending::Factors { layer, peer });
            }
            WorkerCommand::Reconstruct { layer, iter } => {
                if !self.reconstruct(layer, iter)? {
                    self.retry.push_back(Retry::Reconstruct { layer, iter });
                }
            }
            WorkerCommand::LayerReady { layer, .. } => {
                let w = self.worker.as_mut().expect("worker");
                w.held[layer as usize] = Held::Ready;
                w.synced_at[layer as usize] = Some(Instant::now());
                if let Some(reply) = w.waiters.remove(&layer) {
                    let b = make_buffers(&book, w, layer);
                    let _ = reply.send(b);
                }
                self.try_wait_all();
            }
        }
        Ok(())
    }

    /// Σ_p U_pᵀV_p in worker order, applied to the layer. False when the
    /// caller holds the layer's parameters (SSP): try again later.
    fn reconstruct(&mut self, layer: u32, iter: u64) -> Result<bool> {
        let book = self.book.clone();
        let op = self.op;
        let w = self.worker.as_mut().expect("worker");
        let spec = &book.layers()[layer as usize];
        let mut params = match w.params.lease_f32(w.param_off[layer as usize] / 4, spec.params()) {
            Ok(l) => l,
            Err(tidewire_transport::Error::RegionBusy { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        let k = book.config().batch;
        let mut fs = Vec::with_capacity(book.p1());
        for &r in book.cluster().workers() {
            fs.push(w.sf_store.remove(&(layer, iter, r)).ok_or_else(|| {
                Error::Engine(EngineError::Protocol {
                    rank: r,
                    what: format!("factors of layer {layer} iteration {iter} missing at reconstruction"),
                })
            })?);
        }
        let refs: Vec<(&[f32], &[f32])> = fs.iter().map(|(u, v)| (u.as_slice(), v.as_slice())).collect();
        w.scratch.resize(spec.params(), 0.0);
        cpu::sf_sum(&refs, k, spec.m, spec.n, &mut w.scratch[..spec.params()]);
        let mom = w.momentum.entry(layer).or_insert_with(|| {
            if op.needs_momentum() {
                vec![0.0; spec.params()]
            } else {
                Vec::new()
            }
        });
        cpu::apply(op, book.p1(), &w.scratch[..spec.params()], params.as_f32_mut()?, mom);
        drop(params);
        w.core.handle_factors_applied(layer, iter)?;
        Ok(true)
    }

    fn run_retry(&mut self, r: Retry) -> bool {
        let res = match r {
            Retry::Reconstruct { layer, iter } => self.reconstruct(layer, iter),
            Retry::LocalBcast { chunk } => self.local_broadcast(chunk),
        };
        match res {
            Ok(true) => true,
            Ok(false) => {
                self.retry.push_back(r);
                false
            }
            Err(e) => {
                self.fail(e);
                false
            }
        }
    }

    fn local_broadcast(&mut self, chunk: u32) -> Result<bool> {
        let ch = self.book.chunks()[chunk as usize];
        let me = self.rank;
        let w = self.worker.as_mut().expect("colocated");
        let s = self.server.as_mut().expect("server");
        let mut dst = match w
            .params
            .lease(w.param_off[ch.layer as usize] + ch.offset * 4, ch.len * 4)
        {
            Ok(l) => l,
            Err(tidewire_transport::Error::RegionBusy { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        let src = s.shard.lease(ch.shard_offset * 4, ch.len * 4)?;
        dst.as_bytes_mut().copy_from_slice(src.as_bytes());
        drop((src, dst));
        w.core.handle_params(chunk)?;
        s.core.handle_broadcast_done(chunk, me)?;
        Ok(true)
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
                let at = ch.shard_offset + (si.offset - ch.offset);
                let src = if worker == me {
                    let w = self.worker.as_ref().expect("colocated");
                    w.grads
                        .lease(w.grad_off[si.layer as usize] + si.offset * 4, si.len * 4)?
                } else {
                    let s = self.server.as_ref().expect("server");
                    let wi = book.cluster().worker_index(worker).expect("checked by the core");
                    s.landing
                        .lease((wi * self.slots as usize + slot as usize) * s.slot_bytes, si.len * 4)?
                };
                let s = self.server.as_mut().expect("server");
                // The aggregator places the chunk on the CPU or the GPU (Nexus) and
                // adds in call order either way, so the bits do not depend on it.
                let key = window as u64 * book.chunks().len() as u64 + si.chunk as u64;
                let chunk_acc = &mut s.acc[window as usize][ch.shard_offset..ch.shard_offset + ch.len];
                s.agg
                    .accumulate(key, book.p1(), chunk_acc, at - ch.shard_offset, src.as_f32()?, first)?;
            }
            ServerCommand::ReturnCredit { worker, slot } => {
                if worker == me {
                    let slice = self
                        .server
                        .as_mut()
                        .expect("server")
                        .local_slots
                        .remove(&slot)
                        .expect("a local push took this slot");
                    let w = self.worker.as_mut().expect("colocated");
                    w.core.handle_push_done(slice)?;
                    w.core.handle_credit(me, slot)?;
                } else {
                    self.credit_out.entry(worker).or_default().push(slot);
                }
            }
            ServerCommand::Apply { chunk, window, .. } => {
                let ch = book.chunks()[chunk as usize];
                let s = self.server.as_mut().expect("server");
                let range = ch.shard_offset..ch.shard_offset + ch.len;
                let key = window as u64 * book.chunks().len() as u64 + chunk as u64;
                s.agg.finish(key, &mut s.acc[window as usize][range.clone()])?;
                let mut dst = s.shard.lease_f32(ch.shard_offset, ch.len)?;
                let mom = if s.momentum.is_empty() {
                    &mut [][..]
                } else {
                    &mut s.momentum[range.clone()]
                };
                cpu::apply(
                    self.op,
                    book.p1(),
                    &s.acc[window as usize][range],
                    dst.as_f32_mut()?,
                    mom,
                );
            }
            ServerCommand::Broadcast { chunk, worker } => {
                if worker == me {
                    if !self.local_broadcast(chunk)? {
                        self.retry.push_back(Retry::LocalBcast { chunk });
                    }
                } else {
                    let ch = book.chunks()[chunk as usize];
                    let s = self.server.as_ref().expect("server");
                    let src = s.shard.slice(ch.shard_offset * 4, ch.len * 4)?;
                    let dst = self.peers[worker as usize]
                        .params
                        .ok_or_else(|| no_region(worker, "params"))?;
                    // Every worker lays its parameters out contiguously from the
                    // base it announced; its transport rejects a write outside the region.
                    let base = self.peers[worker as usize].keys.map_or(0, |k| k.params_base) as usize;
                    let off = base + (book.layer_offset(ch.layer) + ch.offset) * 4;
                    self.post_write(worker, &src, dst, off as u64, chunk, Pending::Bcast { chunk, worker })?;
                }
            }
        }
        Ok(())
    }

    fn flush_credits(&mut self) -> Result<()> {
        let workers: Vec<u32> = self.credit_out.keys().copied().collect();
        for w in workers {
            if self.free_cells.is_empty() {
                return Ok(());
            }
            let slots = self.credit_out.remove(&w).expect("listed");
            let mut msg = Vec::with_capacity(slots.len() * 4);
            for s in &slots[..slots.len().min(CELL / 4)] {
                msg.extend_from_slice(&s.to_le_bytes());
            }
            if slots.len() > CELL / 4 {
                self.credit_out.insert(w, slots[CELL / 4..].to_vec());
            }
            let conn = self.conn(w)?;
            self.send_ctrl(conn, TAG_CREDIT, &msg)?;
        }
        Ok(())
    }

    fn event(&mut self, ev: Event) {
        if let Err(e) = self.event_inner(ev) {
            self.fail(e);
        }
    }

    fn event_inner(&mut self, ev: Event) -> Result<()> {
        match ev {
            Event::WriteDone { req, .. } | Event::SendDone { req, .. } => match self.pending.remove(&req) {
                Some(Pending::Push { slice }) => self.worker.as_mut().expect("worker").core.handle_push_done(slice)?,
                Some(Pending::Init) | None => {}
                Some(Pending::Factors { layer, peer }) => self
                    .worker
                    .as_mut()
                    .expect("worker")
                    .core
                    .handle_factors_sent(layer, peer)?,
                Some(Pending::Bcast { chunk, worker }) => self
                    .server
                    .as_mut()
                    .expect("server")
                    .core
                    .handle_broadcast_done(chunk, worker)?,
                Some(Pending::Ctrl { cell }) => self.free_cells.push(cell),
            },
            Event::OpFailed { conn, error, .. } => {
                let rank = self.conn_rank.get(&conn).copied().unwrap_or(u32::MAX);
                return Err(Error::PeerLost {
                    rank,
                    reason: format!("an operation failed: {error}"),
                });
            }
            Event::Message { conn, tag, data } => {
                let rank = *self
                    .conn_rank
                    .get(&conn)
                    .ok_or_else(|| Error::Transport("message on an unknown connection".into()))?;
                self.stats.rx_copied_bytes += data.len() as u64;
                self.message(rank, tag, data)?;
            }
            Event::WriteReceived {
                conn,
                region,
                offset,
                len,
                imm,
            } => {
                let rank = *self
                    .conn_rank
                    .get(&conn)
                    .ok_or_else(|| Error::Transport("write on an unknown connection".into()))?;
                self.write_received(rank, region, offset, len, imm)?;
            }
            Event::WriteRejected { conn, error } => {
                let rank = self.conn_rank.get(&conn).copied().unwrap_or(u32::MAX);
                return Err(Error::Engine(EngineError::Protocol {
                    rank,
                    what: format!("a write was rejected: {error}"),
                }));
            }
            Event::RemoteRegionsChanged { conn } => {
                if let Some(&r) = self.conn_rank.get(&conn) {
                    self.remote_ready(r);
                }
            }
            Event::Closed { conn, error } => {
                let Some(&rank) = self.conn_rank.get(&conn) else {
                    return Ok(());
                };
                let p = &mut self.peers[rank as usize];
                p.closed = true;
                if !p.bye {
                    return Err(Error::PeerLost {
                        rank,
                        reason: match error {
                            Some(e) => e.to_string(),
                            None => "it closed the connection without saying goodbye (did the process exit?)".into(),
                        },
                    });
                }
            }
            Event::PeerRejected { addr, error, .. } => {
                tracing::warn!(%addr, %error, "refused a connection");
            }
            _ => {}
        }
        Ok(())
    }

    fn message(&mut self, rank: u32, tag: u32, data: Vec<u8>) -> Result<()> {
        let bad = |what: &str| {
            Error::Engine(EngineError::Protocol {
                rank,
                what: what.into(),
            })
        };
        match tag {
            TAG_HELLO => {
                tracing::debug!(rank = self.rank, peer = rank, "hello received");
                if data.len() < 32 {
                    return Err(bad("short hello"));
                }
                let u32_at = |i: usize| u32::from_le_bytes(data[i..i + 4].try_into().expect("4 bytes"));
                let hash = u64::from_le_bytes(data[4..12].try_into().expect("8 bytes"));
                if u32_at(0) != rank {
                    return Err(bad("hello names another rank"));
                }
                if hash != self.book.hash() {
                    return Err(Error::Engine(EngineError::BookMismatch {
                        rank,
                        ours: self.book.hash(),
                        theirs: hash,
                        hint: "every rank must use the same layer table, cluster, batch, chunk and slice sizes".into(),
                    }));
                }
                self.peers[rank as usize].keys = Some(Keys {
                    params: u32_at(12),
                    shard: u32_at(16),
                    landing: u32_at(20),
                    params_base: u64::from_le_bytes(data[24..32].try_into().expect("8 bytes")),
                });
                self.remote_ready(rank);
            }
            TAG_CREDIT => {
                let w = self
                    .worker
                    .as_mut()
                    .ok_or_else(|| bad("credit sent to a rank that is not a worker"))?;
                for c in data.chunks_exact(4) {
                    w.core
                        .handle_credit(rank, u32::from_le_bytes(c.try_into().expect("4 bytes")))?;
                }
            }
            TAG_FACTORS => {
                let w = self
                    .worker
                    .as_mut()
                    .ok_or_else(|| bad("factors sent to a rank that is not a worker"))?;
                if data.len() < SF_HEADER {
                    return Err(bad("short factor message"));
                }
                let layer = u32::from_le_bytes(data[..4].try_into().expect("4 bytes"));
                let iter = u64::from_le_bytes(data[8..16].try_into().expect("8 bytes"));
                let spec = self.book.layer(layer)?;
                let k = self.book.config().batch;
                if data.len() != SF_HEADER + k * (spec.m + spec.n) * 4 {
                    return Err(bad("factor message of the wrong size"));
                }
                let floats: Vec<f32> = data[SF_HEADER..]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect();
                let v = floats[k * spec.m..].to_vec();
                let mut u = floats;
                u.truncate(k * spec.m);
                w.sf_store.insert((layer, iter, rank), (u, v));
                w.core.handle_factors_arrived(layer, iter, rank)?;
            }
            TAG_BYE => self.peers[rank as usize].bye = true,
            TAG_ABORT => {
                return Err(Error::PeerAborted {
                    rank,
                    reason: String::from_utf8_lossy(&data).into_owned(),
                })
            }
            _ => return Err(bad("unknown message tag")),
        }
        Ok(())
    }

    fn write_received(&mut self, rank: u32, region: u32, offset: u64, len: u64, imm: u32) -> Result<()> {
        let bad = |what: String| Error::Engine(EngineError::Protocol { rank, what });
        self.stats.rx_direct_bytes += len;
        if let Some(s) = self.server.as_mut() {
            if region == s.landing.key() {
                let wi = self
                    .book
                    .cluster()
                    .worker_index(rank)
                    .ok_or_else(|| bad("a push from a rank that is not a worker".into()))?;
                let g = offset as usize / s.slot_bytes;
                if offset as usize % s.slot_bytes != 0 || g / self.slots as usize != wi {
                    return Err(bad(format!(
                        "a push at offset {offset}, outside the sender's landing slots"
                    )));
                }
                let si = self
                    .book
                    .slices()
                    .get(imm as usize)
                    .ok_or_else(|| bad(format!("unknown slice {imm}")))?;
                if si.len * 4 != len as usize {
                    return Err(bad(format!("slice {imm} pushed with {len} bytes")));
                }
                s.core.handle_landed(rank, (g % self.slots as usize) as u32, imm)?;
                return Ok(());
            }
            if region == s.shard.key() {
                s.core.handle_init(rank, imm)?;
                return Ok(());
            }
        }
        if let Some(w) = self.worker.as_mut() {
            if region == w.params.key() {
                w.core.handle_params(imm)?;
                return Ok(());
            }
        }
        Err(bad(format!("a write into unexpected region {region:#x}")))
    }
}

fn no_region(rank: u32, what: &str) -> Error {
    Error::Engine(EngineError::Protocol {
        rank,
        what: format!("rank {rank} announced no {what} region"),
    })
}

fn reply_err(r: Request, e: Error) {
    match r {
        Request::Wait { reply, .. } => drop(reply.send(Err(e))),
        Request::WaitAll { reply } => drop(reply.send(Err(e))),
        Request::Stats { reply } => drop(reply.send(Err(e))),
        Request::Shutdown { reply } => drop(reply.send(Err(e))),
        Request::HandIn { .. } | Request::Abort(_) => {}
    }
}

fn contiguous(book: &Book) -> Result<(PinnedBuffer, Vec<usize>)> {
    let offs = (0..book.layers().len() as u32)
        .map(|l| book.layer_offset(l) * 4)
        .collect();
    Ok((pinned(book.total_params() * 4)?, offs))
}

fn make_buffers(book: &Book, w: &mut WorkerPart, layer: u32) -> Result<LayerBuffers> {
    let spec = &book.layers()[layer as usize];
    let params = w.params.lease_f32(w.param_off[layer as usize] / 4, spec.params())?;
    let grad = w.grads.lease_f32(w.grad_off[layer as usize] / 4, spec.params())?;
    let factors = match (w.sf_off[layer as usize], &w.factors) {
        (Some(off), Some(r)) => {
            let k = book.config().batch;
            Some((r.lease_f32(off / 4, 4 + k * (spec.m + spec.n))?, k * spec.m))
        }
        _ => None,
    };
    w.held[layer as usize] = Held::User;
    Ok(LayerBuffers {
        layer,
        synced_at: w.synced_at[layer as usize],
        params,
        grad,
        factors,
    })
}
