//! Fuzz the pack parser (header, footer, raw or zstd-compressed entry table) on arbitrary bytes,
//! and the tail parser a network store indexes packs with (any suffix of the pack).
//! `fuzz/inputs/store_pack` holds a small pack of each version (written by strata before and
//! after version 2); `scripts/fuzz.sh` adds version-2 packs of a fresh store.
#![no_main]
use libfuzzer_sys::fuzz_target;
use strata::store::pack::{
    index_object_of_pack, parse_pack, parse_pack_footer, parse_pack_header, parse_pack_tail,
    IndexObject, PackTail,
};

fuzz_target!(|data: &[u8]| {
    if let Ok((id, entries)) = parse_pack(data) {
        // Every entry the parser accepts must lie inside the pack data, before the trailer.
        let f = parse_pack_footer(&data[data.len() - 32..], data.len() as u64).unwrap();
        for e in &entries {
            assert!(e.frame_off >= 32 && e.frame_off + e.frame_len as u64 <= f.trailer_off);
        }
        // The index object made from the pack's trailer names the same entries.
        let idx = IndexObject::decode(&index_object_of_pack(data).unwrap()).unwrap();
        assert_eq!((idx.pack, idx.pack_size, &idx.entries), (id, data.len() as u64, &entries));
        // Its tail gives the same entries, without the header.
        match parse_pack_tail(&data[f.trailer_off as usize..], data.len() as u64) {
            Ok(PackTail::Entries(e)) => assert_eq!(e, entries),
            other => panic!("tail of a valid pack: {other:?}"),
        }
    }
    // Any suffix: never a panic; entries it accepts lie before the trailer.
    let cut = data.first().map_or(0, |&b| b as usize % (data.len() + 1));
    let n = (data.len() as u64).max(cut as u64 + 64) + (data.len() as u64 % 7);
    if let Ok(PackTail::Entries(es)) = parse_pack_tail(&data[cut..], n) {
        for e in &es {
            assert!(e.frame_off >= 32 && e.frame_off + e.frame_len as u64 <= n);
        }
    }
    if data.len() >= 32 {
        let _ = parse_pack_header(&data[..32]);
        if let Ok(f) = parse_pack_footer(&data[data.len() - 32..], data.len() as u64) {
            assert_eq!(f.trailer_off + f.trailer_len + 32, data.len() as u64);
        }
    }
});
