//! A rank's side of refit, whatever the transport: its weights (host or GPU memory), and its
//! sender or receiver over TCP, NCCL or CUDA IPC.
//!
//! Which transport a refit group uses is the plan's (`RefitGroup::transport`, resolved from
//! `spec.refit.transport` once by `rlplane_api::topology::group_transport`): `Tcp` keeps weights in
//! host memory; `Nccl` and `CudaIpc` in GPU memory. `Auto` on GPUs follows what was measured on
//! 4×H200 (docs/benchmarks.md): CUDA IPC for a group sharing one node with a single receiver per
//! sender's bytes — colocated (one copy on the same GPU, 0.9 of a device copy) or one receiver
//! (copy engines, 1.09× NCCL) — and NCCL for fan-out to several receivers, where its ring crosses
//! each sender's link once (46 ms against 69 ms for 2 senders × 2 receivers) and across nodes.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rlplane_api::RefitVerify;
use rlplane_api::plan::{RefitGroup, WorkerPlan};
use tokio::time::Instant;

use crate::digest::{fill, tensor_seed};
use crate::gpu::Gpu;
use crate::gpu::tensors::DeviceTensors;
use crate::net::JobAuth;
use crate::refit::memory::{DestinationMemory, HostTensors, Region, SourceMemory};
pub use crate::refit::verify::{Side, segment_id};
use crate::refit::{
    self, RefitPlan, RefitReceiver, RefitSender, RefitStats, StreamConfig, TransportKind as Kind, WeightsState,
};
use crate::transport::cuda_ipc::{self, IpcMode, IpcTransport};
use crate::transport::nccl::NcclTransport;
use crate::transport::tcp::{RefitListener, TcpOptions, TcpTransport};

/// A listener bound before the rank announces readiness.
pub enum Listener {
    /// TCP refit (sender root or relay receiver).
    Tcp(RefitListener),
    /// NCCL rendezvous (sender).
    Nccl(tokio::net::TcpListener),
    /// Nothing to bind (NCCL receivers; CUDA IPC binds its socket when connecting).
    None,
}

/// Binds what process `me` needs for `kind`.
pub async fn bind(plan: &WorkerPlan, me: u32, kind: Kind, sender: bool) -> anyhow::Result<Listener> {
    Ok(match (kind, sender) {
        (Kind::Tcp, _) => Listener::Tcp(refit::bind_listener(plan, me).await?),
        (Kind::Nccl, true) => {
            let port = plan.process(me).ports.refit.context("a sender without a refit port")?;
            Listener::Nccl(crate::net::bind(&plan.bind_address(me, port), "the NCCL rendezvous").await?)
        }
        _ => Listener::None,
    })
}

/// A rank's weights: host buffers or GPU buffers, one per tensor.
pub enum Weights {
    /// Host memory.
    Host(HostTensors),
    /// GPU memory.
    Device(DeviceTensors),
}

impl Weights {
    /// Buffers of the given sizes in the memory `kind` works with.
    pub fn alloc(
        kind: Kind,
        gpu: Option<&Gpu>,
        sizes: impl IntoIterator<Item = Option<u64>>,
    ) -> anyhow::Result<Weights> {
        Ok(match (kind, gpu) {
            (Kind::Tcp, _) => Weights::Host(HostTensors::zeroed(sizes.into_iter().map(|s| s.unwrap_or(0)))),
            (_, Some(gpu)) => Weights::Device(DeviceTensors::alloc(gpu, sizes)?),
            (_, None) => anyhow::bail!("a GPU transport without a GPU"),
        })
    }

    /// Bytes held.
    pub fn total_bytes(&self) -> u64 {
        match self {
            Weights::Host(h) => h.total_bytes(),
            Weights::Device(d) => d.total_bytes(),
        }
    }

    /// The synthetic update: every source span of `plan`'s segments gets the content of the full
    /// tensor's bytes it corresponds to, for `seed`.
    pub fn update(&mut self, plan: &RefitPlan, seed: u64) -> anyhow::Result<()> {
        match self {
            Weights::Host(h) => {
                for seg in plan.segments() {
                    let src = h.tensor_mut(seg.tensor as usize);
                    let tseed = tensor_seed(seed, seg.tensor);
                    for r in 0..seg.rows {
                        let at = (seg.src_offset + r * seg.src_pitch) as usize;
                        fill(&mut src[at..at + seg.width as usize], tseed, seg.dst_offset + r * seg.dst_pitch);
                    }
                }
            }
            Weights::Device(d) => {
                let stream = d.gpu().stream()?;
                d.fill_shard(plan, seed, &stream)?;
                stream.synchronize().map_err(|e| anyhow::anyhow!("waiting for the update: {e}"))?;
            }
        }
        Ok(())
    }

    /// The refit check's digest of `plan`'s segments on `side` for `version` under `verify`
    /// (`None` when verification is off): see [`refit::verify::plan_digest`].
    pub fn digest(
        &self,
        plan: &RefitPlan,
        side: Side,
        verify: RefitVerify,
        version: u64,
        id: impl Fn(usize) -> u64,
    ) -> anyhow::Result<Option<u64>> {
        let region = |t: u32| {
            SourceMemory::source_region(self, t as usize)
                .with_context(|| format!("tensor {t} has no buffer but the plan has a segment of it"))
        };
        let gpu = match self {
            Weights::Host(_) => None,
            Weights::Device(d) => Some(d.gpu()),
        };
        // SAFETY: the regions are this object's own buffers, not written while it is borrowed.
        unsafe { refit::verify::plan_digest(plan, side, verify, version, id, region, gpu) }
    }
}

// SAFETY: delegates to the wrapped memory, which upholds the contract.
unsafe impl SourceMemory for Weights {
    fn tensor_count(&self) -> usize {
        match self {
            Weights::Host(h) => SourceMemory::tensor_count(h),
            Weights::Device(d) => SourceMemory::tensor_count(d),
        }
    }
    fn source_region(&self, tensor: usize) -> Option<Region> {
        match self {
            Weights::Host(h) => h.source_region(tensor),
            Weights::Device(d) => d.source_region(tensor),
        }
    }
}

// SAFETY: as above.
unsafe impl DestinationMemory for Weights {
    fn tensor_count(&self) -> usize {
        match self {
            Weights::Host(h) => DestinationMemory::tensor_count(h),
            Weights::Device(d) => DestinationMemory::tensor_count(d),
        }
    }
    fn destination_region(&mut self, tensor: usize) -> Option<Region> {
        match self {
            Weights::Host(h) => h.destination_region(tensor),
            Weights::Device(d) => d.destination_region(tensor),
        }
    }
}

/// A sender over any transport (boxed: the engines differ a lot in size).
pub enum Sender {
    /// TCP.
    Tcp(Box<RefitSender<TcpTransport>>),
    /// NCCL.
    Nccl(Box<RefitSender<NcclTransport>>),
    /// CUDA IPC.
    Ipc(Box<RefitSender<IpcTransport>>),
}

impl Sender {
    /// Sends `version` of `weights`.
    pub async fn send<S: SourceMemory>(&mut self, version: u64, weights: &S) -> anyhow::Result<RefitStats> {
        Ok(match self {
            Sender::Tcp(s) => s.send(version, weights).await?,
            Sender::Nccl(s) => s.send(version, weights).await?,
            Sender::Ipc(s) => s.send(version, weights).await?,
        })
    }

    /// CUDA IPC: lends these handles for the allocations they map (memory registered by a user's
    /// process) instead of exporting them. Other transports move such memory as it is.
    pub fn lend_imported(&mut self, imported: &std::collections::HashMap<u64, crate::gpu::IpcHandle>) {
        if let Sender::Ipc(s) = self {
            s.transport_mut().set_imported(imported.clone());
        }
    }

    /// The sender's plan.
    pub fn plan(&self) -> &RefitPlan {
        match self {
            Sender::Tcp(s) => s.plan(),
            Sender::Nccl(s) => s.plan(),
            Sender::Ipc(s) => s.plan(),
        }
    }
}

/// A receiver over any transport (boxed, as [`Sender`]).
pub enum Receiver {
    /// TCP.
    Tcp(Box<RefitReceiver<TcpTransport>>),
    /// NCCL.
    Nccl(Box<RefitReceiver<NcclTransport>>),
    /// CUDA IPC.
    Ipc(Box<RefitReceiver<IpcTransport>>),
}

impl Receiver {
    /// Receives the next refit into `weights`.
    pub async fn receive<D: DestinationMemory>(&mut self, weights: &mut D) -> anyhow::Result<RefitStats> {
        Ok(match self {
            Receiver::Tcp(r) => r.receive(weights).await?,
            Receiver::Nccl(r) => r.receive(weights).await?,
            Receiver::Ipc(r) => r.receive(weights).await?,
        })
    }

    /// The weights' state.
    pub fn state(&self) -> WeightsState {
        match self {
            Receiver::Tcp(r) => r.state(),
            Receiver::Nccl(r) => r.state(),
            Receiver::Ipc(r) => r.state(),
        }
    }
}

fn stream_config(plan: &WorkerPlan, staged: bool) -> StreamConfig {
    let mut c = StreamConfig::from_spec(&plan.refit);
    if staged {
        c.staging = crate::refit::StagingPolicy::Always;
    }
    c
}

fn timeouts(plan: &WorkerPlan) -> (Duration, Instant) {
    let timeout = Duration::from_secs(plan.refit.timeout_seconds as u64);
    (timeout, Instant::now() + timeout.max(Duration::from_secs(120)))
}

/// Connects sender `me` of `group`. `staged` forces the classic pack → send → unpack path (for
/// comparisons; with CUDA IPC it lends staging buffers instead of the weights).
#[allow(clippy::too_many_arguments)]
pub async fn connect_sender(
    plan: &WorkerPlan,
    me: u32,
    auth: &JobAuth,
    group: &RefitGroup,
    kind: Kind,
    gpu: Option<&Gpu>,
    listener: &Listener,
    staged: bool,
) -> anyhow::Result<Sender> {
    let pos = group.senders.iter().position(|&s| s == me).context("not a sender of this group")?;
    let rplan = Arc::new(refit::sender_plan(plan, me)?);
    let config = stream_config(plan, staged);
    let name = plan.process(me).name.clone();
    let receivers: Vec<String> = group.receivers.iter().map(|&r| plan.process(r).name.clone()).collect();
    let (timeout, deadline) = timeouts(plan);
    Ok(match (kind, listener) {
        (Kind::Tcp, Listener::Tcp(l)) => {
            let options = TcpOptions::default();
            let streams = refit::group_streams(plan, group, &options)?;
            let t = refit::connect_tcp_sender(plan, &streams[pos], l, auth, &options).await?;
            Sender::Tcp(Box::new(RefitSender::new(streams[pos].plan.clone(), t, config)?))
        }
        (Kind::Nccl, Listener::Nccl(l)) => {
            let gpu = gpu.context("NCCL needs a GPU")?;
            // Sender k rotates the receivers by k, so forwarding spreads over them (see `root`);
            // RLPLANE_NCCL_RING_ROTATION=off keeps one order, for comparison.
            let rotation = if std::env::var("RLPLANE_NCCL_RING_ROTATION").is_ok_and(|v| v == "off") { 0 } else { pos };
            let t =
                NcclTransport::root(&name, gpu, l, &receivers, rotation, &rplan.identity(), auth, timeout, deadline)
                    .await?;
            Sender::Nccl(Box::new(RefitSender::new(rplan, t, config)?))
        }
        (Kind::Ipc, _) => {
            let gpu = gpu.context("CUDA IPC needs a GPU")?;
            let ep = cuda_ipc::endpoint(plan, me);
            let mode = if staged { IpcMode::Staged } else { IpcMode::Direct };
            let t = IpcTransport::root(&name, gpu, &ep, &receivers, rplan.clone(), mode, auth, deadline).await?;
            Sender::Ipc(Box::new(RefitSender::new(rplan, t, config)?))
        }
        _ => anyhow::bail!("refit listener does not match the transport {kind:?}"),
    })
}

/// Connects receiver `me` to every sender of `group`; returns the receiver and the senders'
/// plans (in sender order, for the digests).
#[allow(clippy::too_many_arguments)]
pub async fn connect_receiver(
    plan: &WorkerPlan,
    me: u32,
    auth: &JobAuth,
    group: &RefitGroup,
    kind: Kind,
    gpu: Option<&Gpu>,
    listener: &Listener,
    staged: bool,
) -> anyhow::Result<(Receiver, Vec<Arc<RefitPlan>>)> {
    let config = stream_config(plan, staged);
    let name = plan.process(me).name.clone();
    let (timeout, deadline) = timeouts(plan);
    let plans: Vec<Arc<RefitPlan>> =
        group.senders.iter().map(|&s| refit::sender_plan(plan, s).map(Arc::new)).collect::<Result<_, _>>()?;
    let receiver = match (kind, listener) {
        (Kind::Tcp, Listener::Tcp(l)) => {
            let options = TcpOptions::default();
            let streams = refit::group_streams(plan, group, &options)?;
            let ts = refit::connect_tcp_receiver(plan, me, &streams, l, auth, &options).await?;
            Receiver::Tcp(Box::new(RefitReceiver::new(
                streams.iter().map(|s| s.plan.clone()).zip(ts).collect(),
                config,
            )?))
        }
        (Kind::Nccl, _) => {
            let gpu = gpu.context("NCCL needs a GPU")?;
            let mut streams = Vec::new();
            for (i, &s) in group.senders.iter().enumerate() {
                let addr = plan.address(s, plan.process(s).ports.refit.context("a sender without a refit port")?);
                let label = format!("nccl stream of {} at {name}", plan.process(s).name);
                let t =
                    NcclTransport::receiver(&label, &name, gpu, &addr, &plans[i].identity(), auth, timeout, deadline)
                        .await?;
                streams.push((plans[i].clone(), t));
            }
            Receiver::Nccl(Box::new(RefitReceiver::new(streams, config)?))
        }
        (Kind::Ipc, _) => {
            let gpu = gpu.context("CUDA IPC needs a GPU")?;
            let mut streams = Vec::new();
            for (i, &s) in group.senders.iter().enumerate() {
                let label = format!("ipc stream of {} at {name}", plan.process(s).name);
                let t = IpcTransport::receiver(
                    &label,
                    &name,
                    gpu,
                    &cuda_ipc::endpoint(plan, s),
                    plans[i].clone(),
                    auth,
                    deadline,
                )
                .await?;
                streams.push((plans[i].clone(), t));
            }
            Receiver::Ipc(Box::new(RefitReceiver::new(streams, config)?))
        }
        _ => anyhow::bail!("refit listener does not match the transport {kind:?}"),
    };
    Ok((receiver, plans))
}

/// This process's GPU, when the plan gives it one and the transport uses it.
pub fn open_gpu(plan: &WorkerPlan, me: u32, kind: Kind) -> anyhow::Result<Option<Gpu>> {
    if kind == Kind::Tcp {
        return Ok(None);
    }
    let p = plan.process(me);
    let slot = p.gpu.context("a GPU transport for a process without a GPU in the plan")?;
    let ordinal = crate::gpu::physical_gpu(slot);
    // Fail at once, naming what this worker sees, rather than at the first CUDA call.
    let seen = crate::gpu::visible_gpus()?;
    if let Some(why) = crate::gpu::missing_gpu(&p.name, ordinal as usize, plan.pods[p.pod as usize].gpus, &seen) {
        anyhow::bail!(why);
    }
    let gpu = Gpu::open(ordinal as usize)?;
    if let Ok(v) = crate::gpu::nccl_version()
        && kind == Kind::Nccl
    {
        tracing::info!(nccl = v, gpu = ordinal, "NCCL loaded");
    }
    Ok(Some(gpu))
}

/// A debug event with the refit's per-phase timings (a span event in the trace).
pub(crate) fn refit_event(stats: &RefitStats) {
    tracing::debug!(
        version = stats.version,
        bytes = stats.bytes,
        buckets = stats.buckets,
        total_s = stats.total_secs,
        begin_s = stats.begin_secs,
        pack_s = stats.pack_secs,
        transfer_s = stats.transfer_secs,
        unpack_s = stats.unpack_secs,
        buffer_wait_s = stats.buffer_wait_secs,
        end_s = stats.end_secs,
        "refit done"
    );
}
