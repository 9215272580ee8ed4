//! NBD wire format: magics, codes, and the fixed-size headers, as pure functions over bytes.
//!
//! Everything here is side-effect free so that the handshake state machine, the transmission
//! loop, the tests and cargo-fuzz all share one definition of the bytes on the wire
//! (NetworkBlockDevice/nbd `doc/proto.md`). All integers are big-endian. Parsers take `&[u8]`
//! and never panic: a short or malformed buffer is a `ProtoError`. Encoders return fixed-size
//! arrays so a header is built without allocating; payloads are appended by the caller.
//! The unit tests at the bottom pin every header byte by byte.

use crate::endian::{be16, be32, be64};
use std::fmt;

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: second greeting magic and the magic of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every fixed-newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server, 16 bits) and client flags (32 bits).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags (16 bits).
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_RESIZE: u16 = 1 << 9;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// Option codes.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const REP_ERR_POLICY: u32 = 0x8000_0002;
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
pub const REP_ERR_PLATFORM: u32 = 0x8000_0004;
pub const REP_ERR_TLS_REQD: u32 = 0x8000_0005;
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
pub const REP_ERR_SHUTDOWN: u32 = 0x8000_0007;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = 0x8000_0008;
pub const REP_ERR_TOO_BIG: u32 = 0x8000_0009;

// NBD_INFO_* types inside NBD_REP_INFO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Command types.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured reply flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

// base:allocation status flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// The one metadata context this server implements.
pub const CONTEXT_BASE_ALLOCATION: &str = "base:allocation";

/// Length of the server greeting: NBDMAGIC, IHAVEOPT, handshake flags.
pub const GREETING_LEN: usize = 18;
/// Length of a client option header: IHAVEOPT, option, data length.
pub const OPTION_HEADER_LEN: usize = 16;
/// Length of an option reply header: magic, option, type, data length.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
/// Length of a transmission request header.
pub const REQUEST_LEN: usize = 28;
/// Length of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Length of a structured reply chunk header.
pub const CHUNK_HEADER_LEN: usize = 20;
/// Zero padding after the NBD_OPT_EXPORT_NAME reply unless NO_ZEROES was negotiated.
pub const EXPORT_NAME_PADDING: usize = 124;
/// Longest string (export name, query, message) the protocol allows.
pub const MAX_STRING_LEN: usize = 4096;

/// Error values carried in replies (`NBD_E*`); the numbers are fixed by the protocol, not by
/// the host's errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum NbdErrno {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    Overflow = 75,
    NotSup = 95,
    Shutdown = 108,
}

impl NbdErrno {
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Parse a reply error field; unknown values are `None` (clients treat them as EINVAL).
    pub fn from_code(code: u32) -> Option<NbdErrno> {
        Some(match code {
            1 => NbdErrno::Perm,
            5 => NbdErrno::Io,
            12 => NbdErrno::NoMem,
            22 => NbdErrno::Inval,
            28 => NbdErrno::NoSpc,
            75 => NbdErrno::Overflow,
            95 => NbdErrno::NotSup,
            108 => NbdErrno::Shutdown,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            NbdErrno::Perm => "EPERM",
            NbdErrno::Io => "EIO",
            NbdErrno::NoMem => "ENOMEM",
            NbdErrno::Inval => "EINVAL",
            NbdErrno::NoSpc => "ENOSPC",
            NbdErrno::Overflow => "EOVERFLOW",
            NbdErrno::NotSup => "ENOTSUP",
            NbdErrno::Shutdown => "ESHUTDOWN",
        }
    }
}

impl fmt::Display for NbdErrno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("Truncated {what}: got {got} bytes, need {need}")]
    Short { what: &'static str, got: usize, need: usize },
    #[error("Bad request magic {magic:#010x}, expected {REQUEST_MAGIC:#010x}")]
    BadRequestMagic { magic: u32 },
    #[error("Bad option magic {magic:#018x}, expected IHAVEOPT")]
    BadOptionMagic { magic: u64 },
}

fn need(what: &'static str, b: &[u8], n: usize) -> Result<(), ProtoError> {
    if b.len() < n {
        return Err(ProtoError::Short { what, got: b.len(), need: n });
    }
    Ok(())
}

/// The server greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub fn encode_greeting(handshake_flags: u16) -> [u8; GREETING_LEN] {
    let mut b = [0u8; GREETING_LEN];
    b[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&handshake_flags.to_be_bytes());
    b
}

/// Parse the 4-byte client flags that follow the greeting.
pub fn parse_client_flags(b: &[u8]) -> Result<u32, ProtoError> {
    need("client flags", b, 4)?;
    Ok(be32(b, 0))
}

/// A client option header; `len` bytes of option data follow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

/// Parse a 16-byte option header. Bad magic is an error: the session must end.
pub fn parse_option_header(b: &[u8]) -> Result<OptionHeader, ProtoError> {
    need("option header", b, OPTION_HEADER_LEN)?;
    let magic = be64(b, 0);
    if magic != IHAVEOPT {
        return Err(ProtoError::BadOptionMagic { magic });
    }
    Ok(OptionHeader { option: be32(b, 8), len: be32(b, 12) })
}

impl OptionHeader {
    pub fn to_bytes(self) -> [u8; OPTION_HEADER_LEN] {
        let mut b = [0u8; OPTION_HEADER_LEN];
        b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// Header of one fixed-newstyle option reply; `len` bytes of reply data follow.
pub fn encode_option_reply(option: u32, reply: u32, len: u32) -> [u8; OPTION_REPLY_HEADER_LEN] {
    let mut b = [0u8; OPTION_REPLY_HEADER_LEN];
    b[0..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    b[8..12].copy_from_slice(&option.to_be_bytes());
    b[12..16].copy_from_slice(&reply.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// A parsed option reply header (used by clients and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply: u32,
    pub len: u32,
}

pub fn parse_option_reply(b: &[u8]) -> Result<OptionReplyHeader, ProtoError> {
    need("option reply", b, OPTION_REPLY_HEADER_LEN)?;
    let magic = be64(b, 0);
    if magic != OPTION_REPLY_MAGIC {
        return Err(ProtoError::BadOptionMagic { magic });
    }
    Ok(OptionReplyHeader { option: be32(b, 8), reply: be32(b, 12), len: be32(b, 16) })
}

/// Payload of `NBD_INFO_EXPORT`: type, size, transmission flags (12 bytes).
pub fn encode_info_export(size: u64, tflags: u16) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    b[2..10].copy_from_slice(&size.to_be_bytes());
    b[10..12].copy_from_slice(&tflags.to_be_bytes());
    b
}

/// Payload of `NBD_INFO_BLOCK_SIZE`: type, minimum, preferred, maximum (14 bytes).
pub fn encode_info_block_size(min: u32, preferred: u32, max: u32) -> [u8; 14] {
    let mut b = [0u8; 14];
    b[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b[2..6].copy_from_slice(&min.to_be_bytes());
    b[6..10].copy_from_slice(&preferred.to_be_bytes());
    b[10..14].copy_from_slice(&max.to_be_bytes());
    b
}

/// Reply to `NBD_OPT_EXPORT_NAME`: size, transmission flags (+124 zeroes unless NO_ZEROES).
pub fn encode_export_name_reply(size: u64, tflags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut b = Vec::with_capacity(10 + EXPORT_NAME_PADDING);
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&tflags.to_be_bytes());
    if !no_zeroes {
        b.resize(10 + EXPORT_NAME_PADDING, 0);
    }
    b
}

/// The command of a request; unknown types are kept so they can be answered with EINVAL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Unknown(u16),
}

impl Command {
    pub fn from_u16(t: u16) -> Command {
        match t {
            CMD_READ => Command::Read,
            CMD_WRITE => Command::Write,
            CMD_DISC => Command::Disc,
            CMD_FLUSH => Command::Flush,
            CMD_TRIM => Command::Trim,
            CMD_CACHE => Command::Cache,
            CMD_WRITE_ZEROES => Command::WriteZeroes,
            CMD_BLOCK_STATUS => Command::BlockStatus,
            other => Command::Unknown(other),
        }
    }

    pub fn to_u16(self) -> u16 {
        match self {
            Command::Read => CMD_READ,
            Command::Write => CMD_WRITE,
            Command::Disc => CMD_DISC,
            Command::Flush => CMD_FLUSH,
            Command::Trim => CMD_TRIM,
            Command::Cache => CMD_CACHE,
            Command::WriteZeroes => CMD_WRITE_ZEROES,
            Command::BlockStatus => CMD_BLOCK_STATUS,
            Command::Unknown(t) => t,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Command::Read => "read",
            Command::Write => "write",
            Command::Disc => "disconnect",
            Command::Flush => "flush",
            Command::Trim => "trim",
            Command::Cache => "cache",
            Command::WriteZeroes => "write-zeroes",
            Command::BlockStatus => "block-status",
            Command::Unknown(_) => "unknown",
        }
    }
}

/// A transmission request header. For `Write`, `len` payload bytes follow on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    pub handle: u64,
    pub offset: u64,
    pub len: u32,
}

/// Parse a 28-byte request header. This is the trust boundary of the transmission phase and
/// the entry point of the `nbd_request` fuzz target.
pub fn parse_request(b: &[u8]) -> Result<Request, ProtoError> {
    need("request", b, REQUEST_LEN)?;
    let magic = be32(b, 0);
    if magic != REQUEST_MAGIC {
        return Err(ProtoError::BadRequestMagic { magic });
    }
    Ok(Request {
        flags: be16(b, 4),
        command: Command::from_u16(be16(b, 6)),
        handle: be64(b, 8),
        offset: be64(b, 16),
        len: be32(b, 24),
    })
}

impl Request {
    pub fn to_bytes(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_u16().to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// Simple reply header: magic, error, handle. Read data (if any) follows.
pub fn encode_simple_reply(handle: u64, error: u32) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b
}

/// Parsed simple reply header (clients and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub handle: u64,
}

/// Structured reply chunk header: magic, flags, type, handle, payload length.
pub fn encode_chunk_header(flags: u16, kind: u16, handle: u64, len: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut b = [0u8; CHUNK_HEADER_LEN];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// Parsed structured chunk header (clients and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub kind: u16,
    pub handle: u64,
    pub len: u32,
}

/// Either kind of reply header, told apart by magic. Simple replies are 16 bytes, chunk
/// headers 20: callers read 16 bytes, and 4 more if `needs_more` says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyHeader {
    Simple(SimpleReply),
    Chunk(ChunkHeader),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Bad reply magic {magic:#010x}")]
pub struct BadReplyMagic {
    pub magic: u32,
}

/// Parse a reply header from `b` (16 bytes for simple, 20 for structured).
pub fn parse_reply_header(b: &[u8]) -> Result<Option<ReplyHeader>, BadReplyMagic> {
    if b.len() < 4 {
        return Ok(None);
    }
    match be32(b, 0) {
        SIMPLE_REPLY_MAGIC if b.len() >= SIMPLE_REPLY_LEN => {
            Ok(Some(ReplyHeader::Simple(SimpleReply { error: be32(b, 4), handle: be64(b, 8) })))
        }
        STRUCTURED_REPLY_MAGIC if b.len() >= CHUNK_HEADER_LEN => {
            Ok(Some(ReplyHeader::Chunk(ChunkHeader {
                flags: be16(b, 4),
                kind: be16(b, 6),
                handle: be64(b, 8),
                len: be32(b, 16),
            })))
        }
        SIMPLE_REPLY_MAGIC | STRUCTURED_REPLY_MAGIC => Ok(None),
        magic => Err(BadReplyMagic { magic }),
    }
}

/// Payload of an `NBD_REPLY_TYPE_ERROR` chunk: error, message length, message.
/// The message is cut to the protocol's 4096-byte string limit (on a char boundary).
pub fn encode_error_payload(errno: NbdErrno, message: &str) -> Vec<u8> {
    let mut end = message.len().min(MAX_STRING_LEN);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let msg = &message.as_bytes()[..end];
    let mut b = Vec::with_capacity(6 + msg.len());
    b.extend_from_slice(&errno.code().to_be_bytes());
    b.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    b.extend_from_slice(msg);
    b
}

/// One `base:allocation` descriptor on the wire: length and status flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub len: u32,
    pub flags: u32,
}

/// Payload of an `NBD_REPLY_TYPE_BLOCK_STATUS` chunk: context id, then descriptors.
pub fn encode_block_status_payload(context_id: u32, descriptors: &[Descriptor]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + 8 * descriptors.len());
    b.extend_from_slice(&context_id.to_be_bytes());
    for d in descriptors {
        b.extend_from_slice(&d.len.to_be_bytes());
        b.extend_from_slice(&d.flags.to_be_bytes());
    }
    b
}

/// Parse a block status payload (clients and tests). `None` if the length is not 4 + 8n.
pub fn parse_block_status_payload(b: &[u8]) -> Option<(u32, Vec<Descriptor>)> {
    if b.len() < 4 || !(b.len() - 4).is_multiple_of(8) {
        return None;
    }
    let id = be32(b, 0);
    let descs =
        b[4..].chunks_exact(8).map(|c| Descriptor { len: be32(c, 0), flags: be32(c, 4) }).collect();
    Some((id, descs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magics_are_the_protocol_values() {
        assert_eq!(&NBD_MAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
        assert_eq!(
            OPTION_REPLY_MAGIC.to_be_bytes(),
            [0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9]
        );
        assert_eq!(REQUEST_MAGIC.to_be_bytes(), [0x25, 0x60, 0x95, 0x13]);
        assert_eq!(SIMPLE_REPLY_MAGIC.to_be_bytes(), [0x67, 0x44, 0x66, 0x98]);
        assert_eq!(STRUCTURED_REPLY_MAGIC.to_be_bytes(), [0x66, 0x8e, 0x33, 0xef]);
    }

    #[test]
    fn code_values_are_pinned() {
        assert_eq!((OPT_INFO, OPT_GO, OPT_STRUCTURED_REPLY), (6, 7, 8));
        assert_eq!((OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT), (9, 10));
        assert_eq!(REP_ERR_UNSUP, (1 << 31) + 1);
        assert_eq!(REP_ERR_TOO_BIG, (1 << 31) + 9);
        assert_eq!(REPLY_TYPE_ERROR, 32769);
        assert_eq!(REPLY_TYPE_ERROR_OFFSET, 32770);
        assert_eq!(TFLAG_SEND_FAST_ZERO, 0x0800);
        assert_eq!(TFLAG_CAN_MULTI_CONN, 0x0100);
        assert_eq!(CMD_FLAG_FAST_ZERO, 0x10);
        assert_eq!(NbdErrno::NotSup.code(), 95);
        assert_eq!(NbdErrno::Shutdown.code(), 108);
        for c in [1, 5, 12, 22, 28, 75, 95, 108] {
            assert_eq!(NbdErrno::from_code(c).unwrap().code(), c);
        }
        assert_eq!(NbdErrno::from_code(2), None);
    }

    #[test]
    fn greeting_bytes() {
        let g = encode_greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..], &[0, 3]);
    }

    #[test]
    fn request_layout_is_pinned() {
        let raw: [u8; 28] = [
            0x25, 0x60, 0x95, 0x13, // magic
            0x00, 0x01, // flags: FUA
            0x00, 0x01, // type: write
            1, 2, 3, 4, 5, 6, 7, 8, // handle
            0, 0, 0, 0, 0, 0, 0x10, 0x00, // offset 4096
            0, 0, 0x02, 0x00, // length 512
        ];
        let r = parse_request(&raw).unwrap();
        assert_eq!(r.flags, CMD_FLAG_FUA);
        assert_eq!(r.command, Command::Write);
        assert_eq!(r.handle, 0x0102030405060708);
        assert_eq!(r.offset, 4096);
        assert_eq!(r.len, 512);
        assert_eq!(r.to_bytes(), raw);
    }

    #[test]
    fn request_errors() {
        assert_eq!(
            parse_request(&[0; 27]),
            Err(ProtoError::Short { what: "request", got: 27, need: 28 })
        );
        let mut raw = [0u8; 28];
        raw[0..4].copy_from_slice(&0x12560953u32.to_be_bytes());
        assert_eq!(parse_request(&raw), Err(ProtoError::BadRequestMagic { magic: 0x12560953 }));
        let r = Request { flags: 0, command: Command::Unknown(99), handle: 7, offset: 0, len: 0 };
        assert_eq!(parse_request(&r.to_bytes()).unwrap().command, Command::Unknown(99));
    }

    #[test]
    fn option_header_layout() {
        let h = OptionHeader { option: OPT_GO, len: 0x0102 };
        let b = h.to_bytes();
        assert_eq!(&b[..8], b"IHAVEOPT");
        assert_eq!(&b[8..], &[0, 0, 0, 7, 0, 0, 1, 2]);
        assert_eq!(parse_option_header(&b).unwrap(), h);
        let mut bad = b;
        bad[0] = b'X';
        assert!(matches!(parse_option_header(&bad), Err(ProtoError::BadOptionMagic { .. })));
        assert!(matches!(parse_option_header(&b[..15]), Err(ProtoError::Short { .. })));
    }

    #[test]
    fn option_reply_layout() {
        let b = encode_option_reply(OPT_LIST, REP_SERVER, 9);
        assert_eq!(
            b,
            [0, 3, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 9]
        );
        assert_eq!(
            parse_option_reply(&b).unwrap(),
            OptionReplyHeader { option: 3, reply: 2, len: 9 }
        );
    }

    #[test]
    fn info_payloads() {
        assert_eq!(
            encode_info_export(0x1_0000_0000, 0x0d6f),
            [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0x0d, 0x6f]
        );
        assert_eq!(
            encode_info_block_size(1, 4096, 32 << 20),
            [0, 3, 0, 0, 0, 1, 0, 0, 0x10, 0, 0x02, 0, 0, 0]
        );
    }

    #[test]
    fn export_name_reply_padding() {
        let r = encode_export_name_reply(1 << 20, 0x0003, false);
        assert_eq!(r.len(), 134);
        assert_eq!(&r[..10], &[0, 0, 0, 0, 0, 0x10, 0, 0, 0, 3]);
        assert!(r[10..].iter().all(|&b| b == 0));
        assert_eq!(encode_export_name_reply(1 << 20, 0x0003, true).len(), 10);
    }

    #[test]
    fn reply_headers() {
        let s = encode_simple_reply(0xAABB, 22);
        assert_eq!(s, [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 0, 0, 0, 0, 0, 0, 0xAA, 0xBB]);
        assert_eq!(
            parse_reply_header(&s).unwrap(),
            Some(ReplyHeader::Simple(SimpleReply { error: 22, handle: 0xAABB }))
        );
        let c = encode_chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 5, 4104);
        assert_eq!(
            c,
            [0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0x10, 0x08]
        );
        assert_eq!(
            parse_reply_header(&c).unwrap(),
            Some(ReplyHeader::Chunk(ChunkHeader { flags: 1, kind: 1, handle: 5, len: 4104 }))
        );
        assert_eq!(parse_reply_header(&c[..16]).unwrap(), None);
        assert!(parse_reply_header(&[1, 2, 3, 4]).is_err());
    }

    #[test]
    fn error_and_block_status_payloads() {
        let e = encode_error_payload(NbdErrno::Inval, "bad");
        assert_eq!(e, [0, 0, 0, 22, 0, 3, b'b', b'a', b'd']);
        let long = "é".repeat(3000); // 6000 bytes, cut on a char boundary
        let e = encode_error_payload(NbdErrno::Io, &long);
        assert_eq!(be16(&e, 4) as usize, 4096);
        assert!(std::str::from_utf8(&e[6..]).is_ok());
        let d = [
            Descriptor { len: 4096, flags: STATE_HOLE | STATE_ZERO },
            Descriptor { len: 512, flags: 0 },
        ];
        let p = encode_block_status_payload(1, &d);
        assert_eq!(p, [0, 0, 0, 1, 0, 0, 0x10, 0, 0, 0, 0, 3, 0, 0, 2, 0, 0, 0, 0, 0]);
        assert_eq!(parse_block_status_payload(&p), Some((1, d.to_vec())));
        assert_eq!(parse_block_status_payload(&p[..7]), None);
    }
}
