//! Push/pull over caller-owned memory (`PinnedBuffer::foreign`): randomized
//! jobs (seeded; the seed is printed), every rank's result checked against
//! the exact sum, and the interface's misuse errors.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tidewire::cluster::ClusterSpec;
use tidewire::engine::book::{LayerKind, LayerSpec};
use tidewire::engine::testkit::{next, seed};
use tidewire::engine::{EngineError, Scheme, SchemePolicy};
use tidewire::gpu::cpu::ApplyOp;
use tidewire::pushpull::PushPull;
use tidewire::session::BufferLayout;
use tidewire::transport::{JobSecret, PinnedBuffer};
use tidewire::{Builder, Error};

/// A Vec<f32> handed over as caller memory: the buffer owns it from here on.
fn foreign(n: usize, fill: f32) -> (PinnedBuffer, usize) {
    let v = vec![fill; n.max(1)];
    let addr = v.as_ptr() as usize;
    (PinnedBuffer::from_f32_vec(v).unwrap(), addr)
}

fn free_master() -> SocketAddr {
    let port = tidewire::rendezvous::free_port(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    format!("127.0.0.1:{port}").parse().unwrap()
}

/// The gradient rank `r` pushes for element `i` of layer `l` at step `t`:
/// small integers, so every sum is exact whatever the order.
fn grad(r: usize, t: usize, l: usize, i: usize) -> f32 {
    ((r * 7 + t * 3 + l * 5 + i) % 11) as f32 - 5.0
}

#[derive(Debug, Clone)]
struct Job {
    layers: Vec<LayerSpec>,
    ranks: usize,
    steps: usize,
    batch: usize,
    policy: SchemePolicy,
    mean: bool,
    poll: bool,
}

fn random_job(s: &mut u64) -> Job {
    let n = 1 + next(s) as usize % 4;
    let layers = (0..n)
        .map(|i| {
            let kind = [LayerKind::Fc, LayerKind::Conv, LayerKind::Other][next(s) as usize % 3];
            LayerSpec::new(
                format!("l{i}"),
                kind,
                1 + next(s) as usize % 40,
                1 + next(s) as usize % 300,
            )
        })
        .collect();
    Job {
        layers,
        ranks: 1 + next(s) as usize % 3,
        steps: 1 + next(s) as usize % 4,
        batch: 1 + next(s) as usize % 4,
        policy: [SchemePolicy::Hybrid, SchemePolicy::Ps, SchemePolicy::Sfb][next(s) as usize % 3],
        mean: next(s) % 2 == 0,
        poll: next(s) % 2 == 0,
    }
}

/// One rank: returns its parameters after every step, read through `held`.
fn rank(job: Job, r: usize, master: SocketAddr) -> Result<Vec<Vec<f32>>, Error> {
    let total: usize = job.layers.iter().map(|l| l.params()).sum();
    let (params, _) = foreign(total, 0.0);
    let (grads, _) = foreign(total, 0.0);
    let mut offsets = Vec::new();
    let mut at = 0;
    for l in &job.layers {
        offsets.push(at * 4);
        at += l.params();
    }
    let session = Builder::new(job.layers.clone())
        .batch(job.batch)
        .chunk_bytes(1024)
        .slice_params(64)
        .policy(job.policy)
        .apply(if job.mean { ApplyOp::Mean } else { ApplyOp::Sum })
        .job(11, JobSecret::new(b"pushpull".to_vec()))
        .timeout(Duration::from_secs(30))
        .params_buffer(BufferLayout {
            buffer: params,
            offsets: offsets.clone(),
        })
        .grads_buffer(BufferLayout { buffer: grads, offsets })
        .build(ClusterSpec::new(r as u32, job.ranks, 0, true, master)?)?;
    let mut pp = PushPull::new(session)?;
    let mut out = Vec::new();
    let k = job.batch;
    for t in 0..job.steps {
        // Backward order: last layer first, each pushed the moment it is "produced".
        for (l, spec) in job.layers.iter().enumerate().rev() {
            let l32 = l as u32;
            if pp.session().scheme(l32)? == Scheme::Sfb {
                // Refused without factors, and the layer stays the caller's.
                assert!(matches!(
                    pp.push(l32),
                    Err(Error::Engine(EngineError::NeedsFactors { .. }))
                ));
                // U = e_(i mod M) rows scaled, V rows chosen so Uᵀ·V has integer entries.
                let u: Vec<f32> = (0..k * spec.m)
                    .map(|x| {
                        if x % spec.m == (x / spec.m + t) % spec.m {
                            1.0
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let v: Vec<f32> = (0..k * spec.n).map(|i| grad(r, t, l, i)).collect();
                assert!(pp.push_factors(l32, &u[1..], &v).is_err(), "short U refused");
                pp.push_factors(l32, &u, &v)?;
            } else {
                let g = pp.held(l32)?;
                for (i, x) in g.grad_mut().iter_mut().enumerate() {
                    *x = grad(r, t, l, i);
                }
                pp.push(l32)?;
            }
            assert!(pp.in_flight(l32));
            assert!(pp.held(l32).is_err(), "a pushed layer is not the caller's");
            assert!(pp.push(l32).is_err(), "a second push before the pull is refused");
        }
        let mut step = Vec::new();
        for l in 0..job.layers.len() as u32 {
            if job.poll {
                let t0 = Instant::now();
                while !pp.poll(l)? {
                    assert!(t0.elapsed() < Duration::from_secs(30), "poll never completed");
                    std::thread::sleep(Duration::from_micros(200));
                }
            } else {
                pp.pull(l)?;
            }
            pp.pull(l)?; // a second pull of a synced layer returns at once
            step.extend_from_slice(pp.held(l)?.params());
        }
        out.push(step);
    }
    pp.shutdown()?;
    Ok(out)
}

/// What every rank must hold after step `t`: the sum (or mean) over ranks.
fn expected(job: &Job, schemes: &[Scheme], t: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for (l, spec) in job.layers.iter().enumerate() {
        let mut acc = vec![0.0f64; spec.params()];
        for r in 0..job.ranks {
            if schemes[l] == Scheme::Sfb {
                // Uᵀ·V: row a gets V's row k wherever U[k][a] = 1.
                for kk in 0..job.batch {
                    let a = (kk + t) % spec.m;
                    for c in 0..spec.n {
                        acc[a * spec.n + c] += grad(r, t, l, kk * spec.n + c) as f64;
                    }
                }
            } else {
                for (i, x) in acc.iter_mut().enumerate() {
                    *x += grad(r, t, l, i) as f64;
                }
            }
        }
        let scale = if job.mean { 1.0 / job.ranks as f32 } else { 1.0 };
        out.extend(acc.iter().map(|&x| x as f32 * scale));
    }
    out
}

#[test]
fn randomized_push_pull_jobs_over_caller_memory() {
    let seed = seed("TIDEWIRE_PUSHPULL_SEED");
    let jobs: usize = std::env::var("TIDEWIRE_PUSHPULL_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    eprintln!("pushpull: seed {seed} (TIDEWIRE_PUSHPULL_SEED), {jobs} jobs");
    let mut s = seed;
    for j in 0..jobs {
        let job = random_job(&mut s);
        let master = free_master();
        let handles: Vec<_> = (0..job.ranks)
            .map(|r| {
                let job = job.clone();
                std::thread::spawn(move || rank(job, r, master))
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().expect("rank panicked")).collect();
        let results: Vec<Vec<Vec<f32>>> = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("seed {seed} job {j} {job:?}: {e}")))
            .collect();
        // The schemes the book chose (the same on every rank: rendezvous checks it).
        let book = tidewire::engine::Book::new(
            tidewire::engine::Cluster::from_roles(vec![tidewire::engine::Role::Both; job.ranks]).unwrap(),
            job.layers.clone(),
            tidewire::engine::BookConfig {
                batch: job.batch,
                chunk_bytes: 1024,
                slice_params: 64,
                policy: job.policy,
                ..Default::default()
            },
        )
        .unwrap();
        let schemes: Vec<Scheme> = (0..job.layers.len() as u32).map(|l| book.scheme(l, 0)).collect();
        for (r, steps) in results.iter().enumerate() {
            for (t, got) in steps.iter().enumerate() {
                let want = expected(&job, &schemes, t);
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "seed {seed} job {j} rank {r} step {t} ({schemes:?}): {job:?}"
                );
            }
        }
    }
}

#[test]
fn pull_timeout_and_unknown_layers_are_errors_not_hangs() {
    let layers = vec![LayerSpec::new("w", LayerKind::Other, 2, 2)];
    let (p, _) = foreign(4, 1.0);
    let (g, _) = foreign(4, 0.0);
    // Rank 0 of a 2-rank job whose peer never comes: build itself times out.
    let master = free_master();
    let e = Builder::new(layers.clone())
        .job(3, JobSecret::new(b"x".to_vec()))
        .connect_timeout(Duration::from_millis(300))
        .params_buffer(BufferLayout {
            buffer: p,
            offsets: vec![0],
        })
        .grads_buffer(BufferLayout {
            buffer: g,
            offsets: vec![0],
        })
        .build(ClusterSpec::new(0, 2, 0, true, master).unwrap())
        .unwrap_err();
    assert!(format!("{e}").to_lowercase().contains("time"), "{e}");

    let (p, _) = foreign(4, 1.0);
    let (g, _) = foreign(4, 0.0);
    let s = Builder::new(layers)
        .job(3, JobSecret::new(b"x".to_vec()))
        .apply(ApplyOp::Sum)
        .params_buffer(BufferLayout {
            buffer: p,
            offsets: vec![0],
        })
        .grads_buffer(BufferLayout {
            buffer: g,
            offsets: vec![0],
        })
        .build(ClusterSpec::new(0, 1, 0, true, "127.0.0.1:1".parse().unwrap()).unwrap())
        .unwrap();
    let mut pp = PushPull::new(s).unwrap();
    assert_eq!(pp.held(0).unwrap().params(), &[1.0; 4], "the caller's initial values");
    assert!(matches!(
        pp.push(5),
        Err(Error::Engine(EngineError::UnknownLayer { .. }))
    ));
    assert!(pp.pull(5).is_err() && pp.poll(5).is_err());
    assert!(pp.push_factors(0, &[], &[]).is_err(), "not an FC layer");
    pp.held(0).unwrap().grad_mut().copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
    pp.push(0).unwrap();
    pp.pull_all().unwrap();
    assert_eq!(pp.held(0).unwrap().params(), &[1.0, 2.0, 3.0, 4.0]);
    pp.shutdown().unwrap();
}

#[test]
fn caller_vectors_are_registered_in_place() {
    let (b, addr) = foreign(10, 2.5);
    assert!(b.is_foreign() && !b.is_locked());
    assert_eq!((b.len(), b.as_ptr() as usize), (40, addr), "in place, not copied");
    assert!(PinnedBuffer::from_f32_vec(Vec::new()).is_err(), "empty refused");
}

#[test]
fn f16_bf16_f64_memory_is_staged_and_summed_in_f32() {
    use tidewire::gpu::cpu::{narrow, widen, HostType};
    let seed = seed("TIDEWIRE_PUSHPULL_SEED");
    eprintln!("typed pushpull: seed {seed} (TIDEWIRE_PUSHPULL_SEED)");
    let mut s = seed;
    for t in [HostType::F16, HostType::Bf16, HostType::F64, HostType::F32] {
        let job = random_job(&mut s);
        let (ranks, mean) = (2usize, next(&mut s) % 2 == 0);
        let layers: Vec<LayerSpec> = job
            .layers
            .iter()
            .map(|l| LayerSpec::new(l.name.clone(), LayerKind::Conv, l.m, l.n))
            .collect();
        let total: usize = layers.iter().map(|l| l.params()).sum();
        let master = free_master();
        let hs: Vec<_> = (0..ranks)
            .map(|r| {
                let layers = layers.clone();
                std::thread::spawn(move || -> Result<Vec<Vec<u8>>, Error> {
                    // Each rank starts from different values: rank 0's (all 1.5) win.
                    let mut p = vec![0u8; total * t.size()];
                    narrow(t, &vec![1.5 + r as f32; total], &mut p);
                    let b = Builder::new(layers.clone())
                        .apply(if mean { ApplyOp::Mean } else { ApplyOp::Sum })
                        .chunk_bytes(512)
                        .slice_params(40)
                        .job(5, JobSecret::new(b"typed".to_vec()))
                        .timeout(Duration::from_secs(30));
                    let spec = ClusterSpec::new(r as u32, ranks, 0, true, master)?;
                    let mut pp = PushPull::build(
                        b,
                        spec,
                        t,
                        PinnedBuffer::from_byte_vec(p)?,
                        PinnedBuffer::from_byte_vec(vec![0u8; total * t.size()])?,
                    )?;
                    assert_eq!(pp.host_type(), t);
                    let mut out = Vec::new();
                    for l in 0..layers.len() as u32 {
                        if t == HostType::F32 {
                            assert_eq!(pp.held(l)?.params()[0], 1.5, "rank 0's initial values");
                            let g: Vec<f32> = (0..layers[l as usize].params())
                                .map(|i| grad(r, 0, l as usize, i))
                                .collect();
                            pp.held(l)?.grad_mut().copy_from_slice(&g);
                        } else {
                            let (p, g) = pp.staged_mut(l)?;
                            let mut w = vec![0f32; p.len() / t.size()];
                            widen(t, &p, &mut w);
                            assert!(w.iter().all(|&x| x == 1.5), "rank 0's initial values");
                            let vals: Vec<f32> = (0..w.len()).map(|i| grad(r, 0, l as usize, i)).collect();
                            narrow(t, &vals, g);
                        }
                        pp.push(l)?;
                    }
                    for l in 0..layers.len() as u32 {
                        pp.pull(l)?;
                        out.push(if t == HostType::F32 {
                            pp.held(l)?.params().iter().flat_map(|x| x.to_le_bytes()).collect()
                        } else {
                            pp.staged_mut(l)?.0
                        });
                    }
                    assert!(pp.staged_mut(0).is_err() == (t == HostType::F32));
                    pp.shutdown()?;
                    Ok(out)
                })
            })
            .collect();
        let got: Vec<_> = hs
            .into_iter()
            .map(|h| h.join().unwrap().unwrap_or_else(|e| panic!("seed {seed} {t:?}: {e}")))
            .collect();
        for (l, spec) in layers.iter().enumerate() {
            let sum: Vec<f32> = (0..spec.params())
                .map(|i| {
                    let s: f32 = (0..ranks).map(|r| grad(r, 0, l, i)).sum();
                    if mean {
                        s * (1.0 / ranks as f32)
                    } else {
                        s
                    }
                })
                .collect();
            let mut want = vec![0u8; sum.len() * t.size()];
            narrow(t, &sum, &mut want);
            for (r, g) in got.iter().enumerate() {
                assert_eq!(
                    g[l], want,
                    "seed {seed} {t:?} rank {r} layer {l}: the f32 result, narrowed"
                );
            }
        }
    }
}

#[test]
fn a_push_no_other_worker_makes_fails_every_rank_instead_of_hanging() {
    // Rank 0 pushes layer 1; rank 1 pushes nothing and shuts down. The
    // iteration can never complete: both ranks must hear why, not wait forever.
    let layers = vec![
        LayerSpec::new("a", LayerKind::Conv, 4, 8),
        LayerSpec::new("b", LayerKind::Conv, 4, 300),
    ];
    for servers_first in [false, true] {
        let master = free_master();
        let hs: Vec<_> = (0..2usize)
            .map(|r| {
                let layers = layers.clone();
                std::thread::spawn(move || -> (Result<(), Error>, Result<(), Error>) {
                    let b = Builder::new(layers)
                        .chunk_bytes(256)
                        .job(9, JobSecret::new(b"stranded".to_vec()))
                        .timeout(Duration::from_secs(60));
                    let spec = ClusterSpec::new(r as u32, 2, 0, true, master).unwrap();
                    let n = 4 * 8 + 4 * 300;
                    let mut pp = PushPull::build(
                        b,
                        spec,
                        tidewire::gpu::cpu::HostType::F32,
                        PinnedBuffer::from_f32_vec(vec![0.0; n]).unwrap(),
                        PinnedBuffer::from_f32_vec(vec![1.0; n]).unwrap(),
                    )
                    .unwrap();
                    if r == 0 {
                        let t0 = Instant::now();
                        // The push itself fails if rank 1's goodbye came first.
                        let pulled = pp.push(1).and_then(|()| {
                            if servers_first {
                                std::thread::sleep(Duration::from_millis(200));
                            }
                            pp.pull(1)
                        });
                        assert!(
                            t0.elapsed() < Duration::from_secs(20),
                            "the pull waited {:?}",
                            t0.elapsed()
                        );
                        (pulled, pp.shutdown())
                    } else {
                        if !servers_first {
                            std::thread::sleep(Duration::from_millis(200));
                        }
                        (Ok(()), pp.shutdown())
                    }
                })
            })
            .collect();
        let t0 = Instant::now();
        let rs: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
        let (pull0, shut0) = &rs[0];
        let e = pull0.as_ref().expect_err("rank 0's push or pull cannot succeed");
        let msg = e.to_string();
        assert!(
            msg.contains("finished without pushing iteration 0 of layer 1 (b)"),
            "{msg}"
        );
        assert!(shut0.is_err(), "rank 0's shutdown reports the failure");
        let shut1 = rs[1].1.as_ref().expect_err("rank 1 hears it too");
        assert!(shut1.to_string().contains("finished without pushing"), "{shut1}");
    }
}

#[test]
fn shutdown_after_a_failed_wait_aborts_instead_of_waiting_forever() {
    // Rank 1 stays alive and never pushes: rank 0's pull times out, and its
    // shutdown must not wait for the layer that will never sync.
    let layers = vec![LayerSpec::new("a", LayerKind::Conv, 4, 8)];
    let master = free_master();
    let hs: Vec<_> = (0..2usize)
        .map(|r| {
            let layers = layers.clone();
            std::thread::spawn(move || -> Result<PushPull, Error> {
                let b = Builder::new(layers)
                    .job(10, JobSecret::new(b"late".to_vec()))
                    .timeout(Duration::from_millis(if r == 0 { 500 } else { 30_000 }));
                let spec = ClusterSpec::new(r as u32, 2, 0, true, master).unwrap();
                PushPull::build(
                    b,
                    spec,
                    tidewire::gpu::cpu::HostType::F32,
                    PinnedBuffer::from_f32_vec(vec![0.0; 32]).unwrap(),
                    PinnedBuffer::from_f32_vec(vec![1.0; 32]).unwrap(),
                )
            })
        })
        .collect();
    let mut pps: Vec<PushPull> = hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    let mut r1 = pps.pop().unwrap();
    let mut r0 = pps.pop().unwrap();
    r0.push(0).unwrap();
    let e = r0.pull(0).unwrap_err();
    assert!(e.is_timeout(), "{e}");
    assert!(
        matches!(r0.push(0), Err(Error::LayerState { layer: 0, .. })),
        "the layer is lost"
    );
    let t0 = Instant::now();
    let e = r0.shutdown().unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "shutdown waited {:?}",
        t0.elapsed()
    );
    assert!(e.is_timeout(), "shutdown returns the failure: {e}");
    // Rank 1 hears why.
    let e = r1.pull(0).and_then(|()| {
        r1.push(0)?;
        r1.pull(0)
    });
    let e = e.unwrap_err().to_string();
    assert!(e.contains("aborted") && e.contains("timed out"), "{e}");
}
