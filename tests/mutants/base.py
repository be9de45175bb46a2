"""What every family of mutants shares: the Mutant record, the library files mutated and the test
selections that catch them (node ids and files under tests/)."""


from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    category: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    description: str
    equivalent: str | None = None


SRC_STRATEGIES = "twinshard/parallel/strategies.py"
DATA_TENSOR = "tests/test_data_tensor.py"  # dp, fsdp, tp, fsdp_tp in both twins
COST = "tests/test_cost.py"
HLO = "tests/test_hlo.py"
LAYERS = "tests/test_layers.py"
MODEL = "tests/test_model.py"
OPTIM = "tests/test_loss_optim.py"
DATA = "tests/test_data.py"
TRAIN = "tests/test_train.py"
TPU = "tests/test_tpu_topology.py"
SCHEDULE = "tests/test_schedule.py"
CLI = "tests/test_collectives_cli.py"
PRECISION = "tests/test_precision.py"
ATTENTION = "tests/test_attention.py"
HLO_INPUT = "tests/test_hlo_input.py"
VALIDATION = "tests/test_validation.py"
CLI_ERRORS = "tests/test_cli_errors.py"
SCAN = "tests/test_scan.py"
PLAN = "tests/test_plan.py"
MOE = "tests/test_moe.py"
EXPERTS = "tests/test_experts.py"
RAGGED = "tests/test_ragged.py"
ACCUM = "tests/test_accum.py"
OPTIMIZERS = "tests/test_optimizers.py"
REMAT = "tests/test_remat.py"
MEMORY = "tests/test_memory.py"
GQA = "tests/test_gqa.py"
EXPLICIT = "tests/test_explicit.py"
OPTIONS = "tests/test_options.py"  # every option observed; explicit against derived settings
DTYPES = "tests/test_promised_dtypes.py"
ULYSSES = "tests/test_ulysses.py"
QUANTIZATION = "tests/test_quantization.py"
XLA_OPTIONS = "tests/test_xla_options.py"
SPLASH = "tests/test_splash.py"
GRADIENT_BYTES = "tests/test_gradient_bytes.py"  # --weight_dtype=bfloat16: gradient reductions, ledger and model

# The manual twin's tests of DATA_TENSOR: its cases of the tests parametrised over [twin-strategy],
# then its own (the last two also run the GSPMD twin).
MANUAL = (*(f"{DATA_TENSOR}::{test}[manual-{s}]" for test in ("test_initial_params_are_bitwise_single_device",
                                                             "test_adamw_matches_single_device",
                                                             "test_params_and_moments_are_physically_sharded")
            for s in ("dp", "fsdp", "tp", "fsdp_tp")),
          *(f"{DATA_TENSOR}::{test}" for test in (
              "test_manual_every_collective_is_named_in_manual_parallel",
              "test_manual_dp_all_reduce_moves_exactly_the_parameter_bytes",
              "test_manual_fsdp_gathers_each_weight_forward_and_backward_and_scatters_each_gradient",
              "test_manual_tp_all_reduces_activations_only", "test_manual_ledger_equals_the_cost_model_exactly",
              "test_reported_grad_norm_is_the_unclipped_float64_norm", "test_manual_matches_auto")))
# Everything that reads a compiled ledger or the cost model (a parser or model bug shows there too).
LEDGER_TESTS = (HLO, DATA_TENSOR, TPU, CLI)
COST_TESTS = (COST, *MANUAL, TPU, CLI)
# Both twins (placement tables are read by both).
TWINS = (DATA_TENSOR,)

SRC_COLL = "manual_parallel/collectives.py"
SRC_TP = "manual_parallel/tp.py"
SRC_FSDP = "manual_parallel/fsdp.py"
SRC_RUNNER = "manual_parallel/runner.py"
SRC_OPTIM = "twinshard/train/optim.py"
SRC_LAYERS = "twinshard/model/layers.py"
SRC_MATMULS = "twinshard/model/matmuls.py"
SRC_PLAN = "twinshard/hardware/plan.py"
SRC_LOSS = "twinshard/model/loss.py"
SRC_MODEL = "twinshard/model/transformer.py"
SRC_REMAT = "twinshard/model/remat.py"
SRC_ATTENTION = "twinshard/model/attention.py"
SRC_LINEAR = "twinshard/model/linear.py"
SRC_QUANTIZE = "twinshard/model/quantize.py"
SRC_RESOLVE = "twinshard/parallel/resolve.py"
SRC_DATA = "twinshard/train/data.py"
SRC_HLO_PARSE = "twinshard/hlo/parse.py"
SRC_HLO_GROUPS = "twinshard/hlo/groups.py"
SRC_HLO_LOOPS = "twinshard/hlo/loops.py"
SRC_HLO_RECORDS = "twinshard/hlo/records.py"
SRC_HLO_TIMING = "twinshard/hlo/timing.py"
SRC_HLO_MATMUL_FLOPS = "twinshard/hlo/matmul_flops.py"
SRC_XLA_OPTIONS = "twinshard/train/xla_options.py"
SRC_COST_ROWS = "twinshard/cost/communication.py"
SRC_COST_ROWS_BUILDERS = "twinshard/cost/rows.py"
SRC_COST_FLOPS = "twinshard/cost/flops.py"
SRC_COST_MEMORY = "twinshard/cost/memory.py"
SRC_COST_WEIGHTS = "twinshard/cost/weights.py"
SRC_TRAIN = "launch/train.py"
SRC_FIT = "launch/fit.py"
SRC_CONFIG = "twinshard/config.py"
SRC_TRAINER = "twinshard/train/trainer.py"

