//! The launcher ([`launch`]): starts the local cluster, follows and supervises
//! its ranks, rolls back, verifies, and builds the report.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::args::{split_list, TrainArgs};
use super::comm;
use super::reference::reference;
use super::report::{AggregationShare, IterStat, LayerRow, NodeResult, SparseSummary, TrainReport};
use crate::error::{Error, Result};
use crate::resilience::{self, Restart};

fn free_port() -> Result<u16> {
    let no_port = |e: std::io::Error| Error::Launch(format!("no free rendezvous port on 127.0.0.1: {e}"));
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(no_port)?;
    Ok(l.local_addr().map_err(no_port)?.port())
}

fn secret() -> String {
    let mut b = [0u8; 16];
    if getrandom::getrandom(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        b = (t.as_nanos() ^ u128::from(std::process::id())).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The environment of node `node`'s local learners: the shared file (in
/// /dev/shm where it exists) and this run's nonce.
fn local_env(c: &mut Command, node: usize, secret: &str) {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let nonce = u64::from_str_radix(&secret[..16.min(secret.len())], 16).unwrap_or(1);
    c.env("TIDEWIRE_LOCAL_NODE", node.to_string())
        .env(
            "TIDEWIRE_LOCAL_PATH",
            dir.join(format!("tidewire-train-{}-{node}", &secret[..12.min(secret.len())])),
        )
        .env("TIDEWIRE_LOCAL_NONCE", nonce.to_string());
}

/// Launches the local cluster, follows it, verifies, and reports. With
/// --checkpoint-dir, a run attempt that loses a rank is rolled back: every
/// rank starts again from the newest complete checkpoint ([`resilience`]).
pub fn launch(args: &TrainArgs, node_args: Vec<String>) -> Result<TrainReport> {
    args.validate()?;
    args.ckpt.check_dirs(args.iters)?;
    let mut base_args = resilience::without_resume(&node_args);
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
    let args = &args;
    let mut kills: std::collections::VecDeque<resilience::Kill> = args.ckpt.fault_kill.iter().copied().collect();
    let mut restarts: Vec<Restart> = Vec::new();
    let mut resume: Option<std::path::PathBuf> = match &args.ckpt.resume {
        // Every rank resumes the same step: resolve a checkpoint directory to its newest one here.
        Some(r) if !r.join("manifest.json").is_file() => Some(
            tidewire::checkpoint::Loaded::newest_complete(r)
                .map_err(|e| Error::Launch(e.to_string()))?
                .ok_or_else(|| Error::Launch(format!("--resume {}: no complete checkpoint there", r.display())))?,
        ),
        r => r.clone(),
    };
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
                resume = resilience::rollback_point(dir, resume.as_deref())?;
                let from = resume.as_deref().map_or(0, resilience::step_iteration);
                if from >= args.iters {
                    return Err(Error::Launch(format!(
                        "the local cluster failed after its last checkpoint (iteration {from} of {}): the \
                         parameters are in {}; nothing is left to run: {cause}",
                        args.iters,
                        dir.display()
                    )));
                }
                if !args.json {
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
            }
        }
    }
}

/// The rates every rank of this launch decides HybComm (and the default
/// slice size) with: `None` where nothing is decided from them
/// (`--cost-model bytes`, a mode with neither HybComm nor slices, or
/// `--rates` given). Otherwise this machine's profile (measured
/// now, or `--profile`), shared by every rank process on it; under the
/// bandwidth harness each rank's link is the shaped one, measured between
/// the first two namespaces.
fn measured_rates(args: &TrainArgs) -> Result<Option<tidewire_engine::cost::Rates>> {
    if args.cost_model == "bytes"
        || args.rates.is_some()
        || args.comm.active()
        || (args.sync_mode().policy() != tidewire_engine::SchemePolicy::Hybrid && !args.sync_mode().sliced())
    {
        return Ok(None);
    }
    let profile = match &args.profile {
        Some(p) => tidewire::calibrate::Profile::load(p).map_err(|e| Error::Usage(format!("--profile: {e}")))?,
        None => tidewire::calibrate::measure(Duration::from_millis(150))
            .map_err(|e| Error::Launch(format!("measuring this machine's rates: {e}")))?,
    };
    let (_, _, world) = args.world();
    let procs = world + args.workers * args.local_learners.saturating_sub(1) * usize::from(!args.flat);
    let link = match (&args.netns, &args.netns_addrs) {
        (Some(ns), Some(addrs)) => Some(netns_link_rate(&split_list(ns), &split_list(addrs))?),
        _ => None,
    };
    Ok(Some(profile.node_rates(procs, link)))
}

/// One TCP stream's rate from the first namespace to the second (a probe
/// of about half a second through the shaped links), or the loopback's
/// where there is one namespace.
fn netns_link_rate(ns: &[String], addrs: &[String]) -> Result<f64> {
    if ns.len() < 2 || addrs.len() < 2 {
        return Ok(f64::MAX);
    }
    let exe = std::env::current_exe().map_err(|e| Error::Launch(format!("cannot find my own binary: {e}")))?;
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
    let (p1, p2, world) = args.world();
    let began = Instant::now();
    let exe = std::env::current_exe().map_err(|e| Error::Launch(format!("cannot find my own binary: {e}")))?;
    let secret = secret();
    // Under the bandwidth harness each rank runs in a namespace of its own (round robin),
    // and rank 0's namespace address is the rendezvous; a fresh namespace has every port free.
    let netns = match (&args.netns, &args.netns_addrs) {
        (Some(ns), Some(a)) => Some((split_list(ns), split_list(a))),
        _ => None,
    };
    let master = match &netns {
        Some((_, addrs)) => format!("{}:29500", addrs[0]),
        None => format!("127.0.0.1:{}", free_port()?),
    };
    let mut children: Vec<(u32, Child)> = Vec::new();
    // A rank's process (a replacement's too): its namespace under the
    // bandwidth harness, its place in the job, its output piped to us.
    let rank_command = |rank: u32| -> Command {
        let mut c = match &netns {
            Some((ns, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns[rank as usize % ns.len()]]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        c.arg("train-node")
            .args(&node_args)
            .env("TIDEWIRE_RANK", rank.to_string())
            .env("TIDEWIRE_WORLD_SIZE", world.to_string())
            .env("TIDEWIRE_MASTER", &master)
            .env("TIDEWIRE_SECRET", &secret)
            .env("TIDEWIRE_JOB", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if args.colocate {
            c.env_remove("TIDEWIRE_SERVERS");
        } else {
            c.env("TIDEWIRE_SERVERS", p2.to_string());
        }
        c
    };
    let held: std::collections::BTreeSet<u32> = kills.iter().map(|k| k.rank).collect();
    for rank in 0..world as u32 {
        let mut c = rank_command(rank);
        // With --remove-stragglers a worker reads `leave` from its stdin; a
        // --fault-kill's target waits, done, until its stdin closes, so that
        // the kill finds it running however fast the run ends.
        if held.contains(&rank) {
            c.env(resilience::HOLD_ENV, "1");
        }
        c.stdin(
            if (args.remove_stragglers.is_some() && (rank as usize) < p1) || held.contains(&rank) {
                Stdio::piped()
            } else {
                Stdio::null()
            },
        );
        let hier = args.local_learners > 1 && !args.flat;
        if hier && (rank as usize) < p1 {
            c.env("TIDEWIRE_LOCAL_RANK", "0");
            local_env(&mut c, rank as usize, &secret);
        }
        let child = c
            .spawn()
            .map_err(|e| Error::Launch(format!("cannot start rank {rank}: {e}")))?;
        children.push((rank, child));
    }
    // Local learners 1..L of every node: processes that are not ranks. They
    // take "rank" numbers after the ranks' for the launcher's bookkeeping only.
    if args.local_learners > 1 && !args.flat {
        for node in 0..p1 {
            for j in 1..args.local_learners {
                let mut c = match &netns {
                    Some((ns, _)) => {
                        let mut c = Command::new("ip");
                        c.args(["netns", "exec", &ns[node % ns.len()]]).arg(&exe);
                        c
                    }
                    None => Command::new(&exe),
                };
                c.arg("train-node")
                    .args(&node_args)
                    .env("TIDEWIRE_LOCAL_RANK", j.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                local_env(&mut c, node, &secret);
                let id = (world + node * (args.local_learners - 1) + j - 1) as u32;
                let child = c
                    .spawn()
                    .map_err(|e| Error::Launch(format!("cannot start local learner {j} of node {node}: {e}")))?;
                children.push((id, child));
            }
        }
    }
    let ranks = world;
    let world = children.len();
    // Local learners are not ranks: name them by node and local rank.
    let who = |id: u32| -> String {
        let id = id as usize;
        if id < ranks {
            format!("rank {id}")
        } else {
            let per = args.local_learners.saturating_sub(1).max(1);
            format!(
                "local learner {} of node {}",
                (id - ranks) % per + 1,
                (id - ranks) / per
            )
        }
    };
    let bar = indicatif::ProgressBar::new(args.iters);
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} iterations, {elapsed} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("{} {}w/{}s {}", model.name, p1, p2, args.sync));
    // Read every child's output on its own thread; rank 0's progress drives the bar.
    let mut readers = Vec::new();
    // When a worker last reported an iteration (ms since `began`), and the furthest one.
    let last_progress = Arc::new(AtomicU64::new(0));
    let max_iter = Arc::new(AtomicU64::new(0));
    // Each worker's latest iteration (the coordinator's view, for --remove-stragglers).
    let progress: Arc<Vec<AtomicU64>> = Arc::new((0..world).map(|_| AtomicU64::new(0)).collect());
    let mut removal =
        resilience::StragglerWatch::new(args.remove_stragglers, args.straggler_window, p1, args.trigger()?);
    let mut stdins: Vec<(u32, std::process::ChildStdin)> = children
        .iter_mut()
        .filter_map(|(r, c)| Some((*r, c.stdin.take()?)))
        .collect();
    let mut err_readers = Vec::new();
    // Follows a rank's output on two threads: progress and the result on
    // stdout (rank 0's progress drives the bar), warnings and a tail of stderr.
    let follow = |rank: u32,
                  child: &mut Child,
                  readers: &mut Vec<std::thread::JoinHandle<Option<NodeResult>>>,
                  err_readers: &mut Vec<std::thread::JoinHandle<(u32, String, Vec<String>)>>| {
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let bar = bar.clone();
        let last = last_progress.clone();
        let furthest = max_iter.clone();
        let mine = progress.clone();
        readers.push(std::thread::spawn(move || {
            let mut result = None;
            for line in BufReader::new(stdout).lines().map_while(std::result::Result::ok) {
                if line.starts_with("progress ") || line.starts_with("result ") {
                    last.store(began.elapsed().as_millis() as u64, Ordering::Relaxed);
                }
                if let Some(p) = line.strip_prefix("progress ") {
                    furthest.fetch_max(p.trim().parse().unwrap_or(0), Ordering::Relaxed);
                    if let Some(m) = mine.get(rank as usize) {
                        m.fetch_max(p.trim().parse().unwrap_or(0), Ordering::Relaxed);
                    }
                    if rank == 0 {
                        bar.set_position(p.trim().parse().unwrap_or(0));
                    }
                } else if let Some(j) = line.strip_prefix("result ") {
                    result = serde_json::from_str::<NodeResult>(j).ok();
                }
            }
            result
        }));
        err_readers.push(std::thread::spawn(move || {
            let mut tail = String::new();
            let mut warnings = Vec::new();
            for line in BufReader::new(stderr).lines().map_while(std::result::Result::ok) {
                if line.contains("WARN") || line.contains("ERROR") {
                    warnings.push(format!("rank {rank}: {line}"));
                }
                tail.push_str(&line);
                tail.push('\n');
                if tail.len() > 8192 {
                    tail.drain(..tail.len() - 8192);
                }
            }
            (rank, tail, warnings)
        }));
    };
    for (rank, child) in children.iter_mut() {
        follow(*rank, child, &mut readers, &mut err_readers);
    }
    let mut replaced: Vec<u32> = Vec::new();
    // A watchdog, not a deadline: the run is killed only when no worker has
    // finished an iteration for this long (the ranks' own timeouts catch a
    // lost peer first; a run that is slow but moving is left alone).
    let stall_limit = Duration::from_secs(args.timeout_s + 30)
        + model
            .iteration_compute(args.batch(&model), args.time_scale)
            .mul_f64(20.0);
    let mut failed: Vec<String> = Vec::new();
    let mut statuses = vec![None; world];
    let mut first_failure: Option<Instant> = None;
    let mut killed = false;
    // When the pending kill's iteration came (its checkpoint wait counts from there).
    let mut kill_due: Option<Instant> = None;
    while statuses.iter().any(Option::is_none) {
        // Fault injection: the next --fault-kill, once a worker reports its iteration.
        if let Some(k) = kills.front().copied().filter(|_| !killed) {
            let came = max_iter.load(Ordering::Relaxed) >= k.iter;
            if came {
                kill_due.get_or_insert_with(Instant::now);
            }
            if came && resilience::due_checkpoint_done(&args.ckpt, k.iter, kill_due.unwrap_or(began)) {
                kill_due = None;
                kills.pop_front();
                // Only a rank still running is killed (one that finished has nothing to lose).
                if let Some((_, c)) = children.iter_mut().find(|(r, _)| *r == k.rank) {
                    if matches!(c.try_wait(), Ok(None)) {
                        let _ = c.kill();
                        failed.push(format!(
                            "rank {} was killed (SIGKILL) at iteration {} by --fault-kill",
                            k.rank,
                            max_iter.load(Ordering::Relaxed)
                        ));
                        killed = true;
                        first_failure.get_or_insert_with(Instant::now);
                    }
                }
            }
        }
        // A held rank (a --fault-kill's target, done and waiting) is let go
        // once no kill of this attempt can reach it: its stdin closes.
        stdins.retain(|(r, _)| !held.contains(r) || (!killed && kills.iter().any(|k| k.rank == *r)));
        // The coordinator: a worker far behind the median leaves at its next boundary.
        let now: Vec<u64> = progress.iter().map(|p| p.load(Ordering::Relaxed)).collect();
        for r in removal.judge(&now) {
            if let Some((_, pipe)) = stdins.iter_mut().find(|(x, _)| *x == r) {
                let _ = writeln!(pipe, "leave");
                let _ = pipe.flush();
            }
        }
        let mut gone: Vec<u32> = Vec::new();
        for (i, (rank, child)) in children.iter_mut().enumerate() {
            if statuses[i].is_none() {
                if let Ok(Some(st)) = child.try_wait() {
                    if !st.success() {
                        failed.push(format!("{} exited with {st}", who(*rank)));
                        first_failure.get_or_insert_with(Instant::now);
                    }
                    statuses[i] = Some(st);
                    gone.push(*rank);
                }
            }
        }
        // --replace-stragglers: a removed worker that left gets a replacement.
        for r in gone {
            let removed = removal.removed.iter().any(|x| x.rank == r);
            if args.replace_stragglers && removed && !replaced.contains(&r) && failed.is_empty() {
                let now: Vec<u64> = progress.iter().map(|p| p.load(Ordering::Relaxed)).collect();
                let mut live: Vec<u64> = (0..p1).filter(|&w| w != r as usize).map(|w| now[w]).collect();
                live.sort_unstable();
                // The rounds left, less a margin for the time it takes to join:
                // it must not outlast the others (a round only it fed would strand).
                let n = args.iters.saturating_sub(live.last().copied().unwrap_or(0) + 3);
                if n == 0 {
                    continue;
                }
                let mut c = rank_command(r);
                c.env("TIDEWIRE_REPLACEMENT_ITERS", n.to_string()).stdin(Stdio::null());
                let mut child = c
                    .spawn()
                    .map_err(|e| Error::Launch(format!("cannot start a replacement for rank {r}: {e}")))?;
                follow(r, &mut child, &mut readers, &mut err_readers);
                children.push((r, child));
                statuses.push(None);
                replaced.push(r);
                if let Some(x) = removal.removed.iter_mut().find(|x| x.rank == r) {
                    x.replaced_for = Some(n);
                }
            }
        }
        // A rollback restarts every rank: once one failed, give the others a
        // moment to report the loss themselves, then stop them.
        if args.ckpt.active() && first_failure.is_some_and(|t| t.elapsed() > Duration::from_secs(3)) {
            for (i, (_, c)) in children.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    let _ = c.kill();
                }
            }
        }
        let since = began
            .elapsed()
            .saturating_sub(Duration::from_millis(last_progress.load(Ordering::Relaxed)));
        if since > stall_limit {
            for (_, c) in children.iter_mut() {
                let _ = c.kill();
            }
            failed.push(format!(
                "no worker finished an iteration for {stall_limit:?}, so the run was killed (raise --timeout-s for a slower run)"
            ));
            break;
        }
        // A pending fault is injected within a couple of milliseconds of its iteration.
        std::thread::sleep(Duration::from_millis(if kills.is_empty() || killed { 20 } else { 2 }));
    }
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
    bar.finish_and_clear();
    let results: Vec<NodeResult> = readers.into_iter().filter_map(|r| r.join().ok().flatten()).collect();
    let stderr_tails: Vec<(u32, String, Vec<String>)> = err_readers.into_iter().filter_map(|r| r.join().ok()).collect();
    if !failed.is_empty() {
        let mut msg = failed.join("; ");
        for (rank, tail, _) in stderr_tails.iter().filter(|(_, t, _)| !t.is_empty()) {
            msg.push_str(&format!("\n--- {} stderr ---\n{}", who(*rank), tail.trim_end()));
        }
        // A run that failed before any iteration would fail again the same way
        // (a setup error): only a run that got going is rolled back.
        let progressed = max_iter.load(Ordering::Relaxed) > 0 || killed;
        return Ok(Attempt::Failed {
            cause: msg,
            progressed,
            failed_at: first_failure.unwrap_or_else(Instant::now),
        });
    }
    // A removed worker's result is apart; its replacement, if any, reports as its rank.
    let workers: Vec<&NodeResult> = results
        .iter()
        .filter(|r| r.worker && r.local.is_none() && r.removed_at.is_none())
        .collect();
    let p1 = p1 - removal.removed.len() + replaced.len();
    if workers.len() != p1 {
        return Err(Error::Launch(format!(
            "{} of {p1} workers reported a result",
            workers.len()
        )));
    }
    let learners: Vec<&NodeResult> = results.iter().filter(|r| r.local.is_some()).collect();
    let want_learners = if args.flat { 0 } else { p1 * (args.local_learners - 1) };
    if learners.len() != want_learners {
        return Err(Error::Launch(format!(
            "{} of {want_learners} local learners reported a result",
            learners.len()
        )));
    }
    let book = args.book(&model, args.cluster()?)?;
    // The slowest worker's iterations.
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
    let spans: Vec<f64> = steady
        .iter()
        .filter(|i| i.sync_span_s > 0.0)
        .map(|i| (1.0 - i.exposed_s / i.sync_span_s).clamp(0.0, 1.0))
        .collect();
    let hidden_fraction = if spans.is_empty() {
        0.0
    } else {
        spans.iter().sum::<f64>() / spans.len() as f64
    };
    let (verified, mismatched_layers) = if args.verify {
        let want = if args.comm.active() {
            comm::reference(args, &model, p1)?
        } else {
            reference(args, &book)?
        };
        let mut bad: Vec<String> = Vec::new();
        for w in workers.iter().chain(&learners) {
            for (l, d) in w.digests.iter().enumerate() {
                if want.get(l) != Some(d) && !bad.contains(&model.layers[l].name) {
                    bad.push(model.layers[l].name.clone());
                }
            }
            if w.digests.len() != want.len() {
                bad.push(format!("rank {} reported {} layers", w.rank, w.digests.len()));
            }
        }
        (Some(bad.is_empty()), bad)
    } else {
        (None, vec![])
    };
    let k = args.batch(&model);
    let checkpoint = args.ckpt.active().then(|| {
        let ranks: Vec<(u32, &tidewire::checkpoint::CheckpointStats)> = results
            .iter()
            .filter_map(|r| Some((r.rank, r.checkpoint.as_ref()?)))
            .collect();
        resilience::CheckpointSummary::of(&ranks, &args.ckpt, iteration_s, per.len())
    });
    let mut by_rank: Vec<&NodeResult> = workers.clone();
    by_rank.sort_by_key(|r| r.rank);
    drop(stdins);
    let mut removed = removal.removed;
    for x in removed.iter_mut() {
        x.left_at = results
            .iter()
            .find(|w| w.rank == x.rank && w.removed_at.is_some())
            .and_then(|w| w.removed_at);
    }
    Ok(Attempt::Done(Box::new(TrainReport {
        removed,
        trigger: args.trigger.clone(),
        worker_iteration_s: by_rank
            .iter()
            .map(|r| r.iters.iter().map(|i| i.seconds).sum::<f64>() / r.iters.len().max(1) as f64)
            .collect(),
        dropped: results.iter().map(|r| r.stats.dropped).sum(),
        late_folded: results.iter().map(|r| r.stats.late_folded).sum(),
        partial_applies: results.iter().map(|r| r.stats.partial_applies).sum(),
        checkpoint,
        restarts: Vec::new(),
        resumed_from: None,
        log_warnings: stderr_tails.into_iter().flat_map(|(_, _, w)| w).collect(),
        slice_params: book.config().slice_params,
        aggregation: AggregationShare {
            cpu_bytes: results.iter().map(|r| r.stats.cpu_aggregated_bytes).sum(),
            gpu_bytes: results.iter().map(|r| r.stats.gpu_aggregated_bytes).sum(),
            cpu_chunks: results.iter().map(|r| r.stats.cpu_aggregation_chunks).sum(),
            gpu_chunks: results.iter().map(|r| r.stats.gpu_aggregation_chunks).sum(),
        },
        max_outstanding: results.iter().map(|r| r.stats.max_outstanding).max().unwrap_or(0),
        max_message_bytes: results.iter().map(|r| r.stats.max_message_bytes).max().unwrap_or(0),
        would_block: results.iter().map(|r| r.stats.would_block).sum(),
        factor_bytes_in_place: results.iter().map(|r| r.stats.factor_bytes_in_place).sum(),
        factor_bytes_decoded: results.iter().map(|r| r.stats.factor_bytes_decoded).sum(),
        sparse: SparseSummary {
            pushes: results.iter().map(|r| r.stats.sparse_pushes).sum(),
            dense_pushes: results.iter().map(|r| r.stats.sparse_dense_pushes).sum(),
            nonzeros: results.iter().map(|r| r.stats.sparse_nonzeros).sum(),
            elements: results.iter().map(|r| r.stats.sparse_elements).sum(),
            bytes: results.iter().map(|r| r.stats.sparse_bytes).sum(),
            dense_bytes: results.iter().map(|r| r.stats.sparse_dense_bytes).sum(),
        },
        model: model.name.into(),
        local_learners: args.local_learners,
        flat: args.flat,
        node_tx_bytes: per_node(&results, args, |r| r.stats.tx_payload_bytes - r.setup_tx_bytes),
        node_rx_bytes: per_node(&results, args, |r| {
            r.stats.rx_direct_bytes + r.stats.rx_copied_bytes - r.setup_rx_bytes
        }),
        sync: args.sync.clone(),
        consistency: args.consistency.clone(),
        workers: p1,
        servers: p2,
        colocate: args.colocate,
        batch: k,
        iters: args.iters,
        time_scale: args.time_scale,
        compute_s: model.iteration_compute(k, args.time_scale).as_secs_f64(),
        iteration_s,
        throughput_samples_s: (p1 * args.learners() * k) as f64 / iteration_s,
        hidden_fraction,
        per_iteration: per,
        workers_detail: {
            let mut w: Vec<&NodeResult> = workers.clone();
            w.sort_by_key(|r| r.rank);
            w.iter().map(|r| r.iters.clone()).collect()
        },
        layers: book
            .layers()
            .iter()
            .enumerate()
            .map(|(i, l)| LayerRow {
                name: l.name.clone(),
                kind: l.kind,
                shape: (l.m, l.n),
                scheme: book.scheme(i as u32, 0),
                cost_s: book.seconds(i as u32).map(|(ps, sfb)| (ps.total(), sfb.total())),
            })
            .collect(),
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
        transport: {
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
        },
    })))
}

/// Sums a counter over each worker node's ranks (worker ranks `0..P1`; with
/// --flat, node `i` is ranks `i·L..(i+1)·L`).
fn per_node(results: &[NodeResult], args: &TrainArgs, f: impl Fn(&NodeResult) -> u64) -> Vec<u64> {
    let per = if args.flat { args.local_learners } else { 1 };
    let mut out = vec![0u64; args.workers];
    for r in results.iter().filter(|r| r.local.is_none() && r.worker) {
        if let Some(n) = out.get_mut(r.rank as usize / per) {
            *n += f(r);
        }
    }
    out
}
