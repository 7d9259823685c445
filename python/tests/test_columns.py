"""Column encoding for put (ragged/fixed, dtypes) and batch decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rlplane
from rlplane.columns import decode_batch, decode_column, encode_columns
from rlplane.dtypes import bf16_to_f32, f32_to_bf16, wire_dtype
from rlplane.shm import Arena, Mappings


@pytest.fixture
def arena(shm_dir: Path):
    with Arena("job", "engine-0", min_file_bytes=1 << 16) as a:
        yield a


def read(desc: dict[str, Any]) -> bytes:
    with open(desc["path"], "rb") as f:
        f.seek(desc["offset"])
        return f.read(desc["nbytes"])


def test_ragged_column_layout(arena: Arena) -> None:
    ids = [np.array([1, 2, 3]), np.array([4]), np.array([], dtype=np.int64), np.array([5, 6])]
    wire, n = encode_columns(arena, {"input_ids": ids})
    (c,) = wire
    assert n == 4
    assert {k: c[k] for k in ("name", "dtype", "ragged", "inner", "len")} == {
        "name": "input_ids", "dtype": "i64", "ragged": True, "inner": [], "len": 4,
    }
    assert np.frombuffer(read(c["values"]), "<i8").tolist() == [1, 2, 3, 4, 5, 6]
    assert np.frombuffer(read(c["offsets"]), "<u8").tolist() == [0, 3, 4, 4, 6]
    assert c["values"]["kind"] == "shm" and c["values"]["nbytes"] == 48 and c["offsets"]["nbytes"] == 40


def test_fixed_columns_scalar_and_inner(arena: Arena) -> None:
    wire, n = encode_columns(
        arena,
        {"reward": np.array([0.5, -1.0], dtype=np.float32), "emb": np.arange(12, dtype=np.int32).reshape(2, 2, 3)},
    )
    r, e = wire
    assert n == 2
    assert r == {**r, "dtype": "f32", "ragged": False, "inner": [], "len": 2} and "offsets" not in r
    assert np.frombuffer(read(r["values"]), "<f4").tolist() == [0.5, -1.0]
    assert e["inner"] == [2, 3] and e["dtype"] == "i32"
    assert np.frombuffer(read(e["values"]), "<i4").tolist() == list(range(12))


def test_ragged_rows_with_inner_shape(arena: Arena) -> None:
    rows = [np.ones((2, 3), np.float16), np.zeros((1, 3), np.float16)]
    (c,), _ = encode_columns(arena, {"topk": rows})
    assert c["inner"] == [3] and c["dtype"] == "f16" and c["values"]["nbytes"] == 3 * 3 * 2
    assert np.frombuffer(read(c["offsets"]), "<u8").tolist() == [0, 2, 3]


@pytest.mark.parametrize(
    "dtype,name",
    [(np.bool_, "bool"), (np.uint8, "u8"), (np.int8, "i8"), (np.uint16, "u16"), (np.int16, "i16"),
     (np.uint32, "u32"), (np.int32, "i32"), (np.uint64, "u64"), (np.int64, "i64"), (np.float16, "f16"),
     (np.float32, "f32"), (np.float64, "f64")],
)
def test_every_numpy_dtype_has_its_name(arena: Arena, dtype: Any, name: str) -> None:
    (c,), _ = encode_columns(arena, {"x": np.zeros(3, dtype=dtype)})
    assert c["dtype"] == name and c["values"]["nbytes"] == 3 * np.dtype(dtype).itemsize


def test_bf16_from_bits_with_a_dtype_override(arena: Arena) -> None:
    vals = np.array([1.0, -2.5, 3.140625], dtype=np.float32)
    bits = f32_to_bf16(vals)
    (c,), _ = encode_columns(arena, {"lp": [bits, bits[:1]]}, dtypes={"lp": "bf16"})
    assert c["dtype"] == "bf16"
    assert bf16_to_f32(np.frombuffer(read(c["values"]), "<u2")).tolist() == [1.0, -2.5, 3.140625, 1.0]
    with pytest.raises(rlplane.InvalidError, match="raw bits"):
        encode_columns(arena, {"lp": vals}, dtypes={"lp": "bf16"})


def test_dtype_override_casts(arena: Arena) -> None:
    (c,), _ = encode_columns(arena, {"lp": [[0.5, 0.25], [1.0]]}, dtypes={"lp": "f32"})
    assert c["dtype"] == "f32" and np.frombuffer(read(c["values"]), "<f4").tolist() == [0.5, 0.25, 1.0]


def test_nested_lists_are_ragged_int64(arena: Arena) -> None:
    (c,), n = encode_columns(arena, {"input_ids": [[1, 2], [3]]})
    assert n == 2 and c["dtype"] == "i64" and c["ragged"]


def test_torch_tensors_are_accepted(arena: Arena) -> None:
    torch = pytest.importorskip("torch")
    lp = [torch.tensor([0.5, -1.5], dtype=torch.bfloat16), torch.tensor([2.0], dtype=torch.bfloat16)]
    ids = torch.arange(6).reshape(2, 3)
    w, n = encode_columns(arena, {"lp": lp, "ids": ids})
    assert n == 2 and w[0]["dtype"] == "bf16" and w[1]["dtype"] == "i64" and w[1]["inner"] == [3]
    assert bf16_to_f32(np.frombuffer(read(w[0]["values"]), "<u2")).tolist() == [0.5, -1.5, 2.0]


@pytest.mark.parametrize(
    "columns,kw,match",
    [
        ({}, {}, "at least one column"),
        ({"a": np.zeros(2), "b": np.zeros(3)}, {}, "has 3 samples"),
        ({"a": [np.zeros(2, np.int64), np.zeros(2, np.float32)]}, {}, "one dtype"),
        ({"a": [np.zeros((2, 3)), np.zeros((2, 4))]}, {}, "rows of shape"),
        ({"a": [np.int64(3)]}, {}, "scalar"),
        ({"a": np.float32(1)}, {}, "scalar"),
        ({"a": np.zeros(0)}, {}, "0 samples"),
        ({"a": np.array(["x", "y"], dtype=object)}, {}, "Python objects"),
        ({"a": np.zeros(2, dtype=np.complex64)}, {}, "complex|no rlplane dtype"),
        ({"a": np.zeros(2)}, {"dtypes": {"b": "f32"}}, "not put"),
        ({"a": np.zeros(2)}, {"dtypes": {"a": "f128"}}, "unknown dtype"),
    ],
)
def test_bad_columns_say_what_is_wrong(arena: Arena, columns: dict, kw: dict, match: str) -> None:
    with pytest.raises(rlplane.InvalidError, match=match):
        encode_columns(arena, columns, **kw)


def test_encode_then_decode_round_trip(arena: Arena) -> None:
    ids = [np.arange(k, dtype=np.int64) for k in (5, 0, 3)]
    reward = np.array([1.0, 0.0, -1.0], dtype=np.float32)
    lp = [f32_to_bf16(np.full(k, 0.5, np.float32)) for k in (5, 0, 3)]
    wire, _ = encode_columns(arena, {"input_ids": ids, "reward": reward, "lp": lp}, dtypes={"lp": "bf16"})
    reply = {"ok": True, "step": 4, "samples": 3, "keys": ["a", "b", "c"], "tokens": [5, 1, 3], "columns": wire}
    batch = decode_batch(reply, Mappings())
    assert batch.step == 4 and batch.samples == 3 and len(batch) == 3 and "lp" in batch
    col = batch["input_ids"]
    assert col.ragged and len(col) == 3 and col.values.dtype == np.int64
    assert [s.tolist() for s in col.as_list()] == [list(range(5)), [], [0, 1, 2]]
    assert col.sample(-1).tolist() == [0, 1, 2]
    assert not col.values.flags.writeable
    assert batch["reward"].sample(2) == -1.0 and batch["reward"].offsets is None
    assert batch["lp"].dtype == "bf16" and batch["lp"].values.dtype == np.uint16
    padded, mask = col.padded(-1)
    assert padded.tolist() == [[0, 1, 2, 3, 4], [-1] * 5, [0, 1, 2, -1, -1]]
    assert mask.sum(axis=1).tolist() == [5, 0, 3]
    cut, cmask = col.padded(0, max_len=2)
    assert cut.tolist() == [[0, 1], [0, 0], [0, 1]] and cmask.shape == (3, 2)
    with pytest.raises(KeyError, match="has no column"):
        batch["nope"]
    with pytest.raises(IndexError):
        col.sample(3)


def test_decode_refuses_inconsistent_descriptors(arena: Arena) -> None:
    wire, _ = encode_columns(arena, {"ids": [np.arange(3), np.arange(2)]})
    (c,) = wire
    m = Mappings()
    bad_len = {**c, "len": 3}  # offsets descriptor holds 3 entries, len 3 needs 4
    with pytest.raises(rlplane.ProtocolError, match="offsets"):
        decode_column(bad_len, m)
    short_values = {**c, "values": {**c["values"], "nbytes": 16}}
    with pytest.raises(rlplane.ProtocolError, match="5 rows"):
        decode_column(short_values, m)
    no_offsets = {k: v for k, v in c.items() if k != "offsets"}
    with pytest.raises(rlplane.ProtocolError, match="no offsets"):
        decode_column(no_offsets, m)
    with pytest.raises(rlplane.ProtocolError, match="unknown dtype"):
        decode_column({**c, "dtype": "f8e5m2"}, m)
    reply = {"step": 1, "keys": ["a"], "tokens": [1], "columns": wire}
    with pytest.raises(rlplane.ProtocolError, match="2 samples, the batch 1"):
        decode_batch(reply, m)


def test_wire_dtype_hint_resolves_raw_bits() -> None:
    assert wire_dtype(np.uint16) == "u16"
    assert wire_dtype(np.uint16, "bf16") == "bf16"
    assert wire_dtype(np.uint8, "fp8e4m3") == "fp8e4m3"
    assert wire_dtype(np.float32, "bf16") == "f32"
    with pytest.raises(rlplane.InvalidError):
        wire_dtype(np.dtype(">f4"))


def test_bf16_conversion_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 1000
    x[:4] = [0.0, -0.0, np.inf, -np.inf]
    ours = f32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32)))).all()
