//! A host's view of a store: which backend it lives in, and the host-local SSD cache in front.
//!
//! `--store DIR` always names a directory on this host. For the embedded default the directory
//! *is* the backend (it holds `config`, `packs/`, `refs/` ...). For a remote store it holds only
//! host-local state: `host.json` naming the backend and the cache, the metadata cache
//! (`.meta/meta.redb`), disk write logs and the NBD socket. Everything a second host needs to
//! read the store is in the backend; `host.json` is the only thing `strata init` writes locally.
//!
//! `host.json` (documented in `docs/backends.md`): `{"format": 1, "backend": "s3://b/p",
//! "cache": {"dir": "/ssd/strata-cache", "size": 21474836480}}`, at most 64 KiB. Credentials
//! are never written there: they come from the `AWS_*` environment at every start.
//!
//! Opening builds the stack bottom-up: backend (S3/Redis, behind retries) -> SSD cache
//! (unless `--no-cache`) -> store. The cache fills from pack uploads too (write-through), cut
//! into frames so a later read of one chunk hits.

use crate::backend::cache::{CacheBackend, CacheCounters, CacheError, CacheOptions, Splitter};
use crate::backend::open::{open_location, parse_location, Location, OpenError};
use crate::backend::retry::RetryPolicy;
use crate::backend::DynBackend;
use crate::store::{local_meta_path, InitOptions, Store, StoreError};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(crate) const HOST_FILE: &str = "host.json";
pub(crate) const HOST_FORMAT: u32 = 1;
const MAX_HOST_FILE: u64 = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("Cannot open the cache")]
    Cache(#[from] CacheError),
    #[error("Cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid host config ({detail}); fix it or re-run `strata init --backend ...`")]
    BadConfig { path: PathBuf, detail: String },
    #[error("{dir} already belongs to a store; use another --store directory")]
    DirInUse { dir: PathBuf },
    #[error("Not a strata store: {dir} has neither a store nor a host.json; create one with `strata init --store {dir}` (add --backend s3://BUCKET or redis://HOST:PORT for a remote store)")]
    NotAStore { dir: PathBuf },
    #[error("--cache needs a remote --backend: a local store is already on local disk")]
    CacheOnLocal,
}

pub type Result<T> = std::result::Result<T, HostError>;

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheConfig {
    pub dir: PathBuf,
    pub size: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HostConfig {
    pub format: u32,
    /// What `--backend` said: `s3://BUCKET[/PREFIX]` or `redis://HOST:PORT`.
    pub backend: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheConfig>,
}

impl HostConfig {
    pub fn read(dir: &Path) -> Result<Option<HostConfig>> {
        let path = dir.join(HOST_FILE);
        let bytes = match std::fs::metadata(&path) {
            Ok(m) if m.len() > MAX_HOST_FILE => {
                return Err(HostError::BadConfig {
                    path,
                    detail: format!("larger than {MAX_HOST_FILE} bytes"),
                })
            }
            Ok(_) => std::fs::read(&path).map_err(|source| HostError::Io {
                op: "read",
                path: path.clone(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(HostError::Io { op: "stat", path, source }),
        };
        let c: HostConfig = serde_json::from_slice(&bytes)
            .map_err(|e| HostError::BadConfig { path: path.clone(), detail: e.to_string() })?;
        if c.format != HOST_FORMAT {
            return Err(HostError::BadConfig {
                path,
                detail: format!("format {} (this strata reads {HOST_FORMAT})", c.format),
            });
        }
        if !matches!(parse_location(&c.backend), Ok(Location::S3(_) | Location::Redis(_))) {
            return Err(HostError::BadConfig {
                path,
                detail: format!("backend '{}' is not s3:// or redis://", c.backend),
            });
        }
        Ok(Some(c))
    }

    /// Write atomically (temp file, fsync, rename).
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(HOST_FILE);
        let tmp = dir.join(".host.json.tmp");
        let io = |op, p: &Path| {
            let p = p.to_path_buf();
            move |source| HostError::Io { op, path: p, source }
        };
        let mut body = serde_json::to_vec_pretty(self).expect("host config serializes");
        body.push(b'\n');
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).map_err(io("create", &tmp))?;
            f.write_all(&body).map_err(io("write", &tmp))?;
            f.sync_all().map_err(io("sync", &tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(io("rename", &path))?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

/// How to open.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Bypass the SSD cache (`serve --no-cache`, for comparisons).
    pub no_cache: bool,
}

/// An open store plus what sits under it on this host.
pub struct Host {
    pub store: Store,
    pub cache: Option<Arc<CacheBackend>>,
    /// None for a local store.
    pub config: Option<HostConfig>,
    pub dir: PathBuf,
}

impl Host {
    pub fn cache_counters(&self) -> Option<CacheCounters> {
        self.cache.as_ref().map(|c| c.counters())
    }
    pub fn is_remote(&self) -> bool {
        self.config.is_some()
    }
}

/// Cut an uploaded pack into its frames, so the cache holds what readers will ask for.
pub fn pack_splitter() -> Splitter {
    Arc::new(|key: &str, data: &[u8]| {
        if !key.starts_with("packs/") {
            return Vec::new();
        }
        match crate::store::pack::parse_pack(data) {
            Ok((_, entries)) => {
                let mut r: Vec<(u64, u64)> =
                    entries.iter().map(|e| (e.frame_off, e.frame_len as u64)).collect();
                r.sort_unstable();
                r.dedup();
                r
            }
            Err(_) => Vec::new(),
        }
    })
}

fn stack(config: &HostConfig, no_cache: bool) -> Result<(DynBackend, Option<Arc<CacheBackend>>)> {
    let remote = open_location(&config.backend, Some(RetryPolicy::default()))?;
    match (&config.cache, no_cache) {
        (Some(c), false) => {
            let mut opts = CacheOptions::new(c.size);
            opts.splitter = Some(pack_splitter());
            match CacheBackend::open(remote.clone(), &c.dir, opts) {
                Ok(cache) => {
                    let cache = Arc::new(cache);
                    Ok((cache.clone() as DynBackend, Some(cache)))
                }
                // One process per cache file: a second strata command beside `strata serve`
                // goes to the backend directly (reads miss, writes were write-through anyway).
                Err(CacheError::InUse { dir }) => {
                    tracing::info!(target: "strata::host", dir = %dir.display(),
                        "cache in use by another strata process; this one reads the backend directly");
                    Ok((remote, None))
                }
                Err(e) => Err(e.into()),
            }
        }
        _ => Ok((remote, None)),
    }
}

/// Create a store: locally in `dir` (backend None), or in a remote backend with `dir` holding
/// this host's state. If the remote backend already holds a store, this host joins it.
/// Returns the open host and whether the store was newly created.
pub fn init(
    dir: &Path,
    backend: Option<&str>,
    cache: Option<CacheConfig>,
    opts: InitOptions,
) -> Result<(Host, bool)> {
    let Some(spec) = backend else {
        if cache.is_some() {
            return Err(HostError::CacheOnLocal);
        }
        let store = Store::init_local(dir, opts)?;
        return Ok((Host { store, cache: None, config: None, dir: dir.to_path_buf() }, true));
    };
    match parse_location(spec)? {
        Location::Local(p) => {
            if cache.is_some() {
                return Err(HostError::CacheOnLocal);
            }
            let store = Store::init_local(&p, opts)?;
            return Ok((Host { store, cache: None, config: None, dir: p }, true));
        }
        Location::S3(_) | Location::Redis(_) => {}
    }
    if dir.join("config").exists() || HostConfig::read(dir)?.is_some() {
        return Err(HostError::DirInUse { dir: dir.to_path_buf() });
    }
    std::fs::create_dir_all(dir).map_err(|source| HostError::Io {
        op: "create",
        path: dir.to_path_buf(),
        source,
    })?;
    let config = HostConfig { format: HOST_FORMAT, backend: spec.to_string(), cache };
    let (backend, cache) = stack(&config, false)?;
    let meta = local_meta_path(dir);
    let (store, created) = match Store::init(backend.clone(), &meta, opts) {
        Ok(s) => (s, true),
        Err(StoreError::AlreadyExists { .. }) => (Store::open(backend, &meta)?, false),
        Err(e) => return Err(e.into()),
    };
    // Written last: a failed init leaves no host.json pointing at nothing.
    config.write(dir)?;
    Ok((Host { store, cache, config: Some(config), dir: dir.to_path_buf() }, created))
}

/// Open the store `dir` names: a local store, or the remote one its `host.json` points at.
pub fn open(dir: &Path, o: &OpenOptions) -> Result<Host> {
    if let Some(config) = HostConfig::read(dir)? {
        let (backend, cache) = stack(&config, o.no_cache)?;
        let store = Store::open(backend, &local_meta_path(dir))?;
        return Ok(Host { store, cache, config: Some(config), dir: dir.to_path_buf() });
    }
    if !dir.join("config").is_file() {
        return Err(HostError::NotAStore { dir: dir.to_path_buf() });
    }
    let store = Store::open_local(dir)?;
    Ok(Host { store, cache: None, config: None, dir: dir.to_path_buf() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_config_round_trips_and_rejects_junk() {
        let d = tempfile::tempdir().unwrap();
        assert!(HostConfig::read(d.path()).unwrap().is_none());
        let c = HostConfig {
            format: HOST_FORMAT,
            backend: "s3://bucket/prefix".into(),
            cache: Some(CacheConfig { dir: "/ssd/c".into(), size: 1 << 30 }),
        };
        c.write(d.path()).unwrap();
        assert_eq!(HostConfig::read(d.path()).unwrap(), Some(c));
        let text = std::fs::read_to_string(d.path().join(HOST_FILE)).unwrap();
        assert!(text.contains("\"backend\": \"s3://bucket/prefix\""), "{text}");
        for bad in [
            "{}",
            "not json",
            r#"{"format": 2, "backend": "s3://b"}"#,
            r#"{"format": 1, "backend": "/local/dir"}"#,
        ] {
            std::fs::write(d.path().join(HOST_FILE), bad).unwrap();
            let e = HostConfig::read(d.path()).unwrap_err();
            assert!(e.to_string().contains("strata init --backend"), "{e}");
        }
        std::fs::write(d.path().join(HOST_FILE), vec![b' '; (MAX_HOST_FILE + 1) as usize]).unwrap();
        assert!(HostConfig::read(d.path()).is_err());
    }

    #[test]
    fn local_init_and_open() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("s");
        let (h, created) = init(&dir, None, None, InitOptions::default()).unwrap();
        assert!(created && !h.is_remote());
        drop(h);
        let h = open(&dir, &OpenOptions::default()).unwrap();
        assert!(h.cache.is_none());
        let e = open(&d.path().join("nothing"), &OpenOptions::default()).err().unwrap();
        assert!(e.to_string().contains("strata init"), "{e}");
        let e = init(
            &d.path().join("x"),
            None,
            Some(CacheConfig { dir: "/tmp".into(), size: 1 << 20 }),
            InitOptions::default(),
        )
        .err()
        .unwrap();
        assert!(matches!(e, HostError::CacheOnLocal));
    }
}
