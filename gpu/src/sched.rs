//! Nexus's aggregation scheduler: for each chunk, estimate how long the CPU
//! and the GPU would take to aggregate it, counting host↔device copies where
//! the data sits on the host and the work already queued on each, and pick
//! the sooner. The throughputs start from a calibration and follow what is
//! measured (an exponentially weighted moving average).
//!
//! ```
//! use tidewire_gpu::sched::{Exec, GpuRates, Scheduler, Task};
//! // A 2 GB/s CPU against a GPU behind a 20 GB/s link.
//! let mut s = Scheduler::with_gpu(2e9, GpuRates { add: 1e12, h2d: 20e9, d2h: 20e9, launch_s: 20e-6 });
//! let small = Task { bytes: 4 << 10, contributions: 4, on_host: true };
//! let large = Task { bytes: 64 << 20, contributions: 4, on_host: true };
//! assert_eq!(s.pick(&small).0, Exec::Cpu); // launches and copies dominate
//! assert_eq!(s.pick(&large).0, Exec::Gpu); // bandwidth dominates
//! ```

use serde::Serialize;

/// Where a chunk is aggregated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exec {
    /// On the CPU, in host memory.
    Cpu,
    /// On the GPU: contributions are copied in, the sum is copied out.
    Gpu,
}

/// A chunk's aggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Task {
    /// Bytes of one contribution (the chunk's size).
    pub bytes: usize,
    /// Contributions summed into it.
    pub contributions: usize,
    /// Whether the contributions sit in host memory (then the GPU pays for
    /// copying them in and the sum out).
    pub on_host: bool,
}

/// The GPU's throughputs, bytes per second, and its per-operation overhead.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuRates {
    /// Contribution bytes summed per second by the kernel.
    pub add: f64,
    /// Host→device copy.
    pub h2d: f64,
    /// Device→host copy.
    pub d2h: f64,
    /// Seconds of fixed cost per contribution (launch and synchronization).
    pub launch_s: f64,
}

/// Both estimates for a task, in seconds, each including the queue's wait.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    /// On the CPU.
    pub cpu_s: f64,
    /// On the GPU, when there is one.
    pub gpu_s: Option<f64>,
}

/// What the scheduler has seen; see [`Scheduler::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SchedStats {
    /// Chunks given to the CPU.
    pub cpu_picks: u64,
    /// Chunks given to the GPU.
    pub gpu_picks: u64,
    /// The CPU's current throughput estimate, bytes/s.
    pub cpu_add_bps: f64,
    /// The GPU's current estimates, when there is one.
    pub gpu: Option<GpuRates>,
}

/// Weight of a new measurement in the moving averages.
const ALPHA: f64 = 0.2;

fn ewma(old: &mut f64, new: f64) {
    if new.is_finite() && new > 0.0 {
        *old = (1.0 - ALPHA) * *old + ALPHA * new;
    }
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Scheduler {
    cpu_add: f64,
    gpu: Option<GpuRates>,
    /// Seconds of assigned, unfinished work on each executor.
    queued: [f64; 2],
    picks: [u64; 2],
}

/// A measurement to learn from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// CPU summation of contribution bytes.
    CpuAdd,
    /// GPU kernel summation of contribution bytes.
    GpuAdd,
    /// A host→device copy.
    H2d,
    /// A device→host copy.
    D2h,
}

impl Scheduler {
    /// A CPU-only scheduler: every chunk goes to the CPU.
    pub fn cpu_only(cpu_add_bps: f64) -> Self {
        Scheduler {
            cpu_add: cpu_add_bps.max(1.0),
            gpu: None,
            queued: [0.0; 2],
            picks: [0; 2],
        }
    }

    /// A scheduler that chooses between the CPU and a GPU.
    pub fn with_gpu(cpu_add_bps: f64, gpu: GpuRates) -> Self {
        Scheduler {
            gpu: Some(gpu),
            ..Self::cpu_only(cpu_add_bps)
        }
    }

    fn cpu_time(&self, t: &Task) -> f64 {
        (t.bytes * t.contributions) as f64 / self.cpu_add
    }

    fn gpu_time(&self, t: &Task) -> Option<f64> {
        let g = self.gpu?;
        let total = (t.bytes * t.contributions) as f64;
        let copies = if t.on_host {
            total / g.h2d + t.bytes as f64 / g.d2h
        } else {
            0.0
        };
        Some(total / g.add + copies + t.contributions as f64 * g.launch_s)
    }

    /// The time each executor would take to finish `t`, counting what is
    /// already queued on it.
    pub fn estimate(&self, t: &Task) -> Estimate {
        Estimate {
            cpu_s: self.queued[0] + self.cpu_time(t),
            gpu_s: self.gpu_time(t).map(|g| self.queued[1] + g),
        }
    }

    /// Picks the executor that finishes `t` sooner and queues `t`'s time on
    /// it; returns the executor and that time (hand it to [`Scheduler::done`]).
    pub fn pick(&mut self, t: &Task) -> (Exec, f64) {
        let e = self.estimate(t);
        let (exec, own) = match e.gpu_s {
            Some(g) if g < e.cpu_s => (Exec::Gpu, self.gpu_time(t).expect("a GPU")),
            _ => (Exec::Cpu, self.cpu_time(t)),
        };
        self.queued[exec as usize] += own;
        self.picks[exec as usize] += 1;
        (exec, own)
    }

    /// Forces `exec` for `t` (a policy override), still queuing its time;
    /// without a GPU, [`Exec::Gpu`] becomes [`Exec::Cpu`].
    pub fn assign(&mut self, t: &Task, exec: Exec) -> (Exec, f64) {
        let (exec, own) = match (exec, self.gpu_time(t)) {
            (Exec::Gpu, Some(g)) => (Exec::Gpu, g),
            _ => (Exec::Cpu, self.cpu_time(t)),
        };
        self.queued[exec as usize] += own;
        self.picks[exec as usize] += 1;
        (exec, own)
    }

    /// A task picked earlier has finished.
    pub fn done(&mut self, exec: Exec, est_s: f64) {
        let q = &mut self.queued[exec as usize];
        *q = (*q - est_s).max(0.0);
    }

    /// Learns from `bytes` moved or summed in `secs`.
    pub fn observe(&mut self, m: Measure, bytes: usize, secs: f64) {
        if secs <= 0.0 || bytes == 0 {
            return;
        }
        let bps = bytes as f64 / secs;
        match (m, self.gpu.as_mut()) {
            (Measure::CpuAdd, _) => ewma(&mut self.cpu_add, bps),
            (Measure::GpuAdd, Some(g)) => ewma(&mut g.add, bps),
            (Measure::H2d, Some(g)) => ewma(&mut g.h2d, bps),
            (Measure::D2h, Some(g)) => ewma(&mut g.d2h, bps),
            _ => {}
        }
    }

    /// Picks so far and the current estimates.
    pub fn stats(&self) -> SchedStats {
        SchedStats {
            cpu_picks: self.picks[0],
            gpu_picks: self.picks[1],
            cpu_add_bps: self.cpu_add,
            gpu: self.gpu,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu() -> GpuRates {
        GpuRates {
            add: 2e12,
            h2d: 25e9,
            d2h: 25e9,
            launch_s: 10e-6,
        }
    }

    #[test]
    fn small_chunks_stay_on_the_cpu_and_large_ones_move() {
        let s = Scheduler::with_gpu(5e9, gpu());
        let t = |bytes| Task {
            bytes,
            contributions: 8,
            on_host: true,
        };
        // 8 × 4 KiB: 6.6 µs on the CPU against 80 µs of launches.
        let e = s.estimate(&t(4096));
        assert!(e.cpu_s < e.gpu_s.unwrap(), "{e:?}");
        // 8 × 64 MiB: 107 ms on the CPU against 24 ms of copies.
        let e = s.estimate(&t(64 << 20));
        assert!(e.gpu_s.unwrap() < e.cpu_s / 3.0, "{e:?}");
        // The break-even lies between, and device-resident data moves sooner.
        let mut lo = 4096;
        while s.estimate(&t(lo)).cpu_s < s.estimate(&t(lo)).gpu_s.unwrap() {
            lo *= 2;
        }
        assert!((64 << 10..64 << 20).contains(&lo), "{lo}");
        let dev = Task {
            on_host: false,
            ..t(lo / 2)
        };
        let host = s.estimate(&t(lo / 2));
        let e = s.estimate(&dev);
        assert!(
            e.gpu_s.unwrap() < host.gpu_s.unwrap() && e.cpu_s == host.cpu_s,
            "{lo}: {e:?} {host:?}"
        );
    }

    #[test]
    fn queue_waits_shift_the_choice_and_drain() {
        let mut s = Scheduler::with_gpu(5e9, gpu());
        let big = Task {
            bytes: 64 << 20,
            contributions: 8,
            on_host: true,
        };
        let (e1, t1) = s.pick(&big);
        assert_eq!(e1, Exec::Gpu);
        // A GPU busy for a long time sends the next chunk to the CPU.
        let (_, est) = s.assign(&big, Exec::Gpu);
        for _ in 0..10 {
            s.assign(&big, Exec::Gpu);
        }
        let mid = Task {
            bytes: 1 << 20,
            contributions: 8,
            on_host: true,
        };
        assert_eq!(s.pick(&mid).0, Exec::Cpu);
        // Once the GPU's work is done, it wins again.
        s.done(Exec::Gpu, t1);
        for _ in 0..11 {
            s.done(Exec::Gpu, est);
        }
        assert_eq!(s.pick(&big).0, Exec::Gpu);
        let st = s.stats();
        assert_eq!((st.cpu_picks, st.gpu_picks), (1, 13));
    }

    #[test]
    fn measurements_move_the_estimates() {
        let mut s = Scheduler::with_gpu(5e9, gpu());
        let big = Task {
            bytes: 64 << 20,
            contributions: 8,
            on_host: true,
        };
        assert!(s.estimate(&big).cpu_s > s.estimate(&big).gpu_s.unwrap());
        // A link measured 100× slower than assumed makes the GPU lose.
        for _ in 0..40 {
            s.observe(Measure::H2d, 1 << 30, 4.0);
        }
        let e = s.estimate(&big);
        assert!(e.cpu_s < e.gpu_s.unwrap(), "{e:?}");
        assert!(s.stats().gpu.unwrap().h2d < 1e9);
        // Nonsense measurements are ignored.
        let before = s.stats();
        s.observe(Measure::CpuAdd, 0, 1.0);
        s.observe(Measure::CpuAdd, 100, 0.0);
        assert_eq!(s.stats(), before);
    }

    #[test]
    fn without_a_gpu_everything_is_cpu() {
        let mut s = Scheduler::cpu_only(1e9);
        let t = Task {
            bytes: 1 << 30,
            contributions: 32,
            on_host: false,
        };
        assert_eq!(s.estimate(&t).gpu_s, None);
        assert_eq!(s.pick(&t).0, Exec::Cpu);
        // 32 GiB at 1 GB/s: 34.4 s, queued on the CPU even when the GPU is asked for.
        let (exec, secs) = s.assign(&t, Exec::Gpu);
        assert_eq!(exec, Exec::Cpu);
        assert!((secs - 34.359_738_368).abs() < 1e-6, "{secs}");
        assert!((s.estimate(&t).cpu_s - 3.0 * secs).abs() < 1e-6);
    }
}
