"""A user's trainer process for test_layouts.py whose weights are laid out as real trainers lay
them out, filled with exact.full()'s bytes for each version and published:

--fsdp: a fully-sharded trainer. Every rank joins a torch.distributed world (gloo on the CPU, NCCL
  with --device cuda) and holds DTensors sharded as spec.trainer.parallelism says: tensor-parallel
  (mesh dimension "tp": Shard(0) for Rows, Shard(1) for Columns, Replicate) outside, fully sharded
  over data (mesh dimension "fsdp": Shard(0)) inside. On the CPU each local shard is built over the
  client's shared memory (DTensor.from_local); with --device cuda the model is a real FSDP2
  module (fully_shard) on top of the tensor-parallel DTensors. At every version the rank checks,
  through torch's own collectives (full_tensor), that the DTensors are the full tensors the
  engines must hold.
--fused: a tensor-parallel trainer holding Megatron-LM's fused tensors: an interleaved linear_qkv
  (per query group: its q heads, its k head, its v head) and a concatenated linear_fc1
  ([gate; up]), mapped onto the model's q/k/v/gate/up with rlplane.fused.

Writes what it saw to <report dir>/trainer-<rank>.json."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import rlplane
from rlplane.fused import Fused, FusedLayout
from rlplane.torch import register_model, shared_tensor, torch_dtype

sys.path.insert(0, os.path.dirname(__file__))
from exact import full, shard  # noqa: E402


def as_tensor(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """exact.full()'s raw array as a torch tensor of the model's dtype (bf16 from its bits)."""
    return torch.from_numpy(np.ascontiguousarray(arr)).view(torch_dtype(dtype))


def fsdp_mesh(info: Any, device: str, reversed_fsdp: bool = False) -> Any:
    """The trainer's (tp, fsdp) mesh over ranks `tp + T·dp` (one shard group: data == fsdp); with
    `reversed_fsdp`, the fully-sharded dimension in the opposite order (a mesh built wrong)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    fsdp = info.rank.fsdp_size or 1
    ranks = torch.arange(world).reshape(fsdp, world // fsdp).T  # mesh[t][f] = t + T·f
    if reversed_fsdp:
        ranks = ranks.flip(1)
    return DeviceMesh(device, ranks.contiguous(), mesh_dim_names=("tp", "fsdp"))


def placements(spec: dict[str, Any]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    split = spec.get("tpSplit") or ("Rows" if len(spec["shape"]) >= 2 else "Replicated")
    tp = {"Rows": Shard(0), "Columns": Shard(1) if len(spec["shape"]) >= 2 else Shard(0), "Replicated": Replicate()}
    return [tp[split], Shard(0)]


def local_rows(whole: np.ndarray, info: Any, tp_shape: tuple[int, ...]) -> np.ndarray:
    """This rank's part: its tensor-parallel shard, then its torch.chunk rows of that."""
    tp_part = shard(whole, tp_shape, info.rank.tp or 0)
    return tp_part[_chunk(tp_part.shape[0], info.rank.fsdp or 0, info.rank.fsdp_size or 1)]


def _chunk(n: int, i: int, parts: int) -> slice:
    size = -(-n // parts)
    return slice(min(i * size, n), min((i + 1) * size, n))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", required=True)
    ap.add_argument("--mode", choices=["fsdp", "fused"], required=True)
    ap.add_argument("--model", required=True, help="the job's spec.model.tensors, as JSON")
    ap.add_argument("--init", required=True, help="torch.distributed's file:// rendezvous")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--world", type=int, required=True, help="trainer ranks")
    ap.add_argument("--groups", type=int, default=2, help="--fused: the model's query groups")
    ap.add_argument("--wrong-mesh", action="store_true", help="--fsdp on the CPU: the mesh's fsdp order reversed")
    args = ap.parse_args()
    model = json.loads(args.model)
    report: dict = {"publish": [], "checked": []}
    with rlplane.Trainer(timeout=60) as t:
        info = t.info
        report["rank"] = info.rank.name
        report["hello"] = info.raw
        cuda = args.device == "cuda"
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, init_method=args.init, rank=info.rank.rank, world_size=args.world)
        if args.mode == "fsdp":
            try:
                step = run_fsdp(t, info, model, args.device, report, args.wrong_mesh)
            except rlplane.MismatchError as e:
                print(f"layout_trainer.py: {e}", file=sys.stderr, flush=True)
                raise
        else:
            step = run_fused(t, info, args.world, args.groups, report)
        report["done"] = step
        dist.destroy_process_group()
    with open(os.path.join(args.report, f"trainer-{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    return 0


def run_fsdp(t: rlplane.Trainer, info: Any, model: list[dict[str, Any]], device: str, report: dict,
             wrong_mesh: bool = False) -> bool:
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh = fsdp_mesh(info, device, wrong_mesh) if device == "cpu" else None
    specs = {w.name: w for w in info.weights}
    names = [m["name"] for m in model]
    tp_shapes = {m["name"]: _tp_shape(m, info) for m in model}

    def locals_of(version: int) -> dict[str, np.ndarray]:
        return {n: local_rows(full(version, i, specs[n].dtype, specs[n].shape), info, tp_shapes[n])
                for i, n in enumerate(names)}

    if device == "cuda":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        # A real FSDP2 module over tensor-parallel DTensors, on the usual (fsdp, tp) mesh:
        # fully_shard chunks each tensor-parallel shard's rows.
        world, fsdp = dist.get_world_size(), info.rank.fsdp_size or 1
        mesh2 = DeviceMesh("cuda", torch.arange(world).reshape(fsdp, world // fsdp), mesh_dim_names=("fsdp", "tp"))
        module = torch.nn.Module()
        for i, m in enumerate(model):
            whole = as_tensor(full(0, i, m["dtype"], tuple(m["shape"])), m["dtype"]).cuda()
            dt = distribute_tensor(whole, mesh2["tp"], [placements(m)[0]])
            module.register_parameter(f"p{i}", torch.nn.Parameter(dt))
        fully_shard(module, mesh=mesh2["fsdp"])
        params = {n: getattr(module, f"p{i}") for i, n in enumerate(names)}
    else:
        params = {}
        for i, m in enumerate(model):
            part = locals_of(0)[m["name"]]
            local = shared_tensor(t, f"local-{m['name']}", specs[m["name"]].dtype, part.shape) if part.size else \
                torch.empty(part.shape, dtype=torch_dtype(m["dtype"]))
            if part.size:
                local.copy_(as_tensor(part, m["dtype"]))
            params[m["name"]] = DTensor.from_local(local, mesh, placements(m), run_check=False,
                                                   shape=torch.Size(m["shape"]), stride=_strides(m["shape"]))
    held = {n: p for n, p in params.items() if specs[n].held}
    report["registered"] = {n: list(p.to_local().shape) for n, p in held.items() if p.to_local().numel()}
    register_model(t, held)

    def set_version(v: int) -> None:
        parts = locals_of(v)
        with torch.no_grad():
            for i, n in enumerate(names):
                local = params[n].to_local()
                if local.numel():
                    local.copy_(as_tensor(parts[n], specs[n].dtype).to(local.device))
                # torch's own view of the sharded tensor must be the full tensor the engines get.
                whole = params[n].full_tensor().cpu()
                want = as_tensor(full(v, i, specs[n].dtype, specs[n].shape), specs[n].dtype)
                report["checked"].append({"version": v, "name": n, "equal": bool(torch.equal(whole, want))})

    return _train(t, set_version, report)


def run_fused(t: rlplane.Trainer, info: Any, tp_size: int, groups: int, report: dict) -> bool:
    """A tensor-parallel trainer (tp_size ranks, data 1) with Megatron-LM's fused tensors."""
    specs = {w.name: w for w in info.weights}
    order = [w.name for w in info.weights]
    tp = info.rank.tp or 0

    def part(v: int, n: str) -> torch.Tensor:
        w = specs[n]
        return as_tensor(shard(full(v, order.index(n), w.dtype, w.shape), w.shard_shape, tp), w.dtype)

    def megatron(v: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = groups // tp_size
        q, k, vv = (part(v, n).reshape(g, -1, *part(v, n).shape[1:]) for n in ("q", "k", "v"))
        qkv = torch.cat([q, k, vv], dim=1).reshape(-1, *q.shape[2:]).contiguous()
        return qkv, torch.cat([part(v, "gate"), part(v, "up")]).contiguous()

    module = torch.nn.Module()
    qkv, fc1 = megatron(0)
    module.linear_qkv = torch.nn.Parameter(qkv)
    module.linear_fc1 = torch.nn.Parameter(fc1)
    rest = {n: torch.nn.Parameter(part(0, n)) for n in order if n not in ("q", "k", "v", "gate", "up") and specs[n].held}
    layout = FusedLayout(t, module, [Fused("linear_qkv", ("q", "k", "v"), groups=groups),
                                     Fused("linear_fc1", ("gate", "up"))])
    report["copied"] = list(layout.copied)
    register_model(t, {**layout.tensors, **rest})

    def set_version(v: int) -> None:
        qkv, fc1 = megatron(v)
        with torch.no_grad():
            module.linear_qkv.copy_(qkv)
            module.linear_fc1.copy_(fc1)
            for n, p in rest.items():
                p.copy_(part(v, n))
        layout.to_parts()

    return _train(t, set_version, report)


def _tp_shape(m: dict[str, Any], info: Any) -> tuple[int, ...]:
    """The tensor-parallel shard's shape (before fully-sharded chunking), as exact.shard reads it."""
    shape = list(m["shape"])
    tp = dist.get_world_size() // (info.rank.fsdp_size or 1)
    split = m.get("tpSplit") or ("Rows" if len(shape) >= 2 else "Replicated")
    if split == "Rows" or (split == "Columns" and len(shape) < 2):
        shape[0] //= tp
    elif split == "Columns":
        shape[1] //= tp
    return tuple(shape)


def _strides(shape: list[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _train(t: rlplane.Trainer, set_version: Any, report: dict) -> bool:
    """Publishes the initial version, then each step's, each written by `set_version` first."""
    # Lazily: the first batch comes only once the initial version is published.
    for version in itertools.chain([t.initial_version], (batch.step for batch in t.batches())):
        set_version(version)
        p = t.publish(version)
        report["publish"].append({"version": p.version, "bytes": p.bytes})
    return True


if __name__ == "__main__":
    sys.exit(main())
