//! The claims rows of P3 (SysML'19, `p3-sysml19.txt`).

use crate::*;

/// "Maintains the linear throughput": within 2% of the mode's throughput at
/// the top bandwidth, 30 Gbit/s (P3 §5.2 on ResNet-50).
const FLAT: f64 = 0.98;

/// The lowest bandwidth of P3's figure from which `sync` keeps [`FLAT`] of
/// its top-bandwidth throughput at every bandwidth above.
fn flat_from(pts: &[Point], model: &str, sync: &str) -> f64 {
    let top = p3_tp(pts, model, P3_BW[P3_BW.len() - 1], sync);
    let mut from = P3_BW[P3_BW.len() - 1];
    for &bw in P3_BW.iter().rev() {
        if p3_tp(pts, model, bw, sync) < FLAT * top {
            break;
        }
        from = bw;
    }
    from
}

/// P3 over the baseline (`wfbp`) in `tidewire train` under the harness, at
/// each bandwidth it ran `model` at.
fn train_gains(train: &[TrainPoint], model: &str) -> String {
    let tp = |prof: &str, sync: &str| {
        train
            .iter()
            .find(|t| t.model == model && t.profile == prof && t.sync == sync)
            .map(|t| t.train_throughput_samples_s)
    };
    let mut profs: Vec<&str> = train
        .iter()
        .filter(|t| t.model == model)
        .map(|t| t.profile.as_str())
        .collect();
    profs.dedup();
    let gains: Vec<String> = profs
        .iter()
        .filter_map(|p| Some(format!("{:+.0}% at {p}", (tp(p, "p3")? / tp(p, "wfbp")? - 1.0) * 100.0)))
        .collect();
    if gains.is_empty() {
        "not run here (`--train` as root, or `--train-from`)".into()
    } else {
        format!("`train`, 4 ranks, P3 over `wfbp`: {}", gains.join(", "))
    }
}

/// A peak gain of P3 over KVStore: (percent, at Gbit/s).
fn kv_peak(pts: &[Point], m: &str) -> (f64, f64) {
    let (g, bw) = best_over(pts, m, "p3", "kvstore");
    (g * 100.0, bw)
}

/// Every row of P3.
pub(crate) fn p3_claims(pts: &[Point], util: &[Util], train: &[TrainPoint]) -> Vec<Claim> {
    let mut rows = vec![Claim {
        source: "P3 §5.1",
        says: "the set-up: 4 machines of one P4000 each on 100 Gbit/s InfiniBand throttled with tc (§5.2, §5.3); AWS g3.4xlarge at 10 Gbit/s (§5.4); servers as many as workers; throughput averaged over".into(),
        value: "1000 iterations".into(),
        sim: format!(
            "4 nodes, each a worker and a server, `--gpu p4000` (Titan X calibration × FP32 peaks), {}-{} Gbit/s; 2-16 machines at {P3_FIG_BW} Gbit/s; `--iters` iterations per point (the simulator is deterministic)",
            P3_BW[0],
            P3_BW[P3_BW.len() - 1],
        ),
        harness: "`train`: 4 ranks on this machine's 2 cores, tc-shaped veths, 5 iterations".into(),
        holds: Holds::Setting,
    }];
    rows.extend(p3_peak_claims(pts, train));
    rows.extend(p3_resnet_claims(pts, train));
    rows.extend(p3_vgg_claims(pts, train));
    rows.extend(p3_figure_claims(pts, util));
    rows.extend(p3_scaling_claims(pts));
    rows
}

/// The abstract's peaks (also §1.1, §5.2 and §7), one row per model.
fn p3_peak_claims(pts: &[Point], train: &[TrainPoint]) -> Vec<Claim> {
    [
        ("resnet-50", "ResNet-50", 25.0),
        ("sockeye", "Sockeye", 38.0),
        ("vgg19", "VGG-19", 66.0),
    ]
    .into_iter()
    .map(|(m, name, paper)| {
        let (g, bw) = kv_peak(pts, m);
        let (w, wbw) = p3_best(pts, m);
        Claim {
            source: "P3 abstract, §1.1, §5.2, Fig. 7, §7",
            says: format!(
                "{name}, 4 machines: P3's best gain over the baseline (MXNet KVStore) under limited bandwidth"
            ),
            value: format!("+{paper:.0}%"),
            sim: format!(
                "{g:+.0}% at {bw} Gbit/s over `kvstore` (peak over 1-30 Gbit/s); over `wfbp` {:+.0}% at {wbw} Gbit/s",
                w * 100.0
            ),
            harness: if m == "sockeye" {
                no_harness("not among the harness runs")
            } else {
                train_gains(train, m)
            },
            holds: judge(g, paper, g > 0.0),
        }
    })
    .collect()
}

/// §5.2's prose about Fig. 7: ResNet-50 and InceptionV3.
fn p3_resnet_claims(pts: &[Point], train: &[TrainPoint]) -> Vec<Claim> {
    let (kv_flat, p3_flat) = (
        flat_from(pts, "resnet-50", "kvstore"),
        flat_from(pts, "resnet-50", "p3"),
    );
    let r4 = gain_over(pts, "resnet-50", 4.0, "p3", "kvstore") * 100.0;
    let (inc, inc_bw) = kv_peak(pts, "inception-v3");
    let slicing = slicing_little_effect(pts);
    vec![
        Claim {
            source: "P3 §5.2, Fig. 7(a)",
            says: "ResNet-50: the baseline's throughput drops below; P3 stays linear down to".into(),
            value: "6 Gbit/s; 4 Gbit/s".into(),
            sim: format!(
                "within 2% of 30 Gbit/s's throughput from: `kvstore` {kv_flat} Gbit/s, `p3` {p3_flat} Gbit/s; \
                 samples/s at 5 and 4 Gbit/s: `kvstore` {:.0}, {:.0}; `p3` {:.0}, {:.0}",
                p3_tp(pts, "resnet-50", 5.0, "kvstore"),
                p3_tp(pts, "resnet-50", 4.0, "kvstore"),
                p3_tp(pts, "resnet-50", 5.0, "p3"),
                p3_tp(pts, "resnet-50", 4.0, "p3")
            ),
            harness: train_gains(train, "resnet-50"),
            holds: effect(p3_flat < kv_flat),
        },
        Claim {
            source: "P3 §5.2, Fig. 7(a)",
            says: "ResNet-50 at 4 Gbit/s: P3 over the baseline".into(),
            value: "+26%".into(),
            sim: format!(
                "{r4:+.0}% over `kvstore`, {:+.0}% over `wfbp`",
                p3_gain(pts, "resnet-50", 4.0) * 100.0
            ),
            harness: train_gains(train, "resnet-50"),
            holds: judge(r4, 26.0, r4 > 0.0),
        },
        Claim {
            source: "P3 §5.2, Fig. 7(b)",
            says: "InceptionV3: P3's best gain over the baseline".into(),
            value: "+18%".into(),
            sim: format!("{inc:+.0}% at {inc_bw} Gbit/s over `kvstore` (peak over 1-30 Gbit/s)"),
            harness: no_harness("not among the harness runs"),
            holds: judge(inc, 18.0, inc > 0.0),
        },
        Claim {
            source: "P3 §5.2, Fig. 7(a)-(b)",
            says: "ResNet-50 and InceptionV3 do not benefit from parameter slicing".into(),
            value: "no gain".into(),
            sim: slicing.evidence,
            harness: no_harness("not among the harness runs"),
            holds: effect(slicing.holds),
        },
    ]
}

/// §5.2's prose about Fig. 7: VGG-19, and every model.
fn p3_vgg_claims(pts: &[Point], train: &[TrainPoint]) -> Vec<Claim> {
    let s30 = gain_over(pts, "vgg19", 30.0, "sliced", "kvstore") * 100.0;
    let v15 = gain_over(pts, "vgg19", 15.0, "p3", "kvstore") * 100.0;
    vec![
        Claim {
            source: "P3 §5.2, Fig. 7(c)",
            says: "VGG-19 at 30 Gbit/s: slicing alone over the baseline".into(),
            value: "+49%".into(),
            sim: format!("{s30:+.0}% (`sliced` over `kvstore`): our 4 nodes are compute-bound at 30 Gbit/s"),
            harness: no_harness("30 Gbit/s is beyond the shaped veths on 2 cores"),
            holds: judge(s30, 49.0, s30 > 1.0),
        },
        Claim {
            source: "P3 §5.2, Fig. 7(c)",
            says: "VGG-19 at 15 Gbit/s: P3 over the baseline".into(),
            value: "+66%".into(),
            sim: format!(
                "{v15:+.0}% over `kvstore`, {:+.0}% over `wfbp`",
                p3_gain(pts, "vgg19", 15.0) * 100.0
            ),
            harness: no_harness("15 Gbit/s is beyond the shaped veths on 2 cores"),
            holds: judge(v15, 66.0, v15 > 0.0),
        },
        large_layers_slicing_claim(pts),
        always_better_claim(pts, train),
        low_bandwidth_claim(pts),
    ]
}

/// §5.2: the models with very large layers (VGG-19, Sockeye) gain from
/// slicing alone. Once kvstore sends a big array's parts to every server
/// at once and answers every pull at once, as MXNet does, whole parts cost
/// VGG-19 on 4 machines nothing on the simulator's fair network: in the
/// colocated all-to-all both directions of every link are busy while the
/// parts go in and while they come back (`docs/src/papers.md` has the
/// dissection). Sockeye, whose heaviest layer is needed first, still gains.
pub(crate) fn large_layers_slicing_claim(pts: &[Point]) -> Claim {
    let (gv, bv) = best_over(pts, "vgg19", "sliced", "kvstore");
    let (gs, bs) = best_over(pts, "sockeye", "sliced", "kvstore");
    Claim {
        source: "P3 §5.2, Fig. 7(c)-(d)",
        says:
            "VGG-19 and Sockeye (very large layers): slicing alone gives a considerable improvement over the baseline"
                .into(),
        value: "no number (+49% at 30 Gbit/s on VGG-19)".into(),
        sim: format!(
            "best of `sliced` over `kvstore`: vgg19 {:+.1}% at {bv} Gbit/s, sockeye {:+.1}% at {bs} Gbit/s \
             (on a fair network, with MXNet's parts and answers all sent at once, VGG-19's whole parts cost it nothing)",
            gv * 100.0,
            gs * 100.0
        ),
        harness: no_harness("not among the harness runs"),
        holds: effect(gv >= 0.01 && gs >= 0.01),
    }
}

/// P3 §5.2: P3 always performs better than the baseline.
fn always_better_claim(pts: &[Point], train: &[TrainPoint]) -> Claim {
    let (never, never_at) = least(|m, bw| p3_tp(pts, m, bw, "p3") / p3_tp(pts, m, bw, "kvstore"));
    Claim {
        source: "P3 §5.2, Fig. 7",
        says: "P3 always performs better than the baseline".into(),
        value: "no number".into(),
        sim: format!(
            "least P3 / `kvstore` over the {} points: {never:.3} ({never_at})",
            P3_MODELS.len() * P3_BW.len()
        ),
        harness: train_gains(train, "vgg19"),
        holds: effect(never >= 0.99),
    }
}

/// P3 §5.2: its benefits diminish where the bandwidth is lowest.
fn low_bandwidth_claim(pts: &[Point]) -> Claim {
    // Each model's gain at the lowest bandwidth, against its peak.
    let low_at = |m: &str| (gain_over(pts, m, P3_BW[0], "p3", "kvstore") * 100.0, kv_peak(pts, m).0);
    let low: Vec<String> = P3_MODELS
        .iter()
        .map(|&m| {
            let (l, p) = low_at(m);
            format!("{m} {l:+.0}% (peak {p:+.0}%)")
        })
        .collect();
    let low_ok = P3_MODELS.iter().all(|&m| {
        let (l, p) = low_at(m);
        l < p - 1.0
    });
    Claim {
        source: "P3 §5.2, Fig. 7",
        says: "P3's benefits diminish where the bandwidth is lowest (little room to overlap)".into(),
        value: "no number".into(),
        sim: format!(
            "P3 over `kvstore` at {} Gbit/s against its peak: {}",
            P3_BW[0],
            low.join(", ")
        ),
        harness: no_harness("1 Gbit/s runs of the four models not among the harness runs"),
        holds: effect(low_ok),
    }
}

/// §3's layer share, §5.3, §5.5 and §5.6 (Figs. 8, 9, 11 and 12).
fn p3_figure_claims(pts: &[Point], util: &[Util]) -> Vec<Claim> {
    let vgg = tidewire::engine::models::profile("vgg19").expect("a built-in model");
    let top = vgg.layers.iter().map(|l| l.params()).max().unwrap_or(0) as f64 / vgg.params() as f64;
    let link = link_use_effect(pts, util);
    let slices = slice_size_effect(pts);
    vec![
        Claim {
            source: "P3 §3, Fig. 5(c)",
            says: "VGG-19: share of all parameters in its one largest (fully connected) layer".into(),
            value: "71.5%".into(),
            sim: format!("{:.1}% (fc6, `engine/src/models.rs`)", top * 100.0),
            harness: "the same profile".into(),
            holds: judge(top, 0.715, true),
        },
        Claim {
            source: "P3 §5.3, Figs. 8, 9",
            says: "ResNet-50 at 4 Gbit/s, VGG-19 at 15, Sockeye at 4: the baseline's link bursty with idle gaps, P3's busier (shares only in the figures)".into(),
            value: "none in the text".into(),
            sim: link.evidence,
            harness: no_harness("the link traces are simulated"),
            holds: effect(link.holds),
        },
        Claim {
            source: "P3 §5.5, Fig. 11",
            says: "ResNet-110 on CIFAR-10, 4 machines, 160 epochs, 5 settings: average accuracy drop of DGC (P3: none)".into(),
            value: "0.004".into(),
            sim: "none".into(),
            harness: no_harness("the real training"),
            holds: Holds::NotReproduced("needs Deep Gradient Compression (not a Tidewire mode) and the real training; P3 here changes only the order of the bytes, never their values"),
        },
        Claim {
            source: "P3 §5.6, Fig. 12",
            says: "ResNet-50 and VGG-19: throughput peaks at a slice size of (parameters)".into(),
            value: "50,000".into(),
            sim: slices.evidence,
            harness: no_harness("the sweep is simulated"),
            holds: effect(slices.holds),
        },
    ]
}

/// §5.4's scalability (Fig. 10) at 10 Gbit/s.
fn p3_scaling_claims(pts: &[Point]) -> Vec<Claim> {
    let kv8 = |m: &str| {
        (find(pts, "p3-scaling", m, 8, P3_FIG_BW, "p3").throughput_samples_s
            / find(pts, "p3-scaling", m, 8, P3_FIG_BW, "kvstore").throughput_samples_s
            - 1.0)
            * 100.0
    };
    let r50 = P3_SCALE_NODES
        .iter()
        .map(|&n| {
            (find(pts, "p3-scaling", "resnet-50", n, P3_FIG_BW, "p3").throughput_samples_s
                / find(pts, "p3-scaling", "resnet-50", n, P3_FIG_BW, "kvstore").throughput_samples_s
                - 1.0)
                .abs()
        })
        .fold(0.0, f64::max);
    let (v8, s8) = (kv8("vgg19"), kv8("sockeye"));
    let machines = "2-16 machines do not fit on 2 cores";
    vec![
        Claim {
            source: "P3 §5.4, Fig. 10(a)",
            says: "ResNet-50, 2-16 machines, 10 Gbit/s: baseline and P3 perform similarly".into(),
            value: "no number".into(),
            sim: format!("P3 and `kvstore` at most {:.1}% apart", r50 * 100.0),
            harness: no_harness(machines),
            holds: effect(r50 <= 0.03),
        },
        Claim {
            source: "P3 §5.4, Fig. 10(b)",
            says: "VGG-19, 8 machines, 10 Gbit/s: P3 over the baseline".into(),
            value: "+61%".into(),
            sim: format!(
                "{v8:+.0}% over `kvstore`, {:+.0}% over `wfbp`",
                p3_scale_gain(pts, "vgg19", 8) * 100.0
            ),
            harness: no_harness(machines),
            holds: judge(v8, 61.0, v8 > 0.0),
        },
        Claim {
            source: "P3 §5.4, Fig. 10(c)",
            says: "Sockeye, 8 machines, 10 Gbit/s: P3 over the baseline".into(),
            value: "+18%".into(),
            sim: format!(
                "{s8:+.0}% over `kvstore`, {:+.0}% over `wfbp`",
                p3_scale_gain(pts, "sockeye", 8) * 100.0
            ),
            harness: no_harness(machines),
            holds: judge(s8, 18.0, s8 > 0.0),
        },
    ]
}
