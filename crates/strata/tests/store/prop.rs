//! Property tests of the pack/index codecs and of the store against a simple model.

use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;
use strata::backend::memory::MemoryBackend;
use strata::progress::NoProgress;
use strata::store::check::CheckOptions;
use strata::store::objects::{Ref, Tree};
use strata::store::pack::{parse_pack, ChunkKind, IndexObject, PackBuilder};
use strata::store::{InitOptions, Store};
use strata::{ChunkId, Codec, PackId};

fn codec_strategy() -> impl Strategy<Value = Codec> {
    prop_oneof![Just(Codec::None), Just(Codec::Lz4), (1i32..=5).prop_map(Codec::Zstd)]
}

fn chunk_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..3000),
        (any::<u8>(), 1usize..5000).prop_map(|(b, n)| vec![b; n]),
        (0u8..4, 1usize..5000).prop_map(|(m, n)| (0..n).map(|i| (i as u8) & m).collect()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Any sequence of frames round-trips through pack bytes, the trailer and the index object.
    #[test]
    fn packs_round_trip(frames in prop::collection::vec((prop::collection::vec(chunk_strategy(), 1..5), codec_strategy()), 1..12)) {
        let mut b = PackBuilder::new(PackId([3; 16]));
        let mut expect = Vec::new();
        for (chunks, codec) in &frames {
            let raw: Vec<u8> = chunks.concat();
            let (stored, used) = match codec.compress(&raw) { Some(z) => (z, *codec), None => (raw.clone(), Codec::None) };
            let meta: Vec<_> = chunks.iter().map(|c| (ChunkId::of(c), c.len() as u32, ChunkKind::Data)).collect();
            b.add_frame(&stored, used, &meta);
            expect.extend(chunks.iter().cloned());
        }
        let (bytes, entries) = b.finish();
        let (id, parsed) = parse_pack(&bytes).unwrap();
        prop_assert_eq!(id, PackId([3; 16]));
        prop_assert_eq!(&parsed, &entries);
        for (e, want) in parsed.iter().zip(&expect) {
            let frame = &bytes[e.frame_off as usize..(e.frame_off + e.frame_len as u64) as usize];
            let raw = e.codec.decompress(frame, e.frame_raw_len as usize).unwrap();
            prop_assert_eq!(&raw[e.off_in_frame as usize..(e.off_in_frame + e.raw_len) as usize], &want[..]);
        }
        let idx = IndexObject { pack: id, pack_size: bytes.len() as u64, entries };
        let enc = idx.encode();
        prop_assert_eq!(IndexObject::decode(&enc).unwrap(), idx);
    }

    /// Damage anywhere outside frame data is caught by parsing; inside frame data by the
    /// frame CRC. Never a panic.
    #[test]
    fn pack_damage_never_passes_silently(chunks in prop::collection::vec(chunk_strategy(), 1..6), pos in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut b = PackBuilder::new(PackId([1; 16]));
        for c in &chunks {
            b.add_frame(c, Codec::None, &[(ChunkId::of(c), c.len() as u32, ChunkKind::Data)]);
        }
        let (mut bytes, entries) = b.finish();
        let i = pos.index(bytes.len());
        bytes[i] ^= 1 << bit;
        match parse_pack(&bytes) {
            Err(_) => {}
            Ok((_, parsed)) => {
                prop_assert_eq!(&parsed, &entries);
                let hit = parsed.iter().find(|e| (e.frame_off as usize..(e.frame_off + e.frame_len as u64) as usize).contains(&i));
                let e = hit.expect("a flip outside frames must fail parsing");
                let frame = &bytes[e.frame_off as usize..(e.frame_off + e.frame_len as u64) as usize];
                prop_assert_ne!(crc32c::crc32c(frame), e.frame_crc);
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Put { name: u8, seeds: Vec<u16> },
    Delete { name: u8 },
    Gc,
    Reopen,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..5, prop::collection::vec(0u16..60, 1..30)).prop_map(|(name, seeds)| Op::Put { name, seeds }),
        2 => (0u8..5).prop_map(|name| Op::Delete { name }),
        1 => Just(Op::Gc),
        1 => Just(Op::Reopen),
    ]
}

fn block(seed: u16) -> Vec<u8> {
    let mut x = seed as u64 * 2654435761 + 1;
    (0..2048)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x & 0x1f) as u8
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random puts, deletes, GCs and reopens: the store always matches the model, and
    /// `check` never finds damage.
    #[test]
    fn store_matches_model(ops in prop::collection::vec(op_strategy(), 1..40)) {
        let d = tempfile::tempdir().unwrap();
        let backend = MemoryBackend::new();
        let meta = d.path().join("m.redb");
        let mut s = Some(Store::init(Arc::new(backend.clone()), &meta, InitOptions { pack_size: 64 << 10, default_codec: Codec::Lz4 }).unwrap());
        let mut model: BTreeMap<String, Vec<u16>> = BTreeMap::new();
        for op in ops {
            let st = s.as_ref().unwrap();
            match op {
                Op::Put { name, seeds } => {
                    let ses = st.session();
                    let ids: Vec<ChunkId> = seeds.iter().map(|&x| ses.put(&block(x), ChunkKind::Data).unwrap()).collect();
                    let root = ses.put_tree(&Tree { children: ids, payload: vec![] }).unwrap();
                    ses.commit_ref(&format!("r/{name}"), Ref::new(vec![root], vec![])).unwrap();
                    model.insert(format!("r/{name}"), seeds);
                }
                Op::Delete { name } => {
                    let n = format!("r/{name}");
                    prop_assert_eq!(st.delete_ref(&n).is_ok(), model.remove(&n).is_some());
                }
                Op::Gc => { st.gc(&NoProgress).unwrap(); }
                Op::Reopen => {
                    drop(s.take());
                    s = Some(Store::open(Arc::new(backend.clone()), &meta).unwrap());
                }
            }
        }
        let st = s.as_ref().unwrap();
        prop_assert_eq!(st.list_refs("r/").unwrap(), model.keys().cloned().collect::<Vec<_>>());
        for (name, seeds) in &model {
            let r = st.get_ref(name).unwrap().unwrap();
            let t = Tree::decode(&st.get(&r.roots[0]).unwrap()).unwrap();
            let got: Vec<Vec<u8>> = t.children.iter().map(|c| st.get(c).unwrap()).collect();
            let want: Vec<Vec<u8>> = seeds.iter().map(|&x| block(x)).collect();
            prop_assert_eq!(got, want);
        }
        let rep = st.check(CheckOptions::default(), &NoProgress).unwrap();
        prop_assert!(!rep.is_damaged(), "{:?}", rep.problems);
    }
}
