//! The [`Transport`] implementation: the public, non-blocking API of the backend.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use tracing::{debug, info};

use crate::api::{ConnId, Event, ListenerId, Transport};
use crate::conn_core::{self, Backend};
use crate::error::{Error, Result};
use crate::memory::{Access, PinnedBuffer, Region};

use super::state::{Listener, Side, State};
use super::{sys, TcpTransport};

impl Transport for TcpTransport {
    // properties, listener_addr, accept, remote_regions, send, write, waker.
    crate::conn_core::transport_common!();

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

    fn connect(&mut self, addr: SocketAddr) -> Result<ConnId> {
        let fd = sys::socket_for(&addr)?;
        sys::tune(fd.as_raw_fd(), &self.sockopts)?;
        let conn = self.new_conn(Side::Client, addr, fd, None);
        self.start_connect(conn, false)?;
        Ok(ConnId(conn))
    }

    fn register(&mut self, buf: PinnedBuffer, access: Access) -> Result<Region> {
        conn_core::check_register(&buf)?;
        let key = self.regions.new_key();
        let generation = (self.id() & 0xffff_ffff) as u32;
        let mut fixed = None;
        // A fixed-buffer slot only serves SEND_ZC. Registering one pins the whole region,
        // which faults in and zeroes every page at once: for a training job's buffers,
        // gigabytes at start-up (45% of a one-iteration VGG19 run's CPU went to it).
        // Without SEND_ZC, take none; a region registered before SEND_ZC is switched on
        // sends from plain buffers.
        if self.fixed_ok && self.cfg.send_zc_min_bytes.is_some() && buf.len() <= 1 << 30 {
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
        self.regions.insert(r.clone());
        debug!(key = format_args!("{key:#x}"), len = r.len(), ?access, fixed = ?fixed, "registered region");
        self.broadcast_regions(&r, false);
        Ok(r)
    }

    fn deregister(&mut self, region: &Region) -> Result<()> {
        self.regions.deregister(region)?;
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
        self.broadcast_regions(region, true);
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<Event>, max: usize) -> Result<usize> {
        if self.events.len() < max {
            self.progress_with(None, super::state::Acks::Send)?;
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
        self.wait_rest(events, max, end)
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

    fn counters(&self) -> crate::api::Counters {
        crate::api::Counters {
            rx_direct_bytes: self.stats.rx_write_direct_bytes,
            // Staged write bytes were copied from the read-ahead buffer into the region.
            rx_copied_bytes: self.stats.rx_user_copy_bytes + self.stats.rx_write_staged_bytes,
            tx_payload_bytes: self.stats.tx_payload_bytes,
            tx_sends: self.stats.tx_sends,
        }
    }
}
