//! The claims table: every number the papers' texts
//! (`/work/shared/papers/`, cited as its README says: Poseidon §N, Fig. N;
//! Poseidon'15 §N; P3 §N, Fig. N; Nexus §N, Fig. N) state in their
//! evaluations, beside ours. The rows are data: [`Claim`]s built by
//! [`poseidon_claims`], [`poseidon15_claims`], [`p3_claims`] and
//! [`nexus_claims`] from the simulated points, the harness runs and the
//! measurements committed under `bench/results/`.

use std::fmt::Write as _;

use crate::*;

/// Whether a paper's number holds in ours.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Holds {
    /// The effect holds and our number is within [`CLOSE`] of the paper's.
    Yes,
    /// The effect holds; our number is further than [`CLOSE`] from the
    /// paper's, or the paper states none in its text.
    Effect,
    /// The effect does not hold in ours.
    No,
    /// Our input, not a result: the simulator is calibrated to this number.
    Calibrated,
    /// The paper's setting (cluster, dataset, configuration), not a result;
    /// the row says what ours is.
    Setting,
    /// Not reproduced, and why.
    NotReproduced(&'static str),
}

/// One row of the claims table.
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    /// The text and where: paper, section, table or figure.
    pub(crate) source: &'static str,
    /// What the paper says the number is.
    pub(crate) says: String,
    /// The paper's value, as its text states it.
    pub(crate) value: String,
    /// Ours, from `tidewire sim` (or the cost model, or the model profiles).
    pub(crate) sim: String,
    /// Ours, from runs on real processes (the harness, or a committed measurement).
    pub(crate) harness: String,
    pub(crate) holds: Holds,
}

/// How close our number must be to the paper's for [`Holds::Yes`]: within
/// 10% of it, relative, compared as the paper states it (a speedup as a
/// speedup, a gain in percent as a gain in percent). One rule for every row.
pub(crate) const CLOSE: f64 = 0.10;

/// [`Holds::Yes`] if `ours` is within [`CLOSE`] of `paper` and the effect
/// holds, [`Holds::Effect`] if only the effect does, else [`Holds::No`].
pub(crate) fn judge(ours: f64, paper: f64, effect: bool) -> Holds {
    match (effect, (ours / paper - 1.0).abs() <= CLOSE) {
        (false, _) => Holds::No,
        (true, true) => Holds::Yes,
        (true, false) => Holds::Effect,
    }
}

/// [`judge`] on several numbers at once: [`Holds::Yes`] only if each is close.
pub(crate) fn judge_all(ours: &[f64], paper: &[f64], effect: bool) -> Holds {
    assert_eq!(ours.len(), paper.len(), "one of ours per number of the paper's");
    let close = ours.iter().zip(paper).all(|(&o, &p)| judge(o, p, true) == Holds::Yes);
    judge(if close { 1.0 } else { 2.0 }, 1.0, effect)
}

/// [`Holds::Effect`] if `effect`, else [`Holds::No`] (no number to compare).
pub(crate) fn effect(effect: bool) -> Holds {
    if effect {
        Holds::Effect
    } else {
        Holds::No
    }
}

impl Holds {
    pub(crate) fn text(&self) -> String {
        match self {
            Holds::Yes => "yes".into(),
            Holds::Effect => "the effect (not the number)".into(),
            Holds::No => "**no**".into(),
            Holds::Calibrated => "input (calibrated to it)".into(),
            Holds::Setting => "a setting, not a result".into(),
            Holds::NotReproduced(why) => format!("not reproduced: {why}"),
        }
    }
}

/// The harness column of a row whose setting the 2-core machine cannot run.
pub(crate) fn no_harness(why: &str) -> String {
    format!("n/a ({why})")
}

/// Every claims row, in the table's order.
pub(crate) fn all_claims(pts: &[Point], util: &[Util], train: &[TrainPoint]) -> Vec<Claim> {
    let mut rows = poseidon_claims(pts);
    rows.extend(poseidon15_claims(pts));
    rows.extend(poseidon15_internal_claims(pts));
    rows.extend(p3_claims(pts, util, train));
    rows.extend(nexus_claims());
    rows
}

/// The claims section of `EVAL.md`.
pub(crate) fn claims_md(s: &mut String, pts: &[Point], util: &[Util], train: &[TrainPoint]) {
    let rows = all_claims(pts, util, train);
    let n = |f: fn(&Holds) -> bool| rows.iter().filter(|r| f(&r.holds)).count();
    let _ = writeln!(s, "\n## The papers' numbers beside ours\n");
    let _ = writeln!(
        s,
        "Every number the papers' texts state in their evaluations (Poseidon §5, Poseidon'15 §5, P3 §5, \
         Nexus §V, and the abstracts and introductions that quote them), with a few their designs rest on \
         (model sizes, Poseidon's Table 1 example, P3's VGG-19 layer share) and Nexus's sparse push \
         (§IV-C, Fig. 8). The texts are the copies in the papers folder (its README says which file is \
         which); we cite them by section, table and figure. Where a number is only in a figure, the text \
         copy does not have it and we did not read it off the plot: the row says so. Characterization \
         (Nexus §III) and related work are left out.\n\n\
         *Ours* is `tidewire sim` (or the cost model, `engine::cost`, or the model profiles, \
         `engine/src/models.rs`) and, where this 2-core machine can run it, real processes: `tidewire \
         train` under the bandwidth harness, or the measurements committed in `bench/results/` (each row \
         says which). *Holds* is judged on the simulator's number where the row has one (the real processes' \
         stand beside it), else on the real processes': **yes** where the effect holds and our number is within {:.0}% of the \
         paper's (relative, as the paper states it: a speedup as a speedup, a gain in percent as a gain in \
         percent; one rule for every row); *the effect* where it holds but the number is further off or the \
         text has none; **no** where the effect does not hold; *input* where the simulator is calibrated to \
         the number; *a setting* where the number describes the paper's set-up (the row says what ours is); \
         *not reproduced* with the reason.\n\n\
         {} rows: {} yes, {} the effect only, {} no, {} inputs, {} settings, {} not reproduced.\n",
        CLOSE * 100.0,
        rows.len(),
        n(|h| *h == Holds::Yes),
        n(|h| *h == Holds::Effect),
        n(|h| *h == Holds::No),
        n(|h| *h == Holds::Calibrated),
        n(|h| *h == Holds::Setting),
        n(|h| matches!(h, Holds::NotReproduced(_))),
    );
    let head: Vec<String> = [
        "source",
        "the paper says",
        "its value",
        "ours: simulator",
        "ours: real processes",
        "holds",
    ]
    .map(String::from)
    .to_vec();
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|r| vec![r.source.into(), r.says, r.value, r.sim, r.harness, r.holds.text()])
        .collect();
    table(s, &head, 6, &rows);
}
