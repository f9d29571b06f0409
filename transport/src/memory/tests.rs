//! Tests that span the memory types: foreign memory registered and leased in
//! place, region bounds with the in-flight count, the copies against leases,
//! relaxed reads into a lease, and leases raced from two threads.

use super::*;
use crate::error::{Error, Result};

#[test]
fn foreign_memory_is_used_in_place_and_checked() {
    // SAFETY: a null pointer is refused before anything reads it.
    let e = unsafe { PinnedBuffer::foreign(std::ptr::null_mut(), 16, None) }.unwrap_err();
    assert!(e.to_string().contains("null"), "{e}");
    let mut b = [0u8; 8];
    // SAFETY: a zero length is refused before anything reads it.
    let e = unsafe { PinnedBuffer::foreign(b.as_mut_ptr(), 0, None) }.unwrap_err();
    assert!(e.to_string().contains("> 0"), "{e}");
    let v: Vec<f32> = (0..300).map(|i| i as f32).collect();
    let addr = v.as_ptr() as usize;
    let locked = PinnedBuffer::locked_bytes_total();
    let buf = PinnedBuffer::from_f32_vec(v).unwrap();
    assert!(buf.is_foreign() && !buf.is_locked());
    assert_eq!((buf.as_ptr() as usize, buf.len()), (addr, 1200));
    assert_eq!(
        PinnedBuffer::locked_bytes_total(),
        locked,
        "foreign memory is not counted as locked"
    );
    // Registered and leased like our own memory, in place.
    let r = Region::new(buf, 9, 1, Access::LOCAL, None);
    let mut l = r.lease_f32(1, 2).unwrap();
    assert_eq!(l.as_f32().unwrap(), &[1.0, 2.0]);
    l.as_f32_mut().unwrap()[0] = -1.0;
    drop(l);
    let mut out = [0u8; 4];
    r.read_at(4, &mut out).unwrap();
    assert_eq!(f32::from_le_bytes(out), -1.0);
    assert!(r.lease(1196, 8).is_err(), "bounds are the caller's length");
    drop(r); // frees the Vec (Miri checks the ownership)
             // Foreign memory one byte off a 4-byte boundary: a relaxed f32 read at an
             // offset whose address is not aligned is refused; one that lands aligned reads.
    let mut words = vec![0u32; 8];
    words[1] = 2.5f32.to_bits();
    // SAFETY: the 28 bytes from byte 1 lie in `words`, which outlives the region.
    let odd = unsafe { PinnedBuffer::foreign(words.as_mut_ptr().cast::<u8>().add(1), 28, None) }.unwrap();
    let r = Region::new(odd, 10, 1, Access::LOCAL, None);
    let mut f = [0f32; 1];
    assert!(matches!(
        r.read_f32_relaxed(0, &mut f),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        r.read_f32_relaxed(4, &mut f),
        Err(Error::InvalidArgument { .. })
    ));
    r.read_f32_relaxed(3, &mut f).unwrap();
    assert_eq!(f, [2.5]);
    drop(r);
    drop(words);
}

#[test]
fn region_bounds_and_copies() {
    let r = Region::new(PinnedBuffer::new(4096).unwrap(), 7, 1, Access::LOCAL, None);
    r.write_at(10, b"hello").unwrap();
    let mut out = [0u8; 5];
    r.read_at(10, &mut out).unwrap();
    assert_eq!(&out, b"hello");
    assert!(r.slice(4090, 7).is_err());
    assert!(r.slice(usize::MAX, 2).is_err());
    assert!(r.read_at(4095, &mut [0u8; 2]).is_err());
    let s = r.slice(4000, 96).unwrap();
    assert_eq!((s.offset(), s.len()), (4000, 96));
    {
        let _g = InFlight::new(&r);
        assert_eq!(r.in_flight(), 1);
    }
    assert_eq!(r.in_flight(), 0);
}

fn region(len: usize) -> Region {
    let buf = PinnedBuffer::with_options(
        len,
        PinOptions {
            lock: false,
            ..Default::default()
        },
    )
    .unwrap();
    Region::new(buf, 9, 1, Access::REMOTE_WRITE, None)
}

fn busy(r: Result<()>) -> bool {
    matches!(r, Err(Error::RegionBusy { .. }))
}

#[test]
fn copies_refuse_leased_bytes() {
    let r = region(4096);
    let mut l = r.lease(100, 50).unwrap();
    l.as_bytes_mut().fill(7);
    for (off, len) in [(100, 50), (90, 11), (149, 1), (0, 4096), (120, 1)] {
        assert!(busy(r.write_at(off, &vec![1; len])), "write_at {off}+{len}");
        assert!(busy(r.fill(off, len, 1)), "fill {off}+{len}");
        assert!(busy(r.read_at(off, &mut vec![0; len])), "read_at {off}+{len}");
    }
    assert!(busy(r.read_f32_relaxed(148, &mut [0.0; 1])));
    let e = r.write_at(100, b"x").unwrap_err();
    assert!(e.to_string().contains("Region::write_at"), "{e}");
    // Next to the lease, copies go ahead.
    r.write_at(90, &[1; 10]).unwrap();
    r.fill(150, 10, 2).unwrap();
    let mut out = [0u8; 70];
    r.read_at(150, &mut out[..10]).unwrap();
    assert_eq!(out[..10], [2; 10]);
    assert!(
        l.as_bytes().iter().all(|&b| b == 7),
        "the leased bytes were not touched"
    );
    drop(l);
    r.read_at(90, &mut out).unwrap();
    assert_eq!(out[..10], [1; 10]);
    assert_eq!(out[10..60], [7; 50]);
    assert_eq!(out[60..], [2; 10]);
    r.write_at(100, b"free again").unwrap();
}

#[test]
fn relaxed_reads() {
    let r = region(4096);
    let vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    r.lease_f32(8, 64).unwrap().as_f32_mut().unwrap().copy_from_slice(&vals);
    let mut got = vec![0f32; 64];
    r.read_f32_relaxed(32, &mut got).unwrap();
    assert_eq!(got, vals);
    assert!(matches!(
        r.read_f32_relaxed(2, &mut got),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        r.read_f32_relaxed(4096 - 8, &mut got[..3]),
        Err(Error::OutOfBounds { .. })
    ));
    r.read_f32_relaxed(4096, &mut []).unwrap();
    // Region to region (and within one region) through a lease on the destination.
    let other = region(4096);
    let mut dst = other.lease_f32(0, 64).unwrap();
    r.read_f32_relaxed(32, dst.as_f32_mut().unwrap()).unwrap();
    assert_eq!(dst.as_f32().unwrap(), &vals[..]);
    let mut same = r.lease_f32(512, 64).unwrap();
    r.read_f32_relaxed(32, same.as_f32_mut().unwrap()).unwrap();
    assert_eq!(same.as_f32().unwrap(), &vals[..]);
    // Float reads at both 4-byte alignments of an 8-byte word and every length
    // around it: a lone float before the first word boundary and one after the
    // last whole word are read singly, the pairs between as words.
    let vals: Vec<f32> = (0..40).map(|i| -(i as f32) * 1.25 - 0.5).collect();
    r.lease_f32(600, 40)
        .unwrap()
        .as_f32_mut()
        .unwrap()
        .copy_from_slice(&vals);
    for first in 0..3 {
        for len in 0..(40 - first).min(12) {
            let mut out = vec![f32::NAN; len];
            r.read_f32_relaxed(2400 + 4 * first, &mut out).unwrap();
            assert_eq!(out, vals[first..first + len], "float {first}, {len} floats");
        }
    }
    // Byte reads at every alignment and length around the 8-byte words.
    let bytes: Vec<u8> = (0..64u8).collect();
    r.write_at(1000, &bytes).unwrap();
    for off in 0..9 {
        for len in 0..(64 - off).min(20) {
            let mut out = vec![0u8; len];
            r.read_at(1000 + off, &mut out).unwrap();
            assert_eq!(out, bytes[off..off + len], "{off}+{len}");
        }
    }
}

#[test]
fn leases_from_two_threads_are_exclusive() {
    // Two threads race for overlapping leases and write through them, while
    // copies run beside them; a lapse in exclusivity is a data race (Miri
    // reports it) or a torn pattern (the asserts catch it).
    let r = region(4096);
    let rounds = if cfg!(miri) { 20 } else { 2000 };
    let workers: Vec<_> = (1..=2u8)
        .map(|me| {
            let r = r.clone();
            std::thread::spawn(move || {
                let mut won = 0;
                for _ in 0..rounds {
                    if let Ok(mut l) = r.lease(me as usize * 8, 32) {
                        l.as_bytes_mut().fill(me);
                        assert!(l.as_bytes().iter().all(|&b| b == me), "another writer in my lease");
                        won += 1;
                    }
                    let mut out = [0u8; 8];
                    match r.read_at(0, &mut out) {
                        Ok(()) => assert!(out.iter().all(|&b| b == out[0])),
                        Err(e) => assert!(matches!(e, Error::RegionBusy { .. }), "{e}"),
                    }
                    let _ = r.write_at(4000, &[me; 8]);
                    let mut f = [0f32; 2];
                    r.read_f32_relaxed(4000, &mut f).unwrap();
                    std::thread::yield_now();
                }
                won
            })
        })
        .collect();
    let won: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(won > 0);
    assert!(r.lease(0, 4096).is_ok(), "every lease was released");
}
