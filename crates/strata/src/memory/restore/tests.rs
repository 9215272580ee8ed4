//! Tests of the restore plan, map reads and the fetch pipeline.

use super::maps::*;
use super::pipeline::*;
use super::*;
use crate::backend::memory::MemoryBackend;
use crate::backend::Backend;
use crate::memory::manifest::BlockMeta;
use crate::store::map::{read_map, write_map};
use crate::store::pack::{ChunkKind, PackEntry};
use crate::store::InitOptions;
use std::sync::Arc;

#[test]
fn concurrent_map_reads_match_read_map() {
    let d = tempfile::tempdir().unwrap();
    let store = Store::init(
        Arc::new(MemoryBackend::new()),
        &d.path().join("m.redb"),
        InitOptions::default(),
    )
    .unwrap();
    let ses = store.session();
    let ids: Vec<ChunkId> =
        (0..40u32).map(|i| ses.put(&i.to_le_bytes(), ChunkKind::Data).unwrap()).collect();
    // Map 0: a full leaf, an all-zero leaf, a partial leaf. Map 1: one short leaf. Map 2: empty.
    let mut m0: Vec<ChunkId> = (0..LEAF_IDS).map(|i| ids[i % 40]).collect();
    m0.extend(std::iter::repeat_n(ChunkId::ZERO, LEAF_IDS));
    m0.extend((0..123).map(|i| ids[(i * 7) % 40]));
    let m1: Vec<ChunkId> = ids[..5].to_vec();
    let maps = [m0, m1, Vec::new()];
    let roots: Vec<ChunkId> = maps.iter().map(|m| write_map(&ses, m).unwrap()).collect();
    store.flush().unwrap();
    for threads in [1, 3, MAP_READERS] {
        let got = read_maps(&store, &roots, threads).unwrap();
        assert!(got.slots.iter().all(|s| s.is_empty()), "no slot tables");
        for (i, (g, want)) in got.ids.iter().zip(&maps).enumerate() {
            assert_eq!(g, want, "map {i} with {threads} threads");
            assert_eq!(g, &read_map(&store, &roots[i]).unwrap());
        }
    }
    // A root that is not stored: the error names the map (ramblock) it belongs to.
    let bad = [roots[0], ids[0], ChunkId::of(b"not stored")];
    let (i, _) = read_maps(&store, &bad, 4).unwrap_err();
    assert!(i == 1 || i == 2, "failing map index {i}");
}

/// Leaves' slot tables (version 4) come back as (page, slot) per map, pages counted across
/// leaves; a damaged table is an error naming its map.
#[test]
fn map_reads_return_slot_tables() {
    use crate::memory::manifest::SlotTable;
    use crate::store::map::write_map_payloads;
    let d = tempfile::tempdir().unwrap();
    let store = Store::init(
        Arc::new(MemoryBackend::new()),
        &d.path().join("m.redb"),
        InitOptions::default(),
    )
    .unwrap();
    let ses = store.session();
    let ids: Vec<ChunkId> =
        (0..40u32).map(|i| ses.put(&i.to_le_bytes(), ChunkKind::Data).unwrap()).collect();
    let map: Vec<ChunkId> = (0..LEAF_IDS + 100).map(|i| ids[i % 40]).collect();
    let tables = [SlotTable(vec![(0, 5), (7, 31)]), SlotTable(vec![(99, 1)])];
    let root = write_map_payloads(&ses, &map, &mut |n| tables[n].encode(), &mut |_, _| {}).unwrap();
    let bad_root = write_map_payloads(
        &ses,
        &map,
        &mut |n| if n == 1 { vec![200, 0, 1] } else { vec![] },
        &mut |_, _| {},
    )
    .unwrap();
    store.flush().unwrap();
    let got = read_maps(&store, &[root], 2).unwrap();
    assert_eq!(got.ids[0], map);
    assert_eq!(got.slots[0], vec![(0, 5), (7, 31), (LEAF_IDS as u32 + 99, 1)]);
    assert_eq!((got.slot(0, 7), got.slot(0, 8), got.slot(0, 33)), (31, 8, 1));
    let (i, e) = read_maps(&store, &[root, bad_root], 2).unwrap_err();
    assert_eq!(i, 1);
    assert!(
        crate::error::error_chain(&e).contains("Slot table names entry 200 of a leaf of 100"),
        "{}",
        crate::error::error_chain(&e)
    );
}

#[test]
fn get_chunks_reads_runs_per_pack_and_verifies_each_chunk() {
    let d = tempfile::tempdir().unwrap();
    let mem = MemoryBackend::new();
    let store = Store::init(
        Arc::new(mem.clone()),
        &d.path().join("m.redb"),
        InitOptions { default_codec: Codec::None, ..InitOptions::default() },
    )
    .unwrap();
    let ses = store.session();
    let data = |i: u32| -> Vec<u8> {
        (0..64u32 << 10).map(|j| (j.wrapping_mul(2654435761) >> 13 ^ i) as u8).collect()
    };
    // Two packs, the first holding more than one CHUNKS_SPAN of chunks (several reads).
    let mut ids: Vec<ChunkId> =
        (0..48).map(|i| ses.put(&data(i), ChunkKind::Data).unwrap()).collect();
    store.flush().unwrap();
    ids.extend((48..52).map(|i| ses.put(&data(i), ChunkKind::Data).unwrap()));
    store.flush().unwrap();
    assert_eq!(mem.list("packs/").unwrap().len(), 2);
    // Asked out of order, with a repeat: answers in the order asked.
    let mut ask: Vec<ChunkId> = ids.iter().rev().copied().collect();
    ask.push(ids[3]);
    for threads in [1, 4] {
        let got = get_chunks(&store, &ask, threads).unwrap();
        for (a, g) in ask.iter().zip(&got) {
            assert_eq!(ChunkId::of(g), *a);
        }
    }
    // A chunk nobody stored: the error names its index.
    let mut bad = ids[..3].to_vec();
    bad.push(ChunkId::of(b"never stored"));
    let (i, e) = get_chunks(&store, &bad, 2).unwrap_err();
    assert_eq!(i, 3, "{e}");
    // A flipped byte in the small pack: caught by the frame checksum, naming that chunk.
    let small = mem.list("packs/").unwrap().into_iter().min_by_key(|o| o.size).unwrap();
    let (_, e) = store.locate(&ids[50]).unwrap();
    let mut bytes = mem.get(&small.key).unwrap();
    bytes[e.frame_off as usize + 10] ^= 1;
    mem.put(&small.key, &bytes).unwrap();
    let (i, e) = get_chunks(&store, &ids[48..], 1).unwrap_err();
    assert_eq!(i, 2, "{e}");
    assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
}

/// However the bytes arrive, a read is cut into batches of whole frames, in order, each
/// holding exactly its bytes, none but the last under the batch size and none holding more
/// than a batch and a frame.
#[test]
fn arriving_bytes_are_cut_into_batches_of_whole_frames() {
    use rand::{Rng, SeedableRng};
    let meta = |len: u32| FrameMeta {
        len,
        raw_len: 65536,
        codec: Codec::Zstd(1),
        crc: 0,
        delta: false,
        run: false,
    };
    let pack = PackId([3; 16]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut jobs = Vec::new();
    let mut off = 4096u64;
    for u in 0..60u32 {
        let len = rng.gen_range(1_000..70_000);
        add_to_jobs(&mut jobs, pack, off, 0, u, &meta(len), 4 << 20);
        // Now and then a gap between frames (pages of other checkpoints).
        off += len as u64 + if u % 7 == 3 { rng.gen_range(1..100_000) } else { 0 };
    }
    assert_eq!(jobs.len(), 1);
    let job = &jobs[0];
    let data: Vec<u8> = (0..job.end).map(|i| (i % 253) as u8).collect();
    let bufs = Buffers::new();
    for piece_max in [1usize, 777, 16 << 10, 1 << 20, 8 << 20] {
        let mut split = Splitter::new(0, job, &bufs);
        let mut batches = Vec::new();
        let mut at = job.start as usize;
        while at < job.end as usize {
            let n = rng.gen_range(1..=piece_max).min(job.end as usize - at);
            split.push(&data[at..at + n], &mut |b| batches.push(b));
            at += n;
        }
        assert!(split.done(), "every frame handed over (pieces up to {piece_max})");
        let mut next = (0usize, job.start);
        for (i, b) in batches.iter().enumerate() {
            assert_eq!((b.f0, b.base), next, "batches follow each other");
            assert!(b.f1 > b.f0);
            let end = job.frames[b.f1 - 1].off + job.frames[b.f1 - 1].len as u64;
            assert_eq!(b.bytes[..], data[b.base as usize..end as usize]);
            let len = end - b.base;
            if i + 1 < batches.len() {
                assert!(len >= BATCH_BYTES, "a batch before the last is at least the batch size");
            }
            if b.f1 - b.f0 > 1 {
                let f = &job.frames[b.f1 - 2];
                assert!(
                    f.off + f.len as u64 - b.base < BATCH_BYTES,
                    "a batch is cut at the first frame reaching the batch size"
                );
            }
            next = (b.f1, end);
        }
        assert_eq!(next, (job.frames.len(), job.end));
    }
}

#[test]
fn reads_coalesce_per_pack_and_end_with_the_smallest() {
    let meta = |len: u32| FrameMeta {
        len,
        raw_len: 65536,
        codec: Codec::Zstd(1),
        crc: 0,
        delta: false,
        run: false,
    };
    let (a, b) = (PackId([1; 16]), PackId([2; 16]));
    let mut jobs = Vec::new();
    // Pack a: three frames, the second with two pages, a gap of 64 KiB before the third;
    // then one small frame in pack b; then a far frame in pack a (a new read).
    add_to_jobs(&mut jobs, a, 0, 0, 0, &meta(1000), 1 << 20);
    add_to_jobs(&mut jobs, a, 1000, 0, 1, &meta(2000), 1 << 20);
    add_to_jobs(&mut jobs, a, 1000, 4096, 2, &meta(2000), 1 << 20);
    add_to_jobs(&mut jobs, a, 3000 + (64 << 10), 0, 3, &meta(500), 1 << 20);
    add_to_jobs(&mut jobs, b, 0, 0, 4, &meta(300), 1 << 20);
    add_to_jobs(&mut jobs, a, 8 << 20, 0, 5, &meta(900_000), 1 << 20);
    let spans: Vec<(PackId, u64, u64, usize)> =
        jobs.iter().map(|j| (j.pack, j.start, j.end, j.frames.len())).collect();
    assert_eq!(
        spans,
        vec![(a, 0, 3500 + (64 << 10), 3), (b, 0, 300, 1), (a, 8 << 20, (8 << 20) + 900_000, 1)]
    );
    assert_eq!(jobs[0].frames[1].chunks, vec![(0, 1), (4096, 2)]);
    // A read never grows past the read size: the same frames with 4 KiB reads split.
    let mut small = Vec::new();
    add_to_jobs(&mut small, a, 0, 0, 0, &meta(1000), 4096);
    add_to_jobs(&mut small, a, 1000, 0, 1, &meta(2000), 4096);
    add_to_jobs(&mut small, a, 3000, 0, 2, &meta(2000), 4096);
    assert_eq!(small.iter().map(|j| j.frames.len()).collect::<Vec<_>>(), vec![2, 1]);
    // Largest first, smallest last; equal sizes keep their order.
    order_reads(&mut jobs);
    let sizes: Vec<u64> = jobs.iter().map(|j| j.end - j.start).collect();
    assert_eq!(sizes, vec![900_000, 3500 + (64 << 10), 300]);
    let mut same = vec![small[1].clone(), small[1].clone()];
    same[1].start = 1;
    same[1].end = 2001;
    order_reads(&mut same);
    assert_eq!(same[0].start, 3000, "stable for equal sizes");
}

#[test]
fn a_packs_small_last_read_is_folded_into_the_one_before() {
    let meta = |len: u32| FrameMeta {
        len,
        raw_len: 65536,
        codec: Codec::Zstd(1),
        crc: 0,
        delta: false,
        run: false,
    };
    let (a, b, c) = (PackId([1; 16]), PackId([2; 16]), PackId([3; 16]));
    let mut jobs = Vec::new();
    // Pack a: two full 1 MiB reads and a 100 KB remainder; pack b: a full read and a
    // 300 KB remainder (over a quarter: kept); pack c: a single small read (kept).
    let mut u = 0;
    let mut add = |jobs: &mut Vec<Job>, p: PackId, off: u64, len: u32| {
        add_to_jobs(jobs, p, off, 0, u, &meta(len), 1 << 20);
        u += 1;
    };
    for k in 0..32u64 {
        add(&mut jobs, a, k * 65536, 65536);
    }
    add(&mut jobs, a, 32 * 65536, 100_000);
    for k in 0..16u64 {
        add(&mut jobs, b, k * 65536, 65536);
    }
    add(&mut jobs, b, 16 * 65536, 300_000);
    add(&mut jobs, c, 0, 5_000);
    assert_eq!(jobs.len(), 6);
    let folded = fold_small_tails(jobs, 1 << 20);
    let spans: Vec<(PackId, u64, u64, usize)> =
        folded.iter().map(|j| (j.pack, j.start, j.end, j.frames.len())).collect();
    assert_eq!(
        spans,
        vec![
            (a, 0, 1 << 20, 16),
            (a, 1 << 20, (2 << 20) + 100_000, 17),
            (b, 0, 1 << 20, 16),
            (b, 1 << 20, (1 << 20) + 300_000, 1),
            (c, 0, 5_000, 1),
        ]
    );
}

#[test]
fn small_checkpoints_get_small_reads() {
    // 24 MB: 1 MiB reads (24 of them, 6 per fetcher); 700 MB: the full 8 MiB.
    assert_eq!(read_size(24 << 20, 8 << 20), MIN_READ);
    assert_eq!(read_size(700 << 20, 8 << 20), 8 << 20);
    assert_eq!(read_size(96 << 20, 8 << 20), 3 << 20);
    // A caller's limit below MIN_READ wins.
    assert_eq!(read_size(24 << 20, 256 << 10), 256 << 10);
    assert!(read_size(0, 8 << 20) >= 1);
}

#[test]
fn par_map_keeps_order_and_reports_the_first_failure() {
    let items: Vec<u32> = (0..100).collect();
    let out = par_map(&items, 7, |x| Ok::<u32, ()>(x * 2)).unwrap();
    assert_eq!(out, items.iter().map(|x| x * 2).collect::<Vec<_>>());
    let err = par_map(&items, 1, |x| if *x >= 40 { Err(*x) } else { Ok(*x) }).unwrap_err();
    assert_eq!(err, (40, 40));
    assert!(par_map(&[] as &[u32], 4, |x| Ok::<u32, ()>(*x)).unwrap().is_empty());
}

#[test]
fn head_runs_are_cut_like_reads_and_claim_exactly_their_frames() {
    let (a, b) = (PackId([1; 16]), PackId([2; 16]));
    // Pack a: frames back to back, a repeat, then one past a 300 KiB gap; pack b: one frame.
    let frames =
        vec![(a, 1000, 500), (a, 32, 968), (b, 32, 100), (a, 32, 968), (a, 1500 + (300 << 10), 10)];
    let runs = runs_of(frames, 1 << 20);
    assert_eq!(
        runs,
        vec![(a, 32, 1500), (a, 1500 + (300 << 10), 1510 + (300 << 10)), (b, 32, 132)]
    );
    // A run stops at the read size, as a planned read does.
    let tiled: Vec<(PackId, u64, u32)> = (0..10u64).map(|k| (a, 32 + k * 1000, 1000)).collect();
    assert_eq!(
        runs_of(tiled, 4000).iter().map(|r| r.2 - r.1).collect::<Vec<_>>(),
        vec![4000, 4000, 2000]
    );
    // Largest first while under HEAD_BYTES, at most HEAD_READS, then sorted for claims.
    let many: Vec<(PackId, u64, u64)> =
        (0..20u64).map(|k| (PackId([k as u8; 16]), 32, 32 + (k + 1) * (1 << 20))).collect();
    let picked = pick_runs(many.clone(), HEAD_BYTES);
    let sizes: Vec<u64> = picked.iter().map(|r| (r.2 - r.1) >> 20).collect();
    assert!(picked.len() <= HEAD_READS && picked.windows(2).all(|w| w[0] < w[1]), "{picked:?}");
    assert_eq!(sizes, vec![20], "the largest run alone reaches HEAD_BYTES");
    let sizes: Vec<u64> = pick_runs(many, 50 << 20).iter().map(|r| (r.2 - r.1) >> 20).collect();
    assert_eq!(sizes, vec![18, 19, 20], "20 + 19 < 50 MiB: a third starts, then no more");
    let small: Vec<(PackId, u64, u64)> =
        (0..20u64).map(|k| (PackId([k as u8; 16]), 32, 32 + (k + 1) * 1000)).collect();
    let want: Vec<u64> = (20 - HEAD_READS as u64 + 1..=20).map(|k| k * 1000).collect();
    assert_eq!(
        pick_runs(small, HEAD_BYTES).iter().map(|r| r.2 - r.1).collect::<Vec<_>>(),
        want,
        "at most HEAD_READS"
    );
    assert!(pick_runs(vec![(a, 32, 132)], 0).is_empty(), "nothing when nothing may be read");
    // Claims: a frame inside a run (its first byte in [start, end)) belongs to it; none other.
    let head = Head::with_runs(runs.clone());
    assert_eq!(head.claim(a, 32), Some(0));
    assert_eq!(head.claim(a, 1499), Some(0));
    assert_eq!(head.claim(a, 1500), None, "the gap is not claimed");
    assert_eq!(head.claim(a, 31), None);
    assert_eq!(head.claim(a, 1500 + (300 << 10)), Some(1));
    assert_eq!(head.claim(b, 32), Some(2));
    assert_eq!(head.claim(b, 132), None);
    assert_eq!(head.claim(PackId([0; 16]), 32), None);
    assert_eq!(head.claim(PackId([3; 16]), 32), None);
}

#[test]
fn with_a_head_start_every_frame_is_read_once_and_the_head_reads_come_first() {
    let meta = |len: u32| FrameMeta {
        len,
        raw_len: 131072,
        codec: Codec::Zstd(1),
        crc: 0,
        delta: false,
        run: false,
    };
    let packs: Vec<PackId> = (1..=3u8).map(|k| PackId([k; 16])).collect();
    // 3 packs of 40 frames of 50,000 bytes; page u is in frame u / 4 (in pack order).
    let frame_of = |u: u32| -> (PackId, u64) {
        let f = (u / 4) as u64;
        (packs[(f / 40) as usize], 32 + (f % 40) * 50_000)
    };
    // The head start saw pages 0..200 (frames 0..50 of the first two packs).
    let head_frames: Vec<(PackId, u64, u32)> =
        (0..200).map(|u| (frame_of(u).0, frame_of(u).1, 50_000)).collect();
    let head = Head::with_runs(pick_runs(runs_of(head_frames, 1 << 20), HEAD_BYTES));
    let mut head_jobs = head.jobs();
    let mut jobs = Vec::new();
    let mut hits: Vec<(PackId, u64, u32, u32)> =
        (0..480).map(|u| (frame_of(u).0, frame_of(u).1, (u % 4) * 4096, u)).collect();
    hits.sort_unstable();
    for (pack, off, in_frame, u) in hits {
        match head.claim(pack, off) {
            Some(h) => add_to_run(&mut head_jobs[h], off, in_frame, u, &meta(50_000)),
            None => add_to_jobs(&mut jobs, pack, off, in_frame, u, &meta(50_000), 1 << 20),
        }
    }
    let n_head = head_jobs.len();
    assert!(n_head > 0);
    let mut all: Vec<Job> = head_jobs;
    all.extend(fold_small_tails(jobs, 1 << 20));
    // Every page once, every frame in one read, inside it; a head read is exactly its run.
    let mut seen = std::collections::HashSet::new();
    let mut pages = 0;
    for (k, j) in all.iter().enumerate() {
        assert!(!j.frames.is_empty());
        for f in &j.frames {
            assert!(
                f.off >= j.start && f.off + f.len as u64 <= j.end,
                "read {k}: frame at {} outside {}..{}",
                f.off,
                j.start,
                j.end
            );
            assert!(seen.insert((j.pack, f.off)), "frame at {} of {:?} read twice", f.off, j.pack);
            pages += f.chunks.len();
        }
        if k < n_head {
            assert_eq!(
                (j.start, j.end),
                (j.frames[0].off, j.frames.last().map(|f| f.off + f.len as u64).unwrap())
            );
        }
    }
    assert_eq!(pages, 480);
    assert_eq!(seen.len(), 120);
}

#[test]
fn a_second_head_stage_reads_only_outside_the_first_and_keeps_runs_disjoint() {
    let d = tempfile::tempdir().unwrap();
    let store = Store::init(
        Arc::new(MemoryBackend::new()),
        &d.path().join("m.redb"),
        InitOptions::default(),
    )
    .unwrap();
    let (a, b) = (PackId([1; 16]), PackId([2; 16]));
    let mut head = Head::with_runs(vec![(a, 1000, 2000)]);
    // Two frames the first stage reads, one before and one after it in the same pack (close
    // enough that one read would span all three), and one in another pack.
    let frames = vec![(a, 1000, 500), (a, 1500, 500), (a, 2000, 1000), (b, 32, 100), (a, 100, 800)];
    assert_eq!(head.extend(&store, frames, 1 << 20, HEAD_BYTES), 3);
    let (runs, handles) = head.runs();
    assert_eq!(runs, &[(a, 100, 900), (a, 1000, 2000), (a, 2000, 3000), (b, 32, 132)]);
    assert_eq!(handles, 4, "one read per run, in the runs' order");
    assert_eq!(head.claim(a, 2000), Some(2));
    assert_eq!(head.claim(a, 1500), Some(1));
    assert_eq!(head.claim(a, 100), Some(0));
    // Nothing new: nothing starts.
    assert_eq!(head.extend(&store, vec![(a, 1500, 500), (b, 32, 100)], 1 << 20, HEAD_BYTES), 0);
    assert_eq!(head.extend(&store, vec![(b, 500, 100)], 1 << 20, 0), 0, "no bytes allowed");
}

fn block(name: &str, pages: u64) -> BlockMeta {
    BlockMeta {
        name: name.into(),
        used_len: pages * PAGE_SIZE as u64,
        zero_pages: 0,
        unique_pages: 0,
    }
}

fn cid(n: u8) -> ChunkId {
    ChunkId([n; 32])
}

/// Pages are listed in map order, non-zero ones with their address and zero ones apart; a map
/// shorter than its ramblock is damage.
#[test]
fn list_pages_splits_zero_pages_and_checks_map_lengths() {
    let blocks = [block("pc.ram", 3), block("vga", 2)];
    let roots = [cid(100), cid(101)];
    let maps = vec![vec![cid(1), ChunkId::ZERO, cid(1)], vec![ChunkId::ZERO, cid(2)]];
    let listed = list_pages("c", &blocks, &roots, maps).unwrap();
    assert_eq!(listed.ids, vec![cid(1), cid(1), cid(2)]);
    assert_eq!(listed.pages, vec![(0, 0), (0, 2), (1, 1)]);
    assert_eq!(listed.zeros, vec![(0, 1), (1, 0)]);
    let short = vec![vec![cid(1); 3], vec![cid(2)]];
    match list_pages("c", &blocks, &roots, short) {
        Err(MemError::MetaDamaged { what, .. }) => assert!(what.contains("vga"), "{what}"),
        other => panic!("{other:?}"),
    }
}

fn entry(kind: ChunkKind, raw_len: u32) -> PackEntry {
    PackEntry {
        id: cid(9),
        frame_off: 4096,
        frame_len: 777,
        frame_raw_len: 65536,
        off_in_frame: 8192,
        raw_len,
        codec: Codec::Zstd(1),
        kind,
        frame_crc: 5,
    }
}

/// A page chunk is read at its place; a run's page at its slot (the slot table's, else its
/// page number's); a delta record is a tree chunk; a slot table naming a page chunk, or a
/// chunk of another size, is damage, and runs before version 3 are chunks of the wrong size.
#[test]
fn classify_places_pages_runs_and_deltas() {
    let (f, at, wrong) = classify(&entry(ChunkKind::Data, PAGE_SIZE as u32), None, 7, true);
    assert_eq!((f.len, f.raw_len, f.crc, f.delta, f.run, at), (777, 65536, 5, false, false, 8192));
    assert!(wrong.is_none());
    let run = entry(ChunkKind::Data, RUN_BYTES as u32);
    let (f, at, wrong) = classify(&run, None, 35, true);
    assert!(f.run && wrong.is_none());
    assert_eq!(at, 8192 + (35 % RUN_PAGES as u32) * PAGE_SIZE as u32);
    let (_, at, _) = classify(&run, Some(1), 35, true);
    assert_eq!(at, 8192 + PAGE_SIZE as u32);
    let (f, _, wrong) = classify(&run, None, 35, false);
    assert!(!f.run);
    assert!(wrong.unwrap().contains("not a page"));
    let (f, _, wrong) = classify(&entry(ChunkKind::Tree, 100), None, 0, true);
    assert!(f.delta && !f.run && wrong.is_none());
    let (_, _, wrong) = classify(&entry(ChunkKind::Data, PAGE_SIZE as u32), Some(3), 0, true);
    assert!(wrong.unwrap().contains("not a run"));
}

fn meta(len: u32, delta: bool) -> FrameMeta {
    FrameMeta { len, raw_len: 65536, codec: Codec::Zstd(1), crc: 0, delta, run: false }
}

/// Each frame's bytes count once, however many pages it holds; delta records not at all.
#[test]
fn frame_bytes_count_each_frame_once() {
    let (a, b) = (PackId([1; 16]), PackId([2; 16]));
    let located = Located {
        hits: vec![(a, 0, 0, 0), (a, 0, 4096, 1), (a, 100, 0, 2), (b, 0, 0, 3), (b, 50, 0, 4)],
        frames_of: vec![
            meta(100, false),
            meta(100, false),
            meta(30, false),
            meta(50, false),
            meta(9, true),
        ],
    };
    assert_eq!(frame_bytes(&located), 180);
}

/// Pages at one place with one id share a unique chunk; its refs list every page; a delta
/// record goes to the delta jobs, the others into reads.
#[test]
fn group_reads_shares_chunks_and_sets_deltas_apart() {
    let a = PackId([1; 16]);
    let ids = vec![cid(1), cid(1), cid(2), cid(3)];
    let pages = vec![(0, 0), (0, 5), (0, 1), (1, 0)];
    let located = Located {
        hits: vec![(a, 0, 0, 0), (a, 0, 0, 1), (a, 0, 4096, 2), (a, 500, 0, 3)],
        frames_of: vec![meta(400, false), meta(400, false), meta(400, false), meta(60, true)],
    };
    let maps = super::maps::PageMaps::default();
    let g = group_reads(located, ids, &pages, &maps, &Head::none(), &mut [], 1 << 20);
    assert_eq!(g.uids, vec![cid(1), cid(2), cid(3)]);
    assert_eq!(g.slots, vec![NOT_A_RUN; 3]);
    assert_eq!(g.ref_ranges, vec![(0, 2), (2, 3), (3, 4)]);
    assert_eq!(g.refs, vec![(0, 0), (0, 5), (0, 1), (1, 0)]);
    assert_eq!(g.deltas, vec![2]);
    assert_eq!(g.jobs.len(), 1);
    assert_eq!(g.jobs[0].frames[0].chunks, vec![(0, 0), (4096, 1)]);
}
