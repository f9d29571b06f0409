//! The narrow, non-blocking Transport API, shaped like NCCL's net plugin
//! (`properties`, `listen`, `connect`, `accept`, `reg_mr`, `dereg_mr`,
//! `isend`, `iwrite`, `test`, `close`).
//!
//! # Progress model
//! A transport is driven by its owner's thread. No call blocks: `connect`
//! returns a [`ConnId`] at once and the handshake runs inside [`Transport::poll`];
//! `accept` answers `None` ("call again") until an authenticated peer is ready.
//! All I/O completes as [`Event`]s from `poll` (non-blocking) or `wait` (blocks
//! up to a timeout). A transport is `Send` but not `Sync`: move it to the
//! thread that drives it.
//!
//! # Ordering guarantees
//! Per connection:
//! 1. Messages ([`Transport::send`]) are delivered in the order they were posted,
//!    each exactly once, whole, or the connection fails.
//! 2. One-sided writes ([`Transport::write`]) are placed in the order they were
//!    posted. A `WriteReceived` event (writes with an immediate) means the whole
//!    payload of that write and of every earlier write on the connection is in
//!    the destination region.
//! 3. A `WriteDone` at the writer means the target placed the data (like an
//!    RDMA RC completion), not merely that it left this host.
//! 4. There is **no** ordering between messages and writes: a message posted
//!    after a write may arrive before the write lands. To say "data is ready",
//!    use the write's immediate.
//! 5. Completions of one class (sends, writes) arrive in posting order.
//!
//! # Limits
//! [`Properties::max_message_bytes`] bounds a message, [`Properties::max_write_bytes`]
//! one write, and [`Properties::max_outstanding`] the requests a connection may
//! have in flight; beyond it a post returns [`Error::WouldBlock`]
//! and the caller polls and retries.
//!
//! # Waking
//! [`Transport::waker`] hands out a [`Waker`] that any thread may call: a
//! `wait` in progress on the owner's thread returns promptly (possibly with no
//! event), or, when none is in progress, the next `wait` does. Wakes that
//! arrive before the owner's `wait` consumes them coalesce into one return. So
//! a runtime thread can sleep in `wait` with a long timeout and no busy polling
//! (`busy_poll` zero), and other threads wake it when they hand it work.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::memory::{Access, MemoryKind, PinnedBuffer, Region, RemoteRegion, Slice};

/// Names a connection within one transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Names a listener within one transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ListenerId(pub u64);

/// Names a posted request; completions carry it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReqId(pub u64);

/// What a transport can do (NCCL's `ncclNetProperties`).
#[derive(Debug, Clone)]
pub struct Properties {
    /// Backend name, e.g. `"tcp-io_uring"`.
    pub name: String,
    /// Link speed in Mbit/s, when known.
    pub speed_mbps: Option<u64>,
    /// Memory kinds that can be registered.
    pub memory_kinds: Vec<MemoryKind>,
    /// Largest message payload.
    pub max_message_bytes: usize,
    /// Largest single one-sided write.
    pub max_write_bytes: usize,
    /// Whether writes are truly one-sided (no remote CPU). False for TCP.
    pub one_sided: bool,
    /// Requests in flight per connection before posts answer `WouldBlock`.
    pub max_outstanding: usize,
}

/// Who the peer is, once authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's rank in the job.
    pub rank: u32,
    /// The peer's socket address.
    pub addr: SocketAddr,
}

/// A completion or notification from [`Transport::poll`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Event {
    /// An outbound connection finished its handshake and is ready.
    Connected { conn: ConnId, peer: PeerInfo },
    /// An inbound connection is authenticated; `accept` will return it.
    Incoming { listener: ListenerId, conn: ConnId },
    /// An inbound peer was refused (bad frame, wrong version, job or secret, timeout).
    /// It learned no region descriptor.
    PeerRejected {
        listener: ListenerId,
        addr: SocketAddr,
        error: Error,
    },
    /// The peer announced or revoked regions; see [`Transport::remote_regions`].
    RemoteRegionsChanged { conn: ConnId },
    /// A message was sent (its source slice may be reused).
    SendDone { conn: ConnId, req: ReqId, bytes: usize },
    /// A one-sided write was placed at the target (its source may be reused).
    WriteDone { conn: ConnId, req: ReqId, bytes: usize },
    /// A one-sided read (RDMA backend, `RdmaTransport::read`) filled its local destination.
    ReadDone { conn: ConnId, req: ReqId, bytes: usize },
    /// A posted operation failed; its source slice is released.
    OpFailed { conn: ConnId, req: ReqId, error: Error },
    /// A message arrived.
    Message { conn: ConnId, tag: u32, data: Vec<u8> },
    /// A peer's write with an immediate landed in a local region.
    WriteReceived {
        conn: ConnId,
        region: u32,
        offset: u64,
        len: u64,
        imm: u32,
    },
    /// A peer's write was refused and nothing was written (bounds, unknown region, access).
    WriteRejected { conn: ConnId, error: Error },
    /// The connection ended: `error` is `None` for a graceful close.
    Closed { conn: ConnId, error: Option<Error> },
}

/// The transport contract every backend implements.
pub trait Transport: Send {
    /// Capabilities of this backend.
    fn properties(&self) -> &Properties;

    /// Starts listening on `addr` (port 0 picks one). Never blocks.
    fn listen(&mut self, addr: SocketAddr) -> Result<ListenerId>;

    /// The address a listener is bound to.
    fn listener_addr(&self, listener: ListenerId) -> Result<SocketAddr>;

    /// Starts connecting. Returns at once; `Event::Connected` (or `Closed`
    /// with an error) follows from `poll`.
    fn connect(&mut self, addr: SocketAddr) -> Result<ConnId>;

    /// Returns an authenticated inbound connection, or `None`: call again after `poll`.
    fn accept(&mut self, listener: ListenerId) -> Result<Option<(ConnId, PeerInfo)>>;

    /// Registers pinned memory. Regions with `remote_write` are announced to
    /// every authenticated peer, now and on later connections.
    fn register(&mut self, buf: PinnedBuffer, access: Access) -> Result<Region>;

    /// Deregisters a region. Refused with `RegionBusy` while operations use it;
    /// peers are told, and later writes to it are rejected.
    fn deregister(&mut self, region: &Region) -> Result<()>;

    /// Regions the peer has announced and not revoked.
    fn remote_regions(&self, conn: ConnId) -> Result<Vec<RemoteRegion>>;

    /// Posts a message of `src`'s bytes, labelled `tag`. Zero-copy from the region.
    fn send(&mut self, conn: ConnId, src: &Slice, tag: u32) -> Result<ReqId>;

    /// Posts a one-sided write of `src` into `dst` at `dst_offset`. With
    /// `imm`, the target gets an `Event::WriteReceived` carrying it.
    fn write(
        &mut self,
        conn: ConnId,
        src: &Slice,
        dst: &RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> Result<ReqId>;

    /// Makes progress and appends up to `max` events. Never blocks.
    fn poll(&mut self, events: &mut Vec<Event>, max: usize) -> Result<usize>;

    /// Like `poll`, but blocks up to `timeout` for at least one event.
    fn wait(&mut self, events: &mut Vec<Event>, max: usize, timeout: Duration) -> Result<usize>;

    /// Starts a graceful close: queued work is flushed, then `Event::Closed` follows.
    fn close(&mut self, conn: ConnId) -> Result<()>;

    /// A handle that other threads use to end this transport's `wait` early
    /// (see [`Waker`]). Every call returns a handle to the same wake-up.
    fn waker(&self) -> Result<Waker>;

    /// Byte counters: payload placed straight into registered memory, bytes
    /// user space copied on receive (messages, control frames), and payload
    /// bytes sent (writes and messages: what this rank put on its NIC).
    fn counters(&self) -> Counters {
        Counters::default()
    }
}

/// Byte counters every backend can report (see [`Transport::counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes of peers' one-sided writes placed directly in registered regions.
    pub rx_direct_bytes: u64,
    /// Bytes user space copied on receive.
    pub rx_copied_bytes: u64,
    /// Payload bytes of this rank's writes and messages that went out (headers
    /// and framing not counted).
    pub tx_payload_bytes: u64,
    /// Send operations handed to the kernel or the NIC: a gathered `sendmsg`
    /// of several frames or writes counts once (io_uring TCP: SQEs; portable
    /// TCP: `sendmsg` calls that sent; RDMA: work requests). The runtime's
    /// per-message cost follows it more than the message count.
    pub tx_sends: u64,
}

/// Checks a write against the remote descriptor and the local source; shared by backends.
pub fn check_write(src: &Slice, dst: &RemoteRegion, dst_offset: u64, max: usize) -> Result<()> {
    if src.len() > max {
        return Err(Error::TooLarge {
            op: "write",
            len: src.len() as u64,
            max: max as u64,
        });
    }
    match dst_offset.checked_add(src.len() as u64) {
        Some(end) if end <= dst.len => Ok(()),
        _ => Err(Error::OutOfBounds {
            op: "write",
            region: dst.rkey,
            offset: dst_offset,
            len: src.len() as u64,
            region_len: dst.len,
        }),
    }
}

/// Ends a [`Transport::wait`] from any thread; see [`Transport::waker`].
///
/// After [`Waker::wake`], a `wait` in progress on the transport's thread
/// returns promptly, possibly with zero events; when no `wait` is in progress,
/// the next one returns promptly instead. Wakes coalesce: any number of them
/// before the owner's `wait` notices makes that `wait` return once. A wake
/// never makes [`Transport::poll`] return anything, and `poll` does not consume it.
///
/// A handle is cheap to clone, `Send` and `Sync`, and may outlive its
/// transport (waking then does nothing).
#[derive(Clone)]
pub struct Waker(pub(crate) Arc<WakeFd>);

impl Waker {
    /// Wakes the transport's `wait` (now, or the next one). Never blocks; costs
    /// one `write(2)` to an eventfd unless a wake is already pending or the
    /// owner's thread is not asleep (a backend that says when it sleeps: the
    /// io_uring TCP one); otherwise an atomic swap and a load.
    pub fn wake(&self) {
        self.0.wake();
    }
}

impl fmt::Debug for Waker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waker")
            .field("eventfd", &self.0.fd.as_raw_fd())
            .field("pending", &self.0.pending.load(Ordering::Relaxed))
            .finish()
    }
}

/// The eventfd behind a [`Waker`] and the flag that says a wake is pending.
///
/// The flag is the truth and the eventfd only the doorbell: a waker sets the
/// flag and, if it was clear, writes the eventfd; the owner's `wait` returns
/// when it [takes](WakeFd::take) a set flag, and sleeps (in io_uring or
/// `poll(2)`) with the eventfd among what ends the sleep. The owner drains the
/// eventfd whenever it is readable, so a write that lands after its flag was
/// taken costs at most one spurious wake-up of the sleep, never a return.
///
/// A backend may also say when its owner is awake ([`WakeFd::woke`],
/// [`WakeFd::may_sleep`]); a wake then rings the doorbell only while the owner
/// may be asleep, since an awake owner looks at the flag before it sleeps. The
/// two sides form the store-buffering pattern, all sequentially consistent: the
/// owner clears `awake` and then loads `pending`; a waker sets `pending` and
/// then loads `awake`. In the single order of those four operations, either
/// the owner sees the wake (and does not sleep) or the waker sees the owner
/// asleep (and writes the eventfd), so no wake is lost.
pub(crate) struct WakeFd {
    fd: OwnedFd,
    pending: AtomicBool,
    /// The owner is running and will look at `pending` before it sleeps. It
    /// starts false (a backend that never sets it gets a write on every wake).
    awake: AtomicBool,
}

impl fmt::Debug for WakeFd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WakeFd").field("fd", &self.fd.as_raw_fd()).finish()
    }
}

impl WakeFd {
    /// A non-blocking, close-on-exec eventfd with no wake pending.
    pub(crate) fn new() -> Result<Arc<WakeFd>> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::Io {
                op: "eventfd (waker)",
                peer: None,
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: eventfd just returned this descriptor and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Arc::new(WakeFd {
            fd,
            pending: AtomicBool::new(false),
            awake: AtomicBool::new(false),
        }))
    }

    /// The eventfd, readable while a doorbell is undrained.
    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    fn wake(&self) {
        if self.pending.swap(true, Ordering::SeqCst) {
            return; // already pending: whoever set it rings (or rang) the doorbell
        }
        if self.awake.load(Ordering::SeqCst) {
            return; // the owner looks at the flag before it sleeps (see the type's docs)
        }
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to our eventfd. EAGAIN
        // (the counter is saturated) means the doorbell is already ringing.
        unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// The owner's thread is running again (after a sleep, or from the start
    /// of a `wait`): wakes set the flag without ringing the doorbell until it
    /// next calls [`WakeFd::may_sleep`].
    pub(crate) fn woke(&self) {
        self.awake.store(true, Ordering::SeqCst);
    }

    /// Called by the owner right before it sleeps: false if a wake is pending
    /// (it must not sleep); true if it may, and every wake from now on rings
    /// the doorbell. After the sleep it calls [`WakeFd::woke`].
    pub(crate) fn may_sleep(&self) -> bool {
        self.awake.store(false, Ordering::SeqCst);
        if self.pending.load(Ordering::SeqCst) {
            self.awake.store(true, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Whether a wake is pending (not yet taken).
    pub(crate) fn is_pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Consumes a pending wake: true if there was one.
    pub(crate) fn take(&self) -> bool {
        self.pending.swap(false, Ordering::AcqRel)
    }

    /// Resets the eventfd's counter so it stops being readable (non-blocking).
    pub(crate) fn drain(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local buffer from our
        // non-blocking eventfd (EAGAIN when already drained).
        unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waker_is_send_sync_and_coalesces() {
        fn send_sync<T: Send + Sync + Clone + fmt::Debug>() {}
        send_sync::<Waker>();
        let w = Waker(WakeFd::new().unwrap());
        assert!(!w.0.is_pending());
        w.wake();
        w.clone().wake();
        assert!(w.0.is_pending());
        let mut pfd = libc::pollfd {
            fd: w.0.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 1, "the doorbell rang");
        assert!(w.0.take(), "one wake taken");
        assert!(!w.0.take(), "the second wake coalesced into the first");
        w.0.drain();
        pfd.revents = 0;
        // SAFETY: as above.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0, "drained");
    }
}
