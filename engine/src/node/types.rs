//! What goes into a [`Node`](super::Node) and what comes out of it.

use std::time::Duration;

/// A region of this rank's memory, by role. The runtime (or the simulator)
/// allocates and registers one of each the Node's sizes ask for
/// ([`Node::region_bytes`](super::Node::region_bytes)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LocalRegion {
    /// Worker parameters: the landing zone of servers' broadcasts, and under
    /// BSP also the caller's view. Remote-writable.
    Params,
    /// Under SSP: the caller's copy of the parameters, published from
    /// `Params` when a layer is ready, so no peer ever writes memory the
    /// caller holds. Local only.
    View,
    /// Worker gradients: the source of pushes. Local only.
    Grads,
    /// Worker sufficient factors: U (K×M) then V (K×N) per FC layer. Local only.
    Factors,
    /// Worker staging of sparse pushes: per sparse layer, as many bytes as its
    /// gradient; a slice's pairs are encoded at the slice's own offset (an
    /// encoded slice is always smaller than the dense one). Local only.
    Sparse,
    /// Server shard: the current parameters of this rank's chunks. Remote-writable (seeding).
    Shard,
    /// Server landing slots: `slots` per worker. Remote-writable.
    Landing,
    /// Control cells: the bytes of inline messages. Local only.
    Ctrl,
    /// The momentum of the layers that may switch schemes
    /// ([`crate::plan::Plan::movable`]), where the op keeps momentum: a
    /// worker's of each such layer (packed), then a server's of its shard
    /// (at the shard's offsets). The Apply and Reconstruct jobs of those
    /// layers read and write it there, and switches send it from there.
    /// Empty otherwise. Local only.
    Moments,
}

impl LocalRegion {
    /// Every region, in a fixed order.
    pub const ALL: [LocalRegion; 9] = [
        LocalRegion::Params,
        LocalRegion::View,
        LocalRegion::Grads,
        LocalRegion::Factors,
        LocalRegion::Sparse,
        LocalRegion::Shard,
        LocalRegion::Landing,
        LocalRegion::Ctrl,
        LocalRegion::Moments,
    ];

    /// Whether peers write into it.
    pub fn remote_write(self) -> bool {
        matches!(self, LocalRegion::Params | LocalRegion::Shard | LocalRegion::Landing)
    }

    /// The index of this region's key in a hello (remote-writable regions only).
    pub fn key_index(self) -> Option<usize> {
        let i = match self {
            LocalRegion::Params => Some(0),
            LocalRegion::Shard => Some(1),
            LocalRegion::Landing => Some(2),
            _ => None,
        };
        // A hello carries the keys of the remote-writable regions, and only theirs.
        debug_assert_eq!(i.is_some(), self.remote_write());
        i
    }
}

/// A place in local memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Loc {
    /// Which region.
    pub region: LocalRegion,
    /// Byte offset.
    pub offset: u64,
}

/// A place in a peer's memory: one of its remote-writable regions, named
/// by the keys in its hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteLoc {
    /// `Params`, `Shard` or `Landing`.
    pub region: LocalRegion,
    /// Byte offset.
    pub offset: u64,
}

/// What a message carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// The bytes.
    Bytes(Vec<u8>),
    /// Only the length: for simulations that model time and do not move
    /// values. The Node checks lengths and hands no data to jobs then.
    Opaque(usize),
}

impl Payload {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Payload::Bytes(b) => b.len(),
            Payload::Opaque(n) => *n,
        }
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The source of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendSrc {
    /// `len` bytes of a local region, sent zero-copy.
    Region { at: Loc, len: u64 },
    /// Control bytes: the runtime copies them into control cell `cell`
    /// (at `cell × CELL_BYTES` in the `Ctrl` region) and sends them from there.
    /// The cell is the Node's until the transmit completes.
    Inline { cell: u32, bytes: Vec<u8> },
}

impl SendSrc {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            SendSrc::Region { len, .. } => *len,
            SendSrc::Inline { bytes, .. } => bytes.len() as u64,
        }
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One transport operation. Its completion comes back as [`Input::Done`] or
/// [`Input::Failed`] with `token`; a transport that refuses it for now
/// (`WouldBlock`) leaves it to the driver to hold and post again
/// ([`super::held::HeldTransmits`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Names the operation in its completion.
    pub token: u64,
    /// The peer's rank.
    pub peer: u32,
    /// What to post.
    pub op: TxOp,
}

/// See [`Transmit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxOp {
    /// A one-sided write of `len` bytes from `src` to `dst` at the peer,
    /// with an immediate when `imm` is set.
    Write {
        src: Loc,
        dst: RemoteLoc,
        len: u64,
        imm: Option<u32>,
    },
    /// A message.
    Send { tag: u32, src: SendSrc },
}

impl TxOp {
    /// Bytes the operation moves.
    pub fn len(&self) -> u64 {
        match self {
            TxOp::Write { len, .. } => *len,
            TxOp::Send { src, .. } => src.len(),
        }
    }
    /// Whether it moves nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which executor runs a job. Jobs of one queue run one at a time, in the
/// order the Node emits them; the two queues run concurrently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Queue {
    /// Aggregation and apply on this rank's shard.
    Server,
    /// Work on this rank's worker buffers: reconstruction, publishing, local broadcasts.
    Worker,
}

/// The factors one worker contributed to a layer's iteration: U (K×M) then
/// V (K×N), f32 little-endian.
///
/// Received bytes are never copied by the Node: a block that came in one
/// message is that message's buffer ([`Blob::Bytes`], moved), and a block
/// that came in several keeps its fragments as they came
/// ([`Blob::Fragments`]). Consumers read the f32 values in place with
/// [`Blob::f32s`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Blob {
    /// The whole block in one buffer: one received message, or this rank's
    /// own captured factors.
    Bytes(Vec<u8>),
    /// The block's fragments in order, each the buffer of the message that
    /// carried it (at least two, none empty).
    Fragments(Vec<Vec<u8>>),
    /// Only the length (see [`Payload::Opaque`]).
    Opaque(usize),
}

impl Blob {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Blob::Bytes(b) => b.len(),
            Blob::Fragments(f) => f.iter().map(Vec::len).sum(),
            Blob::Opaque(n) => *n,
        }
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffers that hold the bytes, in order (none for [`Blob::Opaque`]).
    pub fn pieces(&self) -> &[Vec<u8>] {
        match self {
            Blob::Bytes(b) => std::slice::from_ref(b),
            Blob::Fragments(f) => {
                debug_assert!(
                    f.len() >= 2 && f.iter().all(|p| !p.is_empty()),
                    "fragments: {:?}",
                    f.len()
                );
                f
            }
            Blob::Opaque(_) => &[],
        }
    }

    /// The `count` f32 values at byte `at`, borrowed from the buffer that
    /// holds them, when one does, at a 4-byte aligned address, on a
    /// little-endian host. `None` otherwise (or out of range).
    pub fn f32s_in_place(&self, at: usize, count: usize) -> Option<&[f32]> {
        if cfg!(target_endian = "big") {
            return None;
        }
        let end = at.checked_add(count.checked_mul(4)?)?;
        let mut start = 0;
        for p in self.pieces() {
            if at >= start && end <= start + p.len() {
                let v: Option<&[f32]> = bytemuck::try_cast_slice(&p[at - start..end - start]).ok();
                debug_assert!(v.map_or(true, |v| v.len() == count));
                return v;
            }
            start += p.len();
        }
        None
    }

    /// Decodes the `count` f32 values at byte `at` into `out` (cleared
    /// first), across buffer boundaries and at any alignment. `false` when
    /// the range is not all here (or the blob is opaque).
    pub fn read_f32s(&self, at: usize, count: usize, out: &mut Vec<f32>) -> bool {
        out.clear();
        let Some(end) = count.checked_mul(4).and_then(|b| at.checked_add(b)) else {
            return false;
        };
        if end > self.len() || matches!(self, Blob::Opaque(_)) {
            return false;
        }
        out.reserve(count);
        let mut carry = [0u8; 4];
        let mut held = 0;
        let mut start = 0;
        for p in self.pieces() {
            let base = start;
            start += p.len();
            let (a, b) = (at.max(base), end.min(start));
            if a >= b {
                continue;
            }
            let mut s = &p[a - base..b - base];
            if held > 0 {
                let t = (4 - held).min(s.len());
                carry[held..held + t].copy_from_slice(&s[..t]);
                held += t;
                s = &s[t..];
                if held < 4 {
                    continue;
                }
                out.push(f32::from_le_bytes(carry));
            }
            let whole = s.chunks_exact(4);
            let rest = whole.remainder();
            out.extend(whole.map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
            carry[..rest.len()].copy_from_slice(rest);
            held = rest.len();
        }
        debug_assert_eq!((out.len(), held), (count, 0));
        true
    }

    /// The `count` f32 values at byte `at`: in place when
    /// [`f32s_in_place`](Self::f32s_in_place) can, else decoded into
    /// `scratch` (a copy: only when the values span two of the buffers, or a
    /// buffer is not 4-byte aligned, or the host is big-endian). The flag
    /// says whether they were decoded. `None` when the range is not all here.
    pub fn f32s<'a>(&'a self, at: usize, count: usize, scratch: &'a mut Vec<f32>) -> Option<(&'a [f32], bool)> {
        if let Some(v) = self.f32s_in_place(at, count) {
            return Some((v, false));
        }
        if !self.read_f32s(at, count, scratch) {
            return None;
        }
        debug_assert_eq!(scratch.len(), count);
        Some((&scratch[..], true))
    }
}

/// A compute job. Its completion comes back as [`Input::JobDone`] (or
/// [`Input::JobFailed`]) with `id`.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// Names the job in its completion.
    pub id: u64,
    /// The executor.
    pub queue: Queue,
    /// What to do.
    pub kind: JobKind,
}

/// See [`Job`]. Element counts are f32 elements; offsets in `Loc` are bytes.
#[derive(Debug, Clone, PartialEq)]
pub enum JobKind {
    /// `acc[window][acc_at..acc_at + len] = src` when `first`, else `+= src`;
    /// with `partial`, the same into the fold group's partial sum instead
    /// (a second buffer shaped like `acc`; see [`crate::SchedConfig::fold_group`]).
    /// `acc` is a copy of the shard per SSP window (`Node::windows`);
    /// `contributions` is how many the chunk receives in all (for the Nexus
    /// CPU/GPU placement). With `pairs`, `src` holds the slice encoded as
    /// that many index/value pairs ([`crate::sparse`]): densify it to its
    /// `len` elements first (checking it: a peer wrote it), then do the same.
    Accumulate {
        window: u32,
        chunk: u32,
        acc_at: usize,
        src: Loc,
        len: usize,
        first: bool,
        partial: bool,
        contributions: usize,
        pairs: Option<u32>,
    },
    /// `acc[window][acc_at..acc_at + len] += partial[window][..same]`: a fold
    /// group's partial sum joins the accumulator.
    FoldPartial {
        window: u32,
        chunk: u32,
        acc_at: usize,
        len: usize,
        contributions: usize,
    },
    /// Encode the `len` elements at `src` (a sparse layer's slice) as
    /// index/value pairs at `dst` ([`crate::sparse`]: header, then pairs),
    /// unless there are more than `cap`. The completion's `data` is an
    /// [`EncodeReport`](crate::sparse::EncodeReport) (`to_bytes`).
    EncodeSparse {
        slice: u32,
        src: Loc,
        len: usize,
        dst: Loc,
        cap: usize,
    },
    /// Every contribution to `chunk` for `iter` is summed in `acc[window]`
    /// over `shard_at..shard_at + len`: apply the op to the shard there.
    /// `gradients` is how many gradients the sum holds: the mean and SGD
    /// divide by it. Under the default trigger it is always P1 × learners;
    /// under the others ([`crate::config::Trigger`]) it is the round's
    /// contributors × learners.
    /// `momentum`: where the chunk's momentum lies (`len` f32s) when its
    /// layer may switch schemes and the op keeps momentum (the `Moments`
    /// region); `None`: the executor's own, at `shard_at`.
    Apply {
        window: u32,
        chunk: u32,
        iter: u64,
        shard_at: usize,
        len: usize,
        gradients: u32,
        momentum: Option<Loc>,
    },
    /// Copy `len` bytes (a colocated rank's seeding or broadcast to itself,
    /// or momentum between its worker's and its server's parts of `Moments`).
    Copy { src: Loc, dst: Loc, len: u64 },
    /// Write a peer's bytes (a chunk's momentum at a switch) at `dst`.
    Place { dst: Loc, data: Blob },
    /// `grad = Uᵀ·V` of an FC layer handed in with factors whose scheme is PS.
    FactorsToGrad { layer: u32, factors: Loc, grad: Loc },
    /// Copy the layer's U and V (`len` bytes at `factors`) out; the
    /// completion carries them ([`Input::JobDone`]'s `data`).
    CaptureFactors { layer: u32, factors: Loc, len: u64 },
    /// `params` op= Σ_p U_pᵀ·V_p, with every worker's factors in worker order.
    /// `momentum`: where the layer's momentum lies (the `Moments` region)
    /// when it may switch schemes and the op keeps momentum; `None`: the
    /// executor's own.
    Reconstruct {
        layer: u32,
        iter: u64,
        params: Loc,
        factors: Vec<Blob>,
        momentum: Option<Loc>,
    },
    /// Copy a ready layer's parameters to the caller's view, reading memory a
    /// peer may be writing (relaxed atomic loads).
    Publish { layer: u32, src: Loc, dst: Loc, len: u64 },
    /// Adam's server ([`crate::book::Scheme::Adam`]): `acc[window][acc_at..
    /// acc_at + M·N] = Σ_p U_pᵀ·V_p`, with every worker's factors in worker
    /// order, the first term written and each later one added (per element,
    /// the sum the PS folds from the gradients U_pᵀ·V_p in rank order).
    /// The layer's chunks lie together in the shard from `acc_at`.
    SumFactors {
        layer: u32,
        iter: u64,
        window: u32,
        acc_at: usize,
        factors: Vec<Blob>,
    },
}

/// An input to [`Node::handle`](super::Node::handle).
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// The caller handed `layer` in: its gradient (or, with `factors`, its
    /// U and V) is in place.
    HandIn { layer: u32, factors: bool },
    /// The caller wants to leave once every peer that needs this rank is done.
    Shutdown,
    /// Worker index 0's driver decides the contested layers' schemes from
    /// the decision point `at` on ([`Output::DecisionDue`]; bit i of `sfb`:
    /// the i-th contested layer by SFB, see [`crate::plan::Plan::decide`]).
    /// The Node tells every other rank.
    Decide { at: u64, sfb: u64 },
    /// The transport connection to `peer` is up (authenticated).
    Connected { peer: u32 },
    /// The regions whose keys `peer` sent ([`Output::PeerKeys`]) are known to the transport.
    PeerRegionsKnown { peer: u32 },
    /// A transmit completed: data placed at the target (writes) or sent (messages).
    Done { token: u64 },
    /// A transmit failed; the connection is lost.
    Failed { token: u64, reason: String },
    /// A peer's write with an immediate landed in `region` at `offset`.
    Landed {
        peer: u32,
        region: LocalRegion,
        offset: u64,
        len: u64,
        imm: u32,
    },
    /// A message arrived.
    Message { peer: u32, tag: u32, data: Payload },
    /// The connection to `peer` ended (`error` is `None` for a graceful close).
    Closed { peer: u32, error: Option<String> },
    /// A job finished; `data` holds captured factors.
    JobDone { id: u64, data: Option<Vec<u8>> },
    /// A job failed: the driver's error.
    JobFailed { id: u64, error: crate::error::JobCause },
    /// Time passed (see [`Node::poll_timeout`](super::Node::poll_timeout)).
    Tick,
    /// The runtime gives up (a local failure, or the caller dropped its
    /// session): the Node tells its peers why and fails.
    Abort { reason: String },
}

/// An output of [`Node::poll_output`](super::Node::poll_output).
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Post this.
    Transmit(Transmit),
    /// Run this on its queue.
    Job(Job),
    /// `peer`'s remote-writable regions have these keys (0: none): tell the
    /// Node with [`Input::PeerRegionsKnown`] once the transport knows them.
    PeerKeys { peer: u32, keys: [u32; 3] },
    /// The layer's iteration is synced: its buffers are the caller's again.
    LayerReady { layer: u32, iter: u64 },
    /// Setup is complete: every peer agreed and the initial parameters are in place.
    Ready,
    /// Worker index 0 only, adaptive schemes: decide the schemes from the
    /// point `at` on ([`Input::Decide`]). Hand-ins of that iteration wait for
    /// it on every rank; it comes one iteration ahead.
    DecisionDue { at: u64 },
    /// Every peer that needed this rank is done: the runtime may close and exit.
    Finished,
    /// The rank failed. Abort messages to the peers were emitted before it.
    Fatal(crate::EngineError),
}

/// The transport's limits, which the Node never exceeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Requests in flight per connection (sends and writes together).
    pub max_outstanding: usize,
    /// Largest message.
    pub max_message_bytes: usize,
    /// Largest one-sided write.
    pub max_write_bytes: usize,
}

impl Default for Limits {
    /// The io_uring TCP backend's defaults.
    fn default() -> Self {
        let l = Limits {
            max_outstanding: 256,
            max_message_bytes: 16 << 20,
            max_write_bytes: 1 << 30,
        };
        // Room for the protocol's control messages (what `Node::new` checks).
        debug_assert!(l.max_outstanding > 0 && l.max_message_bytes >= crate::wire::MAX_CONTROL);
        l
    }
}

/// How long the Node waits before a failed setup is reported.
pub const DEFAULT_STARTUP: Duration = Duration::from_secs(60);
