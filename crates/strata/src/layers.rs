//! The layer rule, as a test: every top-level module of the crate sits on one layer of
//! [`LAYERS`], and a module refers only to modules on layers below its own (and to itself).
//! A module's references are the `crate::NAME` paths (also `crate::{A, B}` groups) and the
//! `super::` paths that climb to the crate root, anywhere in its files: code, tests and
//! comments alike. A `crate::NAME` that is no module (a re-export at the crate root, like
//! `crate::ChunkId`) counts as a violation too: it hides which layer the item comes from.
//! `ARCHITECTURE.md` draws the same table; a test checks that too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Layers from the ground up. A module may use the modules of every lower row.
const LAYERS: &[&[&str]] = &[
    // The ground floor: imports nothing from the crate.
    &["error", "id", "codec", "progress", "endian", "units"],
    // The object stores, page hashing, and the protocols (NBD, QMP), which stand beside the
    // storage stack and use only the ground floor.
    &["backend", "page_hash", "nbd", "qmp"],
    &["store"],
    &["disk", "memory", "host"],
    &["boot"],
    &["serve"],
    // Test support (the `testkit` feature): may use anything below it.
    &["fixtures"],
];

/// Files that are not a module of the crate's layers: the crate root and this checker.
const NOT_LAYERED: &[&str] = &["lib", "layers"];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|row| row.contains(&module))
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let n = s.bytes().take_while(|&b| is_ident(b)).count();
    &s[..n]
}

/// Top-level names a path continuing at `rest` names: one identifier, or the first
/// identifier of every item of a `{...}` group.
fn names_after(rest: &str) -> Vec<&str> {
    let Some(group) = rest.strip_prefix('{') else { return vec![ident(rest)] };
    let (mut out, mut depth, mut start) = (Vec::new(), 0usize, 0usize);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                out.push(ident(group[start..].trim_start()));
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(ident(group[start..i].trim_start()));
                start = i + 1;
            }
            _ => {}
        }
    }
    out.retain(|n| !n.is_empty());
    out
}

/// Top-level names the source text of a file refers to: every name after `crate::`, and the
/// layered modules named by `super::` paths that reach the crate root. `depth` is how many
/// modules deep the file is (`serve.rs`, `disk/mod.rs`: 1; `disk/volume.rs`: 2), so `super::`
/// repeated `depth` times is the crate root (or, inside an inline module such as `mod tests`,
/// the file's own module: hence only layered module names count there).
fn references(text: &str, depth: usize) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let fresh = i == 0 || !(is_ident(b[i - 1]) || b[i - 1] == b'$');
        if fresh && b[i..].starts_with(b"crate::") {
            let names = names_after(&text[i + 7..]).into_iter();
            out.extend(names.filter(|n| !n.is_empty()).map(String::from));
            i += 7;
        } else if fresh && b[i..].starts_with(b"super::") {
            let mut j = i;
            let mut ups = 0;
            while b[j..].starts_with(b"super::") {
                j += 7;
                ups += 1;
            }
            if ups >= depth {
                let names = names_after(&text[j..]).into_iter();
                out.extend(names.filter(|n| layer_of(n).is_some()).map(String::from));
            }
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Each top-level module's references to other top-level modules, with the file that makes
/// each one: module -> (referenced module -> file).
fn module_references() -> BTreeMap<String, BTreeMap<String, String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
        let module = parts[0].trim_end_matches(".rs").to_string();
        if NOT_LAYERED.contains(&module.as_str()) {
            continue;
        }
        let depth = parts.len() - usize::from(parts.last().is_some_and(|l| l == "mod.rs"));
        let text = std::fs::read_to_string(&f).unwrap();
        let refs = out.entry(module.clone()).or_default();
        for r in references(&text, depth) {
            if r != module {
                refs.entry(r).or_insert_with(|| rel.display().to_string());
            }
        }
    }
    out
}

/// The layer rule over `refs`: one line per module missing from the table and per
/// reference to a module that is not on a lower layer.
fn violations(refs: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<String> {
    let mut bad = Vec::new();
    for (m, used) in refs {
        let Some(lm) = layer_of(m) else {
            bad.push(format!("module `{m}` is on no layer: add it to LAYERS and ARCHITECTURE.md"));
            continue;
        };
        for (r, file) in used {
            match layer_of(r) {
                Some(lr) if lr < lm => {}
                Some(lr) => bad.push(format!(
                    "{file}: `{m}` (layer {lm}) refers to `{r}` (layer {lr}), which is not below it"
                )),
                None => bad.push(format!(
                    "{file}: `{m}` refers to `crate::{r}`, which is on no layer: use the path of \
                     the module that defines it"
                )),
            }
        }
    }
    bad
}

#[test]
fn no_module_refers_to_a_module_on_its_own_layer_or_above() {
    let refs = module_references();
    assert!(refs.len() >= 10, "found only {:?} under src/", refs.keys());
    let bad = violations(&refs);
    assert!(bad.is_empty(), "layer violations:\n{}", bad.join("\n"));
}

/// The checker sees every form of reference, and the rule catches a reference upward, one
/// within a layer and a module missing from the table.
#[test]
fn the_checker_sees_every_form_of_reference() {
    let text = "use crate::store::Store;\nuse crate::{id::ChunkId, backend::{self, Backend}};\n\
                // see crate::disk for more\nlet _ = super::super::memory::x; $crate::qmp; \
                notcrate::serve; super::boot; crate::error_chain(e); super::super::Thing";
    let got: Vec<String> = references(text, 2).into_iter().collect();
    assert_eq!(got, ["backend", "disk", "error_chain", "id", "memory", "store"]);
    assert_eq!(names_after("{a, b::{c, d}, e}"), ["a", "b", "e"]);

    let refs = |m: &str, r: &[&str]| {
        let used = r.iter().map(|r| (r.to_string(), format!("{m}.rs"))).collect();
        BTreeMap::from([(m.to_string(), used)])
    };
    assert!(violations(&refs("disk", &["store", "id", "qmp"])).is_empty());
    assert!(violations(&refs("nbd", &["endian"])).is_empty());
    let upward = [refs("store", &["disk"]), refs("disk", &["memory"]), refs("nbd", &["store"])];
    for bad in upward.into_iter().chain([refs("serve", &["ChunkId"])]) {
        assert_eq!(violations(&bad).len(), 1, "{bad:?}");
    }
    assert_eq!(violations(&refs("newmod", &[])).len(), 1);
}

/// ARCHITECTURE.md's layer table (rows `| N | `a`, `b` | ...`) is this file's table.
#[test]
fn architecture_md_draws_the_same_layers() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ARCHITECTURE.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let mut rows: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 3 || !cells[0].is_empty() {
            continue;
        }
        let Ok(n) = cells[1].parse::<usize>() else { continue };
        let mods = cells[2].split(',').map(|m| m.trim().trim_matches('`').to_string());
        rows.entry(n).or_default().extend(mods);
    }
    let want: BTreeMap<usize, BTreeSet<String>> = LAYERS
        .iter()
        .enumerate()
        .map(|(n, row)| (n, row.iter().map(|m| m.to_string()).collect()))
        .collect();
    assert_eq!(rows, want, "the layer table in {} differs from LAYERS", path.display());
}
