//! A loopback TCP forwarder that delays each direction by its own fixed
//! time, bytes kept in order: put in front of a shared store for one
//! sidecar, it makes that sidecar's reading of the store's clock lean one
//! way (a slow way there, a fast way back, or the reverse), as asymmetric
//! routes do, while the round trip says only how uncertain it is. Two
//! sidecars leaning opposite ways decide near the two ends of the bound.

use std::time::Duration;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpListener, TcpStream,
    },
    sync::mpsc,
    task::JoinHandle,
    time::Instant,
};

/// One sidecar's delays: on the way to the store, and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delays {
    pub to_store: Duration,
    pub from_store: Duration,
}

impl std::str::FromStr for Delays {
    type Err = String;

    /// `<to>/<from>`, each a duration (`40ms/0ms`).
    fn from_str(text: &str) -> Result<Delays, String> {
        let (to, from) = text
            .split_once('/')
            .ok_or_else(|| format!("{text}: a delay is <to the store>/<back>, e.g. 40ms/0ms"))?;
        let parse = |part: &str| {
            humantime::parse_duration(part).map_err(|error| format!("{text}: {part}: {error}"))
        };
        Ok(Delays {
            to_store: parse(to)?,
            from_store: parse(from)?,
        })
    }
}

/// Forwards a port of its own to `127.0.0.1:target` with `delays`, until
/// the returned task is aborted.
pub async fn start(target: u16, delays: Delays) -> Result<(u16, JoinHandle<()>), String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|error| format!("a port for the delaying forwarder: {error}"))?;
    let port = listener
        .local_addr()
        .map_err(|error| error.to_string())?
        .port();
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((inbound, _)) = listener.accept().await {
            connections.spawn(async move {
                let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)).await else {
                    return;
                };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let (from_client, to_client) = inbound.into_split();
                let (from_store, to_store) = outbound.into_split();
                tokio::select! {
                    () = pump(from_client, to_store, delays.to_store) => {}
                    () = pump(from_store, to_client, delays.from_store) => {}
                }
            });
        }
    });
    Ok((port, task))
}

/// Copies one direction, each chunk written `delay` after it was read.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (chunks, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    let reader = async move {
        let mut buffer = vec![0u8; 64 << 10];
        loop {
            match from.read(&mut buffer).await {
                Ok(read @ 1..) => {
                    let at = Instant::now() + delay;
                    if chunks.send((at, buffer[..read].to_vec())).is_err() {
                        return;
                    }
                }
                _ => return,
            }
        }
    };
    // The reader ends at EOF; what it read is still written.
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_are_read_as_there_and_back() {
        assert_eq!(
            "40ms/0ms".parse::<Delays>().unwrap(),
            Delays {
                to_store: Duration::from_millis(40),
                from_store: Duration::ZERO,
            }
        );
        assert!("40ms".parse::<Delays>().is_err());
        assert!("40ms/soon".parse::<Delays>().is_err());
    }
}
