//! The metric families each process records: the coordinator's per-step metrics, a rank's refit,
//! weight version and transfer-queue metrics, and the collectors read at scrape time (storage
//! units, handshake refusals).

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use rlplane_api::TqFetch;
use rlplane_api::plan::{ProcessRole, WorkerPlan};

use super::{
    FloatGauge, HistogramFamily, JobLabels, PhaseLabels, ProtocolLabels, ScalarLabels, UnitLabels, claim_buckets,
    duration_buckets, tq_buckets, transport_name,
};
use crate::coordinator::{Observer, Progress, StepRecord};
use crate::net::Refusals;
use crate::refit::RefitStats;
use crate::tq::StorageUnit;

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
    policy_lag: Histogram,
    stale_dropped: Counter,
    engine_idle: Counter<f64, AtomicU64>,
    trainer_idle: Counter<f64, AtomicU64>,
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
            policy_lag: Histogram::new((0..=rlplane_api::MAX_POLICY_LAG).map(f64::from)),
            stale_dropped: Counter::default(),
            engine_idle: Counter::default(),
            trainer_idle: Counter::default(),
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
        registry.register(
            "policy_lag",
            "Policy lag of every sample trained on: how many versions older than the previous step's weights \
             generated it (0 in a synchronous job; at most spec.schedule.maxPolicyLag)",
            m.policy_lag.clone(),
        );
        registry.register(
            "stale_samples_dropped",
            "Samples dropped at the claim because they lagged more than spec.schedule.maxPolicyLag",
            m.stale_dropped.clone(),
        );
        registry.register_with_unit(
            "engine_idle",
            "Step wall time the busiest engine producer spent neither generating nor refitting",
            Unit::Seconds,
            m.engine_idle.clone(),
        );
        registry.register_with_unit(
            "trainer_idle",
            "Step wall time the busiest trainer rank spent neither training, updating nor sending its refit",
            Unit::Seconds,
            m.trainer_idle.clone(),
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
        for (lag, n) in r.policy_lags.iter().enumerate() {
            for _ in 0..*n {
                self.policy_lag.observe(lag as f64);
            }
        }
        self.stale_dropped.inc_by(r.stale_dropped);
        self.engine_idle.inc_by(r.engine_idle_s);
        self.trainer_idle.inc_by(r.trainer_idle_s);
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
pub(super) struct RefitMetrics {
    pub(super) duration: Histogram,
    pub(super) phases: HistogramFamily<PhaseLabels>,
    pub(super) bytes: Counter,
    pub(super) bandwidth: FloatGauge,
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
    pub(super) addr: Option<SocketAddr>,
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
    pub(super) fn register(registry: &mut Registry, direction: &str) -> RefitMetrics {
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
