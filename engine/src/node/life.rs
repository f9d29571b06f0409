//! A [`super::Node`]'s lifecycle as one value, [`Life`]: setup, running,
//! and the goodbye's steps. It names nothing of the Node's, so the Node can
//! hold it without an import cycle.

/// Where a [`super::Node`] is in its life. It only ever moves forward (the order of
/// the variants), except that a shutdown asked for during setup is kept in
/// `Setup` until setup completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Life {
    /// Connecting, agreeing and seeding; `shutdown` once the caller asked to
    /// leave (the rank drains as soon as it is ready).
    Setup { shutdown: bool },
    /// Ready ([`super::Output::Ready`]), training.
    Running,
    /// The caller asked to leave: the worker drains its layers in flight.
    Draining,
    /// This rank said `Finished` (a worker to every peer; a server-only rank
    /// has nothing to finish): it pushes nothing more.
    FinishedSent,
    /// This rank said `Bye` to every peer: its server owes nothing more.
    ByeSent,
    /// Every peer said goodbye and nothing is in flight ([`super::Output::Finished`]).
    Done,
}

impl Life {
    /// Setup is complete.
    pub(super) fn ready(self) -> bool {
        !matches!(self, Life::Setup { .. })
    }

    /// The caller asked to leave.
    pub(super) fn shutdown(self) -> bool {
        matches!(self, Life::Setup { shutdown: true }) || self >= Life::Draining
    }

    /// The caller's [`super::Input::Shutdown`]: idempotent.
    pub(super) fn request_shutdown(&mut self) {
        match *self {
            Life::Setup { .. } => *self = Life::Setup { shutdown: true },
            Life::Running => *self = Life::Draining,
            _ => {}
        }
        debug_assert!(self.shutdown());
    }

    /// One step forward to `to`, the next state after this one.
    pub(super) fn advance(&mut self, to: Life) {
        debug_assert!(to > *self, "life goes forward: {self:?} to {to:?}");
        debug_assert!(
            to == Life::Running || self.shutdown(),
            "the goodbye starts only after a shutdown: {self:?} to {to:?}"
        );
        *self = to;
    }
}
