//! The sans-IO core of Tidewire.
//!
//! It holds Poseidon's information book and cost model, P3's slicing with
//! priority and credit scheduling, the KV-store shard state machine and the
//! BSP/SSP bookkeeping. It takes events in (`handle_*`, `grad_ready`,
//! `sf_ready`) and hands commands out (`poll_command`): write this slice,
//! send these factors, accumulate, apply, broadcast. It keeps no clock and
//! draws no random numbers, so the real driver and a deterministic simulator
//! ([`sim`]) drive the same code.
//!
//! Its dependency tree must never contain an I/O crate (io-uring, sideway,
//! cudarc, or the transport and gpu crates); `ci/test.sh` checks this.
//!
//! ```
//! use std::sync::Arc;
//! use tidewire_engine::{Book, BookConfig, Cluster, SchedConfig, Server, ServerCommand, Worker, WorkerCommand};
//! use tidewire_engine::book::{LayerKind, LayerSpec};
//!
//! // One worker (rank 0) and one server (rank 1), one small conv layer.
//! let book = Arc::new(Book::new(
//!     Cluster::split(1, 1)?,
//!     vec![LayerSpec::new("conv1", LayerKind::Conv, 8, 9)],
//!     BookConfig::default(),
//! )?);
//! let mut w = Worker::new(book.clone(), 0, SchedConfig::default())?;
//! let mut s = Server::new(book.clone(), 1, SchedConfig::default())?;
//! // Rank 0 seeds the server; the server broadcasts the initial values.
//! while let Some(WorkerCommand::InitPush { chunk, .. }) = w.poll_command() {
//!     s.handle_init(0, chunk)?;
//! }
//! while let Some(ServerCommand::Broadcast { chunk, .. }) = s.poll_command() {
//!     w.handle_params(chunk)?;
//!     s.handle_broadcast_done(chunk, 0)?;
//! }
//! assert!(w.is_initialized());
//! // Backward produced layer 0's gradient.
//! w.grad_ready(0)?;
//! let Some(WorkerCommand::Push { slot, slice, .. }) = w.poll_command() else { panic!() };
//! s.handle_landed(0, slot, slice)?; // the write landed
//! w.handle_push_done(slice)?;
//! let cmds: Vec<_> = std::iter::from_fn(|| s.poll_command()).collect();
//! assert!(matches!(cmds[0], ServerCommand::Accumulate { first: true, .. }));
//! assert!(matches!(cmds[2], ServerCommand::Apply { iter: 0, .. }));
//! w.handle_params(0)?; // the broadcast landed
//! assert!(matches!(w.poll_command(), Some(WorkerCommand::LayerReady { layer: 0, iter: 0 })));
//! # Ok::<(), tidewire_engine::EngineError>(())
//! ```

pub mod book;
pub mod config;
pub mod cost;
pub mod error;
pub mod models;
pub mod net;
pub mod server;
pub mod sim;
pub mod worker;

pub use book::{Book, BookConfig, Cluster, Role, Scheme, SchemePolicy};
pub use config::{Consistency, QueueOrder, SchedConfig, SyncMode};
pub use error::{EngineError, Result};
pub use server::{Server, ServerCommand};
pub use worker::{Worker, WorkerCommand};
