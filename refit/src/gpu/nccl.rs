//! NCCL communicators in non-blocking mode, so that every wait has a deadline: a peer that dies
//! or never arrives makes us abort the communicator (which also stops its kernels) and return an
//! error, instead of hanging in `ncclCommInitRank` or inside a collective.

use std::ffi::{CStr, c_void};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::nccl::sys::{self, ncclComm_t, ncclResult_t};

use super::{Gpu, GpuError, catch};

/// NCCL's text for a result code.
pub fn error_string(r: ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static C string for any code.
    unsafe {
        let p = sys::ncclGetErrorString(r);
        if p.is_null() { format!("{r:?}") } else { CStr::from_ptr(p).to_string_lossy().into_owned() }
    }
}

/// The 128-byte unique id the root creates and the others fetch from its rendezvous address.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId(..)")
    }
}

impl UniqueId {
    /// Creates a new id (the group root does this once per communicator).
    pub fn new() -> Result<UniqueId, GpuError> {
        catch("ncclGetUniqueId", || {
            let id = cudarc::nccl::result::get_uniqueid()
                .map_err(|e| GpuError::msg("ncclGetUniqueId", error_string(e.0)))?;
            Ok(UniqueId(id.internal.map(|c| c as u8)))
        })
    }

    fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId { internal: self.0.map(|b| b as std::ffi::c_char) }
    }
}

/// A communicator of one rank.
pub struct Comm {
    comm: ncclComm_t,
    rank: usize,
    world: usize,
    aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (we hold it by &mut or
// behind the owner's exclusive access).
unsafe impl Send for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {} of {})", self.rank, self.world)
    }
}

const NCCL_CONFIG_UNDEF_INT: i32 = i32::MIN;

impl Comm {
    /// Joins a communicator of `world` ranks as `rank` on `gpu`, waiting at most until `deadline`
    /// for the others.
    pub fn init(gpu: &Gpu, id: &UniqueId, rank: usize, world: usize, deadline: Instant) -> Result<Comm, GpuError> {
        gpu.bind()?;
        let what = format!("joining an NCCL communicator as rank {rank} of {world} on GPU {}", gpu.ordinal());
        let mut config = sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: 0xcafe_beef,
            version: 22800,
            blocking: 0,
            cgaClusterSize: NCCL_CONFIG_UNDEF_INT,
            minCTAs: NCCL_CONFIG_UNDEF_INT,
            maxCTAs: NCCL_CONFIG_UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: NCCL_CONFIG_UNDEF_INT,
            trafficClass: NCCL_CONFIG_UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: NCCL_CONFIG_UNDEF_INT,
            CTAPolicy: NCCL_CONFIG_UNDEF_INT,
            shrinkShare: NCCL_CONFIG_UNDEF_INT,
            nvlsCTAs: NCCL_CONFIG_UNDEF_INT,
            nChannelsPerNetPeer: NCCL_CONFIG_UNDEF_INT,
            nvlinkCentricSched: NCCL_CONFIG_UNDEF_INT,
        };
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let r = catch(&what, || {
            // SAFETY: a valid config and id; comm receives the handle.
            let r = unsafe { sys::ncclCommInitRankConfig(&mut comm, world as i32, id.raw(), rank as i32, &mut config) };
            Ok(r)
        })?;
        if r != ncclResult_t::ncclSuccess && r != ncclResult_t::ncclInProgress {
            return Err(GpuError::msg(what, error_string(r)));
        }
        let mut c = Comm { comm, rank, world, aborted: false };
        c.wait_ready(deadline, &what)?;
        Ok(c)
    }

    /// Rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Size of the communicator.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The communicator's asynchronous state: Ok(true) ready, Ok(false) still in progress.
    pub fn poll(&self) -> Result<bool, GpuError> {
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator.
        let r = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        if r != ncclResult_t::ncclSuccess {
            return Err(GpuError::msg("ncclCommGetAsyncError", error_string(r)));
        }
        match state {
            ncclResult_t::ncclSuccess => Ok(true),
            ncclResult_t::ncclInProgress => Ok(false),
            e => Err(GpuError::msg("NCCL communicator", error_string(e))),
        }
    }

    /// Waits until pending non-blocking work (init, enqueueing) completes; aborts on error or
    /// deadline.
    pub fn wait_ready(&mut self, deadline: Instant, what: &str) -> Result<(), GpuError> {
        loop {
            match self.poll() {
                Ok(true) => return Ok(()),
                Ok(false) if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(50)),
                Ok(false) => {
                    self.abort();
                    return Err(GpuError::msg(what, "timed out waiting for the other ranks; communicator aborted"));
                }
                Err(e) => {
                    self.abort();
                    return Err(GpuError::msg(what, format!("{e}; communicator aborted")));
                }
            }
        }
    }

    /// Aborts the communicator: pending and running operations stop. Idempotent.
    pub fn abort(&mut self) {
        if !self.aborted && !self.comm.is_null() {
            self.aborted = true;
            // SAFETY: a live communicator, aborted once.
            unsafe {
                sys::ncclCommAbort(self.comm);
            }
        }
    }

    /// Whether it was aborted (it cannot be used again).
    pub fn is_aborted(&self) -> bool {
        self.aborted
    }

    /// Enqueues a broadcast of `bytes` from `root` (`send` at the root, `recv` everywhere; in
    /// place when they are equal) on `stream`.
    ///
    /// # Safety
    /// The pointers must be valid device memory of this rank's GPU for the whole operation.
    pub unsafe fn broadcast(
        &mut self,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        bytes: u64,
        root: usize,
        stream: &CudaStream,
    ) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller; uint8 elements so any byte count is exact.
        let r = unsafe {
            sys::ncclBroadcast(
                send as *const c_void,
                recv as *mut c_void,
                bytes as usize,
                sys::ncclDataType_t::ncclUint8,
                root as i32,
                self.comm,
                stream.cu_stream() as sys::cudaStream_t,
            )
        };
        self.check(r, "ncclBroadcast")
    }

    /// Enqueues a send of `bytes` to `peer` on `stream` (point-to-point; group it with the
    /// matching receive).
    ///
    /// # Safety
    /// `buf` must be valid device memory of this rank's GPU for the whole operation.
    pub unsafe fn send(
        &mut self,
        buf: CUdeviceptr,
        bytes: u64,
        peer: usize,
        stream: &CudaStream,
    ) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        let r = unsafe {
            sys::ncclSend(
                buf as *const c_void,
                bytes as usize,
                sys::ncclDataType_t::ncclUint8,
                peer as i32,
                self.comm,
                stream.cu_stream() as sys::cudaStream_t,
            )
        };
        self.check(r, "ncclSend")
    }

    /// Enqueues a receive of `bytes` from `peer` on `stream`.
    ///
    /// # Safety
    /// `buf` must be valid device memory of this rank's GPU for the whole operation.
    pub unsafe fn recv(
        &mut self,
        buf: CUdeviceptr,
        bytes: u64,
        peer: usize,
        stream: &CudaStream,
    ) -> Result<(), GpuError> {
        // SAFETY: forwarded to the caller.
        let r = unsafe {
            sys::ncclRecv(
                buf as *mut c_void,
                bytes as usize,
                sys::ncclDataType_t::ncclUint8,
                peer as i32,
                self.comm,
                stream.cu_stream() as sys::cudaStream_t,
            )
        };
        self.check(r, "ncclRecv")
    }

    fn check(&mut self, r: ncclResult_t, op: &str) -> Result<(), GpuError> {
        match r {
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => Ok(()),
            e => {
                self.abort();
                Err(GpuError::msg(op, format!("{}; communicator aborted", error_string(e))))
            }
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.comm.is_null() && !self.aborted {
            // Abort rather than destroy: destroy blocks until every peer finalizes, and a drop
            // must never hang.
            self.abort();
        }
    }
}

/// Starts an NCCL group (calls on several communicators up to [`group_end`] are launched together).
pub fn group_start() -> Result<(), GpuError> {
    // SAFETY: no arguments.
    let r = unsafe { sys::ncclGroupStart() };
    match r {
        ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => Ok(()),
        e => Err(GpuError::msg("ncclGroupStart", error_string(e))),
    }
}

/// Ends an NCCL group. With non-blocking communicators the launch may complete asynchronously:
/// callers wait with [`Comm::wait_ready`] on each communicator involved.
pub fn group_end() -> Result<(), GpuError> {
    // SAFETY: no arguments.
    let r = unsafe { sys::ncclGroupEnd() };
    match r {
        ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => Ok(()),
        e => Err(GpuError::msg("ncclGroupEnd", error_string(e))),
    }
}
