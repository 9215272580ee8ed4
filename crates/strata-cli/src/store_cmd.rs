//! The store-wide commands: `strata init`, `check`, `du` and `gc`. Each opens the store,
//! calls one library function and prints its report (text, or JSON with `--json`).

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use strata::store::check::CheckOptions;
use strata::store::InitOptions;
use strata::Codec;

use crate::{control, open, parse_size, store_location, ui, Cli};

#[derive(Args)]
pub struct InitArgs {
    /// Codec for writers that don't choose: none, lz4, zstd[:LEVEL].
    #[arg(long, default_value = "lz4")]
    pub codec: String,
    /// Target pack size, e.g. 32M (default: what the backend prefers, see docs/backends.md).
    #[arg(long)]
    pub pack_size: Option<String>,
    /// s3://BUCKET[/PREFIX] (endpoint and credentials from AWS_ENDPOINT_URL,
    /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP) or
    /// redis://HOST:PORT.
    #[arg(long)]
    pub backend: Option<String>,
    /// Host-local SSD cache directory in front of a remote backend.
    #[arg(long, requires = "cache_size")]
    pub cache: Option<PathBuf>,
    /// Size of the cache file, e.g. 20G.
    #[arg(long, requires = "cache")]
    pub cache_size: Option<String>,
}

/// `strata init`: create the store, or join the one the remote backend holds.
pub fn init(cli: &Cli, args: &InitArgs) -> Result<()> {
    let InitArgs { codec, pack_size, backend, cache, cache_size } = args;
    let loc = store_location(&cli.store);
    let codec: Codec = codec.parse()?;
    let pack_size = pack_size.as_deref().map(parse_size).transpose()?.unwrap_or(0);
    let cache = match (cache, cache_size) {
        (Some(dir), Some(size)) => {
            Some(strata::host::CacheConfig { dir: dir.clone(), size: parse_size(size)? })
        }
        _ => None,
    };
    let (h, created) = strata::host::init(
        &loc,
        backend.as_deref(),
        cache,
        InitOptions { pack_size, default_codec: codec },
    )
    .with_context(|| {
        format!(
            "Cannot create store at {}",
            backend.as_deref().unwrap_or(&loc.display().to_string())
        )
    })?;
    let where_ = h.store.location().to_string();
    let cfg = h.store.config().settings.clone();
    let cache_dir = h.config.as_ref().and_then(|c| c.cache.clone());
    h.store.close()?;
    ui::emit(
        cli.json,
        &serde_json::json!({"store": loc, "backend": where_, "created": created, "codec": cfg.default_codec,
            "pack_size": cfg.pack_size, "cache": cache_dir}),
        || {
            let verb =
                if created { "Created strata store" } else { "Joined the existing strata store" };
            let mut t = format!(
                "{verb} in {where_} (codec {}, packs of {} bytes)",
                cfg.default_codec, cfg.pack_size
            );
            if h.config.is_some() {
                t += &format!("\nThis host's state is in {}", loc.display());
            }
            if let Some(c) = &cache_dir {
                t += &format!("; SSD cache of {} in {}", ui::human(c.size), c.dir.display());
            }
            t
        },
    );
    Ok(())
}

/// `strata check`: verify the store; exits 1 on damage.
pub fn check(cli: &Cli, quick: bool) -> Result<()> {
    let s = open(cli)?;
    let p = ui::bar(cli.json);
    let rep = s.check(CheckOptions { read_data: !quick }, &p)?;
    drop(p);
    ui::emit(cli.json, &rep, || {
        let mut out = format!(
            "Checked {} packs, {} chunks, {} refs ({} bytes read)\n",
            rep.packs, rep.chunks, rep.refs, rep.bytes_read
        );
        for pr in &rep.problems {
            let sev = match pr.severity {
                strata::store::check::Severity::Error => "ERROR",
                strata::store::check::Severity::Warning => "warning",
            };
            out += &format!("{sev}: {}: {}", pr.object, pr.message);
            if !pr.refs.is_empty() {
                out += &format!(" [used by: {}]", pr.refs.join(", "));
            }
            out.push('\n');
        }
        out += if rep.is_damaged() { "Store is DAMAGED" } else { "No damage found" };
        out
    });
    if rep.is_damaged() {
        std::process::exit(1);
    }
    Ok(())
}

/// `strata du`: logical, unique and stored bytes, per ref and in total.
pub fn du(cli: &Cli) -> Result<()> {
    let s = open(cli)?;
    let u = s.du()?;
    ui::emit(cli.json, &u, || {
        let mut out = String::new();
        for r in &u.refs {
            out += &format!("{:>12}  {}\n", ui::human(r.logical_bytes), r.name);
        }
        out += &format!(
            "logical {}  unique {}  stored {}  (dedup {:.2}x, compression {:.2}x)\nchunks {}  packs {}  unreachable {} in {} chunks (run `strata gc`)",
            ui::human(u.logical_bytes),
            ui::human(u.unique_bytes),
            ui::human(u.stored_bytes),
            u.dedup_ratio,
            u.compression_ratio,
            u.chunks,
            u.packs,
            ui::human(u.unreachable_bytes),
            u.unreachable_chunks
        );
        out
    });
    Ok(())
}

/// `strata gc`: through the running `strata serve` if there is one, else in this process.
pub fn gc(cli: &Cli) -> Result<()> {
    // A running `strata serve` keeps the store open, so it runs the GC itself.
    let local = store_location(&cli.store).join(".meta");
    let gc = control::request(&local, &serde_json::json!({"op": "gc"}))
        .context("The serving daemon could not run the GC")?;
    let r = match gc {
        Some(r) => r,
        None => {
            let s = open(cli)?;
            let p = ui::bar(cli.json);
            let r = s.gc(&p)?;
            drop(p);
            serde_json::to_value(r)?
        }
    };
    let n = |k: &str| r[k].as_u64().unwrap_or(0);
    ui::emit(cli.json, &r, || {
        format!(
            "Collected {} dead chunks: {} packs deleted, {} repacked, {} orphan packs removed, {} freed",
            n("dead_chunks"),
            n("packs_deleted"),
            n("packs_repacked"),
            n("orphan_packs_deleted"),
            ui::human(n("bytes_freed"))
        )
    });
    Ok(())
}
