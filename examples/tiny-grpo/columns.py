"""Rollouts as transfer-queue columns, and back.

The engine puts one row per sample into rlplane's transfer queue; the trainer gets the step's
samples back as columns. Sequences travel unpadded (ragged columns), so the bytes moved are the
tokens generated, not a padded rectangle:

| column          | kind   | dtype | per sample                                                      |
|-----------------|--------|-------|-----------------------------------------------------------------|
| `input_ids`     | ragged | i64   | prompt then response tokens                                      |
| `response_mask` | ragged | bool  | True on the response tokens of `input_ids`                      |
| `old_logprobs`  | ragged | f32   | the engine's log-prob of each response token                     |
| `reward`        | fixed  | f32   | the task's score                                                 |
| `group`         | fixed  | i64   | the prompt answered; GRPO normalises rewards within a group      |
| `index`         | fixed  | i64   | position in the engine's output, to restore the order            |
| `version`       | fixed  | i64   | the weights version that generated it                            |
| `probe_logits`  | ragged | f32   | the engine's probe logits [probe, time, vocab]: on the engine's  |
|                 |        |       | first sample of the step, no rows on every other sample          |

Restoring the engine's order on the trainer (the transfer queue balances samples across
data-parallel shards and need not keep it) makes the trainer's batch exactly the reference
loop's, so an rlplane run follows the reference run's curve.
"""

import numpy as np
import torch

import task
from grpo import Rollouts


def to_columns(r: Rollouts, version: int, probe_logits: torch.Tensor) -> dict:
    """The columns `rlplane.Engine.put` takes: lists of per-sample arrays (ragged) or one array
    of all samples (fixed)."""
    n = len(r.reward)
    # A sample ends at its last response token (the responses follow their prompts).
    ends = (r.response_mask.int().cumsum(dim=1).argmax(dim=1) + 1).tolist()
    tokens, mask, old = r.tokens.numpy(), r.response_mask.numpy(), r.old_logprobs.numpy()
    probe = probe_logits.numpy()
    no_probe = np.zeros((0, *probe.shape[1:]), dtype=np.float32)
    return {
        "input_ids": [tokens[i, : ends[i]] for i in range(n)],
        "response_mask": [mask[i, : ends[i]] for i in range(n)],
        "old_logprobs": [old[i][mask[i]] for i in range(n)],
        "reward": r.reward.numpy(),
        "group": r.group.numpy(),
        "index": np.arange(n, dtype=np.int64),
        "version": np.full(n, version, dtype=np.int64),
        "probe_logits": [probe] + [no_probe] * (n - 1),
    }


def from_batch(batch) -> tuple[Rollouts, np.ndarray, list[tuple[int, torch.Tensor]]]:
    """A trainer's `rlplane.Batch` as (rollouts in the engine's order, the weights version of each
    sample, the probe logits the batch carries with the version of the weights that computed them)."""
    order = np.argsort(np.asarray(batch["index"].values), kind="stable")
    tokens, _ = batch["input_ids"].padded(task.PAD)
    mask, _ = batch["response_mask"].padded(False)
    tokens, mask = tokens[order], mask[order]
    old = np.zeros(tokens.shape, dtype=np.float32)
    logprobs = batch["old_logprobs"]
    for row, i in enumerate(order):
        old[row][mask[row]] = logprobs.sample(int(i))
    version = np.array(batch["version"].values)
    probes = [(int(version[i]), torch.from_numpy(np.array(p))) for i, p in enumerate(batch["probe_logits"]) if len(p) > 0]
    rollouts = Rollouts(
        tokens=torch.from_numpy(tokens.astype(np.int64)),
        response_mask=torch.from_numpy(mask.astype(bool)),
        old_logprobs=torch.from_numpy(old),
        reward=torch.from_numpy(np.array(batch["reward"].values)[order]),
        group=torch.from_numpy(np.array(batch["group"].values)[order]),
    )
    return rollouts, version[order], probes
