//! [`PortableTransport`]: the poller and everything it watches, the event loop,
//! connection lifecycle and deadlines, and the [`Transport`] implementation.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll};
use tracing::{debug, info};

use crate::api::{ConnId, Event, ListenerId, Properties, Transport, WakeFd};
use crate::conn_core::{self, Backend, RegionTable};
use crate::error::{Error, Result};
use crate::handshake::Params;
use crate::memory::{Access, PinnedBuffer, Region};
use crate::tcp::sys::SockOpts;
use crate::TcpConfig;

use super::config::{PortableStats, Sock, DISCARD_CHUNK, EVENTS};
use super::state::{Conn, CtrlRx, DataRx, Listener, Pending, Ready, Side, State};

/// The portable (epoll) TCP transport. See the module docs.
pub struct PortableTransport {
    pub(super) poll: Poll,
    pub(super) mio_events: Events,
    /// Readiness reported by the last poll, copied out of `mio_events` (reused).
    pub(super) fired: Vec<(Sock, bool, bool)>,
    pub(super) cfg: TcpConfig,
    pub(super) params: Params,
    pub(super) props: Properties,
    pub(super) listeners: HashMap<u64, Listener>,
    pub(super) pending: HashMap<u64, Pending>,
    pub(super) conns: HashMap<u64, Conn>,
    pub(super) tokens: HashMap<u64, u64>,
    pub(super) regions: RegionTable,
    pub(super) events: VecDeque<Event>,
    pub(super) next_id: u64,
    pub(super) next_req: u64,
    pub(super) stats: PortableStats,
    pub(super) sockopts: SockOpts,
    /// Connections with queued output or unread input to look at (reused).
    pub(super) dirty: Vec<u64>,
    pub(super) work: Vec<u64>,
    /// Sockets whose read budget ran out (more to read without a new edge).
    pub(super) again: Vec<Sock>,
    /// Complete data-socket first frames waiting for their connection's Auth.
    pub(super) parked: Vec<u64>,
    /// Parked sockets to classify again (their Auth arrived).
    pub(super) dirty_pending: Vec<u64>,
    /// Scratch iovecs for gathered sends (reused).
    pub(super) iov: Vec<libc::iovec>,
    /// Scratch for discarding rejected writes.
    pub(super) scratch: Box<[u8]>,
    pub(super) wake: Arc<WakeFd>,
}

// SAFETY: `iov` holds raw pointers only between its fill and the sendmsg that
// uses them, inside one call on the owner's thread; it never dereferences them
// across calls. Everything else is Send.
unsafe impl Send for PortableTransport {}

impl std::fmt::Debug for PortableTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortableTransport")
            .field("rank", &self.cfg.rank)
            .field("conns", &self.conns.len())
            .field("regions", &self.regions.len())
            .finish()
    }
}

impl PortableTransport {
    /// A poller and a waker; no sockets yet. Needs only epoll and eventfd.
    pub fn new(cfg: TcpConfig) -> Result<Self> {
        conn_core::check_max_message(&cfg, "PortableTransport::new")?;
        conn_core::check_max_outstanding(&cfg, "PortableTransport::new")?;
        let poll = Poll::new().map_err(|source| Error::Io {
            op: "epoll_create",
            peer: None,
            source,
        })?;
        let wake = WakeFd::new()?;
        poll.registry()
            .register(&mut SourceFd(&wake.fd()), Sock::Wake.token(), Interest::READABLE)
            .map_err(|source| Error::Io {
                op: "epoll_ctl (waker)",
                peer: None,
                source,
            })?;
        let props = conn_core::properties(&cfg, "tcp-portable");
        let sockopts = conn_core::sockopts(&cfg);
        let params = Params {
            job_id: cfg.job_id,
            rank: cfg.rank,
            secret: cfg.secret.clone(),
        };
        info!(rank = cfg.rank, "portable (epoll) TCP transport ready");
        Ok(PortableTransport {
            poll,
            mio_events: Events::with_capacity(EVENTS),
            fired: Vec::with_capacity(EVENTS),
            cfg,
            params,
            props,
            listeners: HashMap::new(),
            pending: HashMap::new(),
            conns: HashMap::new(),
            tokens: HashMap::new(),
            regions: RegionTable::default(),
            events: VecDeque::new(),
            next_id: 1,
            next_req: 1,
            stats: PortableStats::default(),
            sockopts,
            dirty: Vec::new(),
            work: Vec::new(),
            again: Vec::new(),
            parked: Vec::new(),
            dirty_pending: Vec::new(),
            iov: Vec::with_capacity(2 * super::config::GATHER_MAX + 1),
            scratch: vec![0u8; DISCARD_CHUNK].into_boxed_slice(),
            wake,
        })
    }

    /// Data-path counters.
    pub fn stats(&self) -> PortableStats {
        self.stats
    }

    /// Marks `conn` as having output to send.
    pub(super) fn mark_dirty(&mut self, conn: u64) {
        self.dirty.push(conn);
    }

    pub(super) fn id(&mut self) -> u64 {
        let i = self.next_id;
        self.next_id += 1;
        i
    }

    pub(super) fn io_err(op: &'static str, peer: Option<SocketAddr>) -> impl FnOnce(io::Error) -> Error {
        move |source| Error::Io { op, peer, source }
    }

    // ---------------------------------------------------------------- the loop

    /// One turn: wait up to `timeout` for readiness, then accept, read, write and
    /// check deadlines.
    pub(super) fn progress(&mut self, timeout: Option<Duration>) -> Result<()> {
        let busy = !self.again.is_empty() || !self.dirty.is_empty() || !self.dirty_pending.is_empty();
        let timeout = if busy { Some(Duration::ZERO) } else { timeout };
        self.stats.polls += 1;
        match self.poll.poll(&mut self.mio_events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(Error::Io {
                    op: "epoll_wait",
                    peer: None,
                    source,
                })
            }
        }
        self.fired.clear();
        for ev in self.mio_events.iter() {
            let rd = ev.is_readable() || ev.is_read_closed() || ev.is_error();
            let wr = ev.is_writable() || ev.is_write_closed() || ev.is_error();
            self.fired.push((Sock::from_token(ev.token()), rd, wr));
        }
        for &s in &self.again {
            self.fired.push((s, true, false));
        }
        self.again.clear();
        let mut fired = std::mem::take(&mut self.fired);
        self.work.clear();
        for &(sock, rd, wr) in &fired {
            match sock {
                Sock::Wake => self.wake.drain(),
                Sock::Listener(l) => self.accept_all(l),
                Sock::Pending(p) => self.read_first_frame(p),
                Sock::Ctrl(c) => {
                    if let Some(conn) = self.conns.get_mut(&c) {
                        conn.ctrl_ready.rd |= rd;
                        conn.ctrl_ready.wr |= wr;
                        self.work.push(c);
                    }
                }
                Sock::Data(c) => {
                    if let Some(conn) = self.conns.get_mut(&c) {
                        conn.data_ready.rd |= rd;
                        conn.data_ready.wr |= wr;
                        self.work.push(c);
                    }
                }
            }
        }
        fired.clear();
        self.fired = fired;
        let mut work = std::mem::take(&mut self.work);
        work.append(&mut self.dirty);
        work.sort_unstable();
        work.dedup();
        for &c in &work {
            self.drive(c);
        }
        work.clear();
        self.work = work;
        while let Some(p) = self.dirty_pending.pop() {
            self.read_first_frame(p);
        }
        // Driving may queue more output (acks, Ready); flush it in the same turn.
        self.flush_dirty();
        self.check_deadlines();
        Ok(())
    }

    /// Sends what every connection with queued output can send now.
    pub(super) fn flush_dirty(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for &c in &dirty {
            self.flush(c);
        }
        dirty.clear();
        // Flushing may dirty connections again (a close completing); keep those.
        dirty.append(&mut self.dirty);
        self.dirty = dirty;
    }

    /// Reads and writes whatever one connection's sockets allow.
    pub(super) fn drive(&mut self, c: u64) {
        let Some(conn) = self.conns.get_mut(&c) else { return };
        if conn.state == State::Connecting && conn.ctrl_ready.wr {
            self.on_connected(c);
        }
        let Some(conn) = self.conns.get_mut(&c) else { return };
        if conn.data_connecting && conn.data_ready.wr {
            self.on_data_connected(c);
        }
        if self.conns.get(&c).is_some_and(|x| x.ctrl_ready.rd) {
            self.read_ctrl(c);
        }
        if self.conns.get(&c).is_some_and(|x| x.data_ready.rd) {
            self.read_data(c);
        }
        self.flush(c);
    }

    // ---------------------------------------------------------------- lifecycle

    pub(super) fn new_conn(
        &mut self,
        side: Side,
        addr: SocketAddr,
        ctrl: mio::net::TcpStream,
        listener: Option<u64>,
    ) -> u64 {
        let id = self.id();
        let c = Conn {
            id,
            side,
            state: if side == Side::Client {
                State::Connecting
            } else {
                State::Handshake
            },
            hs: None,
            peer_addr: addr,
            peer_rank: u32::MAX,
            listener,
            ctrl,
            ctrl_ready: Ready::default(),
            data: None,
            data_ready: Ready::default(),
            data_connecting: false,
            attach: None,
            data_eof: false,
            deadline: Some(Instant::now() + self.cfg.handshake_timeout),
            rx: CtrlRx::new(),
            drx: DataRx::header(),
            ctrl_tx: VecDeque::new(),
            ctrl_off: 0,
            data_tx: VecDeque::new(),
            data_off: 0,
            awaiting_ack: VecDeque::new(),
            next_write_seq: 1,
            ack_to_send: None,
            outstanding: 0,
            remote: HashMap::new(),
            local_close: false,
            sent_close: false,
            peer_closed: false,
        };
        self.conns.insert(id, c);
        id
    }

    /// Removes a connection: deregisters and closes its sockets, fails its queued work.
    fn remove(&mut self, conn: u64) -> Option<Conn> {
        let mut c = self.conns.remove(&conn)?;
        let _ = self.poll.registry().deregister(&mut c.ctrl);
        let _ = c.ctrl.shutdown(std::net::Shutdown::Both);
        if let Some(d) = c.data.as_mut() {
            let _ = self.poll.registry().deregister(d);
            let _ = d.shutdown(std::net::Shutdown::Both);
        }
        if self.tokens.get(&c.hs_token()).is_some_and(|&x| x == conn) {
            self.tokens.remove(&c.hs_token());
        }
        Some(c)
    }

    /// Fails a connection: every queued and unacknowledged request fails, and the
    /// application hears `Closed` with the error (or `PeerRejected` for an inbound
    /// connection that never finished its handshake).
    pub(super) fn fail(&mut self, conn: u64, err: Error) {
        let Some(mut c) = self.remove(conn) else { return };
        debug!(conn, error = %err, state = c.state.name(), "connection failed");
        let peer = c.peer();
        let lost = |during| Error::ConnectionLost {
            conn,
            peer: peer.clone(),
            during,
            source: None,
        };
        let reqs = c
            .ctrl_tx
            .drain(..)
            .filter_map(|f| f.req)
            .chain(c.data_tx.drain(..).map(|w| w.req))
            .chain(c.awaiting_ack.drain(..).map(|a| a.req));
        for req in reqs {
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req,
                error: lost("an operation queued when the connection failed"),
            });
        }
        if c.handshaking() && c.side == Side::Server {
            self.events.push_back(Event::PeerRejected {
                listener: ListenerId(c.listener.unwrap_or(0)),
                addr: c.peer_addr,
                error: err,
            });
        } else {
            self.events.push_back(Event::Closed {
                conn: ConnId(conn),
                error: Some(err),
            });
        }
    }

    pub(super) fn lost(&self, conn: u64, during: &'static str, source: Option<io::Error>) -> Error {
        conn_core::lost(conn, self.conns.get(&conn).map(|c| c.peer()), during, source)
    }

    pub(super) fn check_close_done(&mut self, conn: u64) {
        let Some(c) = self.conns.get(&conn) else { return };
        if c.state == State::Closing && c.peer_closed && c.sent_close && c.ctrl_tx.is_empty() {
            self.finish_close(conn);
        }
    }

    pub(super) fn finish_close(&mut self, conn: u64) {
        let Some(mut c) = self.remove(conn) else { return };
        debug!(conn, "closed gracefully");
        for a in c.awaiting_ack.drain(..) {
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req: a.req,
                error: Error::Cancelled { conn },
            });
        }
        self.events.push_back(Event::Closed {
            conn: ConnId(conn),
            error: None,
        });
    }

    pub(super) fn check_deadlines(&mut self) {
        let now = Instant::now();
        let mut expired = Vec::new();
        for c in self.conns.values() {
            let oldest = c.awaiting_ack.front().map(|a| a.since);
            if let Some((op, after)) = conn_core::expired(&self.cfg, now, c.deadline, c.state == State::Closing, oldest)
            {
                expired.push((c.id, op, after));
            }
        }
        for (id, op, after) in expired {
            let peer = self.conns.get(&id).map(|c| c.peer()).unwrap_or_default();
            self.fail(id, conn_core::timeout(op, peer, after));
        }
        let late = self.pending.iter().filter(|(_, p)| p.deadline <= now);
        let late: Vec<u64> = late.map(|(&id, _)| id).collect();
        for id in late {
            let error = conn_core::first_frame_timeout(&self.cfg, self.pending[&id].addr);
            self.refuse_pending(id, crate::handshake::Refusal { error, reply: None });
        }
    }

    /// The earliest instant at which `check_deadlines` has something to do.
    pub(super) fn nearest_deadline(&self) -> Option<Instant> {
        let conns = self.conns.values();
        let conns = conns.map(|c| (c.deadline, c.awaiting_ack.front().map(|a| a.since)));
        let pending = self.pending.values().map(|p| p.deadline);
        conn_core::nearest_deadline(&self.cfg, conns, pending)
    }

    pub(super) fn ready_conn(&mut self, conn: ConnId, op: &'static str) -> Result<&mut Conn> {
        let c = self
            .conns
            .get_mut(&conn.0)
            .ok_or(Error::UnknownConnection { op, conn: conn.0 })?;
        match c.state {
            State::Ready => Ok(c),
            State::Closing => Err(Error::UnknownConnection { op, conn: conn.0 }),
            _ => Err(Error::NotConnected { op, conn: conn.0 }),
        }
    }
}

impl Conn {
    fn hs_token(&self) -> u64 {
        self.hs.as_ref().map(|h| h.token()).unwrap_or(0)
    }
}

impl Transport for PortableTransport {
    // properties, listener_addr, accept, remote_regions, send, write, waker.
    crate::conn_core::transport_common!();

    fn listen(&mut self, addr: SocketAddr) -> Result<ListenerId> {
        let mut sock = mio::net::TcpListener::bind(addr).map_err(Self::io_err("listen (bind)", Some(addr)))?;
        let bound = sock
            .local_addr()
            .map_err(Self::io_err("listen (local_addr)", Some(addr)))?;
        let id = self.id();
        self.poll
            .registry()
            .register(&mut sock, Sock::Listener(id).token(), Interest::READABLE)
            .map_err(Self::io_err("epoll_ctl (listener)", Some(addr)))?;
        self.listeners.insert(
            id,
            Listener {
                sock,
                addr: bound,
                accepted: VecDeque::new(),
            },
        );
        info!(addr = %bound, "listening (portable)");
        Ok(ListenerId(id))
    }

    fn connect(&mut self, addr: SocketAddr) -> Result<ConnId> {
        self.start_connect(addr)
    }

    fn register(&mut self, buf: PinnedBuffer, access: Access) -> Result<Region> {
        conn_core::check_register(&buf)?;
        let key = self.regions.new_key();
        let generation = (self.id() & 0xffff_ffff) as u32;
        let r = Region::new(buf, key, generation, access, None);
        self.regions.insert(r.clone());
        debug!(
            key = format_args!("{key:#x}"),
            len = r.len(),
            ?access,
            "registered region"
        );
        self.broadcast_regions(&r, false);
        Ok(r)
    }

    fn deregister(&mut self, region: &Region) -> Result<()> {
        self.regions.deregister(region)?;
        self.broadcast_regions(region, true);
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<Event>, max: usize) -> Result<usize> {
        if self.events.len() < max {
            self.progress(Some(Duration::ZERO))?;
        }
        Ok(self.drain_events(events, max))
    }

    fn wait(&mut self, events: &mut Vec<Event>, max: usize, timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        let end = start + timeout;
        let spin_end = start + self.cfg.busy_poll.min(timeout);
        // Send what the caller queued, then go straight to the (possibly sleeping)
        // epoll_wait below: it returns at once if anything is ready.
        self.flush_dirty();
        while self.events.is_empty() && !self.wake.is_pending() && Instant::now() < spin_end {
            self.progress(Some(Duration::ZERO))?;
        }
        self.wait_rest(events, max, end)
    }

    fn close(&mut self, conn: ConnId) -> Result<()> {
        let close_timeout = self.cfg.close_timeout;
        let c = self.conns.get_mut(&conn.0).ok_or(Error::UnknownConnection {
            op: "close",
            conn: conn.0,
        })?;
        match c.state {
            State::Ready => {
                c.state = State::Closing;
                c.local_close = true;
                c.deadline = Some(Instant::now() + close_timeout);
                self.dirty.push(conn.0);
            }
            State::Closing => {}
            State::Connecting | State::Handshake => {
                // Abort a handshake in progress: nothing was exchanged yet.
                self.remove(conn.0);
                self.events.push_back(Event::Closed { conn, error: None });
            }
        }
        Ok(())
    }

    fn counters(&self) -> crate::api::Counters {
        crate::api::Counters {
            rx_direct_bytes: self.stats.rx_write_direct_bytes,
            rx_copied_bytes: self.stats.rx_user_copy_bytes,
            tx_payload_bytes: self.stats.tx_payload_bytes,
            tx_sends: self.stats.tx_sends,
        }
    }
}

impl Drop for PortableTransport {
    fn drop(&mut self) {
        // Cut every socket at once so peers see a reset or EOF now, not at exit.
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.remove(id);
        }
        let _ = self.poll.registry().deregister(&mut SourceFd(&self.wake.fd()));
    }
}
