//! `tidewire-papers`: the Poseidon and P3 evaluations, reproduced with
//! `tidewire sim` at the papers' scale and, with `--train`, with
//! `tidewire train` under the bandwidth harness (`ci/netem/`) at the sizes
//! this machine holds. It writes `EVAL.md`, `results.json` and PNG plots
//! into `--out`, and checks the papers' effects.
//!
//! ```text
//! bench/papers/regen.sh                      # everything, into bench/papers/ (root for --train)
//! tidewire-papers --out target/papers        # simulation only
//! tidewire-papers --out target/papers --check  # exit 1 if an effect does not show
//! ```
//!
//! The modules: [`poseidon`] and [`p3`] hold each paper's figures (their
//! jobs, effects, `EVAL.md` sections and plots; P3's effects are
//! in [`p3_effects`]); [`claims`] holds the claims table, every number the
//! papers' texts state beside ours (its rows in [`claims_poseidon`],
//! [`claims_p3`] and [`claims_nexus`]); [`runner`]
//! runs the simulations and the harness; [`render`] writes `EVAL.md`
//! around the papers' sections; [`plot`] draws the panels.
//!
//! To add a figure: push its [`Job`]s in its paper's jobs function (phase
//! 1, or phase 2 if they depend on phase 1's results), find its points
//! with [`find`] or [`find_by`], and give it an effects function (pushing
//! [`Effect`]s), a section of its paper's `EVAL.md` (tables with
//! [`table`]) and, if it has a plot, a `plot_*` function built on
//! [`panel`].

mod claims;
mod claims_nexus;
mod claims_p3;
mod claims_poseidon;
mod p3;
mod p3_effects;
mod plot;
mod poseidon;
mod render;
mod runner;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use serde::{Deserialize, Serialize};
use tidewire_cli::sim::{self, SimResult};

use claims::*;
use claims_nexus::*;
use claims_p3::*;
use claims_poseidon::*;
use p3::*;
use p3_effects::*;
use plot::*;
use poseidon::*;
use render::*;
use runner::*;

#[derive(Parser, Debug)]
#[command(
    name = "tidewire-papers",
    about = "Reproduce Poseidon's and P3's evaluations with tidewire sim (and tidewire train under ci/netem)"
)]
struct Cli {
    /// Where EVAL.md, results.json and the PNGs go.
    #[arg(long, default_value = "bench/papers")]
    out: PathBuf,
    /// Simulated iterations per run.
    #[arg(long, default_value_t = 10)]
    iters: u64,
    /// Simulated iterations per run of the slice-size sweep (P3's Fig. 12),
    /// whose small slices are the slowest runs to simulate.
    #[arg(long, default_value_t = 5)]
    sweep_iters: u64,
    /// Simulations run at once (each is single-threaded and deterministic:
    /// the results do not depend on it). Default: the cores available.
    #[arg(long)]
    jobs: Option<usize>,
    /// Also run `tidewire train` under the bandwidth harness for the P3
    /// figure (needs root, iproute2, iperf3 and a built `tidewire`: see --tidewire).
    #[arg(long)]
    train: bool,
    /// Harness runs as MODEL@PROFILE, comma-separated (with --train).
    #[arg(
        long,
        default_value = "resnet-50@1gbe,resnet-50@2gbe,resnet-50@5gbe,vgg19@2gbe,vgg19@5gbe"
    )]
    train_points: String,
    /// Instead of --train: the `train` runs of an earlier results.json (e.g.
    /// bench/papers/results.json from a run as root), carried over and marked
    /// so in EVAL.md; their `sim` column is simulated again here.
    #[arg(long, conflicts_with = "train")]
    train_from: Option<PathBuf>,
    /// Iterations of each `train` run.
    #[arg(long, default_value_t = 5)]
    train_iters: u64,
    /// The tidewire binary for --train (default: the `tidewire` beside this binary,
    /// in the same target directory, which is where `cargo build --release -p tidewire-cli`
    /// puts it, CARGO_TARGET_DIR or not).
    #[arg(long)]
    tidewire: Option<PathBuf>,
    /// Exit with status 1 when one of the papers' effects does not show.
    #[arg(long)]
    check: bool,
    /// A TTF font for the plots.
    #[arg(long, default_value = tidewire_bench::DEFAULT_FONT)]
    font: PathBuf,
}

impl Cli {
    fn tidewire(&self) -> PathBuf {
        self.tidewire.clone().unwrap_or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(|d| d.join("tidewire")))
                .unwrap_or_else(|| PathBuf::from("target/release/tidewire"))
        })
    }
}

/// One simulated point.
#[derive(Debug, Clone, Serialize)]
struct Point {
    figure: &'static str,
    model: String,
    nodes: usize,
    bandwidth_gbps: f64,
    sync: String,
    /// P3's slice size, parameters (modes without slices: the 2 MiB chunk's).
    slice_params: usize,
    iteration_s: f64,
    throughput_samples_s: f64,
    speedup: f64,
    /// Per host (the workers, then separate servers): payload bytes its NIC
    /// sent and received per iteration, the set-up not counted. Only the
    /// points of Poseidon's simulated Fig. 10 have it ([`Job::hosts`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    host_bytes_per_iter: Vec<[f64; 2]>,
}

/// One `train` run under the harness.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainPoint {
    model: String,
    profile: String,
    shaped_gbps: f64,
    dilation: u32,
    sync: String,
    train_throughput_samples_s: f64,
    sim_throughput_samples_s: f64,
}

/// An effect of the papers, checked on our numbers.
#[derive(Debug, Serialize)]
struct Effect {
    claim: String,
    evidence: String,
    holds: bool,
}

fn main() {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("tidewire-papers: {e}");
            std::process::exit(2);
        }
    }
}

/// Parses `--train-points` (with `--train`) into (model, profile) pairs,
/// and checks that the `tidewire` binary is there, before any long run.
fn train_points(cli: &Cli) -> Result<Vec<(String, String)>, String> {
    let mut train_points = Vec::new();
    if cli.train {
        for p in cli.train_points.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (m, prof) = p
                .split_once('@')
                .ok_or_else(|| format!("--train-points {p:?}: give MODEL@PROFILE, e.g. resnet-50@2gbe"))?;
            if !P3_MODELS.contains(&m) {
                return Err(format!(
                    "--train-points {p:?}: the P3 figure has {}",
                    P3_MODELS.join(" and ")
                ));
            }
            train_points.push((m.to_string(), prof.to_string()));
        }
        if !cli.tidewire().exists() {
            return Err(format!(
                "{} is missing: cargo build --release -p tidewire-cli --bin tidewire first",
                cli.tidewire().display()
            ));
        }
    }
    Ok(train_points)
}

/// The `train` runs of `--train-from`'s results.json, if given.
fn carried_train(cli: &Cli) -> Result<Option<Vec<TrainPoint>>, String> {
    Ok(match &cli.train_from {
        None => None,
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| format!("--train-from {}: {e}", p.display()))?;
            let j: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("--train-from {}: {e}", p.display()))?;
            let t: Vec<TrainPoint> = serde_json::from_value(j["train"].clone())
                .map_err(|e| format!("--train-from {}: its \"train\": {e}", p.display()))?;
            if t.is_empty() {
                return Err(format!("--train-from {}: it has no train runs", p.display()));
            }
            Some(t)
        }
    })
}

/// Runs `tidewire train` under the harness at each of `train_points`, in
/// each of [`TRAIN_MODES`], beside `tidewire sim` at the shaped rate.
fn train_runs(cli: &Cli, train_points: &[(String, String)]) -> Result<Vec<TrainPoint>, String> {
    let mut train = Vec::new();
    for (k, (model, profile)) in train_points.iter().enumerate() {
        for sync in TRAIN_MODES {
            eprintln!(
                "[{}/{}] train {model} under {profile}, {sync} ({} iterations)",
                k + 1,
                train_points.len(),
                cli.train_iters
            );
            let (tp, rate, dil) = train_under_harness(cli, model, profile, sync)?;
            let mut a = sim_args(model, 4, rate, sync, cli.train_iters);
            a.job.time_scale = f64::from(dil);
            let s = sim::run(&a).map_err(|e| e.to_string())?;
            eprintln!(
                "      {tp:.1} samples/s (sim at {rate} Gbit/s × {dil}: {:.1})",
                s.throughput_samples_s
            );
            train.push(TrainPoint {
                model: model.clone(),
                profile: profile.clone(),
                shaped_gbps: rate,
                dilation: dil,
                sync: sync.into(),
                train_throughput_samples_s: tp,
                sim_throughput_samples_s: s.throughput_samples_s,
            });
        }
    }
    Ok(train)
}

/// The carried-over `train` runs, their `sim` column simulated again.
fn resimulate_carried(cli: &Cli, carried: &[TrainPoint]) -> Result<Vec<TrainPoint>, String> {
    let mut train = Vec::new();
    for c in carried {
        let mut a = sim_args(&c.model, 4, c.shaped_gbps, &c.sync, cli.train_iters);
        a.job.time_scale = f64::from(c.dilation);
        let s = sim::run(&a).map_err(|e| e.to_string())?;
        train.push(TrainPoint {
            sim_throughput_samples_s: s.throughput_samples_s,
            ..c.clone()
        });
    }
    Ok(train)
}

/// Every effect of both papers, in `EVAL.md`'s order.
fn all_effects(pts: &[Point], util: &[Util]) -> Vec<Effect> {
    let mut eff = poseidon_bandwidth_effects(pts);
    eff.extend(p3_best_effects(pts));
    eff.extend(p3_bw_effects(pts));
    eff.extend(more_effects(pts, util));
    eff.extend(adam_effects(pts));
    eff
}

/// The PNGs, in the order [`write_plots`] draws them.
const PNGS: [&str; 7] = [
    "poseidon-bandwidth.png",
    "poseidon-scaling.png",
    "p3-bandwidth.png",
    "p3-utilization.png",
    "p3-scaling.png",
    "p3-slices.png",
    "p3-kvstore.png",
];

/// Draws every figure's plot into `--out`.
fn write_plots(cli: &Cli, pts: &[Point], util: &[Util], train: &[TrainPoint]) -> Result<(), String> {
    plot_poseidon_bandwidth(pts, &cli.out.join(PNGS[0]))?;
    plot_scaling(pts, &cli.out.join(PNGS[1]))?;
    plot_p3(pts, train, &cli.out.join(PNGS[2]))?;
    plot_util(pts, util, &cli.out.join(PNGS[3]))?;
    plot_p3_scaling(pts, &cli.out.join(PNGS[4]))?;
    plot_slices(pts, &cli.out.join(PNGS[5]))?;
    plot_kvstore(pts, &cli.out.join(PNGS[6]))?;
    Ok(())
}

fn run(cli: &Cli) -> Result<bool, String> {
    if cli.iters == 0 || cli.train_iters == 0 {
        return Err("--iters and --train-iters must be at least 1".into());
    }
    // Check the --train-points before any long run.
    let train_points = train_points(cli)?;
    // Read before anything is written: it may be the results.json this run replaces.
    let carried = carried_train(cli)?;
    tidewire_bench::register_font(&cli.font).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&cli.out).map_err(|e| format!("{}: {e}", cli.out.display()))?;
    let t0 = Instant::now();

    let threads = cli
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    // Phase 1: the figures whose points are fixed.
    let mut jobs: Vec<Job> = Vec::new();
    jobs.extend(poseidon_jobs(cli.iters));
    jobs.extend(p3_bandwidth_jobs(cli.iters));
    jobs.extend(adam_jobs(cli.iters));
    jobs.extend(p3_scaling_jobs(cli.iters));
    jobs.extend(claims_jobs(cli.iters));
    let mut pts: Vec<Point> = run_sims(&jobs, threads)?.into_iter().map(|(p, _)| p).collect();
    eprintln!("{} simulations in {:.1} s", jobs.len(), t0.elapsed().as_secs_f64());

    // Phase 2: the points at the bandwidths phase 1 found: the slice sizes
    // and the link traces of P3's Figs. 8, 9 and 12.
    let jobs = p3_phase2_jobs(&pts, cli.sweep_iters);
    let t1 = Instant::now();
    let phase2 = run_sims(&jobs, threads)?;
    eprintln!("{} more simulations in {:.1} s", jobs.len(), t1.elapsed().as_secs_f64());
    let traced: Vec<(Point, SimResult)> = phase2
        .iter()
        .filter(|(p, _)| p.figure == "p3-utilization")
        .cloned()
        .collect();
    let util = utilization(&traced)?;
    pts.extend(phase2.into_iter().map(|(p, _)| p));

    let mut train = train_runs(cli, &train_points)?;
    if let Some(t) = &carried {
        train.extend(resimulate_carried(cli, t)?);
    }
    let eff = all_effects(&pts, &util);
    write_plots(cli, &pts, &util, &train)?;
    let json = serde_json::json!({ "sim": pts, "utilization": util, "train": train, "effects": eff });
    let jp = cli.out.join("results.json");
    std::fs::write(&jp, serde_json::to_string_pretty(&json).expect("serializable") + "\n")
        .map_err(|e| format!("{}: {e}", jp.display()))?;
    let md = eval_md(cli, &pts, &util, &train, &eff);
    let mp = cli.out.join("EVAL.md");
    std::fs::write(&mp, md).map_err(|e| format!("{}: {e}", mp.display()))?;
    for e in &eff {
        println!(
            "{} {} ({})",
            if e.holds { "SHOWS  " } else { "MISSING" },
            e.claim,
            e.evidence
        );
    }
    println!(
        "wrote {} (and results.json, {} PNGs) in {:.1} s",
        mp.display(),
        PNGS.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(eff.iter().all(|e| e.holds) || !cli.check)
}
