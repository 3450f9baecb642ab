//! The injector's serving certificate, reloaded when its files change, so a
//! rotated Secret (cert-manager renews before expiry) needs no restart.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use rustls::{
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};

/// The certificate and key files, and what was last loaded from them.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    /// The files' bytes, to notice a change without parsing.
    files: (Vec<u8>, Vec<u8>),
    key: Arc<CertifiedKey>,
}

impl ReloadingCert {
    /// Loads the pair; an error is one line naming the file.
    pub fn load(cert_path: PathBuf, key_path: PathBuf) -> Result<ReloadingCert, String> {
        let loaded = read_pair(&cert_path, &key_path)?;
        Ok(ReloadingCert {
            cert_path,
            key_path,
            current: RwLock::new(loaded),
        })
    }

    /// Reads the files again; swaps the certificate in when they changed
    /// and parse. Returns whether it swapped. A broken pair (a rotation
    /// caught halfway) keeps the old certificate and is reported.
    pub fn reload(&self) -> Result<bool, String> {
        let cert = std::fs::read(&self.cert_path)
            .map_err(|e| format!("--tls-cert {}: {e}", self.cert_path.display()))?;
        let key = std::fs::read(&self.key_path)
            .map_err(|e| format!("--tls-key {}: {e}", self.key_path.display()))?;
        if self.current.read().expect("cert lock").files == (cert.clone(), key.clone()) {
            return Ok(false);
        }
        let loaded = parse_pair(&self.cert_path, cert, &self.key_path, key)?;
        *self.current.write().expect("cert lock") = loaded;
        Ok(true)
    }

    /// Reloads every `interval`, for as long as the process runs.
    pub async fn watch(self: Arc<Self>, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let this = Arc::clone(&self);
            match tokio::task::spawn_blocking(move || this.reload()).await {
                Ok(Ok(true)) => tracing::info!("serving certificate reloaded"),
                Ok(Ok(false)) => {}
                Ok(Err(problem)) => {
                    tracing::warn!(%problem, "serving certificate not reloaded; keeping the current one")
                }
                Err(join) => tracing::warn!(%join, "certificate reload task failed"),
            }
        }
    }

    /// A rustls server configuration that always serves the current pair.
    pub fn server_config(self: &Arc<Self>) -> rustls::ServerConfig {
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_no_client_auth()
        .with_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        config
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.current.read().expect("cert lock").key))
    }
}

fn read_pair(cert_path: &Path, key_path: &Path) -> Result<Loaded, String> {
    let cert = crate::credentials::read_pem_file("tls-cert", cert_path)?;
    let key = crate::credentials::read_pem_file("tls-key", key_path)?;
    parse_pair(cert_path, cert, key_path, key)
}

fn parse_pair(
    cert_path: &Path,
    cert: Vec<u8>,
    key_path: &Path,
    key: Vec<u8>,
) -> Result<Loaded, String> {
    let chain = CertificateDer::pem_slice_iter(&cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("--tls-cert {}: {e}", cert_path.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "--tls-cert {}: no certificate in it",
            cert_path.display()
        ));
    }
    let private = PrivateKeyDer::from_pem_slice(&key)
        .map_err(|e| format!("--tls-key {}: {e}", key_path.display()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&private)
        .map_err(|e| format!("--tls-key {}: {e}", key_path.display()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|e| {
        format!(
            "--tls-key {} does not belong to --tls-cert {}: {e}",
            key_path.display(),
            cert_path.display()
        )
    })?;
    Ok(Loaded {
        files: (cert, key),
        key: Arc::new(certified),
    })
}
