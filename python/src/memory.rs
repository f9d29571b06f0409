//! The caller's memory: where a host tensor's memory is, and the factor
//! matrices `push_factors` copies.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};
use tidewire::gpu::cpu::HostType;

/// Where a host tensor's memory is: (address, bytes, element type). Accepts a
/// `torch.Tensor` (CPU, contiguous; float32, float16, bfloat16 or float64) or
/// anything with NumPy's `__array_interface__` (`<f4`, `<f2` or `<f8`,
/// C-contiguous, writable).
pub(crate) fn host_memory(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(usize, usize, HostType)> {
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
