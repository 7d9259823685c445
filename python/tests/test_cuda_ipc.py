"""CUDA IPC through PyTorch's handles and rlplane.torch's cudaIpcOpenMemHandle, across two real
processes on one GPU. Skips (visibly) without a CUDA device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import rlplane  # noqa: E402
import rlplane.torch as rt  # noqa: E402

from .conftest import HELLO  # noqa: E402
from .recorder import offline  # noqa: E402

PEER = str(Path(__file__).with_name("_ipc_peer.py"))

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def need_cuda() -> None:
    if not torch.cuda.is_available():
        print("SKIPPED CUDA IPC tests: torch.cuda.is_available() is False on this machine", file=sys.stderr)
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")


def peer(mode: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    return subprocess.Popen([sys.executable, PEER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def test_open_handles_made_by_another_process() -> None:
    p = peer("export")
    try:
        assert p.stdout is not None and p.stdin is not None
        d = json.loads(p.stdout.readline())
        assert d["a"]["memory"]["handle"] == d["b"]["memory"]["handle"]  # one allocation, two tensors
        assert d["b"]["memory"]["offset"] - d["a"]["memory"]["offset"] == 4096 * 4
        opened = len(rt._opened)
        a = rt.open_cuda_ipc(d["a"]["memory"], "f32", [1000])
        b = rt.open_cuda_ipc(d["b"]["memory"], "bf16", [128])
        c = rt.open_cuda_ipc(d["c"]["memory"], "i64", [3, 5])
        assert torch.equal(a.cpu(), torch.arange(1000, dtype=torch.float32))
        assert b.dtype == torch.bfloat16 and abs(float(b.float().sum()) - d["b_sum"]) < 1e-3
        assert c.shape == (3, 5) and int(c.sum()) == 105
        assert len(rt._opened) - opened <= 2  # the shared handle was opened once
        a.fill_(42.0)  # writes land in the other process's memory
        torch.cuda.synchronize()
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok"
    finally:
        p.kill()
        p.wait()


def test_registered_cuda_model_is_readable_by_another_process(shm_dir: Path) -> None:
    model = torch.nn.Module()
    model.embed = torch.nn.Parameter(torch.randn(16, 64, device="cuda"))
    model.norm = torch.nn.Parameter(torch.randn(64, device="cuda").to(torch.bfloat16))
    model.head = torch.nn.Parameter(torch.randn(16, 64, device="cuda"))
    t, rec = offline(rlplane.Trainer, HELLO, register_weights={"ok": True, "tensors": 3, "bytes": 8320})
    rt.register_model(t, model, {"embed": "embed.weight", "norm": "norm.weight", "head": "lm_head.weight"})
    entries = rec.requests[-1]["tensors"]
    assert all(e["memory"]["kind"] == "cuda_ipc" and len(e["memory"]["handle"]) == 128 for e in entries)
    assert model.embed.device.type == "cuda"  # CUDA tensors are described in place, not moved
    p = peer("import")
    out, _ = p.communicate(json.dumps({e["name"]: e for e in entries}) + "\n", timeout=120)
    sums = json.loads(out)
    for name, param in (("embed", model.embed), ("norm", model.norm), ("head", model.head)):
        assert abs(sums[name] - float(param.detach().double().sum())) < 1e-3, name
    t._sync_cuda()  # publish's wait for queued GPU work runs on the registered device
    assert t._cuda_devices == {torch.cuda.current_device()}


def test_non_contiguous_cuda_tensor_is_named(shm_dir: Path) -> None:
    t, _ = offline(rlplane.Trainer, HELLO)
    bad = {"embed.weight": torch.randn(64, 16, device="cuda").t(), "norm.weight": torch.zeros(64, dtype=torch.bfloat16, device="cuda"),
           "lm_head.weight": torch.zeros(16, 64, device="cuda")}
    with pytest.raises(rlplane.InvalidError, match="`embed.weight` is not contiguous"):
        rt.register_model(t, bad)


def test_staged_cuda_ipc_buffers_become_tensors(shm_dir: Path) -> None:
    p = peer("export")
    try:
        assert p.stdout is not None
        d = json.loads(p.stdout.readline())
        staging = [{"name": "embed.weight", "dtype": "f32", "shape": [1000], "memory": d["a"]["memory"]},
                   {"name": "norm.weight", "dtype": "bf16", "shape": [128], "memory": d["b"]["memory"]}]
        hello = json.loads(json.dumps(HELLO))
        hello["rank"]["role"] = "engine"
        e, _ = offline(rlplane.Engine, hello, register_weights={"ok": True, "tensors": 0, "bytes": 0, "staging": staging})
        views = rt.staged_tensors(e)
        assert views["embed.weight"].is_cuda and float(views["embed.weight"][999]) == 999.0
        assert views["norm.weight"].dtype == torch.bfloat16
    finally:
        p.kill()
        p.wait()


EXPANDABLE = r"""
import json, torch
import rlplane, rlplane.torch as rt

def describe(t, name):
    try:
        d = rt.cuda_ipc_descriptor(t, name)
        return {"nbytes": d["nbytes"], "handle_hex": len(d["handle"])}
    except rlplane.InvalidError as e:
        return str(e)

out = {"outside": describe(torch.ones(1 << 20, device="cuda"), "outside")}
with rt.ipc_allocations():
    inside = torch.full((1 << 20,), 7.0, device="cuda")
out["inside"] = describe(inside, "inside")
# Expandable segments again after the block (larger than what is left of the block's plain
# segment, which the caching allocator would reuse).
out["after"] = describe(torch.ones(64 << 20, device="cuda"), "after")
print(json.dumps(out))
"""


def test_ipc_allocations_give_handles_in_a_process_with_expandable_segments() -> None:
    # Allocator settings are per process: a fresh one, started with expandable segments.
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    p = subprocess.run([sys.executable, "-c", EXPANDABLE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "expandable segment" in out["outside"] and "ipc_allocations" in out["outside"], out
    assert out["inside"] == {"nbytes": 4 << 20, "handle_hex": 128}, out
    assert "expandable segment" in out["after"], out
