//! Cuts placed by the guest's own flushes: how a desktop snapshot cuts its disks without
//! adding to the guest's pause.
//!
//! QEMU stops a guest for the device-state part of a background snapshot, and on stop it
//! drains its block layer and flushes every disk written since its last flush; nothing
//! reaches a disk again until it resumes. So the disks' content at the memory's instant is
//! their content after the last flush that completed before the guest resumed (or, with no
//! flush since the disks were armed, their content when armed: nothing was written since).
//!
//! [`DiskExports::arm`] cuts the disks at once and from then on, after every flush of an
//! armed disk, cuts all the arm's disks again (at one instant, `disk::cut`), stamped with the
//! wall clock once the cut is taken. A cut costs no I/O; the next write to a disk copies its
//! overlay once. [`DiskExports::disarm`] is given QEMU's RESUME event time (the same wall
//! clock) and keeps the last cut stamped before it: every write acknowledged before the stop
//! is in it, and nothing the resumed guest wrote. A cut is skipped when no armed disk took a
//! write since the previous one (it would be the same content), and an arm keeps at most
//! [`MAX_CUTS`] cuts, refusing to place one it dropped.

use super::DiskExports;
use crate::disk::cut::{self, Cut};
use crate::disk::{volume::Volume, DiskError};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Cuts one arm keeps (flushes during one background snapshot's set-up are a handful).
pub(crate) const MAX_CUTS: usize = 4096;

type Result<T> = std::result::Result<T, DiskError>;

/// Wall-clock microseconds since the Unix epoch (QEMU stamps its events with the same clock).
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

struct Arm {
    id: u64,
    vols: Vec<Arc<Volume>>,
    /// (stamp, appended counts at the cut, the cuts), oldest first.
    cuts: Vec<(u64, Vec<u64>, Vec<Cut>)>,
    /// Cuts dropped for the cap: the oldest kept is not the first.
    dropped: bool,
}

/// The arms of a set of exports.
#[derive(Default)]
pub(crate) struct Arms {
    next: AtomicU64,
    /// Arms in the list: a flush with none looks at nothing else (no lock on the flush path).
    count: AtomicU64,
    list: Mutex<Vec<Arm>>,
}

impl Arms {
    /// A flush of `name` completed: cut every arm that holds it.
    pub(crate) fn on_flush(&self, name: &str) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut list = self.list.lock();
        for arm in list.iter_mut().filter(|a| a.vols.iter().any(|v| v.name() == name)) {
            let counts: Vec<u64> = arm.vols.iter().map(|v| v.appended()).collect();
            if arm.cuts.last().is_some_and(|(_, c, _)| *c == counts) {
                continue;
            }
            match cut::cut_all(&arm.vols) {
                Ok(cuts) => {
                    arm.cuts.push((now_us(), counts, cuts));
                    if arm.cuts.len() > MAX_CUTS {
                        arm.cuts.remove(0);
                        arm.dropped = true;
                    }
                }
                // A failed disk fails every later request; the disarm reports it.
                Err(e) => {
                    tracing::warn!(target: "strata::serve", arm = arm.id, error = %e, "cut at a flush failed")
                }
            }
        }
    }
}

impl DiskExports {
    /// Arm `names` (see the module comment): they are cut now and after every flush until
    /// [`disarm`](Self::disarm). Returns the arm's id.
    pub fn arm(&self, names: &[String]) -> Result<u64> {
        let vols: Vec<Arc<Volume>> =
            names.iter().map(|n| self.hold(n).map(|h| h.vol)).collect::<Result<_>>()?;
        let id = self.arms.next.fetch_add(1, Ordering::Relaxed);
        let mut list = self.arms.list.lock();
        // Counted before the first cut: a flush from now on takes the lock (waiting for the
        // arm to be listed) instead of skipping, so none between the cut and the listing is
        // missed.
        self.arms.count.fetch_add(1, Ordering::AcqRel);
        let counts = vols.iter().map(|v| v.appended()).collect();
        let first = match cut::cut_all(&vols) {
            Ok(c) => c,
            Err(e) => {
                self.arms.count.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        };
        list.push(Arm { id, vols, cuts: vec![(now_us(), counts, first)], dropped: false });
        Ok(id)
    }

    /// End arm `id` and return its cuts placed at `resumed_us` (the last one stamped before
    /// it), in the order the disks were armed. `None` drops the arm.
    pub fn disarm(&self, id: u64, resumed_us: Option<u64>) -> Result<Option<Vec<Cut>>> {
        let arm = {
            let mut list = self.arms.list.lock();
            let Some(i) = list.iter().position(|a| a.id == id) else { return Ok(None) };
            self.arms.count.fetch_sub(1, Ordering::Release);
            list.remove(i)
        };
        let Some(at) = resumed_us else { return Ok(None) };
        for v in &arm.vols {
            v.check_failed()?;
        }
        let pick = arm.cuts.iter().rposition(|(t, _, _)| *t < at);
        match pick {
            Some(0) if arm.dropped => Err(DiskError::Log(format!(
                "more than {MAX_CUTS} flushes while the disks were armed: the cut at the guest's pause was dropped"
            ))),
            Some(i) => Ok(Some(arm.cuts.into_iter().nth(i).map(|(_, _, c)| c).unwrap_or_default())),
            None => Err(DiskError::Log(format!(
                "the guest resumed ({at} us) before the disks were armed ({} us): the clocks disagree",
                arm.cuts.first().map_or(0, |c| c.0)
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nbd::ExportSet;
    use crate::store::{InitOptions, Store};

    fn content(s: &Store, c: &Cut) -> Vec<u8> {
        let f = c.fold(&s.session()).unwrap();
        let blocks = crate::store::map::read_map(s, &f.root).unwrap();
        if blocks[0].is_zero() {
            vec![0; 8]
        } else {
            s.get(&blocks[0]).unwrap()[..8].to_vec()
        }
    }

    #[test]
    fn the_cut_is_the_last_flush_before_the_resume() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::init_local(&d.path().join("s"), InitOptions::default()).unwrap();
        crate::disk::create(&s, "a", 1 << 20).unwrap();
        let ex = DiskExports::new(s.clone());
        let e = ex.open("a").unwrap();
        e.write(0, b"one.....", false).unwrap();
        e.flush().unwrap();
        let before_arm = now_us();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let id = ex.arm(&["a".to_string()]).unwrap();
        e.write(0, b"two.....", false).unwrap();
        e.flush().unwrap();
        let flushed = now_us();
        std::thread::sleep(std::time::Duration::from_millis(2));
        // Written after the resume and not flushed: never in the cut.
        e.write(0, b"three...", false).unwrap();
        let cuts = ex.disarm(id, Some(flushed + 1)).unwrap().unwrap();
        assert_eq!(content(&s, &cuts[0]), b"two.....");

        // No flush after arming: the cut taken when armed.
        let id = ex.arm(&["a".to_string()]).unwrap();
        let armed = now_us();
        std::thread::sleep(std::time::Duration::from_millis(2));
        e.write(0, b"four....", false).unwrap();
        let cuts = ex.disarm(id, Some(armed + 1)).unwrap().unwrap();
        assert_eq!(content(&s, &cuts[0]), b"three...");

        // A resume before the arm cannot be placed; an abandoned arm is dropped.
        let id = ex.arm(&["a".to_string()]).unwrap();
        assert!(ex.disarm(id, Some(before_arm)).is_err());
        let id = ex.arm(&["a".to_string()]).unwrap();
        assert!(ex.disarm(id, None).unwrap().is_none());
        assert!(ex.arms.list.lock().is_empty());
    }
}
