//! A small blocking NBD client: fixed-newstyle handshake with `NBD_OPT_GO`, simple replies,
//! pipelined reads. It exists so benchmarks and tests can drive any NBD server (strata's or
//! qemu-nbd, over a Unix socket or TCP) with a recorded block trace, without a guest.
//!
//! Deliberately narrow: no structured replies (so a read's reply is the 16-byte header plus
//! exactly `len` bytes, and errors arrive as an errno), no TLS, no metadata contexts. Requests
//! are pipelined by the caller: `send_read` as many as it wants in flight, then `recv` the
//! replies in whatever order the server sends them (matched by handle). Everything a server
//! sends is checked (magics, lengths, handles) and a violation is a `Protocol` error, never a
//! panic.

use super::proto::{
    parse_option_reply, parse_reply_header, BadReplyMagic, Command, OptionHeader, ProtoError,
    ReplyHeader, Request, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES, FLAG_FIXED_NEWSTYLE,
    FLAG_NO_ZEROES, IHAVEOPT, INFO_EXPORT, NBD_MAGIC, OPTION_REPLY_HEADER_LEN, OPT_GO, REP_ACK,
    REP_INFO, SIMPLE_REPLY_LEN,
};
use crate::endian;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Unix(p) => write!(f, "unix:{}", p.display()),
            Target::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("Cannot connect to the NBD server at {target}: check that it is running")]
    Connect {
        target: String,
        #[source]
        source: io::Error,
    },
    #[error("NBD connection failed during {op}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("NBD server refused export '{export}' (reply {reply:#x}: {message}); list exports with `nbdinfo --list`")]
    Refused { export: String, reply: u32, message: String },
    #[error("NBD server broke the protocol: {0}")]
    Protocol(#[from] Violation),
    #[error("NBD read of {len} bytes at offset {offset} failed with error {errno}")]
    ReadFailed { offset: u64, len: u32, errno: u32 },
}

/// How a server (or the caller) broke the protocol.
#[derive(Debug, thiserror::Error)]
pub enum Violation {
    #[error("Not a fixed-newstyle NBD server (bad greeting magic)")]
    GreetingMagic,
    #[error("Server does not speak fixed newstyle")]
    NotFixedNewstyle,
    #[error("Bad option reply")]
    OptionReply(#[source] ProtoError),
    #[error("Unexpected option reply {0}")]
    UnexpectedOptionReply(String),
    #[error("Unknown option reply type {0:#x}")]
    UnknownOptionReply(u32),
    #[error("Structured reply without negotiation")]
    UnnegotiatedStructuredReply,
    #[error("Bad reply")]
    ReplyMagic(#[source] BadReplyMagic),
    #[error("Reply for unknown handle {0}")]
    UnknownHandle(u64),
    #[error("read() with requests in flight; use send_read/recv")]
    ReadWhileInFlight,
    #[error("Replay client thread panicked")]
    ThreadPanicked,
}

type Result<T> = std::result::Result<T, ClientError>;

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> ClientError {
    move |source| ClientError::Io { op, source }
}

/// One connection to one export.
pub struct Client {
    r: Box<dyn Read + Send>,
    w: Box<dyn Write + Send>,
    size: u64,
    tflags: u16,
    next: u64,
    /// Outstanding reads: handle -> (offset, length).
    pending: HashMap<u64, (u64, u32)>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("size", &self.size)
            .field("pending", &self.pending.len())
            .finish()
    }
}

/// Longest option reply payload accepted during the handshake.
const MAX_OPTION_REPLY: u32 = 64 << 10;

impl Client {
    /// Connect and select `export` with `NBD_OPT_GO`.
    pub fn connect(target: &Target, export: &str) -> Result<Client> {
        let timeout = Some(Duration::from_secs(120));
        let (r, w): (Box<dyn Read + Send>, Box<dyn Write + Send>) = match target {
            Target::Unix(p) => {
                let s = UnixStream::connect(p).map_err(|source| ClientError::Connect {
                    target: target.to_string(),
                    source,
                })?;
                s.set_read_timeout(timeout).map_err(io_err("setup"))?;
                (Box::new(s.try_clone().map_err(io_err("setup"))?), Box::new(s))
            }
            Target::Tcp(a) => {
                let s =
                    TcpStream::connect_timeout(a, Duration::from_secs(10)).map_err(|source| {
                        ClientError::Connect { target: target.to_string(), source }
                    })?;
                s.set_nodelay(true).map_err(io_err("setup"))?;
                s.set_read_timeout(timeout).map_err(io_err("setup"))?;
                (Box::new(s.try_clone().map_err(io_err("setup"))?), Box::new(s))
            }
        };
        let mut c = Client { r, w, size: 0, tflags: 0, next: 1, pending: HashMap::new() };
        c.handshake(export)?;
        Ok(c)
    }

    fn handshake(&mut self, export: &str) -> Result<()> {
        let mut g = [0u8; 18];
        self.r.read_exact(&mut g).map_err(io_err("greeting"))?;
        if endian::be64(&g, 0) != NBD_MAGIC || endian::be64(&g, 8) != IHAVEOPT {
            return Err(Violation::GreetingMagic.into());
        }
        let hflags = endian::be16(&g, 16);
        if hflags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(Violation::NotFixedNewstyle.into());
        }
        let mut cflags = FLAG_C_FIXED_NEWSTYLE;
        if hflags & FLAG_NO_ZEROES != 0 {
            cflags |= FLAG_C_NO_ZEROES;
        }
        self.w.write_all(&cflags.to_be_bytes()).map_err(io_err("handshake"))?;
        // NBD_OPT_GO: name length, name, zero information requests.
        let mut data = (export.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        let mut m = OptionHeader { option: OPT_GO, len: data.len() as u32 }.to_bytes().to_vec();
        m.extend_from_slice(&data);
        self.w.write_all(&m).map_err(io_err("handshake"))?;
        loop {
            let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
            self.r.read_exact(&mut h).map_err(io_err("handshake"))?;
            let rep = parse_option_reply(&h).map_err(Violation::OptionReply)?;
            if rep.option != OPT_GO || rep.len > MAX_OPTION_REPLY {
                return Err(Violation::UnexpectedOptionReply(format!("{rep:?}")).into());
            }
            let mut d = vec![0u8; rep.len as usize];
            self.r.read_exact(&mut d).map_err(io_err("handshake"))?;
            match rep.reply {
                REP_ACK => break,
                REP_INFO if d.len() >= 12 && endian::be16(&d, 0) == INFO_EXPORT => {
                    self.size = endian::be64(&d, 2);
                    self.tflags = endian::be16(&d, 10);
                }
                REP_INFO => {}
                r if r & 0x8000_0000 != 0 => {
                    return Err(ClientError::Refused {
                        export: export.into(),
                        reply: r,
                        message: String::from_utf8_lossy(&d).into_owned(),
                    })
                }
                r => return Err(Violation::UnknownOptionReply(r).into()),
            }
        }
        Ok(())
    }

    /// Size of the export in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Transmission flags the server announced.
    pub fn flags(&self) -> u16 {
        self.tflags
    }

    /// Requests sent whose replies have not been received.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Send a read request without waiting; returns its handle.
    pub fn send_read(&mut self, offset: u64, len: u32) -> Result<u64> {
        let handle = self.next;
        self.next += 1;
        let r = Request { flags: 0, command: Command::Read, handle, offset, len };
        self.w.write_all(&r.to_bytes()).map_err(io_err("send"))?;
        self.pending.insert(handle, (offset, len));
        Ok(handle)
    }

    /// Receive the next reply to an outstanding read into `buf` (resized to the read's length).
    /// Returns the handle; a server error is `ReadFailed`.
    pub fn recv(&mut self, buf: &mut Vec<u8>) -> Result<u64> {
        let mut h = [0u8; SIMPLE_REPLY_LEN];
        self.r.read_exact(&mut h).map_err(io_err("receive"))?;
        let rep = match parse_reply_header(&h) {
            Ok(Some(ReplyHeader::Simple(s))) => s,
            Ok(_) => return Err(Violation::UnnegotiatedStructuredReply.into()),
            Err(e) => return Err(Violation::ReplyMagic(e).into()),
        };
        let (offset, len) =
            self.pending.remove(&rep.handle).ok_or(Violation::UnknownHandle(rep.handle))?;
        if rep.error != 0 {
            return Err(ClientError::ReadFailed { offset, len, errno: rep.error });
        }
        buf.resize(len as usize, 0);
        self.r.read_exact(buf).map_err(io_err("receive"))?;
        Ok(rep.handle)
    }

    /// Read `buf.len()` bytes at `offset` (one request, waiting for its reply).
    pub fn read(&mut self, offset: u64, buf: &mut Vec<u8>) -> Result<()> {
        if !self.pending.is_empty() {
            return Err(Violation::ReadWhileInFlight.into());
        }
        self.send_read(offset, buf.len() as u32)?;
        self.recv(buf).map(|_| ())
    }

    /// Tell the server we are done (`NBD_CMD_DISC`) and close.
    pub fn disconnect(mut self) -> Result<()> {
        let r = Request { flags: 0, command: Command::Disc, handle: self.next, offset: 0, len: 0 };
        self.w.write_all(&r.to_bytes()).map_err(io_err("disconnect"))?;
        self.w.flush().map_err(io_err("disconnect"))
    }
}
