//! One connection to a rank's local API: the handshake, then requests answered in order.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;
use tokio::time::Instant;

use super::protocol::{
    self, ApiError, ColumnDesc, ErrorKind, MemoryDesc, PROTOCOL_VERSION, Request, TensorReg, invalid, state,
};
use super::weights::UserWeights;
use super::{LocalApi, RankInfo, RefitTarget, Role, Scope, State, dtype_name, parse_dtype};
use crate::refit::WeightsState;
use crate::shm::SharedFile;
use crate::tq::{Batch, Column, FieldSpec, PutOptions};

/// The longest checkpoint URI a trainer may report (it goes into the RLJob's status).
const MAX_CHECKPOINT_URI: usize = 4096;

/// The most scalars a rank reports per step, and the longest name: they become Prometheus
/// series and keys of the RLJob's status, which must stay small.
const MAX_SCALARS: usize = 32;
const MAX_SCALAR_NAME: usize = 64;

/// Serves one connection until it closes.
pub async fn serve(local_api: LocalApi, stream: UnixStream) {
    let (mut rd, mut wr) = stream.into_split();
    let mut session = Session { local_api: local_api.clone(), files: HashMap::new(), scope: None, clean: false };
    let outcome = session.run(&mut rd, &mut wr).await;
    // A connection that never said hello holds nothing.
    let Some(scope) = session.scope else { return };
    let role = local_api.info.role.name();
    local_api.update(|s| {
        if let Some(i) = s.sessions.iter().position(|&x| x == scope) {
            s.sessions.remove(i);
        }
        if session.clean || s.done {
            return;
        }
        // A process that registered weights and went away took its memory with it; one that
        // waited for a step is gone from the loop: either way the rank cannot go on.
        let stranded = (scope.owns_weights() && s.registered.is_some())
            || (scope.owns_rollouts() && s.step.is_some_and(|(_, handed)| handed))
            || (scope == Scope::All && s.published.is_some());
        if stranded {
            let why = match &outcome {
                Err(e) => format!(": {e}"),
                Ok(()) => String::new(),
            };
            let what = if scope == Scope::All { String::new() } else { format!(" ({} session)", scope.name()) };
            s.user_error = Some(format!(
                "the {role} process{what} closed its connection to the sidecar before the job ended (did it exit or crash?){why}"
            ));
        }
    });
    if session.clean && scope.owns_weights() {
        // `bye`: the registration goes with the process.
        if let Ok(mut w) = local_api.shared.weights.try_lock() {
            *w = None;
            local_api.update(|s| s.registered = None);
        }
    }
}

struct Session {
    local_api: LocalApi,
    /// Shared-memory files of puts, by path (the client reuses its arena).
    files: HashMap<String, Arc<SharedFile>>,
    /// What this connection does, once its `hello` was accepted.
    scope: Option<Scope>,
    clean: bool,
}

/// What a request asks the session to wait for.
enum Reply {
    Now(Value),
    Close(Value),
}

impl Session {
    async fn run(
        &mut self,
        rd: &mut tokio::net::unix::OwnedReadHalf,
        wr: &mut tokio::net::unix::OwnedWriteHalf,
    ) -> anyhow::Result<()> {
        loop {
            let Some(msg) = protocol::read_message(rd).await? else { return Ok(()) };
            let reply = match protocol::parse(&msg) {
                Err(e) if e.kind == ErrorKind::Protocol => Reply::Close(e.reply()),
                Err(e) => Reply::Now(e.reply()),
                Ok(req) => {
                    // A blocking request also watches the socket: a client that goes away while
                    // it waits is noticed at once.
                    let handled = self.handle(req);
                    tokio::pin!(handled);
                    let mut probe = [0u8; 1];
                    tokio::select! {
                        r = &mut handled => match r {
                            Ok(r) => r,
                            Err(e) if e.kind == ErrorKind::Protocol => Reply::Close(e.reply()),
                            Err(e) => Reply::Now(e.reply()),
                        },
                        n = rd.read(&mut probe) => {
                            return match n {
                                Ok(0) | Err(_) => Ok(()),
                                Ok(_) => {
                                    let e = ApiError::new(ErrorKind::Protocol, "a request sent before the previous one was answered; one request at a time");
                                    let _ = protocol::write_message(wr, &e.reply()).await;
                                    Ok(())
                                }
                            };
                        }
                    }
                }
            };
            match reply {
                Reply::Now(v) => protocol::write_message(wr, &v).await?,
                Reply::Close(v) => {
                    protocol::write_message(wr, &v).await?;
                    return Ok(());
                }
            }
        }
    }

    fn role(&self) -> Role {
        self.local_api.info.role
    }

    fn need(&self, role: Role, op: &str) -> Result<(), ApiError> {
        if self.role() != role {
            return Err(state(format!(
                "{op} is a {} call; this is a {} rank's socket",
                role.name(),
                self.role().name()
            )));
        }
        Ok(())
    }

    /// Answers one request of the local API: checks that it may come now, then does it.
    async fn handle(&mut self, req: Request) -> Result<Reply, ApiError> {
        self.check_order(&req)?;
        Ok(match req {
            Request::Hello { protocol, role, session, .. } => Reply::Now(self.hello(protocol, &role, session)?),
            Request::RegisterWeights { mode, tensors, name_map } => {
                Reply::Now(self.register_weights(mode.as_deref(), &tensors, &name_map)?)
            }
            Request::Publish { version } => Reply::Now(self.publish(version).await?),
            Request::CheckpointSaved { step, uri } => {
                self.checkpoint_saved(step, uri)?;
                Reply::Now(json!({"ok": true}))
            }
            Request::CheckGpus { uuids } => {
                self.check_gpus(&uuids)?;
                Reply::Now(json!({"ok": true}))
            }
            Request::ReportScalars { step, values } => {
                self.report_scalars(step, values)?;
                Reply::Now(json!({"ok": true}))
            }
            Request::NextBatch {} => Reply::Now(self.next_batch().await?),
            Request::NextStep {} => Reply::Now(self.next_step().await?),
            Request::Put { step, keys, tokens, tags, columns } => {
                self.need(Role::Engine, "put")?;
                self.check_put_step(step)?;
                Reply::Now(self.put(step, keys, tokens, tags, &columns).await?)
            }
            Request::EndStep { step } => {
                self.end_step(step)?;
                Reply::Now(json!({"ok": true}))
            }
            Request::Version {} => {
                self.need(Role::Engine, "version")?;
                let held = self.local_api.peek(|s| s.held);
                Reply::Now(held_reply(held))
            }
            Request::WaitVersion { version, timeout_s } => {
                self.need(Role::Engine, "wait_version")?;
                let deadline = deadline_of(timeout_s)?;
                let held = self.wait_held(version, deadline).await?;
                Reply::Now(held_reply(held))
            }
            Request::AcquireStaged { version, timeout_s } => Reply::Now(self.acquire_staged(version, timeout_s).await?),
            Request::ReleaseStaged {} => {
                self.need(Role::Engine, "release_staged")?;
                self.local_api.update(|s| s.lent = None);
                Reply::Now(json!({"ok": true}))
            }
            Request::Fail { message } => {
                let reason = format!("the {} process reported a failure: {message}", self.role().name());
                // Logged at once, so the rank's log carries the user's reason even where the
                // process's exit is noticed before the rank's failure reaches the coordinator.
                tracing::error!("{reason}");
                self.local_api.update(|s| s.user_error = Some(reason));
                Reply::Now(json!({"ok": true}))
            }
            Request::Bye {} => {
                self.clean = true;
                Reply::Close(json!({"ok": true}))
            }
        })
    }

    /// Refuses a request out of turn: `hello` first and once, then only calls of the
    /// connection's scope.
    fn check_order(&self, req: &Request) -> Result<(), ApiError> {
        match (self.scope, req) {
            (None, Request::Hello { .. }) => Ok(()),
            (None, _) => Err(ApiError::new(ErrorKind::Protocol, "the first request must be hello")),
            (Some(_), Request::Hello { .. }) => {
                Err(ApiError::new(ErrorKind::Protocol, "hello was already said on this connection"))
            }
            (Some(scope), req) => check_scope(scope, req),
        }
    }

    /// `hello`: checks the client's protocol and role, claims the session it asks for, and
    /// answers what the client needs to know of the rank.
    fn hello(&mut self, protocol: u32, role: &str, session: Option<String>) -> Result<Value, ApiError> {
        if protocol != PROTOCOL_VERSION {
            return Err(ApiError::new(
                ErrorKind::Protocol,
                format!(
                    "protocol {protocol} is not spoken here; this sidecar speaks {PROTOCOL_VERSION}: upgrade the client or the worker image so they match"
                ),
            ));
        }
        if role != self.role().name() {
            return Err(state(format!(
                "hello as {role} on a {} rank's socket ({}); connect to the {role}'s socket",
                self.role().name(),
                super::socket_path(&self.local_api.info.plan, self.local_api.info.me).display()
            )));
        }
        let scope = self.claim(session.as_deref())?;
        self.scope = Some(scope);
        let mut reply = self.local_api.info.hello();
        reply["session"] = json!(scope.name());
        Ok(reply)
    }

    /// `register_weights`: maps the user's tensors (direct) or allocates the sidecar's buffers
    /// for an engine to load into (staged), and makes them the rank's weights. Refused while a
    /// refit holds the weights or an engine has the staged buffers lent.
    fn register_weights(
        &self,
        mode: Option<&str>,
        tensors: &[TensorReg],
        name_map: &BTreeMap<String, String>,
    ) -> Result<Value, ApiError> {
        let staged = match mode {
            None | Some("direct") => false,
            Some("staged") => true,
            Some(m) => return Err(invalid(format!("mode: {m:?}; use \"direct\" or \"staged\""))),
        };
        if staged && self.role() == Role::Trainer {
            return Err(invalid("mode: \"staged\" is for engines; a trainer registers its tensors directly"));
        }
        if staged && !tensors.is_empty() {
            return Err(invalid("mode \"staged\" takes no tensors: the sidecar allocates the buffers"));
        }
        let Ok(mut slot) = self.local_api.shared.weights.try_lock() else {
            return Err(state("a refit is under way; register again once publish / wait_version returns"));
        };
        if self.local_api.peek(|s| s.lent.is_some()) {
            return Err(state("the staged weights are lent (acquire_staged); release_staged first"));
        }
        let (w, staging) = if staged {
            let (w, d) = self.allocate_staging()?;
            (w, Some(d))
        } else {
            (self.map_registered(tensors, name_map)?, None)
        };
        let mut reply = json!({"ok": true, "tensors": w.tensors(), "bytes": w.total_bytes()});
        if let Some(d) = staging {
            reply["staging"] = Value::Array(d);
        }
        *slot = Some(w);
        drop(slot);
        self.local_api.update(|s| {
            let generation = s.registered.map_or(1, |(g, _)| g + 1);
            s.registered = Some((generation, staged));
            // Staged buffers hold nothing yet.
            if staged {
                s.held = WeightsState::Empty;
            }
        });
        Ok(reply)
    }

    /// The sidecar's own buffers for every tensor of the model, and their descriptors for the
    /// engine to map; a host file is recorded to be removed with the rank.
    fn allocate_staging(&self) -> Result<(UserWeights, Vec<Value>), ApiError> {
        let info = &self.local_api.info;
        let manifest = info.plan.manifest();
        let path = info.shm_dir.join(format!("{}-staging", info.file_prefix()));
        let mode = info.shared_mode();
        let (w, d) = UserWeights::staging(&manifest, info.memory_kind(), info.gpu.as_ref(), &path, mode)
            .map_err(|e| ApiError::new(ErrorKind::Failed, format!("allocating staging buffers: {e:#}")))?;
        if info.memory_kind() == super::weights::MemoryKind::Host {
            self.local_api.update(|s| s.files.push(path.clone()));
        }
        Ok((w, d))
    }

    /// The user's tensors, checked against what this rank holds of the model and mapped; an
    /// engine's are mapped writable, since refit writes into them.
    fn map_registered(
        &self,
        tensors: &[TensorReg],
        name_map: &BTreeMap<String, String>,
    ) -> Result<UserWeights, ApiError> {
        let info = &self.local_api.info;
        let manifest = info.plan.manifest();
        let writable = self.role() == Role::Engine;
        UserWeights::register(
            &manifest,
            &info.expected,
            tensors,
            name_map,
            info.memory_kind(),
            info.gpu.as_ref(),
            writable,
        )
    }

    /// `publish(version)`: the trainer's weights hold `version`; answers once its refit is over,
    /// with the refit's outcome.
    async fn publish(&self, version: u64) -> Result<Value, ApiError> {
        self.need(Role::Trainer, "publish")?;
        self.local_api.update(|s| -> Result<(), ApiError> {
            if s.registered.is_none() {
                return Err(state("publish before register_weights: register the tensors to send first"));
            }
            if version != s.next_version {
                return Err(state(format!(
                    "publish({version}) but the job is at version {}: publish 0 for the initial weights, then each step's number after training on its batch",
                    s.next_version
                )));
            }
            s.published = Some(version);
            Ok(())
        })?;
        let out = self
            .wait_session(None, |s| match &s.refit {
                Some((v, r)) if *v == version => Some(r.clone()),
                _ => None,
            })
            .await?;
        out.map_err(|e| ApiError::new(ErrorKind::Failed, e))
    }

    /// `checkpoint_saved`: keeps the trainer's newest checkpoint for the job's status, from which
    /// a gang restart resumes.
    fn checkpoint_saved(&self, step: u64, uri: String) -> Result<(), ApiError> {
        self.need(Role::Trainer, "checkpoint_saved")?;
        let first = self.local_api.info.plan.first_version() as u64;
        self.local_api.update(|s| -> Result<(), ApiError> {
            if uri.is_empty() || uri.len() > MAX_CHECKPOINT_URI {
                return Err(invalid(format!(
                    "checkpoint_saved: uri is {} bytes; give the path or URI of the checkpoint (1 to {MAX_CHECKPOINT_URI} bytes)",
                    uri.len()
                )));
            }
            if step < first || step > s.next_version {
                return Err(state(format!(
                    "checkpoint_saved(step={step}) but the trainer is at step {}: report the step whose state the checkpoint holds, after training on it",
                    s.next_version
                )));
            }
            s.checkpoint = Some(rlplane_api::CheckpointRef { step, uri });
            Ok(())
        })
    }

    /// `next_batch`: waits for the trainer's next batch, or answers `done` once the job ended.
    async fn next_batch(&self) -> Result<Value, ApiError> {
        self.need(Role::Trainer, "next_batch")?;
        let b = self.wait_session(None, |s| s.batch.take().map(Some).or(s.done.then_some(None))).await?;
        Ok(match b {
            Some(v) => v,
            None => json!({"ok": true, "done": true}),
        })
    }

    /// `next_step`: waits for the engine's next step to generate and hands it out, with the
    /// weights' version; answers `done` once the job ended.
    async fn next_step(&self) -> Result<Value, ApiError> {
        self.need(Role::Engine, "next_step")?;
        if !self.local_api.info.producer() {
            return Err(state(
                "next_step on an engine rank that is not its engine's producer: only tensor-parallel rank 0 of an engine generates and puts rollouts; the others only take weights (wait_version)",
            ));
        }
        let r = self
            .wait_session(None, |s| match s.step {
                Some((step, false)) if s.writing != Some(RefitTarget::Engine) => {
                    s.step = Some((step, true));
                    s.step_first = None;
                    Some(Some((step, s.held.current())))
                }
                _ => s.done.then_some(None),
            })
            .await?;
        Ok(match r {
            Some((step, version)) => json!({"ok": true, "step": step, "version": version}),
            None => json!({"ok": true, "done": true}),
        })
    }

    /// Refuses a `put` for any step but the one handed out and under way.
    fn check_put_step(&self, step: u32) -> Result<(), ApiError> {
        let current = self.local_api.peek(|s| s.step);
        if current != Some((step, true)) {
            return Err(state(format!(
                "put for step {step}, but {}",
                match current {
                    Some((s, true)) => format!("the step under way is {s}"),
                    _ => "no step is under way: call next_step first".into(),
                }
            )));
        }
        Ok(())
    }

    /// The version the engine generates step `step` with: the staged version it last took, or
    /// the one refit wrote into its own tensors. Refused when older than the step allows
    /// (`spec.schedule.maxPolicyLag`): a staged engine must take newer weights first.
    fn generating_version(&self, step: u32) -> Result<(Option<u64>, Option<u64>), ApiError> {
        let (first, last, min) = self.local_api.peek(|s| {
            let last = if s.staged() { s.taken } else { s.held.current() };
            let first = if s.staged() { s.step_first.or(s.taken) } else { last };
            (first, last, s.min_version)
        });
        match first {
            Some(v) if v < min => Err(state(format!(
                "step {step} must be generated with weights of version {min} or newer, and this engine last took \
                 version {v}: take the staged weights first (engine.staged(step.version))"
            ))),
            _ => Ok((first, last)),
        }
    }

    /// `end_step`: every rollout of the step under way is put.
    fn end_step(&self, step: u32) -> Result<(), ApiError> {
        self.need(Role::Engine, "end_step")?;
        self.local_api.update(|s| match s.step {
            Some((st, true)) if st == step => {
                s.ended = Some(step);
                Ok(())
            }
            _ => Err(state(format!("end_step({step}) but step {step} is not under way"))),
        })
    }

    /// `acquire_staged`: waits until the staged buffers hold `version` or newer and no refit is
    /// writing them, then lends them to the engine (a registration is refused, and the next
    /// refit waits, until it releases them).
    async fn acquire_staged(&self, version: u64, timeout_s: Option<f64>) -> Result<Value, ApiError> {
        self.need(Role::Engine, "acquire_staged")?;
        if !self.local_api.staged() {
            return Err(state(
                "acquire_staged without a staged registration: register_weights with mode \"staged\" first",
            ));
        }
        let deadline = deadline_of(timeout_s)?;
        let partial = self.local_api.info.plan.schedule.partial_rollouts;
        let v = self.wait_held_then(version, deadline, |s, _| lend_staged(s, partial)).await?;
        Ok(json!({"ok": true, "version": v}))
    }

    /// Checks that the rank's GPU is one the user's process sees: the worker opens the process's
    /// CUDA IPC handles and runs NCCL on that GPU, so both must see it. A mismatch fails the rank
    /// at once with what each side sees.
    fn check_gpus(&self, uuids: &[String]) -> Result<(), ApiError> {
        let info = &self.local_api.info;
        let Some(gpu) = &info.gpu else { return Ok(()) };
        let mine = gpu.uuid().map_err(|e| ApiError::new(ErrorKind::Failed, e.to_string()))?;
        let wanted = crate::gpu::normalize_uuid(&mine);
        if uuids.iter().any(|u| crate::gpu::normalize_uuid(u) == wanted) {
            return Ok(());
        }
        let name = &info.plan.process(info.me).name;
        let message = format!(
            "{name}'s GPU is {mine} (the worker's device {}), which the {} process does not see (it sees {}): the worker sidecar and the user's containers must share the pod's GPUs (spec.gpus: DevicePlugin with whole-node pods, or ResourceClaim), and the process's CUDA_VISIBLE_DEVICES must include its rank's GPU",
            gpu.ordinal(),
            self.role().name(),
            if uuids.is_empty() { "no GPU".to_string() } else { uuids.join(", ") }
        );
        self.local_api.update(|s| s.user_error = Some(message.clone()));
        Err(ApiError::new(ErrorKind::Mismatch, message))
    }

    /// Keeps scalars of the rank's current step for the step's report to the coordinator: a
    /// trainer's before it publishes the step, an engine's before it ends it.
    fn report_scalars(&self, step: u64, values: BTreeMap<String, f64>) -> Result<(), ApiError> {
        for (name, v) in &values {
            let well_formed = !name.is_empty()
                && name.len() <= MAX_SCALAR_NAME
                && name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !well_formed {
                return Err(invalid(format!(
                    "values: {name:?} is not a scalar name; use letters, digits and _ (not first a digit), at most {MAX_SCALAR_NAME} characters (it becomes a Prometheus label value and a status key)"
                )));
            }
            if !v.is_finite() {
                return Err(invalid(format!("values.{name}: {v} is not a finite number")));
            }
        }
        let role = self.role();
        self.local_api.update(|s| {
            let current = match role {
                // Its batch taken, the step not yet published.
                Role::Trainer => (s.batch.is_none() && s.published.is_some_and(|p| p < s.next_version))
                    .then_some(s.next_version),
                // Handed out, not yet ended.
                Role::Engine => {
                    s.step.filter(|&(st, handed)| handed && s.ended != Some(st)).map(|(st, _)| st as u64)
                }
            };
            if current != Some(step) {
                return Err(state(format!(
                    "report_scalars(step={step}) but {}: report a step's scalars while it is under way (a trainer before publish(step), an engine before end_step(step))",
                    match current {
                        Some(c) => format!("the step under way is {c}"),
                        None => "no step is under way".to_string(),
                    }
                )));
            }
            let fresh = values.keys().filter(|k| !s.scalars.contains_key(*k)).count();
            if s.scalars.len() + fresh > MAX_SCALARS {
                return Err(invalid(format!(
                    "values: more than {MAX_SCALARS} scalars for step {step}; report fewer names"
                )));
            }
            s.scalars.extend(values);
            Ok(())
        })
    }

    /// Takes the `session` scope `hello` asked for on this rank, if it is free.
    fn claim(&self, session: Option<&str>) -> Result<Scope, ApiError> {
        let scope = Scope::parse(session).ok_or_else(|| {
            invalid(format!(
                "session: {session:?}; use \"all\" (the default), or on an engine rank \"rollouts\" (the process that takes steps and puts rollouts) or \"weights\" (a process that registers or loads the weights)"
            ))
        })?;
        let info = &self.local_api.info;
        let name = &info.plan.process(info.me).name;
        if scope != Scope::All && self.role() == Role::Trainer {
            return Err(invalid(format!(
                "session: \"{}\" is for engine ranks; a trainer rank's process uses one session (leave session out)",
                scope.name()
            )));
        }
        if scope == Scope::Rollouts && !info.producer() {
            return Err(state(format!(
                "session \"rollouts\" on {name}, which is not its engine's producer: the engine's rollouts go through its tensor-parallel rank 0's socket; connect the driver there"
            )));
        }
        self.local_api.update(|s| {
            if let Some(held) = s.sessions.iter().find(|h| h.overlaps(scope)) {
                return Err(ApiError::new(
                    ErrorKind::Busy,
                    format!(
                        "another process holds {name}'s {} session on its local API socket, so a {} session cannot open: one process per rank (check LOCAL_RANK / RLPLANE_SOCKET), or an engine's driver with session \"rollouts\" beside one worker with session \"weights\"",
                        held.name(),
                        scope.name()
                    ),
                ));
            }
            s.sessions.push(scope);
            Ok(scope)
        })
    }

    /// Waits (session side) until `f` answers; answers `failed` once the rank failed, and
    /// `timeout` at `deadline`.
    async fn wait_session<T>(
        &self,
        deadline: Option<Instant>,
        mut f: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<T, ApiError> {
        let r = self
            .local_api
            .wait(deadline, |s| {
                if let Some(e) = &s.rank_error {
                    return Some(Err(ApiError::new(ErrorKind::Failed, format!("the rank failed: {e}"))));
                }
                f(s).map(Ok)
            })
            .await;
        match r {
            Ok(v) => v,
            Err(_) => Err(ApiError::new(ErrorKind::Timeout, "timed out; the job may be slower than the timeout given")),
        }
    }

    async fn wait_held(&self, version: u64, deadline: Option<Instant>) -> Result<WeightsState, ApiError> {
        self.wait_held_then(version, deadline, |_, held| Some(Ok(held))).await
    }

    /// Waits until the engine holds `version` or newer and `then` answers, under the same lock
    /// (so what `then` decides holds for the weights it saw).
    async fn wait_held_then<T>(
        &self,
        version: u64,
        deadline: Option<Instant>,
        mut then: impl FnMut(&mut State, WeightsState) -> Option<Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        let r = self
            .wait_session(deadline, |s| match s.held {
                WeightsState::Complete(v) if v >= version => then(s, s.held),
                WeightsState::Incomplete(v) => Some(Err(ApiError::new(
                    ErrorKind::Failed,
                    format!("the refit to version {v} did not finish: the weights are a mix of versions; the job restarts its gang"),
                ))),
                _ if s.done => Some(Err(ApiError::new(ErrorKind::Shutdown, "the job ended"))),
                _ => None,
            })
            .await;
        match r {
            Err(e) if e.kind == ErrorKind::Timeout => Err(ApiError::new(
                ErrorKind::Timeout,
                format!("version {version} did not arrive in time (holding {})", self.local_api.peek(|s| s.held)),
            )),
            Err(e) => Err(e),
            Ok(r) => r,
        }
    }

    fn file(&mut self, path: &str) -> Result<Arc<SharedFile>, ApiError> {
        if let Some(f) = self.files.get(path) {
            return Ok(f.clone());
        }
        let f = Arc::new(SharedFile::open(Path::new(path), false).map_err(|e| invalid(e.to_string()))?);
        // A file that grew since it was mapped is mapped again below when a range misses.
        self.files.insert(path.to_string(), f.clone());
        Ok(f)
    }

    fn read(&mut self, field: &str, m: &MemoryDesc) -> Result<Vec<u8>, ApiError> {
        let MemoryDesc::Shm { path, offset, nbytes } = m else {
            return Err(invalid(format!("{field}: rollouts are read from shared memory (kind \"shm\")")));
        };
        let mut f = self.file(path)?;
        if offset.saturating_add(*nbytes) > f.len() as u64 {
            // The client may have grown or replaced the file: map it again.
            self.files.remove(path);
            f = self.file(path)?;
        }
        f.read(*offset, *nbytes).map_err(|e| invalid(format!("{field}: {e}")))
    }

    async fn put(
        &mut self,
        step: u32,
        keys: Option<Vec<String>>,
        tokens: Option<Vec<u32>>,
        tags: Option<Vec<Vec<(String, String)>>>,
        columns: &[ColumnDesc],
    ) -> Result<Value, ApiError> {
        let t = std::time::Instant::now();
        let Some(first) = columns.first() else { return Err(invalid("columns: a put needs at least one column")) };
        let n = first.len;
        let mut cols = Vec::with_capacity(columns.len());
        for c in columns {
            let field = format!("columns[{}]", c.name);
            if c.len != n {
                return Err(invalid(format!(
                    "{field}.len is {} but {} has {n} samples; every column has one entry per sample",
                    c.len, first.name
                )));
            }
            let dtype = parse_dtype(&c.dtype).ok_or_else(|| {
                invalid(format!("{field}.dtype: {:?} is not a transfer-queue dtype (i64, f32, bf16, …)", c.dtype))
            })?;
            let values = self.read(&format!("{field}.values"), &c.values)?;
            let offsets = match (&c.offsets, c.ragged) {
                (Some(m), true) => {
                    let b = self.read(&format!("{field}.offsets"), m)?;
                    if b.len() % 8 != 0 {
                        return Err(invalid(format!(
                            "{field}.offsets: {} bytes is not a whole number of u64",
                            b.len()
                        )));
                    }
                    b.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes"))).collect()
                }
                (None, true) => return Err(invalid(format!("{field}: a ragged column needs offsets"))),
                (Some(_), false) => return Err(invalid(format!("{field}: a fixed column has no offsets"))),
                (None, false) => Vec::new(),
            };
            let spec = FieldSpec { name: c.name.clone(), dtype, ragged: c.ragged, inner: c.inner.clone() };
            cols.push(Column::from_parts(spec, n, Bytes::from(values), offsets).map_err(|e| invalid(e.to_string()))?);
        }
        let info = &self.local_api.info;
        let engine = match info.plan.process(info.me).role {
            rlplane_api::plan::ProcessRole::Generation(c) => c.engine,
            _ => 0,
        };
        let base = self.local_api.peek(|s| s.put.samples);
        let keys = match keys {
            Some(k) if k.len() != n => return Err(invalid(format!("keys: {} keys for {n} samples", k.len()))),
            Some(k) => k,
            None => (0..n).map(|i| format!("s{step}-e{engine}-{}", base + i as u64)).collect(),
        };
        if let Some(t) = &tokens
            && t.len() != n
        {
            return Err(invalid(format!("tokens: {} counts for {n} samples", t.len())));
        }
        let tags = tags.unwrap_or_default();
        if !tags.is_empty() && tags.len() != n {
            return Err(invalid(format!("tags: {} tag lists for {n} samples", tags.len())));
        }
        let (first, last) = self.generating_version(step)?;
        let partial = self.local_api.info.plan.schedule.partial_rollouts;
        let tags = with_policy_version(tags, n, first, last.filter(|_| partial))?;
        let token_total: u64 = match &tokens {
            Some(t) => t.iter().map(|&x| x as u64).sum(),
            None => cols.iter().filter(|c| c.spec().ragged).map(|c| c.offsets()[n]).max().unwrap_or(n as u64),
        };
        let tq = info.tq.as_ref().ok_or_else(|| state("this rank hosts no transfer-queue client"))?;
        let report = tq
            .put_with(&format!("step-{step}"), &keys, &cols, &PutOptions { tokens, tags })
            .await
            .map_err(|e| ApiError::new(ErrorKind::Failed, format!("putting into the transfer queue: {e}")))?;
        let seconds = t.elapsed().as_secs_f64();
        self.local_api.update(|s| {
            s.put.samples += n as u64;
            s.put.bytes += report.bytes;
            s.put.tokens += token_total;
            s.put.seconds += seconds;
        });
        Ok(json!({"ok": true, "samples": n, "bytes": report.bytes}))
    }
}

/// Lends the staging buffers to the engine, which holds complete weights of the version wanted:
/// not while a refit writes them (the caller waits, and sees the newer version); refused inside
/// a step begun with older weights unless `partial` rollouts are allowed. Answers the version
/// lent.
fn lend_staged(s: &mut State, partial: bool) -> Option<Result<u64, ApiError>> {
    if s.writing == Some(RefitTarget::Staging) {
        return None;
    }
    let v = s.held.current()?;
    let under_way = matches!(s.step, Some((st, true)) if s.ended != Some(st));
    match s.step_first {
        // A step's rollouts are under way with older weights: newer ones inside the step are
        // partial rollouts.
        Some(first) if under_way && v != first && !partial => {
            return Some(Err(state(format!(
                "the staged weights are version {v} now, and this step's rollouts began with version {first}: \
                 taking them inside a step needs spec.schedule.partialRollouts; take them after end_step"
            ))));
        }
        None if under_way => s.step_first = Some(v),
        _ => {}
    }
    s.lent = Some(v);
    s.taken = Some(v);
    Some(Ok(v))
}

/// Marks each of `n` samples with the policy version the engine holds (its weights can't change
/// during a step: a refit waits for `end_step`), unless the engine tagged the sample itself;
/// refuses a tag that is not a version number.
fn with_policy_version(
    mut tags: Vec<Vec<(String, String)>>,
    n: usize,
    held: Option<u64>,
    last: Option<u64>,
) -> Result<Vec<Vec<(String, String)>>, ApiError> {
    use crate::tq::version::{POLICY_VERSION_LAST_TAG, POLICY_VERSION_TAG};
    let Some(held) = held else { return Ok(tags) };
    if tags.is_empty() {
        tags = vec![Vec::new(); n];
    }
    for (i, list) in tags.iter_mut().enumerate() {
        match list.iter().find(|(k, _)| k == POLICY_VERSION_TAG) {
            Some((_, v)) if v.parse::<u64>().is_err() => {
                return Err(invalid(format!(
                    "tags[{i}]: {POLICY_VERSION_TAG} = {v:?} is not a version number; leave the tag out (the sidecar adds the engine's version) or give a non-negative integer"
                )));
            }
            Some(_) => {}
            None => list.push(crate::tq::version::tag(held)),
        }
        if let Some(last) = last
            && !list.iter().any(|(k, _)| k == POLICY_VERSION_LAST_TAG)
        {
            list.push((POLICY_VERSION_LAST_TAG.to_string(), last.to_string()));
        }
    }
    Ok(tags)
}

/// Refuses a call outside the connection's scope, naming the session that makes it.
fn check_scope(scope: Scope, req: &Request) -> Result<(), ApiError> {
    let (op, needs) = match req {
        Request::RegisterWeights { .. } => ("register_weights", Scope::Weights),
        Request::AcquireStaged { .. } => ("acquire_staged", Scope::Weights),
        Request::ReleaseStaged {} => ("release_staged", Scope::Weights),
        Request::NextStep {} => ("next_step", Scope::Rollouts),
        Request::Put { .. } => ("put", Scope::Rollouts),
        Request::EndStep { .. } => ("end_step", Scope::Rollouts),
        Request::ReportScalars { .. } => ("report_scalars", Scope::Rollouts),
        _ => return Ok(()),
    };
    if scope == Scope::All || scope == needs {
        return Ok(());
    }
    Err(state(format!(
        "{op} in a \"{}\" session; it belongs to the \"{}\" session (or \"all\")",
        scope.name(),
        needs.name()
    )))
}

fn deadline_of(timeout_s: Option<f64>) -> Result<Option<Instant>, ApiError> {
    match timeout_s {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Some(Instant::now() + Duration::from_secs_f64(t.min(1e9)))),
        Some(t) => {
            Err(invalid(format!("timeout_s: {t}; give seconds ≥ 0, or leave it out to wait as long as it takes")))
        }
    }
}

fn held_reply(held: WeightsState) -> Value {
    let (version, st) = match held {
        WeightsState::Empty => (None, "empty"),
        WeightsState::Complete(v) => (Some(v), "ready"),
        WeightsState::Incomplete(v) => (Some(v), "incomplete"),
    };
    json!({"ok": true, "version": version, "state": st})
}

/// Writes `batch` into a new shared-memory file of the rank (the previous step's file is removed:
/// the user's mappings of it stay valid until it unmaps them) and returns the `next_batch` reply.
pub fn write_batch(info: &RankInfo, step: u32, batch: &Batch) -> anyhow::Result<(Value, std::path::PathBuf)> {
    let prefix = info.shm_dir.join(format!("{}-batch", info.file_prefix()));
    let path =
        prefix.with_file_name(format!("{}-{step}", prefix.file_name().and_then(|n| n.to_str()).unwrap_or("batch")));
    if step > 0 {
        let old = prefix.with_file_name(format!(
            "{}-{}",
            prefix.file_name().and_then(|n| n.to_str()).unwrap_or("batch"),
            step - 1
        ));
        let _ = std::fs::remove_file(old);
    }
    let _ = std::fs::remove_file(&path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        // The user's process only reads it.
        .mode(info.shared_mode() & 0o644)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("creating the batch file {}: {e}", path.display()))?;
    let mut at = 0u64;
    let mut out = std::io::BufWriter::new(&mut file);
    let mut write = |bytes: &[u8]| -> std::io::Result<Value> {
        let pad = at.next_multiple_of(64) - at;
        out.write_all(&vec![0u8; pad as usize])?;
        at += pad;
        let d = json!({"kind": "shm", "path": path.display().to_string(), "offset": at, "nbytes": bytes.len()});
        out.write_all(bytes)?;
        at += bytes.len() as u64;
        Ok(d)
    };
    let mut columns = Vec::with_capacity(batch.columns.len());
    for c in &batch.columns {
        let values = write(c.values())?;
        let offsets = if c.spec().ragged {
            let b: Vec<u8> = c.offsets().iter().flat_map(|o| o.to_le_bytes()).collect();
            Some(write(&b)?)
        } else {
            None
        };
        let mut v = json!({"name": c.name(), "dtype": dtype_name(c.spec().dtype), "ragged": c.spec().ragged,
            "inner": c.spec().inner, "len": c.len(), "values": values});
        if let Some(o) = offsets {
            v["offsets"] = o;
        }
        columns.push(v);
    }
    out.flush()?;
    drop(out);
    let meta = &batch.meta;
    let reply = json!({
        "ok": true,
        "step": step,
        "samples": meta.len(),
        "keys": meta.keys().collect::<Vec<_>>(),
        "tokens": meta.tokens(),
        "tags": meta.iter().map(|s| s.tags().iter().map(|(k, v)| [k.as_str(), v.as_str()]).collect::<Vec<_>>()).collect::<Vec<_>>(),
        "columns": columns,
    });
    Ok((reply, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_buffers_are_not_lent_while_a_refit_writes_them() {
        let mut s = State { held: WeightsState::Complete(2), ..State::default() };
        assert_eq!(s.begin_staging_write(), Some(()));
        // The engine asks while version 3 is being written: it waits, whatever it holds.
        assert!(lend_staged(&mut s, false).is_none());
        assert_eq!(s.lent, None);
        s.held = WeightsState::Complete(3);
        s.writing = None;
        assert!(matches!(lend_staged(&mut s, false), Some(Ok(3))));
        assert_eq!((s.lent, s.taken), (Some(3), Some(3)));
        // Lent: the next refit waits for release_staged.
        assert_eq!(s.begin_staging_write(), None);
        assert_eq!(s.writing, None);
        s.lent = None;
        assert_eq!(s.begin_staging_write(), Some(()));
        assert_eq!(s.writing, Some(RefitTarget::Staging));
    }

    #[test]
    fn newer_staged_weights_inside_a_step_need_partial_rollouts() {
        let mut s = State { held: WeightsState::Complete(4), step: Some((5, true)), ..State::default() };
        assert!(matches!(lend_staged(&mut s, false), Some(Ok(4))));
        assert_eq!(s.step_first, Some(4));
        s.lent = None;
        s.held = WeightsState::Complete(5);
        let refused = lend_staged(&mut s, false);
        assert!(
            matches!(&refused, Some(Err(e)) if e.message.contains("partialRollouts")),
            "{:?}",
            refused.map(|r| r.err().map(|e| e.message))
        );
        assert_eq!(s.lent, None);
        assert!(matches!(lend_staged(&mut s, true), Some(Ok(5))));
        assert_eq!(s.step_first, Some(4));
    }
}
