//! The claims rows of Poseidon (ATC'17, `poseidon-atc17.txt`) and its 2015
//! predecessor (`poseidon-arxiv15.txt`), and the few simulations only they need.

use tidewire::engine::cost::{ps_params, sfb_params, NodeRole};
use tidewire::engine::models::profile;

use crate::*;

/// The figure of the points only the claims use.
pub(crate) const CLAIMS_FIG: &str = "poseidon-claims";
/// Poseidon's scaling models whose WFBP (Caffe+WFBP, TF+WFBP) §5.1 quotes at 32 nodes.
const WFBP_32_MODELS: [&str; 4] = ["googlenet", "vgg19", "vgg19-22k", "inception-v3"];
/// Near-linear: at least 90% of the nodes (the effects' rule too: 14.4× on 16).
const NEAR_LINEAR: f64 = 0.9;

/// Phase 1's jobs of the claims: WFBP at 32 nodes (Poseidon §5.1, Figs. 5
/// and 6), and ResNet-152 at 32 nodes (Fig. 9), 40 GbE as the scaling figure.
pub(crate) fn claims_jobs(iters: u64) -> Vec<Job> {
    let mut jobs: Vec<Job> = WFBP_32_MODELS
        .iter()
        .map(|m| Job::new(CLAIMS_FIG, sim_args(m, 32, 40.0, "wfbp", iters)))
        .collect();
    jobs.push(Job::new(CLAIMS_FIG, sim_args("resnet-152", 32, 40.0, "hybrid", iters)));
    jobs
}

fn sp(pts: &[Point], fig: &str, m: &str, n: usize, bw: f64, sync: &str) -> f64 {
    find(pts, fig, m, n, bw, sync).speedup
}

/// Speedup at 32 nodes, 40 GbE: the scaling figure's modes, or the claims' WFBP.
fn sp32(pts: &[Point], m: &str, sync: &str) -> f64 {
    let fig = if sync == "wfbp" || m == "resnet-152" {
        CLAIMS_FIG
    } else {
        "poseidon-scaling"
    };
    sp(pts, fig, m, 32, 40.0, sync)
}

const TF: &str = "needs distributed TensorFlow r0.10 (each tensor whole on one PS shard), which we do not model";
const TRAINING: &str = "an accuracy over training time needs the real training on the dataset; `tidewire sim` moves bytes and does not learn";
const BIG: &str = "16-32 nodes do not fit on 2 cores";

/// Every row of Poseidon ATC'17.
pub(crate) fn poseidon_claims(pts: &[Point]) -> Vec<Claim> {
    let mut rows = headline_claims(pts);
    rows.push(Claim {
        source: "Poseidon §5",
        says: "the cluster: one Titan X, a 16-core CPU and 64 GB per node, 40 GbE; Caffe of 2016/06/30, TensorFlow r0.10".into(),
        value: "up to 32 nodes".into(),
        sim: "the Titan X calibration (`engine/src/models.rs`), 5 µs latency, fair lossless links; 40 GbE in the scaling figure, 2-30 GbE in the bandwidth one; no framework".into(),
        harness: no_harness(BIG),
        holds: Holds::Setting,
    });
    rows.extend(table3_claims());
    rows.extend(single_node_claims(pts));
    rows.extend(scaling_claims(pts));
    rows.extend(scaling_other_claims(pts));
    rows.extend(table1_claims());
    rows.extend(bandwidth_fig8_claims(pts));
    rows.extend(comparison_claims(pts));
    rows
}

/// The abstract's and §1's numbers.
fn headline_claims(pts: &[Point]) -> Vec<Claim> {
    let k22_10 = sp(pts, "poseidon-bandwidth", "vgg19-22k", 16, 10.0, "hybrid");
    let inc = sp32(pts, "inception-v3", "hybrid");
    let k22 = sp32(pts, "vgg19-22k", "hybrid");
    let ps40 = sp(pts, "poseidon-scaling", "vgg19-22k", 16, 40.0, "fifo-ps");
    let ps10 = sp(pts, "poseidon-bandwidth", "vgg19-22k", 16, 10.0, "fifo-ps");
    let wf10 = sp(pts, "poseidon-bandwidth", "vgg19-22k", 16, 10.0, "wfbp");
    vec![
        Claim {
            source: "Poseidon abstract, §1, §5.2, Fig. 8",
            says: "Poseidon (Caffe and TensorFlow), VGG19-22K, 16 nodes, 10 GbE: speedup".into(),
            value: "15.5×".into(),
            sim: format!("{k22_10:.1}× (`hybrid`; WFBP {wf10:.1}×, PS {ps10:.1}×)"),
            harness: no_harness(BIG),
            holds: judge(k22_10, 15.5, k22_10 >= NEAR_LINEAR * 16.0),
        },
        Claim {
            source: "Poseidon abstract, §1, §5.1, Fig. 6",
            says: "Poseidon-TensorFlow, Inception-V3, 32 nodes, 40 GbE: speedup".into(),
            value: "31.5×".into(),
            sim: format!("{inc:.1}× (`hybrid`)"),
            harness: no_harness(BIG),
            holds: judge(inc, 31.5, inc >= NEAR_LINEAR * 32.0),
        },
        Claim {
            source: "Poseidon abstract, §1, Fig. 6",
            says: "open-source distributed TensorFlow, Inception-V3, 32 nodes: speedup (Poseidon's 31.5× is \"a 50% improvement\")".into(),
            value: "20×".into(),
            sim: format!("our PS (`fifo-ps`): {:.1}×", sp32(pts, "inception-v3", "fifo-ps")),
            harness: no_harness(BIG),
            holds: Holds::NotReproduced(TF),
        },
        Claim {
            source: "Poseidon §1, §5.1, Fig. 6",
            says: "open-source TensorFlow, VGG19-22K, 32 machines: can be slower than one machine".into(),
            value: "< 1×".into(),
            sim: format!("our PS (`fifo-ps`): {:.1}×", sp32(pts, "vgg19-22k", "fifo-ps")),
            harness: no_harness(BIG),
            holds: Holds::NotReproduced(TF),
        },
        Claim {
            source: "Poseidon §1 (citing §5.1)",
            says: "VGG19-22K, 16 machines, 40 GbE, one Titan X each: the network bottlenecks a PS to".into(),
            value: "8×".into(),
            sim: format!("{ps40:.1}× (`fifo-ps`: 2 MB chunks over all servers, not bottlenecked at 40 GbE)"),
            harness: no_harness(BIG),
            holds: effect(ps40 < NEAR_LINEAR * 16.0),
        },
        Claim {
            source: "Poseidon §1, Figs. 5, 6",
            says: "Poseidon, VGG19-22K, 32 nodes (Caffe and TensorFlow): near-linear speedup".into(),
            value: "30×".into(),
            sim: format!("{k22:.1}× (`hybrid`, 40 GbE)"),
            harness: no_harness(BIG),
            holds: judge(k22, 30.0, k22 >= NEAR_LINEAR * 32.0),
        },
        Claim {
            source: "Poseidon §1, §5.2, Fig. 8",
            says: "VGG19-22K, 10 GbE, 16 machines: a PS reaches only (Poseidon keeps scaling linearly)".into(),
            value: "4×".into(),
            sim: format!("PS {ps10:.1}× (`fifo-ps`), WFBP {wf10:.1}×; Poseidon {k22_10:.1}×"),
            harness: no_harness(BIG),
            holds: judge(ps10, 4.0, ps10 < NEAR_LINEAR * 16.0 && k22_10 >= NEAR_LINEAR * 16.0),
        },
    ]
}

/// §5's Table 3: model sizes and batches.
fn table3_claims() -> Vec<Claim> {
    let mut rows: Vec<Claim> = [
        ("googlenet", "GoogLeNet", "5M", 5.0e6, 128),
        ("inception-v3", "Inception-V3", "27M", 27.0e6, 32),
        ("vgg19", "VGG19", "143M", 143.0e6, 32),
        ("vgg19-22k", "VGG19-22K", "229M", 229.0e6, 32),
        ("resnet-152", "ResNet-152", "60.2M", 60.2e6, 32),
    ]
    .into_iter()
    .map(|(m, name, stated, params, batch)| {
        let p = profile(m).expect("a built-in model");
        let ours = p.params() as f64;
        Claim {
            source: "Poseidon §5, Table 3",
            says: format!("{name}: parameters, single-node batch"),
            value: format!("{stated}, {batch}"),
            sim: format!(
                "{:.1} M, {} (`engine/src/models.rs`: the architecture's layer shapes)",
                ours / 1e6,
                p.batch
            ),
            harness: "the same profiles".into(),
            // A count has no effect apart from its value: within CLOSE, or not.
            holds: if p.batch == batch && judge(ours, params, true) == Holds::Yes {
                Holds::Yes
            } else {
                Holds::No
            },
        }
    })
    .collect();
    rows.push(Claim {
        source: "Poseidon §5, Table 3",
        says: "CIFAR-10 quick: parameters, batch".into(),
        value: "145.6K, 100".into(),
        sim: "no profile".into(),
        harness: no_harness("no profile"),
        holds: Holds::NotReproduced("Caffe's toy CIFAR-10 network has no profile in `tidewire sim`"),
    });
    rows
}

/// §5.1's single-node throughputs.
fn single_node_claims(pts: &[Point]) -> Vec<Claim> {
    let one = |m: &str| find(pts, "poseidon-scaling", m, 1, 40.0, "hybrid").throughput_samples_s;
    let ps_one = |m: &str| find(pts, "poseidon-scaling", m, 1, 40.0, "fifo-ps").throughput_samples_s;
    let caffe = ["googlenet", "vgg19", "vgg19-22k"];
    let (ps1, pos1) = (caffe.map(ps_one), caffe.map(one));
    vec![
        Claim {
            source: "Poseidon §5.1, Fig. 5",
            says: "one node, Poseidon-Caffe (original Caffe): images/s, GoogLeNet / VGG19 / VGG19-22K".into(),
            value: "257 / 35.5 / 34.2 (257 / 35.5 / 34.6)".into(),
            sim: format!(
                "{:.1} / {:.1} / {:.1}",
                one("googlenet"),
                one("vgg19"),
                one("vgg19-22k")
            ),
            harness: no_harness("a Titan X's throughput, not this machine's"),
            holds: Holds::Calibrated,
        },
        Claim {
            source: "Poseidon §5.1, Fig. 6",
            says: "one node, Poseidon-TensorFlow (original TensorFlow): images/s, Inception-V3 / VGG19 / VGG19-22K"
                .into(),
            value: "43.2 / 38.2 / 34.5 (43.2 / 38.5 / 34.8)".into(),
            sim: format!(
                "{:.1} / {:.1} / {:.1} (VGG19s calibrated to Caffe's)",
                one("inception-v3"),
                one("vgg19"),
                one("vgg19-22k")
            ),
            harness: no_harness("a Titan X's throughput, not this machine's"),
            holds: Holds::Calibrated,
        },
        Claim {
            source: "Poseidon §5.1, Fig. 5",
            says: "one node, Caffe+PS: images/s, GoogLeNet / VGG19 / VGG19-22K (its RAM-GPU copies not overlapped with compute)".into(),
            value: "213.3 / 21.3 / 18.5".into(),
            sim: format!(
                "{:.1} / {:.1} / {:.1} (`fifo-ps`: its sync through the node's own server after the whole backward pass, not overlapped; no host-GPU copies modelled)",
                ps1[0], ps1[1], ps1[2]
            ),
            harness: no_harness("a Titan X's throughput, not this machine's"),
            holds: judge_all(&ps1, &[213.3, 21.3, 18.5], ps1.iter().zip(pos1).all(|(p, q)| p < &q)),
        },
    ]
}

/// §5.1's scaling on 40 GbE: Figs. 5, 6 and 7.
fn scaling_claims(pts: &[Point]) -> Vec<Claim> {
    let (wg, wv) = (sp32(pts, "googlenet", "wfbp"), sp32(pts, "vgg19", "wfbp"));
    let (wk, hk) = (sp32(pts, "vgg19-22k", "wfbp"), sp32(pts, "vgg19-22k", "hybrid"));
    let (wi, hi, hv) = (
        sp32(pts, "inception-v3", "wfbp"),
        sp32(pts, "inception-v3", "hybrid"),
        sp32(pts, "vgg19", "hybrid"),
    );
    let busy = |m: &str| sp(pts, "poseidon-scaling", m, 8, 40.0, "hybrid") / 8.0 * 100.0;
    let busy_min = ["inception-v3", "vgg19", "vgg19-22k"]
        .map(busy)
        .into_iter()
        .fold(100.0, f64::min);
    vec![
        Claim {
            source: "Poseidon §5.1, Fig. 5",
            says: "Caffe+WFBP (no HybComm), 32 machines, 40 GbE: almost linear for GoogLeNet and VGG19".into(),
            value: "near-linear".into(),
            sim: format!("`wfbp`: GoogLeNet {wg:.1}×, VGG19 {wv:.1}×"),
            harness: no_harness(BIG),
            holds: effect(wg.min(wv) >= NEAR_LINEAR * 32.0),
        },
        Claim {
            source: "Poseidon §5.1, Fig. 5",
            says: "VGG19-22K, 32 nodes, 40 GbE: speedup, Caffe+WFBP → Poseidon".into(),
            value: "21.5× → 29.5×".into(),
            sim: format!("{wk:.1}× (`wfbp`) → {hk:.1}× (`hybrid`)"),
            harness: no_harness(BIG),
            holds: judge(wk, 21.5, hk > wk * 1.05),
        },
        Claim {
            source: "Poseidon §5.1, Fig. 6",
            says: "32 nodes: Poseidon over TF+WFBP (the model is not named; the paragraph is about VGG19's big tensors)".into(),
            value: "22× → 30×".into(),
            sim: format!("`wfbp` → `hybrid`: VGG19 {wv:.1}× → {hv:.1}×, VGG19-22K {wk:.1}× → {hk:.1}×, Inception-V3 {wi:.1}× → {hi:.1}×"),
            harness: no_harness(BIG),
            holds: judge(wk, 22.0, hk > wk * 1.05),
        },
        Claim {
            source: "Poseidon §5.1, Fig. 6",
            says: "distributed TensorFlow, 32 nodes: Inception-V3 (it \"fails to scale\" VGG19 and VGG19-22K)".into(),
            value: "10×".into(),
            sim: format!("our PS (`fifo-ps`): {:.1}×", sp32(pts, "inception-v3", "fifo-ps")),
            harness: no_harness(BIG),
            holds: Holds::NotReproduced(TF),
        },
        Claim {
            source: "Poseidon §5.1, Fig. 7",
            says: "8 nodes: Poseidon keeps the GPUs busy most of the time; TensorFlow stalls (the shares are only in the figure)".into(),
            value: "none in the text".into(),
            sim: format!(
                "GPU busy = speedup / nodes, `hybrid`, 8 nodes: Inception-V3 {:.0}%, VGG19 {:.0}%, VGG19-22K {:.0}%",
                busy("inception-v3"),
                busy("vgg19"),
                busy("vgg19-22k")
            ),
            harness: no_harness("8 nodes do not fit on 2 cores"),
            holds: effect(busy_min >= NEAR_LINEAR * 100.0),
        },
    ]
}

/// §5.1's other numbers: VGG19-22K's FC share, the multi-GPU prose, ResNet-152 (Fig. 9).
fn scaling_other_claims(pts: &[Point]) -> Vec<Claim> {
    let r152 = sp32(pts, "resnet-152", "hybrid");
    let fc = fc_share("vgg19-22k");
    vec![
        Claim {
            source: "Poseidon §5.1",
            says: "VGG19-22K: share of the parameters in its three FC layers".into(),
            value: "91%".into(),
            sim: format!("{:.1}% (`engine/src/models.rs`)", fc * 100.0),
            harness: "the same profile".into(),
            holds: judge(fc, 0.91, true),
        },
        Claim {
            source: "Poseidon §5.1 (Multi-GPU Settings)",
            says: "one node, 4 Titan X: Poseidon linear; Caffe's multi-GPU: GoogLeNet / VGG19".into(),
            value: "4× (3× / 2×)".into(),
            sim: "none: a simulated node has one GPU (Nexus's local aggregation below puts learners behind one rank)"
                .into(),
            harness: no_harness("no GPU here"),
            holds: Holds::NotReproduced("needs a multi-GPU node model with Caffe's own multi-GPU path to compare"),
        },
        Claim {
            source: "Poseidon §5.1 (Multi-GPU Settings)",
            says: "4 AWS p2.8xlarge (32 K80s): GoogLeNet / VGG19".into(),
            value: "32× / 28×".into(),
            sim: "none: no K80 profile".into(),
            harness: no_harness("no GPU here"),
            holds: Holds::NotReproduced("needs a K80 calibration; the paper gives no K80 throughput"),
        },
        Claim {
            source: "Poseidon §5.1, Fig. 9(a)",
            says: "ResNet-152, 32 nodes: throughput speedup".into(),
            value: "31×".into(),
            sim: format!("{r152:.1}× (`hybrid`, 40 GbE; ResNet-152's compute at the mean calibrated rate)"),
            harness: no_harness(BIG),
            holds: judge(r152, 31.0, r152 >= NEAR_LINEAR * 32.0),
        },
        Claim {
            source: "Poseidon §5.1, Fig. 9(b)",
            says: "ResNet-152, 16 and 32 nodes: top-1 error reached in under 90 epochs".into(),
            value: "0.24".into(),
            sim: "none".into(),
            harness: no_harness("ILSVRC12 on GPUs"),
            holds: Holds::NotReproduced(TRAINING),
        },
    ]
}

/// A model's share of parameters in its FC layers.
fn fc_share(model: &str) -> f64 {
    let p = profile(model).expect("a built-in model");
    let fc: usize = p
        .layers
        .iter()
        .filter(|l| l.kind == tidewire::engine::book::LayerKind::Fc)
        .map(|l| l.params())
        .sum();
    fc as f64 / p.params() as f64
}

/// §3.2's Table 1 example.
fn table1_claims() -> Vec<Claim> {
    let (m, n, k, p) = (4096u64, 4096u64, 32u64, 8u64);
    let mp = |x: u64| x as f64 / 1e6;
    let ps_w = mp(ps_params(NodeRole::WorkerOnly, m, n, p, p));
    let ps_s = mp(ps_params(NodeRole::ServerOnly, m, n, p, p));
    let ps_b = mp(ps_params(NodeRole::Both, m, n, p, p));
    let sfb = mp(sfb_params(k, p, m, n));
    vec![Claim {
        source: "Poseidon §3.2, Table 1",
        says: "FC 4096×4096, K = 32, P1 = P2 = 8: parameters per iteration, PS worker / PS server / PS both / SFB"
            .into(),
        value: "34 M / 34 M / 58.7 M / 3.7 M".into(),
        sim: format!("{ps_w:.1} M / {ps_s:.1} M / {ps_b:.1} M / {sfb:.1} M (`engine::cost`)"),
        harness: "the same cost model".into(),
        holds: match judge_all(&[ps_w, ps_s, ps_b, sfb], &[34.0, 34.0, 58.7, 3.7], true) {
            Holds::Yes => Holds::Yes,
            _ => Holds::No,
        },
    }]
}

/// §5.2's bandwidth experiments (Fig. 8).
fn bandwidth_fig8_claims(pts: &[Point]) -> Vec<Claim> {
    let need = |model: &str, sync: &str| {
        POSEIDON_BW
            .iter()
            .copied()
            .find(|&bw| sp(pts, "poseidon-bandwidth", model, 16, bw, sync) >= NEAR_LINEAR * 16.0)
    };
    let show = |b: Option<f64>| b.map_or("none of 2-30 GbE".to_string(), |b| format!("{b} GbE"));
    let lin10 = ["vgg19", "vgg19-22k"]
        .iter()
        .all(|m| need(m, "hybrid").is_some_and(|b| b <= 10.0));
    let ps_more = ["vgg19", "vgg19-22k"]
        .iter()
        .all(|m| need(m, "fifo-ps").map_or(true, |b| b > 10.0) && need(m, "wfbp").map_or(true, |b| b > 10.0));
    let (v_ps, v_wf) = (
        sp(pts, "poseidon-bandwidth", "vgg19", 16, 10.0, "fifo-ps"),
        sp(pts, "poseidon-bandwidth", "vgg19", 16, 10.0, "wfbp"),
    );
    let g_sfb = sfb_params(128, 16, 1000, 1024);
    let g_ps = ps_params(NodeRole::Both, 1000, 1024, 16, 16);
    let g_gain = POSEIDON_BW
        .iter()
        .map(|&bw| {
            sp(pts, "poseidon-bandwidth", "googlenet", 16, bw, "hybrid")
                / sp(pts, "poseidon-bandwidth", "googlenet", 16, bw, "wfbp")
        })
        .fold(0.0, f64::max);
    vec![
        Claim {
            source: "Poseidon §5.2, Fig. 8",
            says: "VGG19, 16 nodes, 10 GbE: PS accelerated only by".into(),
            value: "8×".into(),
            sim: format!("{v_ps:.1}× (`fifo-ps`), {v_wf:.1}× (`wfbp`)"),
            harness: no_harness(BIG),
            holds: judge(v_ps, 8.0, v_ps.max(v_wf) < NEAR_LINEAR * 16.0),
        },
        Claim {
            source: "Poseidon §5.2, Fig. 8",
            says: "VGG19 and VGG19-22K, 16 machines: Poseidon near-linear with 10 GbE; an optimized PS needs 30 GbE or more".into(),
            value: "10 GbE against ≥ 30 GbE".into(),
            sim: format!(
                "first bandwidth reaching 14.4×, Poseidon / WFBP / PS: VGG19 {} / {} / {}; VGG19-22K {} / {} / {}",
                show(need("vgg19", "hybrid")),
                show(need("vgg19", "wfbp")),
                show(need("vgg19", "fifo-ps")),
                show(need("vgg19-22k", "hybrid")),
                show(need("vgg19-22k", "wfbp")),
                show(need("vgg19-22k", "fifo-ps"))
            ),
            harness: no_harness(BIG),
            holds: effect(lin10 && ps_more),
        },
        Claim {
            source: "Poseidon §5.2, Fig. 8",
            says: "GoogLeNet, 16 nodes: Poseidon reduces to PS (one thin FC layer, 1000×1024, batch 128)".into(),
            value: "PS for every layer".into(),
            sim: format!(
                "cost model for that layer: SFB {:.1} M > PS {:.1} M parameters; simulated, Poseidon over WFBP at most {:+.1}%",
                g_sfb as f64 / 1e6,
                g_ps as f64 / 1e6,
                (g_gain - 1.0) * 100.0
            ),
            harness: no_harness(BIG),
            holds: effect(g_sfb > g_ps && g_gain <= 1.05),
        },
    ]
}

/// §5.3: Adam (Fig. 10) and CNTK's 1-bit quantization (Fig. 11).
fn comparison_claims(pts: &[Point]) -> Vec<Claim> {
    let adam = adam_point(pts, "vgg19", "adam").speedup;
    let hyb = adam_point(pts, "vgg19", "hybrid").speedup;
    let t = traffic(adam_point(pts, "vgg19", "adam"));
    let vgg = |n: usize| sp(pts, "poseidon-scaling", "vgg19", n, 40.0, "hybrid");
    vec![
        Claim {
            source: "Poseidon §3.2, §5.3, Fig. 10",
            says: "VGG19, 8 nodes: Adam's traffic per node is highly imbalanced (Gb per iteration per node only in the figure)".into(),
            value: "none in the text".into(),
            sim: adam_imbalance_evidence(pts),
            harness: no_harness("8 + 8 nodes do not fit on 2 cores"),
            holds: effect(t.server_max / t.server_min >= 2.0),
        },
        Claim {
            source: "Poseidon §5.3",
            says: "Adam's strategy, VGG19, 8 nodes: speedup".into(),
            value: "5×".into(),
            sim: format!(
                "{adam:.2}× (`adam`, 8 workers + 8 servers, 40 GbE; HybComm {hyb:.2}×): Adam's busiest server does not bottleneck our 40 GbE"
            ),
            harness: no_harness("8 + 8 nodes do not fit on 2 cores"),
            holds: judge(adam, 5.0, adam < hyb * 0.95),
        },
        Claim {
            source: "Poseidon §5.3, Fig. 11",
            says: "CIFAR-10 quick, 4 GPUs: test error, Poseidon-1bit after 3K iterations against Poseidon at 1,000".into(),
            value: "0.5 against 0.3".into(),
            sim: "none".into(),
            harness: no_harness("no 1-bit mode"),
            holds: Holds::NotReproduced("needs 1-bit quantization (not a Tidewire mode) and the real training"),
        },
        Claim {
            source: "Poseidon §5.3",
            says: "CNTK-1bit, VGG19, 8 / 16 / 32 nodes: speedup".into(),
            value: "5.8× / 11× / 20×".into(),
            sim: format!("Poseidon (`hybrid`, 40 GbE): {:.1}× / {:.1}× / {:.1}×", vgg(8), vgg(16), vgg(32)),
            harness: no_harness(BIG),
            holds: Holds::NotReproduced("1-bit quantization is not a Tidewire mode"),
        },
    ]
}

/// Every row of Poseidon's 2015 arXiv paper. Its text copy lost most of its
/// numbers (they were typeset as math); the rows hold those it kept.
pub(crate) fn poseidon15_claims(pts: &[Point]) -> Vec<Claim> {
    let g8 = sp(pts, "poseidon-scaling", "googlenet", 8, 40.0, "hybrid");
    let k20 = "needs K20C GPUs' profiles and the real training; `tidewire sim` has neither";
    vec![
        Claim {
            source: "Poseidon'15 §5.1, Table 4",
            says: "the datasets: images (classes) of CIFAR-10 / ILSVRC2012 / ImageNet22K; the cluster: K20C GPUs, 40 GbE, Caffe of Oct 2014".into(),
            value: "60K (10) / 1.3M (1000) / 14.2M (21841); 8 nodes".into(),
            sim: "no dataset: `tidewire sim` moves gradients of the models' shapes".into(),
            harness: no_harness("no dataset"),
            holds: Holds::Setting,
        },
        Claim {
            source: "Poseidon'15 abstract, §5.1, Table 5",
            says: "8 nodes (K20C, 40 GbE), speedup to convergence: AlexNet / GoogLeNet / CIFAR-10 quick".into(),
            value: "4.5× / 4× / 4×".into(),
            sim: format!("throughput, not convergence: GoogLeNet {g8:.1}× (`hybrid`, 8 nodes, Titan X)"),
            harness: no_harness("8 nodes, K20C"),
            holds: Holds::NotReproduced(k20),
        },
        Claim {
            source: "Poseidon'15 §5.1.1, Fig. 6(a)-(b)",
            says: "CIFAR-10 quick, 8 nodes: converges in".into(),
            value: "19 s".into(),
            sim: "none".into(),
            harness: no_harness("8 nodes, K20C"),
            holds: Holds::NotReproduced(TRAINING),
        },
        Claim {
            source: "Poseidon'15 §5.1.2, Fig. 6(c)-(d)",
            says: "AlexNet: time to its top-1 accuracy, Poseidon (8 nodes) against one machine".into(),
            value: "27 hours against 5 days".into(),
            sim: "none".into(),
            harness: no_harness("ILSVRC12 on GPUs"),
            holds: Holds::NotReproduced(TRAINING),
        },
        Claim {
            source: "Poseidon'15 §5.1.2, Fig. 6(e)-(f)",
            says: "GoogLeNet: Poseidon converges after; Caffe reaches lower accuracies after; Poseidon reaches them after; Caffe hard to converge after".into(),
            value: "130 h; 250 h and 350 h; < 48 h and 75 h; > 500 h".into(),
            sim: "none".into(),
            harness: no_harness("ILSVRC12 on GPUs"),
            holds: Holds::NotReproduced(TRAINING),
        },
        Claim {
            source: "Poseidon'15 §5.1.3, Table 6",
            says: "ImageNet22K: training time (machines), Poseidon / Adam / MXNet / Le et al.".into(),
            value: "3 days (8 GPUs) / 10 days (62 machines) / 8.5 days (4 GPUs) / 3 days (1,000 machines, 16,000 cores)".into(),
            sim: "none".into(),
            harness: no_harness("ImageNet22K on GPUs"),
            holds: Holds::NotReproduced(TRAINING),
        },
        Claim {
            source: "Poseidon'15 §5.1.3",
            says: "its ImageNet22K network (AlexNet-like, two FC layers of 3,000, 21,841 classes): parameters".into(),
            value: "120 M".into(),
            sim: "no profile".into(),
            harness: no_harness("no profile"),
            holds: Holds::NotReproduced("its conv shapes were lost in the text copy, so it has no profile"),
        },
    ]
}

/// Poseidon'15 §5.2's internal comparisons (Figs. 7, 8), whose numbers the text copy lost.
pub(crate) fn poseidon15_internal_claims(pts: &[Point]) -> Vec<Claim> {
    let (g_ps, g_wf, g_hy) = (
        sp(pts, "poseidon-bandwidth", "googlenet", 16, 2.0, "fifo-ps"),
        sp(pts, "poseidon-bandwidth", "googlenet", 16, 2.0, "wfbp"),
        sp(pts, "poseidon-bandwidth", "googlenet", 16, 2.0, "hybrid"),
    );
    let lost = |says: &str| {
        Claim {
        source: "Poseidon'15 §5.2.1, Fig. 7",
        says: says.into(),
        value: "lost in the text copy".into(),
        sim: format!("GoogLeNet, 16 nodes, 2 GbE: `fifo-ps` {g_ps:.1}× → `wfbp` {g_wf:.1}× → `hybrid` {g_hy:.1}× (no AlexNet run here)"),
        harness: no_harness(BIG),
        holds: effect(g_wf > g_ps),
    }
    };
    vec![
        lost("AlexNet and GoogLeNet, 8 nodes: DWBP raises the speedup over traditional BP"),
        Claim {
            holds: effect(g_hy >= g_wf * 0.99),
            ..lost("8 nodes: SACP raises it further for AlexNet, a little for GoogLeNet (fewer FC layers)")
        },
        Claim {
            source: "Poseidon'15 §5.2.2, Fig. 8",
            says: "AlexNet, 4 nodes: speedup with staleness s > 0 against BSP (s = 0)".into(),
            value: "lost in the text copy".into(),
            sim: "none: SSP not simulated here".into(),
            harness: no_harness("K20C"),
            holds: Holds::NotReproduced(
                "the figure's values were lost in the text copy and the SSP runs are not part of this evaluation",
            ),
        },
    ]
}
