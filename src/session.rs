//! The embedding API: build a [`Session`], take the layer buffers, hand each
//! layer in the moment backward produces its gradient, and wait for its
//! parameters before the next forward pass uses them.
//!
//! ```no_run
//! use tidewire::session::{Builder, TransportKind};
//! use tidewire::engine::book::{LayerKind, LayerSpec};
//! use tidewire::gpu::cpu::ApplyOp;
//!
//! // The cluster comes from the environment (TIDEWIRE_*, torchrun, Slurm or Open MPI).
//! let layers = vec![
//!     LayerSpec::new("conv1", LayerKind::Conv, 64, 27),
//!     LayerSpec::new("fc", LayerKind::Fc, 10, 64),
//! ];
//! let mut session = Builder::new(layers)
//!     .batch(32)
//!     .transport(TransportKind::Auto)
//!     .apply(ApplyOp::Sgd { lr: 0.01, momentum: 0.9, weight_decay: 0.0 })
//!     .init_params(|_layer, p| p.fill(0.01))
//!     .build_from_env()?;
//! let mut layers = session.take_layers()?;
//! for _iter in 0..10 {
//!     for l in 0..layers.len() {
//!         let buf = layers[l].as_ref().expect("held");
//!         let _w = buf.params(); // forward pass reads the parameters
//!     }
//!     for l in (0..layers.len()).rev() {
//!         let mut buf = layers[l].take().expect("held");
//!         buf.grad_mut().fill(0.001); // backward writes the gradient in place
//!         session.grad_ready(buf)?; // zero-copy: the engine pushes from this buffer
//!     }
//!     for l in 0..layers.len() {
//!         layers[l] = Some(session.wait_layer(l as u32)?); // updated parameters
//!     }
//! }
//! session.shutdown()?;
//! # Ok::<(), tidewire::Error>(())
//! ```
//!
//! FC layers that sync by sufficient-factor broadcast ([`Session::scheme`]
//! says `Sfb`) are handed in with [`Session::sf_ready`] after writing U (K×M)
//! and V (K×N) into [`LayerBuffers::u_mut`] and [`LayerBuffers::v_mut`].
//!
//! # Consistency
//! Under BSP (the default) `wait_layer` returns parameters that include every
//! worker's gradients of the iteration just handed in. Under SSP(s)
//! `wait_layer` may return up to `s` iterations early; servers keep sending
//! newer versions into a landing copy, and the caller gets a copy published
//! from it when the layer is ready (each value at least as new as the bound
//! requires, possibly newer). Either way nothing writes a layer's buffers
//! while the caller holds them: not the engine, and not a peer.
//! Aggregation under SSP is in arrival order.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use tidewire_engine::book::{LayerKind, LayerSpec};
use tidewire_engine::{ApplyOp, Book, Cluster, EngineError, Role, SchedConfig, Scheme, SchemePolicy};
use tidewire_transport::JobSecret;

pub use crate::buffers::{BufferLayout, LayerBuffers};
use crate::cluster::ClusterSpec;
use crate::config::Config;
pub use crate::config::{TransportKind, TransportLimits};
use crate::error::{Error, Result};
use crate::runtime::shared::{Request, Shared};
pub use crate::stats::SessionStats;

/// Builds a [`Session`].
#[derive(Debug)]
pub struct Builder {
    pub(crate) cfg: Config,
}

impl Builder {
    /// A builder for this layer table (forward order). Defaults: batch 32,
    /// 2 MiB chunks, 50,000-parameter slices, HybComm, P3 priority, BSP,
    /// deterministic aggregation, mean, TCP-or-RDMA auto, 60 s timeouts.
    pub fn new(layers: Vec<LayerSpec>) -> Self {
        Builder {
            cfg: Config::new(layers),
        }
    }
    /// Batch size K (the cost model's K, and the rows of U and V).
    pub fn batch(mut self, k: usize) -> Self {
        self.cfg.book.batch = k;
        self
    }
    /// KV chunk size in bytes: the unit a server applies and broadcasts.
    /// Default 2 MiB (Poseidon's). Under the priority order (P3), chunks of
    /// one slice (4 × [`Builder::slice_params`]) apply and broadcast each
    /// slice as soon as it is summed, as P3's server does: what `tidewire
    /// train --sync p3` uses ([`tidewire_engine::SyncMode::default_chunk_bytes`]),
    /// and faster where few servers serve many workers.
    pub fn chunk_bytes(mut self, b: usize) -> Self {
        self.cfg.book.chunk_bytes = b;
        self
    }
    /// Scheduling slice size in parameters.
    pub fn slice_params(mut self, p: usize) -> Self {
        self.cfg.book.slice_params = p;
        self
    }
    /// Scheme policy (HybComm, or a forced one).
    pub fn policy(mut self, p: SchemePolicy) -> Self {
        self.cfg.book.policy = p;
        self
    }
    /// Chunk placement: Poseidon's even chunks (the default), or MXNet's
    /// KVStore ([`tidewire_engine::Placement::KvStore`]: whole layers, notify
    /// then pull; BSP only). Every rank must agree.
    pub fn placement(mut self, p: tidewire_engine::Placement) -> Self {
        self.cfg.book.placement = p;
        self
    }
    /// Scheduling, credits and consistency.
    pub fn sched(mut self, s: SchedConfig) -> Self {
        self.cfg.sched = s;
        self
    }
    /// Consistency model.
    pub fn consistency(mut self, c: tidewire_engine::Consistency) -> Self {
        self.cfg.sched.consistency = c;
        self
    }
    /// When servers apply a chunk's round ([`tidewire_engine::Trigger`]):
    /// `All` (BSP, the default), `Quorum(k)`, `Async` or `Timeout(d)`; the
    /// others need BSP and PS layers. Every rank must agree.
    ///
    /// ```
    /// use tidewire::engine::book::{LayerKind, LayerSpec};
    /// use tidewire::engine::{SchemePolicy, Trigger};
    /// let b = tidewire::Builder::new(vec![LayerSpec::new("conv", LayerKind::Conv, 64, 27)])
    ///     .policy(SchemePolicy::Ps)
    ///     .trigger(Trigger::parse("quorum:3").expect("a trigger"));
    /// # let _ = b;
    /// ```
    pub fn trigger(mut self, t: tidewire_engine::Trigger) -> Self {
        self.cfg.sched.trigger = t;
        self
    }
    /// Learners behind every worker rank (Nexus's local aggregation, see
    /// [`crate::local`] and [`PushPull::lead`](crate::pushpull::PushPull::lead)):
    /// the mean and SGD divide by workers × learners. Every rank must agree.
    pub fn local_learners(mut self, n: u32) -> Self {
        self.cfg.sched.learners = n;
        self
    }
    /// Credit window in bytes.
    pub fn credit_bytes(mut self, b: usize) -> Self {
        self.cfg.sched.credit_bytes = b;
        self
    }
    /// What servers do with a complete chunk.
    pub fn apply(mut self, op: ApplyOp) -> Self {
        self.cfg.op = op;
        self
    }

    /// How this job communicates: every T steps, accumulating gradients or
    /// averaging models between exchanges, with T fixed or adjusted by
    /// training quality (Nexus). The engine syncs what is handed in; the
    /// training loop carries the mode out (see [`crate::freq`], whose
    /// [`Guide`](crate::freq::Guide) does the learner's part). Every rank
    /// must set the same (it is agreed at rendezvous). Default: every step.
    pub fn comm(mut self, c: tidewire_engine::freq::CommConfig) -> Self {
        self.cfg.comm = c;
        self
    }

    /// Where the server sums contributions: `Cpu`, `Gpu` (an error at build
    /// without a usable GPU), or `Auto` (default: Nexus's per-chunk choice,
    /// which is the CPU without a GPU). Sums are bitwise the same either way.
    pub fn aggregation(mut self, p: tidewire_gpu::agg::Policy) -> Self {
        self.cfg.aggregation = p;
        self
    }
    /// The link speed, Gbit/s, that the sparse/dense choice of layers with
    /// the sparse hint ([`LayerSpec::sparse()`](tidewire_engine::book::LayerSpec::sparse()))
    /// weighs against its measured encode cost. Default: `TIDEWIRE_LINK_GBPS`,
    /// else the speed the transport reports, else 10.
    ///
    /// ```
    /// use tidewire::engine::book::{LayerKind, LayerSpec};
    /// use tidewire::Builder;
    /// let b = Builder::new(vec![
    ///     LayerSpec::new("embedding", LayerKind::Other, 50_000, 64).sparse(true),
    ///     LayerSpec::new("fc", LayerKind::Fc, 10, 64),
    /// ])
    /// .link_gbps(1.0);
    /// # let _ = b;
    /// ```
    pub fn link_gbps(mut self, gbps: f64) -> Self {
        self.cfg.link_gbps = Some(gbps);
        self
    }
    /// The measured rates HybComm decides with, in seconds rather than in
    /// Poseidon's bytes (see [`tidewire_engine::cost::seconds`]): where the
    /// GEMM that rebuilds a gradient from factors is slow beside the link,
    /// an FC layer goes through the PS. Default: `TIDEWIRE_RATES` (JSON),
    /// else none (bytes). Measure them with [`crate::calibrate::measure`]
    /// or `tidewire calibrate`; every rank must reach the same schemes (the
    /// rendezvous refuses ranks that do not).
    ///
    /// ```no_run
    /// use tidewire::engine::book::{LayerKind, LayerSpec};
    /// let p = tidewire::calibrate::measure(std::time::Duration::from_millis(200)).unwrap();
    /// let b = tidewire::Builder::new(vec![LayerSpec::new("fc", LayerKind::Fc, 4096, 4096)])
    ///     .rates(p.node_rates(1, None));
    /// # let _ = b;
    /// ```
    pub fn rates(mut self, r: tidewire_engine::cost::Rates) -> Self {
        self.cfg.rates = Some(r);
        self
    }
    /// FC layers switch between the PS and SFB at these iterations
    /// ([`tidewire_engine::plan`]): every rank must give the same (they are
    /// part of the agreed book). BSP with the `all` trigger, an apply op
    /// without momentum, and no checkpoints.
    pub fn switches(mut self, s: Vec<tidewire_engine::Switch>) -> Self {
        self.cfg.switches = s;
        self
    }
    /// HybComm decides again in the run, every `every` iterations (0: never):
    /// worker index 0 tries the cost model's choice against an alternative
    /// on the measured iteration time and keeps the faster, and the protocol
    /// carries each decision to every rank (see [`tidewire_engine::plan`]).
    /// Every rank must give the same. Hand the dense FC layers in by their
    /// factors ([`Session::sf_ready`]): a layer's scheme may be undecided
    /// when its backward ends. The same limits as [`Builder::switches`].
    pub fn adaptive(mut self, every: u64) -> Self {
        self.cfg.adapt_every = every;
        self
    }
    /// Transport selection.
    pub fn transport(mut self, t: TransportKind) -> Self {
        self.cfg.transport = t;
        self
    }
    /// Lower limits for the transport (requests in flight per connection,
    /// largest message); `TIDEWIRE_MAX_OUTSTANDING` and
    /// `TIDEWIRE_MAX_MESSAGE_BYTES` override them. The engine queues and
    /// splits to stay within whatever the transport reports.
    pub fn transport_limits(mut self, l: TransportLimits) -> Self {
        self.cfg.limits = l;
        self
    }
    /// Job id and secret (every rank the same). Without a secret,
    /// `TIDEWIRE_SECRET` is read at build time.
    pub fn job(mut self, id: u64, secret: JobSecret) -> Self {
        self.cfg.job = id;
        self.cfg.secret = Some(secret);
        self
    }
    /// How long a wait may last before it fails, and how long a peer may stay silent.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.cfg.timeout = t;
        self
    }
    /// How long rendezvous and connection setup may take.
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.cfg.connect_timeout = t;
        self
    }
    /// The IP to listen on (default: the one that reaches rank 0).
    pub fn listen_ip(mut self, ip: IpAddr) -> Self {
        self.cfg.listen_ip = Some(ip);
        self
    }
    /// Fills the initial parameters of each layer. Worker rank 0's values
    /// are broadcast to everyone, so all replicas start equal.
    pub fn init_params(mut self, f: impl Fn(u32, &mut [f32]) + Send + 'static) -> Self {
        self.cfg.init = Some(Box::new(f));
        self
    }
    /// Registers the caller's own parameter memory (zero-copy) instead of
    /// letting the session allocate it. Its values are the initial
    /// parameters (worker rank 0's go to everyone) unless
    /// [`Builder::init_params`] overwrites them.
    pub fn params_buffer(mut self, layout: BufferLayout) -> Self {
        self.cfg.params = Some(layout);
        self
    }
    /// Registers the caller's own gradient memory.
    pub fn grads_buffer(mut self, layout: BufferLayout) -> Self {
        self.cfg.grads = Some(layout);
        self
    }

    /// Checkpoints the job every `c.every` iterations into `c.dir`
    /// ([`crate::checkpoint`]): servers snapshot their shards' optimizer
    /// state and worker 0 the parameters, all at the same iteration, written
    /// atomically as safetensors on a thread of their own. Every rank must
    /// set the same, and the directory must be one all ranks see (a shared
    /// filesystem across machines); the settings and the resumed iteration
    /// are agreed at rendezvous. A fresh job refuses a directory that
    /// already holds checkpoints: resume from it, or give another. Needs BSP
    /// and the `all` trigger (under SSP or another trigger the workers and
    /// the servers are not at one iteration).
    ///
    /// ```no_run
    /// use tidewire::checkpoint::Checkpointing;
    /// # let layers = vec![];
    /// let session = tidewire::Builder::new(layers)
    ///     .checkpoint(Checkpointing::new("/data/ckpt", 100))
    ///     .resume("/data/ckpt") // after a failure: the newest complete checkpoint
    ///     .build_from_env()?;
    /// let first = session.start_iteration(); // iterations already done
    /// # let _ = first; Ok::<(), tidewire::Error>(())
    /// ```
    pub fn checkpoint(mut self, c: crate::checkpoint::Checkpointing) -> Self {
        self.cfg.checkpoint = Some(c);
        self
    }
    /// Starts from a checkpoint: `path` is a `step-*` directory, or a
    /// checkpoint directory (its newest complete checkpoint). Its parameters
    /// replace [`Builder::init_params`]'s, the servers and workers take its
    /// momentum, and [`Session::start_iteration`] says where it left off.
    /// Give every rank the same. Checkpoints after it in the
    /// [`Builder::checkpoint`] directory are removed: they belong to the run
    /// that failed.
    pub fn resume(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.cfg.resume = Some(path.into());
        self
    }

    /// This process replaces a worker of a running job (one lost or
    /// removed as a straggler; a worker that holds no shard, under a
    /// [`Trigger`](tidewire_engine::Trigger) other than `All`): it gets the
    /// address table from rank 0, dials every rank, takes the current
    /// parameters from the servers (no seeding), and is counted from the
    /// round in progress on. Give it the rank it replaces and the job's
    /// settings.
    pub fn rejoin(mut self) -> Self {
        self.cfg.rejoin = true;
        self
    }

    /// Builds with the cluster from the environment (see [`crate::cluster`]).
    pub fn build_from_env(self) -> Result<Session> {
        let spec = ClusterSpec::from_env()?;
        self.build(spec)
    }

    /// Builds: rendezvous, connections, registration and the initial
    /// parameter broadcast. Returns once every chunk holds rank 0's values.
    pub fn build(mut self, spec: ClusterSpec) -> Result<Session> {
        let cluster = Cluster::from_roles(spec.roles.clone())?;
        let mut book = Book::new(cluster, std::mem::take(&mut self.cfg.layers), self.cfg.book)?;
        let rates = match self.cfg.rates {
            Some(r) => Some(r),
            None => crate::calibrate::rates_from_env()?,
        };
        if let Some(r) = rates {
            book = book.with_rates(r)?;
        }
        if !self.cfg.switches.is_empty() || self.cfg.adapt_every > 0 {
            if self.cfg.checkpoint.is_some() || self.cfg.resume.is_some() {
                return Err(Error::Checkpoint(
                    "scheme switches and checkpoints do not go together yet (a checkpoint keeps each layer where its start-up scheme holds it)".into(),
                ));
            }
            book = book.with_switches(&self.cfg.switches)?;
            if self.cfg.adapt_every > 0 {
                book = book.with_adaptive(self.cfg.adapt_every)?;
            }
        }
        let book = Arc::new(book);
        if self.cfg.secret.is_none() {
            let s = std::env::var("TIDEWIRE_SECRET").map_err(|_| {
                Error::Cluster(
                    "no job secret: pass Builder::job(id, secret) or set TIDEWIRE_SECRET (same on every rank)".into(),
                )
            })?;
            self.cfg.secret = Some(JobSecret::new(s.into_bytes()));
            if let Ok(j) = std::env::var("TIDEWIRE_JOB") {
                self.cfg.job = j
                    .trim()
                    .parse()
                    .map_err(|_| Error::Cluster(format!("TIDEWIRE_JOB={j:?} is not a number")))?;
            }
        }
        if let Some(l) = &self.cfg.params {
            check_layout(&book, l, "parameter")?;
            for (i, &o) in l.offsets.iter().enumerate() {
                if o.checked_sub(l.offsets[0]) != Some(book.layer_offset(i as u32) * 4) {
                    return Err(Error::Layout(format!(
                        "parameter buffer: layer {i} starts at {o}, but parameters must be back to back from {} (expected {})",
                        l.offsets[0],
                        l.offsets[0] + book.layer_offset(i as u32) * 4
                    )));
                }
            }
        }
        if let Some(l) = &self.cfg.grads {
            check_layout(&book, l, "gradient")?;
        }
        let role = book.cluster().role(spec.rank).expect("rank checked by ClusterSpec");
        let start_iteration = self.prepare_checkpoints(&book, spec.rank)?;
        let writer = self.cfg.ckpt.writer.clone();
        let framework = self.cfg.ckpt.loaded.as_ref().and_then(|l| l.framework.clone());
        let (tx, rx) = bounded::<Request>(1024);
        let shared = Arc::new(Shared::default());
        let (layers_tx, layers_rx) = bounded(1);
        let timeout = self.cfg.timeout;
        let handle = crate::runtime::spawn(self.cfg, book.clone(), spec.clone(), rx, shared.clone(), layers_tx)?;
        let layers = match layers_rx.recv() {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                let _ = handle.join();
                shared.check_panic();
                return Err(e);
            }
            Err(_) => {
                let _ = handle.join();
                shared.check_panic();
                return Err(shared.fatal().unwrap_or(Error::Shutdown));
            }
        };
        Ok(Session {
            ckpt_stats: writer.clone(),
            writer,
            start_iteration,
            framework,
            last_error: Arc::new(std::sync::Mutex::new(None)),
            book,
            timeout,
            rank: spec.rank,
            role,
            tx: Some(tx),
            shared,
            handle: Some(handle),
            layers: Some(layers),
        })
    }
}

impl Builder {
    /// Loads the checkpoint to resume from and starts the writer; returns
    /// the iterations already done.
    fn prepare_checkpoints(&mut self, book: &Arc<Book>, rank: u32) -> Result<u64> {
        use crate::checkpoint::{self, Loaded, Plan, Writer};
        let mut base = 0;
        if let Some(path) = self.cfg.resume.clone() {
            let loaded = Loaded::open(&path, book)?;
            loaded.check_op(book, self.cfg.op)?;
            base = loaded.iteration;
            let l = Arc::new(loaded);
            let l2 = l.clone();
            // The checkpoint's values are every rank's initial ones.
            self.cfg.init = Some(Box::new(move |layer, p| p.copy_from_slice(&l2.params[layer as usize])));
            tracing::info!(rank, from = %l.dir.display(), iteration = base, "resuming");
            self.cfg.ckpt.loaded = Some(l);
        }
        if self.cfg.checkpoint.is_some() || self.cfg.resume.is_some() {
            let (every, fw) = self
                .cfg
                .checkpoint
                .as_ref()
                .map_or((0, false), |c| (c.every, c.framework_state));
            // Every rank must checkpoint alike and resume the same iteration.
            self.cfg.ckpt.fingerprint = tidewire_engine::agree::JobConfig::checkpoint_fingerprint(&[
                &every.to_le_bytes(),
                &[u8::from(fw)],
                &base.to_le_bytes(),
            ]);
        }
        if let Some(c) = self.cfg.checkpoint.clone() {
            if self.cfg.sched.consistency != tidewire_engine::Consistency::Bsp {
                return Err(Error::Checkpoint(
                    "checkpoints need BSP: under SSP the parameters a worker holds at an iteration \
                     boundary may lag the servers' optimizer state, so the files would not be of one iteration"
                        .into(),
                ));
            }
            if self.cfg.sched.trigger != tidewire_engine::Trigger::All {
                return Err(Error::Checkpoint(
                    "checkpoints need the `all` aggregation trigger: under the others the servers' rounds \
                     and the workers' iterations differ"
                        .into(),
                ));
            }
            if self.cfg.comm.freq.t_max != 1 {
                return Err(Error::Checkpoint(
                    "checkpoints with a communication period above 1 are not supported: the \
                     learners' accumulated state is the training loop's"
                        .into(),
                ));
            }
            c.validate()?;
            let model_writer = book.cluster().worker_index(rank) == Some(0);
            if self.cfg.resume.is_some() {
                if model_writer {
                    // Worker 0 alone removes them, before the rendezvous: no rank can
                    // write a checkpoint until every rank has joined.
                    let gone = checkpoint::remove_after(&c.dir, base)?;
                    if !gone.is_empty() {
                        tracing::info!(
                            rank,
                            ?gone,
                            "removed the failed run's checkpoints after the one resumed"
                        );
                    }
                }
            } else if let Some(p) = Loaded::newest_complete(&c.dir)? {
                return Err(Error::Checkpoint(format!(
                    "{} already holds checkpoints ({}): resume from it, or checkpoint into another directory",
                    c.dir.display(),
                    p.display()
                )));
            } else if model_writer {
                // A fresh job: what an earlier attempt left half-written goes (before
                // the rendezvous, so no rank of this job has written anything yet).
                checkpoint::remove_after(&c.dir, 0)?;
            }
            let run = checkpoint::run_id(self.cfg.secret.as_ref().map_or(0, |s| s.fingerprint()), self.cfg.job);
            self.cfg.ckpt.writer = Some(Writer::start(Plan::new(c, book, self.cfg.op, rank, run, base))?);
        }
        Ok(base)
    }
}

fn check_layout(book: &Book, l: &BufferLayout, what: &str) -> Result<()> {
    if l.offsets.len() != book.layers().len() {
        return Err(Error::Layout(format!(
            "{what} buffer: {} offsets for {} layers",
            l.offsets.len(),
            book.layers().len()
        )));
    }
    let mut ranges: Vec<(usize, usize, usize)> = Vec::new();
    for (i, (&off, spec)) in l.offsets.iter().zip(book.layers()).enumerate() {
        let len = spec.params() * 4;
        if off % 4 != 0 {
            return Err(Error::Layout(format!(
                "{what} buffer: layer {i} ({}) starts at {off}, not a multiple of 4",
                spec.name
            )));
        }
        if off.checked_add(len).map_or(true, |e| e > l.buffer.len()) {
            return Err(Error::Engine(EngineError::WrongSize {
                layer: i as u32,
                name: spec.name.clone(),
                got: l.buffer.len().saturating_sub(off) / 4,
                want: spec.params(),
            }));
        }
        ranges.push((off, off + len, i));
    }
    ranges.sort();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::Layout(format!(
                "{what} buffer: layers {} ({}) and {} ({}) overlap",
                w[0].2,
                book.layers()[w[0].2].name,
                w[1].2,
                book.layers()[w[1].2].name
            )));
        }
    }
    Ok(())
}

/// A running rank of a job.
#[derive(Debug)]
pub struct Session {
    writer: Option<crate::checkpoint::Writer>,
    /// The writer, kept after shutdown for its counters.
    ckpt_stats: Option<crate::checkpoint::Writer>,
    start_iteration: u64,
    framework: Option<Vec<u8>>,
    last_error: Arc<std::sync::Mutex<Option<Error>>>,
    book: Arc<Book>,
    timeout: Duration,
    rank: u32,
    role: Role,
    tx: Option<Sender<Request>>,
    shared: Arc<Shared>,
    handle: Option<std::thread::JoinHandle<()>>,
    layers: Option<Vec<LayerBuffers>>,
}

impl Session {
    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }
    /// Iterations done before this session: 0, or the resumed checkpoint's
    /// iteration ([`Builder::resume`]). The training loop counts from here.
    pub fn start_iteration(&self) -> u64 {
        self.start_iteration
    }
    /// The learner's framework state saved with the resumed checkpoint, if any.
    pub fn framework_state(&self) -> Option<&[u8]> {
        self.framework.as_deref()
    }
    /// Saves the learner's framework state (e.g. a serialized optimizer or
    /// data-loader position) with checkpoint `iteration`: one learner calls
    /// it at each checkpoint iteration (a multiple of `every`, counted
    /// globally, after [`Session::start_iteration`]) when the job declared
    /// [`Checkpointing::framework_state`](crate::checkpoint::Checkpointing::framework_state).
    /// It is written on the checkpoint thread; the call does not wait.
    pub fn save_framework_state(&self, iteration: u64, state: Vec<u8>) -> Result<()> {
        let w = self
            .writer
            .as_ref()
            .ok_or_else(|| Error::Checkpoint("this session does not checkpoint (Builder::checkpoint)".into()))?;
        w.framework(iteration, state)
    }
    /// What this rank's checkpoints cost so far, and which it wrote its part
    /// of; `None` when the session does not checkpoint. After
    /// [`Session::shutdown`] it includes the last writes.
    pub fn checkpoint_stats(&self) -> Option<crate::checkpoint::CheckpointStats> {
        self.ckpt_stats.as_ref().map(|w| w.stats())
    }
    /// This rank's role.
    pub fn role(&self) -> Role {
        self.role
    }
    /// The information book every rank agreed on.
    pub fn book(&self) -> &Arc<Book> {
        &self.book
    }
    /// The scheme `layer` syncs by from the start (see [`Book::scheme`]);
    /// with switches in the book ([`Book::with_switches`]), it may change:
    /// see [`Session::scheme_at`].
    pub fn scheme(&self, layer: u32) -> Result<Scheme> {
        self.scheme_at(layer, 0)
    }

    /// The scheme `layer` syncs by in iteration `iter` (a layer's buffers
    /// say which iteration they are for: [`LayerBuffers::iter`]).
    /// With adaptive schemes ([`Builder::adaptive`]) this is what the rank
    /// knows now: final for a decided iteration, the last decision carried
    /// on for a later one.
    pub fn scheme_at(&self, layer: u32, iter: u64) -> Result<Scheme> {
        self.book.layer(layer)?;
        Ok(match self.shared.plan() {
            Some((plan, _)) => plan.scheme(layer, iter),
            None => self.book.scheme(layer, iter),
        })
    }

    /// The switches so far (given up front, or decided in the run), and on
    /// worker index 0 of an adaptive session the decisions with the window
    /// times they came from.
    pub fn switches(&self) -> (Vec<tidewire_engine::Switch>, Vec<crate::Decision>) {
        match self.shared.plan() {
            Some((plan, log)) => (plan.switches().collect(), log.unwrap_or_default()),
            None => (self.book.plan().switches().collect(), Vec::new()),
        }
    }

    fn check(&self) -> Result<&Sender<Request>> {
        self.shared.check_panic();
        if let Some(e) = self.shared.fatal() {
            return Err(e);
        }
        self.tx.as_ref().ok_or(Error::Shutdown)
    }

    fn worker(&self) -> Result<()> {
        if self.role.is_worker() {
            Ok(())
        } else {
            Err(Error::Role {
                rank: self.rank,
                role: "worker",
            })
        }
    }

    /// Takes every layer's buffers (once), holding the initial parameters.
    pub fn take_layers(&mut self) -> Result<Vec<Option<LayerBuffers>>> {
        self.worker()?;
        self.check()?;
        let l = self
            .layers
            .take()
            .ok_or_else(|| Error::Layout("take_layers was already called".into()))?;
        Ok(l.into_iter().map(Some).collect())
    }

    fn send(&self, r: Request) -> Result<()> {
        self.check()?.send(r).map_err(|_| {
            self.shared.check_panic();
            self.shared.fatal().unwrap_or(Error::Shutdown)
        })?;
        // The runtime sleeps in the transport until woken.
        self.shared.wake();
        Ok(())
    }

    /// Hands in a layer whose gradient is in [`LayerBuffers::grad_mut`]. Its
    /// slices are queued at once; the call does not wait for the network.
    pub fn grad_ready(&self, buf: LayerBuffers) -> Result<()> {
        self.worker()?;
        let spec = self.book.layer(buf.layer)?;
        // Decided in the run, a dense FC layer may go either way: always by its factors.
        let contested = self.book.plan().contested().contains(&buf.layer);
        if contested || self.scheme_at(buf.layer, buf.iter)?.takes_factors() {
            return Err(EngineError::NeedsFactors {
                layer: buf.layer,
                name: spec.name.clone(),
            }
            .into());
        }
        self.send(Request::HandIn {
            buf,
            factors: false,
            at: Instant::now(),
        })
    }

    /// Hands in an FC layer by its sufficient factors (U, V). Where the layer
    /// syncs through the PS, the gradient Uᵀ·V is formed here and pushed.
    pub fn sf_ready(&self, buf: LayerBuffers) -> Result<()> {
        self.worker()?;
        let spec = self.book.layer(buf.layer)?;
        if spec.kind != LayerKind::Fc {
            return Err(EngineError::NotFullyConnected {
                layer: buf.layer,
                name: spec.name.clone(),
            }
            .into());
        }
        self.send(Request::HandIn {
            buf,
            factors: true,
            at: Instant::now(),
        })
    }

    fn call<T>(&self, what: String, make: impl FnOnce(Sender<Result<T>>) -> Request) -> Result<T> {
        let (tx, rx): (Sender<Result<T>>, Receiver<Result<T>>) = bounded(1);
        self.send(make(tx))?;
        let r = match rx.recv_timeout(self.timeout()) {
            Ok(r) => r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(Error::Timeout {
                what,
                after: self.timeout(),
            }),
            Err(_) => {
                self.shared.check_panic();
                Err(self.shared.fatal().unwrap_or(Error::Shutdown))
            }
        };
        if let Err(e) = &r {
            // A job that panicked on an executor failed the rank: raise the panic here.
            self.shared.check_panic();
            record(&self.last_error, e);
        }
        r
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Asks for `layer`'s parameters without blocking: the non-blocking twin
    /// of [`Session::wait_layer`]. The returned handle completes when the
    /// layer is synced; poll it with [`Pending::try_take`] or block on
    /// [`Pending::wait`]. Dropping the handle before it completes loses the
    /// layer's buffers for the rest of the session.
    pub fn wait_layer_async(&self, layer: u32) -> Result<Pending<LayerBuffers>> {
        self.worker()?;
        self.book.layer(layer)?;
        self.pending(format!("layer {layer} to sync"), |reply| Request::Wait { layer, reply })
    }

    /// The non-blocking twin of [`Session::wait_all`].
    pub fn wait_all_async(&self) -> Result<Pending<Vec<LayerBuffers>>> {
        self.worker()?;
        self.pending("every layer to sync".into(), |reply| Request::WaitAll { reply })
    }

    fn pending<T>(&self, what: String, make: impl FnOnce(Sender<Result<T>>) -> Request) -> Result<Pending<T>> {
        let (tx, rx) = bounded(1);
        self.send(make(tx))?;
        Ok(Pending {
            rx,
            what,
            since: Instant::now(),
            timeout: self.timeout,
            shared: self.shared.clone(),
            last_error: self.last_error.clone(),
        })
    }

    /// Blocks until `layer`'s parameters are synced, and returns its buffers.
    pub fn wait_layer(&self, layer: u32) -> Result<LayerBuffers> {
        self.worker()?;
        self.book.layer(layer)?;
        self.call(format!("layer {layer} to sync"), |reply| Request::Wait { layer, reply })
    }

    /// Blocks until every handed-in layer is synced (the BSP barrier) and
    /// returns their buffers, in layer order.
    pub fn wait_all(&self) -> Result<Vec<LayerBuffers>> {
        self.worker()?;
        self.call("every layer to sync".into(), |reply| Request::WaitAll { reply })
    }

    /// The transport this rank runs on (`"tcp"` for io_uring TCP, `"portable"`
    /// for the epoll TCP backend, or `"rdma"`) and why it was chosen: with
    /// [`TransportKind::Auto`], RDMA when a usable device exists, else TCP with
    /// the reason RDMA was not usable (and, where io_uring is not allowed, why
    /// the portable backend carries it).
    pub fn transport(&self) -> (String, String) {
        self.shared
            .transport()
            .unwrap_or_else(|| ("tcp".into(), "not reported".into()))
    }

    /// Counters. After [`Session::shutdown`], the counters as the runtime
    /// left them (a server-only rank's whole job happens inside shutdown).
    pub fn stats(&self) -> Result<SessionStats> {
        if self.tx.is_none() {
            // After shutdown: the counters as the runtime left them.
            if let Some(s) = self.shared.last_stats() {
                return Ok(s);
            }
        }
        self.call("stats".into(), |reply| Request::Stats { reply })
    }

    /// Ends the session: waits for in-flight layers, tells the peers, and
    /// serves them until every peer has said goodbye (a server-only rank calls
    /// this to serve the whole job). Every later call fails with `Shutdown`.
    pub fn shutdown(&mut self) -> Result<()> {
        if self.tx.is_none() {
            return Err(Error::Shutdown);
        }
        // After a wait timed out, layers may be in flight that will never sync
        // (a peer skipped them, or is stuck): waiting for them could last forever.
        // Abort instead, telling the peers why, and return that error.
        let failed = self.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(e) = failed.filter(Error::is_timeout) {
            self.abort_inner();
            return Err(e);
        }
        let r = self.shutdown_inner();
        self.tx = None;
        self.layers = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.shared.check_panic();
        // The checkpoints queued are written before the session ends.
        let w = self.writer.take().map_or(Ok(()), |w| w.finish());
        r.and(w)
    }

    fn shutdown_inner(&self) -> Result<()> {
        let (tx, rx) = bounded(1);
        self.send(Request::Shutdown { reply: tx })?;
        // Serving the job can take as long as the job: wait on the transport's
        // liveness checks rather than a fixed timeout.
        match rx.recv() {
            Ok(r) => r,
            Err(_) => Err(self.shared.fatal().unwrap_or(Error::Shutdown)),
        }
    }
}

impl Session {
    /// Ends the session at once, without waiting for layers in flight: the
    /// peers' calls fail with [`EngineError::PeerAborted`] and this reason.
    /// Use it when this rank cannot go on; [`Session::shutdown`] is the
    /// graceful end. Every later call fails with `Shutdown`.
    pub fn abort(&mut self, reason: &str) -> Result<()> {
        record(
            &self.last_error,
            &Error::Engine(EngineError::Aborted(reason.to_string())),
        );
        if self.tx.is_none() {
            return Err(Error::Shutdown);
        }
        self.abort_inner();
        Ok(())
    }

    fn abort_inner(&mut self) {
        if let Some(tx) = self.tx.take() {
            let why = match self.last_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
                Some(Error::Engine(EngineError::Aborted(r))) => r,
                Some(e) => format!("it failed: {e}"),
                None => "its session was dropped without shutdown".into(),
            };
            let _ = tx.send(Request::Abort(why));
            self.shared.wake();
        }
        self.layers = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.abort_inner();
    }
}

/// A request in flight: the completion handle of
/// [`Session::wait_layer_async`] and [`Session::wait_all_async`].
///
/// The session's timeout runs from the request: [`Pending::try_take`] fails
/// with [`Error::Timeout`] once it has passed, like the blocking call would.
#[derive(Debug)]
pub struct Pending<T> {
    rx: Receiver<Result<T>>,
    what: String,
    since: Instant,
    timeout: Duration,
    shared: Arc<Shared>,
    last_error: Arc<std::sync::Mutex<Option<Error>>>,
}

/// Remembers a failed call: after a timed-out wait [`Session::shutdown`]
/// aborts instead of waiting for layers that may never sync, and an abort
/// (or a drop) tells the peers why.
fn record(last: &std::sync::Mutex<Option<Error>>, e: &Error) {
    *last.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
}

impl<T> Pending<T> {
    fn note<V>(&self, r: Result<V>) -> Result<V> {
        if let Err(e) = &r {
            record(&self.last_error, e);
        }
        r
    }

    fn failed(&self) -> Error {
        self.shared.check_panic();
        self.shared.fatal().unwrap_or(Error::Shutdown)
    }

    /// The result if it is there, `Ok(None)` if not yet; never blocks.
    /// After it returned `Some` (or an error) the handle is spent: later
    /// calls fail with [`Error::Shutdown`].
    pub fn try_take(&mut self) -> Result<Option<T>> {
        let r = match self.rx.try_recv() {
            Ok(r) => r.map(Some),
            Err(crossbeam_channel::TryRecvError::Empty) if self.since.elapsed() >= self.timeout => {
                Err(Error::Timeout {
                    what: self.what.clone(),
                    after: self.timeout,
                })
            }
            Err(crossbeam_channel::TryRecvError::Empty) => Ok(None),
            Err(crossbeam_channel::TryRecvError::Disconnected) => Err(self.failed()),
        };
        self.note(r)
    }

    /// Blocks until the result is there (at most the rest of the session's timeout).
    pub fn wait(self) -> Result<T> {
        let left = self.timeout.saturating_sub(self.since.elapsed());
        let r = match self.rx.recv_timeout(left) {
            Ok(r) => r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(Error::Timeout {
                what: self.what.clone(),
                after: self.timeout,
            }),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(self.failed()),
        };
        self.note(r)
    }

    /// Blocks at most `d`: `Ok(None)` if the result is not there by then.
    pub fn wait_for(&mut self, d: Duration) -> Result<Option<T>> {
        let left = self.timeout.saturating_sub(self.since.elapsed());
        match self.rx.recv_timeout(d.min(left)) {
            Ok(r) => self.note(r.map(Some)),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => self.try_take(),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                let e = self.failed();
                self.note(Err(e))
            }
        }
    }
}

/// The address a rank 0 would bind for a job on this host (for launchers).
pub fn loopback_master(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}
