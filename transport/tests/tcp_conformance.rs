//! The conformance suite on the io_uring TCP backend.

mod conformance;

use conformance::{Backend, Opts};
use tidewire_transport::{JobSecret, TcpConfig, TcpTransport, Transport};

struct Tcp;

impl Backend for Tcp {
    type T = TcpTransport;
    fn make(o: &Opts) -> TcpTransport {
        let mut cfg = TcpConfig::new(o.job_id, o.rank, JobSecret::new(o.secret.clone()));
        cfg.handshake_timeout = o.handshake_timeout;
        cfg.max_outstanding = o.max_outstanding;
        if let Some(b) = o.busy_poll {
            cfg.busy_poll = b;
        }
        if let Some(m) = o.max_message_bytes {
            cfg.max_message_bytes = m;
        }
        TcpTransport::new(cfg).expect("io_uring transport")
    }
}

conformance_suite!(Tcp);

/// An idle wait with no busy polling is one sleep in `io_uring_enter`: no
/// periodic timer (handshake and close deadlines are the only ones, and an
/// established, idle connection has neither) cuts it into slices.
#[test]
fn idle_wait_is_one_sleep_in_the_kernel() {
    let quiet = |rank| {
        let mut o = Opts::rank(rank);
        o.busy_poll = Some(std::time::Duration::ZERO);
        Tcp::make(&o)
    };
    let mut p = conformance::Pair::with(quiet(0), quiet(1), Tcp::listen_addr());
    conformance::quiesce(&mut p.s);
    conformance::quiesce(&mut p.c);
    let before = p.c.stats().submits;
    let start = std::time::Instant::now();
    let n =
        p.c.wait(&mut Vec::new(), 16, std::time::Duration::from_secs(1))
            .unwrap();
    let enters = p.c.stats().submits - before;
    assert_eq!(n, 0);
    assert!(start.elapsed() >= std::time::Duration::from_millis(950));
    // One non-blocking submit up front, then one blocking enter for the whole second.
    assert!(enters <= 2, "{enters} io_uring_enter calls in an idle 1 s wait");
}

/// A write the peer never acknowledges fails after `peer_timeout` even while the
/// writer sleeps in one long `wait`: the acknowledgement deadline bounds the sleep.
#[test]
fn unacknowledged_write_ends_a_long_wait() {
    use std::time::{Duration, Instant};
    use tidewire_transport::{Access, Error, Event};
    let mk = |rank, peer_timeout| {
        let mut cfg = TcpConfig::new(conformance::JOB, rank, JobSecret::new(conformance::SECRET.to_vec()));
        cfg.busy_poll = Duration::ZERO;
        cfg.peer_timeout = peer_timeout;
        TcpTransport::new(cfg).unwrap()
    };
    let mut p = conformance::Pair::with(
        mk(0, Duration::from_secs(30)),
        mk(1, Duration::from_millis(300)),
        Tcp::listen_addr(),
    );
    let src = p.c.register(conformance::buf(4096), Access::LOCAL).unwrap();
    let dst = p.s_remote();
    p.c.write(p.cc, &src.slice(0, 64).unwrap(), &dst, 0, None).unwrap();
    // The server is never driven again, so it never acknowledges.
    let start = Instant::now();
    let mut ev = Vec::new();
    let timed_out = |ev: &[Event]| {
        ev.iter().any(|e| {
            matches!(
                e,
                Event::Closed {
                    error: Some(Error::Timeout { .. }),
                    ..
                }
            )
        })
    };
    while !timed_out(&ev) {
        assert!(start.elapsed() < Duration::from_secs(5), "no timeout yet: {ev:?}");
        p.c.wait(&mut ev, 16, Duration::from_secs(10)).unwrap();
    }
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
}
