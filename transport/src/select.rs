//! Transport selection: `Auto` takes RDMA when a usable device with an ACTIVE
//! port exists, and the io_uring TCP backend otherwise, and says which and why.
//! Where io_uring cannot be set up (`kernel.io_uring_disabled`, a seccomp
//! profile such as Docker's default, gVisor), `Auto` and `Tcp` fall back to the
//! portable epoll TCP backend, which speaks the same protocol, and the reason
//! says so. `TIDEWIRE_TRANSPORT=tcp|portable|rdma|auto` overrides the caller's
//! preference.

use crate::api::Transport;
use crate::error::{Error, Result};
use crate::portable::PortableTransport;
use crate::tcp::{TcpConfig, TcpTransport};

/// Which backend the caller wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preference {
    /// RDMA when usable, else TCP.
    #[default]
    Auto,
    /// TCP: io_uring, or the portable epoll backend where io_uring is unavailable.
    Tcp,
    /// The portable epoll TCP backend, even where io_uring works.
    Portable,
    /// RDMA verbs only: an error when unusable.
    Rdma,
}

impl Preference {
    /// Applies `TIDEWIRE_TRANSPORT`, when set.
    pub fn from_env(self) -> Result<Self> {
        match std::env::var("TIDEWIRE_TRANSPORT").ok().as_deref() {
            None | Some("") => Ok(self),
            Some("auto") => Ok(Preference::Auto),
            Some("tcp") => Ok(Preference::Tcp),
            Some("portable") => Ok(Preference::Portable),
            Some("rdma") => Ok(Preference::Rdma),
            Some(o) => Err(Error::InvalidArgument {
                op: "TIDEWIRE_TRANSPORT",
                reason: format!("{o:?}: use tcp, portable, rdma or auto"),
            }),
        }
    }
}

/// The opened transport, which backend it is, and why it was chosen.
pub struct Selected {
    pub transport: Box<dyn Transport>,
    /// `"tcp"` (io_uring), `"portable"` (epoll) or `"rdma"`.
    pub kind: &'static str,
    pub reason: String,
}

impl std::fmt::Debug for Selected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Selected")
            .field("kind", &self.kind)
            .field("reason", &self.reason)
            .finish()
    }
}

/// Knobs of the RDMA backend a caller may set before it opens (message size, say).
#[cfg(feature = "rdma")]
pub type RdmaTweak<'a> = &'a dyn Fn(&mut crate::rdma::RdmaConfig);
#[cfg(not(feature = "rdma"))]
pub type RdmaTweak<'a> = &'a dyn Fn(&mut ());

/// Opens a transport by preference (after `TIDEWIRE_TRANSPORT`), logging the choice.
pub fn open(pref: Preference, control: TcpConfig, tweak: RdmaTweak<'_>) -> Result<Selected> {
    let pref = pref.from_env()?;
    let portable = |reason: String| -> Result<Selected> {
        let t = PortableTransport::new(control.clone())?;
        Ok(Selected {
            transport: Box::new(t),
            kind: "portable",
            reason,
        })
    };
    // io_uring TCP with `why`, or the portable backend where io_uring is unavailable
    // (its reason: `fallback`, the io_uring error, and what is used instead).
    let tcp = |why: String, fallback: String| -> Result<Selected> {
        match TcpTransport::new(control.clone()) {
            Ok(t) => Ok(Selected {
                transport: Box::new(t),
                kind: "tcp",
                reason: why,
            }),
            Err(e @ Error::UringUnavailable { .. }) => {
                // Expected in containers (Docker's default seccomp profile): the reason goes
                // into `Selected::reason`, which the caller reports; not a warning.
                tracing::info!(error = %e, "io_uring unavailable; using the portable epoll TCP backend");
                portable(format!("{fallback}{e}; using the portable epoll TCP backend"))
            }
            Err(e) => Err(e),
        }
    };
    let chosen = match pref {
        Preference::Tcp => tcp(
            "TCP requested (TIDEWIRE_TRANSPORT=tcp or the caller's choice)".into(),
            "TCP requested; ".into(),
        ),
        Preference::Portable => {
            portable("portable epoll TCP requested (TIDEWIRE_TRANSPORT=portable or the caller's choice)".into())
        }
        Preference::Rdma => open_rdma(&control, tweak),
        Preference::Auto => match open_rdma(&control, tweak) {
            Ok(s) => Ok(s),
            Err(e) => tcp(
                format!("falling back to io_uring TCP: {e}"),
                format!("falling back to TCP: {e}; "),
            ),
        },
    }?;
    tracing::info!(transport = chosen.kind, reason = %chosen.reason, "transport selected");
    Ok(chosen)
}

/// Whether io_uring can be set up here: `Ok(())`, or the error that says
/// why it cannot (what `tidewire doctor` reports).
pub fn uring_usable() -> Result<()> {
    let cfg = TcpConfig::new(0, 0, crate::JobSecret::new(b"probe".to_vec()));
    TcpTransport::new(cfg).map(|_| ())
}

#[cfg(feature = "rdma")]
fn open_rdma(control: &TcpConfig, tweak: RdmaTweak<'_>) -> Result<Selected> {
    let mut cfg = crate::rdma::RdmaConfig::new(control.clone()).from_env()?;
    tweak(&mut cfg);
    let t = crate::rdma::RdmaTransport::new(cfg)?;
    let (dev, port, gid) = t.device();
    let reason = format!(
        "RDMA device {dev} port {port} is ACTIVE (GID index {gid}, MTU {})",
        t.mtu_bytes()
    );
    Ok(Selected {
        transport: Box::new(t),
        kind: "rdma",
        reason,
    })
}

#[cfg(not(feature = "rdma"))]
fn open_rdma(_: &TcpConfig, _: RdmaTweak<'_>) -> Result<Selected> {
    Err(Error::RdmaUnavailable {
        reason: "this binary was built without the `rdma` feature (rebuild with `--features rdma`)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobSecret;

    #[test]
    fn env_override_and_fallback() {
        // Without a usable RDMA device (this test's hosts), Auto falls back and says why;
        // where a device is usable it must have picked it.
        let cfg = TcpConfig::new(1, 0, JobSecret::new(b"s".to_vec()));
        std::env::remove_var("TIDEWIRE_TRANSPORT");
        let s = open(Preference::Auto, cfg.clone(), &|_| {}).unwrap();
        match s.kind {
            "tcp" | "portable" => {
                assert!(
                    s.reason.contains("falling back") && s.reason.contains("RDMA unavailable"),
                    "{}",
                    s.reason
                );
                let e = open(Preference::Rdma, cfg.clone(), &|_| {}).unwrap_err();
                assert!(matches!(e, Error::RdmaUnavailable { .. }), "{e}");
            }
            _ => assert!(s.reason.contains("ACTIVE"), "{}", s.reason),
        }
        let t = open(Preference::Tcp, cfg.clone(), &|_| {}).unwrap();
        match uring_usable() {
            Ok(()) => {
                assert_eq!(t.kind, "tcp");
                assert!(t.transport.properties().name.contains("io_uring"));
            }
            Err(why) => {
                // io_uring denied here: TCP falls back to the portable backend and says why.
                assert_eq!(t.kind, "portable", "{why}");
                assert!(t.reason.contains("io_uring unavailable"), "{}", t.reason);
                assert!(t.reason.contains("portable epoll"), "{}", t.reason);
            }
        }
        let p = open(Preference::Portable, cfg.clone(), &|_| {}).unwrap();
        assert_eq!(p.kind, "portable");
        assert_eq!(p.transport.properties().name, "tcp-portable");
        std::env::set_var("TIDEWIRE_TRANSPORT", "portable");
        let p = open(Preference::Tcp, cfg.clone(), &|_| {}).unwrap();
        assert_eq!(p.kind, "portable");
        assert!(p.reason.contains("TIDEWIRE_TRANSPORT=portable"), "{}", p.reason);
        std::env::set_var("TIDEWIRE_TRANSPORT", "carrier-pigeon");
        let e = open(Preference::Auto, cfg, &|_| {}).unwrap_err();
        std::env::remove_var("TIDEWIRE_TRANSPORT");
        assert!(e.to_string().contains("tcp, portable, rdma or auto"), "{e}");
    }
}
