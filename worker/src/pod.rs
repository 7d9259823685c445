//! `rlplane worker --plan PLAN`: the entry point of every pod.
//!
//! Without `--process`, it supervises the pod: it starts one child process per rank of its pod
//! (`RLPLANE_POD` names the pod), serves `/healthz` and `/readyz` on the plan's metrics port, and
//! exits with the first failure (so the operator restarts the gang) or with 0 once every rank has
//! finished. With `--process NAME` it runs that one rank (or the coordinator).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use rlplane_api::plan::{PlanError, ProcessRole, WorkerPlan};

use crate::coordinator::{self, LogObserver, Summary};
use crate::supervisor::{Stderr, Supervisor};

/// Arguments of `rlplane worker`.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// The job's plan (the `plan.json` of its ConfigMap).
    #[arg(long)]
    pub plan: PathBuf,
    /// This pod's name (from the downward API).
    #[arg(long, env = "RLPLANE_POD")]
    pub pod: Option<String>,
    /// Run only this process of the plan (a rank or `coordinator`); used by the supervisor.
    #[arg(long, hide = true)]
    pub process: Option<String>,
}

/// Exit code for a plan or manifest the worker cannot use.
pub const EXIT_BAD_INPUT: u8 = 2;

/// Runs `rlplane worker`.
pub fn main(args: WorkerArgs) -> ExitCode {
    let path = args.plan.display().to_string();
    // The plan is the whole contract: addresses, socket directory and key path were resolved
    // once by the plan builder, and nothing here rewrites them.
    let plan = match WorkerPlan::load(&path) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_BAD_INPUT);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime");
    let result = match &args.process {
        Some(name) => rt.block_on(run_one(&plan, name)),
        None => rt.block_on(supervise_pod(&plan, &args.plan, args.pod.as_deref())),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            let text = format!("{e:#}");
            eprintln!("error: {text}");
            if args.process.is_none() {
                write_termination_message(Path::new(TERMINATION_LOG), &text);
            }
            ExitCode::FAILURE
        }
    }
}

/// Where the kubelet reads a container's termination message (`terminationMessagePath`'s
/// default); the operator puts it in the Restarting or Failed condition and the GangRestart Event.
const TERMINATION_LOG: &str = "/dev/termination-log";

/// The most of the message kept: the operator's Event note holds 1 kB in all.
const TERMINATION_MESSAGE_MAX: usize = 600;

/// The pod's failure in one line for the kubelet's termination message: the first line (which
/// rank failed and how) and the failing rank's own last error line, when its output had one.
/// Nothing is written outside a container (no such file: `rlplane local`, tests).
pub fn write_termination_message(path: &Path, error: &str) {
    if !path.exists() {
        return;
    }
    let _ = std::fs::write(path, termination_message(error));
}

fn termination_message(error: &str) -> String {
    let mut lines = error.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or_default().trim_end_matches("; its last output:");
    let cause = lines.filter_map(|l| l.strip_prefix("error: ")).next_back();
    let mut text = match cause {
        Some(c) => format!("{first}: {c}"),
        None => first.to_string(),
    };
    if text.len() > TERMINATION_MESSAGE_MAX {
        let mut end = TERMINATION_MESSAGE_MAX;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// Runs one process of the plan.
pub async fn run_one(plan: &WorkerPlan, name: &str) -> anyhow::Result<ExitCode> {
    let me = plan.process_index(name).with_context(|| format!("process `{name}` is not in the plan"))?;
    if plan.process(me).role == ProcessRole::Coordinator {
        let auth = crate::net::JobAuth::for_plan(plan)?;
        // A SIGTERM once the job is done (the kubelet stopping the sidecar after the user's
        // trainer exited) must not cut the last step's status report off; before that it ends
        // the run.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let (control, tq) = bind_coordinator(plan).await?;
        let mut registry = crate::metrics::JobLabels::of(plan).registry(&[]);
        let metrics = crate::metrics::CoordinatorMetrics::register(&mut registry);
        crate::metrics::HandshakeRefusals::register(&mut registry, auth.refusals());
        let served = crate::metrics::RankMetrics::default().serve(registry).await;
        crate::roles::announce_ready(served.addr());
        let reporter =
            crate::status::StatusReporter::in_cluster(&plan.job.namespace, &plan.job.name, plan.resume.clone()).await;
        let observer = crate::status::ReportingObserver { inner: LogObserver, reporter };
        let observed = crate::metrics::MetricsObserver { inner: &observer, metrics };
        let record = tokio::select! {
            r = coordinator::run(plan, &auth, control, tq, &observed, false) => r?,
            _ = term.recv() => anyhow::bail!("terminated (SIGTERM) before the job finished"),
        };
        drop(observed);
        // The last step's report goes out before the pod exits.
        if let Some(r) = observer.reporter {
            r.finish(std::time::Duration::from_secs(5)).await;
        }
        eprint!("{}", Summary::of(&record).table());
        return Ok(ExitCode::SUCCESS);
    }
    crate::roles::run_process(plan.clone(), me).await?;
    Ok(ExitCode::SUCCESS)
}

/// Binds the coordinator's control and transfer-queue listeners.
pub async fn bind_coordinator(plan: &WorkerPlan) -> anyhow::Result<(tokio::net::TcpListener, tokio::net::TcpListener)> {
    let c = plan.coordinator;
    let p = &plan.process(c).ports;
    let control =
        crate::net::bind(&plan.bind_address(c, p.control.context("no control port")?), "the control plane").await?;
    let tq =
        crate::net::bind(&plan.bind_address(c, p.tq_controller.context("no TQ port")?), "the TQ controller").await?;
    Ok((control, tq))
}

/// The role of a process in words, for errors ("trainer rank 3").
pub fn describe(plan: &WorkerPlan, i: u32) -> String {
    match plan.process(i).role {
        ProcessRole::Coordinator => "the coordinator".into(),
        ProcessRole::Trainer(c) => format!("trainer rank {} (tp {} pp {} cp {} dp {})", c.rank, c.tp, c.pp, c.cp, c.dp),
        ProcessRole::Generation(c) => {
            format!("generation rank {} (engine {} rank {})", c.rank, c.engine, c.engine_rank)
        }
        ProcessRole::Storage { unit } => format!("storage unit {unit}"),
    }
}

/// The command that runs process `name` of the plan at `plan_path` as a child.
pub fn child_command(
    plan_path: &Path,
    name: &str,
    library_dir: Option<&Path>,
) -> anyhow::Result<tokio::process::Command> {
    let mut cmd = crate::proc::self_command([
        "worker".as_ref(),
        "--plan".as_ref(),
        plan_path.as_os_str(),
        "--process".as_ref(),
        name.as_ref(),
    ])?;
    if let Some(dir) = library_dir {
        cmd.env("LD_LIBRARY_PATH", crate::gpu::library_path_with(dir));
    }
    Ok(cmd)
}

async fn supervise_pod(plan: &WorkerPlan, plan_path: &Path, pod: Option<&str>) -> anyhow::Result<ExitCode> {
    let pod =
        pod.context("which pod is this? set RLPLANE_POD (the operator sets it from metadata.name) or pass --pod")?;
    let pod_index = plan.pod_index(pod).map_err(|e: PlanError| anyhow::anyhow!(e))?;
    let procs = plan.processes_of_pod(pod_index);
    // SIGTERM is handled from the start: a pod torn down while its ranks start (a gang restart
    // right after the last one) must not wait out its whole grace period as PID 1 ignoring it.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let scratch = std::env::temp_dir().join(format!("rlplane-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).ok();
    let library_dir = crate::gpu::nccl_library_dir(&scratch);
    let mut sup = Supervisor::new(Arc::new(Stderr));
    for &i in &procs {
        let name = &plan.process(i).name;
        sup.spawn(name, &describe(plan, i), child_command(plan_path, name, library_dir.as_deref())?)
            .with_context(|| format!("starting {name}"))?;
    }
    sup.watch();
    let ready = Arc::new(AtomicBool::new(false));
    let bind_host = &plan.pods[pod_index as usize].bind_host;
    let health_addr: SocketAddr = format!("{bind_host}:{}", plan.observability.metrics_port)
        .parse()
        .with_context(|| format!("the pod's bind host {bind_host} is no IP address"))?;
    // One /metrics for the pod: every rank's, merged (see crate::metrics).
    let metrics = crate::metrics::MergedMetrics::new(crate::metrics::JobLabels::of(plan).registry(&[]), Vec::new());
    let health = tokio::spawn(serve_health(health_addr, ready.clone(), metrics.clone()));
    let readiness = tokio::select! {
        r = sup.wait_ready(Duration::from_secs(300)) => r.map_err(|e| match e {
            crate::supervisor::ReadyError::Exited(x) => x.describe(),
            crate::supervisor::ReadyError::Timeout(names) => format!("not ready after 300s: {}", names.join(", ")),
        }),
        _ = term.recv() => Err("terminated (SIGTERM) while its ranks started".to_string()),
    };
    if let Err(msg) = readiness {
        sup.stop(Duration::from_secs(5)).await;
        anyhow::bail!("pod {pod}: {msg}");
    }
    metrics.set_children(children_metrics(&sup));
    ready.store(true, Ordering::Release);
    let outcome = loop {
        tokio::select! {
            e = sup.next_exit() => match e {
                None => break Ok(()),
                Some(e) if e.success() => {
                    if sup.running() == 0 { break Ok(()); }
                }
                Some(e) => break Err(e.describe()),
            },
            _ = term.recv() => break Err("terminated (SIGTERM)".to_string()),
            _ = tokio::signal::ctrl_c() => break Err("interrupted".to_string()),
        }
    };
    health.abort();
    match outcome {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(why) => {
            sup.stop(Duration::from_secs(10)).await;
            anyhow::bail!("pod {pod}: {why}")
        }
    }
}

/// The metrics endpoints the children announced: (name, address).
pub fn children_metrics(sup: &Supervisor) -> Vec<(String, String)> {
    sup.names().into_iter().zip(sup.readiness()).filter_map(|(n, r)| Some((n, r?.metrics?))).collect()
}

/// `/healthz` (alive), `/readyz` (every rank of the pod ready) and `/metrics` (every rank's,
/// merged) on the metrics port.
async fn serve_health(addr: SocketAddr, ready: Arc<AtomicBool>, metrics: Arc<crate::metrics::MergedMetrics>) {
    use axum::http::StatusCode;
    use axum::routing::get;
    let app = axum::Router::new().route("/healthz", get(|| async { "ok" })).route(
        "/readyz",
        get(move || {
            let ready = ready.clone();
            async move {
                if ready.load(Ordering::Acquire) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting")
                }
            }
        }),
    );
    let app = app.merge(crate::metrics::router(metrics));
    match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => {
            let _ = axum::serve(l, app).await;
        }
        Err(e) => tracing::warn!(%addr, error = %e, "cannot serve health endpoints"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_termination_message_is_the_failure_and_the_ranks_own_last_error() {
        let e = "pod job-trainer-0: coordinator (coordinator) exited with code 1; its last output:\n  \
                 2026-11-28T12:00:00Z INFO step 39 done\n  \
                 error: step 40: claimed 63 samples but the producers put 64";
        assert_eq!(
            termination_message(e),
            "pod job-trainer-0: coordinator (coordinator) exited with code 1: step 40: claimed 63 samples but the producers put 64"
        );
        assert_eq!(termination_message("pod p: terminated (SIGTERM)"), "pod p: terminated (SIGTERM)");
        let long = termination_message(&format!("pod p: {}", "é".repeat(1000)));
        assert!(long.len() <= TERMINATION_MESSAGE_MAX + '…'.len_utf8() && long.ends_with('…'));
    }

    #[test]
    fn the_message_goes_only_where_a_kubelet_made_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("termination-log");
        write_termination_message(&missing, "pod p: failed");
        assert!(!missing.exists(), "outside a container nothing is created");
        std::fs::write(&missing, "").unwrap();
        write_termination_message(&missing, "pod p: failed");
        assert_eq!(std::fs::read_to_string(&missing).unwrap(), "pod p: failed");
    }
}
