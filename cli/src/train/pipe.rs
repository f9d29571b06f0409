//! The ranks' pipe: what a rank process tells its launcher on stdout, and
//! what the launcher tells a rank on stdin, one JSON message a line. Typed
//! both ways ([`ToLauncher`], [`ToRank`]); a line that is not a message
//! (something a library printed) is ignored. A rank reads its stdin on one
//! thread ([`launcher_line`]).

use std::io::Write;

use serde::{Deserialize, Serialize};

use super::report::NodeResult;

/// A rank to its launcher, on the rank's stdout.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "msg", content = "body", rename_all = "snake_case")]
pub enum ToLauncher {
    /// Iterations done so far (drives the progress bar, the watchdog, the
    /// straggler judge and `--fault-kill`).
    Progress(u64),
    /// The rank's result, once, when it is done.
    Result(Box<NodeResult>),
}

/// The launcher to a rank, on the rank's stdin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum ToRank {
    /// Leave the job at the next iteration boundary (straggler removal).
    Leave,
}

/// Writes `msg` as one line and flushes it.
fn send(out: &mut impl Write, msg: &impl Serialize) -> std::io::Result<()> {
    serde_json::to_writer(&mut *out, msg)?;
    out.write_all(b"\n")?;
    out.flush()
}

impl ToLauncher {
    /// Writes this message as one line on `out` and flushes it.
    pub fn send(&self, out: &mut impl Write) -> std::io::Result<()> {
        send(out, self)
    }

    /// The message on `line`, or `None` for a line that is not one.
    pub fn parse(line: &str) -> Option<ToLauncher> {
        serde_json::from_str(line).ok()
    }
}

impl ToRank {
    /// Writes this message as one line on `out` and flushes it.
    pub fn send(&self, out: &mut impl Write) -> std::io::Result<()> {
        send(out, self)
    }

    /// The message on `line`, or `None` for a line that is not one.
    pub fn parse(line: &str) -> Option<ToRank> {
        serde_json::from_str(line).ok()
    }
}

/// Tells the launcher `iters` iterations are done (on stdout; a closed
/// stdout is not this rank's failure).
pub(crate) fn progress(iters: u64) {
    let _ = ToLauncher::Progress(iters).send(&mut std::io::stdout().lock());
}

/// What the launcher says to a rank on its stdin: [`ToRank::Leave`] (a straggler
/// removed), and its end (EOF: the launcher let it go, or is gone).
#[derive(Debug)]
pub struct LauncherLine {
    pub leave: std::sync::Arc<std::sync::atomic::AtomicBool>,
    closed: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

/// The one reader of this process's stdin, started on first use.
pub fn launcher_line() -> &'static LauncherLine {
    static LINE: std::sync::OnceLock<&'static LauncherLine> = std::sync::OnceLock::new();
    LINE.get_or_init(|| {
        let line: &'static LauncherLine = Box::leak(Box::new(LauncherLine {
            leave: Default::default(),
            closed: std::sync::Mutex::new(false),
            cv: std::sync::Condvar::new(),
        }));
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::stdin().lock().lines().map_while(std::result::Result::ok) {
                if ToRank::parse(&l) == Some(ToRank::Leave) {
                    line.leave.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
            *line.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
            line.cv.notify_all();
        });
        line
    })
}

/// A `--fault-kill`'s target, its result printed and its checkpoints
/// written, waits here until the launcher closes its stdin: the kill then
/// finds it running however quickly the run ended, and the rollback is
/// the same on a fast machine and a slow one. No-op for other ranks.
pub fn hold_until_released() {
    if !crate::resilience::held() {
        return;
    }
    let line = launcher_line();
    let mut closed = line.closed.lock().unwrap_or_else(|p| p.into_inner());
    while !*closed {
        closed = line.cv.wait(closed).unwrap_or_else(|p| p.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_one_line_each_and_other_lines_are_not_messages() {
        let mut out = Vec::new();
        ToLauncher::Progress(7).send(&mut out).unwrap();
        ToRank::Leave.send(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(matches!(ToLauncher::parse(lines[0]), Some(ToLauncher::Progress(7))));
        assert_eq!(ToRank::parse(lines[1]), Some(ToRank::Leave));
        // A rank's message is not the launcher's, and free text is neither.
        assert_eq!(ToRank::parse(lines[0]), None);
        assert!(ToLauncher::parse(lines[1]).is_none());
        for junk in [
            "progress 3",
            "leave",
            "",
            "{\"msg\":\"progress\"}",
            "{\"msg\":\"stop\"}",
        ] {
            assert!(ToLauncher::parse(junk).is_none(), "{junk}");
            assert_eq!(ToRank::parse(junk), None, "{junk}");
        }
    }
}
