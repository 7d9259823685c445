//! The deterministic packing plan: which bytes of which tensor travel in which bucket, at which
//! offset.
//!
//! Senders and receivers each compute the plan from the same inputs (the manifest, the bucket size,
//! the alignment and the sender's shard coordinates) and compare [`RefitPlan::hash`] at the
//! handshake, so no per-bucket metadata ever travels.
//!
//! Every piece of a plan is a [`Segment`]: a 2-D copy of `rows × width` bytes from the sender's
//! source shard (pitch `src_pitch`) to the receiver's full tensor (pitch `dst_pitch`), placed
//! densely (pitch `width`) at `bucket_offset` inside a bucket. A contiguous piece is one row.
//!
//! Packing rules, in manifest order:
//! - every segment starts at an `align_bytes`-aligned offset of its bucket;
//! - a segment that fits in one bucket is never split: it goes to the next bucket when the
//!   current one has too little room left;
//! - a segment larger than a bucket is split, starting in the current bucket's remaining room:
//!   by rows, and a single row longer than a bucket by bytes. Contiguous segments are one row, so
//!   they are split by bytes and fill their buckets completely.

use std::fmt;
use std::ops::Range;

use rlplane_api::model::{TensorSpec, TpSplit, pipeline_stages};

/// Version of the packing algorithm and of the hash's encoding. Bump it on any change to either,
/// so that ranks running different builds refuse each other at the handshake.
pub const PLAN_FORMAT_VERSION: u32 = 2;

/// Where a sender's bytes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SenderLayout {
    /// The sender holds every tensor whole (a gathered trainer rank 0).
    Full,
    /// The sender holds one tensor-parallel shard of the tensors of one pipeline stage, or its
    /// fully-sharded (FSDP) rows of that shard.
    Sharded(ShardCoords),
}

/// A sharded sender's coordinates in the trainer's tensor-, pipeline- and fully-sharded
/// data-parallel grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShardCoords {
    /// Tensor-parallel index, `< tp_size`.
    pub tp: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline stage, `< pp_size`.
    pub pp: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Index in the fully-sharded data-parallel group, `< fsdp_size`.
    pub fsdp: u32,
    /// Fully-sharded data-parallel size (1: the sender holds its tensor-parallel shard whole).
    pub fsdp_size: u32,
}

impl ShardCoords {
    /// Tensor-parallel rank `tp` of `tp_size` in stage `pp` of `pp_size`, holding its shard whole.
    pub fn tensor_parallel(tp: u32, tp_size: u32, pp: u32, pp_size: u32) -> ShardCoords {
        ShardCoords { tp, tp_size, pp, pp_size, fsdp: 0, fsdp_size: 1 }
    }

    /// The same sender holding only its rows `fsdp` of `fsdp_size` of each tensor-parallel shard.
    pub fn fully_sharded(self, fsdp: u32, fsdp_size: u32) -> ShardCoords {
        ShardCoords { fsdp, fsdp_size, ..self }
    }
}

/// One 2-D copy of the plan: `rows` rows of `width` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Index of the tensor in the manifest.
    pub tensor: u32,
    /// Rows (1 for a contiguous span).
    pub rows: u64,
    /// Bytes per row.
    pub width: u64,
    /// Offset of the first row in the sender's source shard of the tensor.
    pub src_offset: u64,
    /// Distance between rows in the source shard.
    pub src_pitch: u64,
    /// Offset of the first row in the receiver's full tensor.
    pub dst_offset: u64,
    /// Distance between rows in the full tensor.
    pub dst_pitch: u64,
    /// The bucket carrying it.
    pub bucket: u32,
    /// Offset inside the bucket (aligned); rows lie densely from there.
    pub bucket_offset: u64,
}

impl Segment {
    /// Bytes the segment carries (`rows × width`).
    pub fn bytes(&self) -> u64 {
        self.rows * self.width
    }

    /// Whether the source bytes form one contiguous span.
    pub fn src_contiguous(&self) -> bool {
        self.rows <= 1 || self.src_pitch == self.width
    }

    /// Whether the destination bytes form one contiguous span.
    pub fn dst_contiguous(&self) -> bool {
        self.rows <= 1 || self.dst_pitch == self.width
    }

    /// Bytes from the first source byte to one past the last (the span a source view must cover).
    pub fn src_extent(&self) -> u64 {
        if self.rows == 0 { 0 } else { (self.rows - 1) * self.src_pitch + self.width }
    }

    /// Bytes from the first destination byte to one past the last.
    pub fn dst_extent(&self) -> u64 {
        if self.rows == 0 { 0 } else { (self.rows - 1) * self.dst_pitch + self.width }
    }
}

/// One bucket: a run of consecutive segments.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Bucket {
    /// Bucket index (0-based, in sending order).
    pub index: u32,
    /// Indices of its segments in [`RefitPlan::segments`].
    pub segments: Range<usize>,
    /// Bytes of staging buffer it uses: the end of its last segment, padding included.
    pub used_bytes: u64,
    /// Bytes it carries on the wire: the sum of its segments (padding never travels).
    pub payload_bytes: u64,
}

/// Per-tensor sizes a plan expects of the memory on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorExtent {
    /// Bytes of this sender's source shard of the tensor; `None` when this sender sends none of it.
    pub source_bytes: Option<u64>,
    /// Bytes of the full tensor at the receiver.
    pub dest_bytes: u64,
}

/// Bad plan inputs. Each names the field and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A setting is out of range.
    #[error("{field}: {message}")]
    Setting {
        /// Field path (e.g. `spec.refit.alignBytes`).
        field: &'static str,
        /// What is wrong and what to do.
        message: String,
    },
    /// A tensor of the manifest cannot be planned.
    #[error("tensor `{name}` (index {index}): {message}")]
    Tensor {
        /// Manifest index.
        index: usize,
        /// Tensor name.
        name: String,
        /// What is wrong and what to do.
        message: String,
    },
}

/// What the handshake compares: the plan's hash and the inputs a human needs to see on a mismatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanIdentity {
    /// [`PLAN_FORMAT_VERSION`] of the side that computed it.
    pub format_version: u32,
    /// Stable hash of every input.
    pub hash: u64,
    /// Number of tensors in the manifest.
    pub manifest_len: u64,
    /// Bytes of the whole manifest.
    pub manifest_bytes: u64,
    /// Bucket size.
    pub bucket_bytes: u64,
    /// Alignment of segments in a bucket.
    pub align_bytes: u64,
    /// Bytes this sender's stream carries.
    pub stream_bytes: u64,
}

impl PlanIdentity {
    /// Length of [`PlanIdentity::encode`]'s output.
    pub const ENCODED_LEN: usize = 4 + 8 * 6;

    /// Fixed little-endian encoding, for the handshake.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..4].copy_from_slice(&self.format_version.to_le_bytes());
        for (i, v) in
            [self.hash, self.manifest_len, self.manifest_bytes, self.bucket_bytes, self.align_bytes, self.stream_bytes]
                .into_iter()
                .enumerate()
        {
            b[4 + 8 * i..12 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Decodes [`PlanIdentity::encode`]'s output.
    pub fn decode(b: &[u8]) -> Option<PlanIdentity> {
        if b.len() != Self::ENCODED_LEN {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[4 + 8 * i..12 + 8 * i].try_into().expect("8 bytes"));
        Some(PlanIdentity {
            format_version: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            hash: u64_at(0),
            manifest_len: u64_at(1),
            manifest_bytes: u64_at(2),
            bucket_bytes: u64_at(3),
            align_bytes: u64_at(4),
            stream_bytes: u64_at(5),
        })
    }

    /// Explains a mismatch between this side (`ours`, named `us`) and the peer's.
    pub fn mismatch(&self, us: &str, theirs: &PlanIdentity, them: &str) -> String {
        format!(
            "refit plans differ: {us} has {self}; {them} has {theirs}. Every rank must compute the plan from the same \
             model manifest and spec.refit settings (bufferBytes, alignBytes) with the same rlplane version: check \
             that both run the same plan.json and image"
        )
    }
}

impl fmt::Display for PlanIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "manifest of {} tensors ({} bytes), bucket {} bytes, alignment {} bytes, stream of {} bytes, plan format \
             {}, hash {:016x}",
            self.manifest_len,
            self.manifest_bytes,
            self.bucket_bytes,
            self.align_bytes,
            self.stream_bytes,
            self.format_version,
            self.hash
        )
    }
}

/// The packing plan of one sender's stream. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefitPlan {
    layout: SenderLayout,
    bucket_bytes: u64,
    align_bytes: u64,
    manifest_bytes: u64,
    tensors: Vec<TensorExtent>,
    names: Vec<String>,
    segments: Vec<Segment>,
    buckets: Vec<Bucket>,
    hash: u64,
}

/// Largest tensor a plan accepts (2^50 bytes, 1 PiB): far above any real tensor, far below
/// where offsets could overflow.
const MAX_TENSOR_BYTES: u64 = 1 << 50;

impl RefitPlan {
    /// The plan of one sender holding every tensor whole.
    pub fn new(manifest: &[TensorSpec], bucket_bytes: u64, align_bytes: u64) -> Result<RefitPlan, PlanError> {
        Self::build(manifest, bucket_bytes, align_bytes, SenderLayout::Full)
    }

    /// The plan of one sharded sender: for the tensors of its pipeline stage (stages from
    /// [`pipeline_stages`]), its tensor-parallel slice. `Rows` tensors: a contiguous range of rows
    /// (dimension 0). `Columns` tensors (two or more dimensions): a range of dimension 1 in every
    /// row, strided in the full tensor; a vector marked `Columns` is split like `Rows`.
    /// `Replicated` tensors: sent whole by `tp = 0` only. Uneven splits give rank `t` the range
    /// `[n·t/tp, n·(t+1)/tp)`, so the union over all ranks covers each byte exactly once. The
    /// source shard is stored contiguously in its own slice layout (rows × slice width).
    ///
    /// A fully-sharded sender (`fsdp_size > 1`) then holds only its `torch.chunk` piece of that
    /// slice's dimension 0, as FSDP2 does: chunks of `⌈n/fsdp_size⌉` rows, so the last ranks may
    /// hold fewer rows or none.
    pub fn sharded(
        manifest: &[TensorSpec],
        bucket_bytes: u64,
        align_bytes: u64,
        coords: ShardCoords,
    ) -> Result<RefitPlan, PlanError> {
        Self::build(manifest, bucket_bytes, align_bytes, SenderLayout::Sharded(coords))
    }

    /// Builds the plan for any layout.
    pub fn build(
        manifest: &[TensorSpec],
        bucket_bytes: u64,
        align_bytes: u64,
        layout: SenderLayout,
    ) -> Result<RefitPlan, PlanError> {
        check_settings(bucket_bytes, align_bytes, layout)?;
        let mut tensors = Vec::with_capacity(manifest.len());
        let mut manifest_bytes = 0u64;
        for (index, t) in manifest.iter().enumerate() {
            let bytes = checked_tensor_bytes(t).ok_or_else(|| PlanError::Tensor {
                index,
                name: t.name.clone(),
                message: format!(
                    "shape {:?} of {} is larger than {MAX_TENSOR_BYTES} bytes or has a zero dimension; fix the manifest",
                    t.shape,
                    t.dtype.as_str()
                ),
            })?;
            manifest_bytes += bytes;
            tensors.push(TensorExtent { source_bytes: None, dest_bytes: bytes });
        }
        let stages = match layout {
            SenderLayout::Full => None,
            SenderLayout::Sharded(c) => Some(pipeline_stages(manifest, c.pp_size)),
        };
        let mut packer = Packer::new(bucket_bytes, align_bytes);
        for (index, t) in manifest.iter().enumerate() {
            let slice = match layout {
                SenderLayout::Full => Some(full_slice(t)),
                SenderLayout::Sharded(c) => {
                    let stage = stages.as_ref().map_or(0, |s| s[index]);
                    if stage == c.pp { shard_slice(t, c) } else { None }
                }
            };
            let Some(slice) = slice else { continue };
            tensors[index].source_bytes = Some(slice.rows * slice.width);
            if slice.rows * slice.width == 0 {
                continue;
            }
            packer.place(index as u32, slice);
        }
        let (segments, buckets) = packer.finish();
        let hash = plan_hash(manifest, bucket_bytes, align_bytes, layout);
        let names = manifest.iter().map(|t| t.name.clone()).collect();
        Ok(RefitPlan { layout, bucket_bytes, align_bytes, manifest_bytes, tensors, names, segments, buckets, hash })
    }

    /// The sender's layout.
    pub fn layout(&self) -> SenderLayout {
        self.layout
    }

    /// Bucket size (the size of a staging buffer).
    pub fn bucket_bytes(&self) -> u64 {
        self.bucket_bytes
    }

    /// Alignment of every segment's bucket offset.
    pub fn align_bytes(&self) -> u64 {
        self.align_bytes
    }

    /// Every segment, in sending order; a segment's index here is stable for identical inputs, so
    /// both sides can name (and checksum) segments by index.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Every bucket, in sending order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The segments of one bucket.
    pub fn bucket_segments(&self, bucket: usize) -> &[Segment] {
        &self.segments[self.buckets[bucket].segments.clone()]
    }

    /// Per-tensor sizes expected of source and destination memory, in manifest order.
    pub fn tensors(&self) -> &[TensorExtent] {
        &self.tensors
    }

    /// Name of tensor `i` (for errors).
    pub fn tensor_name(&self, i: usize) -> &str {
        self.names.get(i).map_or("?", String::as_str)
    }

    /// Largest staging space any bucket uses (a staging buffer never needs more).
    pub fn max_bucket_used_bytes(&self) -> u64 {
        self.buckets.iter().map(|b| b.used_bytes).max().unwrap_or(0)
    }

    /// Bytes this sender's stream carries (the sum of all segments).
    pub fn stream_bytes(&self) -> u64 {
        self.buckets.iter().map(|b| b.payload_bytes).sum()
    }

    /// Bytes of the whole manifest.
    pub fn manifest_bytes(&self) -> u64 {
        self.manifest_bytes
    }

    /// Stable hash of every input (manifest, bucket size, alignment, sender layout) and of
    /// [`PLAN_FORMAT_VERSION`]: xxh3-64 of a canonical byte encoding.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// What the handshake compares.
    pub fn identity(&self) -> PlanIdentity {
        PlanIdentity {
            format_version: PLAN_FORMAT_VERSION,
            hash: self.hash,
            manifest_len: self.tensors.len() as u64,
            manifest_bytes: self.manifest_bytes,
            bucket_bytes: self.bucket_bytes,
            align_bytes: self.align_bytes,
            stream_bytes: self.stream_bytes(),
        }
    }
}

fn check_settings(bucket_bytes: u64, align_bytes: u64, layout: SenderLayout) -> Result<(), PlanError> {
    if bucket_bytes == 0 {
        return Err(PlanError::Setting {
            field: "spec.refit.bufferBytes",
            message: "must be at least 1 (use e.g. 268435456 for 256 MiB buckets)".into(),
        });
    }
    if !align_bytes.is_power_of_two() {
        return Err(PlanError::Setting {
            field: "spec.refit.alignBytes",
            message: format!("{align_bytes} is not a power of two; use e.g. 256"),
        });
    }
    if align_bytes > bucket_bytes {
        return Err(PlanError::Setting {
            field: "spec.refit.alignBytes",
            message: format!("{align_bytes} exceeds bufferBytes = {bucket_bytes}; use a smaller alignment"),
        });
    }
    if let SenderLayout::Sharded(c) = layout {
        if c.tp_size == 0 || c.tp >= c.tp_size {
            return Err(PlanError::Setting {
                field: "trainer.parallelism.tensor",
                message: format!(
                    "sender tensor-parallel index {} is not below the size {}; rebuild the plan",
                    c.tp, c.tp_size
                ),
            });
        }
        if c.fsdp_size == 0 || c.fsdp >= c.fsdp_size {
            return Err(PlanError::Setting {
                field: "trainer.parallelism.fsdp",
                message: format!(
                    "sender fully-sharded index {} is not below the size {}; rebuild the plan",
                    c.fsdp, c.fsdp_size
                ),
            });
        }
        if c.pp_size == 0 || c.pp >= c.pp_size {
            return Err(PlanError::Setting {
                field: "trainer.parallelism.pipeline",
                message: format!(
                    "sender pipeline stage {} is not below the size {}; rebuild the plan",
                    c.pp, c.pp_size
                ),
            });
        }
    }
    Ok(())
}

/// A tensor's size in bytes, or `None` when it is absurd (zero dimension, overflow, over 1 PiB).
fn checked_tensor_bytes(t: &TensorSpec) -> Option<u64> {
    let mut n = t.dtype.size_bytes();
    for &d in &t.shape {
        if d == 0 {
            return None;
        }
        n = n.checked_mul(d)?;
    }
    (n <= MAX_TENSOR_BYTES).then_some(n)
}

/// The part of a tensor one sender sends, before packing.
#[derive(Clone, Copy, Debug)]
struct Slice {
    rows: u64,
    width: u64,
    src_offset: u64,
    src_pitch: u64,
    dst_offset: u64,
    dst_pitch: u64,
}

fn full_slice(t: &TensorSpec) -> Slice {
    let bytes = t.size_bytes();
    Slice { rows: 1, width: bytes, src_offset: 0, src_pitch: bytes, dst_offset: 0, dst_pitch: bytes }
}

/// `[n·t/tp, n·(t+1)/tp)`: balanced, and the ranges of all ranks tile `[0, n)`.
fn split_range(n: u64, t: u32, tp: u32) -> (u64, u64) {
    let start = (n as u128 * t as u128 / tp as u128) as u64;
    let end = (n as u128 * (t as u128 + 1) / tp as u128) as u64;
    (start, end)
}

/// `torch.chunk(n, parts)[i]`: chunks of `⌈n/parts⌉`, the last ones shorter or empty.
fn chunk_range(n: u64, i: u32, parts: u32) -> (u64, u64) {
    let size = n.div_ceil(parts as u64);
    let start = (size * i as u64).min(n);
    (start, (start + size).min(n))
}

/// The shape of sender `c`'s shard of `t` (the pipeline stage aside), as [`RefitPlan::sharded`]
/// slices it: `None` where the sender holds none of it (a replicated tensor off `tp = 0`, or an
/// empty fully-sharded chunk).
pub fn shard_shape(t: &TensorSpec, c: ShardCoords) -> Option<Vec<u64>> {
    shard_box(t, c).map(|(_, shape)| shape)
}

/// Where sender `c`'s shard of `t` starts in the full tensor: the index of its first element
/// along each dimension (what a DTensor calls its global offset); `None` as for [`shard_shape`].
pub fn shard_offset(t: &TensorSpec, c: ShardCoords) -> Option<Vec<u64>> {
    shard_box(t, c).map(|(offset, _)| offset)
}

/// (offset, shape) of sender `c`'s shard of `t`: a box of the full tensor.
fn shard_box(t: &TensorSpec, c: ShardCoords) -> Option<(Vec<u64>, Vec<u64>)> {
    let mut shape = t.shape.clone();
    let mut offset = vec![0; shape.len()];
    match t.effective_split() {
        TpSplit::Replicated if c.tp != 0 => return None,
        TpSplit::Replicated => {}
        TpSplit::Columns if shape.len() >= 2 => {
            let (c0, c1) = split_range(shape[1], c.tp, c.tp_size);
            (offset[1], shape[1]) = (c0, c1 - c0);
        }
        TpSplit::Rows | TpSplit::Columns => {
            let (r0, r1) = split_range(shape[0], c.tp, c.tp_size);
            (offset[0], shape[0]) = (r0, r1 - r0);
        }
    }
    let (f0, f1) = chunk_range(shape[0], c.fsdp, c.fsdp_size);
    offset[0] += f0;
    shape[0] = f1 - f0;
    (shape[0] > 0).then_some((offset, shape))
}

/// The sender's box of `t` ([`shard_box`]) as the part of the full tensor it sends: a contiguous
/// byte range, or for a `Columns` split of two or more dimensions rows strided by the full row.
fn shard_slice(t: &TensorSpec, c: ShardCoords) -> Option<Slice> {
    let (offset, shape) = shard_box(t, c)?;
    let row_bytes = t.size_bytes() / t.shape[0];
    if t.effective_split() == TpSplit::Columns && t.shape.len() >= 2 {
        let unit = t.shape[2..].iter().product::<u64>() * t.dtype.size_bytes();
        let width = shape[1] * unit;
        return Some(Slice {
            rows: shape[0],
            width,
            src_offset: 0,
            src_pitch: width,
            dst_offset: offset[0] * row_bytes + offset[1] * unit,
            dst_pitch: row_bytes,
        });
    }
    let len = shape[0] * row_bytes;
    Some(Slice {
        rows: 1,
        width: len,
        src_offset: 0,
        src_pitch: len,
        dst_offset: offset[0] * row_bytes,
        dst_pitch: len,
    })
}

/// Which part of a slice a segment takes: rows `[row0, row0 + rows)`, bytes
/// `[byte0, byte0 + width)` of each.
#[derive(Clone, Copy)]
struct Cut {
    row0: u64,
    rows: u64,
    byte0: u64,
    width: u64,
}

struct Packer {
    bucket_bytes: u64,
    align_bytes: u64,
    segments: Vec<Segment>,
    buckets: Vec<Bucket>,
    /// Index of the current bucket.
    current: u32,
    /// First segment of the current bucket.
    first: usize,
    /// End of the last segment placed in the current bucket.
    cursor: u64,
}

impl Packer {
    fn new(bucket_bytes: u64, align_bytes: u64) -> Packer {
        Packer { bucket_bytes, align_bytes, segments: Vec::new(), buckets: Vec::new(), current: 0, first: 0, cursor: 0 }
    }

    fn aligned_cursor(&self) -> u64 {
        self.cursor.next_multiple_of(self.align_bytes)
    }

    fn close_bucket(&mut self) {
        if self.segments.len() == self.first {
            return;
        }
        let segs = &self.segments[self.first..];
        self.buckets.push(Bucket {
            index: self.current,
            segments: self.first..self.segments.len(),
            used_bytes: self.cursor,
            payload_bytes: segs.iter().map(Segment::bytes).sum(),
        });
        self.current += 1;
        self.first = self.segments.len();
        self.cursor = 0;
    }

    fn push(&mut self, tensor: u32, s: &Slice, cut: Cut, at: u64) {
        let Cut { row0, rows, byte0, width } = cut;
        self.segments.push(Segment {
            tensor,
            rows,
            width,
            src_offset: s.src_offset + row0 * s.src_pitch + byte0,
            src_pitch: s.src_pitch,
            dst_offset: s.dst_offset + row0 * s.dst_pitch + byte0,
            dst_pitch: s.dst_pitch,
            bucket: self.current,
            bucket_offset: at,
        });
        self.cursor = at + rows * width;
    }

    fn place(&mut self, tensor: u32, s: Slice) {
        // A slice contiguous on both sides is one row, so that it can be split anywhere.
        let s = if s.rows > 1 && s.src_pitch == s.width && s.dst_pitch == s.width {
            let bytes = s.rows * s.width;
            Slice { rows: 1, width: bytes, src_pitch: bytes, dst_pitch: bytes, ..s }
        } else {
            s
        };
        let total = s.rows * s.width;
        if total <= self.bucket_bytes {
            // Fits in one bucket: never split it.
            if self.aligned_cursor() + total > self.bucket_bytes {
                self.close_bucket();
            }
            let at = self.aligned_cursor();
            self.push(tensor, &s, Cut { row0: 0, rows: s.rows, byte0: 0, width: s.width }, at);
            return;
        }
        // Larger than a bucket: fill the current bucket's room, then whole buckets.
        let mut row = 0;
        while row < s.rows {
            let at = self.aligned_cursor();
            let room = self.bucket_bytes.saturating_sub(at);
            if room == 0 {
                self.close_bucket();
                continue;
            }
            if s.width <= room {
                let n = (s.rows - row).min(room / s.width);
                self.push(tensor, &s, Cut { row0: row, rows: n, byte0: 0, width: s.width }, at);
                row += n;
            } else if s.width > self.bucket_bytes {
                // A row longer than a bucket: split it by bytes.
                let mut byte = 0;
                while byte < s.width {
                    let at = self.aligned_cursor();
                    let room = self.bucket_bytes.saturating_sub(at);
                    if room == 0 {
                        self.close_bucket();
                        continue;
                    }
                    let n = (s.width - byte).min(room);
                    self.push(tensor, &s, Cut { row0: row, rows: 1, byte0: byte, width: n }, at);
                    byte += n;
                }
                row += 1;
            } else {
                // The next row fits in an empty bucket: do not split it.
                self.close_bucket();
            }
        }
    }

    fn finish(mut self) -> (Vec<Segment>, Vec<Bucket>) {
        self.close_bucket();
        (self.segments, self.buckets)
    }
}

/// xxh3-64 over a canonical encoding of every input: a domain tag, the format version, the layout,
/// the settings and each tensor (name, dtype, shape, split as given).
fn plan_hash(manifest: &[TensorSpec], bucket_bytes: u64, align_bytes: u64, layout: SenderLayout) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut put = |b: &[u8]| h.update(b);
    let bytes = |put: &mut dyn FnMut(&[u8]), b: &[u8]| {
        put(&(b.len() as u64).to_le_bytes());
        put(b);
    };
    bytes(&mut put, b"rlplane.refit.plan");
    put(&PLAN_FORMAT_VERSION.to_le_bytes());
    match layout {
        SenderLayout::Full => put(&[0]),
        SenderLayout::Sharded(c) => {
            put(&[1]);
            for v in [c.tp, c.tp_size, c.pp, c.pp_size, c.fsdp, c.fsdp_size] {
                put(&v.to_le_bytes());
            }
        }
    }
    put(&bucket_bytes.to_le_bytes());
    put(&align_bytes.to_le_bytes());
    put(&(manifest.len() as u64).to_le_bytes());
    for t in manifest {
        bytes(&mut put, t.name.as_bytes());
        bytes(&mut put, t.dtype.as_str().as_bytes());
        put(&(t.shape.len() as u64).to_le_bytes());
        for d in &t.shape {
            put(&d.to_le_bytes());
        }
        put(&[match t.tp_split {
            None => 0,
            Some(TpSplit::Replicated) => 1,
            Some(TpSplit::Rows) => 2,
            Some(TpSplit::Columns) => 3,
        }]);
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use rlplane_api::model::{DType, ModelPreset};

    use super::*;

    #[test]
    fn a_tensor_larger_than_a_bucket_is_chunked_not_refused() {
        // NeMo-RL's colocated path failed on an embedding bigger than its buffer; ours splits it.
        let m = vec![TensorSpec::new("embed", DType::Bf16, vec![1000, 64])];
        let p = RefitPlan::new(&m, 4096, 256).unwrap();
        assert_eq!(p.stream_bytes(), 128_000);
        assert_eq!(p.buckets().len(), 128_000usize.div_ceil(4096));
        assert!(p.buckets().iter().all(|b| b.used_bytes <= 4096));
    }

    #[test]
    fn columns_shards_are_strided_in_the_destination() {
        let m = vec![TensorSpec::with_split("o", DType::Bf16, vec![4, 8], TpSplit::Columns)];
        let c = ShardCoords::tensor_parallel(1, 2, 0, 1);
        let p = RefitPlan::sharded(&m, 1 << 20, 64, c).unwrap();
        let s = p.segments()[0];
        assert_eq!((s.rows, s.width, s.src_pitch, s.dst_offset, s.dst_pitch), (4, 8, 8, 8, 16));
        assert!(s.src_contiguous() && !s.dst_contiguous());
        assert_eq!(p.tensors()[0].source_bytes, Some(32));
    }

    #[test]
    fn fully_sharded_senders_hold_torch_chunk_rows() {
        // torch.chunk: 5 rows in 3 → 2, 2, 1; 5 in 4 → 2, 2, 1, none; a Columns tensor is
        // chunked along its rows, inside the tensor-parallel column slice.
        let m = vec![
            TensorSpec::new("w", DType::F32, vec![5, 2]),
            TensorSpec::new("b", DType::F32, vec![3]),
            TensorSpec::with_split("o", DType::Bf16, vec![5, 4], TpSplit::Columns),
        ];
        let rows = |fsdp_size: u32, tp: u32, tp_size: u32| -> Vec<Vec<Option<Vec<u64>>>> {
            (0..fsdp_size)
                .map(|f| {
                    let c = ShardCoords::tensor_parallel(tp, tp_size, 0, 1).fully_sharded(f, fsdp_size);
                    m.iter().map(|t| shard_shape(t, c)).collect()
                })
                .collect()
        };
        let s = |v: &[u64]| Some(v.to_vec());
        assert_eq!(
            rows(3, 0, 1),
            vec![
                vec![s(&[2, 2]), s(&[1]), s(&[2, 4])],
                vec![s(&[2, 2]), s(&[1]), s(&[2, 4])],
                vec![s(&[1, 2]), s(&[1]), s(&[1, 4])],
            ]
        );
        assert_eq!(rows(4, 0, 1)[3], vec![None, None, None]);
        assert_eq!(rows(4, 0, 1)[2], vec![s(&[1, 2]), s(&[1]), s(&[1, 4])]);
        // Under tensor parallelism 2 (`w`: rows 2..5 on tp 1; `o`: columns 2..4): rows of the shard.
        assert_eq!(rows(2, 1, 2), vec![vec![s(&[2, 2]), None, s(&[3, 2])], vec![s(&[1, 2]), None, s(&[2, 2])]]);
        let c = ShardCoords::tensor_parallel(1, 2, 0, 1).fully_sharded(1, 2);
        let p = RefitPlan::sharded(&m, 1 << 20, 1, c).unwrap();
        let by_tensor = |i: u32| *p.segments().iter().find(|s| s.tensor == i).unwrap();
        // `w` rows 2..5 of tp 1, then its chunk 1: row 4 (16 bytes at byte 32).
        let w = by_tensor(0);
        assert_eq!((w.rows, w.width, w.dst_offset), (1, 8, 32));
        // `o` rows 3..5 (chunk 1 of 5 rows in 2), columns 2..4: 2 rows of 4 bytes at pitch 8.
        let o = by_tensor(2);
        assert_eq!((o.rows, o.width, o.dst_offset, o.dst_pitch), (2, 4, 3 * 8 + 4, 8));
        // Where those parts start in the full tensors (a DTensor's global offset).
        assert_eq!(
            m.iter().map(|t| shard_offset(t, c)).collect::<Vec<_>>(),
            vec![Some(vec![4, 0]), None, Some(vec![3, 2])]
        );
        // Another fully-sharded index is another plan.
        let whole = RefitPlan::sharded(&m, 1 << 20, 1, ShardCoords::tensor_parallel(1, 2, 0, 1)).unwrap();
        assert_ne!(whole.hash(), p.hash());
        let e = RefitPlan::sharded(&m, 4096, 1, c.fully_sharded(2, 2)).unwrap_err();
        assert!(e.to_string().contains("parallelism.fsdp"), "{e}");
    }

    #[test]
    fn bad_settings_name_the_field() {
        let m = ModelPreset::Tiny.tensors();
        let e = RefitPlan::new(&m, 4096, 3).unwrap_err();
        assert!(e.to_string().contains("spec.refit.alignBytes"), "{e}");
        let e = RefitPlan::new(&m, 0, 1).unwrap_err();
        assert!(e.to_string().contains("spec.refit.bufferBytes"), "{e}");
        let e = RefitPlan::sharded(&m, 4096, 1, ShardCoords::tensor_parallel(2, 2, 0, 1)).unwrap_err();
        assert!(e.to_string().contains("parallelism.tensor"), "{e}");
    }

    #[test]
    fn identity_round_trips() {
        let p = RefitPlan::new(&ModelPreset::Tiny.tensors(), 1 << 16, 256).unwrap();
        let id = p.identity();
        assert_eq!(PlanIdentity::decode(&id.encode()), Some(id));
        assert_eq!(PlanIdentity::decode(&id.encode()[1..]), None);
    }
}
