"""rlplane.fused on the CPU: fused tensors (concatenated and Megatron-interleaved) mapped onto the
job model's tensors, against an offline client whose hello describes a tensor-parallel rank; and
DTensor shards through register_model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import rlplane  # noqa: E402
import rlplane.torch as rt  # noqa: E402
from rlplane.fused import Fused, FusedLayout  # noqa: E402

from .conftest import HELLO  # noqa: E402
from .recorder import offline  # noqa: E402

# A GQA layer: 8 query heads and 4 key/value heads of dim 2 (4 query groups), hidden 4; an MLP
# of 6 rows. tp = 2: this rank (tp 1) holds query groups 2 and 3, and rows 3..6 of gate and up.
HID, HD, NQ, NKV, FF, TP, RANK = 4, 2, 8, 4, 6, 2, 1
MODEL = [("q", NQ * HD), ("k", NKV * HD), ("v", NKV * HD), ("gate", FF), ("up", FF)]


def hello(tp: int = RANK, tp_size: int = TP, fsdp_size: int = 1) -> dict[str, Any]:
    h = copy.deepcopy(HELLO)
    h["rank"].update(tp=tp, fsdp=0, fsdp_size=fsdp_size)
    h["weights"] = [
        {"name": n, "dtype": "f32", "shape": [rows, HID], "shard_shape": [rows // tp_size, HID]} for n, rows in MODEL
    ]
    return h


def full(name: str) -> torch.Tensor:
    """Distinct values per element of the model's (Hugging Face layout) tensor `name`."""
    base = [n for n, _ in MODEL].index(name) * 1000
    rows = dict(MODEL)[name]
    return torch.arange(rows * HID, dtype=torch.float32).reshape(rows, HID) + base


def mine(name: str, tp: int = RANK, tp_size: int = TP) -> torch.Tensor:
    return full(name).chunk(tp_size)[tp]


def megatron_qkv(tp: int = RANK, tp_size: int = TP) -> torch.Tensor:
    """Megatron-LM's linear_qkv shard: per query group, its q heads, then its k head, then its v head."""
    groups = NKV // tp_size
    q, k, v = (mine(n, tp, tp_size).view(groups, -1, HID) for n in ("q", "k", "v"))
    return torch.cat([q, k, v], dim=1).reshape(-1, HID).contiguous()


def layer(tp: int = RANK) -> torch.nn.Module:
    m = torch.nn.Module()
    m.linear_qkv = torch.nn.Parameter(megatron_qkv(tp))
    m.linear_fc1 = torch.nn.Parameter(torch.cat([mine("gate", tp), mine("up", tp)]))
    return m


DECLARED = [Fused("linear_qkv", ("q", "k", "v"), groups=NKV), Fused("linear_fc1", ("gate", "up"))]


def test_interleaved_qkv_is_copied_into_its_parts_and_concatenated_gate_up_registers_as_views(shm_dir: Path) -> None:
    t, rec = offline(rlplane.Trainer, hello(), register_weights={"ok": True, "tensors": 5, "bytes": 0})
    model = layer()
    fc1 = model.linear_fc1
    layout = FusedLayout(t, model, DECLARED)
    assert set(layout.tensors) == {"q", "k", "v", "gate", "up"} and layout.copied == ("linear_qkv",)
    # gate/up: views of the (now shared-memory) fused parameter, which stays the same Parameter.
    assert model.linear_fc1 is fc1
    assert layout.tensors["gate"].data_ptr() == fc1.data_ptr()
    assert layout.tensors["up"].data_ptr() == fc1.data_ptr() + 3 * HID * 4
    layout.to_parts()
    for n in ("q", "k", "v", "gate", "up"):
        assert torch.equal(layout.tensors[n], mine(n)), n
    rt.register_model(t, layout.tensors)
    by = {e["name"]: e for e in rec.requests[-1]["tensors"]}
    assert {n: e["shape"] for n, e in by.items()} == {n: [r // TP, HID] for n, r in MODEL}
    # A trainer step changes the fused tensors; to_parts carries the change, the views see it at once.
    with torch.no_grad():
        model.linear_qkv.mul_(2)
        model.linear_fc1.add_(1)
    layout.to_parts()
    assert torch.equal(layout.tensors["k"], mine("k") * 2) and torch.equal(layout.tensors["up"], mine("up") + 1)


def test_an_engine_gets_refit_bytes_back_into_its_interleaved_tensor(shm_dir: Path) -> None:
    e, _ = offline(rlplane.Engine, hello(), register_weights={"ok": True, "tensors": 5, "bytes": 0})
    model = layer()
    with torch.no_grad():
        model.linear_qkv.zero_()
    layout = FusedLayout(e, model, DECLARED)
    for n in ("q", "k", "v"):  # what refit writes into the parts
        layout.tensors[n].copy_(mine(n))
    layout.from_parts()
    assert torch.equal(model.linear_qkv.detach(), megatron_qkv())


def test_declarations_that_do_not_fit_are_all_listed(shm_dir: Path) -> None:
    t, _ = offline(rlplane.Trainer, hello())
    model = layer()
    model.wide = torch.nn.Parameter(torch.zeros(6, HID + 1))
    with pytest.raises(rlplane.MismatchError) as e:
        FusedLayout(t, model, [
            Fused("linear_qkv", ("q", "k", "v"), groups=3),  # 3 does not divide k's 8 rows
            Fused("linear_fc1", ("gate", "up", "q")),  # more rows than it has
            Fused("missing", ("q",)),
            Fused("wide", ("gate", "up")),  # another width
            Fused("linear_fc1", ("nope",)),
        ])
    msg = str(e.value)
    assert "groups = 3 does not divide" in msg
    assert "`linear_fc1` (f32 [6, 4]): its 6 rows are not its parts' rows on this rank [3, 3, 8]" in msg
    assert "`missing`: no such tensor" in msg
    assert "every dimension after the first" in msg
    assert "declared twice" in msg


def test_fused_tensors_are_refused_on_a_fully_sharded_trainer(shm_dir: Path) -> None:
    t, _ = offline(rlplane.Trainer, hello(fsdp_size=2))
    with pytest.raises(rlplane.InvalidError, match="FSDP chunks a fused tensor's rows"):
        FusedLayout(t, layer(), DECLARED)


def dtensor_world() -> Any:
    """A one-rank gloo world, so DTensors can be built here."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not built in")
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    return init_device_mesh("cpu", (1,))


def test_a_dtensor_registers_its_local_shard_and_one_outside_shared_memory_is_refused(shm_dir: Path) -> None:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = dtensor_world()
    h = hello(tp=0, tp_size=1)
    t, rec = offline(rlplane.Trainer, h, register_weights={"ok": True, "tensors": 5, "bytes": 0})
    local = {n: rt.shared_tensor(t, n, "f32", (rows, HID)) for n, rows in MODEL}
    for n, v in local.items():
        v.copy_(full(n))
    params = {n: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for n, v in local.items()}
    rt.register_model(t, params)
    by = {e["name"]: e for e in rec.requests[-1]["tensors"]}
    assert set(by) == {n for n, _ in MODEL} and by["q"]["memory"]["kind"] == "shm"
    # FSDP2 on the CPU keeps shards in its own storage, which rlplane cannot move.
    with pytest.raises(rlplane.InvalidError, match="DTensor whose CPU shard lies outside"):
        rt.register_model(t, {n: distribute_tensor(full(n), mesh, [Shard(0)]) for n, _ in MODEL})
