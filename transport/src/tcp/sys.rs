//! Socket plumbing for the TCP backend: raw sockets, options, address
//! conversion, and the provided-buffer ring. The only `unsafe` of the TCP
//! backend outside its op table lives here.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use io_uring::types::BufRingEntry;
use io_uring::IoUring;

use crate::error::{Error, Result};
use crate::memory::{PinOptions, PinnedBuffer};

/// The error of a failed CQE (`res` is `-errno`).
pub(crate) fn errno(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

/// Socket tuning shared by both ends.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SockOpts {
    pub sndbuf: Option<usize>,
    pub rcvbuf: Option<usize>,
    pub peer_timeout: Duration,
}

fn setsockopt_int(fd: RawFd, level: i32, name: i32, val: i32, what: &'static str) -> Result<()> {
    // SAFETY: `val` is a valid i32 for the duration of the call; the length matches.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&val as *const i32).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(Error::Io {
            op: what,
            peer: None,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Applies TCP_NODELAY, buffer sizes, keepalive and TCP_USER_TIMEOUT so a
/// vanished peer is detected within `peer_timeout`.
pub(crate) fn tune(fd: RawFd, o: &SockOpts) -> Result<()> {
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1, "setsockopt(TCP_NODELAY)")?;
    if let Some(b) = o.sndbuf {
        setsockopt_int(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            b.min(i32::MAX as usize) as i32,
            "setsockopt(SO_SNDBUF)",
        )?;
    }
    if let Some(b) = o.rcvbuf {
        setsockopt_int(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            b.min(i32::MAX as usize) as i32,
            "setsockopt(SO_RCVBUF)",
        )?;
    }
    let ms = o.peer_timeout.as_millis().clamp(1000, i32::MAX as u128) as i32;
    setsockopt_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        ms,
        "setsockopt(TCP_USER_TIMEOUT)",
    )?;
    setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1, "setsockopt(SO_KEEPALIVE)")?;
    let idle = (ms / 3000).max(1);
    setsockopt_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPIDLE,
        idle,
        "setsockopt(TCP_KEEPIDLE)",
    )?;
    setsockopt_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        idle,
        "setsockopt(TCP_KEEPINTVL)",
    )?;
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3, "setsockopt(TCP_KEEPCNT)")?;
    Ok(())
}

/// A new TCP socket of `addr`'s family, close-on-exec, blocking (io_uring polls it).
pub(crate) fn socket_for(addr: &SocketAddr) -> Result<OwnedFd> {
    let fam = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2) call with constant arguments.
    let fd = unsafe { libc::socket(fam, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Error::Io {
            op: "socket",
            peer: Some(*addr),
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `shutdown(2)` both directions; errors (already closed) are ignored.
pub(crate) fn shutdown(fd: &OwnedFd, how: i32) {
    // SAFETY: the fd is valid while `fd` is borrowed.
    unsafe { libc::shutdown(fd.as_raw_fd(), how) };
}

/// A sockaddr in storage with its length, kept alive for a Connect op.
pub(crate) struct SockAddr {
    pub storage: libc::sockaddr_storage,
    pub len: libc::socklen_t,
}

impl SockAddr {
    pub fn from_std(a: &SocketAddr) -> Box<SockAddr> {
        // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
        let mut s: libc::sockaddr_storage = unsafe { zeroed() };
        let len = match a {
            SocketAddr::V4(v4) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: v4.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(v4.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
                unsafe { std::ptr::write((&mut s as *mut libc::sockaddr_storage).cast(), sin) };
                size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(v6) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: v6.port().to_be(),
                    sin6_flowinfo: v6.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: v6.ip().octets(),
                    },
                    sin6_scope_id: v6.scope_id(),
                };
                // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
                unsafe { std::ptr::write((&mut s as *mut libc::sockaddr_storage).cast(), sin6) };
                size_of::<libc::sockaddr_in6>()
            }
        };
        Box::new(SockAddr {
            storage: s,
            len: len as libc::socklen_t,
        })
    }
}

/// The peer address of a connected socket.
pub(crate) fn peer_addr(fd: RawFd) -> Option<SocketAddr> {
    // SAFETY: zeroed storage is valid; getpeername writes at most `len` bytes into it.
    let mut s: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: pointers are valid for the call; `len` holds the storage size.
    let rc = unsafe { libc::getpeername(fd, (&mut s as *mut libc::sockaddr_storage).cast(), &mut len) };
    if rc != 0 {
        return None;
    }
    match s.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin: libc::sockaddr_in = unsafe { std::ptr::read((&s as *const libc::sockaddr_storage).cast()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                u32::from_be(sin.sin_addr.s_addr).into(),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6: libc::sockaddr_in6 = unsafe { std::ptr::read((&s as *const libc::sockaddr_storage).cast()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                sin6.sin6_addr.s6_addr.into(),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// A provided-buffer ring (`IORING_REGISTER_PBUF_RING`) for multishot receives.
///
/// `count` buffers of `size` bytes each. The kernel picks a buffer per
/// completion; the owner copies the bytes out and gives the buffer back.
pub(crate) struct BufRing {
    ring_mem: PinnedBuffer,
    bufs: PinnedBuffer,
    count: u16,
    size: u32,
    tail: u16,
    pub bgid: u16,
}

impl BufRing {
    pub fn new(uring: &IoUring, count: u16, size: u32, bgid: u16) -> Result<Self> {
        assert!(count.is_power_of_two() && count > 0);
        let no_lock = PinOptions {
            lock: false,
            ..PinOptions::default()
        };
        let ring_mem = PinnedBuffer::with_options(count as usize * size_of::<BufRingEntry>(), no_lock)?;
        let bufs = PinnedBuffer::with_options(count as usize * size as usize, no_lock)?;
        // SAFETY: `ring_mem` is page-aligned, large enough for `count` entries, and is
        // kept alive in `self` until after the ring is unregistered or the io_uring
        // instance is dropped (the transport drops its IoUring before its BufRing).
        unsafe {
            uring
                .submitter()
                .register_buf_ring_with_flags(ring_mem.as_ptr() as u64, count, bgid, 0)
        }
        .map_err(|e| Error::UringUnavailable {
            reason: "registering a provided-buffer ring (needs Linux 5.19+)".into(),
            source: Some(e),
        })?;
        let mut r = BufRing {
            ring_mem,
            bufs,
            count,
            size,
            tail: 0,
            bgid,
        };
        for bid in 0..count {
            r.push(bid);
        }
        r.publish();
        Ok(r)
    }

    fn entries(&self) -> *mut BufRingEntry {
        self.ring_mem.as_ptr() as *mut BufRingEntry
    }

    /// Queues buffer `bid` for the kernel; visible after `publish`.
    pub fn push(&mut self, bid: u16) {
        let idx = (self.tail & (self.count - 1)) as usize;
        // SAFETY: idx < count, so the entry lies inside `ring_mem`. The kernel only reads
        // entries between its head and our published tail, and this slot is outside
        // that window until `publish`.
        let e = unsafe { &mut *self.entries().add(idx) };
        // SAFETY: bid < count, so the buffer lies inside `bufs`.
        e.set_addr(unsafe { self.bufs.as_ptr().add(bid as usize * self.size as usize) } as u64);
        e.set_len(self.size);
        e.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes pushed buffers visible to the kernel.
    pub fn publish(&mut self) {
        // SAFETY: the tail field lies in entry 0 of the live ring; the kernel reads it
        // with acquire semantics, so a release store publishes the entries written before.
        let tail = unsafe { &*(BufRingEntry::tail(self.entries()) as *const AtomicU16) };
        tail.store(self.tail, Ordering::Release);
    }

    /// Where the bytes of buffer `bid` that a completion filled lie: for a caller
    /// that reads them while it mutates the transport (it must not push `bid`
    /// back before its last read).
    pub fn raw(&self, bid: u16, len: usize) -> (*const u8, usize) {
        assert!(bid < self.count, "buffer id {bid} from the kernel is outside the ring");
        let start = bid as usize * self.size as usize;
        let len = len.min(self.size as usize);
        // SAFETY: bid < count, so `start` lies inside `bufs`.
        (unsafe { self.bufs.as_ptr().add(start) }, len)
    }
}
