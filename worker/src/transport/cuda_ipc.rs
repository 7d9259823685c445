//! CUDA IPC transport: the receivers map the sender's GPU memory and copy every piece straight
//! into place with the copy engines — one copy per byte. Used colocated (trainer and generation
//! ranks share a GPU in one pod) and between GPUs of one node (peer copies over NVLink beat NCCL
//! there: GPU-NOTES.md).
//!
//! Control goes over ZMQ: the sender binds a ROUTER on an `ipc://` socket in the pod's shared
//! emptyDir; each receiver connects a DEALER. Messages (first byte is the kind):
//! `H` hello (the [`crate::net`] hello: token, name, plan identity, nonce) → `C` challenge (the
//! sender's nonce and proof of the epoch's key) → `P` proof (the receiver's) → `W` welcome /
//! `R` refused (either side may refuse, with the reason); `B` begin (version);
//! `N` new handle (key, 64-byte CUDA IPC handle of an allocation, exported once, opened once and
//! cached by the receiver); `K` bucket (its pieces as (handle key, offset, length)); `A` bucket
//! copied (the sender may reuse what it lent); `D` done (version).
//!
//! **Direct** mode lends the trainer's own parameter storage (allocated with `cuMemAlloc`, so it
//! can be exported): the receiver copies each tensor's span straight from it. **Staged** mode is
//! the fallback when the source cannot be exported: the engine packs every segment into exported
//! staging buffers (ping-pong) and the receiver copies out of them — two copies, as the usual
//! design does. Both speak the same protocol; only what the pieces point into differs.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaEvent, CudaStream};
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use zeromq::{DealerSocket, RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use super::{Piece, Transport, TransportError, coalesce, gpu_err};
use crate::gpu::tensors::DeviceStaging;
use crate::gpu::{Gpu, GpuError, IpcHandle, IpcMapping, copy_async};
use crate::net::{self, JobAuth};
use crate::refit::memory::{Copy2d, MemorySpace};
use crate::refit::plan::{PlanIdentity, RefitPlan};

/// What the sender lends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpcMode {
    /// The trainer's parameter storage itself (one copy).
    Direct,
    /// Exported staging buffers the engine packs into (two copies; the fallback).
    Staged,
}

/// A completion.
pub enum IpcTicket {
    /// A bucket, by index.
    Bucket(u32),
    /// Pack / unpack copies on the copy stream.
    Copy {
        /// Start event (for the copy engine's busy time).
        start: CudaEvent,
        /// End event.
        end: CudaEvent,
    },
}

enum Inbound {
    Message(Vec<Bytes>),
    /// The socket failed.
    Lost(String),
    /// A peer disconnected: fatal once the group is joined, not while strangers come and go
    /// during the handshake.
    Disconnected(String),
}

/// The ZMQ socket lives in its own task; the transport talks to it through channels, so that
/// polling for messages never cancels a receive.
struct Channel {
    out: mpsc::UnboundedSender<ZmqMessage>,
    inbound: mpsc::UnboundedReceiver<Inbound>,
    task: tokio::task::JoinHandle<()>,
}

fn spawn_socket<S>(mut socket: S) -> Channel
where
    S: Socket + SocketRecv + SocketSend + Send + 'static,
{
    let (out, mut out_rx) = mpsc::unbounded_channel::<ZmqMessage>();
    let (in_tx, inbound) = mpsc::unbounded_channel();
    let mut monitor = socket.monitor();
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                m = socket.recv() => match m {
                    Ok(m) => { if in_tx.send(Inbound::Message(m.into_vec())).is_err() { return; } }
                    Err(e) => { let _ = in_tx.send(Inbound::Lost(e.to_string())); return; }
                },
                m = out_rx.recv() => match m {
                    Some(m) => if let Err(e) = socket.send(m).await { let _ = in_tx.send(Inbound::Lost(e.to_string())); return; },
                    None => return,
                },
                Some(ev) = monitor.next() => {
                    if let SocketEvent::Disconnected(peer) = ev {
                        let _ = in_tx.send(Inbound::Disconnected(format!("peer {:?} disconnected", String::from_utf8_lossy(&Bytes::from(peer)))));
                    }
                }
            }
        }
    });
    Channel { out, inbound, task }
}

fn msg(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).expect("at least one frame")
}

struct RootState {
    /// Receivers by ZMQ identity.
    receivers: Vec<(Bytes, String)>,
    /// Exported allocations: base → key.
    exported: HashMap<CUdeviceptr, u32>,
    /// The next key (keys are never reused: receivers cache their mappings by key).
    next_key: u32,
    /// Acknowledgements per bucket.
    acks: HashMap<u32, usize>,
    dones: usize,
}

struct ReceiverState {
    /// Opened allocations by key.
    mapped: HashMap<u32, IpcMapping>,
    /// Source pieces the sender announced, by bucket.
    announced: HashMap<u32, Vec<(u32, u64, u64)>>,
    /// Submitted buckets not yet issued: (bucket, destination pieces).
    submitted: VecDeque<(u32, Vec<Piece>)>,
    /// Issued buckets: their completion events.
    issued: BTreeMap<u32, Vec<CudaEvent>>,
    begun: Option<u64>,
    next_stream: usize,
}

/// One member's side of a sender's CUDA IPC group.
pub struct IpcTransport {
    name: String,
    gpu: Gpu,
    mode: IpcMode,
    channel: Channel,
    root: Option<RootState>,
    recv: Option<ReceiverState>,
    /// The GPU whose copy engines move the lent bytes: the sender's (the receiver pushes from
    /// there over NVLink, issuing on a stream of that GPU's context) or this one's (same GPU, or
    /// pulling as a fallback).
    copier: Gpu,
    /// Two streams of `copier`, used in turn.
    streams: [Arc<CudaStream>; 2],
    /// Pieces under [`BATCH_BELOW`] copied on one GPU go as one kernel launch per bucket
    /// (`rlp_copy_spans`) rather than a driver copy each, whose fixed cost is most of a small
    /// model's refit; larger pieces keep the driver's copies, which move big spans faster
    /// (`RLPLANE_IPC_COPY=driver` uses them for everything, for comparison). Copies between GPUs
    /// stay on the copy engines, measured faster over NVLink.
    batch_copies: bool,
    /// Whether every bucket moved in place is in flight at once (see `pipelines_direct`);
    /// `RLPLANE_IPC_WINDOW=buffers` holds them to `num_buffers` at a time, for comparison. Both
    /// sides of a stream read the same environment (a job's processes share it).
    pipeline_direct: bool,
    copy_stream: Arc<CudaStream>,
    copy_busy: Duration,
    aborted: Option<String>,
    /// Allocations mapped from another process (a user's registered tensors), by base, with the
    /// handle to lend for them: such memory cannot be exported again.
    imported: HashMap<CUdeviceptr, IpcHandle>,
}

/// Where a sender's IPC control socket lives: its colocated GPU socket, or a socket named after
/// it in its pod's socket directory.
pub fn endpoint(plan: &rlplane_api::WorkerPlan, sender: u32) -> String {
    let p = plan.process(sender);
    match &p.ipc {
        Some(e) => e.clone(),
        None => format!("ipc://{}/refit-{}.sock", plan.pods[p.pod as usize].ipc_dir, p.name),
    }
}

impl IpcTransport {
    /// The sender's side: binds `endpoint` and waits for `receivers` to say hello.
    #[allow(clippy::too_many_arguments)]
    pub async fn root(
        name: &str,
        gpu: &Gpu,
        endpoint: &str,
        receivers: &[String],
        plan: Arc<RefitPlan>,
        mode: IpcMode,
        auth: &JobAuth,
        deadline: Instant,
    ) -> Result<IpcTransport, TransportError> {
        if let Some(path) = endpoint.strip_prefix("ipc://") {
            // A socket file left by an earlier epoch would refuse the bind.
            let _ = std::fs::remove_file(path);
        }
        let mut socket = RouterSocket::new();
        socket.bind(endpoint).await.map_err(|e| TransportError::Config(format!("binding {endpoint}: {e}")))?;
        let mut channel = spawn_socket(socket);
        let ordinal = gpu.ordinal() as u32;
        let joined = accept_receivers(name, &mut channel, receivers, &plan.identity(), auth, ordinal, deadline).await?;
        Self::new(
            name,
            gpu,
            gpu,
            mode,
            channel,
            Some(RootState {
                receivers: joined,
                exported: HashMap::new(),
                next_key: 0,
                acks: HashMap::new(),
                dones: 0,
            }),
            None,
        )
    }

    /// A receiver's side: connects to the sender's `endpoint` and says hello.
    #[allow(clippy::too_many_arguments)]
    pub async fn receiver(
        name: &str,
        me: &str,
        gpu: &Gpu,
        endpoint: &str,
        plan: Arc<RefitPlan>,
        auth: &JobAuth,
        deadline: Instant,
    ) -> Result<IpcTransport, TransportError> {
        let mut socket = DealerSocket::new();
        // The sender may not have bound yet: retry until the deadline.
        loop {
            match socket.connect(endpoint).await {
                Ok(()) => break,
                Err(e) if Instant::now() >= deadline => {
                    return Err(TransportError::Timeout {
                        peer: endpoint.into(),
                        what: format!("connecting ({e})"),
                        secs: 0.0,
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        let mut channel = spawn_socket(socket);
        let sender_gpu = say_hello(&mut channel, me, endpoint, &plan.identity(), auth, deadline).await?;
        let copier = copier_for(gpu, sender_gpu);
        let state = ReceiverState {
            mapped: HashMap::new(),
            announced: HashMap::new(),
            submitted: VecDeque::new(),
            issued: BTreeMap::new(),
            begun: None,
            next_stream: 0,
        };
        Self::new(name, gpu, &copier, IpcMode::Direct, channel, None, Some(state))
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        gpu: &Gpu,
        copier: &Gpu,
        mode: IpcMode,
        channel: Channel,
        root: Option<RootState>,
        recv: Option<ReceiverState>,
    ) -> Result<IpcTransport, TransportError> {
        let s = |g: &Gpu, what| g.stream().map_err(|e| gpu_err(what, e));
        Ok(IpcTransport {
            name: name.into(),
            gpu: gpu.clone(),
            mode,
            channel,
            root,
            recv,
            copier: copier.clone(),
            streams: [s(copier, "a copy stream")?, s(copier, "a copy stream")?],
            batch_copies: copier.ordinal() == gpu.ordinal()
                && !std::env::var("RLPLANE_IPC_COPY").is_ok_and(|v| v == "driver"),
            pipeline_direct: !std::env::var("RLPLANE_IPC_WINDOW").is_ok_and(|v| v == "buffers"),
            copy_stream: s(gpu, "the pack stream")?,
            copy_busy: Duration::ZERO,
            aborted: None,
            imported: HashMap::new(),
        })
    }

    /// Lends `imported`'s handles for the allocations they map (a user's tensors registered
    /// through the sidecar) instead of exporting them. Replacing the table forgets every
    /// allocation lent so far: after a re-registration the same addresses may hold other memory.
    pub fn set_imported(&mut self, imported: HashMap<CUdeviceptr, IpcHandle>) {
        if imported != self.imported {
            self.imported = imported;
            if let Some(root) = self.root.as_mut() {
                root.exported.clear();
            }
        }
    }

    fn check_usable(&self) -> Result<(), TransportError> {
        match &self.aborted {
            Some(reason) => Err(TransportError::Aborted { name: self.name.clone(), reason: reason.clone() }),
            None => Ok(()),
        }
    }

    fn send_all(&mut self, body: Vec<Bytes>) -> Result<(), TransportError> {
        let root = self.root.as_ref().expect("root only");
        for (id, peer) in &root.receivers {
            let mut frames = vec![id.clone()];
            frames.extend(body.iter().cloned());
            self.channel
                .out
                .send(msg(frames))
                .map_err(|_| TransportError::Closed { peer: peer.clone(), what: "sending".into() })?;
        }
        Ok(())
    }

    fn send_root(&mut self, body: Vec<Bytes>) -> Result<(), TransportError> {
        self.channel
            .out
            .send(msg(body))
            .map_err(|_| TransportError::Closed { peer: self.name.clone(), what: "sending to the sender".into() })
    }

    /// Handles every message already received (never waits).
    fn pump(&mut self) -> Result<(), TransportError> {
        loop {
            let m = match self.channel.inbound.try_recv() {
                Ok(Inbound::Message(m)) => m,
                Ok(Inbound::Lost(why) | Inbound::Disconnected(why)) => {
                    return Err(TransportError::Closed { peer: self.name.clone(), what: format!("refitting ({why})") });
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    return Err(TransportError::Closed {
                        peer: self.name.clone(),
                        what: "refitting (socket task ended)".into(),
                    });
                }
            };
            if self.root.is_some() {
                self.on_root_message(m)?;
            } else {
                self.on_receiver_message(m)?;
            }
        }
        if self.recv.is_some() {
            self.issue_ready()?;
        }
        Ok(())
    }

    fn on_root_message(&mut self, m: Vec<Bytes>) -> Result<(), TransportError> {
        let (id, body) = split_identity(m, &self.name)?;
        let root = self.root.as_mut().expect("root");
        let peer = root.receivers.iter().find(|(i, _)| *i == id).map(|(_, p)| p.clone()).unwrap_or_else(|| "?".into());
        match (body.first().map(|b| b.as_ref()), body.get(1)) {
            (Some(b"A"), Some(k)) if k.len() == 4 => {
                *root.acks.entry(u32::from_le_bytes(k[..4].try_into().expect("4 bytes"))).or_insert(0) += 1;
            }
            (Some(b"D"), _) => root.dones += 1,
            (Some(b"H"), _) => {} // a late duplicate hello
            _ => return Err(TransportError::Protocol { peer, detail: "an unknown message to the sender".into() }),
        }
        Ok(())
    }

    fn on_receiver_message(&mut self, m: Vec<Bytes>) -> Result<(), TransportError> {
        let peer = self.name.clone();
        let bad = |detail: &str| TransportError::Protocol { peer: peer.clone(), detail: detail.into() };
        let st = self.recv.as_mut().expect("receiver");
        match m.first().map(|b| b.as_ref()) {
            Some(b"B") => {
                let v = m.get(1).filter(|b| b.len() == 8).ok_or_else(|| bad("a malformed begin"))?;
                st.begun = Some(u64::from_le_bytes(v[..8].try_into().expect("8 bytes")));
            }
            Some(b"N") => {
                let key = m.get(1).filter(|b| b.len() == 4).ok_or_else(|| bad("a malformed handle key"))?;
                let h = m.get(2).filter(|b| b.len() == 64).ok_or_else(|| bad("a malformed IPC handle"))?;
                let key = u32::from_le_bytes(key[..4].try_into().expect("4 bytes"));
                let handle = IpcHandle(h[..64].try_into().expect("64 bytes"));
                if let std::collections::hash_map::Entry::Vacant(e) = st.mapped.entry(key) {
                    // Opened once and cached for every later refit.
                    e.insert(
                        // Mapped in the copier's context: the sender's own GPU when pushing.
                        IpcMapping::open(&self.copier, &handle)
                            .map_err(|e| gpu_err("opening the sender's memory", e))?,
                    );
                }
            }
            Some(b"K") => {
                let k = m.get(1).filter(|b| b.len() == 4).ok_or_else(|| bad("a malformed bucket index"))?;
                let list = m.get(2).filter(|b| b.len() % 20 == 0).ok_or_else(|| bad("a malformed piece list"))?;
                let pieces = list
                    .chunks_exact(20)
                    .map(|c| {
                        (
                            u32::from_le_bytes(c[0..4].try_into().expect("4")),
                            u64::from_le_bytes(c[4..12].try_into().expect("8")),
                            u64::from_le_bytes(c[12..20].try_into().expect("8")),
                        )
                    })
                    .collect();
                st.announced.insert(u32::from_le_bytes(k[..4].try_into().expect("4 bytes")), pieces);
            }
            _ => return Err(bad("an unknown message to a receiver")),
        }
        Ok(())
    }

    /// Issues the copies of every submitted bucket whose source pieces have been announced.
    fn issue_ready(&mut self) -> Result<(), TransportError> {
        loop {
            let st = self.recv.as_mut().expect("receiver");
            let Some((k, _)) = st.submitted.front() else { return Ok(()) };
            let Some(src) = st.announced.remove(k) else { return Ok(()) };
            let (k, pieces) = st.submitted.pop_front().expect("checked");
            // The same spans the sender announced: runs of tiny pieces merged (`stage_below`).
            let dst = coalesce(&pieces, self.stage_below());
            if src.len() != dst.len() {
                return Err(TransportError::Protocol {
                    peer: self.name.clone(),
                    detail: format!(
                        "bucket {k}: the sender lent {} pieces where the plan has {}",
                        src.len(),
                        dst.len()
                    ),
                });
            }
            self.copier.bind().map_err(|e| gpu_err(&self.name, e))?;
            let mut batch = Vec::with_capacity(if self.batch_copies { dst.len() } else { 0 });
            for (&(key, offset, len), span) in src.iter().zip(&dst) {
                if len != span.len {
                    return Err(TransportError::Protocol {
                        peer: self.name.clone(),
                        detail: format!("bucket {k}: a piece of {len} bytes where the plan has {}", span.len),
                    });
                }
                let map =
                    st_mapped(self.recv.as_ref().expect("receiver"), key).ok_or_else(|| TransportError::Protocol {
                        peer: self.name.clone(),
                        detail: format!("bucket {k} uses allocation {key}, which was never lent"),
                    })?;
                if self.batch_copies && len < BATCH_BELOW {
                    batch.push((span.addr, map + offset, len));
                    continue;
                }
                let st = self.recv.as_mut().expect("receiver");
                // Two streams, alternating: copies overlap on the copy engines.
                let stream = &self.streams[st.next_stream % 2];
                st.next_stream += 1;
                // SAFETY: the source is the sender's lent memory, untouched until we confirm; the
                // destination piece stays valid until our ticket completes (engine contract).
                unsafe { copy_async(span.addr, map + offset, len, stream) }.map_err(|e| gpu_err("a peer copy", e))?;
            }
            // SAFETY: as for the single copies above.
            unsafe { self.copier.copy_spans(&batch, &self.streams[0]) }.map_err(|e| gpu_err("a bucket's copies", e))?;
            let mut events = Vec::with_capacity(2);
            for s in &self.streams {
                let e = self.copier.event(false).map_err(|e| gpu_err(&self.name, e))?;
                e.record(s).map_err(|e| gpu_err("recording an event", GpuError::driver("", e)))?;
                events.push(e);
            }
            self.recv.as_mut().expect("receiver").issued.insert(k, events);
        }
    }
}

/// Pieces below this size are copied by one batched kernel launch per bucket on one GPU: on an
/// H100 the kernel moved a Qwen3-0.6B refit (310 tensors) 1.4× faster than a driver copy per
/// tensor, and Llama-3-8B's gigabyte tensors 3% slower (docs/benchmarks.md).
const BATCH_BELOW: u64 = 16 << 20;

/// The GPU whose copy engines should move a sender's bytes to `gpu`: the sender's own (copies
/// issued there push over NVLink — writes, measured faster than pulling reads: GPU-NOTES.md), or
/// `gpu` when the sender shares it, when the sender's GPU is not visible here, or when
/// `RLPLANE_IPC_COPY=pull` asks for it.
fn copier_for(gpu: &Gpu, sender_gpu: Option<u32>) -> Gpu {
    let Some(ordinal) = sender_gpu.filter(|&o| o as usize != gpu.ordinal()) else { return gpu.clone() };
    if std::env::var("RLPLANE_IPC_COPY").is_ok_and(|v| v == "pull") {
        return gpu.clone();
    }
    match Gpu::open(ordinal as usize).and_then(|src| src.enable_peer_access(gpu).map(|()| src)) {
        Ok(src) => src,
        Err(e) => {
            tracing::warn!(error = %e, sender_gpu = ordinal, "cannot push from the sender's GPU; pulling instead");
            gpu.clone()
        }
    }
}

fn st_mapped(st: &ReceiverState, key: u32) -> Option<CUdeviceptr> {
    st.mapped.get(&key).map(|m| m.ptr())
}

/// Handshake magic of the CUDA IPC control channel (the [`crate::net`] handshake, over ZMQ).
pub const IPC_MAGIC: [u8; 4] = *b"RIPC";
const IPC_VERSION: u16 = 1;

/// The sender's side of the handshake: until every one of `receivers` has joined, answers each
/// `H` hello (token checked) with a `C` challenge, and each `P` proof that checks out — from an
/// expected receiver with the same plan — with a `W` welcome naming GPU `ordinal`; anything else
/// gets `R` and the reason, is counted in `auth`'s refusals and changes nothing. Returns the
/// receivers' ZMQ identities and names.
async fn accept_receivers(
    name: &str,
    channel: &mut Channel,
    receivers: &[String],
    identity: &PlanIdentity,
    auth: &JobAuth,
    ordinal: u32,
    deadline: Instant,
) -> Result<Vec<(Bytes, String)>, TransportError> {
    let start = Instant::now();
    let mut joined: Vec<(Bytes, String)> = Vec::new();
    let mut pending: HashMap<Bytes, (net::Hello, net::ServerChallenge)> = HashMap::new();
    while joined.len() < receivers.len() {
        let m = loop {
            match tokio::time::timeout_at(deadline, channel.inbound.recv()).await {
                Ok(Some(Inbound::Message(m))) => break m,
                // A peer that leaves before it joined (refused, or never speaking) is no
                // receiver of ours: keep waiting for those.
                Ok(Some(Inbound::Disconnected(why))) => tracing::debug!(%why, "a peer left the IPC handshake"),
                Ok(Some(Inbound::Lost(why))) => {
                    return Err(TransportError::Closed {
                        peer: name.into(),
                        what: format!("waiting for IPC receivers ({why})"),
                    });
                }
                Ok(None) => {
                    return Err(TransportError::Closed { peer: name.into(), what: "waiting for IPC receivers".into() });
                }
                Err(_) => {
                    return Err(TransportError::Timeout {
                        peer: name.into(),
                        what: format!("waiting for IPC receivers ({} of {} joined)", joined.len(), receivers.len()),
                        secs: start.elapsed().as_secs_f64(),
                    });
                }
            }
        };
        let (id, body) = split_identity(m, name)?;
        let verdict = match (body.first().map(|b| b.as_ref()), body.get(1)) {
            (Some(b"H"), Some(hello)) if body.len() == 2 => match auth.open_hello(hello, IPC_MAGIC, IPC_VERSION) {
                Ok((hello, challenge)) => {
                    let c = msg(vec![id.clone(), Bytes::from_static(b"C"), Bytes::copy_from_slice(challenge.bytes())]);
                    let _ = channel.out.send(c);
                    pending.insert(id, (hello, challenge));
                    continue;
                }
                Err(reason) => Err(reason),
            },
            (Some(b"P"), Some(proof)) => match pending.remove(&id) {
                None => Err("a proof without a hello".to_string()),
                Some((hello, challenge)) => challenge.verify(auth, proof).and_then(|()| {
                    let peer = hello.peer;
                    let checked = if !receivers.contains(&peer) {
                        Err(format!("`{peer}` is not a receiver of this sender"))
                    } else {
                        match PlanIdentity::decode(&hello.extra) {
                            Some(theirs) if &theirs == identity => Ok(peer.clone()),
                            Some(theirs) => Err(identity.mismatch("the sender", &theirs, &peer)),
                            None => Err("malformed plan identity".into()),
                        }
                    };
                    checked.inspect_err(|_| auth.refusals().count(IPC_MAGIC))
                }),
            },
            (Some(b"R"), reason) => {
                // The receiver refused this sender (it counted that); forget its hello.
                pending.remove(&id);
                let reason = reason.map(|r| String::from_utf8_lossy(r).into_owned()).unwrap_or_default();
                tracing::warn!(%reason, "an IPC receiver refused this sender");
                continue;
            }
            _ => {
                auth.refusals().count(IPC_MAGIC);
                Err("expected a hello".to_string())
            }
        };
        match verdict {
            Ok(peer) => {
                // The welcome names this GPU, so a receiver on another GPU can push from it.
                let welcome =
                    msg(vec![id.clone(), Bytes::from_static(b"W"), Bytes::copy_from_slice(&ordinal.to_le_bytes())]);
                let _ = channel.out.send(welcome);
                if !joined.iter().any(|(_, p)| p == &peer) {
                    joined.push((id, peer));
                }
            }
            Err(reason) => {
                tracing::warn!(%reason, "refused an IPC receiver");
                let _ = channel.out.send(msg(vec![id, Bytes::from_static(b"R"), Bytes::from(reason)]));
            }
        }
    }
    Ok(joined)
}

/// A receiver's side of the handshake: `H` hello, then — once the sender's `C` challenge proves
/// it holds the key — `P` proof; returns the sender's GPU from its `W` welcome. A sender without
/// the key gets `R` and the reason.
async fn say_hello(
    channel: &mut Channel,
    me: &str,
    endpoint: &str,
    identity: &PlanIdentity,
    auth: &JobAuth,
    deadline: Instant,
) -> Result<Option<u32>, TransportError> {
    let hello =
        net::Hello { magic: IPC_MAGIC, version: IPC_VERSION, peer: me.into(), extra: identity.encode().to_vec() };
    let ours = auth
        .client_hello(&hello)
        .map_err(|e| TransportError::Refused { peer: endpoint.into(), reason: e.to_string() })?;
    let send = |channel: &mut Channel, frames: Vec<Bytes>| {
        channel
            .out
            .send(msg(frames))
            .map_err(|_| TransportError::Closed { peer: endpoint.into(), what: "saying hello".into() })
    };
    let refused = |answer: &[Bytes]| TransportError::Refused {
        peer: endpoint.into(),
        reason: answer.get(1).map(|r| String::from_utf8_lossy(r).into_owned()).unwrap_or_default(),
    };
    let unexpected =
        || TransportError::Protocol { peer: endpoint.into(), detail: "an unexpected answer to hello".into() };
    send(channel, vec![Bytes::from_static(b"H"), Bytes::copy_from_slice(ours.bytes())])?;
    let answer = recv(channel, deadline, endpoint, "waiting for the sender's challenge").await?;
    match answer.first().map(|b| b.as_ref()) {
        Some(b"C") => {}
        Some(b"R") => return Err(refused(&answer)),
        _ => return Err(unexpected()),
    }
    let proof = match ours.answer(auth, answer.get(1).map(|b| b.as_ref()).unwrap_or_default()) {
        Ok(p) => p,
        Err(reason) => {
            let _ = send(channel, vec![Bytes::from_static(b"R"), Bytes::from(reason.clone())]);
            return Err(TransportError::Refused { peer: endpoint.into(), reason });
        }
    };
    send(channel, vec![Bytes::from_static(b"P"), Bytes::copy_from_slice(&proof)])?;
    let answer = recv(channel, deadline, endpoint, "waiting for the sender's welcome").await?;
    match answer.first().map(|b| b.as_ref()) {
        Some(b"W") => Ok(answer.get(1).filter(|b| b.len() == 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        Some(b"R") => Err(refused(&answer)),
        _ => Err(unexpected()),
    }
}

fn split_identity(mut m: Vec<Bytes>, name: &str) -> Result<(Bytes, Vec<Bytes>), TransportError> {
    if m.is_empty() {
        return Err(TransportError::Protocol { peer: name.into(), detail: "an empty message".into() });
    }
    let id = m.remove(0);
    Ok((id, m))
}

async fn recv(channel: &mut Channel, deadline: Instant, peer: &str, what: &str) -> Result<Vec<Bytes>, TransportError> {
    let start = Instant::now();
    match tokio::time::timeout_at(deadline, channel.inbound.recv()).await {
        Ok(Some(Inbound::Message(m))) => Ok(m),
        Ok(Some(Inbound::Lost(why) | Inbound::Disconnected(why))) => {
            Err(TransportError::Closed { peer: peer.into(), what: format!("{what} ({why})") })
        }
        Ok(None) => Err(TransportError::Closed { peer: peer.into(), what: what.into() }),
        Err(_) => {
            Err(TransportError::Timeout { peer: peer.into(), what: what.into(), secs: start.elapsed().as_secs_f64() })
        }
    }
}

impl Transport for IpcTransport {
    type Ticket = IpcTicket;
    type Staging = DeviceStaging;

    fn name(&self) -> &str {
        &self.name
    }

    fn is_root(&self) -> bool {
        self.root.is_some()
    }

    fn reaches(&self, space: MemorySpace) -> bool {
        let here = space == MemorySpace::Device { ordinal: self.gpu.ordinal() as u32 };
        // In staged mode the sender lends only its staging buffers: the engine packs everything.
        here && !(self.root.is_some() && self.mode == IpcMode::Staged)
    }

    fn alloc_staging(&mut self, bytes: u64) -> Result<DeviceStaging, TransportError> {
        self.gpu.alloc(bytes as usize).map(DeviceStaging).map_err(|e| gpu_err("allocating a staging buffer", e))
    }

    async fn begin(&mut self, version: Option<u64>, deadline: Instant) -> Result<u64, TransportError> {
        self.check_usable()?;
        match version {
            Some(v) => {
                let root = self.root.as_mut().expect("a root begins with a version");
                root.acks.clear();
                root.dones = 0;
                // The sender's weights must be final before anyone copies them.
                self.gpu
                    .context()
                    .synchronize()
                    .map_err(|e| gpu_err("finishing the update", GpuError::driver("", e)))?;
                self.send_all(vec![Bytes::from_static(b"B"), Bytes::copy_from_slice(&v.to_le_bytes())])?;
                Ok(v)
            }
            None => {
                let start = Instant::now();
                loop {
                    self.pump()?;
                    if let Some(v) = self.recv.as_mut().expect("receiver").begun.take() {
                        return Ok(v);
                    }
                    if Instant::now() >= deadline {
                        return Err(TransportError::Timeout {
                            peer: self.name.clone(),
                            what: "waiting for the refit to start".into(),
                            secs: start.elapsed().as_secs_f64(),
                        });
                    }
                    match tokio::time::timeout_at(deadline, self.channel.inbound.recv()).await {
                        Ok(Some(Inbound::Message(m))) => self.on_receiver_message(m)?,
                        Ok(Some(Inbound::Lost(why) | Inbound::Disconnected(why))) => {
                            return Err(TransportError::Closed {
                                peer: self.name.clone(),
                                what: format!("waiting for the refit to start ({why})"),
                            });
                        }
                        Ok(None) => {
                            return Err(TransportError::Closed {
                                peer: self.name.clone(),
                                what: "waiting for the refit to start".into(),
                            });
                        }
                        Err(_) => {}
                    }
                }
            }
        }
    }

    unsafe fn submit(&mut self, bucket: u32, pieces: &[Piece]) -> Result<IpcTicket, TransportError> {
        self.check_usable()?;
        if self.recv.is_some() {
            self.recv.as_mut().expect("receiver").submitted.push_back((bucket, pieces.to_vec()));
            self.pump()?;
            return Ok(IpcTicket::Bucket(bucket));
        }
        // The sender lends each piece's allocation (exported once) and announces the pieces.
        let spans = coalesce(pieces, self.stage_below());
        let mut list = Vec::with_capacity(spans.len() * 20);
        for span in spans {
            let (base, _) =
                crate::gpu::allocation_range(span.addr).map_err(|e| gpu_err("finding a lent allocation", e))?;
            let known = self.root.as_ref().expect("root").exported.get(&base).copied();
            let key = match known {
                Some(k) => k,
                None => {
                    let handle = match self.imported.get(&base) {
                        Some(h) => *h,
                        None => export(&self.gpu, base).map_err(|e| {
                            gpu_err(
                                "exporting the trainer's memory (allocate it with cuMemAlloc, or use the staged mode)",
                                e,
                            )
                        })?,
                    };
                    let root = self.root.as_mut().expect("root");
                    let key = root.next_key;
                    root.next_key += 1;
                    root.exported.insert(base, key);
                    self.send_all(vec![
                        Bytes::from_static(b"N"),
                        Bytes::copy_from_slice(&key.to_le_bytes()),
                        Bytes::copy_from_slice(&handle.0),
                    ])?;
                    key
                }
            };
            list.extend_from_slice(&key.to_le_bytes());
            list.extend_from_slice(&(span.addr - base).to_le_bytes());
            list.extend_from_slice(&span.len.to_le_bytes());
        }
        self.send_all(vec![
            Bytes::from_static(b"K"),
            Bytes::copy_from_slice(&bucket.to_le_bytes()),
            Bytes::from(list),
        ])?;
        Ok(IpcTicket::Bucket(bucket))
    }

    unsafe fn copy(&mut self, copies: &[Copy2d]) -> Result<IpcTicket, TransportError> {
        self.check_usable()?;
        // SAFETY: regions valid until the ticket completes (engine contract).
        let (start, end) = unsafe { self.gpu.copy_regions(copies, &self.copy_stream) }
            .map_err(|e| gpu_err("a pack/unpack copy", e))?;
        Ok(IpcTicket::Copy { start, end })
    }

    async fn wait(&mut self, ticket: IpcTicket, deadline: Instant) -> Result<(), TransportError> {
        self.check_usable()?;
        let began = Instant::now();
        let timeout = |s: &Self, what: &str| TransportError::Timeout {
            peer: s.name.clone(),
            what: what.into(),
            secs: began.elapsed().as_secs_f64(),
        };
        match ticket {
            IpcTicket::Copy { start, end } => {
                loop {
                    match end.try_is_complete() {
                        Ok(true) => break,
                        Ok(false) => {}
                        Err(e) => return Err(gpu_err("a copy", GpuError::driver("", e))),
                    }
                    if Instant::now() >= deadline {
                        return Err(timeout(self, "waiting for a copy"));
                    }
                    tokio::task::yield_now().await;
                }
                if let Ok(ms) = start.elapsed_ms(&end) {
                    self.copy_busy += Duration::from_secs_f64(ms as f64 / 1e3);
                }
                Ok(())
            }
            IpcTicket::Bucket(k) if self.root.is_some() => loop {
                self.pump()?;
                let root = self.root.as_ref().expect("root");
                if root.acks.get(&k).copied().unwrap_or(0) >= root.receivers.len() {
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    return Err(timeout(self, &format!("waiting for the receivers to copy bucket {k}")));
                }
                tokio::task::yield_now().await;
            },
            IpcTicket::Bucket(k) => loop {
                self.pump()?;
                let st = self.recv.as_ref().expect("receiver");
                if let Some(events) = st.issued.get(&k) {
                    let mut done = true;
                    for e in events {
                        done &= e.try_is_complete().map_err(|e| gpu_err("a peer copy", GpuError::driver("", e)))?;
                    }
                    if done {
                        self.recv.as_mut().expect("receiver").issued.remove(&k);
                        self.send_root(vec![Bytes::from_static(b"A"), Bytes::copy_from_slice(&k.to_le_bytes())])?;
                        return Ok(());
                    }
                }
                if Instant::now() >= deadline {
                    return Err(timeout(self, &format!("copying bucket {k}")));
                }
                tokio::task::yield_now().await;
            },
        }
    }

    async fn end(&mut self, version: u64, deadline: Instant) -> Result<(), TransportError> {
        self.check_usable()?;
        if self.root.is_some() {
            let began = Instant::now();
            loop {
                self.pump()?;
                let root = self.root.as_ref().expect("root");
                if root.dones >= root.receivers.len() {
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    return Err(TransportError::Timeout {
                        peer: self.name.clone(),
                        what: "waiting for the receivers' confirmations".into(),
                        secs: began.elapsed().as_secs_f64(),
                    });
                }
                tokio::task::yield_now().await;
            }
        } else {
            self.send_root(vec![Bytes::from_static(b"D"), Bytes::copy_from_slice(&version.to_le_bytes())])
        }
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() {
            self.aborted = Some(reason.to_string());
            if self.gpu.bind().is_ok() {
                // Copies in flight finish on their own; after this nothing we were lent or handed
                // is touched.
                for s in self.streams.iter().chain([&self.copy_stream]) {
                    let _ = s.synchronize();
                }
            }
        }
    }

    fn copy_busy(&self) -> Duration {
        self.copy_busy
    }

    fn stage_below(&self) -> u64 {
        // Tiny copies are cheap to issue, and staging them would add round trips: nothing is
        // packed (measured: colocated 12.2 ms with packing, 8.3 ms without).
        0
    }

    fn pipelines_direct(&self) -> bool {
        // Copies go on the receiver's streams in bucket order, and direct pieces need no buffer:
        // announcing every bucket at once takes the host's round trip per bucket (acknowledge,
        // announce the next) off the GPU's path.
        self.pipeline_direct
    }
}

impl Drop for IpcTransport {
    fn drop(&mut self) {
        self.channel.task.abort();
    }
}

fn export(gpu: &Gpu, base: CUdeviceptr) -> Result<IpcHandle, GpuError> {
    gpu.bind()?;
    let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: base is the start of an allocation (from cuMemGetAddressRange).
    let r = unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), base) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::msg("cuIpcGetMemHandle", format!("{r:?}")));
    }
    // SAFETY: initialized by the successful call.
    Ok(IpcHandle(unsafe { h.assume_init() }.reserved.map(|c| c as u8)))
}

#[cfg(test)]
mod tests {
    //! The control channel's handshake over real ZMQ `ipc://` sockets, without a GPU: the same
    //! attackers as `tests/auth.rs` on the TCP ports, each refused, counted and left out.
    use super::*;
    use crate::refit::plan::RefitPlan;
    use rlplane_api::model::{DType, TensorSpec, TpSplit};

    const CLIENT_LABEL: &[u8] = b"rlplane handshake v1: connecting side\0";

    fn identity() -> PlanIdentity {
        let m = vec![TensorSpec::with_split("w", DType::Bf16, vec![64, 64], TpSplit::Rows)];
        RefitPlan::new(&m, 4096, 256).unwrap().identity()
    }

    fn proof_under(key: &[u8; 32], hello: &[u8], server_nonce: &[u8]) -> Bytes {
        let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
        let mut ctx = ring::hmac::Context::with_key(&k);
        for part in [CLIENT_LABEL, &(hello.len() as u32).to_le_bytes(), hello, server_nonce] {
            ctx.update(part);
        }
        Bytes::copy_from_slice(ctx.sign().as_ref())
    }

    fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(20)
    }

    async fn dealer(endpoint: &str) -> Channel {
        let mut socket = DealerSocket::new();
        socket.connect(endpoint).await.unwrap();
        spawn_socket(socket)
    }

    fn send(channel: &Channel, frames: Vec<Bytes>) {
        channel.out.send(msg(frames)).unwrap();
    }

    /// Says `hello` (bytes), answers a challenge with `proof(server_nonce)`; returns the
    /// sender's final answer.
    async fn attempt(endpoint: &str, hello: &[u8], proof: impl FnOnce(&[u8]) -> Bytes) -> Vec<Bytes> {
        let mut c = dealer(endpoint).await;
        send(&c, vec![Bytes::from_static(b"H"), Bytes::copy_from_slice(hello)]);
        let answer = recv(&mut c, deadline(), "sender", "the challenge").await.unwrap();
        if answer[0].as_ref() != b"C" {
            return answer;
        }
        send(&c, vec![Bytes::from_static(b"P"), proof(&answer[1][..net::NONCE_LEN])]);
        recv(&mut c, deadline(), "sender", "the verdict").await.unwrap()
    }

    fn refused(answer: &[Bytes]) -> String {
        assert_eq!(answer[0].as_ref(), b"R", "not refused: {answer:?}");
        String::from_utf8_lossy(&answer[1]).into_owned()
    }

    #[tokio::test]
    async fn the_ipc_sender_admits_only_the_key_holder() {
        let dir = tempfile::tempdir().unwrap();
        let endpoint = format!("ipc://{}/refit.sock", dir.path().display());
        let id = identity();
        let key = JobAuth::generate_key().unwrap();
        let auth = JobAuth::new(&rlplane_api::job_token("uid", 1), &key);
        let (old_token, old_key) = (rlplane_api::job_token("uid", 0), JobAuth::generate_key().unwrap());
        let mut router = RouterSocket::new();
        router.bind(&endpoint).await.unwrap();
        let mut channel = spawn_socket(router);
        let server_auth = auth.clone();
        let sender = tokio::spawn(async move {
            let r =
                accept_receivers("trainer-0", &mut channel, &["gen-0".into()], &id, &server_auth, 3, deadline()).await;
            r.map(|joined| joined.into_iter().map(|(_, name)| name).collect::<Vec<_>>())
        });
        let hello =
            net::Hello { magic: IPC_MAGIC, version: IPC_VERSION, peer: "gen-0".into(), extra: id.encode().to_vec() };

        // The epoch's token without its key; the previous epoch's token and key; the token with
        // the previous key.
        for (token, key) in [
            (auth.token().to_string(), JobAuth::generate_key().unwrap()),
            (old_token, old_key),
            (auth.token().to_string(), old_key),
        ] {
            let ours = JobAuth::new(&token, &key).client_hello(&hello).unwrap();
            let bytes = ours.bytes().to_vec();
            let reason = refused(&attempt(&endpoint, &bytes, |nonce| proof_under(&key, &bytes, nonce)).await);
            assert!(reason.contains("did not prove it holds") || reason.contains("another job or epoch"), "{reason}");
        }
        // A replay of a valid handshake recorded against another sender of this epoch.
        let ours = auth.client_hello(&hello).unwrap();
        let (_, challenge) = auth.open_hello(ours.bytes(), IPC_MAGIC, IPC_VERSION).unwrap();
        let recorded = Bytes::copy_from_slice(&ours.answer(&auth, challenge.bytes()).unwrap());
        let reason = refused(&attempt(&endpoint, ours.bytes(), |_| recorded).await);
        assert!(reason.contains("replayed handshake"), "{reason}");
        // Anything but a hello.
        let mut c = dealer(&endpoint).await;
        send(&c, vec![Bytes::from_static(b"B"), Bytes::from_static(&[0; 8])]);
        refused(&recv(&mut c, deadline(), "sender", "a refusal").await.unwrap());

        // Every one was counted: three forged proofs, the replay and the stray message.
        assert_eq!(auth.refusals().snapshot(), vec![("RIPC".to_string(), 5)]);
        assert!(!sender.is_finished(), "no attacker took gen-0's place");

        // The key holder joins, and learns the sender's GPU.
        let mut c = dealer(&endpoint).await;
        let gpu = say_hello(&mut c, "gen-0", &endpoint, &id, &auth, deadline()).await.unwrap();
        assert_eq!(gpu, Some(3));
        assert_eq!(sender.await.unwrap().unwrap(), vec!["gen-0"]);
    }

    #[tokio::test]
    async fn a_receiver_refuses_a_sender_without_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let endpoint = format!("ipc://{}/refit.sock", dir.path().display());
        let id = identity();
        let token = rlplane_api::job_token("uid", 1);
        let (auth, impostor) = (
            JobAuth::new(&token, &JobAuth::generate_key().unwrap()),
            JobAuth::new(&token, &JobAuth::generate_key().unwrap()),
        );
        let mut router = RouterSocket::new();
        router.bind(&endpoint).await.unwrap();
        let mut channel = spawn_socket(router);
        let sender = tokio::spawn(async move {
            accept_receivers("trainer-0", &mut channel, &["gen-0".into()], &id, &impostor, 0, deadline()).await
        });
        let mut c = dealer(&endpoint).await;
        let err = say_hello(&mut c, "gen-0", &endpoint, &id, &auth, deadline()).await.unwrap_err().to_string();
        assert!(err.contains("the listener did not prove it holds this job epoch's key"), "{err}");
        assert_eq!(auth.refusals().total(), 1);
        assert!(!sender.is_finished(), "the impostor got no receiver");
        sender.abort();
    }
}
