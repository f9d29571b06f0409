//! Worker index 0's scheme decisions in the run (adaptive schemes, see
//! [`crate::plan`]): HybComm's choice tried against the measured iteration
//! time instead of trusted. Sans-IO: the driver gives the time and the
//! rates its jobs reached; the runtime and the simulator drive the same
//! policy.
//!
//! The Node asks for a decision one iteration before each point (every
//! `every` iterations: [`crate::node::Output::DecisionDue`]), at worker 0's
//! first hand-in of that iteration; the driver also says when worker 0
//! first hands in each iteration ([`Adapt::started`]). A window is timed
//! from the first hand-in of its point to the request for the next point:
//! `every - 1` iterations, every one of them under the window's decision
//! (so the period is at least 2). The policy, with two candidates, the
//! start-up choice and an alternative:
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
//! [`UNSURE`]), at the reached rates where the run reached any. Where that
//! flips none, nothing is ever tried: a trial of a scheme the model says is
//! several times slower costs its whole window, and the switches there and
//! back (the layer's parameters and momentum to every worker).

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
    /// The last decision point reached, and when worker 0 first handed in its iteration.
    last: Option<(u64, Duration)>,
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
            cands: [start, Self::flipped(book, start, None)],
            phase: Phase::Warmup,
            times: [0.0; 2],
            last: None,
            every: plan.every(),
            log: Vec::new(),
        })
    }

    /// `start` with the contested layers the book's model is least sure of
    /// flipped, at `rates` where given (else the book's own).
    fn flipped(book: &Book, start: u64, rates: Option<&Rates>) -> u64 {
        let flip = book
            .plan()
            .contested()
            .iter()
            .enumerate()
            .filter(|&(_, &l)| {
                let times = match rates {
                    Some(r) => book.seconds_at(l, r),
                    None => book.seconds(l),
                };
                let (a, b) = match times {
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

    /// The book's rates with what the run reached in their place (`None`
    /// without rates, or where nothing was reached).
    fn reached_rates(book: &Book, reached: Reached) -> Option<Rates> {
        let r0 = book.rates()?;
        if reached.gemm_flop_per_s.is_none() && reached.sum_bytes_per_s.is_none() {
            return None;
        }
        let r = Rates {
            gemm_flop_per_s: reached.gemm_flop_per_s.unwrap_or(r0.gemm_flop_per_s),
            sum_bytes_per_s: reached.sum_bytes_per_s.unwrap_or(r0.sum_bytes_per_s),
            ..*r0
        };
        // The link and the message cost stay the measured ones.
        debug_assert!(r.link_bytes_per_s == r0.link_bytes_per_s && r.msg_s == r0.msg_s);
        r.validate().ok().map(|()| r)
    }

    /// The model's choice at rates `r` (the run's reached ones).
    fn at_rates(book: &Book, r: &Rates) -> u64 {
        let bits = book
            .plan()
            .contested()
            .iter()
            .enumerate()
            .fold(0u64, |b, (i, &l)| match book.seconds_at(l, r) {
                Some((ps, sfb)) if sfb.total() < ps.total() => b | 1 << i,
                _ => b,
            });
        debug_assert!(book.plan().contested().len() >= 64 || bits >> book.plan().contested().len() == 0);
        bits
    }

    /// Every decision so far.
    pub fn log(&self) -> &[Decision] {
        // One decision a point, in order.
        debug_assert!(self.log.windows(2).all(|w| w[0].at + self.every == w[1].at));
        &self.log
    }

    /// Worker 0 hands in a layer of iteration `iter` at `now` (any clock
    /// that goes forward): the first hand-in of a decision point starts the
    /// window its decision is timed over.
    pub fn started(&mut self, iter: u64, now: Duration) {
        if iter > 0 && iter % self.every == 0 && self.last.map_or(true, |(p, _)| p < iter) {
            self.last = Some((iter, now));
        }
        debug_assert!(self.last.map_or(true, |(p, _)| p % self.every == 0));
    }

    /// The decision for the point `at`, asked at `now`: at worker 0's first
    /// hand-in of iteration `at - 1`, so the window since the last point's
    /// first hand-in holds `every - 1` iterations, all under its decision.
    pub fn decide(&mut self, plan: &Plan, at: u64, now: Duration, reached: Reached) -> u64 {
        let window = match self.last {
            Some((p, t)) if p + self.every == at => Some(now.saturating_sub(t).as_secs_f64() / (self.every - 1) as f64),
            _ => None,
        };
        let (next, keep) = match (self.phase, window) {
            (Phase::Warmup, _) | (_, None) => (Phase::Measure(0), 0),
            (Phase::Measure(0), Some(w)) => {
                self.times[0] = w;
                if let Some(r) = Self::reached_rates(&self.book, reached) {
                    let b = Self::at_rates(&self.book, &r);
                    // The model at the rates of the run: what it decides
                    // otherwise, else the layers it is still unsure of there.
                    self.cands[1] = if b != self.cands[0] {
                        b
                    } else {
                        Self::flipped(&self.book, self.cands[0], Some(&r))
                    };
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
            (Phase::Settled(_, t), Some(w)) if w > t * (1.0 + DRIFT) => {
                // The rates moved: measure again, the start-up choice first,
                // then an alternative (chosen anew from the rates reached).
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

    fn book(every: u64) -> Book {
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
        .with_adaptive(every)
        .unwrap()
    }

    /// Iteration by iteration, as the runtime drives it: each iteration
    /// takes 1 s under the start-up choice and `alt_s` under the
    /// alternative; the request for point p comes at the first hand-in of
    /// p - 1. Returns the decisions.
    fn run(every: u64, alt_s: f64) -> Vec<u64> {
        let b = std::sync::Arc::new(book(every));
        let mut plan = b.plan().clone();
        let mut a = Adapt::new(&b).unwrap();
        let mut t = Duration::ZERO;
        let mut out = Vec::new();
        for i in 0..6 * every {
            a.started(i, t);
            if (i + 1) % every == 0 {
                let sfb = a.decide(&plan, i + 1, t, Reached::default());
                plan.decide(i + 1, sfb).unwrap();
                out.push(sfb);
            }
            let per = if plan.current_bits(i) == a.cands[0] { 1.0 } else { alt_s };
            t += Duration::from_secs_f64(per);
        }
        out
    }

    #[test]
    fn the_alternative_is_tried_once_and_kept_only_when_faster() {
        for every in [2, 3, 5] {
            let b = std::sync::Arc::new(book(every));
            let a = Adapt::new(&b).unwrap();
            let (start, alt) = (a.cands[0], a.cands[1]);
            assert_ne!(start, alt, "the bytes model is unsure of the FC layer");
            // The iterations before the first point are warm-up; then the
            // start-up choice is measured, then the alternative, then settled.
            let s6 = [start, alt, alt, alt, alt, alt];
            assert_eq!(run(every, 0.5), s6, "every {every}: twice as fast");
            assert_eq!(run(every, 0.95), s6, "every {every}: 5% faster, past the margin");
            let kept = [start, alt, start, start, start, start];
            assert_eq!(
                run(every, 0.99),
                kept,
                "every {every}: within the margin, kept as it was"
            );
            assert_eq!(run(every, 2.0), kept, "every {every}: slower");
        }
    }

    /// With rates: the model in seconds at the start-up rates is unsure of
    /// the FC layer (so the alternative flips it), but at the GEMM rate the
    /// run reached (100x slower) SFB is far behind: nothing is tried, and
    /// the start-up choice is kept at every point. At the start-up rates
    /// reached again, the layer is tried the other way.
    #[test]
    fn no_trial_where_the_reached_rates_make_the_model_sure() {
        let rates = Rates {
            link_bytes_per_s: 1e9,
            msg_s: 0.0,
            sum_bytes_per_s: 1e10,
            gemm_flop_per_s: 1e11,
            host_ranks: 1,
            link_on_host: false,
            ps_builds_grad: false,
        };
        let b = std::sync::Arc::new(book(2).with_rates(rates).unwrap());
        let (ps, sfb) = b.seconds(1).expect("an FC layer in seconds");
        assert!(
            ps.total().max(sfb.total()) < UNSURE * ps.total().min(sfb.total()),
            "{ps:?} {sfb:?}"
        );
        for (gemm, tried) in [(1e9, false), (1e11, true)] {
            let mut plan = b.plan().clone();
            let mut a = Adapt::new(&b).unwrap();
            let start = a.cands[0];
            let reached = Reached {
                gemm_flop_per_s: Some(gemm),
                sum_bytes_per_s: None,
            };
            let mut got = Vec::new();
            let mut t = Duration::ZERO;
            for i in 0..8u64 {
                a.started(i, t);
                if (i + 1) % 2 == 0 {
                    let sfb = a.decide(&plan, i + 1, t, reached);
                    plan.decide(i + 1, sfb).unwrap();
                    got.push(sfb);
                }
                t += Duration::from_secs(1);
            }
            assert_eq!(got.iter().any(|&s| s != start), tried, "GEMM at {gemm}: {got:?}");
        }
    }
}
