//! The claims rows of Nexus (IBM 2017, `nexus-ibm17.txt`), beside the
//! measurements committed in `bench/results/` (read at build time: the
//! papers check runs none of them again; `bench/results/README.md` says how
//! each was made).

use serde_json::Value;

use crate::*;

/// `tidewire-sparse`: Nexus's sparse push, CPU measured here, wire modelled.
const SPARSE_PUSH: &str = include_str!("../../../results/sparse-push.json");
/// `tidewire-nexus`: local aggregation against flat, in `tidewire sim`.
const NEXUS_LOCAL: &str = include_str!("../../../results/nexus-local.json");
/// `examples/torch/freq_experiment.sh`: quality-guided communication frequency.
const FREQ_DIGITS: &str = include_str!("../../../results/freq-digits/summary.json");
/// `ci/gpu-bench.sh` on the device machine (one H200, 16 cores).
const GPU_AGGREGATE: &str = include_str!("../../../results/h200-16core/aggregate.json");

fn json(text: &str) -> Value {
    serde_json::from_str(text).expect("a committed results file is JSON")
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key}: not a number in {v}"))
}

const NO_HW: &str = "no such hardware on this machine";

/// Every row of Nexus.
pub(crate) fn nexus_claims() -> Vec<Claim> {
    let mut rows = vec![
        Claim {
            source: "Nexus §V, §V-A, Table II",
            says: "the 18-job workload: 24 machines of 2 K40m, Nexus servers on 12, 10 GigE and 56 Gbit/s InfiniBand; batch size and communication frequency (batches per exchange) per model: AlexNet / GoogLeNet / NIN (Caffe) / NMT / VGG / NIN (Torch)".into(),
            value: "256, 10 / 32, 10 / 128 per GPUs, 1 / 40, 100 / 128, 5 / 64, 10".into(),
            sim: "none of these trainings is simulated".into(),
            harness: "our frequency experiment (`bench/results/freq-digits/`): T = 1, quality-guided (up to 16), fixed 64".into(),
            holds: Holds::Setting,
        },
        Claim {
            source: "Nexus §V-B, Fig. 12",
            says: "the dissection's set-up: a NMT model of, on 4 nodes (1 Nexus server, the rest learners without computation), synchronous model averaging".into(),
            value: "350 MB".into(),
            sim: "`tidewire-nexus`: 8 nodes, each a worker and a server, of 2-8 learners, with computation (VGG19, ResNet-50, GoogLeNet)".into(),
            harness: no_harness(NO_HW),
            holds: Holds::Setting,
        },
    ];
    rows.extend(nexus_scaling_claims());
    rows.push(sparse_claim());
    rows.push(freq_claim());
    rows.extend(dissection_claims());
    rows
}

/// §V-A's Figs. 9 and 10: the 18-job workload on K40m GPUs.
fn nexus_scaling_claims() -> Vec<Claim> {
    let k40 = "needs K40m profiles, NIN, NMT and Torch's CIFAR-10 VGG as models, and model averaging every T batches (Table II) in the simulator; it has none of them";
    vec![
        Claim {
            source: "Nexus §V-A, Fig. 9",
            says: "8 learners: throughput speedup, Caffe-AlexNet / Caffe-GoogLeNet / Caffe-NIN / Theano-NMT / Torch-VGG / Torch-NIN".into(),
            value: "7.31× / 7.42× / 3.5× / 7.69× / 7.33× / 7.2×".into(),
            sim: "none".into(),
            harness: no_harness("8 K40m learners"),
            holds: Holds::NotReproduced(k40),
        },
        Claim {
            source: "Nexus §V-A, Fig. 9",
            says: "the same trainings: share of training time spent communicating".into(),
            value: "11.6% / 6.7% (printed \"6,7%\") / 40.6% / 3.7% / 6.3% / 5.3%".into(),
            sim: "none".into(),
            harness: no_harness("8 K40m learners"),
            holds: Holds::NotReproduced(k40),
        },
        Claim {
            source: "Nexus §V-A, Fig. 9",
            says: "NIN Caffe-CIFAR10 scales worst: its batch takes about".into(),
            value: "20 ms".into(),
            sim: "none".into(),
            harness: no_harness("K40m"),
            holds: Holds::NotReproduced(k40),
        },
        Claim {
            source: "Nexus §V-A, Fig. 10(f)",
            says: "NIN-Torch to 30% accuracy: 1 GPU / 4 learners / 8 learners".into(),
            value: "9.25 h / 3.49 h (> 2.65×) / 2.8 h (≈ 20% over 4)".into(),
            sim: "none".into(),
            harness: no_harness("ImageNet-1K on GPUs"),
            holds: Holds::NotReproduced(
                "an accuracy over training time needs the real training on the dataset; `tidewire sim` does not learn",
            ),
        },
    ]
}

/// §IV-C's Fig. 8: sparse-vector push against dense (and compression).
fn sparse_claim() -> Claim {
    let j = json(SPARSE_PUSH);
    let pts = j["points"].as_array().expect("points");
    let at = |d: f64| -> Vec<&Value> { pts.iter().filter(|p| (num(p, "density") - d).abs() < 1e-9).collect() };
    let show = |d: f64| {
        at(d)
            .iter()
            .map(|p| {
                format!(
                    "{:.1} → {:.1} ms at {} GbE",
                    num(p, "dense_ms"),
                    num(p, "sparse_ms"),
                    num(p, "gbe")
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let faster = at(0.01).iter().all(|p| num(p, "sparse_ms") < num(p, "dense_ms"));
    let elems = num(&j, "elems");
    Claim {
        source: "Nexus §IV-C, Fig. 8",
        says: "NMT, several bandwidths: sparse-vector push shortens the push time against the plain push and against LZO or LZMA compression (times only in the figure)".into(),
        value: "none in the text".into(),
        sim: "the wire is modelled at line rate (no simulation)".into(),
        harness: format!(
            "`tidewire-sparse` (`bench/results/sparse-push.json`: CPU parts measured on this machine, the wire modelled), a layer of {:.1} M elements, dense → sparse push: 1% dense {}; 50% dense {} (auto push picks dense there); compression not measured",
            elems / 1e6,
            show(0.01),
            show(0.5)
        ),
        holds: effect(faster),
    }
}

/// §IV-C-2 and §V-A's Fig. 11: quality-guided communication frequency.
fn freq_claim() -> Claim {
    let j = json(FREQ_DIGITS);
    let c = &j["configs"];
    let (g, f) = (&c["guided"], &c["fixed"]);
    let (g_x, g_acc) = (num(g, "exchange_reduction_vs_t1"), num(g, "accuracy_minus_t1_points"));
    let (f_x, f_acc) = (num(f, "exchange_reduction_vs_t1"), num(f, "accuracy_minus_t1_points"));
    Claim {
        source: "Nexus §IV-C, §V-A, Fig. 11",
        says: "quality-guided frequency: lowered the exchange frequency (AlexNet, GoogLeNet, VGG, NIN) without significant quality loss; fixed low frequencies (Freq-15, Freq-20) hurt VGG-Torch on CIFAR-10".into(),
        value: "2× fewer exchanges on average".into(),
        sim: "none: accuracy needs the real training".into(),
        harness: format!(
            "`bench/results/freq-digits/` (4 processes of `examples/torch/digits.py` here, 5 seeds): guided {g_x:.2}× fewer exchanges than T = 1, {g_acc:+.2} points of test accuracy; fixed T = {} {f_x:.0}× fewer, {f_acc:+.2} points",
            f["comm_every"]
        ),
        holds: judge(g_x, 2.0, g_x > 1.0 && g_acc > -0.5 && f_acc < g_acc),
    }
}

/// §V-B's Fig. 12: the dissection of the communication path (350 MB NMT,
/// one server, learners without computation).
fn dissection_claims() -> Vec<Claim> {
    let local = json(NEXUS_LOCAL);
    let rows = local.as_array().expect("rows");
    let cut: Vec<f64> = rows
        .iter()
        .map(|r| 1.0 - num(&r["local"], "iteration_s") / num(&r["flat"], "iteration_s"))
        .collect();
    let mean = cut.iter().sum::<f64>() / cut.len() as f64 * 100.0;
    let (lo, hi) = cut.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &c| {
        (l.min(c * 100.0), h.max(c * 100.0))
    });
    let wire = "needs a 10 GbE NIC, InfiniBand and an RDMA NIC; this machine has loopback and soft-RoCE, whose rates are the CPU's";
    vec![
        Claim {
            source: "Nexus §V-B, Fig. 12",
            says: "TCP with CPU-only aggregation: the clients' network utilization".into(),
            value: "< 45%".into(),
            sim: "none: the simulator's links are ideal".into(),
            harness: no_harness(NO_HW),
            holds: Holds::NotReproduced(wire),
        },
        gpu_aggregation_claim(),
        Claim {
            source: "Nexus §V-B, Fig. 12",
            says: "10 GbE → InfiniBand with TCP (IPoIB): total cost cut by another".into(),
            value: "50% on average".into(),
            sim: "none".into(),
            harness: no_harness(NO_HW),
            holds: Holds::NotReproduced(wire),
        },
        Claim {
            source: "Nexus §V-B, Fig. 12",
            says: "IPoIB → RDMA: cost cut by another; network utilization above".into(),
            value: "30% on average; 75%".into(),
            sim: "none".into(),
            harness: no_harness(NO_HW),
            holds: Holds::NotReproduced(wire),
        },
        Claim {
            source: "Nexus §V-B, Fig. 12",
            says: "local aggregation with the cache: synchronization time improved by another".into(),
            value: "19% on average".into(),
            sim: format!(
                "iteration cut by {mean:.0}% on average ({lo:.0}% to {hi:.0}%) over {} configurations (`bench/results/nexus-local.json`, `tidewire-nexus`: 8 nodes of 2-8 learners against the flat run, VGG19, ResNet-50, GoogLeNet at 10 and 40 GbE)",
                cut.len()
            ),
            harness: no_harness("8 nodes do not fit on 2 cores"),
            holds: judge(mean, 19.0, mean > 0.0 && lo >= -1.0),
        },
    ]
}

/// §V-B's Fig. 12: aggregation on the GPU against the CPU, from
/// `ci/gpu-bench.sh`'s run on the device machine.
fn gpu_aggregation_claim() -> Claim {
    let a = json(GPU_AGGREGATE);
    let gpu = &a["gpu"];
    let (cpu_gbps, gpu_gbps) = (num(&a, "cpu_sum_gbps"), num(gpu, "sum_gbps"));
    let over = gpu_gbps / cpu_gbps;
    // Both rates count the accumulating sum's (P + 2)·N·4 bytes. With the P
    // inputs copied in and the sum copied out at the measured pinned rates:
    let (p, mib) = (num(&a, "inputs"), num(&a, "mib"));
    let input = mib * (1 << 20) as f64 / 1e9; // GB
    let cpu_s = (p + 2.0) * input / cpu_gbps;
    let (h2d, d2h) = (num(gpu, "h2d_gbps"), num(gpu, "d2h_gbps"));
    let gpu_s = p * input / h2d + (p + 2.0) * input / gpu_gbps + input / d2h;
    let with_copies = cpu_s / gpu_s;
    Claim {
            source: "Nexus §V-B, Fig. 12",
            says: "aggregation on the GPU instead of the CPU: aggregation time cut by up to".into(),
            value: "15.9×".into(),
            sim: "none".into(),
            harness: format!(
                "{over:.0}× (`bench/results/h200-16core/aggregate.json`, `ci/gpu-bench.sh` on the device machine: sum of {} inputs of {} MiB, GPU {gpu_gbps:.0} GB/s against {} CPU threads {cpu_gbps:.1} GB/s; data already on each side; with the inputs copied in and the sum out at the pinned rates measured there, {h2d:.0} and {d2h:.0} GB/s: {with_copies:.1}×)",
                a["inputs"],
                a["mib"],
                a["threads"]
            ),
            holds: judge(over, 15.9, over > 1.0),
        }
}
