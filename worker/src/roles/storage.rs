//! A dedicated transfer-queue storage unit (placement Dedicated): serves puts and gets until the
//! coordinator says Shutdown.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rlplane_api::plan::{ProcessRole, WorkerPlan};

use super::{Rank, announce_ready, serve_commands};
use crate::control::{Command, ControlClient, ControlError, Report};
use crate::metrics::RankMetrics;
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
    control: impl Future<Output = Result<ControlClient, ControlError>>,
    metrics: RankMetrics,
) -> anyhow::Result<()> {
    let ProcessRole::Storage { unit } = plan.process(me).role else {
        anyhow::bail!("process {me} is not a storage unit")
    };
    let port = plan.process(me).ports.storage.context("the storage unit has no storage port in the plan")?;
    let listener = crate::net::bind(&plan.bind_address(me, port), "the storage unit").await?;
    let storage = Arc::new(StorageUnit::new(unit, plan.transfer_queue.capacity_bytes));
    metrics.storage_unit(storage.clone());
    let server = StorageServer::new(
        storage,
        &plan.job.token,
        Duration::from_secs(plan.transfer_queue.put_timeout_seconds as u64),
    );
    let serving = tokio::spawn(server.serve(listener));
    announce_ready(metrics.addr());
    let mut control = control.await?;
    let r = serve_commands(&mut control, &mut Idle, &plan.job.token).await;
    serving.abort();
    r
}
