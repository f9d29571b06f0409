//! The transport conformance suite: one set of behaviours every backend must
//! show. A backend's test file implements [`Backend`] and expands
//! `conformance_suite!(ItsBackend)`, which makes one `#[test]` per case.
//!
//! Every wait is bounded (`pump` panics after its deadline), so a broken
//! backend fails a test rather than hanging it.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tidewire_transport::frame::{self, Header, Kind};
use tidewire_transport::{
    Access, ConnId, Error, Event, ListenerId, PinOptions, PinnedBuffer, Region, RemoteRegion, Transport,
};

pub const JOB: u64 = 0x7e57;
pub const SECRET: &[u8] = b"conformance-secret";

/// Knobs a case may need.
#[derive(Debug, Clone)]
pub struct Opts {
    pub rank: u32,
    pub secret: Vec<u8>,
    pub job_id: u64,
    pub handshake_timeout: Duration,
    pub max_outstanding: usize,
    /// `busy_poll` of `wait` (the control plane's for RDMA); `None` keeps the backend's default.
    pub busy_poll: Option<Duration>,
    /// The message cap (`Properties::max_message_bytes`); `None` keeps the backend's default.
    pub max_message_bytes: Option<usize>,
}

impl Opts {
    pub fn rank(rank: u32) -> Self {
        Opts {
            rank,
            secret: SECRET.to_vec(),
            job_id: JOB,
            handshake_timeout: Duration::from_secs(5),
            max_outstanding: 256,
            busy_poll: None,
            max_message_bytes: None,
        }
    }
}

/// How a backend makes transports for the suite.
pub trait Backend {
    type T: Transport;
    fn make(o: &Opts) -> Self::T;
    fn listen_addr() -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }
    /// Why this backend cannot run here (printed, and the case returns), or `None`.
    fn skip() -> Option<String> {
        None
    }
}

/// A pinned buffer; falls back to unlocked memory, loudly, when RLIMIT_MEMLOCK is low.
pub fn buf(len: usize) -> PinnedBuffer {
    match PinnedBuffer::new(len) {
        Ok(b) => b,
        Err(e @ Error::MemlockLimit { .. }) => {
            eprintln!("NOTE: {e}; this test uses unlocked memory instead");
            PinnedBuffer::with_options(
                len,
                PinOptions {
                    lock: false,
                    ..Default::default()
                },
            )
            .unwrap()
        }
        Err(e) => panic!("allocating {len} bytes: {e}"),
    }
}

/// Drives every transport until `done` holds, collecting events per transport.
pub fn pump<T: Transport>(
    ts: &mut [&mut T],
    evs: &mut [Vec<Event>],
    what: &str,
    mut done: impl FnMut(&[Vec<Event>]) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if done(evs) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for: {what}; events so far: {evs:#?}"
        );
        for (t, e) in ts.iter_mut().zip(evs.iter_mut()) {
            t.poll(e, 1024).unwrap();
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

pub fn count(ev: &[Event], f: impl Fn(&Event) -> bool) -> usize {
    ev.iter().filter(|e| f(e)).count()
}

/// A connected pair: `s` listens, `c` connects; both have a 1 MiB remote-writable region.
pub struct Pair<T> {
    pub s: T,
    pub c: T,
    pub l: ListenerId,
    pub sc: ConnId,
    pub cc: ConnId,
    pub s_land: Region,
    pub c_land: Region,
    pub evs: Vec<Vec<Event>>,
}

impl<T: Transport> Pair<T> {
    pub fn new<B: Backend<T = T>>() -> Self {
        Self::with(B::make(&Opts::rank(0)), B::make(&Opts::rank(1)), B::listen_addr())
    }

    pub fn with(mut s: T, mut c: T, addr: SocketAddr) -> Self {
        let l = s.listen(addr).unwrap();
        let s_land = s.register(buf(1 << 20), Access::REMOTE_WRITE).unwrap();
        let c_land = c.register(buf(1 << 20), Access::REMOTE_WRITE).unwrap();
        let cc = c.connect(s.listener_addr(l).unwrap()).unwrap();
        let mut evs = vec![Vec::new(), Vec::new()];
        let mut sc = None;
        {
            let mut ts = [&mut s, &mut c];
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                for (t, e) in ts.iter_mut().zip(evs.iter_mut()) {
                    t.poll(e, 1024).unwrap();
                }
                if sc.is_none() {
                    sc = ts[0].accept(l).unwrap().map(|x| x.0);
                }
                let c_ready = ts[1].remote_regions(cc).map(|r| !r.is_empty()).unwrap_or(false);
                let s_ready = sc.is_some_and(|sc| ts[0].remote_regions(sc).map(|r| !r.is_empty()).unwrap_or(false));
                if c_ready && s_ready {
                    break;
                }
                assert!(Instant::now() < deadline, "pair did not connect: {evs:#?}");
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Pair {
            s,
            c,
            l,
            sc: sc.unwrap(),
            cc,
            s_land,
            c_land,
            evs,
        }
    }

    pub fn pump(&mut self, what: &str, done: impl FnMut(&[Vec<Event>]) -> bool) {
        pump(&mut [&mut self.s, &mut self.c], &mut self.evs, what, done)
    }

    /// The server's landing region as the client knows it.
    pub fn s_remote(&self) -> RemoteRegion {
        let r = self.c.remote_regions(self.cc).unwrap();
        *r.iter()
            .find(|r| r.rkey == self.s_land.key())
            .expect("server region announced")
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

// ------------------------------------------------------------------ cases

pub fn connect_accept<B: Backend>() {
    let mut p = Pair::<B::T>::new::<B>();
    assert!(
        count(
            &p.evs[1],
            |e| matches!(e, Event::Connected { peer, .. } if peer.rank == 0)
        ) == 1,
        "{:?}",
        p.evs[1]
    );
    assert!(count(&p.evs[0], |e| matches!(e, Event::Incoming { .. })) == 1);
    assert_eq!(p.s.remote_regions(p.sc).unwrap()[0], p.c_land.remote());
    assert_eq!(p.s_remote(), p.s_land.remote());
    // accept says "call again" once the queue is empty.
    assert!(p.s.accept(p.l).unwrap().is_none());
    p.s.poll(&mut Vec::new(), 16).unwrap();
}

pub fn many_connections<B: Backend>() {
    let mut s = B::make(&Opts::rank(0));
    let l = s.listen(B::listen_addr()).unwrap();
    let addr = s.listener_addr(l).unwrap();
    let n = 12;
    let mut clients: Vec<B::T> = (1..=n).map(|r| B::make(&Opts::rank(r))).collect();
    let conns: Vec<ConnId> = clients.iter_mut().map(|c| c.connect(addr).unwrap()).collect();
    let mut accepted = Vec::new();
    let mut cev: Vec<Vec<Event>> = (0..n).map(|_| Vec::new()).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while accepted.len() < n as usize
        || cev
            .iter()
            .any(|e| count(e, |x| matches!(x, Event::Connected { .. })) == 0)
    {
        assert!(Instant::now() < deadline, "only {} of {n} accepted", accepted.len());
        s.poll(&mut Vec::new(), 1024).unwrap();
        while let Some((c, peer)) = s.accept(l).unwrap() {
            accepted.push((c, peer.rank));
        }
        for (c, e) in clients.iter_mut().zip(cev.iter_mut()) {
            c.poll(e, 64).unwrap();
        }
    }
    let mut ranks: Vec<u32> = accepted.iter().map(|a| a.1).collect();
    ranks.sort();
    assert_eq!(ranks, (1..=n).collect::<Vec<_>>());
    assert_eq!(conns.len(), n as usize);
}

pub fn send_recv_ordering<B: Backend>() {
    let mut p = Pair::<B::T>::new::<B>();
    let src = p.c.register(buf(1 << 20), Access::LOCAL).unwrap();
    let n = 2000usize;
    let mut reqs = Vec::new();
    let mut posted = 0;
    let mut got: Vec<(u32, Vec<u8>)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let max_out = p.c.properties().max_outstanding;
    while got.len() < n {
        assert!(Instant::now() < deadline, "received {} of {n}", got.len());
        while posted < n && reqs.len() - count(&p.evs[1], |e| matches!(e, Event::SendDone { .. })) < max_out {
            let len = (posted * 7) % 300;
            let off = (posted * 512) % ((1 << 20) - 512);
            src.write_at(off, &pattern(len, posted as u8)).unwrap();
            let r = p.c.send(p.cc, &src.slice(off, len).unwrap(), posted as u32).unwrap();
            reqs.push(r);
            posted += 1;
        }
        p.c.poll(&mut p.evs[1], 4096).unwrap();
        let mut ev = Vec::new();
        p.s.poll(&mut ev, 4096).unwrap();
        for e in ev {
            if let Event::Message { tag, data, .. } = e {
                got.push((tag, data));
            }
        }
    }
    for (i, (tag, data)) in got.iter().enumerate() {
        assert_eq!(*tag as usize, i, "messages out of order");
        assert_eq!(data, &pattern((i * 7) % 300, i as u8), "message {i} corrupted");
    }
    p.pump("all SendDone", |e| {
        count(&e[1], |x| matches!(x, Event::SendDone { .. })) == n
    });
    let done: Vec<_> = p.evs[1]
        .iter()
        .filter_map(|e| {
            if let Event::SendDone { req, .. } = e {
                Some(*req)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(done, reqs, "send completions out of posting order");
}

pub fn write_imm_lands_at_offset<B: Backend>() {
    let mut p = Pair::<B::T>::new::<B>();
    let src = p.c.register(buf(4096), Access::LOCAL).unwrap();
    src.write_at(100, b"tidewire-slice").unwrap();
    let dst = p.s_remote();
    let req =
        p.c.write(p.cc, &src.slice(100, 14).unwrap(), &dst, 4093, Some(0xdead_beef))
            .unwrap();
    p.pump("write placed and acknowledged", |e| {
        count(&e[0], |x| matches!(x, Event::WriteReceived { .. })) == 1
            && count(&e[1], |x| matches!(x, Event::WriteDone { .. })) == 1
    });
    let wr = p.evs[0]
        .iter()
        .find(|e| matches!(e, Event::WriteReceived { .. }))
        .unwrap();
    match wr {
        Event::WriteReceived {
            region,
            offset,
            len,
            imm,
            ..
        } => {
            assert_eq!((*region, *offset, *len, *imm), (p.s_land.key(), 4093, 14, 0xdead_beef));
        }
        _ => unreachable!(),
    }
    assert!(p.evs[1]
        .iter()
        .any(|e| matches!(e, Event::WriteDone { req: r, bytes: 14, .. } if *r == req)));
    let mut all = vec![0u8; 1 << 20];
    p.s_land.read_at(0, &mut all).unwrap();
    assert_eq!(&all[4093..4107], b"tidewire-slice");
    assert!(
        all[..4093].iter().all(|&b| b == 0) && all[4107..].iter().all(|&b| b == 0),
        "bytes outside the target changed"
    );
    // A write without immediate lands silently at the target but still completes.
    p.c.write(p.cc, &src.slice(100, 4).unwrap(), &dst, 0, None).unwrap();
    p.pump("silent write acknowledged", |e| {
        count(&e[1], |x| matches!(x, Event::WriteDone { .. })) == 2
    });
    let mut four = [0u8; 4];
    p.s_land.read_at(0, &mut four).unwrap();
    assert_eq!(&four, b"tide");
    assert_eq!(count(&p.evs[0], |x| matches!(x, Event::WriteReceived { .. })), 1);
}

pub fn one_byte_and_64_mib<B: Backend>() {
    let s = B::make(&Opts::rank(0));
    let c = B::make(&Opts::rank(1));
    let mut p = Pair::with(s, c, B::listen_addr());
    let big = 64 << 20;
    let land = p.s.register(buf(big), Access::REMOTE_WRITE).unwrap();
    let src = p.c.register(buf(big), Access::LOCAL).unwrap();
    let data = pattern(big, 3);
    src.write_at(0, &data).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let dst = loop {
        p.c.poll(&mut p.evs[1], 1024).unwrap();
        p.s.poll(&mut p.evs[0], 1024).unwrap();
        if let Some(r) =
            p.c.remote_regions(p.cc)
                .unwrap()
                .into_iter()
                .find(|r| r.rkey == land.key())
        {
            break r;
        }
        assert!(Instant::now() < deadline, "64 MiB region never announced");
    };
    // 1 byte: a message and a write.
    p.c.send(p.cc, &src.slice(5, 1).unwrap(), 1).unwrap();
    p.c.write(p.cc, &src.slice(7, 1).unwrap(), &dst, big as u64 - 1, Some(1))
        .unwrap();
    p.pump("1-byte message and write", |e| {
        e[0].iter()
            .any(|x| matches!(x, Event::Message { data, .. } if data.len() == 1 && data[0] == pattern(8, 3)[5]))
            && count(&e[0], |x| matches!(x, Event::WriteReceived { len: 1, .. })) == 1
    });
    let mut last = [0u8];
    land.read_at(big - 1, &mut last).unwrap();
    assert_eq!(last[0], data[7]);
    // 64 MiB in one write.
    p.c.write(p.cc, &src.full(), &dst, 0, Some(64)).unwrap();
    // WriteDone means placed at the target; the target's own event may still be in
    // its completion queue (RDMA acknowledges in hardware), so wait for both.
    p.pump("64 MiB write", |e| {
        count(
            &e[1],
            |x| matches!(x, Event::WriteDone { bytes, .. } if *bytes == 64 << 20),
        ) == 1
            && count(&e[0], |x| matches!(x, Event::WriteReceived { imm: 64, .. })) >= 1
    });
    assert_eq!(
        count(&p.evs[0], |x| matches!(x, Event::WriteReceived { imm: 64, .. })),
        1
    );
    let mut got = vec![0u8; big];
    land.read_at(0, &mut got).unwrap();
    assert!(got == data, "64 MiB payload differs");
}

pub fn bad_writes_are_rejected_on_both_sides<B: Backend>() {
    let mut p = Pair::<B::T>::new::<B>();
    let src = p.c.register(buf(1 << 16), Access::LOCAL).unwrap();
    src.fill(0, 1 << 16, 0xab).unwrap();
    let real = p.s_remote();
    // Caught locally: the write does not fit the descriptor.
    let e =
        p.c.write(p.cc, &src.slice(0, 100).unwrap(), &real, real.len - 50, None)
            .unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    // Forged descriptors get past the local check and must be refused by the target.
    let lying = RemoteRegion {
        len: real.len * 4,
        ..real
    };
    let unknown = RemoteRegion {
        rkey: real.rkey ^ 0x5a5a_5a5a,
        ..real
    };
    let stale = RemoteRegion {
        generation: real.generation.wrapping_add(1),
        ..real
    };
    // A backend may refuse them at once (it knows what the peer announced), or
    // post them and fail them later; either way none lands.
    let one_sided = p.c.properties().one_sided;
    let mut posted = Vec::new();
    for (d, off, len, imm) in [
        (lying, real.len + 10, 4096, 1),
        (unknown, 0, 4096, 2),
        (stale, 0, 16, 3),
    ] {
        match p.c.write(p.cc, &src.slice(0, len).unwrap(), &d, off, Some(imm)) {
            Ok(r) => posted.push(r),
            Err(e) => assert!(
                one_sided && matches!(e, Error::UnknownRegion { .. } | Error::OutOfBounds { .. }),
                "only a one-sided backend refuses forged descriptors locally, with a typed error: {e}"
            ),
        }
    }
    if !posted.is_empty() {
        p.pump("rejections reported", |e| {
            count(&e[1], |x| matches!(x, Event::OpFailed { .. })) >= posted.len()
                || count(&e[1], |x| matches!(x, Event::Closed { .. })) == 1
        });
        let failed: Vec<_> = p.evs[1]
            .iter()
            .filter_map(|e| {
                if let Event::OpFailed { req, .. } = e {
                    Some(*req)
                } else {
                    None
                }
            })
            .collect();
        for r in &posted {
            assert!(
                failed.contains(r),
                "write {r:?} not failed at the writer: {:?}",
                p.evs[1]
            );
        }
    }
    if !one_sided {
        let rejected: Vec<String> = p.evs[0]
            .iter()
            .filter_map(|e| {
                if let Event::WriteRejected { error, .. } = e {
                    Some(error.to_string())
                } else {
                    None
                }
            })
            .collect();
        assert!(!rejected.is_empty(), "target reported no rejection: {:?}", p.evs[0]);
        assert!(rejected.iter().any(|r| r.contains("outside region")), "{rejected:?}");
    }
    assert!(!p.evs[0].iter().any(|e| matches!(e, Event::WriteReceived { .. })));
    let mut all = vec![0u8; 1 << 20];
    p.s_land.read_at(0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 0), "a rejected write changed the target");
}

pub fn deregister_while_in_flight_is_refused<B: Backend>() {
    let mut p = Pair::<B::T>::new::<B>();
    let src = p.c.register(buf(1 << 20), Access::LOCAL).unwrap();
    let dst = p.s_remote();
    p.c.write(p.cc, &src.full(), &dst, 0, Some(9)).unwrap();
    match p.c.deregister(&src) {
        Err(Error::RegionBusy { in_flight, .. }) => assert!(in_flight >= 1),
        other => panic!("deregister during a write: {other:?}"),
    }
    p.pump("write done", |e| {
        count(&e[1], |x| matches!(x, Event::WriteDone { .. })) == 1
    });
    p.c.deregister(&src).unwrap();
    assert!(!src.is_registered());
    // Using a deregistered source is refused locally.
    assert!(matches!(
        p.c.write(p.cc, &src.slice(0, 1).unwrap(), &dst, 0, None),
        Err(Error::UnknownRegion { .. })
    ));
    // Target side: deregistration revokes the descriptor, and a late write with it is rejected.
    let src2 = p.c.register(buf(4096), Access::LOCAL).unwrap();
    p.s.deregister(&p.s_land).unwrap();
    p.pump("revocation seen", |e| {
        count(&e[1], |x| matches!(x, Event::RemoteRegionsChanged { .. })) >= 2
    });
    assert!(!p.c.remote_regions(p.cc).unwrap().iter().any(|r| r.rkey == dst.rkey));
    match p.c.write(p.cc, &src2.slice(0, 8).unwrap(), &dst, 0, None) {
        Ok(_) => p.pump("stale write rejected", |e| {
            count(&e[1], |x| matches!(x, Event::OpFailed { .. } | Event::Closed { .. })) == 1
        }),
        // A backend that tracks announcements refuses the revoked descriptor at once.
        Err(e) => assert!(matches!(e, Error::UnknownRegion { .. }), "{e}"),
    }
}

pub fn outstanding_bound<B: Backend>() {
    let mut o = Opts::rank(1);
    o.max_outstanding = 8;
    let mut p = Pair::with(B::make(&Opts::rank(0)), B::make(&o), B::listen_addr());
    let src = p.c.register(buf(4096), Access::LOCAL).unwrap();
    let dst = p.s_remote();
    for _ in 0..8 {
        p.c.write(p.cc, &src.slice(0, 64).unwrap(), &dst, 0, None).unwrap();
    }
    let e = p.c.write(p.cc, &src.slice(0, 64).unwrap(), &dst, 0, None).unwrap_err();
    assert!(matches!(e, Error::WouldBlock { limit: 8, .. }), "{e}");
    assert!(matches!(
        p.c.send(p.cc, &src.slice(0, 1).unwrap(), 0),
        Err(Error::WouldBlock { .. })
    ));
    p.pump("completions free the window", |e| {
        count(&e[1], |x| matches!(x, Event::WriteDone { .. })) == 8
    });
    p.c.write(p.cc, &src.slice(0, 64).unwrap(), &dst, 0, None).unwrap();
}

/// Limits lowered in the configuration show in `properties` and are enforced:
/// sends, writes and writes with an immediate share one per-connection window.
pub fn lowered_limits_are_enforced<B: Backend>() {
    let lowered = |rank| {
        let mut o = Opts::rank(rank);
        o.max_outstanding = 4;
        o.max_message_bytes = Some(65536);
        B::make(&o)
    };
    let mut p = Pair::with(lowered(0), lowered(1), B::listen_addr());
    let props = p.c.properties().clone();
    assert_eq!(
        (props.max_outstanding, props.max_message_bytes),
        (4, 65536),
        "{props:?}"
    );
    let src = p.c.register(buf(1 << 20), Access::LOCAL).unwrap();
    let dst = p.s_remote();
    let e = p.c.send(p.cc, &src.slice(0, 65537).unwrap(), 1).unwrap_err();
    assert!(
        matches!(
            e,
            Error::TooLarge {
                len: 65537,
                max: 65536,
                ..
            }
        ),
        "{e}"
    );
    let post_all = |p: &mut Pair<B::T>| {
        p.c.send(p.cc, &src.slice(0, 65536).unwrap(), 1).unwrap();
        p.c.write(p.cc, &src.slice(0, 4096).unwrap(), &dst, 0, None).unwrap();
        p.c.write(p.cc, &src.slice(0, 4096).unwrap(), &dst, 8192, Some(7))
            .unwrap();
        p.c.send(p.cc, &src.slice(0, 10).unwrap(), 2).unwrap();
        let full = |r: tidewire_transport::Result<_>| matches!(r, Err(Error::WouldBlock { limit: 4, .. }));
        assert!(full(p.c.send(p.cc, &src.slice(0, 1).unwrap(), 3)));
        assert!(full(p.c.write(p.cc, &src.slice(0, 1).unwrap(), &dst, 0, None)));
        assert!(full(p.c.write(p.cc, &src.slice(0, 1).unwrap(), &dst, 0, Some(8))));
    };
    post_all(&mut p);
    p.pump("the window drains", |e| {
        count(&e[1], |x| matches!(x, Event::SendDone { .. })) == 2
            && count(&e[1], |x| matches!(x, Event::WriteDone { .. })) == 2
            && count(
                &e[0],
                |x| matches!(x, Event::Message { data, .. } if data.len() == 65536),
            ) == 1
            && count(&e[0], |x| matches!(x, Event::WriteReceived { imm: 7, .. })) == 1
    });
    post_all(&mut p);
}

pub fn message_too_large<B: Backend>() {
    let mut p = Pair::<B::T>::new::<B>();
    let max = p.c.properties().max_message_bytes;
    let src = p.c.register(buf(max + 1), Access::LOCAL).unwrap();
    assert!(matches!(p.c.send(p.cc, &src.full(), 0), Err(Error::TooLarge { .. })));
}

/// A message reaches the application with at most one copy in user space: the
/// receiver's copy counter rises by at most the payload bytes it received
/// (sizes from 1 byte to the largest message, sent back to back so that
/// messages straddle receive buffers), and every message arrives intact.
pub fn messages_are_copied_at_most_once<B: Backend>() {
    let mut p = Pair::<B::T>::new::<B>();
    let max =
        p.c.properties()
            .max_message_bytes
            .min(p.s.properties().max_message_bytes);
    let src = p.c.register(buf(max), Access::LOCAL).unwrap();
    let sizes: Vec<usize> = [1, 39, 40, 41, 300, 4096, 65_535, 65_536 + 7, 1 << 20, max]
        .into_iter()
        .filter(|&n| n <= max)
        .collect();
    let seed = 0x5d;
    src.write_at(0, &pattern(max, seed)).unwrap();
    // Let the connection settle (region announcements) before counting.
    quiesce(&mut p.c);
    quiesce(&mut p.s);
    let before = p.s.counters().rx_copied_bytes;
    let mut want = Vec::new();
    for round in 0..3 {
        for &n in &sizes {
            let off = (round * 4099 + n) % (max - n + 1);
            loop {
                match p.c.send(p.cc, &src.slice(off, n).unwrap(), want.len() as u32) {
                    Ok(_) => break,
                    Err(Error::WouldBlock { .. }) => {
                        p.c.poll(&mut p.evs[1], 4096).unwrap();
                        p.s.poll(&mut p.evs[0], 4096).unwrap();
                    }
                    Err(e) => panic!("send of {n} bytes: {e}"),
                }
            }
            want.push((off, n));
        }
    }
    let total: usize = want.iter().map(|w| w.1).sum();
    let k = want.len();
    p.pump("all messages", |e| {
        count(&e[0], |x| matches!(x, Event::Message { .. })) == k
    });
    let got: Vec<(u32, &Vec<u8>)> = p.evs[0]
        .iter()
        .filter_map(|e| match e {
            Event::Message { tag, data, .. } => Some((*tag, data)),
            _ => None,
        })
        .collect();
    let all = pattern(max, seed);
    for (i, (tag, data)) in got.iter().enumerate() {
        let (off, n) = want[i];
        assert_eq!(*tag as usize, i, "messages out of order");
        assert!(data[..] == all[off..off + n], "message {i} ({n} bytes) corrupted");
    }
    let copied = p.s.counters().rx_copied_bytes - before;
    assert!(
        copied <= total as u64,
        "user space copied {copied} bytes to deliver {total} message bytes ({k} messages)"
    );
}

pub fn graceful_close_flushes<B: Backend>() {
    let mut p = Pair::<B::T>::new::<B>();
    let src = p.c.register(buf(1 << 20), Access::LOCAL).unwrap();
    let dst = p.s_remote();
    for i in 0..10u64 {
        p.c.write(p.cc, &src.slice(0, 65536).unwrap(), &dst, i * 65536, Some(i as u32))
            .unwrap();
    }
    p.c.close(p.cc).unwrap();
    assert!(
        p.c.write(p.cc, &src.slice(0, 1).unwrap(), &dst, 0, None).is_err(),
        "posting after close must fail"
    );
    p.pump("both sides closed", |e| {
        count(&e[0], |x| matches!(x, Event::Closed { .. })) == 1
            && count(&e[1], |x| matches!(x, Event::Closed { .. })) == 1
    });
    assert_eq!(count(&p.evs[1], |x| matches!(x, Event::WriteDone { .. })), 10);
    assert_eq!(count(&p.evs[0], |x| matches!(x, Event::WriteReceived { .. })), 10);
    for e in p.evs.iter().flatten() {
        if let Event::Closed { error, .. } = e {
            assert!(error.is_none(), "graceful close reported {error:?}");
        }
    }
}

pub fn peer_closes_mid_transfer<B: Backend>() {
    // The receiver vanishes while a 64 MiB write streams into it.
    let p = Pair::<B::T>::new::<B>();
    let Pair { mut s, mut c, cc, .. } = p;
    let big = 64 << 20;
    let land = s.register(buf(big), Access::REMOTE_WRITE).unwrap();
    let src = c.register(buf(big), Access::LOCAL).unwrap();
    let mut evs = [Vec::new(), Vec::new()];
    let deadline = Instant::now() + Duration::from_secs(10);
    let dst = loop {
        s.poll(&mut evs[0], 1024).unwrap();
        c.poll(&mut evs[1], 1024).unwrap();
        if let Some(r) = c.remote_regions(cc).unwrap().into_iter().find(|r| r.rkey == land.key()) {
            break r;
        }
        assert!(Instant::now() < deadline);
    };
    // 16 writes of 64 MiB: far more than can move before the peer goes.
    for _ in 0..16 {
        c.write(cc, &src.full(), &dst, 0, Some(1)).unwrap();
    }
    for _ in 0..3 {
        c.poll(&mut evs[1], 1024).unwrap();
        s.poll(&mut evs[0], 1024).unwrap();
    }
    drop(s);
    let t0 = Instant::now();
    let mut ev = Vec::new();
    pump(
        &mut [&mut c],
        std::slice::from_mut(&mut ev),
        "writer notices the dead peer",
        |e| count(&e[0], |x| matches!(x, Event::Closed { error: Some(_), .. })) == 1,
    );
    assert!(
        ev.iter().any(|e| matches!(e, Event::OpFailed { .. })),
        "the writes must fail: {ev:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10));

    // The writer vanishes while the receiver is mid-payload.
    let p = Pair::<B::T>::new::<B>();
    let Pair { mut s, mut c, cc, .. } = p;
    let land = s.register(buf(big), Access::REMOTE_WRITE).unwrap();
    let src = c.register(buf(big), Access::LOCAL).unwrap();
    let mut evs = [Vec::new(), Vec::new()];
    let dst = loop {
        s.poll(&mut evs[0], 1024).unwrap();
        c.poll(&mut evs[1], 1024).unwrap();
        if let Some(r) = c.remote_regions(cc).unwrap().into_iter().find(|r| r.rkey == land.key()) {
            break r;
        }
    };
    for _ in 0..16 {
        c.write(cc, &src.full(), &dst, 0, Some(1)).unwrap();
    }
    for _ in 0..3 {
        c.poll(&mut evs[1], 1024).unwrap();
        s.poll(&mut evs[0], 1024).unwrap();
    }
    drop(c);
    let mut ev = std::mem::take(&mut evs[0]);
    pump(
        &mut [&mut s],
        std::slice::from_mut(&mut ev),
        "receiver notices the dead writer",
        |e| count(&e[0], |x| matches!(x, Event::Closed { error: Some(_), .. })) == 1,
    );
    let received = count(&ev, |e| matches!(e, Event::WriteReceived { .. }));
    assert!(
        received < 16,
        "the torn write must not be reported as received ({received} of 16)"
    );
}

pub fn wrong_secret_is_refused<B: Backend>() {
    let mut s = B::make(&Opts::rank(0));
    let mut bad = Opts::rank(1);
    bad.secret = b"not the job secret".to_vec();
    let mut c = B::make(&bad);
    let l = s.listen(B::listen_addr()).unwrap();
    s.register(buf(4096), Access::REMOTE_WRITE).unwrap();
    let cc = c.connect(s.listener_addr(l).unwrap()).unwrap();
    let mut evs = [Vec::new(), Vec::new()];
    pump(&mut [&mut s, &mut c], &mut evs, "both sides report the failure", |e| {
        count(&e[0], |x| matches!(x, Event::PeerRejected { .. })) == 1
            && count(&e[1], |x| matches!(x, Event::Closed { error: Some(_), .. })) == 1
    });
    let ce = evs[1]
        .iter()
        .find_map(|e| {
            if let Event::Closed { error: Some(e), .. } = e {
                Some(e)
            } else {
                None
            }
        })
        .unwrap();
    assert!(matches!(ce, Error::AuthFailed { .. }), "client: {ce}");
    let se = evs[0]
        .iter()
        .find_map(|e| {
            if let Event::PeerRejected { error, .. } = e {
                Some(error)
            } else {
                None
            }
        })
        .unwrap();
    assert!(matches!(se, Error::AuthFailed { .. }), "server: {se}");
    assert!(!evs[1]
        .iter()
        .any(|e| matches!(e, Event::RemoteRegionsChanged { .. } | Event::Connected { .. })));
    assert!(s.accept(l).unwrap().is_none());
    assert!(c.remote_regions(cc).is_err() || c.remote_regions(cc).unwrap().is_empty());
}

pub fn wrong_job_is_refused<B: Backend>() {
    let mut s = B::make(&Opts::rank(0));
    let mut o = Opts::rank(1);
    o.job_id = JOB + 1;
    let mut c = B::make(&o);
    let l = s.listen(B::listen_addr()).unwrap();
    c.connect(s.listener_addr(l).unwrap()).unwrap();
    let mut evs = [Vec::new(), Vec::new()];
    pump(&mut [&mut s, &mut c], &mut evs, "job mismatch on both sides", |e| {
        e[0].iter().any(|x| {
            matches!(
                x,
                Event::PeerRejected {
                    error: Error::JobMismatch { .. },
                    ..
                }
            )
        }) && e[1].iter().any(|x| {
            matches!(
                x,
                Event::Closed {
                    error: Some(Error::Rejected { .. }),
                    ..
                }
            )
        })
    });
}

/// Reads frames from a raw socket until EOF, returning their kinds.
fn raw_frames(s: &mut TcpStream) -> Vec<(Kind, Vec<u8>)> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    let mut out = Vec::new();
    let mut at = 0;
    while let Ok(Some((h, total))) = frame::next_frame(&all[at..], frame::MAX_CONTROL_BYTES) {
        out.push((h.kind, all[at + frame::HEADER_LEN..at + total].to_vec()));
        at += total;
    }
    out
}

fn server_with_region<B: Backend>(o: &Opts) -> (B::T, ListenerId, Region, SocketAddr) {
    let mut s = B::make(o);
    let l = s.listen(B::listen_addr()).unwrap();
    let r = s.register(buf(4096), Access::REMOTE_WRITE).unwrap();
    let a = s.listener_addr(l).unwrap();
    (s, l, r, a)
}

fn expect_rejected<T: Transport>(s: &mut T, what: &str, f: impl Fn(&Error) -> bool) -> Error {
    let mut ev = vec![Vec::new()];
    pump(&mut [s], &mut ev, what, |e| {
        count(&e[0], |x| matches!(x, Event::PeerRejected { .. })) == 1
    });
    let Some(Event::PeerRejected { error, .. }) = ev[0].pop().filter(|e| matches!(e, Event::PeerRejected { .. }))
    else {
        panic!("{what}: {ev:?}")
    };
    assert!(f(&error), "{what}: got {error}");
    error
}

pub fn wrong_version_is_refused<B: Backend>() {
    let (mut s, l, r, addr) = server_with_region::<B>(&Opts::rank(0));
    let mut raw = TcpStream::connect(addr).unwrap();
    let hello = frame::Hello {
        job_id: JOB,
        rank: 9,
        nonce: [7; 32],
    }
    .encode();
    let mut h = Header::new(Kind::Hello, hello.len() as u32).encode();
    h[4] = frame::VERSION + 1;
    raw.write_all(&h).unwrap();
    raw.write_all(&hello).unwrap();
    expect_rejected(
        &mut s,
        "version mismatch",
        |e| matches!(e, Error::VersionMismatch { theirs, .. } if *theirs == frame::VERSION + 1),
    );
    let frames = raw_frames(&mut raw);
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(frames[0].0, Kind::Reject);
    assert!(String::from_utf8_lossy(&frames[0].1).contains("version"));
    assert!(s.accept(l).unwrap().is_none());
    assert_eq!(r.in_flight(), 0);
}

pub fn garbage_is_refused<B: Backend>() {
    let (mut s, l, r, addr) = server_with_region::<B>(&Opts::rank(0));
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: tidewire\r\n\r\n\x00\xff\xfe garbage garbage garbage")
        .unwrap();
    expect_rejected(&mut s, "garbage", |e| matches!(e, Error::BadFrame { .. }));
    let frames = raw_frames(&mut raw);
    assert!(
        frames.iter().all(|f| f.0 != Kind::Regions),
        "garbage peer learned regions"
    );
    assert!(s.accept(l).unwrap().is_none());
    let mut all = vec![0u8; 4096];
    r.read_at(0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 0));
    // A valid header claiming a huge payload is refused before anything is read.
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.write_all(&Header::new(Kind::Hello, frame::MAX_CONTROL_BYTES).encode())
        .unwrap();
    expect_rejected(&mut s, "oversized first frame", |e| matches!(e, Error::BadFrame { .. }));
}

pub fn forged_auth_is_refused<B: Backend>() {
    let (mut s, l, _r, addr) = server_with_region::<B>(&Opts::rank(0));
    let mut raw = TcpStream::connect(addr).unwrap();
    let hello = frame::Hello {
        job_id: JOB,
        rank: 5,
        nonce: [1; 32],
    }
    .encode();
    raw.write_all(&Header::new(Kind::Hello, hello.len() as u32).encode())
        .unwrap();
    raw.write_all(&hello).unwrap();
    // Read the challenge while driving the server.
    raw.set_nonblocking(true).unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        s.poll(&mut Vec::new(), 64).unwrap();
        let mut b = [0u8; 256];
        if let Ok(n) = raw.read(&mut b) {
            got.extend_from_slice(&b[..n]);
        }
        if let Ok(Some((h, _))) = frame::next_frame(&got, 4096) {
            assert_eq!(h.kind, Kind::Challenge);
            break;
        }
        assert!(Instant::now() < deadline, "no challenge");
    }
    raw.set_nonblocking(false).unwrap();
    raw.write_all(&Header::new(Kind::Auth, 32).encode()).unwrap();
    raw.write_all(&[0x42; 32]).unwrap();
    expect_rejected(&mut s, "forged proof", |e| matches!(e, Error::AuthFailed { .. }));
    let frames = raw_frames(&mut raw);
    assert!(
        frames.iter().all(|f| f.0 != Kind::Regions && f.0 != Kind::Ready),
        "{frames:?}"
    );
    assert!(frames.iter().any(|f| f.0 == Kind::Reject), "{frames:?}");
    assert!(s.accept(l).unwrap().is_none());
}

pub fn silent_peer_times_out<B: Backend>() {
    let mut o = Opts::rank(0);
    o.handshake_timeout = Duration::from_millis(300);
    let (mut s, _l, _r, addr) = server_with_region::<B>(&o);
    let _raw = TcpStream::connect(addr).unwrap();
    let t0 = Instant::now();
    expect_rejected(&mut s, "silent peer", |e| matches!(e, Error::Timeout { .. }));
    assert!(t0.elapsed() < Duration::from_secs(5));
    // A client whose server never answers also gets a timeout, not a hang.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = B::make(&o);
    c.connect(listener.local_addr().unwrap()).unwrap();
    let mut ev = vec![Vec::new()];
    pump(&mut [&mut c], &mut ev, "client handshake timeout", |e| {
        e[0].iter().any(|x| {
            matches!(
                x,
                Event::Closed {
                    error: Some(Error::Timeout { .. }),
                    ..
                }
            )
        })
    });
}

pub fn connect_refused_is_an_error<B: Backend>() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut c = B::make(&Opts::rank(1));
    c.connect(port).unwrap();
    let mut ev = vec![Vec::new()];
    pump(&mut [&mut c], &mut ev, "refused connect reported", |e| {
        e[0].iter().any(|x| matches!(x, Event::Closed { error: Some(_), .. }))
    });
}

/// This thread's CPU time (user + system) so far.
pub fn thread_cpu() -> Duration {
    // SAFETY: all-zero is a valid rusage; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage for the duration of the call.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) }, 0);
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Waits on `t` until a short wait brings no event (what the handshake left behind is consumed).
pub fn quiesce<T: Transport>(t: &mut T) {
    let mut ev = Vec::new();
    for _ in 0..50 {
        ev.clear();
        if t.wait(&mut ev, 1024, Duration::from_millis(50)).unwrap() == 0 {
            return;
        }
    }
    panic!("the transport never went quiet: {ev:#?}");
}

pub fn waker_ends_wait<B: Backend>() {
    fn send_sync<W: Send + Sync + Clone + std::fmt::Debug>(_: &W) {}
    let mut t = B::make(&Opts::rank(0));
    let w = t.waker().unwrap();
    send_sync(&w);
    let mut ev = Vec::new();

    // A wait in progress on this thread, woken from another after ~50 ms.
    let w2 = w.clone();
    let th = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        w2.wake();
    });
    let start = Instant::now();
    let n = t.wait(&mut ev, 16, Duration::from_secs(10)).unwrap();
    let took = start.elapsed();
    th.join().unwrap();
    assert!(took < Duration::from_secs(5), "the wake did not end the wait: {took:?}");
    assert!(
        took >= Duration::from_millis(40),
        "returned before the wake ({n} events: {ev:?})"
    );

    // Wakes before the wait: the next wait returns promptly, and they coalesce into that one return.
    for _ in 0..100 {
        w.wake();
    }
    let start = Instant::now();
    t.wait(&mut ev, 16, Duration::from_secs(10)).unwrap();
    assert!(start.elapsed() < Duration::from_secs(5), "an earlier wake was lost");
    let start = Instant::now();
    t.wait(&mut ev, 16, Duration::from_millis(300)).unwrap();
    assert!(
        start.elapsed() >= Duration::from_millis(250),
        "wakes did not coalesce: a second wait returned after {:?}",
        start.elapsed()
    );

    // `poll` does not consume a wake.
    w.wake();
    t.poll(&mut ev, 16).unwrap();
    let start = Instant::now();
    t.wait(&mut ev, 16, Duration::from_secs(10)).unwrap();
    assert!(start.elapsed() < Duration::from_secs(5), "poll swallowed the wake");
    assert!(ev.is_empty(), "a bare transport has nothing to report: {ev:?}");

    // A handle may outlive its transport.
    drop(t);
    w.wake();
}

pub fn idle_wait_uses_little_cpu<B: Backend>() {
    let quiet = |rank| {
        let mut o = Opts::rank(rank);
        o.busy_poll = Some(Duration::ZERO);
        B::make(&o)
    };
    let mut p = Pair::with(quiet(0), quiet(1), B::listen_addr());
    quiesce(&mut p.s);
    quiesce(&mut p.c);
    let mut ev = Vec::new();
    let cpu = thread_cpu();
    let start = Instant::now();
    let n = p.c.wait(&mut ev, 16, Duration::from_millis(300)).unwrap();
    let (wall, cpu) = (start.elapsed(), thread_cpu() - cpu);
    assert_eq!(n, 0, "an idle connection produced events: {ev:?}");
    assert!(wall >= Duration::from_millis(250), "the wait ended early: {wall:?}");
    assert!(
        cpu < Duration::from_millis(30),
        "an idle 300 ms wait used {cpu:?} of CPU"
    );
    // The connection is still there and the wait still wakes.
    let w = p.c.waker().unwrap();
    w.wake();
    let start = Instant::now();
    p.c.wait(&mut ev, 16, Duration::from_secs(10)).unwrap();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(!p.c.remote_regions(p.cc).unwrap().is_empty());
}

/// Wakes from another thread, each timed at random around the moment the
/// owner goes to sleep (seeded; the seed is printed): every one ends its
/// wait promptly. A lost wake would leave a wait to its 20 s timeout.
pub fn wakes_race_sleeps<B: Backend>() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
        | 1;
    eprintln!("wakes_race_sleeps: seed {seed}");
    const ROUNDS: u64 = 2_000;
    let mut t = B::make(&Opts::rank(0));
    let w = t.waker().unwrap();
    let waits = Arc::new(AtomicU64::new(0));
    let seen = waits.clone();
    let th = std::thread::spawn(move || {
        let mut x = seed;
        for i in 1..=ROUNDS {
            while seen.load(Ordering::SeqCst) < i {
                std::hint::spin_loop();
            }
            // xorshift: 0 to 63 µs after the owner said it was about to wait.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let delay = x % 64;
            if delay > 0 {
                std::thread::sleep(Duration::from_micros(delay));
            }
            w.wake();
        }
    });
    let mut ev = Vec::new();
    let mut slowest = Duration::ZERO;
    for i in 1..=ROUNDS {
        waits.store(i, Ordering::SeqCst);
        let start = Instant::now();
        t.wait(&mut ev, 16, Duration::from_secs(20)).unwrap();
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(10),
            "round {i} (seed {seed}): a wake was lost ({took:?})"
        );
        slowest = slowest.max(took);
        ev.clear();
    }
    th.join().unwrap();
    eprintln!("wakes_race_sleeps: {ROUNDS} rounds, slowest wait {slowest:?}");
}

#[macro_export]
macro_rules! conformance_suite {
    ($b:ty) => {
        $crate::conformance_suite!(@ $b; connect_accept many_connections send_recv_ordering write_imm_lands_at_offset
            one_byte_and_64_mib bad_writes_are_rejected_on_both_sides deregister_while_in_flight_is_refused
            outstanding_bound lowered_limits_are_enforced message_too_large messages_are_copied_at_most_once graceful_close_flushes peer_closes_mid_transfer
            wrong_secret_is_refused wrong_job_is_refused wrong_version_is_refused garbage_is_refused
            forged_auth_is_refused silent_peer_times_out connect_refused_is_an_error waker_ends_wait
            wakes_race_sleeps idle_wait_uses_little_cpu);
    };
    (@ $b:ty; $($case:ident)*) => {
        $( #[test] fn $case() {
            if let Some(why) = <$b as conformance::Backend>::skip() {
                // Straight to the stderr handle: libtest's capture would hide an eprintln!.
                use std::io::Write as _;
                let _ = writeln!(std::io::stderr(), "SKIPPED: {}: {why}", stringify!($case));
                return;
            }
            conformance::$case::<$b>()
        } )*
    };
}
