"""The whole GRPO loop in one process, without rlplane: the reference that `train.py` and
`engine.py` must reproduce.

The "engine" is a second copy of the model. After every optimizer step the trainer's weights are
copied into it (what rlplane's refit does across processes and GPUs), and the probe check asserts
that both copies compute bit-identical logits.

    python examples/tiny-grpo/reference.py --seed 0
"""

import argparse
import json
import sys
import time

import torch

import grpo
from model import TinyLM


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=grpo.Config.seed)
    ap.add_argument("--steps", type=int, default=grpo.Config.steps)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--out", help="write the result (curve, wall time) as JSON here")
    args = ap.parse_args()

    grpo.set_deterministic(args.threads)
    cfg = grpo.Config(seed=args.seed, steps=args.steps)
    policy = grpo.make_policy(cfg).to(args.device)
    optimizer = grpo.make_optimizer(policy, cfg)
    engine = TinyLM().to(args.device)  # its own initial weights; the first refit replaces them
    probe = grpo.probe_prompts(cfg)

    def refit() -> None:
        engine.load_state_dict(policy.state_dict())

    def check_probe(step: int) -> dict:
        # As train.py does through rlplane: before generating step `step`, the engine's probe
        # logits with the weights it holds (version step - 1) equal the trainer's.
        assert torch.equal(grpo.probe_logits(policy, probe), grpo.probe_logits(engine, probe)), "probe logits differ"
        return {"version": step - 1, "engines": 1}

    start = time.monotonic()
    refit()  # version 0: the initial weights
    curve = []
    for step in range(1, cfg.steps + 1):
        compared = check_probe(step)
        rollouts = grpo.generate(engine, grpo.prompts_for_step(cfg, step), cfg, step)  # engine holds step - 1
        metrics = grpo.train_step(policy, optimizer, rollouts, cfg, step)
        refit()  # version `step`
        metrics = {"step": step, **{k: round(v, 4) for k, v in metrics.items()}, "probe": compared,
                   "elapsed_s": round(time.monotonic() - start, 2)}
        curve.append(metrics)
        print(json.dumps(metrics), flush=True)

    result = grpo.summarize(cfg, curve, wall_s=time.monotonic() - start)
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
