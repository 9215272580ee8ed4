//! The disks of a desktop: which disks a running QEMU has attached and what serves them, and
//! how a recorded command line is pointed at other disks for a restore.
//!
//! QEMU reports each attached block device with `query-block`; for a disk on an NBD server
//! the `inserted.file` is a URI, `nbd+unix:///EXPORT?socket=PATH` or
//! `nbd://HOST:PORT/EXPORT`, whichever way (`-drive`, `-blockdev`, legacy `nbd:unix:`) the
//! operator attached it. A strata disk is an export of the store's `strata serve`; anything
//! else (a local qcow2, an export of another server) is foreign, which a desktop snapshot
//! refuses unless told to leave it out.
//!
//! [`rewrite_cmdline`] is a pure function, unit-tested: it swaps export names (and, on
//! another host, the server's socket) in `-drive` URIs, `-drive`/`-blockdev` key=value
//! options and JSON `-blockdev` arguments, and leaves everything else as it was.

use std::path::PathBuf;

use serde_json::Value;

use crate::qmp::{QmpClient, QmpError};

/// Where an NBD disk is served.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NbdServer {
    /// A unix socket path.
    Unix(PathBuf),
    /// `host:port`.
    Tcp(String),
}

/// An NBD disk: export name and server.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NbdTarget {
    pub export: String,
    pub server: NbdServer,
}

/// A block device of a running QEMU with a medium.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AttachedDisk {
    /// The `-drive` id, else the qdev path of a `-blockdev`'s device.
    pub device: String,
    /// QEMU's file name for the medium (a URI for NBD).
    pub file: String,
    pub read_only: bool,
    /// Set when the medium is an NBD export.
    pub nbd: Option<NbdTarget>,
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parse the NBD URIs QEMU reports: `nbd+unix:///EXPORT?socket=PATH`, `nbd://HOST:PORT/EXPORT`
/// (also `nbd+tcp`), and the legacy `nbd:unix:PATH:exportname=EXPORT` and
/// `nbd:HOST:PORT:exportname=EXPORT`. `None` for anything else.
pub fn parse_nbd_uri(uri: &str) -> Option<NbdTarget> {
    if let Some(rest) = uri.strip_prefix("nbd+unix://") {
        let (path, query) = rest.split_once('?')?;
        let export = percent_decode(path.strip_prefix('/').unwrap_or(path));
        let socket = query.split('&').find_map(|kv| kv.strip_prefix("socket="))?;
        return Some(NbdTarget { export, server: NbdServer::Unix(percent_decode(socket).into()) });
    }
    if let Some(rest) = uri.strip_prefix("nbd://").or_else(|| uri.strip_prefix("nbd+tcp://")) {
        let rest = rest.split('?').next().unwrap_or(rest);
        let (hostport, export) = rest.split_once('/').unwrap_or((rest, ""));
        let hostport =
            if hostport.contains(':') { hostport.to_string() } else { format!("{hostport}:10809") };
        return Some(NbdTarget {
            export: percent_decode(export),
            server: NbdServer::Tcp(hostport),
        });
    }
    if let Some(rest) = uri.strip_prefix("nbd:") {
        let (addr, export) = match rest.split_once(":exportname=") {
            Some((a, e)) => (a, e.to_string()),
            None => (rest, String::new()),
        };
        let server = match addr.strip_prefix("unix:") {
            Some(p) => NbdServer::Unix(p.into()),
            None => NbdServer::Tcp(addr.to_string()),
        };
        return Some(NbdTarget { export, server });
    }
    None
}

/// The URI of an export on a server, as QEMU writes it.
pub fn nbd_uri(export: &str, server: &NbdServer) -> String {
    match server {
        NbdServer::Unix(p) => format!("nbd+unix:///{export}?socket={}", p.display()),
        NbdServer::Tcp(hp) => format!("nbd://{hp}/{export}"),
    }
}

/// Read the block devices with a medium from `query-block` output.
pub fn parse_query_block(v: &Value) -> Vec<AttachedDisk> {
    let mut out = Vec::new();
    for d in v.as_array().into_iter().flatten() {
        let Some(ins) = d.get("inserted") else { continue };
        let device = match d["device"].as_str() {
            Some(s) if !s.is_empty() => s.to_string(),
            _ => d["qdev"].as_str().unwrap_or("").trim_end_matches("/virtio-backend").to_string(),
        };
        let file = ins["file"].as_str().unwrap_or("").to_string();
        out.push(AttachedDisk {
            device,
            nbd: parse_nbd_uri(&file),
            read_only: ins["ro"].as_bool().unwrap_or(false),
            file,
        });
    }
    out
}

/// The block devices of the QEMU behind `qmp` that have a medium.
pub fn attached_disks(qmp: &mut QmpClient) -> Result<Vec<AttachedDisk>, QmpError> {
    Ok(parse_query_block(&qmp.execute("query-block", None)?))
}

/// One disk pointed elsewhere by [`rewrite_cmdline`].
#[derive(Debug, Clone)]
pub struct DiskSwap {
    /// The export the recorded command line names.
    pub old_export: String,
    pub new_export: String,
    /// The server to use instead of the recorded one (restoring on another host, or a
    /// daemon listening elsewhere); `None` keeps it.
    pub new_server: Option<NbdServer>,
}

/// Point a recorded QEMU command line at other disks (see the module comment).
pub fn rewrite_cmdline(cmdline: &[String], swaps: &[DiskSwap]) -> Vec<String> {
    let mut out = Vec::with_capacity(cmdline.len());
    for (i, a) in cmdline.iter().enumerate() {
        let opt = i.checked_sub(1).map(|p| cmdline[p].trim_start_matches('-'));
        let rewritten = match opt {
            Some("drive" | "blockdev") if a.trim_start().starts_with('{') => rewrite_json(a, swaps),
            Some("drive" | "blockdev") => rewrite_keyvals(a, swaps),
            _ => a.clone(),
        };
        out.push(rewritten);
    }
    out
}

fn swap_for<'a>(swaps: &'a [DiskSwap], export: &str) -> Option<&'a DiskSwap> {
    swaps.iter().find(|s| s.old_export == export)
}

/// `-drive file=nbd...,...` and `-blockdev driver=nbd,export=X,server.path=P`.
fn rewrite_keyvals(arg: &str, swaps: &[DiskSwap]) -> String {
    let parts: Vec<&str> = arg.split(',').collect();
    // Which export this argument names, so its server options can follow.
    let mut named: Option<&DiskSwap> = None;
    for p in &parts {
        if let Some((k, v)) = p.split_once('=') {
            let key = k.rsplit('.').next().unwrap_or(k);
            if key == "export" || key == "exportname" {
                named = named.or(swap_for(swaps, v));
            }
            if key == "file" || k == "file.filename" {
                if let Some(t) = parse_nbd_uri(v) {
                    named = named.or(swap_for(swaps, &t.export));
                }
            }
        }
    }
    let Some(swap) = named else { return arg.to_string() };
    let parts: Vec<String> = parts
        .iter()
        .map(|p| {
            let Some((k, v)) = p.split_once('=') else { return p.to_string() };
            let key = k.rsplit('.').next().unwrap_or(k);
            match key {
                "export" | "exportname" if v == swap.old_export => {
                    format!("{k}={}", swap.new_export)
                }
                "file" | "filename" => match parse_nbd_uri(v) {
                    Some(t) if t.export == swap.old_export => {
                        let server = swap.new_server.clone().unwrap_or(t.server);
                        format!("{k}={}", nbd_uri(&swap.new_export, &server))
                    }
                    _ => p.to_string(),
                },
                "path" if k.ends_with("server.path") => match &swap.new_server {
                    Some(NbdServer::Unix(np)) => format!("{k}={}", np.display()),
                    _ => p.to_string(),
                },
                _ => p.to_string(),
            }
        })
        .collect();
    parts.join(",")
}

/// JSON `-blockdev {"driver":"nbd","export":"X","server":{"type":"unix","path":P}}`, at any
/// depth (a format node over an NBD `file`).
fn rewrite_json(arg: &str, swaps: &[DiskSwap]) -> String {
    let Ok(mut v) = serde_json::from_str::<Value>(arg) else { return arg.to_string() };
    fn walk(v: &mut Value, swaps: &[DiskSwap]) {
        let Value::Object(m) = v else { return };
        let swap = m
            .get("export")
            .and_then(Value::as_str)
            .filter(|_| m.get("driver").and_then(Value::as_str) == Some("nbd"))
            .and_then(|e| swap_for(swaps, e))
            .cloned();
        if let Some(s) = swap {
            m.insert("export".into(), Value::String(s.new_export.clone()));
            if let (Some(NbdServer::Unix(p)), Some(Value::Object(srv))) =
                (&s.new_server, m.get_mut("server"))
            {
                srv.insert("path".into(), Value::String(p.display().to_string()));
            }
        }
        for (_, child) in m.iter_mut() {
            walk(child, swaps);
        }
    }
    walk(&mut v, swaps);
    v.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn nbd_uris_of_every_form_parse() {
        let u = parse_nbd_uri("nbd+unix:///desk1?socket=/s/.meta/nbd.sock").unwrap();
        assert_eq!(u.export, "desk1");
        assert_eq!(u.server, NbdServer::Unix("/s/.meta/nbd.sock".into()));
        let t = parse_nbd_uri("nbd://10.0.0.5:10810/desk2").unwrap();
        assert_eq!(
            (t.export.as_str(), t.server),
            ("desk2", NbdServer::Tcp("10.0.0.5:10810".into()))
        );
        let d = parse_nbd_uri("nbd://host/d").unwrap();
        assert_eq!(d.server, NbdServer::Tcp("host:10809".into()));
        let l = parse_nbd_uri("nbd:unix:/p.sock:exportname=x").unwrap();
        assert_eq!((l.export.as_str(), l.server), ("x", NbdServer::Unix("/p.sock".into())));
        assert!(parse_nbd_uri("/var/lib/desk.qcow2").is_none());
        assert!(parse_nbd_uri("json:{}").is_none());
        assert_eq!(parse_nbd_uri("nbd+unix:///a%40b?socket=/p").unwrap().export, "a@b");
    }

    #[test]
    fn query_block_devices_are_named_by_drive_id_or_qdev() {
        let q: Value = serde_json::json!([
            {"device": "virtio0", "qdev": "/machine/peripheral-anon/device[0]/virtio-backend",
             "inserted": {"file": "nbd+unix:///d1?socket=/s.sock", "ro": false}},
            {"device": "", "qdev": "/machine/peripheral/disk2/virtio-backend",
             "inserted": {"file": "nbd+unix:///d2?socket=/s.sock", "ro": false}},
            {"device": "ide1-cd0", "qdev": "/machine/unattached/device[23]"},
            {"device": "foreign", "inserted": {"file": "/x.qcow2", "ro": true}}
        ]);
        let d = parse_query_block(&q);
        assert_eq!(d.len(), 3, "the empty CD drive has no medium");
        assert_eq!(d[0].device, "virtio0");
        assert_eq!(d[1].device, "/machine/peripheral/disk2");
        assert_eq!(d[1].nbd.as_ref().unwrap().export, "d2");
        assert!(d[2].nbd.is_none() && d[2].read_only);
    }

    #[test]
    fn rewrites_every_way_of_attaching_a_disk_and_nothing_else() {
        let swaps = [
            DiskSwap { old_export: "d1".into(), new_export: "d1.snap.1".into(), new_server: None },
            DiskSwap {
                old_export: "d2".into(),
                new_export: "d2.snap.1".into(),
                new_server: Some(NbdServer::Unix("/other/nbd.sock".into())),
            },
            DiskSwap { old_export: "d3".into(), new_export: "c3".into(), new_server: None },
        ];
        let line = v(&[
            "qemu-system-x86_64",
            "-drive",
            "file=nbd+unix:///d1?socket=/s.sock,format=raw,if=virtio,cache=none",
            "-blockdev",
            "driver=nbd,server.type=unix,server.path=/s.sock,export=d2,node-name=n2",
            "-blockdev",
            r#"{"driver":"raw","node-name":"n3","file":{"driver":"nbd","export":"d3","server":{"type":"unix","path":"/s.sock"}}}"#,
            "-drive",
            "file=/var/lib/other.qcow2,if=virtio",
            "-name",
            "export=d1",
        ]);
        let out = rewrite_cmdline(&line, &swaps);
        assert_eq!(
            out[2],
            "file=nbd+unix:///d1.snap.1?socket=/s.sock,format=raw,if=virtio,cache=none"
        );
        assert_eq!(
            out[4],
            "driver=nbd,server.type=unix,server.path=/other/nbd.sock,export=d2.snap.1,node-name=n2"
        );
        let j: Value = serde_json::from_str(&out[6]).unwrap();
        assert_eq!(j["file"]["export"], "c3");
        assert_eq!(j["file"]["server"]["path"], "/s.sock");
        assert_eq!(out[8], line[8], "a foreign disk stays");
        assert_eq!(out[10], line[10], "only -drive and -blockdev values are rewritten");
        let legacy = v(&["q", "-drive", "file=nbd:unix:/s.sock:exportname=d1,if=virtio"]);
        assert_eq!(
            rewrite_cmdline(&legacy, &swaps)[2],
            "file=nbd+unix:///d1.snap.1?socket=/s.sock,if=virtio"
        );
    }
}
