//! In-memory backend: a map behind a lock. Used by unit tests, property tests and as the
//! "disk" under the fault-injection backend. Not persistent; `sync` is a no-op.

use super::{validate_key, BResult, Backend, BackendError, Capabilities, ErrorKind, ObjectInfo};
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Debug, Default, Clone)]
pub struct MemoryBackend {
    objects: Arc<RwLock<BTreeMap<String, Arc<Vec<u8>>>>>,
}

impl MemoryBackend {
    pub fn new() -> MemoryBackend {
        MemoryBackend::default()
    }

    /// Replace an object's bytes behind the store's back (for corruption tests).
    pub fn tamper(&self, key: &str, f: impl FnOnce(&mut Vec<u8>)) -> bool {
        let mut m = self.objects.write();
        match m.get_mut(key) {
            Some(v) => {
                let mut copy = (**v).clone();
                f(&mut copy);
                *v = Arc::new(copy);
                true
            }
            None => false,
        }
    }

    pub fn keys(&self) -> Vec<String> {
        self.objects.read().keys().cloned().collect()
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> String {
        "memory".into()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { native_range: true, persistent: false, ..Capabilities::default() }
    }

    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        validate_key(key)?;
        self.objects
            .read()
            .get(key)
            .map(|v| (**v).clone())
            .ok_or_else(|| BackendError::new(ErrorKind::NotFound, "get", key))
    }

    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        validate_key(key)?;
        let m = self.objects.read();
        let v =
            m.get(key).ok_or_else(|| BackendError::new(ErrorKind::NotFound, "get_range", key))?;
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= v.len() as u64)
            .ok_or_else(|| BackendError::new(ErrorKind::Invalid, "get_range", key))?;
        Ok(v[offset as usize..end as usize].to_vec())
    }

    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        validate_key(key)?;
        self.objects.write().insert(key.to_string(), Arc::new(data.to_vec()));
        Ok(())
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        validate_key(key)?;
        let mut m = self.objects.write();
        if m.contains_key(key) {
            return Ok(false);
        }
        m.insert(key.to_string(), Arc::new(data.to_vec()));
        Ok(true)
    }

    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        Ok(self
            .objects
            .read()
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| ObjectInfo { key: k.clone(), size: v.len() as u64 })
            .collect())
    }

    fn delete(&self, key: &str) -> BResult<()> {
        validate_key(key)?;
        self.objects.write().remove(key);
        Ok(())
    }

    fn sync(&self) -> BResult<()> {
        Ok(())
    }

    fn head(&self, key: &str) -> BResult<Option<u64>> {
        validate_key(key)?;
        Ok(self.objects.read().get(key).map(|v| v.len() as u64))
    }
}
