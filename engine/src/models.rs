//! Model profiles: per-layer shapes taken from the architectures, with forward
//! FLOPs per sample, and a compute-time model calibrated to the single-GPU
//! throughputs the Poseidon paper reports for a Titan X.
//!
//! Conventions:
//! - A convolution's weight is M×N with M output channels and N = input
//!   channels × kernel area; an FC weight is outputs × inputs.
//! - Biases are left out (under 0.1% of the parameters). Networks built with
//!   batch norm (ResNets, Inception-V3) carry one `Other` layer per norm with
//!   its scale and shift (2×C).
//! - Auxiliary classifiers are left out (Inception-V3's AuxLogits head is
//!   3,326,696 of torchvision's 27,161,264 parameters; the 23,833,568 here
//!   are the rest less the fc's 1,000 biases).
//! - FLOPs count a multiply-add as 2.
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

    /// Effective FLOP/s of forward + backward (3× forward) on the calibration GPU.
    pub fn calibrated_flop_rate(&self) -> f64 {
        match self.paper_img_s {
            Some(img_s) => 3.0 * self.flops() * img_s,
            None => reference_flop_rate(),
        }
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

/// The mean effective FLOP/s of the four models the paper calibrates; used
/// for models the paper gives no throughput for (ResNets, AlexNet).
pub fn reference_flop_rate() -> f64 {
    let rates: Vec<f64> = ["vgg19", "vgg19-22k", "googlenet", "inception-v3"]
        .iter()
        .map(|n| profile(n).expect("built in").calibrated_flop_rate())
        .collect();
    rates.iter().sum::<f64>() / rates.len() as f64
}

/// A profile by name (case-insensitive; `_` and `-` are the same).
pub fn profile(name: &str) -> Option<Model> {
    let n = name.to_ascii_lowercase().replace('_', "-");
    Some(match n.as_str() {
        "vgg19" | "vgg-19" => vgg19(1000),
        "vgg19-mini" | "vgg-19-mini" => vgg19_mini(),
        "vgg19-22k" | "vgg-19-22k" => vgg19(21841),
        "googlenet" | "inception-v1" => googlenet(),
        "inception-v3" | "inceptionv3" => inception_v3(),
        "resnet-50" | "resnet50" => resnet(&[3, 4, 6, 3], "resnet-50"),
        "resnet-152" | "resnet152" => resnet(&[3, 8, 36, 3], "resnet-152"),
        "alexnet" => alexnet(),
        _ => return None,
    })
}

struct Builder(Vec<LayerSpec>);

impl Builder {
    fn conv(&mut self, name: String, out: usize, inp: usize, kh: usize, kw: usize, hw: usize) {
        let mut l = LayerSpec::new(name, LayerKind::Conv, out, inp * kh * kw);
        l.flops = 2.0 * (out * inp * kh * kw * hw * hw) as f64;
        self.0.push(l);
    }
    fn conv_bn(&mut self, name: String, out: usize, inp: usize, kh: usize, kw: usize, hw: usize) {
        self.conv(name.clone(), out, inp, kh, kw, hw);
        let mut bn = LayerSpec::new(format!("{name}.bn"), LayerKind::Other, 2, out);
        bn.flops = 4.0 * (out * hw * hw) as f64;
        self.0.push(bn);
    }
    fn fc(&mut self, name: &str, out: usize, inp: usize) {
        let mut l = LayerSpec::new(name, LayerKind::Fc, out, inp);
        l.flops = 2.0 * (out * inp) as f64;
        self.0.push(l);
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
    b.fc("fc6", 512, 64 * 7 * 7);
    b.fc("fc7", 512, 512);
    b.fc("fc8", 125, 512);
    Model {
        name: "vgg19-mini",
        layers: b.0,
        batch: 32,
        paper_img_s: None,
    }
}

fn alexnet() -> Model {
    let mut b = Builder(Vec::new());
    b.conv("conv1".into(), 64, 3, 11, 11, 55);
    b.conv("conv2".into(), 192, 64, 5, 5, 27);
    b.conv("conv3".into(), 384, 192, 3, 3, 13);
    b.conv("conv4".into(), 256, 384, 3, 3, 13);
    b.conv("conv5".into(), 256, 256, 3, 3, 13);
    b.fc("fc6", 4096, 256 * 6 * 6);
    b.fc("fc7", 4096, 4096);
    b.fc("fc8", 1000, 4096);
    Model {
        name: "alexnet",
        layers: b.0,
        batch: 256,
        paper_img_s: None,
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
    for (m, inp, c1, c3r, c3, c5r, c5, pp, hw) in modules {
        b.conv(format!("inception_{m}.1x1"), c1, inp, 1, 1, hw);
        b.conv(format!("inception_{m}.3x3_reduce"), c3r, inp, 1, 1, hw);
        b.conv(format!("inception_{m}.3x3"), c3, c3r, 3, 3, hw);
        b.conv(format!("inception_{m}.5x5_reduce"), c5r, inp, 1, 1, hw);
        b.conv(format!("inception_{m}.5x5"), c5, c5r, 5, 5, hw);
        b.conv(format!("inception_{m}.pool_proj"), pp, inp, 1, 1, hw);
    }
    b.fc("fc", 1000, 1024);
    Model {
        name: "googlenet",
        layers: b.0,
        batch: 128,
        paper_img_s: Some(257.0),
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
    b.fc("fc", 1000, 2048);
    Model {
        name,
        layers: b.0,
        batch: 32,
        paper_img_s: None,
    }
}

fn inception_v3() -> Model {
    let mut b = Builder(Vec::new());
    b.conv_bn("Conv2d_1a_3x3".into(), 32, 3, 3, 3, 149);
    b.conv_bn("Conv2d_2a_3x3".into(), 32, 32, 3, 3, 147);
    b.conv_bn("Conv2d_2b_3x3".into(), 64, 32, 3, 3, 147);
    b.conv_bn("Conv2d_3b_1x1".into(), 80, 64, 1, 1, 73);
    b.conv_bn("Conv2d_4a_3x3".into(), 192, 80, 3, 3, 71);
    for (m, inp, pf) in [("Mixed_5b", 192, 32), ("Mixed_5c", 256, 64), ("Mixed_5d", 288, 64)] {
        let hw = 35;
        b.conv_bn(format!("{m}.branch1x1"), 64, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch5x5_1"), 48, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch5x5_2"), 64, 48, 5, 5, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_1"), 64, inp, 1, 1, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_2"), 96, 64, 3, 3, hw);
        b.conv_bn(format!("{m}.branch3x3dbl_3"), 96, 96, 3, 3, hw);
        b.conv_bn(format!("{m}.branch_pool"), pf, inp, 1, 1, hw);
    }
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
    for (m, inp) in [("Mixed_7b", 1280), ("Mixed_7c", 2048)] {
        let hw = 8;
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
    b.fc("fc", 1000, 2048);
    Model {
        name: "inception-v3",
        layers: b.0,
        batch: 32,
        paper_img_s: Some(43.2),
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
