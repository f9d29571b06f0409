//! What `tidewire bench aggregate` takes and reports, shared by its CPU part
//! ([`super`]) and its GPU part (`gpu.rs`), which both depend on this module
//! and on nothing of each other's.

use std::collections::TryReserveError;

use serde::Serialize;

/// What to measure.
#[derive(Debug, Clone)]
pub struct AggregateOpts {
    /// P, the inputs summed into the accumulator.
    pub inputs: usize,
    /// MiB per input (and per triad array).
    pub mib: usize,
    /// Threads for both the sum and the triad.
    pub threads: usize,
    /// Repetitions of each, alternating; the best and the median are reported.
    pub reps: usize,
}

impl AggregateOpts {
    /// Bounds on [`AggregateOpts::inputs`].
    pub const INPUTS: std::ops::RangeInclusive<usize> = 1..=64;
    /// Bounds on [`AggregateOpts::mib`].
    pub const MIB: std::ops::RangeInclusive<usize> = 1..=16384;
    /// Bounds on [`AggregateOpts::reps`].
    pub const REPS: std::ops::RangeInclusive<usize> = 1..=1000;
}

impl Default for AggregateOpts {
    fn default() -> Self {
        AggregateOpts {
            inputs: 8,
            mib: 64,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            reps: 5,
        }
    }
}

/// The GPU part of the report (GB/s counted as for the CPU: the sum moves
/// (P+2)·N·4 bytes, a copy 2·N·4).
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuPart {
    /// Whether a GPU was measured; `reason` says why not.
    pub measured: bool,
    pub reason: String,
    pub device: Option<String>,
    /// The deterministic f32 sum kernel, best repetition.
    pub sum_gbps: Option<f64>,
    /// cuMemcpyDtoD of one input, same run.
    pub d2d_copy_gbps: Option<f64>,
    /// sum_gbps / d2d_copy_gbps.
    pub ratio_vs_copy: Option<f64>,
    /// Milliseconds per accumulating sum (acc += x0 + ... + x(P-1)), best repetition.
    pub sum_ms: Option<f64>,
    /// Milliseconds per fresh sum (acc = x0 + ... + x(P-1): no read of acc,
    /// torch.sum(X, dim=0, out=acc)'s operation), best repetition.
    pub fresh_sum_ms: Option<f64>,
    /// The sum with bf16 inputs accumulated in f32 (P·N·2 + 2·N·4 bytes).
    pub bf16_sum_gbps: Option<f64>,
    /// cuBLAS SGEMM as SF reconstruction (4096×4096 from P·256 factor rows).
    pub sgemm_gflops: Option<f64>,
    /// Pinned host→device.
    pub h2d_gbps: Option<f64>,
    /// Device→pinned host.
    pub d2h_gbps: Option<f64>,
    /// The kernel's result equals the CPU's bitwise on the bench's data.
    pub matches_cpu_bitwise: Option<bool>,
}

/// The result; `cpu_sum_gbps` and `triad_gbps` are the best repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct AggregateReport {
    pub inputs: usize,
    pub mib: usize,
    pub threads: usize,
    pub reps: usize,
    pub cpu_sum_gbps: f64,
    pub triad_gbps: f64,
    /// cpu_sum_gbps / triad_gbps.
    pub ratio: f64,
    pub cpu_sum_gbps_median: f64,
    pub triad_gbps_median: f64,
    pub gpu: GpuPart,
}

/// Why `bench aggregate` could not measure. (The GPU part never fails the
/// bench: what stops it is reported in [`GpuPart::reason`].)
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// The options are out of bounds (see the constants on [`AggregateOpts`]).
    #[error(
        "{inputs} inputs, {mib} MiB, {threads} threads, {reps} repetitions: need 1..=64 inputs, \
         1..=16384 MiB, at least 1 thread and 1..=1000 repetitions"
    )]
    Options {
        inputs: usize,
        mib: usize,
        threads: usize,
        reps: usize,
    },
    /// MemAvailable is below what the arrays need, so the run would swap or be killed.
    #[error(
        "needs {need_mib} MiB ({inputs} inputs + accumulator + 3 triad arrays of {mib} MiB), \
         but only {available_mib} MiB are available"
    )]
    Memory {
        need_mib: usize,
        available_mib: u64,
        inputs: usize,
        mib: usize,
    },
    /// One array could not be allocated.
    #[error("cannot allocate {mib} MiB for {what}")]
    Alloc {
        what: &'static str,
        mib: usize,
        #[source]
        source: TryReserveError,
    },
    /// The measured loops did not compute what they should (the values are checked
    /// so that neither loop can be optimized away).
    #[error("aggregation produced wrong values: sum {sum}, triad {triad} (want a finite sum and triad 7)")]
    WrongValues { sum: f32, triad: f32 },
}
