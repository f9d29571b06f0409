//! Worker index 0's scheme decisions in the run (adaptive schemes, see
//! [`crate::plan`]): HybComm's choice tried against the measured iteration
//! time instead of trusted. Sans-IO: the driver gives the time and the
//! rates its jobs reached; the runtime and the simulator drive the same
//! policy.
//!
//! The Node asks for a decision one iteration before each point (every
//! `every` iterations: [`crate::node::Output::DecisionDue`]). The
//! time between two such requests is `every` iterations of worker 0's
//! training (shifted by one iteration, so one of them ran under the previous
//! decision). The policy, with two candidates, the start-up choice and an
//! alternative:
//! 1. the iterations before the first point are warm-up, not measured;
//! 2. the start-up choice is measured for a window, then the alternative;
//! 3. the faster one is kept, the alternative only when it is at least
//!    [`MARGIN`] faster (hysteresis);
//! 4. settled, the kept one's time is watched: once it is [`DRIFT`] slower
//!    than when it was chosen (the rates moved), both are measured again.
//!
//! The alternative is chosen when the start-up choice has been measured:
//! the cost model again at the rates worker 0's jobs reached in the run
//! (its GEMM, and its sum where it is a server too: on a shared host these
//! are what the other ranks leave it), where that decides otherwise; else
//! the start-up choice with the layers the model is least sure of flipped
//! (its two times, or in bytes its two traffics, within a factor
//! [`UNSURE`]). Where that flips none, nothing is ever tried: a trial of a
//! scheme the model says is several times slower costs its whole window.

use std::time::Duration;

use crate::book::Book;
use crate::cost::Rates;
use crate::plan::Plan;

/// What worker 0's jobs reached so far in the run, where they did any.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reached {
    /// Rebuilding gradients from factors, FLOP/s.
    pub gemm_flop_per_s: Option<f64>,
    /// Folding contributions into a server's sum, bytes/s.
    pub sum_bytes_per_s: Option<f64>,
}

/// The alternative is kept only when at least this much faster.
pub const MARGIN: f64 = 0.03;
/// A settled choice this much slower than when chosen is measured again.
pub const DRIFT: f64 = 0.25;
/// Layers whose PS and SFB times (the cost model's) lie within this factor are flipped.
pub const UNSURE: f64 = 2.0;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    Warmup,
    /// Measuring candidate `0` (start-up) or `1` (the alternative).
    Measure(usize),
    /// Kept candidate, and its time per iteration when chosen.
    Settled(usize, f64),
}

/// One decision, for the report.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Decision {
    /// The iteration it takes effect at.
    pub at: u64,
    /// Bit i: the i-th contested layer by SFB.
    pub sfb: u64,
    /// Worker 0's seconds per iteration over the window that ended there.
    pub window_s: f64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Adapt {
    book: std::sync::Arc<Book>,
    cands: [u64; 2],
    phase: Phase,
    times: [f64; 2],
    last: Option<Duration>,
    every: u64,
    log: Vec<Decision>,
}

impl Adapt {
    /// The policy for `book`'s adaptive plan (`None` when it has none).
    pub fn new(book: &std::sync::Arc<Book>) -> Option<Adapt> {
        let plan = book.plan();
        if plan.every() == 0 {
            return None;
        }
        let start = plan.current_bits(0);
        debug_assert!(
            plan.contested().len() <= 64,
            "a decision's bits cover every contested layer"
        );
        Some(Adapt {
            book: book.clone(),
            cands: [start, Self::flipped(book, start)],
            phase: Phase::Warmup,
            times: [0.0; 2],
            last: None,
            every: plan.every(),
            log: Vec::new(),
        })
    }

    /// `start` with the contested layers the book's model is least sure of flipped.
    fn flipped(book: &Book, start: u64) -> u64 {
        let flip = book
            .plan()
            .contested()
            .iter()
            .enumerate()
            .filter(|&(_, &l)| {
                let (a, b) = match book.seconds(l) {
                    Some((ps, sfb)) => (ps.total(), sfb.total()),
                    None => {
                        // In bytes: what the busiest node moves either way.
                        let (ps, sfb) = book.costs(l);
                        (ps as f64, sfb as f64)
                    }
                };
                a.max(b) < UNSURE * a.min(b)
            })
            .fold(0u64, |m, (i, _)| m | 1 << i);
        debug_assert!(book.plan().contested().len() >= 64 || flip >> book.plan().contested().len() == 0);
        start ^ flip
    }

    /// The model's choice at the book's rates with what the run reached in
    /// their place (`None` without rates, or where nothing was reached).
    fn at_reached(book: &Book, reached: Reached) -> Option<u64> {
        let r0 = book.rates()?;
        if reached.gemm_flop_per_s.is_none() && reached.sum_bytes_per_s.is_none() {
            return None;
        }
        let r = Rates {
            gemm_flop_per_s: reached.gemm_flop_per_s.unwrap_or(r0.gemm_flop_per_s),
            sum_bytes_per_s: reached.sum_bytes_per_s.unwrap_or(r0.sum_bytes_per_s),
            ..*r0
        };
        r.validate().ok()?;
        let bits = book
            .plan()
            .contested()
            .iter()
            .enumerate()
            .fold(0u64, |b, (i, &l)| match book.seconds_at(l, &r) {
                Some((ps, sfb)) if sfb.total() < ps.total() => b | 1 << i,
                _ => b,
            });
        debug_assert!(book.plan().contested().len() >= 64 || bits >> book.plan().contested().len() == 0);
        Some(bits)
    }

    /// Every decision so far.
    pub fn log(&self) -> &[Decision] {
        // One decision a point, in order.
        debug_assert!(self.log.windows(2).all(|w| w[0].at + self.every == w[1].at));
        &self.log
    }

    /// The decision for the point `at`, asked at `now` (any clock that goes
    /// forward), with what worker 0's jobs reached so far.
    pub fn decide(&mut self, plan: &Plan, at: u64, now: Duration, reached: Reached) -> u64 {
        let window = self
            .last
            .map(|t| now.saturating_sub(t).as_secs_f64() / self.every as f64);
        self.last = Some(now);
        let alt = self.cands[1] != self.cands[0];
        let (next, keep) = match (self.phase, window) {
            (Phase::Warmup, _) | (_, None) => (Phase::Measure(0), 0),
            (Phase::Measure(0), Some(w)) => {
                self.times[0] = w;
                if let Some(b) = Self::at_reached(&self.book, reached).filter(|&b| b != self.cands[0]) {
                    // The model at the rates of the run decides otherwise: try that.
                    self.cands[1] = b;
                }
                let alt = self.cands[1] != self.cands[0];
                if alt {
                    (Phase::Measure(1), 1)
                } else {
                    (Phase::Settled(0, w), 0)
                }
            }
            (Phase::Measure(_), Some(w)) => {
                self.times[1] = w;
                let best = usize::from(self.times[1] < self.times[0] * (1.0 - MARGIN));
                (Phase::Settled(best, self.times[best]), best)
            }
            (Phase::Settled(best, t), Some(w)) if alt && w > t * (1.0 + DRIFT) => {
                // The rates moved: measure both again, the kept one first.
                let _ = best;
                (Phase::Measure(0), 0)
            }
            (Phase::Settled(best, t), Some(_)) => (Phase::Settled(best, t), best),
        };
        self.phase = next;
        let sfb = self.cands[keep];
        debug_assert!(plan.contested().len() >= 64 || sfb >> plan.contested().len() == 0);
        self.log.push(Decision {
            at,
            sfb,
            window_s: window.unwrap_or(0.0),
        });
        sfb
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::book::{BookConfig, Cluster, LayerKind, LayerSpec};

    fn book() -> Book {
        Book::new(
            Cluster::split(2, 1).unwrap(),
            vec![
                LayerSpec::new("conv", LayerKind::Conv, 8, 8),
                LayerSpec::new("fc", LayerKind::Fc, 64, 64),
            ],
            // PS and SFB move about the same at the busiest node (the server:
            // 2·P1·M·N against each worker's 2·K·(M+N)·(P1 − 1)).
            BookConfig {
                batch: 64,
                ..BookConfig::default()
            },
        )
        .unwrap()
        .with_adaptive(2)
        .unwrap()
    }

    /// Window times of 1 s per iteration for the start-up choice: the
    /// alternative is kept when it runs at `alt_s`, only past the margin.
    fn run(alt_s: f64) -> Vec<u64> {
        let b = book();
        let mut plan = b.plan().clone();
        let b = std::sync::Arc::new(b);
        let mut a = Adapt::new(&b).unwrap();
        let mut t = Duration::ZERO;
        let mut out = Vec::new();
        for k in 1..=5u64 {
            let at = 2 * k;
            let sfb = a.decide(&plan, at, t, Reached::default());
            plan.decide(at, sfb).unwrap();
            out.push(sfb);
            // The window that now runs: the start-up choice (bits 0 in bytes for this
            // small layer, or whatever it was) takes 1 s per iteration, the alternative alt_s.
            let per = if sfb == a.cands[0] { 1.0 } else { alt_s };
            t += Duration::from_secs_f64(per * 2.0);
        }
        out
    }

    #[test]
    fn the_alternative_is_tried_once_and_kept_only_when_faster() {
        let b = std::sync::Arc::new(book());
        let a = Adapt::new(&b).unwrap();
        let (start, alt) = (a.cands[0], a.cands[1]);
        assert_ne!(start, alt, "the bytes model is unsure of the FC layer");
        // The first window (before any decision) is warm-up; then the
        // start-up choice is measured, then the alternative, then settled.
        assert_eq!(run(0.5), [start, alt, alt, alt, alt]);
        assert_eq!(
            run(0.99),
            [start, alt, start, start, start],
            "within the margin: kept as it was"
        );
        assert_eq!(run(2.0), [start, alt, start, start, start]);
    }
}
