//! Speed_Transfer: the prior a save starts from (a speed remembered from an earlier save on
//! the same backend, a network default, or a timed probe `put`) and the upload meter's
//! reading that replaces it once enough went up.

use super::*;

/// Bytes written by the backend probe (non-network backends without a remembered speed).
pub(crate) const PROBE_BYTES: usize = 16 << 20;
/// Speed_Transfer assumed for a network backend until its uploads are measured: 1 Gbit/s.
pub(crate) const DEFAULT_NETWORK_BPS: f64 = 125e6;
/// Uploaded bytes before the measured speed replaces the prior.
/// 4 MiB: a shaped link lets its first burst (`tbf` burst 256 KiB here, a switch's buffers
/// in general) through at wire speed, so a small first upload measures a link several times
/// faster than it is, and the chooser then picked lz4 for up to 130 frames of a 128 MiB save
/// (+1 MB stored) before the measurement settled.
pub(crate) const METER_MIN_BYTES: u64 = 4 << 20;
/// How long a speed measured by an earlier save is trusted as the prior.
pub(crate) const REMEMBER_SECS: u64 = 7 * 24 * 3600;
/// File in the store's local directory holding the last measured speed.
pub(crate) const SPEED_FILE: &str = "backend-speed.json";

#[derive(serde::Serialize, serde::Deserialize)]
struct Remembered {
    backend: String,
    bytes_per_s: f64,
    measured_unix: u64,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The speed an earlier save measured on `backend` from this host, and its age in seconds,
/// if recent enough.
pub fn remembered_speed(dir: &std::path::Path, backend: &str) -> Option<(f64, u64)> {
    let raw = std::fs::read(dir.join(SPEED_FILE)).ok()?;
    let r: Remembered = serde_json::from_slice(&raw).ok()?;
    let age = unix_now().checked_sub(r.measured_unix)?;
    (r.backend == backend
        && age <= REMEMBER_SECS
        && r.bytes_per_s.is_finite()
        && r.bytes_per_s > 0.0)
        .then_some((r.bytes_per_s, age))
}

/// Remember a measured speed for the next save (best effort: a failure only costs the prior).
pub fn remember_speed(dir: &std::path::Path, backend: &str, bytes_per_s: f64) {
    let r = Remembered { backend: backend.into(), bytes_per_s, measured_unix: unix_now() };
    let tmp = dir.join(format!("{SPEED_FILE}.tmp"));
    let ok = serde_json::to_vec(&r)
        .ok()
        .and_then(|b| std::fs::write(&tmp, b).ok())
        .and_then(|_| std::fs::rename(&tmp, dir.join(SPEED_FILE)).ok());
    if ok.is_none() {
        tracing::debug!(target: "strata::memory", dir = %dir.display(), "backend speed not remembered");
    }
}

/// Upload speed in bytes/s from the store's meter (bytes, busy time), once enough went up.
pub fn metered_speed(bytes: u64, busy: std::time::Duration) -> Option<f64> {
    (bytes >= METER_MIN_BYTES && !busy.is_zero()).then(|| bytes as f64 / busy.as_secs_f64())
}

/// Reads the backend's measured speed during a save (`None` until enough was uploaded).
pub type Meter = Box<dyn Fn() -> Option<f64> + Send + Sync>;

/// Time one `put` of `bytes` incompressible bytes (plus its durability) and delete it.
/// Returns bytes per second.
pub fn probe_backend(backend: &dyn Backend, bytes: usize) -> Result<f64, BackendError> {
    let mut data = vec![0u8; bytes];
    let mut x: u64 = rand::random::<u64>() | 1;
    for w in data.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    let key = format!("tmp/strata-probe-{:016x}", rand::random::<u64>());
    let t = Instant::now();
    backend.put(&key, &data)?;
    backend.sync()?;
    let secs = t.elapsed().as_secs_f64().max(1e-6);
    let _ = backend.delete(&key);
    Ok(bytes as f64 / secs)
}
