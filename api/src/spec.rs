//! The `RLJob` custom resource (`rlplane.dev/v1alpha1`): spec, status and defaults.
//!
//! Every field's doc comment becomes its description in the CRD, so `kubectl explain` reads well.
//! Rules that can be checked statically are enforced twice: by CEL `x-kubernetes-validations` in
//! the CRD (the `#[x_kube(validation)]` attributes here) and by [`crate::validate`], which returns
//! every error with its field path and what to do.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, PodTemplateSpec, ResourceRequirements, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::model::{ModelPreset, TensorSpec};

/// Largest job name: pod names (`<job>-trainer-<i>`) and the headless Service
/// (`<job>-headless`) must stay valid DNS labels of at most 63 characters.
pub const MAX_JOB_NAME_LEN: usize = 40;

/// An RL post-training job: a trainer and generation engines, the refit of weights between them,
/// and the transfer queue that carries rollouts.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "rlplane.dev",
    version = "v1alpha1",
    kind = "RLJob",
    plural = "rljobs",
    shortname = "rlj",
    namespaced,
    status = "RLJobStatus",
    doc = "An RL post-training job (GRPO-style): trainer, generation engines, refit and transfer queue.",
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mode"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Step", type_ = "integer", json_path = ".status.step"),
    printcolumn(name = "Refit", type_ = "string", json_path = ".status.lastRefit.summary", description = "Last refit: version and seconds"),
    printcolumn(name = "Restarts", type_ = "integer", json_path = ".status.restarts"),
    printcolumn(name = "Waiting", type_ = "string", json_path = ".status.stall.message", description = "What the coordinator has been waiting for, 5 s or longer", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.size() <= 40").message("metadata.name: at most 40 characters, so that pod and Service names stay valid DNS labels; choose a shorter name"),
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.mode != 'Colocated' || self.generation.engines * self.generation.tensorParallel == self.trainer.nodes * self.trainer.gpusPerNode").message("spec.generation: in Colocated mode engines × tensorParallel must equal the trainer's nodes × gpusPerNode (generation shares the trainer's GPUs)"))]
#[x_kube(validation = Rule::new("self.mode != 'Colocated' || self.trainer.gpusPerNode % self.generation.tensorParallel == 0").message("spec.generation.tensorParallel: in Colocated mode an engine must fit in one trainer pod, so tensorParallel must divide trainer.gpusPerNode"))]
#[x_kube(validation = Rule::new("self.mode != 'Colocated' || self.refit.transport != 'Nccl'").message("spec.refit.transport: Nccl cannot serve Colocated mode (a trainer and a generation rank share each GPU); use CudaIpc or Auto"))]
#[x_kube(validation = Rule::new("self.device == 'Gpu' || (self.refit.transport != 'Nccl' && self.refit.transport != 'CudaIpc')").message("spec.refit.transport: Nccl and CudaIpc need GPUs; with device Cpu use Tcp or Auto"))]
#[x_kube(validation = Rule::new("self.mode != 'Split' || !has(self.generation.gpusPerNode) || self.generation.gpusPerNode < self.generation.tensorParallel || self.generation.engines % (self.generation.gpusPerNode / self.generation.tensorParallel) == 0").message("spec.generation.engines: in Split mode engines must fill whole generation pods (a multiple of gpusPerNode / tensorParallel)"))]
#[x_kube(validation = Rule::new("self.device == 'Gpu' || !has(self.gpus) || self.gpus.sharing != 'ResourceClaim'").message("spec.gpus.sharing: ResourceClaim shares the pods' GPUs, and device Cpu has none: set device Gpu, or leave spec.gpus out"))]
#[x_kube(validation = Rule::new("self.workload.promptsPerStep * self.workload.samplesPerPrompt >= self.trainer.parallelism.data").message("spec.workload: promptsPerStep × samplesPerPrompt must be at least trainer.parallelism.data, so that every data-parallel shard gets samples"))]
pub struct RLJobSpec {
    /// Where generation runs: `Colocated` (trainer and generation engines share the same GPUs and
    /// pods, refit through CUDA IPC) or `Split` (separate pods and GPUs, refit through NCCL).
    pub mode: Mode,
    /// What the ranks run on: `Gpu` (default; pods request GPUs) or `Cpu` (no GPUs; TCP transports;
    /// for laptops, CI and kind clusters).
    #[serde(default)]
    pub device: Device,
    /// The parameter manifest that refit moves: a preset or an explicit list of tensors.
    pub model: ModelSpec,
    /// The trainer: its pods, GPUs and parallel layout.
    pub trainer: TrainerSpec,
    /// The generation (inference) engines.
    pub generation: GenerationSpec,
    /// How new weights move from the trainer to the generation engines after each step.
    #[serde(default)]
    pub refit: RefitSpec,
    /// The transfer queue that carries rollouts from generation to the trainer.
    #[serde(default)]
    pub transfer_queue: TransferQueueSpec,
    /// The built-in synthetic GRPO workload the worker runs when no user containers are given.
    #[serde(default)]
    pub workload: WorkloadSpec,
    /// Restarts, deadlines, clean-up and suspension.
    #[serde(default)]
    pub run_policy: RunPolicy,
    /// Scheduler, priority, Kueue queue and gang scheduling.
    #[serde(default)]
    pub scheduling: SchedulingSpec,
    /// Metrics and traces.
    #[serde(default)]
    pub observability: ObservabilitySpec,
    /// Who may reach the job's pods: a NetworkPolicy admitting only the job's own pods (and
    /// Prometheus to the metrics port). On by default.
    #[serde(default)]
    pub network_policy: NetworkPolicySpec,
    /// How often the trainer checkpoints, so that a gang restart resumes after the last
    /// checkpoint instead of starting over. rlplane never writes the model itself: the user's
    /// trainer saves it where it chooses and reports where (`Trainer.checkpoint_saved`).
    #[serde(default, skip_serializing_if = "CheckpointSpec::is_off")]
    pub checkpoint: CheckpointSpec,
    /// How the worker sidecar and the user's containers share a pod's GPUs (device `Gpu` with
    /// user templates): through the device plugin (default) or one ResourceClaim (DRA).
    #[serde(default, skip_serializing_if = "GpuSpec::is_default")]
    pub gpus: GpuSpec,
    /// Whether generation waits for training: `Synchronous` (default; every step's rollouts come
    /// from the previous step's weights) or `Asynchronous` (engines generate the next steps while
    /// the trainer trains, from weights at most `maxPolicyLag` versions old).
    #[serde(default, skip_serializing_if = "ScheduleSpec::is_synchronous")]
    pub schedule: ScheduleSpec,
}

/// How generation and training overlap (`spec.schedule`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.policy == 'Asynchronous' || !has(self.maxPolicyLag) || self.maxPolicyLag == 0").message("spec.schedule.maxPolicyLag: only an Asynchronous schedule lets generation run ahead; set policy: Asynchronous, or leave maxPolicyLag out"))]
#[x_kube(validation = Rule::new("self.policy == 'Asynchronous' || !has(self.partialRollouts) || !self.partialRollouts").message("spec.schedule.partialRollouts: only an Asynchronous schedule has newer weights to take inside a step; set policy: Asynchronous, or leave partialRollouts out"))]
pub struct ScheduleSpec {
    /// `Synchronous` (default): generate, train, refit, each waiting for the last. `Asynchronous`:
    /// the engines generate the next steps' rollouts while the trainer trains, and take new
    /// weights between their own steps.
    #[serde(default)]
    pub policy: SchedulePolicy,
    /// The policy lag a trained sample may have (Asynchronous only; default 1): step `s` trains
    /// on rollouts generated with weights of version `s − 1 − lag` for a lag of at most this
    /// (version `s − 1` is the synchronous one). 0 behaves exactly like `Synchronous`. The
    /// transfer queue holds up to `maxPolicyLag + 1` steps of rollouts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 8))]
    pub max_policy_lag: Option<u32>,
    /// Asynchronous only: an engine registered staged may take newer weights in the middle of a
    /// step (partial rollouts: the rollouts under way continue with the new weights). Its
    /// samples then carry the first and the last version among their tokens (tags
    /// `policy_version` and `policy_version_last`); the lag bound applies to the first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub partial_rollouts: bool,
}

/// Whether generation waits for training.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum SchedulePolicy {
    /// Each step's generation waits for the previous step's refit.
    #[default]
    Synchronous,
    /// Generation runs ahead of training by at most `maxPolicyLag` versions.
    Asynchronous,
}

/// Largest `spec.schedule.maxPolicyLag`: the transfer queue holds that many steps of rollouts
/// beyond the one in training.
pub const MAX_POLICY_LAG: u32 = 8;

impl ScheduleSpec {
    /// Whether it is the default (left out of the serialized spec, so existing jobs' spec hashes
    /// do not change).
    pub fn is_synchronous(&self) -> bool {
        *self == ScheduleSpec::default()
    }

    /// The policy lag allowed: 0 when synchronous, `maxPolicyLag` (default 1) when asynchronous.
    pub fn max_lag(&self) -> u32 {
        match self.policy {
            SchedulePolicy::Synchronous => 0,
            SchedulePolicy::Asynchronous => self.max_policy_lag.unwrap_or(1),
        }
    }

    /// An asynchronous schedule with lag `k` (0: the synchronous one).
    pub fn asynchronous(k: u32) -> ScheduleSpec {
        ScheduleSpec { policy: SchedulePolicy::Asynchronous, max_policy_lag: Some(k), partial_rollouts: false }
    }
}

/// How a pod's GPUs reach its containers (`spec.gpus`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.sharing != 'ResourceClaim' || has(self.deviceClassName)").message("spec.gpus.deviceClassName: sharing ResourceClaim allocates the pod's GPUs from a DeviceClass; name it (e.g. gpu.nvidia.com)"))]
pub struct GpuSpec {
    /// `DevicePlugin` (default): the first user container requests `nvidia.com/gpu` (unless one
    /// does itself) and the worker sidecar sees the node's GPUs through
    /// `NVIDIA_VISIBLE_DEVICES=all` — the pod's GPUs only when the pod takes the whole node, so
    /// use it with gpusPerNode equal to the node's GPU count. `ResourceClaim`: every pod gets one
    /// ResourceClaim (Dynamic Resource Allocation) for its GPUs, and the worker and every user
    /// container use that claim, so all of them see exactly the same devices.
    #[serde(default)]
    pub sharing: GpuSharing,
    /// `ResourceClaim`: the DeviceClass the pod's GPUs are allocated from (e.g. `gpu.nvidia.com`,
    /// NVIDIA's DRA driver).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_class_name: Option<String>,
}

impl GpuSpec {
    /// Whether it is the default (left out of the serialized spec, so existing jobs' spec hashes
    /// do not change).
    pub fn is_default(&self) -> bool {
        *self == GpuSpec::default()
    }
}

/// How the worker and the user's containers share a pod's GPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum GpuSharing {
    /// The NVIDIA device plugin allocates the GPUs to one user container; the worker sees the
    /// node's GPUs by environment (whole-node pods).
    #[default]
    DevicePlugin,
    /// One ResourceClaim per pod, used by the worker and every user container.
    ResourceClaim,
}

/// The checkpoint cadence (`spec.checkpoint`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointSpec {
    /// Checkpoint after every this many steps (0, the default: never; every restart starts
    /// over). The client's `Trainer.checkpoint_due(step)` says when; the synthetic trainer
    /// checkpoints on its own.
    #[serde(default)]
    pub every_steps: u32,
}

impl CheckpointSpec {
    /// Whether checkpoints are off (the field is then left out of the serialized spec).
    pub fn is_off(&self) -> bool {
        self.every_steps == 0
    }

    /// Whether the trainer checkpoints after `step`.
    pub fn due(&self, step: u64) -> bool {
        self.every_steps > 0 && step > 0 && step.is_multiple_of(self.every_steps as u64)
    }
}

/// A checkpoint the trainer saved: the step whose weights it holds and where it is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointRef {
    /// The step it holds the trainer's state after (its weights are that version).
    pub step: u64,
    /// Where the trainer saved it (a path or URI the user's code chose; opaque to rlplane).
    pub uri: String,
}

impl RLJobSpec {
    /// The user templates whose containers run in a pod of `role`: the trainer's in trainer pods
    /// (with the generation's too in Colocated mode), the generation's in generation pods.
    pub fn user_templates(&self, role: PodRole) -> Vec<&UserTemplate> {
        match role {
            PodRole::Trainer => {
                let mut t: Vec<&UserTemplate> = self.trainer.template.iter().collect();
                if self.mode == Mode::Colocated {
                    t.extend(self.generation.template.iter());
                }
                t
            }
            PodRole::Generation => self.generation.template.iter().collect(),
            PodRole::Storage => Vec::new(),
        }
    }

    /// Environment rlplane adds to the containers of user template `t` for the client, beyond
    /// the pod's socket directory and name: in the generation template's, the engines'
    /// tensor-parallel size, with which a process finds an engine's rank sockets
    /// (`engine-<engine · tensorParallel + rank>.sock`).
    pub fn template_env(&self, t: &UserTemplate) -> Vec<(&'static str, String)> {
        match &self.generation.template {
            Some(g) if std::ptr::eq(g, t) => {
                vec![(ENGINE_TENSOR_PARALLEL_ENV, self.generation.tensor_parallel.to_string())]
            }
            _ => Vec::new(),
        }
    }
}

/// The environment variable holding `spec.generation.tensorParallel` in the generation
/// template's containers ([`RLJobSpec::template_env`]).
pub const ENGINE_TENSOR_PARALLEL_ENV: &str = "RLPLANE_ENGINE_TENSOR_PARALLEL";

/// Placement of generation relative to the trainer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Mode {
    /// Trainer and generation share GPUs and pods; weights move through CUDA IPC on the same GPU.
    Colocated,
    /// Trainer and generation on different GPUs and pods; weights move through NCCL broadcast.
    Split,
}

/// The kind of device ranks run on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Device {
    /// NVIDIA GPUs (pods request `nvidia.com/gpu`).
    #[default]
    Gpu,
    /// CPU only: no GPU requests, TCP transports.
    Cpu,
}

/// The model whose weights refit moves. Give exactly one of `preset` and `tensors`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.preset) != has(self.tensors)").message("spec.model: give exactly one of preset and tensors"))]
pub struct ModelSpec {
    /// A built-in manifest: `llama3-8b` (291 tensors, 16.06 GB bf16), `qwen3-0.6b` (1.19 GB) or
    /// `tiny` (1.3 MB, for tests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<ModelPreset>,
    /// An explicit manifest: tensors in the order refit sends them, names unique.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    #[x_kube(validation = Rule::new("self.all(t, t.shape.all(d, d >= 1))").message("spec.model.tensors: every dimension of every shape must be at least 1"))]
    pub tensors: Option<Vec<TensorSpec>>,
}

impl ModelSpec {
    /// A spec naming a preset.
    pub fn preset(p: ModelPreset) -> Self {
        ModelSpec { preset: Some(p), tensors: None }
    }

    /// The resolved manifest: the preset's tensors or the explicit list (empty if neither is set;
    /// [`crate::validate`] reports that).
    pub fn manifest(&self) -> Vec<TensorSpec> {
        match (&self.preset, &self.tensors) {
            (Some(p), _) => p.tensors(),
            (None, Some(t)) => t.clone(),
            (None, None) => Vec::new(),
        }
    }
}

/// The kind of pod a job runs (the plan lists them; the operator renders them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PodRole {
    /// Trainer pod (in Colocated mode it also runs generation; pod 0 also runs the coordinator).
    Trainer,
    /// Generation pod (Split mode).
    Generation,
    /// Dedicated transfer-queue storage pod.
    Storage,
}

impl PodRole {
    /// Name segment used in pod names and labels (`trainer`, `gen`, `tq`).
    pub fn short(self) -> &'static str {
        match self {
            PodRole::Trainer => "trainer",
            PodRole::Generation => "gen",
            PodRole::Storage => "tq",
        }
    }
}

/// Parallel layout of the trainer. The product must equal `nodes × gpusPerNode`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.fsdp) || self.data % self.fsdp == 0").message("spec.trainer.parallelism.fsdp: must divide data (each shard group is fsdp consecutive data-parallel ranks; data / fsdp groups replicate each other)"))]
pub struct Parallelism {
    /// Tensor-parallel size: ranks that split each layer.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub tensor: u32,
    /// Pipeline-parallel size: stages holding different layers.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub pipeline: u32,
    /// Context-parallel size: ranks that split each sequence (weights replicated).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub context: u32,
    /// Data-parallel size: model replicas, each fed its own share of the batch.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 4096))]
    pub data: u32,
    /// Fully-sharded data parallelism (FSDP2, ZeRO-3): how many consecutive data-parallel ranks
    /// shard each parameter between them along dimension 0, in `torch.chunk` pieces (rank *f* of a
    /// shard group holds rows `[f·⌈n/fsdp⌉, (f+1)·⌈n/fsdp⌉)` of its tensor-parallel shard). 1 (the
    /// default): every data-parallel rank holds its whole shard. `data` for FSDP, a divisor of it
    /// for hybrid sharding (HSDP: `data / fsdp` replicas). With `refit.source: Sharded` every rank
    /// of the first shard group sends its own rows, so no rank ever holds a gathered copy.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    #[schemars(range(min = 1, max = 4096))]
    pub fsdp: u32,
}

impl Default for Parallelism {
    fn default() -> Self {
        Parallelism { tensor: 1, pipeline: 1, context: 1, data: 1, fsdp: 1 }
    }
}

impl Parallelism {
    /// tensor × pipeline × context × data (saturating).
    pub fn product(&self) -> u64 {
        [self.tensor, self.pipeline, self.context, self.data].iter().fold(1u64, |a, &x| a.saturating_mul(x as u64))
    }
}

/// Pod-level overrides applied to every pod of a role.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodOverrides {
    /// Node labels the pods must match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations added to the pods (e.g. for GPU node taints).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Affinity rules for the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Extra environment variables for the worker container (e.g. `NCCL_DEBUG`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Extra volumes added to the pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
    /// Extra volume mounts added to the worker container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
    /// Annotations added to the pods.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Labels added to the pods (rlplane's own labels win on conflict).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// The trainer role.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.context * self.parallelism.data == self.nodes * self.gpusPerNode").message("spec.trainer.parallelism: tensor×pipeline×context×data must equal nodes×gpusPerNode"))]
pub struct TrainerSpec {
    /// Number of trainer pods (one per node).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 1024))]
    pub nodes: u32,
    /// GPUs (ranks) per trainer pod.
    #[schemars(range(min = 1, max = 16))]
    pub gpus_per_node: u32,
    /// Parallel layout; tensor × pipeline × context × data must equal nodes × gpusPerNode.
    #[serde(default)]
    pub parallelism: Parallelism,
    /// Image of the rlplane worker container; defaults to the operator's `--worker-image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Resources of the worker container. `nvidia.com/gpu` is set from gpusPerNode (device Gpu).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Pod overrides: nodeSelector, tolerations, affinity, env, volumes, volumeMounts, annotations, labels.
    #[serde(flatten)]
    pub pod: PodOverrides,
    /// The user's own trainer pod (e.g. PyTorch/Megatron containers). When set, the rlplane worker
    /// runs beside it as a native sidecar sharing IPC sockets, /dev/shm and the IPC namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::preserve_object")]
    pub template: Option<UserTemplate>,
}

/// The generation (inference) role.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.gpusPerNode) || self.gpusPerNode % self.tensorParallel == 0").message("spec.generation.gpusPerNode: must be a multiple of tensorParallel (an engine never spans pods)"))]
pub struct GenerationSpec {
    /// Number of inference engines.
    #[schemars(range(min = 1, max = 4096))]
    pub engines: u32,
    /// GPUs per engine (the engine's tensor-parallel size).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub tensor_parallel: u32,
    /// Split mode: GPUs per generation pod (defaults to tensorParallel, i.e. one engine per pod);
    /// a multiple of tensorParallel. Ignored in Colocated mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub gpus_per_node: Option<u32>,
    /// Image of the rlplane worker container; defaults to the operator's `--worker-image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Resources of the worker container. `nvidia.com/gpu` is set from the pod's GPUs (device Gpu).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Pod overrides: nodeSelector, tolerations, affinity, env, volumes, volumeMounts, annotations, labels.
    #[serde(flatten)]
    pub pod: PodOverrides,
    /// The user's own inference pod (e.g. vLLM/SGLang). When set, the rlplane worker runs beside it
    /// as a native sidecar. In Colocated mode its containers join the trainer's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::preserve_object")]
    pub template: Option<UserTemplate>,
}

impl GenerationSpec {
    /// GPUs per generation pod in Split mode.
    pub fn pod_gpus(&self) -> u32 {
        self.gpus_per_node.unwrap_or(self.tensor_parallel)
    }

    /// Total generation ranks (engines × tensorParallel, saturating).
    pub fn world(&self) -> u64 {
        (self.engines as u64).saturating_mul(self.tensor_parallel as u64)
    }
}

/// Transport for refit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum RefitTransport {
    /// Pick by measurement: CUDA IPC where every rank of a refit group shares a node, NCCL across
    /// nodes, TCP without GPUs.
    #[default]
    Auto,
    /// NCCL broadcast (GPUs).
    Nccl,
    /// CUDA IPC with copy-engine copies (GPUs on one node).
    CudaIpc,
    /// TCP streams relayed through the receivers (CPU; works everywhere).
    Tcp,
}

/// Where refit's bytes come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum RefitSource {
    /// Every trainer rank of data-parallel replica 0 sends its own shard straight to the receivers.
    #[default]
    Sharded,
    /// The shards are first gathered onto trainer rank 0, which sends everything (the usual
    /// design; kept for comparison).
    Gathered,
}

/// How a generation rank checks the weights of each refit against the trainer's (see
/// docs/refit.md, "Verification"). Whatever the policy, a refit that did not deliver every bucket
/// leaves the rank `Incomplete` and fails the step: an engine never runs on mixed weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum RefitVerify {
    /// Every byte: each receiver digests all it received and compares it with the digest the
    /// senders computed once for the version. Catches any wrong byte (a transport or copy fault,
    /// a wrong offset, stride or dtype, a tensor left out, a source written during the refit), at
    /// the cost of one read of the weights on every receiver.
    Full,
    /// A sample, fresh every version: each tensor segment's first and last 4 KiB block and a
    /// pseudo-random one in 16 of the others, drawn from the version, so no block stays unchecked
    /// for long. Catches every systematic fault (wrong offsets, strides, dtypes or plans, a
    /// missing or stale tensor, a truncated or shifted segment) and a localized corruption with
    /// the probability that one of its blocks is drawn; costs about a sixteenth of `Full`.
    #[default]
    Sampled,
    /// No digest. Versions and bucket accounting still refuse incomplete refits.
    Off,
}

/// Refit settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.bufferBytes) && has(self.bufferMemoryFraction))").message("spec.refit: set bufferBytes or bufferMemoryFraction, not both"))]
#[x_kube(validation = Rule::new("!has(self.bufferBytes) || self.alignBytes <= self.bufferBytes").message("spec.refit.alignBytes: must not exceed bufferBytes"))]
pub struct RefitSpec {
    /// Bytes per staging buffer (bucket). Default 1 GiB when neither this nor
    /// bufferMemoryFraction is set. Tensors larger than a bucket are split across buckets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 4096))]
    pub buffer_bytes: Option<u64>,
    /// Alternative to bufferBytes: all staging buffers together take this fraction of the sending
    /// rank's device memory (resolved by the refit root and announced at the handshake).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0001, max = 0.5))]
    pub buffer_memory_fraction: Option<f64>,
    /// Buffers in flight, so that packing, transfer and unpacking overlap.
    #[serde(default = "default_num_buffers")]
    #[schemars(range(min = 1, max = 8))]
    pub num_buffers: u32,
    /// Alignment of every tensor's offset inside a bucket; a power of two.
    #[serde(default = "default_align_bytes")]
    #[schemars(range(min = 1, max = 1048576))]
    #[x_kube(validation = Rule::new("self in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576]").message("spec.refit.alignBytes: must be a power of two (e.g. 256)"))]
    pub align_bytes: u64,
    /// Transport: Auto, Nccl, CudaIpc or Tcp.
    #[serde(default)]
    pub transport: RefitTransport,
    /// Where the bytes leave from: Sharded (every trainer shard sends) or Gathered.
    #[serde(default)]
    pub source: RefitSource,
    /// Every wait in a refit (connect, handshake, a bucket) fails after this many seconds.
    #[serde(default = "default_refit_timeout")]
    #[schemars(range(min = 1, max = 86400))]
    pub timeout_seconds: u32,
    /// How receivers check each refit: Full, Sampled (default) or Off.
    #[serde(default)]
    pub verify: RefitVerify,
}

/// Default bucket size: 1 GiB.
pub const DEFAULT_BUFFER_BYTES: u64 = 1 << 30;

impl Default for RefitSpec {
    fn default() -> Self {
        RefitSpec {
            buffer_bytes: None,
            buffer_memory_fraction: None,
            num_buffers: default_num_buffers(),
            align_bytes: default_align_bytes(),
            transport: RefitTransport::Auto,
            source: RefitSource::Sharded,
            timeout_seconds: default_refit_timeout(),
            verify: RefitVerify::Sampled,
        }
    }
}

/// Where the transfer queue's storage units run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum TqPlacement {
    /// Each generation engine's leader keeps its own rollouts; consumers fetch from it directly
    /// (one hop: producer memory → consumer).
    #[default]
    ProducerLocal,
    /// `storageUnits` dedicated pods; keys hashed across them (two hops).
    Dedicated,
}

/// How the trainer fetches a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum TqFetch {
    /// Only each data-parallel shard's leader (tp = cp = pp = 0) fetches and fans out to its followers.
    #[default]
    LeaderBroadcast,
    /// Every trainer rank fetches its shard's batch itself (for comparison).
    Independent,
}

/// Transfer-queue settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TransferQueueSpec {
    /// ProducerLocal (default) or Dedicated storage pods.
    #[serde(default)]
    pub placement: TqPlacement,
    /// Number of dedicated storage pods (placement Dedicated).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 256))]
    pub storage_units: u32,
    /// Memory each storage unit may hold; a put beyond it waits (backpressure), then fails.
    #[serde(default = "default_tq_capacity")]
    #[schemars(range(min = 1048576))]
    pub capacity_bytes: u64,
    /// LeaderBroadcast (default) or Independent.
    #[serde(default)]
    pub fetch: TqFetch,
    /// A claim not acknowledged within this many seconds can be claimed again.
    #[serde(default = "default_lease_seconds")]
    #[schemars(range(min = 1, max = 86400))]
    pub lease_seconds: u32,
    /// A put blocked by a full storage unit fails after this many seconds.
    #[serde(default = "default_put_timeout")]
    #[schemars(range(min = 1, max = 86400))]
    pub put_timeout_seconds: u32,
}

impl Default for TransferQueueSpec {
    fn default() -> Self {
        TransferQueueSpec {
            placement: TqPlacement::ProducerLocal,
            storage_units: 1,
            capacity_bytes: default_tq_capacity(),
            fetch: TqFetch::LeaderBroadcast,
            lease_seconds: default_lease_seconds(),
            put_timeout_seconds: default_put_timeout(),
        }
    }
}

/// Inclusive range of response lengths in tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("self.min <= self.max").message("spec.workload.responseTokens: min must not exceed max"))]
pub struct TokenRange {
    /// Shortest response, in tokens.
    #[schemars(range(min = 1, max = 1048576))]
    pub min: u32,
    /// Longest response, in tokens.
    #[schemars(range(min = 1, max = 1048576))]
    pub max: u32,
}

/// The built-in synthetic GRPO workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadSpec {
    /// RL steps to run; the job succeeds after the last one.
    #[serde(default = "default_steps")]
    #[schemars(range(min = 1, max = 1000000))]
    pub steps: u32,
    /// Prompts per step.
    #[serde(default = "default_prompts")]
    #[schemars(range(min = 1, max = 1000000))]
    pub prompts_per_step: u32,
    /// Responses sampled per prompt (the GRPO group size).
    #[serde(default = "default_samples")]
    #[schemars(range(min = 1, max = 1024))]
    pub samples_per_prompt: u32,
    /// Prompt length in tokens.
    #[serde(default = "default_prompt_tokens")]
    #[schemars(range(min = 1, max = 1048576))]
    pub prompt_tokens: u32,
    /// Response lengths, drawn uniformly from this range (seeded).
    #[serde(default = "default_response_tokens")]
    pub response_tokens: TokenRange,
    /// Seed of every random choice of the workload.
    #[serde(default)]
    pub seed: u64,
    /// Simulated decoding time of each engine's rollouts of a step, milliseconds, drawn uniformly
    /// from this range (seeded by step and engine): a stand-in for an inference engine's work, so
    /// that schedules (`spec.schedule`) can be compared on CPUs. Default: none.
    #[serde(default, skip_serializing_if = "MillisRange::is_zero")]
    pub generate_millis: MillisRange,
    /// Simulated forward and backward time of each trainer rank's step, milliseconds, drawn
    /// uniformly from this range (seeded by step and rank). Default: none.
    #[serde(default, skip_serializing_if = "MillisRange::is_zero")]
    pub train_millis: MillisRange,
}

/// Inclusive range of simulated work in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("self.min <= self.max").message("spec.workload: a millisecond range's min must not exceed its max; swap them"))]
pub struct MillisRange {
    /// Least, in milliseconds.
    #[schemars(range(max = 3600000))]
    pub min: u32,
    /// Most, in milliseconds.
    #[schemars(range(max = 3600000))]
    pub max: u32,
}

impl MillisRange {
    /// Whether no work is simulated (left out of the serialized spec).
    pub fn is_zero(&self) -> bool {
        self.max == 0
    }

    /// The duration a uniform draw `r` (any u64) picks from the range.
    pub fn pick(&self, r: u64) -> std::time::Duration {
        let span = u64::from(self.max.saturating_sub(self.min)) + 1;
        std::time::Duration::from_millis(u64::from(self.min) + r % span)
    }
}

impl Default for WorkloadSpec {
    fn default() -> Self {
        WorkloadSpec {
            steps: default_steps(),
            prompts_per_step: default_prompts(),
            samples_per_prompt: default_samples(),
            prompt_tokens: default_prompt_tokens(),
            response_tokens: default_response_tokens(),
            seed: 0,
            generate_millis: MillisRange::default(),
            train_millis: MillisRange::default(),
        }
    }
}

impl WorkloadSpec {
    /// Samples produced per step.
    pub fn samples_per_step(&self) -> u64 {
        self.prompts_per_step as u64 * self.samples_per_prompt as u64
    }
}

/// Restarts, deadlines, clean-up and suspension.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunPolicy {
    /// Whole-gang restarts allowed before the job fails.
    #[serde(default = "default_backoff_limit")]
    #[schemars(range(max = 1000))]
    pub backoff_limit: u32,
    /// The job fails with DeadlineExceeded after running this long (counted from its start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: Option<u64>,
    /// A finished job (Succeeded or Failed) is deleted this many seconds after it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds_after_finished: Option<u64>,
    /// true deletes the pods and keeps the job (Suspended); false (re)creates them.
    #[serde(default)]
    pub suspend: bool,
    /// Seconds a pod of the job gets between SIGTERM and SIGKILL when it is deleted (a gang
    /// restart, suspend, the end). The worker stops its ranks within 10 s of SIGTERM in every
    /// phase, so the default 15 keeps a gang restart short (Kubernetes' own default is 30). Takes
    /// effect for pods created after a change.
    #[serde(default = "default_termination_grace")]
    #[schemars(range(max = 3600))]
    pub termination_grace_period_seconds: u32,
    /// Which pod failures count against `backoffLimit`: disruptions (eviction, preemption, a node
    /// drain: the pod's `DisruptionTarget` condition) have a limit of their own by default, and
    /// rules may restart without counting, count, or fail the job at once.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
}

impl Default for RunPolicy {
    fn default() -> Self {
        RunPolicy {
            backoff_limit: default_backoff_limit(),
            active_deadline_seconds: None,
            ttl_seconds_after_finished: None,
            suspend: false,
            termination_grace_period_seconds: default_termination_grace(),
            failure_policy: FailurePolicy::default(),
        }
    }
}

/// How a failed pod is judged: the first rule that matches the gang's first failure decides;
/// without a match, a disruption counts against `disruptionLimit` and any other failure against
/// `backoffLimit`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailurePolicy {
    /// Gang restarts caused by disruptions (the pod's `DisruptionTarget` condition, or phase
    /// Failed with reason Evicted) allowed before the job fails; they do not count against
    /// `backoffLimit`.
    #[serde(default = "default_disruption_limit")]
    #[schemars(range(max = 10000))]
    pub disruption_limit: u32,
    /// Rules, checked in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    pub rules: Vec<FailureRule>,
}

impl Default for FailurePolicy {
    fn default() -> Self {
        FailurePolicy { disruption_limit: default_disruption_limit(), rules: Vec::new() }
    }
}

/// What a matching rule does with the failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum FailureAction {
    /// Restart the gang without counting the restart anywhere.
    Ignore,
    /// Restart the gang and count it against `backoffLimit` (a disruption too).
    Count,
    /// Fail the job at once (reason FailurePolicy), without a restart.
    FailJob,
}

/// One rule: an action, and exactly one of `onExitCodes` and `onPodConditions`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.onExitCodes) != has(self.onPodConditions)").message("spec.runPolicy.failurePolicy.rules: give each rule exactly one of onExitCodes and onPodConditions"))]
pub struct FailureRule {
    /// What to do when the rule matches.
    pub action: FailureAction,
    /// Matches a container that terminated with one of (or none of) these non-zero exit codes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_exit_codes: Option<ExitCodesMatcher>,
    /// Matches a pod with any of these conditions True (e.g. `DisruptionTarget`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 20))]
    pub on_pod_conditions: Option<Vec<PodConditionMatcher>>,
}

/// Exit codes of a failed container (a container that exited 0 never matches).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.operator != 'In' || !self.values.exists(v, v == 0)").message("spec.runPolicy.failurePolicy.rules[].onExitCodes.values: 0 is no failure and cannot be matched with In"))]
pub struct ExitCodesMatcher {
    /// Only this container's exit code (by default any container of the pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_name: Option<String>,
    /// `In`: the code is one of `values`; `NotIn`: it is none of them.
    pub operator: ExitCodeOperator,
    /// The exit codes.
    #[schemars(length(min = 1, max = 255))]
    pub values: Vec<i32>,
}

/// How `values` are matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ExitCodeOperator {
    /// The exit code is one of the values.
    In,
    /// The exit code is none of the values.
    NotIn,
}

/// A pod condition type that must be True.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PodConditionMatcher {
    /// The condition type, e.g. `DisruptionTarget`.
    #[serde(rename = "type")]
    #[schemars(length(min = 1, max = 316))]
    pub type_: String,
}

/// Gang scheduling integration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum GangScheduler {
    /// No PodGroup.
    #[default]
    None,
    /// Volcano PodGroup (`scheduling.volcano.sh/v1beta1`), schedulerName `volcano`.
    Volcano,
    /// scheduler-plugins coscheduling PodGroup (`scheduling.x-k8s.io/v1alpha1`),
    /// schedulerName `scheduler-plugins-scheduler`.
    Coscheduling,
}

/// Scheduling settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchedulingSpec {
    /// Scheduler for the pods (overrides the gang scheduler's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub scheduler_name: Option<String>,
    /// PriorityClass of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub priority_class_name: Option<String>,
    /// Kueue LocalQueue: the job's pods form one Kueue pod group, held behind Kueue's scheduling
    /// gate until it admits the whole gang (docs/operator.md, "Kueue").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub queue_name: Option<String>,
    /// Gang scheduling: None, Volcano or Coscheduling (a PodGroup with minMember = all pods).
    #[serde(default)]
    pub gang: GangScheduler,
}

/// Metrics and traces.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.metricsPort < 7000 || self.metricsPort > 7999").message("spec.observability.metricsPort: 7000-7999 is used by the worker for refit and the transfer queue; pick another port (default 9400)"))]
#[x_kube(validation = Rule::new("!has(self.otlpEndpoint) || self.otlpEndpoint.startsWith('http://') || self.otlpEndpoint.startsWith('https://')").message("spec.observability.otlpEndpoint: must be an http:// or https:// URL (e.g. http://otel-collector:4317)"))]
pub struct ObservabilitySpec {
    /// Port of every worker's Prometheus `/metrics` (also `/healthz`, `/readyz`).
    #[serde(default = "default_metrics_port")]
    #[schemars(range(min = 1024, max = 65535))]
    pub metrics_port: u16,
    /// OTLP gRPC endpoint for traces (e.g. `http://otel-collector:4317`); traces are off when unset
    /// and OTEL_EXPORTER_OTLP_ENDPOINT is not set either.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
}

impl Default for ObservabilitySpec {
    fn default() -> Self {
        ObservabilitySpec { metrics_port: default_metrics_port(), otlp_endpoint: None }
    }
}

/// The job's NetworkPolicy `<job>-ingress`: ingress to the job's pods only from the job's own
/// pods (every port) and from the metrics scrapers (the metrics port). It needs a network plugin
/// that enforces NetworkPolicies; the job's handshakes are authenticated either way.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    /// Create the NetworkPolicy (default true). Set false where another policy governs the
    /// namespace.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Labels of the pods allowed to scrape the metrics port (default `app.kubernetes.io/name:
    /// prometheus`, what prometheus-operator puts on Prometheus pods).
    #[serde(default = "default_metrics_scraper_labels")]
    pub metrics_scraper_labels: BTreeMap<String, String>,
    /// Labels of the namespaces those scrapers may run in (default: none given, every namespace).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics_scraper_namespace_labels: BTreeMap<String, String>,
}

impl Default for NetworkPolicySpec {
    fn default() -> Self {
        NetworkPolicySpec {
            enabled: true,
            metrics_scraper_labels: default_metrics_scraper_labels(),
            metrics_scraper_namespace_labels: BTreeMap::new(),
        }
    }
}

fn default_true() -> bool {
    true
}

fn default_metrics_scraper_labels() -> BTreeMap<String, String> {
    BTreeMap::from([("app.kubernetes.io/name".into(), "prometheus".into())])
}

/// Lifecycle phase of an RLJob.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    /// Accepted; pods not created yet.
    #[default]
    Pending,
    /// Pods created, not all ready.
    Starting,
    /// Every pod ready; steps running.
    Running,
    /// A pod failed; the whole gang is being restarted with a new epoch.
    Restarting,
    /// Suspended: pods deleted, job kept.
    Suspended,
    /// The coordinator finished every step.
    Succeeded,
    /// Failed: invalid spec, backoff exhausted or deadline exceeded (see conditions).
    Failed,
}

impl Phase {
    /// Succeeded or Failed.
    pub fn is_finished(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }

    /// The phase's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "Pending",
            Phase::Starting => "Starting",
            Phase::Running => "Running",
            Phase::Restarting => "Restarting",
            Phase::Suspended => "Suspended",
            Phase::Succeeded => "Succeeded",
            Phase::Failed => "Failed",
        }
    }

    /// Every phase, for metrics.
    pub const ALL: [Phase; 7] = [
        Phase::Pending,
        Phase::Starting,
        Phase::Running,
        Phase::Restarting,
        Phase::Suspended,
        Phase::Succeeded,
        Phase::Failed,
    ];
}

/// Ready and total pods of one role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RoleCounts {
    /// Pods ready.
    pub ready: u32,
    /// Pods desired.
    pub total: u32,
}

/// Per-role pod counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoleStatus {
    /// Trainer pods (in Colocated mode they also run generation).
    pub trainer: RoleCounts,
    /// Generation pods (Split mode).
    pub generation: RoleCounts,
    /// Dedicated transfer-queue storage pods.
    pub storage: RoleCounts,
}

/// The last refit the coordinator reported.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastRefit {
    /// Weight version (the step) every generation rank now holds.
    pub version: u64,
    /// Seconds the refit took.
    pub seconds: f64,
    /// Bytes delivered to each receiver.
    pub bytes: u64,
    /// `v<version> <seconds>s`, for the printer column.
    #[serde(default)]
    pub summary: String,
}

/// What a wait of the coordinator's that has lasted 5 s or longer is waiting for (written by the
/// coordinator; gone once the wait ends). A job whose ranks never arrive shows this long before
/// any timeout turns it into a gang restart.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Stall {
    /// The waiting phase: `connecting`, `set-up`, or the step and the commands awaited (`step 3: train`, …).
    pub phase: String,
    /// The ranks (process names) it waits for.
    #[serde(default)]
    pub waiting_for: Vec<String>,
    /// Seconds waited so far (as of the last report; reports come every 5 s).
    pub seconds: u64,
    /// `<phase>: waiting <seconds>s for <ranks>`.
    #[serde(default)]
    pub message: String,
}

/// Observed state of an RLJob.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RLJobStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: Phase,
    /// Conditions: PodsCreated, PodsReady, Running, Restarting, Suspended, Succeeded, Failed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Whole-gang restarts so far (every kind, counted or not).
    #[serde(default)]
    pub restarts: u32,
    /// Gang restarts counted against `runPolicy.backoffLimit` (failures no rule exempted).
    #[serde(default)]
    pub counted_restarts: u32,
    /// Gang restarts caused by disruptions and counted against `failurePolicy.disruptionLimit`.
    #[serde(default)]
    pub disruptions: u32,
    /// Current epoch: 0 at the first start, +1 at every gang restart. Rendezvous tokens derive from it.
    #[serde(default)]
    pub epoch: u32,
    /// Ready and total pods per role.
    #[serde(default)]
    pub roles: RoleStatus,
    /// When the pods of the current run were first created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When the job finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Last step the coordinator finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// The last refit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_refit: Option<LastRefit>,
    /// What the coordinator is stuck waiting for, while a wait has lasted 5 s or longer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall: Option<Stall>,
    /// The newest checkpoint the trainer reported (written by the coordinator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointRef>,
    /// The scalars (reward, KL, lengths…) of the last step that reported any, as the trainer's
    /// and engines' processes report them (written by the coordinator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scalars: Option<StepScalars>,
    /// The checkpoint the current epoch resumed from: the operator sets it at a gang restart
    /// from `checkpoint`; the new epoch's steps start after its step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<CheckpointRef>,
}

impl RLJobStatus {
    /// The status without the fields the coordinator owns under its own field manager
    /// (`step`, `lastRefit`, `stall`, `checkpoint`, `scalars`): the part the operator writes and
    /// compares. An operator apply that carried one of them would co-own it, and the
    /// coordinator's next apply of it would conflict.
    pub fn operator_part(&self) -> RLJobStatus {
        RLJobStatus { step: None, last_refit: None, stall: None, checkpoint: None, scalars: None, ..self.clone() }
    }
}

/// A step's scalars in the status.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StepScalars {
    /// The step they belong to.
    pub step: u64,
    /// Name → value: for each name, the mean over the ranks that reported it.
    pub values: BTreeMap<String, f64>,
}

fn one() -> u32 {
    1
}
fn is_one(v: &u32) -> bool {
    *v == 1
}
fn default_num_buffers() -> u32 {
    2
}
fn default_align_bytes() -> u64 {
    256
}
fn default_refit_timeout() -> u32 {
    120
}
fn default_tq_capacity() -> u64 {
    4 << 30
}
fn default_lease_seconds() -> u32 {
    60
}
fn default_put_timeout() -> u32 {
    60
}
fn default_steps() -> u32 {
    3
}
fn default_prompts() -> u32 {
    8
}
fn default_samples() -> u32 {
    4
}
fn default_prompt_tokens() -> u32 {
    128
}
fn default_response_tokens() -> TokenRange {
    TokenRange { min: 64, max: 512 }
}
fn default_backoff_limit() -> u32 {
    3
}
fn default_disruption_limit() -> u32 {
    10
}
fn default_termination_grace() -> u32 {
    15
}
fn default_metrics_port() -> u16 {
    9400
}

impl RefitSpec {
    /// Bucket size when given in bytes (or the 1 GiB default); `None` when a memory fraction is
    /// set and the size is resolved on the device.
    pub fn fixed_buffer_bytes(&self) -> Option<u64> {
        match (self.buffer_bytes, self.buffer_memory_fraction) {
            (Some(b), _) => Some(b),
            (None, Some(_)) => None,
            (None, None) => Some(DEFAULT_BUFFER_BYTES),
        }
    }
}

impl ModelSpec {
    /// Explicit manifest builder, for tests and benches.
    pub fn tensors(tensors: Vec<TensorSpec>) -> Self {
        ModelSpec { preset: None, tensors: Some(tensors) }
    }
}

/// A user's pod template, kept as given so that one malformed template cannot stop the operator
/// from reading every other RLJob; [`crate::validate`] reports what is wrong with it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UserTemplate(pub serde_json::Value);

impl UserTemplate {
    /// The template as a typed `PodTemplateSpec`, or what is wrong with it.
    pub fn pod_template(&self) -> Result<PodTemplateSpec, String> {
        let t: PodTemplateSpec = serde_json::from_value(self.0.clone()).map_err(|e| e.to_string())?;
        match t.spec.as_ref() {
            Some(spec) if !spec.containers.is_empty() => Ok(t),
            _ => Err("the template needs spec.containers with at least one container".into()),
        }
    }
}

impl From<PodTemplateSpec> for UserTemplate {
    fn from(t: PodTemplateSpec) -> Self {
        UserTemplate(serde_json::to_value(t).unwrap_or_default())
    }
}
