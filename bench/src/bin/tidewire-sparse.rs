//! `tidewire-sparse`: Nexus's Fig. 8, push time of a sparse layer against its
//! density and the link's bandwidth, dense against sparse against the
//! automatic choice.
//!
//! What is measured and what is modelled:
//! - measured on this machine (median of `--reps`): per slice, the worker's
//!   encode (`tidewire_gpu::cpu::sparse_encode`, whole and stopped at the cap
//!   the automatic choice sets), the server's densify
//!   (`sparse_densify`) and the dense path's copy of a landing slot; and the
//!   start-up calibration the runtime runs (`calibrate_sparse`), which sets the
//!   threshold;
//! - modelled: the wire, `bytes / bandwidth` at line rate (1, 10, 40 GbE), with
//!   no per-message cost (both forms make one write per slice) and no overlap
//!   of one slice's encode with another's transfer (a push is the sum over its
//!   slices; the runtime does overlap them, which only helps sparse).
//!
//! Auto runs the engine's own policy (`SparsePolicy`, with its re-tries of
//! slices found dense) over `--iters` pushes and reports the mean per push. A
//! try that stays under its cap does the forced sparse path's work and is
//! charged that path's measurement; a try stopped at its cap is measured as it
//! runs (the scan it wasted is part of auto's cost).
//!
//! ```text
//! cargo run --release -p tidewire-bench --bin tidewire-sparse -- --out bench/results
//! ```
//!
//! Writes `sparse-push.json`, `sparse-push.md` and `sparse-push.png` under
//! `--out`; `--check` exits 1 when auto is more than 5% slower than the better
//! of dense and sparse at some point.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use plotters::prelude::*;
use serde::Serialize;
use tidewire::engine::sparse::{encoded_bytes, pair_limit, Choice, SparseCosts, SparsePolicy};
use tidewire::engine::testkit::Rng;
use tidewire::gpu::cpu;

#[derive(Parser, Debug)]
#[command(name = "tidewire-sparse", about = "Sparse against dense push time (Nexus Fig. 8)")]
struct Cli {
    /// Elements of the sparse layer (an embedding table of rows × `--row`).
    #[arg(long, default_value_t = 4 << 20)]
    elems: usize,
    /// Elements per row: the gradient's nonzeros come in whole rows, as an embedding's do.
    #[arg(long, default_value_t = 64)]
    row: usize,
    /// Elements per slice (the book's `slice_params`).
    #[arg(long, default_value_t = 50_000)]
    slice: usize,
    /// Repetitions of each CPU measurement (the median is used).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Pushes the automatic choice makes per point (its re-tries included).
    #[arg(long, default_value_t = 2 * SparsePolicy::REPROBE as u64)]
    iters: u64,
    /// Threads for the kernels (default: the runtime's, the machine's up to 8).
    #[arg(long)]
    threads: Option<usize>,
    /// Where the JSON, Markdown and PNG go.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// A TTF font for the plot.
    #[arg(long, default_value = tidewire_bench::DEFAULT_FONT)]
    font: PathBuf,
    /// Exit 1 when auto is more than 5% slower than the better form somewhere.
    #[arg(long)]
    check: bool,
}

const DENSITIES: [f64; 4] = [0.001, 0.01, 0.1, 0.5];
const GBE: [f64; 3] = [1.0, 10.0, 40.0];

#[derive(Debug, Serialize)]
struct Point {
    density: f64,
    gbe: f64,
    /// Nonzeros over elements of the generated gradient.
    measured_density: f64,
    dense_ms: f64,
    sparse_ms: f64,
    auto_ms: f64,
    /// auto / min(dense, sparse).
    auto_over_best: f64,
    /// Slices pushed sparse by auto, over all its pushes.
    auto_sparse_fraction: f64,
    /// The calibrated threshold density for a slice at this bandwidth.
    threshold: f64,
    /// Slices over the slot's pair limit (forced sparse sends them dense).
    over_limit_slices: usize,
}

#[derive(Debug, Serialize)]
struct Scaling {
    elems: usize,
    threads: usize,
    encode_ns_per_elem: f64,
    densify_ns_per_elem: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    machine_threads: usize,
    threads: usize,
    elems: usize,
    row: usize,
    slice: usize,
    reps: usize,
    iters: u64,
    calibration: Calibration,
    par_min: usize,
    scaling: Vec<Scaling>,
    points: Vec<Point>,
    auto_within_5_percent: bool,
}

#[derive(Debug, Serialize)]
struct Calibration {
    encode_ns_per_elem: f64,
    encode_ns_per_pair: f64,
    densify_ns_per_elem: f64,
    densify_ns_per_pair: f64,
    copy_ns_per_elem: f64,
}

fn median_ns(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    tidewire_bench::median(&v)
}

/// A gradient with a `density` fraction of its rows nonzero.
fn gradient(elems: usize, row: usize, density: f64, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    let mut g = vec![0f32; elems];
    for r in g.chunks_mut(row) {
        if rng.unit() < density {
            for x in r.iter_mut() {
                *x = (rng.below(20_000) as f32 - 9_999.5) / 1e4;
            }
        }
    }
    g
}

fn words_of(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

struct SliceCosts {
    len: usize,
    pairs: usize,
    encode_ns: f64,
    densify_ns: f64,
    copy_ns: f64,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("tidewire-sparse: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let cli = Cli::parse();
    let machine = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cli.threads.unwrap_or(machine.min(8));
    let slice_lens = slice_lens(cli.elems, cli.slice);

    // The runtime's start-up measurement, which sets the threshold.
    let cal = cpu::calibrate_sparse(cli.slice, threads, 1.25e9);
    eprintln!(
        "calibration: encode {:.3} ns/elem + {:.3} ns/pair, densify {:.3} ns/elem + {:.3} ns/pair, copy {:.3} ns/elem ({threads} threads)",
        cal.encode_ns_per_elem, cal.encode_ns_per_pair, cal.densify_ns_per_elem, cal.densify_ns_per_pair, cal.copy_ns_per_elem
    );
    let scaling = thread_scaling(&cli, machine)?;

    let mut points = Vec::new();
    for (di, &density) in DENSITIES.iter().enumerate() {
        let mut layer = Layer::measure(&cli, density, 1000 + di as u64, threads, &slice_lens);
        for &gbe in &GBE {
            points.push(layer.point(gbe, &cal));
        }
    }
    let ok = points.iter().all(|p| p.auto_over_best <= 1.05);
    let report = Report {
        machine_threads: machine,
        threads,
        elems: cli.elems,
        row: cli.row,
        slice: cli.slice,
        reps: cli.reps,
        iters: cli.iters,
        calibration: Calibration {
            encode_ns_per_elem: cal.encode_ns_per_elem,
            encode_ns_per_pair: cal.encode_ns_per_pair,
            densify_ns_per_elem: cal.densify_ns_per_elem,
            densify_ns_per_pair: cal.densify_ns_per_pair,
            copy_ns_per_elem: cal.copy_ns_per_elem,
        },
        par_min: cpu::SPARSE_PAR_MIN,
        scaling,
        points,
        auto_within_5_percent: ok,
    };
    write_outputs(&cli, &report)?;
    if cli.check && !ok {
        eprintln!("auto is more than 5% slower than the better form at some point");
        std::process::exit(1);
    }
    Ok(())
}

/// The lengths of the slices of `elems` elements, `slice` each but the last.
fn slice_lens(elems: usize, slice: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut at = 0;
    while at < elems {
        let n = slice.min(elems - at);
        v.push(n);
        at += n;
    }
    v
}

/// Where threads start to pay: one buffer at 1%, encoded and densified on 1..8 threads.
fn thread_scaling(cli: &Cli, machine: usize) -> Result<Vec<Scaling>, String> {
    let mut scaling = Vec::new();
    for &n in &[50_000usize, 262_144, 1 << 20, 4 << 20] {
        let g = gradient(n, cli.row, 0.01, 7);
        let mut enc = vec![0u8; n * 4];
        let pairs = cpu::sparse_encode_on(&g, usize::MAX, &mut enc, 1).ok_or("over the limit at 1%")?;
        let words = words_of(&enc[..encoded_bytes(pairs)]);
        let mut out = vec![0f32; n];
        for t in [1usize, 2, 4, 8] {
            if t > machine.max(2) {
                continue;
            }
            let e = median_ns(cli.reps, || {
                std::hint::black_box(cpu::sparse_encode_on(&g, usize::MAX, &mut enc, t));
            });
            let d = median_ns(cli.reps, || {
                let _ = std::hint::black_box(cpu::sparse_densify_on(&words, pairs, &mut out, t));
            });
            eprintln!(
                "scaling: {n} elements, {t} threads: encode {:.3} ns/elem, densify {:.3}",
                e / n as f64,
                d / n as f64
            );
            scaling.push(Scaling {
                elems: n,
                threads: t,
                encode_ns_per_elem: e / n as f64,
                densify_ns_per_elem: d / n as f64,
            });
        }
    }
    Ok(scaling)
}

/// Nanoseconds `bytes` take on the wire at line rate (`bps`, bytes per second).
fn wire_ns(bytes: usize, bps: f64) -> f64 {
    bytes as f64 * 1e9 / bps
}

/// A slice pushed dense: the wire, and the server's copy of the landing slot.
fn dense_ns(s: &SliceCosts, bps: f64) -> f64 {
    wire_ns(s.len * 4, bps) + s.copy_ns
}

/// The sparse layer at one density: its gradient and each slice's measured costs.
struct Layer<'a> {
    cli: &'a Cli,
    density: f64,
    g: Vec<f32>,
    nnz: usize,
    threads: usize,
    slices: Vec<SliceCosts>,
    /// Encodes stopped at a cap, measured once: (slice, cap) → (ns, pairs).
    capped: HashMap<(usize, usize), (f64, Option<usize>)>,
    /// The encoder's output.
    enc: Vec<u8>,
}

impl<'a> Layer<'a> {
    /// Per slice: the full encode, the densify, the dense copy (medians).
    fn measure(cli: &'a Cli, density: f64, seed: u64, threads: usize, slice_lens: &[usize]) -> Self {
        let g = gradient(cli.elems, cli.row, density, seed);
        let nnz = g.iter().filter(|v| v.to_bits() != 0).count();
        let mut slices = Vec::new();
        let mut at = 0;
        let mut enc = vec![0u8; cli.slice * 4];
        let mut out = vec![0f32; cli.slice];
        for &len in slice_lens {
            let src = &g[at..at + len];
            at += len;
            let enc = &mut enc[..len * 4];
            let out = &mut out[..len];
            let full = cpu::sparse_encode(src, usize::MAX, enc, threads);
            let pairs = full.unwrap_or(usize::MAX);
            let encode_ns = median_ns(cli.reps, || {
                std::hint::black_box(cpu::sparse_encode(src, usize::MAX, enc, threads));
            });
            let densify_ns = match full {
                Some(p) => {
                    let words = words_of(&enc[..encoded_bytes(p)]);
                    median_ns(cli.reps, || {
                        let _ = std::hint::black_box(cpu::sparse_densify(&words, p, out, threads));
                    })
                }
                None => 0.0,
            };
            let copy_ns = median_ns(cli.reps, || {
                out.copy_from_slice(std::hint::black_box(src));
                std::hint::black_box(&mut *out);
            });
            slices.push(SliceCosts {
                len,
                pairs,
                encode_ns,
                densify_ns,
                copy_ns,
            });
        }
        Layer {
            cli,
            density,
            g,
            nnz,
            threads,
            slices,
            capped: HashMap::new(),
            enc,
        }
    }

    /// A push at `gbe`: dense, forced sparse (dense over the pair limit), and auto.
    fn point(&mut self, gbe: f64, cal: &SparseCosts) -> Point {
        let cli = self.cli;
        let bps = gbe * 1e9 / 8.0;
        let dense: f64 = self.slices.iter().map(|s| dense_ns(s, bps)).sum();
        let mut over = 0;
        let sparse: f64 = self
            .slices
            .iter()
            .map(|s| {
                if s.pairs <= pair_limit(s.len) {
                    s.encode_ns + wire_ns(encoded_bytes(s.pairs), bps) + s.densify_ns
                } else {
                    over += 1;
                    s.encode_ns + dense_ns(s, bps)
                }
            })
            .sum();
        // Auto: the engine's policy with the calibrated costs at this bandwidth.
        let costs = SparseCosts {
            link_bytes_per_s: bps,
            ..*cal
        };
        let (auto_total, auto_sparse, auto_pushes) = self.auto(&costs);
        let auto = auto_total / cli.iters.max(1) as f64;
        let best = dense.min(sparse);
        let p = Point {
            density: self.density,
            gbe,
            measured_density: self.nnz as f64 / cli.elems as f64,
            dense_ms: dense / 1e6,
            sparse_ms: sparse / 1e6,
            auto_ms: auto / 1e6,
            auto_over_best: auto / best,
            auto_sparse_fraction: auto_sparse as f64 / auto_pushes.max(1) as f64,
            threshold: costs.threshold(cli.slice),
            over_limit_slices: over,
        };
        eprintln!(
            "density {:>5.1}% {:>2} GbE: dense {:8.3} ms, sparse {:8.3} ms, auto {:8.3} ms ({:.3} of the better; {:.0}% sparse; threshold {:.2}%)",
            self.density * 100.0,
            gbe,
            p.dense_ms,
            p.sparse_ms,
            p.auto_ms,
            p.auto_over_best,
            p.auto_sparse_fraction * 100.0,
            p.threshold * 100.0
        );
        p
    }

    /// The engine's policy over `--iters` pushes at `costs`: the total time,
    /// the slices it sent sparse, and the slices pushed.
    fn auto(&mut self, costs: &SparseCosts) -> (f64, u64, u64) {
        let (cli, threads, bps) = (self.cli, self.threads, costs.link_bytes_per_s);
        let mut policy = SparsePolicy::from_slices(self.slices.len());
        let (mut auto_total, mut auto_sparse, mut auto_pushes) = (0.0, 0u64, 0u64);
        for _ in 0..cli.iters {
            let mut at = 0;
            for (i, s) in self.slices.iter().enumerate() {
                let src = &self.g[at..at + s.len];
                at += s.len;
                auto_pushes += 1;
                match policy.choose(costs, i as u32, s.len) {
                    Choice::Dense => auto_total += dense_ns(s, bps),
                    Choice::Try { cap } => {
                        // A try that stays under its cap does the whole encode's
                        // work: its time is the forced sparse path's measurement.
                        // One that stops early is measured as it runs.
                        let (t, got) = if s.pairs <= cap.min(pair_limit(s.len)) {
                            (s.encode_ns, Some(s.pairs))
                        } else {
                            *self.capped.entry((i, cap)).or_insert_with(|| {
                                let e = &mut self.enc[..s.len * 4];
                                let got = cpu::sparse_encode(src, cap, e, threads);
                                let t = median_ns(cli.reps, || {
                                    std::hint::black_box(cpu::sparse_encode(src, cap, e, threads));
                                });
                                (t, got)
                            })
                        };
                        policy.report(i as u32, got.map(|n| n as u32));
                        auto_total += t + match got {
                            Some(n) => {
                                auto_sparse += 1;
                                wire_ns(encoded_bytes(n), bps) + s.densify_ns
                            }
                            None => dense_ns(s, bps),
                        };
                    }
                }
            }
        }
        (auto_total, auto_sparse, auto_pushes)
    }
}

/// Writes `sparse-push.json`, `.md` and `.png` under `--out`.
fn write_outputs(cli: &Cli, report: &Report) -> Result<(), String> {
    std::fs::create_dir_all(&cli.out).map_err(|e| format!("{}: {e}", cli.out.display()))?;
    let json = cli.out.join("sparse-push.json");
    std::fs::write(
        &json,
        serde_json::to_string_pretty(report).map_err(|e| e.to_string())? + "\n",
    )
    .map_err(|e| format!("{}: {e}", json.display()))?;
    let md = cli.out.join("sparse-push.md");
    std::fs::write(&md, markdown(report)).map_err(|e| format!("{}: {e}", md.display()))?;
    tidewire_bench::register_font(&cli.font).map_err(|e| e.to_string())?;
    let png = cli.out.join("sparse-push.png");
    plot(report, &png)?;
    eprintln!("wrote {}, {}, {}", json.display(), md.display(), png.display());
    Ok(())
}

fn markdown(r: &Report) -> String {
    let mut s = String::new();
    s.push_str(
        "| density | GbE | dense ms | sparse ms | auto ms | auto / better | auto sparse | threshold |\n|---|---|---|---|---|---|---|---|\n",
    );
    for p in &r.points {
        s.push_str(&format!(
            "| {:.1}% | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0}% | {:.2}% |\n",
            p.density * 100.0,
            p.gbe,
            p.dense_ms,
            p.sparse_ms,
            p.auto_ms,
            p.auto_over_best,
            p.auto_sparse_fraction * 100.0,
            p.threshold * 100.0
        ));
    }
    s.push_str(&format!(
        "\nA layer of {} elements ({}-element rows), {}-element slices, {} kernel threads on a machine with {}; \
         CPU parts measured (median of {}), wire modelled at line rate. Auto within 5% of the better form everywhere: {}.\n",
        r.elems, r.row, r.slice, r.threads, r.machine_threads, r.reps, r.auto_within_5_percent
    ));
    s.push_str("\nThread scaling (ns per element, 1% density):\n\n| elements | threads | encode | densify |\n|---|---|---|---|\n");
    for x in &r.scaling {
        s.push_str(&format!(
            "| {} | {} | {:.3} | {:.3} |\n",
            x.elems, x.threads, x.encode_ns_per_elem, x.densify_ns_per_elem
        ));
    }
    s
}

fn plot(r: &Report, path: &std::path::Path) -> Result<(), String> {
    let root = BitMapBackend::new(path, (1500, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let colors = [RGBColor(200, 60, 40), RGBColor(40, 110, 200), RGBColor(30, 150, 70)];
    for (area, &gbe) in root.split_evenly((1, 3)).iter().zip(GBE.iter()) {
        let pts: Vec<&Point> = r.points.iter().filter(|p| p.gbe == gbe).collect();
        let ymax = pts
            .iter()
            .map(|p| p.dense_ms.max(p.sparse_ms).max(p.auto_ms))
            .fold(0.0, f64::max);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{gbe} GbE"), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((0.0005f64..0.8f64).log_scale(), 0f64..ymax * 1.15)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("density (log)")
            .y_desc("push time per layer (ms)")
            .x_label_formatter(&|x| format!("{}%", x * 100.0))
            .draw()
            .map_err(|e| e.to_string())?;
        type Pick = fn(&Point) -> f64;
        let series: [(&str, Pick); 3] = [
            ("dense", |p| p.dense_ms),
            ("sparse", |p| p.sparse_ms),
            ("auto", |p| p.auto_ms),
        ];
        for (k, (name, f)) in series.iter().enumerate() {
            let c = colors[k];
            let v: Vec<(f64, f64)> = pts.iter().map(|p| (p.density, f(p))).collect();
            let width = if k == 2 { 1 } else { 2 };
            chart
                .draw_series(LineSeries::new(v.clone(), c.stroke_width(width)))
                .map_err(|e| e.to_string())?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
            chart
                .draw_series(
                    v.iter()
                        .map(|&p| Circle::new(p, if k == 2 { 3 } else { 4 }, c.filled())),
                )
                .map_err(|e| e.to_string())?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}
