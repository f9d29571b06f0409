//! Summarizes a side-by-side run (bench/compare-perftest.sh, bench/compare-tcp.sh):
//! medians per test and size, the ratio ours/peer, the acceptance checks,
//! JSON, and a PNG plot drawn with plotters.
//!
//! Input: lines `TEST<TAB>BYTES<TAB>TOOL<TAB>REP<TAB>VALUE`, where TOOL is `ours`
//! or the peer's name (`perftest`, `iperf3`). Bandwidth tests (`*_bw`) are
//! higher-is-better; latency tests (`*_lat`, t_typical in µs) lower-is-better.
//!
//! ```text
//! tidewire-perf-report --input raw.tsv --json out.json --png out.png \
//!     --check write_bw:65536:ge:0.95 --check write_lat:2:le:1.10
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use plotters::prelude::*;
use tidewire_bench::median;

#[derive(Parser)]
#[command(
    name = "tidewire-perf-report",
    about = "Medians, ratios, JSON and a PNG plot of a side-by-side run"
)]
struct Cli {
    /// The raw results (TEST BYTES TOOL REP VALUE, tab-separated).
    #[arg(long)]
    input: PathBuf,
    /// Write `{"rows":[{"test","bytes","ours",<peer>,"ratio",...}], "checks":[...]}` here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw the plot here (PNG).
    #[arg(long)]
    png: Option<PathBuf>,
    /// TEST:BYTES:ge|le:LIMIT, an acceptance check on the ratio ours/peer (repeatable).
    #[arg(long = "check")]
    checks: Vec<String>,
    /// Exit non-zero when a check fails.
    #[arg(long)]
    enforce: bool,
    /// A TTF font for the plot's text.
    #[arg(long, default_value = tidewire_bench::DEFAULT_FONT)]
    font: PathBuf,
}

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    test: String,
    bytes: u64,
    ours: f64,
    peer: String,
    peer_value: f64,
    ratio: f64,
    /// The median of ours/peer within each repetition (the two ran back to back).
    paired_ratio: Option<f64>,
    unit: &'static str,
    runs_ours: usize,
    runs_peer: usize,
}

fn unit(test: &str) -> &'static str {
    if test.ends_with("_lat") {
        "usec (t_typical)"
    } else {
        "MB/sec (BW average)"
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(3),
        Err(e) => {
            eprintln!("tidewire-perf-report: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// (test, bytes) -> tool -> (repetition, value).
type Samples = BTreeMap<(String, u64), BTreeMap<String, Vec<(String, f64)>>>;

fn parse(text: &str) -> Result<Samples, String> {
    let mut s: Samples = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() != 5 {
            return Err(format!("line {}: want 5 tab-separated fields, got {:?}", i + 1, line));
        }
        let bytes: u64 = f[1]
            .parse()
            .map_err(|_| format!("line {}: bad size {:?}", i + 1, f[1]))?;
        let v: f64 = f[4]
            .parse()
            .map_err(|_| format!("line {}: bad value {:?}", i + 1, f[4]))?;
        if !v.is_finite() || v <= 0.0 {
            return Err(format!("line {}: value {v} is not a positive measurement", i + 1));
        }
        s.entry((f[0].to_string(), bytes))
            .or_default()
            .entry(f[2].to_string())
            .or_default()
            .push((f[3].to_string(), v));
    }
    Ok(s)
}

fn rows(s: &Samples) -> Vec<Row> {
    let mut out = Vec::new();
    for ((test, bytes), tools) in s {
        let Some(ours) = tools.get("ours") else { continue };
        for (peer, pv) in tools.iter().filter(|(k, _)| k.as_str() != "ours") {
            let vals = |v: &Vec<(String, f64)>| v.iter().map(|x| x.1).collect::<Vec<f64>>();
            let (o, p) = (median(&vals(ours)), median(&vals(pv)));
            let paired: Vec<f64> = ours
                .iter()
                .filter_map(|(rep, a)| pv.iter().find(|(r, _)| r == rep).map(|(_, b)| a / b))
                .collect();
            out.push(Row {
                test: test.clone(),
                bytes: *bytes,
                ours: o,
                peer: peer.clone(),
                peer_value: p,
                ratio: o / p,
                paired_ratio: (!paired.is_empty()).then(|| median(&paired)),
                unit: unit(test),
                runs_ours: ours.len(),
                runs_peer: pv.len(),
            });
        }
    }
    out
}

fn run(cli: &Cli) -> Result<bool, String> {
    let text = std::fs::read_to_string(&cli.input).map_err(|e| format!("{}: {e}", cli.input.display()))?;
    let s = parse(&text)?;
    let rows = rows(&s);
    if rows.is_empty() {
        return Err(format!(
            "{}: no test has results from both ours and a peer",
            cli.input.display()
        ));
    }
    print_table(&rows);
    let (all_ok, checks) = run_checks(cli, &rows)?;
    if let Some(p) = &cli.json {
        write_json(p, &rows, checks)?;
        println!("json: {}", p.display());
    }
    if let Some(p) = &cli.png {
        plot(&rows, p, &cli.font)?;
        println!("png: {}", p.display());
    }
    Ok(all_ok || !cli.enforce)
}

/// The rows, as perftest's columns.
fn print_table(rows: &[Row]) {
    println!(
        "{:<10} {:>8}  {:>12}  {:>12}  {:>7}  {:>7}  {:>4}  unit",
        "test", "bytes", "ours", "peer", "ratio", "paired", "runs"
    );
    for r in rows {
        println!(
            "{:<10} {:>8}  {:>12.3}  {:>12.3}  {:>7.3}  {:>7}  {:>4}  {} (peer: {})",
            r.test,
            r.bytes,
            r.ours,
            r.peer_value,
            r.ratio,
            r.paired_ratio.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into()),
            r.runs_ours.min(r.runs_peer),
            r.unit,
            r.peer
        );
    }
    println!("ratio: median(ours) / median(peer); paired: the median of ours/peer within each repetition");
}

/// `--check TEST:BYTES:ge|le:LIMIT`, each printed: whether all pass, and
/// each as JSON.
fn run_checks(cli: &Cli, rows: &[Row]) -> Result<(bool, Vec<serde_json::Value>), String> {
    let mut all_ok = true;
    let mut checks = Vec::new();
    for c in &cli.checks {
        let f: Vec<&str> = c.split(':').collect();
        let bad = || format!("--check {c:?}: give TEST:BYTES:ge|le:LIMIT");
        if f.len() != 4 {
            return Err(bad());
        }
        let bytes: u64 = f[1].parse().map_err(|_| bad())?;
        let limit: f64 = f[3].parse().map_err(|_| bad())?;
        let r = rows
            .iter()
            .find(|r| r.test == f[0] && r.bytes == bytes)
            .ok_or_else(|| format!("--check {c}: no such row in the results"))?;
        let ok = match f[2] {
            "ge" => r.ratio >= limit,
            "le" => r.ratio <= limit,
            _ => return Err(bad()),
        };
        all_ok &= ok;
        println!(
            "check {} {} B: ratio {:.3} {} {} ... {}",
            r.test,
            bytes,
            r.ratio,
            if f[2] == "ge" { ">=" } else { "<=" },
            limit,
            if ok { "PASS" } else { "FAIL" }
        );
        checks.push(serde_json::json!({"test": r.test, "bytes": bytes, "ratio": r.ratio, "op": f[2], "limit": limit, "pass": ok}));
    }
    Ok((all_ok, checks))
}

/// The rows and the checks as JSON in `p`.
fn write_json(p: &std::path::Path, rows: &[Row], checks: Vec<serde_json::Value>) -> Result<(), String> {
    let j = serde_json::json!({
        "rows": rows.iter().map(|r| {
            let mut m = serde_json::json!({
                "test": r.test, "bytes": r.bytes, "ours": r.ours, "ratio": r.ratio, "paired_ratio": r.paired_ratio,
                "peer": r.peer, "unit": r.unit, "runs_ours": r.runs_ours, "runs_peer": r.runs_peer,
            });
            m[r.peer.as_str()] = serde_json::json!(r.peer_value);
            m
        }).collect::<Vec<_>>(),
        "checks": checks,
    });
    std::fs::write(p, serde_json::to_string_pretty(&j).expect("json") + "\n")
        .map_err(|e| format!("{}: {e}", p.display()))?;
    Ok(())
}

fn plot(rows: &[Row], path: &std::path::Path, font: &std::path::Path) -> Result<(), String> {
    tidewire_bench::register_font(font).map_err(|e| e.to_string())?;
    let tests: Vec<String> = {
        let mut t: Vec<String> = rows.iter().map(|r| r.test.clone()).collect();
        t.dedup();
        t
    };
    let width = 560 * tests.len().max(1) as u32;
    let root = BitMapBackend::new(path, (width, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((1, tests.len().max(1)));
    for (area, test) in panels.iter().zip(&tests) {
        plot_test(area, rows, test)?;
    }
    root.present().map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

/// One test's panel: ours against the peer over the message sizes, both axes log.
fn plot_test(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    rows: &[Row],
    test: &str,
) -> Result<(), String> {
    let rs: Vec<&Row> = rows.iter().filter(|r| r.test == test).collect();
    let peer = rs.first().map(|r| r.peer.clone()).unwrap_or_default();
    let xs: Vec<f64> = rs.iter().map(|r| (r.bytes as f64).log2()).collect();
    let (x0, x1) = (
        xs.iter().cloned().fold(f64::INFINITY, f64::min),
        xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
    );
    // Log scale: bandwidth and latency both span orders of magnitude across sizes.
    let ymax = rs.iter().map(|r| r.ours.max(r.peer_value)).fold(0.0, f64::max) * 1.5;
    let ymin = rs
        .iter()
        .map(|r| r.ours.min(r.peer_value))
        .fold(f64::INFINITY, f64::min)
        / 1.5;
    let (x0, x1) = if x1 > x0 { (x0, x1) } else { (x0 - 1.0, x1 + 1.0) };
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{test}: tidewire-perf vs {peer}"), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, (ymin.max(1e-9)..ymax.max(2e-9)).log_scale())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("message size (log2 bytes)")
        .y_desc(format!("{} (log scale)", unit(test)))
        .x_label_formatter(&size_label)
        .draw()
        .map_err(|e| e.to_string())?;
    let ours: Vec<(f64, f64)> = rs.iter().map(|r| ((r.bytes as f64).log2(), r.ours)).collect();
    let theirs: Vec<(f64, f64)> = rs.iter().map(|r| ((r.bytes as f64).log2(), r.peer_value)).collect();
    chart
        .draw_series(LineSeries::new(ours.clone(), BLUE.stroke_width(2)))
        .map_err(|e| e.to_string())?
        .label("tidewire-perf")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE.stroke_width(2)));
    chart
        .draw_series(ours.iter().map(|&p| Circle::new(p, 3, BLUE.filled())))
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(LineSeries::new(theirs.clone(), RED.stroke_width(2)))
        .map_err(|e| e.to_string())?
        .label(peer.clone())
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RED.stroke_width(2)));
    chart
        .draw_series(theirs.iter().map(|&p| TriangleMarker::new(p, 4, RED.filled())))
        .map_err(|e| e.to_string())?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// A message size's label on the log2 axis: 512, 4K, 1M.
fn size_label(v: &f64) -> String {
    let b = 2f64.powf(*v).round() as u64;
    if b >= 1 << 20 {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 {
        format!("{}K", b >> 10)
    } else {
        format!("{b}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_ratios() {
        let t = "write_bw\t65536\tours\t1\t40\nwrite_bw\t65536\tperftest\t1\t50\nwrite_bw\t65536\tours\t2\t48\n\
                 write_bw\t65536\tperftest\t2\t40\nwrite_bw\t65536\tours\t3\t44\nwrite_bw\t65536\tperftest\t3\t44\n";
        let r = rows(&parse(t).unwrap());
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].ours, r[0].peer_value, r[0].ratio), (44.0, 44.0, 1.0));
        // Per repetition: 40/50, 48/40, 44/44 -> median 1.0.
        assert_eq!(r[0].paired_ratio, Some(1.0));
        assert_eq!(r[0].runs_ours, 3);
    }

    #[test]
    fn bad_input_is_refused_with_the_line() {
        assert!(parse("write_bw\t2\tours\t1\n").unwrap_err().contains("line 1"));
        assert!(parse("write_bw\t2\tours\t1\tnan\n")
            .unwrap_err()
            .contains("not a positive"));
        assert!(parse("write_bw\tx\tours\t1\t3\n").unwrap_err().contains("bad size"));
    }
}
