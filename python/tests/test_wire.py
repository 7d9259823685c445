"""Framing and request/reply over a socket pair. The peer here only frames canned messages: it
checks the client's wire format, never the sidecar's logic."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rlplane
from rlplane import _wire
from rlplane.errors import error_for_kind


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def peer(sock: socket.socket, script: Callable[[socket.socket], None]) -> threading.Thread:
    t = threading.Thread(target=script, args=(sock,), daemon=True)
    t.start()
    return t


def test_encode_is_length_prefixed_compact_json() -> None:
    frame = _wire.encode({"op": "hello", "protocol": 1, "client": "é"})
    (n,) = struct.unpack("<I", frame[:4])
    assert n == len(frame) - 4
    assert frame[4:] == '{"op":"hello","protocol":1,"client":"é"}'.encode()


def test_round_trip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    msgs = [{"op": "x", "n": i, "s": "ü" * i, "l": list(range(i))} for i in range(50)]
    for m in msgs:
        _wire.write_message(a, m)
    for m in msgs:
        assert _wire.read_message(b) == m


def test_read_survives_byte_by_byte_delivery(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    frame = _wire.encode({"ok": True, "version": 3, "state": "ready"})

    def dribble(s: socket.socket) -> None:
        for i in range(len(frame)):
            s.send(frame[i : i + 1])

    peer(a, dribble)
    assert _wire.read_message(b) == {"ok": True, "version": 3, "state": "ready"}


def test_clean_eof_between_messages_is_none(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    assert _wire.read_message(b) is None


def test_eof_inside_a_message_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(struct.pack("<I", 10) + b'{"ok"')
    a.close()
    with pytest.raises(rlplane.ProtocolError, match="middle of a message"):
        _wire.read_message(b)


def test_oversized_announcement_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(struct.pack("<I", _wire.MAX_MESSAGE + 1))
    with pytest.raises(rlplane.ProtocolError, match="more than the protocol"):
        _wire.read_message(b)


def test_oversized_request_is_refused_before_sending() -> None:
    with pytest.raises(rlplane.InvalidError, match="64|67108864"):
        _wire.encode({"op": "put", "keys": ["k" * 1024] * (70 * 1024)})


@pytest.mark.parametrize("body", [b"[1, 2]", b"not json", b"\xff\xfe"])
def test_non_object_or_non_json_is_a_protocol_error(pair: tuple[socket.socket, socket.socket], body: bytes) -> None:
    a, b = pair
    a.sendall(struct.pack("<I", len(body)) + body)
    with pytest.raises(rlplane.ProtocolError):
        _wire.read_message(b)


def answering(reply: dict[str, Any], seen: list[dict[str, Any]]) -> Callable[[socket.socket], None]:
    def run(s: socket.socket) -> None:
        req = _wire.read_message(s)
        assert req is not None
        seen.append(req)
        _wire.write_message(s, reply)

    return run


def test_call_sends_op_and_fields_and_returns_reply(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    seen: list[dict[str, Any]] = []
    peer(b, answering({"ok": True, "version": 3, "refit_s": 0.01, "bytes": 10}, seen))
    conn = _wire.Connection(a, "/x.sock")
    assert conn.call("publish", version=3)["refit_s"] == 0.01
    assert seen == [{"op": "publish", "version": 3}]


@pytest.mark.parametrize(
    "kind,cls",
    [
        ("protocol", rlplane.ProtocolError),
        ("busy", rlplane.BusyError),
        ("invalid", rlplane.InvalidError),
        ("mismatch", rlplane.MismatchError),
        ("state", rlplane.StateError),
        ("timeout", rlplane.TimeoutError),
        ("failed", rlplane.FailedError),
        ("shutdown", rlplane.ShutdownError),
    ],
)
def test_error_reply_maps_kind_to_class_with_message(pair: tuple[socket.socket, socket.socket], kind: str, cls: type) -> None:
    a, b = pair
    message = f"a {kind} happened; do the thing the sidecar says"
    peer(b, answering({"ok": False, "error": {"kind": kind, "message": message}}, []))
    conn = _wire.Connection(a, "/x.sock")
    with pytest.raises(cls) as info:
        conn.call("publish", version=3)
    e = info.value
    assert isinstance(e, rlplane.RlplaneError)
    assert e.kind == kind and e.message == message and e.op == "publish"
    assert message in str(e) and "publish" in str(e)
    assert conn.closed == (kind == "protocol")  # a protocol error closes the connection


def test_unknown_kind_keeps_kind_and_message() -> None:
    e = error_for_kind("quota", "over quota: ask for more")
    assert type(e) is rlplane.RlplaneError and e.kind == "quota" and "over quota" in str(e)


def test_malformed_error_reply_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    peer(b, answering({"ok": False, "error": "boom"}, []))
    with pytest.raises(rlplane.ProtocolError, match="error.kind"):
        _wire.Connection(a, "/x.sock").call("version")


def test_reply_without_ok_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    peer(b, answering({"version": 1}, []))
    with pytest.raises(rlplane.ProtocolError, match="ok"):
        _wire.Connection(a, "/x.sock").call("version")


def test_close_without_reply_is_shutdown_naming_the_socket(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair

    def close_after_request(s: socket.socket) -> None:
        _wire.read_message(s)
        s.shutdown(socket.SHUT_RDWR)

    peer(b, close_after_request)
    conn = _wire.Connection(a, "/run/x/trainer-0.sock")
    with pytest.raises(rlplane.ShutdownError, match="trainer-0.sock"):
        conn.call("next_batch")
    assert conn.closed
    with pytest.raises(rlplane.ShutdownError, match="closed"):
        conn.call("next_batch")


def test_reply_sent_before_the_peer_closes_is_still_read(pair: tuple[socket.socket, socket.socket]) -> None:
    # A second connection gets `busy` and is closed, possibly before its hello is read.
    a, b = pair
    _wire.write_message(b, {"ok": False, "error": {"kind": "busy", "message": "trainer-0 is held by pid 42"}})
    b.close()
    with pytest.raises(rlplane.BusyError, match="pid 42"):
        _wire.Connection(a, "/x.sock").call("hello", protocol=1)


def test_nan_cannot_be_sent() -> None:
    with pytest.raises(rlplane.InvalidError, match="JSON"):
        _wire.encode({"op": "x", "v": float("nan")})


def test_messages_are_utf8_json_objects(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    _wire.write_message(a, {"op": "fail", "message": "crashed: ✗"})
    head = b.recv(4)
    (n,) = struct.unpack("<I", head)
    assert json.loads(b.recv(n).decode("utf-8")) == {"op": "fail", "message": "crashed: ✗"}


def test_an_interrupted_call_closes_the_connection(pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    # A reply that arrives after an interrupt must never be taken for the next request's.
    a, _ = pair
    conn = _wire.Connection(a, "/x.sock")

    def interrupted(sock: socket.socket) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_wire, "read_message", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conn.call("next_batch")
    assert conn.closed
