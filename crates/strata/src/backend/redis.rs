//! Redis backend (single node or cluster): objects as Redis strings, for hot memory pages (a
//! NoSQL dirty-page store) and small shared stores.
//!
//! Shape, and why:
//! - One object is one string key (`[PREFIX/]KEY`). `put` is `SET` (atomic: Redis executes one
//!   command at a time), `put_if_absent` is `SET NX` (atomic across all clients, the base for
//!   leases), `delete` is `UNLINK` (a 8 MiB pack is freed off the server's main thread).
//! - `get_range` and `head` are small Lua scripts, so bounds and existence are checked in the
//!   same atomic step as the read and each costs one round trip: `GETRANGE` alone cannot tell a
//!   missing key from an empty object, and clamps ranges past the end instead of failing.
//! - `list` is `SCAN MATCH PREFIX*` on every master (a cluster spreads keys over its masters by
//!   hash slot, and SCAN only sees the node it runs on), then `STRLEN` for the sizes, pipelined.
//! - Cluster mode is detected (`INFO cluster`), not configured: `redis://HOST:PORT` of any node.
//! - Durability. Redis acknowledges a write once it is in memory; whether it also reached disk
//!   depends on the server's `appendonly`/`appendfsync`. With `appendonly yes` and
//!   `appendfsync always`, Redis fsyncs the AOF before it sends the reply, so every acknowledged
//!   write is durable and `sync` has nothing left to do. The default mode [`Durability::Fsync`]
//!   checks that configuration on every master at open and refuses a server that lacks it, with
//!   the two `CONFIG SET` commands as the fix. [`Durability::Volatile`] (`?durability=volatile`)
//!   accepts any server for data the caller can lose (a cache of hot pages); `persistent` is then
//!   false. We do not emulate durability with `SAVE`/`BGSAVE` in `sync`: rewriting the whole
//!   dataset per flush costs O(dataset), not O(write).
//! - Preferred pack size 8 MiB: Redis runs commands one at a time, so a `SET` of a large value
//!   stalls every other client while it is copied and (with `appendfsync always`) fsynced; 8 MiB
//!   keeps that stall to a few ms while still amortising the per-command cost. Values are capped
//!   by Redis at 512 MB (`proto-max-bulk-len`).
//! - Connections: a small pool of blocking connections with connect and I/O timeouts, so a dead
//!   server is an `Unavailable` error in seconds, not a hang. A connection that saw an I/O error
//!   is dropped, not reused. No retries here; compose with [`super::retry`].

use super::{validate_key, BResult, Backend, BackendError, Capabilities, ErrorKind, ObjectInfo};
use parking_lot::Mutex;
use redis::{ConnectionAddr, ConnectionInfo, ConnectionLike, IntoConnectionInfo, Value};
use std::time::Duration;

const TARGET: &str = "strata::backend::redis";

/// Pack size the store should use on Redis (see the module comment).
pub const REDIS_PACK_SIZE: u64 = 8 << 20;
/// Largest Redis string (default `proto-max-bulk-len`).
pub(crate) const REDIS_MAX_OBJECT: u64 = 512 << 20;
const POOL_IDLE: usize = 16;

/// What `sync` may promise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Require `appendonly yes` + `appendfsync always` on every master (checked at open).
    Fsync,
    /// Accept any persistence setting: data may be lost when a server dies.
    Volatile,
}

#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("Invalid Redis URL '{url}': {reason} (expected redis://[USER:PASSWORD@]HOST:PORT[/DB][?prefix=P&durability=volatile])")]
    BadUrl { url: String, reason: String },
    #[error("Cannot reach Redis at {addr}: check the address and that redis-server is running")]
    Unreachable {
        addr: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("Redis at {addr} refused the credentials: put the right USER:PASSWORD in the URL")]
    Auth {
        addr: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("Redis at {addr} is not durable (appendonly={appendonly}, appendfsync={appendfsync}): run `redis-cli -h HOST -p PORT CONFIG SET appendonly yes` and `CONFIG SET appendfsync always` (and persist them in redis.conf), or add ?durability=volatile if losing data is acceptable")]
    NotDurable { addr: String, appendonly: String, appendfsync: String },
    #[error("Cannot read the persistence settings of Redis at {addr} (is CONFIG disabled?): add ?durability=volatile to use it anyway")]
    ConfigUnreadable {
        addr: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("Redis cluster at {addr} lists no reachable master")]
    NoMasters { addr: String },
    #[error("Redis at {addr} failed during {op}")]
    Command {
        addr: String,
        op: &'static str,
        #[source]
        source: redis::RedisError,
    },
}

/// Where the objects live and what to promise.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    /// `redis://[USER:PASSWORD@]HOST:PORT[/DB]` without our query options.
    pub url: String,
    /// Key prefix (no trailing `/`), so several stores can share one server; may be empty.
    pub prefix: String,
    pub durability: Durability,
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
}

impl RedisConfig {
    /// Parse `redis://HOST:PORT[/DB][?prefix=P&durability=fsync|volatile]`. Pure, for tests and fuzzing.
    pub fn from_url(url: &str) -> Result<RedisConfig, RedisError> {
        let bad =
            |reason: &str| RedisError::BadUrl { url: url.to_string(), reason: reason.to_string() };
        if !url.starts_with("redis://") {
            return Err(bad("it must start with redis://"));
        }
        let (base, query) = match url.split_once('?') {
            Some((b, q)) => (b, q),
            None => (url, ""),
        };
        let mut cfg = RedisConfig {
            url: base.to_string(),
            prefix: String::new(),
            durability: Durability::Fsync,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
        };
        for kv in query.split('&').filter(|s| !s.is_empty()) {
            match kv.split_once('=') {
                Some(("prefix", p)) => {
                    let p = p.trim_matches('/');
                    if !p.is_empty() && validate_key(p).is_err() {
                        return Err(bad(
                            "the prefix may hold only letters, digits, '._@=+-' and '/'",
                        ));
                    }
                    cfg.prefix = p.to_string();
                }
                Some(("durability", "fsync")) => cfg.durability = Durability::Fsync,
                Some(("durability", "volatile")) => cfg.durability = Durability::Volatile,
                Some(("durability", _)) => return Err(bad("durability must be fsync or volatile")),
                _ => return Err(bad("unknown option (known: prefix, durability)")),
            }
        }
        base.into_connection_info().map_err(|e| bad(&e.to_string()))?;
        Ok(cfg)
    }
}

enum Conn {
    Single(redis::Connection),
    Cluster(Box<redis::cluster::ClusterConnection>),
}

impl Conn {
    fn cx(&mut self) -> &mut dyn ConnectionLike {
        match self {
            Conn::Single(c) => c,
            Conn::Cluster(c) => &mut **c,
        }
    }
}

/// Objects in Redis.
pub struct RedisBackend {
    cfg: RedisConfig,
    info: ConnectionInfo,
    cluster: Option<redis::cluster::ClusterClient>,
    client: redis::Client,
    pool: Mutex<Vec<Conn>>,
    range_script: redis::Script,
    head_script: redis::Script,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("addr", &self.addr())
            .field("prefix", &self.cfg.prefix)
            .field("cluster", &self.cluster.is_some())
            .field("durability", &self.cfg.durability)
            .finish()
    }
}

/// Returns the bytes, or -1 when the key is missing, -2 when the range is out of bounds.
const RANGE_LUA: &str = r#"
local n = redis.call('STRLEN', KEYS[1])
if n == 0 and redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local off = tonumber(ARGV[1])
local len = tonumber(ARGV[2])
if off + len > n then return -2 end
if len == 0 then return '' end
return redis.call('GETRANGE', KEYS[1], off, off + len - 1)
"#;

/// Returns the size, or -1 when the key is missing.
const HEAD_LUA: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return redis.call('STRLEN', KEYS[1])
"#;

impl RedisBackend {
    /// Connect, detect cluster mode and check durability.
    pub fn open(cfg: RedisConfig) -> Result<RedisBackend, RedisError> {
        let bad = |reason: String| RedisError::BadUrl { url: cfg.url.clone(), reason };
        let info = cfg.url.as_str().into_connection_info().map_err(|e| bad(e.to_string()))?;
        let addr = addr_of(&info);
        let client = redis::Client::open(info.clone()).map_err(|e| bad(e.to_string()))?;
        let mut first = client
            .get_connection_with_timeout(cfg.connect_timeout)
            .map_err(|e| open_error(&addr, e))?;
        first.set_read_timeout(Some(cfg.io_timeout)).ok();
        first.set_write_timeout(Some(cfg.io_timeout)).ok();
        let cinfo: String = redis::cmd("INFO")
            .arg("cluster")
            .query(&mut first)
            .map_err(|e| open_error(&addr, e))?;
        let is_cluster = cinfo.lines().any(|l| l.trim() == "cluster_enabled:1");
        let cluster = if is_cluster {
            let c = redis::cluster::ClusterClient::builder(vec![info.clone()])
                .connection_timeout(cfg.connect_timeout)
                .response_timeout(cfg.io_timeout)
                .build()
                .map_err(|e| bad(e.to_string()))?;
            Some(c)
        } else {
            None
        };
        let be = RedisBackend {
            cfg,
            info,
            cluster,
            client,
            pool: Mutex::new(Vec::new()),
            range_script: redis::Script::new(RANGE_LUA),
            head_script: redis::Script::new(HEAD_LUA),
        };
        let masters = be.masters_with(&mut first)?;
        if be.cfg.durability == Durability::Fsync {
            for m in &masters {
                be.check_durable(m)?;
            }
        }
        if be.cluster.is_none() {
            be.pool.lock().push(Conn::Single(first));
        }
        tracing::debug!(target: TARGET, addr = %be.addr(), cluster = be.cluster.is_some(), masters = masters.len(), "opened");
        Ok(be)
    }

    pub fn config(&self) -> &RedisConfig {
        &self.cfg
    }

    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    fn addr(&self) -> String {
        addr_of(&self.info)
    }

    /// The masters' connection infos (just ours when not a cluster).
    fn masters_with(&self, c: &mut redis::Connection) -> Result<Vec<ConnectionInfo>, RedisError> {
        if self.cluster.is_none() {
            return Ok(vec![self.info.clone()]);
        }
        let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(c).map_err(|source| {
            RedisError::Command { addr: self.addr(), op: "CLUSTER NODES", source }
        })?;
        let out: Vec<ConnectionInfo> = parse_cluster_masters(&nodes)
            .into_iter()
            .map(|(host, port)| self.info.clone().set_addr(ConnectionAddr::Tcp(host, port)))
            .collect();
        if out.is_empty() {
            return Err(RedisError::NoMasters { addr: self.addr() });
        }
        Ok(out)
    }

    fn node_conn(&self, info: &ConnectionInfo) -> Result<redis::Connection, redis::RedisError> {
        let c = redis::Client::open(info.clone())?
            .get_connection_with_timeout(self.cfg.connect_timeout)?;
        c.set_read_timeout(Some(self.cfg.io_timeout))?;
        c.set_write_timeout(Some(self.cfg.io_timeout))?;
        Ok(c)
    }

    fn check_durable(&self, node: &ConnectionInfo) -> Result<(), RedisError> {
        let addr = addr_of(node);
        let mut c = self.node_conn(node).map_err(|e| open_error(&addr, e))?;
        let get = |c: &mut redis::Connection, name: &str| -> Result<String, RedisError> {
            let v: Vec<String> =
                redis::cmd("CONFIG").arg("GET").arg(name).query(c).map_err(|source| {
                    RedisError::ConfigUnreadable { addr: addr.clone(), source }
                })?;
            Ok(v.get(1).cloned().unwrap_or_default())
        };
        let appendonly = get(&mut c, "appendonly")?;
        let appendfsync = get(&mut c, "appendfsync")?;
        if appendonly != "yes" || appendfsync != "always" {
            return Err(RedisError::NotDurable { addr, appendonly, appendfsync });
        }
        Ok(())
    }

    fn full_key(&self, key: &str) -> BResult<String> {
        validate_key(key)?;
        Ok(if self.cfg.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.cfg.prefix)
        })
    }

    fn connect(&self) -> redis::RedisResult<Conn> {
        match &self.cluster {
            Some(cc) => Ok(Conn::Cluster(Box::new(cc.get_connection()?))),
            None => {
                let c = self.client.get_connection_with_timeout(self.cfg.connect_timeout)?;
                c.set_read_timeout(Some(self.cfg.io_timeout))?;
                c.set_write_timeout(Some(self.cfg.io_timeout))?;
                Ok(Conn::Single(c))
            }
        }
    }

    /// Run `f` on a pooled connection; a connection that failed at the I/O level is dropped.
    fn with<T>(
        &self,
        op: &'static str,
        key: &str,
        f: impl FnOnce(&mut dyn ConnectionLike) -> redis::RedisResult<T>,
    ) -> BResult<T> {
        let pooled = self.pool.lock().pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.connect().map_err(|e| to_backend(op, key, e))?,
        };
        match f(conn.cx()) {
            Ok(v) => {
                self.give_back(conn);
                Ok(v)
            }
            Err(e) => {
                if !(e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_dropped()
                    || e.is_unrecoverable_error())
                {
                    self.give_back(conn);
                }
                Err(to_backend(op, key, e))
            }
        }
    }

    fn give_back(&self, conn: Conn) {
        let mut p = self.pool.lock();
        if p.len() < POOL_IDLE {
            p.push(conn);
        }
    }
}

/// `host:port` of a connection info, for messages.
fn addr_of(info: &ConnectionInfo) -> String {
    match info.addr() {
        ConnectionAddr::Tcp(h, p) => format!("{h}:{p}"),
        other => other.to_string(),
    }
}

fn open_error(addr: &str, e: redis::RedisError) -> RedisError {
    let kind = classify(&e);
    match kind {
        ErrorKind::PermissionDenied => RedisError::Auth { addr: addr.to_string(), source: e },
        ErrorKind::Unavailable => RedisError::Unreachable { addr: addr.to_string(), source: e },
        _ => RedisError::Command { addr: addr.to_string(), op: "connect", source: e },
    }
}

/// Masters (`host`, `port`) from `CLUSTER NODES` output. Pure, for tests and fuzzing.
pub fn parse_cluster_masters(nodes: &str) -> Vec<(String, u16)> {
    let mut out = Vec::new();
    for line in nodes.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 3 {
            continue;
        }
        let flags: Vec<&str> = f[2].split(',').collect();
        if !flags.contains(&"master")
            || flags.iter().any(|x| matches!(*x, "fail" | "fail?" | "noaddr" | "handshake"))
        {
            continue;
        }
        // ip:port@cport[,hostname]
        let hostport = f[1].split(['@', ',']).next().unwrap_or("");
        if let Some((host, port)) = hostport.rsplit_once(':') {
            if let (false, Ok(port)) = (host.is_empty(), port.parse::<u16>()) {
                if port != 0 {
                    out.push((host.trim_matches(['[', ']']).to_string(), port));
                }
            }
        }
    }
    out
}

/// What a caller can do about a Redis failure.
fn classify(e: &redis::RedisError) -> ErrorKind {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        return ErrorKind::Unavailable;
    }
    let code = e.code().unwrap_or("");
    match e.kind() {
        K::AuthenticationFailed | K::Server(S::NoPerm) => ErrorKind::PermissionDenied,
        K::Server(
            S::BusyLoading
            | S::TryAgain
            | S::ClusterDown
            | S::MasterDown
            | S::Moved
            | S::Ask
            | S::ReadOnly,
        ) => ErrorKind::Unavailable,
        K::ClusterConnectionNotFound => ErrorKind::Unavailable,
        _ if matches!(code, "NOAUTH" | "WRONGPASS" | "NOPERM") => ErrorKind::PermissionDenied,
        _ if code == "OOM" => ErrorKind::NoSpace,
        _ if code == "MISCONF" => ErrorKind::Unavailable,
        _ => ErrorKind::Other,
    }
}

fn to_backend(op: &'static str, key: &str, e: redis::RedisError) -> BackendError {
    let kind = classify(&e);
    tracing::debug!(target: TARGET, op, key, ?kind, error = %e, "command failed");
    BackendError::with_source(kind, op, key, e)
}

impl Backend for RedisBackend {
    fn name(&self) -> String {
        let p = if self.cfg.prefix.is_empty() {
            String::new()
        } else {
            format!("?prefix={}", self.cfg.prefix)
        };
        format!("redis://{}{p}", self.addr())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            native_range: true,
            persistent: self.cfg.durability == Durability::Fsync,
            max_object_size: REDIS_MAX_OBJECT,
            preferred_pack_size: REDIS_PACK_SIZE,
            network: true,
        }
    }

    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        let k = self.full_key(key)?;
        let v: Option<Vec<u8>> = self.with("get", key, |c| redis::cmd("GET").arg(&k).query(c))?;
        v.ok_or_else(|| BackendError::new(ErrorKind::NotFound, "get", key))
    }

    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        let k = self.full_key(key)?;
        if offset.checked_add(len).is_none_or(|e| e > REDIS_MAX_OBJECT) {
            return Err(BackendError::new(ErrorKind::Invalid, "get_range", key));
        }
        let v: Value = self
            .with("get_range", key, |c| self.range_script.key(&k).arg(offset).arg(len).invoke(c))?;
        match v {
            Value::BulkString(b) if b.len() as u64 == len => Ok(b),
            Value::Okay | Value::SimpleString(_) if len == 0 => Ok(Vec::new()),
            Value::Int(-1) => Err(BackendError::new(ErrorKind::NotFound, "get_range", key)),
            _ => Err(BackendError::new(ErrorKind::Invalid, "get_range", key)),
        }
    }

    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        let k = self.full_key(key)?;
        if data.len() as u64 > REDIS_MAX_OBJECT {
            return Err(BackendError::new(ErrorKind::Invalid, "put", key));
        }
        self.with("put", key, |c| redis::cmd("SET").arg(&k).arg(data).query::<()>(c))
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        let k = self.full_key(key)?;
        let r: Option<String> = self.with("put_if_absent", key, |c| {
            redis::cmd("SET").arg(&k).arg(data).arg("NX").query(c)
        })?;
        Ok(r.is_some())
    }

    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        let full_prefix = if self.cfg.prefix.is_empty() {
            prefix.to_string()
        } else {
            format!("{}/{prefix}", self.cfg.prefix)
        };
        let strip = if self.cfg.prefix.is_empty() { 0 } else { self.cfg.prefix.len() + 1 };
        let pattern = format!("{}*", glob_escape(&full_prefix));
        let nodes: Vec<ConnectionInfo> = match &self.cluster {
            None => vec![self.info.clone()],
            Some(_) => {
                let mut c =
                    self.node_conn(&self.info).map_err(|e| to_backend("list", prefix, e))?;
                self.masters_with(&mut c).map_err(|e| {
                    BackendError::with_source(ErrorKind::Unavailable, "list", prefix, e)
                })?
            }
        };
        let mut out = Vec::new();
        for node in &nodes {
            let mut c = self.node_conn(node).map_err(|e| to_backend("list", prefix, e))?;
            let mut cursor: u64 = 0;
            loop {
                let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .query(&mut c)
                    .map_err(|e| to_backend("list", prefix, e))?;
                let keys: Vec<String> = keys
                    .into_iter()
                    .filter_map(|k| String::from_utf8(k).ok())
                    .filter(|k| k.starts_with(&full_prefix))
                    .collect();
                if !keys.is_empty() {
                    let mut p = redis::pipe();
                    for k in &keys {
                        p.cmd("STRLEN").arg(k);
                    }
                    let sizes: Vec<u64> =
                        p.query(&mut c).map_err(|e| to_backend("list", prefix, e))?;
                    for (k, size) in keys.into_iter().zip(sizes) {
                        let key = k[strip..].to_string();
                        if validate_key(&key).is_ok() {
                            out.push(ObjectInfo { key, size });
                        }
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(out)
    }

    fn delete(&self, key: &str) -> BResult<()> {
        let k = self.full_key(key)?;
        self.with("delete", key, |c| redis::cmd("UNLINK").arg(&k).query::<i64>(c)).map(|_| ())
    }

    /// In `Fsync` mode the server fsyncs before it replies, so every acknowledged write is
    /// already durable; in `Volatile` mode nothing can be promised. Either way there is nothing
    /// to do here beyond checking that the server is still there.
    fn sync(&self) -> BResult<()> {
        self.with("sync", "", |c| redis::cmd("PING").query::<String>(c)).map(|_| ())
    }

    fn head(&self, key: &str) -> BResult<Option<u64>> {
        let k = self.full_key(key)?;
        let n: i64 = self.with("head", key, |c| self.head_script.key(&k).invoke(c))?;
        Ok(u64::try_from(n).ok())
    }
}

/// Escape Redis glob metacharacters (our keys never contain them; defence in depth).
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        if matches!(ch, '*' | '?' | '[' | ']' | '\\' | '^') {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_with_options() {
        let c = RedisConfig::from_url("redis://127.0.0.1:6379").unwrap();
        assert_eq!(
            (c.url.as_str(), c.prefix.as_str(), c.durability),
            ("redis://127.0.0.1:6379", "", Durability::Fsync)
        );
        let c = RedisConfig::from_url("redis://h:1/2?prefix=/vdi/a/&durability=volatile").unwrap();
        assert_eq!(
            (c.url.as_str(), c.prefix.as_str(), c.durability),
            ("redis://h:1/2", "vdi/a", Durability::Volatile)
        );
        for bad in [
            "http://h:1",
            "redis://h:1?durability=maybe",
            "redis://h:1?colour=red",
            "redis://h:1?prefix=a//b",
        ] {
            let e = RedisConfig::from_url(bad).unwrap_err();
            assert!(e.to_string().contains("redis://[USER:PASSWORD@]HOST:PORT"), "{bad}: {e}");
        }
    }

    #[test]
    fn cluster_nodes_output_yields_live_masters() {
        let out = "\
07c3 127.0.0.1:30004@40004 slave e7d1 0 1426238317239 4 connected
67ed 127.0.0.1:30002@40002 master - 0 1426238316232 2 connected 5461-10922
292f 127.0.0.1:30003@40003,node-3 master - 0 1426238318243 3 connected 10923-16383
e7d1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460
dead 127.0.0.1:30005@40005 master,fail - 0 0 1 disconnected
9999 :0@0 myself,master - 0 0 0 connected
[::1]
";
        let m = parse_cluster_masters(out);
        assert_eq!(
            m,
            [
                ("127.0.0.1".to_string(), 30002),
                ("127.0.0.1".into(), 30003),
                ("127.0.0.1".into(), 30001)
            ]
        );
    }

    #[test]
    fn glob_metacharacters_are_escaped() {
        assert_eq!(glob_escape("packs/a*b?[c]"), "packs/a\\*b\\?\\[c\\]");
    }
}
