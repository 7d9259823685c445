//! The refit check: the digest of a refit plan's segments, read on the sending or the receiving
//! side from host or GPU memory — every 4 KiB block, or the sample a version draws — so that a
//! receiver can compare what it holds with what the senders hold. Every user of refit (the
//! synthetic roles, the sidecar's registered user memory, the benchmarks) calls this one place.

use anyhow::Context;
use rlplane_api::RefitVerify;

use super::memory::{MemorySpace, Region};
use super::plan::RefitPlan;
use crate::digest::{Sampling, digest_region, segment_term};
use crate::gpu::{DigestRegion, Gpu};

/// The identity of segment `index` of the stream of a refit group's `sender_pos`-th sender: what
/// a digest's terms are keyed by, so that the same bytes in the wrong place do not match.
pub fn segment_id(sender_pos: usize, index: usize) -> u64 {
    ((sender_pos as u64) << 32) | index as u64
}

/// Which end of the plan's segments to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The sender's shard (source offsets and pitches).
    Source,
    /// The receiver's full tensors (destination offsets and pitches).
    Destination,
}

/// The sum of `plan`'s segment terms for weight version `version` under `verify` (`None` when
/// it is `Off`): segment `i` is read from `region(tensor)` on `side`, under identity `id(i)` (so
/// that the same bytes in the wrong place do not match). Device memory is read by `gpu` in one
/// kernel launch; host memory on this thread.
///
/// # Safety
/// Every region `region` returns must be valid for reads of its length (host memory in this
/// process, or device memory reachable from `gpu`) and not written while this runs.
pub unsafe fn plan_digest(
    plan: &RefitPlan,
    side: Side,
    verify: RefitVerify,
    version: u64,
    id: impl Fn(usize) -> u64,
    region: impl Fn(u32) -> anyhow::Result<Region>,
    gpu: Option<&Gpu>,
) -> anyhow::Result<Option<u64>> {
    let sampling = |i: usize| match verify {
        RefitVerify::Sampled => Sampling::sampled(version, id(i)),
        _ => Sampling::FULL,
    };
    if verify == RefitVerify::Off {
        return Ok(None);
    }
    let segs = plan.segments();
    let mut regions = Vec::with_capacity(segs.len());
    for seg in segs {
        let r = region(seg.tensor)?;
        let (off, pitch) = match side {
            Side::Source => (seg.src_offset, seg.src_pitch),
            Side::Destination => (seg.dst_offset, seg.dst_pitch),
        };
        let extent = if seg.rows == 0 { 0 } else { off + (seg.rows - 1) * pitch + seg.width };
        anyhow::ensure!(
            extent <= r.len,
            "segment of tensor {} reaches byte {extent} of a region of {} bytes",
            seg.tensor,
            r.len
        );
        regions.push((r, off, pitch));
    }
    let device = regions.iter().filter(|(r, ..)| r.space != MemorySpace::Host).count();
    let digests: Vec<u64> = if device > 0 {
        anyhow::ensure!(device == regions.len(), "a refit plan's tensors are partly in host, partly in device memory");
        let gpu = gpu.context("weights in GPU memory but no GPU to read them")?;
        let table: Vec<DigestRegion> = segs
            .iter()
            .zip(&regions)
            .enumerate()
            .map(|(i, (seg, (r, off, pitch)))| DigestRegion {
                addr: r.addr + off,
                rows: seg.rows,
                width: seg.width,
                pitch: *pitch,
                sampling: sampling(i),
            })
            .collect();
        let stream = gpu.stream()?;
        // SAFETY: the caller vouches for the regions; the extents were checked above.
        unsafe { gpu.digest_regions(&table, &stream) }?
    } else {
        segs.iter()
            .zip(&regions)
            .enumerate()
            .map(|(i, (seg, (r, off, pitch)))| {
                // SAFETY: host memory the caller vouches for.
                let bytes = unsafe { r.as_slice() };
                digest_region(bytes, *off, seg.rows, seg.width, *pitch, sampling(i))
            })
            .collect()
    };
    Ok(Some(digests.iter().enumerate().fold(0u64, |acc, (i, d)| acc.wrapping_add(segment_term(id(i), *d)))))
}
