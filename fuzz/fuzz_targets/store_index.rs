//! Fuzz the index-object decoder (version 1 raw entries, version 2 zstd entry table).
//! An accepted object re-encodes (always as version 2) to bytes that decode to the same object,
//! with the same header fields.
#![no_main]
use libfuzzer_sys::fuzz_target;
use strata::store::pack::IndexObject;

fuzz_target!(|data: &[u8]| {
    if let Ok(obj) = IndexObject::decode(data) {
        let enc = obj.encode();
        assert_eq!(IndexObject::decode(&enc).unwrap(), obj);
        assert_eq!(enc[10..44], data[10..44], "flags, pack id, size, count and entry CRC");
    }
});
