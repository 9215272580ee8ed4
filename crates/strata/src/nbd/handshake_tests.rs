//! Unit tests of the handshake state machine, fed byte sequences without sockets: every
//! option, malformed and oversized input, byte-at-a-time delivery, and the caps.

use super::super::export::{ExportError, ExportInfo};
use super::*;

struct Disk {
    size: u64,
    ro: bool,
    min: u32,
}
impl Export for Disk {
    fn size(&self) -> u64 {
        self.size
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
    fn is_read_only(&self) -> bool {
        self.ro
    }
    fn description(&self) -> Option<String> {
        Some("test disk".into())
    }
    fn can_trim(&self) -> bool {
        true
    }
    fn block_size(&self) -> BlockSize {
        BlockSize { min: self.min, ..BlockSize::default() }
    }
}
struct Set;
impl ExportSet for Set {
    fn list(&self) -> Vec<ExportInfo> {
        vec![
            ExportInfo { name: "a".into(), description: None },
            ExportInfo { name: "ro".into(), description: Some("x".into()) },
        ]
    }
    fn open(&self, name: &str) -> Result<Arc<dyn Export>, OpenError> {
        match name {
            "a" | "" => Ok(Arc::new(Disk { size: 1 << 20, ro: false, min: 1 })),
            "ro" => Ok(Arc::new(Disk { size: 4096, ro: true, min: 1 })),
            "aligned" => Ok(Arc::new(Disk { size: 1 << 20, ro: false, min: 512 })),
            "secret" => Err(OpenError::Denied { name: name.into(), reason: "no".into() }),
            _ => Err(OpenError::NotFound { name: name.into() }),
        }
    }
}

fn started(client_flags: u32) -> Handshake {
    let mut h = Handshake::new(Arc::new(Set));
    let g = h.take_output();
    assert_eq!(g, encode_greeting(3));
    assert_eq!(h.wanted(), 4);
    assert_eq!(h.receive(&client_flags.to_be_bytes()).unwrap(), 4);
    assert_eq!(h.wanted(), 16);
    h
}

fn opt(option: u32, data: &[u8]) -> Vec<u8> {
    let mut v = OptionHeader { option, len: data.len() as u32 }.to_bytes().to_vec();
    v.extend_from_slice(data);
    v
}

fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

/// Split an output buffer into (option, reply type, data) triples.
fn replies(mut out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let mut v = Vec::new();
    while !out.is_empty() {
        let h = parse_option_reply(out).unwrap();
        let end = 20 + h.len as usize;
        v.push((h.option, h.reply, out[20..end].to_vec()));
        out = &out[end..];
    }
    v
}

#[test]
fn go_with_structured_replies_and_meta_context() {
    let mut h = started(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    h.receive(&opt(OPT_STRUCTURED_REPLY, &[])).unwrap();
    assert_eq!(replies(&h.take_output()), vec![(8, REP_ACK, vec![])]);
    h.receive(&opt(
        OPT_SET_META_CONTEXT,
        &meta_data("a", &["base:allocation", "qemu:dirty-bitmap:x"]),
    ))
    .unwrap();
    let r = replies(&h.take_output());
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].1, REP_META_CONTEXT);
    assert_eq!(&r[0].2[..4], &BASE_ALLOCATION_ID.to_be_bytes());
    assert_eq!(&r[0].2[4..], b"base:allocation");
    assert_eq!(r[1].1, REP_ACK);
    h.receive(&opt(OPT_GO, &info_data("a", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION])))
        .unwrap();
    let r = replies(&h.take_output());
    let kinds: Vec<u16> =
        r.iter().filter(|x| x.1 == REP_INFO).map(|x| endian::be16(&x.2, 0)).collect();
    assert_eq!(kinds, vec![INFO_EXPORT, INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]);
    let tflags = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_TRIM
        | TFLAG_SEND_WRITE_ZEROES
        | TFLAG_SEND_FAST_ZERO
        | TFLAG_SEND_DF;
    assert_eq!(r[0].2, encode_info_export(1 << 20, tflags).to_vec());
    assert_eq!(r[1].2, encode_info_block_size(1, 4096, 32 << 20).to_vec());
    assert_eq!(&r[2].2[2..], b"a");
    assert_eq!(&r[3].2[2..], b"test disk");
    assert_eq!(r.last().unwrap().1, REP_ACK);
    assert_eq!(h.phase(), Phase::Transmission);
    assert_eq!(h.wanted(), 0);
    let n = h.into_negotiated().unwrap();
    assert!(n.structured);
    assert_eq!(n.base_allocation, Some(BASE_ALLOCATION_ID));
    assert_eq!(n.tflags, tflags);
}

#[test]
fn meta_context_for_other_export_is_not_active() {
    let mut h = started(1);
    h.receive(&opt(OPT_STRUCTURED_REPLY, &[])).unwrap();
    h.receive(&opt(OPT_SET_META_CONTEXT, &meta_data("ro", &["base:allocation"]))).unwrap();
    h.receive(&opt(OPT_GO, &info_data("a", &[]))).unwrap();
    assert_eq!(h.into_negotiated().unwrap().base_allocation, None);
}

#[test]
fn set_meta_context_requires_structured_replies() {
    let mut h = started(1);
    h.receive(&opt(OPT_SET_META_CONTEXT, &meta_data("a", &["base:allocation"]))).unwrap();
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_INVALID);
    h.receive(&opt(OPT_GO, &info_data("a", &[]))).unwrap();
    let n = h.into_negotiated().unwrap();
    assert!(!n.structured);
    assert_eq!(n.base_allocation, None);
    assert_eq!(n.tflags & TFLAG_SEND_DF, 0);
}

#[test]
fn list_meta_context_queries() {
    let mut h = started(1);
    h.receive(&opt(OPT_LIST_META_CONTEXT, &meta_data("a", &[]))).unwrap();
    let r = replies(&h.take_output());
    assert_eq!((r[0].1, &r[0].2[4..]), (REP_META_CONTEXT, &b"base:allocation"[..]));
    assert_eq!(r[1].1, REP_ACK);
    h.receive(&opt(OPT_LIST_META_CONTEXT, &meta_data("a", &["base:"]))).unwrap();
    assert_eq!(replies(&h.take_output()).len(), 2);
    h.receive(&opt(OPT_LIST_META_CONTEXT, &meta_data("a", &["qemu:"]))).unwrap();
    assert_eq!(replies(&h.take_output()), vec![(OPT_LIST_META_CONTEXT, REP_ACK, vec![])]);
    h.receive(&opt(OPT_LIST_META_CONTEXT, &meta_data("nope", &[]))).unwrap();
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_UNKNOWN);
    let mut bad = meta_data("a", &["base:allocation"]);
    bad.push(0);
    h.receive(&opt(OPT_LIST_META_CONTEXT, &bad)).unwrap();
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_INVALID);
    assert_eq!(h.phase(), Phase::Negotiating);
}

#[test]
fn info_then_list_then_go_default_export() {
    let mut h = started(1);
    h.receive(&opt(OPT_INFO, &info_data("ro", &[]))).unwrap();
    let r = replies(&h.take_output());
    let ro_flags = endian::be16(&r[0].2, 10);
    assert_ne!(ro_flags & TFLAG_READ_ONLY, 0);
    assert_eq!(ro_flags & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES), 0);
    assert_eq!(h.phase(), Phase::Negotiating);
    h.receive(&opt(OPT_LIST, &[])).unwrap();
    let r = replies(&h.take_output());
    assert_eq!(r.len(), 3);
    assert_eq!(r[0], (OPT_LIST, REP_SERVER, vec![0, 0, 0, 1, b'a']));
    assert_eq!(r[1], (OPT_LIST, REP_SERVER, vec![0, 0, 0, 2, b'r', b'o', b'x']));
    h.receive(&opt(OPT_LIST, &[1])).unwrap();
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_INVALID);
    h.receive(&opt(OPT_GO, &info_data("", &[]))).unwrap();
    assert_eq!(h.phase(), Phase::Transmission);
}

#[test]
fn go_errors_keep_negotiating() {
    let mut h = started(1);
    h.receive(&opt(OPT_GO, &info_data("missing", &[]))).unwrap();
    let r = replies(&h.take_output());
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].1, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&r[0].2).contains("missing"));
    h.receive(&opt(OPT_GO, &info_data("secret", &[]))).unwrap();
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_POLICY);
    let mut bad = info_data("a", &[1, 2]);
    bad.pop();
    h.receive(&opt(OPT_GO, &bad)).unwrap();
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_INVALID);
    // name length larger than the data
    h.receive(&opt(OPT_GO, &[0, 0, 0, 50, b'a', 0, 0])).unwrap();
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_INVALID);
    assert_eq!(h.phase(), Phase::Negotiating);
}

#[test]
fn block_size_required_for_aligned_export() {
    let mut h = started(1);
    h.receive(&opt(OPT_GO, &info_data("aligned", &[]))).unwrap();
    let r = replies(&h.take_output());
    assert_eq!(r.last().unwrap().1, REP_ERR_BLOCK_SIZE_REQD);
    assert_eq!(h.phase(), Phase::Negotiating);
    h.receive(&opt(OPT_GO, &info_data("aligned", &[INFO_BLOCK_SIZE]))).unwrap();
    assert_eq!(h.phase(), Phase::Transmission);
    assert_eq!(h.negotiated().unwrap().block_size.min, 512);
}

#[test]
fn export_name_with_and_without_zeroes() {
    let mut h = started(1);
    h.receive(&opt(OPT_EXPORT_NAME, b"a")).unwrap();
    let out = h.take_output();
    assert_eq!(out.len(), 134);
    assert_eq!(&out[..8], &(1u64 << 20).to_be_bytes());
    assert_eq!(h.phase(), Phase::Transmission);

    let mut h = started(3);
    h.receive(&opt(OPT_EXPORT_NAME, b"a")).unwrap();
    assert_eq!(h.take_output().len(), 10);

    let mut h = started(1);
    assert!(matches!(
        h.receive(&opt(OPT_EXPORT_NAME, b"zz")),
        Err(HandshakeError::ExportNameRefused { .. })
    ));
    assert_eq!(h.phase(), Phase::Failed);
    assert!(h.take_output().is_empty());
}

#[test]
fn abort_unknown_and_starttls() {
    let mut h = started(1);
    h.receive(&opt(OPT_STARTTLS, &[])).unwrap();
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_UNSUP);
    h.receive(&opt(4242, &[1, 2, 3])).unwrap();
    assert_eq!(
        replies(&h.take_output())[0],
        (4242, REP_ERR_UNSUP, b"Option 4242 is not supported".to_vec())
    );
    h.receive(&opt(OPT_STRUCTURED_REPLY, &[9])).unwrap();
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_INVALID);
    h.receive(&opt(OPT_ABORT, &[])).unwrap();
    assert_eq!(replies(&h.take_output()), vec![(OPT_ABORT, REP_ACK, vec![])]);
    assert_eq!(h.phase(), Phase::Aborted);
    assert!(matches!(h.receive(&[0]), Err(HandshakeError::Ended)));
}

#[test]
fn malformed_inputs_fail() {
    let mut h = Handshake::new(Arc::new(Set));
    assert!(matches!(h.receive(&[0, 0, 0, 4]), Err(HandshakeError::BadClientFlags { flags: 4 })));
    assert_eq!(h.phase(), Phase::Failed);

    let mut h = started(1);
    let mut o = opt(OPT_LIST, &[]);
    o[0] = b'J';
    assert!(matches!(h.receive(&o), Err(HandshakeError::Header { .. })));
    assert_eq!(h.phase(), Phase::Failed);
}

#[test]
fn oversized_option_is_skipped_then_refused() {
    let mut h = started(1);
    let len = MAX_OPTION_LEN + 10;
    h.receive(&OptionHeader { option: OPT_GO, len }.to_bytes()).unwrap();
    assert!(h.take_output().is_empty());
    let junk = vec![7u8; len as usize];
    // feed in odd pieces; nothing is buffered
    let mut fed = 0;
    for piece in junk.chunks(9999) {
        fed += h.receive(piece).unwrap();
        assert!(h.buf.capacity() <= OPTION_HEADER_LEN);
    }
    assert_eq!(fed, len as usize);
    assert_eq!(replies(&h.take_output())[0].1, REP_ERR_TOO_BIG);
    h.receive(&opt(OPT_GO, &info_data("a", &[]))).unwrap();
    assert_eq!(h.phase(), Phase::Transmission);

    let mut h = started(1);
    let r = h.receive(&OptionHeader { option: OPT_EXPORT_NAME, len: u32::MAX }.to_bytes());
    assert!(matches!(r, Err(HandshakeError::ExportNameInvalid { .. })));
}

#[test]
fn byte_at_a_time_equals_all_at_once() {
    let mut script = 1u32.to_be_bytes().to_vec();
    script.extend(opt(OPT_STRUCTURED_REPLY, &[]));
    script.extend(opt(OPT_LIST, &[]));
    script.extend(opt(OPT_SET_META_CONTEXT, &meta_data("a", &["base:allocation"])));
    script.extend(opt(OPT_GO, &info_data("a", &[INFO_BLOCK_SIZE])));
    let trailing = [0x25u8, 0x60, 0x95, 0x13];
    script.extend_from_slice(&trailing);

    let mut whole = Handshake::new(Arc::new(Set));
    let used = whole.receive(&script).unwrap();
    assert_eq!(used, script.len() - trailing.len(), "transmission bytes must be left unconsumed");
    let mut single = Handshake::new(Arc::new(Set));
    let mut used1 = 0;
    for b in &script {
        used1 += single.receive(std::slice::from_ref(b)).unwrap();
        if single.phase() == Phase::Transmission {
            break;
        }
    }
    assert_eq!(used1, used);
    assert_eq!(whole.output(), single.output());
    assert_eq!(single.negotiated().unwrap().base_allocation, Some(BASE_ALLOCATION_ID));
}

#[test]
fn too_many_options() {
    let mut h = started(1);
    let one = opt(OPT_STRUCTURED_REPLY, &[]);
    for _ in 0..MAX_OPTIONS {
        h.receive(&one).unwrap();
    }
    assert!(matches!(h.receive(&one), Err(HandshakeError::TooManyOptions { .. })));
}

#[test]
fn block_size_sanitizing() {
    let b = sanitize_block_size(BlockSize { min: 3, preferred: 100, max: u32::MAX }, 1 << 30);
    assert_eq!(b, BlockSize { min: 1, preferred: 4096, max: MAX_REQUEST_LEN });
    let b = sanitize_block_size(BlockSize { min: 4096, preferred: 4096, max: 10_000 }, 1 << 30);
    assert_eq!(b, BlockSize { min: 4096, preferred: 4096, max: 8192 });
    let b = sanitize_block_size(BlockSize { min: 512, preferred: 65536, max: 0 }, 1 << 30);
    assert_eq!(b.max, 65536);
    let b = sanitize_block_size(BlockSize::default(), 0);
    assert!(b.max >= b.min);
}

#[test]
fn parsers_reject_without_panicking() {
    assert_eq!(parse_info_request(&[]), Err(OptionDataError::Short));
    assert_eq!(
        parse_info_request(&[0xff, 0xff, 0xff, 0xff, 0, 0]),
        Err(OptionDataError::StringTooLong)
    );
    assert_eq!(
        parse_meta_request(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
        Err(OptionDataError::Short)
    );
    assert_eq!(parse_meta_request(&[0, 0, 0, 1, 0, 0, 0, 0, 0]), Err(OptionDataError::StringNul));
    assert_eq!(
        parse_meta_request(&[0, 0, 0, 0, 0, 0, 0, 0]).unwrap(),
        MetaRequest { name: String::new(), queries: vec![] }
    );
}
