//! `tidewire._native`: Tidewire's push/pull interface for Python.
//!
//! One class, `Session`, wraps [`tidewire::pushpull::PushPull`] over a
//! [`tidewire::Builder`] session whose parameter and gradient memory is the
//! caller's own: two flat float32 host tensors (or NumPy arrays), registered in
//! place (zero-copy). Layers sit back to back in both, in table order. The
//! caller names layers by index: `push(l)` hands layer `l`'s gradient in
//! straight from the gradient tensor, `pull(l)` waits until the servers' result
//! has landed in the parameter tensor. Between a push and its pull the layer
//! belongs to the engine: the caller must not read or write that layer's part
//! of either tensor. `tidewire.torch` builds its DistributedOptimizer on this.
//!
//! Everything else a session is comes in one `tidewire.SessionConfig` (a
//! frozen dataclass of python/tidewire/_config.py), which [`config`] reads by
//! attribute and checks: `Session(config, params=, grads=)`.
//!
//! With `servers=N` the last N ranks are servers only: their session has no
//! layers, and `shutdown` serves the job until every worker has shut down.
//! After an error, `abort` ends a session without waiting for its peers.
//!
//! With `local=LocalAggregation(learners, index, path, nonce, staleness)` the
//! session is one of a node's `learners` local learners (Nexus's local
//! aggregation, `tidewire::local`): index 0 is the node's rank (its `rank` and
//! `world` count nodes) and sums the other learners' gradients into its own
//! before each push; index ≥ 1 joins no rendezvous, hands its gradients to
//! index 0 through shared memory at `path`, and pulls the parameters from the
//! node's cache (up to `staleness` versions old). Every layer syncs through
//! the PS.
//!
//! Every call that waits (the constructor's rendezvous, `pull`, `pull_all`,
//! `shutdown`) releases the GIL. Errors raise `tidewire.TidewireError` (a
//! `RuntimeError`) with the Rust error's message.

mod config;
mod memory;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tidewire::cluster::ClusterSpec;
use tidewire::engine::book::LayerSpec;
use tidewire::engine::freq::Decision;
use tidewire::engine::{ApplyOp, Role, Scheme};
use tidewire::freq::Guide;
use tidewire::gpu::cpu::HostType;
use tidewire::local::{LearnerPushPull, LocalGroup};
use tidewire::pushpull::PushPull;
use tidewire::transport::PinnedBuffer;
use tidewire::Builder;

use config::{seconds, Comm, Local, SessionConfig};
use memory::{factor_values, Memory};

create_exception!(
    tidewire,
    TidewireError,
    PyRuntimeError,
    "An error from Tidewire (engine, transport, rendezvous, or a misuse of a session); the message is the Rust error's."
);

fn tw_err(e: tidewire::Error) -> PyErr {
    TidewireError::new_err(e.to_string())
}

/// A worker's session behind its push/pull interface, or a server-only
/// rank's session, which only serves (from `shutdown`), or a local learner
/// behind its node's worker (no session of its own).
#[derive(Debug)]
enum Inner {
    Worker(PushPull),
    Server(tidewire::Session),
    Learner(LearnerPushPull),
}

impl Inner {
    fn session(&self) -> Option<&tidewire::Session> {
        match self {
            Inner::Worker(pp) => Some(pp.session()),
            Inner::Server(s) => Some(s),
            Inner::Learner(_) => None,
        }
    }
}

/// What a rank opens once its configuration is checked: [`Opening::open`]
/// runs with the GIL released.
struct Opening {
    builder: Builder,
    cluster: ClusterSpec,
    dtype: HostType,
    params: PinnedBuffer,
    grads: PinnedBuffer,
    /// With local aggregation: which of its node's learners this one is.
    local: Option<Local>,
    /// Values per layer, in table order.
    sizes: Vec<usize>,
    /// How long a local learner waits for its group (`connect_timeout`).
    wait: Duration,
}

impl Opening {
    /// A rank's session (a worker's, the leader of its node's local
    /// learners, or a server-only rank's), or a local learner behind its
    /// node's leader.
    fn open(self) -> tidewire::Result<Inner> {
        let Opening {
            builder,
            cluster,
            dtype,
            params,
            grads,
            local,
            sizes,
            wait,
        } = self;
        if let Some(l) = local.as_ref().filter(|l| l.index > 0) {
            let path = Path::new(&l.path);
            let (learners, index) = (l.learners, l.index);
            let pp = LearnerPushPull::attach(
                path,
                l.nonce,
                learners,
                index,
                &sizes,
                dtype,
                params,
                grads,
                wait,
                l.staleness,
            )?;
            return Ok(Inner::Learner(pp));
        }
        let mut pp = PushPull::build(builder, cluster, dtype, params, grads)?;
        if !pp.session().role().is_worker() {
            return Ok(Inner::Server(pp.into_session()));
        }
        if let Some(l) = local {
            let layout = LearnerPushPull::layout(l.learners, &sizes);
            pp.lead(LocalGroup::create(Path::new(&l.path), l.nonce, &layout, wait)?)?;
        }
        Ok(Inner::Worker(pp))
    }
}

/// What push/pull does on a rank or on a local learner.
trait Layers {
    fn push(&mut self, layer: u32) -> tidewire::Result<()>;
    fn push_factors(&mut self, layer: u32, u: &[f32], v: &[f32]) -> tidewire::Result<()>;
    fn pull(&mut self, layer: u32) -> tidewire::Result<()>;
    fn pull_all(&mut self) -> tidewire::Result<()>;
    fn in_flight(&self, layer: u32) -> bool;
}

impl Layers for PushPull {
    fn push(&mut self, layer: u32) -> tidewire::Result<()> {
        PushPull::push(self, layer)
    }
    fn push_factors(&mut self, layer: u32, u: &[f32], v: &[f32]) -> tidewire::Result<()> {
        PushPull::push_factors(self, layer, u, v)
    }
    fn pull(&mut self, layer: u32) -> tidewire::Result<()> {
        PushPull::pull(self, layer)
    }
    fn pull_all(&mut self) -> tidewire::Result<()> {
        PushPull::pull_all(self)
    }
    fn in_flight(&self, layer: u32) -> bool {
        PushPull::in_flight(self, layer)
    }
}

impl Layers for LearnerPushPull {
    fn push(&mut self, layer: u32) -> tidewire::Result<()> {
        LearnerPushPull::push(self, layer)
    }
    fn push_factors(&mut self, layer: u32, _: &[f32], _: &[f32]) -> tidewire::Result<()> {
        Err(tidewire::Error::LayerState {
            layer,
            why: "a local learner pushes gradients (every layer syncs through the PS with local aggregation)".into(),
        })
    }
    fn pull(&mut self, layer: u32) -> tidewire::Result<()> {
        LearnerPushPull::pull(self, layer)
    }
    fn pull_all(&mut self) -> tidewire::Result<()> {
        LearnerPushPull::pull_all(self)
    }
    fn in_flight(&self, layer: u32) -> bool {
        LearnerPushPull::in_flight(self, layer)
    }
}

/// One rank's session over caller-owned memory (see the module docs).
///
/// The tensors given as `params` and `grads` are held by this object and by
/// the session's registrations of their memory, until the last of them is
/// gone. Python code must not resize or re-point them (`resize_`, `set_`)
/// while the session lives, and must not touch a layer's part of either
/// between its push and its pull.
#[pyclass(frozen, module = "tidewire._native", name = "Session")]
#[derive(Debug)]
struct Session {
    /// The session; `None` once shut down.
    pp: Mutex<Option<Inner>>,
    /// Iterations done before this session (the resumed checkpoint's).
    start_iteration: u64,
    /// The framework state saved with the resumed checkpoint.
    framework: Option<Vec<u8>>,
    rank: u32,
    role: Role,
    world: usize,
    batch: usize,
    names: Vec<String>,
    sizes: Vec<usize>,
    schemes: Vec<Scheme>,
    transport: (String, String),
    /// The parameter and gradient tensors (for the `memory` getter; the
    /// registered buffers hold their own references).
    memory: [Py<PyAny>; 2],
}

impl Session {
    fn lock(&self) -> MutexGuard<'_, Option<Inner>> {
        self.pp.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn server_only(&self) -> PyErr {
        TidewireError::new_err(format!(
            "rank {} is a server only: it has no layers to push or pull; it serves the job from shutdown(), \
             which returns once every worker has shut down",
            self.rank
        ))
    }

    /// Runs `f` on the session with the GIL released.
    fn with_inner<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Inner) -> tidewire::Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut g = self.lock();
            let inner = g.as_mut().ok_or(tidewire::Error::Shutdown)?;
            f(inner)
        })
        .map_err(tw_err)
    }

    /// Runs `f` on a worker's push/pull interface with the GIL released.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut dyn Layers) -> tidewire::Result<T> + Send,
    ) -> PyResult<T> {
        if !self.role.is_worker() {
            return Err(self.server_only());
        }
        self.with_inner(py, |inner| match inner {
            Inner::Worker(pp) => f(pp),
            Inner::Learner(pp) => f(pp),
            Inner::Server(_) => Err(tidewire::Error::Shutdown),
        })
    }

    /// The Python object over `inner`, just opened from `c` over `memory`
    /// (a table of `sizes` values per layer).
    fn opened(inner: Inner, c: SessionConfig<'_>, sizes: Vec<usize>, memory: Memory<'_>) -> PyResult<Self> {
        let layers = c.layers.len();
        let (start_iteration, framework) = inner.session().map_or((0, None), |s| {
            (s.start_iteration(), s.framework_state().map(<[u8]>::to_vec))
        });
        let (role, schemes, transport, batch) = match inner.session() {
            Some(s) => (
                s.role(),
                (0..layers as u32)
                    .map(|l| s.scheme(l))
                    .collect::<tidewire::Result<Vec<_>>>()
                    .map_err(tw_err)?,
                s.transport(),
                s.book().config().batch,
            ),
            None => (
                Role::Worker,
                vec![Scheme::Ps; layers],
                (
                    "local".to_string(),
                    "a local learner: its node's leader rank talks to the network".to_string(),
                ),
                c.batch,
            ),
        };
        Ok(Session {
            start_iteration,
            framework,
            rank: c.rank,
            role,
            world: c.world,
            batch,
            names: c.layers.into_iter().map(|l| l.0).collect(),
            sizes,
            schemes,
            transport,
            pp: Mutex::new(Some(inner)),
            memory: memory.into_tensors(),
        })
    }

    fn check_layer(&self, layer: usize) -> PyResult<()> {
        if layer >= self.names.len() {
            return Err(TidewireError::new_err(format!(
                "layer {layer} does not exist (the session has {} layers)",
                self.names.len()
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl Session {
    /// Builds a session from `config` (a `tidewire.SessionConfig`) over the
    /// caller's `params` and `grads`: rendezvous with every rank, connections,
    /// registration of `params` and `grads` in place, and the broadcast of
    /// worker rank 0's initial values in `params` to every rank. Blocks (GIL
    /// released) until every rank has joined or `connect_timeout` passes.
    /// The keyword form of earlier versions, `Session(layers, params=,
    /// grads=, rank=, ...)`, still works (see [`config::resolve`]).
    #[new]
    #[pyo3(signature = (config, *, params, grads, **settings))]
    fn new<'py>(
        py: Python<'py>,
        config: Bound<'py, PyAny>,
        params: Bound<'py, PyAny>,
        grads: Bound<'py, PyAny>,
        settings: Option<Bound<'py, PyDict>>,
    ) -> PyResult<Self> {
        let given = config::resolve(config, settings)?;
        let c = SessionConfig::read(&given)?;
        let specs = c.layer_specs()?;
        let sizes: Vec<usize> = specs.iter().map(LayerSpec::params).collect();
        let memory = Memory::check(params, grads, &sizes)?;
        let (builder, cluster) = c.builder(specs)?;
        let (params, grads) = memory.pin()?;
        let opening = Opening {
            builder,
            cluster,
            dtype: memory.dtype,
            params,
            grads,
            local: c.local.clone(),
            sizes: sizes.clone(),
            wait: seconds(c.connect_timeout, "connect_timeout")?,
        };
        let inner = py.detach(move || opening.open()).map_err(tw_err)?;
        Session::opened(inner, c, sizes, memory)
    }

    /// Hands layer `layer`'s gradient in, straight from the gradient tensor.
    /// Returns at once. A layer whose scheme is 'sfb' needs `push_factors`.
    fn push(&self, py: Python<'_>, layer: usize) -> PyResult<()> {
        self.check_layer(layer)?;
        self.with(py, |pp| pp.push(layer as u32))
    }

    /// Hands an FC layer in by its sufficient factors: U (K x M) and V (K x N),
    /// row major float32 (bytes, a NumPy array or a CPU tensor; copied).
    fn push_factors(&self, py: Python<'_>, layer: usize, u: Bound<'_, PyAny>, v: Bound<'_, PyAny>) -> PyResult<()> {
        self.check_layer(layer)?;
        let u = factor_values(&u, "u")?;
        let v = factor_values(&v, "v")?;
        self.with(py, move |pp| pp.push_factors(layer as u32, &u, &v))
    }

    /// Blocks (GIL released) until `layer` is synced: the servers' result is
    /// in the parameter tensor. Returns at once for a layer not pushed.
    fn pull(&self, py: Python<'_>, layer: usize) -> PyResult<()> {
        self.check_layer(layer)?;
        self.with(py, |pp| pp.pull(layer as u32))
    }

    /// Pulls every pushed layer (GIL released).
    fn pull_all(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |pp| pp.pull_all())
    }

    /// Whether `layer` is synced, without blocking: True for a layer not
    /// pushed. False while another thread is inside a call on this session.
    fn poll(&self, layer: usize) -> PyResult<bool> {
        self.check_layer(layer)?;
        let mut g = match self.pp.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(false),
        };
        match g.as_mut() {
            Some(Inner::Worker(pp)) => pp.poll(layer as u32).map_err(tw_err),
            Some(Inner::Learner(pp)) => pp.poll(layer as u32).map_err(tw_err),
            Some(Inner::Server(_)) => Err(self.server_only()),
            None => Err(tw_err(tidewire::Error::Shutdown)),
        }
    }

    /// Whether `layer` is pushed and not pulled yet.
    fn in_flight(&self, py: Python<'_>, layer: usize) -> PyResult<bool> {
        self.check_layer(layer)?;
        self.with(py, |pp| Ok(pp.in_flight(layer as u32)))
    }

    /// How `layer` syncs: 'ps' (push the gradient), 'sfb' (push its
    /// sufficient factors) or 'adam' (push its sufficient factors, which
    /// the layer's server turns into the gradient). Fixed for the session.
    fn scheme(&self, layer: usize) -> PyResult<&'static str> {
        self.check_layer(layer)?;
        Ok(match self.schemes[layer] {
            Scheme::Ps => "ps",
            Scheme::Sfb => "sfb",
            Scheme::Adam => "adam",
        })
    }

    /// The session's counters (a dict of ints).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with_inner(py, |inner| match inner.session() {
            Some(s) => s.stats(),
            // A local learner puts nothing on the network itself.
            None => Ok(tidewire::SessionStats::default()),
        })?;
        let d = PyDict::new(py);
        let v = serde_json::to_value(s).map_err(|e| TidewireError::new_err(e.to_string()))?;
        if let serde_json::Value::Object(m) = v {
            for (k, v) in m {
                d.set_item(k, v.as_u64().unwrap_or(0))?;
            }
        }
        Ok(d)
    }

    /// Ends the session (GIL released): pulls what is in flight, tells the
    /// peers, and waits until every peer has said goodbye (a server-only rank
    /// serves the job until then). Every rank must call it. Later calls on
    /// this session raise TidewireError.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| match self.lock().take().ok_or(tidewire::Error::Shutdown)? {
            Inner::Worker(pp) => pp.shutdown(),
            Inner::Server(mut s) => s.shutdown(),
            Inner::Learner(mut pp) => pp.pull_all(),
        })
        .map_err(tw_err)
    }

    /// Ends the session at once, without the goodbye: the peers' sessions fail
    /// with "aborted" instead of waiting for this rank (use it after an error,
    /// where `shutdown` could wait forever for a layer that cannot complete).
    /// Does nothing once the session is shut down or aborted.
    fn abort(&self, py: Python<'_>) {
        // Dropping the session sends the abort and joins its runtime thread.
        py.detach(|| drop(self.lock().take()));
    }

    /// Iterations done before this session: 0, or the iteration of the
    /// checkpoint it resumed (`resume=`).
    #[getter]
    fn start_iteration(&self) -> u64 {
        self.start_iteration
    }

    /// The framework state (bytes) saved with the resumed checkpoint, or None.
    fn framework_state<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.framework.as_deref().map(|b| PyBytes::new(py, b))
    }

    /// Saves the learner's framework state (bytes, e.g. a `torch.save` of a
    /// `state_dict`) with checkpoint `iteration` (a multiple of the
    /// checkpoint period). Returns at once: the checkpoint thread writes it.
    fn save_framework_state(&self, py: Python<'_>, iteration: u64, state: Vec<u8>) -> PyResult<()> {
        self.with_inner(py, move |inner| match inner.session() {
            Some(s) => s.save_framework_state(iteration, state),
            None => Err(tidewire::Error::Checkpoint(
                "a local learner does not checkpoint".into(),
            )),
        })
    }

    /// What this rank's checkpoints cost so far (a dict: written, copy_s,
    /// write_s, bytes), or None when the session does not checkpoint.
    fn checkpoint_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let st = self.with_inner(py, |inner| Ok(inner.session().and_then(|s| s.checkpoint_stats())))?;
        let Some(st) = st else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("written", st.written)?;
        d.set_item("copy_s", st.copy_s)?;
        d.set_item("write_s", st.write_s)?;
        d.set_item("bytes", st.bytes)?;
        Ok(Some(d))
    }

    /// This rank's role: 'both' (worker and server shard), 'worker' or
    /// 'server' (serves only: push and pull raise).
    #[getter]
    fn role(&self) -> &'static str {
        match self.role {
            Role::Both => "both",
            Role::Worker => "worker",
            Role::Server => "server",
        }
    }

    /// Whether `shutdown` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.lock().is_none()
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// The number of ranks.
    #[getter]
    fn world(&self) -> usize {
        self.world
    }

    /// The batch size K the session was built with (rows of U and V).
    #[getter]
    fn batch(&self) -> usize {
        self.batch
    }

    /// Layer names, in table order.
    #[getter]
    fn layer_names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// Parameters (float32 values) of each layer, in table order.
    #[getter]
    fn layer_sizes(&self) -> Vec<usize> {
        self.sizes.clone()
    }

    /// The transport this rank runs on ('tcp', 'portable' or 'rdma') and why.
    #[getter]
    fn transport(&self) -> (String, String) {
        self.transport.clone()
    }

    /// The parameter and gradient tensors registered with the session.
    #[getter]
    fn memory(&self, py: Python<'_>) -> (Py<PyAny>, Py<PyAny>) {
        (self.memory[0].clone_ref(py), self.memory[1].clone_ref(py))
    }

    fn __len__(&self) -> usize {
        self.names.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "<tidewire._native.Session rank {} of {}, {} layers, {}>",
            self.rank,
            self.world,
            self.names.len(),
            if self.closed() { "closed" } else { "open" }
        )
    }
}

fn decision_dict<'py>(py: Python<'py>, d: &Decision) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    match *d {
        Decision::Keep => out.set_item("decision", "keep")?,
        Decision::Propose { from, to } => {
            out.set_item("decision", "propose")?;
            out.set_item("from", from)?;
            out.set_item("to", to)?;
        }
        Decision::Accept { t, next } => {
            out.set_item("decision", "accept")?;
            out.set_item("t", t)?;
            out.set_item("next", next)?;
        }
        Decision::Reject { t, back_to, learner } => {
            out.set_item("decision", "reject")?;
            out.set_item("t", t)?;
            out.set_item("back_to", back_to)?;
            out.set_item("learner", learner)?;
        }
        Decision::Revert { to } => {
            out.set_item("decision", "revert")?;
            out.set_item("to", to)?;
        }
    }
    Ok(out)
}

/// One learner's communication frequency: [`tidewire::freq::Guide`] with
/// servers that average (`ApplyOp::Mean`). `tidewire.torch` keeps the quality
/// layer in its flat buffers: it writes `figure()` into this learner's column
/// before an exchange and hands the synced row to `exchanged`.
#[pyclass(module = "tidewire._native", name = "FreqGuide")]
struct FreqGuide {
    g: Guide,
}

#[pymethods]
impl FreqGuide {
    /// `comm` is a `tidewire.CommConfig`.
    #[new]
    fn new(comm: Bound<'_, PyAny>, learner: usize, learners: usize) -> PyResult<Self> {
        let c = Comm::read(&comm, "comm")?.check()?;
        Ok(FreqGuide {
            g: Guide::new(c, ApplyOp::Mean, learner, learners).map_err(|e| PyValueError::new_err(e.to_string()))?,
        })
    }
    /// Reports a quality figure (a loss) for the step now running.
    fn report(&mut self, quality: f64) {
        self.g.report(quality);
    }
    /// Whether the step now running ends with an exchange.
    fn due(&self) -> bool {
        self.g.due()
    }
    /// Ends a step without an exchange.
    fn local_step(&mut self) -> PyResult<()> {
        self.g.local_step().map_err(tw_err)
    }
    /// The mean of the reports since the last exchange (None without one).
    fn figure(&self) -> Option<f64> {
        self.g.figure()
    }
    /// Whether the frequency adjusts (the quality layer travels with every exchange).
    #[getter]
    fn adjusts(&self) -> bool {
        self.g.adjusts()
    }
    /// The T in force.
    #[getter]
    fn t(&self) -> u32 {
        self.g.t()
    }
    /// Steps finished.
    #[getter]
    fn steps(&self) -> u64 {
        self.g.controller().steps()
    }
    /// Exchanges finished.
    #[getter]
    fn exchanges(&self) -> u64 {
        self.g.controller().exchanges()
    }
    /// Ends a step with an exchange: `synced` is the quality layer's synced
    /// row (the servers' mean); with a fixed T pass None. Returns the decision as a dict.
    fn exchanged<'py>(&mut self, py: Python<'py>, synced: Option<Vec<f32>>) -> PyResult<Bound<'py, PyDict>> {
        let d = match synced {
            Some(v) => self.g.exchanged(&v),
            None => self.g.exchanged_fixed(),
        }
        .map_err(tw_err)?;
        decision_dict(py, &d)
    }
    /// The decisions other than 'keep', oldest first: dicts with `step` and `exchange`.
    fn history<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.g
            .controller()
            .history()
            .iter()
            .map(|e| {
                let d = decision_dict(py, &e.decision)?;
                d.set_item("step", e.step)?;
                d.set_item("exchange", e.exchange)?;
                Ok(d)
            })
            .collect()
    }
    /// What is remembered of every T run: {T: (quality, rejected, windows)}.
    fn memory(&self) -> Vec<(u32, f64, bool, u32)> {
        self.g
            .controller()
            .memory()
            .iter()
            .map(|(t, m)| (*t, m.quality, m.rejected, m.windows))
            .collect()
    }
}

/// Tidewire's native module (see the crate docs).
/// The newest complete checkpoint (a `step-*` directory) under `dir`, or
/// None: where a restarted job resumes from.
/// This machine's rates, one thread each, measured for about `ms`
/// milliseconds apiece: `(cores, link_bytes_per_s, msg_s, sum_bytes_per_s,
/// gemm_flop_per_s, mem_bytes_per_s)`, the last the sum on every core at
/// once (see `tidewire calibrate`). The GIL is released.
#[pyfunction]
#[pyo3(signature = (ms = 100))]
fn calibrate(py: Python<'_>, ms: u64) -> PyResult<(usize, f64, f64, f64, f64, f64)> {
    if ms == 0 || ms > 60_000 {
        return Err(PyValueError::new_err(format!("ms={ms}: want 1 to 60000")));
    }
    let p = py
        .detach(|| tidewire::calibrate::measure(std::time::Duration::from_millis(ms)))
        .map_err(tw_err)?;
    let r = p.rates;
    Ok((
        p.cores,
        r.link_bytes_per_s,
        r.msg_s,
        r.sum_bytes_per_s,
        r.gemm_flop_per_s,
        p.mem_bytes_per_s.unwrap_or(r.sum_bytes_per_s * p.cores as f64),
    ))
}

/// Serves one link probe ([`probe_stream`]) on `host`, port chosen by the
/// system; `port` says which, `join()` waits for the probe (30 s at most).
#[pyclass(module = "tidewire._native")]
struct LinkProbe {
    server: Option<tidewire::calibrate::StreamServer>,
    port: u16,
}

#[pymethods]
impl LinkProbe {
    #[new]
    fn new(host: &str) -> PyResult<Self> {
        let ip: std::net::IpAddr = host
            .trim_matches(['[', ']'])
            .parse()
            .map_err(|e| PyValueError::new_err(format!("host {host:?}: {e} (want an IP address)")))?;
        let server = tidewire::calibrate::StreamServer::bind(SocketAddr::new(ip, 0)).map_err(tw_err)?;
        Ok(LinkProbe {
            port: server.port(),
            server: Some(server),
        })
    }
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }
    fn join(&mut self, py: Python<'_>) -> PyResult<()> {
        match self.server.take() {
            Some(s) => py.detach(|| s.join()).map_err(tw_err),
            None => Ok(()),
        }
    }
}

/// Bytes per second of one TCP stream to a `LinkProbe` at `addr`
/// (`host:port`), written for about `ms` milliseconds. The GIL is released.
#[pyfunction]
#[pyo3(signature = (addr, ms = 300))]
fn probe_stream(py: Python<'_>, addr: &str, ms: u64) -> PyResult<f64> {
    let a: SocketAddr = addr
        .to_socket_addrs()
        .map_err(|e| PyValueError::new_err(format!("addr {addr:?}: {e} (want host:port)")))?
        .next()
        .ok_or_else(|| PyValueError::new_err(format!("addr {addr:?} resolves to nothing")))?;
    py.detach(|| tidewire::calibrate::probe_stream(a, std::time::Duration::from_millis(ms.clamp(1, 60_000))))
        .map_err(tw_err)
}

#[pyfunction]
fn newest_checkpoint(dir: &str) -> PyResult<Option<String>> {
    tidewire::checkpoint::Loaded::newest_complete(dir)
        .map(|p| p.map(|p| p.display().to_string()))
        .map_err(tw_err)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Session>()?;
    m.add_function(wrap_pyfunction!(newest_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate, m)?)?;
    m.add_function(wrap_pyfunction!(probe_stream, m)?)?;
    m.add_class::<LinkProbe>()?;
    m.add_class::<FreqGuide>()?;
    m.add("TidewireError", m.py().get_type::<TidewireError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
