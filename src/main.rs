//! The `tidewire` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("TIDEWIRE_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Doctor { json } => {
            let checks = tidewire::doctor::run();
            if json {
                println!("{}", serde_json::to_string_pretty(&checks).expect("serializable"));
            } else {
                print!("{}", tidewire::doctor::render(&checks));
            }
            ExitCode::SUCCESS
        }
    }
}
