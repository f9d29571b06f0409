//! `tidewire-nexus`: Nexus's local (hierarchical) aggregation in `tidewire
//! sim`, as its Fig. 12 shows it: nodes of L learners (GPUs) behind one rank
//! that pushes once per node, against the flat run where every learner is a
//! rank and L of them share each node's NIC. Writes `nexus-local.json`,
//! `nexus-local.md` and `nexus-local.png` into `--out`.
//!
//! ```text
//! cargo run --release -p tidewire-bench --bin tidewire-nexus -- --out bench/results
//! ```

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use plotters::prelude::*;
use serde::Serialize;
use tidewire_cli::job::JobArgs;
use tidewire_cli::sim::{self, SimArgs, SimResult};

#[derive(Parser, Debug)]
#[command(
    name = "tidewire-nexus",
    about = "Nexus's local aggregation (Fig. 12) with tidewire sim"
)]
struct Cli {
    /// Where the JSON, the Markdown and the PNG go.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Simulated iterations per run.
    #[arg(long, default_value_t = 10)]
    iters: u64,
    /// Worker nodes (each also a server, as in Nexus's and Poseidon's runs).
    #[arg(long, default_value_t = 8)]
    nodes: usize,
    /// Memory bandwidth between a node's learners, GB/s.
    #[arg(long, default_value_t = 10.0)]
    local_gbytes: f64,
    /// A TTF font for the plot.
    #[arg(long, default_value = tidewire_bench::DEFAULT_FONT)]
    font: PathBuf,
}

const MODELS: [&str; 3] = ["vgg19", "resnet-50", "googlenet"];
const LEARNERS: [usize; 3] = [2, 4, 8];
const BW: [f64; 2] = [10.0, 40.0];

/// One configuration: the local run and its flat counterpart.
#[derive(Debug, Clone, Serialize)]
struct Row {
    model: String,
    bandwidth_gbps: f64,
    learners: usize,
    local: Dissection,
    flat: Dissection,
    speedup_over_flat: f64,
    nic_bytes_ratio_flat_over_local: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Dissection {
    iteration_s: f64,
    compute_s: f64,
    /// Time a learner waited for the network per iteration (not hidden behind compute).
    exposed_wait_s: f64,
    local_agg_s: f64,
    fanout_s: f64,
    node_tx_mb_per_iter: f64,
    node_rx_mb_per_iter: f64,
    throughput_samples_s: f64,
}

fn dissect(r: &SimResult) -> Dissection {
    Dissection {
        iteration_s: r.iteration_s,
        compute_s: r.compute_s,
        exposed_wait_s: r.blocked_s,
        local_agg_s: r.local_agg_s,
        fanout_s: r.fanout_s,
        node_tx_mb_per_iter: r.node_nic_bytes_per_iter[0] / 1e6,
        node_rx_mb_per_iter: r.node_nic_bytes_per_iter[1] / 1e6,
        throughput_samples_s: r.throughput_samples_s,
    }
}

fn run(cli: &Cli, model: &str, gbps: f64, learners: usize) -> Result<Row, String> {
    let d = SimArgs::default();
    let a = SimArgs {
        job: JobArgs {
            model: model.into(),
            iters: cli.iters,
            local_learners: learners,
            chunk_bytes: Some(2 << 20),
            ..d.job.clone()
        },
        nodes: Some(cli.nodes),
        bandwidth: gbps * 1e9,
        latency_us: 5.0,
        local_bandwidth: cli.local_gbytes * 8e9,
        slice_params: Some(50_000),
        ..d
    };
    let r = sim::run(&a).map_err(|e| format!("sim {model} {gbps} GbE L={learners}: {e}"))?;
    let f = r.flat_run.as_deref().ok_or("no flat run")?;
    let bytes = |d: &SimResult| d.node_nic_bytes_per_iter[0] + d.node_nic_bytes_per_iter[1];
    Ok(Row {
        model: model.into(),
        bandwidth_gbps: gbps,
        learners,
        local: dissect(&r),
        flat: dissect(f),
        speedup_over_flat: r.speedup_over_flat.unwrap_or(f64::NAN),
        nic_bytes_ratio_flat_over_local: bytes(f) / bytes(&r),
    })
}

fn plot(rows: &[Row], cli: &Cli, path: &Path) -> Result<(), String> {
    tidewire_bench::register_font(&cli.font).map_err(|e| e.to_string())?;
    let root = BitMapBackend::new(path, (1300, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (left, right) = root.split_horizontally(700);
    plot_dissection(&left, rows, cli)?;
    plot_speedups(&right, rows)?;
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

/// The left panel: VGG19 at 10 GbE, iteration time = compute + exposed wait,
/// flat and local, per L.
fn plot_dissection(area: &Area<'_>, rows: &[Row], cli: &Cli) -> Result<(), String> {
    let vgg: Vec<&Row> = rows
        .iter()
        .filter(|r| r.model == "vgg19" && r.bandwidth_gbps == 10.0)
        .collect();
    let ymax = vgg
        .iter()
        .map(|r| r.flat.iteration_s.max(r.local.iteration_s))
        .fold(0.0, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("VGG19, {} nodes, 10 GbE: the iteration, dissected", cli.nodes),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..(vgg.len() as f64 * 3.0), 0f64..ymax)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("seconds per iteration")
        .draw()
        .map_err(|e| e.to_string())?;
    let compute = RGBColor(120, 120, 120);
    let wait = RGBColor(200, 60, 40);
    for (i, r) in vgg.iter().enumerate() {
        for (j, (d, label)) in [(&r.flat, "flat"), (&r.local, "local")].iter().enumerate() {
            let x0 = i as f64 * 3.0 + 0.3 + j as f64 * 1.2;
            let comp = d.iteration_s - d.exposed_wait_s;
            chart
                .draw_series([
                    Rectangle::new([(x0, 0.0), (x0 + 1.0, comp)], compute.filled()),
                    Rectangle::new([(x0, comp), (x0 + 1.0, d.iteration_s)], wait.filled()),
                ])
                .map_err(|e| e.to_string())?;
            chart
                .draw_series([Text::new(
                    format!("{label} L={}", r.learners),
                    (x0, d.iteration_s + ymax * 0.04),
                    ("sans-serif", 13),
                )])
                .map_err(|e| e.to_string())?;
        }
    }
    chart
        .draw_series([Rectangle::new([(0.0, 0.0), (0.0, 0.0)], compute.filled())])
        .map_err(|e| e.to_string())?
        .label("the rest of the iteration (compute, sync hidden behind it)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], compute.filled()));
    chart
        .draw_series([Rectangle::new([(0.0, 0.0), (0.0, 0.0)], wait.filled())])
        .map_err(|e| e.to_string())?
        .label("exposed sync (waiting for the network)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], wait.filled()));
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The right panel: speedup of local aggregation over the flat run against L.
fn plot_speedups(area: &Area<'_>, rows: &[Row]) -> Result<(), String> {
    let smax = rows.iter().map(|r| r.speedup_over_flat).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption("local aggregation over the flat run", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(1.5f64..8.5, 0.8f64..smax)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("learners per node (L)")
        .y_desc("speedup over flat")
        .draw()
        .map_err(|e| e.to_string())?;
    let colors = [
        RGBColor(200, 60, 40),
        RGBColor(40, 110, 200),
        RGBColor(30, 150, 70),
        RGBColor(140, 80, 170),
        RGBColor(220, 140, 20),
        RGBColor(90, 90, 90),
    ];
    let mut c = 0;
    for m in MODELS {
        for bw in BW {
            let pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.model == m && r.bandwidth_gbps == bw)
                .map(|r| (r.learners as f64, r.speedup_over_flat))
                .collect();
            let col = colors[c % colors.len()];
            c += 1;
            chart
                .draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(format!("{m}, {bw} GbE"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], col.stroke_width(2)));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, col.filled())))
                .map_err(|e| e.to_string())?;
        }
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn markdown(rows: &[Row], cli: &Cli) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Nexus's local aggregation in `tidewire sim`\n");
    let _ = writeln!(
        s,
        "Generated by `tidewire-nexus` (`cargo run --release -p tidewire-bench --bin tidewire-nexus -- --out bench/results`); \
         do not edit by hand. {} nodes, each a worker and a server; full sync (WFBP + HybComm + P3 slicing), BSP in rank order; \
         5 µs latency; {} GB/s between a node's learners; {} iterations per run. Batch per learner: the profile's.\n",
        cli.nodes, cli.local_gbytes, cli.iters
    );
    let _ = writeln!(
        s,
        "- **local**: L learners per node behind one rank; the node pushes the sum of its learners' gradients once \
         and publishes the parameters to them (`tidewire sim --local-learners L`).\n\
         - **flat**: every learner is a rank, and the node's L ranks share its NIC (`--flat`).\n\
         - The iteration splits into compute (with the sync hidden behind it) and the exposed sync (time the \
         learners waited for the network). Local aggregation and fan-out run beside the compute; their busy time is listed apart.\n"
    );
    let _ = writeln!(s, "![nexus-local](nexus-local.png)\n");
    let _ = writeln!(
        s,
        "| model | GbE | L | flat iteration s (exposed) | local iteration s (exposed) | local agg s | fan-out s | speedup over flat | node NIC MB/iter flat → local |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.3} ({:.3}) | {:.3} ({:.3}) | {:.3} | {:.3} | **{:.2}×** | {:.0} → {:.0} ({:.2}×) |",
            r.model,
            r.bandwidth_gbps,
            r.learners,
            r.flat.iteration_s,
            r.flat.exposed_wait_s,
            r.local.iteration_s,
            r.local.exposed_wait_s,
            r.local.local_agg_s,
            r.local.fanout_s,
            r.speedup_over_flat,
            r.flat.node_tx_mb_per_iter + r.flat.node_rx_mb_per_iter,
            r.local.node_tx_mb_per_iter + r.local.node_rx_mb_per_iter,
            r.nic_bytes_ratio_flat_over_local,
        );
    }
    s
}

fn main() {
    let cli = Cli::parse();
    let t0 = Instant::now();
    let mut rows = Vec::new();
    for m in MODELS {
        for bw in BW {
            for l in LEARNERS {
                match run(&cli, m, bw, l) {
                    Ok(r) => {
                        eprintln!(
                            "{m} {bw} GbE L={l}: local {:.3} s, flat {:.3} s per iteration: {:.2}x",
                            r.local.iteration_s, r.flat.iteration_s, r.speedup_over_flat
                        );
                        rows.push(r);
                    }
                    Err(e) => {
                        eprintln!("tidewire-nexus: {e}");
                        std::process::exit(1);
                    }
                }
            }
        }
    }
    let w = |name: &str, body: String| {
        let p = cli.out.join(name);
        if let Err(e) = std::fs::write(&p, body) {
            eprintln!("tidewire-nexus: {}: {e}", p.display());
            std::process::exit(1);
        }
    };
    if let Err(e) = std::fs::create_dir_all(&cli.out) {
        eprintln!("tidewire-nexus: {}: {e}", cli.out.display());
        std::process::exit(1);
    }
    w(
        "nexus-local.json",
        serde_json::to_string_pretty(&rows).expect("serializable") + "\n",
    );
    w("nexus-local.md", markdown(&rows, &cli));
    if let Err(e) = plot(&rows, &cli, &cli.out.join("nexus-local.png")) {
        eprintln!("tidewire-nexus: plot: {e}");
        std::process::exit(1);
    }
    eprintln!("wrote {} in {:.1} s", cli.out.display(), t0.elapsed().as_secs_f64());
}
