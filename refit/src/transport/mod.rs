//! Transports that carry refit buckets: TCP (CPU, [`tcp`]) now; NCCL and CUDA IPC (GPU) plug into
//! the same [`Transport`] trait.
//!
//! A transport is one broadcast group: one root (a sender) and its receivers. The refit engine
//! ([`crate::stream`]) drives it bucket by bucket and never blocks on it except through
//! [`Transport::wait`]:
//!
//! - [`Transport::submit`] starts moving one bucket and returns a ticket at once, like an
//!   operation enqueued on a CUDA stream; the engine waits on the ticket before it reuses the
//!   bucket's staging buffer. The bucket arrives as its segments' [`Piece`]s (each a contiguous
//!   region: straight in the source or destination tensor where that is contiguous, else in a
//!   staging buffer), so NCCL can group one broadcast per piece and CUDA IPC can issue one copy per
//!   piece, and TCP can write them with vectored writes.
//! - [`Transport::copy`] runs pack / unpack copies (source → staging, staging → destination) on
//!   the transport's own copy engine (a host thread for TCP, a CUDA stream for the GPU), also
//!   returning a ticket.
//! - [`Transport::abort`] is synchronous: when it returns, nothing touches memory handed to the
//!   transport any more. The engine calls it on every failure and when its future is dropped.

pub mod cuda_ipc;
pub mod nccl;
pub mod tcp;

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::memory::{Copy2d, MemorySpace, Region, StagingBuffer};
use rlplane_wire::net::NetError;

/// One contiguous span of a bucket: the bytes of one segment (or of a whole segment's staged
/// copy), in the order they travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the segment in [`crate::plan::RefitPlan::segments`].
    pub segment: u32,
    /// Where the bytes are (root) or go (receiver).
    pub region: Region,
}

/// Errors of a transport. Each names the peer and what was being done.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransportError {
    /// A wait ran past its deadline.
    #[error("timed out after {secs:.1}s {what} (peer {peer})")]
    Timeout {
        /// The peer waited on.
        peer: String,
        /// What was being waited for.
        what: String,
        /// Seconds waited.
        secs: f64,
    },
    /// The peer closed or reset the connection: it died or gave up.
    #[error("peer {peer} closed the connection while {what}")]
    Closed {
        /// The peer.
        peer: String,
        /// What was being done.
        what: String,
    },
    /// Another I/O error.
    #[error("{what} (peer {peer}): {detail}")]
    Io {
        /// The peer.
        peer: String,
        /// What was being done.
        what: String,
        /// The OS error.
        detail: String,
    },
    /// The handshake was refused (other job or epoch, or another refit plan).
    #[error("handshake with {peer} refused: {reason}")]
    Refused {
        /// The peer.
        peer: String,
        /// Why (as the refusing side wrote it).
        reason: String,
    },
    /// The peer computed another refit plan (other manifest, bucket size or alignment).
    #[error("refit plan mismatch with {peer}: {detail}")]
    PlanMismatch {
        /// The peer.
        peer: String,
        /// Both sides' manifest length, bucket size and alignment.
        detail: String,
    },
    /// The peer sent something the protocol does not allow.
    #[error("peer {peer} broke the refit protocol: {detail}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// The transport was aborted by an earlier failure and must be reconnected.
    #[error("transport {name} is unusable after an earlier failure ({reason}); reconnect it")]
    Aborted {
        /// The transport.
        name: String,
        /// The failure that aborted it.
        reason: String,
    },
    /// The wiring or memory cannot be served by this transport.
    #[error("{0}")]
    Config(String),
}

impl TransportError {
    /// The peer the error is about, when there is one.
    pub fn peer(&self) -> Option<&str> {
        match self {
            TransportError::Timeout { peer, .. }
            | TransportError::Closed { peer, .. }
            | TransportError::Io { peer, .. }
            | TransportError::Refused { peer, .. }
            | TransportError::PlanMismatch { peer, .. }
            | TransportError::Protocol { peer, .. } => Some(peer),
            TransportError::Aborted { .. } | TransportError::Config(_) => None,
        }
    }
}

impl From<NetError> for TransportError {
    fn from(e: NetError) -> Self {
        match e {
            NetError::Timeout { what, peer, secs } => TransportError::Timeout { peer, what, secs },
            NetError::Io { what, peer, source } => TransportError::Io { peer, what, detail: source.to_string() },
            NetError::Closed { what, peer } => TransportError::Closed { peer, what },
            NetError::Refused { peer, reason } => TransportError::Refused { peer, reason },
        }
    }
}

/// One broadcast group seen from one member: the root sends, receivers receive (and may relay).
/// See the module docs for the contract.
pub trait Transport: Send {
    /// Completion handle of a submitted transfer or copy (a sequence number for TCP; a CUDA event
    /// for the GPU transports).
    type Ticket: Send;
    /// Staging buffers, in the memory this transport moves bytes from and to.
    type Staging: StagingBuffer;

    /// Name for errors and logs, e.g. `tcp stream of trainer-0 at gen-2`.
    fn name(&self) -> &str;

    /// Whether this member is the group's root (the sender).
    fn is_root(&self) -> bool;

    /// Whether the transport moves bytes straight from / into memory of `space` (zero-copy); if
    /// not, the engine stages them through [`Transport::alloc_staging`] buffers with
    /// [`Transport::copy`].
    fn reaches(&self, space: MemorySpace) -> bool;

    /// Allocates one staging buffer of `bytes` (once per buffer slot, reused across refits).
    fn alloc_staging(&mut self, bytes: u64) -> Result<Self::Staging, TransportError>;

    /// Starts a refit. The root passes its version and announces it; a receiver passes `None` and
    /// learns the version. Returns the version.
    fn begin(
        &mut self,
        version: Option<u64>,
        deadline: Instant,
    ) -> impl Future<Output = Result<u64, TransportError>> + Send;

    /// Starts moving bucket `bucket`, whose bytes are `pieces` in plan order: the root sends them,
    /// a receiver fills them (and forwards them to its relay children). Returns at once.
    ///
    /// # Safety
    /// Every region must stay valid (readable for the root, writable and otherwise untouched for a
    /// receiver) until the ticket completes or [`Transport::abort`] returns.
    unsafe fn submit(&mut self, bucket: u32, pieces: &[Piece]) -> Result<Self::Ticket, TransportError>;

    /// Queues copies on the transport's copy engine, in order after earlier copies. Returns at once.
    ///
    /// # Safety
    /// As for [`Transport::submit`]: every region stays valid until the ticket completes or
    /// [`Transport::abort`] returns.
    unsafe fn copy(&mut self, copies: &[Copy2d]) -> Result<Self::Ticket, TransportError>;

    /// Waits for a ticket until `deadline`. A dead peer fails it at once.
    fn wait(
        &mut self,
        ticket: Self::Ticket,
        deadline: Instant,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Finishes a refit after every bucket completed: a receiver confirms to its parent once its
    /// relay children confirmed; the root waits for its children's confirmations, so that when it
    /// returns every receiver holds the complete weights of `version`.
    fn end(&mut self, version: u64, deadline: Instant) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Stops everything in flight, synchronously: when it returns no memory handed to the
    /// transport is touched any more. The transport is then unusable.
    fn abort(&mut self, reason: &str);

    /// Total time the copy engine spent copying (pack and unpack), for the phase timings.
    fn copy_busy(&self) -> Duration;

    /// Segments smaller than this are staged even when they could move directly, so that the
    /// transport can move a run of them as one span ([`coalesce`]): on GPUs each separate
    /// broadcast or copy has a fixed cost that tiny tensors (norms, biases) do not repay. The
    /// same on both sides of a stream, since both stage by the plan's sizes.
    fn stage_below(&self) -> u64 {
        0
    }

    /// Whether buckets that use no staging buffer (every piece moved in place, from the sender's
    /// tensors into the receiver's) may all be in flight at once instead of `num_buffers` at a
    /// time. The window exists to reuse staging buffers; a bucket without one needs none, and a
    /// transport whose transfers are ordered on a GPU stream can queue the whole refit at once, so
    /// that the GPU never waits for the host's round trip between buckets (an acknowledgment to
    /// the sender, its next announcement). The sending side then leaves those buckets' tickets
    /// unwaited: its `end` alone must return only once every receiver holds all of them. Both
    /// sides of a stream must answer alike.
    fn pipelines_direct(&self) -> bool {
        false
    }
}

/// The spans to move for a bucket's pieces: each piece alone, except that runs of consecutive
/// segments all smaller than `below` (staged, so lying in order in one staging buffer) become one
/// span from the run's first byte to its last, alignment padding included. Both sides of a stream
/// derive the same spans from the same plan.
pub fn coalesce(pieces: &[Piece], below: u64) -> Vec<Region> {
    let mut out: Vec<Region> = Vec::with_capacity(pieces.len());
    let mut run: Option<(Region, u32)> = None;
    for p in pieces {
        let small = p.region.len < below;
        match &mut run {
            Some((span, last))
                if small
                    && p.segment == *last + 1
                    && p.region.space == span.space
                    && p.region.addr >= span.addr + span.len =>
            {
                span.len = p.region.addr + p.region.len - span.addr;
                *last = p.segment;
            }
            _ => {
                if let Some((span, _)) = run.take() {
                    out.push(span);
                }
                if small {
                    run = Some((p.region, p.segment));
                } else {
                    out.push(p.region);
                }
            }
        }
    }
    if let Some((span, _)) = run {
        out.push(span);
    }
    out
}

/// A GPU failure as a transport error, naming what was being done.
fn gpu_err(what: &str, e: crate::gpu::GpuError) -> TransportError {
    TransportError::Config(format!("{what}: {e}"))
}

#[cfg(test)]
mod coalesce_tests {
    use super::*;

    fn piece(segment: u32, addr: u64, len: u64) -> Piece {
        Piece { segment, region: Region { space: MemorySpace::Device { ordinal: 0 }, addr, len } }
    }

    #[test]
    fn runs_of_small_consecutive_pieces_merge_and_large_ones_stay() {
        let p = [
            piece(0, 1000, 8),      // small
            piece(1, 1256, 8),      // small, after padding
            piece(2, 50_000, 4096), // large: alone
            piece(3, 2000, 16),     // small, a new run
            piece(5, 2300, 16),     // small but not consecutive: new run
        ];
        let spans = coalesce(&p, 1024);
        let got: Vec<(u64, u64)> = spans.iter().map(|r| (r.addr, r.len)).collect();
        assert_eq!(got, vec![(1000, 264), (50_000, 4096), (2000, 16), (2300, 16)]);
        // Nothing merges below 1 byte.
        assert_eq!(coalesce(&p, 0).len(), 5);
    }
}
