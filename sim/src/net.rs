//! The simulator's network: full-duplex NICs whose bandwidth is shared fairly
//! between the connections that use them.
//!
//! - Every rank has a transmit and a receive side of one link's bandwidth.
//! - A connection is an ordered pair of ranks. Its messages go in order (one
//!   queue pair or one TCP stream); only its head message uses the link.
//! - Each side of a NIC is a processor-sharing server: the connections with a
//!   message there each get an equal share of its bandwidth. This is done
//!   with virtual time, as in fair queueing: `v` grows by `bytes_per_ns / n`
//!   while `n` connections are active, and a message that starts at `v0`
//!   finishes when `v` reaches `v0 + bytes`. Only each side's earliest finish
//!   is ever scheduled, so an event costs O(log n).
//! - A message starts on the receiving side one latency after it starts on the
//!   sending side (cut-through), and is delivered at the later of its finish
//!   there and its send finish plus the latency. An uncontended message thus
//!   takes `bytes / bandwidth + latency`. Where one side is the bottleneck the
//!   other side still counts the connection as active, so a flow slowed at its
//!   sender also holds a share at its receiver: a simplification of max-min
//!   fairness that is exact when the traffic is symmetric (the parameter
//!   server's all-to-all).
//!
//! - With [`Net::trace`] on, each NIC side also records the bytes it served in
//!   each time bin (a side serves at its full rate whenever a connection is
//!   active there): link utilization over time. Off by default; when off it
//!   costs one branch per catch-up.
//!
//! ```
//! use tidewire_sim::net::Net;
//! // 8 Gbit/s = 1 byte/ns, 1 µs latency; two senders into one receiver.
//! let mut net: Net<&str> = Net::new(3, 8e9, 1_000);
//! net.send(0, 0, 2, 1_000_000, "a", None, 0);
//! net.send(0, 1, 2, 1_000_000, "b", None, 0);
//! let mut out = Vec::new();
//! while let Some(t) = net.next_time() {
//!     net.advance(t, &mut out);
//! }
//! // The receiver is shared: both finish together after 2 ms, not 1 ms and 2 ms.
//! assert_eq!(out.len(), 2);
//! assert!(out.iter().all(|(t, _)| (2_000_000..2_002_000).contains(t)), "{out:?}");
//! ```

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};

use tidewire_engine::fxhash::FxHashMap as HashMap;

#[derive(Debug, Clone, Copy, PartialEq)]
struct Tag(f64);

impl Eq for Tag {}

impl PartialOrd for Tag {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Tag {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// One side of one NIC.
#[derive(Debug, Default)]
struct Side {
    /// Bytes per ns of this side (the link's, or a host's loopback).
    rate: f64,
    /// Virtual time: bytes served to each active connection since the start.
    v: f64,
    /// When `v` was last brought up to date, ns.
    last: u64,
    /// (finish tag, message) of each active connection's head.
    heads: BinaryHeap<Reverse<(Tag, usize)>>,
    /// Bumped on each reschedule; older timers are stale.
    gen: u64,
}

#[derive(Debug)]
struct Msg<P> {
    from: u32,
    to: u32,
    bytes: f64,
    on_arrival: Option<P>,
    on_sent: Option<P>,
    sent: Option<u64>,
    received: Option<u64>,
    extra_ns: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// The earliest finish on side `side`, if `gen` is still current.
    Finish { side: usize, gen: u64 },
    /// The message starts on its receiving side.
    RxStart(usize),
    /// The message is handed to its sender's NIC.
    Post(usize),
}

/// A network of `world` ranks. `P` is what a message carries: it comes back
/// from [`Net::advance`] when the message is sent (`on_sent`) and when it
/// arrives (`on_arrival`).
#[derive(Debug)]
pub struct Net<P> {
    world: usize,
    /// Rank → host: ranks of one host share its NIC.
    host: Vec<usize>,
    hosts: usize,
    latency_ns: u64,
    /// Payload bytes each host's NIC sent and received (loopback not counted).
    nic_bytes: Vec<[u64; 2]>,
    /// `0..hosts` transmit sides, `hosts..2 hosts` receive sides, then one
    /// loopback side per host (messages between ranks of one host: no NIC).
    sides: Vec<Side>,
    /// Per (side, from, to): the connection's messages on that side, head first.
    conns: HashMap<(usize, u32, u32), VecDeque<usize>>,
    msgs: Vec<Option<Msg<P>>>,
    free: Vec<usize>,
    timers: BinaryHeap<Reverse<(u64, u64, Timer)>>,
    seq: u64,
    in_flight: usize,
    /// With [`Net::trace`]: bin width, ns, and the bytes each NIC side
    /// (transmit sides, then receive sides) served in each bin.
    trace: Option<(u64, Vec<Vec<f64>>)>,
    /// With [`Net::host_cpu`]: the loopback copies share each host's cores
    /// with its executors' jobs.
    cpu: Option<HostCpu>,
}

/// A host's cores, shared by its loopback copies and its jobs ([`Net::host_cpu`]).
#[derive(Debug, Clone)]
struct HostCpu {
    cores: f64,
    /// One loopback connection's rate with its two cores to itself, bytes/ns.
    stream: f64,
    /// Busy executors on each host.
    jobs: Vec<u32>,
}

impl HostCpu {
    /// The share of its demand every consumer of `host`'s cores gets, with
    /// `conns` loopback connections (two cores each: the sender's copy and
    /// the receiver's, or every core of a smaller host) and its busy
    /// executors (one core each).
    fn speed(&self, host: usize, conns: usize) -> f64 {
        // A connection's two copies, on a host of fewer cores, take what it has.
        let demand = 2f64.min(self.cores) * conns as f64 + f64::from(self.jobs[host]);
        if demand <= self.cores {
            1.0
        } else {
            self.cores / demand
        }
    }
}

/// Adds `rate` bytes/ns over `[t0, t1)` to `bins` of `bin_ns` each.
fn deposit(bins: &mut Vec<f64>, bin_ns: u64, t0: u64, t1: u64, rate: f64) {
    debug_assert!(t0 < t1 && bin_ns > 0, "[{t0}, {t1}) in bins of {bin_ns}");
    let last = ((t1 - 1) / bin_ns) as usize;
    if bins.len() <= last {
        bins.resize(last + 1, 0.0);
    }
    let mut t = t0;
    while t < t1 {
        let b = t / bin_ns;
        let end = ((b + 1) * bin_ns).min(t1);
        bins[b as usize] += (end - t) as f64 * rate;
        t = end;
    }
}

impl<P> Net<P> {
    /// A network of `world` ranks with links of `bandwidth_bps` bit/s each way
    /// and `latency_ns` one way.
    pub fn new(world: usize, bandwidth_bps: f64, latency_ns: u64) -> Self {
        Self::with_hosts(
            (0..world as u32).collect(),
            bandwidth_bps,
            latency_ns,
            bandwidth_bps / 8.0,
        )
    }

    /// A network whose rank `r` lives on host `host[r]` (hosts numbered from
    /// 0): the ranks of one host share its NIC's two sides, and a message
    /// between two of them stays inside the host, at `local_bytes_per_s` with
    /// the same latency, without touching the NIC.
    pub fn with_hosts(host: Vec<u32>, bandwidth_bps: f64, latency_ns: u64, local_bytes_per_s: f64) -> Self {
        let world = host.len();
        // Messages take bytes / rate: the rates are positive.
        debug_assert!(
            bandwidth_bps > 0.0 && local_bytes_per_s > 0.0,
            "{bandwidth_bps} bit/s, {local_bytes_per_s} B/s"
        );
        let hosts = host.iter().map(|&h| h as usize + 1).max().unwrap_or(0);
        let rate = bandwidth_bps / 8e9;
        let side = |rate: f64| Side {
            rate,
            ..Side::default()
        };
        Net {
            world,
            host: host.iter().map(|&h| h as usize).collect(),
            hosts,
            nic_bytes: vec![[0; 2]; hosts],
            latency_ns,
            sides: (0..2 * hosts)
                .map(|_| side(rate))
                .chain((0..hosts).map(|_| side(local_bytes_per_s / 1e9)))
                .collect(),
            conns: HashMap::default(),
            msgs: Vec::new(),
            free: Vec::new(),
            timers: BinaryHeap::new(),
            seq: 0,
            in_flight: 0,
            trace: None,
            cpu: None,
        }
    }

    /// Couples each host's loopback to its `cores`: a connection moves
    /// `stream_bytes_per_s` on two cores of its own (a TCP stream's sender
    /// and receiver copies), a busy executor ([`Net::set_jobs`]) takes one,
    /// and when they want more than `cores` every one gets the same share of
    /// its demand. Messages between hosts are not affected.
    pub fn host_cpu(&mut self, cores: f64, stream_bytes_per_s: f64) {
        assert!(
            cores > 0.0 && stream_bytes_per_s > 0.0 && cores.is_finite() && stream_bytes_per_s.is_finite(),
            "{cores} cores, {stream_bytes_per_s} B/s"
        );
        self.cpu = Some(HostCpu {
            cores,
            stream: stream_bytes_per_s / 1e9,
            jobs: vec![0; self.hosts],
        });
        for h in 0..self.hosts {
            self.reschedule(2 * self.hosts + h, 0);
        }
    }

    /// With [`Net::host_cpu`]: `jobs` executors of `host` are busy from `t`
    /// on (never earlier than the last change), and the share of the cores
    /// its loopback copies get follows.
    pub fn set_jobs(&mut self, host: usize, jobs: u32, t: u64) {
        let side = 2 * self.hosts + host;
        let Some(cpu) = &mut self.cpu else {
            return;
        };
        if cpu.jobs[host] == jobs {
            return;
        }
        self.catch_up(side, t);
        if let Some(cpu) = &mut self.cpu {
            cpu.jobs[host] = jobs;
        }
        self.reschedule(side, t);
    }

    /// With [`Net::host_cpu`]: the share of its demand each consumer of
    /// `host`'s cores gets now (1 without it).
    pub fn cpu_speed(&self, host: usize) -> f64 {
        match &self.cpu {
            Some(c) => c.speed(host, self.sides[2 * self.hosts + host].heads.len()),
            None => 1.0,
        }
    }

    /// With [`Net::host_cpu`]: the busy executors of `host` ([`Net::set_jobs`]).
    pub fn jobs(&self, host: usize) -> u32 {
        self.cpu.as_ref().map_or(0, |c| c.jobs[host])
    }

    /// Whether [`Net::host_cpu`] couples the loopbacks to the cores.
    pub fn has_host_cpu(&self) -> bool {
        self.cpu.is_some()
    }

    /// The host of rank `r`.
    pub fn host_of(&self, r: u32) -> usize {
        self.host[r as usize]
    }

    /// Records, from now on, the bytes each NIC side serves per `bin_ns`
    /// (≥ 1) of virtual time, bins counted from time 0 ([`Net::traced`]).
    pub fn trace(&mut self, bin_ns: u64) {
        self.trace = Some((bin_ns.max(1), vec![Vec::new(); 2 * self.hosts]));
    }

    /// With [`Net::trace`]: the bin width, ns, and per host the bytes its NIC
    /// sent and received in each bin (`[sent, received]`, bin `i` covering
    /// `[i·bin_ns, (i+1)·bin_ns)`; both as long as the last busy bin of any
    /// side). A side serves at its full rate while any connection is active
    /// on it; the receive side counts a connection active once its first
    /// byte could be there, so where the sender is the bottleneck the
    /// receive trace runs ahead of it (see the module's fairness note).
    pub fn traced(&self) -> Option<(u64, Vec<[Vec<f64>; 2]>)> {
        let (bin, sides) = self.trace.as_ref()?;
        let len = sides.iter().map(Vec::len).max().unwrap_or(0);
        let pad = |v: &Vec<f64>| {
            let mut v = v.clone();
            v.resize(len, 0.0);
            v
        };
        Some((
            *bin,
            (0..self.hosts)
                .map(|h| [pad(&sides[h]), pad(&sides[self.hosts + h])])
                .collect(),
        ))
    }

    /// Payload bytes host `h`'s NIC has sent and received so far.
    pub fn nic_bytes(&self, h: usize) -> [u64; 2] {
        self.nic_bytes[h]
    }

    /// Hosts.
    pub fn hosts(&self) -> usize {
        self.hosts
    }

    /// Messages posted and not yet delivered.
    pub fn in_flight(&self) -> usize {
        debug_assert_eq!(
            self.in_flight + self.free.len(),
            self.msgs.len(),
            "a message is in flight or free"
        );
        self.in_flight
    }

    /// Sends `bytes` from `from` to `to`, handed to the NIC at `t` (which may
    /// be later than the last [`Net::advance`], never earlier). `on_sent` comes
    /// back when the last byte leaves `from`; `on_arrival` when it has arrived
    /// at `to`, `extra_ns` later than the network alone would deliver it.
    #[allow(clippy::too_many_arguments)]
    pub fn send(&mut self, t: u64, from: u32, to: u32, bytes: usize, on_arrival: P, on_sent: Option<P>, extra_ns: u64) {
        assert!(
            (from as usize) < self.world && (to as usize) < self.world,
            "rank out of range"
        );
        let m = Msg {
            from,
            to,
            bytes: bytes.max(1) as f64,
            on_arrival: Some(on_arrival),
            on_sent,
            sent: None,
            received: None,
            extra_ns,
        };
        let id = match self.free.pop() {
            Some(i) => {
                self.msgs[i] = Some(m);
                i
            }
            None => {
                self.msgs.push(Some(m));
                self.msgs.len() - 1
            }
        };
        self.in_flight += 1;
        self.timer(t, Timer::Post(id));
    }

    /// When the next thing happens in the network.
    pub fn next_time(&self) -> Option<u64> {
        self.timers.peek().map(|Reverse((t, _, _))| *t)
    }

    /// Runs the network's next timer, which must be due at `t`
    /// ([`Net::next_time`]), and appends what came back, with its time.
    pub fn advance(&mut self, t: u64, out: &mut Vec<(u64, P)>) {
        let Some(Reverse((due, _, timer))) = self.timers.pop() else {
            return;
        };
        debug_assert_eq!(due, t);
        match timer {
            Timer::Post(id) => {
                let (from, to, bytes) = {
                    let m = self.msgs[id].as_ref().expect("posted message");
                    debug_assert!(m.sent.is_none() && m.received.is_none(), "message {id} posted twice");
                    (m.from, m.to, m.bytes)
                };
                let (hf, ht) = (self.host[from as usize], self.host[to as usize]);
                if hf == ht {
                    self.enqueue(2 * self.hosts + hf, (from, to), id, t, true);
                } else {
                    self.nic_bytes[hf][0] += bytes as u64;
                    self.nic_bytes[ht][1] += bytes as u64;
                    self.enqueue(hf, (from, to), id, t, true);
                }
            }
            Timer::RxStart(id) => {
                let (from, to) = {
                    let m = self.msgs[id].as_ref().expect("message in flight");
                    debug_assert!(m.received.is_none(), "message {id} received before it started there");
                    (m.from, m.to)
                };
                self.enqueue(self.hosts + self.host[to as usize], (from, to), id, t, false);
            }
            Timer::Finish { side, gen } => {
                if self.sides[side].gen != gen {
                    // A stale timer: the side was rescheduled since.
                    debug_assert!(self.sides[side].gen > gen);
                    return;
                }
                self.catch_up(side, t);
                debug_assert_eq!(self.sides[side].last, t, "side {side} is brought up to now");
                // One byte-nanosecond of slack absorbs the rounding of the timer.
                let slack = self.sides[side].rate.max(1e-9) * 2.0;
                let mut done = Vec::new();
                {
                    let s = &mut self.sides[side];
                    while let Some(Reverse((tag, id))) = s.heads.peek().copied() {
                        if tag.0 > s.v + slack {
                            break;
                        }
                        s.heads.pop();
                        done.push(id);
                    }
                }
                for id in done {
                    self.finished(side, id, t, out);
                }
                self.reschedule(side, t);
                self.debug_invariants();
            }
        }
    }

    /// What every finish leaves true (O(sides)).
    fn debug_invariants(&self) {
        debug_assert_eq!(self.in_flight + self.free.len(), self.msgs.len());
        // A connection is kept while it has a message, which is on at most two sides at once.
        debug_assert!(
            self.conns.len() <= 2 * self.in_flight,
            "{} connections",
            self.conns.len()
        );
        debug_assert!(self.sides.iter().all(|s| s.rate > 0.0 && s.v.is_finite()));
    }

    fn timer(&mut self, t: u64, timer: Timer) {
        self.seq += 1;
        self.timers.push(Reverse((t, self.seq, timer)));
    }

    /// Brings the side's virtual time up to `t`.
    fn catch_up(&mut self, side: usize, t: u64) {
        let s = &mut self.sides[side];
        let n = s.heads.len();
        if n > 0 && t > s.last {
            s.v += (t - s.last) as f64 * s.rate / n as f64;
            debug_assert!(s.v.is_finite(), "virtual time of side {side}");
            if let Some((bin, sides)) = &mut self.trace {
                if let Some(bins) = sides.get_mut(side) {
                    deposit(bins, *bin, s.last, t, s.rate);
                }
            }
        }
        s.last = s.last.max(t);
    }

    fn reschedule(&mut self, side: usize, t: u64) {
        // A loopback side's rate follows its host's cores (the side is
        // brought up to `t` at the old rate first, by every caller).
        if let (Some(cpu), true) = (&self.cpu, side >= 2 * self.hosts) {
            let n = self.sides[side].heads.len();
            let rate = cpu.stream * cpu.speed(side - 2 * self.hosts, n) * n.max(1) as f64;
            self.sides[side].rate = rate;
        }
        let s = &mut self.sides[side];
        s.gen += 1;
        let Some(Reverse((tag, _))) = s.heads.peek().copied() else {
            return;
        };
        let n = s.heads.len() as f64;
        debug_assert!(s.rate > 0.0, "side {side} serves at a positive rate");
        let dt = ((tag.0 - s.v).max(0.0) * n / s.rate).ceil() as u64;
        let gen = s.gen;
        self.timer(t + dt, Timer::Finish { side, gen });
    }

    /// Puts message `id` on its connection's queue at `side`; it starts there
    /// now if the connection was idle.
    fn enqueue(&mut self, side: usize, (from, to): (u32, u32), id: usize, t: u64, tx: bool) {
        let q = self.conns.entry((side, from, to)).or_default();
        q.push_back(id);
        if q.len() == 1 {
            self.start(side, id, t, tx);
        }
    }

    fn start(&mut self, side: usize, id: usize, t: u64, tx: bool) {
        self.catch_up(side, t);
        let bytes = self.msgs[id].as_ref().expect("message in flight").bytes;
        debug_assert!(bytes >= 1.0);
        let s = &mut self.sides[side];
        s.heads.push(Reverse((Tag(s.v + bytes), id)));
        self.reschedule(side, t);
        if tx && side < self.hosts {
            self.timer(t + self.latency_ns, Timer::RxStart(id));
        }
    }

    fn finished(&mut self, side: usize, id: usize, t: u64, out: &mut Vec<(u64, P)>) {
        let tx = side < self.hosts || side >= 2 * self.hosts;
        let lat = self.latency_ns;
        let loopback = side >= 2 * self.hosts;
        let (key, deliver_at) = {
            let m = self.msgs[id].as_mut().expect("message in flight");
            let key = (m.from, m.to);
            // Each side finishes a message once.
            if tx {
                debug_assert!(m.sent.is_none(), "message {id} sent twice");
                m.sent = Some(t);
                if loopback {
                    // Inside the host: no receiving NIC to cross.
                    m.received = Some(t);
                }
                if let Some(p) = m.on_sent.take() {
                    out.push((t, p));
                }
            } else {
                debug_assert!(m.received.is_none(), "message {id} received twice");
                m.received = Some(t);
            }
            let at = match (m.sent, m.received) {
                (Some(s), Some(r)) => Some(r.max(s + lat) + m.extra_ns),
                _ => None,
            };
            (key, at)
        };
        if let Some(at) = deliver_at {
            let m = self.msgs[id].take().expect("message in flight");
            out.push((at, m.on_arrival.expect("delivered once")));
            self.free.push(id);
            debug_assert!(self.in_flight > 0);
            self.in_flight -= 1;
        }
        let q = self.conns.get_mut(&(side, key.0, key.1)).expect("connection");
        // Only a connection's head message uses the link.
        debug_assert_eq!(
            q.front(),
            Some(&id),
            "message {id} finished behind its connection's head"
        );
        q.pop_front();
        if let Some(&next) = q.front() {
            self.start(side, next, t, tx);
        } else {
            self.conns.remove(&(side, key.0, key.1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(net: &mut Net<u32>) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        while let Some(t) = net.next_time() {
            net.advance(t, &mut out);
        }
        out.sort();
        out
    }

    #[test]
    fn one_message_takes_serialization_plus_latency() {
        let mut net = Net::new(2, 8e9, 500);
        net.send(100, 0, 1, 4_000, 7, Some(8), 0);
        let out = drain(&mut net);
        assert_eq!(out, vec![(4_100, 8), (4_600, 7)]);
        assert_eq!(net.in_flight(), 0);
    }

    #[test]
    fn a_sender_shares_its_link_between_connections() {
        // 1 byte/ns; two connections from rank 0 get half each.
        let mut net = Net::new(3, 8e9, 0);
        net.send(0, 0, 1, 1_000, 1, None, 0);
        net.send(0, 0, 2, 3_000, 2, None, 0);
        let out = drain(&mut net);
        // 1 finishes at 2000 (half rate); then 2 has 2000 left at full rate.
        assert_eq!(out, vec![(2_000, 1), (4_000, 2)]);
    }

    #[test]
    fn one_connection_is_in_order() {
        let mut net = Net::new(2, 8e9, 0);
        net.send(0, 0, 1, 1_000, 1, None, 0);
        net.send(0, 0, 1, 1_000, 2, None, 0);
        let out = drain(&mut net);
        assert_eq!(out, vec![(1_000, 1), (2_000, 2)]);
    }

    #[test]
    fn a_receiver_shares_its_link() {
        let mut net = Net::new(4, 8e9, 0);
        for from in 0..3 {
            net.send(0, from, 3, 1_000, from, None, 0);
        }
        let out = drain(&mut net);
        assert!(out.iter().all(|(t, _)| (3_000..3_010).contains(t)), "{out:?}");
    }

    #[test]
    fn a_later_message_joins_the_share() {
        let mut net = Net::new(3, 8e9, 0);
        net.send(0, 0, 1, 2_000, 1, None, 0);
        net.send(1_000, 0, 2, 500, 2, None, 0);
        let out = drain(&mut net);
        // From 1000 both share: 2 needs 500 at half rate (1000 ns); 1 has 1000
        // left, 500 of it shared, then 500 alone.
        assert_eq!(out, vec![(2_000, 2), (2_500, 1)]);
    }

    #[test]
    fn a_hosts_loopback_shares_its_cores_with_its_jobs() {
        // 2 cores, a stream of 1 byte/ns on two of them: alone it has them.
        let mut net = Net::with_hosts(vec![0, 0, 0], 8e9, 0, 5e9);
        net.host_cpu(2.0, 1e9);
        assert_eq!(net.cpu_speed(0), 1.0);
        net.send(0, 0, 1, 1_000, 1, None, 0);
        assert_eq!(drain(&mut net), [(1_000, 1)]);
        // A busy executor alone has a core; beside the stream it wants a third
        // one: each consumer gets 2/3 of its demand, the stream 2/3 byte/ns.
        net.set_jobs(0, 1, 1_000);
        assert_eq!((net.jobs(0), net.cpu_speed(0)), (1, 1.0));
        net.send(1_000, 0, 1, 1_000, 2, None, 0);
        net.advance(1_000, &mut Vec::new());
        assert!((net.cpu_speed(0) - 2.0 / 3.0).abs() < 1e-12);
        let out = drain(&mut net);
        assert!((2_499..=2_501).contains(&out[0].0), "{out:?}");
        // Two connections and the job: 5 cores wanted, 2/5 each; the job's
        // end half-way through speeds the rest up to 1/2 (4 wanted).
        net.send(3_000, 0, 1, 1_000, 3, None, 0);
        net.send(3_000, 1, 2, 1_000, 4, None, 0);
        net.advance(3_000, &mut Vec::new());
        net.advance(3_000, &mut Vec::new());
        assert!((net.cpu_speed(0) - 0.4).abs() < 1e-12);
        net.set_jobs(0, 0, 4_000); // 400 bytes each moved by then
        assert_eq!(net.cpu_speed(0), 0.5);
        let out = drain(&mut net);
        // 600 bytes left at 1/2 byte/ns: 1,200 ns more.
        assert!(out.iter().all(|(t, _)| (5_199..=5_201).contains(t)), "{out:?}");
    }

    #[test]
    fn ranks_of_one_host_share_its_nic_and_talk_inside_it() {
        // Hosts: {0, 1} and {2}. 0 and 1 both send to 2: they share host 0's
        // transmit side. 0 → 1 stays inside the host (2 bytes/ns), off the NIC.
        let mut net = Net::with_hosts(vec![0, 0, 1], 8e9, 0, 2e9);
        net.send(0, 0, 2, 1_000, 1, None, 0);
        net.send(0, 1, 2, 1_000, 2, None, 0);
        net.send(0, 0, 1, 1_000, 3, None, 0);
        let out = drain(&mut net);
        assert_eq!(out[0], (500, 3), "{out:?}");
        assert!(out[1..].iter().all(|(t, _)| (2_000..2_010).contains(t)), "{out:?}");
        assert_eq!(net.nic_bytes(0), [2_000, 0]);
        assert_eq!(net.nic_bytes(1), [0, 2_000]);
    }

    #[test]
    fn the_trace_has_each_sides_bytes_per_bin() {
        // 1 byte/ns. 0 → 1: 2500 bytes from t = 0; 1 → 0: 1000 bytes from t = 3000.
        let mut net = Net::new(2, 8e9, 100);
        net.trace(1_000);
        net.send(0, 0, 1, 2_500, 1, None, 0);
        net.send(3_000, 1, 0, 1_000, 2, None, 0);
        drain(&mut net);
        let (bin, t) = net.traced().expect("traced");
        assert_eq!(bin, 1_000);
        let r = |v: &[f64]| v.iter().map(|x| x.round() as u64).collect::<Vec<_>>();
        assert_eq!(r(&t[0][0]), [1_000, 1_000, 500, 0, 0]);
        // Received one latency later; every series as long as the longest.
        assert_eq!(r(&t[1][1]), [900, 1_000, 600, 0, 0]);
        assert_eq!(r(&t[1][0]), [0, 0, 0, 1_000, 0]);
        assert_eq!(r(&t[0][1]), [0, 0, 0, 900, 100]);
        let total: f64 = t.iter().flat_map(|h| h[0].iter()).sum();
        assert!((total - 3_500.0).abs() < 1.0);
        assert!(Net::<u32>::new(2, 8e9, 0).traced().is_none());
    }

    #[test]
    fn extra_delay_is_added() {
        let mut net = Net::new(2, 8e9, 10);
        net.send(0, 0, 1, 100, 1, None, 90);
        assert_eq!(drain(&mut net), vec![(200, 1)]);
    }
}
