//! The op table's entries: every submitted SQE is named by one [`Op`], which
//! owns all memory the kernel may touch until the op's final completion
//! (headers, iovecs, msghdrs, sockaddrs, receive buffers, and region guards).

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::api::WakeFd;
use crate::frame::{Header, HEADER_LEN};
use crate::memory::InFlight;

pub(super) use crate::conn_core::{AwaitAck, Payload, TxFrame, WriteReq};

use super::sys::SockAddr;

/// `user_data` of SQEs whose completion nobody waits for (cancels).
pub(super) const USER_DATA_NONE: u64 = u64::MAX;

/// Memory of one gathered SENDMSG: the iovec array and the msghdr pointing at
/// it. Recycled through [`Pool`], so a steady stream of sends reuses a few of
/// them and allocates nothing.
pub(super) struct Gather {
    iov: Vec<libc::iovec>,
    pub(super) msg: Box<libc::msghdr>,
    pub(super) total: usize,
}

impl Gather {
    fn empty() -> Box<Gather> {
        Box::new(Gather {
            iov: Vec::with_capacity(2 * GATHER_PARTS),
            // SAFETY: msghdr is plain old data; all-zero is valid (no name, no control).
            msg: Box::new(unsafe { std::mem::zeroed() }),
            total: 0,
        })
    }

    /// Points the msghdr at `parts` (empty parts skipped).
    fn fill(&mut self, parts: impl Iterator<Item = (*const u8, usize)>) {
        self.iov.clear();
        self.iov.extend(parts.filter(|&(_, l)| l > 0).map(|(p, l)| libc::iovec {
            iov_base: p as *mut libc::c_void,
            iov_len: l,
        }));
        self.total = self.iov.iter().map(|v| v.iov_len).sum();
        // The iovec array lives on the heap; moving the Gather (or its Box) keeps its address.
        self.msg.msg_iov = self.iov.as_mut_ptr();
        self.msg.msg_iovlen = self.iov.len();
    }
}

/// Frames (or writes) gathered into one SENDMSG, at most.
pub(super) const GATHER_PARTS: usize = 64;

/// How many of each recycled object the pool keeps (one connection needs at most
/// one control send, one data send and one SEND_ZC header at a time).
const POOL_KEEP: usize = 64;

/// Recycled memory of finished send ops, so that steady-state sends allocate
/// nothing: gathers, the frame and write lists a send owns, and SEND_ZC headers.
/// An op still owns everything the kernel may touch until its completion; only
/// then does its memory come back here (emptied).
// The boxes are the point: an op hands the kernel the heap address of its
// msghdr or header, and recycling the box whole keeps that memory reusable.
#[allow(clippy::vec_box)]
#[derive(Default)]
pub(super) struct Pool {
    gathers: Vec<Box<Gather>>,
    frames: Vec<Vec<TxFrame>>,
    writes: Vec<Vec<WriteReq>>,
    hdrs: Vec<Box<[u8; HEADER_LEN]>>,
}

/// A recycled list from `lists`, or a new one with room for a whole gather.
fn take_list<T>(lists: &mut Vec<Vec<T>>) -> Vec<T> {
    lists.pop().unwrap_or_else(|| Vec::with_capacity(GATHER_PARTS))
}

/// Keeps `v`, emptied, for a later send (up to `POOL_KEEP` lists).
fn put_list<T>(lists: &mut Vec<Vec<T>>, mut v: Vec<T>) {
    v.clear();
    if lists.len() < POOL_KEEP {
        lists.push(v);
    }
}

impl Pool {
    pub(super) fn gather(&mut self, parts: impl Iterator<Item = (*const u8, usize)>) -> Box<Gather> {
        let mut g = self.gathers.pop().unwrap_or_else(Gather::empty);
        g.fill(parts);
        g
    }
    pub(super) fn put_gather(&mut self, mut g: Box<Gather>) {
        if self.gathers.len() < POOL_KEEP {
            g.iov.clear();
            g.msg.msg_iov = std::ptr::null_mut();
            g.msg.msg_iovlen = 0;
            self.gathers.push(g);
        }
    }
    pub(super) fn frames(&mut self) -> Vec<TxFrame> {
        take_list(&mut self.frames)
    }
    pub(super) fn put_frames(&mut self, v: Vec<TxFrame>) {
        put_list(&mut self.frames, v)
    }
    pub(super) fn writes(&mut self) -> Vec<WriteReq> {
        take_list(&mut self.writes)
    }
    pub(super) fn put_writes(&mut self, v: Vec<WriteReq>) {
        put_list(&mut self.writes, v)
    }
    pub(super) fn hdr(&mut self, hdr: [u8; HEADER_LEN]) -> Box<[u8; HEADER_LEN]> {
        match self.hdrs.pop() {
            Some(mut b) => {
                *b = hdr;
                b
            }
            None => Box::new(hdr),
        }
    }
    pub(super) fn put_hdr(&mut self, b: Box<[u8; HEADER_LEN]>) {
        if self.hdrs.len() < POOL_KEEP {
            self.hdrs.push(b);
        }
    }
}

/// Size of a data socket's read-ahead buffer.
pub(super) const STAGE_BYTES: usize = 64 * 1024;

/// A data socket's read-ahead buffer: `buf[..len]` holds received bytes not yet
/// parsed (after parsing, at most a partial header). The bytes live on the heap,
/// so their address does not change when the stage moves between the connection
/// and the receive op that owns it while the kernel writes into it.
pub(super) struct Stage {
    pub(super) buf: Box<[u8]>,
    pub(super) len: usize,
}

impl Stage {
    pub(super) fn new() -> Stage {
        Stage {
            buf: vec![0u8; STAGE_BYTES].into_boxed_slice(),
            len: 0,
        }
    }
}

pub(super) enum Op {
    Accept {
        listener: u64,
    },
    Connect {
        conn: u64,
        data: bool,
        _addr: Box<SockAddr>,
    },
    /// Server: first frame of an unclassified socket.
    /// `got`: bytes already in `buf` (a receive that returned short is
    /// resubmitted for the rest).
    FirstHeader {
        pending: u64,
        buf: Box<[u8; HEADER_LEN]>,
        got: usize,
    },
    FirstPayload {
        pending: u64,
        hdr: Header,
        buf: Vec<u8>,
        got: usize,
    },
    CtrlRecv {
        conn: u64,
    },
    CtrlSend {
        conn: u64,
        frames: Vec<TxFrame>,
        g: Box<Gather>,
    },
    DataSend {
        conn: u64,
        writes: Vec<WriteReq>,
        g: Box<Gather>,
    },
    /// Header of a SEND_ZC write (linked to the ZC op that follows).
    ZcHeader {
        conn: u64,
        hdr: Box<[u8; HEADER_LEN]>,
    },
    /// A SEND_ZC payload; freed on its notification.
    ZcPayload {
        conn: u64,
        write: Option<WriteReq>,
        got_result: bool,
    },
    /// Read-ahead on the data socket: a RECV (no MSG_WAITALL) into the stage's free space.
    DataRecvStage {
        conn: u64,
        stage: Stage,
    },
    /// The rest of a write's payload (`len` bytes), received straight into its region.
    DataRecvPayload {
        conn: u64,
        hdr: Header,
        len: u32,
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
    /// A poll of the waker's eventfd: its completion ends a sleep in
    /// `io_uring_enter`; it is re-armed after each. Holds the eventfd open.
    Wake {
        _wake: Arc<WakeFd>,
    },
    /// DataAttach on the client's data socket.
    AttachSend {
        conn: u64,
        _buf: Vec<u8>,
    },
}

impl Op {
    pub(super) fn conn(&self) -> Option<u64> {
        match self {
            Op::Connect { conn, .. }
            | Op::CtrlRecv { conn }
            | Op::CtrlSend { conn, .. }
            | Op::DataSend { conn, .. }
            | Op::ZcHeader { conn, .. }
            | Op::ZcPayload { conn, .. }
            | Op::DataRecvStage { conn, .. }
            | Op::DataRecvPayload { conn, .. }
            | Op::DataDiscard { conn, .. }
            | Op::AttachSend { conn, .. } => Some(*conn),
            _ => None,
        }
    }
}

// SAFETY: the raw pointers in a Gather point into memory owned by the same op
// (frames, writes) or by registered regions; nothing is thread-affine, and the
// transport that owns the op moves between threads as a whole.
unsafe impl Send for Gather {}
