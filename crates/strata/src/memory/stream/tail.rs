//! Validation of the device-state tail at the end of a stream.
//!
//! The parser does not interpret FULL sections (their layout depends on every device's
//! VMState), so it cannot walk the tail section by section. What it can check cheaply, once,
//! when the source has closed: the tail opens with a plausible FULL header (or EOF), and it
//! ends with EOF + VMDESCRIPTION whose length reaches exactly to the last byte and whose JSON
//! parses. A stream cut short anywhere in the tail fails the second check, because the JSON
//! cannot contain a NUL byte and so no earlier `00 06 len` can reach the end.

use super::error::StreamError;
use super::wire;

/// Check the tail's first section header and its EOF + VMDESCRIPTION ending; return the
/// number of devices the VMDESCRIPTION lists. `end` is the stream offset just past the tail.
pub(super) fn validate_tail(
    tail: &[u8],
    end: u64,
    require_vmdesc: bool,
) -> Result<usize, StreamError> {
    let start = end - tail.len() as u64;
    let bad = |at: u64, why: String| Err(StreamError::BadTail { offset: at, why });
    if tail[0] == wire::SEC_FULL {
        // type | be32 id | idstr | be32 instance | be32 version
        if tail.len() < 7 || tail[5] == 0 || tail.len() < 6 + tail[5] as usize + 8 {
            return bad(start, "the first FULL section header is cut short".into());
        }
    }
    // The JSON cannot contain a NUL byte, so the last 0x00 0x06 whose be32 length reaches
    // exactly to the end is the EOF + VMDESCRIPTION pair.
    let mut q = tail.len().saturating_sub(6);
    let found = loop {
        if tail.len() >= 6
            && tail[q] == wire::SEC_EOF
            && tail[q + 1] == wire::SEC_VMDESCRIPTION
            && wire::be32(tail, q + 2) as usize == tail.len() - q - 6
        {
            break Some(q);
        }
        if q == 0 {
            break None;
        }
        q -= 1;
    };
    match found {
        Some(q) => {
            let json = &tail[q + 6..];
            let v: serde_json::Value = match serde_json::from_slice(json) {
                Ok(v) => v,
                Err(_) => {
                    return bad(start + q as u64 + 6, "VMDESCRIPTION is not valid JSON".into())
                }
            };
            match v.get("devices").and_then(|d| d.as_array()) {
                Some(d) => Ok(d.len()),
                None => bad(start + q as u64 + 6, "VMDESCRIPTION has no \"devices\" array".into()),
            }
        }
        None if !require_vmdesc && tail.last() == Some(&wire::SEC_EOF) => Ok(0),
        None => bad(
            end,
            "no EOF + VMDESCRIPTION at the end: the stream is cut short (a source with \
             suppress-vmdesc=on needs Limits::require_vmdesc = false)"
                .into(),
        ),
    }
}
