//! Fuzz the index-object decoder; accepted objects must re-encode to the same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(obj) = strata::store::pack::IndexObject::decode(data) {
        assert_eq!(obj.encode(), data);
    }
});
