//! CUDA IPC transport: the receivers map the sender's GPU memory and copy every piece straight
//! into place with the copy engines — one copy per byte. Used colocated (trainer and generation
//! ranks share a GPU in one pod) and between GPUs of one node (peer copies over NVLink beat NCCL
//! there: GPU-NOTES.md).
//!
//! Control goes over a Unix stream socket: the sender listens on a path in the pod's shared
//! emptyDir (the plan's `ipc://` endpoint); each receiver connects and passes the [`rlplane_wire::net`]
//! handshake (token, key proof both ways, plan identity in the hello); the sender's welcome names
//! its GPU. Then length-prefixed frames ([`FrameLink`]: written and read by non-blocking system
//! calls on the refit's own task), the first byte saying what it is: `B` begin (version);
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

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaEvent, CudaStream};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::net::{UnixListener, UnixStream};
use tokio::time::Instant;

use super::{Piece, Transport, TransportError, coalesce, gpu_err};
use crate::gpu::tensors::DeviceStaging;
use crate::gpu::{Gpu, GpuError, IpcHandle, IpcMapping, copy_async};
use crate::memory::{Copy2d, MemorySpace};
use crate::plan::{PlanIdentity, RefitPlan};
use rlplane_wire::link::FrameLink;
use rlplane_wire::net::{self, JobAuth};

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

/// A joined receiver, as the sender sees it.
struct Peer {
    name: String,
    link: FrameLink,
}

/// The largest control frame: a bucket's piece list is 20 bytes a piece.
const MAX_FRAME: u32 = 64 << 20;

struct RootState {
    /// The joined receivers.
    receivers: Vec<Peer>,
    /// Exported allocations: base → key.
    exported: HashMap<CUdeviceptr, u32>,
    /// The next key (keys are never reused: receivers cache their mappings by key).
    next_key: u32,
    /// Acknowledgements per bucket.
    acks: HashMap<u32, usize>,
    dones: usize,
}

struct ReceiverState {
    /// The connection to the sender.
    sender: FrameLink,
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
    /// This refit's receiving timeline, kept while the debug log is on.
    trace: Option<Trace>,
}

/// A receiver's timeline of one refit, logged at debug level when it ends: where the time
/// between the sender's start message and the last copy goes (docs/benchmarks.md reads it).
struct Trace {
    begun: Instant,
    first_issued: Option<Instant>,
    last_issued: Option<Instant>,
    /// When the last bucket's copies were seen complete.
    completed: Option<Instant>,
    /// Recorded before the first bucket's copies, on the first stream (idle until then, so it
    /// completes as the copies start, whichever stream or kernel takes the first).
    gpu_start: Option<CudaEvent>,
    /// Recorded after the latest bucket's copies, on every stream.
    gpu_ends: Vec<CudaEvent>,
}

impl Trace {
    /// A timeline from now (the start message's arrival), if the debug log is on.
    fn start() -> Option<Trace> {
        tracing::enabled!(tracing::Level::DEBUG).then(|| Trace {
            begun: Instant::now(),
            first_issued: None,
            last_issued: None,
            completed: None,
            gpu_start: None,
            gpu_ends: Vec::new(),
        })
    }

    /// Marks the GPU's start on `stream` (idle), before the refit's first copy is issued.
    fn first_copy(&mut self, copier: &Gpu, stream: &CudaStream) -> Result<(), GpuError> {
        if self.gpu_start.is_none() {
            self.gpu_start = Some(copier.record_event(stream, true)?);
            self.first_issued = Some(Instant::now());
        }
        Ok(())
    }

    /// Marks the end of the latest bucket's copies on every stream.
    fn bucket_issued(&mut self, copier: &Gpu, streams: &[Arc<CudaStream>]) -> Result<(), GpuError> {
        self.gpu_ends = streams.iter().map(|s| copier.record_event(s, true)).collect::<Result<_, _>>()?;
        self.last_issued = Some(Instant::now());
        Ok(())
    }

    fn log(&self, name: &str, version: u64) {
        let ms = |t: Option<Instant>| t.map_or(f64::NAN, |t| (t - self.begun).as_secs_f64() * 1e3);
        let gpu = self.gpu_start.as_ref().map_or(f64::NAN, |s| {
            self.gpu_ends.iter().filter_map(|e| s.elapsed_ms(e).ok()).fold(f64::NAN, |a, b| a.max(b as f64))
        });
        tracing::debug!(
            peer = name,
            version,
            first_issued_ms = ms(self.first_issued),
            last_issued_ms = ms(self.last_issued),
            copies_on_gpu_ms = gpu,
            completed_ms = ms(self.completed),
            confirmed_ms = ms(Some(Instant::now())),
            "cuda ipc receiver's timeline (from the start message)"
        );
    }
}

/// One member's side of a sender's CUDA IPC group.
pub struct IpcTransport {
    name: String,
    gpu: Gpu,
    mode: IpcMode,
    root: Option<RootState>,
    recv: Option<ReceiverState>,
    /// The GPU whose copy engines move the lent bytes: the sender's (the receiver pushes from
    /// there over NVLink, issuing on a stream of that GPU's context) or this one's (same GPU, or
    /// pulling as a fallback).
    copier: Gpu,
    /// Streams of `copier`, used in turn (see [`copy_streams`]).
    streams: Vec<Arc<CudaStream>>,
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
        let path = socket_path(endpoint)?;
        // A socket file left by an earlier epoch would refuse the bind.
        let _ = std::fs::remove_file(path);
        let listener =
            UnixListener::bind(path).map_err(|e| TransportError::Config(format!("binding {endpoint}: {e}")))?;
        let ordinal = gpu.ordinal() as u32;
        let joined = accept_receivers(name, &listener, receivers, &plan.identity(), auth, ordinal, deadline).await;
        // Nobody else joins this group: the path goes (a new epoch binds it afresh).
        drop(listener);
        let _ = std::fs::remove_file(path);
        Self::new(
            name,
            gpu,
            gpu,
            mode,
            Some(RootState {
                receivers: joined?,
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
        let path = socket_path(endpoint)?;
        // The sender may not have bound yet: retry until the deadline.
        let mut stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(TransportError::Timeout {
                        peer: endpoint.into(),
                        what: format!("connecting ({e})"),
                        secs: 0.0,
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let (sender_gpu, session) = say_hello(&mut stream, me, endpoint, &plan.identity(), auth, deadline).await?;
        let copier = copier_for(gpu, sender_gpu);
        let state = ReceiverState {
            sender: FrameLink::unix(stream, MAX_FRAME, session)
                .map_err(|e| io_err(endpoint, "taking over the connection", e))?,
            mapped: HashMap::new(),
            announced: HashMap::new(),
            submitted: VecDeque::new(),
            issued: BTreeMap::new(),
            begun: None,
            next_stream: 0,
            trace: None,
        };
        Self::new(name, gpu, &copier, IpcMode::Direct, None, Some(state))
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        gpu: &Gpu,
        copier: &Gpu,
        mode: IpcMode,
        root: Option<RootState>,
        recv: Option<ReceiverState>,
    ) -> Result<IpcTransport, TransportError> {
        let s = |g: &Gpu, what| g.stream().map_err(|e| gpu_err(what, e));
        let one_gpu = copier.ordinal() == gpu.ordinal();
        Ok(IpcTransport {
            name: name.into(),
            gpu: gpu.clone(),
            mode,
            root,
            recv,
            copier: copier.clone(),
            streams: (0..copy_streams(one_gpu)).map(|_| s(copier, "a copy stream")).collect::<Result<_, _>>()?,
            batch_copies: one_gpu && !std::env::var("RLPLANE_IPC_COPY").is_ok_and(|v| v == "driver"),
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

    fn send_all(&mut self, parts: &[&[u8]]) -> Result<(), TransportError> {
        let root = self.root.as_mut().expect("root only");
        for p in &mut root.receivers {
            p.link.send(parts).map_err(|e| link_err(&p.name, "sending", e))?;
        }
        Ok(())
    }

    fn send_root(&mut self, parts: &[&[u8]]) -> Result<(), TransportError> {
        let st = self.recv.as_mut().expect("receiver only");
        st.sender.send(parts).map_err(|e| link_err(&self.name, "sending to the sender", e))
    }

    /// Handles every message already received, reading the sockets itself (never waits), and
    /// writes what the sockets did not take before.
    fn pump(&mut self) -> Result<(), TransportError> {
        if let Some(root) = self.root.as_mut() {
            let mut frames = Vec::new();
            for (i, p) in root.receivers.iter_mut().enumerate() {
                p.link.flush().map_err(|e| link_err(&p.name, "sending", e))?;
                while let Some(f) = p.link.try_recv().map_err(|e| link_err(&p.name, "refitting", e))? {
                    frames.push((i, f));
                }
            }
            for (i, f) in frames {
                self.on_root_message(i, &f)?;
            }
            return Ok(());
        }
        loop {
            let st = self.recv.as_mut().expect("receiver");
            st.sender.flush().map_err(|e| link_err(&self.name, "sending to the sender", e))?;
            match st.sender.try_recv().map_err(|e| link_err(&self.name, "refitting", e))? {
                Some(f) => self.on_receiver_message(&f)?,
                None => break,
            }
        }
        self.issue_ready()
    }

    fn on_root_message(&mut self, from: usize, m: &[u8]) -> Result<(), TransportError> {
        let root = self.root.as_mut().expect("root");
        match (m.first(), m.get(1..)) {
            (Some(b'A'), Some(k)) if k.len() == 4 => {
                *root.acks.entry(u32::from_le_bytes(k.try_into().expect("4 bytes"))).or_insert(0) += 1;
            }
            (Some(b'D'), _) => root.dones += 1,
            _ => {
                return Err(TransportError::Protocol {
                    peer: root.receivers[from].name.clone(),
                    detail: "an unknown message to the sender".into(),
                });
            }
        }
        Ok(())
    }

    fn on_receiver_message(&mut self, m: &[u8]) -> Result<(), TransportError> {
        let peer = self.name.clone();
        let bad = |detail: &str| TransportError::Protocol { peer: peer.clone(), detail: detail.into() };
        let st = self.recv.as_mut().expect("receiver");
        let (kind, body) = m.split_first().ok_or_else(|| bad("an empty message"))?;
        match kind {
            b'B' => {
                let v = body.try_into().map_err(|_| bad("a malformed begin"))?;
                st.begun = Some(u64::from_le_bytes(v));
            }
            b'N' => {
                if body.len() != 4 + 64 {
                    return Err(bad("a malformed IPC handle"));
                }
                let (key, h) = body.split_at(4);
                let key = u32::from_le_bytes(key.try_into().expect("4 bytes"));
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
            b'K' => {
                if body.len() < 4 || (body.len() - 4) % 20 != 0 {
                    return Err(bad("a malformed piece list"));
                }
                let (k, list) = body.split_at(4);
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
                st.announced.insert(u32::from_le_bytes(k.try_into().expect("4 bytes")), pieces);
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
            if let Some(t) = self.recv.as_mut().expect("receiver").trace.as_mut() {
                t.first_copy(&self.copier, &self.streams[0]).map_err(|e| gpu_err(&self.name, e))?;
            }
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
                // The streams in turn: copies overlap on the copy engines.
                let stream = &self.streams[st.next_stream % self.streams.len()];
                st.next_stream += 1;
                // SAFETY: the source is the sender's lent memory, untouched until we confirm; the
                // destination piece stays valid until our ticket completes (engine contract).
                unsafe { copy_async(span.addr, map + offset, len, stream) }.map_err(|e| gpu_err("a peer copy", e))?;
            }
            // SAFETY: as for the single copies above.
            unsafe { self.copier.copy_spans(&batch, &self.streams[0]) }.map_err(|e| gpu_err("a bucket's copies", e))?;
            let events = self.streams.iter().map(|s| self.copier.record_event(s, false)).collect::<Result<Vec<_>, _>>();
            let st = self.recv.as_mut().expect("receiver");
            st.issued.insert(k, events.map_err(|e| gpu_err(&self.name, e))?);
            if let Some(t) = st.trace.as_mut() {
                t.bucket_issued(&self.copier, &self.streams).map_err(|e| gpu_err(&self.name, e))?;
            }
        }
    }
}

/// Pieces below this size are copied by one batched kernel launch per bucket on one GPU: on an
/// H100 the kernel moved a Qwen3-0.6B refit (310 tensors) 1.4× faster than a driver copy per
/// tensor, and Llama-3-8B's gigabyte tensors 3% slower (docs/benchmarks.md). Checked again on
/// Llama-3-8B, the receiver's copies: 16 MiB 10.88–10.94 ms; 1 MiB 10.99–11.00 and driver
/// copies only 11.06–11.07 (one call); 64 MiB 10.99–11.00, 128 MiB 11.58–11.59 and everything
/// batched 11.68 (another).
const BATCH_BELOW: u64 = 16 << 20;

/// How long a receiver polls for the refit's start before it parks on the socket. Its refit is
/// called when the sender's is, so the start message comes within this; a parked thread's wake-up
/// put 0.08–0.14 ms on the refit's path on an H200, polling 0.00–0.03 ms (docs/benchmarks.md).
const START_SPIN: Duration = Duration::from_millis(2);

/// Copy streams per receiver: 4 when the copies stay on one GPU, where per-tensor copies over 4
/// streams took 7.62–7.65 ms of the GPU for Llama-3-8B on an H200 against 7.80–7.81 over 2
/// (docs/benchmarks.md); 2 for copies between GPUs, measured at 1.05 × NCCL (GPU-NOTES.md).
/// `RLPLANE_IPC_STREAMS=N` sets it, for comparison (both sides read the same environment).
fn copy_streams(one_gpu: bool) -> usize {
    let setting = std::env::var("RLPLANE_IPC_STREAMS").ok();
    copy_streams_for(one_gpu, setting.as_deref()).unwrap_or_else(|(measured, e)| {
        tracing::warn!("{e}; using {measured}");
        measured
    })
}

/// [`copy_streams`] for a given `RLPLANE_IPC_STREAMS`; a bad setting gives the measured count and
/// what is wrong with it.
fn copy_streams_for(one_gpu: bool, setting: Option<&str>) -> Result<usize, (usize, String)> {
    let measured = if one_gpu { 4 } else { 2 };
    match setting.map(|v| (v, v.trim().parse::<usize>())) {
        None => Ok(measured),
        Some((_, Ok(n @ 1..=64))) => Ok(n),
        Some((v, _)) => Err((measured, format!("RLPLANE_IPC_STREAMS={v:?} is not a stream count from 1 to 64"))),
    }
}

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

/// Handshake magic of the CUDA IPC control channel (the [`rlplane_wire::net`] handshake, on its Unix
/// socket).
pub const IPC_MAGIC: [u8; 4] = *b"RIPC";
/// 2: frames on a Unix stream socket instead of zeromq messages. 3: every frame carries its tag.
/// 4: tags are AES-256-GMAC.
const IPC_VERSION: u16 = 4;

/// The socket path of an `ipc://` endpoint.
fn socket_path(endpoint: &str) -> Result<&str, TransportError> {
    endpoint
        .strip_prefix("ipc://")
        .filter(|p| !p.is_empty())
        .ok_or_else(|| TransportError::Config(format!("the CUDA IPC endpoint {endpoint:?} is not ipc://<socket path>")))
}

fn io_err(peer: &str, what: &str, e: std::io::Error) -> TransportError {
    TransportError::Io { peer: peer.into(), what: what.into(), detail: e.to_string() }
}

/// A control link's failure: a closed connection, a malformed frame or another I/O error.
fn link_err(peer: &str, what: &str, e: std::io::Error) -> TransportError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::WriteZero => TransportError::Closed { peer: peer.into(), what: what.into() },
        std::io::ErrorKind::InvalidData => TransportError::Protocol { peer: peer.into(), detail: e.to_string() },
        _ => io_err(peer, what, e),
    }
}

/// The sender's side of the handshake: accepts connections on `listener` until every one of
/// `receivers` has joined, each through the [`rlplane_wire::net`] handshake (token, key proof both ways)
/// and then the checks of its hello — an expected receiver with the same plan — answered by a
/// welcome frame naming GPU `ordinal`. Anything else is refused with the reason, counted in
/// `auth`'s refusals and changes nothing. Handshakes run side by side, so a connection that never
/// speaks holds up nobody. A receiver that joins again (it reconnected) replaces its old link.
async fn accept_receivers(
    name: &str,
    listener: &UnixListener,
    receivers: &[String],
    identity: &PlanIdentity,
    auth: &JobAuth,
    ordinal: u32,
    deadline: Instant,
) -> Result<Vec<Peer>, TransportError> {
    let start = Instant::now();
    let mut joined: Vec<Peer> = Vec::new();
    let mut handshakes = FuturesUnordered::new();
    while receivers.iter().any(|r| !joined.iter().any(|p| &p.name == r)) {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => handshakes.push(admit(stream, receivers, identity, auth, ordinal, deadline)),
                Err(e) if net::is_transient_accept_error(&e) => tracing::debug!(error = %e, "a failed IPC accept"),
                Err(e) => return Err(io_err(name, "accepting IPC receivers", e)),
            },
            Some(admitted) = handshakes.next(), if !handshakes.is_empty() => match admitted {
                Ok(peer) => {
                    joined.retain(|p: &Peer| p.name != peer.name);
                    joined.push(peer);
                }
                Err(e) => tracing::warn!(error = %e, "refused an IPC receiver"),
            },
            () = tokio::time::sleep_until(deadline) => {
                return Err(TransportError::Timeout {
                    peer: name.into(),
                    what: format!("waiting for IPC receivers ({} of {} joined)", joined.len(), receivers.len()),
                    secs: start.elapsed().as_secs_f64(),
                });
            }
        }
    }
    Ok(joined)
}

/// One connection's handshake on the sender's side (see [`accept_receivers`]).
async fn admit(
    mut stream: UnixStream,
    receivers: &[String],
    identity: &PlanIdentity,
    auth: &JobAuth,
    ordinal: u32,
    deadline: Instant,
) -> Result<Peer, TransportError> {
    let peer = "a CUDA IPC receiver";
    let (hello, mut session) = net::accept_hello_on(&mut stream, peer, auth, IPC_MAGIC, IPC_VERSION, deadline, |h| {
        if !receivers.contains(&h.peer) {
            return Err(format!("`{}` is not a receiver of this sender", h.peer));
        }
        match PlanIdentity::decode(&h.extra) {
            Some(theirs) if &theirs == identity => Ok(()),
            Some(theirs) => Err(identity.mismatch("the sender", &theirs, &h.peer)),
            None => Err("malformed plan identity".into()),
        }
    })
    .await?;
    // The welcome names this GPU, so a receiver on another GPU can push from it.
    net::until(deadline, "welcoming", &hello.peer, async {
        net::write_tagged_frame(&mut stream, &mut session.send, &ordinal.to_le_bytes())
            .await
            .map_err(|e| net::NetError::io("welcoming", peer, e))
    })
    .await?;
    let link = FrameLink::unix(stream, MAX_FRAME, session)
        .map_err(|e| io_err(&hello.peer, "taking over the connection", e))?;
    Ok(Peer { name: hello.peer, link })
}

/// A receiver's side of the handshake: the [`rlplane_wire::net`] handshake as `me` with this plan's
/// identity (a sender without the epoch's key is refused), then the sender's welcome: its GPU.
/// Returns that and the connection's frame keys.
async fn say_hello(
    stream: &mut UnixStream,
    me: &str,
    endpoint: &str,
    identity: &PlanIdentity,
    auth: &JobAuth,
    deadline: Instant,
) -> Result<(Option<u32>, net::Session), TransportError> {
    let hello =
        net::Hello { magic: IPC_MAGIC, version: IPC_VERSION, peer: me.into(), extra: identity.encode().to_vec() };
    let mut session = net::send_hello(stream, auth, &hello, deadline, endpoint).await?;
    let mut welcome = Vec::new();
    net::until(deadline, "waiting for the sender's welcome", endpoint, async {
        net::read_tagged_frame(stream, &mut session.recv, &mut welcome, 64)
            .await
            .map_err(|e| net::NetError::io("waiting for the sender's welcome", endpoint, e))
    })
    .await?;
    Ok((welcome.get(..4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))), session))
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
                let began = Instant::now();
                self.gpu
                    .context()
                    .synchronize()
                    .map_err(|e| gpu_err("finishing the update", GpuError::driver("", e)))?;
                self.send_all(&[b"B", &v.to_le_bytes()])?;
                tracing::debug!(peer = %self.name, version = v, start_ms = began.elapsed().as_secs_f64() * 1e3, "cuda ipc sender's start (the weights final, the start message sent)");
                Ok(v)
            }
            None => {
                let start = Instant::now();
                loop {
                    self.pump()?;
                    let st = self.recv.as_mut().expect("receiver");
                    if let Some(v) = st.begun.take() {
                        st.trace = Trace::start();
                        return Ok(v);
                    }
                    if Instant::now() >= deadline {
                        return Err(TransportError::Timeout {
                            peer: self.name.clone(),
                            what: "waiting for the refit to start".into(),
                            secs: start.elapsed().as_secs_f64(),
                        });
                    }
                    if start.elapsed() < START_SPIN {
                        tokio::task::yield_now().await;
                        continue;
                    }
                    let sender = &self.recv.as_ref().expect("receiver").sender;
                    if let Ok(Err(e)) = tokio::time::timeout_at(deadline, sender.readable()).await {
                        return Err(link_err(&self.name, "waiting for the refit to start", e));
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
                    self.send_all(&[b"N", &key.to_le_bytes(), &handle.0])?;
                    key
                }
            };
            list.extend_from_slice(&key.to_le_bytes());
            list.extend_from_slice(&(span.addr - base).to_le_bytes());
            list.extend_from_slice(&span.len.to_le_bytes());
        }
        self.send_all(&[b"K", &bucket.to_le_bytes(), &list])?;
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
                        let st = self.recv.as_mut().expect("receiver");
                        st.issued.remove(&k);
                        if let Some(t) = st.trace.as_mut() {
                            t.completed = Some(Instant::now());
                        }
                        self.send_root(&[b"A", &k.to_le_bytes()])?;
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
            if let Some(t) = self.recv.as_mut().expect("receiver").trace.take() {
                t.log(&self.name, version);
            }
            self.send_root(&[b"D", &version.to_le_bytes()])?;
            // Written before returning: the sender's `end` waits for it.
            let st = self.recv.as_mut().expect("receiver");
            let flushed = tokio::time::timeout_at(deadline, st.sender.flushed()).await;
            match flushed {
                Ok(r) => r.map_err(|e| link_err(&self.name, "confirming the refit", e)),
                Err(_) => Err(TransportError::Timeout {
                    peer: self.name.clone(),
                    what: "confirming the refit (the sender does not read)".into(),
                    secs: 0.0,
                }),
            }
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
    //! The control channel's handshake over real Unix sockets, without a GPU: the same attackers
    //! as `tests/auth.rs` on the TCP ports, each refused, counted and left out.
    use super::*;
    use crate::plan::RefitPlan;
    use rlplane_api::model::{DType, TensorSpec, TpSplit};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn copy_streams_are_4_on_one_gpu_2_between_gpus_and_a_bad_setting_is_named() {
        assert_eq!(copy_streams_for(true, None), Ok(4));
        assert_eq!(copy_streams_for(false, None), Ok(2));
        assert_eq!(copy_streams_for(true, Some("8")), Ok(8));
        assert_eq!(copy_streams_for(false, Some(" 1 ")), Ok(1));
        for bad in ["0", "65", "four", ""] {
            let (measured, e) = copy_streams_for(true, Some(bad)).unwrap_err();
            assert_eq!(measured, 4);
            assert!(e.contains("RLPLANE_IPC_STREAMS") && e.contains("1 to 64"), "{e}");
        }
    }

    fn identity() -> PlanIdentity {
        let m = vec![TensorSpec::with_split("w", DType::Bf16, vec![64, 64], TpSplit::Rows)];
        RefitPlan::new(&m, 4096, 256).unwrap().identity()
    }

    fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(20)
    }

    fn hello(peer: &str, id: &PlanIdentity) -> net::Hello {
        net::Hello { magic: IPC_MAGIC, version: IPC_VERSION, peer: peer.into(), extra: id.encode().to_vec() }
    }

    /// A sender task accepting `receivers` on a fresh socket under `auth`; returns its path and
    /// the names it let join.
    fn sender(
        dir: &tempfile::TempDir,
        receivers: &[&str],
        auth: &JobAuth,
    ) -> (String, tokio::task::JoinHandle<Result<Vec<String>, TransportError>>) {
        let path = dir.path().join("refit.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (receivers, auth) = (receivers.iter().map(|r| r.to_string()).collect::<Vec<_>>(), auth.clone());
        let task = tokio::spawn(async move {
            let joined =
                accept_receivers("trainer-0", &listener, &receivers, &identity(), &auth, 3, deadline()).await?;
            Ok(joined.into_iter().map(|p| p.name).collect())
        });
        (path.display().to_string(), task)
    }

    /// A handshake as `hello` under `auth`: the refusal's reason, or the welcome.
    async fn attempt(path: &str, auth: &JobAuth, hello: &net::Hello) -> Result<Option<u32>, String> {
        let mut s = UnixStream::connect(path).await.unwrap();
        match net::send_hello(&mut s, auth, hello, deadline(), "sender").await {
            Ok(mut session) => {
                let mut w = Vec::new();
                net::read_tagged_frame(&mut s, &mut session.recv, &mut w, 64).await.unwrap();
                Ok(w.get(..4).map(|b| u32::from_le_bytes(b.try_into().unwrap())))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    #[tokio::test]
    async fn the_ipc_sender_admits_only_the_key_holder() {
        let dir = tempfile::tempdir().unwrap();
        let id = identity();
        let key = JobAuth::generate_key().unwrap();
        let auth = JobAuth::new(&rlplane_api::job_token("uid", 1), &key);
        let (old_token, old_key) = (rlplane_api::job_token("uid", 0), JobAuth::generate_key().unwrap());
        let (path, sender) = sender(&dir, &["gen-0"], &auth);

        // A stranger that connects and never speaks holds up nobody.
        let _silent = UnixStream::connect(&path).await.unwrap();

        // The epoch's token without its key; the previous epoch's token and key; the token with
        // the previous key.
        for (token, key) in [
            (auth.token().to_string(), JobAuth::generate_key().unwrap()),
            (old_token, old_key),
            (auth.token().to_string(), old_key),
        ] {
            let reason = attempt(&path, &JobAuth::new(&token, &key), &hello("gen-0", &id)).await.unwrap_err();
            assert!(reason.contains("did not prove it holds") || reason.contains("another job or epoch"), "{reason}");
        }
        // A replay: a valid hello, answered with a proof recorded for another challenge.
        let ours = auth.client_hello(&hello("gen-0", &id)).unwrap();
        let (_, other) = auth.open_hello(ours.bytes(), IPC_MAGIC, IPC_VERSION).unwrap();
        let (recorded, _) = ours.answer(&auth, other.bytes()).unwrap();
        let mut s = UnixStream::connect(&path).await.unwrap();
        net::write_frame(&mut s, ours.bytes()).await.unwrap();
        let mut challenge = [0u8; 1 + net::CHALLENGE_LEN];
        s.read_exact(&mut challenge).await.unwrap();
        assert_eq!(challenge[0], net::HELLO_CHALLENGE);
        let mut proof = vec![net::HELLO_OK];
        proof.extend_from_slice(&recorded);
        s.write_all(&proof).await.unwrap();
        let mut verdict = [0u8; 1];
        s.read_exact(&mut verdict).await.unwrap();
        assert_eq!(verdict[0], net::HELLO_REFUSED, "a replayed proof was accepted");
        // Anything but a hello.
        let mut s = UnixStream::connect(&path).await.unwrap();
        net::write_frame(&mut s, b"B\0\0\0\0\0\0\0\0").await.unwrap();
        s.read_exact(&mut verdict).await.unwrap();
        assert_eq!(verdict[0], net::HELLO_REFUSED);
        // The key holder, under a name that is no receiver of this sender, or with another plan.
        let reason = attempt(&path, &auth, &hello("gen-9", &id)).await.unwrap_err();
        assert!(reason.contains("`gen-9` is not a receiver of this sender"), "{reason}");
        let m = vec![TensorSpec::with_split("w", DType::Bf16, vec![64, 128], TpSplit::Rows)];
        let other_plan = RefitPlan::new(&m, 4096, 256).unwrap().identity();
        let reason = attempt(&path, &auth, &hello("gen-0", &other_plan)).await.unwrap_err();
        assert!(reason.contains("plan"), "{reason}");

        // Counted by the sender: the old epoch's token, the replay, the stray message, the
        // stranger's name and the other plan. (A peer with the right token and another key
        // refuses the sender itself, whose proof it cannot check, and counts that on its side.)
        assert_eq!(auth.refusals().snapshot(), vec![("RIPC".to_string(), 5)]);
        assert!(!sender.is_finished(), "no attacker took gen-0's place");

        // The key holder joins, and learns the sender's GPU.
        assert_eq!(attempt(&path, &auth, &hello("gen-0", &id)).await, Ok(Some(3)));
        assert_eq!(sender.await.unwrap().unwrap(), vec!["gen-0"]);
    }

    #[tokio::test]
    async fn a_receiver_refuses_a_sender_without_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let id = identity();
        let token = rlplane_api::job_token("uid", 1);
        let (auth, impostor) = (
            JobAuth::new(&token, &JobAuth::generate_key().unwrap()),
            JobAuth::new(&token, &JobAuth::generate_key().unwrap()),
        );
        let (path, sender) = sender(&dir, &["gen-0"], &impostor);
        let mut s = UnixStream::connect(&path).await.unwrap();
        let err = say_hello(&mut s, "gen-0", &path, &id, &auth, deadline()).await.unwrap_err().to_string();
        assert!(err.contains("the listener did not prove it holds this job epoch's key"), "{err}");
        assert_eq!(auth.refusals().total(), 1);
        assert!(!sender.is_finished(), "the impostor got no receiver");
        sender.abort();
    }

    #[tokio::test]
    async fn a_receiver_that_joins_again_replaces_its_link_and_a_bad_endpoint_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let id = identity();
        let auth = JobAuth::new(&rlplane_api::job_token("uid", 1), &JobAuth::generate_key().unwrap());
        let (path, sender) = sender(&dir, &["gen-0", "gen-1"], &auth);
        for peer in ["gen-0", "gen-0", "gen-1"] {
            assert_eq!(attempt(&path, &auth, &hello(peer, &id)).await, Ok(Some(3)));
        }
        assert_eq!(sender.await.unwrap().unwrap(), vec!["gen-0", "gen-1"]);
        let e = socket_path("tcp://10.0.0.1:5").unwrap_err().to_string();
        assert!(e.contains("is not ipc://<socket path>"), "{e}");
    }
}
