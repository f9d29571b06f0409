//! The synthetic data a values run moves: gradients, factors and initial
//! parameters chosen so that every sum is exact in f32, and a lost or doubled
//! contribution changes it.

/// Gradient element `i` of `layer` from worker index `w` in iteration `t`:
/// small integers plus a worker-specific quarter, so every sum is exact in f32
/// and a lost or doubled contribution changes it.
pub fn grad_value(w: usize, t: u64, layer: u32, i: usize) -> f32 {
    ((w * 7 + t as usize * 3 + layer as usize * 5 + i) % 5) as f32 + 0.25 * (w as f32 + 1.0)
}

/// Gradient element `i` of a layer with the sparse hint: with probability
/// `density` (by a hash of the arguments) [`grad_value`], its negation, or
/// `-0.0` (a nonzero by its bits), and `+0.0` otherwise. Sums stay exact.
pub fn sparse_grad_value(w: usize, t: u64, layer: u32, i: usize, density: f64) -> f32 {
    let mut h = ((w as u64) << 48) ^ (t << 32) ^ (u64::from(layer) << 24) ^ i as u64;
    let x = tidewire_engine::testkit::next(&mut h);
    if (x >> 11) as f64 / (1u64 << 53) as f64 >= density {
        return 0.0;
    }
    match x % 5 {
        0 => -0.0,
        1 => -grad_value(w, t, layer, i),
        _ => grad_value(w, t, layer, i),
    }
}

/// Initial value of element `i` of `layer`.
pub fn init_value(layer: u32, i: usize) -> f32 {
    ((layer as usize + i) % 3) as f32
}

/// Factor element: small integers.
pub fn factor_value(w: usize, t: u64, which: u32, i: usize) -> f32 {
    ((w + t as usize + which as usize * 2 + i) % 3) as f32
}
