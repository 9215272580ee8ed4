//! S3-compatible object storage backend (AWS S3, versitygw, MinIO, Ceph RGW ...), through the
//! `object_store` crate.
//!
//! Shape, and why:
//! - The [`Backend`] trait is blocking and `object_store` is async, so the backend owns a small
//!   private tokio runtime. Every call spawns its future on that runtime and waits on a std
//!   channel. Unlike `Runtime::block_on`, this cannot panic when the caller is itself inside
//!   another tokio runtime (an NBD server task, a test's `#[tokio::test]`): it only blocks the
//!   calling thread, as every other backend does.
//! - Keys map 1:1 to object keys under an optional prefix (`s3://BUCKET/PREFIX`). `get_range` is
//!   one ranged GET, so a chunk read never fetches its whole pack (`native_range`).
//! - `put` is a single PUT of the whole object: S3 makes it atomic (a reader sees the old or the
//!   new object, never a part). Packs stay below the 5 GiB single-PUT limit, so multipart upload
//!   (which is not atomic until completion and leaves debris when interrupted) is never needed.
//! - `put_if_absent` is a PUT with `If-None-Match: *`. AWS S3 has honoured it since 2024-08;
//!   versitygw v1.8.0 evaluates it under a per-key publish lock (backend/posix/objlock.go), so two
//!   racing writers cannot both win. A server that ignores the header would let both win: the
//!   conformance suite's race test detects that, and such servers are unsupported for leases.
//! - `sync` is a no-op: S3 acknowledges a PUT only once the object is durable (that is S3's
//!   contract; versitygw's posix backend writes through the page cache and survives its own
//!   crash, not a power cut of the storage host). Every acknowledged put is therefore already as
//!   durable as this backend can make it.
//! - No retries in here: `object_store`'s own retry loop is disabled so that transient failures
//!   surface as `ErrorKind::Unavailable` and the [`super::retry`] decorator, which knows which
//!   operations are safe to repeat and counts what it does, is the one place that retries.
//! - Preferred pack size 16 MiB: a pack is uploaded only once it is sealed, so the pack size
//!   is also how much data waits for the link at the end of a save (64 MiB packs left a
//!   256 MiB save's whole upload after the stream, measured by `bench save-restore
//!   --remote`); a PUT's fixed cost (a round trip plus the server's request overhead) is
//!   hidden by the store writer keeping several uploads in flight (`store::writer::UPLOADS`). Reads are range GETs, so the
//!   pack size costs nothing on the read path.
//! - Errors at open name the fix: missing credentials, a missing bucket, wrong credentials, an
//!   unreachable endpoint, an `http://` endpoint without `AWS_ALLOW_HTTP=true`.

use super::{validate_key, BResult, Backend, BackendError, Capabilities, ErrorKind, ObjectInfo};
use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::client::{HttpError, HttpErrorKind};
use object_store::path::Path as OsPath;
use object_store::{
    ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig,
};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A shared pack buffer as an HTTP body (`Bytes::from_owner`).
struct SharedBuf(Arc<Vec<u8>>);

impl AsRef<[u8]> for SharedBuf {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

const TARGET: &str = "strata::backend::s3";

/// Largest single PUT S3 accepts.
pub(crate) const S3_MAX_OBJECT: u64 = 5 << 30;
/// Pack size the store should use on object storage (see the module comment).
pub const S3_PACK_SIZE: u64 = 16 << 20;

/// Failures to configure or reach an S3 endpoint, each naming the fix.
#[derive(Debug, thiserror::Error)]
pub enum S3Error {
    #[error("Invalid S3 URL '{url}': {reason} (expected s3://BUCKET[/PREFIX])")]
    BadUrl { url: String, reason: &'static str },
    #[error("No S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")]
    MissingCredentials,
    #[error(
        "Endpoint {endpoint} is plain http: set AWS_ALLOW_HTTP=true to allow it, or use https"
    )]
    HttpNotAllowed { endpoint: String },
    #[error("Bucket '{bucket}' does not exist at {endpoint}: create it (e.g. `aws s3 mb s3://{bucket}`) or fix the name")]
    NoSuchBucket { bucket: String, endpoint: String },
    #[error("S3 at {endpoint} rejected the credentials for bucket '{bucket}': check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")]
    BadCredentials {
        bucket: String,
        endpoint: String,
        #[source]
        source: object_store::Error,
    },
    #[error(
        "Cannot reach S3 at {endpoint}: check AWS_ENDPOINT_URL and that the server is running"
    )]
    Unreachable {
        endpoint: String,
        #[source]
        source: object_store::Error,
    },
    #[error("S3 client setup failed for bucket '{bucket}'")]
    Client {
        bucket: String,
        #[source]
        source: object_store::Error,
    },
    #[error("Cannot start the S3 I/O runtime")]
    Runtime(#[source] std::io::Error),
    #[error("S3 request for '{key}' was abandoned (the I/O runtime stopped)")]
    Abandoned { key: String },
}

/// Where and how to reach the bucket. Build it with [`S3Config::from_url`] (reads `AWS_*`).
#[derive(Clone)]
pub struct S3Config {
    pub bucket: String,
    /// Key prefix inside the bucket, without leading or trailing `/` (may be empty).
    pub prefix: String,
    /// `AWS_ENDPOINT_URL`; None means AWS itself.
    pub endpoint: Option<String>,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
    pub allow_http: bool,
    pub connect_timeout: Duration,
    /// Whole-request timeout; generous because a pack over a slow link takes seconds.
    pub request_timeout: Duration,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("allow_http", &self.allow_http)
            .finish_non_exhaustive()
    }
}

/// Split `s3://BUCKET[/PREFIX]` into bucket and prefix. Pure, for tests and fuzzing.
pub fn parse_s3_url(url: &str) -> Result<(String, String), S3Error> {
    let bad = |reason| S3Error::BadUrl { url: url.to_string(), reason };
    let rest = url.strip_prefix("s3://").ok_or_else(|| bad("it must start with s3://"))?;
    let (bucket, prefix) = match rest.split_once('/') {
        Some((b, p)) => (b, p.trim_matches('/')),
        None => (rest, ""),
    };
    // S3 bucket naming rules: 3-63 chars of lowercase letters, digits, '-' and '.'.
    let ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.')
        && !bucket.starts_with(['-', '.'])
        && !bucket.ends_with(['-', '.']);
    if !ok {
        return Err(bad("the bucket name must be 3-63 lowercase letters, digits, '-' or '.'"));
    }
    if !prefix.is_empty() && validate_key(prefix).is_err() {
        return Err(bad("the prefix may hold only letters, digits, '._@=+-' and '/' separators"));
    }
    Ok((bucket.to_string(), prefix.to_string()))
}

impl S3Config {
    /// Configuration from a URL and the standard `AWS_*` environment variables.
    pub fn from_url(url: &str) -> Result<S3Config, S3Error> {
        S3Config::from_url_with(url, |k| std::env::var(k).ok())
    }

    /// Like [`S3Config::from_url`], reading variables through `env` (tests pass a map).
    pub fn from_url_with(
        url: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<S3Config, S3Error> {
        let (bucket, prefix) = parse_s3_url(url)?;
        let get = |k: &str| env(k).filter(|v| !v.is_empty());
        let access_key_id = get("AWS_ACCESS_KEY_ID").ok_or(S3Error::MissingCredentials)?;
        let secret_access_key = get("AWS_SECRET_ACCESS_KEY").ok_or(S3Error::MissingCredentials)?;
        let endpoint = get("AWS_ENDPOINT_URL").or_else(|| get("AWS_ENDPOINT_URL_S3"));
        let allow_http = get("AWS_ALLOW_HTTP")
            .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "yes"));
        let region = get("AWS_REGION")
            .or_else(|| get("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".into());
        Ok(S3Config {
            bucket,
            prefix,
            endpoint,
            region,
            access_key_id,
            secret_access_key,
            session_token: get("AWS_SESSION_TOKEN"),
            allow_http,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(300),
        })
    }

    fn endpoint_label(&self) -> String {
        self.endpoint.clone().unwrap_or_else(|| format!("s3.{}.amazonaws.com", self.region))
    }
}

/// Object storage reached over the S3 API.
pub struct S3Backend {
    store: Arc<AmazonS3>,
    rt: Option<tokio::runtime::Runtime>,
    cfg: S3Config,
}

impl std::fmt::Debug for S3Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Backend").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

impl Drop for S3Backend {
    fn drop(&mut self) {
        // Never blocks, so dropping the backend inside an async context cannot panic.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl S3Backend {
    /// Connect and check that the bucket exists and the credentials work (one LIST request).
    pub fn open(cfg: S3Config) -> Result<S3Backend, S3Error> {
        if let Some(ep) = &cfg.endpoint {
            if ep.starts_with("http://") && !cfg.allow_http {
                return Err(S3Error::HttpNotAllowed { endpoint: ep.clone() });
            }
        }
        let mut client = ClientOptions::new()
            .with_connect_timeout(cfg.connect_timeout)
            .with_timeout(cfg.request_timeout)
            .with_pool_max_idle_per_host(32);
        if cfg.allow_http {
            client = client.with_allow_http(true);
        }
        let retry = RetryConfig {
            max_retries: 0,
            retry_timeout: cfg.request_timeout,
            ..RetryConfig::default()
        };
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&cfg.bucket)
            .with_region(&cfg.region)
            .with_access_key_id(&cfg.access_key_id)
            .with_secret_access_key(&cfg.secret_access_key)
            .with_client_options(client)
            .with_retry(retry)
            // No SHA-256 of every body (client and server each hash it, which costs a core
            // at link speed on a small host): packs carry frame CRCs and every chunk is checked
            // against its BLAKE3 id when read, so a body damaged in transit is still caught.
            .with_unsigned_payload(true)
            .with_virtual_hosted_style_request(false);
        if let Some(ep) = &cfg.endpoint {
            b = b.with_endpoint(ep).with_allow_http(cfg.allow_http);
        }
        if let Some(t) = &cfg.session_token {
            b = b.with_token(t);
        }
        let store = Arc::new(
            b.build().map_err(|source| S3Error::Client { bucket: cfg.bucket.clone(), source })?,
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("strata-s3")
            .enable_all()
            .build()
            .map_err(S3Error::Runtime)?;
        let be = S3Backend { store, rt: Some(rt), cfg };
        be.probe()?;
        tracing::debug!(target: TARGET, bucket = %be.cfg.bucket, endpoint = %be.cfg.endpoint_label(), "opened");
        Ok(be)
    }

    /// One LIST of the prefix: tells a missing bucket, bad credentials and a dead server apart.
    fn probe(&self) -> Result<(), S3Error> {
        let store = self.store.clone();
        let prefix =
            (!self.cfg.prefix.is_empty()).then(|| OsPath::from_iter(self.cfg.prefix.split('/')));
        let res = self
            .run(async move { store.list_with_delimiter(prefix.as_ref()).await })
            .ok_or(S3Error::Abandoned { key: String::new() })?;
        let endpoint = self.cfg.endpoint_label();
        let bucket = self.cfg.bucket.clone();
        match res {
            Ok(_) => Ok(()),
            Err(e) if classify(&e) == ErrorKind::PermissionDenied => {
                Err(S3Error::BadCredentials { bucket, endpoint, source: e })
            }
            Err(e)
                if mentions(&e, "NoSuchBucket")
                    || matches!(e, object_store::Error::NotFound { .. }) =>
            {
                Err(S3Error::NoSuchBucket { bucket, endpoint })
            }
            Err(e) if classify(&e) == ErrorKind::Unavailable => {
                Err(S3Error::Unreachable { endpoint, source: e })
            }
            Err(source) => Err(S3Error::Client { bucket, source }),
        }
    }

    pub fn config(&self) -> &S3Config {
        &self.cfg
    }

    /// Run a future on the private runtime from any thread (see the module comment).
    fn run<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> Option<T> {
        let rt = self.rt.as_ref()?;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().ok()
    }

    fn path(&self, key: &str) -> BResult<OsPath> {
        validate_key(key)?;
        let full = if self.cfg.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.cfg.prefix)
        };
        OsPath::parse(&full)
            .map_err(|e| BackendError::with_source(ErrorKind::Invalid, "validate", key, e))
    }

    fn call<T: Send + 'static>(
        &self,
        op: &'static str,
        key: &str,
        fut: impl Future<Output = object_store::Result<T>> + Send + 'static,
    ) -> BResult<T> {
        match self.run(fut) {
            Some(Ok(v)) => Ok(v),
            Some(Err(e)) => Err(self.error(op, key, e)),
            None => Err(BackendError::with_source(
                ErrorKind::Unavailable,
                op,
                key,
                S3Error::Abandoned { key: key.to_string() },
            )),
        }
    }

    fn error(&self, op: &'static str, key: &str, e: object_store::Error) -> BackendError {
        if mentions(&e, "NoSuchBucket") {
            let src = S3Error::NoSuchBucket {
                bucket: self.cfg.bucket.clone(),
                endpoint: self.cfg.endpoint_label(),
            };
            return BackendError::with_source(ErrorKind::Other, op, key, src);
        }
        let kind = classify(&e);
        tracing::debug!(target: TARGET, op, key, ?kind, error = %e, "request failed");
        BackendError::with_source(kind, op, key, e)
    }
}

/// Servers answer a range past the end with 416 or with a body object_store rejects: both
/// are the caller's `Invalid` range.
fn past_end(e: BackendError) -> BackendError {
    if e.kind == ErrorKind::Other && e.source.as_ref().is_some_and(|s| mentions(&**s, "range")) {
        return BackendError { kind: ErrorKind::Invalid, ..e };
    }
    e
}

/// Ranges closer than this are read by one GET (the gap is read and dropped): at 1 Gbit/s
/// 64 KiB take about 0.5 ms, less than a request's fixed cost.
const MERGE_GAP: u64 = 64 << 10;
/// Largest merged GET.
const MERGE_MAX: u64 = 8 << 20;
/// Merged GETs of one call in flight at once.
const MERGE_PARALLEL: usize = 8;

/// One GET covering several requested ranges (indexes into the request).
#[derive(Debug, PartialEq, Eq)]
struct Span {
    start: u64,
    end: u64,
    members: Vec<usize>,
}

/// Group ranges into spans: sorted by offset, a range joins the current span if it starts
/// within `gap` of its end and the span stays within `max` bytes. None on overflow.
fn merge_ranges(ranges: &[(u64, u64)], gap: u64, max: u64) -> Option<Vec<Span>> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i].0);
    let mut spans: Vec<Span> = Vec::new();
    for i in order {
        let (off, len) = ranges[i];
        let end = off.checked_add(len)?;
        match spans.last_mut() {
            Some(s) if off <= s.end.saturating_add(gap) && end.max(s.end) - s.start <= max => {
                s.end = s.end.max(end);
                s.members.push(i);
            }
            _ => spans.push(Span { start: off, end, members: vec![i] }),
        }
    }
    Some(spans)
}

/// Does the error chain's text contain `needle` (S3 error codes travel in response bodies)?
fn mentions(e: &(dyn std::error::Error + 'static), needle: &str) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.to_string().contains(needle) {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Map an `object_store` error to the backend error kinds (what the caller can do about it).
fn classify(e: &object_store::Error) -> ErrorKind {
    use object_store::Error as E;
    // S3 error codes that mean "these credentials are wrong", whatever the HTTP status
    // (versitygw answers an unknown access key with 404 XAdminUserNotFound).
    const BAD_CREDENTIALS: [&str; 4] =
        ["InvalidAccessKeyId", "SignatureDoesNotMatch", "XAdminUserNotFound", "AccessDenied"];
    if BAD_CREDENTIALS.iter().any(|c| mentions(e, c)) {
        return ErrorKind::PermissionDenied;
    }
    match e {
        E::NotFound { .. } => ErrorKind::NotFound,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => {
            if mentions(e, "QuotaExceeded") {
                ErrorKind::NoSpace
            } else {
                ErrorKind::PermissionDenied
            }
        }
        E::InvalidPath { .. } | E::NotSupported { .. } | E::NotImplemented { .. } => {
            ErrorKind::Invalid
        }
        _ => {
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
            while let Some(err) = cur {
                if let Some(h) = err.downcast_ref::<HttpError>() {
                    return match h.kind() {
                        HttpErrorKind::Connect
                        | HttpErrorKind::Request
                        | HttpErrorKind::Timeout
                        | HttpErrorKind::Interrupted => ErrorKind::Unavailable,
                        _ => ErrorKind::Other,
                    };
                }
                cur = err.source();
            }
            let text = e.to_string();
            if text.contains("InsufficientStorage")
                || text.contains("status code: 507")
                || text.contains("QuotaExceeded")
            {
                ErrorKind::NoSpace
            } else if text.contains("status code: 403") || text.contains("status code: 401") {
                ErrorKind::PermissionDenied
            } else if text.contains("status code: 416") || text.contains("InvalidRange") {
                ErrorKind::Invalid
            } else if text.contains("status code: 5")
                || text.contains("status code: 429")
                || text.contains("status code: 408")
                || text.contains("SlowDown")
            {
                ErrorKind::Unavailable
            } else {
                ErrorKind::Other
            }
        }
    }
}

impl Backend for S3Backend {
    fn name(&self) -> String {
        let p = if self.cfg.prefix.is_empty() {
            String::new()
        } else {
            format!("/{}", self.cfg.prefix)
        };
        format!("s3://{}{p}", self.cfg.bucket)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            native_range: true,
            persistent: true,
            max_object_size: S3_MAX_OBJECT,
            preferred_pack_size: S3_PACK_SIZE,
            network: true,
        }
    }

    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        let path = self.path(key)?;
        let store = self.store.clone();
        // `Vec::from` takes over the body's buffer when nothing else holds it: no copy into
        // fresh memory.
        let t = std::time::Instant::now();
        let r = self
            .call("get", key, async move { store.get(&path).await?.bytes().await })
            .map(Vec::from);
        tracing::debug!(target: TARGET, key, bytes = r.as_ref().map_or(0, |b| b.len()), ms = t.elapsed().as_secs_f64() * 1e3, ok = r.is_ok(), "get");
        r
    }

    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        let path = self.path(key)?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| BackendError::new(ErrorKind::Invalid, "get_range", key))?;
        if len == 0 {
            // An empty HTTP range cannot be expressed; check the bounds with a HEAD.
            let size = self
                .head(key)?
                .ok_or_else(|| BackendError::new(ErrorKind::NotFound, "get_range", key))?;
            return if offset <= size {
                Ok(Vec::new())
            } else {
                Err(BackendError::new(ErrorKind::Invalid, "get_range", key))
            };
        }
        let store = self.store.clone();
        let res = self.call("get_range", key, async move {
            let opts =
                GetOptions { range: Some(GetRange::Bounded(offset..end)), ..GetOptions::default() };
            let r = store.get_opts(&path, opts).await?;
            let size = r.meta.size;
            Ok((size, r.bytes().await?))
        });
        match res {
            Ok((size, bytes)) if end <= size && bytes.len() as u64 == len => Ok(Vec::from(bytes)),
            Ok(_) => Err(BackendError::new(ErrorKind::Invalid, "get_range", key)),
            Err(e) => Err(past_end(e)),
        }
    }

    /// The body's pieces are handed over as hyper receives them (no buffer of the whole range).
    fn get_range_to(
        &self,
        key: &str,
        offset: u64,
        len: u64,
        sink: &mut dyn FnMut(&[u8]),
    ) -> BResult<()> {
        if len == 0 {
            return self.get_range(key, offset, len).map(|_| ());
        }
        let path = self.path(key)?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| BackendError::new(ErrorKind::Invalid, "get_range", key))?;
        let abandoned = || {
            BackendError::with_source(
                ErrorKind::Unavailable,
                "get_range",
                key,
                S3Error::Abandoned { key: key.to_string() },
            )
        };
        let Some(rt) = self.rt.as_ref() else { return Err(abandoned()) };
        enum Msg {
            Piece(Bytes),
            Failed(object_store::Error),
            PastEnd,
            End,
        }
        // Unbounded: a send never blocks the runtime, and the range bounds what can queue.
        let (tx, rx) = std::sync::mpsc::channel::<Msg>();
        let store = self.store.clone();
        rt.spawn(async move {
            use futures::StreamExt;
            let opts =
                GetOptions { range: Some(GetRange::Bounded(offset..end)), ..GetOptions::default() };
            let r = match store.get_opts(&path, opts).await {
                Ok(r) => r,
                Err(e) => {
                    let _ = tx.send(Msg::Failed(e));
                    return;
                }
            };
            if r.meta.size < end {
                let _ = tx.send(Msg::PastEnd);
                return;
            }
            let mut body = r.into_stream();
            while let Some(piece) = body.next().await {
                let msg = match piece {
                    Ok(b) => Msg::Piece(b),
                    Err(e) => Msg::Failed(e),
                };
                let failed = matches!(msg, Msg::Failed(_));
                if tx.send(msg).is_err() || failed {
                    return;
                }
            }
            let _ = tx.send(Msg::End);
        });
        let mut got = 0u64;
        loop {
            match rx.recv() {
                Ok(Msg::Piece(b)) => {
                    got += b.len() as u64;
                    if got > len {
                        return Err(BackendError::new(ErrorKind::Invalid, "get_range", key));
                    }
                    sink(&b);
                }
                Ok(Msg::Failed(e)) => return Err(past_end(self.error("get_range", key, e))),
                Ok(Msg::PastEnd) => {
                    return Err(BackendError::new(ErrorKind::Invalid, "get_range", key))
                }
                Ok(Msg::End) if got == len => return Ok(()),
                Ok(Msg::End) => {
                    return Err(BackendError::new(ErrorKind::Invalid, "get_range", key))
                }
                // The runtime went away with the request (the backend is being dropped).
                Err(_) => return Err(abandoned()),
            }
        }
    }

    /// Nearby ranges are merged into one ranged GET (gaps up to [`MERGE_GAP`], at most
    /// [`MERGE_MAX`] per GET) and the GETs run concurrently: a sequential disk read of 16
    /// adjacent 64 KiB frames is one request instead of 16 in a row.
    fn get_ranges(&self, key: &str, ranges: &[(u64, u64)]) -> BResult<Vec<Vec<u8>>> {
        if ranges.len() <= 1 || ranges.iter().any(|&(_, l)| l == 0) {
            return ranges.iter().map(|&(o, l)| self.get_range(key, o, l)).collect();
        }
        let bad = || BackendError::new(ErrorKind::Invalid, "get_range", key);
        let spans = merge_ranges(ranges, MERGE_GAP, MERGE_MAX).ok_or_else(bad)?;
        let path = self.path(key)?;
        let store = self.store.clone();
        let want: Vec<(u64, u64)> = spans.iter().map(|s| (s.start, s.end)).collect();
        let got = self
            .call("get_range", key, async move {
                futures::stream::iter(want.into_iter().map(|(start, end)| {
                    let (store, path) = (store.clone(), path.clone());
                    async move {
                        let opts = GetOptions {
                            range: Some(GetRange::Bounded(start..end)),
                            ..GetOptions::default()
                        };
                        let r = store.get_opts(&path, opts).await?;
                        let size = r.meta.size;
                        Ok::<_, object_store::Error>((size, r.bytes().await?))
                    }
                }))
                .buffered(MERGE_PARALLEL)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<object_store::Result<Vec<_>>>()
            })
            .map_err(past_end)?;
        let mut out = vec![Vec::new(); ranges.len()];
        for (span, (size, bytes)) in spans.iter().zip(got) {
            if span.end > size || bytes.len() as u64 != span.end - span.start {
                return Err(bad());
            }
            for &i in &span.members {
                let (o, l) = ranges[i];
                let at = (o - span.start) as usize;
                out[i] = bytes[at..at + l as usize].to_vec();
            }
        }
        Ok(out)
    }

    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        let path = self.path(key)?;
        let store = self.store.clone();
        let payload = PutPayload::from(Bytes::copy_from_slice(data));
        let t = std::time::Instant::now();
        let r = self.call("put", key, async move { store.put(&path, payload).await }).map(|_| ());
        tracing::debug!(target: TARGET, key, bytes = data.len(), ms = t.elapsed().as_secs_f64() * 1e3, ok = r.is_ok(), "put");
        r
    }

    fn put_shared(&self, key: &str, data: &Arc<Vec<u8>>) -> BResult<()> {
        let path = self.path(key)?;
        let store = self.store.clone();
        // The body is the caller's buffer (no copy); the reference is gone when the put returns.
        let payload = PutPayload::from(Bytes::from_owner(SharedBuf(data.clone())));
        let t = std::time::Instant::now();
        let r = self.call("put", key, async move { store.put(&path, payload).await }).map(|_| ());
        tracing::debug!(target: TARGET, key, bytes = data.len(), ms = t.elapsed().as_secs_f64() * 1e3, ok = r.is_ok(), "put");
        r
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        let path = self.path(key)?;
        let store = self.store.clone();
        let payload = PutPayload::from(Bytes::copy_from_slice(data));
        let res = self.run(async move {
            let opts = PutOptions { mode: PutMode::Create, ..PutOptions::default() };
            store.put_opts(&path, payload, opts).await
        });
        match res {
            Some(Ok(_)) => Ok(true),
            Some(Err(object_store::Error::AlreadyExists { .. })) => Ok(false),
            Some(Err(e)) => Err(self.error("put_if_absent", key, e)),
            None => Err(BackendError::new(ErrorKind::Unavailable, "put_if_absent", key)),
        }
    }

    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        // object_store lists by directory; list the deepest directory the prefix names and keep
        // the keys that start with the prefix string ("conf/list" also matches "conf/listz").
        let dir = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let root = self.cfg.prefix.clone();
        let full_dir: Vec<String> = root
            .split('/')
            .chain(dir.split('/'))
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        let strip = if root.is_empty() { String::new() } else { format!("{root}/") };
        let want = format!("{strip}{prefix}");
        let store = self.store.clone();
        let metas = self.call("list", prefix, async move {
            let dir_path = (!full_dir.is_empty())
                .then(|| OsPath::from_iter(full_dir.iter().map(String::as_str)));
            let mut s = store.list(dir_path.as_ref());
            let mut out = Vec::new();
            while let Some(m) = s.next().await {
                let m = m?;
                let k = m.location.as_ref();
                if k.starts_with(&want) {
                    out.push(ObjectInfo { key: k[strip.len()..].to_string(), size: m.size });
                }
            }
            Ok(out)
        })?;
        Ok(metas.into_iter().filter(|o| validate_key(&o.key).is_ok()).collect())
    }

    fn delete(&self, key: &str) -> BResult<()> {
        let path = self.path(key)?;
        let store = self.store.clone();
        match self.call("delete", key, async move { store.delete(&path).await }) {
            Err(e) if e.kind == ErrorKind::NotFound => Ok(()),
            r => r,
        }
    }

    /// S3 acknowledges a PUT or DELETE once it is durable; nothing is left to flush.
    fn sync(&self) -> BResult<()> {
        Ok(())
    }

    fn head(&self, key: &str) -> BResult<Option<u64>> {
        let path = self.path(key)?;
        let store = self.store.clone();
        match self.call("head", key, async move { store.head(&path).await }) {
            Ok(m) => Ok(Some(m.size)),
            Err(e) if e.kind == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn nearby_ranges_merge_into_few_gets() {
        let k = 64 << 10;
        // Adjacent, out of order, one with a small gap, one far away, one overlapping.
        let r = [(2 * k, k), (0, k), (k, k), (3 * k + 100, 10), (100 * k, k), (100 * k + 5, 3)];
        let s = merge_ranges(&r, MERGE_GAP, MERGE_MAX).unwrap();
        assert_eq!(
            s,
            vec![
                Span { start: 0, end: 3 * k + 110, members: vec![1, 2, 0, 3] },
                Span { start: 100 * k, end: 101 * k, members: vec![4, 5] },
            ]
        );
        // The size cap splits a long run; a gap beyond the limit splits too.
        let run: Vec<(u64, u64)> = (0..200).map(|i| (i * k, k)).collect();
        let s = merge_ranges(&run, 0, MERGE_MAX).unwrap();
        assert_eq!(s.len(), 2, "12.5 MiB in spans of at most 8 MiB");
        assert!(s.iter().all(|x| x.end - x.start <= MERGE_MAX));
        assert_eq!(
            merge_ranges(&[(0, 10), (10 + MERGE_GAP + 1, 10)], MERGE_GAP, MERGE_MAX).unwrap().len(),
            2
        );
        assert!(merge_ranges(&[(u64::MAX, 2)], 0, MERGE_MAX).is_none());
    }

    #[test]
    fn urls_parse_to_bucket_and_prefix() {
        assert_eq!(parse_s3_url("s3://vdi-store").unwrap(), ("vdi-store".into(), "".into()));
        assert_eq!(
            parse_s3_url("s3://vdi.store/hosts/a/").unwrap(),
            ("vdi.store".into(), "hosts/a".into())
        );
        for bad in [
            "vdi",
            "s3://",
            "s3://Up",
            "s3://ab",
            "s3://-x-y",
            "s3://ok-bucket/a//b",
            "s3://ok-bucket/sp ace",
        ] {
            let e = parse_s3_url(bad).unwrap_err();
            assert!(e.to_string().contains("s3://BUCKET"), "{bad}: {e}");
        }
    }

    #[test]
    fn config_reads_the_standard_variables() {
        let env: HashMap<&str, &str> = [
            ("AWS_ACCESS_KEY_ID", "ak"),
            ("AWS_SECRET_ACCESS_KEY", "s3cr3t-value"),
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:7070"),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_REGION", "eu-west-3"),
        ]
        .into();
        let c =
            S3Config::from_url_with("s3://bkt/p", |k| env.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(
            (c.bucket.as_str(), c.prefix.as_str(), c.region.as_str()),
            ("bkt", "p", "eu-west-3")
        );
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:7070"));
        assert!(c.allow_http);
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("s3cr3t"), "secrets must not be printed: {dbg}");
        let e = S3Config::from_url_with("s3://bkt", |_| None).unwrap_err();
        assert!(matches!(e, S3Error::MissingCredentials), "{e}");
        assert!(e.to_string().contains("AWS_ACCESS_KEY_ID"));
    }

    #[test]
    fn plain_http_needs_consent() {
        let env: HashMap<&str, &str> = [
            ("AWS_ACCESS_KEY_ID", "ak"),
            ("AWS_SECRET_ACCESS_KEY", "sk"),
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:1"),
        ]
        .into();
        let c = S3Config::from_url_with("s3://bkt", |k| env.get(k).map(|v| v.to_string())).unwrap();
        let e = S3Backend::open(c).unwrap_err();
        assert!(e.to_string().contains("AWS_ALLOW_HTTP=true"), "{e}");
    }
}
