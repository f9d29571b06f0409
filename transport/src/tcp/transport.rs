//! The [`Transport`] implementation: the public, non-blocking API of the backend.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info};

use crate::api::{check_write, ConnId, Event, ListenerId, PeerInfo, Properties, ReqId, Transport, Waker};
use crate::auth;
use crate::error::{Error, Result};
use crate::frame::{self, Header, Kind};
use crate::memory::{Access, InFlight, PinnedBuffer, Region, RemoteRegion, Slice};

use super::op::{Payload, WriteReq};
use super::state::{Listener, Side, State};
use super::{sys, TcpTransport};

impl TcpTransport {
    pub(super) fn check_source(&self, src: &Slice, op: &'static str) -> Result<()> {
        let r = src.region();
        if !self.regions.get(&r.key()).is_some_and(|x| x.same(r)) {
            return Err(Error::UnknownRegion {
                op,
                region: r.key(),
                generation: r.generation(),
            });
        }
        Ok(())
    }
}

impl Transport for TcpTransport {
    fn properties(&self) -> &Properties {
        &self.props
    }

    fn listen(&mut self, addr: SocketAddr) -> Result<ListenerId> {
        let l = std::net::TcpListener::bind(addr).map_err(|source| Error::Io {
            op: "listen (bind)",
            peer: Some(addr),
            source,
        })?;
        let bound = l.local_addr().map_err(|source| Error::Io {
            op: "listen (local_addr)",
            peer: Some(addr),
            source,
        })?;
        let id = self.id();
        self.listeners.insert(
            id,
            Listener {
                fd: OwnedFd::from(l),
                addr: bound,
                accepted: VecDeque::new(),
                armed: false,
            },
        );
        self.arm_accept(id);
        info!(addr = %bound, "listening");
        Ok(ListenerId(id))
    }

    fn listener_addr(&self, listener: ListenerId) -> Result<SocketAddr> {
        self.listeners
            .get(&listener.0)
            .map(|l| l.addr)
            .ok_or(Error::UnknownListener {
                op: "listener_addr",
                listener: listener.0,
            })
    }

    fn connect(&mut self, addr: SocketAddr) -> Result<ConnId> {
        let fd = sys::socket_for(&addr)?;
        sys::tune(fd.as_raw_fd(), &self.sockopts)?;
        let conn = self.new_conn(Side::Client, addr, fd, None);
        self.start_connect(conn, false)?;
        Ok(ConnId(conn))
    }

    fn accept(&mut self, listener: ListenerId) -> Result<Option<(ConnId, PeerInfo)>> {
        let l = self.listeners.get_mut(&listener.0).ok_or(Error::UnknownListener {
            op: "accept",
            listener: listener.0,
        })?;
        Ok(l.accepted.pop_front())
    }

    fn register(&mut self, buf: PinnedBuffer, access: Access) -> Result<Region> {
        if buf.len() > u32::MAX as usize {
            return Err(Error::TooLarge {
                op: "register",
                len: buf.len() as u64,
                max: u32::MAX as u64,
            });
        }
        let mut key = auth::random_u32();
        while key == 0 || self.regions.contains_key(&key) {
            key = auth::random_u32();
        }
        let generation = (self.id() & 0xffff_ffff) as u32;
        let mut fixed = None;
        if self.fixed_ok && buf.len() <= 1 << 30 {
            if let Some(slot) = self.fixed_free.pop() {
                let iov = libc::iovec {
                    iov_base: buf.as_ptr() as *mut libc::c_void,
                    iov_len: buf.len(),
                };
                // SAFETY: the buffer outlives its fixed-table slot: the slot is cleared in
                // `deregister`, and the ring (which drops the table) is dropped before any
                // region memory that `self.regions` keeps alive.
                match unsafe { self.ring.submitter().register_buffers_update(slot as u32, &[iov], None) } {
                    Ok(_) => fixed = Some(slot),
                    Err(e) => {
                        debug!(error = %e, "fixed-buffer registration refused (memlock?); SEND_ZC uses plain buffers");
                        self.fixed_free.push(slot);
                    }
                }
            }
        }
        let r = Region::new(buf, key, generation, access, fixed);
        self.regions.insert(key, r.clone());
        debug!(key = format_args!("{key:#x}"), len = r.len(), ?access, fixed = ?fixed, "registered region");
        if access.remote_write {
            self.broadcast_regions(r.remote(), false);
        }
        Ok(r)
    }

    fn deregister(&mut self, region: &Region) -> Result<()> {
        let known = self.regions.get(&region.key()).is_some_and(|r| r.same(region));
        crate::memory::check_deregister(known, region)?;
        self.regions.remove(&region.key());
        region.0.registered.store(false, std::sync::atomic::Ordering::Release);
        if let Some(slot) = region.0.fixed_index {
            let iov = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            // SAFETY: clearing a slot references no memory.
            if unsafe { self.ring.submitter().register_buffers_update(slot as u32, &[iov], None) }.is_ok() {
                self.fixed_free.push(slot);
            }
        }
        if region.access().remote_write {
            self.broadcast_regions(region.remote(), true);
        }
        Ok(())
    }

    fn remote_regions(&self, conn: ConnId) -> Result<Vec<RemoteRegion>> {
        let c = self.conns.get(&conn.0).ok_or(Error::UnknownConnection {
            op: "remote_regions",
            conn: conn.0,
        })?;
        let mut v: Vec<_> = c.remote.values().copied().collect();
        v.sort_by_key(|r| r.rkey);
        Ok(v)
    }

    fn send(&mut self, conn: ConnId, src: &Slice, tag: u32) -> Result<ReqId> {
        self.check_source(src, "send")?;
        let max = self.cfg.max_message_bytes;
        if src.len() > max {
            return Err(Error::TooLarge {
                op: "send",
                len: src.len() as u64,
                max: max as u64,
            });
        }
        let limit = self.cfg.max_outstanding;
        let req = ReqId(self.next_req);
        let c = self.ready_conn(conn, "send")?;
        if c.outstanding >= limit {
            return Err(Error::WouldBlock {
                op: "send",
                conn: conn.0,
                limit,
            });
        }
        c.outstanding += 1;
        self.next_req += 1;
        let mut h = Header::new(Kind::Message, src.len() as u32);
        h.imm = tag;
        let guard = InFlight::new(src.region());
        self.queue_ctrl(
            conn.0,
            h,
            Payload::Region {
                slice: src.clone(),
                _guard: guard,
            },
            Some((req, false)),
        );
        Ok(req)
    }

    fn write(
        &mut self,
        conn: ConnId,
        src: &Slice,
        dst: &RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> Result<ReqId> {
        self.check_source(src, "write")?;
        check_write(src, dst, dst_offset, frame::MAX_WRITE_BYTES as usize)?;
        let limit = self.cfg.max_outstanding;
        let req = ReqId(self.next_req);
        {
            let c = self.ready_conn(conn, "write")?;
            if c.outstanding >= limit {
                return Err(Error::WouldBlock {
                    op: "write",
                    conn: conn.0,
                    limit,
                });
            }
            c.outstanding += 1;
        }
        self.next_req += 1;
        let c = self.conns.get_mut(&conn.0).expect("checked above");
        let seq = c.next_write_seq;
        c.next_write_seq += 1;
        let mut h = Header::new(Kind::Write, src.len() as u32);
        h.region = dst.rkey;
        h.generation = dst.generation;
        h.offset = dst_offset;
        h.seq = seq;
        if let Some(i) = imm {
            h.imm = i;
            h.flags |= frame::FLAG_IMM;
        }
        c.data_tx.push_back(WriteReq {
            req,
            hdr: h.encode(),
            src: src.clone(),
            guard: InFlight::new(src.region()),
            seq,
        });
        self.mark_dirty(conn.0);
        Ok(req)
    }

    fn poll(&mut self, events: &mut Vec<Event>, max: usize) -> Result<usize> {
        if self.events.len() < max {
            self.progress(None)?;
        }
        Ok(self.drain_events(events, max))
    }

    fn wait(&mut self, events: &mut Vec<Event>, max: usize, timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        let end = start + timeout;
        // Bounded busy-poll: completions appear in shared memory without a syscall.
        let spin_end = start + self.cfg.busy_poll.min(timeout);
        self.progress(None)?;
        while self.events.is_empty() && !self.wake.is_pending() && Instant::now() < spin_end {
            if self.ring.completion().is_empty() {
                std::hint::spin_loop();
                continue;
            }
            self.progress(None)?;
        }
        // Any return consumes a pending wake: the caller has control again.
        if !self.events.is_empty() || self.wake.take() {
            self.wake.take();
            return Ok(self.drain_events(events, max));
        }
        loop {
            let now = Instant::now();
            let mut slice = end.saturating_duration_since(now);
            if let Some(d) = self.nearest_deadline() {
                slice = slice.min(d.saturating_duration_since(now) + Duration::from_millis(1));
            }
            // Sleeps in io_uring_enter until a completion (the waker's eventfd poll
            // among them), the nearest deadline, or the end of the timeout.
            self.progress(Some(slice))?;
            if !self.events.is_empty() || self.wake.take() || Instant::now() >= end {
                self.wake.take();
                return Ok(self.drain_events(events, max));
            }
        }
    }

    fn close(&mut self, conn: ConnId) -> Result<()> {
        let close_timeout = self.cfg.close_timeout;
        let c = self.conn_mut(conn, "close")?;
        match c.state {
            State::Ready => {
                c.state = State::Closing;
                c.local_close = true;
                c.deadline = Some(Instant::now() + close_timeout);
                self.mark_dirty(conn.0);
            }
            State::Closing => {}
            _ => {
                // Abort a handshake in progress: nothing was exchanged yet.
                c.state = State::Dead;
                for fd in [&c.ctrl, &c.data].into_iter().flatten() {
                    sys::shutdown(fd, libc::SHUT_RDWR);
                }
                self.reap(conn.0);
            }
        }
        Ok(())
    }

    fn waker(&self) -> Result<Waker> {
        Ok(Waker(Arc::clone(&self.wake)))
    }

    fn counters(&self) -> crate::api::Counters {
        crate::api::Counters {
            rx_direct_bytes: self.stats.rx_write_direct_bytes,
            // Staged write bytes were copied from the read-ahead buffer into the region.
            rx_copied_bytes: self.stats.rx_user_copy_bytes + self.stats.rx_write_staged_bytes,
            tx_payload_bytes: self.stats.tx_payload_bytes,
        }
    }
}
