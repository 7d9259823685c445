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

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use rlplane_api::TqFetch;
use rlplane_api::plan::{ProcessRole, WorkerPlan};

use crate::coordinator::{Observer, Progress, StepRecord};
use crate::net::Refusals;
use crate::refit::RefitStats;
use crate::refit::TransportKind as Kind;
use crate::tq::StorageUnit;

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

/// The job-level metrics the coordinator records once per step.
#[derive(Clone, Debug)]
pub struct CoordinatorMetrics {
    steps: Counter,
    step_duration: Histogram,
    step_phases: HistogramFamily<PhaseLabels>,
    refit_duration: Histogram,
    refit_bytes: Counter,
    refit_bandwidth: FloatGauge,
    policy_version: Gauge,
    claim_duration: Histogram,
    tokens: Counter,
    samples: Counter,
    imbalance: FloatGauge,
    scalars: Family<ScalarLabels, FloatGauge>,
}

/// Phases of a step in `rlplane_step_phase_duration_seconds`.
pub const STEP_PHASES: [&str; 5] = ["generate", "transfer", "train", "refit", "control"];

impl CoordinatorMetrics {
    /// Registers the coordinator's metrics in `registry` (made with [`JobLabels::registry`]).
    pub fn register(registry: &mut Registry) -> CoordinatorMetrics {
        let m = CoordinatorMetrics {
            steps: Counter::default(),
            step_duration: duration_buckets(),
            step_phases: Family::new_with_constructor(duration_buckets),
            refit_duration: duration_buckets(),
            refit_bytes: Counter::default(),
            refit_bandwidth: FloatGauge::default(),
            policy_version: Gauge::default(),
            claim_duration: claim_buckets(),
            tokens: Counter::default(),
            samples: Counter::default(),
            imbalance: FloatGauge::default(),
            scalars: Family::default(),
        };
        registry.register("steps", "Steps completed", m.steps.clone());
        registry.register_with_unit("step_duration", "Wall time of a step", Unit::Seconds, m.step_duration.clone());
        registry.register_with_unit(
            "step_phase_duration",
            "Wall time of a step's phases: generate, transfer (claim, fetch, fan-out, write-back, clear), train, \
             refit; control is the part of them no rank spent working",
            Unit::Seconds,
            m.step_phases.clone(),
        );
        registry.register_with_unit(
            "refit_duration",
            "End-to-end refit: from the coordinator's command until every generation rank holds the new version",
            Unit::Seconds,
            m.refit_duration.clone(),
        );
        registry.register_with_unit(
            "refit",
            "Refit bytes delivered, summed over every generation rank",
            Unit::Bytes,
            m.refit_bytes.clone(),
        );
        registry.register(
            "refit_bandwidth_bytes_per_second",
            "Bytes each generation rank received in the last refit divided by its end-to-end duration",
            m.refit_bandwidth.clone(),
        );
        registry.register(
            "policy_version",
            "Weight version the trainer holds (the last step's update); generation ranks lag it until their refit",
            m.policy_version.clone(),
        );
        registry.register_with_unit(
            "tq_claim_duration",
            "Transfer-queue claim of a step's samples by the trainer group (metadata only)",
            Unit::Seconds,
            m.claim_duration.clone(),
        );
        registry.register("step_tokens", "Tokens trained on", m.tokens.clone());
        registry.register("step_samples", "Samples trained on", m.samples.clone());
        registry.register(
            "token_imbalance_ratio",
            "max/mean tokens over the data-parallel shards in the last step",
            m.imbalance.clone(),
        );
        registry.register(
            "step_scalar",
            "Scalars of the last step that reported each (reward, KL, lengths…: what the trainer's and engines' \
             processes report through the local API), the mean over the ranks that reported it",
            m.scalars.clone(),
        );
        for phase in STEP_PHASES {
            let _ = m.step_phases.get_or_create(&PhaseLabels { phase: phase.into() });
        }
        m
    }

    /// Records a finished step.
    pub fn record_step(&self, r: &StepRecord) {
        self.steps.inc();
        self.step_duration.observe(r.total_s);
        for (phase, secs) in [
            ("generate", r.generate_s),
            ("transfer", r.transfer_s),
            ("train", r.train_s),
            ("refit", r.refit_s),
            ("control", r.control_s),
        ] {
            self.step_phases.get_or_create(&PhaseLabels { phase: phase.into() }).observe(secs);
        }
        self.refit_duration.observe(r.refit_s);
        self.refit_bytes.inc_by(r.refit_bytes_per_receiver * r.refit_receivers);
        if r.refit_s > 0.0 {
            self.refit_bandwidth.set(r.refit_bytes_per_receiver as f64 / r.refit_s);
        }
        self.policy_version.set(r.version as i64);
        self.claim_duration.observe(r.claim_s);
        self.tokens.inc_by(r.tokens);
        self.samples.inc_by(r.samples);
        self.imbalance.set(r.imbalance);
        for (name, v) in &r.scalars {
            self.scalars.get_or_create(&ScalarLabels { name: name.clone() }).set(*v);
        }
    }

    /// The trainer's weights are now at `version` (the update of step `version` finished).
    pub fn set_policy_version(&self, version: u64) {
        self.policy_version.set(version as i64);
    }
}

/// Records the coordinator's progress into [`CoordinatorMetrics`], then passes it on.
pub struct MetricsObserver<'a> {
    /// The observer that gets every event afterwards.
    pub inner: &'a dyn Observer,
    /// Where steps are recorded.
    pub metrics: CoordinatorMetrics,
}

impl Observer for MetricsObserver<'_> {
    fn progress(&self, event: Progress) {
        match &event {
            // The refit phase begins once the update is done: the trainer now holds `step`.
            Progress::Phase { step, phase: "refit" } => self.metrics.set_policy_version(*step as u64),
            Progress::StepDone(r) => self.metrics.record_step(r),
            _ => {}
        }
        self.inner.progress(event);
    }
}

/// Refit metrics of one rank (a trainer sender or a generation receiver).
#[derive(Clone, Debug)]
struct RefitMetrics {
    duration: Histogram,
    phases: HistogramFamily<PhaseLabels>,
    bytes: Counter,
    bandwidth: FloatGauge,
}

/// Transfer-queue metrics of one direction (put or get) at one rank.
#[derive(Clone, Debug)]
struct TqOpMetrics {
    bytes: Counter,
    duration: Histogram,
}

impl TqOpMetrics {
    fn register(registry: &mut Registry, op: &str, help: &str) -> TqOpMetrics {
        let m = TqOpMetrics { bytes: Counter::default(), duration: tq_buckets() };
        registry.register_with_unit(
            format!("tq_{op}"),
            format!("Transfer-queue bytes {help}"),
            Unit::Bytes,
            m.bytes.clone(),
        );
        registry.register_with_unit(
            format!("tq_{op}_duration"),
            format!("Time of one transfer-queue {op} (one step's batch {help})"),
            Unit::Seconds,
            m.duration.clone(),
        );
        m
    }
}

/// What a rank process measures. Only the parts its role uses are registered, so a trainer
/// exports no `put` series and a follower no `get` series.
#[derive(Clone, Debug, Default)]
pub struct RankMetrics {
    addr: Option<SocketAddr>,
    refit: Option<RefitMetrics>,
    weight_version: Option<Gauge>,
    put: Option<TqOpMetrics>,
    get: Option<TqOpMetrics>,
    storage: StorageGauges,
}

/// Phases of a refit at a rank in `rlplane_refit_phase_duration_seconds`.
pub const REFIT_PHASES: [&str; 4] = ["pack", "transfer", "unpack", "buffer_wait"];

/// A rank's `role` and `rank` label values.
pub fn rank_labels(plan: &WorkerPlan, me: u32) -> (&'static str, String) {
    match plan.process(me).role {
        ProcessRole::Trainer(c) => ("trainer", c.rank.to_string()),
        ProcessRole::Generation(c) => ("generation", c.rank.to_string()),
        ProcessRole::Storage { unit } => ("storage", unit.to_string()),
        ProcessRole::Coordinator => ("coordinator", "0".to_string()),
    }
}

/// The transport label of a rank: its refit group's transport, else the job's.
fn rank_transport(plan: &WorkerPlan, me: u32) -> String {
    match plan.refit_groups_of(me).first() {
        Some(g) => transport_name(crate::refit::transport_kind(g)).to_string(),
        None => JobLabels::of(plan).transport,
    }
}

impl RankMetrics {
    /// A registry for process `me` (labels `rljob`, `mode`, `transport`, `role`, `rank`) with the
    /// metrics its role records.
    pub fn for_process(plan: &WorkerPlan, me: u32) -> (Registry, RankMetrics) {
        let (role, rank) = rank_labels(plan, me);
        let labels = JobLabels { transport: rank_transport(plan, me), ..JobLabels::of(plan) };
        let mut registry = labels.registry(&[("role", role.to_string()), ("rank", rank)]);
        let mut m = RankMetrics::default();
        match plan.process(me).role {
            ProcessRole::Trainer(c) => {
                if plan.refit_groups_of(me).iter().any(|g| g.senders.contains(&me)) {
                    m.refit = Some(RefitMetrics::register(&mut registry, "sent"));
                }
                if c.leader || plan.transfer_queue.fetch == TqFetch::Independent {
                    m.get = Some(TqOpMetrics::register(&mut registry, "get", "fetched by the trainer"));
                }
            }
            ProcessRole::Generation(c) => {
                m.refit = Some(RefitMetrics::register(&mut registry, "received"));
                let version = Gauge::default();
                registry.register(
                    "weight_version",
                    "Weight version this generation rank holds completely (0 before the first refit)",
                    version.clone(),
                );
                m.weight_version = Some(version);
                if c.producer {
                    m.put = Some(TqOpMetrics::register(&mut registry, "put", "put by the engine's producer"));
                }
            }
            ProcessRole::Storage { .. } | ProcessRole::Coordinator => {}
        }
        registry.register_collector(Box::new(m.storage.clone()));
        (registry, m)
    }

    /// Serves `registry` on an ephemeral loopback port; the address goes into the readiness line.
    /// Without a port (bind failure) the rank runs on without metrics, saying so.
    pub async fn serve(mut self, registry: Registry) -> RankMetrics {
        match tokio::net::TcpListener::bind(("127.0.0.1", 0)).await {
            Ok(l) => {
                self.addr = l.local_addr().ok();
                let exposition = MergedMetrics::of(vec![Arc::new(registry)]);
                tokio::spawn(async move {
                    let _ = axum::serve(l, router(exposition)).await;
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot bind a loopback port for metrics; this rank exports none"),
        }
        self
    }

    /// Where the rank serves its metrics (for `RLPLANE_READY metrics=<addr>`).
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// Records one refit at this rank.
    pub fn refit(&self, stats: &RefitStats) {
        let Some(r) = &self.refit else { return };
        r.duration.observe(stats.total_secs);
        for (phase, secs) in [
            ("pack", stats.pack_secs),
            ("transfer", stats.transfer_secs),
            ("unpack", stats.unpack_secs),
            ("buffer_wait", stats.buffer_wait_secs),
        ] {
            if let Some(h) = r.phases.get(&PhaseLabels { phase: phase.into() }) {
                h.observe(secs);
            }
        }
        r.bytes.inc_by(stats.bytes);
        if stats.total_secs > 0.0 {
            r.bandwidth.set(stats.bytes as f64 / stats.total_secs);
        }
    }

    /// The weight version this generation rank holds completely.
    pub fn weight_version(&self, version: u64) {
        if let Some(g) = &self.weight_version {
            g.set(version as i64);
        }
    }

    /// Records one put of `bytes` that took `secs`.
    pub fn tq_put(&self, bytes: u64, secs: f64) {
        if let Some(p) = &self.put {
            p.bytes.inc_by(bytes);
            p.duration.observe(secs);
        }
    }

    /// Records one get of `bytes` that took `secs`.
    pub fn tq_get(&self, bytes: u64, secs: f64) {
        if let Some(g) = &self.get {
            g.bytes.inc_by(bytes);
            g.duration.observe(secs);
        }
    }

    /// Exports the fill of a storage unit hosted by this process.
    pub fn storage_unit(&self, unit: Arc<StorageUnit>) {
        self.storage.add(unit);
    }
}

impl RefitMetrics {
    fn register(registry: &mut Registry, direction: &str) -> RefitMetrics {
        let sender = direction == "sent";
        let m = RefitMetrics {
            duration: duration_buckets(),
            phases: Family::new_with_constructor(duration_buckets),
            bytes: Counter::default(),
            bandwidth: FloatGauge::default(),
        };
        registry.register_with_unit(
            "refit_rank_duration",
            "One refit at this rank, from its start to the last acknowledgement",
            Unit::Seconds,
            m.duration.clone(),
        );
        registry.register_with_unit(
            "refit_phase_duration",
            "Time of one refit at this rank spent per phase: pack (sender) and unpack (receiver) copy-engine time, \
             transfer, and buffer_wait (blocked on a staging buffer's previous use)",
            Unit::Seconds,
            m.phases.clone(),
        );
        registry.register_with_unit(
            "refit_rank",
            format!("Refit payload bytes {direction} by this rank"),
            Unit::Bytes,
            m.bytes.clone(),
        );
        registry.register(
            "refit_rank_bandwidth_bytes_per_second",
            format!("Bytes {direction} in the last refit at this rank divided by its duration"),
            m.bandwidth.clone(),
        );
        // Only the phases this side has: a sender packs, a receiver unpacks.
        for phase in REFIT_PHASES {
            if (phase == "pack" && !sender) || (phase == "unpack" && sender) {
                continue;
            }
            let _ = m.phases.get_or_create(&PhaseLabels { phase: phase.into() });
        }
        m
    }
}

/// `rlplane_tq_storage_used_bytes{unit}` and `rlplane_tq_storage_capacity_bytes{unit}`, read
/// from the storage units of this process at scrape time.
#[derive(Clone, Default)]
pub struct StorageGauges {
    units: Arc<Mutex<Vec<Arc<StorageUnit>>>>,
}

impl std::fmt::Debug for StorageGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.units.lock().map(|u| u.len()).unwrap_or(0);
        f.debug_struct("StorageGauges").field("units", &n).finish()
    }
}

impl StorageGauges {
    /// Adds a unit to export.
    pub fn add(&self, unit: Arc<StorageUnit>) {
        if let Ok(mut u) = self.units.lock() {
            u.push(unit);
        }
    }
}

impl Collector for StorageGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let units: Vec<Arc<StorageUnit>> = match self.units.lock() {
            Ok(u) => u.clone(),
            Err(_) => return Ok(()),
        };
        if units.is_empty() {
            return Ok(());
        }
        let used = Family::<UnitLabels, Gauge>::default();
        let capacity = Family::<UnitLabels, Gauge>::default();
        for u in &units {
            let labels = UnitLabels { unit: u.id().to_string() };
            used.get_or_create(&labels).set(u.used() as i64);
            capacity.get_or_create(&labels).set(u.capacity() as i64);
        }
        let metric = encoder.encode_descriptor(
            "tq_storage_used",
            "Bytes held by a transfer-queue storage unit.",
            Some(&Unit::Bytes),
            used.metric_type(),
        )?;
        used.encode(metric)?;
        let metric = encoder.encode_descriptor(
            "tq_storage_capacity",
            "Capacity of a transfer-queue storage unit (puts beyond it wait).",
            Some(&Unit::Bytes),
            capacity.metric_type(),
        )?;
        capacity.encode(metric)
    }
}

/// `rlplane_handshake_refused_total{protocol}`: peers this process refused (or that failed to
/// prove they hold the job epoch's key), by protocol magic (`RCTL` control, `TQCT` transfer-queue
/// controller, `TQSU` storage unit, `TQFO` fan-out, `RFIT` TCP refit, `RNCL` NCCL rendezvous,
/// `RIPC` CUDA IPC control), read from the handshakes' [`Refusals`] at scrape time.
#[derive(Clone, Debug)]
pub struct HandshakeRefusals(Refusals);

impl HandshakeRefusals {
    /// Exports `refusals` in `registry`.
    pub fn register(registry: &mut Registry, refusals: &Refusals) {
        registry.register_collector(Box::new(HandshakeRefusals(refusals.clone())));
    }
}

impl Collector for HandshakeRefusals {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let refused = Family::<ProtocolLabels, Counter>::default();
        for (protocol, n) in self.0.snapshot() {
            refused.get_or_create(&ProtocolLabels { protocol }).inc_by(n);
        }
        let metric = encoder.encode_descriptor(
            "handshake_refused",
            "Handshakes refused: peers of another job or epoch, without the epoch's key, or replaying a handshake.",
            None,
            refused.metric_type(),
        )?;
        refused.encode(metric)
    }
}

/// One `/metrics` made of this process's registries and the expositions of child processes.
#[derive(Debug)]
pub struct MergedMetrics {
    local: Vec<Arc<Registry>>,
    children: RwLock<Vec<(String, String)>>,
    up: Option<Family<ProcessLabels, Gauge>>,
}

impl MergedMetrics {
    /// An exposition of `own` (which gets `rlplane_metrics_source_up{process}` for the
    /// children) followed by `more` registries.
    pub fn new(mut own: Registry, more: Vec<Arc<Registry>>) -> Arc<MergedMetrics> {
        let up = Family::<ProcessLabels, Gauge>::default();
        own.register(
            "metrics_source_up",
            "1 when the child process answered the last scrape of the merged /metrics, 0 when it did not",
            up.clone(),
        );
        let mut local = vec![Arc::new(own)];
        local.extend(more);
        Arc::new(MergedMetrics { local, children: RwLock::new(Vec::new()), up: Some(up) })
    }

    /// An exposition of `registries` only (no children).
    pub fn of(registries: Vec<Arc<Registry>>) -> Arc<MergedMetrics> {
        Arc::new(MergedMetrics { local: registries, children: RwLock::new(Vec::new()), up: None })
    }

    /// Sets the children to scrape: (process name, `host:port` of its metrics).
    pub fn set_children(&self, children: Vec<(String, String)>) {
        if let Some(up) = &self.up {
            for (name, _) in &children {
                let _ = up.get_or_create(&ProcessLabels { process: name.clone() });
            }
        }
        if let Ok(mut c) = self.children.write() {
            *c = children;
        }
    }

    /// Scrapes every child (concurrently, [`SCRAPE_TIMEOUT`] each) and merges their expositions
    /// with the local registries.
    pub async fn render(&self) -> String {
        let children = self.children.read().map(|c| c.clone()).unwrap_or_default();
        let scraped = futures::future::join_all(children.iter().map(|(name, addr)| async move {
            let r = scrape(addr, SCRAPE_TIMEOUT).await;
            if let Err(e) = &r {
                tracing::debug!(process = %name, %addr, error = %e, "cannot scrape a child's metrics");
            }
            (name, r)
        }))
        .await;
        let mut texts = Vec::with_capacity(scraped.len() + self.local.len());
        for (name, r) in scraped {
            if let Some(up) = &self.up {
                up.get_or_create(&ProcessLabels { process: name.clone() }).set(r.is_ok() as i64);
            }
            if let Ok(t) = r {
                texts.push(t);
            }
        }
        let mut own = Vec::with_capacity(self.local.len());
        for registry in &self.local {
            let mut s = String::new();
            if prometheus_client::encoding::text::encode(&mut s, registry).is_ok() {
                own.push(s);
            }
        }
        // This process's series first, then the children's.
        merge(own.iter().chain(texts.iter()).map(String::as_str))
    }
}

/// The router serving `/metrics` from `metrics`.
pub fn router(metrics: Arc<MergedMetrics>) -> axum::Router {
    use axum::http::header;
    use axum::routing::get;
    axum::Router::new().route(
        "/metrics",
        get(move || {
            let metrics = metrics.clone();
            async move { ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics.render().await) }
        }),
    )
}

/// GETs `http://<addr>/metrics` and returns the body.
pub async fn scrape(addr: &str, timeout: Duration) -> anyhow::Result<String> {
    use anyhow::Context;
    use http_body_util::{BodyExt, Empty};
    use hyper::header;
    let fetch = async {
        let stream = tokio::net::TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
        let driver = tokio::spawn(conn);
        let request = hyper::Request::get("/metrics")
            .header(header::HOST, addr)
            .header(header::ACCEPT, "application/openmetrics-text")
            .body(Empty::<bytes::Bytes>::new())?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        driver.abort();
        anyhow::ensure!(status.is_success(), "{addr}/metrics answered {status}");
        String::from_utf8(body.to_vec()).with_context(|| format!("{addr}/metrics is not UTF-8"))
    };
    tokio::time::timeout(timeout, fetch).await.with_context(|| format!("{addr}/metrics took over {timeout:?}"))?
}

/// The metric name and label set of a sample line (everything before the value), or None for a
/// malformed line.
fn series_key(line: &str) -> Option<&str> {
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() && bytes[i] != b'{' && bytes[i] != b' ' {
        i += 1;
    }
    if i == 0 || i == bytes.len() {
        return None;
    }
    if bytes[i] == b' ' {
        return Some(&line[..i]);
    }
    // Labels: scan to the closing brace outside quoted values.
    let mut quoted = false;
    let mut escaped = false;
    for (j, &b) in bytes.iter().enumerate().skip(i + 1) {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b'}' if !quoted => return Some(&line[..=j]),
            _ => {}
        }
    }
    None
}

/// The metric name of a sample's series key.
fn sample_name(key: &str) -> &str {
    key.split('{').next().unwrap_or(key)
}

/// Whether sample `name` belongs to family `family` (the family name or a suffixed sample name).
fn belongs(name: &str, family: &str) -> bool {
    name == family
        || name.strip_prefix(family).is_some_and(|suffix| {
            ["_total", "_created", "_bucket", "_count", "_sum", "_info", "_gcount", "_gsum"].contains(&suffix)
        })
}

#[derive(Default)]
struct MergedFamily {
    kind: Option<String>,
    metadata: Vec<String>,
    samples: Vec<String>,
}

/// Merges OpenMetrics (or Prometheus text) expositions into one valid OpenMetrics text: every
/// family's `# HELP`/`# TYPE`/`# UNIT` once, all its samples together, `# EOF` once at the end.
///
/// Families keep the order in which they are first seen. A series (name and labels) that an
/// earlier exposition already had is dropped, and so is a family whose type disagrees with the
/// type seen first (logged): either would make the whole scrape invalid.
pub fn merge<'a>(expositions: impl IntoIterator<Item = &'a str>) -> String {
    let mut families: Vec<(String, MergedFamily)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut family_of = |name: &str, families: &mut Vec<(String, MergedFamily)>| -> usize {
        *index.entry(name.to_string()).or_insert_with(|| {
            families.push((name.to_string(), MergedFamily::default()));
            families.len() - 1
        })
    };
    for text in expositions {
        // The family the following samples belong to, and whether this text's copy is dropped.
        let mut current: Option<(usize, bool)> = None;
        for line in text.lines() {
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            if line == "# EOF" {
                break;
            }
            if let Some(rest) = line.strip_prefix('#') {
                let mut parts = rest.trim_start().splitn(3, ' ');
                let (Some(keyword), Some(name)) = (parts.next(), parts.next()) else { continue };
                if !matches!(keyword, "HELP" | "TYPE" | "UNIT") {
                    continue; // a plain comment: not allowed in OpenMetrics, dropped
                }
                let i = family_of(name, &mut families);
                let dropped = match current {
                    Some((c, dropped)) if c == i => dropped,
                    _ => false,
                };
                let family = &mut families[i].1;
                let dropped = if keyword == "TYPE" {
                    let kind = parts.next().unwrap_or("unknown").trim().to_string();
                    match &family.kind {
                        None => {
                            family.kind = Some(kind);
                            family.metadata.push(line.to_string());
                            false
                        }
                        Some(k) if *k == kind => dropped,
                        Some(k) => {
                            tracing::warn!(family = name, first = %k, other = %kind, "metric family exported with two types; dropping the second");
                            true
                        }
                    }
                } else {
                    if !family
                        .metadata
                        .iter()
                        .any(|m| m.strip_prefix('#').map(str::trim_start).is_some_and(|m| m.starts_with(keyword)))
                    {
                        family.metadata.push(line.to_string());
                    }
                    dropped
                };
                current = Some((i, dropped));
                continue;
            }
            let Some(key) = series_key(line) else { continue };
            let name = sample_name(key);
            let (i, dropped) = match current {
                Some((c, dropped)) if belongs(name, &families[c].0) => (c, dropped),
                _ => {
                    let i = family_of(name, &mut families);
                    current = Some((i, false));
                    (i, false)
                }
            };
            if dropped || !seen.insert(key.to_string()) {
                continue;
            }
            families[i].1.samples.push(line.to_string());
        }
    }
    let mut out = String::new();
    for (_, f) in &families {
        for m in &f.metadata {
            out.push_str(m);
            out.push('\n');
        }
        for s in &f.samples {
            out.push_str(s);
            out.push('\n');
        }
    }
    out.push_str("# EOF\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(merged.contains(r#"rlplane_refit_rank_bytes_total{rljob="j",mode="split",transport="tcp",role="generation",rank="0"} 10"#), "{merged}");
        assert!(merged.contains(r#"rlplane_refit_rank_bytes_total{rljob="j",mode="split",transport="tcp",role="generation",rank="1"} 20"#), "{merged}");
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
}
