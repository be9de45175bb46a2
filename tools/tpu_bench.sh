#!/usr/bin/env bash
# The ONE script for a TPU machine (BENCHMARKS.md, "TPU v5e"): one call (507 s on one v5e), everything written to $OUT:
# tpu_bench.md, tpu_bench.log (with each step's seconds into the call), each run's JSON and whole log, and
# each profiled run's trace (trace<i>/single: TensorBoard's or Perfetto's to open) and its reading (profile<i>).
#
#   OUT=<dir> bash tools/tpu_bench.sh      # on the TPU host, from the repository root
#   tools/tpu_bench.sh --dry-run           # here: JAX_PLATFORMS=cpu, preset tiny, the same steps
#   OUT=<dir> bash tools/tpu_bench.sh levers         # the best run of each preset, then each option undone
#   LEVER_PRESETS=gpt2_125m OUT=<dir> bash tools/tpu_bench.sh levers   # one preset (~7 runs of 30-110 s)
#   tools/tpu_bench.sh --dry-run levers    # the same runs on tiny, on this CPU
#   OUT=<dir> bash tools/tpu_bench.sh int8  # llama_v5e in the preset's 2 sequences (int8_dw's best ratio): bf16, int8, int8_dw (3 runs of ~110 s)
#   INT8_PRESETS="gpt2_125m llama_v5e" OUT=<dir> bash tools/tpu_bench.sh int8   # both presets: 6 runs, past 10 minutes
#   tools/tpu_bench.sh --dry-run int8      # the same pair on tiny, on this CPU
#
# On the TPU VM: python3 3.11 with JAX preinstalled; what it lacks (flax, optax, orbax, absl,
# matplotlib, tiktoken) comes from the machine's own index (TPU_INDEX, default file:///opt/pypi/simple)
# into /tmp/site, after the machine's JAX on PYTHONPATH; qwix (--quantization=int8) and opt_einsum from
# that index or the wheels in QWIX_WHEELS (default .device/), where either has them. Then, each capped by CAP_S:
#   1. the splash kernel's tests, natively (tests/test_splash.py: kernel and twins against the reference)
#   2. launch.bench, single device, with no speed flag: the fast path (twinshard/hardware/fast_path.py) chooses
#      bf16 compute, bf16 weights and AdamW moments, bf16 logits and norms, q/k/v in the kernel's layout, the
#      layer stack unrolled and each preset's batch: gpt2_125m 16x1024; gpt2_350m 16x1024 (no remat, 2
#      micro-batches of 8); llama_v5e 4x2048 (no remat); each logs those choices and reports its init too
#   3. llama_v5e under --quantization=int8_dw (its matmuls in int8 forward and backward) beside step 2's bf16
#   4. steps 2 and 3's runs profiled: each traces 3 more steps in its own process (launch.bench --profile: no second
#      compile), then tools/step_profile.py --trace_dir reads each trace on the host's CPU: device time per op
#      kind, busy against idle, and the same compiled program priced op by op beside it (profile<i>.json)
set -u -o pipefail
T_START=$(date +%s)
cd "$(dirname "$0")/.."
MODE=${1:-run}
WHAT=${2:-}
if [[ $MODE == levers || $MODE == int8 ]]; then WHAT=$MODE MODE=run; fi
if [[ -n $WHAT && $WHAT != levers && $WHAT != int8 ]]; then
  echo "usage: tools/tpu_bench.sh [--dry-run] [levers|int8]  (no argument: the TPU run)" >&2; exit 2
fi
# The preset's best run, then each of the fast path's options undone alone by its flag (each run logs
# that the flag wins), and a splash block of the whole sequence with the scoped VMEM a block of 2048 needs.
lever_runs() {  # lever_runs "<preset> <flags>" <context_length> [chunked]
  local base=$1 t=$2
  LEVER_RUNS+=("$base" "$base --scan_unroll=1" "$base --logits_dtype=float32" "$base --norm_dtype=float32"
               "$base --qkv_layout=tokens" "$base --weight_dtype=float32" "$base --splash_fused_bwd=false"
               "$base --attention_block=$t --xla_tpu_scoped_vmem_limit_kib=98304")
  if [[ ${3:-} == chunked ]]; then LEVER_RUNS+=("$base --loss_chunks=4" "$base --loss_chunks=4 --loss_recompute=false"); fi
}
# int8 against bf16: a preset's run, then the same with --quantization=int8 and =int8_dw (which keep
# --qkv_layout=tokens: the heads layout's einsums are not quantized, so that pair is refused)
int8_runs() { INT8_RUNS+=("$1" "$1 --quantization=int8" "$1 --quantization=int8_dw"); }
LEVER_RUNS=() INT8_RUNS=()
if [[ $MODE == --dry-run ]]; then
  export JAX_PLATFORMS=cpu PREDICT_CHIP=v5e  # the profiles priced as if on a v5e: the tool's code checked
  OUT=${OUT:-$(mktemp -d -t tpu_bench.XXXXXX)}
  PY=${PYTHON:-.venv/bin/python}
  # off a TPU the fast path chooses nothing: the dry run names bf16 itself
  RUNS=("tiny --batch_size=8 --dtype=bfloat16 --weight_dtype=bfloat16 --remat=save_dot_except_mlp --loss_chunks=2")
  STEPS=(--steps=2 --warmup=1 --matmul_size=256 --matmul_reps=3)
  TESTS=()
  CAP_S=${CAP_S:-300}
  lever_runs "tiny --batch_size=8 --dtype=bfloat16 --attention=splash --scan_unroll=2" 128
  lever_runs "tiny --batch_size=8 --dtype=bfloat16 --weight_dtype=bfloat16 --scan_unroll=2" 128 chunked
  int8_runs "tiny --batch_size=8 --dtype=bfloat16 --weight_dtype=bfloat16"
  INT8_DW="tiny --batch_size=8 --dtype=bfloat16 --weight_dtype=bfloat16 --quantization=int8_dw"
elif [[ $MODE == run ]]; then
  OUT=${OUT:?OUT: the folder the results go to}
  PY=${PYTHON:-$(cd / && python3 -c 'import sys; print(sys.executable)')}  # the 3.11 with JAX, not .python-version's
  t0=$(date +%s)
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --only-binary=:all: \
    --index-url "${TPU_INDEX:-file:///opt/pypi/simple}" --target /tmp/site --upgrade \
    flax==0.12.8 optax orbax-checkpoint absl-py matplotlib tiktoken pytest 2>&1 | grep -v notice
  WHEELS=${QWIX_WHEELS:-.device} LINKS=()
  if [[ -d $WHEELS ]]; then LINKS=(--find-links "$WHEELS"); fi
  if ! PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --only-binary=:all: --no-deps "${LINKS[@]}" \
      --index-url "${TPU_INDEX:-file:///opt/pypi/simple}" --target /tmp/site --upgrade qwix==0.1.8 opt_einsum \
      > /tmp/qwix_install.log 2>&1; then  # its absence fails the int8 runs alone
    echo "qwix: neither the index nor $WHEELS has qwix==0.1.8 and opt_einsum; the --quantization=int8 runs will fail"
    tail -3 /tmp/qwix_install.log
  fi
  echo "install: $(( $(date +%s) - t0 )) s"
  export PYTHONPATH=$PWD:${PYTHONPATH:-}:/tmp/site
  # the best configuration of each preset (BENCHMARKS.md, "TPU"), each benchmarked, then profiled: the fast
  # path's, with no speed flag (2026-12-06 with them by hand: bf16 logits, norms and the heads layout -7.6% and
  # -5.1% a step; the stack unrolled -10.5%, -1.9% and -7.4%, compiles 41, 73 and 49 s; gpt2_350m without remat
  # in 2 micro-batches of 8, 367.9 ms against 439.8 with save_dot_except_mlp in one batch of 16; llama_v5e in 4
  # sequences, not the preset's 2, 31,959 tokens/s against 29,588)
  RUNS=("gpt2_125m --batch_size=16" "gpt2_350m --batch_size=16" "llama_v5e")
  STEPS=(--steps=10 --warmup=3)
  TESTS=(tests/test_splash.py)  # the kernel against the reference (the twins need 8 devices)
  # int8 beside bf16's best, in the same 4 sequences (2026-12-06: 211.7 against 256.3 ms; in 2, 111.2 against 138.3);
  # quantized, the fast path keeps the tokens layout (the heads layout's einsums are not quantized)
  INT8_DW="llama_v5e --quantization=int8_dw"
  for preset in ${INT8_PRESETS:-llama_v5e}; do  # each pair in the tokens layout, int8's
    case $preset in
      gpt2_125m) int8_runs "gpt2_125m --batch_size=16 --qkv_layout=tokens" ;;
      llama_v5e) int8_runs "llama_v5e --batch_size=2 --qkv_layout=tokens" ;;
      *) echo "INT8_PRESETS: unknown preset $preset (gpt2_125m, llama_v5e)" >&2; exit 2 ;;
    esac
  done
  CAP_S=${CAP_S:-150}  # an unrolled gpt2_350m compiles in 73 s
  for preset in ${LEVER_PRESETS:-gpt2_125m gpt2_350m llama_v5e}; do
    case $preset in
      gpt2_125m) lever_runs "${RUNS[0]}" 1024 ;;
      gpt2_350m) lever_runs "${RUNS[1]}" 1024 chunked ;;
      llama_v5e) lever_runs "${RUNS[2]}" 2048 ;;
      *) echo "LEVER_PRESETS: unknown preset $preset (gpt2_125m, gpt2_350m, llama_v5e)" >&2; exit 2 ;;
    esac
  done
else
  echo "usage: tools/tpu_bench.sh [--dry-run] [levers]  (no argument: the TPU run)" >&2; exit 2
fi
if [[ $WHAT == levers ]]; then  # the options' runs alone: no tests, no profiles, shorter runs
  RUNS=("${LEVER_RUNS[@]}") TESTS=() PROFILE=0 CAP_S=${LEVER_CAP_S:-130}
  STEPS=(--steps=6 --warmup=2 "${STEPS[@]:2}")
elif [[ $WHAT == int8 ]]; then  # bf16 and int8 pairs: no tests, no profiles (6 files back)
  RUNS=("${INT8_RUNS[@]}") TESTS=() PROFILE=0
else
  RUNS+=("$INT8_DW")  # int8 beside bf16's best, profiled alike
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
  # each run traces 3 more steps in its own process (launch.bench --profile): no second compile
  PROFILE_FLAG=() && (( ${PROFILE:-1} )) && PROFILE_FLAG=(--profile="$OUT/trace$i")
  t_run=$(date +%s)
  echo "== run $i ($(( t_run - T_START )) s into the call): $run" | tee -a "$LOG"
  # shellcheck disable=SC2086
  timeout "$CAP_S" "$PY" -m launch.bench --preset="$preset" $rest --strategies=single \
    "${STEPS[@]}" "${PROFILE_FLAG[@]}" --json="$OUT/run$i.json" --markdown="$OUT/run$i.md.tmp" 2>&1 | grep -v "^[WI]0000" \
    | tee "$OUT/run$i.log" | tail -8 | tee -a "$LOG" || echo "run $i ($run): failed or timed out" | tee -a "$LOG"
  # the process's whole time beside its own phases (run<i>.log: peaks, lowering, compile, init, steps)
  echo "run $i: $(( $(date +%s) - t_run )) s, process start to exit" | tee -a "$LOG"
done
i=0
# each profiled run's trace read back on the host's CPU (no device, no compile): per op kind, and priced op by op
(( ${PROFILE:-1} )) && for run in "${RUNS[@]}"; do
  i=$((i + 1))
  echo "== profile $i ($(( $(date +%s) - T_START )) s into the call): $run" | tee -a "$LOG"
  JAX_PLATFORMS=cpu timeout "$CAP_S" "$PY" tools/step_profile.py --trace_dir="$OUT/trace$i/single" --top=12 \
    --predict_json="$OUT/profile$i.json" ${PREDICT_CHIP:+--predict_chip=$PREDICT_CHIP} 2>&1 | grep -v "^[WI]0000" \
    | tee "$OUT/profile$i.txt" | tail -25 || echo "profile $i ($run): failed or timed out"
done
cat "$OUT"/run*.md.tmp > "$OUT/tpu_bench.md" 2>/dev/null && rm -f "$OUT"/run*.md.tmp
echo "call: $(( $(date +%s) - T_START )) s; results in $OUT" | tee -a "$LOG"
