//! The caller's side of registered memory: each layer's buffers, lent to the
//! caller between a sync and the next hand-in, and caller-owned memory to
//! register instead of the session's own.

use tidewire_transport::{Lease, Region};

/// A caller-owned buffer holding every layer's parameters (or gradients), and
/// where each layer starts in it, in bytes. Layers must not overlap and must
/// each hold M×N f32 values. Gradients may sit anywhere; parameters must be
/// back to back in layer order from `offsets[0]` (servers write into them by
/// offset; a framework's flat parameter buffer has this shape).
#[derive(Debug)]
pub struct BufferLayout {
    /// The memory.
    pub buffer: tidewire_transport::PinnedBuffer,
    /// Byte offset of each layer.
    pub offsets: Vec<usize>,
}

/// One layer's registered buffers, owned by the caller between
/// [`Session::wait_layer`](crate::Session::wait_layer) and the next hand-in.
/// While the caller holds them, nothing else writes them: not the engine,
/// and not a peer (under SSP the caller holds a published copy of the
/// parameters, and servers write elsewhere).
#[derive(Debug)]
pub struct LayerBuffers {
    pub(crate) layer: u32,
    /// The iteration these buffers are handed in for next.
    pub(crate) iter: u64,
    pub(crate) synced_at: Option<std::time::Instant>,
    pub(crate) params: Lease,
    pub(crate) grad: Lease,
    /// U then V, and U's length in elements.
    pub(crate) factors: Option<(Lease, usize)>,
}

impl LayerBuffers {
    /// The layer index.
    pub fn layer(&self) -> u32 {
        self.layer
    }
    /// The iteration the layer is handed in for next (its syncs so far):
    /// with [`Session::scheme_at`](crate::Session::scheme_at), whether it goes
    /// as a gradient or as its sufficient factors.
    pub fn iter(&self) -> u64 {
        self.iter
    }
    /// When the engine finished syncing this layer (None before the first sync).
    pub fn synced_at(&self) -> Option<std::time::Instant> {
        self.synced_at
    }
    /// The parameters (M×N, row major).
    pub fn params(&self) -> &[f32] {
        self.params.as_f32().expect("layer buffers are f32 aligned")
    }
    /// The parameters, writable. Values written here are local: the next sync overwrites them.
    pub fn params_mut(&mut self) -> &mut [f32] {
        self.params.as_f32_mut().expect("layer buffers are f32 aligned")
    }
    /// The gradient, for backward to fill.
    pub fn grad_mut(&mut self) -> &mut [f32] {
        self.grad.as_f32_mut().expect("layer buffers are f32 aligned")
    }
    /// The gradient.
    pub fn grad(&self) -> &[f32] {
        self.grad.as_f32().expect("layer buffers are f32 aligned")
    }
    /// U (K×M) of an FC layer's sufficient factors; empty for other layers.
    pub fn u_mut(&mut self) -> &mut [f32] {
        self.uv_mut().0
    }
    /// V (K×N) of an FC layer's sufficient factors; empty for other layers.
    pub fn v_mut(&mut self) -> &mut [f32] {
        self.uv_mut().1
    }
    /// U and V at once (for code that fills both in one pass).
    pub fn uv_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        match &mut self.factors {
            Some((l, u_len)) => {
                let u = *u_len;
                l.as_f32_mut().expect("aligned").split_at_mut(u)
            }
            None => (&mut [], &mut []),
        }
    }
    pub(crate) fn regions(&self) -> (&Region, &Region) {
        (self.params.region(), self.grad.region())
    }
}
