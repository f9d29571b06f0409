//! Two costs of the runtime, measured on loopback with two ranks in this
//! process (a worker and a server, over the TCP transport):
//!
//! - **Hand-in latency**: from the caller's `grad_ready` to the first post on
//!   the wire (the transport's `write` call for the layer's first slice), as
//!   the runtime records it (`SessionStats::hand_in_to_post_*`). Beside it, in
//!   the same run, half the round trip of a 64-byte ping-pong over a plain
//!   `std::net` TCP socket on loopback, for scale.
//! - **Idle cost**: the CPU time both ranks use while the caller holds every
//!   layer and nothing happens, as a share of one core.
//!
//! ```text
//! tidewire-handin [--iters 2000] [--params 16384] [--idle-secs 5] [--json out.json]
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::Parser;
use serde::Serialize;
use tidewire::cluster::ClusterSpec;
use tidewire::engine::book::{LayerKind, LayerSpec};
use tidewire::engine::ApplyOp;
use tidewire::transport::JobSecret;
use tidewire::{Builder, TransportKind};

#[derive(Parser, Debug)]
#[command(about = "grad_ready-to-wire latency and the idle cost of a session, on loopback")]
struct Args {
    /// Hand-ins to time (each waits for its layer before the next).
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Parameters of the one layer.
    #[arg(long, default_value_t = 16384)]
    params: usize,
    /// Seconds to hold every layer idle while measuring CPU time.
    #[arg(long, default_value_t = 5.0)]
    idle_secs: f64,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Debug, Serialize)]
struct Report {
    iters: usize,
    params: usize,
    hand_in_posts: u64,
    hand_in_to_post_p50_us: f64,
    hand_in_to_post_p99_us: f64,
    std_tcp_half_rtt_p50_us: f64,
    idle_secs: f64,
    idle_cpu_secs: f64,
    idle_core_share: f64,
}

/// CPU time of every thread of this process, seconds (from each thread's
/// `/proc/self/task/*/schedstat`, nanosecond resolution).
fn cpu_secs() -> f64 {
    let mut ns = 0u64;
    for t in std::fs::read_dir("/proc/self/task").expect("procfs") {
        let p = t.expect("task").path().join("schedstat");
        if let Ok(s) = std::fs::read_to_string(p) {
            ns += s.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0);
        }
    }
    ns as f64 / 1e9
}

/// Median of half the round trip of a 64-byte ping-pong over std TCP on loopback, µs.
fn std_half_rtt(reps: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let echo = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut b = [0u8; 64];
        for _ in 0..reps {
            s.read_exact(&mut b).expect("read");
            s.write_all(&b).expect("write");
        }
    });
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_nodelay(true).expect("nodelay");
    let mut b = [7u8; 64];
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        c.write_all(&b).expect("write");
        c.read_exact(&mut b).expect("read");
        t.push(s.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    echo.join().expect("echo");
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let master = format!("127.0.0.1:{port}").parse()?;
    let layers = vec![LayerSpec::new("w", LayerKind::Conv, 64, a.params.div_ceil(64))];
    let builder = |l: Vec<LayerSpec>| {
        Builder::new(l)
            .job(9, JobSecret::new(b"handin-bench".to_vec()))
            .transport(TransportKind::Tcp)
            .apply(ApplyOp::Sum)
            .timeout(Duration::from_secs(30))
    };
    let server_layers = layers.clone();
    let server = std::thread::spawn(move || -> tidewire::Result<()> {
        let mut s = builder(server_layers).build(ClusterSpec::new(1, 1, 1, false, master)?)?;
        s.shutdown()
    });
    let mut s = builder(layers).build(ClusterSpec::new(0, 1, 1, false, master)?)?;
    let mut held = s.take_layers()?;
    let mut buf = held[0].take().expect("one layer");
    for i in 0..a.iters {
        buf.grad_mut().fill(i as f32);
        s.grad_ready(buf)?;
        buf = s.wait_layer(0)?;
    }
    let st = s.stats()?;
    // Idle: the caller holds the only layer; both ranks should sleep.
    let (w0, c0) = (Instant::now(), cpu_secs());
    std::thread::sleep(Duration::from_secs_f64(a.idle_secs));
    let (wall, cpu) = (w0.elapsed().as_secs_f64(), cpu_secs() - c0);
    drop(buf);
    s.shutdown()?;
    server.join().map_err(|_| "server thread panicked")??;
    let r = Report {
        iters: a.iters,
        params: a.params,
        hand_in_posts: st.hand_in_posts,
        hand_in_to_post_p50_us: st.hand_in_to_post_p50_ns as f64 / 1e3,
        hand_in_to_post_p99_us: st.hand_in_to_post_p99_ns as f64 / 1e3,
        std_tcp_half_rtt_p50_us: std_half_rtt(2000),
        idle_secs: wall,
        idle_cpu_secs: cpu,
        idle_core_share: cpu / wall,
    };
    println!(
        "hand-in to first post: median {:.1} µs, p99 {:.1} µs over {} hand-ins ({} parameters)",
        r.hand_in_to_post_p50_us, r.hand_in_to_post_p99_us, r.hand_in_posts, r.params
    );
    println!(
        "for scale, std TCP on loopback: half a 64-byte round trip {:.1} µs (median)",
        r.std_tcp_half_rtt_p50_us
    );
    println!(
        "idle with every layer held: {:.4} s of CPU in {:.2} s = {:.3}% of a core (two ranks)",
        r.idle_cpu_secs,
        r.idle_secs,
        100.0 * r.idle_core_share
    );
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&r)?)?;
    }
    Ok(())
}
