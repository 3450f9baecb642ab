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

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::PathBuf,
    str::FromStr,
};

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
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
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

impl FromStr for KeyId {
    type Err = String;

    /// 16 hexadecimal digits, as the start-up log and errors print an ID.
    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.len() != 2 * ID_BYTES || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "{text:?} is not a key ID (16 hexadecimal digits, as the start-up log prints them)"
            ));
        }
        let mut id = [0; ID_BYTES];
        for (index, byte) in id.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * index..2 * index + 2], 16)
                .map_err(|e| e.to_string())?;
        }
        Ok(KeyId(id))
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
/// answer: a damaged answer is not replayed, and not claimed afresh either —
/// except [`Unsealable::Erased`], a documented state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsealable {
    /// Not in the sealed format (written in plaintext, or its header altered).
    #[error("is not sealed (written before encryption was on, or altered)")]
    NotSealed,
    /// Sealed with a key that is neither configured nor declared erased: a
    /// wrong or missing Secret, a key removed too early, or an altered key
    /// ID. An error, so a misconfiguration never reads as empty answers.
    #[error(
        "was sealed with key {0}, which this sidecar does not have: mount it \
         (--encryption-key-file or --decryption-key-file); only if it was destroyed on \
         purpose, declare it so (--erased-key-id {0})"
    )]
    UnknownKey(KeyId),
    /// Sealed with a key declared destroyed (`--erased-key-id`): the answer
    /// is erased on purpose (crypto-shredding).
    #[error("was sealed with key {0}, which is declared erased")]
    Erased(KeyId),
    /// The key is ours but the ciphertext does not authenticate: altered, or
    /// copied from another record (or from another namespace's key).
    #[error("failed its integrity check (altered, or copied from another record)")]
    Forged,
}

/// Where a keyring's keys come from (the command line's key flags).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyFiles {
    /// `--encryption-key-file`: the file name sorting last seals, all open.
    pub sealing: Vec<PathBuf>,
    /// `--decryption-key-file`: open only (the first step of a rotation on
    /// a shared store, or every key once sealing is turned off).
    pub opening: Vec<PathBuf>,
    /// `--namespace-key NAMESPACE=FILE`: a namespace's own sealing keys.
    pub namespace_sealing: Vec<(String, PathBuf)>,
    /// `--namespace-decryption-key NAMESPACE=FILE`: a namespace's own keys
    /// that only open.
    pub namespace_opening: Vec<(String, PathBuf)>,
    /// `--erased-key-id`: keys destroyed on purpose; what they sealed reads
    /// as erased.
    pub erased: Vec<KeyId>,
}

impl KeyFiles {
    /// No key flag given: answers are stored as they are.
    pub fn is_empty(&self) -> bool {
        self == &KeyFiles::default()
    }
}

/// One group of keys: those that seal (the last does) and those that only
/// open.
#[derive(Default)]
struct Keys {
    /// In file-name order; the last seals.
    sealing: Vec<SealingKey>,
    opening: Vec<SealingKey>,
}

impl Keys {
    fn all(&self) -> impl Iterator<Item = &SealingKey> {
        self.sealing.iter().chain(&self.opening)
    }
}

/// The keys answers are sealed and opened with.
pub struct Keyring {
    /// Every namespace's, unless it has its own.
    keys: Keys,
    /// Namespaces with keys of their own (`--namespace-key`): the last
    /// seals that namespace's answers, and removing them (and declaring
    /// them erased) erases those answers while every other namespace keeps
    /// working.
    namespaces: BTreeMap<String, Keys>,
    /// Keys destroyed on purpose.
    erased: BTreeSet<KeyId>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("keys", &self.ids())
            .field("seals_with", &self.keys.sealing.last().map(|key| key.id))
            .field("namespaces", &self.namespaces.keys().collect::<Vec<_>>())
            .field("erased", &self.erased)
            .finish()
    }
}

impl Keyring {
    /// Reads every key file `files` name: each path is a file, or a
    /// directory whose visible regular files (a Secret mount's `..data`
    /// links are skipped) are each a key; a namespace's files are sorted
    /// together, whatever order they were given in. `None` when no key flag
    /// is given. The error is one line naming the file.
    pub fn load(files: &KeyFiles) -> Result<Option<Keyring>, String> {
        if files.is_empty() {
            return Ok(None);
        }
        if !files.namespace_sealing.is_empty() && files.sealing.is_empty() {
            return Err(
                "--namespace-key needs --encryption-key-file (the key of every other namespace)"
                    .into(),
            );
        }
        let mut namespaces: BTreeMap<String, Keys> = BTreeMap::new();
        for (flag, given, opening) in [
            ("namespace-key", &files.namespace_sealing, false),
            ("namespace-decryption-key", &files.namespace_opening, true),
        ] {
            let mut paths: BTreeMap<&str, Vec<PathBuf>> = BTreeMap::new();
            for (namespace, path) in given {
                paths.entry(namespace).or_default().push(path.clone());
            }
            for (namespace, paths) in paths {
                let keys = read_keys(&format!("{flag} {namespace}"), &paths)?;
                if keys.is_empty() {
                    return Err(format!("--{flag} {namespace} names no key file"));
                }
                let group = namespaces.entry(namespace.to_owned()).or_default();
                if opening {
                    group.opening = keys;
                } else {
                    group.sealing = keys;
                }
            }
        }
        let mut keyring = Keyring {
            keys: Keys {
                sealing: read_keys("encryption-key-file", &files.sealing)?,
                opening: read_keys("decryption-key-file", &files.opening)?,
            },
            namespaces,
            erased: files.erased.iter().copied().collect(),
        };
        if !files.sealing.is_empty() && keyring.keys.sealing.is_empty() {
            return Err("--encryption-key-file names no key file".into());
        }
        if !files.opening.is_empty() && keyring.keys.opening.is_empty() {
            return Err("--decryption-key-file names no key file".into());
        }
        // A key given both ways seals: the second step of a rotation (the
        // new key moved from the opening keys into the sealing ones) passes
        // through that state while a pod restarts between two Secret edits.
        for group in std::iter::once(&mut keyring.keys).chain(keyring.namespaces.values_mut()) {
            let Keys { sealing, opening } = group;
            opening.retain(|key| !sealing.iter().any(|sealer| sealer.id == key.id));
        }
        keyring.check()?;
        Ok(Some(keyring))
    }

    /// A keyring of raw keys, the last sealing (tests, benchmarks).
    pub fn from_bytes(keys: &[[u8; KEY_BYTES]]) -> Result<Keyring, String> {
        if keys.is_empty() {
            return Err("--encryption-key-file names no key file".into());
        }
        let keyring = Keyring {
            keys: Keys {
                sealing: raw_keys("key", keys),
                opening: Vec::new(),
            },
            namespaces: BTreeMap::new(),
            erased: BTreeSet::new(),
        };
        keyring.check()?;
        Ok(keyring)
    }

    /// The same keys, and `namespace`'s own raw keys, the last sealing
    /// (tests, benchmarks).
    pub fn with_namespace_key_bytes(
        mut self,
        namespace: &str,
        keys: &[[u8; KEY_BYTES]],
    ) -> Result<Keyring, String> {
        let label = format!("{namespace} key");
        self.namespaces
            .entry(namespace.to_owned())
            .or_default()
            .sealing
            .extend(raw_keys(&label, keys));
        self.check()?;
        Ok(self)
    }

    /// The same keys, with `ids` declared erased (tests).
    pub fn with_erased(mut self, ids: &[KeyId]) -> Result<Keyring, String> {
        self.erased.extend(ids);
        self.check()?;
        Ok(self)
    }

    /// A keyring that seals nothing and opens nothing, with `ids` declared
    /// erased: sealing turned off, the old keys destroyed (tests).
    pub fn erased_only(ids: &[KeyId]) -> Keyring {
        Keyring {
            keys: Keys::default(),
            namespaces: BTreeMap::new(),
            erased: ids.iter().copied().collect(),
        }
    }

    /// No key twice (a namespace's key that is also another's, or the
    /// default's, would not erase its answers when removed), and no key
    /// both configured and declared erased.
    fn check(&self) -> Result<(), String> {
        let all: Vec<&SealingKey> = self
            .keys
            .all()
            .chain(self.namespaces.values().flat_map(Keys::all))
            .collect();
        for (index, key) in all.iter().enumerate() {
            if let Some(twin) = all[..index].iter().find(|other| other.id == key.id) {
                return Err(format!(
                    "{} holds the same key as {}",
                    key.source.display(),
                    twin.source.display()
                ));
            }
            if self.erased.contains(&key.id) {
                return Err(format!(
                    "{} holds key {}, which --erased-key-id declares destroyed",
                    key.source.display(),
                    key.id
                ));
            }
        }
        Ok(())
    }

    /// The keys that seal now: the default one and each namespace's.
    pub fn sealing_ids(&self) -> Vec<KeyId> {
        std::iter::once(&self.keys)
            .chain(self.namespaces.values())
            .filter_map(|keys| keys.sealing.last())
            .map(|key| key.id)
            .collect()
    }

    /// Every key held, sealing or opening, of every namespace.
    fn held_ids(&self) -> BTreeSet<KeyId> {
        self.keys
            .all()
            .chain(self.namespaces.values().flat_map(Keys::all))
            .map(|key| key.id)
            .collect()
    }

    /// Whether `id` is one of ours (sealing or opening, any namespace's)
    /// or declared erased: what the start-up check asks of every key the
    /// store holds answers under.
    pub fn knows(&self, id: KeyId) -> bool {
        self.erased.contains(&id) || self.held_ids().contains(&id)
    }

    /// Whether this keyring seals answers (it may only open them, or only
    /// know which keys were destroyed).
    pub fn seals(&self) -> bool {
        !self.keys.sealing.is_empty()
    }

    /// Each key's ID and what it does, for the start-up log line:
    /// `default: 1a2b… seals, 3c4d… opens; payments: …; erased: …`.
    pub fn describe(&self) -> String {
        let group = |keys: &Keys| {
            let last = keys.sealing.len().checked_sub(1);
            let described = keys
                .sealing
                .iter()
                .enumerate()
                .map(|(index, key)| {
                    let role = if Some(index) == last {
                        "seals"
                    } else {
                        "opens"
                    };
                    format!("{} {role}", key.id)
                })
                .chain(keys.opening.iter().map(|key| format!("{} opens", key.id)))
                .collect::<Vec<_>>()
                .join(", ");
            if described.is_empty() {
                "none".to_owned()
            } else {
                described
            }
        };
        std::iter::once(format!("default: {}", group(&self.keys)))
            .chain(
                self.namespaces
                    .iter()
                    .map(|(namespace, keys)| format!("{namespace}: {}", group(keys))),
            )
            .chain((!self.erased.is_empty()).then(|| {
                let ids: Vec<String> = self.erased.iter().map(KeyId::to_string).collect();
                format!("erased: {}", ids.join(", "))
            }))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The IDs of the default sealing keys, the sealing one last.
    pub fn ids(&self) -> Vec<KeyId> {
        self.keys.sealing.iter().map(|key| key.id).collect()
    }

    /// The key that seals `namespace`'s answers: its own newest, or the
    /// default newest.
    fn sealing(&self, namespace: &str) -> &SealingKey {
        self.namespaces
            .get(namespace)
            .and_then(|keys| keys.sealing.last())
            .or(self.keys.sealing.last())
            .expect("only a keyring that seals is asked to")
    }

    /// The ID of the key that seals answers of namespaces without keys of
    /// their own.
    pub fn sealing_id(&self) -> KeyId {
        self.keys.sealing.last().expect("a keyring that seals").id
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
        let own = self.namespaces.get(binding.key.namespace());
        let Some(key) = own
            .into_iter()
            .flat_map(Keys::all)
            .chain(self.keys.all())
            .find(|key| key.id == id)
        else {
            let elsewhere = self.namespaces.values().flat_map(Keys::all);
            return Err(if elsewhere.into_iter().any(|key| key.id == id) {
                // Another namespace's key: moved from one of its records.
                Unsealable::Forged
            } else if self.erased.contains(&id) {
                Unsealable::Erased(id)
            } else {
                Unsealable::UnknownKey(id)
            });
        };
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

/// The keyring in force: the engine takes the current one for each call,
/// and [`KeyringSlot::watch`] swaps in a new one when the key files change
/// (a Secret's keys added, rotated or removed), so no restart is needed.
#[derive(Debug)]
pub struct KeyringSlot {
    current: std::sync::RwLock<std::sync::Arc<Keyring>>,
}

impl KeyringSlot {
    /// A slot holding `keyring`.
    pub fn new(keyring: std::sync::Arc<Keyring>) -> Self {
        KeyringSlot {
            current: std::sync::RwLock::new(keyring),
        }
    }

    /// The keyring in force now.
    pub fn current(&self) -> std::sync::Arc<Keyring> {
        std::sync::Arc::clone(&self.current.read().expect("keyring lock"))
    }

    /// Reads `files` again; swaps the keyring in when keys were added or
    /// their roles changed (a new key that seals). Returns the new
    /// keyring's description when it swapped. Files that do not load (a
    /// Secret caught halfway through an update) keep the current keyring
    /// and are reported; so does a key gone from the files: removing a key
    /// takes a restart, since a local tier may still hold answers it
    /// sealed, and a key destroyed on purpose is declared by a flag.
    pub fn reload(&self, files: &KeyFiles) -> Result<Option<String>, String> {
        let loaded = Keyring::load(files)?.ok_or("no key flag given")?;
        let described = loaded.describe();
        let current = self.current();
        if current.describe() == described {
            return Ok(None);
        }
        if let Some(gone) = current.held_ids().difference(&loaded.held_ids()).next() {
            return Err(format!(
                "key {gone} is gone from the key files: a key is removed at the next restart"
            ));
        }
        *self.current.write().expect("keyring lock") = std::sync::Arc::new(loaded);
        Ok(Some(described))
    }

    /// Reloads from `files` every `interval`, for as long as the process
    /// runs (file reads off the runtime's threads).
    pub async fn watch(self: std::sync::Arc<Self>, files: KeyFiles, interval: std::time::Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let (slot, files) = (std::sync::Arc::clone(&self), files.clone());
            match tokio::task::spawn_blocking(move || slot.reload(&files)).await {
                Ok(Ok(Some(keys))) => tracing::info!(%keys, "sealing keys reloaded"),
                Ok(Ok(None)) => {}
                Ok(Err(problem)) => {
                    tracing::warn!(%problem, "sealing keys not reloaded; keeping the current ones")
                }
                Err(join) => tracing::warn!(%join, "sealing key reload task failed"),
            }
        }
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

/// Raw keys labelled `label 0`, `label 1`, … for messages.
fn raw_keys(label: &str, keys: &[[u8; KEY_BYTES]]) -> Vec<SealingKey> {
    keys.iter()
        .enumerate()
        .map(|(index, key)| SealingKey::new(key, PathBuf::from(format!("{label} {index}"))))
        .collect()
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
pub(crate) fn parse_key(text: &str) -> Result<[u8; KEY_BYTES], String> {
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
        let keys = Keyring::load(&KeyFiles {
            sealing: vec![dir.path().to_owned()],
            ..KeyFiles::default()
        })
        .unwrap()
        .expect("keys given");
        assert_eq!(keys.ids().len(), 2);
        assert_eq!(keys.sealing_id(), KeyId::of(&[0x22; KEY_BYTES]));
        assert_eq!(keys.ids()[0], KeyId::of(&[0x11; KEY_BYTES]));
    }

    /// A key ID that is not ours is an error unless declared erased; a key
    /// of another namespace is a forgery (the answer was moved), never
    /// erased; a flipped byte of the ID is no longer a key of ours.
    #[test]
    fn unknown_keys_are_errors_and_only_declared_ones_erased() {
        let payments_key = [4; KEY_BYTES];
        let keys = ring(&[[3; KEY_BYTES]])
            .with_namespace_key_bytes("payments", &[payments_key])
            .unwrap();
        let payment = key("payments", "p-1");
        let order = key("orders", "p-1");
        let at = |key| Binding {
            key,
            lease_token: LeaseToken(5),
        };
        let sealed = keys.seal(&at(&payment), b"answer");
        assert_eq!(
            Keyring::key_id(&sealed).unwrap(),
            keys.sealing_id_for("payments")
        );
        assert_eq!(keys.open(&at(&order), &sealed), Err(Unsealable::Forged));
        let mut flipped = sealed.clone();
        flipped[MAGIC.len()] ^= 0x80;
        let flipped_id = Keyring::key_id(&flipped).unwrap();
        assert_eq!(
            keys.open(&at(&payment), &flipped),
            Err(Unsealable::UnknownKey(flipped_id))
        );

        let payments_id = keys.sealing_id_for("payments");
        let without = ring(&[[3; KEY_BYTES]]);
        assert_eq!(
            without.open(&at(&payment), &sealed),
            Err(Unsealable::UnknownKey(payments_id))
        );
        let declared = ring(&[[3; KEY_BYTES]]).with_erased(&[payments_id]).unwrap();
        assert_eq!(
            declared.open(&at(&payment), &sealed),
            Err(Unsealable::Erased(payments_id))
        );
        assert_eq!(
            Keyring::erased_only(&[payments_id]).open(&at(&payment), &sealed),
            Err(Unsealable::Erased(payments_id))
        );
        assert!(
            ring(&[[3; KEY_BYTES]])
                .with_namespace_key_bytes("payments", &[payments_key])
                .unwrap()
                .with_erased(&[payments_id])
                .is_err(),
            "a key held is not declared erased"
        );
        assert_eq!(payments_id.to_string().parse::<KeyId>(), Ok(payments_id));
        assert!("xyz".parse::<KeyId>().is_err());
    }

    /// Open-only keys open and never seal; a namespace's files sort
    /// together by name whatever order the flags came in.
    #[test]
    fn keys_that_only_open_and_namespace_files_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, byte: u8| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("{byte:02x}").repeat(KEY_BYTES)).unwrap();
            path
        };
        let default = write("default.key", 1);
        let next = write("next.key", 2);
        let (late, early) = (write("2027.key", 3), write("2026.key", 4));
        let payments_old = write("payments-old.key", 5);
        let files = KeyFiles {
            sealing: vec![default],
            opening: vec![next],
            namespace_sealing: vec![("payments".into(), late), ("payments".into(), early)],
            namespace_opening: vec![("payments".into(), payments_old)],
            erased: Vec::new(),
        };
        let keys = Keyring::load(&files).unwrap().unwrap();
        let id = |byte| KeyId::of(&[byte; KEY_BYTES]);
        assert_eq!(keys.sealing_id(), id(1), "an open-only key never seals");
        assert_eq!(
            keys.sealing_id_for("payments"),
            id(3),
            "2027.key sorts last"
        );
        let old_seal = ring(&[[2; KEY_BYTES]]);
        let order = key("orders", "o-1");
        let binding = Binding {
            key: &order,
            lease_token: LeaseToken(1),
        };
        let sealed = old_seal.seal(&binding, b"sealed by the next key");
        assert_eq!(
            keys.open(&binding, &sealed).unwrap(),
            b"sealed by the next key"
        );
        assert!(keys.describe().contains(&format!("{} seals", id(1))));
        assert!(keys.describe().contains(&format!("{} opens", id(2))));

        // The sealing key also given as an opening key: it seals.
        let both_ways = KeyFiles {
            opening: vec![files.sealing[0].clone()],
            ..files.clone()
        };
        let keys = Keyring::load(&both_ways).unwrap().unwrap();
        assert_eq!(keys.sealing_id(), id(1));
        let erased_and_held = KeyFiles {
            erased: vec![id(1)],
            ..files
        };
        assert!(Keyring::load(&erased_and_held)
            .unwrap_err()
            .contains("declares destroyed"));
    }
}
