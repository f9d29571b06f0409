//! Criterion benches for the data path's hot loop: posting work and polling
//! for its completion.
//!
//! - `tcp/*`: the io_uring TCP transport through the `Transport` API, on a
//!   loopback pair driven from one thread: posting 64 one-sided writes of 64 B
//!   and polling until all complete, and one write of 64 B posted and polled to
//!   completion.
//! - `rdma/*` (built with `--features rdma`, run where a device is, e.g. in the
//!   soft-RoCE VM): bare RC queue pairs (`rdma::raw`, what tidewire-perf posts
//!   with), two queue pairs on one device connected to each other: one signalled
//!   2-byte RDMA WRITE posted and polled to completion, and 16 unsignalled plus
//!   one signalled in one doorbell. Without a device the group is skipped and
//!   says why, on stderr.
//!
//! `cargo bench -p tidewire-bench --bench post_poll [--features rdma]`

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tidewire_transport::{Access, ConnId, Event, JobSecret, PinnedBuffer, TcpConfig, TcpTransport, Transport};

fn tcp_pair() -> (
    TcpTransport,
    TcpTransport,
    ConnId,
    tidewire_transport::RemoteRegion,
    tidewire_transport::Region,
) {
    let cfg = |rank| {
        let mut c = TcpConfig::new(0xb0b, rank, JobSecret::new(b"bench".to_vec()));
        c.max_outstanding = 1024;
        c
    };
    let mut srv = TcpTransport::new(cfg(0)).expect("transport");
    let mut cli = TcpTransport::new(cfg(1)).expect("transport");
    let l = srv.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = srv.listener_addr(l).unwrap();
    srv.register(PinnedBuffer::new(1 << 20).unwrap(), Access::REMOTE_WRITE)
        .unwrap();
    let src = cli
        .register(PinnedBuffer::new(1 << 20).unwrap(), Access::LOCAL)
        .unwrap();
    let conn = cli.connect(addr).unwrap();
    let mut ev = Vec::new();
    let dst = loop {
        srv.poll(&mut ev, 64).unwrap();
        let _ = srv.accept(l).unwrap();
        ev.clear();
        cli.wait(&mut ev, 64, Duration::from_millis(1)).unwrap();
        ev.clear();
        if let Some(r) = cli.remote_regions(conn).ok().and_then(|v| v.into_iter().next()) {
            break r;
        }
    };
    (srv, cli, conn, dst, src)
}

fn drain(srv: &mut TcpTransport, cli: &mut TcpTransport, ev: &mut Vec<Event>, mut want: usize) {
    while want > 0 {
        ev.clear();
        srv.poll(ev, 1024).unwrap();
        ev.clear();
        cli.poll(ev, 1024).unwrap();
        want -= ev.iter().filter(|e| matches!(e, Event::WriteDone { .. })).count();
    }
}

fn tcp(c: &mut Criterion) {
    let (mut srv, mut cli, conn, dst, src) = tcp_pair();
    let s = src.slice(0, 64).unwrap();
    let mut ev = Vec::with_capacity(1024);
    let mut g = c.benchmark_group("tcp");
    g.throughput(Throughput::Elements(64));
    g.bench_function("post64_poll_64B_writes", |b| {
        b.iter(|| {
            for i in 0..64u64 {
                cli.write(conn, &s, &dst, i * 64, None).unwrap();
            }
            drain(&mut srv, &mut cli, &mut ev, 64);
        })
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("post1_poll_64B_write", |b| {
        b.iter(|| {
            cli.write(conn, &s, &dst, 0, None).unwrap();
            drain(&mut srv, &mut cli, &mut ev, 1);
        })
    });
    g.finish();
}

#[cfg(feature = "rdma")]
fn rdma(c: &mut Criterion) {
    use tidewire_transport::rdma::raw::{RawConfig, RawEndpoint, RawOp, RawWc, RawWr};
    let mut ep = match RawEndpoint::open(RawConfig {
        qps: 2,
        half_bytes: 4096,
        ..Default::default()
    }) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("SKIPPED: rdma post/poll benches: {e}");
            return;
        }
    };
    let (d0, d1) = (ep.local(0), ep.local(1));
    let mtu = ep.mtu_code();
    ep.connect(0, &d1, mtu).expect("connect 0 -> 1");
    ep.connect(1, &d0, mtu).expect("connect 1 -> 0");
    let wr = |signaled| RawWr {
        wr_id: 1,
        op: RawOp::Write,
        local: ep.source_offset(0),
        len: 2,
        remote: d1.vaddr,
        rkey: d1.rkey,
        signaled,
        inline: false,
    };
    let one = [wr(true)];
    let mut batch: Vec<RawWr> = (0..16).map(|_| wr(false)).collect();
    batch.push(wr(true));
    let mut wcs: Vec<RawWc> = Vec::with_capacity(64);
    let mut g = c.benchmark_group("rdma");
    g.throughput(Throughput::Elements(1));
    g.bench_function("post1_poll_2B_write", |b| {
        b.iter(|| {
            ep.post_send(0, &one).unwrap();
            wcs.clear();
            while ep.poll(&mut wcs).unwrap() == 0 {}
            assert_eq!(wcs[0].status, 0);
        })
    });
    g.throughput(Throughput::Elements(17));
    g.bench_function("post17_one_doorbell_poll_2B_writes", |b| {
        b.iter(|| {
            ep.post_send(0, &batch).unwrap();
            wcs.clear();
            while ep.poll(&mut wcs).unwrap() == 0 {}
            assert_eq!(wcs[0].status, 0);
        })
    });
    g.finish();
}

#[cfg(not(feature = "rdma"))]
fn rdma(_: &mut Criterion) {
    eprintln!("SKIPPED: rdma post/poll benches: built without the `rdma` feature");
}

criterion_group!(benches, tcp, rdma);
criterion_main!(benches);
