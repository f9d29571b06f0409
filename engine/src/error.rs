//! The engine's one error type, with the named peer faults
//! ([`ProtocolViolation`]) and job failures ([`JobFailure`]) it carries.

mod violation;

use std::sync::Arc;

pub use violation::ProtocolViolation;

/// What went wrong in the engine core, or in the way it was used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The configuration cannot work (the message says which field and why).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A layer index outside the layer table.
    #[error("unknown layer {layer} (the table has {layers} layers)")]
    UnknownLayer { layer: u32, layers: u32 },
    /// `grad_ready`/`sf_ready` for a layer whose previous iteration is still syncing.
    #[error("layer {layer} ({name}) is already syncing iteration {iter}: call wait_layer before handing it in again")]
    LayerBusy { layer: u32, name: String, iter: u64 },
    /// A buffer whose size does not match the layer table.
    #[error("buffer for layer {layer} ({name}) has {got} elements, the layer table says {want}")]
    WrongSize {
        layer: u32,
        name: String,
        got: usize,
        want: usize,
    },
    /// The layer's scheme this iteration is sufficient-factor broadcast, so it needs `sf_ready`.
    #[error(
        "layer {layer} ({name}) syncs by sufficient factors this iteration: call sf_ready with U and V, not grad_ready"
    )]
    NeedsFactors { layer: u32, name: String },
    /// The layer's scheme for the iteration is not decided yet (adaptive
    /// schemes, [`crate::plan::Plan`]): hand it in once worker 0's decision came.
    #[error("layer {layer}'s scheme for iteration {iter} is not decided yet")]
    Undecided { layer: u32, iter: u64 },
    /// Sufficient factors were handed in for a layer that is not fully connected.
    #[error("layer {layer} ({name}) is not fully connected: it has no sufficient factors")]
    NotFullyConnected { layer: u32, name: String },
    /// A data type the engine reserves but does not support yet.
    #[error("layer {layer} ({name}): dtype {dtype} is reserved; only f32 is supported")]
    UnsupportedDType {
        layer: u32,
        name: String,
        dtype: &'static str,
    },
    /// A peer broke the protocol (e.g. a slice outside this server's shard);
    /// the violation is also the [`source`](std::error::Error::source).
    #[error("protocol violation by rank {rank}: {violation}")]
    Protocol {
        rank: u32,
        #[source]
        violation: ProtocolViolation,
    },
    /// Two ranks disagree on a field of the job configuration.
    #[error("rank {rank} has {field} = {theirs}, but {reference} has {ours} (every rank must be started with the same configuration)")]
    Disagree {
        rank: u32,
        field: &'static str,
        theirs: String,
        reference: String,
        ours: String,
    },
    /// This rank gave up (its session was dropped, or the runtime failed locally).
    #[error("aborted: {0}")]
    Aborted(String),
    /// A peer went away before it said goodbye.
    #[error("rank {rank} was lost: {reason}")]
    PeerLost { rank: u32, reason: String },
    /// A worker finished (shut down) without pushing an iteration another
    /// worker pushed: the servers could never complete it.
    #[error("worker rank {worker} finished without pushing iteration {iter} of layer {layer} ({name}), which another worker pushed: that iteration can never complete (every worker must push the same layers the same number of times)")]
    Stranded {
        worker: u32,
        layer: u32,
        name: String,
        iter: u64,
    },
    /// A peer aborted the job and said why.
    #[error("rank {rank} aborted: {reason}")]
    PeerAborted { rank: u32, reason: String },
    /// Nothing happened within the configured time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: std::time::Duration },
    /// A compute job (accumulate, apply, reconstruct) failed, or finished
    /// with a result the Node cannot use; the failure is also the source.
    #[error("compute job failed: {0}")]
    Job(#[source] JobFailure),
    /// The session was shut down.
    #[error("the session is shut down")]
    Shutdown,
}

impl EngineError {
    /// `rank` broke the protocol: shorthand for [`EngineError::Protocol`].
    pub fn protocol(rank: u32, violation: ProtocolViolation) -> Self {
        EngineError::Protocol { rank, violation }
    }
}

/// Why a compute job failed ([`EngineError::Job`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum JobFailure {
    /// The driver's executor could not run job `id` (its error is the
    /// [`source`](std::error::Error::source)).
    Failed { id: u64, cause: JobCause },
    /// A sparse encoding job finished without reporting how many pairs it wrote.
    NoEncodeCount { slice: u32 },
    /// A capture job returned a factor block of the wrong size.
    CaptureSize { layer: u32, got: usize, want: usize },
}

impl std::fmt::Display for JobFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobFailure::Failed { id, cause } => write!(f, "job {id}: {cause}"),
            JobFailure::NoEncodeCount { slice } => write!(f, "the encoding of slice {slice} reported no count"),
            JobFailure::CaptureSize { layer, got, want } => {
                write!(f, "captured {got} bytes of factors of layer {layer}, expected {want}")
            }
        }
    }
}

impl std::error::Error for JobFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            JobFailure::Failed { cause, .. } => Some(cause.error()),
            _ => None,
        }
    }
}

/// The driver's error for a failed job ([`Input::JobFailed`](crate::node::Input::JobFailed)),
/// held as a `dyn Error`: the sans-IO engine knows no runtime types, but
/// keeps the error itself, so that a caller can walk to it with
/// [`source`](std::error::Error::source) and downcast it.
///
/// Two causes compare equal when their texts are (what the engine used to
/// keep was the text).
#[derive(Clone)]
pub struct JobCause(Arc<dyn std::error::Error + Send + Sync>);

impl JobCause {
    /// Wraps the driver's error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        JobCause(Arc::new(e))
    }
    /// The driver's error.
    pub fn error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl std::fmt::Display for JobCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Debug for JobCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for JobCause {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for JobCause {}

impl EngineError {
    /// A peer's hello carries `got` configuration fields where this rank has
    /// `want` (for `agree`, which thus names no violation type of its own:
    /// the violations name the wire's kinds, and the wire encodes agreements).
    pub(crate) fn field_count(rank: u32, got: usize, want: usize) -> EngineError {
        EngineError::protocol(rank, ProtocolViolation::FieldCount { got, want })
    }
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, EngineError>;
