//! Reads the secrets and certificates the configuration names — bearer
//! tokens and TLS material — once, at start, before anything is bound. A
//! problem is one line for the exit-64 message; a token never appears in it.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::guard::Tokens;

/// Shortest token accepted: guessing must not be an option.
const MIN_TOKEN_BYTES: usize = 16;

/// Where one token comes from: a file (recommended) or the environment.
#[derive(Clone, Default)]
pub struct TokenSource {
    /// `--*-token-file`.
    pub file: Option<PathBuf>,
    /// The token itself, from a `DEDUPD_*_TOKEN` variable.
    pub value: Option<String>,
}

impl std::fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSource")
            .field("file", &self.file)
            .field("value", &self.value.as_ref().map(|_| "redacted"))
            .finish()
    }
}

impl TokenSource {
    /// Whether a token is configured at all (it may still fail to load).
    pub fn is_set(&self) -> bool {
        self.file.is_some() || self.value.is_some()
    }

    fn load(&self, kind: &str) -> Result<Option<String>, String> {
        let token = match (&self.file, &self.value) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "give the {kind} token as a file or in the environment, not both"
                ))
            }
            (Some(file), None) => std::fs::read_to_string(file)
                .map_err(|e| format!("--{kind}-token-file {}: {e}", file.display()))?
                .trim_end_matches(['\r', '\n'])
                .to_owned(),
            (None, Some(value)) => value.clone(),
            (None, None) => return Ok(None),
        };
        if token.len() < MIN_TOKEN_BYTES {
            return Err(format!(
                "the {kind} token must be at least {MIN_TOKEN_BYTES} bytes"
            ));
        }
        if token.chars().any(|c| c.is_control() || c == ' ') {
            return Err(format!(
                "the {kind} token must not contain spaces or control characters"
            ));
        }
        Ok(Some(token))
    }
}

/// Where the shared store's URL comes from: a flag or variable, or a file
/// (for a URL that carries a password, e.g. a mounted Secret).
#[derive(Clone, Default)]
pub struct StoreUrlSource {
    /// `--store-url` / `DEDUPD_STORE_URL`.
    pub value: Option<String>,
    /// `--store-url-file`.
    pub file: Option<PathBuf>,
}

impl std::fmt::Debug for StoreUrlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreUrlSource")
            .field(
                "value",
                &self
                    .value
                    .as_deref()
                    .map(crate::store::postgres::redact_url),
            )
            .field("file", &self.file)
            .finish()
    }
}

impl StoreUrlSource {
    /// The URL, checked by `check`; the problem in one line without the
    /// password.
    pub fn load(&self, check: impl Fn(&str) -> Result<(), String>) -> Result<String, String> {
        let url = match (&self.value, &self.file) {
            (Some(_), Some(_)) => {
                return Err("give --store-url or --store-url-file, not both".into())
            }
            (Some(url), None) => url.clone(),
            (None, Some(file)) => std::fs::read_to_string(file)
                .map_err(|e| format!("--store-url-file {}: {e}", file.display()))?
                .trim()
                .to_owned(),
            (None, None) => {
                return Err("a shared --store needs --store-url or --store-url-file".into())
            }
        };
        check(&url).map_err(|problem| format!("--store-url {problem}"))?;
        Ok(url)
    }
}

/// The client token and the admin token.
#[derive(Debug, Clone, Default)]
pub struct AuthSources {
    /// Opens every call.
    pub client: TokenSource,
    /// Also opens `Forget`.
    pub admin: TokenSource,
}

impl AuthSources {
    /// The tokens, or `None` when calls are not authenticated.
    pub fn load(&self) -> Result<Option<Tokens>, String> {
        match (self.client.load("auth")?, self.admin.load("admin")?) {
            (Some(client), admin) => Ok(Some(Tokens::new(&client, admin.as_deref()))),
            (None, Some(_)) => {
                Err("an admin token needs a client token too (--auth-token-file)".into())
            }
            (None, None) => Ok(None),
        }
    }
}

/// The PEM files of TLS on the TCP listeners.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// CA bundle clients' certificates must chain to (mTLS), if any.
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// Reads the files and builds the configuration the server will use,
    /// once, so a bad certificate or key is a configuration error (exit 64)
    /// and not a failure after binding.
    pub fn load(&self) -> Result<ServerTlsConfig, String> {
        let identity = Identity::from_pem(
            read_pem_file("tls-cert", &self.cert)?,
            read_pem_file("tls-key", &self.key)?,
        );
        let mut tls = ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.client_ca {
            tls = tls.client_ca_root(Certificate::from_pem(read_pem_file("tls-client-ca", ca)?));
        }
        tonic::transport::Server::builder()
            .tls_config(tls.clone())
            .map_err(|e| format!("TLS configuration rejected: {}", source_chain(&e)))?;
        Ok(tls)
    }
}

/// Reads a PEM file named by `--{flag}`; the problem in one line.
pub fn read_pem_file(flag: &str, path: &Path) -> Result<Vec<u8>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("--{flag} {}: {e}", path.display()))?;
    if !pem.windows(11).any(|window| window == b"-----BEGIN ") {
        return Err(format!("--{flag} {}: not a PEM file", path.display()));
    }
    Ok(pem)
}

fn source_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
