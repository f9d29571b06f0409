//! HMAC-SHA256 challenge-response over a shared job secret.
//!
//! Both sides contribute a fresh 32-byte nonce. The server proves knowledge
//! of the secret first (so a client never talks to an impostor), then the
//! client does; the data socket is bound to the same exchange by a token.
//! Each MAC covers a distinct label, the job id, both ranks and both nonces,
//! so a MAC from one role or connection cannot be replayed in another.
//! Comparison is constant-time (`Mac::verify_slice`).

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::frame::NONCE_LEN;

type HmacSha256 = Hmac<Sha256>;

/// A job's shared secret. Its `Debug` never prints the bytes.
///
/// The MACs are keyed with SHA-256 of a label, the secret's length and the
/// secret, never with the raw bytes: HMAC pads a short key with zeros and
/// hashes a long one, so raw keys `s` and `s\0` (or a long `s` and its
/// SHA-256) would be one key, and a peer holding either would pass the other's
/// challenge (found by the `handshake` fuzz target).
#[derive(Clone)]
pub struct JobSecret {
    key: [u8; 32],
    len: usize,
}

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobSecret(<{} bytes>)", self.len)
    }
}

impl JobSecret {
    /// Wraps secret bytes (any length; 32 random bytes recommended).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        let bytes = bytes.into();
        let mut h = Sha256::new();
        h.update(b"tidewire job secret v1\0");
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
        JobSecret {
            key: h.finalize().into(),
            len: bytes.len(),
        }
    }
    /// A public fingerprint of the secret (a hash of its key): it names a
    /// run, e.g. in checkpoint files, and reveals nothing that would pass a
    /// handshake.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Sha256::new();
        h.update(b"tidewire job secret fingerprint v1\0");
        h.update(self.key);
        let d = h.finalize();
        u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
    }
}

/// The fields every MAC of one handshake covers.
#[doc(hidden)] // pub for fuzz/ only
#[derive(Debug, Clone, Copy)]
pub struct Transcript {
    pub job_id: u64,
    pub client_rank: u32,
    pub server_rank: u32,
    pub client_nonce: [u8; NONCE_LEN],
    pub server_nonce: [u8; NONCE_LEN],
    pub token: u64,
}

/// Which proof.
#[doc(hidden)] // pub for fuzz/ only
#[derive(Debug, Clone, Copy)]
pub enum Role {
    Server,
    Client,
    Data,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Server => b"tidewire/v1/server-proof",
            Role::Client => b"tidewire/v1/client-proof",
            Role::Data => b"tidewire/v1/data-attach",
        }
    }
}

fn mac_for(secret: &JobSecret, role: Role, t: &Transcript) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(&secret.key).expect("HMAC accepts keys of any length");
    m.update(role.label());
    m.update(&t.job_id.to_le_bytes());
    m.update(&t.client_rank.to_le_bytes());
    m.update(&t.server_rank.to_le_bytes());
    m.update(&t.client_nonce);
    m.update(&t.server_nonce);
    m.update(&t.token.to_le_bytes());
    m
}

#[doc(hidden)] // pub for fuzz/ only
pub fn prove(secret: &JobSecret, role: Role, t: &Transcript) -> [u8; NONCE_LEN] {
    mac_for(secret, role, t).finalize().into_bytes().into()
}

#[doc(hidden)] // pub for fuzz/ only
pub fn verify(secret: &JobSecret, role: Role, t: &Transcript, mac: &[u8]) -> bool {
    mac_for(secret, role, t).verify_slice(mac).is_ok()
}

/// A MAC with the job secret over a protocol `label` and `parts` (each
/// length-prefixed, so no two part lists collide), for the job's other
/// protocols (the rendezvous) to authenticate with the same secret. Labels
/// must differ from the transport's and between roles, so that no MAC can be
/// replayed in another place.
pub fn mac(secret: &JobSecret, label: &[u8], parts: &[&[u8]]) -> [u8; NONCE_LEN] {
    labelled(secret, label, parts).finalize().into_bytes().into()
}

/// Checks a [`mac`] in constant time; a MAC of the wrong length fails.
pub fn verify_mac(secret: &JobSecret, label: &[u8], parts: &[&[u8]], mac: &[u8]) -> bool {
    labelled(secret, label, parts).verify_slice(mac).is_ok()
}

/// A fresh 32-byte nonce from the OS's random source.
pub fn nonce() -> [u8; NONCE_LEN] {
    random_nonce()
}

fn labelled(secret: &JobSecret, label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(&secret.key).expect("HMAC accepts keys of any length");
    m.update(&(label.len() as u64).to_le_bytes());
    m.update(label);
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m
}

/// Fresh random bytes from the OS.
pub(crate) fn random_nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).expect("the OS random source is available");
    n
}

pub(crate) fn random_u32() -> u32 {
    let mut n = [0u8; 4];
    getrandom::getrandom(&mut n).expect("the OS random source is available");
    u32::from_le_bytes(n)
}

pub(crate) fn random_u64() -> u64 {
    let mut n = [0u8; 8];
    getrandom::getrandom(&mut n).expect("the OS random source is available");
    u64::from_le_bytes(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Transcript {
        Transcript {
            job_id: 7,
            client_rank: 1,
            server_rank: 0,
            client_nonce: [1; 32],
            server_nonce: [2; 32],
            token: 99,
        }
    }

    /// Secrets that raw HMAC keys would make equal (trailing NULs; a long key
    /// and its SHA-256) are different keys here.
    #[test]
    fn secrets_equal_as_raw_hmac_keys_are_different_keys() {
        use sha2::Digest;
        let long = vec![7u8; 100];
        let hashed = Sha256::digest(&long).to_vec();
        let pairs: [(&[u8], &[u8]); 4] = [
            (b"", b"\0"),
            (b"job secret", b"job secret\0\0"),
            (&long, &hashed),
            (b"a", b"a\0"),
        ];
        for (a, b) in pairs {
            let proof = prove(&JobSecret::new(a.to_vec()), Role::Server, &t());
            assert!(verify(&JobSecret::new(a.to_vec()), Role::Server, &t(), &proof));
            assert!(
                !verify(&JobSecret::new(b.to_vec()), Role::Server, &t(), &proof),
                "secret {b:?} verifies a proof made with {a:?}"
            );
            let m = mac(&JobSecret::new(a.to_vec()), b"label", &[b"x"]);
            assert!(!verify_mac(&JobSecret::new(b.to_vec()), b"label", &[b"x"], &m));
        }
    }

    #[test]
    fn right_secret_verifies_wrong_one_does_not() {
        let s = JobSecret::new(b"correct horse".to_vec());
        let mac = prove(&s, Role::Client, &t());
        assert!(verify(&s, Role::Client, &t(), &mac));
        assert!(!verify(&JobSecret::new(b"wrong".to_vec()), Role::Client, &t(), &mac));
        // Roles are not interchangeable, and every field is covered.
        assert!(!verify(&s, Role::Server, &t(), &mac));
        let mut t2 = t();
        t2.token = 100;
        assert!(!verify(&s, Role::Client, &t2, &mac));
        assert!(!verify(&s, Role::Client, &t(), &mac[..31]));
        assert!(!format!("{s:?}").contains("horse"));
    }

    #[test]
    fn labelled_macs_bind_label_parts_and_their_boundaries() {
        let s = JobSecret::new(b"correct horse".to_vec());
        let m = mac(&s, b"l", &[b"ab", b"c"]);
        assert!(verify_mac(&s, b"l", &[b"ab", b"c"], &m));
        assert!(!verify_mac(&s, b"l", &[b"a", b"bc"], &m), "part boundaries are covered");
        assert!(!verify_mac(&s, b"k", &[b"ab", b"c"], &m), "the label is covered");
        assert!(!verify_mac(
            &JobSecret::new(b"other".to_vec()),
            b"l",
            &[b"ab", b"c"],
            &m
        ));
        assert!(!verify_mac(&s, b"l", &[b"ab", b"c"], &m[..16]));
        assert_ne!(nonce(), nonce());
    }
}
