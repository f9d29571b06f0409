//! The GPU half of `tidewire bench aggregate`: the sum kernel next to a
//! device-to-device copy of the same GPU in the same run, SGEMM, and pinned
//! host↔device copies. Kernel and copy are timed with CUDA events over
//! back-to-back launches.

use std::time::Instant;

use super::types::{AggregateOpts, GpuPart};
use crate::cpu;
use crate::cuda::{CudaError, Gpu, GpuOptions};

fn gbps(bytes: f64, ms: f64) -> f64 {
    bytes / (ms / 1e3) / 1e9
}

/// Measures what [`GpuPart`] reports on GPU 0. `progress` hears one line per step.
pub(super) fn measure(o: &AggregateOpts, mut progress: impl FnMut(&str)) -> Result<GpuPart, CudaError> {
    let g = Gpu::open(GpuOptions::default())?;
    let info = g.info().clone();
    let n = o.mib << 18;
    let reps = o.reps.max(1);
    progress(&format!(
        "gpu: {} (sm_{}{}), {} inputs x {} MiB",
        info.name, info.compute_capability.0, info.compute_capability.1, o.inputs, o.mib
    ));
    let host: Vec<Vec<f32>> = (0..o.inputs).map(|p| vec![1e-3 * (p + 1) as f32; n]).collect();
    let inputs = host.iter().map(|h| g.upload(h)).collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<_> = inputs.iter().collect();
    let mut acc = g.alloc::<f32>(n)?;
    // Correctness on the bench's own data first: one sum from zero, against the CPU.
    g.sum_into(&mut acc, 0, &refs, false)?;
    let mut got = vec![0.0f32; n];
    g.copy_out(&acc, 0, &mut got)?;
    let mut want = vec![0.0f32; n];
    cpu::sum_into(&mut want, &host.iter().map(|v| &v[..]).collect::<Vec<_>>(), o.threads);
    let bitwise = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
    drop((got, want));

    // Warm up, then alternate kernel and copy so both see the same clocks.
    g.sum_into(&mut acc, 0, &refs, false)?;
    let mut dst = g.alloc::<f32>(n)?;
    g.copy_device(&mut dst, &inputs[0])?;
    let (mut sums, mut copies, mut sum_ms, mut fresh_ms) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let sum_bytes = ((o.inputs + 2) * n * 4) as f64;
    let copy_bytes = (2 * n * 4) as f64;
    for r in 0..reps {
        let ms = g.event_ms(10, || g.sum_into_queued(&mut acc, 0, &refs, false))?;
        sums.push(gbps(sum_bytes, ms));
        sum_ms.push(ms);
        fresh_ms.push(g.event_ms(10, || g.sum_into_queued(&mut acc, 0, &refs, true))?);
        let ms = g.event_ms(10, || g.copy_device_queued(&mut dst, &inputs[0]))?;
        copies.push(gbps(copy_bytes, ms));
        progress(&format!(
            "gpu rep {}/{reps}: sum {:.1} GB/s, d2d copy {:.1} GB/s",
            r + 1,
            sums[r],
            copies[r]
        ));
    }
    drop(dst);

    // bf16 inputs accumulated in f32.
    let bf: Vec<Vec<half::bf16>> = (0..o.inputs)
        .map(|p| vec![half::bf16::from_f32(1e-3 * (p + 1) as f32); n])
        .collect();
    let bfd = bf.iter().map(|h| g.upload(h)).collect::<Result<Vec<_>, _>>()?;
    drop(bf);
    let bref: Vec<_> = bfd.iter().collect();
    g.sum_into(&mut acc, 0, &bref, false)?;
    let ms = g.event_ms(10, || g.sum_into_queued(&mut acc, 0, &bref, false))?;
    let bf16_sum_gbps = gbps(((o.inputs * 2 + 8) * n) as f64, ms);
    drop(bfd);
    progress(&format!("gpu: bf16 sum {bf16_sum_gbps:.1} GB/s"));

    // Pinned host <-> device.
    let mut pin = g.pinned_host::<f32>(n)?;
    g.copy_in_pinned(&mut acc, &pin)?;
    let t = Instant::now();
    for _ in 0..reps {
        g.copy_in_pinned(&mut acc, &pin)?;
    }
    let h2d_gbps = gbps((reps * n * 4) as f64, t.elapsed().as_secs_f64() * 1e3);
    let t = Instant::now();
    for _ in 0..reps {
        g.copy_out_pinned(&acc, &mut pin)?;
    }
    let d2h_gbps = gbps((reps * n * 4) as f64, t.elapsed().as_secs_f64() * 1e3);
    drop(pin);
    progress(&format!("gpu: pinned h2d {h2d_gbps:.1} GB/s, d2h {d2h_gbps:.1} GB/s"));

    // SGEMM as SF reconstruction: P workers' K=256 factors of a 4096 x 4096 layer.
    let (m, nn, pk) = (4096usize, 4096usize, 256 * o.inputs.min(16));
    let u = g.upload(&vec![0.5f32; pk * m])?;
    let v = g.upload(&vec![0.25f32; pk * nn])?;
    let mut out = g.alloc::<f32>(m * nn)?;
    let sgemm_gflops = match g.sf_sum(&u, &v, pk, m, nn, &mut out) {
        Ok(()) => {
            let t = Instant::now();
            for _ in 0..reps {
                g.sf_sum(&u, &v, pk, m, nn, &mut out)?;
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            let mut corner = [0.0f32; 1];
            g.copy_out(&out, 0, &mut corner)?;
            if corner[0] != 0.125 * pk as f32 {
                return Err(CudaError::Invalid(format!(
                    "SGEMM gave {} where {} is right",
                    corner[0],
                    0.125 * pk as f32
                )));
            }
            Some(2.0 * (m * nn * pk) as f64 / s / 1e9)
        }
        Err(CudaError::NoCublas) => None,
        Err(e) => return Err(e),
    };
    if let Some(f) = sgemm_gflops {
        progress(&format!("gpu: SGEMM {m}x{nn}x{pk} {f:.0} GFLOP/s"));
    }
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let (sum_gbps, d2d) = (best(&sums), best(&copies));
    let least = |v: &[f64]| v.iter().cloned().fold(f64::INFINITY, f64::min);
    Ok(GpuPart {
        measured: true,
        reason: String::new(),
        device: Some(format!(
            "{} (sm_{}{}, {} MiB)",
            info.name,
            info.compute_capability.0,
            info.compute_capability.1,
            info.memory_bytes >> 20
        )),
        sum_gbps: Some(sum_gbps),
        d2d_copy_gbps: Some(d2d),
        ratio_vs_copy: Some(sum_gbps / d2d),
        sum_ms: Some(least(&sum_ms)),
        fresh_sum_ms: Some(least(&fresh_ms)),
        bf16_sum_gbps: Some(bf16_sum_gbps),
        sgemm_gflops,
        h2d_gbps: Some(h2d_gbps),
        d2h_gbps: Some(d2h_gbps),
        matches_cpu_bitwise: Some(bitwise),
    })
}
