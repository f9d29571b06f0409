//! Receive: the control socket's multishot RECV and frame reassembly, and the
//! data socket's header-then-payload receives that place one-sided writes
//! straight into registered regions (or discard rejected ones).

use std::os::fd::AsRawFd;
use std::time::Instant;

use io_uring::{cqueue, opcode, types};
use tracing::{debug, warn};

use crate::api::{ConnId, Event};
use crate::error::{Error, FrameError, Result};
use crate::frame::{self, Header, Kind, HEADER_LEN};
use crate::memory::{InFlight, Region};

use super::op::{Op, Payload};
use super::state::State;
use super::sys::errno;
use super::TcpTransport;

/// Scratch buffer for discarding a rejected write's payload.
const DISCARD_CHUNK: usize = 64 * 1024;

impl TcpTransport {
    // ---------------------------------------------------------------- arming

    pub(super) fn arm_ctrl_recv(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.ctrl_rx_armed || c.state == State::Dead {
            return;
        }
        let Some(fd) = c.ctrl.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        c.ctrl_rx_armed = true;
        let bgid = self.bufring.bgid;
        let ud = self.add_op(Op::CtrlRecv { conn });
        let e = opcode::RecvMulti::new(types::Fd(fd), bgid).build().user_data(ud);
        // SAFETY: buffers come from the provided-buffer ring owned by `self`.
        unsafe { self.push(e) };
    }

    pub(super) fn arm_data_header(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.data_rx_armed || c.state == State::Dead {
            return;
        }
        let Some(fd) = c.data.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        c.data_rx_armed = true;
        let mut buf = Box::new([0u8; HEADER_LEN]);
        let ptr = buf.as_mut_ptr();
        let ud = self.add_op(Op::DataRecvHeader { conn, buf });
        let e = opcode::Recv::new(types::Fd(fd), ptr, HEADER_LEN as u32)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(ud);
        // SAFETY: the header buffer is boxed inside the op (stable address).
        unsafe { self.push(e) };
    }
    // ---------------------------------------------------------------- control receive

    pub(super) fn on_ctrl_recv(&mut self, ud: u64, conn: u64, res: i32, flags: u32) {
        let more = cqueue::more(flags);
        let live = self.conns.get(&conn).is_some_and(|c| c.is_live());
        if more && live {
            self.keep_op(ud, Op::CtrlRecv { conn });
        } else if let Some(c) = self.conns.get_mut(&conn) {
            c.ctrl_rx_armed = false;
        }
        if res > 0 {
            let Some(bid) = cqueue::buffer_select(flags) else {
                warn!(conn, "multishot recv completion without a buffer");
                return;
            };
            let mut over = None;
            if live {
                let data = self.bufring.data(bid, res as usize);
                let c = self.conns.get_mut(&conn).expect("live");
                let held = c.ctrl_rx.len() + data.len();
                if c.state.is_handshake() && held > frame::PRE_AUTH_MAX_BYTES {
                    // Not authenticated yet: never hold more than the bound.
                    over = Some(held);
                } else {
                    c.ctrl_rx.extend_from_slice(data);
                    self.stats.rx_user_copy_bytes += res as u64;
                }
            }
            self.bufring.push(bid);
            if let Some(held) = over {
                self.stats.pre_auth_refused += 1;
                let peer = self.conns[&conn].peer();
                let reason = FrameError::PreAuthLimit {
                    held,
                    max: frame::PRE_AUTH_MAX_BYTES,
                };
                return self.fail(conn, Error::BadFrame { peer, reason });
            }
            if live {
                self.parse_ctrl(conn);
            }
        } else if !live {
        } else if res == 0 {
            let c = self.conns.get(&conn).expect("live");
            if c.peer_closed || c.state == State::Closing && c.sent_close {
                self.finish_close(conn);
            } else {
                let e = match c.state {
                    State::AwaitAuth => Error::AuthFailed {
                        peer: c.peer(),
                        reason: "peer hung up before proving the job secret (does it have the same secret?)",
                    },
                    _ => self.lost(conn, "control receive (peer closed)", None),
                };
                self.fail(conn, e);
            }
            return;
        } else if res != -libc::ENOBUFS {
            let e = self.lost(conn, "control receive", Some(errno(res)));
            self.fail(conn, e);
            return;
        }
        if !more {
            self.arm_ctrl_recv(conn);
        }
    }

    pub(super) fn parse_ctrl(&mut self, conn: u64) {
        let max = (self.cfg.max_message_bytes as u32).max(frame::MAX_CONTROL_BYTES);
        let mut buf = std::mem::take(&mut self.conns.get_mut(&conn).expect("live").ctrl_rx);
        let mut used = 0;
        let mut failure = None;
        let max_message = self.cfg.max_message_bytes as u32;
        while let Some(state) = self.conns.get(&conn).filter(|c| c.is_live()).map(|c| c.state) {
            // Judge the frame on its header, before any of its payload is buffered.
            let early = frame::peek_header(&buf[used..])
                .and_then(|h| h.map_or(Ok(()), |h| super::handshake::admissible(state, &h, max_message)));
            if let Err(reason) = early {
                if state.is_handshake() {
                    self.stats.pre_auth_refused += 1;
                }
                let peer = self.conns[&conn].peer();
                failure = Some(Error::BadFrame { peer, reason });
                break;
            }
            match frame::next_frame(&buf[used..], max) {
                Ok(Some((hdr, total))) => {
                    let payload = &buf[used + HEADER_LEN..used + total];
                    if let Err(e) = self.on_ctrl_frame(conn, hdr, payload) {
                        failure = Some(e);
                        break;
                    }
                    used += total;
                }
                Ok(None) => break,
                Err(reason) => {
                    let peer = self.conns[&conn].peer();
                    failure = Some(Error::BadFrame { peer, reason });
                    break;
                }
            }
        }
        buf.drain(..used);
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ctrl_rx = buf;
        }
        if let Some(e) = failure {
            self.fail(conn, e);
        }
    }

    /// One reassembled control frame: handshake frames go to the handshake,
    /// the rest are an established connection's.
    pub(super) fn on_ctrl_frame(&mut self, conn: u64, hdr: Header, payload: &[u8]) -> Result<()> {
        if self.conns[&conn].state.is_handshake() {
            return self.on_handshake_frame(conn, hdr, payload);
        }
        let c = self.conns.get_mut(&conn).expect("live");
        let peer = c.peer();
        let unexpected = |state: State| Error::BadFrame {
            peer: peer.clone(),
            reason: FrameError::Unexpected {
                kind: hdr.kind.name(),
                state: state.name(),
            },
        };
        let bad = |reason| Error::BadFrame {
            peer: peer.clone(),
            reason,
        };
        match (c.state, hdr.kind) {
            (State::Ready | State::Closing, Kind::Message) => {
                self.stats.rx_user_copy_bytes += payload.len() as u64;
                self.events.push_back(Event::Message {
                    conn: ConnId(conn),
                    tag: hdr.imm,
                    data: payload.to_vec(),
                });
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Ack) => {
                while c.awaiting_ack.front().is_some_and(|a| a.seq <= hdr.seq) {
                    let a = c.awaiting_ack.pop_front().expect("front");
                    c.outstanding -= 1;
                    self.events.push_back(Event::WriteDone {
                        conn: ConnId(conn),
                        req: a.req,
                        bytes: a.bytes,
                    });
                }
                self.dirty.push(conn);
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Nack) => {
                if let Some(i) = c.awaiting_ack.iter().position(|a| a.seq == hdr.seq) {
                    let a = c.awaiting_ack.remove(i).expect("index valid");
                    c.outstanding -= 1;
                    self.events.push_back(Event::OpFailed {
                        conn: ConnId(conn),
                        req: a.req,
                        error: Error::RemoteAccess {
                            conn,
                            seq: hdr.seq,
                            reason: frame::decode_reason(payload),
                        },
                    });
                }
                self.dirty.push(conn);
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Regions) => {
                let list = frame::decode_regions(payload).map_err(bad)?;
                for r in list {
                    if hdr.flags & frame::FLAG_REVOKE != 0 {
                        c.remote.remove(&r.rkey);
                    } else {
                        c.remote.insert(r.rkey, r);
                    }
                }
                self.events
                    .push_back(Event::RemoteRegionsChanged { conn: ConnId(conn) });
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Close) => {
                c.peer_closed = true;
                if c.state == State::Ready {
                    c.state = State::Closing;
                    c.deadline = Some(Instant::now() + self.cfg.close_timeout);
                }
                self.dirty.push(conn);
                self.check_close_done(conn);
                Ok(())
            }
            (s, _) => Err(unexpected(s)),
        }
    }
    // ---------------------------------------------------------------- data receive

    pub(super) fn check_incoming(&self, hdr: &Header) -> Result<Region> {
        let op = "incoming write";
        let r = self
            .regions
            .get(&hdr.region)
            .filter(|r| r.generation() == hdr.generation)
            .ok_or(Error::UnknownRegion {
                op,
                region: hdr.region,
                generation: hdr.generation,
            })?;
        if !r.access().remote_write {
            return Err(Error::AccessDenied {
                op,
                region: hdr.region,
                needed: "remote write",
            });
        }
        match hdr.offset.checked_add(hdr.length as u64) {
            Some(end) if end <= r.len() as u64 => Ok(r.clone()),
            _ => Err(Error::OutOfBounds {
                op,
                region: hdr.region,
                offset: hdr.offset,
                len: hdr.length as u64,
                region_len: r.len() as u64,
            }),
        }
    }

    pub(super) fn on_data_header(&mut self, conn: u64, res: i32, buf: &[u8; HEADER_LEN]) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        c.data_rx_armed = false;
        if c.state == State::Dead {
            return;
        }
        if res == 0 && (c.peer_closed || c.state == State::Closing) {
            return;
        }
        if res != HEADER_LEN as i32 {
            let during = if res == 0 {
                "data receive (peer closed)"
            } else {
                "data receive"
            };
            let e = self.lost(conn, during, (res < 0).then(|| errno(res)));
            return self.fail(conn, e);
        }
        let peer = c.peer();
        let hdr = match Header::decode(buf) {
            Ok(h) if h.kind == Kind::Write => h,
            Ok(h) => {
                let reason = FrameError::Unexpected {
                    kind: h.kind.name(),
                    state: "DataSocket",
                };
                return self.fail(conn, Error::BadFrame { peer, reason });
            }
            Err(reason) => return self.fail(conn, Error::BadFrame { peer, reason }),
        };
        let fd = c.data.as_ref().expect("data socket").as_raw_fd();
        match self.check_incoming(&hdr) {
            Ok(region) if hdr.length == 0 => {
                drop(region);
                self.placed(conn, hdr);
            }
            Ok(region) => {
                // SAFETY: check_incoming proved offset + length <= region length.
                let dst = unsafe { region.as_ptr().add(hdr.offset as usize) };
                let guard = InFlight::new(&region);
                let ud = self.add_op(Op::DataRecvPayload {
                    conn,
                    hdr,
                    _guard: guard,
                });
                let e = opcode::Recv::new(types::Fd(fd), dst, hdr.length)
                    .flags(libc::MSG_WAITALL)
                    .build()
                    .user_data(ud);
                // SAFETY: the destination lies inside a registered region that the op's
                // guard keeps alive and marks in flight (so it cannot be deregistered).
                unsafe { self.push(e) };
            }
            Err(error) => {
                debug!(conn, error = %error, "rejecting an incoming write; discarding its payload");
                self.discard(conn, fd, hdr, hdr.length as u64, error.to_string(), None);
                self.events.push_back(Event::WriteRejected {
                    conn: ConnId(conn),
                    error,
                });
            }
        }
    }

    pub(super) fn discard(
        &mut self,
        conn: u64,
        fd: i32,
        hdr: Header,
        remaining: u64,
        reason: String,
        buf: Option<Box<[u8]>>,
    ) {
        if remaining == 0 {
            let c = self.conns.get_mut(&conn).expect("live");
            if let Some(seq) = c.ack_to_send.take() {
                let mut h = Header::new(Kind::Ack, 0);
                h.seq = seq;
                self.queue_ctrl(conn, h, Payload::None, None);
            }
            let body = reason.into_bytes();
            let mut h = Header::new(Kind::Nack, body.len() as u32);
            h.seq = hdr.seq;
            self.queue_ctrl(conn, h, Payload::Owned(body), None);
            self.arm_data_header(conn);
            return;
        }
        let mut buf = buf.unwrap_or_else(|| vec![0u8; DISCARD_CHUNK].into_boxed_slice());
        let n = remaining.min(DISCARD_CHUNK as u64) as u32;
        let p = buf.as_mut_ptr();
        let ud = self.add_op(Op::DataDiscard {
            conn,
            hdr,
            remaining,
            reason,
            buf,
        });
        let e = opcode::Recv::new(types::Fd(fd), p, n)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(ud);
        // SAFETY: the scratch buffer is owned by the op.
        unsafe { self.push(e) };
    }

    pub(super) fn on_discard(
        &mut self,
        conn: u64,
        res: i32,
        hdr: Header,
        remaining: u64,
        reason: String,
        buf: Box<[u8]>,
    ) {
        let Some(c) = self.conns.get(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        if res <= 0 {
            let e = self.lost(conn, "discarding a rejected write", (res < 0).then(|| errno(res)));
            return self.fail(conn, e);
        }
        self.stats.rx_write_discarded_bytes += res as u64;
        let fd = c.data.as_ref().expect("data socket").as_raw_fd();
        self.discard(conn, fd, hdr, remaining - res as u64, reason, Some(buf));
    }

    pub(super) fn on_data_payload(&mut self, conn: u64, res: i32, hdr: Header) {
        let Some(c) = self.conns.get(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        if res != hdr.length as i32 {
            let e = self.lost(conn, "receiving a write payload", (res < 0).then(|| errno(res)));
            return self.fail(conn, e);
        }
        self.stats.rx_write_direct_bytes += res as u64;
        self.placed(conn, hdr);
    }

    pub(super) fn placed(&mut self, conn: u64, hdr: Header) {
        if hdr.flags & frame::FLAG_IMM != 0 {
            self.events.push_back(Event::WriteReceived {
                conn: ConnId(conn),
                region: hdr.region,
                offset: hdr.offset,
                len: hdr.length as u64,
                imm: hdr.imm,
            });
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ack_to_send = Some(hdr.seq);
        }
        self.dirty.push(conn);
        self.arm_data_header(conn);
    }
}
