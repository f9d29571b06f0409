//! Nexus's push/pull interface over caller-owned memory: the layer API for
//! programs that keep their own parameter and gradient tensors (a framework,
//! a C program, Python).
//!
//! The caller registers its own flat parameter and gradient memory with
//! [`Builder::params_buffer`](crate::Builder::params_buffer) and
//! [`Builder::grads_buffer`](crate::Builder::grads_buffer) (wrapping it with
//! [`PinnedBuffer::foreign`](crate::transport::PinnedBuffer::foreign)), and
//! then names layers by index: [`PushPull::push`] hands layer `l`'s gradient
//! in, straight from the caller's memory; [`PushPull::pull`] waits until the
//! servers' result has landed in the caller's parameter memory. Between a
//! push and its pull the layer belongs to the engine: the caller must not
//! touch that layer's gradient or parameter bytes.
//!
//! ```no_run
//! use tidewire::engine::book::{LayerKind, LayerSpec};
//! use tidewire::pushpull::PushPull;
//! use tidewire::transport::PinnedBuffer;
//! use tidewire::{BufferLayout, Builder};
//!
//! // The caller's memory: 64 parameters and 64 gradients, f32, handed over
//! // (a framework's tensors are wrapped with the unsafe `PinnedBuffer::foreign`).
//! let p = PinnedBuffer::from_f32_vec(vec![0.5f32; 64])?;
//! let g = PinnedBuffer::from_f32_vec(vec![0.0f32; 64])?;
//! let session = Builder::new(vec![LayerSpec::new("w", LayerKind::Other, 8, 8)])
//!     .params_buffer(BufferLayout { buffer: p, offsets: vec![0] })
//!     .grads_buffer(BufferLayout { buffer: g, offsets: vec![0] })
//!     .build_from_env()?;
//! let mut pp = PushPull::new(session)?;
//! for _step in 0..10 {
//!     pp.held(0)?.grad_mut().fill(0.01); // backward writes the gradient in place
//!     pp.push(0)?; // zero-copy from the gradient memory
//!     pp.pull(0)?; // the parameter memory now holds the servers' result
//!     let _w = pp.held(0)?.params();
//! }
//! pp.shutdown()?;
//! # Ok::<(), tidewire::Error>(())
//! ```
//!
//! [`PushPull::poll`] is the non-blocking pull; [`PushPull::push_factors`]
//! hands in an FC layer by its sufficient factors.

use std::sync::{Arc, Mutex};

use tidewire_gpu::cpu::{narrow, widen, HostType};
use tidewire_transport::PinnedBuffer;

use crate::cluster::ClusterSpec;
use crate::error::{Error, Result};
use crate::session::{BufferLayout, Builder, LayerBuffers, Pending, Session};

fn lost(layer: u32) -> Error {
    Error::LayerState {
        layer,
        why: "an earlier pull of it failed: its buffers are gone for the rest of the session".into(),
    }
}

#[derive(Debug)]
enum Slot {
    /// The caller's: synced (or never pushed).
    Held(LayerBuffers),
    /// Pushed; the engine's until its pull completes.
    Pushed(Pending<LayerBuffers>),
    /// A pull failed: the layer is gone for the rest of the session.
    Lost,
}

/// The caller's memory of another element type than f32, converted at the
/// edge: gradients widened into the session's f32 buffers at each push,
/// results narrowed back into the caller's parameters at each pull.
#[derive(Debug)]
struct Staged {
    t: HostType,
    /// Shared with the build's `init_params` (rank 0's initial values).
    params: Arc<Mutex<PinnedBuffer>>,
    grads: PinnedBuffer,
    /// Element offset and count of each layer in both buffers.
    at: Vec<(usize, usize)>,
}

/// Push/pull by layer index over a [`Session`] (see the module docs).
#[derive(Debug)]
pub struct PushPull {
    session: Session,
    slots: Vec<Slot>,
    staged: Option<Staged>,
    /// This rank leads a node's local learners ([`PushPull::lead`]), and
    /// each layer's pushes so far.
    local: Option<Box<(crate::local::LocalGroup, Vec<u64>)>>,
}

impl PushPull {
    /// Wraps a session and takes its layers. On a server-only rank there
    /// is nothing to push or pull (those calls fail with [`Error::Role`]):
    /// [`PushPull::shutdown`] serves the job.
    pub fn new(mut session: Session) -> Result<Self> {
        let slots = if session.role().is_worker() {
            session
                .take_layers()?
                .into_iter()
                .map(|b| Slot::Held(b.expect("fresh layers")))
                .collect()
        } else {
            Vec::new()
        };
        Ok(PushPull {
            session,
            slots,
            staged: None,
            local: None,
        })
    }

    /// Makes this worker the leader of a node's local learners (Nexus's
    /// local aggregation, [`crate::local`]): each [`PushPull::push`] first
    /// adds the learners' gradients of the layer, in local-rank order, to
    /// this rank's own (in the session's gradient memory: the caller's, for
    /// f32), and each completed pull publishes the layer's parameters into
    /// the node's cache. The group's layout must have one slot per layer of
    /// the layer's size. Publishes every layer's current (initial) values.
    /// The session's mean and SGD should count every learner
    /// ([`SchedConfig::learners`](crate::engine::SchedConfig)).
    pub fn lead(&mut self, group: crate::local::LocalGroup) -> Result<()> {
        if self.local.is_some() {
            return Err(Error::Layout("this rank already leads a local group".into()));
        }
        for l in 0..self.slots.len() as u32 {
            let b = self.held(l)?;
            group.publish(l as usize, 0, b.params())?;
        }
        self.local = Some(Box::new((group, vec![0; self.slots.len()])));
        Ok(())
    }

    /// Builds a session over the caller's flat parameter and gradient
    /// memory holding `t` values, every layer back to back in layer order
    /// (both buffers exactly the model's size), and wraps it. The parameters'
    /// values are the initial ones (worker rank 0's go to everyone).
    ///
    /// f32 memory is registered in place (zero-copy). f16, bf16 and f64
    /// memory is staged: the session keeps f32 buffers, each push widens the
    /// layer's gradient into them and each pull narrows the result back into
    /// the caller's parameters (round to nearest even), so the wire and the
    /// servers' sums are f32; f64 values keep f32's precision.
    pub fn build(
        builder: Builder,
        spec: ClusterSpec,
        t: HostType,
        params: PinnedBuffer,
        grads: PinnedBuffer,
    ) -> Result<Self> {
        let mut at = Vec::new();
        let mut total = 0usize;
        for l in &builder.cfg.layers {
            at.push((total, l.params()));
            total += l.params();
        }
        for (what, b) in [("parameter", &params), ("gradient", &grads)] {
            if b.len() != total * t.size() {
                return Err(Error::Layout(format!(
                    "{what} memory holds {} bytes, but the {} layers' {total} {} values need {}",
                    b.len(),
                    at.len(),
                    t.name(),
                    total * t.size()
                )));
            }
        }
        if t == HostType::F32 {
            let offsets: Vec<usize> = at.iter().map(|(o, _)| o * 4).collect();
            let session = builder
                .params_buffer(BufferLayout {
                    buffer: params,
                    offsets: offsets.clone(),
                })
                .grads_buffer(BufferLayout { buffer: grads, offsets })
                .build(spec)?;
            return Self::new(session);
        }
        let params = Arc::new(Mutex::new(params));
        let (init, init_at) = (params.clone(), at.clone());
        let session = builder
            .init_params(move |l, p| {
                let (o, n) = init_at[l as usize];
                let b = init.lock().unwrap_or_else(|e| e.into_inner());
                widen(t, &b[o * t.size()..(o + n) * t.size()], p);
            })
            .build(spec)?;
        let mut pp = Self::new(session)?;
        pp.staged = Some(Staged { t, params, grads, at });
        // Rank 0's initial values, now in the session's buffers, into the caller's.
        for l in 0..pp.slots.len() as u32 {
            pp.land(l);
        }
        Ok(pp)
    }

    /// The element type of the caller's memory (f32 unless built by [`PushPull::build`] with another).
    pub fn host_type(&self) -> HostType {
        self.staged.as_ref().map_or(HostType::F32, |s| s.t)
    }

    /// The caller's memory of a staged layer it holds (built by
    /// [`PushPull::build`] with a type other than f32): its parameters and
    /// gradient as bytes of that type, for Rust callers that handed their
    /// memory over. (For f32, [`PushPull::held`] reaches the same memory.)
    pub fn staged_mut(&mut self, layer: u32) -> Result<(Vec<u8>, &mut [u8])> {
        self.held(layer)?;
        let st = self.staged.as_mut().ok_or_else(|| {
            Error::Layout("staged_mut: the caller's memory is f32, registered in place: use held()".into())
        })?;
        let (o, n) = st.at[layer as usize];
        let sz = st.t.size();
        let p = st.params.lock().unwrap_or_else(|e| e.into_inner())[o * sz..(o + n) * sz].to_vec();
        Ok((p, &mut st.grads[o * sz..(o + n) * sz]))
    }

    /// A layer came back: into the caller's parameters, and the learners' cache.
    fn land(&mut self, layer: u32) {
        if let (Some(lg), Some(Slot::Held(b))) = (&self.local, self.slots.get(layer as usize)) {
            let (g, pushes) = &**lg;
            // The layout was checked when the group was made; a failure here
            // would be a bug, and the learners then time out with a clear error.
            if let Err(e) = g.publish(layer as usize, pushes[layer as usize], b.params()) {
                tracing::error!(layer, error = %e, "cannot publish to the local learners");
            }
        }
        self.narrow_back(layer);
    }

    /// Narrows a layer that just came back into the caller's parameters.
    fn narrow_back(&mut self, layer: u32) {
        if let (Some(st), Some(Slot::Held(b))) = (&self.staged, self.slots.get(layer as usize)) {
            let (o, n) = st.at[layer as usize];
            let sz = st.t.size();
            let mut p = st.params.lock().unwrap_or_else(|e| e.into_inner());
            narrow(st.t, b.params(), &mut p[o * sz..(o + n) * sz]);
        }
    }

    /// The session underneath (book, schemes, stats, transport).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The session underneath, by value (on a server-only rank, to serve the
    /// job with [`Session::shutdown`]). Layers in flight are dropped with
    /// their pending pulls.
    pub fn into_session(self) -> Session {
        self.session
    }

    /// The number of layers.
    pub fn layers(&self) -> usize {
        self.slots.len()
    }

    fn slot(&mut self, layer: u32) -> Result<&mut Slot> {
        if !self.session.role().is_worker() {
            return Err(Error::Role {
                rank: self.session.rank(),
                role: "worker",
            });
        }
        let n = self.slots.len();
        self.slots.get_mut(layer as usize).ok_or_else(|| {
            Error::Engine(tidewire_engine::EngineError::UnknownLayer {
                layer,
                layers: n as u32,
            })
        })
    }

    fn take_held(&mut self, layer: u32, what: &str) -> Result<LayerBuffers> {
        let slot = self.slot(layer)?;
        match std::mem::replace(slot, Slot::Lost) {
            Slot::Held(b) => Ok(b),
            other => {
                let why = match &other {
                    Slot::Pushed(_) => "it was pushed and not pulled yet",
                    _ => "an earlier pull of it failed",
                };
                *slot = other;
                Err(Error::LayerState {
                    layer,
                    why: format!("cannot {what} it: {why}"),
                })
            }
        }
    }

    fn hand_in(&mut self, layer: u32, buf: LayerBuffers, factors: bool) -> Result<()> {
        let r = if factors {
            self.session.sf_ready(buf)
        } else {
            self.session.grad_ready(buf)
        };
        // A refused hand-in (wrong scheme, a failed session) consumed the
        // buffers: the layer is lost, and the error says why.
        r?;
        let pending = self.session.wait_layer_async(layer)?;
        *self.slot(layer)? = Slot::Pushed(pending);
        Ok(())
    }

    /// Hands layer `layer`'s gradient in, zero-copy from the registered
    /// gradient memory. Returns at once; the push proceeds in the background.
    pub fn push(&mut self, layer: u32) -> Result<()> {
        let mut buf = self.take_held(layer, "push")?;
        if let Some(st) = &self.staged {
            let (o, n) = st.at[layer as usize];
            let sz = st.t.size();
            widen(st.t, &st.grads[o * sz..(o + n) * sz], buf.grad_mut());
        }
        // Decided in the run, a dense FC layer may go either way: always by its factors.
        let contested = self.session.book().plan().contested().contains(&layer);
        if contested || self.session.scheme_at(layer, buf.iter())?.takes_factors() {
            let name = self.session.book().layers()[layer as usize].name.clone();
            *self.slot(layer)? = Slot::Held(buf);
            return Err(tidewire_engine::EngineError::NeedsFactors { layer, name }.into());
        }
        if let Some(b) = &mut self.local {
            let (g, pushes) = &mut **b;
            let it = pushes[layer as usize];
            if let Err(e) = g.sum_into(layer as usize, it, buf.grad_mut()) {
                *self.slot(layer)? = Slot::Held(buf);
                return Err(e);
            }
            pushes[layer as usize] = it + 1;
        }
        self.hand_in(layer, buf, false)
    }

    /// Hands an FC layer in by its sufficient factors: U (K×M) and V (K×N),
    /// row major, copied into the session's factor buffer (K×(M+N) values).
    /// Where HybComm syncs the layer through the PS ([`Session::scheme`]
    /// says `Ps`), the gradient Uᵀ·V is formed in the layer's gradient
    /// memory (the caller's) and pushed from there.
    pub fn push_factors(&mut self, layer: u32, u: &[f32], v: &[f32]) -> Result<()> {
        if self.local.is_some() {
            return Err(Error::LayerState {
                layer,
                why: "a local group's leader pushes gradients: factors from local learners are not supported".into(),
            });
        }
        let spec = self.session.book().layer(layer)?.clone();
        let k = self.session.book().config().batch;
        if u.len() != k * spec.m || v.len() != k * spec.n {
            return Err(Error::Layout(format!(
                "layer {layer} ({}): factors of {} and {} values, want U {k}x{} = {} and V {k}x{} = {}",
                spec.name,
                u.len(),
                v.len(),
                spec.m,
                k * spec.m,
                spec.n,
                k * spec.n
            )));
        }
        let mut buf = self.take_held(layer, "push")?;
        let (du, dv) = buf.uv_mut();
        if du.len() != u.len() || dv.len() != v.len() {
            *self.slot(layer)? = Slot::Held(buf);
            return Err(tidewire_engine::EngineError::NotFullyConnected { layer, name: spec.name }.into());
        }
        du.copy_from_slice(u);
        dv.copy_from_slice(v);
        self.hand_in(layer, buf, true)
    }

    /// Whether `layer` is synced, without blocking. True for a layer that
    /// was never pushed; an error if its sync failed.
    pub fn poll(&mut self, layer: u32) -> Result<bool> {
        let slot = self.slot(layer)?;
        match slot {
            Slot::Held(_) => Ok(true),
            Slot::Pushed(p) => match p.try_take() {
                Ok(Some(b)) => {
                    *slot = Slot::Held(b);
                    self.land(layer);
                    Ok(true)
                }
                Ok(None) => Ok(false),
                Err(e) => {
                    *slot = Slot::Lost;
                    Err(e)
                }
            },
            Slot::Lost => Err(lost(layer)),
        }
    }

    /// Blocks until `layer` is synced: its result is in the caller's
    /// parameter memory. Returns at once for a layer that is not pushed.
    pub fn pull(&mut self, layer: u32) -> Result<()> {
        let slot = self.slot(layer)?;
        match std::mem::replace(slot, Slot::Lost) {
            Slot::Held(b) => {
                *slot = Slot::Held(b);
                Ok(())
            }
            Slot::Pushed(p) => {
                let b = p.wait()?;
                *slot = Slot::Held(b);
                self.land(layer);
                Ok(())
            }
            Slot::Lost => Err(lost(layer)),
        }
    }

    /// Pulls every pushed layer, in layer order.
    pub fn pull_all(&mut self) -> Result<()> {
        for l in 0..self.slots.len() as u32 {
            self.pull(l)?;
        }
        Ok(())
    }

    /// The buffers of a layer the caller holds (synced, or never pushed):
    /// safe access to its parameters and gradient for Rust callers.
    pub fn held(&mut self, layer: u32) -> Result<&mut LayerBuffers> {
        match self.slot(layer)? {
            Slot::Held(b) => Ok(b),
            Slot::Pushed(_) => Err(Error::LayerState {
                layer,
                why: "it is pushed and not pulled yet".into(),
            }),
            Slot::Lost => Err(lost(layer)),
        }
    }

    /// Whether `layer` has been pushed and not pulled.
    pub fn in_flight(&self, layer: u32) -> bool {
        matches!(self.slots.get(layer as usize), Some(Slot::Pushed(_)))
    }

    /// Pulls what is in flight, then ends the session (see
    /// [`Session::shutdown`]). Every in-flight layer is pulled even if one
    /// fails; the first error is returned, after the session has ended.
    pub fn shutdown(mut self) -> Result<()> {
        let mut first = None;
        for l in 0..self.slots.len() as u32 {
            if self.in_flight(l) {
                if let Err(e) = self.pull(l) {
                    first.get_or_insert(e);
                }
            }
        }
        if first.is_some() {
            if let Some(lg) = &self.local {
                lg.0.abort();
            }
        }
        let r = self.session.shutdown();
        match first {
            Some(e) => Err(e),
            None => r,
        }
    }
}
