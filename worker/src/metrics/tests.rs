use std::collections::HashSet;

use prometheus_client::registry::Registry;

use super::families::RefitMetrics;
use super::merge::series_key;
use super::*;
use crate::net::Refusals;

fn encode(r: &Registry) -> String {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, r).unwrap();
    s
}

fn rank_registry(rank: &str) -> (Registry, RefitMetrics) {
    let labels = JobLabels { rljob: "j".into(), mode: "split".into(), transport: "tcp".into() };
    let mut r = labels.registry(&[("role", "generation".into()), ("rank", rank.into())]);
    let m = RefitMetrics::register(&mut r, "received");
    (r, m)
}

#[test]
fn handshake_refusals_are_counted_by_protocol_at_scrape_time() {
    let (mut r, _) = rank_registry("0");
    let refusals = Refusals::default();
    HandshakeRefusals::register(&mut r, &refusals);
    assert!(!encode(&r).contains("handshake_refused_total{"), "no series before a refusal");
    refusals.count(*b"TQSU");
    refusals.count(*b"TQSU");
    refusals.count(*b"RNCL");
    let text = encode(&r);
    assert!(text.contains("# TYPE rlplane_handshake_refused counter"), "{text}");
    for (protocol, n) in [("TQSU", 2), ("RNCL", 1)] {
        let line = text
            .lines()
            .find(|l| {
                l.starts_with("rlplane_handshake_refused_total{") && l.contains(&format!("protocol=\"{protocol}\""))
            })
            .unwrap_or_else(|| panic!("no {protocol} series in\n{text}"));
        assert!(line.ends_with(&format!(" {n}")) && line.contains("rank=\"0\""), "{line}");
    }
}

#[test]
fn merging_keeps_each_family_once_and_ends_with_one_eof() {
    let (a, ma) = rank_registry("0");
    let (b, mb) = rank_registry("1");
    ma.bytes.inc_by(10);
    mb.bytes.inc_by(20);
    mb.duration.observe(0.5);
    let merged = merge([encode(&a).as_str(), encode(&b).as_str()]);
    for family in
        ["rlplane_refit_rank_bytes", "rlplane_refit_rank_duration_seconds", "rlplane_refit_phase_duration_seconds"]
    {
        for kw in ["HELP", "TYPE"] {
            let n = merged.lines().filter(|l| l.starts_with(&format!("# {kw} {family} "))).count();
            assert_eq!(n, 1, "# {kw} {family} once in\n{merged}");
        }
    }
    assert_eq!(merged.matches("# EOF").count(), 1);
    assert!(merged.ends_with("# EOF\n"));
    assert!(
        merged.contains(
            r#"rlplane_refit_rank_bytes_total{rljob="j",mode="split",transport="tcp",role="generation",rank="0"} 10"#
        ),
        "{merged}"
    );
    assert!(
        merged.contains(
            r#"rlplane_refit_rank_bytes_total{rljob="j",mode="split",transport="tcp",role="generation",rank="1"} 20"#
        ),
        "{merged}"
    );
    // Samples of one family are contiguous: after a family's last sample no other line of it.
    let mut finished: HashSet<String> = HashSet::new();
    let mut current = String::new();
    for l in merged.lines().filter(|l| !l.starts_with('#')) {
        let family = l
            .split(['{', ' '])
            .next()
            .unwrap()
            .trim_end_matches("_total")
            .trim_end_matches("_bucket")
            .trim_end_matches("_count")
            .trim_end_matches("_sum")
            .trim_end_matches("_created")
            .to_string();
        if family != current {
            assert!(finished.insert(current.clone()), "family {current} split in\n{merged}");
            current = family;
        }
    }
}

#[test]
fn merging_drops_duplicate_series_and_conflicting_types() {
    let a = "# HELP x A.\n# TYPE x counter\nx_total{a=\"1\"} 1\n# EOF\n";
    let b = "# HELP x A.\n# TYPE x counter\nx_total{a=\"1\"} 5\nx_total{a=\"2\"} 2\n# EOF\n";
    let c = "# TYPE x gauge\nx{a=\"3\"} 3\n# HELP y Y.\n# TYPE y gauge\ny 1\n# EOF\n";
    let merged = merge([a, b, c]);
    assert_eq!(
        merged,
        "# HELP x A.\n# TYPE x counter\nx_total{a=\"1\"} 1\nx_total{a=\"2\"} 2\n# HELP y Y.\n# TYPE y gauge\ny 1\n# EOF\n"
    );
}

#[test]
fn series_keys_respect_quoted_braces() {
    assert_eq!(series_key(r#"a{b="}{\"x"} 1"#), Some(r#"a{b="}{\"x"}"#));
    assert_eq!(series_key("a 1"), Some("a"));
    assert_eq!(series_key("a{b=\"1\""), None);
    assert_eq!(series_key("garbage"), None);
}
