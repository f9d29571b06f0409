//! The caller's memory: the parameter and gradient tensors a session registers
//! in place ([`Memory`]), and the factor matrices `push_factors` copies.

use std::any::Any;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};
use tidewire::gpu::cpu::HostType;
use tidewire::transport::PinnedBuffer;

use crate::tw_err;

/// Where a host tensor's memory is: (address, bytes, element type). Accepts a
/// `torch.Tensor` (CPU, contiguous; float32, float16, bfloat16 or float64) or
/// anything with NumPy's `__array_interface__` (`<f4`, `<f2` or `<f8`,
/// C-contiguous, writable).
fn host_memory(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(usize, usize, HostType)> {
    let (ptr, nbytes, t) = if obj.hasattr("data_ptr")? {
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        if device != "cpu" {
            return Err(PyValueError::new_err(format!(
                "{what}: a {device} tensor; a session registers host memory (stage through a CPU tensor)"
            )));
        }
        let dtype = obj.getattr("dtype")?.str()?.to_string();
        let t = match dtype.as_str() {
            "torch.float32" => HostType::F32,
            "torch.float16" => HostType::F16,
            "torch.bfloat16" => HostType::Bf16,
            "torch.float64" => HostType::F64,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{what}: dtype {dtype}, want torch.float32, float16, bfloat16 or float64"
                )))
            }
        };
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(PyValueError::new_err(format!("{what}: the tensor is not contiguous")));
        }
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        let nbytes: usize = obj.getattr("nbytes")?.extract()?;
        (ptr, nbytes, t)
    } else if obj.hasattr("__array_interface__")? {
        let ai = obj.getattr("__array_interface__")?;
        let ai = ai
            .cast::<PyDict>()
            .map_err(|_| PyTypeError::new_err(format!("{what}: __array_interface__ is not a dict")))?;
        let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
            ai.get_item(k)?
                .ok_or_else(|| PyTypeError::new_err(format!("{what}: __array_interface__ has no {k:?}")))
        };
        let typestr: String = get("typestr")?.extract()?;
        let t = match typestr.as_str() {
            "<f4" => HostType::F32,
            "<f2" => HostType::F16,
            "<f8" => HostType::F64,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{what}: array type {typestr:?}, want float32 ('<f4'), float16 ('<f2') or float64 ('<f8')"
                )))
            }
        };
        if ai.get_item("strides")?.is_some_and(|s| !s.is_none()) {
            return Err(PyValueError::new_err(format!("{what}: the array is not C-contiguous")));
        }
        let (ptr, readonly): (usize, bool) = get("data")?.extract()?;
        if readonly {
            return Err(PyValueError::new_err(format!("{what}: the array is read-only")));
        }
        let nbytes: usize = obj.getattr("nbytes")?.extract()?;
        (ptr, nbytes, t)
    } else {
        return Err(PyTypeError::new_err(format!(
            "{what}: want a CPU floating-point torch.Tensor or NumPy array, got {}",
            obj.get_type().name()?
        )));
    };
    if ptr == 0 || ptr % t.size() != 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: address {ptr:#x} is null or not aligned for {}",
            t.name()
        )));
    }
    Ok((ptr, nbytes, t))
}

/// A session's parameter and gradient tensors, checked against its layer
/// table: `bytes` bytes from `params_at` in `params` and from `grads_at` in
/// `grads`, apart, of one element type.
pub(crate) struct Memory<'py> {
    params: Bound<'py, PyAny>,
    grads: Bound<'py, PyAny>,
    params_at: usize,
    grads_at: usize,
    bytes: usize,
    pub dtype: HostType,
}

impl<'py> Memory<'py> {
    /// Checks `params` and `grads` against a table of `sizes` values per layer.
    pub(crate) fn check(params: Bound<'py, PyAny>, grads: Bound<'py, PyAny>, sizes: &[usize]) -> PyResult<Self> {
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
        Ok(Memory {
            params,
            grads,
            params_at: pptr,
            grads_at: gptr,
            bytes: total,
            dtype: t,
        })
    }

    /// The two ranges as buffers to register in place, each owning a
    /// reference to its tensor. float32 memory is registered as it is;
    /// float16, bfloat16 and float64 are staged through float32
    /// (`PushPull::build`: widened at push, narrowed at pull).
    pub(crate) fn pin(&self) -> PyResult<(PinnedBuffer, PinnedBuffer)> {
        let (p_owner, g_owner): (Box<dyn Any + Send + Sync>, Box<dyn Any + Send + Sync>) = (
            Box::new(self.params.clone().unbind()),
            Box::new(self.grads.clone().unbind()),
        );
        // params_at..params_at+bytes lies in the storage of the tensor `params`
        // (address and size read from the tensor itself by `check`, and checked
        // to cover the layer table). The buffer owns a reference to that tensor,
        // dropped with the buffer and its last region (even a region the
        // transport leaks keeps it), so the storage stays allocated while any of
        // them lives, unless Python code re-points or resizes the tensor, which
        // the Session's contract forbids, as it forbids touching a layer's part
        // between its push and its pull.
        // SAFETY: the storage outlives the buffer (it holds the tensor), as above.
        let p = unsafe { PinnedBuffer::foreign(self.params_at as *mut u8, self.bytes, Some(p_owner)) };
        let p = p.map_err(|e| tw_err(e.into()))?;
        // SAFETY: as for `params` just above, for the tensor `grads`, which this buffer owns a reference to.
        let g = unsafe { PinnedBuffer::foreign(self.grads_at as *mut u8, self.bytes, Some(g_owner)) };
        let g = g.map_err(|e| tw_err(e.into()))?;
        Ok((p, g))
    }

    /// The parameter and gradient tensors.
    pub(crate) fn into_tensors(self) -> [Py<PyAny>; 2] {
        [self.params.unbind(), self.grads.unbind()]
    }
}

/// The bytes of a factor matrix: `bytes`, `bytearray`, anything with
/// `tobytes()` (a NumPy array), or a torch tensor (copied through NumPy).
pub(crate) fn factor_values(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<f32>> {
    let bytes: Vec<u8> = if let Ok(b) = obj.cast::<PyBytes>() {
        b.as_bytes().to_vec()
    } else if let Ok(b) = obj.cast::<PyByteArray>() {
        b.to_vec()
    } else if obj.hasattr("tobytes")? {
        obj.call_method0("tobytes")?.cast::<PyBytes>()?.as_bytes().to_vec()
    } else if obj.hasattr("data_ptr")? {
        let dtype = obj.getattr("dtype")?.str()?.to_string();
        if dtype != "torch.float32" {
            return Err(PyValueError::new_err(format!(
                "{what}: dtype {dtype}, want torch.float32"
            )));
        }
        let arr = obj
            .call_method0("detach")?
            .call_method0("cpu")?
            .call_method0("contiguous")?
            .call_method0("numpy")?;
        arr.call_method0("tobytes")?.cast::<PyBytes>()?.as_bytes().to_vec()
    } else {
        return Err(PyTypeError::new_err(format!(
            "{what}: want float32 bytes, a NumPy array or a torch tensor, got {}",
            obj.get_type().name()?
        )));
    };
    if bytes.len() % 4 != 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: {} bytes is not a whole number of float32 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}
