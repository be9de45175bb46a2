#!/usr/bin/env bash
# MaxText 0.2.5 on the llama-style config of launch/bench.py's maxtext_llama_ref preset,
# for BENCHMARKS.md's comparison.
#
#   bash tools/maxtext_compare.sh setup                     # scratch venv (idempotent)
#   bash tools/maxtext_compare.sh run fsdp none [--tunables]
#       strategies: fsdp (fsdp=8), fsdp_tp (fsdp 4 x tensor 2), dp (data=8)
#       remat: none (saves everything: patched, below), minimal (saves the projections,
#              = our dots_no_batch), full (recomputes the layer; MaxText's default)
#
# MaxText is NEVER a dependency of twinshard: it lives in a scratch venv
# ($MAXTEXT_VENV, default /work/scratch/maxtext) with the project's jax/flax/optax pins,
# installed --no-deps plus only the modules its trainer imports.
#
# The twin side of the comparison is launch.bench in the project's own environment:
#   uv run --locked python -m launch.bench --preset=maxtext_llama_ref \
#       --strategies=single,dp,fsdp,fsdp_tp --mesh='fsdp_tp=data:4,tensor:2' --steps=8 --warmup=2
#
# Timing: MaxText's own per-step "seconds" is async dispatch for the first steps, so this
# takes the median of the wall-clock gaps between consecutive step log lines, steps 3..11.
set -euo pipefail

VENV=${MAXTEXT_VENV:-/work/scratch/maxtext}
PY=$VENV/bin/python
HERE=$(cd "$(dirname "$0")/.." && pwd)

setup() {
  export UV_PYTHON_DOWNLOADS=never VIRTUAL_ENV=$VENV
  [ -x "$PY" ] || uv venv -q -p "$(cd "$HERE" && pyenv which python 2>/dev/null || command -v python3.12)" "$VENV"
  # the project's pins (uv.lock), then MaxText without its ~300 declared dependencies
  # the versions the project's uv.lock resolved (read from its own environment)
  local pins
  pins=$(cd "$HERE" && env -u VIRTUAL_ENV uv run --locked python -c 'import importlib.metadata as m; print(" ".join(
    f"{p}=={m.version(p)}" for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml-dtypes")))')
  # shellcheck disable=SC2086
  uv pip install -q $pins
  uv pip install -q --no-deps maxtext==0.2.5 aqtp
  # what `import maxtext.trainers.pre_train.train` needs, found by importing it
  # (constrained so none of them moves jax off the pin)
  tr ' ' '\n' <<<"$pins" >"$VENV/pins.txt"
  uv pip install -q -c "$VENV/pins.txt" absl-py omegaconf pydantic pathwaysutils jinja2 qwix \
    tokamax huggingface_hub transformers grain drjax pillow tiktoken sentencepiece sympy ml_collections
  # MaxText 0.2.5 maps remat_policy=none to policy None, and jax.checkpoint(policy=None)
  # recomputes everything: "none" would be FULL remat. Make it save everything.
  local f
  f=$("$PY" -c 'import maxtext, os; print(os.path.dirname(maxtext.__file__))')/layers/nnx_decoders.py
  if ! grep -q 'twinshard patch' "$f"; then
    grep -q '    if remat_policy and remat_policy != "none":' "$f" || { echo "patch target not found in $f" >&2; exit 1; }
    "$PY" - "$f" <<'EOF'
import sys
path = sys.argv[1]
src = open(path).read()
old = '    if remat_policy and remat_policy != "none":\n'
new = ('    if remat_policy == "none":  # twinshard patch: none = save everything\n'
       '      return jax.checkpoint_policies.everything_saveable\n' + old)
open(path, "w").write(src.replace(old, new, 1))
EOF
  fi
  if JAX_PLATFORMS=cpu "$PY" -c 'import maxtext.trainers.pre_train.train' 2>/dev/null; then
    echo "maxtext ready in $VENV"
  else
    echo "maxtext in $VENV does not import; see: JAX_PLATFORMS=cpu $PY -c 'import maxtext.trainers.pre_train.train'" >&2
    exit 1
  fi
}

run() {
  local strategy=${1:-} remat=${2:-none} tunables=${3:-}
  case $remat in none|minimal|full) ;; *) echo "remat must be none, minimal or full, got '$remat'" >&2; exit 2 ;; esac
  case $tunables in ''|--tunables) ;; *) echo "the third argument is --tunables or nothing, got '$tunables'" >&2; exit 2 ;; esac
  local mesh
  case $strategy in
    fsdp) mesh="ici_fsdp_parallelism=8" ;;
    fsdp_tp) mesh="ici_fsdp_parallelism=4 ici_tensor_parallelism=2" ;;
    dp) mesh="ici_data_parallelism=8 ici_fsdp_parallelism=1" ;;
    *) echo "strategy must be fsdp, fsdp_tp or dp, got '$strategy'" >&2; exit 2 ;;
  esac
  local env=(JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8)
  if [ "$tunables" = "--tunables" ]; then
    # the launchers' allocator settings (launch.MALLOC_TUNABLES), so both sides get the same
    env+=("GLIBC_TUNABLES=$(cd "$HERE" && python3 -c 'import launch; print(launch.MALLOC_TUNABLES)')")
  fi
  local cfg
  cfg=$("$PY" -c 'import maxtext, os; print(os.path.dirname(maxtext.__file__))')/configs/base.yml
  local log out
  out=$(mktemp -d)
  log=${MAXTEXT_LOG:-$out/train.log}
  # shellcheck disable=SC2064  # expand now: $out is local to this function
  trap "rm -rf '$out'" EXIT  # MAXTEXT_LOG, if given, is kept
  # shellcheck disable=SC2086
  env "${env[@]}" "$PY" -m maxtext.trainers.pre_train.train "$cfg" run_name=twinshard_cmp \
    base_output_directory="$out/run" decoder_block=llama2 base_emb_dim=256 base_num_decoder_layers=4 \
    base_num_query_heads=4 base_num_kv_heads=4 head_dim=64 base_mlp_dim=1024 vocab_size=4096 \
    max_target_length=256 per_device_batch_size=2 weight_dtype=float32 dtype=float32 \
    attention=dot_product dataset_type=synthetic remat_policy="$remat" steps=12 \
    enable_checkpointing=false $mesh >"$log" 2>&1 || { tail -30 "$log" >&2; exit 1; }
  "$PY" - "$log" "$strategy" "$remat" "${tunables:+1}" <<'EOF'
import re, statistics, sys, datetime
log, strategy, remat, tunables = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] or "0"
text = open(log).read()
params = re.search(r"number parameters:?\s*([\d.]+)\s*billion", text)
stamps = {}
for line in text.splitlines():
    m = re.search(r"(\d\d:\d\d:\d\d\.\d+).*completed step: (\d+)", line)
    if m:
        t = datetime.datetime.strptime(m.group(1), "%H:%M:%S.%f")
        stamps[int(m.group(2))] = t.timestamp()
# time of day only: a gap across midnight wraps
gaps = [(stamps[s] - stamps[s - 1]) % 86400 for s in range(3, 12) if s in stamps and s - 1 in stamps]
if not gaps:
    sys.exit(f"no step lines in {log}")
sec = statistics.median(gaps)
n = params.group(1) if params else "?"  # MaxText logs it in billions, 3 decimals
print(f"maxtext {strategy} remat={remat} tunables={tunables} s_per_step={sec:.3f} "
      f"tokens_per_s={16 * 256 / sec:.0f} params_billion={n} gaps={len(gaps)}")
EOF
}

case ${1:-} in
  setup) setup ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 setup | run fsdp|fsdp_tp|dp [none|minimal|full] [--tunables]" >&2; exit 2 ;;
esac
