//! The [`Transport`] implementation: the public, non-blocking API of the backend.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::{check_write, ConnId, Event, ListenerId, PeerInfo, Properties, ReqId, Transport, Waker};
use crate::error::{Error, Result};
use crate::memory::{Access, PinnedBuffer, Region, RemoteRegion, Slice};

use super::config::CqMode;
use super::state::{Conn, OpKind, State, Wr};
use super::wire::Notice;
use super::RdmaTransport;

impl Transport for RdmaTransport {
    fn properties(&self) -> &Properties {
        &self.props
    }

    fn listen(&mut self, addr: SocketAddr) -> Result<ListenerId> {
        let l = self.inner.listen(addr)?;
        if let Some(cm) = self.cm.as_mut() {
            let bound = self.inner.listener_addr(l)?;
            cm.listen(bound, &self.dev.name)?;
        }
        Ok(l)
    }

    fn listener_addr(&self, listener: ListenerId) -> Result<SocketAddr> {
        self.inner.listener_addr(listener)
    }

    fn connect(&mut self, addr: SocketAddr) -> Result<ConnId> {
        let id = self.inner.connect(addr)?;
        self.conns.insert(id.0, Conn::new(id.0, None));
        Ok(id)
    }

    fn accept(&mut self, listener: ListenerId) -> Result<Option<(ConnId, PeerInfo)>> {
        self.inner.listener_addr(listener)?;
        Ok(self.accepted.get_mut(&listener.0).and_then(|q| q.pop_front()))
    }

    fn register(&mut self, buf: PinnedBuffer, access: Access) -> Result<Region> {
        self.register_host(buf, access)
    }

    fn deregister(&mut self, region: &Region) -> Result<()> {
        self.deregister_host(region)
    }

    fn remote_regions(&self, conn: ConnId) -> Result<Vec<RemoteRegion>> {
        let c = self.conns.get(&conn.0).ok_or(Error::UnknownConnection {
            op: "remote_regions",
            conn: conn.0,
        })?;
        Ok(c.remote.clone())
    }

    fn send(&mut self, conn: ConnId, src: &Slice, tag: u32) -> Result<ReqId> {
        if src.len() > self.cfg.max_message_bytes {
            return Err(Error::TooLarge {
                op: "send",
                len: src.len() as u64,
                max: self.cfg.max_message_bytes as u64,
            });
        }
        let lkey = self.lkey_of(src, "send")?;
        let wr = Wr::Send {
            lkey,
            addr: src.ptr() as u64,
            len: src.len() as u32,
            tag,
        };
        self.enqueue(conn, "send", OpKind::Send, src, wr)
    }

    fn write(
        &mut self,
        conn: ConnId,
        src: &Slice,
        dst: &RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> Result<ReqId> {
        check_write(src, dst, dst_offset, self.props.max_write_bytes)?;
        let lkey = self.lkey_of(src, "write")?;
        self.verify_remote(conn, dst, "write")?;
        let wr = Wr::Write {
            lkey,
            addr: src.ptr() as u64,
            len: src.len() as u32,
            rkey: dst.rkey,
            raddr: dst.addr.wrapping_add(dst_offset),
            imm: imm.map(|i| {
                (
                    i,
                    Notice {
                        rkey: dst.rkey,
                        generation: dst.generation,
                        offset: dst_offset,
                        len: src.len() as u64,
                    },
                )
            }),
        };
        self.enqueue(conn, "write", OpKind::Write, src, wr)
    }

    fn poll(&mut self, events: &mut Vec<Event>, max: usize) -> Result<usize> {
        if self.events.len() < max {
            self.progress()?;
        }
        Ok(self.drain(events, max))
    }

    fn wait(&mut self, events: &mut Vec<Event>, max: usize, timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        let end = start + timeout;
        let spin_end = match self.cfg.cq_mode {
            CqMode::BusyPoll => end,
            CqMode::Event => start + self.cfg.control.busy_poll.min(timeout),
        };
        loop {
            self.progress()?;
            // Any return consumes a pending wake: the caller has control again.
            if !self.events.is_empty() || self.wake.take() {
                self.wake.take();
                return Ok(self.drain(events, max));
            }
            let now = Instant::now();
            if now >= end {
                return Ok(0);
            }
            if now < spin_end {
                std::hint::spin_loop();
                continue;
            }
            self.sleep(end - now)?;
        }
    }

    fn close(&mut self, conn: ConnId) -> Result<()> {
        let c = self.conns.get_mut(&conn.0).ok_or(Error::UnknownConnection {
            op: "close",
            conn: conn.0,
        })?;
        match c.state {
            State::Ready => {
                c.state = State::Closing;
                c.deadline = Some(Instant::now() + self.cfg.control.close_timeout);
            }
            State::Closing | State::Dead => {}
            _ => {
                c.state = State::Dead;
                c.qp = None;
                self.inner.close(conn)?;
            }
        }
        Ok(())
    }

    fn waker(&self) -> Result<Waker> {
        Ok(Waker(Arc::clone(&self.wake)))
    }

    fn counters(&self) -> crate::api::Counters {
        crate::api::Counters {
            rx_direct_bytes: self.stats.rx_write_bytes,
            rx_copied_bytes: self.stats.rx_message_copy_bytes,
            tx_payload_bytes: self.stats.tx_payload_bytes,
            tx_sends: self.stats.work_requests,
        }
    }
}
