//! `tidewire-perf` end to end over the io_uring TCP transport on loopback:
//! two processes, perftest's exchange between them, tables and JSON checked;
//! mismatched options, bad flags and a missing server end in clear errors.
//! (The RDMA path, against perftest itself, runs in the soft-RoCE tier:
//! ci/perf-guest.sh.)

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tidewire-perf")
}

fn free_port() -> u16 {
    let l = TcpListener::bind("0.0.0.0:0").unwrap();
    l.local_addr().unwrap().port()
}

fn server(args: &[&str], port: u16) -> Child {
    Command::new(bin())
        .args(args)
        .args(["--transport", "tcp", "-p", &port.to_string(), "--timeout", "10"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn client(args: &[&str], port: u16) -> Output {
    Command::new(bin())
        .args(args)
        .args([
            "--transport",
            "tcp",
            "-p",
            &port.to_string(),
            "--timeout",
            "10",
            "127.0.0.1",
        ])
        .output()
        .unwrap()
}

fn finish(mut c: Child) -> Output {
    let t0 = Instant::now();
    loop {
        if c.try_wait().unwrap().is_some() {
            return c.wait_with_output().unwrap();
        }
        if t0.elapsed() > Duration::from_secs(30) {
            c.kill().unwrap();
            panic!("server did not exit: {:?}", c.wait_with_output().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Table rows: " <bytes> <iters> <number> ...".
fn rows(o: &Output) -> Vec<Vec<f64>> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.starts_with(' ') && l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect::<Vec<f64>>()
        })
        .filter(|r| r.len() >= 5)
        .collect()
}

fn pair(args: &[&str]) -> (Output, Output) {
    let port = free_port();
    let s = server(args, port);
    let c = client(args, port);
    (finish(s), c)
}

#[test]
fn write_bw_both_sides_print_the_clients_row() {
    let json = std::env::temp_dir().join(format!("tw-perf-{}.json", std::process::id()));
    let port = free_port();
    let s = server(&["write_bw", "-s", "65536", "-n", "300"], port);
    let out_json = format!("--out_json={}", json.display());
    let c = client(&["write_bw", "-s", "65536", "-n", "300", &out_json], port);
    let s = finish(s);
    assert!(c.status.success() && s.status.success(), "{}\n{}", text(&c), text(&s));
    let (cr, sr) = (rows(&c), rows(&s));
    assert_eq!(cr.len(), 1, "{}", text(&c));
    assert_eq!((cr[0][0], cr[0][1]), (65536.0, 300.0));
    assert!(cr[0][3] > 0.0, "BW average must be positive: {:?}", cr[0]);
    assert_eq!(cr, sr, "the server prints the client's report");
    assert!(text(&c).contains("RDMA_Write BW Test") && text(&c).contains("BW peak[MB/sec]"));
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(j["results"]["MsgSize"], 65536);
    assert_eq!(j["results"]["n_iterations"], 300);
    assert!(j["results"]["BW_average"].as_f64().unwrap() > 0.0);
    let _ = std::fs::remove_file(json);
}

#[test]
fn latency_ping_pongs_report_on_both_sides() {
    for test in ["write_lat", "send_lat"] {
        let (s, c) = pair(&[test, "-s", "64", "-n", "200"]);
        assert!(
            c.status.success() && s.status.success(),
            "{test}: {}\n{}",
            text(&c),
            text(&s)
        );
        for o in [&c, &s] {
            let r = rows(o);
            assert_eq!(r.len(), 1, "{test}: {}", text(o));
            let (t_min, t_max, typ) = (r[0][2], r[0][3], r[0][4]);
            assert!(t_min > 0.0 && t_min <= typ && typ <= t_max, "{test}: {:?}", r[0]);
        }
    }
}

#[test]
fn send_bw_server_counts_every_message() {
    let (s, c) = pair(&["send_bw", "-s", "4096", "-n", "500", "--report_gbits"]);
    assert!(c.status.success() && s.status.success(), "{}\n{}", text(&c), text(&s));
    let r = rows(&s);
    assert_eq!((r[0][0], r[0][1]), (4096.0, 500.0), "{}", text(&s));
    assert!(text(&s).contains("Gb/sec"));
}

#[test]
fn all_sizes_run_in_one_connection() {
    let (s, c) = pair(&["write_lat", "-a", "-n", "5"]);
    assert!(c.status.success() && s.status.success(), "{}\n{}", text(&c), text(&s));
    let sizes: Vec<f64> = rows(&c).iter().map(|r| r[0]).collect();
    assert_eq!(sizes.len(), 23);
    assert_eq!(sizes[0], 2.0);
    assert_eq!(*sizes.last().unwrap(), 8388608.0);
}

#[test]
fn mismatched_options_stop_both_sides_naming_them() {
    let t0 = Instant::now();
    let (s, c) = pair(&["write_bw", "-n", "100"]);
    assert!(s.status.success() && c.status.success(), "{}\n{}", text(&c), text(&s));
    let port = free_port();
    let srv = server(&["write_bw", "-s", "4096", "-n", "100"], port);
    let c = client(&["send_bw", "-s", "65536", "-n", "100"], port);
    let s = finish(srv);
    assert!(!c.status.success() && !s.status.success());
    for o in [&c, &s] {
        let t = text(o);
        assert!(t.contains("different options") && t.contains("-s: ours"), "{t}");
    }
    assert!(text(&c).contains("test: ours send_bw over tcp, the peer's write_bw over tcp"));
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[test]
fn no_server_is_an_error_after_the_timeout() {
    let port = free_port();
    let t0 = Instant::now();
    let c = Command::new(bin())
        .args([
            "write_bw",
            "--transport",
            "tcp",
            "--timeout",
            "1",
            "-p",
            &port.to_string(),
            "127.0.0.1",
        ])
        .output()
        .unwrap();
    assert!(!c.status.success());
    assert!(text(&c).contains("could not connect to the server"), "{}", text(&c));
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn bad_flags_are_usage_errors() {
    for (args, want) in [
        (vec!["write_bw", "-s", "0"], "give 1 to"),
        (vec!["write_bw", "-a", "-s", "8"], "cannot be used with"),
        (vec!["write_lat", "-n", "3"], "at least 5 iterations"),
        (vec!["write_bw", "-t", "8", "-Q", "16"], "larger than the TX depth"),
        (vec!["write_bw", "-m", "1500"], "give 256, 512"),
        (vec!["write_bw", "-R"], "rdma_cm"),
        (vec!["read_bw", "--transport", "tcp", "-n", "10"], "no one-sided read"),
        (vec!["write_bw", "--transport", "udp"], "invalid value"),
        (vec!["write_bw", "-q", "2", "--transport", "tcp"], "use -q 1"),
        (vec!["write_lat", "-D", "2"], "use -n"),
        (vec!["write_bw", "-D", "2", "-n", "100"], "cannot be used with"),
    ] {
        let o = Command::new(bin()).args(&args).output().unwrap();
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(text(&o).contains(want), "{args:?}: {}", text(&o));
    }
}
