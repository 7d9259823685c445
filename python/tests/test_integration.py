"""The client against the REAL sidecar: `rlplane local` runs a CPU job whose trainer and engine
templates' commands are the scripts in tests/sidecar/, which use this package.

Needs the rlplane binary: $RLPLANE_BIN, or target/debug/rlplane (or release) of this checkout
(`cargo build -p rlplane`). Without it every test here skips, saying so on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.sidecar

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "sidecar"
REPO = HERE.parent.parent


@pytest.fixture(scope="session")
def rlplane_bin() -> str:
    candidates = [os.environ.get("RLPLANE_BIN")] if os.environ.get("RLPLANE_BIN") else [
        str(REPO / "target" / "debug" / "rlplane"),
        str(REPO / "target" / "release" / "rlplane"),
    ]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    msg = f"SKIPPED sidecar integration tests: no rlplane binary (set RLPLANE_BIN or run `cargo build -p rlplane`; looked at {candidates})"
    if os.environ.get("RLPLANE_PYTHON_REQUIRED") == "1":
        pytest.fail(msg + " (RLPLANE_PYTHON_REQUIRED=1: scripts/test builds it)")
    print(msg, file=sys.stderr)
    pytest.skip(msg)


def manifest(tmp: Path, trainer_cmd: list[str], engine_cmd: list[str], *, steps: int = 3, data: int = 2,
             engines: int = 2, name: str = "py-client", gpu: bool = False, tensor: int = 1,
             tensors: list[dict[str, Any]] | None = None, timeout_s: int = 30, source: str = "Sharded",
             checkpoint_every: int = 0, gen_tp: int = 1, gen_gpus_per_node: int | None = None,
             fsdp: int = 1, max_policy_lag: int | None = None, partial_rollouts: bool = False) -> Path:
    """An RLJob running the given user commands: `tensor`-way tensor-parallel trainer ranks per
    data-parallel shard, the tiny preset or the explicit `tensors` (spec.model.tensors entries),
    `timeout_s` the bound on each step's commands (spec.refit.timeoutSeconds)."""
    def container(cname: str, cmd: list[str]) -> str:
        return (f"      spec:\n        containers:\n        - name: {cname}\n          image: unused-locally\n"
                f"          command: {json.dumps(cmd)}\n")

    model = "    preset: tiny" if tensors is None else f"    tensors: {json.dumps(tensors)}"
    text = f"""apiVersion: rlplane.dev/v1alpha1
kind: RLJob
metadata:
  name: {name}
spec:
  mode: {"Colocated" if gpu else "Split"}
  device: {"Gpu" if gpu else "Cpu"}
  model:
{model}
  trainer:
    nodes: 1
    gpusPerNode: {data * tensor}
    parallelism: {{tensor: {tensor}, pipeline: 1, context: 1, data: {data}, fsdp: {fsdp}}}
    template:
{container("train", trainer_cmd)}  generation:
    engines: {engines}
    tensorParallel: {gen_tp}
{f"    gpusPerNode: {gen_gpus_per_node}{chr(10)}" if gen_gpus_per_node else ""}    template:
{container("generate", engine_cmd)}  refit:
    transport: {"Auto" if gpu else "Tcp"}
    bufferBytes: 262144
    numBuffers: 2
    source: {source}
    timeoutSeconds: {timeout_s}
  transferQueue:
    placement: ProducerLocal
    capacityBytes: 67108864
  workload:
    steps: {steps}
    promptsPerStep: 4
    samplesPerPrompt: 2
    promptTokens: 16
    responseTokens: {{min: 8, max: 32}}
    seed: 7
"""
    if checkpoint_every:
        text += f"  checkpoint:\n    everySteps: {checkpoint_every}\n"
    if max_policy_lag is not None:
        text += f"  schedule:\n    policy: Asynchronous\n    maxPolicyLag: {max_policy_lag}\n"
        if partial_rollouts:
            text += "    partialRollouts: true\n"
    p = tmp / "rljob.yaml"
    p.write_text(text)
    return p


def run_local(rlplane_bin: str, path: Path, tmp: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("RLPLANE_SOCKET", None)
    env["RLPLANE_SHM_DIR"] = str(tmp / "shm")
    (tmp / "shm").mkdir(exist_ok=True)
    p = subprocess.run([rlplane_bin, "local", str(path), "--json", str(tmp / "summary.json")], capture_output=True,
                       text=True, timeout=timeout, env=env)
    (tmp / "stdout.txt").write_text(p.stdout)
    (tmp / "stderr.txt").write_text(p.stderr)
    return p


def reports(d: Path, prefix: str) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted(d.glob(f"{prefix}-*.json"))]


def py(script: str, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / "launch.py"), "1", str(SCRIPTS / script), *args]


def trainer_cmd(ranks: int, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / "launch.py"), str(ranks), str(SCRIPTS / "trainer.py"), *args]


def check_job(tmp: Path, out: Path, steps: int, ranks: int, engines: int) -> None:
    trainers, gens = reports(out, "trainer"), reports(out, "engine")
    assert len(trainers) == ranks and len(gens) == engines, (trainers, gens)
    for g in gens:
        assert g.get("done"), g
        assert [s["step"] for s in g["steps"]] == list(range(1, steps + 1)), g["steps"]
        for s in g["steps"]:
            assert s["bad"] == [], f"{g['rank']} step {s['step']}: weights not the trainer's: {s['bad'][:3]}"
            assert s["version"] == s["step"] - 1 and s["held"] == s["version"], s  # the previous step's weights
    put_steps = {s["step"] for g in gens for s in g["steps"]}
    for t in trainers:
        assert t.get("done") and len(t["batches"]) == steps, t
        assert [p["version"] for p in t["publish"]] == [0] + [b["step"] for b in t["batches"]]
        assert t["registered"]["tensors"] == len(t["hello"]["weights"])
    for step in put_steps:
        got = [b for t in trainers for b in t["batches"] if b["step"] == step]
        assert sum(b["samples"] for b in got) == 3 * engines, got  # every sample of the step, once
        for b in got:
            assert b["columns"]["input_ids"] == {"dtype": "i64", "ragged": True, "inner": []}
            assert b["columns"]["reward"] == {"dtype": "f32", "ragged": False, "inner": []}
            assert all(r == float(step) for r in b["reward"])
            for ids, n in zip(b["input_ids"], b["logprobs_len"]):
                assert ids == [1000 * step + i for i in range(len(ids))] and n == len(ids)
            assert b["tokens"] == [len(ids) for ids in b["input_ids"]]
            assert all(dict(map(tuple, t))["engine"] in {"0", "1"} for t in b["tags"])


def test_numpy_trainer_and_direct_engines(rlplane_bin: str, tmp_path: Path) -> None:
    out = tmp_path / "reports"
    out.mkdir()
    m = manifest(tmp_path, trainer_cmd(2, "--report", str(out), "--scalars"),
                 py("engine.py", "--report", str(out), "--mode", "direct", "--scalars"))
    p = run_local(rlplane_bin, m, tmp_path)
    assert p.returncode == 0, f"rlplane local failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    check_job(tmp_path, out, steps=3, ranks=2, engines=2)
    # Each step's scalars: every name's mean over the ranks that reported it.
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]["steps"]
    assert [s["scalars"] for s in steps] == [
        {"loss": 0.5 * n, "rank_index": 0.5, "reward_mean": float(n)} for n in (1, 2, 3)], steps
    for t in reports(out, "trainer"):
        errors = t["scalar_errors"]
        assert errors["bad_name"]["class"] == "InvalidError" and "bad name" in errors["bad_name"]["message"], errors
        assert errors["nan"]["class"] == "InvalidError", errors
        assert errors["ahead"]["class"] == "StateError" and "step under way is 1" in errors["ahead"]["message"], errors
        assert t["after_publish"] == "StateError"
    # The clients removed their own files (rlplane-<job>-<rank>-<pid>-<n>) when they closed.
    assert [f for f in os.listdir(tmp_path / "shm") if f.startswith("rlplane-py-client-")] == []


def test_torch_trainer_and_staged_engines(rlplane_bin: str, tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the torch trainer needs torch")
    out = tmp_path / "reports"
    out.mkdir()
    m = manifest(tmp_path, trainer_cmd(2, "--report", str(out), "--torch"),
                 py("engine.py", "--report", str(out), "--mode", "staged"))
    p = run_local(rlplane_bin, m, tmp_path)
    assert p.returncode == 0, f"rlplane local failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    check_job(tmp_path, out, steps=3, ranks=2, engines=2)
    # rlplane local runs every process as one user: the sidecar's socket, its directory and the
    # staged weights it shares are that user's only (in a pod they are widened for other uids).
    for engine in reports(out, "engine"):
        m = engine["modes"]
        assert m["socket"] == 0o600 and m["socket_dir"] == 0o700, m
        assert m["shm_files"] and all(mode & 0o077 == 0 for mode in m["shm_files"].values()), m


@pytest.mark.parametrize("lag", [0, 1])
def test_vllm_style_engines_a_driver_and_tensor_parallel_workers_share_each_engines_ranks(
    rlplane_bin: str, tmp_path: Path, lag: int
) -> None:
    # Two engines of tensorParallel 2 in one pod, each run as vLLM runs it: a driver process that
    # takes steps and puts rollouts (a "rollouts" session on the engine's rank 0) and one worker
    # process per rank that loads the weights (a "weights" session on its own rank).
    out = tmp_path / "reports"
    out.mkdir()
    m = manifest(tmp_path, trainer_cmd(2, "--report", str(out), "--torch"),
                 [sys.executable, str(SCRIPTS / "launch.py"), "2", str(SCRIPTS / "vllm_standin.py"), "--report", str(out)],
                 steps=4, gen_tp=2, gen_gpus_per_node=4, max_policy_lag=lag or None)
    p = run_local(rlplane_bin, m, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    engines = reports(out, "engine")
    assert sorted(e["rank"] for e in engines) == ["gen-0", "gen-2"], engines
    for e in engines:
        k = e["engine_index"]
        assert e.get("done") and e["session"] == "rollouts", e
        # Each worker reached its own rank of its own engine: engine-<k·TP + r>.sock.
        assert [w["rank"] for w in e["workers"]] == [f"gen-{2 * k}", f"gen-{2 * k + 1}"], e["workers"]
        assert [w["socket"].rsplit("/", 1)[1] for w in e["workers"]] == [f"engine-{2 * k}.sock", f"engine-{2 * k + 1}.sock"]
        # What a rank cannot take while the driver and its worker hold it.
        assert e["probes"] == {"second_weights_session": "BusyError", "second_rollouts_session": "BusyError",
                               "all_beside_the_sessions": "BusyError", "rollouts_on_rank_1": "StateError"}, e["probes"]
        assert [s["step"] for s in e["steps"]] == [1, 2, 3, 4]
        for s in e["steps"]:
            # Asynchronous: the step may be generated with weights up to `lag` versions older, and
            # each worker loads the newest staged, at least the step's.
            assert 0 <= s["step"] - 1 - s["version"] <= lag, s
            for w in s["workers"]:
                assert w["held"] >= s["version"] and s["step"] - 1 - w["held"] <= lag, (s["step"], w)
                assert w["bad"] == [] and w["tensors"] > 0, (s["step"], w)
    trainers = reports(out, "trainer")
    for step in range(1, 5):
        got = [b for t in trainers for b in t["batches"] if b["step"] == step]
        assert sum(b["samples"] for b in got) == 3 * 2, got  # both engines' rollouts, once each


def test_a_trainer_failure_fails_the_run_with_its_message(rlplane_bin: str, tmp_path: Path) -> None:
    out = tmp_path / "reports"
    out.mkdir()
    m = manifest(tmp_path, trainer_cmd(1, "--report", str(out), "--fail-at", "2"),
                 py("engine.py", "--report", str(out), "--mode", "direct"), data=1, engines=1)
    p = run_local(rlplane_bin, m, tmp_path, timeout=180)
    assert p.returncode != 0
    assert "planned failure at step 2" in p.stdout + p.stderr


def test_the_trainer_checkpoints_when_the_job_asks_and_the_coordinator_hears_of_it(rlplane_bin: str,
                                                                                    tmp_path: Path) -> None:
    out, saved = tmp_path / "reports", tmp_path / "checkpoints"
    out.mkdir()
    saved.mkdir()
    m = manifest(tmp_path, trainer_cmd(1, "--report", str(out), "--checkpoint-dir", str(saved)),
                 py("engine.py", "--report", str(out), "--mode", "direct"), data=1, engines=1, steps=4,
                 checkpoint_every=2)
    p = run_local(rlplane_bin, m, tmp_path)
    assert p.returncode == 0, f"rlplane local failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    check_job(tmp_path, out, steps=4, ranks=1, engines=1)
    (t,) = reports(out, "trainer")
    assert t["job"] == {"checkpoint_every": 2, "first_step": 1, "resume": None, "initial_version": 0}, t["job"]
    assert [c["step"] for c in t["checkpoints"]] == [2, 4], t["checkpoints"]
    errors = t["checkpoint_errors"]
    assert errors["ahead"]["class"] == "StateError" and "step=7" in errors["ahead"]["message"], errors
    assert errors["empty_uri"]["class"] == "InvalidError", errors
    # The coordinator heard of each one with the update of its step.
    for c in t["checkpoints"]:
        assert f"the trainer saved a checkpoint of step {c['step']}: {c['uri']}" in p.stdout + p.stderr, p.stderr[-3000:]


def test_a_failed_epoch_restarts_the_gang_and_resumes_after_the_last_checkpoint(rlplane_bin: str,
                                                                               tmp_path: Path) -> None:
    out, saved = tmp_path / "reports", tmp_path / "checkpoints"
    out.mkdir()
    saved.mkdir()
    trainer = trainer_cmd(1, "--report", str(out), "--checkpoint-dir", str(saved), "--fail-at", "5",
                          "--fail-once-marker", str(tmp_path / "failed-once"))
    m = manifest(tmp_path, trainer, py("engine.py", "--report", str(out), "--mode", "direct"), data=1, engines=1,
                 steps=8, checkpoint_every=2)
    p = run_local(rlplane_bin, m, tmp_path)
    assert p.returncode == 0, f"rlplane local failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert "gang restart 1/3 with epoch 1, resuming after step 4" in p.stderr, p.stderr[-3000:]
    assert "planned failure at step 5" in p.stderr, p.stderr[-3000:]
    # The reports are epoch 1's: it resumed from step 4's checkpoint and ran steps 5 to 8.
    (t,) = reports(out, "trainer")
    assert t["job"]["resume"]["step"] == 4 and t["job"]["first_step"] == 5, t["job"]
    assert t["hello"]["job"]["epoch"] == 1
    assert [b["step"] for b in t["batches"]] == [5, 6, 7, 8]
    assert [x["version"] for x in t["publish"]] == [4, 5, 6, 7, 8], t["publish"]
    assert [c["step"] for c in t["checkpoints"]] == [6, 8]
    (e,) = reports(out, "engine")
    assert [s["step"] for s in e["steps"]] == [5, 6, 7, 8], e["steps"]
    for s in e["steps"]:
        assert s["bad"] == [] and s["held"] == s["step"] - 1, s  # the restored weights, then each step's


def test_without_checkpoints_a_failure_ends_the_local_run_at_once(rlplane_bin: str, tmp_path: Path) -> None:
    out = tmp_path / "reports"
    out.mkdir()
    trainer = trainer_cmd(1, "--report", str(out), "--fail-at", "2", "--fail-once-marker", str(tmp_path / "failed"))
    m = manifest(tmp_path, trainer, py("engine.py", "--report", str(out), "--mode", "direct"), data=1, engines=1)
    p = run_local(rlplane_bin, m, tmp_path, timeout=180)
    assert p.returncode != 0 and "gang restart" not in p.stderr, p.stderr[-3000:]


def test_the_sidecars_errors_reach_the_user_as_exceptions(rlplane_bin: str, tmp_path: Path) -> None:
    out = tmp_path / "reports"
    out.mkdir()
    m = manifest(tmp_path, trainer_cmd(1, "--report", str(out), "--probe-errors"),
                 py("engine.py", "--report", str(out), "--mode", "direct"), data=1, engines=1, steps=1)
    p = run_local(rlplane_bin, m, tmp_path)
    assert p.returncode == 0, f"rlplane local failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    (t,) = reports(out, "trainer")
    e = t["errors"]
    assert e["publish_before_register"]["class"] == "StateError" and "register" in e["publish_before_register"]["message"]
    assert e["second_connection"]["class"] == "BusyError"
    mm = e["mismatch"]
    assert mm["class"] == "MismatchError", mm
    assert "not.in.the.model" in mm["message"] and "model.embed_tokens.weight" in mm["message"], mm["message"]
    assert e["staged_trainer"]["class"] == "InvalidError"
    check_job(tmp_path, out, steps=1, ranks=1, engines=1)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_gpu_colocated_cuda_ipc(rlplane_bin: str, tmp_path: Path, mode: str) -> None:
    """One GPU, trainer and engine colocated: the trainer registers CUDA parameters (PyTorch's IPC
    handles, opened by the sidecar); the engine gets CUDA IPC staging buffers (opened here through
    cudaIpcOpenMemHandle) or registers its own CUDA tensors (direct)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        print("SKIPPED test_gpu_colocated_cuda_ipc: no CUDA device", file=sys.stderr)
        pytest.skip("no CUDA device")
    out = tmp_path / "reports"
    out.mkdir()
    m = manifest(tmp_path, trainer_cmd(1, "--report", str(out), "--torch", "--device", "cuda"),
                 py("engine.py", "--report", str(out), "--mode", mode, "--device", "cuda"),
                 data=1, engines=1, gpu=True)
    p = run_local(rlplane_bin, m, tmp_path)
    assert p.returncode == 0, f"rlplane local failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    check_job(tmp_path, out, steps=3, ranks=1, engines=1)
    (t,) = reports(out, "trainer")
    assert t["hello"]["device"] == "gpu" and t["hello"]["transport"] == "cuda_ipc", t["hello"]


@pytest.mark.cuda
def test_a_process_that_cannot_see_its_ranks_gpu_fails_the_job_naming_both_sides(rlplane_bin: str,
                                                                              tmp_path: Path) -> None:
    """Two GPUs: the job's one pod holds GPU 0, but the trainer's process sees only GPU 1 (as a
    container would whose GPUs are not the sidecar's). The client's check_gpus fails the rank at
    once with both sides' GPUs, instead of a CUDA error at the first refit."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        print("SKIPPED test_a_process_that_cannot_see_its_ranks_gpu: needs 2 CUDA devices", file=sys.stderr)
        pytest.skip("needs 2 CUDA devices")
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(2)]
    out = tmp_path / "reports"
    out.mkdir()
    # `rlplane local` gives the pod's processes CUDA_VISIBLE_DEVICES=0; `env` overrides it.
    trainer = ["env", "CUDA_VISIBLE_DEVICES=1", *trainer_cmd(1, "--report", str(out), "--torch", "--device", "cuda")]
    m = manifest(tmp_path, trainer, py("engine.py", "--report", str(out), "--mode", "staged", "--device", "cuda"),
                 data=1, engines=1, gpu=True, timeout_s=20)
    p = run_local(rlplane_bin, m, tmp_path, timeout=180)
    assert p.returncode != 0, p.stderr[-3000:]
    assert "which the trainer process does not see" in p.stderr, p.stderr[-4000:]
    # Both sides named: the rank's GPU (the worker's device 0) and the one the process sees.
    assert uuids[0].removeprefix("GPU-") in p.stderr.lower() or uuids[0] in p.stderr, (uuids, p.stderr[-4000:])
    assert uuids[1].removeprefix("GPU-") in p.stderr.lower() or uuids[1] in p.stderr, (uuids, p.stderr[-4000:])
