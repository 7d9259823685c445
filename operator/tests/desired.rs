//! The operator's pure desired state: pods, Service, ConfigMap and PodGroup for both modes.

use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use rlplane_api::plan::WorkerPlan;
use rlplane_api::{RLJob, load_rljob};
use rlplane_operator::desired::{DesiredError, OperatorConfig, PLAN_KEY, WORKER_CONTAINER, desired, labels};

fn job(file: &str) -> RLJob {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests").join(file)).unwrap();
    let mut job = load_rljob(&text).unwrap();
    job.metadata.namespace = Some("ml".into());
    job.metadata.uid = Some("0b9e-uid".into());
    job
}

fn cfg() -> OperatorConfig {
    OperatorConfig { worker_image: "rlplane-worker:test".into(), image_pull_policy: Some("IfNotPresent".into()) }
}

fn worker(pod: &Pod) -> &k8s_openapi::api::core::v1::Container {
    let spec = pod.spec.as_ref().unwrap();
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find(|c| c.name == WORKER_CONTAINER)
        .expect("every pod runs the worker")
}

fn gpus(c: &k8s_openapi::api::core::v1::Container) -> Option<String> {
    c.resources.as_ref()?.limits.as_ref()?.get("nvidia.com/gpu").map(|q| q.0.clone())
}

#[test]
fn split_cpu_job_has_trainer_and_generation_pods_wired_to_the_plan() {
    let j = job("rljob-cpu.yaml");
    let d = desired(&j, 0, &cfg()).unwrap();
    let names: Vec<_> = d.pods.iter().map(|p| p.metadata.name.clone().unwrap()).collect();
    assert_eq!(names, vec!["grpo-cpu-trainer-0", "grpo-cpu-gen-0", "grpo-cpu-gen-1"]);

    let svc = d.service.spec.as_ref().unwrap();
    assert_eq!(d.service.metadata.name.as_deref(), Some("grpo-cpu-headless"));
    assert_eq!(svc.cluster_ip.as_deref(), Some("None"));
    assert_eq!(svc.publish_not_ready_addresses, Some(true));

    let plan_json = &d.config_map.data.as_ref().unwrap()[PLAN_KEY];
    let plan = WorkerPlan::from_json("cm", plan_json).unwrap();
    assert_eq!(plan, d.plan);
    assert_eq!(plan.job.namespace, "ml");

    for pod in &d.pods {
        let m = &pod.metadata;
        let o = &m.owner_references.as_ref().unwrap()[0];
        assert_eq!((o.kind.as_str(), o.name.as_str(), o.controller), ("RLJob", "grpo-cpu", Some(true)));
        let l = m.labels.as_ref().unwrap();
        assert_eq!(l[labels::JOB], "grpo-cpu");
        assert_eq!(l[labels::EPOCH], "0");
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.hostname, m.name);
        assert_eq!(spec.subdomain.as_deref(), Some("grpo-cpu-headless"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        let w = worker(pod);
        assert_eq!(w.image.as_deref(), Some("rlplane-worker:test"));
        assert_eq!(w.command.as_ref().unwrap().join(" "), "rlplane worker --plan /etc/rlplane/plan.json");
        assert!(w.env.as_ref().unwrap().iter().any(|e| e.name == "RLPLANE_POD" && e.value_from.is_some()));
        assert_eq!(gpus(w), None, "device Cpu requests no GPUs");
        assert!(w.readiness_probe.is_some());
        let vols: Vec<_> = spec.volumes.as_ref().unwrap().iter().map(|v| v.name.as_str()).collect();
        assert_eq!(vols, vec!["plan", "ipc", "dshm"]);
        let mounts: Vec<_> = w.volume_mounts.as_ref().unwrap().iter().map(|v| v.mount_path.as_str()).collect();
        assert_eq!(mounts, vec!["/etc/rlplane", "/var/run/rlplane", "/dev/shm"]);
        // Every listening port of the pod's processes is declared on the container.
        let declared: Vec<i32> = w.ports.as_ref().unwrap().iter().map(|p| p.container_port).collect();
        let pi = plan.pod_index(m.name.as_deref().unwrap()).unwrap();
        for &i in &plan.processes_of_pod(pi) {
            let pr = &plan.process(i).ports;
            for port in [pr.control, pr.tq_controller, pr.refit, pr.fanout, pr.storage].into_iter().flatten() {
                assert!(declared.contains(&(port as i32)), "{:?} lacks port {port}", m.name);
            }
        }
    }
    let coord = d.pods.iter().filter(|p| p.metadata.labels.as_ref().unwrap().contains_key(labels::COORDINATOR));
    assert_eq!(coord.count(), 1, "exactly one pod runs the coordinator");
    assert!(d.pod_group.is_none());
}

#[test]
fn gpu_split_job_requests_gpus_and_gets_a_volcano_gang() {
    let j = job("rljob-split.yaml");
    let d = desired(&j, 2, &cfg()).unwrap();
    assert_eq!(d.pods.len(), 3, "1 trainer pod + 2 generation pods of 8 GPUs");
    for pod in &d.pods {
        assert_eq!(gpus(worker(pod)).as_deref(), Some("8"));
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.scheduler_name.as_deref(), Some("volcano"));
        assert_eq!(pod.metadata.annotations.as_ref().unwrap()["scheduling.k8s.io/group-name"], "llama3-8b-split-gang");
        assert_eq!(pod.metadata.labels.as_ref().unwrap()[labels::EPOCH], "2");
        let env = worker(pod).env.as_ref().unwrap();
        assert!(env.iter().any(|e| e.name == "NCCL_NVLS_ENABLE"), "user env is passed through");
    }
    let pg = d.pod_group.expect("gang: Volcano creates a PodGroup");
    assert_eq!(pg.types.as_ref().unwrap().api_version, "scheduling.volcano.sh/v1beta1");
    assert_eq!(pg.data["spec"]["minMember"], 3);
}

#[test]
fn user_templates_run_beside_the_worker_as_a_native_sidecar() {
    let mut j = job("rljob-colocated.yaml");
    let tpl = |name: &str, image: &str| {
        serde_json::from_value(serde_json::json!({
            "metadata": {"annotations": {"team": "rl"}},
            "spec": {"containers": [{"name": name, "image": image}]}
        }))
        .unwrap()
    };
    j.spec.trainer.template = Some(tpl("megatron", "nvcr.io/megatron:1"));
    j.spec.generation.template = Some(tpl("vllm", "vllm/vllm-openai:1"));
    let d = desired(&j, 0, &cfg()).unwrap();
    let pod = &d.pods[0];
    let spec = pod.spec.as_ref().unwrap();
    let names: Vec<_> = spec.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, vec!["megatron", "vllm"], "colocated: the generation template joins the trainer pod");
    let w = worker(pod);
    assert_eq!(w.restart_policy.as_deref(), Some("Always"), "the worker is a native sidecar");
    assert!(spec.init_containers.as_ref().unwrap().iter().any(|c| c.name == WORKER_CONTAINER));
    for c in &spec.containers {
        let m: Vec<_> = c.volume_mounts.as_ref().unwrap().iter().map(|v| v.mount_path.as_str()).collect();
        assert!(m.contains(&"/var/run/rlplane") && m.contains(&"/dev/shm"), "{}: {m:?}", c.name);
    }
    assert_eq!(gpus(&spec.containers[0]).as_deref(), Some("8"), "GPUs go to the first user container");
    assert_eq!(gpus(w), None);
    assert_eq!(pod.metadata.annotations.as_ref().unwrap()["team"], "rl");
}

#[test]
fn epochs_change_tokens_and_labels_but_not_names() {
    let j = job("rljob-cpu-colocated.yaml");
    let a = desired(&j, 0, &cfg()).unwrap();
    let b = desired(&j, 1, &cfg()).unwrap();
    let names = |d: &rlplane_operator::desired::Desired| {
        d.pods.iter().map(|p| p.metadata.name.clone().unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(names(&a), names(&b));
    assert_ne!(a.plan.job.token, b.plan.job.token);
    assert_eq!(b.pods[0].metadata.labels.as_ref().unwrap()[labels::EPOCH], "1");
    // Pure: the same inputs give the same objects.
    let again = desired(&j, 0, &cfg()).unwrap();
    assert_eq!(serde_json::to_value(&a.pods).unwrap(), serde_json::to_value(&again.pods).unwrap());
    assert_eq!(a.config_map, again.config_map);
    // Dedicated storage: a tq pod without GPUs.
    assert!(a.pods.iter().any(|p| p.metadata.name.as_deref() == Some("grpo-cpu-colocated-tq-0")));
}

#[test]
fn an_invalid_spec_is_an_invalid_spec_error_with_every_message() {
    let mut j = job("rljob-cpu.yaml");
    j.spec.trainer.parallelism.data = 3;
    j.spec.refit.align_bytes = 3;
    match desired(&j, 0, &cfg()) {
        Err(DesiredError::InvalidSpec(e)) => {
            assert_eq!(e.0.len(), 2, "{e}");
            assert!(e.to_string().contains("spec.trainer.parallelism"));
        }
        other => panic!("expected InvalidSpec, got {other:?}"),
    }
    let mut j = job("rljob-cpu.yaml");
    j.metadata.uid = None;
    assert!(matches!(desired(&j, 0, &cfg()), Err(DesiredError::MissingMetadata("metadata.uid"))));
}

#[test]
fn the_committed_crd_is_fresh() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/rljob.yaml");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = rlplane_operator::crd_yaml().unwrap();
    assert!(
        committed == generated,
        "crds/rljob.yaml is stale: run `cargo run -p rlplane-operator --bin crdgen crds/rljob.yaml`"
    );
}

#[test]
fn the_worker_account_may_only_read_and_patch_this_jobs_status() {
    let j = job("rljob-cpu.yaml");
    let d = desired(&j, 0, &cfg()).unwrap();
    assert_eq!(d.service_account.metadata.name.as_deref(), Some("grpo-cpu-worker"));
    let rules = d.role.rules.as_ref().unwrap();
    assert_eq!(rules.len(), 1, "{rules:?}");
    let r = &rules[0];
    assert_eq!(r.api_groups.as_deref(), Some(&["rlplane.dev".to_string()][..]));
    assert_eq!(r.resources.as_deref(), Some(&["rljobs/status".to_string()][..]));
    assert_eq!(r.resource_names.as_deref(), Some(&["grpo-cpu".to_string()][..]));
    assert_eq!(r.verbs, vec!["get", "patch"]);
    let rb = &d.role_binding;
    assert_eq!((rb.role_ref.kind.as_str(), rb.role_ref.name.as_str()), ("Role", "grpo-cpu-worker"));
    let subjects = rb.subjects.as_ref().unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(
        (subjects[0].kind.as_str(), subjects[0].name.as_str(), subjects[0].namespace.as_deref()),
        ("ServiceAccount", "grpo-cpu-worker", Some("ml"))
    );
    for meta in [&d.service_account.metadata, &d.role.metadata, &rb.metadata] {
        assert_eq!(meta.namespace.as_deref(), Some("ml"));
        assert_eq!(meta.owner_references.as_ref().unwrap()[0].name, "grpo-cpu");
        assert_eq!(meta.labels.as_ref().unwrap()[labels::JOB], "grpo-cpu");
    }
    // Every pod runs as the worker account; only the coordinator's pod gets a token.
    for pod in &d.pods {
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.service_account_name.as_deref(), Some("grpo-cpu-worker"));
        let coordinator = pod.metadata.labels.as_ref().unwrap().contains_key(labels::COORDINATOR);
        let automount = spec.automount_service_account_token;
        assert_eq!(automount, if coordinator { None } else { Some(false) }, "{:?}", pod.metadata.name);
    }
}

#[test]
fn a_service_account_named_by_a_template_is_kept_and_bound_as_well() {
    let mut j = job("rljob-colocated.yaml");
    j.spec.trainer.template = Some(
        serde_json::from_value(serde_json::json!({
            "spec": {"serviceAccountName": "team-rl", "containers": [{"name": "megatron", "image": "nvcr.io/megatron:1"}]}
        }))
        .unwrap(),
    );
    let d = desired(&j, 0, &cfg()).unwrap();
    for pod in d.pods.iter().filter(|p| p.metadata.labels.as_ref().unwrap()[labels::ROLE] == "trainer") {
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.service_account_name.as_deref(), Some("team-rl"));
        assert_eq!(spec.automount_service_account_token, None, "the user's account keeps its own token rules");
    }
    let names: Vec<_> = d.role_binding.subjects.as_ref().unwrap().iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, vec!["llama3-8b-colocated-worker", "team-rl"], "the coordinator can report either way");
}

#[test]
fn the_spec_hash_follows_what_shapes_pods_and_ignores_the_run_policy() {
    use rlplane_operator::desired::{SPEC_HASH_ANNOTATION, spec_hash};
    let j = job("rljob-cpu.yaml");
    let base = spec_hash(&j.spec);
    let mut policy = j.spec.clone();
    policy.run_policy.backoff_limit = 9;
    policy.run_policy.active_deadline_seconds = Some(60);
    policy.run_policy.suspend = true;
    policy.scheduling.queue_name = Some("team-a".into());
    assert_eq!(spec_hash(&policy), base, "runPolicy and the queue name change no pod");
    let mut shape = j.spec.clone();
    shape.workload.steps += 1;
    assert_ne!(spec_hash(&shape), base, "the plan changes with the workload");
    let d = desired(&j, 0, &cfg()).unwrap();
    for pod in &d.pods {
        assert_eq!(pod.metadata.annotations.as_ref().unwrap()[SPEC_HASH_ANNOTATION], base);
    }
}

#[test]
fn a_queued_job_puts_its_pods_in_one_kueue_pod_group_per_epoch() {
    use rlplane_operator::desired::labels::{KUEUE_POD_GROUP, KUEUE_POD_GROUP_COUNT, KUEUE_QUEUE};
    let plain = desired(&job("rljob-split.yaml"), 0, &cfg()).unwrap();
    assert!(plain.pods.iter().all(|p| !p.metadata.labels.as_ref().unwrap().contains_key(KUEUE_QUEUE)));

    // Either the RLJob's own Kueue label or spec.scheduling.queueName names the queue.
    let mut by_label = job("rljob-split.yaml");
    by_label.metadata.labels = Some([(KUEUE_QUEUE.to_string(), "team-a".to_string())].into());
    let mut by_spec = job("rljob-split.yaml");
    by_spec.spec.scheduling.queue_name = Some("team-a".into());
    for (j, epoch) in [(by_label, 0u32), (by_spec, 3)] {
        let d = desired(&j, epoch, &cfg()).unwrap();
        for pod in &d.pods {
            let l = pod.metadata.labels.as_ref().unwrap();
            assert_eq!(l[KUEUE_QUEUE], "team-a");
            assert_eq!(l[KUEUE_POD_GROUP], format!("llama3-8b-split-e{epoch}"), "a new group per epoch");
            let a = pod.metadata.annotations.as_ref().unwrap();
            assert_eq!(a[KUEUE_POD_GROUP_COUNT], d.pods.len().to_string(), "the group is every pod");
        }
    }
}
