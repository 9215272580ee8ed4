//! Host-local copies of refs, so a restore need not wait for its ref to cross the link before
//! it starts planning and reading.
//!
//! A restore's first request is the GET of its checkpoint's ref: the ref names the page maps,
//! which name the pages. On a network backend that GET is a round trip (~1 ms on the bench's
//! loopback S3 when idle, 25–41 ms in some runs, 20–50 ms first byte on real S3) in which the
//! link carries nothing (`docs/memory.md`, Restore). The host that saved a checkpoint, or that
//! restored it before, already knows the ref, so it keeps a copy here, and the restore plans
//! from the copy while the GET runs (`memory/restore/mod.rs`).
//!
//! Refs are mutable, so unlike `tree_cache.rs` a copy can be stale (another host replaced or
//! deleted the ref). The copy is therefore only ever a guess: the backend's ref decides, and a
//! restore whose fetched ref differs from the copy throws its plan away and plans again. Every
//! page is verified by hash in any case.
//!
//! * **Self-checking.** A file has its own magic, version, the ref name and a CRC-32C over all
//!   of it, around the ref object's bytes verbatim (`docs/format-store.md`); a file that fails
//!   any check, or names another ref, is a miss and is deleted.
//! * **Best effort.** Written to a temporary name and renamed into place, without fsync; a
//!   failed write or a full disk is logged and ignored.
//! * **Bounded.** At most [`MAX_COPIES`] files; past that the least recently written quarter
//!   goes. A file holds at most [`MAX_REF_BYTES`] of ref (a checkpoint's is ~3 KiB).
//! * Only stores on a network backend keep copies; the local backend's ref is a file read.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::format::{cap, crc, zero, FResult, FormatError, Rd, Wr};
use super::objects::{valid_ref_name, Ref};

const TARGET: &str = "strata::store::ref_copies";

pub(crate) const REF_COPY_MAGIC: &[u8; 8] = b"STRARCPY";
/// Format version of a ref copy file (separate from the ref's own, which is inside).
pub(crate) const REF_COPY_VERSION: u16 = 1;
/// Largest ref kept (the ref object's bytes).
pub(crate) const MAX_REF_BYTES: u64 = 256 << 10;
/// Files kept at most.
pub(crate) const MAX_COPIES: usize = 4096;
const HEADER: usize = 28;

/// Encode a copy of ref `name` (`r`), written at `saved_unix_ms`.
pub fn encode(name: &str, r: &Ref, saved_unix_ms: u64) -> Vec<u8> {
    let body = r.encode();
    let mut out = Vec::with_capacity(HEADER + name.len() + body.len() + 4);
    out.extend_from_slice(REF_COPY_MAGIC);
    out.u16le(REF_COPY_VERSION);
    out.u16le(0);
    out.u16le(name.len() as u16);
    out.u16le(0);
    out.u32le(body.len() as u32);
    out.u64le(saved_unix_ms);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&body);
    let c = crc(&out);
    out.u32le(c);
    out
}

/// Decode a copy: (ref name, ref, saved_unix_ms).
pub fn decode(b: &[u8]) -> FResult<(String, Ref, u64)> {
    let what = "ref copy";
    let mut rd = Rd::new(b, what);
    rd.magic_version_upto(REF_COPY_MAGIC, REF_COPY_VERSION)?;
    zero(what, "flags", rd.u16()? as u64)?;
    let name_len = rd.u16()? as u64;
    zero(what, "reserved", rd.u16()? as u64)?;
    let ref_len = rd.u32()? as u64;
    cap(what, "name_len", name_len, super::objects::MAX_REF_NAME as u64)?;
    cap(what, "ref_len", ref_len, MAX_REF_BYTES)?;
    let saved = rd.u64()?;
    let name = rd.bytes(name_len as usize)?;
    let body = rd.bytes(ref_len as usize)?;
    let body_end = rd.pos();
    let c = rd.u32()?;
    if crc(&b[..body_end]) != c {
        return Err(FormatError::Checksum { what });
    }
    if rd.pos() != b.len() {
        return Err(FormatError::Malformed { what, detail: "trailing bytes".into() });
    }
    let name = std::str::from_utf8(name)
        .ok()
        .filter(|n| valid_ref_name(n))
        .ok_or_else(|| FormatError::Malformed { what, detail: "not a ref name".into() })?;
    let r = Ref::decode(body)?;
    Ok((name.to_string(), r, saved))
}

/// The directory of ref copies (`refs/` in the store's local directory).
#[derive(Debug)]
pub struct RefCopies {
    dir: PathBuf,
    max: usize,
}

impl RefCopies {
    pub fn new(dir: PathBuf) -> RefCopies {
        RefCopies { dir, max: MAX_COPIES }
    }

    #[cfg(test)]
    fn with_max(dir: PathBuf, max: usize) -> RefCopies {
        RefCopies { dir, max }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `disk/a` is kept as `disk:a` (`:` is not allowed in ref names, so names stay distinct).
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name.replace('/', ":"))
    }

    /// The copy of ref `name`, if a sound one is here.
    pub fn get(&self, name: &str) -> Option<Ref> {
        let path = self.path(name);
        let raw = std::fs::read(&path).ok()?;
        match decode(&raw) {
            Ok((n, r, _)) if n == name => Some(r),
            Ok((n, ..)) => {
                tracing::warn!(target: TARGET, name, found = %n, path = %path.display(), "Ref copy names another ref; dropped");
                let _ = std::fs::remove_file(&path);
                None
            }
            Err(e) => {
                tracing::warn!(target: TARGET, name, error = %e, path = %path.display(), "Ref copy is damaged; dropped");
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Keep a copy of ref `name`. Errors are logged, not returned.
    pub fn put(&self, name: &str, r: &Ref) {
        if !valid_ref_name(name) {
            return;
        }
        let ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let raw = encode(name, r, ms);
        if raw.len() as u64 > MAX_REF_BYTES + 512 {
            self.remove(name);
            return;
        }
        if let Err(e) = self.write(&self.path(name), &raw) {
            tracing::debug!(target: TARGET, name, error = %e, "Ref not copied");
            return;
        }
        self.trim();
    }

    /// Whether a copy of any ref whose name starts with `prefix` is here (a file name check;
    /// the copies themselves are not read).
    pub fn any_with_prefix(&self, prefix: &str) -> bool {
        let want = prefix.replace('/', ":");
        std::fs::read_dir(&self.dir)
            .map(|rd| {
                rd.flatten().any(|e| e.file_name().to_str().is_some_and(|n| n.starts_with(&want)))
            })
            .unwrap_or(false)
    }

    /// Forget ref `name` (deleted on this host).
    pub fn remove(&self, name: &str) {
        let _ = std::fs::remove_file(self.path(name));
    }

    fn write(&self, path: &Path, raw: &[u8]) -> std::io::Result<()> {
        super::tree_cache::write_whole(&self.dir, path, raw)
    }

    /// Past the cap, delete the oldest quarter (by mtime).
    fn trim(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return };
        let mut all: Vec<(SystemTime, PathBuf)> = rd
            .flatten()
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                m.is_file().then(|| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), e.path()))
            })
            .collect();
        if all.len() <= self.max {
            return;
        }
        all.sort();
        let drop = all.len() - self.max / 4 * 3;
        for (_, p) in all.into_iter().take(drop) {
            let _ = std::fs::remove_file(p);
        }
        tracing::debug!(target: TARGET, dropped = drop, "Ref copies trimmed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endian;
    use crate::id::ChunkId;

    fn a_ref(g: u64) -> Ref {
        Ref { roots: vec![ChunkId([7; 32])], payload: b"{\"x\":1}".to_vec(), generation: g }
    }

    #[test]
    fn ref_copy_layout_is_pinned() {
        let r = a_ref(3);
        let b = encode("vm/a", &r, 0x1122_3344_5566);
        assert_eq!(&b[0..8], b"STRARCPY");
        assert_eq!(endian::le16(&b, 8), 1, "version at 8");
        assert_eq!(endian::le16(&b, 10), 0, "flags at 10");
        assert_eq!(endian::le16(&b, 12), 4, "name length at 12");
        assert_eq!(endian::le16(&b, 14), 0, "reserved at 14");
        let body = r.encode();
        assert_eq!(endian::le32(&b, 16) as usize, body.len(), "ref length at 16");
        assert_eq!(endian::le64(&b, 20), 0x1122_3344_5566, "saved at 20");
        assert_eq!(&b[28..32], b"vm/a", "name at 28");
        assert_eq!(&b[32..32 + body.len()], &body[..], "the ref verbatim after the name");
        assert_eq!(b.len(), 32 + body.len() + 4);
        assert_eq!(endian::le32(&b, b.len() - 4), crc(&b[..b.len() - 4]));
        assert_eq!(decode(&b).unwrap(), ("vm/a".to_string(), r, 0x1122_3344_5566));
        for cut in 0..b.len() {
            assert!(decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = b.clone();
        bad[30] ^= 1;
        assert_eq!(decode(&bad).unwrap_err(), FormatError::Checksum { what: "ref copy" });
        // The fuzz seed (written by hand from this table, `fuzz/inputs/store_objects/refcopy`
        // after the target's selector byte) decodes too.
        let seed = include_bytes!("../../../../fuzz/inputs/store_objects/refcopy");
        let (n, r, saved) = decode(&seed[1..]).unwrap();
        assert_eq!(
            (n.as_str(), r.generation, r.roots, saved),
            ("vm/desk", 3, vec![ChunkId([9; 32])], 1_764_000_000_000)
        );
        let mut big = b.clone();
        big[16..20].copy_from_slice(&((MAX_REF_BYTES as u32) + 1).to_le_bytes());
        assert!(matches!(decode(&big).unwrap_err(), FormatError::Cap { field: "ref_len", .. }));
    }

    #[test]
    fn any_with_prefix_sees_only_that_prefix() {
        let d = tempfile::tempdir().unwrap();
        let c = RefCopies::new(d.path().join("refs"));
        assert!(!c.any_with_prefix("vm/"), "no directory yet");
        c.put("disk/a", &a_ref(1));
        assert!(!c.any_with_prefix("vm/"));
        assert!(c.any_with_prefix("disk/"));
        c.put("vm/a", &a_ref(1));
        assert!(c.any_with_prefix("vm/"));
        c.remove("vm/a");
        assert!(!c.any_with_prefix("vm/"));
    }

    #[test]
    fn copies_are_checked_replaced_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let c = RefCopies::new(d.path().join("refs"));
        assert_eq!(c.get("vm/a"), None);
        c.put("vm/a", &a_ref(1));
        c.put("disk/a", &a_ref(9));
        assert_eq!(c.get("vm/a"), Some(a_ref(1)));
        assert_eq!(
            c.get("disk/a"),
            Some(a_ref(9)),
            "names that differ only by their prefix stay apart"
        );
        c.put("vm/a", &a_ref(2));
        assert_eq!(
            RefCopies::new(d.path().join("refs")).get("vm/a"),
            Some(a_ref(2)),
            "another process sees the newest copy"
        );
        // A damaged file is a miss, and goes.
        let p = c.dir().join("vm:a");
        let mut raw = std::fs::read(&p).unwrap();
        let n = raw.len();
        raw[n - 10] ^= 0x40;
        std::fs::write(&p, &raw).unwrap();
        assert_eq!(c.get("vm/a"), None);
        assert!(!p.exists());
        // A file moved under another name is a miss too.
        std::fs::copy(c.dir().join("disk:a"), &p).unwrap();
        assert_eq!(c.get("vm/a"), None);
        assert!(!p.exists());
        c.remove("disk/a");
        assert_eq!(c.get("disk/a"), None);
        let left: Vec<_> = std::fs::read_dir(c.dir()).unwrap().flatten().collect();
        assert!(left.is_empty(), "no temporary files left behind: {left:?}");
    }

    #[test]
    fn past_the_cap_the_oldest_go() {
        let d = tempfile::tempdir().unwrap();
        let c = RefCopies::with_max(d.path().join("refs"), 8);
        let old = SystemTime::now() - std::time::Duration::from_secs(100);
        for i in 0..8 {
            c.put(&format!("vm/old{i}"), &a_ref(i));
            let f = std::fs::File::options()
                .append(true)
                .open(c.dir().join(format!("vm:old{i}")))
                .unwrap();
            f.set_modified(old + std::time::Duration::from_secs(i)).unwrap();
        }
        c.put("vm/new", &a_ref(1));
        assert_eq!(c.get("vm/new"), Some(a_ref(1)));
        let kept = (0..8).filter(|i| c.get(&format!("vm/old{i}")).is_some()).count();
        assert_eq!(kept, 5, "9 files over a cap of 8: trimmed to 6, the oldest first");
        assert!(c.get("vm/old0").is_none() && c.get("vm/old7").is_some());
    }
}
