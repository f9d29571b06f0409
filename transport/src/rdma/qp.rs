//! Queue-pair setup and connection: create and post receives (INIT), move to
//! RTR and RTS with the peer's QP info, become ready once both sides are and
//! the peer's regions are known; fail a connection; and the exchange and
//! close deadlines.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::GenericCompletionQueue;
use sideway::ibverbs::device_context::LinkLayer;
use sideway::ibverbs::queue_pair::{QueuePair, QueuePairAttribute, QueuePairState, SetScatterGatherEntry};
use sideway::ibverbs::AccessFlags;
use tracing::debug;

use crate::api::{ConnId, Event, Transport};
use crate::error::{Error, Result};
use crate::memory::{PinOptions, PinnedBuffer};

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
        let mut b = self.pd.create_qp_builder();
        let cq = GenericCompletionQueue::from(Arc::clone(&self.cq));
        b.setup_send_cq(cq.clone())
            .setup_recv_cq(cq)
            .setup_max_send_wr(cfg.tx_depth)
            .setup_max_recv_wr(cfg.rx_depth)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(cfg.max_inline_bytes.max(NOTICE_LEN as u32));
        let mut qp = b.build_ex().map_err(|e| verbs("ibv_create_qp_ex", &name, io_of(e)))?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.dev.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead);
        qp.modify(&a)
            .map_err(|e| verbs("ibv_modify_qp(INIT)", &name, io_of(e)))?;

        let rx_depth = cfg.rx_depth as usize;
        let msg = cfg.max_message_bytes;
        let unlocked = PinOptions {
            lock: false,
            ..Default::default()
        };
        let rx = PinnedBuffer::with_options(rx_depth * msg, unlocked)?;
        let ring = PinnedBuffer::with_options(rx_depth * NOTICE_LEN, unlocked)?;
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
