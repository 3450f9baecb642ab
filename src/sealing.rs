//! Sealing of stored answers: every answer a Commit stores is encrypted in
//! the engine before it reaches any store (sled's files, PostgreSQL's rows
//! and their backups, Redis's values, dumps and replicas, the local tier),
//! and opened in the engine when it is read back.
//!
//! - **Cipher**: XChaCha20-Poly1305 (RustCrypto), a random 192-bit nonce per
//!   write: random nonces never repeat in practice however many answers one
//!   key seals (a 96-bit nonce would cap a key at about 2³² writes).
//! - **Binding**: the associated data names the record — namespace,
//!   correlation ID and the lease token of the claim that committed it — so
//!   a ciphertext copied onto another key, or onto a later claim of the
//!   same key, does not open.
//! - **Keys**: 32 bytes each, from files (a Kubernetes Secret mount), as
//!   `openssl rand -base64 32` (or `-hex 32`) writes them. Each has an ID
//!   derived from the key itself, stored beside every ciphertext; the key
//!   whose file name sorts last seals, all of them open.
//!
//! What is not sealed: correlation IDs (the lookup key), record metadata,
//! timing and sizes (a ciphertext is its answer's length plus 52 bytes).

use std::{collections::BTreeMap, fmt, path::PathBuf};

use base64::Engine as _;
use chacha20poly1305::{
    aead::{Aead, AeadCore, KeyInit, OsRng, Payload},
    XChaCha20Poly1305, XNonce,
};
use sha2::{Digest, Sha256};

use crate::domain::{Key, LeaseToken};

/// Bytes of a key.
pub const KEY_BYTES: usize = 32;
/// The first bytes of every sealed answer, the last its format's version.
/// No text starts so (0xFF is never in UTF-8), and binary answers only by a
/// 1-in-2³² chance: an engine without keys refuses an answer that starts so
/// rather than replay a ciphertext as if it were the answer.
const MAGIC: [u8; 4] = [0xD5, 0xED, 0xFF, 0x01];
const ID_BYTES: usize = 8;
const NONCE_BYTES: usize = 24;
const TAG_BYTES: usize = 16;
const HEADER_BYTES: usize = MAGIC.len() + ID_BYTES + NONCE_BYTES;
/// What sealing adds to an answer's length.
pub const OVERHEAD_BYTES: usize = HEADER_BYTES + TAG_BYTES;

/// A key's ID: the first 8 bytes of SHA-256 over a label and the key, so it
/// names the key without revealing it, and a wrong key under a familiar
/// file name is told from the right one.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId([u8; ID_BYTES]);

impl KeyId {
    fn of(key: &[u8; KEY_BYTES]) -> Self {
        let digest = Sha256::new()
            .chain_update(b"dedupd sealing key id v1\0")
            .chain_update(key)
            .finalize();
        let mut id = [0; ID_BYTES];
        id.copy_from_slice(&digest[..ID_BYTES]);
        KeyId(id)
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|byte| write!(f, "{byte:02x}"))
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

/// One key, ready to seal and open.
struct SealingKey {
    id: KeyId,
    cipher: XChaCha20Poly1305,
    /// The file it came from, for messages.
    source: PathBuf,
}

/// Why a stored answer did not open. Each is an error of the call, never an
/// answer: a damaged answer is not replayed, and not claimed afresh either.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsealable {
    /// Not in the sealed format (written in plaintext, or its header altered).
    #[error("is not sealed (written before encryption was on, or altered)")]
    NotSealed,
    /// Sealed with a key that is not among ours.
    #[error("was sealed with key {0}, which is not configured")]
    UnknownKey(KeyId),
    /// The key is ours but the ciphertext does not authenticate: altered, or
    /// copied from another record.
    #[error("failed its integrity check (altered, or copied from another record)")]
    Forged,
}

/// The keys answers are sealed and opened with.
pub struct Keyring {
    /// In file-name order; the last seals.
    keys: Vec<SealingKey>,
    /// Namespaces with keys of their own (`--namespace-key`): the last
    /// seals that namespace's answers, and removing them erases those
    /// answers while every other namespace keeps working.
    namespaces: BTreeMap<String, Vec<SealingKey>>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("keys", &self.ids())
            .field("seals_with", &self.sealing_id())
            .field("namespaces", &self.namespaces.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Keyring {
    /// Reads every key file: each path is a file, or a directory whose
    /// visible regular files (a Secret mount's `..data` links are skipped)
    /// are each a key. The error is one line naming the file.
    pub fn load(paths: &[PathBuf]) -> Result<Keyring, String> {
        Keyring::from_keys(read_keys("encryption-key-file", paths)?)
    }

    /// The same keys, and `namespace`'s own from `paths` (files or
    /// directories, as for [`Keyring::load`]).
    pub fn with_namespace_keys(
        self,
        namespace: &str,
        paths: &[PathBuf],
    ) -> Result<Keyring, String> {
        let keys = read_keys(&format!("namespace-key {namespace}"), paths)?;
        if keys.is_empty() {
            return Err(format!("--namespace-key {namespace} names no key file"));
        }
        self.add_namespace_keys(namespace, keys)
    }

    /// A keyring of raw keys, the last sealing (tests, benchmarks).
    pub fn from_bytes(keys: &[[u8; KEY_BYTES]]) -> Result<Keyring, String> {
        Keyring::from_keys(
            keys.iter()
                .enumerate()
                .map(|(index, key)| SealingKey::new(key, PathBuf::from(format!("key {index}"))))
                .collect(),
        )
    }

    /// The same keys, and `namespace`'s own raw keys (tests, benchmarks).
    pub fn with_namespace_key_bytes(
        self,
        namespace: &str,
        keys: &[[u8; KEY_BYTES]],
    ) -> Result<Keyring, String> {
        let keys = keys
            .iter()
            .enumerate()
            .map(|(index, key)| {
                SealingKey::new(key, PathBuf::from(format!("{namespace} key {index}")))
            })
            .collect();
        self.add_namespace_keys(namespace, keys)
    }

    /// `keys` added to `namespace`'s own, every key still unique.
    fn add_namespace_keys(
        mut self,
        namespace: &str,
        keys: Vec<SealingKey>,
    ) -> Result<Keyring, String> {
        self.namespaces
            .entry(namespace.to_owned())
            .or_default()
            .extend(keys);
        self.check_unique()?;
        Ok(self)
    }

    fn from_keys(keys: Vec<SealingKey>) -> Result<Keyring, String> {
        if keys.is_empty() {
            return Err("--encryption-key-file names no key file".into());
        }
        let keyring = Keyring {
            keys,
            namespaces: BTreeMap::new(),
        };
        keyring.check_unique()?;
        Ok(keyring)
    }

    /// No key twice: a namespace's key that is also another's, or the
    /// default's, would not erase its answers when removed.
    fn check_unique(&self) -> Result<(), String> {
        let all: Vec<&SealingKey> = self
            .keys
            .iter()
            .chain(self.namespaces.values().flatten())
            .collect();
        for (index, key) in all.iter().enumerate() {
            if let Some(twin) = all[..index].iter().find(|other| other.id == key.id) {
                return Err(format!(
                    "{} holds the same key as {}",
                    key.source.display(),
                    twin.source.display()
                ));
            }
        }
        Ok(())
    }

    /// The IDs of every key, the sealing one last.
    pub fn ids(&self) -> Vec<KeyId> {
        self.keys.iter().map(|key| key.id).collect()
    }

    /// The key that seals `namespace`'s answers: its own newest, or the
    /// default newest.
    fn sealing(&self, namespace: &str) -> &SealingKey {
        self.namespaces
            .get(namespace)
            .and_then(|keys| keys.last())
            .or(self.keys.last())
            .expect("a keyring has a key")
    }

    /// The ID of the key that seals answers of namespaces without keys of
    /// their own.
    pub fn sealing_id(&self) -> KeyId {
        self.keys.last().expect("a keyring has a key").id
    }

    /// The ID of the key that seals `namespace`'s answers.
    pub fn sealing_id_for(&self, namespace: &str) -> KeyId {
        self.sealing(namespace).id
    }

    /// `answer`, sealed to `binding` with the newest key of its namespace.
    pub fn seal(&self, binding: &Binding<'_>, answer: &[u8]) -> Vec<u8> {
        let key = self.sealing(binding.key.namespace());
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let aad = binding.associated_data();
        let ciphertext = key
            .cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: answer,
                    aad: &aad,
                },
            )
            // Only a message beyond 256 GiB fails; answers are bounded far below.
            .expect("an answer within the cipher's limit");
        let mut sealed = Vec::with_capacity(HEADER_BYTES + ciphertext.len());
        sealed.extend_from_slice(&MAGIC);
        sealed.extend_from_slice(&key.id.0);
        sealed.extend_from_slice(&nonce);
        sealed.extend_from_slice(&ciphertext);
        sealed
    }

    /// The answer `sealed` holds, if it was sealed by one of our keys to
    /// this very `binding` and not altered since.
    pub fn open(&self, binding: &Binding<'_>, sealed: &[u8]) -> Result<Vec<u8>, Unsealable> {
        let id = Self::key_id(sealed)?;
        // Its namespace's keys, then the default ones (what sealed it
        // before the namespace had keys of its own).
        let key = self
            .namespaces
            .get(binding.key.namespace())
            .into_iter()
            .flatten()
            .chain(&self.keys)
            .find(|key| key.id == id)
            .ok_or(Unsealable::UnknownKey(id))?;
        let nonce = XNonce::from_slice(&sealed[MAGIC.len() + ID_BYTES..HEADER_BYTES]);
        let aad = binding.associated_data();
        key.cipher
            .decrypt(
                nonce,
                Payload {
                    msg: &sealed[HEADER_BYTES..],
                    aad: &aad,
                },
            )
            .map_err(|_| Unsealable::Forged)
    }

    /// The ID of the key `sealed` was sealed with.
    pub fn key_id(sealed: &[u8]) -> Result<KeyId, Unsealable> {
        if !looks_sealed(sealed) {
            return Err(Unsealable::NotSealed);
        }
        let mut id = [0; ID_BYTES];
        id.copy_from_slice(&sealed[MAGIC.len()..MAGIC.len() + ID_BYTES]);
        Ok(KeyId(id))
    }
}

/// Whether `answer` is in the sealed format (not whether it opens).
pub fn looks_sealed(answer: &[u8]) -> bool {
    answer.len() >= OVERHEAD_BYTES && answer[..MAGIC.len()] == MAGIC
}

impl SealingKey {
    fn new(key: &[u8; KEY_BYTES], source: PathBuf) -> Self {
        SealingKey {
            id: KeyId::of(key),
            cipher: XChaCha20Poly1305::new(key.into()),
            source,
        }
    }
}

/// What a sealed answer is bound to: the record it was committed to.
#[derive(Debug, Clone, Copy)]
pub struct Binding<'a> {
    /// The record's key.
    pub key: &'a Key,
    /// The lease token of the claim that committed it.
    pub lease_token: LeaseToken,
}

impl Binding<'_> {
    /// Each part length-prefixed, so no two bindings share their bytes.
    fn associated_data(&self) -> Vec<u8> {
        let namespace = self.key.namespace().as_bytes();
        let id = self.key.correlation_id().as_bytes();
        let mut aad = Vec::with_capacity(32 + namespace.len() + id.len());
        aad.extend_from_slice(b"dedupd answer v1\0");
        for part in [namespace, id] {
            aad.extend_from_slice(&(part.len() as u32).to_be_bytes());
            aad.extend_from_slice(part);
        }
        aad.extend_from_slice(&self.lease_token.0.to_be_bytes());
        aad
    }
}

/// Every key file `paths` name (files, or directories' visible files), in
/// file-name order; `flag` names them in errors.
fn read_keys(flag: &str, paths: &[PathBuf]) -> Result<Vec<SealingKey>, String> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let entries =
                std::fs::read_dir(path).map_err(|e| format!("--{flag} {}: {e}", path.display()))?;
            for entry in entries {
                let entry = entry.map_err(|e| format!("--{flag} {}: {e}", path.display()))?;
                // A Secret mount's `..data` and timestamped directories.
                let hidden = entry.file_name().to_string_lossy().starts_with('.');
                if !hidden && entry.path().is_file() {
                    files.push(entry.path());
                }
            }
        } else {
            files.push(path.clone());
        }
    }
    // The newest seals: name files so that a later one sorts last
    // (`2026-12.key`, `2027-03.key`).
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()).then(a.cmp(b)));
    files
        .into_iter()
        .map(|file| {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| format!("--{flag} {}: {e}", file.display()))?;
            let key = parse_key(&text)
                .map_err(|problem| format!("--{flag} {}: {problem}", file.display()))?;
            Ok(SealingKey::new(&key, file))
        })
        .collect()
}

/// A key file's text: 32 bytes as base64 (standard or URL-safe, padded or
/// not) or as 64 hexadecimal digits, surrounding whitespace ignored.
fn parse_key(text: &str) -> Result<[u8; KEY_BYTES], String> {
    let text = text.trim();
    let bytes = if text.len() == 2 * KEY_BYTES && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        (0..KEY_BYTES)
            .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|e| e.to_string())?
    } else {
        let engines = [
            &base64::engine::general_purpose::STANDARD,
            &base64::engine::general_purpose::STANDARD_NO_PAD,
            &base64::engine::general_purpose::URL_SAFE,
            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
        ];
        engines
            .iter()
            .find_map(|engine| engine.decode(text).ok())
            .ok_or("is neither base64 nor 64 hexadecimal digits (write one with `openssl rand -base64 32`)")?
    };
    bytes.try_into().map_err(|bytes: Vec<u8>| {
        format!(
            "holds {} bytes, a key is {KEY_BYTES} (write one with `openssl rand -base64 32`)",
            bytes.len()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(namespace: &str, id: &str) -> Key {
        Key::new_unchecked(namespace.into(), id.into())
    }

    fn ring(keys: &[[u8; KEY_BYTES]]) -> Keyring {
        Keyring::from_bytes(keys).unwrap()
    }

    #[test]
    fn an_answer_opens_only_where_it_was_sealed() {
        let keys = ring(&[[7; KEY_BYTES]]);
        let order = key("payments", "o-1");
        let here = Binding {
            key: &order,
            lease_token: LeaseToken(1),
        };
        let sealed = keys.seal(&here, b"card 4242");
        assert_eq!(sealed.len(), b"card 4242".len() + OVERHEAD_BYTES);
        assert!(!sealed.windows(4).any(|w| w == b"4242"));
        assert_eq!(keys.open(&here, &sealed).unwrap(), b"card 4242");

        let other_key = key("payments", "o-2");
        let other_namespace = key("refunds", "o-1");
        for elsewhere in [
            Binding {
                key: &other_key,
                lease_token: LeaseToken(1),
            },
            Binding {
                key: &other_namespace,
                lease_token: LeaseToken(1),
            },
            Binding {
                key: &order,
                lease_token: LeaseToken(2),
            },
        ] {
            assert_eq!(keys.open(&elsewhere, &sealed), Err(Unsealable::Forged));
        }
        for index in 0..sealed.len() {
            let mut flipped = sealed.clone();
            flipped[index] ^= 0x01;
            assert!(keys.open(&here, &flipped).is_err(), "byte {index} flipped");
        }
        assert_eq!(keys.open(&here, b"card 4242"), Err(Unsealable::NotSealed));
        assert!(looks_sealed(&sealed));
        assert!(!looks_sealed(b"card 4242"));
    }

    #[test]
    fn the_last_key_seals_and_every_key_opens() {
        let old = ring(&[[1; KEY_BYTES]]);
        let rotated = ring(&[[1; KEY_BYTES], [2; KEY_BYTES]]);
        let order = key("payments", "o-1");
        let binding = Binding {
            key: &order,
            lease_token: LeaseToken(9),
        };
        let before = old.seal(&binding, b"old answer");
        let after = rotated.seal(&binding, b"new answer");
        assert_eq!(rotated.open(&binding, &before).unwrap(), b"old answer");
        assert_eq!(Keyring::key_id(&after).unwrap(), rotated.sealing_id());
        assert_ne!(rotated.sealing_id(), old.sealing_id());
        assert_eq!(
            old.open(&binding, &after),
            Err(Unsealable::UnknownKey(rotated.sealing_id()))
        );
        // Two seals of one answer differ (a fresh nonce each).
        assert_ne!(rotated.seal(&binding, b"x"), rotated.seal(&binding, b"x"));
    }

    #[test]
    fn key_files_as_openssl_writes_them() {
        let bytes: [u8; KEY_BYTES] = core::array::from_fn(|i| i as u8 * 7);
        let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(parse_key(&format!("{b64}\n")).unwrap(), bytes);
        assert_eq!(parse_key(&format!("  {hex}\n")).unwrap(), bytes);
        assert_eq!(parse_key(&hex.to_uppercase()).unwrap(), bytes);
        let short = base64::engine::general_purpose::STANDARD.encode([1u8; 16]);
        assert!(parse_key(&short).unwrap_err().contains("holds 16 bytes"));
        assert!(parse_key("not a key!")
            .unwrap_err()
            .contains("neither base64"));
        assert!(parse_key("").is_err());
        assert!(Keyring::from_bytes(&[]).is_err());
        assert!(Keyring::from_bytes(&[[3; KEY_BYTES], [3; KEY_BYTES]])
            .unwrap_err()
            .contains("the same key"));
    }

    /// A Kubernetes Secret mount: each key a symlink into `..data`; the
    /// hidden entries are skipped and the name sorting last seals.
    #[test]
    fn a_secret_mount_is_a_keyring() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("..2026_12_07_19_00_00.1");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("2026-12.key"), format!("{}\n", "11".repeat(32))).unwrap();
        std::fs::write(data.join("2027-03.key"), "22".repeat(32)).unwrap();
        std::os::unix::fs::symlink(&data, dir.path().join("..data")).unwrap();
        for name in ["2026-12.key", "2027-03.key"] {
            std::os::unix::fs::symlink(format!("..data/{name}"), dir.path().join(name)).unwrap();
        }
        let keys = Keyring::load(&[dir.path().to_owned()]).unwrap();
        assert_eq!(keys.ids().len(), 2);
        assert_eq!(keys.sealing_id(), KeyId::of(&[0x22; KEY_BYTES]));
        assert_eq!(keys.ids()[0], KeyId::of(&[0x11; KEY_BYTES]));
    }
}
