//! The io_uring TCP backend: the control plane everywhere, and the default
//! data plane on machines without RDMA.
//!
//! # Design
//! Each connection is two TCP sockets, bound together by the authenticated
//! handshake:
//! - the **control socket** carries the handshake, messages, region
//!   announcements and write acknowledgements. It is read by one multishot
//!   `RECV` with a provided-buffer ring. Frames whole in a provided buffer are
//!   handled in place; a frame cut by a buffer's end is assembled in a per-
//!   connection buffer that holds at most one frame. A message's payload goes
//!   from the provided buffers straight into the `Vec` that `Event::Message`
//!   hands the application: one copy in user space, counted in
//!   [`TcpStats::rx_user_copy_bytes`].
//! - the **data socket** carries one-sided writes only. Its receive side reads
//!   ahead: one `RECV` (no MSG_WAITALL) takes whatever the socket holds into a
//!   64 KiB staging buffer per connection (owned by the op while in flight,
//!   reused), and every complete header there is checked (target region,
//!   bounds, generation). A write whose payload is wholly in the stage is
//!   copied once from it into the region with [`Region::write_at`](crate::Region::write_at)
//!   (small writes: one ring round trip serves many); a larger one has its
//!   staged start copied the same way and the rest received by one `RECV`
//!   (MSG_WAITALL) whose buffer is the destination inside the region, so the
//!   kernel copies it straight into place and user space copies at most one
//!   stage's worth of it. A header cut by a receive's end stays in the stage
//!   for the next. [`TcpStats::rx_write_staged_bytes`] and
//!   [`TcpStats::rx_write_direct_bytes`] count the two ways in;
//!   [`TcpStats::rx_user_copy_bytes`] counts the control socket's. A staged copy
//!   into a range under a local lease is refused (the write is rejected), since
//!   Rust would be writing leased bytes.
//!
//! Splitting the two keeps a 64 MiB write from delaying an acknowledgement or a
//! control message behind it (no head-of-line blocking).
//!
//! Sends go straight from registered memory: up to 64 queued frames are
//! gathered into one `SENDMSG` (MSG_WAITALL) whose iovecs point into the
//! regions. Writes of at least [`TcpConfig::send_zc_min_bytes`] use `SEND_ZC`
//! from the io_uring fixed-buffer table instead (regions are registered there
//! when the memlock limit allows). See the book (`docs/src/benchmarks.md`) for the measured threshold.
//!
//! # Unauthenticated peers
//! A socket's first frame must be a `Hello` or `DataAttach` of at most 256
//! bytes; afterwards, while the handshake runs, each control frame is judged
//! on its header alone (kind and length against the handshake state, see
//! `handshake::admissible`) before any payload is read. Before it has
//! authenticated a connection may make this side hold at most
//! [`PRE_AUTH_MAX_BYTES`](crate::frame::PRE_AUTH_MAX_BYTES) (the reassembly
//! buffer included; a provided buffer is at most half of it). At most
//! [`MAX_PENDING_HANDSHAKES`](crate::frame::MAX_PENDING_HANDSHAKES) accepted
//! connections may be unauthenticated at once: accepting another closes the
//! oldest at once ([`TcpStats::handshakes_evicted`]), so that silent
//! connections cannot keep a real peer out (a peer needs milliseconds to
//! authenticate; an attacker would have to open 64 connections within them).
//! Every handshake, accepted or dialled, has [`TcpConfig::handshake_timeout`]
//! from its accept or connect.
//!
//! # Safety model
//! Every submitted SQE has an entry in the op table that owns all memory the
//! kernel may touch (headers, iovecs, msghdrs, sockaddrs, and a region guard
//! that keeps the region alive and counts it in flight). An entry is freed only
//! on the op's final completion; a send's gather (iovecs and msghdr), its
//! frame or write list and a SEND_ZC header are then recycled for later sends,
//! so steady-state sends, receives and polls allocate nothing
//! (`tests/steady_alloc.rs` counts). On drop the transport shuts every socket down,
//! cancels all ops and drains their completions before the ring and the
//! memory go away.
//!
//! # Modules
//! - `config`: [`TcpConfig`] and [`TcpStats`].
//! - `sys`: sockets, socket options, addresses, the provided-buffer ring.
//! - `op`: the op table's entries and the memory each owns.
//! - `state`: listeners, pending sockets, connections and their states.
//! - `ring`: [`TcpTransport`]: the ring, the op table, submission, completion dispatch, drop.
//! - `conn`: connection lifecycle: failure, reaping, close completion, deadlines.
//! - `handshake`: accept, first-frame classification, challenge-response, data attach, refusals.
//! - `tx`: control frames and writes out (gathered SENDMSG, SEND_ZC), send completions.
//! - `rx`: control frame reassembly, placement of writes straight into regions.
//! - `transport`: the [`Transport`](crate::Transport) implementation.
//!
//! What both TCP backends do alike (the region table and `check_incoming`, the
//! admission checks of `send`, `write`, `register` and `deregister`, the queued
//! frames and writes, Ack/Nack/Regions handling, deadlines) is the sans-IO
//! `crate::conn_core`, which this backend drives with its own submissions.

mod config;
mod conn;
mod handshake;
mod op;
mod ring;
mod rx;
mod state;
pub(crate) mod sys;
mod transport;
mod tx;

pub use config::{TcpConfig, TcpStats};
pub use ring::TcpTransport;
