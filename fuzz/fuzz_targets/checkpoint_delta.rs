//! Fuzz the VM checkpoint delta record (`strata::memory::delta`): the tree chunk a page map
//! names for a page stored as a delta, and the byte runs applied to its base page. Input:
//! the encoded tree; the base page is derived from the input so runs land on varied bytes.
//! Neither may panic; an accepted record re-encodes to the same bytes; applied runs give a
//! page, and encoding that page against the base applies back to it.

#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::memory::delta::{apply, encode, parse_record, record_tree, MAX_ENCODED};
use strata::store::objects::Tree;

fuzz_target!(|data: &[u8]| {
    let Ok(t) = Tree::decode(data) else { return };
    let Ok(rec) = parse_record(&t) else { return };
    assert_eq!(record_tree(&rec).encode(), data, "a parsed record re-encodes to its bytes");
    let base: Vec<u8> = (0..4096).map(|i| data[i % data.len()].wrapping_add(i as u8)).collect();
    if let Ok(page) = apply(&base, &rec.enc) {
        let mut out = Vec::new();
        assert!(encode(&base, &page[..], &mut out, MAX_ENCODED));
        assert_eq!(&apply(&base, &out).unwrap()[..], &page[..]);
    }
});
