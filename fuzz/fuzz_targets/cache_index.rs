//! Fuzz the SSD cache's index parsing (read at every cache open from a local file that a crash
//! may have torn): headers and the record log never panic, and every record that parses
//! re-encodes to exactly the bytes it was parsed from.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::backend::cache::format::{
    encode_index_header, encode_record, parse_data_header, parse_index_header, parse_records,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = parse_index_header(data) {
        assert_eq!(&encode_index_header(&g)[..], &data[..64]);
    }
    let _ = parse_data_header(data);
    let (recs, used) = parse_records(data);
    assert!(used <= data.len());
    let mut again = Vec::new();
    for r in &recs {
        encode_record(r, &mut again);
    }
    assert_eq!(&again[..], &data[..used], "records re-encode to their bytes");
    let _ = strata::backend::redis::parse_cluster_masters(&String::from_utf8_lossy(data));
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = strata::backend::s3::parse_s3_url(s);
        let _ = strata::backend::redis::RedisConfig::from_url(s);
    }
});
