//! `rlplane-operator bench`: against the cluster `KUBECONFIG` names, (1) the time from applying a
//! 64-pod RLJob to all of its objects existing (target < 1 s) and (2) the operator's RSS with 100
//! RLJobs alive (target < 40 MB). Skipped, successfully, when `KUBECONFIG` is unset.
//!
//! The operator under test is a separate process (this binary's `run`, or `--operator-bin`), so
//! its RSS is its own. Pods get a node selector no node has: they stay Pending, nothing is pulled
//! or run, and the benchmark measures the operator, not the kubelet.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use rlplane_api::RLJob;
use rlplane_api::topology::{headless_service_name, plan_config_map_name};

use crate::cluster::{Memory, OperatorProcess, TOOL_FIELD_MANAGER, ensure_namespace, install_crd, no_cluster_reason};
use crate::conditions;
use crate::desired::{labels, worker_service_account_name};

/// Options of `rlplane-operator bench`.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Namespace of the benchmark's RLJobs.
    pub namespace: String,
    /// Pods of the latency job.
    pub pods: u32,
    /// RLJobs alive while the RSS is measured.
    pub jobs: u32,
    /// Latency measurements.
    pub rounds: u32,
    /// Operator binary (None: this executable).
    pub operator_bin: Option<PathBuf>,
    /// Keep the namespace afterwards.
    pub keep: bool,
}

/// Node label no node carries: benchmark pods stay Pending.
pub const UNSCHEDULABLE_LABEL: (&str, &str) = ("rlplane.dev/benchmark-node", "none");

/// An RLJob of `pods` pods on CPUs (half trainer, half generation, one rank each), whose pods can
/// never be scheduled. `pods` must be even and at least 2.
pub fn gang_job(name: &str, namespace: &str, pods: u32) -> anyhow::Result<RLJob> {
    if pods < 2 || !pods.is_multiple_of(2) {
        bail!("--pods must be even and at least 2 (half trainer, half generation pods); got {pods}");
    }
    let half = pods / 2;
    let selector = serde_json::json!({ UNSCHEDULABLE_LABEL.0: UNSCHEDULABLE_LABEL.1 });
    let job = serde_json::json!({
        "apiVersion": "rlplane.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": { "name": name, "namespace": namespace },
        "spec": {
            "mode": "Split",
            "device": "Cpu",
            "model": { "preset": "tiny" },
            "trainer": { "nodes": half, "gpusPerNode": 1, "parallelism": { "data": half }, "nodeSelector": selector },
            "generation": { "engines": half, "tensorParallel": 1, "nodeSelector": selector },
            "refit": { "transport": "Tcp" },
            "workload": { "promptsPerStep": half, "samplesPerPrompt": 4 },
        }
    });
    Ok(serde_json::from_value(job)?)
}

/// Prints that the benchmark was skipped, and why; true when it was.
fn skipped() -> bool {
    match no_cluster_reason() {
        Some(why) => {
            println!("rlplane-operator bench: skipped: {why}; point KUBECONFIG at a cluster (kind, k3d) to measure");
            true
        }
        None => false,
    }
}

/// Runs the benchmark against the cluster KUBECONFIG names and prints a report.
pub async fn cluster(opts: &BenchOptions) -> anyhow::Result<()> {
    if skipped() {
        return Ok(());
    }
    let client = Client::try_default().await.context("cannot build a client from KUBECONFIG")?;
    let version = client.apiserver_version().await.context("cannot reach the API server KUBECONFIG names")?;
    install_crd(&client).await?;
    ensure_namespace(&client, &opts.namespace).await?;
    let binary = match &opts.operator_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("cannot find this executable; pass --operator-bin")?,
    };
    let mut operator = OperatorProcess::start(&binary, &opts.namespace, &["--leader-election=false"])?;
    let idle = operator.memory();

    let result = measure(&client, opts, &operator).await;
    let clean_exit = operator.terminate();
    if !opts.keep {
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let _ = namespaces.delete(&opts.namespace, &DeleteParams::background()).await;
    }
    let (latencies, loaded, create_all) = result?;

    let mut sorted = latencies.clone();
    sorted.sort();
    let median = sorted[sorted.len() / 2];
    let max = sorted[sorted.len() - 1];
    let mb = |m: Option<Memory>, f: fn(Memory) -> u64| {
        m.map(|m| format!("{:.1} MB", f(m) as f64 / 1e6)).unwrap_or("n/a".into())
    };
    println!("rlplane-operator bench against Kubernetes {}", version.git_version);
    println!("| measurement | result | target |");
    println!("| --- | --- | --- |");
    println!(
        "| {}-pod RLJob applied → all objects exist ({} rounds) | median {:.0} ms, max {:.0} ms | < 1000 ms |",
        opts.pods,
        latencies.len(),
        median.as_secs_f64() * 1e3,
        max.as_secs_f64() * 1e3
    );
    println!("| operator RSS, idle | {} | |", mb(idle, |m| m.rss));
    println!(
        "| operator RSS with {} RLJobs ({} pods) | {} (peak {}) | < 40 MB |",
        opts.jobs,
        opts.jobs * 3,
        mb(loaded, |m| m.rss),
        mb(loaded, |m| m.peak)
    );
    println!("| time until all {} RLJobs had their pods | {:.1} s | |", opts.jobs, create_all.as_secs_f64());
    println!("| graceful exit on SIGTERM | {} | |", if clean_exit { "yes" } else { "no" });
    Ok(())
}

async fn measure(
    client: &Client,
    opts: &BenchOptions,
    operator: &OperatorProcess,
) -> anyhow::Result<(Vec<Duration>, Option<Memory>, Duration)> {
    let ns = &opts.namespace;
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    let pp = PatchParams::apply(TOOL_FIELD_MANAGER).force();

    let mut latencies = Vec::new();
    for round in 0..opts.rounds {
        let name = format!("bench-gang-{round}");
        let job = gang_job(&name, ns, opts.pods)?;
        let elapsed = time_until_objects_exist(client, ns, &name, opts.pods, async {
            jobs.patch(&name, &pp, &Patch::Apply(&job)).await.map(|_| ())
        })
        .await?;
        eprintln!("round {round}: {} pods and their objects after {:.0} ms", opts.pods, elapsed.as_secs_f64() * 1e3);
        latencies.push(elapsed);
        jobs.delete(&name, &DeleteParams::background()).await?;
        wait_for_no_pods(client, ns, &name).await?;
    }

    // RSS with many small jobs (3 pods each, like manifests/rljob-cpu.yaml).
    let started = Instant::now();
    for i in 0..opts.jobs {
        let name = format!("bench-rss-{i}");
        let mut job = gang_job(&name, ns, 2)?;
        job.spec.generation.engines = 2;
        jobs.patch(&name, &pp, &Patch::Apply(&job)).await.with_context(|| format!("cannot apply RLJob {name}"))?;
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let list = jobs.list(&ListParams::default()).await?;
        let created = list
            .items
            .iter()
            .filter(|j| j.name_any().starts_with("bench-rss-"))
            .filter(|j| j.status.as_ref().is_some_and(|s| conditions::is_true(&s.conditions, conditions::PODS_CREATED)))
            .count();
        if created as u32 >= opts.jobs {
            break;
        }
        if Instant::now() > deadline {
            bail!("only {created} of {} RLJobs had their pods after 300 s", opts.jobs);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let create_all = started.elapsed();
    // Let the watches settle and sample for a while: the figure is the largest RSS seen.
    let mut loaded: Option<Memory> = None;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Some(m) = operator.memory() {
            loaded = Some(match loaded {
                Some(l) => Memory { rss: l.rss.max(m.rss), peak: l.peak.max(m.peak) },
                None => m,
            });
        }
    }
    Ok((latencies, loaded, create_all))
}

/// Runs `apply` and returns the time until the job's `pods` pods, Service, ConfigMap,
/// ServiceAccount, Role and RoleBinding all exist. Pods are watched (the watch starts before the
/// apply), the other objects checked once the pods are there: the operator creates them first.
async fn time_until_objects_exist(
    client: &Client,
    ns: &str,
    name: &str,
    pods: u32,
    apply: impl Future<Output = Result<(), kube::Error>>,
) -> anyhow::Result<Duration> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let wc = watcher::Config::default().labels(&format!("{}={name}", labels::JOB));
    let mut stream = watcher::watcher(api, wc).boxed();
    // Wait for the initial list to finish, so that no pod can be missed.
    while let Some(ev) = stream.next().await {
        if matches!(ev?, Event::InitDone) {
            break;
        }
    }
    let started = Instant::now();
    apply.await.with_context(|| format!("cannot apply RLJob {name}"))?;
    let mut seen = BTreeSet::new();
    let deadline = Duration::from_secs(120);
    while (seen.len() as u32) < pods {
        let next = tokio::time::timeout(deadline.saturating_sub(started.elapsed()), stream.next())
            .await
            .with_context(|| format!("only {} of {pods} pods of {name} appeared within 120 s", seen.len()))?;
        match next {
            Some(Ok(Event::Apply(p) | Event::InitApply(p))) => {
                seen.insert(p.name_any());
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.into()),
            None => bail!("the pod watch ended"),
        }
    }
    let pods_at = started.elapsed();
    let worker = worker_service_account_name(name);
    let exist = [
        Api::<Service>::namespaced(client.clone(), ns).get_opt(&headless_service_name(name)).await?.is_some(),
        Api::<ConfigMap>::namespaced(client.clone(), ns).get_opt(&plan_config_map_name(name)).await?.is_some(),
        Api::<ServiceAccount>::namespaced(client.clone(), ns).get_opt(&worker).await?.is_some(),
        Api::<Role>::namespaced(client.clone(), ns).get_opt(&worker).await?.is_some(),
        Api::<RoleBinding>::namespaced(client.clone(), ns).get_opt(&worker).await?.is_some(),
    ];
    if exist.iter().any(|e| !e) {
        bail!("the pods of {name} exist but not all of its Service, ConfigMap, ServiceAccount, Role, RoleBinding");
    }
    Ok(pods_at)
}

async fn wait_for_no_pods(client: &Client, ns: &str, name: &str) -> anyhow::Result<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&format!("{}={name}", labels::JOB));
    let deadline = Instant::now() + Duration::from_secs(120);
    while !api.list(&lp).await?.items.is_empty() {
        if Instant::now() > deadline {
            bail!("the pods of {name} were not garbage-collected within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}
