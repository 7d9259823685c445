//! A trainer rank: the stand-in for a Megatron/FSDP rank holding its shard of the weights.
//!
//! - Train: a data-parallel leader fetches its shard's batch straight from the storage units and
//!   fans it out to its followers (shapes first, then data); every rank digests the batch; the
//!   leader writes back a per-token field (its "log-probabilities"). With `fetch: Independent`
//!   every rank fetches for itself.
//! - Update: every rank rewrites its shard from the step's seed — each tensor's new bytes derive
//!   from the step and the digests of the whole step's batches, so the result is checkable.
//! - Refit (senders): send the shard to every generation rank of the group.

use std::time::Instant;

use anyhow::Context;
use rlplane_api::plan::{ProcessRole, TrainerCoords, WorkerPlan};
use rlplane_api::{RefitVerify, TqFetch};
use tokio::net::TcpListener;
use tracing::Instrument;

use super::refit_side::{self, Sender, Side, Weights, segment_id};
use super::{Rank, announce_ready, secs, serve_commands, startup_timeout};
use crate::control::{Command, ControlClient, ControlError, POLICY_LAG_COUNTER, Report};
use crate::digest::Digest;
use crate::gpu::Gpu;
use crate::metrics::RankMetrics;
use crate::net::JobAuth;
use crate::refit::TransportKind as Kind;
use crate::refit::{self, RefitPlan, SenderLayout};
use crate::sidecar::{self, LocalApi, RankInfo};
use crate::tq::fanout::{FanoutReceiver, FanoutSender, TcpFanoutFollower, TcpFanoutLeader};
use crate::tq::{Batch, BatchMeta, ClientConfig, Column, TqClient};
use crate::workload::{self, fields, trainer_logprobs};

enum Fanout {
    Leader(TcpFanoutLeader),
    Follower(TcpFanoutFollower),
    None,
}

struct Trainer {
    coords: TrainerCoords,
    tq: TqClient,
    fanout: Fanout,
    /// The layout of this rank's shard (a sender's refit plan, or the shard it would send).
    shard_plan: RefitPlan,
    shard: Weights,
    /// Set on refit senders: the stream and this sender's position in its group.
    sender: Option<(Sender, usize)>,
    metrics: RankMetrics,
    /// The user's trainer process, when it does the training (`spec.trainer.template`).
    user: Option<LocalApi>,
    /// How long the rank waits for the user's process (the coordinator's bound on a command).
    timeout: std::time::Duration,
    /// How receivers check each refit (`spec.refit.verify`): what this sender digests.
    verify: RefitVerify,
    /// The step and digest of the last batch trained on: the update's seed when the coordinator
    /// leaves it to the rank.
    last_batch: Option<(u32, u64)>,
    /// The synthetic trainer's checkpoints (rank 0 reports them): the cadence and the URI prefix.
    /// Its weights at a version derive from that version's seed alone, so a checkpoint holds
    /// nothing to save: resuming regenerates them.
    synthetic_checkpoints: Option<(rlplane_api::CheckpointSpec, String)>,
    /// The policy lag a sample of a batch may have (`spec.schedule`): checked here, where the
    /// batch arrives, whatever the coordinator's schedule did.
    max_lag: u32,
    /// The synthetic workload (its simulated training time).
    workload: rlplane_api::WorkloadSpec,
}

/// Runs trainer rank `me`.
pub async fn run(
    plan: &WorkerPlan,
    me: u32,
    auth: &JobAuth,
    control: impl Future<Output = Result<ControlClient, ControlError>>,
    metrics: RankMetrics,
) -> anyhow::Result<()> {
    let ProcessRole::Trainer(coords) = plan.process(me).role else {
        anyhow::bail!("process {me} is not a trainer rank")
    };
    let group = plan.refit_groups_of(me).into_iter().find(|g| g.senders.contains(&me)).cloned();
    let deadline = tokio::time::Instant::now() + startup_timeout(plan);

    // The transport (and so the memory) follows the group this rank sends to, or any group.
    let kind = match group.as_ref().or(plan.refit_groups.first()) {
        Some(g) => refit::transport_kind(g),
        None => Kind::Tcp,
    };
    let gpu = refit_side::open_gpu(plan, me, kind)?;
    // Listeners first: refit rendezvous (senders) and fan-out (leaders).
    let refit_listener = match &group {
        Some(_) => Some(refit_side::bind(plan, me, kind, true).await?),
        None => None,
    };
    let shard_plan = shard_layout(plan, me, &coords, group.is_some())?;
    let user = if plan.user_processes.trainer {
        Some(start_user_link(plan, me, kind, gpu.clone(), &shard_plan)?)
    } else {
        None
    };
    let fanout_listener = match plan.process(me).ports.fanout {
        Some(port) => Some(crate::net::bind(&plan.bind_address(me, port), "the fan-out leader").await?),
        None => None,
    };
    announce_ready(metrics.addr());

    let fanout = connect_fanout(plan, me, auth, fanout_listener.as_ref(), deadline);
    let sender = async {
        let (Some(g), Some(listener)) = (&group, &refit_listener) else { return anyhow::Ok(None) };
        let pos = g.senders.iter().position(|&s| s == me).expect("a sender of its group");
        let s = refit_side::connect_sender(plan, me, auth, g, kind, gpu.as_ref(), listener, false).await?;
        Ok(Some((s, pos)))
    };
    let (control, fanout, sender) = tokio::join!(control, fanout, sender);
    let mut control = control?;
    let fanout = fanout?;
    let sender = sender?;

    // The user's process holds the weights when it does the training.
    let shard = if user.is_some() {
        Weights::Host(crate::refit::HostTensors::default())
    } else {
        Weights::alloc(kind, gpu.as_ref(), shard_plan.tensors().iter().map(|t| t.source_bytes))?
    };
    let tq = TqClient::new(ClientConfig::from_plan(plan, me, auth)?, None)?;
    let timeout = std::time::Duration::from_secs(plan.refit.timeout_seconds as u64);
    let verify = plan.refit.verify;
    let synthetic_checkpoints = (user.is_none() && coords.rank == 0 && !plan.checkpoint.is_off())
        .then(|| (plan.checkpoint.clone(), format!("synthetic:{}/{}", plan.job.namespace, plan.job.name)));
    let mut rank = Trainer {
        coords,
        tq,
        fanout,
        shard_plan,
        shard,
        sender,
        metrics,
        user,
        timeout,
        verify,
        last_batch: None,
        synthetic_checkpoints,
        max_lag: plan.schedule.max_lag(),
        workload: plan.workload.clone(),
    };
    let served = serve_commands(&mut control, &mut rank, &plan.job.token).await;
    super::end_user_session(rank.user.as_ref(), &served).await;
    served
}

/// This rank's shard layout: the plan it sends with (`sends`: a refit sender), or the shard it
/// would send.
fn shard_layout(plan: &WorkerPlan, me: u32, coords: &TrainerCoords, sends: bool) -> anyhow::Result<RefitPlan> {
    Ok(if sends {
        refit::sender_plan(plan, me)?
    } else {
        RefitPlan::sharded(
            &plan.manifest(),
            refit::bucket_bytes(plan)?,
            plan.refit.align_bytes,
            refit::shard_coords(plan, coords),
        )?
    })
}

/// Starts the sidecar of the user's trainer process, which expects from it the part of each
/// tensor that `shard_plan` holds.
fn start_user_link(
    plan: &WorkerPlan,
    me: u32,
    kind: Kind,
    gpu: Option<Gpu>,
    shard_plan: &RefitPlan,
) -> anyhow::Result<LocalApi> {
    let manifest = plan.manifest();
    // Each tensor's part this rank holds: (shape, offset in the full tensor).
    let (expected, offsets) = manifest
        .iter()
        .zip(shard_plan.tensors())
        .map(|(t, e)| {
            e.source_bytes?;
            match shard_plan.layout() {
                SenderLayout::Full => Some((t.shape.clone(), vec![0; t.shape.len()])),
                SenderLayout::Sharded(c) => Some((refit::plan::shard_shape(t, c)?, refit::plan::shard_offset(t, c)?)),
            }
        })
        .map(|b| b.map_or((None, None), |(s, o)| (Some(s), Some(o))))
        .unzip();
    LocalApi::start(RankInfo {
        plan: std::sync::Arc::new(plan.clone()),
        me,
        role: sidecar::Role::Trainer,
        kind,
        gpu,
        expected,
        offsets,
        shm_dir: sidecar::shm_dir(),
        tq: None,
    })
}

/// Joins this rank's fan-out group when leaders broadcast the batch: as its leader when it
/// has the group's `listener`, else as a follower.
async fn connect_fanout(
    plan: &WorkerPlan,
    me: u32,
    auth: &JobAuth,
    listener: Option<&TcpListener>,
    deadline: tokio::time::Instant,
) -> anyhow::Result<Fanout> {
    if plan.transfer_queue.fetch != TqFetch::LeaderBroadcast {
        return Ok(Fanout::None);
    }
    Ok(match listener {
        Some(l) => {
            let g = plan.fanout_group_of(me).context("a leader without a fan-out group")?;
            let followers: Vec<String> =
                g.members.iter().filter(|&&m| m != me).map(|&m| plan.process(m).name.clone()).collect();
            Fanout::Leader(TcpFanoutLeader::accept(l, auth, &followers, deadline).await?)
        }
        None => Fanout::Follower(TcpFanoutFollower::from_plan(plan, me, auth, deadline).await?),
    })
}

impl Rank for Trainer {
    async fn execute(&mut self, command: Command) -> anyhow::Result<Report> {
        match command {
            Command::Train { step, batch } => self.train(step, batch).await,
            Command::Update { step, seed } => self.update(step, seed).await,
            Command::Refit { version, .. } => self.refit(version).await,
            other => anyhow::bail!("a trainer rank has no part in {}", other.name()),
        }
    }
}

/// A trainer rank's report of a step's batch.
fn train_report(
    batch: &Batch,
    fetched: u64,
    digest: u64,
    phases: std::collections::BTreeMap<String, f64>,
    busy: f64,
    lag: u64,
) -> Report {
    Report {
        busy_secs: busy,
        bytes: fetched,
        samples: batch.meta.len() as u64,
        tokens: batch.meta.total_tokens(),
        digest: Some(digest),
        phases,
        // The largest policy lag in the batch, as this rank checked it on arrival.
        counters: [(POLICY_LAG_COUNTER.to_string(), lag)].into(),
        ..Default::default()
    }
}

/// Digest of a batch as fetched: every column's values and offsets in order.
fn batch_digest(batch: &Batch) -> u64 {
    let mut d = Digest::new();
    for c in &batch.columns {
        d.update(c.name().as_bytes());
        d.update(c.values());
        for o in c.offsets() {
            d.update(&o.to_le_bytes());
        }
    }
    d.finish()
}

impl Trainer {
    async fn train(&mut self, step: u32, meta: Option<BatchMeta>) -> anyhow::Result<Report> {
        let synthetic = [fields::INPUT_IDS, fields::RESPONSE_MASK, fields::OLD_LOGPROBS, fields::REWARD];
        // The user's trainer gets every field its engine put.
        let schema: Vec<String> = meta.iter().flat_map(|m| m.schema.iter().map(|f| f.name.clone())).collect();
        let all: Vec<&str> = schema.iter().map(String::as_str).collect();
        let wanted: &[&str] = if self.user.is_some() { &all } else { &synthetic };
        let mut phases = std::collections::BTreeMap::new();
        let t0 = Instant::now();
        let (batch, fetched) = match (&mut self.fanout, meta) {
            (Fanout::Follower(f), _) => {
                let t = Instant::now();
                let b = f
                    .receive()
                    .instrument(tracing::info_span!("tq.fanout"))
                    .await
                    .with_context(|| format!("receiving step {step}'s batch from the leader"))?;
                phases.insert("fanout".to_string(), secs(t));
                (b, 0)
            }
            (fanout, Some(meta)) => {
                let t = Instant::now();
                let b = self
                    .tq
                    .get(&meta, wanted)
                    .instrument(tracing::info_span!("tq.get", samples = meta.len()))
                    .await
                    .with_context(|| format!("fetching step {step}'s batch"))?;
                phases.insert("fetch".to_string(), secs(t));
                let bytes = b.columns.iter().map(|c| c.nbytes() as u64).sum();
                self.metrics.tq_get(bytes, secs(t));
                if let Fanout::Leader(l) = fanout {
                    let t = Instant::now();
                    l.broadcast(&b)
                        .instrument(tracing::info_span!("tq.fanout"))
                        .await
                        .with_context(|| format!("fanning step {step}'s batch out"))?;
                    phases.insert("fanout".to_string(), secs(t));
                }
                (b, bytes)
            }
            (_, None) => anyhow::bail!("step {step}: no batch to fetch and no leader to receive one from"),
        };
        let lag = crate::tq::version::check_batch(&batch.meta, step, self.max_lag)?;
        let t = Instant::now();
        let digest = batch_digest(&batch);
        self.last_batch = Some((step, digest));
        if let Some(local_api) = &self.user {
            // The user's trainer takes it from here (next_batch).
            local_api
                .deliver_batch(step, &batch)
                .with_context(|| format!("handing step {step}'s batch to the trainer process"))?;
            phases.insert("deliver".to_string(), secs(t));
            return Ok(train_report(&batch, fetched, digest, phases, secs(t0), lag));
        }
        tokio::time::sleep(workload::train_delay(&self.workload, step, self.coords.rank)).await;
        let ids = batch.columns.iter().find(|c| c.name() == fields::INPUT_IDS).context("the batch lacks input_ids")?;
        let masks = batch
            .columns
            .iter()
            .find(|c| c.name() == fields::RESPONSE_MASK)
            .context("the batch lacks response_mask")?;
        let mut logprobs = Vec::with_capacity(batch.meta.len());
        for i in 0..batch.meta.len() {
            logprobs.push(trainer_logprobs(&ids.sample_as::<i64>(i)?, &masks.sample_as::<u8>(i)?));
        }
        phases.insert("compute".to_string(), secs(t));
        // Only leaders write back; the transfer-queue client refuses a follower's write.
        if self.coords.leader {
            let t = Instant::now();
            let views: Vec<&[f32]> = logprobs.iter().map(Vec::as_slice).collect();
            self.tq
                .write_back(&batch.meta, fields::LOGPROBS, &Column::ragged(fields::LOGPROBS, &views))
                .instrument(tracing::info_span!("tq.write_back"))
                .await
                .with_context(|| format!("writing back step {step}'s log-probabilities"))?;
            phases.insert("writeback".to_string(), secs(t));
        }
        Ok(train_report(&batch, fetched, digest, phases, secs(t0), lag))
    }

    async fn update(&mut self, step: u32, seed: Option<u64>) -> anyhow::Result<Report> {
        let t = Instant::now();
        if let Some(local_api) = &self.user {
            // The user's optimizer step is the update: wait for its publish.
            let version = step as u64;
            local_api.wait_published(version, tokio::time::Instant::now() + self.timeout).await?;
            let waited = secs(t);
            let t = Instant::now();
            let weights = local_api.weights().await;
            let w = weights.as_ref().context("the trainer process published without registered weights")?;
            // The senders' digest of the version, computed once here whatever the number of
            // receivers; each receiver's check compares with it.
            let digest = match &self.sender {
                Some((_, pos)) => {
                    w.digest(&self.shard_plan, Side::Source, self.verify, version, |i| segment_id(*pos, i))?
                }
                None => {
                    // Nothing to send from this rank: its publish is done once recorded.
                    local_api.refit_finished(
                        version,
                        Ok(serde_json::json!({"ok": true, "version": version, "refit_s": 0.0, "bytes": 0})),
                    );
                    None
                }
            };
            // The user's training is work, not control: the whole wait counts as busy.
            return Ok(Report {
                busy_secs: waited + secs(t),
                digest,
                bytes: w.total_bytes(),
                phases: [("user".to_string(), waited), ("digest".to_string(), secs(t))].into(),
                checkpoint: local_api.take_checkpoint(),
                scalars: local_api.take_scalars(),
                ..Default::default()
            });
        }
        let seed = match (seed, self.last_batch) {
            (Some(seed), _) => seed,
            // One data-parallel shard: its batch digest (this rank's) is the only one.
            (None, Some((s, digest))) if s == step => crate::control::update_seed(step, &[digest]),
            (None, _) => {
                anyhow::bail!("step {step}: no seed for the update and no batch of this step to derive it from")
            }
        };
        self.shard.update(&self.shard_plan, seed)?;
        // Senders report the digest of what they will send (once per version, whatever the number
        // of receivers); the receivers must match it.
        let digest = match &self.sender {
            Some((_, pos)) => {
                self.shard.digest(&self.shard_plan, Side::Source, self.verify, step as u64, |i| segment_id(*pos, i))?
            }
            None => None,
        };
        let checkpoint = match &self.synthetic_checkpoints {
            Some((every, uri)) if every.due(step as u64) => {
                Some(rlplane_api::CheckpointRef { step: step as u64, uri: format!("{uri}/step-{step}") })
            }
            _ => None,
        };
        Ok(Report { busy_secs: secs(t), digest, bytes: self.shard.total_bytes(), checkpoint, ..Default::default() })
    }

    async fn refit(&mut self, version: u64) -> anyhow::Result<Report> {
        let (sender, _) = self.sender.as_mut().context("this trainer rank sends no refit")?;
        let t = Instant::now();
        let stats = match &self.user {
            Some(local_api) => {
                let weights = local_api.weights().await;
                let sent = match weights.as_ref() {
                    Some(w) => {
                        sender.lend_imported(w.imported());
                        sender.send(version, w).instrument(tracing::info_span!("refit.send", version)).await
                    }
                    None => Err(anyhow::anyhow!("the trainer process's weights are not registered")),
                };
                let outcome = match &sent {
                    Ok(s) => Ok(
                        serde_json::json!({"ok": true, "version": version, "refit_s": s.total_secs, "bytes": s.bytes}),
                    ),
                    Err(e) => Err(format!("{} sending version {version}: {e:#}", self.metrics_name())),
                };
                local_api.refit_finished(version, outcome);
                sent?
            }
            None => sender.send(version, &self.shard).instrument(tracing::info_span!("refit.send", version)).await?,
        };
        self.metrics.refit(&stats);
        refit_side::refit_event(&stats);
        Ok(Report {
            busy_secs: secs(t),
            bytes: stats.bytes,
            phases: [
                ("pack".to_string(), stats.pack_secs),
                ("transfer".to_string(), stats.transfer_secs),
                ("wait".to_string(), stats.buffer_wait_secs),
                ("total".to_string(), stats.total_secs),
            ]
            .into(),
            counters: [
                ("direct_bytes".to_string(), stats.direct_bytes),
                ("staged_bytes".to_string(), stats.staged_bytes),
            ]
            .into(),
            ..Default::default()
        })
    }
}

impl Trainer {
    /// This rank's name, for errors the user's process reads.
    fn metrics_name(&self) -> String {
        format!("trainer rank {}", self.coords.rank)
    }
}
