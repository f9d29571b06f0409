//! The portable TCP backend: the same wire protocol, authentication and
//! [`Transport`](crate::Transport) contract as the io_uring backend
//! ([`crate::tcp`]), on plain non-blocking sockets and epoll readiness (through
//! `mio`). It runs where io_uring is not allowed: Docker's default seccomp
//! profile, containerd's `RuntimeDefault`, `kernel.io_uring_disabled`, gVisor.
//! One job can mix the two backends: a portable rank and an io_uring rank
//! speak byte for byte the same protocol.
//!
//! # Design
//! Each connection is two TCP sockets bound together by the authenticated
//! handshake ([`crate::handshake`], a sans-IO state machine this backend drives):
//! - the **control socket** carries the handshake, messages, region
//!   announcements, write acknowledgements and the close. During the handshake
//!   it is read one frame at a time, header first: a header is checked against
//!   the handshake state before any payload byte is read. Afterwards it is read
//!   in large chunks and frames are reassembled in a reused buffer.
//! - the **data socket** carries one-sided writes. Its receive side reads the
//!   40-byte header, checks region, generation, access and bounds (the
//!   `check_incoming` both backends share, in `crate::conn_core`), and then
//!   `recv(2)`s the payload straight into
//!   the registered region ([`Region`](crate::Region)'s `recv_into`): user space
//!   copies nothing. A rejected write's payload is read into a reused scratch
//!   buffer and dropped, and the writer gets a `Nack`.
//!
//! Sends gather queued frames into one `sendmsg(2)` (MSG_NOSIGNAL) whose
//! iovecs point into the registered regions; a partial send keeps its offset,
//! and a full socket buffer (EAGAIN) waits for writability: back-pressure is
//! never failure. The outstanding bound and the message cap are the io_uring
//! backend's (`WouldBlock`, `TooLarge`).
//!
//! `wait` sleeps in `epoll_wait` (the waker's eventfd is registered in the
//! same poller) until readiness, a wake, the nearest deadline (handshake,
//! close, unacknowledged write) or its timeout; it never spins unless
//! `busy_poll` asks it to. Steady-state sends, writes and polls allocate
//! nothing (scratch iovecs, event lists and buffers are reused; peer names are
//! built only for errors); a received message's bytes are the one exception,
//! since `Event::Message` owns them.
//!
//! Pre-authentication limits ([`crate::handshake`]): [`PRE_AUTH_MAX_BYTES`]
//! per connection, [`MAX_PENDING_HANDSHAKES`] unauthenticated inbound sockets
//! at once (past it the oldest is closed, reported as `TooManyHandshakes`, as in the io_uring backend), and the
//! `handshake_timeout` deadline.
//!
//! [`PRE_AUTH_MAX_BYTES`]: crate::handshake::PRE_AUTH_MAX_BYTES
//! [`MAX_PENDING_HANDSHAKES`]: crate::handshake::MAX_PENDING_HANDSHAKES
//!
//! # Modules
//! - `config`: [`PortableStats`], the mio token layout and buffer sizes.
//! - `state`: listeners, pending sockets, connections, queued frames and writes.
//! - `handshake`: accept, first-frame classification, driving the sans-IO handshake, refusals.
//! - `rx`: control frame reassembly, placement of writes straight into regions.
//! - `tx`: gathered `sendmsg` of control frames and writes, partial sends.
//! - `transport`: [`PortableTransport`]: the poller, the event loop, connection
//!   lifecycle and deadlines, and the [`Transport`](crate::Transport) implementation.
//!
//! What both TCP backends do alike (the region table and `check_incoming`, the
//! admission checks of `send`, `write`, `register` and `deregister`, the queued
//! frames and writes, Ack/Nack/Regions handling, deadlines) is the sans-IO
//! `crate::conn_core`, which this backend drives with its own syscalls.
//!
//! The configuration is the io_uring backend's [`TcpConfig`](crate::TcpConfig)
//! (`ring_entries`, `send_zc_min_bytes` and the receive-buffer knobs are ignored).

mod config;
mod handshake;
mod rx;
mod state;
mod transport;
mod tx;

pub use config::PortableStats;
pub use transport::PortableTransport;
