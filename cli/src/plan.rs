//! `tidewire plan`: Poseidon's per-layer cost model for a model profile and a
//! cluster, with the scheme BestScheme picks.

use serde::Serialize;
use tidewire_engine::book::{LayerKind, LayerSpec, Scheme};
use tidewire_engine::cost::{ps_params, sfb_params, NodeRole};
use tidewire_engine::{models, Book, BookConfig, Cluster, SchemePolicy};

use crate::error::{Error, Result};

/// One layer of the plan. Parameter counts are per node per iteration; bytes are ×4 (f32).
#[derive(Debug, Clone, Serialize)]
pub struct PlanRow {
    /// Forward index.
    pub index: usize,
    /// Layer name.
    pub name: String,
    /// Kind.
    pub kind: LayerKind,
    /// Rows (M).
    pub m: usize,
    /// Columns (N).
    pub n: usize,
    /// Parameters M×N.
    pub params: usize,
    /// PS on a node that is worker and server: 2MN(P1+P2−2)/P2.
    pub ps_params_both: u64,
    /// PS on a worker-only node: 2MN.
    pub ps_params_worker: u64,
    /// PS on a server-only node: 2MN·P1/P2.
    pub ps_params_server: u64,
    /// SFB: 2K(P1−1)(M+N); none for conv and other layers.
    pub sfb_params: Option<u64>,
    /// PS bytes on the busiest node of this layout.
    pub ps_bytes: u64,
    /// SFB bytes per worker.
    pub sfb_bytes: Option<u64>,
    /// The chosen scheme.
    pub scheme: Scheme,
}

/// The whole plan.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Model name.
    pub model: String,
    /// P1.
    pub workers: usize,
    /// P2.
    pub servers: usize,
    /// Batch K.
    pub batch: usize,
    /// Whether every node is worker and server (then PS uses the worker+server row).
    pub colocated: bool,
    /// Per layer.
    pub layers: Vec<PlanRow>,
    /// Bytes per iteration on the busiest node with every layer through the PS.
    pub total_ps_bytes: u64,
    /// Bytes per iteration on the busiest node with the chosen schemes.
    pub total_chosen_bytes: u64,
}

/// Builds the plan. With `colocated` unset, P1 = P2 is taken as colocated
/// (Poseidon's setting: every node is worker and server).
pub fn plan(model: &str, workers: usize, servers: usize, batch: usize, colocated: Option<bool>) -> Result<Plan> {
    let m = models::profile(model)
        .ok_or_else(|| Error::Usage(format!("unknown model {model:?}; known: {}", models::NAMES.join(", "))))?;
    if workers == 0 || servers == 0 || batch == 0 {
        return Err(Error::Usage("workers, servers and batch must be at least 1".into()));
    }
    let colocated = colocated.unwrap_or(workers == servers);
    let cluster = if colocated {
        if workers != servers {
            return Err(Error::Usage(format!(
                "a colocated plan needs as many servers as workers (got {workers} and {servers})"
            )));
        }
        Cluster::colocated(workers)?
    } else {
        Cluster::split(workers, servers)?
    };
    let book = Book::new(
        cluster,
        m.layers.clone(),
        BookConfig {
            batch,
            policy: SchemePolicy::Hybrid,
            ..Default::default()
        },
    )?;
    let (p1, p2, k) = (workers as u64, servers as u64, batch as u64);
    let mut rows = Vec::new();
    let (mut total_ps, mut total_chosen) = (0u64, 0u64);
    for (i, l) in m.layers.iter().enumerate() {
        let row = plan_row(&book, i, l, p1, p2, k);
        total_ps += row.ps_bytes;
        total_chosen += chosen_bytes(&row, colocated, k, p1);
        rows.push(row);
    }
    Ok(Plan {
        model: m.name.into(),
        workers,
        servers,
        batch,
        colocated,
        layers: rows,
        total_ps_bytes: total_ps,
        total_chosen_bytes: total_chosen,
    })
}

/// Layer `i`'s costs under each scheme, and the scheme the book chose.
fn plan_row(book: &Book, i: usize, l: &LayerSpec, p1: u64, p2: u64, k: u64) -> PlanRow {
    let (mm, nn) = (l.m as u64, l.n as u64);
    let (ps, sfb) = book.costs(i as u32);
    let sfb = (l.kind == LayerKind::Fc).then_some(sfb);
    PlanRow {
        index: i,
        name: l.name.clone(),
        kind: l.kind,
        m: l.m,
        n: l.n,
        params: l.params(),
        ps_params_both: ps_params(NodeRole::Both, mm, nn, p1, p2),
        ps_params_worker: ps_params(NodeRole::WorkerOnly, mm, nn, p1, p2),
        ps_params_server: ps_params(NodeRole::ServerOnly, mm, nn, p1, p2),
        sfb_params: sfb.map(|_| sfb_params(k, p1, mm, nn)),
        ps_bytes: ps * 4,
        sfb_bytes: sfb.map(|s| s * 4),
        scheme: book.scheme(i as u32, 0),
    }
}

/// The bytes on the busiest node of a layer under its chosen scheme.
fn chosen_bytes(row: &PlanRow, colocated: bool, k: u64, p1: u64) -> u64 {
    match row.scheme {
        Scheme::Ps => row.ps_bytes,
        Scheme::Sfb => row.sfb_bytes.unwrap_or(0),
        // Not chosen by HybComm (the plan's policy); the layer's server is the busiest node.
        Scheme::Adam => {
            tidewire_engine::cost::adam_params(
                if colocated {
                    NodeRole::Both
                } else {
                    NodeRole::ServerOnly
                },
                k,
                row.m as u64,
                row.n as u64,
                p1,
            ) * 4
        }
    }
}

/// The plan as a table.
pub fn render(p: &Plan) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: P1={} workers, P2={} servers{}, K={}; parameters moved per node per iteration",
        p.model,
        p.workers,
        p.servers,
        if p.colocated { " (colocated)" } else { "" },
        p.batch
    );
    let _ = writeln!(
        s,
        "{:>3}  {:<28} {:<5} {:>14} {:>14} {:>14}  scheme",
        "#", "layer", "kind", "shape M×N", "PS", "SFB"
    );
    for r in &p.layers {
        let ps = if p.colocated { r.ps_params_both } else { r.ps_bytes / 4 };
        let _ = writeln!(
            s,
            "{:>3}  {:<28} {:<5} {:>14} {:>14} {:>14}  {}",
            r.index,
            r.name,
            format!("{:?}", r.kind).to_lowercase(),
            format!("{}×{}", r.m, r.n),
            ps,
            r.sfb_params.map_or("-".into(), |v| v.to_string()),
            match r.scheme {
                Scheme::Ps => "PS",
                Scheme::Sfb => "SFB",
                Scheme::Adam => "Adam",
            }
        );
    }
    let _ = writeln!(
        s,
        "busiest node per iteration: {:.1} MB all-PS, {:.1} MB with the chosen schemes",
        p.total_ps_bytes as f64 / 1e6,
        p.total_chosen_bytes as f64 / 1e6
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vgg19_fc7_is_poseidons_worked_example() {
        let p = plan("vgg19", 8, 8, 32, None).unwrap();
        let fc7 = p.layers.iter().find(|r| r.name == "fc7").unwrap();
        assert_eq!((fc7.m, fc7.n), (4096, 4096));
        assert_eq!(fc7.ps_params_both, 58_720_256);
        assert_eq!(fc7.sfb_params, Some(3_670_016));
        assert_eq!(fc7.scheme, Scheme::Sfb);
        assert!(p
            .layers
            .iter()
            .filter(|r| r.kind != LayerKind::Fc)
            .all(|r| r.scheme == Scheme::Ps));
    }

    #[test]
    fn bad_plans_are_errors() {
        assert!(plan("nope", 1, 1, 1, None).is_err());
        assert!(plan("vgg19", 0, 1, 1, None).is_err());
        assert!(plan("vgg19", 2, 3, 1, Some(true)).is_err());
    }
}
