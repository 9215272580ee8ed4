//! Errors of the QMP client. Each names the socket or command involved and, where the user can
//! do something about it, says what.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use super::caps::Unsupported;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("No QMP socket at {}: start QEMU with -qmp unix:{},server=on,wait=off", path.display(), path.display())]
    NoSocket { path: PathBuf },

    #[error("QMP socket at {} refused the connection: QEMU is not running (stale socket file)", path.display())]
    Refused { path: PathBuf },

    #[error("Cannot connect to the QMP socket at {}", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("Timed out after {after:?} waiting for {op} on {}: QEMU is busy, hung, or another client holds the monitor", path.display())]
    Timeout { op: String, path: PathBuf, after: Duration },

    #[error("QEMU closed the QMP connection on {} during {op}: it exited or was killed", path.display())]
    Closed { op: String, path: PathBuf },

    #[error("QMP I/O failed during {op} on {}", path.display())]
    Io {
        op: String,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("QMP message received during {op} is not valid JSON")]
    BadJson {
        op: String,
        #[source]
        source: serde_json::Error,
    },

    #[error("QMP message received during {op} exceeds {max} bytes")]
    TooLarge { op: String, max: usize },

    #[error("Unexpected QMP greeting from {}: {why}", path.display())]
    BadGreeting { path: PathBuf, why: String },

    #[error("QEMU refused {cmd}: {class}: {desc}")]
    Command { cmd: String, class: String, desc: String },

    #[error("Unexpected reply to {cmd}: {why}")]
    BadReply { cmd: String, why: String },

    #[error("Unexpected reply to human-monitor-command info ramblock: {0}")]
    RamBlocks(RamBlockListError),

    #[error("Migration ended with status '{status}': {desc}")]
    MigrationFailed { status: String, desc: String },

    #[error("Cannot read the peer credentials of {}", path.display())]
    PeerCred {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(transparent)]
    Unsupported(#[from] Unsupported),
}

/// Why an HMP `info ramblock` listing is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RamBlockListError {
    #[error("Unexpected line '{line}'")]
    Line { line: String },
    #[error("Bad number '{field}' in '{line}'")]
    Number { field: String, line: String },
    #[error("Bad page-size unit '{unit}' in '{line}'")]
    Unit { unit: String, line: String },
    #[error("Bad page size in '{line}'")]
    PageSize { line: String },
    #[error("No ramblocks listed")]
    Empty,
}
