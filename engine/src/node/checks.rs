//! What a [`Node`] asserts about itself (in debug builds): what every input
//! leaves true, and that every job and transmit it emits lies inside the
//! regions of both ends and within the transport's limits: the runtime and
//! the transport take these ranges as they are.

use super::*;

impl Node {
    /// What every input leaves true, short of a failure (O(ranks)).
    pub(super) fn debug_invariants(&self) {
        debug_assert!(self.peers[self.rank as usize].open, "this rank is open to itself");
        debug_assert!(self.open_peers < self.peers.len());
        // Server jobs handed out or queued are jobs, and queued ones are held.
        debug_assert!(self.srv_out <= SERVER_JOBS_OUT);
        debug_assert_eq!(self.srv_jobs.len(), self.srv_queue.len());
        debug_assert!(self.srv_out + self.srv_jobs.len() <= self.jobs.len());
        // Only a trigger other than `all` goes on without a worker.
        debug_assert!(self.sched.trigger != Trigger::All || self.peers.iter().all(|p| !p.lost));
        debug_assert!(self.life != Life::Done || (self.jobs.is_empty() && self.flow.idle()));
        // Nothing is written to oneself; a landing slot holds one sparse push at a time.
        debug_assert!(self.imm_sent[self.rank as usize] == 0 && self.landed_from[self.rank as usize] == 0);
        let slots = self.book.p1() * self.sched.landing_slots() as usize;
        debug_assert!(self.landing_sparse.len() <= slots);
    }

    /// A job inside the regions and the shard it reads and writes: the
    /// runtime's executors take these ranges as they are.
    pub(super) fn debug_job(&self, kind: &JobKind) {
        let within = |at: &Loc, len: u64| at.offset + len <= self.bytes[region_index(at.region)];
        let shard = self.server.as_ref().map_or(0, |_| self.book.shard_len(self.rank));
        let layer_bytes = |l: &u32| self.book.layers()[*l as usize].params() as u64 * 4;
        let uv_bytes = |l: &u32| {
            let l = &self.book.layers()[*l as usize];
            (self.book.config().batch * (l.m + l.n) * 4) as u64
        };
        match kind {
            JobKind::Accumulate {
                window,
                acc_at,
                src,
                len,
                pairs,
                ..
            } => {
                debug_assert!(acc_at + len <= shard && (*window as usize) < self.windows(), "{kind:?}");
                let read = pairs.map_or(*len * 4, |n| crate::sparse::encoded_bytes(n as usize));
                debug_assert!(within(src, read as u64), "{kind:?}");
            }
            JobKind::FoldPartial { acc_at, len, .. } => debug_assert!(acc_at + len <= shard, "{kind:?}"),
            JobKind::EncodeSparse { src, len, dst, cap, .. } => {
                debug_assert!(within(src, *len as u64 * 4), "{kind:?}");
                debug_assert!(*cap <= crate::sparse::pair_limit(*len), "{kind:?}");
                // The most it writes: cap pairs and the header.
                debug_assert!(within(dst, crate::sparse::encoded_bytes(*cap) as u64), "{kind:?}");
            }
            JobKind::Apply {
                window,
                shard_at,
                len,
                gradients,
                momentum,
                ..
            } => {
                debug_assert!(shard_at + len <= shard && *gradients > 0, "{kind:?}");
                debug_assert!(momentum.map_or(true, |m| m.region == LocalRegion::Moments
                    && within(&m, *len as u64 * 4)));
                debug_assert!((*window as usize) < self.windows(), "{kind:?}");
            }
            JobKind::Copy { src, dst, len } => {
                // Seeding this rank's shard, or a broadcast to its own worker.
                let (s, d) = (src.region, dst.region);
                debug_assert!(matches!(
                    (s, d),
                    (LocalRegion::Params, LocalRegion::Shard)
                        | (LocalRegion::Shard, LocalRegion::Params)
                        | (LocalRegion::Moments, LocalRegion::Moments)
                ));
                debug_assert!(within(src, *len) && within(dst, *len), "{kind:?}");
            }
            JobKind::Publish { src, dst, len, .. } => {
                debug_assert!(
                    src.region == LocalRegion::Params && dst.region == LocalRegion::View,
                    "{kind:?}"
                );
                debug_assert!(within(src, *len) && within(dst, *len), "{kind:?}");
            }
            JobKind::FactorsToGrad { layer, factors, grad } => {
                debug_assert!(
                    within(factors, uv_bytes(layer)) && within(grad, layer_bytes(layer)),
                    "{kind:?}"
                );
            }
            JobKind::CaptureFactors { layer, factors, len } => {
                debug_assert!(*len == uv_bytes(layer) && within(factors, *len), "{kind:?}");
            }
            JobKind::Reconstruct {
                layer,
                params,
                factors,
                momentum,
                ..
            } => {
                debug_assert!(within(params, layer_bytes(layer)) && factors.len() == self.book.p1());
                debug_assert!(momentum.map_or(true, |m| m.region == LocalRegion::Moments
                    && within(&m, layer_bytes(layer))));
            }
            JobKind::Place { dst, data } => {
                // A peer's momentum of a chunk, into this rank's.
                debug_assert!(
                    dst.region == LocalRegion::Moments && within(dst, data.len() as u64),
                    "{kind:?}"
                );
            }
            JobKind::SumFactors {
                layer, acc_at, factors, ..
            } => {
                debug_assert!((acc_at * 4) as u64 + layer_bytes(layer) <= shard as u64 * 4);
                debug_assert_eq!(factors.len(), self.book.p1());
            }
        }
    }

    /// A transmit within the limits and inside the regions of both ends (a
    /// peer's region sizes follow from the book and the agreed slots, as ours do).
    pub(super) fn debug_transmit(&self, t: &Transmit) {
        let within = |at: &Loc, len: u64| at.offset + len <= self.bytes[region_index(at.region)];
        match &t.op {
            TxOp::Write { src, dst, len, imm } => {
                debug_assert!(*len > 0 && *len <= self.write_cap(t.peer), "{t:?}");
                // The immediate names a slice (a push) or a chunk, as `landed` reads it.
                debug_assert!(
                    imm.map_or(true, |i| match dst.region {
                        LocalRegion::Landing => ((i & !crate::sparse::SPARSE_IMM) as usize) < self.book.slices().len(),
                        _ => (i as usize) < self.book.chunks().len(),
                    }),
                    "{t:?}"
                );
                debug_assert!(within(src, *len), "{t:?}");
                let theirs = match dst.region {
                    LocalRegion::Landing => {
                        self.book.p1() as u64 * u64::from(self.sched.landing_slots()) * self.slot_bytes
                    }
                    LocalRegion::Shard => self.book.shard_len(t.peer) as u64 * 4,
                    LocalRegion::Params => {
                        self.peers[t.peer as usize].params_base + self.book.total_params() as u64 * 4
                    }
                    other => unreachable!("a write into the peer's {other:?}"),
                };
                debug_assert!(
                    dst.offset + len <= theirs,
                    "{t:?}: the peer's region holds {theirs} bytes"
                );
            }
            TxOp::Send {
                tag,
                src: SendSrc::Region { at, len },
            } => {
                debug_assert_eq!(*tag, Kind::FactorData.tag(), "only factor data goes from a region");
                debug_assert!(*len > 0 && *len <= self.message_cap(t.peer), "{t:?}");
                debug_assert!(
                    matches!(at.region, LocalRegion::Factors | LocalRegion::Moments) && within(at, *len),
                    "{t:?}"
                );
            }
            TxOp::Send {
                tag,
                src: SendSrc::Inline { cell, bytes },
            } => {
                debug_assert!((*cell as usize) < CELLS && bytes.len() <= CELL_BYTES, "{t:?}");
                debug_assert!(wire::kind_of(*tag).is_ok_and(|k| k != Kind::FactorData), "{t:?}");
            }
        }
    }
}
