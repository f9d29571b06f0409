//! Configuration and counters of the io_uring TCP backend.

use std::time::Duration;

use crate::auth::JobSecret;
use crate::frame;

/// Configuration of a [`TcpTransport`](super::TcpTransport).
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
    /// Handshake deadline, separate from any job timeout: an accepted socket
    /// must finish authenticating, and an outgoing connect must be
    /// authenticated, this long after the socket was accepted or the connect
    /// started. Unauthenticated peers hold resources until then, so keep it short.
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
    /// every size (see the book, `docs/src/benchmarks.md`, "SEND_ZC threshold").
    /// Only while it is set does `register` give a region a fixed-buffer slot
    /// (which pins, and so faults in, all of its pages at once).
    pub send_zc_min_bytes: Option<usize>,
    /// `wait` first spins this long watching the completion ring (no syscalls)
    /// before it sleeps in the kernel; it trades CPU for wake-up latency, as
    /// RDMA busy-polling does. `Duration::ZERO` never spins.
    pub busy_poll: Duration,
    /// Hold a placed write's Ack until a control frame goes out on its
    /// connection anyway, [`ACK_EVERY`](super::state::ACK_EVERY) writes wait for
    /// it, or `wait` is about to sleep ([`Acks::Lazy`](super::state::Acks)),
    /// instead of sending it from the same `wait` or `poll` that placed the
    /// write. It saves a send per Ack, but only for a caller that keeps calling
    /// `wait` until it has nothing left to do: a caller that stops driving the
    /// transport (to block on something else) leaves the Acks it holds unsent,
    /// and its peers' writes incomplete. Off by default; Tidewire's runtime,
    /// whose loop sleeps only in `wait`, turns it on.
    pub lazy_acks: bool,
    /// Provided buffers for control receives (power of two) and their size
    /// (4 KiB ..= [`PRE_AUTH_MAX_BYTES`](crate::frame::PRE_AUTH_MAX_BYTES) / 2,
    /// so that one receive cannot push an unauthenticated connection past its bound).
    pub recv_buffers: u16,
    pub recv_buffer_bytes: u32,
}

impl TcpConfig {
    /// Defaults for a job: 1024-entry ring, 256 outstanding, 5 s handshake, 30 s peer timeout.
    pub fn new(job_id: u64, rank: u32, secret: JobSecret) -> Self {
        TcpConfig {
            job_id,
            rank,
            secret,
            ring_entries: 1024,
            max_outstanding: 256,
            max_message_bytes: frame::MAX_MESSAGE_BYTES as usize,
            handshake_timeout: Duration::from_secs(5),
            peer_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(5),
            sndbuf_bytes: None,
            rcvbuf_bytes: None,
            send_zc_min_bytes: None,
            busy_poll: Duration::from_micros(100),
            lazy_acks: false,
            recv_buffers: 256,
            recv_buffer_bytes: 16 * 1024,
        }
    }
}

/// Counters of the data path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Payload bytes user space copied on the control receive path: every
    /// message byte once (from a provided buffer into the message's `Vec`), and
    /// the payload of a control frame cut by a buffer's end (assembled; frames
    /// whole in a buffer are parsed in place). Write payloads are counted
    /// in [`rx_write_staged_bytes`](Self::rx_write_staged_bytes) and
    /// [`rx_write_direct_bytes`](Self::rx_write_direct_bytes), never here.
    pub rx_user_copy_bytes: u64,
    /// Write payload bytes received by a recv whose buffer was the destination region.
    pub rx_write_direct_bytes: u64,
    /// Write payload bytes that arrived in the data socket's read-ahead buffer and
    /// were copied from there into the region (one user-space copy): whole small
    /// writes, and at most one buffer's worth (64 KiB) of the start of a larger one.
    pub rx_write_staged_bytes: u64,
    /// Times a data-socket receive ended inside a write header (the rest of the
    /// header came with a later receive).
    pub rx_headers_split: u64,
    /// Write payload bytes discarded because the write was rejected.
    pub rx_write_discarded_bytes: u64,
    /// Payload bytes sent from registered memory (messages and writes).
    pub tx_payload_bytes: u64,
    /// Writes sent by SEND_ZC.
    pub tx_zc_writes: u64,
    /// Send SQEs pushed (a gathered SENDMSG of frames or writes is one; a
    /// SEND_ZC write is two: its header and its payload).
    pub tx_sends: u64,
    /// Submissions to the kernel (io_uring_enter calls that submitted).
    pub submits: u64,
    /// Unauthenticated connections closed because
    /// [`MAX_PENDING_HANDSHAKES`](crate::frame::MAX_PENDING_HANDSHAKES) others
    /// were pending when another was accepted (the oldest is closed).
    pub handshakes_evicted: u64,
    /// Unauthenticated connections refused for a frame their handshake state
    /// does not allow (kind or length, judged on the header alone) or for
    /// exceeding [`PRE_AUTH_MAX_BYTES`](crate::frame::PRE_AUTH_MAX_BYTES).
    pub pre_auth_refused: u64,
}
