//! The `tidewire` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tidewire_cli::bench::BenchCmd;
use tidewire_cli::train::TrainArgs;
use tidewire_cli::{doctor, plan, sim, train};

#[derive(Parser)]
#[command(
    name = "tidewire",
    version,
    about = "Tidewire: communication engine for distributed deep-learning training"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print what this machine can use (io_uring, RDMA, CUDA, pinned memory, huge pages) and why not.
    Doctor {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Poseidon's cost model per layer: bytes under PS and SFB, and the scheme chosen.
    Plan {
        /// Model profile (vgg19, vgg19-22k, googlenet, inception-v3, resnet-50, resnet-152, alexnet, vgg19-mini).
        #[arg(long)]
        model: String,
        /// P1.
        #[arg(long)]
        workers: usize,
        /// P2.
        #[arg(long)]
        servers: usize,
        /// Batch size K per worker.
        #[arg(long)]
        batch: usize,
        /// Every node runs a worker and a server (default when P1 = P2).
        #[arg(long, conflicts_with = "separate")]
        colocate: bool,
        /// Workers and servers on separate nodes (default when P1 ≠ P2).
        #[arg(long)]
        separate: bool,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Launch a local cluster of real processes on loopback and train a model profile.
    Train(TrainArgs),
    /// One rank of `train` (started by `train`; the cluster comes from TIDEWIRE_* variables).
    #[command(hide = true)]
    TrainNode(TrainArgs),
    /// Simulate a cluster: the engine's own core on a discrete-event network (any scale).
    Sim(sim::SimArgs),
    /// Measure this machine's rates (GEMM, sum, TCP stream, message cost) into a
    /// profile: what `train` and `sim` weigh HybComm's choice with, in seconds.
    Calibrate(tidewire_cli::calibrate::CalibrateArgs),
    /// Microbenchmarks of this machine.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("TIDEWIRE_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a rank's stderr is a pipe that train reads and quotes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Doctor { json } => {
            let checks = doctor::run();
            if json {
                println!("{}", serde_json::to_string_pretty(&checks).expect("serializable"));
            } else {
                print!("{}", doctor::render(&checks));
            }
            ExitCode::SUCCESS
        }
        Cmd::Plan {
            model,
            workers,
            servers,
            batch,
            colocate,
            separate,
            json,
        } => {
            let coloc = if colocate {
                Some(true)
            } else if separate {
                Some(false)
            } else {
                None
            };
            match plan::plan(&model, workers, servers, batch, coloc) {
                Ok(p) if json => {
                    println!("{}", serde_json::to_string_pretty(&p).expect("serializable"));
                    ExitCode::SUCCESS
                }
                Ok(p) => {
                    print!("{}", plan::render(&p));
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        Cmd::Train(args) => {
            // The ranks get the same flags (the launcher's own are harmless to them).
            let node_args: Vec<String> = std::env::args().skip(2).collect();
            match train::launch(&args, node_args) {
                Ok(r) => {
                    if args.json {
                        println!("{}", serde_json::to_string_pretty(&r).expect("serializable"));
                    } else {
                        print!("{}", train::render(&r));
                    }
                    if r.verified == Some(false) {
                        ExitCode::from(3)
                    } else {
                        ExitCode::SUCCESS
                    }
                }
                Err(e) => fail(e),
            }
        }
        Cmd::Bench {
            what: BenchCmd::Aggregate(a),
        } => match tidewire_cli::bench::aggregate(&a) {
            Ok(r) if a.json => {
                println!("{}", serde_json::to_string_pretty(&r).expect("serializable"));
                ExitCode::SUCCESS
            }
            Ok(r) => {
                print!("{}", tidewire_gpu::bench::render(&r));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tidewire: error: bench aggregate: {e}");
                ExitCode::FAILURE
            }
        },
        Cmd::Sim(args) => match sim::run(&args) {
            Ok(r) => {
                if args.json {
                    println!("{}", serde_json::to_string_pretty(&r).expect("serializable"));
                } else {
                    print!("{}", sim::render(&r));
                }
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        Cmd::Calibrate(a) => match tidewire_cli::calibrate::run(&a) {
            Ok(tidewire_cli::calibrate::Outcome::Profile(p)) => {
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&p).expect("serializable"));
                } else {
                    print!("{}", tidewire_cli::calibrate::render(&p));
                }
                ExitCode::SUCCESS
            }
            Ok(tidewire_cli::calibrate::Outcome::Probe(r)) => {
                println!("{r}");
                ExitCode::SUCCESS
            }
            Ok(tidewire_cli::calibrate::Outcome::Served) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        },
        Cmd::TrainNode(args) => match train::run_node(&args) {
            Ok(r) => {
                println!("result {}", serde_json::to_string(&r).expect("serializable"));
                tidewire_cli::resilience::hold_until_released();
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
    }
}

fn fail(e: tidewire_cli::Error) -> ExitCode {
    eprintln!("tidewire: error: {e}");
    ExitCode::FAILURE
}
