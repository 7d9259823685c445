//! The user's install path on real containers: the project's images built from its Dockerfile and
//! loaded into the real node's containerd, the operator installed with `helm install` as a
//! Deployment of two replicas (leader election through a Lease), and an RLJob applied with
//! `kubectl apply` whose pods the kubelet runs: the worker image as a non-root container, the
//! plan ConfigMap, the epoch's key Secret and `/dev/shm` mounted by the kubelet, peers found
//! through cluster DNS and the coordinator reaching the API server through the `kubernetes`
//! Service (kube-proxy). The leader's pod killed, the other replica takes over and runs the
//! next job. Without KUBECONFIG, or without a real node, the test says that it skipped (CI makes
//! that an error).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use rlplane_api::{Phase, RLJob};
use rlplane_e2e::real_node::{RealNode, Setup};
use rlplane_e2e::{helm, kubectl, kubectl_stdin, phase_of, workspace};
use rlplane_operator::desired::WORKER_CONTAINER;

/// The real node's pod network (e2e/cluster/node.env's POD_CIDR, 10.199.128.0/24).
const POD_NETWORK: &str = "10.199.128.";

/// A CPU job's whole run on the 2-core machine, container starts included, fits well inside this.
const RUN: Duration = Duration::from_secs(240);

fn ok(what: &str, (success, out, err): (bool, String, String)) -> anyhow::Result<String> {
    anyhow::ensure!(success, "{what} failed:\n{err}{out}");
    Ok(out)
}

/// Polls `get` every 500 ms until it yields a value, at most `within`; fails naming `what`.
async fn until<T, F: std::future::Future<Output = anyhow::Result<Option<T>>>>(
    what: &str,
    within: Duration,
    mut get: impl FnMut() -> F,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = get().await? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("{what} did not happen within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The operator replica that holds the leader Lease.
async fn leader(client: &Client, ns: &str) -> anyhow::Result<Option<String>> {
    let lease = Api::<Lease>::namespaced(client.clone(), ns).get_opt("rlplane-operator").await?;
    Ok(lease.and_then(|l| l.spec).and_then(|s| s.holder_identity).filter(|h| !h.is_empty()))
}

/// manifests/rljob-cpu.yaml named `name`.
fn cpu_job(name: &str) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(workspace().join("manifests/rljob-cpu.yaml"))?;
    Ok(text.replace("name: grpo-cpu\n", &format!("name: {name}\n")))
}

/// A CPU job whose trainer and engine are the user's containers (the Python client's integration
/// scripts, numpy only, from a ConfigMap) on the client image, the worker beside them as a
/// native sidecar: they meet on the pod's socket directory and /dev/shm, and the engine fails
/// the job if a refit's weights differ from the pattern the trainer published.
fn user_containers_job(name: &str, image: &str) -> String {
    let container = |cname: &str, args: &str| {
        format!(
            "    template:\n      spec:\n        volumes: [{{name: scripts, configMap: {{name: sidecar-scripts}}}}]\n\
             \x20       containers:\n        - name: {cname}\n          image: {image}\n          imagePullPolicy: Never\n\
             \x20         command: [python3, /scripts/launch.py, \"1\", {args}]\n\
             \x20         volumeMounts: [{{name: scripts, mountPath: /scripts}}]\n"
        )
    };
    format!(
        "apiVersion: rlplane.dev/v1alpha1\nkind: RLJob\nmetadata:\n  name: {name}\nspec:\n  mode: Split\n  device: Cpu\n\
         \x20 model:\n    preset: tiny\n  trainer:\n    nodes: 1\n    gpusPerNode: 1\n{}\
         \x20 generation:\n    engines: 1\n    tensorParallel: 1\n{}\
         \x20 refit: {{transport: Tcp, bufferBytes: 262144, timeoutSeconds: 60}}\n\
         \x20 transferQueue: {{placement: ProducerLocal, capacityBytes: 67108864}}\n\
         \x20 workload: {{steps: 3, promptsPerStep: 4, samplesPerPrompt: 2, promptTokens: 16, responseTokens: {{min: 8, max: 32}}, seed: 7}}\n",
        container("train", "/scripts/trainer.py, --report, /tmp"),
        container("generate", "/scripts/engine.py, --report, /tmp, --mode, direct"),
    )
}

/// `kubectl apply` of `manifest` (the RLJob `name`); waits for Succeeded (showing the pods' logs,
/// through the kubelet, when it does not get there) and returns the job with the last state seen
/// of each of its pods (the operator deletes them once the job has finished).
async fn run_job(client: &Client, ns: &str, name: &str, manifest: &str) -> anyhow::Result<(RLJob, Vec<Pod>)> {
    let out = ok("kubectl apply", kubectl_stdin(&["apply", "-n", ns, "-f", "-"], manifest)?)?;
    println!("$ kubectl apply -f -   # {name}\n{}", out.trim());
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = ListParams::default().labels(&format!("rlplane.dev/job={name}"));
    let mut seen: BTreeMap<String, Pod> = BTreeMap::new();
    let deadline = Instant::now() + RUN;
    let finished = loop {
        for p in pods.list(&selector).await?.items {
            seen.insert(p.name_any(), p);
        }
        let job = jobs.get_opt(name).await?;
        if let Some(j) = job.filter(|j| matches!(phase_of(j), Some(Phase::Succeeded | Phase::Failed))) {
            break Ok(j);
        }
        if Instant::now() > deadline {
            break Err(anyhow::anyhow!("RLJob {name} did not finish within {RUN:?}"));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    match finished {
        Ok(j) if phase_of(&j) == Some(Phase::Succeeded) => {
            // The coordinator reported every step through the `kubernetes` Service before its
            // pod went, even when the kubelet stopped it as a sidecar.
            let step = j.status.as_ref().and_then(|s| s.step);
            assert_eq!(step, Some(j.spec.workload.steps as u64), "RLJob {name}: the last step reported");
            Ok((j, seen.into_values().collect()))
        }
        other => {
            let label = format!("rlplane.dev/job={name}");
            let (_, logs, _) = kubectl(&["logs", "-n", ns, "-l", &label, "--tail=40", "--prefix", "--all-containers"])?;
            let (_, listed, _) = kubectl(&["get", "pods", "-n", ns, "-o", "wide"])?;
            let status = other.map(|j| format!("{:?}", j.status)).unwrap_or_else(|e| format!("{e:#}"));
            bail!("RLJob {name} did not succeed: {status}\npods:\n{listed}\nlogs:\n{logs}")
        }
    }
}

/// The job's pods ran on the real node: the kubelet started their containers from `images` (the
/// runtime reports each image's digest), on addresses of the node's pod network.
fn assert_ran_as_containers(pods: &[Pod], node: &str, images: &[&str]) -> anyhow::Result<()> {
    anyhow::ensure!(!pods.is_empty(), "the job's pods were never seen");
    for p in pods {
        let spec = p.spec.as_ref().context("a pod without spec")?;
        assert_eq!(spec.node_name.as_deref(), Some(node), "pod {} ran elsewhere", p.name_any());
        let st = p.status.as_ref().context("a pod without status")?;
        let ip = st.pod_ip.as_deref().unwrap_or_default();
        assert!(ip.starts_with(POD_NETWORK), "pod {}: IP {ip:?} is not on the node's pod network", p.name_any());
        let statuses: Vec<_> = st.container_statuses.iter().flatten().collect();
        anyhow::ensure!(!statuses.is_empty(), "pod {}: no container ever started", p.name_any());
        let mut seen = Vec::new();
        for c in statuses.iter().chain(st.init_container_statuses.iter().flatten().collect::<Vec<_>>().iter()) {
            assert!(images.contains(&c.image.as_str()), "pod {} container {}: image {}", p.name_any(), c.name, c.image);
            seen.push(format!("{} ({})", c.name, c.image));
            assert!(c.image_id.contains("sha256:"), "pod {}: the runtime reported no image digest", p.name_any());
            assert!(
                c.container_id.as_deref().is_some_and(|id| id.starts_with("containerd://")),
                "pod {}",
                p.name_any()
            );
        }
        println!("  pod {} on {node}, IP {ip}, containerd containers: {}", p.name_any(), seen.join(", "));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_rljob_runs_as_real_containers_under_the_helm_installed_operator() -> anyhow::Result<()> {
    let Some(setup) = Setup::start("real-pods").await? else { return Ok(()) };
    let (worker_image, client_image) = (setup.image("rlplane-worker")?, setup.image("python-client")?);
    let (client, ns) = (&setup.client, &setup.namespace);
    let result = scenario(client, ns, &setup.node, worker_image, client_image).await;
    let _ = helm(&["uninstall", "rlplane", "-n", ns, "--wait", "--timeout", "60s"]);
    setup.cleanup().await?;
    result
}

async fn scenario(
    client: &Client,
    ns: &str,
    node: &RealNode,
    worker_image: &str,
    client_image: &str,
) -> anyhow::Result<()> {
    let chart = workspace().join("charts/rlplane");
    let started = Instant::now();
    ok(
        "helm install",
        helm(&[
            "install",
            "rlplane",
            &chart.to_string_lossy(),
            "-n",
            ns,
            "--wait",
            "--timeout",
            "180s",
            "--set",
            &format!("watchNamespace={ns}"),
            "--set",
            "image.pullPolicy=Never",
            "--set",
            "workerImage.pullPolicy=Never",
        ])?,
    )?;
    println!("$ helm install rlplane charts/rlplane: 2 operator replicas ready in {:?}", started.elapsed());
    let first = until("an operator replica leading", Duration::from_secs(60), || leader(client, ns)).await?;
    println!("leader: {first}");

    let started = Instant::now();
    let (job, pods) = run_job(client, ns, "real-cpu", &cpu_job("real-cpu")?).await?;
    let st = job.status.as_ref().context("a finished job without status")?;
    println!("RLJob real-cpu Succeeded in {:?}: step {:?}, refit {:?}", started.elapsed(), st.step, st.last_refit);
    assert_ran_as_containers(&pods, &node.name, &[worker_image])?;

    // The leader's container killed with its pod (no grace: it cannot release the Lease).
    ok("kubectl delete pod", kubectl(&["delete", "pod", "-n", ns, &first, "--grace-period=0", "--force"])?)?;
    let started = Instant::now();
    let second = until("the other replica taking the Lease over", Duration::from_secs(90), || async {
        Ok(leader(client, ns).await?.filter(|h| *h != first))
    })
    .await?;
    println!("the leader's pod killed: {second} leads after {:?}", started.elapsed());
    let (_, pods) = run_job(client, ns, "real-cpu-after-failover", &cpu_job("real-cpu-after-failover")?).await?;
    assert_ran_as_containers(&pods, &node.name, &[worker_image])?;

    // The user's trainer and engine in their own containers, the worker as their native sidecar.
    let scripts = workspace().join("python/tests/sidecar");
    let from = |f: &str| format!("--from-file={}", scripts.join(f).display());
    let args = ["create", "configmap", "sidecar-scripts", "-n", ns];
    ok(
        "kubectl create configmap",
        kubectl(&[&args[..], &[&from("launch.py"), &from("trainer.py"), &from("engine.py")]].concat())?,
    )?;
    let started = Instant::now();
    let (job, pods) = run_job(client, ns, "real-user", &user_containers_job("real-user", client_image)).await?;
    let st = job.status.as_ref().context("a finished job without status")?;
    println!("RLJob real-user Succeeded in {:?}: step {:?}, refit {:?}", started.elapsed(), st.step, st.last_refit);
    assert_ran_as_containers(&pods, &node.name, &[worker_image, client_image])?;
    for p in &pods {
        let spec = p.spec.as_ref().context("a pod without spec")?;
        let sidecar = spec.init_containers.iter().flatten().find(|c| c.name == WORKER_CONTAINER);
        assert_eq!(
            sidecar.and_then(|c| c.restart_policy.as_deref()),
            Some("Always"),
            "pod {}: the worker is a native sidecar",
            p.name_any()
        );
    }
    faults(client, ns, node, client_image).await?;
    bad_input(client, ns, client_image).await
}

/// The job's status: (phase, epoch, restarts, step).
async fn progress(jobs: &Api<RLJob>, name: &str) -> anyhow::Result<Option<(Option<Phase>, u32, u32, u64)>> {
    let j = jobs.get_opt(name).await?;
    Ok(j.map(|j| {
        let st = j.status.clone().unwrap_or_default();
        (phase_of(&j), st.epoch, st.restarts, st.step.unwrap_or(0))
    }))
}

/// Faults on real containers during one job of the user's containers: the trainer's container
/// killed by the runtime (SIGKILL through containerd), a worker pod deleted, and the operator's
/// leader pod killed while the gang restarts. Each is a gang restart with a new epoch; the job
/// still runs every step to Succeeded.
async fn faults(client: &Client, ns: &str, node: &RealNode, client_image: &str) -> anyhow::Result<()> {
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let steps = 200;
    let manifest = user_containers_job("real-faults", client_image).replace("steps: 3,", &format!("steps: {steps},"));
    ok("kubectl apply", kubectl_stdin(&["apply", "-n", ns, "-f", "-"], &manifest)?)?;
    // Pod names are the same in every epoch, and status.step keeps the last epoch's step until
    // the new gang reports: a new epoch has started running once its step differs from `after`.
    let reached = |epoch: u32, after: Option<u64>| {
        let jobs = jobs.clone();
        move || {
            let jobs = jobs.clone();
            async move {
                let p = progress(&jobs, "real-faults").await?;
                Ok(p.filter(|p| p.1 == epoch && p.3 >= 5 && after.is_none_or(|a| p.3 != a)))
            }
        }
    };

    // 1. The trainer's user container killed under the kubelet: the pod fails, the gang restarts.
    let at = until("epoch 0 running", RUN, reached(0, None)).await?;
    let trainer = pods.get("real-faults-trainer-0").await?;
    node.kill_container(&trainer, "train")?;
    println!("faults: at step {} the trainer's container was killed (SIGKILL through containerd)", at.3);

    // 2. A worker pod of the next epoch deleted.
    let at = until("epoch 1 running", RUN, reached(1, Some(at.3))).await?;
    let gen0 = pods.get("real-faults-gen-0-e1").await?;
    let epoch = gen0.labels().get("rlplane.dev/epoch").cloned();
    assert_eq!(epoch.as_deref(), Some("1"), "the pod to delete is epoch 1's");
    ok("kubectl delete pod", kubectl(&["delete", "pod", "-n", ns, "real-faults-gen-0-e1", "--wait=false"])?)?;
    println!("faults: at step {} of epoch 1 the pod real-faults-gen-0-e1 was deleted", at.3);

    // 3. The operator's leader killed while it restarts the gang.
    let leader_now = until("a leader", Duration::from_secs(30), || leader(client, ns)).await?;
    ok("kubectl delete pod", kubectl(&["delete", "pod", "-n", ns, &leader_now, "--grace-period=0", "--force"])?)?;
    println!("faults: the operator's leader {leader_now} was killed during the gang restart");

    let done = until("the job finishing", RUN, || async {
        Ok(progress(&jobs, "real-faults").await?.filter(|p| matches!(p.0, Some(Phase::Succeeded | Phase::Failed))))
    })
    .await?;
    let job = jobs.get("real-faults").await?;
    let st = job.status.as_ref().context("a status")?;
    println!("faults: {:?} after {} restarts (epoch {}), step {}", done.0, st.restarts, st.epoch, done.3);
    assert_eq!(done.0, Some(Phase::Succeeded), "{:?}", st.conditions);
    assert_eq!(st.restarts, 2, "one gang restart per fault (the operator's own restart is none)");
    assert_eq!(done.3, steps, "every step of the last epoch reported");
    Ok(())
}

/// What a user sees for two mistakes: an image the node cannot have (the gang waits, PodsReady
/// names the pod, the container and the kubelet's reason), and a user container exiting non-zero
/// (the job fails naming the container and its exit code).
async fn bad_input(client: &Client, ns: &str, client_image: &str) -> anyhow::Result<()> {
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    let missing = cpu_job("real-no-image")?.replacen(
        "  trainer:\n",
        "  trainer:\n    image: ghcr.io/rlplane/rlplane-worker:no-such-tag\n",
        1,
    );
    ok("kubectl apply", kubectl_stdin(&["apply", "-n", ns, "-f", "-"], &missing)?)?;
    let (_, _, message) =
        until("PodsReady naming the image that cannot be pulled", Duration::from_secs(60), || async {
            let j = jobs.get_opt("real-no-image").await?;
            Ok(j.as_ref()
                .and_then(|j| rlplane_e2e::condition(j, "PodsReady"))
                .filter(|(_, reason, _)| reason == "ContainersNotStarting"))
        })
        .await?;
    println!("an image that cannot be pulled: PodsReady=False ContainersNotStarting: {message}");
    assert!(message.contains("pod real-no-image-trainer-0") && message.contains("ErrImageNeverPull"), "{message}");
    assert!(message.contains("no-such-tag"), "{message}");
    ok("kubectl delete rlj", kubectl(&["delete", "rlj", "real-no-image", "-n", ns])?)?;

    let failing = user_containers_job("real-exit", client_image)
        .replace("/scripts/trainer.py, --report, /tmp", "/scripts/no-such-script.py")
        .replacen("spec:\n", "spec:\n  runPolicy: {backoffLimit: 0}\n", 1);
    ok("kubectl apply", kubectl_stdin(&["apply", "-n", ns, "-f", "-"], &failing)?)?;
    let job = until("the job failing", RUN, || async {
        Ok(jobs.get_opt("real-exit").await?.filter(|j| phase_of(j) == Some(Phase::Failed)))
    })
    .await?;
    let (_, reason, message) = rlplane_e2e::condition(&job, "Failed").context("a Failed condition")?;
    println!("a user container exiting non-zero: Failed {reason}: {message}");
    assert!(message.contains("container train exited with code 1"), "{message}");
    Ok(())
}
