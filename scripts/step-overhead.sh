#!/usr/bin/env bash
# Issue 14's figures on one GPU, as recorded in docs/benchmarks.md ("What surrounds the refit"):
# the refit check (spec.refit.verify) against the GPU's read bandwidth, the colocated refit's
# spread and fixed cost, and the whole loop's step overhead per verify policy.
# Usage: scripts/step-overhead.sh DIR [STEP...]
#   DIR holds the release `rlplane` binary and `gpu-tests` (see scripts/gpu-bench.sh).
#   STEPs (default: all): tests bench small local client
set -u
dir=${1:?usage: scripts/step-overhead.sh DIR [STEP...]}
shift
steps=${*:-tests bench small local client}
bin=$(realpath "$dir/rlplane")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RLPLANE_BIN=$bin RLPLANE_LOG=${RLPLANE_LOG:-warn}
want() { [[ " $steps " == *" $1 "* ]]; }
step() { echo; echo "=== $*"; }
nvidia-smi -L
if want tests; then
  step "GPU tests that fit one GPU"
  timeout 200 "$dir/gpu-tests" --test-threads 1 --nocapture 2>&1 | grep -E "SKIPPED|test result|panicked|agree|^test |refit over" | head -40
fi
llama="--model llama3-8b --bucket-bytes 1073741824 --buffers 2 --iters 10"
# Each colocated bench twice: a bucket's copies as one kernel launch (the default), and as one
# driver copy per tensor (RLPLANE_IPC_COPY=driver, as before), alternating.
if want bench; then
  for run in 1 2; do
    for copies in kernel driver; do
      step "colocated refit of Llama-3-8B with the refit check's cost, $copies copies, run $run"
      RLPLANE_IPC_COPY=$copies timeout 150 "$bin" bench refit --transport cuda-ipc --colocated --receivers 1 $llama
    done
  done
fi
if want small; then
  for model in qwen3-0.6b tiny; do
    for copies in kernel driver; do
      step "colocated refit of a small model ($model): the fixed cost per refit, $copies copies"
      RLPLANE_IPC_COPY=$copies timeout 100 "$bin" bench refit --transport cuda-ipc --colocated --receivers 1 \
        --model $model --bucket-bytes 1073741824 --buffers 2 --iters 20
    done
  done
fi
if want local; then
  for v in full sampled off; do
    step "rlplane local manifests/rljob-gpu-colocated-1.yaml --verify $v"
    timeout 150 "$bin" local manifests/rljob-gpu-colocated-1.yaml --verify "$v" 2>&1 | tail -7
  done
fi
if want client; then
  step "refit through the Python client (scripts/client-bench.sh gpu grpo)"
  timeout 420 scripts/client-bench.sh "$bin" gpu grpo
fi
