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
    /// Deregistration was refused because operations still use the region.
    #[error("deregister region {region:#x}: {in_flight} operation(s) still in flight; retry after their completions")]
    RegionBusy { region: u32, in_flight: usize },
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
}
