//! This machine's rates, measured: what HybComm weighs in seconds.
//!
//! [`measure`] times, in a fraction of a second each, the four rates of
//! [`Rates`]: the GEMM that rebuilds a gradient from its sufficient factors
//! ([`tidewire_gpu::cpu::sf_rows`], the runtime's own), the sum into an
//! accumulator ([`tidewire_gpu::cpu::add_assign`]), one TCP stream's
//! throughput and a small message's one-way cost over loopback. A
//! [`Profile`] keeps them with the machine's core count; `tidewire calibrate`
//! writes one as JSON, and `tidewire train --profile` and `tidewire sim
//! --profile` read it.
//!
//! A node's rates are the profile's divided by what shares it
//! ([`Profile::node_rates`]): ranks on one host share its cores, and over
//! loopback the "link" is those cores too. A rank reads the rates it decides
//! with from [`Builder::rates`](crate::Builder::rates) or from
//! `TIDEWIRE_RATES` (the JSON of [`Rates`]); every rank of a job must reach
//! the same schemes, which the rendezvous checks.
//!
//! ```no_run
//! let p = tidewire::calibrate::measure(std::time::Duration::from_millis(300)).unwrap();
//! // Five ranks on this host, each over loopback.
//! let r = p.node_rates(5, None);
//! println!("{:.1} GFLOP/s per rank", r.gemm_flop_per_s / 1e9);
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tidewire_engine::cost::Rates;
use tidewire_gpu::cpu;

use crate::error::{Error, Result};

/// The environment variable a rank reads its rates from (the JSON of [`Rates`]).
pub const RATES_ENV: &str = "TIDEWIRE_RATES";

/// The shape the GEMM rate is measured at: K rows of factors, an M×N
/// block. K = 32 (a common batch per worker), N = 4096, and M such that the
/// block is as large as [`sum_rate`]'s arrays, out of the caches as an FC
/// layer's gradient is. (At K = 128 and a 4 MiB block, the rate was 1.3 to
/// 2 times what `cpu::sf_sum` reached on a 4096×4097 layer at K = 32 with 4
/// workers; on the 2-core VM, whose L2 is 2 MiB a core and whose share of
/// its host's L3 is unknown, a 16 MiB block read 100 to 120 GFLOP/s on one
/// thread where a 64 MiB one gave 60 to 74 and the 256 MiB one 54 to 65, and
/// with VGG19 3+1 over loopback HybComm put the PS within 0.1% of SFB where
/// SFB ran 1.2 to 1.3 times faster.)
pub fn gemm_shape() -> (usize, usize, usize) {
    let n = 4096;
    // sum_len() is at least 16 Mi elements: M at least 4096.
    (32, sum_len() / n, n)
}

/// A machine's measured rates, one thread's each, and how many cores it has.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Cores this process may run on.
    pub cores: usize,
    /// One thread's rates; the link is one loopback TCP stream's (its
    /// sender and receiver on two threads), unless set from a measured link.
    pub rates: Rates,
    /// Where `rates.link_bytes_per_s` came from: "loopback" or what set it.
    pub link: String,
    /// Input bytes per second the sum reaches with every core at once, each
    /// on its own part of arrays out of the caches: the host's memory, which
    /// its ranks share (one core comes near it: folds do not scale with
    /// cores as a GEMM does). `None` in a profile written before it was
    /// measured: then the sum is shared like the cores.
    #[serde(default)]
    pub mem_bytes_per_s: Option<f64>,
    /// The GEMM's FLOP/s at other batches: `[K, FLOP/s]` pairs, K rising
    /// ([`gemm_curve`]). A rebuild at K = 256 runs faster than at K = 32
    /// (more arithmetic for each output element written), and the rate of
    /// one K predicts another's badly. [`Profile::at_batch`] reads it;
    /// empty in a profile written before it was measured (then
    /// `rates.gemm_flop_per_s`, K = 32, at every batch).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gemm_by_k: Vec<[f64; 2]>,
}

impl Profile {
    /// The rates of one of `ranks` ranks sharing this host, each with a link
    /// of `link_bytes_per_s` where it has one of its own (a NIC, a shaped
    /// namespace), or over loopback (`None`, the measured stream, shared by
    /// the ranks like the cores: it is CPU).
    ///
    /// The CPU's rates are divided like the cores (`cores / ranks` each, at
    /// most the whole of one), the sum also like the host's memory
    /// ([`Profile::mem_bytes_per_s`] / ranks), and `host_ranks` says how
    /// many share it, so that HybComm weighs the host's whole work (its
    /// loopback too, where no link of their own is given).
    pub fn node_rates(&self, ranks: usize, link_bytes_per_s: Option<f64>) -> Rates {
        let ranks = ranks.max(1);
        let share = (self.cores as f64 / ranks as f64).min(1.0);
        let mut r = self.rates.shared(share, share);
        if let Some(l) = link_bytes_per_s {
            // A link of its own, but never faster than this CPU moves bytes.
            r.link_bytes_per_s = l.min(r.link_bytes_per_s);
        }
        if let Some(mem) = self.mem_bytes_per_s.filter(|m| m.is_finite() && *m > 0.0) {
            r.sum_bytes_per_s = r.sum_bytes_per_s.min(mem / ranks as f64);
        }
        r.host_ranks = u32::try_from(ranks).unwrap_or(u32::MAX);
        r.link_on_host = link_bytes_per_s.is_none();
        r
    }

    /// The GEMM rate at batch `k`: [`Profile::gemm_by_k`] interpolated in
    /// log K between the measured batches (the nearest end's rate outside
    /// them), else `rates.gemm_flop_per_s`.
    pub fn gemm_at(&self, k: usize) -> f64 {
        let pts: Vec<[f64; 2]> = self
            .gemm_by_k
            .iter()
            .copied()
            .filter(|[k, f]| *k >= 1.0 && f.is_finite() && *f > 0.0)
            .collect();
        let (Some(first), Some(last)) = (pts.first(), pts.last()) else {
            return self.rates.gemm_flop_per_s;
        };
        let k = k.max(1) as f64;
        if k <= first[0] {
            return first[1];
        }
        if k >= last[0] {
            return last[1];
        }
        for w in pts.windows(2) {
            let ([k0, f0], [k1, f1]) = (w[0], w[1]);
            if k == k0 {
                return f0;
            }
            if k == k1 {
                return f1;
            }
            if k < k1 && k1 > k0 {
                let t = (k.ln() - k0.ln()) / (k1.ln() - k0.ln());
                return f0 + t * (f1 - f0);
            }
        }
        last[1]
    }

    /// This profile with its GEMM rate at batch `k` ([`Profile::gemm_at`]):
    /// what a run at that batch rebuilds its gradients at.
    pub fn at_batch(&self, k: usize) -> Profile {
        let mut p = self.clone();
        p.rates.gemm_flop_per_s = self.gemm_at(k);
        p
    }

    /// Reads a profile written by `tidewire calibrate --out`.
    pub fn load(path: &std::path::Path) -> Result<Profile> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Calibration(format!("cannot read the profile {}: {e}", path.display())))?;
        let p: Profile = serde_json::from_str(&text)
            .map_err(|e| Error::Calibration(format!("{} is not a tidewire calibrate profile: {e}", path.display())))?;
        p.rates
            .validate()
            .map_err(|e| Error::Calibration(format!("{}: {e}", path.display())))?;
        if p.cores == 0 {
            return Err(Error::Calibration(format!(
                "{}: cores must be at least 1",
                path.display()
            )));
        }
        let bad = p.gemm_by_k.iter().enumerate().find(|&(i, &[k, f])| {
            let valid = k.is_finite() && k >= 1.0 && f.is_finite() && f > 0.0;
            let rising = i == 0 || p.gemm_by_k[i - 1][0] < k;
            !(valid && rising)
        });
        if let Some((_, [bad, _])) = bad {
            return Err(Error::Calibration(format!(
                "{}: gemm_by_k must list batches of at least 1, rising, each with a positive finite rate (at K = {bad})",
                path.display()
            )));
        }
        Ok(p)
    }
}

/// Parses [`Rates`] from JSON (`TIDEWIRE_RATES`), checking every rate.
pub fn parse_rates(json: &str) -> Result<Rates> {
    let r: Rates = serde_json::from_str(json).map_err(|e| {
        Error::Calibration(format!(
            "{RATES_ENV}: {e} (expected {{\"link_bytes_per_s\":..,\"msg_s\":..,\"sum_bytes_per_s\":..,\"gemm_flop_per_s\":..}})"
        ))
    })?;
    r.validate()
        .map_err(|e| Error::Calibration(format!("{RATES_ENV}: {e}")))?;
    Ok(r)
}

/// The rates in `TIDEWIRE_RATES`, if it is set.
pub fn rates_from_env() -> Result<Option<Rates>> {
    match std::env::var(RATES_ENV) {
        Ok(v) => parse_rates(&v).map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(Error::Calibration(format!("{RATES_ENV}: {e}"))),
    }
}

/// Measures this machine, spending about `budget` on each of the four rates.
pub fn measure(budget: Duration) -> Result<Profile> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let (one, all) = consistent_sums(sum_rate(budget), sum_rate_on(budget, cores), cores);
    let rates = Rates {
        gemm_flop_per_s: gemm_rate(budget),
        sum_bytes_per_s: one,
        link_bytes_per_s: stream_rate(budget)?,
        msg_s: message_cost(budget)?,
        host_ranks: 1,
        link_on_host: true,
        ps_builds_grad: false,
    };
    rates.validate().map_err(|e| Error::Calibration(e.to_string()))?;
    Ok(Profile {
        cores,
        rates,
        link: "loopback".into(),
        mem_bytes_per_s: Some(all),
        gemm_by_k: Vec::new(),
    })
}

/// The batches [`gemm_curve`] measures.
pub const CURVE_KS: [usize; 5] = [16, 32, 64, 128, 256];

/// [`measure`] `rounds` times, and each rate's median (the GEMM's at each
/// of [`CURVE_KS`] too): on a shared machine one round's rates move by a
/// fifth or more (on the 2-core VM the GEMM read 54.6 and 67.5 GFLOP/s an
/// hour apart, one small message 8.1 and 1.8 µs), and the median of three
/// rounds keeps one disturbed reading out.
pub fn measure_rounds(budget: Duration, rounds: usize) -> Result<Profile> {
    let rounds = rounds.max(1);
    let mut ps = Vec::with_capacity(rounds);
    let mut curves = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        ps.push(measure(budget)?);
        curves.push(gemm_curve(budget));
    }
    let med = |f: &dyn Fn(&Profile) -> f64| median(ps.iter().map(f).collect());
    let mut p = ps[0].clone();
    p.rates.sum_bytes_per_s = med(&|p| p.rates.sum_bytes_per_s);
    p.rates.link_bytes_per_s = med(&|p| p.rates.link_bytes_per_s);
    p.rates.msg_s = med(&|p| p.rates.msg_s);
    p.mem_bytes_per_s = Some(med(&|p| p.mem_bytes_per_s.unwrap_or(0.0)));
    // K = 32 is [`gemm_shape`], which `measure` times too: one median of
    // both, so that the rate and the curve agree there.
    let (k0, _, _) = gemm_shape();
    p.gemm_by_k = CURVE_KS
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let mut v: Vec<f64> = curves.iter().map(|c| c[i][1]).collect();
            if k == k0 {
                v.extend(ps.iter().map(|p| p.rates.gemm_flop_per_s));
            }
            [k as f64, median(v)]
        })
        .collect();
    p.rates.gemm_flop_per_s = p.gemm_at(k0);
    p.rates.validate().map_err(|e| Error::Calibration(e.to_string()))?;
    Ok(p)
}

/// The middle value (the mean of the middle two for an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// FLOP/s of [`cpu::sf_rows`] at each of [`CURVE_KS`], as `[K, FLOP/s]`:
/// N = 4096 and [`gemm_shape`]'s M rows, fewer as K grows past its 32 so
/// that each does its FLOPs (never under 1024 rows: the output stays out
/// of the caches, as a layer's gradient is).
pub fn gemm_curve(budget: Duration) -> Vec<[f64; 2]> {
    let (k0, m0, n) = gemm_shape();
    CURVE_KS
        .iter()
        .map(|&k| {
            let m = (m0 * k0 / k).clamp(1024, m0).div_ceil(cpu::SF_ROW_BLOCK) * cpu::SF_ROW_BLOCK;
            [k as f64, gemm_rate_at(budget, (k, m, n))]
        })
        .collect()
}

/// The sum on one core and on `cores` at once, each floored by what the
/// other shows: the host's memory moves at least what one core moved alone,
/// and one core alone at least its share of every core's total. Either
/// measurement taken while something else held a core reads low, and the
/// other corrects it. (On the 2-core VM one `train` in ten read 1.1 GB/s a
/// rank where the others read 2.6 to 3.1, and HybComm took the PS for
/// VGG19 3 + 1 over loopback, where SFB ran 1.4 times faster.)
fn consistent_sums(one: f64, all: f64, cores: usize) -> (f64, f64) {
    let all_f = all.max(one);
    let one_f = one.max(all / cores.max(1) as f64);
    // Never below what was measured, and the floors hold.
    debug_assert!(all_f >= all && one_f >= one && all_f >= one && one_f * cores.max(1) as f64 >= all);
    (one_f, all_f)
}

/// Runs `f` until `budget` is spent (at least twice) and returns the
/// fastest run's seconds: the rate the machine reaches when nothing else
/// interferes (the sharing is applied afterwards, by [`Profile::node_rates`]).
fn best_of(budget: Duration, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut best = f64::INFINITY;
    let mut runs = 0;
    while runs < 2 || start.elapsed() < budget {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    best.max(1e-9)
}

/// FLOP/s of [`cpu::sf_rows`] at [`gemm_shape`].
pub fn gemm_rate(budget: Duration) -> f64 {
    gemm_rate_at(budget, gemm_shape())
}

/// FLOP/s of [`cpu::sf_rows`] at K×M×N = `(k, m, n)`.
fn gemm_rate_at(budget: Duration, (k, m, n): (usize, usize, usize)) -> f64 {
    let u: Vec<f32> = (0..k * m).map(|i| (i % 7) as f32 * 0.25).collect();
    let v: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.5).collect();
    let mut out = vec![0f32; m * n];
    let s = best_of(budget, || cpu::sf_rows(&u, &v, k, m, n, 0, &mut out));
    std::hint::black_box(&out);
    2.0 * (k * m * n) as f64 / s
}

/// Input bytes per second of [`cpu::add_assign`] on one thread, over arrays
/// out of the caches ([`sum_len`]): the folds a server and SFB run are over
/// whole layers and shards, never cache-resident. (Over 16 MiB arrays, which
/// fit a 32 MiB L3, the 2-core VM read 14.5 GB/s where 256 MiB ones gave 8,
/// and `train`'s folds reached 1.6 to 3.9 GB/s per rank beside 4 ranks.)
pub fn sum_rate(budget: Duration) -> f64 {
    sum_rate_on(budget, 1)
}

/// Input bytes per second of [`cpu::add_assign`] on `threads` threads at
/// once, each folding its own part of one pair of [`sum_len`] arrays: the
/// total.
pub fn sum_rate_on(budget: Duration, threads: usize) -> f64 {
    let len = sum_len();
    let threads = threads.clamp(1, 256);
    let src = vec![1f32; len];
    let mut acc = vec![0f32; len];
    let part = len.div_ceil(threads);
    let s = best_of(budget, || {
        std::thread::scope(|sc| {
            for (a, b) in acc.chunks_mut(part).zip(src.chunks(part)) {
                sc.spawn(move || cpu::add_assign(a, b));
            }
        })
    });
    std::hint::black_box(&acc);
    (len * 4) as f64 / s
}

/// Elements of each array [`sum_rate_on`] folds: twice the largest cache
/// this machine lists (`/sys/devices/system/cpu/cpu0/cache`), within 64 to
/// 256 MiB (64 MiB where it lists none).
fn sum_len() -> usize {
    let cache = largest_cache_bytes().unwrap_or(0);
    (2 * cache).clamp(64 << 20, 256 << 20) / 4
}

/// The largest cache of CPU 0 in bytes, from sysfs (`32768K`, `1M`, ...).
fn largest_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
        .filter_map(|t| parse_cache_size(t.trim()))
        .max()
}

/// `32768K` → 33554432; `2M`, `512` (bytes) likewise; `None` otherwise.
fn parse_cache_size(t: &str) -> Option<usize> {
    let (num, mul) = match t.as_bytes().last()? {
        b'K' => (&t[..t.len() - 1], 1 << 10),
        b'M' => (&t[..t.len() - 1], 1 << 20),
        b'G' => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

fn io(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Calibration(format!("loopback {what}: {e}"))
}

/// Bytes of one write of [`probe_stream`] (and one read of its server at most).
const STREAM_WRITE: usize = 1 << 20;

/// Bytes of the arrays [`probe_stream`] writes from and its server reads
/// into, cycling: as large as [`sum_len`]'s, out of the caches, as the
/// gradients and landing memory a run moves are. (From a 1 MiB buffer that
/// stayed in the caches, the 2-core VM's stream read 4.9 to 5.5 GB/s, and
/// with VGG19 3+1 over loopback the model put the PS a hair under SFB where
/// it ran 1.2 to 1.3 times slower.)
fn stream_len() -> usize {
    sum_len() * 4
}

/// An array of [`stream_len`] bytes with every page touched (filled, not
/// zeroed: zeroed pages would fault in while a probe is timed): what a
/// probe writes from, as a layer's gradient, and its server reads into, as
/// a rank's registered landing memory.
fn touched() -> Vec<u8> {
    vec![7u8; stream_len()]
}

/// Rounds of [`stream_rate`]: its rate is the fastest round's.
const STREAM_ROUNDS: u32 = 4;

/// Bytes per second of one TCP stream over loopback (sender and receiver on
/// two threads) for about `budget`: the fastest of [`STREAM_ROUNDS`]
/// [`probe_stream`]s against one reader, as the other rates are the fastest
/// of their runs. (One stream of the whole budget read 0.90 GB/s in one
/// `train` and 1.77 in the next on the 2-core VM, and the slower figure
/// tipped VGG19's FC layers to SFB with 4 colocated ranks, where the PS
/// was 1.3x faster.)
pub fn stream_rate(budget: Duration) -> Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io("bind"))?;
    let addr = l.local_addr().map_err(io("bind"))?;
    // Touched before the first probe starts.
    let mut buf = touched();
    let server = std::thread::spawn(move || -> Result<()> {
        for _ in 0..STREAM_ROUNDS {
            serve_one(&l, &mut buf)?;
        }
        Ok(())
    });
    let mut best = 0f64;
    let src = touched();
    for _ in 0..STREAM_ROUNDS {
        // On an error the reader is left waiting for a round that never
        // comes: it gives up on its own after 30 s (serve_one), not joined.
        best = best.max(probe_stream_from(addr, budget / STREAM_ROUNDS, &src)?);
    }
    server
        .join()
        .map_err(|_| Error::Calibration("loopback reader panicked".into()))??;
    debug_assert!(best > 0.0, "a probe that returned moved bytes");
    Ok(best)
}

/// Serves one [`probe_stream`] on `addr`, then returns; gives up after 30 s
/// without a probe.
pub fn serve_stream(addr: std::net::SocketAddr) -> Result<()> {
    StreamServer::bind(addr)?.join()
}

/// A [`serve_stream`] in a thread of its own, on a port it reports (bind
/// port 0 to let the system choose), for peers that learn it first.
#[derive(Debug)]
pub struct StreamServer {
    port: u16,
    thread: std::thread::JoinHandle<Result<()>>,
}

impl StreamServer {
    /// Binds `addr` and serves one probe in a thread (30 s at most).
    pub fn bind(addr: std::net::SocketAddr) -> Result<StreamServer> {
        // Touched before the port is open: a prober may start at once.
        let mut buf = touched();
        let l = TcpListener::bind(addr).map_err(io("bind"))?;
        let port = l.local_addr().map_err(io("bind"))?.port();
        let thread = std::thread::Builder::new()
            .name("tidewire-link-probe".into())
            .spawn(move || serve_one(&l, &mut buf))
            .map_err(|e| Error::Thread {
                what: "link probe",
                reason: e.to_string(),
            })?;
        Ok(StreamServer { port, thread })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Waits for the probe to end (or the 30 s to pass).
    pub fn join(self) -> Result<()> {
        self.thread
            .join()
            .map_err(|_| Error::Calibration("the link probe's server panicked".into()))?
    }
}

/// Serves one probe on `l`, giving up after 30 s without one.
fn serve_one(l: &TcpListener, buf: &mut [u8]) -> Result<()> {
    l.set_nonblocking(true).map_err(io("accept"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(io("accept"))?;
                return serve_conn(s, buf);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(io("accept")(e)),
        }
    }
}

/// Reads until the prober half-closes, then answers with the byte count.
fn serve_conn(mut s: TcpStream, buf: &mut [u8]) -> Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(30))).map_err(io("read"))?;
    let (mut total, mut at) = (0u64, 0usize);
    loop {
        let end = (at + STREAM_WRITE).min(buf.len());
        match s.read(&mut buf[at..end]).map_err(io("read"))? {
            0 => break,
            n => {
                total += n as u64;
                at = if at + n >= buf.len() { 0 } else { at + n };
            }
        }
    }
    s.write_all(&total.to_le_bytes()).map_err(io("write"))
}

/// Bytes per second of one TCP stream to a [`serve_stream`] at `addr`:
/// writes for about `budget` (at least 16 MiB), half-closes, and counts
/// until the server has read every byte and said so.
pub fn probe_stream(addr: std::net::SocketAddr, budget: Duration) -> Result<f64> {
    probe_stream_from(addr, budget, &touched())
}

/// [`probe_stream`] from `buf` (at least two writes long), cycling through it.
fn probe_stream_from(addr: std::net::SocketAddr, budget: Duration, buf: &[u8]) -> Result<f64> {
    let round = STREAM_WRITE;
    debug_assert!(buf.len() >= 2 * round, "the cycle below needs two writes");
    let mut s = connect_retrying(addr)?;
    let start = Instant::now();
    let (mut sent, mut at) = (0u64, 0usize);
    while sent < 16 * round as u64 || start.elapsed() < budget {
        s.write_all(&buf[at..at + round]).map_err(io("write"))?;
        sent += round as u64;
        at = if at + 2 * round > buf.len() { 0 } else { at + round };
    }
    s.shutdown(std::net::Shutdown::Write).map_err(io("shutdown"))?;
    s.set_read_timeout(Some(Duration::from_secs(30))).map_err(io("read"))?;
    let mut got = [0u8; 8];
    s.read_exact(&mut got).map_err(io("read the count"))?;
    let secs = start.elapsed().as_secs_f64();
    let got = u64::from_le_bytes(got);
    if got != sent {
        return Err(Error::Calibration(format!(
            "stream to {addr}: sent {sent} bytes, the server read {got}"
        )));
    }
    Ok(sent as f64 / secs.max(1e-9))
}

/// Connects, retrying for up to 10 s while the server is starting.
fn connect_retrying(addr: std::net::SocketAddr) -> Result<TcpStream> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(io("connect")(e)),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Seconds one small message costs one way: half a loopback round trip of
/// 64 bytes, the fastest of many.
pub fn message_cost(budget: Duration) -> Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io("bind"))?;
    let addr = l.local_addr().map_err(io("bind"))?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 64];
        loop {
            match s.read_exact(&mut b) {
                Ok(()) => s.write_all(&b)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut s = TcpStream::connect(addr).map_err(io("connect"))?;
    s.set_nodelay(true).map_err(io("nodelay"))?;
    let mut b = [1u8; 64];
    let mut err = None;
    let rtt = best_of(budget.min(Duration::from_millis(200)), || {
        if err.is_none() {
            if let Err(e) = s.write_all(&b).and_then(|()| s.read_exact(&mut b)) {
                err = Some(e);
            }
        }
    });
    drop(s);
    if let Some(e) = err {
        return Err(io("round trip")(e));
    }
    echo.join()
        .map_err(|_| Error::Calibration("loopback echo panicked".into()))?
        .map_err(io("echo"))?;
    Ok(rtt / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sum_read_low_is_floored_by_the_other() {
        // Both consistent: kept.
        assert_eq!(consistent_sums(6.0e9, 10.0e9, 2), (6.0e9, 10.0e9));
        // Every core at once read below one core alone: disturbed.
        assert_eq!(consistent_sums(6.0e9, 4.4e9, 2), (6.0e9, 6.0e9));
        // One core read below its share of every core's total.
        assert_eq!(consistent_sums(2.2e9, 10.0e9, 2), (5.0e9, 10.0e9));
        assert_eq!(consistent_sums(2.2e9, 10.0e9, 0), (10.0e9, 10.0e9));
    }

    #[test]
    fn a_short_measurement_gives_valid_rates_and_node_shares() {
        let p = measure(Duration::from_millis(30)).unwrap();
        p.rates.validate().unwrap();
        assert!(p.cores >= 1);
        // Twice as many ranks as cores: half of every CPU rate.
        let r = p.node_rates(2 * p.cores, None);
        assert!((r.gemm_flop_per_s - p.rates.gemm_flop_per_s / 2.0).abs() < 1e-3 * r.gemm_flop_per_s);
        // A link of its own is taken, but never above what the CPU moves.
        let slow = p.node_rates(1, Some(1.0));
        assert_eq!(slow.link_bytes_per_s, 1.0);
        let fast = p.node_rates(1, Some(f64::MAX));
        assert_eq!(fast.link_bytes_per_s, p.rates.link_bytes_per_s);
    }

    #[test]
    fn the_sum_is_shared_like_the_memory_and_caches_are_read_from_sysfs() {
        let p = Profile {
            cores: 2,
            rates: Rates {
                link_bytes_per_s: 4e9,
                msg_s: 6.5e-6,
                sum_bytes_per_s: 11.75e9,
                gemm_flop_per_s: 75.6e9,
                host_ranks: 1,
                link_on_host: true,
                ps_builds_grad: false,
            },
            link: "loopback".into(),
            mem_bytes_per_s: Some(16.5e9),
            gemm_by_k: Vec::new(),
        };
        // 4 ranks: half a core each, but a quarter of the memory.
        let r = p.node_rates(4, None);
        assert_eq!((r.sum_bytes_per_s, r.gemm_flop_per_s), (16.5e9 / 4.0, 75.6e9 / 2.0));
        assert_eq!((r.host_ranks, r.link_on_host), (4, true));
        // One rank: its core's rate, the memory being no limit.
        assert_eq!(p.node_rates(1, None).sum_bytes_per_s, 11.75e9);
        // A link of its own is not the host's.
        assert!(!p.node_rates(4, Some(1.25e8)).link_on_host);
        // A profile from before the memory was measured shares the sum like the cores.
        let old: Profile = serde_json::from_str(
            r#"{"cores":2,"rates":{"link_bytes_per_s":4e9,"msg_s":1e-5,"sum_bytes_per_s":1e10,"gemm_flop_per_s":3e10},"link":"loopback"}"#,
        )
        .unwrap();
        assert_eq!(old.node_rates(4, None).sum_bytes_per_s, 5e9);
        assert_eq!(parse_cache_size("32768K"), Some(32 << 20));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("lots"), None);
        assert!((64 << 20..=256 << 20).contains(&(sum_len() * 4)));
    }

    #[test]
    fn the_gemm_rate_follows_the_batch_between_the_measured_points() {
        let mut p = Profile {
            cores: 2,
            rates: Rates {
                link_bytes_per_s: 4e9,
                msg_s: 6.5e-6,
                sum_bytes_per_s: 6e9,
                gemm_flop_per_s: 40e9,
                host_ranks: 1,
                link_on_host: true,
                ps_builds_grad: false,
            },
            link: "loopback".into(),
            mem_bytes_per_s: None,
            gemm_by_k: Vec::new(),
        };
        // No curve: the one rate at every batch.
        assert_eq!((p.gemm_at(8), p.gemm_at(512)), (40e9, 40e9));
        p.gemm_by_k = vec![[32.0, 40e9], [128.0, 80e9], [256.0, 70e9]];
        // The measured points, the ends outside them, and log-K interpolation
        // between (64 is half way from 32 to 128 in log K).
        assert_eq!(p.gemm_at(32), 40e9);
        assert_eq!(p.gemm_at(16), 40e9);
        assert_eq!(p.gemm_at(1024), 70e9);
        assert!((p.gemm_at(64) - 60e9).abs() < 1e-3);
        assert!(p.gemm_at(192) < 80e9 && p.gemm_at(192) > 70e9);
        let q = p.at_batch(128);
        assert_eq!(q.rates.gemm_flop_per_s, 80e9);
        assert_eq!(q.rates.sum_bytes_per_s, p.rates.sum_bytes_per_s);
        // Written and read back; a curve that does not rise is refused.
        let path = std::env::temp_dir().join(format!("tw-curve-{}", std::process::id()));
        std::fs::write(&path, serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(Profile::load(&path).unwrap(), p);
        p.gemm_by_k = vec![[64.0, 40e9], [32.0, 50e9]];
        std::fs::write(&path, serde_json::to_string(&p).unwrap()).unwrap();
        let e = Profile::load(&path).unwrap_err().to_string();
        assert!(e.contains("gemm_by_k") && e.contains("K = 32"), "{e}");
        p.gemm_by_k = vec![[32.0, -1.0]];
        std::fs::write(&path, serde_json::to_string(&p).unwrap()).unwrap();
        assert!(Profile::load(&path).is_err());
        let _ = std::fs::remove_file(&path);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn rounds_give_every_rate_and_the_curve() {
        let p = measure_rounds(Duration::from_millis(10), 3).unwrap();
        p.rates.validate().unwrap();
        let ks: Vec<f64> = p.gemm_by_k.iter().map(|[k, _]| *k).collect();
        assert_eq!(ks, CURVE_KS.map(|k| k as f64).to_vec());
        assert!(p.gemm_by_k.iter().all(|[_, f]| f.is_finite() && *f > 0.0));
        assert!(p.mem_bytes_per_s.is_some_and(|m| m >= p.rates.sum_bytes_per_s));
        // The rate is the curve's at gemm_shape's K.
        assert_eq!(p.rates.gemm_flop_per_s, p.gemm_by_k[1][1]);
        assert_eq!(p.gemm_by_k[1][0], gemm_shape().0 as f64);
    }

    #[test]
    fn bad_rates_and_profiles_are_refused_with_the_reason() {
        assert!(matches!(parse_rates("{"), Err(Error::Calibration(_))));
        let e = parse_rates(r#"{"link_bytes_per_s":-1,"msg_s":0,"sum_bytes_per_s":1,"gemm_flop_per_s":1}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("link_bytes_per_s"), "{e}");
        let ok = parse_rates(r#"{"link_bytes_per_s":1e9,"msg_s":1e-5,"sum_bytes_per_s":1e10,"gemm_flop_per_s":3e10}"#)
            .unwrap();
        assert_eq!(ok.gemm_flop_per_s, 3e10);
        let dir = std::env::temp_dir().join(format!("tw-profile-{}", std::process::id()));
        std::fs::write(&dir, "not json").unwrap();
        let e = Profile::load(&dir).unwrap_err().to_string();
        assert!(e.contains("not a tidewire calibrate profile"), "{e}");
        let _ = std::fs::remove_file(&dir);
        assert!(Profile::load(std::path::Path::new("/nonexistent/p.json")).is_err());
    }
}
