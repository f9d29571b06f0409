//! Flow control toward the transport: per-peer windows of outstanding
//! requests, FIFO queues behind them, and control cells for inline messages.
//! Back-pressure (`WouldBlock`) is the driver's ([`super::held`]): a transmit
//! it holds is in flight here until its completion.
//!
//! Bounds: at most `max_outstanding` transmits per peer are posted and not
//! completed; at most [`CELLS`] inline messages are in flight in all. What
//! does not fit waits in the peer's queue, in order: messages to one peer
//! leave in the order they were queued.

use std::collections::VecDeque;

use super::types::{Loc, Output, RemoteLoc, SendSrc, Transmit, TxOp};
use crate::fxhash::FxHashMap;

/// Bytes of one control cell: the largest inline message.
pub const CELL_BYTES: usize = 256;
/// Control cells per rank.
pub const CELLS: usize = 1024;

// Every control message fits one cell.
const _: () = assert!(crate::wire::MAX_CONTROL <= CELL_BYTES);

/// A transmit that waits for its turn.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Write {
        src: Loc,
        dst: RemoteLoc,
        len: u64,
        imm: Option<u32>,
    },
    SendRegion {
        tag: u32,
        at: Loc,
        len: u64,
    },
    SendInline {
        tag: u32,
        bytes: Vec<u8>,
    },
}

#[derive(Debug)]
struct Queued<T> {
    op: Op,
    track: T,
    /// Waits until the peer is open (its hello arrived and its regions are known).
    gated: bool,
}

#[derive(Debug)]
struct PeerFlow<T> {
    out: usize,
    queue: VecDeque<Queued<T>>,
    open: bool,
    /// The connection ended after the peer's goodbye: nothing more goes to it.
    gone: bool,
}

#[derive(Debug)]
struct InFlight<T> {
    peer: u32,
    cell: Option<u32>,
    track: T,
}

/// See the module docs. `T` is what the Node remembers about each transmit.
#[derive(Debug)]
pub(crate) struct Flow<T> {
    cap: usize,
    peers: Vec<PeerFlow<T>>,
    free_cells: Vec<u32>,
    inflight: FxHashMap<u64, InFlight<T>>,
    next_token: u64,
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
    /// Peers whose head waits for a free cell.
    cell_waiters: Vec<u32>,
    /// Most transmits outstanding to one peer, ever.
    pub(crate) max_out_seen: usize,
    /// Tokens in flight to peers whose connection ended: their completions,
    /// if any come, mean nothing, but free the control cell they may hold (the
    /// transport may still be reading it until then).
    dropped: FxHashMap<u64, Option<u32>>,
}

impl<T> Flow<T> {
    pub(crate) fn new(world: usize, cap: usize) -> Self {
        debug_assert!(cap > 0, "a window of 0 transmits would never post");
        Flow {
            cap,
            peers: (0..world)
                .map(|_| PeerFlow {
                    out: 0,
                    queue: VecDeque::new(),
                    open: false,
                    gone: false,
                })
                .collect(),
            free_cells: (0..CELLS as u32).rev().collect(),
            inflight: FxHashMap::default(),
            next_token: 1,
            dirty: Vec::new(),
            is_dirty: vec![false; world],
            cell_waiters: Vec::new(),
            max_out_seen: 0,
            dropped: FxHashMap::default(),
        }
    }

    fn mark(&mut self, peer: u32) {
        if !self.is_dirty[peer as usize] {
            self.is_dirty[peer as usize] = true;
            self.dirty.push(peer);
            debug_assert!(self.dirty.len() <= self.peers.len(), "a peer is marked once");
        }
    }

    /// Queues a transmit to `peer` (dropped if the peer is gone).
    pub(crate) fn push(&mut self, peer: u32, op: Op, track: T, gated: bool) {
        if self.peers[peer as usize].gone {
            return;
        }
        debug_assert!(!matches!(&op, Op::SendInline { bytes, .. } if bytes.len() > CELL_BYTES));
        debug_assert!(
            gated || matches!(op, Op::SendInline { .. }),
            "only control messages go before the peer opens"
        );
        self.peers[peer as usize].queue.push_back(Queued { op, track, gated });
        self.mark(peer);
    }

    /// The peer's hello arrived and its regions are known: gated transmits may go.
    pub(crate) fn open(&mut self, peer: u32) {
        debug_assert!(
            !self.peers[peer as usize].gone,
            "rank {peer} left (a new connection resets it first)"
        );
        self.peers[peer as usize].open = true;
        self.mark(peer);
    }

    /// Posts what the windows allow.
    pub(crate) fn pump(&mut self, out: &mut VecDeque<Output>) {
        while let Some(p) = self.dirty.pop() {
            self.is_dirty[p as usize] = false;
            self.pump_peer(p, out);
        }
        self.debug_invariants();
    }

    /// What every pump leaves true (O(ranks + transmits in flight)).
    fn debug_invariants(&self) {
        // Each transmit in flight is counted once, in its peer's window.
        debug_assert_eq!(self.inflight.len(), self.peers.iter().map(|p| p.out).sum::<usize>());
        debug_assert!(self.peers.iter().all(|p| p.out <= self.cap));
        // A cell is free, or held by a transmit in flight or by a dropped one: never two.
        debug_assert_eq!(
            self.free_cells.len()
                + self.inflight.values().filter(|f| f.cell.is_some()).count()
                + self.dropped.values().filter(|c| c.is_some()).count(),
            CELLS
        );
        // Nothing waits for, or flies to, a peer that is gone.
        debug_assert!(self.peers.iter().all(|p| !p.gone || (p.queue.is_empty() && p.out == 0)));
    }

    fn pump_peer(&mut self, peer: u32, out: &mut VecDeque<Output>) {
        let pf = &mut self.peers[peer as usize];
        while pf.out < self.cap {
            let Some(head) = pf.queue.front() else { return };
            if head.gated && !pf.open {
                return;
            }
            let cell = if matches!(head.op, Op::SendInline { .. }) {
                match self.free_cells.pop() {
                    Some(c) => Some(c),
                    None => {
                        if !self.cell_waiters.contains(&peer) {
                            self.cell_waiters.push(peer);
                        }
                        return;
                    }
                }
            } else {
                None
            };
            let q = pf.queue.pop_front().expect("peeked");
            pf.out += 1;
            debug_assert!(pf.out <= self.cap, "the window of rank {peer}");
            self.max_out_seen = self.max_out_seen.max(pf.out);
            let token = self.next_token;
            self.next_token += 1;
            out.push_back(Output::Transmit(Transmit {
                token,
                peer,
                op: to_tx(&q.op, cell),
            }));
            debug_assert!(!self.inflight.contains_key(&token), "token {token} posted twice");
            self.inflight.insert(
                token,
                InFlight {
                    peer,
                    cell,
                    track: q.track,
                },
            );
        }
    }

    fn release(&mut self, f: &InFlight<T>) {
        let pf = &mut self.peers[f.peer as usize];
        debug_assert!(pf.out > 0, "a transmit to rank {} was counted", f.peer);
        pf.out -= 1;
        if let Some(c) = f.cell {
            // A cell is taken before it is freed.
            debug_assert!(self.free_cells.len() < CELLS, "cell {c} freed twice");
            self.free_cells.push(c);
            for w in std::mem::take(&mut self.cell_waiters) {
                self.mark(w);
            }
        }
        self.mark(f.peer);
    }

    /// A transmit completed (or failed): returns its peer and what it was.
    pub(crate) fn done(&mut self, token: u64) -> Option<(u32, T)> {
        let f = self.inflight.remove(&token)?;
        self.release(&f);
        // A completion leaves room in its peer's window.
        debug_assert!(self.peers[f.peer as usize].out < self.cap, "rank {}", f.peer);
        Some((f.peer, f.track))
    }

    /// The connection to `peer` ended: forgets what was queued for it or in
    /// flight to it, and returns what each of those was.
    pub(crate) fn drop_peer(&mut self, peer: u32) -> Vec<T> {
        let mut tracks = Vec::new();
        let tokens: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.peer == peer)
            .map(|(t, _)| *t)
            .collect();
        let mut tokens = tokens;
        tokens.sort_unstable();
        for t in tokens {
            let f = self.inflight.remove(&t).expect("listed");
            debug_assert!(self.peers[peer as usize].out > 0);
            self.peers[peer as usize].out -= 1;
            self.dropped.insert(t, f.cell);
            tracks.push(f.track);
        }
        let pf = &mut self.peers[peer as usize];
        // Every transmit in flight to the peer was listed.
        debug_assert_eq!(pf.out, 0, "rank {peer}");
        tracks.extend(pf.queue.drain(..).map(|q| q.track));
        pf.open = false;
        pf.gone = true;
        tracks
    }

    /// A new connection to `peer` (a worker that came back): nothing is
    /// queued or in flight to it, and it waits to open like a new peer.
    pub(crate) fn reset_peer(&mut self, peer: u32) {
        let pf = &mut self.peers[peer as usize];
        debug_assert!(pf.out == 0 && pf.queue.is_empty());
        debug_assert!(pf.gone && !pf.open, "only a peer that left comes back");
        pf.open = false;
        pf.gone = false;
    }

    /// Whether the peer's connection ended after its goodbye.
    pub(crate) fn is_gone(&self, peer: u32) -> bool {
        self.peers[peer as usize].gone
    }

    /// Whether `token` was in flight to a peer whose connection ended (and
    /// forgets it, freeing its control cell).
    pub(crate) fn was_dropped(&mut self, token: u64) -> bool {
        match self.dropped.remove(&token) {
            Some(cell) => {
                if let Some(c) = cell {
                    debug_assert!(self.free_cells.len() < CELLS, "cell {c} freed twice");
                    self.free_cells.push(c);
                    for w in std::mem::take(&mut self.cell_waiters) {
                        self.mark(w);
                    }
                }
                true
            }
            None => false,
        }
    }

    /// Nothing queued or in flight.
    pub(crate) fn idle(&self) -> bool {
        self.inflight.is_empty() && self.peers.iter().all(|p| p.queue.is_empty())
    }

    /// Transmits outstanding to `peer`.
    pub(crate) fn outstanding(&self, peer: u32) -> usize {
        debug_assert!(self.peers[peer as usize].out <= self.cap);
        self.peers[peer as usize].out
    }

    /// Queued or in flight to `peer`.
    pub(crate) fn pending_to(&self, peer: u32) -> usize {
        let p = &self.peers[peer as usize];
        p.out + p.queue.len()
    }

    /// Emits an inline message at once, ahead of the peer's queue (aborts),
    /// if its window and a control cell allow. False when they do not: the
    /// peer then learns of the failure from the closed connection.
    pub(crate) fn urgent(&mut self, peer: u32, tag: u32, bytes: Vec<u8>, track: T, out: &mut VecDeque<Output>) -> bool {
        if self.peers[peer as usize].out >= self.cap {
            return false;
        }
        let Some(cell) = self.free_cells.pop() else {
            return false;
        };
        let token = self.next_token;
        self.next_token += 1;
        let op = Op::SendInline { tag, bytes };
        out.push_back(Output::Transmit(Transmit {
            token,
            peer,
            op: to_tx(&op, Some(cell)),
        }));
        self.peers[peer as usize].out += 1;
        debug_assert!(self.peers[peer as usize].out <= self.cap);
        debug_assert!(!self.inflight.contains_key(&token), "token {token} posted twice");
        self.inflight.insert(
            token,
            InFlight {
                peer,
                cell: Some(cell),
                track,
            },
        );
        true
    }
}

fn to_tx(op: &Op, cell: Option<u32>) -> TxOp {
    // Inline bytes, and only they, take a control cell, which they fit.
    debug_assert_eq!(cell.is_some(), matches!(op, Op::SendInline { .. }));
    debug_assert!(!matches!(op, Op::SendInline { bytes, .. } if bytes.len() > CELL_BYTES));
    match op {
        Op::Write { src, dst, len, imm } => TxOp::Write {
            src: *src,
            dst: *dst,
            len: *len,
            imm: *imm,
        },
        Op::SendRegion { tag, at, len } => TxOp::Send {
            tag: *tag,
            src: SendSrc::Region { at: *at, len: *len },
        },
        Op::SendInline { tag, bytes } => TxOp::Send {
            tag: *tag,
            src: SendSrc::Inline {
                cell: cell.expect("inline sends take a cell"),
                bytes: bytes.clone(),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::super::types::LocalRegion;
    use super::*;

    fn write(len: u64) -> Op {
        Op::Write {
            src: Loc {
                region: LocalRegion::Grads,
                offset: 0,
            },
            dst: RemoteLoc {
                region: LocalRegion::Landing,
                offset: 0,
            },
            len,
            imm: Some(1),
        }
    }

    fn tokens(out: &mut VecDeque<Output>) -> Vec<u64> {
        out.drain(..)
            .map(|o| match o {
                Output::Transmit(t) => t.token,
                o => panic!("{o:?}"),
            })
            .collect()
    }

    #[test]
    fn the_window_holds_and_completions_refill_it_in_order() {
        let mut f: Flow<u32> = Flow::new(2, 2);
        let mut out = VecDeque::new();
        for i in 0..5 {
            f.push(1, write(8), i, true);
        }
        f.pump(&mut out);
        assert!(out.is_empty(), "gated until the peer opens");
        f.open(1);
        f.pump(&mut out);
        let t = tokens(&mut out);
        assert_eq!(t.len(), 2);
        assert_eq!(f.done(t[0]), Some((1, 0)));
        f.pump(&mut out);
        let t2 = tokens(&mut out);
        assert_eq!(t2.len(), 1);
        assert_eq!(f.done(t2[0]), Some((1, 2)), "FIFO: the third queued went third");
        assert_eq!(f.outstanding(1), 1);
        assert!(f.max_out_seen <= 2);
    }

    #[test]
    fn cells_are_bounded_and_recycled() {
        let mut f: Flow<u32> = Flow::new(2, usize::MAX);
        let mut out = VecDeque::new();
        f.open(1);
        for i in 0..CELLS as u32 + 3 {
            f.push(1, Op::SendInline { tag: 1, bytes: vec![1] }, i, false);
        }
        f.pump(&mut out);
        let t = tokens(&mut out);
        assert_eq!(t.len(), CELLS);
        f.done(t[0]);
        f.pump(&mut out);
        assert_eq!(tokens(&mut out).len(), 1);
        assert!(!f.idle());
    }
}
