//! GPU memory and aggregation for Tidewire.
//!
//! Behind the `cuda` feature this crate will hold cudarc device buffers,
//! pinned host memory, dmabuf export and the aggregation kernels (the GPU
//! issue). Today it reports what the build and the machine offer, so
//! `tidewire doctor` can explain it, and [`cpu`] holds the CPU path of
//! aggregation, apply and sufficient-factor reconstruction.

pub mod bench;
pub mod cpu;

/// What `tidewire doctor` shows for CUDA.
#[derive(Debug, Clone)]
pub struct CudaReport {
    /// Whether CUDA can be used by this build on this machine.
    pub usable: bool,
    /// Why (or why not).
    pub detail: String,
}

/// Probes CUDA support without touching the driver when it cannot be used.
pub fn probe() -> CudaReport {
    if !cfg!(feature = "cuda") {
        return CudaReport {
            usable: false,
            detail: "built without the `cuda` feature: rebuild with `--features cuda` for GPU buffers and aggregation"
                .into(),
        };
    }
    let found = [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/lib64/libcuda.so.1",
        "/usr/local/nvidia/lib64/libcuda.so.1",
    ]
    .iter()
    .find(|p| std::path::Path::new(p).exists());
    CudaReport {
        usable: false,
        detail: match found {
            Some(p) => format!("driver library at {p}, but the CUDA backend is not in this version yet"),
            None => "no libcuda.so.1 found (no NVIDIA driver on this machine)".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_explains_itself() {
        let r = super::probe();
        assert!(!r.detail.is_empty());
        assert!(
            !r.usable,
            "no CUDA backend exists yet, so nothing may claim it is usable"
        );
    }
}
