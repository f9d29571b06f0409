//! Counters, the poller's token layout, and buffer sizes of the portable backend.

/// Counters of the data path (see [`PortableTransport::stats`](super::PortableTransport::stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortableStats {
    /// Message bytes user space copied on receive: a message whole in the
    /// receive buffer is copied out once; the rest of a longer one is read
    /// straight into the message's own buffer, and control frames are parsed in place.
    pub rx_user_copy_bytes: u64,
    /// Write payload bytes received straight into the destination region.
    pub rx_write_direct_bytes: u64,
    /// Write payload bytes discarded because the write was rejected.
    pub rx_write_discarded_bytes: u64,
    /// Payload bytes sent from registered memory (messages and writes).
    pub tx_payload_bytes: u64,
    /// `sendmsg` calls that sent something (a gathered one counts once).
    pub tx_sends: u64,
    /// `epoll_wait` calls.
    pub polls: u64,
    /// Handshakes closed, oldest first, because [`MAX_PENDING_HANDSHAKES`](crate::handshake::MAX_PENDING_HANDSHAKES) were in progress.
    pub refused_over_limit: u64,
    /// Unauthenticated sockets and connections refused on a header (a kind,
    /// version or length their handshake state does not allow, judged before
    /// any payload byte is read).
    pub pre_auth_refused: u64,
}

/// What a poller token names: the low two bits say which socket, the rest the id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sock {
    Listener(u64),
    Pending(u64),
    Ctrl(u64),
    Data(u64),
    Wake,
}

pub(super) const WAKE_TOKEN: usize = usize::MAX;

impl Sock {
    pub(super) fn token(self) -> mio::Token {
        mio::Token(match self {
            Sock::Listener(i) => (i as usize) << 2,
            Sock::Pending(i) => ((i as usize) << 2) | 1,
            Sock::Ctrl(i) => ((i as usize) << 2) | 2,
            Sock::Data(i) => ((i as usize) << 2) | 3,
            Sock::Wake => WAKE_TOKEN,
        })
    }

    pub(super) fn from_token(t: mio::Token) -> Sock {
        if t.0 == WAKE_TOKEN {
            return Sock::Wake;
        }
        let id = (t.0 >> 2) as u64;
        match t.0 & 3 {
            0 => Sock::Listener(id),
            1 => Sock::Pending(id),
            2 => Sock::Ctrl(id),
            _ => Sock::Data(id),
        }
    }
}

/// Initial size of a control socket's receive buffer (grows to the largest frame seen).
pub(super) const CTRL_RX_BYTES: usize = 64 * 1024;
/// Scratch for discarding a rejected write's payload.
pub(super) const DISCARD_CHUNK: usize = 64 * 1024;
/// Bytes read from one socket per turn before others get theirs.
pub(super) const RX_BUDGET: usize = 8 << 20;
/// Frames (or writes) gathered into one sendmsg, at most.
pub(super) const GATHER_MAX: usize = 64;
/// Poller events handled per `epoll_wait`.
pub(super) const EVENTS: usize = 256;
