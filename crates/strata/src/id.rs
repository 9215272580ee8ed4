//! Chunk identity: a chunk is named by the BLAKE3-256 hash of its *uncompressed* bytes.
//!
//! Naming by content is what makes the store deduplicating (the same page or block written by
//! any disk or VM lands on the same id) and self-verifying (every read re-hashes and compares).
//! The all-zero id is reserved to mean "hole / zero-filled" in trees and is never a real chunk.

use std::fmt;

/// A 32-byte BLAKE3 digest naming a chunk.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ChunkId(pub [u8; 32]);

/// Hash maps key on the id's first 8 bytes, not all 32: they are already uniformly
/// distributed, and the map's hasher is still keyed (SipHash with a random key), so crafted
/// pages cannot aim at one bucket. Hashing 8 bytes instead of 32 plus a length makes every
/// index lookup cheaper (a restore makes one per page, a save one per new page).
impl std::hash::Hash for ChunkId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes")));
    }
}

impl ChunkId {
    /// The reserved id that stands for "no chunk" (a hole) in tree chunks.
    pub const ZERO: ChunkId = ChunkId([0u8; 32]);

    /// Hash `data` into its id.
    pub fn of(data: &[u8]) -> ChunkId {
        ChunkId(*blake3::hash(data).as_bytes())
    }

    pub fn is_zero(&self) -> bool {
        self.0 == [0u8; 32]
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn from_slice(b: &[u8]) -> Option<ChunkId> {
        <[u8; 32]>::try_from(b).ok().map(ChunkId)
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parse a full 64-digit hex id.
    pub fn from_hex(s: &str) -> Option<ChunkId> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(ChunkId(out))
    }

    /// Short form for messages (first 12 hex digits).
    pub fn short(&self) -> String {
        hex::encode(&self.0[..6])
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", self.short())
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A pack's 128-bit random identity; its objects are `packs/XX/<32 hex>` and `index/<32 hex>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PackId(pub [u8; 16]);

impl PackId {
    pub fn random() -> PackId {
        PackId(rand::random())
    }
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
    pub fn from_hex(s: &str) -> Option<PackId> {
        let mut out = [0u8; 16];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(PackId(out))
    }
    pub fn pack_key(&self) -> String {
        let h = self.to_hex();
        format!("packs/{}/{}", &h[..2], h)
    }
    pub fn index_key(&self) -> String {
        format!("index/{}", self.to_hex())
    }
}

impl fmt::Debug for PackId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PackId({})", self.to_hex())
    }
}

impl fmt::Display for PackId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_is_blake3_of_uncompressed_bytes() {
        // Known BLAKE3 test vector: hash of the empty input.
        assert_eq!(
            ChunkId::of(b"").to_hex(),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
        let id = ChunkId::of(b"strata");
        assert_eq!(ChunkId::from_hex(&id.to_hex()), Some(id));
        assert!(ChunkId::ZERO.is_zero());
        assert!(!id.is_zero());
    }

    #[test]
    fn pack_keys_fan_out_by_first_byte() {
        let p = PackId([0xab; 16]);
        assert_eq!(p.pack_key(), format!("packs/ab/{}", "ab".repeat(16)));
        assert_eq!(p.index_key(), format!("index/{}", "ab".repeat(16)));
        assert_eq!(PackId::from_hex(&p.to_hex()), Some(p));
    }
}
