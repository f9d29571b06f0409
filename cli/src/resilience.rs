//! `train`'s checkpoints, resume and rollback: the flags, the faults it can
//! inject, and the trainer's own state saved beside each checkpoint.
//!
//! With `--checkpoint-dir DIR --checkpoint-every N`, every rank checkpoints
//! through the library ([`tidewire::checkpoint`]). When a rank is lost, the
//! launcher stops the others, and starts every rank again from the newest
//! complete checkpoint (at most `--max-restarts` times): the job halts, rolls
//! back and continues. Under BSP with deterministic aggregation the result is
//! bitwise the uninterrupted run's (`--verify` checks it).
//!
//! ```text
//! tidewire train --model vgg19-mini --iters 20 --verify \
//!     --checkpoint-dir /tmp/ckpt --checkpoint-every 4 \
//!     --fault-kill 1@5 --fault-kill 2@5     # a worker, then a server: SIGKILL at iteration 5
//! tidewire train --model vgg19-mini --iters 40 --resume /tmp/ckpt   # go on from the newest one
//! ```

use std::path::{Path, PathBuf};

use clap::Args;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The checkpoint and fault flags of `tidewire train`.
#[derive(Args, Debug, Clone, Default, Serialize, Deserialize)]
pub struct CheckpointArgs {
    /// Checkpoint into this directory (servers' optimizer state and worker
    /// 0's parameters as safetensors, in `step-NNNNNNNN/`), and roll back to the
    /// newest complete checkpoint when a rank is lost. A fresh run refuses a
    /// directory that already holds checkpoints (use --resume).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many iterations.
    #[arg(long, default_value_t = 100)]
    pub checkpoint_every: u64,
    /// Complete checkpoints kept (older ones are removed).
    #[arg(long, default_value_t = 2)]
    pub checkpoint_keep: usize,
    /// Start from a checkpoint: a step directory, or a checkpoint directory
    /// (its newest complete one). Later checkpoints in --checkpoint-dir are removed.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// With --checkpoint-dir: how many times a lost rank may restart the job
    /// from the newest checkpoint before the run fails.
    #[arg(long, default_value_t = 3)]
    pub max_restarts: u32,
    /// Fault injection: SIGKILL rank R once a worker reports iteration I
    /// (`R@I`) and the checkpoint due by then is complete. Repeatable: the
    /// faults fire one per run attempt, in order.
    #[arg(long = "fault-kill", value_parser = parse_kill)]
    pub fault_kill: Vec<Kill>,
}

/// A fault to inject: SIGKILL `rank` at iteration `iter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kill {
    /// The rank killed.
    pub rank: u32,
    /// When a worker reports this iteration.
    pub iter: u64,
}

fn parse_kill(s: &str) -> std::result::Result<Kill, String> {
    let (r, i) = s
        .split_once('@')
        .ok_or_else(|| format!("{s:?}: give RANK@ITERATION, e.g. 1@5"))?;
    Ok(Kill {
        rank: r.trim().parse().map_err(|_| format!("{r:?} is not a rank"))?,
        iter: i.trim().parse().map_err(|_| format!("{i:?} is not an iteration"))?,
    })
}

impl CheckpointArgs {
    /// Whether the job checkpoints.
    pub fn active(&self) -> bool {
        self.checkpoint_dir.is_some()
    }
    /// The library's settings for a rank (the trainer saves its own state too).
    pub fn config(&self) -> Option<tidewire::checkpoint::Checkpointing> {
        self.checkpoint_dir
            .as_ref()
            .map(|d| tidewire::checkpoint::Checkpointing {
                dir: d.clone(),
                every: self.checkpoint_every,
                keep: self.checkpoint_keep,
                framework_state: true,
            })
    }
    /// Checks the flags against the run's.
    /// Checks the flags against the run's; `bsp_all`: BSP with the `all` trigger.
    pub fn validate(&self, world: usize, iters: u64, local_learners: usize, comm: bool, bsp_all: bool) -> Result<()> {
        if self.checkpoint_every == 0 {
            return Err(Error::Usage("--checkpoint-every must be at least 1".into()));
        }
        if self.checkpoint_keep == 0 {
            return Err(Error::Usage("--checkpoint-keep must be at least 1".into()));
        }
        if (self.active() || self.resume.is_some()) && local_learners > 1 {
            return Err(Error::Usage(
                "--checkpoint-dir/--resume with --local-learners is not supported yet".into(),
            ));
        }
        if self.active() && !bsp_all {
            return Err(Error::Usage(
                "--checkpoint-dir needs BSP and --trigger all: under SSP a worker's parameters lag the \
                 servers' optimizer state, and under the other triggers the servers' rounds are not the \
                 workers' iterations, so a checkpoint's files would not be of one iteration"
                    .into(),
            ));
        }
        if (self.active() || self.resume.is_some()) && comm {
            return Err(Error::Usage(
                "--checkpoint-dir/--resume with --comm-every or --freq-max is not supported: the \
                 accumulated gradients are the learners' state"
                    .into(),
            ));
        }
        if !self.fault_kill.is_empty() && !self.active() {
            return Err(Error::Usage(
                "--fault-kill needs --checkpoint-dir: without checkpoints a lost rank ends the run".into(),
            ));
        }
        for k in &self.fault_kill {
            if k.rank as usize >= world {
                return Err(Error::Usage(format!(
                    "--fault-kill {}@{}: there are {world} ranks",
                    k.rank, k.iter
                )));
            }
            if k.iter == 0 || k.iter >= iters {
                return Err(Error::Usage(format!(
                    "--fault-kill {}@{}: workers report iterations 1..{}",
                    k.rank,
                    k.iter,
                    iters.saturating_sub(1)
                )));
            }
        }
        if let Some(r) = &self.resume {
            if !r.exists() {
                return Err(Error::Usage(format!("--resume {}: no such directory", r.display())));
            }
        }
        Ok(())
    }
}

impl CheckpointArgs {
    /// The launcher's checks of the directories, before any rank starts: a
    /// fresh run refuses a directory with checkpoints, and a resume needs a
    /// complete checkpoint before `iters`.
    pub fn check_dirs(&self, iters: u64) -> Result<()> {
        use tidewire::checkpoint::Loaded;
        let launch = |e: tidewire::Error| Error::Launch(e.to_string());
        if let (Some(dir), None) = (&self.checkpoint_dir, &self.resume) {
            if let Some(p) = Loaded::newest_complete(dir).map_err(launch)? {
                return Err(Error::Usage(format!(
                    "--checkpoint-dir {} already holds checkpoints ({}): add --resume {} to go on from it, \
                     or checkpoint into another directory",
                    dir.display(),
                    p.display(),
                    dir.display()
                )));
            }
        }
        if let Some(r) = &self.resume {
            let step = if r.join("manifest.json").is_file() {
                r.clone()
            } else {
                Loaded::newest_complete(r)
                    .map_err(launch)?
                    .ok_or_else(|| Error::Usage(format!("--resume {}: no complete checkpoint there", r.display())))?
            };
            let k = step_iteration(&step);
            if k >= iters {
                return Err(Error::Usage(format!(
                    "--resume {}: the checkpoint is of iteration {k}, and --iters is {iters}: raise --iters to go on",
                    step.display()
                )));
            }
        }
        Ok(())
    }
}

/// The trainer's own state, saved beside every checkpoint by worker 0 (the
/// framework state of [`tidewire::checkpoint`]): what must match for a
/// resumed run to be the same run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// The iteration the checkpoint is of.
    pub iteration: u64,
    /// The model profile.
    pub model: String,
    /// The synthetic gradients' seed.
    pub seed: u64,
    /// Samples per worker per iteration.
    pub batch: usize,
    /// Workers.
    pub workers: usize,
}

impl TrainerState {
    /// Refuses a checkpoint of another run.
    pub fn check(&self, want: &TrainerState) -> Result<()> {
        let mut theirs = self.clone();
        theirs.iteration = want.iteration;
        if &theirs != want {
            return Err(Error::Usage(format!(
                "the checkpoint is of another run ({self:?}); this one is {want:?}"
            )));
        }
        Ok(())
    }
}

/// What a run's checkpoints cost, over its ranks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointSummary {
    /// --checkpoint-every.
    pub every: u64,
    /// The checkpoints written in this attempt (by worker 0, whose part is the model).
    pub written: Vec<u64>,
    /// The most seconds any rank's training path spent copying snapshots.
    pub copy_s: f64,
    /// Seconds the ranks' checkpoint threads spent writing, in all.
    pub write_s: f64,
    /// Bytes written, over all ranks.
    pub bytes: u64,
    /// Checkpoint writes that failed (rank: why); the run went on.
    #[serde(default)]
    pub failed: Vec<String>,
    /// `copy_s` over the attempt's training time (mean iteration × iterations):
    /// the fraction of the iteration time the checkpoints cost.
    pub cost_fraction: f64,
}

impl CheckpointSummary {
    /// Sums the ranks' counters (`(rank, its counters)`); `iteration_s × iters` is the training time.
    pub fn of(
        ranks: &[(u32, &tidewire::checkpoint::CheckpointStats)],
        ckpt: &CheckpointArgs,
        iteration_s: f64,
        iters: usize,
    ) -> Self {
        let stats: Vec<&tidewire::checkpoint::CheckpointStats> = ranks.iter().map(|r| r.1).collect();
        let copy_s = stats.iter().map(|c| c.copy_s).fold(0.0, f64::max);
        let written = ranks
            .iter()
            .find(|r| r.0 == 0)
            .map(|r| r.1.written.clone())
            .unwrap_or_default();
        CheckpointSummary {
            every: ckpt.checkpoint_every,
            written,
            copy_s,
            write_s: stats.iter().map(|c| c.write_s).sum(),
            bytes: stats.iter().map(|c| c.bytes).sum(),
            failed: ranks
                .iter()
                .flat_map(|(r, c)| c.failed.iter().map(move |f| format!("rank {r}: {f}")))
                .collect(),
            cost_fraction: copy_s / (iteration_s * iters as f64).max(f64::MIN_POSITIVE),
        }
    }
}

/// A worker the launcher removed as a straggler.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Removed {
    /// Its rank.
    pub rank: u32,
    /// Why: its progress against the median's.
    pub why: String,
    /// The iteration boundary it left at.
    pub left_at: Option<u64>,
    /// With --replace-stragglers: the iterations its replacement was started for.
    #[serde(default)]
    pub replaced_for: Option<u64>,
}

/// The coordinator's straggler rule (--remove-stragglers FACTOR): once the
/// median worker has done --straggler-window iterations, a worker whose
/// progress is under 1/FACTOR of the median's is removed; never so many that
/// the trigger's quorum could not be met (nor the last worker).
#[derive(Debug)]
pub struct StragglerWatch {
    factor: Option<f64>,
    window: u64,
    workers: usize,
    quorum: usize,
    /// Removed so far.
    pub removed: Vec<Removed>,
}

impl StragglerWatch {
    /// `factor` (None: off) and `window` as the flags give them, for `workers`
    /// worker ranks (0..workers) under `trigger`.
    pub fn new(factor: Option<f64>, window: u64, workers: usize, trigger: tidewire_engine::Trigger) -> Self {
        let quorum = match trigger {
            tidewire_engine::Trigger::Quorum(k) => k as usize,
            _ => 1,
        };
        StragglerWatch {
            factor,
            window: window.max(1),
            workers,
            quorum,
            removed: Vec::new(),
        }
    }

    /// The workers to remove now, given every rank's latest iteration.
    pub fn judge(&mut self, progress: &[u64]) -> Vec<u32> {
        let Some(f) = self.factor else { return Vec::new() };
        let live: Vec<u32> = (0..self.workers as u32)
            .filter(|r| !self.removed.iter().any(|x| x.rank == *r))
            .collect();
        let mut its: Vec<u64> = live
            .iter()
            .map(|&r| progress.get(r as usize).copied().unwrap_or(0))
            .collect();
        its.sort_unstable();
        let Some(&median) = its.get(its.len() / 2) else {
            return Vec::new();
        };
        if median < self.window {
            return Vec::new();
        }
        let mut out = Vec::new();
        // Rank 0 coordinates the job (it hosts the rendezvous a replacement needs): never removed.
        for r in live.into_iter().filter(|&r| r != 0) {
            let p = progress.get(r as usize).copied().unwrap_or(0);
            let left = self.workers - self.removed.len();
            if (p as f64) * f <= median as f64 && left > self.quorum.max(1) {
                self.removed.push(Removed {
                    rank: r,
                    why: format!("at iteration {p} when the median worker was at {median} (under 1/{f})"),
                    left_at: None,
                    replaced_for: None,
                });
                out.push(r);
            }
        }
        out
    }
}

/// One rollback of the launcher.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Restart {
    /// Why the run attempt ended.
    pub cause: String,
    /// The iteration the next attempt resumed from (0: from the start).
    pub resumed_from: u64,
    /// The checkpoint directory it resumed from.
    pub checkpoint: Option<String>,
    /// Seconds from the failure to the next attempt's start (the others'
    /// grace period to report the loss, and the rollback).
    pub recovery_s: f64,
}

/// The node arguments without `--resume` (the launcher gives each attempt its own).
pub fn without_resume(node_args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(node_args.len());
    let mut skip = false;
    for a in node_args {
        if skip {
            skip = false;
            continue;
        }
        if a == "--resume" {
            skip = true;
        } else if !a.starts_with("--resume=") {
            out.push(a.clone());
        }
    }
    out
}

/// Where the next attempt starts: the newest complete checkpoint in `dir`
/// made since the failed attempt's own start `resumed` (a checkpoint older
/// than that would be another run's), else that start again (`None`: the
/// very beginning).
pub fn rollback_point(dir: &Path, resumed: Option<&Path>) -> Result<Option<PathBuf>> {
    let newest = tidewire::checkpoint::Loaded::newest_complete(dir).map_err(|e| Error::Launch(e.to_string()))?;
    let from = resumed.map_or(0, step_iteration);
    Ok(match newest {
        Some(p) if step_iteration(&p) > from || resumed.is_none() => Some(p),
        _ => resumed.map(Path::to_path_buf),
    })
}

/// Whether a `--fault-kill` at iteration `iter` may fire: once the newest
/// checkpoint due by then is complete, so that where a fault rolls back to
/// does not depend on how fast the checkpoint thread wrote (a test's
/// determinism). It fires anyway 10 s after `began`, when the kill's
/// iteration came.
pub fn due_checkpoint_done(ckpt: &CheckpointArgs, iter: u64, began: std::time::Instant) -> bool {
    let Some(dir) = &ckpt.checkpoint_dir else {
        return true;
    };
    let due = iter / ckpt.checkpoint_every * ckpt.checkpoint_every;
    let resumed = ckpt.resume.as_deref().map_or(0, step_iteration);
    if due <= resumed || began.elapsed() > std::time::Duration::from_secs(10) {
        return true;
    }
    matches!(
        tidewire::checkpoint::Loaded::newest_complete(dir),
        Ok(Some(p)) if step_iteration(&p) >= due
    )
}

/// The iteration of a checkpoint: its manifest's, else its directory's name
/// (`step-00000012` → 12), else 0.
pub fn step_iteration(step: &Path) -> u64 {
    let manifest = std::fs::read(step.join("manifest.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|m| m.get("iteration")?.as_u64());
    manifest.unwrap_or_else(|| {
        step.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    })
}

/// Set by the launcher on a rank that a `--fault-kill` targets: once done,
/// the rank waits until its stdin closes (see
/// [`hold_until_released`](crate::train::pipe::hold_until_released)).
pub const HOLD_ENV: &str = "TIDEWIRE_HOLD_EXIT";

/// Whether this rank is a `--fault-kill`'s target ([`HOLD_ENV`]).
pub fn held() -> bool {
    std::env::var_os(HOLD_ENV).is_some_and(|v| v == "1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_straggler_rule_keeps_rank_0_and_the_quorum() {
        use tidewire_engine::Trigger;
        let mut w = StragglerWatch::new(Some(2.0), 5, 4, Trigger::Quorum(3));
        assert!(
            w.judge(&[4, 0, 4, 4]).is_empty(),
            "the median has not done the window yet"
        );
        assert_eq!(w.judge(&[6, 2, 6, 6]), vec![1]);
        assert!(
            w.judge(&[9, 2, 9, 1]).is_empty(),
            "a second removal would leave fewer than the quorum"
        );
        let mut w = StragglerWatch::new(Some(2.0), 5, 4, Trigger::Async);
        assert!(w.judge(&[1, 8, 8, 8]).is_empty(), "rank 0 is never removed");
        assert_eq!(w.judge(&[8, 8, 3, 2]), vec![2, 3]);
        let mut off = StragglerWatch::new(None, 5, 4, Trigger::Async);
        assert!(off.judge(&[9, 0, 9, 9]).is_empty());
    }

    #[test]
    fn kill_flags_parse_and_resume_is_stripped() {
        assert_eq!(parse_kill("2@5"), Ok(Kill { rank: 2, iter: 5 }));
        assert!(parse_kill("2").is_err());
        assert!(parse_kill("x@5").is_err());
        let a: Vec<String> = ["--iters", "9", "--resume", "/x", "--resume=/y", "--verify"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(without_resume(&a), vec!["--iters", "9", "--verify"]);
    }
}
