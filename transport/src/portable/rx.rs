//! Receive: control frames (header-checked, reassembled in a reused buffer) and
//! the data socket's writes, placed straight into registered regions.

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::time::Instant;

use tracing::debug;

use crate::api::{ConnId, Event};
use crate::conn_core::{self, Backend};
use crate::error::{Error, FrameError, Result};
use crate::frame::{self, Header, Kind, HEADER_LEN};
use crate::memory::InFlight;

use super::config::{Sock, RX_BUDGET};
use super::state::{DataRx, State};
use super::PortableTransport;

enum Step {
    More,
    Blocked,
    Eof,
    Failed(Error),
}

impl PortableTransport {
    // ---------------------------------------------------------------- control

    /// Checks a control header against the connection's state, before its payload is read.
    fn check_ctrl_header(&mut self, conn: u64, b: &[u8; HEADER_LEN]) -> Result<Header> {
        let max = (self.cfg.max_message_bytes as u32).max(frame::MAX_CONTROL_BYTES);
        let c = self.conns.get_mut(&conn).expect("live");
        if let Some(h) = c.hs.as_mut() {
            return h.on_header(b).map_err(|r| {
                self.stats.pre_auth_refused += 1;
                r.error
            });
        }
        let bad = |reason| Error::BadFrame { peer: c.peer(), reason };
        let hdr = Header::decode(b).map_err(bad)?;
        if hdr.length > max {
            return Err(bad(FrameError::TooLong { len: hdr.length, max }));
        }
        match (c.state, hdr.kind) {
            (State::Ready | State::Closing, Kind::Message | Kind::Ack | Kind::Nack | Kind::Regions | Kind::Close) => {
                Ok(hdr)
            }
            (s, k) => Err(bad(FrameError::Unexpected {
                kind: k.name(),
                state: s.name(),
            })),
        }
    }

    /// Reads the control socket until it would block (or its budget is spent),
    /// handling every complete frame.
    pub(super) fn read_ctrl(&mut self, conn: u64) {
        let mut budget = RX_BUDGET;
        loop {
            // Handle what is buffered.
            if let Err(e) = self.parse_ctrl(conn) {
                return self.fail(conn, e);
            }
            let Some(c) = self.conns.get_mut(&conn) else { return };
            if !c.ctrl_ready.rd {
                return;
            }
            if budget == 0 {
                self.again.push(Sock::Ctrl(conn));
                return;
            }
            let step = if c.rx.msg.is_some() {
                self.read_ctrl_message(conn, &mut budget)
            } else {
                self.read_ctrl_frames(conn, &mut budget)
            };
            match step {
                // Blocked has cleared the read readiness: the next turn handles
                // what is buffered and stops.
                Step::More | Step::Blocked => {}
                Step::Eof => return self.on_ctrl_eof(conn),
                Step::Failed(e) => return self.fail(conn, e),
            }
        }
    }

    /// Reads a message's payload into the buffer the application gets, within
    /// the read budget like every other read (fairness between sockets), and
    /// delivers the message once whole.
    fn read_ctrl_message(&mut self, conn: u64, budget: &mut usize) -> Step {
        let c = self.conns.get_mut(&conn).expect("live");
        let (_, v, filled) = c.rx.msg.as_mut().expect("a message is being received");
        let want = (v.len() - *filled).min(*budget);
        match c.ctrl.read(&mut v[*filled..*filled + want]) {
            Ok(0) => Step::Eof,
            Ok(n) => {
                *filled += n;
                *budget = budget.saturating_sub(n);
                if n < want {
                    c.ctrl_ready.rd = false;
                }
                if *filled == v.len() {
                    let (hdr, data, _) = c.rx.msg.take().expect("present");
                    self.deliver_message(conn, &hdr, data);
                }
                Step::More
            }
            Err(e) => self.ctrl_read_error(conn, e),
        }
    }

    /// Reads control bytes into the frame buffer, within the read budget.
    fn read_ctrl_frames(&mut self, conn: u64, budget: &mut usize) -> Step {
        let c = self.conns.get_mut(&conn).expect("live");
        let rx = &mut c.rx;
        let have = rx.end - rx.start;
        // During the handshake read one frame at a time (header, then payload);
        // afterwards, as much as fits.
        let frame_end = match rx.hdr {
            Some(h) => HEADER_LEN + h.length as usize,
            None => HEADER_LEN,
        };
        let want = if c.hs.is_some() {
            frame_end - have
        } else {
            frame_end.max(rx.buf.len().min(*budget)) - have
        };
        if rx.start + have + want > rx.buf.len() {
            rx.buf.copy_within(rx.start..rx.end, 0);
            rx.start = 0;
            rx.end = have;
            if have + want > rx.buf.len() {
                rx.buf.resize(have + want, 0);
            }
        }
        let want = want.min(rx.buf.len() - rx.end);
        match c.ctrl.read(&mut rx.buf[rx.end..rx.end + want]) {
            Ok(0) => Step::Eof,
            Ok(n) => {
                rx.end += n;
                *budget = budget.saturating_sub(n);
                // A short read of a stream socket drained it (epoll(7)): the next
                // byte brings a new edge, so skip the read that would say EAGAIN.
                if n < want {
                    c.ctrl_ready.rd = false;
                }
                Step::More
            }
            Err(e) => self.ctrl_read_error(conn, e),
        }
    }

    /// A control read that failed: would-block clears the read readiness,
    /// an interrupt is retried, anything else loses the connection.
    fn ctrl_read_error(&mut self, conn: u64, e: io::Error) -> Step {
        match e.kind() {
            io::ErrorKind::WouldBlock => {
                self.conns.get_mut(&conn).expect("live").ctrl_ready.rd = false;
                Step::Blocked
            }
            io::ErrorKind::Interrupted => Step::More,
            _ => Step::Failed(self.lost(conn, "control receive", Some(e))),
        }
    }

    fn on_ctrl_eof(&mut self, conn: u64) {
        let c = self.conns.get_mut(&conn).expect("live");
        c.ctrl_ready.rd = false;
        if c.peer_closed || c.state == State::Closing && c.sent_close {
            return self.finish_close(conn);
        }
        let e = match c.state {
            State::Handshake if c.side == super::state::Side::Server && c.pre_auth() => Error::AuthFailed {
                peer: c.peer(),
                reason: "peer hung up before proving the job secret (does it have the same secret?)",
            },
            _ => self.lost(conn, "control receive (peer closed)", None),
        };
        self.fail(conn, e);
    }

    /// Handles every complete frame in the buffer; checks a header as soon as it is in.
    fn parse_ctrl(&mut self, conn: u64) -> Result<()> {
        loop {
            let Some(c) = self.conns.get_mut(&conn) else {
                return Ok(());
            };
            let rx = &mut c.rx;
            let have = rx.end - rx.start;
            if have < HEADER_LEN {
                if have == 0 {
                    rx.start = 0;
                    rx.end = 0;
                }
                return Ok(());
            }
            let hdr = match rx.hdr {
                Some(h) => h,
                None => {
                    let b: [u8; HEADER_LEN] = rx.buf[rx.start..rx.start + HEADER_LEN].try_into().expect("40 bytes");
                    let h = self.check_ctrl_header(conn, &b)?;
                    self.conns.get_mut(&conn).expect("live").rx.hdr = Some(h);
                    h
                }
            };
            let c = self.conns.get_mut(&conn).expect("live");
            let total = HEADER_LEN + hdr.length as usize;
            if c.rx.end - c.rx.start < total {
                if hdr.kind == Kind::Message && c.hs.is_none() {
                    // Everything buffered belongs to this message: move it into the
                    // message's own buffer and read the rest straight there.
                    let p = c.rx.start + HEADER_LEN;
                    let have = c.rx.end - p;
                    let mut v = vec![0u8; hdr.length as usize];
                    v[..have].copy_from_slice(&c.rx.buf[p..c.rx.end]);
                    self.stats.rx_user_copy_bytes += have as u64;
                    c.rx.start = 0;
                    c.rx.end = 0;
                    c.rx.hdr = None;
                    c.rx.msg = Some((hdr, v, have));
                }
                return Ok(());
            }
            // Take the buffer out while the frame is handled (no copy, no allocation).
            let mut rx = std::mem::replace(
                &mut c.rx,
                super::state::CtrlRx {
                    buf: Vec::new(),
                    start: 0,
                    end: 0,
                    hdr: None,
                    msg: None,
                },
            );
            let p = rx.start + HEADER_LEN;
            let r = self.on_ctrl_frame(conn, &hdr, &rx.buf[p..p + hdr.length as usize]);
            rx.start += total;
            rx.hdr = None;
            if let Some(c) = self.conns.get_mut(&conn) {
                c.rx = rx;
            }
            r?;
        }
    }

    fn deliver_message(&mut self, conn: u64, hdr: &Header, data: Vec<u8>) {
        self.events.push_back(Event::Message {
            conn: ConnId(conn),
            tag: hdr.imm,
            data,
        });
    }

    /// One control frame: the handshake's, or an established connection's.
    fn on_ctrl_frame(&mut self, conn: u64, hdr: &Header, payload: &[u8]) -> Result<()> {
        let Some(c) = self.conns.get_mut(&conn) else {
            return Ok(());
        };
        if c.hs.is_some() {
            return self.on_handshake_frame(conn, hdr, payload);
        }
        match hdr.kind {
            Kind::Message => {
                self.stats.rx_user_copy_bytes += payload.len() as u64;
                self.deliver_message(conn, hdr, payload.to_vec());
            }
            Kind::Ack => {
                conn_core::on_ack(&mut c.awaiting_ack, &mut c.outstanding, conn, hdr.seq, &mut self.events);
                self.dirty.push(conn);
            }
            Kind::Nack => {
                let (awaiting, outstanding) = (&mut c.awaiting_ack, &mut c.outstanding);
                conn_core::on_nack(awaiting, outstanding, conn, hdr.seq, payload, &mut self.events);
                self.dirty.push(conn);
            }
            Kind::Regions => {
                conn_core::on_regions(&mut c.remote, conn, hdr, payload, &mut self.events)
                    .map_err(|reason| Error::BadFrame { peer: c.peer(), reason })?;
            }
            Kind::Close => {
                c.peer_closed = true;
                if c.state == State::Ready {
                    c.state = State::Closing;
                    c.deadline = Some(Instant::now() + self.cfg.close_timeout);
                }
                self.dirty.push(conn);
                self.check_close_done(conn);
            }
            k => {
                // check_ctrl_header admits no other kind.
                return Err(Error::BadFrame {
                    peer: c.peer(),
                    reason: FrameError::Unexpected {
                        kind: k.name(),
                        state: c.state.name(),
                    },
                });
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- data

    /// Reads the data socket until it would block or its budget is spent.
    pub(super) fn read_data(&mut self, conn: u64) {
        let mut budget = RX_BUDGET;
        loop {
            let Some(c) = self.conns.get(&conn) else { return };
            if !c.data_ready.rd || c.data_eof || c.data_connecting {
                return;
            }
            if budget == 0 {
                self.again.push(Sock::Data(conn));
                return;
            }
            match self.data_step(conn, &mut budget) {
                Step::More => {}
                Step::Blocked => {
                    if let Some(c) = self.conns.get_mut(&conn) {
                        c.data_ready.rd = false;
                    }
                    return;
                }
                Step::Eof => {
                    let c = self.conns.get_mut(&conn).expect("live");
                    let mid_write = !matches!(c.drx, DataRx::Header { have: 0, .. });
                    if !mid_write && (c.peer_closed || c.state == State::Closing) {
                        c.data_eof = true;
                        c.data_ready.rd = false;
                        return;
                    }
                    let e = self.lost(conn, "data receive (peer closed)", None);
                    return self.fail(conn, e);
                }
                Step::Failed(e) => return self.fail(conn, e),
            }
        }
    }

    fn data_step(&mut self, conn: u64, budget: &mut usize) -> Step {
        let c = self.conns.get_mut(&conn).expect("live");
        if c.data.is_none() {
            return Step::Blocked;
        }
        let got = match c.drx {
            DataRx::Header { .. } => self.read_data_header(conn),
            DataRx::Payload { .. } => self.read_data_payload(conn, budget),
            DataRx::Discard { .. } => self.read_data_discard(conn, budget),
        };
        let res = match got {
            Ok(step) => return step,
            Err(e) => e,
        };
        match res.kind() {
            io::ErrorKind::WouldBlock => Step::Blocked,
            io::ErrorKind::Interrupted => Step::More,
            _ => Step::Failed(self.lost(conn, "data receive", Some(res))),
        }
    }

    /// Reads the rest of a write's header, and handles it once whole.
    fn read_data_header(&mut self, conn: u64) -> io::Result<Step> {
        let c = self.conns.get_mut(&conn).expect("live");
        let sock = c.data.as_mut().expect("checked in data_step");
        let DataRx::Header { buf, have } = &mut c.drx else {
            unreachable!("matched in data_step")
        };
        let n = sock.read(&mut buf[*have..])?;
        if n == 0 {
            return Ok(Step::Eof);
        }
        if n < HEADER_LEN - *have {
            c.data_ready.rd = false; // a short read drained the socket
        }
        *have += n;
        if *have < HEADER_LEN {
            return Ok(Step::More);
        }
        let b = *buf;
        Ok(self.on_data_header(conn, &b))
    }

    /// Receives a write's payload straight into its region, within the budget;
    /// the write's last chunk reads the next header too, if it is there.
    fn read_data_payload(&mut self, conn: u64, budget: &mut usize) -> io::Result<Step> {
        let c = self.conns.get_mut(&conn).expect("live");
        let fd = c.data.as_ref().expect("checked in data_step").as_raw_fd();
        let DataRx::Payload { region, hdr, done, .. } = &mut c.drx else {
            unreachable!("matched in data_step")
        };
        let left = hdr.length as u64 - *done;
        let n = left.min(*budget as u64) as usize;
        let at = hdr.offset as usize + *done as usize;
        // The write's last chunk: the next header may come in the same recvmsg.
        let last = n as u64 == left;
        let mut next = [0u8; HEADER_LEN];
        let k = if last {
            region.recv_into_with_tail(at, n, fd, &mut next)?
        } else {
            region.recv_into(at, n, fd)?
        };
        if k == 0 {
            return Ok(Step::Eof);
        }
        let asked = if last { n + HEADER_LEN } else { n };
        if k < asked {
            c.data_ready.rd = false; // a short read drained the socket
        }
        let placed = k.min(n);
        *done += placed as u64;
        *budget = budget.saturating_sub(k);
        self.stats.rx_write_direct_bytes += placed as u64;
        if *done == hdr.length as u64 {
            let h = *hdr;
            let extra = k - placed;
            c.drx = DataRx::Header { buf: next, have: extra };
            self.placed(conn, h);
            if extra == HEADER_LEN {
                return Ok(self.on_data_header(conn, &next));
            }
        }
        Ok(Step::More)
    }

    /// Reads a rejected write's payload into the scratch buffer, within the
    /// budget, and Nacks the write once all of it is gone.
    fn read_data_discard(&mut self, conn: u64, budget: &mut usize) -> io::Result<Step> {
        let c = self.conns.get_mut(&conn).expect("live");
        let sock = c.data.as_mut().expect("checked in data_step");
        let DataRx::Discard { remaining, .. } = &mut c.drx else {
            unreachable!("matched in data_step")
        };
        let n = (*remaining).min(self.scratch.len() as u64) as usize;
        let k = sock.read(&mut self.scratch[..n])?;
        if k == 0 {
            return Ok(Step::Eof);
        }
        if k < n {
            c.data_ready.rd = false; // a short read drained the socket
        }
        let n = k;
        *remaining -= n as u64;
        *budget = budget.saturating_sub(n);
        self.stats.rx_write_discarded_bytes += n as u64;
        if *remaining == 0 {
            let DataRx::Discard { hdr, reason, .. } = std::mem::replace(&mut c.drx, DataRx::header()) else {
                unreachable!("matched above")
            };
            self.nack(conn, hdr, reason);
        }
        Ok(Step::More)
    }

    fn on_data_header(&mut self, conn: u64, b: &[u8; HEADER_LEN]) -> Step {
        let hdr = match conn_core::decode_data_header(b, || self.conns[&conn].peer()) {
            Ok(h) => h,
            Err(e) => return Step::Failed(e),
        };
        let checked = self.regions.check_incoming(&hdr);
        let c = self.conns.get_mut(&conn).expect("live");
        match checked {
            Ok(_) if hdr.length == 0 => {
                c.drx = DataRx::header();
                self.placed(conn, hdr);
            }
            Ok(region) => {
                let guard = InFlight::new(&region);
                c.drx = DataRx::Payload {
                    region,
                    _guard: guard,
                    hdr,
                    done: 0,
                };
            }
            Err(error) => {
                debug!(conn, error = %error, "rejecting an incoming write; discarding its payload");
                let reason = error.to_string();
                self.events.push_back(Event::WriteRejected {
                    conn: ConnId(conn),
                    error,
                });
                if hdr.length == 0 {
                    c.drx = DataRx::header();
                    self.nack(conn, hdr, reason);
                } else {
                    c.drx = DataRx::Discard {
                        hdr,
                        remaining: hdr.length as u64,
                        reason,
                    };
                }
            }
        }
        Step::More
    }

    /// A rejected write was drained: acknowledge what came before it, then refuse it.
    fn nack(&mut self, conn: u64, hdr: Header, reason: String) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        let ack = c.ack_to_send.take();
        self.queue_nack(conn, ack, hdr.seq, reason);
    }

    fn placed(&mut self, conn: u64, hdr: Header) {
        self.events.extend(conn_core::write_received(conn, &hdr));
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ack_to_send = Some(hdr.seq);
        }
        self.dirty.push(conn);
    }
}
