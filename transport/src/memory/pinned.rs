//! Pinned host buffers: [`PinnedBuffer`] (an anonymous mapping locked with
//! `mlock(2)`, or caller-owned memory wrapped in place), its options
//! ([`PinOptions`], [`HugePages`]), and the count of bytes this process has
//! locked. Under Miri the mapping is a page-aligned heap allocation (`heap`).

use std::fmt;

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

#[cfg(not(miri))]
use memmap2::{MmapMut, MmapOptions};

use super::{load_relaxed, memlock_limit, page_size};
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
    ///   until this buffer and every [`Region`](super::Region) made from it are dropped.
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
