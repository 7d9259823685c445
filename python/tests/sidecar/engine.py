"""A user's engine process for the integration tests: registers (direct: arrays refit writes in
place; staged: the sidecar's buffers), checks each step's weights hold the trainer's pattern for
the version, puts rollouts, and writes what it saw to <report dir>/engine-<rank>.json."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import rlplane
from rlplane.dtypes import bf16_to_f32

sys.path.insert(0, os.path.dirname(__file__))
from trainer import pattern  # noqa: E402


def values(arr: np.ndarray, dtype: str) -> np.ndarray:
    if hasattr(arr, "detach"):  # a torch tensor (CUDA IPC staging, or the engine's own CUDA tensors)
        return arr.detach().float().cpu().numpy()
    return bf16_to_f32(arr) if dtype == "bf16" else np.asarray(arr, dtype=np.float64)


def check(views: dict, weights: list, version: int) -> list[str]:
    """Names of tensors whose values are not the trainer's pattern for `version`."""
    bad = []
    for i, w in enumerate(weights):
        v = values(views[w.name], w.dtype)
        if not np.all(v == pattern(version, i)):
            bad.append(f"{w.name}: {np.unique(v)[:4].tolist()} != {pattern(version, i)}")
    return bad


def modes() -> dict:
    """Permission bits of what the sidecar made for this rank: its socket, the socket's directory
    and the shared-memory files in RLPLANE_SHM_DIR that are not the client's own."""
    from rlplane._wire import socket_path

    sock = socket_path("engine")
    shm = os.environ.get("RLPLANE_SHM_DIR", "/dev/shm")
    files = {f: os.stat(os.path.join(shm, f)).st_mode & 0o777 for f in os.listdir(shm)
             if not f.startswith("rlplane-py-client-")}
    return {"socket": os.stat(sock).st_mode & 0o777, "socket_dir": os.stat(os.path.dirname(sock)).st_mode & 0o777,
            "shm_files": files}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", required=True)
    ap.add_argument("--mode", choices=["direct", "staged"], default="direct")
    ap.add_argument("--scalars", action="store_true", help="report the step's mean reward")
    ap.add_argument("--device", default="cpu", help="direct mode: where the engine's tensors live (cpu, cuda)")
    args = ap.parse_args()
    report: dict = {"steps": [], "mode": args.mode}
    with rlplane.Engine(timeout=60) as e:
        info = e.info
        report["rank"] = info.rank.name
        report["hello"] = info.raw
        weights = list(info.weights)
        if args.mode == "staged":
            views = e.register_staged()
        elif args.device != "cpu":
            import torch

            from rlplane.torch import register_model, torch_dtype

            views = {w.name: torch.zeros(w.shard_shape, dtype=torch_dtype(w.dtype), device=args.device) for w in weights}
            register_model(e, views)
        else:
            views = {w.name: e.alloc(w.name) for w in weights}
            e.register(views)
        report["version_before"] = e.version().version
        report["modes"] = modes()
        if not info.rank.producer:
            report["note"] = "not a producer: takes weights only"
            return 0
        rng = np.random.default_rng(info.rank.rank)
        for step in e.steps():
            entry: dict = {"step": step.step, "version": step.version}
            if args.mode == "staged":
                with e.staged(step.version or 0, timeout=30) as held:
                    entry["held"] = held
                    entry["bad"] = check(views, weights, held)
            else:
                vi = e.wait_version(step.version or 0, timeout=30)
                entry["held"] = vi.version
                entry["bad"] = check(views, weights, vi.version or 0)
            n = 3
            lengths = rng.integers(1, 20, size=n)
            ids = [np.arange(k, dtype=np.int64) + 1000 * step.step for k in lengths]
            res = e.put(step, {
                "input_ids": ids,
                "logprobs": [np.full(k, -0.5, np.float32) for k in lengths],
                "reward": np.array([float(step.step)] * n, np.float32),
            }, tags=[{"engine": str(info.rank.engine)}] * n)
            entry["put"] = {"samples": res.samples, "bytes": res.bytes, "lengths": lengths.tolist()}
            if args.scalars:
                e.report_scalars(step, {"reward_mean": float(step.step)})
            report["steps"].append(entry)
        report["done"] = True
    with open(os.path.join(args.report, f"engine-{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
