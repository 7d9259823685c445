"""Socket discovery from the environment and connecting with retry."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from pathlib import Path

import pytest

import rlplane
from rlplane import _wire


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RLPLANE_SOCKET", "RLPLANE_IPC_DIR", "LOCAL_RANK", "RLPLANE_ENGINE", "RLPLANE_ENGINE_TENSOR_PARALLEL"):
        monkeypatch.delenv(var, raising=False)


def test_neither_variable_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(rlplane.ConfigError) as info:
        _wire.socket_path("trainer")
    assert "RLPLANE_SOCKET" in str(info.value) and "RLPLANE_IPC_DIR" in str(info.value)


def test_ipc_dir_and_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLANE_IPC_DIR", "/var/run/rlplane")
    assert _wire.socket_path("trainer") == "/var/run/rlplane/trainer-0.sock"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _wire.socket_path("trainer") == "/var/run/rlplane/trainer-3.sock"
    assert _wire.socket_path("engine") == "/var/run/rlplane/engine-3.sock"
    assert _wire.socket_path("engine", index=1) == "/var/run/rlplane/engine-1.sock"


def test_socket_variable_overrides_the_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLANE_IPC_DIR", "/var/run/rlplane")
    monkeypatch.setenv("RLPLANE_SOCKET", "/tmp/mine.sock")
    assert _wire.socket_path("trainer") == "/tmp/mine.sock"
    assert _wire.socket_path("trainer", socket="/explicit.sock") == "/explicit.sock"


def test_bad_local_rank_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLANE_IPC_DIR", "/d")
    monkeypatch.setenv("LOCAL_RANK", "zero")
    with pytest.raises(rlplane.ConfigError, match="LOCAL_RANK='zero'"):
        _wire.socket_path("engine")


def test_an_engines_rank_socket_is_engine_times_tp_plus_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLPLANE_ENGINE_TENSOR_PARALLEL", raising=False)
    assert _wire.engine_socket_index(0, 1) == 1  # the pod's first engine needs no size
    with pytest.raises(rlplane.ConfigError, match="RLPLANE_ENGINE_TENSOR_PARALLEL"):
        _wire.engine_socket_index(1, 0)
    assert _wire.engine_socket_index(1, 1, tensor_parallel=2) == 3
    monkeypatch.setenv("RLPLANE_ENGINE_TENSOR_PARALLEL", "4")
    assert _wire.engine_socket_index(2, 3) == 11
    with pytest.raises(rlplane.ConfigError, match="tp_rank 4 is not a rank of a 4-way"):
        _wire.engine_socket_index(0, 4)
    monkeypatch.setenv("RLPLANE_ENGINE_TENSOR_PARALLEL", "two")
    with pytest.raises(rlplane.ConfigError, match="'two' is not a number"):
        _wire.engine_socket_index(1, 0)


def test_an_engine_by_engine_index_connects_to_its_rank_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLANE_IPC_DIR", str(tmp_path))
    monkeypatch.setenv("RLPLANE_ENGINE_TENSOR_PARALLEL", "2")
    monkeypatch.setenv("RLPLANE_ENGINE", "1")
    with pytest.raises(rlplane.TimeoutError, match="engine-2.sock"):
        rlplane.Engine(timeout=0.2)
    with pytest.raises(rlplane.TimeoutError, match="engine-3.sock"):
        rlplane.Engine(timeout=0.2, tp_rank=1)
    with pytest.raises(rlplane.ConfigError, match="session='driver'"):
        rlplane.Engine(timeout=0.2, session="driver")


def test_an_engine_socket_of_another_tensor_parallel_rank_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # With a wrong tensor-parallel size, engine 1's rank 0 computes engine-1.sock: engine 0's rank 1.
    import copy

    from .conftest import HELLO

    hello = copy.deepcopy(HELLO)
    hello["rank"].update(name="gen-1", role="engine", engine=0, engine_rank=1)
    path = str(tmp_path / "engine-1.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def answer() -> None:
        conn, _ = srv.accept()
        with conn:
            _wire.read_message(conn)
            _wire.write_message(conn, hello)
            conn.recv(1)

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    monkeypatch.setenv("RLPLANE_IPC_DIR", str(tmp_path))
    with pytest.raises(rlplane.ConfigError, match="gen-1, tensor-parallel rank 1 of its engine, not rank 0 of the pod's engine 1"):
        rlplane.Engine(timeout=2, engine=1, tensor_parallel=1)
    t.join(5)
    srv.close()


def test_connect_times_out_naming_the_path(tmp_path: Path) -> None:
    path = str(tmp_path / "trainer-0.sock")
    t0 = time.monotonic()
    with pytest.raises(rlplane.TimeoutError) as info:
        _wire.connect(path, timeout=0.3)
    assert time.monotonic() - t0 < 3
    assert path in str(info.value) and "does not exist" in str(info.value)
    assert isinstance(info.value, TimeoutError)  # the builtin too


def test_client_without_environment_fails_before_connecting() -> None:
    with pytest.raises(rlplane.ConfigError, match="RLPLANE_IPC_DIR"):
        rlplane.Trainer(timeout=0.1)


def test_client_times_out_naming_the_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLANE_IPC_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(rlplane.TimeoutError, match="engine-1.sock"):
        rlplane.Engine(timeout=0.2)


def test_connect_retries_until_the_socket_appears(tmp_path: Path) -> None:
    path = str(tmp_path / "engine-0.sock")
    accepted: list[socket.socket] = []

    def listen_later() -> None:
        time.sleep(0.4)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        conn, _ = srv.accept()
        accepted.append(conn)
        srv.close()

    t = threading.Thread(target=listen_later, daemon=True)
    t.start()
    conn = _wire.connect(path, timeout=10)
    t.join(5)
    assert accepted and not conn.closed
    conn.close()
    accepted[0].close()


def test_a_path_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trainer-0.sock"
    path.write_text("not a socket")
    with pytest.raises((rlplane.ConfigError, rlplane.TimeoutError)):
        _wire.connect(str(path), timeout=0.2)


def test_too_long_a_path_is_named() -> None:
    with pytest.raises(rlplane.ConfigError, match="shorter"):
        _wire.connect("/" + "d" * 200 + "/trainer-0.sock", timeout=0.1)


def test_errors_are_picklable_and_keep_their_fields() -> None:
    for cls in (rlplane.TimeoutError, rlplane.MismatchError, rlplane.ShutdownError):
        e = cls("what to do", op="publish")
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is cls and back.message == "what to do" and back.op == "publish" and str(back) == str(e)


def test_error_hierarchy() -> None:
    assert issubclass(rlplane.TimeoutError, TimeoutError)
    assert issubclass(rlplane.InvalidError, ValueError)
    for cls in (rlplane.ProtocolError, rlplane.BusyError, rlplane.StateError, rlplane.FailedError, rlplane.ConfigError):
        assert issubclass(cls, rlplane.RlplaneError)
    assert os.environ.get("RLPLANE_SOCKET") is None
