//! Serves the operator's real `/metrics` — the registry of `metrics.rs` behind the router of
//! `server.rs` — without a cluster, so the Grafana dashboard's operator panels can be evaluated
//! by a real Prometheus (`.ci/dashboard_check.py`). Nothing here is measured: this replica
//! "leads", its cache holds RLJobs in every phase, and every 100 ms it records a reconcile (every
//! 7th fails with one of the error kinds, every 13th restarts a gang).
//!
//! ```sh
//! cargo run -p rlplane-operator --example metrics_fixture -- 127.0.0.1:18080 [SECONDS]
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kube::runtime::reflector;
use kube::runtime::watcher::Event;
use prometheus_client::registry::Registry;
use rlplane_api::{Phase, RLJob, RLJobSpec, RLJobStatus};
use rlplane_operator::metrics::{ErrorLabels, JobsByPhase, Metrics, PREFIX, PhaseLabels, ReasonLabels};
use rlplane_operator::observe::FailureKind;
use rlplane_operator::server::{Health, router};

fn rljob(name: &str, phase: Phase) -> anyhow::Result<RLJob> {
    let spec: RLJobSpec = serde_json::from_value(serde_json::json!({
        "mode": "Split", "model": {"preset": "tiny"},
        "trainer": {"gpusPerNode": 1}, "generation": {"engines": 1}
    }))?;
    let mut job = RLJob::new(name, spec);
    job.metadata.namespace = Some("fixture".into());
    job.status = Some(RLJobStatus { phase, ..Default::default() });
    Ok(job)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr: SocketAddr = args.next().unwrap_or_else(|| "127.0.0.1:18080".into()).parse()?;
    let seconds: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(600);

    let mut registry = Registry::with_prefix(PREFIX);
    let jobs = JobsByPhase::default();
    let metrics = Metrics::register(&mut registry, jobs.clone());
    let (store, mut writer) = reflector::store::<RLJob>();
    for (i, phase) in Phase::ALL.iter().enumerate() {
        for n in 0..=i % 3 {
            writer.apply_watcher_event(&Event::Apply(rljob(&format!("job-{i}-{n}"), *phase)?));
        }
    }
    jobs.set_store(Some(store));
    metrics.leader.set(1);
    let health = Arc::new(Health::default());
    health.set_ready(true);

    let listener = tokio::net::TcpListener::bind(addr).await?;
    eprintln!("operator metrics fixture at http://{}/metrics for {seconds}s", listener.local_addr()?);
    tokio::spawn(axum::serve(listener, router(Arc::new(registry), health)).into_future());

    let kinds = rlplane_operator::error::Error::KINDS;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(seconds);
    let mut n = 0u64;
    while tokio::time::Instant::now() < deadline {
        tick.tick().await;
        n += 1;
        metrics.reconciles.inc();
        metrics.reconcile_duration.observe(0.002 * (1 + n % 20) as f64);
        if n.is_multiple_of(7) {
            let error = kinds[(n / 7) as usize % kinds.len()];
            metrics.reconcile_errors.get_or_create(&ErrorLabels { error: error.into() }).inc();
        }
        if n.is_multiple_of(13) {
            let kind = FailureKind::ALL[(n / 13) as usize % FailureKind::ALL.len()];
            metrics.restarts.get_or_create(&ReasonLabels { reason: kind.reason().into() }).inc();
            metrics.transitions.get_or_create(&PhaseLabels { phase: Phase::Restarting.as_str().into() }).inc();
        }
    }
    Ok(())
}
