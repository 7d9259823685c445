//! End-to-end tests of the rlplane operator against a real cluster: the cluster `KUBECONFIG`
//! names (in CI, the local control plane of `e2e/cluster/up`: a real etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler), or none: every test then prints that it skipped and
//! passes, unless `RLPLANE_E2E_REQUIRED=1` (CI sets it) makes a missing cluster an error.
//!
//! Each test gets its own namespace (labelled `rlplane.dev/e2e=true`) and its own operator
//! process watching only that namespace. The real scheduler places the pods on the cluster's
//! (fake GPU) nodes; no kubelet runs them. The tests stand in for the kubelet: they patch pod
//! status (Running, Ready, Failed, Succeeded), which makes every transition deterministic and
//! needs no worker image, and [`Env`] finishes the deletion of terminating pods the way a kubelet
//! does once their containers stopped. docs/operator.md says how to run them.

pub mod jobs;
pub mod node_agent;
pub mod placement;
pub mod real_node;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use rlplane_api::topology::{headless_service_name, plan_config_map_name};
use rlplane_api::{RLJob, load_rljob};
use rlplane_operator::cluster::{
    OperatorProcess, TOOL_FIELD_MANAGER, ensure_namespace, install_crd, no_cluster_reason, operator_binary,
};
use rlplane_operator::desired::{labels, worker_service_account_name};
use serde_json::json;

/// Set to `1` to make a missing cluster an error instead of a skip (CI).
pub const REQUIRED_ENV: &str = "RLPLANE_E2E_REQUIRED";
/// Label on every namespace the tests create (`kubectl delete ns -l rlplane.dev/e2e=true` cleans up
/// after an aborted run).
pub const E2E_LABEL: &str = "rlplane.dev/e2e";

/// The workspace root (manifests/, crds/).
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A test's cluster, namespace and operator.
pub struct Env {
    /// Client for the cluster KUBECONFIG names.
    pub client: Client,
    /// The test's namespace.
    pub namespace: String,
    /// The operator under test.
    pub operator: OperatorProcess,
    /// The kubelet stand-in's loop that finishes the deletion of terminating pods (None when a
    /// [`node_agent::NodeAgent`] runs the pods instead).
    kubelet: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(k) = &self.kubelet {
            k.abort();
        }
    }
}

impl Env {
    /// Installs the CRD, creates a fresh namespace and starts an operator watching it; None (after
    /// printing why) when no cluster is configured.
    pub async fn start(test: &str) -> anyhow::Result<Option<Env>> {
        Env::start_with(test, &[]).await
    }

    /// [`Env::start`] with extra arguments for `rlplane-operator run`.
    pub async fn start_with(test: &str, operator_args: &[&str]) -> anyhow::Result<Option<Env>> {
        let Some((client, namespace)) = namespace(test).await? else { return Ok(None) };
        let binary = operator_binary(&workspace())?;
        let operator = OperatorProcess::start(&binary, &namespace, operator_args)?;
        Ok(Some(Env::new(client, namespace, operator)))
    }

    /// An environment over an existing namespace and operator; starts the kubelet stand-in.
    pub fn new(client: Client, namespace: String, operator: OperatorProcess) -> Env {
        let kubelet = tokio::spawn(finish_pod_deletions(Api::namespaced(client.clone(), &namespace)));
        Env { client, namespace, operator, kubelet: Some(kubelet) }
    }

    /// Like [`Env::start`], without the kubelet stand-in: a [`node_agent::NodeAgent`] the test
    /// starts runs the pods.
    pub async fn start_for_node_agent(test: &str) -> anyhow::Result<Option<Env>> {
        let Some((client, namespace)) = namespace(test).await? else { return Ok(None) };
        let binary = operator_binary(&workspace())?;
        let operator = OperatorProcess::start(&binary, &namespace, &[])?;
        Ok(Some(Env { client, namespace, operator, kubelet: None }))
    }

    /// The RLJob API of the namespace.
    pub fn jobs(&self) -> Api<RLJob> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// The Pod API of the namespace.
    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Loads `manifests/<file>`, lets `edit` change it, and applies it.
    pub async fn apply_manifest(&self, file: &str, edit: impl FnOnce(&mut RLJob)) -> anyhow::Result<RLJob> {
        let path = workspace().join("manifests").join(file);
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let mut job = load_rljob(&text).map_err(|e| anyhow::anyhow!("{}: {e:?}", path.display()))?;
        edit(&mut job);
        self.apply(&job).await
    }

    /// Server-side applies an RLJob in the namespace: its name, labels and spec (an object read
    /// back from the API server can be applied again: uid, managedFields and status are dropped).
    pub async fn apply(&self, job: &RLJob) -> anyhow::Result<RLJob> {
        let name = job.name_any();
        let mut intent = RLJob::new(&name, job.spec.clone());
        intent.metadata.namespace = Some(self.namespace.clone());
        intent.metadata.labels = job.metadata.labels.clone();
        Ok(self.jobs().patch(&name, &PatchParams::apply(TOOL_FIELD_MANAGER).force(), &Patch::Apply(&intent)).await?)
    }

    /// Polls the job until `done` holds (every 200 ms, at most `timeout`); fails naming `what`
    /// and the last status seen.
    pub async fn wait_job(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&RLJob) -> bool,
    ) -> anyhow::Result<RLJob> {
        wait_for_job(&self.jobs(), name, what, timeout, done).await
    }

    /// Polls until `done` holds for the job's pods (those carrying its label).
    pub async fn wait_pods(
        &self,
        job: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[Pod]) -> bool,
    ) -> anyhow::Result<Vec<Pod>> {
        let deadline = Instant::now() + timeout;
        loop {
            let pods = self.pods_of(job).await?;
            if done(&pods) {
                return Ok(pods);
            }
            if Instant::now() > deadline {
                let names: Vec<_> =
                    pods.iter().map(|p| (p.name_any(), p.labels().get(labels::EPOCH).cloned())).collect();
                bail!("RLJob {job}: {what} did not happen within {timeout:?}; pods (name, epoch): {names:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits for the `n` pods of `epoch` of the job, then stands in for their kubelets: every one
    /// runs and is ready.
    pub async fn ready_all(&self, job: &str, epoch: u32, n: usize) -> anyhow::Result<()> {
        let what = format!("{n} pods of epoch {epoch}");
        let pods = self.wait_pods(job, &what, Duration::from_secs(60), |p| live_of_epoch(p, epoch).len() == n).await?;
        for p in live_of_epoch(&pods, epoch) {
            self.set_ready(&p.name_any(), true).await?;
        }
        Ok(())
    }

    /// The pods carrying the job's label.
    pub async fn pods_of(&self, job: &str) -> anyhow::Result<Vec<Pod>> {
        Ok(self.pods().list(&ListParams::default().labels(&format!("{}={job}", labels::JOB))).await?.items)
    }

    /// Which of the job's Service, ConfigMap, ServiceAccount, Role, RoleBinding exist.
    pub async fn objects_of(&self, job: &str) -> anyhow::Result<BTreeMap<&'static str, bool>> {
        let c = &self.client;
        let ns = &self.namespace;
        let worker = worker_service_account_name(job);
        Ok(BTreeMap::from([
            (
                "Service",
                Api::<Service>::namespaced(c.clone(), ns).get_opt(&headless_service_name(job)).await?.is_some(),
            ),
            (
                "ConfigMap",
                Api::<ConfigMap>::namespaced(c.clone(), ns).get_opt(&plan_config_map_name(job)).await?.is_some(),
            ),
            ("ServiceAccount", Api::<ServiceAccount>::namespaced(c.clone(), ns).get_opt(&worker).await?.is_some()),
            ("Role", Api::<Role>::namespaced(c.clone(), ns).get_opt(&worker).await?.is_some()),
            ("RoleBinding", Api::<RoleBinding>::namespaced(c.clone(), ns).get_opt(&worker).await?.is_some()),
        ]))
    }

    /// Waits until the job's objects all exist (true) or are all gone (false).
    pub async fn wait_objects(&self, job: &str, exist: bool, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let objects = self.objects_of(job).await?;
            if objects.values().all(|&e| e == exist) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "RLJob {job}: expected its objects to {} within {timeout:?}: {objects:?}",
                    if exist { "exist" } else { "be gone" }
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until the scheduler bound the pod to a node; returns the node's name.
    pub async fn wait_scheduled(&self, pod: &str, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let p = self.pods().get(pod).await?;
            if let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
                return Ok(node);
            }
            if Instant::now() > deadline {
                let conditions = p.status.and_then(|s| s.conditions).unwrap_or_default();
                bail!("pod {pod} was not scheduled within {timeout:?}; its conditions: {conditions:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stands in for the kubelet of the node the pod was placed on (waiting for the scheduler to
    /// place it first): the pod runs and is ready (or not).
    pub async fn set_ready(&self, pod: &str, ready: bool) -> anyhow::Result<()> {
        self.wait_scheduled(pod, Duration::from_secs(60)).await?;
        let now = Time(Timestamp::now());
        let status = if ready { "True" } else { "False" };
        self.patch_pod_status(
            pod,
            json!({
                "phase": "Running",
                "startTime": now,
                "conditions": [
                    {"type": "Ready", "status": status, "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": status, "lastTransitionTime": now},
                ],
            }),
        )
        .await
    }

    /// Stands in for the kubelet: the pod's worker container exits with `code` (the pod is then
    /// Failed for a non-zero code, Succeeded for 0).
    pub async fn exit(&self, pod: &str, code: i32) -> anyhow::Result<()> {
        let now = Time(Timestamp::now());
        let p = self.pods().get(pod).await?;
        let spec = p.spec.unwrap_or_default();
        let statuses: Vec<_> = spec
            .containers
            .iter()
            .map(|c| {
                json!({
                    "name": c.name, "image": c.image.clone().unwrap_or_default(), "imageID": "", "ready": false,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" },
                              "startedAt": now, "finishedAt": now}},
                })
            })
            .collect();
        self.patch_pod_status(
            pod,
            json!({
                "phase": if code == 0 { "Succeeded" } else { "Failed" },
                "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
                "containerStatuses": statuses,
            }),
        )
        .await
    }

    async fn patch_pod_status(&self, pod: &str, status: serde_json::Value) -> anyhow::Result<()> {
        self.pods()
            .patch_status(pod, &PatchParams::default(), &Patch::Merge(json!({ "status": status })))
            .await
            .with_context(|| format!("cannot patch the status of pod {pod} (standing in for the kubelet)"))?;
        Ok(())
    }

    /// Deletes the namespace (and so everything the test made) and stops the operator; the
    /// kubelet stand-in stays until every pod is gone, so that the namespace can go.
    pub async fn cleanup(mut self) -> anyhow::Result<()> {
        let clean = self.operator.terminate();
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        namespaces.delete(&self.namespace, &DeleteParams::background()).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.pods().list(&ListParams::default()).await?.items.is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if !clean {
            bail!("the operator did not exit cleanly on SIGTERM");
        }
        Ok(())
    }
}

/// The kubelet's last word on a deleted pod: once a pod bound to a node is terminating, the
/// kubelet stops its containers and deletes it for good (grace period 0). No kubelet runs here,
/// so this loop does it for every terminating pod of the namespace, until aborted.
async fn finish_pod_deletions(pods: Api<Pod>) {
    loop {
        if let Ok(list) = pods.list(&ListParams::default()).await {
            for p in list.items.iter().filter(|p| p.metadata.deletion_timestamp.is_some()) {
                let mut dp = DeleteParams::default().grace_period(0);
                dp.preconditions =
                    Some(kube::api::Preconditions { uid: p.metadata.uid.clone(), resource_version: None });
                // Gone already, or replaced by a newer pod of the same name: either is fine.
                let _ = pods.delete(&p.name_any(), &dp).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls RLJob `name` until `done` holds (every 200 ms, at most `timeout`); fails naming `what`
/// and the last status seen.
pub async fn wait_for_job(
    jobs: &Api<RLJob>,
    name: &str,
    what: &str,
    timeout: Duration,
    done: impl Fn(&RLJob) -> bool,
) -> anyhow::Result<RLJob> {
    let deadline = Instant::now() + timeout;
    loop {
        let job = jobs.get_opt(name).await?;
        if let Some(job) = &job
            && done(job)
        {
            return Ok(job.clone());
        }
        if Instant::now() > deadline {
            let status = job.and_then(|j| j.status).map(|s| serde_json::to_string_pretty(&s).unwrap_or_default());
            bail!("RLJob {name}: {what} did not happen within {timeout:?}; last status: {status:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// None when a cluster is configured; otherwise prints that the test skipped (or fails, when
/// [`REQUIRED_ENV`] is `1`).
pub fn skip_without_cluster() -> anyhow::Result<bool> {
    let Some(why) = no_cluster_reason() else { return Ok(false) };
    if std::env::var(REQUIRED_ENV).as_deref() == Ok("1") {
        bail!("{REQUIRED_ENV}=1 but {why}: start the local control plane with `export KUBECONFIG=$(e2e/cluster/up)`");
    }
    // The stderr handle, not println!: the harness captures the macros' output of passing tests.
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: {why}; run `export KUBECONFIG=$(e2e/cluster/up)` (or point it at kind/k3d) to run the e2e tests"
    );
    Ok(true)
}

/// Runs `kubectl` (from PATH, else the `bin/` beside the kubeconfig that e2e/cluster/up wrote)
/// against the KUBECONFIG cluster; returns (exit success, stdout, stderr).
pub fn kubectl(args: &[&str]) -> anyhow::Result<(bool, String, String)> {
    run_tool("kubectl", args, None)
}

/// [`kubectl`] with `input` on its standard input (`-f -`).
pub fn kubectl_stdin(args: &[&str], input: &str) -> anyhow::Result<(bool, String, String)> {
    run_tool("kubectl", args, Some(input))
}

/// Runs `helm` (found like [`kubectl`]) against the KUBECONFIG cluster; returns (exit success,
/// stdout, stderr).
pub fn helm(args: &[&str]) -> anyhow::Result<(bool, String, String)> {
    run_tool("helm", args, None)
}

/// Runs the cluster tool `name` ([`cluster_tool`]) with `input`, if any, on its standard input.
fn run_tool(name: &str, args: &[&str], input: Option<&str>) -> anyhow::Result<(bool, String, String)> {
    use std::io::Write as _;
    let mut child = std::process::Command::new(cluster_tool(name))
        .args(args)
        .stdin(if input.is_some() { std::process::Stdio::piped() } else { std::process::Stdio::null() })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {name} (put it on PATH, or start the cluster with e2e/cluster/up)"))?;
    if let Some(input) = input {
        child.stdin.take().with_context(|| format!("{name}'s stdin"))?.write_all(input.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// A token of ServiceAccount `account` in `namespace`, from the TokenRequest API (valid 10 min).
pub async fn service_account_token(client: &Client, namespace: &str, account: &str) -> anyhow::Result<String> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    let request = TokenRequest {
        spec: TokenRequestSpec { expiration_seconds: Some(600), ..Default::default() },
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(client.clone(), namespace)
        .create_token_request(account, &kube::api::PostParams::default(), &request)
        .await
        .with_context(|| format!("TokenRequest for ServiceAccount {namespace}/{account}"))?
        .status
        .map(|s| s.token)
        .context("the TokenRequest came back without a token")
}

/// A client with KUBECONFIG's cluster and the credentials of `token` instead of its user's.
pub async fn client_with_token(token: &str) -> anyhow::Result<Client> {
    let mut config = kube::Config::infer().await?;
    config.auth_info = serde_json::from_value(json!({ "token": token }))?;
    Ok(Client::try_from(config)?)
}

/// Writes `dir/<name>.kubeconfig`: KUBECONFIG's cluster with `token` as the only credentials (for
/// a process that must run as a ServiceAccount, e.g. the operator with the chart's RBAC).
pub async fn token_kubeconfig(dir: &Path, name: &str, token: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let (server, ca) = api_server_of_kubeconfig(dir).await?;
    let path = dir.join(format!("{name}.kubeconfig"));
    write_kubeconfig(&path, &server, &ca, &format!("token: {token}"), None)?;
    Ok(path)
}

/// Writes a kubeconfig (mode 0600) for `server`, trusting `ca`, with `user` as the user's
/// credentials (`token: …` or `tokenFile: …`) and an optional default namespace.
pub fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca: &Path,
    user: &str,
    namespace: Option<&str>,
) -> anyhow::Result<()> {
    let namespace = namespace.map(|n| format!(", namespace: {n}")).unwrap_or_default();
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    certificate-authority: {}\n\
         users:\n- name: u\n  user:\n    {user}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u{namespace}}}\n\
         current-context: c\n",
        ca.display()
    );
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok(())
}

/// The worker binary the node agent runs for `rlplane`: `$RLPLANE_WORKER_BIN` (scripts/test builds
/// it once and sets the variable), else built with `cargo build -p rlplane --bin rlplane`.
pub fn worker_binary() -> anyhow::Result<PathBuf> {
    rlplane_operator::cluster::built_binary(&workspace(), "RLPLANE_WORKER_BIN", "rlplane", "rlplane")
}

/// The API server URL and CA file of the KUBECONFIG cluster (for the node agent's pod
/// kubeconfigs); the CA is written to `dir` when the kubeconfig embeds it.
pub async fn api_server_of_kubeconfig(dir: &Path) -> anyhow::Result<(String, PathBuf)> {
    let kc = kube::config::Kubeconfig::read().context("cannot read KUBECONFIG")?;
    let current = kc.current_context.clone().unwrap_or_default();
    let ctx = kc.contexts.iter().find(|c| c.name == current).and_then(|c| c.context.clone()).context("no context")?;
    let cluster =
        kc.clusters.iter().find(|c| c.name == ctx.cluster).and_then(|c| c.cluster.clone()).context("no cluster")?;
    let server = cluster.server.clone().context("the kubeconfig's cluster has no server")?;
    let ca = match (&cluster.certificate_authority, &cluster.certificate_authority_data) {
        (Some(path), _) => PathBuf::from(path),
        (None, Some(data)) => {
            use base64::Engine as _;
            let pem = base64::engine::general_purpose::STANDARD.decode(data).context("certificate-authority-data")?;
            let path = dir.join("ca.crt");
            std::fs::create_dir_all(dir)?;
            std::fs::write(&path, pem)?;
            path
        }
        (None, None) => bail!("the kubeconfig's cluster has no certificate authority"),
    };
    Ok((server, ca))
}

/// A cluster tool (`kubectl`, `helm`): the one in `bin/` beside KUBECONFIG's file when there is one
/// (e2e/cluster/up's build), else the name for PATH to resolve.
pub fn cluster_tool(name: &str) -> PathBuf {
    if let Some(kc) = std::env::var_os("KUBECONFIG").and_then(|v| std::env::split_paths(&v).next()) {
        let beside = kc.parent().unwrap_or(Path::new(".")).join("bin").join(name);
        if beside.exists() {
            return beside;
        }
    }
    PathBuf::from(name)
}

/// Creates the test's namespace (after installing the CRD); None when no cluster is configured.
pub async fn namespace(test: &str) -> anyhow::Result<Option<(Client, String)>> {
    if skip_without_cluster()? {
        return Ok(None);
    }
    let client = Client::try_default().await.context("cannot build a client from KUBECONFIG")?;
    client.apiserver_version().await.context("cannot reach the API server KUBECONFIG names")?;
    install_crd(&client).await?;
    let suffix = Timestamp::now().as_millisecond() % 1_000_000;
    let name = format!("rlplane-e2e-{test}-{suffix}");
    ensure_namespace(&client, &name).await?;
    let ns: Api<Namespace> = Api::all(client.clone());
    ns.patch(
        &name,
        &PatchParams::apply(TOOL_FIELD_MANAGER),
        &Patch::Apply(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {E2E_LABEL: "true"}}}),
        ),
    )
    .await?;
    Ok(Some((client, name)))
}

/// The condition `type_` of the job: (status, reason, message).
pub fn condition(job: &RLJob, type_: &str) -> Option<(String, String, String)> {
    let c = rlplane_operator::conditions::find(&job.status.as_ref()?.conditions, type_)?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Whether the job's condition `type_` is True.
pub fn is_true(job: &RLJob, type_: &str) -> bool {
    job.status.as_ref().is_some_and(|s| rlplane_operator::conditions::is_true(&s.conditions, type_))
}

/// The Events regarding the job.
pub async fn job_events(env: &Env, job: &str) -> anyhow::Result<Vec<k8s_openapi::api::events::v1::Event>> {
    job_events_in(&env.client, &env.namespace, job).await
}

/// The Events about RLJob `job` in namespace `ns`.
pub async fn job_events_in(
    client: &Client,
    ns: &str,
    job: &str,
) -> anyhow::Result<Vec<k8s_openapi::api::events::v1::Event>> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(job))
        .collect())
}

/// The notes of the job's GangRestart Events (the Restarting condition says why only while the
/// restart lasts; the Event stays).
pub async fn gang_restart_events(env: &Env, job: &str) -> anyhow::Result<Vec<String>> {
    gang_restart_notes(&env.client, &env.namespace, job).await
}

/// The notes of the GangRestart Events of RLJob `job` in namespace `ns`.
pub async fn gang_restart_notes(client: &Client, ns: &str, job: &str) -> anyhow::Result<Vec<String>> {
    Ok(job_events_in(client, ns, job)
        .await?
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("GangRestart"))
        .filter_map(|e| e.note)
        .collect())
}

/// Waits (at most 30 s: the Event is published after the status that bumps the epoch) until a
/// GangRestart Event of the job names `pod`; returns every GangRestart note.
pub async fn wait_gang_restart_naming(env: &Env, job: &str, pod: &str) -> anyhow::Result<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let notes = gang_restart_events(env, job).await?;
        if notes.iter().any(|n| n.contains(pod)) {
            return Ok(notes);
        }
        if Instant::now() > deadline {
            bail!("RLJob {job}: no GangRestart Event names {pod} within 30 s: {notes:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The job's phase, once the operator wrote one.
pub fn phase_of(job: &RLJob) -> Option<rlplane_api::Phase> {
    job.status.as_ref().map(|s| s.phase)
}

/// The job's epoch (0 before the operator wrote a status).
pub fn epoch_of(job: &RLJob) -> u32 {
    job.status.as_ref().map(|s| s.epoch).unwrap_or_default()
}

/// The pod that runs the coordinator.
pub fn coordinator(pods: &[Pod]) -> Option<&Pod> {
    pods.iter().find(|p| p.labels().get(labels::COORDINATOR).map(String::as_str) == Some("true"))
}

/// Pods of `epoch` among `pods`, not terminating.
pub fn live_of_epoch(pods: &[Pod], epoch: u32) -> Vec<&Pod> {
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.labels().get(labels::EPOCH).map(String::as_str) == Some(epoch.to_string().as_str()))
        .collect()
}

/// Strips from a job what a real deployment's site provides and the test cluster lacks: the
/// PriorityClass it names (pods naming a missing one are refused) and the PersistentVolumeClaims
/// its templates mount (emptyDirs instead: no pod with an unbound claim is ever scheduled).
pub fn without_site_dependencies(job: &mut RLJob) {
    job.spec.scheduling.priority_class_name = None;
    for t in [&mut job.spec.trainer.template, &mut job.spec.generation.template].into_iter().flatten() {
        let Ok(mut pt) = t.pod_template() else { continue };
        for v in pt.spec.iter_mut().flat_map(|s| s.volumes.iter_mut().flatten()) {
            if v.persistent_volume_claim.take().is_some() {
                v.empty_dir = Some(Default::default());
            }
        }
        if let Ok(back) = serde_json::to_value(pt).and_then(serde_json::from_value) {
            *t = back;
        }
    }
}
