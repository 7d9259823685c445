//! The job's NetworkPolicy enforced on the real node (kube-network-policies, e2e/cluster/node):
//! while a CPU job runs as real containers, three pods try to open a TCP connection to every port
//! the job's pods declare: a pod of another job in the job's namespace, a pod of another
//! namespace, and a metrics scraper (labelled as the policy's default scraper,
//! `app.kubernetes.io/name: prometheus`) in another namespace. Every connection is dropped (the
//! connect times out) except the scraper's to the metrics port, which opens — so the probes'
//! network works and the drops are the policy's. The job's own pods keep talking to each other:
//! its steps go on through the probes. The handshake test (job.rs) covers what passes the
//! policy: a peer without the epoch's key. Without KUBECONFIG, or without a real node, the test
//! says that it skipped (CI makes that an error).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use rlplane_api::{Phase, RLJob};
use rlplane_e2e::real_node::{Setup, namespace};
use rlplane_e2e::{kubectl, kubectl_stdin, phase_of, workspace};
use rlplane_operator::cluster::{OperatorProcess, operator_binary};
use serde_json::json;

/// How long a probe waits for a connection: far above a SYN's round trip on one machine, so that
/// a timeout means the SYN was dropped.
const CONNECT_TIMEOUT_S: u32 = 3;

/// A pod that tries a TCP connection to each `host:port` and prints one JSON object: target →
/// `open`, `refused` (reached, nothing listens), `timeout` (dropped) or the error.
const PROBE: &str = r#"
import json, socket, sys
out = {}
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(float(sys.argv[1]))
    try:
        s.connect((host, int(port)))
        out[target] = "open"
    except socket.timeout:
        out[target] = "timeout"
    except ConnectionRefusedError:
        out[target] = "refused"
    except OSError as e:
        out[target] = "error: %s" % e
    finally:
        s.close()
print(json.dumps(out))
"#;

/// The job's step from its status (0 before the first).
async fn step(jobs: &Api<RLJob>, name: &str) -> anyhow::Result<(Option<Phase>, u64)> {
    let j = jobs.get(name).await?;
    Ok((phase_of(&j), j.status.as_ref().and_then(|s| s.step).unwrap_or(0)))
}

/// Waits until `name` has reported step `at_least` with every pod Running with an address;
/// returns the pods.
async fn running(client: &Client, ns: &str, name: &str, at_least: u64) -> anyhow::Result<Vec<Pod>> {
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = ListParams::default().labels(&format!("rlplane.dev/job={name}"));
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let (phase, at) = step(&jobs, name).await?;
        if matches!(phase, Some(Phase::Failed | Phase::Succeeded)) {
            bail!("RLJob {name} ended ({phase:?}) before the probes ran: give it more steps");
        }
        let listed = pods.list(&selector).await?.items;
        let up = |p: &Pod| {
            let st = p.status.as_ref();
            st.and_then(|s| s.phase.as_deref()) == Some("Running") && st.and_then(|s| s.pod_ip.as_ref()).is_some()
        };
        if at >= at_least && !listed.is_empty() && listed.iter().all(up) {
            return Ok(listed);
        }
        if Instant::now() > deadline {
            let (_, out, _) = kubectl(&["get", "pods", "-n", ns, "-o", "wide"])?;
            bail!("RLJob {name} did not reach step {at_least} with its pods running (step {at}):\n{out}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Runs the probe as pod `pod` (labels `labels`) in `ns` against `targets`; returns its verdicts.
async fn probe(
    client: &Client,
    ns: &str,
    pod: &str,
    labels: BTreeMap<&str, &str>,
    image: &str,
    targets: &[String],
) -> anyhow::Result<BTreeMap<String, String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut args = vec!["python3".to_string(), "-c".into(), PROBE.into(), CONNECT_TIMEOUT_S.to_string()];
    args.extend(targets.iter().cloned());
    let manifest: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "probe", "image": image, "imagePullPolicy": "Never", "command": args}],
        },
    }))?;
    pods.create(&PostParams::default(), &manifest).await.with_context(|| format!("cannot create pod {ns}/{pod}"))?;
    let budget = Duration::from_secs(60 + u64::from(CONNECT_TIMEOUT_S) * targets.len() as u64);
    let deadline = Instant::now() + budget;
    loop {
        let p = pods.get(pod).await?;
        match p.status.as_ref().and_then(|s| s.phase.as_deref()) {
            Some("Succeeded") => break,
            Some("Failed") => {
                let (_, logs, _) = kubectl(&["logs", "-n", ns, pod])?;
                bail!("probe {ns}/{pod} failed:\n{logs}")
            }
            _ if Instant::now() > deadline => bail!("probe {ns}/{pod} did not finish within {budget:?}"),
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    let (ok, logs, err) = kubectl(&["logs", "-n", ns, pod])?;
    anyhow::ensure!(ok, "kubectl logs {ns}/{pod}: {err}");
    let verdicts: BTreeMap<String, String> =
        serde_json::from_str(logs.trim()).with_context(|| format!("probe {ns}/{pod} printed {logs:?}"))?;
    println!("probe {ns}/{pod}: {verdicts:?}");
    Ok(verdicts)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_jobs_ports_admit_only_its_own_pods_on_the_real_node() -> anyhow::Result<()> {
    let Some(setup) = Setup::start("real-netpol").await? else { return Ok(()) };
    let client_image = setup.image("python-client")?.to_string();
    let (client, ns) = (&setup.client, &setup.namespace);
    let other_ns = namespace(client, "real-netpol-other").await?;
    let binary = operator_binary(&workspace())?;
    let mut operator = OperatorProcess::start(&binary, ns, &["--image-pull-policy", "Never"])?;
    let result = scenario(client, ns, &other_ns, &client_image).await;
    operator.terminate();
    let _ = Api::<Namespace>::all(client.clone()).delete(&other_ns, &DeleteParams::background()).await;
    setup.cleanup().await?;
    result
}

async fn scenario(client: &Client, ns: &str, other_ns: &str, image: &str) -> anyhow::Result<()> {
    let name = "fenced";
    let manifest = std::fs::read_to_string(workspace().join("manifests/rljob-cpu.yaml"))?
        .replace("name: grpo-cpu\n", &format!("name: {name}\n"))
        .replace("steps: 3", "steps: 100000");
    let (ok, out, err) = kubectl_stdin(&["apply", "-n", ns, "-f", "-"], &manifest)?;
    anyhow::ensure!(ok, "kubectl apply: {err}{out}");
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    // Two steps done: the gang's pods have connected to each other under the policy.
    let pods = running(client, ns, name, 2).await?;

    let job = jobs.get(name).await?;
    let metrics_port = job.spec.observability.metrics_port as i32;
    let mut workers = Vec::new();
    let mut metrics = Vec::new();
    for p in &pods {
        let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone()).context("a running pod without an address")?;
        let containers = p.spec.as_ref().map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()));
        for port in containers.into_iter().flatten().flat_map(|c| c.ports.iter().flatten()) {
            let target = format!("{ip}:{}", port.container_port);
            if port.container_port == metrics_port { metrics.push(target) } else { workers.push(target) }
        }
    }
    anyhow::ensure!(!workers.is_empty(), "the job's pods declare no worker port");
    let targets: Vec<String> = workers.iter().chain(&metrics).cloned().collect();
    println!("job {name}: {} pods, worker ports {workers:?}, metrics {metrics:?}", pods.len());
    let before = step(&jobs, name).await?.1;

    // A pod of another job in the job's namespace, a pod in another namespace, and a metrics
    // scraper in another namespace, at once.
    let another_job = BTreeMap::from([("rlplane.dev/job", "another-job")]);
    let scraper = BTreeMap::from([("app.kubernetes.io/name", "prometheus")]);
    let (same_ns, elsewhere, scraped) = tokio::try_join!(
        probe(client, ns, "probe-another-job", another_job.clone(), image, &targets),
        probe(client, other_ns, "probe-another-namespace", another_job, image, &targets),
        probe(client, other_ns, "probe-metrics-scraper", scraper, image, &targets),
    )?;
    let verdict = |v: &BTreeMap<String, String>, t: &str| v.get(t).cloned().unwrap_or_default();
    for (from, verdicts) in [("another job's pod", &same_ns), ("another namespace's pod", &elsewhere)] {
        for t in &targets {
            assert_eq!(verdict(verdicts, t), "timeout", "{from} → {t}: dropped");
        }
    }
    for t in &workers {
        assert_eq!(verdict(&scraped, t), "timeout", "the metrics scraper → worker port {t}: dropped");
    }
    for t in &metrics {
        assert_eq!(verdict(&scraped, t), "open", "the metrics scraper → metrics port {t}: open");
    }

    // The job's own pods went on talking through the probes.
    let after = step(&jobs, name).await?;
    println!("job {name}: step {before} before the probes, {} after", after.1);
    anyhow::ensure!(after.0 == Some(Phase::Running), "RLJob {name} is {:?}, not Running", after.0);
    anyhow::ensure!(after.1 > before, "RLJob {name} made no step during the probes (step {before})");
    Ok(())
}
