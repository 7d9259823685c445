//! `rlplane-operator bench`: against the cluster `KUBECONFIG` names, (1) the time from applying a
//! 64-pod RLJob to all of its objects existing (target < 1 s) and, with `--schedule`, to all of
//! its pods bound to nodes by the scheduler; (2) the API requests one reconcile costs at steady
//! state, for a small and a large job, read from the API server's own `apiserver_request_total`;
//! (3) the operator's RSS with 100 RLJobs alive (target < 40 MB). Skipped, successfully, when
//! `KUBECONFIG` is unset.
//!
//! The operator under test is a separate process (this binary's `run`, or `--operator-bin`), so
//! its RSS is its own. Pods get a node selector no node has (unless `--schedule`): they stay
//! Pending, nothing is pulled or run, and the benchmark measures the operator, not the kubelet.
//!
//! Requests per reconcile: the API server counts requests by verb and resource, not by client, so
//! the benchmark counts them twice over windows of equal length — once while it makes the
//! operator reconcile a job N times (a metadata-only touch of the RLJob each time, which changes
//! nothing the operator decides on), once idle — and divides the difference by the reconciles the
//! operator's own `rlplane_operator_reconcile_total` counted. The scheduler's and controllers'
//! background requests fall out in the difference.

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
    /// Let the latency job's pods be scheduled (the cluster needs room for them), and time until
    /// the scheduler bound them all.
    pub schedule: bool,
}

/// Node label no node carries: benchmark pods stay Pending.
pub const UNSCHEDULABLE_LABEL: (&str, &str) = ("rlplane.dev/benchmark-node", "none");

/// An RLJob of `pods` pods on CPUs (half trainer, half generation, one rank each), whose pods can
/// never be scheduled unless `schedulable`. `pods` must be even and at least 2.
pub fn gang_job(name: &str, namespace: &str, pods: u32, schedulable: bool) -> anyhow::Result<RLJob> {
    if pods < 2 || !pods.is_multiple_of(2) {
        bail!("--pods must be even and at least 2 (half trainer, half generation pods); got {pods}");
    }
    let half = pods / 2;
    let selector = if schedulable {
        serde_json::json!({})
    } else {
        serde_json::json!({ UNSCHEDULABLE_LABEL.0: UNSCHEDULABLE_LABEL.1 })
    };
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
    let report = result?;

    let stats = |v: &[Duration]| {
        let mut sorted = v.to_vec();
        sorted.sort();
        (sorted[sorted.len() / 2].as_secs_f64() * 1e3, sorted[sorted.len() - 1].as_secs_f64() * 1e3)
    };
    let mb = |m: Option<Memory>, f: fn(Memory) -> u64| {
        m.map(|m| format!("{:.1} MB", f(m) as f64 / 1e6)).unwrap_or("n/a".into())
    };
    println!("rlplane-operator bench against Kubernetes {}", version.git_version);
    println!("| measurement | result | target |");
    println!("| --- | --- | --- |");
    let (median, max) = stats(&report.objects);
    println!(
        "| {}-pod RLJob applied → all objects exist ({} rounds) | median {median:.0} ms, max {max:.0} ms | < 1000 ms |",
        opts.pods,
        report.objects.len(),
    );
    if !report.bound.is_empty() {
        let (median, max) = stats(&report.bound);
        println!(
            "| {}-pod RLJob applied → all pods bound by the scheduler | median {median:.0} ms, max {max:.0} ms | |",
            opts.pods
        );
    }
    for r in &report.requests {
        println!(
            "| API requests per reconcile at steady state, {}-pod RLJob ({} reconciles) | {:.1} reads, {:.1} writes \
             ({:.1} of them to pods): {} | pod writes 0 |",
            r.pods, r.reconciles, r.reads, r.writes, r.pod_writes, r.by_kind,
        );
    }
    println!("| operator RSS, idle | {} | |", mb(idle, |m| m.rss));
    println!(
        "| operator RSS with {} RLJobs ({} pods) | {} (peak {}) | < 40 MB |",
        opts.jobs,
        opts.jobs * 3,
        mb(report.loaded, |m| m.rss),
        mb(report.loaded, |m| m.peak)
    );
    println!("| time until all {} RLJobs had their pods | {:.1} s | |", opts.jobs, report.create_all.as_secs_f64());
    println!("| graceful exit on SIGTERM | {} | |", if clean_exit { "yes" } else { "no" });
    Ok(())
}

/// What [`measure`] found.
struct Report {
    /// Apply → every object exists, per round.
    objects: Vec<Duration>,
    /// Apply → every pod bound to a node, per round (with `--schedule`).
    bound: Vec<Duration>,
    /// API requests per reconcile, per job size.
    requests: Vec<RequestsPerReconcile>,
    /// The operator's largest RSS with `--jobs` RLJobs alive.
    loaded: Option<Memory>,
    /// Apply of the first → the last of those RLJobs had its pods.
    create_all: Duration,
}

/// The API requests one reconcile of a job of `pods` pods costs, at steady state.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestsPerReconcile {
    /// Pods of the job.
    pub pods: u32,
    /// Reconciles counted (the operator's own counter).
    pub reconciles: u64,
    /// GET and LIST requests per reconcile.
    pub reads: f64,
    /// Writes (POST, PUT, PATCH, DELETE) per reconcile.
    pub writes: f64,
    /// Writes to pods per reconcile (a reconcile that changes nothing makes none).
    pub pod_writes: f64,
    /// Every verb and resource with at least 0.5 requests per reconcile, e.g. `PATCH
    /// configmaps 1.0`.
    pub by_kind: String,
}

/// `apiserver_request_total` summed by (verb, resource[/subresource]), WATCH requests left out
/// (they are long-running; a reconcile opens none).
pub fn request_counts(metrics: &str) -> std::collections::BTreeMap<(String, String), f64> {
    let mut counts = std::collections::BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else { continue };
        let Some((labels, value)) = rest.rsplit_once("} ") else { continue };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        let label = |key: &str| {
            labels
                .split("\",")
                .find_map(|kv| kv.strip_prefix(&format!("{key}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let verb = label("verb");
        if verb == "WATCH" || verb == "CONNECT" {
            continue;
        }
        let (resource, sub) = (label("resource"), label("subresource"));
        let resource = if sub.is_empty() { resource } else { format!("{resource}/{sub}") };
        *counts.entry((verb, resource)).or_insert(0.0) += value;
    }
    counts
}

/// The API server's request counters now.
async fn server_requests(client: &Client) -> anyhow::Result<std::collections::BTreeMap<(String, String), f64>> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(req).await.context("cannot read the API server's /metrics (needs GET /metrics)")?;
    Ok(request_counts(&text))
}

/// The operator's reconcile counter now.
fn reconciles(operator: &OperatorProcess) -> anyhow::Result<u64> {
    let m = operator.metrics()?;
    m.lines()
        .find_map(|l| l.strip_prefix("rlplane_operator_reconcile_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .context("the operator's /metrics has no rlplane_operator_reconcile_total")
}

/// Requests per reconcile of a `pods`-pod job: `touches` metadata-only edits of the RLJob (each
/// makes the operator reconcile once), against an idle window of the same length.
async fn requests_per_reconcile(
    client: &Client,
    ns: &str,
    operator: &OperatorProcess,
    pods: u32,
    touches: u32,
) -> anyhow::Result<RequestsPerReconcile> {
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    let name = format!("bench-requests-{pods}");
    let job = gang_job(&name, ns, pods, false)?;
    let pp = PatchParams::apply(TOOL_FIELD_MANAGER).force();
    time_until_objects_exist(client, ns, &name, pods, false, async {
        jobs.patch(&name, &pp, &Patch::Apply(&job)).await.map(|_| ())
    })
    .await?;
    // Settle: the creation's own reconciles (status, Events) finish.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let gap = Duration::from_millis(400);
    let window = gap * touches;

    let idle_before = server_requests(client).await?;
    tokio::time::sleep(window).await;
    let idle_after = server_requests(client).await?;

    let before = server_requests(client).await?;
    let reconciles_before = reconciles(operator)?;
    for i in 0..touches {
        let touch = serde_json::json!({"metadata": {"annotations": {"rlplane.dev/bench-touch": i.to_string()}}});
        jobs.patch(&name, &PatchParams::default(), &Patch::Merge(&touch)).await?;
        tokio::time::sleep(gap).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = server_requests(client).await?;
    let reconciled = reconciles(operator)? - reconciles_before;
    jobs.delete(&name, &DeleteParams::background()).await?;
    wait_for_no_pods(client, ns, &name).await?;
    if reconciled == 0 {
        bail!("the operator did not reconcile {name} when it was touched");
    }

    let delta =
        |a: &std::collections::BTreeMap<(String, String), f64>,
         b: &std::collections::BTreeMap<(String, String), f64>,
         k: &(String, String)| b.get(k).copied().unwrap_or(0.0) - a.get(k).copied().unwrap_or(0.0);
    let mut per = std::collections::BTreeMap::new();
    for k in after.keys() {
        let mut n = delta(&before, &after, k) - delta(&idle_before, &idle_after, k);
        // The benchmark's own touches and its two reads of /metrics are not the operator's.
        if k.0 == "PATCH" && k.1 == "rljobs" {
            n -= touches as f64;
        }
        let n = n / reconciled as f64;
        if n.abs() >= 0.05 {
            per.insert(k.clone(), n);
        }
    }
    let is_read = |v: &str| v == "GET" || v == "LIST";
    // Sums over kinds, never below 0 (the idle window's noise can exceed a kind's own count).
    let sum = |keep: &dyn Fn(&(String, String)) -> bool| -> f64 {
        per.iter().filter(|(k, _)| keep(k)).map(|(_, n)| *n).sum::<f64>().max(0.0)
    };
    let reads = sum(&|k| is_read(&k.0));
    let writes = sum(&|k| !is_read(&k.0));
    let pod_writes = sum(&|k| !is_read(&k.0) && k.1.starts_with("pods"));
    let by_kind = per
        .iter()
        .filter(|(_, n)| **n >= 0.5)
        .map(|((verb, res), n)| format!("{verb} {res} {n:.1}"))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(RequestsPerReconcile { pods, reconciles: reconciled, reads, writes, pod_writes, by_kind })
}

async fn measure(client: &Client, opts: &BenchOptions, operator: &OperatorProcess) -> anyhow::Result<Report> {
    let ns = &opts.namespace;
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    let pp = PatchParams::apply(TOOL_FIELD_MANAGER).force();

    let (mut objects, mut bound) = (Vec::new(), Vec::new());
    for round in 0..opts.rounds {
        let name = format!("bench-gang-{round}");
        let job = gang_job(&name, ns, opts.pods, opts.schedule)?;
        let (objects_at, bound_at) = time_until_objects_exist(client, ns, &name, opts.pods, opts.schedule, async {
            jobs.patch(&name, &pp, &Patch::Apply(&job)).await.map(|_| ())
        })
        .await?;
        eprintln!(
            "round {round}: {} pods and their objects after {:.0} ms{}",
            opts.pods,
            objects_at.as_secs_f64() * 1e3,
            bound_at.map(|b| format!(", all bound after {:.0} ms", b.as_secs_f64() * 1e3)).unwrap_or_default()
        );
        objects.push(objects_at);
        bound.extend(bound_at);
        jobs.delete(&name, &DeleteParams::background()).await?;
        wait_for_no_pods(client, ns, &name).await?;
    }

    let mut requests = Vec::new();
    for pods in [8, opts.pods.max(8)] {
        let r = requests_per_reconcile(client, ns, operator, pods, 20).await?;
        eprintln!("{r:?}");
        requests.push(r);
        if opts.pods <= 8 {
            break;
        }
    }

    // RSS with many small jobs (3 pods each, like manifests/rljob-cpu.yaml).
    let started = Instant::now();
    for i in 0..opts.jobs {
        let name = format!("bench-rss-{i}");
        let mut job = gang_job(&name, ns, 2, false)?;
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
    Ok(Report { objects, bound, requests, loaded, create_all })
}

/// Runs `apply` and returns the time until the job's `pods` pods, Service, ConfigMap,
/// ServiceAccount, Role and RoleBinding all exist and, with `bind`, the time until the scheduler
/// bound every pod to a node. Pods are watched (the watch starts before the apply), the other
/// objects checked once the pods are there: the operator creates them first.
async fn time_until_objects_exist(
    client: &Client,
    ns: &str,
    name: &str,
    pods: u32,
    bind: bool,
    apply: impl Future<Output = Result<(), kube::Error>>,
) -> anyhow::Result<(Duration, Option<Duration>)> {
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
    let (mut seen, mut placed) = (BTreeSet::new(), BTreeSet::new());
    let (mut pods_at, mut bound_at) = (None, None);
    let deadline = Duration::from_secs(120);
    while pods_at.is_none() || (bind && bound_at.is_none()) {
        let next = tokio::time::timeout(deadline.saturating_sub(started.elapsed()), stream.next()).await.with_context(
            || format!("only {} of {pods} pods of {name} appeared ({} bound) within 120 s", seen.len(), placed.len()),
        )?;
        match next {
            Some(Ok(Event::Apply(p) | Event::InitApply(p))) => {
                if p.spec.as_ref().is_some_and(|s| s.node_name.is_some()) {
                    placed.insert(p.name_any());
                }
                seen.insert(p.name_any());
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.into()),
            None => bail!("the pod watch ended"),
        }
        if pods_at.is_none() && seen.len() as u32 >= pods {
            pods_at = Some(started.elapsed());
        }
        if bound_at.is_none() && placed.len() as u32 >= pods {
            bound_at = Some(started.elapsed());
        }
    }
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
    Ok((pods_at.unwrap_or_default(), if bind { bound_at } else { None }))
}

/// Waits until the job's pods are gone. Pods bound to a node wait for its kubelet to confirm
/// their containers stopped; where no kubelet runs them (a control plane without kubelets, or
/// nodes that never started them), terminating pods are deleted for good, as a kubelet would.
async fn wait_for_no_pods(client: &Client, ns: &str, name: &str) -> anyhow::Result<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&format!("{}={name}", labels::JOB));
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = api.list(&lp).await?.items;
        if left.is_empty() {
            break;
        }
        for p in left.iter().filter(|p| p.metadata.deletion_timestamp.is_some()) {
            let mut dp = DeleteParams::default().grace_period(0);
            dp.preconditions = Some(kube::api::Preconditions { uid: p.uid(), resource_version: None });
            let _ = api.delete(&p.name_any(), &dp).await;
        }
        if Instant::now() > deadline {
            bail!("the pods of {name} were not garbage-collected within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}
