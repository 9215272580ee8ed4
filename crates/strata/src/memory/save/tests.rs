//! Tests of the save's helpers (the pause measured from QMP events).

use super::migrate::*;
use super::*;

#[test]
fn pause_is_stop_to_resume() {
    let ev = |n: &str, s: i64, us: i64| QmpEvent {
        name: n.into(),
        data: Value::Null,
        seconds: s,
        microseconds: us,
    };
    let evs = vec![
        ev("MIGRATION", 9, 0),
        ev("STOP", 10, 500_000),
        ev("RESUME", 10, 502_500),
        ev("STOP", 11, 0),
    ];
    assert!((pause_from_events(&evs).unwrap() - 2.5).abs() < 1e-6);
    assert_eq!(pause_from_events(&evs[..2]), None);
}
