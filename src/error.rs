//! The facade's one error type.

use std::time::Duration;

use tidewire_engine::EngineError;

/// Everything a session can fail with.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad use of the engine, or a broken peer protocol.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A transport call failed.
    #[error("transport: {0}")]
    Transport(String),
    /// The cluster description (environment or config) is incomplete or inconsistent.
    #[error("cluster configuration: {0}")]
    Cluster(String),
    /// Rendezvous with rank 0 failed.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// A peer went away before it said goodbye.
    #[error("rank {rank} was lost: {reason}")]
    PeerLost { rank: u32, reason: String },
    /// A peer aborted the job and said why.
    #[error("rank {rank} aborted: {reason}")]
    PeerAborted { rank: u32, reason: String },
    /// Nothing happened within the configured timeout.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    /// A buffer handed to the builder does not fit the layer table.
    #[error("buffer layout: {0}")]
    Layout(String),
    /// A call that needs the buffers of a layer the caller still holds.
    #[error("layer {layer} is not handed in: call grad_ready or sf_ready first")]
    NotHandedIn { layer: u32 },
    /// The call needs a worker (or a server) role this rank does not have.
    #[error("rank {rank} is not a {role}")]
    Role { rank: u32, role: &'static str },
    /// The transport asked for cannot be used here.
    #[error("transport unavailable: {0}")]
    TransportUnavailable(String),
    /// Server-side aggregation failed, or the GPU asked for is not usable.
    #[error(transparent)]
    Aggregation(#[from] tidewire_gpu::agg::AggError),
    /// The session was shut down.
    #[error("the session is shut down")]
    Shutdown,
}

impl From<tidewire_transport::Error> for Error {
    fn from(e: tidewire_transport::Error) -> Self {
        Error::Transport(e.to_string())
    }
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, Error>;
