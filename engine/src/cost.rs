//! Poseidon's cost model (Table 1 of the ATC'17 paper): the parameters one node
//! sends plus receives per iteration to synchronize one layer.
//!
//! Notation: an FC layer's weight is M×N, the batch is K, P1 workers and P2 servers.
//!
//! | scheme | node | parameters moved |
//! |---|---|---|
//! | SFB | worker (or worker+server) | 2K(P1−1)(M+N) |
//! | PS | worker+server | 2MN(P1+P2−2)/P2 |
//! | PS | worker only | 2MN |
//! | PS | server only | 2MN·P1/P2 |
//! | Adam | worker only | K(M+N) + MN |
//! | Adam | server only (the layer's) | P1·K(M+N) + P1·MN |
//! | Adam | worker+server (the layer's) | (P1−1)(K(M+N) + MN) |
//!
//! Adam (Poseidon §3.2, after Project Adam) sends sufficient factors to the
//! server that holds the layer, which rebuilds the gradient, applies it and
//! sends the full matrix back: the worker's load is small, and the layer's
//! server carries P1 times the full matrix. The engine runs it as a mode
//! ([`crate::config::SyncMode::Adam`], `--sync adam`); these rows are its
//! analytic traffic, for the papers' figures.
//!
//! ```
//! use tidewire_engine::cost::{ps_params, sfb_params, NodeRole};
//! // Poseidon's worked example: a 4096×4096 FC layer, K = 32, P1 = P2 = 8.
//! assert_eq!(ps_params(NodeRole::Both, 4096, 4096, 8, 8), 58_720_256);
//! assert_eq!(sfb_params(32, 8, 4096, 4096), 3_670_016);
//! ```

use serde::Serialize;

/// Which of the cost model's node kinds a figure is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeRole {
    /// Runs a worker and a server shard.
    Both,
    /// Runs only a worker.
    WorkerOnly,
    /// Runs only a server shard.
    ServerOnly,
}

/// Parameters moved per node per iteration by sufficient-factor broadcast:
/// 2K(P1−1)(M+N). A server-only node moves none.
pub fn sfb_params(k: u64, p1: u64, m: u64, n: u64) -> u64 {
    let p = 2 * k * p1.saturating_sub(1) * (m + n);
    // A single worker sends its factors to no one.
    debug_assert!(p1 > 1 || p == 0);
    p
}

/// Parameters moved per node per iteration through the sharded PS.
pub fn ps_params(role: NodeRole, m: u64, n: u64, p1: u64, p2: u64) -> u64 {
    let mn = m * n;
    match role {
        NodeRole::Both => 2 * mn * (p1 + p2).saturating_sub(2) / p2.max(1),
        NodeRole::WorkerOnly => 2 * mn,
        NodeRole::ServerOnly => 2 * mn * p1 / p2.max(1),
    }
}

/// Parameters moved per node per iteration by Adam's strategy (factors up,
/// full matrices down), for the node holding the layer where it is a server.
pub fn adam_params(role: NodeRole, k: u64, m: u64, n: u64, p1: u64) -> u64 {
    let (mn, f) = (m * n, k * (m + n));
    match role {
        NodeRole::WorkerOnly => f + mn,
        NodeRole::ServerOnly => p1 * (f + mn),
        NodeRole::Both => p1.saturating_sub(1) * (f + mn),
    }
}

/// The busiest node's load for each scheme, for a cluster layout.
///
/// With colocated nodes (every node is worker and server) it is Poseidon's
/// worker+server row. With separate roles the bottleneck is the larger of the
/// worker's and the server's load.
pub fn bottleneck(colocated: bool, k: u64, m: u64, n: u64, p1: u64, p2: u64) -> (u64, u64) {
    let sfb = sfb_params(k, p1, m, n);
    let ps = if colocated {
        ps_params(NodeRole::Both, m, n, p1, p2)
    } else {
        ps_params(NodeRole::WorkerOnly, m, n, p1, p2).max(ps_params(NodeRole::ServerOnly, m, n, p1, p2))
    };
    (ps, sfb)
}

/// Measured rates of one node, in the engine's terms: what HybComm weighs in
/// **seconds** ([`seconds`]). The engine measures nothing itself (it is
/// sans-IO); the runtime or the launcher measures them and hands them in
/// ([`crate::book::Book::with_rates`]), already divided by whatever shares
/// the node's CPU or link (several ranks on one host share its cores, and on
/// loopback its "link" is CPU too).
///
/// Without rates the book decides in bytes, as Poseidon's Table 1 does: that
/// is exact on the paper's machines (reconstruction on a GPU, "often
/// negligible compared to communication", §3.2) and wrong beside a CPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct Rates {
    /// Bytes per second one node's link carries each way.
    pub link_bytes_per_s: f64,
    /// Seconds the runtime spends per message it sends or receives (post,
    /// completion, wake-up): the cost that many small slices pay.
    pub msg_s: f64,
    /// Bytes of input per second folded into an accumulator (a server's sum,
    /// SFB's sum of the rebuilt gradients).
    pub sum_bytes_per_s: f64,
    /// FLOP/s of the GEMM that rebuilds a gradient from its factors, on the
    /// executor where it runs (the CPU's, or the GPU's where one is used).
    pub gemm_flop_per_s: f64,
    /// Ranks sharing one host's cores, memory and loopback, the rates above
    /// being each one's share of it; 0 or 1: a host of its own. Where ranks
    /// share a host, what one rank leaves idle the others use, so
    /// [`seconds`] weighs the busiest host's whole work, not only its
    /// busiest rank's (see [`on_host`]).
    #[serde(default)]
    pub host_ranks: u32,
    /// Whether the link is the host's too (loopback: its bytes are the
    /// shared cores' work), so that [`on_host`] shares the transfer as it
    /// does the compute; false for a link of the node's own (a NIC, a
    /// shaped namespace), whose time stays the busiest node's.
    #[serde(default)]
    pub link_on_host: bool,
    /// Whether a PS layer's dense gradient is built from its factors on each
    /// worker, at [`Rates::gemm_flop_per_s`]: a GEMM of 2KMN that the PS pays
    /// and SFB does not (SFB rebuilds from the factors instead). True wherever
    /// FC layers on the PS are handed in as factors (the runtime's
    /// `FactorsToGrad`: `tidewire train`, `tidewire.torch` with
    /// `sfb='adaptive'`) or the learner builds it (`train`'s local
    /// learners); false where the framework's backward hands in the
    /// gradient it computed anyway (`tidewire.torch` otherwise, a C caller).
    #[serde(default)]
    pub ps_builds_grad: bool,
}

/// A rate out of range ([`Rates::validate`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidRate {
    /// A throughput that is not finite and above 0 (`rate` names the field).
    #[error("{rate} must be a finite rate above 0, not {value}")]
    NotPositive { rate: &'static str, value: f64 },
    /// A per-message cost that is not finite and at least 0.
    #[error("msg_s must be finite and at least 0, not {value}")]
    MessageCost { value: f64 },
}

impl Rates {
    /// Checks every rate is finite and positive (the message cost may be 0).
    pub fn validate(&self) -> Result<(), InvalidRate> {
        let pos = |value: f64, rate: &'static str| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(InvalidRate::NotPositive { rate, value })
            }
        };
        pos(self.link_bytes_per_s, "link_bytes_per_s")?;
        pos(self.sum_bytes_per_s, "sum_bytes_per_s")?;
        pos(self.gemm_flop_per_s, "gemm_flop_per_s")?;
        if !(self.msg_s.is_finite() && self.msg_s >= 0.0) {
            return Err(InvalidRate::MessageCost { value: self.msg_s });
        }
        Ok(())
    }

    /// These rates on a node that gets `cpu` of its measured CPU and `link`
    /// of its measured link (each in (0, 1]): e.g. `cores / ranks` for ranks
    /// sharing one host. The per-message cost grows by the CPU share.
    pub fn shared(self, cpu: f64, link: f64) -> Rates {
        let (cpu, link) = (cpu.clamp(1e-6, 1.0), link.clamp(1e-6, 1.0));
        let r = Rates {
            link_bytes_per_s: self.link_bytes_per_s * link,
            msg_s: self.msg_s / cpu,
            sum_bytes_per_s: self.sum_bytes_per_s * cpu,
            gemm_flop_per_s: self.gemm_flop_per_s * cpu,
            host_ranks: self.host_ranks,
            link_on_host: self.link_on_host,
            ps_builds_grad: self.ps_builds_grad,
        };
        // A share of valid rates is valid (and never faster).
        debug_assert!(
            self.validate().is_err() || (r.validate().is_ok() && r.link_bytes_per_s <= self.link_bytes_per_s)
        );
        r
    }
}

/// P3's slice size (§3: "~50,000 parameters"), the floor of [`slice_params_for`].
pub const P3_SLICE_PARAMS: usize = 50_000;

/// The share of a slice's transfer time its per-message cost may take.
/// Chosen by measurement, not from a paper: on the 2-core VM, VGG19 with 3
/// workers and 1 server over loopback, `--sync p3` ran at 0.97x `wfbp` with
/// 50,000-parameter slices and 1.09x with 200,000 (2 runs each, 2026-11-26),
/// where the measured rates (about 20 µs a message, 1.5 GB/s per rank) put
/// a 4% overhead at about 190,000.
pub const SLICE_OVERHEAD: f64 = 0.04;

/// The slice size at `rates`: the smallest whose per-message cost is at most
/// [`SLICE_OVERHEAD`] of its time on the link, never under
/// [`P3_SLICE_PARAMS`] (finer slices than P3's win nothing where messages
/// are cheap) nor over a 2 MiB chunk (Poseidon's).
pub fn slice_params_for(r: &Rates) -> usize {
    let bytes = r.msg_s * r.link_bytes_per_s / SLICE_OVERHEAD;
    let params = if bytes.is_finite() {
        (bytes / 4.0).ceil() as usize
    } else {
        usize::MAX
    };
    let slice = params.clamp(P3_SLICE_PARAMS, (2 << 20) / 4);
    // Dearer messages never make slices smaller.
    debug_assert!(slice >= P3_SLICE_PARAMS && slice * 4 <= 2 << 20, "{slice}");
    slice
}

/// What applying an update to one parameter costs, in parameters folded by
/// the sum ([`Rates::sum_bytes_per_s`]): SGD with momentum reads the
/// gradient, the parameter and its momentum and writes the last two, where
/// a fold reads two arrays and writes one (5/3). Measured in `train` on the
/// 2-core VM (VGG19, 3 workers and 1 server, 2026-11-27): updates at 232 to
/// 271 M parameters/s beside folds at 1.07 to 1.66 GB/s, 1.0 to 1.6 folds.
pub const APPLY_SUMS: f64 = 1.5;

/// One FC layer's shape and the cluster around it, for [`seconds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerLoad {
    /// Every node is a worker and a server.
    pub colocated: bool,
    /// Batch K per worker (rows of each factor).
    pub k: u64,
    /// Rows M of the weight.
    pub m: u64,
    /// Columns N of the weight.
    pub n: u64,
    /// Workers P1.
    pub p1: u64,
    /// Servers P2.
    pub p2: u64,
    /// Messages the PS sends per worker for this layer (its slices).
    pub ps_messages: u64,
}

/// Seconds one scheme costs its busiest node for one layer, in parts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SchemeSeconds {
    /// Bytes over the link.
    pub transfer_s: f64,
    /// Messages times the per-message cost.
    pub messages_s: f64,
    /// Reconstruction (GEMM) and sums.
    pub compute_s: f64,
}

impl SchemeSeconds {
    /// The whole: transfer, messages and compute are added, not overlapped
    /// (on a CPU-bound node the transfer is CPU too).
    pub fn total(&self) -> f64 {
        self.transfer_s + self.messages_s + self.compute_s
    }
}

/// The time one scheme costs a layer, from each node's: on a host of its own
/// a node's time is its own, and the busiest node's decides. Where
/// `host_ranks` ranks share a host (their rates each one's share), the busiest
/// host holds the busiest node and `host_ranks − 1` others, taken at the
/// others' mean, and its cores and memory serve whichever of them works:
/// `(busiest + (R − 1)·mean of the others) / R`, part by part. With every
/// rank on one host that is the mean over the nodes: the host's whole work
/// at its whole rates. (Taken as the busiest node alone, a loopback run's
/// PS was charged its server at a quarter of the machine while the workers
/// idled, and HybComm took SFB, whose every worker rebuilds every
/// gradient at once, where the PS was as fast or faster.)
///
/// The transfer is shared so only where the link is the host's
/// ([`Rates::link_on_host`]); a link of each node's own keeps the busiest
/// node's transfer. `others` are (count, time) of the nodes besides the
/// busiest.
pub fn on_host(rates: &Rates, busiest: SchemeSeconds, others: &[(u64, SchemeSeconds)]) -> SchemeSeconds {
    let n: u64 = others.iter().map(|(c, _)| c).sum();
    let r = (rates.host_ranks.max(1) as u64).min(n + 1) as f64;
    if r <= 1.0 || n == 0 {
        return busiest;
    }
    let mean = |f: fn(&SchemeSeconds) -> f64| others.iter().map(|(c, s)| *c as f64 * f(s)).sum::<f64>() / n as f64;
    let part = |f: fn(&SchemeSeconds) -> f64| (f(&busiest) + (r - 1.0) * mean(f)) / r;
    let s = SchemeSeconds {
        transfer_s: if rates.link_on_host {
            part(|s| s.transfer_s)
        } else {
            busiest.transfer_s
        },
        messages_s: part(|s| s.messages_s),
        compute_s: part(|s| s.compute_s),
    };
    // A mean of parts is no more than the largest of them.
    debug_assert!(
        [
            (
                s.transfer_s,
                busiest.transfer_s,
                others.iter().map(|o| o.1.transfer_s).fold(0.0, f64::max)
            ),
            (
                s.messages_s,
                busiest.messages_s,
                others.iter().map(|o| o.1.messages_s).fold(0.0, f64::max)
            ),
            (
                s.compute_s,
                busiest.compute_s,
                others.iter().map(|o| o.1.compute_s).fold(0.0, f64::max)
            ),
        ]
        .iter()
        .all(|&(x, b, o)| !x.is_finite() || x <= b.max(o) * (1.0 + 1e-9)),
        "{s:?} {busiest:?}"
    );
    s
}

/// (PS, SFB) seconds for one FC layer at `rates`: its busiest node's, or
/// where ranks share hosts its busiest host's ([`on_host`]).
///
/// - **PS**, per node kind present: its Table 1 bytes over the link, its
///   pushes and broadcasts times the message cost, and on a server the fold
///   of P1 gradients of its share (MN·P1/P2 elements summed) and the update
///   of its share (MN/P2, at [`APPLY_SUMS`] folds a parameter). On a worker,
///   where the driver builds the dense gradient from factors itself
///   ([`Rates::ps_builds_grad`]), that GEMM too: 2KMN FLOPs. (Left out, on
///   the 2-core VM, VGG19 3+1 over loopback, fc6's PS and SFB came within
///   0.001 to 0.09 s of each other, and the start-up choice went either
///   way: the PS at 57 and 59 samples/s, SFB at 79 and 79.)
/// - **SFB**, on every worker: 2K(P1−1)(M+N) parameters over the link,
///   2(P1−1) factor blocks, the rebuild of all P1 workers' gradients,
///   2KMN FLOPs each, summed into the layer ((P1−1)·MN), and the update of
///   the whole layer (MN, every worker applies it); a server-only node has
///   nothing to do for the layer. The worker's own counts too: the runtime
///   rebuilds every worker's in worker order (`cpu::sf_sum`), so that the
///   sum is the same bits on every worker, while the framework's backward
///   has computed the dense gradient anyway. (Left out, it tipped a
///   4096×4096 layer to SFB on a 2-core machine where SFB made
///   `tidewire.torch` 0.81x DDP against 0.97x with the PS.)
///
/// Table 1's counts are a node's bytes in and out together, the same each
/// way for both schemes. A link of the node's own carries both directions
/// at once (`link_bytes_per_s` each way), so its transfer takes half the
/// count over the rate; over loopback ([`Rates::link_on_host`]) both
/// directions are the host's copies, and the whole count is charged.
/// (Charging the whole count on a link of its own put PS at twice its time:
/// at 5 Gbit/s per node it took AlexNet 3+1's fc6 and fc7 to SFB, where the
/// PS ran at 426 samples/s and SFB at 333.)
pub fn seconds(l: &LayerLoad, r: &Rates) -> (SchemeSeconds, SchemeSeconds) {
    debug_assert!(l.p1 >= 1 && l.p2 >= 1, "a cluster has a worker and a server");
    let mn = (l.m * l.n) as f64;
    let (p1, p2) = (l.p1 as f64, l.p2.max(1) as f64);
    let peers = l.p1.saturating_sub(1) as f64;
    let ways = if r.link_on_host { 1.0 } else { 2.0 };
    let bytes = |params: u64| params as f64 * 4.0 / r.link_bytes_per_s / ways;
    let apply_s = |params: f64| params * APPLY_SUMS * 4.0 / r.sum_bytes_per_s;
    let server_compute_s = mn * p1 / p2 * 4.0 / r.sum_bytes_per_s + apply_s(mn / p2);
    let msgs = l.ps_messages as f64;
    let grad_gemm_s = if r.ps_builds_grad {
        2.0 * l.k as f64 * mn / r.gemm_flop_per_s
    } else {
        0.0
    };
    let worker = SchemeSeconds {
        transfer_s: bytes(ps_params(NodeRole::WorkerOnly, l.m, l.n, l.p1, l.p2)),
        messages_s: 2.0 * msgs * r.msg_s,
        compute_s: grad_gemm_s,
    };
    let server = SchemeSeconds {
        transfer_s: bytes(ps_params(NodeRole::ServerOnly, l.m, l.n, l.p1, l.p2)),
        messages_s: 2.0 * msgs * p1 / p2 * r.msg_s,
        compute_s: server_compute_s,
    };
    let both = SchemeSeconds {
        transfer_s: bytes(ps_params(NodeRole::Both, l.m, l.n, l.p1, l.p2)),
        messages_s: 2.0 * msgs * (1.0 + (p1 - 1.0) / p2) * r.msg_s,
        compute_s: server_compute_s + grad_gemm_s,
    };
    let sfb_worker = SchemeSeconds {
        transfer_s: bytes(sfb_params(l.k, l.p1, l.m, l.n)),
        messages_s: 2.0 * peers * r.msg_s,
        compute_s: p1 * 2.0 * l.k as f64 * mn / r.gemm_flop_per_s + peers * mn * 4.0 / r.sum_bytes_per_s + apply_s(mn),
    };
    let idle = SchemeSeconds {
        transfer_s: 0.0,
        messages_s: 0.0,
        compute_s: 0.0,
    };
    let (ps, sfb) = if l.colocated {
        // Every node alike: the host's mean is any node's time.
        (both, sfb_worker)
    } else {
        let ps = if server.total() >= worker.total() {
            on_host(r, server, &[(l.p2.saturating_sub(1), server), (l.p1, worker)])
        } else {
            on_host(r, worker, &[(l.p1.saturating_sub(1), worker), (l.p2, server)])
        };
        (
            ps,
            on_host(r, sfb_worker, &[(l.p1.saturating_sub(1), sfb_worker), (l.p2, idle)]),
        )
    };
    // Valid rates give times HybComm can compare: finite, and none negative.
    debug_assert!(
        r.validate().is_err()
            || [ps, sfb].iter().all(|s| [s.transfer_s, s.messages_s, s.compute_s]
                .iter()
                .all(|x| x.is_finite() && *x >= 0.0)),
        "{ps:?} {sfb:?}"
    );
    (ps, sfb)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(link: f64, gemm: f64) -> Rates {
        Rates {
            link_bytes_per_s: link,
            msg_s: 10e-6,
            sum_bytes_per_s: 10e9,
            gemm_flop_per_s: gemm,
            host_ranks: 1,
            link_on_host: false,
            ps_builds_grad: false,
        }
    }

    fn fc6(p1: u64, p2: u64, k: u64) -> LayerLoad {
        LayerLoad {
            colocated: false,
            k,
            m: 4096,
            n: 25088,
            p1,
            p2,
            ps_messages: 2056,
        }
    }

    #[test]
    fn seconds_pick_sfb_on_a_slow_link_with_a_fast_gemm() {
        // 1 Gbit/s and a GPU's GEMM: the bytes decide, as in the paper.
        let (ps, sfb) = seconds(&fc6(8, 8, 32), &rates(125e6, 50e12));
        assert!(sfb.total() < ps.total() / 5.0, "{sfb:?} vs {ps:?}");
    }

    #[test]
    fn seconds_pick_ps_beside_a_slow_cpu_gemm_on_a_fast_link() {
        // Loopback-fast link, a shared CPU's GEMM: rebuilding 4 workers' fc6
        // at K = 128 is 4 · 26 GFLOP, which costs more than moving the matrix.
        let (ps, sfb) = seconds(&fc6(4, 1, 128), &rates(3e9, 20e9));
        assert!(ps.total() < sfb.total(), "{ps:?} vs {sfb:?}");
        // The compute part is what decides: 4 · 2·128·4096·25088 FLOPs, 3
        // sums, and the update of the layer.
        let (flops, mn) = (4.0 * 2.0 * 128.0 * 4096.0 * 25088.0, 4096.0 * 25088.0);
        let sums = (3.0 + APPLY_SUMS) * mn * 4.0 / 10e9;
        assert!((sfb.compute_s - flops / 20e9 - sums).abs() < 1e-9);
        // The server folds 4 gradients and updates the layer, once.
        assert!((ps.compute_s - (4.0 + APPLY_SUMS) * mn * 4.0 / 10e9).abs() < 1e-9);
    }

    #[test]
    fn seconds_agree_with_the_byte_model_when_compute_is_free() {
        // With free compute and messages, seconds order the schemes as Table
        // 1's bytes do: the whole count over loopback (both directions are
        // the host's copies), half of it over a link of the node's own (it
        // carries both directions at once).
        for (link_on_host, ways) in [(true, 1.0), (false, 2.0)] {
            let free = Rates {
                link_bytes_per_s: 1e9,
                msg_s: 0.0,
                sum_bytes_per_s: f64::MAX,
                gemm_flop_per_s: f64::MAX,
                host_ranks: 1,
                link_on_host,
                // Free GEMMs cost nothing either way.
                ps_builds_grad: !link_on_host,
            };
            for &(colocated, k, m, n, p1, p2) in &[
                (true, 32, 4096, 4096, 8, 8),
                (false, 256, 1000, 4096, 4, 1),
                (false, 2, 4096, 4096, 16, 2),
                (true, 512, 100, 100, 3, 3),
            ] {
                let l = LayerLoad {
                    colocated,
                    k,
                    m,
                    n,
                    p1,
                    p2,
                    ps_messages: 0,
                };
                let (ps_b, sfb_b) = bottleneck(colocated, k, m, n, p1, p2);
                let (ps_s, sfb_s) = seconds(&l, &free);
                assert!((ps_s.total() - ps_b as f64 * 4.0 / 1e9 / ways).abs() < 1e-6 * ps_s.total().max(1.0));
                assert!((sfb_s.total() - sfb_b as f64 * 4.0 / 1e9 / ways).abs() < 1e-6 * sfb_s.total().max(1.0));
            }
        }
    }

    #[test]
    fn slices_grow_where_messages_are_dear_beside_the_link() {
        // 1 Gbit/s, 17 µs a message: 2 KB of link time, P3's 50,000 stays.
        let slow = Rates {
            msg_s: 17e-6,
            ..rates(125e6, 1e10)
        };
        assert_eq!(slice_params_for(&slow), P3_SLICE_PARAMS);
        // Loopback shared by 4 ranks: 1.5 GB/s, 20 µs: 750 KB slices.
        let lo = Rates {
            msg_s: 20e-6,
            ..rates(1.5e9, 1e10)
        };
        // (20e-6 · 1.5e9 / 0.04 / 4 = 187,500, give or take the floating point.)
        assert!(
            (187_500..=187_501).contains(&slice_params_for(&lo)),
            "{}",
            slice_params_for(&lo)
        );
        // Never over a 2 MiB chunk, whatever the rates.
        let dear = Rates {
            msg_s: 1e-3,
            ..rates(1e11, 1e10)
        };
        assert_eq!(slice_params_for(&dear), 524_288);
        let free = Rates {
            msg_s: 0.0,
            ..rates(1e11, 1e10)
        };
        assert_eq!(slice_params_for(&free), P3_SLICE_PARAMS);
    }

    #[test]
    fn shared_rates_divide_the_cpu_and_the_link() {
        let r = rates(1e9, 1e10).shared(0.5, 0.25);
        assert_eq!(r.gemm_flop_per_s, 5e9);
        assert_eq!(r.sum_bytes_per_s, 5e9);
        assert_eq!(r.link_bytes_per_s, 2.5e8);
        assert_eq!(r.msg_s, 20e-6);
        assert!(r.validate().is_ok());
        assert!(Rates {
            gemm_flop_per_s: f64::NAN,
            ..r
        }
        .validate()
        .is_err());
        assert_eq!(
            Rates {
                link_bytes_per_s: 0.0,
                ..r
            }
            .validate(),
            Err(InvalidRate::NotPositive {
                rate: "link_bytes_per_s",
                value: 0.0
            })
        );
    }

    #[test]
    fn poseidon_worked_example() {
        let (ps, sfb) = bottleneck(true, 32, 4096, 4096, 8, 8);
        assert_eq!(ps, 58_720_256);
        assert_eq!(sfb, 3_670_016);
        assert!(sfb < ps);
    }

    #[test]
    fn adams_layer_server_carries_p1_full_matrices() {
        // 4096×4096, K = 32, P1 = 8: the layer's server moves 8× what a worker does.
        let w = adam_params(NodeRole::WorkerOnly, 32, 4096, 4096, 8);
        assert_eq!(w, 32 * 8192 + 4096 * 4096);
        assert_eq!(adam_params(NodeRole::ServerOnly, 32, 4096, 4096, 8), 8 * w);
        assert_eq!(adam_params(NodeRole::Both, 32, 4096, 4096, 8), 7 * w);
        // Against the sharded PS on the same colocated node: Adam's busiest node
        // carries more than the PS's (which spreads the layer over 8 servers).
        assert!(adam_params(NodeRole::Both, 32, 4096, 4096, 8) > ps_params(NodeRole::Both, 4096, 4096, 8, 8));
    }

    #[test]
    fn sfb_rebuilds_every_workers_gradient_own_included() {
        // tidewire.torch's fc benchmark: 4 colocated ranks on 2 cores,
        // K = 32, a 4096×4096 layer, at the rates rank 0 measured (its CPU
        // halved among 2 ranks per core). Measured: SFB 0.81x DDP, PS 0.97x.
        let l = LayerLoad {
            colocated: true,
            k: 32,
            m: 4096,
            n: 4096,
            p1: 4,
            p2: 4,
            ps_messages: 4,
        };
        let at = |link: f64| Rates {
            link_bytes_per_s: link,
            msg_s: 9.9e-6,
            sum_bytes_per_s: 6.5e9,
            gemm_flop_per_s: 49.4e9,
            host_ranks: 1,
            link_on_host: false,
            ps_builds_grad: false,
        };
        let (ps, sfb) = seconds(&l, &at(2.05e9));
        let own = 2.0 * 32.0 * 4096.0 * 4096.0 / 49.4e9;
        assert!(
            sfb.compute_s > 4.0 * own,
            "{sfb:?}: four rebuilds, the worker's own among them"
        );
        assert!(ps.total() < sfb.total(), "loopback: {ps:?} vs {sfb:?}");
        let (ps, sfb) = seconds(&l, &at(0.12e9));
        assert!(sfb.total() < ps.total() / 5.0, "1 Gbit/s: {ps:?} vs {sfb:?}");
    }

    #[test]
    fn a_shared_host_weighs_its_whole_work() {
        let part = |t: f64, c: f64| SchemeSeconds {
            transfer_s: t,
            messages_s: 0.0,
            compute_s: c,
        };
        let r = |host_ranks: u32, link_on_host: bool| Rates {
            host_ranks,
            link_on_host,
            ..rates(1e9, 1e10)
        };
        let (busy, rest) = (part(3.0, 1.0), [(3, part(1.0, 0.0))]);
        // A host of its own: the busiest node decides.
        assert_eq!(on_host(&r(1, true), busy, &rest), busy);
        assert_eq!(on_host(&r(0, true), busy, &rest), busy);
        // 4 ranks on one host (loopback): the mean of the four.
        let all = on_host(&r(4, true), busy, &rest);
        assert!(
            (all.transfer_s - 1.5).abs() < 1e-12 && (all.compute_s - 0.25).abs() < 1e-12,
            "{all:?}"
        );
        // More ranks than nodes: no more than the nodes there are.
        assert_eq!(on_host(&r(64, true), busy, &rest), all);
        // 2 a host: the busiest and one other, each at half the host.
        let two = on_host(&r(2, true), busy, &rest);
        assert!((two.transfer_s - 2.0).abs() < 1e-12, "{two:?}");
        // Links of their own: the transfer stays the busiest node's.
        let own = on_host(&r(4, false), busy, &rest);
        assert!(own.transfer_s == 3.0 && (own.compute_s - 0.25).abs() < 1e-12, "{own:?}");
    }

    #[test]
    fn on_one_host_sfb_pays_for_every_workers_rebuild() {
        // VGG19's fc6, 3 workers and 1 server on one 2-core host, each rank
        // at its share of what `tidewire calibrate` measured on the VM
        // (2026-11-28: GEMM 39 to 76 GFLOP/s, sum 11.8 GB/s out of cache and
        // 16.5 GB/s on both cores, loopback 1.9 to 4.0 GB/s, 6.5 µs a message).
        // Taken as the busiest rank alone, the server's PS looked 2.3 times
        // SFB's time and HybComm took SFB, which ran no faster in `train`.
        let l = LayerLoad {
            ps_messages: 2056,
            ..fc6(3, 1, 32)
        };
        let shared = Rates {
            link_bytes_per_s: 0.95e9,
            msg_s: 13e-6,
            sum_bytes_per_s: 16.5e9 / 4.0,
            gemm_flop_per_s: 19.6e9,
            host_ranks: 1,
            link_on_host: true,
            ps_builds_grad: false,
        };
        let (ps1, sfb1) = seconds(&l, &shared);
        let host = Rates {
            host_ranks: 4,
            ..shared
        };
        let (ps4, sfb4) = seconds(&l, &host);
        // The host's time is below its busiest rank's, the PS's most (its
        // workers idle while the server works); SFB keeps 3 of 4 ranks busy.
        assert!(ps4.total() < ps1.total() && sfb4.total() < sfb1.total());
        assert!(
            ps4.total() / ps1.total() < sfb4.total() / sfb1.total(),
            "{ps4:?} {sfb4:?}"
        );
        assert!((sfb4.compute_s - 0.75 * sfb1.compute_s).abs() < 1e-9 * sfb1.compute_s);
    }

    #[test]
    fn a_ps_gradient_the_driver_builds_is_charged_to_the_ps() {
        // VGG19's fc6, 3 workers and 1 server over loopback on the 2-core
        // VM, at the rates `train` measured there (2026-11-29): without the
        // PS's gradient GEMM the model called it a tie (the run's report: PS
        // 0.819 s, SFB 0.820 s) and took the PS, which ran at 1.80 s an
        // iteration against SFB's 1.23 s once the run's own decision tried it.
        let l = LayerLoad {
            ps_messages: 252,
            ..fc6(3, 1, 32)
        };
        let r = Rates {
            link_bytes_per_s: 2.20e9,
            msg_s: 29.8e-6,
            sum_bytes_per_s: 2.0e9,
            gemm_flop_per_s: 56.0e9,
            host_ranks: 4,
            link_on_host: true,
            ps_builds_grad: false,
        };
        let (ps, sfb) = seconds(&l, &r);
        assert!(
            (ps.total() / sfb.total() - 1.0).abs() < 0.02,
            "a tie: {ps:?} vs {sfb:?}"
        );
        let (ps_b, sfb_b) = seconds(
            &l,
            &Rates {
                ps_builds_grad: true,
                ..r
            },
        );
        // SFB is untouched; the PS gains each worker's 2KMN at the GEMM's
        // rate, weighed as the host's (3 of its 4 ranks are workers).
        assert_eq!(sfb, sfb_b);
        let gemm = 2.0 * 32.0 * 4096.0 * 25088.0 / 56.0e9;
        let gained = ps_b.compute_s - ps.compute_s;
        assert!((gained - 0.75 * gemm).abs() < 1e-9, "{gained} vs {gemm}");
        assert_eq!((ps.transfer_s, ps.messages_s), (ps_b.transfer_s, ps_b.messages_s));
        assert!(ps_b.total() > sfb_b.total() * 1.05, "{ps_b:?} vs {sfb_b:?}");
        // Colocated, every node is a worker and pays it whole.
        let c = LayerLoad {
            colocated: true,
            p2: 3,
            ..l
        };
        let own = |b: bool| seconds(&c, &Rates { ps_builds_grad: b, ..r }).0.compute_s;
        assert!((own(true) - own(false) - gemm).abs() < 1e-9);
    }

    #[test]
    fn single_worker_moves_nothing_by_sfb() {
        assert_eq!(sfb_params(32, 1, 100, 100), 0);
    }

    #[test]
    fn separate_roles_take_the_busier_node() {
        // 2 workers, 1 server: the server moves 2MN·2 and is the bottleneck.
        let (ps, _) = bottleneck(false, 1, 10, 10, 2, 1);
        assert_eq!(ps, 400);
    }
}
