//! Fuzz the small on-disk objects: store config, refs, tree chunks and leases (which other
//! hosts write), and this host's copies of refs. The first byte picks the decoder so one
//! corpus covers all five.
#![no_main]
use libfuzzer_sys::fuzz_target;
use strata::store::lease::LeaseRecord;
use strata::store::objects::{Ref, StoreConfig, Tree};
use strata::store::ref_copies;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 5 {
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
        3 => {
            if let Ok((name, r, saved)) = ref_copies::decode(rest) {
                assert_eq!(ref_copies::encode(&name, &r, saved), rest);
            }
        }
        _ => {
            if let Ok(l) = LeaseRecord::decode(rest) {
                assert_eq!(LeaseRecord::decode(&l.encode()).unwrap(), l);
            }
        }
    }
});
