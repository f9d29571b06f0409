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
    choose_arch, compile_kernels, kernel_arch, nvrtc_supported_archs, nvrtc_version, ptx_cache_dir, DeviceBuffer,
    DmabufExport, Gpu, GpuElement, GpuOptions, HostRegistration, PinnedHost, KERNELS, KERNELS_SRC, MAX_INPUTS,
};

#[cfg(test)]
mod nvrtc_tests {
    /// NVRTC needs no GPU and no driver: where libnvrtc is installed (CI
    /// installs pip's CUDA 12 and CUDA 13 NVRTC in turn), the kernels are
    /// compiled, in both modes, for the lowest architecture the loaded NVRTC
    /// supports (what a build ahead of any device gets) and for what a compute
    /// 8.0 and a 9.0 device would get from it.
    #[test]
    fn kernels_compile_with_nvrtc() {
        // SAFETY: only tries to load libnvrtc; no NVRTC function is called.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            crate::skip::print_skip("kernels_compile_with_nvrtc", &super::CudaError::NoNvrtc.to_string());
            return;
        }
        let (major, minor) = super::nvrtc_version().unwrap_or_else(|e| panic!("{e}"));
        let archs = super::nvrtc_supported_archs().unwrap_or_else(|e| panic!("{e}"));
        assert!(!archs.is_empty() && archs.iter().all(|&a| a >= 30), "{archs:?}");
        let lowest = super::kernel_arch(None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(lowest, format!("compute_{}", archs.iter().min().unwrap()));
        let mut targets = vec![lowest];
        for cc in [(8, 0), (9, 0)] {
            let a = super::choose_arch(Some(cc), &archs).unwrap_or_else(|e| panic!("{cc:?}: {e}"));
            if !targets.contains(&a) {
                targets.push(a);
            }
        }
        // The CI tier checks this line names the NVRTC it installed.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "kernels_compile_with_nvrtc: NVRTC {major}.{minor}, supported {archs:?}, compiling for {targets:?}"
        );
        let dir = std::env::temp_dir().join(format!("tw-ptx-{}", std::process::id()));
        std::env::set_var("TIDEWIRE_PTX_CACHE", &dir);
        for arch in &targets {
            for fmad in [false, true] {
                let ptx = super::compile_kernels(arch, fmad).unwrap_or_else(|e| panic!("{arch}: {e}"));
                assert!(
                    ptx.contains(&format!(".target sm_{}", &arch["compute_".len()..])),
                    "{arch}: wrong .target"
                );
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

#[cfg(test)]
mod arch_tests {
    use super::{choose_arch, CudaError};

    /// nvrtcGetSupportedArchs of CUDA 12.8's and 13.0's NVRTC (pip wheels).
    const CUDA12: &[i32] = &[50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 120];
    const CUDA13: &[i32] = &[75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];

    fn arch(cc: Option<(i32, i32)>, supported: &[i32]) -> String {
        choose_arch(cc, supported).unwrap_or_else(|e| panic!("{cc:?} {supported:?}: {e}"))
    }

    #[test]
    fn without_a_device_the_lowest_supported() {
        assert_eq!(arch(None, CUDA12), "compute_50");
        assert_eq!(arch(None, CUDA13), "compute_75");
        // Order does not matter; nonsense entries are ignored.
        assert_eq!(arch(None, &[90, 80, 75]), "compute_75");
        assert_eq!(arch(None, &[0, -1, 86]), "compute_86");
    }

    #[test]
    fn a_device_gets_its_own_arch_when_listed() {
        // The H200 of the issue with CUDA 13's NVRTC, and an A100 and an H100 with either.
        for list in [CUDA12, CUDA13] {
            assert_eq!(arch(Some((8, 0)), list), "compute_80");
            assert_eq!(arch(Some((8, 6)), list), "compute_86");
            assert_eq!(arch(Some((9, 0)), list), "compute_90");
        }
        assert_eq!(arch(Some((7, 0)), CUDA12), "compute_70");
        assert_eq!(arch(Some((12, 1)), CUDA13), "compute_121");
    }

    #[test]
    fn a_device_between_or_above_the_list_gets_the_highest_below_it() {
        // compute 8.8 is not in CUDA 12's list: 8.7 is the highest below.
        assert_eq!(arch(Some((8, 8)), CUDA12), "compute_87");
        // Newer than this NVRTC knows: its newest, which the device JIT-compiles.
        assert_eq!(arch(Some((12, 1)), CUDA12), "compute_120");
        assert_eq!(arch(Some((13, 0)), CUDA13), "compute_121");
        assert_eq!(arch(Some((9, 0)), &[90, 75, 80]), "compute_90");
        assert_eq!(arch(Some((8, 9)), &[90, 75, 80]), "compute_80");
    }

    #[test]
    fn below_the_lowest_or_an_empty_list_is_a_typed_error() {
        // A Volta (7.0) with CUDA 13's NVRTC: PTX for compute_75 would not load on it.
        match choose_arch(Some((7, 0)), CUDA13) {
            Err(CudaError::Arch(why)) => assert!(why.contains("7.0") && why.contains("compute_75"), "{why}"),
            other => panic!("{other:?}"),
        }
        for cc in [None, Some((9, 0))] {
            for list in [&[][..], &[0, -5][..]] {
                match choose_arch(cc, list) {
                    Err(e @ CudaError::Arch(_)) => {
                        assert!(e.to_string().contains("lists no supported architecture"), "{e}")
                    }
                    other => panic!("{cc:?} {list:?}: {other:?}"),
                }
            }
        }
    }
}
