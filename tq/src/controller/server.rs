//! The controller as the coordinator runs it: the [`Controller`] state machine shared behind a
//! lock, served over TCP (handshake, framing, token check, dispatch), clearing partitions in every
//! storage unit and watching the units so that a dead one marks its partitions lost.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

use super::state::{AckReport, Claim, Controller, ControllerError, PartitionStatus};
use crate::codec::{self, Body, CONTROLLER_MAGIC, ErrorCode, Header, ReadError, STORAGE_MAGIC, WIRE_VERSION};
use crate::column::BatchMeta;
use rlplane_wire::net::{self, Connection, Hello, JobAuth, NetError};

/// Settings of a [`TqController`].
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// The job epoch's token and key, which every peer must prove it holds.
    pub auth: JobAuth,
    /// Claim lease.
    pub lease: Duration,
    /// Storage units: id → address.
    pub units: BTreeMap<u32, String>,
}

impl ControllerConfig {
    /// From the job's plan, authenticating with `auth`.
    pub fn from_plan(plan: &rlplane_api::WorkerPlan, auth: &JobAuth) -> ControllerConfig {
        ControllerConfig {
            auth: auth.clone(),
            lease: Duration::from_secs(plan.transfer_queue.lease_seconds as u64),
            units: plan.storage_units.iter().filter_map(|u| Some((u.id, plan.storage_address(u.id)?))).collect(),
        }
    }
}

/// Result of clearing a partition everywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClearReport {
    /// Bytes freed across the storage units.
    pub freed: u64,
    /// Units that cleared it.
    pub units: u32,
    /// Units that could not be reached: `(unit, reason)`.
    pub unreachable: Vec<(u32, String)>,
}

/// The controller as the coordinator owns it: shared state, a TCP service, partition clearing in
/// every storage unit and a watch on the units. Cheap to clone.
#[derive(Clone, Debug)]
pub struct TqController {
    core: Arc<Mutex<Controller>>,
    config: Arc<ControllerConfig>,
    /// Units whose watch connection is up (see [`TqController::watch_units`]).
    watched: Arc<Mutex<BTreeSet<u32>>>,
    /// The job is over: units going away are expected, not lost.
    closed: Arc<std::sync::atomic::AtomicBool>,
    /// One connection per unit for clears, opened at the first and kept: a step's clear is then
    /// one small frame each way instead of a connection and an authenticated handshake per unit
    /// per step, which cost the units' processes CPU in the middle of the refit.
    clear_links: Arc<BTreeMap<u32, tokio::sync::Mutex<Option<Connection>>>>,
}

fn lock(core: &Mutex<Controller>) -> std::sync::MutexGuard<'_, Controller> {
    // A panic while holding the lock cannot leave the state half-updated (every method validates
    // before it mutates), so a poisoned lock is safe to keep using.
    core.lock().unwrap_or_else(|e| e.into_inner())
}

impl TqController {
    /// A controller with these settings.
    pub fn new(config: ControllerConfig) -> TqController {
        TqController {
            core: Arc::new(Mutex::new(Controller::new(config.lease))),
            clear_links: Arc::new(config.units.keys().map(|&u| (u, tokio::sync::Mutex::new(None))).collect()),
            config: Arc::new(config),
            watched: Arc::default(),
            closed: Arc::default(),
        }
    }

    /// The job is over: from now on a storage unit that goes away (its rank exiting) is not
    /// reported lost.
    pub fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The settings.
    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }

    /// See [`Controller::register`].
    pub fn register(&self, meta: &BatchMeta) -> Result<(), ControllerError> {
        lock(&self.core).register(meta)
    }

    /// See [`Controller::claim`].
    pub fn claim(
        &self,
        partition: &str,
        group: &str,
        n: usize,
        min: usize,
        required: &[String],
    ) -> Result<Claim, ControllerError> {
        lock(&self.core).claim(partition, group, n, min, required, Instant::now())
    }

    /// See [`Controller::ack`].
    pub fn ack(
        &self,
        partition: &str,
        group: &str,
        claim_id: u64,
        keys: &[String],
    ) -> Result<AckReport, ControllerError> {
        lock(&self.core).ack(partition, group, claim_id, keys)
    }

    /// See [`Controller::mark_unit_lost`].
    pub fn mark_unit_lost(&self, unit: u32, reason: &str) -> Vec<String> {
        let lost = lock(&self.core).mark_unit_lost(unit, reason);
        if !lost.is_empty() {
            tracing::warn!(unit, reason, partitions = ?lost, "transfer-queue storage unit lost");
        }
        lost
    }

    /// See [`Controller::status`].
    pub fn status(&self, partition: &str) -> Option<PartitionStatus> {
        lock(&self.core).status(partition, Instant::now())
    }

    /// Forgets `partition` and frees its bytes in every storage unit (all of them: a put may have
    /// stored bytes whose registration failed). Units that cannot be reached are reported, not
    /// fatal: a dead unit holds nothing any more.
    pub async fn clear(&self, partition: &str) -> ClearReport {
        lock(&self.core).clear(partition);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let lost = lock(&self.core).lost_units().clone();
        let jobs = self.config.units.iter().filter(|(u, _)| !lost.contains_key(u)).map(|(&unit, addr)| {
            let auth = &self.config.auth;
            let link = &self.clear_links[&unit];
            async move { (unit, clear_unit(link, addr, auth, partition, deadline).await) }
        });
        let mut report = ClearReport { freed: 0, units: 0, unreachable: Vec::new() };
        for (unit, r) in futures::future::join_all(jobs).await {
            match r {
                Ok(freed) => {
                    report.freed += freed;
                    report.units += 1;
                }
                Err(e) => report.unreachable.push((unit, e)),
            }
        }
        report
    }

    /// Serves clients on `listener` until the listener fails. Each connection runs on its own
    /// task; a bad frame gets an error reply and closes only its own connection.
    pub async fn serve(self, listener: TcpListener) -> Result<(), NetError> {
        net::serve_connections(listener, "controller clients", move |stream| {
            let this = self.clone();
            async move {
                if let Err(e) = this.serve_connection(stream).await {
                    tracing::debug!(error = %e, "transfer-queue controller connection ended");
                }
            }
        })
        .await
    }

    async fn serve_connection(&self, mut stream: TcpStream) -> Result<(), NetError> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let (hello, mut session) =
            net::accept_hello(&mut stream, &self.config.auth, CONTROLLER_MAGIC, WIRE_VERSION, deadline, |_| Ok(()))
                .await?;
        let peer = hello.peer;
        let mut buf = Vec::new();
        let mut out = Vec::new();
        loop {
            for b in [&mut buf, &mut out] {
                if b.capacity() > codec::KEPT_BUFFER {
                    *b = Vec::new();
                }
            }
            let (header, body) = match codec::read_message(&mut stream, &mut session.recv, &mut buf).await {
                Ok(m) => m,
                Err(ReadError::Io(e)) => return Err(NetError::io("reading a request", peer.as_str(), e)),
                Err(ReadError::Codec(e)) => {
                    // Out of step with the peer: reply, then close.
                    let reply = Body::Error { code: ErrorCode::Malformed, message: e.to_string() };
                    let _ = codec::write_message(&mut stream, &mut session.send, &self.reply_header(0), &reply).await;
                    return Err(NetError::Refused { peer, reason: e.to_string() });
                }
            };
            let reply = if header.token != self.config.auth.token() {
                Body::Error {
                    code: ErrorCode::Token,
                    message: format!(
                        "job token `{}` does not match `{}`: the client belongs to another job or epoch",
                        header.token,
                        self.config.auth.token()
                    ),
                }
            } else {
                self.handle(body).await
            };
            let h = self.reply_header(header.request_id);
            codec::write_message_with(&mut stream, &mut session.send, &h, &reply, &mut out)
                .await
                .map_err(|e| NetError::io("replying", peer.as_str(), e))?;
        }
    }

    fn reply_header(&self, request_id: u32) -> Header {
        Header { version: WIRE_VERSION, request_id, token: self.config.auth.token().to_string() }
    }

    async fn handle(&self, body: Body) -> Body {
        let err = |e: ControllerError| Body::Error { code: e.code(), message: e.to_string() };
        match body {
            Body::Register(meta) => self.register(&meta).map(|_| Body::Done).unwrap_or_else(err),
            Body::Claim { partition, group, n, min, required } => self
                .claim(&partition, &group, n as usize, min as usize, &required)
                .map(|c| Body::Claimed { claim_id: c.claim_id, lease_ms: c.lease.as_millis() as u64, meta: c.meta })
                .unwrap_or_else(err),
            Body::Ack { partition, group, claim_id, keys } => self
                .ack(&partition, &group, claim_id, &keys)
                .map(|r| Body::Acked { acked: r.acked, stale: r.stale })
                .unwrap_or_else(err),
            Body::Clear { partition } => {
                let r = self.clear(&partition).await;
                if r.unreachable.is_empty() {
                    Body::Cleared { freed: r.freed, units: r.units }
                } else {
                    Body::Error {
                        code: ErrorCode::UnitUnreachable,
                        message: format!(
                            "partition `{partition}` cleared in {} units ({} bytes), but these could not be reached: {}",
                            r.units,
                            r.freed,
                            r.unreachable.iter().map(|(u, e)| format!("unit {u}: {e}")).collect::<Vec<_>>().join("; ")
                        ),
                    }
                }
            }
            Body::ReportLost { unit, reason } => {
                if !self.config.units.contains_key(&unit) && !self.config.units.is_empty() {
                    return Body::Error {
                        code: ErrorCode::NotFound,
                        message: format!("storage unit {unit} is not in the plan"),
                    };
                }
                self.mark_unit_lost(unit, &reason);
                Body::Done
            }
            other => Body::Error {
                code: ErrorCode::BadRequest,
                message: format!("message kind {} is not a controller request", other.kind()),
            },
        }
    }

    /// Units whose watch connection is up now.
    pub fn watched_units(&self) -> Vec<u32> {
        self.watched.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect()
    }

    /// Watches every storage unit: once connected, a unit whose connection drops or stops
    /// answering pings is marked lost (its partitions too). Units not up yet are retried. The
    /// watchers stop when the last handle of this controller is dropped.
    pub fn watch_units(&self, ping_every: Duration) {
        for (&unit, addr) in &self.config.units {
            let weak: Weak<Mutex<Controller>> = Arc::downgrade(&self.core);
            let addr = addr.clone();
            let auth = self.config.auth.clone();
            let watched = self.watched.clone();
            let closed = self.closed.clone();
            tokio::spawn(async move {
                let connected = || watched.lock().unwrap_or_else(|e| e.into_inner()).insert(unit);
                let reason = watch_unit(&addr, &auth, ping_every, || weak.strong_count() > 0, connected).await;
                watched.lock().unwrap_or_else(|e| e.into_inner()).remove(&unit);
                if closed.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                if let (Some(core), Some(reason)) = (weak.upgrade(), reason) {
                    let lost = lock(&core).mark_unit_lost(unit, &reason);
                    tracing::warn!(unit, %addr, %reason, partitions = ?lost, "transfer-queue storage unit lost");
                }
            });
        }
    }
}

/// Connects to a storage unit as the controller, with the handshake.
pub(crate) async fn connect_unit(
    addr: &str,
    auth: &JobAuth,
    peer_name: &str,
    deadline: tokio::time::Instant,
) -> Result<Connection, NetError> {
    let mut s = net::connect_retry(addr, deadline, "transfer-queue storage").await?;
    let hello = Hello { magic: STORAGE_MAGIC, version: WIRE_VERSION, peer: peer_name.into(), extra: vec![] };
    let session = net::send_hello(&mut s, auth, &hello, deadline, addr).await?;
    Ok(Connection { stream: s, session })
}

/// Clears `partition` in the unit at `addr` over its kept connection `link` (opened if there is
/// none yet). A kept connection that fails is replaced once: the unit may have closed it.
async fn clear_unit(
    link: &tokio::sync::Mutex<Option<Connection>>,
    addr: &str,
    auth: &JobAuth,
    partition: &str,
    deadline: tokio::time::Instant,
) -> Result<u64, String> {
    let work = async {
        let mut link = link.lock().await;
        // Out of the slot while in use: a request cut short (the deadline) drops the connection
        // rather than leave its reply for the next clear to read.
        let mut kept = link.take();
        loop {
            let reused = kept.is_some();
            let mut s = match kept.take() {
                Some(s) => s,
                None => connect_unit(addr, auth, "tq-controller", deadline).await.map_err(|e| e.to_string())?,
            };
            match clear_request(&mut s, auth, partition).await {
                Ok(answer) => {
                    *link = Some(s);
                    return answer;
                }
                Err(e) if !reused => return Err(e),
                Err(_) => {}
            }
        }
    };
    match tokio::time::timeout_at(deadline, work).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer from {addr} within the deadline")),
    }
}

/// One clear request on `s`: the unit's answer (`Ok(Err)` when it refused), or the connection's
/// failure.
async fn clear_request(s: &mut Connection, auth: &JobAuth, partition: &str) -> Result<Result<u64, String>, String> {
    let h = Header { version: WIRE_VERSION, request_id: 1, token: auth.token().into() };
    let body = Body::ClearUnit { partition: partition.into() };
    codec::write_message(&mut s.stream, &mut s.session.send, &h, &body).await.map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    Ok(match codec::read_message(&mut s.stream, &mut s.session.recv, &mut buf).await.map_err(|e| e.to_string())? {
        (_, Body::Cleared { freed, .. }) => Ok(freed),
        (_, Body::Error { message, .. }) => Err(message),
        (_, other) => Err(format!("unexpected reply kind {}", other.kind())),
    })
}

/// Returns why the unit is considered dead, or None if the watch ended because `alive` said so.
async fn watch_unit(
    addr: &str,
    auth: &JobAuth,
    ping_every: Duration,
    alive: impl Fn() -> bool,
    connected: impl FnOnce() -> bool,
) -> Option<String> {
    // Connect (the unit may start after the controller), retrying while the controller lives.
    let mut s = loop {
        if !alive() {
            return None;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        match connect_unit(addr, auth, "tq-controller-watch", deadline).await {
            Ok(s) => {
                connected();
                break s;
            }
            Err(NetError::Refused { reason, .. }) => return Some(format!("refused the controller: {reason}")),
            Err(_) => continue,
        }
    };
    let mut buf = Vec::new();
    let h = Header { version: WIRE_VERSION, request_id: 0, token: auth.token().into() };
    let answer_within = ping_every.max(Duration::from_millis(100)) * 10;
    loop {
        if !alive() {
            return None;
        }
        if let Err(e) = codec::write_message(&mut s.stream, &mut s.session.send, &h, &Body::Ping).await {
            return Some(format!("connection to {addr} failed: {e}"));
        }
        let answer = codec::read_message(&mut s.stream, &mut s.session.recv, &mut buf);
        match tokio::time::timeout(answer_within, answer).await {
            Ok(Ok((_, Body::Pong { .. }))) => {}
            Ok(Ok((_, other))) => return Some(format!("answered a ping with kind {}", other.kind())),
            Ok(Err(e)) => return Some(format!("connection to {addr} closed: {e}")),
            Err(_) => return Some(format!("no ping answer from {addr} within {answer_within:?}")),
        }
        tokio::time::sleep(ping_every).await;
    }
}
