"""Trainers laid out as real ones are, against the REAL sidecar (`rlplane local`, as
test_integration.py): a fully-sharded (FSDP) trainer whose ranks register their DTensor shards,
alone and under tensor parallelism, and a tensor-parallel trainer with Megatron-LM's fused
linear_qkv (interleaved) and linear_fc1 (concatenated) mapped onto the model's q/k/v/gate/up.
The trainer is tests/sidecar/layout_trainer.py; the engines (tests/sidecar/exact_engine.py)
check every tensor's bytes exactly at every step and after the last refit.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from .test_integration import manifest, reports, rlplane_bin, run_local  # noqa: F401 (a fixture)
from .test_integration_more import check_engines, failed, launch

pytestmark = pytest.mark.sidecar
torch = pytest.importorskip("torch", reason="torch is not installed")

# Uneven rows on purpose: 7 rows in 3 chunks are 3, 3, 1; `b`'s 2 rows leave the third rank none.
FSDP_MODEL: list[dict[str, Any]] = [
    {"name": "embed.weight", "dtype": "bf16", "shape": [7, 4]},
    {"name": "w.weight", "dtype": "f32", "shape": [5, 6]},
    {"name": "b.bias", "dtype": "f32", "shape": [2]},
    {"name": "lm_head.weight", "dtype": "bf16", "shape": [4, 4]},
]
# Tensor parallel 2 inside, fully sharded 2 outside: Rows, Columns and Replicated tensors.
TP_FSDP_MODEL: list[dict[str, Any]] = [
    {"name": "qkv.weight", "dtype": "f32", "shape": [6, 4], "tpSplit": "Rows"},
    {"name": "o.weight", "dtype": "bf16", "shape": [5, 4], "tpSplit": "Columns"},
    {"name": "norm.weight", "dtype": "f32", "shape": [3], "tpSplit": "Replicated"},
]
# A GQA layer: 8 query heads, 4 key/value heads of dim 2 (4 groups), hidden 4; an MLP of 6.
FUSED_MODEL: list[dict[str, Any]] = [
    {"name": "embed", "dtype": "f32", "shape": [6, 4], "tpSplit": "Rows"},
    {"name": "q", "dtype": "bf16", "shape": [16, 4]},
    {"name": "k", "dtype": "bf16", "shape": [8, 4]},
    {"name": "v", "dtype": "bf16", "shape": [8, 4]},
    {"name": "gate", "dtype": "bf16", "shape": [6, 4]},
    {"name": "up", "dtype": "bf16", "shape": [6, 4]},
]


def trainer(ranks: int, tmp: Path, out: Path, mode: str, model: list[dict[str, Any]], *extra: str) -> list[str]:
    return launch(ranks, "layout_trainer.py", "--report", str(out), "--mode", mode, "--model", json.dumps(model),
                  "--init", f"file://{tmp / 'pg-rendezvous'}", "--world", str(ranks), *extra)


def chunk(n: int, i: int, parts: int) -> int:
    size = -(-n // parts)
    return max(0, min((i + 1) * size, n) - min(i * size, n))


@pytest.mark.parametrize(("tensor", "fsdp", "model"), [(1, 3, FSDP_MODEL), (2, 2, TP_FSDP_MODEL)],
                         ids=["fsdp3", "tp2-fsdp2"])
def test_a_fully_sharded_trainer_registers_its_dtensor_shards_and_engines_hold_the_whole(
    rlplane_bin: str, tmp_path: Path, tensor: int, fsdp: int, model: list[dict[str, Any]]
) -> None:
    """Every rank of the shard group registers only its torch.chunk rows (the empty chunk left
    out) and sends them: no rank ever holds a gathered copy. torch's own full_tensor() of the
    DTensors equals, at every version, what every engine holds byte for byte."""
    out = tmp_path / "reports"
    out.mkdir()
    ranks = tensor * fsdp
    m = manifest(tmp_path, trainer(ranks, tmp_path, out, "fsdp", model),
                 launch(1, "exact_engine.py", "--report", str(out)),
                 steps=2, data=fsdp, fsdp=fsdp, tensor=tensor, engines=2, tensors=model, name="py-fsdp")
    p = run_local(rlplane_bin, m, tmp_path, timeout=240)
    assert p.returncode == 0, failed(p)
    check_engines(out, engines=2, steps=2)
    trainers = reports(out, "trainer")
    assert len(trainers) == ranks
    total = 0
    for t in trainers:
        r = t["hello"]["rank"]
        assert r["fsdp_size"] == fsdp and r["fsdp"] == r["dp"], r
        assert t["done"] and all(c["equal"] for c in t["checked"]), [c for c in t["checked"] if not c["equal"]]
        assert [x["version"] for x in t["publish"]] == [0, 1, 2]
        for x in model:
            rows = x["shape"][0]
            split = x.get("tpSplit") or ("Rows" if len(x["shape"]) >= 2 else "Replicated")
            if split == "Replicated" and r["tp"] != 0:
                assert x["name"] not in t["registered"]
                continue
            tp_rows = rows // tensor if split == "Rows" else rows
            want = chunk(tp_rows, r["fsdp"], fsdp)
            got = t["registered"].get(x["name"])
            assert (got[0] if got else 0) == want, (r, x, got)
            total += want * (x["shape"][1] // tensor if split == "Columns" else
                             (x["shape"][1] if len(x["shape"]) > 1 else 1))
    # The ranks' shards tile the model once: nothing is held twice, nothing gathered.
    assert total == sum(x["shape"][0] * (x["shape"][1] if len(x["shape"]) > 1 else 1) for x in model)


def test_a_device_mesh_in_another_rank_order_is_refused_naming_both_offsets(rlplane_bin: str,
                                                                          tmp_path: Path) -> None:
    """Even rows, so every shard has the shape the job expects: only the offsets tell that the
    mesh gives rank 0 the rows the job gives rank 1. register_model refuses it, instead of
    engines holding rows in the wrong place."""
    out = tmp_path / "reports"
    out.mkdir()
    model = [{"name": "w.weight", "dtype": "f32", "shape": [4, 2]}]
    m = manifest(tmp_path, trainer(2, tmp_path, out, "fsdp", model, "--wrong-mesh"),
                 launch(1, "exact_engine.py", "--report", str(out)),
                 steps=1, data=2, fsdp=2, engines=1, tensors=model, name="py-fsdp-mesh", timeout_s=15)
    p = run_local(rlplane_bin, m, tmp_path, timeout=120)
    assert p.returncode != 0, p.stderr[-3000:]
    # Whichever rank is refused first ends the run: rank 0 holds rows 2.. by its mesh, rank 1 rows 0...
    refused = re.search(r"`w\.weight`: this rank's DTensor shard starts at \[(\d), 0\] of the full tensor, the "
                        r"job's layout gives this rank the part from \[(\d), 0\]", p.stderr)
    assert refused and {refused.group(1), refused.group(2)} == {"0", "2"}, p.stderr[-4000:]


@pytest.mark.cuda
def test_fsdp2_on_two_gpus_refits_every_ranks_shard_in_place(rlplane_bin: str, tmp_path: Path) -> None:
    """Two GPUs, colocated: a real FSDP2 module (fully_shard over NCCL) whose ranks register the
    shards FSDP keeps (CUDA IPC, no copy); both engines, registered in place on their GPUs, hold
    the whole model byte for byte, and torch's full_tensor() agrees at every version."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("SKIPPED test_fsdp2_on_two_gpus: needs 2 CUDA devices", file=sys.stderr)
        pytest.skip("needs 2 CUDA devices")
    out = tmp_path / "reports"
    out.mkdir()
    model = FSDP_MODEL + [{"name": "big.weight", "dtype": "bf16", "shape": [4099, 1024]}]
    m = manifest(tmp_path, trainer(2, tmp_path, out, "fsdp", model, "--device", "cuda"),
                 launch(2, "exact_engine.py", "--report", str(out), "--device", "cuda"),
                 steps=3, data=2, fsdp=2, engines=2, tensors=model, gpu=True, name="py-fsdp-gpu")
    p = run_local(rlplane_bin, m, tmp_path, timeout=300)
    assert p.returncode == 0, failed(p)
    check_engines(out, engines=2, steps=3)
    trainers = reports(out, "trainer")
    assert len(trainers) == 2
    for t in trainers:
        assert t["hello"]["transport"] == "cuda_ipc", t["hello"]
        assert t["done"] and all(c["equal"] for c in t["checked"]), [c for c in t["checked"] if not c["equal"]]
        assert t["registered"]["big.weight"] == [2050 - t["hello"]["rank"]["fsdp"], 1024], t["registered"]


def test_megatron_fused_qkv_and_gate_up_map_onto_the_models_tensors(rlplane_bin: str, tmp_path: Path) -> None:
    """TP = 2: each rank's interleaved linear_qkv is copied into its q/k/v parts before each
    publish, its linear_fc1 registers as two views; the engines hold Hugging Face's q/k/v/gate/up."""
    out = tmp_path / "reports"
    out.mkdir()
    m = manifest(tmp_path, trainer(2, tmp_path, out, "fused", FUSED_MODEL, "--groups", "4"),
                 launch(1, "exact_engine.py", "--report", str(out)),
                 steps=2, data=1, tensor=2, engines=2, tensors=FUSED_MODEL, name="py-fused")
    p = run_local(rlplane_bin, m, tmp_path, timeout=240)
    assert p.returncode == 0, failed(p)
    check_engines(out, engines=2, steps=2)
    for t in reports(out, "trainer"):
        assert t["done"] and t["copied"] == ["linear_qkv"], t
        assert all(x["bytes"] > 0 for x in t["publish"]), t["publish"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
