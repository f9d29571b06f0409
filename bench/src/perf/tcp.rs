//! The tests over the TCP transports (io_uring, or the portable epoll backend with
//! `--transport portable`), through the [`Transport`] API the
//! engine uses: one-sided writes into a registered region the peer announced,
//! and messages. Both sides must be tidewire-perf; the out-of-band exchange is
//! perftest's, plus the transport's listening port.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use tidewire_transport::{
    Access, ConnId, Error, Event, JobSecret, PinnedBuffer, PortableTransport, Region, RemoteRegion, TcpConfig,
    TcpTransport, Transport,
};

use super::oob::{Dest, Oob};
use super::stats::{self, BwRow, LatRow};
use super::{bw_columns, bw_line, cycle_offset, header, lat_columns, lat_line, Opts, PerfError, Setup, Test, DASHES};

const JOB: u64 = 0x7464_7065_7266; // "tdperf"

struct Run<'a> {
    o: &'a Opts,
    t: Box<dyn Transport>,
    conn: ConnId,
    oob: Oob,
    src: Region,
    /// Where the peer writes (write tests).
    _dst: Region,
    peer: Option<RemoteRegion>,
    ev: Vec<Event>,
    setup: Setup,
    peer_sig: Option<super::Signature>,
}

fn tcp_err(what: &str, e: Error) -> PerfError {
    PerfError::new(format!("{what}: {e}"))
}

/// Runs the test `o` over the io_uring TCP transport.
pub fn run(o: &Opts) -> Result<(Vec<BwRow>, Vec<LatRow>), PerfError> {
    if o.test.verb() == super::Verb::Read {
        return Err(PerfError::new(
            "the TCP transport has no one-sided read; use --transport rdma",
        ));
    }
    if o.qps != 1 {
        return Err(PerfError::new("--transport tcp runs one connection: use -q 1"));
    }
    let (mut oob, peer_sig) = handshake(o)?;
    let max = o.max_size() as usize;
    let mut t = open(o, max)?;
    let half = max.max(super::oob::CYCLE_BUFFER as usize);
    let pinned = |n| PinnedBuffer::new(n).map_err(|e| tcp_err("allocating buffers", e));
    let src = t
        .register(pinned(half)?, Access::LOCAL)
        .map_err(|e| tcp_err("registering the source buffer", e))?;
    let dst = t
        .register(pinned(half)?, Access::REMOTE_WRITE)
        .map_err(|e| tcp_err("registering the target buffer", e))?;
    let mut ev = Vec::new();
    let (conn, local) = if o.is_server() {
        accept(o, &mut *t, &mut oob, &mut ev)?
    } else {
        connect(o, &mut *t, &mut oob, &mut ev)?
    };
    let setup = tcp_setup(o);
    print!("{}", header(o, &setup));
    println!(" local address: {local}\n remote address: {} (out-of-band)", oob.peer());
    println!("{DASHES}");
    let mut r = Run {
        o,
        t,
        conn,
        oob,
        src,
        _dst: dst,
        peer: None,
        ev,
        setup,
        peer_sig,
    };
    r.wait_peer_region(half)?;
    r.sync("synchronizing before the test")?;
    let (bw, lat) = if o.test.is_bw() { r.bw_test()? } else { r.lat_test()? };
    let setup = r.setup.clone();
    r.finish()?;
    super::write_json(o, &setup, &bw, &lat)?;
    Ok((bw, lat))
}

/// perftest's out-of-band exchange (the server waits for the client), with
/// the versions and options checked. Returns it and the peer's signature.
fn handshake(o: &Opts) -> Result<(Oob, Option<super::Signature>), PerfError> {
    let mut oob = if o.is_server() {
        println!("\n************************************\n* Waiting for client to connect... *\n************************************");
        Oob::accept(o.port, None, o.timeout)?
    } else {
        Oob::connect(o.host.as_deref().expect("client"), o.port, o.timeout)?
    };
    let (_v, sig) = oob.versions(o.signature())?;
    o.check_peer(sig)?;
    oob.sys_data()?;
    oob.mtu(3)?;
    Ok((oob, sig))
}

/// The TCP transport (io_uring, or the portable one), its bounds fitted to
/// `--tx-depth` and to messages of `max` bytes.
fn open(o: &Opts, max: usize) -> Result<Box<dyn Transport>, PerfError> {
    let mut cfg = TcpConfig::new(
        JOB,
        u32::from(!o.is_server()),
        JobSecret::new(b"tidewire-perf".to_vec()),
    );
    cfg.max_outstanding = (o.tx_depth as usize).max(cfg.max_outstanding);
    cfg.max_message_bytes = cfg.max_message_bytes.max(max.min(16 << 20));
    cfg.handshake_timeout = o.timeout;
    if o.test.verb() == super::Verb::Send && max > cfg.max_message_bytes {
        return Err(PerfError::new(format!(
            "send tests over TCP carry messages of at most {} bytes (asked for {max})",
            cfg.max_message_bytes
        )));
    }
    Ok(if o.tcp_portable {
        Box::new(PortableTransport::new(cfg).map_err(|e| tcp_err("opening the portable TCP transport", e))?)
    } else {
        Box::new(TcpTransport::new(cfg).map_err(|e| tcp_err("opening the TCP transport", e))?)
    })
}

/// The server's side of the connection: listens, tells the client the port
/// over the out-of-band socket, and accepts. Returns it and the local address line.
fn accept(o: &Opts, t: &mut dyn Transport, oob: &mut Oob, ev: &mut Vec<Event>) -> Result<(ConnId, String), PerfError> {
    let l = t
        .listen("0.0.0.0:0".parse().expect("address"))
        .map_err(|e| tcp_err("listening", e))?;
    let port = t.listener_addr(l).map_err(|e| tcp_err("listening", e))?.port();
    oob.xchg_u32(port as u32, "telling the client the transport's port")?;
    let local = format!("io_uring TCP listener on port {port}");
    let deadline = Instant::now() + o.timeout;
    loop {
        t.wait(ev, 64, Duration::from_millis(10))
            .map_err(|e| tcp_err("accepting", e))?;
        if let Some((c, _)) = t.accept(l).map_err(|e| tcp_err("accepting", e))? {
            return Ok((c, local));
        }
        for e in ev.drain(..) {
            if let Event::PeerRejected { error, addr, .. } = e {
                return Err(PerfError::new(format!("the transport refused {addr}: {error}")));
            }
        }
        if Instant::now() > deadline {
            return Err(PerfError::new(format!(
                "the client did not connect to the transport within {:.0} s",
                o.timeout.as_secs_f64()
            )));
        }
    }
}

/// The client's side of the connection: learns the server transport's port
/// over the out-of-band socket, and connects. Returns it and the local address line.
fn connect(o: &Opts, t: &mut dyn Transport, oob: &mut Oob, ev: &mut Vec<Event>) -> Result<(ConnId, String), PerfError> {
    let port = oob.xchg_u32(0, "learning the server transport's port")?;
    let host = o.host.as_deref().expect("client");
    let addr: SocketAddr = (host, port as u16)
        .to_socket_addrs()
        .map_err(|e| PerfError::new(format!("cannot resolve {host}: {e}")))?
        .next()
        .ok_or_else(|| PerfError::new(format!("{host} has no address")))?;
    let c = t.connect(addr).map_err(|e| tcp_err("connecting", e))?;
    let deadline = Instant::now() + o.timeout;
    'wait: loop {
        t.wait(ev, 64, Duration::from_millis(10))
            .map_err(|e| tcp_err("connecting", e))?;
        for e in ev.drain(..) {
            match e {
                Event::Connected { .. } => break 'wait,
                Event::Closed { error, .. } => {
                    return Err(PerfError::new(format!(
                        "the transport connection to {addr} failed: {}",
                        error.map(|e| e.to_string()).unwrap_or_else(|| "closed".into())
                    )))
                }
                _ => {}
            }
        }
        if Instant::now() > deadline {
            return Err(PerfError::new(format!(
                "no transport connection to {addr} within {:.0} s",
                o.timeout.as_secs_f64()
            )));
        }
    }
    Ok((c, format!("io_uring TCP connection to {addr}")))
}

/// perftest's configuration block's figures for TCP.
fn tcp_setup(o: &Opts) -> Setup {
    Setup {
        device: "io_uring TCP".into(),
        transport_type: "TCP".into(),
        mtu: 65536,
        link_type: "TCP".into(),
        gid_index: None,
        out_reads: 0,
        inline: 0,
        tx_depth: o.tx_depth,
        rx_depth: o.rx_depth,
        cq_mod: 1,
    }
}

impl Run<'_> {
    /// Both sides need the peer's region descriptor (of at least `half`
    /// bytes) before the test.
    fn wait_peer_region(&mut self, half: usize) -> Result<(), PerfError> {
        let deadline = Instant::now() + self.o.timeout;
        while self.peer.is_none() {
            self.pump(Duration::from_millis(10), "waiting for the peer's regions")?;
            if let Ok(v) = self.t.remote_regions(self.conn) {
                self.peer = v.into_iter().find(|x| x.len as usize >= half);
            }
            if Instant::now() > deadline {
                return Err(PerfError::new("the peer announced no region within the timeout"));
            }
        }
        Ok(())
    }

    fn me(&self) -> Dest {
        Dest::default()
    }

    /// Drives the transport once, failing on a closed or failed connection.
    fn pump(&mut self, wait: Duration, what: &str) -> Result<(), PerfError> {
        self.ev.clear();
        self.t.wait(&mut self.ev, 1024, wait).map_err(|e| tcp_err(what, e))?;
        for e in &self.ev {
            match e {
                Event::Closed { error, .. } => {
                    return Err(PerfError::new(format!(
                        "{what}: the transport connection closed{}",
                        error.as_ref().map(|e| format!(": {e}")).unwrap_or_default()
                    )))
                }
                Event::OpFailed { error, .. } => return Err(PerfError::new(format!("{what}: {error}"))),
                Event::WriteRejected { error, .. } => {
                    return Err(PerfError::new(format!("{what}: the peer refused a write: {error}")))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A synchronization over the out-of-band socket while the transport keeps moving.
    fn sync(&mut self, what: &str) -> Result<(), PerfError> {
        self.oob.xchg_u32(1, what).map(|_| ())
    }

    fn bw_test(&mut self) -> Result<(Vec<BwRow>, Vec<LatRow>), PerfError> {
        let o = self.o;
        let server = o.is_server();
        let mut rows = Vec::new();
        for &size in &o.sizes.clone() {
            // Each size ends with a synchronization: the server learns the client is done.
            let row = match (o.test, server) {
                (Test::SendBw, true) => Some(self.recv_side(size)?),
                (_, true) => {
                    self.serve_writes()?;
                    None
                }
                _ => Some(self.post_side(size)?),
            };
            if !(o.test == Test::WriteBw && server) {
                self.sync("ending the size")?;
            }
            if let Some(row) = row {
                if rows.is_empty() {
                    println!("{}", bw_columns(o.report_gbits));
                }
                println!("{}", bw_line(&row));
                rows.push(row);
            }
        }
        if o.test == Test::WriteBw {
            let mine = rows.last().copied().unwrap_or_default();
            if let Some(row) = super::exchange_report(&mut self.oob, &mine, server, self.peer_sig, o.report_gbits)? {
                rows.push(row);
            }
        }
        println!("{DASHES}");
        Ok((rows, Vec::new()))
    }

    /// The write_bw server: keeps the transport moving (its CPU places the writes)
    /// until the client's end-of-size synchronization arrives.
    fn serve_writes(&mut self) -> Result<(), PerfError> {
        loop {
            self.pump(Duration::from_millis(1), "receiving writes")?;
            if self.oob.readable()? {
                return self.sync("ending the size");
            }
        }
    }

    fn post_side(&mut self, size: u64) -> Result<BwRow, PerfError> {
        let o = self.o;
        let dst = self.peer.expect("peer region");
        let deadline = o.duration.map(|d| Instant::now() + Duration::from_secs_f64(d));
        let iters = if deadline.is_some() { u64::MAX } else { o.iters };
        let mut posted = Vec::new();
        let mut completed = Vec::new();
        let t0 = Instant::now();
        let (mut scnt, mut ccnt) = (0u64, 0u64);
        let mut since = Instant::now();
        let what = format!("{} of {size} bytes over TCP", o.test.name());
        let mut stop = false;
        while ccnt < scnt || (!stop && scnt < iters) {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                stop = true;
            }
            while !stop && scnt < iters && scnt - ccnt < o.tx_depth as u64 {
                let off = cycle_offset(scnt, size);
                let s = self
                    .src
                    .slice(off as usize, size as usize)
                    .map_err(|e| tcp_err(&what, e))?;
                let r = if o.test == Test::SendBw {
                    self.t.send(self.conn, &s, scnt as u32)
                } else {
                    self.t.write(self.conn, &s, &dst, off, None)
                };
                match r {
                    Ok(_) => {}
                    Err(Error::WouldBlock { .. }) => break,
                    Err(e) => return Err(tcp_err(&what, e)),
                }
                if deadline.is_none() {
                    posted.push(t0.elapsed().as_nanos() as u64);
                }
                scnt += 1;
            }
            self.pump(Duration::from_millis(1), &what)?;
            let t = t0.elapsed().as_nanos() as u64;
            let mut n = 0;
            for e in &self.ev {
                if matches!(e, Event::WriteDone { .. } | Event::SendDone { .. }) {
                    n += 1;
                }
            }
            if n > 0 {
                since = Instant::now();
                ccnt += n;
                if deadline.is_none() {
                    completed.extend(std::iter::repeat(t).take(n as usize));
                }
            } else if since.elapsed() > o.timeout {
                return Err(PerfError::new(format!(
                    "{what}: no completion for {:.0} s",
                    o.timeout.as_secs_f64()
                )));
            }
        }
        Ok(match o.duration {
            Some(_) => stats::bw_duration(size, ccnt, t0.elapsed().as_secs_f64(), self.o.unit()),
            None => stats::bw(size, &posted, &completed, 1, 1, o.no_peak, self.o.unit()),
        })
    }

    fn recv_side(&mut self, size: u64) -> Result<BwRow, PerfError> {
        let o = self.o;
        let t0 = Instant::now();
        let mut last = t0;
        let mut got = 0u64;
        let mut since = Instant::now();
        let total = if o.duration.is_some() { u64::MAX } else { o.iters };
        while got < total {
            if let Some(d) = o.duration {
                if t0.elapsed().as_secs_f64() > d && since.elapsed() > Duration::from_millis(200) {
                    break;
                }
            }
            self.pump(Duration::from_millis(1), "receiving messages")?;
            let n = self.ev.iter().filter(|e| matches!(e, Event::Message { .. })).count() as u64;
            if n > 0 {
                got += n;
                last = Instant::now();
                since = last;
            } else if o.duration.is_none() && since.elapsed() > o.timeout {
                return Err(PerfError::new(format!(
                    "receiving {size}-byte messages: none for {:.0} s ({got} of {total})",
                    o.timeout.as_secs_f64()
                )));
            }
        }
        Ok(stats::bw_duration(size, got, (last - t0).as_secs_f64(), self.o.unit()))
    }

    fn lat_test(&mut self) -> Result<(Vec<BwRow>, Vec<LatRow>), PerfError> {
        let o = self.o;
        let mut rows = Vec::new();
        for &size in &o.sizes.clone() {
            let row = self.ping_pong(size)?;
            self.sync("ending the size")?;
            if rows.is_empty() {
                println!("{}", lat_columns());
            }
            println!("{}", lat_line(&row));
            rows.push(row);
        }
        println!("{DASHES}");
        Ok((Vec::new(), rows))
    }

    /// write_lat (writes with an immediate) or send_lat (messages), ping-pong.
    fn ping_pong(&mut self, size: u64) -> Result<LatRow, PerfError> {
        let o = self.o;
        let client = !o.is_server();
        let dst = self.peer.expect("peer region");
        let s = self.src.slice(0, size as usize).map_err(|e| tcp_err("ping-pong", e))?;
        let t0 = Instant::now();
        let mut posted = Vec::with_capacity(o.iters as usize);
        let (mut scnt, mut rcnt) = (0u64, 0u64);
        let mut arrived = 0u64;
        let mut done = 0u64;
        let what = format!("{} of {size} bytes over TCP", o.test.name());
        while scnt < o.iters || rcnt < o.iters {
            if rcnt < o.iters && !(scnt < 1 && client) {
                let since = Instant::now();
                while arrived == 0 {
                    self.pump(Duration::from_millis(1), &what)?;
                    for e in &self.ev {
                        match e {
                            Event::WriteReceived { .. } | Event::Message { .. } => arrived += 1,
                            Event::WriteDone { .. } | Event::SendDone { .. } => done += 1,
                            _ => {}
                        }
                    }
                    if arrived == 0 && since.elapsed() > o.timeout {
                        return Err(PerfError::new(format!(
                            "{what}: the peer's message {} did not arrive within {:.0} s",
                            rcnt + 1,
                            o.timeout.as_secs_f64()
                        )));
                    }
                }
                arrived -= 1;
                rcnt += 1;
            }
            if scnt < o.iters {
                posted.push(t0.elapsed().as_nanos() as u64);
                scnt += 1;
                let r = if o.test == Test::SendLat {
                    self.t.send(self.conn, &s, scnt as u32)
                } else {
                    self.t.write(self.conn, &s, &dst, 0, Some(scnt as u32))
                };
                r.map_err(|e| tcp_err(&what, e))?;
            }
        }
        // Our last message must leave before the out-of-band synchronization blocks.
        let since = Instant::now();
        while done < scnt {
            self.pump(Duration::from_millis(1), &what)?;
            done += self
                .ev
                .iter()
                .filter(|e| matches!(e, Event::WriteDone { .. } | Event::SendDone { .. }))
                .count() as u64;
            if since.elapsed() > o.timeout {
                return Err(PerfError::new(format!(
                    "{what}: our last message did not complete within the timeout"
                )));
            }
        }
        Ok(stats::lat(size, &posted, 2.0))
    }

    fn finish(mut self) -> Result<(), PerfError> {
        let me = self.me();
        // Let the last completions drain before the connection goes.
        let _ = self.t.close(self.conn);
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            self.ev.clear();
            let _ = self.t.wait(&mut self.ev, 64, Duration::from_millis(10));
            if self.ev.iter().any(|e| matches!(e, Event::Closed { .. })) {
                break;
            }
        }
        self.oob.close(&me, false, Some(self.o.timeout))
    }
}
