//! A small MLP in plain Rust, trained data-parallel by several processes
//! through Tidewire, and once more by a single process. The loss curves are
//! compared bit for bit.
//!
//! ```text
//! cargo run --release --example mlp -- --procs 3 --steps 40
//! ```
//!
//! The model is y = W2·relu(W1·x + b1) + b2 on a synthetic regression set of
//! 96 samples. Each of the P processes takes a contiguous shard of the batch.
//! Backward hands the FC layers in by their sufficient factors (U = output
//! gradients, V = inputs), the way Poseidon does, and the biases as plain
//! gradients. The single-process run computes the same per-shard gradients and
//! sums them in rank order, which is the arithmetic the cluster does, so the
//! curves must agree exactly. The plain full-batch curve is printed beside them
//! (equal up to float reassociation).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use tidewire::engine::book::{LayerKind, LayerSpec};
use tidewire::gpu::cpu::{self, ApplyOp};
use tidewire::Builder;

const SAMPLES: usize = 96;
const IN: usize = 8;
const HID: usize = 16;
const LR: f32 = 0.05;

fn data() -> (Vec<[f32; IN]>, Vec<f32>) {
    let mut xs = Vec::new();
    let mut ts = Vec::new();
    for s in 0..SAMPLES {
        let x: [f32; IN] = std::array::from_fn(|i| (((s * 7 + i * 13) % 17) as f32 / 8.0) - 1.0);
        let t = x
            .iter()
            .enumerate()
            .map(|(i, v)| v * (i as f32 - 3.5) / 4.0)
            .sum::<f32>()
            .sin();
        xs.push(x);
        ts.push(t);
    }
    (xs, ts)
}

fn layers() -> Vec<LayerSpec> {
    vec![
        LayerSpec::new("fc1", LayerKind::Fc, HID, IN),
        LayerSpec::new("b1", LayerKind::Other, 1, HID),
        LayerSpec::new("fc2", LayerKind::Fc, 1, HID),
        LayerSpec::new("b2", LayerKind::Other, 1, 1),
    ]
}

fn init(layer: u32, p: &mut [f32]) {
    for (i, v) in p.iter_mut().enumerate() {
        *v = if layer % 2 == 1 {
            0.0
        } else {
            ((i * 37 + layer as usize * 11) % 23) as f32 / 23.0 - 0.5
        };
    }
}

struct Params {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

fn forward(p: &Params, x: &[f32; IN]) -> ([f32; HID], f32) {
    let h: [f32; HID] = std::array::from_fn(|j| {
        let z = p.b1[j] + (0..IN).map(|i| p.w1[j * IN + i] * x[i]).sum::<f32>();
        z.max(0.0)
    });
    let y = p.b2[0] + (0..HID).map(|j| p.w2[j] * h[j]).sum::<f32>();
    (h, y)
}

fn loss(p: &Params, xs: &[[f32; IN]], ts: &[f32]) -> f32 {
    xs.iter()
        .zip(ts)
        .map(|(x, t)| 0.5 * (forward(p, x).1 - t).powi(2))
        .sum::<f32>()
        / xs.len() as f32
}

/// Sufficient factors and bias gradients of one shard, scaled by 1/K.
struct ShardGrad {
    u1: Vec<f32>,
    v1: Vec<f32>,
    gb1: Vec<f32>,
    u2: Vec<f32>,
    v2: Vec<f32>,
    gb2: Vec<f32>,
}

fn backward(p: &Params, xs: &[[f32; IN]], ts: &[f32]) -> ShardGrad {
    let k = xs.len();
    let s = 1.0 / k as f32;
    let mut g = ShardGrad {
        u1: vec![0.0; k * HID],
        v1: vec![0.0; k * IN],
        gb1: vec![0.0; HID],
        u2: vec![0.0; k],
        v2: vec![0.0; k * HID],
        gb2: vec![0.0; 1],
    };
    for (n, (x, t)) in xs.iter().zip(ts).enumerate() {
        let (h, y) = forward(p, x);
        let dy = (y - t) * s;
        g.u2[n] = dy;
        g.v2[n * HID..(n + 1) * HID].copy_from_slice(&h);
        g.gb2[0] += dy;
        for (j, &hj) in h.iter().enumerate() {
            let dh = if hj > 0.0 { p.w2[j] * dy } else { 0.0 };
            g.u1[n * HID + j] = dh;
            g.gb1[j] += dh;
        }
        g.v1[n * IN..(n + 1) * IN].copy_from_slice(x);
    }
    g
}

fn op() -> ApplyOp {
    ApplyOp::Sgd {
        lr: LR,
        momentum: 0.0,
        weight_decay: 0.0,
    }
}

fn shard(procs: usize, rank: usize) -> std::ops::Range<usize> {
    let k = SAMPLES / procs;
    rank * k..(rank + 1) * k
}

/// One rank of the cluster: prints `loss <step> <bits>` after every step.
fn rank_main(procs: usize, steps: usize) -> tidewire::Result<()> {
    let (xs, ts) = data();
    let k = SAMPLES / procs;
    let mut session = Builder::new(layers())
        .batch(k)
        .apply(op())
        .timeout(Duration::from_secs(30))
        .init_params(init)
        .build_from_env()?;
    let rank = session.rank() as usize;
    let my = shard(procs, rank);
    let mut l = session.take_layers()?;
    for step in 0..steps {
        let params = Params {
            w1: l[0].as_ref().expect("held").params().to_vec(),
            b1: l[1].as_ref().expect("held").params().to_vec(),
            w2: l[2].as_ref().expect("held").params().to_vec(),
            b2: l[3].as_ref().expect("held").params().to_vec(),
        };
        let g = backward(&params, &xs[my.clone()], &ts[my.clone()]);
        // Backward order: fc2's factors and b2 first, then fc1 and b1.
        let mut b = l[3].take().expect("held");
        b.grad_mut().copy_from_slice(&g.gb2);
        session.grad_ready(b)?;
        let mut b = l[2].take().expect("held");
        b.u_mut().copy_from_slice(&g.u2);
        b.v_mut().copy_from_slice(&g.v2);
        session.sf_ready(b)?;
        let mut b = l[1].take().expect("held");
        b.grad_mut().copy_from_slice(&g.gb1);
        session.grad_ready(b)?;
        let mut b = l[0].take().expect("held");
        b.u_mut().copy_from_slice(&g.u1);
        b.v_mut().copy_from_slice(&g.v1);
        session.sf_ready(b)?;
        for (i, slot) in l.iter_mut().enumerate() {
            *slot = Some(session.wait_layer(i as u32)?);
        }
        let p = Params {
            w1: l[0].as_ref().expect("held").params().to_vec(),
            b1: l[1].as_ref().expect("held").params().to_vec(),
            w2: l[2].as_ref().expect("held").params().to_vec(),
            b2: l[3].as_ref().expect("held").params().to_vec(),
        };
        println!("loss {step} {:08x}", loss(&p, &xs, &ts).to_bits());
    }
    drop(l);
    session.shutdown()
}

/// One process: the same shards, summed in rank order (`exact`), or the whole
/// batch at once.
fn single(procs: usize, steps: usize, exact: bool) -> Vec<f32> {
    let (xs, ts) = data();
    let mut p = Params {
        w1: vec![0.0; HID * IN],
        b1: vec![0.0; HID],
        w2: vec![0.0; HID],
        b2: vec![0.0; 1],
    };
    init(0, &mut p.w1);
    init(1, &mut p.b1);
    init(2, &mut p.w2);
    init(3, &mut p.b2);
    let parts = if exact { procs } else { 1 };
    let mut curve = Vec::new();
    for _ in 0..steps {
        let mut acc: Option<[Vec<f32>; 4]> = None;
        for r in 0..parts {
            let s = shard(parts, r);
            let k = s.len();
            let g = backward(&p, &xs[s.clone()], &ts[s]);
            let mut w1 = vec![0.0; HID * IN];
            cpu::sf_rows(&g.u1, &g.v1, k, HID, IN, 0, &mut w1);
            let mut w2 = vec![0.0; HID];
            cpu::sf_rows(&g.u2, &g.v2, k, 1, HID, 0, &mut w2);
            let grads = [w1, g.gb1, w2, g.gb2];
            acc = Some(match acc {
                None => grads,
                Some(mut a) => {
                    for (a, g) in a.iter_mut().zip(&grads) {
                        cpu::add_assign(a, g);
                    }
                    a
                }
            });
        }
        let a = acc.expect("at least one shard");
        let n = if exact { procs } else { 1 };
        for (w, g) in [&mut p.w1, &mut p.b1, &mut p.w2, &mut p.b2].into_iter().zip(&a) {
            cpu::apply(op(), n, g, w, &mut []);
        }
        curve.push(loss(&p, &xs, &ts));
    }
    curve
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |f: &str, d: usize| {
        args.iter()
            .position(|a| a == f)
            .and_then(|i| args.get(i + 1))
            .map_or(d, |v| v.parse().unwrap_or_else(|_| panic!("{f} takes a number")))
    };
    let (procs, steps) = (get("--procs", 3), get("--steps", 40));
    if SAMPLES % procs != 0 || procs == 0 {
        eprintln!("--procs must divide {SAMPLES}");
        std::process::exit(2);
    }
    if std::env::var("TIDEWIRE_RANK").is_ok() {
        if let Err(e) = rank_main(procs, steps) {
            eprintln!("mlp rank: {e}");
            std::process::exit(1);
        }
        return;
    }
    // Launcher: P processes on loopback, every node a worker and a server.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..procs)
        .map(|r| {
            Command::new(&exe)
                .args(["--procs", &procs.to_string(), "--steps", &steps.to_string()])
                .env("TIDEWIRE_RANK", r.to_string())
                .env("TIDEWIRE_WORLD_SIZE", procs.to_string())
                .env("TIDEWIRE_MASTER", format!("127.0.0.1:{port}"))
                .env("TIDEWIRE_SECRET", "mlp-example")
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    let mut curves = Vec::new();
    for mut c in children {
        let out = BufReader::new(c.stdout.take().unwrap());
        let curve: Vec<f32> = out
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| {
                let hex = l.strip_prefix("loss ")?.split(' ').nth(1)?.to_string();
                Some(f32::from_bits(u32::from_str_radix(&hex, 16).ok()?))
            })
            .collect();
        let st = c.wait().unwrap();
        if !st.success() {
            eprintln!("a rank failed: {st}");
            std::process::exit(1);
        }
        curves.push(curve);
    }
    let exact = single(procs, steps, true);
    let full = single(procs, steps, false);
    println!(
        "{:>5} {:>14} {:>14} {:>14}",
        "step", "cluster", "one process", "full batch"
    );
    for s in (0..steps).step_by((steps / 10).max(1)).chain([steps - 1]) {
        println!("{s:>5} {:>14.8} {:>14.8} {:>14.8}", curves[0][s], exact[s], full[s]);
    }
    let same = curves
        .iter()
        .all(|c| c.len() == steps && c.iter().zip(&exact).all(|(a, b)| a.to_bits() == b.to_bits()));
    let close = exact
        .iter()
        .zip(&full)
        .all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1e-3));
    println!(
        "{procs} processes: loss {:.6} -> {:.6}; equal to one process bit for bit: {same}; within 1e-5 of the full-batch curve: {close}",
        exact[0],
        exact[steps - 1]
    );
    if !same || !close || exact[steps - 1] >= exact[0] {
        std::process::exit(1);
    }
}
