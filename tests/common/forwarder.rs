//! A TCP forwarder that makes a real server go away and come back.

/// A loopback TCP forwarder to one of the machine's servers that a test can
/// cut (every connection dropped, new ones closed at once) and restore: the
/// server "goes away" and "comes back" without touching the real one.
pub struct Forwarder {
    pub port: u16,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    generation: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
    _task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    /// Forwards a port of its own to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Forwarder {
        use std::sync::{
            atomic::{AtomicBool, Ordering},
            Arc,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = Arc::new(AtomicBool::new(true));
        let generation = Arc::new(tokio::sync::watch::Sender::new(0u64));
        let task = {
            let (open, generation) = (Arc::clone(&open), Arc::clone(&generation));
            tokio::spawn(async move {
                loop {
                    let Ok((mut inbound, _)) = listener.accept().await else {
                        continue;
                    };
                    if !open.load(Ordering::SeqCst) {
                        continue; // dropped: the connection closes at once
                    }
                    let mut cut = generation.subscribe();
                    tokio::spawn(async move {
                        let Ok(mut outbound) =
                            tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                        else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
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
            _task: task,
        }
    }

    /// The server goes away: live connections drop, new ones are refused.
    pub fn cut(&self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        self.generation.send_modify(|generation| *generation += 1);
    }

    /// The server is back.
    pub fn restore(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}
