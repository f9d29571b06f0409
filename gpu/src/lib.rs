//! GPU memory and aggregation for Tidewire.
//!
//! Behind the `cuda` feature, [`cuda`] probes the driver and its GPUs at run
//! time (cudarc with dynamic loading; a typed error without a driver). Device
//! buffers, pinned host memory, dmabuf export and the aggregation kernels
//! arrive with the GPU issue. [`cpu`] holds the CPU path of aggregation, apply
//! and sufficient-factor reconstruction, and [`bench`] measures it against
//! the machine's memory bandwidth.

pub mod bench;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

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
