//! Raw RC queue pairs for perftest-style microbenchmarks (`tidewire-perf`).
//!
//! perftest's peers (`ib_write_bw`, `ib_send_lat`, ...) exchange queue-pair
//! numbers, PSNs, GIDs, rkeys and buffer addresses over their own TCP socket
//! and then run bare verbs: no control plane, no notices, no credits. To
//! interoperate with them, and to measure what the verbs path can do with
//! nothing on top, this module exposes exactly that, safely:
//!
//! - one protection domain, one completion queue, `qps` RC queue pairs on it;
//! - one registered buffer, split per queue pair into a *source* half (what
//!   this side writes, sends or reads into) and a *target* half (what the peer
//!   writes into or reads from: [`RawEndpoint::local`] advertises it);
//! - work requests are posted in batches, one `ibv_wr_start` ... `ibv_wr_complete`
//!   per call, through the same `ibv_wr_*` posting path [`super::RdmaTransport`]
//!   uses, and completions come from `ibv_poll_cq`.
//!
//! The queue-pair attributes follow perftest's (timeout 14, retry_cnt 7,
//! rnr_retry 7, min_rnr_timer 12, hop limit 64), so either side may be perftest.
//!
//! Every local address is an offset checked against the buffer; remote
//! addresses and keys are checked by the devices, which answer a bad one with
//! an error completion (IBV_WC_REM_ACCESS_ERR), never with memory corruption here.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionQueue, GenericCompletionQueue};
use sideway::ibverbs::device_context::{LinkLayer, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetInlineData,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::device::{self, DeviceChoice};
use super::{io_of, mtu_code, mtu_from_bytes, mtu_of_code, verbs};
use crate::error::{Error, Result};
use crate::memory::{page_size, PinOptions, PinnedBuffer};

/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// What a [`RawEndpoint`] opens.
#[derive(Debug, Clone)]
pub struct RawConfig {
    /// Device, port and GID index; automatic by default.
    pub device: DeviceChoice,
    /// Number of RC queue pairs (perftest `-q`).
    pub qps: usize,
    /// Bytes of each half (source and target) per queue pair; rounded up to the page size.
    pub half_bytes: usize,
    /// Send queue depth (perftest `-t`).
    pub tx_depth: u32,
    /// Receive queue depth (perftest's rx depth for send tests).
    pub rx_depth: u32,
    /// Largest inline payload (perftest `-I`); 0 disables inlining.
    pub max_inline: u32,
    /// Path MTU in bytes; `None` takes the port's active MTU.
    pub mtu: Option<u32>,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout per try).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            device: DeviceChoice::default(),
            qps: 1,
            half_bytes: 65536,
            tx_depth: 128,
            rx_depth: 512,
            max_inline: 0,
            mtu: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
        }
    }
}

/// One side's queue-pair description, as perftest exchanges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawDest {
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Outstanding RDMA reads this side accepts as a responder.
    pub out_reads: u32,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Remote key of the target memory.
    pub rkey: u32,
    /// Address of the target memory.
    pub vaddr: u64,
    /// GID (all zero when unused).
    pub gid: [u8; 16],
    /// Shared receive queue number (0: none).
    pub srqn: u32,
}

/// The operation of a [`RawWr`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawOp {
    /// RDMA WRITE.
    Write,
    /// RDMA WRITE with an immediate (consumes a receive at the peer).
    WriteImm(u32),
    /// RDMA READ of the remote range into the local one.
    Read,
    /// SEND.
    Send,
}

/// A send-queue work request over a local range of the endpoint's buffer.
#[derive(Debug, Clone, Copy)]
pub struct RawWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: RawOp,
    /// Offset of the local range in the buffer.
    pub local: usize,
    /// Length in bytes.
    pub len: u32,
    /// Remote address (writes and reads).
    pub remote: u64,
    /// Remote key (writes and reads).
    pub rkey: u32,
    /// Ask for a completion.
    pub signaled: bool,
    /// Copy the payload into the work request (up to `max_inline`).
    pub inline: bool,
}

/// One work completion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawWc {
    /// The work request's id.
    pub wr_id: u64,
    /// IBV_WC_* status (0 = success).
    pub status: u32,
    /// Vendor error.
    pub vendor_err: u32,
    /// IBV_WC_* opcode (valid on success; receives are 128 and up).
    pub opcode: u32,
    /// Received bytes (receives).
    pub byte_len: u32,
    /// Immediate data (receives of WRITE_WITH_IMM or SEND_WITH_IMM).
    pub imm: u32,
}

/// Bare RC queue pairs over one registered buffer; see the module docs.
pub struct RawEndpoint {
    // Field order is drop order: queue pairs, then the MR, the buffer, the CQ, the PD, the device.
    qps: Vec<ExtendedQueuePair>,
    connected: Vec<bool>,
    psns: Vec<u32>,
    mr: Arc<MemoryRegion>,
    buf: PinnedBuffer,
    /// Reused work-completion array for `ibv_poll_cq` (no allocation per poll).
    wc_buf: Vec<rdma_mummy_sys::ibv_wc>,
    cq: Arc<BasicCompletionQueue>,
    _pd: Arc<ProtectionDomain>,
    dev: device::Selected,
    mtu: Mtu,
    out_reads: u32,
    half: usize,
    cfg: RawConfig,
}

impl std::fmt::Debug for RawEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawEndpoint")
            .field("device", &self.dev.name)
            .field("port", &self.dev.port)
            .field("qps", &self.qps.len())
            .field("half_bytes", &self.half)
            .finish()
    }
}

/// Checks `cfg`'s queue-pair count, depths and MTU, and sizes the buffer: one
/// half rounded up to whole pages, and the whole buffer (two halves per queue
/// pair), in bytes.
fn check_sizes(cfg: &RawConfig) -> Result<(usize, usize)> {
    let bad = |reason: String| Error::InvalidArgument {
        op: "RawEndpoint::open",
        reason,
    };
    if cfg.qps == 0 || cfg.qps > 1024 {
        return Err(bad(format!("{} queue pairs: give 1 to 1024", cfg.qps)));
    }
    if cfg.tx_depth == 0 || cfg.rx_depth == 0 {
        return Err(bad("tx_depth and rx_depth must be at least 1".into()));
    }
    if let Some(m) = cfg.mtu {
        if mtu_from_bytes(m).is_none() {
            return Err(bad(format!("MTU {m}: give 256, 512, 1024, 2048 or 4096")));
        }
    }
    let page = page_size();
    let half = cfg.half_bytes.max(1).div_ceil(page) * page;
    let total = half
        .checked_mul(2 * cfg.qps)
        .filter(|&t| t <= 1 << 40)
        .ok_or_else(|| bad(format!("{} queue pairs x 2 x {half} bytes overflows", cfg.qps)))?;
    Ok((half, total))
}

/// Creates `cfg.qps` RC queue pairs on `pd`, sending and receiving on `cq`,
/// each moved to INIT on the device's port, and a random 24-bit starting PSN
/// for each.
fn init_qps(
    cfg: &RawConfig,
    dev: &device::Selected,
    pd: &Arc<ProtectionDomain>,
    cq: &Arc<BasicCompletionQueue>,
) -> Result<(Vec<ExtendedQueuePair>, Vec<u32>)> {
    let name = &dev.name;
    let mut qps = Vec::with_capacity(cfg.qps);
    let mut psns = Vec::with_capacity(cfg.qps);
    for _ in 0..cfg.qps {
        let mut qb = pd.create_qp_builder();
        let gcq = GenericCompletionQueue::from(Arc::clone(cq));
        qb.setup_send_cq(gcq.clone())
            .setup_recv_cq(gcq)
            .setup_max_send_wr(cfg.tx_depth)
            .setup_max_recv_wr(cfg.rx_depth)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(cfg.max_inline);
        let mut qp = qb.build_ex().map_err(|e| verbs("ibv_create_qp_ex", name, io_of(e)))?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead);
        qp.modify(&a)
            .map_err(|e| verbs("ibv_modify_qp(INIT)", name, io_of(e)))?;
        qps.push(qp);
        psns.push(crate::auth::random_u32() & 0xff_ffff);
    }
    Ok((qps, psns))
}

impl RawEndpoint {
    /// Opens the device, registers the buffer and creates the queue pairs (state INIT).
    pub fn open(cfg: RawConfig) -> Result<Self> {
        let (half, total) = check_sizes(&cfg)?;
        let dev = device::select(&cfg.device)?;
        let name = dev.name.clone();
        let out_reads = dev
            .ctx
            .query_device()
            .map(|a| a.max_qp_rd_atom().clamp(1, 255) as u32)
            .unwrap_or(16);
        let pd = dev.ctx.alloc_pd().map_err(|e| verbs("ibv_alloc_pd", &name, io_of(e)))?;
        let mut b = dev.ctx.create_cq_builder();
        let cqe = (cfg.tx_depth + cfg.rx_depth)
            .saturating_mul(cfg.qps as u32)
            .clamp(64, 65536);
        b.setup_cqe(cqe);
        let cq = b.build().map_err(|e| verbs("ibv_create_cq", &name, io_of(e)))?;
        let buf = PinnedBuffer::with_options(
            total,
            PinOptions {
                lock: false,
                ..Default::default()
            },
        )?;
        // SAFETY: `buf` is owned by the endpoint next to the MR, and the endpoint drops
        // its queue pairs and then the MR before the buffer (field order), so the
        // device never touches freed memory.
        let mr = unsafe {
            pd.reg_mr(
                buf.as_ptr() as usize,
                buf.len(),
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            )
        }
        .map_err(|e| verbs("ibv_reg_mr", &name, io_of(e)))?;
        let mtu = match cfg.mtu {
            Some(m) => mtu_from_bytes(m).expect("checked in check_sizes"),
            None => dev.active_mtu,
        };
        let (qps, psns) = init_qps(&cfg, &dev, &pd, &cq)?;
        Ok(RawEndpoint {
            connected: vec![false; qps.len()],
            qps,
            psns,
            mr,
            buf,
            wc_buf: Vec::with_capacity(POLL_BATCH),
            cq,
            _pd: pd,
            dev,
            mtu,
            out_reads,
            half,
            cfg,
        })
    }

    /// Device name, port and GID index in use.
    pub fn device(&self) -> (&str, u8, u32) {
        (&self.dev.name, self.dev.port, self.dev.gid_index)
    }

    /// Whether the port's link layer is Ethernet (RoCE): GIDs are then required.
    pub fn is_ethernet(&self) -> bool {
        self.dev.link != LinkLayer::InfiniBand
    }

    /// The MTU this side asks for, as the verbs code (1 = 256 ... 5 = 4096).
    pub fn mtu_code(&self) -> u8 {
        mtu_code(self.mtu)
    }

    /// Bytes of each half per queue pair (after rounding).
    pub fn half_bytes(&self) -> usize {
        self.half
    }

    /// Offset of queue pair `qp`'s source half in the buffer.
    pub fn source_offset(&self, qp: usize) -> usize {
        qp * 2 * self.half
    }

    /// Offset of queue pair `qp`'s target half (what [`RawEndpoint::local`] advertises).
    pub fn target_offset(&self, qp: usize) -> usize {
        qp * 2 * self.half + self.half
    }

    /// This side's description of queue pair `qp`, to send to the peer.
    pub fn local(&self, qp: usize) -> RawDest {
        let gid = if self.is_ethernet() || self.dev.gid.raw != [0; 16] {
            self.dev.gid.raw
        } else {
            [0; 16]
        };
        RawDest {
            lid: self.dev.lid,
            out_reads: self.out_reads,
            qpn: self.qps[qp].qp_number(),
            psn: self.psns[qp],
            rkey: self.mr.rkey(),
            vaddr: self.buf.as_ptr() as u64 + self.target_offset(qp) as u64,
            gid,
            srqn: 0,
        }
    }

    /// The largest number of outstanding RDMA reads a responder may be asked for (device limit).
    pub fn max_out_reads(&self) -> u32 {
        self.out_reads
    }

    /// Moves queue pair `qp` to RTR and RTS against `remote`, at the smaller of the two MTUs.
    pub fn connect(&mut self, qp: usize, remote: &RawDest, peer_mtu_code: u8) -> Result<()> {
        let name = self.dev.name.clone();
        let mtu = if (1..=5).contains(&peer_mtu_code) && peer_mtu_code < mtu_code(self.mtu) {
            mtu_of_code(peer_mtu_code)
        } else {
            self.mtu
        };
        let q = self.qps.get_mut(qp).ok_or_else(|| Error::InvalidArgument {
            op: "RawEndpoint::connect",
            reason: format!("no queue pair {qp}"),
        })?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(remote.qpn & 0xff_ffff)
            .setup_rq_psn(remote.psn & 0xff_ffff)
            .setup_max_dest_read_atomic(self.out_reads.min(255) as u8)
            .setup_min_rnr_timer(self.cfg.min_rnr_timer);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(self.dev.port)
            .setup_service_level(0);
        if self.dev.link != LinkLayer::InfiniBand || remote.gid != [0; 16] {
            ah.setup_grh_src_gid_index(self.dev.gid_index as u8)
                .setup_grh_dest_gid(&Gid { raw: remote.gid })
                .setup_grh_hop_limit(64);
        }
        a.setup_address_vector(&ah);
        q.modify(&a).map_err(|e| verbs("ibv_modify_qp(RTR)", &name, io_of(e)))?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psns[qp])
            .setup_timeout(self.cfg.timeout)
            .setup_retry_cnt(self.cfg.retry_cnt)
            .setup_rnr_retry(self.cfg.rnr_retry)
            .setup_max_read_atomic(remote.out_reads.clamp(1, self.out_reads).min(255) as u8);
        q.modify(&a).map_err(|e| verbs("ibv_modify_qp(RTS)", &name, io_of(e)))?;
        self.connected[qp] = true;
        Ok(())
    }

    fn check_local(&self, op: &'static str, off: usize, len: usize) -> Result<()> {
        match off.checked_add(len) {
            Some(end) if end <= self.buf.len() => Ok(()),
            _ => Err(Error::OutOfBounds {
                op,
                region: 0,
                offset: off as u64,
                len: len as u64,
                region_len: self.buf.len() as u64,
            }),
        }
    }

    fn check_qp(&self, op: &'static str, qp: usize) -> Result<()> {
        match self.connected.get(qp) {
            Some(true) => Ok(()),
            Some(false) => Err(Error::NotConnected { op, conn: qp as u64 }),
            None => Err(Error::InvalidArgument {
                op,
                reason: format!("no queue pair {qp}"),
            }),
        }
    }

    /// Posts `wrs` on queue pair `qp` with one doorbell. Local ranges are checked
    /// first; nothing is posted if one is out of bounds or too large to inline.
    pub fn post_send(&mut self, qp: usize, wrs: &[RawWr]) -> Result<()> {
        self.check_qp("post_send", qp)?;
        for w in wrs {
            self.check_local("post_send", w.local, w.len as usize)?;
            if w.inline && w.len > self.cfg.max_inline {
                return Err(Error::TooLarge {
                    op: "post_send (inline)",
                    len: w.len as u64,
                    max: self.cfg.max_inline as u64,
                });
            }
        }
        let base = self.buf.as_ptr() as u64;
        let lkey = self.mr.lkey();
        let q = &mut self.qps[qp];
        let mut g = q.start_post_send();
        for w in wrs {
            let mut flags = if w.signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            if w.inline {
                // rxe reads IBV_SEND_INLINE as well as ibv_wr_set_inline_data.
                flags |= WorkRequestFlags::Inline;
            }
            let h = g.construct_wr(w.wr_id, flags);
            let h = match w.op {
                RawOp::Write => h.setup_write(w.rkey, w.remote),
                RawOp::WriteImm(imm) => h.setup_write_imm(w.rkey, w.remote, imm),
                RawOp::Read => h.setup_read(w.rkey, w.remote),
                RawOp::Send => h.setup_send(),
            };
            if w.inline {
                // SAFETY: local..local+len was checked against the buffer above, which the
                // endpoint owns; the bytes are copied into the work request here.
                let b = unsafe { std::slice::from_raw_parts((base + w.local as u64) as *const u8, w.len as usize) };
                h.setup_inline_data(b);
            } else {
                // SAFETY: the range was checked against the registered buffer, which outlives
                // the queue pairs (field order), so the device reads or writes only memory
                // the endpoint owns.
                unsafe { h.setup_sge(lkey, base + w.local as u64, w.len) };
            }
        }
        g.post()
            .map_err(|e| verbs("ibv_wr_complete (post send)", &self.dev.name, io_of(e)))
    }

    /// Posts receives on queue pair `qp`: `(wr_id, offset, len)` each, one call.
    pub fn post_recv(&mut self, qp: usize, wrs: &[(u64, usize, u32)]) -> Result<()> {
        if qp >= self.qps.len() {
            return Err(Error::InvalidArgument {
                op: "post_recv",
                reason: format!("no queue pair {qp}"),
            });
        }
        for &(_, off, len) in wrs {
            self.check_local("post_recv", off, len as usize)?;
        }
        let base = self.buf.as_ptr() as u64;
        let lkey = self.mr.lkey();
        let mut g = self.qps[qp].start_post_recv();
        for &(id, off, len) in wrs {
            let h = g.construct_wr(id);
            // SAFETY: checked against the registered buffer, which outlives the queue pairs.
            unsafe { h.setup_sge(lkey, base + off as u64, len) };
        }
        g.post().map_err(|e| verbs("ibv_post_recv", &self.dev.name, io_of(e)))
    }

    /// Polls the completion queue once (up to 32 completions), appending to `out`.
    /// One `ibv_poll_cq` into a reused array: nothing is allocated per poll.
    pub fn poll(&mut self, out: &mut Vec<RawWc>) -> Result<usize> {
        self.wc_buf.clear();
        // SAFETY: the CQ outlives this call (the endpoint owns it), and the array has room
        // for POLL_BATCH entries, which is all ibv_poll_cq may write.
        let n =
            unsafe { rdma_mummy_sys::ibv_poll_cq(self.cq.cq().as_ptr(), POLL_BATCH as i32, self.wc_buf.as_mut_ptr()) };
        if n < 0 {
            return Err(verbs(
                "ibv_poll_cq",
                &self.dev.name,
                std::io::Error::from_raw_os_error(-n),
            ));
        }
        // SAFETY: ibv_poll_cq initialized the first n entries (0 <= n <= POLL_BATCH).
        unsafe { self.wc_buf.set_len(n as usize) };
        for wc in &self.wc_buf {
            let ok = wc.status == 0;
            // SAFETY: a union of two u32s, so any bits are valid; imm_data is the member the
            // verbs fill for receives with an immediate (raw, as sideway passes it when posting).
            let imm = unsafe { wc.imm_data_invalidated_rkey_union.imm_data };
            out.push(RawWc {
                wr_id: wc.wr_id,
                status: wc.status,
                vendor_err: wc.vendor_err,
                opcode: if ok { wc.opcode } else { 0 },
                byte_len: if ok { wc.byte_len } else { 0 },
                imm: if ok { imm } else { 0 },
            });
        }
        Ok(n as usize)
    }

    /// The buffer's length in bytes.
    pub fn buffer_len(&self) -> usize {
        self.buf.len()
    }

    fn cell(&self, off: usize) -> &AtomicU8 {
        assert!(
            off < self.buf.len(),
            "offset {off} outside the {}-byte buffer",
            self.buf.len()
        );
        // SAFETY: the offset is inside the buffer the endpoint owns, and AtomicU8 has the
        // layout of u8; the device writes these bytes by DMA, which atomics tolerate.
        unsafe { &*(self.buf.as_ptr().add(off) as *const AtomicU8) }
    }

    /// Reads one byte the peer may be writing (acquire: what it wrote before is visible).
    pub fn load_byte(&self, off: usize) -> u8 {
        self.cell(off).load(Ordering::Acquire)
    }

    /// Stores one byte of the buffer (release).
    pub fn store_byte(&self, off: usize, v: u8) {
        self.cell(off).store(v, Ordering::Release)
    }

    /// Fills a range of the buffer with `byte`.
    pub fn fill(&self, off: usize, len: usize, byte: u8) -> Result<()> {
        self.check_local("fill", off, len)?;
        for i in off..off + len {
            self.cell(i).store(byte, Ordering::Relaxed);
        }
        std::sync::atomic::fence(Ordering::Release);
        Ok(())
    }

    /// Copies a range of the buffer out.
    pub fn read_at(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.check_local("read_at", off, dst.len())?;
        std::sync::atomic::fence(Ordering::Acquire);
        for (i, d) in dst.iter_mut().enumerate() {
            *d = self.cell(off + i).load(Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_perftest() {
        let c = RawConfig::default();
        assert_eq!((c.timeout, c.retry_cnt, c.rnr_retry, c.min_rnr_timer), (14, 7, 7, 12));
        assert_eq!((c.tx_depth, c.rx_depth, c.qps), (128, 512, 1));
    }

    #[test]
    fn bad_configs_are_refused_before_any_device_call() {
        let e = RawEndpoint::open(RawConfig {
            qps: 0,
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("0 queue pairs"), "{e}");
        let e = RawEndpoint::open(RawConfig {
            mtu: Some(1500),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("MTU 1500"), "{e}");
    }
}
