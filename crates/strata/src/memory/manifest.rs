//! The stored form of a VM memory checkpoint: one ref `vm/NAME` whose roots are trees of
//! chunks and whose payload is a versioned JSON manifest.
//!
//! ```text
//! refs/vm/NAME   roots[0]      = tail tree   (device-state tail, 64 KiB data chunks)
//!                roots[1 + i]  = page map of ramblock i (store::map two-level tree of page ids,
//!                                the zero id for a zero page; leaves may carry a slot table)
//!                payload       = Manifest (JSON, format "strata-vm-checkpoint", version 2-4)
//! ```
//!
//! Why this shape: pages are ordinary content-addressed chunks, so a page shared by two VMs,
//! two checkpoints or two places in one VM is stored once, and GC/check reach every page
//! through the roots without knowing anything about VMs. Everything a restore needs besides
//! pages and the tail (stream layout, machine type, QEMU command line) is small and lives in
//! the payload, so `vm list` reads only refs. The ref is written last (`commit_ref` flushes
//! first), which is what makes a checkpoint visible only once complete.
//!
//! [`parse_manifest`] is the pure `&[u8]` entry point for cargo-fuzz; it checks the format
//! name, version and caps before anything else trusts the manifest. `docs/format-checkpoint.md`
//! has the tables; the unit tests below pin them.

use std::collections::BTreeMap;

use crate::endian;
use crate::id::ChunkId;
use crate::memory::stream::{RamBlock, RamSectionHeader, StreamLayout, PAGE_SIZE};
use crate::store::objects::{Ref, Tree};

/// `format` field of every checkpoint manifest.
pub(crate) const FORMAT: &str = "strata-vm-checkpoint";
/// Newest manifest version this code writes and reads; readers accept 1..=VERSION. Version 2
/// added delta pages (`delta`, and page map entries that are delta records, see `delta.rs`);
/// a version-1 manifest reads as one without deltas. Version 3 added run chunks (page map
/// entries naming a data chunk of [`RUN_PAGES`] pages, below); a save that made none still
/// writes 2, so older readers keep reading it. Version 4 added slot tables: a page map leaf
/// may name, for some of its entries, which slot of a run chunk the page is ([`SlotTable`]);
/// a save whose maps have none writes 3 (or 2). Version 5 added the disks of a desktop
/// snapshot (`disks`, one extra ref root each); a snapshot without disks writes 4 or less.
pub(crate) const VERSION: u32 = 5;
/// Version a save with slot tables (and no disks) writes.
pub(crate) const VERSION_SLOTS: u32 = 4;
/// Version a desktop snapshot (memory and disks) writes.
pub(crate) const VERSION_DISKS: u32 = 5;
/// Version a save with run chunks but no slot table writes.
pub(crate) const VERSION_RUNS: u32 = 3;
/// Version a save without run chunks writes.
pub(crate) const VERSION_NO_RUNS: u32 = 2;
/// Pages of a run chunk (version 3): a data chunk of `RUN_PAGES * 4096` bytes holding an
/// aligned group of a ramblock's pages; a page map entry naming it means the page's slot,
/// its page number modulo `RUN_PAGES` (`docs/format-checkpoint.md`).
pub const RUN_PAGES: usize = 32;
/// Bytes of a run chunk.
pub(crate) const RUN_BYTES: usize = RUN_PAGES * PAGE_SIZE;

/// Bytes of one slot-table entry: le16 index in the leaf, u8 slot.
pub(crate) const SLOT_ENTRY_BYTES: usize = 3;

/// A page map leaf's slot table (version 4, the leaf tree's payload): for the entries it
/// lists, the page is slot `slot` of the run chunk the entry names, instead of slot
/// `page number mod RUN_PAGES`. Entries are `(index in the leaf, slot)`, indices strictly
/// increasing. An empty payload is an empty table (every leaf before version 4).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotTable(pub Vec<(u16, u8)>);

impl SlotTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.0.len() * SLOT_ENTRY_BYTES);
        for &(i, slot) in &self.0 {
            out.extend_from_slice(&i.to_le_bytes());
            out.push(slot);
        }
        out
    }

    /// Parse a leaf's payload; `entries` is the leaf's number of ids. Refuses a length that is
    /// not whole entries, an index outside the leaf or not above the one before, and a slot of
    /// [`RUN_PAGES`] or more.
    pub fn parse(payload: &[u8], entries: usize) -> Result<SlotTable, SlotTableError> {
        if !payload.len().is_multiple_of(SLOT_ENTRY_BYTES) {
            return Err(SlotTableError::PartialEntry { len: payload.len() });
        }
        let mut out = Vec::with_capacity(payload.len() / SLOT_ENTRY_BYTES);
        for e in payload.chunks_exact(SLOT_ENTRY_BYTES) {
            let i = endian::le16(e, 0);
            let slot = e[2];
            if i as usize >= entries {
                return Err(SlotTableError::OutsideLeaf { index: i, entries });
            }
            if out.last().is_some_and(|&(p, _)| p >= i) {
                return Err(SlotTableError::OutOfOrder { index: i });
            }
            if slot as usize >= RUN_PAGES {
                return Err(SlotTableError::BadSlot { index: i, slot });
            }
            out.push((i, slot));
        }
        Ok(SlotTable(out))
    }
}

/// Whether the store holds `id` as a run chunk (a data chunk of `RUN_BYTES`), as the index
/// tells it: a page map entry naming one is a slot of it.
pub fn is_run_chunk(store: &crate::store::Store, id: &ChunkId) -> bool {
    store.chunk_info(id).is_some_and(|(len, kind)| {
        kind == crate::store::pack::ChunkKind::Data && len as usize == RUN_BYTES
    })
}
/// Entropy (bits per byte, of a 1 KiB sample of each page) above which a save counts a page
/// as uniform, i.e. a run candidate (`memory/ingest/pool.rs`). 1 KiB of uniform random bytes
/// measures ~7.8 (a finite sample's histogram is never flat; 7.73-7.87 over 10,000 pages in
/// the unit test, ~0.02 bits of standard deviation), text and code 4-6.5.
pub(crate) const RUN_UNIFORM_BITS: f64 = 7.6;
/// Refs of checkpoints live under this prefix.
pub(crate) const REF_PREFIX: &str = "vm/";
/// Longest checkpoint name (the ref name adds `vm/`).
pub(crate) const MAX_NAME: usize = 200;
/// Most ramblocks in a checkpoint.
pub(crate) const MAX_BLOCKS: usize = 1024;
/// Most QEMU command-line arguments kept.
pub(crate) const MAX_CMDLINE_ARGS: usize = 4096;
/// Largest manifest accepted (the store caps ref payloads at 1 MiB).
pub(crate) const MAX_MANIFEST: usize = 1 << 20;
/// Size of one stored piece of the device-state tail.
pub(crate) const TAIL_CHUNK: usize = 64 << 10;
/// Magic at the start of the tail tree's payload.
pub(crate) const TAIL_MAGIC: &[u8; 4] = b"SVMT";
/// Most disks in a desktop snapshot.
pub(crate) const MAX_DISKS: usize = 64;
/// Largest tail accepted (QEMU 7.2 x86 tails are 100–400 KB).
pub(crate) const MAX_TAIL: u64 = 64 << 20;

/// Why a stored checkpoint was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    #[error("Checkpoint manifest is not JSON of the expected shape: {detail}")]
    Json { detail: String },
    #[error("Ref payload is not a VM checkpoint (format '{found}', expected '{FORMAT}')")]
    NotCheckpoint { found: String },
    #[error("Checkpoint format version {found} is newer than this strata reads ({VERSION}): upgrade strata")]
    TooNew { found: u32 },
    #[error("Checkpoint manifest field '{field}' is invalid: {why}")]
    Invalid { field: &'static str, why: String },
    #[error("Checkpoint manifest of {len} bytes exceeds the {MAX_MANIFEST}-byte cap")]
    TooLarge { len: usize },
    #[error(
        "Checkpoint ref has {found} roots, its manifest needs {expected} (1 tail + 1 per ramblock + 1 per disk)"
    )]
    Roots { found: usize, expected: usize },
    #[error("Tail tree is malformed: {why}")]
    BadTailTree { why: String },
}

/// Why a page map leaf's slot table is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotTableError {
    #[error("Slot table of {len} bytes is not whole {SLOT_ENTRY_BYTES}-byte entries")]
    PartialEntry { len: usize },
    #[error("Slot table names entry {index} of a leaf of {entries}")]
    OutsideLeaf { index: u16, entries: usize },
    #[error("Slot table entry {index} is out of order")]
    OutOfOrder { index: u16 },
    #[error("Slot {slot} of entry {index} is not below {RUN_PAGES}")]
    BadSlot { index: u16, slot: u8 },
}

/// How the checkpoint was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Stop-and-copy: the VM was paused for the whole save and stays paused (like `virsh save`).
    Save,
    /// Live, `background-snapshot` capability: the state at the start, a pause of milliseconds.
    BackgroundSnapshot,
    /// Live, precopy then `cont`: the state at switchover.
    Precopy,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Save => "save",
            Mode::BackgroundSnapshot => "background-snapshot",
            Mode::Precopy => "precopy",
        }
    }
}

/// The QEMU that produced the stream.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QemuInfo {
    /// `major.minor.micro` from the QMP greeting.
    pub version: String,
    /// Distribution package string from the greeting.
    #[serde(default)]
    pub package: String,
    /// Resolved machine type (e.g. `pc-i440fx-7.2`).
    pub machine_type: String,
    /// `/proc/PID/cmdline` of the source QEMU, for `vm restore --launch`; empty when unknown.
    #[serde(default)]
    pub cmdline: Vec<String>,
}

/// What the stream said besides pages and the tail (enough to regenerate it).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamMeta {
    pub file_version: u32,
    pub machine_type: Option<String>,
    /// CONFIGURATION subsections, verbatim, as hex.
    #[serde(default)]
    pub config_subsections: String,
    pub ram_section: RamSectionHeader,
    /// Bytes QEMU sent (all passes).
    pub bytes: u64,
    /// True for a background-snapshot stream (no RAM END).
    #[serde(default)]
    pub background_snapshot: bool,
    /// Devices listed in VMDESCRIPTION.
    #[serde(default)]
    pub vmdesc_devices: u64,
}

/// One ramblock and what its pages cost.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockMeta {
    pub name: String,
    pub used_len: u64,
    /// Pages that are all zero (not stored).
    pub zero_pages: u64,
    /// Distinct non-zero pages in this block.
    pub unique_pages: u64,
}

impl BlockMeta {
    pub fn pages(&self) -> u64 {
        self.used_len / PAGE_SIZE as u64
    }
}

/// The device-state tail.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TailMeta {
    pub len: u64,
    /// BLAKE3 of the whole tail, hex (pieces are verified too; this pins their order).
    pub blake3: String,
}

/// One codec's measurements on the data that arrived (see `codec_choice`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CodecEstimate {
    pub codec: String,
    /// Stored / raw on the sampled frames.
    pub ratio: f64,
    /// Aggregate compression speed of the pool, MB/s of raw input.
    pub comp_mb_s: f64,
    /// Serial model: Speed_Comp × (1 − Rate), MB/s, what the paper's inequality compares with
    /// the backend. Overlapped model: the raw MB/s the save would reach,
    /// min(Speed_Comp, Speed_Transfer / Rate).
    pub expected_mb_s: f64,
    /// Serial: Speed_Transfer ≤ Speed_Comp × (1 − Rate). Overlapped: Speed_Comp > Speed_Transfer.
    pub pays: bool,
}

/// Which codec was used and why.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CodecReport {
    /// The codec that stored most frames (`none`, `lz4`, `zstd:N`).
    pub chosen: String,
    pub why: String,
    /// `auto` or the codec forced with `--codec`.
    pub policy: String,
    /// Time model of the decisions: `serial` (the paper's, local disks) or `overlapped`
    /// (network backends, whose uploads overlap compression); empty in older manifests.
    #[serde(default)]
    pub model: String,
    /// Backend write speed used by the last decision (MB/s), 0 for a fixed codec.
    pub backend_mb_s: f64,
    /// Where that speed came from: `probe`, a speed remembered from an earlier save, an
    /// assumed 1 Gbit/s, each possibly `then measured on this save's uploads`.
    #[serde(default)]
    pub backend_speed_from: String,
    /// Frames stored with each codec.
    pub frames: BTreeMap<String, u64>,
    /// Frames compressed with every candidate to measure them.
    pub samples: u64,
    /// How often the choice changed during the save.
    pub switches: u64,
    /// The measurements behind the final decision.
    pub estimates: Vec<CodecEstimate>,
}

/// Counters of one save.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SaveStats {
    /// Guest RAM (sum of ramblock lengths).
    pub logical_bytes: u64,
    /// PAGE + ZERO records received (all passes).
    pub pages_sent: u64,
    pub zero_pages: u64,
    pub data_pages: u64,
    pub unique_pages: u64,
    /// Page chunks this save added to the store.
    pub pages_stored: u64,
    /// Data page records that cost nothing: already in the store or seen earlier in the stream.
    pub pages_deduped: u64,
    /// Raw bytes of chunks new to the store (pages, maps, tail).
    pub new_bytes: u64,
    /// Bytes those chunks occupy in packs (after compression).
    pub stored_bytes: u64,
    /// Milliseconds the guest was paused (QEMU's figure; the whole save for `save`).
    pub downtime_ms: f64,
    /// Wall time from the first QMP command to the durable ref.
    pub total_ms: f64,
}

/// Pages stored as deltas against a base checkpoint (manifest version 2).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeltaMeta {
    /// The base checkpoint's name when the save ran (informational: the base pages are
    /// children of this checkpoint's own delta records, so the base may be removed).
    pub base: String,
    /// Distinct pages stored as deltas.
    pub pages: u64,
    /// Encoded bytes of their runs (before the store's compression).
    pub bytes: u64,
    /// Delta records this save added to the store (reused ones are not counted).
    pub records: u64,
    /// Pages for which a delta was computed, and pool batches that skipped trying.
    #[serde(default)]
    pub attempts: u64,
    #[serde(default)]
    pub skipped_batches: u64,
}

/// The JSON payload of a checkpoint ref.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub name: String,
    pub created_unix: u64,
    pub mode: Mode,
    pub qemu: QemuInfo,
    pub stream: StreamMeta,
    pub blocks: Vec<BlockMeta>,
    pub tail: TailMeta,
    pub codec: CodecReport,
    pub stats: SaveStats,
    /// Present when the save had a base checkpoint (version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<DeltaMeta>,
    /// The VM's strata disks, cut at the instant of the memory (a desktop snapshot, version
    /// 5); disk `i`'s block map is root `1 + blocks + i` of the ref.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskRecord>,
}

/// One disk of a desktop snapshot: which VM device it was, which strata disk, and the
/// geometry of its content at the snapshot's instant (the content is the ref root).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DiskRecord {
    /// QEMU's name of the device: the `-drive` id, else the qdev path of a `-blockdev`.
    pub device: String,
    /// The strata disk (the NBD export name) the device had attached.
    pub disk: String,
    /// The NBD URI QEMU reported for it (rewritten on restore).
    pub uri: String,
    pub size: u64,
    pub block_size: u32,
    /// Allocated (non-hole) blocks.
    pub allocated: u64,
    /// The disk's parent image when the snapshot was taken, if it was a linked clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

/// Ref name of checkpoint `name`.
pub fn ref_name(name: &str) -> String {
    format!("{REF_PREFIX}{name}")
}

/// Check a checkpoint name: 1–200 bytes of `[A-Za-z0-9._@=+-]` in `/`-separated segments.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && crate::store::objects::valid_ref_name(&ref_name(name))
}

impl Manifest {
    /// Serialise to the ref payload.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("manifest serialises")
    }

    /// The stream layout for the generator.
    pub fn layout(&self) -> Result<StreamLayout, ManifestError> {
        let config_subsections = hex::decode(&self.stream.config_subsections).map_err(|e| {
            ManifestError::Invalid { field: "stream.config_subsections", why: e.to_string() }
        })?;
        Ok(StreamLayout {
            version: self.stream.file_version,
            machine_type: self.stream.machine_type.clone(),
            config_subsections,
            ram_section: self.stream.ram_section.clone(),
            blocks: self
                .blocks
                .iter()
                .map(|b| RamBlock { name: b.name.clone(), used_len: b.used_len })
                .collect(),
        })
    }

    /// Total pages over all blocks.
    pub fn total_pages(&self) -> u64 {
        self.blocks.iter().map(BlockMeta::pages).sum()
    }

    fn validate(&self) -> Result<(), ManifestError> {
        let bad = |field: &'static str, why: String| Err(ManifestError::Invalid { field, why });
        if self.format != FORMAT {
            return Err(ManifestError::NotCheckpoint { found: self.format.clone() });
        }
        if self.version > VERSION {
            return Err(ManifestError::TooNew { found: self.version });
        }
        if self.version == 0 {
            return bad("version", "0 is not a version".into());
        }
        if !valid_name(&self.name) {
            return bad("name", format!("'{}' is not a valid checkpoint name", self.name));
        }
        if self.blocks.is_empty() || self.blocks.len() > MAX_BLOCKS {
            return bad(
                "blocks",
                format!("{} ramblocks (1..={MAX_BLOCKS} allowed)", self.blocks.len()),
            );
        }
        for (i, b) in self.blocks.iter().enumerate() {
            if b.name.is_empty() || b.name.len() > 255 {
                return bad("blocks.name", format!("ramblock {i} name must be 1 to 255 bytes"));
            }
            if b.used_len == 0 || b.used_len % PAGE_SIZE as u64 != 0 || b.used_len > 16 << 40 {
                return bad(
                    "blocks.used_len",
                    format!("ramblock '{}' length {:#x}", b.name, b.used_len),
                );
            }
            if b.zero_pages > b.pages() || b.unique_pages > b.pages() {
                return bad("blocks", format!("ramblock '{}' counts exceed its pages", b.name));
            }
            if self.blocks[..i].iter().any(|o| o.name == b.name) {
                return bad("blocks.name", format!("ramblock '{}' listed twice", b.name));
            }
        }
        if self.qemu.cmdline.len() > MAX_CMDLINE_ARGS {
            return bad(
                "qemu.cmdline",
                format!("{} arguments (at most {MAX_CMDLINE_ARGS})", self.qemu.cmdline.len()),
            );
        }
        if self.tail.len == 0 || self.tail.len > MAX_TAIL {
            return bad("tail.len", format!("{} bytes (1..={MAX_TAIL})", self.tail.len));
        }
        if self.tail.blake3.len() != 64 || hex::decode(&self.tail.blake3).is_err() {
            return bad("tail.blake3", "not 64 hex digits".into());
        }
        if let Some(d) = &self.delta {
            if self.version < 2 {
                return bad("delta", "delta pages need manifest version 2".into());
            }
            if d.records > d.pages {
                return bad("delta.records", "more records than delta pages".into());
            }
        }
        if !self.disks.is_empty() && self.version < VERSION_DISKS {
            return bad("disks", format!("disks need manifest version {VERSION_DISKS}"));
        }
        if self.disks.len() > MAX_DISKS {
            return bad("disks", format!("{} disks (at most {MAX_DISKS})", self.disks.len()));
        }
        for (i, d) in self.disks.iter().enumerate() {
            if d.disk.is_empty() || d.disk.len() > 200 || d.device.len() > 255 || d.uri.len() > 4096
            {
                return bad("disks", format!("disk {i} has a bad name, device or URI"));
            }
            if d.block_size == 0
                || d.size == 0
                || d.allocated > d.size.div_ceil(d.block_size as u64)
            {
                return bad("disks", format!("disk '{}' has a bad geometry", d.disk));
            }
            if self.disks[..i].iter().any(|o| o.device == d.device) {
                return bad("disks.device", format!("device '{}' listed twice", d.device));
            }
        }
        if self.stream.file_version != 3 {
            return bad("stream.file_version", format!("{} (only 3)", self.stream.file_version));
        }
        self.layout().map(|_| ())
    }
}

/// Parse and validate a manifest. Pure function over bytes, for cargo-fuzz.
pub fn parse_manifest(bytes: &[u8]) -> Result<Manifest, ManifestError> {
    if bytes.len() > MAX_MANIFEST {
        return Err(ManifestError::TooLarge { len: bytes.len() });
    }
    // Check the format tag first so a disk ref gets "not a checkpoint", not a field error.
    #[derive(serde::Deserialize)]
    struct Head {
        format: Option<String>,
    }
    let head: Head =
        serde_json::from_slice(bytes).map_err(|e| ManifestError::Json { detail: e.to_string() })?;
    match head.format {
        Some(f) if f == FORMAT => {}
        other => return Err(ManifestError::NotCheckpoint { found: other.unwrap_or_default() }),
    }
    let m: Manifest =
        serde_json::from_slice(bytes).map_err(|e| ManifestError::Json { detail: e.to_string() })?;
    m.validate()?;
    Ok(m)
}

/// A checkpoint read back from its ref: manifest plus root ids.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub manifest: Manifest,
    pub tail_root: ChunkId,
    pub map_roots: Vec<ChunkId>,
    /// Block map of each of `manifest.disks`, in order.
    pub disk_roots: Vec<ChunkId>,
    pub generation: u64,
}

impl Checkpoint {
    /// Interpret a ref as a checkpoint.
    pub fn from_ref(r: &Ref) -> Result<Checkpoint, ManifestError> {
        let manifest = parse_manifest(&r.payload)?;
        let blocks = manifest.blocks.len();
        let expected = 1 + blocks + manifest.disks.len();
        if r.roots.len() != expected {
            return Err(ManifestError::Roots { found: r.roots.len(), expected });
        }
        Ok(Checkpoint {
            tail_root: r.roots[0],
            map_roots: r.roots[1..1 + blocks].to_vec(),
            disk_roots: r.roots[1 + blocks..].to_vec(),
            manifest,
            generation: r.generation,
        })
    }

    /// The ref to commit.
    pub fn to_ref(&self) -> Ref {
        let mut roots = Vec::with_capacity(1 + self.map_roots.len() + self.disk_roots.len());
        roots.push(self.tail_root);
        roots.extend_from_slice(&self.map_roots);
        roots.extend_from_slice(&self.disk_roots);
        Ref::new(roots, self.manifest.encode())
    }
}

/// Tail tree: children are the tail's 64 KiB pieces in order; payload is
/// `"SVMT" | le64 total length`.
pub fn tail_tree(pieces: Vec<ChunkId>, len: u64) -> Tree {
    let mut payload = Vec::with_capacity(12);
    payload.extend_from_slice(TAIL_MAGIC);
    payload.extend_from_slice(&len.to_le_bytes());
    Tree { children: pieces, payload }
}

/// Read a tail tree back: (pieces, total length), with the piece count checked against the length.
pub fn parse_tail_tree(t: &Tree) -> Result<(Vec<ChunkId>, u64), ManifestError> {
    let bad = |why: &str| ManifestError::BadTailTree { why: why.into() };
    if t.payload.len() != 12 || &t.payload[..4] != TAIL_MAGIC {
        return Err(bad("payload is not SVMT + length"));
    }
    let len = endian::le64(&t.payload, 4);
    if len == 0 || len > MAX_TAIL {
        return Err(bad("tail length out of range"));
    }
    if t.children.len() as u64 != len.div_ceil(TAIL_CHUNK as u64) {
        return Err(bad("piece count does not match the length"));
    }
    if t.children.iter().any(ChunkId::is_zero) {
        return Err(bad("a piece is a hole"));
    }
    Ok((t.children.clone(), len))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        Manifest {
            format: FORMAT.into(),
            version: VERSION,
            name: "desk-01@mon".into(),
            created_unix: 1_700_000_000,
            mode: Mode::BackgroundSnapshot,
            qemu: QemuInfo {
                version: "7.2.22".into(),
                package: "Debian".into(),
                machine_type: "pc-i440fx-7.2".into(),
                cmdline: vec!["qemu-system-x86_64".into(), "-m".into(), "256".into()],
            },
            stream: StreamMeta {
                file_version: 3,
                machine_type: Some("pc-i440fx-7.2".into()),
                config_subsections: String::new(),
                ram_section: RamSectionHeader { section_id: 2, instance_id: 0, version_id: 4 },
                bytes: 123,
                background_snapshot: true,
                vmdesc_devices: 30,
            },
            blocks: vec![
                BlockMeta {
                    name: "pc.ram".into(),
                    used_len: 256 << 20,
                    zero_pages: 10,
                    unique_pages: 20,
                },
                BlockMeta {
                    name: "pc.bios".into(),
                    used_len: 256 << 10,
                    zero_pages: 0,
                    unique_pages: 64,
                },
            ],
            tail: TailMeta { len: 200_000, blake3: "ab".repeat(32) },
            codec: CodecReport {
                chosen: "lz4".into(),
                why: "test".into(),
                policy: "auto".into(),
                model: "serial".into(),
                backend_mb_s: 300.0,
                backend_speed_from: "probe".into(),
                frames: BTreeMap::from([("lz4".into(), 5)]),
                samples: 1,
                switches: 0,
                estimates: vec![],
            },
            stats: SaveStats::default(),
            delta: None,
            disks: Vec::new(),
        }
    }

    #[test]
    fn slot_table_bytes_are_pinned_and_bad_tables_refused() {
        let t = SlotTable(vec![(3, 0), (0x0102, 31)]);
        assert_eq!(t.encode(), [3, 0, 0, 0x02, 0x01, 31]);
        assert_eq!(SlotTable::parse(&t.encode(), 2048).unwrap(), t);
        assert_eq!(SlotTable::parse(&[], 0).unwrap(), SlotTable::default());
        assert_eq!(SlotTable::parse(&[3, 0], 2048), Err(SlotTableError::PartialEntry { len: 2 }));
        assert_eq!(
            SlotTable::parse(&[3, 0, 0], 3),
            Err(SlotTableError::OutsideLeaf { index: 3, entries: 3 })
        );
        assert_eq!(
            SlotTable::parse(&[3, 0, 0, 3, 0, 1], 2048),
            Err(SlotTableError::OutOfOrder { index: 3 })
        );
        assert_eq!(
            SlotTable::parse(&[3, 0, 32], 2048),
            Err(SlotTableError::BadSlot { index: 3, slot: 32 })
        );
        assert!(SlotTable::parse(&[3, 0, 32], 2048)
            .unwrap_err()
            .to_string()
            .contains("not below 32"));
    }

    #[test]
    fn json_field_names_are_pinned() {
        let m = sample();
        let v: serde_json::Value = serde_json::from_slice(&m.encode()).unwrap();
        assert_eq!(v["format"], "strata-vm-checkpoint");
        assert_eq!(v["version"], 5);
        assert_eq!(
            (VERSION, VERSION_DISKS, VERSION_SLOTS, VERSION_RUNS, VERSION_NO_RUNS),
            (5, 5, 4, 3, 2)
        );
        assert_eq!((RUN_PAGES, RUN_BYTES, MAX_DISKS), (32, 131_072, 64));
        assert!(v.get("disks").is_none(), "no disks field without disks");
        assert!(v.get("delta").is_none(), "no delta field without a base");
        assert_eq!(v["mode"], "background-snapshot");
        assert_eq!(v["qemu"]["machine_type"], "pc-i440fx-7.2");
        assert_eq!(v["stream"]["ram_section"]["version_id"], 4);
        assert_eq!(v["blocks"][0]["used_len"], 256u64 << 20);
        assert_eq!(v["tail"]["len"], 200_000);
        assert_eq!(v["codec"]["frames"]["lz4"], 5);
        assert!(v["stats"]["downtime_ms"].is_number());
        assert_eq!(parse_manifest(&m.encode()).unwrap(), m);
        let modes: Vec<String> = [Mode::Save, Mode::BackgroundSnapshot, Mode::Precopy]
            .iter()
            .map(|m| serde_json::to_value(m).unwrap().as_str().unwrap().to_string())
            .collect();
        assert_eq!(modes, ["save", "background-snapshot", "precopy"]);
    }

    #[test]
    fn refuses_other_formats_newer_versions_and_bad_fields() {
        assert!(matches!(
            parse_manifest(b"{\"disk\":1}"),
            Err(ManifestError::NotCheckpoint { .. })
        ));
        assert!(matches!(parse_manifest(b"not json"), Err(ManifestError::Json { .. })));
        let mut m = sample();
        m.version = 6;
        assert_eq!(parse_manifest(&m.encode()), Err(ManifestError::TooNew { found: 6 }));
        m.version = VERSION_RUNS;
        assert_eq!(parse_manifest(&m.encode()).unwrap().version, 3);
        m.version = VERSION_NO_RUNS;
        assert_eq!(parse_manifest(&m.encode()).unwrap().version, 2);
        let mut m = sample();
        m.version = 1;
        m.delta = Some(DeltaMeta::default());
        assert!(matches!(
            parse_manifest(&m.encode()),
            Err(ManifestError::Invalid { field: "delta", .. })
        ));
        let mut m = sample();
        m.blocks[1].used_len = 4095;
        assert!(matches!(
            parse_manifest(&m.encode()),
            Err(ManifestError::Invalid { field: "blocks.used_len", .. })
        ));
        let mut m = sample();
        m.blocks[1].name = "pc.ram".into();
        assert!(matches!(parse_manifest(&m.encode()), Err(ManifestError::Invalid { .. })));
        let mut m = sample();
        m.name = "../x".into();
        assert!(matches!(
            parse_manifest(&m.encode()),
            Err(ManifestError::Invalid { field: "name", .. })
        ));
        let mut m = sample();
        m.stream.config_subsections = "zz".into();
        assert!(parse_manifest(&m.encode()).is_err());
        assert!(matches!(
            parse_manifest(&vec![b' '; MAX_MANIFEST + 1]),
            Err(ManifestError::TooLarge { .. })
        ));
        // Truncations never panic.
        let b = sample().encode();
        for cut in (0..b.len()).step_by(7) {
            assert!(parse_manifest(&b[..cut]).is_err());
        }
    }

    #[test]
    fn ref_roots_layout() {
        let m = sample();
        let c = Checkpoint {
            manifest: m.clone(),
            tail_root: ChunkId([1; 32]),
            map_roots: vec![ChunkId([2; 32]), ChunkId([3; 32])],
            disk_roots: vec![],
            generation: 0,
        };
        let r = c.to_ref();
        assert_eq!(r.roots, vec![ChunkId([1; 32]), ChunkId([2; 32]), ChunkId([3; 32])]);
        let back = Checkpoint::from_ref(&r).unwrap();
        assert_eq!(back.tail_root, c.tail_root);
        assert_eq!(back.map_roots, c.map_roots);
        let mut short = r.clone();
        short.roots.pop();
        assert_eq!(
            Checkpoint::from_ref(&short).unwrap_err(),
            ManifestError::Roots { found: 2, expected: 3 }
        );
        assert_eq!(m.layout().unwrap().blocks[0].name, "pc.ram");
        // Version 2 with delta pages: the same roots, a `delta` object in the payload.
        let mut d = c.clone();
        d.manifest.delta = Some(DeltaMeta {
            base: "gold".into(),
            pages: 9,
            bytes: 900,
            records: 8,
            ..Default::default()
        });
        let r = d.to_ref();
        assert_eq!(r.roots.len(), 3);
        let back = Checkpoint::from_ref(&r).unwrap();
        assert_eq!(back.manifest.delta, d.manifest.delta);
        let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        assert_eq!(v["delta"]["pages"], 9);
        assert_eq!(v["delta"]["records"], 8);
        assert_eq!(v["delta"]["base"], "gold");
        // A version-1 manifest (no delta field) still reads.
        let mut old = c.clone();
        old.manifest.version = 1;
        assert!(Checkpoint::from_ref(&old.to_ref()).unwrap().manifest.delta.is_none());
        assert_eq!(m.total_pages(), (256 << 8) + 64);
        // Version 5, a desktop snapshot: one more root per disk, after the page maps.
        let mut desk = c.clone();
        desk.manifest.version = VERSION_DISKS;
        desk.manifest.disks = vec![DiskRecord {
            device: "virtio0".into(),
            disk: "desk1".into(),
            uri: "nbd+unix:///desk1?socket=/s".into(),
            size: 1 << 30,
            block_size: 65536,
            allocated: 12,
            parent: Some("gold".into()),
        }];
        desk.disk_roots = vec![ChunkId([9; 32])];
        let r = desk.to_ref();
        assert_eq!(r.roots.len(), 4);
        assert_eq!(r.roots[3], ChunkId([9; 32]));
        let back = Checkpoint::from_ref(&r).unwrap();
        assert_eq!((back.map_roots.len(), back.disk_roots.clone()), (2, vec![ChunkId([9; 32])]));
        assert_eq!(back.manifest.disks, desk.manifest.disks);
        let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        assert_eq!(v["disks"][0]["disk"], "desk1");
        let mut early = desk.clone();
        early.manifest.version = 4;
        assert!(Checkpoint::from_ref(&early.to_ref()).is_err(), "disks need version 5");
        assert!(
            v.get("disks").is_some()
                && serde_json::to_value(&c.manifest).unwrap().get("disks").is_none()
        );
    }

    #[test]
    fn tail_tree_bytes_are_pinned() {
        let t = tail_tree(vec![ChunkId([7; 32]); 4], 3 * 65536 + 5);
        let b = t.encode();
        // Tree header (16 bytes) + 4 ids + payload "SVMT" le64.
        assert_eq!(&b[0..4], b"STRT");
        assert_eq!(b.len(), 16 + 4 * 32 + 12);
        assert_eq!(&b[16 + 128..16 + 132], b"SVMT");
        assert_eq!(endian::le64(&b, 148), 3 * 65536 + 5);
        let back = Tree::decode(&b).unwrap();
        assert_eq!(parse_tail_tree(&back).unwrap().1, 3 * 65536 + 5);
        let wrong = tail_tree(vec![ChunkId([7; 32]); 3], 3 * 65536 + 5);
        assert!(parse_tail_tree(&wrong).is_err());
        let hole = tail_tree(vec![ChunkId::ZERO], 10);
        assert!(parse_tail_tree(&hole).is_err());
    }

    #[test]
    fn names() {
        assert!(valid_name("desk-01"));
        assert!(valid_name("pool/desk-01@2026-01-01"));
        assert!(!valid_name(""));
        assert!(!valid_name("a b"));
        assert!(!valid_name(&"x".repeat(MAX_NAME + 1)));
        assert_eq!(ref_name("d"), "vm/d");
    }
}
