//! The handshake, both sides, over the real frame codec and the real HMAC
//! challenge-response (tidewire_transport::{frame, auth}), with an attacker
//! between them.
//!
//! The two sides below follow transport/src/tcp/handshake.rs step for step
//! (client: AwaitChallenge -> AwaitReady -> Ready; server: first frame ->
//! AwaitAuth -> AwaitData -> Ready, the data socket attaching with its token),
//! minus the sockets: every frame is encoded with the real encoders, passes
//! through the attacker, is reassembled with `next_frame` and decoded and
//! verified with the real decoders and `auth::verify`.
//!
//! Input: the job's parameters, secrets, nonces and token, then one attacker
//! action per frame in flight (pass, flip bits, truncate, replace with or
//! append input bytes, inject a forged frame, drop). Invariants:
//! - no decoder or verifier panics on anything the attacker sends;
//! - an untouched exchange with one secret completes on both sides, with equal
//!   transcripts;
//! - with different secrets neither side ever authenticates its peer;
//! - whenever the server accepts a client (and a data socket), the client
//!   completed the same transcript: job, both ranks, both nonces, token;
//! - a MAC for one role never verifies for another.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidewire_transport::auth::{prove, verify, Role, Transcript};
use tidewire_transport::frame::{
    decode_mac, decode_reason, next_frame, Challenge, DataAttach, Header, Hello, Kind, HEADER_LEN, NONCE_LEN,
};
use tidewire_transport::JobSecret;

/// The first frame an unauthenticated socket may send (tcp/handshake.rs: FIRST_FRAME_MAX).
const FIRST_FRAME_MAX: u32 = 256;

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
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        for b in &mut out {
            *b = self.byte();
        }
        out
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    fn take(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a.to_vec()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientState {
    AwaitChallenge,
    AwaitReady,
    Ready,
    Failed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServerState {
    FirstFrame,
    AwaitAuth,
    AwaitData,
    Ready,
    Failed,
}

fn frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut v = Header::new(kind, body.len() as u32).encode().to_vec();
    v.extend_from_slice(body);
    v
}

fn same(a: &Transcript, b: &Transcript) -> bool {
    a.job_id == b.job_id
        && a.client_rank == b.client_rank
        && a.server_rank == b.server_rank
        && a.client_nonce == b.client_nonce
        && a.server_nonce == b.server_nonce
        && a.token == b.token
}

/// What the attacker does to the bytes of one frame in flight.
fn tamper(raw: Vec<u8>, inp: &mut Input, tampered: &mut bool) -> Vec<u8> {
    let action = inp.byte();
    let mut b = raw.clone();
    match action % 8 {
        0..=2 => {}
        3 => {
            // Flip bits in one byte.
            if !b.is_empty() {
                let i = inp.byte() as usize % b.len();
                b[i] ^= inp.byte() | 1;
            }
        }
        4 => {
            let n = inp.byte() as usize % (b.len() + 1);
            b.truncate(n);
        }
        5 => {
            let n = inp.byte() as usize;
            b = inp.take(n);
        }
        6 => {
            // A forged frame of an attacker-chosen kind with attacker bytes.
            let kind = Kind::from_u8(1 + inp.byte() % 12).expect("kind");
            let n = inp.byte() as usize;
            b = frame(kind, &inp.take(n));
        }
        _ => {
            let n = inp.byte() as usize;
            b.extend_from_slice(&inp.take(n));
        }
    }
    *tampered |= b != raw;
    b
}

/// One complete frame from `bytes`, as a receiver reassembles it (it reads
/// nothing past the first frame; a short or malformed frame is a failure).
fn receive(bytes: &[u8], cap: u32) -> Option<(Header, Vec<u8>)> {
    match next_frame(bytes, cap) {
        Ok(Some((h, total))) => Some((h, bytes[HEADER_LEN..total].to_vec())),
        Ok(None) | Err(_) => None,
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let job_id = inp.u64();
    let client_rank = inp.u32();
    let server_rank = inp.u32();
    let one_secret = inp.byte() % 4 != 0;
    let secret_len = inp.byte() as usize % 48;
    let s1 = inp.take(secret_len);
    let server_secret = JobSecret::new(s1.clone());
    let client_secret = if one_secret {
        JobSecret::new(s1.clone())
    } else {
        // Not a zero byte: HMAC pads short keys with zeros, so "k" and "k\0" are one key
        // (found by this target; see fuzz/RESULTS.md).
        let mut s2 = s1.clone();
        s2.push(inp.byte() | 1);
        JobSecret::new(s2)
    };
    let client_job = if inp.byte() % 8 == 0 { job_id ^ 1 } else { job_id };
    let client_nonce: [u8; NONCE_LEN] = inp.bytes();
    let server_nonce: [u8; NONCE_LEN] = inp.bytes();
    let token = inp.u64() | 1;

    let mut tampered = false;
    let mut c = Transcript {
        job_id: client_job,
        client_rank,
        server_rank: 0,
        client_nonce,
        server_nonce: [0; NONCE_LEN],
        token: 0,
    };
    let mut s = Transcript {
        job_id,
        client_rank: 0,
        server_rank,
        client_nonce: [0; NONCE_LEN],
        server_nonce,
        token: 0,
    };
    // The client has sent its Hello and awaits the challenge; the server awaits a first frame.
    let mut cs = ClientState::AwaitChallenge;
    let mut ss = ServerState::FirstFrame;
    let _ = (cs, ss);

    // Client -> server: Hello (the first frame of an unauthenticated socket).
    let hello = Hello {
        job_id: client_job,
        rank: client_rank,
        nonce: client_nonce,
    };
    let wire = tamper(frame(Kind::Hello, &hello.encode()), &mut inp, &mut tampered);
    let mut to_client = None;
    match Header::decode_any_version(&wire) {
        Ok(h)
            if h.version == tidewire_transport::frame::VERSION
                && matches!(h.kind, Kind::Hello)
                && h.length <= FIRST_FRAME_MAX
                && wire.len() >= HEADER_LEN + h.length as usize =>
        {
            let body = &wire[HEADER_LEN..HEADER_LEN + h.length as usize];
            match Hello::decode(body) {
                Ok(got) if got.job_id == job_id => {
                    s.client_rank = got.rank;
                    s.client_nonce = got.nonce;
                    s.token = token;
                    ss = ServerState::AwaitAuth;
                    let ch = Challenge {
                        rank: server_rank,
                        nonce: server_nonce,
                        token,
                        mac: prove(&server_secret, Role::Server, &s),
                    };
                    to_client = Some(frame(Kind::Challenge, &ch.encode()));
                }
                _ => ss = ServerState::Failed,
            }
        }
        _ => ss = ServerState::Failed,
    }
    if ss == ServerState::Failed {
        // The server rejects; the client reads the reason.
        to_client = Some(frame(Kind::Reject, b"expected Hello"));
    }

    // Server -> client: Challenge (or Reject).
    let wire = tamper(to_client.expect("set"), &mut inp, &mut tampered);
    let mut to_server = None;
    match receive(&wire, tidewire_transport::frame::MAX_CONTROL_BYTES) {
        Some((h, p)) if h.kind == Kind::Challenge => match Challenge::decode(&p) {
            Ok(ch) => {
                c.server_rank = ch.rank;
                c.server_nonce = ch.nonce;
                c.token = ch.token;
                if verify(&client_secret, Role::Server, &c, &ch.mac) {
                    // The server proved the secret over what the client sees.
                    assert!(one_secret, "a server proof verified under another secret");
                    cs = ClientState::AwaitReady;
                    let mac = prove(&client_secret, Role::Client, &c);
                    assert!(!verify(&client_secret, Role::Server, &c, &mac), "roles are distinct");
                    assert!(!verify(&client_secret, Role::Data, &c, &mac), "roles are distinct");
                    to_server = Some(frame(Kind::Auth, &mac));
                } else {
                    cs = ClientState::Failed;
                }
            }
            Err(_) => cs = ClientState::Failed,
        },
        Some((h, p)) if h.kind == Kind::Reject => {
            let _ = decode_reason(&p);
            cs = ClientState::Failed;
        }
        _ => cs = ClientState::Failed,
    }
    if cs == ClientState::AwaitReady {
        assert_eq!(
            ss,
            ServerState::AwaitAuth,
            "the client accepted a challenge the server never sent"
        );
        assert!(same(&c, &s), "the client accepted a challenge over another transcript");
    }

    // Client -> server: Auth on the control socket, then DataAttach on the data socket.
    if let Some(auth) = to_server {
        let wire = tamper(auth, &mut inp, &mut tampered);
        if ss == ServerState::AwaitAuth {
            match receive(&wire, tidewire_transport::frame::MAX_CONTROL_BYTES) {
                Some((h, p)) if h.kind == Kind::Auth => match decode_mac(&p, "Auth") {
                    Ok(mac) if verify(&server_secret, Role::Client, &s, &mac) => ss = ServerState::AwaitData,
                    _ => ss = ServerState::Failed,
                },
                _ => ss = ServerState::Failed,
            }
        }
        if ss == ServerState::AwaitData {
            assert!(
                one_secret && cs == ClientState::AwaitReady && same(&c, &s),
                "the server accepted a forged Auth"
            );
        }
        let att = DataAttach {
            token: c.token,
            mac: prove(&client_secret, Role::Data, &c),
        };
        let wire = tamper(frame(Kind::DataAttach, &att.encode()), &mut inp, &mut tampered);
        if let Ok(h) = Header::decode(&wire) {
            if h.kind == Kind::DataAttach && h.length <= FIRST_FRAME_MAX && wire.len() >= HEADER_LEN + h.length as usize
            {
                if let Ok(got) = DataAttach::decode(&wire[HEADER_LEN..HEADER_LEN + h.length as usize]) {
                    let ok = got.token == s.token
                        && ss == ServerState::AwaitData
                        && verify(&server_secret, Role::Data, &s, &got.mac);
                    if ok {
                        ss = ServerState::Ready;
                    }
                }
            }
        }
        if ss == ServerState::Ready {
            assert!(one_secret && same(&c, &s), "the server attached a forged data socket");
            // Server -> client: Ready.
            let wire = tamper(frame(Kind::Ready, &[]), &mut inp, &mut tampered);
            if let Some((h, _)) = receive(&wire, tidewire_transport::frame::MAX_CONTROL_BYTES) {
                if h.kind == Kind::Ready && cs == ClientState::AwaitReady {
                    cs = ClientState::Ready;
                }
            }
        }
    }

    if one_secret && !tampered && client_job == job_id {
        assert_eq!(
            (cs, ss),
            (ClientState::Ready, ServerState::Ready),
            "an honest handshake failed"
        );
        assert!(same(&c, &s));
    }
    if !one_secret {
        assert!(ss != ServerState::AwaitData && ss != ServerState::Ready);
        assert!(cs != ClientState::AwaitReady && cs != ClientState::Ready);
    }
    if client_job != job_id && !tampered {
        assert!(ss == ServerState::Failed, "a Hello of another job was accepted");
    }
});
