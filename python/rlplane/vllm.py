"""A vLLM worker extension that loads refits from the rlplane sidecar.

vLLM mixes a ``worker_extension_cls`` into every worker, and ``collective_rpc`` runs one of its
methods in each worker, where ``self.model_runner.model`` is the model and ``self.device`` its
device::

    from vllm import LLM

    llm = LLM(model=..., worker_extension_cls="rlplane.vllm.RlplaneWorkerExtension")
    llm.collective_rpc("rlplane_connect")                 # each worker: engine-<tp rank>.sock
    engine = rlplane.Engine(index=...)                    # or drive steps from the producer rank
    ...
    llm.collective_rpc("rlplane_update_weights", args=(step.version, 60.0))
    outputs = llm.generate(prompts, sampling)

The engine ranks register in **staged** mode: the sidecar receives each refit into its own
buffers (CUDA IPC or shared memory), and ``rlplane_update_weights`` loads them through the
model's ``load_weights``, which fuses q/k/v and gate/up projections and shards for this worker's
tensor-parallel rank — so the sidecar ships the model's plain (Hugging Face) tensors.

Nothing here imports vLLM at module level; the tensor-parallel rank is read from
``vllm.distributed`` when ``rlplane_connect`` is not given an index.
"""

from __future__ import annotations

import os
from typing import Any

from .client import Engine
from .errors import ConfigError

__all__ = ["RlplaneWorkerExtension"]


class RlplaneWorkerExtension:
    """Methods vLLM adds to its workers (``worker_extension_cls``); call them with
    ``llm.collective_rpc("rlplane_…", args=(…))``.

    Every attribute is prefixed ``rlplane_`` / ``_rlplane_`` so it cannot collide with the
    worker's own (vLLM refuses an extension that would shadow one).
    """

    # Set by rlplane_connect (instance attributes; vLLM's worker has no __init__ hook for us).
    _rlplane_engine: Engine | None
    _rlplane_views: dict[str, Any]

    def _rlplane_worker_device(self) -> Any:
        return getattr(self, "device", None)

    def _rlplane_tp(self) -> tuple[int, int]:
        try:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )
        except ImportError as e:
            raise ConfigError(
                f"cannot read vLLM's tensor-parallel rank ({e}); pass index=… to rlplane_connect "
                "(the worker's local tensor-parallel rank: engine-<index>.sock)"
            ) from None
        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())

    def rlplane_connect(self, socket: str | None = None, index: int | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
        """Connects this worker to its engine rank's sidecar socket and registers in staged mode.

        The socket is ``socket`` if given, else ``$RLPLANE_SOCKET`` (one worker only), else
        ``$RLPLANE_IPC_DIR/engine-<index>.sock`` with ``index`` defaulting to this worker's
        tensor-parallel rank. Returns a summary: the rank's name, the socket, the number of staged
        tensors and the version the engine holds (None before the first refit).
        """
        if getattr(self, "_rlplane_engine", None) is not None:
            raise ConfigError("rlplane_connect: this worker is already connected; call rlplane_close first")
        if index is None and socket is None:
            if os.environ.get("RLPLANE_SOCKET"):
                _, world = self._rlplane_tp() if _vllm_importable() else (0, 1)
                if world > 1:
                    raise ConfigError(
                        f"RLPLANE_SOCKET names one socket but this engine has {world} tensor-parallel workers, each "
                        "needing its own: unset RLPLANE_SOCKET and set RLPLANE_IPC_DIR (engine-<tp rank>.sock), or "
                        "pass socket=… per worker"
                    )
            else:
                index, _ = self._rlplane_tp()
        engine = Engine(socket, timeout=timeout_s, index=index)
        try:
            from .torch import staged_tensors

            device = self._rlplane_worker_device()
            ordinal = device.index if device is not None and getattr(device, "type", None) == "cuda" else None
            views = staged_tensors(engine, device=ordinal)
            held = engine.version().version
        except BaseException:
            engine.close()
            raise
        self._rlplane_engine = engine
        self._rlplane_views = views
        return {"rank": engine.info.rank.name, "socket": engine.socket_path, "tensors": len(views), "version": held}

    def _rlplane_require(self) -> Engine:
        engine: Engine | None = getattr(self, "_rlplane_engine", None)
        if engine is None:
            raise ConfigError("this vLLM worker is not connected to rlplane: call llm.collective_rpc('rlplane_connect') first")
        return engine

    def rlplane_update_weights(self, version: int, timeout_s: float | None = 60.0, process_after_loading: bool = False) -> int:
        """Loads weights of ``version`` (or later) from the sidecar's staging buffers into the
        model, and returns the version loaded.

        Acquires the staging buffers, streams them through ``model.load_weights`` (which fuses
        and shards for this worker), waits for the copies to finish, and releases the buffers —
        also when loading fails. ``process_after_loading`` then runs vLLM's
        ``process_weights_after_loading`` (needed for quantized models that repack weights).
        """
        engine = self._rlplane_require()
        model = self.model_runner.model  # type: ignore[attr-defined]
        held = engine.acquire_staged(version, timeout_s)
        try:
            model.load_weights(weights=iter(self._rlplane_views.items()))
            _synchronize(self._rlplane_worker_device())
        finally:
            engine.release_staged()
        if process_after_loading:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            process_weights_after_loading(model, self.model_config, self._rlplane_worker_device())  # type: ignore[attr-defined]
        return held

    def rlplane_version(self) -> int | None:
        """The version the sidecar's engine rank holds (None before the first refit)."""
        return self._rlplane_require().version().version

    def rlplane_close(self) -> None:
        """Says bye to the sidecar and forgets the staging views."""
        engine = getattr(self, "_rlplane_engine", None)
        self._rlplane_engine = None
        self._rlplane_views = {}
        if engine is not None:
            engine.close()


def _vllm_importable() -> bool:
    try:
        import vllm.distributed.parallel_state  # noqa: F401
    except ImportError:
        return False
    return True


def _synchronize(device: Any) -> None:
    if device is None or getattr(device, "type", None) != "cuda":
        return
    import torch

    torch.cuda.synchronize(device)
