"""A user's trainer process for test_integration_more.py: registers its shard of every tensor
(numpy arrays from alloc, or a torch model with --torch), fills it with exact.full()'s bytes for
each version (its tensor-parallel part of them), publishes, and writes what it saw to
<report dir>/trainer-<rank>.json.

--realloc-at S: before publishing step S, frees its weights as after offloading (overwrites the
old memory with poison, closes its shared memory, whose files go) and registers new ones.
--probe-full: first registers the full tensors (not its shard) and records the error.
--stall-at S: never publishes step S (sleeps until its launcher is gone, at most --stall-s)."""

from __future__ import annotations

import argparse
import random
import json
import os
import sys
import time

import numpy as np

import rlplane

sys.path.insert(0, os.path.dirname(__file__))
from exact import full, poison, shard  # noqa: E402


def error_of(f) -> dict | None:  # noqa: ANN001
    try:
        f()
        return None
    except rlplane.RlplaneError as e:
        return {"class": type(e).__name__, "kind": e.kind, "message": e.message}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", required=True)
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--realloc-at", type=int, default=None)
    ap.add_argument("--probe-full", action="store_true")
    ap.add_argument("--stall-at", type=int, default=None)
    ap.add_argument("--stall-s", type=float, default=120.0)
    ap.add_argument("--sleep-ms", default=None, help="MIN,MAX: train each batch for a random time in this range")
    args = ap.parse_args()
    report: dict = {"batches": [], "publish": [], "registrations": []}
    out = lambda: os.path.join(args.report, f"trainer-{report['rank']}.json")  # noqa: E731
    with rlplane.Trainer(timeout=60) as t:
        info = t.info
        report["rank"] = info.rank.name
        report["hello"] = info.raw
        tp = info.rank.tp or 0
        held = [(i, w) for i, w in enumerate(info.weights) if w.held]

        if args.probe_full:
            whole = {w.name: t.alloc(w.name, w.dtype, w.shape) for _, w in held}
            report["probe_full"] = error_of(lambda: t.register(whole))

        def part(version: int, i: int, w: rlplane.WeightSpec) -> np.ndarray:
            return shard(full(version, i, w.dtype, w.shape), w.shard_shape, tp)

        if args.torch:
            import torch

            from rlplane.torch import register_model, torch_dtype

            params = {w.name: torch.nn.Parameter(torch.zeros(w.shard_shape, dtype=torch_dtype(w.dtype))) for _, w in held}

            def raw(w: rlplane.WeightSpec) -> np.ndarray:  # the parameter's bytes, writable, in place
                return params[w.name].data.view(torch.uint8).numpy().reshape(-1)

            def register() -> rlplane.RegisterResult:
                return register_model(t, params)
        else:
            arrays = {w.name: t.alloc(w.name) for _, w in held}

            def raw(w: rlplane.WeightSpec) -> np.ndarray:
                return arrays[w.name].reshape(-1).view(np.uint8)

            def register() -> rlplane.RegisterResult:
                return t.register(arrays)

        def write(version: int) -> None:
            for i, w in held:
                raw(w)[...] = np.ascontiguousarray(part(version, i, w)).reshape(-1).view(np.uint8)

        def registered(step: int, r: rlplane.RegisterResult) -> None:
            report["registrations"].append({"step": step, "tensors": r.tensors, "bytes": r.bytes, "paths": t.arena.paths})

        write(0)
        registered(0, register())
        p = t.publish(0)
        report["publish"].append({"version": p.version, "bytes": p.bytes})
        for batch in t.batches():
            tags = [dict(map(tuple, t)) for t in (batch.tags or [])]
            report["batches"].append({"step": batch.step, "samples": batch.samples, "keys": list(batch.keys),
                                      "versions": [t.get("policy_version") for t in tags],
                                      "versions_last": [t.get("policy_version_last") for t in tags]})
            if args.sleep_ms:
                lo, hi = (int(x) for x in args.sleep_ms.split(","))
                time.sleep(random.Random(f"{report['rank']}-{batch.step}").uniform(lo, hi) / 1000)
            if batch.step == args.stall_at:
                # Never publish: the sidecar must give up after spec.refit.timeoutSeconds. Leave
                # once the launcher is gone (rlplane local ended the run), or at --stall-s.
                report["stalled_at"] = batch.step
                with open(out(), "w") as f:
                    json.dump(report, f)
                parent, end = os.getppid(), time.monotonic() + args.stall_s
                while os.getppid() == parent and time.monotonic() < end:
                    time.sleep(0.2)
                return 4
            if batch.step == args.realloc_at:
                # Offloading and back: the old memory gets bytes no version has (a refit that
                # still read it would deliver them), then goes with its files; new memory, in
                # new files, gets this step's weights and is registered.
                old = t.arena.paths
                for _, w in held:
                    poison(raw(w))
                if args.torch:
                    for p_ in params.values():
                        p_.data = torch.empty(0, dtype=p_.dtype)
                    t.arena.close()
                    for i, w in held:  # reloaded into ordinary memory; register_model shares it again
                        fresh = np.ascontiguousarray(part(batch.step, i, w))
                        if w.dtype == "bf16":
                            params[w.name].data = torch.from_numpy(fresh.view(np.int16)).view(torch.bfloat16)
                        else:
                            params[w.name].data = torch.from_numpy(fresh)
                else:
                    arrays.clear()
                    t.arena.close()
                    arrays.update({w.name: t.alloc(w.name) for _, w in held})
                    write(batch.step)
                report["realloc"] = {"step": batch.step, "old": old, "old_exist": [x for x in old if os.path.exists(x)]}
                registered(batch.step, register())
            else:
                write(batch.step)
            p = t.publish(batch.step)
            report["publish"].append({"version": p.version, "bytes": p.bytes})
        report["done"] = True
    with open(out(), "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
