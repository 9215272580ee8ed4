//! The pool's side of the pipeline: each worker takes a batch, detects zero pages, hashes the
//! rest 16 at a time, offers new pages to the delta sink and stores the others in frames.
//! Apart from the parse side (`dispatch.rs`): the two only share the batch queue and `Shared`.

use super::*;

/// All-zero test that the compiler vectorises (an OR-fold per 64-byte block).
pub(crate) fn is_zero(page: &[u8]) -> bool {
    page.chunks(64).all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0)
}

pub(super) fn worker(sh: &Shared<'_>, rx: &Mutex<Receiver<Batch>>, free: &SyncSender<Vec<u8>>) {
    let mut ids: Vec<ChunkId> = Vec::new();
    let mut nonzero: Vec<usize> = Vec::new();
    let mut hashed: Vec<ChunkId> = Vec::new();
    let mut fresh: Vec<u8> = Vec::with_capacity(sh.frame_pages * PAGE_SIZE);
    let mut dw = DeltaWorker::default();
    loop {
        let t_wait = std::time::Instant::now();
        let got = rx.lock().recv();
        sh.idle_ns.fetch_add(t_wait.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let batch = match got {
            Ok(b) => b,
            Err(_) => break,
        };
        if sh.failed.load(Ordering::Relaxed) {
            let _ = free.try_send(batch.data);
            continue;
        }
        // Zero pages get the zero id; the others are hashed together, 16 per SIMD pass.
        ids.clear();
        ids.resize(batch.pages.len(), ChunkId::ZERO);
        nonzero.clear();
        let mut zeros = 0;
        for (i, page) in batch.data.chunks_exact(PAGE_SIZE).take(batch.pages.len()).enumerate() {
            if is_zero(page) {
                zeros += 1;
            } else {
                nonzero.push(i);
            }
        }
        {
            let pages: Vec<&[u8; PAGE_SIZE]> = nonzero
                .iter()
                .map(|&i| as_page(&batch.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]).expect("page"))
                .collect();
            hashed.clear();
            hashed.resize(pages.len(), ChunkId::ZERO);
            hash_pages(&pages, &mut hashed);
            for (&i, id) in nonzero.iter().zip(&hashed) {
                ids[i] = *id;
            }
        }
        sh.zero_content.fetch_add(zeros, Ordering::Relaxed);
        // Frames of up to `frame_pages` non-zero pages, in stream order.
        let mut items: Vec<(ChunkId, &[u8])> = Vec::with_capacity(sh.frame_pages);
        let pages: Vec<&[u8]> = batch.data.chunks_exact(PAGE_SIZE).take(batch.pages.len()).collect();
        let mut ok = true;
        let mut flush = |items: &mut Vec<(ChunkId, &[u8])>| -> bool {
            if items.is_empty() {
                return true;
            }
            // The codec chooser measures (on sampled frames only) bytes the store does not
            // hold yet, as the store will pick them (absent, each once), and the store then
            // keeps the sample's output for the chosen codec instead of compressing again.
            fresh.clear();
            let mut fresh_ids: Vec<ChunkId> = Vec::new();
            if sh.chooser.wants_sample() {
                let store = sh.session.store();
                for (id, d) in items.iter() {
                    if !store.contains(id) && !fresh_ids.contains(id) {
                        fresh.extend_from_slice(d);
                        fresh_ids.push(*id);
                    }
                }
            }
            let (codec, sampled) = sh.chooser.codec_for_frame(&fresh);
            let pre = sampled.map(|stored| Precompressed { ids: fresh_ids, stored });
            sh.frames.fetch_add(1, Ordering::Relaxed);
            let t_put = std::time::Instant::now();
            let r = sh.session.put_frame_pre(items, ChunkKind::Data, codec, pre);
            sh.put_ns.fetch_add(t_put.elapsed().as_nanos() as u64, Ordering::Relaxed);
            items.clear();
            match r {
                Ok(n) => {
                    sh.new_chunks.fetch_add(n as u64, Ordering::Relaxed);
                    sh.maybe_flush();
                    true
                }
                Err(e) => {
                    sh.fail(e);
                    false
                }
            }
        };
        let read_base = sh.delta.as_ref().is_some_and(|d| dw.batch_start(d));
        let mut as_delta: Vec<(usize, ChunkId)> = Vec::new();
        for (i, ((id, page), &(block, page_no, _))) in ids.iter().zip(&pages).zip(&batch.pages).enumerate() {
            if id.is_zero() {
                continue;
            }
            // A page new to the store may be kept as a delta against the base checkpoint:
            // its map entry is then the delta record's id.
            if let Some(d) = &sh.delta {
                if !sh.session.store().contains(id) {
                    if let Some(rid) = dw.offer(d, sh.session, *id, block, page_no, page, read_base) {
                        as_delta.push((i, rid));
                        continue;
                    }
                }
            }
            items.push((*id, page));
            if items.len() == sh.frame_pages && !flush(&mut items) {
                ok = false;
                break;
            }
        }
        if ok && !flush(&mut items) {
            ok = false;
        }
        if let Some(d) = &sh.delta {
            if read_base {
                dw.batch_end();
            }
            if ok {
                if let Err(e) = dw.flush(d, sh.session) {
                    sh.fail(e);
                    ok = false;
                }
            }
        }
        for (i, rid) in as_delta {
            ids[i] = rid;
        }
        if ok {
            let mut map = sh.map.lock();
            for ((block, page, rec), id) in batch.pages.iter().zip(&ids) {
                map.set(*block, *page, *rec, *id);
            }
        }
        let _ = free.try_send(batch.data);
    }
}
