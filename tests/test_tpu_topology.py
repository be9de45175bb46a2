"""TPU pods without TPUs: the train step compiled ahead of time for a v5e:4x4 pod (16 chips on
4 hosts, 2x2 chips per host) on this CPU machine, its TPU collective ledger and per-chip memory.

Needs libtpu (the `tpu` extra; CI runs `uv run --locked --extra tpu pytest`); without it these
tests are skipped, except those for error messages. The 8 simulated CPU devices of
conftest stay the default backend: the pod's devices are compile-only.

Meshes that fit the tiny preset on 16 chips (both axes must multiply to 16):
fsdp data:16 (batch 16; d_model 64 -> 4 rows per shard), tp tensor:16 (num_heads 16, head
dim 4; d_ff 192 and vocab 384 divide by 16), fsdp_tp data:4,tensor:4 (tiny as it is).

What TPU prints differently from the cost model (measured, libtpu 0.0.50.1;
twinshard/hardware/topology.py says why): FSDP weight gathers in bf16 (the embedding in f32),
and reduce-scatters compiled as all-reduce + slice: all 16 on data:16, 3 of 16 on data:4,tensor:4.
`twinshard.hardware.topology.tpu_expected` is the model with exactly those two changes; the manual
twin's ledger equals it per (op, axes) in count and bytes. Without FSDP (tp) the ledger equals
the model itself.
"""

import dataclasses
import math
import re
import sys

import jax
import pytest

from twinshard import cost, hlo
from twinshard.hardware import topology
from twinshard.config import Config, preset

needs_libtpu = pytest.mark.skipif(not topology.libtpu_installed(),
                                  reason="needs libtpu: uv run --locked --extra tpu pytest")

TOPOLOGY = "v5e:4x4"
CASES = {  # name: (impl, strategy, mesh, model overrides, batch)
    "auto_fsdp": ("auto", "fsdp", {"data": 16, "tensor": 1}, {}, 16),
    "manual_fsdp": ("manual", "fsdp", {"data": 16, "tensor": 1}, {}, 16),
    "manual_fsdp_tp": ("manual", "fsdp_tp", {"data": 4, "tensor": 4}, {}, 8),
    # bf16 compute: the program asks for bf16 gathers, scatters and TP all-reduces; XLA:CPU
    # promotes bf16 collectives to f32 (passes all-reduce-promotion, float-normalization-bf16,
    # measured) and its runtime has no bf16 reduce-scatter, so the TPU compile is the proof.
    "manual_fsdp_bf16": ("manual", "fsdp", {"data": 16, "tensor": 1}, {"dtype": "bfloat16"}, 16),
    # tp only in bf16: its activation all-reduces are the model's bytes in bf16 (the f32 tp case,
    # the same collectives at twice the bytes, was cut for suite time: ~8 s of TPU compile)
    "manual_tp_bf16": ("manual", "tp", {"data": 1, "tensor": 16}, {"num_heads": 16, "dtype": "bfloat16"}, 8),
}
MANUAL = [n for n in CASES if n.startswith("manual")]
# Reduce-scatters TPU compiled as all-reduce of the full gradient + slice (of 7L+2 = 16).
DECOMPOSED = {"manual_fsdp": 16, "manual_fsdp_tp": 3}


@dataclasses.dataclass
class Step:
    cfg: Config
    strategy: str
    mesh: dict
    runner: object
    state: object
    tokens: object
    compiled: object
    ledger: hlo.Ledger
    model: cost.Cost


@pytest.fixture(scope="module")
def pod():
    return topology.devices(TOPOLOGY, (2, 2, 1))


@pytest.fixture(scope="module")
def step(pod):
    """name -> Step, each compiled once for the whole module (topology.compile_for_pod: without
    the persistent compilation cache, which cannot read compile-only TPU executables back)."""
    import auto_parallel
    import manual_parallel

    done: dict[str, Step] = {}

    def get(name: str) -> Step:
        if name not in done:
            impl, strategy, mesh, over, batch = CASES[name]
            base = preset("tiny")
            cfg = Config(dataclasses.replace(base.model, **over),
                         dataclasses.replace(base.train, batch_size=batch))
            make = auto_parallel.make_runner if impl == "auto" else manual_parallel.make_runner
            spec = ",".join(f"{a}:{n}" for a, n in mesh.items())
            runner = make(strategy, spec, cfg, devices=topology.mesh_devices(mesh, pod))
            tokens = jax.ShapeDtypeStruct((batch, cfg.model.context_length), jax.numpy.int32,
                                          sharding=runner.batch_sharding)
            state = runner.abstract_state()
            compiled = topology.compile_for_pod(runner.train_step.lower(state, tokens, tokens))
            done[name] = Step(cfg, strategy, mesh, runner, state, tokens, compiled,
                              hlo.ledger(compiled.as_text(), runner.mesh),
                              cost.cost(cfg.model, strategy, mesh, batch, cfg.model.context_length))
        return done[name]

    return get


@needs_libtpu
def test_pod_is_16_chips_on_4_hosts(pod):
    assert len(pod) == 16 and {d.platform for d in pod} == {"tpu"}
    assert {d.device_kind for d in pod} == {"TPU v5 lite"}
    hosts = {}
    for d in pod:
        hosts.setdefault(d.process_index, []).append(d)
    assert sorted(hosts) == [0, 1, 2, 3] and all(len(v) == 4 for v in hosts.values())
    assert jax.devices()[0].platform == "cpu" and jax.device_count() == 8  # CPU stays the default


@needs_libtpu
@pytest.mark.parametrize("name", list(CASES))
def test_tpu_ledger_reads_every_line(step, name):
    s = step(name)
    assert s.runner.mesh.devices.flat[0].platform == "tpu"
    assert s.ledger.records and s.ledger.unparsed == []
    # The layer scan's while loops (forward, backward): TPU drops known_trip_count, so the
    # ledger infers it from the loop condition (hlo/loops.py) and says so; it must find L.
    L = s.cfg.model.num_layers
    assert s.ledger.warnings and all(re.fullmatch(rf"while %[\w.]+: no known_trip_count, inferred {L} from "
                                                  r"its condition", w) for w in s.ledger.warnings)
    assert "AsyncCollectiveStart" in s.compiled.as_text() or name.startswith("manual_tp")  # TPU async fusions


@needs_libtpu
@pytest.mark.parametrize("name", MANUAL)
def test_manual_ledger_is_the_model_as_tpu_compiles_it(step, name):
    s = step(name)
    rows = cost.compare(s.ledger.summary(), topology.tpu_expected(s.cfg.model, s.model, s.ledger))
    assert [r for r in rows if not r["match"]] == []
    if name.startswith("manual_tp"):  # no FSDP: nothing for TPU to change
        assert all(r["match"] for r in cost.compare(s.ledger.summary(), s.model.summary()))


@needs_libtpu
@pytest.mark.parametrize("name", ["manual_fsdp", "manual_fsdp_tp"])
def test_tpu_differences_are_exactly_bf16_gathers_and_decomposed_reduce_scatters(step, name):
    s = step(name)
    d, t = s.mesh["data"], s.mesh["tensor"]
    model = s.model.summary()
    # 1. every gather is one the model has, in bf16 or f32; the embedding table [V, D/t] in f32
    #    (with the layer scan TPU also keeps some per-layer weights f32: topology.tpu_expected)
    gathers = s.ledger.filter(op="all-gather", axes="data")
    assert s.ledger.count("all-gather", "data") == model[("all-gather", ("data",))]["count"] == 2 * (7 * 2 + 2) - 1
    assert {g.dtype for g in gathers} == {"bf16", "f32"}
    emb = s.cfg.model.padded_vocab_size * s.cfg.model.d_model // t
    assert any(g.dtype == "f32" and g.bytes == 4 * emb for g in gathers)  # the table (lm_head: same size)
    # 2. each data all-reduce of a matrix is a reduce-scatter done in full: |data| x its bytes
    #    (norm gains are [D] or, stacked, [L, D]; multiplicity counts the layer loop)
    norm_shapes = {(s.cfg.model.d_model,), (s.cfg.model.num_layers, s.cfg.model.d_model)}
    is_norm_or_scalar = lambda r: len(r.shape) < 2 or tuple(r.shape) in norm_shapes  # noqa: E731
    full = [r for r in s.ledger.filter(op="all-reduce", axes="data") if not is_norm_or_scalar(r)]
    assert sum(r.multiplicity for r in full) == DECOMPOSED[name]
    scattered = s.ledger.filter(op="reduce-scatter", axes="data")
    want = model[("reduce-scatter", ("data",))]
    assert scattered.count() + sum(r.multiplicity for r in full) == want["count"]
    assert scattered.total_bytes() + sum(r.bytes * r.multiplicity for r in full) // d == want["bytes"]
    # the rest of the data all-reduces are the model's: norm gains, grad norm (fsdp), loss
    rest = [r for r in s.ledger.filter(op="all-reduce", axes="data") if is_norm_or_scalar(r)]
    assert (sum(r.multiplicity for r in rest), sum(r.bytes * r.multiplicity for r in rest)) == (
        model[("all-reduce", ("data",))]["count"], model[("all-reduce", ("data",))]["bytes"])


@needs_libtpu
def test_auto_fsdp_on_tpu_keeps_gathered_weights_and_all_reduces_gradients(step):
    """GSPMD's own plan on the pod (measured): each matrix gathered once (bf16; the embedding
    f32) and kept for the backward pass; every gradient all-reduced in full over data (no
    reduce-scatter, as on CPU); the squared norm is then local, so one scalar: the loss."""
    s = step("auto_fsdp")
    m = s.cfg.model
    gathers = s.ledger.filter(op="all-gather", axes="data")  # counts include the layer loop's trips
    assert s.ledger.count("all-gather", "data") == 7 * m.num_layers + 2
    emb = m.padded_vocab_size * m.d_model
    assert any(g.dtype == "f32" and g.bytes == 4 * emb for g in gathers)  # the table (lm_head: same size)  # the embedding
    assert s.ledger.count("reduce-scatter") == 0
    ar = s.ledger.filter(op="all-reduce", axes="data")
    # per layer (in the loop) 7 matrix gradients; outside it embedding, lm_head, the stacked
    # ln1/ln2 [L, D] and ln_final gradients, the loss and the squared norm (measured)
    assert s.ledger.count("all-reduce", "data") == 7 * m.num_layers + 2 + 3 + 2
    assert ar.total_bytes() == m.num_params() * 4 + 4 + 4
    assert set(s.ledger.summary()) == {("all-gather", ("data",)), ("all-reduce", ("data",))}


@needs_libtpu
@pytest.mark.parametrize("name", list(CASES))
def test_per_chip_memory_is_the_models_params_and_moments(step, name):
    """memory_analysis() is per chip. Its argument bytes are the state + local batch, each
    array padded to its TPU tile; unpadded, params and moments are exactly the cost model's
    (params, 2 x params). Gradients are not arguments (they live among the temporaries). The
    whole state is donated: every state byte is aliased to an output."""
    s = step(name)
    ma = s.compiled.memory_analysis()
    args = topology.argument_bytes(s.compiled, s.state, s.tokens, s.tokens)
    mem = s.model.memory
    assert args["params"]["bytes"] == mem.params
    assert args["optimizer"]["bytes"] == mem.optimizer == 2 * mem.params
    assert args["batch"]["bytes"] == 2 * s.tokens.shape[0] // s.mesh["data"] * s.tokens.shape[1] * 4
    assert args["total"]["padded"] == ma.argument_size_in_bytes
    assert ma.alias_size_in_bytes == args["total"]["padded"] - args["batch"]["padded"]
    assert args["params"]["padded"] > args["params"]["bytes"]  # tiny shards: tile padding shows


@needs_libtpu
def test_bf16_compute_moves_bf16(step):
    """dtype=bfloat16: every FSDP gather is bf16 (the embedding table too, which f32 runs
    gather in f32) and TP's activation all-reduces are bf16: half the bytes of the f32 run's."""
    fsdp, fsdp32 = step("manual_fsdp_bf16"), step("manual_fsdp")
    gathers = list(fsdp.ledger.filter(op="all-gather", axes="data"))
    assert len(gathers) == len(list(fsdp32.ledger.filter(op="all-gather", axes="data"))) > 0
    assert all(r.bytes == 2 * math.prod(r.shape) for r in gathers), fsdp.ledger.table()
    tp = step("manual_tp_bf16")
    act = (8, 32, 64)  # [B, T, D]
    acts = [r for r in tp.ledger.filter(op="all-reduce", axes="tensor") if tuple(r.shape) == act]
    count = lambda recs: sum(r.multiplicity for r in recs)  # noqa: E731  (layer-loop records x L)
    assert count(acts) == 4 * 2 + 2  # 4 per layer, the embedding, f before lm_head (as in f32)
    assert {r.bytes for r in acts} == {2 * math.prod(act)}  # f32: 4 x prod, measured before the cut


def test_norm_gain_all_reduces_of_every_stack_are_not_taken_for_reduce_scatters():
    """With first_dense_layers the gains are leaves [K, D] and [L-K, D]: their all-reduces over data
    (here a hand ledger of those alone, no libtpu needed) are the model's own, not reduce-scatters
    TPU compiled in full, so tpu_expected leaves the model as it is."""
    model_cfg = dataclasses.replace(preset("tiny_moe").model, num_layers=3, first_dense_layers=1)
    mesh = {"data": 8, "tensor": 1}
    model = cost.cost(model_cfg, "fsdp", mesh, 8)
    gains = [w.leaf_shape for w in cost.weights(model_cfg) if not w.is_matrix]
    assert {(1, 64), (2, 64), (64,)} == set(gains)
    records = [hlo.Collective("all-reduce", "f32", shape, 4 * math.prod(shape), 0.0, (), (), ("data",), (), 8, 1,
                              "", "", "", "") for shape in gains]
    ledger = hlo.Ledger(records, hlo.MeshSpec(tuple(mesh), tuple(mesh.values())))
    assert topology.tpu_expected(model_cfg, model, ledger) == model.summary()


def test_without_libtpu_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` raises ImportError
    assert not topology.libtpu_installed()
    with pytest.raises(ValueError, match=r"needs libtpu.*install the tpu extra \(uv sync --extra tpu"):
        topology.devices(TOPOLOGY)


def test_bad_topology_name_is_a_clear_error(monkeypatch):
    """The name's format is checked before libtpu is needed (so also without it)."""
    monkeypatch.setitem(sys.modules, "libtpu", None)
    for bad in ("v5e-16", "v5e:4", "4x4", "v5e:4x4x4x4", ""):
        with pytest.raises(ValueError, match="is not of the form GENERATION:AxB"):
            topology.devices(bad)
    assert topology.chips_per_host("v5e:1x1") == (1, 1, 1)
    assert topology.chips_per_host("v5e:4x4") == (2, 2, 1)
    assert topology.chips_per_host("v5p:2x2x2") == (2, 2, 1)
    assert topology.chips_per_host("v5e:1x4") == (1, 2, 1)


@needs_libtpu
def test_bad_host_bounds_are_a_clear_error():
    with pytest.raises(ValueError, match=r"rejected by libtpu.*1,1,1 always divides"):
        topology.devices("v5e:4x4", (3, 3, 1))


@needs_libtpu
def test_compiler_options_reach_the_pods_compile():
    """XLA:TPU flags passed as compile options reach libtpu's compile (an unknown one is refused by
    name); without a topology they are refused before anything compiles."""
    from launch.collectives import collectives

    cfg = preset("tiny")
    devices = topology.devices("v5e:2x2", (1, 1, 1))
    unknown = {"xla_tpu_no_such_option": "true"}
    with pytest.raises(Exception, match="No such compile option: 'xla_tpu_no_such_option'"):
        collectives("fsdp", "manual", "data:4,tensor:1", cfg, devices, compiler_options=unknown)
    with pytest.raises(ValueError, match="compiler_options are XLA:TPU flags for a topology's compile"):
        collectives("fsdp", "manual", "data:4,tensor:1", cfg, None, compiler_options=unknown)


@needs_libtpu
def test_auto_fsdp_runs_splash_on_the_pod_in_bf16():
    """GSPMD's twin on a pod in bf16: splash (a Mosaic kernel) in a shard_map over every mesh axis,
    the size-1 tensor axis too (left to the partitioner it failed to lower); nothing moves over tensor."""
    from launch.collectives import collectives

    base = preset("tiny")
    cfg = Config(dataclasses.replace(base.model, d_model=512, num_heads=4, dtype="bfloat16"),
                 dataclasses.replace(base.train, batch_size=16))
    res = collectives("fsdp", "auto", "data:16,tensor:1", cfg, topology.devices(TOPOLOGY, (2, 2, 1)))
    kernels = [line for line in res["hlo"].splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert any("splash_mha_fwd" in line for line in kernels), kernels[:2]
    assert {axes for _, axes in res["ledger"].summary()} == {("data",)}
