//! How to reach PostgreSQL: the URL (checked, and shown without its
//! password), the schema name, and TLS with rustls.

use std::{fmt, str::FromStr, sync::Arc, time::Duration};

use rustls::pki_types::{pem::PemObject, CertificateDer};

use crate::error::Error;

/// How to reach PostgreSQL.
#[derive(Clone)]
pub struct PostgresConfig {
    /// `postgres://user:password@host:port/database?…` (never logged).
    pub url: String,
    /// The schema holding dedupd's tables (created if missing).
    pub schema: String,
    /// Connections in the pool.
    pub pool_size: usize,
    /// Longest one statement may run on the server.
    pub statement_timeout: Duration,
    /// PEM certificates to trust for the server's TLS certificate instead of
    /// the system's roots (a private CA, or the server's own certificate).
    pub ca_pem: Option<Vec<u8>>,
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &redact_url(&self.url))
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
            .field("statement_timeout", &self.statement_timeout)
            .field("private_ca", &self.ca_pem.is_some())
            .finish()
    }
}

/// The URL without its password (in the authority or a `password=`
/// parameter), for logs and errors.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (location, query) = match rest.split_once('?') {
        Some((location, query)) => (location, Some(query)),
        None => (rest, None),
    };
    let location = match location.rsplit_once('@') {
        Some((credentials, host)) if credentials.contains(':') => {
            let user = credentials.split(':').next().unwrap_or_default();
            format!("{user}:…@{host}")
        }
        _ => location.to_owned(),
    };
    let query = query.map(|query| {
        query
            .split('&')
            .map(|pair| {
                if pair.starts_with("password=") {
                    "password=…"
                } else {
                    pair
                }
            })
            .collect::<Vec<_>>()
            .join("&")
    });
    match query {
        Some(query) => format!("{scheme}://{location}?{query}"),
        None => format!("{scheme}://{location}"),
    }
}

/// Checks a URL the way the store will use it; the problem, if any, in one
/// line without the password.
pub fn check_url(url: &str) -> Result<(), String> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(format!(
            "{} is not a postgres:// or postgresql:// URL",
            redact_url(url)
        ));
    }
    tokio_postgres::Config::from_str(url)
        .map(|_| ())
        .map_err(|error| format!("{}: {error}", redact_url(url)))
}

/// Checks a schema name: a plain lower-case SQL identifier, so it can be
/// written into statements as it is.
pub fn check_schema(schema: &str) -> Result<(), String> {
    let mut chars = schema.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    if first_ok
        && schema.len() <= 63
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        Ok(())
    } else {
        Err(format!(
            "{schema:?} is not a schema name (a-z, 0-9 and _, at most 63 bytes, not starting with a digit)"
        ))
    }
}

/// TLS to the server with rustls, for a URL with `sslmode=require`: the
/// server's certificate is verified against `ca_pem`, or else the system's
/// roots.
pub(super) fn tls_config(ca_pem: Option<&[u8]>) -> Result<rustls::ClientConfig, Error> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            for certificate in CertificateDer::pem_slice_iter(pem) {
                let certificate = certificate
                    .map_err(|error| Error::Store(format!("--store-ca-file: {error}")))?;
                roots
                    .add(certificate)
                    .map_err(|error| Error::Store(format!("--store-ca-file: {error}")))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                tracing::warn!(
                    "no system root certificates: TLS to PostgreSQL needs --store-ca-file"
                );
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| Error::Store(format!("TLS: {error}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_leave_the_url() {
        for (url, shown) in [
            (
                "postgres://app:s3cret@db:5432/dedup",
                "postgres://app:…@db:5432/dedup",
            ),
            (
                "postgresql://db/dedup?user=app&password=s3cret&sslmode=require",
                "postgresql://db/dedup?user=app&password=…&sslmode=require",
            ),
            ("postgres://app@db/dedup", "postgres://app@db/dedup"),
        ] {
            assert_eq!(redact_url(url), shown);
            assert!(!redact_url(url).contains("s3cret"));
        }
        let refused = check_url("postgres://app:s3cret@db:notaport/x").unwrap_err();
        assert!(!refused.contains("s3cret"), "{refused}");
        assert!(check_url("mysql://app@db/x").is_err());
        assert!(check_url("postgres://postgres@127.0.0.1:5432/test").is_ok());
    }

    #[test]
    fn schema_names_are_plain_identifiers() {
        assert!(check_schema("dedupd").is_ok());
        assert!(check_schema("dedupd_test_42").is_ok());
        for bad in ["", "1abc", "has space", "Upper", "x;drop", &"a".repeat(64)] {
            assert!(check_schema(bad).is_err(), "{bad:?}");
        }
    }
}
