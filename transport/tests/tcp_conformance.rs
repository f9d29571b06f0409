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
