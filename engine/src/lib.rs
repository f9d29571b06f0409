//! The sans-IO core of Tidewire.
//!
//! A [`Node`](node::Node) is one rank: its worker and server cores and the
//! whole wire protocol between ranks ([`wire`]: hello and agreement on the job
//! configuration, addressing of one-sided writes, landing-slot credits,
//! factor blocks split to the transport's message cap, seeding, flow control
//! within the transport's [`Limits`](node::Limits), and the goodbye). It takes
//! inputs with the time ([`Input`](node::Input): hand-ins, completions,
//! arrivals, job completions, ticks) and gives outputs
//! ([`Output`](node::Output): transmits with their exact addressing and
//! bytes, compute jobs, layer-ready events). The runtime in the `tidewire`
//! crate executes them over a transport, and the deterministic simulator
//! (the `tidewire-sim` crate) executes them over a modelled network: both run
//! the same protocol.
//!
//! Underneath are Poseidon's information book and cost model ([`book`],
//! [`cost`]), P3's slicing with priority and credit scheduling
//! ([`worker`]), the KV-store shard state machine ([`server`]) and the
//! BSP/SSP bookkeeping. The core keeps no clock and draws no random numbers.
//!
//! Its dependency tree must never contain an I/O crate (io-uring, sideway,
//! cudarc, or the transport and gpu crates); `ci/test.sh` checks this.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tidewire_engine::book::{LayerKind, LayerSpec};
//! use tidewire_engine::node::{Input, Node, NodeConfig, Output};
//! use tidewire_engine::{Book, BookConfig, Cluster};
//!
//! // A job of one rank that is both worker and server: no peers to talk to,
//! // so every output is a local compute job.
//! let book = Arc::new(Book::new(
//!     Cluster::colocated(1)?,
//!     vec![LayerSpec::new("conv1", LayerKind::Conv, 8, 9)],
//!     BookConfig::default(),
//! )?);
//! let mut node = Node::new(NodeConfig::new(book, 0))?;
//! let t = Duration::ZERO;
//! node.handle(t, Input::Tick)?;
//! let mut ready = false;
//! let mut layer_ready = false;
//! // Run every job at once (a runtime hands them to its executors).
//! let mut pending = Vec::new();
//! loop {
//!     while let Some(out) = node.poll_output() {
//!         match out {
//!             Output::Job(job) => pending.push(job.id),
//!             Output::Ready => ready = true,
//!             Output::LayerReady { layer: 0, iter: 0 } => layer_ready = true,
//!             other => panic!("{other:?}"),
//!         }
//!     }
//!     if ready && !layer_ready && pending.is_empty() && !node.is_in_flight(0) {
//!         // Backward produced layer 0's gradient.
//!         node.handle(t, Input::HandIn { layer: 0, factors: false })?;
//!         continue;
//!     }
//!     let Some(id) = pending.pop() else { break };
//!     node.handle(t, Input::JobDone { id, data: None })?;
//! }
//! assert!(ready && layer_ready);
//! # Ok::<(), tidewire_engine::EngineError>(())
//! ```
#![forbid(unsafe_code)]

pub mod adapt;
pub mod agree;
pub mod book;
pub mod config;
pub mod cost;
pub mod error;
pub mod freq;
pub mod fxhash;
pub mod models;
pub mod node;
pub mod plan;
pub mod server;
pub mod sparse;
#[doc(hidden)]
pub mod testkit;
pub mod wire;
pub mod worker;

pub use book::{Book, BookConfig, Cluster, Placement, Role, Scheme, SchemePolicy};
pub use config::{
    ApplyOp, Consistency, QueueOrder, SchedConfig, SyncMode, Trigger, REFERENCE_CREDIT_BYTES, SLOTS_AUTO, SPARE_AUTO,
};
pub use error::{EngineError, JobCause, JobFailure, ProtocolViolation, Result};
pub use plan::{Plan, PlanError, Switch};
pub use server::{Server, ServerCommand};
pub use worker::{Worker, WorkerCommand};
