//! Helpers that drive a real cluster from outside the operator, shared by `rlplane-operator bench`
//! and the `rlplane-e2e` tests: whether a cluster is configured, installing the CRD, starting and
//! stopping the operator binary, and reading its memory.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, CustomResourceExt};
use rlplane_api::RLJob;

/// Field manager of objects the tools (bench, e2e) apply.
pub const TOOL_FIELD_MANAGER: &str = "rlplane-tools";

/// Why no cluster is used: None when `KUBECONFIG` names one. Only an explicit `KUBECONFIG` counts
/// (never `~/.kube/config` or an in-cluster account), so that a test run never touches a cluster
/// by accident.
pub fn no_cluster_reason() -> Option<String> {
    match std::env::var_os("KUBECONFIG") {
        None => Some("KUBECONFIG is not set".into()),
        Some(v) if v.is_empty() => Some("KUBECONFIG is empty".into()),
        Some(v) => {
            let first = std::env::split_paths(&v).next().unwrap_or_default();
            if first.exists() {
                None
            } else {
                Some(format!("KUBECONFIG names {}, which does not exist", first.display()))
            }
        }
    }
}

/// Installs (server-side applies) the RLJob CRD and waits until it is established.
pub async fn install_crd(client: &Client) -> anyhow::Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = RLJob::crd();
    let name = RLJob::crd_name();
    crds.patch(name, &PatchParams::apply(TOOL_FIELD_MANAGER).force(), &Patch::Apply(&crd))
        .await
        .with_context(|| format!("cannot apply the CRD {name} (cluster-admin rights are needed)"))?;
    tokio::time::timeout(Duration::from_secs(30), await_condition(crds, name, conditions::is_crd_established()))
        .await
        .with_context(|| format!("the CRD {name} was not established within 30 s"))??;
    Ok(())
}

/// Creates (server-side applies) a namespace.
pub async fn ensure_namespace(client: &Client, name: &str) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns = serde_json::json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name } });
    api.patch(name, &PatchParams::apply(TOOL_FIELD_MANAGER).force(), &Patch::Apply(&ns))
        .await
        .with_context(|| format!("cannot create namespace {name}"))?;
    Ok(())
}

/// A free local TCP port (bound and released; good enough for a child process started next).
pub fn free_local_addr() -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").context("cannot bind a local port")?;
    Ok(l.local_addr()?)
}

/// A GET on a local HTTP/1 endpoint; returns the status code and the body (a chunked body
/// decoded: servers send large answers, e.g. Prometheus's API, in chunks).
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    s.read_to_string(&mut response)?;
    let code = response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((response.as_str(), ""));
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.trim().eq_ignore_ascii_case("chunked")
        })
    });
    Ok((code, if chunked { dechunk(body) } else { body.to_string() }))
}

/// The payload of a `Transfer-Encoding: chunked` body (sizes in hex, each chunk followed by CRLF).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// Memory of a process, from `/proc/<pid>/status` (Linux).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// Resident set size now, in bytes.
    pub rss: u64,
    /// Peak resident set size, in bytes.
    pub peak: u64,
}

/// The memory of process `pid`, or None where /proc is unavailable.
pub fn memory_of(pid: u32) -> Option<Memory> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|v| v * 1024)
    };
    Some(Memory { rss: kb("VmRSS:")?, peak: kb("VmHWM:")? })
}

/// A running `rlplane-operator run`, stopped with SIGTERM when dropped.
pub struct OperatorProcess {
    child: Child,
    /// Its `/healthz`, `/readyz` and `/metrics` address.
    pub metrics_addr: SocketAddr,
}

impl OperatorProcess {
    /// Starts `binary run --namespace <namespace> --metrics-addr <free port> <extra args>` and
    /// waits until it leads (`rlplane_operator_leader 1` on `/metrics`).
    pub fn start(binary: &Path, namespace: &str, extra: &[&str]) -> anyhow::Result<OperatorProcess> {
        OperatorProcess::spawn(binary, Some(namespace), extra, None, true)
    }

    /// Like [`OperatorProcess::start`], but waits only until `/readyz` answers 200 (a standby
    /// replica that does not lead).
    pub fn start_standby(binary: &Path, namespace: &str, extra: &[&str]) -> anyhow::Result<OperatorProcess> {
        OperatorProcess::spawn(binary, Some(namespace), extra, None, false)
    }

    /// Starts the operator with the credentials of `kubeconfig` instead of `KUBECONFIG`'s (e.g.
    /// a ServiceAccount token, to run with exactly the RBAC a chart grants), watching `namespace`
    /// or, with None, every namespace; waits until it leads (`lead`) or is ready.
    pub fn start_as(
        binary: &Path,
        kubeconfig: &Path,
        namespace: Option<&str>,
        extra: &[&str],
        lead: bool,
    ) -> anyhow::Result<OperatorProcess> {
        OperatorProcess::spawn(binary, namespace, extra, Some(kubeconfig), lead)
    }

    /// Whether it leads now.
    pub fn is_leader(&self) -> bool {
        self.metrics().is_ok_and(|m| m.lines().any(|l| l.trim() == "rlplane_operator_leader 1"))
    }

    fn spawn(
        binary: &Path,
        namespace: Option<&str>,
        extra: &[&str],
        kubeconfig: Option<&Path>,
        lead: bool,
    ) -> anyhow::Result<OperatorProcess> {
        let metrics_addr = free_local_addr()?;
        let addr = metrics_addr.to_string();
        let mut args = vec!["run", "--metrics-addr", &addr];
        if let Some(ns) = namespace {
            args.extend(["--namespace", ns]);
        }
        args.extend_from_slice(extra);
        let mut command = Command::new(binary);
        command
            .args(&args)
            .env("RUST_LOG", std::env::var("RLPLANE_OPERATOR_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null());
        if let Some(kc) = kubeconfig {
            command.env("KUBECONFIG", kc);
        }
        let child = command.spawn().with_context(|| format!("cannot start {}", binary.display()))?;
        let mut p = OperatorProcess { child, metrics_addr };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = p.child.try_wait()? {
                bail!("the operator exited during start-up ({status}); see its log above");
            }
            let up = if lead { p.is_leader() } else { http_get(metrics_addr, "/readyz").is_ok_and(|(c, _)| c == 200) };
            if up {
                return Ok(p);
            }
            if Instant::now() > deadline {
                bail!("the operator did not become {} within 60 s", if lead { "the leader" } else { "ready" });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its memory now.
    pub fn memory(&self) -> Option<Memory> {
        memory_of(self.child.id())
    }

    /// Its metrics (Prometheus text).
    pub fn metrics(&self) -> anyhow::Result<String> {
        let (code, body) = http_get(self.metrics_addr, "/metrics")?;
        if code != 200 {
            bail!("/metrics answered {code}");
        }
        Ok(body)
    }

    /// Kills it with SIGKILL (a crash: nothing is released, not even the leader lease) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits up to 30 s for a graceful exit (then kills it). Returns whether it
    /// exited by itself with success.
    pub fn terminate(&mut self) -> bool {
        if let Ok(Some(status)) = self.child.try_wait() {
            return status.success();
        }
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        false
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        self.terminate();
    }
}

/// The operator binary to start: `$RLPLANE_OPERATOR_BIN`, else built with
/// `cargo build -p rlplane-operator --bin rlplane-operator` in `workspace`.
pub fn operator_binary(workspace: &Path) -> anyhow::Result<PathBuf> {
    built_binary(workspace, "RLPLANE_OPERATOR_BIN", "rlplane-operator", "rlplane-operator")
}

/// The binary `bin` of package `package`: the path in `$env_var` if set, else built with `cargo
/// build -p <package> --bin <bin>` in `workspace` (its path read from cargo's JSON messages, so
/// any target directory works).
pub fn built_binary(workspace: &Path, env_var: &str, package: &str, bin: &str) -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os(env_var).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if !p.exists() {
            bail!("{env_var} names {}, which does not exist", p.display());
        }
        return Ok(p);
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(workspace)
        .args(["build", "-p", package, "--bin", bin, "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run cargo build; set {env_var} to a built {bin}"))?;
    if !out.status.success() {
        bail!("cargo build -p {package} --bin {bin} failed");
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if msg["reason"] == "compiler-artifact"
            && msg["target"]["name"] == bin
            && let Some(exe) = msg["executable"].as_str()
        {
            return Ok(PathBuf::from(exe));
        }
    }
    bail!("cargo build did not report the {bin} executable; set {env_var}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_chunked_body_is_decoded() {
        assert_eq!(super::dechunk("5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n"), "hello, world");
        assert_eq!(super::dechunk("3;ext=1\r\nabc\r\n0\r\n\r\n"), "abc");
    }
}
