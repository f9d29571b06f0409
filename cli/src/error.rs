//! The CLI's one error type.

use tidewire_engine::EngineError;
use tidewire_gpu::agg::AggError;

/// Everything a `tidewire` command can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A flag is unknown, out of range, or inconsistent with another; nothing was started.
    #[error("{0}")]
    Usage(String),
    /// The engine rejected the cluster or the layer table the flags describe.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The aggregation asked for cannot run here (`--aggregate gpu` without a usable GPU).
    #[error(transparent)]
    Aggregation(#[from] AggError),
    /// `train` could not start its local cluster, or a rank failed or did not report.
    #[error("train: {0}")]
    Launch(String),
    /// A rank's session (the `tidewire` library) failed.
    #[error(transparent)]
    Session(#[from] tidewire::Error),
    /// The discrete-event simulation failed.
    #[error("simulation: {0}")]
    Sim(#[from] tidewire_sim::SimError),
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, Error>;
