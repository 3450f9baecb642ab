//! LazyFS (a FUSE file system that keeps written data in its own cache
//! until it is synced) as a power switch for the power-loss suite
//! ([`crate::powerloss`]): a mount over a backing directory, its
//! `clear-cache` command (every unsynced write dropped, as a power cut
//! would), and injections armed at mount time that drop the cache at a
//! chosen system call of a chosen file and crash the file system there.
//!
//! LazyFS answers `statfs` with zeros, keeps its "completed" FIFO open (so
//! one line is read from it, never to its end), and needs the *backing*
//! path of a file in its injections.

use std::{
    io::{Read, Write},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A fault LazyFS injects by itself, at a system call of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Injection {
    /// Drops every unsynced write `timing` ("before" or "after") the
    /// `occurrence`-th `op` (fsync, write, create, unlink, rename, truncate)
    /// on `file` (relative to the mount), then crashes the file system.
    ClearCache {
        timing: &'static str,
        op: &'static str,
        file: String,
        occurrence: u32,
    },
    /// Splits the `occurrence`-th write to `file` in `parts`, persists only
    /// those numbered in `persist` (from 1), then crashes: a torn write.
    TornOp {
        file: String,
        occurrence: u32,
        parts: u32,
        persist: Vec<u32>,
    },
    /// Of the `occurrence`-th sequence of writes to `file` between two
    /// syncs, persists only those numbered in `persist`, then crashes.
    TornSeq {
        file: String,
        occurrence: u32,
        persist: Vec<u32>,
    },
}

impl Injection {
    /// A short name, for a run's directory and report.
    pub fn label(&self) -> String {
        let short = |file: &str| file.replace('/', "_");
        match self {
            Injection::ClearCache {
                timing,
                op,
                file,
                occurrence,
            } => format!("clear-{timing}-{op}-{}-{occurrence}", short(file)),
            Injection::TornOp {
                file,
                occurrence,
                parts,
                persist,
            } => format!("torn-op-{}-{occurrence}-{parts}-{persist:?}", short(file)),
            Injection::TornSeq {
                file,
                occurrence,
                persist,
            } => format!("torn-seq-{}-{occurrence}-{persist:?}", short(file)),
        }
    }

    fn toml(&self, backing: &Path) -> String {
        let list = |values: &[u32]| {
            values
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            Injection::ClearCache {
                timing,
                op,
                file,
                occurrence,
            } => format!(
                "[[injection]]\ntype=\"clear-cache\"\ntiming=\"{timing}\"\nop=\"{op}\"\n\
                 from=\"{}\"\noccurrence={occurrence}\ncrash=true\n",
                backing.join(file).display()
            ),
            Injection::TornOp {
                file,
                occurrence,
                parts,
                persist,
            } => format!(
                "[[injection]]\ntype=\"torn-op\"\nfile=\"{}\"\noccurrence={occurrence}\n\
                 parts={parts}\npersist=[{}]\n",
                backing.join(file).display(),
                list(persist)
            ),
            Injection::TornSeq {
                file,
                occurrence,
                persist,
            } => format!(
                "[[injection]]\ntype=\"torn-seq\"\nfile=\"{}\"\nop=\"write\"\n\
                 occurrence={occurrence}\npersist=[{}]\n",
                backing.join(file).display(),
                list(persist)
            ),
        }
    }
}

/// A LazyFS mount, unmounted when dropped.
#[derive(Debug)]
pub struct LazyFs {
    binary: PathBuf,
    /// Where the program under test writes.
    pub mount: PathBuf,
    /// Where what LazyFS persisted lies.
    pub backing: PathBuf,
    work: PathBuf,
    child: Option<Child>,
    commands: PathBuf,
    completed: PathBuf,
    completed_reader: Option<std::fs::File>,
}

/// `O_NONBLOCK` on Linux (x86-64 and AArch64): a FIFO opened so never
/// waits for its writer, and a read that finds nothing says so at once.
const O_NONBLOCK: i32 = 0o4000;
/// The longest LazyFS may take to answer a command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

impl LazyFs {
    /// Mounts `binary` (LazyFS) at `work/mnt` over `work/backing`, with
    /// `injections` armed. Waits (at most 10 s) for the mount.
    pub fn mount(binary: &Path, work: &Path, injections: &[Injection]) -> Result<LazyFs, String> {
        let mount = work.join("mnt");
        let backing = work.join("backing");
        for dir in [&mount, &backing] {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let mut lazyfs = LazyFs {
            binary: binary.to_path_buf(),
            mount,
            backing,
            work: work.to_path_buf(),
            child: None,
            commands: work.join("faults.fifo"),
            completed: work.join("completed.fifo"),
            completed_reader: None,
        };
        lazyfs.start(injections)?;
        Ok(lazyfs)
    }

    fn start(&mut self, injections: &[Injection]) -> Result<(), String> {
        for fifo in [&self.commands, &self.completed] {
            let _ = std::fs::remove_file(fifo);
            let made = Command::new("mkfifo")
                .arg(fifo)
                .status()
                .map_err(|e| format!("mkfifo: {e}"))?;
            if !made.success() {
                return Err(format!("mkfifo {} failed", fifo.display()));
            }
        }
        let config = self.work.join("lazyfs.toml");
        let mut text = format!(
            "[faults]\nfifo_path=\"{}\"\nfifo_path_completed=\"{}\"\n\
             [cache]\napply_eviction=false\n[cache.simple]\ncustom_size=\"2gb\"\n\
             blocks_per_page=1\n[filesystem]\nlog_all_operations=false\nlogfile=\"\"\n",
            self.commands.display(),
            self.completed.display()
        );
        for injection in injections {
            text.push_str(&injection.toml(&self.backing));
        }
        std::fs::write(&config, text).map_err(|e| format!("{}: {e}", config.display()))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.work.join("lazyfs.log"))
            .map_err(|e| format!("lazyfs.log: {e}"))?;
        let child = Command::new(&self.binary)
            .arg(&self.mount)
            .arg("--config-path")
            .arg(&config)
            .args(["-o", "allow_other", "-o", "modules=subdir"])
            .arg("-o")
            .arg(format!("subdir={}", self.backing.display()))
            .arg("-f")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        self.child = Some(child);
        // Non-blocking: opening waits for no writer (LazyFS opens it for
        // writing at start, and waits for a reader), and a read with
        // nothing to read returns at once, so a dead LazyFS is a timeout.
        let completed = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(O_NONBLOCK)
            .open(&self.completed)
            .map_err(|e| format!("{}: {e}", self.completed.display()))?;
        self.completed_reader = Some(completed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.mounted() {
            if Instant::now() > deadline {
                return Err(format!(
                    "LazyFS did not mount {} within 10 s",
                    self.mount.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Whether the mount is up (its entry is in the mount table).
    fn mounted(&self) -> bool {
        let table = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mount = self.mount.display().to_string();
        table
            .lines()
            .any(|line| line.split(' ').nth(1) == Some(mount.as_str()))
    }

    /// Whether an injection crashed the file system (its process is gone).
    pub fn crashed(&mut self) -> bool {
        match &mut self.child {
            Some(child) => child.try_wait().ok().flatten().is_some(),
            None => true,
        }
    }

    /// The last `lines` lines of LazyFS's own log (why it died).
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.work.join("lazyfs.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Drops every write not yet synced (a power cut's effect on the
    /// disk), and waits for LazyFS to say it is done (at most 30 s).
    pub fn clear_cache(&mut self) -> Result<(), String> {
        if self.crashed() {
            return Err("LazyFS is not running".into());
        }
        // Read-write: opening a FIFO so never waits for the other end.
        let mut commands = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.commands)
            .map_err(|e| format!("{}: {e}", self.commands.display()))?;
        commands
            .write_all(b"lazyfs::clear-cache\n")
            .map_err(|e| format!("clear-cache: {e}"))?;
        let reader = self
            .completed_reader
            .as_mut()
            .ok_or("LazyFS is not mounted")?;
        let deadline = Instant::now() + COMMAND_TIMEOUT;
        let mut answer = Vec::new();
        let mut chunk = [0; 256];
        while !answer.contains(&b'\n') {
            match reader.read(&mut chunk) {
                Ok(read) if read > 0 => answer.extend_from_slice(&chunk[..read]),
                // Nothing yet (WouldBlock), or no writer at this moment.
                Ok(_) => std::thread::sleep(Duration::from_millis(5)),
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(error) => return Err(format!("completed FIFO: {error}")),
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "LazyFS did not answer clear-cache within {COMMAND_TIMEOUT:?}"
                ));
            }
        }
        drop(commands);
        let line = String::from_utf8_lossy(&answer);
        if line.trim() == "finished::clear-cache" {
            Ok(())
        } else {
            Err(format!("LazyFS answered {line:?} to clear-cache"))
        }
    }

    /// Unmounts and mounts again (over the same backing directory, which
    /// holds only what was synced), with `injections` armed: the machine
    /// after the power came back.
    pub fn remount(&mut self, injections: &[Injection]) -> Result<(), String> {
        self.unmount();
        self.start(injections)
    }

    fn unmount(&mut self) {
        self.completed_reader = None;
        let _ = Command::new("fusermount3")
            .arg("-uz")
            .arg(&self.mount)
            .stderr(Stdio::null())
            .status();
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for LazyFs {
    fn drop(&mut self) {
        self.unmount();
    }
}
