//! Sizes as operators write them: `4096`, `64K`, `30G`, in binary units.
//!
//! Both binaries read sizes from flags and config (`--size 20G`, `--cache-size 20G`,
//! `--pack-size 32M`); one parser keeps them agreeing. Suffixes are binary (K = 1024) and
//! case-insensitive, with an optional `B` or `iB` (`64KiB`, `64kb`); fractions are refused
//! rather than rounded, and a product that overflows u64 is an error.

/// Why a size could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("Unknown size suffix '{suffix}' in '{input}': use K, M, G or T")]
    Suffix { input: String, suffix: String },
    #[error("Invalid size '{input}': expected e.g. 4096, 64K, 30G")]
    Number { input: String },
    #[error("Size '{input}' is too large")]
    Overflow { input: String },
}

/// The number of bytes `s` names.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = s[i..].to_ascii_uppercase();
            let m = match unit.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1u64 << 40,
                other => {
                    return Err(SizeError::Suffix { input: s.into(), suffix: other.into() });
                }
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    let n: u64 = num.trim().parse().map_err(|_| SizeError::Number { input: s.into() })?;
    n.checked_mul(mult).ok_or_else(|| SizeError::Overflow { input: s.into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_suffixes_in_any_case() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 64K "), Ok(64 << 10));
        assert_eq!(parse_size("64kib"), Ok(64 << 10));
        assert_eq!(parse_size("32MB"), Ok(32 << 20));
        assert_eq!(parse_size("30G"), Ok(30 << 30));
        assert_eq!(parse_size("2t"), Ok(2 << 40));
        assert_eq!(parse_size("7b"), Ok(7));
    }

    #[test]
    fn bad_sizes_are_named() {
        assert!(matches!(parse_size("3X"), Err(SizeError::Suffix { suffix, .. }) if suffix == "X"));
        assert!(matches!(parse_size("1.5G"), Err(SizeError::Number { .. })));
        assert!(matches!(parse_size(""), Err(SizeError::Number { .. })));
        assert!(matches!(parse_size("-1K"), Err(SizeError::Number { .. })));
        assert!(matches!(parse_size("99999999999T"), Err(SizeError::Overflow { .. })));
    }
}
