//! One GPU: its context, a stream pool, device and pinned host memory,
//! dmabuf export, the NVRTC aggregation kernels and cuBLAS SGEMM.
//!
//! Every public operation is synchronous: it returns once the GPU has
//! finished, so host memory handed in may be reused at once and buffers may be
//! dropped. Inside an operation, work is spread over the stream pool where that
//! helps (arrival-order accumulation, pipelined uploads).

use std::collections::HashMap;
use std::ffi::c_int;
use std::marker::PhantomData;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{sys as blas_sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    result, sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::{self, CompileOptions, Ptx};

use super::driver::{self, driver_present, drv, CudaError, GpuInfo};
use crate::cpu::ApplyOp;

/// The kernels' source; see the file for the exactness argument.
pub const KERNELS_SRC: &str = include_str!("kernels.cu");

/// The most inputs one sum kernel takes (`MAX_INPUTS` in `kernels.cu`); more
/// are summed in rounds, still in input order.
pub const MAX_INPUTS: usize = 32;

const THREADS: u32 = 256;

/// The entry points of `kernels.cu`.
pub const KERNELS: [&str; 6] = [
    "tw_sum_f32",
    "tw_sum_bf16",
    "tw_sum_f16",
    "tw_atomic_add_f32",
    "tw_scale_f32",
    "tw_apply_f32",
];

/// Refuses `len` elements at `at` that do not fit in `total`.
fn check_range(what: &str, at: usize, len: usize, total: usize) -> Result<(), CudaError> {
    if at.checked_add(len).map_or(true, |e| e > total) {
        return Err(CudaError::Invalid(format!(
            "{what} of {len} elements at {at} does not fit a buffer of {total}"
        )));
    }
    Ok(())
}

/// How a [`Gpu`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuOptions {
    /// Device ordinal.
    pub ordinal: usize,
    /// Streams in the pool (at least 1).
    pub streams: usize,
    /// Deterministic mode: every sum in input order on one stream, compiled with
    /// `--fmad=false`, so results equal [`crate::cpu`] bitwise. Otherwise
    /// [`Gpu::accumulate`] adds contributions as they arrive on any pool stream
    /// with atomics, and multiply-adds may be fused.
    pub deterministic: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            ordinal: 0,
            streams: 4,
            deterministic: true,
        }
    }
}

/// An element type a sum kernel reads: f32, or bf16/f16 widened to f32.
pub trait GpuElement: crate::cpu::Element + DeviceRepr + ValidAsZeroBits {
    /// The kernel that sums this type.
    const KERNEL: &'static str;
    /// Elements per vector load (16 bytes of f32, 8 bytes of 16-bit values).
    const ALIGN: usize;
}

impl GpuElement for f32 {
    const KERNEL: &'static str = "tw_sum_f32";
    const ALIGN: usize = 16;
}

impl GpuElement for half::bf16 {
    const KERNEL: &'static str = "tw_sum_bf16";
    const ALIGN: usize = 8;
}

impl GpuElement for half::f16 {
    const KERNEL: &'static str = "tw_sum_f16";
    const ALIGN: usize = 8;
}

/// The kernels' input pointers, passed by value (`struct Inputs` in kernels.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct Inputs {
    p: [u64; MAX_INPUTS],
}

// SAFETY: `Inputs` is a plain `#[repr(C)]` array of u64, laid out as the
// kernel's `struct Inputs { u64 p[32]; }`.
unsafe impl DeviceRepr for Inputs {}

/// Device memory of `len` elements of `T`, owned by one [`Gpu`].
pub struct DeviceBuffer<T> {
    slice: CudaSlice<T>,
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("len", &self.slice.len())
            .field("ptr", &format_args!("{:#x}", self.ptr()))
            .finish()
    }
}

impl<T> DeviceBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }
    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }
    /// Bytes.
    pub fn bytes(&self) -> usize {
        self.slice.len() * std::mem::size_of::<T>()
    }
    /// The device address of element 0.
    pub fn ptr(&self) -> u64 {
        // Event tracking is off in a Gpu's context, so the guard records nothing.
        let (p, _guard) = self.slice.device_ptr(self.slice.stream());
        p
    }
    fn at(&self, i: usize) -> u64 {
        self.ptr() + (i * std::mem::size_of::<T>()) as u64
    }
}

/// A dmabuf exported from device memory (cuMemGetHandleForAddressRange), for
/// `RdmaTransport::reg_dmabuf(fd, offset, len, iova)`: the NIC then reads and
/// writes the GPU's memory directly (GPUDirect RDMA).
#[derive(Debug)]
pub struct DmabufExport {
    /// The dmabuf; closing it does not free the device memory.
    pub fd: OwnedFd,
    /// Byte offset of the buffer inside the exported range (the range starts on
    /// a 64 KiB GPU page).
    pub offset: u64,
    /// Bytes of the buffer.
    pub len: usize,
    /// The buffer's device address, the iova to register it at.
    pub iova: u64,
}

/// Page-locked host memory allocated by the driver: portable (every context
/// can copy from it at full speed) and cached, **not** write-combined, so the
/// CPU reads it at normal speed (cudarc's `alloc_pinned` is write-combined).
pub struct PinnedHost<T> {
    slice: PinnedHostSlice<T>,
}

impl<T> std::fmt::Debug for PinnedHost<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHost").field("len", &self.slice.len()).finish()
    }
}

impl<T: ValidAsZeroBits> PinnedHost<T> {
    /// The memory, for the CPU.
    pub fn as_slice(&self) -> &[T] {
        self.slice
            .as_slice()
            .expect("operations are synchronous; no copy is pending")
    }
    /// The memory, for the CPU.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        self.slice
            .as_mut_slice()
            .expect("operations are synchronous; no copy is pending")
    }
}

/// Existing host memory (e.g. a transport's registered region) page-locked
/// for the GPU with cuMemHostRegister, so copies from and to it run at full
/// speed without a bounce. Unregistered on drop.
#[derive(Debug)]
pub struct HostRegistration<'a> {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
    _mem: PhantomData<&'a mut [u8]>,
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` was registered by cuMemHostRegister in `Gpu::register_host`
        // and is unregistered exactly once; the borrow keeps the memory alive until now.
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr.cast()) };
    }
}

impl HostRegistration<'_> {
    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the registration is empty (never: zero bytes are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One GPU, ready to aggregate. See the module docs.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    streams: Vec<Arc<CudaStream>>,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: OnceLock<Result<CudaBlas, CudaError>>,
    info: GpuInfo,
    opts: GpuOptions,
    sms: u32,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("device", &self.info)
            .field("opts", &self.opts)
            .finish()
    }
}

/// PTX already compiled in this process, by (arch, fmad).
fn ptx_cache() -> &'static Mutex<HashMap<(String, bool), String>> {
    static CACHE: OnceLock<Mutex<HashMap<(String, bool), String>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Where compiled PTX is kept between runs: `$TIDEWIRE_PTX_CACHE`, else
/// `$XDG_CACHE_HOME/tidewire/ptx`, else `~/.cache/tidewire/ptx`.
pub fn ptx_cache_dir() -> Option<std::path::PathBuf> {
    if let Some(d) = std::env::var_os("TIDEWIRE_PTX_CACHE") {
        return Some(d.into());
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")))?;
    Some(base.join("tidewire").join("ptx"))
}

/// FNV-1a of the source and options: names the on-disk PTX.
fn ptx_key(arch: &str, fmad: bool) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in KERNELS_SRC.bytes().chain(arch.bytes()).chain([fmad as u8]) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("kernels-{arch}-fmad{}-{h:016x}.ptx", fmad as u8)
}

/// Compiles the kernels for `arch` (e.g. `compute_90`; see [`kernel_arch`] for
/// the one to ask for), once per process and once per machine: the PTX is
/// cached in memory and under [`ptx_cache_dir`].
pub fn compile_kernels(arch: &str, fmad: bool) -> Result<String, CudaError> {
    let key = (arch.to_string(), fmad);
    if let Some(p) = ptx_cache().lock().expect("ptx cache").get(&key) {
        return Ok(p.clone());
    }
    let file = ptx_cache_dir().map(|d| d.join(ptx_key(arch, fmad)));
    if let Some(p) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        ptx_cache().lock().expect("ptx cache").insert(key, p.clone());
        return Ok(p);
    }
    // SAFETY: only tries to load libnvrtc; no NVRTC function is called.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let opts = CompileOptions {
        fmad: Some(fmad),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++14".into()],
        name: Some("tidewire_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = nvrtc::compile_ptx_with_opts(KERNELS_SRC, opts)
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?
        .to_src();
    if let Some(f) = file {
        // A cache that cannot be written only costs a compile next time.
        let _ = f.parent().map(std::fs::create_dir_all);
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &f);
        }
    }
    ptx_cache().lock().expect("ptx cache").insert(key, ptx.clone());
    Ok(ptx)
}

/// The architecture to compile the kernels for, as NVRTC's
/// `--gpu-architecture` value (e.g. `compute_90`), given the device's compute
/// capability and the architectures the loaded NVRTC supports (as
/// `nvrtcGetSupportedArchs` lists them: 75, 80, ... 121).
///
/// With a device: its own architecture, or the highest supported one below it
/// (PTX for an older architecture runs on newer devices, not the reverse), so
/// an NVRTC older than the device still serves it. Without one (compiling
/// ahead of any device): the lowest supported, which every device NVRTC can
/// target runs. [`CudaError::Arch`] when the list is empty or the device is
/// below the lowest (e.g. a Volta, compute 7.0, with CUDA 13's NVRTC, whose
/// lowest is compute_75).
pub fn choose_arch(device_cc: Option<(i32, i32)>, supported: &[i32]) -> Result<String, CudaError> {
    let lowest = supported.iter().copied().filter(|&a| a > 0).min().ok_or_else(|| {
        CudaError::Arch(format!(
            "the loaded NVRTC lists no supported architecture (nvrtcGetSupportedArchs gave {supported:?})"
        ))
    })?;
    let Some((major, minor)) = device_cc else {
        return Ok(format!("compute_{lowest}"));
    };
    let device = major * 10 + minor;
    match supported.iter().copied().filter(|&a| a > 0 && a <= device).max() {
        Some(a) => Ok(format!("compute_{a}")),
        None => {
            let mut all: Vec<i32> = supported.iter().copied().filter(|&a| a > 0).collect();
            all.sort_unstable();
            Err(CudaError::Arch(format!(
                "the GPU's compute capability {major}.{minor} is below compute_{lowest}, the lowest architecture \
                 the loaded NVRTC supports ({all:?}); use the NVRTC of an older CUDA (CUDA 12's reaches down to \
                 compute_50) on LD_LIBRARY_PATH"
            )))
        }
    }
}

/// The architectures the loaded NVRTC can compile for
/// (`nvrtcGetSupportedArchs`, e.g. `[75, 80, ..., 121]` for CUDA 13.0).
pub fn nvrtc_supported_archs() -> Result<Vec<i32>, CudaError> {
    // SAFETY: only tries to load libnvrtc; no NVRTC function is called.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    type ArchFn = unsafe extern "C" fn(*mut c_int) -> nvrtc::sys::nvrtcResult;
    // cudarc panics on a missing symbol, and NVRTC before CUDA 11.2 has neither
    // function, so both are looked up first.
    for name in ["nvrtcGetNumSupportedArchs", "nvrtcGetSupportedArchs"] {
        // SAFETY: libnvrtc loads (checked above), so culib() returns it rather than
        // panicking; looking a symbol up calls nothing, and both functions have the
        // type `ArchFn` (`nvrtcResult f(int*)` in nvrtc.h). The symbol is dropped unused.
        if unsafe { nvrtc::sys::culib().get::<ArchFn>(name.as_bytes()) }.is_err() {
            return Err(CudaError::Arch(format!(
                "the loaded NVRTC has no {name} (it is older than CUDA 11.2)"
            )));
        }
    }
    let mut n: c_int = 0;
    // SAFETY: the function exists (checked above) and `n` is a valid out-pointer for one int.
    unsafe { nvrtc::sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| CudaError::Arch(format!("nvrtcGetNumSupportedArchs failed: {e}")))?;
    let mut archs: Vec<c_int> = vec![0; usize::try_from(n).unwrap_or(0)];
    if !archs.is_empty() {
        // SAFETY: the function exists (checked above), and `archs` holds the `n` ints
        // nvrtcGetNumSupportedArchs said it writes.
        unsafe { nvrtc::sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .map_err(|e| CudaError::Arch(format!("nvrtcGetSupportedArchs failed: {e}")))?;
    }
    Ok(archs)
}

/// The loaded NVRTC's version, (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    // SAFETY: only tries to load libnvrtc; no NVRTC function is called.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: libnvrtc loads (checked above) and has had nvrtcVersion since its first
    // release; both arguments are valid out-pointers for one int.
    unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Arch(format!("nvrtcVersion failed: {e}")))?;
    Ok((major, minor))
}

/// [`choose_arch`] with the loaded NVRTC's list: what [`Gpu::open`] compiles
/// for (with the device's compute capability), or, with `None`, the lowest
/// architecture the loaded NVRTC supports.
pub fn kernel_arch(device_cc: Option<(i32, i32)>) -> Result<String, CudaError> {
    choose_arch(device_cc, &nvrtc_supported_archs()?)
}

fn launch_cfg(n: u64, sms: u32) -> LaunchConfig {
    // Grid-stride loops: enough blocks to fill every SM several times over.
    let blocks = n.div_ceil(THREADS as u64).clamp(1, sms as u64 * 8) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<(), CudaError> {
    if got == want {
        Ok(())
    } else {
        Err(CudaError::Invalid(format!(
            "{what}: {got} elements where {want} are needed"
        )))
    }
}

impl Gpu {
    /// Opens GPU `opts.ordinal`: a context, the stream pool, and the kernels
    /// (compiled by NVRTC for this device's architecture, or taken from the cache).
    pub fn open(opts: GpuOptions) -> Result<Gpu, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let info = driver::probe()?
            .devices
            .into_iter()
            .find(|d| d.ordinal as usize == opts.ordinal)
            .ok_or(CudaError::NoDevice(opts.ordinal))?;
        let ctx = CudaContext::new(opts.ordinal).map_err(drv("cuCtxCreate"))?;
        // SAFETY: no CudaSlice exists yet in this context; every operation below
        // synchronizes its streams before it returns, which is the ordering the
        // event tracking would otherwise provide.
        unsafe { ctx.disable_event_tracking() };
        let streams = (0..opts.streams.max(1))
            .map(|_| ctx.new_stream().map_err(drv("cuStreamCreate")))
            .collect::<Result<Vec<_>, _>>()?;
        let (major, minor) = info.compute_capability;
        let arch = match kernel_arch(Some((major, minor))) {
            // Without NVRTC only PTX cached for the device's own architecture can
            // serve; compile_kernels says NoNvrtc when there is none.
            Err(CudaError::NoNvrtc) => format!("compute_{major}{minor}"),
            a => a?,
        };
        let ptx = compile_kernels(&arch, !opts.deterministic)?;
        let module = ctx.load_module(Ptx::from_src(ptx)).map_err(drv("cuModuleLoadData"))?;
        let mut funcs = HashMap::new();
        for name in KERNELS {
            funcs.insert(name, module.load_function(name).map_err(drv("cuModuleGetFunction"))?);
        }
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("cuDeviceGetAttribute"))?
            .max(1) as u32;
        Ok(Gpu {
            ctx,
            streams,
            funcs,
            blas: OnceLock::new(),
            info,
            opts,
            sms,
        })
    }

    /// The device.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// The options it was opened with.
    pub fn options(&self) -> GpuOptions {
        self.opts
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.streams[0]
    }

    fn sync_all(&self) -> Result<(), CudaError> {
        for s in &self.streams {
            s.synchronize().map_err(drv("cuStreamSynchronize"))?;
        }
        Ok(())
    }

    /// Device memory of `len` zeroed elements.
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<DeviceBuffer<T>, CudaError> {
        if len == 0 {
            return Err(CudaError::Invalid("a device buffer of 0 elements".into()));
        }
        let slice = self
            .stream()
            .alloc_zeros::<T>(len)
            .map_err(|e| CudaError::Alloc(len * std::mem::size_of::<T>(), e.to_string()))?;
        self.stream().synchronize().map_err(drv("cuStreamSynchronize"))?;
        Ok(DeviceBuffer { slice })
    }

    /// A device copy of `src`.
    pub fn upload<T: DeviceRepr + ValidAsZeroBits>(&self, src: &[T]) -> Result<DeviceBuffer<T>, CudaError> {
        let mut b = self.alloc::<T>(src.len())?;
        self.copy_in(&mut b, 0, src)?;
        Ok(b)
    }

    /// Copies `src` into `dst` from element `at`.
    pub fn copy_in<T: DeviceRepr>(&self, dst: &mut DeviceBuffer<T>, at: usize, src: &[T]) -> Result<(), CudaError> {
        check_range("copy in", at, src.len(), dst.len())?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the destination range was checked to lie inside `dst`; the stream is
        // synchronized before returning, so `src` outlives the copy.
        unsafe { result::memcpy_htod_async(dst.at(at), src, self.stream().cu_stream()) }
            .map_err(drv("cuMemcpyHtoDAsync"))?;
        self.stream().synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// Copies `dst.len()` elements of `src` from element `at` to the host.
    pub fn copy_out<T: DeviceRepr>(&self, src: &DeviceBuffer<T>, at: usize, dst: &mut [T]) -> Result<(), CudaError> {
        check_range("copy out", at, dst.len(), src.len())?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the source range was checked to lie inside `src`; the stream is
        // synchronized before returning, so `dst` outlives the copy.
        unsafe { result::memcpy_dtoh_async(dst, src.at(at), self.stream().cu_stream()) }
            .map_err(drv("cuMemcpyDtoHAsync"))?;
        self.stream().synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// Copies all of `src` into `dst` on the device.
    pub fn copy_device<T>(&self, dst: &mut DeviceBuffer<T>, src: &DeviceBuffer<T>) -> Result<(), CudaError> {
        self.copy_device_queued(dst, src)?;
        self.stream().synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// [`Gpu::copy_device`] without waiting: the caller synchronizes before
    /// either buffer is dropped or read.
    pub(crate) fn copy_device_queued<T>(
        &self,
        dst: &mut DeviceBuffer<T>,
        src: &DeviceBuffer<T>,
    ) -> Result<(), CudaError> {
        check_len("copy_device", src.len(), dst.len())?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: both buffers hold `src.bytes()` bytes (checked); the caller keeps them
        // alive until the stream is synchronized.
        unsafe { result::memcpy_dtod_async(dst.ptr(), src.ptr(), src.bytes(), self.stream().cu_stream()) }
            .map_err(drv("cuMemcpyDtoDAsync"))
    }

    /// Milliseconds per call of `f` over `reps` calls queued back to back on
    /// the first stream, timed with CUDA events (no host round trip per call).
    pub(crate) fn event_ms(&self, reps: usize, mut f: impl FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).map_err(drv("cuEventCreate"))?;
        let end = self.ctx.new_event(flags).map_err(drv("cuEventCreate"))?;
        start.record(self.stream()).map_err(drv("cuEventRecord"))?;
        for _ in 0..reps.max(1) {
            f()?;
        }
        end.record(self.stream()).map_err(drv("cuEventRecord"))?;
        let ms = start.elapsed_ms(&end).map_err(drv("cuEventElapsedTime"))?;
        Ok(ms as f64 / reps.max(1) as f64)
    }

    /// Portable, cached (not write-combined) page-locked host memory; see [`PinnedHost`].
    pub fn pinned_host<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<PinnedHost<T>, CudaError> {
        if len == 0 {
            return Err(CudaError::Invalid("pinned host memory of 0 elements".into()));
        }
        // SAFETY: the memory is zeroed below before anyone reads it.
        let mut slice = unsafe {
            self.ctx
                .alloc_pinned_with_flags::<T>(len, sys::CU_MEMHOSTALLOC_PORTABLE)
        }
        .map_err(|e| CudaError::Alloc(len * std::mem::size_of::<T>(), format!("cuMemHostAlloc: {e}")))?;
        let s = slice.as_mut_slice().map_err(drv("cuEventSynchronize"))?;
        // SAFETY: `T: ValidAsZeroBits`, so all-zero bytes are a valid value.
        unsafe { std::ptr::write_bytes(s.as_mut_ptr(), 0, s.len()) };
        Ok(PinnedHost { slice })
    }

    /// Page-locks `mem` for the GPU (cuMemHostRegister, portable) while the
    /// returned registration lives.
    pub fn register_host<'a>(&self, mem: &'a mut [u8]) -> Result<HostRegistration<'a>, CudaError> {
        if mem.is_empty() {
            return Err(CudaError::Invalid("cuMemHostRegister of 0 bytes".into()));
        }
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: `mem` is a live, exclusively borrowed range for 'a, and the
        // registration (which unregisters on drop) cannot outlive that borrow.
        unsafe { sys::cuMemHostRegister_v2(mem.as_mut_ptr().cast(), mem.len(), sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(|e| CudaError::Driver {
                op: "cuMemHostRegister",
                detail: format!(
                    "{e} ({} bytes; page-locked memory counts against `ulimit -l` for non-root users)",
                    mem.len()
                ),
            })?;
        Ok(HostRegistration {
            ptr: mem.as_mut_ptr(),
            len: mem.len(),
            ctx: self.ctx.clone(),
            _mem: PhantomData,
        })
    }

    /// Exports `buf` as a dmabuf for GPUDirect RDMA. Fails with
    /// [`CudaError::NoDmabuf`] when the device or driver cannot (see
    /// [`GpuInfo::dmabuf`]); callers then stage through pinned host memory.
    pub fn export_dmabuf<T>(&self, buf: &DeviceBuffer<T>) -> Result<DmabufExport, CudaError> {
        if !self.info.dmabuf {
            return Err(CudaError::NoDmabuf(format!(
                "GPU {} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0 (needs CUDA 11.7+, an open kernel module or a recent driver, and Linux 5.12+)",
                self.info.ordinal
            )));
        }
        const GPU_PAGE: u64 = 1 << 16;
        let ptr = buf.ptr();
        let base = ptr & !(GPU_PAGE - 1);
        let offset = ptr - base;
        let size = (offset + buf.bytes() as u64).div_ceil(GPU_PAGE) * GPU_PAGE;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let mut fd: i32 = -1;
        // SAFETY: `fd` is a valid out-pointer for an int; [base, base+size) covers the
        // allocation's GPU pages (allocations are 2 MiB-granular, so the rounded range
        // stays inside mapped device memory).
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast(),
                base,
                size as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .map_err(|e| CudaError::NoDmabuf(format!("cuMemGetHandleForAddressRange: {e}")))?;
        if fd < 0 {
            return Err(CudaError::NoDmabuf(format!(
                "cuMemGetHandleForAddressRange returned fd {fd}"
            )));
        }
        Ok(DmabufExport {
            // SAFETY: the driver just created `fd` for us; nothing else owns it.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            offset,
            len: buf.bytes(),
            iova: ptr,
        })
    }

    fn sum_launch<T: GpuElement>(
        &self,
        stream: &CudaStream,
        acc: u64,
        inputs: &[u64],
        n: usize,
        init: bool,
    ) -> Result<(), CudaError> {
        let mut p = Inputs { p: [0; MAX_INPUTS] };
        p.p[..inputs.len()].copy_from_slice(inputs);
        let vec = acc % 16 == 0 && inputs.iter().all(|x| x % T::ALIGN as u64 == 0);
        let (np, n64, init, vec) = (inputs.len() as i32, n as u64, init as i32, vec as i32);
        let mut b = stream.launch_builder(&self.funcs[T::KERNEL]);
        b.arg(&acc).arg(&p).arg(&np).arg(&n64).arg(&init).arg(&vec);
        // SAFETY: `acc` and every input point at `n` live elements of the types the
        // kernel reads (checked by the callers); the kernel's signature is
        // (float*, Inputs, int, u64, int, int).
        unsafe { b.launch(launch_cfg(n64, self.sms)) }.map_err(drv("cuLaunchKernel"))?;
        Ok(())
    }

    /// `acc[at..at+n] = (init ? 0 : acc[at..at+n]) + inputs[0] + inputs[1] + ...`,
    /// every element in input order, in f32 (bf16/f16 widened exactly), where n
    /// is the inputs' length. With `init`, `acc` takes the first input's values
    /// exactly (as a copy, so −0.0 stays −0.0). One kernel reads up to
    /// [`MAX_INPUTS`] inputs with vector loads when the addresses allow.
    /// Equal bitwise to [`crate::cpu::sum_into_as`].
    pub fn sum_into<T: GpuElement>(
        &self,
        acc: &mut DeviceBuffer<f32>,
        at: usize,
        inputs: &[&DeviceBuffer<T>],
        init: bool,
    ) -> Result<(), CudaError> {
        self.sum_into_queued(acc, at, inputs, init)?;
        self.stream().synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// [`Gpu::sum_into`]'s checks and launches, without the wait.
    pub(crate) fn sum_into_queued<T: GpuElement>(
        &self,
        acc: &mut DeviceBuffer<f32>,
        at: usize,
        inputs: &[&DeviceBuffer<T>],
        init: bool,
    ) -> Result<(), CudaError> {
        let Some(first) = inputs.first() else {
            return Err(CudaError::Invalid("sum_into: no inputs".into()));
        };
        let n = first.len();
        for (i, x) in inputs.iter().enumerate() {
            check_len(&format!("sum_into input {i}"), x.len(), n)?;
        }
        check_range("sum_into", at, n, acc.len())?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let ptrs: Vec<u64> = inputs.iter().map(|x| x.ptr()).collect();
        let mut init = init;
        for group in ptrs.chunks(MAX_INPUTS) {
            self.sum_launch::<T>(self.stream(), acc.at(at), group, n, init)?;
            init = false;
        }
        Ok(())
    }

    /// Adds one contribution `x` into `acc[at..]`. In deterministic mode this
    /// is [`Gpu::sum_into`] with one input, in call order; otherwise the
    /// contributions of one call are added concurrently on the pool's streams
    /// with atomics, in no fixed order.
    pub fn accumulate(
        &self,
        acc: &mut DeviceBuffer<f32>,
        at: usize,
        xs: &[&DeviceBuffer<f32>],
    ) -> Result<(), CudaError> {
        if self.opts.deterministic || xs.len() < 2 || self.streams.len() < 2 {
            return self.sum_into(acc, at, xs, false);
        }
        for x in xs {
            check_range("accumulate", at, x.len(), acc.len())?;
        }
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        for (i, x) in xs.iter().enumerate() {
            let s = &self.streams[i % self.streams.len()];
            let (a, p, n) = (acc.at(at), x.ptr(), x.len() as u64);
            let mut b = s.launch_builder(&self.funcs["tw_atomic_add_f32"]);
            b.arg(&a).arg(&p).arg(&n);
            // SAFETY: both ranges hold `n` f32s (checked above); the signature is (float*, const float*, u64).
            unsafe { b.launch(launch_cfg(n, self.sms)) }.map_err(drv("cuLaunchKernel"))?;
        }
        self.sync_all()
    }

    /// `x *= s`.
    pub fn scale(&self, x: &mut DeviceBuffer<f32>, s: f32) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let (p, n) = (x.ptr(), x.len() as u64);
        let mut b = self.stream().launch_builder(&self.funcs["tw_scale_f32"]);
        b.arg(&p).arg(&s).arg(&n);
        // SAFETY: `x` holds `n` f32s; the signature is (float*, float, u64).
        unsafe { b.launch(launch_cfg(n, self.sms)) }.map_err(drv("cuLaunchKernel"))?;
        self.stream().synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// [`crate::cpu::apply`] as one fused kernel: sum, mean, or SGD with
    /// momentum and weight decay on the mean of `p1` contributions. Bitwise
    /// equal to the CPU in deterministic mode.
    pub fn apply(
        &self,
        op: ApplyOp,
        p1: usize,
        acc: &DeviceBuffer<f32>,
        params: &mut DeviceBuffer<f32>,
        momentum: Option<&mut DeviceBuffer<f32>>,
    ) -> Result<(), CudaError> {
        check_len("apply params", params.len(), acc.len())?;
        let inv = 1.0f32 / p1.max(1) as f32;
        let (code, lr, mu, wd) = match op {
            ApplyOp::Sum => (0i32, 0.0f32, 0.0f32, 0.0f32),
            ApplyOp::Mean => (1, 0.0, 0.0, 0.0),
            ApplyOp::Sgd {
                lr,
                momentum: 0.0,
                weight_decay,
            } => (2, lr, 0.0, weight_decay),
            ApplyOp::Sgd {
                lr,
                momentum,
                weight_decay,
            } => (3, lr, momentum, weight_decay),
        };
        let v = match (code, momentum) {
            (3, Some(m)) => {
                check_len("apply momentum", m.len(), acc.len())?;
                m.ptr()
            }
            (3, None) => return Err(CudaError::Invalid("SGD with momentum needs a momentum buffer".into())),
            _ => 0u64,
        };
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let (a, w, n) = (acc.ptr(), params.ptr(), acc.len() as u64);
        let mut b = self.stream().launch_builder(&self.funcs["tw_apply_f32"]);
        b.arg(&code)
            .arg(&inv)
            .arg(&lr)
            .arg(&mu)
            .arg(&wd)
            .arg(&a)
            .arg(&w)
            .arg(&v)
            .arg(&n);
        // SAFETY: acc, params (and momentum for op 3) hold `n` f32s (checked); the
        // signature is (int, float, float, float, float, const float*, float*, float*, u64).
        unsafe { b.launch(launch_cfg(n, self.sms)) }.map_err(drv("cuLaunchKernel"))?;
        self.stream().synchronize().map_err(drv("cuStreamSynchronize"))
    }

    fn blas(&self) -> Result<&CudaBlas, CudaError> {
        self.blas
            .get_or_init(|| {
                // SAFETY: only tries to load libcublas; no cuBLAS function is called.
                if !unsafe { blas_sys::is_culib_present() } {
                    return Err(CudaError::NoCublas);
                }
                CudaBlas::new(self.stream().clone()).map_err(|e| CudaError::Driver {
                    op: "cublasCreate",
                    detail: format!("{e:?}"),
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Sufficient-factor reconstruction, Σ_p U_pᵀV_p, as one SGEMM over the
    /// concatenated factors: `u` is (P·K)×M and `v` (P·K)×N, row major (each
    /// worker's K rows one after another); `out` (M×N, row major) is
    /// overwritten. Not bitwise equal to the CPU's rank-order sum (cuBLAS
    /// chooses its own reduction order); equal to rounding.
    pub fn sf_sum(
        &self,
        u: &DeviceBuffer<f32>,
        v: &DeviceBuffer<f32>,
        pk: usize,
        m: usize,
        n: usize,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<(), CudaError> {
        check_len("sf_sum U", u.len(), pk * m)?;
        check_len("sf_sum V", v.len(), pk * n)?;
        check_len("sf_sum out", out.len(), m * n)?;
        let int = |x: usize, what: &str| {
            i32::try_from(x).map_err(|_| CudaError::Invalid(format!("sf_sum: {what} = {x} exceeds cuBLAS's int")))
        };
        // Row-major out = Uᵀ V is column-major outᵀ (N×M, ld N) = Vᵀ·U, where the
        // row-major V is column-major Vᵀ (N×PK, ld N) and U is column-major Uᵀ
        // (M×PK, ld M), transposed back.
        let cfg = GemmConfig {
            transa: blas_sys::cublasOperation_t::CUBLAS_OP_N,
            transb: blas_sys::cublasOperation_t::CUBLAS_OP_T,
            m: int(n, "N")?,
            n: int(m, "M")?,
            k: int(pk, "P·K")?,
            alpha: 1.0f32,
            lda: int(n, "N")?,
            ldb: int(m, "M")?,
            beta: 0.0f32,
            ldc: int(n, "N")?,
        };
        let blas = self.blas()?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the shapes were checked against the buffers' lengths above.
        unsafe { blas.gemm(cfg, &v.slice, &u.slice, &mut out.slice) }.map_err(|e| CudaError::Driver {
            op: "cublasSgemm",
            detail: format!("{e:?}"),
        })?;
        self.stream().synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// Wall time of `f` in milliseconds, including waiting for every stream.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<(), CudaError>) -> Result<f64, CudaError> {
        let t0 = std::time::Instant::now();
        f()?;
        self.sync_all()?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    }

    /// Copies pinned `src` to the device (at PCIe speed: no bounce buffer).
    pub fn copy_in_pinned(&self, dst: &mut DeviceBuffer<f32>, src: &PinnedHost<f32>) -> Result<(), CudaError> {
        self.copy_in(dst, 0, src.as_slice())
    }

    /// Device→host copy into pinned memory.
    pub fn copy_out_pinned(&self, src: &DeviceBuffer<f32>, dst: &mut PinnedHost<f32>) -> Result<(), CudaError> {
        self.copy_out(src, 0, dst.as_mut_slice())
    }
}
