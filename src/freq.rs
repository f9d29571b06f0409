//! Communication frequency for training programs: exchange every T steps
//! (accumulated gradients, or averaged models), with Nexus's quality-guided
//! adjustment of T.
//!
//! The modes and the controller are [`tidewire_engine::freq`]'s (read its
//! docs for the schedule). This module adds the learner's side: a [`Guide`]
//! per learner takes the quality figures the program reports
//! ([`Guide::report`], a loss per step), says when a step ends with an
//! exchange ([`Guide::due`]), and carries the figures with the exchange:
//!
//! - the job's layer table ends with one extra layer of one value per
//!   learner, [`quality_layer`], synced through the parameter servers like
//!   any other layer;
//! - before an exchange the learner writes its mean figure since the last
//!   exchange into its own column of that layer's gradient, zeros elsewhere
//!   ([`Guide::write_figures`]), and hands the layer in with the others;
//! - after the exchange every learner reads every learner's figure from the
//!   layer's parameters ([`Guide::exchanged`]); all learners read the same
//!   bits, so all controllers take the same decisions at the same exchange
//!   (the leading server's proposal and each learner's verdict are
//!   replicated, not sent).
//!
//! The servers must reduce (`ApplyOp::Mean` or `ApplyOp::Sum`) for the
//! figures to arrive intact: with SGD on the servers, use [`CommMode::Average`]
//! (which reduces with `Mean` and steps locally) or apply the optimizer on
//! the learners. The [`CommConfig`] goes to [`Builder::comm`](crate::Builder::comm)
//! so that every rank agrees on it at rendezvous.
//!
//! ```
//! use tidewire::engine::freq::{CommConfig, CommMode, FreqConfig};
//! use tidewire::freq::Guide;
//! use tidewire::gpu::cpu::ApplyOp;
//!
//! let comm = CommConfig {
//!     mode: CommMode::Average,
//!     freq: FreqConfig { t_initial: 1, t_max: 8, period: 2, tolerance: 0.02, revert_at_step: Some(900) },
//! };
//! // Learner 0 of 1, with the servers averaging (a job of one, without the session here).
//! let mut g = Guide::new(comm, ApplyOp::Mean, 0, 1)?;
//! let mut quality = vec![0f32; 1]; // the quality layer's gradient ...
//! let mut exchanges = 0;
//! for step in 0..1000u64 {
//!     g.report(1.0 / (1.0 + step as f64)); // this step's loss
//!     if g.due() {
//!         g.write_figures(&mut quality)?;
//!         // ... hand in every layer and the quality layer, wait for them ...
//!         let synced = quality.clone(); // ... the quality layer's parameters (Mean of one learner)
//!         g.exchanged(&synced)?;
//!         exchanges += 1;
//!     } else {
//!         g.local_step()?;
//!     }
//! }
//! assert!(exchanges < 1000 && g.t() == 1);
//! # Ok::<(), tidewire::Error>(())
//! ```

use tidewire_engine::book::{LayerKind, LayerSpec};
pub use tidewire_engine::freq::{CommConfig, CommMode, Decision, FreqConfig, FreqController};
use tidewire_engine::ApplyOp;

use crate::error::{Error, Result};

/// The name of the quality layer.
pub const QUALITY_LAYER: &str = "tidewire.quality";

/// The extra layer that carries the quality figures: one value per learner
/// (append it to the layer table, last, when the frequency adjusts).
pub fn quality_layer(learners: usize) -> LayerSpec {
    LayerSpec::new(QUALITY_LAYER, LayerKind::Other, 1, learners.max(1))
}

/// One learner's side of the communication frequency (see the module docs).
#[derive(Debug, Clone)]
pub struct Guide {
    ctl: FreqController,
    mode: CommMode,
    learner: usize,
    learners: usize,
    /// How the servers' result maps back to the figures: × learners for Mean.
    scale: f32,
    sum: f64,
    n: u64,
}

impl Guide {
    /// The guide of learner `learner` (its worker index) of `learners`, for a
    /// job whose servers apply `op`. An error when the settings are invalid,
    /// or the frequency adjusts and `op` does not reduce.
    pub fn new(comm: CommConfig, op: ApplyOp, learner: usize, learners: usize) -> Result<Self> {
        let ctl = FreqController::new(comm.freq, learners)?;
        if learner >= learners {
            return Err(Error::Layout(format!("learner {learner} of {learners}")));
        }
        let scale = match op {
            ApplyOp::Sum => 1.0,
            ApplyOp::Mean => learners as f32,
            ApplyOp::Sgd { .. } if comm.freq.adjusts() => {
                return Err(Error::Engine(tidewire_engine::EngineError::InvalidConfig(
                    "quality-guided frequency needs servers that reduce (mean or sum) to carry the quality \
                     figures: use comm mode average, or apply the optimizer on the learners"
                        .into(),
                )))
            }
            ApplyOp::Sgd { .. } => 1.0,
        };
        if comm.mode == CommMode::Average && op != ApplyOp::Mean {
            return Err(Error::Engine(tidewire_engine::EngineError::InvalidConfig(
                "comm mode average needs the servers to average (mean): they average the models".into(),
            )));
        }
        Ok(Guide {
            ctl,
            mode: comm.mode,
            learner,
            learners,
            scale,
            sum: 0.0,
            n: 0,
        })
    }
    /// The mode.
    pub fn mode(&self) -> CommMode {
        self.mode
    }
    /// The T in force.
    pub fn t(&self) -> u32 {
        self.ctl.t()
    }
    /// Whether the frequency adjusts (then the quality layer travels with every exchange).
    pub fn adjusts(&self) -> bool {
        self.ctl.config().adjusts()
    }
    /// The controller (its memory, history and counters).
    pub fn controller(&self) -> &FreqController {
        &self.ctl
    }
    /// Reports a quality figure (a loss: lower is better) for the step now
    /// running. Several reports in one span are averaged.
    pub fn report(&mut self, quality: f64) {
        self.sum += quality;
        self.n += 1;
    }
    /// Whether the step now running ends with an exchange.
    pub fn due(&self) -> bool {
        self.ctl.due()
    }
    /// Ends a step without an exchange.
    pub fn local_step(&mut self) -> Result<()> {
        Ok(self.ctl.local_step()?)
    }
    /// This learner's figure: the mean of the reports since the last exchange.
    pub fn figure(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }
    /// Writes the quality layer's gradient for this exchange: this learner's
    /// figure in its column, zeros elsewhere. An error when nothing was
    /// reported since the last exchange and the frequency adjusts.
    pub fn write_figures(&self, grad: &mut [f32]) -> Result<()> {
        if grad.len() != self.learners {
            return Err(Error::Layout(format!(
                "the quality layer holds {} values, expected one per learner ({})",
                grad.len(),
                self.learners
            )));
        }
        grad.fill(0.0);
        match self.figure() {
            Some(f) => grad[self.learner] = f as f32,
            None if self.adjusts() => {
                return Err(Error::Engine(tidewire_engine::EngineError::InvalidConfig(
                    "quality-guided frequency: no quality figure was reported since the last exchange \
                     (report the loss every step)"
                        .into(),
                )))
            }
            None => {}
        }
        Ok(())
    }
    /// Ends a step with an exchange, given the quality layer's synced
    /// parameters (the servers' reduction of every learner's figures). Returns
    /// the decision; a new T is in force from the next step.
    pub fn exchanged(&mut self, synced: &[f32]) -> Result<Decision> {
        let figures = figures_of(synced, self.scale);
        self.sum = 0.0;
        self.n = 0;
        Ok(self.ctl.exchanged(&figures)?)
    }
    /// Ends a step with an exchange that carried no quality layer (a fixed T).
    pub fn exchanged_fixed(&mut self) -> Result<Decision> {
        if self.adjusts() {
            return Err(Error::Engine(tidewire_engine::EngineError::InvalidConfig(
                "quality-guided frequency: the exchange must carry the quality layer".into(),
            )));
        }
        self.sum = 0.0;
        self.n = 0;
        Ok(self.ctl.exchanged(&vec![0.0; self.learners])?)
    }
}

/// The figures from the quality layer's synced values: × `scale` (the
/// learners for a mean), in f32 then widened: every learner computes the same bits.
pub fn figures_of(synced: &[f32], scale: f32) -> Vec<f64> {
    synced.iter().map(|v| f64::from(v * scale)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_travel_one_hot_and_come_back_for_every_learner() {
        let comm = CommConfig {
            mode: CommMode::Accumulate,
            freq: FreqConfig {
                t_initial: 1,
                t_max: 4,
                period: 1,
                tolerance: 0.0,
                revert_at_step: None,
            },
        };
        let n = 3;
        let mut gs: Vec<Guide> = (0..n).map(|i| Guide::new(comm, ApplyOp::Mean, i, n).unwrap()).collect();
        let mut rows = vec![vec![0f32; n]; n];
        for (i, g) in gs.iter_mut().enumerate() {
            assert!(g.write_figures(&mut rows[i]).is_err(), "nothing reported yet");
            g.report(1.0 + i as f64);
            g.report(2.0 + i as f64);
            g.write_figures(&mut rows[i]).unwrap();
            assert_eq!(rows[i][i], 1.5 + i as f32);
        }
        // The servers: sum in rank order, then the mean.
        let mut acc = rows[0].clone();
        for r in &rows[1..] {
            tidewire_gpu::cpu::add_assign(&mut acc, r);
        }
        let mut mean = vec![0f32; n];
        tidewire_gpu::cpu::apply(ApplyOp::Mean, n, &acc, &mut mean, &mut []);
        let ds: Vec<Decision> = gs.iter_mut().map(|g| g.exchanged(&mean).unwrap()).collect();
        assert!(ds.iter().all(|d| *d == Decision::Propose { from: 1, to: 2 }), "{ds:?}");
        assert!(gs.iter().all(|g| g.t() == 2 && g.figure().is_none()));
        assert!(Guide::new(
            comm,
            ApplyOp::Sgd {
                lr: 0.1,
                momentum: 0.0,
                weight_decay: 0.0
            },
            0,
            1
        )
        .is_err());
        let avg = CommConfig {
            mode: CommMode::Average,
            ..comm
        };
        assert!(Guide::new(avg, ApplyOp::Sum, 0, 1).is_err());
        assert!(Guide::new(comm, ApplyOp::Mean, 3, 3).is_err());
    }
}
