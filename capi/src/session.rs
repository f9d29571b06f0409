//! `tw_session`: a running rank, and push/pull by layer index.

use std::ffi::{c_char, c_int, CStr, CString};
use std::net::ToSocketAddrs;
use std::sync::{Mutex, MutexGuard};

use tidewire::cluster::ClusterSpec;
use tidewire::engine::book::LayerKind;
use tidewire::engine::Scheme;
use tidewire::pushpull::PushPull;
use tidewire::transport::PinnedBuffer;
use tidewire::{Builder, Session};

use crate::config::{Region, TwConfig};
use crate::error::{guard, Fail, TW_ERR_CLUSTER, TW_ERR_INVALID_ARGUMENT, TW_ERR_PANIC, TW_OK};

/// The layer syncs through the parameter server: hand it in with tw_push.
pub const TW_SCHEME_PS: c_int = 0;
/// The layer syncs by sufficient-factor broadcast: hand it in with tw_push_factors.
pub const TW_SCHEME_SFB: c_int = 1;
/// The layer syncs by Adam's strategy (the layer's server rebuilds the
/// gradient from the factors): hand it in with tw_push_factors. Only under the
/// engine's adam scheme policy, which no TW_POLICY_* selects yet.
pub const TW_SCHEME_ADAM: c_int = 2;

#[derive(Debug)]
enum Rank {
    /// A worker (or a worker and server): push/pull over the registered memory.
    Worker(PushPull),
    /// A server-only rank: nothing to push; tw_finalize serves the job.
    Server(Session),
}

impl Rank {
    fn session(&self) -> &Session {
        match self {
            Rank::Worker(pp) => pp.session(),
            Rank::Server(s) => s,
        }
    }
}

/// A running rank (opaque; `tw_session` in C). Made by tw_init or
/// tw_init_explicit, ended and freed by tw_finalize.
#[derive(Debug)]
pub struct TwSession {
    // A panic during a call poisons the mutex: later calls fail with TW_ERR_PANIC.
    rank_state: Mutex<Rank>,
    rank: u32,
    world: u32,
    layers: u32,
    transport: CString,
}

// Calls may come from any thread (they take turns on the mutex).
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Rank>();
};

impl TwSession {
    fn lock(&self) -> Result<MutexGuard<'_, Rank>, Fail> {
        self.rank_state.lock().map_err(|_| {
            Fail::new(
                TW_ERR_PANIC,
                "an earlier call on this session panicked: only tw_finalize is left",
            )
        })
    }
}

/// # Safety
/// `s` is NULL or a live session (from tw_init, not finalized).
unsafe fn session_ref<'a>(s: *const TwSession) -> Result<&'a TwSession, Fail> {
    // SAFETY: the caller's contract: NULL (refused by as_ref) or a live session,
    // which only tw_finalize frees; concurrent calls share it through its mutex.
    unsafe { s.as_ref() }.ok_or_else(|| Fail::null("session"))
}

fn worker(r: &mut Rank) -> Result<&mut PushPull, Fail> {
    match r {
        Rank::Worker(pp) => Ok(pp),
        Rank::Server(s) => Err(Fail::state(format!(
            "rank {} is a server only: it has no layers to push or pull; call tw_finalize to serve the job",
            s.rank()
        ))),
    }
}

/// Checks that `layer` exists and is not lost, and for a push that it is not in flight.
fn check_layer(pp: &mut PushPull, layer: u32, push: bool) -> Result<(), Fail> {
    let n = pp.layers();
    if layer as usize >= n {
        return Err(Fail::arg(format!(
            "unknown layer {layer}: the table has {n} layers (0 to {})",
            n.saturating_sub(1)
        )));
    }
    if pp.in_flight(layer) {
        if push {
            return Err(Fail::state(format!(
                "layer {layer} is pushed and not pulled yet: tw_pull (or tw_poll) it before pushing it again"
            )));
        }
        return Ok(());
    }
    // Not in flight: the caller holds the layer, or an earlier failure lost it.
    if let Err(e) = pp.held(layer) {
        return Err(Fail::state(format!(
            "layer {layer} was lost by an earlier failure and cannot sync any more ({e})"
        )));
    }
    Ok(())
}

fn build(cfg: &TwConfig, spec: ClusterSpec) -> Result<TwSession, Fail> {
    let (params, grads) = cfg.memory()?;
    let wrap = |r: Region| -> Result<PinnedBuffer, Fail> {
        // tw_register's contract: r.len elements of r.dtype at r.ptr (their byte
        // length checked to fit) stay allocated until tw_finalize drops this buffer
        // with the session, are registered with this session alone, and the caller
        // touches a layer's values only while it holds the layer.
        // SAFETY: that contract is PinnedBuffer::foreign's for the session's protocol.
        let b = unsafe { PinnedBuffer::foreign(r.ptr.as_ptr(), r.len * r.dtype.size(), None) }?;
        Ok(b)
    };
    let mut b = Builder::new(cfg.layers.clone());
    if let Some(k) = cfg.batch {
        b = b.batch(k);
    }
    if let Some(op) = cfg.apply {
        b = b.apply(op);
    }
    if let Some(c) = cfg.consistency {
        b = b.consistency(c);
    }
    if let Some(t) = cfg.timeout {
        b = b.timeout(t);
    }
    if let Some(t) = cfg.connect_timeout {
        b = b.connect_timeout(t);
    }
    if let Some(t) = cfg.transport {
        b = b.transport(t);
    }
    if let Some(p) = cfg.policy {
        b = b.policy(p);
    }
    if let Some((id, secret)) = &cfg.job {
        b = b.job(*id, secret.clone());
    }
    if let Some(t) = cfg.trigger {
        b = b.trigger(t);
    }
    if let Some(c) = &cfg.checkpoint {
        b = b.checkpoint(c.clone());
    }
    if let Some(r) = &cfg.resume {
        b = b.resume(r.clone());
    }
    let world = spec.roles.len() as u32;
    // f32 memory is registered in place; f16, bf16 and f64 are staged (PushPull::build).
    let pp = PushPull::build(b, spec, params.dtype, wrap(params)?, wrap(grads)?)?;
    let rank = pp.session().rank();
    let transport = pp.session().transport().0;
    let state = if pp.session().role().is_worker() {
        Rank::Worker(pp)
    } else {
        Rank::Server(pp.into_session())
    };
    Ok(TwSession {
        rank_state: Mutex::new(state),
        rank,
        world,
        layers: cfg.layers.len() as u32,
        transport: CString::new(transport).unwrap_or_default(),
    })
}

/// # Safety
/// `cfg` is NULL or a live config; `out` is NULL or valid for one write.
unsafe fn init_with(
    call: &str,
    cfg: *const TwConfig,
    out: *mut *mut TwSession,
    spec: impl FnOnce() -> Result<ClusterSpec, Fail>,
) -> c_int {
    guard(call, || {
        if out.is_null() {
            return Err(Fail::null("out"));
        }
        // SAFETY: the caller's contract: a non-NULL out is valid for a write.
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: the caller's contract: NULL (refused by as_ref) or a live config
        // that no other thread changes during the call.
        let cfg = unsafe { cfg.as_ref() }.ok_or_else(|| Fail::null("cfg"))?;
        if cfg.layers.is_empty() {
            return Err(Fail::state("the configuration has no layers (tw_config_add_layer)"));
        }
        let spec = spec()?;
        cfg.memory()?;
        let s = Box::into_raw(Box::new(build(cfg, spec)?));
        // SAFETY: as above.
        unsafe { out.write(s) };
        Ok(TW_OK)
    })
}

/// Starts this rank with the cluster from the environment: TIDEWIRE_RANK,
/// TIDEWIRE_WORLD_SIZE and TIDEWIRE_MASTER (host:port of rank 0's
/// rendezvous), or torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, or
/// Slurm's / Open MPI's rank variables; TIDEWIRE_SERVERS=N makes the last N
/// ranks servers only (default: every rank is a worker and a server). Returns
/// once every rank has joined and every layer holds worker rank 0's initial
/// parameters; then the caller holds every layer. On failure *out is NULL.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config` with registered memory (see
/// tw_register's contract, which holds for the session's whole life);
/// `out` is NULL or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn tw_init(cfg: *const TwConfig, out: *mut *mut TwSession) -> c_int {
    // SAFETY: the caller's contract (# Safety above).
    unsafe { init_with("tw_init", cfg, out, || Ok(ClusterSpec::from_env()?)) }
}

/// Like tw_init with the cluster given: this process's rank, the world size,
/// how many of the ranks are servers only (the last `servers` ranks; 0: every
/// rank is a worker and a server), and rank 0's rendezvous address as
/// "host:port" (every rank the same; rank 0 listens on it).
///
/// # Safety
/// As tw_init; `master` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tw_init_explicit(
    cfg: *const TwConfig,
    rank: u32,
    world_size: u32,
    servers: u32,
    master: *const c_char,
    out: *mut *mut TwSession,
) -> c_int {
    let spec = || -> Result<ClusterSpec, Fail> {
        if master.is_null() {
            return Err(Fail::null("master"));
        }
        // SAFETY: the caller's contract: a non-NULL master is NUL-terminated; it is
        // read before the call returns.
        let m = unsafe { CStr::from_ptr(master) }
            .to_str()
            .map_err(|_| Fail::arg("master is not UTF-8"))?;
        let addr = m
            .to_socket_addrs()
            .map_err(|e| Fail::new(TW_ERR_CLUSTER, format!("master {m:?}: {e} (want host:port)")))?
            .next()
            .ok_or_else(|| Fail::new(TW_ERR_CLUSTER, format!("master {m:?} resolves to nothing")))?;
        let (world, servers) = (world_size as usize, servers as usize);
        if world == 0 || rank as usize >= world {
            return Err(Fail::arg(format!("rank {rank} outside a world of {world_size}")));
        }
        if servers >= world {
            return Err(Fail::arg(format!(
                "{servers} server-only ranks leave no worker in a world of {world_size}"
            )));
        }
        let spec = if servers == 0 {
            ClusterSpec::new(rank, world, 0, true, addr)?
        } else {
            ClusterSpec::new(rank, world - servers, servers, false, addr)?
        };
        Ok(spec)
    };
    // SAFETY: the caller's contract (# Safety above).
    unsafe { init_with("tw_init_explicit", cfg, out, spec) }
}

/// Runs `f` on the session's rank state under the guard.
///
/// # Safety
/// `s` is NULL or a live session.
unsafe fn with_rank(call: &str, s: *const TwSession, f: impl FnOnce(&mut Rank) -> Result<c_int, Fail>) -> c_int {
    guard(call, || {
        // SAFETY: the caller's contract.
        let s = unsafe { session_ref(s) }?;
        let mut r = s.lock()?;
        f(&mut r)
    })
}

/// Pushes layer `layer`'s gradient, zero-copy from the registered gradient
/// memory (Nexus's push; the engine's grad_ready). Returns at once; the sync
/// proceeds in the background. From here until its pull completes the layer
/// belongs to Tidewire: do not touch its gradient or parameters. A layer that
/// syncs by sufficient factors (tw_scheme says TW_SCHEME_SFB) needs
/// tw_push_factors instead (TW_ERR_INVALID_ARGUMENT); pushing a layer twice
/// without a pull is TW_ERR_STATE.
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_push(s: *mut TwSession, layer: u32) -> c_int {
    let f = |r: &mut Rank| {
        let pp = worker(r)?;
        check_layer(pp, layer, true)?;
        pp.push(layer)?;
        Ok(TW_OK)
    };
    // SAFETY: the caller's contract (# Safety above).
    unsafe { with_rank("tw_push", s, f) }
}

/// Pushes an FC layer by its sufficient factors: U (K×M) and V (K×N), row
/// major, for batch K, whose product Uᵀ·V is the layer's gradient. n_u and
/// n_v count floats (K×M and K×N). The factors are copied before the call
/// returns; the layer's registered gradient memory is not read. Works under
/// either scheme (under the parameter server the gradient is formed here).
///
/// # Safety
/// `s` is NULL or a live session; `u` and `v` are NULL or valid for reading
/// n_u (n_v) floats that nothing writes during the call.
#[no_mangle]
pub unsafe extern "C" fn tw_push_factors(
    s: *mut TwSession,
    layer: u32,
    u: *const f32,
    n_u: usize,
    v: *const f32,
    n_v: usize,
) -> c_int {
    let f = |r: &mut Rank| {
        let pp = worker(r)?;
        check_layer(pp, layer, true)?;
        let book = pp.session().book().clone();
        let spec = book.layer(layer).map_err(tidewire::Error::from)?;
        if spec.kind != LayerKind::Fc {
            return Err(Fail::arg(format!(
                "layer {layer} ({}) is not fully connected: it has no sufficient factors; push its gradient with tw_push",
                spec.name
            )));
        }
        let k = book.config().batch;
        let (want_u, want_v) = (k.saturating_mul(spec.m), k.saturating_mul(spec.n));
        if n_u != want_u || n_v != want_v {
            return Err(Fail::arg(format!(
                "layer {layer} ({}): factors of {n_u} and {n_v} floats, want U {k}x{} = {want_u} and V {k}x{} = {want_v} (batch K = {k})",
                spec.name, spec.m, spec.n
            )));
        }
        if u.is_null() {
            return Err(Fail::null("u"));
        }
        if v.is_null() {
            return Err(Fail::null("v"));
        }
        for (what, p) in [("u", u), ("v", v)] {
            if p as usize % std::mem::align_of::<f32>() != 0 {
                return Err(Fail::arg(format!("{what} ({p:p}) is not aligned for float")));
            }
        }
        // SAFETY: the caller's contract: u (v) is non-NULL (checked), aligned
        // (checked), and valid for reading n_u (n_v) floats that nothing writes
        // during this call; the slices do not outlive it.
        let (u, v) = unsafe { (std::slice::from_raw_parts(u, n_u), std::slice::from_raw_parts(v, n_v)) };
        pp.push_factors(layer, u, v)?;
        Ok(TW_OK)
    };
    // SAFETY: the caller's contract (# Safety above).
    unsafe { with_rank("tw_push_factors", s, f) }
}

/// Waits until layer `layer` is synced: its new parameters are in the
/// registered parameter memory and the caller holds the layer again (Nexus's
/// pull; the engine's wait_layer). Returns at once for a layer that is not
/// pushed. TW_ERR_TIMEOUT after the configured timeout; a layer whose pull
/// failed is lost for the rest of the session (TW_ERR_STATE afterwards).
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_pull(s: *mut TwSession, layer: u32) -> c_int {
    let f = |r: &mut Rank| {
        let pp = worker(r)?;
        check_layer(pp, layer, false)?;
        pp.pull(layer)?;
        Ok(TW_OK)
    };
    // SAFETY: the caller's contract (# Safety above).
    unsafe { with_rank("tw_pull", s, f) }
}

/// The non-blocking pull: sets *done to 1 when layer `layer` is synced (the
/// caller holds it again, as after tw_pull) or was never pushed, to 0 while its
/// sync is under way. Past the timeout it fails with TW_ERR_TIMEOUT.
///
/// # Safety
/// `s` is NULL or a live session; `done` is NULL or valid for writing one int.
#[no_mangle]
pub unsafe extern "C" fn tw_poll(s: *mut TwSession, layer: u32, done: *mut c_int) -> c_int {
    let f = |r: &mut Rank| {
        if done.is_null() {
            return Err(Fail::null("done"));
        }
        let pp = worker(r)?;
        check_layer(pp, layer, false)?;
        let d = pp.poll(layer)?;
        // SAFETY: the caller's contract: a non-NULL done is valid for a write.
        unsafe { done.write(c_int::from(d)) };
        Ok(TW_OK)
    };
    // SAFETY: the caller's contract (# Safety above).
    unsafe { with_rank("tw_poll", s, f) }
}

/// Pulls every pushed layer, in layer order (the BSP barrier of an iteration).
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_pull_all(s: *mut TwSession) -> c_int {
    let f = |r: &mut Rank| {
        let pp = worker(r)?;
        for l in 0..pp.layers() as u32 {
            check_layer(pp, l, false)?;
            pp.pull(l)?;
        }
        Ok(TW_OK)
    };
    // SAFETY: the caller's contract (# Safety above).
    unsafe { with_rank("tw_pull_all", s, f) }
}

/// This rank (0 to world size - 1), or a negative error code.
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_rank(s: *const TwSession) -> c_int {
    guard("tw_rank", || {
        // SAFETY: the caller's contract (# Safety above).
        let s = unsafe { session_ref(s) }?;
        c_int::try_from(s.rank).map_err(|_| Fail::arg(format!("rank {} does not fit in an int", s.rank)))
    })
}

/// Iterations done before this session: 0, or the iteration of the
/// checkpoint it resumed (tw_config_set_resume); train from there. A
/// negative error code on failure (TW_ERR_INVALID_ARGUMENT past INT_MAX).
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_start_iteration(s: *const TwSession) -> c_int {
    guard("tw_start_iteration", || {
        // SAFETY: the caller's contract (# Safety above).
        let s = unsafe { session_ref(s) }?;
        let r = s.lock()?;
        let k = r.session().start_iteration();
        c_int::try_from(k).map_err(|_| Fail::arg(format!("iteration {k} does not fit in an int")))
    })
}

/// Saves the learner's own state (`len` bytes at `data`, copied before the
/// call returns) with checkpoint `iteration` (a multiple of the checkpoint
/// period, counted from 0 across resumes). One learner calls it at each
/// checkpoint iteration when tw_config_set_checkpoint asked for a framework state.
///
/// # Safety
/// `s` is NULL or a live session; `data` points to `len` readable bytes (or is NULL with `len` 0).
#[no_mangle]
pub unsafe extern "C" fn tw_save_state(s: *mut TwSession, iteration: u64, data: *const u8, len: usize) -> c_int {
    guard("tw_save_state", || {
        let bytes = if len == 0 {
            Vec::new()
        } else {
            if data.is_null() {
                return Err(Fail::null("data"));
            }
            // SAFETY: the caller's contract: `data` points to `len` readable bytes,
            // copied here before the call returns.
            unsafe { std::slice::from_raw_parts(data, len) }.to_vec()
        };
        // SAFETY: the caller's contract (# Safety above).
        let s = unsafe { session_ref(s) }?;
        let r = s.lock()?;
        r.session().save_framework_state(iteration, bytes)?;
        Ok(TW_OK)
    })
}

/// The number of ranks in the job, or a negative error code.
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_world_size(s: *const TwSession) -> c_int {
    guard("tw_world_size", || {
        // SAFETY: the caller's contract (# Safety above).
        let s = unsafe { session_ref(s) }?;
        c_int::try_from(s.world).map_err(|_| Fail::arg(format!("world size {} does not fit in an int", s.world)))
    })
}

/// The number of layers in the table, or a negative error code.
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_num_layers(s: *const TwSession) -> c_int {
    guard("tw_num_layers", || {
        // SAFETY: the caller's contract (# Safety above).
        let s = unsafe { session_ref(s) }?;
        c_int::try_from(s.layers).map_err(|_| Fail::arg(format!("{} layers do not fit in an int", s.layers)))
    })
}

/// 1 if this rank is a worker (it pushes and pulls), 0 if it is a server
/// only (it just calls tw_finalize, which serves the job), or a negative
/// error code.
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_is_worker(s: *const TwSession) -> c_int {
    // SAFETY: the caller's contract (# Safety above).
    unsafe { with_rank("tw_is_worker", s, |r| Ok(c_int::from(matches!(r, Rank::Worker(_))))) }
}

/// The scheme layer `layer` syncs by, fixed for the session: TW_SCHEME_PS
/// (push with tw_push) or TW_SCHEME_SFB (push with tw_push_factors), or a
/// negative error code (TW_ERR_INVALID_ARGUMENT for an unknown layer).
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_scheme(s: *const TwSession, layer: u32) -> c_int {
    let f = |r: &mut Rank| {
        let n = r.session().book().layers().len();
        if layer as usize >= n {
            return Err(Fail::new(
                TW_ERR_INVALID_ARGUMENT,
                format!("unknown layer {layer}: the table has {n} layers"),
            ));
        }
        Ok(match r.session().scheme(layer)? {
            Scheme::Ps => TW_SCHEME_PS,
            Scheme::Sfb => TW_SCHEME_SFB,
            Scheme::Adam => TW_SCHEME_ADAM,
        })
    };
    // SAFETY: the caller's contract (# Safety above).
    unsafe { with_rank("tw_scheme", s, f) }
}

/// The transport this rank runs on: "tcp" (io_uring), "portable" (epoll) or
/// "rdma"; NULL for a NULL session. The string lives as long as the session.
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn tw_transport(s: *const TwSession) -> *const c_char {
    // SAFETY: the caller's contract (# Safety above).
    match unsafe { session_ref(s) } {
        Ok(s) => s.transport.as_ptr(),
        Err(f) => {
            crate::error::set_last_error("tw_transport", &f.msg);
            std::ptr::null()
        }
    }
}

/// Ends the session and frees it: pulls every layer still in flight, tells the
/// peers, and on a server rank serves them until every peer has finished (so
/// every rank calls it once at the end of training). The registered memory is
/// the caller's again when it returns, whatever the result. TW_ERR_STATE if
/// layers were lost by earlier failures (the session is still ended and freed).
/// NULL is a no-op returning TW_OK. Every worker must push each layer as
/// often as the others: when a worker finalizes without a push another worker
/// made, that iteration can never complete, and every rank's call fails
/// (TW_ERR_ENGINE, naming the worker, layer and iteration) instead of waiting.
/// After a pull timed out, finalize aborts the job rather than wait for layers
/// that may never sync, and the peers hear why.
///
/// # Safety
/// `s` is NULL or a live session that no other thread uses during or after the call.
#[no_mangle]
pub unsafe extern "C" fn tw_finalize(s: *mut TwSession) -> c_int {
    guard("tw_finalize", || {
        if s.is_null() {
            return Ok(TW_OK);
        }
        // SAFETY: the caller's contract: a live session from tw_init (Box::into_raw),
        // finalized once and not used after. It is dropped here whatever happens,
        // which stops the session's threads before the caller reuses its memory.
        let s = unsafe { Box::from_raw(s) };
        let poisoned = s.rank_state.is_poisoned();
        let state = s.rank_state.into_inner().unwrap_or_else(|p| p.into_inner());
        if poisoned {
            drop(state);
            return Err(Fail::new(
                TW_ERR_PANIC,
                "an earlier call on this session panicked: the session was aborted and freed",
            ));
        }
        match state {
            Rank::Worker(mut pp) => {
                // PushPull::shutdown fails on a layer an earlier failure lost (with a
                // buffer-layout error) before it reports how the session ended: name
                // those layers instead, as a state error.
                let lost: Vec<u32> = (0..pp.layers() as u32)
                    .filter(|&l| !pp.in_flight(l) && pp.held(l).is_err())
                    .collect();
                let r = pp.shutdown();
                if !lost.is_empty() {
                    return Err(Fail::state(format!(
                        "the session is ended and freed, but layers {lost:?} were lost by earlier failures{}",
                        r.err().map(|e| format!(" ({e})")).unwrap_or_default()
                    )));
                }
                r?
            }
            Rank::Server(mut session) => session.shutdown()?,
        }
        Ok(TW_OK)
    })
}
