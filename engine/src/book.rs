//! The information book: the cluster, the layer table, the batch size, the
//! placement of KV chunks on servers, the scheduling slices, and the scheme
//! each layer syncs by. Every rank builds the same book from the same inputs;
//! [`Book::hash`] lets ranks check that at rendezvous.

use std::ops::Range;

use serde::Serialize;

use crate::cost;
use crate::error::{EngineError, Result};

/// Slices a book may have: a push's immediate names its slice below bit 31,
/// which marks a sparse push (`SPARSE_IMM` in the sparse module).
pub const MAX_SLICES: u32 = 1 << 31;

/// What a rank does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Computes gradients and pushes them.
    Worker,
    /// Holds a shard of the KV store, aggregates and applies.
    Server,
    /// Both: a colocated node.
    Both,
}

impl Role {
    /// Whether the rank runs a worker.
    pub fn is_worker(self) -> bool {
        matches!(self, Role::Worker | Role::Both)
    }
    /// Whether the rank runs a server shard.
    pub fn is_server(self) -> bool {
        matches!(self, Role::Server | Role::Both)
    }
}

/// The ranks of a job and their roles.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cluster {
    roles: Vec<Role>,
    workers: Vec<u32>,
    servers: Vec<u32>,
}

impl Cluster {
    /// A cluster from explicit roles, indexed by rank.
    pub fn from_roles(roles: Vec<Role>) -> Result<Self> {
        let workers: Vec<u32> = (0..roles.len() as u32)
            .filter(|&r| roles[r as usize].is_worker())
            .collect();
        let servers: Vec<u32> = (0..roles.len() as u32)
            .filter(|&r| roles[r as usize].is_server())
            .collect();
        if workers.is_empty() || servers.is_empty() {
            return Err(EngineError::InvalidConfig(format!(
                "a cluster needs at least one worker and one server (got {} workers, {} servers)",
                workers.len(),
                servers.len()
            )));
        }
        // Ascending, as `worker_index` and `server_index` search them.
        debug_assert!(workers.windows(2).all(|w| w[0] < w[1]));
        debug_assert!(servers.windows(2).all(|w| w[0] < w[1]));
        Ok(Cluster {
            roles,
            workers,
            servers,
        })
    }

    /// `workers` worker-only ranks (0..P1) followed by `servers` server-only ranks.
    pub fn split(workers: usize, servers: usize) -> Result<Self> {
        let mut roles = vec![Role::Worker; workers];
        roles.extend(std::iter::repeat(Role::Server).take(servers));
        let c = Self::from_roles(roles)?;
        debug_assert!(c.workers.len() == workers && c.servers.len() == servers && !c.is_colocated());
        Ok(c)
    }

    /// `n` nodes that are each a worker and a server.
    pub fn colocated(n: usize) -> Result<Self> {
        let c = Self::from_roles(vec![Role::Both; n])?;
        debug_assert!(c.is_colocated() && c.workers == c.servers);
        Ok(c)
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.roles.len()
    }
    /// The role of `rank`.
    pub fn role(&self, rank: u32) -> Option<Role> {
        self.roles.get(rank as usize).copied()
    }
    /// All roles, by rank.
    pub fn roles(&self) -> &[Role] {
        &self.roles
    }
    /// Worker ranks in ascending order (P1 of them). A worker's index in this
    /// list is its place in the deterministic aggregation order.
    pub fn workers(&self) -> &[u32] {
        &self.workers
    }
    /// Server ranks in ascending order (P2 of them).
    pub fn servers(&self) -> &[u32] {
        &self.servers
    }
    /// Index of `rank` among the workers.
    pub fn worker_index(&self, rank: u32) -> Option<usize> {
        self.workers.binary_search(&rank).ok()
    }
    /// Index of `rank` among the servers.
    pub fn server_index(&self, rank: u32) -> Option<usize> {
        self.servers.binary_search(&rank).ok()
    }
    /// Whether every rank is both worker and server.
    pub fn is_colocated(&self) -> bool {
        self.roles.iter().all(|r| *r == Role::Both)
    }
}

/// Layer kind, as the cost model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Fully connected: the gradient has sufficient factors.
    Fc,
    /// Convolution.
    Conv,
    /// Anything else (normalization, embeddings, biases kept apart...).
    Other,
}

/// Element type of a layer's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// 32-bit float: supported.
    F32,
    /// Reserved.
    Bf16,
    /// Reserved.
    F16,
}

impl DType {
    /// Name for messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        }
    }
}

/// Where a layer's buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Location {
    /// Host memory.
    Host,
    /// GPU memory on the given device (used by the GPU path).
    Device(u32),
}

/// One row of the layer table. Its position in the table is its forward index.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerSpec {
    /// Name, e.g. `conv1_1` or `fc6`.
    pub name: String,
    /// Kind.
    pub kind: LayerKind,
    /// Rows of the weight: output features (FC) or output channels (conv).
    pub m: usize,
    /// Columns: input features (FC) or input channels × kernel area (conv).
    pub n: usize,
    /// Element type.
    pub dtype: DType,
    /// Buffer location.
    pub location: Location,
    /// Forward FLOPs per sample (for compute models; 0 when unknown).
    pub flops: f64,
    /// The application's hint that the gradient is mostly zeros (an
    /// embedding's): its slices may be pushed as index/value pairs
    /// ([`crate::sparse`]). A sparse layer always syncs through the PS.
    pub sparse: bool,
}

impl LayerSpec {
    /// A host f32 layer.
    pub fn new(name: impl Into<String>, kind: LayerKind, m: usize, n: usize) -> Self {
        LayerSpec {
            name: name.into(),
            kind,
            m,
            n,
            dtype: DType::F32,
            location: Location::Host,
            flops: 0.0,
            sparse: false,
        }
    }
    /// This layer with the sparse hint set or cleared (the `sparse` field).
    ///
    /// ```
    /// use tidewire_engine::book::{LayerKind, LayerSpec};
    /// let emb = LayerSpec::new("embedding", LayerKind::Other, 100_000, 64).sparse(true);
    /// assert!(emb.sparse);
    /// ```
    pub fn sparse(mut self, sparse: bool) -> Self {
        self.sparse = sparse;
        self
    }
    /// Parameter count M×N.
    pub fn params(&self) -> usize {
        self.m * self.n
    }
}

pub use crate::plan::Scheme;

/// How schemes are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SchemePolicy {
    /// Poseidon's HybComm: the cheaper of PS and SFB per FC layer.
    Hybrid,
    /// Every layer through the PS (ablation).
    Ps,
    /// SFB for every FC layer, PS for the rest (ablation).
    Sfb,
    /// [`Scheme::Adam`] for every (dense) FC layer, PS for the rest: the
    /// baseline of Poseidon's Fig. 10. Its FC layers are placed whole, each
    /// on one server (the least loaded by bytes when its turn comes).
    Adam,
}

/// Parameters from which [`Placement::KvStore`] splits a layer across all
/// servers (MXNet's `MXNET_KVSTORE_BIGARRAY_BOUND` default, 10^6; P3 §4.1:
/// "The threshold is a configurable parameter and is set to 10^6 parameters
/// by default").
pub const KVSTORE_BIG_ARRAY: usize = 1_000_000;

/// Part `i` of `size` parameters split over `n` servers as MXNet's KVStore
/// splits a big array: `round(size / n × (i + 1)) − round(size / n × i)`
/// (`EncodeDefaultKey`; it rounds in doubles, this rounds the exact
/// quotient, half up, which agrees wherever the doubles are exact).
fn kvstore_part(size: usize, n: usize, i: usize) -> usize {
    debug_assert!(i < n, "part {i} of {n}");
    let (size, n) = (size as u128, n as u128);
    let round = |j: u128| (2 * size * j + n) / (2 * n);
    let part = (round(i as u128 + 1) - round(i as u128)) as usize;
    // Parts differ from the mean by less than one.
    debug_assert!(part as u128 * n + n > size && part as u128 * n < size + n);
    part
}

/// How a layer's parameters become KV chunks and land on servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Poseidon: every layer cut into chunks of `chunk_bytes`, each on the
    /// least-loaded server by bytes, lowest index on ties; chunks cut into
    /// slices of `slice_params`.
    #[default]
    Chunked,
    /// MXNet's KVStore as P3 §4.1 describes it (the baseline P3 measures
    /// against): a layer is one key. A layer under [`KVSTORE_BIG_ARRAY`]
    /// parameters goes whole to one server, the least loaded by bytes
    /// (lowest index on ties); a larger one is split into P2 nearly equal
    /// chunks as MXNet rounds them, chunk i on server i. `chunk_bytes` plays
    /// no part in the chunks.
    ///
    /// MXNet picks a small array's server by its key, `key × 9973 mod P2`
    /// (`EncodeDefaultKey` in `src/kvstore/kvstore_dist.h`; P3 §4.1: "a
    /// randomly chosen KVServer"), over one key per array: a weight, its
    /// bias and each batch-norm array apart, about three keys per layer.
    /// Here a layer is one key, and the same hash over so few keys
    /// balances the servers far worse than MXNet's does: tried
    /// (`tidewire-papers`, 4 nodes, 1 to 30 Gbit/s), slicing alone then
    /// beat this KVStore by up to 17.6% on ResNet-50 and 32.6% on
    /// Inception-V3, against 0.0 to 1.4% with the least-loaded choice, where
    /// P3 §5.2 reports that slicing alone gains those models little. So the
    /// least-loaded server stands in for the balance MXNet's many keys give.
    ///
    /// On the wire a chunk still travels as slices of at most
    /// `min(slice_params, chunk_bytes / 4)` parameters (the unsliced modes'
    /// 2 MiB), as MXNet's KVWorker "fragments in case of large layers" (P3
    /// §4.1), so a landing slot is one such slice and a server's landing
    /// memory is `slots × P1 × 2 MiB` whatever the model. The protocol stays
    /// per chunk: it is applied once all its slices are summed, and
    /// notified, pulled and written back whole.
    ///
    /// It also selects the KVStore protocol: a server does not broadcast an
    /// applied chunk but notifies every worker, and a worker pulls a layer
    /// once every chunk of it was notified (see [`crate::config::SyncMode::KvStore`]).
    KvStore,
}

/// Sizes that shape the book.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BookConfig {
    /// Batch size K per worker.
    pub batch: usize,
    /// KV chunk size in bytes (Poseidon: 2 MiB).
    pub chunk_bytes: usize,
    /// Scheduling slice size in parameters (P3: 50,000). Slices never cross chunks.
    pub slice_params: usize,
    /// Scheme policy.
    pub policy: SchemePolicy,
    /// Chunk placement (and, for [`Placement::KvStore`], the pull protocol).
    pub placement: Placement,
}

impl Default for BookConfig {
    fn default() -> Self {
        let c = BookConfig {
            batch: 32,
            chunk_bytes: 2 << 20,
            slice_params: 50_000,
            policy: SchemePolicy::Hybrid,
            placement: Placement::Chunked,
        };
        // What `Book::new` asks of it.
        debug_assert!(c.batch > 0 && c.chunk_bytes % 4 == 0 && c.slice_params > 0);
        c
    }
}

/// A KV chunk: a contiguous run of one layer's parameters, owned by one server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Chunk {
    /// Layer index.
    pub layer: u32,
    /// First element inside the layer.
    pub offset: usize,
    /// Elements.
    pub len: usize,
    /// Owning server's rank.
    pub server: u32,
    /// First element inside the owner's shard.
    pub shard_offset: usize,
}

/// A scheduling slice: the unit that is queued, pushed and aggregated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SliceInfo {
    /// Layer index (its forward index: the priority).
    pub layer: u32,
    /// Chunk it belongs to.
    pub chunk: u32,
    /// First element inside the layer.
    pub offset: usize,
    /// Elements.
    pub len: usize,
}

/// The information book. Build it with [`Book::new`]; it is immutable.
#[derive(Debug, Clone)]
pub struct Book {
    cluster: Cluster,
    layers: Vec<LayerSpec>,
    cfg: BookConfig,
    chunks: Vec<Chunk>,
    slices: Vec<SliceInfo>,
    layer_chunks: Vec<Range<u32>>,
    layer_slices: Vec<Range<u32>>,
    chunk_slices: Vec<Range<u32>>,
    layer_offsets: Vec<usize>,
    shard_len: Vec<usize>,
    server_chunks: Vec<Vec<u32>>,
    schemes: Vec<Scheme>,
    /// The start-up schemes and any switches ([`crate::plan`]).
    plan: crate::plan::Plan,
    rates: Option<cost::Rates>,
    hash: u64,
}

/// Refuses what [`Book::new`] cannot lay out: no layers, an empty batch,
/// chunk or slice sizes out of range, Adam without the chunked placement, a
/// layer with no parameters or not f32.
fn check_inputs(layers: &[LayerSpec], cfg: &BookConfig) -> Result<()> {
    if layers.is_empty() {
        return Err(EngineError::InvalidConfig("the layer table is empty".into()));
    }
    if cfg.batch == 0 {
        return Err(EngineError::InvalidConfig("batch must be at least 1".into()));
    }
    if cfg.chunk_bytes < 4 || cfg.chunk_bytes % 4 != 0 {
        return Err(EngineError::InvalidConfig(format!(
            "chunk_bytes {} must be a positive multiple of 4",
            cfg.chunk_bytes
        )));
    }
    if cfg.slice_params == 0 {
        return Err(EngineError::InvalidConfig("slice_params must be at least 1".into()));
    }
    if cfg.policy == SchemePolicy::Adam && cfg.placement != Placement::Chunked {
        return Err(EngineError::InvalidConfig(
            "the adam scheme policy places each FC layer whole on one server: it needs the chunked placement, not kvstore".into(),
        ));
    }
    for (i, l) in layers.iter().enumerate() {
        if l.dtype != DType::F32 {
            return Err(EngineError::UnsupportedDType {
                layer: i as u32,
                name: l.name.clone(),
                dtype: l.dtype.name(),
            });
        }
        if l.params() == 0 {
            return Err(EngineError::InvalidConfig(format!(
                "layer {i} ({}) has no parameters",
                l.name
            )));
        }
    }
    Ok(())
}

/// The layout [`Book::new`] builds, layer by layer: each layer cut into
/// chunks, each chunk placed on a server (the least loaded by bytes, lowest
/// index on ties; under kvstore, where MXNet puts it) and cut into slices.
struct Placing {
    /// Parameters placed on each server (index into the cluster's servers).
    load: Vec<usize>,
    shard_len: Vec<usize>,
    server_chunks: Vec<Vec<u32>>,
    chunks: Vec<Chunk>,
    slices: Vec<SliceInfo>,
    layer_chunks: Vec<Range<u32>>,
    layer_slices: Vec<Range<u32>>,
    chunk_slices: Vec<Range<u32>>,
    layer_offsets: Vec<usize>,
    /// Parameters of the layers placed so far.
    flat: usize,
}

impl Placing {
    fn new(servers: usize, world: usize) -> Placing {
        debug_assert!(
            servers >= 1 && servers <= world,
            "{servers} servers in a world of {world}"
        );
        Placing {
            load: vec![0; servers],
            shard_len: vec![0; world],
            server_chunks: vec![Vec::new(); world],
            chunks: Vec::new(),
            slices: Vec::new(),
            layer_chunks: Vec::new(),
            layer_slices: Vec::new(),
            chunk_slices: Vec::new(),
            layer_offsets: Vec::new(),
            flat: 0,
        }
    }

    /// The least-loaded server, lowest index on ties: even by bytes.
    fn least_loaded(&self) -> usize {
        debug_assert!(!self.load.is_empty(), "a cluster has a server");
        (0..self.load.len())
            .min_by_key(|&s| (self.load[s], s))
            .expect("at least one server")
    }

    /// Cuts layer `li` into chunks and places them, with their slices.
    fn place_layer(&mut self, li: u32, l: &LayerSpec, cfg: &BookConfig, cluster: &Cluster) {
        self.layer_offsets.push(self.flat);
        self.flat += l.params();
        let (c0, s0) = (self.chunks.len() as u32, self.slices.len() as u32);
        let mut off = 0;
        for (len, at) in self.cuts(l, cfg) {
            let si = at.unwrap_or_else(|| self.least_loaded());
            self.place_chunk(li, off, len, cluster.servers()[si], cfg);
            self.load[si] += len;
            off += len;
        }
        // The chunks tile the layer (and their slices, each chunk).
        debug_assert_eq!(off, l.params(), "{}: chunks cover {off} parameters", l.name);
        self.layer_chunks.push(c0..self.chunks.len() as u32);
        self.layer_slices.push(s0..self.slices.len() as u32);
    }

    /// (length, server index) of each chunk of a layer; `None`: the
    /// least-loaded server when its turn comes.
    fn cuts(&self, l: &LayerSpec, cfg: &BookConfig) -> Vec<(usize, Option<usize>)> {
        let chunk_params = cfg.chunk_bytes / 4;
        let nservers = self.load.len();
        debug_assert!(
            chunk_params >= 1 && l.params() >= 1,
            "check_inputs refused empty chunks and layers"
        );
        // Adam: the whole layer on one server (the least loaded now).
        let whole =
            (cfg.policy == SchemePolicy::Adam && l.kind == LayerKind::Fc && !l.sparse).then(|| self.least_loaded());
        match cfg.placement {
            Placement::Chunked => {
                let n = l.params().div_ceil(chunk_params);
                (0..n)
                    .map(|i| (chunk_params.min(l.params() - i * chunk_params), whole))
                    .collect()
            }
            Placement::KvStore if l.params() < KVSTORE_BIG_ARRAY => vec![(l.params(), None)],
            Placement::KvStore => (0..nservers)
                .map(|i| (kvstore_part(l.params(), nservers, i), Some(i)))
                .filter(|&(len, _)| len > 0)
                .collect(),
        }
    }

    /// One chunk of layer `li` (`len` parameters from `off`) on `server`,
    /// cut into slices of at most `min(slice_params, chunk_bytes / 4)`, as
    /// even as can be (under either placement: a kvstore chunk may be a
    /// whole layer, but its landing slot is one slice).
    fn place_chunk(&mut self, li: u32, off: usize, len: usize, server: u32, cfg: &BookConfig) {
        let cid = self.chunks.len() as u32;
        self.chunks.push(Chunk {
            layer: li,
            offset: off,
            len,
            server,
            shard_offset: self.shard_len[server as usize],
        });
        self.shard_len[server as usize] += len;
        self.server_chunks[server as usize].push(cid);
        let first = self.slices.len() as u32;
        let q = len.div_ceil(cfg.slice_params.min(cfg.chunk_bytes / 4));
        let (base, extra) = (len / q, len % q);
        let mut so = off;
        for i in 0..q {
            let sl = base + usize::from(i < extra);
            self.slices.push(SliceInfo {
                layer: li,
                chunk: cid,
                offset: so,
                len: sl,
            });
            so += sl;
        }
        debug_assert_eq!(so, off + len, "the slices tile the chunk");
        self.chunk_slices.push(first..self.slices.len() as u32);
    }
}

impl Book {
    /// Builds the book: chunks (spread evenly over the servers by bytes),
    /// slices, and the scheme of every layer.
    pub fn new(cluster: Cluster, layers: Vec<LayerSpec>, cfg: BookConfig) -> Result<Self> {
        check_inputs(&layers, &cfg)?;
        let mut p = Placing::new(cluster.servers().len(), cluster.world());
        for (li, l) in layers.iter().enumerate() {
            p.place_layer(li as u32, l, &cfg, &cluster);
        }
        if p.slices.len() as u64 >= u64::from(MAX_SLICES) {
            return Err(EngineError::InvalidConfig(format!(
                "{} slices: a push's immediate names at most 2^31 (raise slice_params)",
                p.slices.len()
            )));
        }
        let mut book = Book {
            cluster,
            layers,
            cfg,
            chunks: p.chunks,
            slices: p.slices,
            layer_chunks: p.layer_chunks,
            layer_slices: p.layer_slices,
            chunk_slices: p.chunk_slices,
            layer_offsets: p.layer_offsets,
            shard_len: p.shard_len,
            server_chunks: p.server_chunks,
            schemes: Vec::new(),
            plan: crate::plan::Plan::default(),
            rates: None,
            hash: 0,
        };
        book.schemes = (0..book.layers.len() as u32).map(|l| book.best_scheme(l)).collect();
        book.plan = crate::plan::Plan::new(book.schemes.clone());
        book.hash = book.compute_hash();
        book.debug_invariants();
        Ok(book)
    }

    /// What `new` builds (O(chunks + slices), once): chunks tile every layer
    /// and slices every chunk, none empty nor over its size (a slice under
    /// either placement, a chunk under the chunked one); Adam's layers lie
    /// whole on one server; every parameter is in one shard, evenly by bytes
    /// where each chunk went to the least-loaded server.
    fn debug_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let chunk_params = self.cfg.chunk_bytes / 4;
        let slice_params = self.cfg.slice_params.min(chunk_params);
        let chunked = self.cfg.placement == Placement::Chunked;
        debug_assert!(self.layer_chunks.len() == self.layers.len() && self.layer_slices.len() == self.layers.len());
        for (li, l) in self.layers.iter().enumerate() {
            let cs = self.layer_chunks[li].clone();
            debug_assert!(!cs.is_empty(), "layer {li} has chunks");
            let mut off = 0;
            for c in cs.clone() {
                let ch = &self.chunks[c as usize];
                let ok =
                    ch.layer == li as u32 && ch.offset == off && ch.len > 0 && (!chunked || ch.len <= chunk_params);
                debug_assert!(ok, "chunk {c}: {ch:?}");
                let mut so = off;
                for s in self.chunk_slices[c as usize].clone() {
                    let sl = &self.slices[s as usize];
                    let ok = sl.chunk == c && sl.offset == so && sl.len > 0 && sl.len <= slice_params;
                    debug_assert!(ok, "slice {s}: {sl:?}");
                    so += sl.len;
                }
                debug_assert_eq!(so, off + ch.len, "chunk {c}: its slices tile it");
                off += ch.len;
            }
            debug_assert_eq!(off, l.params(), "layer {li}: its chunks tile it");
            debug_assert_eq!(
                (self.layer_slices[li].start, self.layer_slices[li].end),
                (
                    self.chunk_slices[cs.start as usize].start,
                    self.chunk_slices[cs.end as usize - 1].end
                ),
                "layer {li}: its slices are its chunks'"
            );
            let adam = self.cfg.policy == SchemePolicy::Adam && l.kind == LayerKind::Fc && !l.sparse;
            let server = self.chunks[cs.start as usize].server;
            debug_assert!(
                !adam || cs.clone().all(|c| self.chunks[c as usize].server == server),
                "layer {li}"
            );
        }
        debug_assert_eq!(self.shard_len.iter().sum::<usize>(), self.total_params());
        let loads = self.cluster.servers().iter().map(|&s| self.shard_len[s as usize]);
        let spread = loads.clone().max().unwrap_or(0) - loads.min().unwrap_or(0);
        debug_assert!(
            !chunked || self.cfg.policy == SchemePolicy::Adam || spread <= chunk_params,
            "{spread}"
        );
    }

    /// Poseidon's BestScheme for `layer`: conv and other layers go to the PS;
    /// an FC layer takes the cheaper scheme by the cost model (bottleneck
    /// node), or the forced one.
    pub fn best_scheme(&self, layer: u32) -> Scheme {
        let l = &self.layers[layer as usize];
        if l.kind != LayerKind::Fc || l.sparse {
            return Scheme::Ps;
        }
        match self.cfg.policy {
            SchemePolicy::Ps => Scheme::Ps,
            SchemePolicy::Sfb => Scheme::Sfb,
            SchemePolicy::Adam => {
                // Adam's server rebuilds a whole layer: it holds every chunk of it.
                debug_assert_eq!(self.cfg.placement, Placement::Chunked);
                Scheme::Adam
            }
            SchemePolicy::Hybrid => {
                let sfb_cheaper = match self.seconds(layer) {
                    Some((ps, sfb)) => sfb.total() < ps.total(),
                    None => {
                        let (ps, sfb) = self.costs(layer);
                        sfb < ps
                    }
                };
                if sfb_cheaper {
                    Scheme::Sfb
                } else {
                    Scheme::Ps
                }
            }
        }
    }

    /// This book with HybComm deciding in seconds at `rates` (see
    /// [`cost::seconds`]) rather than in bytes: every FC layer's scheme is
    /// chosen again. The rates are the node's measured ones; ranks that
    /// decide differently are caught at rendezvous (the decision is part of
    /// the agreed scheme policy, [`Book::scheme_fingerprint`]).
    pub fn with_rates(mut self, rates: cost::Rates) -> Result<Self> {
        rates
            .validate()
            .map_err(|e| EngineError::InvalidConfig(e.to_string()))?;
        if self.plan.has_switches() {
            return Err(EngineError::InvalidConfig(
                "the rates choose the start-up schemes: give them before any switch".into(),
            ));
        }
        self.rates = Some(rates);
        self.schemes = (0..self.layers.len() as u32).map(|l| self.best_scheme(l)).collect();
        self.plan.set_first(self.schemes.clone());
        // The rates choose schemes, nothing of what the book hash covers.
        debug_assert_eq!(self.hash, self.compute_hash());
        Ok(self)
    }

    /// The rates HybComm decides with, if any ([`Book::with_rates`]).
    pub fn rates(&self) -> Option<&cost::Rates> {
        self.rates.as_ref()
    }

    /// (PS, SFB) seconds at the busiest node for an FC `layer` at the
    /// book's rates; `None` without rates or for a layer that is not FC.
    pub fn seconds(&self, layer: u32) -> Option<(cost::SchemeSeconds, cost::SchemeSeconds)> {
        self.seconds_at(layer, self.rates.as_ref()?)
    }

    /// (PS, SFB) seconds at the busiest node for an FC `layer` at rates `r`
    /// (the book's own, or rates measured in the run); `None` for a layer
    /// that is not FC.
    pub fn seconds_at(&self, layer: u32, r: &cost::Rates) -> Option<(cost::SchemeSeconds, cost::SchemeSeconds)> {
        let l = &self.layers[layer as usize];
        if l.kind != LayerKind::Fc || l.sparse {
            return None;
        }
        debug_assert!(self.p1() >= 1 && self.p2() >= 1 && !self.layer_slices(layer).is_empty());
        let load = cost::LayerLoad {
            colocated: self.cluster.is_colocated(),
            k: self.cfg.batch as u64,
            m: l.m as u64,
            n: l.n as u64,
            p1: self.p1() as u64,
            p2: self.p2() as u64,
            ps_messages: self.layer_slices(layer).len() as u64,
        };
        Some(cost::seconds(&load, r))
    }

    /// 0 when HybComm decides in bytes (no rates, or a policy other than
    /// hybrid); otherwise a nonzero 40-bit fingerprint of every layer's
    /// scheme, which the agreed scheme policy carries so that ranks whose
    /// measured rates led them to different schemes do not start.
    pub fn scheme_fingerprint(&self) -> u64 {
        if self.rates.is_none() || self.cfg.policy != SchemePolicy::Hybrid {
            return 0;
        }
        // FNV-1a over the schemes in layer order.
        let h = self.schemes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, s| {
            (h ^ *s as u64).wrapping_mul(0x0100_0000_01b3)
        });
        let fp = (h & 0xff_ffff_ffff) | 1;
        // 40 bits: the agreed policy field carries it above its 16 bits of policy and placement.
        debug_assert!(fp != 0 && fp >> 40 == 0);
        fp
    }

    /// (PS, SFB) parameters moved by the busiest node for `layer`.
    pub fn costs(&self, layer: u32) -> (u64, u64) {
        let l = &self.layers[layer as usize];
        cost::bottleneck(
            self.cluster.is_colocated(),
            self.cfg.batch as u64,
            l.m as u64,
            l.n as u64,
            self.p1() as u64,
            self.p2() as u64,
        )
    }

    /// The scheme `layer` syncs by in iteration `iter`: the start-up choice
    /// ([`Book::best_scheme`]), or the one a switch gave it
    /// ([`Book::with_switches`]).
    pub fn scheme(&self, layer: u32, iter: u64) -> Scheme {
        let s = self.plan.scheme(layer, iter);
        // Factors only for dense FC layers: the others always go through the PS.
        debug_assert!(
            !s.takes_factors() || {
                let l = &self.layers[layer as usize];
                l.kind == LayerKind::Fc && !l.sparse
            }
        );
        s
    }

    /// The start-up schemes and switches.
    pub fn plan(&self) -> &crate::plan::Plan {
        &self.plan
    }

    /// The cluster.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }
    /// P1: the number of workers.
    pub fn p1(&self) -> usize {
        debug_assert!(!self.cluster.workers().is_empty(), "a cluster has a worker");
        self.cluster.workers().len()
    }
    /// P2: the number of servers.
    pub fn p2(&self) -> usize {
        debug_assert!(!self.cluster.servers().is_empty(), "a cluster has a server");
        self.cluster.servers().len()
    }
    /// The layer table, in forward order.
    pub fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }
    /// One layer, or `UnknownLayer`.
    pub fn layer(&self, layer: u32) -> Result<&LayerSpec> {
        self.layers.get(layer as usize).ok_or(EngineError::UnknownLayer {
            layer,
            layers: self.layers.len() as u32,
        })
    }
    /// The sizes this book was built with.
    pub fn config(&self) -> &BookConfig {
        &self.cfg
    }
    /// All chunks; a chunk's index is its id. Ids ascend in forward order.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }
    /// All slices; a slice's index is its id, which is its priority within an
    /// iteration (forward index first, then sequence within the layer).
    pub fn slices(&self) -> &[SliceInfo] {
        &self.slices
    }
    /// Chunk ids of a layer.
    pub fn layer_chunks(&self, layer: u32) -> Range<u32> {
        let r = self.layer_chunks[layer as usize].clone();
        debug_assert!(!r.is_empty(), "layer {layer} has chunks");
        r
    }
    /// Slice ids of a layer.
    pub fn layer_slices(&self, layer: u32) -> Range<u32> {
        let r = self.layer_slices[layer as usize].clone();
        debug_assert!(!r.is_empty(), "layer {layer} has slices");
        r
    }
    /// Slice ids of a chunk.
    pub fn chunk_slices(&self, chunk: u32) -> Range<u32> {
        let r = self.chunk_slices[chunk as usize].clone();
        debug_assert!(!r.is_empty(), "chunk {chunk} has slices");
        r
    }
    /// Element offset of a layer in the flat model (all layers back to back).
    pub fn layer_offset(&self, layer: u32) -> usize {
        let l = layer as usize;
        // Prefix sums of the layers' parameters: every layer has some.
        debug_assert!(l == 0 || self.layer_offsets[l] > self.layer_offsets[l - 1]);
        self.layer_offsets[l]
    }
    /// Total parameters.
    pub fn total_params(&self) -> usize {
        let n = self.layers.iter().map(LayerSpec::params).sum();
        // The layer offsets are the prefix sums of the layers' parameters.
        debug_assert_eq!(
            Some(n),
            self.layers
                .last()
                .map(|l| self.layer_offsets[self.layers.len() - 1] + l.params())
        );
        n
    }
    /// Elements held by the shard on `rank` (0 for a worker-only rank).
    pub fn shard_len(&self, rank: u32) -> usize {
        self.shard_len.get(rank as usize).copied().unwrap_or(0)
    }
    /// Chunk ids owned by `rank`, in ascending (priority) order.
    pub fn server_chunks(&self, rank: u32) -> &[u32] {
        let c = self.server_chunks.get(rank as usize).map(Vec::as_slice).unwrap_or(&[]);
        // Ascending: a shard's local chunk order is the priority order.
        debug_assert!(c.windows(2).all(|w| w[0] < w[1]));
        c
    }
    /// The largest slice, in elements: the size of one landing slot.
    pub fn max_slice_len(&self) -> usize {
        let n = self.slices.iter().map(|s| s.len).max().unwrap_or(0);
        debug_assert!(n > 0, "a book has a slice");
        n
    }
    /// A digest of everything that must agree between ranks.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    fn compute_hash(&self) -> u64 {
        // FNV-1a over a canonical encoding.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut put = |bytes: &[u8]| {
            for b in bytes {
                h ^= u64::from(*b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        };
        for r in self.cluster.roles() {
            put(&[*r as u8]);
        }
        put(&(self.cfg.batch as u64).to_le_bytes());
        put(&(self.cfg.chunk_bytes as u64).to_le_bytes());
        put(&(self.cfg.slice_params as u64).to_le_bytes());
        put(&[self.cfg.policy as u8]);
        if self.cfg.placement != Placement::Chunked {
            // Only when not the default, so that existing books keep their hash.
            put(&[0xb0, self.cfg.placement as u8]);
            // Kvstore's layout, second revision: small layers by MXNet's key
            // hash and chunks cut into wire slices (the first placed by load
            // and sent a chunk as one slice). Shards differ: ranks (and
            // checkpoints) of the two must not meet.
            put(&[2]);
        }
        for l in &self.layers {
            put(l.name.as_bytes());
            put(&[0, l.kind as u8, l.dtype as u8, u8::from(l.sparse)]);
            put(&(l.m as u64).to_le_bytes());
            put(&(l.n as u64).to_le_bytes());
        }
        // Switches and decisions only when there are some, so that existing books keep their hash.
        if self.plan.every() > 0 {
            put(&[0xad]);
            put(&self.plan.every().to_le_bytes());
        }
        for sw in self.plan.switches() {
            put(&[0x5e, sw.scheme as u8]);
            put(&sw.layer.to_le_bytes());
            put(&sw.iter.to_le_bytes());
        }
        h
    }
}

mod switches;

#[cfg(test)]
mod tests {
    use super::*;

    fn layers() -> Vec<LayerSpec> {
        vec![
            LayerSpec::new("conv", LayerKind::Conv, 64, 27),
            LayerSpec::new("fc", LayerKind::Fc, 4096, 4096),
            LayerSpec::new("bias", LayerKind::Other, 1, 10),
        ]
    }

    #[test]
    fn chunks_and_slices_tile_every_layer() {
        let book = Book::new(Cluster::split(4, 3).unwrap(), layers(), BookConfig::default()).unwrap();
        for (li, l) in book.layers().iter().enumerate() {
            let mut next = 0;
            for c in book.layer_chunks(li as u32) {
                let ch = book.chunks()[c as usize];
                assert_eq!(ch.offset, next);
                assert!(ch.len * 4 <= book.config().chunk_bytes);
                let mut snext = ch.offset;
                for s in book.chunk_slices(c) {
                    let sl = book.slices()[s as usize];
                    assert_eq!((sl.offset, sl.chunk, sl.layer), (snext, c, li as u32));
                    assert!(sl.len <= 50_000);
                    snext += sl.len;
                }
                assert_eq!(snext, ch.offset + ch.len, "slices cover the chunk and never cross it");
                next += ch.len;
            }
            assert_eq!(next, l.params());
        }
    }

    fn rates(gemm_flop_per_s: f64, link_bytes_per_s: f64) -> cost::Rates {
        cost::Rates {
            link_bytes_per_s,
            msg_s: 10e-6,
            sum_bytes_per_s: 5e9,
            gemm_flop_per_s,
            host_ranks: 1,
            link_on_host: false,
            ps_builds_grad: false,
        }
    }

    #[test]
    fn hybrid_in_seconds_steps_aside_for_a_slow_gemm_and_agrees_with_bytes_on_a_slow_link() {
        let cfg = BookConfig {
            batch: 128,
            ..Default::default()
        };
        let bytes = Book::new(Cluster::split(4, 1).unwrap(), layers(), cfg).unwrap();
        assert_eq!(
            bytes.scheme(1, 0),
            Scheme::Sfb,
            "in bytes, SFB wins a 4096² layer at K = 128"
        );
        assert_eq!((bytes.scheme_fingerprint(), bytes.rates()), (0, None));
        assert!(bytes.seconds(1).is_none());
        // A CPU's GEMM beside a fast link: rebuilding 3 peers' gradients costs more than moving it.
        let cpu = bytes.clone().with_rates(rates(20e9, 3e9)).unwrap();
        assert_eq!(cpu.scheme(1, 0), Scheme::Ps);
        let (ps, sfb) = cpu.seconds(1).unwrap();
        assert!(ps.total() < sfb.total(), "{ps:?} {sfb:?}");
        // 1 Gbit/s and a GPU's GEMM: SFB, as the bytes say.
        let gpu = bytes.clone().with_rates(rates(50e12, 125e6)).unwrap();
        assert_eq!(gpu.scheme(1, 0), Scheme::Sfb);
        // Conv and other layers stay on the PS whatever the rates.
        for b in [&cpu, &gpu] {
            assert_eq!((b.scheme(0, 0), b.scheme(2, 0)), (Scheme::Ps, Scheme::Ps));
            assert!(b.seconds(0).is_none());
        }
        // Different decisions, different fingerprints; the values' hash is untouched.
        assert_ne!(cpu.scheme_fingerprint(), gpu.scheme_fingerprint());
        assert_ne!(cpu.scheme_fingerprint(), 0);
        assert_eq!(cpu.hash(), bytes.hash());
        // A forced policy is not decided: no fingerprint.
        let forced = Book::new(
            Cluster::split(4, 1).unwrap(),
            layers(),
            BookConfig {
                policy: SchemePolicy::Sfb,
                ..cfg
            },
        )
        .unwrap()
        .with_rates(rates(1.0, 3e9))
        .unwrap();
        assert_eq!((forced.scheme(1, 0), forced.scheme_fingerprint()), (Scheme::Sfb, 0));
        assert!(bytes.with_rates(rates(f64::INFINITY, 1.0)).is_err());
    }

    #[test]
    fn chunks_spread_evenly() {
        let book = Book::new(Cluster::split(2, 3).unwrap(), layers(), BookConfig::default()).unwrap();
        let loads: Vec<usize> = book.cluster().servers().iter().map(|&s| book.shard_len(s)).collect();
        let (lo, hi) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
        assert!(hi - lo <= book.config().chunk_bytes / 4, "{loads:?}");
        assert_eq!(loads.iter().sum::<usize>(), book.total_params());
    }

    /// Kvstore's book as `--sync kvstore` builds it (`SyncMode::book_config`):
    /// unsliced sizes, a wire slice at most a 2 MiB chunk's worth.
    fn kvstore_cfg() -> BookConfig {
        BookConfig {
            placement: Placement::KvStore,
            slice_params: (2 << 20) / 4,
            ..Default::default()
        }
    }

    #[test]
    fn kvstore_places_small_layers_least_loaded_and_splits_big_ones_as_mxnet_rounds() {
        let layers = vec![
            LayerSpec::new("a", LayerKind::Conv, 100, 1000),  // 10^5
            LayerSpec::new("big", LayerKind::Fc, 1000, 1000), // exactly 10^6: split
            LayerSpec::new("b", LayerKind::Conv, 999, 1001),  // 999,999: whole
            LayerSpec::new("c", LayerKind::Other, 1, 10),
            LayerSpec::new("huge", LayerKind::Fc, 4096, 1001), // split, not divisible by 3
        ];
        let cfg = kvstore_cfg();
        let c = Cluster::split(2, 3).unwrap();
        let book = Book::new(c.clone(), layers.clone(), cfg).unwrap();
        let servers = c.servers().to_vec();
        let ch = |l: u32| -> Vec<Chunk> { book.layer_chunks(l).map(|i| book.chunks()[i as usize]).collect() };
        // Small layers whole, each on the least-loaded server at its turn:
        // a on 0 (all empty); after big's thirds, b on 2 (333,333, the
        // least); then c on 1 (333,334 against 433,333 and 1,333,332).
        for (l, s) in [(0, 0), (2, 2), (3, 1)] {
            assert_eq!(ch(l).len(), 1, "layer {l}");
            assert_eq!(ch(l)[0].server, servers[s], "layer {l}");
        }
        assert_eq!(ch(2)[0].len, 999_999);
        // 10^6 over three servers, MXNet's round(10^6 / 3 × (i + 1)) − round(10^6 / 3 × i), chunk i on server i.
        let big = ch(1);
        assert_eq!(
            big.iter().map(|c| c.len).collect::<Vec<_>>(),
            vec![333_333, 333_334, 333_333]
        );
        assert_eq!(big.iter().map(|c| c.server).collect::<Vec<_>>(), servers);
        // 4,100,096 / 3 = 1,366,698.67: 1,366,699, 2,733,397 and 4,100,096 rounded.
        assert_eq!(
            ch(4).iter().map(|c| c.len).collect::<Vec<_>>(),
            vec![1_366_699, 1_366_698, 1_366_699]
        );
        // Chunks cut into wire slices of at most 2 MiB, as even as can be.
        let slice_max = (2 << 20) / 4;
        // The largest: layer b's 999,999 in two (huge's 1,366,699 go in three of 455,567).
        assert_eq!(book.max_slice_len(), 500_000);
        for (i, c) in book.chunks().iter().enumerate() {
            let ss: Vec<SliceInfo> = book.chunk_slices(i as u32).map(|s| book.slices()[s as usize]).collect();
            assert_eq!(ss.len(), c.len.div_ceil(slice_max), "chunk {i}");
            assert_eq!(
                (ss[0].offset, ss.iter().map(|s| s.len).sum::<usize>()),
                (c.offset, c.len)
            );
            assert!(ss.iter().all(|s| s.len <= slice_max && s.len + 1 >= c.len / ss.len()));
        }
        // Ranks agree on it: the placement is in the hash.
        let chunked = Book::new(c, layers, BookConfig::default()).unwrap();
        assert_ne!(book.hash(), chunked.hash());
        assert!(chunked.layer_chunks(0).len() == 1 && chunked.layer_chunks(1).len() == 2);
    }

    #[test]
    fn kvstore_parts_are_mxnets() {
        // MXNet computes round(size / n × (i + 1)) − round(size / n × i) in doubles.
        for (size, n) in [
            (1_000_000, 3),
            (102_760_448, 4),
            (1_000_001, 7),
            (16_777_217, 16),
            (5, 4),
        ] {
            let parts: Vec<usize> = (0..n).map(|i| kvstore_part(size, n, i)).collect();
            let mx: Vec<usize> = (0..n)
                .map(|i| {
                    let x = size as f64 / n as f64;
                    (x * (i + 1) as f64).round() as usize - (x * i as f64).round() as usize
                })
                .collect();
            assert_eq!(parts, mx, "{size} over {n}");
            assert_eq!(parts.iter().sum::<usize>(), size);
        }
    }

    #[test]
    fn schemes_follow_the_policy() {
        let c = Cluster::colocated(8).unwrap();
        let hybrid = Book::new(c.clone(), layers(), BookConfig::default()).unwrap();
        assert_eq!(hybrid.scheme(0, 0), Scheme::Ps);
        assert_eq!(hybrid.scheme(1, 0), Scheme::Sfb);
        assert_eq!(hybrid.scheme(2, 0), Scheme::Ps);
        let ps = Book::new(
            c,
            layers(),
            BookConfig {
                policy: SchemePolicy::Ps,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(ps.scheme(1, 0), Scheme::Ps);
    }

    #[test]
    fn hash_sees_the_layer_table() {
        let c = Cluster::split(2, 1).unwrap();
        let a = Book::new(c.clone(), layers(), BookConfig::default()).unwrap();
        let mut l = layers();
        l[1].n = 4095;
        let b = Book::new(c, l, BookConfig::default()).unwrap();
        assert_ne!(a.hash(), b.hash());
    }

    #[test]
    fn bad_tables_are_typed_errors() {
        let c = Cluster::split(1, 1).unwrap();
        assert!(matches!(
            Book::new(c.clone(), vec![], BookConfig::default()),
            Err(EngineError::InvalidConfig(_))
        ));
        let mut l = layers();
        l[0].dtype = DType::Bf16;
        assert!(matches!(
            Book::new(c, l, BookConfig::default()),
            Err(EngineError::UnsupportedDType { .. })
        ));
        assert!(Cluster::split(0, 1).is_err());
    }
}
