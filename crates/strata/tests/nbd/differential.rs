//! Differential test, shared by `file_differential.rs` (this server on a sparse file) and
//! `disk_differential.rs` (a strata disk imported from the same image, with log compactions
//! at random points): the same seeded random sequence of NBD operations goes to our server
//! and to `qemu-nbd` (serving a raw file), and both are checked
//! against an in-memory model. Reads must agree byte for byte wherever the model knows the
//! contents (trimmed bytes are unspecified by the protocol until rewritten), error codes for
//! out-of-range requests must agree, and every extent reported as ZERO must read as zeroes.
//!
//! One known difference: for a WRITE or WRITE_ZEROES past the end this server answers
//! ENOSPC as the spec asks, while qemu-nbd 7.2 answers EINVAL (its `nbd_trip` replies
//! `-EINVAL` for every request that fails validation, discarding the ENOSPC that
//! `nbd_co_receive_request` computed). `same_error` encodes exactly that exception.

#![allow(dead_code)]

use std::path::Path;

use crate::common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata::nbd::proto::*;

/// Our side of the comparison.
pub struct Ours {
    pub server: TestServer,
    /// Folds a strata disk's log into its block map (operation 95); `None` for file exports,
    /// whose operation 95 is a block status query like 96..99.
    pub compact: Option<Box<dyn Fn() -> Result<(), String>>>,
}

const SIZE: u64 = 8 << 20;

/// Results must match, except ours=ENOSPC/qemu=EINVAL for out-of-range writes (see above).
fn same_error(ours: Result<(), u32>, theirs: Result<(), u32>, write_past_end: bool, ctx: &str) {
    if write_past_end {
        assert_eq!(ours, Err(28), "our write past the end must be ENOSPC: {ctx}");
        assert!(matches!(theirs, Err(28) | Err(22)), "qemu-nbd: {theirs:?}: {ctx}");
    } else {
        assert_eq!(ours, theirs, "results differ: {ctx}");
    }
}

struct Model {
    data: Vec<u8>,
    known: Vec<bool>,
}

impl Model {
    fn check(&self, what: &str, offset: u64, got: &[u8]) {
        for (i, b) in got.iter().enumerate() {
            let at = offset as usize + i;
            if self.known[at] && self.data[at] != *b {
                panic!("{what}: byte {at} is {b:#x}, model says {:#x}", self.data[at]);
            }
        }
    }
}

/// Run `ops` seeded random operations against both servers. `start_ours` serves the file
/// `ours.raw` (already holding the initial image) as export "d".
pub fn run_sequence(
    seed: u64,
    structured: bool,
    ops: usize,
    start_ours: impl FnOnce(&Path, &Path) -> Ours,
) {
    let dir = tempfile::tempdir().unwrap();
    let ours_path = dir.path().join("ours.raw");
    let theirs_path = dir.path().join("theirs.raw");
    let init = pattern(seed, SIZE as usize / 2);
    for p in [&ours_path, &theirs_path] {
        let mut v = init.clone();
        v.resize(SIZE as usize, 0); // second half sparse
        std::fs::write(p, &v).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        f.set_len(SIZE).unwrap();
    }
    let mut model = Model { data: init.clone(), known: vec![true; SIZE as usize] };
    model.data.resize(SIZE as usize, 0);

    let ours_side = start_ours(dir.path(), &ours_path);
    let server = &ours_side.server;
    let qsock = dir.path().join("q.sock");
    let _q = QemuNbd::start(
        &theirs_path,
        &qsock,
        "d",
        &["--discard=unmap", "--cache=none", "--aio=threads"],
    );

    let mut ours = Client::connect(&server.sock, "d", structured, structured).unwrap();
    let mut theirs = Client::connect(&qsock, "d", structured, structured).unwrap();
    assert_eq!(ours.size, theirs.size);

    let mut rng = StdRng::seed_from_u64(seed);
    let mut counts = [0usize; 8];
    for step in 0..ops {
        let op = rng.gen_range(0..100);
        let len = match rng.gen_range(0..4) {
            0 => rng.gen_range(1..=512),
            1 => rng.gen_range(1..=8) * 4096,
            2 => rng.gen_range(1..=262_144),
            _ => rng.gen_range(1..=65_536),
        } as u32;
        let out_of_range = rng.gen_ratio(1, 25);
        let offset = if out_of_range {
            SIZE - rng.gen_range(0..len as u64).min(SIZE)
        } else {
            rng.gen_range(0..=SIZE - len as u64)
        };
        let ctx = format!(
            "seed {seed} step {step} op {op} offset {offset} len {len} structured {structured}"
        );
        match op {
            0..=34 => {
                counts[0] += 1;
                let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                let fua = if rng.gen_ratio(1, 10) { CMD_FLAG_FUA } else { 0 };
                let a = ours.write(offset, &data, fua);
                let b = theirs.write(offset, &data, fua);
                same_error(a, b, out_of_range, &ctx);
                if a.is_ok() {
                    model.data[offset as usize..offset as usize + len as usize]
                        .copy_from_slice(&data);
                    model.known[offset as usize..offset as usize + len as usize].fill(true);
                }
            }
            35..=69 => {
                counts[1] += 1;
                let a = ours.read(offset, len);
                let b = theirs.read(offset, len);
                match (&a, &b) {
                    (Ok(x), Ok(y)) => {
                        model.check(&format!("our read, {ctx}"), offset, x);
                        model.check(&format!("qemu-nbd read, {ctx}"), offset, y);
                    }
                    _ => assert_eq!(a.err(), b.err(), "read result differs: {ctx}"),
                }
            }
            70..=79 => {
                counts[2] += 1;
                let a = ours.simple(Command::Trim, 0, offset, len);
                let b = theirs.simple(Command::Trim, 0, offset, len);
                assert_eq!(a, b, "trim result differs: {ctx}");
                if a.is_ok() {
                    model.known[offset as usize..offset as usize + len as usize].fill(false);
                }
            }
            80..=91 => {
                counts[3] += 1;
                let flags = if rng.gen_bool(0.5) { CMD_FLAG_NO_HOLE } else { 0 };
                let a = ours.simple(Command::WriteZeroes, flags, offset, len);
                let b = theirs.simple(Command::WriteZeroes, flags, offset, len);
                same_error(a, b, out_of_range, &ctx);
                if a.is_ok() {
                    model.data[offset as usize..offset as usize + len as usize].fill(0);
                    model.known[offset as usize..offset as usize + len as usize].fill(true);
                }
            }
            92..=94 => {
                counts[4] += 1;
                assert_eq!(ours.simple(Command::Flush, 0, 0, 0), Ok(()), "{ctx}");
                assert_eq!(theirs.simple(Command::Flush, 0, 0, 0), Ok(()), "{ctx}");
            }
            95 if ours_side.compact.is_some() => {
                counts[7] += 1;
                // Fold the log into the block map mid-sequence (what snapshots and the size
                // threshold trigger); data must not change.
                if let Some(compact) = &ours_side.compact {
                    compact().unwrap_or_else(|e| panic!("compaction failed: {e}: {ctx}"));
                }
            }
            _ if structured && !out_of_range => {
                counts[5] += 1;
                // Every extent marked ZERO must read back as zeroes on that server.
                for (name, c) in [("ours", &mut ours), ("qemu-nbd", &mut theirs)] {
                    let st = c
                        .block_status(offset, len, 0)
                        .unwrap_or_else(|e| panic!("{name} block status errno {e}: {ctx}"));
                    let mut at = offset;
                    for d in st {
                        let n = (d.len as u64).min(SIZE - at).min(offset + len as u64 - at);
                        if n == 0 {
                            break;
                        }
                        if d.flags & STATE_ZERO != 0 {
                            let got = c.read(at, n as u32).unwrap();
                            assert!(
                                got.iter().all(|&b| b == 0),
                                "{name}: extent at {at}+{n} flagged ZERO is not zero: {ctx}"
                            );
                            model.check(&format!("{name} zero extent, {ctx}"), at, &got);
                        }
                        at += n;
                    }
                }
            }
            _ => counts[6] += 1,
        }
    }
    // Final full comparison in 1 MiB pieces.
    for off in (0..SIZE).step_by(1 << 20) {
        let a = ours.read(off, 1 << 20).unwrap();
        let b = theirs.read(off, 1 << 20).unwrap();
        model.check("final, ours", off, &a);
        model.check("final, qemu-nbd", off, &b);
    }
    eprintln!("seed {seed} structured {structured}: write/read/trim/zero/flush/status/skip/compact = {counts:?}");
    assert!(counts[0] > ops / 5 && counts[1] > ops / 5, "sequence did too little: {counts:?}");
    ours.disconnect();
    theirs.disconnect();
}
