//! CUDA and NCCL through cudarc, loaded at run time (the build needs no CUDA).
//!
//! What lives here is device plumbing only: probing for a driver, contexts, IPC-exportable device
//! memory, streams and events, 1-D/2-D copies (same GPU, peer, IPC-mapped), the two PTX kernels
//! (synthetic weights, digests) and NCCL communicators ([`nccl`]). The refit transports build on
//! it.
//!
//! Pitfalls handled here (see GPU-NOTES.md): cudarc panics when libcuda/libnccl are missing, so
//! [`probe`] runs it under `catch_unwind` and turns that into an error suggesting
//! `--transport tcp`; memory that may be exported with CUDA IPC comes from `cuMemAlloc`, never the
//! stream-ordered pool; cudarc never looks for `libnccl.so.2` (the only name pip's NCCL ships), so
//! [`nccl_library_dir`] prepares a `libnccl.so` link for child processes' `LD_LIBRARY_PATH`.

pub mod nccl;
pub mod tensors;

use std::ffi::{CString, c_void};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, result};

use crate::digest::Sampling;

/// Environment variable telling a rank which physical GPU its pod's slot 0 is (one machine runs
/// every pod, so pods' GPU slots are laid out one after another).
pub const GPU_BASE_ENV: &str = "RLPLANE_GPU_BASE";

/// The physical GPU a process of this machine uses: its slot plus its pod's base.
pub fn physical_gpu(slot: u32) -> u32 {
    slot + std::env::var(GPU_BASE_ENV).ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// A GPU error: the operation and what the driver said.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{op}: {detail}")]
pub struct GpuError {
    /// What was being done.
    pub op: String,
    /// What went wrong.
    pub detail: String,
}

impl GpuError {
    /// An error from a driver call.
    pub fn driver(op: impl Into<String>, e: DriverError) -> GpuError {
        GpuError { op: op.into(), detail: e.to_string() }
    }

    /// An error with a message.
    pub fn msg(op: impl Into<String>, detail: impl Into<String>) -> GpuError {
        GpuError { op: op.into(), detail: detail.into() }
    }
}

/// Runs `f`, turning a panic (cudarc's reaction to a missing library) into an error.
pub fn catch<T>(what: &str, f: impl FnOnce() -> Result<T, GpuError>) -> Result<T, GpuError> {
    // Silence the default hook's message for the expected panic; keep it for everything else.
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(AssertUnwindSafe(f));
    std::panic::set_hook(quiet);
    match r {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            // cudarc lists every file name it tried; the first sentence says what matters.
            let msg = msg.split(" - searched for").next().unwrap_or(&msg).to_string();
            Err(GpuError::msg(what, msg))
        }
    }
}

/// What the probe found.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    /// Number of GPUs.
    pub devices: usize,
    /// Name of GPU 0.
    pub name: String,
    /// Memory of GPU 0 in bytes.
    pub memory: usize,
}

/// Checks that a CUDA driver and at least one GPU are present.
pub fn probe() -> Result<GpuInfo, GpuError> {
    let r = catch("loading the CUDA driver", || {
        result::init().map_err(|e| GpuError::driver("cuInit", e))?;
        let devices = CudaContext::device_count().map_err(|e| GpuError::driver("cuDeviceGetCount", e))? as usize;
        if devices == 0 {
            return Err(GpuError::msg("finding GPUs", "the CUDA driver sees no GPU"));
        }
        let ctx = CudaContext::new(0).map_err(|e| GpuError::driver("creating a context on GPU 0", e))?;
        Ok(GpuInfo { devices, name: ctx.name().unwrap_or_default(), memory: ctx.total_mem().unwrap_or_default() })
    });
    r.map_err(|e| GpuError {
        op: "no usable CUDA driver found".into(),
        detail: format!("{e}; use --transport tcp (or spec.device: Cpu) to run without GPUs"),
    })
}

/// The GPUs this process sees, in CUDA's order, by UUID (`GPU-…`, as `nvidia-smi -L` prints
/// them): what the device plugin, a ResourceClaim or `CUDA_VISIBLE_DEVICES` gave the container.
pub fn visible_gpus() -> Result<Vec<String>, GpuError> {
    catch("listing the GPUs", || {
        result::init().map_err(|e| GpuError::driver("cuInit", e))?;
        let n = CudaContext::device_count().map_err(|e| GpuError::driver("cuDeviceGetCount", e))?;
        (0..n)
            .map(|i| {
                let dev = result::device::get(i).map_err(|e| GpuError::driver(format!("cuDeviceGet({i})"), e))?;
                let id =
                    result::device::get_uuid(dev).map_err(|e| GpuError::driver(format!("the UUID of GPU {i}"), e))?;
                Ok(uuid_string(&id.bytes.map(|b| b as u8)))
            })
            .collect()
    })
}

/// A GPU's 16-byte UUID as `nvidia-smi` writes it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn uuid_string(bytes: &[u8; 16]) -> String {
    let h: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// A GPU UUID in one spelling, whichever a tool printed (`GPU-` prefix or not, any case).
pub fn normalize_uuid(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    id.strip_prefix("gpu-").unwrap_or(&id).to_string()
}

/// Why a process that needs its pod's GPU `slot` cannot have it, when it sees only `seen`
/// (UUIDs, in CUDA's order) of the `pod_gpus` its plan gives the pod; `None` when it can.
pub fn missing_gpu(process: &str, slot: usize, pod_gpus: u32, seen: &[String]) -> Option<String> {
    if slot < seen.len() && seen.len() >= pod_gpus as usize {
        return None;
    }
    let listed = if seen.is_empty() { "none".to_string() } else { seen.join(", ") };
    Some(format!(
        "{process} needs GPU {slot} of its pod's {pod_gpus} (the plan), but this worker sees {} GPU(s): {listed}. The worker must see the pod's GPUs: with spec.gpus.sharing DevicePlugin it sees the node's GPUs through NVIDIA_VISIBLE_DEVICES=all, which the NVIDIA container toolkit must honour (accept-nvidia-visible-devices-envvar-when-unprivileged) and which are the pod's only when the pod takes the whole node; with ResourceClaim it uses the pod's claim",
        seen.len()
    ))
}

/// Checks that NCCL loads and returns its version code (e.g. 22809 for 2.28.9).
pub fn nccl_version() -> Result<i32, GpuError> {
    catch("loading NCCL", || {
        cudarc::nccl::result::get_nccl_version().map_err(|e| GpuError::msg("ncclGetVersion", nccl::error_string(e.0)))
    })
    .map_err(|e| GpuError {
        op: "NCCL could not be loaded".into(),
        detail: format!("{e}; install NCCL (e.g. pip install nvidia-nccl-cu13) or use --transport tcp"),
    })
}

/// Finds pip's `libnccl.so.2` (or `RLPLANE_NCCL_LIBRARY`) and returns a directory holding a
/// `libnccl.so` link to it, to put first on child processes' `LD_LIBRARY_PATH`. `None` when no
/// such library is found (the system's `libnccl.so`, if any, is then used).
pub fn nccl_library_dir(scratch: &Path) -> Option<PathBuf> {
    let lib =
        std::env::var_os("RLPLANE_NCCL_LIBRARY").map(PathBuf::from).filter(|p| p.exists()).or_else(find_pip_nccl)?;
    let dir = scratch.join("nccl-lib");
    std::fs::create_dir_all(&dir).ok()?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link).ok()?;
    Some(dir)
}

fn find_pip_nccl() -> Option<PathBuf> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    path.exists().then_some(path)
}

/// `LD_LIBRARY_PATH` with `dir` first.
pub fn library_path_with(dir: &Path) -> String {
    match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", dir.display()),
        _ => dir.display().to_string(),
    }
}

/// One GPU: its primary context and the loaded kernels.
#[derive(Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    kernels: Arc<OnceLock<Result<Kernels, GpuError>>>,
    scratch: Arc<std::sync::Mutex<Option<Scratch>>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.ctx.ordinal())
    }
}

#[derive(Clone, Copy)]
struct Kernels {
    fill2d: sys::CUfunction,
    digest_segments: sys::CUfunction,
    read_words: sys::CUfunction,
    copy_spans: sys::CUfunction,
}

// SAFETY: CUfunction handles are plain driver handles, valid in every thread once the module is
// loaded in the (primary, shared) context.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

const PTX: &str = include_str!("kernels.ptx");

impl Gpu {
    /// Opens GPU `ordinal` (its primary context), probing for the driver first.
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        catch("opening a GPU", || {
            let ctx = CudaContext::new(ordinal).map_err(|e| GpuError::driver(format!("opening GPU {ordinal}"), e))?;
            Ok(Gpu { ctx, kernels: Arc::new(OnceLock::new()), scratch: Arc::default() })
        })
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's UUID (`GPU-…`).
    pub fn uuid(&self) -> Result<String, GpuError> {
        let id = self.ctx.uuid().map_err(|e| GpuError::driver("reading the GPU's UUID", e))?;
        Ok(uuid_string(&id.bytes.map(|b| b as u8)))
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes this GPU's context current on the calling thread (needed before raw driver calls).
    pub fn bind(&self) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(|e| GpuError::driver("binding the CUDA context", e))
    }

    /// Total and free memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), GpuError> {
        self.bind()?;
        let (free, total) = self.ctx.mem_get_info().map_err(|e| GpuError::driver("cuMemGetInfo", e))?;
        Ok((total, free))
    }

    /// Allocates `bytes` of device memory with `cuMemAlloc`, so it can be exported over CUDA IPC.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer, GpuError> {
        self.bind()?;
        // SAFETY: plain allocation; freed in DeviceBuffer's Drop with the same context current.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|e| GpuError::driver(format!("allocating {bytes} bytes on GPU {}", self.ordinal()), e))?;
        Ok(DeviceBuffer { ptr, len: bytes, gpu: self.clone() })
    }

    /// A new non-blocking stream.
    pub fn stream(&self) -> Result<Arc<CudaStream>, GpuError> {
        self.bind()?;
        self.ctx.new_stream().map_err(|e| GpuError::driver("creating a stream", e))
    }

    /// A new event; `timing` events can measure elapsed time, others are cheaper.
    pub fn event(&self, timing: bool) -> Result<CudaEvent, GpuError> {
        self.bind()?;
        let flags =
            if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        self.ctx.new_event(Some(flags)).map_err(|e| GpuError::driver("creating an event", e))
    }

    /// A new event (see [`Gpu::event`]) recorded on `stream` now.
    pub fn record_event(&self, stream: &CudaStream, timing: bool) -> Result<CudaEvent, GpuError> {
        let e = self.event(timing)?;
        e.record(stream).map_err(|e| GpuError::driver("recording an event", e))?;
        Ok(e)
    }

    /// Enqueues `copies` on `stream` between two timing events, returned as (start, end), so
    /// the caller can wait for them and read how long the copy engines were busy.
    ///
    /// # Safety
    /// Every region must be valid device memory until `end` has completed.
    pub unsafe fn copy_regions(
        &self,
        copies: &[crate::memory::Copy2d],
        stream: &CudaStream,
    ) -> Result<(CudaEvent, CudaEvent), GpuError> {
        self.bind()?;
        let start = self.record_event(stream, true)?;
        for c in copies {
            // SAFETY: forwarded to the caller.
            unsafe { copy2d_async(c.dst.addr, c.dst_pitch, c.src.addr, c.src_pitch, c.width, c.rows, stream) }?;
        }
        let end = self.record_event(stream, true)?;
        Ok((start, end))
    }

    /// Lets this GPU's context access `peer`'s memory directly (NVLink / PCIe P2P).
    pub fn enable_peer_access(&self, peer: &Gpu) -> Result<(), GpuError> {
        if peer.ordinal() == self.ordinal() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both contexts are live primary contexts.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            other => Err(GpuError::msg(
                format!("enabling peer access from GPU {} to GPU {}", self.ordinal(), peer.ordinal()),
                format!("{other:?}"),
            )),
        }
    }

    fn kernels(&self) -> Result<Kernels, GpuError> {
        self.kernels
            .get_or_init(|| {
                self.bind()?;
                let src = CString::new(PTX).expect("PTX has no NUL");
                // SAFETY: a NUL-terminated PTX image; the module lives as long as the context.
                unsafe {
                    let module = result::module::load_data(src.as_ptr() as *const c_void)
                        .map_err(|e| GpuError::driver("loading rlplane's PTX kernels", e))?;
                    let get = |n: &str| {
                        result::module::get_function(module, CString::new(n).expect("name"))
                            .map_err(|e| GpuError::driver(format!("finding kernel {n}"), e))
                    };
                    Ok(Kernels {
                        fill2d: get("rlp_fill2d")?,
                        digest_segments: get("rlp_digest_segments")?,
                        read_words: get("rlp_read_words")?,
                        copy_spans: get("rlp_copy_spans")?,
                    })
                }
            })
            .clone()
    }

    /// Writes synthetic weight content into `rows × width` bytes at `dst` (pitch `dst_pitch`),
    /// the bytes of the full tensor at `full_offset` (pitch `full_pitch`): the device version of
    /// [`crate::digest::fill`].
    ///
    /// # Safety
    /// `dst` must point to device memory of this GPU covering the region.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn fill2d(
        &self,
        stream: &CudaStream,
        dst: CUdeviceptr,
        rows: u64,
        width: u64,
        dst_pitch: u64,
        seed: u64,
        full_offset: u64,
        full_pitch: u64,
    ) -> Result<(), GpuError> {
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let k = self.kernels()?;
        let gx = width.div_ceil(256).clamp(1, 2048) as u32;
        let gy = rows.clamp(1, 65535) as u32;
        let mut args = [dst, rows, width, dst_pitch, seed, full_offset, full_pitch];
        let mut params: Vec<*mut c_void> = args.iter_mut().map(|a| a as *mut u64 as *mut c_void).collect();
        // SAFETY: the parameters match the kernel's signature (seven u64s).
        unsafe { result::launch_kernel(k.fill2d, (gx, gy, 1), (256, 1, 1), 0, stream.cu_stream(), &mut params) }
            .map_err(|e| GpuError::driver("launching rlp_fill2d", e))
    }

    /// Digests of `regions` (each as [`crate::digest::digest_region`] defines it, every block or
    /// the blocks its [`Sampling`] draws), read by this GPU in one kernel launch on `stream`;
    /// returns when they are on the host.
    ///
    /// # Safety
    /// Every region must be device memory readable from this GPU, valid until this returns.
    pub unsafe fn digest_regions(&self, regions: &[DigestRegion], stream: &CudaStream) -> Result<Vec<u64>, GpuError> {
        // The kernel's table: one row of seven u64 per non-empty region (kernels.cu's Region).
        let mut table = Vec::with_capacity(regions.len() * 7);
        let mut slots = Vec::with_capacity(regions.len());
        let mut blocks = 0u64;
        for r in regions {
            let len = r.rows * r.width;
            if len == 0 {
                slots.push(None);
                continue;
            }
            slots.push(Some(table.len() / 7));
            table.extend([r.addr, r.rows, r.width, r.pitch, r.sampling.mask(), r.sampling.salt(), blocks]);
            blocks += len.div_ceil(crate::digest::VERIFY_BLOCK);
        }
        let count = table.len() / 7;
        let mut sums = vec![0u64; count];
        if count > 0 {
            let k = self.kernels()?;
            let scratch = self.scratch(table.len() * 8 + count * 8)?;
            let base = scratch.as_ref().expect("allocated").ptr;
            let (table_ptr, out_ptr) = (base, base + table.len() as u64 * 8);
            let bytes: Vec<u8> = table.iter().flat_map(|w| w.to_le_bytes()).collect();
            // SAFETY: the table fits the scratch buffer (sized for table and sums); `bytes` outlives
            // the copy (the stream is synchronized below). On the kernel's stream, so it is ordered.
            unsafe { result::memcpy_htod_async(table_ptr, &bytes, stream.cu_stream()) }
                .map_err(|e| GpuError::driver("copying the digest table to the GPU", e))?;
            // SAFETY: the out slots lie in the scratch buffer, after the table.
            unsafe { result::memset_d8_async(out_ptr, 0, count * 8, stream.cu_stream()) }
                .map_err(|e| GpuError::driver("cuMemsetD8Async", e))?;
            let ctas = blocks.clamp(1, DIGEST_CTAS) as u32;
            let mut count_arg = count as u32;
            let (mut t, mut b, mut o) = (table_ptr, blocks, out_ptr);
            let mut params: Vec<*mut c_void> = vec![
                &mut t as *mut u64 as *mut c_void,
                &mut count_arg as *mut u32 as *mut c_void,
                &mut b as *mut u64 as *mut c_void,
                &mut o as *mut u64 as *mut c_void,
            ];
            // SAFETY: the parameters match the kernel's signature (u64, u32, u64, u64); the table
            // describes memory the caller vouches for.
            unsafe {
                result::launch_kernel(k.digest_segments, (ctas, 1, 1), (256, 1, 1), 0, stream.cu_stream(), &mut params)
            }
            .map_err(|e| GpuError::driver("launching rlp_digest_segments", e))?;
            stream.synchronize().map_err(|e| GpuError::driver("waiting for the digest kernel", e))?;
            let mut host = vec![0u8; count * 8];
            // SAFETY: the sums lie in the scratch buffer; the kernel has finished.
            unsafe { result::memcpy_dtoh_sync(&mut host, out_ptr) }
                .map_err(|e| GpuError::driver("copying the digests from the GPU", e))?;
            for (s, w) in sums.iter_mut().zip(host.chunks_exact(8)) {
                *s = u64::from_le_bytes(w.try_into().expect("8 bytes"));
            }
        }
        Ok(regions
            .iter()
            .zip(slots)
            .map(|(r, slot)| finish_digest(slot.map_or(0, |i| sums[i]), r.rows * r.width))
            .collect())
    }

    /// Copies every `(dst, src, len)` span on `stream` with one kernel launch per
    /// [`COPY_SPANS`] spans (`rlp_copy_spans`): a colocated refit's bucket in one launch instead
    /// of a driver call and a small copy kernel per tensor.
    ///
    /// # Safety
    /// Every span must be device memory of (or mapped into) this GPU's context, `src` readable and
    /// `dst` writable for `len` bytes until the work on `stream` completes.
    pub unsafe fn copy_spans(
        &self,
        spans: &[(CUdeviceptr, CUdeviceptr, u64)],
        stream: &CudaStream,
    ) -> Result<(), GpuError> {
        let k = self.kernels()?;
        for batch in spans.chunks(COPY_SPANS) {
            let mut t = SpanTable { count: 0, total_chunks: 0, spans: [[0; 4]; COPY_SPANS] };
            for &(dst, src, len) in batch.iter().filter(|s| s.2 > 0) {
                t.spans[t.count as usize] = [dst, src, len, t.total_chunks];
                t.count += 1;
                t.total_chunks += len.div_ceil(COPY_CHUNK);
            }
            if t.count == 0 {
                continue;
            }
            let ctas = t.total_chunks.min(COPY_CTAS) as u32;
            let mut params = [&mut t as *mut SpanTable as *mut c_void];
            // SAFETY: the one parameter is the kernel's SpanTable, laid out alike (#[repr(C)]);
            // the caller vouches for the spans.
            unsafe {
                result::launch_kernel(k.copy_spans, (ctas, 1, 1), (256, 1, 1), 0, stream.cu_stream(), &mut params)
            }
            .map_err(|e| GpuError::driver("launching rlp_copy_spans", e))?;
        }
        Ok(())
    }

    /// Reads the `len / 8` words at `base` once (a plain sum, no mixing) and returns the seconds
    /// it took on `stream`: the read-bandwidth reference for the digest in `rlplane bench`.
    ///
    /// # Safety
    /// `base` must be device memory of this GPU covering `len` bytes, 8-byte aligned.
    pub unsafe fn time_read(&self, base: CUdeviceptr, len: u64, stream: &CudaStream) -> Result<f64, GpuError> {
        let k = self.kernels()?;
        let out = self.alloc(8)?;
        out.memset(0, stream)?;
        let end = self.event(true)?;
        let start = self.record_event(stream, true)?;
        let (mut b, mut l, mut o) = (base, len, out.ptr());
        let mut params: Vec<*mut c_void> =
            [&mut b, &mut l, &mut o].into_iter().map(|a| a as *mut u64 as *mut c_void).collect();
        // SAFETY: three u64 parameters, as the kernel declares; the caller vouches for the region.
        unsafe {
            result::launch_kernel(k.read_words, (READ_CTAS, 1, 1), (256, 1, 1), 0, stream.cu_stream(), &mut params)
        }
        .map_err(|e| GpuError::driver("launching rlp_read_words", e))?;
        end.record(stream).map_err(|e| GpuError::driver("recording an event", e))?;
        end.synchronize().map_err(|e| GpuError::driver("waiting for the read kernel", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| GpuError::driver("reading an event", e))?;
        Ok(ms as f64 / 1e3)
    }

    /// The digest's table and sums buffer, at least `bytes`, kept for the next call: a refit
    /// check allocates (and frees, which synchronizes the device) nothing once warm.
    fn scratch(&self, bytes: usize) -> Result<std::sync::MutexGuard<'_, Option<Scratch>>, GpuError> {
        let mut slot = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if slot.as_ref().is_none_or(|b| b.len < bytes) {
            *slot = None;
            self.bind()?;
            let len = bytes.next_power_of_two().max(4096);
            // SAFETY: plain allocation, freed by Scratch's Drop with this context current.
            let ptr = unsafe { result::malloc_sync(len) }
                .map_err(|e| GpuError::driver(format!("allocating {len} bytes on GPU {}", self.ordinal()), e))?;
            *slot = Some(Scratch { ptr, len, ctx: self.ctx.clone() });
        }
        Ok(slot)
    }
}

/// A device allocation a [`Gpu`] keeps for itself (holding the context, not the `Gpu`, so that
/// no reference cycle keeps either alive).
struct Scratch {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAlloc on this context and not freed elsewhere.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Thread blocks of the digest kernel: each takes a contiguous range of the regions' 4 KiB
/// blocks, enough of them to keep every SM of a large GPU busy.
const DIGEST_CTAS: u64 = 2048;
/// Spans per `rlp_copy_spans` launch (its parameter table, under the 4 KiB kernel parameter limit).
pub const COPY_SPANS: usize = 120;
/// Bytes of a span one thread block copies at a time (kernels.cu's COPY_CHUNK).
const COPY_CHUNK: u64 = 65536;
/// Most thread blocks of a copy launch (each takes a contiguous range of chunks).
const COPY_CTAS: u64 = 4096;

/// kernels.cu's SpanTable: `[dst, src, len, first_chunk]` per span.
#[repr(C)]
struct SpanTable {
    count: u64,
    total_chunks: u64,
    spans: [[u64; 4]; COPY_SPANS],
}

/// Thread blocks of the read-bandwidth kernel (grid-stride).
const READ_CTAS: u32 = 2048;

/// A region for [`Gpu::digest_regions`]: `rows` rows of `width` bytes, `pitch` apart from
/// `addr`, read row after row, every block or a sample.
#[derive(Clone, Copy, Debug)]
pub struct DigestRegion {
    /// Device address of the first byte.
    pub addr: CUdeviceptr,
    /// Rows.
    pub rows: u64,
    /// Bytes per row.
    pub width: u64,
    /// Bytes from one row's start to the next's.
    pub pitch: u64,
    /// Which blocks are read.
    pub sampling: Sampling,
}

/// The base and size of the device allocation holding `ptr` (own, or mapped from another process).
pub fn allocation_range(ptr: CUdeviceptr) -> Result<(CUdeviceptr, usize), GpuError> {
    let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
    // SAFETY: out-parameters for a query about a device pointer.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::msg("cuMemGetAddressRange", format!("{r:?}")));
    }
    Ok((base, size))
}

/// Finishes a digest from its word sum and its length, as [`crate::digest::Digest::finish`].
pub fn finish_digest(word_sum: u64, len: u64) -> u64 {
    crate::digest::mix64(word_sum ^ len.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Device memory from `cuMemAlloc`, freed on drop.
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    len: usize,
    gpu: Gpu,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes, GPU {})", self.ptr, self.len, self.gpu.ordinal())
    }
}

impl DeviceBuffer {
    /// Device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU it lives on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Copies host bytes in (synchronous).
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<(), GpuError> {
        self.check(offset, src.len())?;
        self.gpu.bind()?;
        // SAFETY: the range was checked against the allocation.
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, src) }
            .map_err(|e| GpuError::driver("copying to the GPU", e))
    }

    /// Copies bytes out to the host (synchronous).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), GpuError> {
        self.check(offset, dst.len())?;
        self.gpu.bind()?;
        // SAFETY: the range was checked against the allocation.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset as u64) }
            .map_err(|e| GpuError::driver("copying from the GPU", e))
    }

    /// Sets every byte to `value` on `stream`.
    pub fn memset(&self, value: u8, stream: &CudaStream) -> Result<(), GpuError> {
        self.gpu.bind()?;
        // SAFETY: the whole allocation.
        unsafe { result::memset_d8_async(self.ptr, value, self.len, stream.cu_stream()) }
            .map_err(|e| GpuError::driver("cuMemsetD8Async", e))
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), GpuError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(GpuError::msg(
                "copying",
                format!("range {offset}+{len} exceeds a buffer of {} bytes", self.len),
            ));
        }
        Ok(())
    }

    /// This allocation's CUDA IPC handle (export it once; peers open it once and cache it).
    pub fn ipc_handle(&self) -> Result<IpcHandle, GpuError> {
        self.gpu.bind()?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: ptr is the base of a cuMemAlloc allocation.
        let r = unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), self.ptr) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::msg("cuIpcGetMemHandle", format!("{r:?} (is the memory from cuMemAlloc?)")));
        }
        // SAFETY: initialized by the successful call.
        let h = unsafe { h.assume_init() };
        Ok(IpcHandle(h.reserved.map(|c| c as u8)))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by cuMemAlloc on this context and not freed elsewhere.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A CUDA IPC memory handle (64 opaque bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

/// Another process's device memory mapped into this one; unmapped on drop.
pub struct IpcMapping {
    ptr: CUdeviceptr,
    gpu: Gpu,
}

impl IpcMapping {
    /// Opens `handle` on `gpu` (peer access is enabled lazily when the memory is on another GPU).
    pub fn open(gpu: &Gpu, handle: &IpcHandle) -> Result<IpcMapping, GpuError> {
        gpu.bind()?;
        let h = sys::CUipcMemHandle { reserved: handle.0.map(|b| b as std::ffi::c_char) };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: a handle exported by a live peer; the flag asks the driver to enable peer access.
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::msg(format!("opening a CUDA IPC handle on GPU {}", gpu.ordinal()), format!("{r:?}")));
        }
        Ok(IpcMapping { ptr, gpu: gpu.clone() })
    }

    /// Device address of the mapping in this process.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: opened by cuIpcOpenMemHandle in this process.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Copies `bytes` from `src` to `dst` on `stream` (same GPU, peer, or IPC-mapped memory: with
/// unified addressing the driver picks the copy engine).
///
/// # Safety
/// Both ranges must be valid device memory for the duration of the copy.
pub unsafe fn copy_async(dst: CUdeviceptr, src: CUdeviceptr, bytes: u64, stream: &CudaStream) -> Result<(), GpuError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: forwarded to the caller.
    unsafe { result::memcpy_dtod_async(dst, src, bytes as usize, stream.cu_stream()) }
        .map_err(|e| GpuError::driver("cuMemcpyAsync", e))
}

/// Copies a 2-D region: `rows` rows of `width` bytes from `src` (pitch `src_pitch`) to `dst`
/// (pitch `dst_pitch`), on the copy engines.
///
/// # Safety
/// Both regions must be valid device memory for the duration of the copy.
pub unsafe fn copy2d_async(
    dst: CUdeviceptr,
    dst_pitch: u64,
    src: CUdeviceptr,
    src_pitch: u64,
    width: u64,
    rows: u64,
    stream: &CudaStream,
) -> Result<(), GpuError> {
    if rows <= 1 || (src_pitch == width && dst_pitch == width) {
        // SAFETY: forwarded; a contiguous region is one linear copy.
        return unsafe { copy_async(dst, src, rows * width, stream) };
    }
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch as usize,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch as usize,
        WidthInBytes: width as usize,
        Height: rows as usize,
    };
    // SAFETY: a fully initialized descriptor over caller-validated memory.
    let r = unsafe { sys::cuMemcpy2DAsync_v2(&p, stream.cu_stream()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::msg("cuMemcpy2DAsync", format!("{r:?}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_written_as_nvidia_smi_writes_them_and_compared_in_any_spelling() {
        let id: [u8; 16] = core::array::from_fn(|i| (i as u8) * 17);
        let s = uuid_string(&id);
        assert_eq!(s, "GPU-00112233-4455-6677-8899-aabbccddeeff");
        // torch prints the same UUID without the prefix.
        assert_eq!(normalize_uuid(&s), normalize_uuid("00112233-4455-6677-8899-AABBCCDDEEFF"));
    }

    #[test]
    fn a_worker_that_sees_fewer_gpus_than_its_pod_has_is_told_what_it_saw_and_expected() {
        let seen = vec!["GPU-a".to_string(), "GPU-b".to_string()];
        assert_eq!(missing_gpu("gen-1", 1, 2, &seen), None);
        let why = missing_gpu("gen-3", 3, 8, &seen).unwrap();
        assert!(
            why.starts_with("gen-3 needs GPU 3 of its pod's 8 (the plan), but this worker sees 2 GPU(s): GPU-a, GPU-b"),
            "{why}"
        );
        assert!(why.contains("spec.gpus.sharing"), "{why}");
        // Its own GPU visible is not enough: the pod's are all the worker's to open.
        assert!(missing_gpu("gen-0", 0, 8, &seen).is_some());
        assert!(missing_gpu("trainer-0", 0, 1, &[]).unwrap().contains("sees 0 GPU(s): none"));
    }
}
