//! `tidewire bench`: microbenchmarks of this machine. The measurements live in
//! [`tidewire_gpu::bench`]; this module holds their flags.

use clap::{Args, Subcommand};
use tidewire_gpu::bench::{self, AggregateOpts};

/// What `tidewire bench` measures.
#[derive(Subcommand, Debug, Clone)]
pub enum BenchCmd {
    /// CPU aggregation (sum of P inputs into an accumulator) next to a STREAM-like
    /// triad measured in the same run.
    Aggregate(AggregateArgs),
}

/// Flags of `tidewire bench aggregate`.
#[derive(Args, Debug, Clone)]
pub struct AggregateArgs {
    /// P: inputs summed into the accumulator.
    #[arg(long, default_value_t = 8)]
    pub inputs: usize,
    /// MiB per input (and per triad array).
    #[arg(long, default_value_t = 64)]
    pub mib: usize,
    /// Threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Repetitions of each measurement; the best and the median are reported.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

impl AggregateArgs {
    /// The measurement's options.
    pub fn opts(&self) -> AggregateOpts {
        let mut o = AggregateOpts {
            inputs: self.inputs,
            mib: self.mib,
            reps: self.reps,
            ..Default::default()
        };
        if let Some(t) = self.threads {
            o.threads = t;
        }
        o
    }
}

/// Runs `tidewire bench aggregate`, with its progress lines on stderr.
pub fn aggregate(a: &AggregateArgs) -> Result<bench::AggregateReport, bench::BenchError> {
    bench::aggregate(&a.opts(), |line| eprintln!("{line}"))
}
