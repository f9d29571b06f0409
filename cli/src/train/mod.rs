//! `tidewire train`: a local cluster of real processes on loopback, replaying
//! a model profile. Workers sleep for each layer's calibrated compute time,
//! produce deterministic synthetic gradients (or sufficient factors for FC
//! layers) in their registered buffers, and hand them to the engine exactly as
//! a framework would. `--verify` recomputes the run in one process and
//! compares every layer's final parameters bit for bit.
//!
//! The module's files: `args` (the flags), `synth` (the synthetic
//! data and compute), `report` (what ranks and the launcher report, and its
//! text), `worker` (one rank's training loop), `reference` (the single-process
//! runs), `launch` (the attempts and the rollback), `spawn` (starting the
//! rank processes), `supervise` (following and supervising them), `collect`
//! (the report of an attempt) and [`comm`] (the communication frequency).

mod args;
mod collect;
pub mod comm;
mod launch;
pub mod pipe;
mod reference;
mod report;
mod spawn;
mod supervise;
mod synth;
mod worker;

pub use args::TrainArgs;
pub use launch::launch;
pub use reference::{reference, run_single};
pub use report::{render, AggregationShare, IterStat, LayerRow, NodeResult, SparseSummary, TrainReport};
pub(crate) use synth::mix;
pub use synth::{digest, Synth};
pub use worker::run_node;
