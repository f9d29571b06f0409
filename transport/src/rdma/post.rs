//! Posting (transmit): operations queue per connection within the
//! outstanding bound, and are posted in one doorbell per connection within the
//! send-queue depth and the peer's receive credits; and the credit writes that
//! return receive credits to the peer. Nothing here allocates in steady state:
//! the lists it works through are the transport's, reused.

use sideway::ibverbs::queue_pair::{
    PostSendError, PostSendGuard, QueuePair, SetInlineData, SetScatterGatherEntry, WorkRequestFlags,
};

use crate::api::{check_write, ConnId, ReqId};
use crate::error::{Error, Result};
use crate::memory::{InFlight, RemoteRegion, Slice};

use super::error::{io_of, verbs};
use super::state::{wr_id, Conn, Op, OpKind, State, Wr, KIND_CREDIT, KIND_META, KIND_SEND};
use super::wire::{self, Notice, NOTICE_LEN};
use super::RdmaTransport;

impl RdmaTransport {
    /// Posts a one-sided RDMA READ of `dst.len()` bytes from `src` at
    /// `src_offset` into the local slice `dst`; `Event::ReadDone` follows.
    pub fn read(&mut self, conn: ConnId, dst: &Slice, src: &RemoteRegion, src_offset: u64) -> Result<ReqId> {
        check_write(dst, src, src_offset, self.props.max_write_bytes).map_err(|e| match e {
            Error::OutOfBounds {
                region,
                offset,
                len,
                region_len,
                ..
            } => Error::OutOfBounds {
                op: "read",
                region,
                offset,
                len,
                region_len,
            },
            o => o,
        })?;
        let lkey = self.lkey_of(dst, "read")?;
        self.verify_remote(conn, src, "read")?;
        let wr = Wr::Read {
            lkey,
            addr: dst.ptr() as u64,
            len: dst.len() as u32,
            rkey: src.rkey,
            raddr: src.addr + src_offset,
        };
        self.enqueue(conn, "read", OpKind::Read, dst, wr)
    }

    pub(super) fn verify_remote(&self, conn: ConnId, dst: &RemoteRegion, op: &'static str) -> Result<()> {
        if !self.cfg.verify_descriptors {
            return Ok(());
        }
        let c = self
            .conns
            .get(&conn.0)
            .ok_or(Error::UnknownConnection { op, conn: conn.0 })?;
        match c.remote.iter().find(|r| r.rkey == dst.rkey) {
            Some(r) if r.generation == dst.generation && r.addr == dst.addr && r.len == dst.len => Ok(()),
            Some(r) if r.generation == dst.generation => Err(Error::OutOfBounds {
                op,
                region: dst.rkey,
                offset: dst.addr.wrapping_sub(r.addr),
                len: dst.len,
                region_len: r.len,
            }),
            _ => Err(Error::UnknownRegion {
                op,
                region: dst.rkey,
                generation: dst.generation,
            }),
        }
    }

    pub(super) fn enqueue(
        &mut self,
        conn: ConnId,
        op: &'static str,
        kind: OpKind,
        src: &Slice,
        wr: Wr,
    ) -> Result<ReqId> {
        let max_out = self.cfg.control.max_outstanding;
        let c = self
            .conns
            .get_mut(&conn.0)
            .ok_or(Error::UnknownConnection { op, conn: conn.0 })?;
        match c.state {
            State::Ready => {}
            State::Handshake | State::Exchange | State::AwaitReady => {
                return Err(Error::NotConnected { op, conn: conn.0 })
            }
            State::Closing | State::Dead => return Err(Error::UnknownConnection { op, conn: conn.0 }),
        }
        if c.outstanding() >= max_out {
            return Err(Error::WouldBlock {
                op,
                conn: conn.0,
                limit: max_out,
            });
        }
        let req = ReqId(self.next_req);
        self.next_req += 1;
        let seq = c.next_seq;
        c.next_seq += 1;
        let o = Op {
            seq,
            req,
            kind,
            bytes: src.len(),
            wrs: wr.work_requests(),
            _guard: InFlight::new(src.region()),
        };
        c.pending.push_back((o, wr));
        Ok(req)
    }

    /// Posts queued work, in one doorbell per connection.
    pub(super) fn post_pending(&mut self) {
        let mut ids = std::mem::take(&mut self.post_ids);
        ids.clear();
        self.credit_stalled = false;
        ids.extend(
            self.conns
                .values()
                .filter(|c| !c.pending.is_empty() && matches!(c.state, State::Ready | State::Closing))
                .map(|c| c.id),
        );
        for &id in &ids {
            if let Err(e) = self.post_conn(id) {
                self.fail_conn(id, e, None);
            }
        }
        self.post_ids = ids;
    }

    pub(super) fn post_conn(&mut self, id: u64) -> Result<()> {
        let mut batch = std::mem::take(&mut self.post_batch);
        let r = self.post_conn_batch(id, &mut batch);
        batch.clear();
        self.post_batch = batch;
        r
    }

    /// [`post_conn`](Self::post_conn) with the transport's reused batch list (empty).
    fn post_conn_batch(&mut self, id: u64, batch: &mut Vec<(Op, Wr)>) -> Result<()> {
        let tx_depth = self.cfg.tx_depth;
        let signal_every = self.cfg.signal_every;
        let max_inline = self.cfg.max_inline_bytes;
        let rx_depth = self.cfg.rx_depth;
        let c = self.conns.get_mut(&id).expect("listed");
        let Some(info) = c.peer_info else { return Ok(()) };
        let rx_depth_peer = info.rx_depth as u64;
        if let Err(violation) = c.refresh_credits(rx_depth) {
            return Err(Error::Protocol {
                conn: id,
                peer: c.peer_name(),
                violation,
            });
        }
        if take_fitting(c, tx_depth, batch) {
            self.stats.credit_stalls += 1;
            self.credit_stalled = true;
        }
        if batch.is_empty() {
            return Ok(());
        }
        let ring = (info.ring_rkey, info.ring_addr, rx_depth_peer);
        let (posted, sent) = post_batch(c, id, batch, signal_every, max_inline, ring);
        self.stats.doorbells += 1;
        match posted {
            Ok(()) => {
                self.stats.work_requests += sent.wrs;
                self.stats.signalled += sent.signalled;
                self.stats.tx_inline_payload_bytes += sent.inline_bytes;
                self.stats.tx_payload_bytes += sent.payload - sent.inline_bytes;
                let c = self.conns.get_mut(&id).expect("listed");
                c.wrs_in_flight += sent.wrs as u32;
                c.inflight.extend(batch.drain(..).map(|(o, _)| o));
                Ok(())
            }
            Err(e) => {
                let c = self.conns.get_mut(&id).expect("listed");
                for (o, wr) in batch.drain(..).rev() {
                    if wr.consumes_receive() {
                        c.credits += 1;
                    }
                    c.pending.push_front((o, wr));
                }
                Err(verbs("ibv_wr_complete (post send)", &self.dev.name, io_of(e)))
            }
        }
    }

    /// Returns receive credits: for each connection with receives reposted since
    /// the last return, one inline RDMA WRITE (signalled, one send-queue slot) of
    /// the cumulative count into the credit word at the end of the peer's
    /// notification ring. RC places it after the reposts, which happened first.
    /// Without send-queue room now, the credits wait for the next progress step.
    pub(super) fn return_credits(&mut self) {
        let tx_depth = self.cfg.tx_depth;
        // Allocates only when a post fails.
        let mut failed = Vec::new();
        for c in self.conns.values_mut() {
            // Posting needs the queue pair at RTS: from AwaitReady on.
            if c.credit_return == 0
                || c.wrs_in_flight >= tx_depth
                || !matches!(c.state, State::AwaitReady | State::Ready | State::Closing)
            {
                continue;
            }
            let (Some(info), Some(qp)) = (c.peer_info, c.qp.as_mut()) else {
                continue;
            };
            let total = c.credits_returned.wrapping_add(c.credit_return);
            let word = wire::encode_credit_word(total);
            let mut g = qp.start_post_send();
            // IBV_SEND_INLINE as well as ibv_wr_set_inline_data, as for notices (rxe reads the flag).
            let h = g
                .construct_wr(
                    wr_id(c.id, KIND_CREDIT, 0),
                    WorkRequestFlags::Signaled | WorkRequestFlags::Inline,
                )
                .setup_write(
                    info.ring_rkey,
                    info.ring_addr + wire::credit_word_offset(info.rx_depth) as u64,
                );
            h.setup_inline_data(&word);
            match g.post() {
                Ok(()) => {
                    c.credits_returned = total;
                    c.credit_return = 0;
                    c.wrs_in_flight += 1;
                    self.stats.credit_writes += 1;
                }
                Err(e) => failed.push((c.id, verbs("ibv_wr_complete (credit write)", &self.dev.name, io_of(e)))),
            }
        }
        for (id, e) in failed {
            self.fail_conn(id, e, None);
        }
    }
}

/// Builds `wr`, op `op` of connection `id`, into the post's list `g` with
/// `flags` (signalled or not): sends and writes up to `max_inline` bytes go
/// inline, and a write with an immediate is preceded by its notice, written
/// inline into slot `notices_sent` (counted) of the peer's ring `(rkey,
/// address, slots)`. Returns the bytes sent inline.
fn build_wr<G: PostSendGuard>(
    g: &mut G,
    id: u64,
    (op, wr): (&Op, &Wr),
    flags: WorkRequestFlags,
    max_inline: u32,
    ring: (u32, u64, u64),
    notices_sent: &mut u64,
) -> u64 {
    let id_send = wr_id(id, KIND_SEND, op.seq);
    let mut inline_bytes = 0u64;
    match wr {
        Wr::Send { lkey, addr, len, tag } => {
            let inline = *len <= max_inline;
            let h = g.construct_wr(id_send, with_inline(flags, inline)).setup_send_imm(*tag);
            if inline {
                // SAFETY: addr..addr+len lies in a registered region kept alive by the op's guard.
                let bytes = unsafe { std::slice::from_raw_parts(*addr as *const u8, *len as usize) };
                h.setup_inline_data(bytes);
                inline_bytes += *len as u64;
            } else {
                // SAFETY: the sge lies in a registered region the op's guard keeps alive
                // until the completion.
                unsafe { h.setup_sge(*lkey, *addr, *len) };
            }
        }
        Wr::Write {
            lkey,
            addr,
            len,
            rkey,
            raddr,
            imm,
        } => {
            if let Some((imm, notice)) = imm {
                build_notice(g, id, op.seq, notice, ring, notices_sent);
                let h = g.construct_wr(id_send, flags).setup_write_imm(*rkey, *raddr, *imm);
                // SAFETY: as for sends.
                unsafe { h.setup_sge(*lkey, *addr, *len) };
            } else {
                let inline = *len <= max_inline;
                let h = g
                    .construct_wr(id_send, with_inline(flags, inline))
                    .setup_write(*rkey, *raddr);
                if inline {
                    // SAFETY: as for inline sends.
                    let b = unsafe { std::slice::from_raw_parts(*addr as *const u8, *len as usize) };
                    h.setup_inline_data(b);
                    inline_bytes += *len as u64;
                } else {
                    // SAFETY: as for sends.
                    unsafe { h.setup_sge(*lkey, *addr, *len) };
                }
            }
        }
        Wr::Read {
            lkey,
            addr,
            len,
            rkey,
            raddr,
        } => {
            let h = g.construct_wr(id_send, flags).setup_read(*rkey, *raddr);
            // SAFETY: the destination lies in a registered region the op's guard keeps alive.
            unsafe { h.setup_sge(*lkey, *addr, *len) };
        }
    }
    inline_bytes
}

/// `flags`, with `Inline` added when the payload goes inline.
fn with_inline(flags: WorkRequestFlags, inline: bool) -> WorkRequestFlags {
    if inline {
        flags | WorkRequestFlags::Inline
    } else {
        flags
    }
}

/// Builds the notice of op `seq` (a write with an immediate) of connection
/// `id` into the post's list `g`: written inline into slot `notices_sent`
/// (counted) of the peer's ring `(rkey, address, slots)`.
fn build_notice<G: PostSendGuard>(
    g: &mut G,
    id: u64,
    seq: u64,
    notice: &Notice,
    ring: (u32, u64, u64),
    notices_sent: &mut u64,
) {
    let slot = *notices_sent % ring.2;
    *notices_sent += 1;
    let bytes = notice.encode();
    // IBV_SEND_INLINE as well as ibv_wr_set_inline_data: rxe's kernel side
    // reads the flag to know the data is inline (LOC_QP_OP_ERR without it).
    let h = g
        .construct_wr(wr_id(id, KIND_META, seq), WorkRequestFlags::Inline)
        .setup_write(ring.0, ring.1 + slot * NOTICE_LEN as u64);
    h.setup_inline_data(&bytes);
}

/// Totals of one posted batch, for the stats.
#[derive(Default)]
struct Posted {
    wrs: u64,
    signalled: u64,
    inline_bytes: u64,
    payload: u64,
}

/// Moves to `batch` what of connection `c`'s pending ops fits, in order: room
/// in the send queue (`tx_depth` deep) and a receive credit for each op that
/// consumes a receive. True when it stopped for want of a credit.
fn take_fitting(c: &mut Conn, tx_depth: u32, batch: &mut Vec<(Op, Wr)>) -> bool {
    let mut room = tx_depth - c.wrs_in_flight;
    while let Some((_, wr)) = c.pending.front() {
        let need = wr.work_requests();
        if need > room {
            break;
        }
        if wr.consumes_receive() {
            if c.credits == 0 {
                return true;
            }
            c.credits -= 1;
        }
        room -= need;
        batch.push(c.pending.pop_front().expect("front exists"));
    }
    false
}

/// Builds `batch` (non-empty), ops of connection `c` (`id`), into one post on
/// its queue pair and rings the doorbell: every `signal_every` work requests,
/// and the batch's last, are signalled; see [`build_wr`] for `max_inline` and
/// `ring`. Returns the post's answer and the batch's totals.
fn post_batch(
    c: &mut Conn,
    id: u64,
    batch: &[(Op, Wr)],
    signal_every: u32,
    max_inline: u32,
    ring: (u32, u64, u64),
) -> (std::result::Result<(), PostSendError>, Posted) {
    let qp = c.qp.as_mut().expect("ready connections have a queue pair");
    let mut g = qp.start_post_send();
    let n = batch.len();
    let mut sent = Posted::default();
    for (i, (op, wr)) in batch.iter().enumerate() {
        c.since_signal += op.wrs;
        let signal = i + 1 == n || c.since_signal >= signal_every;
        let flags = if signal {
            c.since_signal = 0;
            sent.signalled += 1;
            WorkRequestFlags::Signaled
        } else {
            WorkRequestFlags::none()
        };
        sent.inline_bytes += build_wr(&mut g, id, (op, wr), flags, max_inline, ring, &mut c.notices_sent);
        sent.wrs += op.wrs as u64;
        sent.payload += op.bytes as u64;
    }
    (g.post(), sent)
}
