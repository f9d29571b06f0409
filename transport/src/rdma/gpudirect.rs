//! Device memory for RDMA: GPUDirect through dmabuf where the NIC can, and a
//! staging path through registered host memory where it cannot.
//!
//! [`RdmaTransport::register_device`] takes anything that implements
//! [`DeviceMemory`] (a CUDA buffer exported with cuMemGetHandleForAddressRange,
//! or [`VgemBuffer`], the kernel's virtual GEM driver, which exports real
//! dmabufs on machines without a GPU). It checks the dmabuf's arguments, then
//! registers it with `ibv_reg_dmabuf_mr`. When the device has no dmabuf
//! support (soft-RoCE/rxe, older kernels and libibverbs), it registers a host
//! staging region instead and says so in [`DeviceRegistration::path`]: peers
//! write into the staging region, and [`DeviceRegistration::land`] copies what
//! arrived to the device; outgoing data is copied out with
//! [`DeviceRegistration::stage`] and written from
//! [`DeviceRegistration::staging_slice`]. [`DeviceRegistration::plan`] splits a
//! transfer into chunks over two halves of the staging region, so that one
//! chunk is copied while the previous one is on the wire.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::{DmabufRegion, RdmaTransport};
use crate::{Access, Error, PinnedBuffer, Region, RemoteRegion, Result, Slice, Transport};

/// A dmabuf view of device memory: the fd, where the memory starts in it,
/// and the address to register it at.
#[derive(Debug, Clone, Copy)]
pub struct DmabufHandle<'a> {
    /// The dmabuf.
    pub fd: BorrowedFd<'a>,
    /// Byte offset of the memory inside the dmabuf.
    pub offset: u64,
    /// The iova peers address it by (must agree with `offset` modulo the page size).
    pub iova: u64,
}

/// Memory on a device that can be exported as a dmabuf and copied to and
/// from the host.
pub trait DeviceMemory {
    /// Bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The dmabuf, or why there is none (typically [`Error::DeviceMemory`]; any
    /// error makes [`RdmaTransport::register_device`] stage through host memory).
    fn dmabuf(&self) -> Result<DmabufHandle<'_>>;
    /// Copies `dst.len()` bytes from `offset` to the host (failures: typically
    /// [`Error::DeviceMemory`] with op `"copy to host"`).
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` to the device at `offset` (failures: typically
    /// [`Error::DeviceMemory`] with op `"copy from host"`).
    fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<()>;
}

/// How device memory is reachable by peers.
#[derive(Debug)]
pub enum DevicePath {
    /// GPUDirect RDMA: the NIC reads and writes the device memory itself.
    Direct(DmabufRegion),
    /// Through a registered host region, with a copy each way.
    Staged {
        /// The staging region.
        region: Region,
        /// Why the direct path could not be used.
        reason: String,
    },
}

/// Device memory registered for RDMA; see the module docs.
#[derive(Debug)]
pub struct DeviceRegistration {
    path: DevicePath,
    len: usize,
}

/// One chunk of a staged transfer: `len` bytes at `device_offset`, through
/// the staging region at `staging_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageChunk {
    /// Offset in the device memory.
    pub device_offset: usize,
    /// Offset in the staging region (one of its two halves).
    pub staging_offset: usize,
    /// Bytes.
    pub len: usize,
}

fn bounds(what: &str, off: usize, len: usize, total: usize) -> Result<()> {
    if len == 0 || off.checked_add(len).map_or(true, |e| e > total) {
        return Err(Error::InvalidArgument {
            op: "device memory",
            reason: format!("{what}: {len} bytes at {off} do not fit in {total}"),
        });
    }
    Ok(())
}

impl DeviceRegistration {
    /// The path in use.
    pub fn path(&self) -> &DevicePath {
        &self.path
    }

    /// Whether the NIC reaches the device memory directly.
    pub fn is_direct(&self) -> bool {
        matches!(self.path, DevicePath::Direct(_))
    }

    /// One line for logs: which path, and why.
    pub fn describe(&self) -> String {
        match &self.path {
            DevicePath::Direct(_) => format!("GPUDirect RDMA through dmabuf ({} bytes)", self.len),
            DevicePath::Staged { region, reason } => format!(
                "staging through {} KiB of registered host memory (a copy each way): {reason}",
                region.len() >> 10
            ),
        }
    }

    /// What peers write into: the device memory itself, or the staging region.
    pub fn remote(&self) -> RemoteRegion {
        match &self.path {
            DevicePath::Direct(d) => d.remote(),
            DevicePath::Staged { region, .. } => region.remote(),
        }
    }

    /// Splits `len` bytes at `device_offset` into chunks that alternate
    /// between the staging region's two halves (the whole region when the
    /// path is direct: one chunk).
    pub fn plan(&self, device_offset: usize, len: usize) -> Result<Vec<StageChunk>> {
        bounds("plan", device_offset, len, self.len)?;
        let half = match &self.path {
            DevicePath::Direct(_) => len,
            DevicePath::Staged { region, .. } => region.len() / 2,
        };
        Ok((0..len.div_ceil(half))
            .map(|i| StageChunk {
                device_offset: device_offset + i * half,
                staging_offset: (i % 2) * half,
                len: half.min(len - i * half),
            })
            .collect())
    }

    fn staging(&self) -> Result<&Region> {
        match &self.path {
            DevicePath::Staged { region, .. } => Ok(region),
            DevicePath::Direct(_) => Err(Error::InvalidArgument {
                op: "staging",
                reason: "the memory is registered directly (GPUDirect); there is no staging region".into(),
            }),
        }
    }

    /// Copies a chunk of the device memory into the staging region.
    pub fn stage(&self, mem: &dyn DeviceMemory, c: StageChunk) -> Result<()> {
        let region = self.staging()?;
        bounds("stage (device)", c.device_offset, c.len, mem.len())?;
        let mut lease = region.lease(c.staging_offset, c.len)?;
        mem.copy_to_host(c.device_offset, lease.as_bytes_mut())
    }

    /// The staging slice a chunk is written from.
    pub fn staging_slice(&self, c: StageChunk) -> Result<Slice> {
        self.staging()?.slice(c.staging_offset, c.len)
    }

    /// Copies a chunk that a peer wrote into the staging region to the device.
    pub fn land(&self, mem: &mut dyn DeviceMemory, c: StageChunk) -> Result<()> {
        let region = self.staging()?;
        bounds("land (device)", c.device_offset, c.len, mem.len())?;
        let lease = region.lease(c.staging_offset, c.len)?;
        mem.copy_from_host(c.device_offset, lease.as_bytes())
    }
}

impl RdmaTransport {
    /// Registers device memory for RDMA: directly through its dmabuf when the
    /// device supports it, otherwise through `staging_bytes` of registered
    /// host memory, with the reason in [`DeviceRegistration::describe`] (also
    /// logged as a warning). A dmabuf whose arguments are wrong is refused
    /// before any verbs call; a memory that cannot export one is staged.
    pub fn register_device(&mut self, mem: &dyn DeviceMemory, staging_bytes: usize) -> Result<DeviceRegistration> {
        let len = mem.len();
        if len == 0 {
            return Err(Error::InvalidArgument {
                op: "register_device",
                reason: "device memory of 0 bytes".into(),
            });
        }
        if staging_bytes < 2 * 4096 {
            return Err(Error::InvalidArgument {
                op: "register_device",
                reason: format!("staging of {staging_bytes} bytes: need at least two 4 KiB halves"),
            });
        }
        let reason = match mem.dmabuf() {
            Ok(h) => {
                super::validate_dmabuf_args(h.fd.as_raw_fd(), h.offset, len, h.iova)?;
                match self.reg_dmabuf(h.fd.as_raw_fd(), h.offset, len, h.iova) {
                    Ok(r) => {
                        return Ok(DeviceRegistration {
                            path: DevicePath::Direct(r),
                            len,
                        })
                    }
                    Err(e @ Error::DmabufUnsupported { .. }) => e.to_string(),
                    Err(e) => return Err(e),
                }
            }
            Err(e) => format!("the memory exports no dmabuf: {e}"),
        };
        let region = self.register(PinnedBuffer::new(staging_bytes)?, Access::REMOTE_WRITE)?;
        let reg = DeviceRegistration {
            path: DevicePath::Staged { region, reason },
            len,
        };
        tracing::warn!("device memory: {}", reg.describe());
        Ok(reg)
    }
}

// ---- vgem: a dmabuf exporter without a GPU ---------------------------------

/// `struct drm_mode_create_dumb`.
#[repr(C)]
#[derive(Default)]
struct CreateDumb {
    height: u32,
    width: u32,
    bpp: u32,
    flags: u32,
    handle: u32,
    pitch: u32,
    size: u64,
}

/// `struct drm_prime_handle`.
#[repr(C)]
#[derive(Default)]
struct PrimeHandle {
    handle: u32,
    flags: u32,
    fd: i32,
}

const fn iowr(nr: u64, size: usize) -> u64 {
    (3 << 30) | ((size as u64) << 16) | ((b'd' as u64) << 8) | nr
}
const DRM_IOCTL_MODE_CREATE_DUMB: u64 = iowr(0xb2, std::mem::size_of::<CreateDumb>());
const DRM_IOCTL_PRIME_HANDLE_TO_FD: u64 = iowr(0x2d, std::mem::size_of::<PrimeHandle>());

/// A buffer from the kernel's virtual GEM driver (`modprobe vgem`), exported
/// as a real dmabuf and mapped for host copies: device memory for testing
/// the dmabuf and staging paths where there is no GPU.
#[derive(Debug)]
pub struct VgemBuffer {
    dmabuf: OwnedFd,
    map: *mut u8,
    len: usize,
    _card: OwnedFd,
}

// SAFETY: the mapping is owned by this value and only touched through &self/&mut self.
unsafe impl Send for VgemBuffer {}

impl Drop for VgemBuffer {
    fn drop(&mut self) {
        // SAFETY: `map` is the mapping of `len` bytes made in `new`, unmapped once.
        unsafe { libc::munmap(self.map.cast(), self.len) };
    }
}

/// A vgem buffer could not be made ([`Error::DeviceMemory`], op `"vgem buffer"`):
/// `reason` says why, and the OS error is the source where there is one.
fn vgem_failed(reason: String, source: Option<std::io::Error>) -> Error {
    Error::DeviceMemory {
        op: "vgem buffer",
        reason,
        source: source.map(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>),
    }
}

fn vgem_card() -> Result<std::path::PathBuf> {
    let dir = std::fs::read_dir("/sys/class/drm")
        .map_err(|e| vgem_failed(format!("/sys/class/drm: {e} (no DRM)"), Some(e)))?;
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("card") || name.contains('-') {
            continue;
        }
        // vgem's platform device has no bound driver: match the device's own name too.
        let is_vgem = |link: &str| {
            std::fs::read_link(e.path().join(link))
                .ok()
                .and_then(|d| d.file_name().map(|n| n == "vgem"))
                .unwrap_or(false)
        };
        if is_vgem("device") || is_vgem("device/driver") {
            return Ok(std::path::Path::new("/dev/dri").join(name));
        }
    }
    Err(vgem_failed(
        "no vgem device: load it with `modprobe vgem` (CONFIG_DRM_VGEM)".into(),
        None,
    ))
}

impl VgemBuffer {
    /// A buffer of at least `len` bytes (rounded up to whole pages). Fails with
    /// [`Error::DeviceMemory`] (op `"vgem buffer"`) saying why, e.g. when the
    /// vgem module is not loaded.
    pub fn new(len: usize) -> Result<VgemBuffer> {
        Self::create(len)
    }

    fn create(len: usize) -> Result<VgemBuffer> {
        if len == 0 {
            return Err(vgem_failed("a vgem buffer of 0 bytes".into(), None));
        }
        let path = vgem_card()?;
        let card = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| vgem_failed(format!("{}: {e}", path.display()), Some(e)))?;
        let card = OwnedFd::from(card);
        let page = 4096usize;
        let rows = len.div_ceil(page);
        let mut c = CreateDumb {
            height: rows as u32,
            width: (page / 4) as u32,
            bpp: 32,
            ..Default::default()
        };
        // SAFETY: DRM_IOCTL_MODE_CREATE_DUMB reads and writes one `struct drm_mode_create_dumb`.
        if unsafe { libc::ioctl(card.as_raw_fd(), DRM_IOCTL_MODE_CREATE_DUMB as _, &mut c) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(vgem_failed(format!("vgem create: {e}"), Some(e)));
        }
        let mut p = PrimeHandle {
            handle: c.handle,
            flags: (libc::O_CLOEXEC | libc::O_RDWR) as u32,
            fd: -1,
        };
        // SAFETY: DRM_IOCTL_PRIME_HANDLE_TO_FD reads and writes one `struct drm_prime_handle`.
        if unsafe { libc::ioctl(card.as_raw_fd(), DRM_IOCTL_PRIME_HANDLE_TO_FD as _, &mut p) } != 0 || p.fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(vgem_failed(format!("vgem export: {e}"), Some(e)));
        }
        // SAFETY: the ioctl just created this fd for us.
        let dmabuf = unsafe { OwnedFd::from_raw_fd(p.fd) };
        let size = c.size as usize;
        // SAFETY: maps `size` bytes of the dmabuf shared; checked for MAP_FAILED below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                dmabuf.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(vgem_failed(format!("mmap of the vgem dmabuf: {e}"), Some(e)));
        }
        Ok(VgemBuffer {
            dmabuf,
            map: map.cast(),
            len: size,
            _card: card,
        })
    }
}

impl DeviceMemory for VgemBuffer {
    fn len(&self) -> usize {
        self.len
    }
    fn dmabuf(&self) -> Result<DmabufHandle<'_>> {
        Ok(DmabufHandle {
            fd: self.dmabuf.as_fd(),
            offset: 0,
            iova: self.map as u64,
        })
    }
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if offset.checked_add(dst.len()).map_or(true, |e| e > self.len) {
            return Err(Error::DeviceMemory {
                op: "copy to host",
                reason: format!("{} bytes at {offset} past the vgem buffer's {}", dst.len(), self.len),
                source: None,
            });
        }
        // SAFETY: the range lies inside the live mapping (checked) and `dst` cannot alias it.
        unsafe { std::ptr::copy_nonoverlapping(self.map.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        if offset.checked_add(src.len()).map_or(true, |e| e > self.len) {
            return Err(Error::DeviceMemory {
                op: "copy from host",
                reason: format!("{} bytes at {offset} past the vgem buffer's {}", src.len(), self.len),
                source: None,
            });
        }
        // SAFETY: the range lies inside the live mapping (checked) and `src` cannot alias it.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.add(offset), src.len()) };
        Ok(())
    }
}
