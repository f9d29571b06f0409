//! Completions (receive side): draining the completion queue into events,
//! reposting receives, and sleeping on the completion channel and the control
//! plane's ring.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::sync::Weak;
use std::time::{Duration, Instant};

use sideway::ibverbs::completion::{CompletionChannel, CompletionQueue};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::QueuePair;
use tracing::warn;

use crate::api::{ConnId, Event};
use crate::error::{Error, FrameError, Result, Violation, WC_REM_ACCESS_ERR, WC_WR_FLUSH_ERR};

use super::error::verbs;
use super::state::{
    peer_name, split_wr_id, wr_id, Op, OpKind, Registered, State, KIND_CREDIT, KIND_META, KIND_RECV, KIND_SEND,
};
use super::wire::{self, Notice, NoticeTarget, NOTICE_LEN};
use super::RdmaTransport;

/// The longest sleep while a connection waits for receive credits (see `sleep`).
const CREDIT_NAP: Duration = Duration::from_micros(50);

/// A target whose queue pair failed waits this long for the writer's ABORT, which says why.
const ABORT_GRACE: Duration = Duration::from_millis(300);

/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 64;

impl RdmaTransport {
    /// Drains the completion queue into events: `ibv_poll_cq` straight into an
    /// array on the stack, so nothing is allocated per poll (sideway's
    /// `start_poll` allocates a `Vec` of work completions per call).
    pub(super) fn poll_cq(&mut self) -> Result<()> {
        let mut wcs = [MaybeUninit::<rdma_mummy_sys::ibv_wc>::uninit(); POLL_BATCH];
        loop {
            // SAFETY: the CQ is live (the transport owns it, and it outlives this call);
            // ibv_poll_cq writes at most POLL_BATCH entries, which the array has room for.
            let n = unsafe {
                rdma_mummy_sys::ibv_poll_cq(
                    self.cq.cq().as_ptr(),
                    POLL_BATCH as i32,
                    wcs.as_mut_ptr().cast::<rdma_mummy_sys::ibv_wc>(),
                )
            };
            if n < 0 {
                // A negative return is the provider's own code, not an errno: say it as is.
                return Err(verbs(
                    "ibv_poll_cq",
                    &self.dev.name,
                    std::io::Error::other(format!("ibv_poll_cq returned {n} (the completion queue is in error)")),
                ));
            }
            let n = n as usize;
            for wc in &wcs[..n] {
                // SAFETY: ibv_poll_cq filled the first `n` entries.
                let wc = unsafe { wc.assume_init_read() };
                let (opcode, len, imm) = if wc.status == 0 {
                    // SAFETY: both members of the union are u32s: any bits are valid.
                    let imm = unsafe { wc.imm_data_invalidated_rkey_union.imm_data };
                    (wc.opcode, wc.byte_len, imm)
                } else {
                    (0, 0, 0)
                };
                self.on_completion(wc.wr_id, wc.status, wc.vendor_err, opcode, len, imm);
            }
            if n < POLL_BATCH {
                return Ok(());
            }
        }
    }

    pub(super) fn on_completion(&mut self, id: u64, status: u32, vendor_err: u32, opcode: u32, len: u32, imm: u32) {
        let (conn, kind, seq) = split_wr_id(id);
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        if status != 0 {
            self.on_failed_completion(conn, kind, seq, status, vendor_err);
            return;
        }
        match kind {
            KIND_SEND | KIND_META => {
                while c.inflight.front().is_some_and(|o| o.seq <= seq) {
                    let o = c.inflight.pop_front().expect("front");
                    c.wrs_in_flight = c.wrs_in_flight.saturating_sub(o.wrs);
                    self.events.push_back(done_event(conn, &o));
                }
            }
            KIND_CREDIT => c.wrs_in_flight = c.wrs_in_flight.saturating_sub(1),
            KIND_RECV => self.on_recv(conn, seq, opcode, len, imm),
            _ => {}
        }
    }

    /// A work request of `conn` completed in error: what it was decides
    /// whether the connection waits for the peer's reason, or fails now (with
    /// everything before it done, in order).
    fn on_failed_completion(&mut self, conn: u64, kind: u64, seq: u64, status: u32, vendor_err: u32) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        // The peer's name is built only when an error is.
        let peer = c.peer;
        let op = match kind {
            KIND_RECV => "receive",
            KIND_META => "write notice",
            KIND_CREDIT => "credit return",
            _ => match c.inflight.iter().find(|o| o.seq == seq).map(|o| o.kind) {
                Some(OpKind::Send) => "send",
                Some(OpKind::Read) => "read",
                _ => "write",
            },
        };
        let err = || Error::WorkCompletion {
            op,
            conn,
            peer: peer_name(peer, conn),
            status,
            vendor_err,
        };
        if kind == KIND_RECV || status == WC_WR_FLUSH_ERR {
            // Our queue pair failed underneath the receives: the peer usually says why
            // (ABORT) over the control plane; wait for that briefly.
            if c.qp_failed.is_none() {
                c.qp_failed = Some((err(), Instant::now() + ABORT_GRACE));
            }
            return;
        }
        if kind == KIND_CREDIT {
            // No op of the caller's failed: those posted before it completed
            // (in order, and each batch ends signalled); the rest are cancelled.
            self.fail_conn(conn, err(), None);
            return;
        }
        // Everything before `seq` completed (RC completes in order); `seq` failed.
        while c.inflight.front().is_some_and(|o| o.seq < seq) {
            let o = c.inflight.pop_front().expect("front");
            c.wrs_in_flight = c.wrs_in_flight.saturating_sub(o.wrs);
            self.events.push_back(done_event(conn, &o));
        }
        if status == WC_REM_ACCESS_ERR {
            let why = err().to_string();
            self.ctrl_send(conn, wire::TAG_ABORT, wire::encode_abort(true, &why));
        }
        self.fail_conn(conn, err(), Some((seq, err())));
    }

    /// Receive `seq` of `conn` completed: a write's notice (the peer's RDMA
    /// WRITE with immediate, checked as TCP checks a write header) or a
    /// message; then its buffer is posted again and the peer owed a credit.
    fn on_recv(&mut self, conn: u64, seq: u64, opcode: u32, len: u32, imm: u32) {
        // IBV_WC_RECV = 128, IBV_WC_RECV_RDMA_WITH_IMM = 129.
        let ok = if opcode == 129 {
            self.on_write_notice(conn, len, imm)
        } else {
            self.on_message(conn, seq, len, imm)
        };
        if ok {
            self.repost_recv(conn, seq);
        }
    }

    /// The notice of a peer's write of `len` bytes with immediate `imm`,
    /// read from its slot of the notice ring and checked. False when the
    /// connection failed on it.
    fn on_write_notice(&mut self, conn: u64, len: u32, imm: u32) -> bool {
        let Some(c) = self.conns.get_mut(&conn) else {
            return false;
        };
        let peer = c.peer;
        let rx_depth = self.cfg.rx_depth as u64;
        let slot = (c.notices_seen % rx_depth) as usize;
        c.notices_seen += 1;
        let ring = &c.ring.as_ref().expect("ring").0;
        // The peer's NIC may be writing other slots: copy this one out
        // with relaxed loads rather than borrow the ring as a slice.
        let mut slot_bytes = [0u8; NOTICE_LEN];
        let notice = match ring.read_relaxed(slot * NOTICE_LEN, &mut slot_bytes) {
            Ok(()) => Notice::decode(&slot_bytes),
            Err(_) => Err(FrameError::Malformed {
                what: "notice slot outside the ring",
            }),
        };
        // The peer wrote the notice: check it as TCP checks a write header.
        let checked = match notice {
            Ok(n) => {
                let target = notice_target(&self.regions, &self.dmabuf_targets, n.rkey);
                wire::check_notice(&n, len as u64, target).map(|()| n)
            }
            Err(_) => Err(Violation::NoticeMissing { slot: slot as u64 }),
        };
        match checked {
            Ok(n) => {
                self.stats.rx_write_bytes += len as u64;
                let ev = Event::WriteReceived {
                    conn: ConnId(conn),
                    region: n.rkey,
                    offset: n.offset,
                    len: len as u64,
                    imm,
                };
                if c.ready_event_sent {
                    self.events.push_back(ev);
                } else {
                    c.early.push(ev);
                }
            }
            Err(violation) => {
                let e = Error::Protocol {
                    conn,
                    peer: peer_name(peer, conn),
                    violation,
                };
                warn!(conn, error = %e, "a bad write notice; failing the connection");
                self.fail_conn(conn, e, None);
                return false;
            }
        }
        true
    }

    /// A message of `len` bytes in receive buffer `seq`, copied out and
    /// delivered (held back until the connection has been announced). False
    /// when the buffer could not be read.
    fn on_message(&mut self, conn: u64, seq: u64, len: u32, imm: u32) -> bool {
        let msg = self.cfg.max_message_bytes;
        let idx = seq as usize;
        let Some(c) = self.conns.get_mut(&conn) else {
            return false;
        };
        let (rx, _) = c.rx_buf.as_ref().expect("receives need buffers");
        // Only this receive is complete; the NIC may be filling the others.
        let mut data = vec![0u8; len as usize];
        if let Err(e) = rx.read_relaxed(idx * msg, &mut data) {
            warn!(conn, error = %e, "a receive outside its buffer");
            return false;
        }
        self.stats.rx_message_copy_bytes += len as u64;
        let ev = Event::Message {
            conn: ConnId(conn),
            tag: imm,
            data,
        };
        // Held back until the connection has been announced.
        if c.ready_event_sent {
            self.events.push_back(ev);
        } else {
            c.early.push(ev);
        }
        true
    }

    /// Posts receive buffer `seq` of `conn` again at once, and owes the peer a credit.
    fn repost_recv(&mut self, conn: u64, seq: u64) {
        let msg = self.cfg.max_message_bytes;
        let idx = seq as usize;
        let Some(c) = self.conns.get_mut(&conn) else { return };
        let (rx, rx_mr) = c.rx_buf.as_ref().expect("receives need buffers");
        // Repost the same buffer at once, and owe the peer one credit. One work
        // request built here and posted with ibv_post_recv: sideway's
        // start_post_recv allocates two Vecs per post.
        let mut sge = rdma_mummy_sys::ibv_sge {
            addr: rx.as_ptr() as u64 + (idx * msg) as u64,
            length: msg as u32,
            lkey: rx_mr.lkey(),
        };
        let mut wr = rdma_mummy_sys::ibv_recv_wr {
            wr_id: wr_id(conn, KIND_RECV, seq),
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        let qp = c.qp.as_ref().expect("live connection");
        // The buffer is the one that just completed, inside the registered receive
        // area, which outlives the queue pair (field order in `Conn`, and `fail_conn`).
        // SAFETY: the queue pair is live; `wr` and `sge` are valid for the call, which copies them.
        let rc = unsafe { rdma_mummy_sys::ibv_post_recv(qp.qp().as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            let e = verbs("ibv_post_recv", &self.dev.name, std::io::Error::from_raw_os_error(rc));
            self.fail_conn(conn, e, None);
            return;
        }
        c.credit_return += 1;
    }
    /// Sleeps until the completion channel, the control plane or the waker has
    /// something, at most `d` (and at most 10 ms: deadlines, the inner control
    /// plane's timers and rdma_cm events are found by polling).
    pub(super) fn sleep(&mut self, d: Duration) -> Result<()> {
        let Some(ch) = self.channel.clone() else {
            std::hint::spin_loop();
            return Ok(());
        };
        if !self.armed {
            self.arm_cq()?;
            // A completion may have landed before arming.
            self.poll_cq()?;
            if !self.events.is_empty() {
                return Ok(());
            }
        }
        if self.wake.is_pending() {
            return Ok(());
        }
        let mut fds = [
            libc::pollfd {
                fd: ch.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.inner.ring_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // Credits return by RDMA WRITE, which raises no event: while a connection
        // waits for them, nap at most CREDIT_NAP and look at the word again.
        let nap = if self.credit_stalled {
            d.min(CREDIT_NAP)
        } else {
            d.clamp(Duration::from_millis(1), Duration::from_millis(10))
        };
        let ts = libc::timespec {
            tv_sec: nap.as_secs() as libc::time_t,
            tv_nsec: nap.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `fds` is a valid array of three pollfd and `ts` a valid timespec for
        // the duration of the call; a null signal mask leaves the mask unchanged.
        unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        if fds[2].revents & libc::POLLIN != 0 {
            // The flag (taken by `wait`) says whether to return; the doorbell is reset.
            self.wake.drain();
        }
        if fds[0].revents & libc::POLLIN != 0 {
            self.take_cq_event(&ch);
        }
        Ok(())
    }

    /// Asks the completion queue to signal its channel on the next completion.
    fn arm_cq(&mut self) -> Result<()> {
        // SAFETY: `cq` is a live completion queue; arming only sets a flag in the driver.
        let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        if rc != 0 {
            return Err(verbs(
                "ibv_req_notify_cq",
                &self.dev.name,
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        self.armed = true;
        Ok(())
    }

    /// Takes and acknowledges the event the readable channel `ch` holds, if
    /// any: the completion queue is then disarmed.
    fn take_cq_event(&mut self, ch: &CompletionChannel) {
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the channel is non-blocking and live; the out-pointers are valid locals.
        let rc = unsafe { rdma_mummy_sys::ibv_get_cq_event(ch.comp_channel().as_ptr(), &mut cq, &mut ctx) };
        if rc == 0 {
            // SAFETY: `cq` is the queue the event was for (ours); one event is acknowledged.
            unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
            self.armed = false;
        }
    }
}

/// The region a notice names, if it is registered here: a host region, or a
/// dmabuf region that is still alive (generation 0).
fn notice_target(
    regions: &HashMap<u32, Registered>,
    dmabufs: &HashMap<u32, (u64, Weak<MemoryRegion>)>,
    rkey: u32,
) -> Option<NoticeTarget> {
    if let Some(r) = regions.get(&rkey) {
        return Some(NoticeTarget {
            generation: r.region.generation(),
            len: r.region.len() as u64,
            remote_write: r.region.access().remote_write,
        });
    }
    dmabufs
        .get(&rkey)
        .filter(|(_, mr)| mr.strong_count() > 0)
        .map(|&(len, _)| NoticeTarget {
            generation: 0,
            len,
            remote_write: true,
        })
}

fn done_event(conn: u64, o: &Op) -> Event {
    match o.kind {
        OpKind::Send => Event::SendDone {
            conn: ConnId(conn),
            req: o.req,
            bytes: o.bytes,
        },
        OpKind::Write => Event::WriteDone {
            conn: ConnId(conn),
            req: o.req,
            bytes: o.bytes,
        },
        OpKind::Read => Event::ReadDone {
            conn: ConnId(conn),
            req: o.req,
            bytes: o.bytes,
        },
    }
}
