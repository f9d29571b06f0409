//! Listeners, accepted sockets not yet classified, connections, and what they queue.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::Instant;

use mio::net::{TcpListener, TcpStream};

use crate::api::{ConnId, PeerInfo};
use crate::frame::{Header, HEADER_LEN};
use crate::handshake::{Handshake, FIRST_FRAME_MAX};
use crate::memory::{InFlight, Region, RemoteRegion};

pub(super) use crate::conn_core::{AwaitAck, Payload, Side, TxFrame, WriteReq};

use super::config::CTRL_RX_BYTES;

crate::conn_core::state_enum! {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum State {
        /// Client: the control socket's TCP connect is in progress.
        Connecting,
        /// The handshake runs (see `Conn::hs`).
        Handshake,
        Ready,
        /// Graceful close under way.
        Closing,
    }
}

pub(super) struct Listener {
    pub(super) sock: TcpListener,
    pub(super) addr: SocketAddr,
    pub(super) accepted: VecDeque<(ConnId, PeerInfo)>,
}

/// An accepted socket not yet classified by its first frame.
pub(super) struct Pending {
    pub(super) sock: TcpStream,
    pub(super) addr: SocketAddr,
    pub(super) listener: u64,
    pub(super) deadline: Instant,
    pub(super) buf: [u8; HEADER_LEN + FIRST_FRAME_MAX as usize],
    pub(super) have: usize,
    pub(super) hdr: Option<Header>,
}

/// The control socket's receive buffer: valid bytes are `buf[start..end]`.
pub(super) struct CtrlRx {
    pub(super) buf: Vec<u8>,
    pub(super) start: usize,
    pub(super) end: usize,
    /// The header of the frame at `start`, once checked.
    pub(super) hdr: Option<Header>,
    /// A message being read straight into its own buffer (header, payload, bytes
    /// in so far): the socket's reads land in the buffer the application gets.
    pub(super) msg: Option<(Header, Vec<u8>, usize)>,
}

impl CtrlRx {
    pub(super) fn new() -> Self {
        CtrlRx {
            buf: vec![0; CTRL_RX_BYTES],
            start: 0,
            end: 0,
            hdr: None,
            msg: None,
        }
    }
}

/// The data socket's receive state.
pub(super) enum DataRx {
    Header {
        buf: [u8; HEADER_LEN],
        have: usize,
    },
    Payload {
        region: Region,
        _guard: InFlight,
        hdr: Header,
        done: u64,
    },
    Discard {
        hdr: Header,
        remaining: u64,
        reason: String,
    },
}

impl DataRx {
    pub(super) fn header() -> Self {
        DataRx::Header {
            buf: [0; HEADER_LEN],
            have: 0,
        }
    }
}

/// Readiness of one socket as last reported (edge-triggered: cleared on EAGAIN).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Ready {
    pub(super) rd: bool,
    pub(super) wr: bool,
}

pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) side: Side,
    pub(super) state: State,
    pub(super) hs: Option<Box<Handshake>>,
    pub(super) peer_addr: SocketAddr,
    pub(super) peer_rank: u32,
    pub(super) listener: Option<u64>,
    pub(super) ctrl: TcpStream,
    pub(super) ctrl_ready: Ready,
    pub(super) data: Option<TcpStream>,
    pub(super) data_ready: Ready,
    pub(super) data_connecting: bool,
    /// Client: the DataAttach frame, sent as the data socket's first bytes, and how much went.
    pub(super) attach: Option<(Vec<u8>, usize)>,
    pub(super) data_eof: bool,
    pub(super) deadline: Option<Instant>,
    pub(super) rx: CtrlRx,
    pub(super) drx: DataRx,
    pub(super) ctrl_tx: VecDeque<TxFrame>,
    /// Bytes of `ctrl_tx`'s front frame already sent.
    pub(super) ctrl_off: usize,
    pub(super) data_tx: VecDeque<WriteReq>,
    pub(super) data_off: usize,
    pub(super) awaiting_ack: VecDeque<AwaitAck>,
    pub(super) next_write_seq: u64,
    pub(super) ack_to_send: Option<u64>,
    pub(super) outstanding: usize,
    pub(super) remote: HashMap<u32, RemoteRegion>,
    pub(super) local_close: bool,
    pub(super) sent_close: bool,
    pub(super) peer_closed: bool,
}

impl Conn {
    /// The peer's name, for errors and logs only (it allocates).
    pub(super) fn peer(&self) -> String {
        crate::conn_core::peer_name(self.peer_addr, self.peer_rank)
    }
    pub(super) fn handshaking(&self) -> bool {
        matches!(self.state, State::Connecting | State::Handshake)
    }
    /// Whether the peer has not proved the job secret yet.
    pub(super) fn pre_auth(&self) -> bool {
        self.hs.as_ref().is_some_and(|h| !h.authenticated())
    }
}
