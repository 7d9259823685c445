"""Declared layout mappings between a process's fused tensors and the job model's tensors.

The job's model (``spec.model``) names tensors the way the engine loads them, usually Hugging
Face's: separate ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``. Trainers and
engines often hold some of them fused along dimension 0:

- **concatenated** (``groups=1``): ``[q; k; v]`` (vLLM's ``qkv_proj``, many trainers' fused
  attention) or ``[gate; up]`` (Megatron-LM's ``linear_fc1``, vLLM's ``gate_up_proj``). Each part
  is a contiguous slice of the fused tensor, so the parts are registered as views of it: no copy,
  and refit reads or writes the fused tensor in place.
- **interleaved** (``groups=G``): Megatron-LM's ``linear_qkv`` holds, for each of its G query
  groups, that group's query heads, then its key head, then its value head. A part is then G
  strided pieces; it gets a buffer of its own, and :meth:`FusedLayout.to_parts` (a trainer,
  before ``publish``) or :meth:`FusedLayout.from_parts` (an engine in direct mode, after a
  version is loaded) copies between the two: a device copy of the fused tensor's bytes, and as
  much memory again.

Under tensor parallelism each rank's fused tensor holds its own rank's part of every part
(Megatron's layout: a rank's ``linear_qkv`` holds whole query groups, its ``linear_fc1`` its
gate rows then its up rows), which is what the model's ``tpSplit: Rows`` gives each part, so the
same declaration serves every rank. A trainer that shards over data (``fsdp`` > 1) cannot use it:
FSDP chunks the fused tensor's rows, not each part's; register the parts as separate parameters.

::

    layout = rlplane.fused.FusedLayout(trainer, model, [
        Fused("layers.0.linear_qkv.weight", ("model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"), groups=8),
        Fused("layers.0.linear_fc1.weight", ("model.layers.0.mlp.gate_proj.weight",
              "model.layers.0.mlp.up_proj.weight")),
    ])
    rlplane.torch.register_model(trainer, layout.tensors, name_map)
    ...
    layout.to_parts()          # only copies when a declaration is interleaved
    trainer.publish(step)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvalidError, MismatchError

if TYPE_CHECKING:
    import torch

    from .client import Client

__all__ = ["Fused", "FusedLayout"]


@dataclass(frozen=True)
class Fused:
    """One of the process's tensors that holds several of the model's tensors along dimension 0.

    ``name``: the process's tensor (a parameter name of the module given to :class:`FusedLayout`).
    ``parts``: the model's names (``spec.model``) of what it holds, in its order.
    ``groups``: 1 when the parts are concatenated; G when they are interleaved in G groups along
    dimension 0 (each part's rows split evenly among the groups, group by group).
    """

    name: str
    parts: Sequence[str]
    groups: int = 1


@dataclass
class _Mapped:
    """A fused tensor applied to this rank: where each part's rows lie."""

    fused: Fused
    tensor: Any
    groups: int  # groups on this rank
    rows: list[int]  # each part's rows per group on this rank
    parts: dict[str, Any]  # model name → the part (a view, or its own buffer when interleaved)


class FusedLayout:
    """The process's tensors with every declared fused tensor replaced by its parts, ready for
    :func:`rlplane.torch.register_model` (:attr:`tensors`).

    Each part must have the model's dtype and, on this rank, the model's shard shape
    (``info.weights``' ``shard_shape``); the fused tensor's rows must be exactly its parts' rows.
    Raises :class:`~rlplane.errors.MismatchError` listing every declaration that does not fit,
    and :class:`~rlplane.errors.InvalidError` for a declaration that cannot be applied at all.
    """

    def __init__(self, client: Client, model_or_named: Any, fused: Iterable[Fused]) -> None:
        from .torch import _named_tensors

        named, _ = _named_tensors(model_or_named)
        declared = list(fused)
        rank = client.info.rank
        if declared and (rank.fsdp_size or 1) > 1:
            raise InvalidError(
                f"fused tensors cannot be mapped on a trainer that shards over data (fsdp = {rank.fsdp_size}): FSDP "
                "chunks a fused tensor's rows, not each part's; register the parts as separate parameters"
            )
        problems: list[str] = []
        self._mapped: list[_Mapped] = []
        seen: set[str] = set()
        for f in declared:
            if f.name not in named:
                problems.append(f"`{f.name}`: no such tensor in the process's model")
                continue
            if f.name in seen:
                problems.append(f"`{f.name}`: declared twice")
                continue
            seen.add(f.name)
            mapped = _apply(client, f, named[f.name], problems)
            if mapped is not None:
                self._mapped.append(mapped)
        if problems:
            raise MismatchError(
                f"the fused tensors do not match the job's model ({client.info.job.name}): " + "; ".join(problems),
                op="register_weights",
            )
        fused_names = {m.fused.name for m in self._mapped}
        self.tensors: dict[str, Any] = {n: v for n, v in named.items() if n not in fused_names}
        for m in self._mapped:
            self.tensors.update(m.parts)
        #: The fused tensors mapped through copies (interleaved ones); empty when all are views.
        self.copied: tuple[str, ...] = tuple(m.fused.name for m in self._mapped if m.fused.groups > 1)

    def to_parts(self) -> None:
        """Copies each interleaved fused tensor into its parts (a trainer: before ``publish``).
        Concatenated parts are views and need nothing."""
        t = _torch()
        with t.no_grad():
            for m in self._mapped:
                if m.fused.groups > 1:
                    for part, (grouped, _) in zip(m.parts.values(), _pieces(m)):
                        _grouped(part, m.groups).copy_(grouped)

    def from_parts(self) -> None:
        """Copies the parts back into each interleaved fused tensor (an engine in direct mode:
        after a version is loaded, before generating with it)."""
        t = _torch()
        with t.no_grad():
            for m in self._mapped:
                if m.fused.groups > 1:
                    for part, (grouped, _) in zip(m.parts.values(), _pieces(m)):
                        grouped.copy_(_grouped(part, m.groups))


def _torch() -> Any:
    from .torch import _torch as load

    return load()


def _grouped(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    return tensor.view(groups, tensor.shape[0] // groups, *tensor.shape[1:])


def _pieces(m: _Mapped) -> list[tuple[torch.Tensor, int]]:
    """Each part's rows of the fused tensor, as a (groups, rows, …) view, and its offset in a group."""
    whole = _grouped(m.tensor.detach(), m.groups)
    out, at = [], 0
    for r in m.rows:
        out.append((whole[:, at : at + r], at))
        at += r
    return out


def _apply(client: Client, f: Fused, tensor: Any, problems: list[str]) -> _Mapped | None:
    """Checks one declaration against the model and this rank's shards, and builds its parts."""
    from .torch import shared_tensor, wire_dtype_of

    t = _torch()
    specs = client.info.weights_by_name
    what = f"`{f.name}` ({wire_dtype_of(tensor.dtype)} {list(tensor.shape)})"
    if f.groups < 1 or not f.parts or len(set(f.parts)) != len(f.parts):
        problems.append(f"{what}: needs groups ≥ 1 and distinct parts (got groups={f.groups}, parts={list(f.parts)})")
        return None
    unknown = [p for p in f.parts if p not in specs]
    if unknown:
        problems.append(f"{what}: parts not in the job's model: {unknown}")
        return None
    if not tensor.is_contiguous() or tensor.dim() < 1:
        problems.append(f"{what}: must be a contiguous tensor of at least one dimension")
        return None
    shards = [specs[p].shard_shape for p in f.parts]
    if any(s is None for s in shards):
        problems.append(f"{what}: this rank holds none of {[p for p, s in zip(f.parts, shards) if s is None]}")
        return None
    bad = [
        f"{p} is {specs[p].dtype} {list(s or ())}"
        for p, s in zip(f.parts, shards)
        if specs[p].dtype != wire_dtype_of(tensor.dtype) or tuple((s or ())[1:]) != tuple(tensor.shape[1:])
    ]
    if bad:
        problems.append(f"{what}: its parts must share its dtype and every dimension after the first: {', '.join(bad)}")
        return None
    local = [int((s or (0,))[0]) for s in shards]
    full = [int(specs[p].shape[0]) for p in f.parts]
    if any(n % f.groups for n in full):
        problems.append(f"{what}: groups = {f.groups} does not divide every part's rows {full}")
        return None
    per_group = [n // f.groups for n in full]
    groups = int(tensor.shape[0]) // sum(per_group) if f.groups > 1 else 1
    rows = per_group if f.groups > 1 else local
    if sum(rows) * groups != int(tensor.shape[0]) or any(r * groups != n for r, n in zip(rows, local)):
        problems.append(
            f"{what}: its {tensor.shape[0]} rows are not its parts' rows on this rank {local}"
            + (f" in groups of {per_group}" if f.groups > 1 else "")
        )
        return None
    parts: dict[str, Any] = {}
    if f.groups == 1:
        if tensor.device.type == "cpu":
            _into_shared_memory(client, f.name, tensor)
        at = 0
        for p, r in zip(f.parts, rows):
            parts[p] = tensor.detach().narrow(0, at, r)
            at += r
    else:
        for p, n in zip(f.parts, local):
            shape = (n, *tensor.shape[1:])
            if tensor.device.type == "cpu":
                parts[p] = shared_tensor(client, p, specs[p].dtype, shape)
            else:
                parts[p] = t.empty(shape, dtype=tensor.dtype, device=tensor.device)
    mapped = _Mapped(fused=f, tensor=tensor, groups=groups, rows=rows, parts=parts)
    return mapped


def _into_shared_memory(client: Client, name: str, tensor: Any) -> None:
    """Moves a CPU fused tensor into the client's shared memory in place (``p.data = shared``),
    so that its part views lie there too."""
    from .torch import shared_tensor, wire_dtype_of

    t = _torch()
    nbytes = tensor.numel() * tensor.element_size()
    if client.arena.locate_address(tensor.data_ptr(), nbytes) is not None:
        return
    shared = shared_tensor(client, name, wire_dtype_of(tensor.dtype), tuple(tensor.shape))
    with t.no_grad():
        shared.copy_(tensor.detach())
    tensor.data = shared
