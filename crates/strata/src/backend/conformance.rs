//! Backend conformance suite: the contract from `backend/mod.rs`, as executable checks.
//!
//! Every backend (local, memory, fault, and the remote ones) runs [`run_all`] from its tests.
//! The checks panic with a message naming the backend and the broken rule, so a failing
//! backend is diagnosed from the test output alone. The backend must be empty at the start.

use super::{Backend, ErrorKind};
use std::sync::Arc;

fn ctx(b: &dyn Backend, rule: &str) -> String {
    format!("backend {} violates: {rule}", b.name())
}

/// Run every check. `b` must start empty; objects are left behind under `conf/`.
pub fn run_all(b: &dyn Backend) {
    put_get_round_trip(b);
    missing_is_not_found(b);
    overwrite_replaces_whole_object(b);
    range_reads(b);
    streamed_range_reads(b);
    put_if_absent_semantics(b);
    list_by_prefix(b);
    delete_is_idempotent(b);
    bad_keys_are_refused(b);
    large_object(b);
    vectored_range_reads(b);
    b.sync().unwrap_or_else(|e| panic!("{}: {e}", ctx(b, "sync on a healthy backend succeeds")));
}

/// Run the checks that need concurrency; `b` must be shareable.
pub fn run_concurrent(b: Arc<dyn Backend>) {
    racing_put_if_absent_has_one_winner(b);
}

fn put_get_round_trip(b: &dyn Backend) {
    b.put("conf/a", b"hello").unwrap();
    assert_eq!(b.get("conf/a").unwrap(), b"hello", "{}", ctx(b, "get returns what put stored"));
    assert_eq!(b.head("conf/a").unwrap(), Some(5), "{}", ctx(b, "head returns the size"));
    b.put("conf/empty", b"").unwrap();
    assert_eq!(b.get("conf/empty").unwrap(), b"", "{}", ctx(b, "empty objects exist"));
}

fn missing_is_not_found(b: &dyn Backend) {
    let e = b.get("conf/missing").unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{}", ctx(b, "missing key is NotFound"));
    assert_eq!(b.head("conf/missing").unwrap(), None, "{}", ctx(b, "head of missing is None"));
    let e = b.get_range("conf/missing", 0, 1).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{}", ctx(b, "range of missing key is NotFound"));
}

fn overwrite_replaces_whole_object(b: &dyn Backend) {
    b.put("conf/o", &vec![1u8; 1000]).unwrap();
    b.put("conf/o", &[2u8; 10]).unwrap();
    assert_eq!(b.get("conf/o").unwrap(), vec![2u8; 10], "{}", ctx(b, "put replaces, never merges"));
}

fn range_reads(b: &dyn Backend) {
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 256) as u8).collect();
    b.put("conf/r", &data).unwrap();
    for (off, len) in [(0u64, 1u64), (1, 100), (9_999, 1), (4096, 4096), (0, 10_000)] {
        let got = b.get_range("conf/r", off, len).unwrap();
        assert_eq!(got, &data[off as usize..(off + len) as usize], "{}", ctx(b, "range read"));
    }
    let e = b.get_range("conf/r", 9_999, 2).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Invalid, "{}", ctx(b, "range past the end is Invalid"));
}

fn streamed_range_reads(b: &dyn Backend) {
    let data: Vec<u8> =
        (0..(3u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 9) as u8).collect();
    b.put("conf/s", &data).unwrap();
    for (off, len) in [(0u64, 1u64), (5, 100_000), (1 << 20, 2 << 20), (0, 3 << 20)] {
        let mut got = Vec::new();
        let mut pieces = 0;
        b.get_range_to("conf/s", off, len, &mut |p| {
            pieces += 1;
            got.extend_from_slice(p)
        })
        .unwrap();
        assert!(
            pieces >= 1 && got[..] == data[off as usize..(off + len) as usize],
            "{}",
            ctx(b, "streamed range read")
        );
    }
    let e = b.get_range_to("conf/s", (3 << 20) - 1, 2, &mut |_| {}).unwrap_err();
    assert_eq!(
        e.kind,
        ErrorKind::Invalid,
        "{}",
        ctx(b, "a streamed range past the end is Invalid")
    );
    let e = b.get_range_to("conf/missing", 0, 1, &mut |_| {}).unwrap_err();
    assert_eq!(
        e.kind,
        ErrorKind::NotFound,
        "{}",
        ctx(b, "a streamed range of a missing key is NotFound")
    );
    b.delete("conf/s").unwrap();
}

fn put_if_absent_semantics(b: &dyn Backend) {
    assert!(
        b.put_if_absent("conf/lease", b"one").unwrap(),
        "{}",
        ctx(b, "first put_if_absent wins")
    );
    assert!(
        !b.put_if_absent("conf/lease", b"two").unwrap(),
        "{}",
        ctx(b, "second put_if_absent loses")
    );
    assert_eq!(b.get("conf/lease").unwrap(), b"one", "{}", ctx(b, "loser writes nothing"));
    b.delete("conf/lease").unwrap();
    assert!(
        b.put_if_absent("conf/lease", b"three").unwrap(),
        "{}",
        ctx(b, "free again after delete")
    );
}

fn list_by_prefix(b: &dyn Backend) {
    for k in ["conf/list/x/1", "conf/list/x/2", "conf/list/y/1", "conf/listz"] {
        b.put(k, k.as_bytes()).unwrap();
    }
    let mut keys: Vec<String> =
        b.list("conf/list/x/").unwrap().into_iter().map(|o| o.key).collect();
    keys.sort();
    assert_eq!(
        keys,
        ["conf/list/x/1", "conf/list/x/2"],
        "{}",
        ctx(b, "list returns exactly the prefix")
    );
    let all = b.list("conf/list").unwrap();
    assert_eq!(all.len(), 4, "{}", ctx(b, "list prefix is a string prefix, not a directory"));
    let one = all.iter().find(|o| o.key == "conf/list/y/1").unwrap();
    assert_eq!(one.size, "conf/list/y/1".len() as u64, "{}", ctx(b, "list reports sizes"));
    assert!(b.list("nothing/").unwrap().is_empty(), "{}", ctx(b, "empty prefix lists nothing"));
}

fn delete_is_idempotent(b: &dyn Backend) {
    b.put("conf/d", b"x").unwrap();
    b.delete("conf/d").unwrap();
    b.delete("conf/d").unwrap();
    assert_eq!(
        b.get("conf/d").unwrap_err().kind,
        ErrorKind::NotFound,
        "{}",
        ctx(b, "deleted is gone")
    );
}

fn bad_keys_are_refused(b: &dyn Backend) {
    for bad in ["../escape", "/abs", "a//b", "conf/../x"] {
        let e = b.put(bad, b"x").unwrap_err();
        assert_eq!(e.kind, ErrorKind::Invalid, "{}", ctx(b, "unsafe keys are refused"));
    }
}

fn large_object(b: &dyn Backend) {
    let data: Vec<u8> = (0..(9u32 << 20)).map(|i| (i ^ (i >> 11)) as u8).collect();
    b.put("conf/big", &data).unwrap();
    assert_eq!(b.get_range("conf/big", 8 << 20, 16).unwrap(), &data[8 << 20..(8 << 20) + 16]);
    assert_eq!(
        b.get("conf/big").unwrap().len(),
        data.len(),
        "{}",
        ctx(b, "large objects round-trip")
    );
    b.delete("conf/big").unwrap();
}

fn vectored_range_reads(b: &dyn Backend) {
    let data: Vec<u8> =
        (0..(10u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8).collect();
    b.put("conf/v", &data).unwrap();
    let k = 64u64 << 10;
    let n = data.len() as u64;
    // Out of order, adjacent, overlapping, a small gap, far apart, and one longer than any
    // merged request, as a disk read spanning many frames of a pack asks for them.
    let ranges = [
        (3 * k, k),
        (0, k),
        (k, k),
        (k + 100, 50),
        (2 * k + 4096, 10),
        (n - 1, 1),
        (16 * k, 9 << 20),
    ];
    let got = b.get_ranges("conf/v", &ranges).unwrap();
    assert_eq!(got.len(), ranges.len(), "{}", ctx(b, "get_ranges answers every range"));
    for ((off, len), g) in ranges.iter().zip(&got) {
        assert!(
            g[..] == data[*off as usize..(off + len) as usize],
            "{}",
            ctx(b, "get_ranges returns each range's bytes")
        );
    }
    let e = b.get_ranges("conf/v", &[(0, 10), (n - 1, 2)]).unwrap_err();
    assert_eq!(
        e.kind,
        ErrorKind::Invalid,
        "{}",
        ctx(b, "a range past the end is Invalid in get_ranges")
    );
    let e = b.get_ranges("conf/missing", &[(0, 1), (5, 1)]).unwrap_err();
    assert_eq!(
        e.kind,
        ErrorKind::NotFound,
        "{}",
        ctx(b, "get_ranges of a missing key is NotFound")
    );
    b.delete("conf/v").unwrap();
}

fn racing_put_if_absent_has_one_winner(b: Arc<dyn Backend>) {
    for round in 0..20 {
        let key = format!("conf/race/{round}");
        let winners: usize = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|t| {
                    let b = b.clone();
                    let key = key.clone();
                    s.spawn(move || {
                        b.put_if_absent(&key, format!("{t}").as_bytes()).unwrap() as usize
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(winners, 1, "{}", ctx(&*b, "exactly one racing put_if_absent wins"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{fault::FaultBackend, local::LocalBackend, memory::MemoryBackend};

    #[test]
    fn memory_backend_conforms() {
        let b = MemoryBackend::new();
        run_all(&b);
        run_concurrent(Arc::new(MemoryBackend::new()));
    }

    #[test]
    fn local_backend_conforms() {
        let d = tempfile::tempdir().unwrap();
        let b = LocalBackend::open(d.path()).unwrap();
        run_all(&b);
        run_concurrent(Arc::new(LocalBackend::open(d.path().join("c")).unwrap()));
    }

    #[test]
    fn fault_backend_conforms_when_healthy() {
        let b = FaultBackend::new(&MemoryBackend::new());
        run_all(&b);
        run_concurrent(Arc::new(FaultBackend::new(&MemoryBackend::new())));
    }
}
