//! Fuzz the VM checkpoint manifest parser (`strata::memory::manifest::parse_manifest`): the
//! JSON payload of `refs/vm/NAME`, read back from a store that may have been tampered with.
//! It must never panic, and whatever it accepts must re-encode to something it accepts again.

#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::memory::manifest::parse_manifest;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = parse_manifest(data) {
        let again =
            parse_manifest(&m.encode()).expect("a parsed manifest re-encodes to a valid one");
        assert_eq!(again, m);
    }
});
