"""Runs tiny-grpo synchronously and asynchronously in turns and compares them.

    python examples/tiny-grpo/compare_schedules.py --rounds 3     (from the repository root)

Each round runs `rlplane local examples/tiny-grpo/rljob-async.yaml` with `--max-policy-lag 0`
(the synchronous schedule, the reference) and then with the manifest's own lag (1): the same
job, the trainer and the engine each pinned to a core of their own. It prints, per schedule, the
median round's steps per second (rlplane's summary: the run's steps over their wall time), its
ratio to the synchronous run's in the same session, the steps the reward took to reach the bar
(mean over 3 steps ≥ grpo.Config.pass_reward), and the policy lag the trainer received.

Needs the rlplane binary ($RLPLANE_BIN, or target/release/rlplane, or target/debug/rlplane) and
PyTorch in this interpreter.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent
REPO = EXAMPLE.parent.parent


def rlplane_bin() -> str:
    env = os.environ.get("RLPLANE_BIN")
    for c in [env] if env else [str(REPO / "target" / d / "rlplane") for d in ("release", "debug")]:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("no rlplane binary: set RLPLANE_BIN or run `cargo build --release -p rlplane`")


def run(binary: str, job: Path, lag: int, scratch: Path) -> dict:
    """One run; its rlplane summary and the trainer's result."""
    summary, result = scratch / f"summary-{lag}.json", scratch / f"result-{lag}.json"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               PYTHONPATH=str(REPO / "python"), TINY_GRPO_RESULT=str(result))
    p = subprocess.run([binary, "local", str(job), "--max-policy-lag", str(lag), "--json", str(summary)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"rlplane local --max-policy-lag {lag} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return {"summary": json.loads(summary.read_text())["summary"], "result": json.loads(result.read_text())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--job", default=str(EXAMPLE / "rljob-async.yaml"))
    ap.add_argument("--lag", type=int, default=1, help="the asynchronous run's maxPolicyLag")
    ap.add_argument("--json", help="write every round's numbers here")
    args = ap.parse_args()
    binary = rlplane_bin()
    runs: dict[int, list[dict]] = {0: [], args.lag: []}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for lag in runs:
                out = run(binary, Path(args.job), lag, Path(scratch))
                runs[lag].append(out)
                s, res = out["summary"], out["result"]
                print(f"round {r + 1}: maxPolicyLag {lag}: {s['steps_per_s']:.2f} steps/s, reward bar at step "
                      f"{res['steps_to_pass']}, final reward {res['final_reward']}", file=sys.stderr, flush=True)
    rows = []
    for lag, rs in runs.items():
        rs = sorted(rs, key=lambda o: o["summary"]["steps_per_s"])
        median = rs[len(rs) // 2]
        rows.append({"max_policy_lag": lag, "steps_per_s": [o["summary"]["steps_per_s"] for o in runs[lag]],
                     "median_steps_per_s": median["summary"]["steps_per_s"],
                     "steps_to_pass": [o["result"]["steps_to_pass"] for o in runs[lag]],
                     "passed": all(o["result"]["passed"] for o in runs[lag]),
                     "policy_lag_max": max(o["summary"]["policy_lag_max"] for o in runs[lag]),
                     "policy_lag_mean": median["summary"]["policy_lag_mean"]})
    sync = rows[0]
    print(f"{'schedule':<28}{'steps/s':>9}{'vs sync':>9}{'bar at step':>13}{'vs sync':>9}{'lag max':>9}{'passed':>8}")
    for row in rows:
        bar = max(s for s in row["steps_to_pass"] if s is not None) if all(row["steps_to_pass"]) else None
        sync_bar = max(sync["steps_to_pass"]) if all(sync["steps_to_pass"]) else None
        name = "synchronous" if row["max_policy_lag"] == 0 else f"asynchronous, lag {row['max_policy_lag']}"
        ratio = f"{bar / sync_bar:.2f}×" if bar and sync_bar else "-"
        print(f"{name:<28}{row['median_steps_per_s']:>9.2f}{row['median_steps_per_s'] / sync['median_steps_per_s']:>8.2f}×"
              f"{str(bar):>13}{ratio:>9}{row['policy_lag_max']:>9}{str(row['passed']):>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
