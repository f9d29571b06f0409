//! Momentum at scheme switches ([`crate::plan`]): where the apply op keeps
//! momentum (SGD's), a layer that changes schemes takes it along.
//!
//! - **SFB → PS at `t`:** worker index 0 sends each chunk's momentum (from
//!   its part of the `Moments` region) to the chunk's server, beside its
//!   values; the server places it in its part and applies `t` only then
//!   ([`crate::server::Server::handle_momentum`]).
//! - **PS → SFB at `t`:** each server, once it applied the chunk's round
//!   `t − 1`, sends the chunk's momentum to every worker; a worker's
//!   reconstruction of `t` waits for every chunk's
//!   ([`crate::worker::Worker::handle_momentum_in`]).
//!
//! A block travels as a `MomentumBegin` message and `FactorData` fragments
//! (the factor blocks' reassembly, [`super::factors::Inbox`]); to this
//! rank's own other side it is a `Copy` job. A server places worker 0's
//! momentum into memory its own sends to the workers may still read (a
//! layer back on the PS one iteration after it left): the placement waits
//! for those sends.

use super::factors::Block;
use super::*;

impl Node {
    /// Where chunk `chunk`'s momentum lies in this server's part of
    /// `Moments`, when momentum moves and its layer may switch.
    pub(super) fn shard_momentum(&self, chunk: u32) -> Option<Loc> {
        let m = self.moments.as_ref()?;
        let ch = self.book.chunks()[chunk as usize];
        // A server's own chunk: the shard's part lies after the worker's.
        debug_assert_eq!(ch.server, self.rank, "chunk {chunk}");
        self.book.plan().movable(ch.layer).then_some(Loc {
            region: LocalRegion::Moments,
            offset: m.shard_at + ch.shard_offset as u64 * 4,
        })
    }

    /// Where `layer`'s momentum lies in this worker's part of `Moments`,
    /// when momentum moves and the layer may switch.
    pub(super) fn layer_momentum(&self, layer: u32) -> Option<Loc> {
        let off = self.moments.as_ref()?.layer_off[layer as usize]?;
        // Only a worker's movable layers have a place there.
        debug_assert!(self.worker.is_some() && self.book.plan().movable(layer));
        Some(Loc {
            region: LocalRegion::Moments,
            offset: off,
        })
    }

    /// This worker's momentum of `chunk` (its place in the layer's).
    fn chunk_momentum(&self, chunk: u32) -> Loc {
        let ch = self.book.chunks()[chunk as usize];
        let at = self.layer_momentum(ch.layer).expect("a movable layer of a worker");
        debug_assert!(ch.offset + ch.len <= self.book.layers()[ch.layer as usize].params());
        Loc {
            region: at.region,
            offset: at.offset + ch.offset as u64 * 4,
        }
    }

    /// Worker 0, back to the PS at `iter`: its momentum of `chunk` to the
    /// chunk's server `server` (its own server by a copy).
    pub(super) fn momentum_to_server(&mut self, server: u32, chunk: u32, iter: u64) -> Result<()> {
        debug_assert_eq!(self.book.chunks()[chunk as usize].server, server, "chunk {chunk}");
        let src = self.chunk_momentum(chunk);
        if server == self.rank {
            let me = self.rank;
            self.server
                .as_mut()
                .expect("its server")
                .core
                .accept_momentum(me, chunk, iter)?;
            let dst = self.shard_momentum(chunk).expect("momentum moves");
            let len = self.book.chunks()[chunk as usize].len as u64 * 4;
            let from = self.rank;
            let track = JobTrack::MomentumIn {
                chunk,
                iter,
                from,
                to_server: true,
            };
            self.place_in_shard(chunk, JobKind::Copy { src, dst, len }, track);
        } else {
            self.send_momentum(server, chunk, iter, src, true);
        }
        Ok(())
    }

    /// A server, the chunk's layer off the PS at `iter`: the shard's
    /// momentum of `chunk` to every worker, once its apply ran.
    pub(super) fn momentum_to_workers(&mut self, chunk: u32, iter: u64) -> Result<()> {
        let s = self.server.as_mut().expect("server");
        debug_assert!(iter > 0, "a switch at iteration 0 is the start-up choice");
        if s.apply_running.contains_key(&chunk) {
            let was = s.momentum.deferred.insert(chunk, iter);
            debug_assert!(was.is_none(), "chunk {chunk}: one switch at a time");
            return Ok(());
        }
        let src = self.shard_momentum(chunk).expect("momentum moves");
        let workers = self.book.cluster().workers().to_vec();
        let len = self.book.chunks()[chunk as usize].len as u64 * 4;
        *self
            .server
            .as_mut()
            .expect("server")
            .momentum
            .reading
            .entry(chunk)
            .or_default() += workers.len() as u32;
        for w in workers {
            if w == self.rank {
                self.worker
                    .as_mut()
                    .expect("its worker")
                    .core
                    .accept_momentum(chunk, iter, w)?;
                let dst = self.chunk_momentum(chunk);
                let track = JobTrack::MomentumIn {
                    chunk,
                    iter,
                    from: w,
                    to_server: false,
                };
                self.new_job(Queue::Worker, JobKind::Copy { src, dst, len }, track);
            } else {
                self.send_momentum(w, chunk, iter, src, false);
            }
        }
        Ok(())
    }

    /// The chunk's apply ran: a send of its momentum that waited for it goes.
    pub(super) fn momentum_after_apply(&mut self, chunk: u32) -> Result<()> {
        let s = self.server.as_mut().expect("server");
        debug_assert!(!s.apply_running.contains_key(&chunk), "chunk {chunk}: its apply ran");
        match s.momentum.deferred.remove(&chunk) {
            Some(iter) => self.momentum_to_workers(chunk, iter),
            None => Ok(()),
        }
    }

    /// `MomentumBegin` and the fragments of `chunk`'s momentum at `src`, to `peer`.
    fn send_momentum(&mut self, peer: u32, chunk: u32, iter: u64, src: Loc, to_server: bool) {
        // Mid-run, every peer is open (a switch is at iteration 1 or later).
        debug_assert!(
            self.peers[peer as usize].open,
            "momentum to rank {peer} before it opened"
        );
        let total = self.book.chunks()[chunk as usize].len as u64 * 4;
        self.send_ctrl(
            peer,
            &Msg::MomentumBegin {
                chunk,
                iter,
                total,
                to_server,
            },
        );
        for (off, n) in factors::fragments(total, total, self.message_cap(peer)) {
            self.stats.max_message = self.stats.max_message.max(n);
            let track = if off + n == total {
                Track::Momentum {
                    chunk,
                    reseed: to_server,
                }
            } else {
                Track::Piece
            };
            let at = Loc {
                region: src.region,
                offset: src.offset + off,
            };
            let tag = Kind::FactorData.tag();
            self.enqueue(peer, Op::SendRegion { tag, at, len: n }, track, true);
        }
    }

    /// A send of `chunk`'s momentum was placed: worker 0's counts toward
    /// its write-back; a server's no longer reads the shard's momentum.
    pub(super) fn momentum_sent(&mut self, chunk: u32, reseed: bool) -> Result<()> {
        debug_assert!(self.moments.is_some(), "momentum moves");
        if reseed {
            return self.worker.as_mut().expect("worker 0").core.handle_seed_done(chunk);
        }
        self.end_read(chunk);
        Ok(())
    }

    /// One read of the shard's momentum of `chunk` ended: worker 0's
    /// momentum held for it is placed once none is left.
    fn end_read(&mut self, chunk: u32) {
        let m = &mut self.server.as_mut().expect("server").momentum;
        let left = m.reading.get_mut(&chunk).expect("a read was counted");
        debug_assert!(*left > 0, "chunk {chunk}: counted reads end once each");
        *left -= 1;
        if *left == 0 {
            m.reading.remove(&chunk);
            if let Some((kind, track)) = m.held.remove(&chunk) {
                self.place_in_shard(chunk, kind, track);
            }
        }
    }

    /// `peer` begins a block of `chunk`'s momentum: checked against what a
    /// switch sends (see the module docs), then reassembled like factors.
    pub(super) fn momentum_begin(
        &mut self,
        peer: u32,
        chunk: u32,
        iter: u64,
        total: u64,
        to_server: bool,
    ) -> Result<()> {
        let bad = |violation| EngineError::protocol(peer, violation);
        let unexpected = ProtocolViolation::MomentumUnexpected { chunk, iter };
        let Some(ch) = self.book.chunks().get(chunk as usize).copied() else {
            return Err(bad(unexpected));
        };
        let want = ch.len as u64 * 4;
        if total != want {
            return Err(bad(ProtocolViolation::MomentumSize { chunk, total, want }));
        }
        let movable = self.moments.is_some() && self.book.plan().movable(ch.layer);
        let route = if to_server {
            ch.server == self.rank && self.book.cluster().worker_index(peer) == Some(0)
        } else {
            self.worker.is_some() && ch.server == peer
        };
        if !movable || !route {
            return Err(bad(unexpected));
        }
        // Taken in (checked against the plan, once) before any of it is placed.
        if to_server {
            self.server
                .as_mut()
                .expect("routed")
                .core
                .accept_momentum(peer, chunk, iter)?;
        } else {
            self.worker
                .as_mut()
                .expect("routed")
                .core
                .accept_momentum(chunk, iter, peer)?;
        }
        let block = Block::Momentum { chunk, to_server };
        self.inbox.begin(peer, block, iter, total as usize).map_err(bad)
    }

    /// `peer`'s momentum of `chunk` for `iter` is here, whole: placed (a
    /// server's part waits for its own sends of the chunk's momentum).
    pub(super) fn momentum_arrived(&mut self, peer: u32, chunk: u32, iter: u64, to_server: bool, data: Blob) {
        // The whole chunk: its begin checked the size.
        debug_assert_eq!(data.len(), self.book.chunks()[chunk as usize].len * 4);
        if !to_server {
            let dst = self.chunk_momentum(chunk);
            let track = JobTrack::MomentumIn {
                chunk,
                iter,
                from: peer,
                to_server,
            };
            self.new_job(Queue::Worker, JobKind::Place { dst, data }, track);
            return;
        }
        let dst = self.shard_momentum(chunk).expect("momentum moves");
        let track = JobTrack::MomentumIn {
            chunk,
            iter,
            from: peer,
            to_server: true,
        };
        self.place_in_shard(chunk, JobKind::Place { dst, data }, track);
    }

    /// The server job `kind` that writes the shard's momentum of `chunk`
    /// (worker 0's), now or once the sends that read it ended.
    fn place_in_shard(&mut self, chunk: u32, kind: JobKind, track: JobTrack) {
        let JobTrack::MomentumIn { iter, .. } = track else {
            unreachable!("a placement of momentum: {track:?}")
        };
        let m = &mut self.server.as_mut().expect("checked at the begin").momentum;
        if m.reading.contains_key(&chunk) {
            let was = m.held.insert(chunk, (kind, track));
            debug_assert!(was.is_none(), "chunk {chunk}: one block at a time from worker 0");
            return;
        }
        let layer = self.book.chunks()[chunk as usize].layer;
        self.new_job_at(Queue::Server, (iter, layer), kind, track);
    }

    /// A placement (or local copy) of `chunk`'s momentum for `iter` ran.
    pub(super) fn momentum_placed(&mut self, chunk: u32, iter: u64, from: u32, to_server: bool) -> Result<()> {
        let me = self.rank;
        debug_assert!(
            iter > 0 && self.moments.is_some(),
            "a switch's momentum, at iteration {iter}"
        );
        if to_server {
            self.server
                .as_mut()
                .expect("server")
                .core
                .handle_momentum(from, chunk)?;
            if from == me {
                // Worker 0's own server: its write-back of the momentum is done.
                return self.worker.as_mut().expect("worker 0").core.handle_seed_done(chunk);
            }
            return Ok(());
        }
        if from == me {
            // This rank's own server read its momentum for its own worker.
            self.end_read(chunk);
        }
        self.worker
            .as_mut()
            .expect("worker")
            .core
            .handle_momentum_in(chunk, iter, from)
    }
}
