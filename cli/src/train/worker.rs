//! One rank of `tidewire train` ([`run_node`]): the worker's training loop,
//! the local learners, and a server-only rank.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tidewire_engine::book::{Book, LayerKind};
use tidewire_engine::models::Model;
use tidewire_gpu::cpu;

use tidewire::cluster::ClusterSpec;
use tidewire::session::{Builder, LayerBuffers, Session, SessionStats};

use super::args::TrainArgs;
use super::comm;
use super::pipe::ToLauncher;
use super::report::{IterStat, NodeResult};
use super::synth::{digest, Stream, Synth};
use crate::error::{Error, Result};
use crate::resilience::{self, TrainerState};

/// A replacement worker's iterations (`TIDEWIRE_REPLACEMENT_ITERS`, set by
/// the launcher with --replace-stragglers): it runs the last this many.
fn replacement_iters() -> Option<u64> {
    std::env::var("TIDEWIRE_REPLACEMENT_ITERS").ok()?.trim().parse().ok()
}

/// Set when the launcher removes this worker (`ToRank::Leave` on its stdin, with
/// --remove-stragglers); the training loop leaves at the next iteration boundary.
fn leave_signal(args: &TrainArgs) -> Arc<std::sync::atomic::AtomicBool> {
    if args.remove_stragglers.is_some() || resilience::held() {
        super::pipe::launcher_line().leave.clone()
    } else {
        Arc::new(std::sync::atomic::AtomicBool::new(false))
    }
}

/// Runs one rank of `tidewire train` with the cluster from the environment.
/// Progress and the result go to the launcher on stdout ([`super::pipe::ToLauncher`]).
pub fn run_node(args: &TrainArgs) -> Result<NodeResult> {
    args.validate()?;
    let model = args.model()?;
    if let Some(local) = LocalEnv::from_env()? {
        if local.index > 0 {
            return run_learner(args, &model, &local);
        }
    }
    let spec = ClusterSpec::from_env()?;
    let synth = Arc::new(args.synth(&model));
    let session = build_session(args, &model, &synth, spec)?;
    if session.role().is_worker() && args.comm.active() {
        comm::worker_loop(args, &model, &synth, session, true)
    } else if session.role().is_worker() {
        run_worker(args, &model, &synth, session)
    } else {
        serve_only(session)
    }
}

/// The rank's session, as the flags configure it.
fn build_session(args: &TrainArgs, model: &Model, synth: &Arc<Synth>, spec: ClusterSpec) -> Result<Session> {
    let s2 = synth.clone();
    let mut builder = Builder::new(args.comm.layers(model, args.world().0));
    if let Some(c) = args.ckpt.config() {
        builder = builder.checkpoint(c);
    }
    if let Some(r) = &args.ckpt.resume {
        builder = builder.resume(r);
    }
    if replacement_iters().is_some() {
        builder = builder.rejoin();
    }
    if let Some(r) = args.agreed_rates()? {
        builder = builder.rates(r);
    }
    builder = builder.switches(args.switches(model)?).adaptive(args.adapt_every());
    Ok(builder
        .batch(args.batch(model) * args.learners())
        .chunk_bytes(args.book_config(model).chunk_bytes)
        .slice_params(args.book_config(model).slice_params)
        .placement(args.book_config(model).placement)
        .policy(if args.comm.active() {
            tidewire_engine::SchemePolicy::Ps
        } else {
            args.sync_mode().policy()
        })
        .sched(args.sched())
        .apply(args.comm.server_op(args.apply_op()?))
        .comm(args.comm.config(args.job.iters)?)
        .aggregation(args.aggregate)
        .transport_limits(args.limits())
        .transport(args.transport_kind(spec.rank)?)
        .timeout(Duration::from_secs(args.timeout_s))
        .connect_timeout(Duration::from_secs(args.timeout_s))
        .init_params(move |l, p| s2.init(l, p))
        .build(spec)?)
}

/// A worker rank: the training loop, leading its node's local learners
/// (`--local-learners`) when there are any; they are told when it fails.
fn run_worker(args: &TrainArgs, model: &Model, synth: &Synth, session: Session) -> Result<NodeResult> {
    let group = match LocalEnv::from_env()? {
        Some(local) => Some(
            tidewire::local::LocalGroup::create(
                &local.path,
                local.nonce,
                &local_layout(args, model),
                Duration::from_secs(args.timeout_s),
            )
            .map_err(|e| Error::Launch(e.to_string()))?,
        ),
        None => None,
    };
    let r = worker_loop(
        args,
        model,
        synth,
        session,
        LoopOpts {
            progress: true,
            fc_as_gradients: false,
            group: group.as_ref(),
        },
    );
    if r.is_err() {
        if let Some(g) = &group {
            g.abort();
        }
    }
    r
}

/// A server-only rank serves the whole job inside shutdown: its counters are there after.
fn serve_only(mut session: Session) -> Result<NodeResult> {
    let rank = session.rank();
    let (kind, why) = session.transport();
    session.shutdown()?;
    let stats = session.stats()?;
    Ok(NodeResult {
        rank,
        worker: false,
        iters: vec![],
        digests: vec![],
        stats,
        transport: format!("{kind}: {why}"),
        local: None,
        setup_tx_bytes: 0,
        setup_rx_bytes: 0,
        comm: None,
        checkpoint: session.checkpoint_stats(),
        removed_at: None,
        switches: Vec::new(),
        decisions: Vec::new(),
    })
}

#[derive(Debug, Clone, Copy)]
pub(super) struct LoopOpts<'a> {
    /// Tell the launcher each iteration done ([`super::pipe::ToLauncher::Progress`]).
    pub(super) progress: bool,
    /// Form FC gradients Uᵀ·V in the trainer and hand them in with
    /// `grad_ready` (a framework that does not use sufficient factors).
    pub(super) fc_as_gradients: bool,
    /// This worker leads a node's local learners (`--local-learners`).
    pub(super) group: Option<&'a tidewire::local::LocalGroup>,
}

/// A process's place among its node's local learners, from the launcher's
/// environment (`TIDEWIRE_LOCAL_RANK`, `TIDEWIRE_LOCAL_NODE`, `TIDEWIRE_LOCAL_PATH`,
/// `TIDEWIRE_LOCAL_NONCE`); `None` without local learners.
#[derive(Debug, Clone)]
struct LocalEnv {
    index: usize,
    node: usize,
    path: std::path::PathBuf,
    nonce: u64,
}

impl LocalEnv {
    fn from_env() -> Result<Option<Self>> {
        let Ok(index) = std::env::var("TIDEWIRE_LOCAL_RANK") else {
            return Ok(None);
        };
        let get = |k: &str| std::env::var(k).map_err(|_| Error::Usage(format!("{k} is not set")));
        let num = |k: &str, v: String| {
            v.parse::<u64>()
                .map_err(|_| Error::Usage(format!("{k}={v:?} is not a number")))
        };
        Ok(Some(LocalEnv {
            index: num("TIDEWIRE_LOCAL_RANK", index)? as usize,
            node: num("TIDEWIRE_LOCAL_NODE", get("TIDEWIRE_LOCAL_NODE")?)? as usize,
            path: get("TIDEWIRE_LOCAL_PATH")?.into(),
            nonce: num("TIDEWIRE_LOCAL_NONCE", get("TIDEWIRE_LOCAL_NONCE")?)?,
        }))
    }
}

/// The node's shared-memory layout: per layer its parameters, and a slot for
/// a learner's gradient or its U and V (K rows each), whichever is larger.
fn local_layout(args: &TrainArgs, model: &Model) -> tidewire::local::LocalLayout {
    let k = args.batch(model);
    let params = model.layers.iter().map(|l| l.params()).collect();
    let slots = model
        .layers
        .iter()
        .map(|l| {
            if l.kind == LayerKind::Fc {
                l.params().max(k * (l.m + l.n))
            } else {
                l.params()
            }
        })
        .collect();
    tidewire::local::LocalLayout::new(args.job.local_learners, params, slots)
}

/// A local learner (local rank ≥ 1): the same compute and synthetic data as a
/// worker, with gradients handed to the node's leader through shared memory
/// and parameters read from its cache. Reports its final digests.
fn run_learner(args: &TrainArgs, model: &Model, local: &LocalEnv) -> Result<NodeResult> {
    let layout = local_layout(args, model);
    let timeout = Duration::from_secs(args.timeout_s);
    let me = tidewire::local::LocalLearner::attach(&local.path, local.nonce, &layout, local.index, timeout)
        .map_err(|e| Error::Launch(e.to_string()))?;
    let k = args.batch(model);
    let learner = Learner {
        me,
        model,
        synth: args.synth(model),
        k,
        global: local.node * args.job.local_learners + local.index,
        times: model.layer_times(k, args.job.time_scale),
        gpu: Stream::default(),
        // The leader's book, for the scheme of each FC layer: factors go to the
        // leader for SFB; for the PS this learner forms its own gradient Uᵀ·V.
        book: args.book(model, args.cluster()?)?,
    };
    let mut params: Vec<Vec<f32>> = model.layers.iter().map(|l| vec![0f32; l.params()]).collect();
    let mut grad: Vec<Vec<f32>> = model.layers.iter().map(|l| vec![0f32; l.params()]).collect();
    let mut stats = Vec::new();
    let mut out = std::io::stdout();
    let mut prev: Option<Instant> = None;
    for it in 0..args.job.iters {
        let start = Instant::now();
        let blocked = learner.forward(&mut params, it.saturating_sub(args.cache_staleness))?;
        if let (Some(p), Some(last)) = (prev, stats.last_mut()) {
            let last: &mut IterStat = last;
            last.seconds = (start - p).as_secs_f64();
        }
        prev = Some(start);
        let forward_done_unix = unix_now();
        learner.backward(&mut grad, it)?;
        stats.push(IterStat {
            iter: it,
            seconds: 0.0,
            blocked_s: blocked.as_secs_f64(),
            sync_span_s: 0.0,
            exposed_s: 0.0,
            forward_done_unix,
            backward_done_unix: unix_now(),
        });
        let _ = ToLauncher::Progress(it + 1).send(&mut out);
    }
    for (l, p) in params.iter_mut().enumerate() {
        learner.me.params(l, args.job.iters, p)?;
    }
    if let (Some(p), Some(last)) = (prev, stats.last_mut()) {
        last.seconds = p.elapsed().as_secs_f64();
    }
    Ok(NodeResult {
        rank: u32::MAX,
        worker: true,
        iters: stats,
        digests: params.iter().map(|p| digest(p)).collect(),
        stats: SessionStats::default(),
        transport: String::new(),
        local: Some((local.node as u32, local.index as u32)),
        setup_tx_bytes: 0,
        setup_rx_bytes: 0,
        comm: None,
        checkpoint: None,
        removed_at: None,
        switches: Vec::new(),
        decisions: Vec::new(),
    })
}

/// A local learner's place and compute.
struct Learner<'a> {
    me: tidewire::local::LocalLearner,
    model: &'a Model,
    synth: Synth,
    /// Batch per learner.
    k: usize,
    /// The learner's index over the job (node × L + local rank).
    global: usize,
    /// Each layer's (forward, backward) compute.
    times: Vec<(Duration, Duration)>,
    /// Where that compute runs.
    gpu: Stream,
    book: Book,
}

impl Learner<'_> {
    /// The forward pass: each layer's parameters of iteration `need` or later
    /// from the leader's cache, then its compute. Returns the time blocked.
    fn forward(&self, params: &mut [Vec<f32>], need: u64) -> Result<Duration> {
        let mut blocked = Duration::ZERO;
        for (l, p) in params.iter_mut().enumerate() {
            let t = Instant::now();
            self.me.params(l, need, p)?;
            blocked += t.elapsed();
            // A read that took over a millisecond waited for the leader (the
            // copy alone is faster): the parameters arrived just now.
            if t.elapsed() > Duration::from_millis(1) {
                self.gpu.input_at(Instant::now());
            }
            self.gpu.run(self.times[l].0);
        }
        Ok(blocked)
    }

    /// The backward pass: each layer's gradient, or an SFB layer's factors,
    /// handed to the leader.
    fn backward(&self, grad: &mut [Vec<f32>], it: u64) -> Result<()> {
        let (k, me) = (self.k, &self.me);
        for l in (0..self.model.layers.len()).rev() {
            self.gpu.run(self.times[l].1);
            let spec = &self.model.layers[l];
            if spec.kind == LayerKind::Fc {
                let (mut u, mut v) = (vec![0f32; k * spec.m], vec![0f32; k * spec.n]);
                self.synth.factors(self.global, it, l as u32, &mut u, &mut v);
                if self.book.scheme(l as u32, it).takes_factors() {
                    me.hand_in(l, it, &[&u, &v])?;
                } else {
                    cpu::sf_rows(&u, &v, k, spec.m, spec.n, 0, &mut grad[l]);
                    me.hand_in(l, it, &[&grad[l]])?;
                }
            } else {
                self.synth.grad(self.global, it, l as u32, &mut grad[l]);
                me.hand_in(l, it, &[&grad[l]])?;
            }
        }
        Ok(())
    }
}

/// A worker's training loop: each iteration's forward pass waits for the
/// synced parameters, the backward pass hands in the gradients.
pub(super) fn worker_loop(
    args: &TrainArgs,
    model: &Model,
    synth: &Synth,
    mut session: Session,
    opts: LoopOpts,
) -> Result<NodeResult> {
    let w = Trainer::new(args, model, synth, &session, opts);
    let mut layers = session.take_layers()?;
    w.check_resumed_state(&session)?;
    // Set-up traffic (rendezvous, keys, the servers' seeding), before any
    // iteration: reported apart from the training traffic.
    let setup = session.stats()?;
    let mut stats: Vec<IterStat> = Vec::new();
    let mut starts: Vec<Instant> = Vec::new();
    let mut first_hand_in = None;
    let leave = leave_signal(args);
    for it in w.start..args.job.iters {
        if it > w.start && leave.load(Ordering::Relaxed) {
            return leave_as_straggler(session, stats, &setup, it);
        }
        w.save_state(&session, it)?;
        let began = Instant::now();
        let (blocked, last_sync) = w.forward(&session, &mut layers, it)?;
        let forward_done_unix = unix_now();
        if let Some(prev) = stats.last_mut() {
            // The waits of this forward pass expose the previous iteration's sync.
            prev.exposed_s = blocked.as_secs_f64();
            prev.sync_span_s = span(first_hand_in, last_sync);
            prev.seconds = (began - starts[starts.len() - 1]).as_secs_f64();
            w.progress(it);
        }
        starts.push(began);
        let (first, backward_done_unix) = w.backward(&session, &mut layers, it)?;
        first_hand_in = first;
        stats.push(IterStat {
            iter: it,
            seconds: 0.0,
            blocked_s: blocked.as_secs_f64(),
            exposed_s: 0.0,
            sync_span_s: 0.0,
            forward_done_unix,
            backward_done_unix,
        });
    }
    w.finish(session, stats, &starts, first_hand_in, &setup)
}

/// Removed as a straggler: leave at this iteration boundary, once every push
/// is in (a worker lost with half a contribution in would fail the round),
/// without a goodbye: the process ends, its connections close, and the
/// servers stop counting it.
fn leave_as_straggler(session: Session, stats: Vec<IterStat>, setup: &SessionStats, it: u64) -> Result<NodeResult> {
    let all = session.wait_all()?;
    let mut r = worker_result(&session, &all, stats, setup)?;
    r.removed_at = Some(it);
    drop(all);
    std::mem::forget(session);
    Ok(r)
}

/// What a worker's iterations share: the run's flags, its place and its
/// layers' compute times.
struct Trainer<'a> {
    args: &'a TrainArgs,
    model: &'a Model,
    synth: &'a Synth,
    opts: LoopOpts<'a>,
    book: Arc<Book>,
    /// Worker index.
    wi: usize,
    /// Batch per learner.
    k: usize,
    /// Each layer's (forward, backward) compute.
    times: Vec<(Duration, Duration)>,
    /// Where that compute runs.
    gpu: Stream,
    wait_free: bool,
    /// The first iteration: a resumed run goes on from its checkpoint, and a
    /// replacement joins a running job for the last iterations only.
    start: u64,
}

impl<'a> Trainer<'a> {
    fn new(args: &'a TrainArgs, model: &'a Model, synth: &'a Synth, session: &Session, opts: LoopOpts<'a>) -> Self {
        let rank = session.rank();
        let book = session.book().clone();
        let wi = book.cluster().worker_index(rank).expect("worker");
        let k = args.batch(model);
        // A replacement of a straggler runs at full speed.
        let slow = if args.slow_rank == Some(rank) && replacement_iters().is_none() {
            args.slow_factor
        } else {
            1.0
        };
        let start = match replacement_iters() {
            Some(n) => args.job.iters.saturating_sub(n.max(1)),
            None => session.start_iteration(),
        };
        Trainer {
            args,
            model,
            synth,
            opts,
            book,
            wi,
            k,
            times: model.layer_times(k, args.job.time_scale * slow),
            gpu: Stream::default(),
            wait_free: args.sync_mode().wait_free(),
            start,
        }
    }

    fn trainer_state(&self, iteration: u64) -> TrainerState {
        TrainerState {
            iteration,
            model: self.model.name.to_string(),
            seed: self.args.seed,
            batch: self.k,
            workers: self.args.workers,
        }
    }

    /// The checkpoint resumed must be of this run.
    fn check_resumed_state(&self, session: &Session) -> Result<()> {
        if let Some(blob) = session.framework_state() {
            let saved: TrainerState = serde_json::from_slice(blob)
                .map_err(|e| Error::Usage(format!("the checkpoint's trainer state is damaged: {e}")))?;
            saved.check(&self.trainer_state(self.start))?;
        }
        Ok(())
    }

    /// Worker 0 saves the trainer's state with every checkpoint.
    fn save_state(&self, session: &Session, it: u64) -> Result<()> {
        let args = self.args;
        if self.wi == 0 && args.ckpt.active() && it > self.start && it % args.ckpt.checkpoint_every == 0 {
            let blob = serde_json::to_vec(&self.trainer_state(it)).expect("serializable");
            session.save_framework_state(it, blob)?;
        }
        Ok(())
    }

    /// Tells the launcher `n` iterations are done.
    fn progress(&self, n: u64) {
        if self.opts.progress {
            super::pipe::progress(n);
        }
    }

    /// The forward pass: each layer waits for its synced parameters (after
    /// the first iteration), fans them out to the node's learners, and
    /// computes. Returns the time blocked and when the last of them was synced.
    fn forward(
        &self,
        session: &Session,
        layers: &mut [Option<LayerBuffers>],
        it: u64,
    ) -> Result<(Duration, Option<Instant>)> {
        let mut last_sync: Option<Instant> = None;
        let mut blocked = Duration::ZERO;
        for l in 0..self.book.layers().len() {
            if it > self.start {
                let t = Instant::now();
                let b = session.wait_layer(l as u32)?;
                blocked += t.elapsed();
                last_sync = last_sync.max(b.synced_at());
                // Synced while this thread waited: the wake-up is part of the
                // wait. Synced before: the parameters were there all along.
                let returned = Instant::now();
                self.gpu.input_at(b.synced_at().filter(|s| *s <= t).unwrap_or(returned));
                layers[l] = Some(b);
            }
            if let Some(g) = self.opts.group {
                // The fan-out: once per node, into the learners' cache.
                g.publish(l, it, layers[l].as_ref().expect("held by the trainer").params())?;
            }
            self.gpu.run(self.times[l].0);
        }
        Ok((blocked, last_sync))
    }

    /// The backward pass: each layer's gradient (or factors), handed in as
    /// soon as it is ready when wait-free, else all at the end. Returns when
    /// the first hand-in began and the Unix time before the last.
    fn backward(
        &self,
        session: &Session,
        layers: &mut [Option<LayerBuffers>],
        it: u64,
    ) -> Result<(Option<Instant>, f64)> {
        let mut first_hand_in = None;
        let mut deferred = Vec::new();
        let mut backward_done_unix = 0.0;
        for l in (0..self.book.layers().len()).rev() {
            self.gpu.run(self.times[l].1);
            let mut buf = layers[l].take().expect("held by the trainer");
            let as_grad = match self.opts.group {
                Some(g) => self.stack_group(g, &mut buf, l, it)?,
                None => {
                    self.own_gradient(&mut buf, l, it);
                    self.opts.fc_as_gradients
                }
            };
            if self.wait_free {
                first_hand_in.get_or_insert_with(Instant::now);
                if l == 0 {
                    backward_done_unix = unix_now();
                }
                hand_in(session, buf, as_grad)?;
            } else {
                deferred.push((buf, as_grad));
            }
        }
        let last = deferred.len().saturating_sub(1);
        for (i, (buf, as_grad)) in deferred.into_iter().enumerate() {
            first_hand_in.get_or_insert_with(Instant::now);
            if i == last {
                backward_done_unix = unix_now();
            }
            hand_in(session, buf, as_grad)?;
        }
        Ok((first_hand_in, backward_done_unix))
    }

    /// Learner 0 of node `wi`: its own gradient of layer `l` first, then the
    /// node's other learners' in local-rank order, into `buf` for one
    /// hand-in. Returns whether it holds a gradient (not factors).
    fn stack_group(&self, g: &tidewire::local::LocalGroup, buf: &mut LayerBuffers, l: usize, it: u64) -> Result<bool> {
        let (k, spec) = (self.k, &self.book.layers()[l]);
        let global = self.wi * self.args.job.local_learners;
        let (km, kn) = (k * spec.m, k * spec.n);
        let as_factors = spec.kind == LayerKind::Fc && self.book.scheme(l as u32, it).takes_factors();
        if as_factors {
            let (u, v) = buf.uv_mut();
            self.synth.factors(global, it, l as u32, &mut u[..km], &mut v[..kn]);
            g.stack_into(l, it, &mut [u, v])?;
        } else if spec.kind == LayerKind::Fc {
            // Through the PS: every learner forms its own Uᵀ·V (as a
            // flat run's Nodes do, one per worker); they are summed in order.
            let (mut u, mut v) = (vec![0f32; km], vec![0f32; kn]);
            self.synth.factors(global, it, l as u32, &mut u, &mut v);
            cpu::sf_rows(&u, &v, k, spec.m, spec.n, 0, buf.grad_mut());
            g.sum_into(l, it, buf.grad_mut())?;
        } else {
            self.synth.grad(global, it, l as u32, buf.grad_mut());
            g.sum_into(l, it, buf.grad_mut())?;
        }
        Ok(!as_factors)
    }

    /// This worker's own gradient of layer `l` into `buf`: an FC layer's
    /// factors U and V, or with `fc_as_gradients` the gradient Uᵀ·V.
    fn own_gradient(&self, buf: &mut LayerBuffers, l: usize, it: u64) {
        let (k, wi, spec) = (self.k, self.wi, &self.book.layers()[l]);
        if spec.kind == LayerKind::Fc && self.opts.fc_as_gradients {
            let (mut u, mut v) = (vec![0f32; k * spec.m], vec![0f32; k * spec.n]);
            self.synth.factors(wi, it, l as u32, &mut u, &mut v);
            cpu::sf_rows(&u, &v, k, spec.m, spec.n, 0, buf.grad_mut());
        } else if spec.kind == LayerKind::Fc {
            let (u, v) = buf.uv_mut();
            self.synth.factors(wi, it, l as u32, u, v);
        } else {
            self.synth.grad(wi, it, l as u32, buf.grad_mut());
        }
    }

    /// After the last iteration: waits for every layer, saves the trainer's
    /// state, closes the last iteration's figures, publishes the final
    /// parameters to the node's learners, and shuts down.
    fn finish(
        &self,
        mut session: Session,
        mut stats: Vec<IterStat>,
        starts: &[Instant],
        first_hand_in: Option<Instant>,
        setup: &SessionStats,
    ) -> Result<NodeResult> {
        let args = self.args;
        let t = Instant::now();
        let all = session.wait_all()?;
        self.save_state(&session, args.job.iters)?;
        let end = Instant::now();
        let Some(last) = stats.last_mut() else {
            return Err(Error::Usage(format!(
                "the checkpoint resumed is of iteration {}: nothing is left of --iters {}",
                self.start, args.job.iters
            )));
        };
        last.exposed_s = (end - t).as_secs_f64();
        last.sync_span_s = span(first_hand_in, all.iter().filter_map(|b| b.synced_at()).max());
        last.seconds = (end - starts[starts.len() - 1]).as_secs_f64();
        self.progress(args.job.iters);
        if let Some(g) = self.opts.group {
            for (l, b) in all.iter().enumerate() {
                g.publish(l, args.job.iters, b.params())?;
            }
        }
        let mut r = worker_result(&session, &all, stats, setup)?;
        drop(all);
        session.shutdown()?;
        // After shutdown: the last checkpoint's writes are in.
        r.checkpoint = session.checkpoint_stats();
        Ok(r)
    }
}

/// A worker's result: its iterations, its final parameters' digests, its
/// counters and transport (`setup`: the counters before the first iteration).
fn worker_result(
    session: &Session,
    all: &[LayerBuffers],
    iters: Vec<IterStat>,
    setup: &SessionStats,
) -> Result<NodeResult> {
    let (kind, why) = session.transport();
    let (switches, decisions) = session.switches();
    Ok(NodeResult {
        rank: session.rank(),
        worker: true,
        iters,
        digests: all.iter().map(|b| digest(b.params())).collect(),
        stats: session.stats()?,
        transport: format!("{kind}: {why}"),
        local: None,
        setup_tx_bytes: setup.tx_payload_bytes,
        setup_rx_bytes: setup.rx_direct_bytes + setup.rx_copied_bytes,
        comm: None,
        checkpoint: None,
        removed_at: None,
        switches,
        decisions,
    })
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn span(from: Option<Instant>, to: Option<Instant>) -> f64 {
    match (from, to) {
        (Some(a), Some(b)) if b > a => (b - a).as_secs_f64(),
        _ => 0.0,
    }
}

fn hand_in(session: &Session, buf: LayerBuffers, fc_as_gradients: bool) -> Result<()> {
    if session.book().layers()[buf.layer() as usize].kind == LayerKind::Fc && !fc_as_gradients {
        session.sf_ready(buf)?;
    } else {
        session.grad_ready(buf)?;
    }
    Ok(())
}
