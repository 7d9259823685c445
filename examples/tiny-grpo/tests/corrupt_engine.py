"""engine.py with a refit bug planted: before each step it nudges one weight, as if refit had
left that element stale. The trainer's probe check must fail the job."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import engine  # noqa: E402
import grpo  # noqa: E402

generate = grpo.generate


def generate_with_a_stale_weight(model, *args, **kwargs):
    with torch.no_grad():
        model.head.weight[0, 0] += 1e-3
    return generate(model, *args, **kwargs)


grpo.generate = generate_with_a_stale_weight
sys.exit(engine.main())
