//! The control plane over the inner TCP transport: control messages in
//! registered cells (QP info, READY, regions, ABORT), and the inner
//! transport's events (authenticated connections, messages, closes). Receive
//! credits do not come this way: they are RDMA WRITEs (`post`,
//! `return_credits`), so steady traffic never touches the control plane.

use crate::api::{ConnId, Event, Transport};
use crate::error::Error;
use crate::frame;
use crate::memory::RemoteRegion;

use super::state::{Conn, State, CTRL_CELL};
use super::wire::{self, QpInfo};
use super::RdmaTransport;
use tracing::debug;

impl RdmaTransport {
    pub(super) fn ctrl_send(&mut self, conn: u64, tag: u32, data: Vec<u8>) {
        self.ctrl_backlog.push_back((conn, tag, data));
        self.flush_ctrl();
    }

    pub(super) fn flush_ctrl(&mut self) {
        while let Some((conn, tag, data)) = self.ctrl_backlog.pop_front() {
            let Some(cell) = self.ctrl_cells.pop() else {
                self.ctrl_backlog.push_front((conn, tag, data));
                return;
            };
            let off = cell * CTRL_CELL;
            let len = data.len().min(CTRL_CELL);
            let sent = self
                .ctrl
                .write_at(off, &data[..len])
                .and_then(|_| self.ctrl.slice(off, len))
                .and_then(|s| self.inner.send(ConnId(conn), &s, tag));
            match sent {
                Ok(r) => {
                    self.ctrl_inflight.insert(r, cell);
                }
                Err(Error::WouldBlock { .. }) => {
                    self.ctrl_cells.push(cell);
                    self.ctrl_backlog.push_front((conn, tag, data));
                    return;
                }
                Err(e) => {
                    self.ctrl_cells.push(cell);
                    debug!(conn, tag, error = %e, "control message not sent (connection ending)");
                }
            }
        }
    }

    pub(super) fn announce_all(&mut self, conn: u64) {
        let list: Vec<RemoteRegion> = self
            .regions
            .values()
            .filter(|r| r.region.access().remote_write)
            .map(|r| r.region.remote())
            .collect();
        // An empty list is announced too: it tells the peer the exchange is complete.
        for chunk in list.chunks(CTRL_CELL / 32).chain(list.is_empty().then_some(&[][..])) {
            self.ctrl_send(conn, wire::TAG_REGIONS, frame::encode_regions(chunk));
        }
    }

    pub(super) fn broadcast_regions(&mut self, r: RemoteRegion, revoke: bool) {
        let ids: Vec<u64> = self
            .conns
            .values()
            .filter(|c| c.announced && matches!(c.state, State::Ready | State::Closing | State::AwaitReady))
            .map(|c| c.id)
            .collect();
        for id in ids {
            let tag = if revoke { wire::TAG_REVOKE } else { wire::TAG_REGIONS };
            self.ctrl_send(id, tag, frame::encode_regions(&[r]));
        }
    }
    pub(super) fn on_inner(&mut self, ev: Event) {
        match ev {
            Event::Connected { conn, peer } => {
                let c = self.conns.entry(conn.0).or_insert_with(|| Conn::new(conn.0, None));
                c.peer = Some(peer);
                if let Err(e) = self.start_qp(conn.0) {
                    self.fail_conn(conn.0, e, None);
                }
            }
            Event::Incoming { listener, .. } => {
                while let Ok(Some((conn, peer))) = self.inner.accept(listener) {
                    let mut c = Conn::new(conn.0, Some(listener));
                    c.peer = Some(peer);
                    self.conns.insert(conn.0, c);
                    if let Err(e) = self.start_qp(conn.0) {
                        self.fail_conn(conn.0, e, None);
                    }
                }
            }
            Event::PeerRejected { .. } => self.events.push_back(ev),
            Event::SendDone { req, .. } => {
                if let Some(cell) = self.ctrl_inflight.remove(&req) {
                    self.ctrl_cells.push(cell);
                }
            }
            Event::OpFailed { req, .. } => {
                if let Some(cell) = self.ctrl_inflight.remove(&req) {
                    self.ctrl_cells.push(cell);
                }
            }
            Event::Message { conn, tag, data } => self.on_ctrl(conn.0, tag, &data),
            Event::Closed { conn, error } => self.on_inner_closed(conn.0, error),
            _ => {}
        }
    }

    pub(super) fn on_ctrl(&mut self, id: u64, tag: u32, data: &[u8]) {
        if !self.conns.get(&id).is_some_and(|c| c.state != State::Dead) {
            return;
        }
        let bad = |what: &str, e: &dyn std::fmt::Display| Error::Rejected {
            peer: format!("connection {id}"),
            reason: format!("malformed {what} from the peer: {e}"),
        };
        match tag {
            wire::TAG_QP_INFO => match QpInfo::decode(data) {
                Ok(info) => {
                    if let Err(e) = self.connect_qp(id, info) {
                        self.fail_conn(id, e, None);
                    }
                }
                Err(e) => self.fail_conn(id, bad("QP info", &e), None),
            },
            wire::TAG_READY => {
                self.conns.get_mut(&id).expect("checked").peer_ready = true;
                self.maybe_ready(id);
            }
            wire::TAG_REGIONS | wire::TAG_REVOKE => match frame::decode_regions(data) {
                Ok(list) => {
                    let c = self.conns.get_mut(&id).expect("checked");
                    for r in list {
                        c.remote.retain(|x| x.rkey != r.rkey);
                        if tag == wire::TAG_REGIONS {
                            c.remote.push(r);
                        }
                    }
                    if c.ready_event_sent {
                        self.events.push_back(Event::RemoteRegionsChanged { conn: ConnId(id) });
                    } else if tag == wire::TAG_REGIONS {
                        c.regions_seen = true;
                        self.maybe_ready(id);
                    }
                }
                Err(e) => self.fail_conn(id, bad("region list", &e), None),
            },
            wire::TAG_ABORT => {
                let (access, reason) = wire::decode_abort(data);
                let c = self.conns.get_mut(&id).expect("checked");
                let peer = c.peer_name();
                let seq = c.notices_seen;
                if access {
                    self.events.push_back(Event::WriteRejected {
                        conn: ConnId(id),
                        error: Error::RemoteAccess {
                            conn: id,
                            seq,
                            reason: format!("this side's device refused the peer's write: {reason}"),
                        },
                    });
                }
                self.fail_conn(id, Error::Rejected { peer, reason }, None);
            }
            _ => self.fail_conn(id, bad("control message", &format!("unknown tag {tag}")), None),
        }
    }

    pub(super) fn on_inner_closed(&mut self, id: u64, error: Option<Error>) {
        let Some(c) = self.conns.get(&id) else {
            // Never authenticated: the control plane's verdict is the whole story.
            self.events.push_back(Event::Closed {
                conn: ConnId(id),
                error,
            });
            return;
        };
        if c.state == State::Dead {
            self.conns.remove(&id);
            return;
        }
        // Deliver what already landed before the connection goes.
        let _ = self.poll_cq();
        let Some(c) = self.conns.get(&id) else { return };
        if c.state == State::Dead {
            self.conns.remove(&id);
            return;
        }
        let graceful = error.is_none() && c.inflight.is_empty() && c.pending.is_empty();
        if graceful {
            let visible = c.ready_event_sent;
            if let Some(c) = self.conns.get_mut(&id) {
                c.qp = None;
                c.state = State::Dead;
            }
            if visible {
                self.events.push_back(Event::Closed {
                    conn: ConnId(id),
                    error: None,
                });
            }
            self.conns.remove(&id);
            return;
        }
        let e = error.unwrap_or_else(|| Error::ConnectionLost {
            conn: id,
            peer: c.peer_name(),
            during: "RDMA operations",
            source: None,
        });
        self.fail_conn(id, e, None);
        self.conns.remove(&id);
    }
}
