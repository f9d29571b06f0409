//! The embedding API's contract: typed errors for bad use, never a panic.

use std::net::SocketAddr;
use std::time::Duration;

use tidewire::cluster::ClusterSpec;
use tidewire::engine::book::{LayerKind, LayerSpec};
use tidewire::engine::{EngineError, Scheme, SchemePolicy};
use tidewire::gpu::cpu::ApplyOp;
use tidewire::session::BufferLayout;
use tidewire::transport::{JobSecret, PinOptions, PinnedBuffer};
use tidewire::{Builder, Error};

fn layers() -> Vec<LayerSpec> {
    vec![
        LayerSpec::new("conv", LayerKind::Conv, 4, 9),
        LayerSpec::new("fc", LayerKind::Fc, 3, 4),
    ]
}

fn solo() -> ClusterSpec {
    ClusterSpec::new(0, 1, 0, true, "127.0.0.1:1".parse().unwrap()).unwrap()
}

fn builder(l: Vec<LayerSpec>) -> Builder {
    Builder::new(l)
        .batch(2)
        .job(7, JobSecret::new(b"api-test".to_vec()))
        .apply(ApplyOp::Sum)
        .timeout(Duration::from_secs(10))
}

fn buf(bytes: usize) -> PinnedBuffer {
    PinnedBuffer::with_options(
        bytes,
        PinOptions {
            lock: false,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn one_rank_round_trip_sums_in_place() {
    // One colocated node moves nothing under either scheme, so HybComm keeps the
    // PS; force SFB for the FC layer to exercise sufficient factors.
    let mut s = builder(layers())
        .policy(SchemePolicy::Sfb)
        .init_params(|l, p| p.fill(l as f32))
        .build(solo())
        .unwrap();
    assert_eq!(s.scheme(0).unwrap(), Scheme::Ps);
    assert_eq!(s.scheme(1).unwrap(), Scheme::Sfb);
    let mut l = s.take_layers().unwrap();
    assert_eq!(l[1].as_ref().unwrap().params(), &[1.0; 12], "initial values");
    let mut conv = l[0].take().unwrap();
    conv.grad_mut().iter_mut().enumerate().for_each(|(i, g)| *g = i as f32);
    s.grad_ready(conv).unwrap();
    let mut fc = l[1].take().unwrap();
    fc.u_mut().copy_from_slice(&[1.0, 0.0, 0.0, 0.0, 1.0, 0.0]); // K=2 × M=3
    fc.v_mut().copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 1.0]); // K=2 × N=4
    s.sf_ready(fc).unwrap();
    let conv = s.wait_layer(0).unwrap();
    assert_eq!(conv.params(), (0..36).map(|i| i as f32).collect::<Vec<_>>().as_slice());
    let fc = s.wait_layer(1).unwrap();
    // Uᵀ·V: row 0 = V row 0, row 1 = V row 1, row 2 = 0.
    assert_eq!(
        fc.params(),
        &[1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    );
    assert!(fc.synced_at().is_some());
    drop((conv, fc));
    s.shutdown().unwrap();
}

#[test]
fn misuse_gives_typed_errors() {
    let mut s = builder(layers()).policy(SchemePolicy::Sfb).build(solo()).unwrap();
    let mut l = s.take_layers().unwrap();
    assert!(matches!(s.take_layers(), Err(Error::Layout(_))), "take_layers twice");
    // An FC layer that syncs by SFB needs factors.
    let fc = l[1].take().unwrap();
    assert!(matches!(
        s.grad_ready(fc),
        Err(Error::Engine(EngineError::NeedsFactors { layer: 1, .. }))
    ));
    // A conv layer has no factors.
    let conv = l[0].take().unwrap();
    assert!(matches!(
        s.sf_ready(conv),
        Err(Error::Engine(EngineError::NotFullyConnected { layer: 0, .. }))
    ));
    // Waiting for a layer the caller holds (the buffers above were dropped with the errors, so
    // the engine still considers them the caller's).
    assert!(matches!(s.wait_layer(0), Err(Error::NotHandedIn { layer: 0 })));
    assert!(matches!(
        s.wait_layer(9),
        Err(Error::Engine(EngineError::UnknownLayer { layer: 9, .. }))
    ));
    s.shutdown().unwrap();
    assert!(matches!(s.wait_all(), Err(Error::Shutdown)), "calls after shutdown");
    // The counters stay readable: as the runtime left them (a server-only
    // rank's whole job happens inside shutdown).
    let st = s.stats().expect("the counters after shutdown");
    assert_eq!(st.pushes, 0, "nothing was pushed: every hand-in above was refused");
    assert!(matches!(s.shutdown(), Err(Error::Shutdown)));
}

#[test]
fn grad_ready_twice_in_an_iteration_is_refused_by_the_core() {
    use std::sync::Arc;
    use tidewire::engine::{Book, BookConfig, Cluster, SchedConfig, Worker};
    let book = Arc::new(Book::new(Cluster::split(1, 1).unwrap(), layers(), BookConfig::default()).unwrap());
    let mut w = Worker::new(book, 0, SchedConfig::default()).unwrap();
    w.grad_ready(0).unwrap();
    assert!(matches!(w.grad_ready(0), Err(EngineError::LayerBusy { layer: 0, .. })));
}

#[test]
fn bad_buffers_are_refused_before_anything_starts() {
    // Overlapping layers.
    let e = builder(layers())
        .grads_buffer(BufferLayout {
            buffer: buf(4096),
            offsets: vec![0, 64],
        })
        .build(solo())
        .unwrap_err();
    assert!(matches!(&e, Error::Layout(m) if m.contains("overlap")), "{e}");
    // Too small for a layer.
    let e = builder(layers())
        .grads_buffer(BufferLayout {
            buffer: buf(4096),
            offsets: vec![0, 4088],
        })
        .build(solo())
        .unwrap_err();
    assert!(
        matches!(e, Error::Engine(EngineError::WrongSize { layer: 1, .. })),
        "{e}"
    );
    // Wrong number of offsets.
    let e = builder(layers())
        .params_buffer(BufferLayout {
            buffer: buf(4096),
            offsets: vec![0],
        })
        .build(solo())
        .unwrap_err();
    assert!(matches!(e, Error::Layout(_)), "{e}");
    // Parameters must be back to back.
    let e = builder(layers())
        .params_buffer(BufferLayout {
            buffer: buf(4096),
            offsets: vec![0, 512],
        })
        .build(solo())
        .unwrap_err();
    assert!(matches!(&e, Error::Layout(m) if m.contains("back to back")), "{e}");
    // ... and in layer order: a later layer before the first is refused, not a panic.
    let e = builder(layers())
        .params_buffer(BufferLayout {
            buffer: buf(4096),
            offsets: vec![256, 0],
        })
        .build(solo())
        .unwrap_err();
    assert!(matches!(&e, Error::Layout(m) if m.contains("back to back")), "{e}");
}

#[test]
fn caller_owned_buffers_are_used_in_place() {
    let s = builder(layers())
        .grads_buffer(BufferLayout {
            buffer: buf(8192),
            offsets: vec![4096, 0],
        })
        .params_buffer(BufferLayout {
            buffer: buf(8192),
            offsets: vec![256, 256 + 36 * 4],
        })
        .init_params(|_, p| p.fill(2.0))
        .build(solo());
    let mut s = s.unwrap();
    let mut l = s.take_layers().unwrap();
    let mut conv = l[0].take().unwrap();
    conv.grad_mut().fill(3.0);
    s.grad_ready(conv).unwrap();
    assert_eq!(s.wait_layer(0).unwrap().params(), &[3.0; 36]);
    s.shutdown().unwrap();
}

/// Starts two ranks that differ as `tweak` says; both must fail naming `field` and rank 1.
fn disagreement(field: &str, theirs: Vec<LayerSpec>, tweak: impl FnOnce(Builder) -> Builder + Send + 'static) {
    let port = tidewire::rendezvous::free_port(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    let master: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let h = std::thread::spawn(move || {
        tweak(builder(theirs))
            .connect_timeout(Duration::from_secs(10))
            .build(ClusterSpec::new(1, 2, 0, true, master).unwrap())
            .map(|_| ())
    });
    let r0 = builder(layers())
        .connect_timeout(Duration::from_secs(10))
        .build(ClusterSpec::new(0, 2, 0, true, master).unwrap())
        .map(|_| ());
    let r1 = h.join().unwrap();
    for r in [r0, r1] {
        match r {
            Err(Error::Engine(EngineError::Disagree { rank: 1, field: f, .. })) if f == field => {}
            other => panic!("want a disagreement on {field} naming rank 1, got {other:?}"),
        }
    }
}

#[test]
fn ranks_with_different_layer_tables_fail_at_rendezvous() {
    let mut other = layers();
    other[1].n = 5;
    disagreement("layer table", other, |b| b);
}

#[test]
fn ranks_with_different_slots_or_learning_rates_fail_at_rendezvous() {
    disagreement("slots", layers(), |b| {
        b.sched(tidewire::engine::SchedConfig {
            slots: 3,
            ..Default::default()
        })
    });
    disagreement("apply op", layers(), |b| {
        b.apply(ApplyOp::Sgd {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        })
    });
    disagreement("consistency", layers(), |b| {
        b.consistency(tidewire::engine::Consistency::Ssp(1))
    });
}

#[test]
fn ranks_with_a_different_communication_frequency_fail_at_rendezvous() {
    use tidewire::engine::freq::{CommConfig, CommMode, FreqConfig};
    disagreement("comm_every (steps per exchange)", layers(), |b| {
        b.comm(CommConfig {
            mode: CommMode::Accumulate,
            freq: FreqConfig::fixed(4),
        })
    });
    disagreement("comm_mode", layers(), |b| {
        b.comm(CommConfig {
            mode: CommMode::Average,
            freq: FreqConfig::fixed(1),
        })
    });
    let guided = FreqConfig {
        t_max: 8,
        period: 2,
        tolerance: 0.05,
        ..FreqConfig::fixed(1)
    };
    disagreement(
        "quality-guided frequency (t_max, period, tolerance, revert step)",
        layers(),
        move |b| {
            b.comm(CommConfig {
                mode: CommMode::Accumulate,
                freq: guided,
            })
        },
    );
}

#[test]
fn a_missing_peer_is_a_timeout_not_a_hang() {
    let port = tidewire::rendezvous::free_port(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    let e = builder(layers())
        .connect_timeout(Duration::from_millis(500))
        .build(ClusterSpec::new(0, 2, 0, true, format!("127.0.0.1:{port}").parse().unwrap()).unwrap())
        .unwrap_err();
    assert!(
        matches!(&e, Error::RendezvousTimeout { missing, refused, .. } if missing == &[1] && refused.is_empty()),
        "{e}"
    );
    assert!(e.is_timeout(), "{e}");
}

#[test]
fn rdma_is_refused_with_a_reason_in_this_build() {
    std::env::remove_var("TIDEWIRE_TRANSPORT");
    let e = builder(layers())
        .transport(tidewire::TransportKind::Rdma)
        .build(solo())
        .unwrap_err();
    assert!(matches!(e, Error::TransportUnavailable(_)), "{e}");
}

#[test]
#[should_panic(expected = "the tidewire runtime panicked: the runtime thread panicked: the caller's init panicked")]
fn a_panic_on_the_runtime_thread_reaches_the_caller_with_its_message() {
    // init_params runs on the runtime thread, during setup.
    let _ = builder(layers())
        .init_params(|_, _| panic!("the caller's init panicked"))
        .build(solo());
}
