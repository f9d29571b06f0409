//! Hostile peers against both TCP backends (io_uring and portable, every case
//! on each): what an unauthenticated connection can make a server hold, how
//! long it can hold it, and that legitimate peers still get in meanwhile.
//!
//! The attackers are raw `std` sockets in this process; the server is a real
//! transport of the backend under test, and so is the legitimate peer. The tests in this file run
//! one at a time (they read the process's RSS and share one CPU budget).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use tidewire_transport::error::FrameError;
use tidewire_transport::frame::{self, Header, Hello, Kind, MAX_PENDING_HANDSHAKES};
use tidewire_transport::{
    Access, ConnId, Error, Event, JobSecret, ListenerId, PinOptions, PinnedBuffer, PortableTransport, Region,
    TcpConfig, TcpTransport, Transport,
};

const JOB: u64 = 0x7e57_4057;
const SECRET: &[u8] = b"hostile-peers: the job secret";
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn config(rank: u32, handshake: Duration) -> TcpConfig {
    let mut cfg = TcpConfig::new(JOB, rank, JobSecret::new(SECRET.to_vec()));
    cfg.handshake_timeout = handshake;
    cfg.busy_poll = Duration::ZERO;
    cfg
}

/// A backend under test, with the counters these tests read.
trait Hostile: Transport + Sized {
    fn make(rank: u32, handshake: Duration) -> Self;
    /// Handshakes closed because MAX_PENDING_HANDSHAKES others were pending.
    fn evicted(&self) -> u64;
    /// Unauthenticated connections refused on a header.
    fn pre_auth_refused(&self) -> u64;
    fn stats_line(&self) -> String;
}

impl Hostile for TcpTransport {
    fn make(rank: u32, handshake: Duration) -> Self {
        TcpTransport::new(config(rank, handshake)).expect("io_uring transport")
    }
    fn evicted(&self) -> u64 {
        self.stats().handshakes_evicted
    }
    fn pre_auth_refused(&self) -> u64 {
        self.stats().pre_auth_refused
    }
    fn stats_line(&self) -> String {
        format!("{:?}", self.stats())
    }
}

impl Hostile for PortableTransport {
    fn make(rank: u32, handshake: Duration) -> Self {
        PortableTransport::new(config(rank, handshake)).expect("portable transport")
    }
    fn evicted(&self) -> u64 {
        self.stats().refused_over_limit
    }
    fn pre_auth_refused(&self) -> u64 {
        self.stats().pre_auth_refused
    }
    fn stats_line(&self) -> String {
        format!("{:?}", self.stats())
    }
}

fn transport<T: Hostile>(rank: u32, handshake: Duration) -> T {
    T::make(rank, handshake)
}

fn region(t: &mut impl Transport) -> Region {
    let opts = PinOptions {
        lock: false,
        ..Default::default()
    };
    t.register(PinnedBuffer::with_options(4096, opts).unwrap(), Access::REMOTE_WRITE)
        .unwrap()
}

/// This process's resident set, in KiB.
fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/self/status");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn hello() -> Vec<u8> {
    let body = Hello {
        job_id: JOB,
        rank: 9,
        nonce: [7; 32],
    }
    .encode();
    let mut b = Header::new(Kind::Hello, body.len() as u32).encode().to_vec();
    b.extend_from_slice(&body);
    b
}

/// Whether the server has closed `s` (EOF or reset), reading whatever it sent first.
/// Waits at most `wait`.
fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
    let end = Instant::now() + wait;
    let mut sink = [0u8; 4096];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return false,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
}

/// Whether `s` is still open right now (nothing to read and no EOF).
fn still_open(s: &mut TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut sink = [0u8; 4096];
    let open = loop {
        match s.read(&mut sink) {
            Ok(0) => break false,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break true,
            Err(_) => break false,
        }
    };
    s.set_nonblocking(false).unwrap();
    open
}

/// Connects `client` to the server, has it send one message, and drives both
/// until the server has it; returns how long that took. Panics after `limit`.
fn legit_exchange<T: Hostile>(
    server: &mut T,
    l: ListenerId,
    client: &mut T,
    src: &Region,
    server_evs: &mut Vec<Event>,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    let addr = server.listener_addr(l).unwrap();
    let cc = client.connect(addr).unwrap();
    let mut cev = Vec::new();
    let mut sent = false;
    let mut accepted: Option<ConnId> = None;
    loop {
        assert!(
            start.elapsed() < limit,
            "the legitimate peer did not get through in {limit:?}; client events {cev:#?}"
        );
        server.wait(server_evs, 1024, Duration::from_millis(1)).unwrap();
        client.wait(&mut cev, 1024, Duration::from_millis(1)).unwrap();
        if accepted.is_none() {
            accepted = server.accept(l).unwrap().map(|x| x.0);
        }
        if !sent
            && cev
                .iter()
                .any(|e| matches!(e, Event::Connected { conn, .. } if *conn == cc))
        {
            src.write_at(0, b"hello from a legitimate peer").unwrap();
            client.send(cc, &src.slice(0, 28).unwrap(), 42).unwrap();
            sent = true;
        }
        let got = server_evs.iter().any(|e| {
            matches!(e, Event::Message { conn, tag: 42, data }
                if Some(*conn) == accepted && data.as_slice() == b"hello from a legitimate peer")
        });
        if got {
            return start.elapsed();
        }
        if let Some(e) = cev.iter().find(|e| matches!(e, Event::Closed { .. })) {
            panic!("the legitimate peer's connection failed: {e:?}");
        }
    }
}

/// Runs a peer through the server that sends 8 MiB of 16 KiB messages, so that
/// every provided receive buffer of the server has been used once, then closes it.
fn warm_up<T: Hostile>(server: &mut T, l: ListenerId, sevs: &mut Vec<Event>) {
    let mut peer: T = transport(2, Duration::from_secs(5));
    let opts = PinOptions {
        lock: false,
        ..Default::default()
    };
    let src = peer
        .register(PinnedBuffer::with_options(16 << 10, opts).unwrap(), Access::LOCAL)
        .unwrap();
    let cc = peer.connect(server.listener_addr(l).unwrap()).unwrap();
    let start = Instant::now();
    let (mut sent, mut got, mut connected) = (0, 0, false);
    let mut pev = Vec::new();
    while got < 512 {
        assert!(start.elapsed() < Duration::from_secs(20), "warm-up stalled: {pev:?}");
        peer.wait(&mut pev, 1024, Duration::ZERO).unwrap();
        connected |= pev.iter().any(|e| matches!(e, Event::Connected { .. }));
        pev.clear();
        while connected && sent < 512 && peer.send(cc, &src.slice(0, 16 << 10).unwrap(), 1).is_ok() {
            sent += 1;
        }
        server.wait(sevs, 1024, Duration::from_millis(1)).unwrap();
        while server.accept(l).unwrap().is_some() {}
        got += sevs.iter().filter(|e| matches!(e, Event::Message { .. })).count();
        sevs.clear();
    }
    peer.close(cc).unwrap();
    let end = Instant::now() + Duration::from_millis(200);
    while Instant::now() < end {
        peer.wait(&mut pev, 1024, Duration::ZERO).unwrap();
        server.wait(sevs, 1024, Duration::from_millis(1)).unwrap();
    }
    sevs.clear();
}

/// Acceptance test: 50 connections that each send a valid Hello and then
/// claim a 16 MiB frame (and stream its payload as fast as the server takes
/// it) raise this process's RSS by less than 4 MiB, are closed within the
/// handshake deadline, and a legitimate peer connects and exchanges a message
/// meanwhile.
fn fifty_big_frame_claims_before_auth_cost_little_and_are_closed<T: Hostile>() {
    let _g = serial();
    const ATTACKERS: usize = 50;
    const CHUNK: usize = 1 << 20;
    let hs = Duration::from_millis(1500);
    let slack = Duration::from_millis(1000);
    let mut server: T = transport(0, hs);
    let l = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr: SocketAddr = server.listener_addr(l).unwrap();
    let mut client: T = transport(1, hs);
    let src = region(&mut client);
    let _dst = region(&mut server);
    // Everything the attack itself needs is allocated (and touched) before the baseline.
    let payload = Arc::new(vec![0xabu8; CHUNK]);
    let claimed = Arc::new(AtomicBool::new(false));
    let mut sevs = Vec::with_capacity(4096);
    // The server's receive pool (provided buffers, shared by all connections and
    // fixed in size) is faulted in by a warm-up peer: the baseline is a server
    // that has carried traffic.
    warm_up(&mut server, l, &mut sevs);
    let ready = Arc::new(Barrier::new(2));
    let go = Arc::new(Barrier::new(2));

    let attack = {
        let (payload, claimed, ready, go) = (payload.clone(), claimed.clone(), ready.clone(), go.clone());
        std::thread::spawn(move || {
            let mut socks = Vec::with_capacity(ATTACKERS);
            ready.wait();
            go.wait();
            for _ in 0..ATTACKERS {
                let mut s = TcpStream::connect(addr).unwrap();
                let at = Instant::now();
                s.write_all(&hello()).unwrap();
                s.write_all(&Header::new(Kind::Message, frame::MAX_MESSAGE_BYTES).encode())
                    .unwrap();
                s.set_nonblocking(true).unwrap();
                socks.push((s, at, 0usize, true));
            }
            claimed.store(true, Ordering::Release);
            // Stream each claimed payload for as long as the server reads it (at most 16 MiB each, 3 s).
            let stop = Instant::now() + Duration::from_secs(3);
            while Instant::now() < stop && socks.iter().any(|s| s.3) {
                let mut progressed = false;
                for (s, _, sent, active) in socks.iter_mut().filter(|s| s.3) {
                    let want = (frame::MAX_MESSAGE_BYTES as usize - *sent).min(CHUNK);
                    match s.write(&payload[..want]) {
                        Ok(n) => {
                            *sent += n;
                            progressed = true;
                            *active = *sent < frame::MAX_MESSAGE_BYTES as usize;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(_) => *active = false,
                    }
                }
                if !progressed {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            // Each must be closed by the server within the handshake deadline (plus slack).
            let mut late = Vec::new();
            for (i, (mut s, at, sent, _)) in socks.into_iter().enumerate() {
                s.set_nonblocking(false).unwrap();
                let left = (at + hs + slack).saturating_duration_since(Instant::now());
                if !closed_within(&mut s, left) {
                    late.push((i, sent));
                }
            }
            late
        })
    };

    ready.wait();
    let before = rss_kib();
    go.wait();
    // Drive the server while the attack runs; once every claim is out, a real peer connects.
    let mut took = None;
    // The peak matters, not the end: a reassembly buffer freed when its frame
    // is finally refused goes back to the OS. Sample every turn of the loop.
    let mut peak = before;
    while !attack.is_finished() {
        peak = peak.max(rss_kib());
        if took.is_none() && claimed.load(Ordering::Acquire) {
            took = Some(legit_exchange(&mut server, l, &mut client, &src, &mut sevs, hs));
        }
        server.wait(&mut sevs, 1024, Duration::from_millis(2)).unwrap();
        client.wait(&mut Vec::new(), 1024, Duration::ZERO).unwrap();
    }
    let late = attack.join().unwrap();
    let after = rss_kib();
    let peak = peak.max(after);
    let stats = server.stats_line();
    let rejected = sevs
        .iter()
        .filter(|e| {
            matches!(e, Event::PeerRejected { error: Error::BadFrame { reason, .. }, .. }
                if matches!(reason, FrameError::Unexpected { .. } | FrameError::TooLong { .. }))
        })
        .count();
    eprintln!(
        "RSS {before} KiB -> peak {peak} KiB, end {after} KiB; legitimate peer took {took:?}; \
         {rejected} refused on the header; stats {stats:?}"
    );
    assert!(took.is_some(), "the legitimate peer never tried");
    assert!(
        late.is_empty(),
        "attackers (index, payload bytes sent) still open after the deadline: {late:?}"
    );
    assert!(
        peak.saturating_sub(before) < 4 * 1024,
        "RSS grew by {} KiB (from {before} KiB to a peak of {peak} KiB)",
        peak.saturating_sub(before)
    );
    let others: Vec<_> = sevs
        .iter()
        .filter(|e| matches!(e, Event::PeerRejected { .. } | Event::Closed { .. }))
        .collect();
    assert_eq!(rejected, ATTACKERS, "each claim is refused on its header: {others:#?}");
    assert_eq!(server.pre_auth_refused(), ATTACKERS as u64, "{stats}");
    drop(payload);
}

/// Past `MAX_PENDING_HANDSHAKES` unauthenticated connections the oldest is
/// closed at once: 80 idle sockets (connected, silent) do not keep a
/// legitimate peer out, and it gets in while the newest idle ones are still
/// open (so not merely because their handshake deadline passed). The idle
/// ones that were not evicted are closed at their handshake deadline.
fn idle_connections_past_the_cap_do_not_keep_a_peer_out<T: Hostile>() {
    let _g = serial();
    const IDLE: usize = 80;
    let hs = Duration::from_millis(2000);
    let mut server: T = transport(0, hs);
    let l = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.listener_addr(l).unwrap();
    let mut client: T = transport(1, hs);
    let src = region(&mut client);
    let mut sevs = Vec::new();
    let start = Instant::now();
    let mut idle: Vec<TcpStream> = Vec::with_capacity(IDLE);
    for _ in 0..IDLE {
        idle.push(TcpStream::connect(addr).unwrap());
        // Accept as they come, so that "oldest" is well defined.
        server.wait(&mut sevs, 1024, Duration::from_millis(1)).unwrap();
    }
    let excess = (IDLE - MAX_PENDING_HANDSHAKES) as u64;
    while server.evicted() < excess {
        assert!(
            start.elapsed() < hs / 2,
            "the server did not accept the idle sockets: {:?}",
            server.stats_line()
        );
        server.wait(&mut sevs, 1024, Duration::from_millis(1)).unwrap();
    }
    assert_eq!(server.evicted(), excess);
    // The oldest were closed at once, with a typed reason.
    for (i, s) in idle.iter_mut().take(excess as usize).enumerate() {
        assert!(
            closed_within(s, Duration::from_millis(500)),
            "idle socket {i} (among the oldest) still open"
        );
    }
    let evicted = sevs
        .iter()
        .filter(|e| matches!(e, Event::PeerRejected { error: Error::TooManyHandshakes { limit, .. }, .. } if *limit == MAX_PENDING_HANDSHAKES))
        .count();
    assert_eq!(evicted as u64, excess);

    let took = legit_exchange(&mut server, l, &mut client, &src, &mut sevs, hs / 2);
    eprintln!(
        "legitimate peer got in after {took:?} with 64 idle sockets pending; {:?}",
        server.stats_line()
    );
    let last = idle.last_mut().unwrap();
    assert!(
        still_open(last),
        "the newest idle socket was closed: the peer did not get in past it"
    );

    // The rest are closed when their handshake deadline passes (accepted around `start`).
    let drive_until = start + hs + Duration::from_millis(500);
    while Instant::now() < drive_until {
        server.wait(&mut sevs, 1024, Duration::from_millis(5)).unwrap();
        client.wait(&mut Vec::new(), 1024, Duration::ZERO).unwrap();
    }
    for (i, s) in idle.iter_mut().enumerate() {
        assert!(
            closed_within(s, Duration::from_millis(500)),
            "idle socket {i} outlived its handshake deadline"
        );
    }
    let timeouts = sevs
        .iter()
        .filter(|e| {
            matches!(
                e,
                Event::PeerRejected {
                    error: Error::Timeout { .. },
                    ..
                }
            )
        })
        .count();
    assert!(
        timeouts >= MAX_PENDING_HANDSHAKES - 2,
        "{timeouts} handshake timeouts reported"
    );
}

/// A frame a handshake state does not allow is refused on its header: an
/// authenticated kind (Message) right after the Hello, and an Auth frame that
/// claims more than a MAC. The server never waits for the payload.
fn wrong_kind_or_size_is_refused_on_the_header<T: Hostile>() {
    let _g = serial();
    let hs = Duration::from_secs(5);
    let mut server: T = transport(0, hs);
    let l = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.listener_addr(l).unwrap();
    let claims = [
        Header::new(Kind::Message, 1 << 20),
        Header::new(Kind::Auth, 64 * 1024),
        Header::new(Kind::Regions, 100),
    ];
    for h in claims {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&hello()).unwrap();
        s.write_all(&h.encode()).unwrap();
        let start = Instant::now();
        let mut sevs = Vec::new();
        while !sevs.iter().any(|e| matches!(e, Event::PeerRejected { .. })) {
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "{h:?} was not refused on its header"
            );
            server.wait(&mut sevs, 1024, Duration::from_millis(2)).unwrap();
        }
        assert!(closed_within(&mut s, Duration::from_secs(1)), "{h:?}: socket left open");
        assert!(
            matches!(
                &sevs[..],
                [Event::PeerRejected {
                    error: Error::BadFrame { .. },
                    ..
                }]
            ),
            "{h:?}: {sevs:?}"
        );
    }
    assert_eq!(server.pre_auth_refused(), 3);
}

/// The dialling side is protected too: a "server" that answers the Hello with
/// a Challenge header claiming 1 MiB is refused on that header, at once, not
/// after the handshake deadline and without buffering the payload.
fn a_hostile_server_is_refused_on_its_first_header<T: Hostile>() {
    let _g = serial();
    let hs = Duration::from_secs(5);
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let mut hello = [0u8; frame::HEADER_LEN + 44];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&Header::new(Kind::Challenge, 1 << 20).encode()).unwrap();
        let _ = s.write_all(&vec![0u8; 256 << 10]);
        closed_within(&mut s, Duration::from_secs(3))
    });
    let mut client: T = transport(1, hs);
    let cc = client.connect(addr).unwrap();
    let start = Instant::now();
    let mut evs = Vec::new();
    let error = loop {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "not refused on the header: {evs:?}"
        );
        client.wait(&mut evs, 64, Duration::from_millis(5)).unwrap();
        if let Some(Event::Closed { error, .. }) = evs
            .iter()
            .find(|e| matches!(e, Event::Closed { conn, .. } if *conn == cc))
        {
            break error.as_ref().map(|e| e.to_string());
        }
    };
    let error = error.expect("a failure, not a graceful close");
    assert!(error.contains("Challenge") || error.contains("exceeds"), "{error}");
    assert!(
        server.join().unwrap(),
        "the client left the hostile server's socket open"
    );
}

/// A refused connection's last completions stay its own. Each attacker sends
/// a valid Hello, then a message header (refused before authentication) and
/// a payload behind it, so that more receive completions are on their way
/// when the server fails the connection; new attackers keep arriving, so new
/// handshakes keep taking operation slots. Every attacker must be refused on
/// its header: a slot freed while the kernel still had completions for it
/// would hand one (an end of stream) to the next handshake in that slot.
fn refused_connections_leave_no_completion_behind<T: Hostile>() {
    let _g = serial();
    const ATTACKERS: usize = 240;
    let hs = Duration::from_secs(10);
    let mut server: T = transport(0, hs);
    let l = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr: SocketAddr = server.listener_addr(l).unwrap();
    let mut evs = Vec::new();
    let attack = std::thread::spawn(move || {
        let mut frame = hello();
        frame.extend_from_slice(&Header::new(Kind::Message, 64 << 10).encode());
        frame.extend_from_slice(&vec![0x5au8; 64 << 10]);
        // Open until every attacker is refused: a close of ours is not the server's doing.
        let mut socks = Vec::with_capacity(ATTACKERS);
        for _ in 0..ATTACKERS {
            let mut s = TcpStream::connect(addr).unwrap();
            // The server may refuse (and close) before all of it is read.
            let _ = s.write_all(&frame);
            socks.push(s);
        }
        socks
    });
    let start = Instant::now();
    let refused = |evs: &Vec<Event>| evs.iter().filter(|e| matches!(e, Event::PeerRejected { .. })).count();
    while refused(&evs) < ATTACKERS {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{} of {ATTACKERS} refused after 30 s: {:?}",
            refused(&evs),
            server.stats_line()
        );
        server.wait(&mut evs, 1024, Duration::from_millis(1)).unwrap();
    }
    let socks = attack.join().unwrap();
    let not_on_header: Vec<_> = evs
        .iter()
        .filter(|e| {
            !matches!(
                e,
                Event::PeerRejected {
                    error: Error::BadFrame {
                        reason: FrameError::Unexpected { .. },
                        ..
                    },
                    ..
                } | Event::PeerRejected {
                    error: Error::TooManyHandshakes { .. },
                    ..
                }
            )
        })
        .collect();
    let on_header = ATTACKERS - not_on_header.len() - server.evicted() as usize;
    eprintln!(
        "{on_header} refused on the header, {} evicted (over {MAX_PENDING_HANDSHAKES} pending)",
        server.evicted()
    );
    assert!(
        not_on_header.is_empty(),
        "every attacker is refused on its message header or evicted; these were not: {not_on_header:#?}"
    );
    drop(socks);
}

/// Every case on both TCP backends.
macro_rules! on {
    ($backend:ident, $t:ty) => {
        mod $backend {
            #[test]
            fn fifty_big_frame_claims_before_auth_cost_little_and_are_closed() {
                super::fifty_big_frame_claims_before_auth_cost_little_and_are_closed::<$t>()
            }
            #[test]
            fn idle_connections_past_the_cap_do_not_keep_a_peer_out() {
                super::idle_connections_past_the_cap_do_not_keep_a_peer_out::<$t>()
            }
            #[test]
            fn wrong_kind_or_size_is_refused_on_the_header() {
                super::wrong_kind_or_size_is_refused_on_the_header::<$t>()
            }
            #[test]
            fn refused_connections_leave_no_completion_behind() {
                super::refused_connections_leave_no_completion_behind::<$t>()
            }
            #[test]
            fn a_hostile_server_is_refused_on_its_first_header() {
                super::a_hostile_server_is_refused_on_its_first_header::<$t>()
            }
        }
    };
}
on!(uring, tidewire_transport::TcpTransport);
on!(portable, tidewire_transport::PortableTransport);
