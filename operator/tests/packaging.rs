//! The Helm chart against the operator's code, without any tool: the chart ships the CRD crdgen
//! generates, byte for byte, and every operator metric the Grafana dashboard queries is one the
//! operator's registry exports. (.ci/check-packaging renders, validates and evaluates the rest.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use prometheus_client::registry::Registry;
use rlplane_operator::metrics::{JobsByPhase, Metrics, PREFIX};

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p)
}

#[test]
fn the_chart_ships_the_generated_crd() {
    let generated = std::fs::read(repo("crds/rljob.yaml")).unwrap();
    let chart = std::fs::read(repo("charts/rlplane/crds/rljob.yaml")).unwrap();
    assert!(
        generated == chart,
        "charts/rlplane/crds/rljob.yaml differs from crds/rljob.yaml: cp crds/rljob.yaml charts/rlplane/crds/rljob.yaml"
    );
}

/// Metric names (`rlplane_operator_…`) in the dashboard's expressions.
fn dashboard_operator_metrics() -> BTreeSet<String> {
    let text = std::fs::read_to_string(repo("charts/rlplane/dashboards/rlplane.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    let mut stack = vec![&dashboard];
    while let Some(v) = stack.pop() {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(serde_json::Value::String(e)) = m.get("expr") {
                    exprs.push(e.clone());
                }
                stack.extend(m.values());
            }
            serde_json::Value::Array(a) => stack.extend(a),
            _ => {}
        }
    }
    let mut names = BTreeSet::new();
    for e in exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("rlplane_operator_") {
            let tail = &rest[i..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    names
}

#[test]
fn every_operator_metric_of_the_dashboard_is_exported() {
    let mut registry = Registry::with_prefix(PREFIX);
    let jobs = JobsByPhase::default();
    let metrics = Metrics::register(&mut registry, jobs.clone());
    metrics.reconcile_duration.observe(0.01);
    // A leader's (empty) cache: the jobs gauge is exported.
    let (store, _writer) = kube::runtime::reflector::store::<rlplane_api::RLJob>();
    jobs.set_store(Some(store));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let exported: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(String::from)
        .collect();
    let wanted = dashboard_operator_metrics();
    assert!(wanted.len() >= 4, "the dashboard has operator panels: {wanted:?}");
    for name in &wanted {
        assert!(exported.contains(name), "the dashboard queries {name}, which the operator does not export:\n{text}");
    }
}
