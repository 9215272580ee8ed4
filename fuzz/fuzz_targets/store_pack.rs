//! Fuzz the pack parser (header, footer, trailer entries) on arbitrary bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((_, entries)) = strata::store::pack::parse_pack(data) {
        // Every entry the parser accepts must lie inside the pack.
        for e in entries {
            assert!((e.frame_off + e.frame_len as u64) <= data.len() as u64);
        }
    }
    if data.len() >= 32 {
        let _ = strata::store::pack::parse_pack_header(&data[..32]);
        let _ = strata::store::pack::parse_pack_footer(&data[data.len() - 32..], data.len() as u64);
    }
});
