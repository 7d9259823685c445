//! `rlplane bench refit`: the refit engine over TCP between real processes on loopback, against a
//! raw TCP stream of the same bytes between the same processes, measured in the same run.
//!
//! The benchmark builds a real [`WorkerPlan`] (Split mode, device Cpu, loopback addresses) with
//! [`rlplane_api::topology::build_plan`], writes it to a file and runs every sender and receiver
//! of its refit group as a `rlplane peer refit` child process. The parent drives them over their
//! stdin / stdout (one JSON event per line, [`PeerEvent`]): each refit carries new random data
//! (derived from the seed, the version and the tensor), and every receiver checks every tensor's
//! xxh3 checksum after the timed refit. Tests use the same [`Harness`].

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, bail};
use rand::{RngCore, SeedableRng};
use rlplane_api::model::{ModelPreset, TensorSpec, TpSplit, manifest_bytes};
use rlplane_api::plan::WorkerPlan;
use rlplane_api::spec::{ModelSpec, RLJobSpec, RefitSource};
use rlplane_api::topology::{Addressing, JobIdentity, build_plan};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::TcpStream;
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::time::Instant;

use crate::net::{self, JobAuth};
use crate::refit::memory::{Copy2d, HostTensors, MemorySpace};
use crate::refit::{
    self, RefitReceiver, RefitSender, RefitStats, SenderLayout, StagingPolicy, StreamConfig, WeightsState,
};
use crate::transport::tcp::{TcpOptions, TcpTransport};
use crate::transport::{Piece, Transport, TransportError};

/// Staging policy on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StagingArg {
    /// Stage only strided spans (default).
    WhenNeeded,
    /// Stage everything (pack → send → unpack).
    Always,
}

impl From<StagingArg> for StagingPolicy {
    fn from(s: StagingArg) -> Self {
        match s {
            StagingArg::WhenNeeded => StagingPolicy::WhenNeeded,
            StagingArg::Always => StagingPolicy::Always,
        }
    }
}

/// Where refit's bytes come from, on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceArg {
    /// One sender (trainer rank 0) holding every tensor whole.
    Gathered,
    /// Every (tp, pp) trainer rank sends its own shard.
    Sharded,
}

/// Transports the benchmark can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportArg {
    /// TCP relayed through the receivers.
    Tcp,
    /// NCCL broadcast between GPUs (see [`super::gpu`]).
    Nccl,
    /// CUDA IPC copy-engine copies (between GPUs of a node, or on one GPU with `--colocated`).
    CudaIpc,
    /// Measure the GPU transports that apply and keep the faster.
    Auto,
}

/// Arguments of `rlplane bench refit`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Transport.
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: TransportArg,
    /// Model preset: tiny, qwen3-0.6b or llama3-8b.
    #[arg(long, default_value = "qwen3-0.6b")]
    pub model: ModelPreset,
    /// Receivers (generation ranks), each its own process. A list (`1,3,7`) measures each size in
    /// turn, interleaved round by round, so that load changes on the machine hit every size alike.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub receivers: Vec<u32>,
    /// Rounds of a sweep: each round starts every group size afresh and times `--iters` refits.
    #[arg(long, default_value_t = 1)]
    pub rounds: u32,
    /// Staging buffers per stream (spec.refit.numBuffers).
    #[arg(long, default_value_t = 2)]
    pub buffers: u32,
    /// Bucket size in bytes (spec.refit.bufferBytes).
    #[arg(long, default_value_t = 256 << 20)]
    pub bucket_bytes: u64,
    /// Alignment of tensors in a bucket (spec.refit.alignBytes).
    #[arg(long, default_value_t = 256)]
    pub align_bytes: u64,
    /// Timed refits (and raw streams) per round, after one untimed warm-up of each.
    #[arg(long, default_value_t = 5)]
    pub iters: u32,
    /// Gathered (one sender) or sharded (tp × pp senders).
    #[arg(long, value_enum, default_value = "gathered")]
    pub source: SourceArg,
    /// Trainer tensor-parallel size (sharded source).
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// Trainer pipeline-parallel size (sharded source).
    #[arg(long, default_value_t = 1)]
    pub pp: u32,
    /// Stream settings, passed on to every peer.
    #[command(flatten)]
    pub stream: StreamKnobs,
    /// spec.refit.timeoutSeconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_seconds: u32,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// GPU transports: trainer and generation share GPU 0 (CUDA IPC, direct and staged).
    #[arg(long)]
    pub colocated: bool,
    /// GPU transports: untimed warm-up refits before the timed ones.
    #[arg(long, default_value_t = 3)]
    pub warmup: u32,
}

/// Arguments of a refit peer process (spawned by the benchmark and the tests).
#[derive(Debug, Clone, clap::Args)]
pub struct PeerArgs {
    /// The WorkerPlan file.
    #[arg(long)]
    pub plan: PathBuf,
    /// This process's name in the plan (`trainer-0`, `gen-2`).
    #[arg(long)]
    pub process: String,
    /// Stream settings (the benchmark's).
    #[command(flatten)]
    pub stream: StreamKnobs,
    /// Loopback port of the raw reference stream (the first receiver listens, the sender connects).
    #[arg(long)]
    pub raw_port: Option<u16>,
    /// Test hook: sleep this long before every wait on the transport (a slow peer).
    #[arg(long, default_value_t = 0)]
    pub slow_ms: u64,
    /// Test hook: compute the plan with this bucket size instead of the plan's (a mismatched rank).
    #[arg(long)]
    pub skew_bucket_bytes: Option<u64>,
    /// Test hook: the transport lets buckets without staging all be in flight at once, as the
    /// GPU transports do (`Transport::pipelines_direct`); give it to every peer of a stream.
    #[arg(long)]
    pub pipeline_direct: bool,
}

/// Stream settings that the benchmark and its peers share: the peers get the benchmark's.
#[derive(Debug, Clone, clap::Args)]
pub struct StreamKnobs {
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// When to stage through buffers.
    #[arg(long, value_enum, default_value = "when-needed")]
    pub staging: StagingArg,
    /// Bytes a relay receives before forwarding them.
    #[arg(long, default_value_t = 1 << 20)]
    pub relay_chunk_bytes: u64,
    /// Relay children per node (1 = chain).
    #[arg(long, default_value_t = 1)]
    pub fanout: u32,
}

/// One line a peer prints on stdout.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerEvent {
    /// `ready`, `refit`, `raw` or `error`.
    pub event: String,
    /// The peer's process name.
    pub process: String,
    /// Whether the operation succeeded.
    pub ok: bool,
    /// The refit's version (as announced, for receivers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    /// A receiver's weights state after the operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<WeightsState>,
    /// The refit's statistics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<RefitStats>,
    /// The error, when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A receiver's checksum verdict (every tensor matches the sender's data of `version`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum_ok: Option<bool>,
    /// Tensors whose checksum did not match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mismatched: Vec<String>,
    /// Seconds of the operation (raw stream, or wall time of a failed refit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secs: Option<f64>,
    /// Bytes moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

// ---------------------------------------------------------------------------------------------
// Plans on loopback.

/// Loopback addressing with a fresh free port per service, each held until the plan is built.
struct LoopbackAddressing {
    ipc_dir: String,
    ports: Mutex<HashMap<(String, u16, u32), std::net::TcpListener>>,
}

impl Addressing for LoopbackAddressing {
    fn host(&self, _pod: &str) -> String {
        "127.0.0.1".into()
    }
    fn bind_host(&self, _pod: &str) -> String {
        "127.0.0.1".into()
    }
    fn ipc_dir(&self, _pod: &str) -> String {
        self.ipc_dir.clone()
    }
    fn port(&self, pod: &str, base: u16, offset: u32) -> u16 {
        let mut ports = self.ports.lock().unwrap_or_else(|e| e.into_inner());
        let held = match ports.entry((pod.to_string(), base, offset)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => match net::reserve_loopback_port() {
                Ok(l) => e.insert(l),
                Err(_) => return 0,
            },
        };
        held.local_addr().map(|a| a.port()).unwrap_or(0)
    }
    fn same_node(&self, _pods: &[&str]) -> bool {
        true
    }
    fn private_ipc(&self, _pod: &str) -> bool {
        true
    }
}

/// A port nothing listens on right now, outside the ephemeral range (see
/// [`net::reserve_loopback_port`]).
fn free_port() -> u16 {
    net::reserve_loopback_port().and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(0)
}

/// What a harness runs.
#[derive(Clone, Debug)]
pub struct HarnessOptions {
    /// The `rlplane` executable.
    pub exe: PathBuf,
    /// The manifest.
    pub model: ModelSpec,
    /// Receivers.
    pub receivers: u32,
    /// Gathered or sharded.
    pub source: RefitSource,
    /// Trainer tensor-parallel size.
    pub tp: u32,
    /// Trainer pipeline-parallel size.
    pub pp: u32,
    /// spec.refit.numBuffers.
    pub buffers: u32,
    /// spec.refit.bufferBytes.
    pub bucket_bytes: u64,
    /// spec.refit.alignBytes.
    pub align_bytes: u64,
    /// spec.refit.timeoutSeconds.
    pub timeout_seconds: u32,
    /// Staging policy.
    pub staging: StagingArg,
    /// TCP tuning.
    pub tcp: TcpOptions,
    /// Seed of the random weights.
    pub seed: u64,
    /// Whether to open the raw reference stream (one sender only).
    pub raw: bool,
    /// Extra peer flags per process name, `*` for every peer (test hooks such as `--slow-ms`).
    pub extra_flags: HashMap<String, Vec<String>>,
}

impl HarnessOptions {
    /// Defaults for a model: one receiver, two 256 MiB buffers, gathered, no raw stream.
    pub fn new(exe: impl Into<PathBuf>, model: ModelSpec) -> HarnessOptions {
        HarnessOptions {
            exe: exe.into(),
            model,
            receivers: 1,
            source: RefitSource::Gathered,
            tp: 1,
            pp: 1,
            buffers: 2,
            bucket_bytes: 256 << 20,
            align_bytes: 256,
            timeout_seconds: 60,
            staging: StagingArg::WhenNeeded,
            tcp: TcpOptions::default(),
            seed: 1,
            raw: false,
            extra_flags: HashMap::new(),
        }
    }
}

/// The WorkerPlan of a bench job: Split mode on device Cpu, one trainer pod of tp × pp ranks,
/// `receivers` single-GPU engines, loopback addresses.
pub fn loopback_plan(o: &HarnessOptions, ipc_dir: &Path) -> anyhow::Result<WorkerPlan> {
    let source = match o.source {
        RefitSource::Gathered => "Gathered",
        RefitSource::Sharded => "Sharded",
    };
    let spec = serde_json::json!({
        "mode": "Split",
        "device": "Cpu",
        "model": o.model,
        "trainer": { "nodes": 1, "gpusPerNode": o.tp * o.pp, "parallelism": { "tensor": o.tp, "pipeline": o.pp } },
        "generation": { "engines": o.receivers },
        "refit": {
            "bufferBytes": o.bucket_bytes,
            "numBuffers": o.buffers,
            "alignBytes": o.align_bytes,
            "transport": "Tcp",
            "source": source,
            "timeoutSeconds": o.timeout_seconds,
        },
    });
    let spec: RLJobSpec = serde_json::from_value(spec).context("building the bench job spec")?;
    let id = JobIdentity {
        name: "bench".into(),
        namespace: "local".into(),
        uid: format!("bench-{}-{}", std::process::id(), Instant::now().elapsed().as_nanos()),
        epoch: 0,
        resume: None,
    };
    let addr = LoopbackAddressing { ipc_dir: ipc_dir.display().to_string(), ports: Mutex::default() };
    build_plan(&spec, &id, &addr).map_err(|e| anyhow::anyhow!("the bench job is invalid:\n{e}"))
}

// ---------------------------------------------------------------------------------------------
// Data.

/// Fills `buf` with tensor `index`'s bytes of `version` (deterministic in all three and the seed).
pub fn fill_tensor(seed: u64, version: u64, index: usize, buf: &mut [u8]) {
    let mut key = [0u8; 24];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&version.to_le_bytes());
    key[16..].copy_from_slice(&(index as u64).to_le_bytes());
    let mut rng = rand::rngs::SmallRng::seed_from_u64(xxhash_rust::xxh3::xxh3_64(&key));
    rng.fill_bytes(buf);
}

/// A sender's shard of a full tensor, computed independently of the plan (so the tests check the
/// plan against this definition): `Rows` → rows `[n·t/tp, n·(t+1)/tp)`; `Columns` (2-D and up)
/// → the same range of dimension 1 in every row; `Replicated` → whole at `tp = 0`.
pub fn shard_of(t: &TensorSpec, full: &[u8], tp: u32, tp_size: u32) -> Vec<u8> {
    let range = |n: u64| ((n * tp as u64 / tp_size as u64), (n * (tp as u64 + 1) / tp_size as u64));
    match t.effective_split() {
        TpSplit::Replicated => {
            if tp == 0 {
                full.to_vec()
            } else {
                Vec::new()
            }
        }
        TpSplit::Columns if t.shape.len() >= 2 => {
            let (rows, row_bytes) = t.as_byte_matrix();
            let unit = row_bytes / t.shape[1];
            let (c0, c1) = range(t.shape[1]);
            let mut out = Vec::with_capacity(((c1 - c0) * unit * rows) as usize);
            for r in 0..rows {
                let at = (r * row_bytes + c0 * unit) as usize;
                out.extend_from_slice(&full[at..at + ((c1 - c0) * unit) as usize]);
            }
            out
        }
        TpSplit::Rows | TpSplit::Columns => {
            let unit = full.len() as u64 / t.shape[0];
            let (r0, r1) = range(t.shape[0]);
            full[(r0 * unit) as usize..(r1 * unit) as usize].to_vec()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A slow transport, for the tests' slow peers.

/// Wraps a transport, sleeping before every wait (a peer that consumes its buckets slowly), and
/// optionally pipelining buckets without staging (the GPU transports' window, over TCP).
struct Slow<T> {
    inner: T,
    delay: Duration,
    pipeline_direct: bool,
}

impl<T: Transport> Transport for Slow<T> {
    type Ticket = T::Ticket;
    type Staging = T::Staging;

    fn name(&self) -> &str {
        self.inner.name()
    }
    fn is_root(&self) -> bool {
        self.inner.is_root()
    }
    fn reaches(&self, space: MemorySpace) -> bool {
        self.inner.reaches(space)
    }
    fn alloc_staging(&mut self, bytes: u64) -> Result<T::Staging, TransportError> {
        self.inner.alloc_staging(bytes)
    }
    async fn begin(&mut self, version: Option<u64>, deadline: Instant) -> Result<u64, TransportError> {
        self.inner.begin(version, deadline).await
    }
    unsafe fn submit(&mut self, bucket: u32, pieces: &[Piece]) -> Result<T::Ticket, TransportError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.submit(bucket, pieces) }
    }
    unsafe fn copy(&mut self, copies: &[Copy2d]) -> Result<T::Ticket, TransportError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.copy(copies) }
    }
    async fn wait(&mut self, ticket: T::Ticket, deadline: Instant) -> Result<(), TransportError> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        self.inner.wait(ticket, deadline).await
    }
    async fn end(&mut self, version: u64, deadline: Instant) -> Result<(), TransportError> {
        self.inner.end(version, deadline).await
    }
    fn abort(&mut self, reason: &str) {
        self.inner.abort(reason)
    }
    fn copy_busy(&self) -> Duration {
        self.inner.copy_busy()
    }
    fn stage_below(&self) -> u64 {
        self.inner.stage_below()
    }
    fn pipelines_direct(&self) -> bool {
        self.pipeline_direct || self.inner.pipelines_direct()
    }
}

// ---------------------------------------------------------------------------------------------
// The peer process.

fn emit(e: &PeerEvent) {
    use std::io::Write;
    let line = serde_json::to_string(e).expect("events serialize");
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Runs a peer process.
pub fn run_peer(args: PeerArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(peer_main(args))
}

struct PeerSetup {
    wp: WorkerPlan,
    auth: JobAuth,
    me: u32,
    name: String,
    manifest: Vec<TensorSpec>,
    streams: Vec<refit::StreamInfo>,
    options: TcpOptions,
    config: StreamConfig,
    slow: Duration,
    pipeline_direct: bool,
}

async fn peer_main(args: PeerArgs) -> anyhow::Result<()> {
    let mut wp = WorkerPlan::load(&args.plan.display().to_string())?;
    if let Some(b) = args.skew_bucket_bytes {
        wp.refit.buffer_bytes = Some(b);
    }
    let me = wp.process_index(&args.process).with_context(|| format!("process {} is not in the plan", args.process))?;
    let group = wp
        .refit_groups_of(me)
        .first()
        .cloned()
        .cloned()
        .with_context(|| format!("process {} is in no refit group", args.process))?;
    let options = TcpOptions { relay_chunk_bytes: args.stream.relay_chunk_bytes, fanout: args.stream.fanout };
    let streams = refit::group_streams(&wp, &group, &options)?;
    let mut config = StreamConfig::from_spec(&wp.refit);
    config.staging = args.stream.staging.into();
    let setup = PeerSetup {
        auth: JobAuth::for_plan(&wp)?,
        manifest: wp.manifest(),
        name: args.process.clone(),
        wp,
        me,
        streams,
        options,
        config,
        slow: Duration::from_millis(args.slow_ms),
        pipeline_direct: args.pipeline_direct,
    };
    let result = if group.senders.contains(&me) {
        run_sender(&setup, &args).await
    } else {
        run_receiver(&setup, &args, group.receivers.first() == Some(&me)).await
    };
    if let Err(e) = &result {
        emit(&PeerEvent {
            event: "error".into(),
            process: setup.name.clone(),
            error: Some(format!("{e:#}")),
            ..Default::default()
        });
    }
    result
}

async fn read_command(lines: &mut Lines<BufReader<tokio::io::Stdin>>) -> anyhow::Result<Option<(String, u64)>> {
    let Some(line) = lines.next_line().await? else { return Ok(None) };
    let mut it = line.split_whitespace();
    let cmd = it.next().unwrap_or_default().to_string();
    let arg = it.next().map(str::parse).transpose().context("command argument is not a number")?.unwrap_or(0);
    Ok(Some((cmd, arg)))
}

async fn run_sender(s: &PeerSetup, args: &PeerArgs) -> anyhow::Result<()> {
    let stream = s.streams.iter().find(|x| x.sender == s.me).context("no stream for this sender")?;
    let layout = stream.plan.layout();
    let listener = refit::bind_listener(&s.wp, s.me).await?;
    let transport = refit::connect_tcp_sender(&s.wp, stream, &listener, &s.auth, &s.options).await?;
    let mut raw = match args.raw_port {
        Some(port) => {
            let deadline = Instant::now() + s.config.timeout;
            Some(net::connect_retry(&format!("127.0.0.1:{port}"), deadline, "the raw reference stream").await?)
        }
        None => None,
    };
    let mut sender = RefitSender::new(
        stream.plan.clone(),
        Slow { inner: transport, delay: s.slow, pipeline_direct: s.pipeline_direct },
        s.config,
    )?;
    let mut source = HostTensors::zeroed(stream.plan.tensors().iter().map(|t| t.source_bytes.unwrap_or(0)));
    // The tagged reference stream's keys (no handshake on the reference connection) and threads,
    // as a refit transport has them.
    let (mut tags, macs) = (net::Session::fixed_pair(1).0, net::MacPool::new("raw", 2));
    let mut shared: Option<Vec<bytes::Bytes>> = None;
    emit(&PeerEvent { event: "ready".into(), process: s.name.clone(), ok: true, ..Default::default() });
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut broken = false;
    let mut full = Vec::new();
    while let Some((cmd, arg)) = read_command(&mut lines).await? {
        match cmd.as_str() {
            "refit" => {
                let version = arg;
                for (i, t) in s.manifest.iter().enumerate() {
                    if source.tensor(i).is_empty() {
                        continue;
                    }
                    full.resize(t.size_bytes() as usize, 0);
                    fill_tensor(args.stream.seed, version, i, &mut full);
                    match layout {
                        SenderLayout::Full => source.tensor_mut(i).copy_from_slice(&full),
                        SenderLayout::Sharded(c) => {
                            source.tensor_mut(i).copy_from_slice(&shard_of(t, &full, c.tp, c.tp_size))
                        }
                    }
                }
                if broken {
                    let t = refit::connect_tcp_sender(&s.wp, stream, &listener, &s.auth, &s.options).await?;
                    sender.replace_transport(Slow { inner: t, delay: s.slow, pipeline_direct: s.pipeline_direct });
                }
                let start = Instant::now();
                let r = sender.send(version, &source).await;
                let secs = start.elapsed().as_secs_f64();
                broken = r.is_err();
                let mut e = PeerEvent {
                    event: "refit".into(),
                    process: s.name.clone(),
                    ok: r.is_ok(),
                    version: Some(version),
                    secs: Some(secs),
                    ..Default::default()
                };
                match r {
                    Ok(stats) => {
                        e.bytes = Some(stats.bytes);
                        e.stats = Some(stats);
                    }
                    Err(err) => e.error = Some(err.to_string()),
                }
                emit(&e);
            }
            "raw" => {
                let conn = raw.as_mut().context("no raw stream was set up (--raw-port)")?;
                let mut bufs: Vec<IoSlice<'_>> = (0..source.len()).map(|i| IoSlice::new(source.tensor(i))).collect();
                let start = Instant::now();
                net::write_all_slices(conn, &mut bufs).await?;
                let mut ack = [0u8; 1];
                conn.read_exact(&mut ack).await?;
                let secs = start.elapsed().as_secs_f64();
                emit(&PeerEvent {
                    event: "raw".into(),
                    process: s.name.clone(),
                    ok: true,
                    secs: Some(secs),
                    bytes: Some(source.total_bytes()),
                    ..Default::default()
                });
            }
            "tagged" | "chunked" => {
                let conn = raw.as_mut().context("no raw stream was set up (--raw-port)")?;
                // The tag threads read shared buffers: a copy of the tensors, made once, untimed.
                let shared = shared.get_or_insert_with(|| {
                    (0..source.len()).map(|i| bytes::Bytes::copy_from_slice(source.tensor(i))).collect::<Vec<_>>()
                });
                let start = Instant::now();
                if cmd == "tagged" {
                    net::write_records(conn, &mut tags.send, &macs, shared).await?;
                } else {
                    let parts: Vec<&[u8]> = shared.iter().map(|b| b.as_ref()).collect();
                    write_in_records(conn, &parts).await?;
                }
                let mut ack = [0u8; 1];
                conn.read_exact(&mut ack).await?;
                emit(&PeerEvent {
                    event: cmd.clone(),
                    process: s.name.clone(),
                    ok: true,
                    secs: Some(start.elapsed().as_secs_f64()),
                    bytes: Some(source.total_bytes()),
                    ..Default::default()
                });
            }
            "slow" => sender.transport_mut().delay = Duration::from_millis(arg),
            "quit" => break,
            other => bail!("unknown peer command `{other}`"),
        }
    }
    Ok(())
}

async fn run_receiver(s: &PeerSetup, args: &PeerArgs, first: bool) -> anyhow::Result<()> {
    let raw_listener = match (args.raw_port, first) {
        (Some(port), true) => Some(net::bind(&format!("127.0.0.1:{port}"), "the raw reference stream").await?),
        _ => None,
    };
    let listener = refit::bind_listener(&s.wp, s.me).await?;
    let transports = refit::connect_tcp_receiver(&s.wp, s.me, &s.streams, &listener, &s.auth, &s.options).await?;
    let mut raw = match raw_listener {
        Some(l) => {
            let deadline = Instant::now() + s.config.timeout;
            let (conn, _) = net::until(deadline, "waiting for the raw reference stream", "sender", async {
                l.accept().await.map_err(|e| crate::net::NetError::io("accepting the raw stream", "sender", e))
            })
            .await?;
            net::tune(&conn);
            Some(conn)
        }
        None => None,
    };
    let slow = |t: TcpTransport| Slow { inner: t, delay: s.slow, pipeline_direct: s.pipeline_direct };
    let mut receiver = RefitReceiver::new(
        s.streams.iter().zip(transports).map(|(st, t)| (st.plan.clone(), slow(t))).collect(),
        s.config,
    )?;
    let mut dest = HostTensors::zeroed(s.manifest.iter().map(TensorSpec::size_bytes));
    let (mut tags, macs) = (net::Session::fixed_pair(1).1, net::MacPool::new("raw", 2));
    emit(&PeerEvent { event: "ready".into(), process: s.name.clone(), ok: true, ..Default::default() });
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut broken = false;
    let mut expected = Vec::new();
    while let Some((cmd, arg)) = read_command(&mut lines).await? {
        match cmd.as_str() {
            "refit" => {
                if broken {
                    let t =
                        refit::connect_tcp_receiver(&s.wp, s.me, &s.streams, &listener, &s.auth, &s.options).await?;
                    receiver.replace_transports(t.into_iter().map(slow).collect())?;
                }
                let start = Instant::now();
                let r = receiver.receive(&mut dest).await;
                let secs = start.elapsed().as_secs_f64();
                broken = r.is_err();
                let state = receiver.state();
                let mut e = PeerEvent {
                    event: "refit".into(),
                    process: s.name.clone(),
                    ok: r.is_ok(),
                    state: Some(state),
                    secs: Some(secs),
                    ..Default::default()
                };
                match r {
                    Ok(stats) => {
                        // Outside the timed region: every tensor against the sender's data.
                        let version = stats.version;
                        e.version = Some(version);
                        for (i, t) in s.manifest.iter().enumerate() {
                            expected.resize(t.size_bytes() as usize, 0);
                            fill_tensor(args.stream.seed, version, i, &mut expected);
                            let want = xxhash_rust::xxh3::xxh3_64(&expected);
                            if xxhash_rust::xxh3::xxh3_64(dest.tensor(i)) != want {
                                e.mismatched.push(t.name.clone());
                            }
                        }
                        e.checksum_ok = Some(e.mismatched.is_empty());
                        e.bytes = Some(stats.bytes);
                        e.stats = Some(stats);
                    }
                    Err(err) => {
                        if let WeightsState::Incomplete(v) | WeightsState::Complete(v) = state {
                            e.version = Some(v);
                        }
                        e.error = Some(err.to_string());
                    }
                }
                emit(&e);
            }
            "raw" => {
                let conn =
                    raw.as_mut().context("this receiver has no raw stream (--raw-port on the first receiver)")?;
                let total = dest.total_bytes();
                let start = Instant::now();
                let mut bufs: Vec<IoSliceMut<'_>> =
                    dest.tensors_mut().filter(|b| !b.is_empty()).map(IoSliceMut::new).collect();
                read_exact_vectored(conn, &mut bufs).await?;
                conn.write_all(&[1]).await?;
                emit(&PeerEvent {
                    event: "raw".into(),
                    process: s.name.clone(),
                    ok: true,
                    secs: Some(start.elapsed().as_secs_f64()),
                    bytes: Some(total),
                    ..Default::default()
                });
            }
            "tagged" | "chunked" => {
                let conn =
                    raw.as_mut().context("this receiver has no raw stream (--raw-port on the first receiver)")?;
                let total = dest.total_bytes();
                let start = Instant::now();
                let mut bufs: Vec<&mut [u8]> = dest.tensors_mut().collect();
                if cmd == "tagged" {
                    let mut checks = net::RecordChecks::new();
                    // SAFETY: `dest` belongs to this loop, which finishes the checks right here.
                    unsafe { checks.read(conn, &mut tags.recv, &macs, &mut bufs) }.await?;
                    checks.finish().await?;
                } else {
                    read_in_records(conn, &mut bufs).await?;
                }
                conn.write_all(&[1]).await?;
                emit(&PeerEvent {
                    event: cmd.clone(),
                    process: s.name.clone(),
                    ok: true,
                    secs: Some(start.elapsed().as_secs_f64()),
                    bytes: Some(total),
                    ..Default::default()
                });
            }
            "slow" => receiver.transports_mut().for_each(|t| t.delay = Duration::from_millis(arg)),
            "quit" => break,
            other => bail!("unknown peer command `{other}`"),
        }
    }
    Ok(())
}

/// Writes `parts` (as one stream) in writes of one record each, without tags: the tagged
/// stream's reference for what tagging alone costs.
async fn write_in_records(conn: &mut TcpStream, parts: &[&[u8]]) -> std::io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = Vec::new();
    let mut room = net::RECORD_BYTES;
    for part in parts {
        let mut rest: &[u8] = part;
        while !rest.is_empty() {
            let take = rest.len().min(room);
            slices.push(IoSlice::new(&rest[..take]));
            (rest, room) = (&rest[take..], room - take);
            if room == 0 {
                net::write_all_slices(conn, &mut slices).await?;
                (slices, room) = (Vec::new(), net::RECORD_BYTES);
            }
        }
    }
    net::write_all_slices(conn, &mut slices).await
}

/// Fills `bufs` (as one stream) in reads of at most one record each, as the tagged stream's
/// reader does, without tags.
async fn read_in_records(conn: &mut TcpStream, bufs: &mut [&mut [u8]]) -> std::io::Result<()> {
    let mut room = net::RECORD_BYTES;
    for buf in bufs.iter_mut() {
        let mut at = 0;
        while at < buf.len() {
            let take = (buf.len() - at).min(room);
            conn.read_exact(&mut buf[at..at + take]).await?;
            (at, room) = (at + take, room - take);
            if room == 0 {
                room = net::RECORD_BYTES;
            }
        }
    }
    Ok(())
}

/// Fills every buffer, in order, with vectored reads (at most 64 slices a call).
async fn read_exact_vectored(conn: &mut TcpStream, mut bufs: &mut [IoSliceMut<'_>]) -> std::io::Result<()> {
    while !bufs.is_empty() {
        conn.readable().await?;
        let window = bufs.len().min(64);
        match conn.try_read_vectored(&mut bufs[..window]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The harness.

struct Peer {
    name: String,
    args: Vec<String>,
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

/// A refit group of peer processes on loopback, driven over stdin / stdout.
pub struct Harness {
    /// The plan every peer runs.
    pub plan: WorkerPlan,
    /// The options it was started with.
    pub options: HarnessOptions,
    dir: PathBuf,
    peers: Vec<Peer>,
    senders: Vec<String>,
    receivers: Vec<String>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Results of one refit round.
#[derive(Clone, Debug)]
pub struct Round {
    /// Every sender's event.
    pub senders: Vec<PeerEvent>,
    /// Every receiver's event, in relay order.
    pub receivers: Vec<PeerEvent>,
}

impl Round {
    /// Seconds of the refit: the slowest sender's call (each returns once every receiver confirmed).
    pub fn secs(&self) -> f64 {
        self.senders.iter().filter_map(|e| e.stats.as_ref().map(|s| s.total_secs)).fold(0.0, f64::max)
    }

    /// Whether every peer succeeded and every checksum matched.
    pub fn all_ok(&self) -> bool {
        self.senders.iter().all(|e| e.ok) && self.receivers.iter().all(|e| e.ok && e.checksum_ok == Some(true))
    }

    /// The first failure, for messages.
    pub fn describe_failures(&self) -> String {
        self.senders
            .iter()
            .chain(&self.receivers)
            .filter(|e| !e.ok || e.checksum_ok == Some(false))
            .map(|e| {
                format!(
                    "{}: {}",
                    e.process,
                    e.error.clone().unwrap_or_else(|| format!("mismatched {:?}", e.mismatched))
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl Harness {
    /// Builds the plan and spawns every peer (senders and receivers); does not wait for them.
    pub async fn spawn(options: HarnessOptions) -> anyhow::Result<Harness> {
        let dir = std::env::temp_dir().join(format!(
            "rlplane-refit-{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut plan = loopback_plan(&options, &dir)?;
        // The peers authenticate with a fresh key in the harness's directory.
        let key_path = dir.join("job.key");
        net::issue_key_file(&key_path).with_context(|| format!("writing {}", key_path.display()))?;
        plan.job.key_file = key_path.display().to_string();
        let plan_path = dir.join("plan.json");
        std::fs::write(&plan_path, plan.to_json())?;
        let group = plan.refit_groups.first().context("the plan has no refit group")?.clone();
        let name = |i: &u32| plan.process(*i).name.clone();
        let senders: Vec<String> = group.senders.iter().map(name).collect();
        let receivers: Vec<String> = group.receivers.iter().map(name).collect();
        let raw_port = (options.raw && senders.len() == 1).then(free_port);
        let mut harness = Harness { plan, options, dir, peers: Vec::new(), senders, receivers };
        for (i, p) in harness.receivers.clone().iter().chain(harness.senders.clone().iter()).enumerate() {
            let mut args = vec![
                "peer".to_string(),
                "refit".into(),
                "--plan".into(),
                plan_path.display().to_string(),
                "--process".into(),
                p.clone(),
                "--seed".into(),
                harness.options.seed.to_string(),
                "--staging".into(),
                match harness.options.staging {
                    StagingArg::WhenNeeded => "when-needed".into(),
                    StagingArg::Always => "always".into(),
                },
                "--relay-chunk-bytes".into(),
                harness.options.tcp.relay_chunk_bytes.to_string(),
                "--fanout".into(),
                harness.options.tcp.fanout.to_string(),
            ];
            let is_first_receiver = i == 0;
            let is_sender = harness.senders.contains(p);
            if let Some(port) = raw_port.filter(|_| is_first_receiver || is_sender) {
                args.extend(["--raw-port".into(), port.to_string()]);
            }
            for key in ["*", p.as_str()] {
                args.extend(harness.options.extra_flags.get(key).cloned().unwrap_or_default());
            }
            let peer = harness.start_peer(p, args)?;
            harness.peers.push(peer);
        }
        Ok(harness)
    }

    fn start_peer(&self, name: &str, args: Vec<String>) -> anyhow::Result<Peer> {
        let mut cmd = tokio::process::Command::new(&self.options.exe);
        cmd.args(&args);
        crate::proc::supervise(&mut cmd);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        if std::env::var_os("RLPLANE_LOG").is_none() {
            cmd.env("RLPLANE_LOG", "warn");
        }
        let mut child = cmd.spawn().with_context(|| format!("spawning {}", self.options.exe.display()))?;
        let stdin = child.stdin.take().context("peer stdin")?;
        let stdout = child.stdout.take().context("peer stdout")?;
        Ok(Peer { name: name.to_string(), args, child, stdin, lines: BufReader::new(stdout).lines() })
    }

    /// Spawns every peer and waits until each is connected.
    pub async fn start(options: HarnessOptions) -> anyhow::Result<Harness> {
        let mut h = Harness::spawn(options).await?;
        let first = h.first_events().await?;
        let bad: Vec<String> = first
            .iter()
            .filter(|e| e.event != "ready")
            .map(|e| format!("{}: {}", e.process, e.error.clone().unwrap_or_default()))
            .collect();
        if !bad.is_empty() {
            bail!("refit peers failed to connect: {}", bad.join("; "));
        }
        Ok(h)
    }

    /// The first event of every peer (`ready`, or the `error` it failed with), receivers first.
    pub async fn first_events(&mut self) -> anyhow::Result<Vec<PeerEvent>> {
        let names: Vec<String> = self.peers.iter().map(|p| p.name.clone()).collect();
        let mut out = Vec::new();
        for n in names {
            out.push(self.next_event(&n).await?);
        }
        Ok(out)
    }

    /// Sender process names.
    pub fn senders(&self) -> &[String] {
        &self.senders
    }

    /// Receiver process names, in relay order.
    pub fn receivers(&self) -> &[String] {
        &self.receivers
    }

    /// Bytes of the manifest.
    pub fn manifest_bytes(&self) -> u64 {
        manifest_bytes(&self.plan.manifest())
    }

    fn peer(&mut self, name: &str) -> anyhow::Result<&mut Peer> {
        self.peers.iter_mut().find(|p| p.name == name).with_context(|| format!("no peer {name}"))
    }

    /// Sends a command line to a peer.
    pub async fn command(&mut self, name: &str, line: &str) -> anyhow::Result<()> {
        let p = self.peer(name)?;
        p.stdin.write_all(format!("{line}\n").as_bytes()).await.with_context(|| format!("writing to {name}"))?;
        p.stdin.flush().await?;
        Ok(())
    }

    /// The next event of a peer, waiting at most the refit timeout plus a minute.
    pub async fn next_event(&mut self, name: &str) -> anyhow::Result<PeerEvent> {
        let limit = Duration::from_secs(self.options.timeout_seconds as u64 + 60);
        let p = self.peer(name)?;
        let line = tokio::time::timeout(limit, p.lines.next_line())
            .await
            .with_context(|| format!("{name} printed nothing for {limit:?}"))??;
        match line {
            Some(l) => serde_json::from_str(&l).with_context(|| format!("{name} printed `{l}`")),
            None => {
                let status = p.child.wait().await?;
                bail!("{name} exited ({status}) without an event")
            }
        }
    }

    /// Starts a refit on every peer (receivers first) without waiting for the results.
    pub async fn start_refit(&mut self, version: u64) -> anyhow::Result<()> {
        for n in self.receivers.clone().iter().chain(self.senders.clone().iter()) {
            self.command(n, &format!("refit {version}")).await?;
        }
        Ok(())
    }

    /// Collects every peer's result of a refit started with [`Harness::start_refit`].
    pub async fn finish_refit(&mut self) -> anyhow::Result<Round> {
        let mut senders = Vec::new();
        for n in self.senders.clone() {
            senders.push(self.next_event(&n).await?);
        }
        let mut receivers = Vec::new();
        for n in self.receivers.clone() {
            receivers.push(self.next_event(&n).await?);
        }
        Ok(Round { senders, receivers })
    }

    /// One refit of `version` on every peer.
    pub async fn refit(&mut self, version: u64) -> anyhow::Result<Round> {
        self.start_refit(version).await?;
        self.finish_refit().await
    }

    /// One raw reference stream (sender → first receiver); returns the sender's seconds.
    pub async fn raw(&mut self) -> anyhow::Result<f64> {
        self.reference("raw").await
    }

    /// The same stream with every 256 KiB record tagged and checked as the refit's are (helper
    /// threads on both sides, no copy).
    pub async fn tagged(&mut self) -> anyhow::Result<f64> {
        self.reference("tagged").await
    }

    /// The same stream in writes and reads of one record each, without tags: with
    /// [`Harness::tagged`], the cost of frame authentication alone.
    pub async fn chunked(&mut self) -> anyhow::Result<f64> {
        self.reference("chunked").await
    }

    async fn reference(&mut self, kind: &str) -> anyhow::Result<f64> {
        let (s, r) = (self.senders[0].clone(), self.receivers[0].clone());
        self.command(&r, kind).await?;
        self.command(&s, kind).await?;
        let e = self.next_event(&s).await?;
        self.next_event(&r).await?;
        e.secs.with_context(|| format!("{s} reported no {kind} time: {e:?}"))
    }

    /// Kills a peer (SIGKILL) and reaps it.
    pub async fn kill(&mut self, name: &str) -> anyhow::Result<()> {
        let p = self.peer(name)?;
        p.child.kill().await?;
        Ok(())
    }

    /// Starts a killed peer again with the same arguments; waits for its first event.
    pub async fn respawn(&mut self, name: &str) -> anyhow::Result<()> {
        let args = self.peer(name)?.args.clone();
        let fresh = self.start_peer(name, args)?;
        *self.peer(name)? = fresh;
        Ok(())
    }

    /// Tells every peer to quit and waits for them.
    pub async fn quit(mut self) -> anyhow::Result<()> {
        for p in &mut self.peers {
            let _ = p.stdin.write_all(b"quit\n").await;
            let _ = p.stdin.flush().await;
        }
        for p in &mut self.peers {
            let _ = tokio::time::timeout(Duration::from_secs(10), p.child.wait()).await;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The benchmark.

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] } else { (v[m - 1] + v[m]) / 2.0 }
}

/// The benchmark's results.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Model preset.
    pub model: String,
    /// Tensors in the manifest.
    pub tensors: usize,
    /// Bytes per refit.
    pub bytes: u64,
    /// Receivers.
    pub receivers: u32,
    /// Senders.
    pub senders: u32,
    /// Buffers per stream.
    pub buffers: u32,
    /// Bucket size.
    pub bucket_bytes: u64,
    /// Buckets per refit (first stream).
    pub buckets: u32,
    /// Timed iterations.
    pub iters: u32,
    /// Median seconds per refit.
    pub refit_secs: f64,
    /// bytes / refit_secs, in GB/s.
    pub refit_gbps: f64,
    /// receivers × bytes / refit_secs, in GB/s.
    pub delivered_gbps: f64,
    /// Median seconds of the raw stream (None for sharded runs).
    pub raw_secs: Option<f64>,
    /// bytes / raw_secs, in GB/s.
    pub raw_gbps: Option<f64>,
    /// raw_secs / refit_secs.
    pub ratio_to_raw: Option<f64>,
    /// Median seconds of the tagged reference stream (None for sharded runs).
    pub tagged_secs: Option<f64>,
    /// raw_secs / tagged_secs.
    pub tagged_to_raw: Option<f64>,
    /// Median seconds of the same stream in untagged records (None for sharded runs).
    pub chunked_secs: Option<f64>,
    /// chunked_secs / tagged_secs: what tagging every record leaves of the speed of the same
    /// stream, cut alike, without tags.
    pub tagged_to_chunked: Option<f64>,
    /// The sender's phase timings of the median refit.
    pub sender_stats: RefitStats,
    /// The first receiver's phase timings of the median refit.
    pub receiver_stats: RefitStats,
    /// Receivers × refits whose checksums were verified.
    pub verified: u32,
}

/// Runs the benchmark.
pub fn run(args: Args) -> anyhow::Result<()> {
    let gpu = match args.transport {
        TransportArg::Tcp => None,
        TransportArg::Nccl => Some(super::gpu::GpuTransport::Nccl),
        TransportArg::CudaIpc => Some(super::gpu::GpuTransport::CudaIpc),
        TransportArg::Auto => Some(super::gpu::GpuTransport::Auto),
    };
    if let Some(transport) = gpu {
        if args.receivers.len() != 1 || args.receivers[0] == 0 {
            bail!("--receivers: GPU transports take one group size of at least 1 (e.g. --receivers 2)");
        }
        let mut g = super::gpu::GpuBenchArgs::new(rlplane_api::spec::ModelSpec::preset(args.model));
        g.transport = transport;
        g.receivers = args.receivers[0];
        g.tp = if args.source == SourceArg::Sharded { args.tp } else { 1 };
        g.colocated = args.colocated;
        g.buffers = args.buffers;
        g.bucket_bytes = args.bucket_bytes;
        g.iters = args.iters;
        g.warmup = args.warmup;
        g.timeout_seconds = args.timeout_seconds;
        return super::gpu::run(g);
    }
    if args.receivers.is_empty() || args.receivers.contains(&0) {
        bail!("--receivers: every group size must be at least 1 (e.g. --receivers 1,3,7)");
    }
    if args.iters == 0 || args.rounds == 0 {
        bail!("--iters and --rounds must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let reports = rt.block_on(bench(&args))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(());
    }
    for report in &reports {
        print_report(report);
    }
    if reports.len() > 1 {
        let base = &reports[0];
        let ratios: Vec<String> = reports[1..]
            .iter()
            .map(|r| format!("R={}: {:.2}", r.receivers, r.delivered_gbps / base.delivered_gbps))
            .collect();
        println!("delivered rate relative to R={}: {}", base.receivers, ratios.join(", "));
    }
    Ok(())
}

fn print_report(report: &BenchReport) {
    let gb = report.bytes as f64 / 1e9;
    println!(
        "refit bench: model {} ({} tensors, {gb:.2} GB), transport tcp, {} sender(s) → {} receiver(s), {} buffers \
         of {} bytes ({} buckets), {} timed refits",
        report.model,
        report.tensors,
        report.senders,
        report.receivers,
        report.buffers,
        report.bucket_bytes,
        report.buckets,
        report.iters
    );
    if let (Some(secs), Some(gbps)) = (report.raw_secs, report.raw_gbps) {
        println!("  raw loopback stream (sender → first receiver): {secs:.4} s median, {gbps:.2} GB/s");
    }
    if let (Some(secs), Some(raw)) = (report.chunked_secs, report.raw_secs) {
        let gbps = report.bytes as f64 / secs / 1e9;
        let ratio = raw / secs;
        println!(
            "  the same stream in 256 KiB records, untagged: {secs:.4} s median, {gbps:.2} GB/s, {ratio:.3} × raw"
        );
    }
    if let (Some(secs), Some(ratio)) = (report.tagged_secs, report.tagged_to_chunked) {
        let gbps = report.bytes as f64 / secs / 1e9;
        println!(
            "  the same records, each tagged and checked: {secs:.4} s median, {gbps:.2} GB/s, {ratio:.3} × untagged records"
        );
    }
    println!(
        "  refit: {:.4} s median per refit, {:.2} GB/s{}; delivered {:.2} GB/s (receivers × bytes / time)",
        report.refit_secs,
        report.refit_gbps,
        report.ratio_to_raw.map(|r| format!(", {r:.2} × raw")).unwrap_or_default(),
        report.delivered_gbps
    );
    let s = &report.sender_stats;
    let r = &report.receiver_stats;
    println!(
        "  sender: transfer {:.4} s, pack {:.4} s, buffer wait {:.4} s, acknowledgement {:.4} s; {} bytes direct, {} staged",
        s.transfer_secs, s.pack_secs, s.buffer_wait_secs, s.end_secs, s.direct_bytes, s.staged_bytes
    );
    println!(
        "  first receiver: transfer {:.4} s, unpack {:.4} s, buffer wait {:.4} s; {} bytes direct, {} staged",
        r.transfer_secs, r.unpack_secs, r.buffer_wait_secs, r.direct_bytes, r.staged_bytes
    );
    println!("  checksums: {} receiver refits verified (outside the timed region)", report.verified);
}

/// Timed samples of one group size.
#[derive(Default)]
struct Samples {
    raws: Vec<f64>,
    tagged: Vec<f64>,
    chunked: Vec<f64>,
    refits: Vec<Round>,
    verified: u32,
    senders: u32,
    buckets: u32,
}

async fn bench(args: &Args) -> anyhow::Result<Vec<BenchReport>> {
    let mut o = HarnessOptions::new(crate::proc::self_exe()?, ModelSpec::preset(args.model));
    o.buffers = args.buffers;
    o.bucket_bytes = args.bucket_bytes;
    o.align_bytes = args.align_bytes;
    o.timeout_seconds = args.timeout_seconds;
    o.staging = args.stream.staging;
    o.tcp = TcpOptions { relay_chunk_bytes: args.stream.relay_chunk_bytes, fanout: args.stream.fanout };
    o.seed = args.stream.seed;
    (o.source, o.tp, o.pp) = match args.source {
        SourceArg::Gathered => (RefitSource::Gathered, 1, 1),
        SourceArg::Sharded => (RefitSource::Sharded, args.tp, args.pp),
    };
    o.raw = true;
    let mut samples: Vec<Samples> = args.receivers.iter().map(|_| Samples::default()).collect();
    let mut version = 0u64;
    let mut bytes = 0;
    let mut tensors = 0;
    for _ in 0..args.rounds {
        for (i, &receivers) in args.receivers.iter().enumerate() {
            let mut h = Harness::start(HarnessOptions { receivers, ..o.clone() }).await?;
            let raw_enabled = h.senders().len() == 1;
            let s = &mut samples[i];
            s.senders = h.senders().len() as u32;
            bytes = h.manifest_bytes();
            tensors = h.plan.manifest().len();
            // Iteration 0 warms up (the first write faults the fresh destination pages in).
            for iter in 0..=args.iters {
                version += 1;
                if raw_enabled {
                    let (raw, chunked, tagged) = (h.raw().await?, h.chunked().await?, h.tagged().await?);
                    if iter > 0 {
                        s.raws.push(raw);
                        s.chunked.push(chunked);
                        s.tagged.push(tagged);
                    }
                }
                let round = h.refit(version).await?;
                if !round.all_ok() {
                    bail!("refit {version} failed: {}", round.describe_failures());
                }
                s.verified += round.receivers.len() as u32;
                s.buckets = round.senders[0].stats.as_ref().map_or(0, |st| st.buckets);
                if iter > 0 {
                    s.refits.push(round);
                }
            }
            h.quit().await?;
        }
    }
    let mut reports = Vec::new();
    for (s, &receivers) in samples.iter_mut().zip(&args.receivers) {
        let mut secs: Vec<f64> = s.refits.iter().map(Round::secs).collect();
        let refit_secs = median(&mut secs);
        let median_round = s
            .refits
            .iter()
            .min_by(|a, b| (a.secs() - refit_secs).abs().total_cmp(&(b.secs() - refit_secs).abs()))
            .expect("at least one refit");
        let raw_secs = (!s.raws.is_empty()).then(|| median(&mut s.raws));
        let tagged_secs = (!s.tagged.is_empty()).then(|| median(&mut s.tagged));
        let chunked_secs = (!s.chunked.is_empty()).then(|| median(&mut s.chunked));
        reports.push(BenchReport {
            model: args.model.to_string(),
            tensors,
            bytes,
            receivers,
            senders: s.senders,
            buffers: args.buffers,
            bucket_bytes: args.bucket_bytes,
            buckets: s.buckets,
            iters: s.refits.len() as u32,
            refit_secs,
            refit_gbps: bytes as f64 / refit_secs / 1e9,
            delivered_gbps: receivers as f64 * bytes as f64 / refit_secs / 1e9,
            raw_secs,
            raw_gbps: raw_secs.map(|r| bytes as f64 / r / 1e9),
            ratio_to_raw: raw_secs.map(|r| r / refit_secs),
            tagged_secs,
            tagged_to_raw: raw_secs.zip(tagged_secs).map(|(r, t)| r / t),
            chunked_secs,
            tagged_to_chunked: chunked_secs.zip(tagged_secs).map(|(c, t)| c / t),
            sender_stats: median_round.senders[0].stats.clone().unwrap_or_default(),
            receiver_stats: median_round.receivers[0].stats.clone().unwrap_or_default(),
            verified: s.verified,
        });
    }
    Ok(reports)
}
