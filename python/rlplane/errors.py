"""Exceptions raised by the rlplane client.

Every error the sidecar answers carries a ``kind`` (see docs/local-api.md) that selects one of the
classes below, and a ``message`` that says what is wrong and what to do. Errors found by the client
itself (bad arguments, a socket that never appears, a malformed reply) use the same classes.
"""

from __future__ import annotations

import builtins

__all__ = [
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
    "error_for_kind",
]


class RlplaneError(Exception):
    """Base class of every rlplane client error.

    Attributes:
        kind: the error kind (the sidecar's ``error.kind``, or ``"config"`` for a client-side
            configuration problem, or the unknown kind a newer sidecar sent).
        message: what is wrong and what to do.
        op: the request that failed (``"publish"``, ``"next_batch"``, …), when there was one.
    """

    kind: str = "error"

    def __init__(self, message: str, *, op: str | None = None, kind: str | None = None) -> None:
        self.message = message
        self.op = op
        if kind is not None:
            self.kind = kind
        text = f"{op}: {message}" if op else message
        super().__init__(text)

    def __str__(self) -> str:
        return f"{self.op}: {self.message}" if self.op else self.message

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Keep errors picklable (multiprocessing, vLLM's collective_rpc) despite keyword-only args.
        return (_rebuild, (type(self), self.message, self.op, self.kind))


def _rebuild(cls: type[RlplaneError], message: str, op: str | None, kind: str) -> RlplaneError:
    return cls(message, op=op, kind=kind)


class ConfigError(RlplaneError):
    """The client cannot find or reach its sidecar (environment variables, socket path)."""

    kind = "config"


class ProtocolError(RlplaneError):
    """Malformed message, unknown op or unsupported protocol version; the connection is closed."""

    kind = "protocol"


class BusyError(RlplaneError):
    """Another process holds this rank's socket."""

    kind = "busy"


class InvalidError(RlplaneError, ValueError):
    """A field or argument is missing or wrong (the message names it)."""

    kind = "invalid"


class MismatchError(RlplaneError, ValueError):
    """Registered tensors do not match the job's model (names, dtypes, shapes)."""

    kind = "mismatch"


class StateError(RlplaneError):
    """The call does not fit the rank's state (e.g. publishing a version that is not the step)."""

    kind = "state"


class TimeoutError(RlplaneError, builtins.TimeoutError):
    """A wait ran past its deadline. Also a subclass of the builtin :class:`TimeoutError`."""

    kind = "timeout"


class FailedError(RlplaneError):
    """The rank's command failed (refit, transfer queue); the job restarts its gang."""

    kind = "failed"


class ShutdownError(RlplaneError):
    """The job ended, this rank is stopping, or the sidecar closed the connection."""

    kind = "shutdown"


_BY_KIND: dict[str, type[RlplaneError]] = {
    cls.kind: cls
    for cls in (
        ProtocolError,
        BusyError,
        InvalidError,
        MismatchError,
        StateError,
        TimeoutError,
        FailedError,
        ShutdownError,
    )
}


def error_for_kind(kind: str, message: str, *, op: str | None = None) -> RlplaneError:
    """Builds the exception for a sidecar error reply.

    An unknown ``kind`` (a newer sidecar) gives a plain :class:`RlplaneError` whose ``kind`` is the
    one received, so nothing is lost.
    """
    cls = _BY_KIND.get(kind)
    if cls is None:
        return RlplaneError(f"[{kind}] {message}", op=op, kind=kind)
    return cls(message, op=op)
