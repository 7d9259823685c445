//! `rlplane local MANIFEST`: a whole RLJob on one machine — the demo and the benchmark harness.
//!
//! It validates the manifest with the operator's `validate()`, builds the same plan the operator
//! would (the same pure `build_plan`, with loopback addresses and free ports instead of pod DNS
//! names), starts one child process per rank, runs the coordinator in this process, shows a
//! progress bar (plain log lines when stderr is not a terminal), and prints a summary table
//! (`--json` writes it as JSON too).
//!
//! Exit codes: 0 success; 1 a rank or the run failed; 2 the manifest is invalid; 130 interrupted.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use rlplane_api::plan::WorkerPlan;
use rlplane_api::topology::{Addressing, JobIdentity, build_plan};
use rlplane_api::{Device, RefitTransport, RefitVerify, load_rljob};
use serde::Serialize;

use crate::coordinator::{self, Observer, Progress, RunRecord, Summary};
use crate::net::JobAuth;
use crate::pod::{EXIT_BAD_INPUT, bind_coordinator, child_command, describe};
use crate::supervisor::{OutputSink, Supervisor};

/// Transport choice on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportArg {
    /// Pick by what is present (GPU transports with GPUs, TCP otherwise).
    Auto,
    /// NCCL broadcast.
    Nccl,
    /// CUDA IPC.
    CudaIpc,
    /// TCP.
    Tcp,
}

impl From<TransportArg> for RefitTransport {
    fn from(t: TransportArg) -> Self {
        match t {
            TransportArg::Auto => RefitTransport::Auto,
            TransportArg::Nccl => RefitTransport::Nccl,
            TransportArg::CudaIpc => RefitTransport::CudaIpc,
            TransportArg::Tcp => RefitTransport::Tcp,
        }
    }
}

/// Refit verification on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum VerifyArg {
    /// Every byte of every refit.
    Full,
    /// A sample drawn afresh for every version.
    Sampled,
    /// No digest.
    Off,
}

impl From<VerifyArg> for RefitVerify {
    fn from(v: VerifyArg) -> Self {
        match v {
            VerifyArg::Full => RefitVerify::Full,
            VerifyArg::Sampled => RefitVerify::Sampled,
            VerifyArg::Off => RefitVerify::Off,
        }
    }
}

/// Arguments of `rlplane local`.
#[derive(Debug, clap::Args)]
pub struct LocalArgs {
    /// The RLJob manifest (YAML), e.g. manifests/rljob-cpu.yaml.
    pub manifest: PathBuf,
    /// Refit transport, overriding spec.refit.transport.
    #[arg(long, value_enum)]
    pub transport: Option<TransportArg>,
    /// Refit verification, overriding spec.refit.verify.
    #[arg(long, value_enum)]
    pub verify: Option<VerifyArg>,
    /// Also write the summary as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Override spec.workload.steps.
    #[arg(long)]
    pub steps: Option<u32>,
    /// Override spec.schedule: run asynchronously, generation at most K policy versions behind
    /// (0 is the synchronous schedule).
    #[arg(long, value_name = "K")]
    pub max_policy_lag: Option<u32>,
    /// Serve every rank's metrics and the coordinator's, merged, at
    /// http://127.0.0.1:PORT/metrics while the job runs.
    #[arg(long, value_name = "PORT")]
    pub metrics_port: Option<u16>,
}

/// Loopback addressing: every pod is 127.0.0.1, every port a free one, sockets in a scratch dir.
pub struct LocalAddressing {
    dir: PathBuf,
    /// Held until the plan is built, so that no two services get the same free port.
    held: Mutex<Vec<std::net::TcpListener>>,
}

impl LocalAddressing {
    /// Addressing with sockets under `dir`. Drop it once the plan is built to free the ports.
    pub fn new(dir: &Path) -> LocalAddressing {
        LocalAddressing { dir: dir.to_path_buf(), held: Mutex::new(Vec::new()) }
    }
}

/// The physical GPU of slot 0 of every pod when all pods share one machine with `available` GPUs:
/// pods one after another; an error when they do not fit.
pub fn gpu_bases(plan: &WorkerPlan, available: usize) -> anyhow::Result<Vec<u32>> {
    let mut next = 0u32;
    let mut bases = Vec::with_capacity(plan.pods.len());
    for pod in &plan.pods {
        bases.push(next);
        next += pod.gpus;
    }
    if next as usize > available {
        anyhow::bail!(
            "the job needs {next} GPUs ({}) but this machine has {available}; use a smaller layout or --transport tcp",
            plan.pods
                .iter()
                .filter(|p| p.gpus > 0)
                .map(|p| format!("{} × {}", p.name, p.gpus))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(bases)
}

impl Addressing for LocalAddressing {
    fn host(&self, _pod: &str) -> String {
        "127.0.0.1".into()
    }
    fn bind_host(&self, _pod: &str) -> String {
        "127.0.0.1".into()
    }
    fn ipc_dir(&self, pod: &str) -> String {
        self.dir.join(pod).display().to_string()
    }
    fn port(&self, _pod: &str, _base: u16, _offset: u32) -> u16 {
        let l = crate::net::reserve_loopback_port().expect("a free loopback port");
        let port = l.local_addr().expect("a bound address").port();
        self.held.lock().expect("port lock").push(l);
        port
    }
    fn same_node(&self, _pods: &[&str]) -> bool {
        true
    }
    fn private_ipc(&self, _pod: &str) -> bool {
        true
    }
}

/// The summary as written by `--json`.
#[derive(Serialize)]
struct JsonSummary<'a> {
    job: &'a str,
    mode: String,
    transport: String,
    summary: &'a Summary,
    steps: &'a RunRecord,
}

/// Runs `rlplane local`.
pub fn main(args: LocalArgs) -> ExitCode {
    let text = match std::fs::read_to_string(&args.manifest) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read {}: {e}", args.manifest.display());
            return ExitCode::from(EXIT_BAD_INPUT);
        }
    };
    let mut job = match load_rljob(&text) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("error: {} is not a valid RLJob:", args.manifest.display());
            for line in &e.0 {
                eprintln!("  - {line}");
            }
            return ExitCode::from(EXIT_BAD_INPUT);
        }
    };
    if let Some(t) = args.transport {
        job.spec.refit.transport = t.into();
    }
    if let Some(v) = args.verify {
        job.spec.refit.verify = v.into();
    }
    if let Some(s) = args.steps {
        if s == 0 {
            eprintln!("error: --steps must be at least 1");
            return ExitCode::from(EXIT_BAD_INPUT);
        }
        job.spec.workload.steps = s;
    }
    if let Some(k) = args.max_policy_lag {
        if k > rlplane_api::MAX_POLICY_LAG {
            eprintln!("error: --max-policy-lag {k}: at most {}", rlplane_api::MAX_POLICY_LAG);
            return ExitCode::from(EXIT_BAD_INPUT);
        }
        job.spec.schedule = rlplane_api::ScheduleSpec::asynchronous(k);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime");
    match rt.block_on(run(job, args.json.as_deref(), args.metrics_port)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Interrupted) => {
            eprintln!("interrupted: every rank stopped");
            ExitCode::from(130)
        }
        Err(Failure::Error(e)) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
        Err(Failure::Coordinator(e)) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

enum Failure {
    Interrupted,
    Coordinator(coordinator::CoordinatorError),
    Error(anyhow::Error),
}

impl Failure {
    /// What went wrong, in one message.
    fn describe(&self) -> String {
        match self {
            Failure::Interrupted => "interrupted".into(),
            Failure::Coordinator(e) => e.to_string(),
            Failure::Error(e) => format!("{e:#}"),
        }
    }
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure::Error(e.into())
    }
}

/// The GPUs this machine has, when the manifest asks for them (a GPU transport, or `Auto` on
/// `device: Gpu`), and the transport to name in the run's summary. Each refit group's transport
/// itself is the plan builder's decision (`GroupTransport` in the plan).
fn resolve_transport(job: &rlplane_api::RLJob) -> anyhow::Result<(RefitTransport, Option<crate::gpu::GpuInfo>)> {
    let t = job.spec.refit.transport;
    let wants_gpu = matches!(t, RefitTransport::Nccl | RefitTransport::CudaIpc)
        || (t == RefitTransport::Auto && job.spec.device == Device::Gpu);
    if !wants_gpu {
        return Ok((RefitTransport::Tcp, None));
    }
    let info = crate::gpu::probe().map_err(|e| {
        anyhow::anyhow!(
            "{e}\n(the manifest asks for GPUs: spec.device is {:?} and the refit transport {:?})",
            job.spec.device,
            t
        )
    })?;
    Ok((t, Some(info)))
}

async fn run(job: rlplane_api::RLJob, json: Option<&Path>, metrics_port: Option<u16>) -> Result<(), Failure> {
    let (transport, gpus) = resolve_transport(&job)?;
    let name = job.metadata.name.clone().unwrap_or_else(|| "local".into());
    let scratch = tempdir(&name)?;
    let uid = format!("local-{}-{}", std::process::id(), scratch.file_name().and_then(|s| s.to_str()).unwrap_or(""));
    let mut run = LocalRun::start(job, name, uid, transport, gpus, scratch, metrics_port).await?;
    run.keep_steps = json.is_some();
    let result = run.epochs(json).await;
    let _ = std::fs::remove_dir_all(&run.scratch);
    result
}

/// What a run of `rlplane local` keeps over its epochs: the job, where it lives, its output and
/// its metrics.
struct LocalRun {
    job: rlplane_api::RLJob,
    name: String,
    uid: String,
    transport: RefitTransport,
    gpus: Option<crate::gpu::GpuInfo>,
    scratch: PathBuf,
    ui: Arc<Ui>,
    coordinator_metrics: crate::metrics::CoordinatorMetrics,
    /// Handshake refusals over every epoch (each epoch has a key of its own).
    refusals: crate::net::Refusals,
    merged: Option<Arc<crate::metrics::MergedMetrics>>,
    metrics_port: Option<u16>,
    /// Whether the coordinator keeps every step's record (for `--json`); without, its memory
    /// stays flat however many steps run.
    keep_steps: bool,
}

impl LocalRun {
    /// The run's output and metrics (with `--metrics-port`, one /metrics merging the
    /// coordinator's with every rank's).
    async fn start(
        job: rlplane_api::RLJob,
        name: String,
        uid: String,
        transport: RefitTransport,
        gpus: Option<crate::gpu::GpuInfo>,
        scratch: PathBuf,
        metrics_port: Option<u16>,
    ) -> Result<LocalRun, Failure> {
        // The job's labels (name, mode, transport) are the same in every epoch's plan.
        let labels = {
            let id =
                JobIdentity { name: name.clone(), namespace: "local".into(), uid: uid.clone(), epoch: 0, resume: None };
            let addressing = LocalAddressing::new(&scratch.join("labels"));
            crate::metrics::JobLabels::of(&build_plan(&job.spec, &id, &addressing).map_err(|e| anyhow::anyhow!("{e}"))?)
        };
        let mut registry = labels.registry(&[]);
        let coordinator_metrics = crate::metrics::CoordinatorMetrics::register(&mut registry);
        let refusals = crate::net::Refusals::default();
        crate::metrics::HandshakeRefusals::register(&mut registry, &refusals);
        let merged = match metrics_port {
            Some(port) => {
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.with_context(|| {
                    format!("--metrics-port {port}: cannot listen on 127.0.0.1:{port}; pick a free port")
                })?;
                let merged = crate::metrics::MergedMetrics::new(labels.registry(&[]), vec![Arc::new(registry)]);
                let app = crate::metrics::router(merged.clone());
                tokio::spawn(async move {
                    let _ = axum::serve(listener, app).await;
                });
                Some(merged)
            }
            None => None,
        };
        let ui = Ui::new(job.spec.workload.steps);
        Ok(LocalRun {
            job,
            name,
            uid,
            transport,
            gpus,
            scratch,
            ui,
            coordinator_metrics,
            refusals,
            merged,
            metrics_port,
            keep_steps: false,
        })
    }

    /// Runs epoch after epoch until one finishes the job. With checkpoints on
    /// (`spec.checkpoint.everySteps`), a failed epoch restarts the gang, up to
    /// `spec.runPolicy.backoffLimit` times, from the newest checkpoint the trainer reported, as
    /// the operator does; without them a failure ends the run (a restart would start over).
    async fn epochs(&self, json: Option<&Path>) -> Result<(), Failure> {
        let spec = &self.job.spec;
        let limit = if spec.checkpoint.is_off() { 0 } else { spec.run_policy.backoff_limit };
        let mut resume: Option<rlplane_api::CheckpointRef> = None;
        let mut epoch = 0;
        let (plan, record) = loop {
            match self.epoch(epoch, resume.clone()).await {
                Ok(done) => break done,
                Err(Failure::Interrupted) => return Err(Failure::Interrupted),
                Err(f) if epoch >= limit => return Err(f),
                Err(f) => {
                    resume = self.ui.checkpoint().or(resume);
                    epoch += 1;
                    let from = match &resume {
                        Some(cp) => format!("resuming after step {} ({})", cp.step, cp.uri),
                        None => "no checkpoint yet: starting over".to_string(),
                    };
                    self.ui.line(format!(
                        "gang restart {epoch}/{limit} with epoch {epoch}, {from}; it failed: {}",
                        f.describe()
                    ));
                }
            }
        };
        let summary = Summary::of(&record);
        print!("{}", summary.table());
        if let Some(path) = json {
            let doc = JsonSummary {
                job: &self.name,
                mode: format!("{:?}", plan.mode),
                transport: format!("{:?}", self.transport),
                summary: &summary,
                steps: &record,
            };
            std::fs::write(path, serde_json::to_string_pretty(&doc)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// One epoch: its plan (resuming from `resume`), a fresh key, every rank and user process,
    /// the coordinator; the run's record once every rank exited cleanly.
    async fn epoch(
        &self,
        epoch: u32,
        resume: Option<rlplane_api::CheckpointRef>,
    ) -> Result<(WorkerPlan, RunRecord), Failure> {
        let scratch = self.scratch.join(format!("epoch-{epoch}"));
        std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
        let id =
            JobIdentity { name: self.name.clone(), namespace: "local".into(), uid: self.uid.clone(), epoch, resume };
        let addressing = LocalAddressing::new(&scratch);
        let mut plan = build_plan(&self.job.spec, &id, &addressing).map_err(|e| anyhow::anyhow!("{e}"))?;
        // A fresh key for each epoch, readable only by this user; the plan says where it is.
        let key_path = scratch.join("job.key");
        let key = crate::net::issue_key_file(&key_path)
            .with_context(|| format!("writing the job key {}", key_path.display()))?;
        plan.job.key_file = key_path.display().to_string();
        let auth = JobAuth::new(&plan.job.token, &key).counting_into(&self.refusals);
        for pod in &plan.pods {
            use std::os::unix::fs::DirBuilderExt;
            // This user's only, like everything under the scratch directory.
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&pod.ipc_dir)
                .with_context(|| format!("creating {}", pod.ipc_dir))?;
        }
        let plan_path = scratch.join("plan.json");
        std::fs::write(&plan_path, plan.to_json()).with_context(|| format!("writing {}", plan_path.display()))?;
        // Release the reserved ports only now; the coordinator binds its own at once.
        drop(addressing);
        let (control, tq) = bind_coordinator(&plan).await?;
        if epoch == 0 {
            self.ui.line(format!(
                "rlplane local: job {}, {:?} mode, {} processes ({} trainer, {} generation), refit over {:?}, {} steps",
                self.name,
                plan.mode,
                plan.processes.len(),
                plan.layout.trainer_world,
                plan.layout.generation_world,
                self.transport,
                plan.workload.steps
            ));
        }
        self.ui.resumed(plan.resume.clone());
        let mut sup = Supervisor::new(self.ui.sink());
        let user_processes = self.spawn(&plan, &plan_path, &scratch, &mut sup).await?;
        let outcome = {
            let observer =
                crate::metrics::MetricsObserver { inner: &self.ui, metrics: self.coordinator_metrics.clone() };
            let coordinated = coordinator::run(&plan, &auth, control, tq, &observer, self.keep_steps);
            tokio::pin!(coordinated);
            loop {
                tokio::select! {
                    r = &mut coordinated => break r.map_err(Failure::Coordinator),
                    e = sup.next_exit() => {
                        // A rank that exits before the coordinator is done has failed, whatever its code.
                        let Some(e) = e else { continue };
                        // A user process may end once it has read the job's end (its rank notices
                        // one that ends early: it no longer answers).
                        if e.success() && user_processes.contains(&e.name) { continue; }
                        let mut msg = e.describe();
                        if e.success() { msg.push_str(" before the run finished"); }
                        break Err(Failure::Error(anyhow::anyhow!(msg)));
                    }
                    _ = tokio::signal::ctrl_c() => break Err(Failure::Interrupted),
                }
            }
        };
        self.ui.finish();
        let record = match outcome {
            Ok(x) => x,
            Err(Failure::Coordinator(e)) => {
                // The coordinator often notices a dead rank first, and not always through that
                // rank: its connection drops, or a peer reports a refit that broke off. The
                // supervisor knows which rank died, its role and how. Prefer that.
                let why = match blame(&mut sup, e.rank(), Duration::from_secs(2)).await {
                    Some(exit) => anyhow::anyhow!("{}\n(coordinator: {e})", exit.describe()),
                    None => e.into(),
                };
                sup.stop(Duration::from_secs(5)).await;
                return Err(Failure::Error(why));
            }
            Err(f) => {
                sup.stop(Duration::from_secs(5)).await;
                return Err(f);
            }
        };
        // Every rank got Shutdown: wait for them to exit cleanly.
        let mut failures = Vec::new();
        while sup.running() > 0 {
            match tokio::time::timeout(Duration::from_secs(30), sup.next_exit()).await {
                Ok(Some(e)) if !e.success() => failures.push(e.describe()),
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => {
                    failures.push(format!("{} rank(s) did not exit within 30s of Shutdown", sup.running()));
                    sup.stop(Duration::from_secs(2)).await;
                    break;
                }
            }
        }
        if !failures.is_empty() {
            return Err(Failure::Error(anyhow::anyhow!(failures.join("\n"))));
        }
        Ok((plan, record))
    }

    /// Starts every rank but the coordinator, then the user's own containers; returns the names
    /// of the user's processes.
    async fn spawn(
        &self,
        plan: &WorkerPlan,
        plan_path: &Path,
        scratch: &Path,
        sup: &mut Supervisor,
    ) -> Result<std::collections::HashSet<String>, Failure> {
        // On GPUs every pod gets its own physical GPUs (pods' slots all start at 0), and the ranks
        // find pip's NCCL through a link on their library path.
        let (bases, library) = match &self.gpus {
            Some(info) => {
                if plan.job.epoch == 0 {
                    self.ui.line(format!("{} GPU(s): {}", info.devices, info.name));
                }
                (Some(crate::local::gpu_bases(plan, info.devices)?), crate::gpu::nccl_library_dir(scratch))
            }
            None => (None, None),
        };
        for (i, p) in plan.processes.iter().enumerate() {
            if i as u32 == plan.coordinator {
                continue;
            }
            let mut cmd = child_command(plan_path, &p.name, library.as_deref())?;
            if let Some(b) = &bases {
                cmd.env(crate::gpu::GPU_BASE_ENV, b[p.pod as usize].to_string());
            }
            sup.spawn(&p.name, &describe(plan, i as u32), cmd).with_context(|| format!("starting {}", p.name))?;
        }
        sup.watch();
        if let Some(m) = &self.merged {
            // The ranks announce their metrics endpoints when ready (they connect to the
            // coordinator afterwards, and wait for it).
            if let Err(e) = sup.wait_ready(Duration::from_secs(300)).await {
                let why = match e {
                    crate::supervisor::ReadyError::Exited(x) => x.describe(),
                    crate::supervisor::ReadyError::Timeout(names) => {
                        format!("not ready after 300s: {}", names.join(", "))
                    }
                };
                sup.stop(Duration::from_secs(5)).await;
                return Err(Failure::Error(anyhow::anyhow!(why)));
            }
            m.set_children(crate::pod::children_metrics(sup));
            if plan.job.epoch == 0 {
                self.ui.line(format!("metrics at http://127.0.0.1:{}/metrics", self.metrics_port.unwrap_or_default()));
            }
        }
        // The user's own trainer / engine containers, as the pods run them beside the worker.
        let mut user_processes = std::collections::HashSet::new();
        for u in user_commands(&self.job.spec, plan, bases.as_deref())? {
            let mut command = u.command;
            // The user's processes end with the epoch, whatever happens to it.
            command.kill_on_drop(true);
            sup.spawn(&u.name, &u.role, command).with_context(|| format!("starting {} ({})", u.name, u.role))?;
            user_processes.insert(u.name);
        }
        sup.watch();
        Ok(user_processes)
    }
}

/// A user container's command, ready to run as a child.
struct UserCommand {
    name: String,
    role: String,
    command: tokio::process::Command,
}

/// The containers of the job's user templates (`trainer.template`, `generation.template`), one
/// process per container per pod, with the environment the operator gives them in a pod: the
/// pod's socket directory (where the ranks' local API sockets are), its name, the container's own
/// `env` values, and on GPUs the pod's GPUs as CUDA devices 0, 1, ….
fn user_commands(
    spec: &rlplane_api::RLJobSpec,
    plan: &rlplane_api::WorkerPlan,
    gpu_bases: Option<&[u32]>,
) -> anyhow::Result<Vec<UserCommand>> {
    let mut out = Vec::new();
    for (index, pod) in plan.pods.iter().enumerate() {
        for template in spec.user_templates(pod.role) {
            let t = template.pod_template().map_err(|e| anyhow::anyhow!("a user template: {e}"))?;
            for c in t.spec.map(|s| s.containers).unwrap_or_default() {
                let argv: Vec<String> = c
                    .command
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .chain(c.args.clone().unwrap_or_default())
                    .collect();
                let Some((program, args)) = argv.split_first() else {
                    anyhow::bail!(
                        "container {} of the {} template has no command: rlplane local runs the container's command (it does not run images); set command (and args)",
                        c.name,
                        pod.role.short()
                    );
                };
                let mut cmd = tokio::process::Command::new(program);
                cmd.args(args);
                for e in c.env.unwrap_or_default() {
                    match e.value {
                        Some(v) => {
                            cmd.env(&e.name, v);
                        }
                        None => tracing::warn!(
                            container = %c.name,
                            env = %e.name,
                            "rlplane local only sets env values; valueFrom is left out"
                        ),
                    }
                }
                if let Some(dir) = &c.working_dir {
                    cmd.current_dir(dir);
                }
                cmd.env(rlplane_api::plan::IPC_DIR_ENV, &pod.ipc_dir).env("RLPLANE_POD", &pod.name);
                cmd.envs(spec.template_env(template));
                if let Some(bases) = gpu_bases
                    && pod.gpus > 0
                {
                    let base = bases[index];
                    let devices: Vec<String> = (base..base + pod.gpus).map(|g| g.to_string()).collect();
                    cmd.env("CUDA_VISIBLE_DEVICES", devices.join(","));
                }
                out.push(UserCommand {
                    name: format!("{}/{}", pod.name, c.name),
                    role: format!("the user's {} container {} in pod {}", pod.role.short(), c.name, pod.name),
                    command: cmd,
                });
            }
        }
    }
    Ok(out)
}

/// The exit of the child named `name`, skipping others.
/// The rank to blame for a failed coordinator, among the ranks that end abnormally within
/// `grace`. The order in which the supervisor sees exits is not the order of death, and a dead
/// rank takes others down with it (their peer or the control channel closes), so: a rank ended
/// by a signal (killed, crashed) is the cause; else the rank the coordinator named; else the
/// first failure seen.
async fn blame(sup: &mut Supervisor, named: Option<&str>, grace: Duration) -> Option<crate::supervisor::Exit> {
    let deadline = tokio::time::Instant::now() + grace;
    let mut settle_until = None;
    let mut failed = Vec::new();
    loop {
        let until = settle_until.unwrap_or(deadline).min(deadline);
        match tokio::time::timeout_at(until, sup.next_exit()).await {
            // Ended because the coordinator, failing, closed the control channel (a rank, or a
            // user process whose rank said so): a consequence. Without this, a rank that failed
            // alive (its Failed reply names it) but exits late — it first gives its user process
            // time to read the error — lost the blame to the first of these.
            Ok(Some(e)) if e.tail.iter().any(|l| l.contains(crate::roles::COORDINATOR_GONE)) => {}
            Ok(Some(e)) if !e.success() => {
                // Once the named rank's exit (or, with none named, the first failure) is in,
                // give the others a moment to be seen too.
                if settle_until.is_none() && named.is_none_or(|n| n == e.name) {
                    settle_until = Some(tokio::time::Instant::now() + Duration::from_millis(300));
                }
                failed.push(e);
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    let pick = failed
        .iter()
        .position(|e| e.signaled())
        .or_else(|| failed.iter().position(|e| Some(e.name.as_str()) == named))
        .unwrap_or(0);
    (pick < failed.len()).then(|| failed.swap_remove(pick))
}

/// The run's scratch directory: the job key, the plan and the sockets live in it, so it is this
/// user's only (0700), whatever the umask.
fn tempdir(name: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::env::temp_dir();
    for n in 0..1000u32 {
        let p = base.join(format!("rlplane-{name}-{}-{n}", std::process::id()));
        if std::fs::DirBuilder::new().mode(0o700).create(&p).is_ok() {
            return Ok(p);
        }
    }
    anyhow::bail!("cannot create a scratch directory under {}", base.display())
}

/// Progress display: a bar per step on a terminal, plain lines otherwise.
struct Ui {
    steps: u32,
    bars: Option<(MultiProgress, ProgressBar)>,
    phases: Mutex<HashMap<u32, &'static str>>,
    /// The newest checkpoint of the current epoch: the trainer's last report, else the one the
    /// epoch resumed from.
    checkpoint: Mutex<Option<rlplane_api::CheckpointRef>>,
}

struct BarSink(MultiProgress);

impl OutputSink for BarSink {
    fn line(&self, line: String) {
        let _ = self.0.println(line);
    }
}

impl Ui {
    fn new(steps: u32) -> Arc<Ui> {
        let bars = std::io::stderr().is_terminal().then(|| {
            let mp = MultiProgress::new();
            let bar = mp.add(ProgressBar::new(steps as u64));
            bar.set_style(
                ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {elapsed_precise} {msg}")
                    .expect("a valid template")
                    .progress_chars("=> "),
            );
            bar.enable_steady_tick(Duration::from_millis(100));
            (mp, bar)
        });
        Arc::new(Ui { steps, bars, phases: Mutex::new(HashMap::new()), checkpoint: Mutex::new(None) })
    }

    /// A new epoch begins, resuming from `from` (if any).
    fn resumed(&self, from: Option<rlplane_api::CheckpointRef>) {
        if let Some(cp) = &from {
            self.line(format!("resuming after the checkpoint of step {}: {}", cp.step, cp.uri));
        }
        *self.checkpoint.lock().expect("checkpoint lock") = from;
    }

    /// The newest checkpoint of the current epoch.
    fn checkpoint(&self) -> Option<rlplane_api::CheckpointRef> {
        self.checkpoint.lock().expect("checkpoint lock").clone()
    }

    fn sink(self: &Arc<Self>) -> Arc<dyn OutputSink> {
        match &self.bars {
            Some((mp, _)) => Arc::new(BarSink(mp.clone())),
            None => Arc::new(crate::supervisor::Stderr),
        }
    }

    fn line(&self, line: String) {
        match &self.bars {
            Some((mp, _)) => {
                let _ = mp.println(line);
            }
            None => eprintln!("{line}"),
        }
    }

    fn finish(&self) {
        if let Some((_, bar)) = &self.bars {
            bar.finish_and_clear();
        }
    }
}

impl Observer for Arc<Ui> {
    fn progress(&self, event: Progress) {
        match event {
            Progress::Connected { ranks } => self.line(format!("all {ranks} ranks connected")),
            Progress::InitialSync { version, seconds } => {
                self.line(format!("initial weights (version {version}) loaded into every engine in {seconds:.3}s"))
            }
            Progress::Phase { step, phase } => {
                self.phases.lock().expect("phase lock").insert(step, phase);
                if let Some((_, bar)) = &self.bars {
                    bar.set_message(format!("step {step}: {phase}"));
                }
            }
            Progress::Stalled(Some(stall)) => {
                if let Some((_, bar)) = &self.bars {
                    bar.set_message(stall.message());
                }
            }
            Progress::Stalled(None) => {}
            Progress::Checkpoint(cp) => {
                self.line(format!("the trainer saved a checkpoint of step {}: {}", cp.step, cp.uri));
                *self.checkpoint.lock().expect("checkpoint lock") = Some(cp);
            }
            Progress::StepDone(r) => {
                let scalars: String = r.scalars.iter().map(|(k, v)| format!(", {k} {v:.4}")).collect();
                let line = format!(
                    "step {}/{}: {:.3}s (generate {:.3}s, transfer {:.3}s, train {:.3}s, refit {:.4}s), {} samples, {} tokens, imbalance {:.3}, weights v{} everywhere{scalars}",
                    r.step,
                    self.steps,
                    r.total_s,
                    r.generate_s,
                    r.transfer_s,
                    r.train_s,
                    r.refit_s,
                    r.samples,
                    r.tokens,
                    r.imbalance,
                    r.version
                );
                match &self.bars {
                    Some((_, bar)) => {
                        bar.inc(1);
                        bar.println(line);
                    }
                    None => eprintln!("{line}"),
                }
            }
        }
    }
}
