//! The streaming engine: drives a [`Transport`] bucket by bucket over `numBuffers` staging
//! buffers, tracks the receiver's weights version, and measures every phase.
//!
//! Sender, per bucket `k` (buffer slot `k % N`): wait until the slot's previous transfer completed
//! (time: buffer wait), pack the segments that need staging (time: pack), submit. So while bucket
//! `k` is on the wire, bucket `k + 1` is packed. Where a segment's source bytes are contiguous and
//! the transport reaches their memory, nothing is packed: the transport sends straight from the
//! source tensor.
//!
//! Receiver, per bucket `k`: wait until the slot's previous unpack completed (buffer wait), submit
//! the receive, and once `N` receives are outstanding wait for the oldest and queue its unpack on
//! the transport's copy engine. So unpacking bucket `k` overlaps receiving bucket `k + 1`. Segments
//! whose destination is contiguous are received straight into the destination tensor; only
//! strided destinations (tensor-parallel column shards) go through staging.
//!
//! A receiver of a sharded refit receives every sender's stream concurrently into one destination
//! (the streams' segments are disjoint). Its [`WeightsState`] becomes `Incomplete(v)` when the
//! headers announce version `v` (before any byte is written) and `Complete(v)` only when every
//! stream has delivered and unpacked every byte; a failure leaves `Incomplete(v)`, and the next
//! refit starts over from its first bucket.
//!
//! Every wait has the `timeoutSeconds` deadline; a dead peer fails the wait at once through the
//! transport (connection reset or EOF). On any failure, and when a refit future is dropped, the
//! engine aborts its transports synchronously, so nothing touches the borrowed memory afterwards.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rlplane_api::spec::RefitSpec;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::memory::{Copy2d, DestinationMemory, MemorySpace, Region, SourceMemory, StagingBuffer};
use crate::plan::{RefitPlan, Segment};
use crate::transport::{Piece, Transport, TransportError};

/// When segments go through staging buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum StagingPolicy {
    /// Only where needed: strided spans, or memory the transport cannot reach (default).
    #[default]
    WhenNeeded,
    /// Every segment (the classic pack → send → unpack design; for comparison and tests).
    Always,
}

/// Engine settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamConfig {
    /// Staging buffers per stream (`spec.refit.numBuffers`), at least 1.
    pub num_buffers: u32,
    /// Deadline of every single wait (`spec.refit.timeoutSeconds`).
    pub timeout: Duration,
    /// When to stage.
    pub staging: StagingPolicy,
}

impl StreamConfig {
    /// The settings of `spec.refit`.
    pub fn from_spec(spec: &RefitSpec) -> StreamConfig {
        StreamConfig {
            num_buffers: spec.num_buffers.max(1),
            timeout: Duration::from_secs(spec.timeout_seconds.max(1) as u64),
            staging: StagingPolicy::WhenNeeded,
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    fn buffers(&self) -> usize {
        self.num_buffers.max(1) as usize
    }
}

/// The weights a receiver holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightsState {
    /// No refit has started yet.
    #[default]
    Empty,
    /// Every byte of version `v` is in place.
    Complete(u64),
    /// A refit to version `v` started and did not finish: the weights are a mix; do not use them.
    Incomplete(u64),
}

impl WeightsState {
    /// The version the weights are current at, if they are complete.
    pub fn current(&self) -> Option<u64> {
        match self {
            WeightsState::Complete(v) => Some(*v),
            _ => None,
        }
    }
}

impl fmt::Display for WeightsState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightsState::Empty => f.write_str("Empty"),
            WeightsState::Complete(v) => write!(f, "Complete({v})"),
            WeightsState::Incomplete(v) => write!(f, "Incomplete({v})"),
        }
    }
}

/// A phase of a refit, for errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Checking the source or destination memory against the plan.
    Memory,
    /// Announcing (root) or waiting for (receiver) the refit's header.
    Begin,
    /// Packing a bucket into a staging buffer.
    Pack,
    /// Moving a bucket (sending, receiving, relaying).
    Transfer,
    /// Unpacking a bucket from a staging buffer.
    Unpack,
    /// The completion acknowledgements.
    End,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Memory => "memory check",
            Phase::Begin => "header",
            Phase::Pack => "pack",
            Phase::Transfer => "transfer",
            Phase::Unpack => "unpack",
            Phase::End => "completion acknowledgement",
        })
    }
}

/// A failed refit.
#[derive(Debug, thiserror::Error)]
pub enum RefitError {
    /// A stream failed: names the stream, the version, the phase, the bucket and (in the cause)
    /// the peer.
    #[error("refit{} failed in the {phase}{} of the {stream}: {cause}", fmt_version(*.version), fmt_bucket(*.bucket, *.buckets))]
    Stream {
        /// The stream (transport name).
        stream: String,
        /// The version, once known.
        version: Option<u64>,
        /// Bucket index, for per-bucket phases.
        bucket: Option<u32>,
        /// Buckets in the stream.
        buckets: u32,
        /// Phase.
        phase: Phase,
        /// Cause, naming the peer (shown in the message, so not also a `source`).
        cause: TransportError,
    },
    /// The memory does not match the plan.
    #[error("tensor `{name}` (index {tensor}): {message}")]
    Memory {
        /// Manifest index.
        tensor: usize,
        /// Tensor name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The senders of a sharded refit announced different versions.
    #[error("the senders announced different versions ({detail}); every sender of a refit must send the same step")]
    VersionMismatch {
        /// Versions per stream.
        detail: String,
    },
    /// The engine was set up inconsistently.
    #[error("{0}")]
    Config(String),
    /// The plan could not be built from the settings.
    #[error("refit plan: {0}")]
    Plan(crate::plan::PlanError),
    /// Connecting the streams failed (rendezvous, handshake, plan mismatch).
    #[error("connecting the refit streams failed: {0}")]
    Connect(TransportError),
}

impl From<crate::plan::PlanError> for RefitError {
    fn from(e: crate::plan::PlanError) -> Self {
        RefitError::Plan(e)
    }
}

fn fmt_version(v: Option<u64>) -> String {
    v.map(|v| format!(" to version {v}")).unwrap_or_default()
}

fn fmt_bucket(b: Option<u32>, n: u32) -> String {
    b.map(|b| format!(" of bucket {b} (of {n})")).unwrap_or_default()
}

/// Timings and byte counts of one refit, for metrics. Times are seconds. For a receiver of several
/// streams, byte counts and busy times are summed over streams and window times are the longest.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RefitStats {
    /// Version.
    pub version: u64,
    /// Streams (senders) involved.
    pub streams: u32,
    /// Buckets moved.
    pub buckets: u32,
    /// Payload bytes moved.
    pub bytes: u64,
    /// Bytes moved straight from the source / into the destination (zero-copy).
    pub direct_bytes: u64,
    /// Bytes moved through staging buffers.
    pub staged_bytes: u64,
    /// The whole call.
    pub total_secs: f64,
    /// Announcing or waiting for the header (a receiver waits here for the refit to start).
    pub begin_secs: f64,
    /// From the header to the completion of the last bucket's transfer.
    pub transfer_secs: f64,
    /// Copy-engine time spent packing (sender).
    pub pack_secs: f64,
    /// Copy-engine time spent unpacking (receiver).
    pub unpack_secs: f64,
    /// Time blocked waiting for a staging buffer's previous transfer (sender) or unpack
    /// (receiver) before reusing it.
    pub buffer_wait_secs: f64,
    /// Waiting for the completion acknowledgements.
    pub end_secs: f64,
}

/// Aborts its transport when dropped armed: on failure and when a refit future is dropped.
struct Armed<'a, T: Transport> {
    transport: &'a mut T,
    armed: bool,
}

impl<'a, T: Transport> Armed<'a, T> {
    fn new(transport: &'a mut T) -> Self {
        Armed { transport, armed: true }
    }

    fn fail(&mut self, reason: &str) {
        if self.armed {
            self.transport.abort(reason);
            self.armed = false;
        }
    }
}

impl<T: Transport> Drop for Armed<'_, T> {
    fn drop(&mut self) {
        if self.armed {
            self.transport.abort("the refit was cancelled");
        }
    }
}

/// Builds [`RefitError::Stream`]s for one stream.
struct Blame<'a> {
    stream: &'a str,
    version: Option<u64>,
    buckets: u32,
}

impl Blame<'_> {
    fn at(&self, phase: Phase, bucket: Option<usize>, source: TransportError) -> RefitError {
        RefitError::Stream {
            stream: self.stream.to_string(),
            version: self.version,
            bucket: bucket.map(|b| b as u32),
            buckets: self.buckets,
            phase,
            cause: source,
        }
    }
}

fn staging_region<T: Transport>(
    staging: &mut [Option<T::Staging>],
    slot: usize,
    transport: &mut T,
    bytes: u64,
) -> Result<Region, TransportError> {
    if staging[slot].is_none() {
        staging[slot] = Some(transport.alloc_staging(bytes)?);
    }
    Ok(staging[slot].as_ref().expect("allocated above").region())
}

/// One sender's side of a refit: its plan, its transport (as root) and its staging buffers.
pub struct RefitSender<T: Transport> {
    plan: Arc<RefitPlan>,
    transport: T,
    config: StreamConfig,
    staging: Vec<Option<T::Staging>>,
}

impl<T: Transport> RefitSender<T> {
    /// A sender; `transport` must be the group's root.
    pub fn new(plan: Arc<RefitPlan>, transport: T, config: StreamConfig) -> Result<RefitSender<T>, RefitError> {
        if !transport.is_root() {
            return Err(RefitError::Config(format!("{} is not the root of its group", transport.name())));
        }
        let staging = (0..config.buffers()).map(|_| None).collect();
        Ok(RefitSender { plan, transport, config, staging })
    }

    /// The plan.
    pub fn plan(&self) -> &RefitPlan {
        &self.plan
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport, mutably (for tuning between refits).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Replaces the transport (after reconnecting following a failure); staging buffers are kept.
    pub fn replace_transport(&mut self, transport: T) {
        self.transport = transport;
    }

    /// Sends `version` of the weights in `source` (this sender's shards), and returns once every
    /// receiver confirmed it holds them.
    pub async fn send<S: SourceMemory + ?Sized>(&mut self, version: u64, source: &S) -> Result<RefitStats, RefitError> {
        let start = Instant::now();
        let RefitSender { plan, transport, config, staging } = self;
        let regions = source_regions(plan, source)?;
        let name = transport.name().to_string();
        let buckets = plan.buckets();
        let blame = Blame { stream: &name, version: Some(version), buckets: buckets.len() as u32 };
        let mut t = Armed::new(transport);
        let result: Result<RefitStats, RefitError> = async {
            let mut stats = RefitStats { version, streams: 1, buckets: buckets.len() as u32, ..Default::default() };
            let n = config.buffers();
            let staging_bytes = plan.max_bucket_used_bytes();
            t.transport.begin(Some(version), config.deadline()).await.map_err(|e| blame.at(Phase::Begin, None, e))?;
            stats.begin_secs = start.elapsed().as_secs_f64();
            let streaming = Instant::now();
            let copy_start = t.transport.copy_busy();
            let mut slots: Vec<Option<(usize, T::Ticket)>> = (0..n).map(|_| None).collect();
            // Buckets without staging, all in flight at once where the transport allows it.
            let mut unbuffered: Vec<(usize, T::Ticket)> = Vec::new();
            let mut pieces: Vec<Piece> = Vec::new();
            let mut copies: Vec<Copy2d> = Vec::new();
            let mut buffer_wait = Duration::ZERO;
            let stage_below = t.transport.stage_below();
            let direct = |seg: &Segment, space: MemorySpace, t: &T| {
                config.staging == StagingPolicy::WhenNeeded
                    && seg.src_contiguous()
                    && seg.bytes() >= stage_below
                    && t.reaches(space)
            };
            let mut windowed = 0usize;
            for (k, bucket) in buckets.iter().enumerate() {
                let segments = &plan.segments()[bucket.segments.clone()];
                // A bucket all in place holds no buffer slot: on a transport that pipelines
                // those, only the others wait for a slot (see `Transport::pipelines_direct`).
                let unstaged = t.transport.pipelines_direct()
                    && segments.iter().all(|seg| {
                        let src = regions[seg.tensor as usize].expect("checked against the plan");
                        direct(seg, src.space, &*t.transport)
                    });
                let slot = windowed % n;
                windowed += usize::from(!unstaged);
                if !unstaged && let Some((prev, ticket)) = slots[slot].take() {
                    let w = Instant::now();
                    t.transport
                        .wait(ticket, config.deadline())
                        .await
                        .map_err(|e| blame.at(Phase::Transfer, Some(prev), e))?;
                    buffer_wait += w.elapsed();
                }
                pieces.clear();
                copies.clear();
                for (i, seg) in segments.iter().enumerate() {
                    let src = regions[seg.tensor as usize].expect("checked against the plan");
                    let segment = (bucket.segments.start + i) as u32;
                    if direct(seg, src.space, &*t.transport) {
                        pieces.push(Piece { segment, region: src.sub(seg.src_offset, seg.bytes()) });
                        stats.direct_bytes += seg.bytes();
                    } else {
                        let buf = staging_region(staging, slot, t.transport, staging_bytes)
                            .map_err(|e| blame.at(Phase::Pack, Some(k), e))?
                            .sub(seg.bucket_offset, seg.bytes());
                        copies.push(Copy2d {
                            src: src.sub(seg.src_offset, seg.src_extent()),
                            src_pitch: seg.src_pitch,
                            dst: buf,
                            dst_pitch: seg.width,
                            rows: seg.rows,
                            width: seg.width,
                        });
                        pieces.push(Piece { segment, region: buf });
                        stats.staged_bytes += seg.bytes();
                    }
                }
                if !copies.is_empty() {
                    // SAFETY: the source is borrowed for the whole call and the slot's previous
                    // transfer completed; on failure or drop `Armed` aborts before they end.
                    let ticket = unsafe { t.transport.copy(&copies) }.map_err(|e| blame.at(Phase::Pack, Some(k), e))?;
                    t.transport.wait(ticket, config.deadline()).await.map_err(|e| blame.at(Phase::Pack, Some(k), e))?;
                }
                // SAFETY: as above; the pieces stay untouched until the ticket is waited on.
                let ticket = unsafe { t.transport.submit(k as u32, &pieces) }
                    .map_err(|e| blame.at(Phase::Transfer, Some(k), e))?;
                if unstaged {
                    unbuffered.push((k, ticket));
                } else {
                    slots[slot] = Some((k, ticket));
                }
                stats.bytes += bucket.payload_bytes;
            }
            // Drain the buffered buckets in submission order. The others are left to `end`, which
            // returns once every receiver holds the whole version: waiting for each of them here
            // would put a confirmation's trip per bucket before it (see
            // `Transport::pipelines_direct`).
            let mut buffered: Vec<(usize, T::Ticket)> = slots.into_iter().flatten().collect();
            buffered.sort_by_key(|(k, _)| *k);
            for (prev, ticket) in buffered {
                t.transport
                    .wait(ticket, config.deadline())
                    .await
                    .map_err(|e| blame.at(Phase::Transfer, Some(prev), e))?;
            }
            stats.transfer_secs = streaming.elapsed().as_secs_f64();
            stats.pack_secs = (t.transport.copy_busy() - copy_start).as_secs_f64();
            stats.buffer_wait_secs = buffer_wait.as_secs_f64();
            let ending = Instant::now();
            t.transport.end(version, config.deadline()).await.map_err(|e| blame.at(Phase::End, None, e))?;
            stats.end_secs = ending.elapsed().as_secs_f64();
            stats.total_secs = start.elapsed().as_secs_f64();
            drop(unbuffered);
            Ok(stats)
        }
        .await;
        match &result {
            Ok(_) => t.armed = false,
            Err(e) => t.fail(&e.to_string()),
        }
        result
    }
}

/// One sender's stream as a receiver sees it.
struct ReceiveStream<T: Transport> {
    plan: Arc<RefitPlan>,
    transport: T,
    staging: Vec<Option<T::Staging>>,
    /// Unpack copies of each slot's bucket, kept until its transfer completed.
    slot_copies: Vec<Vec<Copy2d>>,
}

/// A receiver's side of a refit: one stream per sender, and the version of the weights it holds.
pub struct RefitReceiver<T: Transport> {
    streams: Vec<ReceiveStream<T>>,
    config: StreamConfig,
    state: WeightsState,
}

impl<T: Transport> RefitReceiver<T> {
    /// A receiver of the given streams (one per sender, each with the sender's plan). Every plan
    /// must be of the same manifest.
    pub fn new(streams: Vec<(Arc<RefitPlan>, T)>, config: StreamConfig) -> Result<RefitReceiver<T>, RefitError> {
        if streams.is_empty() {
            return Err(RefitError::Config("a refit receiver needs at least one stream".into()));
        }
        let len = streams[0].0.tensors().len();
        for (plan, t) in &streams {
            if plan.tensors().len() != len {
                return Err(RefitError::Config(format!(
                    "the plan of {} has {} tensors where another stream's has {len}",
                    t.name(),
                    plan.tensors().len()
                )));
            }
            if t.is_root() {
                return Err(RefitError::Config(format!("{} is a root, not a receiver", t.name())));
            }
        }
        let n = config.buffers();
        let streams = streams
            .into_iter()
            .map(|(plan, transport)| ReceiveStream {
                plan,
                transport,
                staging: (0..n).map(|_| None).collect(),
                slot_copies: (0..n).map(|_| Vec::new()).collect(),
            })
            .collect();
        Ok(RefitReceiver { streams, config, state: WeightsState::Empty })
    }

    /// The weights' state: `Complete(v)` only after a whole refit to `v` succeeded.
    pub fn state(&self) -> WeightsState {
        self.state
    }

    /// The transports, mutably, in stream order (for tuning between refits).
    pub fn transports_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.streams.iter_mut().map(|s| &mut s.transport)
    }

    /// Replaces the transports (after reconnecting following a failure), in stream order.
    pub fn replace_transports(&mut self, transports: Vec<T>) -> Result<(), RefitError> {
        if transports.len() != self.streams.len() {
            return Err(RefitError::Config(format!(
                "{} transports given for {} streams",
                transports.len(),
                self.streams.len()
            )));
        }
        for (s, t) in self.streams.iter_mut().zip(transports) {
            s.transport = t;
        }
        Ok(())
    }

    /// Receives the next refit into `dest` (full tensors), from every stream concurrently, and
    /// relays it to this receiver's relay children. Returns once the weights are complete.
    pub async fn receive<D: DestinationMemory + ?Sized>(&mut self, dest: &mut D) -> Result<RefitStats, RefitError> {
        let start = Instant::now();
        let RefitReceiver { streams, config, state } = self;
        let regions = destination_regions(streams.iter().map(|s| &*s.plan), dest)?;
        let config = *config;
        let names: Vec<String> = streams.iter().map(|s| s.transport.name().to_string()).collect();
        let mut parts: Vec<StreamPart<'_, T>> = streams
            .iter_mut()
            .map(|s| StreamPart {
                plan: &s.plan,
                transport: Armed::new(&mut s.transport),
                staging: &mut s.staging,
                slot_copies: &mut s.slot_copies,
            })
            .collect();

        // Headers first: the version must be known (and the state Incomplete) before any byte is
        // written.
        let begins = futures::future::try_join_all(parts.iter_mut().zip(&names).map(|(p, name)| async move {
            let blame = Blame { stream: name, version: None, buckets: p.plan.buckets().len() as u32 };
            p.transport.transport.begin(None, config.deadline()).await.map_err(|e| blame.at(Phase::Begin, None, e))
        }))
        .await;
        let versions = match begins {
            Ok(v) => v,
            Err(e) => {
                parts.iter_mut().for_each(|p| p.transport.fail(&e.to_string()));
                return Err(e);
            }
        };
        let version = versions[0];
        if versions.iter().any(|&v| v != version) {
            let detail = names.iter().zip(&versions).map(|(n, v)| format!("{n}: {v}")).collect::<Vec<_>>().join(", ");
            let e = RefitError::VersionMismatch { detail };
            // No byte was written: the weights keep their state.
            parts.iter_mut().for_each(|p| p.transport.fail(&e.to_string()));
            return Err(e);
        }
        *state = WeightsState::Incomplete(version);
        let begin_secs = start.elapsed().as_secs_f64();

        let runs = futures::future::try_join_all(
            parts.iter_mut().zip(&names).map(|(p, name)| p.run(name, version, &regions, config)),
        )
        .await;
        match runs {
            Ok(per_stream) => {
                parts.iter_mut().for_each(|p| p.transport.armed = false);
                let mut stats = RefitStats { version, begin_secs, ..Default::default() };
                for s in per_stream {
                    stats.streams += 1;
                    stats.buckets += s.buckets;
                    stats.bytes += s.bytes;
                    stats.direct_bytes += s.direct_bytes;
                    stats.staged_bytes += s.staged_bytes;
                    stats.transfer_secs = stats.transfer_secs.max(s.transfer_secs);
                    stats.unpack_secs += s.unpack_secs;
                    stats.buffer_wait_secs += s.buffer_wait_secs;
                    stats.end_secs = stats.end_secs.max(s.end_secs);
                }
                stats.total_secs = start.elapsed().as_secs_f64();
                *state = WeightsState::Complete(version);
                Ok(stats)
            }
            Err(e) => {
                parts.iter_mut().for_each(|p| p.transport.fail(&e.to_string()));
                Err(e)
            }
        }
    }
}

struct StreamPart<'a, T: Transport> {
    plan: &'a RefitPlan,
    transport: Armed<'a, T>,
    staging: &'a mut Vec<Option<T::Staging>>,
    slot_copies: &'a mut Vec<Vec<Copy2d>>,
}

impl<T: Transport> StreamPart<'_, T> {
    async fn run(
        &mut self,
        name: &str,
        version: u64,
        regions: &[Option<Region>],
        config: StreamConfig,
    ) -> Result<RefitStats, RefitError> {
        let plan = self.plan;
        let buckets = plan.buckets();
        let blame = Blame { stream: name, version: Some(version), buckets: buckets.len() as u32 };
        let t = &mut *self.transport.transport;
        let n = config.buffers();
        let staging_bytes = plan.max_bucket_used_bytes();
        let mut stats = RefitStats { version, streams: 1, buckets: buckets.len() as u32, ..Default::default() };
        let streaming = Instant::now();
        let copy_start = t.copy_busy();
        let mut unpacks: Vec<Option<(usize, T::Ticket)>> = (0..n).map(|_| None).collect();
        // Outstanding transfers, oldest first, each with the buffer slot it holds (none for a
        // bucket all in place on a transport that pipelines those).
        let mut pending: VecDeque<(usize, T::Ticket, Option<usize>)> = VecDeque::with_capacity(n);
        let mut windowed = 0usize;
        let mut pieces: Vec<Piece> = Vec::new();
        let mut buffer_wait = Duration::ZERO;
        let mut transfers_done = Duration::ZERO;
        let stage_below = t.stage_below();
        let pipelines_direct = t.pipelines_direct();
        let direct = |seg: &Segment, space: MemorySpace, t: &T| {
            config.staging == StagingPolicy::WhenNeeded
                && seg.dst_contiguous()
                && seg.bytes() >= stage_below
                && t.reaches(space)
        };

        // Waits for the oldest outstanding transfer and queues its unpack.
        macro_rules! complete_oldest {
            () => {{
                let (k, ticket, slot) = pending.pop_front().expect("a transfer is outstanding");
                t.wait(ticket, config.deadline()).await.map_err(|e| blame.at(Phase::Transfer, Some(k), e))?;
                transfers_done = streaming.elapsed();
                if let Some(slot) = slot
                    && !self.slot_copies[slot].is_empty()
                {
                    // SAFETY: the destination is borrowed for the whole call and the staging slot
                    // is not reused before this ticket completes; `Armed` aborts on failure/drop.
                    let ticket =
                        unsafe { t.copy(&self.slot_copies[slot]) }.map_err(|e| blame.at(Phase::Unpack, Some(k), e))?;
                    self.slot_copies[slot].clear();
                    unpacks[slot] = Some((k, ticket));
                }
            }};
        }

        for (k, bucket) in buckets.iter().enumerate() {
            let segments = &plan.segments()[bucket.segments.clone()];
            // A bucket all in place holds no buffer slot: on a transport that pipelines those,
            // only the others count against the window (see `Transport::pipelines_direct`).
            let unstaged = pipelines_direct
                && segments.iter().all(|seg| {
                    let dst = regions[seg.tensor as usize].expect("checked against the plan");
                    direct(seg, dst.space, &*t)
                });
            let slot = windowed % n;
            if !unstaged {
                windowed += 1;
                if let Some((prev, ticket)) = unpacks[slot].take() {
                    let w = Instant::now();
                    t.wait(ticket, config.deadline()).await.map_err(|e| blame.at(Phase::Unpack, Some(prev), e))?;
                    buffer_wait += w.elapsed();
                }
                self.slot_copies[slot].clear();
            }
            pieces.clear();
            for (i, seg) in segments.iter().enumerate() {
                let dst = regions[seg.tensor as usize].expect("checked against the plan");
                let segment = (bucket.segments.start + i) as u32;
                if direct(seg, dst.space, &*t) {
                    pieces.push(Piece { segment, region: dst.sub(seg.dst_offset, seg.bytes()) });
                    stats.direct_bytes += seg.bytes();
                } else {
                    let buf = staging_region(self.staging, slot, t, staging_bytes)
                        .map_err(|e| blame.at(Phase::Transfer, Some(k), e))?
                        .sub(seg.bucket_offset, seg.bytes());
                    self.slot_copies[slot].push(Copy2d {
                        src: buf,
                        src_pitch: seg.width,
                        dst: dst.sub(seg.dst_offset, seg.dst_extent()),
                        dst_pitch: seg.dst_pitch,
                        rows: seg.rows,
                        width: seg.width,
                    });
                    pieces.push(Piece { segment, region: buf });
                    stats.staged_bytes += seg.bytes();
                }
            }
            // SAFETY: as above; the pieces are this stream's disjoint part of the destination or
            // this slot's staging buffer, whose previous unpack completed.
            let ticket = unsafe { t.submit(k as u32, &pieces) }.map_err(|e| blame.at(Phase::Transfer, Some(k), e))?;
            pending.push_back((k, ticket, (!unstaged).then_some(slot)));
            stats.bytes += bucket.payload_bytes;
            while pending.iter().filter(|(_, _, slot)| slot.is_some()).count() >= n {
                complete_oldest!();
            }
        }
        while !pending.is_empty() {
            complete_oldest!();
        }
        for u in unpacks.iter_mut() {
            if let Some((k, ticket)) = u.take() {
                t.wait(ticket, config.deadline()).await.map_err(|e| blame.at(Phase::Unpack, Some(k), e))?;
            }
        }
        stats.transfer_secs = transfers_done.as_secs_f64();
        stats.unpack_secs = (t.copy_busy() - copy_start).as_secs_f64();
        stats.buffer_wait_secs = buffer_wait.as_secs_f64();
        let ending = Instant::now();
        t.end(version, config.deadline()).await.map_err(|e| blame.at(Phase::End, None, e))?;
        stats.end_secs = ending.elapsed().as_secs_f64();
        Ok(stats)
    }
}

fn memory_error(plan: &RefitPlan, tensor: usize, message: String) -> RefitError {
    RefitError::Memory { tensor, name: plan.tensor_name(tensor).to_string(), message }
}

/// The source region of every tensor the plan sends, checked against the plan's shard sizes.
fn source_regions<S: SourceMemory + ?Sized>(plan: &RefitPlan, source: &S) -> Result<Vec<Option<Region>>, RefitError> {
    let n = plan.tensors().len();
    if source.tensor_count() != n {
        return Err(RefitError::Config(format!(
            "the source holds {} tensors where the manifest has {n}; expose one region per manifest tensor",
            source.tensor_count()
        )));
    }
    let mut regions = vec![None; n];
    for (i, extent) in plan.tensors().iter().enumerate() {
        let Some(want) = extent.source_bytes.filter(|&b| b > 0) else { continue };
        let r = source.source_region(i).ok_or_else(|| {
            memory_error(plan, i, format!("this sender must send {want} bytes of it but exposes no source region"))
        })?;
        if r.len != want {
            return Err(memory_error(
                plan,
                i,
                format!("source shard has {} bytes where the plan expects {want}; check the shard's shape", r.len),
            ));
        }
        regions[i] = Some(r);
    }
    Ok(regions)
}

/// The destination region of every tensor any stream writes, checked against the full sizes.
fn destination_regions<'p, D: DestinationMemory + ?Sized>(
    plans: impl Iterator<Item = &'p RefitPlan> + Clone,
    dest: &mut D,
) -> Result<Vec<Option<Region>>, RefitError> {
    let first = plans.clone().next().expect("at least one stream");
    let n = first.tensors().len();
    if dest.tensor_count() != n {
        return Err(RefitError::Config(format!(
            "the destination holds {} tensors where the manifest has {n}; expose one region per manifest tensor",
            dest.tensor_count()
        )));
    }
    let mut regions = vec![None; n];
    for (i, region) in regions.iter_mut().enumerate() {
        let used = plans.clone().any(|p| p.tensors()[i].source_bytes.is_some_and(|b| b > 0));
        if !used {
            continue;
        }
        let want = first.tensors()[i].dest_bytes;
        let r = dest.destination_region(i).ok_or_else(|| {
            memory_error(first, i, format!("needs {want} bytes but no destination region is exposed"))
        })?;
        if r.len != want {
            return Err(memory_error(
                first,
                i,
                format!("destination has {} bytes where the full tensor has {want}; check its shape", r.len),
            ));
        }
        *region = Some(r);
    }
    Ok(regions)
}
