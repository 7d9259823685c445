//! A user process's weights as refit reads and writes them: the tensors it registered (shared-
//! memory files and CUDA IPC allocations mapped into this process), or the sidecar's own staging
//! buffers that an engine loads from itself.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use rlplane_api::RefitVerify;
use rlplane_api::model::TensorSpec;
use serde_json::{Value, json};

use super::protocol::{ApiError, ErrorKind, MemoryDesc, TensorReg, handle_hex, invalid, parse_handle};
use crate::gpu::tensors::DeviceTensors;
use crate::gpu::{Gpu, IpcHandle, IpcMapping};
use crate::refit::memory::{DestinationMemory, MemorySpace, Region, SourceMemory};
use crate::refit::plan::RefitPlan;
use crate::refit::verify::{Side, plan_digest};
use crate::shm::SharedFile;

/// Which memory the rank's refit transport moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory (TCP): shared-memory files.
    Host,
    /// GPU memory (CUDA IPC, NCCL): CUDA IPC handles.
    Device,
}

/// Registered (or staged) weights: one region per tensor of the model, `None` where this rank
/// holds none of it, and what keeps the regions mapped.
pub struct UserWeights {
    regions: Vec<Option<Region>>,
    _files: Vec<Arc<SharedFile>>,
    _mappings: Vec<Arc<IpcMapping>>,
    _staging: Option<DeviceTensors>,
    /// Base of each IPC-mapped allocation → the user's handle for it: a CUDA IPC sender lends
    /// these handles instead of exporting (memory mapped from another process cannot be
    /// exported again).
    imported: HashMap<u64, IpcHandle>,
    gpu: Option<Gpu>,
    bytes: u64,
}

impl std::fmt::Debug for UserWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserWeights").field("tensors", &self.regions.len()).field("bytes", &self.bytes).finish()
    }
}

/// Lists problems, at most a dozen, then how many more.
fn list(problems: &[String]) -> String {
    let mut s = problems.iter().take(12).cloned().collect::<Vec<_>>().join("; ");
    if problems.len() > 12 {
        s.push_str(&format!("; and {} more", problems.len() - 12));
    }
    s
}

impl UserWeights {
    /// Maps what `tensors` describe, checked against the model: `expected[i]` is the shape this
    /// rank holds of tensor `i` (`None`: none of it). Every expected tensor must be registered,
    /// with the model's dtype and that shape, in the memory the transport moves.
    pub fn register(
        manifest: &[TensorSpec],
        expected: &[Option<Vec<u64>>],
        tensors: &[TensorReg],
        name_map: &BTreeMap<String, String>,
        kind: MemoryKind,
        gpu: Option<&Gpu>,
        writable: bool,
    ) -> Result<UserWeights, ApiError> {
        let index: HashMap<&str, usize> = manifest.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let mut problems = Vec::new();
        let mut regions: Vec<Option<Region>> = vec![None; manifest.len()];
        let mut seen = vec![false; manifest.len()];
        let mut mapped = Mapped::new(gpu, writable);
        let mut bytes = 0u64;
        for reg in tensors {
            let name = name_map.get(&reg.name).unwrap_or(&reg.name);
            let (i, len) = match check_tensor(manifest, expected, &index, &mut seen, kind, reg, name) {
                Ok(found) => found,
                Err(problem) => {
                    problems.push(problem);
                    continue;
                }
            };
            regions[i] = Some(mapped.region(name, &reg.memory)?);
            bytes += len;
        }
        problems.extend(unregistered(manifest, expected, &seen));
        if !problems.is_empty() {
            return Err(ApiError::new(
                ErrorKind::Mismatch,
                format!(
                    "the registered tensors do not match the job's model: {}. Register exactly the tensors `hello` lists (use name_map for other names), or fix spec.model",
                    list(&problems)
                ),
            ));
        }
        Ok(UserWeights {
            regions,
            _files: mapped.files.into_values().collect(),
            _mappings: mapped.ipc.into_values().collect(),
            _staging: None,
            imported: mapped.imported,
            gpu: gpu.cloned(),
            bytes,
        })
    }

    /// The sidecar's own buffers for every tensor of the model (an engine's staged mode): one
    /// shared-memory file under `shm_dir` (host) or one exportable allocation per tensor (GPU).
    /// Also returns their descriptors for the engine to map. `mode`: the file's permission bits
    /// (see [`super::RankInfo::shared_mode`]).
    pub fn staging(
        manifest: &[TensorSpec],
        kind: MemoryKind,
        gpu: Option<&Gpu>,
        path: &Path,
        mode: u32,
    ) -> anyhow::Result<(UserWeights, Vec<Value>)> {
        let sizes: Vec<u64> = manifest.iter().map(|t| t.size_bytes()).collect();
        let mut descs = Vec::with_capacity(manifest.len());
        let mut regions = Vec::with_capacity(manifest.len());
        let (files, staging) = match kind {
            MemoryKind::Host => {
                let mut offsets = Vec::with_capacity(sizes.len());
                let mut at = 0u64;
                for s in &sizes {
                    offsets.push(at);
                    at = (at + s).next_multiple_of(64);
                }
                let file = Arc::new(SharedFile::create(path, at.max(1) as usize)?);
                // Another container of the pod may run as another user: let it map the file.
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
                for ((t, s), off) in manifest.iter().zip(&sizes).zip(&offsets) {
                    regions.push(Some(Region { space: MemorySpace::Host, addr: file.address(*off, *s)?, len: *s }));
                    descs.push(json!({"name": t.name, "dtype": t.dtype.as_str(), "shape": t.shape,
                        "memory": {"kind": "shm", "path": path.display().to_string(), "offset": off, "nbytes": s}}));
                }
                (vec![file], None)
            }
            MemoryKind::Device => {
                let gpu = gpu.ok_or_else(|| anyhow::anyhow!("staging in GPU memory without a GPU"))?;
                let d = DeviceTensors::alloc(gpu, sizes.iter().map(|&s| Some(s)))?;
                for (i, (t, s)) in manifest.iter().zip(&sizes).enumerate() {
                    let b = d.buffer(i).ok_or_else(|| anyhow::anyhow!("tensor `{}` has no staging buffer", t.name))?;
                    regions.push(Some(Region {
                        space: MemorySpace::Device { ordinal: gpu.ordinal() as u32 },
                        addr: b.ptr(),
                        len: *s,
                    }));
                    descs.push(json!({"name": t.name, "dtype": t.dtype.as_str(), "shape": t.shape,
                        "memory": {"kind": "cuda_ipc", "handle": handle_hex(&b.ipc_handle()?.0), "offset": 0, "nbytes": s}}));
                }
                (Vec::new(), Some(d))
            }
        };
        let bytes = sizes.iter().sum();
        let w = UserWeights {
            regions,
            _files: files,
            _mappings: Vec::new(),
            _staging: staging,
            imported: HashMap::new(),
            gpu: gpu.cloned(),
            bytes,
        };
        Ok((w, descs))
    }

    /// Bytes registered.
    pub fn total_bytes(&self) -> u64 {
        self.bytes
    }

    /// Tensors registered.
    pub fn tensors(&self) -> usize {
        self.regions.iter().flatten().count()
    }

    /// The user's CUDA IPC handles by the base of their mapping in this process.
    pub fn imported(&self) -> &HashMap<u64, IpcHandle> {
        &self.imported
    }

    /// The refit check's digest of `plan`'s segments on `side` for `version` under `verify`, as
    /// the synthetic roles compute it (the receivers' check compares the two).
    pub fn digest(
        &self,
        plan: &RefitPlan,
        side: Side,
        verify: RefitVerify,
        version: u64,
        id: impl Fn(usize) -> u64,
    ) -> anyhow::Result<Option<u64>> {
        let region = |t: u32| {
            self.regions
                .get(t as usize)
                .copied()
                .flatten()
                .ok_or_else(|| anyhow::anyhow!("tensor {} is not registered but the plan has a segment of it", t))
        };
        // SAFETY: live mappings of this registration, read while no refit writes them (the user
        // process promises not to write its registered tensors while a publish is under way).
        unsafe { plan_digest(plan, side, verify, version, id, region, self.gpu.as_ref()) }
    }
}

/// Checks one registered tensor, named `name` in the model, against the model and what this
/// rank holds of it: its index in the model and its length in bytes, or what is wrong with it.
/// Marks it in `seen`, so a second registration of it is refused.
fn check_tensor(
    manifest: &[TensorSpec],
    expected: &[Option<Vec<u64>>],
    index: &HashMap<&str, usize>,
    seen: &mut [bool],
    kind: MemoryKind,
    reg: &TensorReg,
    name: &str,
) -> Result<(usize, u64), String> {
    let Some(&i) = index.get(name) else {
        return Err(format!("`{name}` is not a tensor of the job's model (spec.model)"));
    };
    let t = &manifest[i];
    if std::mem::replace(&mut seen[i], true) {
        return Err(format!("`{name}` is registered twice"));
    }
    let Some(shape) = &expected[i] else {
        return Err(format!(
            "`{name}`: this rank holds none of it (another pipeline stage or tensor-parallel rank sends it); leave it out"
        ));
    };
    if reg.dtype != t.dtype.as_str() {
        return Err(format!("`{name}`: dtype {} registered, the model has {}", reg.dtype, t.dtype.as_str()));
    }
    if &reg.shape != shape {
        return Err(format!("`{name}`: shape {:?} registered, this rank holds {shape:?}", reg.shape));
    }
    let len = shape.iter().product::<u64>() * t.dtype.size_bytes();
    if reg.memory.nbytes() != len {
        return Err(format!(
            "`{name}`: memory.nbytes is {} but {shape:?} of {} is {len} bytes",
            reg.memory.nbytes(),
            t.dtype.as_str()
        ));
    }
    match (&reg.memory, kind) {
        (MemoryDesc::Shm { .. }, MemoryKind::Device) => Err(format!(
            "`{name}`: shared memory registered, but this job's refit moves GPU memory (CUDA IPC / NCCL): register CUDA tensors"
        )),
        (MemoryDesc::CudaIpc { .. }, MemoryKind::Host) => Err(format!(
            "`{name}`: a CUDA IPC handle registered, but this job's refit moves host memory over TCP (spec.device Cpu or spec.refit.transport Tcp): register CPU tensors in shared memory"
        )),
        _ => Ok((i, len)),
    }
}

/// The problem of the tensors this rank holds that were not registered, if any.
fn unregistered(manifest: &[TensorSpec], expected: &[Option<Vec<u64>>], seen: &[bool]) -> Option<String> {
    let missing: Vec<&str> = manifest
        .iter()
        .enumerate()
        .filter(|(i, _)| expected[*i].is_some() && !seen[*i])
        .map(|(_, t)| t.name.as_str())
        .collect();
    if missing.is_empty() {
        return None;
    }
    let mut m: Vec<String> = missing.iter().take(12).map(|n| format!("`{n}`")).collect();
    if missing.len() > 12 {
        m.push(format!("and {} more", missing.len() - 12));
    }
    Some(format!("{} tensor(s) of the model not registered: {}", missing.len(), m.join(", ")))
}

/// What keeps a registration's memory mapped: each shared-memory file and each CUDA IPC
/// allocation is opened once, however many tensors lie in it.
struct Mapped<'a> {
    gpu: Option<&'a Gpu>,
    /// Files are mapped writable for an engine, which refit writes into.
    writable: bool,
    /// Base of each IPC-mapped allocation → the user's handle for it (see [`UserWeights`]).
    imported: HashMap<u64, IpcHandle>,
    ipc: HashMap<[u8; 64], Arc<IpcMapping>>,
    files: HashMap<String, Arc<SharedFile>>,
}

impl<'a> Mapped<'a> {
    fn new(gpu: Option<&'a Gpu>, writable: bool) -> Mapped<'a> {
        Mapped { gpu, writable, imported: HashMap::new(), ipc: HashMap::new(), files: HashMap::new() }
    }

    /// The region of tensor `name` in `memory`, which [`check_tensor`] found to be of the kind
    /// the transport moves.
    fn region(&mut self, name: &str, memory: &MemoryDesc) -> Result<Region, ApiError> {
        match memory {
            MemoryDesc::Shm { path, offset, nbytes } => self.shm_region(name, path, *offset, *nbytes),
            MemoryDesc::CudaIpc { handle, offset, nbytes } => self.ipc_region(name, handle, *offset, *nbytes),
        }
    }

    /// `nbytes` at `offset` of the shared-memory file at `path`.
    fn shm_region(&mut self, name: &str, path: &str, offset: u64, nbytes: u64) -> Result<Region, ApiError> {
        let file = match self.files.get(path) {
            Some(f) => f.clone(),
            None => {
                let f = Arc::new(SharedFile::open(Path::new(path), self.writable).map_err(|e| invalid(e.to_string()))?);
                self.files.insert(path.to_string(), f.clone());
                f
            }
        };
        let addr = file.address(offset, nbytes).map_err(|e| invalid(format!("`{name}`: {e}")))?;
        Ok(Region { space: MemorySpace::Host, addr, len: nbytes })
    }

    /// `nbytes` at `offset` of the allocation the user's CUDA IPC `handle` (hex) names.
    fn ipc_region(&mut self, name: &str, handle: &str, offset: u64, nbytes: u64) -> Result<Region, ApiError> {
        let gpu = self.gpu.ok_or_else(|| invalid("cuda_ipc memory on a rank without a GPU"))?;
        let h = parse_handle(handle).map_err(|e| invalid(format!("`{name}`: {}", e.message)))?;
        let m = match self.ipc.get(&h) {
            Some(m) => m.clone(),
            None => {
                let m = Arc::new(IpcMapping::open(gpu, &IpcHandle(h)).map_err(|e| {
                    invalid(format!(
                        "`{name}`: {e}; the handle must come from cudaIpcGetMemHandle (or PyTorch's _share_cuda_) of a live allocation on GPU {} in another process",
                        gpu.ordinal()
                    ))
                })?);
                self.imported.insert(m.ptr(), IpcHandle(h));
                self.ipc.insert(h, m.clone());
                m
            }
        };
        let (_, size) = crate::gpu::allocation_range(m.ptr()).map_err(|e| invalid(e.to_string()))?;
        if offset.checked_add(nbytes).is_none_or(|end| end > size as u64) {
            return Err(invalid(format!(
                "`{name}`: bytes {offset}..{} lie outside the {size}-byte allocation of its handle",
                offset.saturating_add(nbytes)
            )));
        }
        Ok(Region { space: MemorySpace::Device { ordinal: gpu.ordinal() as u32 }, addr: m.ptr() + offset, len: nbytes })
    }
}

// SAFETY: the regions stay mapped while the object lives (it holds the files, mappings and
// staging buffers); the user process promises not to write its registered source tensors while
// a publish is under way (docs/local-api.md).
unsafe impl SourceMemory for UserWeights {
    fn tensor_count(&self) -> usize {
        self.regions.len()
    }
    fn source_region(&self, tensor: usize) -> Option<Region> {
        self.regions.get(tensor).copied().flatten()
    }
}

// SAFETY: as above; an engine does not read its weights while a refit runs (refits happen
// between the coordinator's generate commands).
unsafe impl DestinationMemory for UserWeights {
    fn tensor_count(&self) -> usize {
        self.regions.len()
    }
    fn destination_region(&mut self, tensor: usize) -> Option<Region> {
        self.regions.get(tensor).copied().flatten()
    }
}
