//! Gang restart latency on the real node (issue 28's "restart in seconds"): a long CPU job's
//! worker container is killed through containerd, ten times; for each restart the benchmark
//! records, on this machine's clock, when the operator started the new epoch (status), when the
//! last pod of the old epoch was gone from the API server, and when every pod of the new epoch
//! was Running (which may come first: each epoch's pods have names of their own, so the new gang
//! starts while the old one terminates). It prints each restart and p50/p99, and whether the new
//! gang ran within 2 s of the old one's termination. A benchmark, not a test: it asserts no time,
//! and is ignored by default. `RLPLANE_RESTARTS=N` sets the number of restarts (10);
//! `RLPLANE_RESTART_TIMELINE=1` prints every pod's transitions during each restart.
//!
//!   export KUBECONFIG=$(e2e/cluster/up)
//!   cargo test -p rlplane-e2e --test restart_latency -- --ignored --nocapture

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use rlplane_api::RLJob;
use rlplane_e2e::real_node::{RealNode, Setup};
use rlplane_e2e::{epoch_of, kubectl_stdin, workspace};
use rlplane_operator::cluster::{OperatorProcess, operator_binary};
use rlplane_operator::desired::{WORKER_CONTAINER, labels};

/// How many restarts to measure: `RLPLANE_RESTARTS`, 10 by default.
fn restarts() -> usize {
    std::env::var("RLPLANE_RESTARTS").ok().and_then(|v| v.parse().ok()).unwrap_or(10)
}
const JOB: &str = "restarts";

/// One restart, in seconds after the kill.
struct Round {
    new_epoch: f64,
    old_gone: f64,
    new_running: f64,
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The pods of the job at `epoch`.
fn of_epoch(pods: &[Pod], epoch: u32) -> Vec<&Pod> {
    let e = epoch.to_string();
    pods.iter().filter(|p| p.labels().get(labels::EPOCH) == Some(&e)).collect()
}

fn running(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none() && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// What the pod watch saw, per pod: each new state (phase, node, deletion) at the first instant.
type Timeline = Arc<Mutex<Vec<(Instant, String, String)>>>;

fn pod_state(p: &Pod) -> String {
    let s = p.status.as_ref();
    let conds: Vec<String> = s
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|c| c.status == "True")
        .map(|c| c.type_)
        .collect();
    format!(
        "{} node={} deleting={} [{}]",
        s.and_then(|s| s.phase.clone()).unwrap_or_default(),
        p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default(),
        p.metadata.deletion_timestamp.is_some(),
        conds.join(",")
    )
}

fn watch_pods(pods: Api<Pod>, timeline: Timeline) {
    tokio::spawn(async move {
        let mut last: BTreeMap<String, String> = BTreeMap::new();
        let mut stream = watcher(pods, watcher::Config::default()).boxed();
        while let Some(ev) = stream.next().await {
            let now = Instant::now();
            let (objs, gone): (Vec<Pod>, bool) = match ev {
                Ok(watcher::Event::Apply(p)) | Ok(watcher::Event::InitApply(p)) => (vec![p], false),
                Ok(watcher::Event::Delete(p)) => (vec![p], true),
                _ => continue,
            };
            for p in objs {
                let key = format!("{}@{}", p.name_any(), p.labels().get(labels::EPOCH).cloned().unwrap_or_default());
                let state = if gone { "GONE".to_string() } else { pod_state(&p) };
                if last.get(&key) != Some(&state) {
                    last.insert(key.clone(), state.clone());
                    timeline.lock().unwrap().push((now, key, state));
                }
            }
        }
    });
}

/// Measures one restart: kills the gang's trainer at `epoch` and watches the next epoch come up.
async fn restart_once(
    node: &RealNode,
    jobs: &Api<RLJob>,
    pods: &Api<Pod>,
    epoch: u32,
    timeline: &Timeline,
) -> anyhow::Result<Round> {
    let listed = pods.list(&ListParams::default()).await?.items;
    let trainer = of_epoch(&listed, epoch)
        .into_iter()
        .find(|p| p.labels().get(labels::ROLE).map(String::as_str) == Some("trainer"))
        .context("no trainer pod")?
        .clone();
    let n = of_epoch(&listed, epoch).len();
    let killed = Instant::now();
    timeline.lock().unwrap().clear();
    node.kill_container(&trainer, WORKER_CONTAINER)?;
    let (mut new_epoch, mut old_gone, mut new_running) = (None, None, None);
    let deadline = killed + Duration::from_secs(120);
    loop {
        let since = killed.elapsed().as_secs_f64();
        if new_epoch.is_none() && jobs.get(JOB).await.map(|j| epoch_of(&j) > epoch)? {
            new_epoch = Some(since);
        }
        let listed = pods.list(&ListParams::default()).await?.items;
        if old_gone.is_none() && new_epoch.is_some() && of_epoch(&listed, epoch).is_empty() {
            old_gone = Some(since);
        }
        let next = of_epoch(&listed, epoch + 1);
        if new_running.is_none() && next.len() == n && next.iter().all(|p| running(p)) {
            new_running = Some(since);
        }
        if let (Some(new_epoch), Some(old_gone), Some(new_running)) = (new_epoch, old_gone, new_running) {
            if std::env::var("RLPLANE_RESTART_TIMELINE").as_deref() == Ok("1") {
                for (t, pod, state) in timeline.lock().unwrap().iter().filter(|(t, ..)| *t >= killed) {
                    println!("  {:6.2} s  {pod}: {state}", t.duration_since(killed).as_secs_f64());
                }
            }
            return Ok(Round { new_epoch, old_gone, new_running });
        }
        if Instant::now() > deadline {
            bail!("epoch {} did not come up within 120 s of the kill", epoch + 1);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: cargo test -p rlplane-e2e --test restart_latency -- --ignored --nocapture"]
async fn gang_restart_latency_on_the_real_node() -> anyhow::Result<()> {
    let Some(setup) = Setup::start("restarts").await? else { return Ok(()) };
    let binary = operator_binary(&workspace())?;
    let mut operator = OperatorProcess::start(&binary, &setup.namespace, &["--image-pull-policy", "Never"])?;
    let result = measure(&setup.client, &setup.namespace, &setup.node).await;
    operator.terminate();
    setup.cleanup().await?;
    result
}

async fn measure(client: &Client, ns: &str, node: &RealNode) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(workspace().join("manifests/rljob-cpu.yaml"))?;
    let text = text.replace("name: grpo-cpu\n", &format!("name: {JOB}\n")).replace("steps: 3", "steps: 1000000");
    let text = text.replacen("spec:\n", &format!("spec:\n  runPolicy: {{backoffLimit: {}}}\n", restarts() + 1), 1);
    let (applied, _, err) = kubectl_stdin(&["apply", "-n", ns, "-f", "-"], &text)?;
    anyhow::ensure!(applied, "kubectl apply: {err}");
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut rounds = Vec::new();
    let timeline: Timeline = Arc::default();
    watch_pods(pods.clone(), timeline.clone());
    for epoch in 0..restarts() as u32 {
        // The gang of this epoch running and stepping.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let j = jobs.get(JOB).await?;
            if epoch_of(&j) == epoch && j.status.as_ref().and_then(|s| s.step).unwrap_or(0) >= 1 {
                let listed = pods.list(&ListParams::default()).await?.items;
                if of_epoch(&listed, epoch).iter().all(|p| running(p)) {
                    break;
                }
            }
            anyhow::ensure!(Instant::now() < deadline, "epoch {epoch} did not start stepping within 120 s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let r = restart_once(node, &jobs, &pods, epoch, &timeline).await?;
        println!(
            "restart {}: new epoch in status {:.2} s, old pods gone {:.2} s, every new pod Running {:.2} s after the kill ({:+.2} s after the old pods went)",
            epoch + 1,
            r.new_epoch,
            r.old_gone,
            r.new_running,
            r.new_running - r.old_gone
        );
        rounds.push(r);
    }
    let col = |f: fn(&Round) -> f64| rounds.iter().map(f).collect::<Vec<_>>();
    for (what, v) in [
        ("kill → new epoch in status", col(|r| r.new_epoch)),
        ("kill → old pods gone", col(|r| r.old_gone)),
        ("kill → every new pod Running", col(|r| r.new_running)),
        ("old pods gone → every new pod Running", col(|r| r.new_running - r.old_gone)),
    ] {
        println!(
            "{what}: p50 {:.2} s, p99 {:.2} s over {} restarts",
            percentile(v.clone(), 0.5),
            percentile(v, 0.99),
            rounds.len()
        );
    }
    let met = rounds.iter().filter(|r| r.new_running - r.old_gone <= 2.0).count();
    println!("the new gang Running within 2 s of the old one's termination: {met}/{} restarts", rounds.len());
    Ok(())
}
