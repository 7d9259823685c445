//! Memory that refit reads from and writes to: the trainer's per-tensor source shards, the
//! generation engine's per-tensor destinations, and staging buffers.
//!
//! Memory is described by [`Region`]s (a space, an address and a length) rather than by Rust
//! slices, because the GPU transports move device memory that the host cannot dereference and
//! because a refit hands disjoint parts of one destination to several concurrent streams, I/O
//! tasks and copy threads. The engine borrows the memory object for the whole refit and guarantees
//! that nothing touches a region after the refit returns (including when its future is dropped:
//! see [`AccessFence`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Where a region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemorySpace {
    /// Host memory the process can dereference.
    Host,
    /// Memory of a GPU (by its ordinal in this process).
    Device {
        /// CUDA device ordinal.
        ordinal: u32,
    },
}

/// A span of memory: its space, its address there (a host pointer's address or a CUdeviceptr)
/// and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    /// Where it lives.
    pub space: MemorySpace,
    /// Address of the first byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

impl Region {
    /// A host region covering `bytes` (the address only; no borrow is kept).
    pub fn host(bytes: &mut [u8]) -> Region {
        Region {
            space: MemorySpace::Host,
            addr: bytes.as_mut_ptr().expose_provenance() as u64,
            len: bytes.len() as u64,
        }
    }

    /// The sub-region `[offset, offset + len)`. The caller checks the bounds.
    pub fn sub(&self, offset: u64, len: u64) -> Region {
        debug_assert!(offset + len <= self.len, "sub-region {offset}+{len} outside a region of {}", self.len);
        Region { space: self.space, addr: self.addr + offset, len }
    }

    /// The region as a host slice.
    ///
    /// # Safety
    /// The region must be host memory, valid for reads of `len` bytes for `'a`, and not written
    /// meanwhile.
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        debug_assert_eq!(self.space, MemorySpace::Host);
        if self.len == 0 {
            return &[];
        }
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(std::ptr::with_exposed_provenance(self.addr as usize), self.len as usize) }
    }

    /// The region as a mutable host slice.
    ///
    /// # Safety
    /// The region must be host memory, valid for writes of `len` bytes for `'a`, and not accessed
    /// otherwise meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<'a>(&self) -> &'a mut [u8] {
        debug_assert_eq!(self.space, MemorySpace::Host);
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: guaranteed by the caller.
        unsafe {
            std::slice::from_raw_parts_mut(std::ptr::with_exposed_provenance_mut(self.addr as usize), self.len as usize)
        }
    }
}

/// The trainer side: a read view of this sender's shard of each tensor, as a trainer holding one
/// allocation per parameter exposes it.
///
/// # Safety
/// Every region returned must stay valid for reads, and unwritten, for as long as the object is
/// borrowed.
pub unsafe trait SourceMemory: Sync {
    /// Number of tensors (the manifest's length).
    fn tensor_count(&self) -> usize;
    /// This sender's shard of tensor `tensor`, laid out contiguously; `None` when it holds none.
    fn source_region(&self, tensor: usize) -> Option<Region>;
}

/// The generation side: a writable destination per full tensor, as an inference engine holding
/// separate weight tensors exposes it.
///
/// # Safety
/// Every region returned must stay valid for writes, and otherwise untouched, for as long as the
/// object is mutably borrowed.
pub unsafe trait DestinationMemory: Send {
    /// Number of tensors (the manifest's length).
    fn tensor_count(&self) -> usize;
    /// The full tensor `tensor`; `None` when this receiver does not hold it.
    fn destination_region(&mut self, tensor: usize) -> Option<Region>;
}

/// Host memory: one buffer per tensor. Serves as a sender's source shards and as a receiver's
/// destinations.
#[derive(Debug, Default)]
pub struct HostTensors {
    tensors: Vec<Vec<u8>>,
}

impl HostTensors {
    /// Zeroed buffers of the given sizes.
    pub fn zeroed(sizes: impl IntoIterator<Item = u64>) -> HostTensors {
        HostTensors { tensors: sizes.into_iter().map(|n| vec![0u8; n as usize]).collect() }
    }

    /// Wraps existing buffers.
    pub fn from_vecs(tensors: Vec<Vec<u8>>) -> HostTensors {
        HostTensors { tensors }
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Tensor `i`'s bytes.
    pub fn tensor(&self, i: usize) -> &[u8] {
        &self.tensors[i]
    }

    /// Tensor `i`'s bytes, writable.
    pub fn tensor_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.tensors[i]
    }

    /// Every tensor's bytes, writable, in order.
    pub fn tensors_mut(&mut self) -> impl Iterator<Item = &mut [u8]> {
        self.tensors.iter_mut().map(Vec::as_mut_slice)
    }

    /// Total bytes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.len() as u64).sum()
    }
}

// SAFETY: the buffers live as long as `self`; `&self` prevents writes through safe code.
unsafe impl SourceMemory for HostTensors {
    fn tensor_count(&self) -> usize {
        self.tensors.len()
    }
    fn source_region(&self, tensor: usize) -> Option<Region> {
        let t = self.tensors.get(tensor)?;
        Some(Region { space: MemorySpace::Host, addr: t.as_ptr().expose_provenance() as u64, len: t.len() as u64 })
    }
}

// SAFETY: the buffers live as long as `self`; `&mut self` prevents any other access.
unsafe impl DestinationMemory for HostTensors {
    fn tensor_count(&self) -> usize {
        self.tensors.len()
    }
    fn destination_region(&mut self, tensor: usize) -> Option<Region> {
        self.tensors.get_mut(tensor).map(|t| Region::host(t))
    }
}

/// A staging buffer owned by a transport (host memory for TCP; device or pinned memory for the GPU
/// transports).
pub trait StagingBuffer: Send {
    /// The buffer's memory.
    fn region(&self) -> Region;
}

/// A host staging buffer: one allocation, made once and reused for every bucket and refit.
pub struct HostBuffer {
    // Kept only to own (and free) the allocation; all access goes through `region`. A `Vec`, not a
    // `Box`, because moving a `Box` asserts unique access and would invalidate `region`'s pointer.
    _bytes: Vec<u8>,
    region: Region,
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes.
    pub fn new(len: u64) -> HostBuffer {
        let mut bytes = vec![0u8; len as usize];
        let region = Region::host(&mut bytes);
        HostBuffer { _bytes: bytes, region }
    }
}

impl StagingBuffer for HostBuffer {
    fn region(&self) -> Region {
        self.region
    }
}

/// One 2-D copy: `rows` rows of `width` bytes from `src` (pitch `src_pitch`) to `dst` (pitch
/// `dst_pitch`). Packing copies source → staging, unpacking staging → destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copy2d {
    /// First source byte.
    pub src: Region,
    /// Distance between source rows.
    pub src_pitch: u64,
    /// First destination byte.
    pub dst: Region,
    /// Distance between destination rows.
    pub dst_pitch: u64,
    /// Rows.
    pub rows: u64,
    /// Bytes per row.
    pub width: u64,
}

/// Revocable permission to touch borrowed memory.
///
/// Every access to memory a refit borrowed (a socket read into a destination, a memcpy) happens
/// inside [`AccessFence::access`], which holds a shared lock for the duration of that one
/// synchronous operation (accesses from several threads run side by side: a socket read beside
/// the check of the record before it) and skips it once the fence is revoked.
/// [`AccessFence::revoke`] sets the flag and then takes the lock exclusively, so when it returns
/// no access is in progress and none will start. It
/// never waits on an async task, so it is safe to call from `Drop` on any runtime: this is what
/// makes dropping a refit future mid-way sound.
#[derive(Clone, Debug, Default)]
pub struct AccessFence {
    inner: Arc<FenceInner>,
}

#[derive(Debug, Default)]
struct FenceInner {
    revoked: AtomicBool,
    lock: RwLock<()>,
}

impl AccessFence {
    /// A fresh, unrevoked fence.
    pub fn new() -> AccessFence {
        AccessFence::default()
    }

    /// Runs `f` unless the fence is revoked (then returns `None`). `f` must not block for long: a
    /// revoke waits for it.
    pub fn access<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        let _guard = self.inner.lock.read().unwrap_or_else(|e| e.into_inner());
        if self.inner.revoked.load(Ordering::Acquire) {
            return None;
        }
        Some(f())
    }

    /// Revokes the fence: after return, no access runs or will run.
    pub fn revoke(&self) {
        self.inner.revoked.store(true, Ordering::Release);
        drop(self.inner.lock.write().unwrap_or_else(|e| e.into_inner()));
    }

    /// Whether the fence was revoked.
    pub fn is_revoked(&self) -> bool {
        self.inner.revoked.load(Ordering::Acquire)
    }
}

/// Largest piece one fenced memcpy moves, so that a revoke waits at most this long.
const COPY_PIECE_BYTES: u64 = 8 << 20;

/// Executes one host 2-D copy in fenced pieces. Returns `false` when the fence was revoked.
///
/// # Safety
/// Both regions must be host memory valid for the copy's extent until the fence is revoked, and
/// must not overlap.
pub unsafe fn host_copy_2d(c: &Copy2d, fence: &AccessFence) -> bool {
    let contiguous = c.rows <= 1 || (c.src_pitch == c.width && c.dst_pitch == c.width);
    let (rows, width) = if contiguous { (1, c.rows * c.width) } else { (c.rows, c.width) };
    for r in 0..rows {
        let mut done = 0;
        while done < width {
            let n = (width - done).min(COPY_PIECE_BYTES);
            let src = c.src.addr + r * c.src_pitch + done;
            let dst = c.dst.addr + r * c.dst_pitch + done;
            let ok = fence.access(|| {
                // SAFETY: guaranteed by the caller; the fence is not revoked.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        std::ptr::with_exposed_provenance::<u8>(src as usize),
                        std::ptr::with_exposed_provenance_mut::<u8>(dst as usize),
                        n as usize,
                    )
                }
            });
            if ok.is_none() {
                return false;
            }
            done += n;
        }
    }
    true
}

/// Completion state of a [`HostCopyStream`].
#[derive(Clone, Copy, Debug, Default)]
struct CopyProgress {
    done: u64,
    revoked: bool,
}

/// An in-order host copy queue on its own thread, the host counterpart of a CUDA stream: copies
/// submitted as batches run one batch after another while the caller goes on (so unpacking bucket
/// k overlaps receiving bucket k+1); each batch gets a sequence number to wait on.
pub struct HostCopyStream {
    jobs: Option<std::sync::mpsc::Sender<CopyJob>>,
    progress: tokio::sync::watch::Receiver<CopyProgress>,
    busy: Arc<Mutex<Duration>>,
    pool: Arc<Mutex<Vec<Vec<Copy2d>>>>,
    submitted: u64,
    fence: AccessFence,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct CopyJob {
    seq: u64,
    copies: Vec<Copy2d>,
}

impl HostCopyStream {
    /// Starts the copy thread. Copies run under `fence`.
    pub fn new(name: &str, fence: AccessFence) -> std::io::Result<HostCopyStream> {
        let (jobs, rx) = std::sync::mpsc::channel::<CopyJob>();
        let (tx, progress) = tokio::sync::watch::channel(CopyProgress::default());
        let busy = Arc::new(Mutex::new(Duration::ZERO));
        let pool: Arc<Mutex<Vec<Vec<Copy2d>>>> = Arc::default();
        let thread = {
            let (busy, pool, fence) = (busy.clone(), pool.clone(), fence.clone());
            std::thread::Builder::new().name(format!("refit-copy-{name}")).spawn(move || {
                while let Ok(mut job) = rx.recv() {
                    let start = Instant::now();
                    let mut ok = true;
                    for c in &job.copies {
                        // SAFETY: the submitter guaranteed validity until the fence is revoked.
                        if !unsafe { host_copy_2d(c, &fence) } {
                            ok = false;
                            break;
                        }
                    }
                    *busy.lock().unwrap_or_else(|e| e.into_inner()) += start.elapsed();
                    job.copies.clear();
                    pool.lock().unwrap_or_else(|e| e.into_inner()).push(job.copies);
                    tx.send_modify(|p| {
                        if ok {
                            p.done = job.seq;
                        } else {
                            p.revoked = true;
                        }
                    });
                }
            })?
        };
        Ok(HostCopyStream { jobs: Some(jobs), progress, busy, pool, submitted: 0, fence, thread: Some(thread) })
    }

    /// Queues a batch of copies; returns its sequence number.
    ///
    /// # Safety
    /// Every region must be host memory valid for its copy until the batch completes or the fence
    /// is revoked.
    pub unsafe fn submit(&mut self, copies: &[Copy2d]) -> u64 {
        let mut v = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
        v.extend_from_slice(copies);
        self.submitted += 1;
        let seq = self.submitted;
        if let Some(jobs) = &self.jobs {
            // The thread only exits when `jobs` drops, so the send cannot fail.
            let _ = jobs.send(CopyJob { seq, copies: v });
        }
        seq
    }

    /// Waits until batch `seq` completed, or `deadline`. `Err(true)` when the fence was revoked,
    /// `Err(false)` on the deadline.
    pub async fn wait(&mut self, seq: u64, deadline: tokio::time::Instant) -> Result<(), bool> {
        let wait = self.progress.wait_for(|p| p.done >= seq || p.revoked);
        match tokio::time::timeout_at(deadline, wait).await {
            Ok(Ok(p)) if p.done >= seq => Ok(()),
            Ok(_) => Err(true),
            Err(_) => Err(false),
        }
    }

    /// Total time the thread spent copying.
    pub fn busy(&self) -> Duration {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The fence its copies run under.
    pub fn fence(&self) -> &AccessFence {
        &self.fence
    }
}

impl Drop for HostCopyStream {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            // Pending batches finish (or stop at once if the fence is revoked).
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_copy_2d_scatters_rows() {
        let mut src: Vec<u8> = (0..12).collect();
        let mut dst = vec![0u8; 16];
        let c = Copy2d {
            src: Region::host(&mut src),
            src_pitch: 3,
            dst: Region::host(&mut dst).sub(1, 15),
            dst_pitch: 4,
            rows: 4,
            width: 3,
        };
        // SAFETY: both vectors outlive the copy and do not overlap.
        assert!(unsafe { host_copy_2d(&c, &AccessFence::new()) });
        assert_eq!(dst, vec![0, 0, 1, 2, 0, 3, 4, 5, 0, 6, 7, 8, 0, 9, 10, 11]);
    }

    #[test]
    fn a_revoked_fence_stops_copies() {
        let mut src = vec![7u8; 64];
        let mut dst = vec![0u8; 64];
        let fence = AccessFence::new();
        fence.revoke();
        let c = Copy2d {
            src: Region::host(&mut src),
            src_pitch: 64,
            dst: Region::host(&mut dst),
            dst_pitch: 64,
            rows: 1,
            width: 64,
        };
        // SAFETY: as above.
        assert!(!unsafe { host_copy_2d(&c, &fence) });
        assert!(dst.iter().all(|&b| b == 0));
    }

    #[tokio::test]
    async fn copy_stream_runs_batches_in_order() {
        let mut src: Vec<u8> = (0..=255).collect();
        let mut dst = vec![0u8; 256];
        let fence = AccessFence::new();
        let mut s = HostCopyStream::new("test", fence).unwrap();
        let s_region = Region::host(&mut src);
        let d_region = Region::host(&mut dst);
        let mut last = 0;
        for i in 0..4u64 {
            let c = Copy2d {
                src: s_region.sub(i * 64, 64),
                src_pitch: 64,
                dst: d_region.sub(i * 64, 64),
                dst_pitch: 64,
                rows: 1,
                width: 64,
            };
            // SAFETY: the vectors outlive the stream's work (we wait below).
            last = unsafe { s.submit(&[c]) };
        }
        s.wait(last, tokio::time::Instant::now() + Duration::from_secs(5)).await.unwrap();
        drop(s);
        assert_eq!(dst, src);
    }
}
