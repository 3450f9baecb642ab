//! A TCP forwarder that makes a real server go away and come back, go
//! silent, or lose the answer to one chosen write.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::tcp::{OwnedReadHalf, OwnedWriteHalf},
    sync::watch,
};

/// What is held back, for whom (a connection's number says how old it is).
#[derive(Clone, Copy, Default)]
struct Silence {
    /// Nothing is relayed, and new connections are not even made.
    everything: bool,
    /// No answer from the server reaches any client.
    answers: bool,
    /// Connections numbered below this stay silent after a partial
    /// restore: stuck links, while new ones work.
    older_than: u64,
}

impl Silence {
    fn holds(&self, connection: u64, toward_client: bool) -> bool {
        self.everything || (toward_client && self.answers) || connection < self.older_than
    }
}

/// What the forwarder does when a client first sends a chunk containing
/// the armed marker.
#[derive(Clone, Copy)]
enum Trap {
    /// The chunk reaches the server; its answer, and everything after,
    /// does not: the write was applied, its answer lost.
    LoseAnswer,
    /// The chunk itself is held with everything else: the write is still
    /// on its way, and lands when the forwarder is restored.
    HoldWrite,
}

/// The marker a client's write is watched for, and what then happens.
type Armed = Arc<Mutex<Option<(Vec<u8>, Trap)>>>;

/// A loopback TCP forwarder to one of the machine's servers that a test can
/// cut (every connection dropped, new ones closed at once), silence (every
/// connection stays open and new ones are accepted, but no byte is relayed:
/// a partition, or a primary gone without a reset) and restore: the server
/// "goes away" and "comes back" without touching the real one. Armed with
/// a marker, it goes silent at one chosen write, before or after relaying
/// it; restored for new connections only, the old ones keep their bytes.
pub struct Forwarder {
    pub port: u16,
    /// Where new connections go.
    target: Arc<AtomicU16>,
    open: Arc<AtomicBool>,
    /// Connections numbered from this one are dropped (bumped by each cut).
    cut: Arc<watch::Sender<u64>>,
    silence: Arc<watch::Sender<Silence>>,
    connections: Arc<AtomicU64>,
    trap: Armed,
    sprung: Arc<AtomicBool>,
    _task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    /// Forwards a port of its own to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Forwarder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(AtomicU16::new(target));
        let open = Arc::new(AtomicBool::new(true));
        let cut = Arc::new(watch::Sender::new(0u64));
        let silence = Arc::new(watch::Sender::new(Silence::default()));
        let connections = Arc::new(AtomicU64::new(0));
        let trap = Arc::new(Mutex::new(None));
        let sprung = Arc::new(AtomicBool::new(false));
        let task = {
            let (target, open, cut, silence, connections) = (
                Arc::clone(&target),
                Arc::clone(&open),
                Arc::clone(&cut),
                Arc::clone(&silence),
                Arc::clone(&connections),
            );
            let (trap, sprung) = (Arc::clone(&trap), Arc::clone(&sprung));
            tokio::spawn(async move {
                loop {
                    let Ok((inbound, _)) = listener.accept().await else {
                        continue;
                    };
                    if !open.load(Ordering::SeqCst) {
                        continue; // dropped: the connection closes at once
                    }
                    let connection = connections.fetch_add(1, Ordering::SeqCst);
                    let target = target.load(Ordering::SeqCst);
                    let mut cut = cut.subscribe();
                    let silence = Arc::clone(&silence);
                    let trap = Springs {
                        trap: Arc::clone(&trap),
                        sprung: Arc::clone(&sprung),
                        silence: Arc::clone(&silence),
                    };
                    tokio::spawn(async move {
                        // While silent, not even the connection to the
                        // server is made: the client's handshake hangs.
                        while silence.borrow().holds(connection, false) {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        let Ok(outbound) =
                            tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                        else {
                            return;
                        };
                        let (from_client, to_client) = inbound.into_split();
                        let (from_server, to_server) = outbound.into_split();
                        let up = Pump {
                            connection,
                            toward_client: false,
                            silence: silence.subscribe(),
                            trap: Some(trap),
                        };
                        let down = Pump {
                            connection,
                            toward_client: true,
                            silence: silence.subscribe(),
                            trap: None,
                        };
                        tokio::select! {
                            () = up.run(from_client, to_server) => {}
                            () = down.run(from_server, to_client) => {}
                            () = async {
                                while cut.changed().await.is_ok() {
                                    if connection >= *cut.borrow() {
                                        return;
                                    }
                                }
                                std::future::pending::<()>().await;
                            } => {}
                        }
                    });
                }
            })
        };
        Forwarder {
            port,
            target,
            open,
            cut,
            silence,
            connections,
            trap,
            sprung,
            _task: task,
        }
    }

    /// The server goes away: live connections drop, new ones are refused.
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.cut.send_replace(0);
    }

    /// How many connections were made so far (they are numbered from 0 in
    /// the order they came).
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    /// Drops the connections numbered `from` and after (the server closes
    /// them, as a restart would); older ones, and new ones, go on.
    pub fn drop_connections_from(&self, from: u64) {
        self.cut.send_replace(from);
    }

    /// New connections go to `127.0.0.1:target` instead (a name that now
    /// resolves to another server); open ones stay where they are.
    pub fn switch_to(&self, target: u16) {
        self.target.store(target, Ordering::SeqCst);
    }

    /// The network goes silent: nothing is relayed, nothing is closed.
    pub fn silence(&self) {
        self.silence
            .send_modify(|silence| silence.everything = true);
    }

    /// The first chunk a client sends containing `marker` reaches the
    /// server, and then the network goes silent: that write is applied and
    /// its answer (with everything after) lost.
    pub fn lose_answer_to(&self, marker: &[u8]) {
        self.arm(marker, Trap::LoseAnswer);
    }

    /// The first chunk a client sends containing `marker` is held, and the
    /// network goes silent: that write lands only at [`Forwarder::restore`].
    pub fn hold_write(&self, marker: &[u8]) {
        self.arm(marker, Trap::HoldWrite);
    }

    fn arm(&self, marker: &[u8], trap: Trap) {
        self.sprung.store(false, Ordering::SeqCst);
        *self.trap.lock().unwrap() = Some((marker.to_vec(), trap));
    }

    /// Whether an armed marker has gone by.
    pub fn sprung(&self) -> bool {
        self.sprung.load(Ordering::SeqCst)
    }

    /// New connections work again; the ones open until now stay silent,
    /// holding what they were sent (links stuck in a partition).
    pub fn restore_new_connections(&self) {
        let made = self.connections.load(Ordering::SeqCst);
        self.silence.send_replace(Silence {
            older_than: made,
            ..Silence::default()
        });
    }

    /// The server is back (and the network speaks again), held bytes and
    /// all.
    pub fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
        self.silence.send_replace(Silence::default());
    }
}

/// An armed marker, shared by every connection: the first to see it
/// springs it.
struct Springs {
    trap: Armed,
    sprung: Arc<AtomicBool>,
    silence: Arc<watch::Sender<Silence>>,
}

impl Springs {
    /// The trap `chunk` springs, if any; answers are silenced at once
    /// (before the chunk is relayed, so no answer can slip by), and the
    /// whole network too for a held write.
    fn spring(&self, chunk: &[u8]) -> Option<Trap> {
        let mut armed = self.trap.lock().unwrap();
        let (marker, _) = armed.as_ref()?;
        if !chunk.windows(marker.len()).any(|window| window == marker) {
            return None;
        }
        let (_, trap) = armed.take()?;
        self.silence.send_modify(|silence| match trap {
            Trap::LoseAnswer => silence.answers = true,
            Trap::HoldWrite => silence.everything = true,
        });
        self.sprung.store(true, Ordering::SeqCst);
        Some(trap)
    }

    fn silence_everything(&self) {
        self.silence
            .send_modify(|silence| silence.everything = true);
    }
}

/// Copies one direction of one connection, holding every byte while the
/// forwarder says so (checked every few milliseconds: simple, and plenty
/// for a test).
struct Pump {
    connection: u64,
    toward_client: bool,
    silence: watch::Receiver<Silence>,
    trap: Option<Springs>,
}

impl Pump {
    async fn run(self, mut from: OwnedReadHalf, mut to: OwnedWriteHalf) {
        let held = || {
            self.silence
                .borrow()
                .holds(self.connection, self.toward_client)
        };
        let mut buffer = vec![0u8; 64 << 10];
        loop {
            let read = loop {
                if held() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                // Silenced while waiting: stop reading (the sender's kernel
                // buffers fill, as on a dead link). A read is cancel-safe.
                match tokio::time::timeout(Duration::from_millis(20), from.read(&mut buffer)).await
                {
                    Ok(read) => break read,
                    Err(_) => continue,
                }
            };
            let Ok(read @ 1..) = read else { return };
            let chunk = &buffer[..read];
            let sprung = self.trap.as_ref().and_then(|trap| trap.spring(chunk));
            while held() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if to.write_all(chunk).await.is_err() {
                return;
            }
            if let (Some(Trap::LoseAnswer), Some(trap)) = (sprung, &self.trap) {
                trap.silence_everything();
            }
        }
    }
}
