//! The operator's pure desired state: pods, Service, ConfigMap and PodGroup for both modes.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use rlplane_api::plan::{JOB_KEY_SECRET_KEY, POD_KEY_DIR, POD_KEY_FILE, WorkerPlan, parse_job_key};
use rlplane_api::{RLJob, load_rljob};
use rlplane_operator::desired::{
    DesiredError, KEY_VOLUME, OperatorConfig, PLAN_KEY, WORKER_CONTAINER, desired, labels, spec_hash,
};

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
        assert_eq!(vols, vec!["plan", "job-key", "ipc", "dshm"]);
        let mounts: Vec<_> = w.volume_mounts.as_ref().unwrap().iter().map(|v| v.mount_path.as_str()).collect();
        assert_eq!(mounts, vec!["/etc/rlplane", "/etc/rlplane-key", "/var/run/rlplane", "/dev/shm"]);
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
    // Only the engine's containers learn the engines' tensor-parallel size (their rank sockets).
    let tp = |c: &k8s_openapi::api::core::v1::Container| {
        c.env
            .as_ref()
            .unwrap()
            .iter()
            .find(|e| e.name == "RLPLANE_ENGINE_TENSOR_PARALLEL")
            .and_then(|e| e.value.clone())
    };
    assert_eq!(tp(&spec.containers[0]), None);
    assert_eq!(tp(&spec.containers[1]), Some(j.spec.generation.tensor_parallel.to_string()));
    assert_eq!(gpus(&spec.containers[0]).as_deref(), Some("8"), "GPUs go to the first user container");
    assert_eq!(gpus(w), None);
    assert_eq!(pod.metadata.annotations.as_ref().unwrap()["team"], "rl");
}

#[test]
fn epochs_change_tokens_labels_and_names() {
    let j = job("rljob-cpu-colocated.yaml");
    let a = desired(&j, 0, &cfg()).unwrap();
    let b = desired(&j, 1, &cfg()).unwrap();
    let names = |d: &rlplane_operator::desired::Desired| {
        d.pods.iter().map(|p| p.metadata.name.clone().unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(names(&a), ["grpo-cpu-colocated-trainer-0", "grpo-cpu-colocated-tq-0"]);
    assert_eq!(names(&b), ["grpo-cpu-colocated-trainer-0-e1", "grpo-cpu-colocated-tq-0-e1"]);
    let spec = b.pods[0].spec.as_ref().unwrap();
    assert_eq!(spec.hostname.as_deref(), Some("grpo-cpu-colocated-trainer-0-e1"), "the DNS name is the epoch's");
    assert_eq!(b.plan.pods[0].name, "grpo-cpu-colocated-trainer-0-e1");
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
fn pods_get_the_run_policys_grace_period_15_s_by_default() {
    let mut j = job("rljob-cpu.yaml");
    let grace = |j: &RLJob| {
        let d = desired(j, 0, &cfg()).unwrap();
        d.pods.iter().map(|p| p.spec.as_ref().unwrap().termination_grace_period_seconds).collect::<Vec<_>>()
    };
    assert!(grace(&j).iter().all(|g| *g == Some(15)), "{:?}", grace(&j));
    j.spec.run_policy.termination_grace_period_seconds = 5;
    assert!(grace(&j).iter().all(|g| *g == Some(5)), "{:?}", grace(&j));
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
    use rlplane_operator::desired::SPEC_HASH_ANNOTATION;
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

/// The `job-key` volume of a pod: the name of the Secret it mounts.
fn key_secret_of(pod: &Pod) -> Option<String> {
    let volumes = pod.spec.as_ref()?.volumes.as_ref()?;
    volumes.iter().find(|v| v.name == KEY_VOLUME)?.secret.as_ref()?.secret_name.clone()
}

#[test]
fn each_epoch_has_its_own_key_secret_mounted_only_into_its_pods_and_never_in_the_plan() {
    let j = job("rljob-cpu.yaml");
    let (a, b) = (desired(&j, 0, &cfg()).unwrap(), desired(&j, 1, &cfg()).unwrap());
    for (d, epoch) in [(&a, 0), (&b, 1)] {
        let s = &d.key_secret;
        // The uid is 0b9e-uid: its first 8 letters and digits.
        let name = format!("grpo-cpu-key-0b9euid-e{epoch}");
        assert_eq!(s.metadata.name.as_deref(), Some(name.as_str()));
        assert_eq!(s.metadata.namespace.as_deref(), Some("ml"));
        let o = &s.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!((o.kind.as_str(), o.name.as_str(), o.uid.as_str()), ("RLJob", "grpo-cpu", "0b9e-uid"));
        assert_eq!(o.controller, Some(true), "garbage-collected with the RLJob");
        assert_eq!(s.metadata.labels.as_ref().unwrap()[labels::EPOCH], epoch.to_string());
        assert_eq!(s.immutable, Some(true), "a key is replaced by a new epoch's Secret, never rewritten");
        assert!(s.data.is_none() && s.string_data.is_none(), "desired() draws no key: it stays pure");
        // Every pod of this epoch mounts this epoch's Secret, into the worker container only.
        for pod in &d.pods {
            assert_eq!(key_secret_of(pod).as_deref(), Some(name.as_str()), "{:?}", pod.metadata.name);
            let mounts = worker(pod).volume_mounts.as_ref().unwrap();
            let m = mounts.iter().find(|m| m.name == KEY_VOLUME).expect("the worker mounts the key");
            assert_eq!((m.mount_path.as_str(), m.read_only), (POD_KEY_DIR, Some(true)));
            // The plan alone says where the key is: no environment variable overrides it.
            let env = worker(pod).env.as_ref().unwrap();
            assert!(env.iter().all(|e| e.name != "RLPLANE_KEY_FILE"), "{env:?}");
        }
        assert_eq!(d.plan.job.key_file, POD_KEY_FILE, "the plan names the mounted file");
    }
    assert_ne!(a.key_secret.metadata.name, b.key_secret.metadata.name);

    // The key goes only into the Secret the controller creates, never into the plan.
    let key = [0xab; 32];
    let secret = a.key_secret_with(&key);
    let text = String::from_utf8(secret.data.as_ref().unwrap()[JOB_KEY_SECRET_KEY].0.clone()).unwrap();
    assert_eq!(parse_job_key(&text).unwrap(), key);
    let plan_json = &a.config_map.data.as_ref().unwrap()[PLAN_KEY];
    assert!(!plan_json.contains(&text), "the plan ConfigMap holds no key");
    assert!(plan_json.contains(POD_KEY_FILE));
}

#[test]
fn user_containers_do_not_get_the_key() {
    let mut j = job("rljob-colocated.yaml");
    j.spec.trainer.template = Some(
        serde_json::from_value(serde_json::json!({"spec": {"containers": [{"name": "megatron", "image": "m:1"}]}}))
            .unwrap(),
    );
    let d = desired(&j, 2, &cfg()).unwrap();
    let spec = d.pods[0].spec.as_ref().unwrap();
    for c in &spec.containers {
        assert!(c.volume_mounts.iter().flatten().all(|m| m.name != KEY_VOLUME), "{} mounts the key", c.name);
    }
    assert_eq!(key_secret_of(&d.pods[0]).as_deref(), Some("llama3-8b-colocated-key-0b9euid-e2"));
}

#[test]
fn the_network_policy_admits_only_the_jobs_pods_and_prometheus_on_the_metrics_port() {
    let j = job("rljob-cpu.yaml");
    let d = desired(&j, 0, &cfg()).unwrap();
    let np = d.network_policy.as_ref().expect("on by default");
    assert_eq!(np.metadata.name.as_deref(), Some("grpo-cpu-ingress"));
    assert_eq!(np.metadata.owner_references.as_ref().unwrap()[0].name, "grpo-cpu");
    let spec = np.spec.as_ref().unwrap();
    let own = BTreeMap::from([(labels::JOB.to_string(), "grpo-cpu".to_string())]);
    assert_eq!(spec.pod_selector.as_ref().unwrap().match_labels.as_ref(), Some(&own), "it guards the job's pods");
    assert_eq!(spec.policy_types.as_deref(), Some(&["Ingress".to_string()][..]));
    let rules = spec.ingress.as_ref().unwrap();
    assert_eq!(rules.len(), 2, "{rules:?}");
    // 1. The job's own pods, same namespace (no namespace selector), every port.
    let from = rules[0].from.as_ref().unwrap();
    assert_eq!(from.len(), 1);
    assert_eq!(from[0].pod_selector.as_ref().unwrap().match_labels.as_ref(), Some(&own));
    assert!(from[0].namespace_selector.is_none() && from[0].ip_block.is_none());
    assert!(rules[0].ports.is_none());
    // 2. Prometheus, any namespace, the metrics port only.
    let from = rules[1].from.as_ref().unwrap();
    let prometheus = BTreeMap::from([("app.kubernetes.io/name".to_string(), "prometheus".to_string())]);
    assert_eq!(from[0].pod_selector.as_ref().unwrap().match_labels.as_ref(), Some(&prometheus));
    assert_eq!(from[0].namespace_selector.as_ref().unwrap().match_labels, None, "every namespace");
    let ports = rules[1].ports.as_ref().unwrap();
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].port, Some(IntOrString::Int(j.spec.observability.metrics_port as i32)));

    // Scrapers can be narrowed; the policy can be turned off; neither restarts the gang.
    let mut narrowed = j.clone();
    narrowed.spec.network_policy.metrics_scraper_namespace_labels =
        BTreeMap::from([("kubernetes.io/metadata.name".into(), "monitoring".into())]);
    let n = desired(&narrowed, 0, &cfg()).unwrap();
    let ns_sel = n.network_policy.unwrap().spec.unwrap().ingress.unwrap()[1].from.as_ref().unwrap()[0]
        .namespace_selector
        .clone()
        .unwrap();
    assert_eq!(ns_sel.match_labels.unwrap()["kubernetes.io/metadata.name"], "monitoring");
    // A user's container that declares a metrics port (by name) is scraped there too.
    let mut served = j.clone();
    served.spec.generation.template = Some(
        serde_json::from_value(serde_json::json!({"spec": {"containers": [{"name": "vllm", "image": "vllm:1",
            "ports": [{"name": "metrics", "containerPort": 8000}, {"name": "http", "containerPort": 8080},
                      {"name": "metrics-exp", "containerPort": 9400}]}]}}))
        .unwrap(),
    );
    let n = desired(&served, 0, &cfg()).unwrap();
    let ports: Vec<_> = n.network_policy.unwrap().spec.unwrap().ingress.unwrap()[1]
        .ports
        .clone()
        .unwrap()
        .into_iter()
        .map(|p| p.port.unwrap())
        .collect();
    let metrics = j.spec.observability.metrics_port as i32;
    assert_eq!(ports, [metrics, 8000, 9400].map(IntOrString::Int), "not the http port");
    let mut off = j.clone();
    off.spec.network_policy.enabled = false;
    assert!(desired(&off, 0, &cfg()).unwrap().network_policy.is_none());
    assert_eq!(spec_hash(&off.spec), spec_hash(&j.spec));
}

#[test]
fn the_fsdp_and_vllm_deployment_renders_two_whole_node_pods_whose_containers_share_the_gpus() {
    let j = job("rljob-llama3-8b-fsdp-vllm.yaml");
    let d = desired(&j, 0, &cfg()).unwrap();
    assert_eq!(d.pods.len(), 2, "one trainer pod and one generation pod of four engines");
    let env = |c: &k8s_openapi::api::core::v1::Container, name: &str| {
        c.env.iter().flatten().find(|e| e.name == name).and_then(|e| e.value.clone())
    };
    for (pod, user) in d.pods.iter().zip(["trainer", "vllm"]) {
        let spec = pod.spec.as_ref().unwrap();
        let names: Vec<_> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, vec![user]);
        let c = &spec.containers[0];
        assert_eq!(gpus(c).as_deref(), Some("8"), "{user}: the user's container holds the node's GPUs");
        let w = worker(pod);
        assert_eq!(gpus(w), None);
        assert_eq!(env(w, "NVIDIA_VISIBLE_DEVICES").as_deref(), Some("all"), "the sidecar sees the same GPUs");
        assert_eq!(env(w, "NVIDIA_DRIVER_CAPABILITIES").as_deref(), Some("compute,utility"), "and gets libcuda");
        for x in [c, w] {
            assert_eq!(env(x, "CUDA_DEVICE_ORDER").as_deref(), Some("PCI_BUS_ID"), "{}: one device order", x.name);
            let mounts: Vec<_> = x.volume_mounts.iter().flatten().map(|m| m.mount_path.as_str()).collect();
            assert!(mounts.contains(&"/dev/shm") && mounts.contains(&"/var/run/rlplane"), "{}: {mounts:?}", x.name);
        }
        assert_eq!(spec.node_selector.as_ref().unwrap()["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
        assert_eq!(spec.termination_grace_period_seconds, Some(60));
    }
    let vllm = &d.pods[1].spec.as_ref().unwrap().containers[0];
    assert_eq!(env(vllm, "RLPLANE_ENGINE_TENSOR_PARALLEL").as_deref(), Some("2"));
    let plan: WorkerPlan = serde_json::from_str(&d.config_map.data.as_ref().unwrap()[PLAN_KEY]).unwrap();
    let engines: Vec<_> = plan
        .processes
        .iter()
        .filter_map(|p| match p.role {
            rlplane_api::plan::ProcessRole::Generation(c) => Some((p.pod, c.engine, c.engine_rank)),
            _ => None,
        })
        .collect();
    assert_eq!(engines.len(), 8);
    assert!(engines.iter().all(|&(pod, _, _)| pod == engines[0].0), "all four engines in one pod: {engines:?}");
}

#[test]
fn with_resource_claim_sharing_the_worker_and_every_user_container_use_the_pods_one_claim() {
    let mut j = job("rljob-llama3-8b-fsdp-vllm.yaml");
    j.spec.gpus = rlplane_api::GpuSpec {
        sharing: rlplane_api::GpuSharing::ResourceClaim,
        device_class_name: Some("gpu.nvidia.com".into()),
    };
    for t in [&mut j.spec.trainer.template, &mut j.spec.generation.template].into_iter().flatten() {
        let mut pt = t.pod_template().unwrap();
        for c in &mut pt.spec.as_mut().unwrap().containers {
            c.resources = None;
        }
        *t = serde_json::from_value(serde_json::to_value(pt).unwrap()).unwrap();
    }
    let d = desired(&j, 0, &cfg()).unwrap();
    // Both pods have 8 GPUs: one template, asking the class for exactly 8 devices.
    assert_eq!(d.gpu_claim_templates.len(), 1);
    let t = &d.gpu_claim_templates[0];
    assert_eq!(t.metadata.name.as_deref(), Some("llama3-8b-grpo-gpus-8"));
    assert_eq!(t.metadata.owner_references.as_ref().unwrap()[0].name, "llama3-8b-grpo", "deleted with the job");
    let req = &t.spec.spec.devices.as_ref().unwrap().requests.as_ref().unwrap()[0];
    let exactly = req.exactly.as_ref().unwrap();
    assert_eq!((exactly.device_class_name.as_str(), exactly.count), ("gpu.nvidia.com", Some(8)));
    for pod in &d.pods {
        let spec = pod.spec.as_ref().unwrap();
        let claims = spec.resource_claims.as_ref().unwrap();
        assert_eq!(claims.len(), 1);
        assert_eq!(claims[0].resource_claim_template_name.as_deref(), Some("llama3-8b-grpo-gpus-8"));
        let users = spec.containers.iter();
        for c in users.chain(std::iter::once(worker(pod))) {
            let r = c.resources.as_ref().unwrap();
            let names: Vec<_> = r.claims.iter().flatten().map(|x| x.name.as_str()).collect();
            assert_eq!(names, [claims[0].name.as_str()], "{}: the pod's one claim", c.name);
            assert_eq!(gpus(c), None, "{}: no device-plugin GPUs beside the claim", c.name);
            let order = c.env.iter().flatten().find(|e| e.name == "CUDA_DEVICE_ORDER");
            assert_eq!(order.and_then(|e| e.value.as_deref()), Some("PCI_BUS_ID"), "{}", c.name);
        }
        assert!(worker(pod).env.iter().flatten().all(|e| e.name != "NVIDIA_VISIBLE_DEVICES"), "the claim, not env");
    }
    // The default, the device plugin: no claim, no template.
    let plain = desired(&job("rljob-llama3-8b-fsdp-vllm.yaml"), 0, &cfg()).unwrap();
    assert!(plain.gpu_claim_templates.is_empty());
    assert!(plain.pods.iter().all(|p| p.spec.as_ref().unwrap().resource_claims.is_none()));
}
