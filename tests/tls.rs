//! TLS and mTLS on the TCP listener: certificates made on the fly by rcgen,
//! a trusted client accepted, an untrusted or plaintext one rejected.

mod common;

use common::*;
use dedupd::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity, ServerTlsConfig};

struct Pki {
    ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    fn new() -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let ca_pem = params.self_signed(&key).unwrap().pem();
        Pki {
            ca_pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// (certificate PEM, key PEM) for `name`, signed by this CA.
    fn leaf(&self, name: &str) -> (String, String) {
        let params = CertificateParams::new(vec![name.to_owned()]).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

async fn start(tls: ServerTlsConfig) -> TestServer {
    TestServer::builder()
        .config(|config| config.tls = Some(tls))
        .start()
        .await
}

/// Why a TLS client got no answer.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// The connection (TLS handshake, then HTTP/2) never came up.
    Connect,
    /// The connection came up, the call failed with this code.
    Call(tonic::Code),
}

async fn try_claim(
    channel: Result<Channel, tonic::transport::Error>,
) -> Result<pb::ClaimOutcome, Refused> {
    let channel = channel.map_err(|_| Refused::Connect)?;
    let response = ClaimAndCommitClient::new(channel)
        .claim(claim_request("tls-1"))
        .await
        .map_err(|status| Refused::Call(status.code()))?;
    Ok(outcome(&response.into_inner()))
}

/// The connection was refused below gRPC: the handshake failed, or the
/// server dropped the connection so the call found no transport (TLS 1.3
/// lets a client finish its handshake before the server checks the client's
/// certificate). Never an answer, never another gRPC error.
fn refused_by_transport(result: Result<pb::ClaimOutcome, Refused>) {
    assert!(
        matches!(
            result,
            Err(Refused::Connect | Refused::Call(tonic::Code::Unknown | tonic::Code::Unavailable))
        ),
        "{result:?}"
    );
}

async fn connect(
    port: u16,
    tls: Option<ClientTlsConfig>,
) -> Result<Channel, tonic::transport::Error> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Channel::from_shared(format!("{scheme}://localhost:{port}")).unwrap();
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls)?;
    }
    endpoint.connect().await
}

#[tokio::test]
async fn mutual_tls_accepts_only_clients_the_ca_signed() {
    let pki = Pki::new();
    let (server_cert, server_key) = pki.leaf("localhost");
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(server_cert, server_key))
        .client_ca_root(Certificate::from_pem(&pki.ca_pem));
    let server = start(tls).await;
    let port = server.addr.port();
    let trusting = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");

    let (client_cert, client_key) = pki.leaf("consumer");
    let with_identity = trusting
        .clone()
        .identity(Identity::from_pem(client_cert, client_key));
    assert_eq!(
        try_claim(connect(port, Some(with_identity)).await).await,
        Ok(pb::ClaimOutcome::Claimed)
    );

    // A client certificate from another CA, or none at all, is refused.
    let stranger_pki = Pki::new();
    let (stranger_cert, stranger_key) = stranger_pki.leaf("stranger");
    let stranger = trusting
        .clone()
        .identity(Identity::from_pem(stranger_cert, stranger_key));
    refused_by_transport(try_claim(connect(port, Some(stranger)).await).await);
    refused_by_transport(try_claim(connect(port, Some(trusting)).await).await);
    // Plaintext gets nowhere either.
    refused_by_transport(try_claim(connect(port, None).await).await);
    server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn server_only_tls_is_verified_by_the_client() {
    let pki = Pki::new();
    let (server_cert, server_key) = pki.leaf("localhost");
    let server =
        start(ServerTlsConfig::new().identity(Identity::from_pem(server_cert, server_key))).await;
    let port = server.addr.port();
    let trusting = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");
    assert_eq!(
        try_claim(connect(port, Some(trusting)).await).await,
        Ok(pb::ClaimOutcome::Claimed)
    );
    // A client that does not trust the server's CA refuses the handshake.
    let other = Pki::new();
    let distrusting = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&other.ca_pem))
        .domain_name("localhost");
    refused_by_transport(try_claim(connect(port, Some(distrusting)).await).await);
    server.stop().await.expect("clean stop");
}
