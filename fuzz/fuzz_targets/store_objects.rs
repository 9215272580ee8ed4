//! Fuzz the small on-disk objects: store config, refs and tree chunks. The first byte picks
//! the decoder so one corpus covers all three.
#![no_main]
use libfuzzer_sys::fuzz_target;
use strata::store::objects::{Ref, StoreConfig, Tree};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 3 {
        0 => {
            if let Ok(r) = Ref::decode(rest) {
                assert_eq!(r.encode(), rest);
            }
        }
        1 => {
            if let Ok(t) = Tree::decode(rest) {
                assert_eq!(t.encode(), rest);
            }
        }
        _ => {
            let _ = StoreConfig::decode(rest);
        }
    }
});
