//! Why a compute job failed: each cause named, with its source. The Node
//! holds it as a `dyn Error` ([`tidewire_engine::node::Input::JobFailed`]'s
//! [`JobCause`](tidewire_engine::JobCause): the engine is sans-IO and knows
//! no runtime types), so the session's error reaches it through
//! [`source`](std::error::Error::source); the runtime and its tests match on
//! the kind.

use tidewire_engine::node::{LocalRegion, Queue};
use tidewire_engine::sparse::SparseError;
use tidewire_gpu::agg::AggError;

/// A job the executors could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum JobError {
    /// The job names a region this rank never registered.
    #[error("this rank has no {region:?} region")]
    NoRegion { region: LocalRegion },
    /// The job's range of a region could not be leased: outside it, or held
    /// by the caller.
    #[error("{region:?} at {offset}+{len}: {source}")]
    Lease {
        region: LocalRegion,
        offset: u64,
        len: u64,
        #[source]
        source: tidewire_transport::Error,
    },
    /// Reading or viewing leased or peer-written memory failed.
    #[error(transparent)]
    Memory(#[from] tidewire_transport::Error),
    /// The job names a chunk, layer, window or range the book or this rank's
    /// shard does not have (`what` says which).
    #[error("{what}")]
    Outside { what: &'static str },
    /// The book refused a lookup (e.g. an unknown layer).
    #[error(transparent)]
    Book(#[from] tidewire_engine::EngineError),
    /// A peer's sparse push does not decode to the slice it stands for.
    #[error("a sparse push of {len} elements: {source}")]
    Sparse {
        len: usize,
        #[source]
        source: SparseError,
    },
    /// The aggregator refused the sum (e.g. a GPU error).
    #[error(transparent)]
    Aggregate(#[from] AggError),
    /// A factor block of the wrong size.
    #[error("factors of {got} bytes, expected {want}")]
    FactorSize { got: usize, want: usize },
    /// A job sent to the executor of the other queue.
    #[error("not a {side} job: {job}")]
    WrongQueue { side: &'static str, job: String },
    /// A job for a queue this rank has no executor for (not that role).
    #[error("a {queue:?} job on a rank without that role")]
    NoExecutor { queue: Queue },
    /// The executor thread is gone.
    #[error("the executor is gone (it panicked?)")]
    ExecutorGone,
    /// The job panicked (a bug: the panic's message).
    #[error("panicked: {message}")]
    Panicked { message: String },
}

impl JobError {
    /// The job names something that is not there.
    pub(crate) fn outside(what: &'static str) -> JobError {
        JobError::Outside { what }
    }
}

/// A job's result.
pub(crate) type JobResult<T> = std::result::Result<T, JobError>;
