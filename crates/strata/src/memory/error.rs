//! Errors of the memory view (save, checkpoint, restore, launch, list/rm/inspect).
//!
//! Each variant names the checkpoint and, where it applies, the ramblock and page, the QMP
//! socket or the stream offset, and says what the operator can do. Source errors are chained,
//! never repeated in the message. Every failure of a save ends with nothing visible: the
//! messages say so, because that is the first thing an operator wants to know.

use std::io;
use std::path::PathBuf;

use super::manifest::ManifestError;
use super::stream::{GenerateError, StreamError};
use crate::id::ChunkId;
use crate::qmp::QmpError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("Desktop snapshot '{name}': the disks could not be snapshotted ({reason}); the guest was resumed and nothing was saved")]
    DiskCut { name: String, reason: String },

    #[error("Invalid checkpoint name '{name}': use 1-200 of letters, digits, '._@=+-' with '/' separators")]
    BadName { name: String },

    #[error("Checkpoint '{name}' already exists: pick another name, or remove it first with `strata vm rm {name}`")]
    Exists { name: String },

    #[error("No checkpoint named '{name}': `strata vm list` shows the stored ones")]
    NotFound { name: String },

    #[error("Ref 'vm/{name}' is not a usable checkpoint")]
    Manifest {
        name: String,
        #[source]
        source: ManifestError,
    },

    #[error("QMP {op} failed on {}", path.display())]
    Qmp {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: QmpError,
    },

    #[error("QEMU at {} is already migrating (status '{status}'): wait for it or run migrate_cancel", path.display())]
    Busy { path: PathBuf, status: String },

    #[error("QEMU did not connect to strata's migration socket {} within {secs} s; nothing was stored", path.display())]
    NoConnection { path: PathBuf, secs: u64 },

    #[error(
        "QEMU's migration for '{name}' ended with status '{status}': {desc}; nothing was stored"
    )]
    SourceFailed { name: String, status: String, desc: String },

    #[error("QEMU exited during the save of '{name}' ({bytes} stream bytes received); nothing was stored")]
    SourceDied { name: String, bytes: u64 },

    #[error("Migration stream for '{name}' was refused; nothing was stored")]
    Stream {
        name: String,
        #[source]
        source: StreamError,
    },

    #[error("The stream for '{name}' did not carry page {offset:#x} of ramblock '{block}' ({missing} pages missing); nothing was stored")]
    Incomplete { name: String, block: String, offset: u64, missing: u64 },

    #[error("Store failed during {op} of '{name}'")]
    Store {
        op: &'static str,
        name: String,
        #[source]
        source: StoreError,
    },

    #[error("{op} on {} failed", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("Checkpoint '{name}' is damaged: page {offset:#x} of ramblock '{block}' (chunk {id}) could not be read; the restore was aborted before QEMU received it")]
    PageDamaged {
        name: String,
        block: String,
        offset: u64,
        id: ChunkId,
        #[source]
        source: StoreError,
    },

    #[error(
        "Checkpoint '{name}' is damaged: its {what} could not be read; nothing was sent to QEMU"
    )]
    MetaDamaged {
        name: String,
        what: String,
        #[source]
        source: StoreError,
    },

    #[error("Target QEMU does not match checkpoint '{name}': {why}. The checkpoint is unchanged; start QEMU with the checkpoint's command line (`strata vm inspect {name}`) or use `--launch`")]
    Mismatch { name: String, why: String },

    #[error("QEMU at {} is not waiting for an incoming migration (status '{status}'): start it with -incoming defer (and -S to keep it paused)", path.display())]
    NotIncoming { path: PathBuf, status: String },

    #[error("Sending checkpoint '{name}' to QEMU failed")]
    Generate {
        name: String,
        #[source]
        source: GenerateError,
    },

    #[error("QEMU failed to load checkpoint '{name}' (status '{status}'): {desc}")]
    LoadFailed { name: String, status: String, desc: String },

    #[error("Checkpoint '{name}' has no recorded QEMU command line, so --launch cannot start one: start QEMU yourself with -incoming defer and use --qmp")]
    NoCmdline { name: String },

    #[error("Cannot launch QEMU for '{name}': {why}")]
    Launch { name: String, why: String },

    #[error("Checkpoint '{base}' cannot be the delta base of this save: {why}. Pick another with --base, or use --no-delta")]
    BaseMismatch { base: String, why: String },

    #[error("A {what} thread panicked")]
    Panic { what: &'static str },
}

impl MemError {
    pub(crate) fn qmp<'a>(
        op: &'static str,
        path: &'a std::path::Path,
    ) -> impl FnOnce(QmpError) -> MemError + 'a {
        move |source| MemError::Qmp { op, path: path.to_path_buf(), source }
    }

    pub(crate) fn store<'a>(
        op: &'static str,
        name: &'a str,
    ) -> impl FnOnce(StoreError) -> MemError + 'a {
        move |source| MemError::Store { op, name: name.to_string(), source }
    }
}
