//! GPU tests: they run where a GPU, its driver and NVRTC are present, and
//! otherwise print `SKIPPED: <test>: <reason>` and pass. Every kernel is
//! checked against the CPU reference in `tidewire_gpu::cpu`, bitwise in
//! deterministic mode.
#![cfg(feature = "cuda")]

use tidewire_gpu::agg::{Aggregator, GpuChoice, Policy};
use tidewire_gpu::cpu::{self, ApplyOp};
use tidewire_gpu::cuda::{CudaError, Gpu, GpuOptions, MAX_INPUTS};
use tidewire_gpu::print_skip;

fn open(test: &str, deterministic: bool) -> Option<Gpu> {
    match Gpu::open(GpuOptions {
        deterministic,
        ..Default::default()
    }) {
        Ok(g) => Some(g),
        Err(e @ (CudaError::NoDriver | CudaError::NoDevice(_) | CudaError::NoNvrtc)) => {
            print_skip(test, &e.to_string());
            None
        }
        Err(e) => panic!("{test}: a GPU is present but cannot be opened: {e}"),
    }
}

fn data(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = (i as u32 ^ seed.wrapping_mul(0x9e37_79b9)).wrapping_mul(2_654_435_761);
            (h >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn sum_matches_cpu_bitwise_for_every_type_length_and_input_count() {
    let Some(g) = open("sum_matches_cpu_bitwise", true) else {
        return;
    };
    // Odd lengths exercise the scalar tail; offsets of 1 element disable vector loads.
    for &(n, p, at) in &[
        (1usize, 1usize, 0usize),
        (1027, 3, 0),
        (1 << 20, 8, 0),
        (4099, MAX_INPUTS + 5, 1),
        (333, 8, 3),
    ] {
        let xs: Vec<Vec<f32>> = (0..p).map(|i| data(n, i as u32 + 1)).collect();
        let base = data(n + at, 99);
        for init in [false, true] {
            // f32
            let mut want = base.clone();
            if init {
                want[at..].copy_from_slice(&xs[0]);
                cpu::sum_into_as(&mut want[at..], &xs[1..].iter().map(|v| &v[..]).collect::<Vec<_>>(), 4);
            } else {
                cpu::sum_into_as(&mut want[at..], &xs.iter().map(|v| &v[..]).collect::<Vec<_>>(), 4);
            }
            let dev: Vec<_> = xs.iter().map(|x| g.upload(x).unwrap()).collect();
            let mut acc = g.upload(&base).unwrap();
            g.sum_into(&mut acc, at, &dev.iter().collect::<Vec<_>>(), init).unwrap();
            let mut got = vec![0.0f32; n + at];
            g.copy_out(&acc, 0, &mut got).unwrap();
            assert_eq!(bits(&got), bits(&want), "f32 n={n} p={p} at={at} init={init}");
        }
        // bf16 and f16, widened exactly and summed in f32.
        let bf: Vec<Vec<half::bf16>> = xs
            .iter()
            .map(|v| v.iter().map(|x| half::bf16::from_f32(*x)).collect())
            .collect();
        let hf: Vec<Vec<half::f16>> = xs
            .iter()
            .map(|v| v.iter().map(|x| half::f16::from_f32(*x)).collect())
            .collect();
        let mut want_b = base.clone();
        cpu::sum_into_as(&mut want_b[at..], &bf.iter().map(|v| &v[..]).collect::<Vec<_>>(), 4);
        let mut want_h = base.clone();
        cpu::sum_into_as(&mut want_h[at..], &hf.iter().map(|v| &v[..]).collect::<Vec<_>>(), 4);
        let db: Vec<_> = bf.iter().map(|x| g.upload(x).unwrap()).collect();
        let dh: Vec<_> = hf.iter().map(|x| g.upload(x).unwrap()).collect();
        let mut acc = g.upload(&base).unwrap();
        g.sum_into(&mut acc, at, &db.iter().collect::<Vec<_>>(), false).unwrap();
        let mut got = vec![0.0f32; n + at];
        g.copy_out(&acc, 0, &mut got).unwrap();
        assert_eq!(bits(&got), bits(&want_b), "bf16 n={n} p={p}");
        let mut acc = g.upload(&base).unwrap();
        g.sum_into(&mut acc, at, &dh.iter().collect::<Vec<_>>(), false).unwrap();
        g.copy_out(&acc, 0, &mut got).unwrap();
        assert_eq!(bits(&got), bits(&want_h), "f16 n={n} p={p}");
    }
}

#[test]
fn apply_and_scale_match_cpu_bitwise() {
    let Some(g) = open("apply_and_scale_match_cpu_bitwise", true) else {
        return;
    };
    let n = 100_003;
    let acc = data(n, 1);
    let w0 = data(n, 2);
    let v0 = data(n, 3);
    let ops = [
        ApplyOp::Sum,
        ApplyOp::Mean,
        ApplyOp::Sgd {
            lr: 0.01,
            momentum: 0.0,
            weight_decay: 5e-4,
        },
        ApplyOp::Sgd {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 1e-4,
        },
    ];
    for op in ops {
        let (mut w, mut v) = (w0.clone(), v0.clone());
        cpu::apply(op, 7, &acc, &mut w, &mut v);
        let da = g.upload(&acc).unwrap();
        let mut dw = g.upload(&w0).unwrap();
        let mut dv = g.upload(&v0).unwrap();
        g.apply(op, 7, &da, &mut dw, Some(&mut dv)).unwrap();
        let (mut gw, mut gv) = (vec![0.0; n], vec![0.0; n]);
        g.copy_out(&dw, 0, &mut gw).unwrap();
        g.copy_out(&dv, 0, &mut gv).unwrap();
        assert_eq!(bits(&gw), bits(&w), "{op:?} params");
        if op.needs_momentum() {
            assert_eq!(bits(&gv), bits(&v), "{op:?} momentum");
        }
    }
    let mut want = acc.clone();
    cpu::scale(&mut want, 0.125);
    let mut d = g.upload(&acc).unwrap();
    g.scale(&mut d, 0.125).unwrap();
    let mut got = vec![0.0; n];
    g.copy_out(&d, 0, &mut got).unwrap();
    assert_eq!(bits(&got), bits(&want));
    // SGD with momentum and no buffer is refused, nothing written.
    let mut dw = g.upload(&w0).unwrap();
    assert!(matches!(
        g.apply(ops[3], 7, &g.upload(&acc).unwrap(), &mut dw, None),
        Err(CudaError::Invalid(_))
    ));
}

#[test]
fn arrival_order_mode_is_close_to_the_reference() {
    let Some(g) = open("arrival_order_mode", false) else {
        return;
    };
    let n = 1 << 18;
    let xs: Vec<Vec<f32>> = (0..8).map(|i| data(n, i + 10)).collect();
    let mut want = vec![0.0f32; n];
    cpu::sum_into(&mut want, &xs.iter().map(|v| &v[..]).collect::<Vec<_>>(), 2);
    let dev: Vec<_> = xs.iter().map(|x| g.upload(x).unwrap()).collect();
    let mut acc = g.alloc::<f32>(n).unwrap();
    g.accumulate(&mut acc, 0, &dev.iter().collect::<Vec<_>>()).unwrap();
    let mut got = vec![0.0; n];
    g.copy_out(&acc, 0, &mut got).unwrap();
    for i in 0..n {
        assert!(
            (got[i] - want[i]).abs() <= 1e-5 * (1.0 + want[i].abs()),
            "{i}: {} vs {}",
            got[i],
            want[i]
        );
    }
}

#[test]
fn sgemm_reconstructs_sufficient_factors() {
    let Some(g) = open("sgemm_reconstructs_sufficient_factors", true) else {
        return;
    };
    let (p, k, m, n) = (4, 16, 300, 257);
    let us: Vec<Vec<f32>> = (0..p).map(|i| data(k * m, 20 + i as u32)).collect();
    let vs: Vec<Vec<f32>> = (0..p).map(|i| data(k * n, 40 + i as u32)).collect();
    let mut want = vec![0.0f32; m * n];
    let pairs: Vec<(&[f32], &[f32])> = us.iter().zip(&vs).map(|(u, v)| (&u[..], &v[..])).collect();
    cpu::sf_sum(&pairs, k, m, n, &mut want);
    let du = g.upload(&us.concat()).unwrap();
    let dv = g.upload(&vs.concat()).unwrap();
    let mut out = g.alloc::<f32>(m * n).unwrap();
    match g.sf_sum(&du, &dv, p * k, m, n, &mut out) {
        Err(e @ CudaError::NoCublas) => {
            print_skip("sgemm_reconstructs_sufficient_factors", &e.to_string());
            return;
        }
        r => r.unwrap(),
    }
    let mut got = vec![0.0; m * n];
    g.copy_out(&out, 0, &mut got).unwrap();
    for i in 0..m * n {
        assert!(
            (got[i] - want[i]).abs() <= 1e-4 * (1.0 + want[i].abs()),
            "{i}: {} vs {}",
            got[i],
            want[i]
        );
    }
    // Shapes that do not match the buffers are refused.
    assert!(matches!(
        g.sf_sum(&du, &dv, p * k, m + 1, n, &mut out),
        Err(CudaError::Invalid(_))
    ));
}

#[test]
fn pinned_registered_and_bounds() {
    let Some(g) = open("pinned_registered_and_bounds", true) else {
        return;
    };
    let n = 1 << 20;
    let mut pin = g.pinned_host::<f32>(n).unwrap();
    assert!(pin.as_slice().iter().all(|x| *x == 0.0));
    pin.as_mut_slice().copy_from_slice(&data(n, 5));
    let mut d = g.alloc::<f32>(n).unwrap();
    g.copy_in_pinned(&mut d, &pin).unwrap();
    let mut back = g.pinned_host::<f32>(n).unwrap();
    g.copy_out_pinned(&d, &mut back).unwrap();
    assert_eq!(bits(back.as_slice()), bits(&data(n, 5)));
    // cuMemHostRegister on ordinary memory.
    let mut mem = vec![0u8; 4 << 20];
    {
        let reg = g.register_host(&mut mem).unwrap();
        assert_eq!(reg.len(), 4 << 20);
    }
    // Out-of-range copies are refused, not performed.
    let mut small = vec![0.0f32; 16];
    assert!(matches!(g.copy_out(&d, n - 8, &mut small), Err(CudaError::Invalid(_))));
    assert!(matches!(g.copy_in(&mut d, n, &small), Err(CudaError::Invalid(_))));
    assert!(matches!(g.alloc::<f32>(0), Err(CudaError::Invalid(_))));
}

#[test]
fn dmabuf_export_or_a_clear_reason() {
    let Some(g) = open("dmabuf_export_or_a_clear_reason", true) else {
        return;
    };
    let d = g.alloc::<f32>(1 << 20).unwrap();
    match g.export_dmabuf(&d) {
        Ok(x) => {
            use std::os::fd::AsRawFd;
            assert!(x.fd.as_raw_fd() >= 0);
            assert_eq!(x.len, 4 << 20);
            assert_eq!(x.iova, d.ptr());
            assert_eq!(x.offset % 4096, x.iova % 4096);
        }
        Err(CudaError::NoDmabuf(why)) => {
            assert!(
                !g.info().dmabuf || why.contains("cuMemGetHandleForAddressRange"),
                "{why}"
            );
            print_skip("dmabuf export", &why);
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn aggregator_on_the_gpu_gives_the_cpu_bits() {
    let Some(_g) = open("aggregator_on_the_gpu", true) else {
        return;
    };
    let mut cpu_agg = Aggregator::new(Policy::Cpu).unwrap();
    let mut gpu_agg = Aggregator::with_gpu_options(Policy::Gpu, GpuChoice::default()).unwrap();
    let n = 1 << 20;
    let slices = [(0usize, n / 2), (n / 2, n / 2)];
    let (mut a, mut b) = (vec![0.0f32; n], vec![0.0f32; n]);
    for w in 0..6u32 {
        for &(off, len) in &slices {
            let src = data(len, w * 7 + off as u32);
            cpu_agg.accumulate(3, 6, &mut a, off, &src, w == 0).unwrap();
            gpu_agg.accumulate(3, 6, &mut b, off, &src, w == 0).unwrap();
        }
    }
    cpu_agg.finish(3, &mut a).unwrap();
    gpu_agg.finish(3, &mut b).unwrap();
    assert_eq!(bits(&a), bits(&b));
    let s = gpu_agg.stats();
    assert_eq!(s.sched.gpu_picks, 1);
    assert_eq!(s.gpu_bytes, 6 * n as u64 * 4);
}
