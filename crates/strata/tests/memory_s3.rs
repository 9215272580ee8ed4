//! A VM memory save into a store on a real S3 server (versitygw), and what happens when the
//! server dies in the middle: the save fails with an error that says the backend went away,
//! no checkpoint becomes visible (also to a second host opening the bucket afterwards), and a
//! save after the server is back works and restores byte for byte.
//!
//! Run: cargo test -p strata --test memory_s3

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use strata::backend::retry::{RetryBackend, RetryPolicy};
use strata::backend::s3::S3Backend;
use strata::backend::servers::S3Server;
use strata::backend::DynBackend;
use strata::memory::manifest::Mode;
use strata::memory::save::{save, SaveOptions};
use strata::progress::{NoProgress, Progress, Unit};
use strata::store::{local_meta_path, InitOptions, Store};

use strata::error_chain as chain;

fn backend(s3: &S3Server) -> DynBackend {
    let b: DynBackend = Arc::new(S3Backend::open(s3.config("s3://vms").unwrap()).unwrap());
    // Short retries, so the test sees the failure in seconds, not a minute.
    let p = RetryPolicy {
        max_attempts: 3,
        base_delay: Duration::from_millis(50),
        max_delay: Duration::from_millis(200),
        max_elapsed: Duration::from_secs(2),
    };
    Arc::new(RetryBackend::new(b, p))
}

/// Kills the S3 server once `after` bytes of pages have arrived.
struct KillS3At {
    pid: u32,
    after: u64,
    seen: AtomicU64,
}

impl Progress for KillS3At {
    fn phase(&self, _: &str, _: Option<u64>, _: Unit) {}
    fn advance(&self, n: u64) {
        let before = self.seen.fetch_add(n, Ordering::SeqCst);
        if before < self.after && before + n >= self.after {
            // SAFETY: plain kill(2) of the versitygw child this test started.
            unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
        }
    }
}

#[test]
fn killing_s3_mid_save_leaves_no_checkpoint_and_says_why() {
    let dir = workdir("mem-s3-kill");
    let mut s3 = S3Server::start(&dir.join("s3")).unwrap_or_else(|e| panic!("{e}"));
    s3.create_bucket("vms").unwrap();
    let store = Store::init(backend(&s3), &local_meta_path(&dir.join("hostA")), InitOptions::default()).unwrap();

    let mut q = Qemu::start(&dir, "src", &vm_args("pc", 256, true));
    q.wait_guest_filled();
    let kill = KillS3At { pid: s3.pid().unwrap(), after: 64 << 20, seen: AtomicU64::new(0) };
    let e = save(&store, &mut q.qmp, "cut", &SaveOptions::new(Mode::Save), &kill).unwrap_err();
    let msg = chain(&e);
    eprintln!("save with S3 killed: {msg}");
    assert!(kill.seen.load(Ordering::SeqCst) >= 64 << 20, "the save finished before the kill");
    let lower = msg.to_lowercase();
    assert!(
        lower.contains("unavailable") || lower.contains("unreachable") || lower.contains("connect"),
        "the error must say the backend went away: {msg}"
    );
    assert!(msg.contains("s3"), "and name it: {msg}");
    drop(store);

    // The server comes back: nothing is visible, to this host or to a new one.
    s3.restart().unwrap();
    let b = Store::open(backend(&s3), &local_meta_path(&dir.join("hostB"))).unwrap();
    assert!(b.get_ref("vm/cut").unwrap().is_none(), "a cut save must not be visible");
    assert!(b.list_refs("vm/").unwrap().is_empty());

    // The VM is still there (paused, as after a failed `virsh save`); a retry succeeds.
    let r = save(&b, &mut q.qmp, "ok", &SaveOptions::new(Mode::Save), &NoProgress).unwrap();
    assert!(r.pages_sent > 0 && r.stored_bytes > 0, "{r:?}");
    assert!(b.get_ref("vm/ok").unwrap().is_some());
    strata::memory::restore::load_checkpoint(&b, "ok").unwrap();
    q.quit();
}
