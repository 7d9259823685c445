"""Shared fixtures of the client's tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The hello reply of docs/local-api.md, extended with a few tensors for the tests.
HELLO: dict[str, Any] = {
    "ok": True,
    "protocol": 1,
    "rank": {
        "name": "trainer-0", "role": "trainer", "rank": 0, "dp": 0, "tp": 0, "pp": 0, "leader": True,
        "engine": None, "engine_rank": None, "producer": False, "local": 0,
    },
    "job": {"name": "tiny-grpo", "namespace": "default", "epoch": 0, "steps": 20},
    "device": "cpu", "gpu": None, "transport": "tcp", "shm_dir": "/dev/shm",
    "weights": [
        {"name": "embed.weight", "dtype": "f32", "shape": [16, 64], "shard_shape": [16, 64]},
        {"name": "norm.weight", "dtype": "bf16", "shape": [64], "shard_shape": [64]},
        {"name": "lm_head.weight", "dtype": "f32", "shape": [16, 64], "shard_shape": [16, 64]},
        {"name": "other_stage.weight", "dtype": "f32", "shape": [8], "shard_shape": None},
    ],
}


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private RLPLANE_SHM_DIR (on /dev/shm when it exists, so the files are memory-backed)."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tmp_path
    d = base / f"rlplane-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    monkeypatch.setenv("RLPLANE_SHM_DIR", str(d))
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
