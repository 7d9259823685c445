"""The engine of tiny-grpo, run by rlplane (`rlplane local examples/tiny-grpo/rljob.yaml`).

It holds its own copy of the policy, which rlplane's refit overwrites in place after every
training step. For each step it samples a group of responses per prompt with the weights it
holds, scores them, and puts them into rlplane's transfer queue for the trainer, together with
its logits for the fixed probe batch (the trainer checks them against its own).
"""

import sys

import torch

import rlplane
import rlplane.torch

import columns
import grpo
from model import TinyLM
from train import device_of


def main() -> int:
    grpo.set_deterministic()
    grpo.pin_cpu_from_env()
    cfg = grpo.config_from_env()

    with rlplane.Engine() as e:
        device = device_of(e.info)
        # Placeholder weights: the initial refit (the trainer's publish(0)) replaces them before
        # the first step. Registering in direct mode lets refit write straight into the
        # parameters (shared memory on CPU, CUDA IPC on GPU).
        model = TinyLM().to(device)
        # Asynchronous (the trainer trains while this engine samples): staged, so that refit fills
        # the sidecar's buffers with the next weights while this engine samples from its own, and
        # the engine takes them between two steps. Synchronous: refit writes in place.
        staged = rlplane.torch.staged_tensors(e) if e.info.job.max_policy_lag else None
        if staged is None:
            rlplane.torch.register_model(e, model)
        probe = grpo.probe_prompts(cfg)

        for step in e.steps():
            if staged is not None:
                with e.staged(step.version) as taken, torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(staged[name])
                step = rlplane.Step(step=step.step, version=taken)
            # The engine holds the weights of the previous step (version 0: the initial ones), or
            # with an asynchronous schedule those of up to max_policy_lag steps before.
            lag = step.step - 1 - step.version
            assert 0 <= lag <= e.info.job.max_policy_lag, f"step {step.step} with weights {step.version}"
            rollouts = grpo.generate(model, grpo.prompts_for_step(cfg, step.step), cfg, step.step)
            cols = columns.to_columns(rollouts, step.version, grpo.probe_logits(model, probe))
            n = len(rollouts.reward)
            e.put(
                step.step,
                cols,
                keys=[f"s{step.step}-{i:05d}" for i in range(n)],
                # The group id as a tag too: the transfer queue can filter and route by tags.
                tags=[[("uid", f"s{step.step}-p{int(g)}")] for g in rollouts.group],
            )
            # The job's metrics and status show it (rlplane_step_scalar{name="reward_mean"}).
            e.report_scalars(step.step, {"reward_mean": rollouts.reward.mean().item()})
            e.end_step(step.step)
            print(f"engine: step {step.step}: {n} rollouts from weights {step.version}, "
                  f"mean reward {rollouts.reward.mean().item():.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
