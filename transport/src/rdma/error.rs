//! Verbs failures as [`Error`]s.

use crate::error::Error;

pub(crate) fn verbs(op: &'static str, device: &str, source: std::io::Error) -> Error {
    Error::Verbs {
        op,
        device: device.to_string(),
        source,
    }
}

pub(crate) fn io_of<E: std::error::Error + 'static>(e: E) -> std::io::Error {
    // sideway errors wrap an io::Error as their source; keep its errno when there is one.
    let mut src: Option<&dyn std::error::Error> = Some(&e);
    while let Some(s) = src {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if let Some(code) = io.raw_os_error() {
                return std::io::Error::from_raw_os_error(code);
            }
        }
        src = s.source();
    }
    // No errno: keep every message of the chain.
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    std::io::Error::other(msg)
}
