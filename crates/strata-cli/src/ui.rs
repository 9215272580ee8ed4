//! Terminal output: indicatif progress bars behind the library's `Progress` trait, `--json`
//! emission, and human-readable sizes. Bars are drawn only on a terminal and never with --json.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use strata::progress::{Progress, Unit};

pub struct Bar {
    pb: ProgressBar,
    /// Show 4 KiB pages/s instead of bytes/s (memory transfers).
    pages: bool,
}

pub fn bar(json: bool) -> Bar {
    let pb = ProgressBar::hidden();
    if !json && std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::stderr());
    }
    Bar { pb, pages: false }
}

impl Bar {
    /// Report pages/s (VM memory) rather than bytes/s.
    pub fn with_pages(mut self) -> Bar {
        self.pages = true;
        self
    }
}

impl Progress for Bar {
    fn phase(&self, name: &str, total: Option<u64>, unit: Unit) {
        self.pb.reset();
        self.pb.set_length(total.unwrap_or(0));
        let tmpl = match (total.is_some(), unit, self.pages) {
            (true, Unit::Bytes, true) => {
                "{msg:>16} [{bar:30}] {bytes}/{total_bytes} {pages_per_sec} eta {eta}"
            }
            (true, Unit::Bytes, false) => {
                "{msg:>16} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}"
            }
            (true, Unit::Items, _) => "{msg:>16} [{bar:30}] {pos}/{len} {per_sec} eta {eta}",
            (false, _, _) => "{msg:>16} {spinner} {pos}",
        };
        let style = ProgressStyle::with_template(tmpl)
            .expect("valid template")
            .with_key(
                "pages_per_sec",
                |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = write!(w, "{:.0} pages/s", s.per_sec() / 4096.0);
                },
            )
            .progress_chars("=> ");
        self.pb.set_style(style);
        self.pb.set_message(name.to_string());
    }
    fn advance(&self, n: u64) {
        self.pb.inc(n);
    }
    fn note(&self, msg: &str) {
        self.pb.println(msg);
    }
    fn finish(&self) {
        self.pb.finish_and_clear();
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.pb.finish_and_clear();
    }
}

/// Print `value` as JSON, or the human text. A reader that went away (`strata vm list | head`)
/// is not an error: the output is simply not wanted any more.
pub fn emit<T: serde::Serialize>(json: bool, value: &T, human: impl FnOnce() -> String) {
    use std::io::Write;
    let text =
        if json { serde_json::to_string_pretty(value).expect("serializable") } else { human() };
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{text}").and_then(|()| out.flush()) {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("strata: cannot write the output: {e}");
            std::process::exit(1);
        }
    }
}

pub fn human(b: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}
