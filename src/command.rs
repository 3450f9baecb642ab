//! The command line as a whole: the top-level parser and one command per
//! face, each face's flags living with the face — the server's and the
//! HTTP proxy's in [`crate::config`], the injector's in [`crate::inject`],
//! the client's in [`crate::cli`]. Only `main` (and the fuzz checks) parse
//! here; nothing inside dedupd imports this module, so no face depends on
//! another through it.

use clap::{Parser, Subcommand};

use crate::{cli::ClientCommand, config::ServeArgs, inject::InjectArgs};

/// dedupd: a deduplication sidecar. Without a command it runs the server;
/// with one it is a client of a running server.
#[derive(Debug, Parser)]
#[command(name = "dedupd", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// Server settings (when no command is given).
    #[command(flatten)]
    pub serve: ServeArgs,
    /// A client command.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What to do.
#[derive(Debug, Subcommand)]
#[allow(
    clippy::large_enum_variant,
    reason = "parsed once at start; boxing would only add an allocation"
)]
pub enum Command {
    /// Run the sidecar (the default when no command is given).
    Serve(ServeArgs),
    /// Run the HTTP idempotency proxy in front of a service: requests with
    /// an Idempotency-Key header run once, retries get the stored response.
    /// The store flags are the server's; gRPC is off unless --grpc-listen.
    #[command(
        mut_arg("listen", |arg| arg
            .long("grpc-listen")
            .env("DEDUPD_GRPC_LISTEN")
            .default_value(None::<&str>)
            .help("Also serve dedupd's gRPC API here (HOST:PORT and/or unix:///path.sock, comma-separated); off when unset")),
        mut_arg("max_response_bytes", |arg| arg
            .long("grpc-max-response-bytes")
            .help("Largest response a gRPC Commit may cache, in bytes (at most 1048576)")),
        mut_arg("http_proxy_listen", |arg| arg
            .long("listen")
            .value_name("HOST:PORT")
            .required(true)
            .help("Serve the proxy here (HOST:PORT; HTTP/1.1 and HTTP/2)")),
        mut_arg("http_proxy_upstream", |arg| arg.long("upstream").value_name("URL").required(true)),
        mut_arg("http_proxy_methods", |arg| arg.long("methods")),
        mut_arg("http_proxy_namespace", |arg| arg.long("namespace")),
        mut_arg("http_proxy_scope", |arg| arg.long("scope")),
        mut_arg("http_proxy_scope_header", |arg| arg.long("scope-header")),
        mut_arg("http_proxy_fingerprint_header", |arg| arg.long("fingerprint-header")),
        mut_arg("http_proxy_never_store_header", |arg| arg.long("never-store-header")),
        mut_arg("http_proxy_strict_key_syntax", |arg| arg.long("strict-key-syntax")),
        mut_arg("http_proxy_after_unknown_outcome", |arg| arg.long("after-unknown-outcome")),
        mut_arg("http_proxy_release_on_status", |arg| arg.long("release-on-status")),
        mut_arg("http_proxy_release_on_grpc_code", |arg| arg.long("release-on-grpc-code")),
        mut_arg("http_proxy_header_timeout", |arg| arg.long("header-timeout")),
        mut_arg("http_proxy_body_timeout", |arg| arg.long("body-timeout")),
        mut_arg("http_proxy_require_key", |arg| arg.long("require-key")),
        mut_arg("http_proxy_retention", |arg| arg.long("retention")),
        mut_arg("http_proxy_max_response_bytes", |arg| arg.long("max-response-bytes")),
        mut_arg("http_proxy_max_request_bytes", |arg| arg.long("max-request-bytes")),
        mut_arg("http_proxy_upstream_timeout", |arg| arg.long("upstream-timeout")),
        mut_arg("http_proxy_upstream_idle_timeout", |arg| arg.long("upstream-idle-timeout")),
        mut_arg("http_proxy_wait_in_flight", |arg| arg.long("wait-in-flight")),
    )]
    HttpProxy(ServeArgs),
    /// Run the Kubernetes admission webhook that injects dedupd as a
    /// sidecar into pods labelled dedupd.io/inject=enabled.
    Inject(InjectArgs),
    /// A client command against a running sidecar.
    #[command(flatten)]
    Client(ClientCommand),
}
