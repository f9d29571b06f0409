//! A legitimate peer that dribbles: every byte it sends, on both sockets, from
//! its first `Hello` to its last write, goes out alone (TCP_NODELAY, a pause
//! after each), so the server's receives cut every header and payload at every
//! offset. The peer is a raw `std` socket driven by the real sans-IO handshake
//! (`tidewire_transport::handshake`); the server is a real transport of each
//! TCP backend. Everything must arrive intact: the messages, and the writes
//! in the region with their immediates and acknowledgements.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use tidewire_transport::frame::{self, Header, Kind, HEADER_LEN};
use tidewire_transport::handshake::{Handshake, Outcome, Params};
use tidewire_transport::{
    Access, ConnId, Event, JobSecret, PinnedBuffer, PortableTransport, RemoteRegion, TcpConfig, TcpTransport, Transport,
};

const JOB: u64 = 0xd21b;
const SECRET: &[u8] = b"dribble: the job secret";
/// Pause after each byte: long enough that the server has read the last one.
const PAUSE: Duration = Duration::from_micros(300);

fn config(rank: u32) -> TcpConfig {
    let mut cfg = TcpConfig::new(JOB, rank, JobSecret::new(SECRET.to_vec()));
    cfg.busy_poll = Duration::ZERO;
    cfg
}

fn dribble(s: &mut TcpStream, bytes: &[u8]) {
    for b in bytes {
        s.write_all(std::slice::from_ref(b)).unwrap();
        thread::sleep(PAUSE);
    }
}

/// Reads whole frames from `s` until one of `kind` arrives; returns its payload.
fn read_until(s: &mut TcpStream, buf: &mut Vec<u8>, kind: Kind) -> (Header, Vec<u8>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        while let Some((h, total)) = frame::next_frame(buf, frame::MAX_CONTROL_BYTES).unwrap() {
            let body = buf[HEADER_LEN..total].to_vec();
            buf.drain(..total);
            if h.kind == kind {
                return (h, body);
            }
        }
        assert!(Instant::now() < deadline, "no {kind:?} from the server");
        let mut b = [0u8; 4096];
        match s.read(&mut b) {
            Ok(0) => panic!("server closed while we waited for {kind:?}"),
            Ok(n) => buf.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// What the dribbling peer sends after the handshake.
const MESSAGES: [usize; 5] = [0, 1, 39, 41, 300];
/// Writes: (offset in the region, length, immediate).
const WRITES: [(u64, usize, Option<u32>); 4] = [(0, 1, Some(7)), (100, 40, None), (4000, 96, Some(9)), (8, 3, None)];

fn body(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

/// The raw peer: handshake, then messages on the control socket and writes on
/// the data socket, all a byte at a time; then waits for every write's Ack.
fn peer(addr: SocketAddr) {
    let p = Params {
        job_id: JOB,
        rank: 1,
        secret: JobSecret::new(SECRET.to_vec()),
    };
    let now = Instant::now();
    let (mut hs, hello) = Handshake::client(&p, &addr.to_string(), now, now + Duration::from_secs(20));
    let mut ctrl = TcpStream::connect(addr).unwrap();
    ctrl.set_nodelay(true).unwrap();
    ctrl.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    dribble(&mut ctrl, &hello.to_bytes());
    let mut rx = Vec::new();
    let (h, ch) = read_until(&mut ctrl, &mut rx, Kind::Challenge);
    let raw: [u8; HEADER_LEN] = h.encode();
    hs.on_header(&raw).unwrap();
    let Outcome::OpenData { send, attach } = hs.on_frame(&p, &h, &ch).unwrap() else {
        panic!("no OpenData after the challenge")
    };
    dribble(&mut ctrl, &send.to_bytes());
    let mut data = TcpStream::connect(addr).unwrap();
    data.set_nodelay(true).unwrap();
    dribble(&mut data, &attach.to_bytes());
    let (h, _) = read_until(&mut ctrl, &mut rx, Kind::Ready);
    hs.on_header(&h.encode()).unwrap();
    assert_eq!(hs.on_frame(&p, &h, &[]).unwrap(), Outcome::Established);
    let (_, regions) = read_until(&mut ctrl, &mut rx, Kind::Regions);
    let region: RemoteRegion = frame::decode_regions(&regions).unwrap()[0];

    for (i, &n) in MESSAGES.iter().enumerate() {
        let mut h = Header::new(Kind::Message, n as u32);
        h.imm = i as u32;
        let mut f = h.encode().to_vec();
        f.extend_from_slice(&body(n, i as u8));
        dribble(&mut ctrl, &f);
    }
    for (i, &(off, n, imm)) in WRITES.iter().enumerate() {
        let mut h = Header::new(Kind::Write, n as u32);
        h.region = region.rkey;
        h.generation = region.generation;
        h.offset = off;
        h.seq = i as u64 + 1;
        if let Some(v) = imm {
            h.imm = v;
            h.flags |= frame::FLAG_IMM;
        }
        let mut f = h.encode().to_vec();
        f.extend_from_slice(&body(n, 0x40 + i as u8));
        dribble(&mut data, &f);
    }
    // Acks are cumulative: the last write's sequence acknowledges them all.
    let last = WRITES.len() as u64;
    loop {
        let (h, _) = read_until(&mut ctrl, &mut rx, Kind::Ack);
        if h.seq >= last {
            break;
        }
    }
    // Say goodbye properly.
    ctrl.write_all(&Header::new(Kind::Close, 0).encode()).unwrap();
    let _ = read_until(&mut ctrl, &mut rx, Kind::Close);
}

fn dribbled<T: Transport>(s: &mut T, name: &str) {
    let l = s.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = s.listener_addr(l).unwrap();
    let land = s
        .register(PinnedBuffer::new(8192).unwrap(), Access::REMOTE_WRITE)
        .unwrap();
    let (done_tx, done_rx) = mpsc::channel();
    let h = thread::spawn(move || {
        let r = std::panic::catch_unwind(|| peer(addr));
        let _ = done_tx.send(());
        r
    });
    let mut evs = Vec::new();
    let mut conn: Option<ConnId> = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while done_rx.try_recv().is_err() {
        assert!(Instant::now() < deadline, "{name}: the dribbling peer never finished");
        s.wait(&mut evs, 256, Duration::from_millis(5)).unwrap();
        if conn.is_none() {
            conn = s.accept(l).unwrap().map(|c| c.0);
        }
    }
    if let Err(p) = h.join().unwrap() {
        std::panic::resume_unwind(p);
    }
    let closed = Instant::now() + Duration::from_secs(10);
    while !evs.iter().any(|e| matches!(e, Event::Closed { .. })) && Instant::now() < closed {
        s.wait(&mut evs, 256, Duration::from_millis(5)).unwrap();
    }
    let conn = conn.unwrap_or_else(|| panic!("{name}: the peer was never accepted: {evs:?}"));
    let msgs: Vec<(u32, &Vec<u8>)> = evs
        .iter()
        .filter_map(|e| match e {
            Event::Message { conn: c, tag, data } if *c == conn => Some((*tag, data)),
            _ => None,
        })
        .collect();
    assert_eq!(msgs.len(), MESSAGES.len(), "{name}: messages: {evs:?}");
    for (i, (tag, data)) in msgs.iter().enumerate() {
        assert_eq!(*tag as usize, i, "{name}: message order");
        assert_eq!(**data, body(MESSAGES[i], i as u8), "{name}: message {i}");
    }
    let imms: Vec<(u64, u64, u32)> = evs
        .iter()
        .filter_map(|e| match e {
            Event::WriteReceived { offset, len, imm, .. } => Some((*offset, *len, *imm)),
            _ => None,
        })
        .collect();
    let want: Vec<(u64, u64, u32)> = WRITES
        .iter()
        .filter_map(|&(o, n, imm)| imm.map(|v| (o, n as u64, v)))
        .collect();
    assert_eq!(imms, want, "{name}: writes with an immediate");
    let mut all = vec![0u8; 8192];
    land.read_at(0, &mut all).unwrap();
    for (i, &(off, n, _)) in WRITES.iter().enumerate() {
        let off = off as usize;
        assert_eq!(
            all[off..off + n],
            body(n, 0x40 + i as u8)[..],
            "{name}: write {i} in the region"
        );
    }
    assert!(
        evs.iter()
            .any(|e| matches!(e, Event::Closed { conn: c, error: None } if *c == conn)),
        "{name}: no clean close: {evs:?}"
    );
}

#[test]
fn uring_server_reassembles_a_peer_that_sends_a_byte_at_a_time() {
    let mut s = TcpTransport::new(config(0)).expect("io_uring transport");
    dribbled(&mut s, "io_uring");
    // The data socket's headers really were cut (each one, byte by byte).
    let split = s.stats().rx_headers_split;
    println!("io_uring: {split} data-socket headers cut by a receive's end");
    assert!(
        split >= WRITES.len() as u64,
        "only {split} headers were cut: the peer did not dribble"
    );
}

#[test]
fn portable_server_reassembles_a_peer_that_sends_a_byte_at_a_time() {
    let mut s = PortableTransport::new(config(0)).expect("portable transport");
    dribbled(&mut s, "portable");
}
