//! The desired state of an RLJob epoch, computed by pure functions from the spec: the worker's
//! ServiceAccount, Role and RoleBinding, the headless Service, the plan ConfigMap, the epoch's key
//! Secret (its metadata; the random key is the caller's), the NetworkPolicy, every Pod, and the
//! gang scheduler's PodGroup. No I/O here; the controller applies the result with server-side
//! apply (the Secret it creates once per epoch).
//!
//! Each kind of object has its own builder, in its own module; [`desired`] composes them.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Resource;
use kube::api::DynamicObject;
use rlplane_api::plan::WorkerPlan;
use rlplane_api::topology::{ClusterAddressing, JobIdentity, build_plan};
use rlplane_api::{RLJob, RLJobSpec, RunPolicy, ValidationErrors, validate_job};

mod gpus;
mod key_secret;
mod network_policy;
mod plan_config_map;
mod pod;
mod pod_group;
mod rbac;
mod service;

pub use gpus::{GPU_CLAIM, gpu_claim_template_name};
pub use network_policy::network_policy_name;
pub use pod_group::pod_group_name;
pub use rbac::worker_service_account_name;

/// Label keys.
pub mod labels {
    /// The RLJob a pod belongs to.
    pub const JOB: &str = "rlplane.dev/job";
    /// Pod role: trainer, gen, tq.
    pub const ROLE: &str = "rlplane.dev/role";
    /// Pod index within its role.
    pub const INDEX: &str = "rlplane.dev/index";
    /// The epoch the pod was created for.
    pub const EPOCH: &str = "rlplane.dev/epoch";
    /// First global rank of the pod's role in the pod.
    pub const FIRST_RANK: &str = "rlplane.dev/first-rank";
    /// Set on the pod that runs the coordinator.
    pub const COORDINATOR: &str = "rlplane.dev/coordinator";
    /// Kueue's queue label on an RLJob (and on its pods, for Kueue's pod-group integration).
    pub const KUEUE_QUEUE: &str = "kueue.x-k8s.io/queue-name";
    /// Kueue's pod-group name label: pods of one group are admitted together.
    pub const KUEUE_POD_GROUP: &str = "kueue.x-k8s.io/pod-group-name";
    /// Kueue's annotation with the number of pods in the group.
    pub const KUEUE_POD_GROUP_COUNT: &str = "kueue.x-k8s.io/pod-group-total-count";
}

/// Annotation on every pod: a hash of the pod-shaping part of the spec the pod was built from.
/// A running gang whose pods carry another hash than the current spec's is restarted with the new
/// spec (a gang cannot be updated pod by pod).
pub const SPEC_HASH_ANNOTATION: &str = "rlplane.dev/spec-hash";
/// Field manager for server-side apply.
pub const FIELD_MANAGER: &str = "rlplane-operator";
/// Key of the plan in the ConfigMap.
pub const PLAN_KEY: &str = "plan.json";
/// Where the plan is mounted in the worker container.
pub const PLAN_MOUNT: &str = "/etc/rlplane";
/// Name of the pod volume holding the epoch's key (user containers that speak the transfer-queue
/// protocol may mount it too).
pub const KEY_VOLUME: &str = "job-key";
/// Name of the worker container (or native sidecar).
pub const WORKER_CONTAINER: &str = "rlplane-worker";
/// ConfigMaps hold at most 1 MiB.
pub const MAX_PLAN_BYTES: usize = 1_000_000;

/// Settings of the operator that shape pods.
#[derive(Clone, Debug)]
pub struct OperatorConfig {
    /// Worker image used when a role gives none.
    pub worker_image: String,
    /// Image pull policy of the worker container (None: the cluster default).
    pub image_pull_policy: Option<String>,
}

impl Default for OperatorConfig {
    fn default() -> Self {
        OperatorConfig {
            worker_image: format!("ghcr.io/rlplane/rlplane-worker:{}", env!("CARGO_PKG_VERSION")),
            image_pull_policy: None,
        }
    }
}

/// Why no desired state could be computed.
#[derive(Debug, thiserror::Error)]
pub enum DesiredError {
    /// The spec breaks validation rules; not retried until the spec changes.
    #[error("invalid spec:\n{0}")]
    InvalidSpec(ValidationErrors),
    /// The plan does not fit in a ConfigMap.
    #[error(
        "the worker plan is {bytes} bytes, over the ConfigMap limit of {MAX_PLAN_BYTES}; use a model preset instead of an explicit tensor list, or fewer ranks"
    )]
    PlanTooLarge {
        /// Plan size.
        bytes: usize,
    },
    /// The RLJob lacks metadata the operator needs.
    #[error("the RLJob has no {0}; it must come from the API server")]
    MissingMetadata(&'static str),
}

/// Everything the operator creates for one epoch of a job.
#[derive(Clone, Debug)]
pub struct Desired {
    /// The plan every worker reads.
    pub plan: WorkerPlan,
    /// `<job>-worker`: the identity the pods run as (unless a user template names its own), so
    /// that the coordinator can report `status.step` and `status.lastRefit`.
    pub service_account: ServiceAccount,
    /// `<job>-worker`: `get` and `patch` on this job's `rljobs/status`, nothing else.
    pub role: Role,
    /// Binds the Role to `<job>-worker` and to every ServiceAccount a user template names.
    pub role_binding: RoleBinding,
    /// Headless Service giving pods stable DNS names.
    pub service: Service,
    /// ConfigMap holding the plan (and no secret: the plan names where the key is mounted).
    pub config_map: ConfigMap,
    /// `<job>-key-<uid>-e<epoch>`: the epoch's key Secret, without its data (see
    /// [`Desired::key_secret_with`]); only this epoch's pods mount it.
    pub key_secret: Secret,
    /// `<job>-ingress`, when `spec.networkPolicy.enabled`.
    pub network_policy: Option<NetworkPolicy>,
    /// Every pod, trainer pods first.
    pub pods: Vec<Pod>,
    /// The gang scheduler's PodGroup, when `scheduling.gang` asks for one.
    pub pod_group: Option<DynamicObject>,
    /// `<job>-gpus-<n>`: with `spec.gpus.sharing: ResourceClaim`, one template per GPU count its
    /// pods have, from which each pod gets its own ResourceClaim.
    pub gpu_claim_templates: Vec<ResourceClaimTemplate>,
}

/// Computes the desired state of `job` at `epoch`.
pub fn desired(job: &RLJob, epoch: u32, cfg: &OperatorConfig) -> Result<Desired, DesiredError> {
    validate_job(job).map_err(DesiredError::InvalidSpec)?;
    let id = job_identity(job, epoch)?;
    let addressing = ClusterAddressing { job: id.name.clone(), namespace: id.namespace.clone() };
    let plan = build_plan(&job.spec, &id, &addressing).map_err(DesiredError::InvalidSpec)?;
    let plan_json = plan_json(&plan)?;
    let meta = JobMeta { job: id.name.clone(), namespace: id.namespace.clone(), owner: owner_reference(job) };
    let hash = spec_hash(&job.spec);
    Ok(Desired {
        service_account: rbac::service_account(&meta),
        role: rbac::role(&meta),
        role_binding: rbac::role_binding(job, &meta),
        service: service::headless_service(job, &meta),
        config_map: plan_config_map::plan_config_map(&meta, epoch, plan_json),
        key_secret: key_secret::key_secret(&meta, &id.uid, epoch),
        network_policy: job.spec.network_policy.enabled.then(|| network_policy::network_policy(job, &meta)),
        pods: (0..plan.pods.len()).map(|i| pod::pod(job, &plan, i, epoch, cfg, &hash, &meta)).collect(),
        pod_group: pod_group::pod_group(job, &meta, plan.pods.len()),
        gpu_claim_templates: gpus::gpu_claim_templates(job, &plan, &meta),
        plan,
    })
}

/// Who the job is at `epoch`, for its plan: name, namespace, uid, and the resume point.
fn job_identity(job: &RLJob, epoch: u32) -> Result<JobIdentity, DesiredError> {
    let name = job.metadata.name.clone().ok_or(DesiredError::MissingMetadata("metadata.name"))?;
    let namespace = job.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let uid = job.metadata.uid.clone().ok_or(DesiredError::MissingMetadata("metadata.uid"))?;
    // The resume point the operator fixed when it started this epoch (decide.rs, restart).
    let resume = job.status.as_ref().filter(|s| s.epoch == epoch).and_then(|s| s.resumed_from.clone());
    Ok(JobIdentity { name, namespace, uid, epoch, resume })
}

/// The plan as the JSON the ConfigMap carries, unless it is too large for one.
fn plan_json(plan: &WorkerPlan) -> Result<String, DesiredError> {
    let plan_json = serde_json::to_string(plan).expect("a plan always serializes");
    if plan_json.len() > MAX_PLAN_BYTES {
        return Err(DesiredError::PlanTooLarge { bytes: plan_json.len() });
    }
    Ok(plan_json)
}

/// What the metadata of every object of one job shares: its namespace, the common labels and the
/// RLJob as controlling owner (so that the objects are garbage-collected with it).
struct JobMeta {
    /// The RLJob's name.
    job: String,
    /// The RLJob's namespace, which its objects share.
    namespace: String,
    /// The RLJob as controlling owner.
    owner: OwnerReference,
}

impl JobMeta {
    /// Metadata of the job's object `name`, with `extra_labels` beside the common ones.
    fn object(&self, name: String, extra_labels: BTreeMap<String, String>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.clone()),
            labels: Some(common_labels(&self.job).into_iter().chain(extra_labels).collect()),
            owner_references: Some(vec![self.owner.clone()]),
            ..Default::default()
        }
    }
}

/// Hash of the part of the spec that shapes pods, the plan and the PodGroup: everything except
/// `runPolicy` (deadlines, TTL, backoff and suspend change no pod), `scheduling.queueName`
/// (Kueue's business) and `networkPolicy` (applied in place). FNV-1a 64 over the JSON form: stable across Rust versions and platforms.
pub fn spec_hash(spec: &RLJobSpec) -> String {
    let mut shaping = spec.clone();
    shaping.run_policy = RunPolicy::default();
    shaping.scheduling.queue_name = None;
    // The NetworkPolicy is applied in place; it shapes no pod.
    shaping.network_policy = Default::default();
    let bytes = serde_json::to_vec(&shaping).unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Labels on every object of a job.
pub fn common_labels(job: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "rlplane".into()),
        ("app.kubernetes.io/instance".into(), job.into()),
        ("app.kubernetes.io/managed-by".into(), FIELD_MANAGER.into()),
        ("app.kubernetes.io/part-of".into(), "rlplane".into()),
        (labels::JOB.into(), job.into()),
    ])
}

/// Labels that select a job's pods.
pub fn selector_labels(job: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(labels::JOB.into(), job.into())])
}

/// Owner reference making the RLJob the controller of an object (garbage-collected with it).
pub fn owner_reference(job: &RLJob) -> OwnerReference {
    OwnerReference {
        api_version: RLJob::api_version(&()).into_owned(),
        kind: RLJob::kind(&()).into_owned(),
        name: job.metadata.name.clone().unwrap_or_default(),
        uid: job.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// The Kueue queue a job asks for: its `kueue.x-k8s.io/queue-name` label, else
/// `spec.scheduling.queueName`.
pub fn kueue_queue(job: &RLJob) -> Option<String> {
    job.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::KUEUE_QUEUE).cloned())
        .or_else(|| job.spec.scheduling.queue_name.clone())
}

/// Name of a job epoch's Kueue pod group (one per epoch: a restarted gang is a new workload).
pub fn kueue_pod_group_name(job: &str, epoch: u32) -> String {
    format!("{job}-e{epoch}")
}
