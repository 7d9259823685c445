//! The operator→worker wiring contract.
//!
//! A [`WorkerPlan`] is everything the workers of one job epoch need: identity, token and where the
//! epoch's key is mounted (never the key itself: the plan is a ConfigMap anyone who can read the
//! job's objects may see), the world
//! layout, every pod and process with its coordinates and addresses, the refit and fan-out groups
//! with their rendezvous, the transfer-queue endpoints, and the settings. The operator stores it as
//! `plan.json` in the job's ConfigMap; every pod runs `rlplane worker --plan /etc/rlplane/plan.json`
//! and picks its own pod by name (`RLPLANE_POD`, from the downward API). One document per job keeps
//! the ConfigMap O(ranks) in size, where a copy per pod would be O(ranks × pods) and outgrow the
//! 1 MiB ConfigMap limit at a few dozen pods.
//!
//! The plan is built by pure code ([`crate::topology::build_plan`]) that the operator and the local
//! runner share; only the [`crate::topology::Addressing`] differs (pod DNS names vs loopback).

use serde::{Deserialize, Serialize};

pub use crate::spec::PodRole;
use crate::spec::{Device, Mode, ModelSpec, ObservabilitySpec, RefitSpec, TransferQueueSpec, WorkloadSpec};

/// Version of the plan format. A worker refuses a plan of any other version. Version 2 added
/// [`JobRef::key_file`] (and with it the authenticated handshake), so a worker of version 1 and
/// one of version 2 cannot be mixed in one job.
pub const PLAN_FORMAT_VERSION: u32 = 3;

/// Fixed ports inside a pod (cluster mode). Per-process services add the process's local index.
pub mod ports {
    /// Coordinator control channel (ranks connect to it).
    pub const CONTROL: u16 = 7000;
    /// Transfer-queue controller (metadata), in the coordinator.
    pub const TQ_CONTROLLER: u16 = 7001;
    /// Transfer-queue storage units: base + slot.
    pub const STORAGE_BASE: u16 = 7100;
    /// Refit: a sender's rendezvous (NCCL id, TCP root) or a receiver's relay listener: base + local index.
    pub const REFIT_BASE: u16 = 7200;
    /// Fan-out from a data-parallel leader to its followers: base + local index.
    pub const FANOUT_BASE: u16 = 7300;
}

/// Job identity and the epoch's token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobRef {
    /// RLJob name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// RLJob uid.
    pub uid: String,
    /// Epoch: +1 at every gang restart.
    pub epoch: u32,
    /// Token stamped on every handshake (refit, transfer queue, control): a rank of another epoch
    /// or job presents another token and is refused. Derived from uid and epoch: an identifier,
    /// not a secret.
    pub token: String,
    /// Path of the file holding the epoch's key (see [`parse_job_key`]), which every handshake
    /// proves possession of. In a cluster it is the Secret [`job_key_secret_name`] mounted at
    /// [`POD_KEY_FILE`]; `rlplane local` writes a fresh random key into its scratch directory.
    pub key_file: String,
}

/// One pod of the job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodEntry {
    /// Pod name: `<job>-trainer-<i>`, `<job>-gen-<i>` or `<job>-tq-<i>`.
    pub name: String,
    /// Role.
    pub role: PodRole,
    /// Index within its role.
    pub index: u32,
    /// GPUs the pod requests (0 for storage pods and device Cpu).
    pub gpus: u32,
    /// Host other pods reach it at (`<pod>.<job>-headless.<ns>.svc`, or 127.0.0.1 locally).
    pub host: String,
    /// Host its listeners bind (0.0.0.0 in a cluster, 127.0.0.1 locally).
    pub bind_host: String,
    /// Directory of its ipc:// (Unix) sockets (the shared emptyDir).
    pub ipc_dir: String,
    /// Its sockets and shared-memory files are for the worker's user only (`rlplane local`, where
    /// every process runs as one user). False in a cluster, where a user's container may run as
    /// another uid, so they are made readable and writable for every user of the pod.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub private_ipc: bool,
}

/// Coordinates of a trainer rank. Global rank order: tp fastest, then cp, dp, pp slowest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TrainerCoords {
    /// Global trainer rank.
    pub rank: u32,
    /// Tensor-parallel index.
    pub tp: u32,
    /// Pipeline stage.
    pub pp: u32,
    /// Context-parallel index.
    pub cp: u32,
    /// Data-parallel shard.
    pub dp: u32,
    /// tp = cp = pp = 0: this rank fetches its shard's batch and fans it out.
    pub leader: bool,
}

/// Coordinates of a generation rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GenerationCoords {
    /// Global generation rank.
    pub rank: u32,
    /// Engine index.
    pub engine: u32,
    /// Rank within the engine (its tensor-parallel index).
    pub engine_rank: u32,
    /// engine_rank = 0: this rank produces the engine's rollouts and hosts its storage unit
    /// (placement ProducerLocal).
    pub producer: bool,
}

/// What a process does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ProcessRole {
    /// The step coordinator and transfer-queue controller.
    Coordinator,
    /// A trainer rank.
    Trainer(TrainerCoords),
    /// A generation rank.
    Generation(GenerationCoords),
    /// A dedicated storage unit.
    Storage {
        /// Storage unit id.
        unit: u32,
    },
}

impl ProcessRole {
    /// Short role name for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            ProcessRole::Coordinator => "coordinator",
            ProcessRole::Trainer(_) => "trainer",
            ProcessRole::Generation(_) => "generation",
            ProcessRole::Storage { .. } => "storage",
        }
    }
}

/// Ports a process listens on (the host comes from its pod).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessPorts {
    /// Coordinator control channel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<u16>,
    /// Transfer-queue controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tq_controller: Option<u16>,
    /// Refit rendezvous (sender) or relay listener (receiver).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refit: Option<u16>,
    /// Fan-out rendezvous (data-parallel leader).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fanout: Option<u16>,
    /// Storage unit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<u16>,
}

/// One process (rank) of the job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessEntry {
    /// Unique name: `coordinator`, `trainer-<rank>`, `gen-<rank>`, `tq-<unit>`.
    pub name: String,
    /// Index of its pod in [`WorkerPlan::pods`].
    pub pod: u32,
    /// Index among its pod's processes (port offsets derive from it).
    pub local: u32,
    /// Local GPU index (None on device Cpu and for CPU-only roles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<u32>,
    /// Role and coordinates.
    pub role: ProcessRole,
    /// Listening ports.
    #[serde(default)]
    pub ports: ProcessPorts,
    /// Colocated refit: the `ipc://` (Unix socket) endpoint this trainer rank binds for its GPU, which the
    /// generation rank on the same GPU connects to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipc: Option<String>,
}

/// A refit group: senders (trainer shards) and every generation rank that needs their bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RefitGroup {
    /// Group name (`refit`, or `refit-pod<i>` for colocated per-pod groups).
    pub name: String,
    /// Sending processes (indices into [`WorkerPlan::processes`]); each is the root of its own
    /// broadcast and publishes its rendezvous (NCCL unique id) on its refit port.
    pub senders: Vec<u32>,
    /// Receiving processes, in relay order.
    pub receivers: Vec<u32>,
    /// Every member shares one node (one pod), so CUDA IPC can serve it.
    pub same_node: bool,
    /// What carries the group's buckets: `spec.refit.transport`, with `Auto` resolved once, by
    /// the plan builder ([`crate::topology::group_transport`]); every rank only reads it.
    pub transport: GroupTransport,
}

/// A refit group's resolved transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupTransport {
    /// TCP relay, host memory.
    Tcp,
    /// NCCL broadcast, GPU memory.
    Nccl,
    /// CUDA IPC, GPU memory of one node.
    CudaIpc,
}

impl GroupTransport {
    /// Its name in logs, metrics labels and summaries (`tcp`, `nccl`, `cuda_ipc`).
    pub fn name(self) -> &'static str {
        match self {
            GroupTransport::Tcp => "tcp",
            GroupTransport::Nccl => "nccl",
            GroupTransport::CudaIpc => "cuda_ipc",
        }
    }
}

/// A data-parallel shard's fan-out group: its leader and followers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FanoutGroup {
    /// Data-parallel shard.
    pub dp: u32,
    /// The leader (tp = cp = pp = 0), root of the group.
    pub leader: u32,
    /// Every member, leader first, in rank order.
    pub members: Vec<u32>,
}

/// A transfer-queue storage unit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StorageUnitEntry {
    /// Unit id.
    pub id: u32,
    /// The process hosting it (an engine's producer, or a dedicated storage process).
    pub process: u32,
}

/// World layouts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Layout {
    /// Trainer tensor-parallel size.
    pub tp: u32,
    /// Trainer pipeline-parallel size.
    pub pp: u32,
    /// Trainer context-parallel size.
    pub cp: u32,
    /// Trainer data-parallel size.
    pub dp: u32,
    /// Data-parallel ranks that shard each parameter between them (`parallelism.fsdp`; 1: none).
    #[serde(default = "fsdp_default")]
    pub fsdp: u32,
    /// Trainer ranks.
    pub trainer_world: u32,
    /// Trainer GPUs per pod.
    pub trainer_gpus_per_pod: u32,
    /// Generation engines.
    pub engines: u32,
    /// GPUs per engine.
    pub engine_tp: u32,
    /// Generation ranks.
    pub generation_world: u32,
}

/// Everything the workers of one job epoch need. See the module docs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerPlan {
    /// Must equal [`PLAN_FORMAT_VERSION`].
    pub format_version: u32,
    /// Job identity, epoch and token.
    pub job: JobRef,
    /// Colocated or Split.
    pub mode: Mode,
    /// Gpu or Cpu.
    pub device: Device,
    /// World layouts.
    pub layout: Layout,
    /// Every pod.
    pub pods: Vec<PodEntry>,
    /// Every process, in a fixed order.
    pub processes: Vec<ProcessEntry>,
    /// The coordinator process.
    pub coordinator: u32,
    /// Refit groups.
    pub refit_groups: Vec<RefitGroup>,
    /// Fan-out groups, one per data-parallel shard.
    pub fanout_groups: Vec<FanoutGroup>,
    /// Storage units.
    pub storage_units: Vec<StorageUnitEntry>,
    /// The model manifest (preset name or explicit tensors).
    pub model: ModelSpec,
    /// Refit settings.
    pub refit: RefitSpec,
    /// Transfer-queue settings.
    pub transfer_queue: TransferQueueSpec,
    /// Synthetic workload.
    pub workload: WorkloadSpec,
    /// Metrics and traces.
    pub observability: ObservabilitySpec,
    /// Which roles run the user's own processes (`trainer.template`, `generation.template`): their
    /// ranks serve the sidecar's local API (docs/local-api.md) instead of synthetic work.
    #[serde(default, skip_serializing_if = "UserProcesses::is_none")]
    pub user_processes: UserProcesses,
    /// The checkpoint cadence (`spec.checkpoint`).
    #[serde(default, skip_serializing_if = "crate::spec::CheckpointSpec::is_off")]
    pub checkpoint: crate::spec::CheckpointSpec,
    /// Whether generation runs ahead of training, and by how many versions (`spec.schedule`):
    /// the coordinator schedules by it, and every trainer rank refuses a sample older than it.
    #[serde(default, skip_serializing_if = "crate::spec::ScheduleSpec::is_synchronous")]
    pub schedule: crate::spec::ScheduleSpec,
    /// The checkpoint this epoch resumes from (`status.resumedFrom` when the operator built the
    /// plan): the initial weights are that step's version, and the steps start after it. None:
    /// the run starts at step 1 from version 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<crate::spec::CheckpointRef>,
}

/// Which roles' work the user's own processes do, through the sidecar's local API.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UserProcesses {
    /// Trainer ranks: the user's trainer registers its weights, publishes them and gets batches.
    #[serde(default)]
    pub trainer: bool,
    /// Generation ranks: the user's engine registers its weights and puts rollouts.
    #[serde(default)]
    pub generation: bool,
}

impl UserProcesses {
    /// Neither role.
    pub fn is_none(&self) -> bool {
        !self.trainer && !self.generation
    }
}

/// Errors reading a plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The file could not be read.
    #[error("cannot read plan {path}: {source}")]
    Read {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Not JSON of the expected shape.
    #[error("plan {path} is not a valid plan: {message}")]
    Parse {
        /// Path.
        path: String,
        /// Cause.
        message: String,
    },
    /// Another format version.
    #[error(
        "plan {path} has format version {found} but this worker reads version {expected}; run a worker image that matches the operator"
    )]
    Version {
        /// Path.
        path: String,
        /// Version in the file.
        found: u32,
        /// Version this build reads.
        expected: u32,
    },
    /// The pod is not in the plan.
    #[error("pod `{pod}` is not in the plan (pods: {known}); check RLPLANE_POD / --pod")]
    UnknownPod {
        /// Pod asked for.
        pod: String,
        /// Pods present.
        known: String,
    },
}

impl WorkerPlan {
    /// The step whose weights the run starts from: the resumed checkpoint's, else 0.
    pub fn first_version(&self) -> u32 {
        self.resume.as_ref().map_or(0, |r| r.step.min(self.workload.steps as u64) as u32)
    }

    /// Parses a plan, checking the format version before anything else, so that a plan of another
    /// version gives the version error rather than a field error.
    pub fn from_json(path: &str, text: &str) -> Result<WorkerPlan, PlanError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct VersionOnly {
            format_version: Option<u32>,
        }
        let v: VersionOnly =
            serde_json::from_str(text).map_err(|e| PlanError::Parse { path: path.into(), message: e.to_string() })?;
        let found = v
            .format_version
            .ok_or_else(|| PlanError::Parse { path: path.into(), message: "missing formatVersion".into() })?;
        if found != PLAN_FORMAT_VERSION {
            return Err(PlanError::Version { path: path.into(), found, expected: PLAN_FORMAT_VERSION });
        }
        serde_json::from_str(text).map_err(|e| PlanError::Parse { path: path.into(), message: e.to_string() })
    }

    /// Reads and parses a plan file.
    pub fn load(path: &str) -> Result<WorkerPlan, PlanError> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Read { path: path.into(), source })?;
        Self::from_json(path, &text)
    }

    /// Serializes the plan (pretty JSON).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a plan always serializes")
    }

    /// Index of a pod by name.
    pub fn pod_index(&self, pod: &str) -> Result<u32, PlanError> {
        self.pods.iter().position(|p| p.name == pod).map(|i| i as u32).ok_or_else(|| PlanError::UnknownPod {
            pod: pod.into(),
            known: self.pods.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", "),
        })
    }

    /// The processes of one pod, in local order.
    pub fn processes_of_pod(&self, pod: u32) -> Vec<u32> {
        (0..self.processes.len() as u32).filter(|&i| self.processes[i as usize].pod == pod).collect()
    }

    /// A process by index.
    pub fn process(&self, i: u32) -> &ProcessEntry {
        &self.processes[i as usize]
    }

    /// Index of a process by name.
    pub fn process_index(&self, name: &str) -> Option<u32> {
        self.processes.iter().position(|p| p.name == name).map(|i| i as u32)
    }

    /// `host:port` other processes use to reach `port` of process `i`.
    pub fn address(&self, i: u32, port: u16) -> String {
        let pod = &self.pods[self.processes[i as usize].pod as usize];
        format!("{}:{port}", pod.host)
    }

    /// `host:port` process `i` binds for `port`.
    pub fn bind_address(&self, i: u32, port: u16) -> String {
        let pod = &self.pods[self.processes[i as usize].pod as usize];
        format!("{}:{port}", pod.bind_host)
    }

    /// The coordinator's control address.
    pub fn control_address(&self) -> String {
        let c = self.coordinator;
        self.address(c, self.process(c).ports.control.expect("the coordinator has a control port"))
    }

    /// The transfer-queue controller's address.
    pub fn tq_controller_address(&self) -> String {
        let c = self.coordinator;
        self.address(c, self.process(c).ports.tq_controller.expect("the coordinator has a TQ port"))
    }

    /// Address of a storage unit.
    pub fn storage_address(&self, unit: u32) -> Option<String> {
        let u = self.storage_units.iter().find(|u| u.id == unit)?;
        let port = self.process(u.process).ports.storage?;
        Some(self.address(u.process, port))
    }

    /// Trainer ranks in global-rank order (process indices).
    pub fn trainer_ranks(&self) -> Vec<u32> {
        let mut v: Vec<(u32, u32)> = self
            .processes
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p.role {
                ProcessRole::Trainer(c) => Some((c.rank, i as u32)),
                _ => None,
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, i)| i).collect()
    }

    /// Generation ranks in global-rank order (process indices).
    pub fn generation_ranks(&self) -> Vec<u32> {
        let mut v: Vec<(u32, u32)> = self
            .processes
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p.role {
                ProcessRole::Generation(c) => Some((c.rank, i as u32)),
                _ => None,
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, i)| i).collect()
    }

    /// The refit group a process belongs to (as sender or receiver), if any.
    pub fn refit_groups_of(&self, process: u32) -> Vec<&RefitGroup> {
        self.refit_groups.iter().filter(|g| g.senders.contains(&process) || g.receivers.contains(&process)).collect()
    }

    /// The fan-out group of a trainer rank.
    pub fn fanout_group_of(&self, process: u32) -> Option<&FanoutGroup> {
        self.fanout_groups.iter().find(|g| g.members.contains(&process))
    }

    /// The resolved model manifest.
    pub fn manifest(&self) -> Vec<crate::model::TensorSpec> {
        self.model.manifest()
    }
}

/// The token of a job epoch: stamped on every handshake so that a rank of another epoch or job is
/// refused with a message that says so. It is an identifier, not a secret (it derives from the
/// uid, which anyone who can read the RLJob can see): what keeps other pods out is the epoch's key
/// ([`JobRef::key_file`]), which every handshake proves possession of.
pub fn job_token(uid: &str, epoch: u32) -> String {
    // FNV-1a 64: stable across Rust versions and platforms, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in uid.as_bytes().iter().chain(b":").chain(epoch.to_le_bytes().iter()) {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("e{epoch}-{h:016x}")
}

/// Bytes in a job epoch's key.
pub const JOB_KEY_LEN: usize = 32;

/// Directory the epoch's key Secret is mounted at in every pod of the job.
pub const POD_KEY_DIR: &str = "/etc/rlplane-key";

/// Key (in the Secret's `data`, and so file name under [`POD_KEY_DIR`]) holding the epoch's key.
pub const JOB_KEY_SECRET_KEY: &str = "key";

/// Path of the epoch's key inside every pod of the job.
pub const POD_KEY_FILE: &str = "/etc/rlplane-key/key";

/// Environment variable telling the user's processes (the Python client) the directory of their
/// pod's ipc:// sockets: the operator and `rlplane local` set it to the pod's `ipcDir`. The worker
/// itself reads only the plan.
pub const IPC_DIR_ENV: &str = "RLPLANE_IPC_DIR";

/// Name of the Secret holding the key of a job epoch: `<job>-key-<uid>-e<epoch>`, `<uid>` being
/// the first 8 letters and digits of the RLJob's uid. One per epoch, so a gang restart gets a new
/// key without ever rewriting the Secret that running pods mount; the uid keeps an RLJob deleted
/// and created again under its name from meeting the old one's Secret before the garbage
/// collector removes it.
pub fn job_key_secret_name(job: &str, uid: &str, epoch: u32) -> String {
    let uid: String = uid.chars().filter(char::is_ascii_alphanumeric).take(8).collect();
    format!("{job}-key-{}-e{epoch}", uid.to_ascii_lowercase())
}

/// A fresh job key from the operating system's random source: the one place keys are made (the
/// operator's Secrets, `rlplane local`'s key files, the benchmarks'). `Err` names what failed.
pub fn generate_job_key() -> Result<[u8; JOB_KEY_LEN], String> {
    use ring::rand::SecureRandom;
    let mut key = [0u8; JOB_KEY_LEN];
    ring::rand::SystemRandom::new().fill(&mut key).map_err(|e| format!("the system random source failed ({e})"))?;
    Ok(key)
}

/// The text form of a job key, as it is stored in the Secret and in key files: lowercase hex
/// (printable, so `kubectl` and Python peers can read it: `bytes.fromhex(text.strip())`).
pub fn encode_job_key(key: &[u8; JOB_KEY_LEN]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses a key file's text ([`encode_job_key`]'s form; surrounding whitespace is ignored). The
/// error says what is wrong with the text, never the text itself.
pub fn parse_job_key(text: &str) -> Result<[u8; JOB_KEY_LEN], String> {
    let hex = text.trim();
    if hex.len() != 2 * JOB_KEY_LEN {
        return Err(format!(
            "expected {} hexadecimal characters (a {JOB_KEY_LEN}-byte key), found {} characters",
            2 * JOB_KEY_LEN,
            hex.len()
        ));
    }
    let mut key = [0u8; JOB_KEY_LEN];
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        let digit = |c: u8| (c as char).to_digit(16);
        match (digit(pair[0]), digit(pair[1])) {
            (Some(h), Some(l)) => key[i] = (h * 16 + l) as u8,
            _ => return Err(format!("character {} is not a hexadecimal digit", 2 * i + 1)),
        }
    }
    Ok(key)
}

fn fsdp_default() -> u32 {
    1
}

#[cfg(test)]
mod key_tests {
    use super::*;

    #[test]
    fn job_keys_round_trip_and_bad_text_is_named_without_echoing_it() {
        let key: [u8; JOB_KEY_LEN] = std::array::from_fn(|i| (i * 37 + 5) as u8);
        let text = encode_job_key(&key);
        assert_eq!(text.len(), 64);
        assert_eq!(parse_job_key(&format!("  {text}\n")).unwrap(), key);
        let short = parse_job_key("abcd").unwrap_err();
        assert!(short.contains("64 hexadecimal characters") && short.contains("found 4"), "{short}");
        let bad = parse_job_key(&format!("zz{}", &text[2..])).unwrap_err();
        assert!(bad.contains("character 1") && !bad.contains(&text[2..]), "{bad}");
        assert_eq!(job_key_secret_name("grpo", "6F1C9A2B-77aa-4e", 3), "grpo-key-6f1c9a2b-e3");
        assert_eq!(job_key_secret_name("grpo", "u-1", 0), "grpo-key-u1-e0");
        assert_eq!(POD_KEY_FILE, format!("{POD_KEY_DIR}/{JOB_KEY_SECRET_KEY}"));
    }
}
