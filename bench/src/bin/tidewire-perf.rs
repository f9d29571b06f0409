//! `tidewire-perf`: perftest's microbenchmarks, interoperable with perftest.
//!
//! ```text
//! tidewire-perf write_bw -d rxe0 -x 1                  # server (no address)
//! tidewire-perf write_bw -d rxe1 -x 1 192.0.2.1        # client, against our server or ib_write_bw's
//! tidewire-perf write_lat -a 192.0.2.1                 # every size from 2 B to 8 MiB
//! tidewire-perf --transport tcp send_bw -s 1048576 127.0.0.1
//! ```
//!
//! Same tests, flags, tables and units as perftest 4.5 (`ib_write_bw`, ...),
//! and the same out-of-band exchange on TCP port 18515, so either side may be
//! perftest. `--transport tcp` runs the tests over the io_uring TCP transport
//! (tidewire-perf on both sides).
// The arguments' doc comments are clap's --help text (`<dev>`, `<port>`), not rustdoc.
#![allow(rustdoc::invalid_html_tags)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tidewire_bench::perf::{self, Opts, PerfError, Test, TransportKind};

#[derive(Parser)]
#[command(
    name = "tidewire-perf",
    version,
    about = "perftest-compatible RDMA and TCP microbenchmarks (interoperate with ib_write_bw & co.)",
    after_help = "Run the server with no address and the client with the server's address, with the same options,\n\
                  as with perftest. Either side may be perftest's ib_<test> (RDMA transport)."
)]
struct Cli {
    #[command(subcommand)]
    test: TestCmd,
}

#[derive(Subcommand)]
enum TestCmd {
    /// RDMA WRITE bandwidth (ib_write_bw).
    #[command(name = "write_bw")]
    WriteBw(Flags),
    /// RDMA WRITE latency, ping-pong (ib_write_lat).
    #[command(name = "write_lat")]
    WriteLat(Flags),
    /// RDMA READ bandwidth (ib_read_bw).
    #[command(name = "read_bw")]
    ReadBw(Flags),
    /// RDMA READ latency (ib_read_lat).
    #[command(name = "read_lat")]
    ReadLat(Flags),
    /// SEND bandwidth (ib_send_bw).
    #[command(name = "send_bw")]
    SendBw(Flags),
    /// SEND latency, ping-pong (ib_send_lat).
    #[command(name = "send_lat")]
    SendLat(Flags),
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
    /// RDMA verbs (RC queue pairs), perftest's wire.
    Rdma,
    /// The io_uring TCP transport (tidewire-perf on both sides).
    Tcp,
    /// The portable (epoll) TCP transport: the same wire as `tcp`, without io_uring.
    Portable,
}

#[derive(Args)]
struct Flags {
    /// Server address (client); none: run as the server.
    host: Option<String>,
    /// Use RDMA device <dev> (default: the first with an ACTIVE port).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    ib_dev: Option<String>,
    /// Use port <port> of the device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..))]
    ib_port: u8,
    /// GID index (default: automatic, preferring RoCE v2 IPv4).
    #[arg(short = 'x', long = "gid-index")]
    gid_index: Option<u32>,
    /// Message size in bytes (default 65536 for BW tests, 2 for latency tests).
    #[arg(short = 's', long = "size", conflicts_with = "all", value_parser = parse_size)]
    size: Option<u64>,
    /// Run sizes from 2 to 2^23.
    #[arg(short = 'a', long = "all")]
    all: bool,
    /// Number of exchanges (at least 5; default 5000 for BW tests, 1000 for latency tests).
    #[arg(short = 'n', long = "iters", conflicts_with = "duration")]
    iters: Option<u64>,
    /// Run for this many seconds instead of -n.
    #[arg(short = 'D', long = "duration")]
    duration: Option<f64>,
    /// Number of queue pairs.
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    qp: usize,
    /// Send queue depth (default 128 for BW tests; latency tests use 1).
    #[arg(short = 't', long = "tx-depth")]
    tx_depth: Option<u32>,
    /// Post lists of this many work requests (one doorbell each).
    #[arg(short = 'l', long = "post_list", default_value_t = 1)]
    post_list: usize,
    /// Ask for a completion every <n> work requests (default 100, at most the TX depth).
    #[arg(short = 'Q', long = "cq-mod")]
    cq_mod: Option<usize>,
    /// Largest message sent inline (0: none).
    #[arg(short = 'I', long = "inline_size", default_value_t = 0)]
    inline_size: u32,
    /// Accepted for perftest compatibility: tidewire-perf reads no CPU frequency (it times with the monotonic clock).
    #[arg(short = 'F', long = "CPU-freq")]
    cpu_freq: bool,
    /// Listen on / connect to this TCP port (the out-of-band exchange).
    #[arg(short = 'p', long = "port", default_value_t = 18515)]
    port: u16,
    /// Connect queue pairs with rdma_cm (perftest -R).
    #[arg(short = 'R', long = "rdma_cm")]
    rdma_cm: bool,
    /// Path MTU: 256, 512, 1024, 2048 or 4096 (default: the port's active MTU).
    #[arg(short = 'm', long = "mtu")]
    mtu: Option<u32>,
    /// Do not compute the peak bandwidth.
    #[arg(short = 'N', long = "noPeak")]
    no_peak: bool,
    /// Report bandwidth in Gb/sec (10^9 bits) instead of MB/sec (2^20 bytes).
    #[arg(long = "report_gbits")]
    report_gbits: bool,
    /// Also write the results as JSON to FILE (perftest_out.json when FILE is omitted).
    #[arg(long = "out_json", value_name = "FILE", num_args = 0..=1, require_equals = true,
          default_missing_value = "perftest_out.json")]
    out_json: Option<PathBuf>,
    /// The JSON file (perftest's spelling, with --out_json).
    #[arg(long = "out_json_file", value_name = "FILE")]
    out_json_file: Option<PathBuf>,
    /// Which transport carries the test.
    #[arg(long = "transport", value_enum, default_value = "rdma")]
    transport: TransportArg,
    /// Seconds to wait for the peer at any step before giving up with an error.
    #[arg(long = "timeout", default_value_t = 30.0)]
    timeout: f64,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let v: u64 = s.parse().map_err(|_| format!("{s:?} is not a size in bytes"))?;
    if v == 0 || v > 1 << 30 {
        return Err(format!("{v}: give 1 to 1073741824 bytes"));
    }
    Ok(v)
}

fn opts(test: Test, f: Flags) -> Result<Opts, PerfError> {
    let bad = |s: String| Err(PerfError::new(s));
    check_mode(test, &f)?;
    let iters = f.iters.unwrap_or(if test.is_bw() { 5000 } else { 1000 });
    if iters < 5 {
        return bad(format!("-n {iters}: at least 5 iterations"));
    }
    if f.qp == 0 || f.qp > 1024 {
        return bad(format!("-q {}: give 1 to 1024 queue pairs", f.qp));
    }
    if let Some(m) = f.mtu {
        if ![256, 512, 1024, 2048, 4096].contains(&m) {
            return bad(format!("-m {m}: give 256, 512, 1024, 2048 or 4096"));
        }
    }
    let tx_depth = if test.is_bw() { f.tx_depth.unwrap_or(128) } else { 1 };
    if tx_depth == 0 || tx_depth > 16384 {
        return bad(format!("-t {tx_depth}: give 1 to 16384"));
    }
    if f.post_list == 0 || f.post_list > tx_depth as usize {
        return bad(format!("-l {}: give 1 to the TX depth ({tx_depth})", f.post_list));
    }
    let cq_mod = cq_mod_of(test, &f, tx_depth, iters)?;
    let sizes = if f.all {
        perf::all_sizes()
    } else {
        vec![f.size.unwrap_or(if test.is_bw() { 65536 } else { 2 })]
    };
    let rx_depth = if f.duration.is_some() {
        512
    } else {
        iters.min(512) as u32
    };
    let out_json = match (f.out_json, f.out_json_file) {
        (_, Some(file)) => Some(file),
        (j, None) => j,
    };
    if !(f.timeout > 0.0 && f.timeout <= 86400.0) {
        return bad(format!("--timeout {}: give seconds above 0", f.timeout));
    }
    let _ = f.cpu_freq;
    Ok(Opts {
        test,
        host: f.host,
        transport: match f.transport {
            TransportArg::Rdma => TransportKind::Rdma,
            TransportArg::Tcp | TransportArg::Portable => TransportKind::Tcp,
        },
        tcp_portable: matches!(f.transport, TransportArg::Portable),
        device: f.ib_dev,
        ib_port: f.ib_port,
        gid_index: f.gid_index,
        sizes,
        all: f.all,
        iters,
        duration: f.duration,
        qps: f.qp,
        tx_depth,
        rx_depth,
        post_list: f.post_list,
        cq_mod,
        inline: f.inline_size,
        port: f.port,
        mtu: f.mtu,
        no_peak: f.no_peak,
        report_gbits: f.report_gbits,
        out_json,
        timeout: Duration::from_secs_f64(f.timeout),
    })
}

/// The exchange (-R is refused) and the run's length: -D for bandwidth tests only.
fn check_mode(test: Test, f: &Flags) -> Result<(), PerfError> {
    let bad = |s: String| Err(PerfError::new(s));
    if f.rdma_cm {
        return bad(
            "-R (connecting with rdma_cm) is not supported by tidewire-perf; run both sides without -R \
                    (perftest's default exchange on TCP port 18515 interoperates)"
                .into(),
        );
    }
    if let Some(d) = f.duration {
        if !(d > 0.0 && d <= 86400.0) {
            return bad(format!("-D {d}: give a duration in seconds, above 0"));
        }
    }
    if f.duration.is_some() && !test.is_bw() {
        return bad(format!(
            "-D with {}: latency tests run a number of round trips; use -n",
            test.name()
        ));
    }
    Ok(())
}

/// -Q: a completion asked for every this many work requests (bandwidth
/// tests; at most the TX depth and, with -n, the iterations).
fn cq_mod_of(test: Test, f: &Flags, tx_depth: u32, iters: u64) -> Result<usize, PerfError> {
    let bad = |s: String| Err(PerfError::new(s));
    if !test.is_bw() {
        return Ok(1);
    }
    let want = f.cq_mod.unwrap_or(100);
    if want == 0 {
        return bad("-Q 0: give at least 1".into());
    }
    if f.cq_mod.is_some() && want > tx_depth as usize {
        return bad(format!(
            "-Q {want} is larger than the TX depth {tx_depth}: completions could never be asked for"
        ));
    }
    let mut c = want.min(tx_depth as usize);
    if f.duration.is_none() {
        c = c.min(iters as usize);
    }
    Ok(c)
}

fn run(o: &Opts) -> Result<(), PerfError> {
    match o.transport {
        TransportKind::Tcp => perf::tcp::run(o).map(|_| ()),
        TransportKind::Rdma => {
            #[cfg(feature = "rdma")]
            {
                perf::rdma::run(o).map(|_| ())
            }
            #[cfg(not(feature = "rdma"))]
            {
                Err(PerfError::new(
                    "this tidewire-perf was built without RDMA: rebuild with `--features rdma`, or use --transport tcp",
                ))
            }
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (test, flags) = match cli.test {
        TestCmd::WriteBw(f) => (Test::WriteBw, f),
        TestCmd::WriteLat(f) => (Test::WriteLat, f),
        TestCmd::ReadBw(f) => (Test::ReadBw, f),
        TestCmd::ReadLat(f) => (Test::ReadLat, f),
        TestCmd::SendBw(f) => (Test::SendBw, f),
        TestCmd::SendLat(f) => (Test::SendLat, f),
    };
    let o = match opts(test, flags) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("tidewire-perf: error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tidewire-perf {}: error: {e}", o.test.name());
            ExitCode::FAILURE
        }
    }
}
