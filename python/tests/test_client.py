"""Client-side bookkeeping of Trainer and Engine: what they send, checked against a transport
double (tests/recorder.py). The sidecar's behaviour is tested against the real sidecar in
test_integration.py."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest

import rlplane
from rlplane.dtypes import f32_to_bf16

from .conftest import HELLO
from .recorder import Recorder, offline


def engine_hello() -> dict:
    h = copy.deepcopy(HELLO)
    h["rank"].update(name="gen-0-0", role="engine", dp=None, tp=None, pp=None, engine=0, engine_rank=0, producer=True,
                     leader=False)
    for w in h["weights"]:
        w["shard_shape"] = w["shape"]
    return h


def test_info_parses_the_documented_hello() -> None:
    info = rlplane.Info.from_wire(HELLO)
    assert info.rank.name == "trainer-0" and info.rank.leader and info.rank.engine is None
    assert info.job == rlplane.JobInfo("tiny-grpo", "default", 0, 20)
    assert info.device == "cpu" and info.gpu is None and info.transport == "tcp"
    assert info.weights[1] == rlplane.WeightSpec("norm.weight", "bf16", (64,), (64,))
    assert not info.weight("other_stage.weight").held
    with pytest.raises(KeyError, match="no tensor"):
        info.weight("nope")
    gpu = rlplane.Info.from_wire({**HELLO, "device": "gpu", "gpu": {"ordinal": 3}})
    assert gpu.gpu == 3
    engine = rlplane.Info.from_wire(engine_hello())  # an engine rank has no dp/tp/pp
    assert engine.rank.dp is None and engine.rank.engine == 0 and engine.rank.producer


def test_info_of_a_resumed_epoch_names_its_checkpoint_and_first_step(shm_dir: Path) -> None:
    job = {**HELLO["job"], "epoch": 2, "checkpoint_every": 10,
           "resume": {"step": 40, "version": 40, "uri": "s3://ckpt/step-40"}, "first_step": 41}
    hello = {**HELLO, "job": job}
    info = rlplane.Info.from_wire(hello)
    assert info.job.resume == rlplane.Resume(40, 40, "s3://ckpt/step-40")
    assert (info.job.checkpoint_every, info.job.first_step) == (10, 41)
    t, _ = offline(rlplane.Trainer, hello)
    assert t.initial_version == 40
    assert [s for s in range(38, 62) if t.checkpoint_due(s)] == [40, 50, 60]
    with pytest.raises(rlplane.InvalidError, match="uri"):
        t.checkpoint_saved(40, "")
    fresh, _ = offline(rlplane.Trainer, HELLO)  # no cadence: never due, publish 0 first
    assert fresh.initial_version == 0 and not any(fresh.checkpoint_due(s) for s in range(0, 30))


def test_info_missing_field_is_a_protocol_error() -> None:
    bad = {k: v for k, v in HELLO.items() if k != "weights"}
    with pytest.raises(rlplane.ProtocolError, match="weights"):
        rlplane.Info.from_wire(bad)


def test_hello_request(shm_dir: Path) -> None:
    t, rec = offline(rlplane.Trainer, HELLO)
    hello = rec.requests[0]
    assert hello["op"] == "hello" and hello["protocol"] == 1 and hello["role"] == "trainer"
    assert hello["client"] == f"rlplane-python/{rlplane.__version__}"
    assert t.info.rank.name == "trainer-0"


def test_other_protocol_is_refused(shm_dir: Path) -> None:
    with pytest.raises(rlplane.ProtocolError, match="protocol 2"):
        offline(rlplane.Trainer, {**HELLO, "protocol": 2})


def test_alloc_defaults_to_the_manifest(shm_dir: Path) -> None:
    t, _ = offline(rlplane.Trainer, HELLO)
    emb = t.alloc("embed.weight")
    assert emb.shape == (16, 64) and emb.dtype == np.float32 and not emb.any()
    norm = t.alloc("norm.weight")
    assert norm.dtype == np.uint16 and norm.shape == (64,)
    assert t.alloc("mine", "i32", (3,)).dtype == np.int32
    with pytest.raises(rlplane.InvalidError, match="no tensor 'mine'"):
        t.alloc("mine")
    with pytest.raises(rlplane.InvalidError, match="holds no part"):
        t.alloc("other_stage.weight")


def test_register_sends_shm_descriptors_of_allocated_arrays(shm_dir: Path) -> None:
    t, rec = offline(rlplane.Trainer, HELLO, register_weights={"ok": True, "tensors": 3, "bytes": 8320})
    emb, norm, head = t.alloc("embed.weight"), t.alloc("norm.weight"), t.alloc("lm_head.weight")
    emb[:] = 1.5
    norm[:] = f32_to_bf16(np.ones(64, np.float32))
    res = t.register({"model.embed_tokens.weight": emb, "norm.weight": norm, "lm_head.weight": head},
                     name_map={"model.embed_tokens.weight": "embed.weight"})
    assert res == rlplane.RegisterResult(3, 8320, res.raw)
    req = rec.requests[-1]
    assert req["mode"] == "direct" and req["name_map"] == {"model.embed_tokens.weight": "embed.weight"}
    by = {e["name"]: e for e in req["tensors"]}
    assert by["norm.weight"]["dtype"] == "bf16"  # uint16 bits, named bf16 by the manifest
    assert by["model.embed_tokens.weight"]["dtype"] == "f32" and by["model.embed_tokens.weight"]["shape"] == [16, 64]
    m = by["model.embed_tokens.weight"]["memory"]
    assert m["kind"] == "shm" and m["nbytes"] == 4096 and m["path"].startswith(str(shm_dir))
    with open(m["path"], "rb") as f:
        f.seek(m["offset"])
        assert np.frombuffer(f.read(16), "<f4").tolist() == [1.5] * 4


def test_register_refuses_arrays_outside_shared_memory(shm_dir: Path) -> None:
    t, rec = offline(rlplane.Trainer, HELLO)
    with pytest.raises(rlplane.InvalidError, match="alloc"):
        t.register({"embed.weight": np.zeros((16, 64), np.float32)})
    assert rec.ops() == ["hello"]


def test_a_closed_arena_is_replaced_by_a_new_one_for_registering_again(shm_dir: Path) -> None:
    reply = {"ok": True, "tensors": 3, "bytes": 8320}
    t, rec = offline(rlplane.Trainer, HELLO, register_weights=reply)
    names = ("embed.weight", "norm.weight", "lm_head.weight")
    t.register({n: t.alloc(n) for n in names})
    old = t.arena.paths
    t.arena.close()  # offloading: the registered memory is freed
    assert not any(os.path.exists(p) for p in old)
    t.register({n: t.alloc(n) for n in names})
    new = t.arena.paths
    assert new and not set(new) & set(old)
    paths = {e["memory"]["path"] for e in rec.requests[-1]["tensors"]}
    assert paths <= set(new)
    t.close()
    with pytest.raises(rlplane.InvalidError, match="closed"):
        t.alloc("embed.weight")


def test_publish_and_batches(shm_dir: Path) -> None:
    t, rec = offline(rlplane.Trainer, HELLO, publish={"ok": True, "version": 0, "refit_s": 0.25, "bytes": 10},
                     next_batch=[{"ok": True, "done": True}])
    assert t.publish(0) == rlplane.PublishResult(0, 0.25, 10, {"ok": True, "version": 0, "refit_s": 0.25, "bytes": 10})
    assert rec.requests[-1] == {"op": "publish", "version": 0}
    with pytest.raises(rlplane.InvalidError, match="integer"):
        t.publish(1.5)  # type: ignore[arg-type]
    assert list(t.batches()) == []


def test_steps_end_the_previous_step_when_the_loop_did_not(shm_dir: Path) -> None:
    e, rec = offline(rlplane.Engine, engine_hello(),
                     next_step=[{"ok": True, "step": 1, "version": 0}, {"ok": True, "step": 2, "version": 1},
                                {"ok": True, "done": True}],
                     end_step={"ok": True})
    seen = []
    for step in e.steps():
        seen.append((step.step, step.version))
        if step.step == 2:
            e.end_step(step)  # ended by hand: not ended twice
    assert seen == [(1, 0), (2, 1)]
    assert rec.ops() == ["hello", "next_step", "end_step", "next_step", "end_step", "next_step"]
    assert [r.get("step") for r in rec.requests if r["op"] == "end_step"] == [1, 2]


def test_put_request(shm_dir: Path) -> None:
    e, rec = offline(rlplane.Engine, engine_hello(), put={"ok": True, "samples": 2, "bytes": 64})
    res = e.put(rlplane.Step(4, 3), {"input_ids": [np.array([1, 2, 3]), np.array([4])],
                                     "reward": np.array([1.0, 0.0], np.float32)},
                keys=["a", "b"], tokens=np.array([3, 1]), tags=[{"uid": "p0"}, [("uid", "p0"), ("g", "1")]])
    assert res.samples == 2 and res.bytes == 64
    req = rec.requests[-1]
    assert req["step"] == 4 and req["keys"] == ["a", "b"] and req["tokens"] == [3, 1]
    assert req["tags"] == [[["uid", "p0"]], [["uid", "p0"], ["g", "1"]]]
    assert [c["name"] for c in req["columns"]] == ["input_ids", "reward"]
    first_path = req["columns"][0]["values"]["path"]
    e.put(5, {"reward": np.zeros(3, np.float32)})
    assert rec.requests[-1]["columns"][0]["values"]["path"] == first_path  # scratch space reused
    assert "keys" not in rec.requests[-1] and "tags" not in rec.requests[-1]
    with pytest.raises(rlplane.InvalidError, match="1 keys for 2 samples"):
        e.put(4, {"reward": np.zeros(2, np.float32)}, keys=["a"])
    with pytest.raises(rlplane.InvalidError, match="strings"):
        e.put(4, {"reward": np.zeros(1, np.float32)}, tags=[{"uid": 1}])  # type: ignore[dict-item]


def test_engine_version_calls(shm_dir: Path) -> None:
    e, rec = offline(rlplane.Engine, engine_hello(),
                     version={"ok": True, "version": None, "state": "empty"},
                     wait_version={"ok": True, "version": 3, "state": "ready"},
                     acquire_staged={"ok": True, "version": 4}, release_staged={"ok": True})
    assert e.version() == rlplane.VersionInfo(None, "empty")
    assert e.wait_version(3, timeout=60) == rlplane.VersionInfo(3, "ready")
    assert rec.requests[-1] == {"op": "wait_version", "version": 3, "timeout_s": 60}
    e.wait_version(3, timeout=0.5)
    assert rec.requests[-1]["timeout_s"] == 0.5
    e.wait_version(3, timeout=None)
    assert rec.requests[-1] == {"op": "wait_version", "version": 3}  # no deadline
    with pytest.raises(rlplane.InvalidError, match="finite"):
        e.wait_version(3, timeout=-1)
    with e.staged(3, timeout=10) as held:
        assert held == 4
    assert rec.ops()[-2:] == ["acquire_staged", "release_staged"]
    with pytest.raises(RuntimeError):
        with e.staged(3):
            raise RuntimeError("load failed")
    assert rec.ops()[-1] == "release_staged"  # released on an exception too


def test_register_staged_maps_shm_staging(shm_dir: Path) -> None:
    staging_file = shm_dir / "rlplane-sidecar-staging"
    data = np.arange(16 * 64, dtype=np.float32)
    staging_file.write_bytes(data.tobytes() + bytes(128))
    staging = [
        {"name": "embed.weight", "dtype": "f32", "shape": [16, 64],
         "memory": {"kind": "shm", "path": str(staging_file), "offset": 0, "nbytes": 4096}},
        {"name": "norm.weight", "dtype": "bf16", "shape": [64],
         "memory": {"kind": "shm", "path": str(staging_file), "offset": 4096, "nbytes": 128}},
    ]
    e, rec = offline(rlplane.Engine, engine_hello(), register_weights={"ok": True, "tensors": 0, "bytes": 0, "staging": staging})
    views = e.register_staged()
    assert rec.requests[-1] == {"op": "register_weights", "mode": "staged", "tensors": []}
    assert views["embed.weight"].shape == (16, 64) and views["embed.weight"][1, 0] == 64.0
    assert views["norm.weight"].dtype == np.uint16 and not views["embed.weight"].flags.writeable
    assert set(e.staging) == {"embed.weight", "norm.weight"}


def test_context_manager_says_bye_or_fails_with_the_exception(shm_dir: Path) -> None:
    t, rec = offline(rlplane.Trainer, HELLO)
    with t:
        t.alloc("embed.weight")
        files = os.listdir(shm_dir)
        assert files
    assert rec.ops()[-1] == "bye" and t.closed and os.listdir(shm_dir) == []

    t, rec = offline(rlplane.Trainer, HELLO)
    with pytest.raises(ZeroDivisionError):
        with t:
            1 / 0
    assert rec.ops()[-1] == "fail" and "ZeroDivisionError" in rec.requests[-1]["message"]
    assert "bye" not in rec.ops() and t.closed

    t, rec = offline(rlplane.Trainer, HELLO)
    with pytest.raises(rlplane.FailedError):
        with t:
            raise rlplane.FailedError("refit failed", op="publish")
    assert rec.ops() == ["hello"]  # the sidecar failed the rank itself: nothing to add
    with pytest.raises(rlplane.ShutdownError, match="closed"):
        t.publish(1)


def test_a_gpu_rank_checks_that_this_process_sees_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlplane.client as rc

    hello = copy.deepcopy(HELLO)
    hello.update(device="gpu", gpu={"ordinal": 1}, transport="cuda_ipc")
    monkeypatch.setattr(rc, "_visible_gpu_uuids", lambda: ["GPU-aa", "GPU-bb"])
    _, rec = offline(rlplane.Trainer, hello, check_gpus={"ok": True})
    assert rec.requests[1] == {"op": "check_gpus", "uuids": ["GPU-aa", "GPU-bb"]}
    # The sidecar's refusal (another GPU) reaches the user as the error it names.
    refusal = {"ok": False, "error": {"kind": "mismatch", "message": "trainer-0's GPU is GPU-cc (the worker's device 1), which the trainer process does not see"}}
    with pytest.raises(rlplane.MismatchError, match="GPU-cc"):
        offline(rlplane.Trainer, hello, check_gpus=refusal)
    # Without torch (or on a CPU rank) nothing is checked.
    monkeypatch.setattr(rc, "_visible_gpu_uuids", lambda: None)
    _, rec = offline(rlplane.Trainer, hello)
    assert rec.ops() == ["hello"]
    _, rec = offline(rlplane.Trainer, HELLO)
    assert rec.ops() == ["hello"]
    # An engine's driver (rollouts session) holds no GPU memory: not checked either.
    monkeypatch.setattr(rc, "_visible_gpu_uuids", lambda: ["GPU-aa"])
    engine = rlplane.Engine.__new__(rlplane.Engine)
    rec = Recorder({"hello": {**hello, "rank": {**hello["rank"], "role": "engine"}}})
    engine._attach(rec, "rollouts")
    assert rec.ops() == ["hello"]
