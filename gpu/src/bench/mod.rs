//! `tidewire bench aggregate`: how fast this machine aggregates, next to its
//! memory bandwidth measured in the same run (a STREAM-like triad), so the
//! figure is a ratio that survives a noisy machine.
//!
//! Bytes are counted as STREAM counts them (no write-allocate traffic): the
//! sum of P inputs into an accumulator moves (P + 2) x N x 4 bytes (P inputs
//! and the accumulator read, the accumulator written); the triad 3 x N x 4.
//!
//! The options, the report and [`BenchError`] live in `types.rs`; the GPU half
//! (`gpu.rs`, feature `cuda`) measures through the `cuda` module and fills
//! [`GpuPart`]. The dependencies go one way: this module -> `gpu.rs` ->
//! `types.rs` and `cuda`; `cuda` knows nothing of the bench.

#[cfg(feature = "cuda")]
mod gpu;
mod types;

use std::time::Instant;

pub use types::{AggregateOpts, AggregateReport, BenchError, GpuPart};

use crate::cpu;

fn alloc(n: usize, v: f32, what: &'static str) -> Result<Vec<f32>, BenchError> {
    let mut x = Vec::new();
    x.try_reserve_exact(n).map_err(|source| BenchError::Alloc {
        what,
        mib: (n * 4) >> 20,
        source,
    })?;
    x.resize(n, v);
    Ok(x)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs the measurement. `progress` hears one line per repetition.
pub fn aggregate(o: &AggregateOpts, mut progress: impl FnMut(&str)) -> Result<AggregateReport, BenchError> {
    if !AggregateOpts::INPUTS.contains(&o.inputs)
        || !AggregateOpts::MIB.contains(&o.mib)
        || o.threads == 0
        || !AggregateOpts::REPS.contains(&o.reps)
    {
        return Err(BenchError::Options {
            inputs: o.inputs,
            mib: o.mib,
            threads: o.threads,
            reps: o.reps,
        });
    }
    let n = o.mib << 18; // f32 elements per MiB: 2^20 / 4
    let need_mib = (o.inputs + 1 + 3) * o.mib;
    if let Some(available_mib) = mem_available_mib() {
        if need_mib as u64 > available_mib {
            return Err(BenchError::Memory {
                need_mib,
                available_mib,
                inputs: o.inputs,
                mib: o.mib,
            });
        }
    }
    let inputs: Vec<Vec<f32>> = (0..o.inputs)
        .map(|p| alloc(n, 1e-3 * (p + 1) as f32, "an input"))
        .collect::<Result<_, _>>()?;
    let refs: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let mut acc = alloc(n, 0.0, "the accumulator")?;
    let mut a = alloc(n, 0.0, "triad a")?;
    let b = alloc(n, 1.0, "triad b")?;
    let c = alloc(n, 2.0, "triad c")?;
    // Warm-up: page in and settle the threads.
    cpu::sum_into(&mut acc, &refs, o.threads);
    cpu::triad(&mut a, &b, &c, 3.0, o.threads);
    let sum_bytes = ((o.inputs + 2) * n * 4) as f64;
    let triad_bytes = (3 * n * 4) as f64;
    let (mut sums, mut triads) = (Vec::new(), Vec::new());
    for r in 0..o.reps {
        let t = Instant::now();
        cpu::triad(&mut a, &b, &c, 3.0, o.threads);
        triads.push(triad_bytes / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        cpu::sum_into(&mut acc, &refs, o.threads);
        sums.push(sum_bytes / t.elapsed().as_secs_f64() / 1e9);
        progress(&format!(
            "rep {}/{}: sum {:.2} GB/s, triad {:.2} GB/s",
            r + 1,
            o.reps,
            sums[r],
            triads[r]
        ));
    }
    // Keep the results observable so neither loop can be optimized away.
    if !(acc[n / 2].is_finite() && a[n / 2] == 7.0) {
        return Err(BenchError::WrongValues {
            sum: acc[n / 2],
            triad: a[n / 2],
        });
    }
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let (cpu_sum_gbps, triad_gbps) = (best(&sums), best(&triads));
    let gpu = gpu_part(o, &mut progress);
    Ok(AggregateReport {
        inputs: o.inputs,
        mib: o.mib,
        threads: o.threads,
        reps: o.reps,
        cpu_sum_gbps,
        triad_gbps,
        ratio: cpu_sum_gbps / triad_gbps,
        cpu_sum_gbps_median: median(sums),
        triad_gbps_median: median(triads),
        gpu,
    })
}

fn gpu_part(o: &AggregateOpts, progress: &mut impl FnMut(&str)) -> GpuPart {
    #[cfg(feature = "cuda")]
    {
        match gpu::measure(o, |l| progress(l)) {
            Ok(p) => p,
            Err(e) => GpuPart {
                reason: e.to_string(),
                ..Default::default()
            },
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (o, progress);
        GpuPart {
            reason: crate::probe().detail,
            ..Default::default()
        }
    }
}

fn mem_available_mib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// The report as text.
pub fn render(r: &AggregateReport) -> String {
    format!(
        "aggregate: sum of {} inputs x {} MiB into an accumulator, {} threads, best of {}\n\
         \x20 cpu sum  {:>7.2} GB/s   (median {:.2})\n\
         \x20 triad    {:>7.2} GB/s   (median {:.2})   STREAM-like a = b + s*c, same run\n\
         \x20 ratio    {:>7.3}\n\
         {}\
         bytes counted as STREAM does: sum (P+2)*N*4, triad 3*N*4, copy 2*N*4\n",
        r.inputs,
        r.mib,
        r.threads,
        r.reps,
        r.cpu_sum_gbps,
        r.cpu_sum_gbps_median,
        r.triad_gbps,
        r.triad_gbps_median,
        r.ratio,
        render_gpu(&r.gpu)
    )
}

fn render_gpu(g: &GpuPart) -> String {
    if !g.measured {
        return format!("  gpu      not measured: {}\n", g.reason);
    }
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
    format!(
        "  gpu      {}\n\
         \x20   sum kernel {:>8} GB/s   d2d copy {} GB/s   ratio {}   bitwise = cpu: {}\n\
         \x20   bf16 sum   {:>8} GB/s   pinned h2d {} GB/s, d2h {} GB/s   SGEMM {} GFLOP/s\n",
        g.device.as_deref().unwrap_or("?"),
        f(g.sum_gbps),
        f(g.d2d_copy_gbps),
        g.ratio_vs_copy.map_or("-".into(), |r| format!("{r:.3}")),
        g.matches_cpu_bitwise.map_or("-".into(), |b| b.to_string()),
        f(g.bf16_sum_gbps),
        f(g.h2d_gbps),
        f(g.d2h_gbps),
        g.sgemm_gflops.map_or("- (no cuBLAS)".into(), |v| format!("{v:.0}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_reports_every_field_and_bad_input_is_refused() {
        let o = AggregateOpts {
            inputs: 3,
            mib: 1,
            threads: 2,
            reps: 2,
        };
        let mut lines = Vec::new();
        let r = aggregate(&o, |l| lines.push(l.to_string())).unwrap();
        // One line per CPU repetition, numbered, first; the GPU half (with a GPU)
        // adds its own lines after them, each starting "gpu".
        let (cpu, gpu): (Vec<_>, Vec<_>) = lines.iter().partition(|l| !l.starts_with("gpu"));
        assert_eq!(cpu.len(), o.reps, "{lines:?}");
        for (i, l) in cpu.iter().enumerate() {
            assert!(l.starts_with(&format!("rep {}/{}: sum ", i + 1, o.reps)), "{l}");
        }
        assert!(
            lines[..o.reps].iter().all(|l| l.starts_with("rep ")),
            "CPU lines first: {lines:?}"
        );
        // The GPU half's lines: its header, one per repetition, bf16, pinned copies, and
        // SGEMM when cuBLAS loads; when it stops early, fewer, and it says why.
        let gpu_lines = 1 + o.reps + 2;
        if r.gpu.measured {
            let sgemm = usize::from(r.gpu.sgemm_gflops.is_some());
            assert_eq!(gpu.len(), gpu_lines + sgemm, "{lines:?}");
        } else {
            assert!(
                gpu.len() <= gpu_lines && !r.gpu.reason.is_empty(),
                "{lines:?} {:?}",
                r.gpu
            );
        }
        // The report says what was asked, whatever this machine's core count.
        assert_eq!(
            (r.inputs, r.mib, r.threads, r.reps),
            (o.inputs, o.mib, o.threads, o.reps)
        );
        assert!(r.cpu_sum_gbps > 0.0 && r.triad_gbps > 0.0 && r.ratio > 0.0);
        let j = serde_json::to_value(&r).unwrap();
        for k in ["cpu_sum_gbps", "triad_gbps", "ratio", "gpu"] {
            assert!(j.get(k).is_some(), "{k} missing from {j}");
        }
        assert!(render(&r).contains("triad"));
        for bad in [
            AggregateOpts { inputs: 0, ..o.clone() },
            AggregateOpts { mib: 0, ..o.clone() },
            AggregateOpts {
                threads: 0,
                ..o.clone()
            },
        ] {
            let e = aggregate(&bad, |_| {}).unwrap_err();
            assert!(matches!(e, BenchError::Options { .. }), "{e:?}");
        }
        let huge = AggregateOpts {
            mib: 16384,
            inputs: 64,
            ..o
        };
        let e = aggregate(&huge, |_| {}).unwrap_err();
        assert!(matches!(e, BenchError::Memory { .. }), "{e:?}");
        assert!(e.to_string().contains("MiB"), "{e}");
    }
}
