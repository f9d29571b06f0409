//! The flags of `tidewire train` ([`TrainArgs`]) and what they decide.

use clap::Args;
use serde::{Deserialize, Serialize};
use tidewire_engine::book::LayerKind;
use tidewire_engine::models::Model;
use tidewire_engine::{Book, BookConfig, Cluster, Consistency, SchedConfig, SyncMode};
use tidewire_gpu::cpu::ApplyOp;

use super::comm::CommArgs;
use super::synth::Synth;
use crate::error::{Error, Result};
use crate::job::JobArgs;
use crate::resilience::CheckpointArgs;

/// Iterations between decisions where `--adapt-every` is not given and the
/// run supports them ([`TrainArgs::adapt_every`]): long enough that a
/// window's time is steadier than one iteration's, short enough that a
/// wrong start-up choice costs a run of 100 iterations at most about a tenth.
pub const ADAPT_EVERY: u64 = 10;

/// Flags of `tidewire train`.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct TrainArgs {
    /// The job: model, iterations, sync mode, consistency, trigger, sizes (shared with `sim`).
    #[command(flatten)]
    pub job: JobArgs,
    /// Worker processes (P1).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Server processes (P2); ignored with --colocate.
    #[arg(long, default_value_t = 2)]
    pub servers: usize,
    /// Every node is a worker and a server (P1 = P2 = --workers).
    #[arg(long)]
    pub colocate: bool,
    /// Where servers sum contributions: auto (Nexus's per-chunk CPU/GPU choice;
    /// the CPU without a GPU), cpu, or gpu (fails without a usable GPU).
    #[arg(long, default_value = "auto")]
    pub aggregate: tidewire_gpu::agg::Policy,
    /// sgd, mean or sum.
    #[arg(long, default_value = "sgd")]
    pub op: String,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.01)]
    pub lr: f32,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    /// SGD weight decay.
    #[arg(long, default_value_t = 0.0005)]
    pub weight_decay: f32,
    /// Slice size in parameters (sliced, p3 and full). Default: with
    /// --cost-model seconds, the smallest slice whose per-message cost is at
    /// most 4% of its time on the measured link, from P3's 50,000 up to a
    /// 2 MiB chunk; otherwise 50,000.
    #[arg(long)]
    pub slice_params: Option<usize>,
    /// Check the final parameters against a single-process reference (BSP, deterministic).
    #[arg(long)]
    pub verify: bool,
    /// Seconds a wait or a silent peer may take before the run fails. The
    /// launcher also kills the run when no worker finishes an iteration for
    /// this long plus 30 s and 20 iterations' compute.
    #[arg(long, default_value_t = 60)]
    pub timeout_s: u64,
    /// Lower the transport's bound on requests in flight per connection (the
    /// engine queues within it; TIDEWIRE_MAX_OUTSTANDING does the same).
    #[arg(long)]
    pub max_outstanding: Option<usize>,
    /// Lower the transport's message cap, bytes, at least 256 (larger factor
    /// blocks are split; TIDEWIRE_MAX_MESSAGE_BYTES does the same).
    #[arg(long)]
    pub max_message_bytes: Option<usize>,
    /// Which transport every rank uses: auto (RDMA when usable, else TCP), tcp
    /// (io_uring, or the portable epoll backend where io_uring is not allowed),
    /// portable (the epoll backend even where io_uring works), rdma, or mixed
    /// (odd ranks portable, even ranks io_uring TCP: the two interoperate).
    /// TIDEWIRE_TRANSPORT overrides it. Default: auto.
    #[arg(long)]
    pub transport: Option<String>,
    /// Seed of the synthetic gradients.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Slow this worker rank's compute down (straggler experiments).
    #[arg(long)]
    pub slow_rank: Option<u32>,
    /// Compute slowdown of --slow-rank.
    #[arg(long, default_value_t = 3.0)]
    pub slow_factor: f64,
    /// Straggler removal (with --trigger other than all, and separate
    /// --servers): the launcher, coordinating, removes a worker whose
    /// progress stays under 1/FACTOR of the median worker's once the median
    /// has done --straggler-window iterations. The worker leaves at its next
    /// iteration boundary and the job goes on with one worker fewer (the
    /// chunk placement stays).
    #[arg(long)]
    pub remove_stragglers: Option<f64>,
    /// Iterations the median worker must have done before a straggler is judged.
    #[arg(long, default_value_t = 5)]
    pub straggler_window: u64,
    /// With --remove-stragglers: once a removed worker has left, start a
    /// replacement (a new process, at full speed) with its rank: it gets the
    /// address table from rank 0, takes the current parameters from the
    /// servers and is counted from the round in progress until the end.
    #[arg(long, requires = "remove_stragglers")]
    pub replace_stragglers: bool,
    /// Local learners read parameters from the node's cache up to this many
    /// versions old instead of waiting for the newest (Nexus's parameter cache).
    #[arg(long, default_value_t = 0)]
    pub cache_staleness: u64,
    /// Run rank r in network namespace r mod N of this comma- or space-separated list
    /// (`ip netns exec`; root). The bandwidth harness (ci/netem/netem.sh run) passes its
    /// namespaces in NETEM_NS. Needs --netns-addrs.
    #[arg(long, requires = "netns_addrs")]
    pub netns: Option<String>,
    /// The IPv4 address of each --netns namespace, in the same order (NETEM_ADDRS);
    /// rank 0's is the rendezvous address.
    #[arg(long, requires = "netns")]
    pub netns_addrs: Option<String>,
    /// Give these layers (comma-separated names; conv or other layers) the
    /// sparse-push hint, and make their synthetic gradients sparse: only a
    /// --sparse-density fraction of their 64-element rows is nonzero, as an
    /// embedding's. The summary then shows how their slices went (pairs or
    /// dense), their density and the bytes of each form.
    #[arg(long)]
    pub sparse_layers: Option<String>,
    /// Fraction of the rows of a --sparse-layers gradient that is nonzero.
    #[arg(long, default_value_t = 0.01)]
    pub sparse_density: f64,
    /// How HybComm weighs the PS against SFB for an FC layer: seconds (this
    /// machine's measured rates: its GEMM, its sum, its loopback or shaped
    /// link and per-message cost, shared by the ranks on it; see `tidewire
    /// calibrate`) or bytes (Poseidon's Table 1, which counts reconstruction
    /// as free). Default: seconds.
    #[arg(long, default_value = "seconds")]
    pub cost_model: String,
    /// With --cost-model seconds: this machine's rates from a `tidewire
    /// calibrate --out` profile, instead of measuring them at start (about 1 s).
    #[arg(long)]
    pub profile: Option<std::path::PathBuf>,
    /// Switch an FC layer's scheme mid-run: LAYER@ITER:SCHEME (layer name or
    /// index, the first iteration under the new scheme, ps or sfb),
    /// repeatable and comma-separated. For trying a schedule by hand and
    /// checking it with --verify: the layer's parameters (and SGD's
    /// momentum) move between the servers and the workers at the boundary.
    /// Needs BSP with the all trigger, the chunked placement, and no
    /// checkpoints.
    #[arg(long, value_delimiter = ',')]
    pub switch: Vec<String>,
    /// Decide FC layers' schemes again in the run, every N iterations (0:
    /// never): worker 0 measures the cost model's choice, then an
    /// alternative (the layers the model is least sure of, flipped), keeps
    /// the faster, and watches it. The report lists each decision with the
    /// window time it came from. Needs what --switch needs, and one learner
    /// per worker. Default: every 10 with `--sync full` or `hybrid` where
    /// that holds (BSP, the all trigger, no --switch, no checkpoints, one
    /// learner, no --comm-*, a dense FC layer), else never; the report says which.
    #[arg(long)]
    pub adapt_every: Option<u64>,
    /// The rates every rank decides with (JSON; the launcher measures them
    /// and passes them on to its ranks).
    #[arg(long, hide = true)]
    pub rates: Option<String>,
    /// Communication frequency (Nexus): --comm-every, --comm-mode, --freq-*.
    #[command(flatten)]
    pub comm: CommArgs,
    /// Checkpoints, resume, rollback and fault injection: --checkpoint-*, --resume,
    /// --max-restarts, --fault-kill.
    #[command(flatten)]
    pub ckpt: CheckpointArgs,
}

pub(super) fn split_list(s: &str) -> Vec<String> {
    s.split([',', ' '])
        .filter(|x| !x.is_empty())
        .map(str::to_string)
        .collect()
}

impl TrainArgs {
    /// The model profile, with the sparse hint on the --sparse-layers.
    pub fn model(&self) -> Result<Model> {
        let mut m = self.job.profile()?;
        for name in self.sparse_layers.iter().flat_map(|s| s.split(',')).map(str::trim) {
            if name.is_empty() {
                continue;
            }
            match m.layers.iter_mut().find(|l| l.name == name) {
                Some(l) if l.kind != LayerKind::Fc => l.sparse = true,
                Some(_) => {
                    return Err(Error::Usage(format!(
                        "--sparse-layers {name}: an FC layer (its gradient is formed from factors); pick conv or other layers"
                    )))
                }
                None => return Err(Error::Usage(format!("--sparse-layers: {} has no layer {name:?}", m.name))),
            }
        }
        if !(0.0..=1.0).contains(&self.sparse_density) {
            return Err(Error::Usage(format!(
                "--sparse-density {} is not in [0, 1]",
                self.sparse_density
            )));
        }
        Ok(m)
    }
    /// The synthetic gradients, sparse on the --sparse-layers.
    pub(super) fn synth(&self, model: &Model) -> Synth {
        let mut s = Synth::new(self.seed);
        s.density = model
            .layers
            .iter()
            .map(|l| if l.sparse { self.sparse_density } else { 1.0 })
            .collect();
        s
    }
    /// The sync mode.
    pub fn sync_mode(&self) -> SyncMode {
        self.job.sync
    }
    /// The apply op.
    pub fn apply_op(&self) -> Result<ApplyOp> {
        Ok(match self.op.as_str() {
            "sgd" => ApplyOp::Sgd {
                lr: self.lr,
                momentum: self.momentum,
                weight_decay: self.weight_decay,
            },
            "mean" => ApplyOp::Mean,
            "sum" => ApplyOp::Sum,
            o => return Err(Error::Usage(format!("--op {o:?}: use sgd, mean or sum"))),
        })
    }
    pub(super) fn batch(&self, m: &Model) -> usize {
        self.job.batch.unwrap_or(m.batch)
    }
    /// (P1, P2, ranks): with --flat every learner is a worker rank.
    pub(super) fn world(&self) -> (usize, usize, usize) {
        let p1 = if self.job.flat {
            self.workers * self.job.local_learners
        } else {
            self.workers
        };
        if self.colocate {
            (p1, p1, p1)
        } else {
            (p1, self.servers, p1 + self.servers)
        }
    }
    /// Learners behind each worker rank (1 with --flat).
    pub(super) fn learners(&self) -> usize {
        if self.job.flat {
            1
        } else {
            self.job.local_learners.max(1)
        }
    }
    /// Checks the flags before anything starts.
    pub fn validate(&self) -> Result<()> {
        self.model()?;
        self.apply_op()?;
        self.transport_kind(0)?;
        self.check_gpu()?;
        self.check_sizes()?;
        self.check_local_learners()?;
        self.check_netns()?;
        self.check_cost_model()?;
        if !(self.job.time_scale >= 0.0 && self.job.time_scale.is_finite()) {
            return Err(Error::Usage("--time-scale must be a finite number ≥ 0".into()));
        }
        let c = self.job.consistency;
        if self.comm.active() {
            self.comm.validate(self.apply_op()?, self.job.iters)?;
            if c != Consistency::Bsp {
                return Err(Error::Usage("--comm-every/--comm-mode/--freq-max need BSP".into()));
            }
        }
        let trigger = self.trigger();
        self.check_baselines(c, trigger)?;
        self.ckpt.validate(
            self.world().2,
            self.job.iters,
            self.job.local_learners,
            self.comm.active(),
            c == Consistency::Bsp && trigger == tidewire_engine::Trigger::All,
        )?;
        self.check_trigger(c, trigger)?;
        self.check_remove_stragglers(trigger)?;
        if self.verify && (c != Consistency::Bsp || self.job.fast) {
            return Err(Error::Usage(
                "--verify needs BSP with deterministic aggregation: SSP and --fast results depend on timing".into(),
            ));
        }
        Ok(())
    }
    /// `--aggregate gpu`: refused before any rank starts, with the probe's reason.
    fn check_gpu(&self) -> Result<()> {
        if self.aggregate == tidewire_gpu::agg::Policy::Gpu {
            let p = tidewire_gpu::probe();
            if !p.usable {
                return Err(tidewire_gpu::agg::AggError::NoGpu(p.detail).into());
            }
        }
        Ok(())
    }
    /// The workers, servers and iterations, and the book's own checks (batch,
    /// chunk and slice sizes, --rates), here rather than in every rank after the launch.
    fn check_sizes(&self) -> Result<()> {
        if self.workers == 0 {
            return Err(Error::Usage("--workers must be at least 1".into()));
        }
        if !self.colocate && self.servers == 0 {
            return Err(Error::Usage("--servers must be at least 1 (or use --colocate)".into()));
        }
        if self.job.iters == 0 {
            return Err(Error::Usage("--iters must be at least 1".into()));
        }
        if self.adapt_every() > 0 && self.job.local_learners > 1 {
            return Err(Error::Usage(
                "--adapt-every with --local-learners is not supported yet: a learner forms its PS gradient from the start-up scheme".into(),
            ));
        }
        if self.rates_pending() {
            // The sizes now; the switches once the launcher has measured the
            // rates the ranks decide with ([`Self::check_plan`]): a book built
            // before then decides in bytes, and may start a layer elsewhere.
            let m = self.model()?;
            Book::new(self.cluster()?, m.layers.clone(), self.book_config(&m))?;
            return Ok(());
        }
        self.check_plan()
    }
    /// Whether the launcher is still to measure the rates every rank decides
    /// HybComm (and the default slice size) with: not with `--cost-model
    /// bytes`, `--rates` given, a frequency-guided run, or a mode with neither
    /// HybComm nor slices.
    pub(super) fn rates_pending(&self) -> bool {
        !(self.cost_model == "bytes"
            || self.rates.is_some()
            || self.comm.active()
            || (self.sync_mode().policy() != tidewire_engine::SchemePolicy::Hybrid && !self.sync_mode().sliced()))
    }
    /// The book as the ranks build it, and its switches and decisions checked
    /// against the run's other flags (checkpoints, consistency, the op).
    pub(super) fn check_plan(&self) -> Result<()> {
        let book = self.book(&self.model()?, self.cluster()?)?;
        if book.plan().has_switches() || book.plan().every() > 0 {
            if self.ckpt.config().is_some() || self.ckpt.resume.is_some() {
                return Err(Error::Usage(
                    "--switch with checkpoints is not supported yet (a checkpoint keeps each layer where its start-up scheme holds it)".into(),
                ));
            }
            let op = self.comm.server_op(self.apply_op()?);
            tidewire_engine::node::check_switches(&book, &self.sched(), op)?;
        }
        Ok(())
    }
    /// `--local-learners`, `--flat` and `--cache-staleness`.
    fn check_local_learners(&self) -> Result<()> {
        if self.job.local_learners == 0 {
            return Err(Error::Usage("--local-learners must be at least 1".into()));
        }
        if self.job.local_learners > 1 && self.comm.active() {
            return Err(Error::Usage(
                "--local-learners with --comm-every or quality-guided frequency is not supported yet: use one of them"
                    .into(),
            ));
        }
        if self.job.flat && self.job.local_learners < 2 {
            return Err(Error::Usage(
                "--flat compares against --local-learners L with L ≥ 2: give L".into(),
            ));
        }
        if self.verify && self.cache_staleness > 0 {
            return Err(Error::Usage(
                "--verify needs --cache-staleness 0: stale parameter reads depend on timing".into(),
            ));
        }
        Ok(())
    }
    /// `--netns` and `--netns-addrs`: one IPv4 address per namespace.
    fn check_netns(&self) -> Result<()> {
        if let (Some(ns), Some(addrs)) = (&self.netns, &self.netns_addrs) {
            let (ns, addrs) = (split_list(ns), split_list(addrs));
            if ns.is_empty() || ns.len() != addrs.len() {
                return Err(Error::Usage(format!(
                    "--netns names {} namespaces and --netns-addrs {} addresses: give one address per namespace",
                    ns.len(),
                    addrs.len()
                )));
            }
            if let Some(a) = addrs.iter().find(|a| a.parse::<std::net::Ipv4Addr>().is_err()) {
                return Err(Error::Usage(format!("--netns-addrs: {a:?} is not an IPv4 address")));
            }
        }
        Ok(())
    }
    /// `--cost-model`, with `--profile` and `--rates`.
    fn check_cost_model(&self) -> Result<()> {
        if !matches!(self.cost_model.as_str(), "seconds" | "bytes") {
            return Err(Error::Usage(format!(
                "--cost-model {:?}: use seconds (measured rates) or bytes (Poseidon's Table 1)",
                self.cost_model
            )));
        }
        if self.profile.is_some() && self.cost_model == "bytes" {
            return Err(Error::Usage(
                "--profile gives rates for --cost-model seconds, not bytes".into(),
            ));
        }
        self.agreed_rates()?;
        Ok(())
    }
    /// The papers' baselines (`--sync kvstore` and `adam`) keep one version
    /// per iteration: BSP and `--trigger all` only.
    fn check_baselines(&self, c: Consistency, trigger: tidewire_engine::Trigger) -> Result<()> {
        if self.sync_mode() == SyncMode::KvStore {
            if c != Consistency::Bsp {
                return Err(Error::Usage(
                    "--sync kvstore is MXNet's dist_sync (notify, then pull every version): it needs BSP".into(),
                ));
            }
            if trigger != tidewire_engine::Trigger::All {
                return Err(Error::Usage(format!(
                    "--sync kvstore pulls every version of every chunk: --trigger {} needs another --sync mode",
                    self.job.trigger
                )));
            }
        }
        if self.sync_mode() == SyncMode::Adam && (c != Consistency::Bsp || trigger != tidewire_engine::Trigger::All) {
            return Err(Error::Usage(format!(
                "--sync adam rebuilds each FC layer on its server from every worker's factors of one iteration: \
                 it needs BSP and --trigger all, not --consistency {} --trigger {}",
                self.job.consistency, self.job.trigger
            )));
        }
        Ok(())
    }
    /// A trigger other than all: no --verify, every layer through the PS, BSP.
    fn check_trigger(&self, c: Consistency, trigger: tidewire_engine::Trigger) -> Result<()> {
        if trigger == tidewire_engine::Trigger::All {
            return Ok(());
        }
        if self.verify {
            return Err(Error::Usage(format!(
                "--verify needs --trigger all: under {} the sums depend on arrival",
                self.job.trigger
            )));
        }
        if self.sync_mode().policy() != tidewire_engine::SchemePolicy::Ps {
            return Err(Error::Usage(format!(
                "--trigger {} needs every layer through the PS (sufficient factors need every worker's): \
                 use --sync p3, sliced, wfbp or fifo-ps",
                self.job.trigger
            )));
        }
        if c != Consistency::Bsp {
            return Err(Error::Usage(format!("--trigger {} needs BSP", self.job.trigger)));
        }
        Ok(())
    }
    /// `--remove-stragglers`: a trigger other than all, separate servers, a
    /// factor above 1, and neither checkpoints nor local learners.
    fn check_remove_stragglers(&self, trigger: tidewire_engine::Trigger) -> Result<()> {
        let Some(f) = self.remove_stragglers else {
            return Ok(());
        };
        if trigger == tidewire_engine::Trigger::All {
            return Err(Error::Usage(
                "--remove-stragglers needs --trigger quorum:K, timeout:MS or async: under all the \
                 servers wait for every worker, so a removed one would end the job"
                    .into(),
            ));
        }
        if self.colocate {
            return Err(Error::Usage(
                "--remove-stragglers needs separate --servers: a colocated worker holds a shard".into(),
            ));
        }
        if !(f > 1.0 && f.is_finite()) {
            return Err(Error::Usage(format!("--remove-stragglers {f}: give a factor above 1")));
        }
        if self.ckpt.active() {
            return Err(Error::Usage(
                "--remove-stragglers with --checkpoint-dir is not supported yet".into(),
            ));
        }
        if self.job.local_learners > 1 {
            return Err(Error::Usage(
                "--remove-stragglers with --local-learners is not supported yet".into(),
            ));
        }
        Ok(())
    }
    /// The slice size: `--slice-params`, or P3's 50,000.
    fn slice(&self) -> usize {
        self.slice_params.unwrap_or(tidewire_engine::cost::P3_SLICE_PARAMS)
    }
    /// The rates the launcher measured for its ranks (`--rates`), if any.
    pub(super) fn agreed_rates(&self) -> Result<Option<tidewire_engine::cost::Rates>> {
        match &self.rates {
            None => Ok(None),
            Some(j) => tidewire::calibrate::parse_rates(j)
                .map(|r| {
                    // A PS layer's gradient is built from its factors here
                    // (the runtime's `FactorsToGrad`, or a local learner's
                    // backward): a GEMM SFB does not pay.
                    Some(tidewire_engine::cost::Rates {
                        ps_builds_grad: true,
                        ..r
                    })
                })
                .map_err(|e| Error::Usage(format!("--rates: {e}"))),
        }
    }
    /// The book every rank builds: the sizes of [`Self::book_config`] over
    /// `cluster`, deciding in seconds at the agreed rates where there are some.
    /// The engine's cluster: P1 workers and P2 servers, or P1 colocated nodes.
    pub(super) fn cluster(&self) -> Result<Cluster> {
        let (p1, p2, _) = self.world();
        Ok(if self.colocate {
            Cluster::colocated(p1)?
        } else {
            Cluster::split(p1, p2)?
        })
    }
    pub(super) fn book(&self, m: &Model, cluster: Cluster) -> Result<Book> {
        let book = Book::new(cluster, m.layers.clone(), self.book_config(m))?;
        let book = match self.agreed_rates()? {
            Some(r) => book.with_rates(r)?,
            None => book,
        };
        let book = book.with_switches(&self.switches(m)?)?;
        Ok(if self.adapt_every() > 0 {
            book.with_adaptive(self.adapt_every())?
        } else {
            book
        })
    }
    /// The decision period: `--adapt-every`, else [`ADAPT_EVERY`] where
    /// [`Self::adapt_off`] finds nothing against it, else 0.
    pub(super) fn adapt_every(&self) -> u64 {
        match self.adapt_every {
            Some(n) => n,
            None if self.adapt_off().is_none() => ADAPT_EVERY,
            None => 0,
        }
    }
    /// Why a run without `--adapt-every` does not decide in the run: its
    /// mode has no HybComm, or it has what decisions do not support.
    pub(super) fn adapt_off(&self) -> Option<&'static str> {
        let sched = self.sched();
        let dense_fc = self
            .model()
            .is_ok_and(|m| m.layers.iter().any(|l| l.kind == LayerKind::Fc && !l.sparse));
        Some(if self.sync_mode().policy() != tidewire_engine::SchemePolicy::Hybrid {
            "the sync mode has no HybComm"
        } else if sched.consistency != Consistency::Bsp || sched.trigger != tidewire_engine::Trigger::All {
            "decisions need BSP with the all trigger"
        } else if self.switch.iter().any(|s| !s.trim().is_empty()) {
            "--switch given"
        } else if self.ckpt.config().is_some() || self.ckpt.resume.is_some() {
            "decisions do not support checkpoints yet"
        } else if self.job.local_learners > 1 {
            "decisions need one learner per worker"
        } else if self.comm.active() {
            "--comm-* decides the frequency instead"
        } else if !dense_fc {
            "the model has no dense FC layer"
        } else {
            return None;
        })
    }
    /// The --switch flags, as the engine's switches (layers by name or index).
    pub(super) fn switches(&self, m: &Model) -> Result<Vec<tidewire_engine::Switch>> {
        let bad = |s: &str, why: String| Error::Usage(format!("--switch {s}: {why} (want LAYER@ITER:ps|sfb)"));
        self.switch
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| {
                let (layer, rest) = s.trim().split_once('@').ok_or_else(|| bad(s, "no @".into()))?;
                let (iter, scheme) = rest.split_once(':').ok_or_else(|| bad(s, "no :SCHEME".into()))?;
                let layer = match m.layers.iter().position(|l| l.name == layer) {
                    Some(i) => i as u32,
                    None => layer
                        .parse::<u32>()
                        .ok()
                        .filter(|&i| (i as usize) < m.layers.len())
                        .ok_or_else(|| bad(s, format!("{} has no layer {layer:?}", m.name)))?,
                };
                let iter = iter
                    .parse()
                    .map_err(|_| bad(s, format!("{iter:?} is not an iteration")))?;
                let scheme = match scheme {
                    "ps" => tidewire_engine::Scheme::Ps,
                    "sfb" => tidewire_engine::Scheme::Sfb,
                    o => return Err(bad(s, format!("{o:?} is not ps or sfb"))),
                };
                Ok(tidewire_engine::Switch { layer, iter, scheme })
            })
            .collect()
    }
    pub(super) fn book_config(&self, m: &Model) -> BookConfig {
        self.sync_mode().book_config(BookConfig {
            batch: self.batch(m) * self.learners(),
            chunk_bytes: self
                .job
                .chunk_bytes
                .unwrap_or_else(|| self.sync_mode().default_chunk_bytes(self.slice())),
            slice_params: self.slice(),
            ..Default::default()
        })
    }
    /// The transport `--transport` asks for, for `rank`.
    pub fn transport_kind(&self, rank: u32) -> Result<tidewire::TransportKind> {
        use tidewire::TransportKind as K;
        // Every rank would refuse a bad TIDEWIRE_TRANSPORT at start-up: say so once, here.
        if let Ok(v) = std::env::var("TIDEWIRE_TRANSPORT") {
            if !matches!(v.as_str(), "" | "auto" | "tcp" | "portable" | "rdma") {
                return Err(Error::Usage(format!(
                    "TIDEWIRE_TRANSPORT={v:?}: use tcp, portable, rdma or auto (it overrides --transport)"
                )));
            }
        }
        Ok(match self.transport.as_deref().unwrap_or("auto") {
            "auto" => K::Auto,
            "tcp" => K::Tcp,
            "portable" => K::Portable,
            "rdma" => K::Rdma,
            "mixed" if rank % 2 == 1 => K::Portable,
            "mixed" => K::Tcp,
            o => {
                return Err(Error::Usage(format!(
                    "--transport {o:?}: use auto, tcp, portable, rdma or mixed"
                )))
            }
        })
    }
    /// The transport limits the flags lower.
    pub fn limits(&self) -> tidewire::TransportLimits {
        tidewire::TransportLimits {
            max_outstanding: self.max_outstanding,
            max_message_bytes: self.max_message_bytes,
        }
    }
    /// --trigger, parsed.
    pub fn trigger(&self) -> tidewire_engine::Trigger {
        self.job.trigger
    }

    pub(super) fn sched(&self) -> SchedConfig {
        let mut s = SchedConfig {
            trigger: self.trigger(),
            order: self.sync_mode().order(),
            consistency: self.job.consistency,
            deterministic: !self.job.fast,
            fold_group: if self.job.flat {
                self.job.local_learners as u32
            } else {
                1
            },
            learners: self.learners() as u32,
            ..SchedConfig::default()
        };
        if let Some(c) = self.job.credit_bytes {
            s.credit_bytes = c;
        }
        s
    }
}
