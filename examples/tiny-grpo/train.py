"""The trainer of tiny-grpo, run by rlplane (`rlplane local examples/tiny-grpo/rljob.yaml`).

It owns the policy and the optimizer. rlplane brings it each step's rollouts from the engine
(`t.batches()`) and, at `t.publish(step)`, moves the updated weights to the engine (refit) and
returns once the engine holds them.

Besides learning, it checks refit: the engine sends, with each step's rollouts, the logits it
computes for a fixed probe batch with the weights it holds; they must be bit-identical to the
logits the trainer computed for the weights it published. Any difference fails the job.

With `spec.checkpoint.everySteps`, it saves the policy, the optimizer and the curve so far where
the job asks (`t.checkpoint_due`) under --checkpoint-dir or $TINY_GRPO_CHECKPOINT_DIR and reports
each; an epoch that resumes after a gang restart loads the one rlplane names and goes on from
there. Every random stream derives from (seed, step), so a resumed run's curve equals an
uninterrupted one's.

Prints one JSON line per step; writes a result JSON (the curve and the pass/fail of the
threshold) to --result or $TINY_GRPO_RESULT.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace

import torch

import rlplane
import rlplane.torch

import columns
import grpo


def device_of(info) -> torch.device:
    """The device this rank computes on. In a pod (and in `rlplane local`) the pod's GPUs are the
    container's CUDA devices 0, 1, …, and the rank's local index picks its own; CUDA IPC refit
    needs the trainer's tensors on the GPU the sidecar serves."""
    if info.device == "gpu":
        device = torch.device("cuda", info.rank.local)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--result", default=os.environ.get("TINY_GRPO_RESULT"), help="write the result JSON here")
    ap.add_argument("--checkpoint-dir", default=os.environ.get("TINY_GRPO_CHECKPOINT_DIR"),
                    help="where checkpoints go (default: one for this process under the temporary directory)")
    ap.add_argument("--fail-once-at", type=int, default=os.environ.get("TINY_GRPO_FAIL_ONCE_AT"),
                    help="fail at this step, once per --checkpoint-dir (to try resuming)")
    args = ap.parse_args()
    if args.fail_once_at is not None and not args.checkpoint_dir:
        ap.error("--fail-once-at needs --checkpoint-dir (or $TINY_GRPO_CHECKPOINT_DIR): it remembers the failure there")

    grpo.set_deterministic()
    grpo.pin_cpu_from_env()
    start = time.monotonic()
    curve = []

    with rlplane.Trainer() as t:
        # The job says how many steps; everything else (seed, hyperparameters) is grpo.Config,
        # which the engine reads too.
        cfg = replace(grpo.config_from_env(), steps=t.info.job.steps)
        device = device_of(t.info)
        model = grpo.make_policy(cfg).to(device)
        # CPU parameters move into shared memory (CUDA ones are shared by IPC handle); refit
        # reads them from there at every publish, with no copy. The optimizer is created after,
        # on the parameters as they now are.
        rlplane.torch.register_model(t, model)
        optimizer = grpo.make_optimizer(model, cfg)
        probe = grpo.probe_prompts(cfg)
        job = t.info.job
        # By default a directory of this process's own, so that runs at once never share one; a
        # restarted epoch reads the checkpoint at the path the trainer reported.
        checkpoints = args.checkpoint_dir or os.path.join(
            tempfile.gettempdir(), "tiny-grpo-checkpoints", f"{job.namespace}-{job.name}-{os.getpid()}")
        if job.resume is not None:
            # A restarted gang: the policy, the optimizer and the curve as they were after the
            # checkpoint's step; the steps go on after it.
            saved = torch.load(job.resume.uri, map_location=device, weights_only=False)
            with torch.no_grad():
                model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            curve = saved["curve"]
            print(json.dumps({"resumed": {"step": job.resume.step, "checkpoint": job.resume.uri}}), flush=True)

        # An asynchronous job's engines generate ahead: step s's rollouts come from the weights
        # of step s-1 or, up to max_policy_lag steps, before. The loss's importance ratio is
        # against the log-probs the engine sampled with, so an older version is still on-policy
        # enough for PPO's clipping; the probe check compares each engine with the version it held.
        max_lag = job.max_policy_lag
        cfg = replace(cfg, decoupled=max_lag > 0)
        t.publish(t.initial_version)  # the initial (or restored) weights, before the engine generates
        published = {t.initial_version: grpo.probe_logits(model, probe)}  # what an engine holding each version computes

        for batch in t.batches():
            rollouts, versions, engine_probes = columns.from_batch(batch)
            newest = batch.step - 1
            # Generation never overlaps a refit: each rollout comes from one published version.
            lags = sorted(set((newest - versions).tolist()))
            if lags[0] < 0 or lags[-1] > max_lag:
                raise RuntimeError(f"step {batch.step}: rollouts from weights {sorted(set(versions.tolist()))}, "
                                   f"expected {newest - max_lag} to {newest}")
            compared = check_probe(batch.step, published, engine_probes)
            held = max(v for v, _ in engine_probes)

            metrics = grpo.train_step(model, optimizer, rollouts, cfg, batch.step)
            if args.fail_once_at is not None and batch.step == int(args.fail_once_at):
                marker = os.path.join(checkpoints, "failed-once")
                if not os.path.exists(marker):
                    os.makedirs(checkpoints, exist_ok=True)
                    open(marker, "w").close()
                    t.fail(f"planned failure at step {batch.step} (--fail-once-at)")
                    return 3
            # What was compared: `engines` probe logits computed with weights `version` by the
            # engines, each equal bit for bit to the trainer's (check_probe raised otherwise).
            row = {"step": batch.step, **{k: round(v, 4) for k, v in metrics.items()},
                   "probe": {"version": held, "engines": compared}}
            if max_lag:
                row["policy_lag"] = round(float((newest - versions).mean()), 4)
            if t.checkpoint_due(batch.step):
                # Saved before publishing: the report travels with this step's update.
                os.makedirs(checkpoints, exist_ok=True)
                path = os.path.join(checkpoints, f"step-{batch.step}.pt")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "curve": curve + [row], "step": batch.step}, path)
                t.checkpoint_saved(batch.step, path)
            t.report_scalars(batch.step, metrics)  # loss, KL, …: the job's metrics and status
            refit = t.publish(batch.step)
            published[batch.step] = grpo.probe_logits(model, probe)
            for old in [v for v in published if v < batch.step - max_lag]:
                del published[old]  # no engine generates with it any more

            row.update(refit_s=round(refit.refit_s, 4), elapsed_s=round(time.monotonic() - start, 2))
            curve.append(row)
            print(json.dumps(row), flush=True)

    result = grpo.summarize(cfg, curve, wall_s=time.monotonic() - start)
    # No engine generates after the last publish, so no probe compares that version: its
    # delivery is checked only by the refit's digest (spec.refit.verify).
    result["unprobed_version"] = curve[-1]["step"] if curve else 0
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def check_probe(step: int, published: dict[int, torch.Tensor], engine_probes: list[tuple[int, torch.Tensor]]) -> int:
    """Fails loudly unless every engine's probe logits equal, bit for bit, the trainer's for the
    version the engine held; returns how many it compared."""
    if not engine_probes:
        raise RuntimeError(f"step {step}: the batch carries no probe logits from the engine")
    for version, p in engine_probes:
        if version not in published:
            raise RuntimeError(f"step {step}: the engine generated with weights version {version}, which the trainer "
                               f"never published or no longer keeps (it keeps {sorted(published)})")
        published_v = published[version]
        if not torch.equal(p, published_v):
            diff = (p - published_v).abs().max().item() if p.shape == published_v.shape else float("nan")
            raise RuntimeError(
                f"step {step}: the engine's probe logits for weights version {version} differ from the trainer's "
                f"(shapes {list(p.shape)} vs {list(published_v.shape)}, max |difference| {diff:.3g}): refit did not "
                "deliver exactly the trainer's weights"
            )
    return len(engine_probes)


if __name__ == "__main__":
    sys.exit(main())
