//! Model profiles: per-layer shapes taken from the architectures, with forward
//! FLOPs per sample, and a compute-time model calibrated to the single-GPU
//! throughputs the Poseidon paper reports for a Titan X.
//!
//! Conventions:
//! - A convolution's weight is M×N with M output channels and N = input
//!   channels × kernel area; an FC weight is outputs × inputs.
//! - Biases are left out (under 0.1% of the parameters; Sockeye's 26,654
//!   biases are 0.096% of its 27.73M). Networks built with batch norm
//!   (ResNets, Inception-V3) carry one `Other` layer per norm with its scale
//!   and shift (2×C).
//! - Auxiliary classifiers are left out (Inception-V3's AuxLogits head is
//!   3,326,696 of torchvision's 27,161,264 parameters; the 23,833,568 here
//!   are the rest less the fc's 1,000 biases).
//! - FLOPs count a multiply-add as 2.
//!
//! # Sockeye (P3's NMT model)
//!
//! `sockeye` is the RNN sequence-to-sequence model P3 (SysML'19) trained,
//! built from the Sockeye 1.5.1 code and command line in P3's artifact
//! (github.com/anandj91/p3, `example/sockeye/`: `source/sockeye/*.py` and
//! `scripts/sockeye_1.5-iwslt15_en-vi.sh`; the same flags are in
//! ctuning/reproduce-sysml19-paper-p3 `program/sysml19-p3/ck_run_sockeye.sh`):
//! `--encoder rnn --decoder rnn --num-layers 2:2 --rnn-cell-type lstm
//! --rnn-num-hidden 512 --num-embed 512:512 --attention-type mlp
//! --attention-num-hidden 512 --batch-size 32 --bucket-width 10` on IWSLT'15
//! English→Vietnamese. Per Sockeye 1.5's `encoder.py`, `decoder.py`,
//! `attention.py` and `rnn.py`, one layer per MXNet weight (so one key in
//! P3's KVStore), in forward order:
//!
//! | layer (MXNet name, `_weight` dropped) | shape | per sentence, forward |
//! |---|---|---|
//! | `source_embed` | 17,192 × 512 | a gather: no multiply-adds |
//! | `encoder_birnn_{forward,reverse}_l0_i2h` / `_h2h` | 1024 × 512 / 1024 × 256 | S steps |
//! | `encoder_rnn_l0_i2h` / `_h2h` | 2048 × 512 / 2048 × 512 | S steps |
//! | `decoder_enc2decinit_{0..3}` | 512 × 512 | once |
//! | `att_e2h` | 512 × 512 | S positions |
//! | `target_embed` | 7,710 × 512 | a gather |
//! | `decoder_l0_i2h` / `_h2h` | 2048 × 1024 / 2048 × 512 | T steps (input: embedding ‖ previous hidden) |
//! | `decoder_l1_i2h` / `_h2h` | 2048 × 512 / 2048 × 512 | T steps |
//! | `att_q2h` | 512 × 512 | T steps |
//! | `att_h2s` | 1 × 512 | S·T pairs (with the context's weighted sum, 2·512 more per pair) |
//! | `decoder_hidden` | 512 × 1024 | T steps |
//! | `decoder_cls` | 7,710 × 512 | T steps |
//!
//! 27,707,904 weights (27,734,558 with its biases, which are left out). FLOPs are the
//! matrix products only (gate nonlinearities, softmax and the tanh are left
//! out) at S = T = [`SOCKEYE_SEQ_LEN`] tokens, the mean padded bucket length:
//! about 0.77 GFLOP forward per sentence.
//!
//! Every Sockeye layer is [`LayerKind::Other`]: an RNN or sequence-FC weight's
//! gradient sums outer products over batch × time steps, so its rank is
//! K·T, not the K Poseidon's SFB cost assumes. The embeddings are dense
//! (`sparse: false`): Sockeye 1.5 calls `mx.sym.Embedding` without
//! `sparse_grad`, so MXNet computes a dense vocabulary × 512 gradient and
//! P3 pushes and slices it as any other key.
//!
//! # Calibration
//!
//! The compute of every model is calibrated on a Titan X: the four models
//! with a Poseidon throughput ([`Model::paper_img_s`]) to that throughput,
//! the others (ResNets, AlexNet, VGG19-mini, Sockeye) to
//! [`reference_flop_rate`], the mean effective FLOP rate of those four.
//! Neither Poseidon nor P3 gives a single-GPU Sockeye throughput, so
//! Sockeye's compute is that mean rate applied to its FLOPs, an estimate
//! (RNNs' small matrix products usually run below the CNNs' rate).
//! [`Calibration::P4000`] (`tidewire sim --gpu p4000`) models P3's GPUs
//! (Quadro P4000, one per machine: from a secondary summary of P3's
//! evaluation; the paper's own text is not verified here) by
//! scaling those rates by the ratio of FP32 peaks, P4000 / Titan X
//! ([`P4000_PEAK_FP32`] / [`TITAN_X_PEAK_FP32`] ≈ 0.803): P3 reports no
//! single-GPU throughputs to calibrate to.
//!
//! ```
//! let vgg = tidewire_engine::models::profile("vgg19").unwrap();
//! assert_eq!(vgg.layers.iter().filter(|l| l.name == "fc6").count(), 1);
//! assert!((vgg.params() as f64 - 143.6e6).abs() < 0.5e6);
//! ```

use std::time::Duration;

use crate::book::{LayerKind, LayerSpec};

/// A model profile.
#[derive(Debug, Clone)]
pub struct Model {
    /// Canonical name.
    pub name: &'static str,
    /// Layers in forward order.
    pub layers: Vec<LayerSpec>,
    /// The batch size the paper used on one GPU.
    pub batch: usize,
    /// Images per second on one Titan X, from the Poseidon paper, where it reports one.
    pub paper_img_s: Option<f64>,
    /// The GPU the compute model stands for (default: the Titan X).
    pub gpu: Calibration,
}

/// Peak FP32 FLOP/s of the GeForce GTX Titan X (Maxwell, GM200) the Poseidon
/// calibration stands for: 2 × 3072 CUDA cores × 1075 MHz boost clock, the
/// cores and clock of NVIDIA's GTX Titan X specifications (NVIDIA markets it
/// as "7 TFLOPS"). Which Titan X Poseidon ran (Maxwell 2015, or the Pascal
/// Titan X of 2016: 2 × 3584 × 1531 MHz = 10.97 TFLOPS) is not verified.
pub const TITAN_X_PEAK_FP32: f64 = 2.0 * 3072.0 * 1.075e9;

/// Peak FP32 FLOP/s of the NVIDIA Quadro P4000 (Pascal, GP104), P3's GPU:
/// 2 × 1792 CUDA cores × 1480 MHz boost clock = 5.30 TFLOPS, the "5.3 TFLOPS"
/// of NVIDIA's Quadro P4000 data sheet (seen here through third-party spec
/// databases, not the data sheet itself).
pub const P4000_PEAK_FP32: f64 = 2.0 * 1792.0 * 1.480e9;

/// The GPU whose compute a model's times stand for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Calibration {
    /// Poseidon's Titan X: the single-GPU throughputs the Poseidon paper reports.
    #[default]
    TitanX,
    /// P3's Quadro P4000: the Titan X rates × [`P4000_PEAK_FP32`] / [`TITAN_X_PEAK_FP32`].
    P4000,
}

impl Calibration {
    /// Names `parse` accepts.
    pub const NAMES: &'static [&'static str] = &["titan-x", "p4000"];

    /// `titan-x` (or `titanx`) or `p4000` (case-insensitive; `_` and `-` are the same).
    pub fn parse(s: &str) -> Option<Self> {
        let c = match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "titan-x" | "titanx" => Some(Calibration::TitanX),
            "p4000" | "quadro-p4000" => Some(Calibration::P4000),
            _ => None,
        };
        debug_assert!(
            c.map_or(true, |c| Self::NAMES.contains(&c.name())),
            "its name is listed"
        );
        c
    }

    /// Its name, as `parse` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Calibration::TitanX => "titan-x",
            Calibration::P4000 => "p4000",
        }
    }

    /// Peak FP32 FLOP/s from the spec sheet.
    pub fn peak_fp32(self) -> f64 {
        match self {
            Calibration::TitanX => TITAN_X_PEAK_FP32,
            Calibration::P4000 => P4000_PEAK_FP32,
        }
    }

    /// The factor on the Titan X calibration's FLOP rates: the ratio of FP32 peaks.
    pub fn rate_factor(self) -> f64 {
        let f = self.peak_fp32() / TITAN_X_PEAK_FP32;
        debug_assert!(
            f > 0.0 && f <= 1.0,
            "{self:?}: the Titan X is the fastest calibrated GPU"
        );
        f
    }
}

/// Names `profile` accepts.
pub const NAMES: &[&str] = &[
    "vgg19",
    "vgg19-22k",
    "googlenet",
    "inception-v3",
    "resnet-50",
    "resnet-152",
    "alexnet",
    "vgg19-mini",
    "sockeye",
];

impl Model {
    /// Total parameters.
    pub fn params(&self) -> usize {
        self.layers.iter().map(LayerSpec::params).sum()
    }

    /// Forward FLOPs per sample.
    pub fn flops(&self) -> f64 {
        self.layers.iter().map(|l| l.flops).sum()
    }

    /// This profile with its compute calibrated to `gpu`.
    ///
    /// ```
    /// use tidewire_engine::models::{profile, Calibration};
    /// let titan = profile("vgg19").unwrap();
    /// let p4000 = titan.clone().on(Calibration::P4000);
    /// let r = p4000.calibrated_flop_rate() / titan.calibrated_flop_rate();
    /// assert!((r - Calibration::P4000.rate_factor()).abs() < 1e-12);
    /// ```
    pub fn on(mut self, gpu: Calibration) -> Self {
        self.gpu = gpu;
        self
    }

    /// Effective FLOP/s of forward + backward (3× forward) on the calibration GPU.
    pub fn calibrated_flop_rate(&self) -> f64 {
        let titan_x = match self.paper_img_s {
            Some(img_s) => 3.0 * self.flops() * img_s,
            None => reference_flop_rate(),
        };
        let rate = titan_x * self.gpu.rate_factor();
        // Compute times divide by it.
        debug_assert!(rate.is_finite() && rate > 0.0, "{}: {rate} FLOP/s", self.name);
        rate
    }

    /// One iteration's compute (forward + backward) at batch `k`, times `time_scale`.
    pub fn iteration_compute(&self, k: usize, time_scale: f64) -> Duration {
        Duration::from_secs_f64(3.0 * self.flops() * k as f64 / self.calibrated_flop_rate() * time_scale)
    }

    /// Forward and backward time of each layer at batch `k`: backward is twice forward.
    pub fn layer_times(&self, k: usize, time_scale: f64) -> Vec<(Duration, Duration)> {
        let rate = self.calibrated_flop_rate();
        self.layers
            .iter()
            .map(|l| {
                let f = l.flops * k as f64 / rate * time_scale;
                (Duration::from_secs_f64(f), Duration::from_secs_f64(2.0 * f))
            })
            .collect()
    }
}

/// The mean effective FLOP/s, on the Titan X, of the four models the paper
/// calibrates; used for models the paper gives no throughput for (ResNets,
/// AlexNet, VGG19-mini, Sockeye).
pub fn reference_flop_rate() -> f64 {
    let rates: Vec<f64> = ["vgg19", "vgg19-22k", "googlenet", "inception-v3"]
        .iter()
        .map(|n| profile(n).expect("built in").calibrated_flop_rate())
        .collect();
    debug_assert!(rates.iter().all(|r| r.is_finite() && *r > 0.0));
    rates.iter().sum::<f64>() / rates.len() as f64
}

/// A profile by name (case-insensitive; `_` and `-` are the same).
pub fn profile(name: &str) -> Option<Model> {
    let n = name.to_ascii_lowercase().replace('_', "-");
    let m = match n.as_str() {
        "vgg19" | "vgg-19" => vgg19(1000),
        "vgg19-mini" | "vgg-19-mini" => vgg19_mini(),
        "vgg19-22k" | "vgg-19-22k" => vgg19(21841),
        "googlenet" | "inception-v1" => googlenet(),
        "inception-v3" | "inceptionv3" => inception_v3(),
        "resnet-50" | "resnet50" => resnet(&[3, 4, 6, 3], "resnet-50"),
        "resnet-152" | "resnet152" => resnet(&[3, 8, 36, 3], "resnet-152"),
        "alexnet" => alexnet(),
        "sockeye" => sockeye(),
        _ => return None,
    };
    debug_assert!(NAMES.contains(&m.name), "{} is listed", m.name);
    // A book takes it: layers with parameters and FLOPs, named once each.
    debug_assert!(m
        .layers
        .iter()
        .all(|l| l.params() > 0 && l.flops.is_finite() && l.flops >= 0.0));
    debug_assert_eq!(
        m.layers
            .iter()
            .map(|l| l.name.as_str())
            .collect::<std::collections::HashSet<_>>()
            .len(),
        m.layers.len(),
        "{}: a layer name twice",
        m.name
    );
    Some(m)
}

struct Builder(Vec<LayerSpec>);

impl Builder {
    fn conv(&mut self, name: String, out: usize, inp: usize, kh: usize, kw: usize, hw: usize) {
        debug_assert!(out * inp * kh * kw * hw > 0, "{name}");
        let mut l = LayerSpec::new(name, LayerKind::Conv, out, inp * kh * kw);
        l.flops = 2.0 * (out * inp * kh * kw * hw * hw) as f64;
        self.0.push(l);
    }
    fn conv_bn(&mut self, name: String, out: usize, inp: usize, kh: usize, kw: usize, hw: usize) {
        self.conv(name.clone(), out, inp, kh, kw, hw);
        let mut bn = LayerSpec::new(format!("{name}.bn"), LayerKind::Other, 2, out);
        debug_assert_eq!(
            self.0.last().map(|l| l.m),
            Some(out),
            "a norm of the convolution's channels"
        );
        bn.flops = 4.0 * (out * hw * hw) as f64;
        self.0.push(bn);
    }
    fn fc(&mut self, name: &str, out: usize, inp: usize) {
        debug_assert!(out * inp > 0, "{name}");
        let mut l = LayerSpec::new(name, LayerKind::Fc, out, inp);
        l.flops = 2.0 * (out * inp) as f64;
        self.0.push(l);
    }
    /// A sequence model's M×N weight applied `times` times per sample (2·M·N
    /// FLOPs each): `Other`, since its gradient sums outer products over
    /// batch × steps, not the batch alone SFB assumes.
    fn seq(&mut self, name: String, m: usize, n: usize, times: f64) {
        debug_assert!(m * n > 0 && times >= 0.0, "{name}");
        let mut l = LayerSpec::new(name, LayerKind::Other, m, n);
        l.flops = 2.0 * (m * n) as f64 * times;
        self.0.push(l);
    }
    /// An LSTM layer (MXNet's LSTMCell) of `hid` units reading `inp` wide
    /// inputs for `steps` steps: i2h (4·hid × inp) and h2h (4·hid × hid).
    fn lstm(&mut self, prefix: &str, hid: usize, inp: usize, steps: f64) {
        debug_assert!(hid > 0 && inp > 0, "{prefix}");
        self.seq(format!("{prefix}_i2h"), 4 * hid, inp, steps);
        self.seq(format!("{prefix}_h2h"), 4 * hid, hid, steps);
    }
}

fn vgg19(classes: usize) -> Model {
    let mut b = Builder(Vec::new());
    let (mut inp, mut hw) = (3, 224);
    for (block, (width, convs)) in [(64, 2), (128, 2), (256, 4), (512, 4), (512, 4)]
        .into_iter()
        .enumerate()
    {
        for i in 0..convs {
            b.conv(format!("conv{}_{}", block + 1, i + 1), width, inp, 3, 3, hw);
            inp = width;
        }
        hw /= 2;
    }
    // Five poolings halve 224 to the 7×7 map fc6 reads.
    debug_assert_eq!((inp, hw), (512, 7));
    b.fc("fc6", 4096, 512 * 7 * 7);
    b.fc("fc7", 4096, 4096);
    b.fc("fc8", classes, 4096);
    let (name, img_s) = if classes == 1000 {
        ("vgg19", 35.5)
    } else {
        ("vgg19-22k", 34.2)
    };
    Model {
        name,
        layers: b.0,
        batch: 32,
        paper_img_s: Some(img_s),
        gpu: Calibration::TitanX,
    }
}

/// VGG19's shape at an eighth of its width (about 2.1M parameters): the
/// same 19 layers, a convolution tail and three FC layers, for runs that
/// must be small (the soft-RoCE VM, quick tests). Its compute model is the
/// reference rate.
fn vgg19_mini() -> Model {
    let mut b = Builder(Vec::new());
    let (mut inp, mut hw) = (3, 224);
    for (block, (width, convs)) in [(8, 2), (16, 2), (32, 4), (64, 4), (64, 4)].into_iter().enumerate() {
        for i in 0..convs {
            b.conv(format!("conv{}_{}", block + 1, i + 1), width, inp, 3, 3, hw);
            inp = width;
        }
        hw /= 2;
    }
    debug_assert_eq!((inp, hw), (64, 7));
    b.fc("fc6", 512, 64 * 7 * 7);
    b.fc("fc7", 512, 512);
    b.fc("fc8", 125, 512);
    debug_assert_eq!(b.0.len(), 19, "VGG19's 19 layers");
    Model {
        name: "vgg19-mini",
        layers: b.0,
        batch: 32,
        paper_img_s: None,
        gpu: Calibration::TitanX,
    }
}

fn alexnet() -> Model {
    let mut b = Builder(Vec::new());
    b.conv("conv1".into(), 64, 3, 11, 11, 55);
    b.conv("conv2".into(), 192, 64, 5, 5, 27);
    b.conv("conv3".into(), 384, 192, 3, 3, 13);
    b.conv("conv4".into(), 256, 384, 3, 3, 13);
    b.conv("conv5".into(), 256, 256, 3, 3, 13);
    debug_assert_eq!(b.0.last().map(|l| l.m), Some(256), "fc6 reads conv5's 256 channels");
    b.fc("fc6", 4096, 256 * 6 * 6);
    b.fc("fc7", 4096, 4096);
    b.fc("fc8", 1000, 4096);
    Model {
        name: "alexnet",
        layers: b.0,
        batch: 256,
        paper_img_s: None,
        gpu: Calibration::TitanX,
    }
}

fn googlenet() -> Model {
    let mut b = Builder(Vec::new());
    b.conv("conv1".into(), 64, 3, 7, 7, 112);
    b.conv("conv2_reduce".into(), 64, 64, 1, 1, 56);
    b.conv("conv2".into(), 192, 64, 3, 3, 56);
    // (name, in, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj, spatial)
    let modules = [
        ("3a", 192, 64, 96, 128, 16, 32, 32, 28),
        ("3b", 256, 128, 128, 192, 32, 96, 64, 28),
        ("4a", 480, 192, 96, 208, 16, 48, 64, 14),
        ("4b", 512, 160, 112, 224, 24, 64, 64, 14),
        ("4c", 512, 128, 128, 256, 24, 64, 64, 14),
        ("4d", 512, 112, 144, 288, 32, 64, 64, 14),
        ("4e", 528, 256, 160, 320, 32, 128, 128, 14),
        ("5a", 832, 256, 160, 320, 32, 128, 128, 7),
        ("5b", 832, 384, 192, 384, 48, 128, 128, 7),
    ];
    // Each module reads what the one before concatenated (conv2's 192 first).
    let mut channels = 192;
    for (m, inp, c1, c3r, c3, c5r, c5, pp, hw) in modules {
        debug_assert_eq!(inp, channels, "inception_{m}");
        channels = c1 + c3 + c5 + pp;
        b.conv(format!("inception_{m}.1x1"), c1, inp, 1, 1, hw);
        b.conv(format!("inception_{m}.3x3_reduce"), c3r, inp, 1, 1, hw);
        b.conv(format!("inception_{m}.3x3"), c3, c3r, 3, 3, hw);
        b.conv(format!("inception_{m}.5x5_reduce"), c5r, inp, 1, 1, hw);
        b.conv(format!("inception_{m}.5x5"), c5, c5r, 5, 5, hw);
        b.conv(format!("inception_{m}.pool_proj"), pp, inp, 1, 1, hw);
    }
    debug_assert_eq!(channels, 1024, "the fc reads inception_5b's output");
    b.fc("fc", 1000, 1024);
    Model {
        name: "googlenet",
        layers: b.0,
        batch: 128,
        paper_img_s: Some(257.0),
        gpu: Calibration::TitanX,
    }
}

fn resnet(blocks: &[usize; 4], name: &'static str) -> Model {
    let mut b = Builder(Vec::new());
    b.conv_bn("conv1".into(), 64, 3, 7, 7, 112);
    let mut inp = 64;
    for (stage, (&n, (width, hw))) in blocks
        .iter()
        .zip([(64, 56), (128, 28), (256, 14), (512, 7)])
        .enumerate()
    {
        for i in 0..n {
            let p = format!("layer{}.{}", stage + 1, i);
            let hw_in = if i == 0 && stage > 0 { hw * 2 } else { hw };
            b.conv_bn(format!("{p}.conv1"), width, inp, 1, 1, hw_in);
            b.conv_bn(format!("{p}.conv2"), width, width, 3, 3, hw);
            b.conv_bn(format!("{p}.conv3"), 4 * width, width, 1, 1, hw);
            if i == 0 {
                b.conv_bn(format!("{p}.downsample"), 4 * width, inp, 1, 1, hw);
            }
            inp = 4 * width;
        }
    }
    debug_assert_eq!(inp, 2048, "the fc reads the last stage's output");
    b.fc("fc", 1000, 2048);
    Model {
        name,
        layers: b.0,
        batch: 32,
        paper_img_s: None,
        gpu: Calibration::TitanX,
    }
}

fn inception_v3() -> Model {
    let mut b = Builder(Vec::new());
    b.conv_bn("Conv2d_1a_3x3".into(), 32, 3, 3, 3, 149);
    b.conv_bn("Conv2d_2a_3x3".into(), 32, 32, 3, 3, 147);
    b.conv_bn("Conv2d_2b_3x3".into(), 64, 32, 3, 3, 147);
    b.conv_bn("Conv2d_3b_1x1".into(), 80, 64, 1, 1, 73);
    b.conv_bn("Conv2d_4a_3x3".into(), 192, 80, 3, 3, 71);
    let mut channels = 192;
    for (m, inp, pf) in [("Mixed_5b", 192, 32), ("Mixed_5c", 256, 64), ("Mixed_5d", 288, 64)] {
        let hw = 35;
        // Each block reads what the one before concatenated: 1x1, 5x5, 3x3dbl, pool.
        debug_assert_eq!(inp, channels, "{m}");
        channels = 64 + 64 + 96 + pf;
        b.conv_bn(format!("{m}.branch1x1"), 64, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch5x5_1"), 48, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch5x5_2"), 64, 48, 5, 5, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_1"), 64, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_2"), 96, 64, 3, 3, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_3"), 96, 96, 3, 3, hw);
        b.conv_bn(format!("{m}.branch_pool"), pf, inp, 1, 1, hw);
    }
    debug_assert_eq!(channels, 288, "Mixed_6a reads Mixed_5d");
    b.conv_bn("Mixed_6a.branch3x3".into(), 384, 288, 3, 3, 17);
    b.conv_bn("Mixed_6a.branch3x3dbl_1".into(), 64, 288, 1, 1, 35);
    b.conv_bn("Mixed_6a.branch3x3dbl_2".into(), 96, 64, 3, 3, 35);
    b.conv_bn("Mixed_6a.branch3x3dbl_3".into(), 96, 96, 3, 3, 17);
    for (m, c7) in [
        ("Mixed_6b", 128),
        ("Mixed_6c", 160),
        ("Mixed_6d", 160),
        ("Mixed_6e", 192),
    ] {
        let (inp, hw) = (768, 17);
        b.conv_bn(format!("{m}.branch1x1"), 192, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch7x7_1"), c7, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch7x7_2"), c7, c7, 1, 7, hw);
        b.conv_bn(format!("{m}.branch7x7_3"), 192, c7, 7, 1, hw);
        b.conv_bn(format!("{m}.branch7x7dbl_1"), c7, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch7x7dbl_2"), c7, c7, 7, 1, hw);
        b.conv_bn(format!("{m}.branch7x7dbl_3"), c7, c7, 1, 7, hw);
        b.conv_bn(format!("{m}.branch7x7dbl_4"), c7, c7, 7, 1, hw);
        b.conv_bn(format!("{m}.branch7x7dbl_5"), 192, c7, 1, 7, hw);
        b.conv_bn(format!("{m}.branch_pool"), 192, inp, 1, 1, hw);
    }
    b.conv_bn("Mixed_7a.branch3x3_1".into(), 192, 768, 1, 1, 17);
    b.conv_bn("Mixed_7a.branch3x3_2".into(), 320, 192, 3, 3, 8);
    b.conv_bn("Mixed_7a.branch7x7x3_1".into(), 192, 768, 1, 1, 17);
    b.conv_bn("Mixed_7a.branch7x7x3_2".into(), 192, 192, 1, 7, 17);
    b.conv_bn("Mixed_7a.branch7x7x3_3".into(), 192, 192, 7, 1, 17);
    b.conv_bn("Mixed_7a.branch7x7x3_4".into(), 192, 192, 3, 3, 8);
    // Mixed_7a concatenates 320, 192 and the 768 it pooled.
    let mut channels = 320 + 192 + 768;
    for (m, inp) in [("Mixed_7b", 1280), ("Mixed_7c", 2048)] {
        let hw = 8;
        debug_assert_eq!(inp, channels, "{m}");
        channels = 320 + 2 * 384 + 2 * 384 + 192;
        b.conv_bn(format!("{m}.branch1x1"), 320, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch3x3_1"), 384, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch3x3_2a"), 384, 384, 1, 3, hw);
        b.conv_bn(format!("{m}.branch3x3_2b"), 384, 384, 3, 1, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_1"), 448, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_2"), 384, 448, 3, 3, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_3a"), 384, 384, 1, 3, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_3b"), 384, 384, 3, 1, hw);
        b.conv_bn(format!("{m}.branch_pool"), 192, inp, 1, 1, hw);
    }
    debug_assert_eq!(channels, 2048, "the fc reads Mixed_7c");
    b.fc("fc", 1000, 2048);
    debug_assert_eq!(
        b.0.iter().map(LayerSpec::params).sum::<usize>(),
        23_833_568,
        "see the module docs"
    );
    Model {
        name: "inception-v3",
        layers: b.0,
        batch: 32,
        paper_img_s: Some(43.2),
        gpu: Calibration::TitanX,
    }
}

/// Sockeye's source vocabulary: the 17,188 tokens of P3's
/// `example/sockeye/dataset/iwslt15_en-vi/vocab.en` (one per line, counted)
/// plus the 4 symbols Sockeye 1.5 puts first (`constants.py` VOCAB_SYMBOLS:
/// `<pad>`, `<unk>`, `<s>`, `</s>`; P3's `train.py` builds the vocabulary
/// from that file with `vocab.build_from_paths`, under `--num-words` 50,000).
pub const SOCKEYE_SRC_VOCAB: usize = 17_188 + 4;
/// Sockeye's target vocabulary: the 7,706 tokens of P3's `vocab.vi` plus the 4 symbols.
pub const SOCKEYE_TGT_VOCAB: usize = 7_706 + 4;
/// Embedding width, source and target: `--num-embed 512:512` (P3's command;
/// also Sockeye 1.5's default).
pub const SOCKEYE_EMBED: usize = 512;
/// LSTM units per layer, encoder and decoder: `--rnn-num-hidden 512` (P3's
/// command; Sockeye 1.5's default is 1024). The bidirectional first encoder
/// layer has 512 / 2 per direction (`encoder.py` BiDirectionalRNNEncoder).
pub const SOCKEYE_HIDDEN: usize = 512;
/// MLP attention's hidden units: `--attention-num-hidden 512` (P3's command).
pub const SOCKEYE_ATT_HIDDEN: usize = 512;
/// Tokens per sentence, source and target (the target counts its `<s>`): the
/// mean padded length under P3's `--bucket-width 10`. P3's Sockeye buckets a
/// pair by the longer side (its `data_io.py` define_parallel_buckets uses
/// one step for both sides: buckets (10,10), (20,20) ... (100,100)), so both
/// sides are padded to the same bucket. Over IWSLT'15 tst2012 (P3's
/// `--validation-source`, 1,553 pairs in P3's repository; the training set is
/// not in it) the mean bucket is 27.52: a proxy for the training set's.
pub const SOCKEYE_SEQ_LEN: f64 = 27.5;
/// Sentences per batch: `--batch-size 32` (P3's `run_exp.sh` BATCH=32 and
/// its Sockeye script; Sockeye 1.5's default is 64).
pub const SOCKEYE_BATCH: usize = 32;

/// Sockeye 1.5's RNN model as P3 ran it (see the module doc): embeddings, a
/// bidirectional then a unidirectional LSTM encoder layer, a 2-layer LSTM
/// decoder with input feeding and MLP attention, and the output projection.
fn sockeye() -> Model {
    let (e, h, a) = (SOCKEYE_EMBED, SOCKEYE_HIDDEN, SOCKEYE_ATT_HIDDEN);
    let (s, t) = (SOCKEYE_SEQ_LEN, SOCKEYE_SEQ_LEN);
    let mut b = Builder(Vec::new());
    b.seq("source_embed".into(), SOCKEYE_SRC_VOCAB, e, 0.0);
    b.lstm("encoder_birnn_forward_l0", h / 2, e, s);
    b.lstm("encoder_birnn_reverse_l0", h / 2, e, s);
    b.lstm("encoder_rnn_l0", h, h, s);
    // One FC + tanh per decoder state (2 layers × (h, c)) from the encoder's last state.
    for i in 0..4 {
        b.seq(format!("decoder_enc2decinit_{i}"), h, h, 1.0);
    }
    b.seq("att_e2h".into(), a, h, s);
    b.seq("target_embed".into(), SOCKEYE_TGT_VOCAB, e, 0.0);
    // Input feeding: the first decoder layer reads the embedding ‖ the previous hidden.
    b.lstm("decoder_l0", h, e + h, t);
    b.lstm("decoder_l1", h, h, t);
    b.seq("att_q2h".into(), a, h, t);
    b.seq("att_h2s".into(), 1, a, s * t);
    // The context, a weighted sum of the S encoder states (H wide) per target
    // step, has no weight of its own: counted with the scores.
    b.0.last_mut().expect("just pushed").flops += 2.0 * h as f64 * s * t;
    b.seq("decoder_hidden".into(), h, 2 * h, t);
    b.seq("decoder_cls".into(), SOCKEYE_TGT_VOCAB, h, t);
    debug_assert_eq!(
        b.0.iter().map(LayerSpec::params).sum::<usize>(),
        27_707_904,
        "see the module docs"
    );
    debug_assert_eq!(b.0.len(), 21);
    Model {
        name: "sockeye",
        layers: b.0,
        batch: SOCKEYE_BATCH,
        paper_img_s: None,
        gpu: Calibration::TitanX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameter counts against the published figures (weights only, no biases, no aux heads).
    #[test]
    fn parameter_counts_match_the_architectures() {
        let want = [
            ("vgg19", 143.65e6),
            ("vgg19-22k", 229.6e6),
            ("googlenet", 7.0e6),      // the original 5×5 branches (torchvision uses 3×3)
            ("inception-v3", 23.83e6), // torchvision 27.16M less the 3.33M aux head
            ("resnet-50", 25.5e6),
            ("resnet-152", 60.1e6),
            ("alexnet", 61.1e6),
        ];
        for (name, p) in want {
            let m = profile(name).unwrap();
            let got = m.params() as f64;
            assert!((got - p).abs() / p < 0.04, "{name}: {got} vs {p}");
        }
    }

    /// Inception-V3, exactly: torchvision's inception_v3 has 27,161,264
    /// parameters (its documented `num_params`, aux head included); less the
    /// AuxLogits head (conv0 768→128 1×1: 98,304 + BN 256; conv1 128→768 5×5:
    /// 2,457,600 + BN 1,536; fc 768→1000: 769,000 with its bias; 3,326,696 in
    /// all) and the fc's 1,000 biases (torchvision's convolutions have none),
    /// 23,833,568 remain: the weights and batch-norm scales and shifts here.
    #[test]
    fn inception_v3_matches_torchvision_without_the_aux_head() {
        let aux = 128 * 768 + 2 * 128 + 768 * 128 * 5 * 5 + 2 * 768 + 1000 * 768 + 1000;
        assert_eq!(aux, 3_326_696);
        assert_eq!(profile("inception-v3").unwrap().params(), 27_161_264 - aux - 1000);
        assert_eq!(profile("inception-v3").unwrap().params(), 23_833_568);
        // torchvision's 5.71 GFLOPS (multiply-adds, at 299×299): the convolutions and fc here.
        let m = profile("inception-v3").unwrap();
        let macs: f64 = m
            .layers
            .iter()
            .filter(|l| !l.name.ends_with(".bn"))
            .map(|l| l.flops / 2.0)
            .sum();
        assert!((macs / 5.713e9 - 1.0).abs() < 0.002, "{macs}");
    }

    /// Sockeye as P3 ran it, from the shapes by hand (no biases).
    #[test]
    fn sockeye_matches_its_shapes() {
        let m = profile("sockeye").unwrap();
        let (e, h, vs, vt) = (512, 512, 17_192, 7_710);
        let lstm = |hid: usize, inp: usize| 4 * hid * inp + 4 * hid * hid;
        let want = vs * e // source embedding
            + 2 * lstm(256, e) // bidirectional layer, 256 per direction
            + lstm(h, h) // unidirectional encoder layer
            + 4 * h * h // decoder state init, 2 layers × (h, c)
            + 512 * h + 512 * h + 512 // attention e2h, q2h (512 × H), h2s (1 × 512)
            + vt * e // target embedding
            + lstm(h, e + h) + lstm(h, h) // decoder layers, input feeding
            + h * 2 * h // hidden FC over [rnn output; context]
            + vt * h; // output projection
        assert_eq!(want, 27_707_904);
        assert_eq!(m.params(), want);
        assert_eq!(m.layers.len(), 21);
        assert!(m.layers.iter().all(|l| l.kind == LayerKind::Other && !l.sparse));
        // Forward FLOPs per sentence at S = T = 27.5: per source token the
        // encoder (with att_e2h), per target token the decoder, per pair the
        // attention score and context, once the state init.
        let enc = 2.0 * (2 * lstm(256, e) + lstm(h, h) + 512 * h) as f64;
        let dec = 2.0 * (lstm(h, e + h) + lstm(h, h) + 512 * h + h * 2 * h + vt * h) as f64;
        assert_eq!(enc, 7_864_320.0);
        assert_eq!(dec, 19_953_664.0);
        let l = SOCKEYE_SEQ_LEN;
        let want = l * (enc + dec) + l * l * 2.0 * (512.0 + 512.0) + 2.0 * (4 * h * h) as f64;
        assert!((m.flops() - want).abs() < 1.0, "{} vs {want}", m.flops());
        assert!((m.flops() - 768_640_512.0).abs() < 1.0);
        // No Titan X figure: the mean rate of the four calibrated models.
        assert_eq!(m.calibrated_flop_rate(), reference_flop_rate());
    }

    #[test]
    fn p4000_scales_by_the_fp32_peaks() {
        // 2·1792·1.48 GHz over 2·3072·1.075 GHz.
        let r = Calibration::P4000.rate_factor();
        assert!((r - 5.30432e12 / 6.6048e12).abs() < 1e-12);
        assert!((r - 0.8031).abs() < 1e-4);
        assert_eq!(Calibration::TitanX.rate_factor(), 1.0);
        for n in Calibration::NAMES {
            assert_eq!(Calibration::parse(n).unwrap().name(), *n);
        }
        assert_eq!(Calibration::parse("Quadro_P4000"), Some(Calibration::P4000));
        assert_eq!(Calibration::parse("v100"), None);
        for n in NAMES {
            let titan = profile(n).unwrap();
            assert_eq!(titan.gpu, Calibration::TitanX);
            let p = titan.clone().on(Calibration::P4000);
            let (a, b) = (titan.iteration_compute(32, 1.0), p.iteration_compute(32, 1.0));
            assert!((a.as_secs_f64() / b.as_secs_f64() - r).abs() < 1e-6, "{n}");
        }
    }

    #[test]
    fn calibration_reproduces_paper_throughput() {
        let vgg = profile("vgg19").unwrap();
        let t = vgg.iteration_compute(32, 1.0).as_secs_f64();
        assert!((32.0 / t - 35.5).abs() < 1e-6);
        let sum: f64 = vgg
            .layer_times(32, 1.0)
            .iter()
            .map(|(f, b)| (*f + *b).as_secs_f64())
            .sum();
        assert!((sum - t).abs() < 1e-6);
    }

    #[test]
    fn every_name_resolves() {
        for n in NAMES {
            assert!(profile(n).is_some(), "{n}");
        }
        assert!(profile("nope").is_none());
    }
}
