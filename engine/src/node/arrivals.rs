//! What arrives: transmit and job completions, peers' writes (checked
//! against the sender's slots and the chunk's range) and messages (decoded,
//! checked, and reassembled for factor blocks).

use super::factors::Block;
use super::*;

impl Node {
    pub(super) fn tx_done(&mut self, track: Track) -> Result<()> {
        match track {
            Track::Init { chunk } => {
                let w = self.worker.as_mut().expect("worker 0 seeds");
                debug_assert_eq!(w.core.index(), 0, "worker 0 seeds");
                w.core.handle_seed_done(chunk)
            }
            Track::Ctrl | Track::Piece => Ok(()),
            Track::Momentum { chunk, reseed } => self.momentum_sent(chunk, reseed),
            Track::Push { slice } => {
                // What stays on this rank is no transmit: a pushed slice's server is a peer.
                let chunk = self.book.slices()[slice as usize].chunk;
                debug_assert_ne!(self.book.chunks()[chunk as usize].server, self.rank);
                self.worker.as_mut().expect("worker").core.handle_push_done(slice)
            }
            Track::Bcast { chunk, worker } => self
                .server
                .as_mut()
                .expect("server")
                .core
                .handle_broadcast_done(chunk, worker),
            Track::Factors { layer, peer } => {
                debug_assert_ne!(peer, self.rank, "own factors are captured, not sent");
                self.worker
                    .as_mut()
                    .expect("worker")
                    .core
                    .handle_factors_sent(layer, peer)
            }
        }
    }

    /// The transmit `token` failed with `reason`: moot to a peer that said
    /// goodbye, the loss of a worker the trigger goes on without, and
    /// otherwise the loss of the peer.
    pub(super) fn tx_failed(&mut self, token: u64, reason: String) -> Result<()> {
        if self.flow.was_dropped(token) {
            return Ok(());
        }
        match self.flow.done(token) {
            // It said goodbye: it needs nothing more, so the transmit is moot.
            Some((peer, track)) if self.peers[peer as usize].bye.is_some() => self.tx_done(track),
            // A worker this job's trigger can go on without.
            Some((peer, track)) if self.may_lose(peer) => {
                self.tx_done(track)?;
                self.lose_worker(peer)
            }
            Some((peer, _)) => Err(EngineError::PeerLost {
                rank: peer,
                reason: format!("an operation failed: {reason}"),
            }),
            None => Err(EngineError::protocol(
                self.rank,
                ProtocolViolation::UnknownTransmitFailed { token, reason },
            )),
        }
    }

    pub(super) fn job_done(&mut self, id: u64, data: Option<Vec<u8>>) -> Result<()> {
        let me = self.rank;
        let track = self
            .jobs
            .remove(&id)
            .ok_or_else(|| EngineError::protocol(me, ProtocolViolation::UnknownJob { id }))?;
        if track.queue() == Queue::Server && self.sched.trigger == Trigger::All {
            debug_assert!(self.srv_out > 0, "server job {id} was handed out");
            self.srv_out -= 1;
            self.pump_server_jobs();
        }
        match track {
            JobTrack::Accumulate {
                worker,
                slot,
                credit: true,
            } => self.return_slot(worker, slot)?,
            JobTrack::Accumulate {
                worker,
                slot,
                credit: false,
            } => {
                if let Some(s) = self.server.as_mut() {
                    s.core.handle_parked_read(worker, slot)?;
                }
            }
            JobTrack::FoldPartial | JobTrack::SumFactors => {}
            JobTrack::Encode { server, slot, slice } => self.encoded(server, slot, slice, data.as_deref())?,
            JobTrack::Apply { chunk } => self.apply_done(id, chunk)?,
            JobTrack::InitCopy { chunk } => {
                debug_assert_eq!(
                    self.book.chunks()[chunk as usize].server,
                    me,
                    "chunk {chunk} is seeded here"
                );
                self.server.as_mut().expect("server").core.handle_init(me, chunk)?;
                if let Some(w) = self.worker.as_mut() {
                    w.core.handle_seed_done(chunk)?;
                }
            }
            JobTrack::LocalBcast { chunk } => {
                debug_assert_eq!(
                    self.book.chunks()[chunk as usize].server,
                    me,
                    "chunk {chunk} is held here"
                );
                self.worker.as_mut().expect("worker").core.handle_params(chunk)?;
                self.server
                    .as_mut()
                    .expect("server")
                    .core
                    .handle_broadcast_done(chunk, me)?;
            }
            JobTrack::FormGrad { layer } => {
                let w = self.worker.as_mut().expect("worker");
                debug_assert!(w.forming[layer as usize], "layer {layer} was forming its gradient");
                w.forming[layer as usize] = false;
                w.core.grad_ready(layer)?;
            }
            JobTrack::Capture { layer, iter, len } => self.captured(layer, iter, len, data)?,
            JobTrack::Reconstruct { layer, iter } => self
                .worker
                .as_mut()
                .expect("worker")
                .core
                .handle_factors_applied(layer, iter)?,
            JobTrack::Publish { layer, iter } => self.published(layer, iter),
            JobTrack::MomentumIn {
                chunk,
                iter,
                from,
                to_server,
            } => self.momentum_placed(chunk, iter, from, to_server)?,
        }
        Ok(())
    }

    /// A sparse encoding of `slice` ran: its report (the pairs, or none when
    /// dense is smaller) feeds the statistics and the policy, and the slice
    /// goes to slot `slot` of `server` as the encoding said.
    fn encoded(&mut self, server: u32, slot: u32, slice: u32, data: Option<&[u8]>) -> Result<()> {
        debug_assert!(self.sparse_off[self.book.slices()[slice as usize].layer as usize].is_some());
        let report = data
            .and_then(crate::sparse::EncodeReport::from_bytes)
            .ok_or(EngineError::Job(JobFailure::NoEncodeCount { slice }))?;
        let si = self.book.slices()[slice as usize];
        let pairs = report
            .pairs
            .filter(|&n| n as usize <= crate::sparse::pair_limit(si.len));
        if let Some(n) = pairs {
            let st = &mut self.sparse_stats[si.layer as usize];
            st.nonzeros += u64::from(n);
            st.scanned += si.len as u64;
        }
        self.sparse_policy.report(slice, pairs);
        self.push_write(server, slot, slice, pairs);
        Ok(())
    }

    /// Job `id`, the apply of `chunk`, ran: the broadcasts and
    /// notifications of the chunk deferred while it ran go out now.
    fn apply_done(&mut self, id: u64, chunk: u32) -> Result<()> {
        let s = self.server.as_mut().expect("server");
        // One apply of a chunk runs at a time: this one.
        let running = s.apply_running.remove(&chunk);
        debug_assert_eq!(running, Some(id), "chunk {chunk}");
        let notify = s.deferred_notify.remove(&chunk).unwrap_or_default();
        for w in s.deferred.remove(&chunk).unwrap_or_default() {
            self.broadcast(chunk, w);
        }
        for (w, version) in notify {
            self.notify(chunk, w, version)?;
        }
        self.momentum_after_apply(chunk)
    }

    /// The capture of `layer`'s factors for `iter` ran: its bytes (`len`
    /// of them, or opaque where the runtime keeps them) are this worker's
    /// factors.
    fn captured(&mut self, layer: u32, iter: u64, len: usize, data: Option<Vec<u8>>) -> Result<()> {
        let spec = &self.book.layers()[layer as usize];
        debug_assert_eq!(
            len,
            self.book.config().batch * (spec.m + spec.n) * 4,
            "U and V of layer {layer}"
        );
        let blob = match data {
            Some(b) if b.len() == len => Blob::Bytes(b),
            Some(b) => {
                return Err(EngineError::Job(JobFailure::CaptureSize {
                    layer,
                    got: b.len(),
                    want: len,
                }))
            }
            None => Blob::Opaque(len),
        };
        let wi = self.worker.as_ref().expect("worker").core.index();
        self.factors_in(layer, iter, wi, blob)
    }

    /// A publish of `layer`'s view ran: for `iter`, the layer is ready for
    /// the caller; for the initial one (`None`), one fewer is left.
    fn published(&mut self, layer: u32, iter: Option<u64>) {
        match iter {
            Some(iter) => {
                debug_assert!(self.staged, "only a staged worker publishes");
                self.out.push_back(Output::LayerReady { layer, iter })
            }
            None => {
                let w = self.worker.as_mut().expect("worker");
                debug_assert!(
                    w.publish_started && w.publish_left > 0,
                    "an initial publish was counted"
                );
                w.publish_left -= 1;
            }
        }
    }

    pub(super) fn landed(&mut self, peer: u32, region: LocalRegion, offset: u64, len: u64, imm: u32) -> Result<()> {
        self.peer_mut(peer)?;
        self.landed_from[peer as usize] += 1;
        self.stranded_dirty = true;
        match region {
            LocalRegion::Landing => self.landed_push(peer, offset, len, imm),
            LocalRegion::Shard => self.landed_seed(peer, offset, len, imm),
            LocalRegion::Params => self.landed_params(peer, offset, len, imm),
            other => Err(EngineError::protocol(
                peer,
                ProtocolViolation::WriteIntoRegion { region: other },
            )),
        }
    }

    /// A push of slice `imm` (flagged sparse or not) from `peer` landed at
    /// `offset..offset + len` of the landing region: it must lie in one of
    /// the sender's slots and hold the slice (dense) or an encoding of it
    /// (sparse, written once), before the server core takes it.
    fn landed_push(&mut self, peer: u32, offset: u64, len: u64, imm: u32) -> Result<()> {
        let bad = |violation| EngineError::protocol(peer, violation);
        let book = self.book.clone();
        let slots = u64::from(self.sched.landing_slots());
        let slot_bytes = self.slot_bytes;
        if self.server.is_none() {
            return Err(bad(ProtocolViolation::PushToNonServer));
        }
        let wi = book
            .cluster()
            .worker_index(peer)
            .ok_or_else(|| bad(ProtocolViolation::PushFromNonWorker))? as u64;
        let sparse = imm & crate::sparse::SPARSE_IMM != 0;
        let slice = imm & !crate::sparse::SPARSE_IMM;
        let si = book
            .slices()
            .get(slice as usize)
            .ok_or_else(|| bad(ProtocolViolation::PushUnknownSlice { slice }))?;
        let g = offset / slot_bytes;
        let start = g * slot_bytes;
        let slot = (g % slots) as u32;
        if !sparse {
            let ends = matches!(
                (offset.checked_add(len), start.checked_add(si.len as u64 * 4)),
                (Some(end), Some(want)) if end == want
            );
            if g / slots != wi || len == 0 || !ends {
                return Err(bad(ProtocolViolation::PushOutsideSlots {
                    slice,
                    bytes: si.len * 4,
                    offset,
                    len,
                }));
            }
        } else {
            let n = sparse_pairs(&book, slice, g / slots == wi, start, offset, len).map_err(bad)?;
            debug_assert!(crate::sparse::encoded_bytes(n as usize) as u64 <= slot_bytes);
            if self.landing_sparse.insert((peer, slot), n as u32).is_some() {
                return Err(bad(ProtocolViolation::SlotWrittenTwice { slot }));
            }
        }
        // The sender's slots lie inside the landing region.
        debug_assert!(start + slot_bytes <= self.bytes[region_index(LocalRegion::Landing)]);
        let s = self.server.as_mut().expect("checked above");
        s.core.handle_landed(peer, slot, slice)
    }

    /// A write of chunk `chunk`'s initial values from `peer` landed at
    /// `offset..offset + len` of the shard: it must be exactly the chunk's
    /// place there, the chunk held here, before the server core takes it.
    fn landed_seed(&mut self, peer: u32, offset: u64, len: u64, chunk: u32) -> Result<()> {
        let bad = |violation| EngineError::protocol(peer, violation);
        let book = self.book.clone();
        let s = self
            .server
            .as_mut()
            .ok_or_else(|| bad(ProtocolViolation::SeedToNonServer))?;
        let ch = book
            .chunks()
            .get(chunk as usize)
            .ok_or_else(|| bad(ProtocolViolation::SeedUnknownChunk { chunk }))?;
        let (a, b) = (ch.shard_offset as u64 * 4, (ch.shard_offset + ch.len) as u64 * 4);
        if ch.server != self.rank || len == 0 || offset < a || offset.checked_add(len) != Some(b) {
            return Err(bad(ProtocolViolation::SeedOutsideChunk { chunk, offset, len }));
        }
        debug_assert!(
            b <= self.bytes[region_index(LocalRegion::Shard)],
            "chunk {chunk} in the shard"
        );
        s.core.handle_init(peer, chunk)
    }

    /// A broadcast of chunk `chunk` from its server `peer` landed at
    /// `offset..offset + len` of the parameters: it must be exactly the
    /// chunk's place there before the worker core takes it.
    fn landed_params(&mut self, peer: u32, offset: u64, len: u64, chunk: u32) -> Result<()> {
        let bad = |violation| EngineError::protocol(peer, violation);
        let book = self.book.clone();
        let base = self.param_off.first().copied().unwrap_or(0);
        let w = self
            .worker
            .as_mut()
            .ok_or_else(|| bad(ProtocolViolation::ParamsToNonWorker))?;
        let ch = book
            .chunks()
            .get(chunk as usize)
            .ok_or_else(|| bad(ProtocolViolation::ParamsUnknownChunk { chunk }))?;
        let a = base + (book.layer_offset(ch.layer) + ch.offset) as u64 * 4;
        let b = a + ch.len as u64 * 4;
        if ch.server != peer || len == 0 || offset < a || offset.checked_add(len) != Some(b) {
            return Err(bad(ProtocolViolation::ParamsOutsideChunk { chunk, offset, len }));
        }
        debug_assert!(
            b <= self.bytes[region_index(LocalRegion::Params)],
            "chunk {chunk} in the parameters"
        );
        // The core cannot know who wrote: a violation is the writer's.
        w.core.handle_params(chunk).map_err(|e| match e {
            EngineError::Protocol { violation, .. } => EngineError::protocol(peer, violation),
            other => other,
        })
    }

    pub(super) fn message(&mut self, peer: u32, tag: u32, data: Payload) -> Result<()> {
        let bad = |violation| EngineError::protocol(peer, violation);
        let kind = wire::kind_of(tag).map_err(|e| bad(ProtocolViolation::Wire(e)))?;
        let hello_seen = self.peer_mut(peer)?.hello;
        if kind != Kind::Hello && !hello_seen {
            return Err(bad(ProtocolViolation::BeforeHello { kind }));
        }
        if kind == Kind::FactorData {
            // Refused unless a block was begun (checked at its begin).
            match self.inbox.data(peer, data).map_err(bad)? {
                Some((Block::Factors { layer }, iter, blob)) => {
                    let wi = self.book.cluster().worker_index(peer).expect("checked at begin");
                    self.factors_in(layer, iter, wi, blob)?;
                }
                Some((Block::Momentum { chunk, to_server }, iter, blob)) => {
                    self.momentum_arrived(peer, chunk, iter, to_server, blob)
                }
                None => {}
            }
            return Ok(());
        }
        let Payload::Bytes(bytes) = data else {
            return Err(bad(ProtocolViolation::MessageWithoutBytes { kind }));
        };
        match wire::decode(tag, &bytes).map_err(|e| bad(ProtocolViolation::Wire(e)))? {
            Msg::Hello(h) => {
                if hello_seen {
                    return Err(bad(ProtocolViolation::SecondHello));
                }
                self.hello(peer, h)
            }
            Msg::Credit(slots) => {
                let w = self
                    .worker
                    .as_mut()
                    .ok_or_else(|| bad(ProtocolViolation::CreditToNonWorker))?;
                for s in slots {
                    w.core.handle_credit(peer, s)?;
                }
                Ok(())
            }
            Msg::FactorsBegin { layer, iter, total } => self.factors_begin(peer, layer, iter, total),
            Msg::FactorData => unreachable!("handled above"),
            Msg::Finished { writes } => self.peer_finished(peer, writes),
            Msg::Bye { writes } => {
                let p = self.peer_mut(peer)?;
                if p.bye.is_some() {
                    return Err(bad(ProtocolViolation::ByeTwice));
                }
                p.bye = Some(writes);
                Ok(())
            }
            Msg::Notify { chunk, version } => {
                let w = self
                    .worker
                    .as_mut()
                    .ok_or_else(|| bad(ProtocolViolation::NotifyToNonWorker))?;
                w.core.handle_notify(peer, chunk, version)
            }
            Msg::Decide { at, sfb } => self.decision_from(peer, at, sfb),
            Msg::MomentumBegin {
                chunk,
                iter,
                total,
                to_server,
            } => self.momentum_begin(peer, chunk, iter, total, to_server),
            Msg::Pull { chunk, version } => {
                let s = self
                    .server
                    .as_mut()
                    .ok_or_else(|| bad(ProtocolViolation::PullToNonServer))?;
                s.core.handle_pull(peer, chunk, version)
            }
            Msg::Abort(reason) => Err(EngineError::PeerAborted { rank: peer, reason }),
        }
    }

    /// `peer` begins a factor block of `total` bytes for `layer`, iteration
    /// `iter`: a worker's, of an FC layer whose scheme takes factors, the
    /// block's size, and sent where the scheme rebuilds the layer (a worker
    /// under SFB, the layer's server under Adam).
    fn factors_begin(&mut self, peer: u32, layer: u32, iter: u64, total: u64) -> Result<()> {
        let bad = |violation| EngineError::protocol(peer, violation);
        let book = self.book.clone();
        if book.cluster().worker_index(peer).is_none() {
            return Err(bad(ProtocolViolation::FactorsFromNonWorker));
        }
        let spec = book.layer(layer).map_err(|_| {
            bad(ProtocolViolation::FactorsUnknownLayer {
                layer,
                layers: book.layers().len() as u32,
            })
        })?;
        let want = book.config().batch as u64 * (spec.m + spec.n) as u64 * 4;
        // An iteration not yet decided: its layer may go either way (checked when decided).
        let settled = self.plan.settled(layer, iter);
        let scheme = if settled {
            self.plan.scheme(layer, iter)
        } else {
            Scheme::Sfb
        };
        if spec.kind != LayerKind::Fc || !scheme.takes_factors() || total != want {
            return Err(bad(ProtocolViolation::FactorBlockMismatch {
                total,
                layer,
                name: spec.name.clone(),
                scheme,
                want,
            }));
        }
        let holder = book.chunks()[book.layer_chunks(layer).start as usize].server;
        match scheme {
            Scheme::Sfb if self.worker.is_none() => return Err(bad(ProtocolViolation::FactorsToNonWorker)),
            Scheme::Adam if holder != self.rank || self.server.is_none() => {
                return Err(bad(ProtocolViolation::AdamFactorsMisrouted {
                    layer,
                    to: self.rank,
                    holder,
                }))
            }
            _ => {}
        }
        debug_assert_eq!(total % 4, 0, "a block of f32s");
        self.inbox
            .begin(peer, Block::Factors { layer }, iter, total as usize)
            .map_err(bad)
    }

    /// `peer`'s worker is done, after `writes` writes to this rank (once):
    /// the stranded check is on.
    fn peer_finished(&mut self, peer: u32, writes: u64) -> Result<()> {
        let p = self.peer_mut(peer)?;
        if p.finished.is_some() {
            return Err(EngineError::protocol(peer, ProtocolViolation::FinishedTwice));
        }
        p.finished = Some(writes);
        self.any_finished = true;
        self.stranded_dirty = true;
        debug_assert_ne!(peer, self.rank, "a peer's worker finished");
        Ok(())
    }
}

/// The pairs of a sparse push of `slice` written from its slot's `start`
/// to `offset + len` ("sparse, (len - 8) / 8 pairs": a write over the
/// transport's cap lands in pieces, and the last one carries the immediate,
/// so the length counts from the slot's start). Malformed unless it lies in
/// the sender's slots (`in_slots`), holds a whole number of pairs within the
/// slice's limit, and the slice's layer goes sparse.
fn sparse_pairs(
    book: &Book,
    slice: u32,
    in_slots: bool,
    start: u64,
    offset: u64,
    len: u64,
) -> std::result::Result<u64, ProtocolViolation> {
    let si = book.slices()[slice as usize];
    let h = crate::sparse::HEADER_BYTES as u64;
    let p = crate::sparse::PAIR_BYTES as u64;
    let total = offset
        .checked_add(len)
        .and_then(|e| e.checked_sub(start))
        .filter(|_| len > 0);
    let pairs = total
        .and_then(|t| t.checked_sub(h))
        .filter(|b| b % p == 0)
        .map(|b| b / p);
    let ok = in_slots
        && pairs.is_some_and(|n| n as usize <= crate::sparse::pair_limit(si.len))
        && book.layers()[si.layer as usize].sparse;
    let n = pairs.filter(|_| ok).ok_or(ProtocolViolation::SparsePushMalformed {
        slice,
        offset,
        len,
        pairs_max: crate::sparse::pair_limit(si.len),
    })?;
    debug_assert!(
        n as usize <= crate::sparse::pair_limit(si.len),
        "slice {slice}: {n} pairs"
    );
    Ok(n)
}
