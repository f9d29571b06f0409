//! Error codes, the thread-local last error, and the guard every call runs in.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use tidewire::engine::EngineError;

/// Success.
pub const TW_OK: c_int = 0;
/// A null pointer, a size that does not match the layer table, a value out of
/// range, an unknown layer, or the wrong push for a layer's scheme.
pub const TW_ERR_INVALID_ARGUMENT: c_int = -1;
/// The cluster description (environment variables, rank, world size, master
/// address) is missing or inconsistent, rendezvous failed, or the ranks were
/// started with different configurations.
pub const TW_ERR_CLUSTER: c_int = -2;
/// A wait, the rendezvous or a peer ran past the configured timeout.
pub const TW_ERR_TIMEOUT: c_int = -3;
/// The session is shut down.
pub const TW_ERR_SHUTDOWN: c_int = -4;
/// The transport failed, or the transport asked for is unavailable here.
pub const TW_ERR_TRANSPORT: c_int = -5;
/// The registered memory does not fit the layer table (or is missing).
pub const TW_ERR_LAYOUT: c_int = -6;
/// The engine failed (protocol violation, aggregation, a thread that could not start).
pub const TW_ERR_ENGINE: c_int = -7;
/// A call out of order: a layer pushed twice without a pull, a layer lost by an
/// earlier failure, a push on a server-only rank, a layer added after tw_register.
pub const TW_ERR_STATE: c_int = -8;
/// A peer rank was lost or aborted the job.
pub const TW_ERR_PEER_LOST: c_int = -9;
/// Tidewire panicked inside the call (a bug); the message says where. A session
/// on which a call panicked refuses every later call but tw_finalize.
pub const TW_ERR_PANIC: c_int = -10;

/// A failure on its way to C: its code and message.
#[derive(Debug)]
pub(crate) struct Fail {
    pub(crate) code: c_int,
    pub(crate) msg: String,
}

impl Fail {
    pub(crate) fn new(code: c_int, msg: impl Into<String>) -> Self {
        Fail { code, msg: msg.into() }
    }
    pub(crate) fn arg(msg: impl Into<String>) -> Self {
        Fail::new(TW_ERR_INVALID_ARGUMENT, msg)
    }
    pub(crate) fn state(msg: impl Into<String>) -> Self {
        Fail::new(TW_ERR_STATE, msg)
    }
    pub(crate) fn null(what: &str) -> Self {
        Fail::arg(format!("{what} is NULL"))
    }
}

/// The code of each class of [`tidewire::Error`].
pub(crate) fn code_of(e: &tidewire::Error) -> c_int {
    use tidewire::Error as E;
    if e.is_timeout() {
        return TW_ERR_TIMEOUT;
    }
    if e.is_peer_lost() {
        return TW_ERR_PEER_LOST;
    }
    match e {
        E::Shutdown | E::Engine(EngineError::Shutdown) => TW_ERR_SHUTDOWN,
        E::Cluster(_) | E::Rendezvous(_) | E::Engine(EngineError::Disagree { .. }) => TW_ERR_CLUSTER,
        E::Transport(_) | E::TransportUnavailable(_) => TW_ERR_TRANSPORT,
        E::Layout(_) | E::Engine(EngineError::WrongSize { .. }) => TW_ERR_LAYOUT,
        E::NotHandedIn { .. } | E::LayerState { .. } | E::Role { .. } | E::Engine(EngineError::LayerBusy { .. }) => {
            TW_ERR_STATE
        }
        E::Engine(
            EngineError::UnknownLayer { .. }
            | EngineError::NeedsFactors { .. }
            | EngineError::NotFullyConnected { .. }
            | EngineError::InvalidConfig(_)
            | EngineError::UnsupportedDType { .. },
        ) => TW_ERR_INVALID_ARGUMENT,
        _ => TW_ERR_ENGINE,
    }
}

impl From<tidewire::Error> for Fail {
    fn from(e: tidewire::Error) -> Self {
        Fail::new(code_of(&e), e.to_string())
    }
}

impl From<tidewire::transport::Error> for Fail {
    fn from(e: tidewire::transport::Error) -> Self {
        tidewire::Error::from(e).into()
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's last error. Never panics.
pub(crate) fn set_last_error(call: &str, msg: &str) {
    let text = format!("{call}: {msg}").replace('\0', "\\0");
    let text = CString::new(text).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            *c = text;
        }
    });
}

use tidewire::error::panic_message;

/// Runs `f` for the C call `call`: a failure becomes its code and this thread's
/// last error, a panic becomes `TW_ERR_PANIC`. Nothing unwinds past here.
pub(crate) fn guard(call: &str, f: impl FnOnce() -> Result<c_int, Fail>) -> c_int {
    guard_with(call, TW_ERR_PANIC, |fail| fail.code, f)
}

/// Like [`guard`] for calls that return a pointer: NULL on failure.
pub(crate) fn guard_ptr<T>(call: &str, f: impl FnOnce() -> Result<*mut T, Fail>) -> *mut T {
    guard_with(call, std::ptr::null_mut(), |_| std::ptr::null_mut(), f)
}

fn guard_with<T>(call: &str, on_panic: T, on_fail: impl FnOnce(&Fail) -> T, f: impl FnOnce() -> Result<T, Fail>) -> T {
    // AssertUnwindSafe: after a panic nothing observes broken state: a session's
    // state sits behind a Mutex, which a panic poisons (every later call on it but
    // tw_finalize then fails with TW_ERR_PANIC), and a config is plain data.
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(fail)) => {
            set_last_error(call, &fail.msg);
            on_fail(&fail)
        }
        Err(p) => {
            // The payload's own drop could panic in turn: keep it from unwinding.
            let msg = catch_unwind(AssertUnwindSafe(|| panic_message(&*p))).unwrap_or_default();
            let _ = catch_unwind(AssertUnwindSafe(move || drop(p)));
            set_last_error(call, &format!("panicked: {msg}"));
            on_panic
        }
    }
}

/// The message of the last failed `tw_` call on the calling thread ("" if none
/// has failed). Successful calls leave it as it is. The string stays valid
/// until the next failing call on this thread; copy it to keep it.
#[no_mangle]
pub extern "C" fn tw_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|c| c.try_borrow().map(|s| s.as_ptr()).ok())
        .ok()
        .flatten()
        .unwrap_or(c"".as_ptr())
}

/// The name of an error code ("TW_OK", "TW_ERR_TIMEOUT", ...; "TW_ERR_UNKNOWN"
/// for a value that is none). A static string.
#[no_mangle]
pub extern "C" fn tw_error_name(code: c_int) -> *const c_char {
    match code {
        TW_OK => c"TW_OK",
        TW_ERR_INVALID_ARGUMENT => c"TW_ERR_INVALID_ARGUMENT",
        TW_ERR_CLUSTER => c"TW_ERR_CLUSTER",
        TW_ERR_TIMEOUT => c"TW_ERR_TIMEOUT",
        TW_ERR_SHUTDOWN => c"TW_ERR_SHUTDOWN",
        TW_ERR_TRANSPORT => c"TW_ERR_TRANSPORT",
        TW_ERR_LAYOUT => c"TW_ERR_LAYOUT",
        TW_ERR_ENGINE => c"TW_ERR_ENGINE",
        TW_ERR_STATE => c"TW_ERR_STATE",
        TW_ERR_PEER_LOST => c"TW_ERR_PEER_LOST",
        TW_ERR_PANIC => c"TW_ERR_PANIC",
        _ => c"TW_ERR_UNKNOWN",
    }
    .as_ptr()
}

/// The library's version ("0.1.0"). A static string.
#[no_mangle]
pub extern "C" fn tw_version() -> *const c_char {
    const V: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    V.as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;
    use tidewire::engine::ProtocolViolation;

    fn last() -> String {
        // SAFETY: tw_last_error returns a NUL-terminated string valid until the next
        // failing call on this thread; it is copied at once.
        unsafe { CStr::from_ptr(tw_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_code_and_a_message() {
        assert_eq!(guard("tw_test", || panic!("boom {}", 42)), TW_ERR_PANIC);
        assert_eq!(last(), "tw_test: panicked: boom 42");
        assert!(guard_ptr::<u8>("tw_test_ptr", || panic!("static boom")).is_null());
        assert_eq!(last(), "tw_test_ptr: panicked: static boom");
        assert_eq!(guard("tw_ok", || Ok(5)), 5);
        assert_eq!(
            last(),
            "tw_test_ptr: panicked: static boom",
            "successes keep the message"
        );
    }

    #[test]
    fn messages_with_nul_bytes_survive() {
        assert_eq!(guard("tw_nul", || Err(Fail::arg("a\0b"))), TW_ERR_INVALID_ARGUMENT);
        assert_eq!(last(), "tw_nul: a\\0b");
    }

    #[test]
    fn errors_map_to_their_class() {
        use std::time::Duration;
        use tidewire::Error as E;
        let cases = [
            (E::Shutdown, TW_ERR_SHUTDOWN),
            (E::Cluster("x".into()), TW_ERR_CLUSTER),
            (E::Rendezvous("x".into()), TW_ERR_CLUSTER),
            (
                E::Timeout {
                    what: "x".into(),
                    after: Duration::from_secs(1),
                },
                TW_ERR_TIMEOUT,
            ),
            (E::Layout("x".into()), TW_ERR_LAYOUT),
            (E::TransportUnavailable("x".into()), TW_ERR_TRANSPORT),
            (E::NotHandedIn { layer: 1 }, TW_ERR_STATE),
            (
                E::Role {
                    rank: 1,
                    role: "worker",
                },
                TW_ERR_STATE,
            ),
            (
                E::Engine(EngineError::PeerLost {
                    rank: 1,
                    reason: "x".into(),
                }),
                TW_ERR_PEER_LOST,
            ),
            (
                E::Engine(EngineError::UnknownLayer { layer: 3, layers: 2 }),
                TW_ERR_INVALID_ARGUMENT,
            ),
            (
                E::Engine(EngineError::protocol(1, ProtocolViolation::SecondHello)),
                TW_ERR_ENGINE,
            ),
        ];
        for (e, code) in cases {
            assert_eq!(code_of(&e), code, "{e}");
        }
    }
}
