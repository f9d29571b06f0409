//! The synthetic workload: deterministic data ([`Synth`]), digests, and the
//! calibrated compute time a worker sleeps for.

use std::time::Duration;

use sha2::{Digest, Sha256};

/// Deterministic synthetic data: every value is a table entry picked by a
/// hash of (worker, iteration, layer), so the reference can recompute it.
#[derive(Debug, Clone)]
pub struct Synth {
    table: Vec<f32>,
    seed: u64,
    /// Per layer: the fraction of 64-element rows of its gradient that is nonzero (none: all).
    pub density: Vec<f64>,
}

const TABLE: usize = 1 << 16;

pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Synth {
    /// The table for `seed`: values in [-0.01, 0.01).
    pub fn new(seed: u64) -> Self {
        let table = (0..TABLE as u64)
            .map(|i| ((mix(seed ^ (i << 1)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02)
            .collect();
        Synth {
            table,
            seed,
            density: Vec::new(),
        }
    }
    fn fill(&self, out: &mut [f32], key: u64) {
        let off = (mix(self.seed ^ key) as usize) & (TABLE - 1);
        let mut i = 0;
        while i < out.len() {
            let start = (off + i) & (TABLE - 1);
            let n = (TABLE - start).min(out.len() - i);
            out[i..i + n].copy_from_slice(&self.table[start..start + n]);
            i += n;
        }
    }
    fn key(wi: usize, iter: u64, layer: u32, salt: u64) -> u64 {
        (wi as u64) << 48 ^ iter << 24 ^ u64::from(layer) << 4 ^ salt
    }
    /// Initial parameters of `layer`.
    pub fn init(&self, layer: u32, out: &mut [f32]) {
        self.fill(out, Self::key(0, u64::MAX >> 24, layer, 1));
    }
    /// Worker `wi`'s gradient of a conv/other layer at `iter`.
    pub fn grad(&self, wi: usize, iter: u64, layer: u32, out: &mut [f32]) {
        self.fill(out, Self::key(wi, iter, layer, 2));
        let d = self.density.get(layer as usize).copied().unwrap_or(1.0);
        if d < 1.0 {
            let key = self.seed ^ Self::key(wi, iter, layer, 5);
            for (r, row) in out.chunks_mut(64).enumerate() {
                if ((mix(key ^ ((r as u64) << 8)) >> 11) as f64 / (1u64 << 53) as f64) >= d {
                    row.fill(0.0);
                }
            }
        }
    }
    /// Worker `wi`'s sufficient factors of an FC layer at `iter`.
    pub fn factors(&self, wi: usize, iter: u64, layer: u32, u: &mut [f32], v: &mut [f32]) {
        self.fill(u, Self::key(wi, iter, layer, 3));
        self.fill(v, Self::key(wi, iter, layer, 4));
    }
}

/// SHA-256 of a layer's values.
pub fn digest(v: &[f32]) -> String {
    let mut h = Sha256::new();
    let mut bytes = Vec::with_capacity(16 << 12);
    for block in v.chunks(16 << 10) {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|x| x.to_le_bytes()));
        h.update(&bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn sleep(d: Duration) {
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}

/// The emulated accelerator: the layers' compute on a timeline of its own,
/// back to back, as a GPU runs the kernels a training framework has queued.
/// The worker thread's work between two layers (writing the synthetic
/// gradient, handing it in) overlaps the next layer's compute instead of
/// adding to it, and a sleep that wakes late is taken back from the next
/// one. Only input that arrives late stalls the timeline
/// ([`Stream::input_at`]): a layer's parameters from the servers.
///
/// With a plain sleep per layer, ResNet-50's 107 layers on the 2-core VM ran
/// 0.344 s an iteration for 0.260 s of compute while blocked 0.01 s (wfbp,
/// 2 workers + 2 servers, loopback): the wake-ups' lateness and the
/// gradients' writing, which a GPU run overlaps and `tidewire sim` does not
/// charge, made a third of a compute-bound iteration's time.
#[derive(Debug, Default)]
pub(crate) struct Stream {
    /// When the compute queued so far ends (none yet: starts when run).
    due: std::cell::Cell<Option<std::time::Instant>>,
}

impl Stream {
    /// The next layer's input arrived at `at`: its compute starts no earlier.
    pub(crate) fn input_at(&self, at: std::time::Instant) {
        self.due.set(Some(self.due.get().map_or(at, |d| d.max(at))));
    }

    /// Queues `d` of compute after what is queued, and returns when it is done.
    pub(crate) fn run(&self, d: Duration) {
        let due = self.due.get().unwrap_or_else(std::time::Instant::now) + d;
        self.due.set(Some(due));
        sleep(due.saturating_duration_since(std::time::Instant::now()));
    }
}
