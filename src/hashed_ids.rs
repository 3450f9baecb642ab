//! Keyed hashing of correlation IDs (`--hash-correlation-ids`): for IDs
//! that are themselves personal data (an e-mail address, an account
//! number), the engine hands every store a keyed hash of the ID instead of
//! the ID, so no store, dump, replica or backup holds it. Callers still
//! send and receive their IDs; only the store's key changes.
//!
//! HMAC-SHA-256 (RustCrypto `hmac`) over the namespace and the ID,
//! length-prefixed, under a key of its own that must never change: another
//! key hashes every ID differently, so each stored record would be out of
//! reach and its event processed again.

use std::{fmt, path::Path};

use base64::Engine as _;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::{
    domain::Key,
    sealing::{parse_key, KEY_BYTES},
};

/// What a hashed ID starts with: the scheme's version, so another scheme
/// could one day be told apart.
const PREFIX: &str = "h1.";

/// Hashes correlation IDs under one key.
#[derive(Clone)]
pub struct IdHasher {
    /// Keyed once; cloned per ID (the key's two compression-function
    /// blocks are not redone).
    mac: Hmac<Sha256>,
}

impl fmt::Debug for IdHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IdHasher")
    }
}

impl IdHasher {
    /// The key in `path` (32 bytes, base64 or hex, as for the sealing keys);
    /// the error is one line naming the file.
    pub fn load(path: &Path) -> Result<IdHasher, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--hash-correlation-ids {}: {e}", path.display()))?;
        let key = parse_key(&text)
            .map_err(|problem| format!("--hash-correlation-ids {}: {problem}", path.display()))?;
        Ok(IdHasher::from_bytes(&key))
    }

    /// A hasher with a raw key (tests, benchmarks).
    pub fn from_bytes(key: &[u8; KEY_BYTES]) -> IdHasher {
        IdHasher {
            mac: <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes any key length"),
        }
    }

    /// A value that names the hashing key without revealing it (16 hex
    /// digits): kept in the store, so a sidecar started with another key
    /// is refused instead of finding no record and processing every event
    /// again.
    pub fn check_value(&self) -> String {
        let mut mac = self.mac.clone();
        mac.update(b"dedupd correlation id check v1");
        let digest = mac.finalize().into_bytes();
        digest[..8]
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect()
    }

    /// The key the store holds for `key`: its namespace as it is (retention,
    /// metrics and the reaper work by namespace), its ID hashed (`h1.` and
    /// 43 base64url characters).
    pub fn stored(&self, key: &Key) -> Key {
        let mut mac = self.mac.clone();
        mac.update(b"dedupd correlation id v1\0");
        for part in [key.namespace(), key.correlation_id()] {
            mac.update(&(part.len() as u32).to_be_bytes());
            mac.update(part.as_bytes());
        }
        let digest = mac.finalize().into_bytes();
        let mut id = String::with_capacity(PREFIX.len() + 43);
        id.push_str(PREFIX);
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode_string(digest, &mut id);
        Key::new_unchecked(key.namespace().to_owned(), id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(namespace: &str, id: &str) -> Key {
        Key::new_unchecked(namespace.into(), id.into())
    }

    #[test]
    fn one_id_one_hash_per_key_and_namespace() {
        let hasher = IdHasher::from_bytes(&[1; KEY_BYTES]);
        let stored = hasher.stored(&key("payments", "alice@example.com"));
        assert_eq!(stored.namespace(), "payments");
        assert!(stored.correlation_id().starts_with(PREFIX));
        assert_eq!(stored.correlation_id().len(), PREFIX.len() + 43);
        assert!(!stored.correlation_id().contains("alice"));
        assert_eq!(stored, hasher.stored(&key("payments", "alice@example.com")));
        assert_ne!(stored, hasher.stored(&key("payments", "bob@example.com")));
        assert_ne!(
            stored.correlation_id(),
            hasher
                .stored(&key("refunds", "alice@example.com"))
                .correlation_id()
        );
        // Length-prefixed: the parts cannot trade bytes.
        assert_ne!(
            hasher.stored(&key("ab", "c")).correlation_id(),
            hasher.stored(&key("a", "bc")).correlation_id()
        );
        let other = IdHasher::from_bytes(&[2; KEY_BYTES]);
        assert_ne!(stored, other.stored(&key("payments", "alice@example.com")));
    }
}
