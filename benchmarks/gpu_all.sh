#!/usr/bin/env bash
# Runs, one after another, the benchmarks whose numbers depend on the
# accelerator, at the sizes of the seeds' recipes, and keeps what they print:
#
#   bash benchmarks/gpu_all.sh DIR
#
# Sized for a GPU lent for 15 minutes, compiles included: the fused kernel's
# GPU tests first, then moderate sizes before large ones, each script's rows
# printed as they finish, and whatever would start after the total budget
# skipped. DIR/<script>.txt holds each script's output, DIR/hlo/ the compiled
# HLO of every train-step variant (to read fusions, copies and conditionals
# later, without the accelerator). A script that fails does not stop the
# others; the exit status says whether any failed.
#
#   GPU_ALL_BUDGET=SECONDS  the whole run (default 720); each script gets
#                           what is left, at most its own share below
#   ROUNDS=N                every script's interleaved timing rounds
#   QCOST_BUDGET=SECONDS    rows of quantized_step_cost.py at 4 x 1024
#                           (default 100)
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: bash benchmarks/gpu_all.sh DIR" >&2
  exit 2
fi
mkdir -p "$1/hlo"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(cd .. && pwd)${PYTHONPATH:+:$PYTHONPATH}"
budget=${GPU_ALL_BUDGET:-720}
failed=()

run() {  # run SHARE SCRIPT ARGS...: one step, at most SHARE seconds
  local share=$1 name=$2 start=$SECONDS left
  shift 2
  left=$((budget - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "== skipped $name $*: ${left} s of the budget left"
    return
  fi
  [ "$share" -gt "$left" ] && share=$left
  echo "== $name $* (at most ${share} s)"
  if ! timeout "$share" "$@" 2>&1 | tee -a "$out/$name.txt"; then
    failed+=("$name")
  fi
  echo "[$name: $((SECONDS - start)) s; $((budget - SECONDS)) s left]"
}

python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax",
flax.__version__, "optax", optax.__version__, jax.devices())'
# The kernels compiled by Triton (fused 8/4-bit Adam, block-scaled FP8
# GEMM): equal to the XLA path, run by the recipes.
run 60 tests python3 -m pytest -q -p no:cacheprovider -n 0 -k gpu \
  ../tests/test_fused_quantized.py ../tests/test_fp8_block_gemm.py
# The fused Adam kernel at 4 and 8 warps per program (registers: 191, 78).
run 60 fused_adam_warps python3 fused_adam_warps.py --rounds "${ROUNDS:-7}"
# 8-bit states and the fused quantized_adam kernel against SR(adam) at the
# seeds' 3 x 4096, then every row at 4 x 1024.
run 120 quantized_step_cost python3 quantized_step_cost.py --xla-path \
  --width 4096 --depth 3 --batch 512 --budget 90 --rounds "${ROUNDS:-7}" \
  --only "adam, 8));quantized_adam" --dump "$out/hlo"
# The block-scaled FP8 GEMM kernel alone, against bf16 and the scan.
run 80 fp8_block_gemm python3 fp8_block_gemm.py --rounds "${ROUNDS:-5}"
# Fine FP8 at d=4096, each variant timed against bf16 as it is built; "row"
# last: on an H100 its step had not compiled after 180 s.
run 150 gpu_fp8 python3 gpu_fp8.py --dump "$out/hlo" --rounds "${ROUNDS:-5}" \
  --variants fp8-current fp8-block fp8-mx fp8-row
run 150 quantized_step_cost python3 quantized_step_cost.py \
  --budget "${QCOST_BUDGET:-100}" --rounds "${ROUNDS:-7}"
# The seeds' MLP (PyTorch's and Paddle's AMP recipes): 3 x 4096, batch 512.
run 150 optimizer_memory python3 optimizer_memory.py --width 4096 --depth 3 \
  --batch 512 --rounds "${ROUNDS:-9}" --dump "$out/hlo"
run 100 fp8_native_probe python3 fp8_native_probe.py --rounds "${ROUNDS:-5}"
run 100 gpu_step python3 gpu_step.py --dump "$out/hlo" --rounds "${ROUNDS:-15}"
run 100 loss_scaling_overhead python3 loss_scaling_overhead.py --width 4096 \
  --depth 3 --batch 512 --rounds "${ROUNDS:-9}"

if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
