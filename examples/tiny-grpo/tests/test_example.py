"""Tests of the tiny-grpo example.

    python -m pytest examples/tiny-grpo

The last tests run the example through rlplane (`rlplane local`); they need the binary
($RLPLANE_BIN, or target/debug/rlplane of this checkout: `cargo build -p rlplane`) and skip
without it.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import grpo
import model
import task

EXAMPLE = Path(__file__).resolve().parent.parent
REPO = EXAMPLE.parent.parent


@pytest.mark.parametrize("job", ["rljob.yaml", "rljob-async.yaml", "rljob-gpu-colocated.yaml", "rljob-gpu-split.yaml"])
def test_job_lists_the_models_tensors(job):
    # The RLJob's spec.model.tensors must be TinyLM's manifest, else register_model is refused.
    text = (EXAMPLE / job).read_text()
    assert model.manifest_yaml(model.TinyLM(), indent=6) + "\n  trainer:" in text


def test_task_reward():
    prompt = task.make_prompts(1, seed=3)[0].tolist()
    digits = [t for t in prompt if t >= task.DIGIT0]
    assert prompt[-1] == task.SEP and task.MIN_DIGITS <= len(digits) <= task.MAX_DIGITS
    right = task.answer(prompt)
    assert right == digits[::-1]
    assert task.reward(prompt, right) == 1.0
    assert task.reward(prompt, right + [task.DIGIT0]) < 1.0  # rambling on costs
    assert task.reward(prompt, []) == 0.0
    assert torch.equal(task.make_prompts(4, seed=9), task.make_prompts(4, seed=9))


def test_group_advantages():
    reward = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.8])
    group = torch.tensor([7, 7, 3, 3, 7, 7])
    adv = grpo.group_advantages(reward, group)
    assert torch.allclose(adv[2:4], torch.zeros(2))  # equal rewards teach nothing
    g7 = adv[[0, 1, 4, 5]]
    assert abs(g7.mean().item()) < 1e-6 and abs(g7.std(unbiased=False).item() - 1) < 1e-4


def test_generate_marks_every_sampled_token():
    grpo.set_deterministic()
    cfg = grpo.Config(prompts_per_step=4, group_size=3)
    r = grpo.generate(grpo.make_policy(cfg), grpo.prompts_for_step(cfg, 1), cfg, 1)
    assert r.tokens.shape[0] == 12 and (r.group == torch.arange(4).repeat_interleave(3)).all()
    # Log-probs exactly where the mask is, and the mask is one run right after the prompt.
    assert ((r.old_logprobs != 0) == r.response_mask).all()
    assert not r.response_mask[:, : task.PROMPT_LEN].any()
    assert (r.response_mask[:, task.PROMPT_LEN]).all()
    # With unchanged weights, the trainer's log-probs reproduce the sampler's (ratio 1).
    policy = grpo.make_policy(cfg)
    lp = grpo.token_logprobs(policy, r.tokens, cfg.temperature)
    assert torch.allclose(lp[r.response_mask], r.old_logprobs[r.response_mask], atol=1e-5)


def test_columns_round_trip():
    # The trainer must rebuild exactly the engine's rollouts from the columns, in whatever order
    # the transfer queue hands the samples over.
    rlplane_columns = pytest.importorskip("rlplane.columns")
    import columns

    grpo.set_deterministic()
    cfg = grpo.Config(prompts_per_step=5, group_size=4)
    policy = grpo.make_policy(cfg)
    r = grpo.generate(policy, grpo.prompts_for_step(cfg, 2), cfg, 2)
    probe = grpo.probe_logits(policy, grpo.probe_prompts(cfg))
    cols = columns.to_columns(r, version=1, probe_logits=probe)

    n = len(r.reward)
    order = np.random.default_rng(0).permutation(n)
    wire = {}
    for name, v in cols.items():
        if isinstance(v, list):  # ragged: values back to back, plus row offsets
            rows = [np.asarray(v[i]) for i in order]
            offsets = np.concatenate([[0], np.cumsum([len(x) for x in rows])]).astype(np.uint64)
            wire[name] = rlplane_columns.Column(name, "", True, rows[0].shape[1:], np.concatenate(rows), offsets)
        else:
            wire[name] = rlplane_columns.Column(name, "", False, v.shape[1:], v[order], None)
    batch = rlplane_columns.Batch(step=2, keys=[str(i) for i in order], tokens=[1] * n, columns=wire)

    back, versions, probes = columns.from_batch(batch)
    for f in grpo.Rollouts.__dataclass_fields__:
        assert torch.equal(getattr(back, f), getattr(r, f)), f
    assert (versions == 1).all()
    assert len(probes) == 1 and probes[0][0] == 1 and torch.equal(probes[0][1], probe)


def test_reference_is_deterministic_and_checks_the_probe(tmp_path):
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        subprocess.run([sys.executable, str(EXAMPLE / "reference.py"), "--steps", "4", "--out", str(out)], check=True,
                       capture_output=True)
        runs.append(json.loads(out.read_text()))
    strip = lambda r: [{k: v for k, v in row.items() if k != "elapsed_s"} for row in r["curve"]]  # noqa: E731
    assert strip(runs[0]) == strip(runs[1])
    assert all(row["probe"] == {"version": row["step"] - 1, "engines": 1} for row in runs[0]["curve"])


@pytest.mark.skipif(not os.environ.get("TINY_GRPO_SLOW"), reason="set TINY_GRPO_SLOW=1 to run the full reference (about 15 s)")
def test_reference_learns(tmp_path):
    out = tmp_path / "ref.json"
    subprocess.run([sys.executable, str(EXAMPLE / "reference.py"), "--out", str(out)], check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert result["first_reward"] < 0.15 and result["passed"], result


# ---------------------------------------------------------------------------------------------
# Through rlplane


@pytest.fixture(scope="module")
def rlplane_bin() -> str:
    env = os.environ.get("RLPLANE_BIN")
    candidates = [env] if env else [str(REPO / "target" / d / "rlplane") for d in ("debug", "release")]
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    msg = f"no rlplane binary (set RLPLANE_BIN or run `cargo build -p rlplane`; looked at {candidates})"
    if os.environ.get("RLPLANE_PYTHON_REQUIRED") == "1":
        pytest.fail(msg + " (RLPLANE_PYTHON_REQUIRED=1: scripts/test builds it)")
    print(f"SKIPPED tiny-grpo through rlplane: {msg}", file=sys.stderr)
    pytest.skip(msg)


def rlplane_local(binary: str, job: Path, result: Path, *extra: str) -> subprocess.CompletedProcess:
    # The job's containers run `python examples/tiny-grpo/...` from the repository root, with
    # this interpreter and this checkout's client package.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               PYTHONPATH=str(REPO / "python"), TINY_GRPO_RESULT=str(result))
    return subprocess.run([binary, "local", str(job), *extra], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_rlplane_run_learns_and_follows_the_reference(rlplane_bin, tmp_path):
    run = rlplane_local(rlplane_bin, EXAMPLE / "rljob.yaml", tmp_path / "result.json", "--json",
                        str(tmp_path / "summary.json"))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    # The trainer's and the engine's scalars reached the job's step records (and so /metrics
    # and the RLJob status): the trainer's curve, and the engine's mean reward of the same rollouts.
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]["steps"]
    assert len(steps) == grpo.Config.steps
    for rec, row in zip(steps, result["curve"]):
        assert rec["scalars"]["loss"] == pytest.approx(row["loss"], abs=1e-4), (rec["scalars"], row)
        assert rec["scalars"]["reward_mean"] == pytest.approx(row["reward"], abs=1e-4)  # the curve rounds to 4 places
    assert result["steps"] == grpo.Config.steps
    # Every step compared the engine's probe logits for the weights it generated with; only the
    # last publish has no generation after it, and the result says so.
    assert [row["probe"] for row in result["curve"]] == [{"version": s, "engines": 1} for s in range(grpo.Config.steps)]
    assert result["unprobed_version"] == grpo.Config.steps
    assert result["first_reward"] < 0.15 and result["passed"], {k: v for k, v in result.items() if k != "curve"}

    # Refit moves the weights bit for bit and the columns restore the engine's order, so the
    # run is the reference run, step for step.
    subprocess.run([sys.executable, str(EXAMPLE / "reference.py"), "--out", str(tmp_path / "ref.json")], check=True,
                   capture_output=True)
    reference = json.loads((tmp_path / "ref.json").read_text())
    same = lambda r: [{k: v for k, v in row.items() if k not in ("elapsed_s", "refit_s")} for row in r["curve"]]  # noqa: E731
    assert same(result) == same(reference)


def test_an_asynchronous_run_learns_within_its_lag_bound_nearly_as_fast_per_step(rlplane_bin, tmp_path):
    """rljob-async.yaml (spec.schedule Asynchronous, maxPolicyLag 1; the decoupled PPO objective)
    against the same job run synchronously (--max-policy-lag 0). Both runs are deterministic:
    the schedule, not timing, fixes which weights generate each step (step s with those of step
    s - 2 from step 2 on). The asynchronous run trains every step on rollouts exactly one version
    behind, the trainer's probe check passes against the version each engine held, it clears the
    reward bar, and it gets there in at most 1.3 times the synchronous run's steps."""
    runs = {}
    for lag in (0, 1):
        result, summary = tmp_path / f"result-{lag}.json", tmp_path / f"summary-{lag}.json"
        run = rlplane_local(rlplane_bin, EXAMPLE / "rljob-async.yaml", result, "--max-policy-lag", str(lag),
                            "--json", str(summary))
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        runs[lag] = (json.loads(result.read_text()), json.loads(summary.read_text())["summary"])
    (sync, sync_summary), (asyn, asyn_summary) = runs[0], runs[1]
    assert sync["passed"] and asyn["passed"], (sync["final_reward"], asyn["final_reward"])
    assert sync_summary["policy_lag_max"] == 0 and asyn_summary["policy_lag_max"] == 1
    assert asyn_summary["max_policy_lag"] == 1 and asyn_summary["stale_dropped"] == 0
    # Step s trained on step s - 2's weights from step 2 on (the previous step's at step 1), and
    # the engine's probe logits for them equal the trainer's, bit for bit.
    assert [row["probe"] for row in asyn["curve"]] == [{"version": max(0, s - 2), "engines": 1} for s in range(1, 61)]
    assert [row["policy_lag"] for row in asyn["curve"]] == [0.0] + [1.0] * 59
    assert asyn["steps_to_pass"] <= 1.3 * sync["steps_to_pass"], (asyn["steps_to_pass"], sync["steps_to_pass"])


def test_rlplane_run_fails_when_the_engine_holds_other_weights(rlplane_bin, tmp_path):
    job = tmp_path / "rljob.yaml"
    job.write_text((EXAMPLE / "rljob.yaml").read_text().replace(
        "examples/tiny-grpo/engine.py", str(EXAMPLE / "tests" / "corrupt_engine.py")))
    run = rlplane_local(rlplane_bin, job, tmp_path / "result.json", "--steps", "2")
    assert run.returncode != 0
    assert "probe logits for weights version 0 differ" in run.stdout + run.stderr


def test_killed_mid_run_it_resumes_from_its_checkpoint_and_still_follows_the_reference(rlplane_bin, tmp_path):
    """The trainer checkpoints every 10 steps; at step 25 its process is killed (SIGKILL). rlplane
    local restarts the gang from the step-20 checkpoint, and the finished run is still the
    reference run, step for step: the policy, the optimizer and the curve came back exactly."""
    job = EXAMPLE / "rljob.yaml"
    assert "everySteps: 10" in job.read_text()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               PYTHONPATH=str(REPO / "python"), TINY_GRPO_RESULT=str(tmp_path / "result.json"),
               TINY_GRPO_CHECKPOINT_DIR=str(tmp_path / "checkpoints"))
    proc = subprocess.Popen([rlplane_bin, "local", str(job)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, killed = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed is None and '"step": 25,' in line:
                found = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "examples/tiny-grpo/train.py"],
                                       capture_output=True, text=True).stdout.split()
                assert found, "the trainer process is rlplane local's child"
                killed = int(found[0])
                os.kill(killed, signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        proc.kill()
    out = "".join(lines)
    assert killed is not None, out[-4000:]
    assert proc.returncode == 0, out[-4000:]
    assert "gang restart 1/3 with epoch 1, resuming after step 20" in out, out[-4000:]
    assert '"resumed": {"step": 20' in out, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == grpo.Config.steps and result["passed"], {k: v for k, v in result.items() if k != "curve"}
    subprocess.run([sys.executable, str(EXAMPLE / "reference.py"), "--out", str(tmp_path / "ref.json")], check=True,
                   capture_output=True)
    reference = json.loads((tmp_path / "ref.json").read_text())
    same = lambda r: [{k: v for k, v in row.items() if k not in ("elapsed_s", "refit_s")} for row in r["curve"]]  # noqa: E731
    assert same(result) == same(reference)
