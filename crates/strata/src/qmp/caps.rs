//! Which migration capabilities strata can store, checked before a save starts.
//!
//! strata keeps a checkpoint as pages + an opaque device-state tail, which is only faithful
//! when the stream is a plain precopy stream on one channel. Capabilities that change the
//! stream's shape are refused *before* migrating, with the reason and the fix, rather than
//! failing halfway through a save. Unknown capabilities that are enabled are refused too: a
//! newer QEMU may add one that changes the format, and silently storing a stream we cannot
//! restore would be worse than asking the operator to turn it off.

/// One entry of `query-migrate-capabilities`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationCapability {
    pub capability: String,
    pub state: bool,
}

/// What the caller opts into.
#[derive(Debug, Clone, Default)]
pub struct CapabilityPolicy {
    /// Accept `multifd` (and `zero-copy-send`): pages then travel on extra channels that the
    /// caller must read itself.
    pub allow_multifd: bool,
}

/// A refused capability and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedCapability {
    pub name: String,
    pub reason: &'static str,
}

/// Enabled capabilities strata cannot store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Migration capabilities strata cannot store are enabled: {}; disable them with migrate-set-capabilities", list(.refused))]
pub struct Unsupported {
    pub refused: Vec<RefusedCapability>,
}

fn list(r: &[RefusedCapability]) -> String {
    r.iter().map(|c| format!("{} ({})", c.name, c.reason)).collect::<Vec<_>>().join(", ")
}

/// Verdict for one capability: `None` = fine when enabled.
fn verdict(name: &str, policy: &CapabilityPolicy) -> Option<&'static str> {
    match name {
        "xbzrle" => Some("pages are deltas against the receiver's cache"),
        "compress" => Some("pages are zlib-compressed records the parser does not read"),
        "postcopy-ram" | "postcopy-preempt" => {
            Some("device state travels in a PACKAGED command and needs a return path")
        }
        "return-path" => Some("needs a bidirectional channel and QEMU's return-path protocol"),
        "block" => {
            Some("block migration interleaves disk sections with RAM; strata stores disks itself")
        }
        "dirty-bitmaps" => Some("interleaves dirty-bitmap sections with RAM"),
        "x-ignore-shared" => Some("shared ramblocks are left out of the stream"),
        "x-colo" => Some("COLO streams are continuous checkpoints with a return path"),
        "switchover-ack" => Some("needs a return path"),
        "mapped-ram" => Some("the file layout is not a stream"),
        "multifd" | "zero-copy-send" if !policy.allow_multifd => {
            Some("pages travel on extra channels; opt in with allow_multifd")
        }
        "multifd" | "zero-copy-send" => None,
        // Capabilities that leave the single-channel precopy format unchanged.
        "events"
        | "auto-converge"
        | "zero-blocks"
        | "pause-before-switchover"
        | "late-block-activate"
        | "release-ram"
        | "postcopy-blocktime"
        | "validate-uuid"
        | "background-snapshot"
        | "rdma-pin-all"
        | "dirty-limit" => None,
        _ => Some("unknown capability: not checked against the stream parser"),
    }
}

/// Refuse capabilities strata cannot store (multifd refused too).
pub fn check_capabilities(caps: &[MigrationCapability]) -> Result<(), Unsupported> {
    check_capabilities_with(caps, &CapabilityPolicy::default())
}

/// Refuse capabilities strata cannot store, under `policy`.
pub fn check_capabilities_with(
    caps: &[MigrationCapability],
    policy: &CapabilityPolicy,
) -> Result<(), Unsupported> {
    let refused: Vec<RefusedCapability> = caps
        .iter()
        .filter(|c| c.state)
        .filter_map(|c| {
            verdict(&c.capability, policy)
                .map(|reason| RefusedCapability { name: c.capability.clone(), reason })
        })
        .collect();
    if refused.is_empty() {
        Ok(())
    } else {
        Err(Unsupported { refused })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(on: &[&str]) -> Vec<MigrationCapability> {
        ["xbzrle", "events", "multifd", "background-snapshot", "compress", "block", "return-path"]
            .iter()
            .chain(on.iter().filter(|c| {
                ![
                    "xbzrle",
                    "events",
                    "multifd",
                    "background-snapshot",
                    "compress",
                    "block",
                    "return-path",
                ]
                .contains(c)
            }))
            .map(|c| MigrationCapability { capability: c.to_string(), state: on.contains(c) })
            .collect()
    }

    #[test]
    fn defaults_and_harmless_ones_pass() {
        assert_eq!(check_capabilities(&caps(&[])), Ok(()));
        assert_eq!(
            check_capabilities(&caps(&["events", "background-snapshot", "auto-converge"])),
            Ok(())
        );
    }

    #[test]
    fn refuses_each_and_names_it() {
        for c in [
            "xbzrle",
            "compress",
            "postcopy-ram",
            "block",
            "multifd",
            "return-path",
            "x-ignore-shared",
            "x-new-thing",
        ] {
            let e = check_capabilities(&caps(&[c])).unwrap_err();
            assert_eq!(e.refused.len(), 1, "{c}");
            assert_eq!(e.refused[0].name, c);
            assert!(e.to_string().contains(c), "{e}");
            assert!(e.to_string().contains("migrate-set-capabilities"), "{e}");
        }
        let e = check_capabilities(&caps(&["xbzrle", "compress"])).unwrap_err();
        assert_eq!(e.refused.len(), 2);
    }

    #[test]
    fn multifd_only_with_opt_in() {
        let p = CapabilityPolicy { allow_multifd: true };
        assert_eq!(check_capabilities_with(&caps(&["multifd"]), &p), Ok(()));
        assert!(check_capabilities(&caps(&["multifd"])).is_err());
    }
}
