//! `tidewire calibrate`: this machine's rates as a profile, for `train
//! --profile` and `sim --profile`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use tidewire::calibrate::{self, Profile};

use crate::error::{Error, Result};

/// Options of `tidewire calibrate`.
#[derive(Args, Debug, Clone)]
pub struct CalibrateArgs {
    /// Milliseconds spent on each rate (GEMM, sum, stream, message, and each
    /// of the curve's five batches), in every round: about 3 s a round at 300.
    #[arg(long, default_value_t = 300)]
    pub ms: u64,
    /// Rounds of measurements; the profile keeps each rate's median.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Write the profile (JSON) here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Serve one stream probe on this address, then exit (train's link probe
    /// under the bandwidth harness).
    #[arg(long, hide = true)]
    pub serve_stream: Option<std::net::SocketAddr>,
    /// Probe a --serve-stream at this address and print its bytes per second.
    #[arg(long, hide = true)]
    pub probe_stream: Option<std::net::SocketAddr>,
}

/// What `calibrate` prints: the profile, or a probe's rate.
#[derive(Debug)]
pub enum Outcome {
    /// A measured profile.
    Profile(Profile),
    /// A stream probe's bytes per second.
    Probe(f64),
    /// A served probe.
    Served,
}

/// Runs `calibrate`.
pub fn run(a: &CalibrateArgs) -> Result<Outcome> {
    let err = |e: tidewire::Error| Error::Launch(e.to_string());
    if let Some(addr) = a.serve_stream {
        calibrate::serve_stream(addr).map_err(err)?;
        return Ok(Outcome::Served);
    }
    if let Some(addr) = a.probe_stream {
        return Ok(Outcome::Probe(
            calibrate::probe_stream(addr, Duration::from_millis(500)).map_err(err)?,
        ));
    }
    if a.ms == 0 || a.ms > 60_000 {
        return Err(Error::Usage(format!(
            "--ms {}: give 1 to 60000 milliseconds per rate",
            a.ms
        )));
    }
    if a.rounds == 0 || a.rounds > 100 {
        return Err(Error::Usage(format!("--rounds {}: give 1 to 100", a.rounds)));
    }
    let p = calibrate::measure_rounds(Duration::from_millis(a.ms), a.rounds).map_err(err)?;
    if let Some(out) = &a.out {
        let json = serde_json::to_string_pretty(&p).expect("serializable");
        std::fs::write(out, json + "\n")
            .map_err(|e| Error::Launch(format!("cannot write the profile to {}: {e}", out.display())))?;
    }
    Ok(Outcome::Profile(p))
}

/// The profile as text.
pub fn render(p: &Profile) -> String {
    let r = &p.rates;
    let mem = match p.mem_bytes_per_s {
        Some(m) => format!("{:>8.2} GB/s", m / 1e9),
        None => "not measured (shared like the cores)".into(),
    };
    let curve: Vec<String> = p
        .gemm_by_k
        .iter()
        .map(|[k, f]| format!("K={k}: {:.1}", f / 1e9))
        .collect();
    let curve = if curve.is_empty() {
        String::new()
    } else {
        format!("  the GEMM at other batches, GFLOP/s        {}\n", curve.join(", "))
    };
    format!(
        "this machine, one thread each ({} cores):\n  GEMM (factors to gradient, K×M×N = {:?})  {:>8.1} GFLOP/s\n{curve}  sum into an accumulator (out of cache)    {:>8.2} GB/s\n  the same sum on every core at once        {mem}\n  one TCP stream ({})                 {:>8.2} GB/s\n  one small message, one way               {:>8.1} µs\n\
         `train --profile FILE` and `sim --profile FILE` divide these among the ranks that share the host.\n",
        p.cores,
        calibrate::gemm_shape(),
        r.gemm_flop_per_s / 1e9,
        r.sum_bytes_per_s / 1e9,
        p.link,
        r.link_bytes_per_s / 1e9,
        r.msg_s * 1e6
    )
}
