//! The whole job through the real cluster: an RLJob applied with `kubectl`, reconciled by the real
//! operator into pods the real scheduler places, run by the real worker (`rlplane worker`) as
//! containers on the test cluster's real node (or, without one, started by the e2e node agent
//! from the pods' own command, env, volumes and ServiceAccount token; the tiny-grpo test always
//! uses the agent: its containers need PyTorch, which the suite's images leave out), with
//! the coordinator reporting STEP and REFIT into the RLJob's status with the per-job worker
//! account's token; a worker killed mid-job and the gang restarted with a new epoch that refuses a
//! process of the old one; the workers' `/metrics` scraped by a real Prometheus through the chart's
//! PodMonitor (its selector, port and relabelling turned into Prometheus relabel rules as
//! prometheus-operator does, over pod targets discovered from the API server), and the dashboard's
//! refit and queue panels answered for the job.
//! Without KUBECONFIG every test prints that it skipped and passes (CI makes that an error).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kube::ResourceExt;
use rlplane_api::{Phase, RLJob};
use rlplane_e2e::jobs::{Cluster, RUN};
use rlplane_e2e::{
    Env, cluster_tool, epoch_of, helm, kubectl, kubectl_stdin, phase_of, service_account_token, worker_binary,
    workspace,
};
use rlplane_operator::cluster::http_get;

/// `kubectl get rlj -w` in the background: what a user watching the job sees.
struct Watch(Child, PathBuf);

impl Watch {
    fn start(ns: &str, dir: &Path) -> anyhow::Result<Watch> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("kubectl-get-rlj-w.txt");
        let out = std::fs::File::create(&path)?;
        let child = Command::new(cluster_tool("kubectl"))
            .args(["get", "rlj", "-n", ns, "-w"])
            .stdout(out)
            .stderr(Stdio::null())
            .spawn()
            .context("cannot run kubectl get rlj -w")?;
        Ok(Watch(child, path))
    }

    /// Stops once the last row of `name` shows `text` — kubectl prints a watch event a moment
    /// after the API server has it, so stopping as soon as the API shows a phase can cut its row
    /// off — or after `within`.
    async fn stop_after(self, name: &str, text: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            let table = std::fs::read_to_string(&self.1).unwrap_or_default();
            if table.lines().rfind(|l| l.starts_with(name)).is_some_and(|r| r.contains(text)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.stop()
    }

    fn stop(mut self) -> String {
        let _ = self.0.kill();
        let _ = self.0.wait();
        std::fs::read_to_string(&self.1).unwrap_or_default()
    }
}

/// The steps and refit versions the job's status went through, polled while `until` is false.
async fn record_progress(env: &Env, job: &str, until: impl Fn(&RLJob) -> bool) -> anyhow::Result<Vec<(u64, u64)>> {
    let mut seen: Vec<(u64, u64)> = Vec::new();
    let deadline = Instant::now() + RUN;
    loop {
        if let Some(j) = env.jobs().get_opt(job).await?
            && let Some(st) = &j.status
        {
            if let (Some(step), Some(refit)) = (st.step, st.last_refit.as_ref()) {
                let now = (step, refit.version);
                if seen.last() != Some(&now) {
                    seen.push(now);
                }
            }
            if until(&j) {
                return Ok(seen);
            }
        }
        if Instant::now() > deadline {
            bail!("RLJob {job} did not finish within {RUN:?}; progress seen: {seen:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Who wrote `status.step`: the field manager of the status subresource that owns it.
fn status_step_manager(job: &RLJob) -> Option<String> {
    job.metadata.managed_fields.iter().flatten().find_map(|m| {
        let owns_step = m.subresource.as_deref() == Some("status")
            && m.fields_v1.as_ref().is_some_and(|f| f.0.get("f:status").and_then(|s| s.get("f:step")).is_some());
        owns_step.then(|| m.manager.clone()).flatten()
    })
}

async fn runs_to_succeeded(file: &str) -> anyhow::Result<()> {
    let Some(c) =
        Cluster::start(&format!("job-{}", file.trim_end_matches(".yaml").trim_start_matches("rljob-"))).await?
    else {
        return Ok(());
    };
    let ns = c.env.namespace.clone();
    let watch = Watch::start(&ns, &c.dir)?;
    let name = c.apply(file, |t| t)?;

    let progress = record_progress(&c.env, &name, |j| phase_of(j).is_some_and(|p| p.is_finished())).await?;
    let job = c.wait(&name, "Succeeded", |j| phase_of(j) == Some(Phase::Succeeded)).await?;
    let table = watch.stop_after(&name, "Succeeded", Duration::from_secs(10)).await;
    println!("$ kubectl get rlj -w\n{table}");
    let (_, describe, _) = kubectl(&["describe", "rlj", &name, "-n", &ns])?;
    println!("$ kubectl describe rlj {name}\n{describe}");

    let st = job.status.as_ref().unwrap();
    assert_eq!(st.restarts, 0, "{file}: no gang restart: {:?}", rlplane_e2e::gang_restart_events(&c.env, &name).await?);
    let steps = job.spec.workload.steps as u64;
    assert_eq!(st.step, Some(steps), "{file}: the coordinator reported every step: {st:?}");
    // The step scalars (here the synthetic engines' mean reward) reached the status through the
    // API server: the CRD's schema keeps the field.
    let scalars = st.scalars.as_ref().unwrap_or_else(|| panic!("{file}: no status.scalars: {st:?}"));
    assert_eq!(scalars.step, steps, "{file}: {scalars:?}");
    assert!(scalars.values.get("reward_mean").is_some_and(|r| (0.0..=1.0).contains(r)), "{file}: {scalars:?}");
    assert!(!progress.is_empty(), "{file}: STEP/REFIT never showed while the job ran");
    assert!(progress.windows(2).all(|w| w[0].0 < w[1].0), "{file}: STEP only advances: {progress:?}");
    assert!(progress.iter().all(|&(step, version)| version >= 1 && version <= step + 1), "{progress:?}");
    println!("{file}: STEP/REFIT seen while running: {progress:?}");
    // The table a user watches shows the columns filling in.
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with(&name)).collect();
    // A job of a few seconds may finish before the operator saw every pod ready (Running); the
    // columns must fill in before the last row all the same.
    let before_last = &rows[..rows.len().saturating_sub(1)];
    assert!(
        before_last
            .iter()
            .any(|r| r.split_whitespace().any(|w| w.strip_prefix('v').is_some_and(|n| n.parse::<u64>().is_ok()))),
        "{file}: kubectl get rlj -w never showed STEP and REFIT while the job ran:\n{table}"
    );
    assert!(rows.last().is_some_and(|r| r.contains("Succeeded")), "{file}: the last row is not Succeeded:\n{table}");
    // The coordinator wrote them, through its own field manager, as the per-job worker account
    // (the only credentials its pod has; the operator's tests show that account can patch no
    // other job's status).
    assert_eq!(status_step_manager(&job).as_deref(), Some("rlplane-coordinator"), "{file}: managedFields");
    assert!(describe.contains("Succeeded"), "{describe}");
    c.env.cleanup().await
}

#[tokio::test]
async fn the_cpu_job_applied_with_kubectl_runs_to_succeeded_and_reports_steps_and_refits() -> anyhow::Result<()> {
    runs_to_succeeded("rljob-cpu.yaml").await
}

#[tokio::test]
async fn the_colocated_cpu_job_applied_with_kubectl_runs_to_succeeded() -> anyhow::Result<()> {
    runs_to_succeeded("rljob-cpu-colocated.yaml").await
}

/// `spec.schedule: Asynchronous` through the API server (the CRD keeps the field), the operator
/// (the plan carries it) and real pods: the engines generate ahead of the trainer, within the
/// bound every trainer rank checks.
#[tokio::test]
async fn the_asynchronous_cpu_job_runs_to_succeeded() -> anyhow::Result<()> {
    runs_to_succeeded("rljob-cpu-async.yaml").await
}

/// A job whose generation pods cannot be placed: the coordinator (in the trainer's pod) waits for
/// their ranks, and says so — in its log and in the job's status (`kubectl get rlj -o wide`) —
/// within seconds, long before its start-up deadline.
#[tokio::test]
async fn a_coordinator_waiting_for_a_pending_pod_says_whom_it_waits_for_in_the_status() -> anyhow::Result<()> {
    let Some(c) = Cluster::start("job-stall").await? else { return Ok(()) };
    let unplaceable = "generation:\n    nodeSelector: {rlplane.dev/e2e-no-such-node: \"true\"}\n    ";
    let name = c.apply("rljob-cpu.yaml", |t| t.replacen("generation:\n    ", unplaceable, 1))?;
    let started = Instant::now();
    let job = c
        .wait(&name, "status.stall naming the generation ranks", |j| {
            j.status
                .as_ref()
                .and_then(|s| s.stall.as_ref())
                .is_some_and(|s| s.waiting_for.iter().any(|r| r.starts_with("gen-")))
        })
        .await?;
    let waited = started.elapsed();
    let stall = job.status.and_then(|s| s.stall).expect("a stall");
    println!("status.stall after {:.1}s: {stall:?}", waited.as_secs_f64());
    assert_eq!(stall.phase, "connecting", "{stall:?}");
    assert!(stall.message.contains("waiting") && stall.message.contains("gen-0"), "{stall:?}");
    assert!(waited < Duration::from_secs(60), "the stall showed after {waited:?}: the start-up deadline is 120 s");
    let (_, wide, _) = kubectl(&["get", "rlj", &name, "-n", &c.env.namespace, "-o", "wide"])?;
    println!("$ kubectl get rlj -o wide\n{wide}");
    assert!(wide.contains("WAITING") && wide.contains("connecting: waiting"), "{wide}");
    // The coordinator's own log says the same, every few seconds.
    let trainer =
        c.env.pods_of(&name).await?.into_iter().find(|p| p.name_any().contains("trainer-0")).expect("trainer-0");
    let log = c.logs(&trainer.name_any());
    let waiting = |l: &&str| l.contains("the coordinator is still waiting for") && l.contains("gen-0");
    assert!(log.lines().any(|l| waiting(&l)), "{log}");
    c.env.cleanup().await
}

#[tokio::test]
async fn a_worker_killed_mid_job_restarts_the_gang_and_the_old_epoch_is_refused() -> anyhow::Result<()> {
    let Some(c) = Cluster::start("job-kill").await? else { return Ok(()) };
    // Enough steps that the kill lands mid-job, and that the new gang still runs when the old
    // epoch's rank tries to rejoin.
    let name = c.apply("rljob-cpu.yaml", |t| t.replace("steps: 3", "steps: 60"))?;
    c.wait(&name, "the first step", |j| j.status.as_ref().and_then(|s| s.step).is_some_and(|s| s >= 1)).await?;

    // Keep the old epoch's plan (and its token) before the restart replaces it, and its key:
    // the stale rank holds everything its epoch had.
    let victim = format!("{name}-gen-0");
    let (plan, key) = c.mounted_plan_and_key(&victim).await?;
    let (old_plan, old_key) = (c.dir.join("epoch-0-plan.json"), c.dir.join("epoch-0-key"));
    std::fs::write(&old_plan, plan)?;
    std::fs::write(&old_key, key)?;
    c.kill_worker(&victim).await?;
    println!("killed the worker of {victim} (SIGKILL)");

    let job = c.wait(&name, "a gang restart", |j| epoch_of(j) == 1).await?;
    let st = job.status.as_ref().unwrap();
    assert_eq!(st.restarts, 1);
    let restarts = rlplane_e2e::wait_gang_restart_naming(&c.env, &name, &victim).await?;
    println!("GangRestart: {restarts:?}");
    c.wait(&name, "Running at epoch 1", |j| epoch_of(j) == 1 && phase_of(j) == Some(Phase::Running)).await?;

    // A process of the old epoch tries to rejoin: the new gang refuses its handshake.
    let stale = stale_rank(&c, &old_plan, &old_key, &victim).await?;
    println!("the epoch-0 rank that tried to rejoin: {stale}");
    // The new coordinator's own refusal, naming the stale token — only a live gang answers the
    // handshake so; a plain "refused" would also match a connection refused by a coordinator that
    // had already exited.
    assert!(stale.contains("job token") && stale.contains("does not match"), "{stale}");

    let job = c.wait(&name, "Succeeded at epoch 1", |j| phase_of(j) == Some(Phase::Succeeded)).await?;
    assert_eq!(epoch_of(&job), 1);
    assert_eq!(job.status.as_ref().and_then(|s| s.step), Some(60), "the new epoch ran every step");
    c.env.cleanup().await
}

/// Runs one rank of the old plan (the generation rank of `pod`, with its epoch's key) on this
/// machine against the new epoch's gang, and returns what it printed once it exited. It must exit
/// with an error.
async fn stale_rank(c: &Cluster, old_plan: &Path, old_key: &Path, pod: &str) -> anyhow::Result<String> {
    let mut plan: rlplane_api::WorkerPlan = serde_json::from_str(&std::fs::read_to_string(old_plan)?)?;
    let pod_index = plan.pods.iter().position(|p| p.name == pod).context("the old plan names the pod")?;
    let process = plan
        .processes
        .iter()
        .find(|p| p.pod as usize == pod_index)
        .map(|p| p.name.clone())
        .context("the pod runs a process")?;
    // An address of its own, its own socket directory, and its epoch's key where the plan says
    // the key is mounted. Its peers' names are the old epoch's, which no longer resolve: point
    // them at the new gang's pods of the same role and index (a stale DNS cache, or addresses
    // reused), so that its handshake reaches the new coordinator.
    let mut at = c.outsider_placement(pod).await?;
    let new_epoch = plan.job.epoch + 1;
    for p in &plan.pods {
        let new_name = rlplane_api::topology::pod_name(&plan.job.name, p.role, p.index, new_epoch);
        let new_host = p.host.replacen(&p.name, &new_name, 1);
        if let Some(address) = at.addresses.get(&new_host).cloned() {
            at.addresses.insert(p.host.clone(), address);
        }
    }
    let ipc = c.dir.join("stale-ipc");
    std::fs::create_dir_all(&ipc)?;
    at.mounts = vec![(plan.pods[pod_index].ipc_dir.clone(), ipc), (plan.job.key_file.clone(), old_key.to_path_buf())];
    rlplane_e2e::placement::localize_plan(&mut plan, &at);
    let plan_path = c.dir.join("stale-plan.json");
    std::fs::write(&plan_path, plan.to_json())?;
    let out = Command::new(worker_binary()?)
        .args(["worker", "--plan", plan_path.to_str().unwrap(), "--process", &process])
        .stdin(Stdio::null())
        .output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    anyhow::ensure!(!out.status.success(), "the old epoch's rank {process} was accepted and succeeded:\n{text}");
    Ok(text.lines().rfind(|l| !l.trim().is_empty()).unwrap_or_default().to_string())
}

#[tokio::test]
async fn prometheus_scrapes_the_job_through_the_pod_monitor_and_the_dashboard_answers() -> anyhow::Result<()> {
    let Some(prometheus) = which("prometheus") else {
        if std::env::var(rlplane_e2e::REQUIRED_ENV).as_deref() == Ok("1") {
            bail!("prometheus is not installed (apt-get install prometheus; scripts/test installs it)");
        }
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "SKIPPED: prometheus is not installed (apt-get install prometheus)");
        return Ok(());
    };
    let Some(c) = Cluster::start("job-metrics").await? else { return Ok(()) };
    let ns = c.env.namespace.clone();

    // The chart's PodMonitor for this namespace, as Helm renders it.
    let chart = workspace().join("charts/rlplane");
    let watch = format!("watchNamespace={ns}");
    let (ok, rendered, err) = helm(&[
        "template",
        "rlplane",
        chart.to_str().unwrap(),
        "--set",
        "podMonitor.enabled=true",
        "--set",
        &watch,
        "--show-only",
        "templates/podmonitor.yaml",
    ])?;
    anyhow::ensure!(ok, "helm template: {err}");
    let monitor: serde_json::Value = serde_saphyr::from_str(&rendered).context("the rendered PodMonitor")?;

    // Prometheus's own pod discovery, as a ServiceAccount that may list and watch pods here.
    let (ok, _, err) = kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &prometheus_rbac(&ns))?;
    anyhow::ensure!(ok, "{err}");
    let token = service_account_token(&c.env.client, &ns, "prometheus").await?;
    let dir = c.dir.join("prometheus");
    std::fs::create_dir_all(&dir)?;
    let targets = dir.join("pods.json");
    std::fs::write(&targets, "[]")?;
    let config = scrape_config(&monitor, &targets)?;
    std::fs::write(dir.join("prometheus.yml"), &config)?;
    // Debian's Prometheus is built without Kubernetes discovery: this loop is it, listing pods as
    // the `prometheus` account, with the labels Prometheus's pod role gives each container port.
    let discovery = tokio::spawn(discover_pods(
        kube::Api::namespaced(rlplane_e2e::client_with_token(&token).await?, &ns),
        targets.clone(),
    ));
    let port = rlplane::net::reserve_loopback_port()?.local_addr()?.port();
    let mut prom = Command::new(prometheus)
        .args([
            &format!("--config.file={}", dir.join("prometheus.yml").display()),
            &format!("--storage.tsdb.path={}", dir.join("data").display()),
            &format!("--web.listen-address=127.0.0.1:{port}"),
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log"))?)
        .spawn()?;
    let result = scrape_and_query(&c, port, &dir).await;
    discovery.abort();
    let _ = prom.kill();
    let _ = prom.wait();
    if result.is_err() {
        eprintln!("prometheus config:\n{config}");
    }
    result?;
    c.env.cleanup().await
}

async fn scrape_and_query(c: &Cluster, port: u16, dir: &Path) -> anyhow::Result<()> {
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !http_get(addr, "/-/ready").is_ok_and(|(code, _)| code == 200) {
        if Instant::now() > deadline {
            bail!("Prometheus did not start: {}", std::fs::read_to_string(dir.join("prometheus.log"))?);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let start = unix_now();
    // A job that outlives the test: it must be discovered (Prometheus applies new targets at most
    // every 5 s) and scraped for a while however fast the machine runs its steps (200 steps took
    // 5 s on one run: done before its pods were ever discovered). The namespace's clean-up ends it.
    let name = c.apply("rljob-cpu.yaml", |t| t.replace("steps: 3", "steps: 1000000"))?;
    c.wait(&name, "Running", |j| phase_of(j).is_some_and(|p| p == Phase::Running || p.is_finished())).await?;
    // Every pod of the job is a target, discovered through the API server, and scraped.
    let pods = c.env.pods_of(&name).await?.len();
    let deadline = Instant::now() + Duration::from_secs(60);
    let targets = loop {
        let (_, body) = http_get(addr, "/api/v1/targets")?;
        let targets: serde_json::Value =
            serde_json::from_str(&body).with_context(|| format!("Prometheus's targets: {body}"))?;
        let up = targets["data"]["activeTargets"]
            .as_array()
            .map(|t| t.iter().filter(|t| t["health"] == "up").count())
            .unwrap_or(0);
        if up >= pods || Instant::now() > deadline {
            println!("{up} of {pods} pods scraped");
            if up < pods {
                let discovered = std::fs::read_to_string(dir.join("pods.json")).unwrap_or_default();
                bail!("Prometheus scraped {up} of {pods} pods; targets: {targets}\ndiscovered: {discovered}");
            }
            break targets;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    for t in targets["data"]["activeTargets"].as_array().into_iter().flatten() {
        println!(
            "  target {} {} role={} epoch={}",
            t["scrapeUrl"], t["health"], t["labels"]["pod_role"], t["labels"]["epoch"]
        );
        assert_eq!(t["labels"]["epoch"], "0", "the PodMonitor's relabelling keeps the epoch: {t}");
    }
    // Twenty more steps while every pod is a target: refits and queue traffic, scraped.
    let from = c.env.jobs().get(&name).await?.status.and_then(|s| s.step).unwrap_or(0);
    c.wait(&name, "20 more steps", |j| j.status.as_ref().and_then(|s| s.step).is_some_and(|s| s >= from + 20)).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let end = unix_now() + 1.0;

    // The dashboard's refit-latency and transfer-queue panels, for this job.
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(workspace().join("charts/rlplane/dashboards/rlplane.json"))?)?;
    let mut checked = Vec::new();
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or_default();
        if !(title.starts_with("Refit latency") || title.starts_with("TQ ")) {
            continue;
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = substitute(target["expr"].as_str().unwrap_or_default(), &name);
            let q = format!("/api/v1/query_range?query={}&start={start:.3}&end={end:.3}&step=1", urlencode(&expr));
            let (code, body) = http_get(addr, &q)?;
            let answer: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let values: Vec<f64> = answer["data"]["result"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|s| s["values"].as_array().cloned().unwrap_or_default())
                .filter_map(|v| v[1].as_str().and_then(|x| x.parse::<f64>().ok()))
                .filter(|v| v.is_finite())
                .collect();
            assert!(code == 200 && !values.is_empty(), "panel {title:?}: {expr} returned no data: {body}");
            checked.push(format!("{title}: {} points", values.len()));
        }
    }
    println!("dashboard panels with data for {name}:\n  {}", checked.join("\n  "));
    assert!(checked.iter().any(|c| c.starts_with("Refit latency")) && checked.iter().any(|c| c.starts_with("TQ ")));
    Ok(())
}

/// A ServiceAccount `prometheus` that may list and watch the namespace's pods (what Prometheus's
/// pod discovery needs).
fn prometheus_rbac(ns: &str) -> String {
    format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: prometheus, namespace: {ns}}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: prometheus, namespace: {ns}}}\n\
         rules: [{{apiGroups: [\"\"], resources: [pods], verbs: [get, list, watch]}}]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: prometheus, namespace: {ns}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: prometheus}}\n\
         subjects: [{{kind: ServiceAccount, name: prometheus, namespace: {ns}}}]\n"
    )
}

/// Writes `file` (Prometheus file discovery) every 250 ms: one target per container port of every
/// pod with an IP, labelled as Prometheus's Kubernetes pod discovery labels it
/// (`__meta_kubernetes_pod_label_*`, `..._labelpresent_*`, `..._container_port_name`, …).
async fn discover_pods(pods: kube::Api<k8s_openapi::api::core::v1::Pod>, file: PathBuf) {
    loop {
        let listed = pods.list(&Default::default()).await;
        if let Err(e) = &listed {
            eprintln!("pod discovery: {e}");
        }
        if let Ok(list) = listed {
            let mut groups = Vec::new();
            for p in &list.items {
                let Some(ip) = p.status.as_ref().and_then(|s| s.pod_ip.clone()) else { continue };
                let spec = p.spec.clone().unwrap_or_default();
                let mut base = serde_json::Map::new();
                base.insert("__meta_kubernetes_namespace".into(), p.namespace().unwrap_or_default().into());
                base.insert("__meta_kubernetes_pod_name".into(), p.name_any().into());
                base.insert("__meta_kubernetes_pod_ip".into(), ip.clone().into());
                for (k, v) in p.labels() {
                    base.insert(format!("__meta_kubernetes_pod_label_{}", sanitize(k)), v.clone().into());
                    base.insert(format!("__meta_kubernetes_pod_labelpresent_{}", sanitize(k)), "true".into());
                }
                let containers = spec.init_containers.iter().flatten().map(|c| (c, true));
                for (c, init) in containers.chain(spec.containers.iter().map(|c| (c, false))) {
                    for port in c.ports.iter().flatten() {
                        let mut labels = base.clone();
                        labels.insert("__meta_kubernetes_pod_container_name".into(), c.name.clone().into());
                        labels.insert("__meta_kubernetes_pod_container_init".into(), init.to_string().into());
                        labels.insert(
                            "__meta_kubernetes_pod_container_port_name".into(),
                            port.name.clone().unwrap_or_default().into(),
                        );
                        labels.insert(
                            "__meta_kubernetes_pod_container_port_number".into(),
                            port.container_port.to_string().into(),
                        );
                        groups.push(serde_json::json!({
                            "targets": [format!("{ip}:{}", port.container_port)], "labels": labels,
                        }));
                    }
                }
            }
            let tmp = file.with_extension("tmp");
            if std::fs::write(&tmp, serde_json::to_vec(&groups).unwrap_or_default()).is_ok() {
                let _ = std::fs::rename(&tmp, &file);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The scrape configuration prometheus-operator generates from a PodMonitor, over `targets` (file
/// discovery in place of Kubernetes discovery): pods kept by the monitor's namespaces, its selector
/// (`Exists` expressions) and its endpoint's port name, then the endpoint's own relabelings.
/// Scrapes every 500 ms (the job lives seconds).
fn scrape_config(monitor: &serde_json::Value, targets: &Path) -> anyhow::Result<String> {
    let spec = &monitor["spec"];
    let endpoint = &spec["podMetricsEndpoints"][0];
    let namespaces: Vec<String> = spec["namespaceSelector"]["matchNames"]
        .as_array()
        .context("the PodMonitor names its namespaces (watchNamespace)")?
        .iter()
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect();
    let mut relabel = vec![format!(
        "  - {{source_labels: [__meta_kubernetes_namespace], regex: \"{}\", action: keep}}",
        namespaces.join("|")
    )];
    for e in spec["selector"]["matchExpressions"].as_array().into_iter().flatten() {
        anyhow::ensure!(e["operator"] == "Exists", "only Exists selectors are translated: {e}");
        let label = sanitize(e["key"].as_str().unwrap_or_default());
        relabel.push(format!(
            "  - {{source_labels: [__meta_kubernetes_pod_labelpresent_{label}], regex: \"true\", action: keep}}"
        ));
    }
    let port = endpoint["port"].as_str().context("the endpoint names its port")?;
    relabel.push(format!(
        "  - {{source_labels: [__meta_kubernetes_pod_container_port_name], regex: {port}, action: keep}}"
    ));
    for r in endpoint["relabelings"].as_array().into_iter().flatten() {
        let sources: Vec<&str> =
            r["sourceLabels"].as_array().into_iter().flatten().filter_map(|s| s.as_str()).collect();
        relabel.push(format!(
            "  - {{source_labels: [{}], target_label: {}}}",
            sources.join(", "),
            r["targetLabel"].as_str().unwrap_or_default()
        ));
    }
    Ok(format!(
        "global: {{scrape_interval: 500ms, scrape_timeout: 400ms}}\nscrape_configs:\n\
         - job_name: podMonitor/{}\n  metrics_path: {}\n  file_sd_configs:\n  - files: [{}]\n    refresh_interval: 1s\n\
         \x20 relabel_configs:\n{}\n",
        monitor["metadata"]["name"].as_str().unwrap_or_default(),
        endpoint["path"].as_str().unwrap_or("/metrics"),
        targets.display(),
        relabel.join("\n")
    ))
}

/// A Kubernetes label name as Prometheus's discovery spells it (`rlplane.dev/job` →
/// `rlplane_dev_job`).
fn sanitize(label: &str) -> String {
    label.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect()
}

fn panels(dashboard: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

/// The dashboard's variables as Grafana substitutes them for one job, at a 500 ms scrape interval.
fn substitute(expr: &str, job: &str) -> String {
    expr.replace("$__rate_interval", "5s").replace("${rljob}", job).replace("$rljob", job)
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default()
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[test]
fn a_pod_monitor_becomes_the_scrape_config_prometheus_operator_would_write() {
    let monitor = serde_json::json!({
        "metadata": {"name": "rlplane-jobs"},
        "spec": {
            "selector": {"matchExpressions": [{"key": "rlplane.dev/job", "operator": "Exists"}]},
            "namespaceSelector": {"matchNames": ["ml"]},
            "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics",
                "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_rlplane_dev_epoch"], "targetLabel": "epoch"}]}],
        }
    });
    let config = scrape_config(&monitor, Path::new("/pods.json")).unwrap();
    let parsed: serde_json::Value = serde_saphyr::from_str(&config).unwrap();
    let job = &parsed["scrape_configs"][0];
    assert_eq!(job["file_sd_configs"][0]["files"][0], "/pods.json");
    let relabel = job["relabel_configs"].as_array().unwrap();
    assert_eq!(relabel[0]["regex"], "ml");
    assert_eq!(relabel[1]["source_labels"][0], "__meta_kubernetes_pod_labelpresent_rlplane_dev_job");
    assert_eq!(relabel[2]["regex"], "metrics");
    assert_eq!(relabel[3]["target_label"], "epoch");
}

/// The Python that runs users' containers in the tiny-grpo test: `RLPLANE_PYTHON` (scripts/test
/// points it at scripts/python-env's venv, with PyTorch and the client). Without it the test says
/// that it skipped, or fails where the e2e suite is required.
fn user_python() -> anyhow::Result<Option<PathBuf>> {
    match std::env::var_os("RLPLANE_PYTHON") {
        Some(p) if p != "skip" => Ok(Some(PathBuf::from(p))),
        Some(_) => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED users_own_trainer_and_engine_…: RLPLANE_PYTHON=skip");
            Ok(None)
        }
        None if std::env::var("RLPLANE_E2E_REQUIRED").is_ok_and(|v| v == "1") => {
            bail!("RLPLANE_PYTHON is not set: point it at a python with torch and the client (scripts/python-env)")
        }
        None => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED users_own_trainer_and_engine_…: RLPLANE_PYTHON is not set (scripts/test sets it)"
            );
            Ok(None)
        }
    }
}

#[tokio::test]
async fn users_own_trainer_and_engine_run_tiny_grpo_through_the_cluster_and_resume_when_killed() -> anyhow::Result<()> {
    // examples/tiny-grpo/rljob.yaml applied as it is, but for absolute paths to its scripts (the
    // node agent runs containers in their pod's directory) and a result file for the trainer: the
    // operator renders the user's containers beside the worker as a native sidecar, the node agent
    // runs both, and they meet on the pod's socket directory and /dev/shm. Killed mid-run, it
    // resumes from its last checkpoint (issue 28).
    let Some(python) = user_python()? else { return Ok(()) };
    let Some(c) = Cluster::start_with("job-tiny-grpo", [("python".to_string(), python)]).await? else {
        return Ok(());
    };
    let result = c.dir.join("tiny-grpo-result.json");
    let _ = std::fs::remove_file(&result);
    let root = workspace().canonicalize()?;
    let name = c.apply("examples/tiny-grpo/rljob.yaml", |t| {
        let t = t.replace("examples/tiny-grpo/", &format!("{}/examples/tiny-grpo/", root.display()));
        // The trainer's container (the first to name a seed) also says where its result goes.
        t.replacen(
            r#"- {name: TINY_GRPO_SEED, value: "0"}"#,
            &format!(
                "- {{name: TINY_GRPO_SEED, value: \"0\"}}\n              - {{name: TINY_GRPO_RESULT, value: \"{}\"}}",
                result.display()
            ),
            1,
        )
    })?;
    // Killed mid-run: once the trainer has reported its step-20 checkpoint (it saves one every
    // 10 steps), every process of its pod gets SIGKILL; the gang restarts and resumes there.
    let saved = |j: &RLJob| j.status.as_ref().and_then(|s| s.checkpoint.as_ref()).is_some_and(|c| c.step >= 20);
    let before = c.wait(&name, "the step-20 checkpoint", saved).await?;
    let trainer = format!("{name}-trainer-0");
    c.kill_worker(&trainer).await?;
    let killed_at = before.status.as_ref().and_then(|s| s.step).unwrap_or(0);
    println!("killed every process of {trainer} near step {killed_at}");
    let job = c.wait(&name, "Succeeded", |j| phase_of(j) == Some(Phase::Succeeded)).await?;
    let st = job.status.as_ref().unwrap();
    if (st.restarts, st.epoch) != (1, 1) {
        // Why a later epoch restarted too: its conditions and its trainer's last log lines.
        let later = format!("{trainer}-e1");
        panic!(
            "one gang restart expected, {} happened: {:?}\nconditions: {:?}\n{later}:\n{}",
            st.restarts,
            rlplane_e2e::gang_restart_events(&c.env, &name).await?,
            st.conditions,
            c.logs(&later)
        );
    }
    let resumed = st.resumed_from.clone().context("status.resumedFrom")?;
    println!("epoch 1 resumed after step {} ({})", resumed.step, resumed.uri);
    assert!(resumed.step >= 20 && killed_at.saturating_sub(resumed.step) <= 10, "{resumed:?}, killed near {killed_at}");
    assert_eq!(st.step, Some(job.spec.workload.steps as u64), "every step reported: {st:?}");
    let text =
        std::fs::read_to_string(&result).with_context(|| format!("the trainer wrote no {}", result.display()))?;
    let r: serde_json::Value = serde_json::from_str(&text)?;
    println!("tiny-grpo through the cluster: first reward {}, final {}", r["first_reward"], r["final_reward"]);
    assert_eq!(r["passed"], true, "the mean reward passed the example's threshold: {r}");
    let curve = r["curve"].as_array().context("a curve in the result")?;
    // The curve continues across the restart: the checkpoint carried the rows before it.
    let steps: Vec<u64> = curve.iter().filter_map(|row| row["step"].as_u64()).collect();
    assert_eq!(steps, (1..=job.spec.workload.steps as u64).collect::<Vec<_>>(), "a row per step, once");
    // The trainer compared, at every step, the engine's probe logits for the weights that
    // generated the step (version step - 1) with its own (it fails the job on a difference).
    for row in curve {
        let step = row["step"].as_u64().context("a step")?;
        assert_eq!(row["probe"]["version"].as_u64(), Some(step - 1), "{row}");
        assert!(row["probe"]["engines"].as_u64().is_some_and(|n| n >= 1), "no probe compared: {row}");
    }
    c.env.cleanup().await
}
