//! A node agent for the test cluster: what a kubelet and a container runtime would do for the
//! pods the scheduler binds to the (fake) nodes, done with local processes.
//!
//! For each pod of its namespace bound to a node, it gives the pod a loopback address of its own
//! (127.s.x.y, `s` the agent's own: every pod can then bind the same ports, as pods on separate
//! IPs do), lays out the
//! pod's volumes under a per-pod root (ConfigMaps and Secrets written as files, emptyDirs as
//! directories, the projected ServiceAccount token from the TokenRequest API bound to the pod),
//! and starts its containers' commands as processes: native sidecars first, then the containers,
//! with the pod's environment (downward-API fields resolved). Paths under a volume's mount path
//! in the command, the arguments and the environment are rewritten to the per-pod root, and
//! nothing is written outside the agent's directory. The container's first command word is
//! mapped to a local executable (`rlplane` → the worker binary).
//!
//! Pods find each other through their plan: as the agent lays out the plan's ConfigMap it writes
//! what the pod would see through its own network and mount namespaces ([`crate::placement`]):
//! peers' addresses for their DNS names, its own address to bind, its volumes' paths. The agent reports into the pod status what a kubelet
//! would (Running, the pod IP, Ready from the readiness probe, container states, Succeeded or
//! Failed with the exit codes) and, when a pod is deleted, stops its processes (SIGTERM, then
//! SIGKILL) and finishes the deletion.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Container, EnvVar, Pod, Secret, ServiceAccount, Volume};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use serde_json::json;

/// Where the agent keeps its pods and what it runs for them.
#[derive(Clone, Debug)]
pub struct NodeAgentConfig {
    /// The namespace whose pods it runs.
    pub namespace: String,
    /// Its directory: one subdirectory per pod, the hosts file, the logs.
    pub root: PathBuf,
    /// A container's first command word → the executable to run for it (e.g. `rlplane` → the
    /// built worker binary).
    pub executables: BTreeMap<String, PathBuf>,
    /// The API server's URL and CA file, for the pods' kubeconfig (their ServiceAccount token).
    pub api_server: String,
    /// The CA certificate (PEM) the API server's certificate is signed with.
    pub api_ca_file: PathBuf,
}

/// One container's process.
struct Proc {
    name: String,
    sidecar: bool,
    child: tokio::process::Child,
    exit: Option<i32>,
    started: Timestamp,
    finished: Option<Timestamp>,
}

/// A pod the agent runs.
struct RunningPod {
    name: String,
    ip: String,
    dir: PathBuf,
    procs: Vec<Proc>,
    /// The readiness probe's `(port, path)` (the first container's that has one).
    probe: Option<(u16, String)>,
    ready: bool,
    started: Timestamp,
    last_status: serde_json::Value,
    /// Set once every regular container exited and the sidecars were stopped.
    done: bool,
}

/// Shared state: pods by uid, loopback addresses by pod name.
#[derive(Default)]
struct State {
    pods: HashMap<String, RunningPod>,
    addresses: BTreeMap<String, String>,
    /// The second octet of this agent's addresses (127.<subnet>.x.y): agents of tests running at
    /// once in one process, or in processes side by side, must not hand out the same address.
    subnet: u8,
    /// DNS name → pod name, from the pods seen and the plans they mount.
    hosts: BTreeMap<String, String>,
    /// Pods whose start failed (uid → why), reported as Failed once.
    failed: HashMap<String, String>,
}

/// The running agent; dropping it stops the loop and kills every process it started.
pub struct NodeAgent {
    cfg: NodeAgentConfig,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl NodeAgent {
    /// Starts the agent's loop for `cfg.namespace`.
    pub fn start(client: Client, cfg: NodeAgentConfig) -> anyhow::Result<NodeAgent> {
        // Two agents in one directory would mix each other's pods' volumes and logs, and one
        // would delete what the other laid out (issue 30).
        if !ROOTS.lock().unwrap().insert(cfg.root.clone()) {
            bail!("another node agent of this process uses {} already; give each its own root", cfg.root.display());
        }
        // What an earlier run of the same namespace left is no pod of this one.
        let _ = std::fs::remove_dir_all(&cfg.root);
        std::fs::create_dir_all(&cfg.root).with_context(|| format!("cannot create {}", cfg.root.display()))?;
        static AGENTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = AGENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let subnet = 2 + ((std::process::id().wrapping_mul(31).wrapping_add(n)) % 250) as u8;
        let state = Arc::new(Mutex::new(State { subnet, ..State::default() }));
        let task = tokio::spawn(run(client, cfg.clone(), state.clone()));
        Ok(NodeAgent { cfg, state, task })
    }

    /// The agent's directory.
    pub fn root(&self) -> &Path {
        &self.cfg.root
    }

    /// Every pod DNS name seen so far → its pod's address.
    pub fn addresses(&self) -> HashMap<String, String> {
        self.state.lock().unwrap().addresses_by_dns_name()
    }

    /// The directory of the running pod `name` (its volumes under `vol/`, its logs).
    pub fn pod_dir(&self, name: &str) -> Option<PathBuf> {
        let st = self.state.lock().unwrap();
        st.pods.values().find(|p| p.name == name && !p.done).map(|p| p.dir.clone())
    }

    /// An address of this agent's range for `name`, a process that is no pod of the cluster (it
    /// keeps the address for the agent's life).
    pub fn reserve_address(&self, name: &str) -> String {
        address_of(&mut self.state.lock().unwrap(), name)
    }

    /// The loopback address of pod `name`.
    pub fn address(&self, name: &str) -> Option<String> {
        self.state.lock().unwrap().addresses.get(name).cloned()
    }

    /// Sends `signal` to every process of the running pod `name` (its whole process group: the
    /// worker and the ranks it supervises). Returns whether the pod was running.
    pub fn signal(&self, name: &str, signal: i32) -> bool {
        let st = self.state.lock().unwrap();
        let Some(p) = st.pods.values().find(|p| p.name == name && !p.done) else { return false };
        for proc in &p.procs {
            if let Some(pid) = proc.child.id() {
                // SAFETY: kill(2) on a process group we created; no memory is touched.
                unsafe { libc::kill(-(pid as i32), signal) };
            }
        }
        true
    }

    /// The last lines of pod `name`'s container logs, for failure messages.
    pub fn logs(&self, name: &str) -> String {
        let dirs: Vec<PathBuf> = {
            let st = self.state.lock().unwrap();
            st.pods.values().filter(|p| p.name == name).map(|p| p.dir.clone()).collect()
        };
        let mut out = String::new();
        for d in dirs {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.path().extension().is_some_and(|x| x == "log") {
                    let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().rev().take(40).collect();
                    out.push_str(&format!("--- {}\n", e.path().display()));
                    for l in tail.into_iter().rev() {
                        out.push_str(l);
                        out.push('\n');
                    }
                }
            }
        }
        out
    }
}

/// The roots of this process's live agents.
static ROOTS: Mutex<std::collections::BTreeSet<PathBuf>> = Mutex::new(std::collections::BTreeSet::new());

/// A short directory of its own for the agent of `namespace` (pods' Unix sockets live under it,
/// and a socket path is at most 107 bytes): `<tmp>/rlpe2e-<hash of the namespace>`.
pub fn root_for(namespace: &str) -> PathBuf {
    // FNV-1a: stable across runs and processes, unlike std's randomly seeded hasher.
    let hash = namespace.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    std::env::temp_dir().join(format!("rlpe2e-{:010x}", hash & 0xff_ffff_ffff))
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        ROOTS.lock().unwrap().remove(&self.cfg.root);
        self.task.abort();
        let mut st = self.state.lock().unwrap();
        for p in st.pods.values_mut() {
            kill_all(p, libc::SIGKILL);
        }
    }
}

fn kill_all(p: &mut RunningPod, signal: i32) {
    for proc in &p.procs {
        if proc.exit.is_none()
            && let Some(pid) = proc.child.id()
        {
            // SAFETY: kill(2) on a process group we created; no memory is touched.
            unsafe { libc::kill(-(pid as i32), signal) };
        }
    }
}

async fn run(client: Client, cfg: NodeAgentConfig, state: Arc<Mutex<State>>) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &cfg.namespace);
    loop {
        if let Err(e) = sync(&client, &pods, &cfg, &state).await {
            eprintln!("node agent ({}): {e:#}", cfg.namespace);
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

/// One pass: start newly bound pods, report status, stop and finish deleted ones.
async fn sync(
    client: &Client,
    pods: &Api<Pod>,
    cfg: &NodeAgentConfig,
    state: &Arc<Mutex<State>>,
) -> anyhow::Result<()> {
    let list = pods.list(&ListParams::default()).await?.items;
    // Every pod gets its address at first sight, so that a pod starting before its peers can
    // already name them.
    {
        let mut st = state.lock().unwrap();
        for p in &list {
            let name = p.name_any();
            address_of(&mut st, &name);
            if let Some(dns) = dns_name(p) {
                st.hosts.insert(dns, name);
            }
        }
    }

    // Pods gone from the API server (force-deleted): stop what is left of them.
    let live: std::collections::HashSet<String> = list.iter().filter_map(|p| p.uid()).collect();
    {
        let mut st = state.lock().unwrap();
        let gone: Vec<String> = st.pods.keys().filter(|u| !live.contains(*u)).cloned().collect();
        for uid in gone {
            if let Some(mut p) = st.pods.remove(&uid) {
                kill_all(&mut p, libc::SIGKILL);
            }
        }
    }

    for pod in &list {
        let Some(uid) = pod.uid() else { continue };
        let name = pod.name_any();
        let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
        if pod.metadata.deletion_timestamp.is_some() {
            finish_deletion(pods, state, &uid, &name, pod).await;
            continue;
        }
        let known = state.lock().unwrap().pods.contains_key(&uid);
        let failed = state.lock().unwrap().failed.get(&uid).cloned();
        if let Some(why) = failed {
            if pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed") {
                let status = json!({"phase": "Failed", "reason": "NodeAgentError", "message": why});
                let _ =
                    pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({"status": status}))).await;
            }
            continue;
        }
        if !known && bound && pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("Pending") == "Pending" {
            match start_pod(client, cfg, state, pod).await {
                Ok(p) => {
                    state.lock().unwrap().pods.insert(uid.clone(), p);
                }
                Err(e) => {
                    eprintln!("node agent: cannot start pod {name}: {e:#}");
                    state.lock().unwrap().failed.insert(uid.clone(), format!("{e:#}"));
                }
            }
        }
        report(pods, state, &uid).await;
    }
    Ok(())
}

impl State {
    /// Every pod DNS name seen so far → its pod's address.
    fn addresses_by_dns_name(&self) -> HashMap<String, String> {
        self.hosts.iter().filter_map(|(dns, pod)| Some((dns.clone(), self.addresses.get(pod)?.clone()))).collect()
    }
}

fn address_of(st: &mut State, pod: &str) -> String {
    if let Some(a) = st.addresses.get(pod) {
        return a.clone();
    }
    let n = st.addresses.len() + 1;
    let a = format!("127.{}.{}.{}", st.subnet, n / 250, n % 250 + 1);
    st.addresses.insert(pod.to_string(), a.clone());
    a
}

/// `<hostname>.<subdomain>.<namespace>.svc`, the name a headless Service gives a pod.
fn dns_name(p: &Pod) -> Option<String> {
    let spec = p.spec.as_ref()?;
    Some(format!("{}.{}.{}.svc", spec.hostname.as_ref()?, spec.subdomain.as_ref()?, p.namespace()?))
}

/// The containers a pod starts: native sidecars (init containers that keep running) first.
fn sidecars_and_containers(spec: &k8s_openapi::api::core::v1::PodSpec) -> impl Iterator<Item = &Container> {
    let sidecars = spec.init_containers.iter().flatten().filter(|c| c.restart_policy.as_deref() == Some("Always"));
    sidecars.chain(spec.containers.iter())
}

/// A container's volume mounts: mount path → the directory (or, with a subPath, the file) it is
/// on this machine.
fn container_mounts(c: &Container, volume_dirs: &HashMap<String, PathBuf>) -> Vec<(String, PathBuf)> {
    c.volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            let base = volume_dirs.get(&m.name)?;
            let path = match m.sub_path.as_deref() {
                Some(s) if !s.is_empty() => base.join(s),
                _ => base.clone(),
            };
            Some((m.mount_path.clone(), path))
        })
        .collect()
}

/// Rewrites a worker plan laid out from a ConfigMap (if `path` is one) for the pod placed at `at`.
fn localize_plan_file(path: &Path, at: &crate::placement::Placement) -> anyhow::Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let Ok(mut plan) = serde_json::from_str::<rlplane_api::WorkerPlan>(&text) else { return Ok(()) };
    crate::placement::localize_plan(&mut plan, at);
    std::fs::write(path, plan.to_json()).with_context(|| format!("rewriting {}", path.display()))
}

async fn start_pod(
    client: &Client,
    cfg: &NodeAgentConfig,
    state: &Arc<Mutex<State>>,
    pod: &Pod,
) -> anyhow::Result<RunningPod> {
    let name = pod.name_any();
    let uid = pod.uid().unwrap_or_default();
    let ns = cfg.namespace.as_str();
    let spec = pod.spec.clone().unwrap_or_default();
    let dir = cfg.root.join(format!("{name}-{}", &uid[..8.min(uid.len())]));
    std::fs::create_dir_all(dir.join("vol"))?;

    // Volumes, under dir/vol/<name>.
    let mut volume_dirs: HashMap<String, PathBuf> = HashMap::new();
    for v in spec.volumes.iter().flatten() {
        let vdir = dir.join("vol").join(&v.name);
        std::fs::create_dir_all(&vdir)?;
        lay_out_volume(client, ns, pod, v, &vdir, cfg).await.with_context(|| format!("volume {}", v.name))?;
        volume_dirs.insert(v.name.clone(), vdir);
    }

    // A plan mounted from a ConfigMap names every pod of the job: give them all an address now.
    let ip;
    {
        let mut st = state.lock().unwrap();
        for vdir in volume_dirs.values() {
            let Ok(text) = std::fs::read_to_string(vdir.join("plan.json")) else { continue };
            let Ok(plan) = serde_json::from_str::<serde_json::Value>(&text) else { continue };
            for p in plan["pods"].as_array().into_iter().flatten() {
                if let (Some(host), Some(pod_name)) = (p["host"].as_str(), p["name"].as_str()) {
                    address_of(&mut st, pod_name);
                    st.hosts.insert(host.to_string(), pod_name.to_string());
                }
            }
        }
        ip = address_of(&mut st, &name);
        let addresses = st.addresses_by_dns_name();
        let mounts = sidecars_and_containers(&spec).flat_map(|c| container_mounts(c, &volume_dirs)).collect();
        let at = crate::placement::Placement { pod: name.clone(), addresses, bind_host: ip.clone(), mounts };
        for vdir in volume_dirs.values() {
            localize_plan_file(&vdir.join("plan.json"), &at)?;
        }
    }

    // The pod's ServiceAccount credentials as a kubeconfig (kube clients read KUBECONFIG first).
    let token_dir = volume_dirs.iter().find(|(n, _)| n.starts_with("kube-api-access-")).map(|(_, d)| d.clone());
    let kubeconfig = match &token_dir {
        Some(d) => {
            let kc = dir.join("kubeconfig");
            let user = format!("tokenFile: {}", d.join("token").display());
            crate::write_kubeconfig(&kc, &cfg.api_server, &d.join("ca.crt"), &user, Some(ns))?;
            Some(kc)
        }
        None => None,
    };

    let sidecars: Vec<Container> = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| c.restart_policy.as_deref() == Some("Always"))
        .cloned()
        .collect();
    if spec.init_containers.iter().flatten().any(|c| c.restart_policy.as_deref() != Some("Always")) {
        bail!("init containers that run to completion are not supported by the e2e node agent");
    }
    let mut procs = Vec::new();
    let mut probe = None;
    for (c, sidecar) in sidecars.iter().map(|c| (c, true)).chain(spec.containers.iter().map(|c| (c, false))) {
        let mounts = container_mounts(c, &volume_dirs);
        let rewrite = |s: &str| crate::placement::rewrite_path(s, &mounts);
        let mut words: Vec<String> =
            c.command.iter().flatten().chain(c.args.iter().flatten()).map(|w| rewrite(w)).collect();
        if words.is_empty() {
            bail!("container {} has no command (the e2e node agent runs commands, not images)", c.name);
        }
        let exe = cfg.executables.get(&words[0]).cloned().unwrap_or_else(|| PathBuf::from(&words[0]));
        words[0] = exe.display().to_string();
        let mut cmd = tokio::process::Command::new(&words[0]);
        cmd.args(&words[1..]).env_clear().current_dir(&dir).stdin(Stdio::null()).process_group(0).kill_on_drop(true);
        for key in ["PATH", "HOME", "LANG", "RUST_BACKTRACE", "RUST_LOG", "LD_LIBRARY_PATH"] {
            if let Some(v) = std::env::var_os(key) {
                cmd.env(key, v);
            }
        }
        cmd.env("HOSTNAME", spec.hostname.as_deref().unwrap_or(&name));
        if let Some(kc) = &kubeconfig {
            let (host, port) = host_port(&cfg.api_server);
            cmd.env("KUBECONFIG", kc).env("KUBERNETES_SERVICE_HOST", host).env("KUBERNETES_SERVICE_PORT", port);
        }
        for e in c.env.iter().flatten() {
            let value = env_value(client, ns, pod, &ip, e).await?;
            cmd.env(&e.name, rewrite(&value));
        }
        let log = std::fs::File::create(dir.join(format!("{}.log", c.name)))?;
        cmd.stdout(log.try_clone()?).stderr(log);
        let child = cmd.spawn().with_context(|| format!("cannot start {} for container {}", words[0], c.name))?;
        if probe.is_none()
            && let Some(http) = c.readiness_probe.as_ref().and_then(|p| p.http_get.as_ref())
        {
            let port = match &http.port {
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => *p as u16,
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(n) => c
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref() == Some(n.as_str()))
                    .map(|p| p.container_port as u16)
                    .with_context(|| format!("the readiness probe names port {n}, which container {} lacks", c.name))?,
            };
            probe = Some((port, http.path.clone().unwrap_or_else(|| "/".into())));
        }
        procs.push(Proc {
            name: c.name.clone(),
            sidecar,
            child,
            exit: None,
            started: Timestamp::now(),
            finished: None,
        });
    }
    Ok(RunningPod {
        name,
        ip,
        dir,
        procs,
        probe,
        ready: false,
        started: Timestamp::now(),
        last_status: serde_json::Value::Null,
        done: false,
    })
}

fn host_port(url: &str) -> (String, String) {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let hostport = rest.split('/').next().unwrap_or(rest);
    match hostport.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.to_string()),
        None => (hostport.to_string(), "443".into()),
    }
}

async fn env_value(client: &Client, ns: &str, pod: &Pod, ip: &str, e: &EnvVar) -> anyhow::Result<String> {
    if let Some(v) = &e.value {
        return Ok(v.clone());
    }
    let Some(from) = &e.value_from else { return Ok(String::new()) };
    if let Some(f) = &from.field_ref {
        let spec = pod.spec.as_ref();
        return Ok(match f.field_path.as_str() {
            "metadata.name" => pod.name_any(),
            "metadata.namespace" => ns.to_string(),
            "metadata.uid" => pod.uid().unwrap_or_default(),
            "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
            "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()).unwrap_or_default(),
            "status.podIP" => ip.to_string(),
            "status.hostIP" => "127.0.0.1".into(),
            other => bail!("env {}: the e2e node agent does not resolve fieldRef {other}", e.name),
        });
    }
    if let Some(r) = &from.config_map_key_ref {
        let cm = Api::<ConfigMap>::namespaced(client.clone(), ns).get(&r.name).await?;
        return cm
            .data
            .and_then(|d| d.get(&r.key).cloned())
            .with_context(|| format!("env {}: no key {}", e.name, r.key));
    }
    if let Some(r) = &from.secret_key_ref {
        let s = Api::<Secret>::namespaced(client.clone(), ns).get(&r.name).await?;
        let v =
            s.data.and_then(|d| d.get(&r.key).cloned()).with_context(|| format!("env {}: no key {}", e.name, r.key))?;
        return Ok(String::from_utf8_lossy(&v.0).into_owned());
    }
    bail!("env {}: this kind of valueFrom is not supported by the e2e node agent", e.name)
}

async fn lay_out_volume(
    client: &Client,
    ns: &str,
    pod: &Pod,
    v: &Volume,
    dir: &Path,
    cfg: &NodeAgentConfig,
) -> anyhow::Result<()> {
    if v.empty_dir.is_some() {
        return Ok(());
    }
    if let Some(src) = &v.config_map {
        let cm = Api::<ConfigMap>::namespaced(client.clone(), ns).get(&src.name).await?;
        let data = cm.data.unwrap_or_default();
        match &src.items {
            Some(items) => {
                for it in items {
                    let value =
                        data.get(&it.key).with_context(|| format!("ConfigMap {} has no key {}", src.name, it.key))?;
                    std::fs::write(dir.join(&it.path), value)?;
                }
            }
            None => {
                for (k, value) in &data {
                    std::fs::write(dir.join(k), value)?;
                }
            }
        }
        return Ok(());
    }
    if let Some(src) = &v.secret {
        let name = src.secret_name.clone().unwrap_or_default();
        let secret = Api::<Secret>::namespaced(client.clone(), ns).get(&name).await?;
        for (k, value) in secret.data.unwrap_or_default() {
            let path = dir.join(&k);
            std::fs::write(&path, &value.0)?;
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        }
        return Ok(());
    }
    if let Some(p) = &v.projected {
        // The ServiceAccount admission plugin's kube-api-access volume: a token bound to this pod,
        // the cluster's CA and the namespace.
        for s in p.sources.iter().flatten() {
            if let Some(t) = &s.service_account_token {
                let account =
                    pod.spec.as_ref().and_then(|s| s.service_account_name.clone()).unwrap_or("default".into());
                let request = TokenRequest {
                    spec: TokenRequestSpec {
                        audiences: t.audience.iter().cloned().collect(),
                        expiration_seconds: t.expiration_seconds.or(Some(3600)),
                        bound_object_ref: Some(BoundObjectReference {
                            api_version: Some("v1".into()),
                            kind: Some("Pod".into()),
                            name: Some(pod.name_any()),
                            uid: pod.uid(),
                        }),
                    },
                    ..Default::default()
                };
                let token = Api::<ServiceAccount>::namespaced(client.clone(), ns)
                    .create_token_request(&account, &PostParams::default(), &request)
                    .await
                    .with_context(|| format!("TokenRequest for ServiceAccount {account}"))?
                    .status
                    .map(|s| s.token)
                    .unwrap_or_default();
                std::fs::write(dir.join(&t.path), token)?;
            }
            if let Some(cm) = &s.config_map {
                for it in cm.items.iter().flatten() {
                    if it.key == "ca.crt" {
                        std::fs::copy(&cfg.api_ca_file, dir.join(&it.path))?;
                    }
                }
            }
            if let Some(d) = &s.downward_api {
                for it in d.items.iter().flatten() {
                    if it.field_ref.as_ref().is_some_and(|f| f.field_path == "metadata.namespace") {
                        std::fs::write(dir.join(&it.path), ns)?;
                    }
                }
            }
        }
        return Ok(());
    }
    bail!("the e2e node agent cannot lay out this kind of volume")
}

/// Polls the pod's processes and readiness and patches its status when it changed.
async fn report(pods: &Api<Pod>, state: &Arc<Mutex<State>>, uid: &str) {
    let (name, ip, probe) = {
        let mut st = state.lock().unwrap();
        let Some(p) = st.pods.get_mut(uid) else { return };
        for proc in &mut p.procs {
            if proc.exit.is_none()
                && let Ok(Some(status)) = proc.child.try_wait()
            {
                use std::os::unix::process::ExitStatusExt;
                proc.exit = Some(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)));
                proc.finished = Some(Timestamp::now());
            }
        }
        // The regular containers all exited: stop the sidecars, as a kubelet does.
        if !p.done && p.procs.iter().filter(|c| !c.sidecar).all(|c| c.exit.is_some()) {
            for proc in p.procs.iter().filter(|c| c.sidecar && c.exit.is_none()) {
                if let Some(pid) = proc.child.id() {
                    // SAFETY: kill(2) on a process group we created; no memory is touched.
                    unsafe { libc::kill(-(pid as i32), libc::SIGTERM) };
                }
            }
            p.done = p.procs.iter().all(|c| c.exit.is_some());
        }
        (p.name.clone(), p.ip.clone(), p.probe.clone())
    };
    let ready_now = match &probe {
        Some((port, path)) => {
            let addr: std::net::SocketAddr = format!("{ip}:{port}").parse().expect("an address");
            let path = path.clone();
            tokio::task::spawn_blocking(move || {
                rlplane_operator::cluster::http_get(addr, &path).is_ok_and(|(c, _)| (200..400).contains(&c))
            })
            .await
            .unwrap_or(false)
        }
        None => true,
    };
    let status = {
        let mut st = state.lock().unwrap();
        let Some(p) = st.pods.get_mut(uid) else { return };
        let any_running_regular = p.procs.iter().any(|c| !c.sidecar && c.exit.is_none());
        p.ready = ready_now && any_running_regular;
        let status = pod_status(p);
        if status == p.last_status {
            return;
        }
        p.last_status = status.clone();
        status
    };
    // A strategic merge, as the kubelet's status manager does: conditions merge by type, so one
    // the API server added (DisruptionTarget, from an eviction) stays.
    if let Err(e) =
        pods.patch_status(&name, &PatchParams::default(), &Patch::Strategic(json!({"status": status}))).await
    {
        eprintln!("node agent: cannot report the status of pod {name}: {e}");
        if let Some(p) = state.lock().unwrap().pods.get_mut(uid) {
            p.last_status = serde_json::Value::Null;
        }
    }
}

fn container_status(c: &Proc, ready: bool) -> serde_json::Value {
    let state = match c.exit {
        None => json!({"running": {"startedAt": Time(c.started)}}),
        Some(code) => json!({"terminated": {
            "exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" },
            "startedAt": Time(c.started), "finishedAt": Time(c.finished.unwrap_or(c.started)),
        }}),
    };
    json!({"name": c.name, "image": "local", "imageID": "", "ready": ready && c.exit.is_none(),
           "restartCount": 0, "started": c.exit.is_none(), "state": state})
}

fn pod_status(p: &RunningPod) -> serde_json::Value {
    let regular: Vec<&Proc> = p.procs.iter().filter(|c| !c.sidecar).collect();
    let phase = if regular.iter().any(|c| c.exit.is_none()) {
        "Running"
    } else if regular.iter().all(|c| c.exit == Some(0)) {
        "Succeeded"
    } else {
        "Failed"
    };
    let ready = if p.ready && phase == "Running" { "True" } else { "False" };
    let start = Time(p.started);
    json!({
        "phase": phase,
        "podIP": p.ip, "podIPs": [{"ip": p.ip}], "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
        "startTime": start,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": start},
            {"type": "Initialized", "status": "True", "lastTransitionTime": start},
            {"type": "ContainersReady", "status": ready, "lastTransitionTime": start},
            {"type": "Ready", "status": ready, "lastTransitionTime": start},
        ],
        "containerStatuses": regular.iter().map(|c| container_status(c, p.ready)).collect::<Vec<_>>(),
        "initContainerStatuses": p.procs.iter().filter(|c| c.sidecar).map(|c| container_status(c, p.ready)).collect::<Vec<_>>(),
    })
}

/// A terminating pod: SIGTERM its processes, SIGKILL after the grace period (at most 10 s), then
/// delete it for good.
async fn finish_deletion(pods: &Api<Pod>, state: &Arc<Mutex<State>>, uid: &str, name: &str, pod: &Pod) {
    let grace = pod.metadata.deletion_grace_period_seconds.unwrap_or(30).clamp(0, 10) as u64;
    let deadline = {
        let mut st = state.lock().unwrap();
        match st.pods.get_mut(uid) {
            Some(p) if p.procs.iter().any(|c| c.exit.is_none()) => {
                kill_all(p, libc::SIGTERM);
                Some(Instant::now() + Duration::from_secs(grace))
            }
            _ => None,
        }
    };
    if let Some(deadline) = deadline {
        loop {
            let all_exited = {
                let mut st = state.lock().unwrap();
                let Some(p) = st.pods.get_mut(uid) else { break };
                p.procs.iter_mut().all(|c| c.exit.is_some() || matches!(c.child.try_wait(), Ok(Some(_))))
            };
            if all_exited {
                break;
            }
            if Instant::now() > deadline {
                if let Some(p) = state.lock().unwrap().pods.get_mut(uid) {
                    kill_all(p, libc::SIGKILL);
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut dp = DeleteParams::default().grace_period(0);
    dp.preconditions = Some(Preconditions { uid: Some(uid.to_string()), resource_version: None });
    let _ = pods.delete(name, &dp).await;
    state.lock().unwrap().pods.remove(uid);
}
