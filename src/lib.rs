//! Tidewire: a communication engine for distributed deep-learning training.
//!
//! Training programs embed this crate to keep model replicas in sync: large
//! parameter chunks move zero-copy by one-sided writes (RDMA WRITE, or the
//! io_uring TCP backend that emulates it), control and small messages travel
//! over io_uring TCP, and aggregation runs where it is fastest.
//!
//! The embedding API is [`Builder`] → [`Session`]: register each layer's
//! buffers once, hand a layer in with [`Session::grad_ready`] (or
//! [`Session::sf_ready`] with sufficient factors) the moment backward produces
//! it, and take its updated parameters back with [`Session::wait_layer`] in
//! forward order. See [`session`] for a complete example, and [`cluster`] for
//! the launcher variables.
//!
//! This crate has no command-line dependency. The `tidewire` command (`train`,
//! the local cluster launcher that emulates a training job through this API;
//! `sim`, `plan`, `doctor` and `bench`) is the separate crate `tidewire-cli`,
//! in the workspace's `cli/` folder.
//!
//! The layers underneath are re-exported: [`transport`] (registered memory and
//! the narrow Transport API), [`engine`] (the sans-IO core and its simulator)
//! and [`gpu`] (aggregation kernels and their CPU path).

pub use tidewire_engine as engine;
pub use tidewire_gpu as gpu;
pub use tidewire_transport as transport;

mod buffers;
pub mod calibrate;
pub mod checkpoint;
pub mod cluster;
mod config;
pub mod error;
pub mod freq;
pub mod local;
pub mod pushpull;
pub mod rendezvous;
mod runtime;
pub mod session;
mod stats;

pub use error::{Error, Result};
pub use session::{
    BufferLayout, Builder, LayerBuffers, Pending, Session, SessionStats, TransportKind, TransportLimits,
};
pub use tidewire_engine::adapt::Decision;
