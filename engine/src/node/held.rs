//! Back-pressure, held by the driver: the transmits a transport refused for
//! now (`WouldBlock`), kept in posting order per peer and posted again later.
//!
//! The Node never hears of a refusal. To it, a held transmit is one in flight:
//! it counts in the peer's window ([`super::types::Limits::max_outstanding`])
//! until its `Done` (or `Failed`) comes, so a driver holds at most that many
//! per peer. The one rule is order: a transmit to a peer with held transmits
//! waits behind them, so writes and messages to a peer still leave in the
//! order the Node emitted them. (This is quinn's `buffered_transmit`: the
//! refused datagram stays in the driver, and the protocol core goes on.)
//!
//! A driver (the runtime, or the simulator):
//! 1. passes each `Output::Transmit` through [`HeldTransmits::admit`], and posts what
//!    it returns; a refused post goes to [`HeldTransmits::refused`];
//! 2. calls [`HeldTransmits::retry`] when the transport may take more (after its
//!    completions, and at the latest [`HeldTransmits::RETRY_AFTER`] later);
//! 3. when a peer's connection ends, feeds `Input::Closed` first, then
//!    `Input::Failed` for each transmit [`HeldTransmits::forget_peer`] returns (the
//!    Node dropped their tokens with the connection, and frees their cells).

use std::collections::VecDeque;
use std::time::Duration;

use super::types::Transmit;

/// See the module docs.
#[derive(Debug, Default)]
pub struct HeldTransmits {
    /// Per peer, the held transmits in posting order; the head was refused.
    lines: Vec<VecDeque<Transmit>>,
    /// Transmits held in all.
    len: usize,
}

impl HeldTransmits {
    /// With a held transmit and nothing else to wake the driver, try again after this long.
    pub const RETRY_AFTER: Duration = Duration::from_millis(1);

    /// Nothing held, for a job of `world` ranks.
    pub fn new(world: usize) -> Self {
        let h = HeldTransmits {
            lines: (0..world).map(|_| VecDeque::new()).collect(),
            len: 0,
        };
        debug_assert!(h.is_empty() && h.lines.len() == world);
        h
    }

    /// A transmit the Node emitted: returned to be posted now, or kept
    /// (`None`) behind the ones held for its peer.
    pub fn admit(&mut self, t: Transmit) -> Option<Transmit> {
        let line = &mut self.lines[t.peer as usize];
        if line.is_empty() {
            return Some(t);
        }
        // Tokens rise in the order the Node emits them, and a line keeps that order.
        debug_assert!(line.back().is_some_and(|b| b.token < t.token), "rank {}", t.peer);
        line.push_back(t);
        self.len += 1;
        None
    }

    /// The transport refused `t` for now (it came from [`HeldTransmits::admit`] or
    /// [`HeldTransmits::retry`]): it heads its peer's line again.
    pub fn refused(&mut self, t: Transmit) {
        let line = &mut self.lines[t.peer as usize];
        // The refused one is older than everything held behind it.
        debug_assert!(line.front().map_or(true, |f| t.token < f.token), "rank {}", t.peer);
        line.push_front(t);
        self.len += 1;
    }

    /// Offers the held transmits to `post` again, each peer's in order. `post`
    /// returns `Err(t)` when the transport refuses `t` for now: that peer's
    /// line stops there, the others go on. Returns how many were posted.
    pub fn retry(&mut self, mut post: impl FnMut(Transmit) -> Result<(), Transmit>) -> usize {
        let before = self.len;
        if before == 0 {
            return 0;
        }
        let mut posted = 0;
        for line in &mut self.lines {
            while let Some(t) = line.pop_front() {
                match post(t) {
                    Ok(()) => posted += 1,
                    Err(t) => {
                        line.push_front(t);
                        break;
                    }
                }
            }
        }
        self.len -= posted;
        debug_assert_eq!(self.len, self.lines.iter().map(VecDeque::len).sum::<usize>());
        posted
    }

    /// The connection to `peer` ended: its held transmits, oldest first, to
    /// be reported `Failed` after the Node hears `Closed`.
    pub fn forget_peer(&mut self, peer: u32) -> Vec<Transmit> {
        let Some(line) = self.lines.get_mut(peer as usize) else {
            return Vec::new();
        };
        let gone: Vec<Transmit> = line.drain(..).collect();
        self.len -= gone.len();
        debug_assert!(gone.windows(2).all(|w| w[0].token < w[1].token));
        gone
    }

    /// Transmits held in all.
    pub fn len(&self) -> usize {
        debug_assert!(self.len >= self.lines.iter().filter(|l| !l.is_empty()).count());
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        let empty = self.len() == 0;
        debug_assert_eq!(empty, self.lines.iter().all(VecDeque::is_empty));
        empty
    }

    /// Transmits held for `peer`.
    pub fn held_for(&self, peer: u32) -> usize {
        let n = self.lines.get(peer as usize).map_or(0, VecDeque::len);
        debug_assert!(n <= self.len, "rank {peer}: {n} of {}", self.len);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::types::{SendSrc, TxOp};

    fn tx(token: u64, peer: u32) -> Transmit {
        Transmit {
            token,
            peer,
            op: TxOp::Send {
                tag: 0,
                src: SendSrc::Inline {
                    cell: 0,
                    bytes: vec![token as u8],
                },
            },
        }
    }

    #[test]
    fn a_refused_transmit_keeps_its_peers_order_and_others_go_on() {
        let mut h = HeldTransmits::new(3);
        // Peer 1 refuses token 1; tokens 2 and 4 to it wait; 3 to peer 2 goes at once.
        let t1 = h.admit(tx(1, 1)).expect("nothing held");
        h.refused(t1);
        assert!(h.admit(tx(2, 1)).is_none());
        assert_eq!(h.admit(tx(3, 2)).map(|t| t.token), Some(3));
        assert!(h.admit(tx(4, 1)).is_none());
        assert_eq!((h.len(), h.held_for(1), h.held_for(2)), (3, 3, 0));
        // Still refusing: nothing leaves, the order stays.
        assert_eq!(h.retry(Err), 0);
        // Refusing again after one: 1 leaves, 2 heads the line.
        let mut sent = Vec::new();
        let n = h.retry(|t| {
            if sent.is_empty() {
                sent.push(t.token);
                Ok(())
            } else {
                Err(t)
            }
        });
        assert_eq!((n, sent.as_slice(), h.len()), (1, &[1][..], 2));
        let mut rest = Vec::new();
        assert_eq!(
            h.retry(|t| {
                rest.push(t.token);
                Ok(())
            }),
            2
        );
        assert_eq!((rest, h.is_empty()), (vec![2, 4], true));
        // With nothing held, a transmit goes at once again.
        assert!(h.admit(tx(5, 1)).is_some());
    }

    #[test]
    fn a_closed_peers_held_transmits_are_given_back_oldest_first() {
        let mut h = HeldTransmits::new(2);
        let t = h.admit(tx(7, 0)).expect("nothing held");
        h.refused(t);
        assert!(h.admit(tx(9, 0)).is_none());
        let gone: Vec<u64> = h.forget_peer(0).into_iter().map(|t| t.token).collect();
        assert_eq!((gone, h.is_empty()), (vec![7, 9], true));
        assert!(h.forget_peer(5).is_empty(), "an unknown peer holds nothing");
    }
}
