//! Seeded randomness for tests, here and in the crates above (not part of the
//! engine's API): a splitmix64 step, and a seed that comes from an environment
//! variable when set (to replay a failure) and from the clock otherwise, and is
//! printed either way; and [`Rng`], that step as a generator with the draws the
//! tests make (the one seeded generator of the workspace's tests, the simulator's
//! and the VOPR's included: a seed replays the same sequence everywhere).

/// One splitmix64 step of `s`.
pub fn next(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// splitmix64 of `z` alone: a hash of one value (`next` of a copy of `z`).
pub fn mix(z: u64) -> u64 {
    let mut s = z;
    next(&mut s)
}

/// A seeded splitmix64 generator: `Rng(seed)` draws [`next`]'s sequence from `seed`.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        next(&mut self.0)
    }
    /// In `0..n` (by `%`; 0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// In `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        debug_assert!(lo <= hi && hi - lo < u64::MAX, "{lo}..={hi}");
        lo + self.below(hi - lo + 1)
    }
    /// In `[0, 1)`, from the top 53 bits.
    pub fn unit(&mut self) -> f64 {
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        debug_assert!((0.0..1.0).contains(&u));
        u
    }
    /// True with probability `p` (`unit() <= p`).
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() <= p
    }
    /// One of `xs`, uniformly.
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        debug_assert!(!xs.is_empty(), "a pick from nothing");
        xs[self.below(xs.len() as u64) as usize]
    }
}

/// The seed in `var` (a u64), else one from the clock; printed with how to replay it.
pub fn seed(var: &str) -> u64 {
    let seed = match std::env::var(var) {
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("{var} is a u64")),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    };
    println!("seed {seed} (replay with {var}={seed})");
    seed
}
