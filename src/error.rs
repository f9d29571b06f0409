//! The facade's one error type.
//!
//! Transport failures keep the transport's own error as a typed source, so a
//! caller can tell a timeout, a work-completion error or a lost peer apart:
//!
//! ```
//! use tidewire::Error;
//! fn retryable(e: &Error) -> bool {
//!     matches!(e.transport(), Some(tidewire::transport::Error::Timeout { .. })) || e.is_peer_lost()
//! }
//! ```

use std::sync::Arc;
use std::time::Duration;

use tidewire_engine::EngineError;

use std::net::SocketAddr;

/// Everything a session can fail with.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad use of the engine, a broken peer protocol, a lost or aborting peer,
    /// or a disagreement on the job configuration (see [`EngineError`]).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A transport call failed; the source is the transport's typed error.
    #[error("transport: {0}")]
    Transport(#[source] Arc<tidewire_transport::Error>),
    /// The cluster description (environment or config) is incomplete or inconsistent.
    #[error("cluster configuration: {0}")]
    Cluster(String),
    /// Rendezvous with rank 0 failed.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// Nothing happened within the configured timeout.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    /// Rank 0's rendezvous ran out of time with ranks `missing`; `refused`
    /// names the joiners it turned away meanwhile (a rank with another
    /// secret, say), the first [`MAX_REFUSALS_KEPT`](crate::rendezvous::MAX_REFUSALS_KEPT)
    /// of them, and `refused_more` counts the rest.
    #[error(
        "timed out after {after:?} waiting for ranks {missing:?} to join the rendezvous{}",
        refusals(.refused, *.refused_more)
    )]
    RendezvousTimeout {
        missing: Vec<u32>,
        refused: Vec<RefusedJoiner>,
        refused_more: usize,
        after: Duration,
    },
    /// A buffer handed to the builder does not fit the layer table.
    #[error("buffer layout: {0}")]
    Layout(String),
    /// A call that needs the buffers of a layer the caller still holds.
    #[error("layer {layer} is not handed in: call grad_ready or sf_ready first")]
    NotHandedIn { layer: u32 },
    /// Push/pull on a layer in the wrong state (pushed twice, pulled after a failed pull).
    #[error("layer {layer}: {why}")]
    LayerState { layer: u32, why: String },
    /// The call needs a worker (or a server) role this rank does not have.
    #[error("rank {rank} is not a {role}")]
    Role { rank: u32, role: &'static str },
    /// The transport asked for cannot be used here.
    #[error("transport unavailable: {0}")]
    TransportUnavailable(String),
    /// Server-side aggregation failed, or the GPU asked for is not usable.
    #[error(transparent)]
    Aggregation(#[from] tidewire_gpu::agg::AggError),
    /// A thread could not be started.
    #[error("cannot start the {what} thread: {reason}")]
    Thread { what: &'static str, reason: String },
    /// The session was shut down.
    #[error("the session is shut down")]
    Shutdown,
    /// A node's local learners and their leader ([`crate::local`]): a leader
    /// that gave up or died, a shared file of another run or layout.
    #[error("local learners: {0}")]
    Local(String),
    /// A checkpoint could not be written or read, or does not fit the job
    /// ([`crate::checkpoint`]).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// This machine's rates could not be measured, or a profile of them
    /// (`TIDEWIRE_RATES`, a `tidewire calibrate` file) is unreadable or out of
    /// range ([`crate::calibrate`]).
    #[error("calibration: {0}")]
    Calibration(String),
}

impl From<tidewire_transport::Error> for Error {
    fn from(e: tidewire_transport::Error) -> Self {
        Error::Transport(Arc::new(e))
    }
}

impl Error {
    /// The transport's error, when this is one.
    pub fn transport(&self) -> Option<&tidewire_transport::Error> {
        match self {
            Error::Transport(e) => Some(e),
            _ => None,
        }
    }
    /// Whether a peer was lost or aborted the job.
    pub fn is_peer_lost(&self) -> bool {
        matches!(
            self,
            Error::Engine(EngineError::PeerLost { .. } | EngineError::PeerAborted { .. })
        )
    }
    /// Whether a wait or a setup step ran out of time.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. } | Error::RendezvousTimeout { .. } | Error::Engine(EngineError::Timeout { .. })
        ) || matches!(self.transport(), Some(tidewire_transport::Error::Timeout { .. }))
    }
}

/// The tail of [`Error::RendezvousTimeout`]'s message: the refused joiners, if any.
fn refusals(refused: &[RefusedJoiner], more: usize) -> String {
    if refused.is_empty() {
        return String::new();
    }
    let n = refused.len() + more;
    let mut s = format!(
        "; meanwhile rank 0 refused {n} joiner{}: ",
        if n == 1 { "" } else { "s" }
    );
    let each: Vec<String> = refused.iter().map(ToString::to_string).collect();
    s += &each.join("; ");
    if more > 0 {
        s += &format!("; and {more} more");
    }
    if refused.iter().any(|r| r.kind == RefusalKind::WrongSecret) {
        s += " (is the job secret, TIDEWIRE_SECRET, the same on every rank?)";
    }
    s
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, Error>;

/// The message of a caught panic (`&str` or `String` payloads), for errors
/// that report it.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

/// Why rank 0 refused a joiner, by kind ([`RefusedJoiner::detail`] has the words).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RefusalKind {
    /// Its join did not prove this job's secret: a rank with another secret,
    /// or a rank of another job on the same port.
    WrongSecret,
    /// Its lines are not this rendezvous protocol (another program or version).
    Malformed,
    /// It sent no join before its deadline, closed the connection, or sent an
    /// over-long line.
    NoJoin,
    /// Its connection could not be set up, or the challenge not sent.
    Connection,
}

/// A joiner rank 0 refused during the rendezvous, as its timeout error
/// ([`Error::RendezvousTimeout`]) reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedJoiner {
    /// Where it connected from.
    pub peer: SocketAddr,
    /// The rank and job its join claimed, when it sent one that parses. Not
    /// authenticated: a hint for the reader, never used for the job.
    pub claimed: Option<(u32, u64)>,
    /// Why, by kind.
    pub kind: RefusalKind,
    /// Why, in words: what rank 0 answered it (`{"refused": detail}`).
    pub detail: String,
}

impl std::fmt::Display for RefusedJoiner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.peer)?;
        if let Some((rank, job)) = self.claimed {
            write!(f, " claiming rank {rank} of job {job}")?;
        }
        write!(f, ": {}", self.detail)
    }
}
