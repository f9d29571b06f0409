//! Seeded randomness for tests, here and in the crates above (not part of the
//! engine's API): a splitmix64 step, and a seed that comes from an environment
//! variable when set (to replay a failure) and from the clock otherwise, and is
//! printed either way.

/// One splitmix64 step of `s`.
pub fn next(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
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
