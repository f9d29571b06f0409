//! Registered memory and the narrow Transport API of Tidewire, with the
//! io_uring TCP backend (the default everywhere) and, behind the `rdma`
//! feature, the RDMA verbs backend.
//!
//! ```no_run
//! use std::time::Duration;
//! use tidewire_transport::{Access, JobSecret, PinnedBuffer, TcpConfig, TcpTransport, Transport, Event};
//!
//! let secret = JobSecret::new(b"from your job launcher".to_vec());
//! let mut server = TcpTransport::new(TcpConfig::new(42, 0, secret.clone()))?;
//! let l = server.listen("127.0.0.1:0".parse().unwrap())?;
//! let landing = server.register(PinnedBuffer::new(1 << 20)?, Access::REMOTE_WRITE)?;
//!
//! let mut client = TcpTransport::new(TcpConfig::new(42, 1, secret))?;
//! let conn = client.connect(server.listener_addr(l)?)?;
//! let src = client.register(PinnedBuffer::new(4096)?, Access::LOCAL)?;
//! src.write_at(0, b"gradient bytes")?;
//! let mut ev = Vec::new();
//! // Drive both sides until the client is connected and has learned the region.
//! while client.remote_regions(conn)?.is_empty() {
//!     server.poll(&mut ev, 64)?;
//!     client.wait(&mut ev, 64, Duration::from_millis(10))?;
//! }
//! let dst = client.remote_regions(conn)?[0];
//! client.write(conn, &src.slice(0, 14)?, &dst, 128, Some(7))?;
//! # Ok::<(), tidewire_transport::Error>(())
//! ```

pub mod api;
pub mod auth;
mod conn_core;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod memory;
pub mod portable;
pub mod probe;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod select;
pub mod shm;
pub mod tcp;

pub use api::{ConnId, Counters, Event, ListenerId, PeerInfo, Properties, ReqId, Transport, Waker};
pub use auth::JobSecret;
pub use error::{Error, FrameError, Result};
pub use memory::{Access, HugePages, Lease, MemoryKind, PinOptions, PinnedBuffer, Region, RemoteRegion, Slice};
pub use portable::{PortableStats, PortableTransport};
#[cfg(feature = "rdma")]
pub use rdma::{ConnectMode, CqMode, RdmaConfig, RdmaStats, RdmaTransport};
pub use tcp::{TcpConfig, TcpStats, TcpTransport};
