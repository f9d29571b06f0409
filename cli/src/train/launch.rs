//! The launcher ([`launch`]): the attempts of a run and the rollback between
//! them, and the rates every rank decides with. An attempt starts its
//! processes ([`super::spawn`]), supervises them ([`super::supervise`]) and
//! builds the report ([`super::collect`]).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::args::{split_list, TrainArgs};
use super::collect;
use super::report::TrainReport;
use super::spawn::Spawner;
use super::supervise::Supervisor;
use crate::error::{Error, Result};
use crate::resilience::{self, Restart};

/// Launches the local cluster, follows it, verifies, and reports. With
/// --checkpoint-dir, a run attempt that loses a rank is rolled back: every
/// rank starts again from the newest complete checkpoint ([`resilience`]).
pub fn launch(args: &TrainArgs, node_args: Vec<String>) -> Result<TrainReport> {
    args.validate()?;
    args.ckpt.check_dirs(args.job.iters)?;
    let mut base_args = resilience::without_resume(&node_args);
    let args = &with_measured_rates(args, &mut base_args)?;
    args.check_plan()?;
    let mut kills: std::collections::VecDeque<resilience::Kill> = args.ckpt.fault_kill.iter().copied().collect();
    let mut restarts: Vec<Restart> = Vec::new();
    let mut resume = first_resume(args)?;
    loop {
        let mut attempt_args = base_args.clone();
        if let Some(r) = &resume {
            attempt_args.push("--resume".into());
            attempt_args.push(r.display().to_string());
        }
        let mut attempt_opts = args.clone();
        attempt_opts.ckpt.resume = resume.clone();
        match launch_attempt(&attempt_opts, attempt_args, &mut kills)? {
            Attempt::Done(mut r) => {
                r.restarts = restarts;
                r.resumed_from = resume.as_deref().map(resilience::step_iteration);
                return Ok(*r);
            }
            Attempt::Failed {
                cause,
                progressed,
                failed_at,
            } => {
                resume = roll_back(args, &mut restarts, resume.as_deref(), cause, progressed, failed_at)?;
            }
        }
    }
}

/// The flags with the rates every rank decides with (and the slice size
/// they give, unless set), passed to the ranks in `base_args` too.
fn with_measured_rates(args: &TrainArgs, base_args: &mut Vec<String>) -> Result<TrainArgs> {
    let mut args = args.clone();
    if let Some(r) = measured_rates(&args)? {
        let json = serde_json::to_string(&r).map_err(|e| Error::Launch(format!("rates: {e}")))?;
        base_args.push("--rates".into());
        base_args.push(json.clone());
        args.rates = Some(json);
        if args.slice_params.is_none() && args.sync_mode().sliced() {
            let p = tidewire_engine::cost::slice_params_for(&r);
            base_args.push("--slice-params".into());
            base_args.push(p.to_string());
            args.slice_params = Some(p);
        }
    }
    Ok(args)
}

/// The checkpoint the first attempt resumes (`--resume`): every rank resumes
/// the same step, so a checkpoint directory resolves to its newest one here.
fn first_resume(args: &TrainArgs) -> Result<Option<PathBuf>> {
    Ok(match &args.ckpt.resume {
        Some(r) if !r.join("manifest.json").is_file() => Some(
            tidewire::checkpoint::Loaded::newest_complete(r)
                .map_err(|e| Error::Launch(e.to_string()))?
                .ok_or_else(|| Error::Launch(format!("--resume {}: no complete checkpoint there", r.display())))?,
        ),
        r => r.clone(),
    })
}

/// After a failed attempt: the checkpoint the next one resumes, with the
/// restart recorded, or the error that ends the run (no --checkpoint-dir, no
/// iteration done, --max-restarts spent, or nothing left to run).
fn roll_back(
    args: &TrainArgs,
    restarts: &mut Vec<Restart>,
    resume: Option<&Path>,
    cause: String,
    progressed: bool,
    failed_at: Instant,
) -> Result<Option<PathBuf>> {
    let tried = if restarts.is_empty() {
        String::new()
    } else {
        format!(" (after {} rollback(s))", restarts.len())
    };
    let Some(dir) = &args.ckpt.checkpoint_dir else {
        return Err(Error::Launch(format!("the local cluster failed: {cause}")));
    };
    if !progressed {
        return Err(Error::Launch(format!(
            "the local cluster failed before its first iteration{tried}, so it is not rolled back: {cause}"
        )));
    }
    if restarts.len() as u32 >= args.ckpt.max_restarts {
        return Err(Error::Launch(format!(
            "the local cluster failed{tried}, and --max-restarts {} is spent: {cause}",
            args.ckpt.max_restarts
        )));
    }
    let resume = resilience::rollback_point(dir, resume)?;
    let from = resume.as_deref().map_or(0, resilience::step_iteration);
    if from >= args.job.iters {
        return Err(Error::Launch(format!(
            "the local cluster failed after its last checkpoint (iteration {from} of {}): the \
             parameters are in {}; nothing is left to run: {cause}",
            args.job.iters,
            dir.display()
        )));
    }
    if !args.job.json {
        eprintln!(
            "tidewire: a rank was lost ({}); rolling back to iteration {from} and restarting every rank",
            cause.lines().next().unwrap_or("")
        );
    }
    restarts.push(Restart {
        cause,
        resumed_from: from,
        checkpoint: resume.as_ref().map(|p| p.display().to_string()),
        recovery_s: failed_at.elapsed().as_secs_f64(),
    });
    Ok(resume)
}

/// The rates every rank of this launch decides HybComm (and the default
/// slice size) with: `None` where nothing is decided from them
/// (`--cost-model bytes`, a mode with neither HybComm nor slices, or
/// `--rates` given). Otherwise this machine's profile (measured
/// now, or `--profile`), shared by every rank process on it; under the
/// bandwidth harness each rank's link is the shaped one, measured between
/// the first two namespaces.
fn measured_rates(args: &TrainArgs) -> Result<Option<tidewire_engine::cost::Rates>> {
    if !args.rates_pending() {
        return Ok(None);
    }
    let profile = match &args.profile {
        Some(p) => tidewire::calibrate::Profile::load(p).map_err(|e| Error::Usage(format!("--profile: {e}")))?,
        None => tidewire::calibrate::measure(Duration::from_millis(150))
            .map_err(|e| Error::Launch(format!("measuring this machine's rates: {e}")))?,
    };
    // The GEMM at the batch a worker's factors have (K, its learners' too).
    let profile = profile.at_batch(args.batch(&args.model()?) * args.learners());
    let (_, _, world) = args.world();
    let procs = world + args.workers * args.job.local_learners.saturating_sub(1) * usize::from(!args.job.flat);
    let link = match (&args.netns, &args.netns_addrs) {
        (Some(ns), Some(addrs)) => Some(netns_link_rate(&split_list(ns), &split_list(addrs))?),
        _ => None,
    };
    Ok(Some(tidewire_engine::cost::Rates {
        // The ranks build a PS layer's gradient from factors ([`TrainArgs::agreed_rates`]).
        ps_builds_grad: true,
        ..profile.node_rates(procs, link)
    }))
}

/// One TCP stream's rate from the first namespace to the second (a probe
/// of about half a second through the shaped links), or the loopback's
/// where there is one namespace.
fn netns_link_rate(ns: &[String], addrs: &[String]) -> Result<f64> {
    if ns.len() < 2 || addrs.len() < 2 {
        return Ok(f64::MAX);
    }
    let exe = super::spawn::own_binary()?;
    let target = format!("{}:29499", addrs[1]);
    let mut server = Command::new("ip")
        .args(["netns", "exec", &ns[1]])
        .arg(&exe)
        .args(["calibrate", "--serve-stream", &target])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Launch(format!("link probe: ip netns exec {}: {e}", ns[1])))?;
    let out = Command::new("ip")
        .args(["netns", "exec", &ns[0]])
        .arg(&exe)
        .args(["calibrate", "--probe-stream", &target])
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let out = out.map_err(|e| Error::Launch(format!("link probe: ip netns exec {}: {e}", ns[0])))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| out.status.success() && v.is_finite() && *v > 0.0)
        .ok_or_else(|| {
            Error::Launch(format!(
                "link probe from {} to {target} failed: {} {}",
                ns[0],
                text.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        })
}

/// How one run attempt of the local cluster ended.
enum Attempt {
    Done(Box<TrainReport>),
    /// A rank was lost or failed: the launcher may roll back.
    Failed {
        cause: String,
        progressed: bool,
        failed_at: Instant,
    },
}

/// One attempt: starts every rank, follows them (injecting the next
/// `--fault-kill` when its iteration comes), and reports.
fn launch_attempt(
    args: &TrainArgs,
    node_args: Vec<String>,
    kills: &mut std::collections::VecDeque<resilience::Kill>,
) -> Result<Attempt> {
    let model = args.model()?;
    let (p1, p2, _) = args.world();
    let began = Instant::now();
    let spawner = Spawner::new(args, node_args)?;
    let held: std::collections::BTreeSet<u32> = kills.iter().map(|k| k.rank).collect();
    let children = spawner.spawn_all(&held)?;
    // A watchdog, not a deadline: the run is killed only when no worker has
    // finished an iteration for this long (the ranks' own timeouts catch a
    // lost peer first; a run that is slow but moving is left alone).
    let stall_limit = Duration::from_secs(args.timeout_s + 30)
        + model
            .iteration_compute(args.batch(&model), args.job.time_scale)
            .mul_f64(20.0);
    let prefix = format!("{} {}w/{}s {}", model.name, p1, p2, args.job.sync);
    let mut sup = Supervisor::new(args, began, children, held, prefix, stall_limit)?;
    sup.run(kills, &spawner)?;
    let mut ended = sup.finish();
    if let Some(cause) = ended.failed.pop() {
        return Ok(Attempt::Failed {
            cause,
            progressed: ended.progressed,
            failed_at: ended.first_failure.unwrap_or_else(Instant::now),
        });
    }
    Ok(Attempt::Done(Box::new(collect::report(args, &model, began, &ended)?)))
}
