"""rlplane.vllm.RlplaneWorkerExtension's own sequencing, on a stand-in worker (NOT vLLM): a class
with the two attributes vLLM's workers give extensions (``model_runner.model`` with
``load_weights``, ``device``) and an Engine attached to the transport double. test_vllm.py runs
the extension inside real vLLM where vLLM can be imported."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import rlplane  # noqa: E402
import rlplane.vllm as rv  # noqa: E402

from .conftest import HELLO  # noqa: E402
from .recorder import offline  # noqa: E402


class StandInModel:
    def __init__(self, fail: bool = False) -> None:
        self.loaded: list[tuple[str, Any]] = []
        self.fail = fail

    def load_weights(self, weights: Any) -> set[str]:
        for name, t in weights:
            if self.fail:
                raise RuntimeError("bad tensor")
            self.loaded.append((name, t.clone()))
        return {n for n, _ in self.loaded}


class StandInWorker(rv.RlplaneWorkerExtension):
    def __init__(self, model: StandInModel) -> None:
        self.model_runner = type("Runner", (), {"model": model})()
        self.device = torch.device("cpu")


@pytest.fixture
def staged(shm_dir: Path, monkeypatch: pytest.MonkeyPatch):
    path = shm_dir / "rlplane-sidecar-staging"
    path.write_bytes(np.arange(16 * 64, dtype=np.float32).tobytes())
    staging = [{"name": "embed.weight", "dtype": "f32", "shape": [16, 64],
                "memory": {"kind": "shm", "path": str(path), "offset": 0, "nbytes": 4096}}]
    hello = copy.deepcopy(HELLO)
    hello["rank"].update(name="gen-0-0", role="engine")
    made: list[Any] = []

    def fake_engine(socket: Any = None, *, timeout: float = 120.0, index: Any = None, **kw: Any) -> rlplane.Engine:
        e, rec = offline(rlplane.Engine, hello,
                         register_weights={"ok": True, "tensors": 0, "bytes": 0, "staging": staging},
                         version={"ok": True, "version": None, "state": "empty"},
                         acquire_staged={"ok": True, "version": 3}, release_staged={"ok": True})
        made.append((rec, socket, index, kw))
        return e

    monkeypatch.setattr(rv, "Engine", fake_engine)
    return made


def test_connect_update_and_version(staged: list) -> None:
    model = StandInModel()
    w = StandInWorker(model)
    with pytest.raises(rlplane.ConfigError, match="rlplane_connect"):
        w.rlplane_update_weights(1)
    info = w.rlplane_connect(index=1)
    assert info == {"rank": "gen-0-0", "socket": "/recorded/x.sock", "tensors": 1, "version": None}
    rec, _, index, kw = staged[0]
    assert index == 1 and kw == {"session": "weights"} and rec.requests[-2]["mode"] == "staged"
    assert w.rlplane_update_weights(2, 5.0) == 3
    assert rec.ops()[-2:] == ["acquire_staged", "release_staged"]
    assert rec.requests[-2] == {"op": "acquire_staged", "version": 2, "timeout_s": 5}
    (name, t), = model.loaded
    assert name == "embed.weight" and t.shape == (16, 64) and float(t[1, 0]) == 64.0
    assert w.rlplane_version() is None
    with pytest.raises(rlplane.ConfigError, match="already connected"):
        w.rlplane_connect(index=1)
    w.rlplane_close()
    assert rec.ops()[-1] == "bye"


def test_staging_is_released_when_loading_fails(staged: list) -> None:
    w = StandInWorker(StandInModel(fail=True))
    w.rlplane_connect(index=0)
    with pytest.raises(RuntimeError, match="bad tensor"):
        w.rlplane_update_weights(1)
    assert staged[0][0].ops()[-1] == "release_staged"


def test_extension_attributes_cannot_collide_with_a_worker() -> None:
    # vLLM refuses an extension whose attributes the worker already has.
    names = [a for a in dir(rv.RlplaneWorkerExtension) if not a.startswith("__")]
    assert names and all(a.startswith(("rlplane_", "_rlplane_")) for a in names)


def test_without_an_index_a_worker_takes_its_rank_of_its_engine(staged: list, monkeypatch: pytest.MonkeyPatch) -> None:
    # Inside vLLM the worker's tensor-parallel rank and size come from vllm.distributed.
    monkeypatch.delenv("RLPLANE_SOCKET", raising=False)
    monkeypatch.setenv("RLPLANE_ENGINE", "1")
    monkeypatch.setattr(StandInWorker, "_rlplane_tp", lambda self: (1, 2))
    StandInWorker(StandInModel()).rlplane_connect()
    assert staged[-1][3] == {"session": "weights", "engine": 1, "tp_rank": 1, "tensor_parallel": 2}
    StandInWorker(StandInModel()).rlplane_connect(engine=0)
    assert staged[-1][3]["engine"] == 0


def test_the_driver_takes_the_rollouts_session_of_its_engines_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict] = []
    monkeypatch.setattr(rv, "Engine", lambda *a, **kw: made.append(kw) or "engine")
    monkeypatch.setenv("RLPLANE_ENGINE", "3")
    assert rv.connect_driver(tensor_parallel=2) == "engine"
    assert made[-1] == {"timeout": 120.0, "session": "rollouts", "engine": 3, "tensor_parallel": 2}
    monkeypatch.setenv("RLPLANE_ENGINE", "x")
    with pytest.raises(rlplane.ConfigError, match="RLPLANE_ENGINE='x'"):
        rv.connect_driver()
