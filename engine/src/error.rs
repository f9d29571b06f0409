//! The engine's one error type.

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
    /// A peer broke the protocol (e.g. a slice outside this server's shard).
    #[error("protocol violation by rank {rank}: {what}")]
    Protocol { rank: u32, what: String },
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
    /// A compute job (accumulate, apply, reconstruct) failed.
    #[error("compute job failed: {0}")]
    Job(String),
    /// The session was shut down.
    #[error("the session is shut down")]
    Shutdown,
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, EngineError>;
