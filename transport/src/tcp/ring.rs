//! The [`TcpTransport`] itself: the ring and everything it owns, the op table
//! that names every submitted SQE, submission, completion dispatch, and the
//! drop that drains the ring before the memory it references goes away.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use tracing::{debug, info, warn};

use crate::api::{Event, Properties, WakeFd};
use crate::conn_core::{self, RegionTable};
use crate::error::{Error, Result};
use crate::frame;

use super::config::{TcpConfig, TcpStats};
use super::op::{Op, Pool, USER_DATA_NONE};
use super::state::{Acks, Conn, Listener, Pending};
use super::sys::{self, errno, BufRing, SockOpts};

/// Slots of the io_uring fixed-buffer table (regions registered for SEND_ZC).
const FIXED_SLOTS: u32 = 1024;
/// Completions reaped per batch.
const CQE_BATCH: usize = 256;

/// The io_uring TCP transport. See the module docs.
pub struct TcpTransport {
    // Field order matters for drop: the ring goes before the memory it references.
    pub(super) ring: IoUring,
    pub(super) bufring: BufRing,
    pub(super) cfg: TcpConfig,
    pub(super) props: Properties,
    pub(super) ops: Vec<Option<Op>>,
    pub(super) free_ops: Vec<usize>,
    pub(super) live_ops: usize,
    pub(super) listeners: HashMap<u64, Listener>,
    pub(super) pending: HashMap<u64, Pending>,
    pub(super) conns: HashMap<u64, Conn>,
    pub(super) tokens: HashMap<u64, u64>,
    pub(super) regions: RegionTable,
    pub(super) fixed_free: Vec<u16>,
    pub(super) fixed_ok: bool,
    pub(super) events: VecDeque<Event>,
    pub(super) next_id: u64,
    pub(super) next_req: u64,
    pub(super) stats: TcpStats,
    pub(super) sockopts: SockOpts,
    /// Connections with something to send, each at most once.
    pub(super) dirty: Vec<u64>,
    /// Op slots reserved for the live connections made ready.
    pub(super) ops_budget: usize,
    /// `dirty` while `flush` walks it (the two are swapped, keeping both capacities).
    pub(super) flushing: Vec<u64>,
    /// Recycled memory of finished sends.
    pub(super) pool: Pool,
    /// One batch of completions (user data, result, flags), reused.
    pub(super) cqes: Vec<(u64, i32, u32)>,
    /// The [`Waker`](crate::Waker)'s eventfd and flag; a poll of it is always armed.
    pub(super) wake: Arc<WakeFd>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("rank", &self.cfg.rank)
            .field("conns", &self.conns.len())
            .field("regions", &self.regions.len())
            .field("live_ops", &self.live_ops)
            .finish()
    }
}

/// Bytes `ctrl_rx` reserves when a connection becomes ready: a steady-state
/// control frame (an Ack or a Close: a header and a few bytes) with room to
/// spare. The rare frames (a Nack and its reason, a Regions list after a
/// registration) may grow it; they are failures or set-up, not the hot path.
const STEADY_CTRL_FRAME: usize = crate::frame::HEADER_LEN + 64;

impl TcpTransport {
    /// Sets up the ring, the provided-buffer ring and the fixed-buffer table.
    ///
    /// Fails with [`Error::UringUnavailable`] (saying why) where io_uring is
    /// disabled (`kernel.io_uring_disabled`, seccomp) or too old.
    pub fn new(cfg: TcpConfig) -> Result<Self> {
        conn_core::check_max_message(&cfg, "TcpTransport::new")?;
        let max_buf = (frame::PRE_AUTH_MAX_BYTES / 2) as u32;
        if !cfg.recv_buffers.is_power_of_two() || !(4096..=max_buf).contains(&cfg.recv_buffer_bytes) {
            return Err(Error::InvalidArgument {
                op: "TcpTransport::new",
                reason: format!("recv_buffers must be a power of two and recv_buffer_bytes in 4096..={max_buf}"),
            });
        }
        conn_core::check_max_outstanding(&cfg, "TcpTransport::new")?;
        let ring = IoUring::builder()
            .setup_cqsize(cfg.ring_entries * 4)
            .build(cfg.ring_entries)
            .map_err(|e| Error::UringUnavailable {
                reason: format!(
                    "io_uring_setup failed ({e}); check /proc/sys/kernel/io_uring_disabled and any seccomp profile"
                ),
                source: Some(e),
            })?;
        let bufring = BufRing::new(&ring, cfg.recv_buffers, cfg.recv_buffer_bytes, 0)?;
        let fixed_ok = match ring.submitter().register_buffers_sparse(FIXED_SLOTS) {
            Ok(()) => true,
            Err(e) => {
                debug!(error = %e, "no io_uring fixed-buffer table; SEND_ZC will use plain buffers");
                false
            }
        };
        let props = conn_core::properties(&cfg, "tcp-io_uring");
        let sockopts = conn_core::sockopts(&cfg);
        let wake = WakeFd::new()?;
        info!(rank = cfg.rank, "io_uring TCP transport ready");
        let mut t = TcpTransport {
            ring,
            bufring,
            cfg,
            props,
            ops: Vec::new(),
            free_ops: Vec::new(),
            live_ops: 0,
            listeners: HashMap::new(),
            pending: HashMap::new(),
            conns: HashMap::new(),
            tokens: HashMap::new(),
            regions: RegionTable::default(),
            fixed_free: (0..FIXED_SLOTS as u16).rev().collect(),
            fixed_ok,
            events: VecDeque::new(),
            next_id: 1,
            next_req: 1,
            stats: TcpStats::default(),
            sockopts,
            dirty: Vec::new(),
            flushing: Vec::new(),
            ops_budget: 0,
            pool: Pool::default(),
            cqes: Vec::with_capacity(CQE_BATCH),
            wake,
        };
        t.arm_wake();
        Ok(t)
    }

    /// Data-path counters.
    pub fn stats(&self) -> TcpStats {
        self.stats
    }

    /// Sets the SEND_ZC threshold (`None`: never). Regions registered while it
    /// was `None` have no fixed-buffer slot: their SEND_ZCs use plain buffers.
    pub fn set_send_zc_min_bytes(&mut self, v: Option<usize>) {
        self.cfg.send_zc_min_bytes = v;
    }

    /// The io_uring file descriptor: readable when completions are waiting. The
    /// RDMA backend sleeps on it together with its completion channel.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn ring_fd(&self) -> std::os::fd::RawFd {
        self.ring.as_raw_fd()
    }

    pub(super) fn id(&mut self) -> u64 {
        let i = self.next_id;
        self.next_id += 1;
        i
    }

    // ---------------------------------------------------------------- op table

    pub(super) fn add_op(&mut self, op: Op) -> u64 {
        if let Some(c) = op.conn() {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.ops += 1;
            }
        }
        if let Op::FirstHeader { pending, .. } | Op::FirstPayload { pending, .. } = &op {
            if let Some(p) = self.pending.get_mut(pending) {
                p.ops += 1;
            }
        }
        self.live_ops += 1;
        match self.free_ops.pop() {
            Some(i) => {
                self.ops[i] = Some(op);
                i as u64
            }
            None => {
                self.ops.push(Some(op));
                // `take_op` frees into `free_ops`: room for every slot, so it never grows there.
                self.free_ops
                    .reserve(self.ops.len().saturating_sub(self.free_ops.len()));
                (self.ops.len() - 1) as u64
            }
        }
    }

    /// Marks a connection as having something to send (once per flush).
    pub(super) fn mark_dirty(&mut self, conn: u64) {
        if !self.dirty.contains(&conn) {
            self.dirty.push(conn);
        }
    }

    /// A connection just became ready: reserve what its steady traffic can need
    /// at most (`max_outstanding` writes queued, in flight and awaiting their
    /// Acks, each with at most two ops: a SEND_ZC header and payload), so that
    /// the hot path never grows a table. Growth happens here, once per connection.
    pub(super) fn ops_per_conn(max_outstanding: usize) -> usize {
        debug_assert!(max_outstanding > 0, "a connection allows at least one transmit");
        2 * max_outstanding + 8
    }

    pub(super) fn reserve_for_ready(&mut self, conn: u64) {
        let n = self.cfg.max_outstanding;
        let Some(c) = self.conns.get_mut(&conn).filter(|c| !c.reserved) else {
            return;
        };
        c.data_tx.reserve(n);
        c.awaiting_ack.reserve(n);
        c.ctrl_tx.reserve(2 * super::op::GATHER_PARTS);
        // A steady-state control frame (an Ack, a Close) split across two receives is assembled here: room for one, so that the
        // first split (a matter of timing, rare on a quiet machine) allocates nothing.
        c.ctrl_rx.reserve(STEADY_CTRL_FRAME.saturating_sub(c.ctrl_rx.len()));
        c.reserved = true;
        // Given back when the connection is reaped: the tables then grow only past
        // the most connections ever ready at once, not with every one ever made.
        self.ops_budget += Self::ops_per_conn(n);
        self.ops.reserve(self.ops_budget.saturating_sub(self.ops.len()));
        // Events wait for the next poll: at most one per op completion (sends and
        // writes done) plus what the peer's window lets it deliver, which the same
        // budget covers; how many pile up between polls is a matter of timing.
        self.events.reserve(self.ops_budget.saturating_sub(self.events.len()));
        self.free_ops
            .reserve(self.ops.capacity().saturating_sub(self.free_ops.len()));
        let live = self.conns.len();
        self.dirty.reserve(live.saturating_sub(self.dirty.len()));
        self.flushing.reserve(live.saturating_sub(self.flushing.len()));
    }

    pub(super) fn take_op(&mut self, ud: u64) -> Option<Op> {
        let op = self.ops.get_mut(ud as usize)?.take()?;
        self.free_ops.push(ud as usize);
        self.live_ops -= 1;
        if let Some(c) = op.conn() {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.ops -= 1;
            }
        }
        if let Op::FirstHeader { pending, .. } | Op::FirstPayload { pending, .. } = &op {
            if let Some(p) = self.pending.get_mut(pending) {
                p.ops -= 1;
            }
        }
        Some(op)
    }

    /// Asks the kernel to cancel the op in slot `ud`, which must hold a live
    /// op; its own completion (`-ECANCELED`, or its result if it finished
    /// first) still arrives and frees the slot as usual. The cancel is
    /// submitted at once (this ring has no SQ thread, so the kernel looks `ud`
    /// up during the submit): while this runs the slot still holds the op, even
    /// if its last completion is already waiting in the queue, whereas at the
    /// next flush the slot could belong to another op. Its completion is ignored.
    pub(super) fn cancel_op(&mut self, ud: u64) {
        debug_assert!(
            self.ops.get(ud as usize).is_some_and(Option::is_some),
            "cancel of free slot {ud}"
        );
        let e = opcode::AsyncCancel::new(ud).build().user_data(USER_DATA_NONE);
        // SAFETY: a cancel references no memory.
        unsafe { self.push(e) };
        if let Err(err) = self.ring.submit() {
            warn!(error = %err, "io_uring submit of a cancel failed");
        }
        self.stats.submits += 1;
    }

    /// Puts an op back in its slot (a multishot op that stays armed).
    pub(super) fn keep_op(&mut self, ud: u64, op: Op) {
        // The slot was freed by `take_op` for this very completion; nothing may have reused it.
        assert!(
            self.ops[ud as usize].is_none(),
            "op slot {ud} reused while its multishot op was live"
        );
        if let Some(pos) = self.free_ops.iter().rposition(|&i| i == ud as usize) {
            self.free_ops.swap_remove(pos);
        }
        if let Some(c) = op.conn() {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.ops += 1;
            }
        }
        self.live_ops += 1;
        self.ops[ud as usize] = Some(op);
    }

    /// Arms a one-shot poll of the waker's eventfd (see [`Op::Wake`]).
    pub(super) fn arm_wake(&mut self) {
        let fd = self.wake.fd();
        let ud = self.add_op(Op::Wake {
            _wake: Arc::clone(&self.wake),
        });
        let e = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .build()
            .user_data(ud);
        // SAFETY: a poll references no user memory; the op keeps the eventfd open.
        unsafe { self.push(e) };
    }

    /// Pushes an SQE.
    ///
    /// # Safety
    /// Every buffer the entry references must be owned by the op named by its
    /// user_data (or by `self`) and stay valid until that op's final completion.
    pub(super) unsafe fn push(&mut self, e: squeue::Entry) {
        loop {
            // SAFETY: forwarded from the caller's contract.
            if unsafe { self.ring.submission().push(&e) }.is_ok() {
                return;
            }
            if let Err(err) = self.ring.submit() {
                warn!(error = %err, "io_uring submit failed while the SQ was full");
            }
            self.stats.submits += 1;
        }
    }
    // ---------------------------------------------------------------- completions

    pub(super) fn reap_completions(&mut self) {
        // The batch list is taken and given back (completing an op needs `&mut self`).
        let mut batch = std::mem::take(&mut self.cqes);
        loop {
            batch.clear();
            batch.extend(
                self.ring
                    .completion()
                    .take(CQE_BATCH)
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            if batch.is_empty() {
                break;
            }
            for &(ud, res, flags) in &batch {
                if ud == USER_DATA_NONE {
                    continue;
                }
                self.complete(ud, res, flags);
            }
        }
        self.cqes = batch;
        self.bufring.publish();
    }

    pub(super) fn complete(&mut self, ud: u64, res: i32, flags: u32) {
        let Some(op) = self.take_op(ud) else {
            warn!(ud, res, "completion for an unknown op");
            return;
        };
        let conn_of = op.conn();
        let pending_of = match &op {
            Op::FirstHeader { pending, .. } | Op::FirstPayload { pending, .. } => Some(*pending),
            _ => None,
        };
        match op {
            Op::Parting { .. } => {}
            Op::Wake { .. } => {
                // Reset the doorbell before re-arming, or the poll would fire at once
                // again; the pending flag (taken by `wait`) says whether to return.
                self.wake.drain();
                if res != -libc::ECANCELED {
                    self.arm_wake();
                }
            }
            Op::Accept { listener } => self.on_accept(ud, listener, res, flags),
            Op::Connect { conn, data, .. } => self.on_connect(conn, data, res),
            Op::FirstHeader { pending, buf, got } => self.on_first_header(pending, res, buf, got),
            Op::FirstPayload { pending, hdr, buf, got } => self.on_first_payload(pending, res, hdr, buf, got),
            Op::CtrlRecv { conn } => self.on_ctrl_recv(ud, conn, res, flags),
            Op::CtrlSend { conn, frames, g } => {
                let total = g.total;
                self.pool.put_gather(g);
                self.on_ctrl_sent(conn, res, frames, total)
            }
            Op::DataSend { conn, writes, g } => {
                let total = g.total;
                self.pool.put_gather(g);
                self.on_data_sent(conn, res, writes, total)
            }
            Op::ZcHeader { conn, hdr } => {
                self.pool.put_hdr(hdr);
                if res < 0 && res != -libc::ECANCELED {
                    let e = self.lost(conn, "sending a write header", Some(errno(res)));
                    self.fail(conn, e);
                }
            }
            Op::ZcPayload {
                conn,
                write,
                got_result,
            } => self.on_zc(ud, conn, res, flags, write, got_result),
            Op::DataRecvStage { conn, stage } => self.on_data_stage(conn, res, stage),
            Op::DataRecvPayload { conn, hdr, len, _guard } => self.on_data_payload(conn, res, hdr, len),
            Op::DataDiscard {
                conn,
                hdr,
                remaining,
                reason,
                buf,
            } => self.on_discard(conn, res, hdr, remaining, reason, buf),
            Op::AttachSend { conn, .. } => {
                if res < 0 {
                    let e = self.lost(conn, "attaching the data socket", Some(errno(res)));
                    self.fail(conn, e);
                }
            }
        }
        if let Some(c) = conn_of {
            self.reap(c);
        }
        if let Some(p) = pending_of {
            self.reap_pending(p);
        }
    }

    /// One turn of the ring, sleeping up to `wait` for a completion; held Acks
    /// are sent lazily ([`Acks::Lazy`]) unless it sleeps.
    pub(super) fn progress(&mut self, wait: Option<Duration>) -> Result<()> {
        self.progress_with(wait, Acks::Lazy)
    }

    /// [`TcpTransport::progress`] with the Ack policy for when it does not
    /// sleep: [`Transport::poll`](crate::Transport::poll) sends them at once,
    /// since a caller that only polls never lets the ring sleep.
    pub(super) fn progress_with(&mut self, wait: Option<Duration>, acks: Acks) -> Result<()> {
        // Without `lazy_acks` every flush sends the pending Acks (see TcpConfig).
        let acks = if self.cfg.lazy_acks { acks } else { Acks::Send };
        self.check_deadlines();
        // Completions already in (a send that finished since the last turn) first:
        // a connection whose send completed can then send again in this flush,
        // and its Acks go with what the caller posted since.
        self.reap_completions();
        // Held Acks go out before the ring sleeps (see [`Acks`]).
        let may_block = wait.is_some() && self.events.is_empty();
        self.flush(if may_block { Acks::Send } else { acks });
        let block = wait.filter(|_| self.events.is_empty() && self.wake.may_sleep());
        let r = match block {
            Some(d) => {
                let ts = types::Timespec::from(d);
                let args = types::SubmitArgs::new().timespec(&ts);
                let r = self.ring.submitter().submit_with_args(1, &args);
                self.wake.woke();
                r
            }
            None => self.ring.submit(),
        };
        self.stats.submits += 1;
        match r {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                ) => {}
            Err(e) => {
                return Err(Error::Io {
                    op: "io_uring_enter",
                    peer: None,
                    source: e,
                })
            }
        }
        self.reap_completions();
        // The writes placed just now: by `acks` (see [`Acks`]).
        self.flush(acks);
        if !self.ring.submission().is_empty() {
            self.ring.submit().map_err(|e| Error::Io {
                op: "io_uring_enter",
                peer: None,
                source: e,
            })?;
            self.stats.submits += 1;
        }
        Ok(())
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        for c in self.conns.values() {
            for fd in [&c.ctrl, &c.data].into_iter().flatten() {
                sys::shutdown(fd, libc::SHUT_RDWR);
            }
        }
        for p in self.pending.values() {
            if let Some(fd) = &p.fd {
                sys::shutdown(fd, libc::SHUT_RDWR);
            }
        }
        for l in self.listeners.values() {
            sys::shutdown(&l.fd, libc::SHUT_RDWR);
        }
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data(USER_DATA_NONE);
        // SAFETY: a cancel references no memory.
        unsafe { self.push(cancel) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.live_ops > 0 && Instant::now() < deadline {
            let ts = types::Timespec::from(Duration::from_millis(10));
            let args = types::SubmitArgs::new().timespec(&ts);
            let _ = self.ring.submitter().submit_with_args(1, &args);
            let batch: Vec<(u64, u32)> = self.ring.completion().map(|c| (c.user_data(), c.flags())).collect();
            for (ud, flags) in batch {
                if ud == USER_DATA_NONE {
                    continue;
                }
                let multishot_more = cqueue::more(flags) && !cqueue::notif(flags);
                if let Some(op) = self.take_op(ud) {
                    let keep =
                        multishot_more || matches!(op, Op::ZcPayload { got_result: false, .. } if cqueue::more(flags));
                    if keep {
                        self.keep_op(ud, op);
                    }
                }
            }
        }
        if self.live_ops > 0 {
            // The kernel may still write into memory these ops own: leak it rather than free it.
            warn!(
                ops = self.live_ops,
                "io_uring ops did not drain at drop; leaking their buffers"
            );
            std::mem::forget(std::mem::take(&mut self.ops));
            let placeholder = self.regions.take_all();
            std::mem::forget(placeholder);
        }
    }
}
