//! Following and supervising one attempt's processes: their output (progress
//! drives the bar and the watchdog; the result; warnings and a tail of
//! stderr), `--fault-kill`, `--remove-stragglers` and
//! `--replace-stragglers`, the rollback's stop, and the watchdog.

use std::collections::{BTreeSet, VecDeque};
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::args::TrainArgs;
use super::pipe::{ToLauncher, ToRank};
use super::report::NodeResult;
use super::spawn::Spawner;
use crate::error::{Error, Result};
use crate::resilience::{self, Kill, Removed, StragglerWatch};

/// A process's stderr: its id, a tail of it, and its warnings.
pub(super) type StderrTail = (u32, String, Vec<String>);

/// Process `id`'s name: local learners are not ranks, so they are named
/// by node and local rank (their ids follow the `ranks` ranks').
fn who(ranks: usize, local_learners: usize, id: u32) -> String {
    let id = id as usize;
    if id < ranks {
        format!("rank {id}")
    } else {
        let per = local_learners.saturating_sub(1).max(1);
        format!(
            "local learner {} of node {}",
            (id - ranks) % per + 1,
            (id - ranks) / per
        )
    }
}

/// How the processes of one attempt ended.
pub(super) struct Ended {
    /// Every result a process reported.
    pub(super) results: Vec<NodeResult>,
    pub(super) stderr_tails: Vec<StderrTail>,
    /// Why the attempt failed (empty: it did not).
    pub(super) failed: Vec<String>,
    pub(super) first_failure: Option<Instant>,
    /// The furthest iteration any worker reported, or a kill came: a
    /// failed attempt got going (it may be rolled back).
    pub(super) progressed: bool,
    /// Workers removed as stragglers (and when they left).
    pub(super) removed: Vec<Removed>,
    /// Ranks that got a replacement.
    pub(super) replaced: Vec<u32>,
}

/// The launcher's view of one attempt's processes.
pub(super) struct Supervisor<'a> {
    args: &'a TrainArgs,
    began: Instant,
    /// The ranks (ids below are ranks; above, local learners).
    ranks: usize,
    p1: usize,
    children: Vec<(u32, Child)>,
    statuses: Vec<Option<ExitStatus>>,
    stdins: Vec<(u32, ChildStdin)>,
    /// --fault-kill targets: they wait, done, until their stdin closes.
    held: BTreeSet<u32>,
    bar: indicatif::ProgressBar,
    /// When a worker last reported an iteration (ms since `began`).
    last_progress: Arc<AtomicU64>,
    /// The furthest iteration any worker reported.
    max_iter: Arc<AtomicU64>,
    /// Each worker's latest iteration (the coordinator's view, for --remove-stragglers).
    progress: Arc<Vec<AtomicU64>>,
    readers: Vec<JoinHandle<Option<NodeResult>>>,
    err_readers: Vec<JoinHandle<StderrTail>>,
    removal: StragglerWatch,
    replaced: Vec<u32>,
    failed: Vec<String>,
    first_failure: Option<Instant>,
    killed: bool,
    /// When the pending kill's iteration came (its checkpoint wait counts from there).
    kill_due: Option<Instant>,
    /// A watchdog, not a deadline (see [`Supervisor::stalled`]).
    stall_limit: Duration,
}

impl<'a> Supervisor<'a> {
    /// Follows every process of `children`; `prefix` names the run on the bar.
    pub(super) fn new(
        args: &'a TrainArgs,
        began: Instant,
        mut children: Vec<(u32, Child)>,
        held: BTreeSet<u32>,
        prefix: String,
        stall_limit: Duration,
    ) -> Result<Self> {
        let (p1, _, ranks) = args.world();
        let world = children.len();
        let bar = indicatif::ProgressBar::new(args.job.iters);
        if args.job.json {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        bar.set_style(
            indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} iterations, {elapsed} {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(prefix);
        let stdins = children
            .iter_mut()
            .filter_map(|(r, c)| Some((*r, c.stdin.take()?)))
            .collect();
        let mut s = Supervisor {
            args,
            began,
            ranks,
            p1,
            statuses: vec![None; world],
            stdins,
            held,
            bar,
            last_progress: Arc::new(AtomicU64::new(0)),
            max_iter: Arc::new(AtomicU64::new(0)),
            progress: Arc::new((0..world).map(|_| AtomicU64::new(0)).collect()),
            readers: Vec::new(),
            err_readers: Vec::new(),
            removal: StragglerWatch::new(args.remove_stragglers, args.straggler_window, p1, args.trigger()),
            replaced: Vec::new(),
            failed: Vec::new(),
            first_failure: None,
            killed: false,
            kill_due: None,
            stall_limit,
            children: Vec::new(),
        };
        for (rank, mut child) in children {
            s.follow(rank, &mut child);
            s.children.push((rank, child));
        }
        Ok(s)
    }

    fn who(&self, id: u32) -> String {
        who(self.ranks, self.args.job.local_learners, id)
    }

    /// Follows a process's output on two threads: progress and the result
    /// on stdout (rank 0's progress drives the bar), warnings and a tail of
    /// stderr.
    fn follow(&mut self, rank: u32, child: &mut Child) {
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let bar = self.bar.clone();
        let last = self.last_progress.clone();
        let furthest = self.max_iter.clone();
        let mine = self.progress.clone();
        let began = self.began;
        self.readers.push(std::thread::spawn(move || {
            let mut result = None;
            for line in BufReader::new(stdout).lines().map_while(std::result::Result::ok) {
                let Some(msg) = ToLauncher::parse(&line) else {
                    continue;
                };
                last.store(began.elapsed().as_millis() as u64, Ordering::Relaxed);
                match msg {
                    ToLauncher::Progress(n) => {
                        furthest.fetch_max(n, Ordering::Relaxed);
                        if let Some(m) = mine.get(rank as usize) {
                            m.fetch_max(n, Ordering::Relaxed);
                        }
                        if rank == 0 {
                            bar.set_position(n);
                        }
                    }
                    ToLauncher::Result(r) => result = Some(*r),
                }
            }
            result
        }));
        self.err_readers.push(std::thread::spawn(move || {
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
    }

    /// Supervises until every process has exited (or the watchdog fired).
    pub(super) fn run(&mut self, kills: &mut VecDeque<Kill>, spawner: &Spawner<'_>) -> Result<()> {
        while self.statuses.iter().any(Option::is_none) {
            self.inject_kill(kills);
            // A held rank (a --fault-kill's target, done and waiting) is let go
            // once no kill of this attempt can reach it: its stdin closes.
            let (held, killed) = (&self.held, self.killed);
            self.stdins
                .retain(|(r, _)| !held.contains(r) || (!killed && kills.iter().any(|k| k.rank == *r)));
            self.judge_stragglers();
            let gone = self.reap();
            self.replace(gone, spawner)?;
            self.stop_for_rollback();
            if self.stalled() {
                break;
            }
            // A pending fault is injected within a couple of milliseconds of its iteration.
            std::thread::sleep(Duration::from_millis(if kills.is_empty() || self.killed {
                20
            } else {
                2
            }));
        }
        Ok(())
    }

    /// Fault injection: the next --fault-kill, once a worker reports its
    /// iteration (and the checkpoint due there is written).
    fn inject_kill(&mut self, kills: &mut VecDeque<Kill>) {
        let Some(k) = kills.front().copied().filter(|_| !self.killed) else {
            return;
        };
        let came = self.max_iter.load(Ordering::Relaxed) >= k.iter;
        if came {
            self.kill_due.get_or_insert_with(Instant::now);
        }
        if !(came && resilience::due_checkpoint_done(&self.args.ckpt, k.iter, self.kill_due.unwrap_or(self.began))) {
            return;
        }
        self.kill_due = None;
        kills.pop_front();
        // Only a rank still running is killed (one that finished has nothing to lose).
        if let Some((_, c)) = self.children.iter_mut().find(|(r, _)| *r == k.rank) {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                self.failed.push(format!(
                    "rank {} was killed (SIGKILL) at iteration {} by --fault-kill",
                    k.rank,
                    self.max_iter.load(Ordering::Relaxed)
                ));
                self.killed = true;
                self.first_failure.get_or_insert_with(Instant::now);
            }
        }
    }

    /// The coordinator: a worker far behind the median leaves at its next boundary.
    fn judge_stragglers(&mut self) {
        let now: Vec<u64> = self.progress.iter().map(|p| p.load(Ordering::Relaxed)).collect();
        for r in self.removal.judge(&now) {
            if let Some((_, pipe)) = self.stdins.iter_mut().find(|(x, _)| *x == r) {
                let _ = ToRank::Leave.send(pipe);
            }
        }
    }

    /// The processes that exited since the last look (a failure is noted).
    fn reap(&mut self) -> Vec<u32> {
        let mut gone = Vec::new();
        for i in 0..self.children.len() {
            if self.statuses[i].is_some() {
                continue;
            }
            let rank = self.children[i].0;
            if let Ok(Some(st)) = self.children[i].1.try_wait() {
                if !st.success() {
                    self.failed.push(format!("{} exited with {st}", self.who(rank)));
                    self.first_failure.get_or_insert_with(Instant::now);
                }
                self.statuses[i] = Some(st);
                gone.push(rank);
            }
        }
        gone
    }

    /// --replace-stragglers: a removed worker that left gets a replacement.
    fn replace(&mut self, gone: Vec<u32>, spawner: &Spawner<'_>) -> Result<()> {
        for r in gone {
            let removed = self.removal.removed.iter().any(|x| x.rank == r);
            if !(self.args.replace_stragglers && removed && !self.replaced.contains(&r) && self.failed.is_empty()) {
                continue;
            }
            let now: Vec<u64> = self.progress.iter().map(|p| p.load(Ordering::Relaxed)).collect();
            let mut live: Vec<u64> = (0..self.p1).filter(|&w| w != r as usize).map(|w| now[w]).collect();
            live.sort_unstable();
            // The rounds left, less a margin for the time it takes to join:
            // it must not outlast the others (a round only it fed would strand).
            let n = self
                .args
                .job
                .iters
                .saturating_sub(live.last().copied().unwrap_or(0) + 3);
            if n == 0 {
                continue;
            }
            let mut c = spawner.rank_command(r);
            c.env("TIDEWIRE_REPLACEMENT_ITERS", n.to_string()).stdin(Stdio::null());
            let mut child = c
                .spawn()
                .map_err(|e| Error::Launch(format!("cannot start a replacement for rank {r}: {e}")))?;
            self.follow(r, &mut child);
            self.children.push((r, child));
            self.statuses.push(None);
            self.replaced.push(r);
            if let Some(x) = self.removal.removed.iter_mut().find(|x| x.rank == r) {
                x.replaced_for = Some(n);
            }
        }
        Ok(())
    }

    /// A rollback restarts every rank: once one failed, give the others a
    /// moment to report the loss themselves, then stop them.
    fn stop_for_rollback(&mut self) {
        if !(self.args.ckpt.active() && self.first_failure.is_some_and(|t| t.elapsed() > Duration::from_secs(3))) {
            return;
        }
        for (i, (_, c)) in self.children.iter_mut().enumerate() {
            if self.statuses[i].is_none() {
                let _ = c.kill();
            }
        }
    }

    /// The watchdog: no worker finished an iteration for `stall_limit`, so
    /// every process is killed (the ranks' own timeouts catch a lost peer
    /// first; a run that is slow but moving is left alone).
    fn stalled(&mut self) -> bool {
        let since = self
            .began
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_progress.load(Ordering::Relaxed)));
        if since <= self.stall_limit {
            return false;
        }
        for (_, c) in self.children.iter_mut() {
            let _ = c.kill();
        }
        self.failed.push(format!(
            "no worker finished an iteration for {:?}, so the run was killed (raise --timeout-s for a slower run)",
            self.stall_limit
        ));
        true
    }

    /// Waits for every process and collects what they reported.
    pub(super) fn finish(mut self) -> Ended {
        for (_, c) in self.children.iter_mut() {
            let _ = c.wait();
        }
        self.bar.finish_and_clear();
        let results: Vec<NodeResult> = self
            .readers
            .into_iter()
            .filter_map(|r| r.join().ok().flatten())
            .collect();
        let stderr_tails: Vec<StderrTail> = self.err_readers.into_iter().filter_map(|r| r.join().ok()).collect();
        let mut failed = self.failed;
        if !failed.is_empty() {
            let mut msg = failed.join("; ");
            for (rank, tail, _) in stderr_tails.iter().filter(|(_, t, _)| !t.is_empty()) {
                let who = who(self.ranks, self.args.job.local_learners, *rank);
                msg.push_str(&format!("\n--- {who} stderr ---\n{}", tail.trim_end()));
            }
            failed = vec![msg];
        }
        drop(self.stdins);
        let mut removed = self.removal.removed;
        for x in removed.iter_mut() {
            x.left_at = results
                .iter()
                .find(|w| w.rank == x.rank && w.removed_at.is_some())
                .and_then(|w| w.removed_at);
        }
        Ended {
            // A run that failed before any iteration would fail again the same
            // way (a setup error): only a run that got going is rolled back.
            progressed: self.max_iter.load(Ordering::Relaxed) > 0 || self.killed,
            results,
            stderr_tails,
            failed,
            first_failure: self.first_failure,
            removed,
            replaced: self.replaced,
        }
    }
}
