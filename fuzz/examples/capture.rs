//! Records real traffic into the fuzz targets' seed corpora (fuzz/corpus/<target>/seed-*).
//!
//! A recording relay sits between the real peers on loopback and keeps every
//! byte each way: a TcpTransport client and server (handshake, region
//! announcement, a write with an immediate, engine messages sent as transport
//! messages), a rendezvous (rank 0's Host and a joining rank: agreement, a
//! configuration mismatch, a wrong job), and a tidewire-perf out-of-band
//! exchange (versions, system data, MTU, keys with and without GID, BW report,
//! close). The RDMA control messages need a device to be produced live; their
//! seeds come from the RDMA backend's own encoders with the values a soft-RoCE
//! run exchanges.
//!
//! Run from the repository root: cargo run --release --manifest-path fuzz/Cargo.toml --example capture
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use tidewire_bench::perf::oob::{BwReport, Dest, Oob, Signature};
use tidewire_engine::agree::JobConfig;
use tidewire_engine::book::{Book, BookConfig, Cluster, LayerKind, LayerSpec};
use tidewire_engine::wire::{self, Hello, Msg};
use tidewire_engine::{ApplyOp, SchedConfig};
use tidewire_transport::frame::{next_frame, Challenge, Header, Kind, HEADER_LEN, MAX_WRITE_BYTES};
use tidewire_transport::rdma::wire::{encode_abort, Notice, QpInfo};
use tidewire_transport::{Access, Event, JobSecret, PinnedBuffer, TcpConfig, TcpTransport, Transport};

type Log = Arc<Mutex<Vec<u8>>>;

/// A relay to `target` that records each accepted connection's two directions:
/// (client to server, server to client), in accept order.
fn relay(target: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<(Log, Log)>>>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("relay bind");
    let addr = l.local_addr().expect("relay addr");
    let conns: Arc<Mutex<Vec<(Log, Log)>>> = Arc::default();
    let c2 = conns.clone();
    thread::spawn(move || {
        for a in l.incoming() {
            let Ok(a) = a else { return };
            let b = TcpStream::connect(target).expect("relay connect");
            let _ = (a.set_nodelay(true), b.set_nodelay(true));
            let (up, down): (Log, Log) = Default::default();
            c2.lock().unwrap().push((up.clone(), down.clone()));
            pump(a.try_clone().unwrap(), b.try_clone().unwrap(), up);
            pump(b, a, down);
        }
    });
    (addr, conns)
}

fn pump(mut from: TcpStream, mut to: TcpStream, log: Log) {
    thread::spawn(move || {
        let mut buf = [0u8; 65536];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    return;
                }
                Ok(n) => {
                    log.lock().unwrap().extend_from_slice(&buf[..n]);
                    if to.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    });
}

fn seed(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("fuzz/corpus").join(target);
    std::fs::create_dir_all(&dir).expect("corpus dir");
    std::fs::write(dir.join(format!("seed-{name}")), bytes).expect("write seed");
    println!("{target}/seed-{name}: {} bytes", bytes.len());
}

fn job_config(batch: usize) -> JobConfig {
    let book = Book::new(
        Cluster::split(2, 1).expect("cluster"),
        vec![LayerSpec::new("fc", LayerKind::Fc, 10, 20)],
        BookConfig {
            batch,
            ..Default::default()
        },
    )
    .expect("book");
    JobConfig::new(&book, &SchedConfig::default(), ApplyOp::Mean, "tcp")
}

/// Frames of a captured stream: (header, payload).
fn frames(stream: &[u8]) -> Vec<(Header, Vec<u8>)> {
    let mut out = Vec::new();
    let mut b = stream;
    while let Ok(Some((h, total))) = next_frame(b, MAX_WRITE_BYTES) {
        out.push((h, b[HEADER_LEN..total].to_vec()));
        b = &b[total..];
    }
    out
}

fn transport() {
    let secret = JobSecret::new(b"captured for the fuzz corpus".to_vec());
    let mut server = TcpTransport::new(TcpConfig::new(42, 0, secret.clone())).expect("server");
    let l = server.listen("127.0.0.1:0".parse().unwrap()).expect("listen");
    let _landing = server
        .register(PinnedBuffer::new(1 << 16).expect("buffer"), Access::REMOTE_WRITE)
        .expect("register");
    let (addr, conns) = relay(server.listener_addr(l).expect("addr"));
    let mut client = TcpTransport::new(TcpConfig::new(42, 1, secret)).expect("client");
    let conn = client.connect(addr).expect("connect");
    let src = client
        .register(PinnedBuffer::new(1 << 16).expect("buffer"), Access::LOCAL)
        .expect("register");
    let mut ev = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.remote_regions(conn).expect("regions").is_empty() {
        assert!(Instant::now() < deadline, "the handshake did not complete");
        server.poll(&mut ev, 64).expect("poll");
        client.wait(&mut ev, 64, Duration::from_millis(5)).expect("wait");
    }
    let dst = client.remote_regions(conn).expect("regions")[0];
    src.write_at(0, b"gradient bytes").expect("write_at");
    client
        .write(conn, &src.slice(0, 14).unwrap(), &dst, 128, Some(7))
        .expect("write");
    // The engine's rank protocol, as a Node sends it: one transport message per message.
    let cfg = job_config(32);
    let msgs = [
        Msg::Hello(Hello {
            version: 1,
            rank: 1,
            world: 3,
            keys: [0x1001, 0x1002, 0],
            params_base: 0,
            max_message: 16 << 20,
            max_write: 1 << 30,
            fields: cfg.fields().to_vec(),
        }),
        Msg::Credit(vec![0, 1, 2, 3]),
        Msg::FactorsBegin {
            layer: 0,
            iter: 3,
            total: 120,
        },
        Msg::Finished { writes: 12 },
        Msg::Bye { writes: 12 },
        Msg::Notify { chunk: 5, version: 3 },
        Msg::Pull { chunk: 5, version: 3 },
        Msg::Abort("worker 1: gradient of layer 0 is NaN".into()),
    ];
    let mut off = 1024;
    for m in &msgs {
        let (tag, bytes) = wire::encode(m);
        src.write_at(off, &bytes).expect("write_at");
        client
            .send(conn, &src.slice(off, bytes.len()).unwrap(), tag)
            .expect("send");
        off += bytes.len().max(1);
    }
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        server.poll(&mut ev, 64).expect("poll");
        client.wait(&mut ev, 64, Duration::from_millis(5)).expect("wait");
    }
    let _ = client.close(conn);
    let until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < until {
        let _ = server.poll(&mut ev, 64);
        let _ = client.wait(&mut ev, 64, Duration::from_millis(5));
    }
    let received = ev.iter().filter(|e| matches!(e, Event::Message { .. })).count();
    println!("transport: {received} messages received by the server");
    thread::sleep(Duration::from_millis(100));

    let conns = conns.lock().unwrap();
    let names = ["ctrl", "data"];
    let mut hello = None;
    let mut challenge = None;
    for (i, (up, down)) in conns.iter().enumerate() {
        let name = names.get(i).copied().unwrap_or("extra");
        for (dir, log) in [("c2s", up), ("s2c", down)] {
            let s = log.lock().unwrap().clone();
            if s.is_empty() {
                continue;
            }
            // Selector: payload cap MAX_MESSAGE_BYTES (4 << 5), pieces of 7 and of 1 byte.
            for sel in [(4 << 5) | 6, 0] {
                let mut v = vec![sel];
                v.extend_from_slice(&s[..s.len().min(4096)]);
                seed("frame", &format!("{name}-{dir}-{sel:02x}"), &v);
            }
            for (h, p) in frames(&s) {
                match h.kind {
                    Kind::Hello => hello = Some(tidewire_transport::frame::Hello::decode(&p).expect("hello")),
                    Kind::Challenge => challenge = Some(Challenge::decode(&p).expect("challenge")),
                    Kind::Message => {
                        let mut v = vec![0x80];
                        v.extend_from_slice(&h.imm.to_le_bytes());
                        v.extend_from_slice(&p);
                        let k = wire::kind_of(h.imm).map(|k| format!("{k:?}")).unwrap_or("x".into());
                        seed("engine_wire", &k.to_lowercase(), &v);
                    }
                    _ => {}
                }
            }
        }
    }
    // The handshake target's input, from the captured Hello and Challenge: job, ranks,
    // one secret (or two), the secret, the client's job, both nonces, the token, then
    // one "pass" per frame in flight.
    let (h, c) = (
        hello.expect("a Hello was captured"),
        challenge.expect("a Challenge was captured"),
    );
    for (name, one) in [("honest", 1u8), ("two-secrets", 0)] {
        let mut v = Vec::new();
        v.extend_from_slice(&h.job_id.to_le_bytes());
        v.extend_from_slice(&h.rank.to_le_bytes());
        v.extend_from_slice(&c.rank.to_le_bytes());
        v.push(one);
        let s = b"captured for the fuzz corpus";
        v.push(s.len() as u8);
        v.extend_from_slice(s);
        if one == 0 {
            v.push(b'!');
        }
        v.push(1);
        v.extend_from_slice(&h.nonce);
        v.extend_from_slice(&c.nonce);
        v.extend_from_slice(&c.token.to_le_bytes());
        v.extend_from_slice(&[0; 5]);
        seed("handshake", name, &v);
    }
}

fn rendezvous() {
    let cases: [(&str, u64, JobConfig); 3] = [
        ("agree", 7, job_config(32)),
        ("mismatch", 7, job_config(64)),
        ("job", 8, job_config(32)),
    ];
    for (name, job, theirs) in cases {
        let free = TcpListener::bind("127.0.0.1:0").unwrap();
        let master = free.local_addr().unwrap();
        drop(free);
        let host = tidewire::rendezvous::Host::bind(master).expect("bind");
        let (addr, conns) = relay(master);
        let me: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let t = thread::spawn(move || {
            let _ = host.run(7, 2, me, &job_config(32), Duration::from_secs(10));
        });
        let r = tidewire::rendezvous::join(
            addr,
            job,
            1,
            2,
            "127.0.0.1:40001".parse().unwrap(),
            &theirs,
            Duration::from_secs(10),
        );
        println!(
            "rendezvous {name}: {:?}",
            r.as_ref().map(|_| "ok").map_err(|e| e.to_string())
        );
        t.join().unwrap();
        thread::sleep(Duration::from_millis(100));
        let conns = conns.lock().unwrap();
        let (up, down) = &conns[0];
        seed("rendezvous", &format!("{name}-join"), &up.lock().unwrap());
        seed("rendezvous", &format!("{name}-reply"), &down.lock().unwrap());
    }
}

fn perf_oob() {
    let free = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free.local_addr().unwrap().port();
    drop(free);
    let (addr, conns) = relay(SocketAddr::from(([127, 0, 0, 1], port)));
    let t = Duration::from_secs(10);
    let d = Dest {
        lid: 0,
        out_reads: 1,
        qpn: 0x11,
        psn: 0xa2c05f,
        rkey: 0x23c,
        vaddr: 0x55c6_fcc3_7000,
        gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xc0, 0, 2, 2],
        srqn: 0,
    };
    let sig = Signature {
        test: 3,
        qps: 1,
        flags: 1,
        size: 65536,
        iters: 5000,
    };
    let srv = thread::spawn(move || {
        let mut o = Oob::accept(port, Some(t), t).expect("accept");
        o.versions(sig).unwrap();
        o.sys_data().unwrap();
        o.mtu(3).unwrap();
        o.keys(&d, true, "keys").unwrap();
        o.keys(&d, false, "keys").unwrap();
        o.report(&BwReport::default()).unwrap();
        o.xchg_u32(4096, "tcp port").unwrap();
        o.sync(&d, true, "sync", Some(t)).unwrap();
    });
    thread::sleep(Duration::from_millis(100));
    let mut o = Oob::connect("127.0.0.1", addr.port(), t).expect("connect");
    o.versions(sig).unwrap();
    o.sys_data().unwrap();
    o.mtu(3).unwrap();
    o.keys(&d, true, "keys").unwrap();
    o.keys(&d, false, "keys").unwrap();
    o.report(&BwReport {
        size: 65536,
        iters: 5000,
        bw_peak: 11_520.5,
        bw_avg: 11_498.25,
        msg_rate: 0.183_972,
    })
    .unwrap();
    o.xchg_u32(4097, "tcp port").unwrap();
    o.close(&d, true, Some(t)).unwrap();
    srv.join().unwrap();
    thread::sleep(Duration::from_millis(100));
    let conns = conns.lock().unwrap();
    let (up, down) = &conns[0];
    // Message sizes in order; the selector's low bits pick the exchange (see perf_oob.rs).
    let steps: [(&str, usize, u8); 9] = [
        ("version", 16, 0),
        ("sys-cycle", 4, 1),
        ("sys-line", 4, 1),
        ("mtu", 2, 2),
        ("keys-gid", 108, 3),
        ("keys", 59, 4),
        ("report", 40, 5),
        ("u32", 4, 1),
        ("sync", 108, 3),
    ];
    for (dir, log, role) in [("c2s", up, 0x80u8), ("s2c", down, 0)] {
        let s = log.lock().unwrap().clone();
        let mut at = 0;
        for (name, n, which) in steps {
            let Some(m) = s.get(at..at + n) else { break };
            at += n;
            // Over the socket (the peer sends what was captured), and parse-only.
            for (mode, sel) in [("x", role | which), ("p", 0x10 | which)] {
                let mut v = vec![sel];
                v.extend_from_slice(m);
                seed("perf_oob", &format!("{dir}-{name}-{mode}"), &v);
            }
        }
    }
}

fn rdma() {
    let q = QpInfo {
        qpn: 0x11,
        psn: 0xabcdef,
        lid: 0,
        gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1],
        mtu: 3,
        rx_depth: 64,
        max_message: 65536,
        ring_addr: 0x7f00_0000_1000,
        ring_rkey: 0x1234,
        max_msg_sz: 1 << 31,
    };
    let n = Notice {
        rkey: 7,
        generation: 2,
        offset: 4093,
        len: 14,
    };
    for (name, b) in [
        ("qp-info", q.encode()),
        ("notice", n.encode().to_vec()),
        ("abort", encode_abort(true, "REM_ACCESS_ERR")),
        ("credit", 16u32.to_le_bytes().to_vec()),
    ] {
        let mut v = vec![0];
        v.extend_from_slice(&b);
        seed("rdma_wire", name, &v);
    }
}

fn main() {
    transport();
    rendezvous();
    perf_oob();
    rdma();
}
