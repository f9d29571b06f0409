//! The runtime's part, as the simulator plays it: feeding a Node its inputs,
//! draining its outputs (transmits over the modelled transport with its
//! limits and injected back-pressure, jobs onto the executors, layer-ready
//! events to the worker loop), and a crashed worker's rejoin.

use std::time::Duration;

use tidewire_engine::config::{Consistency, Trigger};
use tidewire_engine::node::{
    HeldTransmits, Input, Job, Limits, Loc, LocalRegion, Output, Payload, Queue, RemoteLoc, SendSrc, Transmit, TxOp,
    CELL_BYTES,
};

use crate::config::{SimError, CONTROL_BYTES};
use crate::exec::{job_ns, ridx};
use crate::rank::{make_rank, Phase};
use crate::world::{brief_input, brief_output, Ev, Sim};

impl Sim {
    /// Feeds an input to a rank's Node and executes what comes out.
    pub(crate) fn feed(&mut self, r: u32, input: Input) -> Result<(), SimError> {
        let rank = &mut self.ranks[r as usize];
        if rank.dead || rank.fatal.is_some() {
            return Ok(());
        }
        if self.trace {
            eprintln!("{:>12} r{r} <- {}", self.now, brief_input(&input));
        }
        if let Input::Done { token } = &input {
            if let Some(p) = rank.tokens.remove(token) {
                rank.posted[p as usize] -= 1;
            }
        }
        let closed = match &input {
            Input::Closed { peer, .. } => Some(*peer),
            _ => None,
        };
        if let (Input::HandIn { layer, .. }, Some(a)) = (&input, self.adapt.as_mut()) {
            if self.cfg.book.cluster().workers().first() == Some(&r) {
                // Worker 0's policy times its windows from its hand-ins.
                a.started(rank.node.completed(*layer), Duration::from_nanos(self.now));
            }
        }
        let now = Duration::from_nanos(self.now);
        // Kept for the report of a refusal; a message's bytes go to the Node
        // as they are (moved: the receive path copies nothing, see `delivered`).
        let shown = match &input {
            Input::Message { peer, tag, data } => Input::Message {
                peer: *peer,
                tag: *tag,
                data: Payload::Opaque(data.len()),
            },
            other => other.clone(),
        };
        if let Err(e) = rank.node.handle(now, input) {
            return Err(self.violation(format!("rank {r} refused {shown:?}: {e}")));
        }
        // What the driver held for a closed peer never reached the transport:
        // it failed (the Node dropped those tokens with the connection).
        if let Some(peer) = closed {
            for t in self.ranks[r as usize].held.forget_peer(peer) {
                let reason = "the connection closed before the transport took it".to_string();
                self.feed(r, Input::Failed { token: t.token, reason })?;
            }
        }
        self.drain(r)
    }

    /// Takes every output of rank `r`'s Node and acts on it (a transmit the
    /// transport refuses is held, as the runtime holds it: [`HeldTransmits`]),
    /// then feeds back the sends that completed at once, and schedules the
    /// Node's timer.
    pub(crate) fn drain(&mut self, r: u32) -> Result<(), SimError> {
        while let Some(out) = self.ranks[r as usize].node.poll_output() {
            self.last_progress = self.now;
            if self.trace {
                eprintln!("{:>12} r{r} -> {}", self.now, brief_output(&out));
            }
            match out {
                Output::Transmit(t) => {
                    let Some(t) = self.ranks[r as usize].held.admit(t) else {
                        continue;
                    };
                    if let Err(t) = self.offer(r, t)? {
                        self.hold(r, t);
                    }
                }
                Output::Job(job) => self.on_job(r, job)?,
                Output::PeerKeys { peer, .. } => {
                    self.at(self.now, Ev::Input(r, Input::PeerRegionsKnown { peer }));
                }
                Output::LayerReady { layer, iter } => self.on_layer_ready(r, layer, iter)?,
                Output::Ready => self.on_ready(r)?,
                Output::DecisionDue { at } => self.on_decision_due(r, at)?,
                Output::Finished => self.on_finished(r),
                Output::Fatal(e) => {
                    if self.ranks[r as usize].fatal.is_none() {
                        self.ranks[r as usize].fatal = Some((self.now, e));
                        self.settle(r);
                    }
                }
            }
        }
        self.feed_sent_now(r)?;
        self.schedule_tick(r);
        Ok(())
    }

    /// Feeds rank `r` the completions of its sends that completed at once
    /// (only its own: a drain or a retry posts for its own rank).
    fn feed_sent_now(&mut self, r: u32) -> Result<(), SimError> {
        let done_now = std::mem::take(&mut self.sent_now);
        for (_, token) in done_now {
            self.feed(r, Input::Done { token })?;
        }
        Ok(())
    }

    /// Offers `t` to the modelled transport: `Ok(Err(t))` when it refuses it
    /// for now (`WouldBlock`, a fault drawn with `block_prob`).
    fn offer(&mut self, r: u32, t: Transmit) -> Result<Result<(), Transmit>, SimError> {
        if self.chance(self.cfg.faults.block_prob) {
            self.report.blocked += 1;
            return Ok(Err(t));
        }
        self.transmit(r, t)?;
        Ok(Ok(()))
    }

    /// Rank `r`'s driver holds `t`, which the transport refused, and tries
    /// again after [`HeldTransmits::RETRY_AFTER`].
    fn hold(&mut self, r: u32, t: Transmit) {
        self.ranks[r as usize].held.refused(t);
        self.schedule_retry(r);
    }

    /// Rank `r`'s driver retries its held transmits after
    /// [`HeldTransmits::RETRY_AFTER`], unless a retry is due already.
    fn schedule_retry(&mut self, r: u32) {
        if self.ranks[r as usize].retry_at.is_none() {
            let at = self.now + HeldTransmits::RETRY_AFTER.as_nanos() as u64;
            self.ranks[r as usize].retry_at = Some(at);
            self.at(at, Ev::Retry(r));
        }
    }

    /// Rank `r`'s driver offers its held transmits to the transport again.
    pub(crate) fn retry_held(&mut self, r: u32) -> Result<(), SimError> {
        let rank = &mut self.ranks[r as usize];
        rank.retry_at = None;
        if rank.dead || rank.fatal.is_some() || rank.held.is_empty() {
            return Ok(());
        }
        let mut held = std::mem::take(&mut rank.held);
        let mut error = None;
        held.retry(|t| {
            if error.is_some() {
                return Err(t);
            }
            match self.offer(r, t) {
                Ok(Ok(())) => Ok(()),
                Ok(Err(t)) => Err(t),
                Err(e) => {
                    error = Some(e);
                    Ok(())
                }
            }
        });
        self.ranks[r as usize].held = held;
        if let Some(e) = error {
            return Err(e);
        }
        if !self.ranks[r as usize].held.is_empty() {
            self.schedule_retry(r);
        }
        self.feed_sent_now(r)?;
        self.schedule_tick(r);
        Ok(())
    }

    /// The Node's timer (retries after back-pressure, the setup deadline), as
    /// the Node now asks for it.
    fn schedule_tick(&mut self, r: u32) {
        let rank = &mut self.ranks[r as usize];
        if let Some(t) = rank.node.poll_timeout() {
            let t = (t.as_nanos() as u64).max(self.now);
            if rank.tick_at != Some(t) {
                rank.tick_at = Some(t);
                self.at(t, Ev::Input(r, Input::Tick));
            }
        }
    }

    /// A job of rank `r` goes to the end of its executor's queue.
    fn on_job(&mut self, r: u32, job: Job) -> Result<(), SimError> {
        self.check_trigger(r, &job)?;
        let q = match job.queue {
            Queue::Server => 0,
            Queue::Worker => 1,
        };
        if self.net.has_host_cpu() {
            self.ranks[r as usize].cpu[q].waiting.push_back(job);
            self.cpu_start(r, q);
            return Ok(());
        }
        let dt = job_ns(&self.cfg, &job);
        let rank = &mut self.ranks[r as usize];
        let start = self.now.max(rank.busy[q]);
        rank.busy[q] = start + dt;
        self.at(start + dt, Ev::JobDone(r, job));
        Ok(())
    }

    /// Layer `layer` of rank `r` is synced for iteration `iter`: its values
    /// are checked (BSP), published to the node's learners, and the worker
    /// loop woken if it waits for it.
    fn on_layer_ready(&mut self, r: u32, layer: u32, iter: u64) -> Result<(), SimError> {
        if self.cfg.values && self.cfg.sched.consistency == Consistency::Bsp && self.cfg.sched.trigger == Trigger::All {
            let off = self.params_offset(r as usize, layer, true);
            let region = if self.ranks[r as usize].node.is_staged() {
                LocalRegion::View
            } else {
                LocalRegion::Params
            };
            self.check_values(r as usize, layer, iter, region, off)?;
        }
        let nl = self.cfg.book.layers().len() as u32;
        let fan = if self.cfg.local_learners > 1 {
            let bytes = self.cfg.book.layers()[layer as usize].params() as f64 * 4.0;
            (2.0 * bytes / self.cfg.local_bytes_per_s * 1e9) as u64
        } else {
            0
        };
        let now = self.now;
        let rank = &mut self.ranks[r as usize];
        let avail = if fan > 0 {
            let start = now.max(rank.local_busy);
            rank.local_busy = start + fan;
            rank.local_ns[1] += fan;
            start + fan
        } else {
            now
        };
        rank.local_avail[layer as usize] = rank.local_avail[layer as usize].max(avail);
        let synced = (0..nl).all(|l| !rank.node.is_in_flight(l));
        let w = rank.worker.as_mut().expect("worker");
        if w.phase == Phase::Done && w.finished.is_none() && synced {
            w.finished = Some(avail.max(rank.local_busy));
        }
        if matches!(w.waiting, Some((l, _)) if l == layer) {
            self.at(avail, Ev::Wake(r));
        }
        Ok(())
    }

    /// Rank `r`'s set-up is done: the seeding is checked, and a worker that
    /// came back goes on from the model's newest iteration.
    /// Worker 0's Node asks for the decision at `at` (adaptive books): the
    /// driver decides (kept as is, or at random with `decide_seed`), keeps
    /// it for the checks, and feeds it back.
    fn on_decision_due(&mut self, r: u32, at: u64) -> Result<(), SimError> {
        let n = self.plan.contested().len();
        let sfb = match self.cfg.decide_seed {
            Some(s) => {
                let bits = tidewire_engine::testkit::mix(s ^ at.wrapping_mul(0x9e37_79b9));
                if n >= 64 {
                    bits
                } else {
                    bits & ((1u64 << n) - 1)
                }
            }
            None => match self.adapt.as_mut() {
                Some(a) => {
                    let reached = tidewire_engine::adapt::Reached {
                        gemm_flop_per_s: Some(self.cfg.gemm_flops),
                        sum_bytes_per_s: Some(self.cfg.agg_bytes_per_s),
                    };
                    a.decide(&self.plan, at, std::time::Duration::from_nanos(self.now), reached)
                }
                None => self.plan.current_bits(at),
            },
        };
        let made = self
            .plan
            .decide(at, sfb)
            .map_err(|e| self.violation(format!("rank {r} asked for a decision at {at}: {e}")))?;
        self.report.decisions += 1;
        self.report.switches += made.len() as u64;
        // A random decision also comes late, half the time by up to 2 ms:
        // every rank (worker 0 too) then reaches the point undecided.
        let late = match self.cfg.decide_seed {
            Some(s) if tidewire_engine::testkit::mix(s ^ !at) % 2 == 0 => {
                tidewire_engine::testkit::mix(s.wrapping_add(at)) % 2_000_000
            }
            _ => 0,
        };
        self.at(self.now + late, Ev::Input(r, Input::Decide { at, sfb }));
        Ok(())
    }

    fn on_ready(&mut self, r: u32) -> Result<(), SimError> {
        // Under the other triggers, a worker ready late may start
        // from a version the others already made: no seeding check.
        if self.cfg.values && self.ranks[r as usize].worker.is_some() && self.cfg.sched.trigger == Trigger::All {
            self.check_seeding(r as usize)?;
        }
        if self.ranks[r as usize].worker.as_ref().is_some_and(|w| w.rejoined) {
            // A worker that came back goes on from the model's
            // newest iteration (each chunk counts its pushes from
            // where it was when the worker came back: never past
            // the job's last round).
            let book = self.cfg.book.clone();
            let newest = (0..book.chunks().len() as u32)
                .filter_map(|c| self.ranks[book.chunks()[c as usize].server as usize].node.applied(c))
                .max()
                .unwrap_or(0);
            let iters = self.cfg.iters;
            let w = self.ranks[r as usize].worker.as_mut().expect("a worker");
            w.iter = w.iter.max(newest).min(iters);
            if w.iter == iters {
                w.phase = Phase::Done;
            }
        }
        if self.ranks[r as usize].worker.is_some() {
            self.at(self.now, Ev::Wake(r));
        }
        Ok(())
    }

    /// Rank `r` said goodbye: it leaves, closing its connections gracefully.
    fn on_finished(&mut self, r: u32) {
        if self.ranks[r as usize].finished.is_none() {
            self.ranks[r as usize].finished = Some(self.now);
            self.settle(r);
            // The rank leaves: it closes its connections gracefully.
            for p in (0..self.ranks.len() as u32).filter(|&p| p != r) {
                if !self.dead(p) {
                    self.fins_in_net += 1;
                    self.net.send(self.now, r, p, 1, Ev::Fin { from: r, to: p }, None, 0);
                }
            }
        }
    }

    pub(crate) fn limits_of(&self, r: u32) -> Limits {
        self.cfg
            .rank_limits
            .as_ref()
            .and_then(|l| l.get(r as usize).copied())
            .unwrap_or(self.cfg.limits)
    }

    pub(crate) fn transmit(&mut self, r: u32, t: Transmit) -> Result<(), SimError> {
        let peer = t.peer;
        let (mine, theirs) = (self.limits_of(r), self.limits_of(peer));
        // The sender's bound on requests in flight; messages and writes must fit both ends.
        let limits = Limits {
            max_outstanding: mine.max_outstanding,
            max_message_bytes: mine.max_message_bytes.min(theirs.max_message_bytes),
            max_write_bytes: mine.max_write_bytes.min(theirs.max_write_bytes),
        };
        {
            let rank = &mut self.ranks[r as usize];
            rank.posted[peer as usize] += 1;
            rank.tokens.insert(t.token, peer);
            if rank.posted[peer as usize] > limits.max_outstanding {
                let n = rank.posted[peer as usize];
                return Err(self.violation(format!(
                    "rank {r} has {n} transmits outstanding to rank {peer} (the transport allows {})",
                    limits.max_outstanding
                )));
            }
        }
        if peer == r || peer as usize >= self.ranks.len() {
            return Err(self.violation(format!("rank {r} transmits to rank {peer}")));
        }
        if self.dead(r) || self.dead(peer) {
            return Ok(());
        }
        let (post_at, extra) = self.post_time(r, peer);
        match t.op {
            TxOp::Write { src, dst, len, imm } => {
                self.send_write(r, (peer, t.token), (src, dst, len, imm), &limits, (post_at, extra))
            }
            TxOp::Send { tag, src } => self.send_message(r, (peer, t.token), tag, src, &limits, (post_at, extra)),
        }
    }

    /// When a transmit of rank `r` to `peer` posted now leaves, and the random
    /// extra delay it meets: after the runtime's per-message cost
    /// ([`SimConfig::msg_ns`], serialized per rank), and after a partition
    /// between them heals.
    ///
    /// [`SimConfig::msg_ns`]: crate::SimConfig::msg_ns
    fn post_time(&mut self, r: u32, peer: u32) -> (u64, u64) {
        let now = self.now;
        let mut extra = 0;
        if self.chance(self.cfg.faults.delay_prob) && self.cfg.faults.delay_max_ns > 0 {
            extra = self.rand() % self.cfg.faults.delay_max_ns;
        }
        let mut post_at = now;
        if self.cfg.msg_ns > 0 {
            let rank = &mut self.ranks[r as usize];
            rank.post_busy = rank.post_busy.max(now) + self.cfg.msg_ns;
            post_at = rank.post_busy;
        }
        if let Some((side, a, b)) = &self.cfg.faults.partition {
            if now >= *a && now < *b && side.contains(&r) != side.contains(&peer) {
                // Never before the rank's earlier posts: one connection's
                // transmits leave in the order they were posted (a post held
                // by the runtime's per-message cost past `b` stays behind).
                post_at = post_at.max(*b);
            }
        }
        (post_at, extra)
    }

    /// A one-sided write on the network, within the transport's write cap.
    fn send_write(
        &mut self,
        r: u32,
        (peer, token): (u32, u64),
        (src, dst, len, imm): (Loc, RemoteLoc, u64, Option<u32>),
        limits: &Limits,
        (post_at, extra): (u64, u64),
    ) -> Result<(), SimError> {
        if len as usize > limits.max_write_bytes || len == 0 {
            return Err(self.violation(format!(
                "rank {r} wrote {len} bytes (the transport allows {})",
                limits.max_write_bytes
            )));
        }
        let ev = Ev::WriteArrive {
            from: r,
            to: peer,
            token,
            src,
            dst: Loc {
                region: dst.region,
                offset: dst.offset,
            },
            len,
            imm,
        };
        self.net.send(post_at, r, peer, len as usize, ev, None, extra);
        Ok(())
    }

    /// A message on the network (or, small on an idle connection, beside the
    /// bulk data at the cost of latency only), within the message cap.
    fn send_message(
        &mut self,
        r: u32,
        (peer, token): (u32, u64),
        tag: u32,
        src: SendSrc,
        limits: &Limits,
        (post_at, extra): (u64, u64),
    ) -> Result<(), SimError> {
        let len = src.len();
        if len as usize > limits.max_message_bytes {
            return Err(self.violation(format!(
                "rank {r} sent a message of {len} bytes (the transport allows {})",
                limits.max_message_bytes
            )));
        }
        let data = match src {
            SendSrc::Inline { bytes, .. } => {
                if bytes.len() > CELL_BYTES {
                    return Err(self.violation(format!("an inline message of {} bytes", bytes.len())));
                }
                Payload::Bytes(bytes)
            }
            SendSrc::Region { at, len } => {
                if self.cfg.values {
                    let m = &self.ranks[r as usize].store.mem[ridx(at.region)];
                    Payload::Bytes(m[at.offset as usize..(at.offset + len) as usize].to_vec())
                } else {
                    Payload::Opaque(len as usize)
                }
            }
        };
        let arrive = Ev::MsgArrive {
            from: r,
            to: peer,
            tag,
            data,
        };
        let sent = Ev::Sent { from: r, token };
        let conn = r as usize * self.ranks.len() + peer as usize;
        let in_net = self.msgs_in_net[conn];
        // Control messages interleave with bulk data at packet
        // granularity, so they pay latency only, unless a message is
        // ahead of them on the connection.
        if len as usize <= CONTROL_BYTES && in_net == 0 {
            if post_at == self.now {
                // It has left already: complete it after this drain, without an event.
                self.sent_now.push((r, token));
            } else {
                self.at(post_at, sent);
            }
            self.arrival(post_at + self.cfg.latency_ns, arrive, false);
        } else {
            self.msgs_in_net[conn] += 1;
            self.net.send(post_at, r, peer, len as usize, arrive, Some(sent), extra);
        }
        Ok(())
    }

    /// The crashed worker `r` comes back: a new process with a fresh Node
    /// that rejoins, at the iteration it crashed in.
    pub(crate) fn rejoin(&mut self, r: u32) -> Result<(), SimError> {
        let role = self.cfg.book.cluster().role(r).expect("in the cluster");
        let running = self
            .ranks
            .iter()
            .all(|x| x.finished.is_none() && x.worker.as_ref().map_or(true, |w| !w.shutdown_sent || x.dead));
        if self.cfg.sched.trigger == Trigger::All || role.is_server() || !running || !self.dead(r) {
            return Ok(());
        }
        let iter = self.crashed_at.expect("it crashed");
        self.retired_pushes += self.ranks[r as usize].node.stats().pushes;
        // The old process's executors stop; the new one's generations go on
        // from theirs, so that no end scheduled for the old matches the new.
        let gens = self.cpu_kill(r);
        let mut rank = make_rank(&self.cfg, r)?;
        for (exec, gen) in rank.cpu.iter_mut().zip(gens) {
            exec.gen = gen;
        }
        let (seed, now) = (self.cfg.seed, self.now);
        rank.node.rejoin().map_err(|error| SimError::Rank {
            seed,
            rank: r,
            at_ns: now,
            error,
        })?;
        let w = rank.worker.as_mut().expect("a worker");
        w.iter = iter;
        w.rejoined = true;
        self.ranks[r as usize] = rank;
        self.settled -= 1;
        // What the others posted to the old process never completes: their
        // Nodes dropped it with the connection.
        for x in &mut self.ranks {
            x.posted[r as usize] = 0;
            x.tokens.retain(|_, p| *p != r);
        }
        self.report.rejoined += 1;
        for p in (0..self.ranks.len() as u32).filter(|&p| p != r) {
            if !self.dead(p) {
                self.at(self.now, Ev::Input(p, Input::Connected { peer: r }));
                self.at(self.now, Ev::Input(r, Input::Connected { peer: p }));
            }
        }
        self.at(self.now, Ev::Step(r));
        self.at(self.now, Ev::Input(r, Input::Tick));
        Ok(())
    }
}
