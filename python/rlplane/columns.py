"""Columns of rollouts and batches, as the transfer queue stores them.

A *ragged* column holds a variable number of rows per sample (``input_ids``, ``logprobs``): the
values of every sample back to back, plus ``len + 1`` little-endian ``u64`` row offsets starting at
0, sample ``i`` owning rows ``offsets[i]:offsets[i+1]``. A *fixed* column holds exactly one row per
sample (``reward``). A row has shape ``inner`` (empty for scalars and plain token sequences).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .dtypes import RAW_DTYPES, numpy_dtype, wire_dtype
from .errors import InvalidError, ProtocolError
from .shm import Arena, Mappings

__all__ = ["Column", "Batch", "encode_columns", "decode_column", "decode_batch", "ColumnInput"]

#: What :meth:`rlplane.Engine.put` takes for one column: a list of per-sample arrays (ragged), or
#: one array of ``n`` rows (fixed). torch tensors are accepted in place of numpy arrays.
ColumnInput = Any


@dataclass(frozen=True)
class Column:
    """One field of a batch.

    Attributes:
        name: the field's name.
        dtype: the protocol's dtype name (``bf16`` values are raw ``uint16`` bits in ``values``).
        ragged: whether samples have a variable number of rows.
        inner: shape of one row.
        values: the values, zero-copy from the sidecar's batch file, read-only: ``[rows, *inner]``
            (ragged) or ``[len, *inner]`` (fixed). Valid until the next ``next_batch``; copy
            (``np.array(col.values)``) to keep them longer.
        offsets: ``len + 1`` row offsets (ragged), else None.
    """

    name: str
    dtype: str
    ragged: bool
    inner: tuple[int, ...]
    values: np.ndarray
    offsets: npt.NDArray[np.uint64] | None = None

    def __len__(self) -> int:
        if self.offsets is not None:
            return len(self.offsets) - 1
        return int(self.values.shape[0])

    def sample(self, i: int) -> np.ndarray:
        """Sample ``i``'s value: its rows (ragged, ``[rows_i, *inner]``) or its one row (fixed)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"column {self.name!r} has {n} samples, no sample {i}")
        i %= n
        if self.offsets is not None:
            return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]
        row: np.ndarray = self.values[i]
        return row

    def lengths(self) -> npt.NDArray[np.int64]:
        """Rows per sample (all 1 for a fixed column)."""
        if self.offsets is None:
            return np.ones(len(self), dtype=np.int64)
        return np.diff(self.offsets).astype(np.int64)

    def as_list(self) -> list[np.ndarray]:
        """Every sample's value, in order (views, no copy)."""
        return [self.sample(i) for i in range(len(self))]

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.as_list())

    def padded(self, pad_value: int | float = 0, max_len: int | None = None) -> tuple[np.ndarray, npt.NDArray[np.bool_]]:
        """A ragged column as a dense ``[len, max_len, *inner]`` array and a ``[len, max_len]`` mask.

        ``max_len`` defaults to the longest sample; longer samples are cut. A fixed column gives
        ``[len, 1, *inner]`` and an all-true mask.
        """
        n = len(self)
        lengths = self.lengths()
        width = int(lengths.max(initial=0)) if max_len is None else int(max_len)
        out = np.full((n, width, *self.inner), pad_value, dtype=self.values.dtype)
        keep = np.minimum(lengths, width)
        row = np.repeat(np.arange(n), keep)
        starts = np.zeros(n, dtype=np.int64) if self.offsets is None else self.offsets[:-1].astype(np.int64)
        col = np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep, keep)
        src = np.repeat(starts, keep) + col
        out[row, col] = self.values[src]
        mask = np.arange(width)[None, :] < keep[:, None]
        return out, mask


@dataclass(frozen=True)
class Batch:
    """A trainer rank's batch of one step (the reply of ``next_batch``).

    Attributes:
        step: the RL step the samples were generated for.
        keys: one key per sample.
        tokens: the token count of each sample (what the assignment balanced).
        columns: every field by name.
        tags: per-sample tags (lists of ``(key, value)`` pairs) when the sidecar sent them.
        raw: the reply as received.
    """

    step: int
    keys: list[str]
    tokens: list[int]
    columns: dict[str, Column]
    tags: list[list[tuple[str, str]]] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def samples(self) -> int:
        """Number of samples."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, name: str) -> Column:
        try:
            return self.columns[name]
        except KeyError:
            raise KeyError(f"the batch has no column {name!r}; it has {sorted(self.columns)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.columns


def _is_torch(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _to_numpy(x: Any, what: str) -> tuple[np.ndarray, str | None]:
    """An input value as numpy, plus the dtype name a torch tensor implies (bf16/fp8)."""
    if _is_torch(x):
        from .torch import tensor_to_numpy

        return tensor_to_numpy(x)
    try:
        return np.asarray(x), None
    except Exception as e:  # noqa: BLE001 - any conversion failure is the user's input
        raise InvalidError(f"{what}: cannot be read as an array ({e})") from None


def _prepare(value: np.ndarray, implied: str | None, override: str | None, what: str) -> tuple[np.ndarray, str]:
    want = override or implied
    if want is not None and want in RAW_DTYPES:
        if implied == want or value.dtype == RAW_DTYPES[want]:
            return value, want
        raise InvalidError(
            f"{what}: dtype {want} needs its raw bits ({RAW_DTYPES[want]}) or a torch tensor of that dtype, "
            f"got {value.dtype}; convert with rlplane.dtypes.f32_to_bf16 for bf16"
        )
    if want is not None:
        dt = numpy_dtype(want)
        if value.dtype != dt:
            if value.dtype == object:
                raise InvalidError(f"{what}: holds Python objects, not numbers")
            value = value.astype(dt)
        return value, want
    if value.dtype == object:
        raise InvalidError(f"{what}: holds Python objects (rows of different lengths?); pass a list of arrays for a ragged column")
    name = wire_dtype(value.dtype)
    return value, name


def encode_columns(
    arena: Arena,
    columns: Mapping[str, ColumnInput],
    dtypes: Mapping[str, str] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Writes columns into the arena and returns their wire form and the number of samples.

    Each value is either a list/tuple of per-sample arrays (a ragged column: sample ``i`` is an
    array ``[rows_i, *inner]``, a 1-D array for a token sequence) or one array of ``n`` rows (a
    fixed column: ``[n]`` for scalars, ``[n, *inner]``). ``dtypes`` names a column's dtype where
    the array's dtype does not say it (``bf16`` given as ``uint16`` bits) or to cast.

    Raises:
        InvalidError: no columns, columns of different sample counts, rows of different inner
            shapes, unknown dtypes.
    """
    if not columns:
        raise InvalidError("put needs at least one column")
    dtypes = dict(dtypes or {})
    unknown = sorted(set(dtypes) - set(columns))
    if unknown:
        raise InvalidError(f"dtypes names columns that are not put: {unknown}")
    out: list[dict[str, Any]] = []
    n_samples: int | None = None
    first: str | None = None
    for name, value in columns.items():
        if not isinstance(name, str) or not name:
            raise InvalidError(f"column names must be non-empty strings, not {name!r}")
        what = f"column {name!r}"
        override = dtypes.get(name)
        if override is not None:
            numpy_dtype(override)  # validates the name
        if isinstance(value, (list, tuple)):
            wire, n = _encode_ragged(arena, name, value, override, what)
        else:
            wire, n = _encode_fixed(arena, name, value, override, what)
        if n_samples is None:
            n_samples, first = n, name
        elif n != n_samples:
            raise InvalidError(f"column {name!r} has {n} samples, column {first!r} has {n_samples}: every column needs one entry per sample")
        out.append(wire)
    assert n_samples is not None
    if n_samples == 0:
        raise InvalidError("put of 0 samples: pass at least one sample per column")
    return out, n_samples


def _encode_ragged(arena: Arena, name: str, rows: Sequence[Any], override: str | None, what: str) -> tuple[dict[str, Any], int]:
    arrays: list[np.ndarray] = []
    dtype_name: str | None = None
    inner: tuple[int, ...] | None = None
    for i, r in enumerate(rows):
        a, implied = _to_numpy(r, f"{what} sample {i}")
        if a.ndim == 0:
            raise InvalidError(f"{what} sample {i} is a scalar; a ragged column takes a 1-D (or higher) array per sample, a fixed column one array of all samples")
        a, dn = _prepare(a, implied, override, f"{what} sample {i}")
        if dtype_name is None:
            dtype_name, inner = dn, tuple(a.shape[1:])
        elif dn != dtype_name:
            raise InvalidError(f"{what}: sample {i} is {dn}, sample 0 is {dtype_name}; give every sample one dtype (or pass dtypes={{{name!r}: ...}})")
        elif tuple(a.shape[1:]) != inner:
            raise InvalidError(f"{what}: sample {i} has rows of shape {list(a.shape[1:])}, sample 0 of {list(inner or ())}")
        arrays.append(a)
    if dtype_name is None:
        dtype_name = override or "i64"
        inner = ()
    assert inner is not None
    dt = numpy_dtype(dtype_name)
    n = len(arrays)
    counts = np.fromiter((a.shape[0] for a in arrays), dtype=np.uint64, count=n)
    offsets_host = np.zeros(n + 1, dtype="<u8")
    np.cumsum(counts, out=offsets_host[1:])
    total_rows = int(offsets_host[-1])
    row_elems = int(np.prod(inner, dtype=np.int64))
    vseg = arena.alloc(total_rows * row_elems * dt.itemsize)
    oseg = arena.alloc(offsets_host.nbytes)
    values = vseg.array.view(dt).reshape((total_rows, *inner))
    pos = 0
    for a in arrays:
        k = a.shape[0]
        values[pos : pos + k] = a.view(dt) if a.dtype != dt and a.dtype.itemsize == dt.itemsize else a
        pos += k
    oseg.array.view("<u8")[:] = offsets_host
    wire = {
        "name": name,
        "dtype": dtype_name,
        "ragged": True,
        "inner": list(inner),
        "len": n,
        "values": vseg.descriptor,
        "offsets": oseg.descriptor,
    }
    return wire, n


def _encode_fixed(arena: Arena, name: str, value: Any, override: str | None, what: str) -> tuple[dict[str, Any], int]:
    a, implied = _to_numpy(value, what)
    if a.ndim == 0:
        raise InvalidError(f"{what} is a scalar; a fixed column takes one array of n samples ([n] or [n, ...])")
    a, dtype_name = _prepare(a, implied, override, what)
    dt = numpy_dtype(dtype_name)
    seg = arena.alloc(a.nbytes)
    seg.array.view(dt).reshape(a.shape)[...] = a.view(dt) if a.dtype != dt else a
    wire = {
        "name": name,
        "dtype": dtype_name,
        "ragged": False,
        "inner": list(a.shape[1:]),
        "len": int(a.shape[0]),
        "values": seg.descriptor,
    }
    return wire, int(a.shape[0])


def decode_column(wire: Mapping[str, Any], mappings: Mappings) -> Column:
    """Maps one column of a batch (zero-copy, read-only) and checks its sizes.

    Raises:
        ProtocolError: a field is missing, or the sizes in the descriptors do not add up.
    """
    try:
        name = str(wire["name"])
        dtype_name = str(wire["dtype"])
        ragged = bool(wire["ragged"])
        inner = tuple(int(d) for d in (wire.get("inner") or ()))
        n = int(wire["len"])
        values_desc = wire["values"]
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"a batch column lacks a field or has a wrong one ({e!r}): {dict(wire)}") from None
    what = f"column {name!r}"
    try:
        dt = numpy_dtype(dtype_name)
    except InvalidError:
        raise ProtocolError(f"{what}: unknown dtype {dtype_name!r}; is this client older than the sidecar?") from None
    row_bytes = int(np.prod(inner, dtype=np.int64)) * dt.itemsize
    if ragged:
        if "offsets" not in wire:
            raise ProtocolError(f"{what} is ragged but has no offsets")
        offsets = mappings.array(wire["offsets"], "<u8", (n + 1,), f"{what} offsets")
        if n + 1 > 0 and int(offsets[0]) != 0:
            raise ProtocolError(f"{what}: offsets start at {int(offsets[0])}, not 0")
        if n > 0 and np.any(offsets[1:] < offsets[:-1]):
            raise ProtocolError(f"{what}: offsets decrease")
        rows = int(offsets[-1])
        raw = mappings.bytes(values_desc, f"{what} values")
        if raw.nbytes != rows * row_bytes:
            raise ProtocolError(f"{what}: {rows} rows of {row_bytes} bytes need {rows * row_bytes} bytes, the values hold {raw.nbytes}")
        values = mappings.array(values_desc, dt, (rows, *inner), f"{what} values")
        return Column(name, dtype_name, True, inner, values, offsets)
    values = mappings.array(values_desc, dt, (n, *inner), f"{what} values")
    return Column(name, dtype_name, False, inner, values, None)


def decode_batch(reply: Mapping[str, Any], mappings: Mappings) -> Batch:
    """Builds a :class:`Batch` from a ``next_batch`` reply (not ``done``)."""
    try:
        step = int(reply["step"])
        keys = [str(k) for k in reply.get("keys", [])]
        tokens = [int(t) for t in reply.get("tokens", [])]
        wire_columns = reply.get("columns", [])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"next_batch reply lacks a field or has a wrong one ({e!r})") from None
    columns: dict[str, Column] = {}
    for w in wire_columns:
        col = decode_column(w, mappings)
        if len(col) != len(keys):
            raise ProtocolError(f"column {col.name!r} has {len(col)} samples, the batch {len(keys)} keys")
        columns[col.name] = col
    samples = reply.get("samples")
    if samples is not None and int(samples) != len(keys):
        raise ProtocolError(f"next_batch says {samples} samples but lists {len(keys)} keys")
    tags_raw = reply.get("tags")
    tags = None
    if tags_raw is not None:
        tags = [[(str(k), str(v)) for k, v in t] for t in tags_raw]
    return Batch(step=step, keys=keys, tokens=tokens, columns=columns, tags=tags, raw=dict(reply))
