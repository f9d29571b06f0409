use std::io::{IsTerminal as _, Write as _};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use tidewire::engine::SyncMode;
use tidewire_cli::job::JobArgs;
use tidewire_cli::sim::{self, SimArgs, SimResult};

use crate::*;

pub(crate) fn sim_args(model: &str, nodes: usize, gbps: f64, sync: &str, iters: u64) -> SimArgs {
    let d = SimArgs::default();
    SimArgs {
        job: JobArgs {
            model: model.into(),
            sync: SyncMode::parse(sync).unwrap_or_else(|| panic!("{sync}: not a sync mode")),
            iters,
            // Poseidon's PS sums in arrival order (P3's figures: see p3_args).
            fast: true,
            ..d.job.clone()
        },
        gpu: Default::default(),
        nodes: Some(nodes),
        bandwidth: gbps * 1e9,
        latency_us: 5.0,
        ..d
    }
}

/// One simulation of a figure.
pub(crate) struct Job {
    pub(crate) figure: &'static str,
    pub(crate) args: SimArgs,
    /// Also keep every host's NIC bytes per iteration (`SimResult::host_nic_bytes_per_iter`).
    pub(crate) hosts: bool,
}

impl Job {
    pub(crate) fn new(figure: &'static str, args: SimArgs) -> Self {
        Job {
            figure,
            args,
            hosts: false,
        }
    }
}

pub(crate) fn simulate(job: &Job) -> Result<(Point, SimResult), String> {
    let a = &job.args;
    let r: SimResult =
        sim::run(a).map_err(|e| format!("sim {} {} nodes {}: {e}", a.job.model, a.nodes.unwrap_or(0), a.job.sync))?;
    let p = Point {
        figure: job.figure,
        model: a.job.model.clone(),
        nodes: r.workers,
        bandwidth_gbps: r.bandwidth_gbps,
        sync: r.sync.clone(),
        slice_params: r.slice_params,
        iteration_s: r.iteration_s,
        throughput_samples_s: r.throughput_samples_s,
        speedup: r.speedup,
        host_bytes_per_iter: if job.hosts {
            r.host_nic_bytes_per_iter.clone()
        } else {
            Vec::new()
        },
    };
    Ok((p, r))
}

/// A job's point and its whole result (with the trace, if it asked for one).
pub(crate) type Outcome = Result<(Point, SimResult), String>;

/// Roughly how long a job takes to simulate: the nodes, times the slices
/// per chunk in modes with slices (their events).
pub(crate) fn cost(a: &SimArgs) -> f64 {
    let sliced = matches!(a.job.sync.name(), "sliced" | "p3" | "full");
    let per = if sliced {
        5.0 * P3_SLICE as f64 / a.slice() as f64
    } else {
        1.0
    };
    a.nodes.unwrap_or(1) as f64 * per.max(1.0) * a.job.iters as f64
}

/// Runs `jobs`, `threads` at a time (the longest first, so that no long one
/// is left alone at the end), and returns their results in `jobs`' order.
pub(crate) fn run_sims(jobs: &[Job], threads: usize) -> Result<Vec<(Point, SimResult)>, String> {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| cost(&jobs[b].args).total_cmp(&cost(&jobs[a].args)));
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<Outcome>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
    let tty = std::io::stderr().is_terminal();
    std::thread::scope(|sc| {
        for _ in 0..threads.clamp(1, jobs.len().max(1)) {
            sc.spawn(|| {
                while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let job = &jobs[i];
                    let r = simulate(job);
                    let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                    let a = &job.args;
                    let nodes = match (a.nodes, a.workers, a.servers) {
                        (Some(n), _, _) => n.to_string(),
                        (None, Some(w), Some(s)) => format!("{w}+{s}"),
                        _ => "1".into(),
                    };
                    let line = format!(
                        "[{d:>3}/{}] sim {}: {} {nodes} nodes {} Gbit/s {}{}",
                        jobs.len(),
                        job.figure,
                        a.job.model,
                        a.bandwidth / 1e9,
                        a.job.sync,
                        if a.slice() == P3_SLICE {
                            String::new()
                        } else {
                            format!(" slices {}", a.slice())
                        }
                    );
                    if tty {
                        eprint!("\r{line:<80}");
                        let _ = std::io::stderr().flush();
                    } else if d % 25 == 0 || d == jobs.len() {
                        eprintln!("{line}");
                    }
                    out.lock().expect("no thread panicked")[i] = Some(r);
                }
            });
        }
    });
    if tty {
        eprintln!();
    }
    out.into_inner()
        .expect("no thread panicked")
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect()
}

/// The point of figure `fig` that `pick` accepts.
pub(crate) fn find_by<'a>(pts: &'a [Point], fig: &str, pick: impl Fn(&Point) -> bool) -> &'a Point {
    pts.iter()
        .find(|p| p.figure == fig && pick(p))
        .unwrap_or_else(|| panic!("a point of {fig} was not simulated"))
}

pub(crate) fn find<'a>(pts: &'a [Point], fig: &str, model: &str, nodes: usize, bw: f64, sync: &str) -> &'a Point {
    find_by(pts, fig, |p| {
        p.model == model && p.nodes == nodes && (p.bandwidth_gbps - bw).abs() < 1e-9 && p.sync == sync
    })
}

/// Runs `tidewire train` under the harness: (samples/s, shaped Gbit/s, dilation).
pub(crate) fn train_under_harness(
    cli: &Cli,
    model: &str,
    profile: &str,
    sync: &str,
) -> Result<(f64, f64, u32), String> {
    let script = r#"exec "$0" train --model "$1" --workers 4 --colocate --iters "$2" --sync "$3" --fast --json \
        --time-scale "$NETEM_DILATION" --netns "$NETEM_NS" --netns-addrs "$NETEM_ADDRS""#;
    let out = Command::new("bash")
        .args(["ci/netem/netem.sh", "run", profile, "4", "--", "sh", "-c", script])
        .arg(cli.tidewire())
        .args([model, &cli.train_iters.to_string(), sync])
        .output()
        .map_err(|e| format!("ci/netem/netem.sh: {e}"))?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let tail: Vec<&str> = err.lines().rev().take(6).collect();
        return Err(format!(
            "train {model} {sync} under {profile} failed ({}):\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    let j: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("train {model} {sync} under {profile}: its JSON: {e}"))?;
    let tp = j["throughput_samples_s"]
        .as_f64()
        .ok_or("train's JSON has no throughput_samples_s")?;
    // "[netem ..] 4 namespaces on a 1gbe star: 1.000 Gbit/s per NIC each way, dilation 1"
    let line = err
        .lines()
        .find(|l| l.contains("per NIC each way"))
        .ok_or("the harness did not say what it shaped to")?;
    let rate: f64 = line
        .split(": ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("unreadable harness line: {line}"))?;
    let dil: u32 = line
        .rsplit("dilation ")
        .next()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| format!("unreadable harness line: {line}"))?;
    Ok((tp, rate, dil))
}
