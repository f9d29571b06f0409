//! Per-connection state: work-request ids, queued and in-flight operations,
//! the connection state machine, and registered regions.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::ExtendedQueuePair;

use crate::api::{Event, ListenerId, PeerInfo, ReqId};
use crate::error::{Error, Violation};
use crate::memory::{InFlight, PinnedBuffer, Region, RemoteRegion};

use super::wire::{self, Notice, QpInfo};

pub(super) const KIND_SEND: u64 = 0;
pub(super) const KIND_RECV: u64 = 1;
pub(super) const KIND_META: u64 = 2;
/// The inline RDMA WRITE that returns receive credits (the peer's credit word).
pub(super) const KIND_CREDIT: u64 = 3;
pub(super) const SEQ_BITS: u32 = 38;
pub(super) const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
pub(super) const CTRL_CELL: usize = 4096;
pub(super) const CTRL_CELLS: usize = 256;

pub(super) fn wr_id(conn: u64, kind: u64, seq: u64) -> u64 {
    (conn << (SEQ_BITS + 2)) | (kind << SEQ_BITS) | (seq & SEQ_MASK)
}

pub(super) fn split_wr_id(id: u64) -> (u64, u64, u64) {
    (id >> (SEQ_BITS + 2), (id >> SEQ_BITS) & 3, id & SEQ_MASK)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpKind {
    Send,
    Write,
    Read,
}

#[derive(Debug)]
pub(super) enum Wr {
    Send {
        lkey: u32,
        addr: u64,
        len: u32,
        tag: u32,
    },
    Write {
        lkey: u32,
        addr: u64,
        len: u32,
        rkey: u32,
        raddr: u64,
        imm: Option<(u32, Notice)>,
    },
    Read {
        lkey: u32,
        addr: u64,
        len: u32,
        rkey: u32,
        raddr: u64,
    },
}

impl Wr {
    pub(super) fn consumes_receive(&self) -> bool {
        matches!(self, Wr::Send { .. } | Wr::Write { imm: Some(_), .. })
    }
    pub(super) fn work_requests(&self) -> u32 {
        match self {
            Wr::Write { imm: Some(_), .. } => 2,
            _ => 1,
        }
    }
}

#[derive(Debug)]
pub(super) struct Op {
    pub(super) seq: u64,
    pub(super) req: ReqId,
    pub(super) kind: OpKind,
    pub(super) bytes: usize,
    pub(super) wrs: u32,
    pub(super) _guard: InFlight,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// The control plane is authenticating.
    Handshake,
    /// Queue pair created, our QP info sent; waiting for the peer's.
    Exchange,
    /// Ready to send; waiting for the peer's READY.
    AwaitReady,
    Ready,
    /// Local close: draining queued and in-flight work.
    Closing,
    /// Failed or closed; events were emitted.
    Dead,
}

pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) state: State,
    pub(super) inbound: Option<ListenerId>,
    pub(super) peer: Option<PeerInfo>,
    pub(super) qp: Option<ExtendedQueuePair>,
    pub(super) psn: u32,
    /// Receive buffers (rx_depth x max_message) and the notification ring.
    pub(super) rx_buf: Option<(PinnedBuffer, Arc<MemoryRegion>)>,
    pub(super) ring: Option<(PinnedBuffer, Arc<MemoryRegion>)>,
    pub(super) peer_info: Option<QpInfo>,
    pub(super) peer_ready: bool,
    pub(super) announced: bool,
    /// Receive-consuming posts the peer still has room for.
    pub(super) credits: u32,
    /// Receives reposted since credits were last returned.
    pub(super) credit_return: u32,
    /// Receives reposted and returned, in all (wrapping): what the last credit
    /// write put in the peer's credit word.
    pub(super) credits_returned: u32,
    /// The peer's count last taken from our ring's credit word (wrapping).
    pub(super) credits_seen: u32,
    /// A credit word that would grant more than the peer has receives: taken
    /// for a torn read of a word being written until it reads the same again.
    pub(super) credit_doubt: Option<u32>,
    pub(super) notices_sent: u64,
    pub(super) notices_seen: u64,
    pub(super) next_seq: u64,
    pub(super) pending: VecDeque<(Op, Wr)>,
    pub(super) inflight: VecDeque<Op>,
    pub(super) wrs_in_flight: u32,
    pub(super) since_signal: u32,
    pub(super) remote: Vec<RemoteRegion>,
    /// The queue pair failed on our side (flush at the target, say); wait for the
    /// peer's ABORT until the instant, then fail with this error.
    pub(super) qp_failed: Option<(Error, Instant)>,
    /// Connected or Incoming was emitted: the user knows this connection.
    pub(super) ready_event_sent: bool,
    /// A local close finished flushing and closed the control connection.
    pub(super) close_sent: bool,
    /// The peer's first region list arrived (it follows READY on the control plane).
    pub(super) regions_seen: bool,
    /// Arrivals (messages, writes) that beat READY or the region list here over the
    /// other channel: delivered right after Connected/Incoming, in order.
    pub(super) early: Vec<Event>,
    /// When the queue-pair exchange (from authentication to Ready) or a local
    /// close (flushing) must be done by; past it the connection fails.
    pub(super) deadline: Option<Instant>,
    /// The rdma_cm identifier of this connection (ConnectMode::RdmaCm).
    pub(super) cm_id: Option<std::sync::Arc<sideway::rdmacm::communication_manager::Identifier>>,
}

impl Conn {
    pub(super) fn new(id: u64, inbound: Option<ListenerId>) -> Self {
        Conn {
            id,
            state: State::Handshake,
            inbound,
            peer: None,
            qp: None,
            psn: crate::auth::random_u32() & 0xff_ffff,
            rx_buf: None,
            ring: None,
            peer_info: None,
            peer_ready: false,
            announced: false,
            credits: 0,
            credit_return: 0,
            credits_returned: 0,
            credits_seen: 0,
            credit_doubt: None,
            notices_sent: 0,
            notices_seen: 0,
            next_seq: 0,
            pending: VecDeque::new(),
            inflight: VecDeque::new(),
            wrs_in_flight: 0,
            since_signal: 0,
            remote: Vec::new(),
            qp_failed: None,
            ready_event_sent: false,
            close_sent: false,
            regions_seen: false,
            early: Vec::new(),
            deadline: None,
            cm_id: None,
        }
    }

    pub(super) fn outstanding(&self) -> usize {
        self.pending.len() + self.inflight.len()
    }

    /// The peer as errors name it. Allocates: call it only to build an error.
    pub(super) fn peer_name(&self) -> String {
        peer_name(self.peer, self.id)
    }

    /// Takes the receive credits the peer returned since the last look: the
    /// cumulative count it wrote into our ring's credit word (`rx_depth` is
    /// ours, which placed the word; the word checks itself, see
    /// [`wire::decode_credit_word`]). Fails when the word grants more than the
    /// receives the peer posted, read twice the same.
    pub(super) fn refresh_credits(&mut self, rx_depth: u32) -> Result<(), Violation> {
        let (Some((ring, _)), Some(info)) = (&self.ring, self.peer_info) else {
            return Ok(());
        };
        let off = wire::credit_word_offset(rx_depth);
        assert!(off + 8 <= ring.len(), "the ring holds its credit word");
        let p = ring.as_ptr().wrapping_add(off);
        assert!(p.cast::<AtomicU64>().is_aligned(), "the ring is page-aligned");
        // No Rust code writes the ring; the peer's device writes it by DMA, which an atomic
        // load tolerates (a torn value fails its check: see `decode_credit_word`).
        // SAFETY: the word is inside the ring and u64-aligned (both checked); the ring outlives `self`'s borrow.
        let word = unsafe { &*p.cast::<AtomicU64>() };
        let Some(total) = wire::decode_credit_word(u64::from_le(word.load(Ordering::Acquire))) else {
            // Never written yet, or caught mid-write: look again at the next step.
            return Ok(());
        };
        let max = info.rx_depth.min(wire::MAX_RX_DEPTH);
        self.apply_credit_word(total, max)
    }

    /// [`refresh_credits`](Self::refresh_credits) once the word is read.
    pub(super) fn apply_credit_word(&mut self, total: u32, max: u32) -> Result<(), Violation> {
        let grant = total.wrapping_sub(self.credits_seen);
        if grant == 0 {
            self.credit_doubt = None;
            return Ok(());
        }
        match wire::grant_credits(self.credits, grant, max) {
            Ok(credits) => {
                self.credits = credits;
                self.credits_seen = total;
                self.credit_doubt = None;
                Ok(())
            }
            // The same impossible word twice: the peer wrote it.
            Err(v) if self.credit_doubt == Some(total) => Err(v),
            // Perhaps caught mid-write (a torn value); look again next time.
            Err(_) => {
                self.credit_doubt = Some(total);
                Ok(())
            }
        }
    }
}

/// A peer as errors name it: its rank and address once authenticated.
pub(super) fn peer_name(peer: Option<PeerInfo>, id: u64) -> String {
    match peer {
        Some(p) => format!("rank {} ({})", p.rank, p.addr),
        None => format!("connection {id}"),
    }
}

/// A registered region and its memory region; the MR is deregistered before the
/// transport lets go of the memory (field order is drop order).
pub(super) struct Registered {
    pub(super) mr: Arc<MemoryRegion>,
    pub(super) region: Region,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_round_trip() {
        for (c, k, s) in [(1u64, KIND_SEND, 0u64), (4095, KIND_RECV, 63), (7, KIND_META, SEQ_MASK)] {
            assert_eq!(split_wr_id(wr_id(c, k, s)), (c, k, s));
        }
        // Sequence numbers wrap inside their field without touching the others.
        assert_eq!(split_wr_id(wr_id(3, KIND_SEND, SEQ_MASK + 5)), (3, KIND_SEND, 4));
    }

    #[test]
    fn credit_words_grant_what_was_returned_and_no_more() {
        let mut c = Conn::new(1, None);
        c.credits = 4; // of 64 the peer posted: 60 in use
        assert_eq!(c.apply_credit_word(0, 64), Ok(()));
        assert_eq!(c.credits, 4, "nothing returned yet");
        c.apply_credit_word(10, 64).unwrap();
        assert_eq!((c.credits, c.credits_seen), (14, 10));
        c.apply_credit_word(60, 64).unwrap();
        assert_eq!(c.credits, 64);
        // The count wraps.
        c.credits = 0;
        c.credits_seen = u32::MAX - 1;
        c.apply_credit_word(3, 64).unwrap();
        assert_eq!((c.credits, c.credits_seen), (5, 3));
        // More than the peer's receives: doubted once (a torn read), then refused.
        c.credits = 60;
        assert_eq!(c.apply_credit_word(13, 64), Ok(()));
        assert_eq!((c.credits, c.credits_seen), (60, 3), "not applied");
        // A good read in between clears the doubt.
        c.apply_credit_word(5, 64).unwrap();
        assert_eq!((c.credits, c.credit_doubt), (62, None));
        assert_eq!(c.apply_credit_word(1, 64), Ok(()), "backwards: doubted");
        assert!(matches!(
            c.apply_credit_word(1, 64),
            Err(Violation::CreditOverflow { max: 64, .. })
        ));
    }

    #[test]
    fn wr_shapes() {
        let n = Notice {
            rkey: 1,
            generation: 1,
            offset: 0,
            len: 4,
        };
        let w = |imm| Wr::Write {
            lkey: 1,
            addr: 0,
            len: 4,
            rkey: 2,
            raddr: 0,
            imm,
        };
        assert_eq!(w(Some((9, n))).work_requests(), 2, "notice + payload");
        assert!(w(Some((9, n))).consumes_receive());
        assert!(
            !w(None).consumes_receive(),
            "a plain write needs no receive at the target"
        );
        assert!(Wr::Send {
            lkey: 1,
            addr: 0,
            len: 1,
            tag: 0
        }
        .consumes_receive());
    }
}
