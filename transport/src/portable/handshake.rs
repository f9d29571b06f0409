//! The handshake, driven over non-blocking sockets: accepting and classifying
//! sockets by their first frame, the client's connects, feeding the sans-IO
//! [`crate::handshake`] machine, attaching data sockets, and refusals.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::Instant;

use mio::net::TcpStream;
use mio::Interest;
use tracing::{debug, info, warn};

use crate::api::{ConnId, Event, ListenerId, PeerInfo};
use crate::auth;
use crate::conn_core::Backend;
use crate::error::{Error, Result};
use crate::frame::{Header, HEADER_LEN, NONCE_LEN};
use crate::handshake::{self as hs, FirstFrame, Frame, Handshake, Outcome, Refusal, MAX_PENDING_HANDSHAKES};
use crate::tcp::sys;

use super::config::Sock;
use super::state::{Payload, Pending, Side, State};
use super::PortableTransport;

const RW: Interest = Interest::READABLE.add(Interest::WRITABLE);

impl PortableTransport {
    /// Unauthenticated inbound handshakes now: unclassified sockets and server
    /// connections whose peer has not proved the secret.
    fn pending_handshakes(&self) -> usize {
        self.pending.len()
            + self
                .conns
                .values()
                .filter(|c| c.side == Side::Server && c.pre_auth())
                .count()
    }

    /// Closes the oldest unauthenticated inbound handshake (an unclassified
    /// socket or a server connection waiting for the Auth), reporting it as
    /// [`Error::TooManyHandshakes`]. False when there is none.
    fn evict_oldest_handshake(&mut self) -> bool {
        // Every handshake's deadline is its start plus the same timeout, so the
        // earliest deadline is the oldest.
        let pend = self.pending.iter().map(|(&id, p)| (p.deadline, false, id)).min();
        let conn = self
            .conns
            .values()
            .filter(|c| c.side == Side::Server && c.pre_auth())
            .filter_map(|c| c.deadline.map(|d| (d, true, c.id)))
            .min();
        let Some((_, is_conn, id)) = pend.into_iter().chain(conn).min() else {
            return false;
        };
        self.stats.refused_over_limit += 1;
        if is_conn {
            let peer = self.conns.get(&id).map(|c| c.peer()).unwrap_or_default();
            debug!(conn = id, %peer, "evicting the oldest handshake: {MAX_PENDING_HANDSHAKES} pending");
            self.fail(
                id,
                Error::TooManyHandshakes {
                    peer,
                    limit: MAX_PENDING_HANDSHAKES,
                },
            );
        } else {
            let peer = self.pending[&id].addr.to_string();
            debug!(pending = id, %peer, "evicting the oldest handshake: {MAX_PENDING_HANDSHAKES} pending");
            self.refuse_pending(
                id,
                Refusal {
                    error: Error::TooManyHandshakes {
                        peer,
                        limit: MAX_PENDING_HANDSHAKES,
                    },
                    reply: None,
                },
            );
        }
        true
    }

    pub(super) fn accept_all(&mut self, listener: u64) {
        loop {
            let Some(l) = self.listeners.get(&listener) else { return };
            let (mut sock, addr) = match l.sock.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn!(listener, error = %e, "accept failed");
                    return;
                }
            };
            // At the bound, the oldest handshake goes (as in the io_uring backend):
            // idle sockets cannot keep a real peer out for longer than it takes
            // the peer to connect.
            while self.pending_handshakes() >= MAX_PENDING_HANDSHAKES {
                if !self.evict_oldest_handshake() {
                    break;
                }
            }
            if let Err(e) = sys::tune(sock.as_raw_fd(), &self.sockopts) {
                warn!(%addr, error = %e, "socket options on an accepted socket");
            }
            let id = self.id();
            if let Err(e) = self
                .poll
                .registry()
                .register(&mut sock, Sock::Pending(id).token(), Interest::READABLE)
            {
                warn!(%addr, error = %e, "epoll_ctl on an accepted socket");
                continue;
            }
            self.pending.insert(
                id,
                Pending {
                    sock,
                    addr,
                    listener,
                    deadline: Instant::now() + self.cfg.handshake_timeout,
                    buf: [0; HEADER_LEN + hs::FIRST_FRAME_MAX as usize],
                    have: 0,
                    hdr: None,
                },
            );
            debug!(%addr, pending = id, "accepted a socket");
            // Its first bytes may already be in.
            self.read_first_frame(id);
        }
    }

    /// Refuses an unclassified socket: tells it why (when it should learn) and closes it.
    pub(super) fn refuse_pending(&mut self, id: u64, r: Refusal) {
        let Some(mut p) = self.pending.remove(&id) else { return };
        self.parked.retain(|&x| x != id);
        let _ = self.poll.registry().deregister(&mut p.sock);
        debug!(addr = %p.addr, error = %r.error, "refusing a peer");
        if let Some(f) = r.reject_frame() {
            send_now(&mut p.sock, &f);
        }
        let _ = p.sock.shutdown(std::net::Shutdown::Both);
        self.events.push_back(Event::PeerRejected {
            listener: ListenerId(p.listener),
            addr: p.addr,
            error: r.error,
        });
    }

    /// Reads an unclassified socket's first frame: the header alone first (checked
    /// before any payload byte is read), then exactly its payload.
    pub(super) fn read_first_frame(&mut self, id: u64) {
        loop {
            let Some(p) = self.pending.get_mut(&id) else { return };
            let want = match p.hdr {
                None => HEADER_LEN,
                Some(h) => HEADER_LEN + h.length as usize,
            };
            if p.have == want {
                if p.hdr.is_none() {
                    let b: [u8; HEADER_LEN] = p.buf[..HEADER_LEN].try_into().expect("40 bytes");
                    match hs::first_header(&p.addr.to_string(), &b) {
                        Ok(h) => p.hdr = Some(h),
                        Err(r) => {
                            self.stats.pre_auth_refused += 1;
                            return self.refuse_pending(id, r);
                        }
                    }
                    continue;
                }
                return self.on_first_frame(id);
            }
            match p.sock.read(&mut p.buf[p.have..want]) {
                Ok(0) => {
                    let e = Error::ConnectionLost {
                        conn: 0,
                        peer: p.addr.to_string(),
                        during: "the first frame of the handshake",
                        source: None,
                    };
                    return self.refuse_pending(id, Refusal { error: e, reply: None });
                }
                Ok(n) => p.have += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let e = Error::ConnectionLost {
                        conn: 0,
                        peer: p.addr.to_string(),
                        during: "the first frame of the handshake",
                        source: Some(e),
                    };
                    return self.refuse_pending(id, Refusal { error: e, reply: None });
                }
            }
        }
    }

    fn new_token(&self) -> u64 {
        let mut token = auth::random_u64();
        while token == 0 || self.tokens.contains_key(&token) {
            token = auth::random_u64();
        }
        token
    }

    fn on_first_frame(&mut self, id: u64) {
        let token = self.new_token();
        let p = self.pending.get(&id).expect("caller checked");
        let hdr = p.hdr.expect("complete");
        let peer = p.addr.to_string();
        let payload = &p.buf[HEADER_LEN..HEADER_LEN + hdr.length as usize];
        let now = Instant::now();
        let first = hs::first_frame(&self.params, &peer, hdr, payload, token, now, p.deadline);
        match first {
            Err(r) => self.refuse_pending(id, r),
            Ok(FirstFrame::Hello { hs, send }) => self.on_hello(id, token, hs, send),
            Ok(FirstFrame::DataAttach { token, mac }) => self.on_data_attach(id, &peer, token, mac),
        }
    }

    /// Pending socket `id` sent a `Hello`: it becomes a server connection that
    /// holds `token`, runs `hs` and sends the challenge `send`.
    fn on_hello(&mut self, id: u64, token: u64, hs: Box<Handshake>, send: Frame) {
        let mut p = self.pending.remove(&id).expect("present");
        let (addr, listener) = (p.addr, p.listener);
        let conn = self.id();
        if let Err(e) = self
            .poll
            .registry()
            .reregister(&mut p.sock, Sock::Ctrl(conn).token(), RW)
        {
            warn!(%addr, error = %e, "epoll_ctl on a control socket");
            return;
        }
        // new_conn takes the next id; keep ours by inserting under it.
        self.next_id -= 1;
        let conn2 = self.new_conn(Side::Server, addr, p.sock, Some(listener));
        debug_assert_eq!(conn, conn2);
        self.tokens.insert(token, conn);
        let c = self.conns.get_mut(&conn).expect("just made");
        c.deadline = Some(hs.deadline());
        c.peer_rank = hs.peer_rank();
        c.hs = Some(hs);
        // Bytes after the Hello (the Auth, say) may already be queued.
        c.ctrl_ready = super::state::Ready { rd: true, wr: true };
        debug!(conn, rank = c.peer_rank, "hello received; challenge sent");
        self.queue_frame(conn, send);
        self.dirty.push(conn);
    }

    /// Pending socket `id` claims to be the data socket of the connection given
    /// `token`: attach it there if `mac` proves it, else refuse it (or park it
    /// while that connection still awaits its Auth).
    fn on_data_attach(&mut self, id: u64, peer: &str, token: u64, mac: [u8; NONCE_LEN]) {
        if self.park_before_auth(id, token) {
            return;
        }
        let conn = self.tokens.get(&token).copied();
        let attached = match conn.and_then(|c| self.conns.get_mut(&c)) {
            Some(c) if c.data.is_none() => match c.hs.as_mut() {
                Some(h) => h.attach(&self.params, &mac),
                None => Err(hs::unknown_token(peer)),
            },
            _ => Err(hs::unknown_token(peer)),
        };
        let ready = match attached {
            Ok(f) => f,
            Err(r) => return self.refuse_pending(id, r),
        };
        let conn = conn.expect("attached");
        let mut p = self.pending.remove(&id).expect("present");
        if let Err(e) = self
            .poll
            .registry()
            .reregister(&mut p.sock, Sock::Data(conn).token(), RW)
        {
            let e = Error::Io {
                op: "epoll_ctl (data socket)",
                peer: Some(p.addr),
                source: e,
            };
            return self.fail(conn, e);
        }
        self.tokens.remove(&token);
        self.ready_on_data(conn, p.sock, ready);
    }

    /// True when pending data socket `id` was parked because the connection given
    /// `token` still awaits its Auth, even after reading its control socket.
    fn park_before_auth(&mut self, id: u64, token: u64) -> bool {
        // The client sends Auth on the control socket before it connects the data
        // socket, but the two sockets race: read the control socket first, and if
        // the Auth is still not in, park this socket until it is (or its deadline).
        let Some(c) = self.tokens.get(&token).copied() else {
            return false;
        };
        let awaiting_auth = |t: &Self| {
            t.conns
                .get(&c)
                .and_then(|x| x.hs.as_ref())
                .is_some_and(|h| h.state() == hs::HsState::AwaitAuth)
        };
        if !awaiting_auth(self) {
            return false;
        }
        if let Some(x) = self.conns.get_mut(&c) {
            x.ctrl_ready.rd = true;
        }
        self.read_ctrl(c);
        if !awaiting_auth(self) {
            return false;
        }
        debug!(conn = c, pending = id, "data socket before the Auth: parked");
        if !self.parked.contains(&id) {
            self.parked.push(id);
        }
        true
    }

    /// Server connection `conn`, now authenticated, takes `sock` as its data
    /// socket and is ready: it sends `ready` and the region list, and its
    /// listener reports it.
    fn ready_on_data(&mut self, conn: u64, sock: TcpStream, ready: Frame) {
        let list = self.regions.announce_list();
        let c = self.conns.get_mut(&conn).expect("checked");
        c.data = Some(sock);
        c.data_ready = super::state::Ready { rd: true, wr: true };
        c.state = State::Ready;
        c.deadline = None;
        c.hs = None;
        let info = PeerInfo {
            rank: c.peer_rank,
            addr: c.peer_addr,
        };
        let listener = c.listener.unwrap_or(0);
        info!(
            conn,
            rank = info.rank,
            "peer authenticated; connection ready (portable)"
        );
        self.reserve_for_ready(conn);
        self.queue_frame(conn, ready);
        self.send_regions(conn, &list, false);
        if let Some(l) = self.listeners.get_mut(&listener) {
            l.accepted.push_back((ConnId(conn), info));
        }
        self.events.push_back(Event::Incoming {
            listener: ListenerId(listener),
            conn: ConnId(conn),
        });
        self.again.push(Sock::Data(conn));
    }

    // ---------------------------------------------------------------- connect side

    pub(super) fn start_connect(&mut self, addr: SocketAddr) -> Result<ConnId> {
        let sock = match mio::net::TcpStream::connect(addr) {
            Ok(s) => s,
            Err(source) => {
                // Report it like a connect that failed later: the caller polls for it.
                let id = self.id();
                self.events.push_back(Event::Closed {
                    conn: ConnId(id),
                    error: Some(Error::Io {
                        op: "connect",
                        peer: Some(addr),
                        source,
                    }),
                });
                return Ok(ConnId(id));
            }
        };
        sys::tune(sock.as_raw_fd(), &self.sockopts)?;
        let conn = self.new_conn(Side::Client, addr, sock, None);
        let c = self.conns.get_mut(&conn).expect("just made");
        self.poll
            .registry()
            .register(&mut c.ctrl, Sock::Ctrl(conn).token(), RW)
            .map_err(Self::io_err("epoll_ctl (connect)", Some(addr)))?;
        Ok(ConnId(conn))
    }

    /// Checks a finished non-blocking connect: `Ok(true)` connected, `Ok(false)` not yet.
    fn connect_result(s: &mio::net::TcpStream) -> io::Result<bool> {
        if let Some(e) = s.take_error()? {
            return Err(e);
        }
        match s.peer_addr() {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub(super) fn on_connected(&mut self, conn: u64) {
        let c = self.conns.get_mut(&conn).expect("caller checked");
        match Self::connect_result(&c.ctrl) {
            Ok(true) => {}
            Ok(false) => {
                c.ctrl_ready.wr = false;
                return;
            }
            Err(source) => {
                let e = Error::Io {
                    op: "connect",
                    peer: Some(c.peer_addr),
                    source,
                };
                return self.fail(conn, e);
            }
        }
        let now = Instant::now();
        let deadline = c.deadline.unwrap_or(now + self.cfg.handshake_timeout);
        let (h, hello) = Handshake::client(&self.params, &c.peer(), now, deadline);
        c.hs = Some(Box::new(h));
        c.state = State::Handshake;
        debug!(conn, "connected; hello sent");
        self.queue_frame(conn, hello);
    }

    pub(super) fn on_data_connected(&mut self, conn: u64) {
        let c = self.conns.get_mut(&conn).expect("caller checked");
        let d = c.data.as_ref().expect("connecting");
        match Self::connect_result(d) {
            Ok(true) => c.data_connecting = false,
            Ok(false) => c.data_ready.wr = false,
            Err(source) => {
                let e = Error::Io {
                    op: "connect (data socket)",
                    peer: Some(c.peer_addr),
                    source,
                };
                self.fail(conn, e);
            }
        }
    }

    /// A control frame while the handshake runs.
    pub(super) fn on_handshake_frame(&mut self, conn: u64, hdr: &Header, payload: &[u8]) -> Result<()> {
        let c = self.conns.get_mut(&conn).expect("live");
        let Some(h) = c.hs.as_mut() else {
            return Err(Error::BadFrame {
                peer: c.peer(),
                reason: crate::error::FrameError::Unexpected {
                    kind: hdr.kind.name(),
                    state: c.state.name(),
                },
            });
        };
        match h.on_frame(&self.params, hdr, payload) {
            Err(r) => {
                if let Some(f) = r.reject_frame() {
                    send_now(&mut c.ctrl, &f);
                }
                Err(r.error)
            }
            Ok(Outcome::Continue) => {
                // Server: the Auth verified; a data socket that came first may be waiting.
                if !self.parked.is_empty() {
                    for p in std::mem::take(&mut self.parked) {
                        if self.pending.contains_key(&p) {
                            self.dirty_pending.push(p);
                        }
                    }
                }
                Ok(())
            }
            Ok(Outcome::OpenData { send, attach }) => {
                c.peer_rank = h.peer_rank();
                let addr = c.peer_addr;
                self.queue_frame(conn, send);
                let mut d =
                    mio::net::TcpStream::connect(addr).map_err(Self::io_err("connect (data socket)", Some(addr)))?;
                sys::tune(d.as_raw_fd(), &self.sockopts)?;
                self.poll
                    .registry()
                    .register(&mut d, Sock::Data(conn).token(), RW)
                    .map_err(Self::io_err("epoll_ctl (data socket)", Some(addr)))?;
                let c = self.conns.get_mut(&conn).expect("live");
                c.data = Some(d);
                c.data_connecting = true;
                c.attach = Some((attach.to_bytes(), 0));
                Ok(())
            }
            Ok(Outcome::Established) => {
                c.state = State::Ready;
                c.deadline = None;
                c.hs = None;
                let info = PeerInfo {
                    rank: c.peer_rank,
                    addr: c.peer_addr,
                };
                info!(conn, rank = info.rank, "connection ready (portable)");
                self.reserve_for_ready(conn);
                self.on_established(conn, info);
                Ok(())
            }
        }
    }

    /// A connection just became ready: its queues get room for what its steady
    /// traffic can hold (`max_outstanding` writes queued and awaiting their
    /// Acks), and the event list for what every ready connection can deliver
    /// between two polls (its completions and the peer's window), so that how
    /// the two sides' polls interleave never grows a list on the hot path.
    pub(super) fn reserve_for_ready(&mut self, conn: u64) {
        let n = self.cfg.max_outstanding;
        if let Some(c) = self.conns.get_mut(&conn) {
            c.data_tx.reserve(n.saturating_sub(c.data_tx.len()));
            c.awaiting_ack.reserve(n.saturating_sub(c.awaiting_ack.len()));
        }
        let ready = self.conns.values().filter(|c| c.state == State::Ready).count();
        let want = ready * (2 * n + 8);
        self.events.reserve(want.saturating_sub(self.events.len()));
    }

    pub(super) fn queue_frame(&mut self, conn: u64, f: Frame) {
        let payload = if f.body.is_empty() {
            Payload::None
        } else {
            Payload::Owned(f.body)
        };
        self.queue_ctrl(conn, f.hdr, payload, None);
    }
}

/// Best-effort, non-blocking send of a small frame (a `Reject` before closing).
fn send_now(s: &mut mio::net::TcpStream, f: &Frame) {
    let _ = s.write(&f.to_bytes());
}
