//! Nexus's sparse push in the simulated cluster with real values: the same job
//! run dense, sparse and with the automatic choice ends with bitwise the same
//! parameters on every worker, at densities 0, tiny, around the threshold and
//! 1.0. Every failure names the seed; replay one with
//! `TIDEWIRE_SPARSE_SEED=<seed> cargo test -p tidewire-engine --test sparse`.

use std::sync::Arc;

use tidewire_engine::book::{LayerKind, LayerSpec};
use tidewire_engine::sim::{Sim, SimConfig, SimReport};
use tidewire_engine::sparse::SparseCosts;
use tidewire_engine::{Book, BookConfig, Cluster, Consistency, SyncMode};

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        tidewire_engine::testkit::next(&mut self.0) % n
    }
}

/// Costs under which sparse always pays (a slow link: the cap is the slot's).
fn always_sparse() -> SparseCosts {
    SparseCosts::default().with_link(1e3)
}

/// Costs under which sparse never pays (scanning costs more than sending).
fn never_sparse() -> SparseCosts {
    SparseCosts::default().with_link(1e15)
}

fn book(cluster: Cluster, mode: SyncMode, rng: &mut Rng) -> Arc<Book> {
    let layers = vec![
        LayerSpec::new("emb", LayerKind::Other, 40 + rng.below(60) as usize, 8).sparse(true),
        LayerSpec::new("conv", LayerKind::Conv, 8, 27),
        // A sparse FC layer goes through the PS whatever the scheme policy.
        LayerSpec::new("fc", LayerKind::Fc, 24, 20).sparse(true),
    ];
    let base = BookConfig {
        batch: 2,
        chunk_bytes: 4 * (64 + rng.below(512) as usize),
        slice_params: 20 + rng.below(200) as usize,
        ..Default::default()
    };
    Arc::new(Book::new(cluster, layers, mode.book_config(base)).expect("valid book"))
}

fn run(book: Arc<Book>, mode: SyncMode, seed: u64, density: f64, costs: SparseCosts, det: bool) -> SimReport {
    run_with(book, mode, seed, density, costs, det, Consistency::Bsp)
}

fn run_with(
    book: Arc<Book>,
    mode: SyncMode,
    seed: u64,
    density: f64,
    costs: SparseCosts,
    det: bool,
    consistency: Consistency,
) -> SimReport {
    let n = book.layers().len();
    let mut cfg = SimConfig::new(book, mode, vec![(20_000, 40_000); n], 3);
    cfg.values = true;
    cfg.seed = seed;
    cfg.bandwidth_bps = 1e9;
    cfg.sched.slots = 2;
    cfg.sched.credit_bytes = 2000;
    cfg.sched.deterministic = det;
    cfg.sched.consistency = consistency;
    cfg.sparse_density = density;
    cfg.sparse = costs;
    match Sim::run(cfg) {
        Ok(r) => r,
        Err(e) => panic!("seed {seed}, density {density}: {e}"),
    }
}

#[test]
fn sparse_and_dense_pushes_give_bitwise_the_same_parameters() {
    let seed = tidewire_engine::testkit::seed("TIDEWIRE_SPARSE_SEED");
    let mut rng = Rng(seed);
    for case in 0..10 {
        let cluster = if rng.below(2) == 0 {
            Cluster::colocated(2 + rng.below(3) as usize).expect("cluster")
        } else {
            Cluster::split(1 + rng.below(3) as usize, 1 + rng.below(3) as usize).expect("cluster")
        };
        let mode = [SyncMode::P3, SyncMode::Full, SyncMode::Wfbp][rng.below(3) as usize];
        let book = book(cluster, mode, &mut rng);
        // 0, tiny, around the default costs' threshold at 10 GbE, dense-ish, every element.
        let slice = book.slices()[0].len;
        let around = SparseCosts::default().threshold(slice);
        let density = [0.0, 0.002, around, 0.3, 1.0][case % 5];
        let sim_seed = seed.wrapping_add(case as u64);
        let dense = run(book.clone(), mode, sim_seed, density, never_sparse(), true);
        let sparse = run(book.clone(), mode, sim_seed, density, always_sparse(), true);
        let auto = run(book.clone(), mode, sim_seed, density, SparseCosts::default(), true);
        let what = format!(
            "seed {seed} case {case} ({:?}, {mode:?}, density {density})",
            book.cluster().roles()
        );
        assert!(!dense.params_bits.is_empty(), "{what}");
        assert_eq!(
            dense.params_bits, sparse.params_bits,
            "{what}: sparse differs from dense"
        );
        assert_eq!(dense.params_bits, auto.params_bits, "{what}: auto differs from dense");
        // Where pushes cross the network, the forced runs took the path they were given.
        let pushes = |r: &SimReport| r.sparse.iter().map(|s| s.sparse_pushes + s.dense_pushes).sum::<u64>();
        let sparse_pushes = |r: &SimReport| r.sparse.iter().map(|s| s.sparse_pushes).sum::<u64>();
        assert_eq!(sparse_pushes(&dense), 0, "{what}");
        if pushes(&sparse) > 0 && density < 0.05 {
            assert_eq!(
                sparse_pushes(&sparse),
                pushes(&sparse),
                "{what}: not every push went sparse"
            );
        }
        if density == 1.0 {
            // Over the slot's limit: every try falls back to dense.
            assert_eq!(sparse_pushes(&sparse), 0, "{what}");
        }
        for s in sparse.sparse.iter().filter(|s| s.sparse_pushes > 0) {
            assert!(
                (s.density() - density).abs() < 0.2 + density,
                "{what}: density {}",
                s.density()
            );
            assert!(s.sparse_bytes < s.sparse_pushes * 8 * 1000, "{what}");
        }
    }
}

#[test]
fn sparse_pushes_pass_the_value_checks_in_arrival_order_and_under_ssp() {
    let seed = tidewire_engine::testkit::seed("TIDEWIRE_SPARSE_SEED");
    let mut rng = Rng(seed);
    for case in 0..6 {
        let cluster = Cluster::colocated(2 + rng.below(3) as usize).expect("cluster");
        let mode = SyncMode::P3;
        let b = book(cluster, mode, &mut rng);
        let consistency = if case % 2 == 1 {
            Consistency::Ssp(1)
        } else {
            Consistency::Bsp
        };
        let density = [0.0, 0.01, 0.2][case % 3];
        let r = run_with(
            b,
            mode,
            seed ^ case as u64,
            density,
            always_sparse(),
            false,
            consistency,
        );
        assert!(r.checks > 0, "seed {seed} case {case}");
        assert!(
            r.sparse.iter().map(|s| s.sparse_pushes).sum::<u64>() > 0,
            "seed {seed} case {case}: no sparse push"
        );
    }
}
