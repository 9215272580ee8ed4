//! QMP (QEMU Machine Protocol) client used to drive saves and restores of VM memory.
//!
//! strata never links against QEMU; it talks to a running qemu-system process over its QMP
//! unix socket (`-qmp unix:PATH,server=on,wait=off`) to stop/continue the guest, set migration
//! capabilities and parameters, start `migrate` into a pipe strata reads, or `migrate-incoming`
//! from a stream strata generates. The module is split into the blocking line/JSON client
//! ([`client`]), typed command helpers ([`commands`]), the capability policy that refuses
//! streams strata cannot store ([`caps`]) and errors ([`error`]). Logs use target
//! `strata::qmp`.

pub mod caps;
pub mod client;
pub mod commands;
pub mod error;

pub use caps::{
    check_capabilities, check_capabilities_with, CapabilityPolicy, MigrationCapability,
    RefusedCapability, Unsupported,
};
pub use client::{QemuVersion, QmpClient, QmpEvent};
pub use commands::{
    machine_type_request, parse_info_ramblock, set_capabilities_request, MachineInfo,
    MemorySizeSummary, MigrateParameters, MigrationInfo, MigrationRam, RamBlockInfo, Request,
    RunStatus,
};
pub use error::{QmpError, RamBlockListError};
