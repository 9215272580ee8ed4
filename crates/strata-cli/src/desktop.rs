//! Desktops as one unit: the disks side of `vm snapshot`, `vm save` and `vm restore`.
//!
//! A desktop snapshot is the VM's memory and every strata disk it has attached, at one guest
//! instant, committed as one ref (`memory::manifest`, version 5). This file finds the disks
//! (QMP `query-block`, matched against the serving daemon's NBD address from its control
//! socket), cuts them through the daemon while the guest is stopped ([`DaemonCut`], the
//! `cut` op of `control.rs`: reply line one once every disk is cut, line two once the cuts
//! are folded and durable; the connection stays open until the snapshot's ref is committed,
//! so the daemon keeps the fold's chunks pinned), and on restore makes the disks the
//! desktop starts on: writable clones (the default), or the original disks reverted
//! (`--revert`, the current content kept as a disk snapshot unless `--discard-current`).

use crate::control::{
    self,
    client::{ArmSession, CutSession},
};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;
use strata::disk::DiskMeta;
use strata::id::ChunkId;
use strata::memory::disks::{self, AttachedDisk, DiskSwap, NbdServer};
use strata::memory::manifest::{Checkpoint, DiskRecord};
use strata::memory::save::{DiskCut, Placement};
use strata::qmp::QmpClient;
use strata::store::Store;

/// The NBD address the store's daemon serves on, if one runs.
fn daemon_server(local_dir: &Path) -> Result<Option<NbdServer>> {
    let Some(who) = control::request(local_dir, &json!({"op": "whoami"}))? else { return Ok(None) };
    let nbd = &who["nbd"];
    if let Some(p) = nbd["unix"].as_str() {
        return Ok(Some(NbdServer::Unix(p.into())));
    }
    if let Some(t) = nbd["tcp"].as_str() {
        return Ok(Some(NbdServer::Tcp(t.into())));
    }
    bail!("The serving daemon did not say where it serves NBD ({who})")
}

/// Whether a disk QEMU reports on `theirs` is served by our daemon on `ours`.
fn same_server(ours: &NbdServer, theirs: &NbdServer) -> bool {
    match (ours, theirs) {
        (NbdServer::Unix(a), NbdServer::Unix(b)) => {
            a == b
                || matches!(
                    (std::fs::canonicalize(a), std::fs::canonicalize(b)),
                    (Ok(x), Ok(y)) if x == y
                )
        }
        (NbdServer::Tcp(a), NbdServer::Tcp(b)) => {
            let split = |s: &str| s.rsplit_once(':').map(|(h, p)| (h.to_string(), p.to_string()));
            match (split(a), split(b)) {
                (Some((ha, pa)), Some((hb, pb))) => {
                    let local = |h: &str| {
                        matches!(h, "localhost" | "0.0.0.0" | "::" | "[::]" | "[::1]" | "::1")
                            || h.starts_with("127.")
                    };
                    pa == pb && (ha == hb || (local(&ha) && local(&hb)))
                }
                _ => a == b,
            }
        }
        _ => false,
    }
}

/// The VM's disks a desktop snapshot takes, and the warnings for those it leaves out.
pub struct Plan {
    /// Writable strata disks: the device and the disk (export) name.
    pub disks: Vec<AttachedDisk>,
    pub warnings: Vec<String>,
}

/// Find the disks of the VM behind `qmp` (see the module comment). Refuses a writable disk
/// that is not a strata disk of this store's daemon unless `allow_foreign`.
pub fn plan(local_dir: &Path, qmp: &mut QmpClient, allow_foreign: bool) -> Result<Plan> {
    let attached = disks::attached_disks(qmp).context("Cannot list the VM's disks")?;
    let writable: Vec<AttachedDisk> = attached.into_iter().filter(|d| !d.read_only).collect();
    let mut plan = Plan { disks: Vec::new(), warnings: Vec::new() };
    if writable.is_empty() {
        return Ok(plan);
    }
    let ours = daemon_server(local_dir)?;
    for d in writable {
        let verdict = match (&d.nbd, &ours) {
            (Some(t), Some(o)) if same_server(o, &t.server) => Ok(()),
            (Some(_), Some(o)) => Err(format!(
                "is served by another NBD server ({}), not by this store's strata serve ({})",
                d.file,
                disks::nbd_uri("NAME", o)
            )),
            (Some(_), None) => Err(format!(
                "is an NBD disk ({}) but no strata serve runs for this store (start `strata serve`: it must serve the desktop's disks)",
                d.file
            )),
            (None, _) => Err(format!("is not a strata disk ({})", d.file)),
        };
        match verdict {
            Ok(()) => plan.disks.push(d),
            Err(why) if allow_foreign && d.nbd.as_ref().is_none_or(|_| ours.is_some()) => {
                plan.warnings.push(format!(
                    "Disk {} {why}: the snapshot records memory only for it",
                    d.device
                ));
            }
            Err(why) => bail!(
                "Disk {} {why}. A desktop snapshot takes every writable disk with the memory: serve it from this store, pass --allow-foreign-disks to leave it out, or --memory-only",
                d.device
            ),
        }
    }
    Ok(plan)
}

/// The daemon side of a desktop snapshot's disks (see the module comment).
pub struct DaemonCut {
    local_dir: PathBuf,
    disks: Vec<AttachedDisk>,
    placement: Placement,
    session: Option<Session>,
    /// `AtStop`: the daemon's cut, request to first reply (inside the guest's pause);
    /// `AtFlush`: arming, before the migration starts.
    pub cut_ms: Option<f64>,
}

enum Session {
    Cut(CutSession),
    Arm(ArmSession),
}

impl DaemonCut {
    /// Cut at the guest's last flush before it resumed (no time added to its pause), unless
    /// a disk is never flushed (`cache=unsafe`): then while strata holds the guest stopped.
    pub fn new(local_dir: &Path, plan: &Plan) -> DaemonCut {
        let placement = if plan.disks.iter().any(|d| d.no_flush) {
            Placement::AtStop
        } else {
            Placement::AtFlush
        };
        DaemonCut {
            local_dir: local_dir.to_path_buf(),
            disks: plan.disks.clone(),
            placement,
            session: None,
            cut_ms: None,
        }
    }

    /// Force the placement (`vm snapshot --cut-at-stop`).
    pub fn at_stop(mut self) -> DaemonCut {
        self.placement = Placement::AtStop;
        self
    }

    fn export(d: &AttachedDisk) -> &str {
        d.nbd.as_ref().map(|t| t.export.as_str()).unwrap_or("")
    }

    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> =
            self.disks.iter().map(|d| DaemonCut::export(d).to_string()).collect();
        names.sort_unstable();
        names.dedup();
        names
    }
}

impl DiskCut for DaemonCut {
    fn placement(&self) -> Placement {
        self.placement
    }

    fn cut(&mut self, at: Placement) -> std::result::Result<(), String> {
        let t = Instant::now();
        let names = self.names();
        self.placement = at;
        let started = match at {
            Placement::AtStop => CutSession::start(&self.local_dir, &names).map(|s| {
                s.map(|s| {
                    tracing::debug!(daemon_cut_ms = s.cut_ms, "disks cut in the daemon");
                    Session::Cut(s)
                })
            }),
            Placement::AtFlush => {
                ArmSession::start(&self.local_dir, &names).map(|s| s.map(Session::Arm))
            }
        };
        match started {
            Ok(Some(s)) => {
                self.session = Some(s);
                self.cut_ms = Some(t.elapsed().as_secs_f64() * 1e3);
                Ok(())
            }
            Ok(None) => Err("no strata serve answers on this store's control socket".into()),
            Err(e) => Err(format!("{e:#}")),
        }
    }

    fn finish(
        &mut self,
        resumed_us: Option<u64>,
    ) -> std::result::Result<Vec<(DiskRecord, ChunkId)>, String> {
        let folded = match self.session.as_mut().ok_or("the disks were not cut")? {
            Session::Cut(s) => s.folded(),
            Session::Arm(s) => match resumed_us {
                Some(at) => s.place(at),
                None => return Err("QEMU reported no RESUME after its STOP: the guest's instant is unknown (retry, or pass --cut-at-stop)".into()),
            },
        }
        .map_err(|e| format!("{e:#}"))?;
        let mut out = Vec::with_capacity(self.disks.len());
        for d in &self.disks {
            let name = DaemonCut::export(d);
            let f = folded
                .iter()
                .find(|f| f["name"].as_str() == Some(name))
                .ok_or_else(|| format!("the daemon returned no cut of disk '{name}'"))?;
            let root = f["root"]
                .as_str()
                .and_then(ChunkId::from_hex)
                .ok_or_else(|| format!("the daemon returned a bad root for '{name}'"))?;
            let meta: DiskMeta = serde_json::from_value(f["meta"].clone())
                .map_err(|e| format!("the daemon returned a bad description of '{name}': {e}"))?;
            let rec = DiskRecord {
                device: d.device.clone(),
                disk: name.to_string(),
                uri: d.file.clone(),
                size: meta.size,
                block_size: meta.block_size,
                allocated: meta.allocated.unwrap_or(0),
                parent: meta.parent.clone(),
            };
            out.push((rec, root));
        }
        Ok(out)
    }
}

/// The description a disk of a desktop snapshot is cloned or reverted with.
fn disk_meta(r: &DiskRecord) -> DiskMeta {
    DiskMeta {
        size: r.size,
        block_size: r.block_size,
        parent: r.parent.clone(),
        id: None,
        snapshot_of: None,
        log_folded: None,
        allocated: Some(r.allocated),
    }
}

/// A disk name made from a snapshot name: disk names take `[A-Za-z0-9._-]`.
fn name_part(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '-' })
        .collect()
}

/// How `vm restore` treats a desktop snapshot's disks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskMode {
    /// Writable clones of the snapshot's disks (the original disks stay as they are).
    Clone,
    /// The original disks get the snapshot's content; the current content is kept as a disk
    /// snapshot unless `discard_current`.
    Revert { discard_current: bool, force: bool },
}

/// What `prepare` made of one disk.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Prepared {
    pub device: String,
    /// The disk the snapshot recorded.
    pub disk: String,
    /// The disk the desktop starts on (a clone, or `disk` itself when reverted).
    pub now: String,
    /// With `--revert`: the disk snapshot that keeps the content it had.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_as: Option<String>,
}

/// Make the disks a restore of `ckpt` starts on, and the command line pointing at them.
pub fn prepare(
    store: &Store,
    ckpt: &Checkpoint,
    mode: DiskMode,
) -> Result<(Vec<Prepared>, Vec<String>)> {
    let m = &ckpt.manifest;
    let local = store.local_dir();
    let server = daemon_server(local)?;
    let Some(server) = server else {
        bail!(
            "Desktop snapshot '{}' has {} disk(s), and no strata serve runs for this store to serve them: start `strata serve` first (or restore with --memory-only)",
            m.name,
            m.disks.len()
        )
    };
    let stamp = strata::store::lease::now_ms() / 1000;
    let mut out = Vec::new();
    let mut swaps = Vec::new();
    for (rec, root) in m.disks.iter().zip(&ckpt.disk_roots) {
        let meta = disk_meta(rec);
        let p = match mode {
            DiskMode::Clone => {
                let now = free_name(store, &format!("{}.{}", rec.disk, name_part(&m.name)))?;
                let parent = rec.parent.clone().or(Some(rec.disk.clone()));
                strata::disk::clone_root(store, &now, *root, meta, parent)
                    .with_context(|| format!("Cannot clone disk '{}' of the snapshot", rec.disk))?;
                Prepared { device: rec.device.clone(), disk: rec.disk.clone(), now, kept_as: None }
            }
            DiskMode::Revert { discard_current, force } => {
                let kept_as = if discard_current {
                    None
                } else {
                    let snap = format!("before-{}-{stamp}", name_part(&m.name));
                    keep_current(local, store, &rec.disk, &snap)?;
                    Some(format!("{}@{snap}", rec.disk))
                };
                revert(local, store, &rec.disk, *root, &meta, force)?;
                let now = rec.disk.clone();
                Prepared { device: rec.device.clone(), disk: rec.disk.clone(), now, kept_as }
            }
        };
        let recorded = disks::parse_nbd_uri(&rec.uri).map(|t| t.server);
        swaps.push(DiskSwap {
            old_export: rec.disk.clone(),
            new_export: p.now.clone(),
            new_server: (recorded.as_ref() != Some(&server)).then(|| server.clone()),
        });
        out.push(p);
    }
    Ok((out, disks::rewrite_cmdline(&m.qemu.cmdline, &swaps)))
}

/// `base`, else `base.2`, `base.3`, ...: the first disk name not taken.
fn free_name(store: &Store, base: &str) -> Result<String> {
    for n in 1..1000 {
        let name = if n == 1 { base.to_string() } else { format!("{base}.{n}") };
        if strata::disk::info(store, &name).is_err() {
            return Ok(name);
        }
    }
    bail!("No free disk name like '{base}': remove old restores with `strata disk rm`")
}

/// Keep a disk's current content as `disk@snap` (through the daemon when it runs).
fn keep_current(local: &Path, store: &Store, disk: &str, snap: &str) -> Result<()> {
    let req = json!({"op": "disk-snapshot", "snaps": [[disk, snap]]});
    match control::request(local, &req)? {
        Some(_) => Ok(()),
        None => strata::disk::snapshot(store, disk, snap).map(|_| ()).map_err(|e| anyhow!(e)),
    }
    .with_context(|| format!("Cannot keep the current content of disk '{disk}' as '{disk}@{snap}'"))
}

/// Give `disk` the content `root` (through the daemon when it runs).
fn revert(
    local: &Path,
    store: &Store,
    disk: &str,
    root: ChunkId,
    meta: &DiskMeta,
    force: bool,
) -> Result<()> {
    let req = json!({"op": "disk-revert", "name": disk, "root": root.to_hex(), "meta": meta, "force": force});
    match control::request(local, &req)? {
        Some(_) => Ok(()),
        None => strata::disk::revert(store, disk, root, meta).map(|_| ()).map_err(|e| anyhow!(e)),
    }
    .with_context(|| format!("Cannot revert disk '{disk}'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_match_by_socket_or_local_address() {
        let u = |p: &str| NbdServer::Unix(p.into());
        let t = |a: &str| NbdServer::Tcp(a.into());
        assert!(same_server(&u("/s/nbd.sock"), &u("/s/nbd.sock")));
        assert!(!same_server(&u("/s/nbd.sock"), &u("/t/nbd.sock")));
        assert!(same_server(&t("127.0.0.1:10809"), &t("localhost:10809")));
        assert!(same_server(&t("0.0.0.0:10809"), &t("127.0.0.1:10809")));
        assert!(!same_server(&t("127.0.0.1:10809"), &t("127.0.0.1:10810")));
        assert!(!same_server(&t("127.0.0.1:10809"), &t("10.1.2.3:10809")));
        assert!(!same_server(&u("/s"), &t("127.0.0.1:10809")));
    }

    #[test]
    fn snapshot_names_become_disk_names() {
        assert_eq!(name_part("desk1/mon@9=a+b"), "desk1-mon-9-a-b");
        assert_eq!(name_part("ok.name_1-x"), "ok.name_1-x");
    }
}
