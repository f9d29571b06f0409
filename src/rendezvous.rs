//! Rendezvous on rank 0: every rank reports its transport address and its
//! job configuration field by field ([`JobConfig`]: the book, the scheduler
//! settings, the apply op, the transport); rank 0 checks that they agree,
//! naming the first field and rank that differ, and hands everyone the
//! address table.
//!
//! # Protocol
//! Plain TCP, one JSON line at a time, each at most [`MAX_LINE`] bytes:
//! 1. rank 0 → joiner: a fresh 32-byte nonce (`{"nonce": hex}`);
//! 2. joiner → rank 0: its `Join` as a string, its own nonce, and an
//!    HMAC-SHA256 with the job secret over both nonces and the join
//!    (`tidewire/v1/rendezvous-join`);
//! 3. rank 0 → joiner, once every rank has joined: the reply as a string and an
//!    HMAC over both nonces and the reply (`tidewire/v1/rendezvous-reply`), or
//!    `{"refused": why}` for a joiner that did not prove the secret.
//!
//! A joiner without the secret is refused and the job goes on without it;
//! rank 0 logs the refusal and remembers it ([`RefusedJoiner`]: from where,
//! claiming which rank, why), so that when the rendezvous then times out its
//! error names the joiners it turned away ([`Error::RendezvousTimeout`]), not
//! only the ranks missing. A recorded join or reply is useless on another
//! connection (fresh nonces on both sides). Rank 0 serves joiners
//! concurrently, one thread each (at most [`MAX_JOINERS_IN_FLIGHT`] at once;
//! past it the oldest is cut), each under its own deadline ([`JOIN_TIMEOUT`]
//! by default), so an idle connection delays nobody else. The addresses are
//! not secret; the transport authenticates every connection again.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};
use tidewire_engine::agree::{Field, JobConfig};
use tidewire_engine::EngineError;
use tidewire_transport::auth;
use tidewire_transport::JobSecret;

use crate::error::{Error, Result};

/// The longest line either side reads (a join, a reply, a challenge).
pub const MAX_LINE: usize = 64 * 1024;
/// How long rank 0 gives one connection to send its authenticated join.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections rank 0 authenticates at once; another one cuts the oldest.
pub const MAX_JOINERS_IN_FLIGHT: usize = 256;

/// Refused joiners rank 0 remembers for its timeout error (the first ones);
/// past it, it only counts them.
pub const MAX_REFUSALS_KEPT: usize = 16;

const JOIN_LABEL: &[u8] = b"tidewire/v1/rendezvous-join";
const REPLY_LABEL: &[u8] = b"tidewire/v1/rendezvous-reply";

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

#[derive(Debug, Serialize, Deserialize)]
struct Challenge {
    nonce: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct SignedJoin {
    join: String,
    nonce: String,
    mac: String,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct SignedReply {
    reply: Option<String>,
    mac: Option<String>,
    refused: Option<String>,
}

/// A joiner that proved the secret, waiting for the table.
struct Joined {
    join: Join,
    stream: TcpStream,
    nonces: [[u8; 32]; 2],
}

/// What a connection's thread reports: its id, its peer, and a proven join or why it was refused.
type Outcome = (u64, SocketAddr, std::result::Result<Joined, Refusal>);

/// Connections rank 0 is authenticating (at most [`MAX_JOINERS_IN_FLIGHT`]):
/// id and a handle to cut it, oldest first; and the next id.
#[derive(Default)]
struct InFlight {
    conns: VecDeque<(u64, TcpStream)>,
    next_id: u64,
}

/// Why rank 0's rendezvous ends without a table.
enum Failure {
    /// A proven joiner does not fit: another job or world, a rank twice, or
    /// (with the field) another configuration.
    Refused(String, Option<Mismatch>),
    /// The deadline passed with ranks missing ([`Error::RendezvousTimeout`]).
    TimedOut(Error),
}

/// Why rank 0 refused a joiner before its join counted: it did not prove the
/// job secret in time, or its connection failed. The text is what rank 0
/// answers the joiner (`{"refused": why}`).
#[derive(Debug, thiserror::Error)]
enum Refusal {
    /// The connection could not be set up (blocking mode, write timeout).
    #[error("{0}")]
    Socket(#[source] std::io::Error),
    /// The challenge could not be sent.
    #[error("sending the challenge: {0}")]
    SendChallenge(#[source] std::io::Error),
    /// No join line arrived before the deadline, or it was too long.
    #[error("reading the join: {0}")]
    ReadJoin(#[source] std::io::Error),
    /// The signed join line, or the join inside it, is not the expected JSON.
    #[error("malformed join: {0}")]
    MalformedJoin(#[source] serde_json::Error),
    /// The joiner's nonce is not 32 bytes of hex.
    #[error("malformed joiner nonce")]
    MalformedNonce,
    /// The MAC is not hex.
    #[error("malformed MAC")]
    MalformedMac,
    /// The MAC does not prove the job secret. `claimed` is the (rank, job)
    /// its join names, when it parses: unauthenticated, a hint for the report.
    #[error("authentication failed (the joiner does not have this job's secret)")]
    Unauthenticated { claimed: Option<(u32, u64)> },
}

impl Refusal {
    fn kind(&self) -> RefusalKind {
        match self {
            Refusal::Unauthenticated { .. } => RefusalKind::WrongSecret,
            Refusal::MalformedJoin(_) | Refusal::MalformedNonce | Refusal::MalformedMac => RefusalKind::Malformed,
            Refusal::ReadJoin(_) => RefusalKind::NoJoin,
            Refusal::Socket(_) | Refusal::SendChallenge(_) => RefusalKind::Connection,
        }
    }
}

pub use crate::error::{RefusalKind, RefusedJoiner};

impl RefusedJoiner {
    /// The report of `why`, logged (a wrong secret or a foreign protocol as a
    /// warning; a silent or broken connection, a port scan say, only at debug).
    fn logged(peer: SocketAddr, why: &Refusal) -> Self {
        let claimed = match why {
            Refusal::Unauthenticated { claimed } => *claimed,
            _ => None,
        };
        let r = RefusedJoiner {
            peer,
            claimed,
            kind: why.kind(),
            detail: why.to_string(),
        };
        match r.kind {
            RefusalKind::WrongSecret | RefusalKind::Malformed => {
                tracing::warn!(refused = %r, "rendezvous: rank 0 refused a joiner");
            }
            RefusalKind::NoJoin | RefusalKind::Connection => {
                tracing::debug!(refused = %r, "rendezvous: rank 0 refused a joiner");
            }
        }
        r
    }
}

/// The refusals of one rendezvous: the first [`MAX_REFUSALS_KEPT`], and how many more.
#[derive(Debug, Default)]
struct Refusals {
    kept: Vec<RefusedJoiner>,
    more: usize,
}

impl Refusals {
    fn record(&mut self, peer: SocketAddr, why: &Refusal) {
        let r = RefusedJoiner::logged(peer, why);
        if self.kept.len() < MAX_REFUSALS_KEPT {
            self.kept.push(r);
        } else {
            self.more += 1;
        }
    }
}

/// The ports [`free_port`] draws from: below Linux's default ephemeral range
/// (32768-60999), which the kernel hands out to every `connect()` and to
/// `bind(port 0)`. A port taken from that range by binding port 0 and letting
/// it go can become some connection's local port before rank 0 binds it (CI saw
/// "rank 0 cannot bind ...: Address already in use" that way, once in a full
/// run); one below it is taken only by a process that binds it by number.
pub const FREE_PORTS: std::ops::Range<u16> = 20000..32768;

/// A TCP port free on `ip` now, for a rendezvous address a launcher or a test
/// hands to rank 0 before rank 0 binds it: drawn at random from [`FREE_PORTS`]
/// (so that concurrent jobs rarely draw the same one) and checked by binding
/// it. Errors when 64 draws are all taken.
pub fn free_port(ip: IpAddr) -> std::io::Result<u16> {
    let span = u32::from(FREE_PORTS.end - FREE_PORTS.start);
    let mut last = None;
    // std's hasher keys are drawn from the OS's randomness, fresh per `RandomState`.
    let seed = std::collections::hash_map::RandomState::new();
    for draw in 0..64u32 {
        let r = std::hash::BuildHasher::hash_one(&seed, draw);
        let port = FREE_PORTS.start + (r % u64::from(span)) as u16;
        match TcpListener::bind((ip, port)) {
            Ok(_) => return Ok(port),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no port drawn")))
}

/// Rank 0's side, bound before the transport listens so that the advertised IP
/// is known.
#[derive(Debug)]
pub struct Host {
    listener: TcpListener,
    join_timeout: Duration,
}

impl Host {
    /// Binds the rendezvous address.
    pub fn bind(master: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(master).map_err(|e| {
            Error::Rendezvous(format!(
                "rank 0 cannot bind {master}: {e} (is another job using the port?)"
            ))
        })?;
        Ok(Host {
            listener,
            join_timeout: JOIN_TIMEOUT,
        })
    }

    /// How long one connection may take to send its authenticated join
    /// (default [`JOIN_TIMEOUT`]); past it, it is refused and closed.
    pub fn join_timeout(mut self, d: Duration) -> Self {
        self.join_timeout = d;
        self
    }

    /// The bound address (its port when bound to port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr().map_err(io)
    }

    /// Collects every rank's authenticated join and answers it. Joiners that
    /// fail to authenticate are refused and do not affect the job; if the
    /// rendezvous then times out, its error ([`Error::RendezvousTimeout`])
    /// names them, and the ranks that did join hear it too.
    pub fn run(
        &self,
        secret: &JobSecret,
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
        let mut conns: Vec<Joined> = Vec::new();
        let mut failure: Option<Failure> = None;
        let (tx, rx): (Sender<Outcome>, Receiver<Outcome>) = crossbeam_channel::unbounded();
        let mut joiners = InFlight::default();
        let mut refused = Refusals::default();
        while addrs.iter().any(Option::is_none) && failure.is_none() {
            if Instant::now() > deadline {
                // What the threads reported meanwhile: a refusal (an impostor is
                // refused at once) belongs in the error; a late join hears it.
                for (_, peer, outcome) in rx.try_iter() {
                    match outcome {
                        Ok(joined) => conns.push(joined),
                        Err(why) => refused.record(peer, &why),
                    }
                }
                failure = Some(Failure::TimedOut(Error::RendezvousTimeout {
                    missing: (0..world as u32).filter(|&r| addrs[r as usize].is_none()).collect(),
                    refused: std::mem::take(&mut refused.kept),
                    refused_more: refused.more,
                    after: timeout,
                }));
                break;
            }
            self.accept_waiting(&mut joiners, &tx, secret, deadline);
            let (id, peer, outcome) = match rx.recv_timeout(Duration::from_millis(5)) {
                Ok(x) => x,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => unreachable!("the host holds a sender"),
            };
            joiners.conns.retain(|(i, _)| *i != id);
            let joined = match outcome {
                Ok(j) => j,
                Err(why) => {
                    refused.record(peer, &why);
                    continue;
                }
            };
            let j = &joined.join;
            match admit(j, job, world, config, &addrs) {
                Ok(()) => addrs[j.rank as usize] = Some(j.addr),
                Err((e, m)) => failure = Some(Failure::Refused(e, m)),
            }
            conns.push(joined);
        }
        // Joiners still authenticating are not part of the job.
        for (_, h) in joiners.conns {
            let _ = h.shutdown(Shutdown::Both);
        }
        let reply = match &failure {
            None => Reply {
                addrs: addrs.iter().map(|a| a.expect("all joined")).collect(),
                error: None,
                mismatch: None,
            },
            Some(Failure::Refused(e, m)) => Reply {
                addrs: vec![],
                error: Some(e.clone()),
                mismatch: *m,
            },
            Some(Failure::TimedOut(e)) => Reply {
                addrs: vec![],
                error: Some(format!("rank 0 {e}")),
                mismatch: None,
            },
        };
        for mut c in conns {
            send_reply(&mut c, secret, &reply);
        }
        match failure {
            None => Ok(reply.addrs),
            Some(Failure::Refused(e, m)) => Err(to_error(e, m)),
            Some(Failure::TimedOut(e)) => Err(e),
        }
    }

    /// Accepts every connection waiting; each gets its own thread, which
    /// authenticates it before its deadline and reports to `tx`.
    fn accept_waiting(&self, joiners: &mut InFlight, tx: &Sender<Outcome>, secret: &JobSecret, deadline: Instant) {
        loop {
            let (stream, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of fds and the like: try again on the next turn.
                    tracing::warn!(error = %e, "rendezvous accept failed");
                    break;
                }
            };
            if joiners.conns.len() >= MAX_JOINERS_IN_FLIGHT {
                if let Some((_, oldest)) = joiners.conns.pop_front() {
                    tracing::debug!("rendezvous: too many joiners authenticating; cutting the oldest");
                    let _ = oldest.shutdown(Shutdown::Both);
                }
            }
            let id = joiners.next_id;
            joiners.next_id += 1;
            let handle = match stream.try_clone() {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "rendezvous: cannot track a connection; dropping it");
                    continue;
                }
            };
            let conn_deadline = (Instant::now() + self.join_timeout).min(deadline);
            let (tx, secret) = (tx.clone(), secret.clone());
            let spawned = std::thread::Builder::new()
                .name("tidewire-rendezvous-join".into())
                .spawn(move || {
                    let r = authenticate(stream, &secret, conn_deadline);
                    let _ = tx.send((id, peer, r));
                });
            match spawned {
                Ok(_) => joiners.conns.push_back((id, handle)),
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "rendezvous: cannot start a thread; dropping the joiner");
                    let _ = handle.shutdown(Shutdown::Both);
                }
            }
        }
    }

    /// After the rendezvous (`addrs` is its table): answers a replacement of
    /// a rank, a new process joining with that rank's number (a worker that
    /// was lost or removed), with the table updated with its new address, so
    /// that it can dial every rank. The same authenticated protocol; the job,
    /// the world and the configuration must agree. Serves on a thread of its
    /// own until the returned handle is dropped.
    pub fn serve_rejoins(
        self,
        secret: JobSecret,
        job: u64,
        mut addrs: Vec<SocketAddr>,
        config: JobConfig,
    ) -> Result<Rejoins> {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let join_timeout = self.join_timeout;
        let handle = std::thread::Builder::new()
            .name("tidewire-rendezvous-rejoins".into())
            .spawn(move || {
                let world = addrs.len();
                while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                    let (stream, peer) = match self.listener.accept() {
                        Ok(x) => x,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                        Err(_) => {
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                    };
                    let _ = stream.set_nonblocking(false);
                    // One at a time: a replacement is rare, and each has its deadline.
                    let mut joined = match authenticate(stream, &secret, Instant::now() + join_timeout) {
                        Ok(j) => j,
                        Err(why) => {
                            RefusedJoiner::logged(peer, &why);
                            continue;
                        }
                    };
                    let j = &joined.join;
                    let refused = if j.job != job || j.world != world {
                        Some(format!("rank {} is of another job or world", j.rank))
                    } else if j.rank == 0 || j.rank as usize >= world {
                        Some(format!("rank {} cannot be replaced (rank 0 hosts the job)", j.rank))
                    } else {
                        mismatch(j.rank, &config, &j.config).map(|_| "the job configurations differ".to_string())
                    };
                    let reply = match refused {
                        Some(e) => Reply {
                            addrs: vec![],
                            error: Some(e),
                            mismatch: None,
                        },
                        None => {
                            addrs[j.rank as usize] = j.addr;
                            tracing::info!(rank = j.rank, addr = %j.addr, "a replacement joined");
                            Reply {
                                addrs: addrs.clone(),
                                error: None,
                                mismatch: None,
                            }
                        }
                    };
                    send_reply(&mut joined, &secret, &reply);
                }
            })
            .map_err(|e| Error::Thread {
                what: "rendezvous rejoins",
                reason: e.to_string(),
            })?;
        Ok(Rejoins {
            stop,
            handle: Some(handle),
        })
    }
}

/// Rank 0's service for replacement ranks ([`Host::serve_rejoins`]); stops when dropped.
#[derive(Debug)]
pub struct Rejoins {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Rejoins {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Answers a proven joiner with `reply`, signed over both nonces.
fn send_reply(c: &mut Joined, secret: &JobSecret, reply: &Reply) {
    let body = serde_json::to_string(reply).expect("serializable");
    let [host, joiner] = c.nonces;
    let signed = SignedReply {
        mac: Some(hex(&auth::mac(secret, REPLY_LABEL, &[&host, &joiner, body.as_bytes()]))),
        reply: Some(body.clone()),
        refused: None,
    };
    let line = serde_json::to_string(&signed).expect("serializable") + "\n";
    let _ = c.stream.set_write_timeout(Some(Duration::from_secs(5)));
    let _ = c.stream.write_all(line.as_bytes());
}

/// One connection on rank 0: challenge, then a join that proves the secret,
/// all before `deadline`. A refusal is answered (best effort) and closes it.
fn authenticate(stream: TcpStream, secret: &JobSecret, deadline: Instant) -> std::result::Result<Joined, Refusal> {
    let host = auth::nonce();
    let r = (|| {
        stream.set_nonblocking(false).map_err(Refusal::Socket)?;
        stream
            .set_write_timeout(Some(remaining(deadline)))
            .map_err(Refusal::Socket)?;
        let line = serde_json::to_string(&Challenge { nonce: hex(&host) }).expect("serializable") + "\n";
        (&stream).write_all(line.as_bytes()).map_err(Refusal::SendChallenge)?;
        let mut reader = BufReader::new(&stream);
        let line = read_line(&mut reader, &stream, deadline).map_err(Refusal::ReadJoin)?;
        check_join(&line, secret, &host)
    })();
    match r {
        Ok((join, joiner)) => Ok(Joined {
            join,
            stream,
            nonces: [host, joiner],
        }),
        Err(why) => {
            let refusal = SignedReply {
                refused: Some(why.to_string()),
                ..Default::default()
            };
            let line = serde_json::to_string(&refusal).expect("serializable") + "\n";
            let _ = stream.set_write_timeout(Some(Duration::from_millis(200)));
            let _ = (&stream).write_all(line.as_bytes());
            let _ = stream.shutdown(Shutdown::Both);
            Err(why)
        }
    }
}

/// Rank 0's check of a joiner's signed join line against its challenge nonce
/// `host`: the join and the joiner's nonce, or why it is refused.
fn check_join(line: &[u8], secret: &JobSecret, host: &[u8; 32]) -> std::result::Result<(Join, [u8; 32]), Refusal> {
    let signed: SignedJoin = serde_json::from_slice(line).map_err(Refusal::MalformedJoin)?;
    let joiner = unhex32(&signed.nonce).ok_or(Refusal::MalformedNonce)?;
    let mac = unhex(&signed.mac).ok_or(Refusal::MalformedMac)?;
    if !auth::verify_mac(secret, JOIN_LABEL, &[host, &joiner, signed.join.as_bytes()], &mac) {
        let claimed = serde_json::from_str::<Join>(&signed.join).ok().map(|j| (j.rank, j.job));
        return Err(Refusal::Unauthenticated { claimed });
    }
    let join: Join = serde_json::from_str(&signed.join).map_err(Refusal::MalformedJoin)?;
    Ok((join, joiner))
}

/// A joiner's check of rank 0's signed reply line: the address table, or why not.
fn check_reply(line: &[u8], secret: &JobSecret, nonces: [&[u8; 32]; 2], world: usize) -> Result<Vec<SocketAddr>> {
    let [host, joiner] = nonces;
    let signed: SignedReply =
        serde_json::from_slice(line).map_err(|e| Error::Rendezvous(format!("bad reply from rank 0: {e}")))?;
    if let Some(why) = signed.refused {
        return Err(Error::Rendezvous(format!(
            "rank 0 refused this rank: {why} (is the job secret the same on every rank?)"
        )));
    }
    let (Some(body), Some(mac)) = (signed.reply, signed.mac.as_deref().and_then(unhex)) else {
        return Err(Error::Rendezvous("rank 0's reply has no table or no MAC".into()));
    };
    if !auth::verify_mac(secret, REPLY_LABEL, &[host, joiner, body.as_bytes()], &mac) {
        return Err(Error::Rendezvous(
            "rank 0's reply does not prove the job secret (an impostor, or another job's rank 0)".into(),
        ));
    }
    let r: Reply = serde_json::from_str(&body).map_err(|e| Error::Rendezvous(format!("bad reply from rank 0: {e}")))?;
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

/// Reads one line of at most [`MAX_LINE`] bytes (without its newline) before `deadline`.
fn read_line(r: &mut impl BufRead, s: &TcpStream, deadline: Instant) -> std::io::Result<Vec<u8>> {
    read_line_max(r, s, deadline, MAX_LINE)
}

fn read_line_max(r: &mut impl BufRead, s: &TcpStream, deadline: Instant, max: usize) -> std::io::Result<Vec<u8>> {
    let mut line = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed"));
        }
        s.set_read_timeout(Some(left))?;
        let room = (max + 1 - line.len()) as u64;
        let n = match r.by_ref().take(room).read_until(b'\n', &mut line) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if line.last() == Some(&b'\n') {
            line.pop();
            return Ok(line);
        }
        if line.len() > max {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("line longer than {max} bytes"),
            ));
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed",
            ));
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || s.len() > 128 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|d| u8::from_str_radix(d, 16).ok()))
        .collect()
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    unhex(s)?.try_into().ok()
}

/// Rank 0's check of a proven join against the job and the ranks already in:
/// why it does not fit (with the field, for a configuration that differs).
fn admit(
    j: &Join,
    job: u64,
    world: usize,
    config: &JobConfig,
    addrs: &[Option<SocketAddr>],
) -> std::result::Result<(), (String, Option<Mismatch>)> {
    if j.job != job {
        return Err((format!("rank {} belongs to job {}, not {job}", j.rank, j.job), None));
    }
    if j.world != world {
        return Err((
            format!(
                "rank {} says the world has {} ranks, rank 0 says {world}",
                j.rank, j.world
            ),
            None,
        ));
    }
    if j.rank == 0 || j.rank as usize >= world || addrs[j.rank as usize].is_some() {
        return Err((format!("rank {} joined twice or is out of range", j.rank), None));
    }
    match mismatch(j.rank, config, &j.config) {
        Some(m) => Err(("the job configurations differ".into(), Some(m))),
        None => Ok(()),
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

/// A non-zero rank's side: answers rank 0's challenge with a join that proves
/// the job secret, and waits for the table (whose MAC proves rank 0 has it too).
#[allow(clippy::too_many_arguments)]
pub fn join(
    master: SocketAddr,
    secret: &JobSecret,
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
    let late = |what: &str, e: std::io::Error| match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Error::Timeout {
            what: format!("rank 0's rendezvous {what}"),
            after: timeout,
        },
        _ => Error::Rendezvous(format!("reading rank 0's {what}: {e}")),
    };
    let mut reader = BufReader::new(&stream);
    let line = read_line(&mut reader, &stream, deadline).map_err(|e| late("challenge", e))?;
    let ch: Challenge =
        serde_json::from_slice(&line).map_err(|e| Error::Rendezvous(format!("bad challenge from rank 0: {e}")))?;
    let host = unhex32(&ch.nonce).ok_or_else(|| Error::Rendezvous("bad challenge nonce from rank 0".into()))?;
    let joiner = auth::nonce();
    let j = Join {
        rank,
        world,
        job,
        addr: me,
        config: config.fields().iter().map(|&(f, v)| (f as u8, v)).collect(),
    };
    let body = serde_json::to_string(&j).expect("serializable");
    let signed = SignedJoin {
        mac: hex(&auth::mac(secret, JOIN_LABEL, &[&host, &joiner, body.as_bytes()])),
        nonce: hex(&joiner),
        join: body,
    };
    stream.set_write_timeout(Some(remaining(deadline))).map_err(io)?;
    (&stream)
        .write_all((serde_json::to_string(&signed).expect("serializable") + "\n").as_bytes())
        .map_err(io)?;
    // The table grows with the world: allow for it beyond the usual bound.
    let max = MAX_LINE.max(world.saturating_mul(128));
    let line = read_line_max(&mut reader, &stream, deadline, max).map_err(|e| late("reply", e))?;
    check_reply(&line, secret, [&host, &joiner], world)
}

/// Not an API: the entry point of fuzz/fuzz_targets/rendezvous.rs. Parses `line`
/// as rank 0 parses a join (checked against `config`) and as a rank parses rank
/// 0's reply (an error in it rendered as `join` would return it), and returns
/// what parsed, re-encoded: (the join, the reply). It also runs the real checks
/// of the signed lines, [`check_join`] and [`check_reply`], with `secret` and
/// fixed nonces (a line the fuzzer did not sign must be refused).
#[doc(hidden)]
pub fn fuzz_parse_line(line: &str, config: &JobConfig, secret: &JobSecret) -> (Option<String>, Option<String>) {
    let nonces = [[1u8; 32], [2u8; 32]];
    let _ = check_join(line.as_bytes(), secret, &nonces[0]);
    let _ = check_reply(line.as_bytes(), secret, [&nonces[0], &nonces[1]], 4).map_err(|e| e.to_string());
    // `line` as the body of a properly signed join and reply: past the MAC, the
    // checks accept exactly what parses (and a reply only with 4 addresses and no error).
    let signed = SignedJoin {
        mac: hex(&auth::mac(
            secret,
            JOIN_LABEL,
            &[&nonces[0], &nonces[1], line.as_bytes()],
        )),
        nonce: hex(&nonces[1]),
        join: line.to_string(),
    };
    let ok = check_join(
        serde_json::to_string(&signed).expect("serializable").as_bytes(),
        secret,
        &nonces[0],
    );
    assert_eq!(ok.is_ok(), serde_json::from_str::<Join>(line).is_ok(), "{ok:?}");
    let signed = SignedReply {
        mac: Some(hex(&auth::mac(
            secret,
            REPLY_LABEL,
            &[&nonces[0], &nonces[1], line.as_bytes()],
        ))),
        reply: Some(line.to_string()),
        refused: None,
    };
    let got = check_reply(
        serde_json::to_string(&signed).expect("serializable").as_bytes(),
        secret,
        [&nonces[0], &nonces[1]],
        4,
    );
    let want = serde_json::from_str::<Reply>(line).is_ok_and(|r| r.error.is_none() && r.addrs.len() == 4);
    assert_eq!(got.is_ok(), want, "{got:?}");
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread::JoinHandle;
    use tidewire_engine::book::{LayerKind, LayerSpec};
    use tidewire_engine::{ApplyOp, Book, BookConfig, Cluster, SchedConfig};

    const JOB: u64 = 77;
    const WORLD: usize = 3;

    fn secret() -> JobSecret {
        JobSecret::new(b"rendezvous test secret".to_vec())
    }

    #[test]
    fn a_free_port_is_below_the_ephemeral_range_and_bindable() {
        let ip: IpAddr = std::net::Ipv4Addr::LOCALHOST.into();
        let ports: Vec<u16> = (0..8).map(|_| free_port(ip).unwrap()).collect();
        for &p in &ports {
            assert!(FREE_PORTS.contains(&p), "{p}");
            // Free after the draw: it was bound only to check it.
            drop(TcpListener::bind((ip, p)).unwrap());
        }
        assert!(ports.windows(2).any(|w| w[0] != w[1]), "drawn at random: {ports:?}");
        // A port held by someone else is never handed out: hold every draw, draw again.
        let held: Vec<TcpListener> = ports.iter().filter_map(|&p| TcpListener::bind((ip, p)).ok()).collect();
        let again = free_port(ip).unwrap();
        assert!(!held.iter().any(|l| l.local_addr().unwrap().port() == again), "{again}");
    }

    fn config() -> JobConfig {
        let book = Book::new(
            Cluster::split(WORLD, 1).unwrap(),
            vec![LayerSpec::new("fc", LayerKind::Fc, 10, 20)],
            BookConfig::default(),
        )
        .unwrap();
        JobConfig::new(&book, &SchedConfig::default(), ApplyOp::Mean, "tcp")
    }

    fn addr_of(rank: u32) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 40000 + rank as u16))
    }

    /// Rank 0 on a fresh port, serving in a thread; returns its address.
    fn host(join_timeout: Duration) -> (SocketAddr, JoinHandle<Result<Vec<SocketAddr>>>) {
        let h = Host::bind("127.0.0.1:0".parse().unwrap())
            .unwrap()
            .join_timeout(join_timeout);
        let at = h.local_addr().unwrap();
        let t =
            std::thread::spawn(move || h.run(&secret(), JOB, WORLD, addr_of(0), &config(), Duration::from_secs(20)));
        (at, t)
    }

    fn joiner(master: SocketAddr, secret: JobSecret, rank: u32) -> JoinHandle<Result<Vec<SocketAddr>>> {
        std::thread::spawn(move || {
            join(
                master,
                &secret,
                JOB,
                rank,
                WORLD,
                addr_of(rank),
                &config(),
                Duration::from_secs(20),
            )
        })
    }

    fn table() -> Vec<SocketAddr> {
        (0..WORLD as u32).map(addr_of).collect()
    }

    /// A raw connection's challenge nonce.
    fn challenge(s: &TcpStream) -> (BufReader<TcpStream>, [u8; 32]) {
        let mut r = BufReader::new(s.try_clone().unwrap());
        let line = read_line(&mut r, s, Instant::now() + Duration::from_secs(5)).unwrap();
        let c: Challenge = serde_json::from_slice(&line).unwrap();
        (r, unhex32(&c.nonce).unwrap())
    }

    fn signed_join(secret: &JobSecret, host: &[u8; 32], rank: u32) -> String {
        let j = Join {
            rank,
            world: WORLD,
            job: JOB,
            addr: "10.9.9.9:1".parse().unwrap(),
            config: config().fields().iter().map(|&(f, v)| (f as u8, v)).collect(),
        };
        let body = serde_json::to_string(&j).unwrap();
        let n = [5u8; 32];
        let s = SignedJoin {
            mac: hex(&auth::mac(secret, JOIN_LABEL, &[host, &n, body.as_bytes()])),
            nonce: hex(&n),
            join: body,
        };
        serde_json::to_string(&s).unwrap() + "\n"
    }

    /// The answer rank 0 gives a raw connection: `refused` or a reply.
    fn answer(r: &mut BufReader<TcpStream>) -> SignedReply {
        let s = r.get_ref().try_clone().unwrap();
        let line = read_line(r, &s, Instant::now() + Duration::from_secs(5)).unwrap();
        serde_json::from_slice(&line).unwrap()
    }

    #[test]
    fn joiners_without_the_secret_are_refused_and_the_job_goes_on() {
        let (master, h) = host(JOIN_TIMEOUT);
        // An impostor with the wrong secret claims rank 2 first.
        let impostor = joiner(master, JobSecret::new(b"guess".to_vec()), 2).join().unwrap();
        match impostor {
            Err(Error::Rendezvous(m)) => assert!(m.contains("refused"), "{m}"),
            other => panic!("an impostor was not refused: {other:?}"),
        }
        // A joiner that sends an unsigned join (the old protocol, or no secret at all).
        let raw = TcpStream::connect(master).unwrap();
        let (mut r, _) = challenge(&raw);
        (&raw)
            .write_all(b"{\"rank\":2,\"world\":3,\"job\":77,\"addr\":\"10.9.9.9:1\",\"config\":[]}\n")
            .unwrap();
        assert!(answer(&mut r).refused.is_some(), "an unsigned join was not refused");
        // A replay: a join signed (with the right secret) for another connection's challenge.
        let first = TcpStream::connect(master).unwrap();
        let (_r1, h1) = challenge(&first);
        let recorded = signed_join(&secret(), &h1, 2);
        let second = TcpStream::connect(master).unwrap();
        let (mut r2, _) = challenge(&second);
        (&second).write_all(recorded.as_bytes()).unwrap();
        assert!(answer(&mut r2).refused.is_some(), "a replayed join was accepted");
        drop(first);
        // The real ranks still complete, with their own addresses.
        let (r1, r2) = (joiner(master, secret(), 1), joiner(master, secret(), 2));
        assert_eq!(r1.join().unwrap().unwrap(), table());
        assert_eq!(r2.join().unwrap().unwrap(), table());
        assert_eq!(h.join().unwrap().unwrap(), table());
    }

    #[test]
    fn a_timeout_names_the_joiners_rank_0_refused() {
        let h = Host::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let master = h.local_addr().unwrap();
        let timeout = Duration::from_millis(1500);
        let t = std::thread::spawn(move || h.run(&secret(), JOB, WORLD, addr_of(0), &config(), timeout));
        // Rank 1 has the job's secret; rank 2 another one.
        let r1 = joiner(master, secret(), 1);
        let r2 = joiner(master, JobSecret::new(b"another secret".to_vec()), 2)
            .join()
            .unwrap();
        match r2 {
            Err(Error::Rendezvous(m)) => assert!(m.contains("refused this rank: authentication failed"), "{m}"),
            other => panic!("a rank with another secret was not refused: {other:?}"),
        }
        let e = t.join().unwrap().unwrap_err();
        assert!(e.is_timeout(), "{e}");
        let Error::RendezvousTimeout {
            missing,
            refused,
            refused_more,
            after,
        } = &e
        else {
            panic!("not a rendezvous timeout: {e:?}");
        };
        assert_eq!((missing.as_slice(), *refused_more, *after), (&[2][..], 0, timeout));
        assert_eq!(refused.len(), 1, "{refused:?}");
        let r = &refused[0];
        assert_eq!((r.kind, r.claimed), (RefusalKind::WrongSecret, Some((2, JOB))));
        assert_eq!(r.peer.ip(), master.ip());
        let msg = e.to_string();
        for want in [
            "waiting for ranks [2] to join the rendezvous",
            "rank 0 refused 1 joiner: 127.0.0.1:",
            "claiming rank 2 of job 77: authentication failed (the joiner does not have this job's secret)",
            "is the job secret, TIDEWIRE_SECRET, the same on every rank?",
        ] {
            assert!(msg.contains(want), "{want:?} not in {msg:?}");
        }
        // Rank 1, which joined, hears rank 0's timeout and the refusal rather than a closed connection.
        match r1.join().unwrap() {
            Err(Error::Rendezvous(m)) => {
                assert!(m.starts_with("rank 0 timed out after"), "{m}");
                assert!(m.contains("claiming rank 2 of job 77"), "{m}");
            }
            other => panic!("rank 1 did not hear rank 0's timeout: {other:?}"),
        }
    }

    #[test]
    fn a_timeout_without_refusals_names_only_the_missing_ranks() {
        let h = Host::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let e = h
            .run(&secret(), JOB, WORLD, addr_of(0), &config(), Duration::from_millis(200))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "timed out after 200ms waiting for ranks [1, 2] to join the rendezvous"
        );
    }

    #[test]
    fn refusals_past_the_bound_are_counted_not_kept() {
        let mut r = Refusals::default();
        let peer: SocketAddr = "10.0.0.9:7".parse().unwrap();
        for _ in 0..MAX_REFUSALS_KEPT + 4 {
            r.record(peer, &Refusal::MalformedMac);
        }
        assert_eq!((r.kept.len(), r.more), (MAX_REFUSALS_KEPT, 4));
        let e = Error::RendezvousTimeout {
            missing: vec![1],
            refused: r.kept,
            refused_more: r.more,
            after: Duration::from_secs(1),
        };
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("rank 0 refused {} joiners: ", MAX_REFUSALS_KEPT + 4)),
            "{msg}"
        );
        assert!(msg.ends_with("10.0.0.9:7: malformed MAC; and 4 more"), "{msg}");
        assert!(!msg.contains("TIDEWIRE_SECRET"), "no wrong secret, no hint: {msg}");
    }

    #[test]
    fn an_idle_connection_does_not_delay_the_others() {
        let per_conn = Duration::from_secs(10);
        let (master, h) = host(per_conn);
        let start = Instant::now();
        // Connects first and sends nothing; a second one sends an endless line.
        let _idle = TcpStream::connect(master).unwrap();
        let long = TcpStream::connect(master).unwrap();
        let (mut lr, _) = challenge(&long);
        let _ = (&long).write_all(&vec![b'x'; MAX_LINE + 10]);
        let (r1, r2) = (joiner(master, secret(), 1), joiner(master, secret(), 2));
        assert_eq!(r1.join().unwrap().unwrap(), table());
        assert_eq!(r2.join().unwrap().unwrap(), table());
        assert_eq!(h.join().unwrap().unwrap(), table());
        let took = start.elapsed();
        assert!(
            took < per_conn / 5,
            "the rendezvous took {took:?} with an idle connection open (per-connection deadline {per_conn:?})"
        );
        assert!(answer(&mut lr).refused.is_some(), "an over-long line was not refused");
    }

    #[test]
    fn a_connection_past_its_deadline_is_refused() {
        let (master, h) = host(Duration::from_millis(300));
        let idle = TcpStream::connect(master).unwrap();
        let (mut r, _) = challenge(&idle);
        let start = Instant::now();
        let a = answer(&mut r);
        assert!(a.refused.is_some_and(|m| m.contains("reading the join")));
        assert!(start.elapsed() < Duration::from_secs(2));
        let (r1, r2) = (joiner(master, secret(), 1), joiner(master, secret(), 2));
        assert_eq!(r1.join().unwrap().unwrap(), table());
        assert_eq!(r2.join().unwrap().unwrap(), table());
        assert_eq!(h.join().unwrap().unwrap(), table());
    }

    #[test]
    fn lines_are_bounded_and_hex_decoding_never_panics() {
        for s in ["", "0", "zz", "ab", "é1", &"a".repeat(200)] {
            let _ = unhex(s);
            let _ = unhex32(s);
        }
        assert_eq!(unhex("00ff").unwrap(), vec![0, 255]);
        assert_eq!(unhex32(&hex(&[9; 32])), Some([9; 32]));
    }

    #[test]
    fn a_refusal_names_its_check_and_keeps_its_source() {
        use std::error::Error as _;
        let host = [1u8; 32];
        let e = check_join(b"not json", &secret(), &host).unwrap_err();
        assert!(matches!(e, Refusal::MalformedJoin(_)), "{e}");
        assert!(e.to_string().starts_with("malformed join: "), "{e}");
        assert!(e.source().is_some_and(|s| s.is::<serde_json::Error>()));
        // Signed with another secret: the MAC does not verify.
        let joiner = [2u8; 32];
        let body = "{}";
        let line = serde_json::to_string(&SignedJoin {
            mac: hex(&auth::mac(
                &JobSecret::new(b"another job".to_vec()),
                JOIN_LABEL,
                &[&host, &joiner, body.as_bytes()],
            )),
            nonce: hex(&joiner),
            join: body.into(),
        })
        .unwrap();
        let e = check_join(line.as_bytes(), &secret(), &host).unwrap_err();
        assert!(matches!(e, Refusal::Unauthenticated { claimed: None }), "{e}");
        assert_eq!(
            e.to_string(),
            "authentication failed (the joiner does not have this job's secret)"
        );
    }
}
