//! The operator's Prometheus metrics (prometheus-client). Every name starts with
//! `rlplane_operator_`; docs/operator.md lists them for dashboards. The registry is passed
//! explicitly: there is no global one.

use std::sync::{Arc, RwLock};

use kube::runtime::reflector::Store;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use rlplane_api::{Phase, RLJob};

use crate::observe::FailureKind;

/// Prefix of every metric name.
pub const PREFIX: &str = "rlplane_operator";

/// Label set `{error}`: the kind of a reconcile error.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// [`crate::error::Error::kind`].
    pub error: String,
}

/// Label set `{phase}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// A phase name, e.g. `Running`.
    pub phase: String,
}

/// Label set `{reason}`: why a gang restarted.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// A [`FailureKind`] reason, e.g. `ContainerFailed`.
    pub reason: String,
}

/// The operator's metrics.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// `rlplane_operator_reconcile_total`: reconciles run.
    pub reconciles: Counter,
    /// `rlplane_operator_reconcile_errors_total{error}`: reconciles that failed, by error kind.
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    /// `rlplane_operator_reconcile_duration_seconds`: time per reconcile.
    pub reconcile_duration: Histogram,
    /// `rlplane_operator_restarts_total{reason}`: gang restarts caused by a failure.
    pub restarts: Family<ReasonLabels, Counter>,
    /// `rlplane_operator_phase_transitions_total{phase}`: jobs entering a phase.
    pub transitions: Family<PhaseLabels, Counter>,
    /// `rlplane_operator_leader`: 1 while this replica holds the lease and reconciles.
    pub leader: Gauge,
}

impl Metrics {
    /// Creates the metrics and registers them (and the `jobs` collector reading `jobs`) in
    /// `registry`, under [`PREFIX`] (give a registry made with `Registry::with_prefix(PREFIX)`).
    pub fn register(registry: &mut Registry, jobs: JobsByPhase) -> Metrics {
        let m = Metrics {
            reconciles: Counter::default(),
            reconcile_errors: Family::default(),
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            restarts: Family::default(),
            transitions: Family::default(),
            leader: Gauge::default(),
        };
        registry.register("reconcile", "RLJob reconciles run", m.reconciles.clone());
        registry.register(
            "reconcile_errors",
            "RLJob reconciles that failed, by error kind",
            m.reconcile_errors.clone(),
        );
        registry.register_with_unit(
            "reconcile_duration",
            "Time one RLJob reconcile took, API calls included",
            Unit::Seconds,
            m.reconcile_duration.clone(),
        );
        registry.register(
            "restarts",
            "Whole-gang restarts caused by a failed pod, by failure kind",
            m.restarts.clone(),
        );
        registry.register("phase_transitions", "RLJobs entering a phase", m.transitions.clone());
        registry.register("leader", "1 while this replica holds the leader lease and reconciles", m.leader.clone());
        // Zero series exist from the start so that rate() and dashboards see them before the first event.
        for kind in FailureKind::ALL {
            m.restarts.get_or_create(&ReasonLabels { reason: kind.reason().into() }).inc_by(0);
        }
        for kind in crate::error::Error::KINDS {
            m.reconcile_errors.get_or_create(&ErrorLabels { error: kind.into() }).inc_by(0);
        }
        for phase in Phase::ALL {
            m.transitions.get_or_create(&PhaseLabels { phase: phase.as_str().into() }).inc_by(0);
        }
        registry.register_collector(Box::new(jobs));
        m
    }
}

/// The `rlplane_operator_jobs{phase}` gauge, computed at scrape time from the controller's cache
/// of RLJobs (exact, with no bookkeeping of deletions). Empty on a replica that is not the
/// leader, so summing over replicas counts every job once.
#[derive(Clone, Debug, Default)]
pub struct JobsByPhase {
    store: Arc<RwLock<Option<Store<RLJob>>>>,
}

impl JobsByPhase {
    /// Points the gauge at the running controller's cache (None when it stops).
    pub fn set_store(&self, store: Option<Store<RLJob>>) {
        if let Ok(mut s) = self.store.write() {
            *s = store;
        }
    }

    /// Jobs per phase in the cache, every phase listed; None when no controller runs here.
    pub fn counts(&self) -> Option<Vec<(Phase, i64)>> {
        let guard = self.store.read().ok()?;
        let store = guard.as_ref()?;
        let jobs = store.state();
        Some(
            Phase::ALL
                .iter()
                .map(|&p| {
                    let n = jobs.iter().filter(|j| j.status.as_ref().map(|s| s.phase).unwrap_or_default() == p).count();
                    (p, n as i64)
                })
                .collect(),
        )
    }
}

impl Collector for JobsByPhase {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(counts) = self.counts() else { return Ok(()) };
        let family = Family::<PhaseLabels, Gauge>::default();
        for (phase, n) in counts {
            family.get_or_create(&PhaseLabels { phase: phase.as_str().into() }).set(n);
        }
        let metric = encoder.encode_descriptor("jobs", "RLJobs by phase (leader only)", None, family.metric_type())?;
        family.encode(metric)
    }
}
