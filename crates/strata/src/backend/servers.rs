//! Real storage servers for tests and benchmarks: versitygw (S3, posix backend) and
//! redis-server (single node or cluster), started on loopback and killed on drop.
//!
//! The project tests against real peers, never mocks, and the remote benchmarks need the same
//! servers inside the storage-host namespace, so the launchers live here, next to the backends
//! they serve, rather than in one test file. Each launcher picks free ports, keeps its data in
//! a directory the caller owns, waits until the server answers, and can `kill` (SIGKILL: a
//! crash, not a shutdown) and `restart` on the same port and data, which is what the crash
//! tests need. Nothing here is used on the data path of strata itself.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TARGET: &str = "strata::backend::servers";

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{program} is not installed: {hint}")]
    Missing { program: String, hint: &'static str },
    #[error("Cannot start {program}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} did not become ready on {addr} within {secs} s (log: {log})")]
    NotReady { program: String, addr: String, secs: u64, log: String },
    #[error("{what} failed: {detail}")]
    Setup { what: &'static str, detail: String },
    #[error("I/O error while preparing {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A loopback port nobody listens on right now (and, if `with_bus`, neither on port + 10000,
/// which Redis cluster uses for its bus).
pub fn free_port(with_bus: bool) -> u16 {
    for _ in 0..200 {
        let Ok(l) = TcpListener::bind("127.0.0.1:0") else { continue };
        let Ok(addr) = l.local_addr() else { continue };
        let port = addr.port();
        if !with_bus {
            return port;
        }
        if port < 55535 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
    0
}

/// Where a program is: `$PATH`, then `~/go/bin` (where `go install` puts versitygw).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    if let Some(gobin) = std::env::var_os("GOBIN") {
        dirs.push(PathBuf::from(gobin));
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join("go/bin"));
    }
    dirs.push(PathBuf::from("/root/go/bin"));
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

fn wait_tcp(addr: SocketAddr, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

fn kill_child(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let start = s.len().saturating_sub(800);
    format!("{}: ...{}", path.display(), s.get(start..).unwrap_or(""))
}

/// versitygw serving `root` (a directory; each bucket is a subdirectory) over S3 on loopback.
#[derive(Debug)]
pub struct S3Server {
    pub root: PathBuf,
    pub port: u16,
    pub access_key: String,
    pub secret_key: String,
    bin: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Bind address; 127.0.0.1 unless started with [`S3Server::start_on`].
    pub host: String,
}

impl S3Server {
    /// Start versitygw on a free loopback port with random credentials.
    pub fn start(root: &Path) -> Result<S3Server, ServerError> {
        S3Server::start_on(root, "127.0.0.1", free_port(false))
    }

    /// Start on a given address (the storage-host namespace binds its veth address).
    pub fn start_on(root: &Path, host: &str, port: u16) -> Result<S3Server, ServerError> {
        let bin = find_program("versitygw").ok_or(ServerError::Missing {
            program: "versitygw".into(),
            hint: "run scripts/setup.sh (go install github.com/versity/versitygw/cmd/versitygw@v1.8.0)",
        })?;
        std::fs::create_dir_all(root)
            .map_err(|source| ServerError::Io { path: root.to_path_buf(), source })?;
        let mut s = S3Server {
            root: root.to_path_buf(),
            port,
            access_key: format!("strata{:08x}", rand::random::<u32>()),
            secret_key: format!("{:032x}", rand::random::<u128>()),
            bin,
            log: root.with_extension("versitygw.log"),
            child: None,
            host: host.to_string(),
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> Result<(), ServerError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|source| ServerError::Io { path: self.log.clone(), source })?;
        let log2 =
            log.try_clone().map_err(|source| ServerError::Io { path: self.log.clone(), source })?;
        let child = Command::new(&self.bin)
            .arg("--access")
            .arg(&self.access_key)
            .arg("--secret")
            .arg(&self.secret_key)
            .arg("--port")
            .arg(format!("{}:{}", self.host, self.port))
            .arg("--quiet")
            // HTTP keep-alive, as AWS S3, MinIO and Ceph RGW keep connections open; versitygw
            // defaults to `Connection: close`, which costs every request a new TCP connection
            // (and its slow start through the benchmarks' shaped link).
            .arg("--keep-alive")
            .arg("posix")
            .arg(&self.root)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|source| ServerError::Spawn { program: "versitygw".into(), source })?;
        self.child = Some(child);
        let addr: SocketAddr = format!("{}:{}", self.host, self.port).parse().map_err(|_| {
            ServerError::Setup { what: "address", detail: format!("{}:{}", self.host, self.port) }
        })?;
        if !wait_tcp(addr, Duration::from_secs(20)) {
            kill_child(&mut self.child);
            return Err(ServerError::NotReady {
                program: "versitygw".into(),
                addr: addr.to_string(),
                secs: 20,
                log: tail(&self.log),
            });
        }
        tracing::debug!(target: TARGET, %addr, "versitygw ready");
        Ok(())
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }

    /// Create a bucket: with the posix backend a bucket is a directory of the root.
    pub fn create_bucket(&self, name: &str) -> Result<(), ServerError> {
        let p = self.root.join(name);
        std::fs::create_dir_all(&p).map_err(|source| ServerError::Io { path: p, source })
    }

    /// The `AWS_*` variables a client needs, as (name, value) pairs.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_key.clone()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }

    /// Client configuration for `s3://bucket[/prefix]` on this server.
    pub fn config(&self, url: &str) -> Result<super::s3::S3Config, super::s3::S3Error> {
        let env = self.env();
        super::s3::S3Config::from_url_with(url, |k| {
            env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
        })
    }

    /// SIGKILL the server (a crash: no shutdown handling).
    pub fn kill(&mut self) {
        kill_child(&mut self.child);
    }

    /// Start again on the same port and data.
    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.kill();
        self.spawn()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}

/// One redis-server process.
#[derive(Debug)]
pub struct RedisServer {
    pub dir: PathBuf,
    pub port: u16,
    pub host: String,
    cluster: bool,
    durable: bool,
    child: Option<Child>,
}

impl RedisServer {
    /// Start redis-server on a free loopback port, keeping its files in `dir`. `durable` turns
    /// on `appendonly yes` + `appendfsync always` (what `Durability::Fsync` requires).
    pub fn start(dir: &Path, durable: bool) -> Result<RedisServer, ServerError> {
        RedisServer::start_with(dir, "127.0.0.1", free_port(false), durable, false)
    }

    pub fn start_with(
        dir: &Path,
        host: &str,
        port: u16,
        durable: bool,
        cluster: bool,
    ) -> Result<RedisServer, ServerError> {
        std::fs::create_dir_all(dir)
            .map_err(|source| ServerError::Io { path: dir.to_path_buf(), source })?;
        let mut s = RedisServer {
            dir: dir.to_path_buf(),
            port,
            host: host.to_string(),
            cluster,
            durable,
            child: None,
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> Result<(), ServerError> {
        let bin = find_program("redis-server").ok_or(ServerError::Missing {
            program: "redis-server".into(),
            hint: "apt-get install redis-server",
        })?;
        let mut cmd = Command::new(bin);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg(&self.host)
            .arg("--dir")
            .arg(&self.dir)
            .arg("--save")
            .arg("")
            .arg("--protected-mode")
            .arg("no")
            .arg("--daemonize")
            .arg("no")
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .arg("--appendonly")
            .arg(if self.durable { "yes" } else { "no" })
            .arg("--appendfsync")
            .arg(if self.durable { "always" } else { "everysec" });
        if self.cluster {
            cmd.arg("--cluster-enabled")
                .arg("yes")
                .arg("--cluster-config-file")
                .arg(self.dir.join("nodes.conf"));
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| ServerError::Spawn { program: "redis-server".into(), source })?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.ping() {
                tracing::debug!(target: TARGET, port = self.port, "redis-server ready");
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        kill_child(&mut self.child);
        Err(ServerError::NotReady {
            program: "redis-server".into(),
            addr: self.addr(),
            secs: 20,
            log: tail(&self.dir.join("redis.log")),
        })
    }

    /// Does the server answer PING (and has it finished loading its AOF)?
    pub fn ping(&self) -> bool {
        matches!(raw_command(&self.addr(), &["PING"]), Ok(r) if r.starts_with("+PONG"))
    }

    pub fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr())
    }

    /// SIGKILL (a crash; the AOF keeps what was fsynced).
    pub fn kill(&mut self) {
        kill_child(&mut self.child);
    }

    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.kill();
        self.spawn()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}

/// A Redis cluster of `n` masters without replicas, built with `redis-cli --cluster create`.
#[derive(Debug)]
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(dir: &Path, n: usize, durable: bool) -> Result<RedisCluster, ServerError> {
        let mut nodes = Vec::new();
        for i in 0..n {
            let port = free_port(true);
            nodes.push(RedisServer::start_with(
                &dir.join(format!("node{i}")),
                "127.0.0.1",
                port,
                durable,
                true,
            )?);
        }
        let cli = find_program("redis-cli").ok_or(ServerError::Missing {
            program: "redis-cli".into(),
            hint: "apt-get install redis-tools",
        })?;
        let out = Command::new(cli)
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(RedisServer::addr))
            .arg("--cluster-replicas")
            .arg("0")
            .arg("--cluster-yes")
            .output()
            .map_err(|source| ServerError::Spawn { program: "redis-cli".into(), source })?;
        if !out.status.success() {
            return Err(ServerError::Setup {
                what: "redis-cli --cluster create",
                detail: String::from_utf8_lossy(&out.stdout)
                    .chars()
                    .rev()
                    .take(600)
                    .collect::<String>()
                    .chars()
                    .rev()
                    .collect(),
            });
        }
        let c = RedisCluster { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let ok = c.nodes.iter().all(|n| {
                raw_command(&n.addr(), &["CLUSTER", "INFO"])
                    .is_ok_and(|r| r.contains("cluster_state:ok"))
            });
            if ok {
                return Ok(c);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(ServerError::Setup {
            what: "redis cluster",
            detail: "cluster_state never became ok".into(),
        })
    }

    /// URL of the first node (any node works: the backend discovers the rest).
    pub fn url(&self) -> String {
        self.nodes[0].url()
    }
}

/// Send one command in RESP and return the raw reply text (enough for PING/INFO in launchers,
/// which must not depend on the client library under test).
pub fn raw_command(addr: &str, args: &[&str]) -> std::io::Result<String> {
    let sock: SocketAddr = addr.parse().map_err(|_| std::io::Error::other("bad address"))?;
    let mut s = TcpStream::connect_timeout(&sock, Duration::from_millis(500))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    s.write_all(req.as_bytes())?;
    let mut buf = vec![0u8; 65536];
    let mut got = 0;
    // One reply: a line, or a bulk string whose length the first line gives.
    loop {
        let n = s.read(&mut buf[got..])?;
        if n == 0 {
            break;
        }
        got += n;
        let text = String::from_utf8_lossy(&buf[..got]);
        if let Some(rest) = text.strip_prefix('$') {
            if let Some((len, body)) = rest.split_once("\r\n") {
                if len.parse::<usize>().is_ok_and(|l| body.len() >= l + 2) {
                    break;
                }
                continue;
            }
            continue;
        }
        if text.ends_with("\r\n") {
            break;
        }
        if got == buf.len() {
            break;
        }
    }
    Ok(String::from_utf8_lossy(&buf[..got]).into_owned())
}
