"""Element types as the manifest and the transfer queue name them, and their numpy forms.

``bf16`` and ``fp8e4m3`` have no numpy dtype: numpy arrays hold their raw bits (``uint16`` and
``uint8``); :func:`f32_to_bf16` and :func:`bf16_to_f32` convert. torch has both
(``torch.bfloat16``, ``torch.float8_e4m3fn``), see :mod:`rlplane.torch`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "DTYPES",
    "RAW_DTYPES",
    "numpy_dtype",
    "itemsize",
    "wire_dtype",
    "f32_to_bf16",
    "bf16_to_f32",
]

#: Every dtype name the protocol knows, with the numpy dtype that holds its bytes (little-endian).
DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype("?"),
    "u8": np.dtype("u1"),
    "i8": np.dtype("i1"),
    "u16": np.dtype("<u2"),
    "i16": np.dtype("<i2"),
    "u32": np.dtype("<u4"),
    "i32": np.dtype("<i4"),
    "u64": np.dtype("<u8"),
    "i64": np.dtype("<i8"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
    "f32": np.dtype("<f4"),
    "f64": np.dtype("<f8"),
    "fp8e4m3": np.dtype("u1"),
}

#: dtypes numpy holds as raw bits, with the numpy dtype of the bits.
RAW_DTYPES: dict[str, np.dtype] = {"bf16": np.dtype("<u2"), "fp8e4m3": np.dtype("u1")}

_FROM_NUMPY: dict[np.dtype, str] = {
    np.dtype("?"): "bool",
    np.dtype("u1"): "u8",
    np.dtype("i1"): "i8",
    np.dtype("<u2"): "u16",
    np.dtype("<i2"): "i16",
    np.dtype("<u4"): "u32",
    np.dtype("<i4"): "i32",
    np.dtype("<u8"): "u64",
    np.dtype("<i8"): "i64",
    np.dtype("<f2"): "f16",
    np.dtype("<f4"): "f32",
    np.dtype("<f8"): "f64",
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype holding ``name``'s bytes (``bf16`` → ``uint16``, ``fp8e4m3`` → ``uint8``).

    Raises:
        InvalidError: unknown name.
    """
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        from .errors import InvalidError

        raise InvalidError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def itemsize(name: str) -> int:
    """Bytes per element of ``name``."""
    return numpy_dtype(name).itemsize


def wire_dtype(dtype: npt.DTypeLike, hint: str | None = None) -> str:
    """The protocol's name for a numpy dtype.

    ``hint`` resolves raw bits: a ``uint16`` array with ``hint="bf16"`` is ``bf16``, a ``uint8``
    array with ``hint="fp8e4m3"`` is ``fp8e4m3``; any other hint is ignored.

    Raises:
        InvalidError: the dtype has no protocol name (big-endian, complex, object, …).
    """
    dt = np.dtype(dtype)
    if dt.byteorder == "=" or dt.byteorder == "|":
        dt = dt.newbyteorder("<") if dt.itemsize > 1 else dt
    if hint in RAW_DTYPES and RAW_DTYPES[hint] == dt:
        return hint
    try:
        return _FROM_NUMPY[dt]
    except KeyError:
        from .errors import InvalidError

        raise InvalidError(
            f"numpy dtype {np.dtype(dtype)} has no rlplane dtype; use one of "
            + ", ".join(str(d) for d in _FROM_NUMPY)
            + " (little-endian), uint16 bits for bf16 or uint8 bits for fp8e4m3"
        ) from None


def f32_to_bf16(values: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """Rounds float32 values to bfloat16 (round to nearest even), returning the raw ``uint16`` bits."""
    x = np.ascontiguousarray(values, dtype="<f4")
    bits = x.view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype("<u2")
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype("<u2")  # keep NaN a quiet NaN
    return out


def bf16_to_f32(bits: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Widens raw bfloat16 bits (``uint16``) to float32 exactly."""
    b = np.ascontiguousarray(bits, dtype="<u2")
    return (b.astype("<u4") << 16).view("<f4")
