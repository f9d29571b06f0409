//! The checker: the invariants a run must keep, from what the simulator saw
//! rather than the Nodes' own counters: exact values after every BSP layer
//! and at the end, the seeding, applies once per iteration and in order, the
//! aggregation trigger's rules, and every credit back at the end.

use tidewire_engine::book::LayerKind;
use tidewire_engine::config::{ApplyOp, Consistency, Trigger};
use tidewire_engine::node::{Job, JobKind, Loc, LocalRegion};

use crate::config::SimError;
use crate::exec::{f32s, ridx};
use crate::oracle::close;
use crate::values::{factor_value, grad_value, init_value, sparse_grad_value};
use crate::world::Sim;

impl Sim {
    /// After a clean goodbye: every chunk applied once per iteration, and with
    /// values every worker holds the last iteration's sum (BSP and SSP).
    pub(crate) fn check_end(&mut self) -> Result<(), SimError> {
        let book = self.cfg.book.clone();
        let iters = self.cfg.iters;
        let trigger = self.cfg.sched.trigger;
        // Every push was either accumulated or dropped, once.
        let (mut pushes, mut accumulated, mut dropped) = (self.retired_pushes, 0, 0);
        for r in &self.ranks {
            let s = r.node.stats();
            pushes += s.pushes;
            accumulated += s.accumulated;
            dropped += s.dropped;
        }
        if pushes != accumulated + dropped || accumulated != self.accumulates {
            return Err(self.violation(format!(
                "{pushes} pushes, {accumulated} accumulated ({} accumulate jobs seen), {dropped} dropped",
                self.accumulates
            )));
        }
        if matches!(trigger, Trigger::All | Trigger::Async) && dropped != 0 {
            return Err(self.violation(format!(
                "{dropped} contributions dropped under the {} trigger",
                trigger.name()
            )));
        }
        // Every live worker holds all its landing-slot credits again.
        let all = self.cfg.sched.slots as usize * book.p2();
        for (i, r) in self.ranks.iter().enumerate() {
            if let (false, Some(n)) = (r.dead, r.node.free_credits()) {
                if n != all {
                    return Err(self.violation(format!(
                        "rank {i} holds {n} landing-slot credits at the end, of {all} (a credit was not returned)"
                    )));
                }
            }
        }
        for (c, ch) in book.chunks().iter().enumerate() {
            // The rounds the servers held the layer in (all of them, but for SFB and its switches).
            let rounds = self.plan.server_rounds(ch.layer, iters);
            if rounds == 0 {
                continue;
            }
            let got = self.ranks[ch.server as usize].node.applied(c as u32);
            let ok = match (trigger, got) {
                (Trigger::Async, Some(n)) => n >= iters && n <= iters * book.p1() as u64,
                _ => got == Some(rounds),
            };
            if !ok {
                return Err(self.violation(format!(
                    "chunk {c} was applied {got:?} times over {iters} iterations, {rounds} of them through the servers (lost or doubled contributions)"
                )));
            }
        }
        if !self.cfg.values || iters == 0 || trigger != Trigger::All {
            return Ok(());
        }
        for r in 0..self.ranks.len() {
            // A rank that died after its goodbye stopped receiving: nothing to check there.
            if self.ranks[r].worker.is_none() || self.ranks[r].dead {
                continue;
            }
            for l in 0..book.layers().len() as u32 {
                let off = self.params_offset(r, l, false);
                self.check_values(r, l, iters - 1, LocalRegion::Params, off)?;
            }
        }
        Ok(())
    }

    /// Byte offset of layer `l` in rank `r`'s Params region (or its caller view).
    pub(crate) fn params_offset(&self, r: usize, l: u32, view: bool) -> u64 {
        let node = &self.ranks[r].node;
        if view || !node.is_staged() {
            node.layer_locs(l).expect("worker").0.offset
        } else {
            self.cfg.book.layer_offset(l) as u64 * 4
        }
    }

    pub(crate) fn expected(&self, l: u32, iter: u64, i: usize) -> f64 {
        let book = &self.cfg.book;
        let spec = &book.layers()[l as usize];
        let p1 = book.p1();
        if self.by_factors(l, iter) {
            let k = book.config().batch;
            let (row, col) = (i / spec.n, i % spec.n);
            (0..p1)
                .map(|wi| {
                    (0..k)
                        .map(|kk| {
                            factor_value(wi, iter, 0, kk * spec.m + row) as f64
                                * factor_value(wi, iter, 1, kk * spec.n + col) as f64
                        })
                        .sum::<f64>()
                })
                .sum()
        } else {
            (0..p1).map(|wi| self.grad(wi, iter, l, i) as f64).sum()
        }
    }

    /// Fills the oracle of layer `l` through iteration `iter`: from the
    /// initial values, each iteration's exact sum ([`Sim::expected`]) applied
    /// by the op's formula in f64, element by element. It shares no code with
    /// the kernels the run executes ([`tidewire_gpu::cpu::apply`]).
    fn oracle_through(&mut self, l: u32, iter: u64) {
        let n = self.cfg.book.layers()[l as usize].params();
        // The mean and SGD divide by every gradient in the sum (BSP, the all trigger).
        let p = (self.cfg.book.p1() * self.cfg.sched.learners as usize) as f64;
        let op = self.cfg.apply;
        loop {
            let done = self.oracle.states.get(&l).map_or(0, Vec::len) as u64;
            if done > iter {
                return;
            }
            let (mut w, mut v) = match self.oracle.states.get(&l).and_then(|s| s.last()) {
                Some((w, v)) => (w.clone(), v.clone()),
                None => ((0..n).map(|i| f64::from(init_value(l, i))).collect(), vec![0.0; n]),
            };
            for i in 0..n {
                let g = self.expected(l, done, i) / p;
                match op {
                    ApplyOp::Sum => w[i] = g * p,
                    ApplyOp::Mean => w[i] = g,
                    ApplyOp::Sgd {
                        lr,
                        momentum,
                        weight_decay,
                    } => {
                        let step = f64::from(lr) * (g + f64::from(weight_decay) * w[i]);
                        v[i] = if momentum == 0.0 {
                            step
                        } else {
                            f64::from(momentum) * v[i] + step
                        };
                        w[i] -= v[i];
                    }
                }
            }
            self.oracle.states.entry(l).or_default().push((w, v));
        }
    }

    /// Worker `wi`'s gradient element `i` of layer `l` in `iter`.
    pub(crate) fn grad(&self, wi: usize, iter: u64, l: u32, i: usize) -> f32 {
        if self.cfg.book.layers()[l as usize].sparse {
            sparse_grad_value(wi, iter, l, i, self.cfg.sparse_density)
        } else {
            grad_value(wi, iter, l, i)
        }
    }

    /// Whether layer `l` is handed in by its factors in `iter`.
    pub(crate) fn by_factors(&self, l: u32, iter: u64) -> bool {
        let book = &self.cfg.book;
        // Under adaptive schemes a contested layer may be undecided at its
        // hand-in: it always comes as factors.
        book.layers()[l as usize].kind == LayerKind::Fc
            && (self.cfg.fc_factors || self.plan.contested().contains(&l) || self.plan.scheme(l, iter).takes_factors())
    }

    pub(crate) fn check_values(
        &mut self,
        r: usize,
        l: u32,
        iter: u64,
        region: LocalRegion,
        off: u64,
    ) -> Result<(), SimError> {
        let n = self.cfg.book.layers()[l as usize].params();
        let m = &self.ranks[r].store.mem[ridx(region)];
        let got = f32s(&m[off as usize..off as usize + n * 4]);
        if self.cfg.apply == ApplyOp::Sum {
            // Sums of small integers are exact in f32: every bit is checked.
            for (i, g) in got.iter().enumerate() {
                let want = self.expected(l, iter, i);
                if f64::from(*g) != want {
                    return Err(self.violation(format!(
                        "rank {r} layer {l} element {i} after iteration {iter}: {g} != {want} (lost or doubled contribution)"
                    )));
                }
            }
        } else {
            self.oracle_through(l, iter);
            let want = &self.oracle.states[&l][iter as usize].0;
            if let Some(i) = (0..n).find(|&i| !close(got[i], want[i])) {
                let (g, w) = (got[i], want[i]);
                return Err(self.violation(format!(
                    "rank {r} layer {l} element {i} after iteration {iter}: {g} where the {:?} oracle (f64) has {w} (a lost or doubled contribution, or the apply's arithmetic)",
                    self.cfg.apply
                )));
            }
        }
        self.report.checks += 1;
        Ok(())
    }

    /// After setup, every worker's view holds rank 0's initial values.
    pub(crate) fn check_seeding(&mut self, r: usize) -> Result<(), SimError> {
        let book = self.cfg.book.clone();
        for (l, spec) in book.layers().iter().enumerate() {
            let off = self.params_offset(r, l as u32, true) as usize;
            let region = if self.ranks[r].node.is_staged() {
                LocalRegion::View
            } else {
                LocalRegion::Params
            };
            let got = f32s(&self.ranks[r].store.mem[ridx(region)][off..off + spec.params() * 4]);
            if let Some(i) = (0..spec.params()).find(|&i| got[i] != init_value(l as u32, i)) {
                return Err(self.violation(format!(
                    "rank {r} layer {l} element {i} after seeding: {} != {}",
                    got[i],
                    init_value(l as u32, i)
                )));
            }
        }
        self.report.checks += 1;
        Ok(())
    }

    /// The aggregation trigger's semantics, checked on every job a server
    /// emits, from what the simulator saw (not the server's own counters):
    /// applies of a chunk come once per iteration, in order; no worker's
    /// contribution is half in; the apply divides by the gradients in it;
    /// `All` takes every worker, `Quorum(k)` at least k, `Async` at least
    /// one, and `Timeout(d)` every live worker or else no earlier than `d`
    /// after the round's first contribution.
    pub(crate) fn check_trigger(&mut self, r: u32, job: &Job) -> Result<(), SimError> {
        match &job.kind {
            JobKind::Accumulate { chunk, src, .. } => self.round_accumulate(r, *chunk, *src),
            JobKind::SumFactors { layer, factors, .. } => self.round_sum_factors(r, *layer, factors.len())?,
            JobKind::Apply {
                chunk, iter, gradients, ..
            } => self.round_apply(r, *chunk, *iter, *gradients)?,
            _ => {}
        }
        Ok(())
    }

    /// A slice of one worker's contribution to `chunk` enters the round.
    fn round_accumulate(&mut self, r: u32, chunk: u32, src: Loc) {
        let book = self.cfg.book.clone();
        let p1 = book.p1();
        self.accumulates += 1;
        let wi = if src.region == LocalRegion::Landing {
            let slot_bytes = book.max_slice_len() as u64 * 4;
            (src.offset / (u64::from(self.cfg.sched.landing_slots()) * slot_bytes)) as usize
        } else {
            book.cluster()
                .worker_index(r)
                .expect("a local push comes from this rank's worker")
        };
        let now = self.now;
        let e = self.ranks[r as usize]
            .round
            .entry(chunk)
            .or_insert_with(|| (vec![0; p1], now));
        if e.0.iter().all(|&c| c == 0) {
            e.1 = now;
        }
        e.0[wi] += 1;
        let by = &mut self.report.accumulated_by_worker;
        by.resize(p1, 0);
        by[wi] += 1;
    }

    /// Adam: every worker's whole contribution to each of `layer`'s chunks at
    /// once (one factor block per worker, `blocks` of them).
    fn round_sum_factors(&mut self, r: u32, layer: u32, blocks: usize) -> Result<(), SimError> {
        let book = self.cfg.book.clone();
        let p1 = book.p1();
        // Adam: every worker's whole contribution to each of the
        // layer's chunks at once (one factor block per worker).
        if blocks != p1 {
            return Err(self.violation(format!(
                "layer {layer}: a sum of {} factor blocks, of {p1} workers",
                blocks
            )));
        }
        let now = self.now;
        for c in book.layer_chunks(layer) {
            let n = book.chunk_slices(c).len() as u32;
            let e = self.ranks[r as usize]
                .round
                .entry(c)
                .or_insert_with(|| (vec![0; p1], now));
            for x in e.0.iter_mut() {
                *x += n;
            }
        }
        Ok(())
    }

    /// `chunk` is applied for `iter`, dividing by `gradients`: in order, with
    /// whole contributions, and as many as the trigger requires.
    fn round_apply(&mut self, r: u32, chunk: u32, iter: u64, gradients: u32) -> Result<(), SimError> {
        let book = self.cfg.book.clone();
        let p1 = book.p1();
        self.report.updates_ns = self.now.saturating_sub(self.start.unwrap_or(0));
        let seen = self.ranks[r as usize].applies_seen.entry(chunk).or_insert(0);
        // Round `seen`'s iteration: switches leave the layer's SFB iterations out.
        let layer = book.chunks()[chunk as usize].layer;
        let want = self.plan.round_iter(layer, *seen);
        if Some(iter) != want || (self.cfg.sched.trigger != Trigger::All && iter != *seen) {
            let s = *seen;
            return Err(self.violation(format!(
                "chunk {chunk} applied for iteration {iter} after {s} applies, where round {s} is iteration {want:?} (applied twice or skipped)"
            )));
        }
        *seen += 1;
        let (counts, t0) = self.ranks[r as usize]
            .round
            .remove(&chunk)
            .unwrap_or((vec![0; p1], self.now));
        if self.cfg.sched.consistency != Consistency::Bsp {
            return Ok(());
        }
        let n = book.chunk_slices(chunk).len() as u32;
        if let Some(wi) = counts.iter().position(|&c| c % n != 0) {
            return Err(self.violation(format!(
                "chunk {chunk} iteration {iter} applied with {} of the {n} slices of worker {wi}'s contribution",
                counts[wi]
            )));
        }
        let contributions: u32 = counts.iter().sum::<u32>() / n;
        if gradients != contributions * self.cfg.sched.learners {
            return Err(self.violation(format!(
                "chunk {chunk} iteration {iter}: the apply divides by {gradients} gradients, the sum holds {contributions} contributions × {} learners",
                self.cfg.sched.learners
            )));
        }
        let workers = book.cluster().workers();
        let complete = counts.iter().filter(|&&c| c >= n).count();
        // A worker that came back counts from when it is ready (the
        // servers count it a little earlier, when it connected: a
        // weaker check in between, never a false alarm).
        let live_w = |w: u32| {
            let x = &self.ranks[w as usize];
            !x.dead && (!x.worker.as_ref().is_some_and(|l| l.rejoined) || x.node.is_ready())
        };
        let live = workers.iter().filter(|&&w| live_w(w)).count();
        let live_in = (0..p1).filter(|&i| counts[i] >= n && live_w(workers[i])).count();
        let ok = match self.cfg.sched.trigger {
            Trigger::All => counts.iter().all(|&c| c == n),
            Trigger::Quorum(k) => complete >= k as usize,
            Trigger::Async => complete >= 1,
            Trigger::Timeout(d) => complete >= 1 && (live_in >= live || self.now >= t0 + d.as_nanos() as u64),
        };
        if !ok {
            return Err(self.violation(format!(
                "chunk {chunk} iteration {iter} applied with contributions {counts:?} (of {n} slices each), {} ns after the round's first, under the {} trigger",
                self.now - t0,
                self.cfg.sched.trigger.name()
            )));
        }
        // Counted as value checks where no value is checked (the
        // other triggers); under `all` the values are, as before.
        if self.cfg.sched.trigger != Trigger::All {
            self.report.checks += 1;
        }
        Ok(())
    }
}
