//! tidewire-perf's perftest-compatible out-of-band exchange
//! (tidewire_bench::perf::oob): the key message parser, and every exchange of
//! a real `Oob` over a loopback socket whose peer sends the input's bytes —
//! versions (with the hidden test signature), system data, MTU, keys, the BW
//! report and the raw u32 — in both roles (client writes first, server reads first).
//!
//! Input: a selector byte, then the peer's bytes. Invariants:
//! - no parser panics, whatever the peer sends; errors are `PerfError`s;
//! - a key message that parses, re-encoded at the same size, parses to the same
//!   Dest (for fields within perftest's widths), and Dests built from the input
//!   round-trip at both sizes (108 bytes with a GID, 59 without);
//! - what an exchange returns is exactly what the peer sent (MTU: 1..=5 only;
//!   version: starts with a digit; BW report: the five big-endian fields, bit for bit).
#![no_main]

use std::cell::RefCell;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tidewire_bench::perf::oob::{BwReport, Dest, Oob, Signature, KEY_MSG_SIZE, KEY_MSG_SIZE_GID};

/// A real Oob and the raw socket of its peer, per role (0: client, 1: server).
struct Pair {
    oob: Oob,
    peer: TcpStream,
}

thread_local! {
    static PAIRS: RefCell<Vec<Pair>> = RefCell::new(pairs());
}

fn pairs() -> Vec<Pair> {
    let t = Duration::from_secs(10);
    // Client role: our listener, a real Oob::connect.
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let client = Oob::connect("127.0.0.1", port, t).expect("connect");
    let (peer_c, _) = l.accept().expect("accept");
    // Server role: a real Oob::accept on a free port, our raw client.
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    let srv = std::thread::spawn(move || Oob::accept(port, Some(t), t).expect("accept"));
    let peer_s = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let server = srv.join().expect("accept thread");
    for p in [&peer_c, &peer_s] {
        p.set_nodelay(true).expect("nodelay");
        p.set_read_timeout(Some(t)).expect("timeout");
    }
    vec![
        Pair {
            oob: client,
            peer: peer_c,
        },
        Pair {
            oob: server,
            peer: peer_s,
        },
    ]
}

fn padded(b: &[u8], n: usize) -> Vec<u8> {
    let mut v = b[..b.len().min(n)].to_vec();
    v.resize(n, 0);
    v
}

fn in_widths(d: &Dest) -> bool {
    d.out_reads <= 0xffff && d.qpn < 1 << 24 && d.psn < 1 << 24
}

fn check_dest(b: &[u8]) {
    if let Ok(d) = Dest::decode(b) {
        let with_gid = b.len() == KEY_MSG_SIZE_GID;
        if !with_gid {
            assert_eq!(d.gid, [0; 16]);
        }
        match d.encode(with_gid) {
            Ok(m) => {
                assert!(in_widths(&d), "an out-of-range key message was encoded: {d:?}");
                assert_eq!(
                    Dest::decode(&m).ok(),
                    Some(d),
                    "a parsed key message re-encodes to another"
                );
            }
            Err(_) => assert!(!in_widths(&d), "an in-range key message was refused: {d:?}"),
        }
        let _ = d.print("remote", true, with_gid);
    }
    if b.len() >= 46 {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let d = Dest {
            lid: u16::from_le_bytes([b[0], b[1]]),
            out_reads: u32_at(2) & 0xffff,
            qpn: u32_at(6) & 0xff_ffff,
            psn: u32_at(10) & 0xff_ffff,
            rkey: u32_at(14),
            vaddr: u64::from_le_bytes(b[18..26].try_into().unwrap()),
            gid: b[26..42].try_into().unwrap(),
            srqn: u32_at(42),
        };
        let long = d.encode(true).expect("in range");
        assert_eq!(long.len(), KEY_MSG_SIZE_GID);
        assert_eq!(Dest::decode(&long).ok(), Some(d));
        let short = d.encode(false).expect("in range");
        assert_eq!(short.len(), KEY_MSG_SIZE);
        assert_eq!(Dest::decode(&short).ok(), Some(Dest { gid: [0; 16], ..d }));
    }
}

/// One exchange: the peer's bytes are in the socket before the Oob writes and
/// reads; afterwards the peer reads exactly what the Oob wrote, keeping the
/// stream in step for the next input.
fn exchange(pair: &mut Pair, which: u8, b: &[u8]) {
    let (send, wrote) = match which % 6 {
        0 => (padded(b, 16), 16),
        1 => (padded(b, 8), 8),
        2 => (padded(b, 2), 2),
        3 => (padded(b, KEY_MSG_SIZE_GID), KEY_MSG_SIZE_GID),
        4 => (padded(b, KEY_MSG_SIZE), KEY_MSG_SIZE),
        5 => (padded(b, 40), 40),
        _ => unreachable!(),
    };
    pair.peer.write_all(&send).expect("peer write");
    let mine = Dest {
        qpn: 0x11,
        psn: 0xabc,
        rkey: 7,
        vaddr: 0x1000,
        ..Default::default()
    };
    match which % 6 {
        0 => {
            let sig = Signature {
                test: 1,
                qps: 1,
                flags: 0,
                size: 2,
                iters: 9,
            };
            if let Ok((v, theirs)) = pair.oob.versions(sig) {
                assert!(v.starts_with(|c: char| c.is_ascii_digit()));
                if let Some(s) = theirs {
                    assert_ne!(s.test, 0);
                }
            }
        }
        1 => {
            let (c, l) = pair.oob.sys_data().expect("4+4 bytes always parse");
            assert_eq!(c.to_be_bytes(), send[..4]);
            assert_eq!(l.to_be_bytes(), send[4..8]);
        }
        2 => {
            if let Ok(m) = pair.oob.mtu(3) {
                assert!((1..=5).contains(&m));
                assert_eq!(m + b'0', send[0]);
            }
        }
        3 | 4 => {
            if let Ok(d) = pair.oob.keys(&mine, which % 6 == 3, "exchanging keys") {
                assert_eq!(Dest::decode(&send).ok(), Some(d));
            }
        }
        5 => {
            let r = pair
                .oob
                .report(&BwReport {
                    size: 1,
                    iters: 2,
                    bw_peak: 3.0,
                    bw_avg: 4.0,
                    msg_rate: 5.0,
                })
                .expect("5 x 8 bytes always parse");
            let f = |i: usize| u64::from_be_bytes(send[i * 8..i * 8 + 8].try_into().unwrap());
            assert_eq!((r.size, r.iters), (f(0), f(1)));
            assert_eq!(r.bw_peak.to_bits(), f(2));
            assert_eq!(r.bw_avg.to_bits(), f(3));
            assert_eq!(r.msg_rate.to_bits(), f(4));
        }
        _ => unreachable!(),
    }
    let mut back = vec![0u8; wrote];
    pair.peer.read_exact(&mut back).expect("the Oob wrote its message");
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, b)) = data.split_first() else { return };
    check_dest(b);
    // One input in four also goes over the socket (it is much slower than parsing).
    if sel & 0x30 == 0 {
        PAIRS.with(|p| exchange(&mut p.borrow_mut()[(sel >> 7) as usize], sel, b));
    }
});
