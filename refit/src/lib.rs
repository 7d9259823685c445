//! Refit: moving the trainer's new weights to every generation rank after each step.
//!
//! From the bottom up (a module imports only those above it in this list, and the wire layer):
//! - [`plan`]: the deterministic packing plan (pure), compared by hash at the handshake;
//!   [`memory`]: source / destination memory traits, host buffers, the host copy thread;
//!   [`digest`]: the content hash of a byte range, and the synthetic weights' contents.
//! - [`gpu`]: CUDA contexts, device tensors, IPC handles, NCCL communicators, the kernels;
//!   [`transport`]: what carries the buckets (TCP relay, NCCL broadcast, CUDA IPC).
//! - [`stream`]: the engine: N-buffer pipelining, versions, timeouts, phase timings;
//!   [`verify`]: the check of what a receiver holds against the senders (digests, full or sampled).
//!
//! The crate root also derives each member's streams (plans and relay routes) from the
//! [`WorkerPlan`], so that every rank computes the same plans from the same document. It knows
//! nothing of roles, the sidecar, the local runner or metrics.

pub mod digest;
pub mod gpu;
pub mod memory;
pub mod plan;
pub mod stream;
pub mod transport;
pub mod verify;

use std::sync::Arc;

use rlplane_api::plan::{GroupTransport, ProcessRole, RefitGroup, TrainerCoords, WorkerPlan};
use rlplane_api::spec::RefitSource;
use tokio::time::Instant;

pub use memory::{DestinationMemory, HostTensors, MemorySpace, Region, SourceMemory};
pub use plan::{PlanError, PlanIdentity, RefitPlan, Segment, SenderLayout, ShardCoords};
pub use stream::{RefitError, RefitReceiver, RefitSender, RefitStats, StagingPolicy, StreamConfig, WeightsState};

use crate::transport::tcp::{self, RefitListener, Route, TcpOptions, TcpTransport};
use rlplane_wire::net::JobAuth;

/// The transport a refit group's members use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// TCP, host memory.
    Tcp,
    /// NCCL, GPU memory.
    Nccl,
    /// CUDA IPC, GPU memory.
    Ipc,
}

/// The transport of `group`, as the plan builder resolved it (`rlplane_api::topology::group_transport`):
/// `Tcp` keeps weights in host memory, `Nccl` and `Ipc` in GPU memory.
pub fn transport_kind(group: &RefitGroup) -> TransportKind {
    match group.transport {
        GroupTransport::Tcp => TransportKind::Tcp,
        GroupTransport::Nccl => TransportKind::Nccl,
        GroupTransport::CudaIpc => TransportKind::Ipc,
    }
}

/// One sender's stream in a refit group: the sender, its plan and its relay route.
#[derive(Clone, Debug)]
pub struct StreamInfo {
    /// The sender's process index.
    pub sender: u32,
    /// The sender's plan (both sides compute it).
    pub plan: Arc<RefitPlan>,
    /// The relay tree.
    pub route: Route,
}

/// The bucket size of `spec.refit`, or an error when it is left to a GPU memory fraction.
pub fn bucket_bytes(plan: &WorkerPlan) -> Result<u64, PlanError> {
    plan.refit.fixed_buffer_bytes().ok_or_else(|| PlanError::Setting {
        field: "spec.refit.bufferMemoryFraction",
        message: "is resolved from GPU memory, which the TCP transport does not have; set spec.refit.bufferBytes"
            .into(),
    })
}

/// Where trainer rank `coords` sits in the sharded grid: its tensor-parallel shard of its
/// pipeline stage, and its rows of that shard when the trainer shards over data (`fsdp`).
pub fn shard_coords(wp: &WorkerPlan, coords: &TrainerCoords) -> ShardCoords {
    let l = &wp.layout;
    ShardCoords::tensor_parallel(coords.tp, l.tp, coords.pp, l.pp).fully_sharded(coords.dp % l.fsdp, l.fsdp)
}

/// The plan of `sender`'s stream: the whole manifest for a gathered refit, the sender's
/// tensor-parallel slice of its pipeline stage for a sharded one.
pub fn sender_plan(wp: &WorkerPlan, sender: u32) -> Result<RefitPlan, PlanError> {
    let manifest = wp.manifest();
    let bucket = bucket_bytes(wp)?;
    let align = wp.refit.align_bytes;
    match wp.refit.source {
        RefitSource::Gathered => RefitPlan::new(&manifest, bucket, align),
        RefitSource::Sharded => {
            let coords = match wp.processes.get(sender as usize).map(|p| p.role) {
                Some(ProcessRole::Trainer(c)) => c,
                _ => {
                    return Err(PlanError::Setting {
                        field: "refitGroups.senders",
                        message: format!("process {sender} is not a trainer rank; rebuild the plan"),
                    });
                }
            };
            RefitPlan::sharded(&manifest, bucket, align, shard_coords(wp, &coords))
        }
    }
}

/// Every stream of `group`, in the order of its senders.
pub fn group_streams(wp: &WorkerPlan, group: &RefitGroup, options: &TcpOptions) -> Result<Vec<StreamInfo>, RefitError> {
    group
        .senders
        .iter()
        .map(|&sender| {
            Ok(StreamInfo {
                sender,
                plan: Arc::new(sender_plan(wp, sender)?),
                route: Route::from_plan(wp, group, sender, options.fanout).map_err(RefitError::Connect)?,
            })
        })
        .collect()
}

/// Binds process `me`'s refit listener (its `ports.refit`). Bind once; reconnects reuse it.
pub async fn bind_listener(wp: &WorkerPlan, me: u32) -> Result<RefitListener, RefitError> {
    let member = tcp::Member::from_plan(wp, me).map_err(RefitError::Connect)?;
    RefitListener::bind(&member).await.map_err(RefitError::Connect)
}

/// Connects a sender's stream over TCP (accepting its relay children) within `spec.refit.timeoutSeconds`.
pub async fn connect_tcp_sender(
    wp: &WorkerPlan,
    stream: &StreamInfo,
    listener: &RefitListener,
    auth: &JobAuth,
    options: &TcpOptions,
) -> Result<TcpTransport, RefitError> {
    let deadline = Instant::now() + StreamConfig::from_spec(&wp.refit).timeout;
    tcp::connect_root(listener, &stream.route, stream.plan.identity(), auth, options, deadline)
        .await
        .map_err(RefitError::Connect)
}

/// Connects receiver `me` to every stream over TCP within `spec.refit.timeoutSeconds`; the
/// transports come back in the order of `streams`.
pub async fn connect_tcp_receiver(
    wp: &WorkerPlan,
    me: u32,
    streams: &[StreamInfo],
    listener: &RefitListener,
    auth: &JobAuth,
    options: &TcpOptions,
) -> Result<Vec<TcpTransport>, RefitError> {
    let deadline = Instant::now() + StreamConfig::from_spec(&wp.refit).timeout;
    let routes: Vec<_> = streams.iter().map(|s| (s.route.clone(), s.plan.identity())).collect();
    tcp::connect_receiver(listener, me, &routes, auth, options, deadline).await.map_err(RefitError::Connect)
}
