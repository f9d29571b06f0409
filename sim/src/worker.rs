//! The training loop of a worker rank: forward and backward through the
//! layer-time table, hand-ins (wait-free or after the pass), waits for
//! layers in flight, a crash at an iteration boundary, and the goodbye.

use tidewire_engine::node::{Input, LocalRegion};

use crate::config::SimError;
use crate::exec::{put_f32s, ridx};
use crate::rank::Phase;
use crate::values::factor_value;
use crate::world::{Ev, Sim};

impl Sim {
    /// Worker `r`'s compute timer fired, or something it waits for changed:
    /// it moves on through its iteration as far as it can.
    pub(crate) fn step(&mut self, r: u32) -> Result<(), SimError> {
        if self.dead(r) || self.ranks[r as usize].fatal.is_some() {
            return Ok(());
        }
        match self.ranks[r as usize].worker.as_ref().expect("worker").phase {
            Phase::Fwd(l) => self.forward(r, l),
            Phase::Bwd(l) => self.backward(r, l),
            Phase::Done => self.wind_down(r),
        }
    }

    /// The forward pass of layer `l`, once its parameters are in (the Node's
    /// sync and the node's learners' copy), or a wait for them.
    fn forward(&mut self, r: u32, l: u32) -> Result<(), SimError> {
        let now = self.now;
        let iters = self.cfg.iters;
        let nl = self.cfg.book.layers().len() as u32;
        let rank = &mut self.ranks[r as usize];
        let ready = rank.node.is_ready();
        let w = rank.worker.as_mut().expect("worker");
        let avail = rank.local_avail[l as usize];
        let node_wait = rank.node.is_in_flight(l) || !ready;
        if node_wait || avail > now {
            if w.waiting.is_none() {
                w.waiting = Some((l, now));
            }
            if !node_wait {
                // Only the node's learners are behind (a local hand-in
                // or fan-out): nothing else will wake it.
                self.at(avail, Ev::Wake(r));
            }
            return Ok(());
        }
        if let Some((_, since)) = w.waiting.take() {
            // Waiting for the initial parameters is not training time.
            if w.iter > 0 || l > 0 {
                w.wait_ns += now - since;
            }
        }
        if l == 0 && w.iter == 0 && self.start.is_none() {
            self.start = Some(now);
        }
        if l == 0 && self.cfg.faults.crash == Some((r, w.iter)) && w.iter < iters && self.crashed_at.is_none() {
            // It stops here: the crash takes it once its last iteration synced.
            self.at(now, Ev::Crash(r));
            return Ok(());
        }
        let span = self
            .cfg
            .faults
            .slow
            .iter()
            .filter(|(x, _, a, b)| *x == r && (*a..*b).contains(&w.iter))
            .map(|s| s.1)
            .product::<f64>();
        if iters == 0 {
            w.phase = Phase::Done;
            self.at(now, Ev::Step(r));
            return Ok(());
        }
        // The step after the last forward fires when the last layer's backward ends.
        let slow = w.slow * span;
        let mut dt = (self.cfg.layer_ns[l as usize].0 as f64 * slow) as u64;
        if l + 1 == nl {
            dt += (self.cfg.layer_ns[l as usize].1 as f64 * slow) as u64;
        }
        w.span = span;
        w.phase = if l + 1 < nl {
            Phase::Fwd(l + 1)
        } else {
            Phase::Bwd(nl - 1)
        };
        self.at(now + dt, Ev::Step(r));
        Ok(())
    }

    /// The backward pass of layer `l` is done: hand it in (WFBP) or defer it
    /// to the end of the pass; after layer 0, the iteration ends.
    fn backward(&mut self, r: u32, l: u32) -> Result<(), SimError> {
        let now = self.now;
        let iters = self.cfg.iters;
        // The backward of l is done: hand it in (WFBP) or defer it.
        if self.cfg.wait_free {
            self.hand_in(r, l)?;
        } else {
            self.ranks[r as usize].worker.as_mut().expect("worker").deferred.push(l);
        }
        let w = self.ranks[r as usize].worker.as_mut().expect("worker");
        if l > 0 {
            w.phase = Phase::Bwd(l - 1);
            let dt = (self.cfg.layer_ns[l as usize - 1].1 as f64 * w.slow * w.span) as u64;
            self.at(now + dt, Ev::Step(r));
        } else {
            let deferred = std::mem::take(&mut w.deferred);
            for d in deferred {
                self.hand_in(r, d)?;
            }
            let w = self.ranks[r as usize].worker.as_mut().expect("worker");
            w.iter += 1;
            w.phase = if w.iter == iters { Phase::Done } else { Phase::Fwd(0) };
            self.at(now, Ev::Step(r));
        }
        Ok(())
    }

    /// Every iteration is done: once the last layers synced and the learners'
    /// hand-ins reached the Node, the worker says goodbye.
    fn wind_down(&mut self, r: u32) -> Result<(), SimError> {
        let now = self.now;
        let nl = self.cfg.book.layers().len() as u32;
        let rank = &mut self.ranks[r as usize];
        let w = rank.worker.as_mut().expect("worker");
        if w.finished.is_none() && (0..nl).all(|l| !rank.node.is_in_flight(l)) {
            w.finished = Some(now.max(rank.local_busy));
        }
        if !w.shutdown_sent && rank.local_busy > now {
            // A local hand-in is still on its way to the Node.
            let at = rank.local_busy;
            self.at(at, Ev::Step(r));
            return Ok(());
        }
        if !w.shutdown_sent {
            w.shutdown_sent = true;
            self.feed(r, Input::Shutdown)?;
        }
        Ok(())
    }

    pub(crate) fn hand_in(&mut self, r: u32, l: u32) -> Result<(), SimError> {
        let (lo, hi) = self
            .ranks
            .iter()
            .filter_map(|x| x.worker.as_ref().map(|w| w.iter))
            .fold((u64::MAX, 0), |(lo, hi), i| (lo.min(i), hi.max(i)));
        self.report.max_lead = self.report.max_lead.max(hi - lo.min(hi));
        let book = self.cfg.book.clone();
        let iter = self.ranks[r as usize].node.completed(l);
        let factors = self.by_factors(l, iter);
        if self.cfg.values {
            let wi = book.cluster().worker_index(r).expect("worker");
            let spec = &book.layers()[l as usize];
            let rank = &mut self.ranks[r as usize];
            let (_, grad, f) = rank.node.layer_locs(l).expect("worker");
            if factors {
                let k = book.config().batch;
                let f = f.expect("FC layers have factors");
                let mut uv: Vec<f32> = (0..k * spec.m).map(|i| factor_value(wi, iter, 0, i)).collect();
                uv.extend((0..k * spec.n).map(|i| factor_value(wi, iter, 1, i)));
                let m = &mut rank.store.mem[ridx(LocalRegion::Factors)];
                put_f32s(&mut m[f.offset as usize..f.offset as usize + uv.len() * 4], &uv);
            } else {
                let g: Vec<f32> = (0..spec.params()).map(|i| self.grad(wi, iter, l, i)).collect();
                let rank = &mut self.ranks[r as usize];
                let m = &mut rank.store.mem[ridx(LocalRegion::Grads)];
                put_f32s(&mut m[grad.offset as usize..grad.offset as usize + g.len() * 4], &g);
            }
        }
        let lrn = self.cfg.local_learners as usize;
        if lrn > 1 {
            // The node's other learners' gradients (or factors) reach the
            // leader and are summed (stacked) before the one hand-in.
            let spec = &book.layers()[l as usize];
            let per = if factors {
                (book.config().batch / lrn) * (spec.m + spec.n)
            } else {
                spec.params()
            } as f64
                * 4.0;
            let d = ((lrn - 1) as f64 * per / self.cfg.local_bytes_per_s * 1e9) as u64;
            let now = self.now;
            let rank = &mut self.ranks[r as usize];
            let start = now.max(rank.local_busy);
            rank.local_busy = start + d;
            rank.local_ns[0] += d;
            // Until the hand-in, the layer's next forward cannot start: the
            // Node does not know yet that it is in flight.
            rank.local_avail[l as usize] = rank.local_avail[l as usize].max(start + d);
            self.at(start + d, Ev::Input(r, Input::HandIn { layer: l, factors }));
            return Ok(());
        }
        self.feed(r, Input::HandIn { layer: l, factors })
    }
}
