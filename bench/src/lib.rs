//! Benchmarks for Tidewire. The `tidewire-loopback` binary compares the
//! io_uring TCP backend with its peers on loopback, in one run:
//! one-sided write throughput against `iperf3`, and a 64-byte round trip
//! against a blocking `std::net` ping-pong. Criterion benches cover the
//! frame codec.

use std::time::Duration;

pub mod perf;

/// The font plots use, from Debian's `fonts-dejavu-core`.
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Why a font could not be used for the plots.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FontError {
    /// The file could not be read.
    #[error("font {path}: {source} (Debian: apt-get install fonts-dejavu-core, or give --font)")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a TrueType font plotters can draw with.
    #[error("{path}: not a usable TrueType font")]
    NotTrueType { path: std::path::PathBuf },
}

/// Registers the TrueType font at `path` as plotters' "sans-serif" (plotters'
/// bitmap backend draws text only with a registered font).
pub fn register_font(path: &std::path::Path) -> Result<(), FontError> {
    let bytes = std::fs::read(path).map_err(|source| FontError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes).map_err(|_| {
        FontError::NotTrueType {
            path: path.to_path_buf(),
        }
    })
}

/// Median of a non-empty sample (the mean of the middle two for even sizes).
pub fn median(v: &[f64]) -> f64 {
    assert!(!v.is_empty(), "median of nothing");
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Gbit/s for `bytes` moved in `d`.
pub fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 * 8.0 / d.as_secs_f64() / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!((gbps(1_000_000_000, Duration::from_secs(8)) - 1.0).abs() < 1e-9);
    }
}
