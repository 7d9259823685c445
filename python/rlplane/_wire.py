"""The sidecar's wire: framing, request/reply, error mapping, socket discovery and connection.

Every message, both ways, is a 4-byte little-endian length followed by that many bytes of UTF-8
JSON (one object), at most 64 MiB. The client sends a request; the sidecar answers each request
with exactly one reply, in order (docs/local-api.md).
"""

from __future__ import annotations

import errno
import json
import os
import socket as _socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError, ProtocolError, RlplaneError, ShutdownError, TimeoutError, error_for_kind

__all__ = [
    "MAX_MESSAGE",
    "PROTOCOL",
    "encode",
    "decode",
    "read_message",
    "write_message",
    "Connection",
    "engine_socket_index",
    "socket_path",
    "connect",
]

#: The largest message either side sends (64 MiB).
MAX_MESSAGE = 64 * 1024 * 1024
#: The protocol version this client speaks.
PROTOCOL = 1

_LEN = struct.Struct("<I")
# sun_path holds 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107


def encode(message: Mapping[str, Any]) -> bytes:
    """Frames one message: 4-byte little-endian length, then compact UTF-8 JSON.

    Raises:
        InvalidError: the message is larger than 64 MiB or not JSON-serialisable.
    """
    from .errors import InvalidError

    try:
        body = json.dumps(message, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise InvalidError(f"the request cannot be written as JSON: {e}", op=str(message.get("op"))) from None
    if len(body) > MAX_MESSAGE:
        raise InvalidError(
            f"the request is {len(body)} bytes of JSON, more than the protocol's {MAX_MESSAGE} bytes; "
            "put fewer samples per call",
            op=str(message.get("op")),
        )
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    """Parses one message body (without its length prefix) into a JSON object."""
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"the sidecar sent a message that is not UTF-8 JSON ({e}); is the socket an rlplane sidecar's?") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"the sidecar sent JSON that is not an object: {body[:200]!r}")
    return value


def _recv_exact(sock: _socket.socket, n: int) -> bytes | None:
    """Reads exactly ``n`` bytes, or returns None on a clean end of stream before the first byte."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return None
            raise ProtocolError(f"the connection closed in the middle of a message ({got} of {n} bytes read)")
        got += k
    return bytes(buf)


def read_message(sock: _socket.socket) -> dict[str, Any] | None:
    """Reads one framed message; None when the peer closed the connection between messages."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise ProtocolError(f"the sidecar announced a message of {n} bytes, more than the protocol's {MAX_MESSAGE}")
    body = _recv_exact(sock, n) if n else b""
    if body is None:
        raise ProtocolError(f"the connection closed after a message's length ({n} bytes) and before its body")
    return decode(body)


def write_message(sock: _socket.socket, message: Mapping[str, Any]) -> None:
    """Writes one framed message."""
    sock.sendall(encode(message))


class Connection:
    """One client connection: requests answered in order, errors raised as exceptions.

    Thread-safe: one request at a time is in flight (the protocol answers in order).
    """

    def __init__(self, sock: _socket.socket, path: str) -> None:
        self._sock: _socket.socket | None = sock
        self.path = path
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """Whether the connection was closed (by :meth:`close` or by the sidecar)."""
        return self._sock is None

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Sends ``{"op": op, **fields}`` and returns the reply (``ok`` true).

        Raises:
            RlplaneError: the subclass for the reply's ``error.kind``, carrying its message;
                :class:`ShutdownError` when the sidecar closed the connection instead of answering.
        """
        request = {"op": op, **fields}
        frame = encode(request)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise ShutdownError(f"the connection to {self.path} is closed; connect again", op=op)
            try:
                reply = self._exchange(sock, frame, op)
            except RlplaneError:
                raise
            except BaseException:
                # Interrupted (KeyboardInterrupt, a signal handler's exception) between request and
                # reply: the stream's position is unknown, so the connection cannot be used again.
                self._drop()
                raise
        return _check_reply(reply, op, self)

    def _exchange(self, sock: _socket.socket, frame: bytes, op: str) -> dict[str, Any]:
        try:
            sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError) as e:
            # The sidecar may have answered (e.g. `busy`) and closed before reading the request.
            reply = self._read_after_send_failure(sock)
            if reply is None:
                self._drop()
                raise ShutdownError(
                    f"the sidecar at {self.path} closed the connection ({e.strerror}); the rank is stopping "
                    "or the sidecar exited: see the worker's log",
                    op=op,
                ) from None
            return reply
        try:
            reply = read_message(sock)
        except ProtocolError as e:
            self._drop()
            raise ProtocolError(e.message, op=op) from None
        except OSError as e:
            self._drop()
            raise ShutdownError(
                f"reading the reply from {self.path} failed ({e}); the sidecar exited: see the worker's log",
                op=op,
            ) from None
        if reply is None:
            self._drop()
            raise ShutdownError(
                f"the sidecar at {self.path} closed the connection without answering; the rank is stopping or "
                "the sidecar exited: see the worker's log",
                op=op,
            )
        return reply

    def _read_after_send_failure(self, sock: _socket.socket) -> dict[str, Any] | None:
        try:
            return read_message(sock)
        except (OSError, RlplaneError):
            return None

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        """Closes the socket (without sending ``bye``)."""
        with self._lock:
            self._drop()


def _check_reply(reply: dict[str, Any], op: str, conn: Connection | None = None) -> dict[str, Any]:
    ok = reply.get("ok")
    if ok is True:
        return reply
    if ok is False:
        err = reply.get("error")
        if not isinstance(err, dict) or not isinstance(err.get("kind"), str):
            raise ProtocolError(f"the sidecar's error reply has no error.kind: {json.dumps(reply)[:500]}", op=op)
        kind = err["kind"]
        message = err.get("message")
        if not isinstance(message, str):
            message = json.dumps(err)
        if kind == "protocol" and conn is not None:
            conn.close()  # the sidecar closes the connection after a protocol error
        raise error_for_kind(kind, message, op=op)
    raise ProtocolError(f"the sidecar's reply has no boolean `ok`: {json.dumps(reply)[:500]}", op=op)


def engine_socket_index(engine: int, tp_rank: int = 0, tensor_parallel: int | None = None) -> int:
    """The local index of an engine's rank among its pod's generation ranks: ``engine · TP +
    tp_rank``, since a pod holds whole engines, each with ``spec.generation.tensorParallel``
    ranks in tensor-parallel order.

    ``engine`` is the engine's index among the pod's engines (from 0); ``tensor_parallel``
    defaults to ``$RLPLANE_ENGINE_TENSOR_PARALLEL``, which rlplane sets in the engine's containers.

    Raises:
        ConfigError: an index is negative, ``tp_rank`` is not below the tensor-parallel size, or
            the size is needed (``engine`` > 0) and unknown.
    """
    if engine < 0 or tp_rank < 0:
        raise ConfigError(f"engine ({engine}) and tp_rank ({tp_rank}) must be 0 or more")
    if tensor_parallel is None:
        env = os.environ.get("RLPLANE_ENGINE_TENSOR_PARALLEL", "")
        if env:
            try:
                tensor_parallel = int(env)
            except ValueError:
                raise ConfigError(f"RLPLANE_ENGINE_TENSOR_PARALLEL={env!r} is not a number (the engines' tensorParallel)") from None
    if tensor_parallel is None:
        if engine > 0:
            raise ConfigError(
                f"engine {engine}'s socket depends on the engines' tensor-parallel size, which is unknown here: "
                "set RLPLANE_ENGINE_TENSOR_PARALLEL (rlplane sets it in the engine's containers) or pass tensor_parallel=…"
            )
        return tp_rank
    if tensor_parallel < 1 or tp_rank >= tensor_parallel:
        raise ConfigError(f"tp_rank {tp_rank} is not a rank of a {tensor_parallel}-way tensor-parallel engine")
    return engine * tensor_parallel + tp_rank


def socket_path(role: str, socket: str | os.PathLike[str] | None = None, index: int | None = None) -> str:
    """Finds this rank's socket.

    In order: ``socket`` if given; ``$RLPLANE_SOCKET`` if set; else
    ``$RLPLANE_IPC_DIR/<role>-<index>.sock`` where ``index`` defaults to ``$LOCAL_RANK`` (or 0).
    An engine's rank by engine and tensor-parallel rank is :func:`engine_socket_index`.

    Raises:
        ConfigError: neither variable is set, or ``LOCAL_RANK`` is not a number.
    """
    if role not in ("trainer", "engine"):
        raise ValueError(f"role must be 'trainer' or 'engine', not {role!r}")
    if socket is not None:
        return os.fspath(socket)
    env_socket = os.environ.get("RLPLANE_SOCKET")
    if env_socket:
        return env_socket
    ipc_dir = os.environ.get("RLPLANE_IPC_DIR")
    if not ipc_dir:
        raise ConfigError(
            f"cannot find the rlplane sidecar's socket for this {role}: neither RLPLANE_SOCKET (the socket's path) "
            "nor RLPLANE_IPC_DIR (the directory holding <role>-<i>.sock) is set. rlplane sets RLPLANE_IPC_DIR for "
            "the processes it starts; when you start this process yourself, set one of them, or pass socket=…"
        )
    if index is None:
        local = os.environ.get("LOCAL_RANK", "0") or "0"
        try:
            index = int(local)
        except ValueError:
            raise ConfigError(
                f"LOCAL_RANK={local!r} is not a number; it picks {ipc_dir}/{role}-<LOCAL_RANK>.sock. "
                "Fix LOCAL_RANK, or pass index=… or socket=…"
            ) from None
    if index < 0:
        raise ConfigError(f"the rank's local index must be 0 or more, not {index}")
    return os.path.join(ipc_dir, f"{role}-{index}.sock")


def connect(path: str, timeout: float = 120.0) -> Connection:
    """Connects to the sidecar's socket, retrying until ``timeout`` seconds have passed.

    The sidecar may start after the user's process, so a missing socket or a refused connection is
    retried (every 0.05 s at first, backing off to 1 s).

    Raises:
        ConfigError: the path is too long for a Unix socket, or is not a socket / not accessible.
        TimeoutError: no sidecar answered at ``path`` within ``timeout``.
    """
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise ConfigError(
            f"the socket path {path!r} is {len(os.fsencode(path))} bytes, more than a Unix socket's "
            f"{_MAX_SOCKET_PATH}; use a shorter RLPLANE_IPC_DIR or RLPLANE_SOCKET"
        )
    deadline = time.monotonic() + timeout
    delay = 0.05
    last: OSError | None = None
    while True:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return Connection(sock, path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            sock.close()
            last = e
        except PermissionError:
            sock.close()
            raise ConfigError(
                f"permission denied connecting to {path}: run this process as a user that can open the socket"
            ) from None
        except OSError as e:
            sock.close()
            if e.errno in (errno.ENOTSOCK, errno.ENOTDIR, errno.EPROTOTYPE):
                raise ConfigError(f"{path} is not a Unix socket ({e.strerror}); check RLPLANE_SOCKET / RLPLANE_IPC_DIR") from None
            if e.errno not in (errno.EAGAIN, errno.ECONNRESET):
                raise ConfigError(f"connecting to {path} failed: {e}") from None
            last = e
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            what = "does not exist" if isinstance(last, FileNotFoundError) else "refuses connections"
            raise TimeoutError(
                f"no rlplane sidecar answered at {path} within {timeout:g} s (the socket {what}). Is the rlplane "
                "worker running beside this process, with the same RLPLANE_IPC_DIR and this rank's index? "
                "Pass a longer timeout if it starts later",
                op="connect",
            )
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 1.0)
