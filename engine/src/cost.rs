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
    2 * k * p1.saturating_sub(1) * (m + n)
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

#[cfg(test)]
mod tests {
    use super::*;

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
