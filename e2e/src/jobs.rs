//! The e2e job tests' cluster: a namespace with its own operator, whose pods run on the test
//! cluster's real node as containers (the project's images, loaded into its containerd) or, where
//! the cluster has no real node or a test maps a container's command to a local program, as local
//! processes of a node agent; with the helpers to apply a manifest with kubectl, wait for a job
//! (showing the pods' logs when it does not get there), read a pod's logs and kill its worker.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::ResourceExt;
use kube::api::Api;
use rlplane_api::{Phase, RLJob};
use rlplane_operator::cluster::{OperatorProcess, operator_binary};
use rlplane_operator::desired::{PLAN_KEY, WORKER_CONTAINER};

use crate::node_agent::{NodeAgent, NodeAgentConfig};
use crate::real_node::RealNode;
use crate::{Env, api_server_of_kubeconfig, kubectl, kubectl_stdin, phase_of, worker_binary, workspace};

/// A job's whole run on 2 cores, with a restart, fits well inside this.
pub const RUN: Duration = Duration::from_secs(240);

/// What runs the namespace's pods.
pub enum Runner {
    /// The real node's kubelet: containers of the project's images.
    RealNode(RealNode),
    /// The node agent: each container's command as a local process.
    Agent(NodeAgent),
}

/// The test's namespace, operator and what runs its pods.
pub struct Cluster {
    /// The namespace, its operator and the API client.
    pub env: Env,
    /// What runs the namespace's pods.
    pub runner: Runner,
    /// The test's own files.
    pub dir: PathBuf,
}

impl Cluster {
    /// A namespace and operator for `test` whose pods run on the real node (the node agent
    /// where the cluster has none, said so); `None` (said so) without a cluster.
    pub async fn start(test: &str) -> anyhow::Result<Option<Cluster>> {
        if crate::skip_without_cluster()? {
            return Ok(None);
        }
        let client = kube::Client::try_default().await.context("cannot build a client from KUBECONFIG")?;
        let Some(node) = RealNode::lookup(&client).await? else {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "{test}: no real node in the cluster: its pods run on the node agent");
            return Self::start_with(test, []).await;
        };
        node.load_images()?;
        rlplane_operator::cluster::install_crd(&client).await?;
        let namespace = crate::real_node::namespace(&client, test).await?;
        let operator =
            OperatorProcess::start(&operator_binary(&workspace())?, &namespace, &["--image-pull-policy", "Never"])?;
        let env = Env { client, namespace, operator, kubelet: None };
        let dir = test_files().join("e2e-real-node").join(&env.namespace);
        std::fs::create_dir_all(&dir)?;
        Ok(Some(Cluster { env, runner: Runner::RealNode(node), dir }))
    }

    /// A namespace and operator for `test` whose pods the node agent runs, with more command
    /// words it maps to local executables (a user container's `python`, say: an image with the
    /// user's PyTorch is more than the suite builds); `None` (said so) without a cluster.
    pub async fn start_with(
        test: &str,
        more: impl IntoIterator<Item = (String, PathBuf)>,
    ) -> anyhow::Result<Option<Cluster>> {
        let Some(env) = Env::start_for_node_agent(test).await? else { return Ok(None) };
        let dir = test_files().join("e2e-node-agent").join(&env.namespace);
        let (api_server, api_ca_file) = api_server_of_kubeconfig(&dir).await?;
        let cfg = NodeAgentConfig {
            namespace: env.namespace.clone(),
            root: crate::node_agent::root_for(&env.namespace),
            executables: [("rlplane".to_string(), worker_binary()?)].into_iter().chain(more).collect(),
            api_server,
            api_ca_file,
        };
        // The test's own files (the agent's pods live under the short root above).
        std::fs::create_dir_all(&dir)?;
        let agent = NodeAgent::start(env.client.clone(), cfg)?;
        Ok(Some(Cluster { env, runner: Runner::Agent(agent), dir }))
    }

    /// The last lines of pod `pod`'s logs (every container's).
    pub fn logs(&self, pod: &str) -> String {
        match &self.runner {
            Runner::Agent(agent) => agent.logs(pod),
            Runner::RealNode(_) => {
                let args = ["logs", "-n", &self.env.namespace, pod, "--all-containers", "--prefix", "--tail=40"];
                match kubectl(&args) {
                    Ok((_, out, err)) => format!("--- kubectl logs {pod}\n{out}{err}"),
                    Err(e) => format!("--- kubectl logs {pod}: {e:#}\n"),
                }
            }
        }
    }

    /// Kills pod `pod`'s worker with SIGKILL (its container exits with code 137); fails when it
    /// does not run.
    pub async fn kill_worker(&self, pod: &str) -> anyhow::Result<()> {
        match &self.runner {
            Runner::Agent(agent) => {
                anyhow::ensure!(agent.signal(pod, libc::SIGKILL), "{pod} was not running");
                Ok(())
            }
            Runner::RealNode(node) => node.kill_container(&self.env.pods().get(pod).await?, WORKER_CONTAINER),
        }
    }

    /// What running pod `pod` has mounted: the plan's JSON and the epoch's key file's bytes.
    pub async fn mounted_plan_and_key(&self, pod: &str) -> anyhow::Result<(String, Vec<u8>)> {
        let key_name = rlplane_api::plan::JOB_KEY_SECRET_KEY;
        if let Runner::Agent(agent) = &self.runner {
            let dir = agent.pod_dir(pod).with_context(|| format!("{pod} does not run"))?;
            let plan = std::fs::read_to_string(dir.join("vol/plan/plan.json")).context("the pod's mounted plan")?;
            let key = std::fs::read_dir(dir.join("vol"))?
                .flatten()
                .map(|v| v.path().join(key_name))
                .find(|k| k.is_file())
                .context("the pod's mounted key Secret")?;
            return Ok((plan, std::fs::read(key)?));
        }
        // The kubelet mounts the pod's ConfigMap and Secret volumes: read the same objects.
        let spec = self.env.pods().get(pod).await?.spec.context("a pod without spec")?;
        let volumes = spec.volumes.unwrap_or_default();
        let map = volumes.iter().find_map(|v| v.config_map.as_ref()).context("the pod mounts no ConfigMap")?;
        let secret = volumes.iter().find_map(|v| v.secret.as_ref()).context("the pod mounts no Secret")?;
        let ns = &self.env.namespace;
        let map = Api::<ConfigMap>::namespaced(self.env.client.clone(), ns).get(&map.name).await?;
        let plan = map.data.and_then(|d| d.get(PLAN_KEY).cloned()).context("the plan ConfigMap has no plan")?;
        let secret_name = secret.secret_name.clone().context("a Secret volume without a name")?;
        let secret = Api::<Secret>::namespaced(self.env.client.clone(), ns).get(&secret_name).await?;
        let key = secret.data.and_then(|d| d.get(key_name).cloned()).context("the key Secret has no key")?;
        Ok((plan, key.0))
    }

    /// For a process of this machine that plays pod `pod` of the job (a rank of an earlier
    /// epoch, say): where it is placed ([`crate::placement`]), with the running pods' addresses
    /// for their DNS names and an address it may bind; its volumes are the caller's to add.
    pub async fn outsider_placement(&self, pod: &str) -> anyhow::Result<crate::placement::Placement> {
        let (addresses, bind_host) = match &self.runner {
            Runner::Agent(agent) => (agent.addresses(), agent.reserve_address(&format!("outsider-{pod}"))),
            Runner::RealNode(_) => {
                let mut addresses = std::collections::HashMap::new();
                for p in self.env.pods().list(&Default::default()).await?.items {
                    let Some(ip) = p.status.as_ref().and_then(|s| s.pod_ip.clone()) else { continue };
                    let Some(sub) = p.spec.as_ref().and_then(|s| s.subdomain.clone()) else { continue };
                    // As the plan names them: <pod>.<headless service>.<namespace>.svc.
                    addresses.insert(format!("{}.{sub}.{}.svc", p.name_any(), self.env.namespace), ip);
                }
                // Its listeners stay on this machine's loopback; it dials the pods from here,
                // which the node's NetworkPolicy enforcement lets pass for root's connections.
                (addresses, "127.0.0.1".to_string())
            }
        };
        Ok(crate::placement::Placement { pod: pod.to_string(), addresses, bind_host, mounts: Vec::new() })
    }

    /// `kubectl apply -n <ns> -f manifests/<file>` (or `<file>` from the workspace's root when it
    /// names a directory) with the manifest's text edited by `edit`; prints kubectl's answer and
    /// returns the job's name (from `rljob.rlplane.dev/<name> created`).
    pub fn apply(&self, file: &str, edit: impl FnOnce(String) -> String) -> anyhow::Result<String> {
        let shown = if file.contains('/') { file.to_string() } else { format!("manifests/{file}") };
        let text = std::fs::read_to_string(workspace().join(&shown))?;
        let (ok, out, err) = kubectl_stdin(&["apply", "-n", &self.env.namespace, "-f", "-"], &edit(text))?;
        anyhow::ensure!(ok, "kubectl apply -f {shown} failed:\n{err}");
        println!("$ kubectl apply -f {shown}\n{}", out.trim());
        let name = out.split_whitespace().next().and_then(|o| o.strip_prefix("rljob.rlplane.dev/"));
        Ok(name.with_context(|| format!("kubectl apply named no RLJob: {out}"))?.to_string())
    }

    /// Waits for `done`, and on a timeout or a Failed job shows the pods' logs.
    pub async fn wait(&self, job: &str, what: &str, done: impl Fn(&RLJob) -> bool) -> anyhow::Result<RLJob> {
        let failed_early = |j: &RLJob| phase_of(j) == Some(Phase::Failed);
        match self.env.wait_job(job, what, RUN, |j| done(j) || failed_early(j)).await {
            Ok(j) if done(&j) => Ok(j),
            other => {
                let pods = self.env.pods_of(job).await.unwrap_or_default();
                let mut logs = String::new();
                for p in &pods {
                    logs.push_str(&self.logs(&p.name_any()));
                }
                let status = other.map(|j| format!("{:?}", j.status)).unwrap_or_else(|e| format!("{e:#}"));
                bail!("RLJob {job}: {what} did not happen: {status}\npod logs:\n{logs}")
            }
        }
    }
}

/// Where the tests keep their files: cargo's `target/tmp` (`$CARGO_TARGET_DIR/tmp` when set).
pub fn test_files() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace().join("target")).join("tmp")
}
