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
//! With `servers=N` the last N ranks are servers only: their session has no
//! layers, and `shutdown` serves the job until every worker has shut down.
//! After an error, `abort` ends a session without waiting for its peers.
//!
//! With `local=(learners, index, path, nonce, staleness)` the session is one
//! of a node's `learners` local learners (Nexus's local aggregation,
//! `tidewire::local`): index 0 is the node's rank (its `rank` and `world`
//! count nodes) and sums the other learners' gradients into its own before
//! each push; index ≥ 1 joins no rendezvous, hands its gradients to index 0
//! through shared memory at `path`, and pulls the parameters from the node's
//! cache (up to `staleness` versions old). Every layer syncs through the PS.
//!
//! Every call that waits (the constructor's rendezvous, `pull`, `pull_all`,
//! `shutdown`) releases the GIL. Errors raise `tidewire.TidewireError` (a
//! `RuntimeError`) with the Rust error's message.

mod config;
mod memory;

use std::any::Any;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard, TryLockError};

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};
use tidewire::cluster::ClusterSpec;
use tidewire::engine::book::LayerSpec;
use tidewire::engine::freq::Decision;
use tidewire::engine::{ApplyOp, Role, Scheme};
use tidewire::freq::Guide;
use tidewire::local::{LearnerPushPull, LocalGroup};
use tidewire::pushpull::PushPull;
use tidewire::transport::{JobSecret, PinnedBuffer};
use tidewire::Builder;

use config::{parse_apply, parse_comm, parse_consistency, parse_kind, parse_policy, parse_transport, seconds};
use memory::{factor_values, host_memory};

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
    /// Builds a session: rendezvous with every rank, connections, registration
    /// of `params` and `grads` in place, and the broadcast of worker rank 0's
    /// initial values in `params` to every rank. Blocks (GIL released) until
    /// every rank has joined or `connect_timeout` passes.
    #[new]
    #[pyo3(signature = (
        layers, *, params, grads, rank, world, master, secret, servers = 0, job = 1, batch = 32,
        apply = None, consistency = None, policy = "hybrid", transport = "auto", timeout = 60.0,
        connect_timeout = 60.0, chunk_bytes = None, slice_params = None, listen_ip = None, local = None,
        comm = None, checkpoint = None, resume = None, trigger = "all", rates = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layers: Vec<(String, String, usize, usize)>,
        params: Bound<'_, PyAny>,
        grads: Bound<'_, PyAny>,
        rank: u32,
        world: usize,
        master: &str,
        secret: Bound<'_, PyAny>,
        servers: usize,
        job: u64,
        batch: usize,
        apply: Option<Bound<'_, PyAny>>,
        consistency: Option<Bound<'_, PyAny>>,
        policy: &str,
        transport: &str,
        timeout: f64,
        connect_timeout: f64,
        chunk_bytes: Option<usize>,
        slice_params: Option<usize>,
        listen_ip: Option<&str>,
        local: Option<(usize, usize, String, u64, u64)>,
        comm: Option<(String, u32, u32, u32, f64, Option<u64>)>,
        checkpoint: Option<(String, u64, usize, bool)>,
        resume: Option<String>,
        trigger: &str,
        rates: Option<(f64, f64, f64, f64)>,
    ) -> PyResult<Self> {
        if layers.is_empty() {
            return Err(PyValueError::new_err("the layer table is empty"));
        }
        let mut specs = Vec::with_capacity(layers.len());
        for (name, kind, m, n) in &layers {
            if *m == 0 || *n == 0 {
                return Err(PyValueError::new_err(format!(
                    "layer {name:?}: {m}x{n} has no parameters"
                )));
            }
            let (k, sparse) = parse_kind(kind, name)?;
            specs.push(LayerSpec::new(name.clone(), k, *m, *n).sparse(sparse));
        }
        let sizes: Vec<usize> = specs.iter().map(LayerSpec::params).collect();
        let (pptr, plen, t) = host_memory(&params, "params")?;
        let (gptr, glen, gt) = host_memory(&grads, "grads")?;
        if gt != t {
            return Err(PyValueError::new_err(format!(
                "params are {} but grads are {}: both must have one dtype",
                t.name(),
                gt.name()
            )));
        }
        let count = sizes
            .iter()
            .try_fold(0usize, |a, &s| a.checked_add(s))
            .ok_or_else(|| PyValueError::new_err("the layer table's size overflows"))?;
        let total = count
            .checked_mul(t.size())
            .ok_or_else(|| PyValueError::new_err("the layer table's size overflows"))?;
        for (what, len) in [("params", plen), ("grads", glen)] {
            if len < total {
                return Err(PyValueError::new_err(format!(
                    "{what}: {len} bytes, but the layer table needs {total} ({count} {} values)",
                    t.name()
                )));
            }
        }
        if pptr < gptr + total && gptr < pptr + total {
            return Err(PyValueError::new_err("params and grads overlap"));
        }
        let secret = if let Ok(s) = secret.cast::<PyString>() {
            s.to_cow()?.as_bytes().to_vec()
        } else if let Ok(b) = secret.cast::<PyBytes>() {
            b.as_bytes().to_vec()
        } else {
            return Err(PyTypeError::new_err("secret: want str or bytes"));
        };
        if secret.is_empty() {
            return Err(PyValueError::new_err(
                "secret is empty: every rank must pass the same non-empty secret",
            ));
        }
        let addr: SocketAddr = master
            .to_socket_addrs()
            .map_err(|e| PyValueError::new_err(format!("master {master:?}: {e} (want host:port)")))?
            .next()
            .ok_or_else(|| PyValueError::new_err(format!("master {master:?} resolves to nothing")))?;
        if servers >= world {
            return Err(PyValueError::new_err(format!(
                "servers={servers} leaves no worker in a world of {world}"
            )));
        }
        let spec = if servers == 0 {
            ClusterSpec::new(rank, world, 0, true, addr)
        } else {
            ClusterSpec::new(rank, world - servers, servers, false, addr)
        }
        .map_err(tw_err)?;
        if let Some((learners, index, _, _, _)) = &local {
            if *learners < 1 || index >= learners {
                return Err(PyValueError::new_err(format!(
                    "local: learner index {index} of {learners} learners (want 0 <= index < learners)"
                )));
            }
            if policy != "ps" {
                return Err(PyValueError::new_err(format!(
                    "local: with local aggregation every layer syncs through the PS: give policy='ps', not {policy:?}"
                )));
            }
        }
        let mut b = Builder::new(specs)
            .batch(batch)
            .apply(parse_apply(apply.as_ref())?)
            .consistency(parse_consistency(consistency.as_ref())?)
            .policy(parse_policy(policy)?)
            .transport(parse_transport(transport)?)
            .timeout(seconds(timeout, "timeout")?)
            .connect_timeout(seconds(connect_timeout, "connect_timeout")?)
            .job(job, JobSecret::new(secret));
        if let Some(c) = comm {
            b = b.comm(parse_comm(c)?);
        }
        if (checkpoint.is_some() || resume.is_some()) && local.is_some() {
            return Err(PyValueError::new_err(
                "checkpoint/resume with local aggregation is not supported yet",
            ));
        }
        if let Some((dir, every, keep, framework_state)) = checkpoint {
            b = b.checkpoint(tidewire::checkpoint::Checkpointing {
                dir: dir.into(),
                every,
                keep,
                framework_state,
            });
        }
        if let Some(r) = resume {
            b = b.resume(r);
        }
        b = b.trigger(tidewire::engine::Trigger::parse(trigger).ok_or_else(|| {
            PyValueError::new_err(format!(
                "trigger {trigger:?}: want 'all', 'quorum:K', 'async' or 'timeout:MS'"
            ))
        })?);
        if let Some((link_bytes_per_s, msg_s, sum_bytes_per_s, gemm_flop_per_s)) = rates {
            let r = tidewire::engine::cost::Rates {
                link_bytes_per_s,
                msg_s,
                sum_bytes_per_s,
                gemm_flop_per_s,
            };
            r.validate().map_err(|e| PyValueError::new_err(format!("rates: {e}")))?;
            b = b.rates(r);
        }
        if let Some(c) = chunk_bytes {
            b = b.chunk_bytes(c);
        }
        if let Some(s) = slice_params {
            b = b.slice_params(s);
        }
        if let Some(ip) = listen_ip {
            let ip = ip
                .parse()
                .map_err(|e| PyValueError::new_err(format!("listen_ip {ip:?}: {e}")))?;
            b = b.listen_ip(ip);
        }
        let (p_owner, g_owner): (Box<dyn Any + Send + Sync>, Box<dyn Any + Send + Sync>) =
            (Box::new(params.clone().unbind()), Box::new(grads.clone().unbind()));
        // pptr..pptr+total lies in the storage of the tensor `params` (address
        // and size read from the tensor itself above, and checked to cover the
        // layer table). The buffer owns a reference to that tensor, dropped with
        // the buffer and its last region (even a region the transport leaks
        // keeps it), so the storage stays allocated while any of them lives,
        // unless Python code re-points or resizes the tensor, which this class's
        // contract forbids, as it forbids touching a layer's part between its
        // push and its pull.
        // SAFETY: the storage outlives the buffer (it holds the tensor), as above.
        let p = unsafe { PinnedBuffer::foreign(pptr as *mut u8, total, Some(p_owner)) };
        let p = p.map_err(|e| tw_err(e.into()))?;
        // SAFETY: as for `params` just above, for the tensor `grads`, which this buffer owns a reference to.
        let g = unsafe { PinnedBuffer::foreign(gptr as *mut u8, total, Some(g_owner)) };
        let g = g.map_err(|e| tw_err(e.into()))?;
        // float32 memory is registered in place; float16, bfloat16 and float64 are
        // staged through float32 (PushPull::build: widened at push, narrowed at pull).
        let wait = seconds(connect_timeout, "connect_timeout")?;
        let lsizes = sizes.clone();
        if let Some((learners, _, _, _, _)) = &local {
            b = b.local_learners(*learners as u32);
        }
        let inner = py
            .detach(move || {
                if let Some((learners, index, path, nonce, staleness)) = local {
                    let path = std::path::PathBuf::from(path);
                    if index > 0 {
                        let pp =
                            LearnerPushPull::attach(&path, nonce, learners, index, &lsizes, t, p, g, wait, staleness)?;
                        return Ok(Inner::Learner(pp));
                    }
                    let mut pp = PushPull::build(b, spec, t, p, g)?;
                    if pp.session().role().is_worker() {
                        let layout = LearnerPushPull::layout(learners, &lsizes);
                        pp.lead(LocalGroup::create(&path, nonce, &layout, wait)?)?;
                        return Ok(Inner::Worker(pp));
                    }
                    return Ok(Inner::Server(pp.into_session()));
                }
                let pp = PushPull::build(b, spec, t, p, g)?;
                Ok(if pp.session().role().is_worker() {
                    Inner::Worker(pp)
                } else {
                    Inner::Server(pp.into_session())
                })
            })
            .map_err(tw_err)?;
        let (start_iteration, framework) = inner.session().map_or((0, None), |s| {
            (s.start_iteration(), s.framework_state().map(<[u8]>::to_vec))
        });
        let (role, schemes, transport, batch) = match inner.session() {
            Some(s) => (
                s.role(),
                (0..layers.len() as u32)
                    .map(|l| s.scheme(l))
                    .collect::<tidewire::Result<Vec<_>>>()
                    .map_err(tw_err)?,
                s.transport(),
                s.book().config().batch,
            ),
            None => (
                Role::Worker,
                vec![Scheme::Ps; layers.len()],
                (
                    "local".to_string(),
                    "a local learner: its node's leader rank talks to the network".to_string(),
                ),
                batch,
            ),
        };
        Ok(Session {
            start_iteration,
            framework,
            rank,
            role,
            world,
            batch,
            names: layers.into_iter().map(|l| l.0).collect(),
            sizes,
            schemes,
            transport,
            pp: Mutex::new(Some(inner)),
            memory: [params.unbind(), grads.unbind()],
        })
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
    /// `comm` is `(mode, t, t_max, period, tolerance, revert_at_step)`.
    #[new]
    fn new(comm: (String, u32, u32, u32, f64, Option<u64>), learner: usize, learners: usize) -> PyResult<Self> {
        let c = parse_comm(comm)?;
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
/// gemm_flop_per_s)` (see `tidewire calibrate`). The GIL is released.
#[pyfunction]
#[pyo3(signature = (ms = 100))]
fn calibrate(py: Python<'_>, ms: u64) -> PyResult<(usize, f64, f64, f64, f64)> {
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
