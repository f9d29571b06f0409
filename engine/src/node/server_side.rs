//! The server side: the server core's commands turned into accumulate and
//! apply jobs, broadcasts (after their chunk's apply ran) and credits (after
//! the accumulate that read the slot ran).

use super::*;

impl Node {
    pub(super) fn server_cmd(&mut self, cmd: ServerCommand) -> Result<()> {
        let book = self.book.clone();
        match cmd {
            ServerCommand::Accumulate {
                worker,
                slot,
                slice,
                window,
                first,
                partial,
                credit,
                iter,
            } => {
                let si = book.slices()[slice as usize];
                debug_assert!((window as usize) < self.windows(), "window {window}");
                // Parked slots and fold groups are the deterministic order's.
                debug_assert!(credit || self.server.as_ref().is_some_and(|s| s.core.deterministic()));
                debug_assert!(!partial || self.sched.fold_group > 1);
                let (src, pairs) = self.accumulate_source(worker, slot, slice);
                self.new_job_at(
                    Queue::Server,
                    (iter, si.layer),
                    JobKind::Accumulate {
                        window,
                        chunk: si.chunk,
                        acc_at: self.acc_at(slice),
                        src,
                        len: si.len,
                        first,
                        partial,
                        contributions: self.server.as_ref().expect("server").core.acc_contributions(),
                        pairs,
                    },
                    JobTrack::Accumulate { worker, slot, credit },
                );
            }
            ServerCommand::FoldPartial { slice, window, iter } => self.fold_partial_job(slice, window, iter),
            ServerCommand::Apply {
                chunk,
                iter,
                window,
                gradients,
            } => self.apply_job(chunk, iter, window, gradients),
            ServerCommand::Drop { worker, slot } | ServerCommand::Credit { worker, slot } => {
                debug_assert!(
                    book.cluster().worker_index(worker).is_some(),
                    "slots are lent to workers"
                );
                self.return_slot(worker, slot)?
            }
            ServerCommand::Broadcast { chunk, worker } => self.broadcast_after_apply(chunk, worker),
            ServerCommand::SumFactors { layer, iter, window } => self.sum_factors_job(layer, iter, window)?,
            ServerCommand::Notify { chunk, worker, version } => self.notify_after_apply(chunk, worker, version)?,
            ServerCommand::SendMomentum { chunk, iter } => self.momentum_to_workers(chunk, iter)?,
        }
        Ok(())
    }

    /// Where an accumulate of `slice` reads `worker`'s slot `slot`: this
    /// rank's own gradient for its own worker, else the landing slot, with
    /// the sparse pair count its write announced (taken: read once).
    fn accumulate_source(&mut self, worker: u32, slot: u32, slice: u32) -> (Loc, Option<u32>) {
        let si = self.book.slices()[slice as usize];
        debug_assert!(slot < self.sched.landing_slots(), "slot {slot}");
        let pairs = if worker == self.rank {
            None
        } else {
            self.landing_sparse.remove(&(worker, slot))
        };
        let src = if worker == self.rank {
            Loc {
                region: LocalRegion::Grads,
                offset: self.grad_off[si.layer as usize] + si.offset as u64 * 4,
            }
        } else {
            let wi = self.book.cluster().worker_index(worker).expect("checked by the core") as u64;
            Loc {
                region: LocalRegion::Landing,
                offset: (wi * u64::from(self.sched.landing_slots()) + u64::from(slot)) * self.slot_bytes,
            }
        };
        // Its landing checked the pair count against the slice's limit.
        debug_assert!(!pairs.is_some_and(|n| n as usize > crate::sparse::pair_limit(si.len)));
        (src, pairs)
    }

    /// Queues the job that adds a fold group's partial sum of `slice` into
    /// accumulator `window`.
    fn fold_partial_job(&mut self, slice: u32, window: u32, iter: u64) {
        let si = self.book.slices()[slice as usize];
        debug_assert_eq!(window, 0, "fold groups are deterministic BSP: one window");
        debug_assert!(self.sched.fold_group > 1);
        self.new_job_at(
            Queue::Server,
            (iter, si.layer),
            JobKind::FoldPartial {
                window,
                chunk: si.chunk,
                acc_at: self.acc_at(slice),
                len: si.len,
                contributions: self.server.as_ref().expect("server").core.acc_contributions(),
            },
            JobTrack::FoldPartial,
        );
    }

    /// Queues the apply of `chunk`'s sum in accumulator `window`, and marks
    /// it running (broadcasts and notifications of the chunk wait for it).
    fn apply_job(&mut self, chunk: u32, iter: u64, window: u32, gradients: u32) {
        let ch = self.book.chunks()[chunk as usize];
        // The mean and SGD divide by the gradients in the sum.
        debug_assert!(gradients > 0 && (window as usize) < self.windows(), "chunk {chunk}");
        let id = self.next_job;
        self.new_job_at(
            Queue::Server,
            (iter, ch.layer),
            JobKind::Apply {
                window,
                chunk,
                iter,
                shard_at: ch.shard_offset,
                len: ch.len,
                gradients,
                momentum: self.shard_momentum(chunk),
            },
            JobTrack::Apply { chunk },
        );
        let running = self.server.as_mut().expect("server").apply_running.insert(chunk, id);
        debug_assert!(running.is_none(), "two applies of chunk {chunk} at once");
    }

    /// Broadcasts `chunk` to `worker`, or defers it while an apply of the
    /// chunk runs (its values are not yet the new ones).
    fn broadcast_after_apply(&mut self, chunk: u32, worker: u32) {
        debug_assert!(
            self.book.cluster().worker_index(worker).is_some(),
            "broadcasts go to workers"
        );
        let s = self.server.as_mut().expect("server");
        if s.apply_running.contains_key(&chunk) {
            s.deferred.entry(chunk).or_default().push(worker);
        } else {
            self.broadcast(chunk, worker);
        }
    }

    /// Queues the job that sums every worker's factors of `layer` for
    /// `iter` (Adam) into accumulator `window`; the factors must be in.
    fn sum_factors_job(&mut self, layer: u32, iter: u64, window: u32) -> Result<()> {
        let me = self.rank;
        let factors = self
            .inbox
            .take(layer, iter)
            .ok_or_else(|| EngineError::protocol(me, ProtocolViolation::SumWithoutFactors { layer, iter }))?;
        let acc_at = self.book.chunks()[self.book.layer_chunks(layer).start as usize].shard_offset;
        debug_assert_eq!(factors.len(), self.book.p1(), "every worker's factors");
        debug_assert!((window as usize) < self.windows(), "window {window}");
        self.new_job_at(
            Queue::Server,
            (iter, layer),
            JobKind::SumFactors {
                layer,
                iter,
                window,
                acc_at,
                factors,
            },
            JobTrack::SumFactors,
        );
        Ok(())
    }

    /// Notifies `worker` of `chunk` at `version`, or defers it while an
    /// apply of the chunk runs.
    fn notify_after_apply(&mut self, chunk: u32, worker: u32, version: u64) -> Result<()> {
        debug_assert!(version > 0, "a notification names an applied version");
        let s = self.server.as_mut().expect("server");
        if s.apply_running.contains_key(&chunk) {
            s.deferred_notify.entry(chunk).or_default().push((worker, version));
            Ok(())
        } else {
            self.notify(chunk, worker, version)
        }
    }

    /// Where `slice` lies in this rank's shard (and its accumulators): its
    /// chunk's place there, plus its own place in the chunk.
    fn acc_at(&self, slice: u32) -> usize {
        let si = self.book.slices()[slice as usize];
        let ch = self.book.chunks()[si.chunk as usize];
        // The slice lies in its chunk, which lies in this shard.
        debug_assert!(si.offset >= ch.offset && si.offset + si.len <= ch.offset + ch.len);
        debug_assert_eq!(ch.server, self.rank, "slice {slice} is summed by its owner");
        ch.shard_offset + (si.offset - ch.offset)
    }

    /// Kvstore: tells `worker` that `chunk` is at `version` (once its apply ran).
    pub(super) fn notify(&mut self, chunk: u32, worker: u32, version: u64) -> Result<()> {
        debug_assert!(version > 0, "a notification names an applied version");
        debug_assert!(self
            .server
            .as_ref()
            .is_some_and(|s| !s.apply_running.contains_key(&chunk)));
        if worker == self.rank {
            let me = self.rank;
            self.worker
                .as_mut()
                .expect("colocated")
                .core
                .handle_notify(me, chunk, version)
        } else {
            self.send_ctrl(worker, &Msg::Notify { chunk, version });
            Ok(())
        }
    }

    /// A landing slot of `worker` is free again: its credit goes back (to
    /// this rank's own worker at once; to a peer with the next credit message).
    pub(super) fn return_slot(&mut self, worker: u32, slot: u32) -> Result<()> {
        let me = self.rank;
        debug_assert!(slot < self.sched.landing_slots(), "slot {slot} of rank {worker}");
        if worker == me {
            let s = self.server.as_mut().expect("server");
            let slice = s
                .local_slots
                .remove(&slot)
                .ok_or_else(|| EngineError::protocol(me, ProtocolViolation::LocalSlotNotTaken { slot }))?;
            let w = self.worker.as_mut().expect("colocated");
            w.core.handle_push_done(slice)?;
            w.core.handle_credit(me, slot)?;
        } else {
            self.landing_sparse.remove(&(worker, slot));
            self.server
                .as_mut()
                .expect("server")
                .credit_out
                .entry(worker)
                .or_default()
                .push(slot);
        }
        Ok(())
    }

    pub(super) fn broadcast(&mut self, chunk: u32, worker: u32) {
        // The shard is read only once the chunk's apply ran.
        debug_assert!(self
            .server
            .as_ref()
            .is_some_and(|s| !s.apply_running.contains_key(&chunk)));
        let book = self.book.clone();
        let ch = book.chunks()[chunk as usize];
        debug_assert_eq!(ch.server, self.rank, "chunk {chunk} is broadcast by its owner");
        let src = Loc {
            region: LocalRegion::Shard,
            offset: ch.shard_offset as u64 * 4,
        };
        let len = ch.len as u64 * 4;
        if worker == self.rank {
            let dst = Loc {
                region: LocalRegion::Params,
                offset: self.param_off[ch.layer as usize] + ch.offset as u64 * 4,
            };
            self.new_job(
                Queue::Worker,
                JobKind::Copy { src, dst, len },
                JobTrack::LocalBcast { chunk },
            );
        } else {
            // Relative to the worker's base; `drive` adds it when the write goes out.
            let dst = RemoteLoc {
                region: LocalRegion::Params,
                offset: (book.layer_offset(ch.layer) + ch.offset) as u64 * 4,
            };
            self.write(worker, src, dst, len, chunk, Track::Bcast { chunk, worker });
        }
    }

    /// Sends the credits this server owes its workers, at the end of a drive.
    /// While its jobs run or wait (each one's end frees more slots), a
    /// worker's credits are held until a quarter of its slots are owed: one
    /// message then returns several, and the worker keeps at least three
    /// quarters of its window. Once no server job is left, every owed credit
    /// goes, so a credit waits at most for the jobs already queued.
    pub(super) fn flush_credits(&mut self) {
        let busy = self.srv_out > 0 || !self.srv_queue.is_empty();
        let batch = (self.sched.slots / 4).max(1) as usize;
        let Some(s) = self.server.as_mut() else { return };
        if s.credit_out.is_empty() {
            return;
        }
        let pending = if busy {
            let due: Vec<u32> = s
                .credit_out
                .iter()
                .filter(|(_, slots)| slots.len() >= batch)
                .map(|(&w, _)| w)
                .collect();
            due.into_iter()
                .filter_map(|w| s.credit_out.remove(&w).map(|slots| (w, slots)))
                .collect()
        } else {
            std::mem::take(&mut s.credit_out)
        };
        for (w, slots) in pending {
            debug_assert!(w != self.rank && !slots.is_empty(), "credits for rank {w}: {slots:?}");
            for part in slots.chunks(wire::MAX_CREDITS) {
                self.send_ctrl(w, &Msg::Credit(part.to_vec()));
            }
        }
    }
}
