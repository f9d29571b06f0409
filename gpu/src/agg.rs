//! The server's aggregator: sums each chunk's contributions on the CPU or,
//! when built with `cuda` and a GPU is usable, on the GPU, as the
//! [`Scheduler`] decides per chunk (Nexus).
//!
//! A chunk is placed when its first contribution arrives and stays there
//! until [`Aggregator::finish`], which leaves the sum in the caller's host
//! accumulator either way. Contributions are added in call order with plain
//! f32 additions on both executors, so the placement never changes the bits.
//!
//! ```
//! use tidewire_gpu::agg::{Aggregator, Policy};
//! let mut agg = Aggregator::new(Policy::Cpu).unwrap();
//! let mut acc = vec![0.0f32; 8];
//! let key = 7; // (window, chunk), as the caller numbers them
//! agg.accumulate(key, 2, &mut acc, 0, &[1.0; 8], true).unwrap();
//! agg.accumulate(key, 2, &mut acc, 4, &[2.0; 4], false).unwrap();
//! agg.finish(key, &mut acc).unwrap();
//! assert_eq!(acc, [1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0]);
//! ```

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;

use crate::cpu;
use crate::sched::{Exec, Measure, SchedStats, Scheduler, Task};

/// Where chunks may be aggregated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Always the CPU.
    Cpu,
    /// Always the GPU; an error when there is none.
    Gpu,
    /// The scheduler decides per chunk; the CPU when there is no GPU.
    Auto,
}

impl std::str::FromStr for Policy {
    type Err = AggError;
    fn from_str(s: &str) -> Result<Self, AggError> {
        match s {
            "cpu" => Ok(Policy::Cpu),
            "gpu" => Ok(Policy::Gpu),
            "auto" => Ok(Policy::Auto),
            _ => Err(AggError::UnknownPolicy(s.to_string())),
        }
    }
}

/// Why the aggregator cannot run as asked.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum AggError {
    /// `Policy::Gpu` with no usable GPU.
    #[error("GPU aggregation requested, but {0}")]
    NoGpu(String),
    /// A GPU operation failed.
    #[error("GPU aggregation failed: {0}")]
    Gpu(String),
    /// Arguments that do not fit the chunk.
    #[error("aggregation: {0}")]
    Invalid(String),
    /// A policy name other than cpu, gpu or auto.
    #[error("aggregation policy `{0}`: expected cpu, gpu or auto")]
    UnknownPolicy(String),
}

/// Counters, for stats and the bench.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AggStats {
    /// The scheduler's picks and throughput estimates.
    pub sched: SchedStats,
    /// Contribution bytes summed on each executor.
    pub cpu_bytes: u64,
    /// Contribution bytes summed on the GPU.
    pub gpu_bytes: u64,
    /// Why the GPU is not used, when it is not.
    pub gpu_note: Option<String>,
}

#[derive(Debug, Clone, Copy)]
struct Placement {
    exec: Exec,
    est_s: f64,
}

/// Refuses `len` values at `off` that run past a chunk of `acc_len`.
fn in_chunk(off: usize, len: usize, acc_len: usize) -> Result<(), AggError> {
    match off.checked_add(len) {
        Some(end) if end <= acc_len => Ok(()),
        _ => Err(AggError::Invalid(format!(
            "{len} elements at {off} past the chunk's {acc_len}"
        ))),
    }
}

/// `src` into `dst` on this thread: copied for a first contribution, else
/// added; returns how long it took.
fn cpu_sum(dst: &mut [f32], src: &[f32], first: bool) -> std::time::Duration {
    let t = Instant::now();
    if first {
        dst.copy_from_slice(src);
    } else {
        cpu::add_assign(dst, src);
    }
    t.elapsed()
}

/// See the module docs.
#[derive(Debug)]
pub struct Aggregator {
    sched: Scheduler,
    policy: Policy,
    placed: HashMap<u64, Placement>,
    cpu_bytes: u64,
    gpu_bytes: u64,
    gpu_note: Option<String>,
    #[cfg(feature = "cuda")]
    gpu: Option<gpu_side::GpuSide>,
}

/// The CPU's assumed summation rate where no GPU competes (unused for choices).
const NOMINAL_CPU_BPS: f64 = 5e9;

/// Operations smaller than this are not timed (the clock would dominate).
const MIN_TIMED: usize = 256 << 10;

/// Values [`Aggregator::accumulate_from`] reads and adds at a time on the CPU:
/// 16 KiB, a block that stays in the L1 cache between its read and its add
/// (4,096 and 16,384 values measured within 5% of each other).
pub const READ_BLOCK: usize = 4096;

/// The CPU's summation throughput, bytes of contribution per second, measured
/// on 8 MiB.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn calibrate_cpu() -> f64 {
    let n = 2 << 20;
    let src = vec![1.0f32; n];
    let mut acc = vec![0.0f32; n];
    cpu::add_assign(&mut acc, &src);
    let t = Instant::now();
    cpu::add_assign(&mut acc, &src);
    (n * 4) as f64 / t.elapsed().as_secs_f64().max(1e-9)
}

impl Aggregator {
    /// An aggregator for `policy`. With `Auto` and no usable GPU it runs on
    /// the CPU and says why in [`AggStats::gpu_note`].
    pub fn new(policy: Policy) -> Result<Self, AggError> {
        Self::with_gpu_options(policy, Default::default())
    }

    /// As [`Aggregator::new`], with the GPU opened as `opts` says (ignored
    /// without the `cuda` feature).
    pub fn with_gpu_options(policy: Policy, opts: GpuChoice) -> Result<Self, AggError> {
        // The CPU's rate only matters against a GPU: measured once one opens.
        let mut a = Aggregator {
            sched: Scheduler::cpu_only(NOMINAL_CPU_BPS),
            policy,
            placed: HashMap::new(),
            cpu_bytes: 0,
            gpu_bytes: 0,
            gpu_note: None,
            #[cfg(feature = "cuda")]
            gpu: None,
        };
        if policy == Policy::Cpu {
            a.gpu_note = Some("aggregation policy is cpu".into());
            return Ok(a);
        }
        #[cfg(feature = "cuda")]
        {
            match gpu_side::GpuSide::open(opts) {
                Ok((side, rates)) => {
                    a.sched = Scheduler::with_gpu(calibrate_cpu(), rates);
                    a.gpu = Some(side);
                }
                Err(why) => a.gpu_note = Some(why),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = opts;
            a.gpu_note = Some("built without the `cuda` feature".into());
        }
        match (&a.gpu_note, policy) {
            (Some(why), Policy::Gpu) => Err(AggError::NoGpu(why.clone())),
            _ => Ok(a),
        }
    }

    /// Where chunks go, in a line: for logs and `stats`.
    pub fn describe(&self) -> String {
        match &self.gpu_note {
            Some(why) => format!("aggregation on the CPU ({why})"),
            None => format!(
                "aggregation {:?} between the CPU and {}",
                self.policy,
                self.gpu_name().unwrap_or_default()
            ),
        }
    }

    fn gpu_name(&self) -> Option<String> {
        #[cfg(feature = "cuda")]
        {
            self.gpu.as_ref().map(|g| g.name())
        }
        #[cfg(not(feature = "cuda"))]
        None
    }

    /// Adds `src` into `acc[off..off + src.len()]`, where `acc` is the
    /// chunk's whole host accumulator and `key` names the chunk (and its
    /// window) until [`Aggregator::finish`]. `first` copies instead of adding
    /// (the first contribution to those elements). `contributions` is how many
    /// the chunk will receive, for the placement estimate.
    pub fn accumulate(
        &mut self,
        key: u64,
        contributions: usize,
        acc: &mut [f32],
        off: usize,
        src: &[f32],
        first: bool,
    ) -> Result<(), AggError> {
        in_chunk(off, src.len(), acc.len())?;
        let place = self.place(key, contributions, acc.len())?;
        match place.exec {
            Exec::Cpu => {
                let took = cpu_sum(&mut acc[off..off + src.len()], src, first);
                self.cpu_done(src.len(), first, took);
            }
            Exec::Gpu => self.gpu_add(key, off, src, first)?,
        }
        Ok(())
    }

    /// Counts `len` values summed on the CPU in `took`, and gives the
    /// scheduler the rate of an add (a first contribution's copy is not one).
    fn cpu_done(&mut self, len: usize, first: bool, took: std::time::Duration) {
        self.cpu_bytes += len as u64 * 4;
        if len * 4 >= MIN_TIMED && !first {
            self.sched.observe(Measure::CpuAdd, len * 4, took.as_secs_f64());
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(unused_variables, clippy::unused_self))]
    fn gpu_add(&mut self, key: u64, off: usize, src: &[f32], first: bool) -> Result<(), AggError> {
        #[cfg(feature = "cuda")]
        {
            let g = self.gpu.as_mut().expect("GPU placement needs a GPU");
            let (h2d, add) = g.add(key, off, src, first).map_err(AggError::Gpu)?;
            self.gpu_bytes += src.len() as u64 * 4;
            if src.len() * 4 >= MIN_TIMED {
                self.sched.observe(Measure::H2d, src.len() * 4, h2d);
                self.sched.observe(Measure::GpuAdd, src.len() * 4, add);
            }
        }
        Ok(())
    }

    /// [`Aggregator::accumulate`] of `len` values that `read(at, dst)` copies
    /// out (values `at .. at + dst.len()` of the contribution), for a source
    /// that may not be viewed as a slice (memory a peer writes). On the CPU
    /// they are read and added [`READ_BLOCK`] values at a time into a block of
    /// `scratch` that stays in the L1 cache (21 MB read and added in 3.6 ms,
    /// against 4.5 ms read whole and then added, on the 2-core VM); on the GPU
    /// they are read whole into `scratch`, `read` is dropped, and they are
    /// copied over at once. A failed read returns its error with the values
    /// before it already summed into `acc` (as a failed `accumulate` on the
    /// GPU may leave them): the caller treats the sum as lost.
    #[allow(clippy::too_many_arguments)]
    pub fn accumulate_from<E: From<AggError>>(
        &mut self,
        key: u64,
        contributions: usize,
        acc: &mut [f32],
        off: usize,
        len: usize,
        first: bool,
        scratch: &mut Vec<f32>,
        mut read: impl FnMut(usize, &mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        in_chunk(off, len, acc.len())?;
        let place = self.place(key, contributions, acc.len())?;
        match place.exec {
            Exec::Cpu => {
                if scratch.len() < READ_BLOCK.min(len) {
                    scratch.resize(READ_BLOCK.min(len), 0.0);
                }
                // The scheduler's CPU rate is the adds' alone, as `accumulate` times them
                // (the GPU's is its copy and kernel): the reads are not timed.
                let mut adding = std::time::Duration::ZERO;
                let dst = &mut acc[off..off + len];
                for (b, d) in dst.chunks_mut(READ_BLOCK).enumerate() {
                    let blk = &mut scratch[..d.len()];
                    read(b * READ_BLOCK, blk)?;
                    adding += cpu_sum(d, blk, first);
                }
                self.cpu_done(len, first, adding);
            }
            Exec::Gpu => {
                if scratch.len() < len {
                    scratch.resize(len, 0.0);
                }
                read(0, &mut scratch[..len])?;
                // Whatever the reader holds (a lock on the source) is let go before the copy
                // to the device and the kernel.
                drop(read);
                self.gpu_add(key, off, &scratch[..len], first)?;
            }
        }
        Ok(())
    }

    /// Where chunk `key` (of `acc_len` values) is summed: decided at its first
    /// contribution, then kept until [`Aggregator::finish`].
    fn place(&mut self, key: u64, contributions: usize, acc_len: usize) -> Result<Placement, AggError> {
        if let Some(p) = self.placed.get(&key) {
            return Ok(*p);
        }
        let task = Task {
            bytes: acc_len * 4,
            contributions: contributions.max(1),
            on_host: true,
        };
        let (exec, est_s) = match self.policy {
            Policy::Auto => self.sched.pick(&task),
            Policy::Gpu => self.sched.assign(&task, Exec::Gpu),
            Policy::Cpu => self.sched.assign(&task, Exec::Cpu),
        };
        let p = Placement { exec, est_s };
        #[cfg(feature = "cuda")]
        if exec == Exec::Gpu {
            self.gpu
                .as_mut()
                .expect("GPU placement needs a GPU")
                .begin(key, acc_len)
                .map_err(AggError::Gpu)?;
        }
        self.placed.insert(key, p);
        Ok(p)
    }

    /// Leaves chunk `key`'s sum in `acc` (copying it back from the GPU when
    /// it was placed there) and forgets the placement. A key never
    /// accumulated is a no-op.
    pub fn finish(&mut self, key: u64, acc: &mut [f32]) -> Result<(), AggError> {
        let Some(p) = self.placed.remove(&key) else {
            return Ok(());
        };
        self.sched.done(p.exec, p.est_s);
        #[cfg(feature = "cuda")]
        if p.exec == Exec::Gpu {
            let g = self.gpu.as_mut().expect("GPU placement needs a GPU");
            let d2h = g.end(key, acc).map_err(AggError::Gpu)?;
            if acc.len() * 4 >= MIN_TIMED {
                self.sched.observe(Measure::D2h, acc.len() * 4, d2h);
            }
        }
        let _ = acc;
        Ok(())
    }

    /// Counters and estimates.
    pub fn stats(&self) -> AggStats {
        AggStats {
            sched: self.sched.stats(),
            cpu_bytes: self.cpu_bytes,
            gpu_bytes: self.gpu_bytes,
            gpu_note: self.gpu_note.clone(),
        }
    }
}

/// Which GPU an [`Aggregator`] opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuChoice {
    /// Device ordinal.
    pub ordinal: usize,
    /// Deterministic mode (see `cuda::GpuOptions::deterministic`).
    pub deterministic: bool,
}

impl Default for GpuChoice {
    fn default() -> Self {
        GpuChoice {
            ordinal: 0,
            deterministic: true,
        }
    }
}

#[cfg(feature = "cuda")]
mod gpu_side {
    use std::collections::HashMap;
    use std::time::Instant;

    use super::GpuChoice;
    use crate::cuda::{DeviceBuffer, Gpu, GpuOptions};
    use crate::sched::GpuRates;

    /// The GPU half of an aggregator: device accumulators per placed chunk,
    /// recycled by size, and one staging buffer for incoming contributions.
    #[derive(Debug)]
    pub(super) struct GpuSide {
        gpu: Gpu,
        accs: HashMap<u64, DeviceBuffer<f32>>,
        free: Vec<DeviceBuffer<f32>>,
        staging: Option<DeviceBuffer<f32>>,
    }

    impl GpuSide {
        pub(super) fn open(c: GpuChoice) -> Result<(GpuSide, GpuRates), String> {
            let gpu = Gpu::open(GpuOptions {
                ordinal: c.ordinal,
                streams: 2,
                deterministic: c.deterministic,
            })
            .map_err(|e| e.to_string())?;
            // Calibrate on 16 MiB: copies from pageable memory, as contributions arrive.
            let n = 4 << 20;
            let host = vec![1.0f32; n];
            let err = |e: crate::cuda::CudaError| e.to_string();
            let mut a = gpu.upload(&host).map_err(err)?;
            let x = gpu.upload(&host).map_err(err)?;
            let mut back = vec![0.0f32; n];
            let h2d = gpu.time_ms(|| gpu.copy_in(&mut a, 0, &host)).map_err(err)?;
            let add = gpu.time_ms(|| gpu.sum_into(&mut a, 0, &[&x], false)).map_err(err)?;
            let d2h = gpu.time_ms(|| gpu.copy_out(&a, 0, &mut back)).map_err(err)?;
            let tiny = gpu.upload(&host[..1024]).map_err(err)?;
            let mut t = gpu.alloc::<f32>(1024).map_err(err)?;
            let launch = gpu.time_ms(|| gpu.sum_into(&mut t, 0, &[&tiny], false)).map_err(err)?;
            let bytes = (n * 4) as f64;
            let rates = GpuRates {
                add: bytes / (add / 1e3).max(1e-9),
                h2d: bytes / (h2d / 1e3).max(1e-9),
                d2h: bytes / (d2h / 1e3).max(1e-9),
                launch_s: launch / 1e3,
            };
            Ok((
                GpuSide {
                    gpu,
                    accs: HashMap::new(),
                    free: Vec::new(),
                    staging: None,
                },
                rates,
            ))
        }

        pub(super) fn name(&self) -> String {
            format!("GPU {} {}", self.gpu.info().ordinal, self.gpu.info().name)
        }

        pub(super) fn begin(&mut self, key: u64, len: usize) -> Result<(), String> {
            let buf = match self.free.iter().position(|b| b.len() == len) {
                Some(i) => self.free.swap_remove(i),
                None => self.gpu.alloc::<f32>(len).map_err(|e| e.to_string())?,
            };
            self.accs.insert(key, buf);
            Ok(())
        }

        /// Copies `src` in and adds it at `off`; returns (copy, add) seconds.
        pub(super) fn add(&mut self, key: u64, off: usize, src: &[f32], first: bool) -> Result<(f64, f64), String> {
            let err = |e: crate::cuda::CudaError| e.to_string();
            if self.staging.as_ref().map_or(true, |s| s.len() != src.len()) {
                self.staging = Some(self.gpu.alloc::<f32>(src.len()).map_err(err)?);
            }
            let staging = self.staging.as_mut().expect("set above");
            let t = Instant::now();
            self.gpu.copy_in(staging, 0, src).map_err(err)?;
            let h2d = t.elapsed().as_secs_f64();
            let acc = self.accs.get_mut(&key).ok_or("chunk not placed")?;
            let t = Instant::now();
            self.gpu.sum_into(acc, off, &[&*staging], first).map_err(err)?;
            Ok((h2d, t.elapsed().as_secs_f64()))
        }

        /// Copies the sum out; returns the copy's seconds.
        pub(super) fn end(&mut self, key: u64, acc: &mut [f32]) -> Result<f64, String> {
            let buf = self.accs.remove(&key).ok_or("chunk not placed")?;
            let t = Instant::now();
            let r = self.gpu.copy_out(&buf, 0, acc).map_err(|e| e.to_string());
            self.free.push(buf);
            r.map(|()| t.elapsed().as_secs_f64())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_policy_sums_in_call_order_and_counts() {
        let mut a = Aggregator::new(Policy::Cpu).unwrap();
        assert!(a.describe().contains("CPU"), "{}", a.describe());
        let mut acc = vec![9.0f32; 6];
        a.accumulate(1, 3, &mut acc, 0, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], true)
            .unwrap();
        a.accumulate(1, 3, &mut acc, 0, &[0.5; 6], false).unwrap();
        a.accumulate(1, 3, &mut acc, 2, &[1.0; 4], false).unwrap();
        a.finish(1, &mut acc).unwrap();
        assert_eq!(acc, [1.5, 2.5, 4.5, 5.5, 6.5, 7.5]);
        let s = a.stats();
        assert_eq!((s.sched.cpu_picks, s.sched.gpu_picks), (1, 0));
        assert_eq!(s.cpu_bytes, 4 * (6 + 6 + 4));
        // Past the chunk: refused, nothing written.
        let before = acc.clone();
        assert!(matches!(
            a.accumulate(2, 1, &mut acc, 4, &[1.0; 4], false),
            Err(AggError::Invalid(_))
        ));
        assert_eq!(acc, before);
        // An unknown key finishes as a no-op.
        a.finish(99, &mut acc).unwrap();
    }

    #[test]
    fn reading_in_blocks_sums_the_bits_a_slice_does() {
        // Lengths around the block, at offsets inside the chunk: the same bits as
        // `accumulate` of the whole slice, the reader asked for every value once,
        // in order, and a reader's error stops the sum where it stood.
        let n = 3 * READ_BLOCK + 17;
        let vals = |seed: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 1000) as f32 * 0.37 - 150.0)
                .collect()
        };
        for (len, off) in [
            (0, 0),
            (1, 3),
            (READ_BLOCK - 1, 1),
            (READ_BLOCK, 0),
            (READ_BLOCK + 1, 5),
            (n - 9, 9),
        ] {
            let mut whole = Aggregator::new(Policy::Cpu).unwrap();
            let mut blocks = Aggregator::new(Policy::Cpu).unwrap();
            let (mut a, mut b) = (vec![1.5f32; n], vec![1.5f32; n]);
            let mut scratch = Vec::new();
            for (k, first) in [(1u32, true), (2, false), (3, false)] {
                let src = vals(k);
                whole.accumulate(7, 3, &mut a, off, &src[..len], first).unwrap();
                let mut next = 0;
                blocks
                    .accumulate_from(7, 3, &mut b, off, len, first, &mut scratch, |at, dst| {
                        assert_eq!(at, next, "read in order, each value once");
                        next += dst.len();
                        dst.copy_from_slice(&src[at..at + dst.len()]);
                        Ok::<_, AggError>(())
                    })
                    .unwrap();
                assert_eq!(next, len);
            }
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{len} at {off}"
            );
            assert!(scratch.len() <= READ_BLOCK, "{}", scratch.len());
            assert_eq!(whole.stats().cpu_bytes, blocks.stats().cpu_bytes);
        }
        let mut a = Aggregator::new(Policy::Cpu).unwrap();
        let mut acc = vec![0f32; 2 * READ_BLOCK];
        let r = a.accumulate_from(1, 2, &mut acc, 0, 2 * READ_BLOCK, false, &mut Vec::new(), |at, dst| {
            if at > 0 {
                return Err(AggError::Invalid("torn".into()));
            }
            dst.fill(1.0);
            Ok(())
        });
        assert!(matches!(r, Err(AggError::Invalid(ref m)) if m == "torn"), "{r:?}");
        assert!(acc[..READ_BLOCK].iter().all(|&v| v == 1.0) && acc[READ_BLOCK..].iter().all(|&v| v == 0.0));
        // Past the chunk: refused before anything is read.
        let r = a.accumulate_from(2, 1, &mut acc, 1, 2 * READ_BLOCK, false, &mut Vec::new(), |_, _| {
            panic!("read past the chunk")
        });
        assert!(matches!(r, Err::<(), AggError>(AggError::Invalid(_))));
    }

    #[test]
    fn auto_without_a_gpu_says_why_and_gpu_policy_refuses() {
        let a = Aggregator::new(Policy::Auto).unwrap();
        let note = a.stats().gpu_note;
        if cfg!(feature = "cuda") && note.is_none() {
            // A GPU is present: Auto may use it.
            return;
        }
        let note = note.expect("no GPU: a reason");
        assert!(
            note.contains("cuda") || note.contains("CUDA") || note.contains("GPU") || note.contains("NVRTC"),
            "{note}"
        );
        let e = Aggregator::new(Policy::Gpu).unwrap_err();
        assert!(e.to_string().starts_with("GPU aggregation requested, but "), "{e}");
        crate::print_skip("GPU aggregation", &note);
    }

    #[test]
    fn policy_parses() {
        assert_eq!("auto".parse::<Policy>().unwrap(), Policy::Auto);
        let e = "fpga".parse::<Policy>().unwrap_err();
        assert!(matches!(&e, AggError::UnknownPolicy(p) if p == "fpga"), "{e:?}");
        assert!(e.to_string().contains("cpu, gpu or auto"), "{e}");
    }
}
