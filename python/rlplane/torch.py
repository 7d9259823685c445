"""PyTorch helpers: register a model's parameters in place, open the sidecar's CUDA IPC staging
buffers, and turn batches into tensors.

torch is imported when a function here is called, not when :mod:`rlplane` is imported.

Registering a model (:func:`register_model`):

- **CPU** parameters are moved into the client's shared memory: a buffer per parameter, the
  current values copied in, and the parameter re-pointed at it (``p.data = shared``). The
  ``Parameter`` objects stay the same, so a model and an optimizer created before or after keep
  working — on shared memory, which the sidecar reads at each ``publish`` (or refit writes, on an
  engine in direct mode) with no copy. Call it before training; call it again after anything that
  reallocates parameters (``model.to(...)``, loading a state dict with ``assign=True``).
- **CUDA** tensors are described by PyTorch's own CUDA IPC handles
  (``untyped_storage()._share_cuda_()``); they must be contiguous and stay allocated in place
  while registered (the client keeps references). ``publish`` waits for queued GPU work first.
  At exit PyTorch may warn "Producer process has been terminated before all shared CUDA tensors
  released": its IPC reference count is never decremented by the sidecar, which is not a torch
  process; the warning is harmless. Registered allocations must not come from expandable
  segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): those are mapped with CUDA's
  virtual memory API and have no CUDA IPC handle. A process that wants expandable segments for the
  rest of its memory allocates what it registers inside :func:`ipc_allocations`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .columns import Batch, Column
from .dtypes import numpy_dtype
from .errors import ConfigError, InvalidError, MismatchError, ProtocolError

if TYPE_CHECKING:
    import torch

    from .client import Client, Engine
    from .info import RegisterResult

__all__ = [
    "torch_dtype",
    "wire_dtype_of",
    "tensor_to_numpy",
    "numpy_to_tensor",
    "shared_tensor",
    "cuda_ipc_descriptor",
    "ipc_allocations",
    "describe_tensor",
    "register_model",
    "open_cuda_ipc",
    "staged_tensors",
    "column_tensor",
    "padded",
    "batch_tensors",
]


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"rlplane.torch needs PyTorch ({e}); install it (pip install 'rlplane[torch]')") from None
    return torch


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a protocol dtype name (``bf16`` → ``torch.bfloat16``)."""
    t = _torch()
    table = {
        "bool": t.bool,
        "u8": t.uint8,
        "i8": t.int8,
        "u16": getattr(t, "uint16", None),
        "i16": t.int16,
        "u32": getattr(t, "uint32", None),
        "i32": t.int32,
        "u64": getattr(t, "uint64", None),
        "i64": t.int64,
        "f16": t.float16,
        "bf16": t.bfloat16,
        "f32": t.float32,
        "f64": t.float64,
        "fp8e4m3": getattr(t, "float8_e4m3fn", None),
    }
    numpy_dtype(name)  # unknown names raise InvalidError
    dt = table.get(name)
    if dt is None:
        raise InvalidError(f"this PyTorch ({t.__version__}) has no dtype for {name}")
    return cast("torch.dtype", dt)


def wire_dtype_of(dtype: torch.dtype) -> str:
    """The protocol's dtype name of a torch dtype.

    Raises:
        InvalidError: the dtype has none (complex, float8 variants other than e4m3fn, …).
    """
    t = _torch()
    table = {
        t.bool: "bool",
        t.uint8: "u8",
        t.int8: "i8",
        t.int16: "i16",
        t.int32: "i32",
        t.int64: "i64",
        t.float16: "f16",
        t.bfloat16: "bf16",
        t.float32: "f32",
        t.float64: "f64",
    }
    for name, attr in (("u16", "uint16"), ("u32", "uint32"), ("u64", "uint64"), ("fp8e4m3", "float8_e4m3fn")):
        if hasattr(t, attr):
            table[getattr(t, attr)] = name
    try:
        return table[dtype]
    except KeyError:
        raise InvalidError(f"torch dtype {dtype} has no rlplane dtype; use one of {sorted(set(table.values()))}") from None


def _raw_torch(dtype_name: str) -> Any:
    """The torch dtype of the same size that numpy can exchange for ``dtype_name``'s bytes."""
    t = _torch()
    return {"bf16": t.int16, "u16": t.int16, "fp8e4m3": t.uint8, "u32": t.int32, "u64": t.int64}.get(dtype_name)


def tensor_to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A tensor's values as a numpy array (on the CPU, copied only when needed) and its protocol
    dtype name; ``bf16`` and ``fp8e4m3`` come back as raw bits (``uint16``, ``uint8``)."""
    name = wire_dtype_of(tensor.dtype)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    raw = _raw_torch(name)
    if raw is not None:
        return t.view(raw).numpy().view(numpy_dtype(name)), name
    return t.numpy(), name


def numpy_to_tensor(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    """A zero-copy tensor over a numpy array holding ``dtype_name``'s bytes (``bf16`` bits →
    ``torch.bfloat16``). A read-only array gives a tensor that must not be written."""
    t = _torch()
    raw = _RAW_NUMPY.get(dtype_name)
    src = array.view(raw) if raw is not None else array
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        out = t.from_numpy(src)
    if raw is not None:
        out = out.view(torch_dtype(dtype_name))
    return cast("torch.Tensor", out)


# numpy dtypes whose bytes torch.from_numpy takes for protocol dtypes numpy or older torch lack.
_RAW_NUMPY: dict[str, np.dtype] = {"bf16": np.dtype("<i2"), "u16": np.dtype("<i2"), "fp8e4m3": np.dtype("u1"), "u32": np.dtype("<i4"), "u64": np.dtype("<i8")}


def shared_tensor(client: Client, name: str, dtype: str | None = None, shape: Iterable[int] | None = None) -> torch.Tensor:
    """A zeroed CPU tensor in the client's shared memory (see :meth:`rlplane.Client.alloc`)."""
    spec = client.info.weights_by_name.get(name)
    dtype_name = dtype if dtype is not None else (spec.dtype if spec else None)
    if dtype_name is None:
        raise InvalidError(f"the job's model has no tensor {name!r}: pass dtype and shape")
    arr = client.alloc(name, dtype_name, None if shape is None else tuple(shape))
    return numpy_to_tensor(arr, dtype_name)


def cuda_ipc_descriptor(tensor: torch.Tensor, name: str = "the tensor") -> dict[str, Any]:
    """A ``cuda_ipc`` memory descriptor of a contiguous CUDA tensor, from PyTorch's own IPC handle.

    The handle is the ``cudaIpcGetMemHandle`` of the allocation holding the tensor; the offset is
    the storage's offset in that allocation plus the tensor's offset in its storage.

    Raises:
        InvalidError: not a CUDA tensor, not contiguous, or allocated by expandable segments
            (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), whose handles are not CUDA IPC
            memory handles.
    """
    if tensor.device.type != "cuda":
        raise InvalidError(f"{name} is on {tensor.device}, not a CUDA device")
    if not tensor.is_contiguous():
        raise InvalidError(f"{name} is not contiguous (strides {tuple(tensor.stride())}); register a contiguous tensor (.contiguous() copies)")
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()  # type: ignore[no-untyped-call]
    handle, storage_offset = shared[1], int(shared[3])
    raw = _ipc_handle_bytes(bytes(handle), name)
    return {
        "kind": "cuda_ipc",
        "handle": raw.hex(),
        "offset": storage_offset + tensor.storage_offset() * tensor.element_size(),
        "nbytes": tensor.numel() * tensor.element_size(),
    }


@contextlib.contextmanager
def ipc_allocations() -> Iterator[None]:
    """CUDA allocations made inside come from plain ``cudaMalloc`` segments, which have CUDA IPC
    handles, even in a process that runs PyTorch's expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``); the rest of the process keeps them.

    Allocate what you register there — a trainer's parameters (or the bf16 buffers it gathers
    them into), an engine's direct-mode destinations::

        with rlplane.torch.ipc_allocations():
            model.to("cuda")
        rlplane.torch.register_model(trainer, model)

    Memory allocated inside stays in its own segments after the block; the setting is
    process-wide while the block runs, so other threads' allocations then come from plain
    segments too. Without expandable segments configured it changes nothing.
    """
    torch = _torch()
    conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
    if not expandable:
        yield
        return
    settings = torch.cuda.memory._set_allocator_settings  # noqa: SLF001 - PyTorch's only switch for it
    with _ALLOCATOR_LOCK:
        settings("expandable_segments:False")
        try:
            yield
        finally:
            settings("expandable_segments:True")


_ALLOCATOR_LOCK = threading.Lock()

_IPC_HANDLE_SIZE = 64


def _ipc_handle_bytes(handle: bytes, name: str) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` inside PyTorch's shareable handle.

    Older PyTorch returns the handle itself; newer releases prefix a format version byte and a
    kind byte (``c``: cudaMalloc, ``e``: expandable segment).
    """
    if len(handle) == _IPC_HANDLE_SIZE:
        return handle
    if len(handle) == _IPC_HANDLE_SIZE + 2 and handle[1:2] == b"c":
        return handle[2:]
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise InvalidError(
            f"{name} lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True), whose "
            "handles are not CUDA IPC memory handles: allocate it inside `with rlplane.torch.ipc_allocations():`, "
            "or unset expandable_segments for this process"
        )
    raise InvalidError(f"{name}: PyTorch's CUDA IPC handle has an unknown format ({len(handle)} bytes); this torch is not supported")


def describe_tensor(client: Client, name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """The ``register_weights`` entry of a torch tensor: a CPU tensor in the client's shared
    memory (``shm``) or a CUDA tensor (``cuda_ipc``)."""
    what = f"tensor {name!r}"
    dtype_name = wire_dtype_of(tensor.dtype)
    if tensor.device.type == "cpu":
        if not tensor.is_contiguous():
            raise InvalidError(f"{what} is not contiguous; register a contiguous tensor")
        nbytes = tensor.numel() * tensor.element_size()
        where = client.arena.locate_address(tensor.data_ptr(), nbytes)
        if where is None:
            raise InvalidError(
                f"{what} is a CPU tensor outside this client's shared memory: register the model with "
                "rlplane.torch.register_model(client, model), which moves CPU parameters there, or allocate with "
                "rlplane.torch.shared_tensor(client, name)"
            )
        memory = {"kind": "shm", "path": where[0], "offset": where[1], "nbytes": nbytes}
    elif tensor.device.type == "cuda":
        memory = cuda_ipc_descriptor(tensor, what)
    else:
        raise InvalidError(f"{what} is on {tensor.device}; rlplane registers CPU and CUDA tensors")
    return {"name": name, "dtype": dtype_name, "shape": [int(d) for d in tensor.shape], "memory": memory}


def _named_tensors(model_or_named: Any) -> tuple[dict[str, Any], set[str]]:
    """(name → tensor, names that are buffers) of a module or a mapping / iterable of pairs."""
    t = _torch()
    if isinstance(model_or_named, t.nn.Module):
        named = dict(model_or_named.named_parameters(remove_duplicate=False))
        buffers = {n: b for n, b in model_or_named.named_buffers(remove_duplicate=False) if b is not None}
        return {**named, **buffers}, set(buffers)
    if isinstance(model_or_named, Mapping):
        return dict(model_or_named), set()
    return dict(model_or_named), set()


def _dtensor_type() -> Any:
    """torch's DTensor class, or None where torch.distributed is not built in."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _local_shards(named: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[int, ...] | None]]:
    """Each DTensor (FSDP2, tensor parallel) replaced by its local shard, which is what this rank
    holds and registers in place; and, for each name that was a DTensor, where torch says its
    shard starts in the full tensor (None where torch cannot say it as one box)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return named, {}
    out: dict[str, Any] = {}
    offsets: dict[str, tuple[int, ...] | None] = {}
    for n, v in named.items():
        if isinstance(v, dtensor):
            out[n] = v.to_local()
            offsets[n] = _global_offset(v)
        else:
            out[n] = v
    return out, offsets


def _global_offset(v: Any) -> tuple[int, ...] | None:
    """The DTensor's local shard's first element in the full tensor, by torch's own rule; None
    for placements that are not one box per rank (FSDP2's strided shards over tensor parallelism)
    or a torch that does not expose the rule."""
    if any(type(p).__name__ not in ("Shard", "Replicate") for p in v.placements):
        return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return None
    _, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
    return tuple(int(x) for x in offset)


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … ({len(names)} in all)" if len(names) > limit else "")


def register_model(
    client: Client,
    model_or_named_tensors: Any,
    name_map: Mapping[str, str] | None = None,
    *,
    strict: bool = True,
) -> RegisterResult:
    """Registers a model's tensors with the sidecar in place (trainer, or engine in direct mode).

    ``model_or_named_tensors`` is a ``torch.nn.Module`` (its parameters, and the buffers the job's
    model names) or a mapping / iterable of ``(name, tensor)``. ``name_map`` maps the process's
    names to the model's (``spec.model``) names. Every tensor the rank holds (``shard_shape``)
    must be present, with the model's dtype and shard shape; with ``strict`` (default) a
    parameter the job's model does not name is an error too, else it is left out.

    CPU tensors are moved into shared memory (``p.data = shared``, keeping ``Parameter``
    identity); CUDA tensors are described by CUDA IPC handles and must be contiguous.

    **Distributed tensors** (FSDP2's ``fully_shard``, tensor parallelism through DTensor): each
    rank registers its local shard (``to_local()``) in place, which must be the rows the job's
    layout gives it (``spec.trainer.parallelism.fsdp``: ``torch.chunk`` rows of dimension 0, the
    rank's ``info.rank.fsdp`` of ``fsdp_size``). A rank whose chunk of a tensor is empty leaves it
    out. CUDA shards are registered where FSDP keeps them; a CPU shard must already lie in the
    client's shared memory (``DTensor.from_local`` over :func:`shared_tensor`), since a DTensor's
    storage cannot be moved from outside.

    Raises:
        MismatchError: missing, extra (strict) or differently-shaped/typed tensors, all listed.
        InvalidError: a non-contiguous CUDA tensor (named), a tensor on another device, a CPU
            DTensor shard outside shared memory.
    """
    t = _torch()
    named, buffers = _named_tensors(model_or_named_tensors)
    named, distributed = _local_shards(named)
    name_map = dict(name_map or {})
    specs = client.info.weights_by_name
    model_name = {n: name_map.get(n, n) for n in named}
    # Buffers (rotary tables, masks) are registered only when the job's model names them.
    named = {n: v for n, v in named.items() if n not in buffers or model_name[n] in specs}
    # An empty fully-sharded chunk: the rank holds none of the tensor (torch.chunk's last ranks).
    named = {
        n: v for n, v in named.items()
        if not (n in distributed and v.numel() == 0 and model_name[n] in specs and specs[model_name[n]].shard_shape is None)
    }
    extra = sorted(n for n in named if model_name[n] not in specs or specs[model_name[n]].shard_shape is None)
    present = {model_name[n] for n in named}
    missing = sorted(s.name for s in client.info.weights if s.shard_shape is not None and s.name not in present)
    problems: list[str] = []
    if missing:
        problems.append(f"missing (the job's model has them, this rank holds a shard, the process gave none): {_listing(missing)}")
    if extra and strict:
        problems.append(
            f"extra (not in the job's model, or not held by this rank): {_listing(extra)} — map them with name_map, "
            "or pass strict=False to leave them out"
        )
    selected = {n: v for n, v in named.items() if n not in extra}
    for n, v in selected.items():
        spec = specs[model_name[n]]
        have = wire_dtype_of(v.dtype)
        if have != spec.dtype or tuple(v.shape) != spec.shard_shape:
            problems.append(
                f"`{n}`" + (f" (model `{spec.name}`)" if spec.name != n else "")
                + f": {have} {list(v.shape)}, the model has {spec.dtype} {list(spec.shard_shape or ())}"
            )
        elif distributed.get(n) is not None and spec.shard_offset is not None and distributed[n] != spec.shard_offset:
            problems.append(
                f"`{n}`: this rank's DTensor shard starts at {list(distributed[n] or ())} of the full tensor, the "
                f"job's layout gives this rank the part from {list(spec.shard_offset)}: build the device mesh over "
                "the ranks in rlplane's order (info.rank.tp, then fsdp = dp % fsdp_size), or the engines would get "
                "rows in the wrong place"
            )
    if problems:
        raise MismatchError(
            f"the tensors do not match the job's model ({client.info.job.name}, {len(client.info.weights)} tensors): "
            + "; ".join(problems),
            op="register_weights",
        )
    arena = client.arena
    for n, v in selected.items():
        if v.device.type == "cpu":
            nbytes = v.numel() * v.element_size()
            if v.is_contiguous() and arena.locate_address(v.data_ptr(), nbytes) is not None:
                continue  # already shared (e.g. the second name of tied weights)
            if n in distributed:
                raise InvalidError(
                    f"tensor `{n}` is a DTensor whose CPU shard lies outside this client's shared memory, and a "
                    "DTensor's storage cannot be moved from outside: build it with DTensor.from_local(local, mesh, "
                    "placements) over local = rlplane.torch.shared_tensor(client, name, dtype, shard_shape), or train on CUDA"
                )
            spec = specs[model_name[n]]
            shared = shared_tensor(client, spec.name, spec.dtype, tuple(v.shape))
            with t.no_grad():
                shared.copy_(v.detach())
            v.data = shared
        elif v.device.type == "cuda":
            if not v.is_contiguous():
                raise InvalidError(f"tensor `{n}` is not contiguous (strides {tuple(v.stride())}); CUDA tensors are registered in place and must be contiguous")
        else:
            raise InvalidError(f"tensor `{n}` is on {v.device}; rlplane registers CPU and CUDA tensors")
    used_map = {n: m for n, m in name_map.items() if n in selected and m != n}
    return client.register(selected, name_map=used_map or None)


# -- CUDA IPC: opening the sidecar's handles --------------------------------------------------

_cudart_lock = threading.Lock()
_cudart: Any = None
_opened: dict[tuple[str, int], int] = {}


class _IpcHandle(ctypes.Structure):
    # Bytes, not c_char: a c_char array assigned from bytes stops at the first NUL.
    _fields_ = [("reserved", ctypes.c_ubyte * _IPC_HANDLE_SIZE)]


def _load_cudart() -> Any:
    """The CUDA runtime library PyTorch uses (the one already loaded in this process, so the
    current device and contexts are shared with torch)."""
    global _cudart
    with _cudart_lock:
        if _cudart is not None:
            return _cudart
        t = _torch()
        if not t.cuda.is_available():
            raise ConfigError("CUDA IPC memory needs a CUDA device, and torch.cuda.is_available() is False in this process")
        t.cuda.init()
        tried: list[str] = []
        candidates: list[str] = []
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    parts = line.split()
                    if len(parts) >= 6 and "libcudart.so" in os.path.basename(parts[-1]) and parts[-1] not in candidates:
                        candidates.append(parts[-1])
        except OSError:
            pass
        major = (t.version.cuda or "").split(".")[0]
        if major:
            candidates.append(f"libcudart.so.{major}")
        candidates.append("libcudart.so")
        for c in candidates:
            try:
                lib = ctypes.CDLL(c)
                lib.cudaIpcOpenMemHandle  # noqa: B018 - raises AttributeError if absent
            except (OSError, AttributeError) as e:
                tried.append(f"{c} ({e})")
                continue
            lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
            lib.cudaIpcOpenMemHandle.restype = ctypes.c_int
            lib.cudaGetErrorString.argtypes = [ctypes.c_int]
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaGetLastError.argtypes = []
            lib.cudaGetLastError.restype = ctypes.c_int
            _cudart = lib
            return lib
        raise ConfigError(
            "cannot load the CUDA runtime (libcudart) to open CUDA IPC handles; tried: " + "; ".join(tried)
            + ". PyTorch's CUDA build loads it: is this a CPU-only torch?"
        )


def _open_handle(handle_hex: str, device: int) -> int:
    key = (handle_hex, device)
    with _cudart_lock:
        ptr = _opened.get(key)
    if ptr is not None:
        return ptr
    try:
        raw = bytes.fromhex(handle_hex)
    except ValueError:
        raise ProtocolError(f"a cuda_ipc handle is not hex: {handle_hex[:20]}…") from None
    if len(raw) != _IPC_HANDLE_SIZE:
        raise ProtocolError(f"a cuda_ipc handle has {len(raw)} bytes, not {_IPC_HANDLE_SIZE}")
    lib = _load_cudart()
    t = _torch()
    out = ctypes.c_void_p()
    with t.cuda.device(device):
        rc = lib.cudaIpcOpenMemHandle(ctypes.byref(out), _IpcHandle.from_buffer_copy(raw), 1)  # lazy peer access
    if rc != 0:
        msg = lib.cudaGetErrorString(rc).decode(errors="replace")
        lib.cudaGetLastError()  # clear it, or torch's next CUDA call reports it as its own
        raise ConfigError(
            f"cudaIpcOpenMemHandle failed on cuda:{device}: {msg} (error {rc}). The handle must come from another "
            "process on the same machine, with this process able to see that GPU (CUDA_VISIBLE_DEVICES)"
        )
    with _cudart_lock:
        _opened.setdefault(key, int(out.value or 0))
        return _opened[key]


class _CudaMemory:
    """A raw device range, for ``torch.as_tensor`` through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def open_cuda_ipc(memory: Mapping[str, Any], dtype_name: str, shape: Iterable[int], device: int | None = None) -> torch.Tensor:
    """A tensor over a ``cuda_ipc`` descriptor from another process (zero-copy).

    Opens the handle in this process (``cudaIpcOpenMemHandle`` of the CUDA runtime torch loaded;
    once per handle, cached) on ``device`` (default: torch's current device) and views
    ``offset``..``offset + nbytes`` as ``dtype_name`` and ``shape``.
    """
    t = _torch()
    shape = tuple(int(d) for d in shape)
    try:
        handle, offset, nbytes = str(memory["handle"]), int(memory["offset"]), int(memory["nbytes"])
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"a cuda_ipc descriptor needs handle, offset and nbytes: {dict(memory)}") from None
    dt = torch_dtype(dtype_name)
    need = int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype_name).itemsize
    if need != nbytes:
        raise ProtocolError(f"a cuda_ipc descriptor holds {nbytes} bytes, {dtype_name} {list(shape)} needs {need}")
    dev = t.cuda.current_device() if device is None else int(device)
    if nbytes == 0:
        return cast("torch.Tensor", t.empty(shape, dtype=dt, device=t.device("cuda", dev)))
    base = _open_handle(handle, dev)
    raw = t.as_tensor(_CudaMemory(base + offset, nbytes), device=t.device("cuda", dev))
    return cast("torch.Tensor", raw.view(dt).view(shape))


def staged_tensors(engine: Engine, device: int | None = None) -> dict[str, torch.Tensor]:
    """The engine's staging buffers as torch tensors, by the model's names.

    Registers in staged mode first if the engine has not. CUDA IPC buffers are opened on
    ``device`` (default: torch's current device); shared-memory buffers become CPU tensors over
    the read-only mapping (do not write them).
    """
    views = engine.staging or engine.register_staged()
    t = _torch()
    specs = {s["name"]: s for s in engine._staging}
    out: dict[str, Any] = {}
    for name, v in views.items():
        if isinstance(v, t.Tensor):
            if device is not None and v.device.index != device:
                s = specs[name]
                v = open_cuda_ipc(s["memory"], s["dtype"], s["shape"], device)
            out[name] = v
        else:
            out[name] = numpy_to_tensor(v, specs[name]["dtype"])
    return out


# -- batches ------------------------------------------------------------------------------------


def column_tensor(column: Column) -> torch.Tensor:
    """A column's values as a CPU tensor (zero-copy over the read-only batch file: do not write
    it; valid until the next ``next_batch``)."""
    return numpy_to_tensor(column.values, column.dtype)


def padded(
    column: Column, pad_value: int | float = 0, *, max_len: int | None = None, device: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged column as a padded ``[n, max_len, *inner]`` tensor and a boolean ``[n, max_len]``
    mask (True on real rows); a fixed column gives ``[n, 1, *inner]`` and an all-true mask."""
    t = _torch()
    fill: int | float = pad_value
    if column.dtype in ("bf16", "fp8e4m3"):
        # numpy holds the raw bits: pad with the bits of pad_value in that dtype.
        bits = t.tensor(float(pad_value), dtype=torch_dtype(column.dtype)).view(_raw_torch(column.dtype))
        fill = int(bits.item()) & (0xFFFF if column.dtype == "bf16" else 0xFF)
    vals, mask_np = column.padded(fill, max_len)
    out = numpy_to_tensor(vals, column.dtype)
    mask = t.from_numpy(mask_np)
    if device is not None:
        out, mask = out.to(device), mask.to(device)
    return out, mask


def batch_tensors(batch: Batch, pad_value: int | float = 0, *, device: Any = None) -> dict[str, torch.Tensor]:
    """Every column of a batch as a tensor: ragged columns padded (``[n, max_len, *inner]``, with
    their mask as ``"<name>_mask"``), fixed columns ``[n, *inner]`` (copied)."""
    out: dict[str, Any] = {}
    for name, col in batch.columns.items():
        if col.ragged:
            values, mask = padded(col, pad_value, device=device)
            out[name] = values
            out[f"{name}_mask"] = mask
        else:
            v = numpy_to_tensor(np.array(col.values), col.dtype)
            out[name] = v.to(device) if device is not None else v
    return out
