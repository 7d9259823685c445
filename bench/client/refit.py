"""Refit through the Python client: a trainer and an engine register model-sized PyTorch tensors
(the job's `spec.model`, e.g. Llama-3-8B) with their sidecars, and every step the trainer
publishes; the refit streams straight from the trainer's tensors into the engine's.

Run by `rlplane local bench/client/rljob-*.yaml` (the manifests' templates start this script as
`trainer` and as `engine`). The trainer prints one JSON line per publish and a summary line
`{"summary": …}` with the medians: `refit_s` (the sidecar's refit, as `rlplane bench refit`
times it), `publish_s` (what the trainer's `publish` call took, the step's control included) and
the client's own cost per step (publish_s - refit_s). Compare `refit_s` with `rlplane bench
refit` for the same bytes in the same run (scripts/client-bench.sh does both).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

import rlplane
import rlplane.torch


def tensors(client: rlplane.Client, device: str) -> dict[str, torch.Tensor]:
    """A tensor per tensor of the job's model this rank holds, on `device`."""
    out = {}
    for w in client.info.weights:
        shape = w.shard_shape
        if shape is None:
            continue
        dtype = rlplane.torch.torch_dtype(w.dtype)
        if device == "cpu":
            out[w.name] = rlplane.torch.shared_tensor(client, w.name)
        else:
            out[w.name] = torch.empty(shape, dtype=dtype, device=device)
    return out


def fill(ts: dict[str, torch.Tensor], version: int) -> None:
    for t in ts.values():
        t.view(torch.uint8).fill_(version % 251)


def device_of(client: rlplane.Client) -> str:
    """The rank's device: on GPUs, the pod's GPU of its local index (a pod's processes see the
    pod's GPUs as CUDA devices 0, 1, …)."""
    return f"cuda:{client.info.rank.local}" if client.info.device == "gpu" else "cpu"


def trainer() -> None:
    with rlplane.Trainer() as t:
        device = device_of(t)
        ts = tensors(t, device)
        t0 = time.perf_counter()
        reg = t.register(ts)
        register_s = time.perf_counter() - t0
        fill(ts, 0)
        if device != "cpu":
            torch.cuda.synchronize()
        t.publish(0)
        rows = []
        for batch in t.batches():
            fill(ts, batch.step)
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = t.publish(batch.step)
            publish_s = time.perf_counter() - t0
            row = {"step": batch.step, "refit_s": r.refit_s, "publish_s": publish_s, "bytes": r.bytes}
            rows.append(row)
            print(json.dumps(row), flush=True)
        refit = statistics.median(r["refit_s"] for r in rows)
        publish = statistics.median(r["publish_s"] for r in rows)
        print(
            json.dumps(
                {
                    "summary": {
                        "bytes": reg.bytes,
                        "tensors": reg.tensors,
                        "register_s": register_s,
                        "steps": len(rows),
                        "refit_s_p50": refit,
                        "refit_s_min": min(r["refit_s"] for r in rows),
                        "refit_s_max": max(r["refit_s"] for r in rows),
                        "publish_s_p50": publish,
                        "client_overhead_ms_per_step": (publish - refit) * 1e3,
                        "gb_per_s": reg.bytes / refit / 1e9,
                    }
                }
            ),
            flush=True,
        )


def engine() -> None:
    with rlplane.Engine() as e:
        device = device_of(e)
        ts = tensors(e, device)
        e.register(ts)
        first = next(iter(ts.values()))
        for step in e.steps():
            # The previous step's version is in place: check a byte of it.
            got = int(first.view(torch.uint8).flatten()[0].item())
            if got != step.version % 251:
                raise RuntimeError(f"step {step.step}: the engine holds byte {got}, not version {step.version}'s")
            e.put(step, {"input_ids": [np.arange(4, dtype=np.int64)]})


if __name__ == "__main__":
    {"trainer": trainer, "engine": engine}[sys.argv[1]]()
