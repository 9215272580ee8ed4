//! Local-directory backend: the embedded default.
//!
//! Each object is one file under the root. A `put` writes a temporary file in `<root>/.tmp`,
//! `fdatasync`s it, then renames it into place, so a visible object is always complete, even
//! after a power cut (no zero-length or torn files under a final name). What a later `sync`
//! adds is the directory entries: every directory touched since the last sync is `fsync`ed, which
//! makes the renames and unlinks durable. `put_if_absent` uses `link(2)`, which fails atomically
//! with EEXIST, so two writers racing for a lease cannot both win.
//!
//! Large objects (packs, ≥ [`DIRECT_MIN`]) are written with `O_DIRECT` from a reused aligned
//! buffer: the bytes go from that buffer to the device without a copy into the page cache.
//! On these hosts, copying into fresh page-cache pages ran at 0.35–0.6 GB/s and took a whole
//! core, while a direct write made 1 GiB durable at 1.2–1.8 GB/s with almost no CPU. A
//! filesystem without `O_DIRECT` (tmpfs) falls back to buffered writes for good.

use super::{validate_key, BResult, Backend, BackendError, Capabilities, ErrorKind, ObjectInfo};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind as IoKind, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Debug)]
pub struct LocalBackend {
    root: PathBuf,
    dirty_dirs: Mutex<HashSet<PathBuf>>,
    /// Open handles of immutable objects (`packs/`) for range reads: opening a file per 4 KiB
    /// disk read costs more than the read itself.
    handles: RwLock<HashMap<String, Arc<File>>>,
    /// Aligned staging buffer for `O_DIRECT` writes (reused; only big puts take it).
    direct_buf: Mutex<Option<AlignedBuf>>,
    /// Cleared for good once the filesystem refuses `O_DIRECT`.
    direct_ok: AtomicBool,
}

/// Objects at least this big are written with `O_DIRECT`.
pub(crate) const DIRECT_MIN: usize = 1 << 20;
const DIRECT_ALIGN: usize = 4096;

/// A zero-initialised, 4096-byte aligned heap buffer (what `O_DIRECT` needs).
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    cap: usize,
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.cap)
    }
}

// SAFETY: the buffer is plain owned memory; access is serialised by the Mutex around it.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn new(cap: usize) -> Option<AlignedBuf> {
        let cap = cap.div_ceil(DIRECT_ALIGN).max(1) * DIRECT_ALIGN;
        let layout = std::alloc::Layout::from_size_align(cap, DIRECT_ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        std::ptr::NonNull::new(ptr).map(|ptr| AlignedBuf { ptr, cap })
    }
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `cap` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout =
            std::alloc::Layout::from_size_align(self.cap, DIRECT_ALIGN).expect("valid layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// How many pack files `get_range` keeps open.
const MAX_HANDLES: usize = 256;

const TMP: &str = ".tmp";

/// Whether process `pid` exists (on this host).
fn pid_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

impl LocalBackend {
    /// Open (creating if needed) a backend rooted at `root`. Stale temporaries from a crash are
    /// removed: those of processes that are gone. A temporary is named `<pid>.<random>`, so a
    /// second process on the same store (another strata command beside `strata serve`) never
    /// removes the files the first is still writing.
    pub fn open(root: impl AsRef<Path>) -> BResult<LocalBackend> {
        let root = root.as_ref().to_path_buf();
        let tmp = root.join(TMP);
        fs::create_dir_all(&tmp)
            .map_err(|e| BackendError::from_io("open", root.display().to_string(), e))?;
        if let Ok(rd) = fs::read_dir(&tmp) {
            for e in rd.flatten() {
                let name = e.file_name();
                let owner = name
                    .to_str()
                    .and_then(|n| n.split_once('.'))
                    .and_then(|(p, _)| p.parse::<i32>().ok());
                if !owner.is_some_and(pid_alive) {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        Ok(LocalBackend {
            root,
            dirty_dirs: Mutex::new(HashSet::new()),
            handles: RwLock::new(HashMap::new()),
            direct_buf: Mutex::new(None),
            direct_ok: AtomicBool::new(true),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &str) -> BResult<PathBuf> {
        validate_key(key)?;
        Ok(self.root.join(key))
    }

    /// Write `data` to a fresh temporary file and make its contents durable.
    fn write_tmp(&self, op: &'static str, key: &str, data: &[u8]) -> BResult<PathBuf> {
        self.write_tmp_with(op, key, data, true)
    }

    fn write_tmp_with(
        &self,
        op: &'static str,
        key: &str,
        data: &[u8],
        sync: bool,
    ) -> BResult<PathBuf> {
        let tmp = self.root.join(TMP).join(format!(
            "{}.{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        if data.len() >= DIRECT_MIN && self.direct_ok.load(Ordering::Relaxed) {
            match self.write_direct(&tmp, data) {
                Ok(()) => return Ok(tmp),
                Err(e) => {
                    let _ = fs::remove_file(&tmp);
                    if e.raw_os_error() != Some(libc::EINVAL) {
                        return Err(BackendError::from_io(op, key, e));
                    }
                    // The filesystem does not do O_DIRECT: buffered writes from now on.
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
            }
        }
        let res = (|| {
            let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            f.write_all(data)?;
            if sync {
                f.sync_data()?;
            }
            Ok::<(), std::io::Error>(())
        })();
        if let Err(e) = res {
            let _ = fs::remove_file(&tmp);
            return Err(BackendError::from_io(op, key, e));
        }
        Ok(tmp)
    }

    /// Write `data` to the new file `tmp` with `O_DIRECT` (padded to the alignment, then
    /// truncated to its length) and make it durable.
    fn write_direct(&self, tmp: &Path, data: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let padded = data.len().div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let mut slot = self.direct_buf.lock();
        if slot.as_ref().is_none_or(|b| b.cap < padded) {
            *slot = None;
            *slot = Some(
                AlignedBuf::new(padded).ok_or_else(|| std::io::Error::from(IoKind::OutOfMemory))?,
            );
        }
        let buf = slot.as_mut().expect("allocated above").as_mut();
        buf[..data.len()].copy_from_slice(data);
        buf[data.len()..padded].fill(0);
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(tmp)?;
        let mut off = 0;
        while off < padded {
            match f.write_at(&buf[off..padded], off as u64) {
                Ok(0) => return Err(IoKind::WriteZero.into()),
                Ok(n) => off += n,
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if padded != data.len() {
            f.set_len(data.len() as u64)?;
        }
        f.sync_data()
    }

    fn ensure_parent(&self, op: &'static str, key: &str, path: &Path) -> BResult<PathBuf> {
        let parent = path.parent().expect("keys have a parent").to_path_buf();
        if !parent.is_dir() {
            fs::create_dir_all(&parent).map_err(|e| BackendError::from_io(op, key, e))?;
            // New directories must themselves be made durable in their parents.
            let mut d = self.dirty_dirs.lock();
            let mut p = parent.as_path();
            while p != self.root {
                if let Some(pp) = p.parent() {
                    d.insert(pp.to_path_buf());
                    p = pp;
                } else {
                    break;
                }
            }
        }
        Ok(parent)
    }
}

impl Backend for LocalBackend {
    fn name(&self) -> String {
        format!("local:{}", self.root.display())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { native_range: true, persistent: true, ..Capabilities::default() }
    }

    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        let p = self.path(key)?;
        fs::read(&p).map_err(|e| BackendError::from_io("get", key, e))
    }

    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        let p = self.path(key)?;
        let cached = key.starts_with("packs/");
        let f = match cached.then(|| self.handles.read().get(key).cloned()).flatten() {
            Some(f) => f,
            None => {
                let f = Arc::new(
                    File::open(&p).map_err(|e| BackendError::from_io("get_range", key, e))?,
                );
                if cached {
                    let mut h = self.handles.write();
                    if h.len() >= MAX_HANDLES {
                        h.clear();
                    }
                    h.insert(key.to_string(), f.clone());
                }
                f
            }
        };
        let size = f.metadata().map_err(|e| BackendError::from_io("get_range", key, e))?.len();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(BackendError::new(ErrorKind::Invalid, "get_range", key));
        }
        let mut buf = vec![0u8; len as usize];
        f.read_exact_at(&mut buf, offset)
            .map_err(|e| BackendError::from_io("get_range", key, e))?;
        Ok(buf)
    }

    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        let p = self.path(key)?;
        self.handles.write().remove(key);
        let parent = self.ensure_parent("put", key, &p)?;
        let tmp = self.write_tmp("put", key, data)?;
        if let Err(e) = fs::rename(&tmp, &p) {
            let _ = fs::remove_file(&tmp);
            return Err(BackendError::from_io("put", key, e));
        }
        self.dirty_dirs.lock().insert(parent);
        Ok(())
    }

    fn put_volatile(&self, key: &str, data: &[u8]) -> BResult<()> {
        let p = self.path(key)?;
        self.ensure_parent("put_volatile", key, &p)?;
        let tmp = self.write_tmp_with("put_volatile", key, data, false)?;
        fs::rename(&tmp, &p).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            BackendError::from_io("put_volatile", key, e)
        })
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        let p = self.path(key)?;
        let parent = self.ensure_parent("put_if_absent", key, &p)?;
        if p.exists() {
            return Ok(false);
        }
        let tmp = self.write_tmp("put_if_absent", key, data)?;
        let res = fs::hard_link(&tmp, &p);
        let _ = fs::remove_file(&tmp);
        match res {
            Ok(()) => {
                self.dirty_dirs.lock().insert(parent);
                Ok(true)
            }
            Err(e) if e.kind() == IoKind::AlreadyExists => Ok(false),
            Err(e) => Err(BackendError::from_io("put_if_absent", key, e)),
        }
    }

    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        // Walk from the deepest directory named by the prefix.
        let dir_part = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let start = if dir_part.is_empty() { self.root.clone() } else { self.root.join(dir_part) };
        let mut out = Vec::new();
        let mut stack = vec![start];
        while let Some(dir) = stack.pop() {
            let rd = match fs::read_dir(&dir) {
                Ok(rd) => rd,
                Err(e) if e.kind() == IoKind::NotFound => continue,
                Err(e) => return Err(BackendError::from_io("list", prefix, e)),
            };
            for ent in rd {
                let ent = ent.map_err(|e| BackendError::from_io("list", prefix, e))?;
                let path = ent.path();
                let rel = match path.strip_prefix(&self.root) {
                    Ok(r) => r.to_string_lossy().into_owned(),
                    Err(_) => continue,
                };
                if rel == TMP || rel.starts_with(".tmp/") {
                    continue;
                }
                let ft = ent.file_type().map_err(|e| BackendError::from_io("list", prefix, e))?;
                if ft.is_dir() {
                    if rel.starts_with(prefix) || prefix.starts_with(&(rel.clone() + "/")) {
                        stack.push(path);
                    }
                } else if ft.is_file() && rel.starts_with(prefix) && validate_key(&rel).is_ok() {
                    let size = ent.metadata().map(|m| m.len()).unwrap_or(0);
                    out.push(ObjectInfo { key: rel, size });
                }
            }
        }
        Ok(out)
    }

    fn delete(&self, key: &str) -> BResult<()> {
        let p = self.path(key)?;
        self.handles.write().remove(key);
        match fs::remove_file(&p) {
            Ok(()) => {
                if let Some(parent) = p.parent() {
                    self.dirty_dirs.lock().insert(parent.to_path_buf());
                }
                Ok(())
            }
            Err(e) if e.kind() == IoKind::NotFound => Ok(()),
            Err(e) => Err(BackendError::from_io("delete", key, e)),
        }
    }

    fn sync(&self) -> BResult<()> {
        let dirs: Vec<PathBuf> = self.dirty_dirs.lock().drain().collect();
        for (i, d) in dirs.iter().enumerate() {
            let res = File::open(d).and_then(|f| f.sync_all());
            if let Err(e) = res {
                // Keep the rest dirty: a failed sync must not be mistaken for a durable one.
                let mut dd = self.dirty_dirs.lock();
                dd.extend(dirs[i..].iter().cloned());
                return Err(BackendError::from_io("sync", d.display().to_string(), e));
            }
        }
        Ok(())
    }

    fn head(&self, key: &str) -> BResult<Option<u64>> {
        let p = self.path(key)?;
        match fs::metadata(&p) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == IoKind::NotFound => Ok(None),
            Err(e) => Err(BackendError::from_io("head", key, e)),
        }
    }
}
