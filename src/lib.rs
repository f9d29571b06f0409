//! Tidewire: a communication engine for distributed deep-learning training.
//!
//! Training programs embed this crate to keep model replicas in sync: large
//! parameter chunks move zero-copy by one-sided writes (RDMA WRITE, or the
//! io_uring TCP backend that emulates it), control and small messages travel
//! over io_uring TCP, and aggregation runs where it is fastest.
//!
//! Today the crate exposes the transport layer; the engine (Poseidon's
//! WFBP + hybrid PS/SFB, P3's priority slicing, BSP/SSP) builds on it.
//!
//! ```no_run
//! use tidewire::transport::{Access, JobSecret, PinnedBuffer, TcpConfig, TcpTransport, Transport};
//! let mut t = TcpTransport::new(TcpConfig::new(1, 0, JobSecret::new(b"s3cret".to_vec())))?;
//! let grads = t.register(PinnedBuffer::new(64 << 20)?, Access::LOCAL)?;
//! # Ok::<(), tidewire::transport::Error>(())
//! ```

pub use tidewire_engine as engine;
pub use tidewire_gpu as gpu;
pub use tidewire_transport as transport;

pub mod cluster;
pub mod doctor;
mod driver;
pub mod error;
pub mod plan;
pub mod rendezvous;
pub mod session;
pub mod train;

pub use error::{Error, Result};
pub use session::{Builder, LayerBuffers, Session, TransportKind};
