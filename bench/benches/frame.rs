//! Criterion benches for the hot paths of the wire format: header encode,
//! header decode, and frame extraction from a reassembly buffer.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use tidewire_transport::frame::{next_frame, Header, Kind, HEADER_LEN, MAX_MESSAGE_BYTES};

fn codec(c: &mut Criterion) {
    let mut h = Header::new(Kind::Write, 1 << 20);
    h.region = 0xabcd;
    h.offset = 4096;
    h.seq = 77;
    h.imm = 5;
    let bytes = h.encode();
    c.bench_function("header_encode", |b| b.iter(|| black_box(black_box(&h).encode())));
    c.bench_function("header_decode", |b| {
        b.iter(|| Header::decode(black_box(&bytes)).unwrap())
    });

    // 64 messages of 64 B back to back, as a multishot receive hands them over.
    let mut stream = Vec::new();
    for i in 0..64u64 {
        let mut m = Header::new(Kind::Message, 64);
        m.seq = i;
        stream.extend_from_slice(&m.encode());
        stream.extend_from_slice(&[7u8; 64]);
    }
    let mut g = c.benchmark_group("next_frame");
    g.throughput(Throughput::Elements(64));
    g.bench_function("64x64B", |b| {
        b.iter(|| {
            let mut at = 0;
            let mut n = 0;
            while let Some((_, total)) = next_frame(black_box(&stream[at..]), MAX_MESSAGE_BYTES).unwrap() {
                at += total;
                n += 1;
            }
            assert_eq!(n, 64);
            assert_eq!(at, 64 * (HEADER_LEN + 64));
        })
    });
    g.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
