//! The error every perf step returns. It has its own module so that `oob` and the
//! rest of `perf` share it without importing one another.

/// An error that ends the run, with what went wrong and, where it helps, what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerfError(pub String);

impl PerfError {
    /// From a message.
    pub fn new(s: impl Into<String>) -> Self {
        PerfError(s.into())
    }
}

impl std::fmt::Display for PerfError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PerfError {}

impl From<tidewire_transport::Error> for PerfError {
    fn from(e: tidewire_transport::Error) -> Self {
        PerfError(e.to_string())
    }
}
