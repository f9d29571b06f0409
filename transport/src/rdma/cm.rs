//! Queue-pair setup through rdma_cm ([`super::ConnectMode::RdmaCm`], perftest's `-R`).
//!
//! The TCP control plane still authenticates the peer and carries the QP info
//! (receive depth, notification ring), READY and the regions. What rdma_cm adds
//! is the path: the client resolves the server's IP address and route, the CM
//! exchange carries the QPNs and starting PSNs, and both sides take their RTR
//! and RTS attributes from `rdma_init_qp_attr` (the server on the request, the
//! client on the reply, after which it sends the RTU with `rdma_establish`). The server's CM listens on the
//! TCP listener's port number (in the RDMA port space) and matches a request to
//! its TCP connection by the requester's QPN, which the control plane told it.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use sideway::ibverbs::device::DeviceInfo;
use sideway::ibverbs::queue_pair::{QueuePair, QueuePairState};
use sideway::rdmacm::communication_manager::{ConnectionParameter, EventChannel, EventType, Identifier, PortSpace};
use tracing::debug;

use super::{device, io_of, verbs, RdmaTransport, State};
use crate::error::{Error, Result};
use crate::rdma::wire::QpInfo;

/// The transport's rdma_cm event channel, listeners, and connect requests that
/// arrived before the control plane introduced their peer.
pub(super) struct Cm {
    channel: Arc<EventChannel>,
    listeners: Vec<Arc<Identifier>>,
    unmatched: Vec<(Arc<Identifier>, u32)>,
}

const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

fn cm_err(op: &'static str, device: &str, e: impl std::error::Error + 'static) -> Error {
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

    /// Listens on `addr` (the TCP listener's address) in the RDMA port space.
    pub(super) fn listen(&mut self, addr: SocketAddr, device: &str) -> Result<()> {
        let id = self
            .channel
            .create_id(PortSpace::Tcp)
            .map_err(|e| cm_err("rdma_create_id", device, e))?;
        id.bind_addr(addr).map_err(|e| cm_err("rdma_bind_addr", device, e))?;
        id.listen(64).map_err(|e| cm_err("rdma_listen", device, e))?;
        self.listeners.push(id);
        Ok(())
    }
}

impl RdmaTransport {
    /// The peer's QP info arrived: the client starts resolving; the server looks
    /// for the peer's connect request (or waits for it).
    pub(super) fn cm_start(&mut self, id: u64, peer: QpInfo) -> Result<()> {
        let c = self.conns.get_mut(&id).expect("known connection");
        c.credits = peer.rx_depth;
        c.peer_info = Some(peer);
        if c.inbound.is_some() {
            let cm = self.cm.as_mut().expect("CM mode");
            if let Some(at) = cm.unmatched.iter().position(|(_, qpn)| *qpn == peer.qpn) {
                let (cm_id, _) = cm.unmatched.remove(at);
                return self.cm_accept(id, cm_id);
            }
            return Ok(());
        }
        let dst = c.peer.expect("authenticated").addr;
        // Bind the source to this device's own address, so the route leaves through it.
        let src = device::ipv4_mapped(&self.dev.gid).map(|ip| SocketAddr::new(IpAddr::V4(ip), 0));
        let cm = self.cm.as_ref().expect("CM mode");
        let cm_id = cm
            .channel
            .create_id(PortSpace::Tcp)
            .map_err(|e| cm_err("rdma_create_id", &self.dev.name, e))?;
        cm_id.setup_context(id);
        // Bind first and resolve with no source: sideway 0.4.3 passes a source address
        // to rdma_resolve_addr through a temporary that is gone before the call.
        if let Some(src) = src {
            cm_id
                .bind_addr(src)
                .map_err(|e| cm_err("rdma_bind_addr", &self.dev.name, e))?;
        }
        cm_id
            .resolve_addr(None, dst, RESOLVE_TIMEOUT)
            .map_err(|e| cm_err("rdma_resolve_addr", &self.dev.name, e))?;
        self.conns.get_mut(&id).expect("known").cm_id = Some(cm_id);
        Ok(())
    }

    /// Moves our QP with the CM's attributes for `state`, keeping our retry knobs.
    fn cm_modify(&mut self, id: u64, cm_id: &Identifier, state: QueuePairState) -> Result<()> {
        let name = self.dev.name.clone();
        let mut attr = cm_id
            .get_qp_attr(state)
            .map_err(|e| cm_err("rdma_init_qp_attr", &name, e))?;
        if state == QueuePairState::ReadyToSend {
            attr.setup_timeout(self.cfg.timeout)
                .setup_retry_cnt(self.cfg.retry_cnt)
                .setup_rnr_retry(self.cfg.rnr_retry);
        } else {
            attr.setup_min_rnr_timer(self.cfg.min_rnr_timer);
        }
        let op = if state == QueuePairState::ReadyToSend {
            "ibv_modify_qp(RTS, rdma_cm)"
        } else {
            "ibv_modify_qp(RTR, rdma_cm)"
        };
        let c = self.conns.get_mut(&id).expect("known");
        let qp = c.qp.as_mut().ok_or(Error::NotConnected { op, conn: id })?;
        qp.modify(&attr).map_err(|e| verbs(op, &name, io_of(e)))
    }

    fn qpn(&self, id: u64) -> u32 {
        self.conns[&id].qp.as_ref().map(|q| q.qp_number()).unwrap_or(0)
    }

    /// Server: RTR and RTS from the request, then rdma_accept with our QPN.
    fn cm_accept(&mut self, id: u64, cm_id: Arc<Identifier>) -> Result<()> {
        cm_id.setup_context(id);
        self.cm_modify(id, &cm_id, QueuePairState::ReadyToReceive)?;
        self.cm_modify(id, &cm_id, QueuePairState::ReadyToSend)?;
        let mut p = ConnectionParameter::new();
        p.setup_qp_number(self.qpn(id));
        cm_id.accept(p).map_err(|e| cm_err("rdma_accept", &self.dev.name, e))?;
        self.conns.get_mut(&id).expect("known").cm_id = Some(cm_id);
        debug!(conn = id, "rdma_cm: accepted");
        Ok(())
    }

    /// Drains the rdma_cm event channel.
    pub(super) fn poll_cm(&mut self) {
        loop {
            let ev = match self.cm.as_ref().expect("CM mode").channel.get_cm_event() {
                Ok(ev) => ev,
                Err(_) => return,
            };
            let kind = ev.event_type();
            let status = ev.status();
            let cm_id = ev.cm_id();
            let from_listener = ev.listener_id().is_some();
            drop(ev); // acknowledges the event; the identifiers stay alive through their Arcs
            let Some(cm_id) = cm_id else { continue };
            if kind == EventType::ConnectRequest && from_listener {
                self.on_connect_request(cm_id);
                continue;
            }
            let Some(id) = cm_id.get_context::<u64>().map(|c| *c) else {
                continue;
            };
            if !self.conns.get(&id).is_some_and(|c| c.state == State::Exchange) {
                continue;
            }
            let name = self.dev.name.clone();
            let r = match kind {
                EventType::AddressResolved => cm_id
                    .resolve_route(RESOLVE_TIMEOUT)
                    .map_err(|e| cm_err("rdma_resolve_route", &name, e)),
                EventType::RouteResolved => self.cm_connect(id, &cm_id),
                // Client: the reply carries the server's QPN and PSN; RTR, RTS, then RTU.
                EventType::ConnectResponse => {
                    let r = self
                        .cm_modify(id, &cm_id, QueuePairState::ReadyToReceive)
                        .and_then(|_| self.cm_modify(id, &cm_id, QueuePairState::ReadyToSend))
                        .and_then(|_| cm_id.establish().map_err(|e| cm_err("rdma_establish", &name, e)));
                    if r.is_ok() {
                        self.ready_to_send(id);
                    }
                    r
                }
                // Server: the client's RTU arrived.
                EventType::Established if self.conns[&id].inbound.is_some() => {
                    self.ready_to_send(id);
                    Ok(())
                }
                EventType::AddressError
                | EventType::RouteError
                | EventType::ConnectError
                | EventType::Unreachable
                | EventType::Rejected => Err(Error::Rejected {
                    peer: self.conns[&id].peer_name(),
                    reason: format!("rdma_cm: {kind:?} (status {status})"),
                }),
                _ => Ok(()),
            };
            if let Err(e) = r {
                self.fail_conn(id, e, None);
            }
        }
    }

    /// Client: the route is known; check it leaves through our device, and connect.
    fn cm_connect(&mut self, id: u64, cm_id: &Identifier) -> Result<()> {
        let routed = cm_id.get_device_context().map(|c| c.name()).unwrap_or_default();
        if routed != self.dev.name {
            return Err(Error::RdmaUnavailable {
                reason: format!(
                    "rdma_cm routes to the peer through {routed:?}, but this transport runs on {:?}; \
                     set TIDEWIRE_RDMA_DEVICE={routed}",
                    self.dev.name
                ),
            });
        }
        let mut p = ConnectionParameter::new();
        p.setup_qp_number(self.qpn(id));
        cm_id.connect(p).map_err(|e| cm_err("rdma_connect", &self.dev.name, e))
    }

    /// Server: match a connect request to its control connection by the requester's QPN.
    fn on_connect_request(&mut self, cm_id: Arc<Identifier>) {
        let qpn = match cm_id.get_qp_attr(QueuePairState::ReadyToReceive) {
            Ok(a) => a.dest_qp_num(),
            Err(e) => {
                debug!(error = %e, "rdma_cm: unusable connect request");
                return;
            }
        };
        let found = self
            .conns
            .values()
            .find(|c| c.inbound.is_some() && c.state == State::Exchange && c.peer_info.is_some_and(|p| p.qpn == qpn))
            .map(|c| c.id);
        match found {
            Some(id) => {
                if let Err(e) = self.cm_accept(id, cm_id) {
                    self.fail_conn(id, e, None);
                }
            }
            None => self.cm.as_mut().expect("CM mode").unmatched.push((cm_id, qpn)),
        }
    }
}
