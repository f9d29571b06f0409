//! Multi-rank jobs in one process through the C ABI: each rank a thread with its
//! own session over its own memory. A least-squares model y = W·x + b with a
//! known target learns by push/pull with SGD on the servers; the loss must fall
//! and every worker must end with bitwise the same parameters.

use std::ffi::{c_int, CStr, CString};
use std::ptr::null_mut;

use tidewire_c::*;

const M: usize = 3; // outputs
const N: usize = 8; // inputs
const K: usize = 16; // samples per worker per step
const STEPS: usize = 40;
const TOTAL: usize = M * N + M;

fn last_error() -> String {
    // SAFETY: tw_last_error returns a NUL-terminated string valid until the next
    // failing call on this thread; it is copied at once.
    unsafe { CStr::from_ptr(tw_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn ok(rc: c_int) {
    assert_eq!(rc, TW_OK, "{}", last_error());
}

/// A value in [-1, 1) from a seed (splitmix64).
fn uniform(seed: u64) -> f32 {
    let z = tidewire::engine::testkit::mix(seed);
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

fn target(i: usize, j: usize) -> f32 {
    ((i * N + j) % 7) as f32 / 4.0 - 0.75
}

fn sample(rank: u64, step: u64, k: u64) -> ([f32; N], [f32; M]) {
    let x: [f32; N] = std::array::from_fn(|j| uniform((rank << 48) ^ (step << 24) ^ (k << 8) ^ j as u64));
    let y = std::array::from_fn(|i| (0..N).map(|j| target(i, j) * x[j]).sum::<f32>() + 0.1 * i as f32);
    (x, y)
}

/// Mean squared error of (W, b) on a fixed set every rank shares.
fn loss(p: &[f32]) -> f32 {
    let mut l = 0.0;
    for k in 0..64 {
        let (x, y) = sample(99, 0, k);
        for i in 0..M {
            let e = (0..N).map(|j| p[i * N + j] * x[j]).sum::<f32>() + p[M * N + i] - y[i];
            l += e * e;
        }
    }
    l / 64.0
}

struct Job {
    policy: c_int,
    world: u32,
    servers: u32,
    master: CString,
    /// Checkpoint into this directory every 10 steps, and resume from it.
    ckpt: Option<(CString, bool)>,
    /// The steps this run does (a resumed run starts where its checkpoint left off).
    steps: std::ops::Range<usize>,
}

/// What a rank ends with: None for a server-only rank, else (loss before, loss
/// after, parameters).
type Outcome = Option<(f32, f32, Vec<f32>)>;

fn rank(job: &Job, rank: u32) -> Outcome {
    let mut params = vec![0f32; TOTAL];
    let mut grads = vec![0f32; TOTAL];
    if rank != 0 {
        // Only worker rank 0's initial values count: everyone gets them at tw_init.
        params.fill(7.0);
    }
    let cfg = tw_config_new();
    let mut s = null_mut();
    // SAFETY: cfg is live until tw_config_free; params and grads hold TOTAL floats,
    // outlive the session (finalized below) and are touched only while this rank
    // holds the layers (after tw_init and after each pull, before the next push).
    unsafe {
        ok(tw_config_add_layer(cfg, c"w".as_ptr(), TW_LAYER_FC, M, N));
        ok(tw_config_add_layer(cfg, c"b".as_ptr(), TW_LAYER_OTHER, 1, M));
        ok(tw_config_set_batch(cfg, K));
        ok(tw_config_set_apply(cfg, TW_APPLY_SGD, 0.2, 0.5, 0.0));
        ok(tw_config_set_scheme_policy(cfg, job.policy));
        ok(tw_config_set_job(cfg, 11, c"capi-train".as_ptr()));
        ok(tw_config_set_timeout_ms(cfg, 60_000));
        ok(tw_config_set_connect_timeout_ms(cfg, 60_000));
        if let Some((dir, resume)) = &job.ckpt {
            ok(tw_config_set_checkpoint(cfg, dir.as_ptr(), 10, 2, 0));
            if *resume {
                ok(tw_config_set_resume(cfg, dir.as_ptr()));
            }
        }
        ok(tw_register(cfg, params.as_mut_ptr(), TOTAL, grads.as_mut_ptr(), TOTAL));
        ok(tw_init_explicit(
            cfg,
            rank,
            job.world,
            job.servers,
            job.master.as_ptr(),
            &mut s,
        ));
        tw_config_free(cfg);
        assert_eq!(tw_rank(s), rank as c_int);
        assert_eq!(tw_world_size(s), job.world as c_int);
        if tw_is_worker(s) == 0 {
            assert_eq!(tw_push(s, 0), TW_ERR_STATE);
            assert!(last_error().contains("server only"), "{}", last_error());
            ok(tw_finalize(s));
            return None;
        }
    }
    // SAFETY: s is live until tw_finalize.
    let first = unsafe { tw_start_iteration(s) } as usize;
    assert_eq!(first, job.steps.start, "the iteration the session starts from");
    if first == 0 {
        assert_eq!(params, vec![0.0; TOTAL], "rank 0's initial values everywhere");
    }
    let before = loss(&params);
    // SAFETY: s is live until tw_finalize; the buffers as above.
    let sfb = unsafe { tw_scheme(s, 0) } == TW_SCHEME_SFB;
    if job.policy == TW_POLICY_SFB {
        assert!(sfb);
    }
    if job.policy == TW_POLICY_PS {
        assert!(!sfb);
    }
    let mut u = [0f32; K * M];
    let mut v = [0f32; K * N];
    for step in job.steps.clone() {
        // Forward and backward on this rank's batch; 1/K of the gradient per sample.
        let (w, b) = params.split_at(M * N);
        let (gw, gb) = grads.split_at_mut(M * N);
        gw.fill(0.0);
        gb.fill(0.0);
        for k in 0..K {
            let (x, y) = sample(rank as u64 + 1, step as u64, k as u64);
            for i in 0..M {
                let e = ((0..N).map(|j| w[i * N + j] * x[j]).sum::<f32>() + b[i] - y[i]) / K as f32;
                u[k * M + i] = e;
                gb[i] += e;
                for j in 0..N {
                    gw[i * N + j] += e * x[j];
                }
            }
            v[k * N..(k + 1) * N].copy_from_slice(&x);
        }
        let mut done = 0;
        // SAFETY: s is live; u and v hold K×M and K×N floats; the layers' memory is
        // left alone between push and pull.
        unsafe {
            ok(tw_push(s, 1)); // the bias, output side first (backward order)
            if sfb {
                ok(tw_push_factors(s, 0, u.as_ptr(), u.len(), v.as_ptr(), v.len()));
            } else {
                ok(tw_push(s, 0));
            }
            ok(tw_pull(s, 0));
            while done == 0 {
                ok(tw_poll(s, 1, &mut done));
                std::thread::yield_now();
            }
        }
    }
    // SAFETY: s is live and not used after.
    unsafe { ok(tw_finalize(s)) };
    Some((before, loss(&params), params))
}

fn run(policy: c_int, world: u32, servers: u32) {
    let workers = job(policy, world, servers, None, 0..STEPS);
    let (before, after, _) = workers[0];
    eprintln!("policy {policy}: loss {before} -> {after}");
    assert!(after < before / 100.0, "the loss fell from {before} to {after} only");
}

/// Runs a job, checks that every worker ends with the same parameters, and
/// returns the workers' outcomes.
fn job(
    policy: c_int,
    world: u32,
    servers: u32,
    ckpt: Option<(CString, bool)>,
    steps: std::ops::Range<usize>,
) -> Vec<(f32, f32, Vec<f32>)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let job = std::sync::Arc::new(Job {
        policy,
        world,
        servers,
        master: CString::new(format!("127.0.0.1:{port}")).unwrap(),
        ckpt,
        steps,
    });
    let ranks: Vec<_> = (0..world)
        .map(|r| {
            let job = job.clone();
            std::thread::spawn(move || rank(&job, r))
        })
        .collect();
    let outcomes: Vec<Outcome> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    let workers: Vec<_> = outcomes.into_iter().flatten().collect();
    assert_eq!(workers.len(), (world - servers) as usize);
    let p0 = workers[0].2.clone();
    for (r, (_, _, p)) in workers.iter().enumerate() {
        let same = p.iter().zip(&p0).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "worker {r} differs from worker 0:\n{p:?}\n{p0:?}");
    }
    workers
}

/// Checkpoints through the C ABI: a job checkpointed every 10 steps stops
/// after 20; another job resumes from the directory (tw_start_iteration
/// says 20) and ends bitwise where an uninterrupted 40-step run does.
#[test]
fn a_job_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one() {
    let dir = std::env::temp_dir().join(format!("tidewire-capi-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = CString::new(dir.to_str().unwrap()).unwrap();
    let whole = job(TW_POLICY_PS, 3, 1, None, 0..STEPS);
    job(TW_POLICY_PS, 3, 1, Some((d.clone(), false)), 0..20);
    assert!(dir.join("step-00000020/manifest.json").is_file());
    let resumed = job(TW_POLICY_PS, 3, 1, Some((d, true)), 20..STEPS);
    let same = whole[0]
        .2
        .iter()
        .zip(&resumed[0].2)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "resumed {:?}\nwhole {:?}", resumed[0].2, whole[0].2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_triggers_and_checkpoint_settings_are_refused() {
    let cfg = tw_config_new();
    // SAFETY: cfg is live until tw_config_free; the strings are NUL-terminated.
    unsafe {
        assert_eq!(
            tw_config_set_trigger(cfg, c"quorum:x".as_ptr()),
            TW_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("quorum:K"), "{}", last_error());
        ok(tw_config_set_trigger(cfg, c"timeout:5".as_ptr()));
        assert_eq!(
            tw_config_set_checkpoint(cfg, c"/tmp/x".as_ptr(), 0, 2, 0),
            TW_ERR_INVALID_ARGUMENT
        );
        assert_eq!(tw_config_set_resume(cfg, std::ptr::null()), TW_ERR_INVALID_ARGUMENT);
        tw_config_free(cfg);
    }
}

#[test]
fn two_ranks_train_through_the_parameter_server() {
    run(TW_POLICY_PS, 2, 0);
}

#[test]
fn two_ranks_train_by_sufficient_factors() {
    run(TW_POLICY_SFB, 2, 0);
}

#[test]
fn two_workers_and_a_server_only_rank_train() {
    run(TW_POLICY_HYBRID, 3, 1);
}

#[test]
fn a_pull_that_times_out_loses_the_layer() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master = CString::new(format!("127.0.0.1:{port}")).unwrap();
    let ranks: Vec<_> = (0..2u32)
        .map(|r| {
            let master = master.clone();
            std::thread::spawn(move || {
                let mut p = vec![0f32; TOTAL];
                let mut g = vec![0f32; TOTAL];
                let cfg = tw_config_new();
                let mut s = null_mut();
                // SAFETY: cfg is live until freed; p and g hold TOTAL floats and outlive
                // the session, finalized before they go; they are not touched meanwhile.
                unsafe {
                    ok(tw_config_add_layer(cfg, c"w".as_ptr(), TW_LAYER_FC, M, N));
                    ok(tw_config_add_layer(cfg, c"b".as_ptr(), TW_LAYER_OTHER, 1, M));
                    ok(tw_config_set_scheme_policy(cfg, TW_POLICY_PS));
                    ok(tw_config_set_job(cfg, 12, c"capi-timeout".as_ptr()));
                    ok(tw_config_set_timeout_ms(cfg, 1500));
                    ok(tw_config_set_connect_timeout_ms(cfg, 30_000));
                    ok(tw_register(cfg, p.as_mut_ptr(), TOTAL, g.as_mut_ptr(), TOTAL));
                    ok(tw_init_explicit(cfg, r, 2, 0, master.as_ptr(), &mut s));
                    tw_config_free(cfg);
                    if r == 0 {
                        // Rank 1 never pushes: the pull runs out of time.
                        ok(tw_push(s, 1));
                        assert_eq!(tw_pull(s, 1), TW_ERR_TIMEOUT, "{}", last_error());
                        assert!(last_error().contains("timed out"), "{}", last_error());
                        let mut done = 0;
                        assert_eq!(tw_push(s, 1), TW_ERR_STATE);
                        assert!(last_error().contains("layer 1 was lost"), "{}", last_error());
                        assert_eq!(tw_poll(s, 1, &mut done), TW_ERR_STATE);
                        assert_eq!(tw_pull(s, 1), TW_ERR_STATE);
                        // The other layer is still usable locally.
                        assert_eq!(tw_poll(s, 0, &mut done), TW_OK);
                        assert_eq!(done, 1);
                    } else {
                        // Too late: rank 0's finalize after its timed-out pull aborted the
                        // job rather than wait for a layer that might never sync, and
                        // this rank hears why.
                        std::thread::sleep(std::time::Duration::from_millis(3500));
                        let rc = match tw_push(s, 1) {
                            TW_OK => tw_pull(s, 1),
                            rc => rc,
                        };
                        assert_eq!(rc, TW_ERR_PEER_LOST, "{}", last_error());
                        assert!(
                            last_error().contains("aborted") && last_error().contains("timed out"),
                            "{}",
                            last_error()
                        );
                    }
                    if r == 0 {
                        assert_eq!(tw_finalize(s), TW_ERR_STATE);
                        assert!(last_error().contains("layers [1] were lost"), "{}", last_error());
                        assert!(last_error().contains("timed out"), "{}", last_error());
                    } else {
                        assert_ne!(tw_finalize(s), TW_OK, "the job was aborted");
                    }
                }
            })
        })
        .collect();
    for h in ranks {
        h.join().unwrap();
    }
}
