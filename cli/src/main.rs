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
    init_log();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Doctor { json } => {
            let checks = doctor::run();
            print_either(json, &checks, |c| doctor::render(c));
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
                Ok(p) => {
                    print_either(json, &p, plan::render);
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        Cmd::Train(args) => train_cmd(&args),
        Cmd::Bench {
            what: BenchCmd::Aggregate(a),
        } => match tidewire_cli::bench::aggregate(&a) {
            Ok(r) => {
                print_either(a.json, &r, tidewire_gpu::bench::render);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tidewire: error: bench aggregate: {e}");
                ExitCode::FAILURE
            }
        },
        Cmd::Sim(args) => match sim::run(&args) {
            Ok(r) => {
                print_either(args.job.json, &r, sim::render);
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        Cmd::Calibrate(a) => calibrate_cmd(&a),
        Cmd::TrainNode(args) => match train::run_node(&args) {
            Ok(r) => {
                let msg = tidewire_cli::train::pipe::ToLauncher::Result(Box::new(r));
                if let Err(e) = msg.send(&mut std::io::stdout().lock()) {
                    return fail(tidewire_cli::error::Error::Launch(format!(
                        "cannot send the result to the launcher: {e}"
                    )));
                }
                tidewire_cli::train::pipe::hold_until_released();
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
    }
}

/// The log (`TIDEWIRE_LOG`, default warn) goes to stderr.
fn init_log() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("TIDEWIRE_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a rank's stderr is a pipe that train reads and quotes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Prints `v` as pretty JSON with `json`, else as `render` writes it.
fn print_either<T: serde::Serialize>(json: bool, v: &T, render: impl Fn(&T) -> String) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).expect("serializable"));
    } else {
        print!("{}", render(v));
    }
}

/// `tidewire train`: exit 3 when `--verify` found a difference.
fn train_cmd(args: &TrainArgs) -> ExitCode {
    // The ranks get the same flags (the launcher's own are harmless to them).
    let node_args: Vec<String> = std::env::args().skip(2).collect();
    match train::launch(args, node_args) {
        Ok(r) => {
            print_either(args.job.json, &r, train::render);
            if r.verified == Some(false) {
                ExitCode::from(3)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => fail(e),
    }
}

/// `tidewire calibrate`: a profile, a probe's line, or nothing when it served a peer.
fn calibrate_cmd(a: &tidewire_cli::calibrate::CalibrateArgs) -> ExitCode {
    match tidewire_cli::calibrate::run(a) {
        Ok(tidewire_cli::calibrate::Outcome::Profile(p)) => {
            print_either(a.json, &p, tidewire_cli::calibrate::render);
            ExitCode::SUCCESS
        }
        Ok(tidewire_cli::calibrate::Outcome::Probe(r)) => {
            println!("{r}");
            ExitCode::SUCCESS
        }
        Ok(tidewire_cli::calibrate::Outcome::Served) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn fail(e: tidewire_cli::Error) -> ExitCode {
    eprintln!("tidewire: error: {e}");
    ExitCode::FAILURE
}
