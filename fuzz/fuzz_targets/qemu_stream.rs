//! Fuzz the QEMU migration-stream parser (`strata::memory::stream`), the trust boundary where
//! strata reads bytes produced by a guest-controlled QEMU.
//!
//! The first input byte picks a feed size, so both the in-place path and the staging path
//! (units split across `feed` calls) are exercised; whatever the split, the verdict and the
//! error offset must be the same as for one whole-buffer parse.

#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::memory::stream::{parse_all, parse_all_chunked};

fuzz_target!(|data: &[u8]| {
    let Some((&c, stream)) = data.split_first() else {
        return;
    };
    let whole = parse_all(stream);
    let chunk = 1 + c as usize * 37;
    let pieces = parse_all_chunked(stream, chunk);
    match (&whole, &pieces) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.offset(), b.offset(), "{a} / {b}"),
        _ => panic!("feed size {chunk} changed the verdict: {whole:?} / {pieces:?}"),
    }
    if let Err(e) = &whole {
        assert!(e.offset() <= stream.len() as u64, "error offset beyond the input: {e}");
    }
});
