"""A tensor-parallel engine's rank registered direct, for test_integration_more.py: every rank
registers its own arrays in place; rank 0 takes the steps and puts a rollout each, the other
ranks wait for versions until the job ends."""

from __future__ import annotations

import sys

import numpy as np

import rlplane


def main() -> int:
    with rlplane.Engine(timeout=60) as e:
        e.register({w.name: e.alloc(w.name) for w in e.info.weights})
        if e.info.rank.producer:
            for step in e.steps():
                e.put(step, {"input_ids": [np.arange(4, dtype=np.int64)], "reward": np.zeros(1, np.float32)})
            return 0
        version = 0
        while True:
            try:
                version = (e.wait_version(version + 1, timeout=None).version or version)
            except rlplane.RlplaneError:
                return 0


if __name__ == "__main__":
    sys.exit(main())
