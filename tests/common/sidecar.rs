//! The real `dedupd` binary as a child process, started on ephemeral ports
//! and awaited through its `--ready-file`, killed when dropped.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::Path,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use dedupd::proto::v1::claim_and_commit_client::ClaimAndCommitClient;
use serde_json::Value;

pub const BINARY: &str = env!("CARGO_BIN_EXE_dedupd");

pub struct Sidecar {
    pub child: Child,
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    /// Set once the child's stderr reached its end (the process is gone).
    log_ended: Arc<std::sync::atomic::AtomicBool>,
    pub ready_dir: tempfile::TempDir,
    /// What the ready file said (its addresses).
    pub ready: Value,
}

impl Sidecar {
    /// Starts the binary on an ephemeral port and waits (bounded) until it
    /// writes its ready file, which names the port.
    pub fn start(data_dir: &Path) -> Sidecar {
        Sidecar::start_with(data_dir, &[])
    }

    /// Like [`Sidecar::start`], with more flags.
    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Sidecar {
        Sidecar::start_under(&[], data_dir, extra)
    }

    /// Like [`Sidecar::start_with`], run by `launcher` (e.g. `prlimit …`),
    /// which must exec the binary so it keeps the child's process ID.
    pub fn start_under(launcher: &[&str], data_dir: &Path, extra: &[&str]) -> Sidecar {
        Sidecar::start_in_environment(launcher, data_dir, extra, &[])
    }

    /// Like [`Sidecar::start_under`], with these environment variables set.
    pub fn start_in_environment(
        launcher: &[&str],
        data_dir: &Path,
        extra: &[&str],
        environment: &[(&str, &str)],
    ) -> Sidecar {
        let ready_dir = tempfile::tempdir().unwrap();
        let ready_file = ready_dir.path().join("ready.json");
        let mut command = match launcher.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(BINARY);
                command
            }
            None => Command::new(BINARY),
        };
        // Only what the test gives: no OTEL_* or DEDUPD_OTLP_* from the
        // environment the tests run in.
        for (name, _) in std::env::vars_os() {
            if name.to_str().is_some_and(is_trace_setting) {
                command.env_remove(&name);
            }
        }
        let mut child = command
            .envs(environment.iter().copied())
            .args(extra)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--log-format",
                "json",
                "--worker-threads",
                "2",
            ])
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--ready-file")
            .arg(&ready_file)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn dedupd");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let log_ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (lines, ended) = (Arc::clone(&log), Arc::clone(&log_ended));
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
            ended.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        let ready = wait_for_ready_file(&mut child, &ready_file, &log);
        let addr = ready["grpc"][0]
            .as_str()
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("no gRPC address in the ready file: {ready}"));
        Sidecar {
            child,
            addr,
            log,
            log_ended,
            ready_dir,
            ready,
        }
    }

    pub async fn client(&self) -> ClaimAndCommitClient<tonic::transport::Channel> {
        ClaimAndCommitClient::connect(format!("http://{}", self.addr))
            .await
            .expect("connect")
    }

    /// One sample of the sidecar's `/metrics`: `name` is the series as
    /// printed (with its labels, if any).
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let ops: SocketAddr = self.ready["metrics"].as_str()?.parse().ok()?;
        let (_, _, page) = super::ops_http::try_exchange(ops, "/metrics", "")
            .await
            .ok()?;
        page.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
    }

    pub fn kill_9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// What the process logged so far.
    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// A figure of the child's `/proc/PID/status` (`VmRSS`, `VmHWM`), in KiB.
    pub fn status_kib(&self, field: &str) -> u64 {
        let pid = self.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
    }

    /// A function that says whether the process has logged a line
    /// containing `text` yet, for another thread to wait on.
    pub fn logged(&self, text: &str) -> impl Fn() -> bool + Send + 'static {
        let (log, text) = (Arc::clone(&self.log), text.to_owned());
        move || log.lock().unwrap().iter().any(|line| line.contains(&text))
    }

    /// Everything the process logged, once it has exited: waits (bounded)
    /// until its stderr is read to the end, so the last lines are there.
    pub fn log_after_exit(&self) -> String {
        let started = Instant::now();
        while !self.log_ended.load(std::sync::atomic::Ordering::SeqCst)
            && started.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.log_text()
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (bounded) until `child` writes `path`, and returns what it says;
/// panics with the log if the child exits or takes longer than 20 s.
fn wait_for_ready_file(child: &mut Child, path: &Path, log: &Mutex<Vec<String>>) -> Value {
    let started = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return serde_json::from_str(&text).expect("the ready file is JSON");
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "dedupd exited with {status} before it was ready: {:?}",
                log.lock().unwrap()
            );
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!(
                "dedupd was not ready within 20 s: {:?}",
                log.lock().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether the variable `name` configures traces.
pub fn is_trace_setting(name: &str) -> bool {
    name.starts_with("OTEL_") || name.starts_with("DEDUPD_OTLP_")
}

/// Open descriptors of process `pid`.
pub fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// Sends SIGTERM and waits for the exit, which must come `within` (the
/// grace period plus the final sync's time, plus slack); returns the exit
/// code and the whole log.
pub fn terminate(sidecar: &mut Sidecar, within: Duration) -> (Option<i32>, String) {
    let pid = sidecar.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let started = Instant::now();
    loop {
        if let Some(status) = sidecar.child.try_wait().unwrap() {
            return (status.code(), sidecar.log_after_exit());
        }
        assert!(
            started.elapsed() < within,
            "still running {within:?} after SIGTERM: {}",
            sidecar.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
