//! `rlplane bench control` with real rank processes: it runs every way of sending a step's
//! commands and states each one's control cost against the raw ping-pong of the same run.

use std::process::Command;

#[test]
fn the_step_shaped_exchange_reports_every_way_against_the_raw_ping_pong() {
    let o = Command::new(env!("CARGO_BIN_EXE_rlplane"))
        .args(["bench", "control", "--ranks", "4", "--commands", "20", "--steps", "60", "--handshakes", "5"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}\n{stdout}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("2 trainer ranks, 2 engines; 60 steps each"), "{stdout}");
    for way in ["one round at a time", "queued, several shards", "queued, one shard or user's trainer"] {
        let line = stdout.lines().find(|l| l.starts_with(way)).unwrap_or_else(|| panic!("no `{way}` line:\n{stdout}"));
        // p50, p99 and p50 ÷ raw p50: three positive numbers.
        let numbers: Vec<f64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
        assert!(numbers.len() >= 3 && numbers.iter().rev().take(3).all(|&n| n > 0.0), "{line}");
    }
}
