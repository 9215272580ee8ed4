//! `strata inspect`: print one stored object, decoded, with its format version.

use anyhow::{bail, Context, Result};
use serde_json::json;
use strata::store::objects::{Ref, StoreConfig, Tree};
use strata::store::pack::{
    parse_pack, parse_pack_footer, ChunkKind, IndexObject, PackEntry, PACK_VERSION_RAW,
};
use strata::store::Store;
use strata::{ChunkId, PackId};

fn version_at(b: &[u8], off: usize) -> u16 {
    strata::endian::le16_at(b, off).unwrap_or(0)
}

/// How a pack's or index object's entry table of `version` is stored.
fn table_encoding(version: u16) -> &'static str {
    if version == PACK_VERSION_RAW {
        "raw"
    } else {
        "zstd"
    }
}

fn entry_json(e: &PackEntry) -> serde_json::Value {
    json!({
        "chunk": e.id.to_hex(), "frame_offset": e.frame_off, "frame_len": e.frame_len,
        "frame_raw_len": e.frame_raw_len, "offset_in_frame": e.off_in_frame, "raw_len": e.raw_len,
        "codec": e.codec.to_string(), "kind": format!("{:?}", e.kind).to_lowercase(),
        "frame_crc32c": format!("{:08x}", e.frame_crc),
    })
}

pub fn run(s: &Store, kind: &str, what: Option<&str>, as_json: bool) -> Result<()> {
    let be = s.backend();
    let need = || what.context("Name the object: strata inspect KIND NAME-OR-ID");
    let pack_id = |w: &str| {
        PackId::from_hex(w).with_context(|| {
            format!("'{w}' is not a 32-digit hex pack id (see `strata inspect chunk ID`)")
        })
    };
    let v = match kind {
        "config" => {
            let b = be.get("config")?;
            let c = StoreConfig::decode(&b)?;
            json!({"object": "config", "format_version": c.version, "store_id": hex(&c.store_id), "settings": c.settings})
        }
        "ref" => {
            let name = need()?;
            let key = format!("refs/{name}");
            let b = be
                .get(&key)
                .with_context(|| format!("No ref '{name}' (list them with `strata refs`)"))?;
            let r = Ref::decode(&b)?;
            json!({
                "object": key, "format_version": version_at(&b, 8), "bytes": b.len(), "generation": r.generation,
                "roots": r.roots.iter().map(|r| r.to_hex()).collect::<Vec<_>>(),
                "payload": String::from_utf8(r.payload.clone()).map(serde_json::Value::String)
                    .unwrap_or_else(|_| json!(hex(&r.payload))),
            })
        }
        "pack" => {
            let id = pack_id(need()?)?;
            let b = be.get(&id.pack_key())?;
            let (pid, entries) = parse_pack(&b)?;
            let f = parse_pack_footer(&b[b.len() - 32..], b.len() as u64)?;
            json!({
                "object": id.pack_key(), "format_version": version_at(&b, 8), "pack_id": pid.to_hex(),
                "bytes": b.len(), "chunks": entries.len(),
                "entry_table": table_encoding(version_at(&b, 8)), "entry_table_bytes": f.trailer_len,
                "entries": entries.iter().take(64).map(entry_json).collect::<Vec<_>>(),
                "entries_shown": entries.len().min(64),
            })
        }
        "index" => {
            let id = pack_id(need()?)?;
            let b = match be.get(&id.index_key()) {
                Err(e)
                    if e.is_not_found()
                        && be.capabilities().network
                        && be.get_range(&id.pack_key(), 0, 32).is_ok() =>
                {
                    bail!("Pack {id} has no index object: on a network backend a pack is its own index; use `strata inspect pack {id}`")
                }
                r => r?,
            };
            let i = IndexObject::decode(&b)?;
            json!({
                "object": id.index_key(), "format_version": version_at(&b, 8), "pack_size": i.pack_size,
                "chunks": i.entries.len(),
                "entry_table": table_encoding(version_at(&b, 8)), "entry_table_bytes": b.len() - 48,
                "entries": i.entries.iter().take(64).map(entry_json).collect::<Vec<_>>(),
            })
        }
        "chunk" => {
            let w = need()?;
            let id = ChunkId::from_hex(w)
                .with_context(|| format!("'{w}' is not a 64-digit hex chunk id"))?;
            let Some((pid, e)) = s.locate(&id) else { bail!("Chunk {id} is not in the store") };
            let data = s.get(&id)?;
            let mut v = json!({"object": "chunk", "pack": pid.to_hex(), "location": entry_json(&e), "verified": true});
            if e.kind == ChunkKind::Tree {
                let t = Tree::decode(&data)?;
                v["tree"] = json!({
                    "format_version": version_at(&data, 4), "children": t.children.len(),
                    "holes": t.children.iter().filter(|c| c.is_zero()).count(), "payload_bytes": t.payload.len(),
                });
            }
            v
        }
        other => bail!("Unknown object kind '{other}': use config, ref, pack, index or chunk"),
    };
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_human(&v, 0);
    }
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn print_human(v: &serde_json::Value, depth: usize) {
    let pad = "  ".repeat(depth);
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match x {
                    serde_json::Value::Object(_) | serde_json::Value::Array(_) => {
                        println!("{pad}{k}:");
                        print_human(x, depth + 1);
                    }
                    _ => println!("{pad}{k}: {}", x.to_string().trim_matches('"')),
                }
            }
        }
        serde_json::Value::Array(a) => {
            for x in a {
                if x.is_object() {
                    println!("{pad}-");
                    print_human(x, depth + 1);
                } else {
                    println!("{pad}- {}", x.to_string().trim_matches('"'));
                }
            }
        }
        other => println!("{pad}{other}"),
    }
}
