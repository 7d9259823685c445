#!/usr/bin/env bash
# rlplane's GPU tests and benchmarks, as recorded in docs/benchmarks.md.
# Usage: scripts/gpu-bench.sh DIR [STEP...]
#   DIR holds the release `rlplane` binary and the `gpu-tests` executable (the path printed by
#   `cargo test --release -p rlplane --test gpu --no-run`).
#   STEPs (default: all): tests split auto colocated window sharded local colocated4 colocated2 control
#   mps (colocated on one GPU with and without the MPS daemon, each refit's receiver timeline)
# Every step has its own time limit, so that one hang cannot eat the rest.
set -u
dir=${1:?usage: scripts/gpu-bench.sh DIR [STEP...]}
shift
steps=${*:-tests split auto colocated window sharded local colocated4 colocated2 control mps}
bin=$dir/rlplane
# NVLink multicast stays off on shared machines (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RLPLANE_BIN=$bin RLPLANE_LOG=${RLPLANE_LOG:-warn}
want() { [[ " $steps " == *" $1 "* ]]; }
step() { echo; echo "=== $*"; }
step machine
nvidia-smi -L
nvidia-smi topo -m 2>/dev/null | head -8
python3 -c 'import nvidia.nccl; print("pip NCCL:", list(nvidia.nccl.__path__)[0])' 2>/dev/null || echo "no pip NCCL"
gpus=$(nvidia-smi -L | wc -l)
llama="--model llama3-8b --bucket-bytes 1073741824 --buffers 2 --iters 10"
if want tests; then step "GPU tests"; timeout 240 "$dir/gpu-tests" --test-threads 1 --nocapture; fi
if want split; then step "split refit over NCCL, 1 receiver"; timeout 120 "$bin" bench refit --transport nccl --receivers 1 $llama; fi
if want auto; then step "split refit, auto (NCCL vs CUDA IPC copy engines)"; timeout 150 "$bin" bench refit --transport auto --receivers 1 $llama; fi
if want colocated; then step "colocated refit over CUDA IPC (direct vs staged)"; timeout 150 "$bin" bench refit --transport cuda-ipc --colocated --receivers 1 $llama; fi
if want window; then
  # The colocated refit's spread across processes (each bench run is a fresh pair of processes),
  # alternating every bucket in flight (the default) and two at a time (RLPLANE_IPC_WINDOW=buffers,
  # the window of staging buffers, which direct copies do not need), at two bucket sizes.
  for i in 1 2 3; do
    for bucket in 1073741824 268435456; do
      for window in buffers all; do
        step "colocated refit, run $i, buckets of $bucket bytes, in flight: $window"
        RLPLANE_IPC_WINDOW=$window timeout 150 "$bin" bench refit --transport cuda-ipc --colocated --receivers 1 \
          --model llama3-8b --bucket-bytes $bucket --buffers 2 --iters 10
      done
    done
  done
fi
if want sharded && [ "$gpus" -ge 4 ]; then
  step "sharded refit, tp=2 -> 2 receivers, vs gather-then-broadcast"
  timeout 180 "$bin" bench refit --transport nccl --source sharded --tp 2 --receivers 2 $llama
fi
if want local && [ "$gpus" -ge 4 ]; then
  step "the whole loop on 4 GPUs, split: Auto (NCCL for 2 senders x 2 receivers), then CUDA IPC"
  timeout 150 "$bin" local manifests/rljob-gpu-4.yaml
  timeout 150 "$bin" local manifests/rljob-gpu-4.yaml --transport cuda-ipc
  step "the whole loop on 4 GPUs, colocated (CUDA IPC on each GPU)"
  timeout 150 "$bin" local manifests/rljob-gpu-colocated-4.yaml
fi
if want colocated4 && [ "$gpus" -ge 4 ]; then
  # Colocated across GPUs against its copy ceiling, alternated: each GPU copies its own 8 GB shard
  # and takes the other 8 GB of its replica over NVLink (bench/layouts/colocated_ceiling.py; the
  # plan's prediction: rlplane bench layout manifests/rljob-gpu-colocated-4.yaml).
  for i in 1 2; do
    step "colocated across 4 GPUs, run $i: the layout's copy ceiling, then rlplane local"
    timeout 120 python3 bench/layouts/colocated_ceiling.py --gpus 4 --tp 2 --bytes 16060522496
    timeout 150 "$bin" local manifests/rljob-gpu-colocated-4.yaml
  done
fi
if want colocated2 && [ "$gpus" -ge 2 ]; then
  # The same traffic per GPU on two GPUs (FSDP 2 and TP 2: 8 GB local + 8 GB over NVLink each),
  # and data-parallel 2, where each GPU's replica refits its own engine (16 GB local each).
  for i in 1 2; do
    step "colocated on 2 GPUs, run $i: ceilings, then FSDP 2, TP 2, data-parallel 2"
    timeout 120 python3 bench/layouts/colocated_ceiling.py --gpus 2 --tp 2 --bytes 16060522496
    timeout 120 python3 bench/layouts/colocated_ceiling.py --gpus 2 --tp 1 --bytes 16060522496
    for layout in fsdp2 tp2 dp2; do
      timeout 150 "$bin" local bench/layouts/rljob-colocated-2-$layout.yaml 2>&1 | grep -E "^refit|GPU|error"
    done
  done
fi
if want control; then
  step "control plane: dispatch latency against a raw TCP ping-pong"
  timeout 60 "$bin" bench control --ranks 1 --commands 2000
  timeout 60 "$bin" bench control --ranks 8 --commands 1000
fi
if want mps; then
  # Colocated on one GPU, the trainer's and the engine's processes are two CUDA contexts: the
  # bench (with each refit's receiver timeline from the debug log, summarized) and the whole loop,
  # alternated without and with the MPS daemon (pipe and log directories of its own under /tmp;
  # the GPU's compute mode is left as it is, and the daemon quits after each run).
  timeline() {
    python3 - "$1" <<'PY'
import re, statistics, sys
text = open(sys.argv[1]).read().splitlines()
for l in text:
    if re.search(r"direct \(1 copy\)|reference: .*4 stream|direct ÷ reference.*4 stream", l):
        print(re.sub(r"\s{2,}", " ", l))
# The direct variant's refits come first (3 warm-ups, then the 10 timed); the staged ones follow.
lines = [l for l in text if "receiver's timeline" in l][3:13]
keys = ["first_issued_ms", "copies_on_gpu_ms", "completed_ms", "confirmed_ms"]
vals = {k: [float(m.group(1)) for l in lines for m in [re.search(k + r"=([0-9.]+)", l)] if m] for k in keys}
print("receiver's timeline, medians of", len(lines), "refits:", " ".join(f"{k} {statistics.median(v):.3f}" for k, v in vals.items() if v))
PY
  }
  mps_dir=$(mktemp -d)
  for i in 1 2; do
    for mps in off on; do
      if [ $mps = on ]; then
        export CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe CUDA_MPS_LOG_DIRECTORY=$mps_dir/log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d || { echo "no MPS daemon here"; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; break; }
      fi
      step "colocated on one GPU, run $i, MPS $mps: the bench with its receiver timeline, then the loop"
      RLPLANE_LOG="warn,rlplane_refit::transport::cuda_ipc=debug" timeout 150 "$bin" bench refit --transport cuda-ipc \
        --colocated --receivers 1 $llama > "$mps_dir/bench.txt" 2>&1
      timeline "$mps_dir/bench.txt"
      timeout 120 "$bin" local manifests/rljob-gpu-colocated-1.yaml 2>&1 | grep -E "^refit"
      if [ $mps = on ]; then
        echo quit | nvidia-cuda-mps-control
        sleep 1
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      fi
    done
  done
fi
