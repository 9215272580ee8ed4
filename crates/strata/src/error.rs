//! Error helpers every layer may use. Each module keeps its own `thiserror` enum; this ground
//! floor only renders them, so it imports nothing from the crate.

/// An error and its sources, joined with ": " for one-line reports (check reports, the
/// daemon's control replies, test assertions).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn the_chain_names_every_source_in_order() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(super::error_chain(&e), "outer: inner");
    }
}
