//! The conformance suite on the io_uring TCP backend with `lazy_acks` on (as
//! Tidewire's runtime runs it): held Acks must never leave a write incomplete
//! while both sides keep calling `wait`. And the default, off: a receiver that
//! stops driving its transport right after the `wait` that placed a write has
//! already acknowledged it.

mod conformance;

use std::time::{Duration, Instant};

use conformance::{Backend, Opts};
use tidewire_transport::{Access, Event, JobSecret, TcpConfig, TcpTransport, Transport};

struct TcpLazy;

impl Backend for TcpLazy {
    type T = TcpTransport;
    fn make(o: &Opts) -> TcpTransport {
        let mut cfg = TcpConfig::new(o.job_id, o.rank, JobSecret::new(o.secret.clone()));
        cfg.handshake_timeout = o.handshake_timeout;
        cfg.max_outstanding = o.max_outstanding;
        cfg.lazy_acks = true;
        if let Some(b) = o.busy_poll {
            cfg.busy_poll = b;
        }
        if let Some(m) = o.max_message_bytes {
            cfg.max_message_bytes = m;
        }
        TcpTransport::new(cfg).expect("io_uring transport")
    }
}

conformance_suite!(TcpLazy);

/// One write, then the receiver runs `wait` until the write is placed and
/// stops; the writer drives only itself. Returns whether the write completed
/// within 3 s, and whether it did within 3 s after one more idle `wait` of the
/// receiver.
fn completes_after_the_receiver_stops(lazy: bool) -> (bool, bool) {
    let mk = |rank| {
        let mut cfg = TcpConfig::new(conformance::JOB, rank, JobSecret::new(conformance::SECRET.to_vec()));
        cfg.busy_poll = Duration::ZERO;
        cfg.lazy_acks = lazy;
        TcpTransport::new(cfg).unwrap()
    };
    let mut p = conformance::Pair::with(mk(0), mk(1), TcpLazy::listen_addr());
    let src = p.c.register(conformance::buf(4096), Access::LOCAL).unwrap();
    let dst = p.s_remote();
    p.c.write(p.cc, &src.slice(0, 64).unwrap(), &dst, 0, Some(7)).unwrap();
    let mut ev = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    while !ev.iter().any(|e| matches!(e, Event::WriteReceived { .. })) {
        assert!(Instant::now() < end, "the write never landed: {ev:?}");
        p.c.wait(&mut Vec::new(), 16, Duration::ZERO).unwrap();
        p.s.wait(&mut ev, 16, Duration::from_millis(10)).unwrap();
    }
    let done = |c: &mut TcpTransport| {
        let end = Instant::now() + Duration::from_secs(3);
        let mut cev = Vec::new();
        while Instant::now() < end {
            c.wait(&mut cev, 16, Duration::from_millis(10)).unwrap();
            if cev.iter().any(|e| matches!(e, Event::WriteDone { .. })) {
                return true;
            }
        }
        false
    };
    // The server is not driven while the client waits.
    let first = done(&mut p.c);
    // One more wait of the server, with nothing to do: it goes idle.
    p.s.wait(&mut Vec::new(), 16, Duration::from_millis(10)).unwrap();
    (first, first || done(&mut p.c))
}

#[test]
fn by_default_the_wait_that_places_a_write_acknowledges_it() {
    assert!(
        completes_after_the_receiver_stops(false).0,
        "without lazy_acks, a receiver that stops after placing a write must have acknowledged it"
    );
}

#[test]
fn lazy_acks_wait_for_the_receivers_next_wait() {
    // What `lazy_acks` trades: the Ack is held while the receiver is not driven
    // (this is why it is off by default), and goes out when its next wait idles.
    let (first, after) = completes_after_the_receiver_stops(true);
    assert!(!first, "the held Ack went out without a wait");
    assert!(after, "the held Ack did not go out when the receiver's wait went idle");
}
