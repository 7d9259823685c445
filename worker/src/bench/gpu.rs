//! `rlplane bench refit --transport nccl|cuda-ipc|auto`: refit between GPU processes, against
//! ceilings measured in the same run between the same processes.
//!
//! Scenarios (each rank its own process, as in a job):
//! - **split**: a sender on GPU 0 holding the whole model, receivers on GPUs 1..=R. Ceiling: one
//!   raw NCCL broadcast of a 1 GiB buffer among the same processes. With `--transport cuda-ipc`
//!   the receivers copy over NVLink with the copy engines; `auto` measures both and keeps the
//!   faster.
//! - **colocated** (`--colocated`): the trainer and generation processes share GPU 0; CUDA IPC,
//!   direct (one copy) and staged (the fallback: pack into exported buffers, copy out). Ceiling:
//!   one device-to-device copy of the same total bytes.
//! - **sharded** (`--tp N`): N trainer ranks hold tensor-parallel shards and each broadcasts its
//!   own to the R receivers concurrently. Baselines, same run: a raw NCCL broadcast of the same
//!   bytes from one root (the receivers' ingress ceiling) and gather-then-broadcast, sequential
//!   and with 8 overlapped chunks.
//!
//! The parent drives the peers over stdin/stdout (one JSON line each way per operation); every
//! peer times its own part with the GPU synchronized, and an operation's time is the slowest
//! peer's. Checksums (per-segment digests on the GPU) are verified after the timed refits.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rlplane_api::model::manifest_bytes;
use rlplane_api::plan::{ProcessRole, WorkerPlan};
use rlplane_api::spec::{Device, Mode, ModelSpec, RLJobSpec, RefitSource, RefitVerify};
use rlplane_api::topology::{JobIdentity, build_plan};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::control::monotonic_ns;
use crate::gpu::nccl::{Comm, UniqueId};
use crate::gpu::tensors::DeviceTensors;
use crate::gpu::{DeviceBuffer, Gpu, GpuError, copy_async};
use crate::refit::TransportKind as Kind;
use crate::refit::verify::segment_id;
use crate::refit::{self, RefitPlan};
use crate::roles::refit_side::{self, Receiver, Sender, Side as VerifySide, Weights};

/// GPU transports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum GpuTransport {
    /// NCCL broadcast.
    Nccl,
    /// CUDA IPC with copy-engine copies.
    CudaIpc,
    /// Measure both (where both apply) and keep the faster.
    Auto,
}

/// Settings of a GPU refit benchmark.
#[derive(Clone, Debug)]
pub struct GpuBenchArgs {
    /// Transport.
    pub transport: GpuTransport,
    /// Model.
    pub model: ModelSpec,
    /// Receivers.
    pub receivers: u32,
    /// Trainer tensor-parallel senders (sharded when > 1).
    pub tp: u32,
    /// Trainer and generation share GPU 0.
    pub colocated: bool,
    /// Staging buffers.
    pub buffers: u32,
    /// Bucket bytes.
    pub bucket_bytes: u64,
    /// Timed iterations.
    pub iters: u32,
    /// Untimed warm-up iterations.
    pub warmup: u32,
    /// Also write the results as JSON here.
    pub json: Option<PathBuf>,
    /// The `rlplane` binary to run peers with (default: this executable).
    pub bin: Option<PathBuf>,
    /// spec.refit.timeoutSeconds.
    pub timeout_seconds: u32,
    /// Also measure the refit check (`spec.refit.verify` Full and Sampled) on a receiver,
    /// against one plain read of the model's bytes on its GPU.
    pub verify: bool,
}

impl GpuBenchArgs {
    /// Defaults for `model`: split over NCCL to one receiver, 1 GiB buckets, 2 buffers.
    pub fn new(model: ModelSpec) -> GpuBenchArgs {
        GpuBenchArgs {
            transport: GpuTransport::Nccl,
            model,
            receivers: 1,
            tp: 1,
            colocated: false,
            buffers: 2,
            bucket_bytes: 1 << 30,
            iters: 10,
            warmup: 3,
            json: None,
            bin: None,
            timeout_seconds: 120,
            verify: true,
        }
    }

    /// GPUs the scenario needs.
    pub fn gpus_needed(&self) -> usize {
        if self.colocated { 1 } else { (self.tp.max(1) + self.receivers) as usize }
    }
}

/// Arguments of a GPU peer process.
#[derive(Debug, Clone, clap::Args)]
pub struct PeerArgs {
    /// The bench's plan.
    #[arg(long)]
    pub plan: PathBuf,
    /// This process's name in the plan.
    #[arg(long)]
    pub process: String,
    /// Physical GPU.
    #[arg(long)]
    pub gpu: u32,
}

#[derive(Debug, Serialize, Deserialize)]
enum Op {
    /// Create a unique id for communicator `group` (its root).
    MakeId { group: String },
    /// Join communicator `group`.
    Join { group: String, id: Vec<u8>, rank: usize, world: usize },
    /// Set up the refit transport.
    Connect { transport: GpuTransport, staged: bool },
    /// Rewrite the shard for `version` (untimed).
    Update { version: u64 },
    /// One refit (timed), started at `at_ns` on the host's monotonic clock when given (every
    /// peer at once).
    Refit { version: u64, at_ns: Option<u64> },
    /// Digest of what this rank sends or holds, for `version` under `verify` (timed).
    Digest { version: u64, verify: RefitVerify },
    /// One read of `bytes` of device memory (timed): the read-bandwidth ceiling of the digest.
    Read { bytes: u64 },
    /// One raw broadcast of `bytes` on communicator `group` (timed).
    Raw { group: String, bytes: u64 },
    /// One device-to-device copy of `bytes` (timed).
    D2d { bytes: u64 },
    /// One device-to-device copy per piece of `sizes` (the model's tensors), issued on `streams`
    /// streams in turn as the colocated refit issues them (timed): the copies without the
    /// refit's control messages.
    D2dPieces { sizes: Vec<u64>, streams: u32 },
    /// Gather the second half onto the root, then broadcast everything (timed).
    GatherBroadcast { total: u64, chunks: u32, overlapped: bool },
    /// Drop the refit transport.
    Disconnect,
    /// Report the weights' state (receivers).
    State,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Reply {
    ok: bool,
    error: Option<String>,
    secs: f64,
    digest: Option<u64>,
    id: Option<Vec<u8>>,
    state: Option<String>,
    /// A refit's entry and exit on the host's monotonic clock (one clock for every process of
    /// the host), so the bench can place the peers' phases on one timeline.
    start_ns: u64,
    end_ns: u64,
    /// A refit's own phases, seconds: begin (announcing or awaiting the start), transfer, end.
    phases: [f64; 3],
}

/// One measured line of the results.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// What was measured.
    pub what: String,
    /// Bytes each receiver got.
    pub bytes: u64,
    /// Median seconds.
    pub secs: f64,
    /// GB/s (bytes ÷ seconds).
    pub gbps: f64,
    /// The fastest and the slowest timed run, in seconds (the spread around the median; zero in
    /// ratio rows).
    pub min_secs: f64,
    /// See `min_secs`.
    pub max_secs: f64,
}

impl Row {
    /// The row as one line of the results table. Ratio rows (indented, the ratio in `gbps`)
    /// print only the ratio.
    pub fn line(&self) -> String {
        if self.what.starts_with("  ") {
            format!("{:<72} {:>33.3}", self.what, self.gbps)
        } else {
            format!(
                "{:<72} {:>14} {:>9.2} {:>8.1}   {:.2}–{:.2}",
                self.what,
                self.bytes,
                self.secs * 1e3,
                self.gbps,
                self.min_secs * 1e3,
                self.max_secs * 1e3
            )
        }
    }

    /// A ratio row: `value` printed alone.
    fn ratio(what: String, value: f64) -> Row {
        Row { what, bytes: 0, secs: 0.0, gbps: value, min_secs: 0.0, max_secs: 0.0 }
    }
}

struct Peer {
    name: String,
    child: Child,
    stdin: ChildStdin,
    stdout: tokio::io::Lines<BufReader<ChildStdout>>,
}

impl Peer {
    async fn send(&mut self, op: &Op) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(op)?;
        line.push(b'\n');
        self.stdin.write_all(&line).await.with_context(|| format!("sending to {}", self.name))?;
        Ok(())
    }

    async fn reply(&mut self) -> anyhow::Result<Reply> {
        let line = self
            .stdout
            .next_line()
            .await?
            .with_context(|| format!("{} exited: {:?}", self.name, self.child.try_wait()))?;
        let r: Reply = serde_json::from_str(&line).with_context(|| format!("{} answered {line:?}", self.name))?;
        if !r.ok {
            bail!("{}: {}", self.name, r.error.unwrap_or_default());
        }
        Ok(r)
    }
}

/// Sends `op` to every peer in `who`, then collects their replies.
async fn all(peers: &mut [Peer], who: &[usize], op: impl Fn(usize) -> Op) -> anyhow::Result<Vec<Reply>> {
    for &i in who {
        peers[i].send(&op(i)).await?;
    }
    let mut out = Vec::new();
    for &i in who {
        out.push(peers[i].reply().await?);
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// Runs the benchmark and prints its table.
pub fn run(args: GpuBenchArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let rows = rt.block_on(launch(&args))?;
    print_rows(&args, &rows)
}

fn print_rows(args: &GpuBenchArgs, rows: &[Row]) -> anyhow::Result<()> {
    println!("{:<72} {:>14} {:>9} {:>8}   min–max ms", "measurement", "bytes/receiver", "ms", "GB/s");
    for r in rows {
        println!("{}", r.line());
    }
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(rows)?)?;
    }
    Ok(())
}

fn bench_spec(args: &GpuBenchArgs) -> RLJobSpec {
    let mode = if args.colocated { Mode::Colocated } else { Mode::Split };
    let tp = args.tp.max(1);
    let mut spec: RLJobSpec = serde_json::from_value(serde_json::json!({
        "mode": mode,
        "device": "Gpu",
        "model": args.model,
        "trainer": {"nodes": 1, "gpusPerNode": tp, "parallelism": {"tensor": tp}},
        "generation": {"engines": if args.colocated { tp } else { args.receivers }, "tensorParallel": 1},
        "workload": {"promptsPerStep": 64}
    }))
    .expect("a valid bench spec");
    spec.device = Device::Gpu;
    spec.refit.buffer_bytes = Some(args.bucket_bytes);
    spec.refit.num_buffers = args.buffers;
    spec.refit.source = RefitSource::Sharded;
    spec.refit.timeout_seconds = args.timeout_seconds;
    spec
}

/// Everything a launched benchmark holds.
pub struct Launched {
    plan: WorkerPlan,
    peers: Vec<Peer>,
    dir: PathBuf,
    senders: usize,
}

impl Drop for Launched {
    fn drop(&mut self) {
        for p in &mut self.peers {
            let _ = p.child.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts the peers of a benchmark (senders first, then receivers).
pub async fn start(args: &GpuBenchArgs) -> anyhow::Result<Launched> {
    let info = crate::gpu::probe()?;
    let version = crate::gpu::nccl_version().ok();
    eprintln!(
        "{} GPU(s): {} ({:.0} GiB); NCCL {}",
        info.devices,
        info.name,
        info.memory as f64 / (1u64 << 30) as f64,
        version.map(|v| v.to_string()).unwrap_or_else(|| "not loaded".into())
    );
    let spec = bench_spec(args);
    let dir = std::env::temp_dir().join(format!("rlplane-gpubench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let addressing = crate::local::LocalAddressing::new(&dir);
    let id = JobIdentity {
        name: "bench".into(),
        namespace: "bench".into(),
        uid: format!("bench-{}", std::process::id()),
        epoch: 0,
        resume: None,
    };
    let mut plan = build_plan(&spec, &id, &addressing).map_err(|e| anyhow::anyhow!("{e}"))?;
    drop(addressing);
    for pod in &plan.pods {
        std::fs::create_dir_all(&pod.ipc_dir)?;
    }
    // The peers authenticate with a fresh key in the bench's directory.
    let key_path = dir.join("job.key");
    crate::net::issue_key_file(&key_path)?;
    plan.job.key_file = key_path.display().to_string();
    let plan_path = dir.join("plan.json");
    std::fs::write(&plan_path, plan.to_json())?;
    let bases = crate::local::gpu_bases(&plan, if args.colocated { usize::MAX } else { info.devices })?;
    let library = crate::gpu::nccl_library_dir(&dir);

    // Peers: senders first, then receivers.
    let group = &plan.refit_groups[0];
    let members: Vec<u32> = group.senders.iter().chain(&group.receivers).copied().collect();
    let mut peers = Vec::new();
    for &m in &members {
        let p = plan.process(m);
        let gpu = bases[p.pod as usize] + p.gpu.unwrap_or(0);
        let mut cmd = match &args.bin {
            Some(bin) => {
                let mut c = tokio::process::Command::new(bin);
                crate::proc::supervise(&mut c);
                c
            }
            None => crate::proc::self_command(std::iter::empty::<&str>())?,
        };
        cmd.args([
            "peer".as_ref(),
            "gpu".as_ref(),
            "--plan".as_ref(),
            plan_path.as_os_str(),
            "--process".as_ref(),
            p.name.as_ref(),
            "--gpu".as_ref(),
            gpu.to_string().as_ref(),
        ]);
        if let Some(l) = &library {
            cmd.env("LD_LIBRARY_PATH", crate::gpu::library_path_with(l));
        }
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = cmd.spawn().with_context(|| format!("starting {}", p.name))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped")).lines();
        peers.push(Peer { name: p.name.clone(), child, stdin, stdout });
    }
    let senders = group.senders.len();
    Ok(Launched { plan, peers, dir, senders })
}

/// Runs a whole benchmark: ceilings, refits (checksums verified), baselines, ratios.
pub async fn launch(args: &GpuBenchArgs) -> anyhow::Result<Vec<Row>> {
    let mut l = start(args).await?;
    let plan = l.plan.clone();
    let s = l.senders;
    let peers = l.peers.as_mut_slice();
    let senders: Vec<usize> = (0..s).collect();
    let everyone: Vec<usize> = (0..peers.len()).collect();
    let receivers: Vec<usize> = (s..peers.len()).collect();
    let model_bytes = manifest_bytes(&plan.manifest());
    let mut rows = Vec::new();
    let mut copy_rows = Vec::new();
    let timed = |replies: &[Reply]| replies.iter().map(|r| r.secs).fold(0.0, f64::max);
    let iters = args.iters.max(1);

    // A raw-broadcast communicator: sender 0 and the receivers (not in colocated mode: NCCL does
    // not put two ranks on one GPU).
    let raw_members: Vec<usize> = std::iter::once(0).chain(receivers.iter().copied()).collect();
    if !args.colocated {
        make_comm(peers, "raw", &raw_members).await?;
    }
    if args.tp > 1 {
        make_comm(peers, "gather", &[0, 1]).await?;
    }

    // Ceilings.
    if args.colocated {
        let mut t = Vec::new();
        for i in 0..args.warmup + iters {
            let r = all(peers, &[0], |_| Op::D2d { bytes: model_bytes }).await?;
            if i >= args.warmup {
                t.push(timed(&r));
            }
        }
        rows.push(row("ceiling: one device-to-device copy of the model", model_bytes, t));
        // Where a refit's time goes beyond that copy: the same bytes as one copy per tensor,
        // without any control message.
        let sizes: Vec<u64> = plan.manifest().iter().map(|t| t.size_bytes()).collect();
        for streams in [1, 2, 4] {
            let mut t = Vec::new();
            for i in 0..args.warmup + iters {
                let r = all(peers, &[0], |_| Op::D2dPieces { sizes: sizes.clone(), streams }).await?;
                if i >= args.warmup {
                    t.push(timed(&r));
                }
            }
            let what = format!("reference: one device copy per tensor, {streams} stream(s) ({} copies)", sizes.len());
            copy_rows.push(row(&what, model_bytes, t));
        }
    } else {
        let ceiling_bytes = if args.tp > 1 { model_bytes } else { 1 << 30 };
        let mut t = Vec::new();
        for i in 0..args.warmup + iters.max(10) {
            let r = all(peers, &raw_members, |_| Op::Raw { group: "raw".into(), bytes: ceiling_bytes }).await?;
            if i >= args.warmup {
                t.push(timed(&r));
            }
        }
        let what = if args.tp > 1 {
            format!("ceiling: raw NCCL broadcast of the model's bytes, 1 root → {} receivers", receivers.len())
        } else {
            format!("ceiling: raw NCCL broadcast of 1 GiB, 1 → {}", receivers.len())
        };
        rows.push(row(&what, ceiling_bytes, t));
    }

    // Refit variants.
    let mut variants: Vec<(GpuTransport, bool)> = match (args.transport, args.colocated) {
        (_, true) => vec![(GpuTransport::CudaIpc, false), (GpuTransport::CudaIpc, true)],
        (GpuTransport::Auto, false) => vec![(GpuTransport::Nccl, false), (GpuTransport::CudaIpc, false)],
        (t, false) => vec![(t, false)],
    };
    if args.tp > 1 {
        variants.retain(|(t, _)| *t == GpuTransport::Nccl || args.transport == GpuTransport::CudaIpc);
    }
    let mut version = 0u64;
    let mut phase_rows = Vec::new();
    let mut best: Option<(String, f64)> = None;
    for (transport, staged) in variants {
        all(peers, &everyone, |_| Op::Connect { transport, staged }).await?;
        let mut t = Vec::new();
        let mut timelines = Vec::new();
        for i in 0..args.warmup + iters {
            version += 1;
            all(peers, &senders, |_| Op::Update { version }).await?;
            let at_ns = Some(monotonic_ns() + START_LEAD.as_nanos() as u64);
            let r = all(peers, &everyone, |_| Op::Refit { version, at_ns }).await?;
            if i >= args.warmup {
                t.push(timed(&r));
                timelines.push(Timeline::of(&r[..s], &r[s..]));
            }
        }
        // Verify every byte of the last refit, outside the timed region.
        check_received(peers, &senders, &receivers, version, RefitVerify::Full).await?;
        all(peers, &everyone, |_| Op::Disconnect).await?;
        let name = match (transport, staged, args.tp > 1) {
            (GpuTransport::Nccl, _, true) => {
                format!("refit, sharded: {} senders × NCCL → {} receivers", args.tp, receivers.len())
            }
            (GpuTransport::Nccl, _, false) => {
                format!("refit over NCCL, grouped direct broadcasts → {}", receivers.len())
            }
            (_, false, _) if args.colocated => "refit over CUDA IPC, same GPU, direct (1 copy)".into(),
            (_, true, _) => "refit over CUDA IPC, same GPU, staged (2 copies)".into(),
            _ => format!("refit over CUDA IPC copy engines → {}", receivers.len()),
        };
        let m = median(t.clone());
        if !staged && best.as_ref().is_none_or(|(_, b)| m < *b) {
            best = Some((name.clone(), m));
        }
        rows.push(row(&format!("{name} (checksums verified)"), model_bytes, t));
        phase_rows.extend(Timeline::rows(&name, &timelines));
    }
    if args.transport == GpuTransport::Auto
        && !args.colocated
        && let Some((name, _)) = &best
    {
        eprintln!("auto picks: {name}");
    }

    // Sharded baselines: gather onto trainer rank 0, then broadcast.
    if args.tp > 1 {
        let gb: Vec<usize> = std::iter::once(0).chain(std::iter::once(1)).chain(receivers.iter().copied()).collect();
        for overlapped in [false, true] {
            let mut t = Vec::new();
            for i in 0..args.warmup + iters {
                let r = all(peers, &gb, |_| Op::GatherBroadcast { total: model_bytes, chunks: 8, overlapped }).await?;
                if i >= args.warmup {
                    t.push(timed(&r));
                }
            }
            let what = if overlapped {
                "gather-then-broadcast, 8 overlapped chunks".to_string()
            } else {
                "gather-then-broadcast, sequential".to_string()
            };
            rows.push(row(&what, model_bytes, t));
        }
    }

    // The refit check's cost (what `spec.refit.verify` adds to a refit), on the first receiver,
    // against one plain read of the model's bytes on its GPU in the same run.
    let mut verify_rows = Vec::new();
    if args.verify {
        let first = receivers[..1].to_vec();
        let mut read = Vec::new();
        for i in 0..args.warmup + iters {
            let r = all(peers, &first, |_| Op::Read { bytes: model_bytes }).await?;
            if i >= args.warmup {
                read.push(timed(&r));
            }
        }
        verify_rows.push(row("ceiling: one read of the model's bytes on a receiver's GPU", model_bytes, read));
        for verify in [RefitVerify::Full, RefitVerify::Sampled] {
            let mut t = Vec::new();
            for i in 0..args.warmup + iters {
                let r = check_received(peers, &senders, &first, version, verify).await?;
                if i >= args.warmup {
                    t.push(r);
                }
            }
            verify_rows.push(row(&format!("refit check, verify: {verify:?}, on a receiver"), model_bytes, t));
        }
    }

    // Ratios.
    let ceiling = rows[0].gbps;
    let mut ratio_rows = Vec::new();
    for r in &rows[1..] {
        ratio_rows.push(Row::ratio(format!("  ratio: {} ÷ ceiling", short(&r.what)), r.gbps / ceiling));
    }
    if args.colocated && rows.len() >= 3 {
        ratio_rows.push(Row::ratio("  ratio: direct ÷ staged".into(), rows[2].secs / rows[1].secs));
    }
    if args.tp > 1 && rows.len() >= 4 {
        let ours = rows[1].secs;
        ratio_rows.push(Row::ratio("  speed-up: sharded ÷ sequential gather".into(), rows[2].secs / ours));
        ratio_rows.push(Row::ratio("  speed-up: sharded ÷ overlapped gather".into(), rows[3].secs / ours));
    }
    if let [read, full, sampled] = &verify_rows[..] {
        let refit = rows[1].secs;
        ratio_rows.push(Row::ratio("  ratio: verify Full's GB/s ÷ the GPU's read GB/s".into(), full.gbps / read.gbps));
        for (r, name) in [(full, "Full"), (sampled, "Sampled")] {
            ratio_rows.push(Row::ratio(
                format!("  ratio: verify {name} ÷ the refit it checks ({})", short(&rows[1].what)),
                r.secs / refit,
            ));
        }
    }
    for r in &copy_rows {
        ratio_rows
            .push(Row::ratio(format!("  ratio: {} ÷ {}", short(&rows[1].what), short(&r.what)), r.secs / rows[1].secs));
    }
    rows.extend(copy_rows);
    rows.extend(phase_rows);
    rows.extend(verify_rows);
    rows.extend(ratio_rows);
    Ok(rows)
}

/// Has the senders digest version `version` and every receiver in `receivers` digest what it
/// holds, under `verify`; fails naming a receiver whose digest differs. Returns the slowest
/// receiver's digest time.
async fn check_received(
    peers: &mut [Peer],
    senders: &[usize],
    receivers: &[usize],
    version: u64,
    verify: RefitVerify,
) -> anyhow::Result<f64> {
    let sent = all(peers, senders, |_| Op::Digest { version, verify })
        .await?
        .iter()
        .fold(0u64, |a, r| a.wrapping_add(r.digest.unwrap_or(0)));
    let got = all(peers, receivers, |_| Op::Digest { version, verify }).await?;
    for (k, r) in got.iter().enumerate() {
        if r.digest != Some(sent) {
            bail!(
                "{} received bytes that do not match what was sent ({:?} vs {sent:#x}, verify {verify:?})",
                peers[receivers[k]].name,
                r.digest
            );
        }
    }
    Ok(got.iter().map(|r| r.secs).fold(0.0, f64::max))
}

/// Kills the (first) sender while a refit is on the wire and checks that every receiver fails
/// within the refit timeout and holds `Incomplete(version)`. Returns what happened, in words.
pub async fn kill_sender_mid_refit(args: &GpuBenchArgs, kill_after: Duration) -> anyhow::Result<String> {
    let mut l = start(args).await?;
    let n = l.peers.len();
    let everyone: Vec<usize> = (0..n).collect();
    let senders: Vec<usize> = (0..l.senders).collect();
    let transport = args.transport;
    all(&mut l.peers, &everyone, |_| Op::Connect { transport, staged: false }).await?;
    all(&mut l.peers, &senders, |_| Op::Update { version: 1 }).await?;
    all(&mut l.peers, &everyone, |_| Op::Refit { version: 1, at_ns: None }).await?;
    all(&mut l.peers, &senders, |_| Op::Update { version: 2 }).await?;
    for i in 0..n {
        l.peers[i].send(&Op::Refit { version: 2, at_ns: None }).await?;
    }
    tokio::time::sleep(kill_after).await;
    l.peers[0].child.start_kill()?;
    let killed = Instant::now();
    let mut out = Vec::new();
    for i in l.senders..n {
        let r = l.peers[i].reply().await;
        let took = killed.elapsed();
        let e =
            r.err().with_context(|| format!("{} finished refit 2 although its sender was killed", l.peers[i].name))?;
        if took > Duration::from_secs(args.timeout_seconds as u64 + 5) {
            bail!("{} took {took:?} to notice, more than the timeout", l.peers[i].name);
        }
        l.peers[i].send(&Op::State).await?;
        let state = l.peers[i].reply().await?.state.unwrap_or_default();
        if state != "Incomplete(2)" {
            bail!("{} holds {state} after a failed refit 2; expected Incomplete(2)", l.peers[i].name);
        }
        out.push(format!("{} failed after {took:.2?} ({e:#}) and holds {state}", l.peers[i].name));
    }
    Ok(out.join("\n"))
}

/// How far ahead of now the bench schedules a refit's start: long enough for every peer to have
/// read its operation (a pipe and a wake-up each, tens of microseconds).
const START_LEAD: Duration = Duration::from_millis(3);

/// Returns at `at_ns` on the host's monotonic clock: sleeps until shortly before, then spins, so
/// the peers given the same instant start within microseconds of each other and a refit's time
/// is not the bench's dispatch of its operation to one peer after the other.
fn wait_until(at_ns: u64) {
    let now = monotonic_ns();
    if at_ns > now + 300_000 {
        std::thread::sleep(Duration::from_nanos(at_ns - now - 300_000));
    }
    while monotonic_ns() < at_ns {
        std::hint::spin_loop();
    }
}

/// One refit placed on the host's clock: where its time goes between the processes, which each
/// peer's own timer cannot show (a receiver waiting for the start cannot tell the sender's late
/// arrival from a slow start message).
struct Timeline {
    /// From the last peer's entry to the last peer's exit: the refit once everyone is in it.
    span: f64,
    /// How much later the last peer entered than the first (the bench's dispatch, not the refit).
    skew: f64,
    /// From the sender's start announcement to the slowest receiver's having it (or its own
    /// entry, if later).
    start_trip: f64,
    /// The slowest receiver's transfer phase: its copies, issued as the buckets are announced.
    copies: f64,
    /// From the last receiver's exit to the sender's: the end confirmation's trip.
    end_trip: f64,
}

impl Timeline {
    fn of(senders: &[Reply], receivers: &[Reply]) -> Timeline {
        let secs = |ns: i128| ns as f64 / 1e9;
        let all = || senders.iter().chain(receivers);
        let first = all().map(|r| r.start_ns).min().unwrap_or(0);
        let last_in = all().map(|r| r.start_ns).max().unwrap_or(0);
        let last_out = all().map(|r| r.end_ns).max().unwrap_or(0);
        let announced = senders.iter().map(|r| r.start_ns as i128 + (r.phases[0] * 1e9) as i128).max().unwrap_or(0);
        let started = receivers.iter().map(|r| r.start_ns as i128 + (r.phases[0] * 1e9) as i128).max().unwrap_or(0);
        let receivers_out = receivers.iter().map(|r| r.end_ns).max().unwrap_or(0);
        let senders_out = senders.iter().map(|r| r.end_ns).max().unwrap_or(0);
        Timeline {
            span: secs(last_out as i128 - last_in as i128),
            skew: secs(last_in as i128 - first as i128),
            start_trip: secs((started - announced).max(0)),
            copies: receivers.iter().map(|r| r.phases[1]).fold(0.0, f64::max),
            end_trip: secs((senders_out as i128 - receivers_out as i128).max(0)),
        }
    }

    /// Rows for a refit variant's timed runs (median and spread of each part).
    fn rows(name: &str, runs: &[Timeline]) -> Vec<Row> {
        let part = |what: &str, f: fn(&Timeline) -> f64| {
            row(&format!("· {}: {what}", short(name)), 0, runs.iter().map(f).collect())
        };
        vec![
            part("from the last entry to the last exit", |t| t.span),
            part("peers' entry skew (bench dispatch)", |t| t.skew),
            part("start announced → receivers have it", |t| t.start_trip),
            part("receivers' transfer phase", |t| t.copies),
            part("receivers done → sender done", |t| t.end_trip),
        ]
    }
}

fn short(s: &str) -> &str {
    s.split(" (").next().unwrap_or(s)
}

/// A measured row from its timed runs: the median, and the fastest and slowest run.
fn row(what: &str, bytes: u64, runs: Vec<f64>) -> Row {
    let min_secs = runs.iter().copied().fold(f64::INFINITY, f64::min);
    let max_secs = runs.iter().copied().fold(0.0, f64::max);
    let secs = median(runs);
    Row {
        what: what.into(),
        bytes,
        secs,
        gbps: if secs > 0.0 { bytes as f64 / secs / 1e9 } else { 0.0 },
        min_secs: if min_secs.is_finite() { min_secs } else { 0.0 },
        max_secs,
    }
}

async fn make_comm(peers: &mut [Peer], group: &str, members: &[usize]) -> anyhow::Result<()> {
    peers[members[0]].send(&Op::MakeId { group: group.into() }).await?;
    let id = peers[members[0]].reply().await?.id.context("no NCCL id")?;
    let world = members.len();
    for (rank, &m) in members.iter().enumerate() {
        peers[m].send(&Op::Join { group: group.into(), id: id.clone(), rank, world }).await?;
    }
    for &m in members {
        peers[m].reply().await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The peer process.

enum Side {
    Sender { sender: Sender, pos: usize },
    Receiver(Receiver),
}

struct PeerState {
    plan: WorkerPlan,
    auth: crate::net::JobAuth,
    me: u32,
    gpu: Gpu,
    is_sender: bool,
    /// The shard plan (sender) or every sender's plan (receiver).
    plans: Vec<Arc<RefitPlan>>,
    memory: Weights,
    side: Option<Side>,
    comms: HashMap<String, Comm>,
    ids: HashMap<String, UniqueId>,
    flat: HashMap<&'static str, DeviceBuffer>,
}

/// Runs a GPU peer: reads operations on stdin, answers on stdout.
pub fn run_peer(args: PeerArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(peer_main(args))
}

async fn peer_main(args: PeerArgs) -> anyhow::Result<()> {
    let plan = WorkerPlan::load(&args.plan.display().to_string())?;
    let me = plan.process_index(&args.process).context("no such process")?;
    let gpu = Gpu::open(args.gpu as usize)?;
    let group = plan.refit_groups[0].clone();
    let is_sender = group.senders.contains(&me);
    let plans: Vec<Arc<RefitPlan>> = if is_sender {
        vec![Arc::new(refit::sender_plan(&plan, me)?)]
    } else {
        group.senders.iter().map(|&s| refit::sender_plan(&plan, s).map(Arc::new)).collect::<Result<_, _>>()?
    };
    let memory = Weights::Device(if is_sender {
        DeviceTensors::alloc(&gpu, plans[0].tensors().iter().map(|t| t.source_bytes))?
    } else {
        DeviceTensors::alloc(&gpu, plan.manifest().iter().map(|t| Some(t.size_bytes())))?
    });
    let mut st = PeerState {
        auth: crate::net::JobAuth::for_plan(&plan)?,
        plan,
        me,
        gpu,
        is_sender,
        plans,
        memory,
        side: None,
        comms: HashMap::new(),
        ids: HashMap::new(),
        flat: HashMap::new(),
    };
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut out = tokio::io::stdout();
    while let Some(line) = lines.next_line().await? {
        let op: Op = serde_json::from_str(&line).with_context(|| format!("bad operation {line:?}"))?;
        let reply = match st.execute(op).await {
            Ok(r) => r,
            Err(e) => Reply { ok: false, error: Some(format!("{e:#}")), ..Default::default() },
        };
        let mut bytes = serde_json::to_vec(&reply)?;
        bytes.push(b'\n');
        out.write_all(&bytes).await?;
        out.flush().await?;
    }
    Ok(())
}

fn gerr(e: GpuError) -> anyhow::Error {
    anyhow::anyhow!(e)
}

impl PeerState {
    fn flat(&mut self, key: &'static str, bytes: u64) -> anyhow::Result<u64> {
        if self.flat.get(key).is_none_or(|b| (b.len() as u64) < bytes) {
            self.flat.remove(key);
            self.flat.insert(key, self.gpu.alloc(bytes as usize).map_err(gerr)?);
        }
        Ok(self.flat[key].ptr())
    }

    fn sync(&self) -> anyhow::Result<()> {
        self.gpu.bind().map_err(gerr)?;
        self.gpu.context().synchronize().map_err(|e| anyhow::anyhow!("synchronizing: {e}"))
    }

    async fn execute(&mut self, op: Op) -> anyhow::Result<Reply> {
        let mut reply = Reply { ok: true, ..Default::default() };
        match op {
            Op::MakeId { group } => {
                let id = UniqueId::new().map_err(gerr)?;
                self.ids.insert(group, id);
                reply.id = Some(id.0.to_vec());
            }
            Op::Join { group, id, rank, world } => {
                let id = UniqueId(id.try_into().map_err(|_| anyhow::anyhow!("an NCCL id of the wrong length"))?);
                let gpu = self.gpu.clone();
                let deadline = Instant::now() + Duration::from_secs(120);
                let comm = tokio::task::spawn_blocking(move || Comm::init(&gpu, &id, rank, world, deadline))
                    .await?
                    .map_err(gerr)?;
                self.comms.insert(group, comm);
            }
            Op::Connect { transport, staged } => self.connect(transport, staged).await?,
            Op::Disconnect => self.side = None,
            Op::State => {
                reply.state = Some(match &self.side {
                    Some(Side::Receiver(r)) => format!("{:?}", r.state()),
                    _ => "Sender".into(),
                });
            }
            Op::Update { version } => self.memory.update(&self.plans[0], version)?,
            Op::Refit { version, at_ns } => {
                self.sync()?;
                if let Some(at) = at_ns {
                    wait_until(at);
                }
                reply.start_ns = monotonic_ns();
                let t = Instant::now();
                let stats = match self.side.as_mut().context("not connected")? {
                    Side::Sender { sender, .. } => sender.send(version, &self.memory).await?,
                    Side::Receiver(r) => r.receive(&mut self.memory).await?,
                };
                self.sync()?;
                reply.secs = t.elapsed().as_secs_f64();
                reply.end_ns = monotonic_ns();
                reply.phases = [stats.begin_secs, stats.transfer_secs, stats.end_secs];
                // Where a refit's time goes (RLPLANE_LOG=debug): the fixed part is begin + end and
                // what transfer spends beyond the copies.
                crate::roles::refit_side::refit_event(&stats);
            }
            Op::Digest { version, verify } => {
                let t = Instant::now();
                let mut total = 0u64;
                if self.is_sender {
                    let pos = match &self.side {
                        Some(Side::Sender { pos, .. }) => *pos,
                        _ => self.plan.refit_groups[0].senders.iter().position(|&s| s == self.me).unwrap_or(0),
                    };
                    let id = |i| segment_id(pos, i);
                    total = self.memory.digest(&self.plans[0], VerifySide::Source, verify, version, id)?.unwrap_or(0);
                } else {
                    for (pos, p) in self.plans.iter().enumerate() {
                        let d =
                            self.memory.digest(p, VerifySide::Destination, verify, version, |i| segment_id(pos, i))?;
                        total = total.wrapping_add(d.unwrap_or(0));
                    }
                }
                reply.secs = t.elapsed().as_secs_f64();
                reply.digest = Some(total);
            }
            Op::Read { bytes } => {
                let ptr = self.flat("read", bytes)?;
                let stream = self.gpu.stream().map_err(gerr)?;
                self.sync()?;
                // SAFETY: a buffer of `bytes` on this GPU (cuMemAlloc: 8-byte aligned).
                reply.secs = unsafe { self.gpu.time_read(ptr, bytes, &stream) }.map_err(gerr)?;
            }
            Op::Raw { group, bytes } => {
                let ptr = self.flat("raw", bytes)?;
                let stream = self.gpu.stream().map_err(gerr)?;
                self.sync()?;
                let t = Instant::now();
                let comm = self.comms.get_mut(&group).context("no such communicator")?;
                // SAFETY: a buffer of `bytes` on this GPU.
                unsafe { comm.broadcast(ptr, ptr, bytes, 0, &stream) }.map_err(gerr)?;
                comm.wait_ready(Instant::now() + Duration::from_secs(60), "raw broadcast").map_err(gerr)?;
                stream.synchronize().map_err(|e| anyhow::anyhow!("{e}"))?;
                reply.secs = t.elapsed().as_secs_f64();
            }
            Op::D2d { bytes } => {
                let src = self.flat("d2d-src", bytes)?;
                let dst = self.flat("d2d-dst", bytes)?;
                let stream = self.gpu.stream().map_err(gerr)?;
                self.sync()?;
                let t = Instant::now();
                // SAFETY: two buffers of `bytes` on this GPU.
                unsafe { copy_async(dst, src, bytes, &stream) }.map_err(gerr)?;
                stream.synchronize().map_err(|e| anyhow::anyhow!("{e}"))?;
                reply.secs = t.elapsed().as_secs_f64();
            }
            Op::D2dPieces { sizes, streams } => {
                let aligned = |b: u64| b.next_multiple_of(256);
                let total = sizes.iter().map(|&b| aligned(b)).sum();
                let src = self.flat("d2d-src", total)?;
                let dst = self.flat("d2d-dst", total)?;
                let streams =
                    (0..streams.max(1)).map(|_| self.gpu.stream().map_err(gerr)).collect::<Result<Vec<_>, _>>()?;
                self.sync()?;
                let t = Instant::now();
                let mut at = 0;
                for (i, &b) in sizes.iter().enumerate() {
                    // SAFETY: disjoint pieces of two buffers of `total` bytes on this GPU.
                    unsafe { copy_async(dst + at, src + at, b, &streams[i % streams.len()]) }.map_err(gerr)?;
                    at += aligned(b);
                }
                for s in &streams {
                    s.synchronize().map_err(|e| anyhow::anyhow!("{e}"))?;
                }
                reply.secs = t.elapsed().as_secs_f64();
            }
            Op::GatherBroadcast { total, chunks, overlapped } => {
                reply.secs = self.gather_broadcast(total, chunks.max(1) as u64, overlapped)?;
            }
        }
        Ok(reply)
    }

    /// The usual sharded refit: trainer rank 1 sends its half to rank 0 (gather), rank 0
    /// broadcasts everything to the receivers, in `chunks` pieces (sequential: every gather, then
    /// every broadcast; overlapped: chunk c's broadcast starts as soon as its gather is done).
    fn gather_broadcast(&mut self, total: u64, chunks: u64, overlapped: bool) -> anyhow::Result<f64> {
        let role = match self.plan.process(self.me).role {
            ProcessRole::Trainer(c) => c.tp as i64,
            _ => -1,
        };
        let chunk = total.div_ceil(chunks);
        let half = chunk / 2;
        let full = self.flat("raw", total)?;
        let g_stream = self.gpu.stream().map_err(gerr)?;
        let b_stream = self.gpu.stream().map_err(gerr)?;
        self.sync()?;
        let t = Instant::now();
        let dl = Instant::now() + Duration::from_secs(120);
        let mut events = Vec::new();
        for c in 0..chunks {
            let off = c * chunk;
            let len = chunk.min(total - off.min(total));
            let remote = len.saturating_sub(half);
            match role {
                0 => {
                    let g = self.comms.get_mut("gather").context("no gather communicator")?;
                    // SAFETY: inside the flat buffer.
                    unsafe { g.recv(full + off + half, remote, 1, &g_stream) }.map_err(gerr)?;
                    g.wait_ready(dl, "gather").map_err(gerr)?;
                    let e = self.gpu.event(false).map_err(gerr)?;
                    e.record(&g_stream).map_err(|e| anyhow::anyhow!("{e}"))?;
                    events.push(e);
                }
                1 => {
                    let g = self.comms.get_mut("gather").context("no gather communicator")?;
                    // SAFETY: inside the flat buffer.
                    unsafe { g.send(full + off + half, remote, 0, &g_stream) }.map_err(gerr)?;
                    g.wait_ready(dl, "gather").map_err(gerr)?;
                }
                _ => {}
            }
            if overlapped && role != 1 {
                self.broadcast_chunk(full + off, len, events.get(c as usize), &b_stream, dl)?;
            }
        }
        if !overlapped && role != 1 {
            if let Some(last) = events.last() {
                b_stream.wait(last).map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            for c in 0..chunks {
                let off = c * chunk;
                let len = chunk.min(total - off.min(total));
                self.broadcast_chunk(full + off, len, None, &b_stream, dl)?;
            }
        }
        g_stream.synchronize().map_err(|e| anyhow::anyhow!("{e}"))?;
        b_stream.synchronize().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(t.elapsed().as_secs_f64())
    }

    fn broadcast_chunk(
        &mut self,
        ptr: u64,
        len: u64,
        after: Option<&cudarc::driver::CudaEvent>,
        stream: &cudarc::driver::CudaStream,
        dl: Instant,
    ) -> anyhow::Result<()> {
        if let Some(e) = after {
            stream.wait(e).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let comm = self.comms.get_mut("raw").context("no broadcast communicator")?;
        // SAFETY: inside the flat buffer.
        unsafe { comm.broadcast(ptr, ptr, len, 0, stream) }.map_err(gerr)?;
        comm.wait_ready(dl, "broadcast").map_err(gerr)?;
        Ok(())
    }

    async fn connect(&mut self, transport: GpuTransport, staged: bool) -> anyhow::Result<()> {
        self.side = None;
        let plan = self.plan.clone();
        let group = plan.refit_groups[0].clone();
        let kind = match transport {
            GpuTransport::Nccl | GpuTransport::Auto => Kind::Nccl,
            GpuTransport::CudaIpc => Kind::Ipc,
        };
        let listener = refit_side::bind(&plan, self.me, kind, self.is_sender).await?;
        self.side = Some(if self.is_sender {
            let pos = group.senders.iter().position(|&s| s == self.me).context("a sender")?;
            let sender = refit_side::connect_sender(
                &plan,
                self.me,
                &self.auth,
                &group,
                kind,
                Some(&self.gpu),
                &listener,
                staged,
            )
            .await?;
            Side::Sender { sender, pos }
        } else {
            let (r, _) = refit_side::connect_receiver(
                &plan,
                self.me,
                &self.auth,
                &group,
                kind,
                Some(&self.gpu),
                &listener,
                staged,
            )
            .await?;
            Side::Receiver(r)
        });
        Ok(())
    }
}
