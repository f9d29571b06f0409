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
//!
//! # Modules
//! - `pinned`: [`PinnedBuffer`] and its options ([`PinOptions`], [`HugePages`]):
//!   the anonymous mapping (or caller-owned memory), locking and its accounting.
//! - `region`: [`Region`] (registered memory, its identity and the copies in
//!   and out) and [`Slice`], the source of a send or a write.
//! - `lease`: [`Lease`] (exclusive local access to a range, and
//!   [`Region::lease`] that takes one), the in-flight guard of an operation
//!   and the deregistration check the backends share.
//!
//! Here: what peers and backends see of a region ([`Access`], [`MemoryKind`],
//! [`RemoteRegion`]), the page size and the memlock limit, and the relaxed
//! copy that reads memory a device may be writing.

mod lease;
mod pinned;
mod region;

pub use lease::Lease;
pub(crate) use lease::{check_deregister, InFlight};
pub use pinned::{HugePages, PinOptions, PinnedBuffer};
pub use region::{Region, Slice};

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

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

/// Copies `dst.len()` bytes starting at `src` with relaxed atomic loads: single
/// bytes up to 8-byte alignment, then 8 bytes at a time, then the tail.
///
/// # Safety
/// `src .. src + dst.len()` must be valid for reads for the whole call, and no
/// Rust code may write it non-atomically meanwhile (device and kernel writes are
/// outside the Rust memory model: they can only tear values). `dst` must not
/// overlap it.
unsafe fn load_relaxed(src: *const u8, dst: &mut [u8]) {
    // Three loops, not one with a branch per word: the word loop then runs at
    // 4.4 ms for 21 MB copied and summed, against 6.1 for the branching loop and
    // 5.1 for one 4-byte load per float (2-core VM, out of the caches).
    let n = dst.len();
    let head = src.align_offset(8).min(n);
    let (first, rest) = dst.split_at_mut(head);
    for (i, d) in first.iter_mut().enumerate() {
        // SAFETY: `src + i` lies in the range the caller makes valid for reads and
        // free of non-atomic Rust writes; a byte needs no alignment.
        *d = unsafe { AtomicU8::from_ptr(src.add(i).cast_mut()) }.load(Ordering::Relaxed);
    }
    let words = src.wrapping_add(head).cast::<u64>();
    let mut chunks = rest.chunks_exact_mut(8);
    for (k, c) in (&mut chunks).enumerate() {
        // SAFETY: `words + k` is 8-aligned (`head` aligns it) and its 8 bytes lie in
        // the range (a whole chunk of `rest`), valid for reads as above.
        let v = unsafe { AtomicU64::from_ptr(words.add(k).cast_mut()) }.load(Ordering::Relaxed);
        c.copy_from_slice(&v.to_ne_bytes());
    }
    let tail = chunks.into_remainder();
    let at = n - tail.len();
    for (i, d) in tail.iter_mut().enumerate() {
        // SAFETY: `src + at + i` lies in the range (the last bytes of `dst`'s length).
        *d = unsafe { AtomicU8::from_ptr(src.add(at + i).cast_mut()) }.load(Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
