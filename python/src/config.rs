//! A session's configuration: `tidewire.SessionConfig` and its records
//! (python/tidewire/_config.py, where every field's type, default and meaning
//! are), read by attribute and checked, once, into what a session is built
//! from: its layer table, a [`Builder`] and a [`ClusterSpec`].
//!
//! The checks run in the order the constructor's keyword arguments were checked
//! before there was a `SessionConfig`, with the same messages: every field is
//! read first (a wrong type names the field, `SessionConfig.rank: ...`), then
//! the layer table, the caller's memory (`crate::memory`), and the rest.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use pyo3::conversion::FromPyObjectOwned;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple};
use tidewire::checkpoint::Checkpointing;
use tidewire::cluster::ClusterSpec;
use tidewire::engine::book::{LayerKind, LayerSpec};
use tidewire::engine::cost::Rates;
use tidewire::engine::freq::{CommConfig, CommMode, FreqConfig};
use tidewire::engine::{ApplyOp, Consistency, SchemePolicy, Trigger};
use tidewire::transport::JobSecret;
use tidewire::{Builder, TransportKind};

use crate::tw_err;

/// Attribute `name` of `obj` as a `T`. A failure keeps Python's exception type
/// and its message, after the field's name: `TypeError: SessionConfig.rank:
/// 'str' object cannot be interpreted as an integer`.
fn attr<'py, T: FromPyObjectOwned<'py>>(obj: &Bound<'py, PyAny>, owner: &str, name: &str) -> PyResult<T> {
    let py = obj.py();
    let named = |e: PyErr| {
        let err = PyErr::from_type(e.get_type(py), format!("{owner}.{name}: {}", e.value(py)));
        err.set_cause(py, Some(e));
        err
    };
    let value = obj.getattr(name).map_err(named)?;
    value.extract::<T>().map_err(|e| named(e.into()))
}

/// Attribute `name` of `obj`, read by `read` unless it is None.
fn record<'py, T>(
    obj: &Bound<'py, PyAny>,
    owner: &str,
    name: &str,
    read: fn(&Bound<'py, PyAny>, &str) -> PyResult<T>,
) -> PyResult<Option<T>> {
    let value: Option<Bound<'py, PyAny>> = attr(obj, owner, name)?;
    value.map(|v| read(&v, &format!("{owner}.{name}"))).transpose()
}

/// The SessionConfig `Session(config, ...)` was given, or, for the keyword
/// form of earlier versions (`Session(layers, params=, grads=, rank=, ...)`,
/// which `_native.pyi` documents), the one `tidewire._config._from_keywords`
/// makes of `layers` and the keywords.
pub(crate) fn resolve<'py>(
    config: Bound<'py, PyAny>,
    settings: Option<Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    let Some(settings) = settings.filter(|s| !s.is_empty()) else {
        return Ok(config);
    };
    if config.hasattr("layers")? {
        return Err(PyTypeError::new_err(format!(
            "Session(config, params=, grads=) takes the other settings from config, not as keywords ({})",
            settings.keys()
        )));
    }
    let keywords = config.py().import("tidewire._config")?.getattr("_from_keywords")?;
    keywords.call((config,), Some(&settings))
}

/// `tidewire.LocalAggregation`: this session is learner `index` of a node's
/// `learners` (see the crate docs).
#[derive(Debug, Clone)]
pub(crate) struct Local {
    pub learners: usize,
    pub index: usize,
    pub path: String,
    pub nonce: u64,
    pub staleness: u64,
}

impl Local {
    fn read(obj: &Bound<'_, PyAny>, owner: &str) -> PyResult<Self> {
        Ok(Local {
            learners: attr(obj, owner, "learners")?,
            index: attr(obj, owner, "index")?,
            path: attr(obj, owner, "path")?,
            nonce: attr(obj, owner, "nonce")?,
            staleness: attr(obj, owner, "staleness")?,
        })
    }
}

/// `tidewire.CommConfig` as read: its mode is checked by [`Comm::check`].
#[derive(Debug)]
pub(crate) struct Comm {
    mode: String,
    freq: FreqConfig,
}

impl Comm {
    pub(crate) fn read(obj: &Bound<'_, PyAny>, owner: &str) -> PyResult<Self> {
        Ok(Comm {
            mode: attr(obj, owner, "mode")?,
            freq: FreqConfig {
                t_initial: attr(obj, owner, "t_initial")?,
                t_max: attr(obj, owner, "t_max")?,
                period: attr(obj, owner, "period")?,
                tolerance: attr(obj, owner, "tolerance")?,
                revert_at_step: attr(obj, owner, "revert_at_step")?,
            },
        })
    }

    pub(crate) fn check(&self) -> PyResult<CommConfig> {
        let mode = CommMode::parse(&self.mode).ok_or_else(|| {
            PyValueError::new_err(format!("comm mode {:?}: want 'accumulate' or 'average'", self.mode))
        })?;
        self.freq.validate().map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(CommConfig { mode, freq: self.freq })
    }
}

/// `tidewire.Checkpointing`.
fn read_checkpointing(obj: &Bound<'_, PyAny>, owner: &str) -> PyResult<Checkpointing> {
    Ok(Checkpointing {
        dir: attr::<String>(obj, owner, "dir")?.into(),
        every: attr(obj, owner, "every")?,
        keep: attr(obj, owner, "keep")?,
        framework_state: attr(obj, owner, "framework_state")?,
    })
}

/// `tidewire.Rates` (checked by [`SessionConfig::options`]).
fn read_rates(obj: &Bound<'_, PyAny>, owner: &str) -> PyResult<Rates> {
    Ok(Rates {
        link_bytes_per_s: attr(obj, owner, "link_bytes_per_s")?,
        msg_s: attr(obj, owner, "msg_s")?,
        sum_bytes_per_s: attr(obj, owner, "sum_bytes_per_s")?,
        gemm_flop_per_s: attr(obj, owner, "gemm_flop_per_s")?,
        host_ranks: attr(obj, owner, "host_ranks")?,
        link_on_host: attr(obj, owner, "link_on_host")?,
        ps_builds_grad: attr(obj, owner, "ps_builds_grad")?,
    })
}

/// `tidewire.SessionConfig`, every field read and of its type, none checked
/// yet (see the module docs).
#[derive(Debug)]
pub(crate) struct SessionConfig<'py> {
    pub layers: Vec<(String, String, usize, usize)>,
    pub rank: u32,
    pub world: usize,
    master: String,
    secret: Bound<'py, PyAny>,
    servers: usize,
    job: u64,
    pub batch: usize,
    apply: Option<Bound<'py, PyAny>>,
    consistency: Option<Bound<'py, PyAny>>,
    policy: String,
    transport: String,
    timeout: f64,
    pub connect_timeout: f64,
    chunk_bytes: Option<usize>,
    slice_params: Option<usize>,
    listen_ip: Option<String>,
    pub local: Option<Local>,
    comm: Option<Comm>,
    checkpoint: Option<Checkpointing>,
    resume: Option<String>,
    trigger: String,
    rates: Option<Rates>,
    adapt_every: u64,
}

impl<'py> SessionConfig<'py> {
    /// Reads every field of `config` (a `tidewire.SessionConfig`).
    pub(crate) fn read(config: &Bound<'py, PyAny>) -> PyResult<Self> {
        const C: &str = "SessionConfig";
        Ok(SessionConfig {
            layers: attr(config, C, "layers")?,
            rank: attr(config, C, "rank")?,
            world: attr(config, C, "world")?,
            master: attr(config, C, "master")?,
            secret: attr(config, C, "secret")?,
            servers: attr(config, C, "servers")?,
            job: attr(config, C, "job")?,
            batch: attr(config, C, "batch")?,
            apply: attr(config, C, "apply")?,
            consistency: attr(config, C, "consistency")?,
            policy: attr(config, C, "policy")?,
            transport: attr(config, C, "transport")?,
            timeout: attr(config, C, "timeout")?,
            connect_timeout: attr(config, C, "connect_timeout")?,
            chunk_bytes: attr(config, C, "chunk_bytes")?,
            slice_params: attr(config, C, "slice_params")?,
            listen_ip: attr(config, C, "listen_ip")?,
            local: record(config, C, "local", Local::read)?,
            comm: record(config, C, "comm", Comm::read)?,
            checkpoint: record(config, C, "checkpoint", read_checkpointing)?,
            resume: attr(config, C, "resume")?,
            trigger: attr(config, C, "trigger")?,
            rates: record(config, C, "rates", read_rates)?,
            adapt_every: attr(config, C, "adapt_every")?,
        })
    }

    /// The layer table, checked.
    pub(crate) fn layer_specs(&self) -> PyResult<Vec<LayerSpec>> {
        if self.layers.is_empty() {
            return Err(PyValueError::new_err("the layer table is empty"));
        }
        let mut specs = Vec::with_capacity(self.layers.len());
        for (name, kind, m, n) in &self.layers {
            if *m == 0 || *n == 0 {
                return Err(PyValueError::new_err(format!(
                    "layer {name:?}: {m}x{n} has no parameters"
                )));
            }
            let (k, sparse) = parse_kind(kind, name)?;
            specs.push(LayerSpec::new(name.clone(), k, *m, *n).sparse(sparse));
        }
        Ok(specs)
    }

    /// The session's builder over the layer table `specs`, and this rank's
    /// place in the job: every other field, checked.
    pub(crate) fn builder(&self, specs: Vec<LayerSpec>) -> PyResult<(Builder, ClusterSpec)> {
        let secret = secret_bytes(&self.secret)?;
        let cluster = self.cluster()?;
        self.check_local()?;
        let b = Builder::new(specs)
            .batch(self.batch)
            .apply(parse_apply(self.apply.as_ref())?)
            .consistency(parse_consistency(self.consistency.as_ref())?)
            .policy(parse_policy(&self.policy)?)
            .transport(parse_transport(&self.transport)?)
            .timeout(seconds(self.timeout, "timeout")?)
            .connect_timeout(seconds(self.connect_timeout, "connect_timeout")?)
            .job(self.job, JobSecret::new(secret));
        Ok((self.options(b)?, cluster))
    }

    /// Where this rank is: `master`, `rank`, `world` and `servers`.
    fn cluster(&self) -> PyResult<ClusterSpec> {
        let master = &self.master;
        let addr: SocketAddr = master
            .to_socket_addrs()
            .map_err(|e| PyValueError::new_err(format!("master {master:?}: {e} (want host:port)")))?
            .next()
            .ok_or_else(|| PyValueError::new_err(format!("master {master:?} resolves to nothing")))?;
        let (rank, world, servers) = (self.rank, self.world, self.servers);
        if servers >= world {
            return Err(PyValueError::new_err(format!(
                "servers={servers} leaves no worker in a world of {world}"
            )));
        }
        if servers == 0 {
            ClusterSpec::new(rank, world, 0, true, addr)
        } else {
            ClusterSpec::new(rank, world - servers, servers, false, addr)
        }
        .map_err(tw_err)
    }

    fn check_local(&self) -> PyResult<()> {
        let Some(Local { learners, index, .. }) = &self.local else {
            return Ok(());
        };
        if *learners < 1 || index >= learners {
            return Err(PyValueError::new_err(format!(
                "local: learner index {index} of {learners} learners (want 0 <= index < learners)"
            )));
        }
        let policy = &self.policy;
        if policy != "ps" {
            return Err(PyValueError::new_err(format!(
                "local: with local aggregation every layer syncs through the PS: give policy='ps', not {policy:?}"
            )));
        }
        Ok(())
    }

    /// The optional fields, on `b`.
    fn options(&self, mut b: Builder) -> PyResult<Builder> {
        if let Some(c) = &self.comm {
            b = b.comm(c.check()?);
        }
        if (self.checkpoint.is_some() || self.resume.is_some()) && self.local.is_some() {
            return Err(PyValueError::new_err(
                "checkpoint/resume with local aggregation is not supported yet",
            ));
        }
        if let Some(c) = &self.checkpoint {
            b = b.checkpoint(c.clone());
        }
        if let Some(r) = &self.resume {
            b = b.resume(r.clone());
        }
        let trigger = &self.trigger;
        b = b.trigger(Trigger::parse(trigger).ok_or_else(|| {
            PyValueError::new_err(format!(
                "trigger {trigger:?}: want 'all', 'quorum:K', 'async' or 'timeout:MS'"
            ))
        })?);
        if let Some(r) = &self.rates {
            r.validate().map_err(|e| PyValueError::new_err(format!("rates: {e}")))?;
            b = b.rates(*r);
        }
        if self.adapt_every > 0 {
            b = b.adaptive(self.adapt_every);
        }
        if let Some(c) = self.chunk_bytes {
            b = b.chunk_bytes(c);
        }
        if let Some(s) = self.slice_params {
            b = b.slice_params(s);
        }
        if let Some(ip) = &self.listen_ip {
            let ip = ip
                .parse()
                .map_err(|e| PyValueError::new_err(format!("listen_ip {ip:?}: {e}")))?;
            b = b.listen_ip(ip);
        }
        if let Some(l) = &self.local {
            b = b.local_learners(l.learners as u32);
        }
        Ok(b)
    }
}

fn secret_bytes(secret: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
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
    Ok(secret)
}

/// A layer kind, with `:sparse` after it for the sparse-push hint
/// (`"other:sparse"`: an `nn.Embedding(sparse=True)`).
fn parse_kind(kind: &str, name: &str) -> PyResult<(LayerKind, bool)> {
    let (base, sparse) = match kind.strip_suffix(":sparse") {
        Some(b) => (b, true),
        None => (kind, false),
    };
    Ok((parse_base_kind(base, name)?, sparse))
}

fn parse_base_kind(kind: &str, name: &str) -> PyResult<LayerKind> {
    match kind {
        "fc" => Ok(LayerKind::Fc),
        "conv" => Ok(LayerKind::Conv),
        "other" => Ok(LayerKind::Other),
        k => Err(PyValueError::new_err(format!(
            "layer {name:?}: kind {k:?}, want 'fc', 'conv' or 'other'"
        ))),
    }
}

/// `"mean"`, `"sum"`, or `("sgd", lr, momentum, weight_decay)`.
fn parse_apply(obj: Option<&Bound<'_, PyAny>>) -> PyResult<ApplyOp> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(ApplyOp::Mean);
    };
    if let Ok(s) = obj.cast::<PyString>() {
        return match &*s.to_cow()? {
            "mean" => Ok(ApplyOp::Mean),
            "sum" => Ok(ApplyOp::Sum),
            o => Err(PyValueError::new_err(format!(
                "apply={o:?}: want 'mean', 'sum' or ('sgd', lr, momentum, weight_decay)"
            ))),
        };
    }
    let t = obj.cast::<PyTuple>().map_err(|_| {
        PyTypeError::new_err("apply: want 'mean', 'sum' or a tuple ('sgd', lr, momentum, weight_decay)")
    })?;
    let (op, lr, momentum, weight_decay): (String, f32, f32, f32) = t.extract()?;
    if op != "sgd" {
        return Err(PyValueError::new_err(format!(
            "apply=({op:?}, ...): only 'sgd' takes arguments"
        )));
    }
    if !(lr.is_finite() && momentum.is_finite() && weight_decay.is_finite()) {
        return Err(PyValueError::new_err(
            "apply=('sgd', ...): lr, momentum and weight_decay must be finite",
        ));
    }
    Ok(ApplyOp::Sgd {
        lr,
        momentum,
        weight_decay,
    })
}

/// `"bsp"` or `("ssp", staleness)`.
fn parse_consistency(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Consistency> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Consistency::Bsp);
    };
    if let Ok(s) = obj.cast::<PyString>() {
        return match &*s.to_cow()? {
            "bsp" => Ok(Consistency::Bsp),
            o => Err(PyValueError::new_err(format!(
                "consistency={o:?}: want 'bsp' or ('ssp', staleness)"
            ))),
        };
    }
    let (name, s): (String, u32) = obj
        .extract()
        .map_err(|_| PyTypeError::new_err("consistency: want 'bsp' or a tuple ('ssp', staleness)"))?;
    if name != "ssp" {
        return Err(PyValueError::new_err(format!(
            "consistency=({name:?}, ...): want ('ssp', staleness)"
        )));
    }
    Ok(Consistency::Ssp(s))
}

fn parse_policy(p: &str) -> PyResult<SchemePolicy> {
    match p {
        "hybrid" => Ok(SchemePolicy::Hybrid),
        "ps" => Ok(SchemePolicy::Ps),
        "sfb" => Ok(SchemePolicy::Sfb),
        o => Err(PyValueError::new_err(format!(
            "policy={o:?}: want 'hybrid' (HybComm), 'ps' or 'sfb'"
        ))),
    }
}

fn parse_transport(t: &str) -> PyResult<TransportKind> {
    match t {
        "auto" => Ok(TransportKind::Auto),
        "tcp" => Ok(TransportKind::Tcp),
        "portable" => Ok(TransportKind::Portable),
        "rdma" => Ok(TransportKind::Rdma),
        o => Err(PyValueError::new_err(format!(
            "transport={o:?}: want 'auto', 'tcp', 'portable' or 'rdma'"
        ))),
    }
}

pub(crate) fn seconds(s: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| PyValueError::new_err(format!("{what}={s}: want a positive number of seconds")))
}
