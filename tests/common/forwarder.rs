//! A TCP forwarder that makes a real server go away and come back, or go
//! silent.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::tcp::{OwnedReadHalf, OwnedWriteHalf},
    sync::watch,
};

/// A loopback TCP forwarder to one of the machine's servers that a test can
/// cut (every connection dropped, new ones closed at once), silence (every
/// connection stays open and new ones are accepted, but no byte is relayed:
/// a partition, or a primary gone without a reset) and restore: the server
/// "goes away" and "comes back" without touching the real one.
pub struct Forwarder {
    pub port: u16,
    open: Arc<AtomicBool>,
    generation: Arc<watch::Sender<u64>>,
    silent: Arc<watch::Sender<bool>>,
    _task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    /// Forwards a port of its own to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Forwarder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = Arc::new(AtomicBool::new(true));
        let generation = Arc::new(watch::Sender::new(0u64));
        let silent = Arc::new(watch::Sender::new(false));
        let task = {
            let (open, generation, silent) = (
                Arc::clone(&open),
                Arc::clone(&generation),
                Arc::clone(&silent),
            );
            tokio::spawn(async move {
                loop {
                    let Ok((inbound, _)) = listener.accept().await else {
                        continue;
                    };
                    if !open.load(Ordering::SeqCst) {
                        continue; // dropped: the connection closes at once
                    }
                    let mut cut = generation.subscribe();
                    let silent = Arc::clone(&silent);
                    tokio::spawn(async move {
                        // While silent, not even the connection to the
                        // server is made: the client's handshake hangs.
                        while *silent.borrow() {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        let Ok(outbound) =
                            tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                        else {
                            return;
                        };
                        let (from_client, to_client) = inbound.into_split();
                        let (from_server, to_server) = outbound.into_split();
                        tokio::select! {
                            () = pump(from_client, to_server, silent.subscribe()) => {}
                            () = pump(from_server, to_client, silent.subscribe()) => {}
                            _ = cut.changed() => {}
                        }
                    });
                }
            })
        };
        Forwarder {
            port,
            open,
            generation,
            silent,
            _task: task,
        }
    }

    /// The server goes away: live connections drop, new ones are refused.
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.generation.send_modify(|generation| *generation += 1);
    }

    /// The network goes silent: nothing is relayed, nothing is closed.
    pub fn silence(&self) {
        self.silent.send_replace(true);
    }

    /// The server is back (and the network speaks again).
    pub fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
        self.silent.send_replace(false);
    }
}

/// Copies one direction, holding every byte while the forwarder is silent
/// (checked every few milliseconds: simple, and plenty for a test).
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, silent: watch::Receiver<bool>) {
    let is_silent = || *silent.borrow();
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        let read = loop {
            if is_silent() {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            // Silenced while waiting: stop reading (the sender's kernel
            // buffers fill, as on a dead link). A read is cancel-safe.
            match tokio::time::timeout(Duration::from_millis(20), from.read(&mut buffer)).await {
                Ok(read) => break read,
                Err(_) => continue,
            }
        };
        let Ok(read @ 1..) = read else { return };
        while is_silent() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}
