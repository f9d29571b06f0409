//! Scheduling and consistency settings shared by the worker and server cores.

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// Consistency model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    /// Bulk synchronous: iteration t+1 starts on parameters that include every
    /// worker's iteration-t gradients.
    Bsp,
    /// Stale synchronous with bound `s`: a worker may run at most `s`
    /// iterations ahead of the slowest worker's pushed gradients.
    Ssp(u32),
}

impl std::fmt::Display for Consistency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.name();
        // What it prints, `--consistency` reads back.
        debug_assert_eq!(Consistency::parse(&n), Some(*self), "{n}");
        f.write_str(&n)
    }
}

impl Consistency {
    /// Parses `bsp` or `ssp:S`.
    pub fn parse(s: &str) -> Option<Consistency> {
        if s == "bsp" {
            return Some(Consistency::Bsp);
        }
        let c = s.strip_prefix("ssp:")?.parse().ok().map(Consistency::Ssp);
        debug_assert!(c.map_or(true, |c| matches!(c, Consistency::Ssp(_))));
        c
    }
    /// Its name, as [`Consistency::parse`] reads it.
    pub fn name(self) -> String {
        let n = match self {
            Consistency::Bsp => "bsp".to_string(),
            Consistency::Ssp(s) => format!("ssp:{s}"),
        };
        debug_assert!(n.starts_with("bsp") || n.starts_with("ssp:"));
        n
    }
    /// The staleness bound (0 for BSP).
    pub fn staleness(self) -> u64 {
        match self {
            Consistency::Bsp => 0,
            Consistency::Ssp(s) => u64::from(s),
        }
    }
}

/// The order in which a worker's queued slices go out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueOrder {
    /// P3: the layer the next forward pass needs first goes first
    /// (forward index, then slice sequence; earlier iterations before later).
    Priority,
    /// In the order the gradients became ready (WFBP without priorities).
    Fifo,
}

/// When a server applies a chunk's iteration (Nexus's job-defined aggregation
/// trigger). Every trigger but [`Trigger::All`] needs BSP consistency
/// (`Consistency::Bsp`), a fold group of 1, and PS layers only (an SFB layer
/// needs every worker's factors); [`SchedConfig::validate`] and
/// [`crate::node::Node::new`] refuse the rest. Under those triggers:
///
/// - Contributions are summed in arrival order (`deterministic` does not apply).
/// - A worker *contributes* to a chunk's round once every slice of the chunk
///   from it is in. A round is never applied while a worker's contribution is
///   half in (its remaining slices are already on their way), so every slice
///   of an applied chunk holds the same contributors.
/// - The apply divides by the gradients actually in the sum (contributors ×
///   `learners`): the mean over the contributors ([`ApplyOp::Mean`] and
///   [`ApplyOp::Sgd`]); [`ApplyOp::Sum`] stays the plain sum.
/// - A **late** contribution is one for an iteration the server already
///   applied. [`Trigger::Quorum`] and [`Trigger::Timeout`] **drop** it: its
///   landing slot's credit goes back at once and the server counts it
///   ([`crate::server::ServerStats::dropped`]). [`Trigger::Async`] **folds it
///   into the round in progress** (no gradient is ever thrown away).
/// - Every applied version is broadcast to every worker, slow ones included.
///   A worker's wait for iteration t is satisfied by any version at least as
///   new as t + 1, so a late worker never waits on a round it missed. Its
///   caller reads a view published when a layer is ready (as under SSP), so a
///   broadcast never lands in memory the caller holds.
/// - A worker rank that is not also a server may be lost (its connection
///   fails): the servers stop counting it and the others go on, as long as
///   the trigger can still fire (at least `k` live workers for a quorum). A
///   worker lost with half a contribution in a round fails the job with an
///   error naming it. Under [`Trigger::All`] any lost rank fails the job.
/// - Such a lost worker may come back ([`crate::node::Node::rejoin`]): it
///   takes the current parameters from the servers and is counted again;
///   its contributions count from each chunk's iteration when it came back
///   (so they are on time when it keeps up, and late otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// BSP: apply once every worker's contribution is in (the default).
    #[default]
    All,
    /// Apply once `k` workers' contributions of every slice of the chunk are
    /// in (1 ≤ k ≤ P1). Late contributions are dropped.
    Quorum(u32),
    /// Downpour: apply as soon as one worker's whole contribution of the
    /// chunk is in (with whatever else arrived meanwhile), scaled by the mean
    /// over the contributions in it; late contributions fold into the next round.
    Async,
    /// After the first contribution of a chunk's round arrives, wait this
    /// long (or until every live worker's is in), then apply what is in,
    /// scaled by the mean over the contributors. Late contributions are dropped.
    Timeout(std::time::Duration),
}

impl std::fmt::Display for Trigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.name();
        // One word on a command line, as `--trigger` takes it.
        debug_assert!(!n.is_empty() && !n.contains(char::is_whitespace), "{n:?}");
        f.write_str(&n)
    }
}

impl Trigger {
    /// Parses `all`, `quorum:K`, `async` or `timeout:MS` (milliseconds, may be fractional).
    pub fn parse(s: &str) -> Option<Trigger> {
        Some(match s {
            "all" => Trigger::All,
            "async" => Trigger::Async,
            _ => {
                if let Some(k) = s.strip_prefix("quorum:") {
                    Trigger::Quorum(k.parse().ok()?)
                } else {
                    let ms: f64 = s.strip_prefix("timeout:")?.parse().ok()?;
                    if !(ms.is_finite() && ms > 0.0 && ms < 1e9) {
                        return None;
                    }
                    Trigger::Timeout(std::time::Duration::from_nanos((ms * 1e6) as u64))
                }
            }
        })
    }
    /// Its name, as [`Trigger::parse`] reads it.
    pub fn name(self) -> String {
        let n = match self {
            Trigger::All => "all".into(),
            Trigger::Quorum(k) => format!("quorum:{k}"),
            Trigger::Async => "async".into(),
            Trigger::Timeout(d) => format!("timeout:{}", d.as_secs_f64() * 1e3),
        };
        // `parse` reads it back (a timeout up to the rounding of its milliseconds).
        debug_assert!(
            matches!(self, Trigger::Timeout(_)) || Trigger::parse(&n) == Some(self),
            "{n}"
        );
        n
    }
    /// Its rendezvous encoding (see [`crate::agree`]).
    pub fn encode(self) -> u64 {
        match self {
            Trigger::All => 0,
            Trigger::Quorum(k) => 1 << 56 | u64::from(k),
            Trigger::Async => 2 << 56,
            Trigger::Timeout(d) => 3 << 56 | (d.as_nanos() as u64 & ((1 << 56) - 1)),
        }
    }
}

/// Settings of the worker and server cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SchedConfig {
    /// Send order.
    pub order: QueueOrder,
    /// Credit window: bytes a worker (and a server's broadcaster) may have in
    /// flight. One item larger than the window still goes when nothing else is
    /// in flight. Under kvstore a server's window is at least an answer of its
    /// largest part to every worker (MXNet answers every pull at once).
    pub credit_bytes: usize,
    /// Landing-slot credits a worker holds per server: at most this many of
    /// its pushes to one server are in flight or waiting to be read.
    /// [`SLOTS_AUTO`] (the default) sizes them from the book
    /// ([`SchedConfig::resolve`]): `SLOT_CREDIT_WINDOWS` reference credit windows of
    /// the largest slice per server, from 8 to 32 slots.
    pub slots: u32,
    /// Spare landing slots each server keeps per worker beyond `slots`, for
    /// the deterministic order: a push that lands before a lower rank's
    /// contribution to the same slice is *parked* (it stays where it landed
    /// until its turn), and the worker gets a spare slot's credit at once, so
    /// rank order holds no credit and never stalls the worker's priority
    /// queue. Only when a worker's spares are all parked does a landed push
    /// hold its own credit until its turn. A server keeps `(slots +
    /// spare_slots) × P1` landing slots. [`SPARE_AUTO`] (the default) sizes
    /// them from the book ([`SchedConfig::resolve`]): enough to park
    /// `SPARE_CREDIT_WINDOWS` reference credit windows ([`REFERENCE_CREDIT_BYTES`]) of the largest slice, from 1 to 256.
    pub spare_slots: u32,
    /// Consistency model.
    pub consistency: Consistency,
    /// Sum in fixed worker-rank order (bitwise reproducible) rather than arrival
    /// order. Applies under BSP; SSP always sums in arrival order.
    pub deterministic: bool,
    /// Deterministic order in groups (Nexus's nodes): workers `g·G..(g+1)·G`
    /// are summed in rank order into a partial sum first, and the partial sums
    /// are folded in group order, exactly as a node-local aggregator with `G`
    /// learners and its leader would. So a flat run with `fold_group = G`
    /// gives bitwise the parameters of the hierarchical run with `G` local
    /// learners per worker. 1 (the default) is the plain worker order.
    pub fold_group: u32,
    /// Learners behind every worker rank (Nexus's local learners: a worker
    /// pushes the sum of its node's `learners` gradients). The mean and SGD
    /// divide the sum by workers × learners, the number of gradients in it.
    pub learners: u32,
    /// When a server applies a chunk's iteration ([`Trigger`]; `All` is BSP).
    pub trigger: Trigger,
}

impl Default for SchedConfig {
    fn default() -> Self {
        let c = SchedConfig {
            order: QueueOrder::Priority,
            credit_bytes: 8 << 20,
            slots: SLOTS_AUTO,
            spare_slots: SPARE_AUTO,
            consistency: Consistency::Bsp,
            deterministic: true,
            fold_group: 1,
            learners: 1,
            trigger: Trigger::All,
        };
        debug_assert!(c.validate().is_ok());
        c
    }
}

/// [`SchedConfig::slots`]: size them from the book.
pub const SLOTS_AUTO: u32 = u32::MAX;
/// The credit window the automatic slot sizes count in: the default 8 MiB,
/// not each rank's own `credit_bytes`, so that the sizes follow from the book
/// alone (every rank must agree on them, and `credit_bytes` is a rank's own).
pub const REFERENCE_CREDIT_BYTES: usize = 8 << 20;
/// Credit windows' worth of slices a worker may have in flight to one server
/// ([`SLOTS_AUTO`]), measured with `tidewire sim --sync p3` over P3's sweep
/// (EVAL.md, 4 nodes, 1-30 Gbit/s) and its scalability runs (2-16 nodes at
/// 10 Gbit/s): 8 slots of 200 kB per server (1.6 MB) left Sockeye at 8-20
/// Gbit/s 2-4% behind WFBP, and ResNet-50 and Inception-V3 at 1-3 Gbit/s 3-10%
/// behind 16 slots; 11 slots on 8 servers left Sockeye 1.2% behind WFBP; 16,
/// 24 and 32 were within 1% of each other. Half an 8 MiB window is 21 slots
/// of 200 kB; slices of 2 MiB (the unsliced modes) keep 8.
pub const SLOT_CREDIT_WINDOWS: f64 = 0.5;
/// [`SchedConfig::spare_slots`]: size them from the book.
pub const SPARE_AUTO: u32 = u32::MAX;
/// Credit windows' worth of slices a worker may have parked at one server
/// ([`SPARE_AUTO`]), measured with `tidewire sim --sync p3` over P3's sweep
/// (EVAL.md, 4 nodes, 1-30 Gbit/s): with 1 window (42 spares of 200 kB) the
/// rank order still held credits often enough to leave Inception-V3 at
/// 2 Gbit/s 3.6% behind the arrival-order run; with 1.5 (63 spares) 1.2%.
/// The cost is memory: `(slots + spares) × P1` slices per server.
pub const SPARE_CREDIT_WINDOWS: f64 = 1.5;

impl SchedConfig {
    /// Landing slots a server keeps per worker: `slots + spare_slots`
    /// (resolved: see [`SchedConfig::resolve`]).
    pub fn landing_slots(&self) -> u32 {
        debug_assert!(
            self.spare_slots != SPARE_AUTO && self.slots != SLOTS_AUTO,
            "slots not resolved"
        );
        self.slots.saturating_add(self.spare_slots)
    }

    /// Bytes of broadcasts a server (`rank`) has out at once: the credit
    /// window, or under kvstore one answer to every worker's pull of its
    /// largest part. MXNet's server (ps-lite over ZMQ) answers each pull as
    /// it comes, on that worker's own connection, and the answers share its
    /// link; with the credit window a server sent its 51 MB part of VGG19's
    /// fc6 to one worker after another, and each worker took its parts from
    /// the 8 servers in turn. The answers are sent from the parameters
    /// (zero-copy), which stay until every pull of the version is placed: no
    /// extra memory holds data.
    pub fn bcast_window(&self, book: &crate::book::Book, rank: u32) -> usize {
        if book.config().placement != crate::book::Placement::KvStore {
            return self.credit_bytes;
        }
        let largest = book
            .server_chunks(rank)
            .iter()
            .map(|&c| book.chunks()[c as usize].len * 4)
            .max()
            .unwrap_or(0);
        let window = self.credit_bytes.max(largest.saturating_mul(book.p1()));
        // Every worker's answer of the largest part fits at once.
        debug_assert!(window >= self.credit_bytes && (window == usize::MAX || window / book.p1().max(1) >= largest));
        window
    }

    /// Bytes of a server's landing region, where its workers' pushes land
    /// (what the runtime allocates and registers as
    /// [`crate::node::LocalRegion::Landing`]): P1 × [`Self::landing_slots`]
    /// slots of the largest slice ([`crate::book::Book::max_slice_len`]).
    /// Slots are bounded (8 to 32 credits, 1 to 256 spares) and so is a
    /// slice (`chunk_bytes`), so this grows with P1 and never with P1 ×
    /// the model's size. On a resolved config ([`Self::resolve`]).
    pub fn landing_bytes(&self, book: &crate::book::Book) -> u64 {
        let slot_bytes = book.max_slice_len() as u64 * 4;
        let n = book.p1() as u64 * u64::from(self.landing_slots()) * slot_bytes;
        // Every worker has a slot at least.
        debug_assert!(n >= slot_bytes * book.p1() as u64 && slot_bytes > 0);
        n
    }

    /// The settings with [`SLOTS_AUTO`] and [`SPARE_AUTO`] replaced by the
    /// slots this book needs: `SLOT_CREDIT_WINDOWS × REFERENCE_CREDIT_BYTES` of its
    /// largest slice per server (8 to 32), and spares for
    /// `SPARE_CREDIT_WINDOWS × REFERENCE_CREDIT_BYTES` of it (1 to 256).
    pub fn resolve(mut self, book: &crate::book::Book) -> Self {
        if self.slots == SLOTS_AUTO {
            let slot = (book.max_slice_len() * 4).max(1) as f64;
            let per_server = SLOT_CREDIT_WINDOWS * REFERENCE_CREDIT_BYTES as f64;
            self.slots = (per_server / slot).ceil().clamp(8.0, 32.0) as u32;
        }
        if self.spare_slots == SPARE_AUTO {
            let slot = (book.max_slice_len() * 4).max(1) as f64;
            let n = (SPARE_CREDIT_WINDOWS * REFERENCE_CREDIT_BYTES as f64 / slot).ceil();
            self.spare_slots = n.clamp(1.0, 256.0) as u32;
        }
        debug_assert!(self.slots != SLOTS_AUTO && self.spare_slots != SPARE_AUTO);
        self
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        if self.slots == 0 {
            return Err(EngineError::InvalidConfig("slots must be at least 1".into()));
        }
        if self.spare_slots != SPARE_AUTO
            && self.slots != SLOTS_AUTO
            && self.slots.checked_add(self.spare_slots).map_or(true, |t| t > 1 << 16)
        {
            return Err(EngineError::InvalidConfig(
                "slots + spare_slots must be at most 65536".into(),
            ));
        }
        if self.credit_bytes == 0 {
            return Err(EngineError::InvalidConfig("credit_bytes must be at least 1".into()));
        }
        if self.fold_group == 0 || self.learners == 0 {
            return Err(EngineError::InvalidConfig(
                "fold_group and learners must be at least 1".into(),
            ));
        }
        if self.consistency.staleness() > 64 {
            return Err(EngineError::InvalidConfig(
                "SSP staleness above 64 is not supported".into(),
            ));
        }
        match self.trigger {
            Trigger::All => {}
            t => {
                if self.consistency != Consistency::Bsp {
                    return Err(EngineError::InvalidConfig(format!(
                        "the {} trigger needs BSP consistency (a late contribution has no SSP window to land in)",
                        t.name()
                    )));
                }
                if self.fold_group != 1 {
                    return Err(EngineError::InvalidConfig(format!(
                        "the {} trigger sums in arrival order: fold_group must be 1",
                        t.name()
                    )));
                }
                match t {
                    Trigger::Quorum(0) => {
                        return Err(EngineError::InvalidConfig("a quorum of 0 workers: give k ≥ 1".into()))
                    }
                    Trigger::Timeout(d) if d.is_zero() => {
                        return Err(EngineError::InvalidConfig(
                            "a timeout of 0: give a positive timeout".into(),
                        ))
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

/// The sync modes the papers ablate, as one switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncMode {
    /// Compute the whole backward pass, then communicate (PS only, no slicing).
    FifoPs,
    /// Wait-free backprop: each layer syncs as soon as its backward ends (PS, FIFO).
    Wfbp,
    /// WFBP + HybComm (PS or SFB per layer, FIFO).
    Hybrid,
    /// WFBP + P3 slicing, sent in the order the slices became ready (PS
    /// only): P3's "slicing only" ablation.
    Sliced,
    /// WFBP + P3 slicing + priority (PS only).
    P3,
    /// Everything: WFBP + HybComm + slicing + priority.
    Full,
    /// MXNet's KVStore, the baseline P3 measures against (P3, SysML'19, §4.1):
    /// WFBP send order (each layer pushed as its backward ends, FIFO, no
    /// priority), PS only, no P3 slicing, and [`crate::book::Placement::KvStore`]:
    /// a layer under 10^6 parameters (MXNet's `MXNET_KVSTORE_BIGARRAY_BOUND`)
    /// is one key on the least-loaded server, a larger one is split
    /// equally across all servers. A key's push travels as wire slices of at
    /// most 2 MiB (P3 §4.1: the KVWorker "serializes (and fragments in case
    /// of large layers) the gradient matrix"), FIFO, so the layer still goes
    /// as one unit in order; a server's landing slots are those slices. A
    /// split layer's parts go side by side, a slice to each server in turn,
    /// as ps-lite's `ZPush` sends every server its part at once.
    ///
    /// Servers do not broadcast: when a server applies a chunk it sends every
    /// worker a `Notify` ([`crate::wire::Msg::Notify`], MXNet's push
    /// acknowledgement); a worker pulls a layer only once every chunk of it,
    /// from every server, was notified, with one `Pull` per chunk, and the
    /// server answers each pull, in arrival order, by writing the chunk's
    /// values (the broadcast write, chunk id as the immediate); its
    /// broadcast window holds an answer of its largest part to every worker
    /// (MXNet's server answers each pull on that worker's connection, all at
    /// once). `docs/src/papers.md` measures what sending the parts and the
    /// answers one after another cost.
    ///
    /// No bidirectional overlap within a layer: the pull of layer l starts
    /// only after its push round trip is complete (every worker's push of the
    /// whole layer reached its servers and was applied), so a layer's pull
    /// traffic never overlaps its own push. Pulls of one layer may overlap
    /// the pushes of other layers, as MXNet's push and pull are per key.
    /// This is the point P3 makes when it motivates slicing (with a whole
    /// layer as the unit, one direction of the link idles while the other
    /// carries the layer). P3 §4.1: "Once the parameters are updated
    /// KVServer notifies all the workers and resets the counter for that
    /// key-value pair. When KVWorker receives a notification, it immediately
    /// issues a Pull request to the KVServer(s) for the corresponding
    /// updated parameter values"; stock MXNet `dist_sync`
    /// (`kvstore_dist.h`) and the P3 artifact (anandj91/p3) do the same.
    ///
    /// BSP and the `all` trigger only ([`crate::node::Node::new`] refuses SSP
    /// and the other triggers: a notification names one version, and a pull
    /// round per version is what `dist_sync` does).
    KvStore,
    /// Project Adam's strategy, the baseline of Poseidon's traffic figure
    /// (Poseidon, ATC'17, §3.2, Fig. 10): WFBP send order (FIFO), no slicing,
    /// [`crate::book::Scheme::Adam`] for every dense FC layer and the PS for
    /// the rest. A worker sends an FC layer's sufficient factors to the one
    /// server holding the whole layer, which sums Σ_p U_pᵀ·V_p in worker
    /// order (bitwise what the PS sums from the gradients U_pᵀ·V_p in rank
    /// order), applies it and broadcasts the full matrix.
    ///
    /// BSP and the `all` trigger only ([`crate::node::Node::new`] refuses the
    /// rest: the server rebuilds a layer from every worker's factors of one
    /// iteration).
    Adam,
}

impl std::fmt::Display for SyncMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // What it prints, `--sync` reads back.
        debug_assert_eq!(SyncMode::parse(self.name()), Some(*self));
        f.write_str(self.name())
    }
}

impl SyncMode {
    /// All modes, in the papers' order.
    pub const ALL: [SyncMode; 8] = [
        SyncMode::FifoPs,
        SyncMode::Wfbp,
        SyncMode::Hybrid,
        SyncMode::Sliced,
        SyncMode::P3,
        SyncMode::Full,
        SyncMode::KvStore,
        SyncMode::Adam,
    ];

    /// Parses `fifo-ps`, `wfbp`, `hybrid`, `sliced`, `p3`, `full`, `kvstore` or `adam`.
    pub fn parse(s: &str) -> Option<Self> {
        let m = match s {
            "fifo-ps" => SyncMode::FifoPs,
            "wfbp" => SyncMode::Wfbp,
            "hybrid" => SyncMode::Hybrid,
            "sliced" => SyncMode::Sliced,
            "p3" => SyncMode::P3,
            "full" => SyncMode::Full,
            "kvstore" => SyncMode::KvStore,
            "adam" => SyncMode::Adam,
            _ => return None,
        };
        debug_assert_eq!(m.name(), s, "parse and name agree");
        Some(m)
    }
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            SyncMode::FifoPs => "fifo-ps",
            SyncMode::Wfbp => "wfbp",
            SyncMode::Hybrid => "hybrid",
            SyncMode::Sliced => "sliced",
            SyncMode::P3 => "p3",
            SyncMode::Full => "full",
            SyncMode::KvStore => "kvstore",
            SyncMode::Adam => "adam",
        }
    }
    /// The scheme policy.
    pub fn policy(self) -> crate::book::SchemePolicy {
        match self {
            SyncMode::Hybrid | SyncMode::Full => crate::book::SchemePolicy::Hybrid,
            SyncMode::Adam => crate::book::SchemePolicy::Adam,
            _ => crate::book::SchemePolicy::Ps,
        }
    }
    /// The queue order.
    pub fn order(self) -> QueueOrder {
        match self {
            SyncMode::P3 | SyncMode::Full => QueueOrder::Priority,
            _ => QueueOrder::Fifo,
        }
    }
    /// Whether layers are cut into P3 slices (otherwise a slice is `chunk_bytes`'
    /// worth: a whole chunk, or a piece of one of kvstore's larger chunks).
    pub fn sliced(self) -> bool {
        matches!(self, SyncMode::Sliced | SyncMode::P3 | SyncMode::Full)
    }
    /// The KV chunk size this mode uses unless told otherwise, for slices of
    /// `slice_params`: in the sliced modes a chunk is one slice, so a server
    /// applies and broadcasts each slice as soon as its contributions are in,
    /// as P3's server does (it keys every slice); in the others Poseidon's
    /// 2 MiB. Slices under 64 KiB are grouped, whole, into chunks of at least
    /// 64 KiB, and no chunk exceeds 2 MiB: a 1,000-parameter slice on
    /// VGG19-22K would otherwise make 229,000 chunks, each applied and
    /// broadcast on its own.
    ///
    /// Measured (`tidewire sim`, P3 against WFBP; EVAL.md's sweep): with
    /// 2 MiB chunks (groups of ten 200 kB slices) P3 lost to WFBP where few
    /// servers serve many workers, because a server's outgoing link waited
    /// for whole groups: ResNet-152 on 12 workers and 2 servers at 5 Gbit/s
    /// (P4000) was 0.92× WFBP, Sockeye on 12 + 2 at 40 GbE 0.94×, ResNet-50
    /// on 8 + 2 at 8 Gbit/s 0.97×. One slice per chunk made them 1.02×,
    /// 1.09× and 1.17×; groups of 2 slices left ResNet-152 at 0.98×. On
    /// EVAL.md's 4-node sweep it is within −4.4% (ResNet-50 at 4 Gbit/s) to
    /// +2.3% of 2 MiB, and P3 stays ≥ WFBP everywhere.
    ///
    /// ```
    /// use tidewire_engine::SyncMode;
    /// assert_eq!(SyncMode::P3.default_chunk_bytes(50_000), 200_000);
    /// assert_eq!(SyncMode::P3.default_chunk_bytes(10_000_000), 2 << 20);
    /// // 1,000-parameter slices: 17 to a chunk (68,000 bytes ≥ 64 KiB).
    /// assert_eq!(SyncMode::P3.default_chunk_bytes(1_000), 68_000);
    /// assert_eq!(SyncMode::Wfbp.default_chunk_bytes(50_000), 2 << 20);
    /// ```
    pub fn default_chunk_bytes(self, slice_params: usize) -> usize {
        const POSEIDON: usize = 2 << 20;
        const MIN: usize = 64 << 10;
        if !self.sliced() {
            return POSEIDON;
        }
        let slice = slice_params.clamp(1, POSEIDON / 4) * 4;
        let chunk = (slice * MIN.div_ceil(slice)).min(POSEIDON / slice * slice);
        // Whole slices, at most 2 MiB, at least 64 KiB where 2 MiB allows.
        debug_assert!(chunk % slice == 0 && chunk <= POSEIDON);
        debug_assert!(chunk >= MIN.min(POSEIDON / slice * slice));
        chunk
    }
    /// Whether a layer is handed in as soon as its backward ends.
    pub fn wait_free(self) -> bool {
        self != SyncMode::FifoPs
    }
    /// The book sizes for this mode, from the sliced defaults.
    pub fn book_config(self, mut base: crate::book::BookConfig) -> crate::book::BookConfig {
        base.policy = self.policy();
        if !self.sliced() {
            base.slice_params = base.chunk_bytes / 4;
        }
        base.placement = match self {
            SyncMode::KvStore => crate::book::Placement::KvStore,
            _ => crate::book::Placement::Chunked,
        };
        // Unsliced, a slice is a whole chunk.
        debug_assert!(self.sliced() || base.slice_params * 4 == base.chunk_bytes / 4 * 4);
        base
    }
}

/// What a server does with a chunk once every contribution is summed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum ApplyOp {
    /// Reduce only: the output is the sum of the gradients.
    Sum,
    /// Reduce only: the output is the mean (sum × 1/P1).
    Mean,
    /// Caffe/Poseidon SGD on the mean gradient g:
    /// `v = momentum·v + lr·(g + weight_decay·w); w -= v`.
    Sgd {
        /// Learning rate.
        lr: f32,
        /// Momentum.
        momentum: f32,
        /// L2 weight decay.
        weight_decay: f32,
    },
}

impl ApplyOp {
    /// Whether the op keeps a momentum buffer.
    pub fn needs_momentum(&self) -> bool {
        matches!(self, ApplyOp::Sgd { momentum, .. } if *momentum != 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::book::{Book, BookConfig, Cluster};
    use crate::models;

    /// Issue #33: a kvstore server's landing memory is `slots × P1 × slot`,
    /// and a slot is a wire slice, not VGG19's fc6 over P2 (~100 MB): flat
    /// per worker as P1 grows, far under P1 × the model.
    #[test]
    fn kvstore_landing_memory_is_flat_in_p1_on_vgg19() {
        let vgg = models::profile("vgg19").unwrap();
        let model_bytes = vgg.params() as u64 * 4;
        let cfg = SyncMode::KvStore.book_config(BookConfig::default());
        let mut per_worker = Vec::new();
        for p1 in [2, 4, 8, 16] {
            let book = Book::new(Cluster::split(p1, 4).unwrap(), vgg.layers.clone(), cfg).unwrap();
            let largest = book.chunks().iter().map(|c| c.len).max().unwrap();
            assert!(largest * 4 > 100_000_000, "fc6 over 4 servers: {largest}");
            assert_eq!(book.max_slice_len(), (2 << 20) / 4, "P1 = {p1}");
            let sched = SchedConfig::default().resolve(&book);
            let landing = sched.landing_bytes(&book);
            assert_eq!(landing, p1 as u64 * u64::from(sched.landing_slots()) * (2 << 20));
            assert!(landing < model_bytes, "P1 = {p1}: {landing} B");
            per_worker.push(landing / p1 as u64);
        }
        // 8 credits + 6 spares (1.5 reference windows) of 2 MiB per worker, at every P1.
        assert_eq!(per_worker, vec![14 * (2 << 20); 4]);
    }
}
