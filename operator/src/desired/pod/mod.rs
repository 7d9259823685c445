//! One Pod of the plan: its metadata, the worker container (alone, or as the native sidecar of the
//! user's containers), its volumes, where it may be scheduled, its GPUs and its identity.

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements, Volume};
use rlplane_api::plan::{PodEntry, PodRole, WorkerPlan};
use rlplane_api::topology::headless_service_name;
use rlplane_api::{GangScheduler, PodOverrides, RLJob, RLJobSpec, UserTemplate};

use super::gpus::assign_gpus;
use super::{JobMeta, OperatorConfig, worker_service_account_name};

mod containers;
mod metadata;
mod volumes;

/// One pod of the plan, with everything that shapes it.
struct PlannedPod<'a> {
    job: &'a RLJob,
    plan: &'a WorkerPlan,
    entry: &'a PodEntry,
    /// The plan's processes that run in this pod.
    procs: Vec<u32>,
    epoch: u32,
    role: RoleSettings<'a>,
}

impl PlannedPod<'_> {
    /// True when the pod runs the coordinator (the one process that reports status).
    fn runs_coordinator(&self) -> bool {
        self.procs.contains(&self.plan.coordinator)
    }
}

/// What a pod's role gives it: the worker's overrides, image and resources, and the user
/// templates whose containers join the pod.
struct RoleSettings<'a> {
    overrides: Option<&'a PodOverrides>,
    image: Option<String>,
    resources: Option<ResourceRequirements>,
    templates: Vec<&'a UserTemplate>,
}

/// Role-specific settings: generation pods in Split mode use the generation spec, storage pods
/// neither role's overrides.
fn role_settings(spec: &RLJobSpec, role: PodRole) -> RoleSettings<'_> {
    match role {
        PodRole::Trainer => RoleSettings {
            overrides: Some(&spec.trainer.pod),
            image: spec.trainer.image.clone(),
            resources: spec.trainer.resources.clone(),
            templates: spec.user_templates(role),
        },
        PodRole::Generation => RoleSettings {
            overrides: Some(&spec.generation.pod),
            image: spec.generation.image.clone(),
            resources: spec.generation.resources.clone(),
            templates: spec.user_templates(role),
        },
        PodRole::Storage => {
            RoleSettings { overrides: None, image: spec.trainer.image.clone(), resources: None, templates: Vec::new() }
        }
    }
}

/// The plan's pod `index` at `epoch`, its annotations carrying `spec_hash`.
pub(super) fn pod(
    job: &RLJob,
    plan: &WorkerPlan,
    index: usize,
    epoch: u32,
    cfg: &OperatorConfig,
    spec_hash: &str,
    meta: &JobMeta,
) -> Pod {
    let entry = &plan.pods[index];
    let pod = PlannedPod {
        job,
        plan,
        entry,
        procs: plan.processes_of_pod(index as u32),
        epoch,
        role: role_settings(&job.spec, entry.role),
    };
    let metadata = metadata::pod_metadata(&pod, spec_hash, meta);
    let worker = containers::worker_container(&pod, cfg);
    let mut volumes = volumes::pod_volumes(&pod);
    let mut pod_spec = placement(&pod);
    if pod.role.templates.is_empty() {
        pod_spec.containers = vec![worker];
    } else {
        add_user_templates(&mut pod_spec, &mut volumes, worker, &pod);
    }
    volumes.dedup_by(|a, b| a.name == b.name);
    pod_spec.volumes = Some(volumes);
    assign_gpus(&mut pod_spec, job, entry.gpus);
    default_service_account(&mut pod_spec, &pod);
    Pod { metadata, spec: Some(pod_spec), status: None }
}

/// The pod's spec before its containers and volumes: its DNS name under the headless Service,
/// no restarts, the grace period, the scheduler and priority, and the role's placement overrides.
fn placement(pod: &PlannedPod) -> PodSpec {
    let spec = &pod.job.spec;
    let overrides = pod.role.overrides;
    PodSpec {
        hostname: Some(pod.entry.name.clone()),
        subdomain: Some(headless_service_name(&pod.plan.job.name)),
        restart_policy: Some("Never".into()),
        termination_grace_period_seconds: Some(spec.run_policy.termination_grace_period_seconds.into()),
        scheduler_name: scheduler_name(pod.job),
        priority_class_name: spec.scheduling.priority_class_name.clone(),
        node_selector: overrides.map(|o| o.node_selector.clone()).filter(|m| !m.is_empty()),
        tolerations: overrides.map(|o| o.tolerations.clone()).filter(|v| !v.is_empty()),
        affinity: overrides.and_then(|o| o.affinity.clone()),
        ..Default::default()
    }
}

/// Scheduler name for the pods: the explicit one, else the gang scheduler's.
fn scheduler_name(job: &RLJob) -> Option<String> {
    let s = &job.spec.scheduling;
    s.scheduler_name.clone().or(match s.gang {
        GangScheduler::None => None,
        GangScheduler::Volcano => Some("volcano".into()),
        GangScheduler::Coscheduling => Some("scheduler-plugins-scheduler".into()),
    })
}

/// Puts the containers of the role's user templates into the pod, with their init containers
/// and volumes; the first template to set the service account, node selector, tolerations,
/// affinity or image pull secrets sets them for the pod (unless the role's overrides did).
fn add_user_templates(pod_spec: &mut PodSpec, volumes: &mut Vec<Volume>, mut worker: Container, pod: &PlannedPod) {
    // Users' containers run the real trainer / engine; the worker joins as a native sidecar
    // (an init container with restartPolicy Always), sharing the IPC sockets and /dev/shm.
    worker.restart_policy = Some("Always".into());
    let mut containers = Vec::new();
    let mut init = vec![worker];
    for &t in &pod.role.templates {
        let Ok(pt) = t.pod_template() else { continue };
        let Some(ts) = pt.spec else { continue };
        let PodSpec {
            containers: user_containers,
            init_containers,
            volumes: user_volumes,
            service_account_name,
            node_selector,
            tolerations,
            affinity,
            image_pull_secrets,
            ..
        } = ts;
        containers.extend(user_containers.into_iter().map(|c| containers::user_container(c, &pod.job.spec, t)));
        init.extend(init_containers.unwrap_or_default());
        volumes.extend(user_volumes.unwrap_or_default());
        if pod_spec.service_account_name.is_none() {
            pod_spec.service_account_name = service_account_name;
        }
        if pod_spec.node_selector.is_none() {
            pod_spec.node_selector = node_selector;
        }
        if pod_spec.tolerations.is_none() {
            pod_spec.tolerations = tolerations;
        }
        if pod_spec.affinity.is_none() {
            pod_spec.affinity = affinity;
        }
        pod_spec.image_pull_secrets = pod_spec.image_pull_secrets.take().or(image_pull_secrets);
    }
    pod_spec.containers = containers;
    pod_spec.init_containers = Some(init);
}

/// Runs the pod as the job's worker account unless a user template named another.
fn default_service_account(pod_spec: &mut PodSpec, pod: &PlannedPod) {
    if pod_spec.service_account_name.is_none() {
        // The job's own account; only the coordinator reports status, so only its pod gets a
        // token. A user template that names an account keeps that account and its token rules.
        pod_spec.service_account_name = Some(worker_service_account_name(&pod.plan.job.name));
        if !pod.runs_coordinator() {
            pod_spec.automount_service_account_token = Some(false);
        }
    }
}
