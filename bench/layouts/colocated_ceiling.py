"""The copy ceiling of a colocated refit across GPUs, measured with PyTorch on the same machine.

Layout: a trainer of tensor-parallel degree ``--tp`` replicated over the GPUs (data-parallel
replicas of ``--tp`` consecutive GPUs each), one engine per GPU holding the whole model. rlplane
refits each engine from the replica that shares its GPUs (api/src/topology.rs,
``colocated_refit_groups``): every GPU copies its own shard locally and takes each other shard of
its replica over NVLink, once. The ceiling is that traffic with nothing else: on every GPU at
once, one device-to-device copy of its shard and, for each other GPU of its replica, a peer copy
of that GPU's shard pushed from there (the copy is issued on the source GPU, as rlplane's CUDA IPC
transport does), each on a stream of its own. It prints the median wall time of ``--iters`` rounds
after ``--warmup`` rounds, every GPU synchronized, and what each GPU's links carried.

    python bench/layouts/colocated_ceiling.py --gpus 4 --tp 2 --bytes 16060522496
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, required=True, help="GPUs, one engine and one trainer rank on each")
    ap.add_argument("--tp", type=int, required=True, help="trainer tensor-parallel degree (GPUs of one replica)")
    ap.add_argument("--bytes", type=int, required=True, help="bytes of the whole model")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    if a.gpus > torch.cuda.device_count() or a.gpus % a.tp:
        raise SystemExit(f"--gpus {a.gpus} must be a multiple of --tp {a.tp} and at most {torch.cuda.device_count()}")
    shard = a.bytes // a.tp // 256 * 256
    devs = [torch.device("cuda", g) for g in range(a.gpus)]
    src = [torch.empty(shard, dtype=torch.uint8, device=d) for d in devs]
    dst = [torch.empty(shard * a.tp, dtype=torch.uint8, device=d) for d in devs]
    streams = [[torch.cuda.Stream(device=d) for _ in range(a.tp)] for d in devs]
    for s in src:
        s.fill_(7)

    def round_once() -> float:
        for d in devs:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for g in range(a.gpus):
            base = g - g % a.tp
            for k in range(a.tp):
                q = base + k  # the GPU holding shard k of g's replica
                part = dst[g][k * shard : (k + 1) * shard]
                with torch.cuda.device(devs[q]), torch.cuda.stream(streams[q][(g - base) % a.tp]):
                    part.copy_(src[q], non_blocking=True)
        for d in devs:
            torch.cuda.synchronize(d)
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        round_once()
    times = [round_once() for _ in range(a.iters)]
    for g in range(a.gpus):
        base = g - g % a.tp
        ok = all(bool((dst[g][k * shard : k * shard + 4096] == 7).all()) for k in range(a.tp))
        if not ok:
            raise SystemExit(f"GPU {g}: the copied bytes differ")
    p50 = statistics.median(times)
    peer = shard * (a.tp - 1)
    print(
        f"ceiling: {a.gpus} GPUs, replicas of {a.tp}: each GPU copies {shard / 1e9:.2f} GB locally and takes "
        f"{peer / 1e9:.2f} GB over NVLink (sends the same): p50 {p50 * 1e3:.2f} ms, "
        f"min {min(times) * 1e3:.2f} ms, {a.bytes / p50 / 1e9:.1f} GB/s per engine"
    )


if __name__ == "__main__":
    main()
