//! Fuzz the NBD handshake state machine: arbitrary client bytes, fed in pieces whose sizes
//! come from the input, to a server offering two small exports. Checks that the machine never
//! consumes more than it is given, that `wanted()` stays bounded, that everything it sends
//! is a well-formed sequence of server messages, and that a finished handshake is consistent.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use strata::nbd::export::{Export, ExportError, ExportInfo, ExportSet, OpenError};
use strata::nbd::handshake::{Handshake, Phase, MAX_OPTION_LEN};
use strata::nbd::proto::*;

struct Zero(u64);
impl Export for Zero {
    fn size(&self) -> u64 {
        self.0
    }
    fn read(&self, _: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        buf.fill(0);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ExportError> {
        Ok(())
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
}

struct Set;
impl ExportSet for Set {
    fn list(&self) -> Vec<ExportInfo> {
        vec![
            ExportInfo { name: "a".into(), description: None },
            ExportInfo { name: "".into(), description: Some("default".into()) },
        ]
    }
    fn open(&self, name: &str) -> Result<Arc<dyn Export>, OpenError> {
        match name {
            "a" => Ok(Arc::new(Zero(1 << 20))),
            "" => Ok(Arc::new(Zero(512))),
            _ => Err(OpenError::NotFound { name: name.into() }),
        }
    }
}

/// Walk the server's output: greeting, then option replies, then (after EXPORT_NAME) the
/// 10- or 134-byte export reply.
fn check_output(out: &[u8], phase: Phase) {
    assert!(out.len() >= GREETING_LEN);
    assert_eq!(&out[..16], b"NBDMAGICIHAVEOPT");
    let mut rest = &out[GREETING_LEN..];
    while rest.len() >= OPTION_REPLY_HEADER_LEN && rest[..8] == OPTION_REPLY_MAGIC.to_be_bytes() {
        let h = parse_option_reply(rest).unwrap();
        let end = OPTION_REPLY_HEADER_LEN + h.len as usize;
        assert!(end <= rest.len(), "option reply runs past the output");
        if h.reply & 0x8000_0000 != 0 {
            assert!(h.len as usize <= MAX_STRING_LEN, "error message over 4096 bytes");
        }
        rest = &rest[end..];
    }
    if !rest.is_empty() {
        // Only the NBD_OPT_EXPORT_NAME reply may follow the option replies.
        assert_eq!(phase, Phase::Transmission);
        assert!(rest.len() == 10 || rest.len() == 134, "stray output of {} bytes", rest.len());
    }
}

fuzz_target!(|data: &[u8]| {
    let mut hs = Handshake::new(Arc::new(Set));
    let mut out = hs.take_output();
    let mut input = data;
    let mut i = 0usize;
    while !input.is_empty() {
        let step = 1 + (data[i % data.len()] as usize % 64) * (1 + i % 3);
        i += 1;
        let piece = &input[..step.min(input.len())];
        assert!(hs.wanted() <= MAX_OPTION_LEN as usize);
        let r = hs.receive(piece);
        out.extend(hs.take_output());
        match r {
            Ok(n) => {
                assert!(n <= piece.len());
                if n < piece.len() {
                    assert_ne!(
                        hs.phase(),
                        Phase::Negotiating,
                        "stopped consuming while negotiating"
                    );
                }
                input = &input[n..];
                if hs.phase() != Phase::Negotiating {
                    break;
                }
            }
            Err(_) => {
                assert!(matches!(hs.phase(), Phase::Failed | Phase::Aborted));
                break;
            }
        }
    }
    check_output(&out, hs.phase());
    if let Some(n) = hs.negotiated() {
        assert_ne!(n.tflags & TFLAG_HAS_FLAGS, 0);
        assert!(n.base_allocation.is_none() || n.structured);
        assert_eq!(n.size, n.export.size());
        assert!(n.block_size.min.is_power_of_two() && n.block_size.max >= n.block_size.min);
    }
});
