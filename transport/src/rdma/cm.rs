//! The rdma_cm wrapper of [`super::ConnectMode::RdmaCm`]: the transport's event
//! channel, its listeners, and connect requests that arrived before the control
//! plane introduced their peer. The queue-pair setup that drives it is in `qp`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use sideway::rdmacm::communication_manager::{EventChannel, EventType, Identifier, PortSpace};

use super::error::{io_of, verbs};
use crate::error::{Error, Result};

/// The transport's rdma_cm event channel, listeners, and connect requests that
/// arrived before the control plane introduced their peer.
pub(super) struct Cm {
    channel: Arc<EventChannel>,
    listeners: Vec<Arc<Identifier>>,
    unmatched: Vec<(Arc<Identifier>, u32)>,
}

/// What the transport uses of one rdma_cm event, taken after the event is acknowledged.
pub(super) struct CmEvent {
    pub(super) kind: EventType,
    pub(super) status: i32,
    pub(super) cm_id: Option<Arc<Identifier>>,
    /// The event came to one of our listeners (a connect request).
    pub(super) from_listener: bool,
}

/// How long address and route resolution may take.
pub(super) const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) fn cm_err(op: &'static str, device: &str, e: impl std::error::Error + 'static) -> Error {
    verbs(op, device, io_of(e))
}

impl Cm {
    pub(super) fn new(device: &str) -> Result<Cm> {
        let channel = EventChannel::new().map_err(|e| cm_err("rdma_create_event_channel", device, e))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| verbs("fcntl(O_NONBLOCK) on the rdma_cm channel", device, e))?;
        Ok(Cm {
            channel,
            listeners: Vec::new(),
            unmatched: Vec::new(),
        })
    }

    /// A new identifier on the channel, in the RDMA port space.
    pub(super) fn create_id(&self, device: &str) -> Result<Arc<Identifier>> {
        self.channel
            .create_id(PortSpace::Tcp)
            .map_err(|e| cm_err("rdma_create_id", device, e))
    }

    /// Listens on `addr` (the TCP listener's address) in the RDMA port space.
    pub(super) fn listen(&mut self, addr: SocketAddr, device: &str) -> Result<()> {
        let id = self.create_id(device)?;
        id.bind_addr(addr).map_err(|e| cm_err("rdma_bind_addr", device, e))?;
        id.listen(64).map_err(|e| cm_err("rdma_listen", device, e))?;
        self.listeners.push(id);
        Ok(())
    }

    /// The next event on the (nonblocking) channel, acknowledged; `None` when there is none.
    pub(super) fn next_event(&self) -> Option<CmEvent> {
        let ev = self.channel.get_cm_event().ok()?;
        let out = CmEvent {
            kind: ev.event_type(),
            status: ev.status(),
            cm_id: ev.cm_id(),
            from_listener: ev.listener_id().is_some(),
        };
        drop(ev); // acknowledges the event; the identifiers stay alive through their Arcs
        Some(out)
    }

    /// Takes the parked connect request whose requester's QPN is `qpn`.
    pub(super) fn take_unmatched(&mut self, qpn: u32) -> Option<Arc<Identifier>> {
        let at = self.unmatched.iter().position(|(_, q)| *q == qpn)?;
        Some(self.unmatched.remove(at).0)
    }

    /// Parks a connect request until the control plane introduces its peer.
    pub(super) fn park(&mut self, cm_id: Arc<Identifier>, qpn: u32) {
        self.unmatched.push((cm_id, qpn));
    }
}
