"""A transport double for client-side tests: records what the client sends and hands back the
replies a test scripted, in order. It implements none of the sidecar's logic; tests use it to
check the requests the client builds (descriptors, fields) and its own bookkeeping."""

from __future__ import annotations

import copy
from collections import defaultdict, deque
from typing import Any

from rlplane import _wire
from rlplane.errors import ShutdownError


class Recorder:
    def __init__(self, replies: dict[str, list[dict[str, Any]] | dict[str, Any]]) -> None:
        self.path = "/recorded/x.sock"
        self.closed = False
        self.requests: list[dict[str, Any]] = []
        self._replies: dict[str, deque[dict[str, Any]]] = defaultdict(deque)
        self._fixed: dict[str, dict[str, Any]] = {}
        for op, r in replies.items():
            if isinstance(r, list):
                self._replies[op].extend(r)
            else:
                self._fixed[op] = r

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        if self.closed:
            raise ShutdownError("closed", op=op)
        _wire.encode({"op": op, **fields})  # what the client sends must frame
        self.requests.append(copy.deepcopy({"op": op, **fields}))
        if self._replies[op]:
            reply = self._replies[op].popleft()
        elif op in self._fixed:
            reply = self._fixed[op]
        else:
            raise AssertionError(f"the test scripted no reply to {op}")
        return _wire._check_reply(reply, op)

    def ops(self) -> list[str]:
        return [r["op"] for r in self.requests]

    def close(self) -> None:
        self.closed = True


def offline(cls: type, hello: dict[str, Any], **replies: Any) -> Any:
    """A Trainer/Engine attached to a Recorder instead of a socket."""
    client = cls.__new__(cls)
    rec = Recorder({"hello": hello, "bye": {"ok": True}, "fail": {"ok": True}, **replies})
    client._attach(rec)
    return client, rec
