//! NBD server: listening socket, accept thread, one thread per connection, graceful shutdown.
//!
//! Blocking and thread-based, like the rest of the library. The accept thread `poll`s the
//! listener together with a self-pipe, so `ServerHandle::shutdown` wakes it without
//! connecting to itself or relying on platform quirks of `shutdown()` on a listener. Each
//! connection thread runs the handshake (`handshake::negotiate`) and then the transmission
//! phase (`transmission::serve_transmission`, which adds its own worker threads). A failure on
//! one connection, including a panic inside an export, ends only that connection.
//!
//! Shutdown: stop accepting, half-close every connection for reading (clients see no new
//! replies to requests they send after that, but everything already received is answered),
//! wait up to `shutdown_grace` for connections to finish, then close the rest outright.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::export::ExportSet;
use super::handshake::negotiate;
use super::transmission::{serve_transmission, Stats, TransmissionConfig};

const TARGET: &str = "strata::nbd";

/// The IANA port for NBD, used by `bind_tcp_loopback(None)`.
pub(crate) const NBD_DEFAULT_PORT: u16 = 10809;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("Socket path {path} already exists; remove it if no server is using it, or pick another path")]
    SocketExists { path: PathBuf },
    #[error("Cannot listen on {addr}")]
    Bind {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("Cannot set up the server ({op})")]
    Setup {
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub transmission: TransmissionConfig,
    /// Connections served at once; further clients are closed at accept.
    pub max_connections: usize,
    /// How long shutdown waits for connections to finish their queued requests.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            transmission: TransmissionConfig::default(),
            max_connections: 128,
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// Where a server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl ServerAddr {
    /// An NBD URI for `export` (as understood by qemu, libnbd and fio). The export name is
    /// inserted verbatim: use names without URI-reserved characters.
    pub fn uri(&self, export: &str) -> String {
        match self {
            ServerAddr::Unix(p) => format!("nbd+unix:///{export}?socket={}", p.display()),
            ServerAddr::Tcp(a) => format!("nbd://{a}/{export}"),
        }
    }
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// One accepted connection, Unix or TCP.
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        }
    }

    fn peer(&self) -> String {
        match self {
            Stream::Unix(_) => "unix".to_string(),
            Stream::Tcp(s) => s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tcp".into()),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl super::transmission::Source for Stream {
    fn read_append(&mut self, v: &mut Vec<u8>, n: usize) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.take(n as u64).read_to_end(v),
            Stream::Tcp(s) => s.take(n as u64).read_to_end(v),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tcp(s) => (&*s).write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A bound, not yet serving, NBD server.
pub struct Server {
    listener: Option<Listener>,
    addr: ServerAddr,
    config: ServerConfig,
    /// Socket file to remove when the server goes away.
    owned_path: Option<PathBuf>,
}

impl Server {
    /// Listen on a Unix socket at `path` (which must not exist).
    pub fn bind_unix(path: impl AsRef<Path>) -> Result<Server, ServerError> {
        let path = path.as_ref().to_path_buf();
        if path.symlink_metadata().is_ok() {
            return Err(ServerError::SocketExists { path });
        }
        let l = UnixListener::bind(&path)
            .map_err(|source| ServerError::Bind { addr: path.display().to_string(), source })?;
        Ok(Server {
            listener: Some(Listener::Unix(l)),
            addr: ServerAddr::Unix(path.clone()),
            config: ServerConfig::default(),
            owned_path: Some(path),
        })
    }

    /// Listen on TCP at `addr`. NBD has no authentication here: prefer loopback.
    pub fn bind_tcp(addr: SocketAddr) -> Result<Server, ServerError> {
        let l = TcpListener::bind(addr)
            .map_err(|source| ServerError::Bind { addr: addr.to_string(), source })?;
        let bound =
            l.local_addr().map_err(|source| ServerError::Setup { op: "local_addr", source })?;
        Ok(Server {
            listener: Some(Listener::Tcp(l)),
            addr: ServerAddr::Tcp(bound),
            config: ServerConfig::default(),
            owned_path: None,
        })
    }

    /// Listen on 127.0.0.1 at `port` (10809 if `None`; `Some(0)` picks a free port).
    pub fn bind_tcp_loopback(port: Option<u16>) -> Result<Server, ServerError> {
        Server::bind_tcp(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::LOCALHOST,
            port.unwrap_or(NBD_DEFAULT_PORT),
        )))
    }

    pub fn with_config(mut self, config: ServerConfig) -> Server {
        self.config = config;
        self
    }

    pub fn addr(&self) -> &ServerAddr {
        &self.addr
    }

    /// Start the accept thread and return a handle that stops it.
    pub fn serve(mut self, exports: Arc<dyn ExportSet>) -> Result<ServerHandle, ServerError> {
        let (stop_r, stop_w) =
            pipe().map_err(|source| ServerError::Setup { op: "pipe", source })?;
        let listener = self.listener.take().ok_or(ServerError::Setup {
            op: "listener already used",
            source: io::Error::from(io::ErrorKind::InvalidInput),
        })?;
        let listen_fd = match &listener {
            Listener::Unix(l) => {
                l.set_nonblocking(true)
                    .map_err(|source| ServerError::Setup { op: "set_nonblocking", source })?;
                l.as_raw_fd()
            }
            Listener::Tcp(l) => {
                l.set_nonblocking(true)
                    .map_err(|source| ServerError::Setup { op: "set_nonblocking", source })?;
                l.as_raw_fd()
            }
        };
        let shared = Arc::new(Shared {
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            active: AtomicUsize::new(0),
            total: AtomicU64::new(0),
            config: self.config.clone(),
        });
        let owned_path = self.owned_path.take();
        let addr = self.addr.clone();
        let s2 = shared.clone();
        let accept = thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(listener, listen_fd, stop_r, s2, exports))
            .map_err(|source| ServerError::Setup { op: "spawn accept thread", source })?;
        tracing::info!(target: TARGET, addr = ?addr, "NBD server listening");
        Ok(ServerHandle {
            stopper: Stopper { fd: Arc::new(stop_w) },
            accept: Some(accept),
            shared,
            addr,
            owned_path,
            done: false,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(p) = self.owned_path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds is a valid array of two ints for pipe2 to fill.
    // Non-blocking so that repeated `Stopper::stop` calls can never block on a full pipe.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by us alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

struct ConnEntry {
    stream: Stream,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    conns: Mutex<HashMap<u64, ConnEntry>>,
    next_id: AtomicU64,
    active: AtomicUsize,
    total: AtomicU64,
    config: ServerConfig,
}

/// Asks a running server to stop; cheap to clone and send to a signal-handling thread.
#[derive(Clone)]
pub struct Stopper {
    fd: Arc<OwnedFd>,
}

impl Stopper {
    /// Stop accepting connections. The `ServerHandle` owner (in `wait` or `shutdown`) then
    /// drains and closes existing connections. Calling it again is harmless.
    pub fn stop(&self) {
        // SAFETY: writing one byte from a valid buffer to the pipe we own.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    }
}

/// A running server. Dropping it shuts the server down.
pub struct ServerHandle {
    stopper: Stopper,
    accept: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
    addr: ServerAddr,
    owned_path: Option<PathBuf>,
    done: bool,
}

impl ServerHandle {
    pub fn addr(&self) -> &ServerAddr {
        &self.addr
    }

    pub fn uri(&self, export: &str) -> String {
        self.addr.uri(export)
    }

    /// A handle that can stop the server from another thread while this one `wait`s.
    pub fn stopper(&self) -> Stopper {
        self.stopper.clone()
    }

    /// Connections currently open.
    pub fn active_connections(&self) -> usize {
        self.shared.active.load(Ordering::SeqCst)
    }

    /// Connections accepted since start.
    pub fn total_connections(&self) -> u64 {
        self.shared.total.load(Ordering::SeqCst)
    }

    /// Serve until a `Stopper` stops the server (or the listener fails), then close every
    /// connection as `shutdown` does.
    pub fn wait(mut self) {
        self.finish();
    }

    /// Stop accepting, let connections finish queued requests, then close them.
    pub fn shutdown(mut self) {
        self.stopper.stop();
        self.finish();
    }

    fn finish(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let mut entries: Vec<(u64, ConnEntry)> = self.shared.conns.lock().drain().collect();
        for (_, e) in &entries {
            let _ = e.stream.shutdown(Shutdown::Read);
        }
        let deadline = Instant::now() + self.shared.config.shutdown_grace;
        while Instant::now() < deadline
            && entries.iter().any(|(_, e)| e.thread.as_ref().is_some_and(|t| !t.is_finished()))
        {
            thread::sleep(Duration::from_millis(5));
        }
        for (id, e) in &mut entries {
            if e.thread.as_ref().is_some_and(|t| !t.is_finished()) {
                tracing::warn!(target: TARGET, conn = *id, "connection still busy at shutdown; closing it");
                let _ = e.stream.shutdown(Shutdown::Both);
            }
            if let Some(t) = e.thread.take() {
                let _ = t.join();
            }
        }
        if let Some(p) = self.owned_path.take() {
            let _ = std::fs::remove_file(p);
        }
        tracing::info!(target: TARGET, addr = ?self.addr, "NBD server stopped");
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if !self.done {
            self.stopper.stop();
            self.finish();
        }
    }
}

fn accept_loop(
    listener: Listener,
    listen_fd: RawFd,
    stop: OwnedFd,
    shared: Arc<Shared>,
    exports: Arc<dyn ExportSet>,
) {
    loop {
        let mut fds = [
            libc::pollfd { fd: listen_fd, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: fds is a valid array of two pollfd structs.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(target: TARGET, error = %e, "poll on the listening socket failed; server stops accepting");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        let accepted = match &listener {
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }),
        };
        let stream = match accepted {
            Ok(s) => s,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                continue
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(target: TARGET, error = %e, "accept failed");
                thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        let blocking = match &stream {
            Stream::Unix(s) => s.set_nonblocking(false),
            Stream::Tcp(s) => s.set_nonblocking(false),
        };
        if let Err(e) = blocking {
            tracing::warn!(target: TARGET, error = %e, "cannot make the connection blocking; dropping it");
            continue;
        }
        if shared.active.load(Ordering::SeqCst) >= shared.config.max_connections {
            tracing::warn!(target: TARGET, max = shared.config.max_connections, "too many NBD connections; refusing one");
            continue;
        }
        spawn_connection(stream, &shared, &exports);
    }
}

fn spawn_connection(stream: Stream, shared: &Arc<Shared>, exports: &Arc<dyn ExportSet>) {
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let control = match stream.try_clone() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(target: TARGET, error = %e, "cannot clone the connection socket; dropping it");
            return;
        }
    };
    shared.active.fetch_add(1, Ordering::SeqCst);
    shared.total.fetch_add(1, Ordering::SeqCst);
    // Hold the map lock across spawn so the thread's own removal cannot run before insert.
    let mut conns = shared.conns.lock();
    let (s2, e2) = (shared.clone(), exports.clone());
    let spawned = thread::Builder::new().name(format!("nbd-conn-{id}")).spawn(move || {
        let peer = stream.peer();
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_connection(id, stream, e2, &s2.config)));
        if outcome.is_err() {
            tracing::error!(target: TARGET, conn = id, peer, "connection thread panicked; connection closed");
        }
        s2.conns.lock().remove(&id);
        s2.active.fetch_sub(1, Ordering::SeqCst);
    });
    match spawned {
        Ok(t) => {
            conns.insert(id, ConnEntry { stream: control, thread: Some(t) });
        }
        Err(e) => {
            shared.active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(target: TARGET, error = %e, "cannot start a connection thread; dropping the client");
        }
    }
}

fn run_connection(id: u64, mut stream: Stream, exports: Arc<dyn ExportSet>, config: &ServerConfig) {
    let peer = stream.peer();
    tracing::debug!(target: TARGET, conn = id, peer, "client connected");
    let negotiated = match negotiate(&mut stream, exports) {
        Ok(Some(n)) => n,
        Ok(None) => {
            tracing::debug!(target: TARGET, conn = id, "client left during the handshake");
            return;
        }
        Err(e) => {
            tracing::info!(target: TARGET, conn = id, peer, error = %e, cause = ?std::error::Error::source(&e).map(|s| s.to_string()), "handshake failed");
            return;
        }
    };
    let reader = match stream.try_clone() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(target: TARGET, conn = id, error = %e, "cannot clone the connection socket");
            return;
        }
    };
    let stats = Stats::default();
    let start = Instant::now();
    tracing::info!(target: TARGET, conn = id, peer, export = %negotiated.name, "transmission started");
    let result = serve_transmission(reader, &stream, &negotiated, &config.transmission, &stats);
    let _ = stream.shutdown(Shutdown::Both);
    let requests = stats.requests.load(Ordering::Relaxed);
    let errors = stats.errors.load(Ordering::Relaxed);
    let secs = start.elapsed().as_secs_f64();
    match result {
        Ok(ending) => {
            tracing::info!(target: TARGET, conn = id, export = %negotiated.name, ?ending, requests, errors, secs, "connection closed")
        }
        Err(e) => tracing::info!(target: TARGET, conn = id, export = %negotiated.name, error = %e,
            cause = ?std::error::Error::source(&e).map(|s| s.to_string()), requests, errors, secs, "connection ended with an error"),
    }
}
