//! Weights in GPU memory: one `cuMemAlloc` allocation per tensor (as a trainer or an inference
//! engine holding separate parameters has them), usable as a refit source or destination, plus the
//! device-side version of the synthetic update (the digests are `crate::verify`'s).

use cudarc::driver::CudaStream;

use super::{DeviceBuffer, Gpu, GpuError};
use crate::memory::{DestinationMemory, MemorySpace, Region, SourceMemory, StagingBuffer};
use crate::plan::{RefitPlan, Segment};

/// Per-tensor device buffers (`None` where this rank holds none of a tensor).
pub struct DeviceTensors {
    gpu: Gpu,
    buffers: Vec<Option<DeviceBuffer>>,
}

impl DeviceTensors {
    /// Allocates one buffer per `Some(size)`.
    pub fn alloc(gpu: &Gpu, sizes: impl IntoIterator<Item = Option<u64>>) -> Result<DeviceTensors, GpuError> {
        let buffers = sizes
            .into_iter()
            .map(|s| s.filter(|&b| b > 0).map(|b| gpu.alloc(b as usize)).transpose())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceTensors { gpu: gpu.clone(), buffers })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Tensor `i`'s buffer.
    pub fn buffer(&self, i: usize) -> Option<&DeviceBuffer> {
        self.buffers.get(i)?.as_ref()
    }

    /// Total bytes held.
    pub fn total_bytes(&self) -> u64 {
        self.buffers.iter().flatten().map(|b| b.len() as u64).sum()
    }

    fn region(&self, i: usize) -> Option<Region> {
        let b = self.buffer(i)?;
        Some(Region {
            space: MemorySpace::Device { ordinal: self.gpu.ordinal() as u32 },
            addr: b.ptr(),
            len: b.len() as u64,
        })
    }

    /// Rewrites this rank's shard from `seed`: for every segment of `plan`, its source rows get the
    /// synthetic content of the full tensor's bytes they correspond to (as [`crate::digest::fill`]).
    pub fn fill_shard(&self, plan: &RefitPlan, seed: u64, stream: &CudaStream) -> Result<(), GpuError> {
        for seg in plan.segments() {
            let buf = self.buffer(seg.tensor as usize).ok_or_else(|| missing(seg))?;
            // SAFETY: the plan's source extents were checked against the buffer sizes when the
            // buffers were allocated from the same plan.
            unsafe {
                self.gpu.fill2d(
                    stream,
                    buf.ptr() + seg.src_offset,
                    seg.rows,
                    seg.width,
                    seg.src_pitch,
                    crate::digest::tensor_seed(seed, seg.tensor),
                    seg.dst_offset,
                    seg.dst_pitch,
                )?;
            }
        }
        Ok(())
    }
}

fn missing(seg: &Segment) -> GpuError {
    GpuError::msg(
        "refit memory",
        format!("tensor {} has no device buffer but the plan has a segment of it", seg.tensor),
    )
}

// SAFETY: the regions are this object's own allocations, valid until it is dropped; the engine
// borrows the object for the whole refit.
unsafe impl SourceMemory for DeviceTensors {
    fn tensor_count(&self) -> usize {
        self.buffers.len()
    }
    fn source_region(&self, tensor: usize) -> Option<Region> {
        self.region(tensor)
    }
}

// SAFETY: as above; the engine holds the object mutably for the whole refit.
unsafe impl DestinationMemory for DeviceTensors {
    fn tensor_count(&self) -> usize {
        self.buffers.len()
    }
    fn destination_region(&mut self, tensor: usize) -> Option<Region> {
        self.region(tensor)
    }
}

/// A staging buffer in device memory (exportable over CUDA IPC).
pub struct DeviceStaging(pub DeviceBuffer);

impl StagingBuffer for DeviceStaging {
    fn region(&self) -> Region {
        Region {
            space: MemorySpace::Device { ordinal: self.0.gpu().ordinal() as u32 },
            addr: self.0.ptr(),
            len: self.0.len() as u64,
        }
    }
}
