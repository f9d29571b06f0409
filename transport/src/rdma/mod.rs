//! The RDMA verbs backend (feature `rdma`): RC queue pairs over `sideway`, with
//! the authenticated io_uring TCP transport as its control plane.
//!
//! # Design
//! - **Control plane.** Every connection starts as an inner [`TcpTransport`](crate::tcp::TcpTransport)
//!   connection: the same handshake (job id, HMAC challenge, version) and the
//!   same refusals. Over it the two sides exchange QPN, PSN, GID/LID, MTU and
//!   the notification ring (`wire::QpInfo`), then READY, region descriptors,
//!   and an ABORT reason when a side fails the connection.
//! - **Data plane.** One RC queue pair per connection on one shared completion
//!   queue. A one-sided [`Transport::write`](crate::Transport::write) is an RDMA WRITE from the
//!   registered source straight into the peer's registered region: the host
//!   copies no payload on either side (see "Zero copy" below). With an
//!   immediate it is two work requests in one doorbell: a 32-byte notice
//!   (region, offset, length) written inline into the peer's notification ring,
//!   then the payload as WRITE_WITH_IMM carrying the caller's immediate. RC
//!   ordering places the notice and every earlier write before the immediate's
//!   receive completion, so `Event::WriteReceived` can name the region and range.
//!   The peer writes the notice, so it is checked like a TCP write header
//!   (`wire::check_notice`: the region is registered here with that
//!   generation and takes remote writes, the range lies inside it without
//!   overflow, the length is what landed); a bad or missing notice fails the
//!   connection with [`Error::Protocol`](crate::Error::Protocol), naming the peer.
//! - **Messages** are SEND_WITH_IMM (the immediate is the tag) into receive
//!   buffers pre-posted per connection (`rx_depth` of `max_message_bytes`).
//!   Each receive is reposted as soon as it completes, and a sender never posts
//!   more receive-consuming operations (messages and writes with an immediate)
//!   than the receiver has posted. Receive credits flow back as an inline RDMA
//!   WRITE (one per progress step that reposted receives) of the receiver's
//!   cumulative repost count into the credit word at the end of the sender's
//!   notification ring (`wire::credit_word_offset`); the sender reads the word
//!   when it posts. So no operation ever meets an empty receive queue (no RNR
//!   stalls), and steady traffic never touches the control plane.
//!   Grants are added with checked arithmetic and may never raise the credits
//!   past the receives the peer said it posted (`wire::grant_credits`; at most
//!   `wire::MAX_RX_DEPTH`); a word that grants past that, read twice alike (a
//!   single read may be torn mid-write), is [`Error::Protocol`](crate::Error::Protocol).
//! - **Posting.** Operations queue per connection and are posted at the next
//!   `poll`/`wait` in one batch (one `ibv_wr_start` ... `ibv_wr_complete`),
//!   signalled every `signal_every` work requests and at the end of each batch;
//!   work requests in flight never exceed `tx_depth`.
//! - **Completions.** Busy-polled, or event-driven through a completion channel
//!   ([`CqMode`]); `wait` first spins for `control.busy_poll`. `ibv_poll_cq`
//!   fills an array on the stack.
//! - **No allocation in steady state.** Posting, polling, notices and credit
//!   returns reuse the transport's lists and queues; peer names are formatted
//!   only for errors. A received message's `Vec` (`Event::Message`) is the one
//!   allocation, per message (`rdma_conformance`'s steady-state cases count them).
//!
//! # Zero copy
//! Sources and targets of writes, reads and messages are registered memory
//! regions (`ibv_reg_mr` over the [`PinnedBuffer`](crate::PinnedBuffer)); work requests carry their
//! addresses and keys, and the device moves the bytes. The only host copies are
//! of control data: the 32-byte notice (inline) and a received message's bytes,
//! which `Event::Message` hands over as a `Vec`. Payload inlining is off unless
//! [`RdmaConfig::max_inline_bytes`] allows it. [`RdmaStats`] counts both.
//!
//! # Failure
//! Every verbs error and every error completion becomes a typed [`Error`](crate::Error)
//! naming the operation and the peer. A failed queue pair fails its
//! connection: queued and in-flight operations end with `OpFailed`, then
//! `Closed { error }`. A vanished peer shows up as a dead control socket or as
//! IBV_WC_RETRY_EXC_ERR after `timeout` x `retry_cnt`, never as a hang.
//!
//! # Modules
//! - `config`: [`RdmaConfig`], [`CqMode`], [`ConnectMode`], [`RdmaStats`], path-MTU codes.
//! - `error`: verbs failures as [`Error`](crate::Error)s.
//! - `state`: work-request ids, queued and in-flight operations, connection state, registered regions.
//! - `ctx`: [`RdmaTransport`]: device context, PD, CQ and channel, control plane; construction, progress.
//! - `mr`: memory registration (host and dmabuf), local keys.
//! - `qp`: queue-pair setup and connection, readiness, failure, deadlines.
//! - `control`: control messages over the inner TCP transport and its events.
//! - `post`: queueing within the outstanding bound, posting within depth and credits, credit returns.
//! - `cq`: completion polling, receive reposting, sleeping on the completion channel.
//! - `transport`: the [`Transport`](crate::Transport) implementation.
//! - `cm`: the rdma_cm wrapper (queue-pair setup through it is in `qp`); `device`: device selection and probes;
//!   `gpudirect`: device memory by dmabuf or staging; `raw`: raw RC queue pairs
//!   for the perftest tools; `wire`: control-plane and notice encodings.

mod cm;
mod config;
mod control;
mod cq;
mod ctx;
pub mod device;
mod error;
pub mod gpudirect;
mod mr;
mod post;
mod qp;
pub mod raw;
mod state;
mod transport;
#[doc(hidden)] // pub for fuzz/ only
pub mod wire;

pub use config::{ConnectMode, CqMode, RdmaConfig, RdmaStats};
pub use ctx::RdmaTransport;
pub use device::{rate_limit_of, DeviceChoice, DeviceInfoSummary, Dmabuf, GidInfo, PortInfo, RateLimit};
pub use gpudirect::{DeviceMemory, DevicePath, DeviceRegistration, DmabufHandle, StageChunk, VgemBuffer};
pub use mr::{validate_dmabuf_args, DmabufRegion};

use config::{mtu_code, mtu_from_bytes, mtu_of_code};
pub(crate) use error::io_of;
use error::verbs;
