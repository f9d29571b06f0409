//! The CUDA driver, probed at run time through cudarc's dynamic loading.
//!
//! cudarc panics when it first calls into a missing libcuda, so every entry
//! point here checks [`driver_present`] first and answers
//! [`CudaError::NoDriver`] instead; NVRTC and cuBLAS are checked the same
//! way before their first use.
//!
//! [`Gpu`] is one device ready to aggregate: see [`gpu`].

mod driver;
pub mod gpu;
pub use driver::{driver_present, probe, CudaError, DriverInfo, GpuInfo};
pub use gpu::{
    compile_kernels, ptx_cache_dir, DeviceBuffer, DmabufExport, Gpu, GpuElement, GpuOptions, HostRegistration,
    PinnedHost, KERNELS, KERNELS_SRC, MAX_INPUTS,
};

#[cfg(test)]
mod nvrtc_tests {
    /// NVRTC needs no GPU and no driver: where libnvrtc is installed (CI
    /// installs pip's nvidia-cuda-nvrtc-cu12), the kernels are compiled for
    /// the architectures we target, in both modes.
    #[test]
    fn kernels_compile_with_nvrtc() {
        // SAFETY: only tries to load libnvrtc; no NVRTC function is called.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            crate::skip::print_skip("kernels_compile_with_nvrtc", &super::CudaError::NoNvrtc.to_string());
            return;
        }
        let dir = std::env::temp_dir().join(format!("tw-ptx-{}", std::process::id()));
        std::env::set_var("TIDEWIRE_PTX_CACHE", &dir);
        for arch in ["compute_70", "compute_80", "compute_90"] {
            for fmad in [false, true] {
                let ptx = super::compile_kernels(arch, fmad).unwrap_or_else(|e| panic!("{arch}: {e}"));
                for k in super::gpu::KERNELS {
                    assert!(ptx.contains(&format!(".entry {k}(")), "{arch}: no {k}");
                }
                // Deterministic mode: no fused multiply-add anywhere.
                if !fmad {
                    assert!(!ptx.contains("fma.rn.f32"), "{arch}: fma with --fmad=false");
                }
                // Vector loads are there.
                assert!(ptx.contains("ld.global.v4.f32"), "{arch}: no float4 loads");
                // Cached on disk for the next process.
                assert!(std::fs::read_dir(&dir).unwrap().count() >= 1);
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
