//! The driver itself: whether libcuda loads, what it lists, and [`CudaError`],
//! the error of every CUDA call in this crate.

use cudarc::driver::{result, sys};
use serde::Serialize;

/// Why CUDA cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// libcuda.so could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda.so cannot be loaded (no NVIDIA driver on this machine, or it is not on the library path)")]
    NoDriver,
    /// libnvrtc.so could not be loaded: the kernels cannot be compiled.
    #[error("no NVRTC: libnvrtc.so cannot be loaded (install the CUDA toolkit's nvrtc, e.g. the cuda-nvrtc package or pip's nvidia-cuda-nvrtc-cu12, and put it on LD_LIBRARY_PATH; CUDA 13's pip nvidia-cuda-nvrtc ships only libnvrtc.so.13, which is looked for as libnvrtc.so: link libnvrtc.so to it)")]
    NoNvrtc,
    /// The loaded NVRTC offers no architecture the kernels can be compiled for
    /// (it lists none, or this device's is below its lowest).
    #[error("no architecture to compile the aggregation kernels for: {0}")]
    Arch(String),
    /// libcublas.so could not be loaded: no GPU SGEMM.
    #[error("no cuBLAS: libcublas.so cannot be loaded (install libcublas, e.g. pip's nvidia-cublas-cu12, and put it on LD_LIBRARY_PATH)")]
    NoCublas,
    /// No GPU with this ordinal.
    #[error("no GPU {0}: the driver lists fewer devices (CUDA_VISIBLE_DEVICES?)")]
    NoDevice(usize),
    /// NVRTC rejected the kernels.
    #[error("NVRTC could not compile the aggregation kernels: {0}")]
    Compile(String),
    /// Device or pinned memory could not be allocated.
    #[error("cannot allocate {0} bytes: {1}")]
    Alloc(usize, String),
    /// Device memory cannot be exported as a dmabuf.
    #[error("no dmabuf export: {0}")]
    NoDmabuf(String),
    /// A call's arguments do not fit together.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A driver call failed.
    #[error("{op} failed: {detail}")]
    Driver { op: &'static str, detail: String },
}

pub(crate) fn drv(op: &'static str) -> impl FnOnce(result::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        detail: e.to_string(),
    }
}

/// Whether libcuda can be loaded (checked before any driver call).
pub fn driver_present() -> bool {
    // SAFETY: only tries to load the library; no driver function is called.
    unsafe { sys::is_culib_present() }
}

/// One GPU as the driver describes it.
#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    pub ordinal: i32,
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    pub memory_bytes: usize,
    /// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED.
    pub gpudirect_rdma: bool,
    /// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: device memory can be exported as a dmabuf.
    pub dmabuf: bool,
}

/// The driver and its devices.
#[derive(Debug, Clone, Serialize)]
pub struct DriverInfo {
    /// As cuDriverGetVersion reports it, e.g. 12080 for 12.8.
    pub version: i32,
    pub devices: Vec<GpuInfo>,
}

impl DriverInfo {
    /// `major.minor` of the driver's CUDA version.
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version / 1000, (self.version % 1000) / 10)
    }
}

/// Probes the driver: its version, and every device's name, compute
/// capability, memory, and GPUDirect RDMA and dmabuf attributes.
pub fn probe() -> Result<DriverInfo, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    result::init().map_err(drv("cuInit"))?;
    let mut version = 0;
    // SAFETY: the library is loaded (checked above) and `version` is a valid out-pointer.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(drv("cuDriverGetVersion"))?;
    let count = result::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(drv("cuDeviceGet"))?;
        let name = result::device::get_name(dev).map_err(drv("cuDeviceGetName"))?;
        let attr = |a| {
            // SAFETY: `dev` came from cuDeviceGet above.
            unsafe { result::device::get_attribute(dev, a) }.map_err(drv("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute::*;
        let cc = (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let gdr = attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)? != 0;
        let dmabuf = attr(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? != 0;
        // SAFETY: `dev` came from cuDeviceGet above.
        let memory_bytes = unsafe { result::device::total_mem(dev) }.map_err(drv("cuDeviceTotalMem"))?;
        devices.push(GpuInfo {
            ordinal,
            name,
            compute_capability: cc,
            memory_bytes,
            gpudirect_rdma: gdr,
            dmabuf,
        });
    }
    Ok(DriverInfo { version, devices })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_says_why() {
        match probe() {
            Err(CudaError::NoDriver) => {
                assert!(!driver_present());
                assert!(CudaError::NoDriver.to_string().contains("libcuda"));
                use std::io::Write as _;
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED: GPU part of probe: no CUDA driver on this machine"
                );
            }
            Err(e) => panic!("driver present but unusable: {e}"),
            Ok(info) => {
                assert!(info.version >= 11000, "{info:?}");
                for d in &info.devices {
                    assert!(
                        !d.name.is_empty() && d.compute_capability.0 >= 3 && d.memory_bytes > 0,
                        "{d:?}"
                    );
                }
            }
        }
    }
}
