//! A dedicated transfer-queue storage unit (placement Dedicated): serves puts and gets until the
//! coordinator says Shutdown.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rlplane_api::plan::{ProcessRole, WorkerPlan};
use tokio::task::JoinHandle;

use super::{Rank, announce_ready, serve_commands};
use crate::control::{Command, ControlClient, ControlError, Report};
use crate::metrics::RankMetrics;
use crate::net::{JobAuth, NetError};
use crate::tq::{StorageServer, StorageUnit};

struct Idle;

impl Rank for Idle {
    async fn execute(&mut self, command: Command) -> anyhow::Result<Report> {
        anyhow::bail!("a storage unit has no part in {}", command.name())
    }
}

/// Runs a dedicated storage unit.
pub async fn run(
    plan: &WorkerPlan,
    me: u32,
    auth: &JobAuth,
    control: impl Future<Output = Result<ControlClient, ControlError>>,
    metrics: RankMetrics,
) -> anyhow::Result<()> {
    let ProcessRole::Storage { unit } = plan.process(me).role else {
        anyhow::bail!("process {me} is not a storage unit")
    };
    let (_, serving) = start_unit(plan, me, unit, auth, &metrics, "the storage unit").await?;
    announce_ready(metrics.addr());
    let mut control = control.await?;
    let r = serve_commands(&mut control, &mut Idle, &plan.job.token).await;
    serving.abort();
    r
}

/// Binds process `me`'s storage port and serves storage unit `unit` there (a dedicated unit, or
/// a producer's own under placement ProducerLocal), with its metrics registered. Returns the
/// unit and the serving task; abort the task to stop serving.
pub(super) async fn start_unit(
    plan: &WorkerPlan,
    me: u32,
    unit: u32,
    auth: &JobAuth,
    metrics: &RankMetrics,
    what: &str,
) -> anyhow::Result<(Arc<StorageUnit>, JoinHandle<Result<(), NetError>>)> {
    let port = plan.process(me).ports.storage.with_context(|| format!("{what} has no storage port in the plan"))?;
    let listener = crate::net::bind(&plan.bind_address(me, port), what).await?;
    let storage = Arc::new(StorageUnit::new(unit, plan.transfer_queue.capacity_bytes));
    metrics.storage_unit(storage.clone());
    let server =
        StorageServer::new(storage.clone(), auth, Duration::from_secs(plan.transfer_queue.put_timeout_seconds as u64));
    Ok((storage, tokio::spawn(server.serve(listener))))
}
