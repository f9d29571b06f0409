//! Receive: the control socket's multishot RECV and frame reassembly, and the
//! data socket's header-then-payload receives that place one-sided writes
//! straight into registered regions (or discard rejected ones).

use std::os::fd::AsRawFd;
use std::time::Instant;

use io_uring::{cqueue, opcode, types};
use tracing::{debug, warn};

use crate::api::{ConnId, Event};
use crate::conn_core::{self, Backend};
use crate::error::{Error, FrameError, Result};
use crate::frame::{self, Header, Kind, HEADER_LEN};
use crate::memory::{InFlight, Region};

use super::op::{Op, Stage};
use super::state::{peer_name, State};
use super::sys::errno;
use super::TcpTransport;

/// Scratch buffer for discarding a rejected write's payload.
const DISCARD_CHUNK: usize = 64 * 1024;

impl TcpTransport {
    // ---------------------------------------------------------------- arming

    pub(super) fn arm_ctrl_recv(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.ctrl_rx_op.is_some() || c.state == State::Dead {
            return;
        }
        let Some(fd) = c.ctrl.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        let bgid = self.bufring.bgid;
        let ud = self.add_op(Op::CtrlRecv { conn });
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ctrl_rx_op = Some(ud);
        }
        let e = opcode::RecvMulti::new(types::Fd(fd), bgid).build().user_data(ud);
        // SAFETY: buffers come from the provided-buffer ring owned by `self`.
        unsafe { self.push(e) };
    }

    /// Resumes the data socket's receive side: parses what the stage already
    /// holds, then reads ahead into it.
    pub(super) fn arm_data_rx(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.data_rx_armed || c.state == State::Dead || c.data.is_none() {
            return;
        }
        let stage = c.data_stage.take().unwrap_or_else(Stage::new);
        self.parse_stage(conn, stage);
    }

    /// One RECV, without MSG_WAITALL, into the stage's free space (after
    /// `parse_stage`, which leaves at most a partial header there).
    fn recv_stage(&mut self, conn: u64, mut stage: Stage) {
        let c = self.conns.get_mut(&conn).expect("live");
        let fd = c.data.as_ref().expect("data socket").as_raw_fd();
        c.data_rx_armed = true;
        let free = &mut stage.buf[stage.len..];
        let (ptr, n) = (free.as_mut_ptr(), free.len() as u32);
        debug_assert!(n as usize > HEADER_LEN);
        let ud = self.add_op(Op::DataRecvStage { conn, stage });
        let e = opcode::Recv::new(types::Fd(fd), ptr, n).build().user_data(ud);
        // SAFETY: `ptr..ptr+n` is the free tail of the stage's heap buffer, which the
        // op owns (moving the `Stage` into it does not move the heap bytes) and frees
        // only on this RECV's completion; nothing else reads or writes the buffer meanwhile.
        unsafe { self.push(e) };
    }
    // ---------------------------------------------------------------- control receive

    pub(super) fn on_ctrl_recv(&mut self, ud: u64, conn: u64, res: i32, flags: u32) {
        let more = cqueue::more(flags);
        let live = self.conns.get(&conn).is_some_and(|c| c.is_live());
        // While the kernel says more completions follow, the op keeps its slot
        // (and keeps its connection from being reaped), live or not: a slot
        // freed early is reused, and the multishot receive's next completion
        // (its EOF after `fail`'s shutdown) would be delivered to the new op.
        if more {
            self.keep_op(ud, Op::CtrlRecv { conn });
        } else if let Some(c) = self.conns.get_mut(&conn) {
            c.ctrl_rx_op = None;
        }
        if res > 0 {
            let Some(bid) = cqueue::buffer_select(flags) else {
                warn!(conn, "multishot recv completion without a buffer");
                return;
            };
            if live {
                let (ptr, len) = self.bufring.raw(bid, res as usize);
                // The kernel does not write buffer `bid` again until it is pushed back
                // below, after the last use of `data`; `ingest_ctrl` never touches the ring.
                // SAFETY: `ptr..ptr+len` is buffer `bid`, filled and handed to us by this completion.
                let data = unsafe { std::slice::from_raw_parts(ptr, len) };
                let held = self.conns[&conn].ctrl_rx.len() + data.len();
                let r = if self.conns[&conn].state.is_handshake() && held > frame::PRE_AUTH_MAX_BYTES {
                    // Not authenticated yet: never hold more than the bound.
                    self.stats.pre_auth_refused += 1;
                    Err(Error::BadFrame {
                        peer: self.conns[&conn].peer(),
                        reason: FrameError::PreAuthLimit {
                            held,
                            max: frame::PRE_AUTH_MAX_BYTES,
                        },
                    })
                } else {
                    self.ingest_ctrl(conn, data)
                };
                self.bufring.push(bid);
                if let Err(e) = r {
                    return self.fail(conn, e);
                }
            } else {
                self.bufring.push(bid);
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

    /// The control bytes of one receive, frame by frame. Each frame is judged on
    /// its header (kind against the handshake state, length against the kind's
    /// bound) before any of its payload is held. A message's payload goes straight
    /// into the buffer the application receives: its one copy in user space.
    /// Other frames are handled in place when `data` holds them whole, else
    /// assembled in `ctrl_rx` (which holds at most one frame).
    fn ingest_ctrl(&mut self, conn: u64, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let Some(c) = self.conns.get_mut(&conn).filter(|c| c.is_live()) else {
                return Ok(());
            };
            if c.msg_rx.is_some() {
                data = self.feed_message(conn, data);
                continue;
            }
            let hdr = if c.ctrl_rx.is_empty() && data.len() >= HEADER_LEN {
                let hdr = self.judge_header(conn, &data[..HEADER_LEN])?;
                let total = HEADER_LEN + hdr.length as usize;
                if hdr.kind == Kind::Message {
                    data = &data[HEADER_LEN..];
                    self.start_message(conn, hdr);
                    continue;
                }
                if data.len() >= total {
                    self.on_ctrl_frame(conn, hdr, &data[HEADER_LEN..total])?;
                    data = &data[total..];
                    continue;
                }
                hdr
            } else if c.ctrl_rx.len() < HEADER_LEN {
                let n = (HEADER_LEN - c.ctrl_rx.len()).min(data.len());
                c.ctrl_rx.extend_from_slice(&data[..n]);
                data = &data[n..];
                if c.ctrl_rx.len() < HEADER_LEN {
                    // Garbage is refused as soon as its first 4 bytes are in.
                    if let Err(reason) = frame::peek_header(&c.ctrl_rx) {
                        return Err(Error::BadFrame { peer: c.peer(), reason });
                    }
                    return Ok(());
                }
                let raw: [u8; HEADER_LEN] = c.ctrl_rx[..HEADER_LEN].try_into().expect("header length");
                let hdr = self.judge_header(conn, &raw)?;
                if hdr.kind == Kind::Message {
                    self.conns.get_mut(&conn).expect("live").ctrl_rx.clear();
                    self.start_message(conn, hdr);
                    continue;
                }
                hdr
            } else {
                // A judged header is in `ctrl_rx`, with part of its payload.
                Header::decode(&c.ctrl_rx[..HEADER_LEN]).map_err(|reason| Error::BadFrame { peer: c.peer(), reason })?
            };
            data = self.assemble_frame(conn, hdr, data)?;
        }
        Ok(())
    }

    /// Feeds `data` to the message being received, delivering it once whole;
    /// returns the bytes after it.
    fn feed_message<'a>(&mut self, conn: u64, data: &'a [u8]) -> &'a [u8] {
        let c = self.conns.get_mut(&conn).expect("live");
        let (hdr, buf) = c.msg_rx.as_mut().expect("a message is being received");
        let n = (hdr.length as usize - buf.len()).min(data.len());
        buf.extend_from_slice(&data[..n]);
        self.stats.rx_user_copy_bytes += n as u64;
        if buf.len() == hdr.length as usize {
            let (hdr, buf) = c.msg_rx.take().expect("present");
            self.deliver_message(conn, hdr, buf);
        }
        &data[n..]
    }

    /// Assembles the rest of a frame (not a message) with judged header `hdr` in
    /// `ctrl_rx`, handling it once whole; returns the bytes after it.
    fn assemble_frame<'a>(&mut self, conn: u64, hdr: Header, mut data: &'a [u8]) -> Result<&'a [u8]> {
        let c = self.conns.get_mut(&conn).expect("live");
        if c.ctrl_rx.is_empty() {
            c.ctrl_rx.extend_from_slice(&data[..HEADER_LEN]);
            data = &data[HEADER_LEN..];
        }
        let total = HEADER_LEN + hdr.length as usize;
        let n = (total - c.ctrl_rx.len()).min(data.len());
        c.ctrl_rx.extend_from_slice(&data[..n]);
        self.stats.rx_user_copy_bytes += n as u64;
        data = &data[n..];
        if c.ctrl_rx.len() == total {
            let mut buf = std::mem::take(&mut c.ctrl_rx);
            let r = self.on_ctrl_frame(conn, hdr, &buf[HEADER_LEN..]);
            buf.clear();
            if let Some(c) = self.conns.get_mut(&conn) {
                c.ctrl_rx = buf;
            }
            r?;
        }
        Ok(data)
    }

    /// Decodes a control frame's header and judges it against the connection's
    /// state, before any of its payload is held.
    fn judge_header(&mut self, conn: u64, raw: &[u8]) -> Result<Header> {
        let c = &self.conns[&conn];
        let max_message = self.cfg.max_message_bytes as u32;
        let judged =
            Header::decode(raw).and_then(|h| super::handshake::admissible(c.state, &h, max_message).map(|()| h));
        judged.map_err(|reason| {
            if c.state.is_handshake() {
                self.stats.pre_auth_refused += 1;
            }
            Error::BadFrame { peer: c.peer(), reason }
        })
    }

    /// A message's header is in: its payload goes into a buffer of its own size.
    fn start_message(&mut self, conn: u64, hdr: Header) {
        if hdr.length == 0 {
            return self.deliver_message(conn, hdr, Vec::new());
        }
        let c = self.conns.get_mut(&conn).expect("live");
        c.msg_rx = Some((hdr, Vec::with_capacity(hdr.length as usize)));
    }

    fn deliver_message(&mut self, conn: u64, hdr: Header, data: Vec<u8>) {
        self.events.push_back(Event::Message {
            conn: ConnId(conn),
            tag: hdr.imm,
            data,
        });
    }

    /// One reassembled control frame: handshake frames go to the handshake,
    /// the rest are an established connection's.
    pub(super) fn on_ctrl_frame(&mut self, conn: u64, hdr: Header, payload: &[u8]) -> Result<()> {
        if self.conns[&conn].state.is_handshake() {
            return self.on_handshake_frame(conn, hdr, payload);
        }
        let c = self.conns.get_mut(&conn).expect("live");
        // The name is built only if an error needs it.
        let (addr, rank) = (c.peer_addr, c.peer_rank);
        let unexpected = |state: State| Error::BadFrame {
            peer: peer_name(addr, rank),
            reason: FrameError::Unexpected {
                kind: hdr.kind.name(),
                state: state.name(),
            },
        };
        let bad = |reason| Error::BadFrame {
            peer: peer_name(addr, rank),
            reason,
        };
        match (c.state, hdr.kind) {
            (State::Ready | State::Closing, Kind::Ack) => {
                c.acked_through = c.acked_through.max(hdr.seq);
                conn_core::on_ack(&mut c.awaiting_ack, &mut c.outstanding, conn, hdr.seq, &mut self.events);
                self.mark_dirty(conn);
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Nack) => {
                let (awaiting, outstanding) = (&mut c.awaiting_ack, &mut c.outstanding);
                let nacked = conn_core::on_nack(awaiting, outstanding, conn, hdr.seq, payload, &mut self.events);
                if !nacked && hdr.seq < c.next_write_seq && hdr.seq > c.acked_through {
                    // Its send has not completed yet: failed when it does.
                    c.early_nacks.insert(hdr.seq, frame::decode_reason(payload));
                }
                self.mark_dirty(conn);
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Regions) => {
                conn_core::on_regions(&mut c.remote, conn, &hdr, payload, &mut self.events).map_err(bad)
            }
            (State::Ready | State::Closing, Kind::Close) => {
                c.peer_closed = true;
                if c.state == State::Ready {
                    c.state = State::Closing;
                    c.deadline = Some(Instant::now() + self.cfg.close_timeout);
                }
                self.mark_dirty(conn);
                self.check_close_done(conn);
                Ok(())
            }
            (s, _) => Err(unexpected(s)),
        }
    }
    // ---------------------------------------------------------------- data receive

    pub(super) fn on_data_stage(&mut self, conn: u64, res: i32, mut stage: Stage) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        c.data_rx_armed = false;
        if c.state == State::Dead {
            return;
        }
        if res == 0 && stage.len == 0 && (c.peer_closed || c.state == State::Closing) {
            return;
        }
        if res <= 0 {
            let during = if res == 0 {
                "data receive (peer closed)"
            } else {
                "data receive"
            };
            let e = self.lost(conn, during, (res < 0).then(|| errno(res)));
            return self.fail(conn, e);
        }
        stage.len += res as usize;
        self.parse_stage(conn, stage);
    }

    /// Handles every write whose header the stage holds: a payload wholly in the
    /// stage is copied into its region (or dropped, for a rejected write); one that
    /// goes on past the stage's end continues with a direct receive into the region
    /// (or the discard path), after which `arm_data_rx` resumes here. Otherwise the
    /// partial header left over moves to the front and the stage reads ahead again.
    fn parse_stage(&mut self, conn: u64, stage: Stage) {
        let mut pos = 0;
        loop {
            let Some(c) = self.conns.get(&conn).filter(|c| c.is_live()) else {
                return;
            };
            if stage.len - pos < HEADER_LEN {
                return self.read_ahead(conn, stage, pos);
            }
            let fd = c.data.as_ref().expect("data socket").as_raw_fd();
            let raw: &[u8; HEADER_LEN] = stage.buf[pos..pos + HEADER_LEN].try_into().expect("header length");
            let hdr = match conn_core::decode_data_header(raw, || c.peer()) {
                Ok(h) => h,
                Err(e) => return self.fail(conn, e),
            };
            pos += HEADER_LEN;
            let avail = (stage.len - pos).min(hdr.length as usize);
            let staged = &stage.buf[pos..pos + avail];
            pos += avail;
            let whole = avail == hdr.length as usize;
            // The staged part goes in through the lease-respecting copy: a range under
            // a local lease is refused (the write is rejected) rather than written by Rust.
            let checked = self.regions.check_incoming(&hdr).and_then(|r| {
                if avail > 0 {
                    r.write_at(hdr.offset as usize, staged)?;
                }
                Ok(r)
            });
            match checked {
                Ok(_) if whole => {
                    self.stats.rx_write_staged_bytes += avail as u64;
                    self.placed_no_arm(conn, hdr);
                }
                Ok(region) => {
                    self.stats.rx_write_staged_bytes += avail as u64;
                    // The payload runs past the stage's end, so the stage is drained.
                    debug_assert_eq!(pos, stage.len);
                    self.park_drained_stage(conn, stage);
                    return self.recv_payload_rest(conn, fd, hdr, avail, &region);
                }
                Err(error) => {
                    debug!(conn, error = %error, "rejecting an incoming write; discarding its payload");
                    self.stats.rx_write_discarded_bytes += avail as u64;
                    let rest = (hdr.length as usize - avail) as u64;
                    if whole {
                        self.nack(conn, hdr, error.to_string());
                        self.events.push_back(Event::WriteRejected {
                            conn: ConnId(conn),
                            error,
                        });
                    } else {
                        debug_assert_eq!(pos, stage.len);
                        self.park_drained_stage(conn, stage);
                        self.discard(conn, fd, hdr, rest, error.to_string(), None);
                        self.events.push_back(Event::WriteRejected {
                            conn: ConnId(conn),
                            error,
                        });
                        return;
                    }
                }
            }
        }
    }

    /// Fewer than a header's bytes are left in the stage from `pos`: they move to
    /// the front and the stage reads ahead again.
    fn read_ahead(&mut self, conn: u64, mut stage: Stage, pos: usize) {
        if stage.len > pos {
            self.stats.rx_headers_split += 1;
        }
        stage.buf.copy_within(pos..stage.len, 0);
        stage.len -= pos;
        self.recv_stage(conn, stage)
    }

    /// Keeps a drained stage on the connection while a payload that ran past its
    /// end is received directly (or discarded); `arm_data_rx` takes it back.
    fn park_drained_stage(&mut self, conn: u64, mut stage: Stage) {
        stage.len = 0;
        self.conns.get_mut(&conn).expect("live").data_stage = Some(stage);
    }

    /// Receives the rest of a write whose first `avail` bytes were in the stage
    /// straight into `region` (which `check_incoming` returned for `hdr`), with the
    /// region marked in flight until the receive completes.
    fn recv_payload_rest(&mut self, conn: u64, fd: i32, hdr: Header, avail: usize, region: &Region) {
        // The bounds check_incoming proved, checked again where the pointer is made.
        let end = hdr.offset.checked_add(hdr.length as u64);
        assert!(avail < hdr.length as usize && end.is_some_and(|e| e <= region.len() as u64));
        let len = hdr.length - avail as u32;
        // SAFETY: offset + length <= region length (asserted above), and avail < length,
        // so offset + avail lies inside the region.
        let dst = unsafe { region.as_ptr().add(hdr.offset as usize + avail) };
        let guard = InFlight::new(region);
        let ud = self.add_op(Op::DataRecvPayload {
            conn,
            hdr,
            len,
            _guard: guard,
        });
        let e = opcode::Recv::new(types::Fd(fd), dst, len)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(ud);
        // SAFETY: the destination [offset + avail, offset + length) lies inside a
        // registered region that the op's guard keeps alive and marks in flight
        // (so it cannot be deregistered).
        unsafe { self.push(e) };
    }

    /// Queues the Nack of a rejected write, after the Ack of every write placed before it.
    fn nack(&mut self, conn: u64, hdr: Header, reason: String) {
        let c = self.conns.get_mut(&conn).expect("live");
        c.acks_held = 0;
        let ack = c.ack_to_send.take();
        self.queue_nack(conn, ack, hdr.seq, reason);
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
            self.nack(conn, hdr, reason);
            self.arm_data_rx(conn);
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

    pub(super) fn on_data_payload(&mut self, conn: u64, res: i32, hdr: Header, len: u32) {
        let Some(c) = self.conns.get(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        if res < 0 || res as u32 != len {
            let e = self.lost(conn, "receiving a write payload", (res < 0).then(|| errno(res)));
            return self.fail(conn, e);
        }
        self.stats.rx_write_direct_bytes += res as u64;
        self.placed(conn, hdr);
    }

    pub(super) fn placed(&mut self, conn: u64, hdr: Header) {
        self.placed_no_arm(conn, hdr);
        self.arm_data_rx(conn);
    }

    /// A write is in place: its event (with an immediate) and its Ack to come.
    fn placed_no_arm(&mut self, conn: u64, hdr: Header) {
        self.events.extend(conn_core::write_received(conn, &hdr));
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ack_to_send = Some(hdr.seq);
            c.acks_held = c.acks_held.saturating_add(1);
        }
        self.mark_dirty(conn);
    }
}
