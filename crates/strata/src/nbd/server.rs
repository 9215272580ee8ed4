//! NBD server: listening socket, accept thread, one thread per connection, graceful shutdown.
//!
//! Blocking and thread-based, like the rest of the library. The accept thread `poll`s the
//! listener together with a self-pipe, so `ServerHandle::shutdown` wakes it without
//! connecting to itself or relying on platform quirks of `shutdown()` on a listener. Each
//! connection thread runs the handshake (`handshake::negotiate`) and then the transmission
//! phase (`transmission::serve_transmission`, which adds its own worker threads). A failure on
//! one connection, including a panic inside an export, ends only that connection.
//!
//! Admission keeps clients that never finish the handshake from locking others out. The
//! accept thread only decides and spawns, so no handshake can block it. A connection in
//! handshake holds a handshake slot, not one of the `max_connections` slots: there are
//! `max_handshakes` of those in all and `max_handshakes_per_client` per client (an IP address,
//! an IPv6 /64, or a Unix peer uid other than the server's own and root's). A client over a
//! cap is closed at once. Every handshake read and write waits at most until the connection's
//! handshake deadline (`handshake_timeout` after accept), so a silent, trickling or stalled
//! client is closed then, and the handshake threads are bounded by `max_handshakes`.
//!
//! Shutdown: stop accepting, half-close every connection for reading (clients see no new
//! replies to requests they send after that, but everything already received is answered),
//! wait up to `shutdown_grace` for connections to finish, then close the rest outright.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream,
};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::export::ExportSet;
use super::handshake::{negotiate, NegotiateError};
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
    /// Connections in transmission at once. A client that connects while this many are
    /// established is closed at accept; connections still in handshake do not count.
    pub max_connections: usize,
    /// Longest a connection may take from accept to entering transmission. Every handshake
    /// read and write waits at most until then, and the connection is closed when it passes.
    pub handshake_timeout: Duration,
    /// Connections in handshake at once, over all clients; further clients are closed at
    /// accept. This bounds the handshake threads.
    pub max_handshakes: usize,
    /// Connections in handshake at once from one client: one IPv4 address or IPv6 /64 over
    /// TCP, one peer uid over a Unix socket (except the server's own uid and root, which can
    /// stop the server anyway). Further connections from that client are closed at accept.
    pub max_handshakes_per_client: usize,
    /// How long shutdown waits for connections to finish their queued requests.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            transmission: TransmissionConfig::default(),
            max_connections: 128,
            handshake_timeout: Duration::from_secs(10),
            max_handshakes: 256,
            max_handshakes_per_client: 16,
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

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }

    /// The peer, for log lines and for the per-client handshake cap.
    fn identify(&self) -> Peer {
        match self {
            Stream::Unix(s) => match peer_cred(s) {
                Some(c) => Peer {
                    name: format!("unix uid {} pid {}", c.uid, c.pid),
                    // SAFETY: geteuid has no preconditions and cannot fail.
                    key: (c.uid != 0 && c.uid != unsafe { libc::geteuid() })
                        .then_some(PeerKey::Uid(c.uid)),
                },
                None => Peer { name: "unix".into(), key: None },
            },
            Stream::Tcp(s) => match s.peer_addr() {
                Ok(a) => Peer { name: a.to_string(), key: Some(PeerKey::from_ip(a.ip())) },
                Err(_) => Peer { name: "tcp".into(), key: None },
            },
        }
    }
}

/// Who is on the other end of a connection.
struct Peer {
    name: String,
    /// What the per-client handshake cap counts by; `None` is not capped per client.
    key: Option<PeerKey>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum PeerKey {
    /// An IPv4 address, or the /64 prefix of an IPv6 one (the smallest block a site gets, so
    /// one client cannot dodge the cap by cycling addresses inside it).
    Ip(IpAddr),
    Uid(u32),
}

impl PeerKey {
    fn from_ip(ip: IpAddr) -> PeerKey {
        match ip {
            IpAddr::V4(_) => PeerKey::Ip(ip),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerKey::Ip(IpAddr::V4(v4)),
                None => {
                    PeerKey::Ip(IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))))
                }
            },
        }
    }
}

/// The credentials of a Unix socket's peer (SO_PEERCRED), as of its `connect`.
fn peer_cred(s: &UnixStream) -> Option<libc::ucred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid for writes of the sizes passed.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0 && len as usize == std::mem::size_of::<libc::ucred>()).then_some(cred)
}

/// The handshake's view of a connection: every read and write waits at most until `deadline`,
/// and one that would wait longer fails with `TimedOut`. The socket timeout is set from the
/// time left before each call, so a client that trickles bytes gains nothing.
struct Deadlined<'a> {
    stream: &'a Stream,
    deadline: Instant,
}

impl Deadlined<'_> {
    fn time_left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        Ok(left)
    }
}

/// A blocking socket whose timeout expires reports `WouldBlock`; name it for what it is.
fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::ErrorKind::TimedOut.into()
    } else {
        e
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.time_left()?))?;
        let r = match self.stream {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
        };
        r.map_err(timed_out)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.time_left()?))?;
        let mut w = self.stream;
        w.write(buf).map_err(timed_out)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
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
        let shared = Arc::new(Shared::new(self.config.clone()));
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
    /// Connections open, in handshake or in transmission.
    active: AtomicUsize,
    /// Connections in transmission (at most `max_connections`).
    established: AtomicUsize,
    handshakes: Mutex<Handshakes>,
    total: AtomicU64,
    handshake_timeouts: AtomicU64,
    refused: AtomicU64,
    config: ServerConfig,
}

impl Shared {
    fn new(config: ServerConfig) -> Shared {
        Shared {
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            active: AtomicUsize::new(0),
            established: AtomicUsize::new(0),
            handshakes: Mutex::new(Handshakes::default()),
            total: AtomicU64::new(0),
            handshake_timeouts: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            config,
        }
    }
}

/// Connections in handshake, in all and per client.
#[derive(Default)]
struct Handshakes {
    all: usize,
    per_client: HashMap<PeerKey, usize>,
}

/// Why a connection is refused at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    Established,
    Handshakes,
    ClientHandshakes,
}

/// A connection's place among those in handshake; dropping it gives the place back.
struct HandshakeSlot {
    shared: Arc<Shared>,
    key: Option<PeerKey>,
}

impl HandshakeSlot {
    fn take(shared: &Arc<Shared>, key: Option<PeerKey>) -> Result<HandshakeSlot, Refusal> {
        let cfg = &shared.config;
        if shared.established.load(Ordering::SeqCst) >= cfg.max_connections {
            return Err(Refusal::Established);
        }
        let mut h = shared.handshakes.lock();
        if h.all >= cfg.max_handshakes {
            return Err(Refusal::Handshakes);
        }
        if let Some(k) = key {
            let n = h.per_client.entry(k).or_insert(0);
            if *n >= cfg.max_handshakes_per_client {
                return Err(Refusal::ClientHandshakes);
            }
            *n += 1;
        }
        h.all += 1;
        Ok(HandshakeSlot { shared: shared.clone(), key })
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut h = self.shared.handshakes.lock();
        h.all -= 1;
        if let Some(k) = self.key {
            if let Some(n) = h.per_client.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    h.per_client.remove(&k);
                }
            }
        }
    }
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

    /// Connections currently open, in handshake or in transmission.
    pub fn active_connections(&self) -> usize {
        self.shared.active.load(Ordering::SeqCst)
    }

    /// Connections currently in handshake.
    pub fn handshaking_connections(&self) -> usize {
        self.shared.handshakes.lock().all
    }

    /// Connections closed because they did not finish the handshake within
    /// `handshake_timeout`, since start.
    pub fn handshake_timeouts(&self) -> u64 {
        self.shared.handshake_timeouts.load(Ordering::SeqCst)
    }

    /// Connections closed at accept (or right after the handshake) because a cap was
    /// reached, since start.
    pub fn refused_connections(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
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
        let deadline = Instant::now() + shared.config.handshake_timeout;
        let peer = stream.identify();
        let slot = match HandshakeSlot::take(&shared, peer.key) {
            Ok(slot) => slot,
            Err(why) => {
                shared.refused.fetch_add(1, Ordering::SeqCst);
                let cfg = &shared.config;
                let peer = peer.name;
                match why {
                    Refusal::Established => {
                        tracing::warn!(target: TARGET, peer, max = cfg.max_connections,
                        "too many NBD connections; refusing one")
                    }
                    Refusal::Handshakes => {
                        tracing::warn!(target: TARGET, peer, max = cfg.max_handshakes,
                        "too many NBD connections in handshake; refusing one")
                    }
                    Refusal::ClientHandshakes => {
                        tracing::warn!(target: TARGET, peer, max = cfg.max_handshakes_per_client,
                        "too many NBD connections in handshake from this client; refusing one")
                    }
                }
                continue;
            }
        };
        spawn_connection(stream, peer.name, slot, deadline, &shared, &exports);
    }
}

fn spawn_connection(
    stream: Stream,
    peer: String,
    slot: HandshakeSlot,
    deadline: Instant,
    shared: &Arc<Shared>,
    exports: &Arc<dyn ExportSet>,
) {
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
        let conn = Conn { id, peer: &peer, deadline, shared: &s2 };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_connection(&conn, stream, slot, e2)
        }));
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

/// What a connection thread knows about its connection besides the socket.
struct Conn<'a> {
    id: u64,
    peer: &'a str,
    deadline: Instant,
    shared: &'a Shared,
}

/// Counts the connection as established for as long as it lives.
struct Established<'a>(&'a Shared);

impl Drop for Established<'_> {
    fn drop(&mut self) {
        self.0.established.fetch_sub(1, Ordering::SeqCst);
    }
}

fn run_connection(conn: &Conn, stream: Stream, slot: HandshakeSlot, exports: Arc<dyn ExportSet>) {
    let (id, peer, shared) = (conn.id, conn.peer, conn.shared);
    let config = &shared.config;
    tracing::debug!(target: TARGET, conn = id, peer, "client connected");
    let outcome = negotiate(&mut Deadlined { stream: &stream, deadline: conn.deadline }, exports);
    drop(slot);
    let negotiated = match outcome {
        Ok(Some(n)) => n,
        Ok(None) => {
            tracing::debug!(target: TARGET, conn = id, "client left during the handshake");
            return;
        }
        Err(NegotiateError::Io { source, .. }) if source.kind() == io::ErrorKind::TimedOut => {
            shared.handshake_timeouts.fetch_add(1, Ordering::SeqCst);
            tracing::warn!(target: TARGET, conn = id, peer, timeout_secs = config.handshake_timeout.as_secs_f64(),
                "client did not finish the NBD handshake in time; closing the connection");
            return;
        }
        Err(e) => {
            tracing::info!(target: TARGET, conn = id, peer, error = %e, cause = ?std::error::Error::source(&e).map(|s| s.to_string()), "handshake failed");
            return;
        }
    };
    // Connections in handshake are not counted against `max_connections`, so a full server
    // can have admitted several that finish together: the ones past the cap are closed here.
    let max = config.max_connections;
    if shared
        .established
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < max).then_some(n + 1))
        .is_err()
    {
        shared.refused.fetch_add(1, Ordering::SeqCst);
        tracing::warn!(target: TARGET, conn = id, peer, max, "too many NBD connections; closing one after its handshake");
        return;
    }
    let _established = Established(shared);
    if let Err(e) = stream.set_read_timeout(None).and_then(|()| stream.set_write_timeout(None)) {
        tracing::warn!(target: TARGET, conn = id, error = %e, "cannot clear the handshake timeouts");
        return;
    }
    let reader = match stream.try_clone() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(target: TARGET, conn = id, error = %e, "cannot clone the connection socket");
            return;
        }
    };
    // Ends the connection from elsewhere (a withdrawn export): the reader sees EOF.
    let hangup: super::export::Hangup = match stream.try_clone() {
        Ok(s) => Arc::new(move || {
            let _ = s.shutdown(Shutdown::Read);
        }),
        Err(e) => {
            tracing::warn!(target: TARGET, conn = id, error = %e, "cannot clone the connection socket");
            return;
        }
    };
    let stats = Stats::default();
    let start = Instant::now();
    tracing::info!(target: TARGET, conn = id, peer, export = %negotiated.name, "transmission started");
    let result =
        serve_transmission(reader, &stream, &negotiated, &config.transmission, &stats, &hangup);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_keys_group_ipv6_by_64_and_unmap_ipv4() {
        let key = |s: &str| PeerKey::from_ip(s.parse().unwrap());
        assert_eq!(key("192.0.2.7"), PeerKey::Ip("192.0.2.7".parse().unwrap()));
        assert_eq!(key("::ffff:192.0.2.7"), key("192.0.2.7"));
        assert_eq!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff:ffff:ffff:ffff"));
        assert_eq!(key("2001:db8:1:2::1"), PeerKey::Ip("2001:db8:1:2::".parse().unwrap()));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
    }

    #[test]
    fn handshake_slots_are_capped_in_all_and_per_client_and_given_back() {
        let config = ServerConfig {
            max_connections: 2,
            max_handshakes: 3,
            max_handshakes_per_client: 2,
            ..ServerConfig::default()
        };
        let shared = Arc::new(Shared::new(config));
        let (a, b) = (Some(PeerKey::Uid(1000)), Some(PeerKey::Uid(1001)));
        let a1 = HandshakeSlot::take(&shared, a).unwrap();
        let a2 = HandshakeSlot::take(&shared, a).unwrap();
        assert_eq!(HandshakeSlot::take(&shared, a).err(), Some(Refusal::ClientHandshakes));
        let b1 = HandshakeSlot::take(&shared, b).unwrap();
        assert_eq!(HandshakeSlot::take(&shared, None).err(), Some(Refusal::Handshakes));
        drop(a1);
        let a3 = HandshakeSlot::take(&shared, a).unwrap();
        drop((a2, a3, b1));
        assert_eq!(shared.handshakes.lock().all, 0);
        assert!(shared.handshakes.lock().per_client.is_empty());
        shared.established.store(2, Ordering::SeqCst);
        assert_eq!(HandshakeSlot::take(&shared, b).err(), Some(Refusal::Established));
    }
}
