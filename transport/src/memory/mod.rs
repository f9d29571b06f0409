//! Registered memory: page-aligned pinned host buffers and the region handle
//! every backend shares.
//!
//! A [`PinnedBuffer`] is an anonymous mapping, locked with `mlock(2)` so the
//! kernel never pages it out while a NIC or the socket layer writes into it.
//! Registering it with a transport turns it into a [`Region`]: a cheap,
//! reference-counted handle with a local identity (key + generation) and a
//! [`RemoteRegion`] descriptor that authenticated peers use to address
//! one-sided writes. Operations hold a clone of the region, so its memory
//! cannot be unmapped while the kernel or the hardware still uses it.
//!
//! # Who touches region memory
//! - **Safe Rust on this host** reaches the bytes only through a [`Lease`]
//!   (exclusive, never overlapping another) or through copies
//!   ([`Region::read_at`], [`Region::write_at`], [`Region::fill`],
//!   [`Region::read_f32_relaxed`]), which refuse bytes under a live lease and
//!   run under the lease table's lock. So no two Rust accesses to a byte race.
//! - **The kernel and the NIC** (a peer's one-sided write landing, a send or
//!   write reading its source) work outside Rust's memory model and outside
//!   the leases: the protocol above orders them (use a range after its
//!   completion event, leave it alone while an operation on it is in flight).
//!   Where bytes may still be landing, read them with the copies above: they
//!   read through relaxed atomic loads, never through a slice, so a race with
//!   the device can tear values but cannot make the program undefined.
//!
//! Under Miri, which cannot `mmap`, `mlock` or `madvise`, a [`PinnedBuffer`]
//! is a zeroed, page-aligned heap allocation and is never locked.

use std::fmt;

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

#[cfg(not(miri))]
use memmap2::{MmapMut, MmapOptions};

use crate::error::{Error, Result};

/// Bytes locked by all live [`PinnedBuffer`]s of this process.
static LOCKED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// How the buffer should try to get huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Ask for transparent huge pages with `MADV_HUGEPAGE` (the default; a no-op where THP is off).
    #[default]
    Transparent,
    /// Map from the hugetlbfs pool with `MAP_HUGETLB` (2 MiB pages). Fails if the pool is empty.
    HugeTlb,
    /// Plain 4 KiB pages.
    Off,
}

/// Options for [`PinnedBuffer::with_options`].
#[derive(Debug, Clone, Copy)]
pub struct PinOptions {
    /// Huge-page policy.
    pub huge_pages: HugePages,
    /// Lock the pages in RAM (`mlock`). Turn off only for tests of unpinned paths.
    pub lock: bool,
}

impl Default for PinOptions {
    fn default() -> Self {
        Self {
            huge_pages: HugePages::Transparent,
            lock: true,
        }
    }
}

/// The memory behind a [`PinnedBuffer`]: an anonymous mapping.
#[cfg(not(miri))]
type Mapping = MmapMut;
/// The memory behind a [`PinnedBuffer`] under Miri: a heap allocation.
#[cfg(miri)]
type Mapping = heap::HeapMap;

/// A page-aligned, zero-filled, pinned host buffer, or caller-owned memory
/// wrapped by [`PinnedBuffer::foreign`].
pub struct PinnedBuffer {
    map: Backing,
    len: usize,
    locked: bool,
    huge: HugePages,
}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("addr", &self.map.as_ptr())
            .field("len", &self.len)
            .field("locked", &self.locked)
            .field("huge", &self.huge)
            .finish()
    }
}

const HUGE_PAGE_BYTES: usize = 2 << 20;

/// The memory behind a [`PinnedBuffer`]: our own mapping, or the caller's.
enum Backing {
    Anon(Mapping),
    Foreign(Foreign),
}

/// Caller-owned memory (a framework's tensor): an address, a length, and
/// whatever keeps the memory alive.
struct Foreign {
    ptr: NonNull<u8>,
    len: usize,
    _owner: Option<Box<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: `PinnedBuffer::foreign`'s contract makes the memory behave like an owned
// allocation for Rust code (valid until drop, no Rust aliasing outside this value);
// the keep-alive owner is itself Send + Sync.
unsafe impl Send for Foreign {}
// SAFETY: as above; `&Foreign` gives out only shared reads and the raw address.
unsafe impl Sync for Foreign {}

impl Backing {
    fn as_ptr(&self) -> *const u8 {
        match self {
            Backing::Anon(m) => m.as_ptr(),
            Backing::Foreign(f) => f.ptr.as_ptr(),
        }
    }
    /// Bytes locked for this buffer (the whole mapping), or 0 for foreign memory.
    fn mapped_len(&self) -> usize {
        match self {
            Backing::Anon(m) => m.len(),
            Backing::Foreign(_) => 0,
        }
    }
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Anon(m) => m,
            // SAFETY: `PinnedBuffer::foreign`'s caller promised `len` valid, initialized
            // bytes that no one but this buffer's users touches while it lives.
            Backing::Foreign(f) => unsafe { std::slice::from_raw_parts(f.ptr.as_ptr(), f.len) },
        }
    }
}

impl std::ops::DerefMut for Backing {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Backing::Anon(m) => m,
            // SAFETY: as in `deref`; `&mut self` makes this the only Rust borrow.
            Backing::Foreign(f) => unsafe { std::slice::from_raw_parts_mut(f.ptr.as_ptr(), f.len) },
        }
    }
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let sz = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if sz > 0 {
        sz as usize
    } else {
        4096
    }
}

/// The soft RLIMIT_MEMLOCK as text (`"unlimited"` or bytes), for errors and `doctor`.
pub fn memlock_limit() -> (Option<u64>, String) {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `rl` is a valid, writable rlimit struct for the duration of the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    if rc != 0 {
        return (None, "unknown".into());
    }
    if rl.rlim_cur == libc::RLIM_INFINITY {
        (None, "unlimited".into())
    } else {
        (Some(rl.rlim_cur), format!("{} bytes", rl.rlim_cur))
    }
}

impl PinnedBuffer {
    /// Allocates `len` bytes (rounded up to a page), locked, with transparent huge pages.
    pub fn new(len: usize) -> Result<Self> {
        Self::with_options(len, PinOptions::default())
    }

    /// Allocates with explicit options.
    pub fn with_options(len: usize, opts: PinOptions) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument {
                op: "PinnedBuffer::new",
                reason: "length must be > 0".into(),
            });
        }
        let page = page_size();
        let rounded = match opts.huge_pages {
            HugePages::HugeTlb => len.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES,
            _ => len.div_ceil(page) * page,
        };
        let map = map_anon(rounded, opts.huge_pages).map_err(|source| Error::Alloc {
            bytes: rounded,
            what: if opts.huge_pages == HugePages::HugeTlb {
                "MAP_HUGETLB anonymous memory (is vm.nr_hugepages > 0?)"
            } else {
                "anonymous memory"
            },
            source,
        })?;
        let mut buf = Self {
            map: Backing::Anon(map),
            len,
            locked: false,
            huge: opts.huge_pages,
        };
        if opts.lock {
            let Backing::Anon(map) = &buf.map else {
                unreachable!("just mapped")
            };
            if let Err(source) = lock_pages(map) {
                let (_, limit) = memlock_limit();
                let locked_bytes = LOCKED_BYTES.load(Ordering::Relaxed);
                return Err(match source.raw_os_error() {
                    Some(libc::EPERM) | Some(libc::ENOMEM) | Some(libc::EAGAIN) => Error::MemlockLimit {
                        requested_bytes: rounded,
                        limit,
                        locked_bytes,
                        source,
                    },
                    _ => Error::Alloc {
                        bytes: rounded,
                        what: "mlock",
                        source,
                    },
                });
            }
            buf.locked = cfg!(not(miri));
            if buf.locked {
                LOCKED_BYTES.fetch_add(buf.map.mapped_len(), Ordering::Relaxed);
            }
        }
        Ok(buf)
    }

    /// Wraps caller-owned host memory (a framework's tensor, a C program's
    /// array) so that a transport can register it in place: zero-copy, the
    /// session's pushes read it and the servers' results land in it. Nothing
    /// is allocated, copied or locked here (an RDMA registration pins the
    /// pages itself; the TCP backends need no pinning). `owner`, when given,
    /// is dropped with the buffer: use it to keep the memory alive.
    ///
    /// # Safety
    /// - `ptr..ptr+len` is valid, initialized memory that stays allocated
    ///   until this buffer and every [`Region`] made from it are dropped.
    /// - While it lives, code outside this buffer touches the memory only
    ///   under the protocol of the layer above, exactly as the kernel and the
    ///   NIC do: never a range while an operation on it is in flight or while
    ///   it is leased (for a session: only between a layer's sync and its next
    ///   hand-in). A Rust reference formed outside this buffer to any of it
    ///   ends before that range is handed back.
    pub unsafe fn foreign(
        ptr: *mut u8,
        len: usize,
        owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<Self> {
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::InvalidArgument {
            op: "PinnedBuffer::foreign",
            reason: "null pointer".into(),
        })?;
        if len == 0 {
            return Err(Error::InvalidArgument {
                op: "PinnedBuffer::foreign",
                reason: "length must be > 0".into(),
            });
        }
        if (ptr.as_ptr() as usize).checked_add(len).is_none() || len > isize::MAX as usize {
            return Err(Error::InvalidArgument {
                op: "PinnedBuffer::foreign",
                reason: format!("{len} bytes at {:p} wrap the address space", ptr.as_ptr()),
            });
        }
        Ok(PinnedBuffer {
            map: Backing::Foreign(Foreign {
                ptr,
                len,
                _owner: owner,
            }),
            len,
            locked: false,
            huge: HugePages::Off,
        })
    }

    /// Takes ownership of the caller's `Vec<f32>` and registers its memory
    /// in place (the safe form of [`PinnedBuffer::foreign`]: the buffer owns
    /// the vector, so nothing else can reach it). Not page-aligned, not locked.
    pub fn from_f32_vec(mut v: Vec<f32>) -> Result<Self> {
        let (ptr, len) = (v.as_mut_ptr(), v.len() * 4);
        // SAFETY: the Vec moves into the buffer as its owner; its heap memory does
        // not move with it, stays allocated until the buffer drops, and no other
        // reference to it exists once the Vec is moved.
        unsafe { Self::foreign(ptr.cast(), len, Some(Box::new(v))) }
    }

    /// Takes ownership of a byte vector and registers its memory in place,
    /// like [`PinnedBuffer::from_f32_vec`] (no alignment beyond a byte).
    pub fn from_byte_vec(mut v: Vec<u8>) -> Result<Self> {
        let (ptr, len) = (v.as_mut_ptr(), v.len());
        // SAFETY: as in `from_f32_vec`: the buffer owns the Vec, whose heap memory
        // stays put and unreferenced elsewhere until the buffer drops.
        unsafe { Self::foreign(ptr, len, Some(Box::new(v))) }
    }

    /// Whether the memory is the caller's ([`PinnedBuffer::foreign`]).
    pub fn is_foreign(&self) -> bool {
        matches!(self.map, Backing::Foreign(_))
    }

    /// Usable length in bytes (as requested).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `dst.len()` bytes from `offset` with relaxed atomic loads: for
    /// a buffer a device writes (receive buffers, a notice ring), read
    /// without forming a slice over memory that can change meanwhile. Bytes
    /// being written concurrently may be torn.
    pub fn read_relaxed(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        match offset.checked_add(dst.len()) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(Error::OutOfBounds {
                    op: "PinnedBuffer::read_relaxed",
                    region: 0,
                    offset: offset as u64,
                    len: dst.len() as u64,
                    region_len: self.len as u64,
                })
            }
        }
        // SAFETY: the range was checked to lie in the buffer, which lives as long as
        // `self`; Rust code writes a PinnedBuffer only through `&mut self` (DerefMut),
        // which cannot coexist with this `&self`; `dst` is a distinct allocation.
        unsafe { load_relaxed(self.as_ptr().add(offset), dst) };
        Ok(())
    }

    /// Whether the pages are locked in RAM (never under Miri).
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// The mapping's start address (page-aligned).
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }

    /// Bytes locked by all live pinned buffers of this process.
    pub fn locked_bytes_total() -> usize {
        LOCKED_BYTES.load(Ordering::Relaxed)
    }
}

/// Maps `len` bytes of zeroed anonymous memory, with the huge-page policy.
#[cfg(not(miri))]
fn map_anon(len: usize, huge: HugePages) -> std::io::Result<Mapping> {
    let mut mo = MmapOptions::new();
    mo.len(len);
    if huge == HugePages::HugeTlb {
        mo.huge(Some(21));
    }
    let map = mo.map_anon()?;
    if huge == HugePages::Transparent && len >= HUGE_PAGE_BYTES {
        // Best effort: THP may be disabled; the buffer works either way.
        if let Err(e) = map.advise(memmap2::Advice::HugePage) {
            tracing::debug!(error = %e, "MADV_HUGEPAGE refused; using 4 KiB pages");
        }
    }
    Ok(map)
}

/// Miri cannot map memory: a zeroed, page-aligned heap allocation (huge pages ignored).
#[cfg(miri)]
fn map_anon(len: usize, _huge: HugePages) -> std::io::Result<Mapping> {
    heap::HeapMap::new(len)
}

/// `mlock(2)`s the mapping.
#[cfg(not(miri))]
fn lock_pages(map: &Mapping) -> std::io::Result<()> {
    map.lock()
}

/// Miri cannot lock pages: nothing is locked (and [`PinnedBuffer::is_locked`] says so).
#[cfg(miri)]
fn lock_pages(_map: &Mapping) -> std::io::Result<()> {
    Ok(())
}

#[cfg(miri)]
mod heap {
    use std::alloc::{alloc_zeroed, dealloc, Layout};
    use std::io;
    use std::ptr::NonNull;

    /// A zeroed, page-aligned heap allocation that stands in for an anonymous
    /// mapping under Miri; it owns its memory as a `Box<[u8]>` would.
    pub(crate) struct HeapMap {
        ptr: NonNull<u8>,
        layout: Layout,
    }

    // SAFETY: HeapMap uniquely owns its allocation (like Box<[u8]>); access to the
    // bytes goes through `&self`/`&mut self` or raw pointers whose users uphold the rules.
    unsafe impl Send for HeapMap {}
    // SAFETY: as above; `&HeapMap` only gives out shared reads or raw pointers.
    unsafe impl Sync for HeapMap {}

    impl HeapMap {
        pub(crate) fn new(len: usize) -> io::Result<HeapMap> {
            let layout = Layout::from_size_align(len, super::page_size()).map_err(io::Error::other)?;
            if layout.size() == 0 {
                return Err(io::Error::from(io::ErrorKind::InvalidInput));
            }
            // SAFETY: the layout has a non-zero size (checked above).
            let ptr = unsafe { alloc_zeroed(layout) };
            let ptr = NonNull::new(ptr).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
            Ok(HeapMap { ptr, layout })
        }
        pub(crate) fn as_ptr(&self) -> *const u8 {
            self.ptr.as_ptr()
        }
        pub(crate) fn len(&self) -> usize {
            self.layout.size()
        }
    }

    impl std::ops::Deref for HeapMap {
        type Target = [u8];
        fn deref(&self) -> &[u8] {
            // SAFETY: the allocation is live, initialized (zeroed) and `len` bytes long.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
        }
    }

    impl std::ops::DerefMut for HeapMap {
        fn deref_mut(&mut self) -> &mut [u8] {
            // SAFETY: as in `deref`; `&mut self` makes this the only borrow.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
        }
    }

    impl Drop for HeapMap {
        fn drop(&mut self) {
            // SAFETY: allocated in `new` with this very layout, freed once.
            unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}

impl std::ops::Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl std::ops::DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.locked {
            LOCKED_BYTES.fetch_sub(self.map.mapped_len(), Ordering::Relaxed);
        }
    }
}

/// What peers may do to a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    /// Peers may write into it with one-sided writes. Only such regions are announced.
    pub remote_write: bool,
}

impl Access {
    /// Local use only: sources of sends and writes.
    pub const LOCAL: Access = Access { remote_write: false };
    /// A landing zone for peers' one-sided writes.
    pub const REMOTE_WRITE: Access = Access { remote_write: true };
}

/// Memory kinds a transport can register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Pinned host memory.
    Host,
    /// CUDA device memory addressed by pointer (GPUDirect through peer memory).
    Cuda,
    /// Device memory exported as a dmabuf file descriptor.
    DmaBuf,
}

/// The descriptor a peer needs to write into a region: what an RDMA
/// implementation would call (addr, len, rkey), plus a generation that makes
/// descriptors of a deregistered region stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Virtual address of byte 0 at the owner (informational for TCP; used by RDMA).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key: names the region at its owner. Random, learned only after authentication.
    pub rkey: u32,
    /// Registration generation at the owner.
    pub generation: u32,
}

/// Leased byte ranges, as (start, end, lease id).
type LeaseTable = Vec<(usize, usize, u64)>;

pub(crate) struct RegionInner {
    buf: PinnedBuffer,
    ptr: NonNull<u8>,
    len: usize,
    pub(crate) key: u32,
    pub(crate) generation: u32,
    pub(crate) access: Access,
    /// Operations that currently use the memory (sends, writes, incoming payloads).
    pub(crate) in_flight: AtomicUsize,
    pub(crate) registered: AtomicBool,
    /// io_uring fixed-buffer slot, when the backend registered one.
    pub(crate) fixed_index: Option<u16>,
    /// Byte ranges leased for local access; its lock also serializes the copies.
    leases: Mutex<LeaseTable>,
    next_lease: AtomicUsize,
}

// SAFETY: the memory is owned by `buf` and lives as long as the RegionInner. Rust
// code on any thread reaches it only through leases (exclusive, non-overlapping,
// tracked under the `leases` lock) or through copies that refuse leased bytes and
// run under that lock (module docs); kernel and device I/O is ordered by the
// protocol. `ptr` is a plain address into `buf`'s memory, not a borrow.
unsafe impl Send for RegionInner {}
// SAFETY: see `Send` above: no two threads get aliasing references to the same bytes.
unsafe impl Sync for RegionInner {}

/// A registered region: a reference-counted handle to pinned memory.
///
/// Cloning is cheap. Every in-flight operation holds a clone, so the memory
/// outlives the operation even if the user drops all handles.
#[derive(Clone)]
pub struct Region(pub(crate) Arc<RegionInner>);

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("key", &format_args!("{:#x}", self.0.key))
            .field("generation", &self.0.generation)
            .field("len", &self.0.len)
            .field("access", &self.0.access)
            .field("in_flight", &self.0.in_flight.load(Ordering::Relaxed))
            .finish()
    }
}

impl Region {
    pub(crate) fn new(buf: PinnedBuffer, key: u32, generation: u32, access: Access, fixed_index: Option<u16>) -> Self {
        let len = buf.len();
        let ptr = NonNull::new(buf.as_ptr() as *mut u8).expect("mmap never returns null");
        Region(Arc::new(RegionInner {
            buf,
            ptr,
            len,
            key,
            generation,
            access,
            in_flight: AtomicUsize::new(0),
            registered: AtomicBool::new(true),
            fixed_index,
            leases: Mutex::new(Vec::new()),
            next_lease: AtomicUsize::new(0),
        }))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// Local key (also the remote key peers use).
    pub fn key(&self) -> u32 {
        self.0.key
    }

    /// Registration generation.
    pub fn generation(&self) -> u32 {
        self.0.generation
    }

    /// Access granted at registration.
    pub fn access(&self) -> Access {
        self.0.access
    }

    /// Whether the region is still registered with its transport.
    pub fn is_registered(&self) -> bool {
        self.0.registered.load(Ordering::Acquire)
    }

    /// Operations currently using this region.
    pub fn in_flight(&self) -> usize {
        self.0.in_flight.load(Ordering::Acquire)
    }

    /// Whether the pages are locked.
    pub fn is_locked(&self) -> bool {
        self.0.buf.is_locked()
    }

    /// The descriptor peers use to address one-sided writes.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.0.ptr.as_ptr() as u64,
            len: self.0.len as u64,
            rkey: self.0.key,
            generation: self.0.generation,
        }
    }

    /// A bounds-checked view `[offset, offset+len)` to use as a send or write source.
    pub fn slice(&self, offset: usize, len: usize) -> Result<Slice> {
        self.check(offset, len, "Region::slice")?;
        Ok(Slice {
            region: self.clone(),
            offset,
            len,
        })
    }

    /// The whole region as a slice.
    pub fn full(&self) -> Slice {
        Slice {
            region: self.clone(),
            offset: 0,
            len: self.0.len,
        }
    }

    fn check(&self, offset: usize, len: usize, op: &'static str) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.0.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                op,
                region: self.0.key,
                offset: offset as u64,
                len: len as u64,
                region_len: self.0.len as u64,
            }),
        }
    }

    /// Bounds-checks `[offset, offset+len)`, then locks the lease table and checks
    /// that no lease covers any of its bytes. A copy holds the returned guard
    /// while it touches the range, so no lease can be taken on it meanwhile and
    /// no other copy runs at the same time.
    fn quiet_range(&self, offset: usize, len: usize, op: &'static str) -> Result<MutexGuard<'_, LeaseTable>> {
        self.check(offset, len, op)?;
        let end = offset + len;
        let leases = self.0.leases.lock().unwrap_or_else(|p| p.into_inner());
        match leases.iter().filter(|&&(s, e, _)| offset < e && s < end).count() {
            0 => Ok(leases),
            in_flight => Err(Error::RegionBusy {
                op,
                region: self.0.key,
                in_flight,
            }),
        }
    }

    /// Copies `dst.len()` bytes out of the region at `offset`.
    ///
    /// Refused with [`Error::RegionBusy`] while a [`Lease`] covers any of those
    /// bytes (its holder may be writing them). Safe while a peer's one-sided
    /// write or the NIC is placing bytes in the range: the copy reads through
    /// relaxed atomic loads (8 bytes at a time where aligned), never through a
    /// slice over the region, so such a race can only tear values. To read
    /// whole values, read after the write's completion event
    /// (`Event::WriteReceived`).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let _quiet = self.quiet_range(offset, dst.len(), "Region::read_at")?;
        // No lease covers the range and the lease lock is held, so no Rust code writes it
        // meanwhile; `dst` cannot alias it (a `&mut` into a region lies in a leased range).
        // SAFETY: bounds checked; the mapping is valid for reads while `self` lives.
        unsafe { load_relaxed(self.0.ptr.as_ptr().add(offset), dst) };
        Ok(())
    }

    /// Reads `dst.len()` f32 values starting at byte `offset` (a multiple of 4),
    /// each through one `AtomicU32::load(Relaxed)` on the mapping: no slice over
    /// the region is made.
    ///
    /// Use it for memory a peer or the NIC may be writing while you read (a
    /// landing slot, a parameter buffer that servers write into), and to publish
    /// from one region into another without a plain view of the source:
    /// `src.read_f32_relaxed(off, dst_lease.as_f32_mut()?)`. Each value is read
    /// whole (an aligned 4-byte device write is not torn within a value on
    /// x86-64 and arm64); values written concurrently may be a mix of old and new.
    /// Refused with [`Error::RegionBusy`] while a lease covers any byte of the
    /// range, with [`Error::InvalidArgument`] when `offset` is not 4-byte aligned.
    pub fn read_f32_relaxed(&self, offset: usize, dst: &mut [f32]) -> Result<()> {
        let op = "Region::read_f32_relaxed";
        let len = dst.len().checked_mul(4).ok_or(Error::InvalidArgument {
            op,
            reason: "element count overflows".into(),
        })?;
        if offset % 4 != 0 {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("offset {offset} is not 4-byte aligned"),
            });
        }
        let _quiet = self.quiet_range(offset, len, op)?;
        let base = self.0.ptr.as_ptr().wrapping_add(offset).cast::<u32>();
        for (i, d) in dst.iter_mut().enumerate() {
            // No Rust code writes the range meanwhile (no lease, lock held), so every access
            // is atomic or ordered by that lock; `dst` cannot alias it (a `&mut` would be leased).
            // SAFETY: in bounds (checked); aligned (page-aligned base, offset a multiple of 4); live.
            let v = unsafe { AtomicU32::from_ptr(base.add(i)) }.load(Ordering::Relaxed);
            *d = f32::from_bits(v);
        }
        Ok(())
    }

    /// Copies bytes into the region (e.g. to fill a send source). Refused with
    /// [`Error::RegionBusy`] while a [`Lease`] covers any of those bytes.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        let _quiet = self.quiet_range(offset, src.len(), "Region::write_at")?;
        // No lease covers the range and the lease lock is held, so no Rust reference to these
        // bytes exists meanwhile and `src` (a lease, outside the range) cannot overlap them.
        // SAFETY: bounds checked; the mapping is writable and valid while `self` lives.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Receives up to `len` bytes from the non-blocking socket `fd` straight into
    /// `[offset, offset+len)` (the portable TCP backend's placement of a peer's
    /// write): the kernel copies into the mapping, and no Rust reference to the
    /// bytes is formed. The lease table's lock is held for the call, so no local
    /// copy ([`Region::read_at`], [`Region::write_at`], ...) runs meanwhile. As
    /// with the io_uring `RECV` and an RDMA NIC, a lease does not stop a peer's
    /// write: the protocol above keeps leased ranges quiet.
    pub(crate) fn recv_into(&self, offset: usize, len: usize, fd: std::os::fd::RawFd) -> std::io::Result<usize> {
        self.check(offset, len, "incoming write")
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let _serialized = self.0.leases.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: [offset, offset+len) lies inside the live, writable mapping (checked
        // above; `self` keeps it alive). The kernel writes the bytes; no Rust reference
        // to them exists in this function, and local copies are excluded by the lock.
        let n = unsafe { libc::recv(fd, self.0.ptr.as_ptr().add(offset).cast(), len, 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Like [`Region::recv_into`], and bytes past `len` (the start of the next
    /// frame) go into `tail`: one `recvmsg(2)` with two iovecs. Returns the bytes
    /// received in all (`> len` means `tail` got the excess).
    pub(crate) fn recv_into_with_tail(
        &self,
        offset: usize,
        len: usize,
        fd: std::os::fd::RawFd,
        tail: &mut [u8],
    ) -> std::io::Result<usize> {
        self.check(offset, len, "incoming write")
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let _serialized = self.0.leases.lock().unwrap_or_else(|p| p.into_inner());
        let mut iov = [
            libc::iovec {
                // SAFETY: offset <= len of the mapping (checked above).
                iov_base: unsafe { self.0.ptr.as_ptr().add(offset) }.cast(),
                iov_len: len,
            },
            libc::iovec {
                iov_base: tail.as_mut_ptr().cast(),
                iov_len: tail.len(),
            },
        ];
        // SAFETY: all-zero is a valid msghdr (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = 2;
        // The kernel writes the first iovec with no Rust reference to those bytes alive
        // (local copies are excluded by the lock); the second is a unique borrow of `tail`.
        // SAFETY: both iovecs lie in live, writable memory (checked above) that outlives the call.
        let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Fills `[offset, offset+len)` with `byte`. Refused with
    /// [`Error::RegionBusy`] while a [`Lease`] covers any of those bytes.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        let _quiet = self.quiet_range(offset, len, "Region::fill")?;
        // SAFETY: bounds checked; the mapping is writable and valid while `self` lives; no
        // lease covers the range and the lease lock is held for the write, so no Rust
        // reference to these bytes exists or can be made meanwhile.
        unsafe { std::ptr::write_bytes(self.0.ptr.as_ptr().add(offset), byte, len) };
        Ok(())
    }

    /// A zero-copy view of the whole region.
    ///
    /// # Safety
    /// Nothing may write into the region while the slice lives: no lease may be
    /// written through, no [`Region::write_at`] or [`Region::fill`] may run, and
    /// no incoming one-sided write targeting it may be in progress (wait for
    /// its completion event, or quiesce the peers, first). Prefer
    /// [`Region::read_at`] or [`Region::read_f32_relaxed`].
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the caller guarantees no concurrent writer; memory valid for `len`.
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr(), self.0.len) }
    }

    /// Exclusive local access to `[offset, offset+len)`, for code that computes
    /// on registered memory in place (filling a gradient, summing a landing slot,
    /// applying an update).
    ///
    /// Leases never overlap, and the copies ([`Region::read_at`],
    /// [`Region::write_at`], [`Region::fill`], [`Region::read_f32_relaxed`])
    /// refuse leased bytes: a second lease or a copy touching any byte of a
    /// leased range fails with [`Error::RegionBusy`] until the lease is dropped,
    /// so safe code cannot alias the memory, on any thread. What a lease cannot
    /// stop is I/O that the protocol above controls: a one-sided write from a
    /// peer into the range, or a send or write posted from it, runs
    /// concurrently and can tear the values it touches (and the slice the
    /// lease hands out would then change underneath it). Lease a range only
    /// while the protocol guarantees it is quiet (after the write's completion
    /// event, before the next post); to read bytes that may still be landing,
    /// use [`Region::read_f32_relaxed`] or [`Region::read_at`] instead.
    pub fn lease(&self, offset: usize, len: usize) -> Result<Lease> {
        let mut leases = self.quiet_range(offset, len, "Region::lease")?;
        let id = self.0.next_lease.fetch_add(1, Ordering::Relaxed) as u64;
        leases.push((offset, offset + len, id));
        Ok(Lease {
            region: self.clone(),
            offset,
            len,
            id,
        })
    }

    /// [`Region::lease`] of `len` f32 elements starting at element `offset`.
    pub fn lease_f32(&self, offset: usize, len: usize) -> Result<Lease> {
        let (o, l) = match (offset.checked_mul(4), len.checked_mul(4)) {
            (Some(o), Some(l)) => (o, l),
            _ => {
                return Err(Error::InvalidArgument {
                    op: "Region::lease_f32",
                    reason: "element range overflows".into(),
                })
            }
        };
        self.lease(o, l)
    }

    /// Base pointer, for backends and FFI.
    pub fn as_ptr(&self) -> *mut u8 {
        self.0.ptr.as_ptr()
    }

    /// Whether two handles name the same registration.
    pub fn same(&self, other: &Region) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A bounds-checked `[offset, offset+len)` view of a region: the source of a send or a write.
#[derive(Debug, Clone)]
pub struct Slice {
    pub(crate) region: Region,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl Slice {
    /// The region.
    pub fn region(&self) -> &Region {
        &self.region
    }
    /// Offset inside the region.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub(crate) fn ptr(&self) -> *mut u8 {
        // SAFETY: offset <= region length was checked when the slice was made.
        unsafe { self.region.as_ptr().add(self.offset) }
    }
}

/// Exclusive local access to a byte range of a [`Region`]; see [`Region::lease`].
/// No other lease and no copy touches the range while it lives (device and
/// kernel I/O excepted: the protocol must keep the range quiet). The range is
/// released when the lease drops.
pub struct Lease {
    region: Region,
    offset: usize,
    len: usize,
    id: u64,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("region", &format_args!("{:#x}", self.region.0.key))
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Lease {
    /// The region.
    pub fn region(&self) -> &Region {
        &self.region
    }
    /// Offset of the range in the region, bytes.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length, bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The leased bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // Remote I/O into the range is the protocol's business (see `Region::lease`).
        // SAFETY: bounds-checked at lease time; the mapping lives as long as `self.region`;
        // no other lease overlaps, and the copies refuse leased bytes, so no Rust code
        // writes the range while this borrow of the lease lives.
        unsafe { std::slice::from_raw_parts(self.region.as_ptr().add(self.offset), self.len) }
    }
    /// The leased bytes, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`; `&mut self` makes this the only borrow of the lease.
        unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().add(self.offset), self.len) }
    }
    fn f32_ok(&self) -> Result<usize> {
        if self.offset % 4 != 0 || self.len % 4 != 0 {
            return Err(Error::InvalidArgument {
                op: "Lease::as_f32",
                reason: format!("range {}+{} is not 4-byte aligned", self.offset, self.len),
            });
        }
        Ok(self.len / 4)
    }
    /// The leased range as f32 (the offset and length must be multiples of 4).
    pub fn as_f32(&self) -> Result<&[f32]> {
        let n = self.f32_ok()?;
        // SAFETY: as in `as_bytes`; the region base is page aligned and the
        // offset a multiple of 4, so the pointer is aligned for f32, and any
        // bit pattern is a valid f32.
        Ok(unsafe { std::slice::from_raw_parts(self.region.as_ptr().add(self.offset) as *const f32, n) })
    }
    /// The leased range as mutable f32.
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        let n = self.f32_ok()?;
        // SAFETY: as in `as_f32`; `&mut self` makes this the only borrow of the lease.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().add(self.offset) as *mut f32, n) })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut leases = self.region.0.leases.lock().unwrap_or_else(|p| p.into_inner());
        leases.retain(|l| l.2 != self.id);
    }
}

/// Whether a backend may deregister `region`: it must be the backend's own
/// (`known`) and have no operation in flight. Shared by the backends.
pub(crate) fn check_deregister(known: bool, region: &Region) -> Result<()> {
    if !known {
        return Err(Error::UnknownRegion {
            op: "deregister",
            region: region.key(),
            generation: region.generation(),
        });
    }
    match region.in_flight() {
        0 => Ok(()),
        in_flight => Err(Error::RegionBusy {
            op: "deregister",
            region: region.key(),
            in_flight,
        }),
    }
}

/// Guards one in-flight use of a region; dropping it releases the use.
#[derive(Debug)]
pub(crate) struct InFlight(pub(crate) Region);

impl InFlight {
    pub(crate) fn new(r: &Region) -> Self {
        r.0.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(r.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0 .0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Copies `dst.len()` bytes starting at `src` with relaxed atomic loads: single
/// bytes up to 8-byte alignment, then 8 bytes at a time, then the tail.
///
/// # Safety
/// `src .. src + dst.len()` must be valid for reads for the whole call, and no
/// Rust code may write it non-atomically meanwhile (device and kernel writes are
/// outside the Rust memory model: they can only tear values). `dst` must not
/// overlap it.
unsafe fn load_relaxed(src: *const u8, dst: &mut [u8]) {
    let n = dst.len();
    let head = src.align_offset(8).min(n);
    let mut i = 0;
    while i < n {
        if i >= head && i + 8 <= n {
            // SAFETY: `src + i` is 8-aligned (`i >= head`) and its 8 bytes lie in the range,
            // which the caller makes valid for reads and free of non-atomic Rust writes.
            let v = unsafe { AtomicU64::from_ptr(src.add(i).cast::<u64>().cast_mut()) }.load(Ordering::Relaxed);
            dst[i..i + 8].copy_from_slice(&v.to_ne_bytes());
            i += 8;
        } else {
            // SAFETY: `src + i` lies in the range (as above); a byte needs no alignment.
            dst[i] = unsafe { AtomicU8::from_ptr(src.add(i).cast_mut()) }.load(Ordering::Relaxed);
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foreign_memory_is_used_in_place_and_checked() {
        // SAFETY: a null pointer is refused before anything reads it.
        let e = unsafe { PinnedBuffer::foreign(std::ptr::null_mut(), 16, None) }.unwrap_err();
        assert!(e.to_string().contains("null"), "{e}");
        let mut b = [0u8; 8];
        // SAFETY: a zero length is refused before anything reads it.
        let e = unsafe { PinnedBuffer::foreign(b.as_mut_ptr(), 0, None) }.unwrap_err();
        assert!(e.to_string().contains("> 0"), "{e}");
        let v: Vec<f32> = (0..300).map(|i| i as f32).collect();
        let addr = v.as_ptr() as usize;
        let locked = PinnedBuffer::locked_bytes_total();
        let buf = PinnedBuffer::from_f32_vec(v).unwrap();
        assert!(buf.is_foreign() && !buf.is_locked());
        assert_eq!((buf.as_ptr() as usize, buf.len()), (addr, 1200));
        assert_eq!(
            PinnedBuffer::locked_bytes_total(),
            locked,
            "foreign memory is not counted as locked"
        );
        // Registered and leased like our own memory, in place.
        let r = Region::new(buf, 9, 1, Access::LOCAL, None);
        let mut l = r.lease_f32(1, 2).unwrap();
        assert_eq!(l.as_f32().unwrap(), &[1.0, 2.0]);
        l.as_f32_mut().unwrap()[0] = -1.0;
        drop(l);
        let mut out = [0u8; 4];
        r.read_at(4, &mut out).unwrap();
        assert_eq!(f32::from_le_bytes(out), -1.0);
        assert!(r.lease(1196, 8).is_err(), "bounds are the caller's length");
        drop(r); // frees the Vec (Miri checks the ownership)
    }

    #[test]
    fn leases_are_exclusive_and_typed() {
        let r = Region::new(
            PinnedBuffer::with_options(
                4096,
                PinOptions {
                    lock: false,
                    ..Default::default()
                },
            )
            .unwrap(),
            1,
            1,
            Access::LOCAL,
            None,
        );
        let mut a = r.lease_f32(0, 4).unwrap();
        a.as_f32_mut().unwrap().copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        assert!(
            matches!(r.lease(12, 8), Err(Error::RegionBusy { .. })),
            "overlap refused"
        );
        let b = r.lease_f32(4, 4).unwrap();
        assert_eq!(b.as_f32().unwrap(), &[0.0; 4]);
        drop(a);
        let a = r.lease_f32(0, 4).unwrap();
        assert_eq!(a.as_f32().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert!(r.lease(33, 4).unwrap().as_f32().is_err(), "misaligned f32 view refused");
        assert!(matches!(r.lease(4090, 8), Err(Error::OutOfBounds { .. })));
        drop(b);
    }

    #[test]
    fn pinned_buffer_is_page_aligned_zeroed_and_locked() {
        let b = PinnedBuffer::new(10_000).unwrap();
        assert_eq!(b.as_ptr() as usize % page_size(), 0);
        assert_eq!(b.len(), 10_000);
        assert!(b.iter().all(|&x| x == 0));
        // Miri cannot lock pages; the buffer says so.
        assert_eq!(b.is_locked(), cfg!(not(miri)));
        if b.is_locked() {
            assert!(PinnedBuffer::locked_bytes_total() >= 10_000);
        }
    }

    #[test]
    fn zero_length_is_rejected() {
        assert!(matches!(PinnedBuffer::new(0), Err(Error::InvalidArgument { .. })));
    }

    #[test]
    fn memlock_error_names_the_limit_and_the_fix() {
        let e = Error::MemlockLimit {
            requested_bytes: 1 << 30,
            limit: "8388608 bytes".into(),
            locked_bytes: 0,
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        };
        let s = e.to_string();
        assert!(s.contains("RLIMIT_MEMLOCK"), "{s}");
        assert!(s.contains("8388608 bytes"), "{s}");
        assert!(s.contains("ulimit -l"), "{s}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "fork, setrlimit and mlock are real syscalls")]
    fn over_limit_mlock_reports_memlock() {
        // Lower our own soft limit in a child process so the rest of the test run is unaffected.
        // SAFETY: fork in a test process; the child only calls async-signal-safe-enough
        // code paths (setrlimit, mmap, mlock) and exits with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let rl = libc::rlimit {
                rlim_cur: 64 * 1024,
                rlim_max: 64 * 1024,
            };
            // SAFETY: valid rlimit pointer; setgid/setuid drop root's CAP_IPC_LOCK
            // (which would bypass the limit) in this child only.
            unsafe {
                libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl);
                if libc::geteuid() == 0 {
                    libc::setgid(65534);
                    libc::setuid(65534);
                }
            }
            let code = match PinnedBuffer::new(16 << 20) {
                Err(e @ Error::MemlockLimit { .. }) if e.to_string().contains("65536 bytes") => 0,
                _ => 1,
            };
            // SAFETY: terminate the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting on our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }

    #[test]
    fn region_bounds_and_copies() {
        let r = Region::new(PinnedBuffer::new(4096).unwrap(), 7, 1, Access::LOCAL, None);
        r.write_at(10, b"hello").unwrap();
        let mut out = [0u8; 5];
        r.read_at(10, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(r.slice(4090, 7).is_err());
        assert!(r.slice(usize::MAX, 2).is_err());
        assert!(r.read_at(4095, &mut [0u8; 2]).is_err());
        let s = r.slice(4000, 96).unwrap();
        assert_eq!((s.offset(), s.len()), (4000, 96));
        {
            let _g = InFlight::new(&r);
            assert_eq!(r.in_flight(), 1);
        }
        assert_eq!(r.in_flight(), 0);
    }

    fn region(len: usize) -> Region {
        let buf = PinnedBuffer::with_options(
            len,
            PinOptions {
                lock: false,
                ..Default::default()
            },
        )
        .unwrap();
        Region::new(buf, 9, 1, Access::REMOTE_WRITE, None)
    }

    fn busy(r: Result<()>) -> bool {
        matches!(r, Err(Error::RegionBusy { .. }))
    }

    #[test]
    fn copies_refuse_leased_bytes() {
        let r = region(4096);
        let mut l = r.lease(100, 50).unwrap();
        l.as_bytes_mut().fill(7);
        for (off, len) in [(100, 50), (90, 11), (149, 1), (0, 4096), (120, 1)] {
            assert!(busy(r.write_at(off, &vec![1; len])), "write_at {off}+{len}");
            assert!(busy(r.fill(off, len, 1)), "fill {off}+{len}");
            assert!(busy(r.read_at(off, &mut vec![0; len])), "read_at {off}+{len}");
        }
        assert!(busy(r.read_f32_relaxed(148, &mut [0.0; 1])));
        let e = r.write_at(100, b"x").unwrap_err();
        assert!(e.to_string().contains("Region::write_at"), "{e}");
        // Next to the lease, copies go ahead.
        r.write_at(90, &[1; 10]).unwrap();
        r.fill(150, 10, 2).unwrap();
        let mut out = [0u8; 70];
        r.read_at(150, &mut out[..10]).unwrap();
        assert_eq!(out[..10], [2; 10]);
        assert!(
            l.as_bytes().iter().all(|&b| b == 7),
            "the leased bytes were not touched"
        );
        drop(l);
        r.read_at(90, &mut out).unwrap();
        assert_eq!(out[..10], [1; 10]);
        assert_eq!(out[10..60], [7; 50]);
        assert_eq!(out[60..], [2; 10]);
        r.write_at(100, b"free again").unwrap();
    }

    #[test]
    fn relaxed_reads() {
        let r = region(4096);
        let vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
        r.lease_f32(8, 64).unwrap().as_f32_mut().unwrap().copy_from_slice(&vals);
        let mut got = vec![0f32; 64];
        r.read_f32_relaxed(32, &mut got).unwrap();
        assert_eq!(got, vals);
        assert!(matches!(
            r.read_f32_relaxed(2, &mut got),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            r.read_f32_relaxed(4096 - 8, &mut got[..3]),
            Err(Error::OutOfBounds { .. })
        ));
        r.read_f32_relaxed(4096, &mut []).unwrap();
        // Region to region (and within one region) through a lease on the destination.
        let other = region(4096);
        let mut dst = other.lease_f32(0, 64).unwrap();
        r.read_f32_relaxed(32, dst.as_f32_mut().unwrap()).unwrap();
        assert_eq!(dst.as_f32().unwrap(), &vals[..]);
        let mut same = r.lease_f32(512, 64).unwrap();
        r.read_f32_relaxed(32, same.as_f32_mut().unwrap()).unwrap();
        assert_eq!(same.as_f32().unwrap(), &vals[..]);
        // Byte reads at every alignment and length around the 8-byte words.
        let bytes: Vec<u8> = (0..64u8).collect();
        r.write_at(1000, &bytes).unwrap();
        for off in 0..9 {
            for len in 0..(64 - off).min(20) {
                let mut out = vec![0u8; len];
                r.read_at(1000 + off, &mut out).unwrap();
                assert_eq!(out, bytes[off..off + len], "{off}+{len}");
            }
        }
    }

    #[test]
    fn leases_from_two_threads_are_exclusive() {
        // Two threads race for overlapping leases and write through them, while
        // copies run beside them; a lapse in exclusivity is a data race (Miri
        // reports it) or a torn pattern (the asserts catch it).
        let r = region(4096);
        let rounds = if cfg!(miri) { 20 } else { 2000 };
        let workers: Vec<_> = (1..=2u8)
            .map(|me| {
                let r = r.clone();
                std::thread::spawn(move || {
                    let mut won = 0;
                    for _ in 0..rounds {
                        if let Ok(mut l) = r.lease(me as usize * 8, 32) {
                            l.as_bytes_mut().fill(me);
                            assert!(l.as_bytes().iter().all(|&b| b == me), "another writer in my lease");
                            won += 1;
                        }
                        let mut out = [0u8; 8];
                        match r.read_at(0, &mut out) {
                            Ok(()) => assert!(out.iter().all(|&b| b == out[0])),
                            Err(e) => assert!(matches!(e, Error::RegionBusy { .. }), "{e}"),
                        }
                        let _ = r.write_at(4000, &[me; 8]);
                        let mut f = [0f32; 2];
                        r.read_f32_relaxed(4000, &mut f).unwrap();
                        std::thread::yield_now();
                    }
                    won
                })
            })
            .collect();
        let won: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
        assert!(won > 0);
        assert!(r.lease(0, 4096).is_ok(), "every lease was released");
    }
}
