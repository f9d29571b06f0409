//! The io_uring TCP backend: the control plane everywhere, and the default
//! data plane on machines without RDMA.
//!
//! # Design
//! Each connection is two TCP sockets, bound together by the authenticated
//! handshake:
//! - the **control socket** carries the handshake, messages, region
//!   announcements and write acknowledgements. It is read by one multishot
//!   `RECV` with a provided-buffer ring; frames are reassembled from there.
//! - the **data socket** carries one-sided writes only. Its receive side reads
//!   the 40-byte header into a small buffer, checks the target region, bounds
//!   and generation, and then issues one `RECV` (MSG_WAITALL) whose buffer is
//!   the destination inside the registered region: the kernel copies from the
//!   socket straight into place and user space copies nothing
//!   ([`TcpStats::rx_user_copy_bytes`] counts the only user-space copies, which
//!   are control-plane bytes).
//!
//! Splitting the two keeps a 64 MiB write from delaying an acknowledgement or a
//! control message behind it (no head-of-line blocking), and lets the data
//! socket never read a byte it cannot place directly.
//!
//! Sends go straight from registered memory: up to 64 queued frames are
//! gathered into one `SENDMSG` (MSG_WAITALL) whose iovecs point into the
//! regions. Writes of at least [`TcpConfig::send_zc_min_bytes`] use `SEND_ZC`
//! from the io_uring fixed-buffer table instead (regions are registered there
//! when the memlock limit allows). See the README for the measured threshold.
//!
//! # Safety model
//! Every submitted SQE has an entry in the op table that owns all memory the
//! kernel may touch (headers, iovecs, msghdrs, sockaddrs, and a region guard
//! that keeps the region alive and counts it in flight). An entry is freed only
//! on the op's final completion. On drop the transport shuts every socket down,
//! cancels all ops and drains their completions before the ring and the
//! memory go away.

mod sys;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use tracing::{debug, debug_span, info, warn};

use crate::api::{check_write, ConnId, Event, ListenerId, PeerInfo, Properties, ReqId, Transport};
use crate::auth::{self, JobSecret, Role as MacRole, Transcript};
use crate::error::{Error, FrameError, Result};
use crate::frame::{self, Header, Kind, HEADER_LEN, NONCE_LEN};
use crate::memory::{Access, InFlight, MemoryKind, PinnedBuffer, Region, RemoteRegion, Slice};
use sys::{BufRing, SockAddr, SockOpts};

/// Configuration of a [`TcpTransport`].
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Job identity: peers of another job are refused.
    pub job_id: u64,
    /// This process's rank, told to peers.
    pub rank: u32,
    /// Shared job secret for the HMAC challenge-response.
    pub secret: JobSecret,
    /// Submission queue entries (completion queue is twice this).
    pub ring_entries: u32,
    /// Requests in flight per connection (sends + writes) before `WouldBlock`.
    pub max_outstanding: usize,
    /// Largest message payload (at most 16 MiB).
    pub max_message_bytes: usize,
    /// Handshake deadline for both sides.
    pub handshake_timeout: Duration,
    /// A peer silent this long with work outstanding is declared dead
    /// (TCP_USER_TIMEOUT, keepalive, and unacknowledged writes).
    pub peer_timeout: Duration,
    /// Deadline for a graceful close before the sockets are cut.
    pub close_timeout: Duration,
    /// SO_SNDBUF, when set.
    pub sndbuf_bytes: Option<usize>,
    /// SO_RCVBUF, when set.
    pub rcvbuf_bytes: Option<usize>,
    /// Writes at least this large go by SEND_ZC; `None` never uses it.
    /// Default: `None`, because on loopback and veth SEND_ZC measured slower at
    /// every size (see README, "SEND_ZC threshold").
    pub send_zc_min_bytes: Option<usize>,
    /// `wait` first spins this long watching the completion ring (no syscalls)
    /// before it sleeps in the kernel; it trades CPU for wake-up latency, as
    /// RDMA busy-polling does. `Duration::ZERO` never spins.
    pub busy_poll: Duration,
    /// Provided buffers for control receives (power of two) and their size.
    pub recv_buffers: u16,
    pub recv_buffer_bytes: u32,
}

impl TcpConfig {
    /// Defaults for a job: 1024-entry ring, 256 outstanding, 10 s handshake, 30 s peer timeout.
    pub fn new(job_id: u64, rank: u32, secret: JobSecret) -> Self {
        TcpConfig {
            job_id,
            rank,
            secret,
            ring_entries: 1024,
            max_outstanding: 256,
            max_message_bytes: frame::MAX_MESSAGE_BYTES as usize,
            handshake_timeout: Duration::from_secs(10),
            peer_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(5),
            sndbuf_bytes: None,
            rcvbuf_bytes: None,
            send_zc_min_bytes: None,
            busy_poll: Duration::from_micros(100),
            recv_buffers: 256,
            recv_buffer_bytes: 16 * 1024,
        }
    }
}

/// Counters of the data path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Bytes user space copied on any receive path (control frames and messages
    /// reassembled from the provided buffers). One-sided write payloads never add here.
    pub rx_user_copy_bytes: u64,
    /// Write payload bytes received by a recv whose buffer was the destination region.
    pub rx_write_direct_bytes: u64,
    /// Write payload bytes discarded because the write was rejected.
    pub rx_write_discarded_bytes: u64,
    /// Payload bytes sent from registered memory (messages and writes).
    pub tx_payload_bytes: u64,
    /// Writes sent by SEND_ZC.
    pub tx_zc_writes: u64,
    /// Submissions to the kernel (io_uring_enter calls that submitted).
    pub submits: u64,
}

const USER_DATA_NONE: u64 = u64::MAX;
const GATHER_MAX: usize = 64;
const GATHER_BYTES_MAX: usize = 8 << 20;
const DISCARD_CHUNK: usize = 64 * 1024;
const FIRST_FRAME_MAX: u32 = 256;
const FIXED_SLOTS: u32 = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Client,
    Server,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Client: TCP connect of the control socket in progress.
    Connecting,
    /// Client: Hello sent, waiting for the server's Challenge.
    AwaitChallenge,
    /// Client: Auth sent and data socket attached; waiting for Ready.
    AwaitReady,
    /// Server: Challenge sent, waiting for the client's Auth.
    AwaitAuth,
    /// Server: authenticated, waiting for the data socket.
    AwaitData,
    Ready,
    /// Graceful close under way.
    Closing,
    /// Failed or closed; waiting for in-flight ops to drain.
    Dead,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Connecting => "Connecting",
            State::AwaitChallenge => "AwaitChallenge",
            State::AwaitReady => "AwaitReady",
            State::AwaitAuth => "AwaitAuth",
            State::AwaitData => "AwaitData",
            State::Ready => "Ready",
            State::Closing => "Closing",
            State::Dead => "Dead",
        }
    }
}

/// Payload of a queued control frame.
enum Payload {
    None,
    Owned(Vec<u8>),
    Region { slice: Slice, _guard: InFlight },
}

impl Payload {
    fn len(&self) -> usize {
        match self {
            Payload::None => 0,
            Payload::Owned(v) => v.len(),
            Payload::Region { slice, .. } => slice.len(),
        }
    }
    fn ptr(&self) -> *const u8 {
        match self {
            Payload::None => std::ptr::null(),
            Payload::Owned(v) => v.as_ptr(),
            Payload::Region { slice, .. } => slice.ptr(),
        }
    }
}

struct TxFrame {
    hdr: [u8; HEADER_LEN],
    payload: Payload,
    /// User request to complete, with its kind.
    req: Option<(ReqId, bool)>,
}

struct WriteReq {
    req: ReqId,
    hdr: [u8; HEADER_LEN],
    src: Slice,
    guard: InFlight,
    seq: u64,
}

struct AwaitAck {
    seq: u64,
    req: ReqId,
    bytes: usize,
    _guard: InFlight,
    since: Instant,
}

/// Memory of one gathered SENDMSG.
struct Gather {
    _iov: Vec<libc::iovec>,
    msg: Box<libc::msghdr>,
    total: usize,
}

impl Gather {
    fn new(parts: impl Iterator<Item = (*const u8, usize)>) -> Box<Gather> {
        let iov: Vec<libc::iovec> = parts
            .filter(|&(_, l)| l > 0)
            .map(|(p, l)| libc::iovec {
                iov_base: p as *mut libc::c_void,
                iov_len: l,
            })
            .collect();
        let total = iov.iter().map(|v| v.iov_len).sum();
        // SAFETY: msghdr is plain old data; all-zero is valid (no name, no control).
        let mut msg: Box<libc::msghdr> = Box::new(unsafe { std::mem::zeroed() });
        // The iovec array lives on the heap; moving the Vec into the Gather keeps its address.
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = iov.len();
        Box::new(Gather { _iov: iov, msg, total })
    }
}

enum Op {
    Accept {
        listener: u64,
    },
    Connect {
        conn: u64,
        data: bool,
        _addr: Box<SockAddr>,
    },
    /// Server: first frame of an unclassified socket.
    FirstHeader {
        pending: u64,
        buf: Box<[u8; HEADER_LEN]>,
    },
    FirstPayload {
        pending: u64,
        hdr: Header,
        buf: Vec<u8>,
    },
    CtrlRecv {
        conn: u64,
    },
    CtrlSend {
        conn: u64,
        frames: Vec<TxFrame>,
        _g: Box<Gather>,
    },
    DataSend {
        conn: u64,
        writes: Vec<WriteReq>,
        _g: Box<Gather>,
    },
    /// Header of a SEND_ZC write (linked to the ZC op that follows).
    ZcHeader {
        conn: u64,
        _hdr: Box<[u8; HEADER_LEN]>,
    },
    /// A SEND_ZC payload; freed on its notification.
    ZcPayload {
        conn: u64,
        write: Option<WriteReq>,
        got_result: bool,
    },
    DataRecvHeader {
        conn: u64,
        buf: Box<[u8; HEADER_LEN]>,
    },
    DataRecvPayload {
        conn: u64,
        hdr: Header,
        _guard: InFlight,
    },
    DataDiscard {
        conn: u64,
        hdr: Header,
        remaining: u64,
        reason: String,
        buf: Box<[u8]>,
    },
    /// Fire-and-forget send that owns its socket (rejects to refused peers).
    Parting {
        _fd: OwnedFd,
        _buf: Vec<u8>,
    },
    /// DataAttach on the client's data socket.
    AttachSend {
        conn: u64,
        _buf: Vec<u8>,
    },
}

impl Op {
    fn conn(&self) -> Option<u64> {
        match self {
            Op::Connect { conn, .. }
            | Op::CtrlRecv { conn }
            | Op::CtrlSend { conn, .. }
            | Op::DataSend { conn, .. }
            | Op::ZcHeader { conn, .. }
            | Op::ZcPayload { conn, .. }
            | Op::DataRecvHeader { conn, .. }
            | Op::DataRecvPayload { conn, .. }
            | Op::DataDiscard { conn, .. }
            | Op::AttachSend { conn, .. } => Some(*conn),
            _ => None,
        }
    }
}

struct Listener {
    fd: OwnedFd,
    addr: SocketAddr,
    accepted: VecDeque<(ConnId, PeerInfo)>,
    armed: bool,
}

/// A socket accepted but not yet classified by its first frame.
struct Pending {
    fd: Option<OwnedFd>,
    addr: SocketAddr,
    listener: u64,
    deadline: Instant,
    ops: usize,
    done: bool,
}

struct Conn {
    id: u64,
    side: Side,
    state: State,
    peer_addr: SocketAddr,
    peer_rank: u32,
    listener: Option<u64>,
    ctrl: Option<OwnedFd>,
    data: Option<OwnedFd>,
    transcript: Transcript,
    deadline: Option<Instant>,
    ctrl_rx: Vec<u8>,
    ctrl_rx_armed: bool,
    ctrl_tx: VecDeque<TxFrame>,
    ctrl_tx_busy: bool,
    data_tx: VecDeque<WriteReq>,
    data_tx_busy: bool,
    data_rx_armed: bool,
    awaiting_ack: VecDeque<AwaitAck>,
    next_write_seq: u64,
    ack_to_send: Option<u64>,
    outstanding: usize,
    remote: HashMap<u32, RemoteRegion>,
    ops: usize,
    local_close: bool,
    sent_close: bool,
    peer_closed: bool,
    error: Option<Error>,
    closed_reported: bool,
    span: tracing::Span,
}

impl Conn {
    fn peer(&self) -> String {
        format!("{} (rank {})", self.peer_addr, self.peer_rank)
    }
    fn is_live(&self) -> bool {
        !matches!(self.state, State::Dead)
    }
}

/// The io_uring TCP transport. See the module docs.
pub struct TcpTransport {
    // Field order matters for drop: the ring goes before the memory it references.
    ring: IoUring,
    bufring: BufRing,
    cfg: TcpConfig,
    props: Properties,
    ops: Vec<Option<Op>>,
    free_ops: Vec<usize>,
    live_ops: usize,
    listeners: HashMap<u64, Listener>,
    pending: HashMap<u64, Pending>,
    conns: HashMap<u64, Conn>,
    tokens: HashMap<u64, u64>,
    regions: HashMap<u32, Region>,
    fixed_free: Vec<u16>,
    fixed_ok: bool,
    events: VecDeque<Event>,
    next_id: u64,
    next_req: u64,
    stats: TcpStats,
    sockopts: SockOpts,
    dirty: Vec<u64>,
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

fn errno(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

impl TcpTransport {
    /// Sets up the ring, the provided-buffer ring and the fixed-buffer table.
    ///
    /// Fails with [`Error::UringUnavailable`] (saying why) where io_uring is
    /// disabled (`kernel.io_uring_disabled`, seccomp) or too old.
    pub fn new(cfg: TcpConfig) -> Result<Self> {
        if cfg.max_message_bytes > frame::MAX_MESSAGE_BYTES as usize || cfg.max_message_bytes == 0 {
            return Err(Error::InvalidArgument {
                op: "TcpTransport::new",
                reason: format!("max_message_bytes must be in 1..={}", frame::MAX_MESSAGE_BYTES),
            });
        }
        if !cfg.recv_buffers.is_power_of_two() || cfg.recv_buffer_bytes < 4096 {
            return Err(Error::InvalidArgument {
                op: "TcpTransport::new",
                reason: "recv_buffers must be a power of two and recv_buffer_bytes >= 4096".into(),
            });
        }
        if cfg.max_outstanding == 0 {
            return Err(Error::InvalidArgument {
                op: "TcpTransport::new",
                reason: "max_outstanding must be > 0".into(),
            });
        }
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
        let props = Properties {
            name: "tcp-io_uring".into(),
            speed_mbps: None,
            memory_kinds: vec![MemoryKind::Host],
            max_message_bytes: cfg.max_message_bytes,
            max_write_bytes: frame::MAX_WRITE_BYTES as usize,
            one_sided: false,
            max_outstanding: cfg.max_outstanding,
        };
        let sockopts = SockOpts {
            sndbuf: cfg.sndbuf_bytes,
            rcvbuf: cfg.rcvbuf_bytes,
            peer_timeout: cfg.peer_timeout,
        };
        info!(rank = cfg.rank, "io_uring TCP transport ready");
        Ok(TcpTransport {
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
            regions: HashMap::new(),
            fixed_free: (0..FIXED_SLOTS as u16).rev().collect(),
            fixed_ok,
            events: VecDeque::new(),
            next_id: 1,
            next_req: 1,
            stats: TcpStats::default(),
            sockopts,
            dirty: Vec::new(),
        })
    }

    /// Data-path counters.
    pub fn stats(&self) -> TcpStats {
        self.stats
    }

    /// Sets the SEND_ZC threshold (`None`: never).
    pub fn set_send_zc_min_bytes(&mut self, v: Option<usize>) {
        self.cfg.send_zc_min_bytes = v;
    }

    /// The io_uring file descriptor: readable when completions are waiting. The
    /// RDMA backend sleeps on it together with its completion channel.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn ring_fd(&self) -> std::os::fd::RawFd {
        self.ring.as_raw_fd()
    }

    fn id(&mut self) -> u64 {
        let i = self.next_id;
        self.next_id += 1;
        i
    }

    // ---------------------------------------------------------------- op table

    fn add_op(&mut self, op: Op) -> u64 {
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
                (self.ops.len() - 1) as u64
            }
        }
    }

    fn take_op(&mut self, ud: u64) -> Option<Op> {
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

    /// Puts an op back in its slot (a multishot op that stays armed).
    fn keep_op(&mut self, ud: u64, op: Op) {
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

    /// Pushes an SQE.
    ///
    /// # Safety
    /// Every buffer the entry references must be owned by the op named by its
    /// user_data (or by `self`) and stay valid until that op's final completion.
    unsafe fn push(&mut self, e: squeue::Entry) {
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

    // ---------------------------------------------------------------- helpers

    fn conn_mut(&mut self, conn: ConnId, op: &'static str) -> Result<&mut Conn> {
        self.conns
            .get_mut(&conn.0)
            .filter(|c| c.is_live())
            .ok_or(Error::UnknownConnection { op, conn: conn.0 })
    }

    fn new_conn(&mut self, side: Side, addr: SocketAddr, ctrl: OwnedFd, listener: Option<u64>) -> u64 {
        let id = self.id();
        let span = debug_span!("conn", id, ?side, peer = %addr);
        let c = Conn {
            id,
            side,
            state: if side == Side::Client {
                State::Connecting
            } else {
                State::AwaitAuth
            },
            peer_addr: addr,
            peer_rank: u32::MAX,
            listener,
            ctrl: Some(ctrl),
            data: None,
            transcript: Transcript {
                job_id: self.cfg.job_id,
                client_rank: 0,
                server_rank: 0,
                client_nonce: [0; NONCE_LEN],
                server_nonce: [0; NONCE_LEN],
                token: 0,
            },
            deadline: Some(Instant::now() + self.cfg.handshake_timeout),
            ctrl_rx: Vec::new(),
            ctrl_rx_armed: false,
            ctrl_tx: VecDeque::new(),
            ctrl_tx_busy: false,
            data_tx: VecDeque::new(),
            data_tx_busy: false,
            data_rx_armed: false,
            awaiting_ack: VecDeque::new(),
            next_write_seq: 1,
            ack_to_send: None,
            outstanding: 0,
            remote: HashMap::new(),
            ops: 0,
            local_close: false,
            sent_close: false,
            peer_closed: false,
            error: None,
            closed_reported: false,
            span,
        };
        self.conns.insert(id, c);
        id
    }

    fn queue_ctrl(&mut self, conn: u64, hdr: Header, payload: Payload, req: Option<(ReqId, bool)>) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ctrl_tx.push_back(TxFrame {
                hdr: hdr.encode(),
                payload,
                req,
            });
            self.dirty.push(conn);
        }
    }

    fn announce_list(&self) -> Vec<RemoteRegion> {
        let mut l: Vec<_> = self
            .regions
            .values()
            .filter(|r| r.access().remote_write)
            .map(|r| r.remote())
            .collect();
        l.sort_by_key(|r| r.rkey);
        l
    }

    fn send_regions(&mut self, conn: u64, list: &[RemoteRegion], revoke: bool) {
        if list.is_empty() {
            return;
        }
        let body = frame::encode_regions(list);
        let mut h = Header::new(Kind::Regions, body.len() as u32);
        if revoke {
            h.flags |= frame::FLAG_REVOKE;
        }
        self.queue_ctrl(conn, h, Payload::Owned(body), None);
    }

    /// Announces (or revokes) one region to every established connection.
    fn broadcast_regions(&mut self, r: RemoteRegion, revoke: bool) {
        let ready: Vec<u64> = self
            .conns
            .values()
            .filter(|c| c.state == State::Ready)
            .map(|c| c.id)
            .collect();
        for c in ready {
            self.send_regions(c, &[r], revoke);
        }
    }

    fn send_reject_and_close(&mut self, fd: OwnedFd, reason: &str) {
        let body = reason.as_bytes()[..reason.len().min(256)].to_vec();
        let mut buf = Header::new(Kind::Reject, body.len() as u32).encode().to_vec();
        buf.extend_from_slice(&body);
        sys::shutdown(&fd, libc::SHUT_RD);
        let raw = fd.as_raw_fd();
        let (ptr, len) = (buf.as_ptr(), buf.len() as u32);
        let ud = self.add_op(Op::Parting { _fd: fd, _buf: buf });
        let e = opcode::Send::new(types::Fd(raw), ptr, len)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(ud);
        // SAFETY: the buffer and the fd are owned by the Parting op until its completion.
        unsafe { self.push(e) };
    }

    /// Fails a connection: records the first error, cuts both sockets so every
    /// in-flight op completes, and fails all queued work.
    fn fail(&mut self, conn: u64, err: Error) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        let _e = c.span.clone().entered();
        debug!(error = %err, state = c.state.name(), "connection failed");
        let handshaking = !matches!(c.state, State::Ready | State::Closing);
        c.state = State::Dead;
        if c.error.is_none() {
            c.error = Some(err);
        }
        for fd in [&c.ctrl, &c.data].into_iter().flatten() {
            sys::shutdown(fd, libc::SHUT_RDWR);
        }
        let mut failed = Vec::new();
        for f in c.ctrl_tx.drain(..) {
            if let Some((req, _)) = f.req {
                failed.push(req);
            }
        }
        for w in c.data_tx.drain(..) {
            failed.push(w.req);
        }
        for a in c.awaiting_ack.drain(..) {
            failed.push(a.req);
        }
        c.outstanding = c.outstanding.saturating_sub(failed.len());
        self.tokens.remove(&c.transcript.token);
        let peer = c.peer();
        for req in failed {
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req,
                error: Error::ConnectionLost {
                    conn,
                    peer: peer.clone(),
                    during: "an operation queued when the connection failed",
                    source: None,
                },
            });
        }
        // A server-side connection that never finished its handshake is reported
        // as a rejected peer: the application never saw it.
        if handshaking && c.side == Side::Server {
            let listener = c.listener.unwrap_or(0);
            let addr = c.peer_addr;
            let error = c.error.take().expect("set above");
            c.closed_reported = true;
            self.events.push_back(Event::PeerRejected {
                listener: ListenerId(listener),
                addr,
                error,
            });
        }
        self.reap(conn);
    }

    /// Removes a dead connection once no op references it, reporting `Closed`.
    fn reap(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state != State::Dead || c.ops > 0 {
            return;
        }
        let c = self.conns.remove(&conn).expect("present");
        self.tokens.remove(&c.transcript.token);
        if !c.closed_reported {
            self.events.push_back(Event::Closed {
                conn: ConnId(conn),
                error: c.error,
            });
        }
    }

    fn lost(&self, conn: u64, during: &'static str, source: Option<io::Error>) -> Error {
        let peer = self.conns.get(&conn).map(|c| c.peer()).unwrap_or_default();
        Error::ConnectionLost {
            conn,
            peer,
            during,
            source,
        }
    }

    // ---------------------------------------------------------------- arming

    fn arm_ctrl_recv(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.ctrl_rx_armed || c.state == State::Dead {
            return;
        }
        let Some(fd) = c.ctrl.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        c.ctrl_rx_armed = true;
        let bgid = self.bufring.bgid;
        let ud = self.add_op(Op::CtrlRecv { conn });
        let e = opcode::RecvMulti::new(types::Fd(fd), bgid).build().user_data(ud);
        // SAFETY: buffers come from the provided-buffer ring owned by `self`.
        unsafe { self.push(e) };
    }

    fn arm_data_header(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.data_rx_armed || c.state == State::Dead {
            return;
        }
        let Some(fd) = c.data.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        c.data_rx_armed = true;
        let mut buf = Box::new([0u8; HEADER_LEN]);
        let ptr = buf.as_mut_ptr();
        let ud = self.add_op(Op::DataRecvHeader { conn, buf });
        let e = opcode::Recv::new(types::Fd(fd), ptr, HEADER_LEN as u32)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(ud);
        // SAFETY: the header buffer is boxed inside the op (stable address).
        unsafe { self.push(e) };
    }

    fn arm_first_header(&mut self, pending: u64, fd: i32) {
        let mut buf = Box::new([0u8; HEADER_LEN]);
        let ptr = buf.as_mut_ptr();
        let ud = self.add_op(Op::FirstHeader { pending, buf });
        let e = opcode::Recv::new(types::Fd(fd), ptr, HEADER_LEN as u32)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(ud);
        // SAFETY: the buffer is boxed inside the op.
        unsafe { self.push(e) };
    }

    fn arm_accept(&mut self, listener: u64) {
        let Some(l) = self.listeners.get_mut(&listener) else {
            return;
        };
        if l.armed {
            return;
        }
        l.armed = true;
        let fd = l.fd.as_raw_fd();
        let ud = self.add_op(Op::Accept { listener });
        let e = opcode::AcceptMulti::new(types::Fd(fd))
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(ud);
        // SAFETY: multishot accept references no user memory.
        unsafe { self.push(e) };
    }

    fn start_connect(&mut self, conn: u64, data: bool) -> Result<()> {
        let (addr, fd) = {
            let c = self.conns.get(&conn).expect("caller checked");
            let fd = if data { c.data.as_ref() } else { c.ctrl.as_ref() };
            (c.peer_addr, fd.expect("socket set").as_raw_fd())
        };
        let sa = SockAddr::from_std(&addr);
        let (p, l) = (&sa.storage as *const libc::sockaddr_storage, sa.len);
        let ud = self.add_op(Op::Connect { conn, data, _addr: sa });
        let e = opcode::Connect::new(types::Fd(fd), p.cast(), l).build().user_data(ud);
        // SAFETY: the sockaddr is boxed inside the op.
        unsafe { self.push(e) };
        Ok(())
    }

    // ---------------------------------------------------------------- transmit

    /// Starts sends for every connection with queued frames and no send in flight.
    fn flush(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for conn in dirty {
            self.flush_conn(conn);
        }
    }

    fn flush_conn(&mut self, conn: u64) {
        // Pending acknowledgement goes ahead of anything queued later.
        if let Some(c) = self.conns.get_mut(&conn) {
            if let Some(seq) = c.ack_to_send.take() {
                let mut h = Header::new(Kind::Ack, 0);
                h.seq = seq;
                c.ctrl_tx.push_back(TxFrame {
                    hdr: h.encode(),
                    payload: Payload::None,
                    req: None,
                });
            }
        }
        self.maybe_send_close(conn);
        self.flush_ctrl(conn);
        self.flush_data(conn);
    }

    fn maybe_send_close(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state != State::Closing || c.sent_close {
            return;
        }
        if !c.data_tx.is_empty()
            || c.data_tx_busy
            || !c.awaiting_ack.is_empty()
            || !c.ctrl_tx.is_empty()
            || c.ctrl_tx_busy
        {
            return;
        }
        c.sent_close = true;
        c.ctrl_tx.push_back(TxFrame {
            hdr: Header::new(Kind::Close, 0).encode(),
            payload: Payload::None,
            req: None,
        });
    }

    fn flush_ctrl(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.ctrl_tx_busy || c.ctrl_tx.is_empty() || c.state == State::Dead || c.state == State::Connecting {
            return;
        }
        let Some(fd) = c.ctrl.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        let mut frames = Vec::new();
        let mut bytes = 0;
        while let Some(f) = c.ctrl_tx.front() {
            if !frames.is_empty() && (frames.len() >= GATHER_MAX || bytes + f.payload.len() > GATHER_BYTES_MAX) {
                break;
            }
            bytes += HEADER_LEN + f.payload.len();
            frames.push(c.ctrl_tx.pop_front().expect("front exists"));
        }
        c.ctrl_tx_busy = true;
        let g = Gather::new(
            frames
                .iter()
                .flat_map(|f| [(f.hdr.as_ptr(), HEADER_LEN), (f.payload.ptr(), f.payload.len())]),
        );
        let msg = &*g.msg as *const libc::msghdr;
        let ud = self.add_op(Op::CtrlSend { conn, frames, _g: g });
        let e = opcode::SendMsg::new(types::Fd(fd), msg)
            .flags((libc::MSG_WAITALL | libc::MSG_NOSIGNAL) as u32)
            .build()
            .user_data(ud);
        // SAFETY: the frames (headers in the Vec's heap buffer, which moving the Vec
        // does not relocate; payloads owned or guarded region slices), the iovecs and
        // the msghdr are owned by the op until its completion.
        unsafe { self.push(e) };
    }

    fn flush_data(&mut self, conn: u64) {
        let zc_min = self.cfg.send_zc_min_bytes;
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.data_tx_busy || c.data_tx.is_empty() || !matches!(c.state, State::Ready | State::Closing) {
            return;
        }
        let Some(fd) = c.data.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        let first_len = c.data_tx.front().map(|w| w.src.len()).unwrap_or(0);
        if zc_min.is_some_and(|m| first_len >= m) {
            let w = c.data_tx.pop_front().expect("non-empty");
            c.data_tx_busy = true;
            let hdr = Box::new(w.hdr);
            let hp = hdr.as_ptr();
            let (pp, pl) = (w.src.ptr() as *const u8, w.src.len() as u32);
            let fixed = w.src.region().0.fixed_index;
            self.stats.tx_zc_writes += 1;
            let ud_h = self.add_op(Op::ZcHeader { conn, _hdr: hdr });
            let ud_p = self.add_op(Op::ZcPayload {
                conn,
                write: Some(w),
                got_result: false,
            });
            let eh = opcode::Send::new(types::Fd(fd), hp, HEADER_LEN as u32)
                .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL | libc::MSG_MORE)
                .build()
                .flags(squeue::Flags::IO_LINK)
                .user_data(ud_h);
            let mut zc = opcode::SendZc::new(types::Fd(fd), pp, pl).flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL);
            if let Some(i) = fixed {
                zc = zc.buf_index(Some(i));
            }
            let ep = zc.build().user_data(ud_p);
            // SAFETY: the header is boxed in its op; the payload lies in a registered
            // region kept alive and counted in flight by the write's guard, which the
            // ZcPayload op holds until the kernel's notification says it let go.
            unsafe {
                self.push(eh);
                self.push(ep);
            }
            return;
        }
        let mut writes = Vec::new();
        let mut bytes = 0;
        while let Some(w) = c.data_tx.front() {
            if !writes.is_empty()
                && (writes.len() >= GATHER_MAX
                    || bytes + w.src.len() > GATHER_BYTES_MAX
                    || zc_min.is_some_and(|m| w.src.len() >= m))
            {
                break;
            }
            bytes += w.src.len();
            writes.push(c.data_tx.pop_front().expect("front exists"));
        }
        c.data_tx_busy = true;
        let g = Gather::new(
            writes
                .iter()
                .flat_map(|w| [(w.hdr.as_ptr(), HEADER_LEN), (w.src.ptr() as *const u8, w.src.len())]),
        );
        let msg = &*g.msg as *const libc::msghdr;
        let ud = self.add_op(Op::DataSend { conn, writes, _g: g });
        let e = opcode::SendMsg::new(types::Fd(fd), msg)
            .flags((libc::MSG_WAITALL | libc::MSG_NOSIGNAL) as u32)
            .build()
            .user_data(ud);
        // SAFETY: as in flush_ctrl; region payloads are guarded by each write's InFlight.
        unsafe { self.push(e) };
    }

    // ---------------------------------------------------------------- completions

    fn reap_completions(&mut self) {
        loop {
            let batch: Vec<(u64, i32, u32)> = self
                .ring
                .completion()
                .take(256)
                .map(|c| (c.user_data(), c.result(), c.flags()))
                .collect();
            if batch.is_empty() {
                break;
            }
            for (ud, res, flags) in batch {
                if ud == USER_DATA_NONE {
                    continue;
                }
                self.complete(ud, res, flags);
            }
        }
        self.bufring.publish();
    }

    fn complete(&mut self, ud: u64, res: i32, flags: u32) {
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
            Op::Accept { listener } => self.on_accept(ud, listener, res, flags),
            Op::Connect { conn, data, .. } => self.on_connect(conn, data, res),
            Op::FirstHeader { pending, buf } => self.on_first_header(pending, res, &buf),
            Op::FirstPayload { pending, hdr, buf } => self.on_first_payload(pending, res, hdr, buf),
            Op::CtrlRecv { conn } => self.on_ctrl_recv(ud, conn, res, flags),
            Op::CtrlSend { conn, frames, _g } => self.on_ctrl_sent(conn, res, frames, _g.total),
            Op::DataSend { conn, writes, _g } => self.on_data_sent(conn, res, writes, _g.total),
            Op::ZcHeader { conn, .. } => {
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
            Op::DataRecvHeader { conn, buf } => self.on_data_header(conn, res, &buf),
            Op::DataRecvPayload { conn, hdr, _guard } => self.on_data_payload(conn, res, hdr),
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
}

// SAFETY: the raw pointers in a Gather point into memory owned by the same op
// (frames, writes) or by registered regions; nothing is thread-affine, and the
// transport that owns the op moves between threads as a whole.
unsafe impl Send for Gather {}

impl TcpTransport {
    // ---------------------------------------------------------------- accept side

    fn on_accept(&mut self, ud: u64, listener: u64, res: i32, flags: u32) {
        let live = self.listeners.contains_key(&listener);
        if cqueue::more(flags) && live {
            self.keep_op(ud, Op::Accept { listener });
        } else if let Some(l) = self.listeners.get_mut(&listener) {
            l.armed = false;
        }
        if res < 0 {
            if live && res != -libc::ECANCELED && res != -libc::EINVAL {
                warn!(listener, error = %errno(res), "accept failed");
            }
            if live && !cqueue::more(flags) && res != -libc::EINVAL {
                self.arm_accept(listener);
            }
            return;
        }
        // SAFETY: a successful accept returns a new fd that nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(res) };
        if !live {
            return;
        }
        let addr = sys::peer_addr(fd.as_raw_fd()).unwrap_or_else(|| ([0, 0, 0, 0], 0).into());
        if let Err(e) = sys::tune(fd.as_raw_fd(), &self.sockopts) {
            warn!(%addr, error = %e, "socket options on an accepted socket");
        }
        let id = self.id();
        let raw = fd.as_raw_fd();
        self.pending.insert(
            id,
            Pending {
                fd: Some(fd),
                addr,
                listener,
                deadline: Instant::now() + self.cfg.handshake_timeout,
                ops: 0,
                done: false,
            },
        );
        debug!(%addr, pending = id, "accepted a socket");
        self.arm_first_header(id, raw);
        if !cqueue::more(flags) {
            self.arm_accept(listener);
        }
    }

    fn reject_pending(&mut self, pending: u64, error: Error, reply: Option<String>) {
        let Some(p) = self.pending.get_mut(&pending) else {
            return;
        };
        if p.done {
            return;
        }
        p.done = true;
        let (listener, addr) = (p.listener, p.addr);
        let fd = p.fd.take();
        debug!(%addr, error = %error, "refusing a peer");
        if let Some(fd) = fd {
            sys::shutdown(&fd, libc::SHUT_RD);
            match reply {
                Some(r) => self.send_reject_and_close(fd, &r),
                None => {
                    sys::shutdown(&fd, libc::SHUT_RDWR);
                    // Keep the fd until the pending op on it has completed.
                    if let Some(p) = self.pending.get_mut(&pending) {
                        p.fd = Some(fd);
                    }
                }
            }
        }
        self.events.push_back(Event::PeerRejected {
            listener: ListenerId(listener),
            addr,
            error,
        });
        self.reap_pending(pending);
    }

    fn reap_pending(&mut self, pending: u64) {
        if self.pending.get(&pending).is_some_and(|p| p.done && p.ops == 0) {
            self.pending.remove(&pending);
        }
    }

    fn on_first_header(&mut self, pending: u64, res: i32, buf: &[u8; HEADER_LEN]) {
        let Some(p) = self.pending.get(&pending) else { return };
        if p.done {
            return;
        }
        let peer = p.addr.to_string();
        if res != HEADER_LEN as i32 {
            let src = (res < 0).then(|| errno(res));
            let e = Error::ConnectionLost {
                conn: 0,
                peer,
                during: "the first frame of the handshake",
                source: src,
            };
            return self.reject_pending(pending, e, None);
        }
        let hdr = match Header::decode_any_version(buf) {
            Ok(h) => h,
            Err(reason) => return self.reject_pending(pending, Error::BadFrame { peer, reason }, None),
        };
        if hdr.version != frame::VERSION {
            let e = Error::VersionMismatch {
                peer,
                ours: frame::VERSION,
                theirs: hdr.version,
            };
            let msg = format!(
                "protocol version mismatch: this peer speaks {}, you sent {}",
                frame::VERSION,
                hdr.version
            );
            return self.reject_pending(pending, e, Some(msg));
        }
        if !matches!(hdr.kind, Kind::Hello | Kind::DataAttach) || hdr.length > FIRST_FRAME_MAX {
            let reason = FrameError::Unexpected {
                kind: hdr.kind.name(),
                state: "FirstFrame",
            };
            return self.reject_pending(pending, Error::BadFrame { peer, reason }, Some("expected Hello".into()));
        }
        let fd = p.fd.as_ref().expect("not done").as_raw_fd();
        let mut body = vec![0u8; hdr.length as usize];
        if body.is_empty() {
            return self.on_first_payload(pending, 0, hdr, body);
        }
        let (ptr, len) = (body.as_mut_ptr(), body.len() as u32);
        let ud = self.add_op(Op::FirstPayload {
            pending,
            hdr,
            buf: body,
        });
        let e = opcode::Recv::new(types::Fd(fd), ptr, len)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(ud);
        // SAFETY: the Vec's heap buffer is owned by the op and never resized.
        unsafe { self.push(e) };
    }

    fn on_first_payload(&mut self, pending: u64, res: i32, hdr: Header, body: Vec<u8>) {
        let Some(p) = self.pending.get(&pending) else { return };
        if p.done {
            return;
        }
        let (peer, addr, listener) = (p.addr.to_string(), p.addr, p.listener);
        if res != hdr.length as i32 {
            let e = Error::ConnectionLost {
                conn: 0,
                peer,
                during: "the first frame of the handshake",
                source: (res < 0).then(|| errno(res)),
            };
            return self.reject_pending(pending, e, None);
        }
        match hdr.kind {
            Kind::Hello => {
                let hello = match frame::Hello::decode(&body) {
                    Ok(h) => h,
                    Err(reason) => return self.reject_pending(pending, Error::BadFrame { peer, reason }, None),
                };
                if hello.job_id != self.cfg.job_id {
                    let e = Error::JobMismatch {
                        peer,
                        ours: self.cfg.job_id,
                        theirs: hello.job_id,
                    };
                    return self.reject_pending(pending, e, Some("job id mismatch".into()));
                }
                let p = self.pending.get_mut(&pending).expect("checked");
                p.done = true;
                let fd = p.fd.take().expect("not done");
                self.reap_pending(pending);
                let conn = self.new_conn(Side::Server, addr, fd, Some(listener));
                let mut token = auth::random_u64();
                while token == 0 || self.tokens.contains_key(&token) {
                    token = auth::random_u64();
                }
                self.tokens.insert(token, conn);
                let c = self.conns.get_mut(&conn).expect("just made");
                c.peer_rank = hello.rank;
                c.transcript.client_rank = hello.rank;
                c.transcript.client_nonce = hello.nonce;
                c.transcript.server_rank = self.cfg.rank;
                c.transcript.server_nonce = auth::random_nonce();
                c.transcript.token = token;
                let ch = frame::Challenge {
                    rank: self.cfg.rank,
                    nonce: c.transcript.server_nonce,
                    token,
                    mac: auth::prove(&self.cfg.secret, MacRole::Server, &c.transcript),
                };
                debug!(parent: &c.span, rank = hello.rank, "hello received; challenge sent");
                let body = ch.encode();
                self.queue_ctrl(
                    conn,
                    Header::new(Kind::Challenge, body.len() as u32),
                    Payload::Owned(body),
                    None,
                );
                self.arm_ctrl_recv(conn);
            }
            Kind::DataAttach => {
                let att = match frame::DataAttach::decode(&body) {
                    Ok(a) => a,
                    Err(reason) => return self.reject_pending(pending, Error::BadFrame { peer, reason }, None),
                };
                let conn = self.tokens.get(&att.token).copied();
                let ok = conn.and_then(|c| self.conns.get(&c)).is_some_and(|c| {
                    c.state == State::AwaitData
                        && auth::verify(&self.cfg.secret, MacRole::Data, &c.transcript, &att.mac)
                });
                let Some(conn) = conn.filter(|_| ok) else {
                    let e = Error::AuthFailed {
                        peer,
                        reason: "data socket presented an unknown token or a bad proof",
                    };
                    return self.reject_pending(pending, e, Some("authentication failed".into()));
                };
                let p = self.pending.get_mut(&pending).expect("checked");
                p.done = true;
                let fd = p.fd.take().expect("not done");
                self.reap_pending(pending);
                let list = self.announce_list();
                let c = self.conns.get_mut(&conn).expect("checked");
                c.data = Some(fd);
                c.state = State::Ready;
                c.deadline = None;
                let info = PeerInfo {
                    rank: c.peer_rank,
                    addr: c.peer_addr,
                };
                info!(parent: &c.span, rank = c.peer_rank, "peer authenticated; connection ready");
                self.queue_ctrl(conn, Header::new(Kind::Ready, 0), Payload::None, None);
                self.send_regions(conn, &list, false);
                self.arm_data_header(conn);
                if let Some(l) = self.listeners.get_mut(&listener) {
                    l.accepted.push_back((ConnId(conn), info));
                }
                self.events.push_back(Event::Incoming {
                    listener: ListenerId(listener),
                    conn: ConnId(conn),
                });
            }
            _ => unreachable!("checked in on_first_header"),
        }
    }

    // ---------------------------------------------------------------- connect side

    fn on_connect(&mut self, conn: u64, data: bool, res: i32) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        if res < 0 {
            let e = Error::Io {
                op: if data { "connect (data socket)" } else { "connect" },
                peer: Some(c.peer_addr),
                source: errno(res),
            };
            return self.fail(conn, e);
        }
        if !data {
            c.state = State::AwaitChallenge;
            c.transcript.client_rank = self.cfg.rank;
            c.transcript.client_nonce = auth::random_nonce();
            let hello = frame::Hello {
                job_id: self.cfg.job_id,
                rank: self.cfg.rank,
                nonce: c.transcript.client_nonce,
            };
            debug!(parent: &c.span, "connected; hello sent");
            let body = hello.encode();
            self.queue_ctrl(
                conn,
                Header::new(Kind::Hello, body.len() as u32),
                Payload::Owned(body),
                None,
            );
            self.arm_ctrl_recv(conn);
        } else {
            let att = frame::DataAttach {
                token: c.transcript.token,
                mac: auth::prove(&self.cfg.secret, MacRole::Data, &c.transcript),
            };
            let body = att.encode();
            let mut buf = Header::new(Kind::DataAttach, body.len() as u32).encode().to_vec();
            buf.extend_from_slice(&body);
            let fd = c.data.as_ref().expect("data socket").as_raw_fd();
            let (p, l) = (buf.as_ptr(), buf.len() as u32);
            let ud = self.add_op(Op::AttachSend { conn, _buf: buf });
            let e = opcode::Send::new(types::Fd(fd), p, l)
                .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL)
                .build()
                .user_data(ud);
            // SAFETY: the buffer is owned by the op.
            unsafe { self.push(e) };
            self.arm_data_header(conn);
        }
    }

    // ---------------------------------------------------------------- control receive

    fn on_ctrl_recv(&mut self, ud: u64, conn: u64, res: i32, flags: u32) {
        let more = cqueue::more(flags);
        let live = self.conns.get(&conn).is_some_and(|c| c.is_live());
        if more && live {
            self.keep_op(ud, Op::CtrlRecv { conn });
        } else if let Some(c) = self.conns.get_mut(&conn) {
            c.ctrl_rx_armed = false;
        }
        if res > 0 {
            let Some(bid) = cqueue::buffer_select(flags) else {
                warn!(conn, "multishot recv completion without a buffer");
                return;
            };
            if live {
                let data = self.bufring.data(bid, res as usize);
                let c = self.conns.get_mut(&conn).expect("live");
                c.ctrl_rx.extend_from_slice(data);
                self.stats.rx_user_copy_bytes += res as u64;
            }
            self.bufring.push(bid);
            if live {
                self.parse_ctrl(conn);
            }
        } else if !live {
        } else if res == 0 {
            let c = self.conns.get(&conn).expect("live");
            if c.peer_closed || c.state == State::Closing && c.sent_close {
                self.finish_close(conn);
            } else {
                let e = match c.state {
                    State::AwaitAuth => Error::AuthFailed {
                        peer: c.peer(),
                        reason: "peer hung up before proving the job secret (does it have the same secret?)",
                    },
                    _ => self.lost(conn, "control receive (peer closed)", None),
                };
                self.fail(conn, e);
            }
            return;
        } else if res != -libc::ENOBUFS {
            let e = self.lost(conn, "control receive", Some(errno(res)));
            self.fail(conn, e);
            return;
        }
        if !more {
            self.arm_ctrl_recv(conn);
        }
    }

    fn parse_ctrl(&mut self, conn: u64) {
        let max = (self.cfg.max_message_bytes as u32).max(frame::MAX_CONTROL_BYTES);
        let mut buf = std::mem::take(&mut self.conns.get_mut(&conn).expect("live").ctrl_rx);
        let mut used = 0;
        let mut failure = None;
        while self.conns.get(&conn).is_some_and(|c| c.is_live()) {
            match frame::next_frame(&buf[used..], max) {
                Ok(Some((hdr, total))) => {
                    let payload = &buf[used + HEADER_LEN..used + total];
                    if let Err(e) = self.on_ctrl_frame(conn, hdr, payload) {
                        failure = Some(e);
                        break;
                    }
                    used += total;
                }
                Ok(None) => break,
                Err(reason) => {
                    let peer = self.conns[&conn].peer();
                    failure = Some(Error::BadFrame { peer, reason });
                    break;
                }
            }
        }
        buf.drain(..used);
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ctrl_rx = buf;
        }
        if let Some(e) = failure {
            self.fail(conn, e);
        }
    }

    fn on_ctrl_frame(&mut self, conn: u64, hdr: Header, payload: &[u8]) -> Result<()> {
        let c = self.conns.get_mut(&conn).expect("live");
        let peer = c.peer();
        let unexpected = |state: State| Error::BadFrame {
            peer: peer.clone(),
            reason: FrameError::Unexpected {
                kind: hdr.kind.name(),
                state: state.name(),
            },
        };
        let bad = |reason| Error::BadFrame {
            peer: peer.clone(),
            reason,
        };
        match (c.state, hdr.kind) {
            (State::AwaitChallenge | State::AwaitReady | State::AwaitAuth | State::AwaitData, Kind::Reject) => {
                Err(Error::Rejected {
                    peer: peer.clone(),
                    reason: frame::decode_reason(payload),
                })
            }
            (State::AwaitChallenge, Kind::Challenge) => {
                let ch = frame::Challenge::decode(payload).map_err(bad)?;
                c.transcript.server_rank = ch.rank;
                c.transcript.server_nonce = ch.nonce;
                c.transcript.token = ch.token;
                c.peer_rank = ch.rank;
                if !auth::verify(&self.cfg.secret, MacRole::Server, &c.transcript, &ch.mac) {
                    return Err(Error::AuthFailed {
                        peer: c.peer(),
                        reason: "the server could not prove the job secret",
                    });
                }
                let mac = auth::prove(&self.cfg.secret, MacRole::Client, &c.transcript);
                c.state = State::AwaitReady;
                let addr = c.peer_addr;
                self.queue_ctrl(
                    conn,
                    Header::new(Kind::Auth, NONCE_LEN as u32),
                    Payload::Owned(mac.to_vec()),
                    None,
                );
                let fd = sys::socket_for(&addr)?;
                sys::tune(fd.as_raw_fd(), &self.sockopts)?;
                self.conns.get_mut(&conn).expect("live").data = Some(fd);
                self.start_connect(conn, true)
            }
            (State::AwaitAuth, Kind::Auth) => {
                let mac = frame::decode_mac(payload, "Auth").map_err(bad)?;
                if !auth::verify(&self.cfg.secret, MacRole::Client, &c.transcript, &mac) {
                    // Tell the peer why, then drop it; it learned no region descriptor.
                    if let Some(fd) = c.ctrl.take() {
                        self.send_reject_and_close(fd, "authentication failed");
                    }
                    return Err(Error::AuthFailed {
                        peer,
                        reason: "the client's proof of the job secret is wrong",
                    });
                }
                c.state = State::AwaitData;
                Ok(())
            }
            (State::AwaitReady, Kind::Ready) => {
                c.state = State::Ready;
                c.deadline = None;
                let info = PeerInfo {
                    rank: c.peer_rank,
                    addr: c.peer_addr,
                };
                info!(parent: &c.span, rank = c.peer_rank, "connection ready");
                let list = self.announce_list();
                self.send_regions(conn, &list, false);
                self.events.push_back(Event::Connected {
                    conn: ConnId(conn),
                    peer: info,
                });
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Message) => {
                self.stats.rx_user_copy_bytes += payload.len() as u64;
                self.events.push_back(Event::Message {
                    conn: ConnId(conn),
                    tag: hdr.imm,
                    data: payload.to_vec(),
                });
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Ack) => {
                while c.awaiting_ack.front().is_some_and(|a| a.seq <= hdr.seq) {
                    let a = c.awaiting_ack.pop_front().expect("front");
                    c.outstanding -= 1;
                    self.events.push_back(Event::WriteDone {
                        conn: ConnId(conn),
                        req: a.req,
                        bytes: a.bytes,
                    });
                }
                self.dirty.push(conn);
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Nack) => {
                if let Some(i) = c.awaiting_ack.iter().position(|a| a.seq == hdr.seq) {
                    let a = c.awaiting_ack.remove(i).expect("index valid");
                    c.outstanding -= 1;
                    self.events.push_back(Event::OpFailed {
                        conn: ConnId(conn),
                        req: a.req,
                        error: Error::RemoteAccess {
                            conn,
                            seq: hdr.seq,
                            reason: frame::decode_reason(payload),
                        },
                    });
                }
                self.dirty.push(conn);
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Regions) => {
                let list = frame::decode_regions(payload).map_err(bad)?;
                for r in list {
                    if hdr.flags & frame::FLAG_REVOKE != 0 {
                        c.remote.remove(&r.rkey);
                    } else {
                        c.remote.insert(r.rkey, r);
                    }
                }
                self.events
                    .push_back(Event::RemoteRegionsChanged { conn: ConnId(conn) });
                Ok(())
            }
            (State::Ready | State::Closing, Kind::Close) => {
                c.peer_closed = true;
                if c.state == State::Ready {
                    c.state = State::Closing;
                    c.deadline = Some(Instant::now() + self.cfg.close_timeout);
                }
                self.dirty.push(conn);
                self.check_close_done(conn);
                Ok(())
            }
            (s, _) => Err(unexpected(s)),
        }
    }

    fn check_close_done(&mut self, conn: u64) {
        let Some(c) = self.conns.get(&conn) else { return };
        if c.state == State::Closing && c.peer_closed && c.sent_close && !c.ctrl_tx_busy && c.ctrl_tx.is_empty() {
            self.finish_close(conn);
        }
    }

    fn finish_close(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        debug!(parent: &c.span, "closed gracefully");
        c.state = State::Dead;
        for fd in [&c.ctrl, &c.data].into_iter().flatten() {
            sys::shutdown(fd, libc::SHUT_RDWR);
        }
        let leftover: Vec<ReqId> = c.awaiting_ack.drain(..).map(|a| a.req).collect();
        for req in leftover {
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req,
                error: Error::Cancelled { conn },
            });
        }
        self.reap(conn);
    }

    // ---------------------------------------------------------------- send completions

    fn on_ctrl_sent(&mut self, conn: u64, res: i32, frames: Vec<TxFrame>, total: usize) {
        let ok = res >= 0 && res as usize == total;
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ctrl_tx_busy = false;
        }
        let err_src = (res < 0).then(|| errno(res));
        for f in frames {
            let Some((req, _)) = f.req else { continue };
            if let Some(c) = self.conns.get_mut(&conn) {
                c.outstanding = c.outstanding.saturating_sub(1);
            }
            if ok {
                self.stats.tx_payload_bytes += f.payload.len() as u64;
                self.events.push_back(Event::SendDone {
                    conn: ConnId(conn),
                    req,
                    bytes: f.payload.len(),
                });
            } else {
                let error = self.lost(conn, "send", err_src.as_ref().map(|e| io::Error::from(e.kind())));
                self.events.push_back(Event::OpFailed {
                    conn: ConnId(conn),
                    req,
                    error,
                });
            }
        }
        if !ok {
            let e = self.lost(conn, "sending control frames", err_src);
            self.fail(conn, e);
            return;
        }
        self.dirty.push(conn);
        self.check_close_done(conn);
    }

    fn ack_wait(&mut self, conn: u64, w: WriteReq) {
        let c = self.conns.get_mut(&conn).expect("caller checked");
        self.stats.tx_payload_bytes += w.src.len() as u64;
        c.awaiting_ack.push_back(AwaitAck {
            seq: w.seq,
            req: w.req,
            bytes: w.src.len(),
            _guard: w.guard,
            since: Instant::now(),
        });
    }

    fn on_data_sent(&mut self, conn: u64, res: i32, writes: Vec<WriteReq>, total: usize) {
        let live = self.conns.get(&conn).is_some_and(|c| c.is_live());
        if let Some(c) = self.conns.get_mut(&conn) {
            c.data_tx_busy = false;
        }
        if live && res >= 0 && res as usize == total {
            for w in writes {
                self.ack_wait(conn, w);
            }
            self.dirty.push(conn);
            return;
        }
        let src = (res < 0).then(|| errno(res));
        for w in writes {
            let error = self.lost(conn, "write", src.as_ref().map(|e| io::Error::from(e.kind())));
            if let Some(c) = self.conns.get_mut(&conn) {
                c.outstanding = c.outstanding.saturating_sub(1);
            }
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req: w.req,
                error,
            });
        }
        let e = self.lost(conn, "sending writes", src);
        self.fail(conn, e);
    }

    fn on_zc(&mut self, ud: u64, conn: u64, res: i32, flags: u32, write: Option<WriteReq>, got_result: bool) {
        if cqueue::notif(flags) || got_result {
            // The kernel no longer references the pages: dropping `write` releases its guard.
            return;
        }
        let live = self.conns.get(&conn).is_some_and(|c| c.is_live());
        if let Some(c) = self.conns.get_mut(&conn) {
            c.data_tx_busy = false;
        }
        let w = write.expect("first completion carries the write");
        let ok = live && res >= 0 && res as usize == w.src.len();
        if ok {
            let mirror = WriteReq {
                req: w.req,
                hdr: w.hdr,
                src: w.src.clone(),
                guard: InFlight::new(w.src.region()),
                seq: w.seq,
            };
            self.ack_wait(conn, mirror);
            self.dirty.push(conn);
        } else {
            if let Some(c) = self.conns.get_mut(&conn) {
                c.outstanding = c.outstanding.saturating_sub(1);
            }
            let src = (res < 0).then(|| errno(res));
            let error = self.lost(conn, "write (SEND_ZC)", src.as_ref().map(|e| io::Error::from(e.kind())));
            self.events.push_back(Event::OpFailed {
                conn: ConnId(conn),
                req: w.req,
                error,
            });
            let e = self.lost(conn, "sending a write", src);
            self.fail(conn, e);
        }
        if cqueue::more(flags) {
            self.keep_op(
                ud,
                Op::ZcPayload {
                    conn,
                    write: Some(w),
                    got_result: true,
                },
            );
        }
    }

    // ---------------------------------------------------------------- data receive

    fn check_incoming(&self, hdr: &Header) -> Result<Region> {
        let op = "incoming write";
        let r = self
            .regions
            .get(&hdr.region)
            .filter(|r| r.generation() == hdr.generation)
            .ok_or(Error::UnknownRegion {
                op,
                region: hdr.region,
                generation: hdr.generation,
            })?;
        if !r.access().remote_write {
            return Err(Error::AccessDenied {
                op,
                region: hdr.region,
                needed: "remote write",
            });
        }
        match hdr.offset.checked_add(hdr.length as u64) {
            Some(end) if end <= r.len() as u64 => Ok(r.clone()),
            _ => Err(Error::OutOfBounds {
                op,
                region: hdr.region,
                offset: hdr.offset,
                len: hdr.length as u64,
                region_len: r.len() as u64,
            }),
        }
    }

    fn on_data_header(&mut self, conn: u64, res: i32, buf: &[u8; HEADER_LEN]) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        c.data_rx_armed = false;
        if c.state == State::Dead {
            return;
        }
        if res == 0 && (c.peer_closed || c.state == State::Closing) {
            return;
        }
        if res != HEADER_LEN as i32 {
            let during = if res == 0 {
                "data receive (peer closed)"
            } else {
                "data receive"
            };
            let e = self.lost(conn, during, (res < 0).then(|| errno(res)));
            return self.fail(conn, e);
        }
        let peer = c.peer();
        let hdr = match Header::decode(buf) {
            Ok(h) if h.kind == Kind::Write => h,
            Ok(h) => {
                let reason = FrameError::Unexpected {
                    kind: h.kind.name(),
                    state: "DataSocket",
                };
                return self.fail(conn, Error::BadFrame { peer, reason });
            }
            Err(reason) => return self.fail(conn, Error::BadFrame { peer, reason }),
        };
        let fd = c.data.as_ref().expect("data socket").as_raw_fd();
        match self.check_incoming(&hdr) {
            Ok(region) if hdr.length == 0 => {
                drop(region);
                self.placed(conn, hdr);
            }
            Ok(region) => {
                // SAFETY: check_incoming proved offset + length <= region length.
                let dst = unsafe { region.as_ptr().add(hdr.offset as usize) };
                let guard = InFlight::new(&region);
                let ud = self.add_op(Op::DataRecvPayload {
                    conn,
                    hdr,
                    _guard: guard,
                });
                let e = opcode::Recv::new(types::Fd(fd), dst, hdr.length)
                    .flags(libc::MSG_WAITALL)
                    .build()
                    .user_data(ud);
                // SAFETY: the destination lies inside a registered region that the op's
                // guard keeps alive and marks in flight (so it cannot be deregistered).
                unsafe { self.push(e) };
            }
            Err(error) => {
                debug!(conn, error = %error, "rejecting an incoming write; discarding its payload");
                self.discard(conn, fd, hdr, hdr.length as u64, error.to_string(), None);
                self.events.push_back(Event::WriteRejected {
                    conn: ConnId(conn),
                    error,
                });
            }
        }
    }

    fn discard(&mut self, conn: u64, fd: i32, hdr: Header, remaining: u64, reason: String, buf: Option<Box<[u8]>>) {
        if remaining == 0 {
            let c = self.conns.get_mut(&conn).expect("live");
            if let Some(seq) = c.ack_to_send.take() {
                let mut h = Header::new(Kind::Ack, 0);
                h.seq = seq;
                self.queue_ctrl(conn, h, Payload::None, None);
            }
            let body = reason.into_bytes();
            let mut h = Header::new(Kind::Nack, body.len() as u32);
            h.seq = hdr.seq;
            self.queue_ctrl(conn, h, Payload::Owned(body), None);
            self.arm_data_header(conn);
            return;
        }
        let mut buf = buf.unwrap_or_else(|| vec![0u8; DISCARD_CHUNK].into_boxed_slice());
        let n = remaining.min(DISCARD_CHUNK as u64) as u32;
        let p = buf.as_mut_ptr();
        let ud = self.add_op(Op::DataDiscard {
            conn,
            hdr,
            remaining,
            reason,
            buf,
        });
        let e = opcode::Recv::new(types::Fd(fd), p, n)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(ud);
        // SAFETY: the scratch buffer is owned by the op.
        unsafe { self.push(e) };
    }

    fn on_discard(&mut self, conn: u64, res: i32, hdr: Header, remaining: u64, reason: String, buf: Box<[u8]>) {
        let Some(c) = self.conns.get(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        if res <= 0 {
            let e = self.lost(conn, "discarding a rejected write", (res < 0).then(|| errno(res)));
            return self.fail(conn, e);
        }
        self.stats.rx_write_discarded_bytes += res as u64;
        let fd = c.data.as_ref().expect("data socket").as_raw_fd();
        self.discard(conn, fd, hdr, remaining - res as u64, reason, Some(buf));
    }

    fn on_data_payload(&mut self, conn: u64, res: i32, hdr: Header) {
        let Some(c) = self.conns.get(&conn) else { return };
        if c.state == State::Dead {
            return;
        }
        if res != hdr.length as i32 {
            let e = self.lost(conn, "receiving a write payload", (res < 0).then(|| errno(res)));
            return self.fail(conn, e);
        }
        self.stats.rx_write_direct_bytes += res as u64;
        self.placed(conn, hdr);
    }

    fn placed(&mut self, conn: u64, hdr: Header) {
        if hdr.flags & frame::FLAG_IMM != 0 {
            self.events.push_back(Event::WriteReceived {
                conn: ConnId(conn),
                region: hdr.region,
                offset: hdr.offset,
                len: hdr.length as u64,
                imm: hdr.imm,
            });
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            c.ack_to_send = Some(hdr.seq);
        }
        self.dirty.push(conn);
        self.arm_data_header(conn);
    }

    // ---------------------------------------------------------------- progress

    fn check_deadlines(&mut self) {
        let now = Instant::now();
        let peer_timeout = self.cfg.peer_timeout;
        let mut expired = Vec::new();
        for c in self.conns.values() {
            if !c.is_live() {
                continue;
            }
            if c.deadline.is_some_and(|d| d <= now) {
                let (op, after) = if c.state == State::Closing {
                    ("graceful close", self.cfg.close_timeout)
                } else {
                    ("handshake", self.cfg.handshake_timeout)
                };
                expired.push((c.id, op, after, c.peer()));
            } else if c.awaiting_ack.front().is_some_and(|a| now - a.since > peer_timeout) {
                expired.push((c.id, "write acknowledgement", peer_timeout, c.peer()));
            }
        }
        for (id, op, after, peer) in expired {
            let e = Error::Timeout {
                op,
                peer,
                after_ms: after.as_millis() as u64,
            };
            self.fail(id, e);
        }
        let late: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.done && p.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            let peer = self.pending[&id].addr.to_string();
            let e = Error::Timeout {
                op: "handshake (first frame)",
                peer,
                after_ms: self.cfg.handshake_timeout.as_millis() as u64,
            };
            self.reject_pending(id, e, None);
        }
    }

    fn progress(&mut self, wait: Option<Duration>) -> Result<()> {
        self.check_deadlines();
        self.flush();
        let block = wait.filter(|_| self.events.is_empty());
        let r = match block {
            Some(d) => {
                let ts = types::Timespec::from(d);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
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
        self.flush();
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

    fn drain_events(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        let n = max.min(self.events.len());
        out.extend(self.events.drain(..n));
        n
    }

    fn nearest_deadline(&self) -> Option<Instant> {
        let conn_d = self.conns.values().filter_map(|c| c.deadline).min();
        let pend_d = self.pending.values().filter(|p| !p.done).map(|p| p.deadline).min();
        [conn_d, pend_d].into_iter().flatten().min()
    }

    fn ready_conn(&mut self, conn: ConnId, op: &'static str) -> Result<&mut Conn> {
        let c = self.conn_mut(conn, op)?;
        match c.state {
            State::Ready => Ok(c),
            State::Closing => Err(Error::UnknownConnection { op, conn: conn.0 }),
            _ => Err(Error::NotConnected { op, conn: conn.0 }),
        }
    }

    fn check_source(&self, src: &Slice, op: &'static str) -> Result<()> {
        let r = src.region();
        if !self.regions.get(&r.key()).is_some_and(|x| x.same(r)) {
            return Err(Error::UnknownRegion {
                op,
                region: r.key(),
                generation: r.generation(),
            });
        }
        Ok(())
    }
}

impl Transport for TcpTransport {
    fn properties(&self) -> &Properties {
        &self.props
    }

    fn listen(&mut self, addr: SocketAddr) -> Result<ListenerId> {
        let l = std::net::TcpListener::bind(addr).map_err(|source| Error::Io {
            op: "listen (bind)",
            peer: Some(addr),
            source,
        })?;
        let bound = l.local_addr().map_err(|source| Error::Io {
            op: "listen (local_addr)",
            peer: Some(addr),
            source,
        })?;
        let id = self.id();
        self.listeners.insert(
            id,
            Listener {
                fd: OwnedFd::from(l),
                addr: bound,
                accepted: VecDeque::new(),
                armed: false,
            },
        );
        self.arm_accept(id);
        info!(addr = %bound, "listening");
        Ok(ListenerId(id))
    }

    fn listener_addr(&self, listener: ListenerId) -> Result<SocketAddr> {
        self.listeners
            .get(&listener.0)
            .map(|l| l.addr)
            .ok_or(Error::UnknownListener {
                op: "listener_addr",
                listener: listener.0,
            })
    }

    fn connect(&mut self, addr: SocketAddr) -> Result<ConnId> {
        let fd = sys::socket_for(&addr)?;
        sys::tune(fd.as_raw_fd(), &self.sockopts)?;
        let conn = self.new_conn(Side::Client, addr, fd, None);
        self.start_connect(conn, false)?;
        Ok(ConnId(conn))
    }

    fn accept(&mut self, listener: ListenerId) -> Result<Option<(ConnId, PeerInfo)>> {
        let l = self.listeners.get_mut(&listener.0).ok_or(Error::UnknownListener {
            op: "accept",
            listener: listener.0,
        })?;
        Ok(l.accepted.pop_front())
    }

    fn register(&mut self, buf: PinnedBuffer, access: Access) -> Result<Region> {
        if buf.len() > u32::MAX as usize {
            return Err(Error::TooLarge {
                op: "register",
                len: buf.len() as u64,
                max: u32::MAX as u64,
            });
        }
        let mut key = auth::random_u32();
        while key == 0 || self.regions.contains_key(&key) {
            key = auth::random_u32();
        }
        let generation = (self.id() & 0xffff_ffff) as u32;
        let mut fixed = None;
        if self.fixed_ok && buf.len() <= 1 << 30 {
            if let Some(slot) = self.fixed_free.pop() {
                let iov = libc::iovec {
                    iov_base: buf.as_ptr() as *mut libc::c_void,
                    iov_len: buf.len(),
                };
                // SAFETY: the buffer outlives its fixed-table slot: the slot is cleared in
                // `deregister`, and the ring (which drops the table) is dropped before any
                // region memory that `self.regions` keeps alive.
                match unsafe { self.ring.submitter().register_buffers_update(slot as u32, &[iov], None) } {
                    Ok(_) => fixed = Some(slot),
                    Err(e) => {
                        debug!(error = %e, "fixed-buffer registration refused (memlock?); SEND_ZC uses plain buffers");
                        self.fixed_free.push(slot);
                    }
                }
            }
        }
        let r = Region::new(buf, key, generation, access, fixed);
        self.regions.insert(key, r.clone());
        debug!(key = format_args!("{key:#x}"), len = r.len(), ?access, fixed = ?fixed, "registered region");
        if access.remote_write {
            self.broadcast_regions(r.remote(), false);
        }
        Ok(r)
    }

    fn deregister(&mut self, region: &Region) -> Result<()> {
        let known = self.regions.get(&region.key()).is_some_and(|r| r.same(region));
        crate::memory::check_deregister(known, region)?;
        self.regions.remove(&region.key());
        region.0.registered.store(false, std::sync::atomic::Ordering::Release);
        if let Some(slot) = region.0.fixed_index {
            let iov = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            // SAFETY: clearing a slot references no memory.
            if unsafe { self.ring.submitter().register_buffers_update(slot as u32, &[iov], None) }.is_ok() {
                self.fixed_free.push(slot);
            }
        }
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
        let mut v: Vec<_> = c.remote.values().copied().collect();
        v.sort_by_key(|r| r.rkey);
        Ok(v)
    }

    fn send(&mut self, conn: ConnId, src: &Slice, tag: u32) -> Result<ReqId> {
        self.check_source(src, "send")?;
        let max = self.cfg.max_message_bytes;
        if src.len() > max {
            return Err(Error::TooLarge {
                op: "send",
                len: src.len() as u64,
                max: max as u64,
            });
        }
        let limit = self.cfg.max_outstanding;
        let req = ReqId(self.next_req);
        let c = self.ready_conn(conn, "send")?;
        if c.outstanding >= limit {
            return Err(Error::WouldBlock {
                op: "send",
                conn: conn.0,
                limit,
            });
        }
        c.outstanding += 1;
        self.next_req += 1;
        let mut h = Header::new(Kind::Message, src.len() as u32);
        h.imm = tag;
        let guard = InFlight::new(src.region());
        self.queue_ctrl(
            conn.0,
            h,
            Payload::Region {
                slice: src.clone(),
                _guard: guard,
            },
            Some((req, false)),
        );
        Ok(req)
    }

    fn write(
        &mut self,
        conn: ConnId,
        src: &Slice,
        dst: &RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> Result<ReqId> {
        self.check_source(src, "write")?;
        check_write(src, dst, dst_offset, frame::MAX_WRITE_BYTES as usize)?;
        let limit = self.cfg.max_outstanding;
        let req = ReqId(self.next_req);
        {
            let c = self.ready_conn(conn, "write")?;
            if c.outstanding >= limit {
                return Err(Error::WouldBlock {
                    op: "write",
                    conn: conn.0,
                    limit,
                });
            }
            c.outstanding += 1;
        }
        self.next_req += 1;
        let c = self.conns.get_mut(&conn.0).expect("checked above");
        let seq = c.next_write_seq;
        c.next_write_seq += 1;
        let mut h = Header::new(Kind::Write, src.len() as u32);
        h.region = dst.rkey;
        h.generation = dst.generation;
        h.offset = dst_offset;
        h.seq = seq;
        if let Some(i) = imm {
            h.imm = i;
            h.flags |= frame::FLAG_IMM;
        }
        c.data_tx.push_back(WriteReq {
            req,
            hdr: h.encode(),
            src: src.clone(),
            guard: InFlight::new(src.region()),
            seq,
        });
        self.dirty.push(conn.0);
        Ok(req)
    }

    fn poll(&mut self, events: &mut Vec<Event>, max: usize) -> Result<usize> {
        if self.events.len() < max {
            self.progress(None)?;
        }
        Ok(self.drain_events(events, max))
    }

    fn wait(&mut self, events: &mut Vec<Event>, max: usize, timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        let end = start + timeout;
        // Bounded busy-poll: completions appear in shared memory without a syscall.
        let spin_end = start + self.cfg.busy_poll.min(timeout);
        self.progress(None)?;
        while self.events.is_empty() && Instant::now() < spin_end {
            if self.ring.completion().is_empty() {
                std::hint::spin_loop();
                continue;
            }
            self.progress(None)?;
        }
        if !self.events.is_empty() {
            return Ok(self.drain_events(events, max));
        }
        loop {
            let now = Instant::now();
            let mut slice = end.saturating_duration_since(now);
            if let Some(d) = self.nearest_deadline() {
                slice = slice.min(d.saturating_duration_since(now) + Duration::from_millis(1));
            }
            self.progress(Some(slice))?;
            if !self.events.is_empty() || Instant::now() >= end {
                return Ok(self.drain_events(events, max));
            }
        }
    }

    fn close(&mut self, conn: ConnId) -> Result<()> {
        let close_timeout = self.cfg.close_timeout;
        let c = self.conn_mut(conn, "close")?;
        match c.state {
            State::Ready => {
                c.state = State::Closing;
                c.local_close = true;
                c.deadline = Some(Instant::now() + close_timeout);
                self.dirty.push(conn.0);
            }
            State::Closing => {}
            _ => {
                // Abort a handshake in progress: nothing was exchanged yet.
                c.state = State::Dead;
                for fd in [&c.ctrl, &c.data].into_iter().flatten() {
                    sys::shutdown(fd, libc::SHUT_RDWR);
                }
                self.reap(conn.0);
            }
        }
        Ok(())
    }

    fn counters(&self) -> crate::api::Counters {
        crate::api::Counters {
            rx_direct_bytes: self.stats.rx_write_direct_bytes,
            rx_copied_bytes: self.stats.rx_user_copy_bytes,
        }
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
            let placeholder = self.regions.drain().collect::<Vec<_>>();
            std::mem::forget(placeholder);
        }
    }
}
