//! `tidewire doctor`: what this machine can use, and why not.

use serde::Serialize;
use tidewire_transport::probe::{self, Capability};

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub area: &'static str,
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

fn from(area: &'static str, c: Capability) -> Check {
    Check {
        area,
        name: c.name,
        ok: c.ok,
        detail: c.detail,
    }
}

/// The name of the portable backend's check.
pub const PORTABLE: &str = "portable epoll TCP";

/// Runs every probe.
pub fn run() -> Vec<Check> {
    let mut out = Vec::new();
    out.extend(probe::io_uring().into_iter().map(|c| from("io_uring", c)));
    out.push(from("io_uring", probe::portable()));
    out.extend(probe::rdma().into_iter().map(|c| from("rdma", c)));
    let cuda = tidewire_gpu::probe();
    out.push(Check {
        area: "cuda",
        name: "cuda".into(),
        ok: cuda.usable,
        detail: cuda.detail,
    });
    for (name, ok, detail) in tidewire_gpu::library_checks() {
        out.push(Check {
            area: "cuda",
            name: name.into(),
            ok,
            detail,
        });
    }
    out.push(from("memory", probe::memlock()));
    out.extend(probe::huge_pages().into_iter().map(|c| from("memory", c)));
    out
}

/// Renders the report as text: one line per check, then what the default backend will be.
pub fn render(checks: &[Check]) -> String {
    let mut s = String::new();
    let mut area = "";
    for c in checks {
        if c.area != area {
            area = c.area;
            s.push_str(&format!("\n[{area}]\n"));
        }
        s.push_str(&format!(
            "  {:<4} {:<36} {}\n",
            if c.ok { "ok" } else { "NO" },
            c.name,
            c.detail
        ));
    }
    let uring = checks.iter().find(|c| c.name == "io_uring").is_some_and(|c| c.ok);
    let rdma = checks
        .iter()
        .find(|c| c.name == "rdma (transport auto)")
        .filter(|c| c.ok);
    s.push_str(&format!(
        "\ndefault transport (auto): {}\n",
        match (rdma, uring) {
            (Some(r), _) => format!("RDMA verbs ({}); the control plane is io_uring TCP", r.detail),
            (None, true) => "io_uring TCP (no usable RDMA device; see [rdma] above)".into(),
            (None, false) => {
                let why = checks
                    .iter()
                    .find(|c| c.name == "io_uring")
                    .map(|c| c.detail.as_str())
                    .unwrap_or("no io_uring check ran");
                let portable = checks.iter().find(|c| c.name == PORTABLE).is_some_and(|c| c.ok);
                if portable {
                    format!(
                        "portable epoll TCP: io_uring is unusable here ({why}); the portable backend speaks the same \
                         protocol and mixes with io_uring ranks (TIDEWIRE_TRANSPORT=portable forces it anywhere)"
                    )
                } else {
                    format!("none: io_uring is unusable ({why}) and the portable backend failed too (see above)")
                }
            }
        }
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_missing_capability_says_why() {
        let checks = run();
        for area in ["io_uring", "rdma", "cuda", "memory"] {
            assert!(checks.iter().any(|c| c.area == area), "no {area} check");
        }
        // What is missing must say why, and what to do about it.
        for c in checks.iter().filter(|c| !c.ok) {
            assert!(
                c.detail.len() > 30,
                "{} is missing but explains nothing: {:?}",
                c.name,
                c.detail
            );
        }
        // No RDMA device on the machines this runs on (the VM tier checks devices):
        // either the feature is off, or the probe says why nothing is usable.
        let rdma = checks.iter().find(|c| c.area == "rdma").unwrap();
        assert!(!rdma.ok, "{rdma:?}");
        if cfg!(feature = "rdma") {
            assert!(
                rdma.detail.contains("RDMA unavailable") || rdma.detail.contains("no device"),
                "{rdma:?}"
            );
        } else {
            assert!(rdma.detail.contains("--features rdma"), "{rdma:?}");
        }
        let cuda = checks.iter().find(|c| c.area == "cuda").unwrap();
        assert!(!cuda.ok && cuda.detail.contains("cuda"), "{cuda:?}");
        let text = render(&checks);
        assert!(text.contains("default transport"));
        // The portable backend works wherever epoll does, and the summary names the
        // io_uring TCP backend or, where io_uring is unusable, the portable one and why.
        let portable = checks.iter().find(|c| c.name == PORTABLE).unwrap();
        assert!(portable.ok, "{portable:?}");
        let uring = checks.iter().find(|c| c.name == "io_uring").unwrap();
        if uring.ok {
            assert!(text.contains("io_uring TCP"), "{text}");
        } else {
            assert!(text.contains("portable epoll TCP: io_uring is unusable"), "{text}");
        }
        assert!(text.contains("memlock"));
    }
}
