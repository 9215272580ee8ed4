//! Fixed-newstyle NBD handshake as an explicit, socket-free state machine.
//!
//! ```text
//!            new(): greeting queued (NBDMAGIC IHAVEOPT flags=FIXED_NEWSTYLE|NO_ZEROES)
//!                 |
//!                 v
//!        +--> ClientFlags (want 4) --unknown bit--> Failed
//!        |        |
//!        |        v
//!        |   OptionHeader (want 16) --bad magic / too many options--> Failed
//!        |        |            \-- len > MAX_OPTION_LEN --> Discard(len) --> reply TOO_BIG --+
//!        |        v                                                                          |
//!        |   OptionData (want len)                                                           |
//!        |        |-- ABORT ----------------------> ACK, Aborted                             |
//!        |        |-- EXPORT_NAME ok -------------> size+flags(+zeroes), Transmission        |
//!        |        |-- EXPORT_NAME unknown --------> Failed (the option cannot carry errors)  |
//!        |        |-- GO ok ----------------------> INFO.. ACK, Transmission                 |
//!        |        |-- INFO, GO error, LIST, STRUCTURED_REPLY, (LIST|SET)_META_CONTEXT,       |
//!        |        |   unknown (ERR_UNSUP) --------> replies, back to OptionHeader ---------->+
//!        +--------+<-------------------------------------------------------------------------+
//! ```
//!
//! The machine consumes bytes (`receive`) and queues bytes to send (`take_output`); it never
//! touches a socket, so tests and the fuzzer drive it with byte slices. `wanted()` says how
//! many bytes complete the current message, letting the socket driver `read_exact` exactly
//! that much and never read past the handshake into transmission data. Memory is bounded:
//! option data is buffered only up to `MAX_OPTION_LEN`; longer options are skipped without
//! buffering and answered with `NBD_REP_ERR_TOO_BIG`.

use crate::endian;
use std::io::{Read, Write};
use std::sync::Arc;

use super::export::{BlockSize, Export, ExportSet, OpenError};
use super::proto::*;

/// Largest option payload buffered; longer ones are discarded and refused.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Options accepted on one connection before the server hangs up (denial-of-service guard).
pub(crate) const MAX_OPTIONS: u32 = 4096;
/// Largest READ/WRITE payload the server accepts (2^25, the spec's portable limit).
pub const MAX_REQUEST_LEN: u32 = 32 << 20;
/// Context id this server assigns to `base:allocation`.
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;

const TARGET: &str = "strata::nbd";

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("Client flags {flags:#x} contain bits the server did not offer")]
    BadClientFlags { flags: u32 },
    #[error("Malformed option header")]
    Header {
        #[source]
        source: ProtoError,
    },
    #[error("Client sent more than {max} options; hanging up")]
    TooManyOptions { max: u32 },
    #[error("NBD_OPT_EXPORT_NAME refused for '{name}'")]
    ExportNameRefused {
        name: String,
        #[source]
        source: OpenError,
    },
    #[error("NBD_OPT_EXPORT_NAME with an unusable name ({reason})")]
    ExportNameInvalid { reason: &'static str },
    #[error("Handshake already ended; no more input accepted")]
    Ended,
}

/// Everything the transmission phase needs, fixed at the end of the handshake.
#[derive(Clone)]
pub struct Negotiated {
    pub name: String,
    pub export: Arc<dyn Export>,
    pub size: u64,
    /// Transmission flags as sent to the client.
    pub tflags: u16,
    pub structured: bool,
    /// Context id of `base:allocation` if the client selected it for this export.
    pub base_allocation: Option<u32>,
    /// Effective block size constraints (sanitised, capped at `MAX_REQUEST_LEN`).
    pub block_size: BlockSize,
}

impl std::fmt::Debug for Negotiated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Negotiated")
            .field("name", &self.name)
            .field("size", &self.size)
            .field("tflags", &format_args!("{:#06x}", self.tflags))
            .field("structured", &self.structured)
            .field("base_allocation", &self.base_allocation)
            .field("block_size", &self.block_size)
            .finish()
    }
}

/// Coarse state for callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Negotiating,
    /// `NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME` succeeded.
    Transmission,
    /// The client sent `NBD_OPT_ABORT` (soft disconnect).
    Aborted,
    /// A protocol violation; the connection must be closed after sending pending output.
    Failed,
}

enum State {
    ClientFlags,
    OptionHeader,
    OptionData { option: u32, len: u32 },
    Discard { option: u32, len: u32, left: u64 },
    Transmission(Box<Negotiated>),
    Aborted,
    Failed,
}

#[derive(Clone, Debug, Default)]
struct MetaSelection {
    export: String,
    base_allocation: bool,
}

/// The server side of one handshake.
pub struct Handshake {
    exports: Arc<dyn ExportSet>,
    state: State,
    buf: Vec<u8>,
    out: Vec<u8>,
    no_zeroes: bool,
    structured: bool,
    meta: Option<MetaSelection>,
    options: u32,
}

/// Parsed body of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub infos: Vec<u16>,
}

/// Parsed body of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaRequest {
    pub name: String,
    pub queries: Vec<String>,
}

/// Why the data of an option naming an export is refused (the client is told, in an
/// `NBD_REP_ERR_INVALID` reply).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OptionDataError {
    #[error("String longer than {MAX_STRING_LEN} bytes")]
    StringTooLong,
    #[error("String runs past the option data")]
    StringPastEnd,
    #[error("String contains NUL")]
    StringNul,
    #[error("String is not UTF-8")]
    StringNotUtf8,
    #[error("Option data too short")]
    Short,
    #[error("Missing information request count")]
    NoInfoCount,
    #[error("Information request count does not match the option length")]
    InfoCount,
    #[error("Trailing bytes after the last query")]
    Trailing,
}

fn take_string(b: &[u8], at: usize, len: usize) -> Result<String, OptionDataError> {
    if len > MAX_STRING_LEN {
        return Err(OptionDataError::StringTooLong);
    }
    let end = at.checked_add(len).ok_or(OptionDataError::StringPastEnd)?;
    let s = b.get(at..end).ok_or(OptionDataError::StringPastEnd)?;
    if s.contains(&0) {
        return Err(OptionDataError::StringNul);
    }
    String::from_utf8(s.to_vec()).map_err(|_| OptionDataError::StringNotUtf8)
}

fn take_u32(b: &[u8], at: usize) -> Result<u32, OptionDataError> {
    endian::be32_at(b, at).ok_or(OptionDataError::Short)
}

/// Parse `NBD_OPT_INFO`/`NBD_OPT_GO` data: name length, name, count, info types.
pub fn parse_info_request(data: &[u8]) -> Result<InfoRequest, OptionDataError> {
    let name_len = take_u32(data, 0)? as usize;
    let name = take_string(data, 4, name_len)?;
    let at = 4 + name_len;
    let count = endian::be16_at(data, at).ok_or(OptionDataError::NoInfoCount)? as usize;
    let list = &data[at + 2..];
    if list.len() != count * 2 {
        return Err(OptionDataError::InfoCount);
    }
    let infos = list.chunks_exact(2).map(|c| endian::be16(c, 0)).collect();
    Ok(InfoRequest { name, infos })
}

/// Parse meta-context option data: name length, name, query count, (length, query)*.
pub fn parse_meta_request(data: &[u8]) -> Result<MetaRequest, OptionDataError> {
    let name_len = take_u32(data, 0)? as usize;
    let name = take_string(data, 4, name_len)?;
    let mut at = 4 + name_len;
    let count = take_u32(data, at)?;
    at += 4;
    let mut queries = Vec::new();
    for _ in 0..count {
        let qlen = take_u32(data, at)? as usize;
        at += 4;
        queries.push(take_string(data, at, qlen)?);
        at += qlen;
    }
    if at != data.len() {
        return Err(OptionDataError::Trailing);
    }
    Ok(MetaRequest { name, queries })
}

/// Clamp an export's block size answer into values the spec allows.
pub fn sanitize_block_size(b: BlockSize, size: u64) -> BlockSize {
    let min = if b.min.is_power_of_two() && b.min <= 65536 { b.min } else { 1 };
    let floor = min.max(512);
    let preferred = if b.preferred.is_power_of_two() && b.preferred >= floor {
        b.preferred
    } else {
        floor.max(4096)
    };
    let mut max = b.max.min(MAX_REQUEST_LEN);
    max -= max % min;
    let need = (preferred as u64).min(size).min(MAX_REQUEST_LEN as u64) as u32;
    if max < need {
        max = need.div_ceil(min) * min;
    }
    if max == 0 {
        max = min;
    }
    BlockSize { min, preferred, max }
}

/// Transmission flags for `export`, given whether structured replies were negotiated.
pub fn transmission_flags(export: &dyn Export, structured: bool) -> u16 {
    let mut f = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA;
    if export.is_read_only() {
        f |= TFLAG_READ_ONLY;
    } else {
        f |= TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
        if export.can_trim() {
            f |= TFLAG_SEND_TRIM;
        }
    }
    if export.can_multi_conn() {
        f |= TFLAG_CAN_MULTI_CONN;
    }
    if structured {
        f |= TFLAG_SEND_DF;
    }
    f
}

impl Handshake {
    /// Start a handshake; the greeting is queued in the output.
    pub fn new(exports: Arc<dyn ExportSet>) -> Handshake {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(&encode_greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
        Handshake {
            exports,
            state: State::ClientFlags,
            buf: Vec::new(),
            out,
            no_zeroes: false,
            structured: false,
            meta: None,
            options: 0,
        }
    }

    pub fn phase(&self) -> Phase {
        match self.state {
            State::Transmission(_) => Phase::Transmission,
            State::Aborted => Phase::Aborted,
            State::Failed => Phase::Failed,
            _ => Phase::Negotiating,
        }
    }

    /// Bytes still needed to complete the current message (0 once the handshake ended).
    pub fn wanted(&self) -> usize {
        let total = match &self.state {
            State::ClientFlags => 4,
            State::OptionHeader => OPTION_HEADER_LEN,
            State::OptionData { len, .. } => *len as usize,
            State::Discard { left, .. } => return (*left).min(1 << 16) as usize,
            _ => return 0,
        };
        total - self.buf.len()
    }

    /// Bytes queued for the client.
    pub fn output(&self) -> &[u8] {
        &self.out
    }

    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    /// The negotiated session, once `phase()` is `Transmission`.
    pub fn negotiated(&self) -> Option<&Negotiated> {
        match &self.state {
            State::Transmission(n) => Some(n),
            _ => None,
        }
    }

    pub fn into_negotiated(self) -> Option<Negotiated> {
        match self.state {
            State::Transmission(n) => Some(*n),
            _ => None,
        }
    }

    /// Feed client bytes. Returns how many were consumed: input after the end of the
    /// handshake is left for the transmission phase. On error the machine is `Failed`; any
    /// queued output should still be sent before closing.
    pub fn receive(&mut self, input: &[u8]) -> Result<usize, HandshakeError> {
        let mut used = 0;
        loop {
            match &mut self.state {
                State::Transmission(_) => return Ok(used),
                State::Aborted | State::Failed => {
                    return if used == 0 && !input.is_empty() {
                        Err(HandshakeError::Ended)
                    } else {
                        Ok(used)
                    };
                }
                State::Discard { option, len, left } => {
                    let n = (*left).min((input.len() - used) as u64);
                    *left -= n;
                    used += n as usize;
                    if *left > 0 {
                        return Ok(used);
                    }
                    let (option, len) = (*option, *len);
                    self.state = State::OptionHeader;
                    let msg =
                        format!("Option data of {len} bytes exceeds the {MAX_OPTION_LEN}-byte cap");
                    self.reply_error(option, REP_ERR_TOO_BIG, &msg);
                    continue;
                }
                _ => {}
            }
            let total = self.message_len();
            let n = (total - self.buf.len()).min(input.len() - used);
            self.buf.extend_from_slice(&input[used..used + n]);
            used += n;
            if self.buf.len() < total {
                return Ok(used);
            }
            let msg = std::mem::take(&mut self.buf);
            if let Err(e) = self.step(&msg) {
                tracing::debug!(target: TARGET, error = %e, "handshake failed");
                self.state = State::Failed;
                return Err(e);
            }
        }
    }

    fn message_len(&self) -> usize {
        match &self.state {
            State::ClientFlags => 4,
            State::OptionHeader => OPTION_HEADER_LEN,
            State::OptionData { len, .. } => *len as usize,
            _ => 0,
        }
    }

    fn step(&mut self, msg: &[u8]) -> Result<(), HandshakeError> {
        match self.state {
            State::ClientFlags => {
                let flags =
                    parse_client_flags(msg).map_err(|source| HandshakeError::Header { source })?;
                if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                    return Err(HandshakeError::BadClientFlags { flags });
                }
                self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                tracing::trace!(target: TARGET, flags, "client flags");
                self.state = State::OptionHeader;
                Ok(())
            }
            State::OptionHeader => {
                let h =
                    parse_option_header(msg).map_err(|source| HandshakeError::Header { source })?;
                self.options += 1;
                if self.options > MAX_OPTIONS {
                    return Err(HandshakeError::TooManyOptions { max: MAX_OPTIONS });
                }
                tracing::trace!(target: TARGET, option = h.option, len = h.len, "option");
                self.state = if h.len > MAX_OPTION_LEN {
                    if h.option == OPT_EXPORT_NAME {
                        return Err(HandshakeError::ExportNameInvalid {
                            reason: "name longer than the option cap",
                        });
                    }
                    State::Discard { option: h.option, len: h.len, left: h.len as u64 }
                } else {
                    State::OptionData { option: h.option, len: h.len }
                };
                Ok(())
            }
            State::OptionData { option, .. } => {
                self.state = State::OptionHeader;
                self.option(option, msg)
            }
            _ => Err(HandshakeError::Ended),
        }
    }

    fn reply(&mut self, option: u32, reply: u32, data: &[u8]) {
        self.out.extend_from_slice(&encode_option_reply(option, reply, data.len() as u32));
        self.out.extend_from_slice(data);
    }

    fn reply_error(&mut self, option: u32, reply: u32, message: &str) {
        tracing::debug!(target: TARGET, option, reply = format_args!("{reply:#x}"), message, "option refused");
        let mut end = message.len().min(MAX_STRING_LEN);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        self.reply(option, reply, &message.as_bytes()[..end]);
    }

    fn option(&mut self, option: u32, data: &[u8]) -> Result<(), HandshakeError> {
        match option {
            OPT_EXPORT_NAME => self.export_name(data),
            OPT_ABORT => {
                self.reply(option, REP_ACK, &[]);
                self.state = State::Aborted;
                Ok(())
            }
            OPT_LIST => {
                if !data.is_empty() {
                    self.reply_error(option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data");
                    return Ok(());
                }
                for e in self.exports.list() {
                    let mut d = Vec::with_capacity(4 + e.name.len());
                    d.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
                    d.extend_from_slice(e.name.as_bytes());
                    if let Some(desc) = &e.description {
                        d.extend_from_slice(desc.as_bytes());
                    }
                    self.reply(option, REP_SERVER, &d);
                }
                self.reply(option, REP_ACK, &[]);
                Ok(())
            }
            OPT_STARTTLS => {
                self.reply_error(
                    option,
                    REP_ERR_UNSUP,
                    "TLS is not supported by this server; connect without TLS",
                );
                Ok(())
            }
            OPT_INFO | OPT_GO => {
                self.info_or_go(option, data);
                Ok(())
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.reply_error(
                        option,
                        REP_ERR_INVALID,
                        "NBD_OPT_STRUCTURED_REPLY takes no data",
                    );
                } else {
                    self.structured = true;
                    self.reply(option, REP_ACK, &[]);
                }
                Ok(())
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta_context(option, data);
                Ok(())
            }
            _ => {
                self.reply_error(
                    option,
                    REP_ERR_UNSUP,
                    &format!("Option {option} is not supported"),
                );
                Ok(())
            }
        }
    }

    fn export_name(&mut self, data: &[u8]) -> Result<(), HandshakeError> {
        if data.len() > MAX_STRING_LEN {
            return Err(HandshakeError::ExportNameInvalid { reason: "longer than 4096 bytes" });
        }
        let name = String::from_utf8(data.to_vec())
            .map_err(|_| HandshakeError::ExportNameInvalid { reason: "not UTF-8" })?;
        let export = self
            .exports
            .open(&name)
            .map_err(|source| HandshakeError::ExportNameRefused { name: name.clone(), source })?;
        let n = self.negotiate(name, export);
        self.out.extend_from_slice(&encode_export_name_reply(n.size, n.tflags, self.no_zeroes));
        tracing::debug!(target: TARGET, export = %n.name, size = n.size, "export selected with NBD_OPT_EXPORT_NAME");
        self.state = State::Transmission(Box::new(n));
        Ok(())
    }

    fn negotiate(&self, name: String, export: Arc<dyn Export>) -> Negotiated {
        let size = export.size();
        let tflags = transmission_flags(export.as_ref(), self.structured);
        let block_size = sanitize_block_size(export.block_size(), size);
        let base_allocation = match &self.meta {
            Some(m) if m.base_allocation && m.export == name && self.structured => {
                Some(BASE_ALLOCATION_ID)
            }
            _ => None,
        };
        Negotiated {
            name,
            export,
            size,
            tflags,
            structured: self.structured,
            base_allocation,
            block_size,
        }
    }

    fn info_or_go(&mut self, option: u32, data: &[u8]) {
        let req = match parse_info_request(data) {
            Ok(r) => r,
            Err(why) => {
                self.reply_error(
                    option,
                    REP_ERR_INVALID,
                    &format!("Malformed NBD_OPT_INFO/GO: {why}"),
                );
                return;
            }
        };
        let export = match self.exports.open(&req.name) {
            Ok(e) => e,
            Err(e) => {
                let rep = match e {
                    OpenError::Denied { .. } => REP_ERR_POLICY,
                    _ => REP_ERR_UNKNOWN,
                };
                self.reply_error(option, rep, &e.to_string());
                return;
            }
        };
        let n = self.negotiate(req.name.clone(), export);
        self.reply(option, REP_INFO, &encode_info_export(n.size, n.tflags));
        let bs = n.block_size;
        self.reply(option, REP_INFO, &encode_info_block_size(bs.min, bs.preferred, bs.max));
        if req.infos.contains(&INFO_NAME) {
            let mut d = INFO_NAME.to_be_bytes().to_vec();
            d.extend_from_slice(req.name.as_bytes());
            self.reply(option, REP_INFO, &d);
        }
        if req.infos.contains(&INFO_DESCRIPTION) {
            if let Some(desc) = n.export.description() {
                let mut d = INFO_DESCRIPTION.to_be_bytes().to_vec();
                let mut end = desc.len().min(MAX_STRING_LEN);
                while !desc.is_char_boundary(end) {
                    end -= 1;
                }
                d.extend_from_slice(&desc.as_bytes()[..end]);
                self.reply(option, REP_INFO, &d);
            }
        }
        if option == OPT_GO && bs.min > 1 && !req.infos.contains(&INFO_BLOCK_SIZE) {
            let msg = format!(
                "Export needs {}-byte aligned requests; request NBD_INFO_BLOCK_SIZE",
                bs.min
            );
            self.reply_error(option, REP_ERR_BLOCK_SIZE_REQD, &msg);
            return;
        }
        self.reply(option, REP_ACK, &[]);
        if option == OPT_GO {
            tracing::debug!(target: TARGET, export = %n.name, size = n.size, tflags = n.tflags,
                structured = n.structured, base_allocation = n.base_allocation.is_some(), "export selected with NBD_OPT_GO");
            self.state = State::Transmission(Box::new(n));
        }
    }

    fn meta_context(&mut self, option: u32, data: &[u8]) {
        let set = option == OPT_SET_META_CONTEXT;
        if set {
            self.meta = None;
        }
        if set && !self.structured {
            self.reply_error(
                option,
                REP_ERR_INVALID,
                "Negotiate NBD_OPT_STRUCTURED_REPLY before NBD_OPT_SET_META_CONTEXT",
            );
            return;
        }
        let req = match parse_meta_request(data) {
            Ok(r) => r,
            Err(why) => {
                self.reply_error(
                    option,
                    REP_ERR_INVALID,
                    &format!("Malformed meta context option: {why}"),
                );
                return;
            }
        };
        if let Err(e) = self.exports.open(&req.name) {
            self.reply_error(option, REP_ERR_UNKNOWN, &e.to_string());
            return;
        }
        let matches = if set {
            req.queries.iter().any(|q| q == CONTEXT_BASE_ALLOCATION)
        } else {
            req.queries.is_empty()
                || req.queries.iter().any(|q| q == "base:" || q == CONTEXT_BASE_ALLOCATION)
        };
        if matches {
            let id = if set { BASE_ALLOCATION_ID } else { 0 };
            let mut d = id.to_be_bytes().to_vec();
            d.extend_from_slice(CONTEXT_BASE_ALLOCATION.as_bytes());
            self.reply(option, REP_META_CONTEXT, &d);
        }
        if set {
            self.meta = Some(MetaSelection { export: req.name, base_allocation: matches });
        }
        self.reply(option, REP_ACK, &[]);
    }
}

/// I/O failure while driving a handshake over a stream.
#[derive(Debug, thiserror::Error)]
pub enum NegotiateError {
    #[error("Socket error during the handshake ({op})")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("Handshake failed")]
    Protocol {
        #[source]
        source: HandshakeError,
    },
}

/// Drive a handshake over a blocking stream. `Ok(None)` means the client aborted or hung up
/// during negotiation (not an error for the server).
pub fn negotiate<S: Read + Write>(
    stream: &mut S,
    exports: Arc<dyn ExportSet>,
) -> Result<Option<Negotiated>, NegotiateError> {
    let mut hs = Handshake::new(exports);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let out = hs.take_output();
        if !out.is_empty() {
            stream.write_all(&out).map_err(|source| NegotiateError::Io { op: "write", source })?;
        }
        match hs.phase() {
            Phase::Transmission => return Ok(hs.into_negotiated()),
            Phase::Aborted => return Ok(None),
            // receive() reports a failure as Err, handled below, before Failed is observable.
            Phase::Failed => {
                return Err(NegotiateError::Protocol { source: HandshakeError::Ended })
            }
            Phase::Negotiating => {}
        }
        let want = hs.wanted().min(buf.len());
        match stream.read_exact(&mut buf[..want]) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(source) => return Err(NegotiateError::Io { op: "read", source }),
        }
        if let Err(source) = hs.receive(&buf[..want]) {
            let out = hs.take_output();
            let _ = stream.write_all(&out);
            return Err(NegotiateError::Protocol { source });
        }
    }
}

#[cfg(test)]
#[path = "handshake_tests.rs"]
mod tests;
