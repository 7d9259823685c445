"""GRPO, in three parts that run in different processes under rlplane:

- the engine side, `generate`: sample a group of responses per prompt with the weights it holds,
  record the log-probability of each sampled token, and score each response with the task's rule;
- the trainer side, `train_step`: normalise rewards within each group into advantages and take
  clipped policy-gradient steps (PPO's surrogate, as GRPO uses it) on the response tokens;
- the check between them, `probe_logits`: the logits of a fixed batch of prompts, which must be
  bit-identical on the trainer and on an engine that holds the same weights.

`reference.py` runs all three in one process; `train.py` and `engine.py` run them through rlplane.
"""

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import task
from model import TinyLM


@dataclass(frozen=True)
class Config:
    seed: int = 0
    steps: int = 60
    prompts_per_step: int = 32
    # GRPO's group: responses sampled per prompt. The advantage of a response is its reward
    # relative to the others in its group, so no value network is needed.
    group_size: int = 8
    temperature: float = 1.0
    lr: float = 3e-3
    weight_decay: float = 0.0
    # Each step's rollouts are split into minibatches with one optimizer step each. After the
    # first, the policy has moved away from the one that sampled the rollouts, which is what the
    # importance ratio and its clipping are for.
    minibatches: int = 2
    clip_eps: float = 0.2
    # Rollouts sampled with older weights than the trainer's (an asynchronous schedule) train with
    # the decoupled PPO objective (AReaL): the ratio is taken to the trainer's own weights at the
    # start of the step (the proximal policy) and clipped there, and each token is weighted by
    # how much likelier the proximal policy finds it than the sampler did (capped). With
    # synchronous rollouts the two policies are the same weights and the plain objective is used.
    decoupled: bool = False
    max_importance_weight: float = 5.0
    max_grad_norm: float = 1.0
    probe_prompts: int = 8
    # The bar a run of `steps` steps must clear: mean reward over its last 3 steps. A random
    # policy scores about 0.05; see README.md for the measured curves behind this number.
    pass_reward: float = 0.8


def config_from_env() -> Config:
    """The defaults, with the seed from $TINY_GRPO_SEED and the minibatches per step from
    $TINY_GRPO_MINIBATCHES. The trainer and the engine both call this, so they agree on the
    prompts, the sampling noise and the probe."""
    return Config(seed=int(os.environ.get("TINY_GRPO_SEED", Config.seed)),
                  minibatches=int(os.environ.get("TINY_GRPO_MINIBATCHES", Config.minibatches)))


def stream_seed(cfg: Config, step: int, stream: int) -> int:
    """A seed for one random stream of one step (prompts, sampling, minibatch order), so that
    every process derives the same randomness from (seed, step) alone."""
    return (cfg.seed * 1_000_003 + step) * 8 + stream


PROMPTS, SAMPLING, SHUFFLE, PROBE = range(4)


def prompts_for_step(cfg: Config, step: int) -> torch.Tensor:
    return task.make_prompts(cfg.prompts_per_step, stream_seed(cfg, step, PROMPTS))


def probe_prompts(cfg: Config) -> torch.Tensor:
    """The fixed probe batch: the same prompts at every step."""
    return task.make_prompts(cfg.probe_prompts, stream_seed(cfg, 0, PROBE))


@torch.no_grad()
def probe_logits(model: torch.nn.Module, probe: torch.Tensor) -> torch.Tensor:
    """Logits of the probe batch on the CPU. Equal weights and the same computation give
    bit-identical logits, so comparing them with torch.equal checks that refit delivered exactly
    the trainer's weights."""
    device = next(model.parameters()).device
    return model(probe.to(device)).float().cpu()


@dataclass
class Rollouts:
    """One step's samples, padded into a batch. Sequences are prompt then response, right-padded
    with PAD to the longest; per-token fields are aligned with `tokens`."""

    tokens: torch.Tensor  # [N, T] int64
    response_mask: torch.Tensor  # [N, T] bool: True on response tokens (EOS included)
    old_logprobs: torch.Tensor  # [N, T] float32: the sampler's log-prob of each response token, 0 elsewhere
    reward: torch.Tensor  # [N] float32
    group: torch.Tensor  # [N] int64: the prompt a sample answers; advantages are normalised per group


# ---------------------------------------------------------------------------------------------
# Engine side


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: torch.Tensor, cfg: Config, step: int) -> Rollouts:
    """Sample `group_size` responses for every prompt, at `temperature`, and score them."""
    device = next(model.parameters()).device
    g = cfg.group_size
    n = prompts.shape[0] * g
    seq = prompts.repeat_interleave(g, dim=0).to(device)
    prompt_len = seq.shape[1]
    old_logprobs = torch.zeros(n, prompt_len, device=device)
    response_mask = torch.zeros(n, prompt_len, dtype=torch.bool, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    # The sampling noise comes from a CPU generator seeded by (seed, step), so a CPU and a GPU
    # engine draw the same noise and a run is reproducible.
    gen = torch.Generator().manual_seed(stream_seed(cfg, step, SAMPLING))

    for _ in range(task.MAX_RESPONSE_LEN):
        # No KV cache: the sequences are a dozen tokens long, recomputing the prefix is cheap.
        logits = model(seq)[:, -1].float() / cfg.temperature
        logprobs = F.log_softmax(logits, dim=-1)
        # Gumbel-max: argmax(log p + Gumbel noise) is a sample from p.
        u = torch.rand(logits.shape, generator=gen).clamp_(min=1e-20).to(device)
        token = (logprobs - torch.log(-torch.log(u))).argmax(dim=-1)
        token_logprob = logprobs.gather(1, token[:, None]).squeeze(1)
        # Finished sequences get PAD, which is no response token and has no log-prob. (A
        # sequence still running may sample PAD too: that is a wrong answer token, in the mask.)
        token = torch.where(done, task.PAD, token)
        token_logprob = torch.where(done, 0.0, token_logprob)
        seq = torch.cat([seq, token[:, None]], dim=1)
        old_logprobs = torch.cat([old_logprobs, token_logprob[:, None]], dim=1)
        response_mask = torch.cat([response_mask, ~done[:, None]], dim=1)
        done |= token == task.EOS
        if done.all():
            break

    seq, response_mask, old_logprobs = seq.cpu(), response_mask.cpu(), old_logprobs.cpu()

    rewards = []
    for i in range(n):
        response = seq[i, prompt_len:][response_mask[i, prompt_len:]].tolist()
        if response and response[-1] == task.EOS:
            response = response[:-1]
        rewards.append(task.reward(seq[i, :prompt_len].tolist(), response))
    return Rollouts(
        tokens=seq,
        response_mask=response_mask,
        old_logprobs=old_logprobs,
        reward=torch.tensor(rewards, dtype=torch.float32),
        group=torch.arange(prompts.shape[0]).repeat_interleave(g),
    )


# ---------------------------------------------------------------------------------------------
# Trainer side


def group_advantages(reward: torch.Tensor, group: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: a reward's z-score within its group. A group whose responses all scored
    the same teaches nothing and gets zero advantage."""
    _, idx = torch.unique(group, return_inverse=True)
    k = int(idx.max()) + 1
    count = torch.zeros(k).index_add_(0, idx, torch.ones_like(reward))
    mean = torch.zeros(k).index_add_(0, idx, reward) / count
    var = torch.zeros(k).index_add_(0, idx, (reward - mean[idx]) ** 2) / count
    return (reward - mean[idx]) / (var[idx].sqrt() + eps)


def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) for every t >= 1, at the sampling temperature (so that
    the ratio to the engine's log-probs is 1 for unchanged weights); [N, T], 0 at t = 0."""
    logits = model(tokens[:, :-1]).float() / temperature
    lp = F.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return F.pad(lp, (1, 0))


def grpo_loss(model, batch: Rollouts, advantages: torch.Tensor, cfg: Config, proximal: torch.Tensor | None = None):
    """PPO's clipped surrogate with GRPO's group advantages, averaged over all response tokens of
    the batch (padding and prompt tokens are masked out). With `proximal` (the trainer's
    log-probs at the start of the step), the decoupled objective (see Config.decoupled). Returns
    (loss, fraction clipped)."""
    logprobs = token_logprobs(model, batch.tokens, cfg.temperature)
    anchor = batch.old_logprobs if proximal is None else proximal
    ratio = torch.exp(logprobs - anchor)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
    if proximal is not None:
        surrogate = surrogate * torch.exp(proximal - batch.old_logprobs).clamp(max=cfg.max_importance_weight)
    mask = batch.response_mask.float()
    loss = -(surrogate * mask).sum() / mask.sum()
    clipped = ((ratio - 1).abs() > cfg.clip_eps).float()
    return loss, (clipped * mask).sum() / mask.sum()


def select(batch: Rollouts, idx: torch.Tensor) -> Rollouts:
    return Rollouts(*(getattr(batch, f)[idx] for f in Rollouts.__dataclass_fields__))


def train_step(model, optimizer, batch: Rollouts, cfg: Config, step: int) -> dict:
    """One GRPO step on one step's rollouts: advantages, then one optimizer step per minibatch."""
    device = next(model.parameters()).device
    advantages = group_advantages(batch.reward, batch.group)
    order = torch.randperm(len(batch.reward), generator=torch.Generator().manual_seed(stream_seed(cfg, step, SHUFFLE)))
    losses, clip_fracs = [], []
    proximal = None
    if cfg.decoupled:
        with torch.no_grad():
            proximal = token_logprobs(model, batch.tokens.to(device), cfg.temperature) * batch.response_mask.to(device)
    for idx in order.chunk(cfg.minibatches):
        mb = select(batch, idx)
        mb = Rollouts(*(getattr(mb, f).to(device) for f in Rollouts.__dataclass_fields__))
        loss, clip_frac = grpo_loss(model, mb, advantages[idx].to(device), cfg,
                                    None if proximal is None else proximal[idx.to(device)])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
        clip_fracs.append(clip_frac.item())
    return {
        "reward": batch.reward.mean().item(),
        "solved": (batch.reward == 1.0).float().mean().item(),
        "loss": sum(losses) / len(losses),
        "clip_frac": sum(clip_fracs) / len(clip_fracs),
    }


def make_policy(cfg: Config) -> TinyLM:
    """The trainer's initial policy, a pure function of the seed."""
    torch.manual_seed(cfg.seed)
    return TinyLM()


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    # foreach=False: one simple loop per tensor, the same on every run.
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)


def set_deterministic(threads: int = 1) -> None:
    """Same inputs, same bits: one thread per process (a CPU matmul's summation order can depend
    on the thread count, and the trainer and the engine must compute the probe identically) and
    deterministic kernels where PyTorch has a choice."""
    torch.set_num_threads(threads)
    # cuBLAS is deterministic only with a fixed workspace; this must be set before CUDA starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Where a CUDA backward has no deterministic kernel, warn rather than fail: the probe check
    # compares forward passes, which are deterministic either way.
    torch.use_deterministic_algorithms(True, warn_only=True)


def pin_cpu_from_env() -> None:
    """With $TINY_GRPO_CPU set (a core index), this process runs on that core alone: so that the
    trainer and the engine each get a core of their own when their schedules are compared."""
    cpu = os.environ.get("TINY_GRPO_CPU")
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return
    if int(cpu) not in os.sched_getaffinity(0):
        print(f"tiny-grpo: TINY_GRPO_CPU={cpu} is not a core this process may use; not pinned", file=sys.stderr)
        return
    os.sched_setaffinity(0, {int(cpu)})


def summarize(cfg: Config, curve: list[dict], wall_s: float) -> dict:
    """The run's result: its curve, and whether it cleared the bar."""
    rewards = [row["reward"] for row in curve]
    final = sum(rewards[-3:]) / max(1, len(rewards[-3:]))
    # The first step whose mean reward over it and the two before clears the bar.
    to_pass = next((curve[i]["step"] for i in range(2, len(rewards)) if sum(rewards[i - 2:i + 1]) / 3 >= cfg.pass_reward),
                   None)
    return {
        "seed": cfg.seed,
        "steps": len(curve),
        "first_reward": round(sum(rewards[:3]) / max(1, len(rewards[:3])), 4),
        "final_reward": round(final, 4),
        "pass_reward": cfg.pass_reward,
        "passed": len(curve) >= cfg.steps and final >= cfg.pass_reward,
        "steps_to_pass": to_pass,
        "wall_s": round(wall_s, 2),
        "curve": curve,
    }
