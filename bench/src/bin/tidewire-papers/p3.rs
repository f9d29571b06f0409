use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;
use tidewire_cli::sim::{self, SimArgs, SimResult};

use crate::*;

/// P3's four models (its bandwidth figure and the KVStore comparison).
pub(crate) const P3_MODELS: [&str; 4] = ["resnet-50", "vgg19", "inception-v3", "sockeye"];
/// P3's hardware: every P3 figure runs `--gpu p4000` (engine/src/models.rs).
pub(crate) const P3_GPU: &str = "p4000";
pub(crate) const P3_BW: [f64; 12] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 30.0];
/// P3's bandwidth figure: MXNet's KVStore (P3's baseline), WFBP (layer-wise,
/// as produced, over Tidewire's chunked PS), slicing only, P3; all in
/// Tidewire's default rank-order summation, and P3 with `--fast` beside them
/// (figure `p3-bandwidth-fast`).
pub(crate) const P3_MODES: [(&str, &str); 4] = [
    ("kvstore", "KVStore"),
    ("wfbp", "WFBP"),
    ("sliced", "slicing only"),
    ("p3", "P3"),
];
/// P3's ablation against its own baseline: KVStore, slicing alone, P3.
pub(crate) const KV_MODES: [(&str, &str); 3] = [("kvstore", "KVStore"), ("sliced", "slicing only"), ("p3", "P3")];
/// The `tidewire train` runs under the harness.
pub(crate) const TRAIN_MODES: [&str; 3] = ["wfbp", "sliced", "p3"];
/// The baseline and P3, for P3's Figs. 8-12.
pub(crate) const P3_PAIR: [(&str, &str); 2] = [("wfbp", "baseline"), ("p3", "P3")];
/// P3's Fig. 10 (scalability): its models, where `tidewire sim` has a profile
/// (the rest are skipped, and EVAL.md says so).
pub(crate) const P3_SCALE_MODELS: [&str; 4] = ["resnet-50", "vgg19", "inception-v3", "sockeye"];
pub(crate) const P3_SCALE_NODES: [usize; 4] = [2, 4, 8, 16];
/// The bandwidth of P3's Figs. 8-12 is not in a source we could reach; we use
/// 10 Gbit/s (and, for Figs. 8, 9 and 12, each model's best bandwidth for P3
/// in the P3 bandwidth figure too).
pub(crate) const P3_FIG_BW: f64 = 10.0;
/// P3's Fig. 12 (slice size): models and slice sizes (parameters). Slices
/// never cross a 2 MiB chunk (524,288 parameters), so larger ones act as that.
pub(crate) const SLICE_MODELS: [&str; 2] = ["vgg19", "resnet-50"];
pub(crate) const SLICE_SIZES: [usize; 7] = [5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000];
/// P3's default slice size.
pub(crate) const P3_SLICE: usize = 50_000;
/// P3's Figs. 8 and 9 (link utilization over time): models, bin, iterations
/// simulated (the window is the baseline's iterations 1 and 2: it must end
/// before the faster P3 run does).
pub(crate) const UTIL_MODELS: [&str; 2] = ["vgg19", "resnet-50"];
pub(crate) const UTIL_BIN_US: f64 = 1000.0;
pub(crate) const UTIL_ITERS: u64 = 6;
/// A bin below this fraction of the link is idle.
pub(crate) const IDLE: f64 = 0.1;
/// A point of P3's figures: P3's GPU (`--gpu p4000`) and Tidewire's default
/// rank-order summation (`fast` off), which no longer costs P3 throughput.
pub(crate) fn p3_args(model: &str, nodes: usize, gbps: f64, sync: &str, iters: u64) -> SimArgs {
    let mut a = sim_args(model, nodes, gbps, sync, iters);
    a.gpu = tidewire::engine::models::Calibration::parse(P3_GPU).expect("a known GPU");
    a.job.fast = false;
    a
}

/// P3's bandwidth figure: `sync`'s throughput on 4 nodes at `bw` Gbit/s.
pub(crate) fn p3_tp(pts: &[Point], model: &str, bw: f64, sync: &str) -> f64 {
    find(pts, "p3-bandwidth", model, 4, bw, sync).throughput_samples_s
}

/// `sync`'s gain over `base` in P3's bandwidth figure, at `bw` Gbit/s.
pub(crate) fn gain_over(pts: &[Point], model: &str, bw: f64, sync: &str, base: &str) -> f64 {
    p3_tp(pts, model, bw, sync) / p3_tp(pts, model, bw, base) - 1.0
}

/// P3's throughput gain over WFBP on 4 nodes at `bw` Gbit/s.
pub(crate) fn p3_gain(pts: &[Point], model: &str, bw: f64) -> f64 {
    gain_over(pts, model, bw, "p3", "wfbp")
}

/// The best gain of `sync` over `base`, and the bandwidth where it is (the lowest on a tie).
pub(crate) fn best_over(pts: &[Point], model: &str, sync: &str, base: &str) -> (f64, f64) {
    P3_BW
        .iter()
        .map(|&bw| (gain_over(pts, model, bw, sync, base), bw))
        .fold((f64::NEG_INFINITY, 0.0), |a, b| if b.0 > a.0 { b } else { a })
}

/// P3's best gain over WFBP, and the bandwidth where it is.
pub(crate) fn p3_best(pts: &[Point], model: &str) -> (f64, f64) {
    best_over(pts, model, "p3", "wfbp")
}

/// Deterministic (rank-order) P3 over `--fast` (arrival-order) P3 at `bw` Gbit/s.
pub(crate) fn det_over_fast(pts: &[Point], model: &str, bw: f64) -> f64 {
    p3_tp(pts, model, bw, "p3") / find(pts, "p3-bandwidth-fast", model, 4, bw, "p3").throughput_samples_s
}

/// The least of `f` over P3's bandwidth figure's points, and where.
pub(crate) fn least(f: impl Fn(&str, f64) -> f64) -> (f64, String) {
    let mut w = (f64::INFINITY, String::new());
    for m in P3_MODELS {
        for bw in P3_BW {
            let v = f(m, bw);
            if v < w.0 {
                w = (v, format!("{m} at {bw} Gbit/s"));
            }
        }
    }
    w
}

/// P3's throughput over the baseline's (`wfbp`), less 1, for `m` on `n`
/// machines of the scalability figure.
pub(crate) fn p3_scale_gain(pts: &[Point], m: &str, n: usize) -> f64 {
    find(pts, "p3-scaling", m, n, P3_FIG_BW, "p3").throughput_samples_s
        / find(pts, "p3-scaling", m, n, P3_FIG_BW, "wfbp").throughput_samples_s
        - 1.0
}

/// The models of P3's Fig. 10 that `tidewire sim` has a profile for, and those it skips.
pub(crate) fn p3_scale_models() -> (Vec<&'static str>, Vec<&'static str>) {
    P3_SCALE_MODELS.iter().partition(|m| sim::known_model(m))
}

/// The bandwidths of P3's Figs. 8, 9 and 12 for `model`: [`P3_FIG_BW`] and
/// the model's best bandwidth for P3 in the P3 figure (once if they are the same).
pub(crate) fn p3_fig_bws(pts: &[Point], model: &str) -> Vec<f64> {
    let best = p3_best(pts, model).1;
    if (best - P3_FIG_BW).abs() < 1e-9 {
        vec![P3_FIG_BW]
    } else {
        vec![P3_FIG_BW, best]
    }
}

/// Link utilization of node 0's NIC (worker 0 and server 0), from a traced
/// run (P3's Figs. 8 and 9).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Util {
    pub(crate) model: String,
    pub(crate) bandwidth_gbps: f64,
    pub(crate) sync: String,
    pub(crate) iteration_s: f64,
    /// Where `mean` and `idle` are measured, s from the start of iteration
    /// 0: this run's own iterations after the first, to its end.
    pub(crate) stats_s: [f64; 2],
    /// Mean utilization there, [out, in] (fraction of the link).
    pub(crate) mean: [f64; 2],
    /// Fraction of the bins there below [`IDLE`], [out, in].
    pub(crate) idle: [f64; 2],
    /// The plotted window, s from the start of iteration 0: the baseline's
    /// iterations 1 and 2, the same for both modes.
    pub(crate) window_s: [f64; 2],
    /// Per bin of the window: (s into it, utilization), [out, in].
    #[serde(skip)]
    pub(crate) series: [Vec<(f64, f64)>; 2],
}

/// The utilization of traced runs.
pub(crate) fn utilization(traced: &[(Point, SimResult)]) -> Result<Vec<Util>, String> {
    let mut out = Vec::new();
    for (p, r) in traced {
        let base = traced
            .iter()
            .find(|(q, _)| q.model == p.model && q.bandwidth_gbps == p.bandwidth_gbps && q.sync == "wfbp")
            .ok_or("a traced run without its baseline")?;
        let bin = r.trace_bin_us.ok_or("an untraced run")? / 1e6;
        let cap = p.bandwidth_gbps * 1e9 / 8.0 * bin;
        let nic = r.nic_trace.first().ok_or("no trace")?;
        let end = r.start_s + r.iteration_s * r.iters as f64;
        // Bins [a, b) from t0 to t1 (s from the start of iteration 0).
        let bins = |t0: f64, t1: f64| -> Result<(usize, usize), String> {
            let (a, b) = (
                ((r.start_s + t0) / bin).ceil() as usize,
                ((r.start_s + t1) / bin).floor() as usize,
            );
            if b <= a || b as f64 * bin > end + 1e-9 {
                return Err(format!(
                    "{} {} at {} Gbit/s: the bins {a}..{b} are not inside the run",
                    p.model, p.sync, p.bandwidth_gbps
                ));
            }
            Ok((a, b))
        };
        let u = |d: usize, i: usize| nic[d].get(i).copied().unwrap_or(0) as f64 / cap;
        let (a, b) = bins(r.iteration_s, r.iteration_s * r.iters as f64)?;
        let (mut mean, mut idle) = ([0.0; 2], [0.0; 2]);
        for d in 0..2 {
            mean[d] = (a..b).map(|i| u(d, i)).sum::<f64>() / (b - a) as f64;
            idle[d] = (a..b).filter(|&i| u(d, i) < IDLE).count() as f64 / (b - a) as f64;
        }
        let it = base.1.iteration_s;
        let (wa, wb) = bins(it, 3.0 * it)?;
        let series = [0, 1].map(|d| (wa..wb).map(|i| ((i - wa) as f64 * bin, u(d, i))).collect());
        let secs = |i: usize| i as f64 * bin - r.start_s;
        out.push(Util {
            model: p.model.clone(),
            bandwidth_gbps: p.bandwidth_gbps,
            sync: p.sync.clone(),
            iteration_s: p.iteration_s,
            stats_s: [secs(a), secs(b)],
            mean,
            idle,
            window_s: [secs(wa), secs(wb)],
            series,
        });
    }
    Ok(out)
}

pub(crate) fn util_of<'a>(u: &'a [Util], model: &str, bw: f64, sync: &str) -> &'a Util {
    u.iter()
        .find(|x| x.model == model && (x.bandwidth_gbps - bw).abs() < 1e-9 && x.sync == sync)
        .expect("every utilization point was traced")
}

pub(crate) fn plot_p3(pts: &[Point], train: &[TrainPoint], path: &Path) -> Result<(), String> {
    let root = BitMapBackend::new(path, (1800, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    for (area, model) in root.split_evenly((1, P3_MODELS.len())).iter().zip(P3_MODELS) {
        let mut lines: Vec<Series> = P3_MODES[1..]
            .iter()
            .map(|(sync, label)| {
                let v = P3_BW.iter().map(|&bw| (bw, p3_tp(pts, model, bw, sync))).collect();
                (format!("{label} (sim)"), v)
            })
            .collect();
        lines.push((
            "P3 --fast (sim)".into(),
            P3_BW
                .iter()
                .map(|&bw| {
                    let p = find(pts, "p3-bandwidth-fast", model, 4, bw, "p3");
                    (bw, p.throughput_samples_s)
                })
                .collect(),
        ));
        let dots: Vec<Series> = P3_MODES[1..]
            .iter()
            .map(|(sync, label)| {
                let v = train
                    .iter()
                    .filter(|t| t.model == model && t.sync == *sync)
                    .map(|t| (t.shaped_gbps * f64::from(t.dilation), t.train_throughput_samples_s))
                    .collect();
                (format!("{label} (train)"), v)
            })
            .filter(|s: &Series| !s.1.is_empty())
            .collect();
        panel(
            area,
            &format!("{model}, 4 nodes, P4000"),
            "bandwidth (Gbit/s)",
            "samples/s",
            &lines,
            &dots,
            None,
        )?;
    }
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}

/// P3 against MXNet's KVStore: KVStore, slicing alone and P3 against bandwidth.
pub(crate) fn plot_kvstore(pts: &[Point], path: &Path) -> Result<(), String> {
    let root = BitMapBackend::new(path, (1800, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    for (area, model) in root.split_evenly((1, P3_MODELS.len())).iter().zip(P3_MODELS) {
        let lines: Vec<Series> = KV_MODES
            .iter()
            .map(|(sync, label)| {
                let v = P3_BW.iter().map(|&bw| (bw, p3_tp(pts, model, bw, sync))).collect();
                (label.to_string(), v)
            })
            .collect();
        panel(
            area,
            &format!("{model}, 4 nodes, P4000"),
            "bandwidth (Gbit/s)",
            "samples/s",
            &lines,
            &[],
            None,
        )?;
    }
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}

/// P3's Figs. 8 and 9: node 0's link out and in over the window, baseline and P3,
/// a row per (model, bandwidth).
pub(crate) fn plot_util(pts: &[Point], util: &[Util], path: &Path) -> Result<(), String> {
    let cases: Vec<(&str, f64)> = UTIL_MODELS
        .iter()
        .flat_map(|&m| p3_fig_bws(pts, m).into_iter().map(move |bw| (m, bw)))
        .collect();
    let root = BitMapBackend::new(path, (1500, 330 * cases.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((cases.len(), 2));
    for (k, &(m, bw)) in cases.iter().enumerate() {
        for (d, dir) in ["out (sent)", "in (received)"].iter().enumerate() {
            let lines: Vec<Series> = P3_PAIR
                .iter()
                .map(|(sync, label)| (label.to_string(), util_of(util, m, bw, sync).series[d].clone()))
                .collect();
            panel(
                &areas[2 * k + d],
                &format!("{m}, 4 nodes, {bw} Gbit/s: node 0 {dir}"),
                "s into the window (the baseline's iterations 1 and 2)",
                "fraction of the link",
                &lines,
                &[],
                None,
            )?;
        }
    }
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}

/// P3's Fig. 10: samples/s against machines at 10 Gbit/s.
pub(crate) fn plot_p3_scaling(pts: &[Point], path: &Path) -> Result<(), String> {
    let (models, _) = p3_scale_models();
    let root = BitMapBackend::new(path, (430 * models.len().max(1) as u32, 430)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    for (area, &model) in root.split_evenly((1, models.len().max(1))).iter().zip(&models) {
        let lines: Vec<Series> = P3_PAIR
            .iter()
            .map(|(sync, label)| {
                let v = P3_SCALE_NODES
                    .iter()
                    .map(|&n| {
                        (
                            n as f64,
                            find(pts, "p3-scaling", model, n, P3_FIG_BW, sync).throughput_samples_s,
                        )
                    })
                    .collect();
                (label.to_string(), v)
            })
            .collect();
        let p = find(pts, "p3-scaling", model, 2, P3_FIG_BW, "wfbp");
        let one = p.throughput_samples_s / p.speedup;
        panel(
            area,
            &format!("{model}, {P3_FIG_BW} Gbit/s"),
            "machines",
            "samples/s",
            &lines,
            &[],
            Some(vec![(0.0, 0.0), (16.0, 16.0 * one)]),
        )?;
    }
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}

/// P3's Fig. 12: samples/s against the slice size (log scale), with the baseline.
pub(crate) fn plot_slices(pts: &[Point], path: &Path) -> Result<(), String> {
    let cases: Vec<(&str, f64)> = SLICE_MODELS
        .iter()
        .flat_map(|&m| p3_fig_bws(pts, m).into_iter().map(move |bw| (m, bw)))
        .collect();
    let root = BitMapBackend::new(path, (450 * cases.len() as u32, 430)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    for (area, &(m, bw)) in root.split_evenly((1, cases.len())).iter().zip(&cases) {
        let at = |sync: &str, sp: usize| {
            find_by(pts, "p3-slices", |p| {
                p.model == m && (p.bandwidth_gbps - bw).abs() < 1e-9 && p.sync == sync && p.slice_params == sp
            })
            .throughput_samples_s
        };
        let x = |sp: usize| (sp as f64).log10();
        let lines: Vec<Series> = vec![
            (
                "P3".into(),
                SLICE_SIZES.iter().map(|&sp| (x(sp), at("p3", sp))).collect(),
            ),
            (
                "baseline (no slices)".into(),
                SLICE_SIZES.iter().map(|&sp| (x(sp), at("wfbp", P3_SLICE))).collect(),
            ),
        ];
        panel_in(
            area,
            &format!("{m}, 4 nodes, {bw} Gbit/s"),
            ("log10 slice size (parameters)", "samples/s"),
            &lines,
            &[],
            None,
            false,
        )?;
    }
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}

/// P3's best gain over KVStore in its abstract, per model (Inception-V3: none there).
pub(crate) fn paper_gain(model: &str) -> &'static str {
    match model {
        "resnet-50" => "+25% (abstract)",
        "sockeye" => "+38% (abstract)",
        "vgg19" => "+66% (abstract)",
        "inception-v3" => "+18% (§5.2)",
        _ => "",
    }
}

/// The section of P3 against MXNet's KVStore (its baseline).
pub(crate) fn kvstore_md(s: &mut String, pts: &[Point]) {
    let _ = writeln!(s, "\n## P3 against MXNet's KVStore (P3's baseline)\n");
    let _ = writeln!(
        s,
        "![p3-kvstore](p3-kvstore.png)\n\n\
         The runs of the bandwidth figure above (4 nodes, `--gpu p4000`, rank-order summation): \
         `kvstore` (P3's baseline), `sliced` (slicing alone: P3's ablation without priority) and `p3`. \
         Samples per second over the 4 workers.\n"
    );
    kvstore_table(s, pts);
    kvstore_peaks_md(s, pts);
    slicing_at_top_md(s, pts);
}

/// Each model's samples per second under each KVStore mode, and the gains
/// of slicing alone and of P3 over KVStore, per bandwidth.
fn kvstore_table(s: &mut String, pts: &[Point]) {
    let mut head = vec!["model".to_string(), "mode".to_string()];
    head.extend(P3_BW.iter().map(|bw| bw.to_string()));
    let mut rows = Vec::new();
    for m in P3_MODELS {
        for (sync, label) in KV_MODES {
            let mut r = vec![m.to_string(), format!("{label} (`{sync}`)")];
            r.extend(P3_BW.iter().map(|&bw| format!("{:.0}", p3_tp(pts, m, bw, sync))));
            rows.push(r);
        }
        for (sync, label) in [("sliced", "slicing alone over KVStore"), ("p3", "P3 over KVStore")] {
            let mut r = vec![m.to_string(), label.to_string()];
            r.extend(
                P3_BW
                    .iter()
                    .map(|&bw| format!("{:+.0}%", gain_over(pts, m, bw, sync, "kvstore") * 100.0)),
            );
            rows.push(r);
        }
    }
    table(s, &head, 2, &rows);
}

/// The peak gains over KVStore (and P3's over WFBP) beside the paper's.
fn kvstore_peaks_md(s: &mut String, pts: &[Point]) {
    let _ = writeln!(
        s,
        "\nPeak gains over 1-30 Gbit/s, beside the paper's. The paper's numbers are its best cases \
         \"on clusters with realistic network bandwidth\" (abstract); §5.2 places VGG-19's +66% at 15 Gbit/s \
         and gives ResNet-50 +26% at 4 Gbit/s and InceptionV3 +18% (the claims table below has each).\n"
    );
    let head: Vec<String> = [
        "model",
        "P3 over KVStore: peak (at)",
        "the paper",
        "slicing alone over KVStore: peak (at)",
        "P3 over WFBP: peak (at)",
    ]
    .map(String::from)
    .to_vec();
    let at = |(g, bw): (f64, f64)| format!("{:+.1}% ({bw} Gbit/s)", g * 100.0);
    let rows: Vec<Vec<String>> = P3_MODELS
        .iter()
        .map(|&m| {
            vec![
                m.to_string(),
                at(best_over(pts, m, "p3", "kvstore")),
                paper_gain(m).to_string(),
                at(best_over(pts, m, "sliced", "kvstore")),
                at(p3_best(pts, m)),
            ]
        })
        .collect();
    table(s, &head, 1, &rows);
}

/// Slicing alone on VGG-19 at the top bandwidth, and whether it is compute-bound there.
fn slicing_at_top_md(s: &mut String, pts: &[Point]) {
    let top = P3_BW[P3_BW.len() - 1];
    let sp = |sync: &str| find(pts, "p3-bandwidth", "vgg19", 4, top, sync).speedup;
    let _ = writeln!(
        s,
        "\nSlicing alone on VGG-19 at {top} Gbit/s: {:+.1}% over KVStore (P3 §5.2: \
         +49%). At {top} Gbit/s our 4 nodes run KVStore at {:.2}×, slicing alone \
         at {:.2}× and P3 at {:.2}× one node's throughput: {}.",
        gain_over(pts, "vgg19", top, "sliced", "kvstore") * 100.0,
        sp("kvstore"),
        sp("sliced"),
        sp("p3"),
        if ["kvstore", "sliced", "p3"].iter().all(|m| sp(m) >= 3.9) {
            "our 30 Gbit/s is compute-bound (every mode within 2.5% of 4×), so there is nothing left for \
             slicing to win there, and we cannot reproduce the paper's +49% at that bandwidth"
        } else {
            "not compute-bound: the network still limits it"
        }
    );
}

/// The sections of P3's Figs. 8, 9, 10 and 12.
pub(crate) fn p3_figures_md(s: &mut String, cli: &Cli, pts: &[Point], util: &[Util]) {
    p3_utilization_md(s, pts, util);
    p3_scaling_md(s, cli, pts);
    p3_slices_md(s, cli, pts);
}

/// Each model's bandwidths of P3's Figs. 8, 9 and 12, in words.
fn fig_bws_md(pts: &[Point], models: &[&str]) -> String {
    models
        .iter()
        .map(|&m| {
            let b: Vec<String> = p3_fig_bws(pts, m).iter().map(|b| b.to_string()).collect();
            format!("{m} at {} Gbit/s", b.join(" and "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `EVAL.md`'s section of P3's Figs. 8 and 9 (the link over time).
fn p3_utilization_md(s: &mut String, pts: &[Point], util: &[Util]) {
    let pct = |x: f64| format!("{:.0}%", x * 100.0);
    let bws = |models: &[&str]| fig_bws_md(pts, models);
    let _ = writeln!(s, "\n## P3: the worker's link over time (Figs. 8 and 9)\n");
    let _ = writeln!(
        s,
        "![p3-utilization](p3-utilization.png)\n\n\
         4 nodes, each a worker and a server, `--gpu p4000`, rank-order summation, {UTIL_ITERS} iterations with \
         `tidewire sim --trace-bin-us {UTIL_BIN_US}`: the bytes node 0's NIC (worker 0 and server 0) sent and \
         received in each {} ms bin, as a fraction of the link. The plot shows the baseline's iterations 1 \
         and 2 (from the start of iteration 0 plus one of its mean iterations, to plus three), the same span \
         of time for both modes, so P3 fits more of its own iterations into it. The table measures each run \
         over its own iterations after the first, to its end: *busy* is the mean fraction of the link used, \
         *idle* the share of bins under {}% of it. The bandwidth of the paper's figures is not in a source \
         we could reach: we use {P3_FIG_BW} Gbit/s, and each model's best bandwidth for P3 in the bandwidth \
         figure above ({}). The receive side is the simulator's fair share, which can run ahead of a slower \
         sender (`sim/src/net.rs`).\n",
        UTIL_BIN_US / 1000.0,
        IDLE * 100.0,
        bws(&UTIL_MODELS)
    );
    let mut rows = Vec::new();
    for m in UTIL_MODELS {
        for bw in p3_fig_bws(pts, m) {
            for (sync, label) in P3_PAIR {
                let u = util_of(util, m, bw, sync);
                rows.push(vec![
                    m.to_string(),
                    format!("{bw} Gbit/s"),
                    format!("{label} (`{sync}`)"),
                    format!("{:.3} s", u.iteration_s),
                    pct(u.mean[0]),
                    pct(u.idle[0]),
                    pct(u.mean[1]),
                    pct(u.idle[1]),
                ]);
            }
        }
    }
    let head: Vec<String> = [
        "model",
        "bandwidth",
        "mode",
        "iteration",
        "out: busy",
        "out: idle",
        "in: busy",
        "in: idle",
    ]
    .map(String::from)
    .to_vec();
    table(s, &head, 3, &rows);
}

/// `EVAL.md`'s section of P3's Fig. 10 (scalability).
fn p3_scaling_md(s: &mut String, cli: &Cli, pts: &[Point]) {
    let (models, skipped) = p3_scale_models();
    let _ = writeln!(s, "\n## P3: scalability at {P3_FIG_BW} Gbit/s (Fig. 10)\n");
    let _ = writeln!(
        s,
        "![p3-scaling](p3-scaling.png)\n\n\
         2 to 16 machines, each a worker and a server, {P3_FIG_BW} Gbit/s, `--gpu p4000`, rank-order summation, {} iterations. Samples per \
         second over all workers, with the speedup over one machine; the grey line in the plot is one machine's \
         throughput times the machines. The table adds MXNet's KVStore (`kvstore`), the baseline P3's figure \
         measured against (the plot shows the pair).\n",
        cli.iters
    );
    for m in &skipped {
        let _ = writeln!(
            s,
            "**Skipped: {m}.** `tidewire sim` has no profile for it in this build, so it is not in this figure.\n"
        );
    }
    let mut head = vec!["model".to_string(), "mode".to_string()];
    head.extend(P3_SCALE_NODES.iter().map(|n| format!("{n} machines")));
    let mut rows = Vec::new();
    for &m in &models {
        for (sync, label) in P3_PAIR {
            let mut r = vec![m.to_string(), format!("{label} (`{sync}`)")];
            for n in P3_SCALE_NODES {
                let p = find(pts, "p3-scaling", m, n, P3_FIG_BW, sync);
                r.push(format!("{:.0} ({:.1}×)", p.throughput_samples_s, p.speedup));
            }
            rows.push(r);
        }
        let mut r = vec![m.to_string(), "MXNet KVStore (`kvstore`)".to_string()];
        for n in P3_SCALE_NODES {
            let p = find(pts, "p3-scaling", m, n, P3_FIG_BW, "kvstore");
            r.push(format!("{:.0} ({:.1}×)", p.throughput_samples_s, p.speedup));
        }
        rows.push(r);
        for (base, label) in [("wfbp", "P3 over baseline"), ("kvstore", "P3 over KVStore")] {
            let mut r = vec![m.to_string(), label.to_string()];
            for n in P3_SCALE_NODES {
                let g = find(pts, "p3-scaling", m, n, P3_FIG_BW, "p3").throughput_samples_s
                    / find(pts, "p3-scaling", m, n, P3_FIG_BW, base).throughput_samples_s
                    - 1.0;
                r.push(format!("{:+.0}%", g * 100.0));
            }
            rows.push(r);
        }
    }
    table(s, &head, 2, &rows);
}

/// `EVAL.md`'s section of P3's Fig. 12 (slice size).
fn p3_slices_md(s: &mut String, cli: &Cli, pts: &[Point]) {
    let bws = |models: &[&str]| fig_bws_md(pts, models);
    let _ = writeln!(s, "\n## P3: slice size (Fig. 12)\n");
    let _ = writeln!(
        s,
        "![p3-slices](p3-slices.png)\n\n\
         4 nodes, `--gpu p4000`, rank-order summation, {} iterations per point (fewer than the other figures: the smallest slices are the \
         slowest runs to simulate), P3 with `tidewire sim --slice-params N`, beside the baseline, which has no \
         slices (one point per row); {}. Samples per second over the 4 workers. A slice never crosses a \
         2 MiB chunk (524,288 parameters), so the sweep stops at 500,000: a larger size is the chunk's. \
         A slice of 16,384 parameters (64 KiB) or more is its own chunk, smaller ones are grouped into chunks \
         of at least 64 KiB (the sliced modes' default: a server applies and broadcasts per slice), and the \
         simulator charges every message its latency and its bytes but no per-message CPU time: small slices \
         cost little or nothing here, and what the sweep shows is the cost of large ones (the priority order \
         gets coarser). With 2 MiB chunks (groups of slices), an earlier build showed an interior optimum \
         (ResNet-50 at 3 Gbit/s: 5,000 12.9% below the best, 25,000).\n",
        cli.sweep_iters,
        bws(&SLICE_MODELS)
    );
    let mut head = vec!["model".to_string(), "bandwidth".to_string(), "baseline".to_string()];
    head.extend(SLICE_SIZES.iter().map(|sp| sp.to_string()));
    head.push("best".into());
    let mut rows = Vec::new();
    for m in SLICE_MODELS {
        for bw in p3_fig_bws(pts, m) {
            let at = |sync: &str, sp: usize| {
                find_by(pts, "p3-slices", |p| {
                    p.model == m && (p.bandwidth_gbps - bw).abs() < 1e-9 && p.sync == sync && p.slice_params == sp
                })
                .throughput_samples_s
            };
            let mut r = vec![
                m.to_string(),
                format!("{bw} Gbit/s"),
                format!("{:.1}", at("wfbp", P3_SLICE)),
            ];
            r.extend(SLICE_SIZES.iter().map(|&sp| format!("{:.1}", at("p3", sp))));
            let best = SLICE_SIZES.iter().copied().fold((0, f64::NEG_INFINITY), |a, sp| {
                if at("p3", sp) > a.1 {
                    (sp, at("p3", sp))
                } else {
                    a
                }
            });
            let worst = SLICE_SIZES.iter().map(|&sp| at("p3", sp)).fold(f64::INFINITY, f64::min);
            r.push(if best.1 / worst - 1.0 < 0.001 {
                "none (flat within 0.1%)".to_string()
            } else {
                format!(
                    "{} ({:+.1}% over 50,000)",
                    best.0,
                    (best.1 / at("p3", P3_SLICE) - 1.0) * 100.0
                )
            });
            rows.push(r);
        }
    }
    table(s, &head, 2, &rows);
}

/// Phase 1's jobs of P3's bandwidth figure (and P3 `--fast` beside it).
pub(crate) fn p3_bandwidth_jobs(iters: u64) -> Vec<Job> {
    let mut jobs = Vec::new();
    for m in P3_MODELS {
        for bw in P3_BW {
            for (s, _) in P3_MODES {
                jobs.push(Job::new("p3-bandwidth", p3_args(m, 4, bw, s, iters)));
            }
            let mut a = p3_args(m, 4, bw, "p3", iters);
            a.job.fast = true;
            jobs.push(Job::new("p3-bandwidth-fast", a));
        }
    }
    jobs
}

/// Phase 1's jobs of P3's Fig. 10 (scalability).
pub(crate) fn p3_scaling_jobs(iters: u64) -> Vec<Job> {
    let mut jobs = Vec::new();
    let (scale_models, skipped) = p3_scale_models();
    for m in &skipped {
        eprintln!("tidewire-papers: SKIPPED {m} in P3's scalability figure: tidewire sim has no profile for it");
    }
    for m in &scale_models {
        for n in P3_SCALE_NODES {
            // The pair, and MXNet's KVStore: the baseline P3's own Fig. 10 measured against.
            for s in P3_PAIR.iter().map(|(s, _)| *s).chain(["kvstore"]) {
                jobs.push(Job::new("p3-scaling", p3_args(m, n, P3_FIG_BW, s, iters)));
            }
        }
    }
    jobs
}

/// Phase 2's jobs, at the bandwidths phase 1 found: the slice sizes and
/// the link traces of P3's Figs. 8, 9 and 12.
pub(crate) fn p3_phase2_jobs(pts: &[Point], sweep_iters: u64) -> Vec<Job> {
    let mut jobs: Vec<Job> = Vec::new();
    for m in SLICE_MODELS {
        for bw in p3_fig_bws(pts, m) {
            jobs.push(Job::new("p3-slices", p3_args(m, 4, bw, "wfbp", sweep_iters)));
            for sp in SLICE_SIZES {
                let mut a = p3_args(m, 4, bw, "p3", sweep_iters);
                a.slice_params = Some(sp);
                jobs.push(Job::new("p3-slices", a));
            }
        }
    }
    for m in UTIL_MODELS {
        for bw in p3_fig_bws(pts, m) {
            for (sync, _) in P3_PAIR {
                let mut a = p3_args(m, 4, bw, sync, UTIL_ITERS);
                a.trace_bin_us = Some(UTIL_BIN_US);
                jobs.push(Job::new("p3-utilization", a));
            }
        }
    }
    jobs
}

/// `EVAL.md`'s section of P3's bandwidth figure.
pub(crate) fn p3_bandwidth_md(s: &mut String, cli: &Cli, pts: &[Point]) {
    let _ = writeln!(s, "\n## P3: throughput on 4 nodes against bandwidth\n");
    let _ = writeln!(s, "![p3-bandwidth](p3-bandwidth.png)\n");
    let _ = writeln!(
        s,
        "4 nodes, each a worker and a server, P3's hardware (`--gpu p4000`), {} iterations. Samples per \
         second over the 4 workers (Sockeye: sentences). Every mode sums in Tidewire's default rank order; \
         *P3 `--fast`* is P3 summing in arrival order, and *deterministic / fast* is P3's throughput in rank \
         order over that. The plot has WFBP, slicing alone and P3 (and P3 `--fast`); KVStore is in the next \
         section's.\n",
        cli.iters
    );
    let mut head = vec!["model".to_string(), "mode".to_string()];
    head.extend(P3_BW.iter().map(|bw| bw.to_string()));
    let mut rows = Vec::new();
    for m in P3_MODELS {
        for (sync, label) in P3_MODES {
            let mut r = vec![m.to_string(), format!("{label} (`{sync}`)")];
            r.extend(P3_BW.iter().map(|&bw| format!("{:.0}", p3_tp(pts, m, bw, sync))));
            rows.push(r);
        }
        let mut r = vec![m.to_string(), "P3 `--fast`".to_string()];
        r.extend(P3_BW.iter().map(|&bw| {
            format!(
                "{:.0}",
                find(pts, "p3-bandwidth-fast", m, 4, bw, "p3").throughput_samples_s
            )
        }));
        rows.push(r);
        let mut r = vec![m.to_string(), "P3 over WFBP".to_string()];
        r.extend(P3_BW.iter().map(|&bw| format!("{:+.0}%", p3_gain(pts, m, bw) * 100.0)));
        rows.push(r);
        let mut r = vec![m.to_string(), "deterministic / fast".to_string()];
        r.extend(P3_BW.iter().map(|&bw| format!("{:.3}", det_over_fast(pts, m, bw))));
        rows.push(r);
    }
    table(s, &head, 2, &rows);
}

/// `EVAL.md`'s section of the `tidewire train` runs under the harness.
pub(crate) fn train_md(s: &mut String, cli: &Cli, train: &[TrainPoint]) {
    let _ = writeln!(
        s,
        "\n### `tidewire train` under the harness (4 namespaces, this machine)\n"
    );
    if train.is_empty() {
        let _ = writeln!(
            s,
            "Not run in this generation (it needs root: `bench/papers/regen.sh` as root, or `--train`)."
        );
    } else {
        if let Some(p) = &cli.train_from {
            let _ = writeln!(
                s,
                "**Carried over**, not rerun in this generation: these `train` runs are from an earlier run as \
                 root, read from its `{}` (`--train-from`); the `sim` column is simulated again here.\n",
                p.display()
            );
        }
        let _ = writeln!(
            s,
            "Each row is one `tidewire train --workers 4 --colocate --fast --iters {}` with a rank in each \
             namespace of `ci/netem/netem.sh run PROFILE 4`, beside `tidewire sim` at the shaped rate, \
             simulated as `train` runs (`--fast`, the default Titan X calibration, not the P4000 of the \
             figure). The triangles in the plot are these runs.\n",
            cli.train_iters
        );
        let _ = writeln!(
            s,
            "| model | profile | shaped | dilation | mode | train samples/s | sim samples/s | train / sim |\n|---|---|---:|---:|---|---:|---:|---:|"
        );
        for t in train {
            let _ = writeln!(
                s,
                "| {} | {} | {:.3} Gbit/s | {} | {} | {:.1} | {:.1} | {:.2} |",
                t.model,
                t.profile,
                t.shaped_gbps,
                t.dilation,
                t.sync,
                t.train_throughput_samples_s,
                t.sim_throughput_samples_s,
                t.train_throughput_samples_s / t.sim_throughput_samples_s
            );
        }
    }
}
