//! `tw_config`: the layer table, the settings and the registered memory of one rank.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::NonNull;
use std::time::Duration;

use tidewire::engine::book::{LayerKind, LayerSpec};
use tidewire::engine::{ApplyOp, Consistency, SchemePolicy};
use tidewire::gpu::cpu::HostType;
use tidewire::transport::JobSecret;
use tidewire::TransportKind;

use crate::error::{guard, guard_ptr, Fail, TW_ERR_LAYOUT, TW_OK};

/// A fully connected layer: its gradient has sufficient factors (tw_push_factors).
pub const TW_LAYER_FC: c_int = 0;
/// A convolution layer.
pub const TW_LAYER_CONV: c_int = 1;
/// Any other layer (biases, normalization, embeddings).
pub const TW_LAYER_OTHER: c_int = 2;

/// Reduce only: the pulled values are the sum of every worker's gradients.
pub const TW_APPLY_SUM: c_int = 0;
/// Reduce only: the pulled values are the mean of every worker's gradients (the default).
pub const TW_APPLY_MEAN: c_int = 1;
/// SGD on the mean gradient g, on the servers:
/// `v = momentum * v + lr * (g + weight_decay * w); w -= v`. The pulled values
/// are the updated parameters.
pub const TW_APPLY_SGD: c_int = 2;

/// Bulk synchronous (the default): a pull returns values that include every
/// worker's push of the same iteration.
pub const TW_CONSISTENCY_BSP: c_int = 0;
/// Stale synchronous: a pull may return up to `staleness` iterations early.
pub const TW_CONSISTENCY_SSP: c_int = 1;

/// RDMA where a usable device exists (and the library was built with the
/// `rdma` feature), TCP otherwise (the default). `TIDEWIRE_TRANSPORT` overrides it.
pub const TW_TRANSPORT_AUTO: c_int = 0;
/// TCP: io_uring, or the portable epoll backend where io_uring cannot be used.
pub const TW_TRANSPORT_TCP: c_int = 1;
/// The portable epoll TCP backend, even where io_uring works.
pub const TW_TRANSPORT_PORTABLE: c_int = 2;
/// RDMA verbs; tw_init fails with TW_ERR_TRANSPORT where it is unavailable.
pub const TW_TRANSPORT_RDMA: c_int = 3;

/// Poseidon's HybComm (the default): each FC layer syncs by whichever of the
/// parameter server and sufficient-factor broadcast moves fewer bytes.
pub const TW_POLICY_HYBRID: c_int = 0;
/// Every layer through the parameter server: tw_push for every layer.
pub const TW_POLICY_PS: c_int = 1;
/// Sufficient-factor broadcast for every FC layer, the parameter server for the rest.
pub const TW_POLICY_SFB: c_int = 2;

/// Element type of registered memory: 32-bit float (zero-copy).
pub const TW_DTYPE_F32: c_int = 0;
/// IEEE half (staged: widened to float at each push, narrowed at each pull).
pub const TW_DTYPE_F16: c_int = 1;
/// bfloat16 (staged like TW_DTYPE_F16).
pub const TW_DTYPE_BF16: c_int = 2;
/// double (staged: carried and summed as float, so values keep float's precision).
pub const TW_DTYPE_F64: c_int = 3;

/// The registered memory: a pointer, a count of elements and their type.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Region {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) len: usize,
    pub(crate) dtype: HostType,
}

/// A rank's configuration: the layer table, the settings and the registered
/// memory (opaque; `tw_config` in C). Made by `tw_config_new`, freed by
/// `tw_config_free`; `tw_init` reads it and does not keep it.
#[derive(Debug)]
pub struct TwConfig {
    pub(crate) layers: Vec<LayerSpec>,
    pub(crate) batch: Option<usize>,
    pub(crate) apply: Option<ApplyOp>,
    pub(crate) consistency: Option<Consistency>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) connect_timeout: Option<Duration>,
    pub(crate) transport: Option<TransportKind>,
    pub(crate) policy: Option<SchemePolicy>,
    pub(crate) job: Option<(u64, JobSecret)>,
    pub(crate) registered: Option<(Region, Region)>,
    pub(crate) trigger: Option<tidewire::engine::Trigger>,
    pub(crate) checkpoint: Option<tidewire::checkpoint::Checkpointing>,
    pub(crate) resume: Option<std::path::PathBuf>,
}

impl TwConfig {
    /// Every layer's parameter count, summed.
    pub(crate) fn total_params(&self) -> Result<usize, Fail> {
        self.layers
            .iter()
            .try_fold(0usize, |t, l| t.checked_add(l.params()))
            .ok_or_else(|| Fail::arg("the layer table holds more parameters than fit in size_t"))
    }

    /// The registered memory, checked against the layer table.
    pub(crate) fn memory(&self) -> Result<(Region, Region), Fail> {
        let (p, g) = self.registered.ok_or_else(|| {
            Fail::new(
                TW_ERR_LAYOUT,
                "no memory registered: call tw_register(cfg, params, n_params, grads, n_grads) after the last tw_config_add_layer",
            )
        })?;
        let total = self.total_params()?;
        if p.len != total || g.len != total {
            return Err(Fail::new(
                TW_ERR_LAYOUT,
                format!(
                    "{} parameters and {} gradients registered, but the {} layers hold {total} values",
                    p.len,
                    g.len,
                    self.layers.len()
                ),
            ));
        }
        Ok((p, g))
    }
}

/// # Safety
/// `cfg` is NULL or a live `tw_config` that no other thread uses during the call.
unsafe fn config_mut<'a>(cfg: *mut TwConfig) -> Result<&'a mut TwConfig, Fail> {
    // SAFETY: the caller's contract: NULL (refused by as_mut) or a live config from
    // tw_config_new, used by this call alone.
    unsafe { cfg.as_mut() }.ok_or_else(|| Fail::null("cfg"))
}

/// Creates an empty configuration: no layers, and the engine's defaults
/// (batch 32, mean, BSP, HybComm, TCP-or-RDMA auto, 60 s timeouts, the secret
/// from TIDEWIRE_SECRET). Returns NULL only if Tidewire panicked (see tw_last_error).
#[no_mangle]
pub extern "C" fn tw_config_new() -> *mut TwConfig {
    guard_ptr("tw_config_new", || {
        Ok(Box::into_raw(Box::new(TwConfig {
            layers: Vec::new(),
            batch: None,
            apply: None,
            consistency: None,
            timeout: None,
            connect_timeout: None,
            transport: None,
            policy: None,
            job: None,
            registered: None,
            trigger: None,
            checkpoint: None,
            resume: None,
        })))
    })
}

/// Frees a configuration (NULL is a no-op). A session made from it lives on.
///
/// # Safety
/// `cfg` is NULL or a `tw_config` from tw_config_new that is not used again.
#[no_mangle]
pub unsafe extern "C" fn tw_config_free(cfg: *mut TwConfig) {
    if cfg.is_null() {
        return;
    }
    // SAFETY: the caller's contract: a config from tw_config_new (Box::into_raw),
    // freed once and not used after.
    let cfg = unsafe { Box::from_raw(cfg) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(cfg)));
}

/// Appends a layer to the table, in forward order: layer indices count from 0
/// in the order of these calls. Its parameters are M×N floats (row major); an
/// FC layer's sufficient factors are U (K×M) and V (K×N) for batch K. Every
/// rank must add the same table. Add every layer before tw_register.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`; `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tw_config_add_layer(
    cfg: *mut TwConfig,
    name: *const c_char,
    kind: c_int,
    m: usize,
    n: usize,
) -> c_int {
    guard("tw_config_add_layer", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        if name.is_null() {
            return Err(Fail::null("name"));
        }
        // SAFETY: the caller's contract: a non-NULL name is NUL-terminated; it is
        // copied before the call returns.
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| Fail::arg("name is not UTF-8"))?;
        if name.is_empty() {
            return Err(Fail::arg("name is empty"));
        }
        let kind = match kind {
            TW_LAYER_FC => LayerKind::Fc,
            TW_LAYER_CONV => LayerKind::Conv,
            TW_LAYER_OTHER => LayerKind::Other,
            k => {
                return Err(Fail::arg(format!(
                    "layer {name:?}: kind {k} is none of TW_LAYER_FC, TW_LAYER_CONV, TW_LAYER_OTHER"
                )))
            }
        };
        if m == 0 || n == 0 || m.checked_mul(n).and_then(|p| p.checked_mul(4)).is_none() {
            return Err(Fail::arg(format!(
                "layer {name:?}: {m}x{n} is no size (M and N must be at least 1, M*N*4 bytes within size_t)"
            )));
        }
        if cfg.registered.is_some() {
            return Err(Fail::state(format!(
                "layer {name:?} added after tw_register: add every layer first, then register the memory"
            )));
        }
        cfg.layers.push(LayerSpec::new(name, kind, m, n));
        Ok(TW_OK)
    })
}

/// The batch size K per worker: the rows of an FC layer's factors U and V, and
/// the cost model's K. Every rank the same.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_batch(cfg: *mut TwConfig, batch: usize) -> c_int {
    guard("tw_config_set_batch", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        if batch == 0 {
            return Err(Fail::arg("batch must be at least 1"));
        }
        cfg.batch = Some(batch);
        Ok(TW_OK)
    })
}

/// What the servers do with the summed gradients: TW_APPLY_SUM, TW_APPLY_MEAN
/// (both with lr, momentum and weight_decay 0), or TW_APPLY_SGD with a finite
/// lr > 0 and finite momentum, weight_decay >= 0. Every rank the same.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_apply(
    cfg: *mut TwConfig,
    op: c_int,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
) -> c_int {
    guard("tw_config_set_apply", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        let no_params = lr == 0.0 && momentum == 0.0 && weight_decay == 0.0;
        let op = match op {
            TW_APPLY_SUM | TW_APPLY_MEAN if !no_params => {
                return Err(Fail::arg(format!(
                    "lr {lr}, momentum {momentum}, weight_decay {weight_decay} given to a reduce-only op: they are for TW_APPLY_SGD (pass 0)"
                )))
            }
            TW_APPLY_SUM => ApplyOp::Sum,
            TW_APPLY_MEAN => ApplyOp::Mean,
            TW_APPLY_SGD => {
                if !(lr.is_finite() && lr > 0.0) {
                    return Err(Fail::arg(format!("SGD learning rate {lr}: want a finite value > 0")));
                }
                if !(momentum.is_finite() && momentum >= 0.0 && weight_decay.is_finite() && weight_decay >= 0.0) {
                    return Err(Fail::arg(format!(
                        "SGD momentum {momentum}, weight_decay {weight_decay}: want finite values >= 0"
                    )));
                }
                ApplyOp::Sgd {
                    lr,
                    momentum,
                    weight_decay,
                }
            }
            o => {
                return Err(Fail::arg(format!(
                    "apply op {o} is none of TW_APPLY_SUM, TW_APPLY_MEAN, TW_APPLY_SGD"
                )))
            }
        };
        cfg.apply = Some(op);
        Ok(TW_OK)
    })
}

/// The consistency model: TW_CONSISTENCY_BSP (staleness 0) or
/// TW_CONSISTENCY_SSP with a staleness bound of 1 to 64 iterations.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_consistency(cfg: *mut TwConfig, model: c_int, staleness: u32) -> c_int {
    guard("tw_config_set_consistency", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        let c = match (model, staleness) {
            (TW_CONSISTENCY_BSP, 0) => Consistency::Bsp,
            (TW_CONSISTENCY_BSP, s) => return Err(Fail::arg(format!("BSP takes staleness 0, not {s}"))),
            (TW_CONSISTENCY_SSP, s @ 1..=64) => Consistency::Ssp(s),
            (TW_CONSISTENCY_SSP, s) => return Err(Fail::arg(format!("SSP staleness {s}: want 1 to 64"))),
            (m, _) => {
                return Err(Fail::arg(format!(
                    "consistency {m} is neither TW_CONSISTENCY_BSP nor TW_CONSISTENCY_SSP"
                )))
            }
        };
        cfg.consistency = Some(c);
        Ok(TW_OK)
    })
}

/// Reads a NUL-terminated UTF-8 argument.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string, read before the call returns.
unsafe fn utf8_arg<'a>(p: *const c_char, what: &'static str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(Fail::null(what));
    }
    // SAFETY: the caller's contract: non-NULL and NUL-terminated; read before the call returns.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Fail::arg(format!("{what} is not UTF-8")))
}

/// When servers apply a chunk's round (Nexus's aggregation triggers):
/// "all" (BSP: every worker's gradient, the default), "quorum:K" (the first
/// K workers' contributions; later ones are dropped), "async" (every
/// contribution on arrival; late ones join the next round) or "timeout:MS"
/// (what is in MS milliseconds after the round's first contribution). The
/// pulled mean is over the contributors. The others than "all" need
/// TW_CONSISTENCY_BSP and TW_POLICY_PS; every rank must set the same.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`; `trigger` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_trigger(cfg: *mut TwConfig, trigger: *const c_char) -> c_int {
    guard("tw_config_set_trigger", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        // SAFETY: the caller's contract (# Safety above).
        let t = unsafe { utf8_arg(trigger, "trigger") }?;
        let t = tidewire::engine::Trigger::parse(t)
            .ok_or_else(|| Fail::arg(format!("trigger {t:?}: want all, quorum:K, async or timeout:MS")))?;
        cfg.trigger = Some(t);
        Ok(TW_OK)
    })
}

/// Checkpoints every `every` iterations (pulls) into directory `dir`: the
/// servers' optimizer state and worker 0's parameters as safetensors in
/// `dir/step-NNNNNNNN/`, written atomically off the training path, the
/// newest `keep` complete ones kept. With `framework_state` non-zero, a
/// checkpoint also needs the learner's own state (tw_save_state) to be
/// complete. Needs TW_CONSISTENCY_BSP and the "all" trigger; every rank must
/// set the same, and `dir` must be one all ranks see.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`; `dir` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_checkpoint(
    cfg: *mut TwConfig,
    dir: *const c_char,
    every: u64,
    keep: u32,
    framework_state: c_int,
) -> c_int {
    guard("tw_config_set_checkpoint", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        // SAFETY: the caller's contract (# Safety above).
        let d = unsafe { utf8_arg(dir, "dir") }?;
        if every == 0 || keep == 0 {
            return Err(Fail::arg("every and keep must be at least 1"));
        }
        cfg.checkpoint = Some(tidewire::checkpoint::Checkpointing {
            dir: d.into(),
            every,
            keep: keep as usize,
            framework_state: framework_state != 0,
        });
        Ok(TW_OK)
    })
}

/// Starts from a checkpoint: `path` is a step directory, or a checkpoint
/// directory (its newest complete one). Its parameters replace the values in
/// the registered memory, the servers take its optimizer state, and
/// tw_start_iteration says where it left off. Every rank must pass the same.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`; `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_resume(cfg: *mut TwConfig, path: *const c_char) -> c_int {
    guard("tw_config_set_resume", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        // SAFETY: the caller's contract (# Safety above).
        let p = unsafe { utf8_arg(path, "path") }?;
        cfg.resume = Some(p.into());
        Ok(TW_OK)
    })
}

/// How long a pull (and a silent peer) may take before it fails with
/// TW_ERR_TIMEOUT, in milliseconds (> 0; default 60 s).
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_timeout_ms(cfg: *mut TwConfig, ms: u64) -> c_int {
    guard("tw_config_set_timeout_ms", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        if ms == 0 {
            return Err(Fail::arg("timeout must be at least 1 ms"));
        }
        cfg.timeout = Some(Duration::from_millis(ms));
        Ok(TW_OK)
    })
}

/// How long tw_init's rendezvous and connection setup may take, in
/// milliseconds (> 0; default 60 s).
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_connect_timeout_ms(cfg: *mut TwConfig, ms: u64) -> c_int {
    guard("tw_config_set_connect_timeout_ms", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        if ms == 0 {
            return Err(Fail::arg("connect timeout must be at least 1 ms"));
        }
        cfg.connect_timeout = Some(Duration::from_millis(ms));
        Ok(TW_OK)
    })
}

/// The transport: TW_TRANSPORT_AUTO (default), TW_TRANSPORT_TCP,
/// TW_TRANSPORT_PORTABLE or TW_TRANSPORT_RDMA.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_transport(cfg: *mut TwConfig, transport: c_int) -> c_int {
    guard("tw_config_set_transport", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        cfg.transport = Some(match transport {
            TW_TRANSPORT_AUTO => TransportKind::Auto,
            TW_TRANSPORT_TCP => TransportKind::Tcp,
            TW_TRANSPORT_PORTABLE => TransportKind::Portable,
            TW_TRANSPORT_RDMA => TransportKind::Rdma,
            t => {
                return Err(Fail::arg(format!(
                    "transport {t} is none of TW_TRANSPORT_AUTO, TW_TRANSPORT_TCP, TW_TRANSPORT_PORTABLE, TW_TRANSPORT_RDMA"
                )))
            }
        });
        Ok(TW_OK)
    })
}

/// How layers pick their scheme: TW_POLICY_HYBRID (default), TW_POLICY_PS or
/// TW_POLICY_SFB. Every rank the same. tw_scheme says what each layer got.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_scheme_policy(cfg: *mut TwConfig, policy: c_int) -> c_int {
    guard("tw_config_set_scheme_policy", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        cfg.policy = Some(match policy {
            TW_POLICY_HYBRID => SchemePolicy::Hybrid,
            TW_POLICY_PS => SchemePolicy::Ps,
            TW_POLICY_SFB => SchemePolicy::Sfb,
            p => {
                return Err(Fail::arg(format!(
                    "scheme policy {p} is none of TW_POLICY_HYBRID, TW_POLICY_PS, TW_POLICY_SFB"
                )))
            }
        });
        Ok(TW_OK)
    })
}

/// The job id and the secret the ranks authenticate each other with (any
/// non-empty string, the same on every rank). Without this call tw_init reads
/// TIDEWIRE_SECRET (and TIDEWIRE_JOB) from the environment.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`; `secret` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tw_config_set_job(cfg: *mut TwConfig, job_id: u64, secret: *const c_char) -> c_int {
    guard("tw_config_set_job", || {
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        if secret.is_null() {
            return Err(Fail::null("secret"));
        }
        // SAFETY: the caller's contract: a non-NULL secret is NUL-terminated; its
        // bytes are copied before the call returns.
        let secret = unsafe { CStr::from_ptr(secret) }.to_bytes();
        if secret.is_empty() {
            return Err(Fail::arg("secret is empty"));
        }
        cfg.job = Some((job_id, JobSecret::new(secret)));
        Ok(TW_OK)
    })
}

/// Registers the caller's memory, zero-copy: `params` holds every layer's
/// parameters back to back in layer order (layer l starts after the M×N floats
/// of layers 0..l-1), `grads` every layer's gradients in the same layout.
/// n_params and n_grads count floats and must both equal the table's total
/// parameter count. Call it after the last tw_config_add_layer; calling it
/// again replaces the registration.
///
/// The values in `params` when tw_init runs are the initial parameters: worker
/// rank 0's are copied to every rank, so all replicas start equal.
///
/// # Safety
/// `cfg` is NULL or a live `tw_config`. `params` and `grads` each point to
/// n_params (n_grads) floats that do not overlap, that stay allocated until
/// tw_finalize of every session made from this configuration returns, and
/// that are registered with one live session at a time. While a session
/// lives, the caller touches a layer's parameters and gradients only while it
/// holds the layer: after tw_init, and between a completed pull (tw_pull,
/// tw_pull_all, or tw_poll reporting done) and the layer's next push.
/// During tw_init and while a layer is pushed, Tidewire reads and writes that
/// memory from its own threads.
#[no_mangle]
pub unsafe extern "C" fn tw_register(
    cfg: *mut TwConfig,
    params: *mut f32,
    n_params: usize,
    grads: *mut f32,
    n_grads: usize,
) -> c_int {
    // SAFETY: tw_register_typed's contract for TW_DTYPE_F32 is this function's.
    unsafe {
        register(
            "tw_register",
            cfg,
            TW_DTYPE_F32,
            params.cast(),
            n_params,
            grads.cast(),
            n_grads,
        )
    }
}

/// Like tw_register, for memory of another element type (`dtype`: TW_DTYPE_F32,
/// TW_DTYPE_F16, TW_DTYPE_BF16 or TW_DTYPE_F64); n_params and n_grads count
/// elements of that type. TW_DTYPE_F32 is registered in place. The others are
/// staged: Tidewire keeps float buffers, widens a layer's gradient into them
/// at each push and narrows the result back into `params` (round to nearest
/// even) when the pull completes; the wire and the servers' sums are float.
///
/// # Safety
/// As tw_register, with n_params (n_grads) elements of `dtype`, aligned for it.
#[no_mangle]
pub unsafe extern "C" fn tw_register_typed(
    cfg: *mut TwConfig,
    dtype: c_int,
    params: *mut c_void,
    n_params: usize,
    grads: *mut c_void,
    n_grads: usize,
) -> c_int {
    // SAFETY: the caller's contract (# Safety above) is register's.
    unsafe {
        register(
            "tw_register_typed",
            cfg,
            dtype,
            params.cast(),
            n_params,
            grads.cast(),
            n_grads,
        )
    }
}

/// tw_register and tw_register_typed.
///
/// # Safety
/// tw_register_typed's contract.
unsafe fn register(
    call: &'static str,
    cfg: *mut TwConfig,
    dtype: c_int,
    params: *mut u8,
    n_params: usize,
    grads: *mut u8,
    n_grads: usize,
) -> c_int {
    guard(call, || {
        let t = match dtype {
            TW_DTYPE_F32 => HostType::F32,
            TW_DTYPE_F16 => HostType::F16,
            TW_DTYPE_BF16 => HostType::Bf16,
            TW_DTYPE_F64 => HostType::F64,
            d => {
                return Err(Fail::arg(format!(
                    "dtype {d} is none of TW_DTYPE_F32, TW_DTYPE_F16, TW_DTYPE_BF16, TW_DTYPE_F64"
                )))
            }
        };
        let size = t.size();
        // SAFETY: the caller's contract (# Safety above).
        let cfg = unsafe { config_mut(cfg) }?;
        let p = NonNull::new(params).ok_or_else(|| Fail::null("params"))?;
        let g = NonNull::new(grads).ok_or_else(|| Fail::null("grads"))?;
        if cfg.layers.is_empty() {
            return Err(Fail::state(
                "no layers: add every layer with tw_config_add_layer before tw_register",
            ));
        }
        for (what, ptr, n) in [("params", params, n_params), ("grads", grads, n_grads)] {
            if ptr as usize % size != 0 {
                return Err(Fail::arg(format!("{what} ({ptr:p}) is not aligned for {}", t.name())));
            }
            if n.checked_mul(size).map_or(true, |b| b > isize::MAX as usize) {
                return Err(Fail::arg(format!(
                    "{what}: {n} {} values do not fit in memory",
                    t.name()
                )));
            }
        }
        let total = cfg.total_params()?;
        for (what, n) in [("n_params", n_params), ("n_grads", n_grads)] {
            if n != total {
                let table: Vec<String> = cfg
                    .layers
                    .iter()
                    .map(|l| format!("{} {}x{}", l.name, l.m, l.n))
                    .collect();
                return Err(Fail::new(
                    TW_ERR_LAYOUT,
                    format!(
                        "{what} is {n}, but the layers hold {total} values ({})",
                        table.join(" + ")
                    ),
                ));
            }
        }
        let (pa, ga) = (params as usize, grads as usize);
        if pa < ga + n_grads * size && ga < pa + n_params * size {
            return Err(Fail::arg("params and grads overlap: they must be separate memory"));
        }
        cfg.registered = Some((
            Region {
                ptr: p,
                len: n_params,
                dtype: t,
            },
            Region {
                ptr: g,
                len: n_grads,
                dtype: t,
            },
        ));
        Ok(TW_OK)
    })
}
