//! TCP transport (tokio): one sender's broadcast relayed through its receivers.
//!
//! # Topology
//! The members of one stream form a pipelined tree, numbered as a heap: node 0 is the sender,
//! nodes `1..=R` are the receivers in the group's relay order, and node `n`'s parent is
//! `(n - 1) / fanout`. With the default fanout 1 it is a chain, as NCCL's ring broadcast:
//! `sender → gen-0 → gen-1 → … → gen-(R-1)`. Every receiver forwards each chunk
//! (`relay_chunk_bytes`) to its children as soon as the chunk has arrived, straight from where it
//! landed (the destination tensor or the staging buffer), so the sender's link carries the bytes
//! once whatever R is, and every link carries them at most once in each direction. The pipeline's
//! fill time is one chunk per hop.
//!
//! # Rendezvous
//! The sender listens on its `ports.refit` address from the WorkerPlan; every receiver listens on
//! its own `ports.refit` for its relay children. Each member connects to its parent with
//! [`net::connect_retry`] until the deadline and runs the authenticated handshake of
//! [`rlplane_wire::net`] (job token, proof of the epoch's key) with, in `extra`, the stream's sender
//! (process index) and its [`PlanIdentity`]. The parent refuses a peer without the key, a peer
//! that is not its expected child for that stream, or one whose plan differs; a plan
//! mismatch fails both sides with both sides' manifest length, bucket size and alignment.
//! Connections are made once and reused for every refit.
//!
//! # Wire protocol, per refit
//! Parent → child: a 24-byte header (`RFHD`, record bytes, version, stream bytes), then the
//! stream's bytes:
//! every segment of every bucket in plan order, densely (no padding, no per-bucket metadata).
//! Child → parent: a 16-byte acknowledgement (`RFAK`, version) once the child has its complete
//! weights and every child of its own has acknowledged. A closed connection is a dead peer.
//!
//! Every message is followed by its tag ([`net::mac`], keys from the connection's handshake), and
//! a bucket's bytes are cut into records, each followed by its tag. The root picks the record size
//! (the relay chunk, at most [`net::RECORD_BYTES`]) and the header carries it down the tree, so
//! every hop cuts the stream alike. Tags are made and checked on helper threads ([`net::MacPool`]) beside the socket I/O:
//! the sender tags records ahead of writing them, a leaf checks a record while the next one
//! arrives, and a relay forwards a record's bytes while checking them but sends its children the
//! record's tag only once the bytes checked out, so a child never accepts a record its parent did
//! not. A bucket completes only when every record of it checked out, so a version is never
//! published over bytes that did not.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rlplane_api::plan::{RefitGroup, WorkerPlan};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Piece, Transport, TransportError};
use crate::memory::{AccessFence, Copy2d, HostBuffer, HostCopyStream, MemorySpace, Region};
use crate::plan::PlanIdentity;
use rlplane_wire::net::{self, FrameKey, Hello, JobAuth, MacPool, NetError, Pending, Session, Span, TAG_LEN, Tag};

/// Handshake magic of refit connections.
pub const HELLO_MAGIC: [u8; 4] = *b"RFIT";
/// Version of this wire protocol. 2: every message and record carries its tag. 3: tags are
/// AES-256-GMAC.
pub const PROTOCOL_VERSION: u16 = 3;
/// Start of a refit refusal reason that is a plan mismatch (so the connecting side can tell).
const PLAN_MISMATCH_PREFIX: &str = "refit plans differ";

const HEADER_MAGIC: [u8; 4] = *b"RFHD";
const HEADER_LEN: usize = 24;
const ACK_MAGIC: [u8; 4] = *b"RFAK";
const ACK_LEN: usize = 16;
/// Slices per vectored read or write.
const MAX_IOV: usize = 64;
/// Records a sender tags ahead of the one it writes.
const TAG_AHEAD: usize = 4;
/// Records a leaf may have arrived and not yet checked.
const CHECKS_IN_FLIGHT: usize = 8;
/// Helper threads per transport that tag and check records.
const MAC_THREADS: usize = 2;

/// One member of a stream: its process, name and refit addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Process index in the WorkerPlan.
    pub process: u32,
    /// Process name (`trainer-0`, `gen-3`).
    pub name: String,
    /// `host:port` others connect to.
    pub address: String,
    /// `host:port` it binds.
    pub bind_address: String,
}

impl Member {
    /// The member for process `process` of `plan`, with its refit port.
    pub fn from_plan(plan: &WorkerPlan, process: u32) -> Result<Member, TransportError> {
        let p = plan.processes.get(process as usize).ok_or_else(|| {
            TransportError::Config(format!("process index {process} is not in the plan; rebuild the plan"))
        })?;
        let port = p.ports.refit.ok_or_else(|| {
            TransportError::Config(format!(
                "process {} has no refit port in the plan; it is not a member of a refit group",
                p.name
            ))
        })?;
        Ok(Member {
            process,
            name: p.name.clone(),
            address: plan.address(process, port),
            bind_address: plan.bind_address(process, port),
        })
    }
}

/// The relay tree of one sender's stream. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The root.
    pub sender: Member,
    /// Receivers in relay order.
    pub receivers: Vec<Member>,
    /// Children per node (1 = chain).
    pub fanout: u32,
}

impl Route {
    /// A route; `fanout` must be at least 1 and there must be a receiver.
    pub fn new(sender: Member, receivers: Vec<Member>, fanout: u32) -> Result<Route, TransportError> {
        if fanout == 0 {
            return Err(TransportError::Config("relay fanout must be at least 1 (1 = chain)".into()));
        }
        if receivers.is_empty() {
            return Err(TransportError::Config(format!("the refit stream of {} has no receivers", sender.name)));
        }
        Ok(Route { sender, receivers, fanout })
    }

    /// The route of `sender`'s stream in `group` of `plan`.
    pub fn from_plan(plan: &WorkerPlan, group: &RefitGroup, sender: u32, fanout: u32) -> Result<Route, TransportError> {
        if !group.senders.contains(&sender) {
            return Err(TransportError::Config(format!(
                "process {sender} is not a sender of refit group {}",
                group.name
            )));
        }
        let receivers = group.receivers.iter().map(|&r| Member::from_plan(plan, r)).collect::<Result<Vec<_>, _>>()?;
        Route::new(Member::from_plan(plan, sender)?, receivers, fanout)
    }

    /// Node `n` (0 = sender).
    pub fn node(&self, n: usize) -> &Member {
        if n == 0 { &self.sender } else { &self.receivers[n - 1] }
    }

    /// The node of a process, if it is a member.
    pub fn node_of(&self, process: u32) -> Option<usize> {
        if self.sender.process == process {
            return Some(0);
        }
        self.receivers.iter().position(|m| m.process == process).map(|i| i + 1)
    }

    /// The parent of node `n` (`None` for the root).
    pub fn parent(&self, n: usize) -> Option<&Member> {
        (n > 0).then(|| self.node((n - 1) / self.fanout as usize))
    }

    /// The children of node `n`.
    pub fn children(&self, n: usize) -> Vec<&Member> {
        let f = self.fanout as usize;
        let first = n * f + 1;
        (first..first + f).filter(|&c| c <= self.receivers.len()).map(|c| self.node(c)).collect()
    }
}

/// Tuning of the TCP transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpOptions {
    /// Bytes a relay receives before forwarding them to its children (the pipeline's grain), which
    /// are also the bytes of a tagged record: at most [`net::RECORD_BYTES`], larger values are
    /// cut to it. The root's setting holds for the whole stream.
    pub relay_chunk_bytes: u64,
    /// Children per relay node: 1 = chain (default), 2 = binary tree, ...
    pub fanout: u32,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions { relay_chunk_bytes: 1 << 20, fanout: 1 }
    }
}

/// A bound refit listener: the sender's rendezvous, or a receiver's relay listener. Bind it once
/// and keep it: reconnecting after a failure reuses it.
#[derive(Debug)]
pub struct RefitListener {
    listener: TcpListener,
    name: String,
}

impl RefitListener {
    /// Binds `member`'s refit address.
    pub async fn bind(member: &Member) -> Result<RefitListener, TransportError> {
        let listener = net::bind(&member.bind_address, &format!("refit ({})", member.name)).await?;
        Ok(RefitListener { listener, name: member.name.clone() })
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }
}

fn encode_extra(sender: u32, identity: &PlanIdentity) -> Vec<u8> {
    let mut v = sender.to_le_bytes().to_vec();
    v.extend_from_slice(&identity.encode());
    v
}

fn decode_extra(b: &[u8]) -> Option<(u32, PlanIdentity)> {
    if b.len() < 4 {
        return None;
    }
    Some((u32::from_le_bytes(b[..4].try_into().ok()?), PlanIdentity::decode(&b[4..])?))
}

/// One relay child a listener waits for.
struct Expected<'a> {
    route: &'a Route,
    identity: PlanIdentity,
    child: &'a str,
}

/// Accepts every expected child (refusing strangers, failing on a plan mismatch).
async fn accept_children(
    listener: &RefitListener,
    expected: &[Expected<'_>],
    auth: &JobAuth,
    deadline: Instant,
) -> Result<Vec<Link>, TransportError> {
    let mut slots: Vec<Option<Link>> = expected.iter().map(|_| None).collect();
    let me = listener.name.as_str();
    while slots.iter().any(Option::is_none) {
        let missing: Vec<String> = expected
            .iter()
            .zip(&slots)
            .filter(|(_, s)| s.is_none())
            .map(|(e, _)| format!("{} (stream of {})", e.child, e.route.sender.name))
            .collect();
        let waiting = format!("waiting at {me} for relay children to connect");
        let (mut stream, addr) = net::until(deadline, &waiting, &missing.join(", "), async {
            listener.listener.accept().await.map_err(|e| NetError::io("accepting a relay child", me, e))
        })
        .await?;
        net::tune(&stream);
        let mut matched: Option<usize> = None;
        let mut mismatch: Option<String> = None;
        let verdict = net::accept_hello(&mut stream, auth, HELLO_MAGIC, PROTOCOL_VERSION, deadline, |h| {
            let Some((sender, theirs)) = decode_extra(&h.extra) else {
                return Err("malformed refit handshake (no plan identity); run matching rlplane images".into());
            };
            let Some(i) = expected.iter().position(|e| e.route.sender.process == sender && e.child == h.peer) else {
                return Err(format!(
                    "{} is not a relay child of {me} for the stream of process {sender}; expected {}",
                    h.peer,
                    missing.join(", ")
                ));
            };
            if slots[i].is_some() {
                return Err(format!("{} is already connected to {me} for this stream", h.peer));
            }
            if theirs != expected[i].identity {
                let reason = expected[i].identity.mismatch(me, &theirs, &h.peer);
                mismatch = Some(h.peer.clone());
                return Err(reason);
            }
            matched = Some(i);
            Ok(())
        })
        .await;
        match verdict {
            Ok((_, session)) => {
                let i = matched.expect("an accepted hello matched an expected child");
                slots[i] = Some(Link { stream, session });
            }
            Err(NetError::Refused { reason, .. }) if mismatch.is_some() => {
                return Err(TransportError::PlanMismatch { peer: mismatch.unwrap_or_default(), detail: reason });
            }
            Err(e) => {
                // A stray peer (another job or epoch, or a stale rank) must not stop this one.
                tracing::warn!(listener = me, peer = %addr, error = %e, "refused a refit connection");
            }
        }
    }
    Ok(slots.into_iter().map(|s| s.expect("every slot is filled")).collect())
}

async fn connect_parent(
    route: &Route,
    node: usize,
    identity: &PlanIdentity,
    auth: &JobAuth,
    deadline: Instant,
) -> Result<Link, TransportError> {
    let me = route.node(node);
    let parent = route.parent(node).expect("a receiver has a parent");
    let what = format!("the refit stream of {} (relay parent {})", route.sender.name, parent.name);
    let mut stream = net::connect_retry(&parent.address, deadline, &what).await?;
    let hello = Hello {
        magic: HELLO_MAGIC,
        version: PROTOCOL_VERSION,
        peer: me.name.clone(),
        extra: encode_extra(route.sender.process, identity),
    };
    match net::send_hello(&mut stream, auth, &hello, deadline, &parent.name).await {
        Ok(session) => Ok(Link { stream, session }),
        Err(NetError::Refused { peer, reason }) if reason.starts_with(PLAN_MISMATCH_PREFIX) => {
            Err(TransportError::PlanMismatch { peer, detail: reason })
        }
        Err(e) => Err(e.into()),
    }
}

/// The sender's side of its stream: accepts its relay children on `listener` until `deadline`.
pub async fn connect_root(
    listener: &RefitListener,
    route: &Route,
    identity: PlanIdentity,
    auth: &JobAuth,
    options: &TcpOptions,
    deadline: Instant,
) -> Result<TcpTransport, TransportError> {
    let children = route.children(0);
    let expected: Vec<Expected<'_>> =
        children.iter().map(|c| Expected { route, identity, child: c.name.as_str() }).collect();
    let streams = accept_children(listener, &expected, auth, deadline).await?;
    let children = streams.into_iter().zip(children).map(|(s, m)| (s, m.name.clone())).collect();
    TcpTransport::start(route, 0, None, children, identity.stream_bytes, options)
}

/// A receiver's side of every stream it receives (one per sender), in the order of `streams`:
/// connects to each stream's relay parent and accepts its relay children on `listener`,
/// concurrently, until `deadline`.
pub async fn connect_receiver(
    listener: &RefitListener,
    me: u32,
    streams: &[(Route, PlanIdentity)],
    auth: &JobAuth,
    options: &TcpOptions,
    deadline: Instant,
) -> Result<Vec<TcpTransport>, TransportError> {
    let mut nodes = Vec::with_capacity(streams.len());
    for (route, _) in streams {
        let node = route.node_of(me).filter(|&n| n > 0).ok_or_else(|| {
            TransportError::Config(format!("process {me} is not a receiver of the stream of {}", route.sender.name))
        })?;
        nodes.push(node);
    }
    let mut expected = Vec::new();
    let mut owner = Vec::new();
    for (i, ((route, identity), &node)) in streams.iter().zip(&nodes).enumerate() {
        for child in route.children(node) {
            expected.push(Expected { route, identity: *identity, child: child.name.as_str() });
            owner.push(i);
        }
    }
    let accept = accept_children(listener, &expected, auth, deadline);
    let connect = futures::future::try_join_all(
        streams
            .iter()
            .zip(&nodes)
            .map(|((route, identity), &node)| connect_parent(route, node, identity, auth, deadline)),
    );
    let (children, parents) = tokio::try_join!(accept, connect)?;
    let mut per_stream: Vec<Vec<(Link, String)>> = streams.iter().map(|_| Vec::new()).collect();
    for ((stream, e), i) in children.into_iter().zip(&expected).zip(owner) {
        per_stream[i].push((stream, e.child.to_string()));
    }
    let mut out = Vec::with_capacity(streams.len());
    for ((((route, identity), &node), parent), children) in streams.iter().zip(&nodes).zip(parents).zip(per_stream) {
        let parent_name = route.parent(node).expect("a receiver has a parent").name.clone();
        out.push(TcpTransport::start(
            route,
            node,
            Some((parent, parent_name)),
            children,
            identity.stream_bytes,
            options,
        )?);
    }
    Ok(out)
}

/// Completion of a [`TcpTransport`] operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpTicket {
    /// A socket operation (header, bucket, acknowledgement), by sequence number.
    Io(u64),
    /// A batch of copies on the host copy thread, by sequence number.
    Copy(u64),
}

enum Command {
    Begin { seq: u64, version: Option<u64> },
    Bucket { seq: u64, bucket: u32, pieces: Vec<Piece> },
    End { seq: u64, version: u64 },
}

#[derive(Clone, Debug, Default)]
struct Progress {
    done: u64,
    version: Option<u64>,
    error: Option<TransportError>,
}

/// What the I/O task is doing, for timeout messages: op, peer index, bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    Idle = 0,
    SendHeader,
    ReadHeader,
    Send,
    Receive,
    Forward,
    ReadAck,
    SendAck,
}

impl Op {
    fn from_u8(v: u8) -> Op {
        [Op::Idle, Op::SendHeader, Op::ReadHeader, Op::Send, Op::Receive, Op::Forward, Op::ReadAck, Op::SendAck]
            .get(v as usize)
            .copied()
            .unwrap_or(Op::Idle)
    }

    fn describe(self, bucket: u32) -> String {
        match self {
            Op::Idle => "idle".into(),
            Op::SendHeader => "sending the refit header".into(),
            Op::ReadHeader => "waiting for the refit header".into(),
            Op::Send => format!("sending bucket {bucket}"),
            Op::Receive => format!("receiving bucket {bucket}"),
            Op::Forward => format!("forwarding bucket {bucket}"),
            Op::ReadAck => "waiting for the completion acknowledgement".into(),
            Op::SendAck => "sending the completion acknowledgement".into(),
        }
    }
}

struct Shared {
    /// Index 0: the parent (empty for the root); then the children.
    peers: Vec<String>,
    /// `op << 56 | peer << 32 | bucket`.
    activity: AtomicU64,
    pool: Mutex<Vec<Vec<Piece>>>,
}

impl Shared {
    fn set(&self, op: Op, peer: usize, bucket: u32) {
        self.activity.store((op as u64) << 56 | (peer as u64) << 32 | bucket as u64, Ordering::Relaxed);
    }

    fn activity(&self) -> (Op, &str, u32) {
        let a = self.activity.load(Ordering::Relaxed);
        let peer = ((a >> 32) & 0xff_ffff) as usize;
        (Op::from_u8((a >> 56) as u8), self.peers.get(peer).map_or("?", String::as_str), a as u32)
    }
}

/// One member's side of one stream over TCP. See the module docs.
pub struct TcpTransport {
    name: String,
    root: bool,
    commands: mpsc::UnboundedSender<Command>,
    progress: watch::Receiver<Progress>,
    shared: Arc<Shared>,
    next_seq: u64,
    io: JoinHandle<()>,
    copier: HostCopyStream,
    fence: AccessFence,
    aborted: Option<String>,
}

impl TcpTransport {
    fn start(
        route: &Route,
        node: usize,
        upstream: Option<(Link, String)>,
        children: Vec<(Link, String)>,
        stream_bytes: u64,
        options: &TcpOptions,
    ) -> Result<TcpTransport, TransportError> {
        let me = &route.node(node).name;
        let name = format!("tcp stream of {} at {me}", route.sender.name);
        let fence = AccessFence::new();
        let copier = HostCopyStream::new(me, fence.clone())
            .map_err(|e| TransportError::Config(format!("cannot start the refit copy thread: {e}")))?;
        let mut peers = vec![upstream.as_ref().map(|(_, n)| n.clone()).unwrap_or_default()];
        peers.extend(children.iter().map(|(_, n)| n.clone()));
        let shared = Arc::new(Shared { peers, activity: AtomicU64::new(0), pool: Mutex::default() });
        let macs = MacPool::new("refit", MAC_THREADS);
        let (commands, rx) = mpsc::unbounded_channel();
        let (tx, progress) = watch::channel(Progress::default());
        let io = Io {
            upstream: upstream.map(|(s, _)| s),
            children: children.into_iter().map(|(s, _)| s).collect(),
            shared: shared.clone(),
            fence: fence.clone(),
            macs,
            stream_bytes,
            record: options.relay_chunk_bytes.clamp(1, net::RECORD_BYTES as u64),
        };
        let io = tokio::spawn(io.run(rx, tx));
        Ok(TcpTransport {
            name,
            root: node == 0,
            commands,
            progress,
            shared,
            next_seq: 0,
            io,
            copier,
            fence,
            aborted: None,
        })
    }

    fn usable(&self) -> Result<(), TransportError> {
        match &self.aborted {
            Some(reason) => Err(TransportError::Aborted { name: self.name.clone(), reason: reason.clone() }),
            None => Ok(()),
        }
    }

    fn push(&mut self, make: impl FnOnce(u64) -> Command) -> Result<u64, TransportError> {
        self.usable()?;
        self.next_seq += 1;
        let seq = self.next_seq;
        if self.commands.send(make(seq)).is_err() {
            return Err(self.ended_error());
        }
        Ok(seq)
    }

    /// The error of an I/O task that has ended.
    fn ended_error(&self) -> TransportError {
        self.progress
            .borrow()
            .error
            .clone()
            .unwrap_or_else(|| TransportError::Aborted { name: self.name.clone(), reason: "its I/O task ended".into() })
    }

    async fn wait_io(&mut self, seq: u64, deadline: Instant) -> Result<(), TransportError> {
        let shared = &self.shared;
        // A refit that stalls on a peer says so every few seconds, naming it and the bucket.
        let what = || {
            let (op, peer, bucket) = shared.activity();
            format!("{} with {peer}", op.describe(bucket))
        };
        let waited = rlplane_wire::patience::wait_reporting(deadline, what, async {
            self.progress.wait_for(|p| p.done >= seq || p.error.is_some()).await.map(|p| (p.done, p.error.clone()))
        })
        .await;
        match waited {
            Ok(Ok((done, _))) if done >= seq => Ok(()),
            Ok(Ok((_, error))) => Err(error.expect("the wait ended on an error")),
            Ok(Err(_)) => Err(self.ended_error()),
            Err(waited) => {
                let (op, peer, bucket) = self.shared.activity();
                Err(TransportError::Timeout {
                    peer: peer.to_string(),
                    what: op.describe(bucket),
                    secs: waited.as_secs_f64(),
                })
            }
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.fence.revoke();
        self.io.abort();
    }
}

impl Transport for TcpTransport {
    type Ticket = TcpTicket;
    type Staging = HostBuffer;

    fn name(&self) -> &str {
        &self.name
    }

    fn is_root(&self) -> bool {
        self.root
    }

    fn reaches(&self, space: MemorySpace) -> bool {
        space == MemorySpace::Host
    }

    fn alloc_staging(&mut self, bytes: u64) -> Result<HostBuffer, TransportError> {
        Ok(HostBuffer::new(bytes))
    }

    async fn begin(&mut self, version: Option<u64>, deadline: Instant) -> Result<u64, TransportError> {
        if self.root && version.is_none() {
            return Err(TransportError::Config("the root must give the refit's version".into()));
        }
        let seq = self.push(|seq| Command::Begin { seq, version })?;
        self.wait_io(seq, deadline).await?;
        Ok(self.progress.borrow().version.expect("a completed begin records the version"))
    }

    unsafe fn submit(&mut self, bucket: u32, pieces: &[Piece]) -> Result<TcpTicket, TransportError> {
        if let Some(p) = pieces.iter().find(|p| p.region.space != MemorySpace::Host) {
            return Err(TransportError::Config(format!(
                "{} cannot reach {:?} memory (segment {}); stage it through host buffers",
                self.name, p.region.space, p.segment
            )));
        }
        let mut v = self.shared.pool.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
        v.extend_from_slice(pieces);
        self.push(|seq| Command::Bucket { seq, bucket, pieces: v }).map(TcpTicket::Io)
    }

    unsafe fn copy(&mut self, copies: &[Copy2d]) -> Result<TcpTicket, TransportError> {
        self.usable()?;
        if copies.iter().any(|c| c.src.space != MemorySpace::Host || c.dst.space != MemorySpace::Host) {
            return Err(TransportError::Config(format!("{} copies host memory only", self.name)));
        }
        // SAFETY: forwarded from the caller.
        Ok(TcpTicket::Copy(unsafe { self.copier.submit(copies) }))
    }

    async fn wait(&mut self, ticket: TcpTicket, deadline: Instant) -> Result<(), TransportError> {
        match ticket {
            TcpTicket::Io(seq) => self.wait_io(seq, deadline).await,
            TcpTicket::Copy(seq) => {
                let start = Instant::now();
                self.copier.wait(seq, deadline).await.map_err(|revoked| {
                    if revoked {
                        TransportError::Aborted { name: self.name.clone(), reason: "copies were cancelled".into() }
                    } else {
                        TransportError::Timeout {
                            peer: "(local copy thread)".into(),
                            what: "copying between staging and tensors".into(),
                            secs: start.elapsed().as_secs_f64(),
                        }
                    }
                })
            }
        }
    }

    async fn end(&mut self, version: u64, deadline: Instant) -> Result<(), TransportError> {
        let seq = self.push(|seq| Command::End { seq, version })?;
        self.wait_io(seq, deadline).await
    }

    fn abort(&mut self, reason: &str) {
        self.fence.revoke();
        self.io.abort();
        if self.aborted.is_none() {
            self.aborted = Some(reason.to_string());
        }
    }

    fn copy_busy(&self) -> Duration {
        self.copier.busy()
    }
}

/// Position in a bucket's pieces.
#[derive(Clone, Copy, Debug, Default)]
struct Cursor {
    piece: usize,
    offset: u64,
}

impl Cursor {
    /// Calls `f(i, region)` for up to [`MAX_IOV`] consecutive spans totalling at most `len` bytes.
    fn spans(&self, pieces: &[Piece], len: u64, mut f: impl FnMut(usize, Region)) -> usize {
        let mut left = len;
        let mut n = 0;
        let mut piece = self.piece;
        let mut offset = self.offset;
        while left > 0 && n < MAX_IOV && piece < pieces.len() {
            let r = pieces[piece].region;
            let take = (r.len - offset).min(left);
            f(n, r.sub(offset, take));
            n += 1;
            left -= take;
            piece += 1;
            offset = 0;
        }
        n
    }

    fn advance(&mut self, pieces: &[Piece], mut by: u64) {
        while by > 0 {
            let rest = pieces[self.piece].region.len - self.offset;
            if by < rest {
                self.offset += by;
                return;
            }
            by -= rest;
            self.piece += 1;
            self.offset = 0;
        }
        while self.piece < pieces.len() && pieces[self.piece].region.len == self.offset {
            self.piece += 1;
            self.offset = 0;
        }
    }
}

/// A connection after its handshake: the socket and its frame keys.
struct Link {
    stream: TcpStream,
    session: Session,
}

impl Link {
    /// Writes `msg` and its tag.
    async fn send(&mut self, msg: &[u8]) -> std::io::Result<()> {
        net::write_tagged(&mut self.stream, &mut self.session.send, msg).await
    }

    /// Reads a message of `N` bytes and checks its tag.
    async fn recv<const N: usize>(&mut self) -> std::io::Result<[u8; N]> {
        let mut b = [0u8; N];
        net::read_tagged(&mut self.stream, &mut self.session.recv, &mut b).await?;
        Ok(b)
    }
}

/// The task that owns a member's sockets and executes its commands in order.
struct Io {
    upstream: Option<Link>,
    children: Vec<Link>,
    shared: Arc<Shared>,
    fence: AccessFence,
    macs: MacPool,
    stream_bytes: u64,
    /// Bytes per tagged record: the root's choice, read from the header by the others.
    record: u64,
}

impl Io {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>, progress: watch::Sender<Progress>) {
        while let Some(command) = commands.recv().await {
            let (seq, result) = match command {
                Command::Begin { seq, version } => (seq, self.begin(version).await.map(Some)),
                Command::Bucket { seq, bucket, mut pieces } => {
                    let r = self.bucket(bucket, &pieces).await;
                    pieces.clear();
                    self.shared.pool.lock().unwrap_or_else(|e| e.into_inner()).push(pieces);
                    (seq, r.map(|()| None))
                }
                Command::End { seq, version } => (seq, self.end(version).await.map(|()| None)),
            };
            self.shared.set(Op::Idle, 0, 0);
            match result {
                Ok(version) => progress.send_modify(|p| {
                    p.done = seq;
                    if version.is_some() {
                        p.version = version;
                    }
                }),
                Err(e) => {
                    // Dropping the sockets on return tells every neighbour at once.
                    progress.send_modify(|p| p.error = Some(e));
                    return;
                }
            }
        }
    }

    fn peer(&self, index: usize) -> String {
        self.shared.peers[index].clone()
    }

    async fn begin(&mut self, version: Option<u64>) -> Result<u64, TransportError> {
        let version = match (version, self.upstream.as_mut()) {
            (Some(v), None) => v,
            (_, Some(up)) => {
                self.shared.set(Op::ReadHeader, 0, 0);
                let h: [u8; HEADER_LEN] =
                    up.recv().await.map_err(|e| NetError::io(Op::ReadHeader.describe(0), self.peer(0), e))?;
                if h[..4] != HEADER_MAGIC {
                    return Err(TransportError::Protocol { peer: self.peer(0), detail: "bad refit header".into() });
                }
                let record = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) as u64;
                if record == 0 || record > net::RECORD_BYTES as u64 {
                    return Err(TransportError::Protocol {
                        peer: self.peer(0),
                        detail: format!("records of {record} bytes (1 to {} expected)", net::RECORD_BYTES),
                    });
                }
                self.record = record;
                let v = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
                let bytes = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
                if bytes != self.stream_bytes {
                    return Err(TransportError::Protocol {
                        peer: self.peer(0),
                        detail: format!("refit of {bytes} bytes where the plan has {}", self.stream_bytes),
                    });
                }
                v
            }
            (None, None) => unreachable!("the root always passes a version"),
        };
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&HEADER_MAGIC);
        h[4..8].copy_from_slice(&(self.record as u32).to_le_bytes());
        h[8..16].copy_from_slice(&version.to_le_bytes());
        h[16..24].copy_from_slice(&self.stream_bytes.to_le_bytes());
        for i in 0..self.children.len() {
            self.shared.set(Op::SendHeader, i + 1, 0);
            self.children[i]
                .send(&h)
                .await
                .map_err(|e| NetError::io(Op::SendHeader.describe(0), self.peer(i + 1), e))?;
        }
        Ok(version)
    }

    async fn bucket(&mut self, bucket: u32, pieces: &[Piece]) -> Result<(), TransportError> {
        let total: u64 = pieces.iter().map(|p| p.region.len).sum();
        // Every member moves the bucket record by record (the relay's chunk, or smaller), so a
        // relay forwards each record as soon as it has arrived.
        let records = records(pieces, total, self.record);
        let mut checks: VecDeque<(RecordCheck, usize)> = VecDeque::new();
        let mut tags: VecDeque<Vec<Pending<Option<Tag>>>> = VecDeque::new();
        let mut tagged = 0;
        for (r, &(start, len)) in records.iter().enumerate() {
            if let Some(up) = self.upstream.as_mut() {
                self.shared.set(Op::Receive, 0, bucket);
                let (mut c, mut tag) = (start, [0u8; TAG_LEN]);
                let peer = self.shared.peers[0].as_str();
                read_pieces(&up.stream, &self.fence, pieces, &mut c, len, &mut tag, peer, bucket).await?;
                let key = up.session.recv.next_key();
                checks.push_back((spawn_check(&self.macs, &self.fence, key, spans(pieces, start, len), tag), r));
            }
            if self.children.is_empty() {
                while checks.len() > CHECKS_IN_FLIGHT {
                    self.checked(checks.pop_front(), bucket).await?;
                }
                continue;
            }
            // A relay tags a record once it has arrived; the root tags ahead of what it writes.
            let until = if self.upstream.is_some() { r + 1 } else { (r + 1 + TAG_AHEAD).min(records.len()) };
            while tagged < until {
                let (at, n) = records[tagged];
                let per_child = self
                    .children
                    .iter_mut()
                    .map(|c| spawn_tag(&self.macs, &self.fence, c.session.send.next_key(), spans(pieces, at, n)))
                    .collect();
                tags.push_back(per_child);
                tagged += 1;
            }
            let per_child = tags.pop_front().expect("every written record was tagged");
            if self.upstream.is_none() {
                // The root tagged ahead: each record goes out with its tag, in the same writes.
                for (i, (child, t)) in self.children.iter().zip(per_child).enumerate() {
                    let tag = t.wait().await.flatten().ok_or_else(aborted)?;
                    let (mut c, peer) = (start, self.shared.peers[i + 1].as_str());
                    self.shared.set(Op::Send, i + 1, bucket);
                    write_pieces(&child.stream, &self.fence, pieces, &mut c, len, &tag, peer, Op::Send, bucket).await?;
                }
                continue;
            }
            for (i, child) in self.children.iter().enumerate() {
                let (mut c, peer) = (start, self.shared.peers[i + 1].as_str());
                self.shared.set(Op::Forward, i + 1, bucket);
                write_pieces(&child.stream, &self.fence, pieces, &mut c, len, &[], peer, Op::Forward, bucket).await?;
            }
            // A relay vouches for a record to its children only once the record checked out.
            while !checks.is_empty() {
                self.checked(checks.pop_front(), bucket).await?;
            }
            for (i, t) in per_child.into_iter().enumerate() {
                let tag = t.wait().await.flatten().ok_or_else(aborted)?;
                let peer = self.shared.peers[i + 1].as_str();
                self.children[i]
                    .stream
                    .write_all(&tag)
                    .await
                    .map_err(|e| NetError::io(Op::Forward.describe(bucket), peer, e))?;
            }
        }
        while !checks.is_empty() {
            self.checked(checks.pop_front(), bucket).await?;
        }
        Ok(())
    }

    /// Waits for a record's check: a record whose tag failed fails the bucket, naming the parent.
    async fn checked(&self, check: Option<(RecordCheck, usize)>, bucket: u32) -> Result<(), TransportError> {
        let Some((check, record)) = check else { return Ok(()) };
        match check.wait().await.flatten() {
            Some(Ok(())) => Ok(()),
            Some(Err(bad)) => Err(TransportError::Protocol {
                peer: self.shared.peers[0].clone(),
                detail: format!("bucket {bucket}, record {record}: {bad}"),
            }),
            None => Err(aborted()),
        }
    }

    async fn end(&mut self, version: u64) -> Result<(), TransportError> {
        for i in 0..self.children.len() {
            self.shared.set(Op::ReadAck, i + 1, 0);
            let a: [u8; ACK_LEN] = self.children[i]
                .recv()
                .await
                .map_err(|e| NetError::io(Op::ReadAck.describe(0), self.peer(i + 1), e))?;
            let v = u64::from_le_bytes(a[8..16].try_into().expect("8 bytes"));
            if a[..4] != ACK_MAGIC || v != version {
                return Err(TransportError::Protocol {
                    peer: self.peer(i + 1),
                    detail: format!("acknowledged version {v} where {version} was sent"),
                });
            }
        }
        if let Some(up) = self.upstream.as_mut() {
            self.shared.set(Op::SendAck, 0, 0);
            let mut a = [0u8; ACK_LEN];
            a[..4].copy_from_slice(&ACK_MAGIC);
            a[8..16].copy_from_slice(&version.to_le_bytes());
            up.send(&a).await.map_err(|e| NetError::io(Op::SendAck.describe(0), self.shared.peers[0].clone(), e))?;
        }
        Ok(())
    }
}

/// A bucket's records: where each starts and its length (`record` bytes, the last one shorter).
fn records(pieces: &[Piece], total: u64, record: u64) -> Vec<(Cursor, u64)> {
    let record = record.max(1);
    let mut out = Vec::with_capacity(total.div_ceil(record) as usize);
    let (mut cursor, mut done) = (Cursor::default(), 0);
    while done < total {
        let len = record.min(total - done);
        out.push((cursor, len));
        cursor.advance(pieces, len);
        done += len;
    }
    out
}

/// The memory of `len` bytes of the pieces from `start` on.
fn spans(pieces: &[Piece], start: Cursor, len: u64) -> Vec<Span> {
    let mut out = Vec::new();
    let (mut piece, mut offset, mut left) = (start.piece, start.offset, len);
    while left > 0 && piece < pieces.len() {
        let r = pieces[piece].region;
        let take = (r.len - offset).min(left);
        out.push(Span::new((r.addr + offset) as usize, take as usize));
        left -= take;
        piece += 1;
        offset = 0;
    }
    out
}

/// A record's check on a helper thread: `None` if the fence was revoked first.
type RecordCheck = Pending<Option<Result<(), net::BadTag>>>;

/// Tags a record on a helper thread, inside the fence (`None` once it is revoked).
fn spawn_tag(macs: &MacPool, fence: &AccessFence, key: FrameKey, spans: Vec<Span>) -> Pending<Option<Tag>> {
    let fence = fence.clone();
    // SAFETY: the spans lie in pieces the engine keeps valid and unwritten until the bucket's
    // ticket completes or the fence is revoked; the job reads them only while holding the fence,
    // and the bucket waits for (or drops, which waits for) every job before its ticket completes.
    macs.spawn(move || fence.access(|| unsafe { key.tag_spans(&spans) }))
}

/// Checks a record against `tag` on a helper thread, inside the fence (`None` once it is revoked).
fn spawn_check(macs: &MacPool, fence: &AccessFence, key: FrameKey, spans: Vec<Span>, tag: Tag) -> RecordCheck {
    let fence = fence.clone();
    // SAFETY: as in `spawn_tag`; the record has landed and nothing writes it before the check.
    macs.spawn(move || fence.access(|| unsafe { key.check_spans(&spans, &tag) }))
}

fn aborted() -> TransportError {
    TransportError::Aborted { name: "tcp stream".into(), reason: "aborted while moving bytes".into() }
}

/// Reads `len` bytes from `stream` into the pieces from `cursor` on, advancing it, then fills
/// `trailer` (a record's tag), in the same reads where it fits.
#[allow(clippy::too_many_arguments)]
async fn read_pieces(
    stream: &TcpStream,
    fence: &AccessFence,
    pieces: &[Piece],
    cursor: &mut Cursor,
    mut len: u64,
    trailer: &mut [u8],
    peer: &str,
    bucket: u32,
) -> Result<(), TransportError> {
    let mut t = 0;
    while len > 0 || t < trailer.len() {
        stream.readable().await.map_err(|e| NetError::io(Op::Receive.describe(bucket), peer, e))?;
        let r = fence.access(|| {
            let mut iov: [IoSliceMut<'_>; MAX_IOV + 1] = std::array::from_fn(|_| IoSliceMut::new(&mut []));
            let mut covered = 0;
            // SAFETY: the engine keeps the pieces valid and exclusively ours until this bucket's
            // ticket completes or the fence is revoked, and the fence is held.
            let n = cursor.spans(pieces, len, |i, r| {
                covered += r.len;
                iov[i] = IoSliceMut::new(unsafe { r.as_mut_slice() })
            });
            // The trailer follows the record's last byte only.
            let n = if covered == len {
                iov[n] = IoSliceMut::new(&mut trailer[t..]);
                n + 1
            } else {
                n
            };
            stream.try_read_vectored(&mut iov[..n])
        });
        match r {
            None => return Err(aborted()),
            Some(Ok(0)) => {
                return Err(TransportError::Closed { peer: peer.into(), what: Op::Receive.describe(bucket) });
            }
            Some(Ok(n)) => {
                let body = (n as u64).min(len);
                cursor.advance(pieces, body);
                len -= body;
                t += n - body as usize;
            }
            Some(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Some(Err(e)) => return Err(NetError::io(Op::Receive.describe(bucket), peer, e).into()),
        }
    }
    Ok(())
}

/// Writes `len` bytes of the pieces from `cursor` on to `stream`, advancing it, then `trailer`
/// (a record's tag), in the same writes where it fits.
#[allow(clippy::too_many_arguments)]
async fn write_pieces(
    stream: &TcpStream,
    fence: &AccessFence,
    pieces: &[Piece],
    cursor: &mut Cursor,
    mut len: u64,
    trailer: &[u8],
    peer: &str,
    op: Op,
    bucket: u32,
) -> Result<(), TransportError> {
    let mut t = 0;
    while len > 0 || t < trailer.len() {
        stream.writable().await.map_err(|e| NetError::io(op.describe(bucket), peer, e))?;
        let r = fence.access(|| {
            let mut iov = [IoSlice::new(&[]); MAX_IOV + 1];
            let mut covered = 0;
            // SAFETY: the engine keeps the pieces valid and unwritten until this bucket's ticket
            // completes or the fence is revoked, and the fence is held.
            let n = cursor.spans(pieces, len, |i, r| {
                covered += r.len;
                iov[i] = IoSlice::new(unsafe { r.as_slice() })
            });
            let n = if covered == len {
                iov[n] = IoSlice::new(&trailer[t..]);
                n + 1
            } else {
                n
            };
            stream.try_write_vectored(&iov[..n])
        });
        match r {
            None => return Err(aborted()),
            Some(Ok(0)) => return Err(TransportError::Closed { peer: peer.into(), what: op.describe(bucket) }),
            Some(Ok(n)) => {
                let body = (n as u64).min(len);
                cursor.advance(pieces, body);
                len -= body;
                t += n - body as usize;
            }
            Some(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Some(Err(e)) => return Err(NetError::io(op.describe(bucket), peer, e).into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(i: u32) -> Member {
        Member { process: i, name: format!("p{i}"), address: String::new(), bind_address: String::new() }
    }

    #[test]
    fn chain_and_tree_shapes() {
        let chain = Route::new(member(0), (1..=4).map(member).collect(), 1).unwrap();
        assert_eq!(chain.parent(1).unwrap().name, "p0");
        assert_eq!(chain.parent(4).unwrap().name, "p3");
        assert_eq!(chain.children(4).len(), 0);
        let tree = Route::new(member(0), (1..=6).map(member).collect(), 2).unwrap();
        let kids: Vec<_> = tree.children(0).iter().map(|m| m.name.clone()).collect();
        assert_eq!(kids, ["p1", "p2"]);
        assert_eq!(tree.parent(5).unwrap().name, "p2");
        assert_eq!(tree.children(3).len(), 0);
        assert!(Route::new(member(0), vec![], 1).is_err());
    }

    #[test]
    fn cursor_walks_pieces() {
        let mut a = vec![0u8; 10];
        let mut b = vec![0u8; 5];
        let pieces =
            [Piece { segment: 0, region: Region::host(&mut a) }, Piece { segment: 1, region: Region::host(&mut b) }];
        let mut c = Cursor::default();
        let mut lens = Vec::new();
        assert_eq!(c.spans(&pieces, 12, |_, r| lens.push(r.len)), 2);
        assert_eq!(lens, [10, 2]);
        c.advance(&pieces, 12);
        assert_eq!((c.piece, c.offset), (1, 2));
        c.advance(&pieces, 3);
        assert_eq!(c.piece, 2);
    }
}
