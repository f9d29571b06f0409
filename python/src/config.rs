//! The constructor's arguments, parsed: the layer table's kinds, `apply`,
//! `consistency`, `policy`, `transport`, the timeouts and `comm`.

use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use tidewire::engine::book::LayerKind;
use tidewire::engine::freq::{CommConfig, CommMode, FreqConfig};
use tidewire::engine::{ApplyOp, Consistency, SchemePolicy};
use tidewire::TransportKind;

/// A layer kind, with `:sparse` after it for the sparse-push hint
/// (`"other:sparse"`: an `nn.Embedding(sparse=True)`).
pub(crate) fn parse_kind(kind: &str, name: &str) -> PyResult<(LayerKind, bool)> {
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
pub(crate) fn parse_apply(obj: Option<&Bound<'_, PyAny>>) -> PyResult<ApplyOp> {
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
pub(crate) fn parse_consistency(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Consistency> {
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

pub(crate) fn parse_policy(p: &str) -> PyResult<SchemePolicy> {
    match p {
        "hybrid" => Ok(SchemePolicy::Hybrid),
        "ps" => Ok(SchemePolicy::Ps),
        "sfb" => Ok(SchemePolicy::Sfb),
        o => Err(PyValueError::new_err(format!(
            "policy={o:?}: want 'hybrid' (HybComm), 'ps' or 'sfb'"
        ))),
    }
}

pub(crate) fn parse_transport(t: &str) -> PyResult<TransportKind> {
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

/// `(mode, t, t_max, period, tolerance, revert_at_step)` as a [`CommConfig`].
pub(crate) fn parse_comm(c: (String, u32, u32, u32, f64, Option<u64>)) -> PyResult<CommConfig> {
    let (mode, t_initial, t_max, period, tolerance, revert_at_step) = c;
    let mode = CommMode::parse(&mode)
        .ok_or_else(|| PyValueError::new_err(format!("comm mode {mode:?}: want 'accumulate' or 'average'")))?;
    let freq = FreqConfig {
        t_initial,
        t_max,
        period,
        tolerance,
        revert_at_step,
    };
    freq.validate().map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(CommConfig { mode, freq })
}
