"""More of the client against the REAL sidecar (`rlplane local` on CPU, as test_integration.py):
a trainer that reallocates and registers again, a tensor-parallel trainer whose ranks register
their shards, an engine that dies mid-step, and a trainer that never publishes. The user
processes are tests/sidecar/exact_{trainer,engine}.py; the engines check every tensor's bytes
exactly (tests/sidecar/exact.py) at every step and after the last refit.

Needs the rlplane binary, as test_integration.py (its fixtures and helpers are used here).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .test_integration import SCRIPTS, manifest, reports, rlplane_bin, run_local  # noqa: F401 (a fixture)

pytestmark = pytest.mark.sidecar


def launch(ranks: int, script: str, *args: str) -> list[str]:
    """A template command: `ranks` local processes of `script` (tests/sidecar/launch.py)."""
    return [sys.executable, str(SCRIPTS / "launch.py"), str(ranks), str(SCRIPTS / script), *args]


def failed(p: Any) -> str:
    return f"rlplane local failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"


def final_error(p: Any) -> str:
    """What `rlplane local` itself says went wrong: its own `error:` line (the processes' lines
    are prefixed with their names) and what follows it."""
    lines = p.stderr.splitlines()
    at = max((i for i, line in enumerate(lines) if line.startswith("error: ")), default=None)
    assert at is not None, f"no `error:` line from rlplane local:\n{p.stderr[-4000:]}"
    return "\n".join(lines[at:])


def check_engines(out: Path, engines: int, steps: int) -> list[dict[str, Any]]:
    """Every engine held, at each step s, exactly version s − 1's bytes, and after the job
    exactly the last version's."""
    gens = reports(out, "engine")
    assert len(gens) == engines, gens
    for g in gens:
        assert g.get("done"), g
        assert [s["step"] for s in g["steps"]] == list(range(1, steps + 1)), g["steps"]
        for s in g["steps"]:
            assert s["held"] == s["step"] - 1, s
            assert s["bad"] == [], f"{g['rank']} step {s['step']} (version {s['held']}): {s['bad'][:4]}"
        assert g["final"]["version"] == steps and g["final"]["state"] == "ready", g["final"]
        assert g["final"]["bad"] == [], f"{g['rank']} after the job (version {steps}): {g['final']['bad'][:4]}"
    return gens


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_trainer_that_reallocates_registers_again_and_engines_get_the_new_memory(
    rlplane_bin: str, tmp_path: Path, kind: str
) -> None:
    """After offloading: mid-job every trainer rank poisons and frees its registered memory
    (closing its shared-memory files), registers new memory in new files, and publishes from
    it. Were the sidecar still reading the old registration, the engines would hold poison."""
    if kind == "torch":
        pytest.importorskip("torch", reason="the torch trainer needs torch")
    out = tmp_path / "reports"
    out.mkdir()
    extra = ["--torch"] if kind == "torch" else []
    m = manifest(tmp_path, launch(2, "exact_trainer.py", "--report", str(out), "--realloc-at", "2", *extra),
                 launch(1, "exact_engine.py", "--report", str(out)), steps=3, data=2, engines=2)
    p = run_local(rlplane_bin, m, tmp_path, timeout=180)
    assert p.returncode == 0, failed(p)
    check_engines(out, engines=2, steps=3)
    trainers = reports(out, "trainer")
    assert len(trainers) == 2
    for t in trainers:
        assert t.get("done") and [b["step"] for b in t["batches"]] == [1, 2, 3], t
        assert [x["version"] for x in t["publish"]] == [0, 1, 2, 3]
        first, again = t["registrations"]
        assert (first["step"], again["step"]) == (0, 2)
        assert again["tensors"] == first["tensors"] == len(t["hello"]["weights"])
        assert again["bytes"] == first["bytes"]
        # New memory in new files; the old files were removed when the old memory was freed.
        assert first["paths"] and again["paths"] and not set(first["paths"]) & set(again["paths"]), (first, again)
        assert t["realloc"]["old"] == first["paths"] and t["realloc"]["old_exist"] == []
    # Each trainer rank's registered bytes went somewhere: replica 0 sends, every rank publishes.
    assert any(x["bytes"] > 0 for t in trainers for x in t["publish"][1:])


@pytest.mark.parametrize("mode", ["direct", "staged", "partial"])
def test_an_asynchronous_job_trains_within_its_policy_lag_and_engines_hold_each_version_exactly(
    rlplane_bin: str, tmp_path: Path, mode: str
) -> None:
    """spec.schedule Asynchronous, maxPolicyLag 1, under random generation and training times:
    the engines generate a step while the trainer still trains the one before, yet every sample
    a trainer process receives (its policy_version tag, which the sidecar adds) lags at most one
    version; each engine holds exactly the bytes of the version it generates with. Direct
    registration: a refit into the engine's tensors waits for end_step, so none lands mid-step.
    Staged: the refit fills the staging buffers while the engine generates from the copy it took,
    and it takes the newer one at its next step; taking it inside the step is refused. Partial
    rollouts (spec.schedule.partialRollouts): the engine takes it inside the step, and the samples
    it finishes afterwards carry the first and the last version (the bound applies to the first).
    The sample each engine labels with version 0 at
    step 4 is dropped and counted, never trained on; every other sample is trained on once."""
    out = tmp_path / "reports"
    out.mkdir()
    steps, engines, k = 6, 2, 1
    # Each engine's step outlasts the trainer's, so the trainer's refit arrives while the engines
    # still generate the step after it.
    m = manifest(tmp_path, launch(2, "exact_trainer.py", "--report", str(out), "--sleep-ms", "10,30"),
                 launch(1, "exact_engine.py", "--report", str(out), "--sleep-ms", "80,100", "--stale-at", "4",
                        *([] if mode == "direct" else ["--staged", "--mid-step"])),
                 steps=steps, data=2, engines=engines, max_policy_lag=k, partial_rollouts=mode == "partial")
    p = run_local(rlplane_bin, m, tmp_path, timeout=180)
    assert p.returncode == 0, failed(p)
    gens = reports(out, "engine")
    assert len(gens) == engines
    for g in gens:
        assert g.get("done") and [s["step"] for s in g["steps"]] == list(range(1, steps + 1)), g
        for s in g["steps"]:
            assert 0 <= s["step"] - 1 - s["held"] <= k and s["held"] >= s["version"], s
            assert s["bad"] == [], f"{g['rank']} step {s['step']} (version {s['held']}): {s['bad'][:4]}"
        assert g["final"]["version"] == steps and g["final"]["bad"] == [], g["final"]
        if mode == "direct":
            # A refit into the engine's own tensors waited for end_step: nothing changed mid-step.
            assert all(s["held_after"] == s["held"] and s["bad_after"] == [] for s in g["steps"]), g["steps"]
        else:
            # Staged: the next version arrived while the engine generated from the one it took.
            newer = [s for s in g["steps"] if s["held_after"] > s["held"]]
            assert len(newer) >= steps // 2, g["steps"]
            if mode == "staged":
                assert all("needs spec.schedule.partialRollouts" in s["mid_refused"] for s in newer), newer
            else:
                assert all(s["mid_take"] >= s["held_after"] and s["bad_mid"] == [] for s in newer), newer
    # Generation ran ahead: from step 2 on, each step is generated while the trainer trains the
    # step before, with weights at least a version old.
    assert all(s["held"] <= max(0, s["step"] - 2) for g in gens for s in g["steps"]), gens
    trainers = reports(out, "trainer")
    per_step: dict[int, list[str]] = {}
    mixed = 0  # samples whose tokens span two versions
    for t in trainers:
        assert t.get("done") and [b["step"] for b in t["batches"]] == list(range(1, steps + 1)), t
        for b in t["batches"]:
            lags = [b["step"] - 1 - int(v) for v in b["versions"]]
            assert len(lags) == b["samples"] and all(0 <= lag <= k for lag in lags), (b["step"], b["versions"])
            last = [None if v is None else int(v) for v in b["versions_last"]]
            if mode == "partial":
                assert all(x is not None and x >= int(v) for x, v in zip(last, b["versions"])), b
            else:
                assert last == [None] * b["samples"], b
            mixed += sum(x is not None and x > int(v) for x, v in zip(last, b["versions"]))
            per_step.setdefault(b["step"], []).extend(b["keys"])
    for step, keys in per_step.items():
        assert len(keys) == len(set(keys)) == 2 * engines, (step, keys)  # every sample once, no stale one
        assert not any(key.startswith("stale-") for key in keys), keys
    assert (mixed > 0) == (mode == "partial"), mixed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summary"]["stale_dropped"] == engines, summary["summary"]
    assert summary["summary"]["policy_lag_max"] == k and summary["summary"]["max_policy_lag"] == k


@pytest.mark.parametrize("lag", [0, 1])
def test_an_asynchronous_tensor_parallel_engine_registered_direct_is_refused_naming_the_fix(
    rlplane_bin: str, tmp_path: Path, lag: int
) -> None:
    """In an asynchronous job refits arrive while the engine generates; only an engine's rank 0
    sees its steps, so a direct registration on another rank could have its tensors written in the
    middle of rank 0's forward pass. The rank refuses it, saying to register staged; the same
    engine runs a synchronous job (refits come between its steps)."""
    out = tmp_path / "reports"
    out.mkdir()
    m = manifest(tmp_path, launch(2, "exact_trainer.py", "--report", str(out)),
                 launch(2, "tp_direct_engine.py"),
                 steps=2, data=2, engines=1, gen_tp=2, gen_gpus_per_node=2, max_policy_lag=lag or None)
    p = run_local(rlplane_bin, m, tmp_path, timeout=120)
    if lag == 0:
        assert p.returncode == 0, failed(p)
        return
    assert p.returncode != 0, failed(p)
    # The refusing rank says why (which failure the run names first is a race between the ranks).
    assert "registered its weights direct" in p.stderr and "register staged" in p.stderr, p.stderr[-4000:]


# An explicit model for tensor parallelism: default Rows (embed), Columns on 2-D (f32 and bf16) and
# 3-D tensors, a replicated vector (the default for 1-D) and an explicitly replicated matrix.
TP_MODEL: list[dict[str, Any]] = [
    {"name": "embed.weight", "dtype": "bf16", "shape": [16, 8]},
    {"name": "layers.0.o_proj.weight", "dtype": "f32", "shape": [8, 12], "tpSplit": "Columns"},
    {"name": "layers.0.down_proj.weight", "dtype": "bf16", "shape": [6, 10], "tpSplit": "Columns"},
    {"name": "layers.0.conv.weight", "dtype": "i32", "shape": [4, 6, 3], "tpSplit": "Columns"},
    {"name": "norm.weight", "dtype": "f32", "shape": [8]},
    {"name": "rope.table", "dtype": "f32", "shape": [4, 4], "tpSplit": "Replicated"},
    {"name": "lm_head.weight", "dtype": "f32", "shape": [16, 8], "tpSplit": "Rows"},
]
# What each of the 2 tensor-parallel ranks holds (None: nothing; rank 0 sends replicated tensors).
TP_SHARDS: dict[str, tuple[list[int] | None, list[int] | None]] = {
    "embed.weight": ([8, 8], [8, 8]),
    "layers.0.o_proj.weight": ([8, 6], [8, 6]),
    "layers.0.down_proj.weight": ([6, 5], [6, 5]),
    "layers.0.conv.weight": ([4, 3, 3], [4, 3, 3]),
    "norm.weight": ([8], None),
    "rope.table": ([4, 4], None),
    "lm_head.weight": ([8, 8], [8, 8]),
}


def test_a_tensor_parallel_trainer_registers_its_shards_and_engines_hold_the_whole(
    rlplane_bin: str, tmp_path: Path
) -> None:
    """TP = 2, refit source Sharded: each trainer rank registers only its shard (hello's
    shard_shape) and sends it; each engine's full tensors equal, byte for byte, the
    concatenation the splits imply (Rows: dimension 0, Columns: dimension 1). Registering the
    full tensors on a tensor-parallel rank is refused, naming each tensor and the shape it wants."""
    out = tmp_path / "reports"
    out.mkdir()
    m = manifest(tmp_path, launch(2, "exact_trainer.py", "--report", str(out), "--probe-full"),
                 launch(1, "exact_engine.py", "--report", str(out)),
                 steps=2, data=1, tensor=2, engines=2, tensors=TP_MODEL, source="Sharded", name="py-tp")
    p = run_local(rlplane_bin, m, tmp_path, timeout=180)
    assert p.returncode == 0, failed(p)
    check_engines(out, engines=2, steps=2)
    trainers = sorted(reports(out, "trainer"), key=lambda t: t["hello"]["rank"]["tp"])
    assert [t["hello"]["rank"]["tp"] for t in trainers] == [0, 1]
    for tp, t in enumerate(trainers):
        weights = t["hello"]["weights"]
        assert [w["name"] for w in weights] == [x["name"] for x in TP_MODEL]
        assert all(w["shape"] == x["shape"] for w, x in zip(weights, TP_MODEL))
        assert {w["name"]: w.get("shard_shape") for w in weights} == {n: s[tp] for n, s in TP_SHARDS.items()}, weights
        held = [n for n, s in TP_SHARDS.items() if s[tp] is not None]
        assert t.get("done") and t["registrations"][0]["tensors"] == len(held), t["registrations"]
        # Both ranks send their shard (Sharded): each publish moved bytes from each rank.
        assert all(x["bytes"] > 0 for x in t["publish"]), t["publish"]
        # The full tensors, registered on a tensor-parallel rank: refused, every split tensor named
        # with the shape this rank holds; the replicated ones rank 0 holds whole are fine.
        e = t["probe_full"]
        assert e is not None and e["class"] == "MismatchError" and e["kind"] == "mismatch", e
        for name in held:
            full, mine = next(x["shape"] for x in TP_MODEL if x["name"] == name), TP_SHARDS[name][tp]
            if full != mine:
                assert f"`{name}`: shape {full} registered, this rank holds {mine}" in e["message"], e["message"]
            else:
                assert f"`{name}`" not in e["message"], e["message"]


@pytest.mark.parametrize("code", [3, 0])
def test_an_engine_that_dies_mid_step_fails_the_run_promptly(rlplane_bin: str, tmp_path: Path, code: int) -> None:
    """Engine 0's process exits (os._exit) in the middle of step 2, after a put and before
    end_step — with an error code, or 0, which the supervisor alone does not count as a failure.
    The run fails, naming the engine, well before any of the job's timeouts could end it."""
    out = tmp_path / "reports"
    out.mkdir()
    timeout_s = 60
    m = manifest(tmp_path, launch(1, "exact_trainer.py", "--report", str(out)),
                 launch(1, "exact_engine.py", "--report", str(out), "--die-at", "2", "--die-code", str(code)),
                 steps=3, data=1, engines=1, timeout_s=timeout_s)
    t0 = time.monotonic()
    p = run_local(rlplane_bin, m, tmp_path, timeout=120)
    took = time.monotonic() - t0
    text = p.stdout + p.stderr
    assert p.returncode != 0, text[-4000:]
    (g,) = reports(out, "engine")
    assert g["died_at"] == 2 and [s["bad"] for s in g["steps"]] == [[], []], g
    # Noticed from the closed socket or the process's exit, not by waiting out a deadline.
    assert took < timeout_s, f"took {took:.1f}s; a dead engine must not wait out spec.refit.timeoutSeconds:\n{text[-4000:]}"
    assert "timed out" not in text, text[-4000:]
    # The sidecar saw the socket close (the only sign with code 0), or — with an error code, if
    # it came first — rlplane local saw the engine container exit: either way the engine is named.
    closed = "the engine process closed its connection to the sidecar before the job ended"
    why = final_error(p)
    if code == 0:
        assert "gen-0" in why and closed in why, why
    else:
        assert ("gen-0" in why and closed in why) or "the user's engine container" in why, why
    assert "trainer-0" not in why.splitlines()[0], why


def test_a_trainer_that_never_publishes_fails_the_run_with_the_sidecars_timeout(rlplane_bin: str, tmp_path: Path) -> None:
    """The trainer process takes step 1's batch and never publishes: after
    spec.refit.timeoutSeconds the rank gives up, and the run fails saying it waited for the
    trainer process to publish version 1."""
    out = tmp_path / "reports"
    out.mkdir()
    timeout_s = 8  # small; room for the trainer process to start and publish version 0 on a busy machine
    m = manifest(tmp_path, launch(1, "exact_trainer.py", "--report", str(out), "--stall-at", "1", "--stall-s", "60"),
                 launch(1, "exact_engine.py", "--report", str(out)), steps=2, data=1, engines=1, timeout_s=timeout_s)
    t0 = time.monotonic()
    p = run_local(rlplane_bin, m, tmp_path, timeout=90)
    took = time.monotonic() - t0
    text = p.stdout + p.stderr
    assert p.returncode != 0, text[-4000:]
    (t,) = reports(out, "trainer")
    assert t["stalled_at"] == 1 and [x["version"] for x in t["publish"]] == [0], t
    # The rank's own deadline reports, not the coordinator's generic one ("… waiting for
    # trainer-0 to finish update"), and the blame goes to the trainer, not to the engine whose
    # rank exited first once the coordinator gave up.
    why = final_error(p)
    assert "trainer-0" in why and "timed out waiting for the trainer process to publish version 1" in why, why
    assert "gen-0" not in why, why
    assert took < 60, f"took {took:.1f}s with timeoutSeconds {timeout_s}"
