//! [`Region`]: registered memory as a reference-counted handle (its key,
//! generation, access and in-flight count, its lease table), the copies in and
//! out that never form a slice over bytes a device may write, the kernel's
//! receives straight into it; and [`Slice`], a bounds-checked view used as the
//! source of a send or a write. Leases are taken in `lease`.

use std::fmt;

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{load_relaxed, Access, PinnedBuffer, RemoteRegion};
use crate::error::{Error, Result};

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
    pub(super) leases: Mutex<LeaseTable>,
    pub(super) next_lease: AtomicUsize,
}

// SAFETY: the memory is owned by `buf` and lives as long as the RegionInner. Rust
// code on any thread reaches it only through leases (exclusive, non-overlapping,
// tracked under the `leases` lock) or through copies that refuse leased bytes and
// run under that lock (the `memory` module docs); kernel and device I/O is ordered
// by the protocol. `ptr` is a plain address into `buf`'s memory, not a borrow.
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
    pub(super) fn quiet_range(
        &self,
        offset: usize,
        len: usize,
        op: &'static str,
    ) -> Result<MutexGuard<'_, LeaseTable>> {
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
    /// Refused with [`Error::RegionBusy`] while a [`Lease`](super::Lease) covers any of those
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

    /// Reads `dst.len()` f32 values starting at byte `offset` (the address there
    /// must be 4-byte aligned: a multiple of 4 in a region of our own memory,
    /// which is page-aligned), each through one relaxed atomic load on the
    /// mapping (8-byte loads of two values where aligned, else `AtomicU32`): no
    /// slice over the region is made.
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
        if (self.0.ptr.as_ptr() as usize).wrapping_add(offset) % 4 != 0 {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("offset {offset} does not give a 4-byte aligned address"),
            });
        }
        let _quiet = self.quiet_range(offset, len, op)?;
        let base = self.0.ptr.as_ptr().wrapping_add(offset).cast::<u32>();
        // No Rust code writes the range meanwhile (no lease, lock held), so every access
        // is atomic or ordered by that lock; `dst` cannot alias it (a `&mut` would be leased).
        // A float is always one load: one 4-byte load for a float before the first 8-byte
        // boundary and for an odd one at the end, 8-byte loads (two floats) between.
        let load_one = |i: usize| {
            // SAFETY: element `i` is in bounds (checked by `quiet_range`); its address is
            // 4-aligned (checked above); the mapping lives while `self` does.
            f32::from_bits(unsafe { AtomicU32::from_ptr(base.add(i)) }.load(Ordering::Relaxed))
        };
        let head = usize::from(base as usize % 8 != 0).min(dst.len());
        let pairs = (dst.len() - head) / 2 * 2;
        let (first, rest) = dst.split_at_mut(head);
        let (middle, last) = rest.split_at_mut(pairs);
        for (i, d) in first.iter_mut().enumerate() {
            *d = load_one(i);
        }
        // SAFETY: an f32 is 4 plain bytes with no invalid bit pattern; the byte view
        // covers exactly `middle`, mutably borrowed while the view lives.
        let bytes = unsafe { std::slice::from_raw_parts_mut(middle.as_mut_ptr().cast::<u8>(), pairs * 4) };
        // SAFETY: elements `head .. head + pairs` are in bounds and valid for reads (as
        // above), and start 8-aligned, so `load_relaxed` loads whole 8-byte words only.
        unsafe { load_relaxed(base.add(head).cast::<u8>(), bytes) };
        for (i, d) in last.iter_mut().enumerate() {
            *d = load_one(head + pairs + i);
        }
        Ok(())
    }

    /// Copies bytes into the region (e.g. to fill a send source). Refused with
    /// [`Error::RegionBusy`] while a [`Lease`](super::Lease) covers any of those bytes.
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
    /// [`Error::RegionBusy`] while a [`Lease`](super::Lease) covers any of those bytes.
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
