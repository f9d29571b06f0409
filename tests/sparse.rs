//! Nexus's sparse push through real sessions (threads over loopback TCP): the
//! same job pushed dense and pushed sparse ends with bitwise the same
//! parameters on every rank, and a rank that disagrees on the hint is refused
//! at rendezvous. Replay a seed with `TIDEWIRE_SPARSE_SEED=<seed>`.

use std::net::SocketAddr;
use std::time::Duration;

use tidewire::cluster::ClusterSpec;
use tidewire::engine::book::{LayerKind, LayerSpec};
use tidewire::engine::testkit;
use tidewire::engine::EngineError;
use tidewire::gpu::cpu::ApplyOp;
use tidewire::transport::JobSecret;
use tidewire::{Builder, Error, SessionStats};

const RANKS: usize = 3;
const ITERS: u64 = 3;

fn layers(hint: bool) -> Vec<LayerSpec> {
    vec![
        LayerSpec::new("emb", LayerKind::Other, 1500, 8).sparse(hint),
        LayerSpec::new("conv", LayerKind::Conv, 8, 27),
    ]
}

fn master() -> SocketAddr {
    let port = tidewire::rendezvous::free_port(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    format!("127.0.0.1:{port}").parse().unwrap()
}

fn builder(hint: bool, gbps: f64) -> Builder {
    Builder::new(layers(hint))
        .batch(2)
        .chunk_bytes(8 << 10)
        .slice_params(700)
        .job(11, JobSecret::new(b"sparse-test".to_vec()))
        // Parameters = the sum, so a signed zero of the sum shows in them.
        .apply(ApplyOp::Sum)
        .init_params(|l, p| {
            p.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = (i as f32 + l as f32) * 0.01)
        })
        .timeout(Duration::from_secs(30))
        .connect_timeout(Duration::from_secs(30))
        .link_gbps(gbps)
}

/// Gradient element `i` of rank `r`'s layer `l` in `iter`: with probability
/// `density` a non-integer value (sums depend on their order) or `-0.0`,
/// else `+0.0`.
fn grad(seed: u64, r: usize, iter: u64, l: u32, i: usize, density: f64) -> f32 {
    let mut h = seed ^ ((r as u64) << 56) ^ (iter << 40) ^ (u64::from(l) << 32) ^ i as u64;
    let x = testkit::next(&mut h);
    if l == 0 && (x >> 11) as f64 / (1u64 << 53) as f64 >= density {
        return 0.0;
    }
    match x % 3 {
        0 => -0.0,
        _ => ((x >> 20) % 100_000) as f32 / 3e4 - 1.5,
    }
}

/// Runs the job; every rank's final parameters (bits, layer by layer) and stats.
fn job(seed: u64, density: f64, hint: bool, gbps: f64) -> Vec<(Vec<Vec<u32>>, SessionStats)> {
    let m = master();
    let hs: Vec<_> = (0..RANKS)
        .map(|r| {
            std::thread::spawn(move || {
                let mut s = builder(hint, gbps)
                    .build(ClusterSpec::new(r as u32, RANKS, 0, true, m).unwrap())
                    .unwrap();
                let mut bufs: Vec<_> = s.take_layers().unwrap().into_iter().map(Option::unwrap).collect();
                for iter in 0..ITERS {
                    for (l, mut b) in bufs.drain(..).enumerate().rev() {
                        b.grad_mut()
                            .iter_mut()
                            .enumerate()
                            .for_each(|(i, g)| *g = grad(seed, r, iter, l as u32, i, density));
                        s.grad_ready(b).unwrap();
                    }
                    bufs = (0..2).map(|l| s.wait_layer(l).unwrap()).collect();
                }
                let bits = bufs
                    .iter()
                    .map(|b| b.params().iter().map(|v| v.to_bits()).collect())
                    .collect();
                let stats = s.stats().unwrap();
                drop(bufs);
                s.shutdown().unwrap();
                (bits, stats)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Bitwise equality, naming the first difference.
fn same(a: &[Vec<u32>], b: &[Vec<u32>], what: &str) {
    for (l, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "{what}: layer {l}");
        if let Some(i) = (0..x.len()).find(|&i| x[i] != y[i]) {
            panic!("{what}: layer {l} element {i}: {:#010x} != {:#010x}", x[i], y[i]);
        }
    }
    assert_eq!(a.len(), b.len(), "{what}");
}

#[test]
fn sparse_and_dense_sessions_end_bitwise_equal() {
    let seed = testkit::seed("TIDEWIRE_SPARSE_SEED");
    for density in [0.0, 0.001, 0.05, 0.3, 1.0] {
        // The dense job: no sparse hint (a fast link is not enough: with the
        // link free, a dense push still costs the server a copy, which this
        // machine's calibration can find dearer than scanning a slice that is
        // almost all zeros). The sparse one: a link so slow that everything
        // that fits a slot goes as pairs.
        let dense = job(seed, density, false, 1e9);
        let sparse = job(seed, density, true, 1e-9);
        for r in 0..RANKS {
            same(
                &dense[r].0,
                &dense[0].0,
                &format!("seed {seed} density {density}: rank {r} and 0 (dense)"),
            );
            same(
                &sparse[r].0,
                &dense[r].0,
                &format!("seed {seed} density {density}: rank {r} sparse, dense"),
            );
            assert_eq!(dense[r].1.sparse_pushes, 0, "seed {seed} density {density}");
        }
        let pushed: u64 = sparse.iter().map(|x| x.1.sparse_pushes).sum();
        let fell_back: u64 = sparse.iter().map(|x| x.1.sparse_dense_pushes).sum();
        if density <= 0.05 {
            assert!(
                pushed > 0 && fell_back == 0,
                "seed {seed} density {density}: {pushed} sparse, {fell_back} dense"
            );
            let (nz, el): (u64, u64) = sparse
                .iter()
                .fold((0, 0), |a, x| (a.0 + x.1.sparse_nonzeros, a.1 + x.1.sparse_elements));
            assert!(
                el > 0 && (nz as f64 / el as f64) <= density * 2.0 + 0.01,
                "seed {seed}: {nz}/{el}"
            );
        }
        if density == 1.0 {
            assert!(
                pushed == 0 && fell_back > 0,
                "seed {seed}: {pushed} sparse at density 1"
            );
        }
    }
}

#[test]
fn ranks_that_disagree_on_the_sparse_hint_fail_at_rendezvous() {
    let m = master();
    let h = std::thread::spawn(move || {
        builder(false, 10.0)
            .build(ClusterSpec::new(1, 2, 0, true, m).unwrap())
            .map(|_| ())
    });
    let r0 = builder(true, 10.0)
        .build(ClusterSpec::new(0, 2, 0, true, m).unwrap())
        .map(|_| ());
    for r in [r0, h.join().unwrap()] {
        match r {
            Err(Error::Engine(EngineError::Disagree {
                field: "layer table", ..
            })) => {}
            other => panic!("want a disagreement on the layer table, got {other:?}"),
        }
    }
}
