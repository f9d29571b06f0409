//! Nexus's local aggregation through push/pull: nodes whose leader rank
//! ([`PushPull::lead`]) sums its learners' gradients ([`LearnerPushPull`],
//! threads here, processes in a real job) and pushes once, against the flat
//! job where every learner is a rank and the servers fold each node's
//! learners first (`fold_group`). Randomized and seeded
//! (`TIDEWIRE_LOCAL_PP_SEED`, printed): every learner of both jobs ends every
//! step with bitwise the same parameters, equal to the sum in that order.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tidewire::cluster::ClusterSpec;
use tidewire::engine::book::{LayerKind, LayerSpec};
use tidewire::engine::testkit::mix;
use tidewire::engine::{SchedConfig, SchemePolicy};
use tidewire::gpu::cpu::{ApplyOp, HostType};
use tidewire::local::{LearnerPushPull, LocalGroup};
use tidewire::pushpull::PushPull;
use tidewire::transport::{JobSecret, PinnedBuffer};
use tidewire::{Builder, Error};

fn free_master() -> SocketAddr {
    let port = tidewire::rendezvous::free_port(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    format!("127.0.0.1:{port}").parse().unwrap()
}

/// Learner `g`'s gradient: arbitrary floats, so the summation order shows.
fn grad(seed: u64, g: usize, t: usize, l: usize, i: usize) -> f32 {
    let h = mix(seed ^ mix((g as u64) << 40 ^ (t as u64) << 24 ^ (l as u64) << 16 ^ i as u64));
    (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

#[derive(Debug, Clone)]
struct Job {
    seed: u64,
    sizes: Vec<usize>,
    nodes: usize,
    learners: usize,
    steps: usize,
}

fn builder(job: &Job, sched: SchedConfig) -> Builder {
    let layers = job
        .sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| LayerSpec::new(format!("l{i}"), LayerKind::Conv, 1, n))
        .collect();
    Builder::new(layers)
        .chunk_bytes(1024)
        .slice_params(48)
        .policy(SchemePolicy::Ps)
        .sched(sched)
        .apply(ApplyOp::Mean)
        .job(12, JobSecret::new(b"local".to_vec()))
        .timeout(Duration::from_secs(30))
}

fn mem(n: usize) -> PinnedBuffer {
    PinnedBuffer::from_f32_vec(vec![0.0; n]).unwrap()
}

/// One learner's steps: fill the gradient, push every layer (last first),
/// pull them all, record the parameters.
fn steps(
    job: &Job,
    g: usize,
    mut push: impl FnMut(u32) -> Result<(), Error>,
    mut pull: impl FnMut() -> Result<(), Error>,
    mut access: impl FnMut(&mut dyn FnMut(&mut [f32], &[f32])),
) -> Result<Vec<Vec<f32>>, Error> {
    let mut out = Vec::new();
    for t in 0..job.steps {
        access(&mut |grads, _| {
            let mut at = 0;
            for (l, &n) in job.sizes.iter().enumerate() {
                for i in 0..n {
                    grads[at + i] = grad(job.seed, g, t, l, i);
                }
                at += n;
            }
        });
        for l in (0..job.sizes.len()).rev() {
            push(l as u32)?;
        }
        pull()?;
        access(&mut |_, params| out.push(params.to_vec()));
    }
    Ok(out)
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A rank's memory, flat, through `held`: `f` reads the parameters and
/// writes the gradient.
fn rank_access(p: &mut PushPull, nl: u32, f: &mut dyn FnMut(&mut [f32], &[f32])) {
    let (mut params, mut grads) = (Vec::new(), Vec::new());
    for l in 0..nl {
        let b = p.held(l).unwrap();
        params.extend_from_slice(b.params());
        grads.extend_from_slice(b.grad());
    }
    f(&mut grads, &params);
    let mut at = 0;
    for l in 0..nl {
        let b = p.held(l).unwrap();
        let n = b.grad().len();
        b.grad_mut().copy_from_slice(&grads[at..at + n]);
        at += n;
    }
}

/// A rank's steps (learner `g`), then its shutdown.
fn run_rank(job: &Job, g: usize, pp: PushPull) -> Result<Vec<Vec<f32>>, Error> {
    let nl = job.sizes.len() as u32;
    let pp = std::cell::RefCell::new(pp);
    let r = steps(
        job,
        g,
        |l| pp.borrow_mut().push(l),
        || pp.borrow_mut().pull_all(),
        |f| rank_access(&mut pp.borrow_mut(), nl, f),
    )?;
    pp.into_inner().shutdown()?;
    Ok(r)
}

/// The local job: per learner (global index), its parameters after each step.
fn local_job(job: &Job) -> Vec<Vec<Vec<f32>>> {
    let master = free_master();
    let total: usize = job.sizes.iter().sum();
    let nonce = mix(job.seed) | 1;
    let path = |node: usize| -> PathBuf {
        std::env::temp_dir().join(format!("tw-local-pp-{}-{}-{node}", std::process::id(), job.seed))
    };
    let sched = SchedConfig {
        learners: job.learners as u32,
        ..SchedConfig::default()
    };
    std::thread::scope(|s| {
        let mut hs = Vec::new();
        for node in 0..job.nodes {
            for j in 0..job.learners {
                let g = node * job.learners + j;
                let job = job.clone();
                hs.push(s.spawn(move || -> Result<Vec<Vec<f32>>, Error> {
                    let timeout = Duration::from_secs(30);
                    if j == 0 {
                        let mut pp = PushPull::build(
                            builder(&job, sched),
                            ClusterSpec::new(node as u32, job.nodes, 0, true, master)?,
                            HostType::F32,
                            mem(total),
                            mem(total),
                        )?;
                        let layout = LearnerPushPull::layout(job.learners, &job.sizes);
                        pp.lead(LocalGroup::create(&path(node), nonce, &layout, timeout)?)?;
                        run_rank(&job, g, pp)
                    } else {
                        let pp = LearnerPushPull::attach(
                            &path(node),
                            nonce,
                            job.learners,
                            j,
                            &job.sizes,
                            HostType::F32,
                            mem(total),
                            mem(total),
                            timeout,
                            0,
                        )?;
                        let pp = std::cell::RefCell::new(pp);
                        steps(
                            &job,
                            g,
                            |l| pp.borrow_mut().push(l),
                            || pp.borrow_mut().pull_all(),
                            |f| {
                                let mut p = pp.borrow_mut();
                                let (params, grads) = p.memory();
                                let params = f32s(params);
                                let mut gv = f32s(grads);
                                f(&mut gv, &params);
                                for (d, v) in grads.chunks_exact_mut(4).zip(&gv) {
                                    d.copy_from_slice(&v.to_le_bytes());
                                }
                            },
                        )
                    }
                }));
            }
        }
        hs.into_iter()
            .map(|h| h.join().unwrap().unwrap_or_else(|e| panic!("seed {}: {e}", job.seed)))
            .collect()
    })
}

/// The flat job: every learner a rank, the servers folding groups of L.
fn flat_job(job: &Job) -> Vec<Vec<Vec<f32>>> {
    let master = free_master();
    let total: usize = job.sizes.iter().sum();
    let p1 = job.nodes * job.learners;
    let sched = SchedConfig {
        fold_group: job.learners as u32,
        ..SchedConfig::default()
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..p1)
            .map(|g| {
                let job = job.clone();
                s.spawn(move || -> Result<Vec<Vec<f32>>, Error> {
                    let pp = PushPull::build(
                        builder(&job, sched),
                        ClusterSpec::new(g as u32, p1, 0, true, master)?,
                        HostType::F32,
                        mem(total),
                        mem(total),
                    )?;
                    run_rank(&job, g, pp)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap().unwrap_or_else(|e| panic!("seed {}: {e}", job.seed)))
            .collect()
    })
}

/// The expected parameters after step `t`: each node's learners in order,
/// then the nodes in order, divided by every learner (the mean).
fn expected(job: &Job, t: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for (l, &n) in job.sizes.iter().enumerate() {
        for i in 0..n {
            let mut acc = 0f32;
            for node in 0..job.nodes {
                let mut part = grad(job.seed, node * job.learners, t, l, i);
                for j in 1..job.learners {
                    part += grad(job.seed, node * job.learners + j, t, l, i);
                }
                acc = if node == 0 { part } else { acc + part };
            }
            out.push(acc * (1.0 / (job.nodes * job.learners) as f32));
        }
    }
    out
}

#[test]
fn leaders_with_learners_equal_the_flat_job_bitwise() {
    let base = std::env::var("TIDEWIRE_LOCAL_PP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::process::id() as u64);
    let jobs: u64 = std::env::var("TIDEWIRE_LOCAL_PP_JOBS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    println!("local push/pull: seed {base} (TIDEWIRE_LOCAL_PP_SEED), {jobs} jobs");
    for k in 0..jobs {
        let seed = base + k;
        let mut s = mix(seed);
        let mut next = || {
            s = mix(s);
            s
        };
        let job = Job {
            seed,
            sizes: (0..1 + next() % 4).map(|_| 1 + (next() % 300) as usize).collect(),
            nodes: 1 + (next() % 3) as usize,
            learners: 2 + (next() % 3) as usize,
            steps: 1 + (next() % 3) as usize,
        };
        println!("job {k}: {job:?}");
        let local = local_job(&job);
        let flat = flat_job(&job);
        for (g, (a, b)) in local.iter().zip(&flat).enumerate() {
            for t in 0..job.steps {
                let want = expected(&job, t);
                for (what, got) in [("local learner", &a[t]), ("flat rank", &b[t])] {
                    assert_eq!(got.len(), want.len());
                    if let Some(i) = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                        panic!(
                            "seed {seed}: {what} {g} step {t}: element {i} is {} (bits {:#x}), the sum in node order is {} ({:#x})",
                            got[i],
                            got[i].to_bits(),
                            want[i],
                            want[i].to_bits()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_learner_whose_leader_never_comes_times_out_and_misuse_is_typed() {
    let p = std::env::temp_dir().join(format!("tw-local-pp-none-{}", std::process::id()));
    let e = LearnerPushPull::attach(
        &p,
        1,
        2,
        1,
        &[4],
        HostType::F32,
        mem(4),
        mem(4),
        Duration::from_millis(100),
        0,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    let e = LearnerPushPull::attach(
        &p,
        1,
        2,
        1,
        &[4],
        HostType::F32,
        mem(3),
        mem(4),
        Duration::from_millis(100),
        0,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Layout(_)), "{e}");
}
