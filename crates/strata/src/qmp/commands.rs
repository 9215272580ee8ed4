//! Typed helpers for the QMP commands strata uses to save and restore VM memory.
//!
//! Each helper is a thin wrapper over [`QmpClient::execute`] that turns QEMU's JSON into a
//! small struct and keeps the raw value where callers may need more. The ramblock list has no
//! QMP command in QEMU 7.2, so it is read from HMP `info ramblock` through
//! `human-monitor-command`; the text parser is separate and unit-tested.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use super::caps::{check_capabilities_with, CapabilityPolicy, MigrationCapability};
use super::client::QmpClient;
use super::error::{QmpError, RamBlockListError};

/// `query-status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunStatus {
    /// e.g. `running`, `paused`, `postmigrate`, `inmigrate`, `prelaunch`.
    pub status: String,
    pub running: bool,
}

/// Parameters for `migrate-set-parameters`; fields left `None` are not sent.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct MigrateParameters {
    /// Bytes per second (QEMU 7.2 defaults to 128 MiB/s, which throttles saves).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bandwidth: Option<u64>,
    /// Milliseconds the final stop-and-copy may take.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downtime_limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multifd_channels: Option<u32>,
}

/// RAM counters of `query-migrate`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrationRam {
    pub transferred: u64,
    pub total: u64,
    pub remaining: u64,
    pub normal: u64,
    pub duplicate: u64,
    pub dirty_sync_count: u64,
}

/// `query-migrate`.
#[derive(Debug, Clone)]
pub struct MigrationInfo {
    /// `none`, `setup`, `active`, `completed`, `failed`, `cancelled`, ...
    pub status: String,
    pub total_time_ms: Option<u64>,
    pub downtime_ms: Option<u64>,
    pub ram: Option<MigrationRam>,
    pub error_desc: Option<String>,
    pub raw: Value,
}

/// One machine type from `query-machines`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineInfo {
    pub name: String,
    pub alias: Option<String>,
    pub is_default: bool,
}

/// `query-memory-size-summary`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemorySizeSummary {
    pub base_memory: u64,
    pub plugged_memory: Option<u64>,
}

/// One line of HMP `info ramblock`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamBlockInfo {
    pub name: String,
    pub page_size: u64,
    pub offset: u64,
    pub used: u64,
    pub total: u64,
}

/// A command and its arguments, as [`QmpClient::pipeline`] takes them. The `*_request`
/// functions build exactly what the matching typed wrapper sends, so a pipelined reply is
/// handed to that wrapper.
pub type Request = (&'static str, Option<Value>);

impl MigrateParameters {
    /// The `migrate-set-parameters` request for these parameters.
    pub fn request(&self) -> Result<Request, QmpError> {
        let v = serde_json::to_value(self)
            .map_err(|source| QmpError::BadJson { op: "migrate-set-parameters".into(), source })?;
        Ok(("migrate-set-parameters", Some(v)))
    }
}

/// The `migrate-set-capabilities` request for (name, state) pairs.
pub fn set_capabilities_request(caps: &[(&str, bool)]) -> Request {
    let list: Vec<Value> =
        caps.iter().map(|(c, s)| json!({ "capability": c, "state": s })).collect();
    ("migrate-set-capabilities", Some(json!({ "capabilities": list })))
}

/// The `qom-get` request behind [`QmpClient::machine_type`].
pub fn machine_type_request() -> Request {
    ("qom-get", Some(json!({ "path": "/machine", "property": "type" })))
}

fn u64_at(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

impl QmpClient {
    /// `query-status`.
    pub fn query_status(&mut self) -> Result<RunStatus, QmpError> {
        let r = self.execute("query-status", None)?;
        match (r.get("status").and_then(Value::as_str), r.get("running").and_then(Value::as_bool)) {
            (Some(s), Some(running)) => Ok(RunStatus { status: s.to_owned(), running }),
            _ => Err(QmpError::BadReply {
                cmd: "query-status".into(),
                why: format!("no status/running in {r}"),
            }),
        }
    }

    /// `query-migrate-capabilities`.
    pub fn query_migrate_capabilities(&mut self) -> Result<Vec<MigrationCapability>, QmpError> {
        let r = self.execute("query-migrate-capabilities", None)?;
        let arr = r.as_array().ok_or_else(|| QmpError::BadReply {
            cmd: "query-migrate-capabilities".into(),
            why: "not an array".into(),
        })?;
        Ok(arr
            .iter()
            .filter_map(|c| {
                Some(MigrationCapability {
                    capability: c.get("capability")?.as_str()?.to_owned(),
                    state: c.get("state")?.as_bool()?,
                })
            })
            .collect())
    }

    /// `migrate-set-capabilities` with (name, state) pairs.
    pub fn migrate_set_capabilities(&mut self, caps: &[(&str, bool)]) -> Result<(), QmpError> {
        let (cmd, args) = set_capabilities_request(caps);
        self.execute(cmd, args)?;
        Ok(())
    }

    /// Query the capabilities and refuse the ones strata cannot store.
    pub fn ensure_storable_capabilities(
        &mut self,
        policy: &CapabilityPolicy,
    ) -> Result<(), QmpError> {
        let caps = self.query_migrate_capabilities()?;
        check_capabilities_with(&caps, policy)?;
        Ok(())
    }

    /// `migrate-set-parameters`.
    pub fn migrate_set_parameters(&mut self, p: &MigrateParameters) -> Result<(), QmpError> {
        let (cmd, args) = p.request()?;
        self.execute(cmd, args)?;
        Ok(())
    }

    /// `query-migrate-parameters`, raw.
    pub fn query_migrate_parameters(&mut self) -> Result<Value, QmpError> {
        self.execute("query-migrate-parameters", None)
    }

    /// `migrate` to `uri` (e.g. `exec:cat > FILE`, `unix:PATH`, `fd:NAME`). Returns at once;
    /// use [`wait_migration`](Self::wait_migration).
    pub fn migrate(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate", Some(json!({ "uri": uri })))?;
        Ok(())
    }

    /// `migrate-incoming` on a QEMU started with `-incoming defer`.
    pub fn migrate_incoming(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate-incoming", Some(json!({ "uri": uri })))?;
        Ok(())
    }

    /// `migrate_cancel`.
    pub fn migrate_cancel(&mut self) -> Result<(), QmpError> {
        self.execute("migrate_cancel", None)?;
        Ok(())
    }

    /// `query-migrate`.
    pub fn query_migrate(&mut self) -> Result<MigrationInfo, QmpError> {
        let r = self.execute("query-migrate", None)?;
        let status = r.get("status").and_then(Value::as_str).unwrap_or("none").to_owned();
        let ram = r.get("ram").map(|m| MigrationRam {
            transferred: u64_at(m, "transferred").unwrap_or(0),
            total: u64_at(m, "total").unwrap_or(0),
            remaining: u64_at(m, "remaining").unwrap_or(0),
            normal: u64_at(m, "normal").unwrap_or(0),
            duplicate: u64_at(m, "duplicate").unwrap_or(0),
            dirty_sync_count: u64_at(m, "dirty-sync-count").unwrap_or(0),
        });
        Ok(MigrationInfo {
            status,
            total_time_ms: u64_at(&r, "total-time"),
            downtime_ms: u64_at(&r, "downtime"),
            ram,
            error_desc: r.get("error-desc").and_then(Value::as_str).map(str::to_owned),
            raw: r,
        })
    }

    /// Poll `query-migrate` every `poll` until `completed` (Ok), `failed` or `cancelled`
    /// (Err with QEMU's error-desc), or `timeout`.
    pub fn wait_migration(
        &mut self,
        timeout: Duration,
        poll: Duration,
    ) -> Result<MigrationInfo, QmpError> {
        let deadline = Instant::now() + timeout;
        loop {
            let info = self.query_migrate()?;
            match info.status.as_str() {
                "completed" => return Ok(info),
                "failed" | "cancelled" => {
                    return Err(QmpError::MigrationFailed {
                        desc: info
                            .error_desc
                            .clone()
                            .unwrap_or_else(|| "no error-desc from QEMU".into()),
                        status: info.status,
                    })
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return Err(QmpError::Timeout {
                    op: format!("migration to complete (last status '{}')", info.status),
                    path: self.path().to_path_buf(),
                    after: timeout,
                });
            }
            std::thread::sleep(poll);
        }
    }

    /// `cont`.
    pub fn cont(&mut self) -> Result<(), QmpError> {
        self.execute("cont", None)?;
        Ok(())
    }

    /// `stop`.
    pub fn stop(&mut self) -> Result<(), QmpError> {
        self.execute("stop", None)?;
        Ok(())
    }

    /// `quit` (QEMU exits; the connection closes).
    pub fn quit(&mut self) -> Result<(), QmpError> {
        self.execute("quit", None)?;
        Ok(())
    }

    /// `query-machines`.
    pub fn query_machines(&mut self) -> Result<Vec<MachineInfo>, QmpError> {
        let r = self.execute("query-machines", None)?;
        let arr = r.as_array().ok_or_else(|| QmpError::BadReply {
            cmd: "query-machines".into(),
            why: "not an array".into(),
        })?;
        Ok(arr
            .iter()
            .filter_map(|m| {
                Some(MachineInfo {
                    name: m.get("name")?.as_str()?.to_owned(),
                    alias: m.get("alias").and_then(Value::as_str).map(str::to_owned),
                    is_default: m.get("is-default").and_then(Value::as_bool).unwrap_or(false),
                })
            })
            .collect())
    }

    /// Machine type of the running VM (e.g. `pc-i440fx-7.2`), as written into CONFIGURATION:
    /// the QOM type of `/machine` without its `-machine` suffix.
    pub fn machine_type(&mut self) -> Result<String, QmpError> {
        let (cmd, args) = machine_type_request();
        let r = self.execute(cmd, args)?;
        let t = r.as_str().ok_or_else(|| QmpError::BadReply {
            cmd: "qom-get /machine type".into(),
            why: format!("not a string: {r}"),
        })?;
        Ok(t.strip_suffix("-machine").unwrap_or(t).to_owned())
    }

    /// `query-machines` entry of the running machine type.
    pub fn current_machine(&mut self) -> Result<MachineInfo, QmpError> {
        let name = self.machine_type()?;
        self.query_machines()?.into_iter().find(|m| m.name == name).ok_or_else(|| {
            QmpError::BadReply {
                cmd: "query-machines".into(),
                why: format!("no entry for '{name}'"),
            }
        })
    }

    /// `query-memory-size-summary`.
    pub fn memory_size_summary(&mut self) -> Result<MemorySizeSummary, QmpError> {
        let r = self.execute("query-memory-size-summary", None)?;
        Ok(MemorySizeSummary {
            base_memory: u64_at(&r, "base-memory").ok_or_else(|| QmpError::BadReply {
                cmd: "query-memory-size-summary".into(),
                why: format!("no base-memory in {r}"),
            })?,
            plugged_memory: u64_at(&r, "plugged-memory"),
        })
    }

    /// `human-monitor-command`: run an HMP command and return its text output.
    pub fn human_monitor_command(&mut self, line: &str) -> Result<String, QmpError> {
        let r = self.execute("human-monitor-command", Some(json!({ "command-line": line })))?;
        r.as_str().map(str::to_owned).ok_or_else(|| QmpError::BadReply {
            cmd: format!("human-monitor-command {line}"),
            why: "not a string".into(),
        })
    }

    /// The ramblocks of the running VM (HMP `info ramblock`).
    pub fn ram_blocks(&mut self) -> Result<Vec<RamBlockInfo>, QmpError> {
        let text = self.human_monitor_command("info ramblock")?;
        parse_info_ramblock(&text).map_err(QmpError::RamBlocks)
    }
}

/// Parse HMP `info ramblock` output:
/// `NAME  PSIZE UNIT  0xOFFSET 0xUSED 0xTOTAL` per line after a header line.
pub fn parse_info_ramblock(text: &str) -> Result<Vec<RamBlockInfo>, RamBlockListError> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.starts_with("Block Name") {
            continue;
        }
        let t: Vec<&str> = line.split_whitespace().collect();
        if t.len() < 6 {
            return Err(RamBlockListError::Line { line: line.into() });
        }
        let n = t.len();
        let hex = |s: &str| {
            s.strip_prefix("0x")
                .and_then(|h| u64::from_str_radix(h, 16).ok())
                .ok_or_else(|| RamBlockListError::Number { field: s.into(), line: line.into() })
        };
        let unit = match t[n - 4] {
            "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            u => return Err(RamBlockListError::Unit { unit: u.into(), line: line.into() }),
        };
        let size: u64 =
            t[n - 5].parse().map_err(|_| RamBlockListError::PageSize { line: line.into() })?;
        out.push(RamBlockInfo {
            name: t[..n - 5].join(" "),
            page_size: size * unit,
            offset: hex(t[n - 3])?,
            used: hex(t[n - 2])?,
            total: hex(t[n - 1])?,
        });
    }
    if out.is_empty() {
        return Err(RamBlockListError::Empty);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_ramblock_text() {
        // Captured from QEMU 7.2, -machine pc -m 128 -nodefaults.
        let text = "              Block Name    PSize              Offset               Used              Total\r\n\
                  pc.ram    4 KiB  0x0000000000000000 0x0000000008000000 0x0000000008000000\r\n\
    /rom@etc/acpi/tables    4 KiB  0x0000000008080000 0x0000000000020000 0x0000000000200000\r\n\
      /rom@etc/acpi/rsdp    4 KiB  0x00000000082c0000 0x0000000000001000 0x0000000000001000\r\n";
        let b = parse_info_ramblock(text).unwrap();
        assert_eq!(b.len(), 3);
        assert_eq!(
            b[0],
            RamBlockInfo {
                name: "pc.ram".into(),
                page_size: 4096,
                offset: 0,
                used: 0x800_0000,
                total: 0x800_0000
            }
        );
        assert_eq!(b[1].name, "/rom@etc/acpi/tables");
        assert_eq!(b[1].used, 0x20000);
        assert_eq!(b[1].total, 0x200000);
        assert_eq!(parse_info_ramblock(""), Err(RamBlockListError::Empty));
        assert!(matches!(
            parse_info_ramblock("pc.ram 4 KiB 0x0 zz 0x0"),
            Err(RamBlockListError::Number { .. })
        ));
    }

    #[test]
    fn parameters_serialise_kebab_case() {
        let p = MigrateParameters {
            max_bandwidth: Some(1 << 30),
            downtime_limit: Some(500),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            json!({"max-bandwidth": 1073741824u64, "downtime-limit": 500})
        );
    }
}
