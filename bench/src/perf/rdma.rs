//! The six tests over bare RC queue pairs ([`tidewire_transport::rdma::raw`]),
//! with perftest's exchange, so the peer may be perftest.

use std::time::{Duration, Instant};

use tidewire_transport::rdma::raw::{RawConfig, RawDest, RawEndpoint, RawOp, RawWc, RawWr};
use tidewire_transport::rdma::DeviceChoice;

use super::oob::{Dest, Oob};
use super::stats::{self, BwRow, LatRow};
use super::{
    bw_columns, bw_line, cycle_offset, header, lat_columns, lat_line, Opts, PerfError, Setup, Test, Verb, DASHES,
};

const RECV_BIT: u64 = 1 << 63;

fn to_dest(d: &RawDest) -> Dest {
    Dest {
        lid: d.lid,
        out_reads: d.out_reads,
        qpn: d.qpn,
        psn: d.psn,
        rkey: d.rkey,
        vaddr: d.vaddr,
        gid: d.gid,
        srqn: d.srqn,
    }
}

fn to_raw(d: &Dest) -> RawDest {
    RawDest {
        lid: d.lid,
        out_reads: d.out_reads,
        qpn: d.qpn,
        psn: d.psn,
        rkey: d.rkey,
        vaddr: d.vaddr,
        gid: d.gid,
        srqn: d.srqn,
    }
}

fn wc_error(wc: &RawWc, what: &str) -> PerfError {
    PerfError::new(format!(
        "{what}: work completion failed: {} (status {}, vendor error {:#x}){}",
        tidewire_transport::error::wc_status_name(wc.status),
        wc.status,
        wc.vendor_err,
        match wc.status {
            10 => ": the peer refused the access (its buffer is smaller, or the options differ: compare -s/-a on both sides)",
            12 => ": no answer from the peer (it stopped, or the link is down)",
            13 => ": the peer posted no receive (is it running a send test with the same options?)",
            _ => "",
        }
    ))
}

struct Run<'a> {
    o: &'a Opts,
    ep: RawEndpoint,
    oob: Oob,
    me: Vec<Dest>,
    rem: Vec<Dest>,
    with_gid: bool,
    setup: Setup,
    wcs: Vec<RawWc>,
    empty_polls: u64,
    peer_sig: Option<super::Signature>,
}

/// Runs the test `o` over RDMA; prints perftest's output; returns the rows.
pub fn run(o: &Opts) -> Result<(Vec<BwRow>, Vec<LatRow>), PerfError> {
    let max = o.max_size();
    let half = (max as usize).max(super::oob::CYCLE_BUFFER as usize);
    let cfg = RawConfig {
        device: DeviceChoice {
            device: o.device.clone(),
            port: Some(o.ib_port),
            gid_index: o.gid_index,
        },
        qps: o.qps,
        half_bytes: half,
        tx_depth: o.tx_depth,
        rx_depth: o.rx_depth,
        max_inline: o.inline,
        mtu: o.mtu,
        ..Default::default()
    };
    let ep = RawEndpoint::open(cfg)?;
    let mut oob = if o.is_server() {
        println!("\n************************************\n* Waiting for client to connect... *\n************************************");
        Oob::accept(o.port, None, o.timeout)?
    } else {
        Oob::connect(o.host.as_deref().expect("client"), o.port, o.timeout)?
    };
    let (_ver, sig) = oob.versions(o.signature())?;
    o.check_peer(sig)?;
    let peer_sig = sig;
    oob.sys_data()?;
    let peer_mtu = oob.mtu(ep.mtu_code())?;
    let mtu_code = ep.mtu_code().min(peer_mtu);
    let (dev, _port, gid_index) = ep.device();
    let with_gid = ep.is_ethernet() || o.gid_index.is_some();
    let setup = Setup {
        device: dev.to_string(),
        transport_type: "IB".into(),
        mtu: 128u32 << mtu_code,
        link_type: if ep.is_ethernet() { "Ethernet" } else { "IB" }.into(),
        gid_index: with_gid.then_some(gid_index),
        out_reads: ep.max_out_reads(),
        inline: o.inline,
        tx_depth: o.tx_depth,
        rx_depth: o.rx_depth,
        cq_mod: o.cq_mod,
    };
    print!("{}", header(o, &setup));
    let show_out = o.test.verb() == Verb::Read;
    let me: Vec<Dest> = (0..o.qps).map(|i| to_dest(&ep.local(i))).collect();
    let mut rem = Vec::with_capacity(o.qps);
    for (i, d) in me.iter().enumerate() {
        rem.push(oob.keys(d, with_gid, &format!("exchanging the keys of QP {i}"))?);
    }
    for d in &me {
        print!("{}", d.print("local", show_out, with_gid));
    }
    for d in &rem {
        print!("{}", d.print("remote", show_out, with_gid));
    }
    println!("{DASHES}");
    let mut r = Run {
        o,
        ep,
        oob,
        me,
        rem,
        with_gid,
        setup,
        wcs: Vec::with_capacity(64),
        empty_polls: 0,
        peer_sig,
    };
    for i in 0..o.qps {
        let d = to_raw(&r.rem[i]);
        r.ep.connect(i, &d, peer_mtu)?;
    }
    // Receives before the last synchronization, so no send meets an empty queue.
    let receiver = match o.test {
        Test::SendBw => o.is_server(),
        Test::SendLat => true,
        _ => false,
    };
    if receiver {
        for q in 0..o.qps {
            r.post_receives(q, o.sizes[0] as u32, o.rx_depth as usize)?;
        }
    }
    for k in 0..o.test.syncs_before() {
        r.sync(
            &format!("synchronizing before the test ({}/{})", k + 1, o.test.syncs_before()),
            Some(o.timeout),
        )?;
    }
    let result = if o.test.is_bw() { r.bw_test() } else { r.lat_test() };
    let (bw, lat) = result?;
    let setup = r.setup.clone();
    r.finish()?;
    super::write_json(o, &setup, &bw, &lat)?;
    Ok((bw, lat))
}

impl Run<'_> {
    fn sync(&mut self, stage: &str, timeout: Option<Duration>) -> Result<(), PerfError> {
        let me = self.me[0];
        self.oob.sync(&me, self.with_gid, stage, timeout)
    }

    fn post_receives(&mut self, q: usize, size: u32, n: usize) -> Result<(), PerfError> {
        let base = self.ep.target_offset(q);
        let wrs: Vec<(u64, usize, u32)> = (0..n)
            .map(|k| {
                (
                    RECV_BIT | (q as u64) << 32 | k as u64,
                    base + cycle_offset(k as u64, size as u64) as usize,
                    size.max(1),
                )
            })
            .collect();
        self.ep.post_recv(q, &wrs)?;
        Ok(())
    }

    fn poll(&mut self, what: &str, since: &mut Instant) -> Result<(), PerfError> {
        self.wcs.clear();
        let n = self.ep.poll(&mut self.wcs)?;
        if n > 0 {
            self.empty_polls = 0;
            *since = Instant::now();
        } else {
            // Read the clock only now and then: it would slow the busy poll down.
            self.empty_polls += 1;
            if self.empty_polls % 1024 == 0 && since.elapsed() > self.o.timeout {
                return Err(PerfError::new(format!(
                    "{what}: no completion for {:.0} s (the peer stopped, or runs different options)",
                    self.o.timeout.as_secs_f64()
                )));
            }
        }
        for wc in &self.wcs {
            if wc.status != 0 {
                return Err(wc_error(wc, what));
            }
        }
        Ok(())
    }

    fn bw_test(&mut self) -> Result<(Vec<BwRow>, Vec<LatRow>), PerfError> {
        let o = self.o;
        let mut rows = Vec::new();
        let server = o.is_server();
        let mut first = true;
        for &size in &o.sizes.clone() {
            if o.test == Test::SendBw && o.all && !first {
                if server {
                    for q in 0..o.qps {
                        self.post_receives(q, size as u32, o.rx_depth as usize)?;
                    }
                }
                self.sync("synchronizing between sizes", Some(o.timeout))?;
            }
            first = false;
            let row = match (o.test, server) {
                (Test::SendBw, true) => Some(self.recv_side(size)?),
                (_, true) => None,
                _ => Some(self.post_side(size)?),
            };
            if let Some(row) = row {
                if rows.is_empty() {
                    println!("{}", bw_columns(o.report_gbits));
                }
                println!("{}", bw_line(&row));
                rows.push(row);
            }
        }
        if o.test != Test::SendBw {
            // Write and read: the server learns the client's last row (perftest's xchg_bw_reports).
            let mine = rows.last().copied().unwrap_or_default();
            if server {
                self.sync("waiting for the client to finish", None)?;
            } else {
                self.sync("telling the server the test is over", Some(o.timeout))?;
            }
            if let Some(row) = super::exchange_report(&mut self.oob, &mine, server, self.peer_sig, o.report_gbits)? {
                rows.push(row);
            }
        }
        println!("{DASHES}");
        Ok((rows, Vec::new()))
    }

    /// The posting side of write_bw, read_bw and send_bw.
    fn post_side(&mut self, size: u64) -> Result<BwRow, PerfError> {
        let o = self.o;
        let qps = o.qps;
        let iters = o.iters;
        let deadline = o.duration.map(|d| Instant::now() + Duration::from_secs_f64(d));
        let cap = if deadline.is_some() { 0 } else { (iters as usize) * qps };
        let mut posted = Vec::with_capacity(cap);
        let mut completed = vec![0u64; cap];
        let t0 = Instant::now();
        let now = || t0.elapsed().as_nanos() as u64;
        let mut scnt = vec![0u64; qps];
        let mut ccnt = vec![0u64; qps];
        let mut tot_c = 0usize;
        let cq_mod = o.cq_mod.max(1) as u64;
        let op = match o.test.verb() {
            Verb::Write => RawOp::Write,
            Verb::Read => RawOp::Read,
            Verb::Send => RawOp::Send,
        };
        let inline = op != RawOp::Read && size as u32 <= o.inline;
        let mut batch = Vec::with_capacity(o.post_list);
        let mut since = Instant::now();
        let what = format!("{} of {size} bytes", o.test.name());
        let mut stop = false;
        loop {
            if let Some(d) = deadline {
                if !stop && Instant::now() >= d {
                    stop = true;
                }
            }
            for q in 0..qps {
                // In duration mode, stop at a signalled message so that every post completes.
                let limit = match (deadline, stop) {
                    (None, _) => iters,
                    (Some(_), false) => u64::MAX,
                    (Some(_), true) => scnt[q].div_ceil(cq_mod) * cq_mod,
                };
                while scnt[q] < limit && scnt[q] - ccnt[q] + o.post_list as u64 <= o.tx_depth as u64 {
                    batch.clear();
                    for _ in 0..o.post_list {
                        if scnt[q] >= limit {
                            break;
                        }
                        let k = scnt[q];
                        let off = cycle_offset(k, size);
                        let last = deadline.is_none() && k + 1 == iters;
                        batch.push(RawWr {
                            wr_id: (q as u64) << 40 | k,
                            op,
                            local: self.ep.source_offset(q) + off as usize,
                            len: size as u32,
                            remote: self.rem[q].vaddr + off,
                            rkey: self.rem[q].rkey,
                            signaled: (k + 1) % cq_mod == 0 || last,
                            inline,
                        });
                        scnt[q] += 1;
                    }
                    let t = now();
                    if deadline.is_none() {
                        posted.extend(std::iter::repeat(t).take(batch.len()));
                    }
                    self.ep.post_send(q, &batch)?;
                }
            }
            self.poll(&what, &mut since)?;
            let t = now();
            for i in 0..self.wcs.len() {
                let id = self.wcs[i].wr_id;
                let q = (id >> 40) as usize;
                let k = id & ((1 << 40) - 1);
                let done = k + 1 - ccnt[q];
                ccnt[q] = k + 1;
                let new_tot = tot_c + done as usize;
                if deadline.is_none() {
                    for c in &mut completed[tot_c..new_tot.min(cap)] {
                        *c = t;
                    }
                }
                tot_c = new_tot;
            }
            let all_done = (0..qps).all(|q| ccnt[q] == scnt[q]);
            if (deadline.is_none() && tot_c >= cap) || (stop && all_done) {
                break;
            }
        }
        let row = match o.duration {
            Some(_) => stats::bw_duration(size, tot_c as u64, t0.elapsed().as_secs_f64(), self.o.unit()),
            None => stats::bw(
                size,
                &posted,
                &completed,
                o.cq_mod,
                o.post_list,
                o.no_peak,
                self.o.unit(),
            ),
        };
        Ok(row)
    }

    /// The receiving side of send_bw: counts receives and reposts them.
    fn recv_side(&mut self, size: u64) -> Result<BwRow, PerfError> {
        let o = self.o;
        let total = if o.duration.is_some() {
            u64::MAX
        } else {
            o.iters * o.qps as u64
        };
        let t0 = Instant::now();
        let mut got = 0u64;
        let mut last = t0;
        let mut since = Instant::now();
        let what = format!("receiving {size}-byte messages");
        let mut per_q = vec![o.rx_depth as u64; o.qps];
        while got < total {
            if let Some(d) = o.duration {
                // The client stops at its deadline; stop when it has gone quiet after ours.
                if t0.elapsed().as_secs_f64() > d && since.elapsed() > Duration::from_millis(200) {
                    break;
                }
            }
            self.poll(&what, &mut since)?;
            let n = self.wcs.len();
            if n == 0 {
                continue;
            }
            last = Instant::now();
            got += n as u64;
            let wcs = std::mem::take(&mut self.wcs);
            for wc in &wcs {
                let q = ((wc.wr_id >> 32) & 0x7fff_ffff) as usize;
                // Repost while more messages are due on this queue pair.
                let due = if o.duration.is_some() { u64::MAX } else { o.iters };
                if per_q[q] < due {
                    let k = per_q[q];
                    per_q[q] += 1;
                    let off = self.ep.target_offset(q) + cycle_offset(k, size) as usize;
                    self.ep
                        .post_recv(q, &[(RECV_BIT | (q as u64) << 32 | k, off, size.max(1) as u32)])?;
                }
            }
            self.wcs = wcs;
        }
        let secs = (last - t0).as_secs_f64();
        let mut row = stats::bw_duration(size, got, secs, self.o.unit());
        if o.duration.is_none() {
            row.iterations = o.iters;
        }
        Ok(row)
    }

    fn lat_test(&mut self) -> Result<(Vec<BwRow>, Vec<LatRow>), PerfError> {
        let o = self.o;
        let mut rows = Vec::new();
        let mut first = true;
        for &size in &o.sizes.clone() {
            if o.test == Test::SendLat && !first {
                self.post_receives(0, size as u32, o.rx_depth as usize)?;
                self.sync("synchronizing between sizes", Some(o.timeout))?;
            }
            first = false;
            let row = match o.test {
                Test::WriteLat => Some(self.write_lat(size)?),
                Test::SendLat => Some(self.send_lat(size)?),
                Test::ReadLat if !o.is_server() => Some(self.read_lat(size)?),
                _ => None,
            };
            if let Some(row) = row {
                if rows.is_empty() {
                    println!("{}", lat_columns());
                }
                println!("{}", lat_line(&row));
                rows.push(row);
            }
        }
        // The read_lat server measures nothing (the client reads) and prints no table.
        if !rows.is_empty() {
            println!("{DASHES}");
        }
        Ok((Vec::new(), rows))
    }

    fn lat_iters(&self) -> u64 {
        self.o.iters
    }

    fn wait_send_completion(&mut self, what: &str) -> Result<(), PerfError> {
        let mut since = Instant::now();
        loop {
            self.poll(what, &mut since)?;
            if self.wcs.iter().any(|w| w.wr_id & RECV_BIT == 0) {
                return Ok(());
            }
        }
    }

    fn write_lat(&mut self, size: u64) -> Result<LatRow, PerfError> {
        let o = self.o;
        let iters = self.lat_iters();
        let post_off = self.ep.source_offset(0) + size as usize - 1;
        let poll_off = self.ep.target_offset(0) + size as usize - 1;
        // perftest's write_lat: the server writes first, the client waits first.
        let server = o.is_server();
        let inline = size as u32 <= o.inline;
        let t0 = Instant::now();
        let mut posted = Vec::with_capacity(iters as usize);
        let (mut scnt, mut rcnt, mut ccnt) = (0u64, 0u64, 0u64);
        let what = format!("write_lat of {size} bytes");
        while scnt < iters || rcnt < iters || ccnt < iters {
            if rcnt < iters && !(scnt < 1 && server) {
                rcnt += 1;
                let want = rcnt as u8;
                let since = Instant::now();
                let mut spins = 0u32;
                while self.ep.load_byte(poll_off) != want {
                    spins = spins.wrapping_add(1);
                    if spins % 4096 == 0 && since.elapsed() > o.timeout {
                        return Err(PerfError::new(format!(
                            "{what}: the peer's write {rcnt} did not arrive within {:.0} s (it stopped, or runs different options: -s/-n/-a must match)",
                            o.timeout.as_secs_f64()
                        )));
                    }
                }
            }
            if scnt < iters {
                posted.push(t0.elapsed().as_nanos() as u64);
                scnt += 1;
                self.ep.store_byte(post_off, scnt as u8);
                let wr = RawWr {
                    wr_id: scnt,
                    op: RawOp::Write,
                    local: self.ep.source_offset(0),
                    len: size as u32,
                    remote: self.rem[0].vaddr,
                    rkey: self.rem[0].rkey,
                    signaled: true,
                    inline,
                };
                self.ep.post_send(0, &[wr])?;
            }
            if ccnt < iters {
                self.wait_send_completion(&what)?;
                ccnt += 1;
            }
        }
        Ok(stats::lat(size, &posted, 2.0))
    }

    fn send_lat(&mut self, size: u64) -> Result<LatRow, PerfError> {
        let o = self.o;
        let iters = self.lat_iters();
        let client = !o.is_server();
        let inline = size as u32 <= o.inline;
        let t0 = Instant::now();
        let mut posted = Vec::with_capacity(iters as usize);
        let (mut scnt, mut rcnt) = (0u64, 0u64);
        let mut reposted = o.rx_depth as u64;
        let what = format!("send_lat of {size} bytes");
        // Completions seen and not yet consumed: [receives, sends].
        let mut pending = [0u64; 2];
        while scnt < iters || rcnt < iters {
            if rcnt < iters && !(scnt < 1 && client) {
                self.send_lat_wait(&what, size, &mut pending, 0, &mut reposted)?;
                rcnt += 1;
            }
            if scnt < iters {
                posted.push(t0.elapsed().as_nanos() as u64);
                scnt += 1;
                let wr = RawWr {
                    wr_id: scnt,
                    op: RawOp::Send,
                    local: self.ep.source_offset(0),
                    len: size as u32,
                    remote: 0,
                    rkey: 0,
                    signaled: true,
                    inline,
                };
                self.ep.post_send(0, &[wr])?;
                // One send in flight at a time (tx depth 1), as perftest.
                self.send_lat_wait(&what, size, &mut pending, 1, &mut reposted)?;
            }
        }
        Ok(stats::lat(size, &posted, 2.0))
    }

    /// send_lat: polls until a completion of `kind` (0 receive, 1 send) is pending and
    /// consumes it; reposts each receive while more messages are due.
    fn send_lat_wait(
        &mut self,
        what: &str,
        size: u64,
        pending: &mut [u64; 2],
        kind: usize,
        reposted: &mut u64,
    ) -> Result<(), PerfError> {
        let iters = self.lat_iters();
        let mut since = Instant::now();
        while pending[kind] == 0 {
            self.poll(what, &mut since)?;
            let wcs = std::mem::take(&mut self.wcs);
            for w in &wcs {
                if w.wr_id & RECV_BIT != 0 {
                    pending[0] += 1;
                    if *reposted < iters {
                        let k = *reposted;
                        *reposted += 1;
                        self.ep
                            .post_recv(0, &[(RECV_BIT | k, self.ep.target_offset(0), size.max(1) as u32)])?;
                    }
                } else {
                    pending[1] += 1;
                }
            }
            self.wcs = wcs;
        }
        pending[kind] -= 1;
        Ok(())
    }

    fn read_lat(&mut self, size: u64) -> Result<LatRow, PerfError> {
        let iters = self.lat_iters();
        let t0 = Instant::now();
        let mut posted = Vec::with_capacity(iters as usize);
        let what = format!("read_lat of {size} bytes");
        for k in 0..iters {
            posted.push(t0.elapsed().as_nanos() as u64);
            let wr = RawWr {
                wr_id: k + 1,
                op: RawOp::Read,
                local: self.ep.source_offset(0),
                len: size as u32,
                remote: self.rem[0].vaddr,
                rkey: self.rem[0].rkey,
                signaled: true,
                inline: false,
            };
            self.ep.post_send(0, &[wr])?;
            self.wait_send_completion(&what)?;
        }
        // perftest's read latency counts post to post, one read each: no halving.
        Ok(stats::lat(size, &posted, 1.0))
    }

    /// The end of the run, as perftest closes each test.
    fn finish(self) -> Result<(), PerfError> {
        let Run {
            o, oob, me, with_gid, ..
        } = self;
        match o.test {
            // ib_write_lat just closes its socket.
            Test::WriteLat => Ok(()),
            // The client reads; the server only waits for its close.
            Test::ReadLat if o.is_server() => oob.close(&me[0], with_gid, None),
            _ => oob.close(&me[0], with_gid, Some(o.timeout)),
        }
    }
}
