"""Byte-exact weight contents for the integration tests of test_integration_more.py: the full
tensor every engine must hold at each version (distinct values per element, so a byte moved to
the wrong place shows), and the part of it a tensor-parallel trainer rank holds."""

from __future__ import annotations

import numpy as np

from rlplane.dtypes import f32_to_bf16, numpy_dtype


def full(version: int, index: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `index` of the model at `version`, as its raw bytes' numpy array (bf16 as uint16
    bits). Small integers: exact in every dtype used (bf16, f32, i32, …)."""
    n = int(np.prod(shape, dtype=np.int64))
    vals = ((np.arange(n, dtype=np.int64) * 7 + version * 13 + index * 31) % 251 - 125).astype(np.float32)
    if dtype == "bf16":
        return f32_to_bf16(vals).reshape(shape)
    return vals.astype(numpy_dtype(dtype)).reshape(shape)


def shard(whole: np.ndarray, shard_shape: tuple[int, ...], tp: int) -> np.ndarray:
    """The part of `whole` tensor-parallel rank `tp` holds, as the sidecar's `shard_shape`
    implies it (refit/src/plan.rs): the whole tensor, or an even split along dimension 0
    (tpSplit Rows) or dimension 1 (Columns)."""
    if tuple(shard_shape) == whole.shape:
        return whole
    if shard_shape[0] != whole.shape[0]:
        k = shard_shape[0]
        return whole[tp * k : (tp + 1) * k]
    k = shard_shape[1]
    return whole[:, tp * k : (tp + 1) * k]


def poison(arr: np.ndarray) -> None:
    """Overwrites `arr` with bytes no version holds (0xA5…)."""
    arr.view(np.uint8)[...] = 0xA5
