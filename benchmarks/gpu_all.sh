#!/usr/bin/env bash
# Runs, one after another, the benchmarks whose numbers depend on the
# accelerator, at the sizes of the seeds' recipes, and keeps what they print:
#
#   bash benchmarks/gpu_all.sh DIR
#
# DIR/<script>.txt holds each script's tables, DIR/hlo/ the compiled HLO of
# every train-step variant (to read fusions, copies and conditionals later,
# without the accelerator). A script that fails does not stop the others; the
# exit status says whether any failed. GPU_ALL_LIMIT=SECONDS stops each script
# after that long (for a leased machine's short budget; default: no limit),
# ROUNDS=N sets every script's interleaved timing rounds.
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: bash benchmarks/gpu_all.sh DIR" >&2
  exit 2
fi
mkdir -p "$1/hlo"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
failed=()

run() {  # run SCRIPT ARGS...: one benchmark, its output teed to DIR
  local name=$1 start=$SECONDS
  shift
  echo "== python $name.py $*"
  if ! timeout "${GPU_ALL_LIMIT:-0}" python3 "$name.py" "$@" 2>&1 \
      | tee -a "$out/$name.txt"; then
    failed+=("$name")
  fi
  echo "[$name: $((SECONDS - start)) s]"
}

python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax",
flax.__version__, "optax", optax.__version__, jax.devices())'
# 8/4-bit states (and the fused quantized_adam kernel) against SR(adam):
# moderate size first, each row printed as it finishes, the rest skipped
# once its budget (QCOST_BUDGET seconds, default 240) is spent.
run quantized_step_cost --fused --budget "${QCOST_BUDGET:-240}" \
  --rounds ${ROUNDS:-7} --dump "$out/hlo"
run quantized_step_cost --fused --width 4096 --depth 3 --batch 512 \
  --budget "${QCOST_BUDGET:-240}" --rounds ${ROUNDS:-7} \
  --only "adam, 8));quantized_adam(8)"
# The seeds' MLP (PyTorch's and Paddle's AMP recipes): 3 x 4096, batch 512.
run optimizer_memory --width 4096 --depth 3 --batch 512 --rounds ${ROUNDS:-9} \
  --dump "$out/hlo"
run gpu_fp8 --dump "$out/hlo" --rounds ${ROUNDS:-5}
run fp8_native_probe --rounds ${ROUNDS:-5}
run gpu_step --dump "$out/hlo" --rounds ${ROUNDS:-15}
run loss_scaling_overhead --width 4096 --depth 3 --batch 512 --rounds ${ROUNDS:-9}

if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
