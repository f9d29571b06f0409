//! perftest's arithmetic: bandwidth (peak and average) from post and completion
//! timestamps, and latency statistics from round-trip deltas.

/// MiB (perftest's "MB/sec" is 2^20 bytes per second).
pub const MB: f64 = 1048576.0;
/// Gbit/s factor: bytes per second / 125e6.
pub const GBIT: f64 = 125_000_000.0;
/// perftest computes the peak only up to this many iterations (`-N` otherwise).
pub const PEAK_MAX_ITERS: usize = 20_000;
/// perftest drops this many of the largest latency samples.
pub const LAT_MEASURE_TAIL: usize = 2;

/// One row of the BW table.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct BwRow {
    pub bytes: u64,
    pub iterations: u64,
    pub bw_peak: f64,
    pub bw_average: f64,
    pub msg_rate_mpps: f64,
}

/// Bandwidth from per-message post times and per-signalled-message completion
/// times (nanoseconds from any origin), as perftest's `print_report_bw`.
///
/// `completed[j]` must be set for every `j` with `(j + 1) % cq_mod == 0` and for
/// `j = n - 1`; others are ignored. The peak is the best rate over any run of
/// messages from a post to a signalled completion; 0 when `no_peak`.
pub fn bw(
    size: u64,
    posted: &[u64],
    completed: &[u64],
    cq_mod: usize,
    post_list: usize,
    no_peak: bool,
    unit: f64,
) -> BwRow {
    let n = posted.len().min(completed.len());
    if n == 0 {
        return BwRow {
            bytes: size,
            ..Default::default()
        };
    }
    let cq_mod = cq_mod.max(1);
    let post_list = post_list.max(1);
    let mut opt = f64::INFINITY;
    if !no_peak && n <= PEAK_MAX_ITERS {
        let mut i = 0;
        while i < n {
            let mut j = (i + 1).div_ceil(cq_mod) * cq_mod - 1;
            while j < n {
                let t = completed[j].saturating_sub(posted[i]) as f64 / (j - i + 1) as f64;
                if t > 0.0 && t < opt {
                    opt = t;
                }
                j += cq_mod;
            }
            // The last chunk, when n is not a multiple of cq_mod.
            if (n - 1) % cq_mod != cq_mod - 1 {
                let t = completed[n - 1].saturating_sub(posted[i]) as f64 / (n - i) as f64;
                if t > 0.0 && t < opt {
                    opt = t;
                }
            }
            i += post_list;
        }
    }
    let total_ns = completed[n - 1].saturating_sub(posted[0]).max(1) as f64;
    let secs = total_ns / 1e9;
    let bw_average = size as f64 * n as f64 / secs / unit;
    let msg_rate = n as f64 / secs / 1e6;
    let bw_peak = if opt.is_finite() {
        size as f64 / (opt / 1e9) / unit
    } else {
        0.0
    };
    BwRow {
        bytes: size,
        iterations: n as u64,
        bw_peak,
        bw_average,
        msg_rate_mpps: msg_rate,
    }
}

/// Bandwidth of a duration-mode run: `n` messages of `size` in `secs` (no peak, as perftest).
pub fn bw_duration(size: u64, n: u64, secs: f64, unit: f64) -> BwRow {
    let secs = secs.max(1e-9);
    BwRow {
        bytes: size,
        iterations: n,
        bw_peak: 0.0,
        bw_average: size as f64 * n as f64 / secs / unit,
        msg_rate_mpps: n as f64 / secs / 1e6,
    }
}

/// One row of the latency table, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct LatRow {
    pub bytes: u64,
    pub iterations: u64,
    pub t_min: f64,
    pub t_max: f64,
    pub t_typical: f64,
    pub t_avg: f64,
    pub t_stdev: f64,
    pub p99: f64,
    pub p99_9: f64,
}

/// Latency from the post times of each iteration (nanoseconds), as perftest's
/// `print_report_lat`: deltas between consecutive posts, sorted, the largest
/// [`LAT_MEASURE_TAIL`] dropped; divided by `rtt_factor` (2 for ping-pong
/// tests, 1 for reads). `t_typical` is the median.
pub fn lat(size: u64, posted: &[u64], rtt_factor: f64) -> LatRow {
    let mut d: Vec<f64> = posted
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]) as f64 / 1000.0)
        .collect();
    lat_from_deltas(size, posted.len() as u64, &mut d, rtt_factor)
}

/// As [`lat`], from per-iteration round trips in microseconds (duration mode).
pub fn lat_from_deltas(size: u64, iterations: u64, d: &mut [f64], rtt_factor: f64) -> LatRow {
    if d.is_empty() {
        return LatRow {
            bytes: size,
            iterations,
            ..Default::default()
        };
    }
    d.sort_by(|a, b| a.total_cmp(b));
    let all = d.len();
    let cnt = if all > LAT_MEASURE_TAIL + 1 {
        all - LAT_MEASURE_TAIL
    } else {
        all
    };
    let median = if cnt % 2 == 0 {
        (d[cnt / 2 - 1] + d[cnt / 2]) / 2.0
    } else {
        d[cnt / 2]
    };
    let avg = d[..cnt].iter().sum::<f64>() / cnt as f64;
    let var = d[..cnt].iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / cnt as f64;
    let at = |i: usize| d[i.min(all - 1)];
    let i99 = (cnt as f64 * 0.99).ceil() as usize;
    let i999 = (cnt as f64 * 0.999).ceil() as usize;
    LatRow {
        bytes: size,
        iterations,
        t_min: d[0] / rtt_factor,
        t_max: at(cnt) / rtt_factor,
        t_typical: median / rtt_factor,
        t_avg: avg / rtt_factor,
        t_stdev: var.sqrt() / rtt_factor,
        p99: at(i99) / rtt_factor,
        p99_9: at(i999) / rtt_factor,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_stream_gives_equal_peak_and_average() {
        // 100 messages of 1 MiB, one posted every 1 ms and completed 1 ms later.
        let posted: Vec<u64> = (0..100).map(|i| i * 1_000_000).collect();
        let completed: Vec<u64> = posted.iter().map(|p| p + 1_000_000).collect();
        let r = bw(1 << 20, &posted, &completed, 1, 1, false, MB);
        // Average: 100 MiB in 100 ms; peak: best window, 1 MiB per ms -> 1000 MiB/s.
        assert!((r.bw_average - 1000.0).abs() < 1e-6, "{r:?}");
        assert!((r.bw_peak - 1000.0).abs() < 1e-6, "{r:?}");
        assert!((r.msg_rate_mpps - 0.001).abs() < 1e-12);
        let g = bw(1 << 20, &posted, &completed, 1, 1, false, GBIT);
        assert!((g.bw_average - 1000.0 * MB / GBIT).abs() < 1e-6);
    }

    #[test]
    fn cq_moderation_only_reads_signalled_completions() {
        let n = 10;
        let posted: Vec<u64> = (0..n).map(|i| i * 100).collect();
        let mut completed = vec![0u64; n as usize];
        // Signalled every 4th (indices 3, 7) and the last (9).
        completed[3] = 1000;
        completed[7] = 1400;
        completed[9] = 2000;
        let r = bw(100, &posted, &completed, 4, 1, false, MB);
        // Best window: from post 0 (t=0) to the signalled completion 7 (t=1400): 8 messages
        // in 1400 ns, 175 ns each (better than 0..3 at 250, 4..7 at 250, or 0..9 at 200).
        let best = 100.0 / (175.0 / 1e9) / MB;
        assert!((r.bw_peak - best).abs() / best < 1e-9, "{r:?}");
        assert!(bw(100, &posted, &completed, 4, 1, true, MB).bw_peak == 0.0);
    }

    #[test]
    fn latency_statistics_follow_perftest() {
        // 11 posts -> 10 round trips: 8 of 20 µs, then 30 and 100 (the tail, dropped from the average).
        let mut t = vec![0u64];
        for rt in [20, 20, 20, 20, 20, 20, 20, 20, 30, 100] {
            t.push(t.last().unwrap() + rt * 1000);
        }
        let r = lat(2, &t, 2.0);
        assert_eq!(r.iterations, 11);
        assert_eq!(r.t_min, 10.0);
        assert_eq!(r.t_typical, 10.0);
        assert_eq!(r.t_avg, 10.0);
        assert_eq!(r.t_stdev, 0.0);
        // t_max is the first dropped sample (perftest's delta[measure_cnt]).
        assert_eq!(r.t_max, 15.0);
        assert_eq!(r.p99, 15.0);
        let one = lat(2, &[0, 4000], 1.0);
        assert_eq!((one.t_min, one.t_max), (4.0, 4.0));
        assert_eq!(lat(2, &[5], 1.0).t_avg, 0.0);
    }
}
