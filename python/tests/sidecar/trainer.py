"""A user's trainer process for the integration tests: registers its weights (numpy arrays from
alloc, or a torch model with --torch), publishes each version filled with a pattern the engine
checks, reads every batch, and writes what it saw to <report dir>/trainer-<rank>.json."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import rlplane
from rlplane.dtypes import f32_to_bf16, numpy_dtype


def pattern(version: int, index: int) -> float:
    """The value of every element of tensor `index` at `version` (exact in bf16)."""
    return float(version * 32 + index % 32)


def fill(arr: np.ndarray, dtype: str, value: float) -> None:
    if dtype == "bf16":
        arr[...] = f32_to_bf16(np.full(arr.shape, value, np.float32))
    else:
        arr[...] = np.asarray(value).astype(numpy_dtype(dtype))


def probe_errors(t: rlplane.Trainer, held: list) -> dict:
    """Provokes errors the sidecar answers, before registering for real: what each raised."""
    out: dict = {}

    def record(key: str, f) -> None:  # noqa: ANN001
        try:
            f()
            out[key] = None
        except rlplane.RlplaneError as e:
            out[key] = {"class": type(e).__name__, "kind": e.kind, "message": e.message}

    record("publish_before_register", lambda: t.publish(0))
    record("second_connection", lambda: rlplane.Trainer(socket=t.socket_path, timeout=5))
    name0 = held[0][1].name
    bad = {w.name: t.alloc(w.name) for _, w in held[1:]}
    bad["not.in.the.model"] = t.alloc("x", "f32", (4,))
    bad[name0] = t.alloc(name0 + "/wrong", "f32", (3, 3))
    record("mismatch", lambda: t.register(bad))
    record("staged_trainer", lambda: t._call("register_weights", mode="staged", tensors=[]))
    return out


def report_scalars(t: rlplane.Trainer, step: int, report: dict) -> None:
    """Reports this rank's step scalars; the first time, also what reporting bad ones raises."""
    if "scalar_errors" not in report:
        report["scalar_errors"] = {}
        for key, (s, values) in {"bad_name": (step, {"bad name": 1.0}), "nan": (step, {"loss": float("nan")}),
                                 "ahead": (step + 1, {"loss": 1.0})}.items():
            try:
                t.report_scalars(s, values)
                report["scalar_errors"][key] = None
            except rlplane.RlplaneError as e:
                report["scalar_errors"][key] = {"class": type(e).__name__, "message": e.message}
    t.report_scalars(step, {"loss": step * 0.5, "rank_index": t.info.rank.rank})


def checkpoint(t: rlplane.Trainer, directory: str, step: int, report: dict) -> None:
    """Saves the trainer's state after `step` (here: just the step) and reports it; the first
    time, also what the sidecar answers to a checkpoint of a step not trained yet and to an
    empty URI."""
    path = os.path.join(directory, f"{t.info.rank.name}-step-{step}.json")
    with open(path, "w") as f:
        json.dump({"step": step}, f)
    if "checkpoints" not in report:
        report["checkpoint_errors"] = {}
        for key, (s, uri) in {"ahead": (step + 5, path), "empty_uri": (step, "")}.items():
            try:
                t.checkpoint_saved(s, uri)
                report["checkpoint_errors"][key] = None
            except rlplane.RlplaneError as e:
                report["checkpoint_errors"][key] = {"class": type(e).__name__, "message": e.message}
        report["checkpoints"] = []
    t.checkpoint_saved(step, path)
    report["checkpoints"].append({"step": step, "uri": path})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", required=True)
    ap.add_argument("--torch", action="store_true", help="register a torch model through rlplane.torch")
    ap.add_argument("--device", default="cpu", help="where the torch model lives (cpu, cuda)")
    ap.add_argument("--fail-at", type=int, default=None, help="call fail() at this step")
    ap.add_argument("--fail-once-marker", default=None,
                    help="with --fail-at: fail only if this file does not exist yet, and create it")
    ap.add_argument("--probe-errors", action="store_true", help="first provoke the sidecar's errors and record them")
    ap.add_argument("--scalars", action="store_true", help="report step scalars (and probe the bad ones once)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="save a checkpoint (the version, as a file) where the job asks for one and report it")
    args = ap.parse_args()
    report: dict = {"batches": []}
    with rlplane.Trainer(timeout=60) as t:
        info = t.info
        report["rank"] = info.rank.name
        report["hello"] = info.raw
        report["job"] = {"checkpoint_every": info.job.checkpoint_every, "first_step": info.job.first_step,
                         "resume": None if info.job.resume is None else vars(info.job.resume),
                         "initial_version": t.initial_version}
        held = [(i, w) for i, w in enumerate(info.weights) if w.held]
        if args.probe_errors:
            report["errors"] = probe_errors(t, held)
        if args.torch:
            import torch

            from rlplane.torch import register_model, torch_dtype

            params = {w.name: torch.nn.Parameter(torch.zeros(w.shard_shape, dtype=torch_dtype(w.dtype), device=args.device))
                      for _, w in held}
            res = register_model(t, params)
            arrays = None
        else:
            arrays = {w.name: t.alloc(w.name) for _, w in held}
            res = t.register(arrays)
        report["registered"] = {"tensors": res.tensors, "bytes": res.bytes}

        def set_version(v: int) -> None:
            for i, w in held:
                if arrays is not None:
                    fill(arrays[w.name], w.dtype, pattern(v, i))
                else:
                    with torch.no_grad():
                        params[w.name].fill_(pattern(v, i))

        # A resumed epoch restores the checkpoint (here: the step it names) and publishes it.
        first = t.initial_version
        if info.job.resume is not None:
            with open(info.job.resume.uri) as f:
                restored = json.load(f)["step"]
            assert restored == first, (restored, first)
        set_version(first)
        p = t.publish(first)
        report["publish"] = [{"version": p.version, "refit_s": p.refit_s, "bytes": p.bytes}]
        for batch in t.batches():
            ids = batch["input_ids"]
            report["batches"].append({
                "step": batch.step,
                "samples": batch.samples,
                "keys": batch.keys,
                "tokens": batch.tokens,
                "columns": {n: {"dtype": c.dtype, "ragged": c.ragged, "inner": list(c.inner)} for n, c in batch.columns.items()},
                "input_ids": [s.tolist() for s in ids.as_list()],
                "reward": batch["reward"].values.tolist(),
                "logprobs_len": [len(s) for s in batch["logprobs"].as_list()],
                "tags": batch.tags,
            })
            if args.fail_at is not None and batch.step == args.fail_at and not (
                    args.fail_once_marker and os.path.exists(args.fail_once_marker)):
                if args.fail_once_marker:
                    open(args.fail_once_marker, "w").close()
                t.fail(f"planned failure at step {batch.step}")
                report["failed_at"] = batch.step
                break
            set_version(batch.step)
            if args.checkpoint_dir and t.checkpoint_due(batch.step):
                checkpoint(t, args.checkpoint_dir, batch.step, report)
            if args.scalars:
                report_scalars(t, batch.step, report)
            p = t.publish(batch.step)
            report["publish"].append({"version": p.version, "refit_s": p.refit_s, "bytes": p.bytes})
            if args.scalars and "after_publish" not in report:
                try:
                    t.report_scalars(batch.step, {"loss": 0.0})
                    report["after_publish"] = None
                except rlplane.RlplaneError as e:
                    report["after_publish"] = type(e).__name__
        report["done"] = True
    path = os.path.join(args.report, f"trainer-{report['rank']}.json")
    with open(path, "w") as f:
        json.dump(report, f)
    return 3 if "failed_at" in report else 0


if __name__ == "__main__":
    sys.exit(main())
