//! The sparse push's encoding (tidewire_engine::sparse), which a server reads
//! from memory a peer wrote: header, then index/value pairs.
//!
//! Input: the slice length (u16 LE, at least 1), the pair count the write's
//! length announces (u8), then the words (u32 LE). Invariants: `densify`
//! (the reference) and `tidewire_gpu::cpu::sparse_densify` on 1 and 3
//! threads never panic and agree (both accept, with the same bits, or both
//! refuse); what is accepted has its indices in range and increasing, and
//! re-encodes to the same words when no pair holds `+0.0`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidewire::gpu::cpu::sparse_densify_on;
use tidewire_engine::sparse::{densify, encode};

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let len = usize::from(u16::from_le_bytes([data[0], data[1]])).max(1);
    let pairs = usize::from(data[2]);
    let words: Vec<u32> = data[3..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut a = vec![1.0f32; len];
    let ra = densify(&words, pairs, &mut a);
    for t in [1, 3] {
        let mut b = vec![2.0f32; len];
        let rb = sparse_densify_on(&words, pairs, &mut b, t);
        assert_eq!(ra.is_ok(), rb.is_ok(), "threads {t}: {ra:?} vs {rb:?}");
        if ra.is_ok() {
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
    if ra.is_ok() {
        let idx: Vec<u32> = words[2..].chunks(2).map(|p| p[0]).collect();
        assert!(idx.windows(2).all(|w| w[0] < w[1]) && idx.iter().all(|&i| (i as usize) < len));
        if words[2..].chunks(2).all(|p| p[1] != 0) {
            let mut enc = Vec::new();
            let n = encode(&a, usize::MAX, &mut enc);
            if n.is_some() {
                let back: Vec<u32> = enc
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                assert_eq!(back, words);
            }
        }
    }
});
