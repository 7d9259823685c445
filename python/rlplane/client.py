"""The trainer's and the engine's clients of the rlplane sidecar (docs/local-api.md)."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from . import _wire
from ._version import __version__
from .columns import Batch, ColumnInput, decode_batch, encode_columns
from .dtypes import numpy_dtype, wire_dtype
from .errors import ConfigError, FailedError, InvalidError, ProtocolError, RlplaneError, ShutdownError
from .info import Info, PublishResult, PutResult, RegisterResult, Step, VersionInfo
from .shm import Arena, Mappings, shm_dir

__all__ = ["Trainer", "Engine", "Client", "Tensor"]

#: A tensor the client can register: a numpy array allocated with ``alloc`` (or any array in the
#: client's shared memory), or a torch tensor (see :mod:`rlplane.torch`).
Tensor = Any


def _timeout_fields(t: float | None) -> dict[str, int | float]:
    """``timeout_s`` for the wire: left out for None (wait as long as it takes); an integer when
    whole, else fractional seconds."""
    if t is None:
        return {}
    if not t >= 0 or t == float("inf"):
        raise InvalidError(f"a timeout must be a finite number of seconds ≥ 0 (or None: no deadline), not {t}")
    return {"timeout_s": int(t) if float(t).is_integer() else float(t)}


def _is_torch(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


class Client:
    """What the trainer's and the engine's clients share: connection, hello, shared memory,
    weight registration, failure and shutdown. Use :class:`Trainer` or :class:`Engine`.

    Args:
        socket: the socket's path; default ``$RLPLANE_SOCKET``, else
            ``$RLPLANE_IPC_DIR/<role>-<index>.sock``.
        timeout: seconds to wait for the sidecar's socket to accept (it may start later).
        index: this rank's local index among the pod's ranks of its role; default
            ``$LOCAL_RANK`` or 0.

    Raises:
        ConfigError: the socket cannot be found (neither variable set) or opened.
        TimeoutError: no sidecar answered within ``timeout``.
        BusyError: another process holds this rank's socket.
        ProtocolError: the sidecar speaks another protocol version.
    """

    role: ClassVar[str] = ""

    def __init__(self, socket: str | None = None, *, timeout: float = 120.0, index: int | None = None) -> None:
        path = _wire.socket_path(self.role, socket, index)
        self._attach(_wire.connect(path, timeout))

    def _attach(self, conn: _wire.Connection, session: str | None = None) -> None:
        """Says hello on a connected socket (in ``session``, if given) and sets the client up."""
        self._conn = conn
        try:
            extra = {} if session is None else {"session": session}
            reply = self._conn.call(
                "hello", protocol=_wire.PROTOCOL, role=self.role, client=f"rlplane-python/{__version__}", **extra
            )
            if reply.get("protocol") != _wire.PROTOCOL:
                raise ProtocolError(
                    f"the sidecar answered protocol {reply.get('protocol')!r}; this client speaks {_wire.PROTOCOL}: "
                    "install the rlplane Python package of the sidecar's release",
                    op="hello",
                )
            self._info = Info.from_wire(reply)
            # A rollouts session (an engine's driver) touches no GPU memory: nothing to check,
            # and no CUDA initialised in a process that may fork its workers afterwards.
            if self._info.gpu is not None and session != "rollouts":
                uuids = _visible_gpu_uuids()
                if uuids is not None:
                    # The sidecar opens this process's CUDA memory on its rank's GPU: both must
                    # see that GPU (a mismatch fails the rank, saying what each side sees).
                    self._conn.call("check_gpus", uuids=uuids)
        except BaseException:
            self._conn.close()
            raise
        self._lock = threading.RLock()
        self._arena: Arena | None = None
        self._scratch: Arena | None = None
        self._mappings = Mappings()
        self._registered: dict[str, Any] = {}
        self._keepalive: list[Any] = []
        self._cuda_devices: set[int] = set()
        self._closed = False

    # -- what the sidecar said --------------------------------------------------------------

    @property
    def info(self) -> Info:
        """The sidecar's hello reply: rank, job, device, the model's tensors."""
        return self._info

    @property
    def socket_path(self) -> str:
        """The socket this client is connected to."""
        return self._conn.path

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called or the sidecar closed the connection."""
        return self._closed or self._conn.closed

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        if self._closed:
            raise ShutdownError("the client is closed; create a new one", op=op)
        return self._conn.call(op, **fields)

    # -- shared memory ----------------------------------------------------------------------

    @property
    def arena(self) -> Arena:
        """The shared memory holding this client's registered arrays (created on first use).

        ``arena.close()`` frees it (removes its files; e.g. when offloading the weights); the
        next :meth:`alloc` then opens a new arena, whose arrays are registered again with
        :meth:`register`. The sidecar keeps its own mapping of the old files until then.
        """
        with self._lock:
            # A closed client keeps its closed arena: nothing new is created after close().
            if self._arena is None or (self._arena.closed and not self._closed):
                self._arena = Arena(self._info.job.name, self._info.rank.name, shm_dir(self._info.shm_dir))
            return self._arena

    def _scratch_arena(self) -> Arena:
        with self._lock:
            if self._scratch is None:
                self._scratch = Arena(
                    self._info.job.name, self._info.rank.name + "-put", shm_dir(self._info.shm_dir), min_file_bytes=4 << 20
                )
            return self._scratch

    def alloc(self, name: str, dtype: str | None = None, shape: Sequence[int] | None = None) -> np.ndarray:
        """A zeroed array in shared memory for tensor ``name``, to fill and then :meth:`register`.

        ``dtype`` (a protocol dtype name) and ``shape`` default to the model's tensor of that name
        (its ``shard_shape``: what this rank holds). ``bf16`` and ``fp8e4m3`` arrays hold raw bits
        (``uint16``, ``uint8``).
        """
        spec = self._info.weights_by_name.get(name)
        if dtype is None or shape is None:
            if spec is None:
                raise InvalidError(
                    f"the job's model has no tensor {name!r}: pass dtype and shape, or use the model's name "
                    f"(e.g. {', '.join(w.name for w in self._info.weights[:3])})",
                    op="alloc",
                )
            if shape is None and spec.shard_shape is None:
                raise InvalidError(f"this rank holds no part of {name!r} (no shard_shape); nothing to allocate", op="alloc")
        dtype_name = dtype if dtype is not None else spec.dtype  # type: ignore[union-attr]
        dims = tuple(shape) if shape is not None else spec.shard_shape  # type: ignore[union-attr]
        assert dims is not None
        return self.arena.array(numpy_dtype(dtype_name), dims)

    # -- weights ----------------------------------------------------------------------------

    def _describe(self, name: str, tensor: Tensor, hint: str | None, keep: list[Any], devices: set[int]) -> dict[str, Any]:
        what = f"tensor {name!r}"
        if _is_torch(tensor):
            from .torch import describe_tensor

            entry = describe_tensor(self, name, tensor)
            if entry["memory"]["kind"] == "cuda_ipc":
                # Keep the storage itself: even if the tensor is re-pointed, the registered bytes
                # stay allocated (not reused) until the next register or close.
                keep.append(tensor.untyped_storage())
                devices.add(int(tensor.device.index or 0))
            return entry
        if not isinstance(tensor, np.ndarray):
            raise InvalidError(
                f"{what} is a {type(tensor).__name__}; register numpy arrays from .alloc(...) or torch tensors",
                op="register_weights",
            )
        return {
            "name": name,
            "dtype": wire_dtype(tensor.dtype, hint),
            "shape": [int(d) for d in tensor.shape],
            "memory": self.arena.describe(tensor, what),
        }

    def register(self, tensors: Mapping[str, Tensor], name_map: Mapping[str, str] | None = None) -> RegisterResult:
        """Registers the rank's tensors with the sidecar, in place (``register_weights``, direct).

        A trainer registers its shard of every tensor of the model; refit streams from these bytes
        at each :meth:`Trainer.publish`. An engine in direct mode registers a destination for
        every tensor; refit overwrites them in place.

        ``tensors`` maps names (the model's, or the process's own with ``name_map`` mapping them to
        the model's) to numpy arrays allocated with :meth:`alloc` or torch tensors (CPU tensors in
        this client's shared memory, contiguous CUDA tensors; :func:`rlplane.torch.register_model`
        moves a model's CPU parameters there). The client keeps references to them, so they stay
        alive and in place until registered again or closed.

        Raises:
            MismatchError: names, dtypes or shapes differ from the model's (all listed).
            InvalidError: an array is not in this client's shared memory, or not contiguous.
            StateError: a refit is under way.
        """
        name_map = dict(name_map or {})
        specs = self._info.weights_by_name
        entries = []
        keep: list[Any] = []
        devices: set[int] = set()
        with self._lock:
            for name, tensor in tensors.items():
                spec = specs.get(name_map.get(name, name))
                entries.append(self._describe(name, tensor, spec.dtype if spec else None, keep, devices))
            fields: dict[str, Any] = {"mode": "direct", "tensors": entries}
            if name_map:
                fields["name_map"] = name_map
            reply = self._call("register_weights", **fields)
            self._registered = dict(tensors)
            self._keepalive = keep
            self._cuda_devices = devices
        return RegisterResult(tensors=int(reply.get("tensors", len(entries))), bytes=int(reply.get("bytes", 0)), raw=reply)

    def _sync_cuda(self) -> None:
        """Waits for queued GPU work on the registered tensors' devices, so the sidecar reads or
        writes settled bytes."""
        if not self._cuda_devices:
            return
        import torch

        for d in sorted(self._cuda_devices):
            torch.cuda.synchronize(d)

    # -- scalars ----------------------------------------------------------------------------

    def report_scalars(self, step: int | Any, values: Mapping[str, float]) -> None:
        """Reports scalars of ``step`` about the run's learning — reward, KL, loss, lengths —
        for the job's ``/metrics`` (``rlplane_step_scalar{name=…}``), its dashboard and
        ``status.scalars``. Each name's value is the mean over the ranks that report it.

        Call it while the step is under way: a trainer before ``publish(step)``, an engine before
        ``end_step(step)`` (an engine's driver in a ``rollouts`` session). Reporting a name again
        in the same step replaces its value.

        Raises:
            InvalidError: a name is not letters, digits and ``_`` (at most 64), a value is not a
                finite number, or more than 32 names in a step.
            StateError: ``step`` is not the step under way.
        """
        step_no = getattr(step, "step", step)
        if isinstance(step_no, bool) or not isinstance(step_no, (int, np.integer)):
            raise InvalidError(f"step must be an integer, not {step!r}", op="report_scalars")
        wire: dict[str, float] = {}
        for k, v in values.items():
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise InvalidError(f"values[{k!r}]: {v!r} is not a number", op="report_scalars") from None
            if not math.isfinite(x):
                raise InvalidError(f"values[{k!r}]: {x} is not a finite number", op="report_scalars")
            wire[str(k)] = x
        self._call("report_scalars", step=int(step_no), values=wire)

    # -- failure and shutdown ---------------------------------------------------------------

    def fail(self, message: str) -> None:
        """Fails this rank's command with ``message`` (the job restarts its gang).

        The connection may be closed by the sidecar afterwards; a :class:`ShutdownError` in
        answer is not raised, since the rank is failing anyway.
        """
        try:
            self._call("fail", message=str(message)[:65536])
        except ShutdownError:
            pass

    def close(self) -> None:
        """Says ``bye`` and closes the connection, and removes this client's shared-memory files.

        Arrays from :meth:`alloc` (and model parameters moved to shared memory) stay usable.
        """
        if self._closed:
            return
        try:
            if not self._conn.closed:
                try:
                    self._conn.call("bye")
                except ShutdownError:
                    pass
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        self._conn.close()
        for arena in (self._arena, self._scratch):
            if arena is not None:
                arena.close()
        self._mappings.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        # Leaving on an exception: tell the sidecar why (better than a closed socket), unless the
        # failure came from the sidecar itself.
        try:
            if not isinstance(exc, (FailedError, ShutdownError)) and not self._conn.closed and not self._closed:
                self.fail(f"{exc_type.__name__ if exc_type else 'error'}: {exc}")
        except (RlplaneError, OSError):
            pass
        finally:
            self._shutdown()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self._conn.path
        return f"{type(self).__name__}({self._info.rank.name!r} of {self._info.job.name!r}, {state})"


class Trainer(Client):
    """A trainer rank's client.

    ::

        with rlplane.Trainer() as trainer:
            resume = trainer.info.job.resume                # None at the first start
            if resume:
                load(model, optimizer, resume.uri)          # the user's own checkpoint format
            rlplane.torch.register_model(trainer, model)   # or trainer.register({...})
            trainer.publish(trainer.initial_version)        # 0, or the restored checkpoint's step
            for batch in trainer.batches():
                loss = train_step(model, batch)
                if trainer.checkpoint_due(batch.step):
                    path = save(model, optimizer, batch.step)
                    trainer.checkpoint_saved(batch.step, path)
                trainer.publish(batch.step)
    """

    role: ClassVar[str] = "trainer"

    def __enter__(self) -> Trainer:
        return self

    def publish(self, version: int) -> PublishResult:
        """Says the registered weights now hold ``version`` (the step they were trained on; 0 for
        the initial weights) and waits until every engine holds it.

        Pending GPU work on registered CUDA tensors is waited for first.

        Raises:
            StateError: ``version`` is not the job's current step.
            FailedError, TimeoutError: the refit failed or ran past its deadline.
        """
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise InvalidError(f"version must be an integer step, not {version!r}", op="publish")
        self._sync_cuda()
        reply = self._call("publish", version=int(version))
        return PublishResult(
            version=int(reply.get("version", version)),
            refit_s=float(reply.get("refit_s", 0.0)),
            bytes=int(reply.get("bytes", 0)),
            raw=reply,
        )

    @property
    def initial_version(self) -> int:
        """The version of the first ``publish``: 0 (the initial weights), or, in an epoch that
        resumes from a checkpoint, that checkpoint's step (the weights restored from it)."""
        resume = self._info.job.resume
        return resume.version if resume else 0

    def checkpoint_due(self, step: int) -> bool:
        """Whether the job wants a checkpoint of the trainer's state after ``step``
        (``spec.checkpoint.everySteps``; never when it is 0)."""
        every = self._info.job.checkpoint_every
        return every > 0 and step > 0 and step % every == 0

    def checkpoint_saved(self, step: int, uri: str) -> None:
        """Reports that the trainer's state after ``step`` (model, optimizer, whatever it needs
        to go on) is saved at ``uri``. rlplane never reads it: a gang restart resumes the job after
        the newest checkpoint reported, and hands ``uri`` back in ``info.job.resume``. Call it
        before ``publish(step)`` so that the report travels with that step's update.

        Raises:
            InvalidError: ``uri`` is empty or longer than 4096 bytes.
            StateError: ``step`` is not a step this trainer has trained.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise InvalidError(f"step must be an integer, not {step!r}", op="checkpoint_saved")
        if not isinstance(uri, str) or not uri:
            raise InvalidError(f"uri must be a non-empty string, not {uri!r}", op="checkpoint_saved")
        self._call("checkpoint_saved", step=int(step), uri=uri)

    def next_batch(self) -> Batch | None:
        """Waits for this rank's batch of the next step; None when the job has ended.

        The batch's arrays are read-only views of the sidecar's batch file, valid until the next
        call of ``next_batch``.
        """
        reply = self._call("next_batch")
        # Each step's batch is a new file (the sidecar removes the last one): forget the old
        # mappings so their memory goes once the caller drops the old arrays.
        self._mappings.clear()
        if reply.get("done"):
            return None
        return decode_batch(reply, self._mappings)

    def batches(self) -> Iterator[Batch]:
        """Every batch until the job ends."""
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            yield batch


class Engine(Client):
    """An engine (generation) rank's client.

    ::

        with rlplane.Engine() as engine:
            views = engine.register_staged()           # or engine.register({...}) (direct)
            for step in engine.steps():
                with engine.staged(step.version):
                    load(views)                        # copy the weights into the engine
                rollouts = generate(...)
                engine.put(step, {"input_ids": [...], "reward": np.array([...])})
    """

    role: ClassVar[str] = "engine"

    #: ``session`` values: every call (default), or one half of the rank.
    SESSIONS: ClassVar[tuple[str, ...]] = ("all", "rollouts", "weights")

    def __init__(
        self,
        socket: str | None = None,
        *,
        timeout: float = 120.0,
        index: int | None = None,
        session: str | None = None,
        engine: int | None = None,
        tp_rank: int = 0,
        tensor_parallel: int | None = None,
    ) -> None:
        """Connects to an engine rank's socket.

        Besides the arguments of :class:`Client`:

        Args:
            session: ``"all"`` (default): this process does everything the rank does.
                ``"rollouts"``: only steps and puts (``next_step``, ``put``, ``end_step``), on the
                engine's tensor-parallel rank 0 — an engine's driver process. ``"weights"``: only
                registration and staged loads — a tensor-parallel worker. A rank takes one
                rollouts and one weights session at once, so a vLLM driver and its workers share
                it (``rlplane.vllm``).
            engine: pick the socket by engine instead of ``index``: the pod's ``engine``-th engine
                (from 0; default ``$RLPLANE_ENGINE`` when neither ``index`` nor a socket is
                given), its rank ``tp_rank``; see :func:`rlplane._wire.engine_socket_index`.
                The sidecar's answer is checked to be that tensor-parallel rank.
            tensor_parallel: the engines' tensor-parallel size (default
                ``$RLPLANE_ENGINE_TENSOR_PARALLEL``).

        Raises:
            ConfigError: ``session`` is unknown, or the socket is not the rank asked for.
        """
        if session is not None and session not in self.SESSIONS:
            raise ConfigError(f"session={session!r}; use one of {', '.join(self.SESSIONS)}")
        env_engine = os.environ.get("RLPLANE_ENGINE", "")
        if engine is None and index is None and socket is None and not os.environ.get("RLPLANE_SOCKET") and env_engine:
            try:
                engine = int(env_engine)
            except ValueError:
                raise ConfigError(f"RLPLANE_ENGINE={env_engine!r} is not a number (the engine's index in its pod)") from None
        if engine is not None and index is None and socket is None:
            index = _wire.engine_socket_index(engine, tp_rank, tensor_parallel)
        else:
            engine = None
        path = _wire.socket_path(self.role, socket, index)
        self._attach(_wire.connect(path, timeout), session)
        held = self._info.rank.engine_rank
        if engine is not None and held is not None and held != tp_rank:
            got = self._info.rank.name
            self._shutdown()
            raise ConfigError(
                f"{path} is {got}, tensor-parallel rank {held} of its engine, not rank {tp_rank} of the pod's engine {engine}: "
                "is RLPLANE_ENGINE_TENSOR_PARALLEL (or tensor_parallel=) the job's spec.generation.tensorParallel?"
            )

    def _attach(self, conn: _wire.Connection, session: str | None = None) -> None:
        super()._attach(conn, session)
        self._open_step: int | None = None
        self._staging: list[dict[str, Any]] = []
        self._staging_views: dict[str, Any] = {}
        self._staging_maps = Mappings()

    def __enter__(self) -> Engine:
        return self

    # -- weights ----------------------------------------------------------------------------

    def register_staged(self) -> dict[str, Any]:
        """Registers in staged mode: the sidecar receives refits into its own buffers, and this
        returns them mapped here, by the model's tensor names: numpy arrays (read-only) for shared
        memory, torch CUDA tensors for CUDA IPC (needs torch).

        Load them into the engine between :meth:`acquire_staged` and :meth:`release_staged`.
        """
        with self._lock:
            reply = self._call("register_weights", mode="staged", tensors=[])
            staging = reply.get("staging")
            if not isinstance(staging, list):
                raise ProtocolError("the staged register_weights reply has no `staging` list", op="register_weights")
            views: dict[str, Any] = {}
            for s in staging:
                try:
                    name, dtype_name, shape, memory = s["name"], s["dtype"], [int(d) for d in s["shape"]], s["memory"]
                except (KeyError, TypeError, ValueError):
                    raise ProtocolError(f"a staging entry lacks name, dtype, shape or memory: {s}", op="register_weights") from None
                kind = memory.get("kind") if isinstance(memory, dict) else None
                if kind == "shm":
                    views[name] = self._staging_maps.array(memory, numpy_dtype(dtype_name), shape, f"staging buffer {name!r}")
                elif kind == "cuda_ipc":
                    from .torch import open_cuda_ipc

                    views[name] = open_cuda_ipc(memory, dtype_name, shape)
                else:
                    raise ProtocolError(f"staging buffer {name!r} has a memory descriptor of unknown kind {kind!r}", op="register_weights")
            self._staging = staging
            self._staging_views = views
            return dict(views)

    @property
    def staging(self) -> dict[str, Any]:
        """The staging views of the last :meth:`register_staged` (empty before)."""
        return dict(self._staging_views)

    def version(self) -> VersionInfo:
        """The weights this engine holds now."""
        return _version_info(self._call("version"))

    def wait_version(self, version: int, timeout: float | None = 60.0) -> VersionInfo:
        """Waits until this engine holds ``version`` (or later); ``timeout=None`` waits as long as
        it takes (the job's own deadlines still apply).

        Raises:
            TimeoutError: not within ``timeout`` seconds.
            FailedError: a refit failed part-way (the weights are a mix and are never handed out).
        """
        return _version_info(self._call("wait_version", version=int(version), **_timeout_fields(timeout)))

    def newer_weights(self, than: int | None) -> int | None:
        """The version of weights newer than ``than`` that are ready to take, or None: "new weights
        are ready, take them now". Registered staged, they are in the staging buffers (take them
        with :meth:`staged`: at the next step's start, or inside a step when the job allows partial
        rollouts, ``spec.schedule.partialRollouts``); registered direct, refit has written them
        already (between steps). Never waits."""
        held = self.version().version
        return held if held is not None and (than is None or held > than) else None

    def acquire_staged(self, version: int, timeout: float | None = 60.0) -> int:
        """Waits until the staging buffers hold ``version`` (or later) and no refit is writing
        them, and lends them to this process; returns the version they hold. The next refit waits
        for :meth:`release_staged`."""
        reply = self._call("acquire_staged", version=int(version), **_timeout_fields(timeout))
        return int(reply.get("version", version))

    def release_staged(self) -> None:
        """Gives the staging buffers back to the sidecar."""
        self._call("release_staged")

    @contextlib.contextmanager
    def staged(self, version: int, timeout: float | None = 60.0) -> Iterator[int]:
        """``with engine.staged(v) as held:`` acquires the staging buffers (version ``held`` ≥ v)
        and releases them when the block ends, also on an exception."""
        held = self.acquire_staged(version, timeout)
        try:
            yield held
        finally:
            if not self.closed:
                self.release_staged()

    # -- rollouts ---------------------------------------------------------------------------

    def next_step(self) -> Step | None:
        """Waits until the coordinator starts the next step's generation; None when the job ended.

        Only an engine's producer rank (``info.rank.producer``) calls it.
        """
        reply = self._call("next_step")
        if reply.get("done"):
            self._open_step = None
            return None
        try:
            step = Step(step=int(reply["step"]), version=None if reply.get("version") is None else int(reply["version"]))
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"the next_step reply lacks `step`: {reply}", op="next_step") from None
        self._open_step = step.step
        return step

    def steps(self) -> Iterator[Step]:
        """Every step until the job ends; ends the previous step (``end_step``) before asking for
        the next one if the loop did not."""
        while True:
            if self._open_step is not None:
                self.end_step(self._open_step)
            step = self.next_step()
            if step is None:
                return
            yield step

    def put(
        self,
        step: int | Step,
        columns: Mapping[str, ColumnInput],
        keys: Sequence[str] | None = None,
        tokens: Sequence[int] | npt.ArrayLike | None = None,
        tags: Sequence[Mapping[str, str] | Sequence[tuple[str, str]]] | None = None,
        *,
        dtypes: Mapping[str, str] | None = None,
    ) -> PutResult:
        """Puts rollouts of ``step`` into the transfer queue.

        ``columns`` maps a field name to a list of per-sample arrays (a ragged column: a 1-D
        array of tokens per sample, or ``[rows, *inner]``) or to one array of ``n`` rows (a fixed
        column: ``[n]`` scalars or ``[n, *inner]``). numpy arrays, torch tensors and nested lists
        are accepted; ``dtypes`` names a column's dtype when the array's does not (``bf16`` given
        as ``uint16`` bits) or casts. ``keys`` default to ``s<step>-e<engine>-<n>``; ``tokens``
        (balancing weights) to each sample's rows of ``input_ids``, or 1; ``tags`` are per-sample
        ``{key: value}`` (or lists of pairs).

        The bytes are written to this client's shared memory; the sidecar copies them out before
        it answers. May be called several times per step.
        """
        step_no = step.step if isinstance(step, Step) else int(step)
        with self._lock:
            scratch = self._scratch_arena()
            scratch.reset()
            wire, n = encode_columns(scratch, columns, dtypes)
            fields: dict[str, Any] = {"step": step_no, "columns": wire}
            if keys is not None:
                keys = [str(k) for k in keys]
                if len(keys) != n:
                    raise InvalidError(f"{len(keys)} keys for {n} samples", op="put")
                fields["keys"] = keys
            if tokens is not None:
                toks = [int(t) for t in np.asarray(tokens).reshape(-1)]
                if len(toks) != n:
                    raise InvalidError(f"{len(toks)} token counts for {n} samples", op="put")
                fields["tokens"] = toks
            if tags is not None:
                if len(tags) != n:
                    raise InvalidError(f"{len(tags)} tag sets for {n} samples", op="put")
                fields["tags"] = [_tag_pairs(t, i) for i, t in enumerate(tags)]
            reply = self._call("put", **fields)
        return PutResult(samples=int(reply.get("samples", n)), bytes=int(reply.get("bytes", 0)), raw=reply)

    def end_step(self, step: int | Step) -> None:
        """Says this engine's rollouts for ``step`` are all put."""
        step_no = step.step if isinstance(step, Step) else int(step)
        self._call("end_step", step=step_no)
        if self._open_step == step_no:
            self._open_step = None


def _visible_gpu_uuids() -> list[str] | None:
    """The GPUs this process sees (UUIDs, through torch), or None when torch cannot say (not
    installed, or too old to report UUIDs)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
    except (AttributeError, RuntimeError):
        return None


def _tag_pairs(tags: Mapping[str, str] | Sequence[tuple[str, str]], i: int) -> list[list[str]]:
    items = tags.items() if isinstance(tags, Mapping) else tags
    out = []
    for pair in items:
        try:
            k, v = pair
        except (TypeError, ValueError):
            raise InvalidError(f"tags of sample {i}: {pair!r} is not a (key, value) pair", op="put") from None
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidError(f"tags of sample {i}: keys and values must be strings, got {k!r}: {v!r}", op="put")
        out.append([k, v])
    return out


def _version_info(reply: Mapping[str, Any]) -> VersionInfo:
    v = reply.get("version")
    return VersionInfo(version=None if v is None else int(v), state=str(reply.get("state", "")))
