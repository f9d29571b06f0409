//! Every `--sync` mode of `tidewire train` side by side, in one sitting:
//! for each case (model and layout) and repetition it runs every mode once,
//! rotating the order each repetition so that no mode always goes first, and
//! appends each run's samples/s to a raw TSV. `--report` turns the TSV into a
//! markdown table, JSON and a PNG, with the "Never slower" checks:
//! - `full` at least 0.95x the best other mode, on every row;
//! - `full` at least 1.3x `wfbp` on VGG19 at 1 Gbit/s (profile `1gbe`);
//! - `p3` at least 0.97x `wfbp` on loopback and at 5 Gbit/s (`5gbe`).
//!
//! `bench/compare-sync.sh` drives it, on loopback and under `ci/netem`
//! profiles (inside `netem.sh run`, the namespaces come from `NETEM_NS`,
//! `NETEM_ADDRS` and `NETEM_DILATION`).
//!
//! ```text
//! tidewire-compare-sync run --tidewire target/release/tidewire --net loopback \
//!     --case vgg19:3:1:- --case alexnet:3:1:- --reps 3 --raw raw.tsv
//! tidewire-compare-sync report --raw raw.tsv --md t.md --json t.json --png t.png --enforce
//! ```

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use plotters::prelude::*;
use tidewire_bench::median;

#[derive(Parser)]
#[command(
    name = "tidewire-compare-sync",
    about = "Every --sync mode of tidewire train side by side"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the cases, appending rows to the raw TSV.
    Run(RunArgs),
    /// Summarize a raw TSV: markdown, JSON, PNG and the checks.
    Report(ReportArgs),
    /// Predict every (network, case, mode) of a raw TSV with `tidewire sim
    /// --profile`, appending one row per prediction (status `sim`) to a TSV
    /// that `report --sim` reads.
    Predict(PredictArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// The tidewire binary.
    #[arg(long)]
    tidewire: PathBuf,
    /// The network's name in the table: loopback, or the ci/netem profile.
    #[arg(long, default_value = "loopback")]
    net: String,
    /// MODEL:WORKERS:SERVERS:BATCH (SERVERS 0: colocated; BATCH -: the model's); repeatable.
    #[arg(long = "case", required = true)]
    cases: Vec<String>,
    /// The modes, space- or comma-separated.
    #[arg(long, default_value = "wfbp fifo-ps sliced p3 hybrid full")]
    modes: String,
    /// Repetitions of every mode.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Iterations per run.
    #[arg(long, default_value_t = 4)]
    iters: usize,
    /// Extra arguments for every train (space-separated).
    #[arg(long, default_value = "")]
    extra: String,
    /// Seconds one run may take.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// The raw TSV to append to.
    #[arg(long)]
    raw: PathBuf,
}

#[derive(clap::Args)]
struct ReportArgs {
    /// The raw TSV (`net case mode rep samples_s iteration_s status`).
    #[arg(long)]
    raw: PathBuf,
    #[arg(long)]
    md: Option<PathBuf>,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    png: Option<PathBuf>,
    /// Exit 1 when a check fails.
    #[arg(long)]
    enforce: bool,
    /// A TTF font for the plot's text.
    #[arg(long, default_value = tidewire_bench::DEFAULT_FONT)]
    font: PathBuf,
    /// Predictions (`predict --out`): adds train / sim per mode, and a check
    /// that every mode's median lies within 10% of the simulator's.
    #[arg(long)]
    sim: Option<PathBuf>,
}

#[derive(clap::Args)]
struct PredictArgs {
    /// The tidewire binary.
    #[arg(long)]
    tidewire: PathBuf,
    /// The `tidewire calibrate --out` profile of the machine the runs were on.
    #[arg(long)]
    profile: PathBuf,
    /// The runs' raw TSV: every (network, case, mode) in it with a good run is predicted.
    #[arg(long)]
    raw: PathBuf,
    /// Where the predictions go (replaced).
    #[arg(long)]
    out: PathBuf,
    /// Iterations per simulated run (the runs' own, for the same warm-up share).
    #[arg(long, default_value_t = 4)]
    iters: usize,
    /// A network's link: NET=GBIT or NET=GBIT:DILATION (ci/netem's shaped rate per NIC and its
    /// time dilation); repeatable. Known without it: 1gbe, 2gbe, 5gbe and 10gbe (undilated);
    /// loopback has no link of its own (the profile's loopback rate, shared by the ranks).
    #[arg(long = "rate")]
    rates: Vec<String>,
}

/// One run's line of the raw TSV.
#[derive(Debug, Clone, PartialEq)]
struct Raw {
    net: String,
    case: String,
    mode: String,
    rep: usize,
    samples_s: f64,
    iteration_s: f64,
    status: String,
}

fn case_args(case: &str) -> Result<Vec<String>, String> {
    let f: Vec<&str> = case.split(':').collect();
    if f.len() != 4 {
        return Err(format!("case {case:?}: want MODEL:WORKERS:SERVERS:BATCH"));
    }
    let num = |s: &str, what: &str| {
        s.parse::<usize>()
            .map_err(|_| format!("case {case:?}: {what} {s:?} is not a number"))
    };
    let mut a = vec![
        "--model".to_string(),
        f[0].to_string(),
        "--workers".into(),
        num(f[1], "workers")?.to_string(),
    ];
    match num(f[2], "servers")? {
        0 => a.push("--colocate".into()),
        s => a.extend(["--servers".into(), s.to_string()]),
    }
    if f[3] != "-" {
        a.extend(["--batch".into(), num(f[3], "batch")?.to_string()]);
    }
    Ok(a)
}

/// Rotation: repetition `rep` starts at mode `rep mod count`.
fn order(modes: &[String], rep: usize) -> Vec<String> {
    let n = modes.len().max(1);
    (0..modes.len()).map(|i| modes[(rep + i) % n].clone()).collect()
}

fn one(a: &RunArgs, case: &str, mode: &str) -> Result<(f64, f64, String), String> {
    let mut c = Command::new(&a.tidewire);
    c.arg("train").args(case_args(case)?);
    c.args(["--iters", &a.iters.to_string(), "--sync", mode, "--json"]);
    c.args(a.extra.split_whitespace());
    // Under ci/netem/netem.sh run: one rank per namespace, compute dilated alike.
    if let (Ok(ns), Ok(addrs)) = (std::env::var("NETEM_NS"), std::env::var("NETEM_ADDRS")) {
        c.args(["--netns", &ns, "--netns-addrs", &addrs]);
        if let Ok(d) = std::env::var("NETEM_DILATION") {
            if d.trim() != "1" {
                c.args(["--time-scale", d.trim()]);
            }
        }
    }
    let mut child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", a.tidewire.display()))?;
    let started = Instant::now();
    loop {
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        if started.elapsed() > Duration::from_secs(a.timeout_s) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("timed out after {} s", a.timeout_s));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        return Err(format!(
            "{}: {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        ));
    }
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("train's JSON: {e}"))?;
    let get = |k: &str| j[k].as_f64().ok_or_else(|| format!("train's JSON has no {k}"));
    Ok((get("throughput_samples_s")?, get("iteration_s")?, fc_schemes(&j)))
}

/// The start-up scheme of each FC layer in `train`'s JSON report, as
/// `fc6:sfb fc7:ps` (empty where it lists none): with `hybrid` and `full`
/// the choice can differ from one run to the next, and the samples/s with it.
fn fc_schemes(j: &serde_json::Value) -> String {
    j["layers"]
        .as_array()
        .map(|ls| {
            ls.iter()
                .filter(|l| l["kind"].as_str().is_some_and(|k| k.eq_ignore_ascii_case("fc")))
                .filter_map(|l| Some(format!("{}:{}", l["name"].as_str()?, l["scheme"].as_str()?)))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

fn run(a: &RunArgs) -> Result<(), String> {
    let modes: Vec<String> = a
        .modes
        .split([' ', ','])
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if modes.is_empty() || a.reps == 0 || a.iters == 0 {
        return Err("give at least one mode, one repetition and one iteration".into());
    }
    for c in &a.cases {
        case_args(c)?;
    }
    let mut raw = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&a.raw)
        .map_err(|e| format!("{}: {e}", a.raw.display()))?;
    let total = a.cases.len() * a.reps * modes.len();
    let mut done = 0;
    for case in &a.cases {
        for rep in 0..a.reps {
            for mode in order(&modes, rep) {
                done += 1;
                let t = Instant::now();
                let (s, i, fc, status) = match one(a, case, &mode) {
                    Ok((s, i, fc)) => (s, i, fc, "ok".to_string()),
                    Err(e) => (
                        0.0,
                        0.0,
                        String::new(),
                        format!("failed: {}", e.replace(['\t', '\n'], " ")),
                    ),
                };
                println!(
                    "[{done}/{total}] {} {case} {mode} rep {}: {s:.1} samples/s ({:.0} s){}{}",
                    a.net,
                    rep + 1,
                    t.elapsed().as_secs_f64(),
                    if fc.is_empty() {
                        String::new()
                    } else {
                        format!(" [{fc}]")
                    },
                    if status == "ok" {
                        String::new()
                    } else {
                        format!(" {status}")
                    }
                );
                writeln!(raw, "{}\t{case}\t{mode}\t{}\t{s}\t{i}\t{status}", a.net, rep + 1)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(())
}

/// A network's simulated link: (bandwidth argument for `tidewire sim`, or
/// `loopback` for its `--loopback`, time dilation).
fn link_of(net: &str, given: &[String]) -> Result<(String, f64), String> {
    for g in given {
        let (name, v) = g
            .split_once('=')
            .ok_or_else(|| format!("--rate {g:?}: want NET=GBIT[:DILATION]"))?;
        if name != net {
            continue;
        }
        let (gbit, d) = v.split_once(':').unwrap_or((v, "1"));
        let num = |s: &str| s.parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0);
        let (gbit, d) = (num(gbit), num(d));
        return match (gbit, d) {
            (Some(b), Some(d)) => Ok((format!("{}", b * 1e9), d)),
            _ => Err(format!("--rate {g:?}: GBIT and DILATION must be positive numbers")),
        };
    }
    match net {
        "loopback" => Ok(("loopback".into(), 1.0)),
        "1gbe" | "2gbe" | "5gbe" | "10gbe" => Ok((net.replace("gbe", "gbit"), 1.0)),
        _ => Err(format!(
            "network {net:?}: its shaped rate and dilation are not known here; give --rate {net}=GBIT[:DILATION] (ci/netem/netem.sh prints both)"
        )),
    }
}

/// `tidewire sim`'s flags for a case: `--nodes` where train colocates.
fn sim_case_args(case: &str) -> Result<Vec<String>, String> {
    let mut a = case_args(case)?;
    if let Some(i) = a.iter().position(|x| x == "--colocate") {
        a.remove(i);
        a[2] = "--nodes".into();
    }
    Ok(a)
}

fn predict(a: &PredictArgs) -> Result<(), String> {
    if a.iters == 0 {
        return Err("--iters: give at least one iteration".into());
    }
    let text = std::fs::read_to_string(&a.raw).map_err(|e| format!("{}: {e}", a.raw.display()))?;
    let mut seen: Vec<(String, String, String)> = Vec::new();
    for r in parse(&text)?.into_iter().filter(|r| r.status == "ok") {
        let k = (r.net, r.case, r.mode);
        if !seen.contains(&k) {
            seen.push(k);
        }
    }
    if seen.is_empty() {
        return Err(format!("{}: no good run to predict", a.raw.display()));
    }
    let mut lines = String::new();
    for (n, (net, case, mode)) in seen.iter().enumerate() {
        let (bw, d) = link_of(net, &a.rates)?;
        let out = Command::new(&a.tidewire)
            .arg("sim")
            .args(sim_case_args(case)?)
            .args(["--sync", mode, "--iters", &a.iters.to_string()])
            .args(if bw == "loopback" {
                vec!["--loopback".to_string()]
            } else {
                vec!["--bandwidth".to_string(), bw]
            })
            .args(["--time-scale", &d.to_string(), "--json", "--profile"])
            .arg(&a.profile)
            .output()
            .map_err(|e| format!("{}: {e}", a.tidewire.display()))?;
        if !out.status.success() {
            return Err(format!(
                "sim for {net} {case} {mode}: {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("sim's JSON: {e}"))?;
        let get = |k: &str| j[k].as_f64().ok_or_else(|| format!("sim's JSON has no {k}"));
        let (s, i) = (get("throughput_samples_s")?, get("iteration_s")?);
        println!("[{}/{}] sim {net} {case} {mode}: {s:.1} samples/s", n + 1, seen.len());
        lines += &format!("{net}\t{case}\t{mode}\t0\t{s}\t{i}\tsim\n");
    }
    std::fs::write(&a.out, lines).map_err(|e| format!("{}: {e}", a.out.display()))
}

fn parse(text: &str) -> Result<Vec<Raw>, String> {
    let mut v = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() != 7 {
            return Err(format!("line {}: {} fields, want 7", n + 1, f.len()));
        }
        let num = |s: &str| s.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0);
        v.push(Raw {
            net: f[0].into(),
            case: f[1].into(),
            mode: f[2].into(),
            rep: f[3]
                .parse()
                .map_err(|_| format!("line {}: bad repetition {:?}", n + 1, f[3]))?,
            samples_s: num(f[4]).ok_or_else(|| format!("line {}: bad samples/s {:?}", n + 1, f[4]))?,
            iteration_s: num(f[5]).ok_or_else(|| format!("line {}: bad seconds {:?}", n + 1, f[5]))?,
            status: f[6].into(),
        });
    }
    Ok(v)
}

/// One (network, case): every mode's samples/s over its good runs.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    net: String,
    case: String,
    /// mode -> every good run's samples/s, in repetition order.
    runs: BTreeMap<String, Vec<f64>>,
    /// mode -> the median.
    median: BTreeMap<String, f64>,
    /// mode -> the simulator's samples/s (`report --sim`).
    sim: BTreeMap<String, f64>,
    failed: Vec<String>,
}

fn rows(raw: &[Raw]) -> Vec<Row> {
    let mut by: BTreeMap<(String, String), Row> = BTreeMap::new();
    for r in raw {
        let row = by.entry((r.net.clone(), r.case.clone())).or_insert_with(|| Row {
            net: r.net.clone(),
            case: r.case.clone(),
            runs: BTreeMap::new(),
            median: BTreeMap::new(),
            sim: BTreeMap::new(),
            failed: Vec::new(),
        });
        if r.status == "sim" {
            row.sim.insert(r.mode.clone(), r.samples_s);
        } else if r.status == "ok" {
            row.runs.entry(r.mode.clone()).or_default().push(r.samples_s);
        } else {
            row.failed.push(format!("{} rep {}: {}", r.mode, r.rep, r.status));
        }
    }
    let mut out: Vec<Row> = by.into_values().collect();
    for r in &mut out {
        r.median = r.runs.iter().map(|(m, v)| (m.clone(), median(v))).collect();
    }
    out
}

#[derive(Debug, Clone, serde::Serialize)]
struct Check {
    net: String,
    case: String,
    what: String,
    ratio: f64,
    limit: f64,
    /// The upper bound, for a check that is two-sided.
    max: Option<f64>,
    pass: bool,
}

fn ratio(r: &Row, a: &str, b: &str) -> Option<f64> {
    Some(r.median.get(a)? / r.median.get(b)?.max(1e-12))
}

/// The best median among the modes other than `full`, and its mode.
fn best_fixed(r: &Row) -> Option<(String, f64)> {
    r.median
        .iter()
        .filter(|(m, _)| m.as_str() != "full")
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(m, v)| (m.clone(), *v))
}

fn checks(rows: &[Row]) -> Vec<Check> {
    let mut c = Vec::new();
    let mut band = |r: &Row, what: String, ratio: f64, limit: f64, max: Option<f64>| {
        c.push(Check {
            net: r.net.clone(),
            case: r.case.clone(),
            what,
            ratio,
            limit,
            max,
            pass: ratio >= limit && max.map_or(true, |m| ratio <= m),
        })
    };
    for r in rows {
        if let (Some(full), Some((m, best))) = (r.median.get("full"), best_fixed(r)) {
            band(
                r,
                format!("full / best fixed ({m})"),
                full / best.max(1e-12),
                0.95,
                None,
            );
        }
        if r.net == "1gbe" && r.case.starts_with("vgg19:") {
            if let Some(x) = ratio(r, "full", "wfbp") {
                band(r, "full / wfbp".into(), x, 1.3, None);
            }
        }
        if r.net == "loopback" || r.net == "5gbe" {
            if let Some(x) = ratio(r, "p3", "wfbp") {
                band(r, "p3 / wfbp".into(), x, 0.97, None);
            }
        }
        // The simulator with this machine's profile predicts every mode within 10%.
        for (m, sim) in &r.sim {
            if let Some(t) = r.median.get(m) {
                band(r, format!("{m}: train / sim"), t / sim.max(1e-12), 0.9, Some(1.1));
            }
        }
    }
    c
}

fn markdown(rows: &[Row], checks: &[Check]) -> String {
    let mut modes: Vec<String> = rows.iter().flat_map(|r| r.median.keys().cloned()).collect();
    modes.sort();
    modes.dedup();
    // The paper's order where the modes are the usual ones.
    let rank = |m: &str| {
        ["fifo-ps", "wfbp", "hybrid", "sliced", "p3", "full"]
            .iter()
            .position(|x| *x == m)
            .unwrap_or(9)
    };
    modes.sort_by_key(|m| (rank(m), m.clone()));
    let mut s = String::from("| network | case (model:workers:servers:batch) |");
    for m in &modes {
        s += &format!(" {m} |");
    }
    s += " full / best fixed | full / wfbp | p3 / wfbp | runs |\n|---|---|";
    for _ in 0..modes.len() + 4 {
        s += "---|";
    }
    s += "\n";
    let f = |x: Option<f64>| x.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into());
    for r in rows {
        s += &format!("| {} | {} |", r.net, r.case);
        for m in &modes {
            s += &format!(
                " {} |",
                r.median.get(m).map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into())
            );
        }
        let fb = best_fixed(r).and_then(|(_, b)| r.median.get("full").map(|x| x / b.max(1e-12)));
        let runs = r.runs.values().map(Vec::len).min().unwrap_or(0);
        s += &format!(
            " **{}** | {} | {} | {runs}{} |\n",
            f(fb),
            f(ratio(r, "full", "wfbp")),
            f(ratio(r, "p3", "wfbp")),
            if r.failed.is_empty() {
                String::new()
            } else {
                format!(", {} failed", r.failed.len())
            }
        );
    }
    s += "\nMedian samples/s over the runs; `runs` is the fewest good runs of any mode in the row.\n";
    s += &sim_table(rows, &modes);
    s += "\nChecks:\n";
    for c in checks {
        let bound = match c.max {
            Some(m) => format!("between {} and {m}", c.limit),
            None => format!("at least {}", c.limit),
        };
        s += &format!(
            "- {} {} {}: {:.3} ({bound}) {}\n",
            c.net,
            c.case,
            c.what,
            c.ratio,
            if c.pass { "pass" } else { "**FAIL**" }
        );
    }
    for r in rows.iter().filter(|r| !r.failed.is_empty()) {
        for e in &r.failed {
            s += &format!("- failed run: {} {} {e}\n", r.net, r.case);
        }
    }
    s
}

/// The simulator's samples/s beside train's median, as `sim (train / sim)`,
/// where `report --sim` gave predictions; empty otherwise.
fn sim_table(rows: &[Row], modes: &[String]) -> String {
    if rows.iter().all(|r| r.sim.is_empty()) {
        return String::new();
    }
    let mut s = String::from(
        "\n`tidewire sim --profile` (this machine's calibration) for the same runs, samples/s, with train / sim:\n\n| network | case |",
    );
    for m in modes {
        s += &format!(" {m} |");
    }
    s += "\n|---|---|";
    s += &"---|".repeat(modes.len());
    s += "\n";
    for r in rows.iter().filter(|r| !r.sim.is_empty()) {
        s += &format!("| {} | {} |", r.net, r.case);
        for m in modes {
            s += &match (r.sim.get(m), r.median.get(m)) {
                (Some(p), Some(t)) => format!(" {p:.1} ({:.2}) |", t / p.max(1e-12)),
                (Some(p), None) => format!(" {p:.1} |"),
                _ => " - |".into(),
            };
        }
        s += "\n";
    }
    s
}

fn plot(rows: &[Row], path: &Path, font: &Path) -> Result<(), String> {
    tidewire_bench::register_font(font).map_err(|e| e.to_string())?;
    let mut modes: Vec<String> = rows.iter().flat_map(|r| r.median.keys().cloned()).collect();
    modes.sort();
    modes.dedup();
    let n = rows.len().max(1);
    let root = BitMapBackend::new(path, (260 * n as u32 + 120, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    // Each row's modes as bars, relative to the row's best fixed mode.
    let ymax = relative_max(rows) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "samples/s relative to the best mode other than full",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..n as f64, 0f64..ymax)
        .map_err(|e| e.to_string())?;
    let labels: Vec<String> = rows.iter().map(|r| format!("{} {}", r.net, r.case)).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("ratio")
        .draw()
        .map_err(|e| e.to_string())?;
    // Each group's name above its bars (the x axis has no ticks to hang it on).
    chart
        .draw_series(
            labels
                .iter()
                .enumerate()
                .map(|(i, l)| Text::new(l.clone(), (i as f64 + 0.1, ymax * 0.97), ("sans-serif", 14))),
        )
        .map_err(|e| e.to_string())?;
    let w = 0.8 / modes.len().max(1) as f64;
    for (mi, m) in modes.iter().enumerate() {
        let color = Palette99::pick(mi).to_rgba();
        chart
            .draw_series(mode_bars(rows, m, mi as f64 * w, w, color))
            .map_err(|e| e.to_string())?
            .label(m.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, 0.95), (n as f64, 0.95)],
            BLACK.stroke_width(1),
        )))
        .map_err(|e| e.to_string())?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}

/// The largest ratio of a mode to its row's best fixed mode (at least 1.2).
fn relative_max(rows: &[Row]) -> f64 {
    rows.iter()
        .flat_map(|r| {
            let b = best_fixed(r).map(|x| x.1).unwrap_or(1.0).max(1e-12);
            r.median.values().map(move |v| v / b).collect::<Vec<_>>()
        })
        .fold(1.2, f64::max)
}

/// Mode `m`'s bar in each row that has it (relative to the row's best
/// fixed mode), `offset` into the row's group, `w` wide.
fn mode_bars(rows: &[Row], m: &str, offset: f64, w: f64, color: RGBAColor) -> Vec<Rectangle<(f64, f64)>> {
    rows.iter()
        .enumerate()
        .filter_map(|(ri, r)| {
            let b = best_fixed(r)?.1.max(1e-12);
            let v = r.median.get(m)? / b;
            let x0 = ri as f64 + 0.1 + offset;
            Some(Rectangle::new([(x0, 0.0), (x0 + w * 0.9, v)], color.filled()))
        })
        .collect()
}

fn report(a: &ReportArgs) -> Result<bool, String> {
    let mut text = std::fs::read_to_string(&a.raw).map_err(|e| format!("{}: {e}", a.raw.display()))?;
    if let Some(p) = &a.sim {
        let sim = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        if sim.lines().any(|l| !l.trim().is_empty() && !l.ends_with("\tsim")) {
            return Err(format!(
                "{}: not predict's output (every row's status is sim)",
                p.display()
            ));
        }
        text = text + "\n" + &sim;
    }
    let rows = rows(&parse(&text)?);
    let checks = checks(&rows);
    let md = markdown(&rows, &checks);
    print!("{md}");
    if let Some(p) = &a.md {
        std::fs::write(p, &md).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if let Some(p) = &a.json {
        let j = serde_json::json!({ "rows": rows, "checks": checks });
        std::fs::write(p, serde_json::to_string_pretty(&j).expect("json") + "\n")
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if let Some(p) = &a.png {
        plot(&rows, p, &a.font)?;
    }
    let ok = checks.iter().all(|c| c.pass) && rows.iter().all(|r| r.failed.is_empty());
    Ok(ok || !a.enforce)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Run(a) => run(a).map(|()| true),
        Cmd::Report(a) => report(a),
        Cmd::Predict(a) => predict(a).map(|()| true),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("tidewire-compare-sync: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_become_train_flags_and_bad_ones_are_refused() {
        assert_eq!(
            case_args("vgg19:4:0:128").unwrap(),
            ["--model", "vgg19", "--workers", "4", "--colocate", "--batch", "128"]
        );
        assert_eq!(
            case_args("alexnet:3:1:-").unwrap(),
            ["--model", "alexnet", "--workers", "3", "--servers", "1"]
        );
        assert!(case_args("vgg19:4").unwrap_err().contains("MODEL:WORKERS"));
        assert!(case_args("vgg19:x:1:-").unwrap_err().contains("workers"));
    }

    #[test]
    fn the_fc_layers_start_up_schemes_are_read_from_trains_report() {
        let j = serde_json::json!({"layers": [
            {"name": "conv1", "kind": "conv", "scheme": "ps"},
            {"name": "fc6", "kind": "fc", "scheme": "sfb"},
            {"name": "fc7", "kind": "fc", "scheme": "ps"},
        ]});
        assert_eq!(fc_schemes(&j), "fc6:sfb fc7:ps");
        assert_eq!(fc_schemes(&serde_json::json!({})), "");
    }

    #[test]
    fn every_mode_leads_once_in_as_many_repetitions() {
        let m: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let firsts: Vec<String> = (0..3).map(|r| order(&m, r)[0].clone()).collect();
        assert_eq!(firsts, ["a", "b", "c"]);
        assert_eq!(order(&m, 1), ["b", "c", "a"]);
    }

    #[test]
    fn medians_checks_and_failures() {
        let t = "loopback\tvgg19:3:1:-\twfbp\t1\t40\t1\tok\n\
                 loopback\tvgg19:3:1:-\twfbp\t2\t44\t1\tok\n\
                 loopback\tvgg19:3:1:-\tp3\t1\t38\t1\tok\n\
                 loopback\tvgg19:3:1:-\tp3\t2\t40\t1\tok\n\
                 loopback\tvgg19:3:1:-\tfull\t1\t41\t1\tok\n\
                 loopback\tvgg19:3:1:-\tfull\t2\t0\t0\tfailed: exit 1\n\
                 1gbe\tvgg19:3:1:-\twfbp\t1\t6\t1\tok\n\
                 1gbe\tvgg19:3:1:-\tfull\t1\t19\t1\tok\n";
        let rs = rows(&parse(t).unwrap());
        assert_eq!(rs.len(), 2);
        let lo = rs.iter().find(|r| r.net == "loopback").unwrap();
        assert_eq!(lo.median["wfbp"], 42.0);
        assert_eq!(lo.median["full"], 41.0);
        assert_eq!(lo.failed.len(), 1);
        let c = checks(&rs);
        let get = |net: &str, w: &str| {
            c.iter()
                .find(|x| x.net == net && x.what.starts_with(w))
                .unwrap()
                .clone()
        };
        // 41 / 42 = 0.976 >= 0.95; p3 39 / 42 = 0.929 < 0.97; 1gbe 19 / 6 >= 1.3.
        assert!(get("loopback", "full / best").pass);
        assert!(get("loopback", "full / best").what.contains("wfbp"));
        let p3 = get("loopback", "p3");
        assert!(!p3.pass && (p3.ratio - 39.0 / 42.0).abs() < 1e-12);
        assert!(get("1gbe", "full / wfbp").pass);
        let md = markdown(&rs, &c);
        assert!(md.contains("**FAIL**") && md.contains("failed run"), "{md}");
        assert!(parse("a\tb\tc\n").unwrap_err().contains("line 1"));
        assert!(parse("a\tb\tc\t1\tnan\t1\tok\n").unwrap_err().contains("samples/s"));
    }

    #[test]
    fn predictions_take_the_networks_link_and_the_cases_layout() {
        assert_eq!(link_of("1gbe", &[]).unwrap(), ("1gbit".to_string(), 1.0));
        assert_eq!(link_of("loopback", &[]).unwrap().0, "loopback");
        let given = ["20gbe=5:2".to_string()];
        assert_eq!(link_of("20gbe", &given).unwrap(), ("5000000000".to_string(), 2.0));
        assert!(link_of("40gbe", &given).unwrap_err().contains("--rate 40gbe="));
        assert!(link_of("20gbe", &["20gbe=x".to_string()])
            .unwrap_err()
            .contains("positive"));
        assert_eq!(
            sim_case_args("vgg19:4:0:128").unwrap(),
            ["--model", "vgg19", "--nodes", "4", "--batch", "128"]
        );
        assert_eq!(
            sim_case_args("alexnet:3:1:-").unwrap(),
            ["--model", "alexnet", "--workers", "3", "--servers", "1"]
        );
    }

    #[test]
    fn every_predicted_mode_is_checked_within_ten_percent() {
        let t = "loopback\tvgg19:3:1:-\twfbp\t1\t40\t1\tok\n\
                 loopback\tvgg19:3:1:-\tfull\t1\t50\t1\tok\n\
                 loopback\tvgg19:3:1:-\twfbp\t0\t43\t1\tsim\n\
                 loopback\tvgg19:3:1:-\tfull\t0\t44\t1\tsim\n";
        let rs = rows(&parse(t).unwrap());
        assert_eq!(rs[0].sim.len(), 2);
        assert_eq!(rs[0].runs.len(), 2, "predictions are not runs");
        let c = checks(&rs);
        let get = |w: &str| c.iter().find(|x| x.what == w).unwrap().clone();
        // 40 / 43 = 0.930 in the band; 50 / 44 = 1.136 over it.
        assert!(get("wfbp: train / sim").pass);
        let full = get("full: train / sim");
        assert!(!full.pass && full.max == Some(1.1) && (full.ratio - 50.0 / 44.0).abs() < 1e-12);
        let md = markdown(&rs, &c);
        assert!(md.contains("44.0 (1.14)") && md.contains("between 0.9 and 1.1"), "{md}");
    }
}
