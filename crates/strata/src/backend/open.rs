//! Opening a backend from the string a user types after `--backend`: a directory,
//! `s3://BUCKET[/PREFIX]` (endpoint and credentials from `AWS_*`), or `redis://HOST:PORT[...]`.
//!
//! Remote backends come wrapped in the retry decorator, because a network backend without
//! retries turns every dropped connection into a failed save. The SSD cache is not added here:
//! it needs a directory and a size (`--cache DIR --cache-size SIZE`) and is skipped by
//! `--no-cache`, so the CLI wraps it around what this returns.

use super::local::LocalBackend;
use super::redis::{RedisBackend, RedisConfig, RedisError};
use super::retry::{RetryBackend, RetryPolicy};
use super::s3::{S3Backend, S3Config, S3Error};
use super::{BackendError, DynBackend};
use std::path::PathBuf;
use std::sync::Arc;

/// Where a store lives, as parsed from a `--backend` string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    Local(PathBuf),
    S3(String),
    Redis(String),
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    S3(#[from] S3Error),
    #[error(transparent)]
    Redis(#[from] RedisError),
    #[error(transparent)]
    Local(#[from] BackendError),
    #[error("Unknown backend scheme in '{spec}': use a directory, s3://BUCKET[/PREFIX] or redis://HOST:PORT")]
    Scheme { spec: String },
}

/// Parse a `--backend` string. Pure.
pub fn parse_location(spec: &str) -> Result<Location, OpenError> {
    if spec.starts_with("s3://") {
        Ok(Location::S3(spec.to_string()))
    } else if spec.starts_with("redis://") {
        Ok(Location::Redis(spec.to_string()))
    } else if spec.contains("://") || spec.is_empty() {
        Err(OpenError::Scheme { spec: spec.to_string() })
    } else {
        Ok(Location::Local(PathBuf::from(spec)))
    }
}

/// Open the backend a `--backend` string names; remote ones behind `retry` (None: no retries).
pub fn open_location(spec: &str, retry: Option<RetryPolicy>) -> Result<DynBackend, OpenError> {
    let wrap = |b: DynBackend| -> DynBackend {
        match retry {
            Some(p) => Arc::new(RetryBackend::new(b, p)),
            None => b,
        }
    };
    Ok(match parse_location(spec)? {
        Location::Local(dir) => Arc::new(LocalBackend::open(dir)?),
        Location::S3(url) => wrap(Arc::new(S3Backend::open(S3Config::from_url(&url)?)?)),
        Location::Redis(url) => wrap(Arc::new(RedisBackend::open(RedisConfig::from_url(&url)?)?)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse() {
        assert_eq!(
            parse_location("/var/lib/strata").unwrap(),
            Location::Local("/var/lib/strata".into())
        );
        assert_eq!(parse_location("store").unwrap(), Location::Local("store".into()));
        assert_eq!(parse_location("s3://b/p").unwrap(), Location::S3("s3://b/p".into()));
        assert_eq!(parse_location("redis://h:1").unwrap(), Location::Redis("redis://h:1".into()));
        let e = parse_location("ftp://x").unwrap_err();
        assert!(e.to_string().contains("s3://BUCKET"), "{e}");
        assert!(parse_location("").is_err());
    }

    #[test]
    fn local_directories_open() {
        let d = tempfile::tempdir().unwrap();
        let b = open_location(d.path().to_str().unwrap(), Some(RetryPolicy::default())).unwrap();
        assert!(b.name().starts_with("local:"));
    }
}
