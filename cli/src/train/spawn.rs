//! Starting a rank process: its namespace under the bandwidth harness, its
//! place in the job, its output piped to the launcher.

use std::process::{Child, Command, Stdio};

use super::args::{split_list, TrainArgs};
use crate::error::{Error, Result};
use crate::resilience;

fn free_port() -> Result<u16> {
    let no_port = |e: std::io::Error| Error::Launch(format!("no free rendezvous port on 127.0.0.1: {e}"));
    tidewire::rendezvous::free_port(std::net::Ipv4Addr::LOCALHOST.into()).map_err(no_port)
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

/// What every process of one attempt shares: this binary, the job's secret
/// and rendezvous, the namespaces, the flags.
pub(super) struct Spawner<'a> {
    args: &'a TrainArgs,
    node_args: Vec<String>,
    exe: std::path::PathBuf,
    secret: String,
    master: String,
    /// Under the bandwidth harness: the namespaces (ranks round robin) and
    /// their addresses.
    netns: Option<(Vec<String>, Vec<String>)>,
}

/// The file this process runs, for starting ranks of the same build:
/// `/proc/<pid>/exe` where there is one, which names the very file this
/// process was started from even after a rebuild replaced the path (a
/// restart after a killed rank once failed with ENOENT when `cargo` re-linked
/// `target/release/tidewire` mid-run; with the path, a rebuilt binary of
/// another version could also have joined). It is this launcher's pid, not
/// `self`, so that `ip netns exec` (another process) reaches it too.
/// Elsewhere, [`std::env::current_exe`].
pub(super) fn own_binary() -> Result<std::path::PathBuf> {
    let proc = std::path::PathBuf::from(format!("/proc/{}/exe", std::process::id()));
    if std::fs::metadata(&proc).is_ok() {
        return Ok(proc);
    }
    std::env::current_exe().map_err(|e| Error::Launch(format!("cannot find my own binary: {e}")))
}

impl<'a> Spawner<'a> {
    pub(super) fn new(args: &'a TrainArgs, node_args: Vec<String>) -> Result<Self> {
        let exe = own_binary()?;
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
        Ok(Spawner {
            args,
            node_args,
            exe,
            secret: secret(),
            master,
            netns,
        })
    }

    /// `train-node` in node `node`'s namespace (if any), output piped.
    fn base(&self, node: usize) -> Command {
        let mut c = match &self.netns {
            Some((ns, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns[node % ns.len()]]).arg(&self.exe);
                c
            }
            None => {
                let mut c = Command::new(&self.exe);
                // Named as it was started (ps shows it), not /proc/<pid>/exe.
                if let Some(name) = std::env::args_os().next() {
                    std::os::unix::process::CommandExt::arg0(&mut c, name);
                }
                c
            }
        };
        c.arg("train-node")
            .args(&self.node_args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// A rank's process (a replacement's too), with its place in the job.
    pub(super) fn rank_command(&self, rank: u32) -> Command {
        let (_, p2, world) = self.args.world();
        let mut c = self.base(rank as usize);
        c.env("TIDEWIRE_RANK", rank.to_string())
            .env("TIDEWIRE_WORLD_SIZE", world.to_string())
            .env("TIDEWIRE_MASTER", &self.master)
            .env("TIDEWIRE_SECRET", &self.secret)
            .env("TIDEWIRE_JOB", "1");
        if self.args.colocate {
            c.env_remove("TIDEWIRE_SERVERS");
        } else {
            c.env("TIDEWIRE_SERVERS", p2.to_string());
        }
        c
    }

    /// Every rank, then the local learners 1..L of every node (processes
    /// that are not ranks: they take ids after the ranks', for the
    /// launcher's bookkeeping only). `held` are --fault-kill targets.
    pub(super) fn spawn_all(&self, held: &std::collections::BTreeSet<u32>) -> Result<Vec<(u32, Child)>> {
        let args = self.args;
        let (p1, _, world) = args.world();
        let hier = args.job.local_learners > 1 && !args.job.flat;
        let mut children = Vec::new();
        for rank in 0..world as u32 {
            let mut c = self.rank_command(rank);
            // With --remove-stragglers a worker reads `ToRank::Leave` from its stdin; a
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
            if hier && (rank as usize) < p1 {
                c.env("TIDEWIRE_LOCAL_RANK", "0");
                local_env(&mut c, rank as usize, &self.secret);
            }
            let child = c
                .spawn()
                .map_err(|e| Error::Launch(format!("cannot start rank {rank}: {e}")))?;
            children.push((rank, child));
        }
        if hier {
            for node in 0..p1 {
                for j in 1..args.job.local_learners {
                    let mut c = self.base(node);
                    c.env("TIDEWIRE_LOCAL_RANK", j.to_string()).stdin(Stdio::null());
                    local_env(&mut c, node, &self.secret);
                    let id = (world + node * (args.job.local_learners - 1) + j - 1) as u32;
                    let child = c
                        .spawn()
                        .map_err(|e| Error::Launch(format!("cannot start local learner {j} of node {node}: {e}")))?;
                    children.push((id, child));
                }
            }
        }
        Ok(children)
    }
}
