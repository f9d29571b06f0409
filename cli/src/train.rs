//! `tidewire train`: a local cluster of real processes on loopback, replaying
//! a model profile. Workers sleep for each layer's calibrated compute time,
//! produce deterministic synthetic gradients (or sufficient factors for FC
//! layers) in their registered buffers, and hand them to the engine exactly as
//! a framework would. `--verify` recomputes the run in one process and
//! compares every layer's final parameters bit for bit.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tidewire_engine::book::{LayerKind, Scheme};
use tidewire_engine::models::{self, Model};
use tidewire_engine::{Book, BookConfig, Cluster, Consistency, SchedConfig, SyncMode};
use tidewire_gpu::cpu::{self, ApplyOp};

use tidewire::cluster::ClusterSpec;
use tidewire::session::{Builder, LayerBuffers, Session, SessionStats};

use crate::error::{Error, Result};
use crate::resilience::{self, CheckpointArgs, Restart, TrainerState};

/// Flags of `tidewire train`.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct TrainArgs {
    /// Model profile: vgg19, vgg19-22k, googlenet, inception-v3, resnet-50, resnet-152, alexnet, vgg19-mini.
    #[arg(long, default_value = "vgg19")]
    pub model: String,
    /// Worker processes (P1).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Server processes (P2); ignored with --colocate.
    #[arg(long, default_value_t = 2)]
    pub servers: usize,
    /// Every node is a worker and a server (P1 = P2 = --workers).
    #[arg(long)]
    pub colocate: bool,
    /// Iterations.
    #[arg(long, default_value_t = 10)]
    pub iters: u64,
    /// fifo-ps, wfbp, hybrid, sliced, p3, full, kvstore (MXNet's KVStore,
    /// P3's baseline: whole layers per server, notify then pull; BSP only)
    /// or adam (Project Adam, Poseidon's baseline: FC layers' factors to the
    /// one server holding the layer, full matrices back; BSP only).
    #[arg(long, default_value = "full", value_parser = parse_sync)]
    pub sync: String,
    /// Batch size K per worker (default: the profile's).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Multiplies every layer's compute time (1.0 = the calibrated single-GPU time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// bsp, or ssp:S for stale synchronous with bound S.
    #[arg(long, default_value = "bsp", value_parser = parse_consistency)]
    pub consistency: String,
    /// Sum in arrival order instead of fixed rank order.
    #[arg(long)]
    pub fast: bool,
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
    /// Credit window in bytes (default: the engine's).
    #[arg(long)]
    pub credit_bytes: Option<usize>,
    /// KV chunk size in bytes: the unit a server applies and broadcasts.
    /// Default: one slice in sliced, p3 and full (P3's server applies and
    /// broadcasts per slice; slices under 64 KiB are grouped to at least
    /// 64 KiB, and a chunk stays within 2 MiB), Poseidon's 2 MiB in the other
    /// modes.
    #[arg(long)]
    pub chunk_bytes: Option<usize>,
    /// Slice size in parameters (sliced, p3 and full). Default: with
    /// --cost-model seconds, the smallest slice whose per-message cost is at
    /// most 4% of its time on the measured link, from P3's 50,000 up to a
    /// 2 MiB chunk; otherwise 50,000.
    #[arg(long)]
    pub slice_params: Option<usize>,
    /// Check the final parameters against a single-process reference (BSP, deterministic).
    #[arg(long)]
    pub verify: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
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
    /// When servers apply a chunk's round (Nexus's aggregation triggers):
    /// all (BSP: every worker's gradient, the default), quorum:K (the first K
    /// workers' whole contributions; later ones are dropped), async (every
    /// contribution on arrival, Downpour; late ones join the next round) or
    /// timeout:MS (what is in MS after the round's first contribution, the
    /// mean over the contributors). Not all: BSP, PS layers only (--sync p3,
    /// sliced, wfbp or fifo-ps), no --verify.
    #[arg(long, default_value = "all")]
    pub trigger: String,
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
    /// Learners per worker node (Nexus's local aggregation): each worker rank
    /// leads L learner processes (itself and L-1 more) that hand their
    /// gradients to it through shared memory; it sums them in local-rank order,
    /// pushes once per node and fans the parameters out through a cache.
    /// `--workers` counts nodes; every node computes L × `--batch` samples.
    #[arg(long, default_value_t = 1)]
    pub local_learners: usize,
    /// With --local-learners L: the flat baseline. Every learner is a rank of
    /// its own and pushes for itself (L copies per node), and servers sum each
    /// node's L gradients first, as the local aggregator does, so both runs
    /// give bitwise the same parameters (every PS-synced layer).
    #[arg(long)]
    pub flat: bool,
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
    /// The rates every rank decides with (JSON; the launcher measures them
    /// and passes them on to its ranks).
    #[arg(long, hide = true)]
    pub rates: Option<String>,
    /// Communication frequency (Nexus): --comm-every, --comm-mode, --freq-*.
    #[command(flatten)]
    pub comm: comm::CommArgs,
    /// Checkpoints, resume, rollback and fault injection: --checkpoint-*, --resume,
    /// --max-restarts, --fault-kill.
    #[command(flatten)]
    pub ckpt: CheckpointArgs,
}

fn split_list(s: &str) -> Vec<String> {
    s.split([',', ' '])
        .filter(|x| !x.is_empty())
        .map(str::to_string)
        .collect()
}

fn parse_sync(s: &str) -> std::result::Result<String, String> {
    SyncMode::parse(s)
        .map(|m| m.name().to_string())
        .ok_or_else(|| "use fifo-ps, wfbp, hybrid, sliced, p3, full, kvstore or adam".into())
}

fn parse_consistency(s: &str) -> std::result::Result<String, String> {
    consistency_of(s).map(|_| s.to_string())
}

fn consistency_of(s: &str) -> std::result::Result<Consistency, String> {
    if s == "bsp" {
        return Ok(Consistency::Bsp);
    }
    s.strip_prefix("ssp:")
        .and_then(|n| n.parse::<u32>().ok())
        .map(Consistency::Ssp)
        .ok_or_else(|| "use bsp or ssp:S (e.g. ssp:2)".into())
}

impl TrainArgs {
    /// The model profile, with the sparse hint on the --sparse-layers.
    pub fn model(&self) -> Result<Model> {
        let mut m = models::profile(&self.model).ok_or_else(|| {
            Error::Usage(format!(
                "unknown model {:?}; known: {}",
                self.model,
                models::NAMES.join(", ")
            ))
        })?;
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
    fn synth(&self, model: &Model) -> Synth {
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
        SyncMode::parse(&self.sync).expect("validated by clap")
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
    fn batch(&self, m: &Model) -> usize {
        self.batch.unwrap_or(m.batch)
    }
    /// (P1, P2, ranks): with --flat every learner is a worker rank.
    fn world(&self) -> (usize, usize, usize) {
        let p1 = if self.flat {
            self.workers * self.local_learners
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
    fn learners(&self) -> usize {
        if self.flat {
            1
        } else {
            self.local_learners.max(1)
        }
    }
    /// Checks the flags before anything starts.
    pub fn validate(&self) -> Result<()> {
        self.model()?;
        self.apply_op()?;
        self.transport_kind(0)?;
        if self.aggregate == tidewire_gpu::agg::Policy::Gpu {
            // Refuse before any rank starts, with the probe's reason.
            let p = tidewire_gpu::probe();
            if !p.usable {
                return Err(tidewire_gpu::agg::AggError::NoGpu(p.detail).into());
            }
        }
        if self.workers == 0 {
            return Err(Error::Usage("--workers must be at least 1".into()));
        }
        if !self.colocate && self.servers == 0 {
            return Err(Error::Usage("--servers must be at least 1 (or use --colocate)".into()));
        }
        if self.iters == 0 {
            return Err(Error::Usage("--iters must be at least 1".into()));
        }
        if self.local_learners == 0 {
            return Err(Error::Usage("--local-learners must be at least 1".into()));
        }
        if self.local_learners > 1 && self.comm.active() {
            return Err(Error::Usage(
                "--local-learners with --comm-every or quality-guided frequency is not supported yet: use one of them"
                    .into(),
            ));
        }
        if self.flat && self.local_learners < 2 {
            return Err(Error::Usage(
                "--flat compares against --local-learners L with L ≥ 2: give L".into(),
            ));
        }
        if self.verify && self.cache_staleness > 0 {
            return Err(Error::Usage(
                "--verify needs --cache-staleness 0: stale parameter reads depend on timing".into(),
            ));
        }
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
        if !(self.time_scale >= 0.0 && self.time_scale.is_finite()) {
            return Err(Error::Usage("--time-scale must be a finite number ≥ 0".into()));
        }
        let c = consistency_of(&self.consistency).map_err(Error::Usage)?;
        if self.comm.active() {
            self.comm.validate(self.apply_op()?, self.iters)?;
            if c != Consistency::Bsp {
                return Err(Error::Usage("--comm-every/--comm-mode/--freq-max need BSP".into()));
            }
        }
        let trigger = self.trigger()?;
        if self.sync_mode() == SyncMode::KvStore {
            if c != Consistency::Bsp {
                return Err(Error::Usage(
                    "--sync kvstore is MXNet's dist_sync (notify, then pull every version): it needs BSP".into(),
                ));
            }
            if trigger != tidewire_engine::Trigger::All {
                return Err(Error::Usage(format!(
                    "--sync kvstore pulls every version of every chunk: --trigger {} needs another --sync mode",
                    self.trigger
                )));
            }
        }
        if self.sync_mode() == SyncMode::Adam && (c != Consistency::Bsp || trigger != tidewire_engine::Trigger::All) {
            return Err(Error::Usage(format!(
                "--sync adam rebuilds each FC layer on its server from every worker's factors of one iteration: \
                 it needs BSP and --trigger all, not --consistency {} --trigger {}",
                self.consistency, self.trigger
            )));
        }
        self.ckpt.validate(
            self.world().2,
            self.iters,
            self.local_learners,
            self.comm.active(),
            c == Consistency::Bsp && trigger == tidewire_engine::Trigger::All,
        )?;
        if trigger != tidewire_engine::Trigger::All {
            if self.verify {
                return Err(Error::Usage(format!(
                    "--verify needs --trigger all: under {} the sums depend on arrival",
                    self.trigger
                )));
            }
            if self.sync_mode().policy() != tidewire_engine::SchemePolicy::Ps {
                return Err(Error::Usage(format!(
                    "--trigger {} needs every layer through the PS (sufficient factors need every worker's): \
                     use --sync p3, sliced, wfbp or fifo-ps",
                    self.trigger
                )));
            }
            if c != Consistency::Bsp {
                return Err(Error::Usage(format!("--trigger {} needs BSP", self.trigger)));
            }
        }
        if let Some(f) = self.remove_stragglers {
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
            if self.local_learners > 1 {
                return Err(Error::Usage(
                    "--remove-stragglers with --local-learners is not supported yet".into(),
                ));
            }
        }
        if self.verify && (c != Consistency::Bsp || self.fast) {
            return Err(Error::Usage(
                "--verify needs BSP with deterministic aggregation: SSP and --fast results depend on timing".into(),
            ));
        }
        Ok(())
    }
    /// The slice size: `--slice-params`, or P3's 50,000.
    fn slice(&self) -> usize {
        self.slice_params.unwrap_or(tidewire_engine::cost::P3_SLICE_PARAMS)
    }
    /// The rates the launcher measured for its ranks (`--rates`), if any.
    fn agreed_rates(&self) -> Result<Option<tidewire_engine::cost::Rates>> {
        match &self.rates {
            None => Ok(None),
            Some(j) => tidewire::calibrate::parse_rates(j)
                .map(Some)
                .map_err(|e| Error::Usage(format!("--rates: {e}"))),
        }
    }
    /// The book every rank builds: the sizes of [`Self::book_config`] over
    /// `cluster`, deciding in seconds at the agreed rates where there are some.
    fn book(&self, m: &Model, cluster: Cluster) -> Result<Book> {
        let book = Book::new(cluster, m.layers.clone(), self.book_config(m))?;
        Ok(match self.agreed_rates()? {
            Some(r) => book.with_rates(r)?,
            None => book,
        })
    }
    fn book_config(&self, m: &Model) -> BookConfig {
        self.sync_mode().book_config(BookConfig {
            batch: self.batch(m) * self.learners(),
            chunk_bytes: self
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
    pub fn trigger(&self) -> Result<tidewire_engine::Trigger> {
        tidewire_engine::Trigger::parse(&self.trigger).ok_or_else(|| {
            Error::Usage(format!(
                "--trigger {:?}: use all, quorum:K, async or timeout:MS",
                self.trigger
            ))
        })
    }

    fn sched(&self) -> SchedConfig {
        let mut s = SchedConfig {
            trigger: self.trigger().expect("validated"),
            order: self.sync_mode().order(),
            consistency: consistency_of(&self.consistency).expect("validated"),
            deterministic: !self.fast,
            fold_group: if self.flat { self.local_learners as u32 } else { 1 },
            learners: self.learners() as u32,
            ..SchedConfig::default()
        };
        if let Some(c) = self.credit_bytes {
            s.credit_bytes = c;
        }
        s
    }
}

/// Deterministic synthetic data: every value is a table entry picked by a
/// hash of (worker, iteration, layer), so the reference can recompute it.
#[derive(Debug, Clone)]
pub struct Synth {
    table: Vec<f32>,
    seed: u64,
    /// Per layer: the fraction of 64-element rows of its gradient that is nonzero (none: all).
    pub density: Vec<f64>,
}

const TABLE: usize = 1 << 16;

pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Synth {
    /// The table for `seed`: values in [-0.01, 0.01).
    pub fn new(seed: u64) -> Self {
        let table = (0..TABLE as u64)
            .map(|i| ((mix(seed ^ (i << 1)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02)
            .collect();
        Synth {
            table,
            seed,
            density: Vec::new(),
        }
    }
    fn fill(&self, out: &mut [f32], key: u64) {
        let off = (mix(self.seed ^ key) as usize) & (TABLE - 1);
        let mut i = 0;
        while i < out.len() {
            let start = (off + i) & (TABLE - 1);
            let n = (TABLE - start).min(out.len() - i);
            out[i..i + n].copy_from_slice(&self.table[start..start + n]);
            i += n;
        }
    }
    fn key(wi: usize, iter: u64, layer: u32, salt: u64) -> u64 {
        (wi as u64) << 48 ^ iter << 24 ^ u64::from(layer) << 4 ^ salt
    }
    /// Initial parameters of `layer`.
    pub fn init(&self, layer: u32, out: &mut [f32]) {
        self.fill(out, Self::key(0, u64::MAX >> 24, layer, 1));
    }
    /// Worker `wi`'s gradient of a conv/other layer at `iter`.
    pub fn grad(&self, wi: usize, iter: u64, layer: u32, out: &mut [f32]) {
        self.fill(out, Self::key(wi, iter, layer, 2));
        let d = self.density.get(layer as usize).copied().unwrap_or(1.0);
        if d < 1.0 {
            let key = self.seed ^ Self::key(wi, iter, layer, 5);
            for (r, row) in out.chunks_mut(64).enumerate() {
                if ((mix(key ^ ((r as u64) << 8)) >> 11) as f64 / (1u64 << 53) as f64) >= d {
                    row.fill(0.0);
                }
            }
        }
    }
    /// Worker `wi`'s sufficient factors of an FC layer at `iter`.
    pub fn factors(&self, wi: usize, iter: u64, layer: u32, u: &mut [f32], v: &mut [f32]) {
        self.fill(u, Self::key(wi, iter, layer, 3));
        self.fill(v, Self::key(wi, iter, layer, 4));
    }
}

/// SHA-256 of a layer's values.
pub fn digest(v: &[f32]) -> String {
    let mut h = Sha256::new();
    let mut bytes = Vec::with_capacity(16 << 12);
    for block in v.chunks(16 << 10) {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|x| x.to_le_bytes()));
        h.update(&bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// One iteration as a worker saw it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IterStat {
    /// Iteration index.
    pub iter: u64,
    /// Wall time from this iteration's forward pass to the next one's (the
    /// last iteration ends when every layer is synced).
    pub seconds: f64,
    /// Time this iteration's forward pass blocked waiting for parameters.
    pub blocked_s: f64,
    /// Wall time from this iteration's first hand-in to its last layer synced.
    pub sync_span_s: f64,
    /// Of that span, the time the worker waited (in the next forward pass, or the final wait).
    pub exposed_s: f64,
    /// Unix time when this iteration's forward pass had every parameter it waited for.
    pub forward_done_unix: f64,
    /// Unix time just before the last hand-in of this iteration.
    pub backward_done_unix: f64,
}

/// What one rank reports when it finishes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeResult {
    /// Rank.
    pub rank: u32,
    /// Whether it ran a worker.
    pub worker: bool,
    /// Per iteration (workers).
    pub iters: Vec<IterStat>,
    /// SHA-256 of each layer's final parameters (workers).
    pub digests: Vec<String>,
    /// Session counters.
    pub stats: SessionStats,
    /// The transport this rank used and why ("tcp: ..." or "rdma: ...").
    #[serde(default)]
    pub transport: String,
    /// (node, local rank) of a local learner that is not a rank (`--local-learners`).
    #[serde(default)]
    pub local: Option<(u32, u32)>,
    /// Bytes the transport sent before the first iteration (rendezvous, keys,
    /// seeding the servers' shards).
    #[serde(default)]
    pub setup_tx_bytes: u64,
    /// Bytes received before the first iteration.
    #[serde(default)]
    pub setup_rx_bytes: u64,
    /// Exchanges and T per iteration, with a communication frequency (workers).
    #[serde(default)]
    pub comm: Option<comm::CommSummary>,
    /// What this rank's checkpoints cost (--checkpoint-dir).
    #[serde(default)]
    pub checkpoint: Option<tidewire::checkpoint::CheckpointStats>,
    /// The iteration boundary a worker removed as a straggler left at
    /// (--remove-stragglers); its process ends without the goodbye.
    #[serde(default)]
    pub removed_at: Option<u64>,
}

/// A replacement worker's iterations (`TIDEWIRE_REPLACEMENT_ITERS`, set by
/// the launcher with --replace-stragglers): it runs the last this many.
fn replacement_iters() -> Option<u64> {
    std::env::var("TIDEWIRE_REPLACEMENT_ITERS").ok()?.trim().parse().ok()
}

/// Set when the launcher removes this worker (`leave` on its stdin, with
/// --remove-stragglers); the training loop leaves at the next iteration boundary.
fn leave_signal(args: &TrainArgs) -> Arc<std::sync::atomic::AtomicBool> {
    if args.remove_stragglers.is_some() || resilience::held() {
        resilience::launcher_line().leave.clone()
    } else {
        Arc::new(std::sync::atomic::AtomicBool::new(false))
    }
}

pub(crate) fn sleep(d: Duration) {
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}

/// Runs one rank of `tidewire train` with the cluster from the environment.
/// Progress goes to stdout as `progress <iter>` lines, the result as one JSON line.
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
    let s2 = synth.clone();
    let comm = args.comm.active();
    let mut builder = Builder::new(args.comm.layers(&model, args.world().0));
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
    let session = builder
        .batch(args.batch(&model) * args.learners())
        .chunk_bytes(args.book_config(&model).chunk_bytes)
        .slice_params(args.book_config(&model).slice_params)
        .placement(args.book_config(&model).placement)
        .policy(if comm {
            tidewire_engine::SchemePolicy::Ps
        } else {
            args.sync_mode().policy()
        })
        .sched(args.sched())
        .apply(args.comm.server_op(args.apply_op()?))
        .comm(args.comm.config(args.iters)?)
        .aggregation(args.aggregate)
        .transport_limits(args.limits())
        .transport(args.transport_kind(spec.rank)?)
        .timeout(Duration::from_secs(args.timeout_s))
        .connect_timeout(Duration::from_secs(args.timeout_s))
        .init_params(move |l, p| s2.init(l, p))
        .build(spec)?;
    if session.role().is_worker() && comm {
        comm::worker_loop(args, &model, &synth, session, true)
    } else if session.role().is_worker() {
        let group = match LocalEnv::from_env()? {
            Some(local) => Some(
                tidewire::local::LocalGroup::create(
                    &local.path,
                    local.nonce,
                    &local_layout(args, &model),
                    Duration::from_secs(args.timeout_s),
                )
                .map_err(|e| Error::Launch(e.to_string()))?,
            ),
            None => None,
        };
        let r = worker_loop(
            args,
            &model,
            &synth,
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
    } else {
        let rank = session.rank();
        let (kind, why) = session.transport();
        let mut session = session;
        session.shutdown()?;
        // A server-only rank serves the whole job inside shutdown: its counters are there after.
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
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct LoopOpts<'a> {
    /// Print `progress <iter>` lines for the launcher.
    progress: bool,
    /// Form FC gradients Uᵀ·V in the trainer and hand them in with
    /// `grad_ready` (a framework that does not use sufficient factors).
    fc_as_gradients: bool,
    /// This worker leads a node's local learners (`--local-learners`).
    group: Option<&'a tidewire::local::LocalGroup>,
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
    tidewire::local::LocalLayout::new(args.local_learners, params, slots)
}

/// A local learner (local rank ≥ 1): the same compute and synthetic data as a
/// worker, with gradients handed to the node's leader through shared memory
/// and parameters read from its cache. Reports its final digests.
fn run_learner(args: &TrainArgs, model: &Model, local: &LocalEnv) -> Result<NodeResult> {
    let synth = args.synth(model);
    let layout = local_layout(args, model);
    let timeout = Duration::from_secs(args.timeout_s);
    let me = tidewire::local::LocalLearner::attach(&local.path, local.nonce, &layout, local.index, timeout)
        .map_err(|e| Error::Launch(e.to_string()))?;
    let k = args.batch(model);
    let global = local.node * args.local_learners + local.index;
    let times = model.layer_times(k, args.time_scale);
    let nl = model.layers.len();
    // The leader's book, for the scheme of each FC layer: factors go to the
    // leader for SFB; for the PS this learner forms its own gradient Uᵀ·V.
    let (p1, p2, _) = args.world();
    let cluster = if args.colocate {
        Cluster::colocated(p1)?
    } else {
        Cluster::split(p1, p2)?
    };
    let book = args.book(model, cluster)?;
    let mut params: Vec<Vec<f32>> = model.layers.iter().map(|l| vec![0f32; l.params()]).collect();
    let mut grad: Vec<Vec<f32>> = model.layers.iter().map(|l| vec![0f32; l.params()]).collect();
    let mut stats = Vec::new();
    let mut out = std::io::stdout();
    let mut prev: Option<Instant> = None;
    for it in 0..args.iters {
        let start = Instant::now();
        let mut blocked = Duration::ZERO;
        for l in 0..nl {
            let t = Instant::now();
            me.params(l, it.saturating_sub(args.cache_staleness), &mut params[l])?;
            blocked += t.elapsed();
            sleep(times[l].0);
        }
        if let (Some(p), Some(last)) = (prev, stats.last_mut()) {
            let last: &mut IterStat = last;
            last.seconds = (start - p).as_secs_f64();
        }
        prev = Some(start);
        let forward_done_unix = unix_now();
        for l in (0..nl).rev() {
            sleep(times[l].1);
            let spec = &model.layers[l];
            if spec.kind == LayerKind::Fc {
                let (mut u, mut v) = (vec![0f32; k * spec.m], vec![0f32; k * spec.n]);
                synth.factors(global, it, l as u32, &mut u, &mut v);
                if book.scheme(l as u32, it).takes_factors() {
                    me.hand_in(l, it, &[&u, &v])?;
                } else {
                    cpu::sf_rows(&u, &v, k, spec.m, spec.n, 0, &mut grad[l]);
                    me.hand_in(l, it, &[&grad[l]])?;
                }
            } else {
                synth.grad(global, it, l as u32, &mut grad[l]);
                me.hand_in(l, it, &[&grad[l]])?;
            }
        }
        stats.push(IterStat {
            iter: it,
            seconds: 0.0,
            blocked_s: blocked.as_secs_f64(),
            sync_span_s: 0.0,
            exposed_s: 0.0,
            forward_done_unix,
            backward_done_unix: unix_now(),
        });
        let _ = writeln!(out, "progress {}", it + 1);
        let _ = out.flush();
    }
    for (l, p) in params.iter_mut().enumerate() {
        me.params(l, args.iters, p)?;
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
    })
}

fn worker_loop(
    args: &TrainArgs,
    model: &Model,
    synth: &Synth,
    mut session: Session,
    opts: LoopOpts,
) -> Result<NodeResult> {
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
    let times = model.layer_times(k, args.time_scale * slow);
    let wait_free = args.sync_mode().wait_free();
    let nl = book.layers().len();
    let mut layers = session.take_layers()?;
    // A resumed run goes on from its checkpoint, which must be of this run.
    // A replacement joins a running job: it does the last iterations only.
    let start = match replacement_iters() {
        Some(n) => args.iters.saturating_sub(n.max(1)),
        None => session.start_iteration(),
    };
    let trainer_state = |iteration| TrainerState {
        iteration,
        model: model.name.to_string(),
        seed: args.seed,
        batch: k,
        workers: args.workers,
    };
    if let Some(blob) = session.framework_state() {
        let saved: TrainerState = serde_json::from_slice(blob)
            .map_err(|e| Error::Usage(format!("the checkpoint's trainer state is damaged: {e}")))?;
        saved.check(&trainer_state(start))?;
    }
    // Worker 0 saves the trainer's state with every checkpoint.
    let save_state = |session: &Session, it: u64| -> Result<()> {
        if wi == 0 && args.ckpt.active() && it > start && it % args.ckpt.checkpoint_every == 0 {
            let blob = serde_json::to_vec(&trainer_state(it)).expect("serializable");
            session.save_framework_state(it, blob)?;
        }
        Ok(())
    };
    // Set-up traffic (rendezvous, keys, the servers' seeding), before any
    // iteration: reported apart from the training traffic.
    let setup = session.stats()?;
    let mut stats: Vec<IterStat> = Vec::new();
    let mut starts: Vec<Instant> = Vec::new();
    let mut first_hand_in = None;
    let mut out = std::io::stdout();
    let leave = leave_signal(args);
    for it in start..args.iters {
        if it > start && leave.load(Ordering::Relaxed) {
            // Removed as a straggler: leave at this iteration boundary, once
            // every push is in (a worker lost with half a contribution in would
            // fail the round), without a goodbye: the process ends, its
            // connections close, and the servers stop counting it.
            let all = session.wait_all()?;
            let mut r = worker_result(&session, &all, stats, &setup)?;
            r.removed_at = Some(it);
            drop(all);
            std::mem::forget(session);
            return Ok(r);
        }
        save_state(&session, it)?;
        let began = Instant::now();
        let mut last_sync: Option<Instant> = None;
        let mut blocked = Duration::ZERO;
        for l in 0..nl {
            if it > start {
                let t = Instant::now();
                let b = session.wait_layer(l as u32)?;
                blocked += t.elapsed();
                last_sync = last_sync.max(b.synced_at());
                layers[l] = Some(b);
            }
            if let Some(g) = opts.group {
                // The fan-out: once per node, into the learners' cache.
                g.publish(l, it, layers[l].as_ref().expect("held by the trainer").params())?;
            }
            sleep(times[l].0);
        }
        let forward_done_unix = unix_now();
        if let Some(prev) = stats.last_mut() {
            // The waits of this forward pass expose the previous iteration's sync.
            prev.exposed_s = blocked.as_secs_f64();
            prev.sync_span_s = span(first_hand_in, last_sync);
            prev.seconds = (began - starts[starts.len() - 1]).as_secs_f64();
            if opts.progress {
                let _ = writeln!(out, "progress {it}");
                let _ = out.flush();
            }
        }
        starts.push(began);
        first_hand_in = None;
        let mut deferred = Vec::new();
        let mut backward_done_unix = 0.0;
        for l in (0..nl).rev() {
            sleep(times[l].1);
            let mut buf = layers[l].take().expect("held by the trainer");
            let spec = &book.layers()[l];
            if let Some(g) = opts.group {
                // Learner 0 of node `wi`: its own gradient first, then the
                // node's other learners in local-rank order; one hand-in.
                let global = wi * args.local_learners;
                let (km, kn) = (k * spec.m, k * spec.n);
                let as_factors = spec.kind == LayerKind::Fc && book.scheme(l as u32, it).takes_factors();
                if as_factors {
                    let (u, v) = buf.uv_mut();
                    synth.factors(global, it, l as u32, &mut u[..km], &mut v[..kn]);
                    g.stack_into(l, it, &mut [u, v])?;
                } else if spec.kind == LayerKind::Fc {
                    // Through the PS: every learner forms its own Uᵀ·V (as a
                    // flat run's Nodes do, one per worker); they are summed in order.
                    let (mut u, mut v) = (vec![0f32; km], vec![0f32; kn]);
                    synth.factors(global, it, l as u32, &mut u, &mut v);
                    cpu::sf_rows(&u, &v, k, spec.m, spec.n, 0, buf.grad_mut());
                    g.sum_into(l, it, buf.grad_mut())?;
                } else {
                    synth.grad(global, it, l as u32, buf.grad_mut());
                    g.sum_into(l, it, buf.grad_mut())?;
                }
                if wait_free {
                    first_hand_in.get_or_insert_with(Instant::now);
                    if l == 0 {
                        backward_done_unix = unix_now();
                    }
                    hand_in(&session, buf, !as_factors)?;
                } else {
                    deferred.push((buf, !as_factors));
                }
                continue;
            }
            if spec.kind == LayerKind::Fc && opts.fc_as_gradients {
                let (mut u, mut v) = (vec![0f32; k * spec.m], vec![0f32; k * spec.n]);
                synth.factors(wi, it, l as u32, &mut u, &mut v);
                cpu::sf_rows(&u, &v, k, spec.m, spec.n, 0, buf.grad_mut());
            } else if spec.kind == LayerKind::Fc {
                let (u, v) = buf.uv_mut();
                synth.factors(wi, it, l as u32, u, v);
            } else {
                synth.grad(wi, it, l as u32, buf.grad_mut());
            }
            if wait_free {
                first_hand_in.get_or_insert_with(Instant::now);
                if l == 0 {
                    backward_done_unix = unix_now();
                }
                hand_in(&session, buf, opts.fc_as_gradients)?;
            } else {
                deferred.push((buf, opts.fc_as_gradients));
            }
        }
        let last = deferred.len().saturating_sub(1);
        for (i, (buf, as_grad)) in deferred.into_iter().enumerate() {
            first_hand_in.get_or_insert_with(Instant::now);
            if i == last {
                backward_done_unix = unix_now();
            }
            hand_in(&session, buf, as_grad)?;
        }
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
    let t = Instant::now();
    let all = session.wait_all()?;
    save_state(&session, args.iters)?;
    let end = Instant::now();
    let Some(last) = stats.last_mut() else {
        return Err(Error::Usage(format!(
            "the checkpoint resumed is of iteration {start}: nothing is left of --iters {}",
            args.iters
        )));
    };
    last.exposed_s = (end - t).as_secs_f64();
    last.sync_span_s = span(first_hand_in, all.iter().filter_map(|b| b.synced_at()).max());
    last.seconds = (end - starts[starts.len() - 1]).as_secs_f64();
    if opts.progress {
        let _ = writeln!(out, "progress {}", args.iters);
        let _ = out.flush();
    }
    if let Some(g) = opts.group {
        for (l, b) in all.iter().enumerate() {
            g.publish(l, args.iters, b.params())?;
        }
    }
    let mut r = worker_result(&session, &all, stats, &setup)?;
    drop(all);
    session.shutdown()?;
    // After shutdown: the last checkpoint's writes are in.
    r.checkpoint = session.checkpoint_stats();
    Ok(r)
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
        let s2 = args.synth(&model);
        let spec = ClusterSpec::new(0, 1, 0, true, "127.0.0.1:1".parse().expect("literal"))?;
        let session = Builder::new(model.layers.clone())
            .batch(args.batch(&model))
            .chunk_bytes(args.book_config(&model).chunk_bytes)
            .slice_params(args.book_config(&model).slice_params)
            .policy(tidewire_engine::SchemePolicy::Ps)
            .sched(args.sched())
            .apply(args.apply_op()?)
            .job(1, tidewire_transport::JobSecret::new(b"single".to_vec()))
            .timeout(Duration::from_secs(args.timeout_s))
            .init_params(move |l, p| s2.init(l, p))
            .build(spec)?;
        let r = worker_loop(
            args,
            &model,
            &synth,
            session,
            LoopOpts {
                progress: false,
                fc_as_gradients: true,
                group: None,
            },
        )?;
        return Ok(r.iters);
    }
    let k = args.batch(&model);
    let op = args.apply_op()?;
    let times = model.layer_times(k, args.time_scale);
    let mut params: Vec<Vec<f32>> = model
        .layers
        .iter()
        .enumerate()
        .map(|(l, s)| {
            let mut p = vec![0f32; s.params()];
            synth.init(l as u32, &mut p);
            p
        })
        .collect();
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
    for it in 0..args.iters {
        let start = Instant::now();
        if let (Some(p), Some(last)) = (prev, stats.last_mut()) {
            let last: &mut IterStat = last;
            last.seconds = (start - p).as_secs_f64();
        }
        prev = Some(start);
        for t in &times {
            sleep(t.0);
        }
        for l in (0..model.layers.len()).rev() {
            sleep(times[l].1);
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
    let lrn = args.local_learners.max(1);
    let nodes = args.workers;
    let mut out = Vec::new();
    let max = model.layers.iter().map(|l| l.params()).max().unwrap_or(0);
    let (mut acc, mut part, mut g) = (vec![0f32; max], vec![0f32; max], vec![0f32; max]);
    for (li, spec) in model.layers.iter().enumerate() {
        let n = spec.params();
        let mut w = vec![0f32; n];
        synth.init(li as u32, &mut w);
        let mut mom = if op.needs_momentum() { vec![0f32; n] } else { Vec::new() };
        let (mut u, mut v) = (vec![0f32; lrn * k * spec.m], vec![0f32; lrn * k * spec.n]);
        let (km, kn) = (k * spec.m, k * spec.n);
        for it in 0..args.iters {
            let sfb = spec.kind == LayerKind::Fc && book.scheme(li as u32, it) == Scheme::Sfb;
            // One learner's gradient (global learner index `gi`).
            let mut grad_of = |gi: usize, dst: &mut [f32]| {
                if spec.kind == LayerKind::Fc {
                    synth.factors(gi, it, li as u32, &mut u[..km], &mut v[..kn]);
                    cpu::sf_rows(&u[..km], &v[..kn], k, spec.m, spec.n, 0, dst);
                } else {
                    synth.grad(gi, it, li as u32, dst);
                }
            };
            // Adam's server sums every worker rank's factors in rank order,
            // with no fold groups (a flat run's learners are worker ranks).
            let adam = spec.kind == LayerKind::Fc && book.scheme(li as u32, it) == Scheme::Adam;
            if (sfb || adam) && (args.flat || lrn == 1) {
                for gi in 0..nodes * lrn {
                    if gi == 0 {
                        grad_of(gi, &mut acc[..n]);
                    } else {
                        grad_of(gi, &mut g[..n]);
                        cpu::add_assign(&mut acc[..n], &g[..n]);
                    }
                }
            } else if sfb || adam {
                // A node's learners' factors, stacked (K·learners rows): one
                // hand-in, summed per node in node order.
                for node in 0..nodes {
                    for j in 0..lrn {
                        let gi = node * lrn + j;
                        synth.factors(
                            gi,
                            it,
                            li as u32,
                            &mut u[j * km..(j + 1) * km],
                            &mut v[j * kn..(j + 1) * kn],
                        );
                    }
                    let dst = if node == 0 { &mut acc[..n] } else { &mut g[..n] };
                    cpu::sf_rows(&u, &v, lrn * k, spec.m, spec.n, 0, dst);
                    if node > 0 {
                        cpu::add_assign(&mut acc[..n], &g[..n]);
                    }
                }
            } else {
                for node in 0..nodes {
                    let dst = if node == 0 { &mut acc[..n] } else { &mut part[..n] };
                    grad_of(node * lrn, dst);
                    for j in 1..lrn {
                        grad_of(node * lrn + j, &mut g[..n]);
                        cpu::add_assign(dst, &g[..n]);
                    }
                    if node > 0 {
                        cpu::add_assign(&mut acc[..n], &part[..n]);
                    }
                }
            }
            cpu::apply(op, nodes * lrn, &acc[..n], &mut w, &mut mom);
        }
        out.push(digest(&w));
    }
    Ok(out)
}

/// The sparse-push counters of a `tidewire train` run, over all workers.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct SparseSummary {
    /// Slices sent as index/value pairs.
    pub pushes: u64,
    /// Slices of sparse layers sent dense.
    pub dense_pushes: u64,
    /// Nonzeros of the slices sent as pairs.
    pub nonzeros: u64,
    /// Elements of the slices sent as pairs.
    pub elements: u64,
    /// Bytes sent as pairs.
    pub bytes: u64,
    /// Bytes of sparse layers sent dense.
    pub dense_bytes: u64,
}

/// The launcher's summary.
#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    /// Model.
    pub model: String,
    /// --trigger.
    #[serde(default)]
    pub trigger: String,
    /// Workers removed as stragglers (--remove-stragglers).
    #[serde(default)]
    pub removed: Vec<resilience::Removed>,
    /// Each worker's mean iteration, seconds, by rank (a straggler's own pace
    /// apart from the others' under the quorum, timeout and async triggers).
    #[serde(default)]
    pub worker_iteration_s: Vec<f64>,
    /// Over the servers: late contributions dropped, folded into the next
    /// round, and rounds applied without every worker's contribution.
    #[serde(default)]
    pub dropped: u64,
    #[serde(default)]
    pub late_folded: u64,
    #[serde(default)]
    pub partial_applies: u64,
    /// What the last attempt's checkpoints cost (--checkpoint-dir).
    #[serde(default)]
    pub checkpoint: Option<resilience::CheckpointSummary>,
    /// Rollbacks: every attempt that lost a rank, and where the next one resumed
    /// (--checkpoint-dir). The iteration figures are the last attempt's.
    #[serde(default)]
    pub restarts: Vec<Restart>,
    /// The iteration the last attempt resumed from (--resume, or a rollback).
    #[serde(default)]
    pub resumed_from: Option<u64>,
    /// Every WARN or ERROR line the ranks logged (a healthy run has none), as `rank N: line`.
    pub log_warnings: Vec<String>,
    /// Where the servers' sums ran (Nexus's CPU/GPU scheduler), over all ranks.
    pub aggregation: AggregationShare,
    /// The slice size, parameters (`--slice-params`, or from the rates).
    pub slice_params: usize,
    /// Most requests any rank had in flight to one peer (within the transport's bound).
    pub max_outstanding: u64,
    /// Largest message any rank sent, bytes (within the transport's cap).
    pub max_message_bytes: u64,
    /// Transmits the transports refused for now and the engine retried, over all ranks.
    pub would_block: u64,
    /// Peers' factor bytes the SF reconstructions read in place, in the buffers
    /// the transports received them in, over all ranks.
    pub factor_bytes_in_place: u64,
    /// Peers' factor bytes decoded into scratch first (U or V over the message
    /// cap, so split over messages), over all ranks. 0 when every U and V fits a message.
    pub factor_bytes_decoded: u64,
    /// Learners per worker node (`--local-learners`), and whether each was a
    /// rank of its own (`--flat`) rather than behind a local aggregator.
    pub local_learners: usize,
    /// See `local_learners`.
    pub flat: bool,
    /// Per worker node: payload bytes its NIC sent and received while training
    /// (the transports' counters, summed over the node's ranks: one with local
    /// aggregation, L with --flat; a colocated node's server traffic included;
    /// the set-up before the first iteration, such as seeding, not counted).
    pub node_tx_bytes: Vec<u64>,
    /// See `node_tx_bytes`.
    pub node_rx_bytes: Vec<u64>,
    /// The --sparse-layers' pushes over all workers: slices sent as pairs and
    /// dense, the nonzeros and elements of those sent as pairs, and the bytes of each form.
    pub sparse: SparseSummary,
    /// Sync mode.
    pub sync: String,
    /// Consistency.
    pub consistency: String,
    /// P1.
    pub workers: usize,
    /// P2.
    pub servers: usize,
    /// Colocated nodes.
    pub colocate: bool,
    /// Batch per worker.
    pub batch: usize,
    /// Iterations.
    pub iters: u64,
    /// Compute time scale.
    pub time_scale: f64,
    /// Calibrated compute per iteration (scaled), s.
    pub compute_s: f64,
    /// From the start of iteration 0 to the end of the last sync, divided by
    /// the iterations (as `tidewire sim` measures it), s.
    pub iteration_s: f64,
    /// P1 × K / iteration_s.
    pub throughput_samples_s: f64,
    /// Share of each iteration's sync span that the workers did not wait for
    /// (mean over iterations after the first).
    pub hidden_fraction: f64,
    /// Per-iteration figures of the slowest worker.
    pub per_iteration: Vec<IterStat>,
    /// Every worker's per-iteration figures, by worker rank.
    pub workers_detail: Vec<Vec<IterStat>>,
    /// The scheme of every layer (fixed for the run).
    pub layers: Vec<LayerRow>,
    /// The rates HybComm decided with (`--cost-model seconds`), per rank.
    #[serde(default)]
    pub rates: Option<tidewire_engine::cost::Rates>,
    /// `Some(true)` when every worker's parameters equal the reference bit for bit.
    pub verified: Option<bool>,
    /// Layers that differ (name), when verification failed.
    pub mismatched_layers: Vec<String>,
    /// SHA-256 of every layer's final parameters on worker rank 0, to compare
    /// runs (a flat run and a local-aggregation one give the same, for
    /// example).
    pub digests: Vec<String>,
    /// Wall time of the whole run, s.
    pub wall_s: f64,
    /// The transports the ranks used, each with the reason (distinct lines; with
    /// the ranks that use each when they differ, as with `--transport mixed`).
    pub transport: Vec<String>,
    /// With a communication frequency: the first worker's exchanges, T per iteration and decisions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm: Option<comm::CommSummary>,
}

/// Where the servers' sums ran: bytes and chunks on the CPU and the GPU
/// (`--aggregate`). Rebuilding a gradient from sufficient factors runs on
/// the CPU: the runtime has no GPU path for it yet.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AggregationShare {
    /// Contribution bytes summed on the CPU.
    pub cpu_bytes: u64,
    /// Contribution bytes summed on the GPU.
    pub gpu_bytes: u64,
    /// Chunks the scheduler placed on the CPU.
    pub cpu_chunks: u64,
    /// Chunks the scheduler placed on the GPU.
    pub gpu_chunks: u64,
}

/// One row of the scheme table.
#[derive(Debug, Clone, Serialize)]
pub struct LayerRow {
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: LayerKind,
    /// M×N.
    pub shape: (usize, usize),
    /// Scheme.
    pub scheme: Scheme,
    /// Seconds the PS and SFB would cost the busiest node for this FC layer
    /// at the agreed rates (`--cost-model seconds`), as HybComm weighed them.
    #[serde(default)]
    pub cost_s: Option<(f64, f64)>,
}

fn free_port() -> Result<u16> {
    let no_port = |e: std::io::Error| Error::Launch(format!("no free rendezvous port on 127.0.0.1: {e}"));
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(no_port)?;
    Ok(l.local_addr().map_err(no_port)?.port())
}

fn secret() -> String {
    let mut b = [0u8; 16];
    if getrandom::getrandom(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        b = (t.as_nanos() ^ u128::from(std::process::id())).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The environment of node `node`'s local learners: the shared file (in
/// /dev/shm where it exists) and this run's nonce.
fn local_env(c: &mut Command, node: usize, secret: &str) {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let nonce = u64::from_str_radix(&secret[..16.min(secret.len())], 16).unwrap_or(1);
    c.env("TIDEWIRE_LOCAL_NODE", node.to_string())
        .env(
            "TIDEWIRE_LOCAL_PATH",
            dir.join(format!("tidewire-train-{}-{node}", &secret[..12.min(secret.len())])),
        )
        .env("TIDEWIRE_LOCAL_NONCE", nonce.to_string());
}

/// Launches the local cluster, follows it, verifies, and reports. With
/// --checkpoint-dir, a run attempt that loses a rank is rolled back: every
/// rank starts again from the newest complete checkpoint ([`resilience`]).
pub fn launch(args: &TrainArgs, node_args: Vec<String>) -> Result<TrainReport> {
    args.validate()?;
    args.ckpt.check_dirs(args.iters)?;
    let mut base_args = resilience::without_resume(&node_args);
    let mut args = args.clone();
    if let Some(r) = measured_rates(&args)? {
        let json = serde_json::to_string(&r).map_err(|e| Error::Launch(format!("rates: {e}")))?;
        base_args.push("--rates".into());
        base_args.push(json.clone());
        args.rates = Some(json);
        if args.slice_params.is_none() && args.sync_mode().sliced() {
            let p = tidewire_engine::cost::slice_params_for(&r);
            base_args.push("--slice-params".into());
            base_args.push(p.to_string());
            args.slice_params = Some(p);
        }
    }
    let args = &args;
    let mut kills: std::collections::VecDeque<resilience::Kill> = args.ckpt.fault_kill.iter().copied().collect();
    let mut restarts: Vec<Restart> = Vec::new();
    let mut resume: Option<std::path::PathBuf> = match &args.ckpt.resume {
        // Every rank resumes the same step: resolve a checkpoint directory to its newest one here.
        Some(r) if !r.join("manifest.json").is_file() => Some(
            tidewire::checkpoint::Loaded::newest_complete(r)
                .map_err(|e| Error::Launch(e.to_string()))?
                .ok_or_else(|| Error::Launch(format!("--resume {}: no complete checkpoint there", r.display())))?,
        ),
        r => r.clone(),
    };
    loop {
        let mut attempt_args = base_args.clone();
        if let Some(r) = &resume {
            attempt_args.push("--resume".into());
            attempt_args.push(r.display().to_string());
        }
        let mut attempt_opts = args.clone();
        attempt_opts.ckpt.resume = resume.clone();
        match launch_attempt(&attempt_opts, attempt_args, &mut kills)? {
            Attempt::Done(mut r) => {
                r.restarts = restarts;
                r.resumed_from = resume.as_deref().map(resilience::step_iteration);
                return Ok(*r);
            }
            Attempt::Failed {
                cause,
                progressed,
                failed_at,
            } => {
                let tried = if restarts.is_empty() {
                    String::new()
                } else {
                    format!(" (after {} rollback(s))", restarts.len())
                };
                let Some(dir) = &args.ckpt.checkpoint_dir else {
                    return Err(Error::Launch(format!("the local cluster failed: {cause}")));
                };
                if !progressed {
                    return Err(Error::Launch(format!(
                        "the local cluster failed before its first iteration{tried}, so it is not rolled back: {cause}"
                    )));
                }
                if restarts.len() as u32 >= args.ckpt.max_restarts {
                    return Err(Error::Launch(format!(
                        "the local cluster failed{tried}, and --max-restarts {} is spent: {cause}",
                        args.ckpt.max_restarts
                    )));
                }
                resume = resilience::rollback_point(dir, resume.as_deref())?;
                let from = resume.as_deref().map_or(0, resilience::step_iteration);
                if from >= args.iters {
                    return Err(Error::Launch(format!(
                        "the local cluster failed after its last checkpoint (iteration {from} of {}): the \
                         parameters are in {}; nothing is left to run: {cause}",
                        args.iters,
                        dir.display()
                    )));
                }
                if !args.json {
                    eprintln!(
                        "tidewire: a rank was lost ({}); rolling back to iteration {from} and restarting every rank",
                        cause.lines().next().unwrap_or("")
                    );
                }
                restarts.push(Restart {
                    cause,
                    resumed_from: from,
                    checkpoint: resume.as_ref().map(|p| p.display().to_string()),
                    recovery_s: failed_at.elapsed().as_secs_f64(),
                });
            }
        }
    }
}

/// The rates every rank of this launch decides HybComm (and the default
/// slice size) with: `None` where nothing is decided from them
/// (`--cost-model bytes`, a mode with neither HybComm nor slices, or
/// `--rates` given). Otherwise this machine's profile (measured
/// now, or `--profile`), shared by every rank process on it; under the
/// bandwidth harness each rank's link is the shaped one, measured between
/// the first two namespaces.
fn measured_rates(args: &TrainArgs) -> Result<Option<tidewire_engine::cost::Rates>> {
    if args.cost_model == "bytes"
        || args.rates.is_some()
        || args.comm.active()
        || (args.sync_mode().policy() != tidewire_engine::SchemePolicy::Hybrid && !args.sync_mode().sliced())
    {
        return Ok(None);
    }
    let profile = match &args.profile {
        Some(p) => tidewire::calibrate::Profile::load(p).map_err(|e| Error::Usage(format!("--profile: {e}")))?,
        None => tidewire::calibrate::measure(Duration::from_millis(150))
            .map_err(|e| Error::Launch(format!("measuring this machine's rates: {e}")))?,
    };
    let (_, _, world) = args.world();
    let procs = world + args.workers * args.local_learners.saturating_sub(1) * usize::from(!args.flat);
    let link = match (&args.netns, &args.netns_addrs) {
        (Some(ns), Some(addrs)) => Some(netns_link_rate(&split_list(ns), &split_list(addrs))?),
        _ => None,
    };
    Ok(Some(profile.node_rates(procs, link)))
}

/// One TCP stream's rate from the first namespace to the second (a probe
/// of about half a second through the shaped links), or the loopback's
/// where there is one namespace.
fn netns_link_rate(ns: &[String], addrs: &[String]) -> Result<f64> {
    if ns.len() < 2 || addrs.len() < 2 {
        return Ok(f64::MAX);
    }
    let exe = std::env::current_exe().map_err(|e| Error::Launch(format!("cannot find my own binary: {e}")))?;
    let target = format!("{}:29499", addrs[1]);
    let mut server = Command::new("ip")
        .args(["netns", "exec", &ns[1]])
        .arg(&exe)
        .args(["calibrate", "--serve-stream", &target])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Launch(format!("link probe: ip netns exec {}: {e}", ns[1])))?;
    let out = Command::new("ip")
        .args(["netns", "exec", &ns[0]])
        .arg(&exe)
        .args(["calibrate", "--probe-stream", &target])
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let out = out.map_err(|e| Error::Launch(format!("link probe: ip netns exec {}: {e}", ns[0])))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| out.status.success() && v.is_finite() && *v > 0.0)
        .ok_or_else(|| {
            Error::Launch(format!(
                "link probe from {} to {target} failed: {} {}",
                ns[0],
                text.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        })
}

/// How one run attempt of the local cluster ended.
enum Attempt {
    Done(Box<TrainReport>),
    /// A rank was lost or failed: the launcher may roll back.
    Failed {
        cause: String,
        progressed: bool,
        failed_at: Instant,
    },
}

/// One attempt: starts every rank, follows them (injecting the next
/// `--fault-kill` when its iteration comes), and reports.
fn launch_attempt(
    args: &TrainArgs,
    node_args: Vec<String>,
    kills: &mut std::collections::VecDeque<resilience::Kill>,
) -> Result<Attempt> {
    let model = args.model()?;
    let (p1, p2, world) = args.world();
    let began = Instant::now();
    let exe = std::env::current_exe().map_err(|e| Error::Launch(format!("cannot find my own binary: {e}")))?;
    let secret = secret();
    // Under the bandwidth harness each rank runs in a namespace of its own (round robin),
    // and rank 0's namespace address is the rendezvous; a fresh namespace has every port free.
    let netns = match (&args.netns, &args.netns_addrs) {
        (Some(ns), Some(a)) => Some((split_list(ns), split_list(a))),
        _ => None,
    };
    let master = match &netns {
        Some((_, addrs)) => format!("{}:29500", addrs[0]),
        None => format!("127.0.0.1:{}", free_port()?),
    };
    let mut children: Vec<(u32, Child)> = Vec::new();
    // A rank's process (a replacement's too): its namespace under the
    // bandwidth harness, its place in the job, its output piped to us.
    let rank_command = |rank: u32| -> Command {
        let mut c = match &netns {
            Some((ns, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns[rank as usize % ns.len()]]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        c.arg("train-node")
            .args(&node_args)
            .env("TIDEWIRE_RANK", rank.to_string())
            .env("TIDEWIRE_WORLD_SIZE", world.to_string())
            .env("TIDEWIRE_MASTER", &master)
            .env("TIDEWIRE_SECRET", &secret)
            .env("TIDEWIRE_JOB", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if args.colocate {
            c.env_remove("TIDEWIRE_SERVERS");
        } else {
            c.env("TIDEWIRE_SERVERS", p2.to_string());
        }
        c
    };
    let held: std::collections::BTreeSet<u32> = kills.iter().map(|k| k.rank).collect();
    for rank in 0..world as u32 {
        let mut c = rank_command(rank);
        // With --remove-stragglers a worker reads `leave` from its stdin; a
        // --fault-kill's target waits, done, until its stdin closes, so that
        // the kill finds it running however fast the run ends.
        if held.contains(&rank) {
            c.env(resilience::HOLD_ENV, "1");
        }
        c.stdin(
            if (args.remove_stragglers.is_some() && (rank as usize) < p1) || held.contains(&rank) {
                Stdio::piped()
            } else {
                Stdio::null()
            },
        );
        let hier = args.local_learners > 1 && !args.flat;
        if hier && (rank as usize) < p1 {
            c.env("TIDEWIRE_LOCAL_RANK", "0");
            local_env(&mut c, rank as usize, &secret);
        }
        let child = c
            .spawn()
            .map_err(|e| Error::Launch(format!("cannot start rank {rank}: {e}")))?;
        children.push((rank, child));
    }
    // Local learners 1..L of every node: processes that are not ranks. They
    // take "rank" numbers after the ranks' for the launcher's bookkeeping only.
    if args.local_learners > 1 && !args.flat {
        for node in 0..p1 {
            for j in 1..args.local_learners {
                let mut c = match &netns {
                    Some((ns, _)) => {
                        let mut c = Command::new("ip");
                        c.args(["netns", "exec", &ns[node % ns.len()]]).arg(&exe);
                        c
                    }
                    None => Command::new(&exe),
                };
                c.arg("train-node")
                    .args(&node_args)
                    .env("TIDEWIRE_LOCAL_RANK", j.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                local_env(&mut c, node, &secret);
                let id = (world + node * (args.local_learners - 1) + j - 1) as u32;
                let child = c
                    .spawn()
                    .map_err(|e| Error::Launch(format!("cannot start local learner {j} of node {node}: {e}")))?;
                children.push((id, child));
            }
        }
    }
    let ranks = world;
    let world = children.len();
    // Local learners are not ranks: name them by node and local rank.
    let who = |id: u32| -> String {
        let id = id as usize;
        if id < ranks {
            format!("rank {id}")
        } else {
            let per = args.local_learners.saturating_sub(1).max(1);
            format!(
                "local learner {} of node {}",
                (id - ranks) % per + 1,
                (id - ranks) / per
            )
        }
    };
    let bar = indicatif::ProgressBar::new(args.iters);
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} iterations, {elapsed} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("{} {}w/{}s {}", model.name, p1, p2, args.sync));
    // Read every child's output on its own thread; rank 0's progress drives the bar.
    let mut readers = Vec::new();
    // When a worker last reported an iteration (ms since `began`), and the furthest one.
    let last_progress = Arc::new(AtomicU64::new(0));
    let max_iter = Arc::new(AtomicU64::new(0));
    // Each worker's latest iteration (the coordinator's view, for --remove-stragglers).
    let progress: Arc<Vec<AtomicU64>> = Arc::new((0..world).map(|_| AtomicU64::new(0)).collect());
    let mut removal =
        resilience::StragglerWatch::new(args.remove_stragglers, args.straggler_window, p1, args.trigger()?);
    let mut stdins: Vec<(u32, std::process::ChildStdin)> = children
        .iter_mut()
        .filter_map(|(r, c)| Some((*r, c.stdin.take()?)))
        .collect();
    let mut err_readers = Vec::new();
    // Follows a rank's output on two threads: progress and the result on
    // stdout (rank 0's progress drives the bar), warnings and a tail of stderr.
    let follow = |rank: u32,
                  child: &mut Child,
                  readers: &mut Vec<std::thread::JoinHandle<Option<NodeResult>>>,
                  err_readers: &mut Vec<std::thread::JoinHandle<(u32, String, Vec<String>)>>| {
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let bar = bar.clone();
        let last = last_progress.clone();
        let furthest = max_iter.clone();
        let mine = progress.clone();
        readers.push(std::thread::spawn(move || {
            let mut result = None;
            for line in BufReader::new(stdout).lines().map_while(std::result::Result::ok) {
                if line.starts_with("progress ") || line.starts_with("result ") {
                    last.store(began.elapsed().as_millis() as u64, Ordering::Relaxed);
                }
                if let Some(p) = line.strip_prefix("progress ") {
                    furthest.fetch_max(p.trim().parse().unwrap_or(0), Ordering::Relaxed);
                    if let Some(m) = mine.get(rank as usize) {
                        m.fetch_max(p.trim().parse().unwrap_or(0), Ordering::Relaxed);
                    }
                    if rank == 0 {
                        bar.set_position(p.trim().parse().unwrap_or(0));
                    }
                } else if let Some(j) = line.strip_prefix("result ") {
                    result = serde_json::from_str::<NodeResult>(j).ok();
                }
            }
            result
        }));
        err_readers.push(std::thread::spawn(move || {
            let mut tail = String::new();
            let mut warnings = Vec::new();
            for line in BufReader::new(stderr).lines().map_while(std::result::Result::ok) {
                if line.contains("WARN") || line.contains("ERROR") {
                    warnings.push(format!("rank {rank}: {line}"));
                }
                tail.push_str(&line);
                tail.push('\n');
                if tail.len() > 8192 {
                    tail.drain(..tail.len() - 8192);
                }
            }
            (rank, tail, warnings)
        }));
    };
    for (rank, child) in children.iter_mut() {
        follow(*rank, child, &mut readers, &mut err_readers);
    }
    let mut replaced: Vec<u32> = Vec::new();
    // A watchdog, not a deadline: the run is killed only when no worker has
    // finished an iteration for this long (the ranks' own timeouts catch a
    // lost peer first; a run that is slow but moving is left alone).
    let stall_limit = Duration::from_secs(args.timeout_s + 30)
        + model
            .iteration_compute(args.batch(&model), args.time_scale)
            .mul_f64(20.0);
    let mut failed: Vec<String> = Vec::new();
    let mut statuses = vec![None; world];
    let mut first_failure: Option<Instant> = None;
    let mut killed = false;
    // When the pending kill's iteration came (its checkpoint wait counts from there).
    let mut kill_due: Option<Instant> = None;
    while statuses.iter().any(Option::is_none) {
        // Fault injection: the next --fault-kill, once a worker reports its iteration.
        if let Some(k) = kills.front().copied().filter(|_| !killed) {
            let came = max_iter.load(Ordering::Relaxed) >= k.iter;
            if came {
                kill_due.get_or_insert_with(Instant::now);
            }
            if came && resilience::due_checkpoint_done(&args.ckpt, k.iter, kill_due.unwrap_or(began)) {
                kill_due = None;
                kills.pop_front();
                // Only a rank still running is killed (one that finished has nothing to lose).
                if let Some((_, c)) = children.iter_mut().find(|(r, _)| *r == k.rank) {
                    if matches!(c.try_wait(), Ok(None)) {
                        let _ = c.kill();
                        failed.push(format!(
                            "rank {} was killed (SIGKILL) at iteration {} by --fault-kill",
                            k.rank,
                            max_iter.load(Ordering::Relaxed)
                        ));
                        killed = true;
                        first_failure.get_or_insert_with(Instant::now);
                    }
                }
            }
        }
        // A held rank (a --fault-kill's target, done and waiting) is let go
        // once no kill of this attempt can reach it: its stdin closes.
        stdins.retain(|(r, _)| !held.contains(r) || (!killed && kills.iter().any(|k| k.rank == *r)));
        // The coordinator: a worker far behind the median leaves at its next boundary.
        let now: Vec<u64> = progress.iter().map(|p| p.load(Ordering::Relaxed)).collect();
        for r in removal.judge(&now) {
            if let Some((_, pipe)) = stdins.iter_mut().find(|(x, _)| *x == r) {
                let _ = writeln!(pipe, "leave");
                let _ = pipe.flush();
            }
        }
        let mut gone: Vec<u32> = Vec::new();
        for (i, (rank, child)) in children.iter_mut().enumerate() {
            if statuses[i].is_none() {
                if let Ok(Some(st)) = child.try_wait() {
                    if !st.success() {
                        failed.push(format!("{} exited with {st}", who(*rank)));
                        first_failure.get_or_insert_with(Instant::now);
                    }
                    statuses[i] = Some(st);
                    gone.push(*rank);
                }
            }
        }
        // --replace-stragglers: a removed worker that left gets a replacement.
        for r in gone {
            let removed = removal.removed.iter().any(|x| x.rank == r);
            if args.replace_stragglers && removed && !replaced.contains(&r) && failed.is_empty() {
                let now: Vec<u64> = progress.iter().map(|p| p.load(Ordering::Relaxed)).collect();
                let mut live: Vec<u64> = (0..p1).filter(|&w| w != r as usize).map(|w| now[w]).collect();
                live.sort_unstable();
                // The rounds left, less a margin for the time it takes to join:
                // it must not outlast the others (a round only it fed would strand).
                let n = args.iters.saturating_sub(live.last().copied().unwrap_or(0) + 3);
                if n == 0 {
                    continue;
                }
                let mut c = rank_command(r);
                c.env("TIDEWIRE_REPLACEMENT_ITERS", n.to_string()).stdin(Stdio::null());
                let mut child = c
                    .spawn()
                    .map_err(|e| Error::Launch(format!("cannot start a replacement for rank {r}: {e}")))?;
                follow(r, &mut child, &mut readers, &mut err_readers);
                children.push((r, child));
                statuses.push(None);
                replaced.push(r);
                if let Some(x) = removal.removed.iter_mut().find(|x| x.rank == r) {
                    x.replaced_for = Some(n);
                }
            }
        }
        // A rollback restarts every rank: once one failed, give the others a
        // moment to report the loss themselves, then stop them.
        if args.ckpt.active() && first_failure.is_some_and(|t| t.elapsed() > Duration::from_secs(3)) {
            for (i, (_, c)) in children.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    let _ = c.kill();
                }
            }
        }
        let since = began
            .elapsed()
            .saturating_sub(Duration::from_millis(last_progress.load(Ordering::Relaxed)));
        if since > stall_limit {
            for (_, c) in children.iter_mut() {
                let _ = c.kill();
            }
            failed.push(format!(
                "no worker finished an iteration for {stall_limit:?}, so the run was killed (raise --timeout-s for a slower run)"
            ));
            break;
        }
        // A pending fault is injected within a couple of milliseconds of its iteration.
        std::thread::sleep(Duration::from_millis(if kills.is_empty() || killed { 20 } else { 2 }));
    }
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
    bar.finish_and_clear();
    let results: Vec<NodeResult> = readers.into_iter().filter_map(|r| r.join().ok().flatten()).collect();
    let stderr_tails: Vec<(u32, String, Vec<String>)> = err_readers.into_iter().filter_map(|r| r.join().ok()).collect();
    if !failed.is_empty() {
        let mut msg = failed.join("; ");
        for (rank, tail, _) in stderr_tails.iter().filter(|(_, t, _)| !t.is_empty()) {
            msg.push_str(&format!("\n--- {} stderr ---\n{}", who(*rank), tail.trim_end()));
        }
        // A run that failed before any iteration would fail again the same way
        // (a setup error): only a run that got going is rolled back.
        let progressed = max_iter.load(Ordering::Relaxed) > 0 || killed;
        return Ok(Attempt::Failed {
            cause: msg,
            progressed,
            failed_at: first_failure.unwrap_or_else(Instant::now),
        });
    }
    // A removed worker's result is apart; its replacement, if any, reports as its rank.
    let workers: Vec<&NodeResult> = results
        .iter()
        .filter(|r| r.worker && r.local.is_none() && r.removed_at.is_none())
        .collect();
    let p1 = p1 - removal.removed.len() + replaced.len();
    if workers.len() != p1 {
        return Err(Error::Launch(format!(
            "{} of {p1} workers reported a result",
            workers.len()
        )));
    }
    let learners: Vec<&NodeResult> = results.iter().filter(|r| r.local.is_some()).collect();
    let want_learners = if args.flat { 0 } else { p1 * (args.local_learners - 1) };
    if learners.len() != want_learners {
        return Err(Error::Launch(format!(
            "{} of {want_learners} local learners reported a result",
            learners.len()
        )));
    }
    let book = args.book(
        &model,
        if args.colocate {
            Cluster::colocated(p1)?
        } else {
            Cluster::split(p1, p2)?
        },
    )?;
    // The slowest worker's iterations.
    let slowest = workers
        .iter()
        .max_by(|a, b| {
            let s = |r: &NodeResult| r.iters.iter().map(|i| i.seconds).sum::<f64>();
            s(a).total_cmp(&s(b))
        })
        .expect("p1 >= 1");
    let per: Vec<IterStat> = slowest.iters.clone();
    let steady: Vec<&IterStat> = if per.len() > 1 {
        per[1..].iter().collect()
    } else {
        per.iter().collect()
    };
    // From the start of iteration 0 to the end of the last sync, per
    // iteration: the same measure as `tidewire sim`. (The iterations after the
    // first would count one sync more than their computes: iteration 0's sync
    // is charged to iteration 1, and the last one ends with its own.)
    let iteration_s = per.iter().map(|i| i.seconds).sum::<f64>() / per.len() as f64;
    let spans: Vec<f64> = steady
        .iter()
        .filter(|i| i.sync_span_s > 0.0)
        .map(|i| (1.0 - i.exposed_s / i.sync_span_s).clamp(0.0, 1.0))
        .collect();
    let hidden_fraction = if spans.is_empty() {
        0.0
    } else {
        spans.iter().sum::<f64>() / spans.len() as f64
    };
    let (verified, mismatched_layers) = if args.verify {
        let want = if args.comm.active() {
            comm::reference(args, &model, p1)?
        } else {
            reference(args, &book)?
        };
        let mut bad: Vec<String> = Vec::new();
        for w in workers.iter().chain(&learners) {
            for (l, d) in w.digests.iter().enumerate() {
                if want.get(l) != Some(d) && !bad.contains(&model.layers[l].name) {
                    bad.push(model.layers[l].name.clone());
                }
            }
            if w.digests.len() != want.len() {
                bad.push(format!("rank {} reported {} layers", w.rank, w.digests.len()));
            }
        }
        (Some(bad.is_empty()), bad)
    } else {
        (None, vec![])
    };
    let k = args.batch(&model);
    let checkpoint = args.ckpt.active().then(|| {
        let ranks: Vec<(u32, &tidewire::checkpoint::CheckpointStats)> = results
            .iter()
            .filter_map(|r| Some((r.rank, r.checkpoint.as_ref()?)))
            .collect();
        resilience::CheckpointSummary::of(&ranks, &args.ckpt, iteration_s, per.len())
    });
    let mut by_rank: Vec<&NodeResult> = workers.clone();
    by_rank.sort_by_key(|r| r.rank);
    drop(stdins);
    let mut removed = removal.removed;
    for x in removed.iter_mut() {
        x.left_at = results
            .iter()
            .find(|w| w.rank == x.rank && w.removed_at.is_some())
            .and_then(|w| w.removed_at);
    }
    Ok(Attempt::Done(Box::new(TrainReport {
        removed,
        trigger: args.trigger.clone(),
        worker_iteration_s: by_rank
            .iter()
            .map(|r| r.iters.iter().map(|i| i.seconds).sum::<f64>() / r.iters.len().max(1) as f64)
            .collect(),
        dropped: results.iter().map(|r| r.stats.dropped).sum(),
        late_folded: results.iter().map(|r| r.stats.late_folded).sum(),
        partial_applies: results.iter().map(|r| r.stats.partial_applies).sum(),
        checkpoint,
        restarts: Vec::new(),
        resumed_from: None,
        log_warnings: stderr_tails.into_iter().flat_map(|(_, _, w)| w).collect(),
        slice_params: book.config().slice_params,
        aggregation: AggregationShare {
            cpu_bytes: results.iter().map(|r| r.stats.cpu_aggregated_bytes).sum(),
            gpu_bytes: results.iter().map(|r| r.stats.gpu_aggregated_bytes).sum(),
            cpu_chunks: results.iter().map(|r| r.stats.cpu_aggregation_chunks).sum(),
            gpu_chunks: results.iter().map(|r| r.stats.gpu_aggregation_chunks).sum(),
        },
        max_outstanding: results.iter().map(|r| r.stats.max_outstanding).max().unwrap_or(0),
        max_message_bytes: results.iter().map(|r| r.stats.max_message_bytes).max().unwrap_or(0),
        would_block: results.iter().map(|r| r.stats.would_block).sum(),
        factor_bytes_in_place: results.iter().map(|r| r.stats.factor_bytes_in_place).sum(),
        factor_bytes_decoded: results.iter().map(|r| r.stats.factor_bytes_decoded).sum(),
        sparse: SparseSummary {
            pushes: results.iter().map(|r| r.stats.sparse_pushes).sum(),
            dense_pushes: results.iter().map(|r| r.stats.sparse_dense_pushes).sum(),
            nonzeros: results.iter().map(|r| r.stats.sparse_nonzeros).sum(),
            elements: results.iter().map(|r| r.stats.sparse_elements).sum(),
            bytes: results.iter().map(|r| r.stats.sparse_bytes).sum(),
            dense_bytes: results.iter().map(|r| r.stats.sparse_dense_bytes).sum(),
        },
        model: model.name.into(),
        local_learners: args.local_learners,
        flat: args.flat,
        node_tx_bytes: per_node(&results, args, |r| r.stats.tx_payload_bytes - r.setup_tx_bytes),
        node_rx_bytes: per_node(&results, args, |r| {
            r.stats.rx_direct_bytes + r.stats.rx_copied_bytes - r.setup_rx_bytes
        }),
        sync: args.sync.clone(),
        consistency: args.consistency.clone(),
        workers: p1,
        servers: p2,
        colocate: args.colocate,
        batch: k,
        iters: args.iters,
        time_scale: args.time_scale,
        compute_s: model.iteration_compute(k, args.time_scale).as_secs_f64(),
        iteration_s,
        throughput_samples_s: (p1 * args.learners() * k) as f64 / iteration_s,
        hidden_fraction,
        per_iteration: per,
        workers_detail: {
            let mut w: Vec<&NodeResult> = workers.clone();
            w.sort_by_key(|r| r.rank);
            w.iter().map(|r| r.iters.clone()).collect()
        },
        layers: book
            .layers()
            .iter()
            .enumerate()
            .map(|(i, l)| LayerRow {
                name: l.name.clone(),
                kind: l.kind,
                shape: (l.m, l.n),
                scheme: book.scheme(i as u32, 0),
                cost_s: book.seconds(i as u32).map(|(ps, sfb)| (ps.total(), sfb.total())),
            })
            .collect(),
        rates: book.rates().copied(),
        verified,
        mismatched_layers,
        digests: workers
            .iter()
            .find(|w| w.rank == 0)
            .map(|w| w.digests.clone())
            .unwrap_or_default(),
        comm: workers.iter().min_by_key(|r| r.rank).and_then(|r| r.comm.clone()),
        wall_s: began.elapsed().as_secs_f64(),
        transport: {
            // One line per distinct transport; the ranks are named when they differ.
            let mut by: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
            for r in results.iter().filter(|r| r.local.is_none()) {
                by.entry(r.transport.as_str()).or_default().push(r.rank);
            }
            let one = by.len() == 1;
            by.into_iter()
                .map(|(t, mut ranks)| {
                    if one {
                        return t.to_string();
                    }
                    ranks.sort_unstable();
                    let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
                    let (kind, why) = t.split_once(": ").unwrap_or((t, ""));
                    format!("{kind} on ranks {}: {why}", list.join(", "))
                })
                .collect()
        },
    })))
}

/// Sums a counter over each worker node's ranks (worker ranks `0..P1`; with
/// --flat, node `i` is ranks `i·L..(i+1)·L`).
fn per_node(results: &[NodeResult], args: &TrainArgs, f: impl Fn(&NodeResult) -> u64) -> Vec<u64> {
    let per = if args.flat { args.local_learners } else { 1 };
    let mut out = vec![0u64; args.workers];
    for r in results.iter().filter(|r| r.local.is_none() && r.worker) {
        if let Some(n) = out.get_mut(r.rank as usize / per) {
            *n += f(r);
        }
    }
    out
}

/// The report as text.
pub fn render(r: &TrainReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} | {} workers, {} servers{} | sync {} | {} | K={} | compute {:.3} s/iter (time scale {})",
        r.model,
        r.workers,
        r.servers,
        if r.colocate { " (colocated)" } else { "" },
        r.sync,
        r.consistency,
        r.batch,
        r.compute_s,
        r.time_scale
    );
    for t in &r.transport {
        let _ = writeln!(s, "transport {t}");
    }
    for (i, x) in r.restarts.iter().enumerate() {
        let _ = writeln!(
            s,
            "rollback {}: {}; resumed from iteration {} ({:.2} s to restart)",
            i + 1,
            x.cause.lines().next().unwrap_or(""),
            x.resumed_from,
            x.recovery_s
        );
    }
    let (lo, hi) = r
        .worker_iteration_s
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &w| (lo.min(w), hi.max(w)));
    // Under another trigger, or when the workers' paces differ by a fifth (a straggler).
    if r.trigger != "all" || hi > 1.2 * lo {
        let list: Vec<String> = r.worker_iteration_s.iter().map(|w| format!("{w:.3}")).collect();
        let _ = writeln!(
            s,
            "trigger {}: mean iteration per worker {} s; {} rounds applied without every worker, {} late \
             contributions dropped, {} folded into the next round",
            r.trigger,
            list.join(" / "),
            r.partial_applies,
            r.dropped,
            r.late_folded
        );
    }
    for x in &r.removed {
        let _ = writeln!(
            s,
            "removed rank {} as a straggler: {}; it left at iteration {}, and the job went on with one worker fewer{}",
            x.rank,
            x.why,
            x.left_at.map_or("?".to_string(), |i| i.to_string()),
            x.replaced_for.map_or(String::new(), |n| format!(
                "; a replacement joined for the last {n} iterations"
            ))
        );
    }
    if let Some(c) = &r.checkpoint {
        let _ = writeln!(
            s,
            "checkpoints every {} iterations: {} written ({:.1} MB); copying them cost the iterations {:.3} s \
             ({:.3}% of the run), writing took {:.2} s on the checkpoint threads",
            c.every,
            c.written.len(),
            c.bytes as f64 / 1e6,
            c.copy_s,
            100.0 * c.cost_fraction,
            c.write_s
        );
        for f in &c.failed {
            let _ = writeln!(s, "  a checkpoint could not be written: {f}");
        }
    }
    if let Some(k) = r.resumed_from {
        let _ = writeln!(
            s,
            "the last attempt resumed from iteration {k}; its iterations are below"
        );
    }
    if r.local_learners > 1 {
        let mb = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64 / 1e6;
        let _ = writeln!(
            s,
            "{} learners per node ({}): each node's NIC sent {:.1} MB and received {:.1} MB on average",
            r.local_learners,
            if r.flat {
                "flat: every learner is a rank"
            } else {
                "local aggregation: one rank per node"
            },
            mb(&r.node_tx_bytes),
            mb(&r.node_rx_bytes)
        );
    }
    let a = &r.aggregation;
    if a.cpu_bytes + a.gpu_bytes > 0 {
        let _ = writeln!(
            s,
            "server sums: {:.1} MB on the CPU ({} chunks), {:.1} MB on the GPU ({} chunks); SF rebuilds on the CPU",
            a.cpu_bytes as f64 / 1e6,
            a.cpu_chunks,
            a.gpu_bytes as f64 / 1e6,
            a.gpu_chunks,
        );
    }
    if let Some(rt) = &r.rates {
        let _ = writeln!(
            s,
            "rates per rank (HybComm in seconds): link {:.2} GB/s, {:.1} µs a message, sum {:.1} GB/s, GEMM {:.1} GFLOP/s; slices of {} parameters",
            rt.link_bytes_per_s / 1e9,
            rt.msg_s * 1e6,
            rt.sum_bytes_per_s / 1e9,
            rt.gemm_flop_per_s / 1e9,
            r.slice_params
        );
    }
    let count = |x: Scheme| r.layers.iter().filter(|l| l.scheme == x).count();
    let (sfb, adam) = (count(Scheme::Sfb), count(Scheme::Adam));
    let _ = write!(
        s,
        "schemes (every iteration): {} layers PS, {sfb} layers SFB",
        r.layers.len() - sfb - adam
    );
    if adam > 0 {
        let _ = write!(s, ", {adam} layers Adam");
    }
    let _ = writeln!(s);
    for l in r.layers.iter().filter(|l| l.kind == LayerKind::Fc) {
        let cost = match l.cost_s {
            Some((ps, sfb)) => format!("   (PS {ps:.3} s, SFB {sfb:.3} s at the measured rates)"),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "  {:<10} fc {:>6}×{:<6} {:?}{cost}",
            l.name, l.shape.0, l.shape.1, l.scheme
        );
    }
    let _ = writeln!(
        s,
        "{:>5} {:>10} {:>12} {:>10} {:>10} {:>8}",
        "iter", "seconds", "samples/s", "blocked s", "sync s", "hidden"
    );
    for i in &r.per_iteration {
        let hidden = if i.sync_span_s > 0.0 {
            format!("{:.0}%", 100.0 * (1.0 - i.exposed_s / i.sync_span_s).clamp(0.0, 1.0))
        } else {
            "-".into()
        };
        let _ = writeln!(
            s,
            "{:>5} {:>10.3} {:>12.1} {:>10.3} {:>10.3} {:>8}",
            i.iter,
            i.seconds,
            (r.workers * r.batch * if r.flat { 1 } else { r.local_learners.max(1) }) as f64 / i.seconds,
            i.blocked_s,
            i.sync_span_s,
            hidden
        );
    }
    let _ = writeln!(
        s,
        "mean iteration {:.3} s, {:.1} samples/s, {:.0}% of communication hidden behind compute",
        r.iteration_s,
        r.throughput_samples_s,
        100.0 * r.hidden_fraction
    );
    let sp = &r.sparse;
    if sp.pushes + sp.dense_pushes > 0 {
        let _ = writeln!(
            s,
            "sparse layers: {} slices as pairs (density {:.2}%, {} bytes), {} slices dense ({} bytes)",
            sp.pushes,
            if sp.elements > 0 {
                100.0 * sp.nonzeros as f64 / sp.elements as f64
            } else {
                0.0
            },
            sp.bytes,
            sp.dense_pushes,
            sp.dense_bytes
        );
    }
    if let Some(c) = &r.comm {
        let _ = writeln!(
            s,
            "communication: {} exchanges in {} iterations ({:.2}x fewer than every iteration), {} bytes handed in per worker",
            c.exchanges,
            c.steps,
            c.steps as f64 / c.exchanges.max(1) as f64,
            c.handed_in_bytes
        );
        for d in &c.decisions {
            let _ = writeln!(s, "  {d}");
        }
    }
    match r.verified {
        Some(true) => {
            let _ = writeln!(
                s,
                "verify: every worker's parameters equal the single-process reference, bit for bit"
            );
        }
        Some(false) => {
            let _ = writeln!(s, "verify: FAILED on layers {:?}", r.mismatched_layers);
        }
        None => {}
    }
    if !r.log_warnings.is_empty() {
        let _ = writeln!(s, "the ranks logged {} warnings or errors:", r.log_warnings.len());
        for w in r.log_warnings.iter().take(20) {
            let _ = writeln!(s, "  {w}");
        }
    }
    s
}

/// `tidewire train --comm-every T --comm-mode accumulate|average`, with
/// Nexus's quality-guided adjustment (`--freq-max`): the training loop of a
/// worker that exchanges every T steps, the synthetic loss model that drives
/// the adjustment without a framework, and the single-process reference that
/// `--verify` compares with, bit for bit.
///
/// - `accumulate`: each worker sums its synthetic gradients over the T steps
///   in step order (the first written, the next added) and hands the sum in on
///   the T-th; the servers apply `--op` to the sum over workers (rank order).
/// - `average`: each worker applies `--op` to its own gradient every step
///   (local SGD, its own momentum), and on the T-th hands its parameters in;
///   the servers average them (`mean`), and every worker continues from the
///   average.
///
/// FC layers are handed in as gradients (Uᵀ·V formed by the trainer) through
/// the parameter servers: a sum over steps, or parameters, has no sufficient
/// factors. The last iteration always exchanges (outside the controller's
/// schedule when it is not due), so every replica ends equal.
///
/// The synthetic loss of worker w at step s under T is
/// `(0.2 + 1/(1 + s/25)) · (1 + max(0, T/T_ok - 1)) · (1 + ε)`, with ε a
/// deterministic noise in ±0.5%: quality holds up to `--synthetic-ok-t`
/// (T_ok) and degrades beyond it, so the controller should settle there.
/// The reference replays the same controller on the same figures.
pub mod comm {
    use std::io::Write;
    use std::time::Instant;

    use clap::Args;
    use serde::{Deserialize, Serialize};
    use tidewire::freq::{quality_layer, Guide};
    use tidewire::session::Session;
    use tidewire_engine::book::LayerKind;
    use tidewire_engine::freq::{CommConfig, CommMode, Decision, Event, FreqConfig};
    use tidewire_engine::models::Model;
    use tidewire_gpu::cpu::{self, ApplyOp};

    use super::{digest, IterStat, NodeResult, Synth, TrainArgs};
    use crate::error::{Error, Result};

    /// The communication frequency flags of `tidewire train`.
    #[derive(Args, Debug, Clone, Serialize, Deserialize)]
    pub struct CommArgs {
        /// Exchange every T iterations (Nexus's communication frequency; 1: every one).
        #[arg(long, default_value_t = 1)]
        pub comm_every: u32,
        /// Between exchanges: accumulate (sum gradients locally, push the sum on the
        /// T-th) or average (local --op steps, models averaged by the servers every T).
        #[arg(long, default_value = "accumulate", value_parser = parse_mode)]
        pub comm_mode: String,
        /// Quality-guided adjustment of T (Nexus) up to this T; the workers report the
        /// synthetic loss. Off when absent.
        #[arg(long)]
        pub freq_max: Option<u32>,
        /// Exchanges per measurement window of the adjustment (baseline or trial).
        #[arg(long, default_value_t = 4)]
        pub freq_period: u32,
        /// Relative loss increase over the baseline at which a worker rejects a proposal.
        #[arg(long, default_value_t = 0.02)]
        pub freq_tolerance: f64,
        /// Back to --comm-every for good from this fraction of --iters on.
        #[arg(long, default_value_t = 0.85)]
        pub freq_revert_at: f64,
        /// The synthetic loss model's largest T without quality loss.
        #[arg(long, default_value_t = 4)]
        pub synthetic_ok_t: u32,
    }

    fn parse_mode(s: &str) -> std::result::Result<String, String> {
        CommMode::parse(s)
            .map(|m| m.name().to_string())
            .ok_or_else(|| "use accumulate or average".into())
    }

    impl CommArgs {
        /// Whether anything differs from "every iteration, gradients".
        pub fn active(&self) -> bool {
            self.comm_every != 1 || self.freq_max.is_some() || self.mode() == CommMode::Average
        }
        fn mode(&self) -> CommMode {
            CommMode::parse(&self.comm_mode).unwrap_or(CommMode::Accumulate)
        }
        fn guided(&self) -> bool {
            self.freq_max.is_some_and(|m| m > self.comm_every)
        }
        /// The agreed configuration for a run of `iters` iterations.
        pub fn config(&self, iters: u64) -> Result<CommConfig> {
            if !(0.0..=1.0).contains(&self.freq_revert_at) {
                return Err(Error::Usage(
                    "--freq-revert-at is a fraction of --iters, in 0..=1".into(),
                ));
            }
            if self.synthetic_ok_t == 0 {
                return Err(Error::Usage("--synthetic-ok-t must be at least 1".into()));
            }
            let freq = FreqConfig {
                t_initial: self.comm_every,
                t_max: self.freq_max.unwrap_or(self.comm_every).max(self.comm_every),
                period: self.freq_period,
                tolerance: self.freq_tolerance,
                revert_at_step: self
                    .guided()
                    .then(|| (self.freq_revert_at * iters as f64).round() as u64),
            };
            freq.validate()
                .map_err(|e| Error::Usage(format!("--comm-every/--freq-*: {e}")))?;
            Ok(CommConfig {
                mode: self.mode(),
                freq,
            })
        }
        /// What the servers apply: the average of the models in average mode, `op` otherwise.
        pub fn server_op(&self, op: ApplyOp) -> ApplyOp {
            match self.mode() {
                CommMode::Average => ApplyOp::Mean,
                CommMode::Accumulate => op,
            }
        }
        /// Checks the flags against the run's op: the quality figures need servers that reduce.
        pub fn validate(&self, op: ApplyOp, iters: u64) -> Result<()> {
            let c = self.config(iters)?;
            Guide::new(c, self.server_op(op), 0, 1).map_err(|e| {
                Error::Usage(format!(
                    "{e} (--freq-max with --comm-mode accumulate needs --op mean or sum; average mode reduces with mean)"
                ))
            })?;
            Ok(())
        }
        /// The layer table of the run: the model's, and the quality layer when T adjusts.
        pub fn layers(&self, model: &Model, p1: usize) -> Vec<tidewire_engine::book::LayerSpec> {
            let mut l = model.layers.clone();
            if self.guided() {
                l.push(quality_layer(p1));
            }
            l
        }
    }

    /// The synthetic loss of worker `wi` at step `s` under T = `t` (see the module docs).
    pub fn synthetic_loss(seed: u64, ok_t: u32, wi: usize, s: u64, t: u32) -> f64 {
        let base = 0.2 + 1.0 / (1.0 + s as f64 / 25.0);
        let penalty = (f64::from(t) / f64::from(ok_t) - 1.0).max(0.0);
        let h = super::mix(seed ^ 0x5eed ^ (wi as u64) << 40 ^ s);
        let eps = ((h >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.01;
        base * (1.0 + penalty) * (1.0 + eps)
    }

    /// What a run's communication looked like (worker rank 0's view; every worker's is the same).
    #[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
    pub struct CommSummary {
        /// Iterations.
        pub steps: u64,
        /// Exchanges, the final forced one included.
        pub exchanges: u64,
        /// Bytes this worker handed in over all exchanges (gradients or parameters, and figures).
        pub handed_in_bytes: u64,
        /// T at every iteration.
        pub t_per_step: Vec<u32>,
        /// The controller's decisions other than keep.
        pub decisions: Vec<String>,
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
        let cc = c.config(args.iters)?;
        let op = c.server_op(args.apply_op()?);
        let mut guides: Vec<Guide> = (0..p1)
            .map(|w| Guide::new(cc, op, w, p1))
            .collect::<tidewire::Result<_>>()?;
        let mut due = Vec::new();
        let mut sum = CommSummary::default();
        for it in 0..args.iters {
            let t = guides[0].t();
            sum.t_per_step.push(t);
            let d = guides[0].due();
            due.push(d || it + 1 == args.iters);
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
        sum.steps = args.iters;
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
        let k = args.batch.unwrap_or(model.batch);
        let c = &args.comm;
        let mode = CommMode::parse(&c.comm_mode).unwrap_or(CommMode::Accumulate);
        let op = args.apply_op()?;
        let mut guide = Guide::new(c.config(args.iters)?, c.server_op(op), wi, p1)?;
        let slow = if args.slow_rank == Some(rank) {
            args.slow_factor
        } else {
            1.0
        };
        let times = model.layer_times(k, args.time_scale * slow);
        let nm = model.layers.len();
        let nl = book.layers().len();
        let mut layers = session.take_layers()?;
        let mut mom: Vec<Vec<f32>> = model
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
        let mut scratch = vec![0f32; model.layers.iter().map(|l| l.params()).max().unwrap_or(0)];
        let mut sum = CommSummary::default();
        let mut stats = Vec::new();
        let mut pending: Option<bool> = None; // an exchange in flight: whether the controller scheduled it
        let mut since = 0u64;
        let mut out = std::io::stdout();
        for it in 0..args.iters {
            let start = Instant::now();
            let mut blocked = std::time::Duration::ZERO;
            if let Some(scheduled) = pending.take() {
                for (l, slot) in layers.iter_mut().enumerate() {
                    let t = Instant::now();
                    *slot = Some(session.wait_layer(l as u32)?);
                    blocked += t.elapsed();
                }
                if scheduled && guide.adjusts() {
                    let q = layers[nl - 1].as_ref().expect("held");
                    guide.exchanged(q.params())?;
                } else if scheduled {
                    guide.exchanged_fixed()?;
                }
            }
            for t in &times {
                super::sleep(t.0);
            }
            let t = guide.t();
            sum.t_per_step.push(t);
            let scheduled = guide.due();
            let due = scheduled || it + 1 == args.iters;
            for l in (0..nm).rev() {
                super::sleep(times[l].1);
                let buf = layers[l].as_mut().expect("held by the trainer");
                let n = buf.grad().len();
                match mode {
                    CommMode::Accumulate if since == 0 => gradient(synth, model, k, wi, it, l, buf.grad_mut()),
                    CommMode::Accumulate => {
                        gradient(synth, model, k, wi, it, l, &mut scratch[..n]);
                        cpu::add_assign(buf.grad_mut(), &scratch[..n]);
                    }
                    CommMode::Average => {
                        gradient(synth, model, k, wi, it, l, &mut scratch[..n]);
                        cpu::apply(op, 1, &scratch[..n], buf.params_mut(), &mut mom[l]);
                        if due {
                            let w = buf.params().to_vec();
                            buf.grad_mut().copy_from_slice(&w);
                        }
                    }
                }
                if due {
                    sum.handed_in_bytes += 4 * n as u64;
                    session.grad_ready(layers[l].take().expect("held"))?;
                }
            }
            guide.report(synthetic_loss(args.seed, c.synthetic_ok_t, wi, it, t));
            if nl > nm && due {
                let mut q = layers[nl - 1].take().expect("held");
                if scheduled {
                    guide.write_figures(q.grad_mut())?;
                } else {
                    q.grad_mut().fill(0.0); // the final, unscheduled exchange carries no figures
                }
                sum.handed_in_bytes += 4 * p1 as u64;
                session.grad_ready(q)?;
            }
            if due {
                pending = Some(scheduled);
                sum.exchanges += 1;
                since = 0;
            } else {
                guide.local_step()?;
                since += 1;
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
                let _ = writeln!(out, "progress {}", it + 1);
                let _ = out.flush();
            }
        }
        let all = session.wait_all()?;
        sum.steps = args.iters;
        sum.decisions = guide.controller().history().iter().map(describe).collect();
        let digests = all[..nm].iter().map(|b| digest(b.params())).collect();
        let st = session.stats()?;
        let (kind, why) = session.transport();
        drop(all);
        session.shutdown()?;
        Ok(NodeResult {
            rank,
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
        let k = args.batch.unwrap_or(model.batch);
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
}
