"""rlplane for vLLM: a worker extension that loads refits in every tensor-parallel worker, and
the driver's session that takes the engine's steps and puts its rollouts.

vLLM runs one *driver* process (where ``LLM`` lives and the user's generation loop runs) and, with
tensor parallelism, one *worker* process per GPU. An rlplane engine of ``tensorParallel: N`` has N
ranks, each with a socket; both kinds of process use them, each in its own session:

- every worker opens a ``weights`` session on its own rank (``rlplane_connect``) and loads each
  version the driver asks for (``rlplane_update_weights``);
- the driver opens a ``rollouts`` session on the engine's rank 0 (:func:`connect_driver`) and
  takes steps and puts rollouts there.

::

    from vllm import LLM
    import rlplane.vllm

    llm = LLM(model=..., tensor_parallel_size=2, worker_extension_cls="rlplane.vllm.RlplaneWorkerExtension")
    llm.collective_rpc("rlplane_connect")                 # each worker: its rank's weights session
    with rlplane.vllm.connect_driver() as engine:         # the driver: engine rank 0's rollouts session
        for step in engine.steps():
            llm.collective_rpc("rlplane_update_weights", args=(step.version or 0, 60.0))
            outputs = llm.generate(prompts, sampling)
            engine.put(step, {...})

A pod may run several engines (``spec.generation.gpusPerNode`` a multiple of
``tensorParallel``), one vLLM instance each: set ``RLPLANE_ENGINE=<k>`` (the engine's index in
the pod, from 0) in the environment of instance *k*, or pass ``engine=k`` to both calls. The
engine's rank *r* is socket ``engine-<k·N + r>.sock``; rlplane sets ``RLPLANE_ENGINE_TENSOR_PARALLEL``
(N) in the engine's containers, and each connection checks it reached the rank it meant.

The engine ranks register in **staged** mode: the sidecar receives each refit into its own
buffers (CUDA IPC or shared memory), and ``rlplane_update_weights`` loads them through the
model's ``load_weights``, which fuses q/k/v and gate/up projections and shards for this worker's
tensor-parallel rank — so the sidecar ships the model's plain (Hugging Face) tensors.

Nothing here imports vLLM at module level; the tensor-parallel rank and size are read from
``vllm.distributed`` when ``rlplane_connect`` is not given an index.
"""

from __future__ import annotations

import os
from typing import Any

from .client import Engine
from .errors import ConfigError

__all__ = ["RlplaneWorkerExtension", "connect_driver"]


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

    def rlplane_connect(
        self,
        socket: str | None = None,
        index: int | None = None,
        timeout_s: float = 120.0,
        engine: int | None = None,
    ) -> dict[str, Any]:
        """Connects this worker to its rank's sidecar socket in a ``weights`` session and
        registers in staged mode.

        The socket is ``socket`` if given, else ``$RLPLANE_SOCKET`` (a one-worker engine), else
        ``$RLPLANE_IPC_DIR/engine-<index>.sock``; ``index`` defaults to this worker's rank in the
        pod's engine ``engine`` (default ``$RLPLANE_ENGINE``, else 0): ``engine · TP + tp rank``.
        Returns a summary: the rank's name, the socket, the number of staged tensors and the
        version the engine holds (None before the first refit).
        """
        if getattr(self, "_rlplane_engine", None) is not None:
            raise ConfigError("rlplane_connect: this worker is already connected; call rlplane_close first")
        kwargs: dict[str, Any] = {}
        if index is None and socket is None:
            if os.environ.get("RLPLANE_SOCKET"):
                _, world = self._rlplane_tp() if _vllm_importable() else (0, 1)
                if world > 1:
                    raise ConfigError(
                        f"RLPLANE_SOCKET names one socket but this engine has {world} tensor-parallel workers, each "
                        "needing its own: unset RLPLANE_SOCKET and set RLPLANE_IPC_DIR (engine-<index>.sock), or "
                        "pass socket=… per worker"
                    )
            else:
                rank, world = self._rlplane_tp()
                kwargs = {"engine": _engine_index(engine), "tp_rank": rank, "tensor_parallel": world}
        engine_client = Engine(socket, timeout=timeout_s, index=index, session="weights", **kwargs)
        try:
            from .torch import staged_tensors

            device = self._rlplane_worker_device()
            ordinal = device.index if device is not None and getattr(device, "type", None) == "cuda" else None
            views = staged_tensors(engine_client, device=ordinal)
            held = engine_client.version().version
        except BaseException:
            engine_client.close()
            raise
        self._rlplane_engine = engine_client
        self._rlplane_views = views
        return {
            "rank": engine_client.info.rank.name,
            "socket": engine_client.socket_path,
            "tensors": len(views),
            "version": held,
        }

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


def connect_driver(
    engine: int | None = None,
    tensor_parallel: int | None = None,
    socket: str | None = None,
    timeout: float = 120.0,
) -> Engine:
    """The driver's client: a ``rollouts`` session on rank 0 of the pod's engine ``engine``
    (default ``$RLPLANE_ENGINE``, else 0), for ``steps()``, ``put`` and ``end_step``; the
    workers hold the weights sessions. ``tensor_parallel`` defaults to
    ``$RLPLANE_ENGINE_TENSOR_PARALLEL``; ``socket`` names the socket instead.
    """
    if socket is not None:
        return Engine(socket, timeout=timeout, session="rollouts")
    return Engine(timeout=timeout, session="rollouts", engine=_engine_index(engine), tensor_parallel=tensor_parallel)


def _engine_index(engine: int | None) -> int:
    if engine is not None:
        return int(engine)
    env = os.environ.get("RLPLANE_ENGINE", "") or "0"
    try:
        return int(env)
    except ValueError:
        raise ConfigError(f"RLPLANE_ENGINE={env!r} is not a number (the engine's index in its pod)") from None


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
