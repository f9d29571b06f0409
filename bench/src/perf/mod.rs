//! `tidewire-perf`: perftest-compatible microbenchmarks.
//!
//! The tests, flags, output and out-of-band exchange follow perftest 4.5
//! (`ib_write_bw`, `ib_write_lat`, `ib_read_bw`, `ib_read_lat`, `ib_send_bw`,
//! `ib_send_lat`), so either side of a run may be perftest. [`oob`] is the
//! exchange, [`stats`] the arithmetic, and this module the options and the
//! report (perftest's header block and tables, plus JSON).

mod error;
pub mod oob;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod stats;
pub mod tcp;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

pub use error::PerfError;
pub use oob::{BwReport, Dest, Oob, Signature};
pub use stats::{BwRow, LatRow};

/// The six perftest tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Test {
    WriteBw,
    WriteLat,
    ReadBw,
    ReadLat,
    SendBw,
    SendLat,
}

/// The operation a test measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Write,
    Read,
    Send,
}

impl Test {
    /// The id carried in the signature.
    pub fn id(self) -> u8 {
        match self {
            Test::WriteBw => 1,
            Test::WriteLat => 2,
            Test::ReadBw => 3,
            Test::ReadLat => 4,
            Test::SendBw => 5,
            Test::SendLat => 6,
        }
    }
    /// From the signature's id.
    pub fn from_id(id: u8) -> Option<Test> {
        [
            Test::WriteBw,
            Test::WriteLat,
            Test::ReadBw,
            Test::ReadLat,
            Test::SendBw,
            Test::SendLat,
        ]
        .into_iter()
        .find(|t| t.id() == id)
    }
    /// perftest's program name.
    pub fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write_bw",
            Test::WriteLat => "write_lat",
            Test::ReadBw => "read_bw",
            Test::ReadLat => "read_lat",
            Test::SendBw => "send_bw",
            Test::SendLat => "send_lat",
        }
    }
    /// A bandwidth test (else latency).
    pub fn is_bw(self) -> bool {
        matches!(self, Test::WriteBw | Test::ReadBw | Test::SendBw)
    }
    /// The verb.
    pub fn verb(self) -> Verb {
        match self {
            Test::WriteBw | Test::WriteLat => Verb::Write,
            Test::ReadBw | Test::ReadLat => Verb::Read,
            Test::SendBw | Test::SendLat => Verb::Send,
        }
    }
    /// The title line of perftest's header.
    pub fn title(self) -> &'static str {
        match self {
            Test::WriteBw => "RDMA_Write BW Test",
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::SendBw => "Send BW Test",
            Test::SendLat => "Send Latency Test",
        }
    }
    /// Synchronizations between the key exchange and the test, as perftest does them.
    pub fn syncs_before(self) -> usize {
        match self {
            Test::WriteBw | Test::ReadBw => 2,
            _ => 3,
        }
    }
}

/// Which transport carries the test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum TransportKind {
    Rdma,
    Tcp,
}

/// Every option of a run, after validation.
#[derive(Debug, Clone)]
pub struct Opts {
    pub test: Test,
    /// `None`: server.
    pub host: Option<String>,
    pub transport: TransportKind,
    /// With TCP: the portable (epoll) backend instead of io_uring. The wire is the
    /// same, so either side may use either backend.
    pub tcp_portable: bool,
    pub device: Option<String>,
    pub ib_port: u8,
    pub gid_index: Option<u32>,
    pub sizes: Vec<u64>,
    pub all: bool,
    pub iters: u64,
    pub duration: Option<f64>,
    pub qps: usize,
    pub tx_depth: u32,
    pub rx_depth: u32,
    pub post_list: usize,
    pub cq_mod: usize,
    pub inline: u32,
    pub port: u16,
    pub mtu: Option<u32>,
    pub no_peak: bool,
    pub report_gbits: bool,
    pub out_json: Option<PathBuf>,
    /// Longest wait for the peer at any step that has a deadline.
    pub timeout: Duration,
}

impl Opts {
    /// Server side.
    pub fn is_server(&self) -> bool {
        self.host.is_none()
    }
    /// Bytes per second per reported unit: MB/sec (2^20) or Gb/sec (`--report_gbits`).
    pub fn unit(&self) -> f64 {
        if self.report_gbits {
            stats::GBIT
        } else {
            stats::MB
        }
    }
    /// The largest size of the run.
    pub fn max_size(&self) -> u64 {
        self.sizes.iter().copied().max().unwrap_or(0)
    }
    /// The signature two tidewire-perf sides compare.
    pub fn signature(&self) -> Signature {
        let mut flags = 0;
        if self.all {
            flags |= 1;
        }
        if self.duration.is_some() {
            flags |= 2;
        }
        if self.report_gbits {
            flags |= 4;
        }
        Signature {
            test: self.test.id() | if self.transport == TransportKind::Tcp { 0x10 } else { 0 },
            qps: self.qps.min(255) as u8,
            flags,
            size: if self.all {
                0
            } else {
                self.sizes[0].min(u32::MAX as u64) as u32
            },
            iters: match self.duration {
                Some(d) => d.ceil() as u32,
                None => self.iters.min(u32::MAX as u64) as u32,
            },
        }
    }
    /// Compares the peer's signature with ours and says what differs.
    pub fn check_peer(&self, peer: Option<Signature>) -> Result<(), PerfError> {
        let mine = self.signature();
        let Some(p) = peer else {
            if self.transport == TransportKind::Tcp {
                return Err(PerfError::new(
                    "the peer is perftest (its version message carries no tidewire-perf signature): \
                     --transport tcp needs tidewire-perf on both sides",
                ));
            }
            return Ok(());
        };
        let mut diff = Vec::new();
        let kind = |t: u8| {
            format!(
                "{} over {}",
                Test::from_id(t & 0xf).map(|t| t.name()).unwrap_or("?"),
                if t & 0x10 != 0 { "tcp" } else { "rdma" }
            )
        };
        if p.test != mine.test {
            diff.push(format!("test: ours {}, the peer's {}", kind(mine.test), kind(p.test)));
        }
        if p.qps != mine.qps {
            diff.push(format!("-q: ours {}, the peer's {}", mine.qps, p.qps));
        }
        if p.flags & 1 != mine.flags & 1 {
            diff.push(format!(
                "-a: ours {}, the peer's {}",
                on(mine.flags & 1 != 0),
                on(p.flags & 1 != 0)
            ));
        }
        if p.flags & 2 != mine.flags & 2 {
            diff.push(format!(
                "-D: ours {}, the peer's {}",
                on(mine.flags & 2 != 0),
                on(p.flags & 2 != 0)
            ));
        }
        if p.size != mine.size && p.flags & 1 == 0 && mine.flags & 1 == 0 {
            diff.push(format!("-s: ours {}, the peer's {}", mine.size, p.size));
        }
        if p.iters != mine.iters && p.flags & 2 == mine.flags & 2 {
            let what = if mine.flags & 2 != 0 { "-D" } else { "-n" };
            diff.push(format!("{what}: ours {}, the peer's {}", mine.iters, p.iters));
        }
        if diff.is_empty() {
            Ok(())
        } else {
            Err(PerfError::new(format!(
                "the server and the client run with different options ({}); run both with the same",
                diff.join("; ")
            )))
        }
    }
}

fn on(b: bool) -> &'static str {
    if b {
        "ON"
    } else {
        "OFF"
    }
}

/// The client's BW report in this side's unit: a tidewire-perf client says its
/// unit in its signature; perftest's does not, and its numbers are shown as sent
/// (as perftest itself does).
pub fn peer_row_in_our_unit(mut row: BwRow, peer: Option<Signature>, ours_gbits: bool) -> BwRow {
    let Some(p) = peer else { return row };
    let peer_gbits = p.flags & 4 != 0;
    if peer_gbits != ours_gbits {
        let (from, to) = if peer_gbits {
            (stats::GBIT, stats::MB)
        } else {
            (stats::MB, stats::GBIT)
        };
        row.bw_peak *= from / to;
        row.bw_average *= from / to;
    }
    row
}

/// The end of write_bw and read_bw: the client sends its last row, the server
/// prints it (perftest's xchg_bw_reports) and returns it.
pub fn exchange_report(
    oob: &mut Oob,
    mine: &BwRow,
    server: bool,
    peer: Option<Signature>,
    ours_gbits: bool,
) -> Result<Option<BwRow>, PerfError> {
    let rep = oob.report(&BwReport {
        size: mine.bytes,
        iters: mine.iterations,
        bw_peak: mine.bw_peak,
        bw_avg: mine.bw_average,
        msg_rate: mine.msg_rate_mpps,
    })?;
    if !server {
        return Ok(None);
    }
    let row = BwRow {
        bytes: rep.size,
        iterations: rep.iters,
        bw_peak: rep.bw_peak,
        bw_average: rep.bw_avg,
        msg_rate_mpps: rep.msg_rate,
    };
    let row = peer_row_in_our_unit(row, peer, ours_gbits);
    println!("{}", bw_columns(ours_gbits));
    println!("{}", bw_line(&row));
    Ok(Some(row))
}

/// perftest's separator line.
pub const DASHES: &str = "---------------------------------------------------------------------------------------";

/// What the header block shows about the device side.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Setup {
    pub device: String,
    pub transport_type: String,
    pub mtu: u32,
    pub link_type: String,
    pub gid_index: Option<u32>,
    pub out_reads: u32,
    pub inline: u32,
    pub tx_depth: u32,
    pub rx_depth: u32,
    pub cq_mod: usize,
}

/// perftest's configuration block (between the two separator lines).
pub fn header(o: &Opts, s: &Setup) -> String {
    let mut h = String::new();
    let _ = writeln!(h, "{DASHES}");
    let _ = writeln!(h, "                    {}", o.test.title());
    let _ = writeln!(h, " Dual-port       : OFF\t\tDevice         : {}", s.device);
    let _ = writeln!(
        h,
        " Number of qps   : {}\t\tTransport type : {}",
        o.qps, s.transport_type
    );
    let _ = writeln!(h, " Connection type : RC\t\tUsing SRQ      : OFF");
    let _ = writeln!(h, " PCIe relax order: OFF");
    let _ = writeln!(h, " ibv_wr* API     : {}", on(o.transport == TransportKind::Rdma));
    let server = o.is_server();
    // Which depth perftest shows: the send_bw server's receive depth; the TX depth on
    // clients and on latency servers that send (write_lat's and read_lat's servers show none).
    let show_tx = !server || matches!(o.test, Test::SendLat);
    if o.test == Test::SendBw && server {
        let _ = writeln!(h, " RX depth        : {}", s.rx_depth);
    } else if show_tx {
        let _ = writeln!(h, " TX depth        : {}", s.tx_depth);
    }
    if o.test.is_bw() {
        let _ = writeln!(h, " CQ Moderation   : {}", s.cq_mod);
    }
    let _ = writeln!(h, " Mtu             : {}[B]", s.mtu);
    let _ = writeln!(h, " Link type       : {}", s.link_type);
    if let Some(g) = s.gid_index {
        let _ = writeln!(h, " GID index       : {g}");
    }
    if o.test.verb() == Verb::Read {
        let _ = writeln!(h, " Outstand reads  : {}", s.out_reads);
    } else {
        let _ = writeln!(h, " Max inline data : {}[B]", s.inline);
    }
    let _ = writeln!(h, " rdma_cm QPs\t : OFF");
    let _ = writeln!(h, " Data ex. method : Ethernet");
    let _ = writeln!(h, "{DASHES}");
    h
}

/// The BW table's column line, in MB/sec or Gb/sec.
pub fn bw_columns(gbits: bool) -> String {
    let u = if gbits { "Gb/sec" } else { "MB/sec" };
    format!(" #bytes     #iterations    BW peak[{u}]    BW average[{u}]   MsgRate[Mpps]")
}

/// One BW row, in perftest's format.
pub fn bw_line(r: &BwRow) -> String {
    format!(
        " {:<7}    {:<7}          {:<7.2}            {:<7.2}\t\t   {:<7.6}",
        r.bytes, r.iterations, r.bw_peak, r.bw_average, r.msg_rate_mpps
    )
}

/// The latency table's column line.
pub fn lat_columns() -> &'static str {
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
}

/// One latency row, in perftest's format.
pub fn lat_line(r: &LatRow) -> String {
    format!(
        " {:<7} {}          {:<7.2}        {:<7.2}      {:<7.2}  \t       {:<7.2}     \t{:<7.2}\t\t{:<7.2} \t\t{:<7.2}",
        r.bytes, r.iterations, r.t_min, r.t_max, r.t_typical, r.t_avg, r.t_stdev, r.p99, r.p99_9
    )
}

/// Results of a run, for `--out_json`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct JsonReport {
    pub test_info: serde_json::Value,
    /// The last row, as perftest's single `results` object.
    pub results: serde_json::Value,
    /// Every row of the run.
    pub all_results: Vec<serde_json::Value>,
}

/// Builds the JSON report.
pub fn json_report(o: &Opts, s: &Setup, bw: &[BwRow], lat: &[LatRow]) -> JsonReport {
    let unit = if o.report_gbits { "Gb/sec" } else { "MB/sec" };
    let test_info = serde_json::json!({
        "test": o.test.title().replace(' ', "_"),
        "program": o.test.name(),
        "role": if o.is_server() { "server" } else { "client" },
        "transport": o.transport,
        "Dual_port": "OFF",
        "Device": s.device,
        "Number_of_qps": o.qps,
        "Transport_type": s.transport_type,
        "Connection_type": "RC",
        "Using_SRQ": "OFF",
        "TX_depth": s.tx_depth,
        "CQ_Moderation": s.cq_mod,
        "Mtu": s.mtu,
        "Link_type": s.link_type,
        "GID_index": s.gid_index,
        "Max_inline_data": s.inline,
        "rdma_cm_QPs": "OFF",
        "Data_ex_method": "Ethernet",
        "duration_s": o.duration,
    });
    let mut rows: Vec<serde_json::Value> = bw
        .iter()
        .map(|r| {
            serde_json::json!({
                "MsgSize": r.bytes, "n_iterations": r.iterations,
                "BW_peak": r.bw_peak, "BW_average": r.bw_average, "MsgRate": r.msg_rate_mpps, "unit": unit,
            })
        })
        .collect();
    rows.extend(lat.iter().map(|r| {
        serde_json::json!({
            "MsgSize": r.bytes, "n_iterations": r.iterations,
            "t_min": r.t_min, "t_max": r.t_max, "t_typical": r.t_typical, "t_avg": r.t_avg,
            "t_stdev": r.t_stdev, "percentile_99": r.p99, "percentile_99_9": r.p99_9, "unit": "usec",
        })
    }));
    JsonReport {
        test_info,
        results: rows.last().cloned().unwrap_or(serde_json::Value::Null),
        all_results: rows,
    }
}

/// Writes the JSON report where `--out_json` says.
pub fn write_json(o: &Opts, s: &Setup, bw: &[BwRow], lat: &[LatRow]) -> Result<(), PerfError> {
    let Some(path) = &o.out_json else { return Ok(()) };
    let j = json_report(o, s, bw, lat);
    let text = serde_json::to_string_pretty(&j).expect("serializable");
    std::fs::write(path, text + "\n").map_err(|e| PerfError::new(format!("--out_json {}: {e}", path.display())))
}

/// Sizes of `-a`: 2 to 2^23, as perftest.
pub fn all_sizes() -> Vec<u64> {
    (1..=23).map(|k| 1u64 << k).collect()
}

/// Offset of message `k` in a cycle buffer (perftest's increase_loc_addr/increase_rem_addr):
/// messages no larger than half the cycle buffer step through it by cache lines.
pub fn cycle_offset(k: u64, size: u64) -> u64 {
    let cycle = oob::CYCLE_BUFFER as u64;
    if size > cycle / 2 {
        return 0;
    }
    let step = size.div_ceil(oob::CACHE_LINE as u64) * oob::CACHE_LINE as u64;
    let per = cycle.div_ceil(step);
    (k % per) * step
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(test: Test) -> Opts {
        Opts {
            test,
            host: Some("h".into()),
            transport: TransportKind::Rdma,
            tcp_portable: false,
            device: None,
            ib_port: 1,
            gid_index: None,
            sizes: vec![65536],
            all: false,
            iters: 5000,
            duration: None,
            qps: 1,
            tx_depth: 128,
            rx_depth: 512,
            post_list: 1,
            cq_mod: 100,
            inline: 0,
            port: 18515,
            mtu: None,
            no_peak: false,
            report_gbits: false,
            out_json: None,
            timeout: Duration::from_secs(10),
        }
    }

    #[test]
    fn rows_print_as_perftest_does() {
        // Lines captured from perftest 4.5-0.17.
        let r = BwRow {
            bytes: 2,
            iterations: 20,
            bw_peak: 0.03,
            bw_average: 0.02,
            msg_rate_mpps: 0.009245,
        };
        assert_eq!(
            bw_line(&r),
            " 2          20               0.03               0.02   \t\t   0.009245"
        );
        let r = BwRow {
            bytes: 1048576,
            iterations: 20,
            bw_peak: 41.35,
            bw_average: 41.35,
            msg_rate_mpps: 0.000041,
        };
        assert_eq!(
            bw_line(&r),
            " 1048576    20               41.35              41.35  \t\t   0.000041"
        );
        let l = LatRow {
            bytes: 2,
            iterations: 500,
            t_min: 12.70,
            t_max: 377.90,
            t_typical: 13.36,
            t_avg: 17.49,
            t_stdev: 15.91,
            p99: 40.42,
            p99_9: 377.90,
        };
        assert_eq!(
            lat_line(&l),
            " 2       500          12.70          377.90       13.36    \t       17.49       \t15.91  \t\t40.42   \t\t377.90 "
        );
        let l = LatRow {
            bytes: 4194304,
            iterations: 20,
            t_min: 111909.41,
            t_max: 157046.23,
            t_typical: 126544.88,
            t_avg: 129136.28,
            t_stdev: 11717.10,
            p99: 157046.23,
            p99_9: 157046.23,
        };
        assert_eq!(
            lat_line(&l),
            " 4194304 20          111909.41        157046.23      126544.88  \t       129136.28     \t11717.10\t\t157046.23 \t\t157046.23"
        );
        assert_eq!(
            bw_columns(false),
            " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
        );
    }

    #[test]
    fn header_has_perftests_lines() {
        let s = Setup {
            device: "rxe1".into(),
            transport_type: "IB".into(),
            mtu: 1024,
            link_type: "Ethernet".into(),
            gid_index: Some(1),
            tx_depth: 128,
            cq_mod: 100,
            ..Default::default()
        };
        let h = header(&opts(Test::WriteBw), &s);
        assert!(h.contains("                    RDMA_Write BW Test\n"));
        assert!(h.contains(" Dual-port       : OFF\t\tDevice         : rxe1\n"));
        assert!(h.contains(" TX depth        : 128\n"));
        assert!(
            h.contains(" Mtu             : 1024[B]\n GID index       : 1\n")
                || h.contains(" Mtu             : 1024[B]\n Link type       : Ethernet\n GID index       : 1\n")
        );
        let mut srv = opts(Test::SendBw);
        srv.host = None;
        let h = header(&srv, &Setup { rx_depth: 200, ..s });
        assert!(h.contains(" RX depth        : 200\n") && !h.contains("TX depth"));
    }

    #[test]
    fn mismatched_options_are_named() {
        let a = opts(Test::WriteBw);
        let mut b = opts(Test::WriteBw);
        assert!(a.check_peer(Some(b.signature())).is_ok());
        assert!(a.check_peer(None).is_ok(), "perftest peers carry no signature");
        b.sizes = vec![4096];
        b.qps = 2;
        let e = a.check_peer(Some(b.signature())).unwrap_err().to_string();
        assert!(
            e.contains("-s: ours 65536, the peer's 4096") && e.contains("-q: ours 1, the peer's 2"),
            "{e}"
        );
        let c = opts(Test::SendBw);
        let e = a.check_peer(Some(c.signature())).unwrap_err().to_string();
        assert!(
            e.contains("test: ours write_bw over rdma, the peer's send_bw over rdma"),
            "{e}"
        );
        let mut t = opts(Test::WriteBw);
        t.transport = TransportKind::Tcp;
        assert!(t
            .check_peer(None)
            .unwrap_err()
            .to_string()
            .contains("needs tidewire-perf on both sides"));
    }

    #[test]
    fn a_tidewire_clients_report_is_shown_in_the_servers_unit() {
        let mut g = opts(Test::WriteBw);
        g.report_gbits = true;
        let row = BwRow {
            bytes: 65536,
            iterations: 10,
            bw_peak: 8.0,
            bw_average: 4.0,
            msg_rate_mpps: 0.1,
        };
        let r = peer_row_in_our_unit(row, Some(g.signature()), false);
        assert!((r.bw_average - 4.0 * stats::GBIT / stats::MB).abs() < 1e-9);
        assert_eq!(peer_row_in_our_unit(row, None, false), row);
        assert_eq!(peer_row_in_our_unit(row, Some(g.signature()), true), row);
    }

    #[test]
    fn small_messages_cycle_by_cache_lines() {
        assert_eq!(cycle_offset(0, 2), 0);
        assert_eq!(cycle_offset(1, 2), 64);
        assert_eq!(cycle_offset(64, 2), 0);
        assert_eq!(cycle_offset(1, 100), 128);
        assert_eq!(cycle_offset(5, 65536), 0);
        for k in 0..200 {
            for s in [2u64, 64, 100, 1000, 2048] {
                assert!(cycle_offset(k, s) + s <= 4096);
            }
        }
        assert_eq!(all_sizes().first(), Some(&2));
        assert_eq!(all_sizes().last(), Some(&(1 << 23)));
    }

    #[test]
    fn json_has_the_rows() {
        let o = opts(Test::WriteBw);
        let r = BwRow {
            bytes: 65536,
            iterations: 10,
            bw_peak: 1.0,
            bw_average: 2.0,
            msg_rate_mpps: 0.5,
        };
        let j = serde_json::to_value(json_report(&o, &Setup::default(), &[r], &[])).unwrap();
        assert_eq!(j["results"]["BW_average"], 2.0);
        assert_eq!(j["all_results"].as_array().unwrap().len(), 1);
        assert_eq!(j["test_info"]["test"], "RDMA_Write_BW_Test");
    }
}
