"""Starts one process per local rank, as torchrun does for a pod's ranks: `launch.py N script.py
args…` runs `script.py args…` N times with LOCAL_RANK=0..N-1 and exits non-zero if any fails.

`rlplane local` runs a template's container command once per pod; a pod with N ranks of a role
needs N user processes, one per socket."""

from __future__ import annotations

import os
import subprocess
import sys


def main() -> int:
    n = int(sys.argv[1])
    procs = []
    for i in range(n):
        env = dict(os.environ, LOCAL_RANK=str(i))
        procs.append(subprocess.Popen([sys.executable, *sys.argv[2:]], env=env))
    codes = [p.wait() for p in procs]
    bad = [(i, c) for i, c in enumerate(codes) if c != 0]
    if bad:
        print(f"launch.py: local ranks failed (rank, exit code): {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
