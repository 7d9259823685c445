//! The thin I/O layer: reads an RLJob and its pods, asks [`crate::decide::decide`] what to do, and
//! executes the steps in order with server-side apply (field manager `rlplane-operator`, force)
//! and deletes. Nothing here decides anything the pure layer could.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
    Preconditions,
};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use rlplane_api::plan::job_key_secret_name;
use rlplane_api::topology::{headless_service_name, plan_config_map_name};
use rlplane_api::{GangScheduler, Phase, RLJob, RLJobStatus};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{debug, info, warn};

use crate::decide::{self, Decision, JobEvent, PodRef, Step};
use crate::desired::{
    Desired, FIELD_MANAGER, OperatorConfig, labels, network_policy_name, pod_group_name, worker_service_account_name,
};
use crate::error::{Error, is_code};
use crate::metrics::{ErrorLabels, Metrics, PhaseLabels, ReasonLabels};

/// Pods created (or deleted) at once: a 64-pod gang is created in a few round trips.
pub const POD_CONCURRENCY: usize = 16;
/// First retry after an error; doubles per consecutive error of the same job.
pub const ERROR_BACKOFF_MIN: Duration = Duration::from_secs(2);
/// Longest wait between retries after errors.
pub const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// A job's objects (ServiceAccount, Role, RoleBinding, Service, ConfigMap, PodGroup) unchanged
/// since the last apply are applied again only after this long: a reconcile that changes nothing
/// then makes no write at all, and drift (an object edited or deleted by hand) is still repaired.
pub const OBJECT_RESYNC: Duration = Duration::from_secs(300);

/// Where "now" comes from: the system clock, or a fixed time in tests.
#[derive(Clone, Copy, Debug)]
pub enum Clock {
    /// The system clock.
    System,
    /// Always this time.
    Fixed(Timestamp),
}

impl Clock {
    /// The current time.
    pub fn now(&self) -> Timestamp {
        match self {
            Clock::System => Timestamp::now(),
            Clock::Fixed(t) => *t,
        }
    }
}

/// What every reconcile shares.
pub struct Context {
    /// The API client.
    pub client: Client,
    /// Settings that shape pods.
    pub config: OperatorConfig,
    /// Publishes Events on RLJobs.
    pub recorder: Recorder,
    /// The operator's metrics.
    pub metrics: Metrics,
    /// The time source.
    pub clock: Clock,
    /// Consecutive errors per job (namespace/name), for exponential backoff.
    errors: Mutex<HashMap<String, u32>>,
    /// Per job uid: the fingerprint of the objects last applied, and when.
    applied: Mutex<HashMap<String, (u64, Instant)>>,
}

impl Context {
    /// A context.
    pub fn new(client: Client, config: OperatorConfig, recorder: Recorder, metrics: Metrics, clock: Clock) -> Self {
        Context {
            client,
            config,
            recorder,
            metrics,
            clock,
            errors: Mutex::new(HashMap::new()),
            applied: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `job`'s objects with `fingerprint` were applied less than [`OBJECT_RESYNC`] ago.
    fn applied_recently(&self, job: &RLJob, fingerprint: u64) -> bool {
        let uid = job.uid().unwrap_or_default();
        self.applied
            .lock()
            .is_ok_and(|m| m.get(&uid).is_some_and(|(f, at)| *f == fingerprint && at.elapsed() < OBJECT_RESYNC))
    }

    fn record_applied(&self, job: &RLJob, fingerprint: Option<u64>) {
        if let Ok(mut m) = self.applied.lock() {
            // Entries of deleted jobs age out here.
            m.retain(|_, (_, at)| at.elapsed() < 2 * OBJECT_RESYNC);
            let uid = job.uid().unwrap_or_default();
            match fingerprint {
                Some(f) => m.insert(uid, (f, Instant::now())),
                None => m.remove(&uid),
            };
        }
    }
}

/// A fingerprint of the objects of `d` (the decision's ApplyObjects step carries no pods), stable
/// within this process: equal fingerprints mean identical objects to apply. The Debug text is
/// hashed as it is written, never held or cloned.
fn objects_fingerprint(d: &Desired) -> u64 {
    use std::hash::Hasher;
    struct HashWriter(std::collections::hash_map::DefaultHasher);
    impl std::fmt::Write for HashWriter {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0.write(s.as_bytes());
            Ok(())
        }
    }
    let mut h = HashWriter(std::collections::hash_map::DefaultHasher::new());
    let _ = std::fmt::Write::write_fmt(&mut h, format_args!("{d:?}"));
    h.0.finish()
}

fn key(job: &RLJob) -> String {
    format!("{}/{}", job.namespace().unwrap_or_default(), job.name_any())
}

/// Reconciles one RLJob (the Controller's reconciler).
pub async fn reconcile(job: Arc<RLJob>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    ctx.metrics.reconciles.inc();
    let result = reconcile_job(&job, &ctx).await;
    ctx.metrics.reconcile_duration.observe(started.elapsed().as_secs_f64());
    match &result {
        Ok(_) => {
            if let Ok(mut errors) = ctx.errors.lock() {
                errors.remove(&key(&job));
            }
        }
        Err(e) => {
            ctx.metrics.reconcile_errors.get_or_create(&ErrorLabels { error: e.kind().into() }).inc();
            warn!(job = %key(&job), error = %e, "reconcile failed");
            publish(
                &ctx,
                &job,
                &JobEvent {
                    warning: true,
                    reason: "ReconcileError".into(),
                    action: "Reconcile".into(),
                    note: e.to_string(),
                },
            )
            .await;
        }
    }
    result
}

/// The Controller's error policy: retry with exponential backoff per job.
pub fn error_policy(job: Arc<RLJob>, _error: &Error, ctx: Arc<Context>) -> Action {
    let n = match ctx.errors.lock() {
        Ok(mut errors) => {
            let n = errors.entry(key(&job)).or_insert(0);
            *n = n.saturating_add(1);
            *n
        }
        Err(_) => 1,
    };
    Action::requeue(backoff(n))
}

/// Wait before retry number `n` (1-based): 2 s, 4 s, 8 s … at most 5 min.
pub fn backoff(n: u32) -> Duration {
    let exp = n.saturating_sub(1).min(16);
    (ERROR_BACKOFF_MIN * 2u32.pow(exp)).min(ERROR_BACKOFF_MAX)
}

async fn reconcile_job(cached: &RLJob, ctx: &Context) -> Result<Action, Error> {
    let ns = cached.namespace().ok_or(Error::MissingMetadata("metadata.namespace"))?;
    let name = cached.name_any();
    let jobs: Api<RLJob> = Api::namespaced(ctx.client.clone(), &ns);
    // Read the job fresh, not from the watch cache: a cached status can lag our own last write
    // (epoch, restarts), and deciding on it could restart a gang twice for one failure.
    let Some(job) = jobs.get_opt(&name).await.map_err(|e| Error::kube("get", format!("RLJob {ns}/{name}"), e))? else {
        return Ok(Action::await_change());
    };
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let listed = pods
        .list(&ListParams::default().labels(&format!("{}={name}", labels::JOB)))
        .await
        .map_err(|e| Error::kube("list", format!("pods of RLJob {ns}/{name}"), e))?;
    let decision = decide::decide(&job, &listed.items, ctx.clock.now(), &ctx.config);
    debug!(job = %key(&job), phase = decision.phase.as_str(), steps = decision.steps.len(), "decided");
    execute(&job, &decision, ctx).await?;
    let old_phase = job.status.as_ref().map(|s| s.phase);
    if let Some(st) = decision.status()
        && old_phase != Some(st.phase)
    {
        info!(job = %key(&job), from = ?old_phase, to = st.phase.as_str(), "phase changed");
        ctx.metrics.transitions.get_or_create(&PhaseLabels { phase: st.phase.as_str().into() }).inc();
    }
    if let Some(kind) = decision.restart {
        ctx.metrics.restarts.get_or_create(&ReasonLabels { reason: kind.reason().into() }).inc();
    }
    Ok(match decision.requeue_after {
        Some(d) => Action::requeue(d),
        None => Action::await_change(),
    })
}

/// Executes the steps of `decision` in order, stopping at the first error.
pub async fn execute(job: &RLJob, decision: &Decision, ctx: &Context) -> Result<(), Error> {
    let ns = job.namespace().ok_or(Error::MissingMetadata("metadata.namespace"))?;
    let name = job.name_any();
    // Pods about to be created need their ServiceAccount, ConfigMap and Service: apply those
    // however recently they were.
    let creating = decision.steps.iter().any(|s| matches!(s, Step::CreatePods(_)));
    for step in &decision.steps {
        match step {
            Step::ApplyObjects(desired) => {
                let fingerprint = objects_fingerprint(desired);
                if !creating && ctx.applied_recently(job, fingerprint) {
                    debug!(job = %key(job), "objects unchanged since the last apply");
                    continue;
                }
                if let Err(e) = apply_objects(&ctx.client, &ns, desired).await {
                    ctx.record_applied(job, None);
                    return Err(create_failed(job, ctx, e).await);
                }
                ctx.record_applied(job, Some(fingerprint));
            }
            Step::CreatePods(pods) => {
                let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
                // Collected first: a stream over a borrowing closure is not Send enough for the
                // Controller's spawned futures.
                let creates: Vec<_> = pods.iter().map(|p| apply(&api, "Pod", &ns, p)).collect();
                let created = stream::iter(creates).buffer_unordered(POD_CONCURRENCY).try_collect::<Vec<()>>().await;
                if let Err(e) = created {
                    return Err(create_failed(job, ctx, e).await);
                }
            }
            Step::WriteStatus(status) => write_status(&ctx.client, job, status).await?,
            Step::DeletePods(pods) => {
                let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
                let deletes: Vec<_> = pods.iter().map(|p| delete_pod(&api, &ns, p)).collect();
                stream::iter(deletes).buffer_unordered(POD_CONCURRENCY).try_collect::<Vec<()>>().await?;
            }
            Step::DeleteObjects => {
                ctx.record_applied(job, None);
                let epoch = job.status.as_ref().map(|s| s.epoch).unwrap_or(0);
                delete_objects(&ctx.client, &ns, &name, &job.uid().unwrap_or_default(), epoch).await?
            }
            Step::DeletePodGroups(gangs) => {
                for gang in gangs {
                    delete_pod_group(&ctx.client, &ns, &name, *gang).await?;
                }
            }
            Step::DeleteJob => {
                let api: Api<RLJob> = Api::namespaced(ctx.client.clone(), &ns);
                let dp = DeleteParams {
                    preconditions: Some(Preconditions { uid: job.uid(), resource_version: None }),
                    ..DeleteParams::background()
                };
                match api.delete(&name, &dp).await {
                    Ok(_) => info!(job = %key(job), "deleted after ttlSecondsAfterFinished"),
                    Err(e) if is_code(&e, 404) || is_code(&e, 409) => {}
                    Err(e) => return Err(Error::kube("delete", format!("RLJob {ns}/{name}"), e)),
                }
            }
            Step::Publish(event) => publish(ctx, job, event).await,
        }
    }
    Ok(())
}

/// Records a failure to create pods or objects in status (PodsCreated=False/CreateFailed) and as
/// an Event, best effort, and returns the error for the retry.
async fn create_failed(job: &RLJob, ctx: &Context, error: Error) -> Error {
    let message = error.to_string();
    if let Some(status) = decide::create_failed(job, &message, ctx.clock.now())
        && let Err(e) = write_status(&ctx.client, job, &status).await
    {
        warn!(job = %key(job), error = %e, "cannot record the create failure in status");
    }
    publish(
        ctx,
        job,
        &JobEvent {
            warning: true,
            reason: crate::conditions::reasons::CREATE_FAILED.into(),
            action: "CreatePods".into(),
            note: message,
        },
    )
    .await;
    error
}

/// Server-side applies the operator's part of the status ([`RLJobStatus::operator_part`]: the
/// coordinator's fields are never in it); fields the operator stops sending (e.g. startTime on
/// suspend) are removed by the apply because the operator owned them.
pub async fn write_status(client: &Client, job: &RLJob, status: &RLJobStatus) -> Result<(), Error> {
    let ns = job.namespace().ok_or(Error::MissingMetadata("metadata.namespace"))?;
    let name = job.name_any();
    let api: Api<RLJob> = Api::namespaced(client.clone(), &ns);
    let status = status.operator_part();
    let patch = serde_json::json!({
        "apiVersion": RLJob::api_version(&()),
        "kind": RLJob::kind(&()),
        "status": status,
    });
    api.patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await
        .map_err(|e| Error::kube("write status of", format!("RLJob {ns}/{name}"), e))?;
    Ok(())
}

async fn apply<K>(api: &Api<K>, kind: &str, ns: &str, obj: &K) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(obj))
        .await
        .map_err(|e| Error::kube("apply", format!("{kind} {ns}/{name}"), e))?;
    Ok(())
}

async fn apply_objects(client: &Client, ns: &str, d: &Desired) -> Result<(), Error> {
    // One round of concurrent applies (they depend on nothing of each other), then the
    // RoleBinding: the API server's escalation check reads the Role it binds. Before a new gang
    // this is two round trips, not one per object.
    let policies = Api::<NetworkPolicy>::namespaced(client.clone(), ns);
    let network_policy = async {
        match &d.network_policy {
            Some(np) => apply(&policies, "NetworkPolicy", ns, np).await,
            None => delete_named(policies.clone(), "NetworkPolicy", ns, &network_policy_name(&d.plan.job.name)).await,
        }
    };
    let (accounts, roles) =
        (Api::<ServiceAccount>::namespaced(client.clone(), ns), Api::<Role>::namespaced(client.clone(), ns));
    let (services, maps) =
        (Api::<Service>::namespaced(client.clone(), ns), Api::<ConfigMap>::namespaced(client.clone(), ns));
    let claim_templates = Api::<ResourceClaimTemplate>::namespaced(client.clone(), ns);
    let gpu_claim_templates = futures::future::try_join_all(
        d.gpu_claim_templates.iter().map(|t| apply(&claim_templates, "ResourceClaimTemplate", ns, t)),
    );
    futures::try_join!(
        gpu_claim_templates,
        apply(&accounts, "ServiceAccount", ns, &d.service_account),
        apply(&roles, "Role", ns, &d.role),
        apply(&services, "Service", ns, &d.service),
        apply(&maps, "ConfigMap", ns, &d.config_map),
        create_key_secret(client, ns, d),
        network_policy,
        apply_pod_group(client, ns, d),
    )?;
    apply(&Api::<RoleBinding>::namespaced(client.clone(), ns), "RoleBinding", ns, &d.role_binding).await
}

/// Applies the job's PodGroup, when it has one; a missing PodGroup API names the gang scheduler.
async fn apply_pod_group(client: &Client, ns: &str, d: &Desired) -> Result<(), Error> {
    let Some(pg) = &d.pod_group else { return Ok(()) };
    let types = pg.types.clone().unwrap_or_default();
    let (group, version) = types.api_version.split_once('/').unwrap_or(("", types.api_version.as_str()));
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, &types.kind));
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    match apply(&api, "PodGroup", ns, pg).await {
        Err(Error::Kube { source, .. }) if is_code(&source, 404) => {
            Err(gang_missing(if group == "scheduling.volcano.sh" {
                GangScheduler::Volcano
            } else {
                GangScheduler::Coscheduling
            }))
        }
        other => other,
    }
}

/// Creates the epoch's key Secret with a fresh random key unless it exists (an epoch keeps its
/// first key: the Secret is immutable and never read back); having created it, deletes the
/// previous epoch's (whose pods are gone or going: nothing needs that key any more).
/// Creating rather than applying keeps the operator's rights on Secrets to `create` and `delete`:
/// it never needs to `get`, `list` or `patch` one.
async fn create_key_secret(client: &Client, ns: &str, d: &Desired) -> Result<(), Error> {
    let api = Api::<Secret>::namespaced(client.clone(), ns);
    let name = d.key_secret.metadata.name.clone().unwrap_or_default();
    let key = rlplane_api::plan::generate_job_key().map_err(|_| Error::Random("an epoch's key"))?;
    let pp = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
    match api.create(&pp, &d.key_secret_with(&key)).await {
        Ok(_) => info!(secret = %name, "created the epoch's key"),
        // It exists: this epoch's key stays, and the previous one went when it was created.
        Err(e) if is_code(&e, 409) => return Ok(()),
        Err(e) => return Err(Error::kube("create", format!("Secret {ns}/{name}"), e)),
    }
    let job = &d.plan.job;
    if let Some(previous) = job.epoch.checked_sub(1) {
        delete_named(api, "Secret", ns, &job_key_secret_name(&job.name, &job.uid, previous)).await?;
    }
    Ok(())
}

fn pod_group_api(gang: GangScheduler) -> Option<(ApiResource, &'static str, &'static str, &'static str)> {
    let (group, version, gang_name, install) = match gang {
        GangScheduler::None => return None,
        GangScheduler::Volcano => ("scheduling.volcano.sh", "v1beta1", "Volcano", "Volcano (volcano.sh)"),
        GangScheduler::Coscheduling => (
            "scheduling.x-k8s.io",
            "v1alpha1",
            "Coscheduling",
            "the scheduler-plugins coscheduling plugin (sigs.k8s.io/scheduler-plugins)",
        ),
    };
    let api =
        if group == "scheduling.volcano.sh" { "scheduling.volcano.sh/v1beta1" } else { "scheduling.x-k8s.io/v1alpha1" };
    Some((ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, "PodGroup")), gang_name, api, install))
}

fn gang_missing(gang: GangScheduler) -> Error {
    match pod_group_api(gang) {
        Some((_, gang, api, install)) => Error::GangSchedulerMissing { gang, api, install },
        None => Error::MissingMetadata("spec.scheduling.gang"),
    }
}

async fn delete_pod(api: &Api<Pod>, ns: &str, pod: &PodRef) -> Result<(), Error> {
    let dp = DeleteParams {
        preconditions: pod.uid.clone().map(|uid| Preconditions { uid: Some(uid), resource_version: None }),
        ..DeleteParams::default()
    };
    match api.delete(&pod.name, &dp).await {
        // Gone already, or a newer pod holds the name (the precondition failed): nothing to do.
        Err(e) if is_code(&e, 404) || is_code(&e, 409) => Ok(()),
        Err(e) => Err(Error::kube("delete", format!("Pod {ns}/{}", pod.name), e)),
        Ok(_) => Ok(()),
    }
}

async fn delete_named<K>(api: Api<K>, kind: &str, ns: &str, name: &str) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Err(e) if is_code(&e, 404) => Ok(()),
        Err(e) => Err(Error::kube("delete", format!("{kind} {ns}/{name}"), e)),
        Ok(_) => Ok(()),
    }
}

async fn delete_pod_group(client: &Client, ns: &str, job: &str, gang: GangScheduler) -> Result<(), Error> {
    let Some((ar, ..)) = pod_group_api(gang) else { return Ok(()) };
    // 404 also when the cluster does not serve that PodGroup API at all: nothing to delete.
    delete_named(Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ar), "PodGroup", ns, &pod_group_name(job))
        .await
}

async fn delete_objects(client: &Client, ns: &str, job: &str, uid: &str, epoch: u32) -> Result<(), Error> {
    let worker = worker_service_account_name(job);
    // The key of the job's last epoch (and of the one before, had its deletion not been reached);
    // the RLJob's deletion collects any other through the owner reference.
    let secrets = Api::<Secret>::namespaced(client.clone(), ns);
    for e in [Some(epoch), epoch.checked_sub(1)].into_iter().flatten() {
        delete_named(secrets.clone(), "Secret", ns, &job_key_secret_name(job, uid, e)).await?;
    }
    delete_named(Api::<NetworkPolicy>::namespaced(client.clone(), ns), "NetworkPolicy", ns, &network_policy_name(job))
        .await?;
    delete_named(Api::<Service>::namespaced(client.clone(), ns), "Service", ns, &headless_service_name(job)).await?;
    delete_named(Api::<ConfigMap>::namespaced(client.clone(), ns), "ConfigMap", ns, &plan_config_map_name(job)).await?;
    delete_named(Api::<RoleBinding>::namespaced(client.clone(), ns), "RoleBinding", ns, &worker).await?;
    delete_named(Api::<Role>::namespaced(client.clone(), ns), "Role", ns, &worker).await?;
    delete_named(Api::<ServiceAccount>::namespaced(client.clone(), ns), "ServiceAccount", ns, &worker).await?;
    for gang in [GangScheduler::Volcano, GangScheduler::Coscheduling] {
        delete_pod_group(client, ns, job, gang).await?;
    }
    Ok(())
}

/// Publishes an Event on the job, best effort: an Event that cannot be written is logged, and
/// never fails or repeats a reconcile.
async fn publish(ctx: &Context, job: &RLJob, event: &JobEvent) {
    let ev = Event {
        type_: if event.warning { EventType::Warning } else { EventType::Normal },
        reason: event.reason.clone(),
        note: Some(event.note.clone()),
        action: event.action.clone(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &job.object_ref(&())).await {
        warn!(job = %key(job), reason = %event.reason, error = %e, "cannot publish event");
    }
}

/// The phase recorded in a job's status (Pending when it has none).
pub fn phase_of(job: &RLJob) -> Phase {
    job.status.as_ref().map(|s| s.phase).unwrap_or_default()
}
