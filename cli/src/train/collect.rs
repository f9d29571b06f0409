//! The report of an attempt that ended well: the workers' results checked
//! (every worker and local learner reported), the slowest worker's
//! iterations, `--verify`'s comparison with the single-process reference,
//! and the counters summed over the ranks.

use std::time::Instant;

use tidewire_engine::models::Model;
use tidewire_engine::{Book, SchemePolicy};

use super::args::TrainArgs;
use super::comm;
use super::reference::reference;
use super::report::{AggregationShare, IterStat, LayerRow, MeasuredRates, NodeResult, SparseSummary, TrainReport};
use super::supervise::Ended;
use crate::error::{Error, Result};
use crate::resilience;

/// The report of the attempt `ended`, begun at `began`.
pub(super) fn report(args: &TrainArgs, model: &Model, began: Instant, ended: &Ended) -> Result<TrainReport> {
    let (_, p2, _) = args.world();
    let results = &ended.results;
    let (workers, learners) = reporters(args, ended)?;
    let p1 = workers.len();
    let book = args.book(model, args.cluster()?)?;
    // Decided in the run: the switches worker 0 ended with (every rank took
    // the same decisions), which the reference replays.
    let first = workers.iter().min_by_key(|r| r.rank);
    let book = match first {
        Some(w) if book.plan().every() > 0 => book.replayed(&w.switches)?,
        _ => book,
    };
    let (per, iteration_s, hidden_fraction) = iteration_figures(&workers);
    let (verified, mismatched_layers) = verify(args, model, &book, p1, workers.iter().chain(&learners).copied())?;
    let k = args.batch(model);
    let checkpoint = checkpoint_summary(args, results, iteration_s, per.len());
    let mut by_rank: Vec<&NodeResult> = workers.clone();
    by_rank.sort_by_key(|r| r.rank);
    Ok(TrainReport {
        removed: ended.removed.clone(),
        trigger: args.job.trigger.name(),
        worker_iteration_s: by_rank.iter().map(|r| mean_iteration_s(r)).collect(),
        dropped: results.iter().map(|r| r.stats.dropped).sum(),
        late_folded: results.iter().map(|r| r.stats.late_folded).sum(),
        partial_applies: results.iter().map(|r| r.stats.partial_applies).sum(),
        checkpoint,
        restarts: Vec::new(),
        resumed_from: None,
        log_warnings: ended.stderr_tails.iter().flat_map(|(_, _, w)| w.clone()).collect(),
        slice_params: book.config().slice_params,
        aggregation: aggregation_share(results),
        max_outstanding: results.iter().map(|r| r.stats.max_outstanding).max().unwrap_or(0),
        max_message_bytes: results.iter().map(|r| r.stats.max_message_bytes).max().unwrap_or(0),
        would_block: results.iter().map(|r| r.stats.would_block).sum(),
        slices_pushed: results.iter().map(|r| r.stats.pushes).sum(),
        broadcasts: results.iter().map(|r| r.stats.broadcasts).sum(),
        factor_sends: results.iter().map(|r| r.stats.factor_sends).sum(),
        switches: book.plan().switches().collect(),
        decisions: first.map(|w| w.decisions.clone()).unwrap_or_default(),
        adapt_every: args.adapt_every(),
        adapt_off: match args.adapt_off() {
            Some(why) if args.adapt_every.is_none() && args.sync_mode().policy() == SchemePolicy::Hybrid => {
                Some(why.to_string())
            }
            _ => None,
        },
        tx_sends: results.iter().map(|r| r.stats.tx_sends).sum(),
        factor_bytes_in_place: results.iter().map(|r| r.stats.factor_bytes_in_place).sum(),
        factor_bytes_decoded: results.iter().map(|r| r.stats.factor_bytes_decoded).sum(),
        sparse: sparse_summary(results),
        measured: measured_rates(results),
        model: model.name.into(),
        local_learners: args.job.local_learners,
        flat: args.job.flat,
        node_tx_bytes: per_node(results, args, |r| r.stats.tx_payload_bytes - r.setup_tx_bytes),
        node_rx_bytes: per_node(results, args, |r| {
            r.stats.rx_direct_bytes + r.stats.rx_copied_bytes - r.setup_rx_bytes
        }),
        sync: args.job.sync.name().to_string(),
        consistency: args.job.consistency.name(),
        workers: p1,
        servers: p2,
        colocate: args.colocate,
        batch: k,
        iters: args.job.iters,
        time_scale: args.job.time_scale,
        compute_s: model.iteration_compute(k, args.job.time_scale).as_secs_f64(),
        iteration_s,
        throughput_samples_s: (p1 * args.learners() * k) as f64 / iteration_s,
        hidden_fraction,
        per_iteration: per,
        workers_detail: by_rank.iter().map(|r| r.iters.clone()).collect(),
        layers: layer_rows(&book),
        rates: book.rates().copied(),
        verified,
        mismatched_layers,
        digests: workers
            .iter()
            .find(|w| w.rank == 0)
            .map(|w| w.digests.clone())
            .unwrap_or_default(),
        comm: workers.iter().min_by_key(|r| r.rank).and_then(|r| r.comm.clone()),
        wall_s: began.elapsed().as_secs_f64(),
        transport: transport_lines(results),
    })
}

/// The workers' results and the local learners', checked: every worker
/// reported (P1 less the removed, plus their replacements), and every learner.
fn reporters<'e>(args: &TrainArgs, ended: &'e Ended) -> Result<(Vec<&'e NodeResult>, Vec<&'e NodeResult>)> {
    let results = &ended.results;
    // A removed worker's result is apart; its replacement, if any, reports as its rank.
    let workers: Vec<&NodeResult> = results
        .iter()
        .filter(|r| r.worker && r.local.is_none() && r.removed_at.is_none())
        .collect();
    let p1 = args.world().0 - ended.removed.len() + ended.replaced.len();
    if workers.len() != p1 {
        return Err(Error::Launch(format!(
            "{} of {p1} workers reported a result",
            workers.len()
        )));
    }
    let learners: Vec<&NodeResult> = results.iter().filter(|r| r.local.is_some()).collect();
    let want_learners = if args.job.flat {
        0
    } else {
        p1 * (args.job.local_learners - 1)
    };
    if learners.len() != want_learners {
        return Err(Error::Launch(format!(
            "{} of {want_learners} local learners reported a result",
            learners.len()
        )));
    }
    Ok((workers, learners))
}

/// The slowest worker's iterations, their mean and the share of the sync
/// hidden behind compute.
fn iteration_figures(workers: &[&NodeResult]) -> (Vec<IterStat>, f64, f64) {
    let slowest = workers
        .iter()
        .max_by(|a, b| {
            let s = |r: &NodeResult| r.iters.iter().map(|i| i.seconds).sum::<f64>();
            s(a).total_cmp(&s(b))
        })
        .expect("p1 >= 1");
    let per: Vec<IterStat> = slowest.iters.clone();
    let steady: Vec<&IterStat> = if per.len() > 1 {
        per[1..].iter().collect()
    } else {
        per.iter().collect()
    };
    // From the start of iteration 0 to the end of the last sync, per
    // iteration: the same measure as `tidewire sim`. (The iterations after the
    // first would count one sync more than their computes: iteration 0's sync
    // is charged to iteration 1, and the last one ends with its own.)
    let iteration_s = per.iter().map(|i| i.seconds).sum::<f64>() / per.len() as f64;
    let hidden = hidden_fraction(&steady);
    (per, iteration_s, hidden)
}

/// A worker's mean iteration, s.
fn mean_iteration_s(r: &NodeResult) -> f64 {
    r.iters.iter().map(|i| i.seconds).sum::<f64>() / r.iters.len().max(1) as f64
}

/// What the checkpoints cost, over the ranks (--checkpoint-dir).
fn checkpoint_summary(
    args: &TrainArgs,
    results: &[NodeResult],
    iteration_s: f64,
    iterations: usize,
) -> Option<resilience::CheckpointSummary> {
    args.ckpt.active().then(|| {
        let ranks: Vec<(u32, &tidewire::checkpoint::CheckpointStats)> = results
            .iter()
            .filter_map(|r| Some((r.rank, r.checkpoint.as_ref()?)))
            .collect();
        resilience::CheckpointSummary::of(&ranks, &args.ckpt, iteration_s, iterations)
    })
}

/// Where the servers' sums ran, over all ranks.
fn aggregation_share(results: &[NodeResult]) -> AggregationShare {
    AggregationShare {
        cpu_bytes: results.iter().map(|r| r.stats.cpu_aggregated_bytes).sum(),
        gpu_bytes: results.iter().map(|r| r.stats.gpu_aggregated_bytes).sum(),
        cpu_chunks: results.iter().map(|r| r.stats.cpu_aggregation_chunks).sum(),
        gpu_chunks: results.iter().map(|r| r.stats.gpu_aggregation_chunks).sum(),
    }
}

/// The sparse pushes' counters, over all ranks.
fn sparse_summary(results: &[NodeResult]) -> SparseSummary {
    SparseSummary {
        pushes: results.iter().map(|r| r.stats.sparse_pushes).sum(),
        dense_pushes: results.iter().map(|r| r.stats.sparse_dense_pushes).sum(),
        nonzeros: results.iter().map(|r| r.stats.sparse_nonzeros).sum(),
        elements: results.iter().map(|r| r.stats.sparse_elements).sum(),
        bytes: results.iter().map(|r| r.stats.sparse_bytes).sum(),
        dense_bytes: results.iter().map(|r| r.stats.sparse_dense_bytes).sum(),
    }
}

/// Every layer's row of the scheme table.
fn layer_rows(book: &Book) -> Vec<LayerRow> {
    book.layers()
        .iter()
        .enumerate()
        .map(|(i, l)| LayerRow {
            name: l.name.clone(),
            kind: l.kind,
            shape: (l.m, l.n),
            scheme: book.scheme(i as u32, 0),
            cost_s: book.seconds(i as u32).map(|(ps, sfb)| (ps.total(), sfb.total())),
        })
        .collect()
}

/// The share of each steady iteration's sync hidden behind compute, averaged.
fn hidden_fraction(steady: &[&IterStat]) -> f64 {
    let spans: Vec<f64> = steady
        .iter()
        .filter(|i| i.sync_span_s > 0.0)
        .map(|i| (1.0 - i.exposed_s / i.sync_span_s).clamp(0.0, 1.0))
        .collect();
    if spans.is_empty() {
        0.0
    } else {
        spans.iter().sum::<f64>() / spans.len() as f64
    }
}

/// `--verify`: every rank's final layers against the single-process
/// reference, bit for bit. `(None, [])` without it; else whether all match
/// and the layers (or ranks) that did not.
fn verify<'r>(
    args: &TrainArgs,
    model: &Model,
    book: &Book,
    p1: usize,
    ranks: impl Iterator<Item = &'r NodeResult>,
) -> Result<(Option<bool>, Vec<String>)> {
    if !args.verify {
        return Ok((None, vec![]));
    }
    {
        let want = if args.comm.active() {
            comm::reference(args, model, p1)?
        } else {
            reference(args, book)?
        };
        let mut bad: Vec<String> = Vec::new();
        for w in ranks {
            for (l, d) in w.digests.iter().enumerate() {
                if want.get(l) != Some(d) && !bad.contains(&model.layers[l].name) {
                    bad.push(model.layers[l].name.clone());
                }
            }
            if w.digests.len() != want.len() {
                bad.push(format!("rank {} reported {} layers", w.rank, w.digests.len()));
            }
        }
        Ok((Some(bad.is_empty()), bad))
    }
}

/// One line per distinct transport; the ranks are named when they differ.
fn transport_lines(results: &[NodeResult]) -> Vec<String> {
    {
        // One line per distinct transport; the ranks are named when they differ.
        let mut by: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
        for r in results.iter().filter(|r| r.local.is_none()) {
            by.entry(r.transport.as_str()).or_default().push(r.rank);
        }
        let one = by.len() == 1;
        by.into_iter()
            .map(|(t, mut ranks)| {
                if one {
                    return t.to_string();
                }
                ranks.sort_unstable();
                let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
                let (kind, why) = t.split_once(": ").unwrap_or((t, ""));
                format!("{kind} on ranks {}: {why}", list.join(", "))
            })
            .collect()
    }
}

/// Sums a counter over each worker node's ranks (worker ranks `0..P1`; with
/// --flat, node `i` is ranks `i·L..(i+1)·L`).
fn per_node(results: &[NodeResult], args: &TrainArgs, f: impl Fn(&NodeResult) -> u64) -> Vec<u64> {
    let per = if args.job.flat { args.job.local_learners } else { 1 };
    let mut out = vec![0u64; args.workers];
    for r in results.iter().filter(|r| r.local.is_none() && r.worker) {
        if let Some(n) = out.get_mut(r.rank as usize / per) {
            *n += f(r);
        }
    }
    out
}

/// The rates every rank's executors reached, over all ranks' jobs.
fn measured_rates(results: &[NodeResult]) -> MeasuredRates {
    let total =
        |f: fn(&NodeResult) -> (u64, u64)| results.iter().map(f).fold((0, 0), |(w, t), (dw, dt)| (w + dw, t + dt));
    MeasuredRates::from_totals(
        total(|r| (r.stats.gemm_flops, r.stats.gemm_ns)),
        total(|r| (r.stats.sum_bytes, r.stats.sum_ns)),
        total(|r| (r.stats.apply_params, r.stats.apply_ns)),
    )
}
