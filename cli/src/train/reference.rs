//! The single-process runs: one worker with no peers ([`run_single`]), and the
//! reference that `--verify` compares with ([`reference()`]).

use std::time::{Duration, Instant};

use tidewire_engine::book::{LayerKind, LayerSpec, Scheme};
use tidewire_engine::models::Model;
use tidewire_engine::Book;
use tidewire_gpu::cpu;

use tidewire::cluster::ClusterSpec;
use tidewire::session::Builder;

use super::args::TrainArgs;
use super::report::IterStat;
use super::synth::{digest, Stream, Synth};
use super::worker::{worker_loop, LoopOpts};
use crate::error::Result;

/// One worker with no peers, in this process: the trainer loop through the
/// engine (`engine`), or the same loop applying SGD itself right after each
/// layer's backward, as a framework without Tidewire would. FC gradients are
/// formed by the trainer in both cases, so the difference is the engine's cost.
/// Returns the per-iteration figures.
pub fn run_single(args: &TrainArgs, engine: bool) -> Result<Vec<IterStat>> {
    args.validate()?;
    let model = args.model()?;
    let synth = args.synth(&model);
    if engine {
        single_through_engine(args, &model, &synth)
    } else {
        single_without_engine(args, &model, &synth)
    }
}

/// The trainer loop through a one-rank session.
fn single_through_engine(args: &TrainArgs, model: &Model, synth: &Synth) -> Result<Vec<IterStat>> {
    let s2 = args.synth(model);
    let spec = ClusterSpec::new(0, 1, 0, true, "127.0.0.1:1".parse().expect("literal"))?;
    let session = Builder::new(model.layers.clone())
        .batch(args.batch(model))
        .chunk_bytes(args.book_config(model).chunk_bytes)
        .slice_params(args.book_config(model).slice_params)
        .policy(tidewire_engine::SchemePolicy::Ps)
        .sched(args.sched())
        .apply(args.apply_op()?)
        .job(1, tidewire_transport::JobSecret::new(b"single".to_vec()))
        .timeout(Duration::from_secs(args.timeout_s))
        .init_params(move |l, p| s2.init(l, p))
        .build(spec)?;
    let r = worker_loop(
        args,
        model,
        synth,
        session,
        LoopOpts {
            progress: false,
            fc_as_gradients: true,
            group: None,
        },
    )?;
    Ok(r.iters)
}

/// The same loop applying the op itself right after each layer's backward.
fn single_without_engine(args: &TrainArgs, model: &Model, synth: &Synth) -> Result<Vec<IterStat>> {
    let k = args.batch(model);
    let op = args.apply_op()?;
    let times = model.layer_times(k, args.job.time_scale);
    let mut params = initial_params(model, synth);
    let mut grads: Vec<Vec<f32>> = model.layers.iter().map(|s| vec![0f32; s.params()]).collect();
    let mut mom: Vec<Vec<f32>> = model
        .layers
        .iter()
        .map(|s| {
            if op.needs_momentum() {
                vec![0f32; s.params()]
            } else {
                Vec::new()
            }
        })
        .collect();
    let mut stats = Vec::new();
    let mut prev: Option<Instant> = None;
    let gpu = Stream::default();
    for it in 0..args.job.iters {
        let start = Instant::now();
        if let (Some(p), Some(last)) = (prev, stats.last_mut()) {
            let last: &mut IterStat = last;
            last.seconds = (start - p).as_secs_f64();
        }
        prev = Some(start);
        // The last iteration's updates, applied by this thread, are the
        // forward pass's input: it starts once they are done.
        gpu.input_at(start);
        for t in &times {
            gpu.run(t.0);
        }
        for l in (0..model.layers.len()).rev() {
            gpu.run(times[l].1);
            let spec = &model.layers[l];
            if spec.kind == LayerKind::Fc {
                let (mut u, mut v) = (vec![0f32; k * spec.m], vec![0f32; k * spec.n]);
                synth.factors(0, it, l as u32, &mut u, &mut v);
                cpu::sf_rows(&u, &v, k, spec.m, spec.n, 0, &mut grads[l]);
            } else {
                synth.grad(0, it, l as u32, &mut grads[l]);
            }
            cpu::apply(op, 1, &grads[l], &mut params[l], &mut mom[l]);
        }
        stats.push(IterStat {
            iter: it,
            seconds: 0.0,
            blocked_s: 0.0,
            sync_span_s: 0.0,
            exposed_s: 0.0,
            forward_done_unix: 0.0,
            backward_done_unix: 0.0,
        });
    }
    if let (Some(p), Some(last)) = (prev, stats.last_mut()) {
        last.seconds = p.elapsed().as_secs_f64();
    }
    Ok(stats)
}

/// Every layer's initial parameters.
fn initial_params(model: &Model, synth: &Synth) -> Vec<Vec<f32>> {
    model
        .layers
        .iter()
        .enumerate()
        .map(|(l, s)| {
            let mut p = vec![0f32; s.params()];
            synth.init(l as u32, &mut p);
            p
        })
        .collect()
}

/// The single-process reference: the same synthetic gradients, summed in
/// the engine's deterministic order, applied with the same op. Returns each
/// layer's digest.
///
/// The order: every node's learners in local-rank order into the node's sum
/// (the local aggregator, or a flat run's servers with `fold_group = L`), then
/// the node sums in node order. An FC layer synced by SFB is rebuilt from
/// every worker rank's factors in rank order: a flat run's per learner, a
/// local group's stacked (one Uᵀ·V over the node's L·K rows).
pub fn reference(args: &TrainArgs, book: &Book) -> Result<Vec<String>> {
    let model = args.model()?;
    let synth = args.synth(&model);
    let op = args.apply_op()?;
    let k = args.batch(&model);
    let lrn = args.job.local_learners.max(1);
    let nodes = args.workers;
    let mut out = Vec::new();
    let max = model.layers.iter().map(|l| l.params()).max().unwrap_or(0);
    let (mut acc, mut part, mut g) = (vec![0f32; max], vec![0f32; max], vec![0f32; max]);
    for (li, spec) in model.layers.iter().enumerate() {
        let n = spec.params();
        let mut w = vec![0f32; n];
        synth.init(li as u32, &mut w);
        let mut mom = if op.needs_momentum() { vec![0f32; n] } else { Vec::new() };
        let mut sum = LayerSum {
            synth: &synth,
            spec,
            li,
            k,
            lrn,
            nodes,
            u: vec![0f32; lrn * k * spec.m],
            v: vec![0f32; lrn * k * spec.n],
        };
        for it in 0..args.job.iters {
            let sfb = spec.kind == LayerKind::Fc && book.scheme(li as u32, it) == Scheme::Sfb;
            // Adam's server sums every worker rank's factors in rank order,
            // with no fold groups (a flat run's learners are worker ranks).
            let adam = spec.kind == LayerKind::Fc && book.scheme(li as u32, it) == Scheme::Adam;
            if (sfb || adam) && (args.job.flat || lrn == 1) {
                sum.in_rank_order(it, &mut acc[..n], &mut g[..n]);
            } else if sfb || adam {
                sum.stacked_per_node(it, &mut acc[..n], &mut g[..n]);
            } else {
                sum.per_node(it, &mut acc[..n], &mut part[..n], &mut g[..n]);
            }
            cpu::apply(op, nodes * lrn, &acc[..n], &mut w, &mut mom);
        }
        out.push(digest(&w));
    }
    Ok(out)
}

/// One layer's gradients of an iteration, summed over the learners in the
/// engine's order into `acc` (`g` and `part`: scratch of the layer's size).
struct LayerSum<'a> {
    synth: &'a Synth,
    spec: &'a LayerSpec,
    /// The layer's index.
    li: usize,
    /// Batch per learner.
    k: usize,
    /// Learners per node.
    lrn: usize,
    nodes: usize,
    /// Factors: a node's learners' U and V, stacked.
    u: Vec<f32>,
    v: Vec<f32>,
}

impl LayerSum<'_> {
    /// One learner's gradient (global learner index `gi`).
    fn grad_of(&mut self, gi: usize, it: u64, dst: &mut [f32]) {
        let (k, spec, li) = (self.k, self.spec, self.li);
        let (km, kn) = (k * spec.m, k * spec.n);
        if spec.kind == LayerKind::Fc {
            self.synth
                .factors(gi, it, li as u32, &mut self.u[..km], &mut self.v[..kn]);
            cpu::sf_rows(&self.u[..km], &self.v[..kn], k, spec.m, spec.n, 0, dst);
        } else {
            self.synth.grad(gi, it, li as u32, dst);
        }
    }

    /// Every learner's gradient in rank order (SFB or Adam with every
    /// learner a worker rank).
    fn in_rank_order(&mut self, it: u64, acc: &mut [f32], g: &mut [f32]) {
        for gi in 0..self.nodes * self.lrn {
            if gi == 0 {
                self.grad_of(gi, it, acc);
            } else {
                self.grad_of(gi, it, g);
                cpu::add_assign(acc, g);
            }
        }
    }

    /// A node's learners' factors, stacked (K·learners rows): one hand-in,
    /// summed per node in node order.
    fn stacked_per_node(&mut self, it: u64, acc: &mut [f32], g: &mut [f32]) {
        let (k, spec, lrn) = (self.k, self.spec, self.lrn);
        let (km, kn) = (k * spec.m, k * spec.n);
        for node in 0..self.nodes {
            for j in 0..lrn {
                let gi = node * lrn + j;
                self.synth.factors(
                    gi,
                    it,
                    self.li as u32,
                    &mut self.u[j * km..(j + 1) * km],
                    &mut self.v[j * kn..(j + 1) * kn],
                );
            }
            let dst = if node == 0 { &mut *acc } else { &mut *g };
            cpu::sf_rows(&self.u, &self.v, lrn * k, spec.m, spec.n, 0, dst);
            if node > 0 {
                cpu::add_assign(acc, g);
            }
        }
    }

    /// Each node's learners summed in local-rank order (the local aggregator,
    /// or a flat run's servers with `fold_group = L`), then the node sums in
    /// node order.
    fn per_node(&mut self, it: u64, acc: &mut [f32], part: &mut [f32], g: &mut [f32]) {
        let lrn = self.lrn;
        for node in 0..self.nodes {
            let dst = if node == 0 { &mut *acc } else { &mut *part };
            self.grad_of(node * lrn, it, dst);
            for j in 1..lrn {
                self.grad_of(node * lrn + j, it, g);
                cpu::add_assign(dst, g);
            }
            if node > 0 {
                cpu::add_assign(acc, part);
            }
        }
    }
}
