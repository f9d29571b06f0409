//! End-to-end through the facade: what an embedding framework sees.

use std::time::{Duration, Instant};

use tidewire::transport::{Access, Event, JobSecret, PinnedBuffer, TcpConfig, TcpTransport, Transport};

#[test]
fn a_gradient_chunk_crosses_the_facade() {
    let secret = JobSecret::new(b"facade".to_vec());
    let mut server = TcpTransport::new(TcpConfig::new(9, 0, secret.clone())).unwrap();
    let l = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let landing = server
        .register(PinnedBuffer::new(2 << 20).unwrap(), Access::REMOTE_WRITE)
        .unwrap();
    let mut client = TcpTransport::new(TcpConfig::new(9, 1, secret)).unwrap();
    let grads = client
        .register(PinnedBuffer::new(2 << 20).unwrap(), Access::LOCAL)
        .unwrap();
    let chunk: Vec<u8> = (0..2 << 20).map(|i: u32| (i * 7) as u8).collect();
    grads.write_at(0, &chunk).unwrap();
    let conn = client.connect(server.listener_addr(l).unwrap()).unwrap();
    let (mut se, mut ce) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.remote_regions(conn).unwrap().is_empty() {
        server.poll(&mut se, 64).unwrap();
        client.wait(&mut ce, 64, Duration::from_millis(5)).unwrap();
        assert!(Instant::now() < deadline, "no connection: {se:?} {ce:?}");
    }
    let dst = client.remote_regions(conn).unwrap()[0];
    client.write(conn, &grads.full(), &dst, 0, Some(3)).unwrap();
    while !se.iter().any(|e| matches!(e, Event::WriteReceived { imm: 3, .. })) {
        server.poll(&mut se, 64).unwrap();
        client.poll(&mut ce, 64).unwrap();
        assert!(Instant::now() < deadline, "write never landed");
    }
    let mut got = vec![0u8; 2 << 20];
    landing.read_at(0, &mut got).unwrap();
    assert!(got == chunk);
}
