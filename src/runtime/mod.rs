//! The runtime: one thread per rank that executes the engine's
//! [`Node`](tidewire_engine::node::Node) over a transport.
//!
//! It holds no protocol of its own. It opens the transport, allocates and
//! registers the regions the Node asks for, runs the rendezvous, dials the
//! peers, and then loops: calls from the session, results from the compute
//! executors and transport events go into the Node as inputs; the Node's
//! outputs are posted on the transport, queued on an executor, or handed to
//! the caller. Between inputs it sleeps in the transport's `wait`, which
//! wakes on a completion or on the waker that the session and the executors
//! ring: there is no fixed poll interval, and nothing spins while the caller
//! holds its layers.

mod exec;
pub(crate) mod job_error;
mod setup;
pub(crate) mod shared;
mod snapshot;

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use tidewire_engine::book::LayerKind;
use tidewire_engine::node::{
    HeldTransmits, Input, Limits, LocalRegion, Node, Output, Payload, SendSrc, Transmit, TxOp, CELL_BYTES,
};
use tidewire_engine::{Book, EngineError, JobCause, ProtocolViolation};
use tidewire_transport::select::{self, Preference};
use tidewire_transport::{Access, ConnId, Event, PinOptions, PinnedBuffer, Region, RemoteRegion, ReqId, Transport};

use crate::buffers::LayerBuffers;
use crate::cluster::ClusterSpec;
use crate::config::{Config, TransportKind};
use crate::error::{Error, Result};
use crate::rendezvous;
use crate::stats::SessionStats;
use exec::{Executors, JobResult, Memory, Reply, ServerSetup};
use shared::{Request, Shared};

/// Who holds a layer's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    User,
    InFlight,
    Ready,
}

/// Hand-in latencies kept for the percentiles.
const LATENCY_SAMPLES: usize = 4096;

fn pinned(len: usize) -> Result<PinnedBuffer> {
    // The TCP backend does not need locked pages; RDMA registration pins them itself.
    Ok(PinnedBuffer::with_options(
        len.max(4096),
        PinOptions {
            lock: false,
            ..Default::default()
        },
    )?)
}

fn preference(kind: TransportKind) -> Preference {
    match kind {
        TransportKind::Auto => Preference::Auto,
        TransportKind::Tcp => Preference::Tcp,
        TransportKind::Portable => Preference::Portable,
        TransportKind::Rdma => Preference::Rdma,
    }
}

/// Starts the runtime thread. Setup (rendezvous, connections, registration,
/// the initial broadcast) runs on it; `ready` gets the layer buffers or the error.
pub(crate) fn spawn(
    cfg: Config,
    book: Arc<Book>,
    spec: ClusterSpec,
    rx: Receiver<Request>,
    shared: Arc<Shared>,
    ready: Sender<Result<Vec<LayerBuffers>>>,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("tidewire-runtime-{}", spec.rank))
        .spawn(move || {
            let sh = shared.clone();
            let ready2 = ready.clone();
            // The runtime lives outside the unwind boundary: a panic is recorded
            // (and the fatal error set) before its channels close, so a caller
            // blocked in a call sees the panic, not a bare disconnection.
            let mut rt: Option<Runtime> = None;
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                match Runtime::setup(cfg, book, &spec, shared.clone(), rx) {
                    Ok(r) => rt.insert(r).run(ready),
                    Err(e) => {
                        shared.set_fatal(e.clone());
                        let _ = ready.send(Err(e));
                    }
                }
            }));
            if let Err(p) = r {
                let msg = if let Some(s) = p.downcast_ref::<&str>() {
                    (*s).to_string()
                } else if let Some(s) = p.downcast_ref::<String>() {
                    s.clone()
                } else {
                    "a panic without a message".into()
                };
                sh.panic
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(format!("the runtime thread panicked: {msg}"));
                sh.set_fatal(Error::Shutdown);
                let _ = ready2.send(Err(Error::Shutdown));
            }
            drop(rt);
        })
        .map_err(|e| Error::Thread {
            what: "runtime",
            reason: e.to_string(),
        })
}

struct Runtime {
    t: Box<dyn Transport>,
    node: Node,
    rank: u32,
    book: Arc<Book>,
    mem: Arc<Memory>,
    ex: Executors,
    jobs: Receiver<JobResult>,
    rx: Receiver<Request>,
    shared: Arc<Shared>,
    epoch: Instant,
    conn_of: Vec<Option<ConnId>>,
    rank_of: HashMap<ConnId, u32>,
    dialing: HashMap<ConnId, u32>,
    peer_keys: Vec<Option<[u32; 3]>>,
    peer_regions: Vec<[Option<RemoteRegion>; 3]>,
    peer_known: Vec<bool>,
    key_region: HashMap<u32, LocalRegion>,
    reqs: HashMap<ReqId, u64>,
    held: Vec<Held>,
    synced_at: Vec<Option<Instant>>,
    waiters: HashMap<u32, Sender<Result<LayerBuffers>>>,
    wait_all: Option<Sender<Result<Vec<LayerBuffers>>>>,
    ready: Option<Sender<Result<Vec<LayerBuffers>>>>,
    shutdown: Option<Sender<Result<()>>>,
    fatal: Option<Error>,
    finished: bool,
    hand_in_at: Option<Instant>,
    latencies: VecDeque<u64>,
    hand_in_posts: u64,
    would_block: u64,
    /// Transmits the transport refused for now, posted again when it takes more.
    refused: HeldTransmits,
    evs: Vec<Event>,
    /// Worker 0 of a checkpointing job: the model's snapshots.
    snap: Option<snapshot::ModelSnap>,
    /// Worker index 0 of an adaptive book: its scheme decisions.
    adapt: Option<tidewire_engine::adapt::Adapt>,
    /// Decisions the Node took so far (when it takes one, the session's copy of the plan follows).
    decisions_seen: u64,
    /// Rank 0 under a trigger other than `All`: the service answering replacement ranks.
    _rejoins: Option<rendezvous::Rejoins>,
}

impl Runtime {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn run(&mut self, ready: Sender<Result<Vec<LayerBuffers>>>) {
        self.ready = Some(ready);
        // Start the Node's clock, and let a job of one rank begin at once.
        self.input(Input::Tick);
        while !self.finished && self.fatal.is_none() {
            let busy = self.drain_requests() | self.drain_jobs();
            if self.finished || self.fatal.is_some() {
                break;
            }
            let timeout = if busy { Duration::ZERO } else { self.wait_time() };
            // A held transmit is tried again after the transport's next events, and soon.
            let timeout = if self.refused.is_empty() {
                timeout
            } else {
                timeout.min(HeldTransmits::RETRY_AFTER)
            };
            let mut evs = std::mem::take(&mut self.evs);
            evs.clear();
            if let Err(e) = self.t.wait(&mut evs, 512, timeout) {
                self.input(Input::Abort {
                    reason: format!("the transport failed: {e}"),
                });
            }
            for ev in evs.drain(..) {
                self.event(ev);
            }
            self.evs = evs;
            self.retry_refused();
            if self.node.poll_timeout().is_some_and(|d| self.now() >= d) {
                self.input(Input::Tick);
            }
        }
        if let Some(e) = self.fatal.clone() {
            self.flush(Duration::from_millis(200));
            self.fail_waiters(e);
        } else {
            self.leave();
        }
        self.ex.stop();
    }

    /// How long to sleep: until the Node's next timer, or until woken.
    fn wait_time(&self) -> Duration {
        match self.node.poll_timeout() {
            Some(d) => d.saturating_sub(self.now()),
            None => Duration::from_secs(3600),
        }
    }

    fn drain_requests(&mut self) -> bool {
        let mut any = false;
        loop {
            match self.rx.try_recv() {
                Ok(r) => {
                    any = true;
                    self.request(r);
                }
                Err(TryRecvError::Empty) => return any,
                Err(TryRecvError::Disconnected) => {
                    self.input(Input::Abort {
                        reason: "its session was dropped without shutdown".into(),
                    });
                    return true;
                }
            }
            if self.fatal.is_some() {
                return true;
            }
        }
    }

    fn drain_jobs(&mut self) -> bool {
        let mut any = false;
        while let Ok(j) = self.jobs.try_recv() {
            any = true;
            let input = match j.result {
                Ok(data) => Input::JobDone { id: j.id, data },
                Err(e) => Input::JobFailed {
                    id: j.id,
                    error: JobCause::new(e),
                },
            };
            self.input(input);
        }
        any
    }

    /// Feeds one input, then executes everything the Node has to say.
    fn input(&mut self, input: Input) {
        let now = self.now();
        if let Err(e) = self.node.handle(now, input) {
            // Only a hand-in or a shutdown answers with an error, and the
            // session checked what it could before: the job cannot go on.
            let reason = e.to_string();
            let _ = self.node.handle(now, Input::Abort { reason });
        }
        self.outputs();
    }

    /// Executes the Node's outputs until it has none. Inputs that outputs
    /// cause are fed only after the whole drain. A transmit the transport
    /// refuses for now is held here ([`HeldTransmits`]), with every later one
    /// to its peer behind it; the Node never hears of it.
    fn outputs(&mut self) {
        while self.node.has_output() {
            self.drain_outputs();
        }
    }

    fn drain_outputs(&mut self) {
        let mut failure: Option<String> = None;
        let mut failed = Vec::new();
        let mut known = Vec::new();
        let mut decide = Vec::new();
        while let Some(out) = self.node.poll_output() {
            match out {
                Output::Transmit(t) => {
                    let Some(t) = self.refused.admit(t) else { continue };
                    if let Err(t) = self.post_or_fail(t, &mut failed, &mut failure) {
                        self.refused.refused(t);
                    }
                }
                Output::Job(job) => {
                    if let Err(e) = self.ex.submit(job) {
                        failure.get_or_insert(e.to_string());
                    }
                }
                Output::PeerKeys { peer, keys } => {
                    self.peer_keys[peer as usize] = Some(keys);
                    if self.resolve(peer) {
                        known.push(peer);
                    }
                }
                Output::LayerReady { layer, iter } => {
                    if let Some(snap) = &mut self.snap {
                        let mem = &self.mem;
                        if let Err(e) = snap.layer_ready(&self.book, &self.node, |r| mem.get(r), layer, iter) {
                            failure.get_or_insert(format!("checkpoint snapshot of layer {layer}: {e}"));
                        }
                    }
                    self.layer_ready(layer)
                }
                Output::Ready => {
                    let layers = self.all_layers();
                    if let Some(r) = self.ready.take() {
                        let _ = r.send(layers);
                    }
                }
                Output::Finished => self.finished = true,
                Output::DecisionDue { at } => match (self.epoch.elapsed(), self.adapt.as_mut()) {
                    (now, Some(a)) => {
                        let rate = |m: &exec::Meter| {
                            let (w, ns) = (m.work.load(Ordering::Relaxed), m.ns.load(Ordering::Relaxed));
                            // A millisecond of work at least, or the figure means little.
                            (ns >= 1_000_000 && w > 0).then(|| w as f64 * 1e9 / ns as f64)
                        };
                        let reached = tidewire_engine::adapt::Reached {
                            gemm_flop_per_s: rate(&self.ex.meters.gemm),
                            sum_bytes_per_s: rate(&self.ex.meters.sum),
                        };
                        decide.push((at, a.decide(self.node.plan(), at, now, reached)));
                    }
                    (_, None) => {
                        failure.get_or_insert(format!(
                            "rank {} was asked for a scheme decision it has no policy for",
                            self.rank
                        ));
                    }
                },
                Output::Fatal(e) => {
                    tracing::error!(rank = self.rank, error = %e, "fatal");
                    let e = Error::Engine(e);
                    self.shared.set_fatal(e.clone());
                    if let Some(r) = self.ready.take() {
                        let _ = r.send(Err(e.clone()));
                    }
                    self.fatal.get_or_insert(e);
                }
            }
        }
        let now = self.now();
        for (token, reason) in failed {
            let _ = self.node.handle(now, Input::Failed { token, reason });
        }
        if let Some(reason) = failure {
            let _ = self.node.handle(now, Input::Abort { reason });
        }
        for peer in known {
            let _ = self.node.handle(now, Input::PeerRegionsKnown { peer });
        }
        for (at, sfb) in decide {
            if let Err(e) = self.node.handle(now, Input::Decide { at, sfb }) {
                let _ = self.node.handle(now, Input::Abort { reason: e.to_string() });
            }
        }
        let taken = self.node.stats().decisions;
        if taken != self.decisions_seen {
            self.decisions_seen = taken;
            let log = self.adapt.as_ref().map(|a| a.log().to_vec());
            self.shared.set_plan(self.node.plan().clone(), log);
        }
    }

    fn latency(&mut self, at: Instant) {
        if self.latencies.len() == LATENCY_SAMPLES {
            self.latencies.pop_front();
        }
        self.latencies.push_back(at.elapsed().as_nanos() as u64);
        self.hand_in_posts += 1;
    }

    /// Posts `t`: `Err(t)` when the transport refuses it for now. When the
    /// transport fails it (its connection is going: the peer may be one the
    /// job can lose), its token goes to `failed`, for the Node to hear as
    /// `Failed`; any other failure is kept in `failure` (the first one), to
    /// abort the job with.
    fn post_or_fail(
        &mut self,
        t: Transmit,
        failed: &mut Vec<(u64, String)>,
        failure: &mut Option<String>,
    ) -> std::result::Result<(), Transmit> {
        match self.post(&t) {
            Ok(req) => {
                self.reqs.insert(req, t.token);
                if let Some(at) = self.hand_in_at.take() {
                    self.latency(at);
                }
                Ok(())
            }
            Err(Error::Transport(e)) if matches!(*e, tidewire_transport::Error::WouldBlock { .. }) => {
                self.would_block += 1;
                Err(t)
            }
            Err(e @ (Error::Transport(_) | Error::Engine(EngineError::PeerLost { .. }))) => {
                failed.push((t.token, format!("posting to rank {} failed: {e}", t.peer)));
                Ok(())
            }
            Err(e) => {
                if self.fatal.is_none() && failure.is_none() {
                    *failure = Some(format!("posting to rank {} failed: {e}", t.peer));
                }
                Ok(())
            }
        }
    }

    /// Offers the held transmits to the transport again, in order per peer.
    fn retry_refused(&mut self) {
        if self.refused.is_empty() {
            return;
        }
        let (mut failed, mut failure) = (Vec::new(), None);
        let mut held = std::mem::take(&mut self.refused);
        held.retry(|t| self.post_or_fail(t, &mut failed, &mut failure));
        self.refused = held;
        for (token, reason) in failed {
            self.input(Input::Failed { token, reason });
        }
        if let Some(reason) = failure {
            self.input(Input::Abort { reason });
        }
    }

    fn post(&mut self, t: &Transmit) -> Result<ReqId> {
        let conn = self.conn_of[t.peer as usize].ok_or_else(|| {
            Error::Engine(EngineError::PeerLost {
                rank: t.peer,
                reason: "no connection".into(),
            })
        })?;
        let region = |mem: &Memory, r: LocalRegion| -> Result<Region> {
            mem.get(r)
                .cloned()
                .map_err(|e| Error::Engine(EngineError::InvalidConfig(e.to_string())))
        };
        match &t.op {
            TxOp::Write { src, dst, len, imm } => {
                let s = region(&self.mem, src.region)?.slice(src.offset as usize, *len as usize)?;
                let i = dst.region.key_index().expect("remote-writable");
                let d = self.peer_regions[t.peer as usize][i].ok_or_else(|| {
                    Error::Engine(EngineError::protocol(
                        t.peer,
                        ProtocolViolation::RegionNotAnnounced { region: dst.region },
                    ))
                })?;
                Ok(self.t.write(conn, &s, &d, dst.offset, *imm)?)
            }
            TxOp::Send { tag, src } => {
                let s = match src {
                    SendSrc::Region { at, len } => {
                        region(&self.mem, at.region)?.slice(at.offset as usize, *len as usize)?
                    }
                    SendSrc::Inline { cell, bytes } => {
                        let ctrl = region(&self.mem, LocalRegion::Ctrl)?;
                        let at = *cell as usize * CELL_BYTES;
                        ctrl.write_at(at, bytes)?;
                        ctrl.slice(at, bytes.len())?
                    }
                };
                Ok(self.t.send(conn, &s, *tag)?)
            }
        }
    }

    /// Whether the transport now knows every region `peer` announced (true
    /// once, when it first does): then the Node must hear `PeerRegionsKnown`.
    fn resolve(&mut self, peer: u32) -> bool {
        if self.peer_known[peer as usize] {
            return false;
        }
        let (Some(keys), Some(conn)) = (self.peer_keys[peer as usize], self.conn_of[peer as usize]) else {
            return false;
        };
        let Ok(regions) = self.t.remote_regions(conn) else {
            return false;
        };
        let mut found = [None; 3];
        for i in 0..3 {
            if keys[i] != 0 {
                match regions.iter().find(|r| r.rkey == keys[i]) {
                    Some(r) => found[i] = Some(*r),
                    None => return false,
                }
            }
        }
        self.peer_regions[peer as usize] = found;
        self.peer_known[peer as usize] = true;
        true
    }

    fn attach(&mut self, conn: ConnId, rank: u32) {
        let ok = (rank as usize) < self.conn_of.len() && rank != self.rank && self.conn_of[rank as usize].is_none();
        if !ok {
            self.input(Input::Abort {
                reason: format!("a peer claims rank {rank}, which is taken or outside the world"),
            });
            return;
        }
        self.conn_of[rank as usize] = Some(conn);
        self.rank_of.insert(conn, rank);
        self.input(Input::Connected { peer: rank });
        if self.resolve(rank) {
            self.input(Input::PeerRegionsKnown { peer: rank });
        }
    }

    fn event(&mut self, ev: Event) {
        match ev {
            Event::Connected { conn, peer } => {
                let want = self.dialing.remove(&conn);
                if want != Some(peer.rank) {
                    self.input(Input::Abort {
                        reason: format!("dialed rank {want:?} at {} but rank {} answered", peer.addr, peer.rank),
                    });
                    return;
                }
                self.attach(conn, peer.rank);
            }
            Event::Incoming { listener, .. } => loop {
                match self.t.accept(listener) {
                    Ok(Some((conn, peer))) => self.attach(conn, peer.rank),
                    Ok(None) => break,
                    Err(e) => {
                        self.input(Input::Abort {
                            reason: format!("accept failed: {e}"),
                        });
                        break;
                    }
                }
            },
            Event::PeerRejected { addr, error, .. } => {
                tracing::warn!(rank = self.rank, %addr, %error, "refused a connection");
            }
            Event::RemoteRegionsChanged { conn } => {
                if let Some(&r) = self.rank_of.get(&conn) {
                    if self.resolve(r) {
                        self.input(Input::PeerRegionsKnown { peer: r });
                    }
                }
            }
            Event::SendDone { req, .. } | Event::WriteDone { req, .. } | Event::ReadDone { req, .. } => {
                if let Some(token) = self.reqs.remove(&req) {
                    self.input(Input::Done { token });
                }
            }
            Event::OpFailed { req, error, .. } => {
                if let Some(token) = self.reqs.remove(&req) {
                    self.input(Input::Failed {
                        token,
                        reason: error.to_string(),
                    });
                }
            }
            Event::Message { conn, tag, data } => match self.rank_of.get(&conn) {
                Some(&peer) => self.input(Input::Message {
                    peer,
                    tag,
                    data: Payload::Bytes(data),
                }),
                None => self.input(Input::Abort {
                    reason: format!("a message on connection {conn:?}, which no peer rank owns"),
                }),
            },
            Event::WriteReceived {
                conn,
                region,
                offset,
                len,
                imm,
            } => {
                let Some(&peer) = self.rank_of.get(&conn) else {
                    self.input(Input::Abort {
                        reason: format!("a write on connection {conn:?}, which no peer rank owns"),
                    });
                    return;
                };
                let Some(&r) = self.key_region.get(&region) else {
                    self.input(Input::Abort {
                        reason: format!("rank {peer} wrote into unknown region {region:#x}"),
                    });
                    return;
                };
                self.input(Input::Landed {
                    peer,
                    region: r,
                    offset,
                    len,
                    imm,
                });
            }
            Event::WriteRejected { conn, error } => {
                let peer = self.rank_of.get(&conn).copied().unwrap_or(u32::MAX);
                self.input(Input::Abort {
                    reason: format!("rank {peer}'s write was rejected: {error}"),
                });
            }
            Event::Closed { conn, error } => {
                let peer = self.rank_of.get(&conn).copied().or_else(|| self.dialing.remove(&conn));
                if let Some(peer) = peer {
                    self.input(Input::Closed {
                        peer,
                        error: error.map(|e| e.to_string()),
                    });
                    // What was held for it never reached the transport: it failed
                    // (the Node dropped those tokens with the connection).
                    for t in self.refused.forget_peer(peer) {
                        self.input(Input::Failed {
                            token: t.token,
                            reason: "the connection closed before the transport took it".into(),
                        });
                    }
                    // The rank's slot is free again: a replacement may connect.
                    if self.conn_of.get(peer as usize) == Some(&Some(conn)) {
                        self.conn_of[peer as usize] = None;
                        self.peer_keys[peer as usize] = None;
                        self.peer_regions[peer as usize] = [None; 3];
                        self.peer_known[peer as usize] = false;
                    }
                    self.rank_of.remove(&conn);
                }
            }
            other => tracing::debug!(rank = self.rank, event = ?other, "ignored"),
        }
    }

    fn request(&mut self, r: Request) {
        match r {
            Request::HandIn { buf, factors, at } => {
                let layer = buf.layer;
                let (pr, gr) = buf.regions();
                let (params, grads) = (self.layer_region(layer, true), self.layer_region(layer, false));
                if !params.is_some_and(|p| p.same(pr)) || !grads.is_some_and(|g| g.same(gr)) {
                    self.input(Input::Abort {
                        reason: format!("layer {layer}'s buffers belong to another session"),
                    });
                    return;
                }
                if self.held.get(layer as usize) != Some(&Held::User) {
                    self.input(Input::Abort {
                        reason: format!("layer {layer} handed in twice"),
                    });
                    return;
                }
                if let Some(a) = self.adapt.as_mut() {
                    a.started(buf.iter, self.epoch.elapsed());
                }
                // The caller's leases end here: the engine may write the layer from now on.
                drop(buf);
                self.held[layer as usize] = Held::InFlight;
                // Only a post in this hand-in's own drain counts for the latency
                // (a colocated layer may post nothing).
                self.hand_in_at = Some(at);
                self.input(Input::HandIn { layer, factors });
                self.hand_in_at = None;
            }
            Request::Wait { layer, reply } => match self.held.get(layer as usize) {
                None | Some(Held::User) => {
                    let _ = reply.send(Err(Error::NotHandedIn { layer }));
                }
                Some(Held::Ready) => self.give(layer, &reply),
                Some(Held::InFlight) => {
                    if let Some(old) = self.waiters.insert(layer, reply) {
                        // An earlier call timed out, or another thread waits too: the newest wins.
                        let _ = old.send(Err(Error::Timeout {
                            what: format!("layer {layer}: a later wait_layer call took over"),
                            after: Duration::ZERO,
                        }));
                    }
                }
            },
            Request::WaitAll { reply } => {
                if let Some(old) = self.wait_all.replace(reply) {
                    let _ = old.send(Err(Error::Timeout {
                        what: "every layer: a later wait_all call took over".into(),
                        after: Duration::ZERO,
                    }));
                }
                self.try_wait_all();
            }
            Request::Stats { reply } => {
                let _ = reply.send(Ok(self.stats()));
            }
            Request::Shutdown { reply } => {
                if self.shutdown.is_some() {
                    let _ = reply.send(Err(Error::Shutdown));
                    return;
                }
                self.shutdown = Some(reply);
                self.input(Input::Shutdown);
            }
            Request::Abort(why) => self.input(Input::Abort { reason: why }),
        }
    }

    fn layer_region(&self, layer: u32, params: bool) -> Option<&Region> {
        let (p, g, _) = self.node.layer_locs(layer)?;
        self.mem.region(if params { p.region } else { g.region })
    }

    fn make_buffers(&mut self, layer: u32) -> Result<LayerBuffers> {
        let spec = self.book.layer(layer)?.clone();
        let (p, g, f) = self.node.layer_locs(layer).ok_or(Error::Role {
            rank: self.rank,
            role: "worker",
        })?;
        let lease = |loc: tidewire_engine::node::Loc, len: usize| -> Result<tidewire_transport::Lease> {
            let r = self
                .mem
                .region(loc.region)
                .ok_or_else(|| Error::Layout(format!("no {:?} region", loc.region)))?;
            Ok(r.lease(loc.offset as usize, len)?)
        };
        let params = lease(p, spec.params() * 4)?;
        let grad = lease(g, spec.params() * 4)?;
        let factors = match (f, spec.kind) {
            (Some(f), LayerKind::Fc) => {
                let k = self.book.config().batch;
                Some((lease(f, k * (spec.m + spec.n) * 4)?, k * spec.m))
            }
            _ => None,
        };
        self.held[layer as usize] = Held::User;
        Ok(LayerBuffers {
            layer,
            iter: self.node.completed(layer),
            synced_at: self.synced_at[layer as usize],
            params,
            grad,
            factors,
        })
    }

    fn all_layers(&mut self) -> Result<Vec<LayerBuffers>> {
        (0..self.held.len() as u32).map(|l| self.make_buffers(l)).collect()
    }

    fn layer_ready(&mut self, layer: u32) {
        let Some(h) = self.held.get_mut(layer as usize) else {
            return;
        };
        *h = Held::Ready;
        self.synced_at[layer as usize] = Some(Instant::now());
        if let Some(reply) = self.waiters.remove(&layer) {
            self.give(layer, &reply);
        }
        self.try_wait_all();
    }

    /// Sends a ready layer's buffers to a waiting call. If the call has given
    /// up (it timed out), the layer stays ready for the next one.
    fn give(&mut self, layer: u32, reply: &Sender<Result<LayerBuffers>>) {
        let b = self.make_buffers(layer);
        if reply.send(b).is_err() {
            self.held[layer as usize] = Held::Ready;
        }
    }

    fn try_wait_all(&mut self) {
        if self.wait_all.is_none() || self.held.contains(&Held::InFlight) {
            return;
        }
        let reply = self.wait_all.take().expect("checked");
        let ready: Vec<u32> = (0..self.held.len() as u32)
            .filter(|&l| self.held[l as usize] == Held::Ready)
            .collect();
        let bufs: Result<Vec<LayerBuffers>> = ready.iter().map(|&l| self.make_buffers(l)).collect();
        if reply.send(bufs).is_err() {
            // The call gave up: the layers stay ready for the next one.
            for l in ready {
                self.held[l as usize] = Held::Ready;
            }
        }
    }

    fn stats(&self) -> SessionStats {
        let n = self.node.stats();
        let tc = self.t.counters();
        let agg = self.ex.agg_stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut lat: Vec<u64> = self.latencies.iter().copied().collect();
        lat.sort_unstable();
        let pct = |p: f64| -> u64 {
            if lat.is_empty() {
                0
            } else {
                lat[((lat.len() - 1) as f64 * p).round() as usize]
            }
        };
        let mut sp = tidewire_engine::sparse::SparseLayerStats::default();
        for l in self.node.sparse_stats() {
            sp.add(l);
        }
        let m = &self.ex.meters;
        SessionStats {
            dropped: n.dropped,
            late_folded: n.late_folded,
            partial_applies: n.partial_applies,
            sparse_pushes: sp.sparse_pushes,
            sparse_dense_pushes: sp.dense_pushes,
            sparse_nonzeros: sp.nonzeros,
            sparse_elements: sp.scanned,
            sparse_bytes: sp.sparse_bytes,
            sparse_dense_bytes: sp.dense_bytes,
            pushes: n.pushes,
            factor_sends: n.factor_sends,
            decisions: n.decisions,
            switches: n.switches,
            accumulated: n.accumulated,
            applies: n.applies,
            broadcasts: n.broadcasts,
            rx_direct_bytes: tc.rx_direct_bytes,
            tx_payload_bytes: tc.tx_payload_bytes,
            tx_sends: tc.tx_sends,
            rx_copied_bytes: tc.rx_copied_bytes,
            cpu_aggregated_bytes: agg.cpu_bytes,
            gpu_aggregated_bytes: agg.gpu_bytes,
            cpu_aggregation_chunks: agg.sched.cpu_picks,
            gpu_aggregation_chunks: agg.sched.gpu_picks,
            max_outstanding: n.max_outstanding as u64,
            max_message_bytes: n.max_message,
            would_block: self.would_block,
            hand_in_posts: self.hand_in_posts,
            hand_in_to_post_p50_ns: pct(0.5),
            hand_in_to_post_p99_ns: pct(0.99),
            factor_bytes_in_place: self.ex.meters.reads.in_place.load(Ordering::Relaxed),
            factor_bytes_decoded: self.ex.meters.reads.decoded.load(Ordering::Relaxed),
            gemm_flops: m.gemm.work.load(Ordering::Relaxed),
            gemm_ns: m.gemm.ns.load(Ordering::Relaxed),
            sum_bytes: m.sum.work.load(Ordering::Relaxed),
            sum_ns: m.sum.ns.load(Ordering::Relaxed),
            apply_params: m.apply.work.load(Ordering::Relaxed),
            apply_ns: m.apply.ns.load(Ordering::Relaxed),
        }
    }

    /// Waits up to `limit` for posted transmits (the aborts) to leave.
    fn flush(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut evs = Vec::new();
        // What is held goes too (a fatal error's Abort notice may wait behind it).
        self.post_held_best_effort();
        while !(self.reqs.is_empty() && self.refused.is_empty()) && Instant::now() < deadline {
            self.post_held_best_effort();
            evs.clear();
            if self.t.wait(&mut evs, 256, Duration::from_millis(10)).is_err() {
                break;
            }
            for ev in evs.drain(..) {
                if let Event::SendDone { req, .. } | Event::WriteDone { req, .. } | Event::OpFailed { req, .. } = ev {
                    self.reqs.remove(&req);
                }
            }
        }
    }

    /// Posts what is held where the transport takes it, without telling the
    /// Node anything (the job is failing: a post that fails is dropped).
    fn post_held_best_effort(&mut self) {
        let mut held = std::mem::take(&mut self.refused);
        held.retry(|t| match self.post(&t) {
            Ok(req) => {
                self.reqs.insert(req, t.token);
                Ok(())
            }
            Err(Error::Transport(e)) if matches!(*e, tidewire_transport::Error::WouldBlock { .. }) => Err(t),
            Err(_) => Ok(()),
        });
        self.refused = held;
    }

    fn fail_waiters(&mut self, e: Error) {
        for (_, r) in self.waiters.drain() {
            let _ = r.send(Err(e.clone()));
        }
        if let Some(r) = self.wait_all.take() {
            let _ = r.send(Err(e.clone()));
        }
        if let Some(r) = self.shutdown.take() {
            let _ = r.send(Err(e.clone()));
        }
        if let Some(r) = self.ready.take() {
            let _ = r.send(Err(e));
        }
        // Calls that arrive from now on fail at once.
        while let Ok(r) = self.rx.try_recv() {
            reply_err(r, self.fatal.clone().unwrap_or(Error::Shutdown));
        }
    }

    /// Every peer said goodbye: close the connections gracefully and return.
    fn leave(&mut self) {
        let conns: Vec<ConnId> = self.conn_of.iter().flatten().copied().collect();
        for c in &conns {
            let _ = self.t.close(*c);
        }
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut open: HashSet<ConnId> = conns.into_iter().collect();
        let mut evs = Vec::new();
        while !open.is_empty() && Instant::now() < deadline {
            evs.clear();
            if self.t.wait(&mut evs, 256, Duration::from_millis(20)).is_err() {
                break;
            }
            for ev in evs.drain(..) {
                if let Event::Closed { conn, .. } = ev {
                    open.remove(&conn);
                }
            }
        }
        self.shared.set_last_stats(self.stats());
        if let Some(r) = self.shutdown.take() {
            let _ = r.send(Ok(()));
        }
        while let Ok(r) = self.rx.try_recv() {
            reply_err(r, Error::Shutdown);
        }
    }
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
