//! What a [`Builder`](crate::Builder) collects: the settings of one rank.

use std::net::IpAddr;
use std::time::Duration;

use tidewire_engine::book::LayerSpec;
use tidewire_engine::{ApplyOp, BookConfig, SchedConfig};
use tidewire_transport::JobSecret;

use crate::buffers::BufferLayout;

/// Which transport carries the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// RDMA when a usable device exists, TCP otherwise (io_uring, or the
    /// portable epoll backend where io_uring is not allowed); the choice and the
    /// reason are logged. Override with `TIDEWIRE_TRANSPORT=tcp|portable|rdma|auto`.
    Auto,
    /// TCP: io_uring, falling back to the portable epoll backend where io_uring
    /// cannot be set up.
    Tcp,
    /// The portable epoll TCP backend (plain non-blocking sockets), even where
    /// io_uring works. It speaks the io_uring backend's protocol: ranks may mix them.
    Portable,
    /// RDMA verbs (the `rdma` feature).
    Rdma,
}

/// Lower limits for the transport than its defaults: the engine never
/// exceeds what the transport reports, so these shape its flow control
/// (fewer requests in flight, factor blocks split into smaller messages).
/// `None` keeps the transport's default. Every rank may set its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportLimits {
    /// Requests in flight per connection before the transport answers `WouldBlock`.
    pub max_outstanding: Option<usize>,
    /// Largest message, bytes (at least 256; the TCP backend allows up to 16 MiB).
    pub max_message_bytes: Option<usize>,
}

impl TransportLimits {
    /// Reads `TIDEWIRE_MAX_OUTSTANDING` and `TIDEWIRE_MAX_MESSAGE_BYTES` over these.
    pub fn from_env(self) -> crate::Result<Self> {
        let read = |name: &str| -> crate::Result<Option<usize>> {
            match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| crate::Error::Cluster(format!("{name}={v:?} is not a number"))),
                _ => Ok(None),
            }
        };
        Ok(TransportLimits {
            max_outstanding: read("TIDEWIRE_MAX_OUTSTANDING")?.or(self.max_outstanding),
            max_message_bytes: read("TIDEWIRE_MAX_MESSAGE_BYTES")?.or(self.max_message_bytes),
        })
    }
}

pub(crate) type InitFn = Box<dyn Fn(u32, &mut [f32]) + Send>;

/// The settings of one rank.
pub(crate) struct Config {
    pub(crate) layers: Vec<LayerSpec>,
    pub(crate) book: BookConfig,
    pub(crate) sched: SchedConfig,
    pub(crate) op: ApplyOp,
    pub(crate) transport: TransportKind,
    pub(crate) limits: TransportLimits,
    pub(crate) job: u64,
    pub(crate) secret: Option<JobSecret>,
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) init: Option<InitFn>,
    pub(crate) params: Option<BufferLayout>,
    pub(crate) grads: Option<BufferLayout>,
    pub(crate) listen_ip: Option<IpAddr>,
    pub(crate) aggregation: tidewire_gpu::agg::Policy,
    pub(crate) link_gbps: Option<f64>,
    pub(crate) rates: Option<tidewire_engine::cost::Rates>,
    /// Scheme switches ([`tidewire_engine::plan`]), every rank the same.
    pub(crate) switches: Vec<tidewire_engine::Switch>,
    /// Adaptive schemes: the decision period (0: off).
    pub(crate) adapt_every: u64,
    pub(crate) comm: tidewire_engine::freq::CommConfig,
    pub(crate) checkpoint: Option<crate::checkpoint::Checkpointing>,
    pub(crate) resume: Option<std::path::PathBuf>,
    /// This process replaces a lost or removed worker of a running job.
    pub(crate) rejoin: bool,
    /// Filled by `Builder::build`: the checkpoint writer and the loaded checkpoint.
    pub(crate) ckpt: CkptRun,
}

/// What `Builder::build` prepared for the runtime: the writer, and the
/// checkpoint a resumed job starts from.
#[derive(Debug, Clone, Default)]
pub(crate) struct CkptRun {
    pub(crate) writer: Option<crate::checkpoint::Writer>,
    pub(crate) loaded: Option<std::sync::Arc<crate::checkpoint::Loaded>>,
    /// The checkpoint settings and resumed iteration, agreed at rendezvous (0: none).
    pub(crate) fingerprint: u64,
}

impl Config {
    pub(crate) fn new(layers: Vec<LayerSpec>) -> Self {
        Config {
            layers,
            book: BookConfig::default(),
            sched: SchedConfig::default(),
            op: ApplyOp::Mean,
            transport: TransportKind::Auto,
            limits: TransportLimits::default(),
            job: 1,
            secret: None,
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(60),
            init: None,
            params: None,
            grads: None,
            listen_ip: None,
            aggregation: tidewire_gpu::agg::Policy::Auto,
            link_gbps: None,
            rates: None,
            switches: Vec::new(),
            adapt_every: 0,
            comm: tidewire_engine::freq::CommConfig::default(),
            checkpoint: None,
            resume: None,
            rejoin: false,
            ckpt: CkptRun::default(),
        }
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("layers", &self.layers.len())
            .field("book", &self.book)
            .field("sched", &self.sched)
            .field("op", &self.op)
            .field("transport", &self.transport)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}
