//! The RDMA verbs backend (feature `rdma`): RC queue pairs over `sideway`, with
//! the authenticated io_uring TCP transport as its control plane.
//!
//! # Design
//! - **Control plane.** Every connection starts as an inner [`TcpTransport`]
//!   connection: the same handshake (job id, HMAC challenge, version) and the
//!   same refusals. Over it the two sides exchange QPN, PSN, GID/LID, MTU and
//!   the notification ring ([`wire::QpInfo`]), then READY, region descriptors,
//!   receive credits, and an ABORT reason when a side fails the connection.
//! - **Data plane.** One RC queue pair per connection on one shared completion
//!   queue. A one-sided [`Transport::write`] is an RDMA WRITE from the
//!   registered source straight into the peer's registered region: the host
//!   copies no payload on either side (see "Zero copy" below). With an
//!   immediate it is two work requests in one doorbell: a 32-byte notice
//!   (region, offset, length) written inline into the peer's notification ring,
//!   then the payload as WRITE_WITH_IMM carrying the caller's immediate. RC
//!   ordering places the notice and every earlier write before the immediate's
//!   receive completion, so `Event::WriteReceived` can name the region and range.
//! - **Messages** are SEND_WITH_IMM (the immediate is the tag) into receive
//!   buffers pre-posted per connection (`rx_depth` of `max_message_bytes`).
//!   Each receive is reposted as soon as it completes, and a sender never posts
//!   more receive-consuming operations (messages and writes with an immediate)
//!   than the receiver has posted: receive credits flow back over the control
//!   plane. So no operation ever meets an empty receive queue (no RNR stalls).
//! - **Posting.** Operations queue per connection and are posted at the next
//!   `poll`/`wait` in one batch (one `ibv_wr_start` ... `ibv_wr_complete`),
//!   signalled every `signal_every` work requests and at the end of each batch;
//!   work requests in flight never exceed `tx_depth`.
//! - **Completions.** Busy-polled, or event-driven through a completion channel
//!   ([`CqMode`]); `wait` first spins for `control.busy_poll`.
//!
//! # Zero copy
//! Sources and targets of writes, reads and messages are registered memory
//! regions (`ibv_reg_mr` over the [`PinnedBuffer`]); work requests carry their
//! addresses and keys, and the device moves the bytes. The only host copies are
//! of control data: the 32-byte notice (inline) and a received message's bytes,
//! which `Event::Message` hands over as a `Vec`. Payload inlining is off unless
//! [`RdmaConfig::max_inline_bytes`] allows it. [`RdmaStats`] counts both.
//!
//! # Failure
//! Every verbs error and every error completion becomes a typed [`Error`]
//! naming the operation and the peer. A failed queue pair fails its
//! connection: queued and in-flight operations end with `OpFailed`, then
//! `Closed { error }`. A vanished peer shows up as a dead control socket or as
//! IBV_WC_RETRY_EXC_ERR after `timeout` x `retry_cnt`, never as a hang.

mod cm;
pub mod device;
pub mod gpudirect;
pub mod raw;
pub(crate) mod wire;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue, GenericCompletionQueue};
use sideway::ibverbs::device_context::{LinkLayer, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetInlineData,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;
use tracing::{debug, info, warn};

use crate::api::{check_write, ConnId, Event, ListenerId, PeerInfo, Properties, ReqId, Transport};
use crate::error::{Error, Result, WC_REM_ACCESS_ERR, WC_WR_FLUSH_ERR};
use crate::frame;
use crate::memory::{Access, InFlight, MemoryKind, PinOptions, PinnedBuffer, Region, RemoteRegion, Slice};
use crate::tcp::{TcpConfig, TcpTransport};
pub use device::{rate_limit_of, DeviceChoice, DeviceInfoSummary, Dmabuf, GidInfo, PortInfo, RateLimit};
pub use gpudirect::{DeviceMemory, DevicePath, DeviceRegistration, DmabufHandle, StageChunk, VgemBuffer};
use wire::{Notice, QpInfo, NOTICE_LEN};

/// How completions are waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqMode {
    /// Spin on the completion queue for the whole of `wait` (lowest latency, one core).
    BusyPoll,
    /// Spin for `control.busy_poll`, then sleep on the completion channel and the
    /// control plane's ring.
    Event,
}

/// How an RC queue pair reaches RTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectMode {
    /// QPN, PSN, GID/LID and MTU travel over the authenticated TCP control plane,
    /// and each side moves its QP INIT -> RTR -> RTS itself (as `ibv_rc_pingpong`).
    ControlPlane,
    /// rdma_cm resolves the route from the peer's IP address and supplies the
    /// RTR/RTS attributes (as perftest's `-R`); the CM listens on the TCP
    /// listener's port number in the RDMA port space. The control plane still
    /// authenticates and carries the rest.
    RdmaCm,
}

/// Configuration of an [`RdmaTransport`].
///
/// The queue-pair defaults follow perftest's: `timeout` 14 (4.096 µs x 2^14 =
/// 67 ms per try), `retry_cnt` 7, `rnr_retry` 7, `min_rnr_timer` 12 (0.64 ms),
/// and the port's active MTU (at most 4096).
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// The control plane: job id, rank, secret, handshake and peer timeouts, and
    /// `max_outstanding` (requests per connection before `WouldBlock`).
    pub control: TcpConfig,
    /// Device, port and GID.
    pub device: DeviceChoice,
    /// Path MTU in bytes (256..4096); `None` takes the port's active MTU.
    pub mtu: Option<u32>,
    /// Local ACK timeout exponent (4.096 µs x 2^timeout), 1..=31.
    pub timeout: u8,
    /// Transport retries before IBV_WC_RETRY_EXC_ERR, 0..=7.
    pub retry_cnt: u8,
    /// RNR retries, 0..=7 (7 = infinite). Credits keep receivers ahead anyway.
    pub rnr_retry: u8,
    /// RNR NAK timer code (12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Send work requests in flight per queue pair.
    pub tx_depth: u32,
    /// Receives posted per connection (the peer's send credits).
    pub rx_depth: u32,
    /// Signal one send work request in this many (and the last of each batch).
    pub signal_every: u32,
    /// Largest message (receive buffer size).
    pub max_message_bytes: usize,
    /// Payloads up to this size are copied into the work request (IBV_SEND_INLINE).
    /// 0 (the default) keeps every payload zero-copy.
    pub max_inline_bytes: u32,
    /// Completion queue entries shared by all connections.
    pub cq_entries: u32,
    /// Busy-poll or event-driven completions.
    pub cq_mode: CqMode,
    /// How queue pairs are brought up: by the control-plane exchange (default) or
    /// through rdma_cm (`TIDEWIRE_RDMA_CM=1`, like perftest's `-R`).
    pub connect: ConnectMode,
    /// Refuse writes to descriptors the peer has not announced (stale or forged)
    /// before they reach the device. Off, the target's device is the only check,
    /// and a refused write fails the connection (IBV_WC_REM_ACCESS_ERR).
    pub verify_descriptors: bool,
}

impl RdmaConfig {
    /// Defaults for a job; the device is chosen automatically.
    pub fn new(control: TcpConfig) -> Self {
        RdmaConfig {
            control,
            device: DeviceChoice::default(),
            mtu: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            tx_depth: 128,
            rx_depth: 64,
            signal_every: 16,
            max_message_bytes: 64 * 1024,
            max_inline_bytes: 0,
            cq_entries: 16384,
            cq_mode: CqMode::Event,
            connect: ConnectMode::ControlPlane,
            verify_descriptors: true,
        }
    }

    /// Applies `TIDEWIRE_RDMA_DEVICE`, `_PORT`, `_GID_INDEX` and `TIDEWIRE_RDMA_CQ=busy|event`.
    pub fn from_env(mut self) -> Result<Self> {
        self.device = self.device.from_env()?;
        match std::env::var("TIDEWIRE_RDMA_CM").ok().as_deref() {
            None | Some("") | Some("0") => {}
            Some("1") => self.connect = ConnectMode::RdmaCm,
            Some(o) => {
                return Err(Error::InvalidArgument {
                    op: "TIDEWIRE_RDMA_CM",
                    reason: format!("{o:?}: use 1 (rdma_cm) or 0 (control plane)"),
                })
            }
        }
        match std::env::var("TIDEWIRE_RDMA_CQ").ok().as_deref() {
            None | Some("") => {}
            Some("busy") => self.cq_mode = CqMode::BusyPoll,
            Some("event") => self.cq_mode = CqMode::Event,
            Some(o) => {
                return Err(Error::InvalidArgument {
                    op: "TIDEWIRE_RDMA_CQ",
                    reason: format!("{o:?}: use busy or event"),
                })
            }
        }
        Ok(self)
    }

    fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "RdmaConfig",
                reason,
            })
        };
        if let Some(m) = self.mtu {
            if mtu_from_bytes(m).is_none() {
                return bad(format!("mtu {m}: use 256, 512, 1024, 2048 or 4096"));
            }
        }
        if !(1..=31).contains(&self.timeout) || self.retry_cnt > 7 || self.rnr_retry > 7 || self.min_rnr_timer > 31 {
            return bad("timeout must be 1..=31, retry_cnt and rnr_retry 0..=7, min_rnr_timer 0..=31".into());
        }
        if self.tx_depth < 2 || self.rx_depth < 2 || self.signal_every == 0 || self.signal_every > self.tx_depth {
            return bad("tx_depth and rx_depth must be at least 2, signal_every 1..=tx_depth".into());
        }
        if self.max_message_bytes == 0 || self.max_message_bytes > frame::MAX_MESSAGE_BYTES as usize {
            return bad(format!("max_message_bytes must be 1..={}", frame::MAX_MESSAGE_BYTES));
        }
        if self.control.max_outstanding == 0 {
            return bad("control.max_outstanding must be at least 1".into());
        }
        Ok(())
    }
}

fn mtu_from_bytes(b: u32) -> Option<Mtu> {
    Some(match b {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => return None,
    })
}

fn mtu_code(m: Mtu) -> u8 {
    match m {
        Mtu::Mtu256 => 1,
        Mtu::Mtu512 => 2,
        Mtu::Mtu1024 => 3,
        Mtu::Mtu2048 => 4,
        Mtu::Mtu4096 => 5,
    }
}

fn mtu_of_code(c: u8) -> Mtu {
    match c {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// Counters of the RDMA data path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RdmaStats {
    /// Payload bytes the device moved from registered memory (writes, reads, sends).
    pub tx_payload_bytes: u64,
    /// Payload bytes copied by the CPU into work requests (inline). 0 unless
    /// `max_inline_bytes` is set.
    pub tx_inline_payload_bytes: u64,
    /// Bytes of received messages copied out of the receive buffers into `Event::Message`.
    pub rx_message_copy_bytes: u64,
    /// Payload bytes of peers' writes with an immediate that landed here (no host copy).
    pub rx_write_bytes: u64,
    /// Doorbells (`ibv_wr_complete` calls) and the work requests they posted.
    pub doorbells: u64,
    pub work_requests: u64,
    /// Signalled work requests.
    pub signalled: u64,
    /// Times a receive-consuming post waited for the peer's credits.
    pub credit_stalls: u64,
}

// ---------------------------------------------------------------- internals

const KIND_SEND: u64 = 0;
const KIND_RECV: u64 = 1;
const KIND_META: u64 = 2;
const SEQ_BITS: u32 = 38;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
const CTRL_CELL: usize = 4096;
const CTRL_CELLS: usize = 256;
/// A target whose queue pair failed waits this long for the writer's ABORT, which says why.
const ABORT_GRACE: Duration = Duration::from_millis(300);

fn wr_id(conn: u64, kind: u64, seq: u64) -> u64 {
    (conn << (SEQ_BITS + 2)) | (kind << SEQ_BITS) | (seq & SEQ_MASK)
}

fn split_wr_id(id: u64) -> (u64, u64, u64) {
    (id >> (SEQ_BITS + 2), (id >> SEQ_BITS) & 3, id & SEQ_MASK)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Send,
    Write,
    Read,
}

#[derive(Debug)]
enum Wr {
    Send {
        lkey: u32,
        addr: u64,
        len: u32,
        tag: u32,
    },
    Write {
        lkey: u32,
        addr: u64,
        len: u32,
        rkey: u32,
        raddr: u64,
        imm: Option<(u32, Notice)>,
    },
    Read {
        lkey: u32,
        addr: u64,
        len: u32,
        rkey: u32,
        raddr: u64,
    },
}

impl Wr {
    fn consumes_receive(&self) -> bool {
        matches!(self, Wr::Send { .. } | Wr::Write { imm: Some(_), .. })
    }
    fn work_requests(&self) -> u32 {
        match self {
            Wr::Write { imm: Some(_), .. } => 2,
            _ => 1,
        }
    }
}

#[derive(Debug)]
struct Op {
    seq: u64,
    req: ReqId,
    kind: OpKind,
    bytes: usize,
    wrs: u32,
    _guard: InFlight,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The control plane is authenticating.
    Handshake,
    /// Queue pair created, our QP info sent; waiting for the peer's.
    Exchange,
    /// Ready to send; waiting for the peer's READY.
    AwaitReady,
    Ready,
    /// Local close: draining queued and in-flight work.
    Closing,
    /// Failed or closed; events were emitted.
    Dead,
}

struct Conn {
    id: u64,
    state: State,
    inbound: Option<ListenerId>,
    peer: Option<PeerInfo>,
    qp: Option<ExtendedQueuePair>,
    psn: u32,
    /// Receive buffers (rx_depth x max_message) and the notification ring.
    rx_buf: Option<(PinnedBuffer, Arc<MemoryRegion>)>,
    ring: Option<(PinnedBuffer, Arc<MemoryRegion>)>,
    peer_info: Option<QpInfo>,
    peer_ready: bool,
    announced: bool,
    /// Receive-consuming posts the peer still has room for.
    credits: u32,
    /// Receives reposted since credits were last returned.
    credit_return: u32,
    notices_sent: u64,
    notices_seen: u64,
    next_seq: u64,
    pending: VecDeque<(Op, Wr)>,
    inflight: VecDeque<Op>,
    wrs_in_flight: u32,
    since_signal: u32,
    remote: Vec<RemoteRegion>,
    /// The queue pair failed on our side (flush at the target, say); wait for the
    /// peer's ABORT until the instant, then fail with this error.
    qp_failed: Option<(Error, Instant)>,
    /// Connected or Incoming was emitted: the user knows this connection.
    ready_event_sent: bool,
    /// A local close finished flushing and closed the control connection.
    close_sent: bool,
    /// The peer's first region list arrived (it follows READY on the control plane).
    regions_seen: bool,
    /// Arrivals (messages, writes) that beat READY or the region list here over the
    /// other channel: delivered right after Connected/Incoming, in order.
    early: Vec<Event>,
    /// When the queue-pair exchange (from authentication to Ready) or a local
    /// close (flushing) must be done by; past it the connection fails.
    deadline: Option<Instant>,
    /// The rdma_cm identifier of this connection (ConnectMode::RdmaCm).
    cm_id: Option<std::sync::Arc<sideway::rdmacm::communication_manager::Identifier>>,
}

impl Conn {
    fn new(id: u64, inbound: Option<ListenerId>) -> Self {
        Conn {
            id,
            state: State::Handshake,
            inbound,
            peer: None,
            qp: None,
            psn: crate::auth::random_u32() & 0xff_ffff,
            rx_buf: None,
            ring: None,
            peer_info: None,
            peer_ready: false,
            announced: false,
            credits: 0,
            credit_return: 0,
            notices_sent: 0,
            notices_seen: 0,
            next_seq: 0,
            pending: VecDeque::new(),
            inflight: VecDeque::new(),
            wrs_in_flight: 0,
            since_signal: 0,
            remote: Vec::new(),
            qp_failed: None,
            ready_event_sent: false,
            close_sent: false,
            regions_seen: false,
            early: Vec::new(),
            deadline: None,
            cm_id: None,
        }
    }

    fn outstanding(&self) -> usize {
        self.pending.len() + self.inflight.len()
    }

    fn peer_name(&self) -> String {
        match self.peer {
            Some(p) => format!("rank {} ({})", p.rank, p.addr),
            None => format!("connection {}", self.id),
        }
    }
}

/// A registered region and its memory region; the MR is deregistered before the
/// transport lets go of the memory (field order is drop order).
struct Registered {
    mr: Arc<MemoryRegion>,
    region: Region,
}

/// A device-memory region registered by dmabuf ([`RdmaTransport::reg_dmabuf`]).
/// The host cannot read it; peers write into it through [`DmabufRegion::remote`].
#[derive(Debug)]
pub struct DmabufRegion {
    mr: Arc<MemoryRegion>,
    iova: u64,
    len: u64,
}

impl DmabufRegion {
    /// The descriptor peers write with (address = the iova given at registration).
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.iova,
            len: self.len,
            rkey: self.mr.rkey(),
            generation: 0,
        }
    }
    /// The local key, for work requests that read from it.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
}

/// The RDMA verbs transport; see the module docs.
pub struct RdmaTransport {
    // Field order is drop order: queue pairs before the memory regions they
    // use, before the CQ, the PD and the device context.
    conns: HashMap<u64, Conn>,
    regions: HashMap<u32, Registered>,
    ctrl_cells: Vec<usize>,
    ctrl_inflight: HashMap<ReqId, usize>,
    ctrl_backlog: VecDeque<(u64, u32, Vec<u8>)>,
    ctrl: Region,
    inner: TcpTransport,
    cq: Arc<BasicCompletionQueue>,
    channel: Option<Arc<CompletionChannel>>,
    armed: bool,
    pd: Arc<ProtectionDomain>,
    dev: device::Selected,
    mtu: Mtu,
    cfg: RdmaConfig,
    props: Properties,
    events: VecDeque<Event>,
    accepted: HashMap<u64, VecDeque<(ConnId, PeerInfo)>>,
    next_req: u64,
    generation: u32,
    dmabuf: Option<Dmabuf>,
    stats: RdmaStats,
    /// rdma_cm state, in [`ConnectMode::RdmaCm`].
    cm: Option<cm::Cm>,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("device", &self.dev.name)
            .field("port", &self.dev.port)
            .field("gid_index", &self.dev.gid_index)
            .field("connections", &self.conns.len())
            .field("regions", &self.regions.len())
            .finish()
    }
}

fn verbs(op: &'static str, device: &str, source: std::io::Error) -> Error {
    Error::Verbs {
        op,
        device: device.to_string(),
        source,
    }
}

pub(crate) fn io_of<E: std::error::Error + 'static>(e: E) -> std::io::Error {
    // sideway errors wrap an io::Error as their source; keep its errno when there is one.
    let mut src: Option<&dyn std::error::Error> = Some(&e);
    while let Some(s) = src {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if let Some(code) = io.raw_os_error() {
                return std::io::Error::from_raw_os_error(code);
            }
        }
        src = s.source();
    }
    // No errno: keep every message of the chain.
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    std::io::Error::other(msg)
}

impl RdmaTransport {
    /// Opens the device, allocates the protection domain and completion queue,
    /// and starts the control plane. Fails with [`Error::RdmaUnavailable`] when
    /// libibverbs, a device or an ACTIVE port is missing.
    pub fn new(cfg: RdmaConfig) -> Result<Self> {
        cfg.validate()?;
        let dev = device::select(&cfg.device)?;
        let name = dev.name.clone();
        let pd = dev.ctx.alloc_pd().map_err(|e| verbs("ibv_alloc_pd", &name, io_of(e)))?;
        let channel = match cfg.cq_mode {
            CqMode::Event => {
                let ch = dev
                    .ctx
                    .create_comp_channel()
                    .map_err(|e| verbs("ibv_create_comp_channel", &name, io_of(e)))?;
                ch.set_nonblocking(true)
                    .map_err(|e| verbs("fcntl(O_NONBLOCK) on the completion channel", &name, e))?;
                Some(ch)
            }
            CqMode::BusyPoll => None,
        };
        let mut b = dev.ctx.create_cq_builder();
        b.setup_cqe(cfg.cq_entries);
        if let Some(ch) = &channel {
            b.setup_comp_channel(ch, 0);
        }
        // A basic CQ (ibv_poll_cq): the ibv_start_poll/ibv_next_poll/ibv_end_poll
        // batch of Debian 12's rxe provider advances its consumer index twice when a
        // batch ends on an empty queue, which loses completions and re-reads stale
        // ones (seen here as a duplicated message); ibv_poll_cq has no such state.
        let cq = b.build().map_err(|e| verbs("ibv_create_cq", &name, io_of(e)))?;
        let mtu = match cfg.mtu {
            Some(m) => mtu_from_bytes(m).expect("validated"),
            None => dev.active_mtu,
        };
        let cm = match cfg.connect {
            ConnectMode::ControlPlane => None,
            ConnectMode::RdmaCm => Some(cm::Cm::new(&name)?),
        };
        let inner = TcpTransport::new(cfg.control.clone())?;
        let mut inner = inner;
        let ctrl = inner.register(
            PinnedBuffer::with_options(
                CTRL_CELL * CTRL_CELLS,
                PinOptions {
                    lock: false,
                    ..Default::default()
                },
            )?,
            Access::LOCAL,
        )?;
        let max_write = dev.max_msg_sz.min(1 << 30) as usize;
        let props = Properties {
            name: format!("rdma-verbs ({} port {} gid {})", dev.name, dev.port, dev.gid_index),
            speed_mbps: None,
            memory_kinds: vec![MemoryKind::Host, MemoryKind::DmaBuf],
            max_message_bytes: cfg.max_message_bytes,
            max_write_bytes: max_write,
            one_sided: true,
            max_outstanding: cfg.control.max_outstanding,
        };
        info!(
            device = %dev.name, port = dev.port, gid_index = dev.gid_index, gid = %dev.gid,
            mtu = device::mtu_bytes(mtu), "RDMA transport ready"
        );
        Ok(RdmaTransport {
            conns: HashMap::new(),
            regions: HashMap::new(),
            ctrl_cells: (0..CTRL_CELLS).rev().collect(),
            ctrl_inflight: HashMap::new(),
            ctrl_backlog: VecDeque::new(),
            ctrl,
            inner,
            cq,
            channel,
            armed: false,
            pd,
            dev,
            mtu,
            cfg,
            props,
            events: VecDeque::new(),
            accepted: HashMap::new(),
            next_req: 1,
            generation: 1,
            dmabuf: None,
            stats: RdmaStats::default(),
            cm,
        })
    }

    /// The device, port and GID index in use.
    pub fn device(&self) -> (&str, u8, u32) {
        (&self.dev.name, self.dev.port, self.dev.gid_index)
    }

    /// The path MTU in bytes.
    pub fn mtu_bytes(&self) -> u32 {
        device::mtu_bytes(self.mtu)
    }

    /// Data-path counters.
    pub fn stats(&self) -> RdmaStats {
        self.stats
    }

    /// Whether this device registers dmabuf memory (probed once, NCCL's way).
    pub fn dmabuf_support(&mut self) -> Dmabuf {
        if self.dmabuf.is_none() {
            self.dmabuf = Some(device::probe_dmabuf(&self.pd));
        }
        self.dmabuf.clone().expect("set above")
    }

    /// Registers device memory exported as a dmabuf (`ibv_reg_dmabuf_mr`), for
    /// GPUDirect RDMA. Arguments are checked first; a device without dmabuf
    /// support answers [`Error::DmabufUnsupported`], and the caller stages
    /// through pinned host memory instead.
    pub fn reg_dmabuf(&mut self, fd: i32, offset: u64, len: usize, iova: u64) -> Result<DmabufRegion> {
        validate_dmabuf_args(fd, offset, len, iova)?;
        if let Dmabuf::Unsupported(reason) = self.dmabuf_support() {
            return Err(Error::DmabufUnsupported {
                device: self.dev.name.clone(),
                reason,
            });
        }
        // SAFETY: the arguments were validated; the caller's fd names a dmabuf whose
        // range the exporter keeps alive while the returned region (which owns the MR)
        // lives; the device reads and writes it only through work requests.
        let mr = unsafe {
            self.pd.reg_dmabuf_mr(
                offset,
                len,
                iova,
                fd,
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            )
        }
        .map_err(|e| verbs("ibv_reg_dmabuf_mr", &self.dev.name, io_of(e)))?;
        Ok(DmabufRegion {
            mr,
            iova,
            len: len as u64,
        })
    }

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

    /// Testing aid: destroys this side's queue pair of `conn` while its control
    /// connection stays up, as a crashed NIC or a dead host would look to the peer.
    #[doc(hidden)]
    pub fn debug_drop_qp(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn.0) {
            c.qp = None;
            c.state = State::Dead;
        }
    }

    fn lkey_of(&self, s: &Slice, op: &'static str) -> Result<u32> {
        let r = s.region();
        match self.regions.get(&r.key()) {
            Some(reg) if reg.region.same(r) && r.is_registered() => Ok(reg.mr.lkey()),
            _ => Err(Error::UnknownRegion {
                op,
                region: r.key(),
                generation: r.generation(),
            }),
        }
    }

    fn verify_remote(&self, conn: ConnId, dst: &RemoteRegion, op: &'static str) -> Result<()> {
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

    fn enqueue(&mut self, conn: ConnId, op: &'static str, kind: OpKind, src: &Slice, wr: Wr) -> Result<ReqId> {
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

    fn ctrl_send(&mut self, conn: u64, tag: u32, data: Vec<u8>) {
        self.ctrl_backlog.push_back((conn, tag, data));
        self.flush_ctrl();
    }

    fn flush_ctrl(&mut self) {
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

    fn announce_all(&mut self, conn: u64) {
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

    fn broadcast_regions(&mut self, r: RemoteRegion, revoke: bool) {
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

    /// Creates the queue pair (RESET -> INIT), posts the receives, and sends our QP info.
    fn start_qp(&mut self, id: u64) -> Result<()> {
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
    fn connect_qp(&mut self, id: u64, peer: QpInfo) -> Result<()> {
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
    fn ready_to_send(&mut self, id: u64) {
        self.conns.get_mut(&id).expect("known").state = State::AwaitReady;
        self.ctrl_send(id, wire::TAG_READY, Vec::new());
        self.conns.get_mut(&id).expect("known").announced = true;
        self.announce_all(id);
        self.maybe_ready(id);
    }

    fn maybe_ready(&mut self, id: u64) {
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
    fn fail_conn(&mut self, id: u64, error: Error, culprit: Option<(u64, Error)>) {
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

    /// Posts queued work, in one doorbell per connection.
    fn post_pending(&mut self) {
        let ids: Vec<u64> = self
            .conns
            .values()
            .filter(|c| !c.pending.is_empty() && matches!(c.state, State::Ready | State::Closing))
            .map(|c| c.id)
            .collect();
        for id in ids {
            if let Err(e) = self.post_conn(id) {
                self.fail_conn(id, e, None);
            }
        }
    }

    fn post_conn(&mut self, id: u64) -> Result<()> {
        let tx_depth = self.cfg.tx_depth;
        let signal_every = self.cfg.signal_every;
        let max_inline = self.cfg.max_inline_bytes;
        let c = self.conns.get_mut(&id).expect("listed");
        let Some(info) = c.peer_info else { return Ok(()) };
        let rx_depth_peer = info.rx_depth as u64;
        // Take what fits: send-queue room and receive credits.
        let mut batch: Vec<(Op, Wr)> = Vec::new();
        let mut room = tx_depth - c.wrs_in_flight;
        let mut stalled = false;
        while let Some((_, wr)) = c.pending.front() {
            let need = wr.work_requests();
            if need > room {
                break;
            }
            if wr.consumes_receive() {
                if c.credits == 0 {
                    stalled = true;
                    break;
                }
                c.credits -= 1;
            }
            room -= need;
            batch.push(c.pending.pop_front().expect("front exists"));
        }
        if stalled {
            self.stats.credit_stalls += 1;
        }
        if batch.is_empty() {
            return Ok(());
        }
        let qp = c.qp.as_mut().expect("ready connections have a queue pair");
        let mut g = qp.start_post_send();
        let n = batch.len();
        let mut wrs = 0u64;
        let mut signalled = 0u64;
        let mut inline_bytes = 0u64;
        let mut payload = 0u64;
        for (i, (op, wr)) in batch.iter().enumerate() {
            c.since_signal += op.wrs;
            let signal = i + 1 == n || c.since_signal >= signal_every;
            let flags = if signal {
                c.since_signal = 0;
                signalled += 1;
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let id_send = wr_id(id, KIND_SEND, op.seq);
            match wr {
                Wr::Send { lkey, addr, len, tag } => {
                    let inline = *len <= max_inline;
                    let flags = if inline {
                        flags | WorkRequestFlags::Inline
                    } else {
                        flags
                    };
                    let h = g.construct_wr(id_send, flags).setup_send_imm(*tag);
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
                        let slot = c.notices_sent % rx_depth_peer;
                        c.notices_sent += 1;
                        let bytes = notice.encode();
                        // IBV_SEND_INLINE as well as ibv_wr_set_inline_data: rxe's kernel side
                        // reads the flag to know the data is inline (LOC_QP_OP_ERR without it).
                        let h = g
                            .construct_wr(wr_id(id, KIND_META, op.seq), WorkRequestFlags::Inline)
                            .setup_write(info.ring_rkey, info.ring_addr + slot * NOTICE_LEN as u64);
                        h.setup_inline_data(&bytes);
                        let h = g.construct_wr(id_send, flags).setup_write_imm(*rkey, *raddr, *imm);
                        // SAFETY: as for sends.
                        unsafe { h.setup_sge(*lkey, *addr, *len) };
                    } else {
                        let inline = *len <= max_inline;
                        let flags = if inline {
                            flags | WorkRequestFlags::Inline
                        } else {
                            flags
                        };
                        let h = g.construct_wr(id_send, flags).setup_write(*rkey, *raddr);
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
            wrs += op.wrs as u64;
            payload += op.bytes as u64;
        }
        let posted = g.post();
        self.stats.doorbells += 1;
        match posted {
            Ok(()) => {
                self.stats.work_requests += wrs;
                self.stats.signalled += signalled;
                self.stats.tx_inline_payload_bytes += inline_bytes;
                self.stats.tx_payload_bytes += payload - inline_bytes;
                let c = self.conns.get_mut(&id).expect("listed");
                c.wrs_in_flight += wrs as u32;
                c.inflight.extend(batch.into_iter().map(|(o, _)| o));
                Ok(())
            }
            Err(e) => {
                let c = self.conns.get_mut(&id).expect("listed");
                for (o, wr) in batch.into_iter().rev() {
                    if wr.consumes_receive() {
                        c.credits += 1;
                    }
                    c.pending.push_front((o, wr));
                }
                Err(verbs("ibv_wr_complete (post send)", &self.dev.name, io_of(e)))
            }
        }
    }

    /// Drains the completion queue into events.
    fn poll_cq(&mut self) -> Result<()> {
        loop {
            let mut done: Vec<(u64, u32, u32, u32, u32, u32)> = Vec::with_capacity(64);
            match self.cq.start_poll() {
                Ok(mut p) => {
                    for wc in p.by_ref() {
                        done.push((wc.wr_id(), wc.status(), wc.vendor_err(), 0, 0, 0));
                        let last = done.last_mut().expect("pushed");
                        if last.1 == 0 {
                            last.3 = wc.opcode();
                            last.4 = wc.byte_len();
                            last.5 = wc.imm_data();
                        }
                        if done.len() == 64 {
                            break;
                        }
                    }
                }
                Err(sideway::ibverbs::completion::PollCompletionQueueError::CompletionQueueEmpty) => return Ok(()),
                Err(e) => return Err(verbs("ibv_start_poll", &self.dev.name, io_of(e))),
            }
            let n = done.len();
            for (id, status, vendor, opcode, len, imm) in done {
                self.on_completion(id, status, vendor, opcode, len, imm);
            }
            if n < 64 {
                return Ok(());
            }
        }
    }

    fn on_completion(&mut self, id: u64, status: u32, vendor_err: u32, opcode: u32, len: u32, imm: u32) {
        let (conn, kind, seq) = split_wr_id(id);
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        let peer = c.peer_name();
        if status != 0 {
            let op = match kind {
                KIND_RECV => "receive",
                KIND_META => "write notice",
                _ => match c.inflight.iter().find(|o| o.seq == seq).map(|o| o.kind) {
                    Some(OpKind::Send) => "send",
                    Some(OpKind::Read) => "read",
                    _ => "write",
                },
            };
            let err = || Error::WorkCompletion {
                op,
                conn,
                peer: peer.clone(),
                status,
                vendor_err,
            };
            if kind == KIND_RECV || status == WC_WR_FLUSH_ERR {
                // Our queue pair failed underneath the receives: the peer usually says why
                // (ABORT) over the control plane; wait for that briefly.
                if c.qp_failed.is_none() {
                    c.qp_failed = Some((err(), Instant::now() + ABORT_GRACE));
                }
                return;
            }
            // Everything before `seq` completed (RC completes in order); `seq` failed.
            while c.inflight.front().is_some_and(|o| o.seq < seq) {
                let o = c.inflight.pop_front().expect("front");
                c.wrs_in_flight = c.wrs_in_flight.saturating_sub(o.wrs);
                self.events.push_back(done_event(conn, &o));
            }
            if status == WC_REM_ACCESS_ERR {
                let why = err().to_string();
                self.ctrl_send(conn, wire::TAG_ABORT, wire::encode_abort(true, &why));
            }
            self.fail_conn(conn, err(), Some((seq, err())));
            return;
        }
        match kind {
            KIND_SEND | KIND_META => {
                while c.inflight.front().is_some_and(|o| o.seq <= seq) {
                    let o = c.inflight.pop_front().expect("front");
                    c.wrs_in_flight = c.wrs_in_flight.saturating_sub(o.wrs);
                    self.events.push_back(done_event(conn, &o));
                }
            }
            KIND_RECV => {
                let msg = self.cfg.max_message_bytes;
                let idx = seq as usize;
                let (rx, rx_mr) = c.rx_buf.as_ref().expect("receives need buffers");
                // IBV_WC_RECV = 128, IBV_WC_RECV_RDMA_WITH_IMM = 129.
                if opcode == 129 {
                    let rx_depth = self.cfg.rx_depth as u64;
                    let slot = (c.notices_seen % rx_depth) as usize;
                    c.notices_seen += 1;
                    let ring = &c.ring.as_ref().expect("ring").0;
                    let notice = Notice::decode(&ring[slot * NOTICE_LEN..(slot + 1) * NOTICE_LEN]);
                    match notice {
                        Ok(n) => {
                            self.stats.rx_write_bytes += len as u64;
                            let ev = Event::WriteReceived {
                                conn: ConnId(conn),
                                region: n.rkey,
                                offset: n.offset,
                                len: len as u64,
                                imm,
                            };
                            if c.ready_event_sent {
                                self.events.push_back(ev);
                            } else {
                                c.early.push(ev);
                            }
                        }
                        Err(e) => warn!(conn, error = %e, "write with immediate but no notice in the ring slot"),
                    }
                } else {
                    let data = rx[idx * msg..idx * msg + len as usize].to_vec();
                    self.stats.rx_message_copy_bytes += len as u64;
                    let ev = Event::Message {
                        conn: ConnId(conn),
                        tag: imm,
                        data,
                    };
                    // Held back until the connection has been announced.
                    if c.ready_event_sent {
                        self.events.push_back(ev);
                    } else {
                        c.early.push(ev);
                    }
                }
                // Repost the same buffer at once, and owe the peer one credit.
                let (lkey, addr) = (rx_mr.lkey(), rx.as_ptr() as u64 + (idx * msg) as u64);
                let qp = c.qp.as_mut().expect("live connection");
                let mut g = qp.start_post_recv();
                let h = g.construct_wr(wr_id(conn, KIND_RECV, seq));
                // SAFETY: the buffer is the one that just completed, inside the registered
                // receive area that outlives the queue pair.
                unsafe { h.setup_sge(lkey, addr, msg as u32) };
                if let Err(e) = g.post() {
                    let e = verbs("ibv_post_recv", &self.dev.name, io_of(e));
                    self.fail_conn(conn, e, None);
                    return;
                }
                c.credit_return += 1;
            }
            _ => {}
        }
    }

    fn return_credits(&mut self) {
        let owed: Vec<(u64, u32)> = self
            .conns
            .values_mut()
            .filter(|c| c.credit_return > 0 && c.state != State::Dead)
            .map(|c| (c.id, std::mem::take(&mut c.credit_return)))
            .collect();
        for (id, n) in owed {
            self.ctrl_send(id, wire::TAG_CREDIT, n.to_le_bytes().to_vec());
        }
    }

    fn on_inner(&mut self, ev: Event) {
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

    fn on_ctrl(&mut self, id: u64, tag: u32, data: &[u8]) {
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
            wire::TAG_CREDIT => match wire::decode_credit(data) {
                Ok(n) => self.conns.get_mut(&id).expect("checked").credits += n,
                Err(e) => self.fail_conn(id, bad("credit", &e), None),
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

    fn on_inner_closed(&mut self, id: u64, error: Option<Error>) {
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

    fn housekeeping(&mut self) {
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

    fn progress(&mut self) -> Result<()> {
        let mut inner_events = Vec::new();
        self.inner.poll(&mut inner_events, 1024)?;
        self.poll_cq()?;
        for ev in inner_events {
            self.on_inner(ev);
        }
        if self.cm.is_some() {
            self.poll_cm();
        }
        self.return_credits();
        self.post_pending();
        self.flush_ctrl();
        self.housekeeping();
        Ok(())
    }

    fn drain(&mut self, events: &mut Vec<Event>, max: usize) -> usize {
        let n = self.events.len().min(max);
        events.extend(self.events.drain(..n));
        n
    }

    /// Sleeps until the completion channel or the control plane has something, at most `d`.
    fn sleep(&mut self, d: Duration) -> Result<()> {
        let Some(ch) = self.channel.clone() else {
            std::hint::spin_loop();
            return Ok(());
        };
        if !self.armed {
            // SAFETY: `cq` is a live completion queue; arming only sets a flag in the driver.
            let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
            if rc != 0 {
                return Err(verbs(
                    "ibv_req_notify_cq",
                    &self.dev.name,
                    std::io::Error::from_raw_os_error(rc),
                ));
            }
            self.armed = true;
            // A completion may have landed before arming.
            self.poll_cq()?;
            if !self.events.is_empty() {
                return Ok(());
            }
        }
        let mut fds = [
            libc::pollfd {
                fd: ch.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.inner.ring_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = d.as_millis().clamp(1, 10) as i32;
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if fds[0].revents & libc::POLLIN != 0 {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: the channel is non-blocking and live; the out-pointers are valid locals.
            let rc = unsafe { rdma_mummy_sys::ibv_get_cq_event(ch.comp_channel().as_ptr(), &mut cq, &mut ctx) };
            if rc == 0 {
                // SAFETY: `cq` is the queue the event was for (ours); one event is acknowledged.
                unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
                self.armed = false;
            }
        }
        Ok(())
    }
}

fn done_event(conn: u64, o: &Op) -> Event {
    match o.kind {
        OpKind::Send => Event::SendDone {
            conn: ConnId(conn),
            req: o.req,
            bytes: o.bytes,
        },
        OpKind::Write => Event::WriteDone {
            conn: ConnId(conn),
            req: o.req,
            bytes: o.bytes,
        },
        OpKind::Read => Event::ReadDone {
            conn: ConnId(conn),
            req: o.req,
            bytes: o.bytes,
        },
    }
}

/// Checks `reg_dmabuf`'s arguments before any verbs call.
pub fn validate_dmabuf_args(fd: i32, offset: u64, len: usize, iova: u64) -> Result<()> {
    let bad = |reason: String| {
        Err(Error::InvalidArgument {
            op: "reg_dmabuf",
            reason,
        })
    };
    if fd < 0 {
        return bad(format!("fd {fd} is not a file descriptor"));
    }
    if len == 0 {
        return bad("length 0: nothing to register".into());
    }
    if offset.checked_add(len as u64).is_none() || iova.checked_add(len as u64).is_none() {
        return bad(format!("offset {offset} / iova {iova:#x} + length {len} overflows"));
    }
    let page = crate::memory::page_size() as u64;
    if offset % page != iova % page {
        return bad(format!(
            "offset {offset:#x} and iova {iova:#x} must agree modulo the page size ({page})"
        ));
    }
    Ok(())
}

impl Transport for RdmaTransport {
    fn properties(&self) -> &Properties {
        &self.props
    }

    fn listen(&mut self, addr: SocketAddr) -> Result<ListenerId> {
        let l = self.inner.listen(addr)?;
        if let Some(cm) = self.cm.as_mut() {
            let bound = self.inner.listener_addr(l)?;
            cm.listen(bound, &self.dev.name)?;
        }
        Ok(l)
    }

    fn listener_addr(&self, listener: ListenerId) -> Result<SocketAddr> {
        self.inner.listener_addr(listener)
    }

    fn connect(&mut self, addr: SocketAddr) -> Result<ConnId> {
        let id = self.inner.connect(addr)?;
        self.conns.insert(id.0, Conn::new(id.0, None));
        Ok(id)
    }

    fn accept(&mut self, listener: ListenerId) -> Result<Option<(ConnId, PeerInfo)>> {
        self.inner.listener_addr(listener)?;
        Ok(self.accepted.get_mut(&listener.0).and_then(|q| q.pop_front()))
    }

    fn register(&mut self, buf: PinnedBuffer, access: Access) -> Result<Region> {
        let mut flags = AccessFlags::LocalWrite;
        if access.remote_write {
            flags = flags | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        }
        let (ptr, len) = (buf.as_ptr() as usize, buf.len());
        // SAFETY: the buffer moves into the Region kept next to its MR in `self.regions`;
        // the MR is deregistered first, and in-flight guards keep the memory alive.
        let mr = unsafe { self.pd.reg_mr(ptr, len, flags) };
        let mr = mr.map_err(|e| verbs("ibv_reg_mr", &self.dev.name, io_of(e)))?;
        self.generation = self.generation.wrapping_add(1).max(1);
        // The key names the region locally and, for remote-writable regions, is the
        // rkey peers use. Local-only MRs may all have rkey 0 (rxe), so they go by lkey.
        let key = if access.remote_write { mr.rkey() } else { mr.lkey() };
        let r = Region::new(buf, key, self.generation, access, None);
        if let Some(old) = self.regions.insert(r.key(), Registered { mr, region: r.clone() }) {
            warn!(key = old.region.key(), "device reused an rkey still in the table");
        }
        if access.remote_write {
            self.broadcast_regions(r.remote(), false);
        }
        Ok(r)
    }

    fn deregister(&mut self, region: &Region) -> Result<()> {
        let known = self.regions.get(&region.key()).is_some_and(|r| r.region.same(region));
        crate::memory::check_deregister(known, region)?;
        let reg = self.regions.remove(&region.key()).expect("checked");
        drop(reg.mr);
        region.0.registered.store(false, std::sync::atomic::Ordering::Release);
        if region.access().remote_write {
            self.broadcast_regions(region.remote(), true);
        }
        Ok(())
    }

    fn remote_regions(&self, conn: ConnId) -> Result<Vec<RemoteRegion>> {
        let c = self.conns.get(&conn.0).ok_or(Error::UnknownConnection {
            op: "remote_regions",
            conn: conn.0,
        })?;
        Ok(c.remote.clone())
    }

    fn send(&mut self, conn: ConnId, src: &Slice, tag: u32) -> Result<ReqId> {
        if src.len() > self.cfg.max_message_bytes {
            return Err(Error::TooLarge {
                op: "send",
                len: src.len() as u64,
                max: self.cfg.max_message_bytes as u64,
            });
        }
        let lkey = self.lkey_of(src, "send")?;
        let wr = Wr::Send {
            lkey,
            addr: src.ptr() as u64,
            len: src.len() as u32,
            tag,
        };
        self.enqueue(conn, "send", OpKind::Send, src, wr)
    }

    fn write(
        &mut self,
        conn: ConnId,
        src: &Slice,
        dst: &RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> Result<ReqId> {
        check_write(src, dst, dst_offset, self.props.max_write_bytes)?;
        let lkey = self.lkey_of(src, "write")?;
        self.verify_remote(conn, dst, "write")?;
        let wr = Wr::Write {
            lkey,
            addr: src.ptr() as u64,
            len: src.len() as u32,
            rkey: dst.rkey,
            raddr: dst.addr.wrapping_add(dst_offset),
            imm: imm.map(|i| {
                (
                    i,
                    Notice {
                        rkey: dst.rkey,
                        generation: dst.generation,
                        offset: dst_offset,
                        len: src.len() as u64,
                    },
                )
            }),
        };
        self.enqueue(conn, "write", OpKind::Write, src, wr)
    }

    fn poll(&mut self, events: &mut Vec<Event>, max: usize) -> Result<usize> {
        if self.events.len() < max {
            self.progress()?;
        }
        Ok(self.drain(events, max))
    }

    fn wait(&mut self, events: &mut Vec<Event>, max: usize, timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        let end = start + timeout;
        let spin_end = match self.cfg.cq_mode {
            CqMode::BusyPoll => end,
            CqMode::Event => start + self.cfg.control.busy_poll.min(timeout),
        };
        loop {
            self.progress()?;
            if !self.events.is_empty() {
                return Ok(self.drain(events, max));
            }
            let now = Instant::now();
            if now >= end {
                return Ok(0);
            }
            if now < spin_end {
                std::hint::spin_loop();
                continue;
            }
            self.sleep(end - now)?;
        }
    }

    fn close(&mut self, conn: ConnId) -> Result<()> {
        let c = self.conns.get_mut(&conn.0).ok_or(Error::UnknownConnection {
            op: "close",
            conn: conn.0,
        })?;
        match c.state {
            State::Ready => {
                c.state = State::Closing;
                c.deadline = Some(Instant::now() + self.cfg.control.close_timeout);
            }
            State::Closing | State::Dead => {}
            _ => {
                c.state = State::Dead;
                c.qp = None;
                self.inner.close(conn)?;
            }
        }
        Ok(())
    }

    fn counters(&self) -> crate::api::Counters {
        crate::api::Counters {
            rx_direct_bytes: self.stats.rx_write_bytes,
            rx_copied_bytes: self.stats.rx_message_copy_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_round_trip() {
        for (c, k, s) in [(1u64, KIND_SEND, 0u64), (4095, KIND_RECV, 63), (7, KIND_META, SEQ_MASK)] {
            assert_eq!(split_wr_id(wr_id(c, k, s)), (c, k, s));
        }
        // Sequence numbers wrap inside their field without touching the others.
        assert_eq!(split_wr_id(wr_id(3, KIND_SEND, SEQ_MASK + 5)), (3, KIND_SEND, 4));
    }

    #[test]
    fn config_validation() {
        let base = RdmaConfig::new(TcpConfig::new(1, 0, crate::JobSecret::new(b"s".to_vec())));
        assert!(base.validate().is_ok());
        for f in [
            |c: &mut RdmaConfig| c.mtu = Some(1500),
            |c: &mut RdmaConfig| c.timeout = 0,
            |c: &mut RdmaConfig| c.retry_cnt = 8,
            |c: &mut RdmaConfig| c.rx_depth = 1,
            |c: &mut RdmaConfig| c.signal_every = 0,
            |c: &mut RdmaConfig| c.signal_every = 1000,
            |c: &mut RdmaConfig| c.max_message_bytes = 0,
        ] {
            let mut c = base.clone();
            f(&mut c);
            assert!(matches!(c.validate(), Err(Error::InvalidArgument { .. })), "{c:?}");
        }
        std::env::set_var("TIDEWIRE_RDMA_CQ", "sometimes");
        let e = base.clone().from_env().unwrap_err();
        std::env::remove_var("TIDEWIRE_RDMA_CQ");
        assert!(e.to_string().contains("busy or event"), "{e}");
    }

    #[test]
    fn dmabuf_arguments_are_validated_before_any_verbs_call() {
        assert!(validate_dmabuf_args(-1, 0, 4096, 0)
            .unwrap_err()
            .to_string()
            .contains("fd -1"));
        assert!(validate_dmabuf_args(3, 0, 0, 0)
            .unwrap_err()
            .to_string()
            .contains("length 0"));
        assert!(validate_dmabuf_args(3, u64::MAX, 4096, 0)
            .unwrap_err()
            .to_string()
            .contains("overflows"));
        assert!(validate_dmabuf_args(3, 4096, 4096, 100)
            .unwrap_err()
            .to_string()
            .contains("modulo the page size"));
        assert!(validate_dmabuf_args(3, 8192, 1 << 20, 0x7000_0000_0000).is_ok());
    }

    #[test]
    fn wr_shapes() {
        let n = Notice {
            rkey: 1,
            generation: 1,
            offset: 0,
            len: 4,
        };
        let w = |imm| Wr::Write {
            lkey: 1,
            addr: 0,
            len: 4,
            rkey: 2,
            raddr: 0,
            imm,
        };
        assert_eq!(w(Some((9, n))).work_requests(), 2, "notice + payload");
        assert!(w(Some((9, n))).consumes_receive());
        assert!(
            !w(None).consumes_receive(),
            "a plain write needs no receive at the target"
        );
        assert!(Wr::Send {
            lkey: 1,
            addr: 0,
            len: 1,
            tag: 0
        }
        .consumes_receive());
    }
}
