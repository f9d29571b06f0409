//! TCP-only checks: the one-sided receive path copies large payloads in user
//! space only up to one read-ahead buffer, and the SEND_ZC path delivers the same bytes.

mod conformance;

use conformance::{buf, Opts, Pair};
use tidewire_transport::{Access, Event, JobSecret, Region, RemoteRegion, TcpConfig, TcpTransport, Transport};

fn make(o: &Opts, zc: Option<usize>) -> TcpTransport {
    let mut cfg = TcpConfig::new(o.job_id, o.rank, JobSecret::new(o.secret.clone()));
    cfg.send_zc_min_bytes = zc;
    TcpTransport::new(cfg).unwrap()
}

fn pair(zc: Option<usize>) -> Pair<TcpTransport> {
    Pair::with(
        make(&Opts::rank(0), None),
        make(&Opts::rank(1), zc),
        "127.0.0.1:0".parse().unwrap(),
    )
}

/// Waits until the client has learned `land` from the server, and returns its descriptor.
fn announced(p: &mut Pair<TcpTransport>, land: &Region) -> RemoteRegion {
    p.pump("region announced", |e| {
        e[1].iter()
            .filter(|x| matches!(x, Event::RemoteRegionsChanged { .. }))
            .count()
            >= 2
    });
    p.c.remote_regions(p.cc)
        .unwrap()
        .into_iter()
        .find(|r| r.rkey == land.key())
        .unwrap()
}

#[test]
fn one_sided_receive_copies_no_payload_in_user_space() {
    let mut p = pair(None);
    let len = 32 << 20;
    let land = p.s.register(buf(len), Access::REMOTE_WRITE).unwrap();
    let src = p.c.register(buf(len), Access::LOCAL).unwrap();
    src.fill(0, len, 0x5c).unwrap();
    let dst = announced(&mut p, &land);

    let before = p.s.stats();
    for i in 0..4 {
        p.c.write(
            p.cc,
            &src.slice(0, len / 4).unwrap(),
            &dst,
            (i * len / 4) as u64,
            Some(i as u32),
        )
        .unwrap();
    }
    p.pump("32 MiB written", |e| {
        e[1].iter().filter(|x| matches!(x, Event::WriteDone { .. })).count() == 4
    });
    let after = p.s.stats();
    // Every payload byte went straight from the socket into the region, but for at
    // most one read-ahead buffer (64 KiB) of the start of each write...
    let direct = after.rx_write_direct_bytes - before.rx_write_direct_bytes;
    let staged = after.rx_write_staged_bytes - before.rx_write_staged_bytes;
    assert_eq!(direct + staged, len as u64);
    assert!(staged <= 4 * 64 * 1024, "{staged} bytes staged of {len}");
    // ...and user space copied only control bytes (acks are header-only; nothing near the payload size).
    let copied = after.rx_user_copy_bytes - before.rx_user_copy_bytes;
    assert!(
        copied < 4096,
        "user space copied {copied} bytes while receiving {len} bytes of writes"
    );
    let mut chk = vec![0u8; len];
    land.read_at(0, &mut chk).unwrap();
    assert!(chk.iter().all(|&b| b == 0x5c));

    // The counter is live: a message of the same path-size shows up in it.
    let m = 256 * 1024;
    p.c.send(p.cc, &src.slice(0, m).unwrap(), 0).unwrap();
    p.pump("message", |e| e[0].iter().any(|x| matches!(x, Event::Message { .. })));
    assert!(p.s.stats().rx_user_copy_bytes - after.rx_user_copy_bytes >= m as u64);
}

#[test]
fn send_zc_path_delivers_the_same_bytes() {
    let mut p = pair(Some(4096));
    let len = 8 << 20;
    let land = p.s.register(buf(len), Access::REMOTE_WRITE).unwrap();
    let src = p.c.register(buf(len), Access::LOCAL).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    src.write_at(0, &data).unwrap();
    let dst = announced(&mut p, &land);
    // Mixed sizes: below the threshold (gathered SENDMSG) and above it (SEND_ZC).
    let mut off = 0usize;
    let mut n = 0;
    for sz in [100usize, 4096, 1 << 20, 7, 3 << 20, 65536] {
        p.c.write(p.cc, &src.slice(off, sz).unwrap(), &dst, off as u64, None)
            .unwrap();
        off += sz;
        n += 1;
    }
    p.pump("all written", |e| {
        e[1].iter().filter(|x| matches!(x, Event::WriteDone { .. })).count() == n
    });
    assert!(p.c.stats().tx_zc_writes >= 3, "{:?}", p.c.stats());
    let mut got = vec![0u8; off];
    land.read_at(0, &mut got).unwrap();
    assert!(got == data[..off], "SEND_ZC corrupted the payload");
    // The region stays busy until the kernel's notification, then frees.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while src.in_flight() > 0 {
        p.c.poll(&mut Vec::new(), 64).unwrap();
        assert!(
            std::time::Instant::now() < deadline,
            "SEND_ZC notification never released the region"
        );
    }
    p.c.deregister(&src).unwrap();
}
