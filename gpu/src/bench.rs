//! `tidewire bench aggregate`: how fast this machine aggregates, next to its
//! memory bandwidth measured in the same run (a STREAM-like triad), so the
//! figure is a ratio that survives a noisy machine.
//!
//! Bytes are counted as STREAM counts them (no write-allocate traffic): the
//! sum of P inputs into an accumulator moves (P + 2) x N x 4 bytes (P inputs
//! and the accumulator read, the accumulator written); the triad 3 x N x 4.

use std::time::Instant;

use serde::Serialize;

use crate::cpu;

/// What to measure.
#[derive(Debug, Clone)]
pub struct AggregateOpts {
    /// P, the inputs summed into the accumulator.
    pub inputs: usize,
    /// MiB per input (and per triad array).
    pub mib: usize,
    /// Threads for both the sum and the triad.
    pub threads: usize,
    /// Repetitions of each, alternating; the best and the median are reported.
    pub reps: usize,
}

impl Default for AggregateOpts {
    fn default() -> Self {
        AggregateOpts {
            inputs: 8,
            mib: 64,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            reps: 5,
        }
    }
}

/// The GPU part of the report (GB/s counted as for the CPU: the sum moves
/// (P+2)·N·4 bytes, a copy 2·N·4).
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuPart {
    /// Whether a GPU was measured; `reason` says why not.
    pub measured: bool,
    pub reason: String,
    pub device: Option<String>,
    /// The deterministic f32 sum kernel, best repetition.
    pub sum_gbps: Option<f64>,
    /// cuMemcpyDtoD of one input, same run.
    pub d2d_copy_gbps: Option<f64>,
    /// sum_gbps / d2d_copy_gbps.
    pub ratio_vs_copy: Option<f64>,
    /// The sum with bf16 inputs accumulated in f32 (P·N·2 + 2·N·4 bytes).
    pub bf16_sum_gbps: Option<f64>,
    /// cuBLAS SGEMM as SF reconstruction (4096×4096 from P·256 factor rows).
    pub sgemm_gflops: Option<f64>,
    /// Pinned host→device.
    pub h2d_gbps: Option<f64>,
    /// Device→pinned host.
    pub d2h_gbps: Option<f64>,
    /// The kernel's result equals the CPU's bitwise on the bench's data.
    pub matches_cpu_bitwise: Option<bool>,
}

/// The result; `cpu_sum_gbps` and `triad_gbps` are the best repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct AggregateReport {
    pub inputs: usize,
    pub mib: usize,
    pub threads: usize,
    pub reps: usize,
    pub cpu_sum_gbps: f64,
    pub triad_gbps: f64,
    /// cpu_sum_gbps / triad_gbps.
    pub ratio: f64,
    pub cpu_sum_gbps_median: f64,
    pub triad_gbps_median: f64,
    pub gpu: GpuPart,
}

fn alloc(n: usize, v: f32, what: &str) -> Result<Vec<f32>, String> {
    let mut x = Vec::new();
    x.try_reserve_exact(n)
        .map_err(|_| format!("cannot allocate {} MiB for {what}", (n * 4) >> 20))?;
    x.resize(n, v);
    Ok(x)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs the measurement. `progress` hears one line per repetition.
pub fn aggregate(o: &AggregateOpts, mut progress: impl FnMut(&str)) -> Result<AggregateReport, String> {
    if !(1..=64).contains(&o.inputs) || !(1..=16384).contains(&o.mib) || o.threads == 0 || !(1..=1000).contains(&o.reps)
    {
        return Err("need 1..=64 inputs, 1..=16384 MiB, at least 1 thread and 1..=1000 repetitions".into());
    }
    let n = o.mib << 18; // f32 elements per MiB: 2^20 / 4
    let need_mib = (o.inputs + 1 + 3) * o.mib;
    if let Some(avail) = mem_available_mib() {
        if need_mib as u64 > avail {
            return Err(format!(
                "needs {need_mib} MiB ({} inputs + accumulator + 3 triad arrays of {} MiB), but only {avail} MiB are available",
                o.inputs, o.mib
            ));
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
        return Err("aggregation produced wrong values".into());
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
        match crate::cuda::bench::measure(o, |l| progress(l)) {
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
        let mut lines = 0;
        let r = aggregate(&o, |_| lines += 1).unwrap();
        assert_eq!(lines, 2);
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
            assert!(aggregate(&bad, |_| {}).is_err());
        }
        let huge = AggregateOpts {
            mib: 16384,
            inputs: 64,
            ..o
        };
        let e = aggregate(&huge, |_| {}).unwrap_err();
        assert!(e.contains("MiB"), "{e}");
    }
}
