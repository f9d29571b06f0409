//! The `tidewire` command, as a library: what `tidewire train`, `sim`, `plan`,
//! `doctor` and `bench` do, for the binary (`src/main.rs`) and for the
//! benchmarks that reuse them (`tidewire-bench`'s overhead and papers runs).
//!
//! - [`train`]: a local cluster of real processes on loopback that trains a
//!   model profile through the [`tidewire`] library, and the single-process
//!   reference that `--verify` compares against, bit for bit;
//! - [`train::comm`]: `train`'s communication frequency (`--comm-every`, `--comm-mode`,
//!   Nexus's quality-guided `--freq-max`) and its reference;
//! - [`resilience`]: `train`'s checkpoints, resume, rollback and fault injection;
//! - [`sim`]: the engine's sans-IO core on a discrete-event network;
//! - [`plan`]: Poseidon's cost model per layer;
//! - [`doctor`]: what this machine can use, and why not;
//! - [`bench`](mod@bench): microbenchmarks of this machine (CPU and GPU aggregation).
//!
//! A training program embeds the `tidewire` library, not this crate: this one
//! brings the command-line dependencies (clap, indicatif, tracing-subscriber).

pub mod bench;
pub mod calibrate;
pub mod doctor;
pub mod error;
pub mod job;
pub mod plan;
pub mod resilience;
pub mod sim;
pub mod train;

pub use error::{Error, Result};
