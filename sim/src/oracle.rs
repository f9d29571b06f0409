//! The checker's oracle of the values a run must produce under the mean and
//! SGD: each layer's parameters and momentum after each iteration, in f64,
//! filled by `Sim::oracle_through` (in `check`) from the exact sums. It
//! shares no code with the kernels the run executes.

use tidewire_engine::fxhash::FxHashMap as HashMap;

/// The values a run must produce under an apply op other than the sum: per
/// layer, its parameters and momentum after each iteration, in f64
/// (`Sim::oracle_through`, in `check`).
#[derive(Debug, Default)]
pub(crate) struct Oracle {
    pub(crate) states: HashMap<u32, Vec<State>>,
}

/// A layer's (parameters, momentum) after one iteration, in f64.
type State = (Vec<f64>, Vec<f64>);

/// Whether `got` (f32, the run's) matches `want` (f64, the oracle's) within
/// what f32 rounding can account for over a few iterations: 1e-4 relative,
/// or absolute below 1. A wrong learning rate, a lost momentum or weight
/// decay, or a missing division is far outside it.
pub(crate) fn close(got: f32, want: f64) -> bool {
    (f64::from(got) - want).abs() <= 1e-4 * want.abs().max(1.0)
}
