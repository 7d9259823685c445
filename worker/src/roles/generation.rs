//! A generation rank: the stand-in for an inference engine's rank.
//!
//! - Generate (engine producers only): make the engine's rollouts for the step and put them into
//!   the transfer queue. With placement ProducerLocal the storage unit lives in this process, so
//!   the bytes stay here until a trainer leader fetches them (one hop).
//! - Refit: receive the new weights from every sender of its refit group into its own full
//!   tensors, check them against the senders' digests, and report the version it now holds.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use rlplane_api::TqPlacement;
use rlplane_api::plan::{ProcessRole, WorkerPlan};
use tokio::sync::watch;
use tracing::Instrument;

use super::refit_side::{self, Receiver, Side, Weights, segment_id};
use super::{Rank, announce_ready, secs, serve_commands};
use crate::control::{Command, ControlClient, ControlError, Report};
use crate::metrics::RankMetrics;
use crate::net::JobAuth;
use crate::refit::RefitPlan;
use crate::sidecar::{self, LocalApi, RankInfo};
use crate::tq::{ClientConfig, Column, PutOptions, TqClient};
use crate::workload::{self, fields};

/// The half of a generation rank that makes the engine's rollouts (Generate).
struct Producer {
    plan: Arc<WorkerPlan>,
    engine: u32,
    tq: Option<Arc<TqClient>>,
    metrics: RankMetrics,
    /// The user's engine process, when it does the generation (`spec.generation.template`).
    user: Option<LocalApi>,
    /// How long the rank waits for the user's process, or for weights (the coordinator's bound
    /// on a command).
    timeout: std::time::Duration,
    /// The newest version received and verified.
    received: watch::Receiver<Option<u64>>,
}

/// The half of a generation rank that receives the weights (Refit).
struct Refitter {
    plan: Arc<WorkerPlan>,
    /// Every sender's plan, in the group's sender order (for the digests).
    plans: Vec<Arc<RefitPlan>>,
    receiver: Receiver,
    weights: Weights,
    metrics: RankMetrics,
    user: Option<LocalApi>,
    timeout: std::time::Duration,
    received: watch::Sender<Option<u64>>,
    /// Whether this rank is its engine's producer (its rank 0, where steps run).
    producer: bool,
}

/// A generation rank that runs its commands in order: a refit waits for the step being
/// generated, and the next step for the refit queued before it.
struct Generation {
    producer: Producer,
    refitter: Refitter,
}

/// Runs generation rank `me`.
pub async fn run(
    plan: &WorkerPlan,
    me: u32,
    auth: &JobAuth,
    control: impl Future<Output = Result<ControlClient, ControlError>>,
    metrics: RankMetrics,
) -> anyhow::Result<()> {
    let ProcessRole::Generation(coords) = plan.process(me).role else {
        anyhow::bail!("process {me} is not a generation rank")
    };

    // Listeners first: the storage unit (producers, placement ProducerLocal) and the refit relay.
    let mut local_unit = None;
    let mut serving = None;
    if coords.producer && plan.transfer_queue.placement == TqPlacement::ProducerLocal {
        let unit = plan.storage_units.iter().find(|u| u.process == me).context("no storage unit for this producer")?;
        let (storage, task) =
            super::storage::start_unit(plan, me, unit.id, auth, &metrics, "the producer's storage unit").await?;
        serving = Some(task);
        local_unit = Some(storage);
    }
    let group =
        plan.refit_groups_of(me).into_iter().next().context("this generation rank is in no refit group")?.clone();
    let kind = crate::refit::transport_kind(&group);
    let gpu = refit_side::open_gpu(plan, me, kind)?;
    let refit_listener = refit_side::bind(plan, me, kind, false).await?;
    let tq = match coords.producer {
        true => Some(Arc::new(TqClient::new(ClientConfig::from_plan(plan, me, auth)?, local_unit)?)),
        false => None,
    };
    let user: Option<LocalApi> = if plan.user_processes.generation {
        Some(LocalApi::start(RankInfo {
            plan: Arc::new(plan.clone()),
            me,
            role: sidecar::Role::Engine,
            kind,
            gpu: gpu.clone(),
            expected: plan.manifest().iter().map(|t| Some(t.shape.clone())).collect(),
            offsets: plan.manifest().iter().map(|t| Some(vec![0; t.shape.len()])).collect(),
            shm_dir: sidecar::shm_dir(),
            tq: tq.clone(),
        })?)
    } else {
        None
    };
    announce_ready(metrics.addr());
    let rank_user = user.clone();

    let (control, connected) = tokio::join!(
        control,
        refit_side::connect_receiver(plan, me, auth, &group, kind, gpu.as_ref(), &refit_listener, false)
    );
    let mut control = control?;
    let (receiver, plans) = connected?;
    // The user's engine holds the weights when it does the generation.
    let weights = if user.is_some() {
        Weights::Host(crate::refit::HostTensors::default())
    } else {
        Weights::alloc(kind, gpu.as_ref(), plan.manifest().iter().map(|t| Some(t.size_bytes())))?
    };
    let timeout = std::time::Duration::from_secs(plan.refit.timeout_seconds as u64);
    let shared = Arc::new(plan.clone());
    let (received_tx, received) = watch::channel(None);
    let producer = Producer {
        plan: shared.clone(),
        engine: coords.engine,
        tq,
        metrics: metrics.clone(),
        user: user.clone(),
        timeout,
        received,
    };
    let refitter = Refitter {
        plan: shared,
        plans,
        receiver,
        weights,
        metrics,
        user,
        timeout,
        received: received_tx,
        producer: coords.producer,
    };
    let r = if receives_while_generating(plan) {
        super::lanes::serve_two_lanes(&mut control, producer, refitter, is_refit, &plan.job.token).await
    } else {
        serve_commands(&mut control, &mut Generation { producer, refitter }, &plan.job.token).await
    };
    super::end_user_session(rank_user.as_ref(), &r).await;
    if let Some(s) = serving {
        s.abort();
    }
    r
}

/// Whether this rank receives refits while its engine generates: every engine of an asynchronous
/// job. The synthetic engine's generation reads no weights, so it receives in place and takes
/// each version at a step's start; a user's engine registered staged takes the staging buffers
/// when it chooses (between its steps), and one registered direct has its tensors written only
/// between `end_step` and the next `next_step`. A synchronous job's engines run their commands in
/// order.
fn receives_while_generating(plan: &WorkerPlan) -> bool {
    plan.schedule.max_lag() > 0
}

fn is_refit(command: &Command) -> bool {
    matches!(command, Command::Refit { .. })
}

impl Rank for Generation {
    async fn execute(&mut self, command: Command) -> anyhow::Result<Report> {
        match command {
            Command::Generate { .. } => self.producer.execute(command).await,
            Command::Refit { .. } => self.refitter.execute(command).await,
            other => anyhow::bail!("a generation rank has no part in {}", other.name()),
        }
    }
}

impl Rank for Producer {
    async fn execute(&mut self, command: Command) -> anyhow::Result<Report> {
        match command {
            Command::Generate { step, min_version } => self.generate(step, min_version).await,
            other => anyhow::bail!("a generation rank's producer has no part in {}", other.name()),
        }
    }
}

impl Rank for Refitter {
    async fn execute(&mut self, command: Command) -> anyhow::Result<Report> {
        match command {
            Command::Refit { version, expected } => self.refit(version, expected).await,
            other => anyhow::bail!("a generation rank's receiver has no part in {}", other.name()),
        }
    }
}

impl Producer {
    /// The newest version received, once it is `min_version` or newer: the weights step `step`
    /// is generated with.
    async fn weights_for(&mut self, step: u32, min_version: u64) -> anyhow::Result<u64> {
        let wait = self.received.wait_for(|v| v.is_some_and(|v| v >= min_version));
        match tokio::time::timeout(self.timeout, wait).await {
            Ok(Ok(v)) => Ok(v.expect("waited for a version")),
            Ok(Err(_)) => anyhow::bail!("step {step}: the refit side of this rank is gone"),
            Err(_) => anyhow::bail!(
                "step {step} needs weights of version {min_version} or newer, and none arrived within spec.refit.timeoutSeconds ({} s)",
                self.timeout.as_secs()
            ),
        }
    }

    async fn generate(&mut self, step: u32, min_version: u64) -> anyhow::Result<Report> {
        // Every rollout of the step is made with one version: the newest this rank holds as the
        // step starts (a refit arriving meanwhile is taken at the next step).
        let version = self.weights_for(step, min_version).await?;
        if let Some(local_api) = &self.user {
            // The user's engine generates: hand it the step, wait for its end_step.
            let t = Instant::now();
            local_api.start_step(step, min_version);
            let put = local_api.wait_step_ended(step, tokio::time::Instant::now() + self.timeout).await?;
            self.metrics.tq_put(put.bytes, put.seconds);
            return Ok(Report {
                busy_secs: secs(t),
                bytes: put.bytes,
                samples: put.samples,
                tokens: put.tokens,
                phases: [("generate".to_string(), (secs(t) - put.seconds).max(0.0)), ("put".to_string(), put.seconds)]
                    .into(),
                scalars: local_api.take_scalars(),
                ..Default::default()
            });
        }
        let t = Instant::now();
        let tq = self.tq.as_ref().context("only an engine's producer (engine rank 0) generates")?;
        let w = &self.plan.workload;
        tokio::time::sleep(workload::generate_delay(w, step, self.engine)).await;
        let samples = workload::engine_samples(w, step, self.engine, self.plan.layout.engines);
        let rollouts: Vec<_> = samples.iter().map(|s| workload::rollout(w, step, s)).collect();
        let keys: Vec<String> = samples.iter().map(|s| s.key.clone()).collect();
        let ids: Vec<&[i64]> = rollouts.iter().map(|r| r.input_ids.as_slice()).collect();
        let masks: Vec<&[u8]> = rollouts.iter().map(|r| r.response_mask.as_slice()).collect();
        let logprobs: Vec<&[f32]> = rollouts.iter().map(|r| r.old_logprobs.as_slice()).collect();
        let rewards: Vec<f32> = rollouts.iter().map(|r| r.reward).collect();
        let columns = vec![
            Column::ragged(fields::INPUT_IDS, &ids),
            Column::ragged(fields::RESPONSE_MASK, &masks),
            Column::ragged(fields::OLD_LOGPROBS, &logprobs),
            Column::scalars(fields::REWARD, &rewards),
        ];
        let generate_s = secs(t);
        let t = Instant::now();
        let tokens: Vec<u32> = samples.iter().map(|s| s.tokens() as u32).collect();
        let uid_tags = samples
            .iter()
            .map(|s| {
                vec![
                    ("uid".to_string(), format!("s{step}p{}", s.prompt)),
                    ("engine".to_string(), self.engine.to_string()),
                    crate::tq::version::tag(version),
                ]
            })
            .collect();
        let put = tq
            .put_with(&format!("step-{step}"), &keys, &columns, &PutOptions { tokens: Some(tokens), tags: uid_tags })
            .instrument(tracing::info_span!("tq.put", samples = keys.len()))
            .await
            .with_context(|| format!("putting step {step}'s rollouts"))?;
        let put_s = secs(t);
        self.metrics.tq_put(put.bytes, put_s);
        Ok(Report {
            busy_secs: generate_s + put_s,
            bytes: put.bytes,
            samples: samples.len() as u64,
            tokens: samples.iter().map(|s| s.tokens()).sum(),
            phases: [("generate".to_string(), generate_s), ("put".to_string(), put_s)].into(),
            scalars: workload::rollout_scalars(&rollouts),
            ..Default::default()
        })
    }
}

impl Refitter {
    async fn refit(&mut self, version: u64, expected: u64) -> anyhow::Result<Report> {
        let report = match self.user.clone() {
            Some(local_api) => self.refit_user(&local_api, version, expected).await?,
            None => self.refit_synthetic(version, expected).await?,
        };
        self.received.send_replace(report.version);
        Ok(report)
    }

    async fn refit_synthetic(&mut self, version: u64, expected: u64) -> anyhow::Result<Report> {
        let t = Instant::now();
        let stats =
            self.receiver.receive(&mut self.weights).instrument(tracing::info_span!("refit.receive", version)).await?;
        let busy = secs(t);
        self.metrics.refit(&stats);
        refit_side::refit_event(&stats);
        if stats.version != version {
            anyhow::bail!("received weight version {} where the coordinator announced {version}", stats.version);
        }
        // Check what arrived against the senders' digests (outside the timed refit).
        let t = Instant::now();
        let verify_policy = self.plan.refit.verify;
        let digest = received_digest(&self.plans, |p, pos| {
            self.weights.digest(p, Side::Destination, verify_policy, version, |i| segment_id(pos, i))
        })?;
        let verify = secs(t);
        if let Some(d) = digest {
            check_digest(version, d, expected)?;
        }
        let held = self.receiver.state().current();
        if let Some(v) = held {
            self.metrics.weight_version(v);
        }
        Ok(refit_report(&stats, held, digest, busy, verify))
    }
}

impl Refitter {
    /// Refit into the user engine's registered tensors (or the staging buffers it loads from).
    async fn refit_user(&mut self, local_api: &LocalApi, version: u64, expected: u64) -> anyhow::Result<Report> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        local_api.wait_registered(deadline).await?;
        let _writing = if local_api.staged() {
            local_api.begin_staging_write(deadline).await?;
            RefitWrite(local_api)
        } else if !self.producer && receives_while_generating(&self.plan) {
            // Only the producer rank sees the engine's steps; this rank's tensors could be
            // written while rank 0's step runs on them.
            anyhow::bail!(
                "this rank of a tensor-parallel engine (not its rank 0) registered its weights direct, and in an \
                 asynchronous job (spec.schedule) refits arrive while the engine generates: register staged \
                 (engine.register_staged(), as rlplane.vllm does) and take each version between steps"
            );
        } else {
            local_api.begin_direct_refit(deadline).await?;
            RefitWrite(local_api)
        };
        let mut weights = local_api.weights().await;
        let w = weights.as_mut().context("the engine process's weights are not registered")?;
        let t = Instant::now();
        let received = self.receiver.receive(w).instrument(tracing::info_span!("refit.receive", version)).await;
        let busy = secs(t);
        let stats = match received {
            Ok(s) => s,
            Err(e) => {
                local_api.set_held(self.receiver.state());
                return Err(e);
            }
        };
        self.metrics.refit(&stats);
        refit_side::refit_event(&stats);
        let t = Instant::now();
        let verify_policy = self.plan.refit.verify;
        let digest = received_digest(&self.plans, |p, pos| {
            w.digest(p, Side::Destination, verify_policy, version, |i| segment_id(pos, i))
        });
        let verify = secs(t);
        drop(weights);
        let checked = digest.and_then(|d| {
            anyhow::ensure!(stats.version == version, "received weight version {} for {version}", stats.version);
            if let Some(d) = d {
                check_digest(version, d, expected)?;
            }
            Ok(d)
        });
        let digest = match checked {
            Ok(d) => d,
            Err(e) => {
                local_api.set_held(crate::refit::WeightsState::Incomplete(version));
                return Err(e);
            }
        };
        let held = self.receiver.state();
        local_api.set_held(held);
        if let Some(v) = held.current() {
            self.metrics.weight_version(v);
        }
        Ok(refit_report(&stats, held.current(), digest, busy, verify))
    }
}

/// A refit writing into a user engine's own tensors (its next step waits) or the staging buffers
/// (they are not lent): until it is dropped, after the held version is set, also when the refit
/// fails.
struct RefitWrite<'a>(&'a LocalApi);

impl Drop for RefitWrite<'_> {
    fn drop(&mut self) {
        self.0.end_refit_write();
    }
}

/// The digest of everything a receiver got from every sender of its group, `digest(plan, pos)`
/// being one sender's (`None` when the job's `refit.verify` is `Off`).
fn received_digest(
    plans: &[Arc<RefitPlan>],
    digest: impl Fn(&RefitPlan, usize) -> anyhow::Result<Option<u64>>,
) -> anyhow::Result<Option<u64>> {
    let mut total = None;
    for (pos, p) in plans.iter().enumerate() {
        if let Some(d) = digest(p, pos)? {
            total = Some(total.unwrap_or(0u64).wrapping_add(d));
        }
    }
    Ok(total)
}

/// Refuses weights whose digest differs from the senders'.
fn check_digest(version: u64, received: u64, expected: u64) -> anyhow::Result<()> {
    anyhow::ensure!(
        received == expected,
        "weights of version {version} do not match the trainer's digest ({received:#018x} received, {expected:#018x} sent)"
    );
    Ok(())
}

/// A receiver's report of a refit: what it holds now, the digest it checked (if any), its phases.
fn refit_report(
    stats: &crate::refit::RefitStats,
    held: Option<u64>,
    digest: Option<u64>,
    busy: f64,
    verify: f64,
) -> Report {
    Report {
        busy_secs: busy + verify,
        bytes: stats.bytes,
        version: held,
        digest,
        phases: [
            ("transfer".to_string(), stats.transfer_secs),
            ("unpack".to_string(), stats.unpack_secs),
            ("wait".to_string(), stats.buffer_wait_secs),
            ("total".to_string(), stats.total_secs),
            ("verify".to_string(), verify),
        ]
        .into(),
        counters: [("direct_bytes".to_string(), stats.direct_bytes), ("staged_bytes".to_string(), stats.staged_bytes)]
            .into(),
        ..Default::default()
    }
}
