//! Nexus's local aggregator: several learners on one node (one per GPU or
//! process) behind one Tidewire rank.
//!
//! The node's leader (local rank 0) runs the [`Session`](crate::Session); the
//! other learners attach to a [`LocalGroup`] in shared memory
//! ([`tidewire_transport::shm`], a file in `/dev/shm`). Per layer and
//! iteration:
//!
//! 1. every learner `j ≥ 1` writes its gradient (or its sufficient factors) into
//!    its own slot with [`LocalLearner::hand_in`], in place, and marks it ready;
//! 2. the leader sums the slots into the session's registered gradient buffer
//!    in local-rank order, after its own gradient ([`LocalGroup::sum_into`]), or
//!    stacks the factors ([`LocalGroup::stack_into`]), and hands the layer in
//!    once: the node's NIC carries one copy, not `L`;
//! 3. when the layer's new parameters arrive, the leader writes them once into
//!    the parameter cache ([`LocalGroup::publish`]) and every learner copies them
//!    out ([`LocalLearner::params`]).
//!
//! Gradients hard-sync within the node (Nexus's hybrid groups: every node sum
//! holds all `L` learners of that iteration). Parameters come from the cache:
//! a learner asks for the version it needs, `iteration - staleness`, and gets
//! the newest cached one at or above it without waiting for anything newer —
//! so with a staleness bound a slow learner takes the newest cached
//! parameters instead of waiting, and a fast one waits only at the bound.
//!
//! The sum order (own gradient, then learners 1..L in order) is what a flat
//! run's servers use with [`SchedConfig::fold_group`](crate::engine::SchedConfig)
//! `= L`, so the two give bitwise the same parameters.
//!
//! Nothing here blocks forever: every wait checks the leader's abort word and
//! gives up with [`Error::Timeout`] after the group's timeout.
//!
//! ```no_run
//! # fn main() -> tidewire::Result<()> {
//! use std::time::Duration;
//! use tidewire::local::{LocalGroup, LocalLayout, LocalLearner};
//! let layout = LocalLayout::new(2, vec![4], vec![4]);
//! let path = std::path::Path::new("/dev/shm/tidewire-demo");
//! // Leader (local rank 0):
//! let group = LocalGroup::create(path, 42, &layout, Duration::from_secs(30))?;
//! // Learner 1, in another process:
//! let me = LocalLearner::attach(path, 42, &layout, 1, Duration::from_secs(30))?;
//! me.hand_in(0, 0, &[&[1.0, 2.0, 3.0, 4.0][..]])?;
//! let mut grad = vec![0.5f32; 4]; // the leader's own gradient
//! group.sum_into(0, 0, &mut grad)?; // 1.5, 2.5, 3.5, 4.5
//! group.publish(0, 1, &grad)?;
//! let mut params = vec![0f32; 4];
//! me.params(0, 1, &mut params)?;
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tidewire_transport::shm::SharedMem;

use crate::error::{Error, Result};

const MAGIC: u64 = 0x7469_6465_6c6f_6331; // "tidelocl"
const W_MAGIC: usize = 0;
const W_NONCE: usize = 1;
const W_LAYOUT: usize = 2;
const W_ABORT: usize = 3;
/// The leader's process id, so learners notice a leader that died.
const W_PID: usize = 4;
const HEADER: usize = 8;

/// The shape of a node's shared memory: learners, and per layer the
/// parameter count and the slot size (the gradient, or U and V when larger).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalLayout {
    learners: usize,
    params: Vec<usize>,
    slots: Vec<usize>,
    cache_off: Vec<usize>,
    slot_off: Vec<usize>,
    floats: usize,
}

impl LocalLayout {
    /// `learners` on the node (the leader included), each layer's parameter
    /// count and slot size in f32.
    pub fn new(learners: usize, params: Vec<usize>, slots: Vec<usize>) -> Self {
        assert_eq!(params.len(), slots.len(), "one slot size per layer");
        let mut off = 0;
        let cache_off = params
            .iter()
            .map(|&n| {
                let o = off;
                off += n;
                o
            })
            .collect();
        let per_learner: usize = slots.iter().sum();
        let mut o = off;
        let slot_off = slots
            .iter()
            .map(|&n| {
                let s = o;
                o += n;
                s
            })
            .collect();
        let floats = off + per_learner * learners.saturating_sub(1);
        LocalLayout {
            learners,
            params,
            slots,
            cache_off,
            slot_off,
            floats,
        }
    }

    /// Learners on the node.
    pub fn learners(&self) -> usize {
        self.learners
    }

    fn layers(&self) -> usize {
        self.params.len()
    }

    fn words(&self) -> usize {
        HEADER + self.layers() * (2 + self.learners)
    }

    fn hash(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for v in std::iter::once(self.learners)
            .chain(self.params.iter().copied())
            .chain(self.slots.iter().copied())
        {
            for b in (v as u64).to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }

    /// Parameter cache version word of layer `l`: 0 before the first
    /// publish, else `2·(version + 1)` when stable (odd while being written).
    fn w_seq(&self, l: usize) -> usize {
        HEADER + l
    }
    /// The iteration + 1 whose slots of layer `l` the leader has consumed.
    fn w_taken(&self, l: usize) -> usize {
        HEADER + self.layers() + l
    }
    /// The iteration + 1 whose gradient of layer `l` learner `j` has in its slot.
    fn w_ready(&self, j: usize, l: usize) -> usize {
        HEADER + self.layers() * (2 + j) + l
    }
    fn slot(&self, j: usize, l: usize) -> std::ops::Range<usize> {
        let per: usize = self.slots.iter().sum();
        let s = self.slot_off[l] + (j - 1) * per;
        s..s + self.slots[l]
    }
    fn cache(&self, l: usize) -> std::ops::Range<usize> {
        self.cache_off[l]..self.cache_off[l] + self.params[l]
    }
}

fn local_err(what: String) -> Error {
    Error::Local(what)
}

/// Copies cells out (relaxed loads: other processes may be writing them).
fn load(cells: &[AtomicU32], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(cells) {
        *d = f32::from_bits(c.load(Ordering::Relaxed));
    }
}

fn store(cells: &[AtomicU32], src: &[f32]) {
    for (c, s) in cells.iter().zip(src) {
        c.store(s.to_bits(), Ordering::Relaxed);
    }
}

struct Waiter {
    start: Instant,
    timeout: Duration,
    spins: u32,
}

impl Waiter {
    fn new(timeout: Duration) -> Self {
        Waiter {
            start: Instant::now(),
            timeout,
            spins: 0,
        }
    }
    /// One more round of waiting; an error once the timeout passed or the
    /// leader aborted.
    fn pause(&mut self, mem: &SharedMem, what: impl FnOnce() -> String) -> Result<()> {
        if mem.words()[W_ABORT].load(Ordering::Acquire) != 0 {
            return Err(local_err(format!(
                "the node's leader gave up (while waiting for {})",
                what()
            )));
        }
        if self.spins % 2048 == 0 {
            // Every ~100 ms of sleeping: a leader that died cannot say so.
            let pid = mem.words()[W_PID].load(Ordering::Relaxed);
            if pid != 0
                && pid != u64::from(std::process::id())
                && Path::new("/proc/self").exists()
                && !Path::new(&format!("/proc/{pid}")).exists()
            {
                return Err(local_err(format!(
                    "the node's leader (process {pid}) is gone (while waiting for {})",
                    what()
                )));
            }
        }
        if self.start.elapsed() > self.timeout {
            return Err(Error::Timeout {
                what: what(),
                after: self.timeout,
            });
        }
        self.spins += 1;
        if self.spins < 64 {
            std::hint::spin_loop();
        } else if self.spins < 256 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }
}

/// The leader's side of a node's local group (local rank 0).
#[derive(Debug)]
pub struct LocalGroup {
    mem: SharedMem,
    layout: LocalLayout,
    timeout: Duration,
    path: PathBuf,
}

impl LocalGroup {
    /// Creates the node's shared memory at `path` for this run (`nonce`
    /// tells it from an earlier run's file). Learners may attach before or after.
    pub fn create(path: &Path, nonce: u64, layout: &LocalLayout, timeout: Duration) -> Result<Self> {
        if layout.learners == 0 {
            return Err(local_err("a node needs at least one learner".into()));
        }
        let mem = SharedMem::create(path, layout.words(), layout.floats.max(1))
            .map_err(|e| local_err(format!("cannot create {}: {e}", path.display())))?;
        let w = mem.words();
        w[W_NONCE].store(nonce, Ordering::Relaxed);
        w[W_LAYOUT].store(layout.hash(), Ordering::Relaxed);
        w[W_PID].store(u64::from(std::process::id()), Ordering::Relaxed);
        w[W_MAGIC].store(MAGIC, Ordering::Release);
        Ok(LocalGroup {
            mem,
            layout: layout.clone(),
            timeout,
            path: path.to_path_buf(),
        })
    }

    /// The layout.
    pub fn layout(&self) -> &LocalLayout {
        &self.layout
    }

    fn wait_ready(&self, j: usize, l: usize, iter: u64) -> Result<()> {
        let w = &self.mem.words()[self.layout.w_ready(j, l)];
        let mut waiter = Waiter::new(self.timeout);
        while w.load(Ordering::Acquire) < iter + 1 {
            waiter.pause(&self.mem, || {
                format!("local learner {j} to hand in layer {l} of iteration {iter}")
            })?;
        }
        Ok(())
    }

    /// `dst += Σ_{j=1..L} slot_j(l)` in local-rank order, once each learner's
    /// gradient of layer `l` for `iter` is in; then the slots are free again.
    /// `dst` holds the leader's own gradient (learner 0).
    pub fn sum_into(&self, l: usize, iter: u64, dst: &mut [f32]) -> Result<()> {
        if dst.len() > self.layout.slots[l] {
            return Err(Error::Layout(format!(
                "layer {l}: {} values do not fit its local slot of {}",
                dst.len(),
                self.layout.slots[l]
            )));
        }
        let data = self.mem.data();
        for j in 1..self.layout.learners {
            self.wait_ready(j, l, iter)?;
            for (d, c) in dst.iter_mut().zip(&data[self.layout.slot(j, l)]) {
                *d += f32::from_bits(c.load(Ordering::Relaxed));
            }
        }
        self.mem.words()[self.layout.w_taken(l)].store(iter + 1, Ordering::Release);
        Ok(())
    }

    /// Calls `f(j, slot)` for learners `j = 1..L` in order, each once its slot
    /// of layer `l` holds `iter`'s values (the first `len` of them, copied out
    /// into `scratch`); then the slots are free again.
    pub fn for_each_slot(
        &self,
        l: usize,
        iter: u64,
        len: usize,
        scratch: &mut Vec<f32>,
        mut f: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        if len > self.layout.slots[l] {
            return Err(Error::Layout(format!(
                "layer {l}: {len} values do not fit its local slot of {}",
                self.layout.slots[l]
            )));
        }
        scratch.resize(len, 0.0);
        let data = self.mem.data();
        for j in 1..self.layout.learners {
            self.wait_ready(j, l, iter)?;
            load(&data[self.layout.slot(j, l)], &mut scratch[..len]);
            f(j, &scratch[..len]);
        }
        self.mem.words()[self.layout.w_taken(l)].store(iter + 1, Ordering::Release);
        Ok(())
    }

    /// Stacks every learner's sufficient factors: `parts[p]` (U, then V) holds
    /// `L` blocks of equal size, the leader's own in block 0; learner `j`'s
    /// slot holds its blocks back to back and goes to block `j` of each part.
    pub fn stack_into(&self, l: usize, iter: u64, parts: &mut [&mut [f32]]) -> Result<()> {
        let lrn = self.layout.learners;
        let block: Vec<usize> = parts.iter().map(|p| p.len() / lrn).collect();
        if parts.iter().any(|p| p.len() % lrn != 0) || block.iter().sum::<usize>() > self.layout.slots[l] {
            return Err(Error::Layout(format!(
                "layer {l}: factor parts do not split into {lrn} blocks that fit the local slot"
            )));
        }
        let data = self.mem.data();
        for j in 1..lrn {
            self.wait_ready(j, l, iter)?;
            let mut at = self.layout.slot(j, l).start;
            for (p, &b) in parts.iter_mut().zip(&block) {
                load(&data[at..at + b], &mut p[j * b..(j + 1) * b]);
                at += b;
            }
        }
        self.mem.words()[self.layout.w_taken(l)].store(iter + 1, Ordering::Release);
        Ok(())
    }

    /// Writes layer `l`'s parameters of `version` into the cache (a seqlock:
    /// learners that read meanwhile retry).
    pub fn publish(&self, l: usize, version: u64, params: &[f32]) -> Result<()> {
        let r = self.layout.cache(l);
        if params.len() != r.len() {
            return Err(Error::Layout(format!(
                "layer {l}: {} parameters, the cache holds {}",
                params.len(),
                r.len()
            )));
        }
        let seq = &self.mem.words()[self.layout.w_seq(l)];
        seq.store(2 * version + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        store(&self.mem.data()[r], params);
        seq.store(2 * version + 2, Ordering::Release);
        Ok(())
    }

    /// Tells every learner that the leader gave up; their waits fail at once.
    pub fn abort(&self) {
        self.mem.words()[W_ABORT].store(1, Ordering::Release);
    }

    /// The shared file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        // Learners that still have it mapped keep their mapping; the name goes.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A learner's side (local rank `j ≥ 1`).
#[derive(Debug)]
pub struct LocalLearner {
    mem: SharedMem,
    layout: LocalLayout,
    index: usize,
    timeout: Duration,
}

impl LocalLearner {
    /// Attaches to the leader's group at `path`, waiting (up to `timeout`)
    /// for the leader of this run (`nonce`) to create it.
    pub fn attach(path: &Path, nonce: u64, layout: &LocalLayout, index: usize, timeout: Duration) -> Result<Self> {
        if index == 0 || index >= layout.learners {
            return Err(local_err(format!(
                "learner index {index} out of 1..{}: local rank 0 is the leader",
                layout.learners
            )));
        }
        let start = Instant::now();
        let mut last;
        loop {
            match SharedMem::open(path, layout.words(), layout.floats.max(1)) {
                Ok(mem) => {
                    let w = mem.words();
                    if w[W_MAGIC].load(Ordering::Acquire) == MAGIC && w[W_NONCE].load(Ordering::Relaxed) == nonce {
                        if w[W_LAYOUT].load(Ordering::Relaxed) != layout.hash() {
                            return Err(local_err(format!(
                                "{} was made for another layout (learners or layer sizes differ from the leader's)",
                                path.display()
                            )));
                        }
                        return Ok(LocalLearner {
                            mem,
                            layout: layout.clone(),
                            index,
                            timeout,
                        });
                    }
                    last = "an earlier run's file".into();
                }
                Err(e) => last = e.to_string(),
            }
            if start.elapsed() > timeout {
                return Err(Error::Timeout {
                    what: format!("the node's leader to create {} (last: {last})", path.display()),
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Writes this learner's gradient of layer `l` for `iter` into its slot
    /// (`parts` back to back: the gradient, or U then V) once the leader has
    /// consumed the previous iteration's, and marks it ready.
    pub fn hand_in(&self, l: usize, iter: u64, parts: &[&[f32]]) -> Result<()> {
        let slot = self.layout.slot(self.index, l);
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > slot.len() {
            return Err(Error::Layout(format!(
                "layer {l}: {total} values do not fit the local slot of {}",
                slot.len()
            )));
        }
        let taken = &self.mem.words()[self.layout.w_taken(l)];
        let mut waiter = Waiter::new(self.timeout);
        while taken.load(Ordering::Acquire) < iter {
            waiter.pause(&self.mem, || {
                format!("the leader to take layer {l} of iteration {}", iter.saturating_sub(1))
            })?;
        }
        let data = self.mem.data();
        let mut at = slot.start;
        for p in parts {
            store(&data[at..at + p.len()], p);
            at += p.len();
        }
        self.mem.words()[self.layout.w_ready(self.index, l)].store(iter + 1, Ordering::Release);
        Ok(())
    }

    /// Copies layer `l`'s cached parameters into `dst` once the cache holds
    /// version `need` or newer; returns the version copied (the newest).
    pub fn params(&self, l: usize, need: u64, dst: &mut [f32]) -> Result<u64> {
        let mut waiter = Waiter::new(self.timeout);
        loop {
            if let Some(v) = self.try_params(l, need, dst)? {
                return Ok(v);
            }
            waiter.pause(&self.mem, || format!("version {need} of layer {l}'s parameters"))?;
        }
    }

    /// [`LocalLearner::params`] without waiting: `None` while the cache
    /// holds no version `need` or newer (or the leader is writing it).
    pub fn try_params(&self, l: usize, need: u64, dst: &mut [f32]) -> Result<Option<u64>> {
        let r = self.layout.cache(l);
        if dst.len() != r.len() {
            return Err(Error::Layout(format!(
                "layer {l}: {} parameters, the cache holds {}",
                dst.len(),
                r.len()
            )));
        }
        if self.mem.words()[W_ABORT].load(Ordering::Acquire) != 0 {
            return Err(local_err(format!("the node's leader gave up (layer {l})")));
        }
        let seq = &self.mem.words()[self.layout.w_seq(l)];
        // A seqlock read: retry while the leader rewrote it meanwhile.
        loop {
            let s1 = seq.load(Ordering::Acquire);
            if s1 == 0 || s1 % 2 == 1 || s1 / 2 <= need {
                return Ok(None);
            }
            load(&self.mem.data()[r.clone()], dst);
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == s1 {
                return Ok(Some(s1 / 2 - 1));
            }
        }
    }

    /// This learner's local rank.
    pub fn index(&self) -> usize {
        self.index
    }
}

/// A local learner's push/pull over its own memory (Nexus's push/pull for a
/// learner that is not a rank): the counterpart of [`crate::pushpull::PushPull`]
/// on the node's leader, which was made with [`PushPull::lead`](crate::pushpull::PushPull::lead).
///
/// [`LearnerPushPull::push`] copies the layer's gradient into this learner's
/// slot (widened to f32 for f16, bf16 and f64 memory);
/// [`LearnerPushPull::pull`] waits until the node's cache holds the version
/// this push needs (its count, minus the staleness bound) and copies it into
/// the caller's parameters.
#[derive(Debug)]
pub struct LearnerPushPull {
    me: LocalLearner,
    t: tidewire_gpu::cpu::HostType,
    params: tidewire_transport::PinnedBuffer,
    grads: tidewire_transport::PinnedBuffer,
    at: Vec<(usize, usize)>,
    pushes: Vec<u64>,
    pushed: Vec<bool>,
    staleness: u64,
    scratch: Vec<f32>,
}

impl LearnerPushPull {
    /// The layout a node's leader and learners share for push/pull: one
    /// gradient slot per layer, of the layer's size.
    pub fn layout(learners: usize, sizes: &[usize]) -> LocalLayout {
        LocalLayout::new(learners, sizes.to_vec(), sizes.to_vec())
    }

    /// Attaches learner `index` (≥ 1) of `learners` to the group at `path`
    /// for this run (`nonce`), over the caller's flat parameter and gradient
    /// memory of element type `t`, layers back to back (`sizes`). The
    /// parameters get the leader's initial values.
    #[allow(clippy::too_many_arguments)]
    pub fn attach(
        path: &Path,
        nonce: u64,
        learners: usize,
        index: usize,
        sizes: &[usize],
        t: tidewire_gpu::cpu::HostType,
        params: tidewire_transport::PinnedBuffer,
        grads: tidewire_transport::PinnedBuffer,
        timeout: Duration,
        staleness: u64,
    ) -> Result<Self> {
        let total: usize = sizes.iter().sum();
        for (what, b) in [("parameter", &params), ("gradient", &grads)] {
            if b.len() != total * t.size() {
                return Err(Error::Layout(format!(
                    "{what} memory holds {} bytes, but the {} layers' {total} {} values need {}",
                    b.len(),
                    sizes.len(),
                    t.name(),
                    total * t.size()
                )));
            }
        }
        let layout = Self::layout(learners, sizes);
        let me = LocalLearner::attach(path, nonce, &layout, index, timeout)?;
        let mut at = Vec::new();
        let mut o = 0;
        for &n in sizes {
            at.push((o, n));
            o += n;
        }
        let mut pp = LearnerPushPull {
            me,
            t,
            params,
            grads,
            at,
            pushes: vec![0; sizes.len()],
            pushed: vec![false; sizes.len()],
            staleness,
            scratch: Vec::new(),
        };
        for l in 0..sizes.len() {
            pp.fetch(l, 0)?;
        }
        Ok(pp)
    }

    fn check(&self, l: u32) -> Result<usize> {
        let n = self.at.len();
        if (l as usize) < n {
            Ok(l as usize)
        } else {
            Err(Error::Engine(tidewire_engine::EngineError::UnknownLayer {
                layer: l,
                layers: n as u32,
            }))
        }
    }

    fn fetch(&mut self, l: usize, need: u64) -> Result<()> {
        let (o, n) = self.at[l];
        let sz = self.t.size();
        self.scratch.resize(n, 0.0);
        self.me.params(l, need, &mut self.scratch)?;
        tidewire_gpu::cpu::narrow(self.t, &self.scratch, &mut self.params[o * sz..(o + n) * sz]);
        Ok(())
    }

    /// Hands layer `layer`'s gradient to the node's leader.
    pub fn push(&mut self, layer: u32) -> Result<()> {
        let l = self.check(layer)?;
        if self.pushed[l] {
            return Err(Error::LayerState {
                layer,
                why: "cannot push it: it was pushed and not pulled yet".into(),
            });
        }
        let (o, n) = self.at[l];
        let sz = self.t.size();
        self.scratch.resize(n, 0.0);
        tidewire_gpu::cpu::widen(self.t, &self.grads[o * sz..(o + n) * sz], &mut self.scratch);
        self.me.hand_in(l, self.pushes[l], &[&self.scratch])?;
        self.pushes[l] += 1;
        self.pushed[l] = true;
        Ok(())
    }

    /// Waits for the layer's parameters after this learner's last push (the
    /// newest in the cache, at most `staleness` versions behind it) and
    /// copies them into the caller's memory. At once for a layer not pushed.
    pub fn pull(&mut self, layer: u32) -> Result<()> {
        let l = self.check(layer)?;
        if !self.pushed[l] {
            return Ok(());
        }
        self.fetch(l, self.pushes[l].saturating_sub(self.staleness))?;
        self.pushed[l] = false;
        Ok(())
    }

    /// Pulls every pushed layer, in layer order.
    pub fn pull_all(&mut self) -> Result<()> {
        for l in 0..self.at.len() as u32 {
            self.pull(l)?;
        }
        Ok(())
    }

    /// Whether `layer` is synced (as [`LearnerPushPull::pull`] would find it),
    /// without blocking; when it is, its parameters are copied in as by a pull.
    pub fn poll(&mut self, layer: u32) -> Result<bool> {
        let l = self.check(layer)?;
        if !self.pushed[l] {
            return Ok(true);
        }
        let (o, n) = self.at[l];
        let sz = self.t.size();
        self.scratch.resize(n, 0.0);
        let need = self.pushes[l].saturating_sub(self.staleness);
        if self.me.try_params(l, need, &mut self.scratch)?.is_none() {
            return Ok(false);
        }
        tidewire_gpu::cpu::narrow(self.t, &self.scratch, &mut self.params[o * sz..(o + n) * sz]);
        self.pushed[l] = false;
        Ok(true)
    }

    /// Whether `layer` has been pushed and not pulled.
    pub fn in_flight(&self, layer: u32) -> bool {
        self.pushed.get(layer as usize).copied().unwrap_or(false)
    }

    /// The number of layers.
    pub fn layers(&self) -> usize {
        self.at.len()
    }

    /// The caller's memory: parameters and gradients as bytes of its type.
    pub fn memory(&mut self) -> (&[u8], &mut [u8]) {
        (&self.params[..], &mut self.grads[..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!("tw-local-{tag}-{}", std::process::id()))
    }

    #[test]
    fn threads_sum_in_order_publish_and_read_with_staleness() {
        let layout = LocalLayout::new(3, vec![5, 2], vec![5, 6]);
        let p = path("sum");
        let g = LocalGroup::create(&p, 7, &layout, Duration::from_secs(10)).unwrap();
        std::thread::scope(|s| {
            for j in 1..3 {
                let (p, layout) = (p.clone(), layout.clone());
                s.spawn(move || {
                    let me = LocalLearner::attach(&p, 7, &layout, j, Duration::from_secs(10)).unwrap();
                    for it in 0..20u64 {
                        let mut w = vec![0f32; 5];
                        let v = me.params(0, it, &mut w).unwrap();
                        assert!(v >= it);
                        assert!(w.iter().all(|&x| x == v as f32), "torn or stale read {w:?} at {v}");
                        let g = vec![j as f32 * 0.25 + it as f32; 5];
                        me.hand_in(0, it, &[&g]).unwrap();
                        let (u, vv) = (vec![j as f32; 2], vec![-(j as f32); 1]);
                        me.hand_in(1, it, &[&u, &vv]).unwrap();
                    }
                });
            }
            for it in 0..20u64 {
                g.publish(0, it, &[it as f32; 5]).unwrap();
                let mut acc = vec![it as f32; 5];
                g.sum_into(0, it, &mut acc).unwrap();
                let t = it as f32;
                let want = (t + (0.25 + t)) + (0.5 + t);
                assert_eq!(acc, vec![want; 5]);
                let (mut u, mut v) = (vec![9f32; 6], vec![9f32; 3]);
                g.stack_into(1, it, &mut [&mut u, &mut v]).unwrap();
                assert_eq!(u, [9.0, 9.0, 1.0, 1.0, 2.0, 2.0]);
                assert_eq!(v, [9.0, -1.0, -2.0]);
            }
            g.publish(0, 20, &[20.0; 5]).unwrap();
        });
    }

    #[test]
    fn waits_end_with_typed_errors() {
        let layout = LocalLayout::new(2, vec![1], vec![1]);
        let p = path("err");
        let t = Duration::from_millis(50);
        // Nobody created it: the attach times out and says what it waited for.
        let e = LocalLearner::attach(&p, 1, &layout, 1, t).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(LocalLearner::attach(&p, 1, &layout, 0, t).is_err());
        let g = LocalGroup::create(&p, 1, &layout, t).unwrap();
        // Another layout, another run.
        let other = LocalLayout::new(2, vec![2], vec![2]);
        assert!(LocalLearner::attach(&p, 1, &other, 1, t).is_err());
        assert!(matches!(
            LocalLearner::attach(&p, 2, &layout, 1, t),
            Err(Error::Timeout { .. })
        ));
        let me = LocalLearner::attach(&p, 1, &layout, 1, t).unwrap();
        // The learner never hands in: the leader's sum times out.
        assert!(matches!(g.sum_into(0, 0, &mut [0.0]), Err(Error::Timeout { .. })));
        // Too much for the slot.
        assert!(matches!(me.hand_in(0, 0, &[&[1.0, 2.0]]), Err(Error::Layout(_))));
        // An abort ends the learner's wait at once.
        g.abort();
        let e = me.params(0, 0, &mut [0.0]).unwrap_err();
        assert!(e.to_string().contains("gave up"), "{e}");
    }
}
