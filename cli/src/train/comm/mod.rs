//! `tidewire train --comm-every T --comm-mode accumulate|average`, with
//! Nexus's quality-guided adjustment (`--freq-max`): the training loop of a
//! worker that exchanges every T steps, the synthetic loss model that drives
//! the adjustment without a framework, and the single-process reference that
//! `--verify` compares with, bit for bit.
//!
//! - `accumulate`: each worker sums its synthetic gradients over the T steps
//!   in step order (the first written, the next added) and hands the sum in on
//!   the T-th; the servers apply `--op` to the sum over workers (rank order).
//! - `average`: each worker applies `--op` to its own gradient every step
//!   (local SGD, its own momentum), and on the T-th hands its parameters in;
//!   the servers average them (`mean`), and every worker continues from the
//!   average.
//!
//! FC layers are handed in as gradients (Uᵀ·V formed by the trainer) through
//! the parameter servers: a sum over steps, or parameters, has no sufficient
//! factors. The last iteration always exchanges (outside the controller's
//! schedule when it is not due), so every replica ends equal.
//!
//! The synthetic loss of worker w at step s under T is
//! `(0.2 + 1/(1 + s/25)) · (1 + max(0, T/T_ok - 1)) · (1 + ε)`, with ε a
//! deterministic noise in ±0.5%: quality holds up to `--synthetic-ok-t`
//! (T_ok) and degrades beyond it, so the controller should settle there.
//! The reference replays the same controller on the same figures.

use std::time::{Duration, Instant};

use tidewire::freq::Guide;
use tidewire::session::{LayerBuffers, Session};
use tidewire_engine::book::LayerKind;
use tidewire_engine::freq::{CommMode, Decision, Event};
use tidewire_engine::models::Model;
use tidewire_gpu::cpu::{self, ApplyOp};

use super::{digest, IterStat, NodeResult, Synth, TrainArgs};
use crate::error::Result;

mod args;

pub use args::{CommArgs, CommSummary};

/// The synthetic loss of worker `wi` at step `s` under T = `t` (see the module docs).
pub fn synthetic_loss(seed: u64, ok_t: u32, wi: usize, s: u64, t: u32) -> f64 {
    let base = 0.2 + 1.0 / (1.0 + s as f64 / 25.0);
    let penalty = (f64::from(t) / f64::from(ok_t) - 1.0).max(0.0);
    let h = super::mix(seed ^ 0x5eed ^ (wi as u64) << 40 ^ s);
    let eps = ((h >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.01;
    base * (1.0 + penalty) * (1.0 + eps)
}

fn describe(e: &Event) -> String {
    let what = match e.decision {
        Decision::Keep => "keep".to_string(),
        Decision::Propose { from, to } => format!("propose T {from} -> {to}"),
        Decision::Accept { t, next: Some(n) } => format!("accept T {t}, propose {n}"),
        Decision::Accept { t, next: None } => format!("accept T {t}"),
        Decision::Reject { t, back_to, learner } => {
            format!("worker {learner} rejects T {t}, back to {back_to}")
        }
        Decision::Revert { to } => format!("revert to T {to}"),
    };
    format!("step {} (exchange {}): {what}", e.step, e.exchange)
}

/// The schedule every worker follows: replays one guide per worker on the
/// synthetic figures, through the same one-hot rows and server mean as the run.
/// Returns, per iteration, whether it exchanges, and the summary.
pub fn schedule(args: &TrainArgs, p1: usize) -> Result<(Vec<bool>, CommSummary)> {
    let c = &args.comm;
    let cc = c.config(args.job.iters)?;
    let op = c.server_op(args.apply_op()?);
    let mut guides: Vec<Guide> = (0..p1)
        .map(|w| Guide::new(cc, op, w, p1))
        .collect::<tidewire::Result<_>>()?;
    let mut due = Vec::new();
    let mut sum = CommSummary::default();
    for it in 0..args.job.iters {
        let t = guides[0].t();
        sum.t_per_step.push(t);
        let d = guides[0].due();
        due.push(d || it + 1 == args.job.iters);
        if d && guides[0].adjusts() {
            let rows: Vec<Vec<f32>> = guides
                .iter_mut()
                .enumerate()
                .map(|(w, g)| {
                    g.report(synthetic_loss(args.seed, c.synthetic_ok_t, w, it, t));
                    let mut row = vec![0f32; p1];
                    g.write_figures(&mut row).map(|()| row)
                })
                .collect::<tidewire::Result<_>>()?;
            let synced = server_reduce(&rows, ApplyOp::Mean, p1);
            for g in &mut guides {
                g.exchanged(&synced)?;
            }
        } else {
            for (w, g) in guides.iter_mut().enumerate() {
                g.report(synthetic_loss(args.seed, c.synthetic_ok_t, w, it, t));
                if d {
                    g.exchanged_fixed()?;
                } else {
                    g.local_step()?;
                }
            }
        }
    }
    sum.steps = args.job.iters;
    sum.exchanges = due.iter().filter(|d| **d).count() as u64;
    sum.decisions = guides[0].controller().history().iter().map(describe).collect();
    Ok((due, sum))
}

/// What the servers compute from the workers' rows: the sum in worker-rank
/// order (the first copied, the others added), then `op` (no momentum).
fn server_reduce(rows: &[Vec<f32>], op: ApplyOp, p1: usize) -> Vec<f32> {
    let mut acc = rows[0].clone();
    for r in &rows[1..] {
        cpu::add_assign(&mut acc, r);
    }
    let mut out = vec![0f32; acc.len()];
    cpu::apply(op, p1, &acc, &mut out, &mut []);
    out
}

fn gradient(synth: &Synth, model: &Model, k: usize, wi: usize, it: u64, l: usize, out: &mut [f32]) {
    let spec = &model.layers[l];
    if spec.kind == LayerKind::Fc {
        let (mut u, mut v) = (vec![0f32; k * spec.m], vec![0f32; k * spec.n]);
        synth.factors(wi, it, l as u32, &mut u, &mut v);
        cpu::sf_rows(&u, &v, k, spec.m, spec.n, 0, out);
    } else {
        synth.grad(wi, it, l as u32, out);
    }
}

/// One worker's training loop under `--comm-every`/`--comm-mode`/`--freq-max`.
pub(crate) fn worker_loop(
    args: &TrainArgs,
    model: &Model,
    synth: &Synth,
    mut session: Session,
    progress: bool,
) -> Result<NodeResult> {
    let rank = session.rank();
    let book = session.book().clone();
    let p1 = book.p1();
    let wi = book.cluster().worker_index(rank).expect("worker");
    let c = &args.comm;
    let op = args.apply_op()?;
    let mut guide = Guide::new(c.config(args.job.iters)?, c.server_op(op), wi, p1)?;
    let mut steps = LocalSteps::new(args, model, synth, rank, wi, op);
    let (nm, nl) = (model.layers.len(), book.layers().len());
    let mut layers = session.take_layers()?;
    let mut sum = CommSummary::default();
    let mut stats = Vec::new();
    let mut pending: Option<bool> = None; // an exchange in flight: whether the controller scheduled it
    let mut out = std::io::stdout();
    for it in 0..args.job.iters {
        let start = Instant::now();
        let blocked = match pending.take() {
            Some(scheduled) => wait_exchange(&session, &mut layers, &mut guide, scheduled)?,
            None => Duration::ZERO,
        };
        // The exchange's values, or this thread's own local step, are the
        // forward pass's input: it starts once they are in.
        steps.gpu.input_at(Instant::now());
        for t in &steps.times {
            steps.gpu.run(t.0);
        }
        let t = guide.t();
        sum.t_per_step.push(t);
        let scheduled = guide.due();
        let due = scheduled || it + 1 == args.job.iters;
        sum.handed_in_bytes += steps.backward(&session, &mut layers, it, due)?;
        guide.report(synthetic_loss(args.seed, c.synthetic_ok_t, wi, it, t));
        if nl > nm && due {
            sum.handed_in_bytes += 4 * p1 as u64;
            hand_in_figures(&session, &mut layers, &guide, scheduled)?;
        }
        if due {
            pending = Some(scheduled);
            sum.exchanges += 1;
            steps.since = 0;
        } else {
            guide.local_step()?;
            steps.since += 1;
        }
        stats.push(IterStat {
            iter: it,
            seconds: start.elapsed().as_secs_f64(),
            blocked_s: blocked.as_secs_f64(),
            sync_span_s: 0.0,
            exposed_s: 0.0,
            forward_done_unix: 0.0,
            backward_done_unix: 0.0,
        });
        if progress {
            let _ = crate::train::pipe::ToLauncher::Progress(it + 1).send(&mut out);
        }
    }
    sum.steps = args.job.iters;
    sum.decisions = guide.controller().history().iter().map(describe).collect();
    finish(session, nm, stats, sum)
}

/// A worker's own steps between exchanges: its gradients summed over the
/// steps (accumulate), or its parameters stepped by `--op` with its own
/// momentum (average).
struct LocalSteps<'a> {
    model: &'a Model,
    synth: &'a Synth,
    mode: CommMode,
    op: ApplyOp,
    /// Batch per worker.
    k: usize,
    /// Worker index.
    wi: usize,
    /// Each layer's (forward, backward) compute.
    times: Vec<(Duration, Duration)>,
    /// Where that compute runs.
    gpu: super::synth::Stream,
    /// Per model layer, the momentum of an average's local steps.
    mom: Vec<Vec<f32>>,
    /// A step's gradient, before it is added or applied.
    scratch: Vec<f32>,
    /// Steps since the last exchange.
    since: u64,
}

impl<'a> LocalSteps<'a> {
    fn new(args: &TrainArgs, model: &'a Model, synth: &'a Synth, rank: u32, wi: usize, op: ApplyOp) -> Self {
        let k = args.job.batch.unwrap_or(model.batch);
        let slow = if args.slow_rank == Some(rank) {
            args.slow_factor
        } else {
            1.0
        };
        let mode = CommMode::parse(&args.comm.comm_mode).unwrap_or(CommMode::Accumulate);
        let mom = model
            .layers
            .iter()
            .map(|s| {
                if mode == CommMode::Average && op.needs_momentum() {
                    vec![0f32; s.params()]
                } else {
                    Vec::new()
                }
            })
            .collect();
        LocalSteps {
            model,
            synth,
            mode,
            op,
            k,
            wi,
            times: model.layer_times(k, args.job.time_scale * slow),
            gpu: super::synth::Stream::default(),
            mom,
            scratch: vec![0f32; model.layers.iter().map(|l| l.params()).max().unwrap_or(0)],
            since: 0,
        }
    }

    /// The backward pass of step `it` over the model's layers, each handed
    /// in when the exchange is `due`. Returns the bytes handed in.
    fn backward(&mut self, session: &Session, layers: &mut [Option<LayerBuffers>], it: u64, due: bool) -> Result<u64> {
        let mut bytes = 0;
        for l in (0..self.model.layers.len()).rev() {
            self.gpu.run(self.times[l].1);
            let buf = layers[l].as_mut().expect("held by the trainer");
            self.step(buf, l, it, due);
            if due {
                bytes += 4 * buf.grad().len() as u64;
                session.grad_ready(layers[l].take().expect("held"))?;
            }
        }
        Ok(bytes)
    }

    /// Step `it` of layer `l` into `buf`: the gradient written or added
    /// (accumulate), or applied to the parameters, which are then what is
    /// handed in when the exchange is `due` (average).
    fn step(&mut self, buf: &mut LayerBuffers, l: usize, it: u64, due: bool) {
        let (synth, model, k, wi) = (self.synth, self.model, self.k, self.wi);
        let n = buf.grad().len();
        match self.mode {
            CommMode::Accumulate if self.since == 0 => gradient(synth, model, k, wi, it, l, buf.grad_mut()),
            CommMode::Accumulate => {
                gradient(synth, model, k, wi, it, l, &mut self.scratch[..n]);
                cpu::add_assign(buf.grad_mut(), &self.scratch[..n]);
            }
            CommMode::Average => {
                gradient(synth, model, k, wi, it, l, &mut self.scratch[..n]);
                cpu::apply(self.op, 1, &self.scratch[..n], buf.params_mut(), &mut self.mom[l]);
                if due {
                    let w = buf.params().to_vec();
                    buf.grad_mut().copy_from_slice(&w);
                }
            }
        }
    }
}

/// Waits for every layer of the exchange in flight and tells the controller
/// (with the quality figures, the last layer, when it adjusts T). Returns
/// the time blocked.
fn wait_exchange(
    session: &Session,
    layers: &mut [Option<LayerBuffers>],
    guide: &mut Guide,
    scheduled: bool,
) -> Result<Duration> {
    let mut blocked = Duration::ZERO;
    for (l, slot) in layers.iter_mut().enumerate() {
        let t = Instant::now();
        *slot = Some(session.wait_layer(l as u32)?);
        blocked += t.elapsed();
    }
    if scheduled && guide.adjusts() {
        let q = layers[layers.len() - 1].as_ref().expect("held");
        guide.exchanged(q.params())?;
    } else if scheduled {
        guide.exchanged_fixed()?;
    }
    Ok(blocked)
}

/// Hands in the quality figures (the last layer, past the model's) with an
/// exchange: the controller's, or zeros for the final, unscheduled one.
fn hand_in_figures(
    session: &Session,
    layers: &mut [Option<LayerBuffers>],
    guide: &Guide,
    scheduled: bool,
) -> Result<()> {
    let mut q = layers[layers.len() - 1].take().expect("held");
    if scheduled {
        guide.write_figures(q.grad_mut())?;
    } else {
        q.grad_mut().fill(0.0); // the final, unscheduled exchange carries no figures
    }
    session.grad_ready(q)?;
    Ok(())
}

/// After the last iteration: waits for the last exchange and shuts down.
/// Reports the digests of the model's `nm` layers.
fn finish(mut session: Session, nm: usize, stats: Vec<IterStat>, sum: CommSummary) -> Result<NodeResult> {
    let all = session.wait_all()?;
    let digests = all[..nm].iter().map(|b| digest(b.params())).collect();
    let st = session.stats()?;
    let (kind, why) = session.transport();
    drop(all);
    session.shutdown()?;
    Ok(NodeResult {
        rank: session.rank(),
        worker: true,
        iters: stats,
        digests,
        stats: st,
        transport: format!("{kind}: {why}"),
        comm: Some(sum),
        local: None,
        setup_tx_bytes: 0,
        setup_rx_bytes: 0,
        checkpoint: None,
        removed_at: None,
        switches: Vec::new(),
        decisions: Vec::new(),
    })
}

/// The single-process reference of a run with a communication frequency:
/// every worker's steps, the servers' reduction and op, in the same order and
/// arithmetic as the run. Returns each model layer's digest.
pub fn reference(args: &TrainArgs, model: &Model, p1: usize) -> Result<Vec<String>> {
    let (due, _) = schedule(args, p1)?;
    let synth = Synth::new(args.seed);
    let op = args.apply_op()?;
    let mode = CommMode::parse(&args.comm.comm_mode).unwrap_or(CommMode::Accumulate);
    let k = args.job.batch.unwrap_or(model.batch);
    let mut out = Vec::new();
    for (l, spec) in model.layers.iter().enumerate() {
        let n = spec.params();
        let mut w = vec![0f32; n];
        synth.init(l as u32, &mut w);
        // The servers' momentum (accumulate), or each worker's (average).
        let mut server_mom = if op.needs_momentum() { vec![0f32; n] } else { Vec::new() };
        let mut local: Vec<Vec<f32>> = vec![w.clone(); p1];
        let mut local_mom: Vec<Vec<f32>> = vec![server_mom.clone(); p1];
        let mut contrib: Vec<Vec<f32>> = vec![vec![0f32; n]; p1];
        let mut g = vec![0f32; n];
        let mut since = 0;
        for (it, d) in due.iter().enumerate() {
            for wi in 0..p1 {
                match mode {
                    CommMode::Accumulate if since == 0 => {
                        gradient(&synth, model, k, wi, it as u64, l, &mut contrib[wi])
                    }
                    CommMode::Accumulate => {
                        gradient(&synth, model, k, wi, it as u64, l, &mut g);
                        cpu::add_assign(&mut contrib[wi], &g);
                    }
                    CommMode::Average => {
                        gradient(&synth, model, k, wi, it as u64, l, &mut g);
                        cpu::apply(op, 1, &g, &mut local[wi], &mut local_mom[wi]);
                    }
                }
            }
            if !*d {
                since += 1;
                continue;
            }
            since = 0;
            match mode {
                CommMode::Accumulate => {
                    let mut acc = contrib[0].clone();
                    for c in &contrib[1..] {
                        cpu::add_assign(&mut acc, c);
                    }
                    cpu::apply(op, p1, &acc, &mut w, &mut server_mom);
                }
                CommMode::Average => {
                    w = server_reduce(&local, ApplyOp::Mean, p1);
                    for x in &mut local {
                        x.copy_from_slice(&w);
                    }
                }
            }
        }
        out.push(digest(&w));
    }
    Ok(out)
}
