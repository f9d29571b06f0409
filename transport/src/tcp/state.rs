//! Connection state: listeners, accepted sockets not yet classified, and
//! connections with their handshake state machine and queues.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::time::Instant;

use crate::api::{ConnId, PeerInfo};
use crate::auth::Transcript;
use crate::error::Error;
use crate::frame::Header;
use crate::memory::RemoteRegion;

use super::op::{AwaitAck, Stage, TxFrame, WriteReq};

pub(super) use crate::conn_core::Side;

crate::conn_core::state_enum! {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum State {
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
}

impl State {
    /// Whether the handshake is still running (a frame here is the handshake's).
    pub(super) fn is_handshake(self) -> bool {
        matches!(
            self,
            State::AwaitChallenge | State::AwaitReady | State::AwaitAuth | State::AwaitData
        )
    }
}

pub(super) struct Listener {
    pub(super) fd: OwnedFd,
    pub(super) addr: SocketAddr,
    pub(super) accepted: VecDeque<(ConnId, PeerInfo)>,
    pub(super) armed: bool,
}

/// A socket accepted but not yet classified by its first frame.
pub(super) struct Pending {
    pub(super) fd: Option<OwnedFd>,
    pub(super) addr: SocketAddr,
    pub(super) listener: u64,
    pub(super) deadline: Instant,
    pub(super) ops: usize,
    pub(super) done: bool,
}

pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) side: Side,
    pub(super) state: State,
    pub(super) peer_addr: SocketAddr,
    pub(super) peer_rank: u32,
    pub(super) listener: Option<u64>,
    pub(super) ctrl: Option<OwnedFd>,
    pub(super) data: Option<OwnedFd>,
    pub(super) transcript: Transcript,
    /// Server: a data socket (pending id, proof checked) that arrived before the
    /// client's Auth frame; attached once the Auth is in.
    pub(super) parked_data: Option<u64>,
    pub(super) deadline: Option<Instant>,
    /// A control frame being assembled (at most one; never a message's payload).
    pub(super) ctrl_rx: Vec<u8>,
    /// Its steady-state room is reserved (`reserve_for_ready`), and counted in
    /// the transport's op budget until it is reaped.
    pub(super) reserved: bool,
    /// A message being received: its header and its payload so far, straight
    /// from the receive buffers (the payload's one copy in user space).
    pub(super) msg_rx: Option<(Header, Vec<u8>)>,
    /// The op slot of the control socket's armed multishot receive, until
    /// its last completion (a failed connection cancels it: see `fail`).
    pub(super) ctrl_rx_op: Option<u64>,
    pub(super) ctrl_tx: VecDeque<TxFrame>,
    pub(super) ctrl_tx_busy: bool,
    pub(super) data_tx: VecDeque<WriteReq>,
    pub(super) data_tx_busy: bool,
    pub(super) data_rx_armed: bool,
    /// The data socket's read-ahead buffer while no receive into it is in flight
    /// (allocated on the first arm, then reused).
    pub(super) data_stage: Option<Stage>,
    pub(super) awaiting_ack: VecDeque<AwaitAck>,
    /// Highest write sequence the peer has acknowledged. The target may place a
    /// write and acknowledge it before the SENDMSG carrying it (and later writes)
    /// completes here; such a write is done as soon as its send completes.
    pub(super) acked_through: u64,
    /// Nacks (sequence, reason) for writes whose send had not completed yet;
    /// at most one per write posted.
    pub(super) early_nacks: HashMap<u64, String>,
    pub(super) next_write_seq: u64,
    pub(super) ack_to_send: Option<u64>,
    /// Writes placed since the last Ack went out (see [`super::tx::Acks::Lazy`]).
    pub(super) acks_held: u32,
    pub(super) outstanding: usize,
    pub(super) remote: HashMap<u32, RemoteRegion>,
    pub(super) ops: usize,
    pub(super) local_close: bool,
    pub(super) sent_close: bool,
    pub(super) peer_closed: bool,
    pub(super) error: Option<Error>,
    pub(super) closed_reported: bool,
    pub(super) span: tracing::Span,
}

pub(super) use crate::conn_core::peer_name;

impl Conn {
    /// The peer's name, for errors and logs only (it allocates).
    pub(super) fn peer(&self) -> String {
        peer_name(self.peer_addr, self.peer_rank)
    }
    pub(super) fn is_live(&self) -> bool {
        !matches!(self.state, State::Dead)
    }
}

/// Whether a flush sends the pending Acks (held only with [`TcpConfig::lazy_acks`](super::TcpConfig::lazy_acks)) ([`TcpTransport::flush`](super::TcpTransport::flush)).
///
/// An Ack is cumulative: one frame acknowledges every write placed through
/// its sequence number, so holding it costs the sender nothing but time, and
/// saves a send per hold. [`TcpTransport::progress`](super::TcpTransport::progress) sends every pending Ack
/// before the ring sleeps ([`Acks::Send`]) and otherwise holds them
/// ([`Acks::Lazy`]): an Ack then goes out with the next control frame its
/// connection sends anyway (a reply, a credit: one gathered send instead of
/// two), or once [`ACK_EVERY`] writes wait for it. A sender therefore waits
/// for an Ack at most until the receiving thread has nothing else to do, and
/// never for more than [`ACK_EVERY`] placements while it is busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Acks {
    /// Every connection's pending Ack goes out.
    Send,
    /// A connection's pending Ack goes out if a control frame goes out on it
    /// in this flush, or if [`ACK_EVERY`] writes wait for it; else it stays
    /// pending, and the connection dirty, for the next flush.
    Lazy,
}

/// Placed writes after which a held Ack goes out even while the receiver is busy.
/// Well under a sender's outstanding bound (256 by default), so a sender at its
/// bound is not left waiting on a busy receiver.
pub(super) const ACK_EVERY: u32 = 16;
