//! Loopback comparison of the io_uring TCP backend with its peers.
//!
//! ```text
//! tidewire-loopback compare --runs 5 --secs 3 --json out.json
//! tidewire-loopback write-bw --size 1048576 --secs 3
//! tidewire-loopback rtt --size 64 --iters 20000
//! ```
//!
//! `compare` alternates ours and the peer in each repetition (so drift hits
//! both), then prints medians and the ratio ours/peer.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use serde::Serialize;
use tidewire_bench::{gbps, median};
use tidewire_transport::{
    Access, ConnId, Event, JobSecret, PinnedBuffer, PortableTransport, TcpConfig, TcpTransport, Transport,
};

#[derive(Parser)]
#[command(
    name = "tidewire-loopback",
    about = "io_uring TCP backend vs iperf3 and std::net, on loopback"
)]
struct Cli {
    /// TcpConfig::busy_poll for our transports, in µs (0: sleep in the kernel at once, like blocking std).
    #[arg(long, global = true, default_value_t = 100)]
    busy_poll_us: u64,
    /// Our TCP backend: uring (io_uring) or portable (epoll, plain non-blocking sockets).
    #[arg(long, global = true, default_value = "uring")]
    backend: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// One-sided write throughput, one connection.
    WriteBw {
        #[arg(long, default_value_t = 1 << 20)]
        size: usize,
        #[arg(long, default_value_t = 3.0)]
        secs: f64,
        /// Bytes in flight (window).
        #[arg(long, default_value_t = 16 << 20)]
        window: usize,
        /// Use SEND_ZC for writes at least this large.
        #[arg(long)]
        zc_min: Option<usize>,
    },
    /// Message round trip (ping-pong) latency.
    Rtt {
        #[arg(long, default_value_t = 64)]
        size: usize,
        #[arg(long, default_value_t = 20000)]
        iters: usize,
    },
    /// Blocking std::net ping-pong, the latency peer.
    StdRtt {
        #[arg(long, default_value_t = 64)]
        size: usize,
        #[arg(long, default_value_t = 20000)]
        iters: usize,
    },
    /// iperf3, one stream, the throughput peer.
    Iperf {
        #[arg(long, default_value_t = 3.0)]
        secs: f64,
    },
    /// All of the above, alternating, with medians and ratios.
    Compare {
        #[arg(long, default_value_t = 5)]
        runs: usize,
        #[arg(long, default_value_t = 3.0)]
        secs: f64,
        #[arg(long, default_value_t = 20000)]
        iters: usize,
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// SEND_ZC against plain sends across write sizes (to choose the threshold).
    ZcSweep {
        #[arg(long, default_value_t = 2.0)]
        secs: f64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
}

static BUSY_POLL_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(100);

static PORTABLE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn transport(rank: u32) -> Box<dyn Transport> {
    transport_zc(rank, None)
}

/// Our transport (the `--backend`), with SEND_ZC from `zc_min` bytes (io_uring only).
fn transport_zc(rank: u32, zc_min: Option<usize>) -> Box<dyn Transport> {
    let mut cfg = TcpConfig::new(0xbe4c, rank, JobSecret::new(b"bench".to_vec()));
    cfg.busy_poll = Duration::from_micros(BUSY_POLL_US.load(std::sync::atomic::Ordering::Relaxed));
    cfg.send_zc_min_bytes = zc_min;
    let t: tidewire_transport::Result<Box<dyn Transport>> = if PORTABLE.load(std::sync::atomic::Ordering::Relaxed) {
        PortableTransport::new(cfg).map(|t| Box::new(t) as Box<dyn Transport>)
    } else {
        TcpTransport::new(cfg).map(|t| Box::new(t) as Box<dyn Transport>)
    };
    t.unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    })
}

fn pinned(len: usize) -> PinnedBuffer {
    PinnedBuffer::new(len).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    })
}

/// Server thread: listens, accepts one peer, echoes messages, and stops when the peer closes.
fn spawn_server(landing: usize) -> (SocketAddr, thread::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let h = thread::spawn(move || {
        let mut t = transport(0);
        let l = t.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        t.register(pinned(landing), Access::REMOTE_WRITE).unwrap();
        let echo = t.register(pinned(1 << 20), Access::LOCAL).unwrap();
        tx.send(t.listener_addr(l).unwrap()).unwrap();
        let mut ev = Vec::new();
        let mut conn: Option<ConnId> = None;
        loop {
            ev.clear();
            t.wait(&mut ev, 1024, Duration::from_millis(100)).unwrap();
            if conn.is_none() {
                conn = t.accept(l).unwrap().map(|c| c.0);
            }
            for e in ev.drain(..) {
                match e {
                    Event::Message { conn, data, tag } => {
                        t.send(conn, &echo.slice(0, data.len()).unwrap(), tag).unwrap();
                    }
                    Event::Closed { .. } => return,
                    _ => {}
                }
            }
        }
    });
    (rx.recv().unwrap(), h)
}

fn connect(t: &mut dyn Transport, addr: SocketAddr, want_region: bool) -> ConnId {
    let c = t.connect(addr).unwrap();
    let mut ev = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        t.wait(&mut ev, 64, Duration::from_millis(10)).unwrap();
        if ev.iter().any(|e| matches!(e, Event::Closed { .. })) {
            panic!("connect failed: {ev:?}");
        }
        let ready = ev.iter().any(|e| matches!(e, Event::Connected { .. }));
        if ready && (!want_region || !t.remote_regions(c).unwrap().is_empty()) {
            return c;
        }
        assert!(Instant::now() < deadline, "connect timed out");
    }
}

fn finish(mut t: Box<dyn Transport>, c: ConnId, server: thread::JoinHandle<()>) {
    t.close(c).unwrap();
    let mut ev = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ev.iter().any(|e| matches!(e, Event::Closed { .. })) && Instant::now() < deadline {
        t.wait(&mut ev, 64, Duration::from_millis(50)).unwrap();
    }
    server.join().unwrap();
}

/// Returns Gbit/s of acknowledged one-sided writes.
fn write_bw(size: usize, secs: f64, window: usize, zc_min: Option<usize>) -> f64 {
    let (addr, server) = spawn_server(size.max(1 << 20));
    let mut t = transport_zc(1, zc_min);
    let src = t.register(pinned(size.max(4096)), Access::LOCAL).unwrap();
    src.fill(0, src.len(), 0x77).unwrap();
    let c = connect(&mut *t, addr, true);
    let dst = t.remote_regions(c).unwrap()[0];
    let depth = (window / size).clamp(1, t.properties().max_outstanding);
    let slice = src.slice(0, size).unwrap();
    let mut ev = Vec::new();
    let mut inflight = 0;
    let mut done_bytes = 0u64;
    // Warm up for a tenth of the time, then measure.
    let warm = Duration::from_secs_f64(secs / 10.0);
    let t0 = Instant::now();
    let mut start: Option<(Instant, u64)> = None;
    let dur = Duration::from_secs_f64(secs);
    loop {
        while inflight < depth {
            t.write(c, &slice, &dst, 0, None).unwrap();
            inflight += 1;
        }
        ev.clear();
        t.wait(&mut ev, 1024, Duration::from_millis(100)).unwrap();
        for e in &ev {
            match e {
                Event::WriteDone { bytes, .. } => {
                    inflight -= 1;
                    done_bytes += *bytes as u64;
                }
                Event::OpFailed { error, .. } => panic!("write failed: {error}"),
                _ => {}
            }
        }
        let now = Instant::now();
        if start.is_none() && now - t0 >= warm {
            start = Some((now, done_bytes));
        }
        if let Some((s, b0)) = start {
            if now - s >= dur {
                let r = gbps(done_bytes - b0, now - s);
                while inflight > 0 {
                    ev.clear();
                    t.wait(&mut ev, 1024, Duration::from_millis(100)).unwrap();
                    inflight -= ev.iter().filter(|e| matches!(e, Event::WriteDone { .. })).count();
                }
                finish(t, c, server);
                return r;
            }
        }
    }
}

/// Returns the round-trip times in µs.
fn rtt(size: usize, iters: usize) -> Vec<f64> {
    let (addr, server) = spawn_server(4096);
    let mut t = transport(1);
    let src = t.register(pinned(size.max(4096)), Access::LOCAL).unwrap();
    let c = connect(&mut *t, addr, false);
    let slice = src.slice(0, size).unwrap();
    let mut ev = Vec::new();
    let mut out = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t0 = Instant::now();
        t.send(c, &slice, i as u32).unwrap();
        loop {
            ev.clear();
            t.wait(&mut ev, 64, Duration::from_secs(5)).unwrap();
            if ev.iter().any(|e| matches!(e, Event::Message { .. })) {
                break;
            }
        }
        if i >= iters / 10 {
            out.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    finish(t, c, server);
    out
}

/// Blocking std::net ping-pong (TCP_NODELAY), the latency peer.
fn std_rtt(size: usize, iters: usize) -> Vec<f64> {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let total = iters + iters / 10;
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut b = vec![0u8; size];
        for _ in 0..total {
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let mut b = vec![1u8; size];
    let mut out = Vec::with_capacity(iters);
    for i in 0..total {
        let t0 = Instant::now();
        s.write_all(&b).unwrap();
        s.read_exact(&mut b).unwrap();
        if i >= iters / 10 {
            out.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    server.join().unwrap();
    out
}

/// One iperf3 single-stream run on loopback; returns Gbit/s (receiver side).
fn iperf(secs: f64) -> Result<f64, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .map_err(|e| e.to_string())?
        .local_addr()
        .unwrap()
        .port();
    let mut srv = Command::new("iperf3")
        .args(["-s", "-1", "--forceflush", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run iperf3 ({e}); install it with `apt-get install iperf3`"))?;
    // Wait (bounded) until the server says it listens.
    let stdout = srv.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    if rx.recv_timeout(Duration::from_secs(10)).is_err() {
        let _ = srv.kill();
        let _ = srv.wait();
        return Err("iperf3 server did not start within 10 s".into());
    }
    let client = Command::new("iperf3")
        .args([
            "-c",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-t",
            &format!("{secs}"),
            "-O",
            "1",
            "-J",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let out = wait_bounded(client, Duration::from_secs_f64(secs + 20.0));
    let _ = srv.kill();
    let _ = srv.wait();
    let out = out?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("iperf3 JSON: {e}"))?;
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|b| b / 1e9)
        .ok_or_else(|| format!("iperf3 gave no result: {}", String::from_utf8_lossy(&out.stdout)))
}

/// Waits for a child up to `limit`, killing it after that.
fn wait_bounded(mut child: std::process::Child, limit: Duration) -> Result<std::process::Output, String> {
    let end = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().map_err(|e| e.to_string()),
            Ok(None) if Instant::now() < end => thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("iperf3 client did not finish within {limit:?}"));
            }
        }
    }
}

#[derive(Serialize)]
struct Row {
    test: &'static str,
    unit: &'static str,
    ours: Vec<f64>,
    peer_name: &'static str,
    peer: Vec<f64>,
    ours_median: f64,
    peer_median: f64,
    ratio: f64,
}

fn row(test: &'static str, unit: &'static str, peer_name: &'static str, ours: Vec<f64>, peer: Vec<f64>) -> Row {
    let (a, b) = (median(&ours), median(&peer));
    Row {
        test,
        unit,
        peer_name,
        ours_median: a,
        peer_median: b,
        ratio: a / b,
        ours,
        peer,
    }
}

fn main() {
    let cli = Cli::parse();
    BUSY_POLL_US.store(cli.busy_poll_us, std::sync::atomic::Ordering::Relaxed);
    match cli.backend.as_str() {
        "uring" => {}
        "portable" => PORTABLE.store(true, std::sync::atomic::Ordering::Relaxed),
        o => {
            eprintln!("error: --backend {o:?}: use uring or portable");
            std::process::exit(2)
        }
    }
    match cli.cmd {
        Cmd::WriteBw {
            size,
            secs,
            window,
            zc_min,
        } => {
            println!(
                "write_bw size={size} B: {:.2} Gbit/s",
                write_bw(size, secs, window, zc_min)
            )
        }
        Cmd::Rtt { size, iters } => {
            let v = rtt(size, iters);
            println!(
                "rtt size={size} B: median {:.2} us over {} round trips",
                median(&v),
                v.len()
            );
        }
        Cmd::StdRtt { size, iters } => {
            let v = std_rtt(size, iters);
            println!(
                "std rtt size={size} B: median {:.2} us over {} round trips",
                median(&v),
                v.len()
            );
        }
        Cmd::Iperf { secs } => match iperf(secs) {
            Ok(g) => println!("iperf3: {g:.2} Gbit/s"),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2)
            }
        },
        Cmd::ZcSweep { secs, runs } => zc_sweep(secs, runs),
        Cmd::Compare {
            runs,
            secs,
            iters,
            json,
        } => compare(runs, secs, iters, json, cli.busy_poll_us),
    }
}

/// Plain sends against SEND_ZC, per message size (medians of `runs`).
fn zc_sweep(secs: f64, runs: usize) {
    println!(
        "{:>10} {:>14} {:>14} {:>8}",
        "bytes", "send Gbit/s", "SEND_ZC Gbit/s", "zc/send"
    );
    for size in [4096usize, 16384, 65536, 262144, 1 << 20, 4 << 20] {
        let mut a = Vec::new();
        let mut b = Vec::new();
        for _ in 0..runs {
            a.push(write_bw(size, secs, 16 << 20, None));
            b.push(write_bw(size, secs, 16 << 20, Some(0)));
        }
        let (ma, mb) = (median(&a), median(&b));
        println!("{size:>10} {ma:>14.2} {mb:>14.2} {:>8.2}", mb / ma);
    }
}

/// Our write_bw and 64 B round trip against iperf3 and std::net, alternating
/// over `runs`; the table, and with `json` the rows as JSON there.
fn compare(runs: usize, secs: f64, iters: usize, json: Option<std::path::PathBuf>, busy_poll_us: u64) {
    let (mut ours_bw, mut peer_bw, mut ours_rtt, mut peer_rtt) = (vec![], vec![], vec![], vec![]);
    for r in 0..runs {
        eprintln!("[{}/{runs}] write_bw 1 MiB vs iperf3, 64 B rtt vs std::net ...", r + 1);
        ours_bw.push(write_bw(1 << 20, secs, 16 << 20, None));
        match iperf(secs) {
            Ok(g) => peer_bw.push(g),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2)
            }
        }
        ours_rtt.push(median(&rtt(64, iters)));
        peer_rtt.push(median(&std_rtt(64, iters)));
    }
    let rows = vec![
        row("write_bw 1 MiB", "Gbit/s", "iperf3 (1 stream)", ours_bw, peer_bw),
        row("rtt 64 B", "us", "std::net blocking ping-pong", ours_rtt, peer_rtt),
    ];
    println!(
        "medians of {runs} alternating runs; our busy_poll = {} us",
        busy_poll_us
    );
    println!(
        "{:<16} {:>8} {:>14} {:>14} {:>8}  peer",
        "test", "unit", "ours(median)", "peer(median)", "ratio"
    );
    for r in &rows {
        println!(
            "{:<16} {:>8} {:>14.2} {:>14.2} {:>8.3}  {}",
            r.test, r.unit, r.ours_median, r.peer_median, r.ratio, r.peer_name
        );
    }
    if let Some(p) = json {
        let doc = serde_json::json!({ "runs": runs, "busy_poll_us": busy_poll_us, "rows": rows });
        std::fs::write(&p, serde_json::to_string_pretty(&doc).unwrap()).unwrap_or_else(|e| {
            eprintln!("error: writing {}: {e}", p.display());
            std::process::exit(2)
        });
    }
}
