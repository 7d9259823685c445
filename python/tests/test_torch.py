"""rlplane.torch on the CPU: registering a model in place, dtypes, batches as tensors."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import rlplane  # noqa: E402
import rlplane.torch as rt  # noqa: E402
from rlplane.columns import decode_batch, encode_columns  # noqa: E402
from rlplane.shm import Mappings  # noqa: E402

from .conftest import HELLO  # noqa: E402
from .recorder import offline  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 64)
        self.norm = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        self.lm_head = torch.nn.Linear(64, 16, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("rope", torch.arange(4.0))


NAME_MAP = {"embed.weight": "embed.weight", "norm": "norm.weight", "lm_head.weight": "lm_head.weight"}


def file_bytes(desc: dict, n: int) -> bytes:
    with open(desc["path"], "rb") as f:
        f.seek(desc["offset"])
        return f.read(n)


def test_cpu_model_moves_into_shared_memory_in_place(shm_dir: Path) -> None:
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t, rec = offline(rlplane.Trainer, HELLO, register_weights={"ok": True, "tensors": 3, "bytes": 8320})
    rt.register_model(t, model, NAME_MAP)
    # same Parameter objects, same values, now in the client's shared memory
    for n, p in model.named_parameters():
        assert p is params[n] and torch.equal(p.detach(), before[n])
        assert t.arena.locate_address(p.data_ptr(), p.numel() * p.element_size()) is not None
    assert model.embed.weight.data_ptr() == model.lm_head.weight.data_ptr()  # still tied
    req = rec.requests[-1]
    by = {e["name"]: e for e in req["tensors"]}
    assert set(by) == {"embed.weight", "norm", "lm_head.weight"} and req["name_map"] == {"norm": "norm.weight"}
    assert by["norm"]["dtype"] == "bf16" and by["embed.weight"]["memory"] == by["lm_head.weight"]["memory"]
    # the optimizer keeps training the shared bytes: the sidecar sees every step
    model.embed.weight.grad = torch.ones_like(model.embed.weight)
    opt.step()
    got = np.frombuffer(file_bytes(by["embed.weight"]["memory"], 4096), "<f4").reshape(16, 64)
    assert np.allclose(got, (before["embed.weight"] - 0.1).numpy())
    # registering again finds the parameters already shared: no new allocation
    n_files = len(t.arena.paths)
    rt.register_model(t, model, NAME_MAP)
    assert len(t.arena.paths) == n_files and rec.requests[-1]["tensors"] == req["tensors"]


def test_mismatches_are_listed_before_anything_moves(shm_dir: Path) -> None:
    model = Tiny(tied=False)
    ptr = model.embed.weight.data_ptr()
    t, rec = offline(rlplane.Trainer, HELLO)
    with pytest.raises(rlplane.MismatchError) as info:
        rt.register_model(t, model)  # no name_map: `norm` is not a model name
    msg = str(info.value)
    assert "missing" in msg and "norm.weight" in msg and "extra" in msg and "`norm`" not in msg.split("extra")[0]
    assert "name_map" in msg
    assert model.embed.weight.data_ptr() == ptr and rec.ops() == ["hello"]

    bad = {"embed.weight": torch.zeros(16, 64), "norm.weight": torch.zeros(64), "lm_head.weight": torch.zeros(16, 32)}
    with pytest.raises(rlplane.MismatchError) as info:
        rt.register_model(t, bad)
    msg = str(info.value)
    assert "`norm.weight`: f32 [64], the model has bf16 [64]" in msg
    assert "`lm_head.weight`: f32 [16, 32], the model has f32 [16, 64]" in msg


def test_non_strict_leaves_extra_parameters_out(shm_dir: Path) -> None:
    model = Tiny()
    model.value_head = torch.nn.Linear(64, 1)
    t, rec = offline(rlplane.Trainer, HELLO, register_weights={"ok": True, "tensors": 3, "bytes": 8320})
    with pytest.raises(rlplane.MismatchError, match="value_head.weight"):
        rt.register_model(t, model, NAME_MAP)
    rt.register_model(t, model, NAME_MAP, strict=False)
    assert {e["name"] for e in rec.requests[-1]["tensors"]} == {"embed.weight", "norm", "lm_head.weight"}
    assert t.arena.locate_address(model.value_head.weight.data_ptr(), 4) is None  # left where it was


def test_buffers_register_only_when_the_model_names_them(shm_dir: Path) -> None:
    hello = copy.deepcopy(HELLO)
    hello["weights"].append({"name": "rope", "dtype": "f32", "shape": [4], "shard_shape": [4]})
    model = Tiny()
    t, rec = offline(rlplane.Trainer, hello, register_weights={"ok": True, "tensors": 4, "bytes": 8336})
    rt.register_model(t, model, NAME_MAP)
    assert "rope" in {e["name"] for e in rec.requests[-1]["tensors"]}
    assert t.arena.locate_address(model.rope.data_ptr(), 16) is not None


def test_cpu_tensor_outside_shared_memory_is_refused_by_register(shm_dir: Path) -> None:
    t, _ = offline(rlplane.Trainer, HELLO)
    with pytest.raises(rlplane.InvalidError, match="register_model"):
        t.register({"embed.weight": torch.zeros(16, 64)})
    shared = rt.shared_tensor(t, "norm.weight")
    assert shared.dtype == torch.bfloat16 and shared.shape == (64,)


def test_dtype_names_round_trip() -> None:
    for name in ("bool", "u8", "i8", "i16", "i32", "i64", "f16", "bf16", "f32", "f64", "fp8e4m3", "u16", "u32", "u64"):
        assert rt.wire_dtype_of(rt.torch_dtype(name)) == name
    with pytest.raises(rlplane.InvalidError):
        rt.wire_dtype_of(torch.complex64)


def test_tensor_numpy_exchange_keeps_bits() -> None:
    x = torch.randn(5).to(torch.bfloat16)
    arr, name = rt.tensor_to_numpy(x)
    assert name == "bf16" and arr.dtype == np.uint16
    assert torch.equal(rt.numpy_to_tensor(arr, "bf16"), x)
    f8 = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)
    a8, n8 = rt.tensor_to_numpy(f8)
    assert n8 == "fp8e4m3" and torch.equal(rt.numpy_to_tensor(a8, "fp8e4m3").float(), f8.float())


def test_batch_to_padded_tensors(shm_dir: Path) -> None:
    from rlplane.shm import Arena

    with Arena("j", "e") as a:
        lp = [torch.tensor([0.5, 0.25], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.bfloat16)]
        wire, _ = encode_columns(a, {"input_ids": [np.array([1, 2]), np.array([3])], "lp": lp,
                                     "reward": np.array([1.0, -1.0], np.float32)})
        batch = decode_batch({"step": 1, "keys": ["a", "b"], "tokens": [2, 1], "columns": wire}, Mappings())
        out = rt.batch_tensors(batch, pad_value=-1)
    assert out["input_ids"].tolist() == [[1, 2], [3, -1]]
    assert out["input_ids_mask"].tolist() == [[True, True], [True, False]]
    assert out["lp"].dtype == torch.bfloat16 and out["lp"].float().tolist() == [[0.5, 0.25], [1.0, -1.0]]
    assert out["reward"].tolist() == [1.0, -1.0]
    out["reward"][0] = 5  # fixed columns are copies: writable
    assert rt.column_tensor(batch["input_ids"]).tolist() == [1, 2, 3]


def test_cuda_descriptor_needs_cuda() -> None:
    with pytest.raises(rlplane.InvalidError, match="not a CUDA device"):
        rt.cuda_ipc_descriptor(torch.zeros(3))


def test_ipc_handle_formats() -> None:
    raw = bytes(range(64))
    assert rt._ipc_handle_bytes(raw, "t") == raw
    assert rt._ipc_handle_bytes(b"\x01c" + raw, "t") == raw
    with pytest.raises(rlplane.InvalidError, match="expandable_segments"):
        rt._ipc_handle_bytes(b"\x01e" + raw + b"more", "t")
    with pytest.raises(rlplane.InvalidError, match="unknown format"):
        rt._ipc_handle_bytes(b"short", "t")


def test_ipc_handle_struct_keeps_every_byte() -> None:
    import ctypes

    raw = bytes([1, 2, 0, 0, 5] + [7] * 59)  # a real handle has NULs inside
    h = rt._IpcHandle.from_buffer_copy(raw)
    assert ctypes.string_at(ctypes.addressof(h), 64) == raw
