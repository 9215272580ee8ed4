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

use std::io::{Read, Write};
use std::sync::Arc;

use super::export::{BlockSize, Export, ExportSet, OpenError};
use super::proto::*;

/// Largest option payload buffered; longer ones are discarded and refused.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Options accepted on one connection before the server hangs up (denial-of-service guard).
pub const MAX_OPTIONS: u32 = 4096;
/// Largest READ/WRITE payload the server accepts (2^25, the spec's portable limit).
pub const MAX_REQUEST_LEN: u32 = 32 << 20;
/// Context id this server assigns to `base:allocation`.
pub const BASE_ALLOCATION_ID: u32 = 1;

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

fn take_string(b: &[u8], at: usize, len: usize) -> Result<String, &'static str> {
    if len > MAX_STRING_LEN {
        return Err("string longer than 4096 bytes");
    }
    let end = at.checked_add(len).ok_or("length overflows")?;
    let s = b.get(at..end).ok_or("string runs past the option data")?;
    if s.contains(&0) {
        return Err("string contains NUL");
    }
    String::from_utf8(s.to_vec()).map_err(|_| "string is not UTF-8")
}

fn take_u32(b: &[u8], at: usize) -> Result<u32, &'static str> {
    let s = b.get(at..at + 4).ok_or("option data too short")?;
    Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

/// Parse `NBD_OPT_INFO`/`NBD_OPT_GO` data: name length, name, count, info types.
pub fn parse_info_request(data: &[u8]) -> Result<InfoRequest, &'static str> {
    let name_len = take_u32(data, 0)? as usize;
    let name = take_string(data, 4, name_len)?;
    let at = 4 + name_len;
    let count = data.get(at..at + 2).ok_or("missing information request count")?;
    let count = u16::from_be_bytes([count[0], count[1]]) as usize;
    let list = &data[at + 2..];
    if list.len() != count * 2 {
        return Err("information request count does not match the option length");
    }
    let infos = list.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect();
    Ok(InfoRequest { name, infos })
}

/// Parse meta-context option data: name length, name, query count, (length, query)*.
pub fn parse_meta_request(data: &[u8]) -> Result<MetaRequest, &'static str> {
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
        return Err("trailing bytes after the last query");
    }
    Ok(MetaRequest { name, queries })
}

/// Clamp an export's block size answer into values the spec allows.
pub fn sanitize_block_size(b: BlockSize, size: u64) -> BlockSize {
    let min = if b.min.is_power_of_two() && b.min <= 65536 { b.min } else { 1 };
    let floor = min.max(512);
    let preferred = if b.preferred.is_power_of_two() && b.preferred >= floor { b.preferred } else { floor.max(4096) };
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
                    return if used == 0 && !input.is_empty() { Err(HandshakeError::Ended) } else { Ok(used) };
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
                    let msg = format!("Option data of {len} bytes exceeds the {MAX_OPTION_LEN}-byte cap");
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
                let flags = parse_client_flags(msg).map_err(|source| HandshakeError::Header { source })?;
                if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                    return Err(HandshakeError::BadClientFlags { flags });
                }
                self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                tracing::trace!(target: TARGET, flags, "client flags");
                self.state = State::OptionHeader;
                Ok(())
            }
            State::OptionHeader => {
                let h = parse_option_header(msg).map_err(|source| HandshakeError::Header { source })?;
                self.options += 1;
                if self.options > MAX_OPTIONS {
                    return Err(HandshakeError::TooManyOptions { max: MAX_OPTIONS });
                }
                tracing::trace!(target: TARGET, option = h.option, len = h.len, "option");
                self.state = if h.len > MAX_OPTION_LEN {
                    if h.option == OPT_EXPORT_NAME {
                        return Err(HandshakeError::ExportNameInvalid { reason: "name longer than the option cap" });
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
                self.reply_error(option, REP_ERR_UNSUP, "TLS is not supported by this server; connect without TLS");
                Ok(())
            }
            OPT_INFO | OPT_GO => {
                self.info_or_go(option, data);
                Ok(())
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.reply_error(option, REP_ERR_INVALID, "NBD_OPT_STRUCTURED_REPLY takes no data");
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
                self.reply_error(option, REP_ERR_UNSUP, &format!("Option {option} is not supported"));
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
            Some(m) if m.base_allocation && m.export == name && self.structured => Some(BASE_ALLOCATION_ID),
            _ => None,
        };
        Negotiated { name, export, size, tflags, structured: self.structured, base_allocation, block_size }
    }

    fn info_or_go(&mut self, option: u32, data: &[u8]) {
        let req = match parse_info_request(data) {
            Ok(r) => r,
            Err(why) => {
                self.reply_error(option, REP_ERR_INVALID, &format!("Malformed NBD_OPT_INFO/GO: {why}"));
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
            let msg = format!("Export needs {}-byte aligned requests; request NBD_INFO_BLOCK_SIZE", bs.min);
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
            self.reply_error(option, REP_ERR_INVALID, "Negotiate NBD_OPT_STRUCTURED_REPLY before NBD_OPT_SET_META_CONTEXT");
            return;
        }
        let req = match parse_meta_request(data) {
            Ok(r) => r,
            Err(why) => {
                self.reply_error(option, REP_ERR_INVALID, &format!("Malformed meta context option: {why}"));
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
            req.queries.is_empty() || req.queries.iter().any(|q| q == "base:" || q == CONTEXT_BASE_ALLOCATION)
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
pub fn negotiate<S: Read + Write>(stream: &mut S, exports: Arc<dyn ExportSet>) -> Result<Option<Negotiated>, NegotiateError> {
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
            Phase::Failed => return Err(NegotiateError::Protocol { source: HandshakeError::Ended }),
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
mod tests {
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
            vec![ExportInfo { name: "a".into(), description: None }, ExportInfo { name: "ro".into(), description: Some("x".into()) }]
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
        h.receive(&opt(OPT_SET_META_CONTEXT, &meta_data("a", &["base:allocation", "qemu:dirty-bitmap:x"]))).unwrap();
        let r = replies(&h.take_output());
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].1, REP_META_CONTEXT);
        assert_eq!(&r[0].2[..4], &BASE_ALLOCATION_ID.to_be_bytes());
        assert_eq!(&r[0].2[4..], b"base:allocation");
        assert_eq!(r[1].1, REP_ACK);
        h.receive(&opt(OPT_GO, &info_data("a", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]))).unwrap();
        let r = replies(&h.take_output());
        let kinds: Vec<u16> = r.iter().filter(|x| x.1 == REP_INFO).map(|x| u16::from_be_bytes([x.2[0], x.2[1]])).collect();
        assert_eq!(kinds, vec![INFO_EXPORT, INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]);
        let tflags = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_TRIM
            | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO | TFLAG_SEND_DF;
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
        let ro_flags = u16::from_be_bytes([r[0].2[10], r[0].2[11]]);
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
        assert!(matches!(h.receive(&opt(OPT_EXPORT_NAME, b"zz")), Err(HandshakeError::ExportNameRefused { .. })));
        assert_eq!(h.phase(), Phase::Failed);
        assert!(h.take_output().is_empty());
    }

    #[test]
    fn abort_unknown_and_starttls() {
        let mut h = started(1);
        h.receive(&opt(OPT_STARTTLS, &[])).unwrap();
        assert_eq!(replies(&h.take_output())[0].1, REP_ERR_UNSUP);
        h.receive(&opt(4242, &[1, 2, 3])).unwrap();
        assert_eq!(replies(&h.take_output())[0], (4242, REP_ERR_UNSUP, b"Option 4242 is not supported".to_vec()));
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
        assert!(parse_info_request(&[]).is_err());
        assert!(parse_info_request(&[0xff, 0xff, 0xff, 0xff, 0, 0]).is_err());
        assert!(parse_meta_request(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(parse_meta_request(&[0, 0, 0, 1, 0, 0, 0, 0, 0]).is_err()); // NUL name
        assert_eq!(parse_meta_request(&[0, 0, 0, 0, 0, 0, 0, 0]).unwrap(), MetaRequest { name: String::new(), queries: vec![] });
    }
}
