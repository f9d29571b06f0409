//! HMAC-SHA256 challenge-response over a shared job secret.
//!
//! Both sides contribute a fresh 32-byte nonce. The server proves knowledge
//! of the secret first (so a client never talks to an impostor), then the
//! client does; the data socket is bound to the same exchange by a token.
//! Each MAC covers a distinct label, the job id, both ranks and both nonces,
//! so a MAC from one role or connection cannot be replayed in another.
//! Comparison is constant-time (`Mac::verify_slice`).

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::frame::NONCE_LEN;

type HmacSha256 = Hmac<Sha256>;

/// A job's shared secret. Its `Debug` never prints the bytes.
#[derive(Clone)]
pub struct JobSecret(Vec<u8>);

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobSecret(<{} bytes>)", self.0.len())
    }
}

impl JobSecret {
    /// Wraps secret bytes (any length; 32 random bytes recommended).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        JobSecret(bytes.into())
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
    let mut m = HmacSha256::new_from_slice(&secret.0).expect("HMAC accepts keys of any length");
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
}
