//! Pure construction of a job's [`WorkerPlan`] from its spec.
//!
//! The operator and the local runner call [`build_plan`] with different [`Addressing`]: pod DNS
//! names and fixed ports in a cluster ([`ClusterAddressing`]), loopback and free ports on one
//! machine. Everything else — ranks, coordinates, groups, storage units — is decided here, once.
//!
//! Trainer global rank order: tp fastest, then cp, then dp, pp slowest
//! (`rank = tp + TP·(cp + CP·(dp + DP·pp))`). Trainer rank `r` runs in pod `r / gpusPerNode` on GPU
//! `r % gpusPerNode`. Generation rank `g` belongs to engine `g / tensorParallel`; in Colocated mode
//! it shares GPU `g` with trainer rank `g`; in Split mode it runs in generation pod
//! `g / generation.gpusPerNode`.

use std::collections::BTreeMap;

use crate::plan::{
    FanoutGroup, GenerationCoords, GroupTransport, JobRef, Layout, PLAN_FORMAT_VERSION, POD_KEY_FILE, PodEntry,
    PodRole, ProcessEntry, ProcessPorts, ProcessRole, RefitGroup, StorageUnitEntry, TrainerCoords, WorkerPlan,
    job_token, ports,
};
use crate::spec::{Device, Mode, Parallelism, RLJobSpec, RefitSource, RefitTransport, TqPlacement};
use crate::validate::{ValidationErrors, validate};

/// Identity of the job instance a plan is built for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobIdentity {
    /// RLJob name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// RLJob uid.
    pub uid: String,
    /// Epoch (0 at the first start, +1 per gang restart).
    pub epoch: u32,
    /// The checkpoint this epoch resumes from (`status.resumedFrom`), if any.
    pub resume: Option<crate::spec::CheckpointRef>,
}

/// Where pods are reached and what ports their services get.
pub trait Addressing {
    /// Host other pods use to reach `pod`.
    fn host(&self, pod: &str) -> String;
    /// Host `pod`'s listeners bind.
    fn bind_host(&self, pod: &str) -> String;
    /// Directory for `pod`'s ipc:// (Unix) sockets.
    fn ipc_dir(&self, pod: &str) -> String;
    /// Port of a service: `base` is one of [`ports`], `offset` the process's local index or slot.
    fn port(&self, pod: &str, base: u16, offset: u32) -> u16;
    /// Whether these pods certainly share one node (so CUDA IPC can join them).
    fn same_node(&self, pods: &[&str]) -> bool;
    /// Whether `pod`'s sockets and shared-memory files are for its own user only: true where
    /// every process of the job runs as one user (`rlplane local`); false in a cluster, where a
    /// user's container may run as another uid than the worker's.
    fn private_ipc(&self, _pod: &str) -> bool {
        false
    }
}

/// Cluster addressing: `<pod>.<job>-headless.<ns>.svc`, fixed ports, sockets in `/var/run/rlplane`.
#[derive(Clone, Debug)]
pub struct ClusterAddressing {
    /// RLJob name.
    pub job: String,
    /// Namespace.
    pub namespace: String,
}

/// Directory of the shared emptyDir holding the ipc:// (Unix) sockets inside a pod.
pub const POD_IPC_DIR: &str = "/var/run/rlplane";

impl Addressing for ClusterAddressing {
    fn host(&self, pod: &str) -> String {
        format!("{pod}.{}.{}.svc", headless_service_name(&self.job), self.namespace)
    }
    fn bind_host(&self, _pod: &str) -> String {
        "0.0.0.0".into()
    }
    fn ipc_dir(&self, _pod: &str) -> String {
        POD_IPC_DIR.into()
    }
    fn port(&self, _pod: &str, base: u16, offset: u32) -> u16 {
        base + offset as u16
    }
    fn same_node(&self, pods: &[&str]) -> bool {
        // Different pods may land on different nodes; only one pod is certainly one node.
        pods.windows(2).all(|w| w[0] == w[1])
    }
}

/// Name of the job's headless Service.
pub fn headless_service_name(job: &str) -> String {
    format!("{job}-headless")
}

/// Name of the job's plan ConfigMap.
pub fn plan_config_map_name(job: &str) -> String {
    format!("{job}-plan")
}

/// Longest pod name: the pod's hostname, a DNS label.
const MAX_POD_NAME_LEN: usize = 63;

/// Name of a pod of epoch `epoch`: `<job>-trainer-<i>`, `<job>-gen-<i>`, `<job>-tq-<i>` in the
/// first epoch, with `-e<epoch>` after it in later ones. Each epoch's pods have names of their
/// own, so a new gang is created while the previous one terminates instead of after it (a
/// restart waits for neither the old pods' deletion nor their names); the name is also the
/// pod's DNS name, so old and new pods never answer to the same one. A suffix that would not fit
/// a DNS label keeps the epoch's last digits (at least eight remain for the longest job name
/// and index): only pods that exist at the same time need distinct names.
pub fn pod_name(job: &str, role: PodRole, index: u32, epoch: u32) -> String {
    let base = format!("{job}-{}-{index}", role.short());
    if epoch == 0 {
        return base;
    }
    let digits = epoch.to_string();
    let room = MAX_POD_NAME_LEN.saturating_sub(base.len() + 2).max(1);
    format!("{base}-e{}", &digits[digits.len().saturating_sub(room)..])
}

/// The transport of one refit group: `spec.refit.transport`, or for `Auto` what was measured
/// fastest (docs/benchmarks.md): TCP without GPUs; CUDA IPC when colocated (ranks share GPUs,
/// which NCCL cannot put in one communicator) or when one receiver shares the senders' node (copy
/// engines, 1.09 × NCCL); NCCL for fan-out to several receivers (its ring crosses each sender's
/// link once) and across nodes.
pub fn group_transport(spec: &RLJobSpec, same_node: bool, receivers: usize) -> GroupTransport {
    match spec.refit.transport {
        RefitTransport::Tcp => GroupTransport::Tcp,
        RefitTransport::Nccl => GroupTransport::Nccl,
        RefitTransport::CudaIpc => GroupTransport::CudaIpc,
        RefitTransport::Auto if spec.device == Device::Cpu => GroupTransport::Tcp,
        RefitTransport::Auto if spec.mode == Mode::Colocated => GroupTransport::CudaIpc,
        RefitTransport::Auto if same_node && receivers == 1 => GroupTransport::CudaIpc,
        RefitTransport::Auto => GroupTransport::Nccl,
    }
}

/// What [`colocated_refit_groups`] needs of a colocated job's layout: trainer rank `r` and
/// generation rank `r` share GPU slot `r % gpus_per_pod` of pod `r / gpus_per_pod`.
struct ColocatedLayout<'a> {
    pods: u32,
    gpus_per_pod: u32,
    replicas: u32,
    fsdp: u32,
    generation_ranks: u32,
    /// The trainer ranks that send a replica's shards (its shard group's, context index 0).
    senders_of_replica: &'a dyn Fn(u32) -> Vec<u32>,
    /// A trainer rank's data-parallel index.
    trainer_dp: &'a dyn Fn(u32) -> u32,
}

/// One colocated refit group before process indices: senders are trainer ranks, receivers
/// generation ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ColocatedGroup {
    name: String,
    senders: Vec<u32>,
    generation_ranks: Vec<u32>,
}

/// Colocated refit groups, or None where some pod holds no whole replica (one group for the job
/// then). Each engine rank takes the weights from the replica whose trainer rank shares its GPU
/// (the pod's first whole replica where that one spans pods), so every data-parallel replica of
/// a pod serves bytes: each GPU copies its own shard locally and pulls the other shards once over
/// NVLink, and no GPU sends the same bytes to more engines than its replica holds. With one
/// replica per pod a group is `refit-pod<p>`; with several, `refit-pod<p>-replica<r>`.
fn colocated_refit_groups(l: &ColocatedLayout) -> Option<Vec<ColocatedGroup>> {
    let mut groups = Vec::new();
    for pod in 0..l.pods {
        let in_pod = |ranks: &[u32]| ranks.iter().all(|&r| r / l.gpus_per_pod == pod);
        let whole: Vec<u32> = (0..l.replicas).filter(|&rep| in_pod(&(l.senders_of_replica)(rep))).collect();
        let first = *whole.first()?;
        let mut receivers: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for gr in (0..l.generation_ranks).filter(|gr| gr / l.gpus_per_pod == pod) {
            let home = (l.trainer_dp)(gr) / l.fsdp;
            let replica = if whole.contains(&home) { home } else { first };
            receivers.entry(replica).or_default().push(gr);
        }
        let several = receivers.len() > 1;
        for (replica, generation_ranks) in receivers {
            let name = if several { format!("refit-pod{pod}-replica{replica}") } else { format!("refit-pod{pod}") };
            groups.push(ColocatedGroup { name, senders: (l.senders_of_replica)(replica), generation_ranks });
        }
    }
    Some(groups)
}

/// Builds the plan of a job epoch. Validates the spec first and returns every error.
pub fn build_plan(spec: &RLJobSpec, id: &JobIdentity, addr: &dyn Addressing) -> Result<WorkerPlan, ValidationErrors> {
    validate(spec)?;
    let pods = pods(spec, &id.name, id.epoch, addr);
    let senders = refit_senders(spec);
    let processes = Processes::lay_out(spec, addr, &pods, &senders.is_sender);
    let refit_groups = refit_groups(spec, addr, &pods, &processes, &senders);
    let fanout_groups = fanout_groups(&spec.trainer.parallelism, &processes.trainer);
    let Processes { entries, storage_units, coordinator, .. } = processes;
    Ok(WorkerPlan {
        format_version: PLAN_FORMAT_VERSION,
        job: job_ref(id),
        mode: spec.mode,
        device: spec.device,
        layout: layout(spec),
        pods,
        processes: entries,
        coordinator,
        refit_groups,
        fanout_groups,
        storage_units,
        model: spec.model.clone(),
        refit: spec.refit.clone(),
        transfer_queue: spec.transfer_queue.clone(),
        workload: spec.workload.clone(),
        observability: spec.observability.clone(),
        user_processes: crate::plan::UserProcesses {
            trainer: spec.trainer.template.is_some(),
            generation: spec.generation.template.is_some(),
        },
        checkpoint: spec.checkpoint.clone(),
        schedule: spec.schedule,
        resume: id.resume.clone(),
    })
}

/// The job epoch's identity as the plan carries it, with its token.
fn job_ref(id: &JobIdentity) -> JobRef {
    JobRef {
        name: id.name.clone(),
        namespace: id.namespace.clone(),
        uid: id.uid.clone(),
        epoch: id.epoch,
        token: job_token(&id.uid, id.epoch),
        // Where the operator mounts the epoch's Secret; `rlplane local` points it at its own.
        key_file: POD_KEY_FILE.into(),
    }
}

/// The parallel layout of the trainer and the generation engines.
fn layout(spec: &RLJobSpec) -> Layout {
    let t = &spec.trainer;
    let p = &t.parallelism;
    let g = &spec.generation;
    Layout {
        tp: p.tensor,
        pp: p.pipeline,
        cp: p.context,
        dp: p.data,
        fsdp: p.fsdp,
        trainer_world: t.nodes * t.gpus_per_node,
        trainer_gpus_per_pod: t.gpus_per_node,
        engines: g.engines,
        engine_tp: g.tensor_parallel,
        generation_world: g.engines * g.tensor_parallel,
    }
}

/// The job's pods, in order: trainer pods, then generation pods (Split mode), then storage pods
/// (Dedicated placement).
fn pods(spec: &RLJobSpec, job: &str, epoch: u32, addr: &dyn Addressing) -> Vec<PodEntry> {
    let t = &spec.trainer;
    let g = &spec.generation;
    let gpu = spec.device == Device::Gpu;
    let mut pods = Vec::new();
    let mut add_pod = |role: PodRole, index: u32, gpus: u32| {
        let name = pod_name(job, role, index, epoch);
        pods.push(PodEntry {
            host: addr.host(&name),
            bind_host: addr.bind_host(&name),
            ipc_dir: addr.ipc_dir(&name),
            private_ipc: addr.private_ipc(&name),
            name,
            role,
            index,
            gpus: if gpu { gpus } else { 0 },
        });
    };
    for i in 0..t.nodes {
        add_pod(PodRole::Trainer, i, t.gpus_per_node);
    }
    let gen_world = g.engines * g.tensor_parallel;
    let gen_pod_gpus = g.pod_gpus();
    let gen_pods = if spec.mode == Mode::Split { gen_world / gen_pod_gpus } else { 0 };
    for j in 0..gen_pods {
        add_pod(PodRole::Generation, j, gen_pod_gpus);
    }
    let dedicated = spec.transfer_queue.placement == TqPlacement::Dedicated;
    let storage_pods = if dedicated { spec.transfer_queue.storage_units } else { 0 };
    for k in 0..storage_pods {
        add_pod(PodRole::Storage, k, 0);
    }
    pods
}

/// Trainer rank `r`'s coordinates (see the module docs for the rank order).
fn trainer_coords(p: &Parallelism, r: u32) -> TrainerCoords {
    let tp = r % p.tensor;
    let cp = (r / p.tensor) % p.context;
    let dp = (r / (p.tensor * p.context)) % p.data;
    let pp = r / (p.tensor * p.context * p.data);
    TrainerCoords { rank: r, tp, pp, cp, dp, leader: tp == 0 && cp == 0 && pp == 0 }
}

/// The trainer ranks that send a replica's shards (context index 0). A replica is one shard
/// group: `fsdp` consecutive data-parallel ranks that together hold every parameter once (one
/// rank when the trainer does not shard over data).
fn senders_of_replica(p: &Parallelism, replica: u32) -> Vec<u32> {
    let mut v = Vec::new();
    for pp in 0..p.pipeline {
        for dp in replica * p.fsdp..(replica + 1) * p.fsdp {
            for tp in 0..p.tensor {
                v.push(tp + p.tensor * (p.context * (dp + p.data * pp)));
            }
        }
    }
    v
}

/// Which trainer ranks send weights at a refit.
struct RefitSenders {
    /// Colocated refit groups, or None where the job has one group ([`colocated_refit_groups`]).
    colocated: Option<Vec<ColocatedGroup>>,
    /// The senders of the job's one group (where `colocated` is None).
    global: Vec<u32>,
    /// Per trainer rank, whether it sends (and so gets a refit port).
    is_sender: Vec<bool>,
}

/// The trainer ranks that send at a refit: in Colocated mode with a Sharded source, those of each
/// colocated group (where every pod holds a whole replica); otherwise replica 0's shard group, or
/// rank 0 alone when the source is Gathered.
fn refit_senders(spec: &RLJobSpec) -> RefitSenders {
    let t = &spec.trainer;
    let p = &t.parallelism;
    let global: Vec<u32> = match spec.refit.source {
        RefitSource::Sharded => senders_of_replica(p, 0),
        RefitSource::Gathered => vec![0],
    };
    let colocated = if spec.mode == Mode::Colocated && spec.refit.source == RefitSource::Sharded {
        colocated_refit_groups(&ColocatedLayout {
            pods: t.nodes,
            gpus_per_pod: t.gpus_per_node,
            replicas: p.data / p.fsdp,
            fsdp: p.fsdp,
            generation_ranks: spec.generation.engines * spec.generation.tensor_parallel,
            senders_of_replica: &|replica| senders_of_replica(p, replica),
            trainer_dp: &|r| trainer_coords(p, r).dp,
        })
    } else {
        None
    };
    let mut is_sender = vec![false; (t.nodes * t.gpus_per_node) as usize];
    match &colocated {
        Some(groups) => groups.iter().flat_map(|g| &g.senders).for_each(|&r| is_sender[r as usize] = true),
        None => global.iter().for_each(|&r| is_sender[r as usize] = true),
    }
    RefitSenders { colocated, global, is_sender }
}

/// The plan's processes, pod by pod in local order, and where each rank landed.
struct Processes {
    /// Every process; its position is its index.
    entries: Vec<ProcessEntry>,
    /// Per trainer rank, its process index.
    trainer: Vec<u32>,
    /// Per generation rank, its process index.
    generation: Vec<u32>,
    /// The storage units, in the order their processes were laid out.
    storage_units: Vec<StorageUnitEntry>,
    /// The coordinator's process index.
    coordinator: u32,
}

impl Processes {
    /// The processes of `pods` (from [`pods`]); `is_sender` marks the trainer ranks that get a
    /// refit port.
    fn lay_out(spec: &RLJobSpec, addr: &dyn Addressing, pods: &[PodEntry], is_sender: &[bool]) -> Processes {
        let t = &spec.trainer;
        let g = &spec.generation;
        let mut out = Processes {
            entries: Vec::new(),
            trainer: vec![0; (t.nodes * t.gpus_per_node) as usize],
            generation: vec![0; (g.engines * g.tensor_parallel) as usize],
            storage_units: Vec::new(),
            coordinator: 0,
        };
        for (pod_idx, pod) in pods.iter().enumerate() {
            let pod_idx = pod_idx as u32;
            match pod.role {
                PodRole::Trainer => out.add_trainer_pod(spec, addr, pod, pod_idx, is_sender),
                PodRole::Generation => out.add_generation_pod(spec, addr, pod, pod_idx),
                PodRole::Storage => out.add_storage_pod(addr, pod, pod_idx),
            }
        }
        out
    }

    /// A trainer pod's processes, in local order: its trainer ranks, then in Colocated mode the
    /// generation ranks sharing their GPUs, then on pod 0 the coordinator.
    fn add_trainer_pod(
        &mut self,
        spec: &RLJobSpec,
        addr: &dyn Addressing,
        pod: &PodEntry,
        pod_idx: u32,
        is_sender: &[bool],
    ) {
        let gpn = spec.trainer.gpus_per_node;
        let gpu = spec.device == Device::Gpu;
        let mut local = 0u32;
        let mut next_local = || {
            local += 1;
            local - 1
        };
        for slot in 0..gpn {
            let r = pod.index * gpn + slot;
            let c = trainer_coords(&spec.trainer.parallelism, r);
            let l = next_local();
            let ports = ProcessPorts {
                refit: is_sender[r as usize].then(|| addr.port(&pod.name, ports::REFIT_BASE, l)),
                fanout: c.leader.then(|| addr.port(&pod.name, ports::FANOUT_BASE, l)),
                ..Default::default()
            };
            let ipc = (spec.mode == Mode::Colocated).then(|| format!("ipc://{}/gpu-{slot}.sock", pod.ipc_dir));
            self.trainer[r as usize] = self.push(ProcessEntry {
                name: format!("trainer-{r}"),
                pod: pod_idx,
                local: l,
                gpu: gpu.then_some(slot),
                role: ProcessRole::Trainer(c),
                ports,
                ipc,
            });
        }
        if spec.mode == Mode::Colocated {
            for slot in 0..gpn {
                let gr = pod.index * gpn + slot;
                let l = next_local();
                self.add_generation(gr, gen_entry(spec, addr, pod, pod_idx, gr, l, slot));
            }
        }
        if pod.index == 0 {
            let l = next_local();
            self.coordinator = self.push(ProcessEntry {
                name: "coordinator".into(),
                pod: pod_idx,
                local: l,
                gpu: None,
                role: ProcessRole::Coordinator,
                ports: ProcessPorts {
                    control: Some(addr.port(&pod.name, ports::CONTROL, 0)),
                    tq_controller: Some(addr.port(&pod.name, ports::TQ_CONTROLLER, 0)),
                    ..Default::default()
                },
                ipc: None,
            });
        }
    }

    /// A generation pod's processes (Split mode): its generation ranks, each on its own GPU slot,
    /// which is also its local index.
    fn add_generation_pod(&mut self, spec: &RLJobSpec, addr: &dyn Addressing, pod: &PodEntry, pod_idx: u32) {
        let gpn = spec.generation.pod_gpus();
        for slot in 0..gpn {
            let gr = pod.index * gpn + slot;
            self.add_generation(gr, gen_entry(spec, addr, pod, pod_idx, gr, slot, slot));
        }
    }

    /// A storage pod's process (Dedicated placement): the storage unit numbered like the pod.
    fn add_storage_pod(&mut self, addr: &dyn Addressing, pod: &PodEntry, pod_idx: u32) {
        let process = self.push(ProcessEntry {
            name: format!("tq-{}", pod.index),
            pod: pod_idx,
            local: 0,
            gpu: None,
            role: ProcessRole::Storage { unit: pod.index },
            ports: ProcessPorts { storage: Some(addr.port(&pod.name, ports::STORAGE_BASE, 0)), ..Default::default() },
            ipc: None,
        });
        self.storage_units.push(StorageUnitEntry { id: pod.index, process });
    }

    /// Adds generation rank `gr`'s process and, where it hosts one, its storage unit.
    fn add_generation(&mut self, gr: u32, (entry, unit): (ProcessEntry, Option<u32>)) {
        let process = self.push(entry);
        if let Some(id) = unit {
            self.storage_units.push(StorageUnitEntry { id, process });
        }
        self.generation[gr as usize] = process;
    }

    /// Adds a process; returns its index.
    fn push(&mut self, e: ProcessEntry) -> u32 {
        self.entries.push(e);
        self.entries.len() as u32 - 1
    }
}

/// The refit groups with process indices, each with the transport its members allow.
fn refit_groups(
    spec: &RLJobSpec,
    addr: &dyn Addressing,
    pods: &[PodEntry],
    processes: &Processes,
    senders: &RefitSenders,
) -> Vec<RefitGroup> {
    let pod_name_of = |proc_idx: u32| pods[processes.entries[proc_idx as usize].pod as usize].name.as_str();
    let make_group = |name: String, senders: &[u32], receivers: Vec<u32>| {
        let senders: Vec<u32> = senders.iter().map(|&r| processes.trainer[r as usize]).collect();
        let members: Vec<&str> = senders.iter().chain(&receivers).map(|&i| pod_name_of(i)).collect();
        let same_node = addr.same_node(&members);
        let transport = group_transport(spec, same_node, receivers.len());
        RefitGroup { name, same_node, senders, receivers, transport }
    };
    match &senders.colocated {
        Some(groups) => groups
            .iter()
            .map(|g| {
                let receivers = g.generation_ranks.iter().map(|&gr| processes.generation[gr as usize]).collect();
                make_group(g.name.clone(), &g.senders, receivers)
            })
            .collect(),
        None => vec![make_group("refit".into(), &senders.global, processes.generation.clone())],
    }
}

/// Fan-out groups: one per data-parallel shard, leader first. `trainer_proc` maps trainer ranks
/// to process indices.
fn fanout_groups(p: &Parallelism, trainer_proc: &[u32]) -> Vec<FanoutGroup> {
    let trainer_world = trainer_proc.len() as u32;
    let coords = |r: u32| trainer_coords(p, r);
    (0..p.data)
        .map(|dp| {
            let mut ranks: Vec<u32> = (0..trainer_world).filter(|&r| coords(r).dp == dp).collect();
            ranks.sort_by_key(|&r| (!coords(r).leader, r));
            let members: Vec<u32> = ranks.iter().map(|&r| trainer_proc[r as usize]).collect();
            FanoutGroup { dp, leader: members[0], members }
        })
        .collect()
}

/// A generation rank's process entry, and the storage unit it hosts, if any. `slot` is its GPU
/// slot in the pod.
fn gen_entry(
    spec: &RLJobSpec,
    addr: &dyn Addressing,
    pod: &PodEntry,
    pod_idx: u32,
    gr: u32,
    local: u32,
    slot: u32,
) -> (ProcessEntry, Option<u32>) {
    let gpu = spec.device == Device::Gpu;
    let tp = spec.generation.tensor_parallel;
    let c = GenerationCoords { rank: gr, engine: gr / tp, engine_rank: gr % tp, producer: gr.is_multiple_of(tp) };
    let hosts_storage = c.producer && spec.transfer_queue.placement == TqPlacement::ProducerLocal;
    // Storage slot: the engine's index within the pod, so ports stay small and fixed.
    let storage_slot = slot / tp;
    let entry = ProcessEntry {
        name: format!("gen-{gr}"),
        pod: pod_idx,
        local,
        gpu: gpu.then_some(slot),
        role: ProcessRole::Generation(c),
        ports: ProcessPorts {
            refit: Some(addr.port(&pod.name, ports::REFIT_BASE, local)),
            storage: hosts_storage.then(|| addr.port(&pod.name, ports::STORAGE_BASE, storage_slot)),
            ..Default::default()
        },
        // Colocated: the socket of the GPU it shares with the trainer rank there.
        ipc: (spec.mode == Mode::Colocated).then(|| format!("ipc://{}/gpu-{slot}.sock", pod.ipc_dir)),
    };
    (entry, hosts_storage.then_some(c.engine))
}
