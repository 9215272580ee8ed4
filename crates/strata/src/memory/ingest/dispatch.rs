//! The parse thread's side of the pipeline: the stream sink that copies pages into batches for
//! the pool, records ZERO pages in the map and holds re-sent (hot) pages back until the end.
//! Apart from the pool (`pool.rs`): the two only share the batch queue and `Shared`.

use super::*;
use crate::memory::manifest::RUN_PAGES;

/// A re-sent page held back until the stream ends: (record number, content).
type HeldPage = (u64, Box<[u8; PAGE_SIZE]>);

/// Pages a batch can hold: [`Dispatch::push`] ends one at `batch_pages` pages, or up to
/// [`RUN_PAGES`] later at the end of an aligned group. Allocated whole, so a fresh buffer never
/// grows (a 1 MiB buffer grown to 2 MiB copies itself and faults in another 1.1 MiB, for ~8
/// fresh buffers a save).
pub(super) fn batch_capacity(batch_pages: usize) -> usize {
    batch_pages + RUN_PAGES
}

/// The parse thread's sink: copies pages into batches, records ZERO pages.
pub(super) struct Dispatch<'a, 'p> {
    pub(super) sh: &'a Shared<'a>,
    pub(super) tx: SyncSender<Batch>,
    pub(super) free: &'a Receiver<Vec<u8>>,
    pub(super) cur: Batch,
    pub(super) zeros: Vec<(u32, u32, u64)>,
    pub(super) rec: u64,
    pub(super) batch_pages: usize,
    /// Batches handed to the pool so far (the first [`RAMP_BATCHES`] are smaller).
    pub(super) sent: u64,
    pub(super) progress: &'p dyn Progress,
    pub(super) pending_progress: u64,
    /// Pages seen once already (one bit per page).
    pub(super) seen: Vec<Vec<u64>>,
    /// Re-sent pages held back: (block, page) -> (record number, content).
    pub(super) hot: std::collections::HashMap<(u32, u32), HeldPage>,
    pub(super) hot_cap: usize,
    pub(super) superseded: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("The storing pipeline stopped")]
struct PipelineStopped;

impl<'a, 'p> Dispatch<'a, 'p> {
    /// The dispatcher of a new stream, sending batches of `batch_pages` on `tx`.
    pub(super) fn new(
        sh: &'a Shared<'a>,
        tx: SyncSender<Batch>,
        free: &'a Receiver<Vec<u8>>,
        batch_pages: usize,
        hot_cap: usize,
        progress: &'p dyn Progress,
    ) -> Dispatch<'a, 'p> {
        Dispatch {
            sh,
            tx,
            free,
            cur: Batch {
                data: Vec::with_capacity(batch_capacity(batch_pages) * PAGE_SIZE),
                pages: Vec::with_capacity(batch_capacity(batch_pages)),
            },
            zeros: Vec::new(),
            rec: 0,
            batch_pages,
            sent: 0,
            progress,
            pending_progress: 0,
            seen: Vec::new(),
            hot: std::collections::HashMap::new(),
            hot_cap,
            superseded: 0,
        }
    }

    fn new_buffer(&self) -> Vec<u8> {
        match self.free.try_recv() {
            Ok(mut v) => {
                v.clear();
                v
            }
            Err(_) => Vec::with_capacity(batch_capacity(self.batch_pages) * PAGE_SIZE),
        }
    }

    pub(super) fn send(&mut self) -> Result<(), SinkError> {
        self.flush_zeros();
        if self.cur.pages.is_empty() {
            return Ok(());
        }
        let data = self.new_buffer();
        let full = std::mem::replace(
            &mut self.cur,
            Batch { data, pages: Vec::with_capacity(batch_capacity(self.batch_pages)) },
        );
        let t_send = std::time::Instant::now();
        let sent = !self.sh.failed.load(Ordering::Relaxed) && self.tx.send(full).is_ok();
        self.sh.queue_ns.fetch_add(t_send.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if !sent {
            return Err(Box::new(PipelineStopped));
        }
        Ok(())
    }

    fn flush_zeros(&mut self) {
        if self.zeros.is_empty() {
            return;
        }
        let mut map = self.sh.map.lock();
        for (b, p, r) in self.zeros.drain(..) {
            map.set(b, p, r, ChunkId::ZERO);
        }
    }

    fn tick(&mut self) {
        self.pending_progress += PAGE_SIZE as u64;
        if self.pending_progress >= 4 << 20 {
            self.progress.advance(self.pending_progress);
            self.pending_progress = 0;
        }
    }

    /// A page record arrived: hold it back if the page was sent before (precopy will likely
    /// send it again), else queue it for the pool.
    fn page_record(
        &mut self,
        block: u32,
        page: u32,
        data: &[u8; PAGE_SIZE],
    ) -> Result<(), SinkError> {
        self.rec += 1;
        self.tick();
        let rec = self.rec;
        let Some(word) =
            self.seen.get_mut(block as usize).and_then(|v| v.get_mut(page as usize / 64))
        else {
            return self.push(block, page, rec, data);
        };
        let bit = 1u64 << (page % 64);
        if *word & bit == 0 {
            *word |= bit;
            return self.push(block, page, rec, data);
        }
        if let Some(slot) = self.hot.get_mut(&(block, page)) {
            self.superseded += 1;
            slot.0 = rec;
            slot.1.copy_from_slice(data);
            return Ok(());
        }
        if (self.hot.len() + 1) * PAGE_SIZE <= self.hot_cap {
            self.hot.insert((block, page), (rec, Box::new(*data)));
            return Ok(());
        }
        self.push(block, page, rec, data)
    }

    fn push(&mut self, block: u32, page: u32, rec: u64, data: &[u8]) -> Result<(), SinkError> {
        self.cur.data.extend_from_slice(data);
        self.cur.pages.push((block, page, rec));
        let target = if self.sent < RAMP_BATCHES {
            (self.batch_pages / 4).max(16)
        } else {
            self.batch_pages
        };
        // A batch ends at the end of an aligned group of RUN_PAGES pages (or one group
        // later), so a group that could be a run chunk (`pool.rs`) is not cut in two.
        let n = self.cur.pages.len();
        if n >= target && (page as usize % RUN_PAGES == RUN_PAGES - 1 || n >= target + RUN_PAGES) {
            self.sent += 1;
            self.send()?;
        }
        Ok(())
    }

    /// Queue the held-back pages (at the end of the stream).
    pub(super) fn flush_hot(&mut self) -> Result<(), SinkError> {
        let mut hot: Vec<_> = self.hot.drain().collect();
        hot.sort_unstable_by_key(|(k, _)| *k);
        for ((b, p), (rec, data)) in hot {
            self.push(b, p, rec, &data[..])?;
        }
        Ok(())
    }
}

impl StreamSink for Dispatch<'_, '_> {
    fn event(&mut self, ev: Event<'_>) -> Result<(), SinkError> {
        match ev {
            Event::RamBlocks(blocks) => {
                if let Some(d) = &self.sh.delta {
                    d.set_blocks(
                        &blocks.iter().map(|b| (b.name.clone(), b.used_len)).collect::<Vec<_>>(),
                    );
                }
                self.seen =
                    blocks.iter().map(|b| vec![0u64; (b.pages() as usize).div_ceil(64)]).collect();
                let mut map = self.sh.map.lock();
                map.ids = blocks.iter().map(|b| vec![ChunkId::ZERO; b.pages() as usize]).collect();
                map.recs = blocks.iter().map(|b| vec![0u64; b.pages() as usize]).collect();
                let total: u64 = blocks.iter().map(|b| b.used_len).sum();
                self.progress.phase("receiving", Some(total), Unit::Bytes);
            }
            Event::Page { block, offset, data } => {
                self.page_record(block.0, (offset / PAGE_SIZE as u64) as u32, data)?;
            }
            Event::Zero { block, offset, fill } => {
                let page = (offset / PAGE_SIZE as u64) as u32;
                if fill == 0 {
                    self.rec += 1;
                    let bit = 1u64 << (page % 64);
                    let seen_before = match self
                        .seen
                        .get_mut(block.get())
                        .and_then(|v| v.get_mut(page as usize / 64))
                    {
                        Some(w) => std::mem::replace(w, *w | bit) & bit != 0,
                        None => true,
                    };
                    self.zeros.push((block.0, page, self.rec));
                    self.tick();
                    // A held-back version is superseded by this zero page. Only a page sent
                    // before can be held back: a first-time zero page (most of an idle guest's
                    // RAM, ~100k records at 512 MiB) skips the hash lookup (~2 ms of the parse
                    // thread's ~25 ms per such save, `perf`).
                    if seen_before
                        && !self.hot.is_empty()
                        && self.hot.remove(&(block.0, page)).is_some()
                    {
                        self.superseded += 1;
                    }
                    if self.zeros.len() >= 4096 {
                        self.flush_zeros();
                    }
                } else {
                    self.page_record(block.0, page, &[fill; PAGE_SIZE])?;
                }
            }
            Event::SectionEnd { .. } => {
                // Hand over partial batches at section ends so the pool never idles while
                // QEMU is between passes.
                self.send()?;
            }
            _ => {}
        }
        Ok(())
    }
}
