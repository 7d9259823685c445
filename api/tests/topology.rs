//! Properties of `build_plan` over many layouts of both modes: pod counts, ranks unique and
//! contiguous, every group member resolving to a pod of the set, leaders exactly where tp = cp =
//! pp = 0, colocated IPC endpoints shared by exactly the processes that need them, unique ports,
//! and a plan that round-trips through JSON.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use rlplane_api::plan::{PLAN_FORMAT_VERSION, PlanError, PodRole, ProcessRole, WorkerPlan, job_token};
use rlplane_api::topology::{ClusterAddressing, JobIdentity, build_plan};
use rlplane_api::*;

#[derive(Clone, Copy, Debug)]
struct L {
    mode: Mode,
    nodes: u32,
    gpn: u32,
    tp: u32,
    pp: u32,
    cp: u32,
    dp: u32,
    fsdp: u32,
    engines: u32,
    gen_tp: u32,
    gen_gpn: Option<u32>,
    dedicated: Option<u32>,
    source: RefitSource,
}

fn layouts() -> Vec<L> {
    use Mode::*;
    use RefitSource::*;
    let l = |mode, nodes, gpn, (tp, pp, cp, dp), engines, gen_tp, gen_gpn, dedicated, source| L {
        mode,
        nodes,
        gpn,
        tp,
        pp,
        cp,
        dp,
        fsdp: 1,
        engines,
        gen_tp,
        gen_gpn,
        dedicated,
        source,
    };
    let fsdp = |l: L, fsdp: u32| L { fsdp, ..l };
    vec![
        l(Split, 1, 2, (1, 1, 1, 2), 2, 1, None, None, Sharded),
        fsdp(l(Split, 1, 4, (1, 1, 1, 4), 2, 1, None, None, Sharded), 4),
        fsdp(l(Split, 2, 4, (2, 1, 1, 4), 2, 2, None, None, Sharded), 2),
        fsdp(l(Colocated, 2, 4, (1, 1, 1, 8), 8, 1, None, None, Sharded), 4),
        fsdp(l(Colocated, 1, 4, (2, 1, 1, 2), 2, 2, None, None, Sharded), 2),
        l(Split, 1, 8, (2, 1, 1, 4), 16, 1, Some(8), None, Sharded),
        l(Split, 2, 8, (4, 2, 1, 2), 4, 4, Some(8), Some(2), Sharded),
        l(Split, 4, 4, (2, 2, 2, 2), 3, 2, Some(2), None, Gathered),
        l(Split, 2, 4, (8, 1, 1, 1), 2, 8, Some(8), Some(3), Sharded),
        l(Colocated, 1, 2, (2, 1, 1, 1), 2, 1, None, None, Sharded),
        l(Colocated, 1, 8, (2, 1, 1, 4), 4, 2, None, None, Sharded),
        l(Colocated, 2, 8, (2, 2, 1, 4), 8, 2, None, Some(1), Sharded),
        l(Colocated, 2, 4, (4, 2, 1, 1), 2, 4, None, None, Sharded),
        l(Colocated, 3, 2, (1, 1, 2, 3), 6, 1, None, None, Gathered),
        l(Colocated, 4, 8, (8, 1, 1, 4), 32, 1, None, None, Sharded),
    ]
}

fn spec_of(l: L) -> RLJobSpec {
    let yaml = format!(
        "mode: {:?}\nmodel: {{preset: llama3-8b}}\ntrainer: {{nodes: {}, gpusPerNode: {}, parallelism: {{tensor: {}, pipeline: {}, context: {}, data: {}}}}}\ngeneration: {{engines: {}, tensorParallel: {}}}\nworkload: {{promptsPerStep: 64}}\n",
        l.mode, l.nodes, l.gpn, l.tp, l.pp, l.cp, l.dp, l.engines, l.gen_tp
    );
    let mut spec: RLJobSpec = serde_saphyr::from_str(&yaml).unwrap();
    spec.generation.gpus_per_node = l.gen_gpn;
    spec.refit.source = l.source;
    spec.trainer.parallelism.fsdp = l.fsdp;
    if let Some(s) = l.dedicated {
        spec.transfer_queue.placement = TqPlacement::Dedicated;
        spec.transfer_queue.storage_units = s;
    }
    spec
}

fn id(epoch: u32) -> JobIdentity {
    JobIdentity { name: "job".into(), namespace: "ns".into(), uid: "uid-1".into(), epoch, resume: None }
}

fn plan_of(l: L) -> WorkerPlan {
    let spec = spec_of(l);
    build_plan(&spec, &id(0), &ClusterAddressing { job: "job".into(), namespace: "ns".into() })
        .unwrap_or_else(|e| panic!("{l:?}: {e}"))
}

#[test]
fn pod_counts_and_names() {
    for l in layouts() {
        let p = plan_of(l);
        let count = |r: PodRole| p.pods.iter().filter(|x| x.role == r).count() as u32;
        assert_eq!(count(PodRole::Trainer), l.nodes, "{l:?}");
        let gen_pods = match l.mode {
            Mode::Split => l.engines * l.gen_tp / l.gen_gpn.unwrap_or(l.gen_tp),
            Mode::Colocated => 0,
        };
        assert_eq!(count(PodRole::Generation), gen_pods, "{l:?}");
        assert_eq!(count(PodRole::Storage), l.dedicated.unwrap_or(0), "{l:?}");
        let names: HashSet<_> = p.pods.iter().map(|x| x.name.clone()).collect();
        assert_eq!(names.len(), p.pods.len(), "pod names unique");
        for pod in &p.pods {
            assert_eq!(pod.name, format!("job-{}-{}", pod.role.short(), pod.index));
            assert_eq!(pod.host, format!("{}.job-headless.ns.svc", pod.name));
        }
    }
}

#[test]
fn each_epoch_names_its_pods_apart_from_the_previous_one() {
    let spec = spec_of(layouts()[0]);
    let a = ClusterAddressing { job: "job".into(), namespace: "ns".into() };
    let names = |e| build_plan(&spec, &id(e), &a).unwrap().pods.into_iter().map(|p| p.name).collect::<Vec<_>>();
    assert_eq!(names(0)[0], "job-trainer-0", "the first epoch keeps the plain names");
    assert_eq!(names(1)[0], "job-trainer-0-e1");
    assert_eq!(names(12)[0], "job-trainer-0-e12");
    for e in 0..3 {
        let (now, next): (HashSet<_>, HashSet<_>) =
            (names(e).into_iter().collect(), names(e + 1).into_iter().collect());
        assert!(now.is_disjoint(&next), "epoch {e} and {} share a pod name", e + 1);
    }
    let p = build_plan(&spec, &id(7), &a).unwrap();
    assert!(
        p.pods.iter().all(|x| x.host == format!("{}.job-headless.ns.svc", x.name)),
        "the DNS name follows the epoch"
    );
}

#[test]
fn pod_names_stay_dns_labels_at_the_longest_job_name_index_and_epoch() {
    use rlplane_api::topology::pod_name;
    let job = "j".repeat(MAX_JOB_NAME_LEN);
    for (role, index) in [(PodRole::Trainer, 1023), (PodRole::Generation, 262_143), (PodRole::Storage, 4095)] {
        for epoch in [0, 1, 99_999_999, u32::MAX] {
            let n = pod_name(&job, role, index, epoch);
            assert!(n.len() <= 63, "{n} has {} characters", n.len());
            let suffix = n.rsplit_once("-e").map(|(_, d)| d.len()).unwrap_or(0);
            let wanted = epoch.to_string().len().min(8);
            assert!(epoch == 0 || suffix >= wanted, "{n}: at least the epoch's last eight digits");
        }
    }
    assert_eq!(pod_name(&job, PodRole::Trainer, 1023, 99_999_999).len(), 63);
}

#[test]
fn ranks_are_unique_contiguous_and_on_valid_gpus() {
    for l in layouts() {
        let p = plan_of(l);
        let trainer: Vec<u32> = p
            .trainer_ranks()
            .iter()
            .map(|&i| match p.process(i).role {
                ProcessRole::Trainer(c) => c.rank,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(trainer, (0..l.nodes * l.gpn).collect::<Vec<_>>(), "{l:?}");
        let gens: Vec<u32> = p
            .generation_ranks()
            .iter()
            .map(|&i| match p.process(i).role {
                ProcessRole::Generation(c) => c.rank,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(gens, (0..l.engines * l.gen_tp).collect::<Vec<_>>(), "{l:?}");
        // Coordinates are a bijection onto the parallel grid.
        let coords: HashSet<(u32, u32, u32, u32)> = p
            .trainer_ranks()
            .iter()
            .map(|&i| match p.process(i).role {
                ProcessRole::Trainer(c) => (c.tp, c.pp, c.cp, c.dp),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(coords.len() as u32, l.tp * l.pp * l.cp * l.dp);
        // Per pod and role, GPUs are distinct and inside the pod's count.
        let mut seen: BTreeMap<(u32, &str), BTreeSet<u32>> = BTreeMap::new();
        for proc in &p.processes {
            if let Some(g) = proc.gpu {
                assert!(g < p.pods[proc.pod as usize].gpus, "{l:?} {}", proc.name);
                assert!(seen.entry((proc.pod, proc.role.kind())).or_default().insert(g), "{l:?} {}", proc.name);
            }
        }
        // Local indices are 0..n within each pod.
        for (pi, _) in p.pods.iter().enumerate() {
            let locals: Vec<u32> = p.processes_of_pod(pi as u32).iter().map(|&i| p.process(i).local).collect();
            assert_eq!(locals, (0..locals.len() as u32).collect::<Vec<_>>());
        }
    }
}

#[test]
fn every_group_member_resolves_to_a_process_in_a_pod_of_the_set() {
    for l in layouts() {
        let p = plan_of(l);
        let ok = |i: u32| (i as usize) < p.processes.len() && (p.process(i).pod as usize) < p.pods.len();
        assert!(ok(p.coordinator));
        assert_eq!(p.process(p.coordinator).role, ProcessRole::Coordinator);
        for g in &p.refit_groups {
            assert!(!g.senders.is_empty() && !g.receivers.is_empty(), "{l:?}");
            for &s in &g.senders {
                assert!(ok(s) && matches!(p.process(s).role, ProcessRole::Trainer(_)));
                assert!(p.process(s).ports.refit.is_some(), "a sender publishes its rendezvous");
            }
            for &r in &g.receivers {
                assert!(ok(r) && matches!(p.process(r).role, ProcessRole::Generation(_)));
                assert!(p.process(r).ports.refit.is_some());
            }
        }
        for g in &p.fanout_groups {
            assert!(g.members.iter().all(|&m| ok(m)));
            assert!(p.process(g.leader).ports.fanout.is_some());
        }
        for u in &p.storage_units {
            assert!(ok(u.process) && p.storage_address(u.id).is_some(), "{l:?}");
        }
        // Every generation rank receives from exactly one refit group.
        let mut recv: Vec<u32> = p.refit_groups.iter().flat_map(|g| g.receivers.clone()).collect();
        recv.sort();
        let mut all = p.generation_ranks();
        all.sort();
        assert_eq!(recv, all, "{l:?}");
    }
}

#[test]
fn refit_senders_cover_each_shard_once_per_group() {
    for l in layouts() {
        let p = plan_of(l);
        for g in &p.refit_groups {
            let shards: Vec<(u32, u32, u32, u32)> = g
                .senders
                .iter()
                .map(|&s| match p.process(s).role {
                    ProcessRole::Trainer(c) => (c.tp, c.pp, c.cp, c.dp),
                    _ => unreachable!(),
                })
                .collect();
            match l.source {
                RefitSource::Gathered => assert_eq!(shards, vec![(0, 0, 0, 0)], "{l:?}"),
                RefitSource::Sharded => {
                    // One whole shard group: every (tp, pp) of fsdp consecutive data-parallel ranks.
                    let cells: HashSet<(u32, u32, u32)> = shards.iter().map(|s| (s.0, s.1, s.3 % l.fsdp)).collect();
                    assert_eq!(cells.len() as u32, l.tp * l.pp * l.fsdp, "{l:?}");
                    assert_eq!(shards.len() as u32, l.tp * l.pp * l.fsdp, "{l:?}");
                    assert!(shards.iter().all(|s| s.2 == 0), "context-parallel replicas do not send");
                    let groups: HashSet<u32> = shards.iter().map(|s| s.3 / l.fsdp).collect();
                    assert_eq!(groups.len(), 1, "one replica (shard group) per refit group");
                }
            }
            assert_eq!(p.layout.fsdp, l.fsdp);
            if l.mode == Mode::Colocated && g.name.starts_with("refit-pod") {
                let pods: HashSet<u32> = g.senders.iter().chain(&g.receivers).map(|&i| p.process(i).pod).collect();
                assert_eq!(pods.len(), 1, "a per-pod group stays in its pod");
                assert!(g.same_node);
            }
        }
    }
}

#[test]
fn leaders_are_exactly_the_tp_cp_pp_zero_ranks() {
    for l in layouts() {
        let p = plan_of(l);
        let mut leaders = 0;
        for &i in &p.trainer_ranks() {
            let ProcessRole::Trainer(c) = p.process(i).role else { unreachable!() };
            assert_eq!(c.leader, c.tp == 0 && c.cp == 0 && c.pp == 0, "{l:?}");
            leaders += c.leader as u32;
            let g = p.fanout_group_of(i).expect("every trainer rank has a fan-out group");
            assert_eq!(g.dp, c.dp);
            let ProcessRole::Trainer(lc) = p.process(g.leader).role else { unreachable!() };
            assert!(lc.leader && lc.dp == c.dp);
            assert_eq!(g.members[0], g.leader);
        }
        assert_eq!(leaders, l.dp, "one leader per data-parallel shard");
        assert_eq!(p.fanout_groups.len() as u32, l.dp);
        let members: usize = p.fanout_groups.iter().map(|g| g.members.len()).sum();
        assert_eq!(members as u32, l.nodes * l.gpn, "fan-out groups partition the trainer");
    }
}

#[test]
fn colocated_ipc_endpoints_are_shared_by_exactly_the_processes_on_that_gpu() {
    for l in layouts() {
        let p = plan_of(l);
        let mut users: BTreeMap<(u32, String), Vec<&str>> = BTreeMap::new();
        for proc in &p.processes {
            if let Some(ipc) = &proc.ipc {
                assert!(ipc.starts_with("ipc:///var/run/rlplane/gpu-"), "{ipc}");
                users.entry((proc.pod, ipc.clone())).or_default().push(proc.role.kind());
            }
        }
        match l.mode {
            Mode::Split => assert!(users.is_empty(), "no IPC sockets in Split mode"),
            Mode::Colocated => {
                assert_eq!(users.len() as u32, l.nodes * l.gpn, "one socket per GPU");
                for ((_, ipc), kinds) in users {
                    let mut k = kinds.clone();
                    k.sort();
                    assert_eq!(k, vec!["generation", "trainer"], "{ipc}: one trainer rank and one generation rank");
                }
            }
        }
    }
}

#[test]
fn listeners_of_a_pod_never_share_a_port() {
    for l in layouts() {
        let p = plan_of(l);
        for pi in 0..p.pods.len() as u32 {
            let mut ports = HashSet::new();
            for &i in &p.processes_of_pod(pi) {
                let pr = &p.process(i).ports;
                for port in [pr.control, pr.tq_controller, pr.refit, pr.fanout, pr.storage].into_iter().flatten() {
                    assert!(ports.insert(port), "{l:?}: port {port} used twice in pod {pi}");
                    assert_ne!(port, 9400, "metrics port");
                }
            }
        }
    }
}

#[test]
fn plan_round_trips_through_json_and_refuses_other_versions() {
    for l in layouts() {
        let p = plan_of(l);
        let json = p.to_json();
        let back = WorkerPlan::from_json("plan.json", &json).unwrap();
        assert_eq!(back, p);
        // Same inputs, same plan.
        assert_eq!(plan_of(l), p);
    }
    let p = plan_of(layouts()[0]);
    let mut v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
    v["formatVersion"] = (PLAN_FORMAT_VERSION + 1).into();
    v["someFutureField"] = 1.into();
    match WorkerPlan::from_json("plan.json", &v.to_string()) {
        Err(PlanError::Version { found, expected, .. }) => {
            assert_eq!((found, expected), (PLAN_FORMAT_VERSION + 1, PLAN_FORMAT_VERSION))
        }
        other => panic!("expected a version error, got {other:?}"),
    }
    let err = WorkerPlan::from_json("plan.json", &format!("{{\"formatVersion\": {PLAN_FORMAT_VERSION}}}"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a valid plan"), "{err}");
}

#[test]
fn the_token_is_stamped_with_the_epoch() {
    let spec = spec_of(layouts()[0]);
    let a = ClusterAddressing { job: "job".into(), namespace: "ns".into() };
    let p0 = build_plan(&spec, &id(0), &a).unwrap();
    let p1 = build_plan(&spec, &id(1), &a).unwrap();
    assert_ne!(p0.job.token, p1.job.token);
    assert_eq!(p1.job.token, job_token("uid-1", 1));
    assert_ne!(job_token("uid-1", 1), job_token("uid-2", 1));
    assert!(p1.job.token.starts_with("e1-"));
    // The plan says where the epoch's key is mounted, never the key.
    assert_eq!(p1.job.key_file, rlplane_api::plan::POD_KEY_FILE);
}

#[test]
fn an_invalid_spec_yields_every_error() {
    let mut spec = spec_of(layouts()[0]);
    spec.trainer.parallelism.data = 3;
    spec.refit.num_buffers = 0;
    let a = ClusterAddressing { job: "job".into(), namespace: "ns".into() };
    let e = build_plan(&spec, &id(0), &a).unwrap_err();
    assert_eq!(e.0.len(), 2, "{e}");
}

#[test]
fn hybrid_sharded_colocated_pods_refit_from_their_own_shard_group() {
    // HSDP: 2 pods × 4 GPUs, data 8 in shard groups of 4, one per pod: each pod's four ranks
    // together hold the model once and refit their own pod's engines.
    let l = layouts().into_iter().find(|l| l.mode == Mode::Colocated && l.fsdp == 4).unwrap();
    let p = plan_of(l);
    let names: Vec<&str> = p.refit_groups.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["refit-pod0", "refit-pod1"]);
    for (pod, g) in p.refit_groups.iter().enumerate() {
        let dps: Vec<u32> = g
            .senders
            .iter()
            .map(|&s| match p.process(s).role {
                ProcessRole::Trainer(c) => c.dp,
                _ => unreachable!(),
            })
            .collect();
        let first = pod as u32 * 4;
        assert_eq!(dps, (first..first + 4).collect::<Vec<_>>());
        assert_eq!(g.receivers.len(), 4);
    }
}

/// Issue 25: colocated on 4 GPUs (trainer TP 2 × DP 2, four engines), each engine takes its
/// weights from the replica on its own GPU and its neighbour, so both replicas serve bytes and
/// no GPU sends its shard to more than one other GPU.
#[test]
fn colocated_engines_refit_from_the_replica_that_shares_their_gpus() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/rljob-gpu-colocated-4.yaml"))
        .unwrap();
    let job = load_rljob(&text).unwrap();
    let p = build_plan(&job.spec, &id(0), &ClusterAddressing { job: "j".into(), namespace: "ns".into() }).unwrap();
    let gpu = |i: u32| p.process(i).gpu.unwrap();
    let groups: Vec<(&str, Vec<u32>, Vec<u32>)> = p
        .refit_groups
        .iter()
        .map(|g| {
            (
                g.name.as_str(),
                g.senders.iter().map(|&i| gpu(i)).collect(),
                g.receivers.iter().map(|&i| gpu(i)).collect(),
            )
        })
        .collect();
    assert_eq!(
        groups,
        [("refit-pod0-replica0", vec![0, 1], vec![0, 1]), ("refit-pod0-replica1", vec![2, 3], vec![2, 3])],
        "sender and receiver GPUs of each group"
    );
    // Every engine rank is refitted by exactly one group.
    let mut receivers: Vec<u32> = p.refit_groups.iter().flat_map(|g| g.receivers.clone()).collect();
    receivers.sort();
    let mut all = p.generation_ranks();
    all.sort();
    assert_eq!(receivers, all);
}

#[test]
fn each_refit_group_carries_its_transport_resolved_once() {
    use rlplane_api::plan::GroupTransport;
    let transports = |l: L, device: Device, t: RefitTransport| -> Vec<GroupTransport> {
        let mut spec = spec_of(l);
        spec.device = device;
        spec.refit.transport = t;
        let p = build_plan(&spec, &id(0), &ClusterAddressing { job: "job".into(), namespace: "ns".into() }).unwrap();
        p.refit_groups.iter().map(|g| g.transport).collect()
    };
    let all = layouts();
    let colocated = all.iter().copied().find(|l| l.mode == Mode::Colocated && l.nodes == 2).unwrap();
    let split_one_pod_two_engines = all[0];
    // Auto: TCP without GPUs; CUDA IPC colocated; NCCL to several receivers; explicit stays.
    assert!(transports(colocated, Device::Cpu, RefitTransport::Auto).iter().all(|t| *t == GroupTransport::Tcp));
    assert!(transports(colocated, Device::Gpu, RefitTransport::Auto).iter().all(|t| *t == GroupTransport::CudaIpc));
    assert_eq!(transports(split_one_pod_two_engines, Device::Gpu, RefitTransport::Auto), [GroupTransport::Nccl]);
    assert_eq!(transports(split_one_pod_two_engines, Device::Gpu, RefitTransport::CudaIpc), [GroupTransport::CudaIpc]);
    assert_eq!(transports(split_one_pod_two_engines, Device::Gpu, RefitTransport::Tcp), [GroupTransport::Tcp]);
}
