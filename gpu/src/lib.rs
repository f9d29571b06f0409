//! GPU memory and aggregation for Tidewire.
//!
//! - [`cpu`]: the CPU path of aggregation (f32, and bf16/f16 summed in f32),
//!   apply (fused SGD with momentum) and sufficient-factor reconstruction
//!   (GEMM through `matrixmultiply`).
//! - `cuda` (feature `cuda`): the driver probed at run time (cudarc with
//!   dynamic loading; a typed error without a driver), device buffers,
//!   portable non-write-combined pinned host memory, cuMemHostRegister, dmabuf
//!   export for GPUDirect RDMA, NVRTC-compiled aggregation kernels (cached),
//!   a stream pool, a deterministic mode that matches [`cpu`] bitwise, and
//!   cuBLAS SGEMM for sufficient factors.
//! - [`sched`]: Nexus's CPU/GPU choice per chunk; [`agg`]: the server's
//!   aggregator that follows it.
//! - [`bench`](mod@bench): `tidewire bench aggregate`, against the machine's memory
//!   bandwidth (and, on a GPU, its device-to-device copy).

pub mod agg;
pub mod bench;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod sched;
mod skip;

pub use skip::print_skip;

/// What `tidewire doctor` shows for CUDA.
#[derive(Debug, Clone)]
pub struct CudaReport {
    /// Whether CUDA can be used by this build on this machine.
    pub usable: bool,
    /// Why (or why not).
    pub detail: String,
}

/// The CUDA libraries besides the driver, each as (name, present, detail):
/// NVRTC compiles the aggregation kernels, cuBLAS runs SF reconstruction.
/// Empty without the `cuda` feature.
pub fn library_checks() -> Vec<(&'static str, bool, String)> {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: each call only tries to load its library; no function in it is called.
        let (nvrtc, cublas) = unsafe {
            (
                cudarc::nvrtc::sys::is_culib_present(),
                cudarc::cublas::sys::is_culib_present(),
            )
        };
        let dir = cuda::ptx_cache_dir().map_or("none".to_string(), |d| d.display().to_string());
        vec![
            (
                "nvrtc",
                nvrtc,
                if nvrtc {
                    format!("libnvrtc loads; kernels are compiled once and cached in {dir}")
                } else {
                    cuda::CudaError::NoNvrtc.to_string()
                },
            ),
            (
                "cublas",
                cublas,
                if cublas {
                    "libcublas loads: SGEMM for sufficient-factor reconstruction".to_string()
                } else {
                    cuda::CudaError::NoCublas.to_string()
                },
            ),
        ]
    }
    #[cfg(not(feature = "cuda"))]
    Vec::new()
}

/// Probes CUDA support without touching the driver when it cannot be used.
pub fn probe() -> CudaReport {
    #[cfg(feature = "cuda")]
    {
        match cuda::probe() {
            Ok(info) if info.devices.is_empty() => CudaReport {
                usable: false,
                detail: format!(
                    "driver CUDA {}, but no GPU is visible (CUDA_VISIBLE_DEVICES?)",
                    info.version_string()
                ),
            },
            Ok(info) => CudaReport {
                usable: true,
                detail: format!(
                    "driver CUDA {}; {}",
                    info.version_string(),
                    info.devices
                        .iter()
                        .map(|d| format!(
                            "GPU {} {} (sm_{}{}, {} MiB, GPUDirect RDMA {}, dmabuf {})",
                            d.ordinal,
                            d.name,
                            d.compute_capability.0,
                            d.compute_capability.1,
                            d.memory_bytes >> 20,
                            if d.gpudirect_rdma { "yes" } else { "no" },
                            if d.dmabuf { "yes" } else { "no" }
                        ))
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            },
            Err(e) => CudaReport {
                usable: false,
                detail: e.to_string(),
            },
        }
    }
    #[cfg(not(feature = "cuda"))]
    CudaReport {
        usable: false,
        detail: "built without the `cuda` feature: rebuild with `--features cuda` for GPU buffers and aggregation"
            .into(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_explains_itself() {
        let r = super::probe();
        assert!(!r.detail.is_empty());
        if cfg!(feature = "cuda") {
            // With the feature: a GPU is usable only when the driver lists one.
            assert!(
                r.usable || r.detail.contains("no CUDA driver") || r.detail.contains("no GPU"),
                "{r:?}"
            );
        } else {
            assert!(!r.usable && r.detail.contains("--features cuda"), "{r:?}");
        }
    }
}
