#!/usr/bin/env bash
# Refit through the Python client against `rlplane bench refit` for the same bytes, in one run
# (docs/benchmarks.md, "Through the Python client").
# Usage: scripts/client-bench.sh BIN [gpu] [cpu] [grpo] [split] [grpo-split] [sharded]
#   BIN: the release rlplane binary. python must import torch and numpy; the client is taken
#   from ./python (PYTHONPATH) when it is not installed.
#   gpu:  Llama-3-8B-sized tensors, colocated on GPU 0 (CUDA IPC)  vs  bench refit --colocated
#   cpu:  Qwen3-0.6B-sized tensors, split over TCP                  vs  bench refit --transport tcp
#   grpo: examples/tiny-grpo colocated on GPU 0, checked against its CUDA reference loop
#   split: Llama-3-8B-sized tensors, trainer on GPU 0, engine on GPU 1 (NCCL)  vs  bench refit --transport nccl
#   grpo-split: examples/tiny-grpo with the trainer and the engine on two GPUs (NCCL)
#   sharded: 4 GPUs: a TP-2 trainer's two ranks register their shards, two engines (NCCL)
#            vs  bench refit --source sharded --tp 2 --receivers 2
set -u
bin=$(realpath "${1:?usage: scripts/client-bench.sh BIN [gpu] [cpu] [grpo] [split] [grpo-split] [sharded]}")
shift
what=${*:-gpu cpu}
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 RLPLANE_LOG=${RLPLANE_LOG:-warn}
# The manifests run `python …`: make sure that name exists.
if ! command -v python >/dev/null; then
  mkdir -p /tmp/rlplane-python-bin && ln -sf "$(command -v python3)" /tmp/rlplane-python-bin/python
  export PATH=/tmp/rlplane-python-bin:$PATH
fi
out=${OUT:-/tmp}
summary() { grep -h '"summary"' "$1" | tail -1 | sed 's/^\[[^]]*\] //'; }
if [[ " $what " == *" gpu "* ]]; then
  echo "=== GPU: client refit of Llama-3-8B-sized torch tensors, colocated (CUDA IPC)"
  timeout 300 "$bin" local bench/client/rljob-colocated-8b.yaml > "$out/client-gpu.log" 2>&1; echo "rc=$?"
  tail -8 "$out/client-gpu.log"
  echo "=== GPU: rlplane bench refit, same bytes, same run"
  timeout 200 "$bin" bench refit --transport cuda-ipc --colocated --receivers 1 --model llama3-8b \
    --bucket-bytes 1073741824 --buffers 2 --iters 10 2>&1 | tee "$out/bench-gpu.log" | tail -14
fi
if [[ " $what " == *" cpu "* ]]; then
  echo "=== CPU: client refit of Qwen3-0.6B-sized torch tensors, split over TCP"
  timeout 300 "$bin" local bench/client/rljob-cpu.yaml > "$out/client-cpu.log" 2>&1; echo "rc=$?"
  tail -8 "$out/client-cpu.log"
  echo "=== CPU: rlplane bench refit --transport tcp, same bytes, same run"
  timeout 200 "$bin" bench refit --transport tcp --receivers 1 --model qwen3-0.6b --bucket-bytes 268435456 \
    --buffers 2 --iters 10 2>&1 | tee "$out/bench-cpu.log" | tail -10
fi
# tiny-grpo through rlplane (manifest $1, results named $2) against the CUDA reference loop,
# which runs once per invocation: equal step for step, the probe logits compared at every step.
grpo_vs_reference() {
  if [ -z "${ref_done:-}" ]; then
    (cd examples/tiny-grpo && timeout 200 python reference.py --device cuda --out "$out/ref-cuda.json" \
      > "$out/ref-cuda.log" 2>&1; tail -1 "$out/ref-cuda.log")
    ref_done=1
  fi
  TINY_GRPO_RESULT=$out/$2.json timeout 300 "$bin" local "$1" > "$out/$2.log" 2>&1
  echo "rc=$?"; tail -12 "$out/$2.log"
  python - "$out" "$2" <<'PY'
import json, sys
o, run = sys.argv[1], sys.argv[2]
strip = lambda r: [{k: v for k, v in x.items() if k not in ("elapsed_s", "refit_s")} for x in r["curve"]]
rs = {n: json.load(open(f"{o}/{n}.json")) for n in ("ref-cuda", run)}
for n, r in rs.items(): print(n, "steps", r["steps"], "first", r["first_reward"], "final", r["final_reward"], "passed", r["passed"])
print("probe logits compared (and equal) for versions:", [x["probe"]["version"] for x in rs[run]["curve"]])
print("rlplane run equals the CUDA reference step for step:", strip(rs["ref-cuda"]) == strip(rs[run]))
PY
}
if [[ " $what " == *" grpo "* ]]; then
  echo "=== tiny-grpo colocated on one GPU"
  grpo_vs_reference examples/tiny-grpo/rljob-gpu-colocated.yaml grpo-gpu
fi
if [[ " $what " == *" split "* ]]; then
  echo "=== 2 GPUs: client refit of Llama-3-8B-sized torch tensors, split (NCCL)"
  timeout 300 "$bin" local bench/client/rljob-split-8b.yaml > "$out/client-split.log" 2>&1; echo "rc=$?"
  tail -8 "$out/client-split.log"
  echo "=== 2 GPUs: rlplane bench refit --transport nccl, same bytes, same run"
  timeout 200 "$bin" bench refit --transport nccl --receivers 1 --model llama3-8b \
    --bucket-bytes 1073741824 --buffers 2 --iters 10 2>&1 | tee "$out/bench-split.log" | tail -14
fi
if [[ " $what " == *" grpo-split "* ]]; then
  echo "=== tiny-grpo on two GPUs (NCCL)"
  grpo_vs_reference examples/tiny-grpo/rljob-gpu-split.yaml grpo-split
fi
if [[ " $what " == *" sharded "* ]]; then
  echo "=== 4 GPUs: client refit of Llama-3-8B-sized torch tensors from a TP-2 trainer to 2 engines (NCCL)"
  timeout 300 "$bin" local bench/client/rljob-sharded-8b.yaml > "$out/client-sharded.log" 2>&1; echo "rc=$?"
  grep -h '"summary"' "$out/client-sharded.log" | tail -2
  tail -4 "$out/client-sharded.log"
  echo "=== 4 GPUs: rlplane bench refit --source sharded --tp 2 --receivers 2, same bytes, same run"
  timeout 200 "$bin" bench refit --transport nccl --source sharded --tp 2 --receivers 2 --model llama3-8b \
    --bucket-bytes 1073741824 --buffers 2 --iters 10 2>&1 | tee "$out/bench-sharded.log" | tail -14
fi
