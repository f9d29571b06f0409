//! The conformance suite on the portable (epoll) TCP backend.

mod conformance;

use conformance::{Backend, Opts};
use tidewire_transport::{JobSecret, PortableTransport, TcpConfig};

#[derive(Debug)]
pub struct Portable;

/// The backends' shared configuration from the suite's knobs.
pub fn config(o: &Opts) -> TcpConfig {
    let mut cfg = TcpConfig::new(o.job_id, o.rank, JobSecret::new(o.secret.clone()));
    cfg.handshake_timeout = o.handshake_timeout;
    cfg.max_outstanding = o.max_outstanding;
    if let Some(b) = o.busy_poll {
        cfg.busy_poll = b;
    }
    if let Some(m) = o.max_message_bytes {
        cfg.max_message_bytes = m;
    }
    cfg
}

impl Backend for Portable {
    type T = PortableTransport;
    fn make(o: &Opts) -> PortableTransport {
        PortableTransport::new(config(o)).expect("portable transport")
    }
}

conformance_suite!(Portable);

/// An idle wait with no busy polling is one sleep in epoll_wait (a few polls at most).
#[test]
fn idle_wait_is_one_sleep_in_epoll() {
    use tidewire_transport::Transport;
    let quiet = |rank| {
        let mut o = Opts::rank(rank);
        o.busy_poll = Some(std::time::Duration::ZERO);
        Portable::make(&o)
    };
    let mut p = conformance::Pair::with(quiet(0), quiet(1), Portable::listen_addr());
    conformance::quiesce(&mut p.s);
    conformance::quiesce(&mut p.c);
    let before = p.c.stats().polls;
    let start = std::time::Instant::now();
    let n =
        p.c.wait(&mut Vec::new(), 16, std::time::Duration::from_secs(1))
            .unwrap();
    let polls = p.c.stats().polls - before;
    assert_eq!(n, 0);
    assert!(start.elapsed() >= std::time::Duration::from_millis(950));
    assert!(polls <= 3, "{polls} epoll_wait calls in an idle 1 s wait");
}

/// More than MAX_PENDING_HANDSHAKES silent sockets: the oldest are closed at
/// once (as in the io_uring backend), and a real peer gets in while the
/// newest silent ones are still pending; those time out at the deadline.
#[test]
fn pending_handshakes_are_capped() {
    use std::time::{Duration, Instant};
    use tidewire_transport::handshake::MAX_PENDING_HANDSHAKES;
    use tidewire_transport::{Error, Event, Transport};
    let hs_timeout = Duration::from_secs(3);
    let mut o = Opts::rank(0);
    o.handshake_timeout = hs_timeout;
    let mut s = Portable::make(&o);
    let l = s.listen(Portable::listen_addr()).unwrap();
    let addr = s.listener_addr(l).unwrap();
    let t0 = Instant::now();
    let silent: Vec<_> = (0..MAX_PENDING_HANDSHAKES + 8)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    let mut ev = Vec::new();
    let count = |ev: &[Event], f: fn(&Error) -> bool| {
        ev.iter()
            .filter(|e| matches!(e, Event::PeerRejected { error, .. } if f(error)))
            .count()
    };
    let evicted = |e: &Error| matches!(e, Error::TooManyHandshakes { .. });
    let timed_out = |e: &Error| matches!(e, Error::Timeout { .. });
    while count(&ev, evicted) < 8 {
        assert!(t0.elapsed() < hs_timeout, "the oldest were not evicted: {ev:?}");
        s.poll(&mut ev, 1024).unwrap();
    }
    assert_eq!(s.stats().refused_over_limit, 8);
    // A real client gets in at once: it evicts the oldest silent socket.
    let mut c = Portable::make(&Opts::rank(1));
    c.connect(addr).unwrap();
    let mut cev = Vec::new();
    while !cev.iter().any(|e| matches!(e, Event::Connected { .. })) {
        assert!(
            t0.elapsed() < hs_timeout,
            "client did not connect before the silent sockets' deadline: {cev:?}"
        );
        s.poll(&mut ev, 1024).unwrap();
        c.poll(&mut cev, 1024).unwrap();
    }
    assert!(count(&ev, timed_out) == 0, "nothing timed out yet: {ev:?}");
    assert!(s.accept(l).unwrap().is_some());
    // The rest time out at the handshake deadline.
    let deadline = t0 + hs_timeout + Duration::from_secs(5);
    while count(&ev, timed_out) + count(&ev, evicted) < MAX_PENDING_HANDSHAKES + 8 {
        assert!(Instant::now() < deadline, "silent peers did not time out: {ev:?}");
        s.wait(&mut ev, 1024, Duration::from_millis(100)).unwrap();
        c.poll(&mut cev, 1024).unwrap();
    }
    drop(silent);
}

/// A peer that keeps sending Reject-sized junk before authenticating is cut off
/// by the header checks (an unexpected kind is refused before its payload is read).
#[test]
fn unexpected_kind_refused_before_payload() {
    use std::io::Write;
    use tidewire_transport::frame::{Header, Kind};
    use tidewire_transport::{Event, Transport};
    let mut s = Portable::make(&Opts::rank(0));
    let l = s.listen(Portable::listen_addr()).unwrap();
    let mut raw = std::net::TcpStream::connect(s.listener_addr(l).unwrap()).unwrap();
    // A Message header promising 16 MiB: refused from the header alone.
    raw.write_all(&Header::new(Kind::Message, 16 << 20).encode()).unwrap();
    let mut ev = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !ev.iter().any(|e| matches!(e, Event::PeerRejected { .. })) {
        assert!(std::time::Instant::now() < deadline);
        s.poll(&mut ev, 64).unwrap();
    }
}

/// The data socket's DataAttach may reach the server before the control
/// socket's Auth (two sockets race): the server parks it until the Auth is in.
#[test]
fn data_attach_before_auth_is_parked_not_refused() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    use tidewire_transport::frame::{self, HEADER_LEN};
    use tidewire_transport::handshake::{Handshake, Outcome, Params};
    use tidewire_transport::{Event, Transport};
    let mut s = Portable::make(&Opts::rank(0));
    let l = s.listen(Portable::listen_addr()).unwrap();
    let addr = s.listener_addr(l).unwrap();
    let p = Params {
        job_id: conformance::JOB,
        rank: 7,
        secret: JobSecret::new(conformance::SECRET.to_vec()),
    };
    let now = Instant::now();
    let (mut hs, hello) = Handshake::client(&p, "server", now, now + Duration::from_secs(5));
    let mut ctrl = std::net::TcpStream::connect(addr).unwrap();
    ctrl.write_all(&hello.to_bytes()).unwrap();
    ctrl.set_nonblocking(true).unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    let (h, total) = loop {
        s.poll(&mut Vec::new(), 64).unwrap();
        let mut b = [0u8; 256];
        if let Ok(n) = ctrl.read(&mut b) {
            got.extend_from_slice(&b[..n]);
        }
        if let Ok(Some(x)) = frame::next_frame(&got, 4096) {
            break x;
        }
        assert!(Instant::now() < deadline, "no challenge");
    };
    let hb: [u8; HEADER_LEN] = got[..HEADER_LEN].try_into().unwrap();
    let h2 = hs.on_header(&hb).map_err(|r| r.error).unwrap();
    assert_eq!(h, h2);
    let Outcome::OpenData { send: auth, attach } = hs.on_frame(&p, &h, &got[HEADER_LEN..total]).unwrap() else {
        panic!("no OpenData")
    };
    // The data socket first, and the server driven meanwhile; the Auth only later.
    let mut data = std::net::TcpStream::connect(addr).unwrap();
    data.write_all(&attach.to_bytes()).unwrap();
    let mut ev = Vec::new();
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(200) {
        s.poll(&mut ev, 64).unwrap();
    }
    assert!(!ev.iter().any(|e| matches!(e, Event::PeerRejected { .. })), "{ev:?}");
    ctrl.set_nonblocking(false).unwrap();
    ctrl.write_all(&auth.to_bytes()).unwrap();
    while !ev.iter().any(|e| matches!(e, Event::Incoming { .. })) {
        assert!(Instant::now() < deadline, "never established: {ev:?}");
        s.poll(&mut ev, 64).unwrap();
    }
    let (_, peer) = s.accept(l).unwrap().unwrap();
    assert_eq!(peer.rank, 7);
}
