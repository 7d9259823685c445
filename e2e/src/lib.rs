//! End-to-end tests of the rlplane operator against a real cluster: the cluster `KUBECONFIG`
//! names, or none (every test then prints that it skipped, and passes).
//!
//! Each test gets its own namespace (labelled `rlplane.dev/e2e=true`) and its own operator
//! process watching only that namespace. Pods are given a scheduler that does not exist, so no
//! kubelet ever runs them: the tests stand in for the kubelet by patching pod status (Running,
//! Ready, Failed, Succeeded), which makes every transition deterministic and needs no worker
//! image. docs/operator.md says how to run them against kind or k3d.

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

/// A scheduler name no cluster runs: pods stay unscheduled, and the tests act as their kubelet.
pub const NO_SCHEDULER: &str = "rlplane-e2e-no-scheduler";
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
        Ok(Some(Env { client, namespace, operator }))
    }

    /// The RLJob API of the namespace.
    pub fn jobs(&self) -> Api<RLJob> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// The Pod API of the namespace.
    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Loads `manifests/<file>`, gives its pods the scheduler that does not exist, and applies it.
    pub async fn apply_manifest(&self, file: &str, edit: impl FnOnce(&mut RLJob)) -> anyhow::Result<RLJob> {
        let path = workspace().join("manifests").join(file);
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let mut job = load_rljob(&text).map_err(|e| anyhow::anyhow!("{}: {e:?}", path.display()))?;
        job.spec.scheduling.scheduler_name = Some(NO_SCHEDULER.into());
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
        let deadline = Instant::now() + timeout;
        loop {
            let job = self.jobs().get_opt(name).await?;
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

    /// Stands in for the kubelet: the pod runs and is ready (or not).
    pub async fn set_ready(&self, pod: &str, ready: bool) -> anyhow::Result<()> {
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

    /// Deletes the namespace (and so everything the test made) and stops the operator.
    pub async fn cleanup(mut self) -> anyhow::Result<()> {
        let clean = self.operator.terminate();
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        namespaces.delete(&self.namespace, &DeleteParams::background()).await?;
        if !clean {
            bail!("the operator did not exit cleanly on SIGTERM");
        }
        Ok(())
    }
}

/// Creates the test's namespace (after installing the CRD); None when no cluster is configured.
pub async fn namespace(test: &str) -> anyhow::Result<Option<(Client, String)>> {
    if let Some(why) = no_cluster_reason() {
        println!("skipped: {why}; set KUBECONFIG to a kind or k3d cluster to run the operator e2e tests");
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
