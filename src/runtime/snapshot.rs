//! Checkpoint snapshots ([`crate::checkpoint`]): what the runtime thread and
//! the server executor copy, at the iteration a checkpoint is due, for the
//! writer thread to write.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tidewire_engine::node::Node;
use tidewire_engine::{Book, Scheme};

use tidewire_engine::node::LocalRegion;
use tidewire_transport::Region;

use super::job_error::{JobError, JobResult as Jr};
use crate::checkpoint::{Tensor, Writer};

/// The worker executor's momentum of the layers it updates itself (SFB),
/// by layer: the executor updates it, worker 0's runtime copies it into a
/// checkpoint when the layer is synced (no update runs then: the next one
/// needs the layer handed in again).
pub(crate) type WorkerMomentum = Arc<Mutex<HashMap<u32, Vec<f32>>>>;

/// Worker 0's snapshots of the model, layer by layer as they become synced.
pub(crate) struct ModelSnap {
    writer: Writer,
    momentum: WorkerMomentum,
    pending: BTreeMap<u64, Pending>,
}

/// A model checkpoint being gathered: every layer's parameters, the SFB
/// layers' momentum, and how many layers are still to come.
struct Pending {
    layers: Vec<Option<Tensor>>,
    momentum: Vec<Tensor>,
    left: usize,
}

impl ModelSnap {
    pub(crate) fn new(writer: Writer, momentum: WorkerMomentum) -> Self {
        ModelSnap {
            writer,
            momentum,
            pending: BTreeMap::new(),
        }
    }

    /// `layer` is synced for engine iteration `iter`: copy it if that
    /// completes a checkpoint's iteration, and hand the checkpoint to the
    /// writer once every layer is in.
    pub(crate) fn layer_ready<'a>(
        &mut self,
        book: &Book,
        node: &Node,
        region: impl Fn(LocalRegion) -> Jr<&'a Region>,
        layer: u32,
        iter: u64,
    ) -> Jr<()> {
        let Some(k) = self.writer.plan().due(iter) else {
            return Ok(());
        };
        let t = std::time::Instant::now();
        let r = self.copy(book, node, region, layer, iter, k);
        self.writer.copied(t.elapsed());
        r
    }

    fn copy<'a>(
        &mut self,
        book: &Book,
        node: &Node,
        region: impl Fn(LocalRegion) -> Jr<&'a Region>,
        layer: u32,
        iter: u64,
        k: u64,
    ) -> Jr<()> {
        let nl = book.layers().len();
        let spec = book.layer(layer)?;
        let at = node.layer_locs(layer).ok_or(JobError::outside("not a worker"))?.0;
        let mut data = vec![0f32; spec.params()];
        // Servers may write this region (their next broadcasts, under SSP):
        // read it through relaxed atomics, never as a slice.
        region(at.region)?.read_f32_relaxed(at.offset as usize, &mut data)?;
        let entry = self.pending.entry(k).or_insert_with(|| Pending {
            layers: vec![None; nl],
            momentum: Vec::new(),
            left: nl,
        });
        if entry.layers[layer as usize].is_none() {
            entry.left -= 1;
        }
        entry.layers[layer as usize] = Some(Tensor {
            name: spec.name.clone(),
            shape: vec![spec.m, spec.n],
            data,
        });
        if book.scheme(layer, iter) == Scheme::Sfb {
            let m = self.momentum.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(v) = m.get(&layer).filter(|v| !v.is_empty()) {
                entry.momentum.push(Tensor {
                    name: format!("momentum/{}", spec.name),
                    shape: vec![spec.m, spec.n],
                    data: v.clone(),
                });
            }
        }
        if entry.left == 0 {
            let p = self.pending.remove(&k).expect("present");
            let mut tensors: Vec<Tensor> = p.layers.into_iter().map(|t| t.expect("every layer in")).collect();
            tensors.extend(p.momentum);
            self.writer.model(k, tensors);
        }
        Ok(())
    }
}

/// A server's snapshots of its shard's momentum, chunk by chunk as each is applied.
pub(crate) struct ServerSnap {
    writer: Writer,
    book: Arc<Book>,
    chunks: usize,
    pending: BTreeMap<u64, Vec<Tensor>>,
}

impl ServerSnap {
    pub(crate) fn new(writer: Writer, book: Arc<Book>, rank: u32) -> Self {
        ServerSnap {
            chunks: crate::checkpoint::ps_chunks(&book, rank),
            writer,
            book,
            pending: BTreeMap::new(),
        }
    }

    /// `chunk` was applied for engine iteration `iter`; `momentum` is its
    /// momentum now (empty when the op keeps none: nothing to save).
    pub(crate) fn applied(&mut self, chunk: u32, iter: u64, momentum: &[f32]) -> Jr<()> {
        let Some(k) = self.writer.plan().due(iter) else {
            return Ok(());
        };
        if momentum.is_empty() {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let ch = self
            .book
            .chunks()
            .get(chunk as usize)
            .ok_or(JobError::outside("unknown chunk"))?;
        let name = &self.book.layers()[ch.layer as usize].name;
        let p = self.pending.entry(k).or_default();
        p.push(Tensor {
            name: format!("momentum/{name}/{}", ch.offset),
            shape: vec![momentum.len()],
            data: momentum.to_vec(),
        });
        let done = p.len() == self.chunks;
        self.writer.copied(t.elapsed());
        if done {
            let t = self.pending.remove(&k).expect("present");
            self.writer.server(k, t);
        }
        Ok(())
    }
}
