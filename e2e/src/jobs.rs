//! The e2e job tests' cluster: a namespace with its own operator and a node agent that runs the
//! namespace's pods as local processes, with the helpers to apply a manifest with kubectl and to
//! wait for a job (showing the pods' logs when it does not get there).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use kube::ResourceExt;
use rlplane_api::{Phase, RLJob};

use crate::node_agent::{NodeAgent, NodeAgentConfig};
use crate::{Env, api_server_of_kubeconfig, kubectl_stdin, phase_of, worker_binary, workspace};

/// A job's whole run on 2 cores, with a restart, fits well inside this.
pub const RUN: Duration = Duration::from_secs(240);

/// The test's namespace, operator and node agent (which runs the pods as local processes).
pub struct Cluster {
    /// The namespace, its operator and the API client.
    pub env: Env,
    /// The node agent running the namespace's pods.
    pub agent: NodeAgent,
    /// The test's own files.
    pub dir: PathBuf,
}

impl Cluster {
    /// A namespace, operator and node agent for `test`; `None` (said so) without a cluster.
    pub async fn start(test: &str) -> anyhow::Result<Option<Cluster>> {
        Self::start_with(test, []).await
    }

    /// As [`Cluster::start`], with more command words the node agent maps to executables (a
    /// user container's `python`, say).
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
        Ok(Some(Cluster { env, agent, dir }))
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
                    logs.push_str(&self.agent.logs(&p.name_any()));
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
