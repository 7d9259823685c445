//! The control plane: coordinator ↔ rank messages (step start, assignments, done, versions).
//!
//! Every rank holds one TCP connection to the coordinator's control port, opened with the shared
//! token handshake ([`crate::net`], magic `RCTL`). The coordinator sends [`Envelope`]s; a rank
//! answers each with one [`Reply::Done`] or [`Reply::Failed`]. The done says when the rank read
//! the command and how long it held it, so the coordinator measures the *dispatch latency* — the
//! command's way to the rank (one way, on one host's clock) and the round trip (the answer's way
//! back added, the rank's holding time taken out: any two hosts) — without a message of its own:
//! an acknowledgment per command used to wake the coordinator once more per command, and on a
//! host whose cores the ranks keep busy that cost as much step time as the commands themselves.
//! Several commands for one rank may go out together; the rank runs them in order. Frames are
//! small JSON documents; bulk data never travels here.
//!
//! Both sides read their sockets themselves ([`FrameLink`]), and poll them while a message is
//! due ([`crate::hot_wait`]): a rank for its next command when the last wait for one took about
//! as long, the coordinator for the replies of a set of commands whose last wait it timed. A
//! message arriving then finds its reader running instead of a parked thread to wake (0.1–0.2 ms
//! on a virtualized host), twice or more per step.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::hot_wait::{Forecast, Next};
use crate::link::FrameLink;
use crate::net::{self, Connection, Hello, JobAuth, NetError};
use crate::patience::{Patience, Stall, StallSender};
use crate::reservoir::Reservoir;

/// Protocol magic of the control channel.
pub const MAGIC: [u8; 4] = *b"RCTL";
/// Protocol version. 2: `Update`'s seed may be left to the rank (one data-parallel shard, or a
/// user's trainer), and commands may arrive queued behind one another. 3: a `Train` command's
/// batch is the columnar JSON form of [`crate::tq::BatchMeta`] (`keys`, `units`, `tokens`, `rows`
/// per field, `tag_sets`, `tags`), no longer one object per sample. 4: a `Train` command's batch
/// travels in the frame after the command, in the transfer queue's binary metadata layout
/// ([`crate::tq::codec::encode_meta`]); the command says so with `attached`. 6: every frame carries
/// its tag ([`crate::net::mac`]). 7: tags are AES-256-GMAC.
pub const VERSION: u16 = 7;

/// What the coordinator asks a rank to do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// Generation producers: generate the step's rollouts and put them into the transfer queue.
    Generate {
        /// Step.
        step: u32,
        /// The oldest weights the step may be generated with (`step − 1 − maxPolicyLag`): an
        /// engine that receives refits while it generates waits, at the step's start, until it
        /// holds at least this version.
        #[serde(default)]
        min_version: u64,
    },
    /// Trainer ranks: train on a batch. A data-parallel leader gets its shard's batch to fetch
    /// (and fan out); followers get `None` and receive the batch from their leader.
    Train {
        /// Step.
        step: u32,
        /// The samples assigned to this data-parallel shard, for the rank that fetches. Not in
        /// the command's JSON: it follows as a binary frame (see [`Envelope::attached`]).
        #[serde(skip)]
        batch: Option<crate::tq::BatchMeta>,
    },
    /// Trainer ranks: apply the step's update (the new weights derive from `seed`).
    Update {
        /// Step.
        step: u32,
        /// Seed of the new weights: [`update_seed`] of the step and every data-parallel shard's
        /// batch digest. `None`: the rank derives it from its own batch of the step, which is
        /// the same seed when there is one shard (every rank holds that shard's batch) — so
        /// the update can be sent together with `Train`, without a round trip in between.
        seed: Option<u64>,
    },
    /// Refit group members: move weights of `version` from senders to receivers. Receivers check
    /// what they received against `expected` (the senders' digests summed).
    Refit {
        /// Weight version (the step).
        version: u64,
        /// Expected digest of everything a receiver receives.
        expected: u64,
    },
    /// Stop: the job is done.
    Shutdown,
}

impl Command {
    /// Short name for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Generate { .. } => "generate",
            Command::Train { .. } => "train",
            Command::Update { .. } => "update",
            Command::Refit { .. } => "refit",
            Command::Shutdown => "shutdown",
        }
    }
}

/// Seed of step `step`'s new weights, from the batch digest of every data-parallel shard (in shard
/// order): the weights depend on the data the trainer fetched, and anyone holding the digests can
/// check them.
pub fn update_seed(step: u32, shard_digests: &[u64]) -> u64 {
    shard_digests.iter().fold(crate::digest::mix64(step as u64), |acc, d| crate::digest::mix64(acc ^ d))
}

/// A command with its sequence number and send time.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Envelope {
    /// Sequence number, unique per connection.
    pub seq: u64,
    /// Coordinator's send time ([`monotonic_ns`]).
    pub sent_ns: u64,
    /// The command.
    pub command: Command,
    /// The next frame is this `Train` command's batch, binary: JSON spelled out every number of
    /// it (a 512-sample batch was 24 KB, and a rank took 0.2–0.3 ms to parse a quarter of that on
    /// the GPU hosts).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attached: bool,
}

/// The counter of a Train report that carries the largest policy lag in the rank's batch, as
/// the rank checked it on arrival.
pub const POLICY_LAG_COUNTER: &str = "policy_lag_max";

/// What a rank measured and produced while executing a command.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Seconds the rank was busy with the command (its data and compute time).
    pub busy_secs: f64,
    /// Bytes the command moved at this rank (put, fetched, refit bytes received...).
    pub bytes: u64,
    /// Samples handled.
    pub samples: u64,
    /// Tokens handled.
    pub tokens: u64,
    /// A digest of what was produced or received.
    pub digest: Option<u64>,
    /// Weight version now held (generation ranks after a refit).
    pub version: Option<u64>,
    /// Named phase timings in seconds (e.g. refit pack/transfer/unpack/wait).
    #[serde(default)]
    pub phases: BTreeMap<String, f64>,
    /// Named byte counts (e.g. fetched, written back).
    #[serde(default)]
    pub counters: BTreeMap<String, u64>,
    /// A checkpoint the trainer saved since its last report (trainer ranks, on an update).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<rlplane_api::CheckpointRef>,
    /// Scalars about the step's learning (reward, KL, lengths…) the rank's process reported for
    /// the command's step: the user's through the local API, the synthetic engine's own.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub scalars: BTreeMap<String, f64>,
}

/// A rank's message to the coordinator.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Reply {
    /// The rank finished its set-up (rendezvous with its peers) and takes commands.
    Ready,
    /// The command finished.
    Done {
        /// Its sequence number.
        seq: u64,
        /// What the rank measured.
        report: Report,
        /// When the rank read the command ([`monotonic_ns`]); comparable with the envelope's
        /// `sent_ns` only when both run on one host.
        #[serde(default)]
        recv_ns: u64,
        /// Nanoseconds from reading the command to sending this (on the rank's clock): taken out
        /// of the coordinator's send-to-done time, the rest is the way there and back.
        #[serde(default)]
        held_ns: u64,
    },
    /// The command failed.
    Failed {
        /// Its sequence number.
        seq: u64,
        /// Why, naming peers and phases.
        error: String,
    },
}

/// Errors of the control plane.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Transport trouble with a rank.
    #[error("control channel of {rank}: {source}")]
    Net {
        /// Rank name.
        rank: String,
        /// Cause.
        source: NetError,
    },
    /// A rank reported a failure.
    #[error("{rank} failed {command}: {error}")]
    RankFailed {
        /// Rank name.
        rank: String,
        /// Command name.
        command: String,
        /// Its error.
        error: String,
    },
    /// A rank's connection closed.
    #[error("{rank} disconnected ({reason}); it probably died — see its log")]
    Lost {
        /// Rank name.
        rank: String,
        /// What was seen.
        reason: String,
    },
    /// A wait ran past its deadline.
    #[error("timed out after {secs:.1}s waiting for {waiting} to finish {command}")]
    Timeout {
        /// Command name.
        command: String,
        /// Ranks still pending.
        waiting: String,
        /// Seconds waited.
        secs: f64,
    },
    /// Not every expected rank connected.
    #[error("ranks never connected to the coordinator: {0}")]
    Missing(String),
    /// A malformed message.
    #[error("malformed control message from {rank}: {detail}")]
    Malformed {
        /// Rank name.
        rank: String,
        /// What was wrong.
        detail: String,
    },
}

/// Answers every connection to the control port after the gang formed, until dropped: a rank of an
/// earlier epoch (or another job) hears that its token is stale, a rank of this epoch that
/// connects again hears that it already joined, instead of a connection closed without a word.
/// Nothing such a peer sends is used.
pub struct LateJoinerRefusal(tokio::task::JoinHandle<()>);

impl LateJoinerRefusal {
    /// Takes over `listener` (the control port, after [`ControlServer::accept_all`]).
    /// Refusals are counted in `auth`'s, like the gang's own.
    pub fn start(listener: TcpListener, auth: JobAuth) -> LateJoinerRefusal {
        LateJoinerRefusal(tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let auth = auth.clone();
                tokio::spawn(async move {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    let refused = net::accept_hello(&mut stream, &auth, MAGIC, VERSION, deadline, |h| {
                        Err(format!("`{}` joined this epoch's control channel already; the gang is formed", h.peer))
                    })
                    .await;
                    if let Err(e) = refused {
                        tracing::warn!(error = %e, "refused a control connection after the gang formed");
                    }
                });
            }
        }))
    }
}

impl Drop for LateJoinerRefusal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Publishes (or, with `None`, withdraws) a stall into `sink`, when there is one.
fn publish(sink: Option<&StallSender>, stall: Option<Stall>) {
    if let Some(sink) = sink {
        sink.send_replace(stall);
    }
}

/// Commands sent with [`ControlServer::dispatch`] and not yet waited for.
#[derive(Debug, Default)]
#[must_use = "a dispatched command must be waited for, or its failure goes unnoticed"]
pub struct Pending(Vec<Sent>);

#[derive(Debug)]
struct Sent {
    rank: usize,
    seq: u64,
    command: &'static str,
}

impl Pending {
    /// Adds `other`'s commands to these.
    pub fn merge(mut self, other: Pending) -> Pending {
        self.0.extend(other.0);
        self
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The coordinator's side: one connection per rank.
pub struct ControlServer {
    names: Vec<String>,
    index: HashMap<String, usize>,
    /// One connection per rank, read by this task itself.
    links: Vec<FrameLink>,
    next_seq: u64,
    /// Round trips of every command: send → the rank has it, plus its answer's way back (the
    /// time the rank held the command taken out). Commands sent while the rank was still busy
    /// with an earlier one (queued behind it) are not timed: they wait for that work, not for
    /// the control plane. A bounded sample ([`Reservoir`]): a long job's commands do not grow
    /// the coordinator's memory.
    pub dispatch: Reservoir<Duration>,
    /// One way, send → the rank has it; meaningful only when the ranks share the coordinator's
    /// host (one clock), as in `rlplane local`.
    pub one_way: Reservoir<Duration>,
    /// Every command sent and not finished: its name and send time ([`monotonic_ns`]).
    pending_cmd: HashMap<(usize, u64), (&'static str, u64)>,
    /// Commands sent and not finished, per rank: a command sent while this is non-zero waits in
    /// the rank's queue.
    outstanding: Vec<u32>,
    /// Commands sent behind another one: their dispatch is not timed.
    queued: HashSet<(usize, u64)>,
    /// Reports of commands that finished while the coordinator waited for others.
    finished: HashMap<(usize, u64), Report>,
    /// How long the last wait for each set of commands took (keyed by their names), to poll
    /// for the replies when they are due.
    due: HashMap<String, Forecast>,
    /// Serialized commands, reused.
    out: Vec<u8>,
    /// Where a wait that goes on publishes what it waits for (see [`crate::patience`]).
    stall: Option<StallSender>,
    /// The step the commands waited for belong to (named in a stall's phase).
    step: u32,
}

impl ControlServer {
    /// Accepts a connection from every rank in `expected` (process names) that proves it holds
    /// the job epoch's key; refused peers are logged, counted in `auth` and ignored.
    pub async fn accept_all(
        listener: &TcpListener,
        expected: &[String],
        auth: &JobAuth,
        deadline: Instant,
        stall: Option<StallSender>,
    ) -> Result<ControlServer, ControlError> {
        let index: HashMap<String, usize> = expected.iter().enumerate().map(|(i, n)| (n.clone(), i)).collect();
        let mut streams: Vec<Option<Connection>> = (0..expected.len()).map(|_| None).collect();
        let mut connected = 0;
        // Each handshake on its own task: a connection that never speaks (a port scanner, a peer
        // that hung after connecting) holds up nobody but itself.
        let mut handshakes = tokio::task::JoinSet::new();
        let known: std::sync::Arc<HashSet<String>> = std::sync::Arc::new(expected.iter().cloned().collect());
        let mut patience = Patience::new("connecting");
        let missing = |streams: &[Option<Connection>]| -> Vec<String> {
            expected.iter().zip(streams).filter(|(_, s)| s.is_none()).map(|(n, _)| n.clone()).collect()
        };
        while connected < expected.len() {
            tokio::select! {
                accepted = listener.accept() => {
                    let (mut stream, _) = accepted.map_err(|e| ControlError::Net {
                        rank: "?".into(),
                        source: NetError::io("accepting rank connections", "control listener", e),
                    })?;
                    net::tune(&stream);
                    let (auth, known) = (auth.clone(), known.clone());
                    handshakes.spawn(async move {
                        let hello = net::accept_hello(&mut stream, &auth, MAGIC, VERSION, deadline, |h| {
                            if known.contains(&h.peer) {
                                Ok(())
                            } else {
                                Err(format!("`{}` is not a rank of this job", h.peer))
                            }
                        })
                        .await;
                        hello.map(|(h, session)| (h.peer, Connection { stream, session }))
                    });
                }
                Some(done) = handshakes.join_next(), if !handshakes.is_empty() => match done {
                    Ok(Ok((peer, stream))) => {
                        let i = index[&peer];
                        if streams[i].is_none() {
                            connected += 1;
                        }
                        streams[i] = Some(stream);
                    }
                    // A refused peer (stale epoch, other job) is logged and ignored; the rest still join.
                    Ok(Err(e)) => tracing::warn!(error = %e, "refused a control connection"),
                    Err(e) => tracing::warn!(error = %e, "a control handshake's task failed"),
                },
                () = tokio::time::sleep_until(patience.due().min(deadline)) => {
                    if Instant::now() >= deadline {
                        return Err(ControlError::Missing(missing(&streams).join(", ")));
                    }
                    if let Some(s) = patience.report(|| missing(&streams)) {
                        publish(stall.as_ref(), Some(s));
                    }
                }
            }
        }
        if patience.finish() {
            publish(stall.as_ref(), None);
        }
        let mut links = Vec::with_capacity(expected.len());
        for (name, s) in expected.iter().zip(streams) {
            let c = s.expect("every rank connected");
            let link = FrameLink::tcp(c.stream, net::MAX_FRAME, c.session).map_err(|e| ControlError::Net {
                rank: name.clone(),
                source: NetError::io("taking over the connection", name, e),
            })?;
            links.push(link);
        }
        Ok(ControlServer {
            names: expected.to_vec(),
            index,
            links,
            next_seq: 1,
            dispatch: Reservoir::default(),
            one_way: Reservoir::default(),
            pending_cmd: HashMap::new(),
            outstanding: vec![0; expected.len()],
            queued: HashSet::new(),
            finished: HashMap::new(),
            due: HashMap::new(),
            out: Vec::with_capacity(4096),
            stall,
            step: 0,
        })
    }

    /// Names of the connected ranks.
    pub fn ranks(&self) -> &[String] {
        &self.names
    }

    /// Waits until every rank said it finished its set-up (peers' rendezvous, communicators), so
    /// that no step's time includes start-up.
    pub async fn wait_ready(&mut self, deadline: Instant) -> Result<(), ControlError> {
        let mut ready = vec![false; self.names.len()];
        let mut patience = Patience::new("set-up");
        while ready.iter().any(|r| !r) {
            for (rank, reply, _) in self.poll_replies()? {
                match reply {
                    Reply::Ready => ready[rank] = true,
                    reply => {
                        return Err(ControlError::Malformed {
                            rank: self.names[rank].clone(),
                            detail: format!("{reply:?} before Ready"),
                        });
                    }
                }
            }
            if ready.iter().all(|r| *r) {
                break;
            }
            let waiting = || -> Vec<String> {
                self.names.iter().zip(&ready).filter(|(_, r)| !**r).map(|(n, _)| n.clone()).collect()
            };
            if let Some(s) = patience.report(waiting) {
                self.publish(Some(s));
            }
            if !self.park(Some(patience.due().min(deadline))).await? && Instant::now() >= deadline {
                return Err(ControlError::Timeout {
                    command: "set-up".into(),
                    waiting: waiting().join(", "),
                    secs: 0.0,
                });
            }
        }
        if patience.finish() {
            self.publish(None);
        }
        Ok(())
    }

    /// The step the next commands belong to (0: the initial weights), for stall reports.
    pub fn set_step(&mut self, step: u32) {
        self.step = step;
    }

    /// Publishes (or, with `None`, withdraws) what a wait is stalled on.
    fn publish(&self, stall: Option<Stall>) {
        publish(self.stall.as_ref(), stall);
    }

    /// Every reply that has arrived on any connection, with when it was read
    /// ([`monotonic_ns`]); never waits. A connection that closed or sent garbage fails, naming
    /// its rank.
    fn poll_replies(&mut self) -> Result<Vec<(usize, Reply, u64)>, ControlError> {
        let mut replies = Vec::new();
        for (rank, link) in self.links.iter_mut().enumerate() {
            loop {
                let frame = link.try_recv().map_err(|e| ControlError::Lost {
                    rank: self.names[rank].clone(),
                    reason: if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        "the connection closed".into()
                    } else {
                        e.to_string()
                    },
                })?;
                let Some(frame) = frame else { break };
                let at_ns = monotonic_ns();
                let reply = serde_json::from_slice::<Reply>(&frame).map_err(|e| ControlError::Lost {
                    rank: self.names[rank].clone(),
                    reason: format!("malformed reply: {e}"),
                })?;
                replies.push((rank, reply, at_ns));
            }
        }
        Ok(replies)
    }

    /// Parks until any connection is readable or `until` passes; false when `until` passed.
    async fn park(&self, until: Option<Instant>) -> Result<bool, ControlError> {
        if self.links.is_empty() {
            if let Some(u) = until {
                tokio::time::sleep_until(u).await;
            }
            return Ok(false);
        }
        let any = futures::future::select_all(self.links.iter().map(|l| Box::pin(l.readable())));
        let readable = match until {
            Some(u) => match tokio::time::timeout_at(u, any).await {
                Ok(r) => r,
                Err(_) => return Ok(false),
            },
            None => any.await,
        };
        let (result, rank, _) = readable;
        result.map_err(|e| ControlError::Lost { rank: self.names[rank].clone(), reason: e.to_string() })?;
        Ok(true)
    }

    /// Sends `commands` (rank name, command) without waiting for them. Every command for one
    /// rank goes out in a single write, in the order given, so a rank finds the second one
    /// already in its socket when it finishes the first (no wake-up in between). Wait for them
    /// with [`ControlServer::wait`].
    pub async fn dispatch<R: AsRef<str>>(
        &mut self,
        commands: impl IntoIterator<Item = (R, Command)>,
    ) -> Result<Pending, ControlError> {
        // Group by rank, keeping the order of first appearance and the order within a rank.
        let mut by_rank: Vec<(usize, Vec<Command>)> = Vec::new();
        for (r, c) in commands {
            let r = r.as_ref();
            let i = *self.index.get(r).ok_or_else(|| ControlError::Missing(r.into()))?;
            match by_rank.iter_mut().find(|(j, _)| *j == i) {
                Some((_, cs)) => cs.push(c),
                None => by_rank.push((i, vec![c])),
            }
        }
        let mut pending = Pending::default();
        for (i, commands) in by_rank {
            for command in commands {
                let seq = self.next_seq;
                self.next_seq += 1;
                let name = command.name();
                // A command sent while the rank is still busy waits in its queue: its timing
                // would be that wait, not the control plane.
                if self.outstanding[i] > 0 {
                    self.queued.insert((i, seq));
                }
                let attachment = match &command {
                    Command::Train { batch: Some(b), .. } => Some(crate::tq::codec::encode_meta(b)),
                    _ => None,
                };
                let env = Envelope { seq, sent_ns: monotonic_ns(), command, attached: attachment.is_some() };
                if !matches!(env.command, Command::Shutdown) {
                    self.outstanding[i] += 1;
                    self.pending_cmd.insert((i, seq), (name, env.sent_ns));
                    pending.0.push(Sent { rank: i, seq, command: name });
                }
                self.out.clear();
                serde_json::to_writer(&mut self.out, &env).expect("commands serialize");
                let queued = self.links[i]
                    .queue(&[&self.out])
                    .and_then(|()| attachment.map_or(Ok(()), |a| self.links[i].queue(&[&a])));
                queued.map_err(|e| ControlError::Net {
                    rank: self.names[i].clone(),
                    source: NetError::io("sending a command", &self.names[i], e),
                })?;
            }
            // Every command for the rank in one write.
            self.links[i].flushed().await.map_err(|e| ControlError::Net {
                rank: self.names[i].clone(),
                source: NetError::io("sending a command", &self.names[i], e),
            })?;
        }
        Ok(pending)
    }

    /// Splits `pending` in two: the commands for which `pick(command name, rank name)` holds, and
    /// the others.
    pub fn split(&self, pending: Pending, pick: impl Fn(&str, &str) -> bool) -> (Pending, Pending) {
        let (a, b) = pending.0.into_iter().partition(|s| pick(s.command, &self.names[s.rank]));
        (Pending(a), Pending(b))
    }

    /// Sends `command` to every rank in `ranks`, then waits for all of them to finish it.
    pub async fn run(
        &mut self,
        ranks: &[String],
        command: Command,
        deadline: Instant,
    ) -> Result<HashMap<String, Report>, ControlError> {
        let pending = self.dispatch(ranks.iter().map(|r| (r, command.clone()))).await?;
        self.wait(pending, deadline).await
    }

    /// Sends per-rank commands, then waits for all of them.
    pub async fn run_each(
        &mut self,
        commands: Vec<(String, Command)>,
        deadline: Instant,
    ) -> Result<HashMap<String, Report>, ControlError> {
        let pending = self.dispatch(commands).await?;
        self.wait(pending, deadline).await
    }

    /// Waits until every command of `pending` finished; returns their reports by rank name (at
    /// most one command per rank in `pending`). Fails at once when any rank fails any command
    /// (also one not in `pending`) or disconnects, naming the rank. Commands of other sets that
    /// finish meanwhile are kept for their own wait.
    pub async fn wait(&mut self, pending: Pending, deadline: Instant) -> Result<HashMap<String, Report>, ControlError> {
        let start = Instant::now();
        let mut reports = HashMap::with_capacity(pending.0.len());
        let mut waiting: HashSet<(usize, u64)> = HashSet::with_capacity(pending.0.len());
        for s in pending.0 {
            match self.finished.remove(&(s.rank, s.seq)) {
                Some(report) => {
                    reports.insert(self.names[s.rank].clone(), report);
                }
                None => {
                    waiting.insert((s.rank, s.seq));
                }
            }
        }
        // Poll for the replies while they are due: this set of commands' last wait forecasts it.
        let mut key: Vec<&str> = waiting.iter().filter_map(|k| self.pending_cmd.get(k).map(|c| c.0)).collect();
        key.sort_unstable();
        key.dedup();
        let key = key.join("+");
        let window = self.due.entry(key.clone()).or_default().window(start);
        let learn = !waiting.is_empty();
        let report_at = start + crate::patience::REPORT_EVERY;
        let mut patience: Option<Patience> = None;
        while !waiting.is_empty() {
            for (rank, reply, at_ns) in self.poll_replies()? {
                match reply {
                    Reply::Done { seq, report, recv_ns, held_ns } => {
                        let Some((name, sent_ns)) = self.pending_cmd.remove(&(rank, seq)) else { continue };
                        if !self.queued.remove(&(rank, seq)) && recv_ns > 0 {
                            let there_and_back = at_ns.saturating_sub(sent_ns).saturating_sub(held_ns);
                            tracing::debug!(
                                rank = %self.names[rank],
                                command = name,
                                one_way_us = recv_ns.saturating_sub(sent_ns) / 1000,
                                back_us = at_ns.saturating_sub(recv_ns + held_ns) / 1000,
                                "dispatch timed"
                            );
                            self.dispatch.push(Duration::from_nanos(there_and_back));
                            self.one_way.push(Duration::from_nanos(recv_ns.saturating_sub(sent_ns)));
                        }
                        self.outstanding[rank] = self.outstanding[rank].saturating_sub(1);
                        if waiting.remove(&(rank, seq)) {
                            reports.insert(self.names[rank].clone(), report);
                        } else {
                            self.finished.insert((rank, seq), report);
                        }
                    }
                    Reply::Ready => {}
                    Reply::Failed { seq, error } => {
                        let command = self.pending_cmd.remove(&(rank, seq)).map_or("a command", |c| c.0);
                        return Err(ControlError::RankFailed {
                            rank: self.names[rank].clone(),
                            command: command.into(),
                            error,
                        });
                    }
                }
            }
            if waiting.is_empty() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                let mut names: Vec<&str> = waiting.iter().map(|(i, _)| self.names[*i].as_str()).collect();
                names.sort();
                let command = waiting.iter().find_map(|k| self.pending_cmd.get(k)).map_or("?", |c| c.0);
                return Err(ControlError::Timeout {
                    command: command.into(),
                    waiting: names.join(", "),
                    secs: start.elapsed().as_secs_f64(),
                });
            }
            if now >= report_at {
                let p = patience.get_or_insert_with(|| Patience::since(start, format!("step {}: {key}", self.step)));
                let names = || {
                    let mut names: Vec<String> = waiting.iter().map(|(i, _)| self.names[*i].clone()).collect();
                    names.sort();
                    names
                };
                if let Some(s) = p.report(names) {
                    self.publish(Some(s));
                }
            }
            let report = patience.as_ref().map_or(report_at, Patience::due);
            match window.next(now) {
                Next::Poll => tokio::task::yield_now().await,
                Next::Park(until) => {
                    self.park(Some(until.map_or(deadline, |u| u.min(deadline)).min(report))).await?;
                }
            }
        }
        if patience.is_some_and(Patience::finish) {
            self.publish(None);
        }
        if learn {
            self.due.get_mut(&key).expect("inserted above").learn(start.elapsed());
        }
        Ok(reports)
    }

    /// Sends Shutdown to every rank without waiting for answers (ranks exit on it).
    pub async fn shutdown_all(&mut self) {
        for name in self.names.clone() {
            let _ = self.dispatch([(name, Command::Shutdown)]).await;
        }
        for l in &self.links {
            let _ = l.shutdown_write();
        }
    }
}

/// How long a rank waits for the batch frame that follows its command (both go out in one write).
const ATTACHMENT_WAIT: Duration = Duration::from_secs(30);

/// A rank's side of the control channel.
pub struct ControlClient {
    /// Read by this task itself: commands sent together (a step's update and refit) arrive in
    /// one read.
    link: FrameLink,
    out: Vec<u8>,
    /// The command being executed: its sequence number and when it was read.
    current: Option<(u64, u64)>,
    /// When the last reply went out: a wait for the next command starts there.
    replied: Option<Instant>,
    /// How long the last wait for a command took.
    next_due: Forecast,
}

impl ControlClient {
    /// Connects to the coordinator (retrying until `deadline`) and introduces itself as `name`.
    pub async fn connect(
        addr: &str,
        auth: &JobAuth,
        name: &str,
        deadline: Instant,
    ) -> Result<ControlClient, ControlError> {
        let wrap = |source| ControlError::Net { rank: name.into(), source };
        let mut s = net::connect_retry(addr, deadline, "the coordinator's control channel").await.map_err(wrap)?;
        let hello = Hello { magic: MAGIC, version: VERSION, peer: name.into(), extra: vec![] };
        let session = net::send_hello(&mut s, auth, &hello, deadline, addr).await.map_err(wrap)?;
        let link = FrameLink::tcp(s, net::MAX_FRAME, session)
            .map_err(|e| wrap(NetError::io("taking over the connection", "coordinator", e)))?;
        Ok(ControlClient {
            link,
            out: Vec::with_capacity(1024),
            current: None,
            replied: None,
            next_due: Forecast::new(),
        })
    }

    /// Waits for the next command (answer it with [`ControlClient::done`] or
    /// [`ControlClient::failed`]). `None` when the coordinator closed the connection.
    pub async fn next(&mut self) -> Result<Option<Envelope>, ControlError> {
        let start = self.replied.take().unwrap_or_else(Instant::now);
        let net_err = |e: std::io::Error| ControlError::Net {
            rank: "coordinator".into(),
            source: NetError::io("reading a command", "coordinator", e),
        };
        let frame = match self.link.try_recv() {
            // Queued behind the last one: no wait to learn from.
            Ok(Some(f)) => Ok(Some(f)),
            Ok(None) => {
                let f = self.link.recv(self.next_due.window(start), None).await;
                self.next_due.learn(start.elapsed());
                f
            }
            Err(e) => Err(e),
        };
        let frame = match frame {
            Ok(Some(f)) => f,
            Ok(None) => unreachable!("no deadline"),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(net_err(e)),
        };
        let malformed = |detail: String| ControlError::Malformed { rank: "coordinator".into(), detail };
        let mut env: Envelope = serde_json::from_slice(&frame).map_err(|e| malformed(e.to_string()))?;
        if env.attached {
            // Written with the command: here at once, or after the rest of one write.
            let batch = match self.link.try_recv() {
                Ok(Some(b)) => Some(b),
                Ok(None) => self
                    .link
                    .recv(Forecast::default().window(Instant::now()), Some(Instant::now() + ATTACHMENT_WAIT))
                    .await
                    .map_err(net_err)?,
                Err(e) => return Err(net_err(e)),
            };
            let batch = batch.ok_or_else(|| malformed(format!("command {}'s batch did not follow it", env.seq)))?;
            let meta = crate::tq::codec::decode_meta(&batch)
                .map_err(|e| malformed(format!("command {}'s batch: {e}", env.seq)))?;
            match &mut env.command {
                Command::Train { batch, .. } => *batch = Some(meta),
                other => return Err(malformed(format!("a batch attached to {}, which takes none", other.name()))),
            }
        }
        self.current = Some((env.seq, monotonic_ns()));
        Ok(Some(env))
    }

    /// Answers command `seq` with its report, and when it was read and how long it was held.
    pub async fn done(&mut self, seq: u64, report: Report) -> Result<(), ControlError> {
        let (recv_ns, held_ns) = match self.current.take() {
            Some((s, recv_ns)) if s == seq => (recv_ns, monotonic_ns().saturating_sub(recv_ns)),
            _ => (0, 0),
        };
        self.reply(&Reply::Done { seq, report, recv_ns, held_ns }).await
    }

    /// Answers command `seq` with its failure.
    pub async fn failed(&mut self, seq: u64, error: String) -> Result<(), ControlError> {
        self.current = None;
        self.reply(&Reply::Failed { seq, error }).await
    }

    /// Sends a reply.
    pub async fn reply(&mut self, reply: &Reply) -> Result<(), ControlError> {
        self.out.clear();
        serde_json::to_writer(&mut self.out, reply).expect("replies serialize");
        self.link.queue(&[&self.out]).map_err(|e| ControlError::Net {
            rank: "coordinator".into(),
            source: NetError::io("sending a reply", "coordinator", e),
        })?;
        self.link.flushed().await.map_err(|e| ControlError::Net {
            rank: "coordinator".into(),
            source: NetError::io("sending a reply", "coordinator", e),
        })?;
        self.replied = Some(Instant::now());
        Ok(())
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of a host, so a command's send
/// and receive times taken in two processes there can be subtracted.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Percentile (0..=100) of a set of durations, in microseconds; 0 when empty.
pub fn percentile_us(samples: &[Duration], p: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[rank.min(v.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> JobAuth {
        JobAuth::new("tok", &[3; rlplane_api::plan::JOB_KEY_LEN])
    }

    #[tokio::test]
    async fn commands_are_done_and_timed() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        let names = vec!["gen-0".to_string(), "trainer-0".to_string()];
        for n in names.clone() {
            let addr = addr.clone();
            tokio::spawn(async move {
                let mut c = ControlClient::connect(&addr, &tok(), &n, deadline).await.unwrap();
                c.reply(&Reply::Ready).await.unwrap();
                while let Some(env) = c.next().await.unwrap() {
                    if env.command == Command::Shutdown {
                        break;
                    }
                    let report = Report { bytes: env.seq, ..Default::default() };
                    c.done(env.seq, report).await.unwrap();
                }
            });
        }
        // A stale rank (other epoch's token) is refused and does not count.
        let stale = addr.clone();
        tokio::spawn(async move {
            let _ = ControlClient::connect(&stale, &JobAuth::new("old-token", &[2; 32]), "gen-0", deadline).await;
        });
        let mut s = ControlServer::accept_all(&l, &names, &tok(), deadline, None).await.unwrap();
        s.wait_ready(deadline).await.unwrap();
        for step in 0..20 {
            let r = s.run(&names, Command::Generate { step, min_version: 0 }, deadline).await.unwrap();
            assert_eq!(r.len(), 2);
        }
        assert_eq!(s.dispatch.len(), 40, "every command's dispatch was timed");
        assert!(percentile_us(&s.dispatch, 50.0) > 0.0);
        s.shutdown_all().await;
    }

    #[tokio::test]
    async fn a_failed_command_and_a_lost_rank_name_the_rank() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        let names = vec!["trainer-1".to_string()];
        tokio::spawn(async move {
            let mut c = ControlClient::connect(&addr, &tok(), "trainer-1", deadline).await.unwrap();
            let env = c.next().await.unwrap().unwrap();
            c.failed(env.seq, "fan-out peer trainer-3 reset".into()).await.unwrap();
            let _ = c.next().await.unwrap();
            // Die without answering.
        });
        let mut s = ControlServer::accept_all(&l, &names, &tok(), deadline, None).await.unwrap();
        let e = s.run(&names, Command::Train { step: 0, batch: None }, deadline).await.unwrap_err().to_string();
        assert!(e.contains("trainer-1 failed train: fan-out peer trainer-3 reset"), "{e}");
        let e = s.run(&names, Command::Update { step: 0, seed: Some(1) }, deadline).await.unwrap_err().to_string();
        assert!(e.contains("trainer-1 disconnected"), "{e}");
    }

    #[tokio::test]
    async fn a_train_commands_batch_arrives_whole_behind_it() {
        use crate::tq::column::{DType, FieldSpec};
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        let schema = vec![FieldSpec::ragged("input_ids", DType::I64), FieldSpec::fixed("reward", DType::F32, vec![])];
        let mut b = crate::tq::BatchMeta::builder("step-1", schema);
        let tags: crate::tq::column::SampleTags = std::sync::Arc::from(vec![("uid".to_string(), "p0".to_string())]);
        for i in 0..600u32 {
            b.push(&format!("k{i}"), i % 3, 10 + i, &[10 + i, 1], &tags).unwrap();
        }
        let batch = b.finish();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let mut c = ControlClient::connect(&addr, &tok(), "trainer-0", deadline).await.unwrap();
            let mut got = Vec::new();
            while let Some(env) = c.next().await.unwrap() {
                if env.command == Command::Shutdown {
                    break;
                }
                c.done(env.seq, Report::default()).await.unwrap();
                got.push(env.command);
            }
            tx.send(got).unwrap();
        });
        let names = vec!["trainer-0".to_string()];
        let mut s = ControlServer::accept_all(&l, &names, &tok(), deadline, None).await.unwrap();
        // A batched Train between two commands without one, in one write.
        let sent = s
            .dispatch([
                ("trainer-0", Command::Train { step: 1, batch: None }),
                ("trainer-0", Command::Train { step: 2, batch: Some(batch.clone()) }),
                ("trainer-0", Command::Update { step: 2, seed: None }),
            ])
            .await
            .unwrap();
        s.wait(sent, deadline).await.unwrap();
        s.shutdown_all().await;
        let got = rx.await.unwrap();
        assert_eq!(
            got,
            vec![
                Command::Train { step: 1, batch: None },
                Command::Train { step: 2, batch: Some(batch) },
                Command::Update { step: 2, seed: None }
            ]
        );
    }

    #[tokio::test]
    async fn queued_commands_run_in_order_and_each_wait_gets_its_own() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        let names = vec!["trainer-0".to_string(), "gen-0".to_string()];
        for n in names.clone() {
            let addr = addr.clone();
            tokio::spawn(async move {
                let mut c = ControlClient::connect(&addr, &tok(), &n, deadline).await.unwrap();
                c.reply(&Reply::Ready).await.unwrap();
                while let Some(env) = c.next().await.unwrap() {
                    match env.command {
                        Command::Shutdown => break,
                        // gen-0 never finishes its refit: a failure elsewhere must still surface.
                        Command::Refit { .. } if n == "gen-0" => continue,
                        Command::Refit { .. } => {
                            c.failed(env.seq, "receiver reset".into()).await.unwrap();
                        }
                        // The report tells which command, in which order, the rank executed.
                        _ => {
                            let report = Report { bytes: env.seq, ..Default::default() };
                            c.done(env.seq, report).await.unwrap();
                        }
                    }
                }
            });
        }
        let mut s = ControlServer::accept_all(&l, &names, &tok(), deadline, None).await.unwrap();
        s.wait_ready(deadline).await.unwrap();
        // Train and Update to trainer-0 in one write; wait for the update first.
        let sent = s
            .dispatch([
                ("trainer-0", Command::Train { step: 1, batch: None }),
                ("trainer-0", Command::Update { step: 1, seed: None }),
            ])
            .await
            .unwrap();
        let (train, update) = s.split(sent, |c, _| c == "train");
        let u = s.wait(update, deadline).await.unwrap();
        let t = s.wait(train, deadline).await.unwrap();
        assert!(t["trainer-0"].bytes < u["trainer-0"].bytes, "executed in the order sent");
        assert_eq!(s.dispatch.len(), 1, "only the command that found the rank idle is timed");
        // trainer-0 fails a command nobody waits for yet: the wait for gen-0 reports it at once.
        let other = s.dispatch([("trainer-0", Command::Refit { version: 1, expected: 0 })]).await.unwrap();
        let receiver = s.dispatch([("gen-0", Command::Refit { version: 1, expected: 7 })]).await.unwrap();
        let e = s.wait(receiver, deadline).await.unwrap_err().to_string();
        assert!(e.contains("trainer-0 failed refit: receiver reset"), "{e}");
        drop(other);
    }

    #[tokio::test]
    async fn a_silent_connection_holds_up_no_rank_and_a_missing_one_is_reported_as_a_stall() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        // Sequential handshakes would wait out this whole deadline on the silent connection.
        let deadline = Instant::now() + Duration::from_secs(60);
        let names = vec!["gen-0".to_string(), "trainer-0".to_string()];
        let auth = JobAuth::new("tok", &[3; rlplane_api::plan::JOB_KEY_LEN]);
        let _silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let (tx, mut rx) = tokio::sync::watch::channel(None);
        let server = tokio::spawn({
            let auth = auth.clone();
            async move { ControlServer::accept_all(&l, &names, &auth, deadline, Some(tx)).await.map(|_| ()) }
        });
        let gen0 = ControlClient::connect(&addr, &auth, "gen-0", deadline).await.unwrap();
        // trainer-0 is late: after REPORT_EVERY the wait publishes whom it waits for.
        tokio::time::timeout(Duration::from_secs(10), rx.changed()).await.expect("a stall within 10 s").unwrap();
        let stall = rx.borrow_and_update().clone().expect("a stall");
        assert_eq!(stall.phase, "connecting");
        assert_eq!(stall.waiting_for, ["trainer-0"]);
        let trainer = ControlClient::connect(&addr, &auth, "trainer-0", deadline).await.unwrap();
        server.await.unwrap().unwrap();
        assert_eq!(*rx.borrow(), None, "withdrawn once everyone joined");
        assert!(Instant::now() + Duration::from_secs(40) < deadline, "nobody waited for the silent connection");
        drop((gen0, trainer));
    }

    #[tokio::test]
    async fn after_the_gang_formed_a_stale_or_repeated_rank_is_refused_with_a_reason() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        let names = vec!["gen-0".to_string()];
        let auth = JobAuth::new("tok", &[3; rlplane_api::plan::JOB_KEY_LEN]);
        let joined = tokio::spawn({
            let (addr, auth) = (addr.clone(), auth.clone());
            async move { ControlClient::connect(&addr, &auth, "gen-0", deadline).await.unwrap() }
        });
        let _server = ControlServer::accept_all(&l, &names, &auth, deadline, None).await.unwrap();
        let _joined = joined.await.unwrap();
        let _refusal = LateJoinerRefusal::start(l, auth.clone());
        let old = JobAuth::new("old-epoch", &[2; rlplane_api::plan::JOB_KEY_LEN]);
        let stale = ControlClient::connect(&addr, &old, "gen-0", deadline).await.err().unwrap().to_string();
        assert!(stale.contains("job token `old-epoch` does not match"), "{stale}");
        let again = ControlClient::connect(&addr, &auth, "gen-0", deadline).await.err().unwrap().to_string();
        assert!(again.contains("joined this epoch's control channel already"), "{again}");
    }

    #[test]
    fn percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile_us(&v, 50.0), 51.0);
        assert_eq!(percentile_us(&v, 99.0), 99.0);
        assert_eq!(percentile_us(&[], 99.0), 0.0);
    }
}
