"""A user's engine process for test_integration_more.py: registers arrays refit writes in place
(direct), checks at every step — and after the last refit — that every tensor holds exactly
exact.full()'s bytes for the version it holds, puts a few rollouts, and writes what it saw to
<report dir>/engine-<rank>.json.

--die-at S [--die-code C]: at step S, after a put and before end_step, the process dies
(os._exit(C)), as a crashing engine does."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np

import rlplane

sys.path.insert(0, os.path.dirname(__file__))
from exact import full  # noqa: E402


def check(views: dict, weights: list, version: int) -> list[str]:
    """The tensors whose bytes are not version `version`'s, with where they first differ."""
    bad = []
    for i, w in enumerate(weights):
        want = full(version, i, w.dtype, w.shape)
        have = views[w.name]
        if have.tobytes() != want.tobytes():
            diff = np.flatnonzero(have.reshape(-1) != want.reshape(-1))
            at = int(diff[0]) if diff.size else -1
            bad.append(f"{w.name}: {diff.size} of {want.size} elements differ, first at {at} "
                       f"({have.reshape(-1)[at]!r} != {want.reshape(-1)[at]!r})")
    return bad


class CudaViews(dict):
    """The engine's weights as CUDA tensors refit writes in place; reading one gives its bytes as
    a host numpy array of exact.full()'s dtype."""

    def __init__(self, e: rlplane.Engine, weights: list) -> None:
        import torch

        from rlplane.torch import register_model, torch_dtype

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # colocated: local rank = GPU slot
        self.tensors = {w.name: torch.zeros(w.shape, dtype=torch_dtype(w.dtype), device="cuda") for w in weights}
        register_model(e, self.tensors)
        self.dtypes = {w.name: full(0, 0, w.dtype, (1,)).dtype for w in weights}
        super().__init__({n: None for n in self.tensors})

    def __getitem__(self, name: str) -> np.ndarray:
        import torch

        raw = self.tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy()
        return raw.view(self.dtypes[name]).reshape(self.tensors[name].shape)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", required=True)
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--die-code", type=int, default=3)
    ap.add_argument("--sleep-ms", default=None, help="MIN,MAX: generate each step for a random time in this range")
    ap.add_argument("--stale-at", type=int, default=None,
                    help="at step S, also put one sample labelled as generated with the initial weights (version 0)")
    ap.add_argument("--staged", action="store_true",
                    help="register staged: refit fills the sidecar's buffers and the engine copies them into its own "
                         "arrays at each step's start (what it generates with)")
    ap.add_argument("--mid-step", action="store_true",
                    help="staged: after the step's first sample, take newer staged weights if any have arrived "
                         "(partial rollouts), or record the refusal")
    ap.add_argument("--device", default="cpu", help="cuda: register CUDA tensors (direct mode), read back to check")
    args = ap.parse_args()
    report: dict = {"steps": []}

    def save() -> None:
        with open(os.path.join(args.report, f"engine-{report['rank']}.json"), "w") as f:
            json.dump(report, f)

    with rlplane.Engine(timeout=60) as e:
        info = e.info
        report["rank"] = info.rank.name
        report["hello"] = info.raw
        weights = list(info.weights)
        staging = None
        if args.staged:
            staging = e.register_staged()
            views = {name: np.array(v) for name, v in staging.items()}  # the engine's own copy
        elif args.device == "cuda":
            views = CudaViews(e, weights)
        else:
            views = {w.name: e.alloc(w.name) for w in weights}
            e.register(views)
        for step in e.steps():
            if staging is not None:
                # Take the newest staged weights between two steps; refit may fill the staging
                # buffers with the next version while this step generates from the copy.
                with e.staged(step.version or 0, timeout=30) as taken:
                    for name, v in staging.items():
                        np.copyto(views[name], v)
                held = taken
            else:
                held = e.wait_version(step.version or 0, timeout=30).version
            entry: dict = {"step": step.step, "version": step.version, "held": held,
                           "bad": check(views, weights, held or 0)}
            report["steps"].append(entry)
            n = 2
            if args.sleep_ms:
                lo, hi = (int(x) for x in args.sleep_ms.split(","))
                time.sleep(random.Random(f"{report['rank']}-{step.step}").uniform(lo, hi) / 1000)
            # What the sidecar holds once the step's generation is done: staged, a newer version
            # may have arrived meanwhile; direct, never (the engine's own tensors don't change
            # inside a step).
            entry["held_after"] = e.version().version
            if staging is None:
                entry["bad_after"] = check(views, weights, held or 0)
            columns = {
                "input_ids": [np.arange(4, dtype=np.int64) + 1000 * step.step + k for k in range(n)],
                "reward": np.full(n, float(step.step), np.float32),
            }
            if args.mid_step and staging is not None:
                # The first sample is done with `held`; the second continues with newer weights
                # if they arrived meanwhile, as an engine with partial rollouts does.
                e.put(step, {k: v[:1] for k, v in columns.items()}, keys=[f"s{step.step}-{report['rank']}-a"])
                ready = e.newer_weights(than=held)
                if ready is not None:
                    try:
                        with e.staged(ready, timeout=30) as newer:
                            for name, v in staging.items():
                                np.copyto(views[name], v)
                        entry["mid_take"] = newer
                        entry["bad_mid"] = check(views, weights, newer)
                    except rlplane.StateError as err:
                        entry["mid_refused"] = str(err)
                e.put(step, {k: v[1:] for k, v in columns.items()}, keys=[f"s{step.step}-{report['rank']}-b"])
            else:
                e.put(step, columns)
            if step.step == args.stale_at:
                e.put(step, {"input_ids": [np.arange(4, dtype=np.int64)], "reward": np.zeros(1, np.float32)},
                      keys=[f"stale-s{step.step}-{report['rank']}"], tags=[{"policy_version": "0"}])
            if step.step == args.die_at:
                report["died_at"] = step.step
                save()
                print(f"exact_engine.py: dying at step {step.step} (os._exit({args.die_code}))", file=sys.stderr, flush=True)
                os._exit(args.die_code)
        # After the job's last step its last refit is in place too (in the staging buffers, staged).
        vi = e.version()
        final_views = staging if staging is not None else views
        report["final"] = {"version": vi.version, "state": vi.state, "bad": check(final_views, weights, vi.version or 0)}
        report["done"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
