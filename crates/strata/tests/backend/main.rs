//! The backends against the store and real servers: the SSD cache decorator on local files, Redis
//! (Debian's redis-server, single node and cluster) and S3 (versitygw on loopback).
//!
//! One test binary for the area (fewer binaries to link); each module holds one subject.

mod cache;
mod common;
mod redis;
mod s3;
