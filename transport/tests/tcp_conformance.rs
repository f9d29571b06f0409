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

/// Read-ahead on the data socket: 1000 small writes (random sizes 1..=8192, a
/// third of them 1..=64, at random offsets), three large ones (1-4 MiB) and two rejected ones (a forged
/// region: one small, one large) interleave on one connection. Small socket
/// buffers cut the stream into many receives, so write headers arrive split
/// across them. The target must end up byte-exact, every write after a
/// rejection must still land, and only the forged writes fail.
/// `TIDEWIRE_SEED` replays a run (the seed is printed).
#[test]
fn read_ahead_small_and_large_writes_interleave_byte_exact() {
    use conformance::{buf, count, Pair};
    use std::collections::HashSet;
    use tidewire_transport::{Access, Error, Event, RemoteRegion};

    let seed: u64 = std::env::var("TIDEWIRE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("read-ahead test seed: {seed} (TIDEWIRE_SEED={seed} replays it)");
    let mut x = seed;
    let mut rnd = move |n: usize| -> usize {
        // xorshift64*
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as usize % n
    };

    let make = |rank: u32, rcvbuf: Option<usize>| {
        let o = Opts::rank(rank);
        let mut cfg = TcpConfig::new(o.job_id, o.rank, JobSecret::new(o.secret.clone()));
        cfg.rcvbuf_bytes = rcvbuf;
        TcpTransport::new(cfg).unwrap()
    };
    // A small receive buffer at the target cuts the stream into many receives.
    let mut p = Pair::with(make(0, Some(16 * 1024)), make(1, None), "127.0.0.1:0".parse().unwrap());
    const LAND: usize = 8 << 20;
    let land = p.s.register(buf(LAND), Access::REMOTE_WRITE).unwrap();
    let src = p.c.register(buf(LAND), Access::LOCAL).unwrap();
    let data: Vec<u8> = (0..LAND).map(|_| rnd(256) as u8).collect();
    src.write_at(0, &data).unwrap();
    p.pump("region announced", |e| {
        e[1].iter()
            .filter(|x| matches!(x, Event::RemoteRegionsChanged { .. }))
            .count()
            >= 2
    });
    let dst =
        p.c.remote_regions(p.cc)
            .unwrap()
            .into_iter()
            .find(|r| r.rkey == land.key())
            .unwrap();
    let forged = RemoteRegion {
        rkey: dst.rkey ^ 0x5a5a_5a5a,
        ..dst
    };
    let before = p.s.stats();

    let mut model = vec![0u8; LAND];
    let mut posted = 0usize;
    let mut bad = HashSet::new();
    for i in 0..1000 {
        let (len, reject) = match i {
            250 | 500 | 750 => ((1 << 20) + rnd(3 << 20), false),
            400 => (1 + rnd(8192), true),
            600 => (2 << 20, true),
            // A third are tiny, so headers fill much of the stream and often straddle receives.
            _ if rnd(3) == 0 => (1 + rnd(64), false),
            _ => (1 + rnd(8192), false),
        };
        let off = rnd(LAND - len + 1);
        let from = rnd(LAND - len + 1);
        let d = if reject { &forged } else { &dst };
        let slice = src.slice(from, len).unwrap();
        let req = loop {
            match p.c.write(p.cc, &slice, d, off as u64, None) {
                Ok(r) => break r,
                Err(Error::WouldBlock { .. }) => {
                    let evs = &mut p.evs;
                    p.s.poll(&mut evs[0], 1024).unwrap();
                    p.c.poll(&mut evs[1], 1024).unwrap();
                }
                Err(e) => panic!("write {i}: {e}"),
            }
        };
        posted += 1;
        if reject {
            bad.insert(req);
        } else {
            model[off..off + len].copy_from_slice(&data[from..from + len]);
        }
    }
    p.pump("every write completed or failed", |e| {
        count(&e[1], |x| {
            matches!(
                x,
                Event::WriteDone { .. } | Event::OpFailed { .. } | Event::Closed { .. }
            )
        }) >= posted
    });
    let failed: HashSet<_> = p.evs[1]
        .iter()
        .filter_map(|e| match e {
            Event::OpFailed { req, .. } => Some(*req),
            _ => None,
        })
        .collect();
    assert_eq!(
        failed,
        bad,
        "seed {seed}: only the forged writes fail; {:?}",
        p.evs[1].iter().find(|e| matches!(e, Event::Closed { .. }))
    );
    assert_eq!(count(&p.evs[0], |x| matches!(x, Event::WriteRejected { .. })), 2);
    let mut got = vec![0u8; LAND];
    land.read_at(0, &mut got).unwrap();
    if let Some(at) = got.iter().zip(&model).position(|(a, b)| a != b) {
        panic!("seed {seed}: target differs from the expected bytes at offset {at}");
    }
    let st = p.s.stats();
    let staged = st.rx_write_staged_bytes - before.rx_write_staged_bytes;
    let direct = st.rx_write_direct_bytes - before.rx_write_direct_bytes;
    let split = st.rx_headers_split - before.rx_headers_split;
    println!("staged {staged} B, direct {direct} B, split headers {split}");
    assert!(staged > 0 && direct > 0, "seed {seed}: {st:?}");
    // Not asserted: whether a receive ends inside a header depends on timing
    // (about four runs in five see at least one here).
    if split == 0 {
        println!("note: no header arrived split across receives this run");
    }
}
