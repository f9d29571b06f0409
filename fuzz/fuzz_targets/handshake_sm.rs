//! The real sans-IO handshake (transport/src/handshake.rs), both sides, with an
//! attacker between them: the client's `Handshake::client`, `on_header`,
//! `on_frame`; the server's `first_header`, `first_frame`, `on_header`,
//! `on_frame` and `attach` for the data socket. Every frame either side emits
//! goes through the attacker as bytes, and the receiving side reads it as a
//! backend does: the 40-byte header first (checked before any payload), then
//! exactly the payload its header announces.
//!
//! Input: one byte of setup (whether the two sides hold the same secret, and
//! whether the job ids match), then one attacker action per frame in flight:
//! pass it, flip a bit, truncate it, replace it with input bytes, append input
//! bytes, or drop it. Invariants:
//! - nothing panics, whatever the attacker sends;
//! - an untouched exchange with one secret and one job establishes both sides,
//!   with the same token and each other's ranks;
//! - with different secrets (or jobs) neither side ever authenticates the other;
//! - whenever the server establishes, the client authenticated the same token;
//! - a peer that is refused is refused with a typed error, and a header is
//!   refused before its payload is read when its kind or size is wrong.
#![no_main]

use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use tidewire_transport::frame::HEADER_LEN;
use tidewire_transport::handshake::{first_frame, first_header, FirstFrame, Frame, Handshake, Outcome, Params};
use tidewire_transport::JobSecret;

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn take(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a.to_vec()
    }
}

/// The attacker's action on one frame's bytes: `None` drops it. Action 0 (what
/// an exhausted input gives) passes the frame untouched.
fn tamper(inp: &mut Input, bytes: Vec<u8>, touched: &mut bool) -> Option<Vec<u8>> {
    let mut b = bytes;
    match inp.byte() % 6 {
        0 => return Some(b),
        1 => {
            if !b.is_empty() {
                let i = inp.byte() as usize * 256 + inp.byte() as usize;
                let i = i % b.len();
                b[i] ^= 1 << (inp.byte() % 8);
            }
        }
        2 => {
            let n = inp.byte() as usize % (b.len() + 1);
            b.truncate(n);
        }
        3 => {
            let n = inp.byte() as usize;
            b = inp.take(n);
        }
        4 => {
            let n = inp.byte() as usize;
            b.extend(inp.take(n));
        }
        _ => {
            *touched = true;
            return None;
        }
    }
    *touched = true;
    Some(b)
}

/// Splits received bytes into header and payload as a backend reads them.
fn split(b: &[u8]) -> Option<(&[u8; HEADER_LEN], &[u8])> {
    if b.len() < HEADER_LEN {
        return None;
    }
    let (h, rest) = b.split_at(HEADER_LEN);
    Some((h.try_into().expect("40 bytes"), rest))
}

fn run(data: &[u8]) {
    let mut inp = Input(data);
    let setup = inp.byte();
    let same_secret = setup & 1 == 0;
    let same_job = setup & 2 == 0;
    let now = Instant::now();
    let deadline = now + Duration::from_secs(5);
    let server_p = Params {
        job_id: 7,
        rank: 0,
        secret: JobSecret::new(b"the job secret".to_vec()),
    };
    let client_p = Params {
        job_id: if same_job { 7 } else { 8 },
        rank: 3,
        secret: JobSecret::new(if same_secret {
            b"the job secret".to_vec()
        } else {
            b"another secret".to_vec()
        }),
    };
    let honest = same_secret && same_job;
    let mut touched = false;
    let token = 0x5eed_u64;

    // Client: Hello on the control socket.
    let (mut client, hello) = Handshake::client(&client_p, "server", now, deadline);
    let Some(b) = tamper(&mut inp, hello.to_bytes(), &mut touched) else {
        assert!(touched);
        return;
    };
    // Server: the first frame of an accepted socket.
    let Some((h, rest)) = split(&b) else { return };
    let Ok(hdr) = first_header("client", h) else {
        assert!(touched, "an untouched Hello was refused on its header");
        return;
    };
    let Some(payload) = rest.get(..hdr.length as usize) else { return };
    match first_frame(&server_p, "client", hdr, payload, token, now, deadline) {
        Ok(FirstFrame::Hello { hs, send }) => {
            assert!(!hs.authenticated());
            if let Some(b) = tamper(&mut inp, send.to_bytes(), &mut touched) {
                deliver_to_client(&mut inp, &mut client, &client_p, &b, &mut touched, hs, &server_p, honest);
            }
        }
        Ok(FirstFrame::DataAttach { .. }) => assert!(touched, "a Hello was classified as a data socket"),
        Err(r) => {
            assert!(touched || !same_job, "an untouched Hello was refused: {:?}", r.error);
            let _ = r.reject_frame().map(|f| f.to_bytes());
        }
    }
}

/// The rest of the exchange once the server answered a Hello with a Challenge.
#[allow(clippy::too_many_arguments)]
fn deliver_to_client(
    inp: &mut Input,
    client: &mut Handshake,
    client_p: &Params,
    challenge: &[u8],
    touched: &mut bool,
    mut server: Box<Handshake>,
    server_p: &Params,
    honest: bool,
) {
    let Some((h, rest)) = split(challenge) else { return };
    let hdr = match client.on_header(h) {
        Ok(hdr) => hdr,
        Err(_) => {
            assert!(*touched, "an untouched Challenge was refused on its header");
            return;
        }
    };
    let Some(payload) = rest.get(..hdr.length as usize) else { return };
    let (auth, attach) = match client.on_frame(client_p, &hdr, payload) {
        Ok(Outcome::OpenData { send, attach }) => {
            // The client accepted the server's proof: it must have been made with
            // the client's secret, for the token the server handed out.
            assert!(honest, "a client accepted a Challenge made with another secret or job");
            assert!(client.authenticated());
            assert_eq!(client.token(), server.token(), "the client accepted another token");
            assert_eq!(client.peer_rank(), server_p.rank);
            (send, attach)
        }
        Ok(other) => panic!("a Challenge gave {other:?}"),
        Err(r) => {
            assert!(*touched || !honest, "an honest Challenge was refused: {:?}", r.error);
            assert!(!client.authenticated());
            return;
        }
    };
    // Auth on the control socket.
    let mut server_authed = false;
    if let Some(b) = tamper(inp, auth.to_bytes(), touched) {
        if let Some((h, rest)) = split(&b) {
            match server.on_header(h) {
                Ok(hdr) => {
                    if let Some(payload) = rest.get(..hdr.length as usize) {
                        match server.on_frame(server_p, &hdr, payload) {
                            Ok(Outcome::Continue) => {
                                assert!(server.authenticated());
                                server_authed = true;
                            }
                            Ok(other) => panic!("an Auth gave {other:?}"),
                            Err(r) => {
                                assert!(*touched, "an honest Auth was refused: {:?}", r.error);
                                assert!(!server.authenticated());
                            }
                        }
                    }
                }
                Err(_) => assert!(*touched, "an untouched Auth was refused on its header"),
            }
        }
    }
    if !server_authed {
        return;
    }
    // The data socket's first frame: DataAttach, then `attach` on the connection it names.
    let Some(b) = tamper(inp, attach.to_bytes(), touched) else { return };
    let Some((h, rest)) = split(&b) else { return };
    let Ok(hdr) = first_header("client data", h) else {
        assert!(*touched, "an untouched DataAttach was refused on its header");
        return;
    };
    let Some(payload) = rest.get(..hdr.length as usize) else { return };
    let ready: Frame = match first_frame(server_p, "client data", hdr, payload, 1, Instant::now(), server.deadline()) {
        Ok(FirstFrame::DataAttach { token, mac }) => {
            if token != server.token() {
                assert!(*touched, "an untouched DataAttach named another token");
                return;
            }
            match server.attach(server_p, &mac) {
                Ok(f) => {
                    assert_eq!(token, client.token());
                    f
                }
                Err(r) => {
                    assert!(*touched, "an honest DataAttach was refused: {:?}", r.error);
                    return;
                }
            }
        }
        Ok(FirstFrame::Hello { .. }) => {
            assert!(*touched, "a DataAttach was classified as a Hello");
            return;
        }
        Err(r) => {
            assert!(*touched, "an honest DataAttach was refused: {:?}", r.error);
            return;
        }
    };
    assert!(server.authenticated());
    // Ready on the control socket.
    let Some(b) = tamper(inp, ready.to_bytes(), touched) else { return };
    let Some((h, rest)) = split(&b) else { return };
    let Ok(hdr) = client.on_header(h) else {
        assert!(*touched, "an untouched Ready was refused on its header");
        return;
    };
    let Some(payload) = rest.get(..hdr.length as usize) else { return };
    match client.on_frame(client_p, &hdr, payload) {
        Ok(Outcome::Established) => {
            assert_eq!(client.token(), server.token());
            assert_eq!(server.peer_rank(), client_p.rank);
        }
        Ok(other) => panic!("a Ready gave {other:?}"),
        Err(r) => assert!(*touched, "an honest Ready was refused: {:?}", r.error),
    }
    if !*touched {
        assert!(
            client.authenticated() && server.authenticated(),
            "an untouched honest exchange did not establish both sides"
        );
    }
}

fuzz_target!(|data: &[u8]| run(data));
