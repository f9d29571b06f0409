//! Transmit: the control queue (handshake frames, messages, region
//! announcements, acknowledgements, close) and the data socket's writes, each
//! gathered into one `sendmsg(2)` straight from registered memory. A partial
//! send keeps its offset; EAGAIN waits for writability.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use crate::api::{ConnId, Event};
use crate::frame::HEADER_LEN;

use super::config::GATHER_MAX;
use super::state::{AwaitAck, State, TxFrame};
use super::PortableTransport;

/// `sendmsg(2)` of `iov` with MSG_NOSIGNAL (a vanished peer is an error, not a signal).
fn sendmsg(fd: RawFd, iov: &mut [libc::iovec]) -> io::Result<usize> {
    // SAFETY: all-zero is a valid msghdr (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    // The iovecs describe frame headers and owned payloads in the queue, or slices of
    // registered regions that each queued request's InFlight guard keeps alive.
    // SAFETY: `msg` points at `iov`, whose memory stays valid and unmodified for the call (the kernel only reads it).
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

fn iov(p: *const u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: p as *mut libc::c_void,
        iov_len: len,
    }
}

crate::conn_core::impl_backend!(PortableTransport);

impl PortableTransport {
    /// Sends whatever one connection has queued, as far as its sockets take it.
    pub(super) fn flush(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        // A pending acknowledgement goes ahead of anything queued later.
        if let Some(seq) = c.ack_to_send.take() {
            c.ctrl_tx.push_back(TxFrame::ack(seq));
        }
        if c.state == State::Closing
            && !c.sent_close
            && c.data_tx.is_empty()
            && c.awaiting_ack.is_empty()
            && c.ctrl_tx.is_empty()
        {
            c.sent_close = true;
            c.ctrl_tx.push_back(TxFrame::close());
        }
        self.flush_ctrl(conn);
        self.flush_data(conn);
    }

    fn flush_ctrl(&mut self, conn: u64) {
        loop {
            let Some(c) = self.conns.get_mut(&conn) else { return };
            if c.ctrl_tx.is_empty() || !c.ctrl_ready.wr || c.state == State::Connecting {
                break;
            }
            self.iov.clear();
            let mut skip = c.ctrl_off;
            let mut total = 0;
            for f in c.ctrl_tx.iter().take(GATHER_MAX) {
                for (p, l) in [(f.hdr.as_ptr(), HEADER_LEN), (f.payload.ptr(), f.payload.len())] {
                    if skip >= l {
                        skip -= l;
                        continue;
                    }
                    // SAFETY: skip < l, so the pointer stays inside the part.
                    self.iov.push(iov(unsafe { p.add(skip) }, l - skip));
                    total += l - skip;
                    skip = 0;
                }
            }
            let sent = match sendmsg(c.ctrl.as_raw_fd(), &mut self.iov) {
                Ok(n) => {
                    self.stats.tx_sends += 1;
                    n
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    c.ctrl_ready.wr = false;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let e = self.lost(conn, "sending control frames", Some(e));
                    return self.fail(conn, e);
                }
            };
            if sent < total {
                // A short send filled the socket buffer: wait for the next writable edge.
                c.ctrl_ready.wr = false;
            }
            let mut n = sent + c.ctrl_off;
            while let Some(f) = c.ctrl_tx.front() {
                let len = HEADER_LEN + f.payload.len();
                if n < len {
                    break;
                }
                n -= len;
                let f = c.ctrl_tx.pop_front().expect("front");
                if let Some(req) = f.req {
                    c.outstanding = c.outstanding.saturating_sub(1);
                    self.stats.tx_payload_bytes += f.payload.len() as u64;
                    self.events.push_back(Event::SendDone {
                        conn: ConnId(conn),
                        req,
                        bytes: f.payload.len(),
                    });
                }
            }
            c.ctrl_off = n;
        }
        self.check_close_done(conn);
    }

    fn flush_data(&mut self, conn: u64) {
        loop {
            let Some(c) = self.conns.get_mut(&conn) else { return };
            if c.data_connecting || !c.data_ready.wr {
                return;
            }
            let Some(d) = c.data.as_ref() else { return };
            let fd = d.as_raw_fd();
            self.iov.clear();
            let mut total = 0;
            let attaching = c.attach.is_some();
            if let Some((a, off)) = &c.attach {
                self.iov.push(iov(a[*off..].as_ptr(), a.len() - off));
            } else {
                if c.data_tx.is_empty() || !matches!(c.state, State::Ready | State::Closing) {
                    return;
                }
                let mut skip = c.data_off;
                for w in c.data_tx.iter().take(GATHER_MAX) {
                    for (p, l) in [(w.hdr.as_ptr(), HEADER_LEN), (w.src.ptr() as *const u8, w.src.len())] {
                        if skip >= l {
                            skip -= l;
                            continue;
                        }
                        // SAFETY: skip < l, so the pointer stays inside the part.
                        self.iov.push(iov(unsafe { p.add(skip) }, l - skip));
                        total += l - skip;
                        skip = 0;
                    }
                }
            }
            let sent = match sendmsg(fd, &mut self.iov) {
                Ok(n) => {
                    self.stats.tx_sends += 1;
                    n
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    c.data_ready.wr = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let e = self.lost(conn, "sending writes", Some(e));
                    return self.fail(conn, e);
                }
            };
            if !attaching && sent < total {
                // A short send filled the socket buffer: wait for the next writable edge.
                c.data_ready.wr = false;
            }
            if attaching {
                let (a, off) = c.attach.as_mut().expect("attaching");
                *off += sent;
                if *off == a.len() {
                    c.attach = None;
                }
                continue;
            }
            let mut n = sent + c.data_off;
            let now = Instant::now();
            while let Some(w) = c.data_tx.front() {
                let len = HEADER_LEN + w.src.len();
                if n < len {
                    break;
                }
                n -= len;
                let w = c.data_tx.pop_front().expect("front");
                self.stats.tx_payload_bytes += w.src.len() as u64;
                c.awaiting_ack.push_back(AwaitAck::new(w, now));
            }
            c.data_off = n;
        }
    }
}
