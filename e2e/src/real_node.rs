//! The test cluster's real node (e2e/cluster/node: kubelet, containerd, CNI, kube-proxy, CoreDNS):
//! namespaces whose pods run there as containers, and the project's images loaded into its
//! runtime from the repository's Dockerfile (e2e/cluster/images).
//!
//! The node is tainted so that the fake-node tests' pods never land on it; a namespace made by
//! [`namespace`] tolerates the taint and selects the node through the API server's
//! PodNodeSelector and PodTolerationRestriction admission plugins, so that every pod created in it
//! (a Deployment's, an RLJob's) runs there unchanged.

use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use rlplane_operator::cluster::TOOL_FIELD_MANAGER;
use serde_json::json;

use crate::{REQUIRED_ENV, workspace};

/// The label and taint key of the real node (e2e/cluster/node.env).
pub const NODE_KEY: &str = "rlplane.dev/real-node";

/// The real node and its container runtime.
pub struct RealNode {
    /// The Node's name.
    pub name: String,
    /// containerd's socket (images are loaded through it: no registry is reachable).
    pub containerd_socket: PathBuf,
}

impl RealNode {
    /// The cluster's Ready real node; None (after saying why) when it has none, an error when
    /// [`REQUIRED_ENV`] is `1`.
    pub async fn find(client: &Client) -> anyhow::Result<Option<RealNode>> {
        if let Some(node) = Self::lookup(client).await? {
            return Ok(Some(node));
        }
        let why = "the cluster has no real node (e2e/cluster/up starts one when run as root)";
        // RLPLANE_CLUSTER_REAL_NODE=0 left it out on purpose: a skip, said, even in CI mode.
        let opted_out = std::env::var("RLPLANE_CLUSTER_REAL_NODE").as_deref() == Ok("0");
        if std::env::var(REQUIRED_ENV).as_deref() == Ok("1") && !opted_out {
            bail!("{REQUIRED_ENV}=1 but {why}; RLPLANE_CLUSTER_REAL_NODE=0 leaves the node's tests out");
        }
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
        Ok(None)
    }

    /// The cluster's Ready real node whose containerd socket is on this machine (beside the
    /// kubeconfig, as e2e/cluster/up leaves it), if any.
    pub async fn lookup(client: &Client) -> anyhow::Result<Option<RealNode>> {
        let nodes: Api<Node> = Api::all(client.clone());
        let listed = nodes.list(&ListParams::default().labels(&format!("{NODE_KEY}=true"))).await?;
        let ready = listed.items.iter().find(|n| {
            let conditions = n.status.as_ref().and_then(|s| s.conditions.as_ref());
            conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
        let kubeconfig = std::env::var_os("KUBECONFIG").map(PathBuf::from);
        let socket = kubeconfig.as_deref().and_then(|k| k.parent()).map(|d| d.join("node/containerd/containerd.sock"));
        Ok(match (ready, socket) {
            (Some(node), Some(socket)) if socket.exists() => {
                Some(RealNode { name: node.name_any(), containerd_socket: socket })
            }
            _ => None,
        })
    }

    /// Kills container `container` of `pod` with SIGKILL through the node's containerd, under
    /// the kubelet (a crash, as the kubelet sees it).
    pub fn kill_container(&self, pod: &Pod, container: &str) -> anyhow::Result<()> {
        let id = container_id(pod, container)?;
        self.ctr(&["tasks", "kill", "-s", "SIGKILL", &id])?;
        Ok(())
    }

    /// Runs `command` in the network namespace of `pod` (through its container `container`'s
    /// process), as root of this machine: `iptables` there cuts the pod off from its peers.
    pub fn in_network_of(&self, pod: &Pod, container: &str, command: &[&str]) -> anyhow::Result<String> {
        let id = container_id(pod, container)?;
        let listed = self.ctr(&["tasks", "ls"])?;
        let pid = listed
            .lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some(id.as_str())).then(|| w.next()).flatten()
            })
            .with_context(|| format!("containerd runs no task {id} ({container} of {})", pod.name_any()))?;
        let out = std::process::Command::new("nsenter")
            .args(["-t", pid, "-n", "--"])
            .args(command)
            .output()
            .context("cannot run nsenter (util-linux)")?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        anyhow::ensure!(out.status.success(), "{} in {}'s network: {text}", command.join(" "), pod.name_any());
        Ok(text)
    }

    /// `ctr -n k8s.io ARGS` against the node's containerd; its output.
    fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = std::process::Command::new("ctr")
            .arg("-a")
            .arg(&self.containerd_socket)
            .args(["-n", "k8s.io"])
            .args(args)
            .output()
            .context("cannot run ctr (containerd)")?;
        anyhow::ensure!(out.status.success(), "ctr {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Builds the project's images from its Dockerfile (e2e/cluster/images, cached: a rebuild
    /// happens only when the binaries, the client or the Dockerfile changed) and loads them into
    /// the node's runtime; returns the images' names. The binaries are the ones the suite tests
    /// (`$RLPLANE_WORKER_BIN`, `$RLPLANE_OPERATOR_BIN`, else cargo's debug build) without their
    /// debug info, not a separate release build (minutes on 2 cores). One test at a time builds:
    /// the others wait and reuse the result.
    pub fn load_images(&self) -> anyhow::Result<Vec<String>> {
        static BUILD: Mutex<()> = Mutex::new(());
        let _one = BUILD.lock().unwrap_or_else(|e| e.into_inner());
        let binaries = crate::jobs::test_files().join("image-bin");
        std::fs::create_dir_all(&binaries)?;
        for (var, binary) in [("RLPLANE_WORKER_BIN", "rlplane"), ("RLPLANE_OPERATOR_BIN", "rlplane-operator")] {
            let built = rlplane_operator::cluster::built_binary(&workspace(), var, binary, binary)?;
            let out = std::process::Command::new("strip")
                .arg("--strip-debug")
                .arg("-o")
                .arg(binaries.join(binary))
                .arg(&built)
                .output()
                .context("cannot run strip (binutils)")?;
            anyhow::ensure!(
                out.status.success(),
                "strip {}: {}",
                built.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let script = workspace().join("e2e/cluster/images");
        let out = std::process::Command::new(&script)
            .arg("--load")
            .arg(&self.containerd_socket)
            .env("RLPLANE_IMAGE_BINARIES", &binaries)
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("cannot run {}", script.display()))?;
        if !out.status.success() {
            bail!("{} failed (its output is above)", script.display());
        }
        let listed = String::from_utf8_lossy(&out.stdout);
        Ok(listed.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect())
    }
}

/// A fresh namespace (labelled like every e2e namespace) whose pods all run on the real node.
pub async fn namespace(client: &Client, test: &str) -> anyhow::Result<String> {
    let suffix = k8s_openapi::jiff::Timestamp::now().as_millisecond() % 1_000_000;
    let name = format!("rlplane-e2e-{test}-{suffix}");
    let tolerations = json!([{"key": NODE_KEY, "operator": "Exists", "effect": "NoSchedule"}]).to_string();
    let ns = json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {
            "name": name,
            "labels": {crate::E2E_LABEL: "true"},
            "annotations": {
                "scheduler.alpha.kubernetes.io/node-selector": format!("{NODE_KEY}=true"),
                "scheduler.alpha.kubernetes.io/defaultTolerations": tolerations,
            },
        },
    });
    Api::<Namespace>::all(client.clone())
        .patch(&name, &PatchParams::apply(TOOL_FIELD_MANAGER), &Patch::Apply(ns))
        .await
        .with_context(|| format!("cannot create namespace {name}"))?;
    Ok(name)
}

/// The runtime's id of container `container` of `pod`, from the pod's status.
fn container_id(pod: &Pod, container: &str) -> anyhow::Result<String> {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    let id = statuses
        .and_then(|cs| cs.iter().find(|c| c.name == container))
        .and_then(|c| c.container_id.clone())
        .with_context(|| format!("pod {} has no id for container {container}", pod.name_any()))?;
    Ok(id.trim_start_matches("containerd://").to_string())
}

/// Where a real-node test starts: the cluster's client, its real node with the project's images
/// loaded, and a fresh namespace whose pods run there.
pub struct Setup {
    /// Client for the cluster KUBECONFIG names.
    pub client: Client,
    /// The real node.
    pub node: RealNode,
    /// The images loaded into the node's runtime.
    pub images: Vec<String>,
    /// The test's namespace (pinned to the node).
    pub namespace: String,
}

impl Setup {
    /// The cluster, node, images and a namespace for `test` (with the CRD installed); None,
    /// after saying why, without a cluster or a real node.
    pub async fn start(test: &str) -> anyhow::Result<Option<Setup>> {
        if crate::skip_without_cluster()? {
            return Ok(None);
        }
        let client = Client::try_default().await.context("cannot build a client from KUBECONFIG")?;
        let Some(node) = RealNode::find(&client).await? else { return Ok(None) };
        let images = node.load_images()?;
        rlplane_operator::cluster::install_crd(&client).await?;
        let namespace = namespace(&client, test).await?;
        Ok(Some(Setup { client, node, images, namespace }))
    }

    /// The loaded image whose name contains `part` (e.g. `rlplane-worker`).
    pub fn image(&self, part: &str) -> anyhow::Result<&str> {
        let found = self.images.iter().find(|i| i.contains(part));
        found.map(String::as_str).with_context(|| format!("no {part} image was built"))
    }

    /// Deletes the namespace and everything in it.
    pub async fn cleanup(&self) -> anyhow::Result<()> {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        namespaces.delete(&self.namespace, &kube::api::DeleteParams::background()).await?;
        Ok(())
    }
}
