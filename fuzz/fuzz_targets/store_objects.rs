//! Fuzz the small on-disk objects: store config, refs, tree chunks and leases (which other
//! hosts write). The first byte picks the decoder so one corpus covers all four.
#![no_main]
use libfuzzer_sys::fuzz_target;
use strata::store::lease::LeaseRecord;
use strata::store::objects::{Ref, StoreConfig, Tree};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 4 {
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
        2 => {
            let _ = StoreConfig::decode(rest);
        }
        _ => {
            if let Ok(l) = LeaseRecord::decode(rest) {
                assert_eq!(LeaseRecord::decode(&l.encode()).unwrap(), l);
            }
        }
    }
});
