//! The fill thread: takes staged ranges (bytes a reader or a `put` already has), allocates a
//! block (evicting as needed), writes the bytes to the cache file outside the lock, then
//! publishes the entry and logs it. Readers never wait for it; it is the "lazy" in lazy fill.

use super::format::{self, Record, DATA_HEADER_LEN};
use super::index::{alloc_evicting, flush_log, rewrite_log, Entry, RangeKey, Slice, State};
use super::{bump, Shared, TARGET};
use std::os::unix::fs::FileExt;
use std::sync::mpsc;

pub(super) fn fill_loop(sh: &Shared, rx: mpsc::Receiver<(RangeKey, Slice)>) {
    loop {
        let job = match rx.try_recv() {
            Ok(j) => j,
            Err(mpsc::TryRecvError::Empty) => {
                // Queue drained: push the log out, maybe compact, then block for more.
                {
                    let mut st = sh.state.lock();
                    let compact = st.log.len > 4 * (st.log.live * 64) + (4 << 20);
                    let r =
                        if compact { rewrite_log(&mut st, &sh.geo) } else { flush_log(&mut st) };
                    if let Err(e) = r {
                        tracing::warn!(target: TARGET, error = %e, "cache index write failed");
                    }
                    sh.idle.notify_all();
                }
                match rx.recv() {
                    Ok(j) => j,
                    Err(_) => return,
                }
            }
            Err(mpsc::TryRecvError::Disconnected) => return,
        };
        fill_one(sh, job.0, job.1);
    }
}

fn fill_one(sh: &Shared, rk: RangeKey, s: Slice) {
    let len = s.len as u64;
    let unstage = |st: &mut State| {
        if st.staged.remove(&rk).is_some() {
            st.staged_bytes -= len;
        }
        sh.idle.notify_all();
    };
    let block = {
        let mut st = sh.state.lock();
        if !st.staged.contains_key(&rk) {
            return; // invalidated meanwhile
        }
        let Some(order) = st.buddy.order_for(len) else {
            unstage(&mut st);
            return;
        };
        if st.by_range.contains_key(&rk) {
            unstage(&mut st);
            return;
        }
        match alloc_evicting(&mut st, &sh.stats, order) {
            Some(b) => (b, order),
            None => {
                unstage(&mut st);
                return;
            }
        }
    };
    let data = s.bytes();
    let hash = format::entry_hash(data);
    let res = sh.data.write_all_at(data, DATA_HEADER_LEN + block.0);
    let mut st = sh.state.lock();
    if let Err(e) = res {
        bump(&sh.stats.io_errors, 1);
        tracing::warn!(target: TARGET, error = %e, "cache write failed");
        st.buddy.free(block.0, block.1);
        unstage(&mut st);
        return;
    }
    if !st.staged.contains_key(&rk) {
        st.buddy.free(block.0, block.1); // invalidated while we wrote
        return;
    }
    let tick = st.tick;
    st.tick += 1;
    let (key, obj_off, _) = rk.clone();
    format::encode_record(
        &Record::Insert {
            block: block.0,
            order: block.1,
            len: len as u32,
            hash,
            obj_off,
            key: key.to_string(),
        },
        &mut st.log.buf,
    );
    st.log.live += 1;
    // Verified: these are the bytes this process just hashed and wrote.
    st.by_block.insert(
        block.0,
        Entry { key, obj_off, len, order: block.1, hash, tick, seq: tick, verified: true },
    );
    st.by_range.insert(rk.clone(), block.0);
    st.lru.insert(tick, block.0);
    bump(&sh.stats.fills, 1);
    bump(&sh.stats.fill_bytes, len);
    unstage(&mut st);
}
