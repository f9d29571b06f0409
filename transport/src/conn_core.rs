//! The connection core both TCP backends share: sans-IO pieces that the io_uring
//! backend ([`crate::tcp`]) and the portable backend ([`crate::portable`]) drive
//! with their own syscalls and submissions, as they drive [`crate::handshake`].
//!
//! - [`RegionTable`]: the locally registered regions, and every check made
//!   against them: a local source's registration (`send`, `write`), a
//!   `deregister`, and [`RegionTable::check_incoming`], the bounds, generation
//!   and access check of a peer's one-sided write.
//! - The admission checks of `send`, `write` and `register`, and
//!   `remote_regions`'s list.
//! - What the two queue and await: [`Payload`], [`TxFrame`], [`WriteReq`],
//!   [`AwaitAck`], and the control frames built from them.
//! - A peer's Ack, Nack and Regions frames applied to a connection's queues.
//! - Setup: the configuration checks, properties and socket options of `new`.
//! - Deadlines: which of a connection's has passed, the nearest one, and the
//!   sleeping tail of `wait`.
//! - [`Backend`]: what each backend lends (its configuration, regions, queues
//!   and counters), and on it the `Transport` calls' admission and queueing
//!   (`send`, `write`, `remote_regions`), region announcements and Nacks.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::api::{check_write, ConnId, Event, ListenerId, PeerInfo, Properties, ReqId, WakeFd};
use crate::auth;
use crate::error::{Error, FrameError, Result};
use crate::frame::{self, Header, Kind, HEADER_LEN};
use crate::memory::{InFlight, MemoryKind, PinnedBuffer, Region, RemoteRegion, Slice};
use crate::tcp::sys::SockOpts;
use crate::tcp::TcpConfig;

// ---------------------------------------------------------------- regions

/// The regions registered on one transport, by key.
#[derive(Default)]
pub(crate) struct RegionTable {
    regions: HashMap<u32, Region>,
}

impl RegionTable {
    pub(crate) fn len(&self) -> usize {
        self.regions.len()
    }

    /// A fresh random key: nonzero and not in use.
    pub(crate) fn new_key(&self) -> u32 {
        let mut key = auth::random_u32();
        while key == 0 || self.regions.contains_key(&key) {
            key = auth::random_u32();
        }
        key
    }

    pub(crate) fn insert(&mut self, r: Region) {
        self.regions.insert(r.key(), r);
    }

    /// Every region, taken out of the table (the io_uring backend leaks them at
    /// a drop whose ops did not drain).
    pub(crate) fn take_all(&mut self) -> Vec<(u32, Region)> {
        self.regions.drain().collect()
    }

    /// Whether `src` lies in a region registered here (this very registration,
    /// not a deregistered one's key reused).
    pub(crate) fn check_source(&self, src: &Slice, op: &'static str) -> Result<()> {
        let r = src.region();
        if !self.regions.get(&r.key()).is_some_and(|x| x.same(r)) {
            return Err(Error::UnknownRegion {
                op,
                region: r.key(),
                generation: r.generation(),
            });
        }
        Ok(())
    }

    /// `deregister`'s checks (registered here, nothing in flight), then the
    /// removal: the region is marked unregistered.
    pub(crate) fn deregister(&mut self, region: &Region) -> Result<()> {
        let known = self.regions.get(&region.key()).is_some_and(|r| r.same(region));
        crate::memory::check_deregister(known, region)?;
        self.regions.remove(&region.key());
        region.0.registered.store(false, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Checks a peer's one-sided write against the target region: the region
    /// (key and generation), its access (remote write), and the bounds
    /// (`offset + length` within the region, without overflow). Returns the region.
    pub(crate) fn check_incoming(&self, hdr: &Header) -> Result<Region> {
        let op = "incoming write";
        let r = self
            .regions
            .get(&hdr.region)
            .filter(|r| r.generation() == hdr.generation)
            .ok_or(Error::UnknownRegion {
                op,
                region: hdr.region,
                generation: hdr.generation,
            })?;
        if !r.access().remote_write {
            return Err(Error::AccessDenied {
                op,
                region: hdr.region,
                needed: "remote write",
            });
        }
        match hdr.offset.checked_add(hdr.length as u64) {
            Some(end) if end <= r.len() as u64 => Ok(r.clone()),
            _ => Err(Error::OutOfBounds {
                op,
                region: hdr.region,
                offset: hdr.offset,
                len: hdr.length as u64,
                region_len: r.len() as u64,
            }),
        }
    }

    /// The regions peers may write, sorted by key: what a new connection is told.
    pub(crate) fn announce_list(&self) -> Vec<RemoteRegion> {
        let mut l: Vec<_> = self
            .regions
            .values()
            .filter(|r| r.access().remote_write)
            .map(|r| r.remote())
            .collect();
        l.sort_by_key(|r| r.rkey);
        l
    }
}

// ---------------------------------------------------------------- connections

/// Which end of a connection this side is: the one that dialled, or the one that accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Client,
    Server,
}

/// Declares a backend's connection-state enum (unit variants) with `name()`:
/// each variant's own name, for errors and logs.
macro_rules! state_enum {
    ($(#[$m:meta])* $vis:vis enum $t:ident { $($(#[$vm:meta])* $v:ident,)* }) => {
        $(#[$m])*
        $vis enum $t {
            $($(#[$vm])* $v,)*
        }

        impl $t {
            pub(super) fn name(self) -> &'static str {
                match self {
                    $($t::$v => stringify!($v),)*
                }
            }
        }
    };
}
pub(crate) use state_enum;

// ---------------------------------------------------------------- setup

/// `new`'s check of `max_message_bytes`: in 1..=[`frame::MAX_MESSAGE_BYTES`].
pub(crate) fn check_max_message(cfg: &TcpConfig, op: &'static str) -> Result<()> {
    if cfg.max_message_bytes > frame::MAX_MESSAGE_BYTES as usize || cfg.max_message_bytes == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("max_message_bytes must be in 1..={}", frame::MAX_MESSAGE_BYTES),
        });
    }
    Ok(())
}

/// `new`'s check of `max_outstanding`: at least 1.
pub(crate) fn check_max_outstanding(cfg: &TcpConfig, op: &'static str) -> Result<()> {
    if cfg.max_outstanding == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: "max_outstanding must be > 0".into(),
        });
    }
    Ok(())
}

/// A TCP backend's properties (host memory, two-sided on the wire, the
/// configured caps), under `name`.
pub(crate) fn properties(cfg: &TcpConfig, name: &str) -> Properties {
    Properties {
        name: name.into(),
        speed_mbps: None,
        memory_kinds: vec![MemoryKind::Host],
        max_message_bytes: cfg.max_message_bytes,
        max_write_bytes: frame::MAX_WRITE_BYTES as usize,
        one_sided: false,
        max_outstanding: cfg.max_outstanding,
    }
}

/// The socket options `cfg` asks for.
pub(crate) fn sockopts(cfg: &TcpConfig) -> SockOpts {
    SockOpts {
        sndbuf: cfg.sndbuf_bytes,
        rcvbuf: cfg.rcvbuf_bytes,
        peer_timeout: cfg.peer_timeout,
    }
}

/// A peer's name in errors: its address and rank. Built only when an error or a
/// log line needs it, never on the hot path.
pub(crate) fn peer_name(addr: SocketAddr, rank: u32) -> String {
    format!("{addr} (rank {rank})")
}

// ---------------------------------------------------------------- admission

/// `register`'s length check: a region's offsets and lengths are `u32` on the wire.
pub(crate) fn check_register(buf: &PinnedBuffer) -> Result<()> {
    if buf.len() > u32::MAX as usize {
        return Err(Error::TooLarge {
            op: "register",
            len: buf.len() as u64,
            max: u32::MAX as u64,
        });
    }
    Ok(())
}

/// `send`'s checks on its source: registered here, and at most `max` bytes.
fn check_send(regions: &RegionTable, src: &Slice, max: usize) -> Result<()> {
    regions.check_source(src, "send")?;
    if src.len() > max {
        return Err(Error::TooLarge {
            op: "send",
            len: src.len() as u64,
            max: max as u64,
        });
    }
    Ok(())
}

/// `write`'s checks: the source registered here, then [`check_write`].
fn check_write_req(regions: &RegionTable, src: &Slice, dst: &RemoteRegion, dst_offset: u64) -> Result<()> {
    regions.check_source(src, "write")?;
    check_write(src, dst, dst_offset, frame::MAX_WRITE_BYTES as usize)
}

/// Takes one of a connection's `limit` outstanding requests, or refuses with
/// `WouldBlock` (back-pressure, not failure).
fn admit(outstanding: &mut usize, limit: usize, op: &'static str, conn: ConnId) -> Result<()> {
    if *outstanding >= limit {
        return Err(Error::WouldBlock {
            op,
            conn: conn.0,
            limit,
        });
    }
    *outstanding += 1;
    Ok(())
}

/// A connection's view of its peer's regions, sorted by key.
fn remote_list(remote: &HashMap<u32, RemoteRegion>) -> Vec<RemoteRegion> {
    let mut v: Vec<_> = remote.values().copied().collect();
    v.sort_by_key(|r| r.rkey);
    v
}

pub(crate) fn unknown_listener(op: &'static str, listener: ListenerId) -> Error {
    Error::UnknownListener {
        op,
        listener: listener.0,
    }
}

/// A connection lost: `peer` is its name where the connection is still known.
pub(crate) fn lost(conn: u64, peer: Option<String>, during: &'static str, source: Option<std::io::Error>) -> Error {
    Error::ConnectionLost {
        conn,
        peer: peer.unwrap_or_default(),
        during,
        source,
    }
}

/// How long one sleep of `wait` may last: to `end`, or just past the nearest deadline.
fn sleep_slice(end: Instant, deadline: Option<Instant>) -> Duration {
    let now = Instant::now();
    let mut slice = end.saturating_duration_since(now);
    if let Some(d) = deadline {
        slice = slice.min(d.saturating_duration_since(now) + Duration::from_millis(1));
    }
    slice
}

// ---------------------------------------------------------------- deadlines

/// Which of a connection's deadlines has passed at `now`, if any, as what timed
/// out and after how long: its own `deadline` (the graceful close's while
/// `closing`, else the handshake's), else its oldest unacknowledged write's
/// (sent at `oldest_ack`) `peer_timeout`.
pub(crate) fn expired(
    cfg: &TcpConfig,
    now: Instant,
    deadline: Option<Instant>,
    closing: bool,
    oldest_ack: Option<Instant>,
) -> Option<(&'static str, Duration)> {
    if deadline.is_some_and(|d| d <= now) {
        Some(if closing {
            ("graceful close", cfg.close_timeout)
        } else {
            ("handshake", cfg.handshake_timeout)
        })
    } else if oldest_ack.is_some_and(|since| now - since > cfg.peer_timeout) {
        Some(("write acknowledgement", cfg.peer_timeout))
    } else {
        None
    }
}

/// The earliest deadline of `conns` (each its own deadline and its oldest
/// unacknowledged write's send time) and of `pending` sockets' first frames:
/// when `check_deadlines` next has something to do.
pub(crate) fn nearest_deadline(
    cfg: &TcpConfig,
    conns: impl Iterator<Item = (Option<Instant>, Option<Instant>)> + Clone,
    pending: impl Iterator<Item = Instant>,
) -> Option<Instant> {
    let conn_d = conns.clone().filter_map(|(d, _)| d).min();
    let ack_d = conns.filter_map(|(_, a)| a.map(|since| since + cfg.peer_timeout)).min();
    let pend_d = pending.min();
    [conn_d, ack_d, pend_d].into_iter().flatten().min()
}

pub(crate) fn timeout(op: &'static str, peer: String, after: Duration) -> Error {
    Error::Timeout {
        op,
        peer,
        after_ms: after.as_millis() as u64,
    }
}

/// A pending socket's first frame did not come within `handshake_timeout`.
pub(crate) fn first_frame_timeout(cfg: &TcpConfig, addr: SocketAddr) -> Error {
    timeout("handshake (first frame)", addr.to_string(), cfg.handshake_timeout)
}

// ---------------------------------------------------------------- queued work

/// Payload of a queued control frame.
pub(crate) enum Payload {
    None,
    Owned(Vec<u8>),
    Region { slice: Slice, _guard: InFlight },
}

impl Payload {
    pub(crate) fn len(&self) -> usize {
        match self {
            Payload::None => 0,
            Payload::Owned(v) => v.len(),
            Payload::Region { slice, .. } => slice.len(),
        }
    }
    pub(crate) fn ptr(&self) -> *const u8 {
        match self {
            Payload::None => std::ptr::null(),
            Payload::Owned(v) => v.as_ptr(),
            Payload::Region { slice, .. } => slice.ptr(),
        }
    }
    /// A message's payload: the source slice, guarded in flight until sent.
    pub(crate) fn message(src: &Slice) -> Payload {
        Payload::Region {
            slice: src.clone(),
            _guard: InFlight::new(src.region()),
        }
    }
}

/// A queued control frame: its encoded header, its payload, and the user
/// request it completes (a `send`), if any.
pub(crate) struct TxFrame {
    pub(crate) hdr: [u8; HEADER_LEN],
    pub(crate) payload: Payload,
    pub(crate) req: Option<ReqId>,
}

impl TxFrame {
    /// The Ack of every write up to `seq`.
    pub(crate) fn ack(seq: u64) -> TxFrame {
        TxFrame {
            hdr: ack_header(seq).encode(),
            payload: Payload::None,
            req: None,
        }
    }

    /// The graceful close.
    pub(crate) fn close() -> TxFrame {
        TxFrame {
            hdr: Header::new(Kind::Close, 0).encode(),
            payload: Payload::None,
            req: None,
        }
    }
}

fn ack_header(seq: u64) -> Header {
    let mut h = Header::new(Kind::Ack, 0);
    h.seq = seq;
    h
}

/// The header of a message of `len` bytes with `tag`.
fn message_header(len: usize, tag: u32) -> Header {
    let mut h = Header::new(Kind::Message, len as u32);
    h.imm = tag;
    h
}

/// A queued one-sided write: its encoded header and its source, kept in flight.
pub(crate) struct WriteReq {
    pub(crate) req: ReqId,
    pub(crate) hdr: [u8; HEADER_LEN],
    pub(crate) src: Slice,
    pub(crate) guard: InFlight,
    pub(crate) seq: u64,
}

impl WriteReq {
    /// The write of `src` to `dst` at `dst_offset`, as the connection's `seq`th.
    pub(crate) fn new(
        req: ReqId,
        src: &Slice,
        dst: &RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
        seq: u64,
    ) -> WriteReq {
        let mut h = Header::new(Kind::Write, src.len() as u32);
        h.region = dst.rkey;
        h.generation = dst.generation;
        h.offset = dst_offset;
        h.seq = seq;
        if let Some(i) = imm {
            h.imm = i;
            h.flags |= frame::FLAG_IMM;
        }
        WriteReq {
            req,
            hdr: h.encode(),
            src: src.clone(),
            guard: InFlight::new(src.region()),
            seq,
        }
    }
}

/// A write sent whole, waiting for the peer's Ack or Nack.
pub(crate) struct AwaitAck {
    pub(crate) seq: u64,
    pub(crate) req: ReqId,
    pub(crate) bytes: usize,
    pub(crate) _guard: InFlight,
    pub(crate) since: Instant,
}

impl AwaitAck {
    pub(crate) fn new(w: WriteReq, since: Instant) -> AwaitAck {
        AwaitAck {
            seq: w.seq,
            req: w.req,
            bytes: w.src.len(),
            _guard: w.guard,
            since,
        }
    }
}

// ---------------------------------------------------------------- peer frames

/// A peer's Ack of every write up to `seq`: each such write awaiting it is done.
pub(crate) fn on_ack(
    awaiting: &mut VecDeque<AwaitAck>,
    outstanding: &mut usize,
    conn: u64,
    seq: u64,
    events: &mut VecDeque<Event>,
) {
    while awaiting.front().is_some_and(|a| a.seq <= seq) {
        let a = awaiting.pop_front().expect("front");
        *outstanding -= 1;
        events.push_back(Event::WriteDone {
            conn: ConnId(conn),
            req: a.req,
            bytes: a.bytes,
        });
    }
}

/// A peer's Nack of write `seq`: if it awaits its Ack, it fails with the
/// peer's reason. Returns whether it did.
pub(crate) fn on_nack(
    awaiting: &mut VecDeque<AwaitAck>,
    outstanding: &mut usize,
    conn: u64,
    seq: u64,
    payload: &[u8],
    events: &mut VecDeque<Event>,
) -> bool {
    let Some(i) = awaiting.iter().position(|a| a.seq == seq) else {
        return false;
    };
    let a = awaiting.remove(i).expect("index valid");
    *outstanding -= 1;
    events.push_back(Event::OpFailed {
        conn: ConnId(conn),
        req: a.req,
        error: Error::RemoteAccess {
            conn,
            seq,
            reason: frame::decode_reason(payload),
        },
    });
    true
}

/// A peer's Regions frame (an announcement, or with `FLAG_REVOKE` a revocation)
/// applied to the connection's view of the peer's regions.
pub(crate) fn on_regions(
    remote: &mut HashMap<u32, RemoteRegion>,
    conn: u64,
    hdr: &Header,
    payload: &[u8],
    events: &mut VecDeque<Event>,
) -> std::result::Result<(), FrameError> {
    let list = frame::decode_regions(payload)?;
    for r in list {
        if hdr.flags & frame::FLAG_REVOKE != 0 {
            remote.remove(&r.rkey);
        } else {
            remote.insert(r.rkey, r);
        }
    }
    events.push_back(Event::RemoteRegionsChanged { conn: ConnId(conn) });
    Ok(())
}

/// Decodes a data socket's header: only a `Write` may come there.
pub(crate) fn decode_data_header(raw: &[u8; HEADER_LEN], peer: impl FnOnce() -> String) -> Result<Header> {
    match Header::decode(raw) {
        Ok(h) if h.kind == Kind::Write => Ok(h),
        Ok(h) => Err(Error::BadFrame {
            peer: peer(),
            reason: FrameError::Unexpected {
                kind: h.kind.name(),
                state: "DataSocket",
            },
        }),
        Err(reason) => Err(Error::BadFrame { peer: peer(), reason }),
    }
}

/// The event of a write placed in a region, where it carries an immediate.
pub(crate) fn write_received(conn: u64, hdr: &Header) -> Option<Event> {
    (hdr.flags & frame::FLAG_IMM != 0).then(|| Event::WriteReceived {
        conn: ConnId(conn),
        region: hdr.region,
        offset: hdr.offset,
        len: hdr.length as u64,
        imm: hdr.imm,
    })
}

// ---------------------------------------------------------------- the backend

/// A ready connection's admission counters, lent by its backend.
pub(crate) struct Admission<'a> {
    pub(crate) outstanding: &'a mut usize,
    pub(crate) next_write_seq: &'a mut u64,
}

/// What a backend lends the shared connection logic: its configuration, its
/// region table, its queues and its connections' counters. The logic itself
/// (the `Transport` calls' admission, region announcements, Nacks) is the
/// trait's provided methods; the backends only move the bytes.
pub(crate) trait Backend {
    fn cfg(&self) -> &TcpConfig;
    fn regions(&self) -> &RegionTable;
    fn events(&mut self) -> &mut VecDeque<Event>;
    /// The next user request id (taken only once a request is admitted).
    fn next_req(&mut self) -> &mut u64;
    /// A connection's counters, if it is Ready: `UnknownConnection` if it is
    /// gone or closing, `NotConnected` while its handshake runs.
    fn admission(&mut self, conn: ConnId, op: &'static str) -> Result<Admission<'_>>;
    /// A connection's view of its peer's regions (`UnknownConnection` if gone).
    fn remote_of(&self, conn: ConnId, op: &'static str) -> Result<&HashMap<u32, RemoteRegion>>;
    /// The control queue of `conn`, if it is still there.
    fn ctrl_queue(&mut self, conn: u64) -> Option<&mut VecDeque<TxFrame>>;
    /// The write queue of `conn` (admitted, so it is there).
    fn write_queue(&mut self, conn: u64) -> &mut VecDeque<WriteReq>;
    /// Marks `conn` as having output to send.
    fn set_dirty(&mut self, conn: u64);
    /// The connections that are established (Ready).
    fn ready_conns(&self) -> Vec<u64>;
    /// The [`Waker`](crate::Waker)'s eventfd and flag.
    fn wake_fd(&self) -> &WakeFd;
    /// One turn of the backend's loop, sleeping up to `timeout` (in
    /// `io_uring_enter` or `epoll_wait`) for a completion or readiness, the
    /// waker's among them.
    fn turn(&mut self, timeout: Duration) -> Result<()>;
    /// The nearest deadline (handshake, close, unacknowledged write, first frame).
    fn next_deadline(&self) -> Option<Instant>;

    /// Moves up to `max` queued events into `out`; returns how many.
    fn drain_events(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        let events = self.events();
        let n = events.len().min(max);
        out.extend(events.drain(..n));
        n
    }

    /// The rest of [`Transport::wait`](crate::Transport::wait), after the
    /// backend's busy-poll: returns at once if an event or a wake is in, else
    /// sleeps in turns (each until the nearest deadline at most) until one is,
    /// or until `end`. Any return consumes a pending wake: the caller has
    /// control again.
    fn wait_rest(&mut self, out: &mut Vec<Event>, max: usize, end: Instant) -> Result<usize> {
        if !self.events().is_empty() || self.wake_fd().take() {
            self.wake_fd().take();
            return Ok(self.drain_events(out, max));
        }
        loop {
            let slice = sleep_slice(end, self.next_deadline());
            self.turn(slice)?;
            if !self.events().is_empty() || self.wake_fd().take() || Instant::now() >= end {
                self.wake_fd().take();
                return Ok(self.drain_events(out, max));
            }
        }
    }

    /// Queues one control frame on `conn` (nothing if it is gone).
    fn queue_ctrl(&mut self, conn: u64, hdr: Header, payload: Payload, req: Option<ReqId>) {
        if let Some(q) = self.ctrl_queue(conn) {
            q.push_back(TxFrame {
                hdr: hdr.encode(),
                payload,
                req,
            });
            self.set_dirty(conn);
        }
    }

    /// [`Transport::send`](crate::Transport::send): the source registered here
    /// and within the message cap, the connection Ready and under its
    /// outstanding bound; then the message is queued.
    fn core_send(&mut self, conn: ConnId, src: &Slice, tag: u32) -> Result<ReqId> {
        check_send(self.regions(), src, self.cfg().max_message_bytes)?;
        let limit = self.cfg().max_outstanding;
        let a = self.admission(conn, "send")?;
        admit(a.outstanding, limit, "send", conn)?;
        let req = take_req(self.next_req());
        let h = message_header(src.len(), tag);
        self.queue_ctrl(conn.0, h, Payload::message(src), Some(req));
        Ok(req)
    }

    /// [`Transport::write`](crate::Transport::write): the source registered
    /// here, the write within the remote region and the write cap, the
    /// connection Ready and under its outstanding bound; then the write is
    /// queued with the connection's next sequence number.
    fn core_write(
        &mut self,
        conn: ConnId,
        src: &Slice,
        dst: &RemoteRegion,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> Result<ReqId> {
        check_write_req(self.regions(), src, dst, dst_offset)?;
        let limit = self.cfg().max_outstanding;
        let a = self.admission(conn, "write")?;
        admit(a.outstanding, limit, "write", conn)?;
        let seq = *a.next_write_seq;
        *a.next_write_seq += 1;
        let req = take_req(self.next_req());
        self.write_queue(conn.0)
            .push_back(WriteReq::new(req, src, dst, dst_offset, imm, seq));
        self.set_dirty(conn.0);
        Ok(req)
    }

    /// [`Transport::remote_regions`](crate::Transport::remote_regions).
    fn core_remote_regions(&self, conn: ConnId) -> Result<Vec<RemoteRegion>> {
        Ok(remote_list(self.remote_of(conn, "remote_regions")?))
    }

    /// Announces (or revokes) `list` to `conn`; nothing if it is empty.
    fn send_regions(&mut self, conn: u64, list: &[RemoteRegion], revoke: bool) {
        if list.is_empty() {
            return;
        }
        let body = frame::encode_regions(list);
        let mut h = Header::new(Kind::Regions, body.len() as u32);
        if revoke {
            h.flags |= frame::FLAG_REVOKE;
        }
        self.queue_ctrl(conn, h, Payload::Owned(body), None);
    }

    /// A region registered (or, with `revoke`, deregistered): if peers may
    /// write it, every established connection is told.
    fn broadcast_regions(&mut self, r: &Region, revoke: bool) {
        if !r.access().remote_write {
            return;
        }
        let r = r.remote();
        for c in self.ready_conns() {
            self.send_regions(c, &[r], revoke);
        }
    }

    /// A connection became Ready: the peer is told this side's regions, and
    /// the application hears `Connected`.
    fn on_established(&mut self, conn: u64, peer: PeerInfo) {
        let list = self.regions().announce_list();
        self.send_regions(conn, &list, false);
        self.events().push_back(Event::Connected {
            conn: ConnId(conn),
            peer,
        });
    }

    /// Queues the Nack of rejected write `seq`, after the Ack `ack` of every
    /// write placed before it (the connection's pending one, taken by the caller).
    fn queue_nack(&mut self, conn: u64, ack: Option<u64>, seq: u64, reason: String) {
        if let Some(a) = ack {
            self.queue_ctrl(conn, ack_header(a), Payload::None, None);
        }
        let body = reason.into_bytes();
        let mut h = Header::new(Kind::Nack, body.len() as u32);
        h.seq = seq;
        self.queue_ctrl(conn, h, Payload::Owned(body), None);
    }
}

fn take_req(next: &mut u64) -> ReqId {
    let req = ReqId(*next);
    *next += 1;
    req
}

/// Implements [`Backend`] for a backend's transport type. Both backends name
/// the lent parts alike (the fields `cfg`, `regions`, `events`, `next_req`,
/// `conns` and `wake`; a connection's `id`, `state`, `outstanding`,
/// `next_write_seq`, `remote`, `ctrl_tx` and `data_tx`; the methods
/// `ready_conn`, `mark_dirty`, `progress` and `nearest_deadline`), so one impl
/// serves both; paths in it resolve where it is expanded (`State` is the
/// backend's own).
macro_rules! impl_backend {
    ($t:ty) => {
        impl $crate::conn_core::Backend for $t {
            fn cfg(&self) -> &$crate::tcp::TcpConfig {
                &self.cfg
            }
            fn regions(&self) -> &$crate::conn_core::RegionTable {
                &self.regions
            }
            fn events(&mut self) -> &mut std::collections::VecDeque<$crate::api::Event> {
                &mut self.events
            }
            fn next_req(&mut self) -> &mut u64 {
                &mut self.next_req
            }
            fn admission(
                &mut self,
                conn: $crate::api::ConnId,
                op: &'static str,
            ) -> $crate::error::Result<$crate::conn_core::Admission<'_>> {
                let c = self.ready_conn(conn, op)?;
                Ok($crate::conn_core::Admission {
                    outstanding: &mut c.outstanding,
                    next_write_seq: &mut c.next_write_seq,
                })
            }
            fn remote_of(
                &self,
                conn: $crate::api::ConnId,
                op: &'static str,
            ) -> $crate::error::Result<&std::collections::HashMap<u32, $crate::memory::RemoteRegion>> {
                let c = self.conns.get(&conn.0);
                Ok(&c
                    .ok_or($crate::error::Error::UnknownConnection { op, conn: conn.0 })?
                    .remote)
            }
            fn ctrl_queue(&mut self, conn: u64) -> Option<&mut std::collections::VecDeque<$crate::conn_core::TxFrame>> {
                self.conns.get_mut(&conn).map(|c| &mut c.ctrl_tx)
            }
            fn write_queue(&mut self, conn: u64) -> &mut std::collections::VecDeque<$crate::conn_core::WriteReq> {
                &mut self.conns.get_mut(&conn).expect("admitted").data_tx
            }
            fn set_dirty(&mut self, conn: u64) {
                self.mark_dirty(conn);
            }
            fn ready_conns(&self) -> Vec<u64> {
                let ready = self.conns.values().filter(|c| c.state == State::Ready);
                ready.map(|c| c.id).collect()
            }
            fn wake_fd(&self) -> &$crate::api::WakeFd {
                &self.wake
            }
            fn turn(&mut self, timeout: std::time::Duration) -> $crate::error::Result<()> {
                self.progress(Some(timeout))
            }
            fn next_deadline(&self) -> Option<std::time::Instant> {
                self.nearest_deadline()
            }
        }
    };
}
pub(crate) use impl_backend;

/// The [`Transport`](crate::Transport) methods both backends implement alike
/// (on [`Backend`] and the fields `props`, `listeners` and `wake`), expanded
/// inside each backend's `impl Transport`: `properties`, `listener_addr`,
/// `accept`, `remote_regions`, `send`, `write` and `waker`.
macro_rules! transport_common {
    () => {
        fn properties(&self) -> &$crate::api::Properties {
            &self.props
        }

        fn listener_addr(&self, listener: $crate::api::ListenerId) -> $crate::error::Result<std::net::SocketAddr> {
            let l = self.listeners.get(&listener.0);
            l.map(|l| l.addr)
                .ok_or($crate::conn_core::unknown_listener("listener_addr", listener))
        }

        fn accept(
            &mut self,
            listener: $crate::api::ListenerId,
        ) -> $crate::error::Result<Option<($crate::api::ConnId, $crate::api::PeerInfo)>> {
            let l = self.listeners.get_mut(&listener.0);
            Ok(l.ok_or($crate::conn_core::unknown_listener("accept", listener))?
                .accepted
                .pop_front())
        }

        fn remote_regions(
            &self,
            conn: $crate::api::ConnId,
        ) -> $crate::error::Result<Vec<$crate::memory::RemoteRegion>> {
            $crate::conn_core::Backend::core_remote_regions(self, conn)
        }

        fn send(
            &mut self,
            conn: $crate::api::ConnId,
            src: &$crate::memory::Slice,
            tag: u32,
        ) -> $crate::error::Result<$crate::api::ReqId> {
            $crate::conn_core::Backend::core_send(self, conn, src, tag)
        }

        fn write(
            &mut self,
            conn: $crate::api::ConnId,
            src: &$crate::memory::Slice,
            dst: &$crate::memory::RemoteRegion,
            dst_offset: u64,
            imm: Option<u32>,
        ) -> $crate::error::Result<$crate::api::ReqId> {
            $crate::conn_core::Backend::core_write(self, conn, src, dst, dst_offset, imm)
        }

        fn waker(&self) -> $crate::error::Result<$crate::api::Waker> {
            Ok($crate::api::Waker(std::sync::Arc::clone(&self.wake)))
        }
    };
}
pub(crate) use transport_common;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::Kind;
    use crate::memory::Access;

    fn table(len: usize) -> (RegionTable, Region, Region) {
        let mut t = RegionTable::default();
        let w = Region::new(PinnedBuffer::new(len).unwrap(), 7, 3, Access::REMOTE_WRITE, None);
        let l = Region::new(PinnedBuffer::new(len).unwrap(), 9, 3, Access::LOCAL, None);
        t.insert(w.clone());
        t.insert(l.clone());
        (t, w, l)
    }

    fn write(region: u32, generation: u32, offset: u64, length: u32) -> Header {
        let mut h = Header::new(Kind::Write, length);
        h.region = region;
        h.generation = generation;
        h.offset = offset;
        h
    }

    #[test]
    fn incoming_writes_are_checked_for_region_generation_access_and_bounds() {
        let (t, w, _) = table(4096);
        // In bounds, to the last byte.
        assert!(t.check_incoming(&write(7, 3, 0, 4096)).unwrap().same(&w));
        assert!(t.check_incoming(&write(7, 3, 4095, 1)).is_ok());
        assert!(t.check_incoming(&write(7, 3, 4096, 0)).is_ok());
        // An unknown key, or the right key of another generation.
        assert!(matches!(
            t.check_incoming(&write(8, 3, 0, 1)),
            Err(Error::UnknownRegion {
                region: 8,
                generation: 3,
                ..
            })
        ));
        assert!(matches!(
            t.check_incoming(&write(7, 4, 0, 1)),
            Err(Error::UnknownRegion {
                region: 7,
                generation: 4,
                ..
            })
        ));
        // A local region is never a peer's to write, however small the write.
        assert!(matches!(
            t.check_incoming(&write(9, 3, 0, 0)),
            Err(Error::AccessDenied { region: 9, .. })
        ));
        // One byte past the end, and an offset that wraps u64 with the length.
        assert!(matches!(
            t.check_incoming(&write(7, 3, 4095, 2)),
            Err(Error::OutOfBounds {
                offset: 4095,
                len: 2,
                region_len: 4096,
                ..
            })
        ));
        assert!(matches!(
            t.check_incoming(&write(7, 3, u64::MAX - 1, 4)),
            Err(Error::OutOfBounds { .. })
        ));
    }

    #[test]
    fn a_deregistered_region_is_no_source_and_takes_no_writes() {
        let (mut t, w, _) = table(64);
        let src = w.slice(0, 64).unwrap();
        assert!(t.check_source(&src, "send").is_ok());
        t.deregister(&w).unwrap();
        assert!(matches!(
            t.check_source(&src, "send"),
            Err(Error::UnknownRegion { op: "send", .. })
        ));
        assert!(matches!(
            t.check_incoming(&write(7, 3, 0, 1)),
            Err(Error::UnknownRegion { .. })
        ));
        // A second deregistration is refused, not a silent success.
        assert!(t.deregister(&w).is_err());
        // The remote-writable regions announced: only those left.
        assert!(t.announce_list().is_empty());
    }
}
