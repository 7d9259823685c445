"""What the sidecar tells the client: the hello reply and the results of calls, as dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolError

__all__ = [
    "RankInfo",
    "JobInfo",
    "WeightSpec",
    "Info",
    "RegisterResult",
    "PublishResult",
    "PutResult",
    "Step",
    "VersionInfo",
]


def _need(d: Mapping[str, Any], key: str, what: str) -> Any:
    if not isinstance(d, Mapping) or key not in d:
        raise ProtocolError(f"the sidecar's {what} lacks `{key}`; is this client older or newer than the sidecar?")
    return d[key]


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


@dataclass(frozen=True)
class RankInfo:
    """This rank, as the sidecar knows it (``rank`` in the hello reply).

    ``dp``, ``tp``, ``pp`` (a trainer rank's data-, tensor- and pipeline-parallel coordinates) and
    ``fsdp`` of ``fsdp_size`` (its index in its fully-sharded group, ``dp % fsdp_size``; size 1
    when the trainer does not shard over data) are None on an engine rank; ``engine`` and ``engine_rank`` (its engine and its tensor-parallel rank
    in it) are None on a trainer rank. ``local`` is the rank's index among its pod's ranks of the
    same role (what names its socket).
    """

    name: str
    role: str
    rank: int
    dp: int | None
    tp: int | None
    pp: int | None
    fsdp: int | None
    fsdp_size: int | None
    leader: bool
    engine: int | None
    engine_rank: int | None
    producer: bool
    local: int

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> RankInfo:
        """Parses the hello reply's ``rank``."""
        w = "hello reply's rank"
        return cls(
            name=str(_need(d, "name", w)),
            role=str(_need(d, "role", w)),
            rank=int(_need(d, "rank", w)),
            dp=_opt_int(d.get("dp")),
            tp=_opt_int(d.get("tp")),
            pp=_opt_int(d.get("pp")),
            fsdp=_opt_int(d.get("fsdp")),
            fsdp_size=_opt_int(d.get("fsdp_size")),
            leader=bool(d.get("leader", False)),
            engine=_opt_int(d.get("engine")),
            engine_rank=_opt_int(d.get("engine_rank")),
            producer=bool(d.get("producer", False)),
            local=int(d.get("local", 0)),
        )


@dataclass(frozen=True)
class Resume:
    """The checkpoint a restarted job resumes from (``job.resume`` in the hello reply).

    Attributes:
        step: the step whose state the checkpoint holds; the job's steps go on after it.
        version: the weights version to publish first (the restored weights): equal to ``step``.
        uri: where the trainer saved it, as it reported (``Trainer.checkpoint_saved``).
    """

    step: int
    version: int
    uri: str

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Resume:
        """Parses the hello reply's ``job.resume``."""
        w = "hello reply's job.resume"
        step = int(_need(d, "step", w))
        return cls(step=step, version=int(d.get("version", step)), uri=str(_need(d, "uri", w)))


@dataclass(frozen=True)
class JobInfo:
    """The job (``job`` in the hello reply).

    Attributes:
        name, namespace: the RLJob's.
        epoch: 0 at the first start, +1 at every gang restart.
        steps: the job's last step.
        checkpoint_every: ``spec.checkpoint.everySteps`` (0: the job takes no checkpoints).
        resume: the checkpoint this epoch resumes from, or None when it starts at step 1.
        first_step: the first step this epoch runs (1, or the step after ``resume``).
        max_policy_lag: how many versions behind the previous step's weights a step's rollouts
            may have been generated (``spec.schedule``; 0: synchronous, each step generated with
            the weights of the step before).
    """

    name: str
    namespace: str
    epoch: int
    steps: int
    checkpoint_every: int = 0
    resume: Resume | None = None
    first_step: int = 1
    max_policy_lag: int = 0

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> JobInfo:
        """Parses the hello reply's ``job``."""
        w = "hello reply's job"
        resume = d.get("resume")
        return cls(
            name=str(_need(d, "name", w)),
            namespace=str(d.get("namespace", "")),
            epoch=int(d.get("epoch", 0)),
            steps=int(_need(d, "steps", w)),
            checkpoint_every=int(d.get("checkpoint_every", 0) or 0),
            resume=Resume.from_wire(resume) if resume else None,
            first_step=int(d.get("first_step", 1)),
            max_policy_lag=int(d.get("max_policy_lag", 0) or 0),
        )


@dataclass(frozen=True)
class WeightSpec:
    """One tensor of the job's model, in refit order.

    Attributes:
        name: the model's name for the tensor.
        dtype: the manifest's dtype name.
        shape: the full tensor's shape.
        shard_shape: what this rank holds (a trainer's tensor-/pipeline-parallel shard, the full
            tensor on an engine), or None where this rank holds none of it.
        shard_offset: where that part starts in the full tensor, along each dimension (a
            DTensor's global offset); None where this rank holds none of it, or from a sidecar
            that does not say.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...] | None
    shard_offset: tuple[int, ...] | None = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> WeightSpec:
        """Parses one entry of the hello reply's ``weights``."""
        w = "hello reply's weights entry"
        shard = d.get("shard_shape")
        offset = d.get("shard_offset")
        return cls(
            name=str(_need(d, "name", w)),
            dtype=str(_need(d, "dtype", w)),
            shape=tuple(int(x) for x in _need(d, "shape", w)),
            shard_shape=None if shard is None else tuple(int(x) for x in shard),
            shard_offset=None if offset is None else tuple(int(x) for x in offset),
        )

    @property
    def held(self) -> bool:
        """Whether this rank holds any of the tensor."""
        return self.shard_shape is not None


@dataclass(frozen=True)
class Info:
    """The sidecar's hello reply: who this rank is, the job, its device and the model.

    Attributes:
        protocol: the protocol version spoken (1).
        rank: this rank.
        job: the job.
        device: ``"cpu"`` or ``"gpu"``.
        gpu: the CUDA device ordinal the rank uses, as the worker sees it, when ``device`` is gpu.
        transport: the refit transport (``tcp``, ``cuda_ipc``, ``nccl``, …).
        shm_dir: where the sidecar expects shared-memory files.
        weights: the job's model in refit order.
        raw: the reply as received (fields this client does not know yet included).
    """

    protocol: int
    rank: RankInfo
    job: JobInfo
    device: str
    gpu: int | None
    transport: str
    shm_dir: str | None
    weights: tuple[WeightSpec, ...]
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Info:
        """Parses the hello reply."""
        w = "hello reply"
        gpu = d.get("gpu")
        ordinal = None
        if isinstance(gpu, Mapping):
            ordinal = _opt_int(gpu.get("ordinal"))
        elif gpu is not None:
            ordinal = int(gpu)
        try:
            return cls(
                protocol=int(_need(d, "protocol", w)),
                rank=RankInfo.from_wire(_need(d, "rank", w)),
                job=JobInfo.from_wire(_need(d, "job", w)),
                device=str(d.get("device", "cpu")),
                gpu=ordinal,
                transport=str(d.get("transport", "")),
                shm_dir=d.get("shm_dir"),
                weights=tuple(WeightSpec.from_wire(x) for x in _need(d, "weights", w)),
                raw=dict(d),
            )
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"the sidecar's hello reply has a field of the wrong type ({e})") from None

    def weight(self, name: str) -> WeightSpec:
        """The model tensor called ``name``.

        Raises:
            KeyError: the model has no such tensor (the message lists a few names it has).
        """
        for w in self.weights:
            if w.name == name:
                return w
        some = ", ".join(w.name for w in self.weights[:5])
        raise KeyError(f"the job's model has no tensor {name!r} (it has {len(self.weights)}: {some}, …)")

    @property
    def weights_by_name(self) -> dict[str, WeightSpec]:
        """The model's tensors by name."""
        return {w.name: w for w in self.weights}


@dataclass(frozen=True)
class RegisterResult:
    """Reply of ``register_weights``: how many tensors and bytes are registered."""

    tensors: int
    bytes: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class PublishResult:
    """Reply of ``publish``: every engine holds ``version``; the refit took ``refit_s`` seconds."""

    version: int
    refit_s: float
    bytes: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class PutResult:
    """Reply of ``put``: samples and bytes stored."""

    samples: int
    bytes: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Step:
    """A step of generation (reply of ``next_step``): generate rollouts for ``step`` with the
    weights of ``version`` (already the previous step's)."""

    step: int
    version: int | None

    def __int__(self) -> int:
        return self.step


@dataclass(frozen=True)
class VersionInfo:
    """The weights an engine holds: ``version`` (None before the first refit) and ``state``
    (``empty``, ``ready`` or ``incomplete``)."""

    version: int | None
    state: str
