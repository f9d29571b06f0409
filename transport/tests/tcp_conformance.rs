//! The conformance suite on the io_uring TCP backend.

mod conformance;

use conformance::{Backend, Opts};
use tidewire_transport::{JobSecret, TcpConfig, TcpTransport};

struct Tcp;

impl Backend for Tcp {
    type T = TcpTransport;
    fn make(o: &Opts) -> TcpTransport {
        let mut cfg = TcpConfig::new(o.job_id, o.rank, JobSecret::new(o.secret.clone()));
        cfg.handshake_timeout = o.handshake_timeout;
        cfg.max_outstanding = o.max_outstanding;
        TcpTransport::new(cfg).expect("io_uring transport")
    }
}

conformance_suite!(Tcp);
