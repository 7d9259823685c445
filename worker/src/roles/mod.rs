//! The rank processes: trainer ranks, generation ranks and dedicated storage units. The
//! coordinator is in [`crate::coordinator`].
//!
//! Every rank runs the same way, in a pod (`rlplane worker --plan`) or on one machine
//! (`rlplane local`); only the addresses in the plan differ:
//! 1. bind its listeners (refit, fan-out, storage), then announce readiness on stdout;
//! 2. rendezvous with its peers and the coordinator, concurrently (they start in any order);
//! 3. execute the coordinator's commands until Shutdown.

pub mod generation;
mod lanes;
pub mod refit_side;
pub mod storage;
pub mod trainer;

use std::time::Duration;

use rlplane_api::plan::{ProcessRole, WorkerPlan};
use tokio::time::Instant;
use tracing::Instrument;

use crate::control::{Command, ControlClient, Envelope, Reply, Report};
use crate::net::JobAuth;
use crate::supervisor::READY_PREFIX;

/// How long a rank waits for its peers and the coordinator at start-up.
pub fn startup_timeout(plan: &WorkerPlan) -> Duration {
    Duration::from_secs(120).max(Duration::from_secs(plan.refit.timeout_seconds as u64))
}

/// Announces readiness to the supervisor (listeners are bound; metrics served at `metrics`).
pub fn announce_ready(metrics: Option<std::net::SocketAddr>) {
    match metrics {
        Some(a) => println!("{READY_PREFIX} metrics={a}"),
        None => println!("{READY_PREFIX}"),
    }
}

/// A rank's reaction to commands.
pub trait Rank {
    /// Executes one command (never Shutdown).
    fn execute(&mut self, command: Command) -> impl Future<Output = anyhow::Result<Report>>;
}

/// The step a command belongs to (a refit's version is its step).
pub(super) fn command_step(command: &Command) -> Option<u32> {
    match command {
        Command::Generate { step, .. } | Command::Train { step, .. } | Command::Update { step, .. } => Some(*step),
        Command::Refit { version, .. } => u32::try_from(*version).ok(),
        Command::Shutdown => None,
    }
}

/// The command loop: execute each command and answer Done or Failed, until Shutdown or until the
/// coordinator goes away. Each command runs in a span named after it, in its step's trace (the
/// job `token` and the step derive it, see [`crate::telemetry`]).
pub async fn serve_commands<R: Rank>(control: &mut ControlClient, rank: &mut R, token: &str) -> anyhow::Result<()> {
    // Set-up is done (the caller rendezvoused with its peers): take commands.
    control.reply(&Reply::Ready).await?;
    while let Some(Envelope { seq, command, .. }) = control.next().await? {
        if command == Command::Shutdown {
            return Ok(());
        }
        let name = command.name();
        let step = command_step(&command);
        let span = tracing::info_span!("command", otel.name = name, step);
        if let Some(step) = step {
            crate::telemetry::join_step(&span, token, step);
        }
        match rank.execute(command).instrument(span.clone()).await {
            Ok(report) => {
                span.in_scope(|| tracing::debug!(busy_s = report.busy_secs, bytes = report.bytes, "{name} done"));
                control.done(seq, report).await?
            }
            Err(e) => {
                let error = format!("{e:#}");
                control.failed(seq, error.clone()).await?;
                // A failed command leaves this rank's state (weights, sockets) unknown: stop, so
                // the supervisor reports it and the gang restarts.
                anyhow::bail!("{name} failed: {error}");
            }
        }
    }
    anyhow::bail!("{COORDINATOR_GONE}")
}

/// How a rank's error starts when it ends because the coordinator went away: the consequence of
/// a failure elsewhere, never its cause (`rlplane local` blames another process).
pub const COORDINATOR_GONE: &str = "the coordinator closed the control channel before Shutdown";

/// Runs process `me` of the plan until Shutdown. Its metrics are served on a loopback port that
/// the readiness line announces.
pub async fn run_process(plan: WorkerPlan, me: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + startup_timeout(&plan);
    let name = plan.process(me).name.clone();
    // The epoch's key first: without it this rank could not join any of its peers.
    let auth = JobAuth::for_plan(&plan)?;
    let (mut registry, metrics) = crate::metrics::RankMetrics::for_process(&plan, me);
    crate::metrics::HandshakeRefusals::register(&mut registry, auth.refusals());
    let metrics = metrics.serve(registry).await;
    let control = async { ControlClient::connect(&plan.control_address(), &auth, &name, deadline).await };
    match plan.process(me).role {
        ProcessRole::Trainer(_) => trainer::run(&plan, me, &auth, control, metrics).await,
        ProcessRole::Generation(_) => generation::run(&plan, me, &auth, control, metrics).await,
        ProcessRole::Storage { .. } => storage::run(&plan, me, &auth, control, metrics).await,
        ProcessRole::Coordinator => anyhow::bail!("the coordinator is not a rank; run it with the coordinator role"),
    }
}

/// Ends a user process's session once the rank's command loop ends: at Shutdown its pending
/// calls answer `done`; after a failure they answer `failed` with the error. Either way the user
/// process gets a moment to read the answer before this rank exits.
pub async fn end_user_session(local_api: Option<&crate::sidecar::LocalApi>, served: &anyhow::Result<()>) {
    let Some(local_api) = local_api else { return };
    match served {
        Ok(()) => local_api.shutdown(Duration::from_secs(10)).await,
        Err(e) => local_api.fail(&format!("{e:#}"), Duration::from_secs(2)).await,
    }
}

/// Seconds since `t`.
pub fn secs(t: std::time::Instant) -> f64 {
    t.elapsed().as_secs_f64()
}
