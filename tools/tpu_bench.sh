#!/usr/bin/env bash
# The ONE script for a TPU machine (BENCHMARKS.md, "TPU v5e"): one call of at most 9 minutes,
# everything written to $OUT (tpu_bench.md, tpu_bench.log, the JSON of each run).
#
#   OUT=<dir> bash tools/tpu_bench.sh      # on the TPU host, from the repository root
#   tools/tpu_bench.sh --dry-run           # here: JAX_PLATFORMS=cpu, preset tiny, the same steps
#
# On the TPU VM: python3 3.11 with JAX preinstalled; what it lacks (flax, optax, orbax, absl,
# matplotlib, tiktoken) comes from the machine's own index (TPU_INDEX, default file:///opt/pypi/simple)
# into /tmp/site, after the machine's JAX on PYTHONPATH. Then, each capped by CAP_S:
#   1. the splash kernel's tests, natively (tests/test_splash.py: kernel and twins against the reference)
#   2. launch.bench, single device, bf16 compute, float32 weights and AdamW moments unless stated:
#      gpt2_125m 16x1024 (bf16 weights and moments); gpt2_350m 16x1024 (bf16 weights and moments,
#      remat save_dot_except_mlp, 4 loss chunks); llama_v5e (bf16 weights and moments, no remat);
#      each reports its init too
#   3. tools/step_profile.py on each of those: device time per op kind, busy against idle
set -u -o pipefail
cd "$(dirname "$0")/.."
MODE=${1:-run}
if [[ $MODE == --dry-run ]]; then
  export JAX_PLATFORMS=cpu
  OUT=${OUT:-$(mktemp -d -t tpu_bench.XXXXXX)}
  PY=${PYTHON:-.venv/bin/python}
  RUNS=("tiny --batch_size=8" "tiny --batch_size=8 --weight_dtype=bfloat16 --remat=save_dot_except_mlp --loss_chunks=2")
  STEPS=(--steps=2 --warmup=1 --matmul_size=256 --matmul_reps=3)
  TESTS=()
  CAP_S=${CAP_S:-300}
elif [[ $MODE == run ]]; then
  OUT=${OUT:?OUT: the folder the results go to}
  PY=${PYTHON:-$(cd / && python3 -c 'import sys; print(sys.executable)')}  # the 3.11 with JAX, not .python-version's
  t0=$(date +%s)
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --only-binary=:all: \
    --index-url "${TPU_INDEX:-file:///opt/pypi/simple}" --target /tmp/site --upgrade \
    flax==0.12.8 optax orbax-checkpoint absl-py matplotlib tiktoken pytest 2>&1 | grep -v notice
  echo "install: $(( $(date +%s) - t0 )) s"
  export PYTHONPATH=$PWD:${PYTHONPATH:-}:/tmp/site
  # the best configuration of each preset (BENCHMARKS.md, "TPU"), each benchmarked, then profiled
  BF16="--weight_dtype=bfloat16"
  RUNS=("gpt2_125m --batch_size=16 $BF16" "gpt2_350m --batch_size=16 $BF16 --remat=save_dot_except_mlp --loss_chunks=4"
        "llama_v5e $BF16 --remat=none")
  STEPS=(--steps=10 --warmup=3)
  TESTS=(tests/test_splash.py)  # the kernel against the reference (the twins need 8 devices)
  CAP_S=${CAP_S:-100}
else
  echo "usage: tools/tpu_bench.sh [--dry-run]  (no argument: the TPU run)" >&2; exit 2
fi
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG=$OUT/tpu_bench.log
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tee -a "$LOG"
if (( ${#TESTS[@]} )); then
  # conftest simulates 8 CPU devices: the TPU run asks for the chip instead
  timeout "$CAP_S" env TWINSHARD_TEST_PLATFORM=tpu "$PY" -m pytest -q -p no:cacheprovider -o addopts="" "${TESTS[@]}" -k "reference or residuals" --tb=short 2>&1 \
    | tail -40 | tee -a "$LOG"
fi
i=0
for run in "${RUNS[@]}"; do
  i=$((i + 1))
  read -r preset rest <<< "$run"
  # shellcheck disable=SC2086
  timeout "$CAP_S" "$PY" -m launch.bench --preset="$preset" $rest --strategies=single --dtype=bfloat16 \
    "${STEPS[@]}" --json="$OUT/run$i.json" --markdown="$OUT/run$i.md.tmp" 2>&1 | grep -v "^[WI]0000" | tail -8 | tee -a "$LOG" \
    || echo "run $i ($run): failed or timed out" | tee -a "$LOG"
done
i=0
for run in "${RUNS[@]}"; do  # each run, profiled
  i=$((i + 1))
  # shellcheck disable=SC2086
  timeout "$CAP_S" "$PY" tools/step_profile.py --preset=$run --strategy=single --dtype=bfloat16 --steps=3 --top=12 \
    2>&1 | grep -v "^[WI]0000" | tee "$OUT/profile$i.txt" | tail -25 || echo "profile $i ($run): failed or timed out"
done
cat "$OUT"/run*.md.tmp > "$OUT/tpu_bench.md" 2>/dev/null && rm -f "$OUT"/run*.md.tmp  # 8 files in all
echo "results in $OUT"
