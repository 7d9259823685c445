//! `/healthz`, `/readyz` and `/metrics` over real HTTP, and the metric names dashboards rely on.

use std::sync::Arc;

use kube::runtime::reflector;
use kube::runtime::watcher::Event;
use prometheus_client::registry::Registry;
use rlplane_api::{Phase, RLJob, RLJobSpec, RLJobStatus};
use rlplane_operator::cluster::http_get;
use rlplane_operator::metrics::{JobsByPhase, Metrics, PREFIX, ReasonLabels};
use rlplane_operator::server::{Health, router};

fn rljob(name: &str, phase: Option<Phase>) -> RLJob {
    let spec: RLJobSpec = serde_json::from_value(serde_json::json!({
        "mode": "Split", "model": {"preset": "tiny"},
        "trainer": {"gpusPerNode": 1}, "generation": {"engines": 1}
    }))
    .unwrap();
    let mut job = RLJob::new(name, spec);
    job.metadata.namespace = Some("ml".into());
    job.status = phase.map(|phase| RLJobStatus { phase, ..Default::default() });
    job
}

#[tokio::test]
async fn the_endpoints_report_health_readiness_and_metrics() {
    let mut registry = Registry::with_prefix(PREFIX);
    let jobs = JobsByPhase::default();
    let metrics = Metrics::register(&mut registry, jobs.clone());
    let health = Arc::new(Health::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, router(Arc::new(registry), health.clone())).into_future());
    let get = move |path: &'static str| tokio::task::spawn_blocking(move || http_get(addr, path).unwrap());

    assert_eq!(get("/healthz").await.unwrap().0, 200);
    assert_eq!(get("/readyz").await.unwrap().0, 503, "not ready before start-up finished");
    health.set_ready(true);
    assert_eq!(get("/readyz").await.unwrap().0, 200);

    // No controller here (not the leader): no jobs gauge, the rest at zero.
    let (code, body) = get("/metrics").await.unwrap();
    assert_eq!(code, 200);
    for name in [
        "# TYPE rlplane_operator_reconcile counter",
        "# TYPE rlplane_operator_reconcile_errors counter",
        "# TYPE rlplane_operator_reconcile_duration_seconds histogram",
        "# TYPE rlplane_operator_restarts counter",
        "# TYPE rlplane_operator_phase_transitions counter",
        "# TYPE rlplane_operator_leader gauge",
        "rlplane_operator_reconcile_total 0",
        "rlplane_operator_leader 0",
        "rlplane_operator_restarts_total{reason=\"PodDeleted\"} 0",
        "rlplane_operator_reconcile_errors_total{error=\"forbidden\"} 0",
        "rlplane_operator_phase_transitions_total{phase=\"Running\"} 0",
    ] {
        assert!(body.contains(name), "missing {name:?} in\n{body}");
    }
    assert!(!body.contains("rlplane_operator_jobs{"), "{body}");

    // Leading: the gauge counts the controller's cached jobs by phase.
    let (store, mut writer) = reflector::store::<RLJob>();
    for (name, phase) in
        [("a", Some(Phase::Running)), ("b", Some(Phase::Running)), ("c", None), ("d", Some(Phase::Failed))]
    {
        writer.apply_watcher_event(&Event::Apply(rljob(name, phase)));
    }
    jobs.set_store(Some(store));
    metrics.leader.set(1);
    metrics.restarts.get_or_create(&ReasonLabels { reason: "PodEvicted".into() }).inc();
    let (_, body) = get("/metrics").await.unwrap();
    for line in [
        "rlplane_operator_jobs{phase=\"Running\"} 2",
        "rlplane_operator_jobs{phase=\"Pending\"} 1",
        "rlplane_operator_jobs{phase=\"Failed\"} 1",
        "rlplane_operator_jobs{phase=\"Succeeded\"} 0",
        "rlplane_operator_leader 1",
        "rlplane_operator_restarts_total{reason=\"PodEvicted\"} 1",
    ] {
        assert!(body.lines().any(|l| l == line), "missing {line:?} in\n{body}");
    }
    assert!(body.ends_with("# EOF\n"), "OpenMetrics text ends with # EOF");
}
