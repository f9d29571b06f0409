//! The worker side: hand-ins from the caller, and the worker core's
//! commands turned into writes, factor blocks, jobs and layer-ready events.

use super::*;
use crate::sparse::{self, Choice};

impl Node {
    pub(super) fn hand_in(&mut self, layer: u32, factors: bool) -> Result<()> {
        if self.life.shutdown() {
            return Err(EngineError::Shutdown);
        }
        // A hand-in may wait for a decision: one place per layer.
        debug_assert_eq!(self.parked_in.len(), self.book.layers().len());
        self.hand_in_now(layer, factors)
    }

    /// A hand-in the caller made (before any shutdown): now, or again once
    /// the decision it waited for came.
    pub(super) fn hand_in_now(&mut self, layer: u32, factors: bool) -> Result<()> {
        let spec = self.book.layer(layer)?.clone();
        let rank = self.rank;
        let parked = self.is_parked(layer);
        let Some(w) = self.worker.as_mut() else {
            return Err(EngineError::InvalidConfig(format!("rank {rank} is not a worker")));
        };
        if w.forming[layer as usize] || w.core.is_in_flight(layer) || parked {
            return Err(EngineError::LayerBusy {
                layer,
                name: spec.name.clone(),
                iter: w.core.completed(layer),
            });
        }
        let iter = w.core.completed(layer);
        if self.park_undecided(layer, iter, factors)? {
            return Ok(());
        }
        let w = self.worker.as_mut().expect("a worker, above");
        if !factors {
            w.core.grad_ready(layer)?;
            debug_assert!(w.core.is_in_flight(layer), "layer {layer} went by the PS");
            return Ok(());
        }
        if spec.kind != LayerKind::Fc {
            return Err(EngineError::NotFullyConnected {
                layer,
                name: spec.name.clone(),
            });
        }
        match w.core.next_scheme(layer)? {
            Scheme::Sfb => {
                let iter = w.core.completed(layer);
                w.core.sf_ready(layer)?;
                debug_assert!(w.core.is_in_flight(layer), "layer {layer} went by SFB");
                self.capture_factors(layer, iter);
            }
            Scheme::Adam => {
                // To the layer's server (a `SendFactors`, or this rank's own
                // server through a capture: see `worker_cmd`).
                w.core.sf_ready(layer)?;
                debug_assert!(w.core.is_in_flight(layer), "layer {layer} went by Adam");
            }
            Scheme::Ps => self.form_gradient(layer),
        }
        Ok(())
    }

    /// Queues the capture of `layer`'s factors (U then V, from the caller's
    /// factor buffer) for `iter`: SFB's own copy, or Adam's to this rank's
    /// own server (`factors_in` takes it when the job is done).
    fn capture_factors(&mut self, layer: u32, iter: u64) {
        let spec = &self.book.layers()[layer as usize];
        debug_assert_eq!(spec.kind, LayerKind::Fc, "layer {layer} has factors");
        let len = self.book.config().batch as u64 * (spec.m + spec.n) as u64 * 4;
        let factors = Loc {
            region: LocalRegion::Factors,
            offset: self.factor_off[layer as usize].expect("FC layers have factors"),
        };
        self.new_job(
            Queue::Worker,
            JobKind::CaptureFactors { layer, factors, len },
            JobTrack::Capture {
                layer,
                iter,
                len: len as usize,
            },
        );
    }

    /// The PS scheme for an FC layer handed in as factors: marks `layer`
    /// forming and queues the job that forms its gradient from them.
    fn form_gradient(&mut self, layer: u32) {
        let w = self.worker.as_mut().expect("worker");
        debug_assert!(!w.forming[layer as usize], "layer {layer} forms one gradient at a time");
        w.forming[layer as usize] = true;
        let factors = Loc {
            region: LocalRegion::Factors,
            offset: self.factor_off[layer as usize].expect("FC layers have factors"),
        };
        let grad = Loc {
            region: LocalRegion::Grads,
            offset: self.grad_off[layer as usize],
        };
        self.new_job(
            Queue::Worker,
            JobKind::FactorsToGrad { layer, factors, grad },
            JobTrack::FormGrad { layer },
        );
    }

    pub(super) fn worker_cmd(&mut self, cmd: WorkerCommand) -> Result<()> {
        let book = self.book.clone();
        let me = self.rank;
        match cmd {
            WorkerCommand::InitPush { server, chunk } => self.init_push(server, chunk),
            WorkerCommand::Push {
                server, slot, slice, ..
            } => self.push_slice(server, slot, slice)?,
            WorkerCommand::SendFactors { peer, layer, iter } if peer == me => {
                // Adam, and this rank holds the layer: its own server takes
                // the factors from a capture (`factors_in`).
                debug_assert_eq!(self.plan.scheme(layer, iter), Scheme::Adam);
                self.capture_factors(layer, iter);
            }
            WorkerCommand::SendFactors { peer, layer, iter } => {
                debug_assert!(
                    self.plan.scheme(layer, iter).takes_factors(),
                    "layer {layer} sends factors"
                );
                if !self.peers[peer as usize].open {
                    self.early[peer as usize].push(Early::Factors { layer, iter });
                    return Ok(());
                }
                self.send_factors(peer, layer, iter);
            }
            WorkerCommand::Reconstruct { layer, iter } => {
                debug_assert_eq!(
                    self.plan.scheme(layer, iter),
                    Scheme::Sfb,
                    "only SFB rebuilds on the worker"
                );
                self.reconstruct(layer, iter);
            }
            WorkerCommand::Pull { server, chunk, version } => {
                debug_assert_eq!(
                    book.chunks()[chunk as usize].server,
                    server,
                    "chunk {chunk} is pulled from its owner"
                );
                debug_assert!(version > 0, "a pull names an applied version");
                if server == me {
                    self.server
                        .as_mut()
                        .expect("colocated")
                        .core
                        .handle_pull(me, chunk, version)?;
                } else {
                    self.send_ctrl(server, &Msg::Pull { chunk, version });
                }
            }
            WorkerCommand::LayerReady { layer, iter } => self.layer_ready(layer, iter),
            WorkerCommand::SendMomentum { server, chunk, iter } => self.momentum_to_server(server, chunk, iter)?,
        }
        Ok(())
    }

    /// Seeds `chunk` at its server `server` from this worker's parameters
    /// (worker 0's job): a local copy into the shard, or a write.
    fn init_push(&mut self, server: u32, chunk: u32) {
        let ch = self.book.chunks()[chunk as usize];
        debug_assert_eq!(ch.server, server, "chunk {chunk} is seeded at its owner");
        debug_assert_eq!(self.worker.as_ref().map(|w| w.core.index()), Some(0), "worker 0 seeds");
        let src = Loc {
            region: LocalRegion::Params,
            offset: self.param_off[ch.layer as usize] + ch.offset as u64 * 4,
        };
        let len = ch.len as u64 * 4;
        let shard_at = ch.shard_offset as u64 * 4;
        if server == self.rank {
            let dst = Loc {
                region: LocalRegion::Shard,
                offset: shard_at,
            };
            self.new_job(
                Queue::Server,
                JobKind::Copy { src, dst, len },
                JobTrack::InitCopy { chunk },
            );
        } else {
            let dst = RemoteLoc {
                region: LocalRegion::Shard,
                offset: shard_at,
            };
            self.write(server, src, dst, len, chunk, Track::Init { chunk });
        }
    }

    /// Pushes `slice` into slot `slot` of `server`: this rank's own server
    /// takes it as landed (read from the gradient); a peer gets a write,
    /// sparse-encoded first where the layer and the policy say so.
    fn push_slice(&mut self, server: u32, slot: u32, slice: u32) -> Result<()> {
        let me = self.rank;
        let si = self.book.slices()[slice as usize];
        debug_assert_eq!(
            self.book.chunks()[si.chunk as usize].server,
            server,
            "slice {slice} goes to its owner"
        );
        if server == me {
            let s = self.server.as_mut().expect("colocated");
            // A slot is free before it is taken.
            let taken = s.local_slots.insert(slot, slice);
            debug_assert!(taken.is_none(), "local slot {slot} taken twice");
            s.core.handle_landed(me, slot, slice)?;
            self.stranded_dirty = true;
        } else if let Some(base) = self.sparse_off[si.layer as usize] {
            match self.sparse_policy.choose(&self.sparse_costs, slice, si.len) {
                Choice::Try { cap } => self.encode_sparse(server, slot, slice, base, cap),
                Choice::Dense => self.push_write(server, slot, slice, None),
            }
        } else {
            self.push_write(server, slot, slice, None);
        }
        Ok(())
    }

    /// Queues the sparse encoding of `slice` (at most `cap` pairs) into its
    /// place in the `Sparse` staging at `base`; its write follows the job.
    fn encode_sparse(&mut self, server: u32, slot: u32, slice: u32, base: u64, cap: usize) {
        let si = self.book.slices()[slice as usize];
        debug_assert_eq!(
            self.sparse_off[si.layer as usize],
            Some(base),
            "slice {slice} is sparse"
        );
        let src = Loc {
            region: LocalRegion::Grads,
            offset: self.grad_off[si.layer as usize] + si.offset as u64 * 4,
        };
        let dst = Loc {
            region: LocalRegion::Sparse,
            offset: base + si.offset as u64 * 4,
        };
        self.new_job(
            Queue::Worker,
            JobKind::EncodeSparse {
                slice,
                src,
                len: si.len,
                dst,
                cap,
            },
            JobTrack::Encode { server, slot, slice },
        );
    }

    /// The core finished `layer`'s iteration `iter`: tells the caller, once
    /// its view is published where the caller reads a staged view.
    fn layer_ready(&mut self, layer: u32, iter: u64) {
        // The core finished the iteration: the layer's next one is the one after.
        let w = &self.worker.as_ref().expect("worker").core;
        debug_assert!(!w.is_in_flight(layer), "layer {layer} is ready");
        debug_assert_eq!(w.completed(layer), iter + 1, "layer {layer}");
        if self.staged {
            self.publish(layer, Some(iter));
        } else {
            self.out.push_back(Output::LayerReady { layer, iter });
        }
    }

    /// Writes `slice` into landing slot `slot` of `server`: dense from the
    /// gradient, or (`pairs`) its encoding from the `Sparse` staging.
    pub(super) fn push_write(&mut self, server: u32, slot: u32, slice: u32, pairs: Option<u32>) {
        let si = self.book.slices()[slice as usize];
        let wi = self.worker.as_ref().expect("worker").core.index() as u64;
        debug_assert!(slot < self.sched.landing_slots(), "slot {slot}");
        let dst = RemoteLoc {
            region: LocalRegion::Landing,
            offset: (wi * u64::from(self.sched.landing_slots()) + u64::from(slot)) * self.slot_bytes,
        };
        let st = &mut self.sparse_stats[si.layer as usize];
        let (src, len, imm) = match pairs {
            Some(n) => {
                // The server refuses more pairs than the limit.
                debug_assert!(n as usize <= sparse::pair_limit(si.len), "{n} pairs of slice {slice}");
                let len = sparse::encoded_bytes(n as usize) as u64;
                st.sparse_pushes += 1;
                st.sparse_bytes += len;
                let src = Loc {
                    region: LocalRegion::Sparse,
                    offset: self.sparse_off[si.layer as usize].expect("a sparse layer") + si.offset as u64 * 4,
                };
                (src, len, slice | sparse::SPARSE_IMM)
            }
            None => {
                let len = si.len as u64 * 4;
                if self.sparse_off[si.layer as usize].is_some() {
                    st.dense_pushes += 1;
                    st.dense_bytes += len;
                }
                let src = Loc {
                    region: LocalRegion::Grads,
                    offset: self.grad_off[si.layer as usize] + si.offset as u64 * 4,
                };
                (src, len, slice)
            }
        };
        // Dense or encoded, a push fits its landing slot (the server checks it too).
        debug_assert!(
            len <= self.slot_bytes,
            "a push of {len} bytes, slots of {}",
            self.slot_bytes
        );
        self.write(server, src, dst, len, imm, Track::Push { slice });
    }

    /// Queues a factor block: its begin message, then fragments of at most
    /// the message cap, sent zero-copy from the factor region, cut as
    /// [`factors::fragments`] says (at the U/V boundary first, so that the
    /// receiver reads U and V in place in the fragments they came in).
    pub(super) fn send_factors(&mut self, peer: u32, layer: u32, iter: u64) {
        let spec = &self.book.layers()[layer as usize];
        let k = self.book.config().batch as u64;
        let (u, total) = (k * spec.m as u64 * 4, k * (spec.m + spec.n) as u64 * 4);
        debug_assert!(0 < u && u < total, "U and V of layer {layer} are not empty");
        let base = self.factor_off[layer as usize].expect("FC");
        // The cap is the peer's from its hello: blocks wait in `early` until it opens.
        debug_assert!(
            self.peers[peer as usize].open,
            "factors to rank {peer} before it opened"
        );
        self.send_ctrl(peer, &Msg::FactorsBegin { layer, iter, total });
        for (off, n) in factors::fragments(u, total, self.message_cap(peer)) {
            self.stats.max_message = self.stats.max_message.max(n);
            let track = if off + n == total {
                Track::Factors { layer, peer }
            } else {
                Track::Piece
            };
            let at = Loc {
                region: LocalRegion::Factors,
                offset: base + off,
            };
            let tag = Kind::FactorData.tag();
            self.enqueue(peer, Op::SendRegion { tag, at, len: n }, track, true);
        }
    }

    pub(super) fn publish(&mut self, layer: u32, iter: Option<u64>) {
        debug_assert!(self.staged, "only a staged worker publishes a view");
        let len = self.book.layers()[layer as usize].params() as u64 * 4;
        let src = Loc {
            region: LocalRegion::Params,
            offset: self.param_off[layer as usize],
        };
        let dst = Loc {
            region: LocalRegion::View,
            offset: self.view_off[layer as usize],
        };
        self.new_job(
            Queue::Worker,
            JobKind::Publish { layer, src, dst, len },
            JobTrack::Publish { layer, iter },
        );
    }

    pub(super) fn reconstruct(&mut self, layer: u32, iter: u64) {
        match self.inbox.take(layer, iter) {
            Some(factors) => {
                debug_assert_eq!(factors.len(), self.book.p1(), "every worker's factors");
                let params = Loc {
                    region: LocalRegion::Params,
                    offset: self.param_off[layer as usize],
                };
                self.new_job(
                    Queue::Worker,
                    JobKind::Reconstruct {
                        layer,
                        iter,
                        params,
                        factors,
                        momentum: self.layer_momentum(layer),
                    },
                    JobTrack::Reconstruct { layer, iter },
                );
            }
            None => {
                // One reconstruction is asked for per iteration.
                let new = self.worker.as_mut().expect("worker").want.insert((layer, iter));
                debug_assert!(new, "layer {layer} iteration {iter} wanted twice");
            }
        }
    }

    /// Worker index `wi`'s factors of `layer` for `iter` are complete: for
    /// this rank's worker (SFB) or its server (Adam, which holds the layer).
    pub(super) fn factors_in(&mut self, layer: u32, iter: u64, wi: usize, blob: Blob) -> Result<()> {
        let spec = &self.book.layers()[layer as usize];
        debug_assert_eq!(spec.kind, LayerKind::Fc, "layer {layer} has factors");
        debug_assert_eq!(
            blob.len(),
            self.book.config().batch * (spec.m + spec.n) * 4,
            "U and V of layer {layer}"
        );
        let from = self.book.cluster().workers()[wi];
        self.inbox
            .put(layer, iter, wi, blob)
            .map_err(|violation| EngineError::protocol(from, violation))?;
        if self.book.scheme(layer, iter) == Scheme::Adam {
            let me = self.rank;
            // Adam's factors reach the layer's server only (checked at their begin).
            debug_assert_eq!(
                self.book.chunks()[self.book.layer_chunks(layer).start as usize].server,
                me
            );
            let s = self.server.as_mut().ok_or_else(|| {
                EngineError::protocol(from, ProtocolViolation::AdamFactorsToNonServer { layer, to: me })
            })?;
            s.core.handle_factors(from, layer, iter)?;
            if from == me {
                // This rank's own factors, captured: the "send" is done.
                self.worker
                    .as_mut()
                    .expect("worker")
                    .core
                    .handle_factors_sent(layer, me)?;
            }
            return Ok(());
        }
        let w = self.worker.as_mut().expect("worker");
        if from != self.rank {
            w.core.handle_factors_arrived(layer, iter, from)?;
        }
        if w.want.remove(&(layer, iter)) {
            self.reconstruct(layer, iter);
        }
        Ok(())
    }
}
