//! Replaying a boot's reads with N concurrent NBD clients: the boot storm with the guests'
//! CPU taken out (on a 2-core machine, ten TCG guests measure the CPU, not the storage).
//!
//! Each client connects to its own export (a clone per client, as in a real storm, or one
//! shared export for a server like qemu-nbd serving a golden image), waits at a barrier so all
//! start together, then sends the trace's reads in their recorded order as fast as the server
//! answers, keeping up to `depth` requests in flight (the guest's queue: the trace records how
//! many of its requests were in flight). Think time is left out on purpose: it is guest CPU.
//! Reads longer than the NBD cap are split.
//!
//! Every client folds what it read into a digest that does not depend on reply order, so a
//! benchmark can check that all clients, and all servers compared, returned the same bytes.

use crate::nbd::client::{Client, ClientError, Target, Violation};
use std::sync::Barrier;
use std::time::Instant;

/// Longest single read sent (the NBD server caps requests at 32 MiB).
const MAX_READ: u64 = 32 << 20;

/// What one client did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ClientRun {
    pub export: String,
    /// From the common start to this client's last reply.
    pub secs: f64,
    /// From launching the clients to the common start: connecting, which opens the exports
    /// (and may start server-side work such as a boot prefetch before `secs` starts).
    pub connect_secs: f64,
    pub requests: u64,
    pub bytes: u64,
    /// Order-independent digest of the bytes read (equal across clients of the same content).
    pub digest: u64,
}

/// Split reads at the NBD request cap.
pub fn requests(reads: &[(u64, u64)]) -> Vec<(u64, u32)> {
    let mut out = Vec::with_capacity(reads.len());
    for &(off, len) in reads {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(MAX_READ);
            out.push((off + done, n as u32));
            done += n;
        }
    }
    out
}

fn mix(i: u64, crc: u32) -> u64 {
    // splitmix64 of the request index and its CRC: summing these is order-independent.
    let mut z = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((crc as u64) << 17) ^ crc as u64;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Replay `reqs` on one connected client. Returns (requests, bytes, digest).
pub fn run_one(
    c: &mut Client,
    reqs: &[(u64, u32)],
    depth: usize,
) -> Result<(u64, u64, u64), ClientError> {
    let depth = depth.max(1);
    let mut index_of = std::collections::HashMap::with_capacity(depth * 2);
    let (mut next, mut done, mut bytes, mut digest) = (0usize, 0usize, 0u64, 0u64);
    let mut buf = Vec::new();
    while done < reqs.len() {
        while next < reqs.len() && c.in_flight() < depth {
            let (off, len) = reqs[next];
            let h = c.send_read(off, len)?;
            index_of.insert(h, next as u64);
            next += 1;
        }
        let h = c.recv(&mut buf)?;
        let i = index_of.remove(&h).unwrap_or(u64::MAX);
        digest = digest.wrapping_add(mix(i, crc32c::crc32c(&buf)));
        bytes += buf.len() as u64;
        done += 1;
    }
    Ok((reqs.len() as u64, bytes, digest))
}

/// Replay the same reads with one client per (target, export), all starting together.
pub fn replay(
    clients: &[(Target, String)],
    reads: &[(u64, u64)],
    depth: usize,
) -> Result<Vec<ClientRun>, ClientError> {
    let reqs = requests(reads);
    let barrier = Barrier::new(clients.len());
    let start = std::sync::OnceLock::new();
    let launched = Instant::now();
    let results: Vec<Result<ClientRun, ClientError>> = std::thread::scope(|s| {
        let hs: Vec<_> = clients
            .iter()
            .map(|(target, export)| {
                let (reqs, barrier, start, launched) = (&reqs, &barrier, &start, &launched);
                s.spawn(move || -> Result<ClientRun, ClientError> {
                    let conn = Client::connect(target, export);
                    // Everyone passes the barrier even if its connect failed, so no one hangs.
                    barrier.wait();
                    let mut c = conn?;
                    let t0: &Instant = start.get_or_init(Instant::now);
                    let (requests, bytes, digest) = run_one(&mut c, reqs, depth)?;
                    let secs = t0.elapsed().as_secs_f64();
                    let connect_secs = t0.duration_since(*launched).as_secs_f64();
                    c.disconnect()?;
                    Ok(ClientRun {
                        export: export.clone(),
                        secs,
                        connect_secs,
                        requests,
                        bytes,
                        digest,
                    })
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or(Err(ClientError::Protocol(Violation::ThreadPanicked))))
            .collect()
    });
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_reads_are_split_at_the_cap() {
        let r = requests(&[(0, 4096), (1 << 20, (70 << 20) + 5), (7, 0)]);
        assert_eq!(
            r,
            vec![
                (0, 4096),
                (1 << 20, 32 << 20),
                ((1 << 20) + (32 << 20), 32 << 20),
                ((1 << 20) + (64 << 20), (6 << 20) + 5)
            ]
        );
    }

    #[test]
    fn digest_ignores_reply_order_but_not_content() {
        let a = mix(0, 1).wrapping_add(mix(1, 2));
        let b = mix(1, 2).wrapping_add(mix(0, 1));
        assert_eq!(a, b);
        assert_ne!(a, mix(0, 2).wrapping_add(mix(1, 1)));
    }
}
