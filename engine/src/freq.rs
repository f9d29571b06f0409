//! Communication frequency (Nexus): exchange every T local steps, and let
//! training quality adjust T.
//!
//! # Modes
//! A learner exchanges with the servers every `T` local steps (T = 1: every
//! step, plain BSP). Between exchanges it does one of two things
//! ([`CommMode`]):
//!
//! - [`CommMode::Accumulate`]: it sums its gradients locally over the T
//!   batches and pushes the **sum** on the T-th (Horovod's
//!   `backward_passes_per_step`); the model changes only at exchanges, so one
//!   update carries T batches and its step is T times as long as one batch's
//!   (scale the learning rate or the loss by 1/T for a mean).
//! - [`CommMode::Average`]: it takes an optimizer step on every batch (local
//!   SGD, its own momentum), and at the T-th step pushes its **parameters**;
//!   the servers average them (`ApplyOp::Mean`) and every learner continues
//!   from the average (Nexus's BSP model averaging). The learning rate keeps
//!   its per-batch meaning.
//!
//! # Quality-guided adjustment
//! [`FreqController`] is Nexus's frequency adjustment as a pure state
//! machine: no clock, no I/O, no randomness. Each learner reports a quality
//! figure (a loss: lower is better) every step; at each exchange the mean of
//! the figures since the previous exchange travels with the exchange, and
//! every learner feeds **every** learner's figure (in learner order) to its
//! controller. Because every controller sees the same inputs in the same
//! order, every learner computes the same decisions at the same exchange: the
//! leading server's proposal and every learner's verdict are *replicated*,
//! not sent, and all learners switch T at the same exchange (BSP needs that).
//!
//! The schedule, counted in exchanges (`period` = P):
//! 1. **Baseline**: P exchanges at the current T; each learner's mean figure
//!    over them is its baseline, and is remembered as the quality of that T.
//! 2. **Proposal**: the leader proposes a lower frequency (a larger T): twice
//!    the current T, capped at `t_max`; a T that was rejected before is not
//!    proposed again (the memory), and the next smaller untried one is
//!    proposed instead (halving the gap). With nothing left to propose T stays.
//! 3. **Trial**: P exchanges at the proposed T. If any learner's mean figure
//!    is worse than its baseline by more than `tolerance` (relative: above
//!    `b + tolerance·|b|`; a non-finite figure is always worse), that learner
//!    rejects: everyone falls back to the previous T, the proposal is
//!    remembered as rejected, and a new baseline is measured (step 1).
//!    Otherwise everyone accepts: the trial window is the new baseline and
//!    the next proposal follows at once (step 2).
//! 4. **Late reversion**: from step `revert_at_step` on, T returns to the
//!    original one for the rest of the run and nothing more is proposed. The
//!    controller makes that step an exchange, so every learner switches there.
//!
//! ```
//! use tidewire_engine::freq::{FreqConfig, FreqController, Decision};
//!
//! let cfg = FreqConfig { t_initial: 1, t_max: 8, period: 2, tolerance: 0.05, revert_at_step: Some(100) };
//! let mut c = FreqController::new(cfg, 2)?;
//! let mut proposals = 0;
//! for step in 0..120u64 {
//!     // ... forward, backward, and the local part of the step ...
//!     if c.due() {
//!         // ... exchange; every learner's figure arrives with it ...
//!         let loss = 1.0 / (1.0 + step as f64);
//!         if let Decision::Propose { .. } | Decision::Accept { next: Some(_), .. } = c.exchanged(&[loss, loss])? {
//!             proposals += 1;
//!         }
//!     } else {
//!         c.local_step();
//!     }
//! }
//! assert!(proposals > 0);
//! assert_eq!(c.t(), 1); // back to the original frequency late in the run
//! # Ok::<(), tidewire_engine::EngineError>(())
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// What a learner does between exchanges (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommMode {
    /// Sum gradients locally over T batches, push the sum on the T-th.
    Accumulate,
    /// A local optimizer step per batch; the models are averaged every T steps.
    Average,
}

impl CommMode {
    /// Parses `accumulate` or `average`.
    pub fn parse(s: &str) -> Option<Self> {
        let m = match s {
            "accumulate" => Some(CommMode::Accumulate),
            "average" => Some(CommMode::Average),
            _ => None,
        };
        debug_assert!(m.map_or(true, |m| m.name() == s), "parse and name agree");
        m
    }
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            CommMode::Accumulate => "accumulate",
            CommMode::Average => "average",
        }
    }
}

/// The largest T the controller accepts.
pub const T_MAX_LIMIT: u32 = 1 << 16;
/// Decisions [`FreqController::history`] keeps (the oldest go first).
pub const HISTORY_MAX: usize = 4096;

/// Settings of the frequency: the original T and, for quality-guided
/// adjustment, its bounds and schedule. Every rank must agree on all of them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FreqConfig {
    /// The original T (steps per exchange), 1..=`t_max`.
    pub t_initial: u32,
    /// The largest T the controller proposes; `t_max == t_initial` fixes T.
    pub t_max: u32,
    /// Exchanges per measurement window (baseline or trial), at least 1.
    pub period: u32,
    /// How much worse (relative) a learner's mean figure may get before it
    /// rejects a proposal; finite and ≥ 0.
    pub tolerance: f64,
    /// The step from which T is the original one again, for good.
    pub revert_at_step: Option<u64>,
}

impl FreqConfig {
    /// A fixed T (no adjustment).
    pub fn fixed(t: u32) -> Self {
        FreqConfig {
            t_initial: t,
            t_max: t,
            period: 1,
            tolerance: 0.0,
            revert_at_step: None,
        }
    }
    /// Whether T may change.
    pub fn adjusts(&self) -> bool {
        self.t_max > self.t_initial
    }
    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        let bad = |s: String| Err(EngineError::InvalidConfig(s));
        if self.t_initial == 0 || self.t_initial > self.t_max {
            return bad(format!(
                "communication frequency: T = {} must be in 1..=t_max ({})",
                self.t_initial, self.t_max
            ));
        }
        if self.t_max > T_MAX_LIMIT {
            return bad(format!(
                "communication frequency: t_max {} above {T_MAX_LIMIT}",
                self.t_max
            ));
        }
        if self.period == 0 {
            return bad("communication frequency: period must be at least 1 exchange".into());
        }
        if !(self.tolerance.is_finite() && self.tolerance >= 0.0) {
            return bad(format!(
                "communication frequency: tolerance {} must be finite and >= 0",
                self.tolerance
            ));
        }
        Ok(())
    }
    /// The agreed encoding: every field, for the rendezvous hash.
    pub fn encode(&self) -> [u8; 33] {
        let mut b = [0u8; 33];
        b[..4].copy_from_slice(&self.t_initial.to_le_bytes());
        b[4..8].copy_from_slice(&self.t_max.to_le_bytes());
        b[8..12].copy_from_slice(&self.period.to_le_bytes());
        b[12..20].copy_from_slice(&self.tolerance.to_bits().to_le_bytes());
        b[20] = u8::from(self.revert_at_step.is_some());
        b[21..29].copy_from_slice(&self.revert_at_step.unwrap_or(0).to_le_bytes());
        b
    }
}

/// How a job communicates: the mode between exchanges and the frequency.
/// Every rank must agree on it (it is hashed at rendezvous:
/// [`JobConfig::with_comm`](crate::agree::JobConfig::with_comm)).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CommConfig {
    /// What learners do between exchanges.
    pub mode: CommMode,
    /// T and its adjustment.
    pub freq: FreqConfig,
}

impl Default for CommConfig {
    /// Every step (T = 1), no adjustment.
    fn default() -> Self {
        let c = CommConfig {
            mode: CommMode::Accumulate,
            freq: FreqConfig::fixed(1),
        };
        debug_assert!(c.freq.validate().is_ok() && !c.freq.adjusts());
        c
    }
}

/// What the controller decided at an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// T stays.
    Keep,
    /// The leader proposes `to` (from `from`); the trial starts now.
    Propose {
        /// The T before.
        from: u32,
        /// The proposed T, in force from this exchange on.
        to: u32,
    },
    /// Every learner's quality held at the proposed T: it stays, and the
    /// leader proposes the next one at once (`next`, now on trial, in force
    /// from this exchange on), unless none is left.
    Accept {
        /// The accepted T.
        t: u32,
        /// The next proposal.
        next: Option<u32>,
    },
    /// Learner `learner`'s quality degraded at `t`: everyone falls back to `back_to`.
    Reject {
        /// The rejected T.
        t: u32,
        /// The T in force from this exchange on.
        back_to: u32,
        /// The first learner (in learner order) whose figure degraded.
        learner: u32,
    },
    /// Late in the run: back to the original T for good.
    Revert {
        /// The original T.
        to: u32,
    },
}

/// One decision in [`FreqController::history`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Event {
    /// The step that ended with this exchange (0-based).
    pub step: u64,
    /// The exchange (0-based).
    pub exchange: u64,
    /// What was decided.
    pub decision: Decision,
}

/// What the controller remembers about a T it ran.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tried {
    /// The mean over learners of their mean figure in the latest window at this T.
    pub quality: f64,
    /// Whether a trial of this T was rejected (it is not proposed again).
    pub rejected: bool,
    /// Windows measured at this T.
    pub windows: u32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Trial {
    from: u32,
    to: u32,
}

/// Nexus's quality-guided communication frequency (see the module docs).
///
/// Call order, every step: [`due`](Self::due) says whether this step ends
/// with an exchange; after the exchange call [`exchanged`](Self::exchanged)
/// with every learner's figure, otherwise [`local_step`](Self::local_step).
#[derive(Debug, Clone)]
pub struct FreqController {
    cfg: FreqConfig,
    learners: usize,
    t: u32,
    step: u64,
    since: u32,
    exchanges: u64,
    window: Vec<f64>,
    window_n: u32,
    baseline: Option<Vec<f64>>,
    trial: Option<Trial>,
    memory: BTreeMap<u32, Tried>,
    reverted: bool,
    history: Vec<Event>,
}

impl FreqController {
    /// A controller for `learners` learners (at least 1).
    pub fn new(cfg: FreqConfig, learners: usize) -> Result<Self> {
        cfg.validate()?;
        if learners == 0 {
            return Err(EngineError::InvalidConfig(
                "communication frequency: at least one learner".into(),
            ));
        }
        let c = FreqController {
            cfg,
            learners,
            t: cfg.t_initial,
            step: 0,
            since: 0,
            exchanges: 0,
            window: vec![0.0; learners],
            window_n: 0,
            baseline: None,
            trial: None,
            memory: BTreeMap::new(),
            reverted: false,
            history: Vec::new(),
        };
        c.debug_invariants();
        // T = 1: every step is an exchange.
        debug_assert_eq!(c.due(), cfg.t_initial == 1);
        Ok(c)
    }

    /// The settings.
    pub fn config(&self) -> &FreqConfig {
        &self.cfg
    }
    /// The T in force: steps per exchange.
    pub fn t(&self) -> u32 {
        self.t
    }
    /// Steps finished.
    pub fn steps(&self) -> u64 {
        self.step
    }
    /// Exchanges finished.
    pub fn exchanges(&self) -> u64 {
        self.exchanges
    }
    /// Steps finished since the last exchange.
    pub fn since_exchange(&self) -> u32 {
        self.since
    }
    /// Whether T is back at the original one for good.
    pub fn reverted(&self) -> bool {
        self.reverted
    }
    /// The proposal on trial, as (from, to).
    pub fn on_trial(&self) -> Option<(u32, u32)> {
        self.trial.map(|t| (t.from, t.to))
    }
    /// What is remembered of every T run so far.
    pub fn memory(&self) -> &BTreeMap<u32, Tried> {
        &self.memory
    }
    /// The decisions other than [`Decision::Keep`], oldest first (the last
    /// [`HISTORY_MAX`]).
    pub fn history(&self) -> &[Event] {
        &self.history
    }

    /// Whether the step now running ends with an exchange: the T-th step since
    /// the last one, or the reversion step.
    pub fn due(&self) -> bool {
        self.since + 1 >= self.t || self.revert_due()
    }

    fn revert_due(&self) -> bool {
        !self.reverted && self.t != self.cfg.t_initial && self.cfg.revert_at_step.is_some_and(|r| self.step + 1 >= r)
    }

    /// Ends a step without an exchange. An error when the step was [`due`](Self::due).
    pub fn local_step(&mut self) -> Result<()> {
        if self.due() {
            return Err(EngineError::InvalidConfig(format!(
                "communication frequency: step {} is an exchange step (T = {}), but it ended without one",
                self.step, self.t
            )));
        }
        self.step += 1;
        self.since += 1;
        self.debug_invariants();
        Ok(())
    }

    /// Ends a step with an exchange, given every learner's quality figure
    /// (learner order; the mean loss since the previous exchange). Every
    /// learner must call it with the same figures. Returns the decision; a
    /// new T is in force from the next step. An error when the step was not
    /// [`due`](Self::due) or the figures are not one per learner.
    pub fn exchanged(&mut self, quality: &[f64]) -> Result<Decision> {
        if !self.due() {
            return Err(EngineError::InvalidConfig(format!(
                "communication frequency: step {} exchanged, but T = {} and only {} steps passed since the last exchange",
                self.step,
                self.t,
                self.since + 1
            )));
        }
        if quality.len() != self.learners {
            return Err(EngineError::InvalidConfig(format!(
                "communication frequency: {} quality figures, expected one per learner ({})",
                quality.len(),
                self.learners
            )));
        }
        let d = self.decide(quality);
        if d != Decision::Keep {
            if self.history.len() == HISTORY_MAX {
                self.history.remove(0);
            }
            self.history.push(Event {
                step: self.step,
                exchange: self.exchanges,
                decision: d,
            });
        }
        // A proposal is on trial from the exchange it is made at; a reversion ends them.
        debug_assert!(
            !matches!(d, Decision::Propose { .. } | Decision::Accept { next: Some(_), .. }) || self.trial.is_some()
        );
        debug_assert!(!matches!(d, Decision::Revert { .. }) || self.reverted);
        self.step += 1;
        self.since = 0;
        self.exchanges += 1;
        self.debug_invariants();
        Ok(d)
    }

    /// What every step leaves true.
    fn debug_invariants(&self) {
        // T within its bounds; the steps since the exchange under it.
        debug_assert!(self.t >= 1 && self.t <= self.cfg.t_max, "T = {}", self.t);
        debug_assert!(self.since < self.t, "{} steps at T = {}", self.since, self.t);
        // A trial is a larger T, in force; after the reversion there is none, at the original T.
        debug_assert!(
            self.trial.map_or(true, |tr| tr.from < tr.to && tr.to == self.t),
            "{:?}",
            self.trial
        );
        debug_assert!(!self.reverted || (self.trial.is_none() && self.t == self.cfg.t_initial));
        debug_assert!(self.window_n < self.cfg.period.max(1) && self.history.len() <= HISTORY_MAX);
        debug_assert!(self.baseline.as_ref().map_or(true, |b| b.len() == self.learners));
    }

    fn decide(&mut self, q: &[f64]) -> Decision {
        if self.reverted || !self.cfg.adjusts() {
            return Decision::Keep;
        }
        if self.cfg.revert_at_step.is_some_and(|r| self.step + 1 >= r) {
            self.reverted = true;
            self.trial = None;
            self.t = self.cfg.t_initial;
            return Decision::Revert { to: self.t };
        }
        for (w, x) in self.window.iter_mut().zip(q) {
            *w += x;
        }
        self.window_n += 1;
        if self.window_n < self.cfg.period {
            return Decision::Keep;
        }
        let n = f64::from(self.window_n);
        debug_assert_eq!(self.window_n, self.cfg.period, "a window is one period of exchanges");
        let means: Vec<f64> = self.window.iter().map(|w| w / n).collect();
        self.window.iter_mut().for_each(|w| *w = 0.0);
        self.window_n = 0;
        let overall = means.iter().sum::<f64>() / means.len() as f64;
        if let Some(tr) = self.trial.take() {
            // A trial is a lower frequency, and it is the T in force.
            debug_assert!(tr.from < tr.to && tr.to == self.t, "{tr:?} at T = {}", self.t);
            let base = self.baseline.as_deref().expect("a trial follows a baseline");
            debug_assert_eq!(base.len(), means.len(), "a figure per learner");
            let worse = means
                .iter()
                .zip(base)
                .position(|(m, b)| !within(*m, b + self.cfg.tolerance * b.abs()));
            let entry = self.memory.entry(tr.to).or_insert(Tried {
                quality: overall,
                rejected: false,
                windows: 0,
            });
            entry.quality = overall;
            entry.windows += 1;
            if let Some(learner) = worse {
                entry.rejected = true;
                self.t = tr.from;
                self.baseline = None;
                return Decision::Reject {
                    t: tr.to,
                    back_to: tr.from,
                    learner: learner as u32,
                };
            }
            // What is accepted was never rejected: rejected T are not proposed again.
            debug_assert!(self.memory.get(&tr.to).is_some_and(|m| !m.rejected));
            self.baseline = Some(means);
            let next = match self.propose() {
                Decision::Propose { to, .. } => Some(to),
                _ => None,
            };
            return Decision::Accept { t: tr.to, next };
        }
        // A baseline window at the current T.
        let entry = self.memory.entry(self.t).or_insert(Tried {
            quality: overall,
            rejected: false,
            windows: 0,
        });
        entry.quality = overall;
        entry.windows += 1;
        self.baseline = Some(means);
        self.propose()
    }

    /// The next T to try above the current one: twice it (capped at
    /// `t_max`), or the largest untried-or-accepted one below that, halving
    /// the gap; `None` when every candidate was rejected.
    pub fn candidate(&self) -> Option<u32> {
        let mut c = self.t.saturating_mul(2).min(self.cfg.t_max);
        while c > self.t {
            if !self.memory.get(&c).is_some_and(|m| m.rejected) {
                debug_assert!(c <= self.cfg.t_max && c <= self.t.saturating_mul(2));
                return Some(c);
            }
            c = self.t + (c - self.t) / 2;
        }
        None
    }

    fn propose(&mut self) -> Decision {
        match self.candidate() {
            Some(to) => {
                let from = self.t;
                debug_assert!(self.trial.is_none(), "one trial at a time");
                self.trial = Some(Trial { from, to });
                self.t = to;
                Decision::Propose { from, to }
            }
            None => Decision::Keep,
        }
    }
}

/// Whether the figure `m` is finite and at most `limit` (a non-finite
/// figure, or a NaN limit, counts as degraded).
fn within(m: f64, limit: f64) -> bool {
    m.is_finite()
        && matches!(
            m.partial_cmp(&limit),
            Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit;

    fn cfg(t_max: u32, period: u32, tol: f64, revert: Option<u64>) -> FreqConfig {
        FreqConfig {
            t_initial: 1,
            t_max,
            period,
            tolerance: tol,
            revert_at_step: revert,
        }
    }

    /// Runs `steps` steps with `loss(step, t, learner)` as each learner's
    /// per-step figure (averaged between exchanges, as a learner does).
    /// Returns the T of every step and the decisions.
    fn drive(
        c: &mut FreqController,
        steps: u64,
        loss: impl Fn(u64, u32, usize) -> f64,
    ) -> (Vec<u32>, Vec<(u64, Decision)>) {
        let n = c.learners;
        let mut acc = vec![0.0; n];
        let mut cnt = 0.0;
        let mut ts = Vec::new();
        let mut ds = Vec::new();
        for s in 0..steps {
            assert_eq!(c.steps(), s);
            ts.push(c.t());
            for (i, a) in acc.iter_mut().enumerate() {
                *a += loss(s, c.t(), i);
            }
            cnt += 1.0;
            if c.due() {
                let q: Vec<f64> = acc.iter().map(|a| a / cnt).collect();
                let d = c.exchanged(&q).unwrap();
                ds.push((s, d));
                acc.iter_mut().for_each(|a| *a = 0.0);
                cnt = 0.0;
            } else {
                c.local_step().unwrap();
            }
        }
        (ts, ds)
    }

    #[test]
    fn fixed_t_exchanges_every_t_steps_and_never_changes() {
        for t in [1u32, 2, 3, 7, 100] {
            let mut c = FreqController::new(FreqConfig::fixed(t), 3).unwrap();
            let (ts, ds) = drive(&mut c, 1000, |_, _, _| 1.0);
            assert!(ts.iter().all(|x| *x == t));
            let at: Vec<u64> = ds.iter().map(|(s, _)| *s).collect();
            let want: Vec<u64> = (0..1000).filter(|s| (s + 1) % u64::from(t) == 0).collect();
            assert_eq!(at, want, "T = {t}");
            assert!(ds.iter().all(|(_, d)| *d == Decision::Keep));
            assert_eq!(c.exchanges(), 1000 / u64::from(t));
        }
    }

    #[test]
    fn proposal_schedule_doubles_every_period_while_quality_holds() {
        // A falling loss: every proposal is accepted.
        let mut c = FreqController::new(cfg(16, 3, 0.0, None), 2).unwrap();
        let (_, ds) = drive(&mut c, 2000, |s, _, _| 10.0 / (1.0 + s as f64));
        let props: Vec<(u32, u32)> = ds
            .iter()
            .filter_map(|(_, d)| match d {
                Decision::Propose { from, to } => Some((*from, *to)),
                Decision::Accept { t, next: Some(n) } => Some((*t, *n)),
                _ => None,
            })
            .collect();
        assert_eq!(props, vec![(1, 2), (2, 4), (4, 8), (8, 16)]);
        // The first proposal comes after one baseline window of 3 exchanges at T = 1;
        // each next after one trial window of 3 exchanges at the proposed T.
        let prop_steps: Vec<u64> = ds
            .iter()
            .filter(|(_, d)| matches!(d, Decision::Propose { .. } | Decision::Accept { next: Some(_), .. }))
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(prop_steps, vec![2, 2 + 3 * 2, 8 + 3 * 4, 20 + 3 * 8]);
        assert_eq!(c.t(), 16);
        let accepts = ds.iter().filter(|(_, d)| matches!(d, Decision::Accept { .. })).count();
        assert_eq!(accepts, 4);
        assert!(c.memory().values().all(|m| !m.rejected));
        assert_eq!(c.memory().keys().copied().collect::<Vec<_>>(), vec![1, 2, 4, 8, 16]);
    }

    #[test]
    fn a_degraded_learner_rejects_and_everyone_falls_back() {
        // Learner 2's loss jumps whenever T > 4; the others are content.
        let loss = |s: u64, t: u32, i: usize| {
            let base = 1.0 + 1.0 / (1.0 + s as f64);
            if i == 2 && t > 4 {
                base * 1.5
            } else {
                base
            }
        };
        let mut c = FreqController::new(cfg(64, 2, 0.05, None), 4).unwrap();
        let (ts, ds) = drive(&mut c, 3000, loss);
        let rejects: Vec<Decision> = ds
            .iter()
            .map(|(_, d)| *d)
            .filter(|d| matches!(d, Decision::Reject { .. }))
            .collect();
        assert!(!rejects.is_empty());
        for r in &rejects {
            let Decision::Reject { t, back_to, learner } = *r else {
                unreachable!()
            };
            assert_eq!(learner, 2);
            assert!(t > 4 && back_to <= 4, "{r:?}");
        }
        // Memory: 8, 6 and 5 each rejected once and never proposed again; T settles at 4.
        assert_eq!(rejects.len(), 3, "{rejects:?}");
        for t in [8, 6, 5] {
            assert!(c.memory()[&t].rejected, "{t}");
        }
        assert_eq!(c.t(), 4);
        assert!(ts[2000..].iter().all(|t| *t == 4));
        assert_eq!(c.candidate(), None);
    }

    #[test]
    fn tolerance_decides_at_the_boundary() {
        // The baseline window is 1.0; a trial at 1.0 * (1 + tol) is accepted, above it rejected.
        for (trial_loss, accepted) in [
            (1.1, true),
            (1.1000001, false),
            (0.5, true),
            (f64::NAN, false),
            (f64::INFINITY, false),
            (f64::NEG_INFINITY, false),
        ] {
            let mut c = FreqController::new(cfg(2, 1, 0.1, None), 1).unwrap();
            assert_eq!(c.exchanged(&[1.0]).unwrap(), Decision::Propose { from: 1, to: 2 });
            c.local_step().unwrap();
            let d = c.exchanged(&[trial_loss]).unwrap();
            if accepted {
                assert_eq!(d, Decision::Accept { t: 2, next: None }, "{trial_loss}");
                assert_eq!(c.t(), 2);
            } else {
                assert_eq!(
                    d,
                    Decision::Reject {
                        t: 2,
                        back_to: 1,
                        learner: 0
                    },
                    "{trial_loss}"
                );
                assert_eq!(c.t(), 1);
            }
        }
    }

    #[test]
    fn late_reversion_returns_to_the_original_t_at_the_step() {
        let mut c = FreqController::new(cfg(32, 1, 0.0, Some(500)), 2).unwrap();
        let (ts, ds) = drive(&mut c, 1000, |s, _, _| 1.0 / (1.0 + s as f64));
        assert!(ts[..499].contains(&32));
        // Step 499 is an exchange (whatever T was), and T = 1 from step 500 on.
        assert!(ds.iter().any(|(s, d)| *s == 499 && *d == Decision::Revert { to: 1 }));
        assert!(ts[500..].iter().all(|t| *t == 1));
        assert!(c.reverted());
        assert_eq!(
            ds.iter().filter(|(_, d)| matches!(d, Decision::Revert { .. })).count(),
            1
        );
        assert!(ds.iter().filter(|(s, _)| *s >= 500).all(|(_, d)| *d == Decision::Keep));
    }

    #[test]
    fn misuse_is_a_typed_error() {
        assert!(FreqController::new(cfg(4, 1, 0.0, None), 0).is_err());
        for bad in [
            FreqConfig {
                t_initial: 0,
                ..FreqConfig::fixed(1)
            },
            FreqConfig {
                t_initial: 5,
                ..cfg(4, 1, 0.0, None)
            },
            cfg(4, 0, 0.0, None),
            cfg(4, 1, -0.1, None),
            cfg(4, 1, f64::INFINITY, None),
            cfg(T_MAX_LIMIT + 1, 1, 0.0, None),
        ] {
            assert!(
                matches!(FreqController::new(bad, 1), Err(EngineError::InvalidConfig(_))),
                "{bad:?}"
            );
        }
        let mut c = FreqController::new(FreqConfig::fixed(2), 2).unwrap();
        assert!(c.exchanged(&[1.0, 1.0]).is_err()); // not due
        c.local_step().unwrap();
        assert!(c.local_step().is_err()); // due
        assert!(c.exchanged(&[1.0]).is_err()); // one figure short
        assert_eq!(c.steps(), 1);
        assert_eq!(c.exchanged(&[1.0, 1.0]).unwrap(), Decision::Keep);
    }

    #[test]
    fn agreed_encoding_covers_every_field() {
        let a = cfg(8, 4, 0.02, Some(100));
        let enc = a.encode();
        for b in [
            FreqConfig { t_initial: 2, ..a },
            FreqConfig { t_max: 9, ..a },
            FreqConfig { period: 5, ..a },
            FreqConfig { tolerance: 0.03, ..a },
            FreqConfig {
                revert_at_step: None,
                ..a
            },
            FreqConfig {
                revert_at_step: Some(101),
                ..a
            },
        ] {
            assert_ne!(b.encode(), enc, "{b:?}");
        }
    }

    /// Randomized: arbitrary settings and noisy, learner-specific losses.
    /// The invariants: T stays in 1..=t_max (and t_initial after the
    /// reversion); exchanges happen exactly when due, every T steps (or at the
    /// reversion step); replicas fed the same figures decide identically; a
    /// rejected T is never proposed again; a reject or an accept ends the trial
    /// that was running.
    #[test]
    fn randomized_invariants() {
        let seed = testkit::seed("TIDEWIRE_FREQ_SEED");
        let mut s = seed;
        for case in 0..300 {
            let r = |s: &mut u64, n: u64| testkit::next(s) % n;
            let t_initial = 1 + r(&mut s, 4) as u32;
            let t_max = t_initial + r(&mut s, 40) as u32;
            let period = 1 + r(&mut s, 5) as u32;
            let tolerance = r(&mut s, 20) as f64 / 100.0;
            let steps = 50 + r(&mut s, 2000);
            let revert = (r(&mut s, 2) == 0).then(|| r(&mut s, steps + 10));
            let learners = 1 + r(&mut s, 6) as usize;
            let c0 = FreqConfig {
                t_initial,
                t_max,
                period,
                tolerance,
                revert_at_step: revert,
            };
            let mut a = FreqController::new(c0, learners).unwrap();
            let mut b = FreqController::new(c0, learners).unwrap();
            let (mut since, mut rejected) = (0u32, std::collections::BTreeSet::new());
            let mut noise = testkit::next(&mut s);
            for step in 0..steps {
                let t = a.t();
                assert!(
                    (1..=t_max).contains(&t) && t >= t_initial,
                    "seed {seed} case {case}: T {t}"
                );
                if a.reverted() {
                    assert_eq!(t, t_initial, "seed {seed} case {case}");
                }
                assert_eq!(a.due(), b.due());
                let reverting = revert.is_some_and(|rv| step + 1 >= rv) && !a.reverted() && t != t_initial;
                assert_eq!(
                    a.due(),
                    since + 1 >= t || reverting,
                    "seed {seed} case {case} step {step}"
                );
                if a.due() {
                    let q: Vec<f64> = (0..learners)
                        .map(|_| 1.0 + (testkit::next(&mut noise) % 1000) as f64 / 1000.0 * f64::from(t) / 8.0)
                        .collect();
                    let trial = a.on_trial();
                    let (da, db) = (a.exchanged(&q).unwrap(), b.exchanged(&q).unwrap());
                    assert_eq!(da, db, "seed {seed} case {case}: replicas disagree");
                    assert_eq!(a.t(), b.t());
                    match da {
                        Decision::Propose { from, to } => {
                            assert!(
                                to > from && to <= t_max && !rejected.contains(&to),
                                "seed {seed} case {case}: {da:?}"
                            );
                        }
                        Decision::Reject { t, back_to, learner } => {
                            assert_eq!(trial, Some((back_to, t)), "seed {seed} case {case}");
                            assert!((learner as usize) < learners);
                            rejected.insert(t);
                        }
                        Decision::Accept { t, next } => {
                            assert_eq!(trial.map(|x| x.1), Some(t), "seed {seed} case {case}");
                            if let Some(n) = next {
                                assert!(
                                    n > t && n <= t_max && !rejected.contains(&n),
                                    "seed {seed} case {case}: {da:?}"
                                );
                            }
                        }
                        Decision::Revert { to } => assert_eq!(to, t_initial),
                        Decision::Keep => {}
                    }
                    since = 0;
                } else {
                    a.local_step().unwrap();
                    b.local_step().unwrap();
                    since += 1;
                }
            }
            if revert.is_some_and(|rv| rv < steps) && a.t() != t_initial {
                panic!("seed {seed} case {case}: not reverted by the end");
            }
        }
    }
}
