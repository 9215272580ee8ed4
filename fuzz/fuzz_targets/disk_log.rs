//! Fuzz the disk write-log parser (what recovery reads after a crash): never a panic, records
//! lie inside the input, and sequence numbers are consecutive.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((h, recs, valid)) = strata::disk::log::scan(data) {
        assert!(
            (1..=strata::disk::log::LOG_VERSION).contains(&h.version),
            "only known log versions decode"
        );
        assert!(valid as usize <= data.len());
        for (i, r) in recs.iter().enumerate() {
            assert_eq!(r.seq, i as u64 + 1);
            assert!(r.data_pos <= valid);
        }
    }
});
