//! Terminal output: indicatif progress bars behind the library's `Progress` trait, `--json`
//! emission, and human-readable sizes. Bars are drawn only on a terminal and never with --json.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use strata::progress::{Progress, Unit};

pub struct Bar {
    pb: ProgressBar,
}

pub fn bar(json: bool) -> Bar {
    let pb = ProgressBar::hidden();
    if !json && std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::stderr());
    }
    Bar { pb }
}

impl Progress for Bar {
    fn phase(&self, name: &str, total: Option<u64>, unit: Unit) {
        self.pb.reset();
        self.pb.set_length(total.unwrap_or(0));
        let tmpl = match (total.is_some(), unit) {
            (true, Unit::Bytes) => "{msg:>16} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            (true, Unit::Items) => "{msg:>16} [{bar:30}] {pos}/{len} {per_sec} eta {eta}",
            (false, _) => "{msg:>16} {spinner} {pos}",
        };
        self.pb.set_style(ProgressStyle::with_template(tmpl).unwrap().progress_chars("=> "));
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

/// Print `value` as JSON, or the human text.
pub fn emit<T: serde::Serialize>(json: bool, value: &T, human: impl FnOnce() -> String) {
    if json {
        println!("{}", serde_json::to_string_pretty(value).expect("serializable"));
    } else {
        println!("{}", human());
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
