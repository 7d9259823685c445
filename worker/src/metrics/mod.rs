//! Prometheus metrics of the worker: what each rank and the coordinator measure, and one merged
//! `/metrics` per pod (or per `rlplane local` run).
//!
//! - Every rank process owns a [`Registry`] (passed explicitly; there is no global one) with its
//!   [`RankMetrics`], serves it on an ephemeral loopback port and announces the address to its
//!   supervisor (`RLPLANE_READY metrics=<addr>`).
//! - The coordinator records [`CoordinatorMetrics`] from the [`StepRecord`] of every step (through
//!   [`MetricsObserver`]).
//! - The pod supervisor (`rlplane worker`) and `rlplane local --metrics-port` serve one `/metrics`
//!   ([`MergedMetrics`]): they scrape every child on request and [`merge`] the expositions with
//!   their own registries into one valid OpenMetrics text (each family's metadata once, `# EOF` once
//!   at the end). `rlplane_metrics_source_up{process}` tells which children answered.
//!
//! Labels: every series carries `rljob` (the RLJob's name — not `job`, which Prometheus reserves for
//! the scrape job and would rename to `exported_job`), `mode` (`split`, `colocated`) and
//! `transport` (`tcp`, `nccl`, `cuda_ipc`; `mixed` when refit groups differ). Series of a rank also
//! carry `role` (`trainer`, `generation`, `storage`) and `rank`, so that no two processes of a
//! pod ever export the same series. The names are listed in README.md ("Observability") and used
//! by `charts/rlplane/dashboards/rlplane.json`.
//!
//! The module's parts: the label sets and constants here; the metric families each process
//! records in [`families`]; serving, scraping and the merged endpoint in [`serve`]; the merging of
//! expositions in [`merge`].

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use rlplane_api::plan::WorkerPlan;
use std::time::Duration;

use crate::refit::TransportKind as Kind;

pub mod families;
pub mod merge;
pub mod serve;
#[cfg(test)]
mod tests;

pub use families::{
    CoordinatorMetrics, HandshakeRefusals, MetricsObserver, REFIT_PHASES, RankMetrics, STEP_PHASES, StorageGauges,
    rank_labels,
};
pub use merge::merge;
pub use serve::{MergedMetrics, router, scrape};

/// Prefix of every worker metric.
pub const PREFIX: &str = "rlplane";

/// Content type of the exposition (OpenMetrics text, as prometheus-client encodes it).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long the merged endpoint waits for one child's exposition.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(3);

/// A gauge holding a float.
type FloatGauge = Gauge<f64, AtomicU64>;
/// A family of histograms with fixed buckets.
type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Buckets of step and refit durations: 1 ms … 131 s.
fn duration_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 18))
}

/// Buckets of transfer-queue operations: 100 µs … 13 s.
fn tq_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

/// Buckets of claims (metadata only, in the coordinator's process): 10 µs … 1.3 s.
fn claim_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.00001, 2.0, 18))
}

/// Label set `{phase}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// Phase name, e.g. `transfer`.
    pub phase: String,
}

/// Label set `{name}`: a step scalar the job's processes report (reward, KL…).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScalarLabels {
    /// The scalar's name, as reported.
    pub name: String,
}

/// Label set `{unit}`: a transfer-queue storage unit.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UnitLabels {
    /// Storage unit id.
    pub unit: String,
}

/// Label set `{protocol}`: a handshake's protocol magic, e.g. `TQSU`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProtocolLabels {
    /// The protocol's 4-byte magic.
    pub protocol: String,
}

/// Label set `{process}`: a child process of a supervisor.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProcessLabels {
    /// Process name from the plan, e.g. `gen-0`.
    pub process: String,
}

/// The constant labels of a job's series: `rljob`, `mode`, `transport`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobLabels {
    /// The RLJob's name.
    pub rljob: String,
    /// `split` or `colocated`.
    pub mode: String,
    /// The refit transport (`tcp`, `nccl`, `cuda_ipc`, or `mixed`).
    pub transport: String,
}

/// The label value of a refit transport.
pub fn transport_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Tcp => "tcp",
        Kind::Nccl => "nccl",
        Kind::Ipc => "cuda_ipc",
    }
}

impl JobLabels {
    /// The job's labels; `transport` is the transport every refit group uses (`mixed` when they
    /// differ, `none` without refit groups).
    pub fn of(plan: &WorkerPlan) -> JobLabels {
        let kinds: HashSet<&str> =
            plan.refit_groups.iter().map(|g| transport_name(crate::refit::transport_kind(g))).collect();
        let transport = match kinds.len() {
            0 => "none".to_string(),
            1 => kinds.into_iter().next().unwrap_or_default().to_string(),
            _ => "mixed".to_string(),
        };
        JobLabels { rljob: plan.job.name.clone(), mode: format!("{:?}", plan.mode).to_lowercase(), transport }
    }

    /// As constant labels of a registry.
    pub fn pairs(&self) -> Vec<(Cow<'static, str>, Cow<'static, str>)> {
        vec![
            (Cow::Borrowed("rljob"), Cow::Owned(self.rljob.clone())),
            (Cow::Borrowed("mode"), Cow::Owned(self.mode.clone())),
            (Cow::Borrowed("transport"), Cow::Owned(self.transport.clone())),
        ]
    }

    /// A registry whose every series carries these labels (and `extra`).
    pub fn registry(&self, extra: &[(&'static str, String)]) -> Registry {
        let mut labels = self.pairs();
        labels.extend(extra.iter().map(|(k, v)| (Cow::Borrowed(*k), Cow::Owned(v.clone()))));
        Registry::with_prefix_and_labels(PREFIX, labels.into_iter())
    }
}
