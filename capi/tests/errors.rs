//! The C ABI's error paths, called the way C calls them: null pointers, wrong
//! sizes, values out of range, unknown layers, calls out of order. Each gives
//! its code and a message from tw_last_error, never a crash or a panic.

use std::ffi::{c_char, c_int, CStr};
use std::ptr::{null, null_mut};

use tidewire_c::*;

fn last_error() -> String {
    // SAFETY: tw_last_error returns a NUL-terminated string that stays valid until
    // the next failing call on this thread; it is copied at once.
    unsafe { CStr::from_ptr(tw_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts `rc` is `code` and the last error mentions every one of `words`.
#[track_caller]
fn fails(rc: c_int, code: c_int, words: &[&str]) {
    let msg = last_error();
    assert_eq!(rc, code, "want {}, got {rc}: {msg}", name(code));
    for w in words {
        assert!(msg.contains(w), "{:?} does not mention {w:?}", msg);
    }
}

fn name(code: c_int) -> String {
    // SAFETY: tw_error_name returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(tw_error_name(code)) }
        .to_string_lossy()
        .into_owned()
}

/// A config with a conv layer (4×9) and an FC layer (3×4), batch 2.
fn config() -> *mut TwConfig {
    let cfg = tw_config_new();
    assert!(!cfg.is_null());
    // SAFETY: cfg is live; the names are NUL-terminated and outlive the calls.
    unsafe {
        assert_eq!(tw_config_add_layer(cfg, c"conv".as_ptr(), TW_LAYER_CONV, 4, 9), TW_OK);
        assert_eq!(tw_config_add_layer(cfg, c"fc".as_ptr(), TW_LAYER_FC, 3, 4), TW_OK);
        assert_eq!(tw_config_set_batch(cfg, 2), TW_OK);
        assert_eq!(tw_config_set_job(cfg, 7, c"capi-test".as_ptr()), TW_OK);
        assert_eq!(tw_config_set_apply(cfg, TW_APPLY_SUM, 0.0, 0.0, 0.0), TW_OK);
        assert_eq!(tw_config_set_timeout_ms(cfg, 20_000), TW_OK);
    }
    cfg
}

const TOTAL: usize = 4 * 9 + 3 * 4;

/// A one-rank session over `params` and `grads` (TOTAL floats each).
fn solo(cfg: *mut TwConfig, params: &mut [f32], grads: &mut [f32]) -> *mut TwSession {
    let mut s = null_mut();
    // SAFETY: cfg is live; params and grads hold TOTAL floats each, outlive the
    // session (every caller finalizes it before they go) and are touched only
    // while the caller holds the layers.
    unsafe {
        assert_eq!(
            tw_register(cfg, params.as_mut_ptr(), params.len(), grads.as_mut_ptr(), grads.len()),
            TW_OK
        );
        let rc = tw_init_explicit(cfg, 0, 1, 0, c"127.0.0.1:1".as_ptr(), &mut s);
        assert_eq!(rc, TW_OK, "{}", last_error());
    }
    assert!(!s.is_null());
    s
}

#[test]
fn null_pointers_are_refused_by_name() {
    let cfg = config();
    let mut p = vec![0f32; TOTAL];
    let mut g = vec![0f32; TOTAL];
    let mut s = null_mut();
    let mut done = 0;
    // SAFETY: every pointer passed is NULL or valid (cfg is live, the buffers hold
    // TOTAL floats); NULL is what is under test.
    unsafe {
        fails(
            tw_config_add_layer(null_mut(), c"x".as_ptr(), TW_LAYER_FC, 1, 1),
            TW_ERR_INVALID_ARGUMENT,
            &["tw_config_add_layer", "cfg is NULL"],
        );
        fails(
            tw_config_add_layer(cfg, null(), TW_LAYER_FC, 1, 1),
            TW_ERR_INVALID_ARGUMENT,
            &["name is NULL"],
        );
        fails(
            tw_config_set_batch(null_mut(), 4),
            TW_ERR_INVALID_ARGUMENT,
            &["tw_config_set_batch", "cfg is NULL"],
        );
        fails(
            tw_config_set_job(cfg, 1, null()),
            TW_ERR_INVALID_ARGUMENT,
            &["secret is NULL"],
        );
        fails(
            tw_register(cfg, null_mut(), TOTAL, g.as_mut_ptr(), TOTAL),
            TW_ERR_INVALID_ARGUMENT,
            &["tw_register", "params is NULL"],
        );
        fails(
            tw_register(cfg, p.as_mut_ptr(), TOTAL, null_mut(), TOTAL),
            TW_ERR_INVALID_ARGUMENT,
            &["grads is NULL"],
        );
        fails(
            tw_init(null(), &mut s),
            TW_ERR_INVALID_ARGUMENT,
            &["tw_init", "cfg is NULL"],
        );
        assert!(s.is_null());
        fails(tw_init(cfg, null_mut()), TW_ERR_INVALID_ARGUMENT, &["out is NULL"]);
        fails(
            tw_init_explicit(cfg, 0, 1, 0, null(), &mut s),
            TW_ERR_INVALID_ARGUMENT,
            &["master is NULL"],
        );
        fails(
            tw_push(null_mut(), 0),
            TW_ERR_INVALID_ARGUMENT,
            &["tw_push", "session is NULL"],
        );
        fails(
            tw_push_factors(null_mut(), 0, null(), 0, null(), 0),
            TW_ERR_INVALID_ARGUMENT,
            &["session is NULL"],
        );
        fails(
            tw_pull(null_mut(), 0),
            TW_ERR_INVALID_ARGUMENT,
            &["tw_pull", "session is NULL"],
        );
        fails(
            tw_poll(null_mut(), 0, &mut done),
            TW_ERR_INVALID_ARGUMENT,
            &["tw_poll", "session is NULL"],
        );
        fails(tw_pull_all(null_mut()), TW_ERR_INVALID_ARGUMENT, &["session is NULL"]);
        fails(tw_rank(null()), TW_ERR_INVALID_ARGUMENT, &["tw_rank"]);
        fails(tw_world_size(null()), TW_ERR_INVALID_ARGUMENT, &["tw_world_size"]);
        fails(tw_num_layers(null()), TW_ERR_INVALID_ARGUMENT, &["tw_num_layers"]);
        fails(tw_is_worker(null()), TW_ERR_INVALID_ARGUMENT, &["tw_is_worker"]);
        fails(tw_scheme(null(), 0), TW_ERR_INVALID_ARGUMENT, &["tw_scheme"]);
        assert!(tw_transport(null()).is_null());
        assert!(last_error().contains("tw_transport"));
        // NULL is a no-op for the two frees.
        assert_eq!(tw_finalize(null_mut()), TW_OK);
        tw_config_free(null_mut());
    }
    let s = solo(cfg, &mut p, &mut g);
    // SAFETY: s is live and finalized last; done is NULL, which is under test.
    unsafe {
        fails(tw_poll(s, 0, null_mut()), TW_ERR_INVALID_ARGUMENT, &["done is NULL"]);
        let u = [0f32; 6];
        // Wrong sizes (U 2×3 and V 2×4 at batch 2) are named before the pointers.
        fails(
            tw_push_factors(s, 1, null(), 6, u.as_ptr(), 6),
            TW_ERR_INVALID_ARGUMENT,
            &["factors of 6 and 6 floats", "want U 2x3 = 6 and V 2x4 = 8"],
        );
        let v = [0f32; 8];
        fails(
            tw_push_factors(s, 1, null(), 6, v.as_ptr(), 8),
            TW_ERR_INVALID_ARGUMENT,
            &["u is NULL"],
        );
        fails(
            tw_push_factors(s, 1, u.as_ptr(), 6, null(), 8),
            TW_ERR_INVALID_ARGUMENT,
            &["v is NULL"],
        );
        assert_eq!(tw_finalize(s), TW_OK, "{}", last_error());
        tw_config_free(cfg);
    }
}

#[test]
fn bad_values_and_sizes_are_refused() {
    let cfg = config();
    let mut p = vec![0f32; TOTAL + 1];
    let mut g = vec![0f32; TOTAL];
    // SAFETY: cfg is live, the buffers hold the lengths passed (or more), and no
    // session is made from them.
    unsafe {
        fails(
            tw_config_add_layer(cfg, c"x".as_ptr(), 7, 1, 1),
            TW_ERR_INVALID_ARGUMENT,
            &["kind 7"],
        );
        fails(
            tw_config_add_layer(cfg, c"x".as_ptr(), TW_LAYER_FC, 0, 4),
            TW_ERR_INVALID_ARGUMENT,
            &["0x4"],
        );
        fails(
            tw_config_add_layer(cfg, c"x".as_ptr(), TW_LAYER_FC, usize::MAX, 2),
            TW_ERR_INVALID_ARGUMENT,
            &["size_t"],
        );
        fails(
            tw_config_add_layer(cfg, c"".as_ptr(), TW_LAYER_FC, 1, 1),
            TW_ERR_INVALID_ARGUMENT,
            &["empty"],
        );
        let bad_utf8: [c_char; 3] = [0xff_u8 as c_char, 0x41, 0];
        fails(
            tw_config_add_layer(cfg, bad_utf8.as_ptr(), TW_LAYER_FC, 1, 1),
            TW_ERR_INVALID_ARGUMENT,
            &["UTF-8"],
        );
        fails(tw_config_set_batch(cfg, 0), TW_ERR_INVALID_ARGUMENT, &["batch"]);
        fails(
            tw_config_set_apply(cfg, 9, 0.0, 0.0, 0.0),
            TW_ERR_INVALID_ARGUMENT,
            &["apply op 9"],
        );
        fails(
            tw_config_set_apply(cfg, TW_APPLY_MEAN, 0.1, 0.0, 0.0),
            TW_ERR_INVALID_ARGUMENT,
            &["TW_APPLY_SGD"],
        );
        fails(
            tw_config_set_apply(cfg, TW_APPLY_SGD, 0.0, 0.0, 0.0),
            TW_ERR_INVALID_ARGUMENT,
            &["learning rate"],
        );
        fails(
            tw_config_set_apply(cfg, TW_APPLY_SGD, f32::NAN, 0.0, 0.0),
            TW_ERR_INVALID_ARGUMENT,
            &["learning rate"],
        );
        fails(
            tw_config_set_apply(cfg, TW_APPLY_SGD, 0.1, -1.0, 0.0),
            TW_ERR_INVALID_ARGUMENT,
            &["momentum"],
        );
        assert_eq!(tw_config_set_apply(cfg, TW_APPLY_SGD, 0.1, 0.9, 1e-4), TW_OK);
        fails(
            tw_config_set_consistency(cfg, TW_CONSISTENCY_BSP, 2),
            TW_ERR_INVALID_ARGUMENT,
            &["BSP"],
        );
        fails(
            tw_config_set_consistency(cfg, TW_CONSISTENCY_SSP, 0),
            TW_ERR_INVALID_ARGUMENT,
            &["1 to 64"],
        );
        fails(
            tw_config_set_consistency(cfg, TW_CONSISTENCY_SSP, 65),
            TW_ERR_INVALID_ARGUMENT,
            &["1 to 64"],
        );
        fails(
            tw_config_set_consistency(cfg, 5, 0),
            TW_ERR_INVALID_ARGUMENT,
            &["consistency 5"],
        );
        assert_eq!(tw_config_set_consistency(cfg, TW_CONSISTENCY_SSP, 3), TW_OK);
        assert_eq!(tw_config_set_consistency(cfg, TW_CONSISTENCY_BSP, 0), TW_OK);
        fails(tw_config_set_timeout_ms(cfg, 0), TW_ERR_INVALID_ARGUMENT, &["timeout"]);
        fails(
            tw_config_set_connect_timeout_ms(cfg, 0),
            TW_ERR_INVALID_ARGUMENT,
            &["connect timeout"],
        );
        fails(
            tw_config_set_transport(cfg, 4),
            TW_ERR_INVALID_ARGUMENT,
            &["transport 4"],
        );
        fails(
            tw_config_set_scheme_policy(cfg, -1),
            TW_ERR_INVALID_ARGUMENT,
            &["scheme policy -1"],
        );
        fails(
            tw_config_set_job(cfg, 1, c"".as_ptr()),
            TW_ERR_INVALID_ARGUMENT,
            &["secret is empty"],
        );

        // Sizes that do not match the table (36 + 12 floats).
        let (pp, gp) = (p.as_mut_ptr(), g.as_mut_ptr());
        fails(
            tw_register(cfg, pp, TOTAL + 1, gp, TOTAL),
            TW_ERR_LAYOUT,
            &["n_params is 49", "48 values", "conv 4x9 + fc 3x4"],
        );
        fails(
            tw_register(cfg, pp, TOTAL, gp, TOTAL - 1),
            TW_ERR_LAYOUT,
            &["n_grads is 47"],
        );
        // Overlapping and misaligned memory.
        fails(
            tw_register(cfg, pp, TOTAL, pp.add(1), TOTAL),
            TW_ERR_INVALID_ARGUMENT,
            &["overlap"],
        );
        let misaligned = pp.cast::<u8>().add(1).cast::<f32>();
        fails(
            tw_register(cfg, misaligned, TOTAL, gp, TOTAL),
            TW_ERR_INVALID_ARGUMENT,
            &["not aligned"],
        );
        // No registration yet: tw_init refuses before it touches the network.
        let mut s = null_mut();
        fails(
            tw_init_explicit(cfg, 0, 1, 0, c"127.0.0.1:1".as_ptr(), &mut s),
            TW_ERR_LAYOUT,
            &["tw_register"],
        );
        assert!(s.is_null());
        // Cluster settings.
        assert_eq!(tw_register(cfg, pp, TOTAL, gp, TOTAL), TW_OK);
        fails(
            tw_init_explicit(cfg, 2, 2, 0, c"127.0.0.1:1".as_ptr(), &mut s),
            TW_ERR_INVALID_ARGUMENT,
            &["rank 2 outside a world of 2"],
        );
        fails(
            tw_init_explicit(cfg, 0, 2, 2, c"127.0.0.1:1".as_ptr(), &mut s),
            TW_ERR_INVALID_ARGUMENT,
            &["no worker"],
        );
        fails(
            tw_init_explicit(cfg, 0, 1, 0, c"no port here".as_ptr(), &mut s),
            TW_ERR_CLUSTER,
            &["master", "no port here"],
        );
        assert!(s.is_null());
        // A layer after the registration would not be in the registered memory.
        fails(
            tw_config_add_layer(cfg, c"late".as_ptr(), TW_LAYER_OTHER, 1, 1),
            TW_ERR_STATE,
            &["after tw_register"],
        );
        tw_config_free(cfg);

        // Registering needs layers.
        let empty = tw_config_new();
        fails(tw_register(empty, pp, TOTAL, gp, TOTAL), TW_ERR_STATE, &["no layers"]);
        tw_config_free(empty);
    }
}

#[test]
fn the_environment_without_a_rank_is_a_cluster_error() {
    if ["TIDEWIRE_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
    {
        eprintln!("skipped: this environment names a rank");
        return;
    }
    let cfg = config();
    let mut p = vec![0f32; TOTAL];
    let mut g = vec![0f32; TOTAL];
    let mut s = null_mut();
    // SAFETY: cfg is live and the buffers hold TOTAL floats; tw_init fails before
    // any session exists.
    unsafe {
        assert_eq!(tw_register(cfg, p.as_mut_ptr(), TOTAL, g.as_mut_ptr(), TOTAL), TW_OK);
        fails(tw_init(cfg, &mut s), TW_ERR_CLUSTER, &["tw_init", "TIDEWIRE_RANK"]);
        assert!(s.is_null());
        tw_config_free(cfg);
    }
}

#[test]
fn misuse_of_a_session_gives_state_and_argument_errors() {
    let cfg = config();
    // SAFETY: cfg is live.
    unsafe { assert_eq!(tw_config_set_scheme_policy(cfg, TW_POLICY_SFB), TW_OK) };
    let mut p: Vec<f32> = (0..TOTAL).map(|i| i as f32).collect();
    let mut g = vec![1f32; TOTAL];
    let s = solo(cfg, &mut p, &mut g);
    // The config can go at once; the session keeps what it needs.
    // SAFETY: cfg is live and not used after.
    unsafe { tw_config_free(cfg) };
    let mut done = -1;
    // SAFETY: s is live until tw_finalize at the end; p and g are read here only
    // while the session holds no layer of theirs (after pulls).
    unsafe {
        assert_eq!(tw_rank(s), 0);
        assert_eq!(tw_world_size(s), 1);
        assert_eq!(tw_num_layers(s), 2);
        assert_eq!(tw_is_worker(s), 1);
        assert_eq!(tw_scheme(s, 0), TW_SCHEME_PS);
        assert_eq!(tw_scheme(s, 1), TW_SCHEME_SFB, "the FC layer under TW_POLICY_SFB");
        let t = CStr::from_ptr(tw_transport(s)).to_str().unwrap();
        assert!(["tcp", "portable", "rdma"].contains(&t), "{t}");

        // Unknown layers.
        fails(tw_push(s, 2), TW_ERR_INVALID_ARGUMENT, &["unknown layer 2", "2 layers"]);
        fails(tw_pull(s, 9), TW_ERR_INVALID_ARGUMENT, &["unknown layer 9"]);
        fails(
            tw_poll(s, u32::MAX, &mut done),
            TW_ERR_INVALID_ARGUMENT,
            &["unknown layer 4294967295"],
        );
        fails(tw_scheme(s, 2), TW_ERR_INVALID_ARGUMENT, &["unknown layer 2"]);
        // The wrong push for the scheme or the kind.
        fails(tw_push(s, 1), TW_ERR_INVALID_ARGUMENT, &["tw_push", "fc"]);
        let (u, v) = ([0f32; 2 * 4], [0f32; 2 * 9]);
        fails(
            tw_push_factors(s, 0, u.as_ptr(), 8, v.as_ptr(), 18),
            TW_ERR_INVALID_ARGUMENT,
            &["not fully connected"],
        );
        // A layer never pushed is synced already.
        assert_eq!(tw_poll(s, 0, &mut done), TW_OK);
        assert_eq!(done, 1);
        assert_eq!(tw_pull(s, 0), TW_OK);

        // Push, then push again before the pull.
        assert_eq!(tw_push(s, 0), TW_OK, "{}", last_error());
        fails(tw_push(s, 0), TW_ERR_STATE, &["layer 0 is pushed and not pulled yet"]);
        assert_eq!(tw_pull(s, 0), TW_OK, "{}", last_error());
        // One rank, TW_APPLY_SUM: the pulled parameters are the gradient, in place.
        assert!(p[..36].iter().all(|&x| x == 1.0), "{:?}", &p[..36]);
        assert_eq!(
            p[36..],
            (36..TOTAL).map(|i| i as f32).collect::<Vec<_>>()[..],
            "layer 1 untouched"
        );

        // Factors: U = [e0; e1] (2×3), V (2×4) -> Uᵀ·V.
        let u = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0];
        let v = [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 1.0];
        assert_eq!(
            tw_push_factors(s, 1, u.as_ptr(), 6, v.as_ptr(), 8),
            TW_OK,
            "{}",
            last_error()
        );
        fails(
            tw_push_factors(s, 1, u.as_ptr(), 6, v.as_ptr(), 8),
            TW_ERR_STATE,
            &["pushed and not pulled"],
        );
        let mut spins = 0u64;
        loop {
            assert_eq!(tw_poll(s, 1, &mut done), TW_OK, "{}", last_error());
            if done == 1 {
                break;
            }
            spins += 1;
            std::thread::yield_now();
        }
        assert_eq!(
            p[36..],
            [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
            "after {spins} polls"
        );
        // The same layer again, then everything at once.
        g.fill(2.0);
        assert_eq!(tw_push(s, 0), TW_OK, "{}", last_error());
        assert_eq!(tw_pull_all(s), TW_OK, "{}", last_error());
        assert!(p[..36].iter().all(|&x| x == 2.0));
        assert_eq!(tw_finalize(s), TW_OK, "{}", last_error());
    }
}

#[test]
fn a_layer_in_flight_at_finalize_is_pulled_first() {
    let cfg = config();
    let mut p = vec![0f32; TOTAL];
    let mut g = vec![3f32; TOTAL];
    let s = solo(cfg, &mut p, &mut g);
    // SAFETY: s and cfg are live; the buffers are read after tw_finalize returned.
    unsafe {
        assert_eq!(tw_push(s, 0), TW_OK, "{}", last_error());
        assert_eq!(tw_finalize(s), TW_OK, "{}", last_error());
        tw_config_free(cfg);
    }
    assert!(p[..36].iter().all(|&x| x == 3.0));
}

#[test]
fn the_last_error_belongs_to_its_thread_and_survives_successes() {
    let cfg = config();
    // SAFETY: cfg is live.
    unsafe {
        fails(
            tw_config_set_batch(cfg, 0),
            TW_ERR_INVALID_ARGUMENT,
            &["batch must be at least 1"],
        );
        assert_eq!(tw_config_set_batch(cfg, 4), TW_OK);
    }
    assert!(
        last_error().contains("batch must be at least 1"),
        "a success keeps the message"
    );
    let other = std::thread::spawn(last_error).join().unwrap();
    assert_eq!(other, "", "another thread has no error");
    // SAFETY: cfg is live and not used after.
    unsafe { tw_config_free(cfg) };
}

#[test]
fn error_names_and_version() {
    assert_eq!(name(TW_OK), "TW_OK");
    assert_eq!(name(TW_ERR_TIMEOUT), "TW_ERR_TIMEOUT");
    assert_eq!(name(TW_ERR_PANIC), "TW_ERR_PANIC");
    assert_eq!(name(-99), "TW_ERR_UNKNOWN");
    let codes = [
        TW_ERR_INVALID_ARGUMENT,
        TW_ERR_CLUSTER,
        TW_ERR_TIMEOUT,
        TW_ERR_SHUTDOWN,
        TW_ERR_TRANSPORT,
        TW_ERR_LAYOUT,
        TW_ERR_ENGINE,
        TW_ERR_STATE,
        TW_ERR_PEER_LOST,
        TW_ERR_PANIC,
    ];
    let mut seen = std::collections::HashSet::new();
    for c in codes {
        assert!(c < 0 && seen.insert(c), "{c}");
        assert!(name(c).starts_with("TW_ERR_") && name(c) != "TW_ERR_UNKNOWN");
    }
    // SAFETY: tw_version returns a static NUL-terminated string.
    let v = unsafe { CStr::from_ptr(tw_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

#[test]
fn rdma_without_the_feature_is_a_transport_error() {
    if cfg!(feature = "rdma") || std::env::var_os("TIDEWIRE_TRANSPORT").is_some() {
        eprintln!("skipped: RDMA is built in, or TIDEWIRE_TRANSPORT overrides the choice");
        return;
    }
    let cfg = config();
    let mut p = vec![0f32; TOTAL];
    let mut g = vec![0f32; TOTAL];
    let mut s = null_mut();
    // SAFETY: cfg is live and the buffers hold TOTAL floats; the session is never made.
    unsafe {
        assert_eq!(tw_config_set_transport(cfg, TW_TRANSPORT_RDMA), TW_OK);
        assert_eq!(tw_register(cfg, p.as_mut_ptr(), TOTAL, g.as_mut_ptr(), TOTAL), TW_OK);
        fails(
            tw_init_explicit(cfg, 0, 1, 0, c"127.0.0.1:1".as_ptr(), &mut s),
            TW_ERR_TRANSPORT,
            &["rdma"],
        );
        assert!(s.is_null());
        tw_config_free(cfg);
    }
}
