//! Transmit: the control queue (handshake frames, messages, region
//! announcements, acknowledgements, close), gathered into one SENDMSG; the data
//! socket's writes, gathered or by SEND_ZC; and their completions.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Instant;

use io_uring::{cqueue, opcode, squeue, types};

use crate::api::{ConnId, Event};
use crate::error::Error;
use crate::frame::HEADER_LEN;
use crate::memory::InFlight;

use super::op::{AwaitAck, Op, TxFrame, WriteReq};
use super::state::{Acks, State, ACK_EVERY};
use super::sys::errno;
use super::TcpTransport;

/// Frames (or writes) gathered into one SENDMSG, at most.
const GATHER_MAX: usize = super::op::GATHER_PARTS;
/// Payload bytes gathered into one SENDMSG, at most (a single larger one goes alone).
const GATHER_BYTES_MAX: usize = 8 << 20;

crate::conn_core::impl_backend!(TcpTransport);

impl TcpTransport {
    // ---------------------------------------------------------------- transmit

    /// Starts sends for every connection with queued frames and no send in flight,
    /// and sends or holds each pending Ack by `acks`.
    pub(super) fn flush(&mut self, acks: Acks) {
        // Two lists swapped, not a fresh one: flushing allocates nothing once both
        // have their steady capacity (a flush may mark connections dirty again).
        std::mem::swap(&mut self.dirty, &mut self.flushing);
        self.flushing.sort_unstable();
        self.flushing.dedup();
        for i in 0..self.flushing.len() {
            let conn = self.flushing[i];
            self.flush_conn(conn, acks);
        }
        self.flushing.clear();
    }

    pub(super) fn flush_conn(&mut self, conn: u64, acks: Acks) {
        // Pending acknowledgement goes ahead of anything queued later.
        if let Some(c) = self.conns.get_mut(&conn) {
            if let Some(seq) = c.ack_to_send {
                let now = match acks {
                    Acks::Send => true,
                    // A closing connection acknowledges everything before its Close.
                    Acks::Lazy => c.acks_held >= ACK_EVERY || !c.ctrl_tx.is_empty() || c.state == State::Closing,
                };
                if now {
                    c.ack_to_send = None;
                    c.acks_held = 0;
                    c.ctrl_tx.push_back(TxFrame::ack(seq));
                } else {
                    self.mark_dirty(conn);
                }
            }
        }
        self.maybe_send_close(conn);
        self.flush_ctrl(conn);
        self.flush_data(conn);
    }

    pub(super) fn maybe_send_close(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state != State::Closing || c.sent_close {
            return;
        }
        if !c.data_tx.is_empty()
            || c.data_tx_busy
            || !c.awaiting_ack.is_empty()
            || !c.ctrl_tx.is_empty()
            || c.ctrl_tx_busy
        {
            return;
        }
        c.sent_close = true;
        c.ctrl_tx.push_back(TxFrame::close());
    }

    pub(super) fn flush_ctrl(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.ctrl_tx_busy || c.ctrl_tx.is_empty() || c.state == State::Dead || c.state == State::Connecting {
            return;
        }
        let Some(fd) = c.ctrl.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        let mut frames = self.pool.frames();
        let mut bytes = 0;
        while let Some(f) = c.ctrl_tx.front() {
            if !frames.is_empty() && (frames.len() >= GATHER_MAX || bytes + f.payload.len() > GATHER_BYTES_MAX) {
                break;
            }
            bytes += HEADER_LEN + f.payload.len();
            frames.push(c.ctrl_tx.pop_front().expect("front exists"));
        }
        c.ctrl_tx_busy = true;
        let g = self.pool.gather(
            frames
                .iter()
                .flat_map(|f| [(f.hdr.as_ptr(), HEADER_LEN), (f.payload.ptr(), f.payload.len())]),
        );
        let msg = &*g.msg as *const libc::msghdr;
        self.stats.tx_sends += 1;
        let ud = self.add_op(Op::CtrlSend { conn, frames, g });
        let e = opcode::SendMsg::new(types::Fd(fd), msg)
            .flags((libc::MSG_WAITALL | libc::MSG_NOSIGNAL) as u32)
            .build()
            .user_data(ud);
        // SAFETY: the frames (headers in the Vec's heap buffer, which moving the Vec
        // does not relocate; payloads owned or guarded region slices), the iovecs and
        // the msghdr are owned by the op until its completion.
        unsafe { self.push(e) };
    }

    pub(super) fn flush_data(&mut self, conn: u64) {
        let zc_min = self.cfg.send_zc_min_bytes;
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.data_tx_busy || c.data_tx.is_empty() || !matches!(c.state, State::Ready | State::Closing) {
            return;
        }
        let Some(fd) = c.data.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        let first_len = c.data_tx.front().map(|w| w.src.len()).unwrap_or(0);
        if zc_min.is_some_and(|m| first_len >= m) {
            let w = c.data_tx.pop_front().expect("non-empty");
            c.data_tx_busy = true;
            return self.send_zc(conn, fd, w);
        }
        let mut writes = self.pool.writes();
        let mut bytes = 0;
        while let Some(w) = c.data_tx.front() {
            if !writes.is_empty()
                && (writes.len() >= GATHER_MAX
                    || bytes + w.src.len() > GATHER_BYTES_MAX
                    || zc_min.is_some_and(|m| w.src.len() >= m))
            {
                break;
            }
            bytes += w.src.len();
            writes.push(c.data_tx.pop_front().expect("front exists"));
        }
        c.data_tx_busy = true;
        let g = self.pool.gather(
            writes
                .iter()
                .flat_map(|w| [(w.hdr.as_ptr(), HEADER_LEN), (w.src.ptr() as *const u8, w.src.len())]),
        );
        let msg = &*g.msg as *const libc::msghdr;
        self.stats.tx_sends += 1;
        let ud = self.add_op(Op::DataSend { conn, writes, g });
        let e = opcode::SendMsg::new(types::Fd(fd), msg)
            .flags((libc::MSG_WAITALL | libc::MSG_NOSIGNAL) as u32)
            .build()
            .user_data(ud);
        // SAFETY: as in flush_ctrl; region payloads are guarded by each write's InFlight.
        unsafe { self.push(e) };
    }

    /// Sends write `w` alone on data socket `fd`: its header by SEND, linked to
    /// its payload by SEND_ZC (from the fixed buffer where the region has one).
    fn send_zc(&mut self, conn: u64, fd: i32, w: WriteReq) {
        let hdr = self.pool.hdr(w.hdr);
        let hp = hdr.as_ptr();
        let (pp, pl) = (w.src.ptr() as *const u8, w.src.len() as u32);
        let fixed = w.src.region().0.fixed_index;
        self.stats.tx_zc_writes += 1;
        self.stats.tx_sends += 2;
        let ud_h = self.add_op(Op::ZcHeader { conn, hdr });
        let ud_p = self.add_op(Op::ZcPayload {
            conn,
            write: Some(w),
            got_result: false,
        });
        let eh = opcode::Send::new(types::Fd(fd), hp, HEADER_LEN as u32)
            .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL | libc::MSG_MORE)
            .build()
            .flags(squeue::Flags::IO_LINK)
            .user_data(ud_h);
        let mut zc = opcode::SendZc::new(types::Fd(fd), pp, pl).flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL);
        if let Some(i) = fixed {
            zc = zc.buf_index(Some(i));
        }
        let ep = zc.build().user_data(ud_p);
        // SAFETY: the header is boxed in its op; the payload lies in a registered
        // region kept alive and counted in flight by the write's guard, which the
        // ZcPayload op holds until the kernel's notification says it let go.
        unsafe {
            self.push(eh);
            self.push(ep);
        }
    }
    // ---------------------------------------------------------------- send completions

    pub(super) fn on_ctrl_sent(&mut self, conn: u64, res: i32, mut frames: Vec<TxFrame>, total: usize) {
        let ok = res >= 0 && res as usize == total;
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ctrl_tx_busy = false;
        }
        let err_src = (res < 0).then(|| errno(res));
        for f in frames.drain(..) {
            let Some(req) = f.req else { continue };
            if let Some(c) = self.conns.get_mut(&conn) {
                c.outstanding = c.outstanding.saturating_sub(1);
            }
            if ok {
                self.stats.tx_payload_bytes += f.payload.len() as u64;
                self.events.push_back(Event::SendDone {
                    conn: ConnId(conn),
                    req,
                    bytes: f.payload.len(),
                });
            } else {
                let error = self.lost(conn, "send", err_src.as_ref().map(|e| io::Error::from(e.kind())));
                self.events.push_back(Event::OpFailed {
                    conn: ConnId(conn),
                    req,
                    error,
                });
            }
        }
        self.pool.put_frames(frames);
        if !ok {
            let e = self.lost(conn, "sending control frames", err_src);
            self.fail(conn, e);
            return;
        }
        self.mark_dirty(conn);
        self.check_close_done(conn);
    }

    pub(super) fn ack_wait(&mut self, conn: u64, w: WriteReq) {
        let c = self.conns.get_mut(&conn).expect("caller checked");
        self.stats.tx_payload_bytes += w.src.len() as u64;
        // The peer may have answered before the send completed here.
        if let Some(reason) = c.early_nacks.remove(&w.seq) {
            c.outstanding -= 1;
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req: w.req,
                error: Error::RemoteAccess {
                    conn,
                    seq: w.seq,
                    reason,
                },
            });
            return;
        }
        if w.seq <= c.acked_through {
            c.outstanding -= 1;
            self.events.push_back(Event::WriteDone {
                conn: ConnId(conn),
                req: w.req,
                bytes: w.src.len(),
            });
            return;
        }
        c.awaiting_ack.push_back(AwaitAck::new(w, Instant::now()));
    }

    pub(super) fn on_data_sent(&mut self, conn: u64, res: i32, mut writes: Vec<WriteReq>, total: usize) {
        let live = self.conns.get(&conn).is_some_and(|c| c.is_live());
        if let Some(c) = self.conns.get_mut(&conn) {
            c.data_tx_busy = false;
        }
        if live && res >= 0 && res as usize == total {
            for w in writes.drain(..) {
                self.ack_wait(conn, w);
            }
            self.pool.put_writes(writes);
            self.mark_dirty(conn);
            return;
        }
        let src = (res < 0).then(|| errno(res));
        for w in writes {
            let error = self.lost(conn, "write", src.as_ref().map(|e| io::Error::from(e.kind())));
            if let Some(c) = self.conns.get_mut(&conn) {
                c.outstanding = c.outstanding.saturating_sub(1);
            }
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req: w.req,
                error,
            });
        }
        let e = self.lost(conn, "sending writes", src);
        self.fail(conn, e);
    }

    pub(super) fn on_zc(
        &mut self,
        ud: u64,
        conn: u64,
        res: i32,
        flags: u32,
        write: Option<WriteReq>,
        got_result: bool,
    ) {
        if cqueue::notif(flags) || got_result {
            // The kernel no longer references the pages: dropping `write` releases its guard.
            return;
        }
        let live = self.conns.get(&conn).is_some_and(|c| c.is_live());
        if let Some(c) = self.conns.get_mut(&conn) {
            c.data_tx_busy = false;
        }
        let w = write.expect("first completion carries the write");
        let ok = live && res >= 0 && res as usize == w.src.len();
        if ok {
            let mirror = WriteReq {
                req: w.req,
                hdr: w.hdr,
                src: w.src.clone(),
                guard: InFlight::new(w.src.region()),
                seq: w.seq,
            };
            self.ack_wait(conn, mirror);
            self.mark_dirty(conn);
        } else {
            if let Some(c) = self.conns.get_mut(&conn) {
                c.outstanding = c.outstanding.saturating_sub(1);
            }
            let src = (res < 0).then(|| errno(res));
            let error = self.lost(conn, "write (SEND_ZC)", src.as_ref().map(|e| io::Error::from(e.kind())));
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req: w.req,
                error,
            });
            let e = self.lost(conn, "sending a write", src);
            self.fail(conn, e);
        }
        if cqueue::more(flags) {
            self.keep_op(
                ud,
                Op::ZcPayload {
                    conn,
                    write: Some(w),
                    got_result: true,
                },
            );
        }
    }
}
