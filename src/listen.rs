//! Where dedupd listens: TCP addresses and Unix domain sockets (for a shared
//! `emptyDir` in a pod), parsed from `--listen` and bound before serving.

use std::{
    fmt, fs, io,
    net::SocketAddr,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    str::FromStr,
};

use tokio::net::{TcpListener, UnixListener};

/// One `--listen` value: `HOST:PORT` or `unix:///path/to.sock`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix domain socket path.
    Unix(PathBuf),
}

/// The socket path of a `unix:///path` (or `unix:/path`) address; `None`
/// for anything else. Shared by the server's `--listen` and the client's
/// `--addr`.
pub(crate) fn unix_socket_path(address: &str) -> Option<PathBuf> {
    address
        .strip_prefix("unix://")
        .or_else(|| address.strip_prefix("unix:"))
        .map(PathBuf::from)
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Some(path) = unix_socket_path(text) {
            if !path.is_absolute() {
                return Err(format!(
                    "{text:?}: the socket path must be absolute (unix:///path)"
                ));
            }
            return Ok(ListenAddr::Unix(path));
        }
        text.parse()
            .map(ListenAddr::Tcp)
            .map_err(|_| format!("{text:?} is neither HOST:PORT nor unix:///path"))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(address) => write!(f, "{address}"),
            ListenAddr::Unix(path) => write!(f, "unix://{}", path.display()),
        }
    }
}

/// A bound listener.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// A Unix domain socket, removed again when dropped.
    Unix(UnixListener, SocketFile),
}

impl From<TcpListener> for Listener {
    fn from(listener: TcpListener) -> Self {
        Listener::Tcp(listener)
    }
}

impl Listener {
    /// Binds `address`. A leftover socket file from an earlier run is
    /// replaced; any other file in the way is an error.
    pub async fn bind(address: &ListenAddr) -> io::Result<Listener> {
        match address {
            ListenAddr::Tcp(address) => Ok(Listener::Tcp(TcpListener::bind(address).await?)),
            ListenAddr::Unix(path) => {
                match fs::symlink_metadata(path) {
                    Ok(meta) if meta.file_type().is_socket() => fs::remove_file(path)?,
                    Ok(_) => {
                        return Err(io::Error::new(
                            io::ErrorKind::AlreadyExists,
                            format!("{} exists and is not a socket", path.display()),
                        ))
                    }
                    Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                    Err(error) => return Err(error),
                }
                let listener = UnixListener::bind(path)?;
                // Owner and group: the app container shares the pod's group.
                fs::set_permissions(path, fs::Permissions::from_mode(0o660))?;
                Ok(Listener::Unix(listener, SocketFile(path.clone())))
            }
        }
    }

    /// What to call this listener in logs.
    pub fn describe(&self) -> String {
        match self {
            Listener::Tcp(listener) => listener
                .local_addr()
                .map_or_else(|_| "tcp (unknown address)".into(), |a| a.to_string()),
            Listener::Unix(_, socket) => format!("unix://{}", socket.0.display()),
        }
    }
}

/// Removes the socket file when the listener is dropped.
#[derive(Debug)]
pub struct SocketFile(PathBuf);

impl SocketFile {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}
