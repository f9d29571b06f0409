//! Connection lifecycle: creation, failure, reaping, graceful-close
//! completion, and the deadlines (handshake, close, write acknowledgement).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::time::Instant;

use tracing::{debug, debug_span};

use crate::api::{ConnId, Event, ListenerId, ReqId};
use crate::auth::Transcript;
use crate::conn_core;
use crate::error::{Error, Result};
use crate::frame::NONCE_LEN;

use super::state::{Conn, Side, State};
use super::{sys, TcpTransport};

impl TcpTransport {
    pub(super) fn conn_mut(&mut self, conn: ConnId, op: &'static str) -> Result<&mut Conn> {
        self.conns
            .get_mut(&conn.0)
            .filter(|c| c.is_live())
            .ok_or(Error::UnknownConnection { op, conn: conn.0 })
    }

    pub(super) fn new_conn(&mut self, side: Side, addr: SocketAddr, ctrl: OwnedFd, listener: Option<u64>) -> u64 {
        let id = self.id();
        let span = debug_span!("conn", id, ?side, peer = %addr);
        let c = Conn {
            id,
            side,
            state: if side == Side::Client {
                State::Connecting
            } else {
                State::AwaitAuth
            },
            peer_addr: addr,
            peer_rank: u32::MAX,
            listener,
            ctrl: Some(ctrl),
            data: None,
            transcript: Transcript {
                job_id: self.cfg.job_id,
                client_rank: 0,
                server_rank: 0,
                client_nonce: [0; NONCE_LEN],
                server_nonce: [0; NONCE_LEN],
                token: 0,
            },
            parked_data: None,
            deadline: Some(Instant::now() + self.cfg.handshake_timeout),
            ctrl_rx: Vec::new(),
            reserved: false,
            msg_rx: None,
            ctrl_rx_op: None,
            ctrl_tx: VecDeque::new(),
            ctrl_tx_busy: false,
            data_tx: VecDeque::new(),
            data_tx_busy: false,
            data_rx_armed: false,
            data_stage: None,
            awaiting_ack: VecDeque::new(),
            acked_through: 0,
            early_nacks: HashMap::new(),
            next_write_seq: 1,
            ack_to_send: None,
            acks_held: 0,
            outstanding: 0,
            remote: HashMap::new(),
            ops: 0,
            local_close: false,
            sent_close: false,
            peer_closed: false,
            error: None,
            closed_reported: false,
            span,
        };
        self.conns.insert(id, c);
        id
    }
    /// Fails a connection: records the first error, cuts both sockets so every
    /// in-flight op completes, and fails all queued work.
    pub(super) fn fail(&mut self, conn: u64, err: Error) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        let _e = c.span.clone().entered();
        debug!(error = %err, state = c.state.name(), "connection failed");
        let handshaking = !matches!(c.state, State::Ready | State::Closing);
        c.state = State::Dead;
        if c.error.is_none() {
            c.error = Some(err);
        }
        for fd in [&c.ctrl, &c.data].into_iter().flatten() {
            sys::shutdown(fd, libc::SHUT_RDWR);
        }
        let rx_op = c.ctrl_rx_op;
        let failed = drain_requests(c);
        c.outstanding = c.outstanding.saturating_sub(failed.len());
        self.tokens.remove(&c.transcript.token);
        let parked = c.parked_data.take();
        let peer = c.peer();
        fail_requests(&mut self.events, conn, &peer, failed);
        // A server-side connection that never finished its handshake is reported
        // as a rejected peer: the application never saw it.
        if handshaking && c.side == Side::Server {
            let listener = c.listener.unwrap_or(0);
            let addr = c.peer_addr;
            let error = c.error.take().expect("set above");
            c.closed_reported = true;
            self.events.push_back(Event::PeerRejected {
                listener: ListenerId(listener),
                addr,
                error,
            });
        }
        if let Some(p) = parked {
            // A data socket waiting for this connection's Auth has nothing to join.
            let e = Error::ConnectionLost {
                conn,
                peer: peer.clone(),
                during: "the handshake (its control socket failed)",
                source: None,
            };
            self.reject_pending(p, e, None);
        }
        // The shutdown above ends the control receive, except where the socket
        // went elsewhere first (a refused Auth hands it to the reject, which
        // shuts only its read side): cancel the receive, or a peer that keeps
        // sending would keep it, and so this dead connection, alive.
        if let Some(ud) = rx_op {
            self.cancel_op(ud);
        }
        self.reap(conn);
    }

    /// Removes a dead connection once no op references it, reporting `Closed`.
    pub(super) fn reap(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state != State::Dead || c.ops > 0 {
            return;
        }
        let c = self.conns.remove(&conn).expect("present");
        if c.reserved {
            self.ops_budget -= Self::ops_per_conn(self.cfg.max_outstanding);
        }
        self.tokens.remove(&c.transcript.token);
        if !c.closed_reported {
            self.events.push_back(Event::Closed {
                conn: ConnId(conn),
                error: c.error,
            });
        }
    }

    pub(super) fn lost(&self, conn: u64, during: &'static str, source: Option<io::Error>) -> Error {
        conn_core::lost(conn, self.conns.get(&conn).map(|c| c.peer()), during, source)
    }
    pub(super) fn check_close_done(&mut self, conn: u64) {
        let Some(c) = self.conns.get(&conn) else { return };
        if c.state == State::Closing && c.peer_closed && c.sent_close && !c.ctrl_tx_busy && c.ctrl_tx.is_empty() {
            self.finish_close(conn);
        }
    }

    pub(super) fn finish_close(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        debug!(parent: &c.span, "closed gracefully");
        c.state = State::Dead;
        for fd in [&c.ctrl, &c.data].into_iter().flatten() {
            sys::shutdown(fd, libc::SHUT_RDWR);
        }
        let leftover: Vec<ReqId> = c.awaiting_ack.drain(..).map(|a| a.req).collect();
        for req in leftover {
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req,
                error: Error::Cancelled { conn },
            });
        }
        self.reap(conn);
    }
    pub(super) fn check_deadlines(&mut self) {
        let now = Instant::now();
        let mut expired = Vec::new();
        for c in self.conns.values().filter(|c| c.is_live()) {
            let oldest = c.awaiting_ack.front().map(|a| a.since);
            if let Some((op, after)) = conn_core::expired(&self.cfg, now, c.deadline, c.state == State::Closing, oldest)
            {
                expired.push((c.id, op, after, c.peer()));
            }
        }
        for (id, op, after, peer) in expired {
            self.fail(id, conn_core::timeout(op, peer, after));
        }
        let late = self.pending.iter().filter(|(_, p)| !p.done && p.deadline <= now);
        let late: Vec<u64> = late.map(|(&id, _)| id).collect();
        for id in late {
            let e = conn_core::first_frame_timeout(&self.cfg, self.pending[&id].addr);
            self.reject_pending(id, e, None);
        }
    }
    /// The earliest instant at which `check_deadlines` has something to do: a
    /// live connection's handshake or close deadline, its oldest unacknowledged
    /// write's `peer_timeout`, or a pending socket's first-frame deadline.
    /// `wait` sleeps no longer than this.
    pub(super) fn nearest_deadline(&self) -> Option<Instant> {
        let live = self.conns.values().filter(|c| c.is_live());
        let conns = live.map(|c| (c.deadline, c.awaiting_ack.front().map(|a| a.since)));
        let pending = self.pending.values().filter(|p| !p.done).map(|p| p.deadline);
        conn_core::nearest_deadline(&self.cfg, conns, pending)
    }

    pub(super) fn ready_conn(&mut self, conn: ConnId, op: &'static str) -> Result<&mut Conn> {
        let c = self.conn_mut(conn, op)?;
        match c.state {
            State::Ready => Ok(c),
            State::Closing => Err(Error::UnknownConnection { op, conn: conn.0 }),
            _ => Err(Error::NotConnected { op, conn: conn.0 }),
        }
    }
}

/// Drains the requests queued on a failing connection: control frames that
/// carry one, then writes, then writes awaiting their Ack.
fn drain_requests(c: &mut Conn) -> Vec<ReqId> {
    let mut failed = Vec::new();
    for f in c.ctrl_tx.drain(..) {
        if let Some(req) = f.req {
            failed.push(req);
        }
    }
    for w in c.data_tx.drain(..) {
        failed.push(w.req);
    }
    for a in c.awaiting_ack.drain(..) {
        failed.push(a.req);
    }
    failed
}

/// Reports each of `failed`, the requests queued on failed connection `conn`,
/// as an `OpFailed`.
fn fail_requests(events: &mut VecDeque<Event>, conn: u64, peer: &str, failed: Vec<ReqId>) {
    for req in failed {
        events.push_back(Event::OpFailed {
            conn: ConnId(conn),
            req,
            error: Error::ConnectionLost {
                conn,
                peer: peer.to_string(),
                during: "an operation queued when the connection failed",
                source: None,
            },
        });
    }
}
