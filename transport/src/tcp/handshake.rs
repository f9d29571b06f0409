//! The handshake: accepting sockets and classifying them by their first
//! frame (Hello or DataAttach), the HMAC challenge-response on the control
//! socket, attaching the data socket, and refusing peers.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Instant;

use io_uring::{cqueue, opcode, types};
use tracing::{debug, info, warn};

use crate::api::{ConnId, Event, ListenerId, PeerInfo};
use crate::auth::{self, Role as MacRole};
use crate::conn_core::Backend;
use crate::error::{Error, FrameError, Result};
use crate::frame::{self, Header, Kind, HEADER_LEN, MAX_PENDING_HANDSHAKES, MAX_REJECT_BYTES, NONCE_LEN};

use super::op::{Op, Payload};
use super::state::{Pending, Side, State};
use super::sys::{self, errno, SockAddr};
use super::TcpTransport;

/// The largest first frame an unauthenticated socket may send.
const FIRST_FRAME_MAX: u32 = 256;
/// A `Challenge` payload: rank, nonce, token, MAC.
const CHALLENGE_LEN: u32 = 4 + NONCE_LEN as u32 + 8 + NONCE_LEN as u32;

/// Whether a control frame with this header may arrive in `state`, judged on
/// the header alone, before any of its payload is read: during the handshake
/// only the next handshake frame (at its exact size) or a short `Reject`;
/// afterwards only an established connection's kinds, messages up to
/// `max_message`.
pub(super) fn admissible(state: State, hdr: &Header, max_message: u32) -> std::result::Result<(), FrameError> {
    let handshake = state.is_handshake();
    let max = match (state, hdr.kind) {
        (_, Kind::Reject) if handshake => MAX_REJECT_BYTES,
        (State::AwaitChallenge, Kind::Challenge) => CHALLENGE_LEN,
        (State::AwaitAuth, Kind::Auth) => NONCE_LEN as u32,
        (State::AwaitReady, Kind::Ready) => 0,
        (State::Ready | State::Closing, Kind::Message) => max_message,
        (State::Ready | State::Closing, Kind::Ack | Kind::Nack | Kind::Regions | Kind::Close) => hdr.kind.max_payload(),
        (s, k) => {
            return Err(FrameError::Unexpected {
                kind: k.name(),
                state: s.name(),
            })
        }
    };
    if hdr.length > max {
        return Err(FrameError::TooLong { len: hdr.length, max });
    }
    Ok(())
}

impl TcpTransport {
    pub(super) fn send_reject_and_close(&mut self, fd: OwnedFd, reason: &str) {
        let body = reason.as_bytes()[..reason.len().min(256)].to_vec();
        let mut buf = Header::new(Kind::Reject, body.len() as u32).encode().to_vec();
        buf.extend_from_slice(&body);
        sys::shutdown(&fd, libc::SHUT_RD);
        let raw = fd.as_raw_fd();
        let (ptr, len) = (buf.as_ptr(), buf.len() as u32);
        let ud = self.add_op(Op::Parting { _fd: fd, _buf: buf });
        let e = opcode::Send::new(types::Fd(raw), ptr, len)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(ud);
        // SAFETY: the buffer and the fd are owned by the Parting op until its completion.
        unsafe { self.push(e) };
    }

    pub(super) fn arm_first_header(&mut self, pending: u64, fd: i32) {
        self.recv_first_header(pending, fd, Box::new([0u8; HEADER_LEN]), 0);
    }

    /// Receives bytes `got..` of the first frame's header into `buf`.
    fn recv_first_header(&mut self, pending: u64, fd: i32, mut buf: Box<[u8; HEADER_LEN]>, got: usize) {
        debug_assert!(got < HEADER_LEN);
        let ptr = buf[got..].as_mut_ptr();
        let ud = self.add_op(Op::FirstHeader { pending, buf, got });
        let e = opcode::Recv::new(types::Fd(fd), ptr, (HEADER_LEN - got) as u32)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(ud);
        // SAFETY: `ptr` points `got` bytes into the boxed buffer, which the op
        // owns until its completion (moving the Box does not move its heap
        // allocation), and the length is what is left of it.
        unsafe { self.push(e) };
    }

    /// Receives bytes `got..` of the first frame's payload into `buf`.
    fn recv_first_payload(&mut self, pending: u64, fd: i32, hdr: Header, mut buf: Vec<u8>, got: usize) {
        debug_assert!(got < buf.len());
        let (ptr, len) = (buf[got..].as_mut_ptr(), (buf.len() - got) as u32);
        let ud = self.add_op(Op::FirstPayload { pending, hdr, buf, got });
        let e = opcode::Recv::new(types::Fd(fd), ptr, len)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(ud);
        // SAFETY: `ptr` points `got` bytes into the Vec's heap buffer, which the
        // op owns until its completion and never resizes; the length is what
        // is left of it.
        unsafe { self.push(e) };
    }

    /// Bytes of the first frame's `want` received after a receive that
    /// ended at `res` (`got` already in), or the loss. Fewer than `want` is
    /// asked for again: MSG_WAITALL may still return short (a signal, a
    /// kernel without io_uring's retry).
    fn first_frame_read(res: i32, got: usize, want: usize, peer: String) -> std::result::Result<usize, Error> {
        match res {
            r if r > 0 && got + r as usize <= want => Ok(got + r as usize),
            0 if want == 0 => Ok(0),
            r => Err(Error::ConnectionLost {
                conn: 0,
                peer,
                during: "the first frame of the handshake",
                source: Some(if r < 0 {
                    errno(r)
                } else {
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("{got} of {want} bytes, then the end of the stream"),
                    )
                }),
            }),
        }
    }

    pub(super) fn arm_accept(&mut self, listener: u64) {
        let Some(l) = self.listeners.get_mut(&listener) else {
            return;
        };
        if l.armed {
            return;
        }
        l.armed = true;
        let fd = l.fd.as_raw_fd();
        let ud = self.add_op(Op::Accept { listener });
        let e = opcode::AcceptMulti::new(types::Fd(fd))
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(ud);
        // SAFETY: multishot accept references no user memory.
        unsafe { self.push(e) };
    }

    pub(super) fn start_connect(&mut self, conn: u64, data: bool) -> Result<()> {
        let (addr, fd) = {
            let c = self.conns.get(&conn).expect("caller checked");
            let fd = if data { c.data.as_ref() } else { c.ctrl.as_ref() };
            (c.peer_addr, fd.expect("socket set").as_raw_fd())
        };
        let sa = SockAddr::from_std(&addr);
        let (p, l) = (&sa.storage as *const libc::sockaddr_storage, sa.len);
        let ud = self.add_op(Op::Connect { conn, data, _addr: sa });
        let e = opcode::Connect::new(types::Fd(fd), p.cast(), l).build().user_data(ud);
        // SAFETY: the sockaddr is boxed inside the op.
        unsafe { self.push(e) };
        Ok(())
    }
    // ---------------------------------------------------------------- accept side

    pub(super) fn on_accept(&mut self, ud: u64, listener: u64, res: i32, flags: u32) {
        let live = self.listeners.contains_key(&listener);
        // As for the control receive: a multishot op stays in its slot until
        // its last completion, or that completion would reach whatever op
        // reused the slot.
        if cqueue::more(flags) {
            self.keep_op(ud, Op::Accept { listener });
        } else if let Some(l) = self.listeners.get_mut(&listener) {
            l.armed = false;
        }
        if res < 0 {
            if live && res != -libc::ECANCELED && res != -libc::EINVAL {
                warn!(listener, error = %errno(res), "accept failed");
            }
            if live && !cqueue::more(flags) && res != -libc::EINVAL {
                self.arm_accept(listener);
            }
            return;
        }
        // SAFETY: a successful accept returns a new fd that nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(res) };
        if !live {
            return;
        }
        let addr = sys::peer_addr(fd.as_raw_fd()).unwrap_or_else(|| ([0, 0, 0, 0], 0).into());
        if let Err(e) = sys::tune(fd.as_raw_fd(), &self.sockopts) {
            warn!(%addr, error = %e, "socket options on an accepted socket");
        }
        while self.pre_auth_count() >= MAX_PENDING_HANDSHAKES {
            if !self.evict_oldest_handshake() {
                break;
            }
        }
        let id = self.id();
        let raw = fd.as_raw_fd();
        self.pending.insert(
            id,
            Pending {
                fd: Some(fd),
                addr,
                listener,
                deadline: Instant::now() + self.cfg.handshake_timeout,
                ops: 0,
                done: false,
            },
        );
        debug!(%addr, pending = id, "accepted a socket");
        self.arm_first_header(id, raw);
        if !cqueue::more(flags) {
            self.arm_accept(listener);
        }
    }

    /// Connections accepted here that have not authenticated yet: sockets not
    /// yet classified by their first frame, and control sockets waiting for the
    /// client's proof.
    pub(super) fn pre_auth_count(&self) -> usize {
        let pending = self.pending.values().filter(|p| !p.done).count();
        let conns = self
            .conns
            .values()
            .filter(|c| c.side == Side::Server && c.state == State::AwaitAuth)
            .count();
        pending + conns
    }

    /// Closes the unauthenticated connection accepted first (the earliest
    /// handshake deadline), to make room for a new one. Returns whether there was one.
    fn evict_oldest_handshake(&mut self) -> bool {
        let pending = self
            .pending
            .iter()
            .filter(|(_, p)| !p.done)
            .map(|(&id, p)| (p.deadline, id, true));
        let conns = self
            .conns
            .values()
            .filter(|c| c.side == Side::Server && c.state == State::AwaitAuth)
            .filter_map(|c| c.deadline.map(|d| (d, c.id, false)));
        let Some((_, id, is_pending)) = pending.chain(conns).min() else {
            return false;
        };
        self.stats.handshakes_evicted += 1;
        let limit = MAX_PENDING_HANDSHAKES;
        if is_pending {
            let peer = self.pending[&id].addr.to_string();
            debug!(%peer, limit, "too many pending handshakes; closing the oldest");
            self.reject_pending(id, Error::TooManyHandshakes { peer, limit }, None);
        } else {
            let peer = self.conns[&id].peer();
            debug!(%peer, limit, "too many pending handshakes; closing the oldest");
            self.fail(id, Error::TooManyHandshakes { peer, limit });
        }
        true
    }

    pub(super) fn reject_pending(&mut self, pending: u64, error: Error, reply: Option<String>) {
        let Some(p) = self.pending.get_mut(&pending) else {
            return;
        };
        if p.done {
            return;
        }
        p.done = true;
        let (listener, addr) = (p.listener, p.addr);
        let fd = p.fd.take();
        debug!(%addr, error = %error, "refusing a peer");
        if let Some(fd) = fd {
            sys::shutdown(&fd, libc::SHUT_RD);
            match reply {
                Some(r) => self.send_reject_and_close(fd, &r),
                None => {
                    sys::shutdown(&fd, libc::SHUT_RDWR);
                    // Keep the fd until the pending op on it has completed.
                    if let Some(p) = self.pending.get_mut(&pending) {
                        p.fd = Some(fd);
                    }
                }
            }
        }
        self.events.push_back(Event::PeerRejected {
            listener: ListenerId(listener),
            addr,
            error,
        });
        self.reap_pending(pending);
    }

    pub(super) fn reap_pending(&mut self, pending: u64) {
        if self.pending.get(&pending).is_some_and(|p| p.done && p.ops == 0) {
            self.pending.remove(&pending);
        }
    }

    pub(super) fn on_first_header(&mut self, pending: u64, res: i32, buf: Box<[u8; HEADER_LEN]>, got: usize) {
        let Some(p) = self.pending.get(&pending) else { return };
        if p.done {
            return;
        }
        let peer = p.addr.to_string();
        match Self::first_frame_read(res, got, HEADER_LEN, peer.clone()) {
            Ok(HEADER_LEN) => {}
            Ok(got) => {
                let fd = p.fd.as_ref().expect("not done").as_raw_fd();
                return self.recv_first_header(pending, fd, buf, got);
            }
            Err(e) => return self.reject_pending(pending, e, None),
        }
        let hdr = match Header::decode_any_version(&buf[..]) {
            Ok(h) => h,
            Err(reason) => return self.reject_pending(pending, Error::BadFrame { peer, reason }, None),
        };
        if hdr.version != frame::VERSION {
            let e = Error::VersionMismatch {
                peer,
                ours: frame::VERSION,
                theirs: hdr.version,
            };
            let msg = format!(
                "protocol version mismatch: this peer speaks {}, you sent {}",
                frame::VERSION,
                hdr.version
            );
            return self.reject_pending(pending, e, Some(msg));
        }
        if !matches!(hdr.kind, Kind::Hello | Kind::DataAttach) || hdr.length > FIRST_FRAME_MAX {
            self.stats.pre_auth_refused += 1;
            let reason = FrameError::Unexpected {
                kind: hdr.kind.name(),
                state: "FirstFrame",
            };
            return self.reject_pending(pending, Error::BadFrame { peer, reason }, Some("expected Hello".into()));
        }
        let fd = p.fd.as_ref().expect("not done").as_raw_fd();
        let body = vec![0u8; hdr.length as usize];
        if body.is_empty() {
            return self.on_first_payload(pending, 0, hdr, body, 0);
        }
        self.recv_first_payload(pending, fd, hdr, body, 0);
    }

    pub(super) fn on_first_payload(&mut self, pending: u64, res: i32, hdr: Header, body: Vec<u8>, got: usize) {
        let Some(p) = self.pending.get(&pending) else { return };
        if p.done {
            return;
        }
        let (peer, addr, listener, deadline) = (p.addr.to_string(), p.addr, p.listener, p.deadline);
        match Self::first_frame_read(res, got, body.len(), peer.clone()) {
            Ok(n) if n == body.len() => {}
            Ok(got) => {
                let fd = p.fd.as_ref().expect("not done").as_raw_fd();
                return self.recv_first_payload(pending, fd, hdr, body, got);
            }
            Err(e) => return self.reject_pending(pending, e, None),
        }
        match hdr.kind {
            Kind::Hello => {
                let hello = match frame::Hello::decode(&body) {
                    Ok(h) => h,
                    Err(reason) => return self.reject_pending(pending, Error::BadFrame { peer, reason }, None),
                };
                if hello.job_id != self.cfg.job_id {
                    let e = Error::JobMismatch {
                        peer,
                        ours: self.cfg.job_id,
                        theirs: hello.job_id,
                    };
                    return self.reject_pending(pending, e, Some("job id mismatch".into()));
                }
                let p = self.pending.get_mut(&pending).expect("checked");
                p.done = true;
                let fd = p.fd.take().expect("not done");
                self.reap_pending(pending);
                let conn = self.new_conn(Side::Server, addr, fd, Some(listener));
                self.send_challenge(conn, &hello, deadline);
            }
            Kind::DataAttach => {
                let att = match frame::DataAttach::decode(&body) {
                    Ok(a) => a,
                    Err(reason) => return self.reject_pending(pending, Error::BadFrame { peer, reason }, None),
                };
                self.on_data_attach(pending, peer, &att);
            }
            _ => unreachable!("checked in on_first_header"),
        }
    }

    /// Server connection `conn`, just made from `hello`: hands it a token and
    /// sends the `Challenge`. The handshake's deadline runs from the accept, not
    /// from the Hello.
    fn send_challenge(&mut self, conn: u64, hello: &frame::Hello, deadline: Instant) {
        let mut token = auth::random_u64();
        while token == 0 || self.tokens.contains_key(&token) {
            token = auth::random_u64();
        }
        self.tokens.insert(token, conn);
        let c = self.conns.get_mut(&conn).expect("just made");
        c.deadline = Some(deadline);
        c.peer_rank = hello.rank;
        c.transcript.client_rank = hello.rank;
        c.transcript.client_nonce = hello.nonce;
        c.transcript.server_rank = self.cfg.rank;
        c.transcript.server_nonce = auth::random_nonce();
        c.transcript.token = token;
        let ch = frame::Challenge {
            rank: self.cfg.rank,
            nonce: c.transcript.server_nonce,
            token,
            mac: auth::prove(&self.cfg.secret, MacRole::Server, &c.transcript),
        };
        debug!(parent: &c.span, rank = hello.rank, "hello received; challenge sent");
        let body = ch.encode();
        self.queue_ctrl(
            conn,
            Header::new(Kind::Challenge, body.len() as u32),
            Payload::Owned(body),
            None,
        );
        self.arm_ctrl_recv(conn);
    }

    /// A pending socket's `DataAttach` (`att`): attaches it to the connection its
    /// token names if its proof holds, parks it there if it overtook the Auth, or
    /// refuses it.
    fn on_data_attach(&mut self, pending: u64, peer: String, att: &frame::DataAttach) {
        let conn = self.tokens.get(&att.token).copied();
        let state = conn
            .and_then(|c| self.conns.get(&c))
            .and_then(|c| auth::verify(&self.cfg.secret, MacRole::Data, &c.transcript, &att.mac).then_some(c.state));
        match (conn, state) {
            (Some(conn), Some(State::AwaitData)) => self.attach_data(pending, conn),
            (Some(conn), Some(State::AwaitAuth)) if self.conns[&conn].parked_data.is_none() => {
                // The data socket overtook the Auth frame (its control receive
                // is queued behind others): park it until the Auth is in. It
                // stays pending, under its deadline and the pending bound.
                debug!(pending, conn, "data socket arrived before the Auth frame; parked");
                self.conns.get_mut(&conn).expect("checked").parked_data = Some(pending);
            }
            _ => {
                let e = Error::AuthFailed {
                    peer,
                    reason: "data socket presented an unknown token or a bad proof",
                };
                self.reject_pending(pending, e, Some("authentication failed".into()));
            }
        }
    }

    /// Binds an authenticated data socket (pending, its proof checked) to its
    /// connection, which has the client's proof too: the connection is ready.
    pub(super) fn attach_data(&mut self, pending: u64, conn: u64) {
        let Some(p) = self.pending.get_mut(&pending).filter(|p| !p.done) else {
            return;
        };
        let listener = p.listener;
        p.done = true;
        let fd = p.fd.take().expect("not done");
        self.reap_pending(pending);
        let list = self.regions.announce_list();
        let Some(c) = self.conns.get_mut(&conn).filter(|c| c.state == State::AwaitData) else {
            return;
        };
        c.data = Some(fd);
        c.state = State::Ready;
        c.deadline = None;
        let info = PeerInfo {
            rank: c.peer_rank,
            addr: c.peer_addr,
        };
        info!(parent: &c.span, rank = c.peer_rank, "peer authenticated; connection ready");
        self.reserve_for_ready(conn);
        self.queue_ctrl(conn, Header::new(Kind::Ready, 0), Payload::None, None);
        self.send_regions(conn, &list, false);
        self.arm_data_rx(conn);
        if let Some(l) = self.listeners.get_mut(&listener) {
            l.accepted.push_back((ConnId(conn), info));
        }
        self.events.push_back(Event::Incoming {
            listener: ListenerId(listener),
            conn: ConnId(conn),
        });
    }

    // ---------------------------------------------------------------- connect side

    pub(super) fn on_connect(&mut self, conn: u64, data: bool, res: i32) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        if res < 0 {
            let e = Error::Io {
                op: if data { "connect (data socket)" } else { "connect" },
                peer: Some(c.peer_addr),
                source: errno(res),
            };
            return self.fail(conn, e);
        }
        if !data {
            c.state = State::AwaitChallenge;
            c.transcript.client_rank = self.cfg.rank;
            c.transcript.client_nonce = auth::random_nonce();
            let hello = frame::Hello {
                job_id: self.cfg.job_id,
                rank: self.cfg.rank,
                nonce: c.transcript.client_nonce,
            };
            debug!(parent: &c.span, "connected; hello sent");
            let body = hello.encode();
            self.queue_ctrl(
                conn,
                Header::new(Kind::Hello, body.len() as u32),
                Payload::Owned(body),
                None,
            );
            self.arm_ctrl_recv(conn);
        } else {
            let att = frame::DataAttach {
                token: c.transcript.token,
                mac: auth::prove(&self.cfg.secret, MacRole::Data, &c.transcript),
            };
            let body = att.encode();
            let mut buf = Header::new(Kind::DataAttach, body.len() as u32).encode().to_vec();
            buf.extend_from_slice(&body);
            let fd = c.data.as_ref().expect("data socket").as_raw_fd();
            let (p, l) = (buf.as_ptr(), buf.len() as u32);
            let ud = self.add_op(Op::AttachSend { conn, _buf: buf });
            let e = opcode::Send::new(types::Fd(fd), p, l)
                .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL)
                .build()
                .user_data(ud);
            // SAFETY: the buffer is owned by the op.
            unsafe { self.push(e) };
            self.arm_data_rx(conn);
        }
    }

    /// A control frame while the handshake runs (client: Challenge, Ready; server: Auth; both: Reject).
    pub(super) fn on_handshake_frame(&mut self, conn: u64, hdr: Header, payload: &[u8]) -> Result<()> {
        let c = self.conns.get_mut(&conn).expect("live");
        let peer = c.peer();
        let unexpected = |state: State| Error::BadFrame {
            peer: peer.clone(),
            reason: FrameError::Unexpected {
                kind: hdr.kind.name(),
                state: state.name(),
            },
        };
        match (c.state, hdr.kind) {
            (State::AwaitChallenge | State::AwaitReady | State::AwaitAuth | State::AwaitData, Kind::Reject) => {
                Err(Error::Rejected {
                    peer: peer.clone(),
                    reason: frame::decode_reason(payload),
                })
            }
            (State::AwaitChallenge, Kind::Challenge) => self.on_challenge(conn, payload),
            (State::AwaitAuth, Kind::Auth) => self.on_auth(conn, payload),
            (State::AwaitReady, Kind::Ready) => {
                c.state = State::Ready;
                c.deadline = None;
                let info = PeerInfo {
                    rank: c.peer_rank,
                    addr: c.peer_addr,
                };
                info!(parent: &c.span, rank = c.peer_rank, "connection ready");
                self.reserve_for_ready(conn);
                self.on_established(conn, info);
                Ok(())
            }
            (s, _) => Err(unexpected(s)),
        }
    }

    /// Client, awaiting the challenge: checks the server's proof, answers with
    /// the `Auth`, and connects the data socket.
    fn on_challenge(&mut self, conn: u64, payload: &[u8]) -> Result<()> {
        let c = self.conns.get_mut(&conn).expect("live");
        let peer = c.peer();
        let ch = frame::Challenge::decode(payload).map_err(|reason| Error::BadFrame { peer, reason })?;
        c.transcript.server_rank = ch.rank;
        c.transcript.server_nonce = ch.nonce;
        c.transcript.token = ch.token;
        c.peer_rank = ch.rank;
        if !auth::verify(&self.cfg.secret, MacRole::Server, &c.transcript, &ch.mac) {
            return Err(Error::AuthFailed {
                peer: c.peer(),
                reason: "the server could not prove the job secret",
            });
        }
        let mac = auth::prove(&self.cfg.secret, MacRole::Client, &c.transcript);
        c.state = State::AwaitReady;
        let addr = c.peer_addr;
        self.queue_ctrl(
            conn,
            Header::new(Kind::Auth, NONCE_LEN as u32),
            Payload::Owned(mac.to_vec()),
            None,
        );
        let fd = sys::socket_for(&addr)?;
        sys::tune(fd.as_raw_fd(), &self.sockopts)?;
        self.conns.get_mut(&conn).expect("live").data = Some(fd);
        self.start_connect(conn, true)
    }

    /// Server, awaiting the client's proof: checks the `Auth` (a wrong one is
    /// refused), then attaches a data socket parked before it.
    fn on_auth(&mut self, conn: u64, payload: &[u8]) -> Result<()> {
        let c = self.conns.get_mut(&conn).expect("live");
        let peer = c.peer();
        let bad = |reason| Error::BadFrame {
            peer: peer.clone(),
            reason,
        };
        let mac = frame::decode_mac(payload, "Auth").map_err(bad)?;
        if !auth::verify(&self.cfg.secret, MacRole::Client, &c.transcript, &mac) {
            // Tell the peer why, then drop it; it learned no region descriptor.
            if let Some(fd) = c.ctrl.take() {
                self.send_reject_and_close(fd, "authentication failed");
            }
            return Err(Error::AuthFailed {
                peer,
                reason: "the client's proof of the job secret is wrong",
            });
        }
        c.state = State::AwaitData;
        if let Some(p) = c.parked_data.take() {
            self.attach_data(p, conn);
        }
        Ok(())
    }
}
