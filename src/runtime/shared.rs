//! What the session and the runtime thread share: the calls the session
//! makes, and the state it reads without a round trip.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crossbeam_channel::Sender;
use tidewire_transport::Waker;

use crate::buffers::LayerBuffers;
use crate::error::{Error, Result};
use crate::stats::SessionStats;

/// A call from the session.
#[derive(Debug)]
pub(crate) enum Request {
    HandIn {
        buf: LayerBuffers,
        factors: bool,
        at: Instant,
    },
    Wait {
        layer: u32,
        reply: Sender<Result<LayerBuffers>>,
    },
    WaitAll {
        reply: Sender<Result<Vec<LayerBuffers>>>,
    },
    Stats {
        reply: Sender<Result<SessionStats>>,
    },
    Shutdown {
        reply: Sender<Result<()>>,
    },
    Abort(String),
}

/// State the session reads directly.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    fatal: Mutex<Option<Error>>,
    /// The backend the runtime opened ("tcp", "portable" or "rdma") and why.
    transport: Mutex<Option<(String, String)>>,
    /// The first panic of a runtime thread, with its message.
    pub(crate) panic: Arc<Mutex<Option<String>>>,
    /// Wakes the runtime thread after a request is queued.
    waker: Mutex<Option<Waker>>,
    /// The counters as the runtime left them (a server-only rank's work is
    /// all done inside `shutdown`): what `Session::stats` returns afterwards.
    last_stats: Mutex<Option<crate::stats::SessionStats>>,
    /// The schemes by iteration as this rank's Node knows them (adaptive
    /// books: after each decision), and worker 0's decisions with the
    /// window times they came from.
    plan: Mutex<Option<(tidewire_engine::Plan, Option<Vec<tidewire_engine::adapt::Decision>>)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    pub(crate) fn set_plan(&self, plan: tidewire_engine::Plan, log: Option<Vec<tidewire_engine::adapt::Decision>>) {
        *lock(&self.plan) = Some((plan, log));
    }
    pub(crate) fn plan(&self) -> Option<(tidewire_engine::Plan, Option<Vec<tidewire_engine::adapt::Decision>>)> {
        lock(&self.plan).clone()
    }
    pub(crate) fn set_transport(&self, kind: &str, reason: &str) {
        *lock(&self.transport) = Some((kind.into(), reason.into()));
    }
    pub(crate) fn transport(&self) -> Option<(String, String)> {
        lock(&self.transport).clone()
    }
    pub(crate) fn fatal(&self) -> Option<Error> {
        lock(&self.fatal).clone()
    }
    pub(crate) fn set_fatal(&self, e: Error) {
        let mut f = lock(&self.fatal);
        if f.is_none() {
            *f = Some(e);
        }
    }
    pub(crate) fn set_waker(&self, w: Waker) {
        *lock(&self.waker) = Some(w);
    }
    pub(crate) fn wake(&self) {
        if let Some(w) = lock(&self.waker).as_ref() {
            w.wake();
        }
    }
    pub(crate) fn set_last_stats(&self, s: crate::stats::SessionStats) {
        *lock(&self.last_stats) = Some(s);
    }
    pub(crate) fn last_stats(&self) -> Option<crate::stats::SessionStats> {
        *lock(&self.last_stats)
    }
    /// Re-raises a runtime thread's panic on the caller's thread.
    pub(crate) fn check_panic(&self) {
        if let Some(msg) = lock(&self.panic).clone() {
            panic!("the tidewire runtime panicked: {msg}");
        }
    }
}
