//! Completions (receive side): draining the completion queue into events,
//! reposting receives, and sleeping on the completion channel and the control
//! plane's ring.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::Weak;
use std::time::{Duration, Instant};

use sideway::ibverbs::completion::CompletionQueue;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::{QueuePair, SetScatterGatherEntry};
use tracing::warn;

use crate::api::{ConnId, Event};
use crate::error::{Error, FrameError, Result, Violation, WC_REM_ACCESS_ERR, WC_WR_FLUSH_ERR};

use super::error::{io_of, verbs};
use super::state::{split_wr_id, wr_id, Op, OpKind, Registered, State, KIND_META, KIND_RECV, KIND_SEND};
use super::wire::{self, Notice, NoticeTarget, NOTICE_LEN};
use super::RdmaTransport;

/// A target whose queue pair failed waits this long for the writer's ABORT, which says why.
const ABORT_GRACE: Duration = Duration::from_millis(300);

impl RdmaTransport {
    /// Drains the completion queue into events.
    pub(super) fn poll_cq(&mut self) -> Result<()> {
        loop {
            let mut done: Vec<(u64, u32, u32, u32, u32, u32)> = Vec::with_capacity(64);
            match self.cq.start_poll() {
                Ok(mut p) => {
                    for wc in p.by_ref() {
                        done.push((wc.wr_id(), wc.status(), wc.vendor_err(), 0, 0, 0));
                        let last = done.last_mut().expect("pushed");
                        if last.1 == 0 {
                            last.3 = wc.opcode();
                            last.4 = wc.byte_len();
                            last.5 = wc.imm_data();
                        }
                        if done.len() == 64 {
                            break;
                        }
                    }
                }
                Err(sideway::ibverbs::completion::PollCompletionQueueError::CompletionQueueEmpty) => return Ok(()),
                Err(e) => return Err(verbs("ibv_start_poll", &self.dev.name, io_of(e))),
            }
            let n = done.len();
            for (id, status, vendor, opcode, len, imm) in done {
                self.on_completion(id, status, vendor, opcode, len, imm);
            }
            if n < 64 {
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
        let peer = c.peer_name();
        if status != 0 {
            let op = match kind {
                KIND_RECV => "receive",
                KIND_META => "write notice",
                _ => match c.inflight.iter().find(|o| o.seq == seq).map(|o| o.kind) {
                    Some(OpKind::Send) => "send",
                    Some(OpKind::Read) => "read",
                    _ => "write",
                },
            };
            let err = || Error::WorkCompletion {
                op,
                conn,
                peer: peer.clone(),
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
            KIND_RECV => {
                let msg = self.cfg.max_message_bytes;
                let idx = seq as usize;
                let (rx, rx_mr) = c.rx_buf.as_ref().expect("receives need buffers");
                // IBV_WC_RECV = 128, IBV_WC_RECV_RDMA_WITH_IMM = 129.
                if opcode == 129 {
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
                                peer: peer.clone(),
                                violation,
                            };
                            warn!(conn, error = %e, "a bad write notice; failing the connection");
                            self.fail_conn(conn, e, None);
                            return;
                        }
                    }
                } else {
                    // Only this receive is complete; the NIC may be filling the others.
                    let mut data = vec![0u8; len as usize];
                    if let Err(e) = rx.read_relaxed(idx * msg, &mut data) {
                        warn!(conn, error = %e, "a receive outside its buffer");
                        return;
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
                }
                // Repost the same buffer at once, and owe the peer one credit.
                let (lkey, addr) = (rx_mr.lkey(), rx.as_ptr() as u64 + (idx * msg) as u64);
                let qp = c.qp.as_mut().expect("live connection");
                let mut g = qp.start_post_recv();
                let h = g.construct_wr(wr_id(conn, KIND_RECV, seq));
                // SAFETY: the buffer is the one that just completed, inside the registered
                // receive area that outlives the queue pair.
                unsafe { h.setup_sge(lkey, addr, msg as u32) };
                if let Err(e) = g.post() {
                    let e = verbs("ibv_post_recv", &self.dev.name, io_of(e));
                    self.fail_conn(conn, e, None);
                    return;
                }
                c.credit_return += 1;
            }
            _ => {}
        }
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
        let ms = d.as_millis().clamp(1, 10) as i32;
        // SAFETY: `fds` is a valid array of three pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if fds[2].revents & libc::POLLIN != 0 {
            // The flag (taken by `wait`) says whether to return; the doorbell is reset.
            self.wake.drain();
        }
        if fds[0].revents & libc::POLLIN != 0 {
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
        Ok(())
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
