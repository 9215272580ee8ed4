//! The small persisted objects: the store config, refs (named roots), and tree chunks.
//!
//! - `config` is written once by `init` and names the store format version; opening a
//!   directory without it is "not a strata store", and a newer version is refused.
//! - A ref (`refs/<name>`) is the only mutable object: it names root chunks plus an opaque
//!   payload (JSON metadata of the disk or checkpoint). It is written last, after everything it
//!   reaches is durable, so a ref never points at missing data.
//! - A tree chunk is an ordinary chunk (content-addressed, deduplicated) whose bytes list child
//!   ids; the all-zero id is a hole. GC and `check` follow trees; everything else is data.

use super::format::{cap, crc, zero, FResult, FormatError, Rd, Wr, FORMAT_VERSION};
use crate::endian;
use crate::id::ChunkId;

pub(crate) const CONFIG_MAGIC: &[u8; 8] = b"STRACONF";
pub(crate) const REF_MAGIC: &[u8; 8] = b"STRAREF\0";
pub(crate) const TREE_MAGIC: &[u8; 4] = b"STRT";
pub(crate) const MAX_REF_ROOTS: u64 = 65_536;
pub(crate) const MAX_REF_PAYLOAD: u64 = 1 << 20;
pub(crate) const MAX_TREE_CHILDREN: u64 = 1 << 18;
pub(crate) const MAX_CONFIG_JSON: u64 = 64 << 10;
pub(crate) const MAX_REF_NAME: usize = 255;

/// Store-wide settings, persisted as the `config` object.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoreConfig {
    pub store_id: [u8; 16],
    pub version: u16,
    pub settings: StoreSettings,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoreSettings {
    /// Pack size writers aim for.
    pub pack_size: u64,
    /// Default codec name for writers that don't choose (`none`, `lz4`, `zstd:N`).
    pub default_codec: String,
    pub created_by: String,
    pub created_unix: u64,
}

impl StoreConfig {
    pub fn encode(&self) -> Vec<u8> {
        let json = serde_json::to_vec(&self.settings).expect("settings serialize");
        let mut out = Vec::new();
        out.extend_from_slice(CONFIG_MAGIC);
        out.u16le(self.version);
        out.u16le(0);
        out.u32le(json.len() as u32);
        out.extend_from_slice(&self.store_id);
        out.extend_from_slice(&json);
        let c = crc(&out);
        out.u32le(c);
        out
    }

    pub fn decode(b: &[u8]) -> FResult<StoreConfig> {
        let what = "store config";
        let mut rd = Rd::new(b, what);
        let version = rd.magic_version(CONFIG_MAGIC)?;
        zero(what, "flags", rd.u16()? as u64)?;
        let len = rd.u32()? as u64;
        cap(what, "json_len", len, MAX_CONFIG_JSON)?;
        let store_id = rd.arr()?;
        let json = rd.bytes(len as usize)?;
        let body_end = rd.pos();
        let c = rd.u32()?;
        if crc(&b[..body_end]) != c || rd.pos() != b.len() {
            return Err(FormatError::Checksum { what });
        }
        let settings = serde_json::from_slice(json)
            .map_err(|e| FormatError::Malformed { what, detail: e.to_string() })?;
        Ok(StoreConfig { store_id, version, settings })
    }
}

/// A named, mutable pointer to root chunks plus metadata.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Ref {
    pub roots: Vec<ChunkId>,
    pub payload: Vec<u8>,
    /// Incremented on every update; lets readers notice changes.
    pub generation: u64,
}

impl Ref {
    pub fn new(roots: Vec<ChunkId>, payload: Vec<u8>) -> Ref {
        Ref { roots, payload, generation: 0 }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(36 + 32 * self.roots.len() + self.payload.len());
        out.extend_from_slice(REF_MAGIC);
        out.u16le(FORMAT_VERSION);
        out.u16le(0);
        out.u32le(self.roots.len() as u32);
        out.u32le(self.payload.len() as u32);
        out.u64le(self.generation);
        out.u32le(0);
        for r in &self.roots {
            out.extend_from_slice(&r.0);
        }
        out.extend_from_slice(&self.payload);
        let c = crc(&out);
        out.u32le(c);
        out
    }

    pub fn decode(b: &[u8]) -> FResult<Ref> {
        let what = "ref";
        let mut rd = Rd::new(b, what);
        rd.magic_version(REF_MAGIC)?;
        zero(what, "flags", rd.u16()? as u64)?;
        let nroots = rd.u32()? as u64;
        let plen = rd.u32()? as u64;
        cap(what, "roots", nroots, MAX_REF_ROOTS)?;
        cap(what, "payload_len", plen, MAX_REF_PAYLOAD)?;
        let generation = rd.u64()?;
        zero(what, "reserved", rd.u32()? as u64)?;
        let mut roots = Vec::with_capacity(nroots as usize);
        for _ in 0..nroots {
            roots.push(ChunkId(rd.arr()?));
        }
        let payload = rd.bytes(plen as usize)?.to_vec();
        let body_end = rd.pos();
        let c = rd.u32()?;
        if crc(&b[..body_end]) != c {
            return Err(FormatError::Checksum { what });
        }
        if rd.pos() != b.len() {
            return Err(FormatError::Malformed { what, detail: "trailing bytes".into() });
        }
        Ok(Ref { roots, payload, generation })
    }
}

/// Ref names: 1–255 bytes of `[A-Za-z0-9._@=+-]` in `/`-separated segments.
pub fn valid_ref_name(name: &str) -> bool {
    name.len() <= MAX_REF_NAME && crate::backend::validate_key(name).is_ok()
}

/// A tree chunk: child ids (zero id = hole) plus an opaque payload.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Tree {
    pub children: Vec<ChunkId>,
    pub payload: Vec<u8>,
}

impl Tree {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 32 * self.children.len() + self.payload.len());
        out.extend_from_slice(TREE_MAGIC);
        out.u16le(FORMAT_VERSION);
        out.u16le(0);
        out.u32le(self.children.len() as u32);
        out.u32le(self.payload.len() as u32);
        for c in &self.children {
            out.extend_from_slice(&c.0);
        }
        out.extend_from_slice(&self.payload);
        out
    }

    pub fn decode(b: &[u8]) -> FResult<Tree> {
        let what = "tree chunk";
        let mut rd = Rd::new(b, what);
        if rd.bytes(4)? != TREE_MAGIC {
            return Err(FormatError::BadMagic { what, expected: "STRT" });
        }
        let v = rd.u16()?;
        if v > FORMAT_VERSION || v == 0 {
            return Err(FormatError::TooNew { what, found: v, supported: FORMAT_VERSION });
        }
        zero(what, "flags", rd.u16()? as u64)?;
        let n = rd.u32()? as u64;
        let plen = rd.u32()? as u64;
        cap(what, "children", n, MAX_TREE_CHILDREN)?;
        cap(what, "payload_len", plen, crate::codec::MAX_FRAME_RAW as u64)?;
        let ids = rd.bytes(n as usize * 32)?;
        let children = ids.chunks_exact(32).map(|c| ChunkId(endian::array(c, 0))).collect();
        let payload = rd.bytes(plen as usize)?.to_vec();
        if rd.pos() != b.len() {
            return Err(FormatError::Malformed { what, detail: "trailing bytes".into() });
        }
        Ok(Tree { children, payload })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ref_layout_is_pinned() {
        let r = Ref { roots: vec![ChunkId([9; 32])], payload: b"{}".to_vec(), generation: 5 };
        let b = r.encode();
        assert_eq!(&b[0..8], b"STRAREF\0");
        assert_eq!(endian::le16(&b, 8), 1);
        assert_eq!(endian::le32(&b, 12), 1, "root count at 12");
        assert_eq!(endian::le32(&b, 16), 2, "payload len at 16");
        assert_eq!(endian::le64(&b, 20), 5, "generation at 20");
        assert_eq!(&b[32..64], &[9u8; 32], "roots start at 32");
        assert_eq!(&b[64..66], b"{}");
        assert_eq!(b.len(), 70);
        assert_eq!(Ref::decode(&b).unwrap(), r);
        let mut bad = b.clone();
        bad[40] ^= 1;
        assert_eq!(Ref::decode(&bad).unwrap_err(), FormatError::Checksum { what: "ref" });
        for cut in 0..b.len() {
            assert!(Ref::decode(&b[..cut]).is_err());
        }
    }

    #[test]
    fn tree_and_config_layouts_are_pinned() {
        let t = Tree { children: vec![ChunkId::ZERO, ChunkId([1; 32])], payload: vec![4, 5] };
        let b = t.encode();
        assert_eq!(&b[0..4], b"STRT");
        assert_eq!(endian::le32(&b, 8), 2);
        assert_eq!(endian::le32(&b, 12), 2);
        assert_eq!(&b[48..80], &[1u8; 32]);
        assert_eq!(Tree::decode(&b).unwrap(), t);

        let c = StoreConfig {
            store_id: [3; 16],
            version: 1,
            settings: StoreSettings {
                pack_size: 1 << 20,
                default_codec: "lz4".into(),
                created_by: "test".into(),
                created_unix: 1,
            },
        };
        let b = c.encode();
        assert_eq!(&b[0..8], b"STRACONF");
        assert_eq!(&b[16..32], &[3u8; 16], "store id at 16");
        assert_eq!(StoreConfig::decode(&b).unwrap(), c);
        let mut newer = b.clone();
        newer[8] = 2;
        assert!(matches!(StoreConfig::decode(&newer), Err(FormatError::TooNew { found: 2, .. })));
    }

    #[test]
    fn caps_are_checked_before_allocation() {
        let mut b = Ref::default().encode();
        b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Ref::decode(&b), Err(FormatError::Cap { .. })));
        let mut t = Tree::default().encode();
        t[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Tree::decode(&t), Err(FormatError::Cap { .. })));
    }

    #[test]
    fn ref_names() {
        assert!(valid_ref_name("disk/golden"));
        assert!(valid_ref_name("vm/desk-01@ckpt.3"));
        assert!(!valid_ref_name("../x"));
        assert!(!valid_ref_name(&"a".repeat(300)));
    }
}
