//! The one error type of `tidewire-transport`.

use std::io;
use std::net::SocketAddr;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every way a transport operation can fail. Each variant names the operation
/// and carries the context a caller needs to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Pinning memory failed because RLIMIT_MEMLOCK is too low.
    #[error(
        "mlock of {requested_bytes} bytes failed: RLIMIT_MEMLOCK is {limit} \
         (already locked by this process: {locked_bytes} bytes). Raise it with `ulimit -l unlimited` \
         (root or CAP_IPC_LOCK), a `memlock` line in /etc/security/limits.conf, or \
         LimitMEMLOCK=infinity in a systemd unit; non-root users here default to 8 MiB"
    )]
    MemlockLimit {
        requested_bytes: usize,
        limit: String,
        locked_bytes: usize,
        #[source]
        source: io::Error,
    },
    /// Mapping or pinning memory failed for another reason.
    #[error("allocating {bytes} bytes of {what} failed")]
    Alloc {
        bytes: usize,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// An argument was out of range; nothing was done.
    #[error("invalid argument to {op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },
    /// A local slice or remote write fell outside a registered region.
    #[error("{op}: range {offset}+{len} is outside region {region:#x} of {region_len} bytes")]
    OutOfBounds {
        op: &'static str,
        region: u32,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    /// The region is not (or no longer) registered, or its generation is stale.
    #[error("{op}: unknown or stale region {region:#x} (generation {generation})")]
    UnknownRegion {
        op: &'static str,
        region: u32,
        generation: u32,
    },
    /// The region is not registered for the access the operation needs.
    #[error("{op}: region {region:#x} does not allow {needed}")]
    AccessDenied {
        op: &'static str,
        region: u32,
        needed: &'static str,
    },
    /// The region (or the range) is in use: deregistration while operations are in
    /// flight, or a lease or copy of bytes that a live lease covers. Nothing was done.
    #[error(
        "{op}: region {region:#x} is in use by {in_flight} in-flight operation(s) or overlapping lease(s); \
         retry after they complete or are dropped"
    )]
    RegionBusy {
        op: &'static str,
        region: u32,
        in_flight: usize,
    },
    /// The per-connection bound on outstanding requests is reached: poll, then call again.
    #[error("{op} on connection {conn}: {limit} requests outstanding (the bound); poll completions and retry")]
    WouldBlock { op: &'static str, conn: u64, limit: usize },
    /// A message is larger than the transport's maximum.
    #[error("{op}: {len} bytes exceeds the maximum of {max}")]
    TooLarge { op: &'static str, len: u64, max: u64 },
    /// No such connection, or it is already closed.
    #[error("{op}: connection {conn} is unknown or closed")]
    UnknownConnection { op: &'static str, conn: u64 },
    /// No such listener.
    #[error("{op}: listener {listener} is unknown")]
    UnknownListener { op: &'static str, listener: u64 },
    /// The connection is not ready for data yet (handshake still running).
    #[error("{op}: connection {conn} is not established yet")]
    NotConnected { op: &'static str, conn: u64 },
    /// A socket or ring call failed.
    #[error("{op} failed{}", peer.map(|p| format!(" (peer {p})")).unwrap_or_default())]
    Io {
        op: &'static str,
        peer: Option<SocketAddr>,
        #[source]
        source: io::Error,
    },
    /// io_uring could not be set up or lacks an opcode this backend needs.
    #[error("io_uring unavailable: {reason}")]
    UringUnavailable {
        reason: String,
        #[source]
        source: Option<io::Error>,
    },
    /// A frame from the peer could not be decoded.
    #[error("bad frame from {peer}: {reason}")]
    BadFrame { peer: String, reason: FrameError },
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch with {peer}: ours {ours}, theirs {theirs}")]
    VersionMismatch { peer: String, ours: u8, theirs: u8 },
    /// The peer belongs to another job.
    #[error("job id mismatch with {peer}: ours {ours:#x}, theirs {theirs:#x}")]
    JobMismatch { peer: String, ours: u64, theirs: u64 },
    /// The peer failed the HMAC challenge (wrong job secret), or we failed its.
    #[error("authentication with {peer} failed: {reason}")]
    AuthFailed { peer: String, reason: &'static str },
    /// The peer refused us and said why.
    #[error("rejected by {peer}: {reason}")]
    Rejected { peer: String, reason: String },
    /// A deadline passed: handshake, close, or an unresponsive peer.
    #[error("{op} timed out after {after_ms} ms (peer {peer})")]
    Timeout {
        op: &'static str,
        peer: String,
        after_ms: u64,
    },
    /// The peer closed or reset the connection while work was outstanding.
    #[error("connection {conn} to {peer} lost during {during}")]
    ConnectionLost {
        conn: u64,
        peer: String,
        during: &'static str,
        #[source]
        source: Option<io::Error>,
    },
    /// The remote side rejected a one-sided write (bounds, unknown region, access).
    #[error("remote rejected write seq {seq} on connection {conn}: {reason}")]
    RemoteAccess { conn: u64, seq: u64, reason: String },
    /// The connection was closed locally before the operation completed.
    #[error("operation cancelled: connection {conn} closed")]
    Cancelled { conn: u64 },
    /// RDMA cannot be used here, and why: the `rdma` feature is off, libibverbs is
    /// missing, there is no device, or no port is ACTIVE.
    #[error("RDMA unavailable: {reason}")]
    RdmaUnavailable { reason: String },
    /// A verbs call failed; `op` names it (e.g. `ibv_reg_mr`, `ibv_modify_qp(RTR)`).
    #[error("{op} on {device} failed: {source}{}", verbs_hint(op, source))]
    Verbs {
        op: &'static str,
        device: String,
        #[source]
        source: io::Error,
    },
    /// A work completion came back with an error status (`IBV_WC_*`).
    #[error(
        "{op} on connection {conn} to {peer} failed: IBV_WC_{} (status {status}, vendor error {vendor_err:#x}){}",
        wc_status_name(*status), wc_status_hint(*status)
    )]
    WorkCompletion {
        op: &'static str,
        conn: u64,
        peer: String,
        status: u32,
        vendor_err: u32,
    },
    /// Device memory could not be exported as a dmabuf, or copied to or from the
    /// host: the failure of a `DeviceMemory` implementation (the RDMA backend's
    /// GPUDirect path), or of creating a vgem buffer.
    #[error("device memory: {op} failed: {reason}")]
    DeviceMemory {
        /// What failed, e.g. `"dmabuf export"`, `"copy to host"`, `"copy from host"`.
        op: &'static str,
        reason: String,
        /// The underlying error (a driver's, an OS error), when there is one.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// Registering device memory by dmabuf is not possible with this device or driver.
    #[error("dmabuf registration unsupported on {device}: {reason}")]
    DmabufUnsupported { device: String, reason: String },
    /// An accepted connection was closed before it authenticated because
    /// `limit` others were handshaking too (the oldest goes first).
    #[error("handshake with {peer} abandoned: {limit} unauthenticated connections were pending (the bound)")]
    TooManyHandshakes { peer: String, limit: usize },
    /// The peer broke the protocol after authentication (a write notice for a
    /// region it was never given, a credit grant past the bound); the
    /// connection is failed.
    #[error("protocol violation by {peer} on connection {conn}: {violation}")]
    Protocol {
        conn: u64,
        peer: String,
        violation: Violation,
    },
}

/// What a peer did wrong ([`Error::Protocol`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// A write notice names a region that is not registered here, or a stale generation.
    #[error("write notice for unknown or stale region {region:#x} (generation {generation})")]
    NoticeUnknownRegion { region: u32, generation: u32 },
    /// A write notice names a region that does not allow remote writes.
    #[error("write notice for region {region:#x}, which does not allow remote writes")]
    NoticeAccess { region: u32 },
    /// A write notice's range lies (partly) outside its region, or overflows.
    #[error("write notice range {offset}+{len} is outside region {region:#x} of {region_len} bytes")]
    NoticeBounds {
        region: u32,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    /// A write with an immediate left no valid notice in its ring slot.
    #[error("write with an immediate but no valid notice in ring slot {slot}")]
    NoticeMissing { slot: u64 },
    /// A write notice's length differs from the bytes that landed.
    #[error("write notice says {noticed} bytes but {landed} landed")]
    NoticeLength { noticed: u64, landed: u64 },
    /// A credit grant would raise the credits past what the peer posted, or overflow.
    #[error("credit grant of {grant} on top of {have} exceeds the maximum of {max}")]
    CreditOverflow { have: u32, grant: u32, max: u32 },
}

/// The `IBV_WC_*` name of a work-completion status (without the prefix).
pub fn wc_status_name(status: u32) -> &'static str {
    const NAMES: [&str; 24] = [
        "SUCCESS",
        "LOC_LEN_ERR",
        "LOC_QP_OP_ERR",
        "LOC_EEC_OP_ERR",
        "LOC_PROT_ERR",
        "WR_FLUSH_ERR",
        "MW_BIND_ERR",
        "BAD_RESP_ERR",
        "LOC_ACCESS_ERR",
        "REM_INV_REQ_ERR",
        "REM_ACCESS_ERR",
        "REM_OP_ERR",
        "RETRY_EXC_ERR",
        "RNR_RETRY_EXC_ERR",
        "LOC_RDD_VIOL_ERR",
        "REM_INV_RD_REQ_ERR",
        "REM_ABORT_ERR",
        "INV_EECN_ERR",
        "INV_EEC_STATE_ERR",
        "FATAL_ERR",
        "RESP_TIMEOUT_ERR",
        "GENERAL_ERR",
        "TM_ERR",
        "TM_RNDV_INCOMPLETE",
    ];
    NAMES.get(status as usize).copied().unwrap_or("UNKNOWN")
}

/// `IBV_WC_REM_ACCESS_ERR`: the target refused a one-sided access (rkey, bounds, rights).
pub const WC_REM_ACCESS_ERR: u32 = 10;
/// `IBV_WC_WR_FLUSH_ERR`: the queue pair was already in the error state.
pub const WC_WR_FLUSH_ERR: u32 = 5;
/// `IBV_WC_RETRY_EXC_ERR`: the peer stopped acknowledging (gone, or unreachable).
pub const WC_RETRY_EXC_ERR: u32 = 12;

fn wc_status_hint(status: u32) -> &'static str {
    match status {
        WC_REM_ACCESS_ERR => ": the target refused the access (unknown or revoked rkey, range outside the region, or no remote-write right)",
        WC_WR_FLUSH_ERR => ": flushed because the queue pair had already failed",
        WC_RETRY_EXC_ERR => ": the peer stopped acknowledging within timeout x retry_cnt (gone, or the path is down)",
        13 => ": the peer had no receive posted for longer than rnr_retry allows",
        1 => ": a message was larger than the receive buffer",
        4 | 8 => ": a local buffer is not registered for this access",
        _ => "",
    }
}

fn verbs_hint(op: &str, e: &io::Error) -> &'static str {
    match (op, e.raw_os_error()) {
        (_, Some(libc::ENOMEM)) if op.contains("reg_mr") => {
            "; registering pins memory and counts against RLIMIT_MEMLOCK (8 MiB for non-root users here): \
             raise it with `ulimit -l unlimited` (root or CAP_IPC_LOCK) or limits.conf"
        }
        (_, Some(libc::EPERM)) => "; this needs root or CAP_IPC_LOCK / CAP_NET_RAW, or a higher RLIMIT_MEMLOCK",
        (_, Some(libc::EOPNOTSUPP)) => "; the device, its driver or this libibverbs does not support it",
        _ => "",
    }
}

/// Why a frame failed to decode. Decoding never panics; it returns one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("unsupported version {0}")]
    BadVersion(u8),
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("payload length {len} exceeds the maximum {max}")]
    TooLong { len: u32, max: u32 },
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    #[error("malformed {what}")]
    Malformed { what: &'static str },
    #[error("unexpected {kind} frame in state {state}")]
    Unexpected { kind: &'static str, state: &'static str },
    /// Before authentication the peer made this side hold more than the bound.
    #[error("{held} bytes held before authentication exceed the bound of {max}")]
    PreAuthLimit { held: usize, max: usize },
}
