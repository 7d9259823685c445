//! The step coordinator: drives `workload.steps` GRPO-shaped steps over the ranks of a job.
//!
//! It runs beside trainer rank 0 (in pod `<job>-trainer-0`; in-process in `rlplane local`) and
//! hosts the transfer-queue controller. It only ever sees metadata: commands and reports over the
//! control plane, sample metadata through the controller. One step:
//!
//! 1. **generate**: every generation producer makes its engine's rollouts and puts them into the
//!    transfer queue (bytes stay in the producer's storage unit, or go to a dedicated one);
//! 2. **claim + assign**: the coordinator claims the step's samples (metadata only) and assigns
//!    them to the trainer's data-parallel shards, balancing tokens (longest first);
//! 3. **train**: each shard's leader fetches its samples straight from the storage units, fans
//!    them out to its followers, writes back a per-token field; the update's seed derives from the
//!    step and the leaders' batch digests, and every trainer rank rewrites its shard from it;
//!    the partition is cleared;
//! 4. **refit**: version = step moves from the trainer senders to every generation rank, which
//!    checks what it received against the senders' digests and reports its version.
//!
//! It waits for an answer only where the next command needs it; other commands go out queued
//! behind the one they follow (a sender's refit behind its update, a one-rank engine's next
//! Generate behind its refit, the update with Train when it needs no seed from here), so a step
//! costs two or three command round trips instead of four (docs/architecture.md, "One step").

mod window;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use rlplane_api::TqFetch;
use rlplane_api::plan::{ProcessRole, WorkerPlan};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tracing::Instrument;

use crate::control::{
    Command, ControlError, ControlServer, POLICY_LAG_COUNTER, Pending, Report, percentile_us, update_seed,
};
use crate::net::JobAuth;
use crate::reservoir::Reservoir;
use crate::tq::{Assignment, BatchMeta, Claim, ControllerConfig, TqController, assign};
use crate::workload::fields;
pub use window::GenerationWindow;

/// Consumer group under which the trainer claims.
pub const TRAINER_GROUP: &str = "trainer";

/// Errors of the coordinator.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// The control plane failed (a rank failed, died or timed out).
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The transfer queue refused something.
    #[error("step {step}: transfer queue: {message}")]
    Queue {
        /// Step.
        step: u32,
        /// What happened.
        message: String,
    },
    /// A check of the data failed.
    #[error("step {step}: {message}")]
    Check {
        /// Step.
        step: u32,
        /// What disagreed.
        message: String,
    },
}

impl CoordinatorError {
    /// The rank the error is about, when one rank failed or was lost.
    pub fn rank(&self) -> Option<&str> {
        match self {
            CoordinatorError::Control(ControlError::Lost { rank, .. } | ControlError::RankFailed { rank, .. }) => {
                Some(rank)
            }
            _ => None,
        }
    }
}

/// Progress events, for a progress bar or log lines.
#[derive(Clone, Debug)]
pub enum Progress {
    /// Every rank connected.
    Connected {
        /// Ranks.
        ranks: usize,
    },
    /// A step's phase began.
    Phase {
        /// Step.
        step: u32,
        /// Phase name.
        phase: &'static str,
    },
    /// The initial weights reached every engine.
    InitialSync {
        /// Their version: 0, or the step of the checkpoint the run resumed from.
        version: u32,
        /// Seconds it took.
        seconds: f64,
    },
    /// The trainer saved a checkpoint (the newest it reported this step).
    Checkpoint(rlplane_api::CheckpointRef),
    /// A step finished.
    StepDone(Box<StepRecord>),
    /// A wait has lasted [`crate::patience::REPORT_EVERY`] or longer: what it waits for; `None`
    /// once it ended. The waits log it themselves; this is for the job's status.
    Stalled(Option<crate::patience::Stall>),
}

/// Receives progress events.
pub trait Observer: Send + Sync {
    /// One event.
    fn progress(&self, event: Progress);
}

/// Logs progress as plain lines.
pub struct LogObserver;

impl Observer for LogObserver {
    fn progress(&self, event: Progress) {
        match event {
            Progress::Connected { ranks } => tracing::info!(ranks, "every rank connected"),
            Progress::InitialSync { version, seconds } => {
                tracing::info!(version, seconds = format!("{seconds:.3}"), "initial weights loaded everywhere")
            }
            Progress::Checkpoint(cp) => tracing::info!(step = cp.step, uri = cp.uri, "the trainer saved a checkpoint"),
            Progress::Phase { step, phase } => tracing::debug!(step, phase, "phase"),
            Progress::StepDone(r) => tracing::info!(
                step = r.step,
                seconds = format!("{:.3}", r.total_s),
                refit_s = format!("{:.3}", r.refit_s),
                version = r.version,
                "step done"
            ),
            // The wait that stalled logged it already (crate::patience).
            Progress::Stalled(_) => {}
        }
    }
}

/// What one step measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StepRecord {
    /// Step (1-based).
    pub step: u32,
    /// Weight version every generation rank holds after it.
    pub version: u64,
    /// Wall time of the step.
    pub total_s: f64,
    /// Generate phase (rollouts made and put): the slowest producer's work, or the wait for it
    /// when longer. A producer may start during the previous step's refit (as soon as it holds
    /// the new weights), so the phase can be longer than the step's wait for it.
    pub generate_s: f64,
    /// Moving rollouts: claim + assignment + the leaders' fetch, fan-out and write-back.
    pub transfer_s: f64,
    /// Training: the train phase without its data movement, plus the weight update.
    pub train_s: f64,
    /// Refit: the slowest rank's refit (every receiver holds the new version at its end).
    pub refit_s: f64,
    /// Checking the received weights against the senders' digests (the synthetic workload's
    /// end-to-end check; a real engine would not spend it).
    pub verify_s: f64,
    /// Control-plane time: phase wall time not spent in any rank's work, plus metadata work on
    /// the critical path (the claim).
    pub control_s: f64,
    /// `control_s` by where it was spent: a phase (or stretch of phases whose commands were sent
    /// together), the claim, a clear that outlasted the refit.
    pub control_phases: BTreeMap<String, f64>,
    /// Samples.
    pub samples: u64,
    /// Tokens.
    pub tokens: u64,
    /// Bytes put into the transfer queue.
    pub put_bytes: u64,
    /// Seconds of the slowest producer's puts.
    pub put_s: f64,
    /// Bytes fetched by the trainer.
    pub get_bytes: u64,
    /// Seconds of the slowest leader's fetch.
    pub get_s: f64,
    /// Seconds of the trainer group's claim of the step's samples (metadata only).
    pub claim_s: f64,
    /// Bytes every generation rank received in the refit.
    pub refit_bytes_per_receiver: u64,
    /// Receivers.
    pub refit_receivers: u64,
    /// Refit per-phase seconds, the maximum over ranks (pack, transfer, unpack, wait...).
    pub refit_phases: HashMap<String, f64>,
    /// max/mean tokens over data-parallel shards.
    pub imbalance: f64,
    /// The step's scalars (reward, KL, lengths…): for each name, the mean over the ranks that
    /// reported it (the engines with their rollouts, the trainer ranks with their update).
    pub scalars: BTreeMap<String, f64>,
    /// Samples trained on, by policy lag: entry `l` counts those generated with the weights of
    /// version `step − 1 − l` (all in entry 0 when synchronous).
    pub policy_lags: Vec<u64>,
    /// The largest policy lag any trainer rank found in its batch as it arrived.
    pub trainer_lag_max: u64,
    /// Samples dropped at the claim because they lagged more than `maxPolicyLag` (none unless a
    /// producer labels rollouts with weights older than the schedule handed it).
    pub stale_dropped: u64,
    /// The step's wall time the busiest engine producer spent neither generating nor refitting:
    /// with no command to work on. A refit counts as work, its wait for the senders included.
    pub engine_idle_s: f64,
    /// The step's wall time the busiest trainer rank spent neither training, updating nor
    /// sending its refit (its wait for busy receivers included in the refit).
    pub trainer_idle_s: f64,
}

/// Everything a run measured, in memory that does not grow with the number of steps unless the
/// run keeps every step's record (`rlplane local --json`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunRecord {
    /// Seconds to load the initial weights (version 0) into every engine.
    pub initial_sync_s: f64,
    /// The policy lag the schedule allowed (`spec.schedule`; 0: synchronous).
    pub max_policy_lag: u32,
    /// Every step's record where the run keeps them ([`RunRecord::keeping_steps`]); else empty.
    pub steps: Vec<StepRecord>,
    /// Whether [`RunRecord::steps`] keeps every step.
    #[serde(skip)]
    pub keep_steps: bool,
    /// What the summary needs of every step, in constant memory.
    #[serde(skip)]
    pub totals: StepTotals,
    /// Commands whose round trip was timed.
    pub dispatches: u64,
    /// Round trips of the commands (their way to the rank and their answer's way back, the
    /// rank's work taken out), microseconds: every one up to [`crate::reservoir::RESERVOIR_CAP`],
    /// a uniform sample past it.
    pub dispatch_us: Vec<f64>,
    /// One way (send → the rank has it), microseconds, sampled the same way; only when every pod
    /// shares one host.
    pub one_way_us: Vec<f64>,
}

impl RunRecord {
    /// A record that keeps every step's record too (for `--json`).
    pub fn keeping_steps() -> RunRecord {
        RunRecord { keep_steps: true, ..RunRecord::default() }
    }

    /// Records a finished step.
    pub fn add_step(&mut self, r: StepRecord) {
        self.totals.add(&r);
        if self.keep_steps {
            self.steps.push(r);
        }
    }
}

/// Sums, maxima and bounded samples over a run's steps: what [`Summary::of`] reads. Percentiles
/// and medians are exact up to [`crate::reservoir::RESERVOIR_CAP`] steps and estimated from a
/// uniform sample past it.
#[derive(Clone, Debug, Default)]
pub struct StepTotals {
    steps: u32,
    generate_s: f64,
    transfer_s: f64,
    train_s: f64,
    refit_s: f64,
    verify_s: f64,
    total_s: f64,
    control_s: f64,
    imbalance: f64,
    imbalance_max: f64,
    first_refit_bytes_per_receiver: Option<u64>,
    refit_bytes_total: u64,
    put_bytes: u64,
    get_bytes: u64,
    policy_lags: Vec<u64>,
    trainer_lag_max: u64,
    stale_dropped: u64,
    engine_idle_s: f64,
    trainer_idle_s: f64,
    refit_times: Reservoir<f64>,
    refit_gbps: Reservoir<f64>,
    put_gbps: Reservoir<f64>,
    get_gbps: Reservoir<f64>,
}

impl StepTotals {
    fn add(&mut self, s: &StepRecord) {
        let rate = |bytes: u64, secs: f64| if secs > 0.0 { bytes as f64 / secs / 1e9 } else { 0.0 };
        self.steps += 1;
        self.generate_s += s.generate_s;
        self.transfer_s += s.transfer_s;
        self.train_s += s.train_s;
        self.refit_s += s.refit_s;
        self.verify_s += s.verify_s;
        self.total_s += s.total_s;
        self.control_s += s.control_s;
        self.imbalance += s.imbalance;
        self.imbalance_max = self.imbalance_max.max(s.imbalance);
        self.first_refit_bytes_per_receiver.get_or_insert(s.refit_bytes_per_receiver);
        self.refit_bytes_total += s.refit_bytes_per_receiver * s.refit_receivers;
        self.put_bytes += s.put_bytes;
        self.get_bytes += s.get_bytes;
        if self.policy_lags.len() < s.policy_lags.len() {
            self.policy_lags.resize(s.policy_lags.len(), 0);
        }
        for (total, n) in self.policy_lags.iter_mut().zip(&s.policy_lags) {
            *total += n;
        }
        self.trainer_lag_max = self.trainer_lag_max.max(s.trainer_lag_max);
        self.stale_dropped += s.stale_dropped;
        self.engine_idle_s += s.engine_idle_s;
        self.trainer_idle_s += s.trainer_idle_s;
        self.refit_times.push(s.refit_s);
        self.refit_gbps.push(rate(s.refit_bytes_per_receiver, s.refit_s));
        self.put_gbps.push(rate(s.put_bytes, s.put_s));
        self.get_gbps.push(rate(s.get_bytes, s.get_s));
    }
}

/// How much longer than `spec.refit.timeoutSeconds` the coordinator waits for a command. A rank
/// bounds its own waits by timeoutSeconds (the user's process: publish, end_step, registering;
/// refit's connects and buckets) from when the command arrives, after the coordinator started its
/// clock, and its error says what it waited for. Without this grace the coordinator's generic
/// "timed out waiting for trainer-0 to finish update" always won that race — a trainer process
/// that never published never heard why, and `rlplane local` blamed whichever rank exited first
/// once the control channel closed (python/tests/test_integration_more.py).
pub const RANK_DEADLINE_GRACE: Duration = Duration::from_secs(3);

/// Runs the job's steps. `control` and `tq` are already bound (so ranks can connect as soon as
/// they start); every rank must prove it holds the epoch's key in `auth`. With `keep_steps` the
/// record keeps every step's record (memory grows with the steps); without, only what the summary
/// needs.
pub async fn run(
    plan: &WorkerPlan,
    auth: &JobAuth,
    control: TcpListener,
    tq: TcpListener,
    observer: &dyn Observer,
    keep_steps: bool,
) -> Result<RunRecord, CoordinatorError> {
    let timeout = Duration::from_secs(plan.refit.timeout_seconds as u64);
    let startup = Duration::from_secs(120).max(timeout);
    // The coordinator's bound on a command is the backstop: see RANK_DEADLINE_GRACE.
    let timeout = timeout + RANK_DEADLINE_GRACE;
    let ranks: Vec<String> = plan
        .processes
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as u32 != plan.coordinator)
        .map(|(_, p)| p.name.clone())
        .collect();

    let controller = TqController::new(ControllerConfig::from_plan(plan, auth));
    let serving = controller.clone();
    let serving_task = tokio::spawn(async move {
        if let Err(e) = serving.serve(tq).await {
            tracing::error!(error = %e, "transfer-queue controller stopped");
        }
    });
    controller.watch_units(Duration::from_secs(1));

    // Long waits publish what they wait for; the observer hears it while the steps go on.
    let (stall_tx, mut stall_rx) = tokio::sync::watch::channel(None);
    let forward = async {
        while stall_rx.changed().await.is_ok() {
            let stall = stall_rx.borrow_and_update().clone();
            observer.progress(Progress::Stalled(stall));
        }
        std::future::pending::<()>().await
    };
    let record = if keep_steps { RunRecord::keeping_steps() } else { RunRecord::default() };
    let steps = run_steps(plan, auth, control, &ranks, &controller, startup, timeout, stall_tx, observer, record);
    let record = tokio::select! {
        r = steps => r,
        () = forward => unreachable!("forwarding never ends"),
    };
    serving_task.abort();
    record
}

/// [`run`] once the transfer queue is served: the gang forms, then the steps run.
#[allow(clippy::too_many_arguments)]
async fn run_steps(
    plan: &WorkerPlan,
    auth: &JobAuth,
    control: TcpListener,
    ranks: &[String],
    controller: &TqController,
    startup: Duration,
    timeout: Duration,
    stall: crate::patience::StallSender,
    observer: &dyn Observer,
    mut record: RunRecord,
) -> Result<RunRecord, CoordinatorError> {
    let deadline = Instant::now() + startup;
    let mut server = ControlServer::accept_all(&control, ranks, auth, deadline, Some(stall)).await?;
    let _late_joiners = crate::control::LateJoinerRefusal::start(control, auth.clone());
    server.wait_ready(deadline).await?;
    observer.progress(Progress::Connected { ranks: ranks.len() });

    let roles = Roles::of(plan);
    // The initial weights (version 0) reach every engine before the first step, as a job's first
    // load does; it also keeps one-time costs (first NCCL use, opening IPC handles) out of step 1.
    let t = Instant::now();
    // A resumed run starts from its checkpoint's version instead: the trainer restores it and
    // publishes it as that version, and the steps go on after it.
    let v0 = plan.first_version();
    record.max_policy_lag = plan.schedule.max_lag();
    let mut window = GenerationWindow::new(v0 + 1, plan.workload.steps, record.max_policy_lag);
    let update = server.dispatch(update_commands(&roles, v0, Some(update_seed(v0, &[])))).await?;
    let behind = roles.generate_behind_refit.then(|| window.take(v0, v0 + 1)).flatten();
    let sync = update_and_refit(&mut server, &roles, v0, update, window.with_min(behind), timeout, None).await?;
    let mut generating = Generating::default();
    generating.queued(behind, sync.generate);
    record.initial_sync_s = t.elapsed().as_secs_f64();
    observer.progress(Progress::InitialSync { version: v0, seconds: record.initial_sync_s });
    for step in v0 + 1..=plan.workload.steps {
        // One trace per step, shared with the ranks' spans of the step (see crate::telemetry).
        let span = tracing::info_span!("step", step);
        crate::telemetry::join_step(&span, &plan.job.token, step);
        server.set_step(step);
        // Generation runs as far ahead as the schedule allows; the engines hold version step − 1.
        while let Some(j) = window.take(step - 1, step) {
            let generate = Command::Generate { step: j, min_version: window.min_version(j) };
            let sent = server.dispatch(roles.producers.iter().map(|p| (p, generate.clone()))).await?;
            generating.push(j, sent);
        }
        let generate = generating.take(step)?;
        // The next Generate the refit's new version allows goes out queued behind it.
        let behind = roles.generate_behind_refit.then(|| window.take(step, step + 1)).flatten();
        let next = window.with_min(behind);
        let (r, queued) = run_step(plan, &roles, &mut server, controller, step, generate, next, timeout, observer)
            .instrument(span)
            .await?;
        generating.queued(behind, queued);
        observer.progress(Progress::StepDone(Box::new(r.clone())));
        record.add_step(r);
    }
    // The queue is done: ranks exiting from now on take their storage units with them, as
    // expected; stop serving it.
    controller.close();
    server.shutdown_all().await;
    record.dispatches = server.dispatch.seen();
    record.dispatch_us = server.dispatch.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    // Monotonic clocks of different hosts are unrelated: one-way times only on one host.
    if plan.pods.iter().all(|p| p.host == plan.pods[0].host) {
        record.one_way_us = server.one_way.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    }
    Ok(record)
}

/// Generate commands sent and not yet waited for, oldest first.
#[derive(Default)]
struct Generating(VecDeque<(u32, Pending)>);

impl Generating {
    /// Step `step`'s Generate went out.
    fn push(&mut self, step: u32, sent: Pending) {
        self.0.push_back((step, sent));
    }

    /// The Generate queued behind a refit, if one went out.
    fn queued(&mut self, step: Option<u32>, sent: Option<Pending>) {
        if let (Some(step), Some(sent)) = (step, sent) {
            self.push(step, sent);
        }
    }

    /// Step `step`'s Generate, which must be the oldest one out.
    fn take(&mut self, step: u32) -> Result<Pending, CoordinatorError> {
        match self.0.pop_front() {
            Some((s, sent)) if s == step => Ok(sent),
            other => Err(CoordinatorError::Check {
                step,
                message: format!(
                    "the schedule sent no Generate for this step (the oldest sent is for step {:?})",
                    other.map(|(s, _)| s)
                ),
            }),
        }
    }
}

/// Who does what, by process name.
struct Roles {
    producers: Vec<String>,
    trainers: Vec<String>,
    /// Per data-parallel shard: (leader, followers).
    shards: Vec<(String, Vec<String>)>,
    /// Per refit group: (senders, receivers).
    refit_groups: Vec<(Vec<String>, Vec<String>)>,
    /// Every engine is one generation rank: a producer may start the next step as soon as its own
    /// refit is done, since no other rank of its engine is still receiving weights.
    generate_behind_refit: bool,
    /// The update needs no seed from the coordinator — one data-parallel shard (every trainer
    /// rank holds the only batch, so it derives the seed itself) or a user's trainer (its own
    /// optimizer step is the update) — so it goes out together with Train.
    update_with_train: bool,
}

impl Roles {
    fn of(plan: &WorkerPlan) -> Roles {
        let name = |i: u32| plan.process(i).name.clone();
        let producers = plan
            .processes
            .iter()
            .filter(|p| matches!(p.role, ProcessRole::Generation(c) if c.producer))
            .map(|p| p.name.clone())
            .collect();
        let trainers = plan.trainer_ranks().into_iter().map(name).collect();
        let shards: Vec<(String, Vec<String>)> = plan
            .fanout_groups
            .iter()
            .map(|g| (name(g.leader), g.members.iter().filter(|&&m| m != g.leader).map(|&m| name(m)).collect()))
            .collect();
        let refit_groups = plan
            .refit_groups
            .iter()
            .map(|g| (g.senders.iter().map(|&s| name(s)).collect(), g.receivers.iter().map(|&r| name(r)).collect()))
            .collect();
        Roles {
            producers,
            trainers,
            update_with_train: plan.user_processes.trainer || shards.len() == 1,
            shards,
            refit_groups,
            generate_behind_refit: plan.layout.engine_tp == 1,
        }
    }

    fn is_sender(&self, rank: &str) -> bool {
        self.refit_groups.iter().any(|(s, _)| s.iter().any(|n| n == rank))
    }
}

fn max_busy(reports: &HashMap<String, Report>) -> f64 {
    reports.values().map(|r| r.busy_secs).fold(0.0, f64::max)
}

fn max_phase(reports: &HashMap<String, Report>, names: &[&str]) -> f64 {
    reports
        .values()
        .map(|r| names.iter().map(|n| r.phases.get(*n).copied().unwrap_or(0.0)).sum::<f64>())
        .fold(0.0, f64::max)
}

/// The update for every trainer rank, each refit sender's refit queued right behind it (a sender
/// streams as soon as its update is done; it has no use for `expected`, which only receivers
/// check).
fn update_commands(roles: &Roles, step: u32, seed: Option<u64>) -> Vec<(String, Command)> {
    let mut cmds: Vec<(String, Command)> =
        roles.trainers.iter().map(|t| (t.clone(), Command::Update { step, seed })).collect();
    for (senders, _) in &roles.refit_groups {
        for s in senders {
            cmds.push((s.clone(), Command::Refit { version: step as u64, expected: 0 }));
        }
    }
    cmds
}

/// Runs step `step`: waits for its Generate (already sent), claims and assigns, trains, then
/// updates and refits while the step's partition is cleared. Step `next`'s Generate, when given,
/// goes out queued behind the producers' refit; it is returned.
#[allow(clippy::too_many_arguments)]
async fn run_step(
    plan: &WorkerPlan,
    roles: &Roles,
    server: &mut ControlServer,
    controller: &TqController,
    step: u32,
    generate: Pending,
    next: Option<(u32, u64)>,
    timeout: Duration,
    observer: &dyn Observer,
) -> Result<(StepRecord, Option<Pending>), CoordinatorError> {
    let run = StepRun { plan, roles, controller, step, partition: format!("step-{step}"), timeout, observer };
    let mut rec = StepRecord { step, version: step as u64, ..Default::default() };
    let step_start = Instant::now();

    // 1. Generate: sent already (queued behind a refit, or ahead as the schedule allows).
    let (generated, produced) = run.generate(server, generate, &mut rec).await?;

    // 2. Claim and assign: metadata only.
    let claimed = run.claim_and_assign(produced, &mut rec)?;

    // 3. Train: leaders fetch and fan out; everyone digests the batch. When the update needs no
    // seed from here it goes out in the same write, and refit senders' refit behind it.
    let trained = run.train(server, &claimed).await?;
    // From here to the end of the refit: the update and refit stretch.
    let stretch = Instant::now();
    let batch_digests = run.check_fanout(&trained.reports)?;
    let moved = record_fetch(&mut rec, roles, &trained.reports);
    rec.transfer_s = claimed.claim_s + moved;

    // The update: new weights derive from the step and every shard's batch.
    let update_pending = if roles.update_with_train {
        trained.update
    } else {
        server.dispatch(update_commands(roles, step, Some(update_seed(step, &batch_digests)))).await?
    };
    // The claim's acknowledgment is bookkeeping: done while the trainer ranks update.
    run.acknowledge(&claimed.claim)?;

    // 4. Refit, while the partition is cleared in every storage unit (nothing waits for the
    // clear: it only frees memory, so it stays off the step's critical path).
    let (done, clear_s) =
        tokio::join!(update_and_refit(server, roles, step, update_pending, next, timeout, Some(observer)), run.clear());
    let done = done?;
    rec.scalars = mean_scalars(generated.values().chain(done.update.values()));
    let wall = stretch.elapsed().as_secs_f64();
    if clear_s > wall {
        // Clearing took longer than the update and refit: the excess delayed the step.
        rec.add_control("clear", clear_s - wall);
    }
    rec.train_s = (trained.wall - moved).max(0.0) + done.update_wall;
    if roles.update_with_train {
        // The update started on each rank right after its training: one stretch of work from
        // Train to the end of the refit.
        rec.add_control("train+update+refit", trained.wall + wall - done.longest_chain(Some(&trained.reports)));
    } else {
        rec.add_control("train", trained.wall - max_busy(&trained.reports));
        rec.add_control("update+refit", wall - done.longest_chain(None));
    }
    record_refit(&mut rec, roles, &done.refit);
    rec.total_s = step_start.elapsed().as_secs_f64();
    rec.trainer_lag_max =
        trained.reports.values().filter_map(|r| r.counters.get(POLICY_LAG_COUNTER)).copied().max().unwrap_or(0);
    record_idle(&mut rec, roles, &generated, &trained.reports, &done);
    tracing::debug!(seconds = rec.total_s, refit_s = rec.refit_s, "step finished");
    Ok((rec, done.generate))
}

impl StepRecord {
    /// Adds `secs` (none if negative) of control-plane time spent in `part` of the step.
    fn add_control(&mut self, part: &str, secs: f64) {
        let secs = secs.max(0.0);
        self.control_s += secs;
        *self.control_phases.entry(part.to_string()).or_insert(0.0) += secs;
    }
}

/// What one step's phases share.
struct StepRun<'a> {
    plan: &'a WorkerPlan,
    roles: &'a Roles,
    controller: &'a TqController,
    step: u32,
    /// The transfer-queue partition of the step's samples.
    partition: String,
    /// The bound on each command.
    timeout: Duration,
    observer: &'a dyn Observer,
}

/// The step's samples as the trainer group claimed them, and their split over the shards.
struct Claimed {
    claim: Claim,
    /// The samples it trains on: the claim's, less those beyond the policy-lag bound.
    batch: BatchMeta,
    assignment: Assignment,
    /// Seconds of the claim-and-assign phase.
    claim_s: f64,
}

/// What the train phase left behind.
struct Trained {
    /// Every trainer rank's train report.
    reports: HashMap<String, Report>,
    /// The update (and senders' refit queued behind it) when it went out with Train; empty
    /// otherwise.
    update: Pending,
    /// Seconds from sending Train until every rank's report was in.
    wall: f64,
}

impl StepRun<'_> {
    /// Waits for every producer's rollouts of the step (their Generate, `pending`, went out
    /// already) and records the phase; returns the producers' reports and how many samples they
    /// put.
    async fn generate(
        &self,
        server: &mut ControlServer,
        pending: Pending,
        rec: &mut StepRecord,
    ) -> Result<(HashMap<String, Report>, u64), CoordinatorError> {
        let step = self.step;
        self.observer.progress(Progress::Phase { step, phase: "generate" });
        let t = Instant::now();
        let generated =
            server.wait(pending, Instant::now() + self.timeout).instrument(tracing::info_span!("generate")).await?;
        let generate_wall = t.elapsed().as_secs_f64();
        let generate_busy = max_busy(&generated);
        rec.add_control("generate", generate_wall - generate_busy);
        // A producer that started during the last step's refit finished some of its work before
        // this step began: the phase is its work, not the shorter wait.
        rec.generate_s = generate_wall.max(generate_busy);
        rec.put_bytes = generated.values().map(|r| r.bytes).sum();
        rec.put_s = max_phase(&generated, &["put"]);
        let produced: u64 = generated.values().map(|r| r.samples).sum();
        Ok((generated, produced))
    }

    /// Claims the `produced` samples of the step for the trainer group and balances their
    /// tokens over the data-parallel shards (longest first).
    fn claim_and_assign(&self, produced: u64, rec: &mut StepRecord) -> Result<Claimed, CoordinatorError> {
        let step = self.step;
        self.observer.progress(Progress::Phase { step, phase: "assign" });
        let t = Instant::now();
        // A user's engine puts its own fields, all at once per sample: every sample put is complete.
        let required: Vec<String> = if self.plan.user_processes.generation {
            Vec::new()
        } else {
            [fields::INPUT_IDS, fields::RESPONSE_MASK, fields::OLD_LOGPROBS, fields::REWARD].map(String::from).to_vec()
        };
        let n = produced as usize;
        let tc = Instant::now();
        let claim = tracing::info_span!("tq.claim", samples = n)
            .in_scope(|| self.controller.claim(&self.partition, TRAINER_GROUP, n, n, &required))
            .map_err(|e| CoordinatorError::Queue { step, message: e.to_string() })?;
        rec.claim_s = tc.elapsed().as_secs_f64();
        if claim.meta.len() as u64 != produced {
            return Err(CoordinatorError::Check {
                step,
                message: format!("claimed {} samples but the producers put {produced}", claim.meta.len()),
            });
        }
        let batch = self.within_lag(&claim.meta, rec)?;
        let assignment = assign(batch.tokens(), self.roles.shards.len())
            .map_err(|e| CoordinatorError::Queue { step, message: e.to_string() })?;
        rec.imbalance = assignment.imbalance;
        rec.samples = batch.len() as u64;
        rec.tokens = batch.total_tokens();
        let claim_s = t.elapsed().as_secs_f64();
        rec.add_control("claim", claim_s);
        Ok(Claimed { claim, batch, assignment, claim_s })
    }

    /// The claimed samples within the schedule's policy-lag bound, counting each one's lag into
    /// `rec`; the older ones are dropped (acknowledged with the rest, so they are cleared and
    /// never trained on) and counted. A sample of unknown or impossible version fails the step.
    fn within_lag(&self, claimed: &BatchMeta, rec: &mut StepRecord) -> Result<BatchMeta, CoordinatorError> {
        let step = self.step;
        let max_lag = self.plan.schedule.max_lag();
        let mut keep = Vec::with_capacity(claimed.len());
        for i in 0..claimed.len() {
            let sample = claimed.sample(i);
            let lag = crate::tq::version::lag(&sample, step, max_lag > 0)
                .map_err(|e| CoordinatorError::Check { step, message: e.to_string() })?;
            if lag > u64::from(max_lag) {
                rec.stale_dropped += 1;
                continue;
            }
            let lag = lag as usize;
            if rec.policy_lags.len() <= lag {
                rec.policy_lags.resize(lag + 1, 0);
            }
            rec.policy_lags[lag] += 1;
            keep.push(i);
        }
        if rec.stale_dropped > 0 {
            tracing::warn!(
                step,
                dropped = rec.stale_dropped,
                max_lag,
                "samples generated with weights older than spec.schedule.maxPolicyLag allows were dropped"
            );
        }
        if keep.is_empty() {
            return Err(CoordinatorError::Check {
                step,
                message: format!(
                    "every one of the step's {} samples lags more than spec.schedule.maxPolicyLag = {max_lag} versions",
                    claimed.len()
                ),
            });
        }
        Ok(if keep.len() == claimed.len() { claimed.clone() } else { claimed.subset(&keep) })
    }

    /// Sends every trainer rank its Train (and the update behind it when it needs no seed from
    /// here) and waits for the Train reports.
    async fn train(&self, server: &mut ControlServer, claimed: &Claimed) -> Result<Trained, CoordinatorError> {
        let step = self.step;
        self.observer.progress(Progress::Phase { step, phase: "train" });
        let t = Instant::now();
        // LeaderBroadcast: only leaders get the batch and fan it out. Independent (for comparison):
        // every rank fetches it itself.
        let independent = self.plan.transfer_queue.fetch == TqFetch::Independent;
        let mut cmds = Vec::new();
        for (d, (leader, followers)) in self.roles.shards.iter().enumerate() {
            let batch = claimed.batch.subset(&claimed.assignment.shards[d]);
            for f in followers {
                cmds.push((f.clone(), Command::Train { step, batch: independent.then(|| batch.clone()) }));
            }
            cmds.push((leader.clone(), Command::Train { step, batch: Some(batch) }));
        }
        if self.roles.update_with_train {
            cmds.extend(update_commands(self.roles, step, None));
        }
        let sent = server.dispatch(cmds).await?;
        let (train_pending, update) = server.split(sent, |c, _| c == "train");
        let reports =
            server.wait(train_pending, Instant::now() + self.timeout).instrument(tracing::info_span!("train")).await?;
        Ok(Trained { reports, update, wall: t.elapsed().as_secs_f64() })
    }

    /// Checks that every follower received its leader's batch; returns each shard's batch
    /// digest, from which the update's seed derives.
    fn check_fanout(&self, train: &HashMap<String, Report>) -> Result<Vec<u64>, CoordinatorError> {
        let mut batch_digests = Vec::with_capacity(self.roles.shards.len());
        for (leader, followers) in &self.roles.shards {
            let ld = train[leader].digest;
            for f in followers {
                if train[f].digest != ld {
                    return Err(CoordinatorError::Check {
                        step: self.step,
                        message: format!(
                            "follower {f} received a batch that differs from its leader {leader}'s (fan-out corrupted data)"
                        ),
                    });
                }
            }
            batch_digests.push(ld.unwrap_or(0));
        }
        Ok(batch_digests)
    }

    /// Acknowledges the trainer group's claim of the step's samples.
    fn acknowledge(&self, claim: &Claim) -> Result<(), CoordinatorError> {
        let keys: Vec<String> = claim.meta.keys().map(String::from).collect();
        tracing::info_span!("tq.ack")
            .in_scope(|| self.controller.ack(&self.partition, TRAINER_GROUP, claim.claim_id, &keys))
            .map_err(|e| CoordinatorError::Queue { step: self.step, message: e.to_string() })?;
        Ok(())
    }

    /// Clears the step's partition in every storage unit; returns the seconds it took.
    async fn clear(&self) -> f64 {
        let c = Instant::now();
        let cleared = self.controller.clear(&self.partition).instrument(tracing::info_span!("tq.clear")).await;
        if !cleared.unreachable.is_empty() {
            tracing::warn!(step = self.step, units = ?cleared.unreachable, "storage units unreachable while clearing");
        }
        c.elapsed().as_secs_f64()
    }
}

/// Records the leaders' fetch of the step's batches; returns the seconds the slowest leader
/// spent moving data (fetch, fan-out and write-back).
fn record_fetch(rec: &mut StepRecord, roles: &Roles, train: &HashMap<String, Report>) -> f64 {
    let leaders: HashMap<String, Report> = roles.shards.iter().map(|(l, _)| (l.clone(), train[l].clone())).collect();
    rec.get_bytes = leaders.values().map(|r| r.bytes).sum();
    rec.get_s = max_phase(&leaders, &["fetch"]);
    max_phase(&leaders, &["fetch", "fanout", "writeback"])
}

/// Records the refit itself: the slowest rank's engine time (a sender's ends once every receiver
/// confirmed), the receivers' digest check apart, what each receiver got, and each refit phase's
/// slowest rank.
fn record_refit(rec: &mut StepRecord, roles: &Roles, refit: &HashMap<String, Report>) {
    rec.refit_s = max_phase(refit, &["total"]);
    rec.verify_s = max_phase(refit, &["verify"]);
    let receivers: Vec<&String> = roles.refit_groups.iter().flat_map(|(_, r)| r).collect();
    rec.refit_receivers = receivers.len() as u64;
    rec.refit_bytes_per_receiver = receivers.iter().map(|r| refit[*r].bytes).max().unwrap_or(0);
    for rep in refit.values() {
        for (k, v) in &rep.phases {
            let e = rec.refit_phases.entry(k.clone()).or_insert(0.0);
            *e = e.max(*v);
        }
    }
}

/// Records how long the busiest engine producer and the busiest trainer rank sat idle in the
/// step: its wall time less their work in it (a producer's generation and refit; a trainer
/// rank's training, update and refit sending).
fn record_idle(
    rec: &mut StepRecord,
    roles: &Roles,
    generated: &HashMap<String, Report>,
    train: &HashMap<String, Report>,
    done: &UpdateRefit,
) {
    let busy = |reports: &HashMap<String, Report>, rank: &str| reports.get(rank).map_or(0.0, |r| r.busy_secs);
    let engine = roles.producers.iter().map(|p| busy(generated, p) + busy(&done.refit, p)).fold(0.0, f64::max);
    let trainer = roles
        .trainers
        .iter()
        .map(|t| busy(train, t) + busy(&done.update, t) + busy(&done.refit, t))
        .fold(0.0, f64::max);
    rec.engine_idle_s = (rec.total_s - engine).max(0.0);
    rec.trainer_idle_s = (rec.total_s - trainer).max(0.0);
}

/// What [`update_and_refit`] collected.
struct UpdateRefit {
    /// Every trainer rank's update report.
    update: HashMap<String, Report>,
    /// Every refit group member's refit report.
    refit: HashMap<String, Report>,
    /// Seconds from the call until every trainer rank's update was in.
    update_wall: f64,
    /// The next step's Generate, queued behind the producers' refit.
    generate: Option<Pending>,
    /// Which ranks send.
    senders: Vec<String>,
}

impl UpdateRefit {
    /// The longest stretch of work any chain of ranks did in the update and refit (plus `train`,
    /// when the update was queued behind it): a sender's update, its refit (which ends once
    /// every receiver confirmed) and the receivers' digest check after it; a receiver's refit;
    /// a trainer rank's update. Wall time beyond it is control.
    fn longest_chain(&self, train: Option<&HashMap<String, Report>>) -> f64 {
        let trained = |r: &str| train.and_then(|t| t.get(r)).map(|t| t.busy_secs).unwrap_or(0.0);
        let verify = max_phase(&self.refit, &["verify"]);
        let mut longest = 0.0f64;
        for (rank, u) in &self.update {
            let mut chain = trained(rank) + u.busy_secs;
            if self.senders.contains(rank) {
                chain += self.refit.get(rank).map(|r| r.busy_secs).unwrap_or(0.0) + verify;
            }
            longest = longest.max(chain);
        }
        for (rank, r) in &self.refit {
            if !self.senders.contains(rank) {
                longest = longest.max(r.busy_secs);
            }
        }
        longest
    }
}

/// Waits for the refit senders' update (already sent in `update`, with their refit of `version`
/// queued behind it), then sends every receiver its refit with the senders' digests to check —
/// and, queued behind a producer's refit, the next step's Generate — and waits for everything.
/// Every receiver must report holding `version`. `observer` hears when the refit phase begins.
#[allow(clippy::too_many_arguments)]
async fn update_and_refit(
    server: &mut ControlServer,
    roles: &Roles,
    version: u32,
    update: Pending,
    next_generate: Option<(u32, u64)>,
    timeout: Duration,
    observer: Option<&dyn Observer>,
) -> Result<UpdateRefit, CoordinatorError> {
    let t = Instant::now();
    // Each command keeps its own bound, as when they went out one round at a time: a user's
    // trainer may take until the deadline to publish, and its refit gets the full bound after.
    let deadline = Instant::now() + timeout;
    let (updates, sender_refits) = server.split(update, |c, _| c == "update");
    let (sender_updates, other_updates) = server.split(updates, |_, r| roles.is_sender(r));
    let mut update = server.wait(sender_updates, deadline).instrument(tracing::info_span!("update")).await?;
    // The senders hold the new version: its refit begins.
    if let Some(o) = observer {
        o.progress(Progress::Phase { step: version, phase: "refit" });
    }
    let mut cmds = Vec::new();
    for (senders, receivers) in &roles.refit_groups {
        let expected = senders.iter().fold(0u64, |acc, s| acc.wrapping_add(update[s].digest.unwrap_or(0)));
        for r in receivers {
            cmds.push((r.clone(), Command::Refit { version: version as u64, expected }));
        }
    }
    if let Some((step, min_version)) = next_generate.filter(|_| roles.generate_behind_refit) {
        // Behind the refit in the same write: the producer generates as soon as it holds the new
        // weights (or, receiving while it generates, as soon as it holds `min_version`), without
        // waiting for the other engines or for this coordinator.
        let generate = Command::Generate { step, min_version };
        cmds.extend(roles.producers.iter().map(|p| (p.clone(), generate.clone())));
    }
    let sent = server.dispatch(cmds).await?;
    let (generate, receiver_refits) = server.split(sent, |c, _| c == "generate");
    update.extend(server.wait(other_updates, deadline).instrument(tracing::info_span!("update")).await?);
    let update_wall = t.elapsed().as_secs_f64();
    if let Some(o) = observer {
        let saved = update.values().filter_map(|r| r.checkpoint.as_ref()).max_by_key(|c| c.step);
        if let Some(cp) = saved {
            o.progress(Progress::Checkpoint(cp.clone()));
        }
    }
    let refit_deadline = Instant::now() + timeout;
    let refit = server
        .wait(sender_refits.merge(receiver_refits), refit_deadline)
        .instrument(tracing::info_span!("refit", version))
        .await?;
    for r in roles.refit_groups.iter().flat_map(|(_, r)| r) {
        if refit[r].version != Some(version as u64) {
            return Err(CoordinatorError::Check {
                step: version,
                message: format!("{r} reports weight version {:?} after refit {version}", refit[r].version),
            });
        }
    }
    let senders = roles.refit_groups.iter().flat_map(|(s, _)| s.iter().cloned()).collect();
    Ok(UpdateRefit { update, refit, update_wall, generate: (!generate.is_empty()).then_some(generate), senders })
}

/// For each scalar name, the mean of the values the reports carry.
fn mean_scalars<'a>(reports: impl Iterator<Item = &'a Report>) -> BTreeMap<String, f64> {
    let mut sums: BTreeMap<String, (f64, u32)> = BTreeMap::new();
    for (k, v) in reports.flat_map(|r| &r.scalars) {
        let e = sums.entry(k.clone()).or_insert((0.0, 0));
        e.0 += v;
        e.1 += 1;
    }
    sums.into_iter().map(|(k, (sum, n))| (k, sum / n as f64)).collect()
}

/// Summary statistics of a run, for the table and `--json`.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Steps run.
    pub steps: u32,
    /// Refit seconds, median.
    pub refit_p50_s: f64,
    /// Refit seconds, 99th percentile.
    pub refit_p99_s: f64,
    /// Refit GB/s per receiver (bytes each receiver got ÷ refit time), median step.
    pub refit_gbps: f64,
    /// Refit bytes each receiver got per step.
    pub refit_bytes_per_receiver: u64,
    /// Refit bytes delivered in total over the run.
    pub refit_bytes_total: u64,
    /// Transfer-queue put GB/s (all producers together).
    pub tq_put_gbps: f64,
    /// Transfer-queue get GB/s (all leaders together).
    pub tq_get_gbps: f64,
    /// Bytes put over the run.
    pub tq_put_bytes: u64,
    /// Bytes fetched over the run.
    pub tq_get_bytes: u64,
    /// Mean seconds per step: generate.
    pub generate_s: f64,
    /// Mean seconds per step: transfer.
    pub transfer_s: f64,
    /// Mean seconds per step: train.
    pub train_s: f64,
    /// Mean seconds per step: refit.
    pub refit_s: f64,
    /// Mean seconds per step: checking refit's bytes.
    pub verify_s: f64,
    /// Mean seconds per step in total.
    pub step_s: f64,
    /// Token imbalance (max/mean over shards), mean over steps.
    pub imbalance_mean: f64,
    /// Token imbalance, worst step.
    pub imbalance_max: f64,
    /// Dispatch latency p50, microseconds: a command's way to the rank and its answer's way back.
    pub dispatch_p50_us: f64,
    /// Dispatch latency p99, microseconds.
    pub dispatch_p99_us: f64,
    /// One-way dispatch p50 (send → the rank has it), microseconds, when measurable (one host).
    pub dispatch_one_way_p50_us: Option<f64>,
    /// One-way dispatch p99, microseconds.
    pub dispatch_one_way_p99_us: Option<f64>,
    /// Control-plane time per step, milliseconds (mean).
    pub control_ms_per_step: f64,
    /// Control messages sent.
    pub dispatches: usize,
    /// The policy lag the schedule allowed (0: synchronous).
    pub max_policy_lag: u32,
    /// Steps per second over the run's steps (the initial load left out).
    pub steps_per_s: f64,
    /// Samples trained on, by policy lag (entry `l`: `l` versions behind the synchronous one).
    pub policy_lags: Vec<u64>,
    /// Mean policy lag of the samples trained on.
    pub policy_lag_mean: f64,
    /// Largest policy lag a trainer rank found in its batch as it arrived.
    pub policy_lag_max: u64,
    /// Samples dropped as older than the bound.
    pub stale_dropped: u64,
    /// Mean seconds per step the busiest engine producer sat idle.
    pub engine_idle_s: f64,
    /// Mean seconds per step the busiest trainer rank sat idle.
    pub trainer_idle_s: f64,
}

fn pct(v: &[f64], p: f64) -> f64 {
    let d: Vec<Duration> = v.iter().map(|s| Duration::from_secs_f64(s.max(0.0))).collect();
    percentile_us(&d, p) / 1e6
}

impl Summary {
    /// Summarizes a run.
    pub fn of(r: &RunRecord) -> Summary {
        let t = &r.totals;
        let n = f64::from(t.steps.max(1));
        let median = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            if v.is_empty() { 0.0 } else { v[v.len() / 2] }
        };
        let d: Vec<Duration> = r.dispatch_us.iter().map(|u| Duration::from_secs_f64(u / 1e6)).collect();
        let ow: Vec<Duration> = r.one_way_us.iter().map(|u| Duration::from_secs_f64(u / 1e6)).collect();
        Summary {
            steps: t.steps,
            refit_p50_s: pct(&t.refit_times, 50.0),
            refit_p99_s: pct(&t.refit_times, 99.0),
            refit_gbps: median(&t.refit_gbps),
            refit_bytes_per_receiver: t.first_refit_bytes_per_receiver.unwrap_or(0),
            refit_bytes_total: t.refit_bytes_total,
            tq_put_gbps: median(&t.put_gbps),
            tq_get_gbps: median(&t.get_gbps),
            tq_put_bytes: t.put_bytes,
            tq_get_bytes: t.get_bytes,
            generate_s: t.generate_s / n,
            transfer_s: t.transfer_s / n,
            train_s: t.train_s / n,
            refit_s: t.refit_s / n,
            verify_s: t.verify_s / n,
            step_s: t.total_s / n,
            imbalance_mean: t.imbalance / n,
            imbalance_max: t.imbalance_max,
            dispatch_p50_us: percentile_us(&d, 50.0),
            dispatch_p99_us: percentile_us(&d, 99.0),
            dispatch_one_way_p50_us: (!ow.is_empty()).then(|| percentile_us(&ow, 50.0)),
            dispatch_one_way_p99_us: (!ow.is_empty()).then(|| percentile_us(&ow, 99.0)),
            control_ms_per_step: t.control_s / n * 1e3,
            dispatches: r.dispatches as usize,
            max_policy_lag: r.max_policy_lag,
            steps_per_s: if t.total_s > 0.0 { f64::from(t.steps) / t.total_s } else { 0.0 },
            policy_lag_mean: {
                let samples: u64 = t.policy_lags.iter().sum();
                let lagged: u64 = t.policy_lags.iter().enumerate().map(|(l, n)| l as u64 * n).sum();
                if samples > 0 { lagged as f64 / samples as f64 } else { 0.0 }
            },
            policy_lags: t.policy_lags.clone(),
            policy_lag_max: t.trainer_lag_max,
            stale_dropped: t.stale_dropped,
            engine_idle_s: t.engine_idle_s / n,
            trainer_idle_s: t.trainer_idle_s / n,
        }
    }

    /// The summary as a table.
    pub fn table(&self) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        let rows = [
            ("steps", format!("{}", self.steps)),
            (
                "refit",
                format!(
                    "p50 {:.4}s  p99 {:.4}s  {:.2} GB/s per receiver  ({:.4} GB each, {:.4} GB total)",
                    self.refit_p50_s,
                    self.refit_p99_s,
                    self.refit_gbps,
                    gb(self.refit_bytes_per_receiver),
                    gb(self.refit_bytes_total)
                ),
            ),
            (
                "transfer queue",
                format!(
                    "put {:.2} GB/s  get {:.2} GB/s  ({:.4} GB put, {:.4} GB fetched)",
                    self.tq_put_gbps,
                    self.tq_get_gbps,
                    gb(self.tq_put_bytes),
                    gb(self.tq_get_bytes)
                ),
            ),
            (
                "step time",
                format!(
                    "{:.4}s {} generate {:.4}s + transfer {:.4}s + train {:.4}s + refit {:.4}s (+ checking refit {:.4}s, control {:.4}s)",
                    self.step_s,
                    // Asynchronous: generation overlaps training, so the phases add up to more.
                    if self.max_policy_lag == 0 { "=" } else { "< (overlapping)" },
                    self.generate_s,
                    self.transfer_s,
                    self.train_s,
                    self.refit_s,
                    self.verify_s,
                    self.control_ms_per_step / 1e3
                ),
            ),
            (
                "schedule",
                format!(
                    "{}: {:.2} steps/s; policy lag mean {:.2}, max {} ({} stale samples dropped); idle per step: engines {:.4}s, trainer {:.4}s",
                    match self.max_policy_lag {
                        0 => "synchronous".to_string(),
                        k => format!("asynchronous (maxPolicyLag {k})"),
                    },
                    self.steps_per_s,
                    self.policy_lag_mean,
                    self.policy_lag_max,
                    self.stale_dropped,
                    self.engine_idle_s,
                    self.trainer_idle_s
                ),
            ),
            (
                "token imbalance",
                format!("max/mean {:.3} (mean)  {:.3} (worst step)", self.imbalance_mean, self.imbalance_max),
            ),
            (
                "control plane",
                match (self.dispatch_one_way_p50_us, self.dispatch_one_way_p99_us) {
                    (Some(o50), Some(o99)) => format!(
                        "dispatch one-way p50 {o50:.1}µs  p99 {o99:.1}µs; round trip p50 {:.1}µs  p99 {:.1}µs  ({} messages)  control {:.3} ms/step",
                        self.dispatch_p50_us, self.dispatch_p99_us, self.dispatches, self.control_ms_per_step
                    ),
                    _ => format!(
                        "dispatch round trip p50 {:.1}µs  p99 {:.1}µs  ({} messages)  control {:.3} ms/step",
                        self.dispatch_p50_us, self.dispatch_p99_us, self.dispatches, self.control_ms_per_step
                    ),
                },
            ),
        ];
        let w = rows.iter().map(|(k, _)| k.chars().count()).max().unwrap_or(0);
        rows.iter().map(|(k, v)| format!("{k:<w$}  {v}\n")).collect()
    }
}
