//! The desired state of an RLJob epoch, computed by pure functions from the spec: the worker's
//! ServiceAccount, Role and RoleBinding, the headless Service, the plan ConfigMap, the epoch's key
//! Secret (its metadata; the random key is the caller's), the NetworkPolicy, every Pod, and the
//! gang scheduler's PodGroup. No I/O here; the controller applies the result with server-side
//! apply (the Secret it creates once per epoch).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HTTPGetAction, KeyToPath, ObjectFieldSelector, Pod, PodResourceClaim, PodSpec, Probe, ResourceClaim,
    ResourceRequirements, Secret, SecretVolumeSource, Service, ServiceAccount, ServicePort, ServiceSpec, Volume,
    VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::api::resource::v1::{
    DeviceClaim, DeviceRequest, ExactDeviceRequest, ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use rlplane_api::plan::{
    JOB_KEY_LEN, JOB_KEY_SECRET_KEY, KEY_FILE_ENV, POD_KEY_DIR, POD_KEY_FILE, PodEntry, PodRole, ProcessRole,
    WorkerPlan, encode_job_key, job_key_secret_name,
};
use rlplane_api::topology::{
    ClusterAddressing, JobIdentity, POD_IPC_DIR, build_plan, headless_service_name, plan_config_map_name,
};
use rlplane_api::{
    Device, GangScheduler, GpuSharing, PodOverrides, RLJob, RLJobSpec, RunPolicy, UserTemplate, ValidationErrors,
    validate_job,
};

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
    let name = job.metadata.name.clone().ok_or(DesiredError::MissingMetadata("metadata.name"))?;
    let namespace = job.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let uid = job.metadata.uid.clone().ok_or(DesiredError::MissingMetadata("metadata.uid"))?;
    // The resume point the operator fixed when it started this epoch (decide.rs, restart).
    let resume = job.status.as_ref().filter(|s| s.epoch == epoch).and_then(|s| s.resumed_from.clone());
    let id = JobIdentity { name: name.clone(), namespace: namespace.clone(), uid, epoch, resume };
    let addressing = ClusterAddressing { job: name.clone(), namespace: namespace.clone() };
    let plan = build_plan(&job.spec, &id, &addressing).map_err(DesiredError::InvalidSpec)?;
    let plan_json = serde_json::to_string(&plan).expect("a plan always serializes");
    if plan_json.len() > MAX_PLAN_BYTES {
        return Err(DesiredError::PlanTooLarge { bytes: plan_json.len() });
    }
    let owner = owner_reference(job);
    let meta = |obj_name: String, extra: BTreeMap<String, String>| ObjectMeta {
        name: Some(obj_name),
        namespace: Some(namespace.clone()),
        labels: Some(common_labels(&name).into_iter().chain(extra).collect()),
        owner_references: Some(vec![owner.clone()]),
        ..Default::default()
    };

    let service = Service {
        metadata: meta(headless_service_name(&name), BTreeMap::new()),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            // Ranks rendezvous before they are ready: their DNS names must resolve at once.
            publish_not_ready_addresses: Some(true),
            selector: Some(selector_labels(&name)),
            ports: Some(vec![ServicePort {
                name: Some("metrics".into()),
                port: job.spec.observability.metrics_port as i32,
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };

    let config_map = ConfigMap {
        metadata: meta(plan_config_map_name(&name), BTreeMap::from([(labels::EPOCH.into(), epoch.to_string())])),
        data: Some(BTreeMap::from([(PLAN_KEY.into(), plan_json)])),
        ..Default::default()
    };

    let worker_sa = worker_service_account_name(&name);
    let service_account = ServiceAccount {
        metadata: meta(worker_sa.clone(), BTreeMap::new()),
        // Only the coordinator's pod mounts a token (see `pod`); the account itself allows it.
        ..Default::default()
    };
    let role = Role {
        metadata: meta(worker_sa.clone(), BTreeMap::new()),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![RLJob::group(&()).into_owned()]),
            resources: Some(vec![format!("{}/status", RLJob::plural(&()))]),
            resource_names: Some(vec![name.clone()]),
            verbs: vec!["get".into(), "patch".into()],
            ..Default::default()
        }]),
    };
    let mut subjects = vec![worker_sa.clone()];
    for sa in template_service_accounts(job) {
        if !subjects.contains(&sa) {
            subjects.push(sa);
        }
    }
    let role_binding = RoleBinding {
        metadata: meta(worker_sa.clone(), BTreeMap::new()),
        role_ref: RoleRef { api_group: "rbac.authorization.k8s.io".into(), kind: "Role".into(), name: worker_sa },
        subjects: Some(
            subjects
                .into_iter()
                .map(|sa| Subject {
                    kind: "ServiceAccount".into(),
                    name: sa,
                    namespace: Some(namespace.clone()),
                    ..Default::default()
                })
                .collect(),
        ),
    };

    let key_secret = Secret {
        metadata: meta(
            job_key_secret_name(&name, &id.uid, epoch),
            BTreeMap::from([(labels::EPOCH.into(), epoch.to_string())]),
        ),
        type_: Some("Opaque".into()),
        // Never rewritten in place: a new epoch gets a new Secret, so running pods never see
        // their key change.
        immutable: Some(true),
        ..Default::default()
    };
    let network_policy = job.spec.network_policy.enabled.then(|| network_policy(job, &name, &meta));

    let pod_group = pod_group(job, &name, &namespace, &owner, plan.pods.len());
    let hash = spec_hash(&job.spec);
    let pods = (0..plan.pods.len()).map(|i| pod(job, &plan, i, epoch, cfg, &owner, &hash, &meta)).collect();
    let gpu_claim_templates = gpu_claim_templates(job, &plan, &meta);
    Ok(Desired {
        plan,
        service_account,
        role,
        role_binding,
        service,
        config_map,
        key_secret,
        network_policy,
        pods,
        pod_group,
        gpu_claim_templates,
    })
}

/// The name of the job's ResourceClaimTemplate for pods of `gpus` GPUs.
pub fn gpu_claim_template_name(job: &str, gpus: u32) -> String {
    format!("{job}-gpus-{gpus}")
}

/// The pod's name for its GPU claim, which the worker and every user container reference.
pub const GPU_CLAIM: &str = "gpus";

/// `spec.gpus.sharing: ResourceClaim`: one ResourceClaimTemplate per GPU count among the job's
/// pods, asking its DeviceClass for exactly that many devices.
fn gpu_claim_templates(
    job: &RLJob,
    plan: &WorkerPlan,
    meta: &dyn Fn(String, BTreeMap<String, String>) -> ObjectMeta,
) -> Vec<ResourceClaimTemplate> {
    let spec = &job.spec;
    if spec.device != Device::Gpu || spec.gpus.sharing != GpuSharing::ResourceClaim {
        return Vec::new();
    }
    let class = spec.gpus.device_class_name.clone().unwrap_or_default();
    let mut counts: Vec<u32> = plan.pods.iter().map(|p| p.gpus).filter(|&g| g > 0).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
        .into_iter()
        .map(|gpus| ResourceClaimTemplate {
            metadata: meta(gpu_claim_template_name(&plan.job.name, gpus), BTreeMap::new()),
            spec: ResourceClaimTemplateSpec {
                metadata: None,
                spec: ResourceClaimSpec {
                    devices: Some(DeviceClaim {
                        requests: Some(vec![DeviceRequest {
                            name: GPU_CLAIM.into(),
                            exactly: Some(ExactDeviceRequest {
                                device_class_name: class.clone(),
                                allocation_mode: Some("ExactCount".into()),
                                count: Some(gpus as i64),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }]),
                        ..Default::default()
                    }),
                },
            },
        })
        .collect()
}

/// Gives the pod's containers its GPUs as `spec.gpus` says. `DevicePlugin`: without user
/// containers the worker requests them; with them, the first user container does (unless one
/// asks itself) and the worker sees the node's GPUs by environment, with the NVIDIA toolkit
/// mounting the driver. `ResourceClaim`: the pod's claim, used by the worker and every user
/// container. Either way every container enumerates devices in PCI order, so that device n is
/// the same GPU in each.
fn assign_gpus(pod: &mut PodSpec, job: &RLJob, gpus: u32) {
    let spec = &job.spec;
    if spec.device != Device::Gpu || gpus == 0 {
        return;
    }
    let sidecar = pod.init_containers.iter().flatten().any(|c| c.name == WORKER_CONTAINER);
    match spec.gpus.sharing {
        GpuSharing::DevicePlugin if !sidecar => {
            for w in pod.containers.iter_mut().filter(|c| c.name == WORKER_CONTAINER) {
                w.resources = with_gpus(w.resources.take(), gpus);
            }
        }
        GpuSharing::DevicePlugin => {
            let asks = |c: &Container| {
                c.resources.as_ref().and_then(|r| r.limits.as_ref()).is_some_and(|l| l.contains_key("nvidia.com/gpu"))
            };
            if !pod.containers.iter().any(asks)
                && let Some(first) = pod.containers.first_mut()
            {
                first.resources = with_gpus(first.resources.take(), gpus);
            }
            for w in pod.init_containers.iter_mut().flatten().filter(|c| c.name == WORKER_CONTAINER) {
                set_env_default(w, "NVIDIA_VISIBLE_DEVICES", "all");
                set_env_default(w, "NVIDIA_DRIVER_CAPABILITIES", "compute,utility");
            }
        }
        GpuSharing::ResourceClaim => {
            pod.resource_claims = Some(vec![PodResourceClaim {
                name: GPU_CLAIM.into(),
                resource_claim_template_name: Some(gpu_claim_template_name(
                    job.metadata.name.as_deref().unwrap_or_default(),
                    gpus,
                )),
                ..Default::default()
            }]);
            for c in gpu_containers(pod) {
                let claims = c.resources.get_or_insert_with(Default::default).claims.get_or_insert_with(Vec::new);
                claims.push(ResourceClaim { name: GPU_CLAIM.into(), request: None });
            }
        }
    }
    for c in gpu_containers(pod) {
        set_env_default(c, "CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    }
}

/// The containers that use the pod's GPUs: the worker and every user container (the user's own
/// init containers do not).
fn gpu_containers(pod: &mut PodSpec) -> impl Iterator<Item = &mut Container> {
    pod.containers.iter_mut().chain(pod.init_containers.iter_mut().flatten().filter(|c| c.name == WORKER_CONTAINER))
}

/// Sets `name` in the container's environment unless the user's spec already does.
fn set_env_default(c: &mut Container, name: &str, value: &str) {
    let env = c.env.get_or_insert_with(Vec::new);
    if !env.iter().any(|e| e.name == name) {
        env.push(EnvVar { name: name.into(), value: Some(value.into()), ..Default::default() });
    }
}

impl Desired {
    /// The epoch's key Secret holding `key` (64 hex characters under `key`), to create once per
    /// epoch. The key is an argument so that this stays pure: the controller draws it from the
    /// operating system's random source.
    pub fn key_secret_with(&self, key: &[u8; JOB_KEY_LEN]) -> Secret {
        let mut s = self.key_secret.clone();
        s.data = Some(BTreeMap::from([(JOB_KEY_SECRET_KEY.into(), ByteString(encode_job_key(key).into_bytes()))]));
        s
    }
}

/// Name of the job's NetworkPolicy.
pub fn network_policy_name(job: &str) -> String {
    format!("{job}-ingress")
}

/// Ports of the user's containers that serve metrics: those named `metrics` or `metrics-…` in
/// the job's templates (vLLM's server, a trainer's exporter), which the scrapers may reach too.
fn user_metrics_ports(job: &RLJob) -> Vec<NetworkPolicyPort> {
    let mut ports: Vec<NetworkPolicyPort> = [&job.spec.trainer.template, &job.spec.generation.template]
        .into_iter()
        .flatten()
        .filter_map(|t| t.pod_template().ok()?.spec)
        .flat_map(|s| s.containers)
        .flat_map(|c| c.ports.unwrap_or_default())
        .filter(|p| p.name.as_deref().is_some_and(|n| n == "metrics" || n.starts_with("metrics-")))
        .map(|p| NetworkPolicyPort {
            port: Some(IntOrString::Int(p.container_port)),
            protocol: Some(p.protocol.unwrap_or_else(|| "TCP".into())),
            ..Default::default()
        })
        .collect();
    ports.sort_by_key(|p| {
        p.port.clone().map(|x| match x {
            IntOrString::Int(i) => i,
            IntOrString::String(_) => 0,
        })
    });
    ports.dedup();
    ports
}

/// The job's NetworkPolicy: its pods admit ingress from the job's own pods on every port, and
/// from the metrics scrapers on the metrics port and the user's containers' metrics ports;
/// nothing else.
fn network_policy(
    job: &RLJob,
    name: &str,
    meta: &dyn Fn(String, BTreeMap<String, String>) -> ObjectMeta,
) -> NetworkPolicy {
    let np = &job.spec.network_policy;
    let own_pods = LabelSelector { match_labels: Some(selector_labels(name)), ..Default::default() };
    let scrapers = NetworkPolicyPeer {
        pod_selector: Some(LabelSelector {
            match_labels: Some(np.metrics_scraper_labels.clone()).filter(|l| !l.is_empty()),
            ..Default::default()
        }),
        // A namespace selector (empty: every namespace) so that Prometheus may run elsewhere.
        namespace_selector: Some(LabelSelector {
            match_labels: Some(np.metrics_scraper_namespace_labels.clone()).filter(|l| !l.is_empty()),
            ..Default::default()
        }),
        ..Default::default()
    };
    NetworkPolicy {
        metadata: meta(network_policy_name(name), BTreeMap::new()),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(own_pods.clone()),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer { pod_selector: Some(own_pods), ..Default::default() }]),
                    ports: None,
                },
                NetworkPolicyIngressRule {
                    from: Some(vec![scrapers]),
                    ports: Some(
                        std::iter::once(NetworkPolicyPort {
                            port: Some(IntOrString::Int(job.spec.observability.metrics_port as i32)),
                            protocol: Some("TCP".into()),
                            ..Default::default()
                        })
                        .chain(user_metrics_ports(job))
                        .collect(),
                    ),
                },
            ]),
            ..Default::default()
        }),
    }
}

/// Name of the job's worker ServiceAccount, Role and RoleBinding.
pub fn worker_service_account_name(job: &str) -> String {
    format!("{job}-worker")
}

/// ServiceAccounts named by the job's user templates (pods built from them run as those).
fn template_service_accounts(job: &RLJob) -> Vec<String> {
    [&job.spec.trainer.template, &job.spec.generation.template]
        .into_iter()
        .flatten()
        .filter_map(|t| t.pod_template().ok()?.spec?.service_account_name)
        .collect()
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

/// Name of the job's PodGroup.
pub fn pod_group_name(job: &str) -> String {
    format!("{job}-gang")
}

fn pod_group(job: &RLJob, name: &str, namespace: &str, owner: &OwnerReference, pods: usize) -> Option<DynamicObject> {
    let (group, version) = match job.spec.scheduling.gang {
        GangScheduler::None => return None,
        GangScheduler::Volcano => ("scheduling.volcano.sh", "v1beta1"),
        GangScheduler::Coscheduling => ("scheduling.x-k8s.io", "v1alpha1"),
    };
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, "PodGroup"));
    let mut spec = serde_json::json!({ "minMember": pods });
    if let Some(pc) = &job.spec.scheduling.priority_class_name
        && job.spec.scheduling.gang == GangScheduler::Volcano
    {
        spec["priorityClassName"] = pc.clone().into();
    }
    let mut obj =
        DynamicObject::new(&pod_group_name(name), &ar).within(namespace).data(serde_json::json!({ "spec": spec }));
    obj.metadata.labels = Some(common_labels(name));
    obj.metadata.owner_references = Some(vec![owner.clone()]);
    Some(obj)
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

#[allow(clippy::too_many_arguments)]
fn pod(
    job: &RLJob,
    plan: &WorkerPlan,
    index: usize,
    epoch: u32,
    cfg: &OperatorConfig,
    owner: &OwnerReference,
    spec_hash: &str,
    meta: &dyn Fn(String, BTreeMap<String, String>) -> ObjectMeta,
) -> Pod {
    let entry: &PodEntry = &plan.pods[index];
    let spec = &job.spec;
    let job_name = &plan.job.name;
    let procs = plan.processes_of_pod(index as u32);
    // Role-specific settings: generation pods in Split mode use the generation spec, storage
    // pods neither role's overrides.
    let (overrides, image, resources, templates): (Option<&PodOverrides>, _, _, Vec<&UserTemplate>) = match entry.role {
        PodRole::Trainer => (
            Some(&spec.trainer.pod),
            spec.trainer.image.clone(),
            spec.trainer.resources.clone(),
            spec.user_templates(entry.role),
        ),
        PodRole::Generation => (
            Some(&spec.generation.pod),
            spec.generation.image.clone(),
            spec.generation.resources.clone(),
            spec.user_templates(entry.role),
        ),
        PodRole::Storage => (None, spec.trainer.image.clone(), None, Vec::new()),
    };

    let first_rank = procs.iter().find_map(|&p| match plan.process(p).role {
        ProcessRole::Trainer(c) => Some(c.rank),
        ProcessRole::Generation(c) => Some(c.rank),
        ProcessRole::Storage { unit } => Some(unit),
        ProcessRole::Coordinator => None,
    });
    let mut pod_labels = BTreeMap::from([
        (labels::ROLE.to_string(), entry.role.short().to_string()),
        (labels::INDEX.to_string(), entry.index.to_string()),
        (labels::EPOCH.to_string(), epoch.to_string()),
        ("app.kubernetes.io/component".to_string(), entry.role.short().to_string()),
    ]);
    if let Some(r) = first_rank {
        pod_labels.insert(labels::FIRST_RANK.into(), r.to_string());
    }
    if procs.contains(&plan.coordinator) {
        pod_labels.insert(labels::COORDINATOR.into(), "true".into());
    }
    match spec.scheduling.gang {
        GangScheduler::Coscheduling => {
            pod_labels.insert("scheduling.x-k8s.io/pod-group".into(), pod_group_name(job_name));
        }
        GangScheduler::Volcano | GangScheduler::None => {}
    }
    let kueue_queue = kueue_queue(job);
    if let Some(q) = &kueue_queue {
        // Kueue's plain-pod group integration: pods carrying the queue and a group name are held
        // behind Kueue's scheduling gate and admitted together, as one workload of all the pods.
        pod_labels.insert(labels::KUEUE_QUEUE.into(), q.clone());
        pod_labels.insert(labels::KUEUE_POD_GROUP.into(), kueue_pod_group_name(job_name, epoch));
    }
    let mut metadata = meta(entry.name.clone(), pod_labels);
    let mut annotations: BTreeMap<String, String> = BTreeMap::new();
    for t in &templates {
        if let Ok(pt) = t.pod_template()
            && let Some(m) = pt.metadata
        {
            annotations.extend(m.annotations.unwrap_or_default());
            let l = metadata.labels.get_or_insert_with(BTreeMap::new);
            for (k, v) in m.labels.unwrap_or_default() {
                l.entry(k).or_insert(v);
            }
        }
    }
    if let Some(o) = overrides {
        annotations.extend(o.annotations.clone());
        let l = metadata.labels.get_or_insert_with(BTreeMap::new);
        for (k, v) in &o.labels {
            l.entry(k.clone()).or_insert(v.clone());
        }
    }
    if spec.scheduling.gang == GangScheduler::Volcano {
        annotations.insert("scheduling.k8s.io/group-name".into(), pod_group_name(job_name));
    }
    if kueue_queue.is_some() {
        annotations.insert(labels::KUEUE_POD_GROUP_COUNT.into(), plan.pods.len().to_string());
    }
    annotations.insert(
        "rlplane.dev/processes".into(),
        procs.iter().map(|&p| plan.process(p).name.as_str()).collect::<Vec<_>>().join(","),
    );
    annotations.insert(SPEC_HASH_ANNOTATION.into(), spec_hash.into());
    metadata.annotations = Some(annotations);
    metadata.owner_references = Some(vec![owner.clone()]);

    // The worker container.
    let mut ports = vec![ContainerPort {
        name: Some("metrics".into()),
        container_port: spec.observability.metrics_port as i32,
        ..Default::default()
    }];
    for &p in &procs {
        let pr = &plan.process(p).ports;
        for (kind, port) in [
            ("control", pr.control),
            ("tq", pr.tq_controller),
            ("refit", pr.refit),
            ("fanout", pr.fanout),
            ("storage", pr.storage),
        ] {
            if let Some(port) = port {
                ports.push(ContainerPort {
                    // Port names are at most 15 characters: kind + local index.
                    name: Some(format!("{kind}-{}", plan.process(p).local)),
                    container_port: port as i32,
                    ..Default::default()
                });
            }
        }
    }
    ports.sort_by_key(|p| p.container_port);
    ports.dedup_by_key(|p| p.container_port);

    let mut env = vec![
        env_field("RLPLANE_POD", "metadata.name"),
        env_field("RLPLANE_NAMESPACE", "metadata.namespace"),
        EnvVar { name: "RLPLANE_IPC_DIR".into(), value: Some(POD_IPC_DIR.into()), ..Default::default() },
        EnvVar { name: KEY_FILE_ENV.into(), value: Some(POD_KEY_FILE.into()), ..Default::default() },
    ];
    if let Some(o) = overrides {
        env.extend(o.env.iter().cloned());
    }
    let mut mounts = vec![
        VolumeMount { name: "plan".into(), mount_path: PLAN_MOUNT.into(), read_only: Some(true), ..Default::default() },
        // The epoch's key: only the worker container of this epoch's pods mounts it.
        VolumeMount {
            name: KEY_VOLUME.into(),
            mount_path: POD_KEY_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        },
        VolumeMount { name: "ipc".into(), mount_path: POD_IPC_DIR.into(), ..Default::default() },
        VolumeMount { name: "dshm".into(), mount_path: "/dev/shm".into(), ..Default::default() },
    ];
    if let Some(o) = overrides {
        mounts.extend(o.volume_mounts.iter().cloned());
    }
    let mut worker = Container {
        name: WORKER_CONTAINER.into(),
        image: Some(image.unwrap_or_else(|| cfg.worker_image.clone())),
        image_pull_policy: cfg.image_pull_policy.clone(),
        command: Some(vec!["rlplane".into(), "worker".into(), "--plan".into(), format!("{PLAN_MOUNT}/{PLAN_KEY}")]),
        env: Some(env),
        ports: Some(ports),
        volume_mounts: Some(mounts),
        resources,
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/readyz".into()),
                port: IntOrString::String("metrics".into()),
                ..Default::default()
            }),
            period_seconds: Some(2),
            failure_threshold: Some(3),
            ..Default::default()
        }),
        ..Default::default()
    };

    let mut volumes = vec![
        Volume {
            name: "plan".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: plan_config_map_name(job_name),
                items: Some(vec![KeyToPath { key: PLAN_KEY.into(), path: PLAN_KEY.into(), ..Default::default() }]),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: KEY_VOLUME.into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(job_key_secret_name(job_name, &plan.job.uid, epoch)),
                items: Some(vec![KeyToPath {
                    key: JOB_KEY_SECRET_KEY.into(),
                    path: JOB_KEY_SECRET_KEY.into(),
                    ..Default::default()
                }]),
                // Readable in the container whatever uid it runs as (the worker image's 65532, a
                // user's image); nothing outside the pod sees the volume.
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume { name: "ipc".into(), empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() },
        Volume {
            name: "dshm".into(),
            empty_dir: Some(EmptyDirVolumeSource { medium: Some("Memory".into()), ..Default::default() }),
            ..Default::default()
        },
    ];
    if let Some(o) = overrides {
        volumes.extend(o.volumes.iter().cloned());
    }

    let mut pod_spec = PodSpec {
        hostname: Some(entry.name.clone()),
        subdomain: Some(headless_service_name(job_name)),
        restart_policy: Some("Never".into()),
        termination_grace_period_seconds: Some(spec.run_policy.termination_grace_period_seconds.into()),
        scheduler_name: scheduler_name(job),
        priority_class_name: spec.scheduling.priority_class_name.clone(),
        node_selector: overrides.map(|o| o.node_selector.clone()).filter(|m| !m.is_empty()),
        tolerations: overrides.map(|o| o.tolerations.clone()).filter(|v| !v.is_empty()),
        affinity: overrides.and_then(|o| o.affinity.clone()),
        ..Default::default()
    };

    if templates.is_empty() {
        pod_spec.containers = vec![worker];
    } else {
        // Users' containers run the real trainer / engine; the worker joins as a native sidecar
        // (an init container with restartPolicy Always), sharing the IPC sockets and /dev/shm.
        worker.restart_policy = Some("Always".into());
        let shared = [
            VolumeMount { name: "ipc".into(), mount_path: POD_IPC_DIR.into(), ..Default::default() },
            VolumeMount { name: "dshm".into(), mount_path: "/dev/shm".into(), ..Default::default() },
        ];
        let mut containers = Vec::new();
        let mut init = vec![worker];
        for t in &templates {
            let Ok(pt) = t.pod_template() else { continue };
            let Some(ts) = pt.spec else { continue };
            for mut c in ts.containers {
                let m = c.volume_mounts.get_or_insert_with(Vec::new);
                m.extend(
                    shared
                        .iter()
                        .filter(|s| !m.iter().any(|x| x.mount_path == s.mount_path))
                        .cloned()
                        .collect::<Vec<_>>(),
                );
                let e = c.env.get_or_insert_with(Vec::new);
                e.push(env_field("RLPLANE_POD", "metadata.name"));
                e.push(EnvVar {
                    name: "RLPLANE_IPC_DIR".into(),
                    value: Some(POD_IPC_DIR.into()),
                    ..Default::default()
                });
                // The pod's /dev/shm is its own memory-backed volume, and the user's container
                // may run as another user than the worker: the client's shared-memory files are
                // created readable and writable by both (docs/local-api.md).
                e.push(EnvVar { name: "RLPLANE_SHM_MODE".into(), value: Some("0666".into()), ..Default::default() });
                e.extend(spec.template_env(t).into_iter().map(|(name, value)| EnvVar {
                    name: name.into(),
                    value: Some(value),
                    ..Default::default()
                }));
                containers.push(c);
            }
            init.extend(ts.init_containers.unwrap_or_default());
            volumes.extend(ts.volumes.unwrap_or_default());
            if pod_spec.service_account_name.is_none() {
                pod_spec.service_account_name = ts.service_account_name;
            }
            if pod_spec.node_selector.is_none() {
                pod_spec.node_selector = ts.node_selector;
            }
            if pod_spec.tolerations.is_none() {
                pod_spec.tolerations = ts.tolerations;
            }
            if pod_spec.affinity.is_none() {
                pod_spec.affinity = ts.affinity;
            }
            pod_spec.image_pull_secrets = pod_spec.image_pull_secrets.or(ts.image_pull_secrets);
        }
        pod_spec.containers = containers;
        pod_spec.init_containers = Some(init);
    }
    volumes.dedup_by(|a, b| a.name == b.name);
    pod_spec.volumes = Some(volumes);
    assign_gpus(&mut pod_spec, job, entry.gpus);
    if pod_spec.service_account_name.is_none() {
        // The job's own account; only the coordinator reports status, so only its pod gets a
        // token. A user template that names an account keeps that account and its token rules.
        pod_spec.service_account_name = Some(worker_service_account_name(job_name));
        if !procs.contains(&plan.coordinator) {
            pod_spec.automount_service_account_token = Some(false);
        }
    }
    Pod { metadata, spec: Some(pod_spec), status: None }
}

fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector { field_path: path.into(), ..Default::default() }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The user's resources with `nvidia.com/gpu` set to `gpus` in limits and requests (when > 0).
fn with_gpus(resources: Option<ResourceRequirements>, gpus: u32) -> Option<ResourceRequirements> {
    if gpus == 0 {
        return resources;
    }
    let mut r = resources.unwrap_or_default();
    let q = Quantity(gpus.to_string());
    r.limits.get_or_insert_with(BTreeMap::new).insert("nvidia.com/gpu".into(), q.clone());
    r.requests.get_or_insert_with(BTreeMap::new).insert("nvidia.com/gpu".into(), q);
    Some(r)
}
