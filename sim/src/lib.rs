//! A deterministic discrete-event simulation of a whole Tidewire cluster.
//! Every rank is the product's own [`Node`]: the same protocol, wire
//! encoding, flow control, limits and goodbye that the runtime executes over
//! a transport, and every job runs on the CPU kernels the runtime ships
//! ([`tidewire_gpu::cpu`]: sums, apply, reconstruction, the sparse codec), so
//! a randomized run (the VOPR, `tests/vopr.rs`) checks the arithmetic that
//! ships as well as the protocol.
//!
//! - Virtual time in nanoseconds; ties break by event sequence, so a run is a
//!   pure function of its [`SimConfig`] (including the seed).
//! - The transport is modelled with its limits ([`Limits`]): a transmit
//!   beyond `max_outstanding` per connection, a message over
//!   `max_message_bytes` or a write over `max_write_bytes` is a violation.
//!   Messages on a connection arrive in order, and so do writes; the two
//!   classes are not ordered with each other, as on the real transports.
//! - Full-duplex NICs ([`net`]): each rank has a transmit and a
//!   receive side of one link's bandwidth, shared fairly between the
//!   connections using it; every transfer pays the latency.
//! - Jobs run on two FIFO executors per rank (server, worker), each with a
//!   throughput model.
//! - Worker compute follows a layer-time table (forward, backward per layer).
//! - Seeded faults: random extra delays, stragglers, a dead rank (its peers
//!   see the connection fail `detect_ns` later), a partition that heals, and
//!   transport back-pressure (`WouldBlock`) on random transmits.
//! - With `values`, real f32 data moves through every rank's regions and the
//!   invariants are checked as it runs: the seeding reaches every worker, BSP
//!   values are exact after every layer's iteration, and at the end every
//!   worker holds the last iteration's sum and every chunk was applied once
//!   per iteration (BSP and SSP).
//!
//! A run that fails returns a [`SimError`] whose message starts with the seed.
//!
//! The rooms:
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | what a run is given: [`SimConfig`], [`Faults`], and how it fails ([`SimError`]) |
//! | `world` | the event loop: virtual time, the event queue, the ranks, the end of a run |
//! | `rank` | one rank: its Node, its worker loop's state, its executors' clocks |
//! | `driver` | the runtime's part: feeding inputs, draining outputs, the transport model and back-pressure, a rejoin |
//! | `worker` | the training loop of a worker rank: forward, backward, hand-ins |
//! | `exec` | a rank's memory and the jobs run on it, by the shipped kernels, and their modelled time |
//! | `check` | the invariants: exact values, applies once per iteration, the trigger's rules, credits at the end |
//! | `oracle` | what the values must be under the mean and SGD, in f64 |
//! | [`net`] | the network: full-duplex NICs, fair sharing, latency, traces |
//! | [`report`] | what a run measured ([`SimReport`]) |
//! | [`values`] | the synthetic gradients, factors and initial parameters whose sums are exact |
//!
//! [`Node`]: tidewire_engine::node::Node
//! [`Limits`]: tidewire_engine::node::Limits

mod check;
pub mod config;
mod cpu;
mod driver;
mod exec;
pub mod net;
mod oracle;
mod rank;
pub mod report;
pub mod values;
mod worker;
mod world;

pub use config::{Faults, SimConfig, SimError, CONTROL_BYTES};
pub use report::SimReport;
pub use values::{factor_value, grad_value, init_value, sparse_grad_value};
pub use world::Sim;
