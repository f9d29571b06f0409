//! Single-node overhead of the engine (Poseidon reports < 1%): one worker, no
//! peers, the same training loop with and without Tidewire, alternating, in
//! one run. Iterations are the model profile's calibrated compute (sleeps)
//! plus the real work: synthetic gradients, FC gradients formed from their
//! factors, and SGD. Without the engine the loop applies SGD itself after
//! each layer's backward; with it, the layer is handed in and the update
//! comes back through the engine (slices, local push, aggregation, apply,
//! broadcast).
//!
//! ```text
//! cargo run --release -p tidewire-bench --bin tidewire-overhead -- --model vgg19 --reps 3 --json out.json
//! ```

use clap::Parser;
use tidewire_cli::train::{run_single, IterStat, TrainArgs};

#[derive(Parser)]
struct Cli {
    /// Model profile.
    #[arg(long, default_value = "vgg19")]
    model: String,
    /// Iterations per run (the first and last are not counted).
    #[arg(long, default_value_t = 7)]
    iters: u64,
    /// Runs of each variant, alternating.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Compute time scale.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Write the figures as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

fn steady_mean(s: &[IterStat]) -> f64 {
    let inner = if s.len() > 2 { &s[1..s.len() - 1] } else { s };
    inner.iter().map(|i| i.seconds).sum::<f64>() / inner.len() as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let cli = Cli::parse();
    if cli.iters < 3 || cli.reps == 0 {
        eprintln!("tidewire-overhead: need --iters >= 3 and --reps >= 1");
        std::process::exit(2);
    }
    #[derive(Parser)]
    struct Defaults {
        #[command(flatten)]
        train: TrainArgs,
    }
    let mut args = Defaults::parse_from(["train", "--workers", "1", "--colocate"]).train;
    args.job.model = cli.model.clone();
    args.job.iters = cli.iters;
    args.job.time_scale = cli.time_scale;
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for rep in 0..cli.reps {
        for engine in [false, true] {
            let s = match run_single(&args, engine) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("tidewire-overhead: {e}");
                    std::process::exit(1);
                }
            };
            let m = steady_mean(&s);
            if std::env::var("TIDEWIRE_OVERHEAD_DEBUG").is_ok() {
                for i in &s {
                    eprintln!("  iter {} {:.4} s, blocked {:.4} s", i.iter, i.seconds, i.blocked_s);
                }
            }
            eprintln!(
                "rep {rep} {:<15} {:.4} s/iteration",
                if engine { "with engine" } else { "without engine" },
                m
            );
            if engine {
                with.push(m);
            } else {
                without.push(m);
            }
        }
    }
    let ratios: Vec<f64> = with.iter().zip(&without).map(|(a, b)| a / b).collect();
    let (mw, mo, mr) = (median(with.clone()), median(without.clone()), median(ratios.clone()));
    println!(
        "{}: one worker, no peers: {:.4} s/iteration with the engine, {:.4} s without; ratio {:.4} (median of {})",
        cli.model, mw, mo, mr, cli.reps
    );
    if let Some(p) = cli.json {
        let j = serde_json::json!({
            "model": cli.model,
            "iters": cli.iters,
            "time_scale": cli.time_scale,
            "with_engine_s": with,
            "without_engine_s": without,
            "ratios": ratios,
            "ratio_median": mr,
        });
        std::fs::write(&p, serde_json::to_string_pretty(&j).expect("serializable")).expect("write the JSON");
    }
}
