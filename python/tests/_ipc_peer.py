"""The other process of test_cuda_ipc.py (CUDA IPC handles cannot be opened by the process that
made them). `export`: makes tensors, prints their cuda_ipc descriptors, then checks what the test
wrote into them. `import`: reads descriptors from stdin, opens them with rlplane.torch, prints
their values' sums."""

from __future__ import annotations

import json
import sys

import torch

import rlplane.torch as rt


def export() -> None:
    big = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
    a = big[:1000]
    a.copy_(torch.arange(1000, dtype=torch.float32, device="cuda"))
    b = big[4096 : 4096 + 64].view(torch.bfloat16)  # 128 bf16 values at byte offset 16384
    b.copy_(torch.linspace(-1, 1, 128, device="cuda").to(torch.bfloat16))
    c = torch.full((3, 5), 7, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    out = {
        "a": {"dtype": "f32", "shape": [1000], "memory": rt.cuda_ipc_descriptor(a, "a")},
        "b": {"dtype": "bf16", "shape": [128], "memory": rt.cuda_ipc_descriptor(b, "b")},
        "c": {"dtype": "i64", "shape": [3, 5], "memory": rt.cuda_ipc_descriptor(c, "c")},
        "b_sum": float(b.float().sum()),
    }
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # the test wrote into `a`
    torch.cuda.synchronize()
    ok = bool(torch.all(a == 42.0)) and bool(torch.all(big[1000:4096] == 0))
    print("ok" if ok else f"bad: a[:4]={a[:4].tolist()}", flush=True)


def import_() -> None:
    descs = json.loads(sys.stdin.readline())
    sums = {}
    for name, d in descs.items():
        t = rt.open_cuda_ipc(d["memory"], d["dtype"], d["shape"])
        sums[name] = float(t.double().sum())
    print(json.dumps(sums), flush=True)


if __name__ == "__main__":
    {"export": export, "import": import_}[sys.argv[1]]()
