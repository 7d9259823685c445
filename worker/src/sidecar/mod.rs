//! The sidecar's local API: a user's own trainer or engine process calls its rank over a Unix
//! socket (docs/local-api.md) and the rank does refit and the transfer queue with the user's
//! memory, over the same transports as the synthetic roles.
//!
//! - [`protocol`]: framing, requests, error kinds.
//! - [`weights`]: the user's registered tensors (shared memory, CUDA IPC) as refit memory.
//! - `session`: one connection's requests.
//!
//! A rank in user mode owns a [`LocalApi`]: the state it shares with the session. The rank's command
//! loop (driven by the coordinator) and the session (driven by the user) meet in it: the rank
//! hands a batch or a step to the user and waits for the user's publish or end of step; the
//! session waits for what the rank provides. Neither knows the other's code.

pub mod protocol;
mod session;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rlplane_api::plan::{ProcessRole, WorkerPlan};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::gpu::Gpu;
use crate::refit::{TransportKind, WeightsState};
use crate::tq::{Batch, DType, TqClient};
use weights::{MemoryKind, UserWeights};

/// Which side of the API a rank serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A trainer rank: registers, publishes, gets batches.
    Trainer,
    /// A generation rank: registers (or stages), waits for versions, puts rollouts.
    Engine,
}

impl Role {
    /// The name in sockets and in `hello`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Trainer => "trainer",
            Role::Engine => "engine",
        }
    }
}

/// What one connection does on its rank, chosen in `hello` (`session`): everything, or one of
/// the two halves of an engine rank, so that an engine whose rollouts come from one process (vLLM's
/// driver) and whose weights live in others (its tensor-parallel workers) can use its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every call of the rank's role (the default).
    All,
    /// An engine's steps and rollouts: `next_step`, `put`, `end_step` (and `version`).
    Rollouts,
    /// An engine's weights: `register_weights`, `acquire_staged`, `release_staged` (and
    /// `version`, `wait_version`).
    Weights,
}

impl Scope {
    /// The scope `hello` names (`None`: the default, `all`).
    pub fn parse(name: Option<&str>) -> Option<Scope> {
        match name {
            None | Some("all") => Some(Scope::All),
            Some("rollouts") => Some(Scope::Rollouts),
            Some("weights") => Some(Scope::Weights),
            Some(_) => None,
        }
    }

    /// The name in `hello`.
    pub fn name(self) -> &'static str {
        match self {
            Scope::All => "all",
            Scope::Rollouts => "rollouts",
            Scope::Weights => "weights",
        }
    }

    /// Whether two connections of these scopes would drive the same calls.
    fn overlaps(self, other: Scope) -> bool {
        self == Scope::All || other == Scope::All || self == other
    }

    /// Whether this scope registers and loads the rank's weights.
    fn owns_weights(self) -> bool {
        matches!(self, Scope::All | Scope::Weights)
    }

    /// Whether this scope takes the rank's steps and puts rollouts.
    fn owns_rollouts(self) -> bool {
        matches!(self, Scope::All | Scope::Rollouts)
    }
}

/// What a session needs to know about its rank (fixed for the rank's life).
pub struct RankInfo {
    /// The plan.
    pub plan: Arc<WorkerPlan>,
    /// This process.
    pub me: u32,
    /// Its side of the API.
    pub role: Role,
    /// The refit transport (which memory the user registers).
    pub kind: TransportKind,
    /// The rank's GPU (CUDA IPC handles are opened on it).
    pub gpu: Option<Gpu>,
    /// The shape this rank holds of each of the model's tensors (`None`: none of it).
    pub expected: Vec<Option<Vec<u64>>>,
    /// Where that part starts in the full tensor, along each dimension (`None`: none of it).
    pub offsets: Vec<Option<Vec<u64>>>,
    /// Where this rank's shared-memory files go.
    pub shm_dir: PathBuf,
    /// Engine producers: the transfer-queue client that puts into the local storage unit.
    pub tq: Option<Arc<TqClient>>,
}

impl RankInfo {
    /// Permission bits of what this rank's sidecar shares with the user's processes (its socket,
    /// staged weights, batch files): its own user's only where the plan says every process runs
    /// as one user, else every user's (a user's container may run as another uid).
    pub fn shared_mode(&self) -> u32 {
        if self.plan.pods[self.plan.process(self.me).pod as usize].private_ipc { 0o600 } else { 0o666 }
    }

    fn memory_kind(&self) -> MemoryKind {
        if self.kind == TransportKind::Tcp { MemoryKind::Host } else { MemoryKind::Device }
    }

    fn producer(&self) -> bool {
        matches!(self.plan.process(self.me).role, ProcessRole::Generation(c) if c.producer)
    }

    /// A file name prefix unique to this rank of this job epoch.
    fn file_prefix(&self) -> String {
        format!("rlplane-{}-{}", self.plan.job.token, self.plan.process(self.me).name)
    }

    /// The `hello` reply.
    fn hello(&self) -> Value {
        let p = self.plan.process(self.me);
        // A trainer rank's index in its fully-sharded group (what its FSDP mesh must call it).
        let fsdp = match p.role {
            ProcessRole::Trainer(c) => Some(c.dp % self.plan.layout.fsdp),
            _ => None,
        };
        let (rank, dp, tp, pp, leader, engine, engine_rank, producer) = match p.role {
            ProcessRole::Trainer(c) => (c.rank, Some(c.dp), Some(c.tp), Some(c.pp), c.leader, None, None, false),
            ProcessRole::Generation(c) => {
                (c.rank, None, None, None, false, Some(c.engine), Some(c.engine_rank), c.producer)
            }
            _ => (0, None, None, None, false, None, None, false),
        };
        let weights: Vec<Value> = self
            .plan
            .manifest()
            .iter()
            .zip(self.expected.iter().zip(&self.offsets))
            .map(|(t, (e, o))| {
                let mut v = json!({"name": t.name, "dtype": t.dtype.as_str(), "shape": t.shape});
                if let Some(s) = e {
                    v["shard_shape"] = json!(s);
                }
                if let Some(o) = o {
                    v["shard_offset"] = json!(o);
                }
                v
            })
            .collect();
        json!({
            "ok": true,
            "protocol": protocol::PROTOCOL_VERSION,
            "rank": {"name": p.name, "role": self.role.name(), "rank": rank, "dp": dp, "tp": tp, "pp": pp,
                     "fsdp": fsdp, "fsdp_size": fsdp.map(|_| self.plan.layout.fsdp),
                     "leader": leader, "engine": engine, "engine_rank": engine_rank, "producer": producer,
                     "local": role_local_index(&self.plan, self.me)},
            "job": {"name": self.plan.job.name, "namespace": self.plan.job.namespace, "epoch": self.plan.job.epoch,
                    "steps": self.plan.workload.steps,
                    "checkpoint_every": self.plan.checkpoint.every_steps,
                    "max_policy_lag": self.plan.schedule.max_lag(),
                    "resume": self.plan.resume.as_ref().map(|r| json!({
                        "step": self.plan.first_version(), "version": self.plan.first_version(), "uri": r.uri})),
                    "first_step": self.plan.first_version() + 1},
            "device": if self.plan.device == rlplane_api::Device::Gpu { "gpu" } else { "cpu" },
            "gpu": self.gpu.as_ref().map(|g| json!({"ordinal": g.ordinal()})),
            "transport": match self.kind { TransportKind::Tcp => "tcp", TransportKind::Nccl => "nccl", TransportKind::Ipc => "cuda_ipc" },
            "shm_dir": self.shm_dir.display().to_string(),
            "weights": weights,
        })
    }
}

/// The index of process `me` among its pod's processes of the same role (trainer or generation):
/// what names its socket.
pub fn role_local_index(plan: &WorkerPlan, me: u32) -> u32 {
    let p = plan.process(me);
    let same = |r: &ProcessRole| {
        matches!(
            (r, &p.role),
            (ProcessRole::Trainer(_), ProcessRole::Trainer(_))
                | (ProcessRole::Generation(_), ProcessRole::Generation(_))
        )
    };
    plan.processes.iter().take(me as usize).filter(|q| q.pod == p.pod && same(&q.role)).count() as u32
}

/// The socket of process `me`: `<ipc dir>/<trainer|engine>-<local index>.sock`.
pub fn socket_path(plan: &WorkerPlan, me: u32) -> PathBuf {
    let p = plan.process(me);
    let role = match p.role {
        ProcessRole::Trainer(_) => "trainer",
        _ => "engine",
    };
    Path::new(&plan.pods[p.pod as usize].ipc_dir).join(format!("{role}-{}.sock", role_local_index(plan, me)))
}

/// Where shared-memory files go: `$RLPLANE_SHM_DIR`, else /dev/shm, else the system's temporary
/// directory (machines without /dev/shm).
pub fn shm_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(SHM_DIR_ENV) {
        return PathBuf::from(d);
    }
    let dev = Path::new("/dev/shm");
    if dev.is_dir() { dev.to_path_buf() } else { std::env::temp_dir() }
}

/// Environment variable naming the shared-memory directory.
pub const SHM_DIR_ENV: &str = "RLPLANE_SHM_DIR";

/// Rollouts put during a step.
#[derive(Clone, Copy, Debug, Default)]
pub struct PutTotals {
    /// Samples.
    pub samples: u64,
    /// Value bytes.
    pub bytes: u64,
    /// Tokens.
    pub tokens: u64,
    /// Seconds spent putting.
    pub seconds: f64,
}

#[derive(Default)]
struct State {
    /// The scopes of the sessions connected now (none overlap).
    sessions: Vec<Scope>,
    /// Weights registered (their generation; staged or not).
    registered: Option<(u64, bool)>,
    /// The user process failed (said so, or went away): the rank's waits fail with this.
    user_error: Option<String>,
    /// The rank failed: the session's waits answer `failed` with this.
    rank_error: Option<String>,
    /// The job ended.
    done: bool,
    // Trainer.
    /// The version the next publish must carry.
    next_version: u64,
    /// The `next_batch` reply waiting for the user.
    batch: Option<Value>,
    /// The latest version the user published.
    published: Option<u64>,
    /// The outcome of publishing a version.
    refit: Option<(u64, Result<Value, String>)>,
    /// A checkpoint the user saved that the coordinator has not heard of yet.
    checkpoint: Option<rlplane_api::CheckpointRef>,
    /// Scalars the user reported for the current step that the coordinator has not heard of yet.
    scalars: std::collections::BTreeMap<String, f64>,
    // Engine.
    /// The step the coordinator asked for, and whether `next_step` handed it out.
    step: Option<(u32, bool)>,
    /// The last step the user ended.
    ended: Option<u32>,
    put: PutTotals,
    held: WeightsState,
    /// The staged version lent to the engine.
    lent: Option<u64>,
    /// Staged registration: the version the engine last took from the staging buffers (what it
    /// generates with).
    taken: Option<u64>,
    /// Staged registration: the version the engine first took in the step under way (the
    /// oldest its rollouts can hold, with partial rollouts).
    step_first: Option<u64>,
    /// The oldest version the step under way may be generated with.
    min_version: u64,
    /// What a refit is writing into now, if anything.
    writing: Option<RefitTarget>,
    /// Files this rank wrote for the user (batches, staging), removed when the rank ends.
    files: Vec<PathBuf>,
}

/// What a refit writes into on an engine rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RefitTarget {
    /// The engine's own registered tensors: no step may start until it is done.
    Engine,
    /// The sidecar's staging buffers: they are not lent (`acquire_staged`) until it is done, so
    /// the engine never loads a mix of two versions.
    Staging,
}

impl State {
    /// Engine, staged: the refit may write the staging buffers once the engine gave them back;
    /// from then on they are not lent until the refit is done ([`LocalApi::end_refit_write`]).
    /// Checking and marking happen under one lock, so a loan cannot slip in between.
    fn begin_staging_write(&mut self) -> Option<()> {
        self.lent.is_none().then(|| self.writing = Some(RefitTarget::Staging))
    }

    /// Whether the engine registered staged (refit fills the sidecar's buffers; the engine takes
    /// them itself).
    fn staged(&self) -> bool {
        self.registered.is_some_and(|(_, staged)| staged)
    }
}

struct Shared {
    state: Mutex<State>,
    changed: watch::Sender<u64>,
    weights: tokio::sync::Mutex<Option<UserWeights>>,
}

/// A rank's end of the local API: the state its command loop shares with the user's sessions.
/// See the module docs.
#[derive(Clone)]
pub struct LocalApi {
    info: Arc<RankInfo>,
    shared: Arc<Shared>,
}

impl LocalApi {
    /// Binds the rank's socket and serves sessions until the rank ends: one at a time, or an
    /// engine's rollouts and weights sessions side by side ([`Scope`]).
    pub fn start(info: RankInfo) -> anyhow::Result<LocalApi> {
        let path = socket_path(&info.plan, info.me);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).with_context(|| {
            format!(
                "binding the local API socket {}{}",
                path.display(),
                if path.as_os_str().len() > 107 {
                    " (a Unix socket's path is at most 107 bytes: the plan's pods[].ipcDir must be shorter)"
                } else {
                    ""
                }
            )
        })?;
        // Users' containers may run as another user than the worker; locally, no one else may.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(info.shared_mode()))
            .with_context(|| format!("setting the permissions of the local API socket {}", path.display()))?;
        let (changed, _) = watch::channel(0);
        // A resumed run's first publish is the restored checkpoint's version.
        let first_version = info.plan.first_version() as u64;
        let local_api = LocalApi {
            info: Arc::new(info),
            shared: Arc::new(Shared {
                state: Mutex::new(State { next_version: first_version, ..State::default() }),
                changed,
                weights: tokio::sync::Mutex::new(None),
            }),
        };
        let serving = local_api.clone();
        tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let l = serving.clone();
                        tokio::spawn(async move { session::serve(l, stream).await });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting on the local API socket");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        tracing::info!(socket = %path.display(), "local API listening");
        Ok(local_api)
    }

    /// The rank's description.
    pub fn info(&self) -> &RankInfo {
        &self.info
    }

    fn update<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let out = f(&mut self.shared.state.lock().expect("local API state"));
        self.shared.changed.send_modify(|n| *n += 1);
        out
    }

    fn peek<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&self.shared.state.lock().expect("local API state"))
    }

    /// Waits until `f` gives an answer, or `deadline`. `f` sees the state under its lock.
    async fn wait<T>(
        &self,
        deadline: Option<Instant>,
        mut f: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<T, WaitTimedOut> {
        let mut rx = self.shared.changed.subscribe();
        loop {
            {
                let mut s = self.shared.state.lock().expect("local API state");
                if let Some(v) = f(&mut s) {
                    drop(s);
                    self.shared.changed.send_modify(|n| *n += 1);
                    return Ok(v);
                }
            }
            match deadline {
                Some(d) => match tokio::time::timeout_at(d, rx.changed()).await {
                    Ok(_) => {}
                    Err(_) => return Err(WaitTimedOut),
                },
                None => {
                    let _ = rx.changed().await;
                }
            }
        }
    }

    /// Waits (rank side) until `f` answers; fails when the user process failed or `deadline`
    /// passes, saying what the rank was waiting for.
    async fn rank_wait<T>(
        &self,
        deadline: Instant,
        what: &str,
        mut f: impl FnMut(&mut State) -> Option<T>,
    ) -> anyhow::Result<T> {
        let role = self.info.role.name();
        let r = self
            .wait(Some(deadline), |s| {
                if let Some(e) = &s.user_error {
                    return Some(Err(anyhow::anyhow!("{e}")));
                }
                f(s).map(Ok)
            })
            .await;
        match r {
            Ok(v) => v,
            Err(WaitTimedOut) => {
                let connected = self.peek(|s| !s.sessions.is_empty());
                anyhow::bail!(
                    "timed out waiting for the {role} process to {what}{}",
                    if connected {
                        ""
                    } else {
                        " (no process is connected to this rank's local API socket: is the user's container running, and does it connect to the right socket?)"
                    }
                )
            }
        }
    }

    /// The registered weights (or staging buffers), locked for a refit.
    pub async fn weights(&self) -> tokio::sync::MutexGuard<'_, Option<UserWeights>> {
        self.shared.weights.lock().await
    }

    /// Waits until the user registered weights.
    pub async fn wait_registered(&self, deadline: Instant) -> anyhow::Result<()> {
        self.rank_wait(deadline, "register its weights", |s| s.registered.map(|_| ())).await
    }

    /// Trainer: writes step `step`'s batch for the user's `next_batch`.
    pub fn deliver_batch(&self, step: u32, batch: &Batch) -> anyhow::Result<()> {
        let (reply, path) = session::write_batch(&self.info, step, batch)?;
        self.update(|s| {
            s.files.retain(|f| f.exists());
            s.files.push(path);
            s.batch = Some(reply);
            s.next_version = step as u64;
        });
        Ok(())
    }

    /// Trainer: waits for the user to publish `version`.
    pub async fn wait_published(&self, version: u64, deadline: Instant) -> anyhow::Result<()> {
        self.rank_wait(deadline, &format!("publish version {version}"), |s| {
            s.published.filter(|&p| p >= version).map(|_| ())
        })
        .await
    }

    /// Trainer: the checkpoint the user saved since the last update's report, if any.
    pub fn take_checkpoint(&self) -> Option<rlplane_api::CheckpointRef> {
        self.update(|s| s.checkpoint.take())
    }

    /// The scalars the user reported for the step since the last report (see `report_scalars`).
    pub fn take_scalars(&self) -> std::collections::BTreeMap<String, f64> {
        self.update(|s| std::mem::take(&mut s.scalars))
    }

    /// Trainer: the refit of `version` ended (answers the user's `publish`).
    pub fn refit_finished(&self, version: u64, outcome: Result<Value, String>) {
        self.update(|s| s.refit = Some((version, outcome)));
    }

    /// Engine producer: step `step` starts; it must be generated with weights of `min_version`
    /// or newer.
    pub fn start_step(&self, step: u32, min_version: u64) {
        self.update(|s| {
            s.step = Some((step, false));
            s.min_version = min_version;
            s.put = PutTotals::default();
        });
    }

    /// Engine, direct registration: waits until no step is under way (the engine is between
    /// `end_step` and its next `next_step`), then holds the next step back until
    /// [`LocalApi::end_refit_write`]: a refit into the engine's own tensors never lands during a
    /// forward pass.
    pub async fn begin_direct_refit(&self, deadline: Instant) -> anyhow::Result<()> {
        self.rank_wait(deadline, "end the step under way (end_step) before the refit writes its weights", |s| {
            let under_way = matches!(s.step, Some((st, true)) if s.ended != Some(st));
            (!under_way).then(|| s.writing = Some(RefitTarget::Engine))
        })
        .await
    }

    /// Engine: the refit is done writing, the engine's tensors or the staging buffers (also when
    /// it failed).
    pub fn end_refit_write(&self) {
        self.update(|s| s.writing = None);
    }

    /// Engine producer: waits until the user ended step `step`; returns what it put.
    pub async fn wait_step_ended(&self, step: u32, deadline: Instant) -> anyhow::Result<PutTotals> {
        self.rank_wait(deadline, &format!("generate step {step} (next_step … put … end_step)"), |s| {
            (s.ended == Some(step)).then_some(s.put)
        })
        .await
    }

    /// Engine: the weights' state after a refit (answers `version`, `wait_version`).
    pub fn set_held(&self, held: WeightsState) {
        self.update(|s| s.held = held);
    }

    /// Engine, staged: waits until the engine gave the staging buffers back, then keeps them
    /// from being lent until [`LocalApi::end_refit_write`].
    pub async fn begin_staging_write(&self, deadline: Instant) -> anyhow::Result<()> {
        self.rank_wait(deadline, "release the staged weights (release_staged)", State::begin_staging_write).await
    }

    /// Whether the registration is staged.
    pub fn staged(&self) -> bool {
        self.peek(State::staged)
    }

    /// The job ended: pending calls answer `done`. Waits up to `grace` for the user process to
    /// hang up, so that it reads the answer before this rank exits.
    pub async fn shutdown(&self, grace: Duration) {
        self.update(|s| s.done = true);
        let _ = self.wait(Some(Instant::now() + grace), |s| s.sessions.is_empty().then_some(())).await;
        self.remove_files();
    }

    /// Removes the files this rank wrote for the user (mappings of them stay valid).
    fn remove_files(&self) {
        for f in self.update(|s| std::mem::take(&mut s.files)) {
            let _ = std::fs::remove_file(f);
        }
    }

    /// The rank failed: pending calls answer `failed` with `error`. Waits up to `grace` for the
    /// user process to read it.
    pub async fn fail(&self, error: &str, grace: Duration) {
        self.update(|s| s.rank_error = Some(error.to_string()));
        let _ = self.wait(Some(Instant::now() + grace), |s| s.sessions.is_empty().then_some(())).await;
        self.remove_files();
    }
}

/// A wait passed its deadline.
#[derive(Debug)]
struct WaitTimedOut;

/// The transfer queue's dtype names, as the local API spells them.
pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::Bool => "bool",
        DType::U8 => "u8",
        DType::I8 => "i8",
        DType::U16 => "u16",
        DType::I16 => "i16",
        DType::U32 => "u32",
        DType::I32 => "i32",
        DType::U64 => "u64",
        DType::I64 => "i64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        DType::F64 => "f64",
    }
}

/// A dtype by its local-API name.
pub fn parse_dtype(name: &str) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| dtype_name(d) == name)
}
