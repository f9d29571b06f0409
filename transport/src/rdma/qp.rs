//! Queue-pair setup and connection: create and post receives (INIT), move to
//! RTR and RTS with the peer's QP info, become ready once both sides are and
//! the peer's regions are known; fail a connection; and the exchange and
//! close deadlines.
//!
//! # Through rdma_cm
//! In [`ConnectMode::RdmaCm`](super::ConnectMode::RdmaCm) (perftest's `-R`), the TCP control
//! plane still authenticates the peer and carries the QP info (receive depth,
//! notification ring), READY and the regions. What rdma_cm adds is the path:
//! the client resolves the server's IP address and route, the CM exchange
//! carries the QPNs and starting PSNs, and both sides take their RTR and RTS
//! attributes from `rdma_init_qp_attr` (the server on the request, the client
//! on the reply, after which it sends the RTU with `rdma_establish`). The
//! server's CM listens on the TCP listener's port number (in the RDMA port
//! space) and matches a request to its TCP connection by the requester's QPN,
//! which the control plane told it. The event channel, the listeners and the
//! requests waiting for their peer are `cm`'s.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::GenericCompletionQueue;
use sideway::ibverbs::device::DeviceInfo;
use sideway::ibverbs::device_context::LinkLayer;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, QueuePair, QueuePairAttribute, QueuePairState, SetScatterGatherEntry,
};
use sideway::ibverbs::AccessFlags;
use sideway::rdmacm::communication_manager::{ConnectionParameter, EventType, Identifier};
use tracing::debug;

use crate::api::{ConnId, Event, Transport};
use crate::error::{Error, Result};
use crate::memory::{PinOptions, PinnedBuffer};

use super::cm::{cm_err, CmEvent, RESOLVE_TIMEOUT};
use super::config::{mtu_code, mtu_of_code};
use super::device;
use super::error::{io_of, verbs};
use super::state::{wr_id, Op, State, KIND_RECV};
use super::wire::{self, QpInfo, NOTICE_LEN};
use super::RdmaTransport;

impl RdmaTransport {
    /// Creates the queue pair (RESET -> INIT), posts the receives, and sends our QP info.
    pub(super) fn start_qp(&mut self, id: u64) -> Result<()> {
        let cfg = &self.cfg;
        let name = self.dev.name.clone();
        let mut qp = self.create_qp()?;

        let rx_depth = cfg.rx_depth as usize;
        let msg = cfg.max_message_bytes;
        let unlocked = PinOptions {
            lock: false,
            ..Default::default()
        };
        let rx = PinnedBuffer::with_options(rx_depth * msg, unlocked)?;
        // A notice slot per receive, then the credit word the peer returns credits in.
        let ring = PinnedBuffer::with_options(wire::ring_len(cfg.rx_depth), unlocked)?;
        // SAFETY: both buffers are owned by the connection next to their MRs, and the
        // connection drops its queue pair before them (field order in `Conn` and
        // `fail_conn`), so the device never touches freed memory.
        let rx_mr = unsafe { self.pd.reg_mr(rx.as_ptr() as usize, rx.len(), AccessFlags::LocalWrite) }
            .map_err(|e| verbs("ibv_reg_mr(receive buffers)", &name, io_of(e)))?;
        // SAFETY: as above.
        let ring_mr = unsafe {
            self.pd.reg_mr(
                ring.as_ptr() as usize,
                ring.len(),
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
            )
        }
        .map_err(|e| verbs("ibv_reg_mr(notification ring)", &name, io_of(e)))?;
        {
            let mut g = qp.start_post_recv();
            for i in 0..rx_depth {
                let h = g.construct_wr(wr_id(id, KIND_RECV, i as u64));
                // SAFETY: the sge lies inside `rx`, registered as `rx_mr`, which outlives the QP.
                unsafe { h.setup_sge(rx_mr.lkey(), rx.as_ptr() as u64 + (i * msg) as u64, msg as u32) };
            }
            g.post().map_err(|e| verbs("ibv_post_recv", &name, io_of(e)))?;
        }
        let info = QpInfo {
            qpn: qp.qp_number(),
            psn: 0,
            lid: self.dev.lid,
            gid: self.dev.gid.raw,
            mtu: mtu_code(self.mtu),
            rx_depth: cfg.rx_depth,
            max_message: msg as u32,
            ring_addr: ring.as_ptr() as u64,
            ring_rkey: ring_mr.rkey(),
            max_msg_sz: self.dev.max_msg_sz,
        };
        let c = self.conns.get_mut(&id).expect("caller made the connection");
        let info = QpInfo { psn: c.psn, ..info };
        c.qp = Some(qp);
        c.rx_buf = Some((rx, rx_mr));
        c.ring = Some((ring, ring_mr));
        c.state = State::Exchange;
        c.deadline = Some(Instant::now() + self.cfg.control.handshake_timeout);
        self.ctrl_send(id, wire::TAG_QP_INFO, info.encode());
        Ok(())
    }

    /// A new RC queue pair on the transport's completion queue, sized by the
    /// config (inline data room for a notice at least), moved RESET -> INIT on
    /// our port.
    fn create_qp(&self) -> Result<ExtendedQueuePair> {
        let cfg = &self.cfg;
        let name = &self.dev.name;
        let mut b = self.pd.create_qp_builder();
        let cq = GenericCompletionQueue::from(Arc::clone(&self.cq));
        b.setup_send_cq(cq.clone())
            .setup_recv_cq(cq)
            .setup_max_send_wr(cfg.tx_depth)
            .setup_max_recv_wr(cfg.rx_depth)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(cfg.max_inline_bytes.max(NOTICE_LEN as u32));
        let mut qp = b.build_ex().map_err(|e| verbs("ibv_create_qp_ex", name, io_of(e)))?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.dev.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead);
        qp.modify(&a)
            .map_err(|e| verbs("ibv_modify_qp(INIT)", name, io_of(e)))?;
        Ok(qp)
    }

    /// The peer's QP info arrived: INIT -> RTR -> RTS, then READY and our regions.
    pub(super) fn connect_qp(&mut self, id: u64, peer: QpInfo) -> Result<()> {
        if self.cm.is_some() {
            return self.cm_start(id, peer);
        }
        let cfg = self.cfg.clone();
        let name = self.dev.name.clone();
        let link = self.dev.link;
        let (port, gid_index) = (self.dev.port, self.dev.gid_index);
        let mtu = if mtu_code(self.mtu) <= peer.mtu {
            self.mtu
        } else {
            mtu_of_code(peer.mtu)
        };
        let c = self.conns.get_mut(&id).expect("known connection");
        let qp = c.qp.as_mut().ok_or(Error::NotConnected {
            op: "connect",
            conn: id,
        })?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(peer.qpn)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(16)
            .setup_min_rnr_timer(cfg.min_rnr_timer);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(peer.lid).setup_port(port).setup_service_level(0);
        if link != LinkLayer::InfiniBand || peer.gid != [0; 16] {
            ah.setup_grh_src_gid_index(gid_index as u8)
                .setup_grh_dest_gid(&Gid { raw: peer.gid })
                .setup_grh_hop_limit(64);
        }
        a.setup_address_vector(&ah);
        qp.modify(&a)
            .map_err(|e| verbs("ibv_modify_qp(RTR)", &name, io_of(e)))?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(c.psn)
            .setup_timeout(cfg.timeout)
            .setup_retry_cnt(cfg.retry_cnt)
            .setup_rnr_retry(cfg.rnr_retry)
            .setup_max_read_atomic(16);
        qp.modify(&a)
            .map_err(|e| verbs("ibv_modify_qp(RTS)", &name, io_of(e)))?;
        c.credits = peer.rx_depth;
        c.peer_info = Some(peer);
        debug!(
            conn = id,
            qpn = peer.qpn,
            mtu = device::mtu_bytes(mtu),
            "queue pair ready to send"
        );
        self.ready_to_send(id);
        Ok(())
    }

    /// Our queue pair is RTS: tell the peer, announce our regions.
    pub(super) fn ready_to_send(&mut self, id: u64) {
        self.conns.get_mut(&id).expect("known").state = State::AwaitReady;
        self.ctrl_send(id, wire::TAG_READY, Vec::new());
        self.conns.get_mut(&id).expect("known").announced = true;
        self.announce_all(id);
        self.maybe_ready(id);
    }

    pub(super) fn maybe_ready(&mut self, id: u64) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        // Ready once both sides are RTS and the peer's regions are known, so that a
        // peer's message never arrives before what it announced earlier (the TCP
        // backend orders them on one socket; here they travel apart).
        if c.state != State::AwaitReady || !c.peer_ready || !c.regions_seen {
            return;
        }
        c.state = State::Ready;
        c.deadline = None;
        if c.ready_event_sent {
            return;
        }
        c.ready_event_sent = true;
        let peer = c.peer.expect("authenticated");
        let early = std::mem::take(&mut c.early);
        let has_regions = !c.remote.is_empty();
        match c.inbound {
            None => self.events.push_back(Event::Connected { conn: ConnId(id), peer }),
            Some(l) => {
                self.accepted.entry(l.0).or_default().push_back((ConnId(id), peer));
                self.events.push_back(Event::Incoming {
                    listener: l,
                    conn: ConnId(id),
                });
            }
        }
        if has_regions {
            self.events.push_back(Event::RemoteRegionsChanged { conn: ConnId(id) });
        }
        self.events.extend(early);
    }

    /// Fails a connection: the queue pair is destroyed first (the device stops
    /// touching memory), then every op ends with `OpFailed` and `Closed` follows.
    pub(super) fn fail_conn(&mut self, id: u64, error: Error, culprit: Option<(u64, Error)>) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        if c.state == State::Dead && c.inflight.is_empty() && c.pending.is_empty() {
            return;
        }
        let was_visible = c.ready_event_sent;
        // Errors the peer did not cause itself are worth telling it about.
        let abort_reason =
            (!matches!(error, Error::Rejected { .. } | Error::ConnectionLost { .. })).then(|| error.to_string());
        c.state = State::Dead;
        c.qp = None;
        let ops: Vec<Op> = c.inflight.drain(..).chain(c.pending.drain(..).map(|p| p.0)).collect();
        c.wrs_in_flight = 0;
        let mut culprit = culprit;
        for o in ops {
            let e = match culprit.take() {
                Some((seq, e)) if seq == o.seq => e,
                Some(other) => {
                    culprit = Some(other);
                    Error::Cancelled { conn: id }
                }
                None => Error::Cancelled { conn: id },
            };
            self.events.push_back(Event::OpFailed {
                conn: ConnId(id),
                req: o.req,
                error: e,
            });
        }
        if was_visible {
            self.events.push_back(Event::Closed {
                conn: ConnId(id),
                error: Some(error),
            });
        } else if let Some(l) = self.conns.get(&id).and_then(|c| c.inbound) {
            let addr = self.conns[&id]
                .peer
                .map(|p| p.addr)
                .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
            self.events.push_back(Event::PeerRejected {
                listener: l,
                addr,
                error,
            });
        } else {
            self.events.push_back(Event::Closed {
                conn: ConnId(id),
                error: Some(error),
            });
        }
        // Tell the peer why before the control connection goes (a no-op when it is gone).
        if let Some(e) = abort_reason {
            self.ctrl_send(id, wire::TAG_ABORT, wire::encode_abort(false, &e));
        }
        let _ = self.inner.close(ConnId(id));
    }

    pub(super) fn housekeeping(&mut self) {
        let now = Instant::now();
        let mut fail = Vec::new();
        let mut close = Vec::new();
        let mut late = Vec::new();
        for c in self.conns.values_mut() {
            if let Some((_, at)) = &c.qp_failed {
                if now >= *at {
                    fail.push(c.id);
                }
            }
            if c.deadline.is_some_and(|d| now >= d)
                && matches!(c.state, State::Exchange | State::AwaitReady | State::Closing)
            {
                c.deadline = None;
                late.push((c.id, c.state));
            }
            if c.state == State::Closing && !c.close_sent && c.pending.is_empty() && c.inflight.is_empty() {
                close.push(c.id);
            }
        }
        for id in fail {
            let e = self
                .conns
                .get_mut(&id)
                .and_then(|c| c.qp_failed.take())
                .map(|x| x.0)
                .expect("listed");
            self.fail_conn(id, e, None);
        }
        for (id, state) in late {
            let c = &self.conns[&id];
            let (op, after) = if state == State::Closing {
                ("close (work still queued or in flight)", self.cfg.control.close_timeout)
            } else {
                (
                    "RDMA queue-pair exchange (is the peer on the TCP transport? every rank must use the same one)",
                    self.cfg.control.handshake_timeout,
                )
            };
            let e = Error::Timeout {
                op,
                peer: c.peer_name(),
                after_ms: after.as_millis() as u64,
            };
            self.fail_conn(id, e, None);
        }
        for id in close {
            // Everything flushed: close the control connection; its Closed ends ours.
            let c = self.conns.get_mut(&id).expect("listed");
            c.close_sent = true;
            let _ = self.inner.close(ConnId(id));
        }
    }
}

/// Queue pairs through rdma_cm.
impl RdmaTransport {
    /// The peer's QP info arrived: the client starts resolving; the server looks
    /// for the peer's connect request (or waits for it).
    pub(super) fn cm_start(&mut self, id: u64, peer: QpInfo) -> Result<()> {
        let c = self.conns.get_mut(&id).expect("known connection");
        c.credits = peer.rx_depth;
        c.peer_info = Some(peer);
        if c.inbound.is_some() {
            if let Some(cm_id) = self.cm.as_mut().expect("CM mode").take_unmatched(peer.qpn) {
                return self.cm_accept(id, cm_id);
            }
            return Ok(());
        }
        let dst = c.peer.expect("authenticated").addr;
        // Bind the source to this device's own address, so the route leaves through it.
        let src = device::ipv4_mapped(&self.dev.gid).map(|ip| SocketAddr::new(IpAddr::V4(ip), 0));
        let cm_id = self.cm.as_ref().expect("CM mode").create_id(&self.dev.name)?;
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
            let Some(CmEvent {
                kind,
                status,
                cm_id,
                from_listener,
            }) = self.cm.as_ref().expect("CM mode").next_event()
            else {
                return;
            };
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
            None => self.cm.as_mut().expect("CM mode").park(cm_id, qpn),
        }
    }
}
