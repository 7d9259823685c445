//! `rlplane-operator run`: the controller, leader election, the HTTP endpoints and shutdown.
//!
//! Only the replica holding the Lease reconciles; the others wait, serve `/healthz`, `/readyz` and
//! `/metrics`, and take over when the lease expires or is released. SIGTERM (or Ctrl-C) stops the
//! controller gracefully (in-flight reconciles finish), releases the lease so that another
//! replica takes over at once, and stops the HTTP server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Api, Client};
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use prometheus_client::registry::Registry;
use rlplane_api::RLJob;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::desired::{OperatorConfig, labels};
use crate::metrics::{JobsByPhase, Metrics, PREFIX};
use crate::reconcile::{Clock, Context, error_policy, reconcile};
use crate::server::{Health, router};

/// Name of the controller in Events (`reportingController`).
pub const CONTROLLER_NAME: &str = "rlplane.dev/operator";

/// Options of `rlplane-operator run`.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Settings that shape pods.
    pub config: OperatorConfig,
    /// Watch only this namespace (None: every namespace).
    pub namespace: Option<String>,
    /// Address of `/healthz`, `/readyz` and `/metrics`.
    pub metrics_addr: SocketAddr,
    /// Elect a leader through a Lease (false: reconcile at once; for a single replica or tests).
    pub leader_election: bool,
    /// Name of the Lease.
    pub lease_name: String,
    /// Namespace of the Lease.
    pub lease_namespace: String,
    /// This replica's identity in the Lease and in Events.
    pub identity: String,
    /// Seconds a lease stays valid without renewal.
    pub lease_duration_seconds: u64,
    /// Seconds before expiry the holder renews.
    pub lease_grace_seconds: u64,
    /// RLJobs reconciled at once.
    pub concurrency: u16,
}

/// Runs the operator until SIGTERM or Ctrl-C.
pub async fn run(opts: RunOptions) -> anyhow::Result<()> {
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        info!("shutdown requested");
        let _ = shutdown_tx.send(true);
    });
    run_until(opts, shutdown_rx).await
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the operator");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Resolves once `rx` holds true (or its sender is gone).
async fn wait_true(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

/// Runs the operator until `shutdown` becomes true.
pub async fn run_until(opts: RunOptions, shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    let mut registry = Registry::with_prefix(PREFIX);
    let jobs_by_phase = JobsByPhase::default();
    let metrics = Metrics::register(&mut registry, jobs_by_phase.clone());
    let health = Arc::new(Health::default());
    let server = serve_http(opts.metrics_addr, registry, health.clone(), shutdown.clone()).await?;
    let client = connect().await?;
    let mut leadership = Leadership::start(&client, &opts).await?;
    health.set_ready(true);

    let reporter = Reporter { controller: CONTROLLER_NAME.into(), instance: Some(opts.identity.clone()) };
    let ctx = Arc::new(Context::new(
        client.clone(),
        opts.config.clone(),
        Recorder::new(client.clone(), reporter),
        metrics.clone(),
        Clock::System,
    ));
    let election_ended =
        reconcile_while_leading(&client, &opts, &mut leadership.leader, shutdown, ctx, &metrics, &jobs_by_phase).await;

    health.set_ready(false);
    leadership.release().await;
    if election_ended {
        // Stop serving too: the process exits with an error and its pod is restarted.
        server.abort();
        anyhow::bail!("leader election stopped (see the lease manager's error above)");
    }
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => error!(error = %e, "HTTP server failed"),
        Err(e) => error!(error = %e, "HTTP server task failed"),
    }
    info!("stopped");
    Ok(())
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `addr` until `shutdown` becomes true.
async fn serve_http(
    addr: SocketAddr,
    registry: Registry,
    health: Arc<Health>,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<JoinHandle<std::io::Result<()>>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on --metrics-addr {addr}; pick a free address"))?;
    info!(addr = %listener.local_addr()?, "serving /healthz, /readyz and /metrics");
    let app = router(Arc::new(registry), health);
    Ok(tokio::spawn(async move {
        axum::serve(listener, app).with_graceful_shutdown(async move { wait_true(&mut shutdown).await }).await
    }))
}

/// A client of the cluster's API server, once the server answers.
async fn connect() -> anyhow::Result<Client> {
    let client = Client::try_default()
        .await
        .context("cannot build a Kubernetes client: set KUBECONFIG, or run in a pod with a ServiceAccount")?;
    let version = client.apiserver_version().await.context("cannot reach the Kubernetes API server")?;
    info!(version = %version.git_version, "connected to the API server");
    Ok(client)
}

/// Whether this replica may reconcile: a channel that is true while it leads.
struct Leadership {
    /// True while this replica holds the lease (always, without election).
    leader: watch::Receiver<bool>,
    /// The lease manager's task, with election.
    lease_task: Option<JoinHandle<kube_lease_manager::Result<LeaseManager>>>,
    /// Without election, the sender that keeps `leader` true; it lives as long as the run.
    always_leader: Option<watch::Sender<bool>>,
}

impl Leadership {
    /// Starts leader election, or, without it, leads at once.
    async fn start(client: &Client, opts: &RunOptions) -> anyhow::Result<Self> {
        if !opts.leader_election {
            let (tx, rx) = watch::channel(true);
            return Ok(Leadership { leader: rx, lease_task: None, always_leader: Some(tx) });
        }
        let manager = LeaseManagerBuilder::new(client.clone(), &opts.lease_name)
            .with_namespace(&opts.lease_namespace)
            .with_identity(&opts.identity)
            .with_duration(opts.lease_duration_seconds)
            .with_grace(opts.lease_grace_seconds)
            .with_field_manager(format!("rlplane-operator-lease-{}", opts.identity))
            .build()
            .await
            .with_context(|| format!("cannot use Lease {}/{}", opts.lease_namespace, opts.lease_name))?;
        let (rx, task) = manager.watch().await;
        info!(lease = %format!("{}/{}", opts.lease_namespace, opts.lease_name), identity = %opts.identity, "leader election started");
        Ok(Leadership { leader: rx, lease_task: Some(task), always_leader: None })
    }

    /// Gives up leadership: releases the lease, if any, so that another replica takes over at
    /// once (waiting at most 10 s; the lease expires on its own otherwise).
    async fn release(self) {
        let Leadership { leader, lease_task, always_leader } = self;
        drop(always_leader);
        if let Some(task) = lease_task {
            // Dropping the receiver makes the lease task release the lease and end.
            drop(leader);
            match tokio::time::timeout(Duration::from_secs(10), task).await {
                Ok(Ok(Ok(_))) => info!("lease released"),
                Ok(Ok(Err(e))) => warn!(error = %e, "cannot release the lease; it expires on its own"),
                Ok(Err(e)) => warn!(error = %e, "lease task failed"),
                Err(_) => warn!("releasing the lease timed out; it expires on its own"),
            }
        }
    }
}

/// Runs the controller each time this replica becomes leader, until it loses the lease, and
/// again when it regains it, until `shutdown` becomes true. Returns true when leader election
/// ended (nobody may lead any more).
async fn reconcile_while_leading(
    client: &Client,
    opts: &RunOptions,
    leader: &mut watch::Receiver<bool>,
    mut shutdown: watch::Receiver<bool>,
    ctx: Arc<Context>,
    metrics: &Metrics,
    jobs_by_phase: &JobsByPhase,
) -> bool {
    loop {
        tokio::select! {
            _ = wait_true(&mut shutdown) => return false,
            leading = leader.wait_for(|leader| *leader) => {
                // The lease task only ends when it cannot go on; without it nobody may lead.
                if leading.is_err() {
                    return true;
                }
            }
        }
        if *shutdown.borrow() {
            return false;
        }
        info!("leading: reconciling RLJobs");
        metrics.leader.set(1);
        let controller = build_controller(client, opts.namespace.as_deref(), opts.concurrency);
        jobs_by_phase.set_store(Some(controller.store()));
        let mut stop_leader = leader.clone();
        let mut stop_shutdown = shutdown.clone();
        controller
            .graceful_shutdown_on(async move {
                tokio::select! {
                    _ = stop_leader.wait_for(|leader| !*leader) => warn!("lost the lease: stopping the controller"),
                    _ = wait_true(&mut stop_shutdown) => {},
                }
            })
            .run(reconcile, error_policy, ctx.clone())
            .for_each(|result| async move {
                if let Err(e) = result {
                    // ObjectNotFound after a deletion is normal; the rest is logged by reconcile.
                    tracing::debug!(error = %e, "controller");
                }
            })
            .await;
        jobs_by_phase.set_store(None);
        metrics.leader.set(0);
        if *shutdown.borrow() {
            return false;
        }
    }
}

/// The Controller on RLJobs, owning every kind of object the operator creates. Children are
/// watched by label (`rlplane.dev/job`) and as metadata only, so the operator caches nothing but
/// RLJobs. PodGroups are not watched: their API may be absent, and nothing about them changes a
/// decision.
pub fn build_controller(client: &Client, namespace: Option<&str>, concurrency: u16) -> Controller<RLJob> {
    fn api<K>(client: &Client, ns: Option<&str>) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let children = watcher::Config::default().labels(labels::JOB);
    Controller::new(api::<RLJob>(client, namespace), watcher::Config::default())
        .owns(api::<Pod>(client, namespace), children.clone())
        .owns(api::<Service>(client, namespace), children.clone())
        .owns(api::<ConfigMap>(client, namespace), children.clone())
        .owns(api::<ServiceAccount>(client, namespace), children.clone())
        .owns(api::<Role>(client, namespace), children.clone())
        .owns(api::<RoleBinding>(client, namespace), children)
        .trigger_backoff(TriggerBackoff::default())
        // Bursts (64 pods turning ready) collapse into few reconciles.
        .with_config(controller::Config::default().concurrency(concurrency).debounce(Duration::from_millis(100)))
}

/// The pause after an error of the controller's watches. They are merged into one stream under
/// one backoff, so kube-runtime's default (0.8 s doubling to 30 s, reset only after 120 s without
/// an error) adds up every watch's error: after an API server restart each of the seven watches
/// answers its resumed watch with 410 Gone (a desync: it re-lists), and the fault campaign saw
/// the operator blind for two minutes, a deleted pod's gang left unrestarted. Here the pause
/// starts at 0.1 s, doubles to at most 1 s, and resets at the first event that is no error: while
/// a restarted API server's caches fill, its watches keep failing in turn, and every failure
/// pauses all of them. An API server that stays down is asked once a second, no more.
#[derive(Clone, Debug)]
pub struct TriggerBackoff {
    next: Duration,
}

impl TriggerBackoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(1);
}

impl Default for TriggerBackoff {
    fn default() -> Self {
        TriggerBackoff { next: TriggerBackoff::FIRST }
    }
}

impl Iterator for TriggerBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let now = self.next;
        self.next = (now * 2).min(TriggerBackoff::MAX);
        Some(now)
    }
}

impl kube::runtime::utils::Backoff for TriggerBackoff {
    fn reset(&mut self) {
        self.next = TriggerBackoff::FIRST;
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::utils::Backoff as _;

    use super::*;

    #[test]
    fn the_trigger_backoff_doubles_to_one_second_and_resets_at_once() {
        let mut b = TriggerBackoff::default();
        let first: Vec<u64> = b.by_ref().take(6).map(|d| d.as_millis() as u64).collect();
        assert_eq!(first, [100, 200, 400, 800, 1000, 1000]);
        b.reset();
        assert_eq!(b.next(), Some(Duration::from_millis(100)), "the first good event resets it");
    }
}
