use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use tidewire_cli::sim::SimArgs;

use crate::*;

pub(crate) const POSEIDON_MODELS: [&str; 3] = ["googlenet", "vgg19", "vgg19-22k"];
pub(crate) const POSEIDON_BW: [f64; 5] = [2.0, 5.0, 10.0, 20.0, 30.0];
/// The Poseidon ablation: PS without WFBP, WFBP, WFBP + HybComm.
pub(crate) const POSEIDON_MODES: [(&str, &str); 3] = [("fifo-ps", "PS"), ("wfbp", "WFBP"), ("hybrid", "Poseidon")];
pub(crate) const SCALING_MODELS: [&str; 4] = ["googlenet", "vgg19", "vgg19-22k", "inception-v3"];
pub(crate) const SCALING_NODES: [usize; 6] = [1, 2, 4, 8, 16, 32];
pub(crate) const SCALING_MODES: [(&str, &str); 2] = [("fifo-ps", "PS"), ("hybrid", "Poseidon")];
/// Poseidon's Fig. 10, simulated: its models and the modes it compares
/// (PS, here WFBP over the sharded PS; HybComm; Adam). The cluster is the
/// analytic table's: [`ADAM_P`] workers and [`ADAM_P`] servers on separate
/// nodes, batch [`ADAM_K`].
pub(crate) const ADAM_MODELS: [&str; 2] = ["vgg19", "vgg19-22k"];
pub(crate) const ADAM_MODES: [(&str, &str); 3] = [("wfbp", "PS"), ("hybrid", "HybComm"), ("adam", "Adam")];
/// Its bandwidth: Poseidon's cluster's 40 GbE, as in the scaling figure.
/// The bytes per iteration do not depend on it; the throughput does.
pub(crate) const ADAM_BW: f64 = 40.0;

/// A point of Poseidon's simulated Fig. 10: [`ADAM_P`] workers and
/// [`ADAM_P`] servers on separate nodes, batch [`ADAM_K`], [`ADAM_BW`] Gbit/s,
/// arrival-order summation as Poseidon's other figures.
pub(crate) fn adam_args(model: &str, sync: &str, iters: u64) -> SimArgs {
    let mut a = SimArgs {
        nodes: None,
        workers: Some(ADAM_P as usize),
        servers: Some(ADAM_P as usize),
        ..sim_args(model, ADAM_P as usize, ADAM_BW, sync, iters)
    };
    a.job.batch = Some(ADAM_K as usize);
    a
}

/// The effects of Poseidon's bandwidth figure.
pub(crate) fn poseidon_bandwidth_effects(pts: &[Point]) -> Vec<Effect> {
    let mut out = Vec::new();
    // 1. HybComm lowers the bandwidth needed for near-linear scaling (≥ 90% of 16×).
    let need = |model: &str, sync: &str| {
        POSEIDON_BW
            .iter()
            .copied()
            .find(|&bw| find(pts, "poseidon-bandwidth", model, 16, bw, sync).speedup >= 0.9 * 16.0)
    };
    let show = |b: Option<f64>| b.map_or("none of 2-30 GbE".to_string(), |b| format!("{b} GbE"));
    for model in ["vgg19", "vgg19-22k"] {
        let (ps, wfbp, pos) = (need(model, "fifo-ps"), need(model, "wfbp"), need(model, "hybrid"));
        let lower = |x: Option<f64>| match (pos, x) {
            (Some(p), Some(x)) => p < x,
            (Some(_), None) => true,
            _ => false,
        };
        out.push(Effect {
            claim: format!("HybComm lowers the bandwidth {model} needs for near-linear scaling (≥ 14.4× on 16 nodes)"),
            evidence: format!(
                "first bandwidth reaching 14.4×: Poseidon {}, WFBP {}, PS {}",
                show(pos),
                show(wfbp),
                show(ps)
            ),
            holds: lower(wfbp) && lower(ps),
        });
    }
    // 2. GoogLeNet gains little from HybComm.
    let gains: Vec<f64> = POSEIDON_BW
        .iter()
        .map(|&bw| {
            find(pts, "poseidon-bandwidth", "googlenet", 16, bw, "hybrid").speedup
                / find(pts, "poseidon-bandwidth", "googlenet", 16, bw, "wfbp").speedup
                - 1.0
        })
        .collect();
    let max_gain = gains.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    out.push(Effect {
        claim: "GoogLeNet gains little from HybComm (Poseidon within 5% of WFBP at every bandwidth)".into(),
        evidence: format!("largest gain of Poseidon over WFBP: {:+.1}%", max_gain * 100.0),
        holds: max_gain <= 0.05,
    });
    out
}

pub(crate) fn plot_poseidon_bandwidth(pts: &[Point], path: &Path) -> Result<(), String> {
    let root = BitMapBackend::new(path, (1500, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    for (area, model) in root.split_evenly((1, 3)).iter().zip(POSEIDON_MODELS) {
        let lines: Vec<Series> = POSEIDON_MODES
            .iter()
            .map(|(sync, label)| {
                let v = POSEIDON_BW
                    .iter()
                    .map(|&bw| (bw, find(pts, "poseidon-bandwidth", model, 16, bw, sync).speedup))
                    .collect();
                (label.to_string(), v)
            })
            .collect();
        panel(
            area,
            &format!("{model}, 16 nodes"),
            "bandwidth (Gbit/s)",
            "speedup over one node",
            &lines,
            &[],
            Some(vec![(0.0, 16.0), (30.0, 16.0)]),
        )?;
    }
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}

pub(crate) fn plot_scaling(pts: &[Point], path: &Path) -> Result<(), String> {
    let root = BitMapBackend::new(path, (1600, 430)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    for (area, model) in root.split_evenly((1, 4)).iter().zip(SCALING_MODELS) {
        let lines: Vec<Series> = SCALING_MODES
            .iter()
            .map(|(sync, label)| {
                let v = SCALING_NODES
                    .iter()
                    .map(|&n| (n as f64, find(pts, "poseidon-scaling", model, n, 40.0, sync).speedup))
                    .collect();
                (label.to_string(), v)
            })
            .collect();
        panel(
            area,
            &format!("{model}, 40 GbE"),
            "nodes",
            "speedup over one node",
            &lines,
            &[],
            Some(vec![(0.0, 0.0), (32.0, 32.0)]),
        )?;
    }
    root.present().map_err(|e| format!("{}: {e}", path.display()))
}

/// Poseidon's cluster for Fig. 10's traffic comparison: P1 workers, P2 servers, batch K.
pub(crate) const ADAM_P: u64 = 8;
pub(crate) const ADAM_K: u64 = 32;

/// Bytes per iteration (FP32) moved by a worker and by the busiest node, for
/// one scheme over a model's FC layers, with P1 = P2 = [`ADAM_P`] separate
/// workers and servers and batch [`ADAM_K`]: (worker, busiest).
pub(crate) fn adam_traffic(fc: &[(u64, u64)], scheme: &str) -> (f64, f64) {
    use tidewire::engine::cost::{adam_params, ps_params, sfb_params, NodeRole};
    let (p, k) = (ADAM_P, ADAM_K);
    // A server's load per layer, and whether the layer is whole on one server (Adam).
    let mut worker = 0u64;
    let mut even = 0u64; // spread evenly over all servers
    let mut whole: Vec<u64> = Vec::new(); // each on one server
    for &(m, n) in fc {
        let ps = ps_params(NodeRole::WorkerOnly, m, n, p, p).max(ps_params(NodeRole::ServerOnly, m, n, p, p));
        let sfb = sfb_params(k, p, m, n);
        match scheme {
            "PS" => {
                worker += ps_params(NodeRole::WorkerOnly, m, n, p, p);
                even += ps_params(NodeRole::ServerOnly, m, n, p, p);
            }
            "SFB" => worker += sfb,
            "HybComm" if sfb < ps => worker += sfb,
            "HybComm" => {
                worker += ps_params(NodeRole::WorkerOnly, m, n, p, p);
                even += ps_params(NodeRole::ServerOnly, m, n, p, p);
            }
            "Adam" => {
                worker += adam_params(NodeRole::WorkerOnly, k, m, n, p);
                whole.push(adam_params(NodeRole::ServerOnly, k, m, n, p));
            }
            _ => unreachable!("a scheme of the table"),
        }
    }
    // Whole layers go largest first to the least-loaded server.
    whole.sort_unstable_by(|a, b| b.cmp(a));
    let mut servers = vec![even; ADAM_P as usize];
    for w in whole {
        let i = (0..servers.len()).min_by_key(|&i| servers[i]).expect("servers");
        servers[i] += w;
    }
    let busiest = worker.max(servers.into_iter().max().unwrap_or(0));
    (4.0 * worker as f64, 4.0 * busiest as f64)
}

/// A model's FC layers, (M, N).
pub(crate) fn fc_layers(model: &str) -> Vec<(u64, u64)> {
    tidewire::engine::models::profile(model)
        .expect("a known model")
        .layers
        .iter()
        .filter(|l| l.kind == tidewire::engine::book::LayerKind::Fc)
        .map(|l| (l.m as u64, l.n as u64))
        .collect()
}

/// Adam's busiest node over a worker, VGG19's FC layers.
pub(crate) fn adam_imbalance(model: &str) -> f64 {
    let (w, b) = adam_traffic(&fc_layers(model), "Adam");
    b / w
}

/// Poseidon's Fig. 10: the traffic of PS, SFB, Adam and HybComm, from the cost model.
pub(crate) fn adam_md(s: &mut String) {
    let _ = writeln!(s, "\n## Poseidon: Adam's traffic (Fig. 10), from the cost model\n");
    let _ = writeln!(
        s,
        "Analytic: Adam (Project Adam's scheme, Poseidon §3.2: sufficient factors up to the layer's server, \
         full matrices down) from the cost model; the next section simulates it with the engine's `adam` mode. \
         Bytes (FP32) moved, sent plus \
         received, per iteration, over each model's FC layers, from `engine::cost` (`ps_params`, \
         `sfb_params`, `adam_params`), with P1 = {ADAM_P} workers and P2 = {ADAM_P} servers on separate nodes \
         and K = {ADAM_K}. PS and HybComm's PS layers are sharded evenly over the servers; Adam puts each FC \
         layer whole on one server (largest first, on the least-loaded one: here each on its own). HybComm \
         takes, per layer, whichever of PS and SFB loads its busiest node less. *Busiest / worker* is the \
         imbalance: per layer, Adam's server moves P1 = {ADAM_P} times what a worker does.\n"
    );
    let head: Vec<String> = [
        "model (FC layers)",
        "scheme",
        "worker",
        "busiest node",
        "busiest / worker",
    ]
    .map(String::from)
    .to_vec();
    let mut rows = Vec::new();
    for model in ["vgg19", "vgg19-22k"] {
        let fc = fc_layers(model);
        let shapes = fc
            .iter()
            .map(|(m, n)| format!("{m}×{n}"))
            .collect::<Vec<_>>()
            .join(", ");
        for scheme in ["PS", "SFB", "Adam", "HybComm"] {
            let (w, b) = adam_traffic(&fc, scheme);
            rows.push(vec![
                format!("{model} ({shapes})"),
                scheme.to_string(),
                format!("{:.0} MB", w / 1e6),
                format!("{:.0} MB", b / 1e6),
                format!("{:.2}", b / w),
            ]);
        }
    }
    table(s, &head, 2, &rows);
}

/// A point's traffic in Poseidon's simulated Fig. 10, bytes per iteration
/// through a node's NIC, sent plus received.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Traffic {
    /// A worker's, the mean over the workers.
    pub(crate) worker: f64,
    /// The busiest server's and the least busy server's.
    pub(crate) server_max: f64,
    pub(crate) server_min: f64,
    /// The busiest node's, worker or server.
    pub(crate) busiest: f64,
}

/// The traffic of a point with [`Point::host_bytes_per_iter`] (its
/// `nodes` workers first, then the servers).
pub(crate) fn traffic(p: &Point) -> Traffic {
    let tot: Vec<f64> = p.host_bytes_per_iter.iter().map(|h| h[0] + h[1]).collect();
    assert!(
        tot.len() > p.nodes && p.nodes > 0,
        "{} {}: {} hosts' bytes, {} workers",
        p.model,
        p.sync,
        tot.len(),
        p.nodes
    );
    let (w, sv) = tot.split_at(p.nodes);
    let max = |v: &[f64]| v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Traffic {
        worker: w.iter().sum::<f64>() / w.len() as f64,
        server_max: max(sv),
        server_min: sv.iter().copied().fold(f64::INFINITY, f64::min),
        busiest: max(&tot),
    }
}

/// The point of Poseidon's simulated Fig. 10 for `model` and `sync`.
pub(crate) fn adam_point<'a>(pts: &'a [Point], model: &str, sync: &str) -> &'a Point {
    find(pts, "poseidon-adam", model, ADAM_P as usize, ADAM_BW, sync)
}

/// The effect of Poseidon's Fig. 10, on the simulated traffic: Adam's
/// strategy loads its servers unevenly (the FC layers' servers carry P1
/// full matrices), and HybComm's busiest node carries less than Adam's.
pub(crate) fn adam_effects(pts: &[Point]) -> Vec<Effect> {
    let mut holds = true;
    let mut rows = Vec::new();
    for m in ADAM_MODELS {
        let a = traffic(adam_point(pts, m, "adam"));
        let h = traffic(adam_point(pts, m, "hybrid"));
        let ratio = a.server_max / a.server_min;
        holds &= ratio >= 2.0 && h.busiest < a.busiest;
        rows.push(format!(
            "{m}: Adam's busiest server {:.0} MB, least busy {:.0} MB ({ratio:.2}×); busiest node: HybComm {:.0} MB, Adam {:.0} MB",
            a.server_max / 1e6,
            a.server_min / 1e6,
            h.busiest / 1e6,
            a.busiest / 1e6
        ));
    }
    vec![Effect {
        claim: format!(
            "Adam's strategy imbalances the servers and HybComm relieves its bottleneck (Fig. 10, simulated: P1 = P2 = {ADAM_P}, \
             K = {ADAM_K}): Adam's busiest server moves ≥ 2× what its least busy one does, and HybComm's busiest node \
             moves less than Adam's, on VGG19 and VGG19-22K"
        ),
        evidence: format!("bytes per iteration, sent + received: {}", rows.join("; ")),
        holds,
    }]
}

/// The bytes of a model's layers other than FC (the conv layers and the rest).
pub(crate) fn non_fc_bytes(model: &str) -> f64 {
    use tidewire::engine::book::{DType, LayerKind};
    tidewire::engine::models::profile(model)
        .expect("a known model")
        .layers
        .iter()
        .filter(|l| l.kind != LayerKind::Fc)
        .map(|l| (l.params() * if l.dtype == DType::F32 { 4 } else { 2 }) as f64)
        .sum()
}

/// Poseidon's Fig. 10, simulated: the traffic of PS, HybComm and Adam per node.
pub(crate) fn adam_sim_md(s: &mut String, cli: &Cli, pts: &[Point]) {
    let _ = writeln!(s, "\n## Poseidon: Adam's traffic (Fig. 10), simulated\n");
    let _ = writeln!(
        s,
        "The analytic table's cluster, simulated with the engine's Adam mode: `tidewire sim --model MODEL \
         --workers {p} --servers {p} --batch {ADAM_K} --bandwidth {ADAM_BW}gbit --sync MODE --fast`, {} iterations. \
         P1 = {p} workers and P2 = {p} servers on separate nodes and K = {ADAM_K}, as the cost model above assumes; \
         {ADAM_BW} GbE because it is Poseidon's cluster (the scaling figure above uses it too; the bandwidth figure \
         sweeps 2-30 GbE, and Fig. 10 is a traffic figure): the bytes per iteration do not depend on the \
         bandwidth, the throughput does. Arrival-order summation (`--fast`), as Poseidon's other figures. \
         Modes: PS = `wfbp` (every layer in 2 MB chunks over all servers), HybComm = `hybrid` (Poseidon: SFB \
         for each FC layer where it moves fewer bytes, PS for the rest), Adam = `adam` (each dense FC layer \
         whole on one server, the least loaded by bytes when its turn comes; the other layers over the sharded \
         PS). Traffic is the bytes a node's NIC sent plus received per iteration, the set-up (seeding the \
         servers) not counted, in MB (10^6 bytes): a worker's (the mean over the {p}), the busiest and the \
         least busy server's, their ratio, and the busiest of all {} nodes over a worker. Samples per second \
         over the {p} workers, and the speedup over one node of the same profile (at most {p}×).\n",
        cli.iters,
        2 * ADAM_P,
        p = ADAM_P
    );
    adam_sim_table(s, pts);
    adam_against_model_md(s, pts);
}

/// Per model and mode: samples per second, speedup, and the nodes' traffic.
fn adam_sim_table(s: &mut String, pts: &[Point]) {
    let head: Vec<String> = [
        "model",
        "scheme",
        "samples/s",
        "speedup",
        "worker",
        "busiest server",
        "least busy server",
        "busiest / least busy server",
        "busiest node / worker",
    ]
    .map(String::from)
    .to_vec();
    let mb = |x: f64| format!("{:.0} MB", x / 1e6);
    let mut rows = Vec::new();
    for m in ADAM_MODELS {
        for (sync, label) in ADAM_MODES {
            let p = adam_point(pts, m, sync);
            let t = traffic(p);
            rows.push(vec![
                m.to_string(),
                format!("{label} (`{sync}`)"),
                format!("{:.1}", p.throughput_samples_s),
                format!("{:.2}×", p.speedup),
                mb(t.worker),
                mb(t.server_max),
                mb(t.server_min),
                format!("{:.2}", t.server_max / t.server_min),
                format!("{:.2}", t.busiest / t.worker),
            ]);
        }
    }
    table(s, &head, 2, &rows);
}

/// The simulated traffic beside the cost model's, and why they differ.
fn adam_against_model_md(s: &mut String, pts: &[Point]) {
    let mb = |x: f64| format!("{:.0} MB", x / 1e6);
    let _ = writeln!(
        s,
        "\n**Against the cost model.** The two tables measure different things, so their figures differ. The \
         cost model counts FP32 parameters of the FC layers alone, placed as its text says; the simulator \
         moves every layer, the conv layers too ({:.0} MB of VGG19's parameters, {:.0} MB of VGG19-22K's, over \
         the sharded PS in every mode: the same load on every worker and about the same on every server, which \
         dilutes Adam's ratios), counts the bytes \
         on its simulated wire (payloads and the protocol's own messages), and places Adam's FC layers as the \
         engine does (by bytes, after the chunks of the layers before them). Side by side, bytes per \
         iteration, cost model → simulated:\n",
        non_fc_bytes("vgg19") / 1e6,
        non_fc_bytes("vgg19-22k") / 1e6
    );
    let head: Vec<String> = ["model", "scheme", "worker", "busiest node", "busiest node / worker"]
        .map(String::from)
        .to_vec();
    let mut rows = Vec::new();
    for m in ADAM_MODELS {
        let fc = fc_layers(m);
        for ((sync, label), scheme) in ADAM_MODES.iter().zip(["PS", "HybComm", "Adam"]) {
            let (w, b) = adam_traffic(&fc, scheme);
            let t = traffic(adam_point(pts, m, sync));
            rows.push(vec![
                m.to_string(),
                format!("{label} (`{sync}`)"),
                format!("{} → {}", mb(w), mb(t.worker)),
                format!("{} → {}", mb(b), mb(t.busiest)),
                format!("{:.2} → {:.2}", b / w, t.busiest / t.worker),
            ]);
        }
    }
    table(s, &head, 2, &rows);
}

/// Phase 1's jobs of Poseidon's bandwidth and scaling figures.
pub(crate) fn poseidon_jobs(iters: u64) -> Vec<Job> {
    let mut jobs = Vec::new();
    for m in POSEIDON_MODELS {
        for bw in POSEIDON_BW {
            for (s, _) in POSEIDON_MODES {
                jobs.push(Job::new("poseidon-bandwidth", sim_args(m, 16, bw, s, iters)));
            }
        }
    }
    for m in SCALING_MODELS {
        for n in SCALING_NODES {
            for (s, _) in SCALING_MODES {
                jobs.push(Job::new("poseidon-scaling", sim_args(m, n, 40.0, s, iters)));
            }
        }
    }
    jobs
}

/// Phase 1's jobs of Poseidon's simulated Fig. 10 (with every host's bytes).
pub(crate) fn adam_jobs(iters: u64) -> Vec<Job> {
    let mut jobs = Vec::new();
    for m in ADAM_MODELS {
        for (s, _) in ADAM_MODES {
            jobs.push(Job {
                hosts: true,
                ..Job::new("poseidon-adam", adam_args(m, s, iters))
            });
        }
    }
    jobs
}

/// `EVAL.md`'s section of Poseidon's bandwidth figure.
pub(crate) fn poseidon_bandwidth_md(s: &mut String, pts: &[Point]) {
    let _ = writeln!(s, "\n## Poseidon: speedup on 16 nodes against bandwidth\n");
    let _ = writeln!(s, "![poseidon-bandwidth](poseidon-bandwidth.png)\n");
    let _ = write!(s, "| model | mode |");
    for bw in POSEIDON_BW {
        let _ = write!(s, " {bw} GbE |");
    }
    let _ = writeln!(s, "\n|---|---|{}", "---:|".repeat(POSEIDON_BW.len()));
    for m in POSEIDON_MODELS {
        for (sync, label) in POSEIDON_MODES {
            let _ = write!(s, "| {m} | {label} (`{sync}`) |");
            for bw in POSEIDON_BW {
                let _ = write!(s, " {:.1}× |", find(pts, "poseidon-bandwidth", m, 16, bw, sync).speedup);
            }
            let _ = writeln!(s);
        }
    }
}

/// `EVAL.md`'s section of Poseidon's scaling figure.
pub(crate) fn poseidon_scaling_md(s: &mut String, pts: &[Point]) {
    let _ = writeln!(s, "\n## Poseidon: speedup against nodes at 40 GbE\n");
    let _ = writeln!(s, "![poseidon-scaling](poseidon-scaling.png)\n");
    let _ = write!(s, "| model | mode |");
    for n in SCALING_NODES {
        let _ = write!(s, " {n} |");
    }
    let _ = writeln!(s, "\n|---|---|{}", "---:|".repeat(SCALING_NODES.len()));
    for m in SCALING_MODELS {
        for (sync, label) in SCALING_MODES {
            let _ = write!(s, "| {m} | {label} (`{sync}`) |");
            for n in SCALING_NODES {
                let _ = write!(s, " {:.1}× |", find(pts, "poseidon-scaling", m, n, 40.0, sync).speedup);
            }
            let _ = writeln!(s);
        }
    }
}

/// Adam's imbalance by the cost model, and simulated: the busiest node over
/// a worker, and the busiest server over the least busy.
pub(crate) fn adam_imbalance_evidence(pts: &[Point]) -> String {
    let sim = |m: &str| {
        let t = traffic(adam_point(pts, m, "adam"));
        (t.busiest / t.worker, t.server_max / t.server_min)
    };
    let (v, k) = (sim("vgg19"), sim("vgg19-22k"));
    format!(
        "cost model, P1 = P2 = {ADAM_P}, K = {ADAM_K}: {ADAM_P:.2}× per layer (P1); FC layers together {:.2}× (VGG19), {:.2}× (VGG19-22K). \
         Simulated (every layer, bytes, {ADAM_BW} GbE; see Fig. 10, simulated): busiest node / worker {:.2}× (VGG19), {:.2}× (VGG19-22K); \
         busiest / least busy server {:.2}× (VGG19), {:.2}× (VGG19-22K)",
        adam_imbalance("vgg19"),
        adam_imbalance("vgg19-22k"),
        v.0,
        k.0,
        v.1,
        k.1
    )
}
