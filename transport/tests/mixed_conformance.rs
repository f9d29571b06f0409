//! The conformance suite across the two TCP backends: one side io_uring, the
//! other portable (epoll), both ways. The suite's server is rank 0 and its
//! clients are ranks >= 1, so a backend that picks the implementation by rank
//! makes every pair mixed. Skips (loudly) where io_uring is unavailable.

mod conformance;

use std::time::Duration;

use conformance::{Backend, Opts};
use tidewire_transport::{Access, JobSecret};
use tidewire_transport::{
    ConnId, Counters, Event, ListenerId, PeerInfo, PinnedBuffer, PortableTransport, Properties, Region, RemoteRegion,
    ReqId, Result, Slice, TcpConfig, TcpTransport, Transport, Waker,
};

/// Either backend behind one type, so a pair can hold one of each.
#[derive(Debug)]
pub enum Either {
    Uring(Box<TcpTransport>),
    Portable(Box<PortableTransport>),
}

macro_rules! both {
    ($s:expr, $t:ident => $e:expr) => {
        match $s {
            Either::Uring($t) => $e,
            Either::Portable($t) => $e,
        }
    };
}

impl Transport for Either {
    fn properties(&self) -> &Properties {
        both!(self, t => t.properties())
    }
    fn listen(&mut self, addr: std::net::SocketAddr) -> Result<ListenerId> {
        both!(self, t => t.listen(addr))
    }
    fn listener_addr(&self, l: ListenerId) -> Result<std::net::SocketAddr> {
        both!(self, t => t.listener_addr(l))
    }
    fn connect(&mut self, addr: std::net::SocketAddr) -> Result<ConnId> {
        both!(self, t => t.connect(addr))
    }
    fn accept(&mut self, l: ListenerId) -> Result<Option<(ConnId, PeerInfo)>> {
        both!(self, t => t.accept(l))
    }
    fn register(&mut self, buf: PinnedBuffer, access: Access) -> Result<Region> {
        both!(self, t => t.register(buf, access))
    }
    fn deregister(&mut self, r: &Region) -> Result<()> {
        both!(self, t => t.deregister(r))
    }
    fn remote_regions(&self, c: ConnId) -> Result<Vec<RemoteRegion>> {
        both!(self, t => t.remote_regions(c))
    }
    fn send(&mut self, c: ConnId, src: &Slice, tag: u32) -> Result<ReqId> {
        both!(self, t => t.send(c, src, tag))
    }
    fn write(&mut self, c: ConnId, src: &Slice, dst: &RemoteRegion, off: u64, imm: Option<u32>) -> Result<ReqId> {
        both!(self, t => t.write(c, src, dst, off, imm))
    }
    fn poll(&mut self, ev: &mut Vec<Event>, max: usize) -> Result<usize> {
        both!(self, t => t.poll(ev, max))
    }
    fn wait(&mut self, ev: &mut Vec<Event>, max: usize, timeout: Duration) -> Result<usize> {
        both!(self, t => t.wait(ev, max, timeout))
    }
    fn close(&mut self, c: ConnId) -> Result<()> {
        both!(self, t => t.close(c))
    }
    fn waker(&self) -> Result<Waker> {
        both!(self, t => t.waker())
    }
    fn counters(&self) -> Counters {
        both!(self, t => t.counters())
    }
}

fn config(o: &Opts) -> TcpConfig {
    let mut cfg = TcpConfig::new(o.job_id, o.rank, JobSecret::new(o.secret.clone()));
    cfg.handshake_timeout = o.handshake_timeout;
    cfg.max_outstanding = o.max_outstanding;
    if let Some(b) = o.busy_poll {
        cfg.busy_poll = b;
    }
    if let Some(m) = o.max_message_bytes {
        cfg.max_message_bytes = m;
    }
    cfg
}

fn uring(o: &Opts) -> Either {
    Either::Uring(Box::new(TcpTransport::new(config(o)).expect("io_uring transport")))
}

fn portable(o: &Opts) -> Either {
    Either::Portable(Box::new(PortableTransport::new(config(o)).expect("portable transport")))
}

fn uring_skip() -> Option<String> {
    match TcpTransport::new(TcpConfig::new(1, 0, JobSecret::new(b"probe".to_vec()))) {
        Ok(_) => None,
        Err(e) => Some(format!("the mixed suite needs io_uring on this host: {e}")),
    }
}

/// io_uring listens (rank 0), portable connects.
mod uring_server {
    use super::*;
    pub struct UringServer;
    impl Backend for UringServer {
        type T = Either;
        fn make(o: &Opts) -> Either {
            if o.rank == 0 {
                uring(o)
            } else {
                portable(o)
            }
        }
        fn skip() -> Option<String> {
            uring_skip()
        }
    }
    conformance_suite!(UringServer);
}

/// Portable listens (rank 0), io_uring connects.
mod portable_server {
    use super::*;
    pub struct PortableServer;
    impl Backend for PortableServer {
        type T = Either;
        fn make(o: &Opts) -> Either {
            if o.rank == 0 {
                portable(o)
            } else {
                uring(o)
            }
        }
        fn skip() -> Option<String> {
            uring_skip()
        }
    }
    conformance_suite!(PortableServer);
}
