//! Fuzz the NBD transmission-phase trust boundary: request header parsing and validation,
//! plus the other fixed-size parsers (option header, option reply, reply header, block
//! status payload) and the option payload parsers. The first 16 bytes pick the session
//! (export size, transmission flags, capabilities, block sizes); the rest is a stream of
//! 28-byte request headers. Checks invariants, not just absence of panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::nbd::handshake::{parse_info_request, parse_meta_request, MAX_REQUEST_LEN};
use strata::nbd::proto::*;
use strata::nbd::transmission::{block_status_descriptors, check_request, Action, Limits};
use strata::nbd::Extent;

fuzz_target!(|data: &[u8]| {
    if data.len() < 16 {
        return;
    }
    let size = strata::endian::be64(&data, 0) >> (data[8] % 64);
    let min_block = 1u32 << (data[11] % 17);
    let limits = Limits {
        size,
        tflags: strata::endian::be16(&data, 9) | TFLAG_HAS_FLAGS,
        structured: data[12] & 1 != 0,
        base_allocation: data[12] & 2 != 0,
        can_fast_zero: data[12] & 4 != 0,
        min_block,
        max_block: (MAX_REQUEST_LEN >> (data[13] % 8)).max(min_block),
    };
    let body = &data[16..];
    for chunk in body.chunks(REQUEST_LEN) {
        let Ok(req) = parse_request(chunk) else { continue };
        assert_eq!(parse_request(&req.to_bytes()), Ok(req), "request round trip");
        if let Ok(action) = check_request(&req, &limits) {
            let end = req.offset.checked_add(req.len as u64);
            match action {
                Action::Read { .. } | Action::Write { .. } => {
                    assert!(end.is_some_and(|e| e <= limits.size), "accepted I/O past the end");
                    assert!(req.len <= limits.max_block, "accepted I/O over the cap");
                    assert!(req.len <= MAX_REQUEST_LEN);
                    if limits.min_block > 1 {
                        assert_eq!(req.offset % limits.min_block as u64, 0);
                    }
                }
                Action::Trim { .. }
                | Action::WriteZeroes { .. }
                | Action::BlockStatus { .. }
                | Action::Cache => {
                    assert!(end.is_some_and(|e| e <= limits.size), "accepted range past the end");
                }
                Action::Flush | Action::Disconnect => {}
            }
            if limits.tflags & TFLAG_READ_ONLY != 0 {
                assert!(!matches!(
                    action,
                    Action::Write { .. } | Action::Trim { .. } | Action::WriteZeroes { .. }
                ));
            }
        }
    }
    let _ = parse_option_header(body);
    let _ = parse_option_reply(body);
    let _ = parse_reply_header(body);
    let _ = parse_block_status_payload(body);
    let _ = parse_info_request(body);
    let _ = parse_meta_request(body);
    // Descriptors built from arbitrary extents stay within the request and are never empty.
    let extents: Vec<Extent> = body
        .chunks(5)
        .map(|c| Extent {
            len: c.iter().take(4).fold(0u64, |a, &b| a << 8 | b as u64),
            hole: c.len() > 4 && c[4] & 1 != 0,
            zero: c.len() > 4 && c[4] & 2 != 0,
        })
        .collect();
    let len = (size as u32).max(1);
    let d = block_status_descriptors(&extents, len, data[14] & 1 != 0);
    assert!(!d.is_empty());
    assert!(d.iter().all(|x| x.len > 0));
    assert!(d.iter().map(|x| x.len as u64).sum::<u64>() <= len as u64);
});
