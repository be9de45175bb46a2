#!/usr/bin/env bash
# The ONE script that measures BENCHMARKS.md's GPU numbers ("GPU"): about 8 minutes on one
# H200, everything written to $OUT (8 files: the remat runs' JSON files are merged into one).
#
#   1. Here, once (the device machine has no network; flax 0.12.12 travels as a wheel, jax 0.11.2 +
#      CUDA 13, optax, orbax, absl, tiktoken, numpy are already there):
#          tools/gpu_bench.sh --fetch-wheel        # pip download flax==0.12.12 into .whl/, git-ignored
#   2. On the GPU host, from the repository root, with .whl/ copied beside the tree:
#          OUT=<dir> bash tools/gpu_bench.sh
#      then read $OUT/gpu_bench.md (tables) and the four JSON files; paste the tables into BENCHMARKS.md.
#   3. Before spending device time, the same script on this CPU with tiny shapes:
#          tools/gpu_bench.sh --dry-run            # JAX_PLATFORMS=cpu, preset tiny, OUT=a temp dir
#
# What it measures, in this order, each run capped (CAPS_S) so that the whole fits BUDGET_S (470 s):
#   - the machine: nvidia-smi name, driver, clocks (read only; nothing is changed on the card)
#   - gpt2_125m, single device, float32, batch 16x1024: f32 + bf16 matmul peaks (8192^3), init
#     compile (trace / lower / XLA compile), step lower + compile, median step, tokens/s, MFU
#   - gpt2_350m, the same
#   - cuDNN flash attention against the reference attention (bf16 values and gradients)
#   - both again with --dtype=bfloat16 (bf16 compute, cuDNN attention)
#   - where gpt2_125m's bf16 step spends its time: tools/step_profile.py's device time per HLO op
#     kind, top instructions and kernels, and how busy the GPU was (a missed target shows why)
#   - gpt2_350m bf16 with --remat=full and --remat=dots, as far as the budget lasts
# A run that outlives its cap is killed and logged ("timed out").
set -u -o pipefail
cd "$(dirname "$0")/.."

MODE=${1:-run}
WHEELS=${WHEELS:-.whl}
FLAX_WHEEL_VERSION=0.12.12

if [[ $MODE == --fetch-wheel ]]; then
  exclude=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$exclude")" &&
    { grep -qx "/$WHEELS/" "$exclude" 2>/dev/null || echo "/$WHEELS/" >> "$exclude"; }
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "flax==$FLAX_WHEEL_VERSION"
  exit $?
fi
if [[ $MODE != run && $MODE != --dry-run ]]; then
  echo "usage: tools/gpu_bench.sh [--fetch-wheel | --dry-run]  (no argument: the device run)" >&2
  exit 2
fi

if [[ $MODE == --dry-run ]]; then
  export JAX_PLATFORMS=cpu
  OUT=${OUT:-$(mktemp -d -t gpu_bench.XXXXXX)}
  PY=${PYTHON:-.venv/bin/python}
  MODELS=(tiny tiny)
  LABELS=(dry_tiny_a dry_tiny_b)
  SHAPE=(--steps=2 --warmup=1 --matmul_size=256 --matmul_reps=3)
  PROFILE_BATCH=8
  BUDGET_S=${BUDGET_S:-300}
else
  OUT=${OUT:?OUT is set by the device tool: the folder whose files come back}
  PY=${PYTHON:-python3}
  MODELS=(gpt2_125m gpt2_350m)
  LABELS=(gpt2_125m gpt2_350m)
  SHAPE=(--batch_size=16 --steps=10 --warmup=3)
  PROFILE_BATCH=16
  BUDGET_S=${BUDGET_S:-470}
fi
read -r -a CAPS <<< "${CAPS_S:-240 200 120 150 90 90}"  # s: 125m f32, 350m f32, 125m bf16, 350m bf16, profile, remat
mkdir -p "$OUT"
LOG=$OUT/gpu_bench.log
MD=$OUT/gpu_bench.md
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1

# flax 0.12.12 from the carried wheel, ahead of the image's own flax; the project from the checkout.
# (python3's pip installs it: a pure-Python wheel, so any pip will do, also for the dry run's venv.)
SITE=$(mktemp -d -t gpu_bench_site.XXXXXX)
if compgen -G "$WHEELS/flax-*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/flax-*.whl || { echo "FAILED: installing $WHEELS/flax-*.whl"; exit 1; }
else
  echo "no $WHEELS/flax-*.whl: using the installed flax (run tools/gpu_bench.sh --fetch-wheel here first)"
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

echo "== gpu_bench $MODE $(date -u '+%F %T') UTC, OUT=$OUT, budget ${BUDGET_S}s"
{ command -v nvidia-smi > /dev/null &&
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw \
      --format=csv; } || echo "(no nvidia-smi)"
"$PY" -c "import sys, jax, flax, optax; print('python', sys.version.split()[0], '| jax', jax.__version__,
'| flax', flax.__version__, '| optax', optax.__version__, '|', jax.devices())" ||
  { echo "FAILED: the python environment (see above)"; exit 1; }
"$PY" -c "import flax; v = flax.__version__; assert v == '$FLAX_WHEEL_VERSION', v" ||
  echo "WARNING: flax is not $FLAX_WHEEL_VERSION: numbers may not be comparable"
: > "$MD"

# bench NAME CAP ARGS...: one launch.bench run, killed after min(CAP, what is left of the budget).
bench() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if ((left < 30)); then
    echo "== $name: SKIPPED, ${left}s of the ${BUDGET_S}s budget left" | tee -a "$MD"; return
  fi
  local limit=$((cap < left ? cap : left)) start=$SECONDS rc
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$PY" -m launch.bench --strategies=single "$@" \
    --json="$OUT/$name.json" --markdown="$OUT/$name.md.part"
  rc=$?
  if ((rc == 0)); then
    cat "$OUT/$name.md.part" >> "$MD"; echo >> "$MD"
  elif ((rc == 124 || rc == 137)); then
    echo "== $name: TIMED OUT after ${limit}s (the log shows the last phase it finished)" | tee -a "$MD"
  else
    echo "== $name: FAILED (exit $rc; see gpu_bench.log)" | tee -a "$MD"
  fi
  rm -f "$OUT/$name.md.part"
  echo "== $name: $((SECONDS - start))s, exit $rc; $((BUDGET_S - SECONDS))s of the budget left"
}

# The attention kernel the bf16 runs use ("auto" = cuDNN flash attention on a GPU in bf16), jax.nn's
# XLA kernel and layers.recompute_attention (the f32 runs' "auto") against the readable reference,
# on gpt2_125m's attention shape, values and gradients, with 12 key/value heads and with 4 (grouped-
# query attention, which cuDNN takes natively) (~30 s).
echo "== attention: cudnn, xla and recompute vs reference" | tee -a "$MD"
timeout 120 "$PY" - <<'PY' 2>&1 | tee -a "$MD"
import jax, jax.numpy as jnp
from twinshard.model import layers
if jax.default_backend() != "gpu":
    print("attention check: SKIPPED (no GPU: cuDNN flash attention needs one)")
else:
    ks = jax.random.split(jax.random.key(0), 3)
    loss = lambda impl: lambda *a: jnp.sum(layers.causal_attention(*a, impl).astype(jnp.float32) ** 2)
    for hk in (12, 4):
        q = jax.random.normal(ks[0], (4, 12, 1024, 64), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (4, hk, 1024, 64), jnp.bfloat16) for kk in ks[1:])
        for impl in ("cudnn", "xla", "recompute"):
            out = layers.causal_attention(q, k, v, impl).astype(jnp.float32)
            ref = layers.causal_attention(q, k, v, "reference").astype(jnp.float32)
            g = jax.grad(loss(impl), argnums=(0, 1, 2))(q, k, v)
            gr = jax.grad(loss("reference"), argnums=(0, 1, 2))(q, k, v)
            gd = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(g, gr))
            print(f"attention {impl} vs reference (bf16 q [4,12,1024,64], {hk} kv heads): out max|diff| "
                  f"{float(jnp.max(jnp.abs(out - ref))):.3g}, grads max|diff| {gd:.3g}")
PY
echo >> "$MD"

bench "${LABELS[0]}_f32" "${CAPS[0]:-240}" --preset="${MODELS[0]}" "${SHAPE[@]}"
bench "${LABELS[1]}_f32" "${CAPS[1]:-200}" --preset="${MODELS[1]}" "${SHAPE[@]}"
bench "${LABELS[0]}_bf16" "${CAPS[2]:-120}" --preset="${MODELS[0]}" "${SHAPE[@]}" --dtype=bfloat16
bench "${LABELS[1]}_bf16" "${CAPS[3]:-150}" --preset="${MODELS[1]}" "${SHAPE[@]}" --dtype=bfloat16
# where the bf16 step's time goes, on the device (kernel time per HLO op kind, busy % of the wall time)
left=$((BUDGET_S - SECONDS)); cap=${CAPS[4]:-90}; limit=$((cap < left ? cap : left))
if ((limit >= 30)); then
  echo "== profile: ${MODELS[0]} bf16 (limit ${limit}s)"
  { echo "### where ${LABELS[0]}'s bf16 step spends its time (tools/step_profile.py)"; echo; echo '```'; } >> "$MD"
  timeout --kill-after=10 "$limit" "$PY" tools/step_profile.py --preset="${MODELS[0]}" --dtype=bfloat16 \
    --batch_size="${PROFILE_BATCH}" --steps=3 --top=12 --width=120 2>&1 | grep -v Warning | tee -a "$MD"
  echo "(exit ${PIPESTATUS[0]})" | tee -a "$MD"; echo '```' >> "$MD"; echo >> "$MD"
else
  echo "== profile: SKIPPED, ${left}s of the ${BUDGET_S}s budget left" | tee -a "$MD"
fi
# If the budget allows (bench skips a run with < 30 s left): gpt2_350m bf16 under
# the two memory-saving remat policies; temp bytes (memory_analysis) and step time beside the run above
bench "${LABELS[1]}_bf16_remat_full" "${CAPS[5]:-90}" --preset="${MODELS[1]}" "${SHAPE[@]}" --dtype=bfloat16 --remat=full
bench "${LABELS[1]}_bf16_remat_dots" "${CAPS[5]:-90}" --preset="${MODELS[1]}" "${SHAPE[@]}" --dtype=bfloat16 --remat=dots
# 8 files in all: the remat runs' JSON files become one, remat.json
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = sorted(out.glob("*_remat_*.json"))
if parts:
    (out / "remat.json").write_text(json.dumps({p.stem: json.loads(p.read_text()) for p in parts}, indent=1))
    for p in parts:
        p.unlink()
PY

{ command -v nvidia-smi > /dev/null &&
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; } || true
echo "== done in ${SECONDS}s; files in $OUT:"
ls -la "$OUT"
echo
cat "$MD"
exec 1>&- 2>&-
wait "$TEE_PID"  # the log is complete before $OUT is collected
