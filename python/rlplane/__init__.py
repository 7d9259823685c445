"""rlplane: the Python client of the rlplane worker sidecar.

A trainer rank and an inference engine rank talk to the rlplane worker beside them over a Unix
socket (docs/local-api.md). Weights, rollouts and batches never travel through the socket: they
are described by shared-memory and CUDA IPC memory descriptors, and the sidecar moves them with
refit and the transfer queue.

::

    import rlplane

    with rlplane.Trainer() as trainer:          # finds $RLPLANE_IPC_DIR/trainer-$LOCAL_RANK.sock
        rlplane.torch.register_model(trainer, model)
        trainer.publish(0)
        for batch in trainer.batches():
            ...
            trainer.publish(batch.step)

:mod:`rlplane.torch` (PyTorch helpers) and :mod:`rlplane.vllm` (a vLLM worker extension) are
imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .client import Client, Engine, Trainer
from .columns import Batch, Column
from .errors import (
    BusyError,
    ConfigError,
    FailedError,
    InvalidError,
    MismatchError,
    ProtocolError,
    RlplaneError,
    ShutdownError,
    StateError,
    TimeoutError,
)
from .info import Info, JobInfo, PublishResult, PutResult, RankInfo, RegisterResult, Resume, Step, VersionInfo, WeightSpec

if TYPE_CHECKING:
    from . import torch, vllm  # noqa: F401

__all__ = [
    "__version__",
    "Client",
    "Trainer",
    "Engine",
    "Batch",
    "Column",
    "Info",
    "RankInfo",
    "JobInfo",
    "Resume",
    "WeightSpec",
    "RegisterResult",
    "PublishResult",
    "PutResult",
    "Step",
    "VersionInfo",
    "RlplaneError",
    "ConfigError",
    "ProtocolError",
    "BusyError",
    "InvalidError",
    "MismatchError",
    "StateError",
    "TimeoutError",
    "FailedError",
    "ShutdownError",
]


def __getattr__(name: str) -> Any:
    # `rlplane.torch` and `rlplane.vllm` import their frameworks; load them only when asked for.
    if name in ("torch", "vllm"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'rlplane' has no attribute {name!r}")
