//! Rendezvous on rank 0: every rank reports its transport address and its
//! job configuration field by field ([`JobConfig`]: the book, the scheduler
//! settings, the apply op, the transport); rank 0 checks that they agree,
//! naming the first field and rank that differ, and hands everyone the
//! address table. It is plain TCP with one JSON line each way; it carries
//! no secrets (the transport authenticates peers with the job secret).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tidewire_engine::agree::{Field, JobConfig};
use tidewire_engine::EngineError;

use crate::error::{Error, Result};

#[derive(Debug, Serialize, Deserialize)]
struct Join {
    rank: u32,
    world: usize,
    job: u64,
    addr: SocketAddr,
    /// (field id, value) of every agreed field.
    config: Vec<(u8, u64)>,
}

/// A disagreement: (rank, field id, its value, rank 0's value).
type Mismatch = (u32, u8, u64, u64);

#[derive(Debug, Serialize, Deserialize)]
struct Reply {
    addrs: Vec<SocketAddr>,
    error: Option<String>,
    /// For a disagreement: (rank, field id, its value, rank 0's value).
    mismatch: Option<Mismatch>,
}

/// Rank 0's side, bound before the transport listens so that the advertised IP
/// is known.
#[derive(Debug)]
pub struct Host {
    listener: TcpListener,
}

impl Host {
    /// Binds the rendezvous address.
    pub fn bind(master: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(master).map_err(|e| {
            Error::Rendezvous(format!(
                "rank 0 cannot bind {master}: {e} (is another job using the port?)"
            ))
        })?;
        Ok(Host { listener })
    }

    /// Collects every rank's join and answers it.
    pub fn run(
        self,
        job: u64,
        world: usize,
        me: SocketAddr,
        config: &JobConfig,
        timeout: Duration,
    ) -> Result<Vec<SocketAddr>> {
        let deadline = Instant::now() + timeout;
        self.listener.set_nonblocking(true).map_err(io)?;
        let mut addrs: Vec<Option<SocketAddr>> = vec![None; world];
        addrs[0] = Some(me);
        let mut conns: Vec<(u32, TcpStream)> = Vec::new();
        let mut failure: Option<(String, Option<Mismatch>)> = None;
        while addrs.iter().any(Option::is_none) && failure.is_none() {
            if Instant::now() > deadline {
                let missing: Vec<usize> = (0..world).filter(|&r| addrs[r].is_none()).collect();
                return Err(Error::Timeout {
                    what: format!("ranks {missing:?} to join the rendezvous"),
                    after: timeout,
                });
            }
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(io(e)),
            };
            stream.set_nonblocking(false).map_err(io)?;
            stream.set_read_timeout(Some(remaining(deadline))).map_err(io)?;
            let mut line = String::new();
            if BufReader::new(&stream).read_line(&mut line).is_err() {
                continue;
            }
            let Ok(j) = serde_json::from_str::<Join>(&line) else {
                continue;
            };
            if j.job != job {
                failure = Some((format!("rank {} belongs to job {}, not {job}", j.rank, j.job), None));
            } else if j.world != world {
                failure = Some((
                    format!(
                        "rank {} says the world has {} ranks, rank 0 says {world}",
                        j.rank, j.world
                    ),
                    None,
                ));
            } else if j.rank == 0 || j.rank as usize >= world || addrs[j.rank as usize].is_some() {
                failure = Some((format!("rank {} joined twice or is out of range", j.rank), None));
            } else if let Some(m) = mismatch(j.rank, config, &j.config) {
                failure = Some(("the job configurations differ".into(), Some(m)));
            } else {
                addrs[j.rank as usize] = Some(j.addr);
            }
            conns.push((j.rank, stream));
        }
        let reply = match &failure {
            None => Reply {
                addrs: addrs.iter().map(|a| a.expect("all joined")).collect(),
                error: None,
                mismatch: None,
            },
            Some((e, m)) => Reply {
                addrs: vec![],
                error: Some(e.clone()),
                mismatch: *m,
            },
        };
        let line = serde_json::to_string(&reply).expect("serializable") + "\n";
        for (_, mut c) in conns {
            let _ = c.write_all(line.as_bytes());
        }
        match failure {
            None => Ok(reply.addrs),
            Some((e, m)) => Err(to_error(e, m)),
        }
    }
}

/// The first field where `rank`'s configuration differs from rank 0's.
fn mismatch(rank: u32, ours: &JobConfig, theirs: &[(u8, u64)]) -> Option<Mismatch> {
    for &(f, v) in ours.fields() {
        match theirs.iter().find(|(id, _)| *id == f as u8) {
            Some(&(_, t)) if t == v => {}
            Some(&(_, t)) => return Some((rank, f as u8, t, v)),
            None => return Some((rank, f as u8, u64::MAX, v)),
        }
    }
    None
}

fn to_error(e: String, m: Option<Mismatch>) -> Error {
    match m.and_then(|(rank, id, theirs, ours)| Field::from_id(id).map(|f| (rank, f, theirs, ours))) {
        Some((rank, f, theirs, ours)) => Error::Engine(EngineError::Disagree {
            rank,
            field: f.name(),
            theirs: f.render(theirs),
            reference: "rank 0".into(),
            ours: f.render(ours),
        }),
        None => Error::Rendezvous(e),
    }
}

/// Time left until `deadline`, at least 1 ms (a zero read timeout means "none").
fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn io(e: std::io::Error) -> Error {
    Error::Rendezvous(e.to_string())
}

/// The local IP this host uses to reach `master` (the address peers can reach us at).
pub fn local_ip_towards(master: SocketAddr) -> Result<IpAddr> {
    if master.ip().is_loopback() {
        return Ok(master.ip());
    }
    let s = std::net::UdpSocket::bind((if master.is_ipv4() { "0.0.0.0" } else { "::" }, 0)).map_err(io)?;
    s.connect(master).map_err(io)?;
    Ok(s.local_addr().map_err(io)?.ip())
}

/// A non-zero rank's side: joins and waits for the table.
pub fn join(
    master: SocketAddr,
    job: u64,
    rank: u32,
    world: usize,
    me: SocketAddr,
    config: &JobConfig,
    timeout: Duration,
) -> Result<Vec<SocketAddr>> {
    let deadline = Instant::now() + timeout;
    let stream = loop {
        match TcpStream::connect_timeout(&master, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(%master, error = %e, "rendezvous not up yet; retrying");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(Error::Timeout {
                    what: format!("rank 0's rendezvous at {master} (last error: {e})"),
                    after: timeout,
                })
            }
        }
    };
    let j = Join {
        rank,
        world,
        job,
        addr: me,
        config: config.fields().iter().map(|&(f, v)| (f as u8, v)).collect(),
    };
    (&stream)
        .write_all((serde_json::to_string(&j).expect("serializable") + "\n").as_bytes())
        .map_err(io)?;
    stream.set_read_timeout(Some(remaining(deadline))).map_err(io)?;
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .map_err(|e| Error::Timeout {
            what: format!("rank 0's rendezvous reply ({e})"),
            after: timeout,
        })?;
    let r: Reply = serde_json::from_str(&line)
        .map_err(|e| Error::Rendezvous(format!("bad reply from rank 0: {e} (line {line:?})")))?;
    if let Some(e) = r.error {
        return Err(to_error(e, r.mismatch));
    }
    if r.addrs.len() != world {
        return Err(Error::Rendezvous(format!(
            "rank 0 sent {} addresses for {world} ranks",
            r.addrs.len()
        )));
    }
    Ok(r.addrs)
}

/// Not an API: the entry point of fuzz/fuzz_targets/rendezvous.rs. Parses `line`
/// as rank 0 parses a join (checked against `config`) and as a rank parses rank
/// 0's reply (an error in it rendered as `join` would return it), and returns
/// what parsed, re-encoded: (the join, the reply).
#[doc(hidden)]
pub fn fuzz_parse_line(line: &str, config: &JobConfig) -> (Option<String>, Option<String>) {
    let join = serde_json::from_str::<Join>(line).ok().map(|j| {
        if let Some(m) = mismatch(j.rank, config, &j.config) {
            let _ = to_error(String::new(), Some(m)).to_string();
        }
        serde_json::to_string(&j).expect("serializable")
    });
    let reply = serde_json::from_str::<Reply>(line).ok().map(|r| {
        if let Some(e) = r.error.clone() {
            let _ = to_error(e, r.mismatch).to_string();
        }
        serde_json::to_string(&r).expect("serializable")
    });
    (join, reply)
}
