//! The real `dedupd` binary as a child process on ephemeral ports (its
//! addresses read from its `--ready-file`), and what `/proc` says about it:
//! memory, open files, threads. Used by the hostile-client and soak runs.

use std::{
    io::Write,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use tokio::process::{Child, Command};

/// A running sidecar, killed when dropped.
#[derive(Debug)]
pub struct Sidecar {
    child: Child,
    /// Its gRPC address.
    pub grpc: SocketAddr,
    /// Its ops (metrics, health) address.
    pub ops: SocketAddr,
    /// Its HTTP idempotency proxy's address, when `flags` turned it on
    /// (`--http-proxy-listen`).
    pub http_proxy: Option<SocketAddr>,
    log: PathBuf,
}

impl Sidecar {
    /// Starts `binary` on a sled store in `data_dir` with `flags` and waits
    /// (at most 30 s) until it is serving. Its log goes to `data_dir/log`,
    /// appended to: a restart keeps what the run before it logged, each
    /// start under a line of its own.
    pub async fn start(binary: &Path, data_dir: &Path, flags: &[String]) -> Result<Self, String> {
        Sidecar::start_on(binary, data_dir, &data_dir.join("data"), flags).await
    }

    /// Like [`Sidecar::start`], its store in `store_dir` (a LazyFS mount,
    /// say) and its log and ready file in `home`.
    pub async fn start_on(
        binary: &Path,
        home: &Path,
        store_dir: &Path,
        flags: &[String],
    ) -> Result<Self, String> {
        std::fs::create_dir_all(home).map_err(|e| format!("{}: {e}", home.display()))?;
        let ready = home.join("ready.json");
        let log = home.join("log");
        let _ = std::fs::remove_file(&ready);
        let mut log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        writeln!(
            log_file,
            "=== dedupd-reliability: {} started at {:.3} s since the epoch, flags {flags:?} ===",
            binary.display(),
            since_epoch.as_secs_f64()
        )
        .map_err(|e| format!("{}: {e}", log.display()))?;
        let mut child = Command::new(binary)
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .args(["--log", "warn"])
            .arg("--data-dir")
            .arg(store_dir)
            .arg("--ready-file")
            .arg(&ready)
            .args(flags)
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let announced = loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                if let Ok(value) = serde_json::from_str::<serde_json::Value>(&text) {
                    break value;
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!(
                    "dedupd exited at start ({status}): {}",
                    last_start(&log)
                ));
            }
            if Instant::now() > deadline {
                return Err("dedupd was not ready within 30 s".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let address = |value: &serde_json::Value| -> Result<SocketAddr, String> {
            value
                .as_str()
                .and_then(|text| text.parse().ok())
                .ok_or_else(|| format!("no address in the ready file: {announced}"))
        };
        let http_proxy = match &announced["http_proxy"] {
            serde_json::Value::Null => None,
            value => Some(address(value)?),
        };
        Ok(Sidecar {
            grpc: address(&announced["grpc"][0])?,
            ops: address(&announced["metrics"])?,
            http_proxy,
            child,
            log,
        })
    }

    /// Its process ID.
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// Whether it has exited (and how), without waiting.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// What it logged since it started (earlier starts on the same
    /// directory logged above it, in the same file).
    pub fn log(&self) -> String {
        last_start(&std::fs::read_to_string(&self.log).unwrap_or_default()).to_owned()
    }

    /// Its log file: every start's lines.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Its `/metrics` page now, or why it could not be had (a sidecar
    /// about to be killed: what it counted is kept for a failed run).
    pub async fn scrape(&self) -> Result<String, String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let exchange = async {
            let mut stream = tokio::net::TcpStream::connect(self.ops).await?;
            stream
                .write_all(
                    format!(
                        "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                        self.ops
                    )
                    .as_bytes(),
                )
                .await?;
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        };
        let answer = tokio::time::timeout(Duration::from_secs(5), exchange)
            .await
            .map_err(|_| "no answer from /metrics within 5 s".to_owned())?
            .map_err(|e| format!("/metrics: {e}"))?;
        let text = String::from_utf8_lossy(&answer);
        match text.split_once("\r\n\r\n") {
            Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_owned()),
            _ => Err(format!(
                "/metrics answered: {}",
                text.lines().next().unwrap_or_default()
            )),
        }
    }

    /// What `/proc` says about it now.
    pub fn sample(&self) -> ProcessSample {
        ProcessSample::of(self.pid())
    }

    /// SIGKILL, and waits for the exit.
    pub async fn kill_9(mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGTERM, then waits (at most `grace` + 5 s) for the exit.
    pub async fn stop(mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        tokio::time::timeout(grace + Duration::from_secs(5), self.child.wait())
            .await
            .ok()
            .and_then(Result::ok)
    }
}

/// The part of a log written since the last start line [`Sidecar::start`]
/// wrote.
fn last_start(log: &str) -> &str {
    log.rfind("=== dedupd-reliability: ")
        .and_then(|at| log[at..].find('\n').map(|end| &log[at + end + 1..]))
        .unwrap_or(log)
}

/// The lines of a log at WARN or ERROR (the text format's level column),
/// and the start lines between them.
pub fn warnings(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| {
            line.starts_with("=== dedupd-reliability: ")
                || line.contains(" WARN ")
                || line.contains(" ERROR ")
                || line.contains("panicked")
        })
        .collect()
}

/// A process's resident memory, its peak, open files and threads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessSample {
    /// Resident set, KiB (VmRSS).
    pub rss_kib: u64,
    /// Peak resident set since the start, KiB (VmHWM).
    pub peak_rss_kib: u64,
    /// Open file descriptors.
    pub open_files: u64,
    /// Threads.
    pub threads: u64,
    /// CPU time it has used, user and system, microseconds (from
    /// `/proc/<pid>/stat`, in clock ticks): unlike latency, what a call
    /// costs in it does not grow when other processes load the machine.
    pub cpu_us: u64,
}

impl ProcessSample {
    /// Reads `/proc/<pid>`; zeros when it is gone.
    pub fn of(pid: u32) -> ProcessSample {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|value| value.parse().ok())
                .unwrap_or(0)
        };
        ProcessSample {
            rss_kib: field("VmRSS:"),
            peak_rss_kib: field("VmHWM:"),
            open_files: std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map_or(0, |entries| entries.count() as u64),
            threads: field("Threads:"),
            cpu_us: cpu_us(pid),
        }
    }
}

/// User plus system CPU time of `pid`, microseconds (0 when it is gone).
fn cpu_us(pid: u32) -> u64 {
    /// Clock ticks per second (`getconf CLK_TCK`: 100 on Linux).
    const TICKS_PER_SECOND: u64 = 100;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces: count from after it.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15: 11 and 12 after the name.
    let ticks = |index: usize| -> u64 {
        fields
            .get(index)
            .and_then(|value| value.parse().ok())
            .unwrap_or(0)
    };
    (ticks(11) + ticks(12)) * (1_000_000 / TICKS_PER_SECOND)
}

/// Bytes under `path`, recursively (the data directory's size on disk as
/// its files' lengths).
pub fn directory_bytes(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => directory_bytes(&entry.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}
