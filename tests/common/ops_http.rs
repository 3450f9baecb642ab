//! A plain HTTP/1.1 GET by hand, for the sidecar's ops endpoints
//! (`/metrics`, `/healthz`, `/readyz`): no client library between the test
//! and what the sidecar writes.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// GET `path` from `addr`: the status and the body.
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let (status, _, body) = exchange(addr, path, "").await;
    (status, body)
}

/// A GET with more header lines (each ending in `\r\n`): the status, the
/// head (lowercased) and the body.
pub async fn exchange(addr: SocketAddr, path: &str, headers: &str) -> (u16, String, String) {
    try_exchange(addr, path, headers)
        .await
        .unwrap_or_else(|error| panic!("GET {path} from {addr}: {error}"))
}

/// [`exchange`], or why it failed (a sidecar not up yet, or gone).
pub async fn try_exchange(
    addr: SocketAddr,
    path: &str,
    headers: &str,
) -> Result<(u16, String, String), String> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: dedupd\r\nConnection: close\r\n{headers}\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .map_err(|e| e.to_string())?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("no status line: {response:?}"))?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Ok((status, head.to_ascii_lowercase(), body.to_owned()))
}
