//! The optional RPC authentication (`rpc_auth_token`, env `MC_TENT_AUTH_TOKEN`).
//!
//! When a token is set, a server serves nothing on a connection until the client asked for a
//! challenge (a fresh random 32-byte nonce) and answered it with HMAC-SHA256(token, label ||
//! nonce). The token itself never crosses the wire, and a recorded answer is useless for another
//! connection. Without a token the messages are unknown ids to an upstream peer, which answers
//! them with an empty success, so a client with a token still talks to servers without one.

use hmac::{Hmac, Mac};
use sha2::Sha256;

const LABEL: &[u8] = b"tent-rs rpc auth v1\0";

/// A fresh random challenge from the OS's random source (`getrandom`). There is no fallback:
/// a guessable challenge would let a recorded answer be replayed, so without randomness the
/// server refuses the connection instead.
pub fn nonce() -> Result<[u8; 32], getrandom::Error> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n)?;
    Ok(n)
}

/// The answer to `nonce` for `token`.
pub fn respond(token: &[u8], nonce: &[u8]) -> Vec<u8> {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(token) else { return Vec::new() };
    mac.update(LABEL);
    mac.update(nonce);
    mac.finalize().into_bytes().to_vec()
}

/// Checks an answer in constant time.
pub fn verify(token: &[u8], nonce: &[u8], answer: &[u8]) -> bool {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(token) else { return false };
    mac.update(LABEL);
    mac.update(nonce);
    mac.verify_slice(answer).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_depend_on_token_and_nonce() {
        let n = nonce().expect("random");
        assert_ne!(n, nonce().expect("random"), "nonces are fresh");
        let a = respond(b"secret", &n);
        assert_eq!(a.len(), 32);
        assert!(verify(b"secret", &n, &a));
        assert!(!verify(b"other", &n, &a));
        assert!(!verify(b"secret", &nonce().expect("random"), &a));
        assert!(!verify(b"secret", &n, &a[..31]));
    }
}
