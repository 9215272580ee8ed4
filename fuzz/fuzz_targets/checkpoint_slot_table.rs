//! Fuzz the page map leaf's slot table (`strata::memory::manifest::SlotTable`, checkpoint
//! format version 4): the payload of a leaf tree read back from a store that may have been
//! tampered with (the tree around it is fuzzed by `store_objects`). Input: le16 number of the
//! leaf's entries (mod 2049), then the payload. It must never panic, and whatever it accepts
//! re-encodes to the same bytes and names only entries inside the leaf.

#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::memory::manifest::{SlotTable, RUN_PAGES};

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let entries = strata::endian::le16(&data, 0) as usize % 2049;
    let payload = &data[2..];
    if let Ok(t) = SlotTable::parse(payload, entries) {
        assert_eq!(t.encode(), payload, "a parsed slot table re-encodes to its bytes");
        assert!(t.0.iter().all(|&(i, s)| (i as usize) < entries && (s as usize) < RUN_PAGES));
        assert!(t.0.windows(2).all(|w| w[0].0 < w[1].0));
    }
});
