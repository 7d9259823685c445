"""A stand-in for one vLLM engine (NOT vLLM) for the integration tests: a driver process and one
worker process per tensor-parallel rank, as vLLM runs them.

Each worker mixes ``rlplane.vllm.RlplaneWorkerExtension`` into a worker whose model records what
``load_weights`` got, and finds its tensor-parallel rank the way it does inside vLLM (through
``vllm.distributed.parallel_state``, stood in here). The driver runs methods on every worker as
``LLM.collective_rpc`` does (over pipes), takes the engine's steps in a ``rollouts`` session,
makes every worker load each step's version, checks what they loaded, and puts rollouts.

``launch.py N vllm_standin.py`` runs one engine per LOCAL_RANK (the engine's index in the pod,
given to rlplane as RLPLANE_ENGINE). Writes <report dir>/engine-<rank of the driver>.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import types
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from trainer import pattern  # noqa: E402


def fake_vllm(rank: int, world: int) -> None:
    """What vLLM's worker process has: its tensor-parallel rank and size."""
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_tensor_model_parallel_rank = lambda: rank  # type: ignore[attr-defined]
    ps.get_tensor_model_parallel_world_size = lambda: world  # type: ignore[attr-defined]
    dist = types.ModuleType("vllm.distributed")
    dist.parallel_state = ps  # type: ignore[attr-defined]
    vllm = types.ModuleType("vllm")
    vllm.distributed = dist  # type: ignore[attr-defined]
    sys.modules.update({"vllm": vllm, "vllm.distributed": dist, "vllm.distributed.parallel_state": ps})


def worker_main(conn: Any, rank: int, world: int) -> None:
    fake_vllm(rank, world)
    import torch

    import rlplane.vllm as rv

    class Model:
        def __init__(self) -> None:
            self.loaded: dict[str, Any] = {}

        def load_weights(self, weights: Any) -> set[str]:
            for name, t in weights:
                self.loaded[name] = t.detach().float().clone()
            return set(self.loaded)

    class Worker(rv.RlplaneWorkerExtension):
        def __init__(self) -> None:
            self.model_runner = types.SimpleNamespace(model=Model())
            self.device = torch.device("cpu")

        def load_and_check(self, version: int) -> dict[str, Any]:
            held = self.rlplane_update_weights(version, 30.0)
            names = [w.name for w in self._rlplane_engine.info.weights]  # type: ignore[union-attr]
            loaded = self.model_runner.model.loaded
            bad = [n for i, n in enumerate(names) if not bool(torch.all(loaded[n] == pattern(held, i)))]
            return {"tp_rank": rank, "held": held, "bad": bad, "tensors": len(loaded)}

    w = Worker()
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, args = msg
        try:
            conn.send(("ok", getattr(w, method)(*args)))
        except BaseException as e:  # noqa: BLE001 - the driver reports it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Workers:
    """The driver's side of its workers: ``collective_rpc`` runs a method in each, in rank order."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, r, world), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        for c in self.conns:
            c.send((method, args))
        out = [c.recv() for c in self.conns]
        errors = [f"worker {i}: {r}" for i, (kind, r) in enumerate(out) if kind == "error"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [r for _, r in out]

    def stop(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(30)


def probes(engine: int, world: int) -> dict[str, str]:
    """What the sidecar says to sessions a rank cannot take: the class of the error (or "ok")."""
    import rlplane

    out = {}
    cases = {
        "second_weights_session": {"session": "weights", "engine": engine, "tp_rank": 0},
        "second_rollouts_session": {"session": "rollouts", "engine": engine, "tp_rank": 0},
        "all_beside_the_sessions": {"engine": engine, "tp_rank": 0},
        "rollouts_on_rank_1": {"session": "rollouts", "engine": engine, "tp_rank": 1},
    }
    for name, kw in cases.items():
        if kw.get("tp_rank", 0) >= world:
            continue
        try:
            rlplane.Engine(timeout=10, **kw).close()
            out[name] = "ok"
        except rlplane.RlplaneError as e:
            out[name] = type(e).__name__
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", required=True)
    args = ap.parse_args()
    import rlplane.vllm

    engine_index = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["RLPLANE_ENGINE"] = str(engine_index)
    world = int(os.environ["RLPLANE_ENGINE_TENSOR_PARALLEL"])
    workers = Workers(world)
    report: dict[str, Any] = {"engine_index": engine_index, "steps": []}
    try:
        report["workers"] = workers.collective_rpc("rlplane_connect")
        with rlplane.vllm.connect_driver(timeout=60) as e:
            report["rank"] = e.info.rank.name
            report["session"] = e.info.raw.get("session")
            report["probes"] = probes(engine_index, world)
            rng = np.random.default_rng(e.info.rank.rank)
            for step in e.steps():
                loaded = workers.collective_rpc("load_and_check", (step.version or 0,))
                n = 3
                lengths = rng.integers(1, 20, size=n)
                ids = [np.arange(k, dtype=np.int64) + 1000 * step.step for k in lengths]
                e.put(step, {
                    "input_ids": ids,
                    "logprobs": [np.full(k, -0.5, np.float32) for k in lengths],
                    "reward": np.array([float(step.step)] * n, np.float32),
                }, tags=[{"engine": str(e.info.rank.engine)}] * n)
                report["steps"].append({"step": step.step, "version": step.version, "workers": loaded})
            report["done"] = True
        workers.collective_rpc("rlplane_close")
    finally:
        workers.stop()
        with open(os.path.join(args.report, f"engine-{report.get('rank', engine_index)}.json"), "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
