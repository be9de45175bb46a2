"""Compile a strategy's train step ahead of time; set its collectives beside the cost model.

    python -m launch.collectives --strategy=fsdp --impl=auto --mesh=data:8,tensor:1 --preset=tiny
    python -m launch.collectives --strategy=fsdp_tp --mesh=data:2,tensor:4 --json=out.json --hlo=step.hlo
    python -m launch.collectives --strategy=cp --impl=auto,manual --mesh=context:4 --devices=4 --preset=tiny
        # the twins side by side: count and bytes per twin and the model's, rows marked where they differ
    uv run --extra tpu python -m launch.collectives --strategy=fsdp --impl=manual --topology=v5e:4x4
        # 16 TPU v5e chips on 4 hosts, compiled here; needs libtpu (the tpu extra)
    uv run --extra tpu python -m launch.collectives --strategy=fsdp --impl=auto,manual --topology=v5e:4x4 \
        --timeline=fsdp.svg   # both twins' steps drawn on one time axis (docs/schedule.md)
    uv run --extra tpu python -m launch.collectives --strategy=fsdp --impl=manual --topology=v5e:2x2 \
        --trace=fsdp.trace.json   # the same predicted step for Perfetto UI or chrome://tracing
    uv run --extra tpu python -m launch.collectives --strategy=hsdp --impl=manual --topology=v5e:2x2 \
        --dcn_mesh=data:2   # 2 slices over DCN: the data axis's rows and lane (docs/slices.md)

Nothing runs: the train step is lowered on abstract inputs (ShapeDtypeStructs
carrying the strategy's shardings) and compiled. The collective ledger of the
compiled HLO (twinshard/hlo/) is printed, then the analytic model
(twinshard/cost/), then one line per (op, mesh axes) with measured/model
count, bytes and ring bytes, and totals per axis.

On CPU the step is compiled for `--devices` simulated devices (8). With
`--topology` it is compiled for a TPU pod that is not here, multi-host
included (twinshard/hardware/topology.py: v5e:4x4 is 16 chips on 4 hosts, 2x2 chips per
host), which needs libtpu (the tpu extra: `uv run --extra tpu ...`). Per-chip
memory comes from `compiled.memory_analysis()`, printed beside the cost
model's: params and optimizer moments as shard bytes (what the model counts)
and as stored (TPU pads every array to its layout tile). On TPU the manual
twin is also compared with the model as the TPU compiler prints it
(`topology.tpu_expected`: bf16 weight gathers, some reduce-scatters compiled
as all-reduce + slice).

The model describes the manual (shard_map) twin's collectives. GSPMD is free
to choose differently; in particular XLA:CPU never emits reduce-scatter for
GSPMD (it writes an all-reduce of the full gradient + dynamic-slice), so the
auto rows differ from the model there, and the output says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from absl import app, flags, logging

from launch import common, fit
from launch.twin_notes import AUTO_NOTES, EXPLICIT_DOCS, twin_notes  # noqa: F401  (tests read both tables here)
from twinshard.parallel import support

common.define(flags.DEFINE_string, "json", None, "Write ledger, model and comparison as JSON to this path.")
common.define(flags.DEFINE_string, "hlo", None, "Write the compiled (optimized) HLO text to this path.")
common.define(flags.DEFINE_string, "topology", None, "Compile for a TPU topology instead of CPU, e.g. "
              "v5e:4x4 (16 chips, 4 hosts; needs libtpu: uv run --extra tpu ...).")
common.define(flags.DEFINE_string, "chips_per_host_bounds", None, "With --topology: chips per host x,y,z "
              "(default 2,2,1, each lowered to 1 where it does not divide the topology's grid).")
common.define(flags.DEFINE_string, "timeline", None, "With --topology: draw one training step as an SVG to this "
              "path (docs/schedule.md): compute, each mesh axis's collectives from issue to completion, what is "
              "exposed; with --impl=auto,manual the twins one above the other. A pipeline strategy (pp, pp_fsdp) first "
              "draws its step as a lane per stage, F / B / W boxes per micro-batch, read from the compiled program "
              "(docs/pipelines.md); that picture needs no --topology.")
common.define(flags.DEFINE_string, "trace", None, "With --topology: write the predicted step as a Chrome "
              "trace-event JSON file to this path, for Perfetto UI (ui.perfetto.dev) or chrome://tracing: a track "
              "for compute, one per mesh axis, each op and collective with its bytes and source line; with "
              "--impl=auto,manual one process per twin (docs/schedule.md; tools/trace_beside.py sets it beside a "
              "measured profile).")
common.define(flags.DEFINE_bool, "force", False, "Overwrite --json, --hlo, --timeline and --trace files that exist.")
common.define(flags.DEFINE_string, "impl", "auto", "The twin: auto (GSPMD annotations), manual (shard_map "
              f"collectives) or explicit (sharding in types: {', '.join(support.written_by('explicit'))}); a comma "
              "list (auto,manual) compiles each in turn.")
common.define_model_flags()  # --devices: simulated CPU devices (ignored with --topology)
FLAGS = flags.FLAGS

def _topology_devices(name: str, slices: int = 1):
    """Devices of `slices` TPU pods that are not here (AOT only). Needs libtpu."""
    from twinshard.hardware import topology

    bounds = None
    if FLAGS.chips_per_host_bounds:
        try:
            bounds = tuple(int(x) for x in FLAGS.chips_per_host_bounds.split(","))
        except ValueError:
            bounds = ()
        if len(bounds) != 3 or min(bounds) < 1:
            raise ValueError(f"--chips_per_host_bounds={FLAGS.chips_per_host_bounds} must be three "
                             "integers >= 1, x,y,z (e.g. 2,2,1).")
    return topology.devices(name, bounds, num_slices=slices)


def _runner(strategy: str, impl: str, mesh_spec: str | None, cfg, devices, dcn_spec: str | None = None):
    """The runner, for CPU (devices None) or for topology devices, ordered for the mesh by mesh_utils
    (across slices: by mesh.hybrid_mesh, in resolve_run)."""
    from dataclasses import replace

    from twinshard.hardware import topology

    run = common.resolve_run(strategy, impl, mesh_spec, cfg, devices, dcn_spec=dcn_spec)
    if devices is not None and not run.dcn:
        run = replace(run, devices=tuple(topology.mesh_devices(run.mesh, devices)))
    return run, common.runner_of(run)


def _pod_memory(devices) -> tuple[int, str] | None:
    """(HBM bytes, what) of a --topology's chip (twinshard.hardware.chips), or None: this host's devices."""
    from twinshard.hardware import chips

    chip = None if devices is None else chips.chip_for(devices[0].device_kind)
    return None if chip is None else (chip.hbm_bytes, f"{chip.name}'s HBM")


def collectives(strategy: str, impl: str, mesh_spec: str | None, cfg, devices=None, compiler_options=None,
                dcn_spec: str | None = None) -> dict:
    """Compile the train step AOT; return ledger, model, comparison, notes, HLO text, timings.
    compiler_options: XLA flags for a topology's compile (topology.compile_for_pod); dcn_spec: --dcn_mesh."""
    import functools

    import jax

    from twinshard import cost, hlo
    from twinshard.hardware import measure, topology
    from twinshard.hlo.evaluate import full_text
    from twinshard.model import layers

    if compiler_options and devices is None:
        raise ValueError("compiler_options are XLA:TPU flags for a topology's compile; pass the topology's devices")
    run, runner = _runner(strategy, impl, mesh_spec, cfg, devices, dcn_spec)
    mesh = dict(run.mesh)
    model = cost.of_run(run)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), jax.numpy.int32,
                                  sharding=runner.batch_sharding)
    state = runner.abstract_state()
    bound = _pod_memory(devices)
    fit.check_model(run, bound)
    t0 = time.perf_counter()
    with layers.compiling_for(runner.mesh.devices.flat[0].platform):  # a --topology's chips: TPU kernels
        lowered = runner.train_step.lower(state, tokens, tokens)
    compiled = fit.compile_checked(lowered, run, bound,  # a TPU pod's devices: compiled for them
                                   None if devices is None else
                                   functools.partial(topology.compile_for_pod, compiler_options=compiler_options))
    compile_s = time.perf_counter() - t0
    options = step_options(lowered, compiler_options)
    text = full_text(compiled)  # with the tables a pipeline's tick loop indexes (as_text() elides them)
    led = hlo.ledger(text, runner.mesh)
    first = runner.mesh.devices.flat[0]
    platform = first.platform
    has_rs = any(r.op == "reduce-scatter" for r in model.collectives)
    notes = twin_notes(strategy, impl, platform, has_rs) + list(model.notes)
    tpu_comparison = None
    if platform == "tpu":
        notes += list(topology.TPU_NOTES)
        if impl == "manual":
            tpu_comparison = cost.compare(led.summary(), topology.tpu_expected(cfg.model, model, led))
    memory = {"analysis": measure.memory_analysis(compiled),
              "arguments": topology.argument_bytes(compiled, state, tokens, tokens),
              "model": {**dataclasses.asdict(model.memory), "total": model.memory.total}}
    return {"strategy": strategy, "impl": impl, "mesh": mesh, "platform": platform,
            "device_kind": first.device_kind, "hosts": len({d.process_index for d in runner.mesh.devices.flat}),
            "batch_size": cfg.train.batch_size, "seq_len": cfg.model.context_length,
            "dcn": dict(run.dcn), "compile_s": compile_s, "compiler_options": options, "ledger": led, "model": model, "memory": memory,
            "comparison": cost.compare(led.summary(), model.summary()),
            "tpu_comparison": tpu_comparison, "notes": notes, "hlo": text, "schedule": pipeline_grid(run),
            "ticks": pipeline_read(run, compiled, runner.mesh)}


def pipeline_read(run, compiled, mesh):
    """A pipeline step's ticks x stages read from its compiled program (twinshard/hlo/pipeline_ticks.py),
    None for the other strategies."""
    from twinshard.hlo.pipeline_ticks import pipeline_ticks
    from twinshard.parallel import strategies

    return pipeline_ticks(compiled, mesh) if strategies.get(run.strategy).family == "pipeline" else None


def pipeline_grid(run) -> str | None:
    """A pipeline run's schedule drawn as its table (twinshard/parallel/pipeline.py), None for the others."""
    from twinshard.parallel import pipeline, strategies

    if strategies.get(run.strategy).family != "pipeline":
        return None
    t = run.cfg.train
    return pipeline.build(t.schedule, run.mesh[pipeline.STAGE], t.microbatches, t.virtual_stages).text()


def step_options(lowered, at_compile: dict | None) -> dict[str, str]:
    """The XLA options the train step was compiled with: those its jit passed (trainer.compiler_options),
    read back from the lowering (JAX 0.12 keeps them as `_compiler_options_kvs`; no public accessor),
    then those given to the compile, which JAX appends after them."""
    return {k: str(v) for k, v in (*lowered._lowering._compiler_options_kvs, *(at_compile or {}).items())}


def _where(res: dict) -> str:
    """'cpu mesh data:8,tensor:1, batch 8x32', or the TPU's kind and hosts in place of cpu."""
    mesh = ",".join(f"{a}:{n}" for a, n in res["mesh"].items())
    where = res["platform"] if res["platform"] == "cpu" else \
        f"{res['device_kind']} ({res['hosts']} host{'s' * (res['hosts'] > 1)})"
    return f"{where} mesh {mesh}, batch {res['batch_size']}x{res['seq_len']}"


def report(res: dict) -> str:
    from twinshard import cost

    title = f"{res['strategy']}/{res['impl']} on {_where(res)} (compiled in {res['compile_s']:.1f}s)"
    options = " ".join(f"--{k}={v}" for k, v in res["compiler_options"].items()) or "none (the compiler's defaults)"
    out = [title, f"XLA options of the train step: {options}"]
    if res["schedule"] is not None:
        out += ["", "== the pipeline schedule: a row per stage, a column per tick (twinshard/parallel/pipeline.py) ==",
                res["schedule"], "", "== the same step read from the compiled program (twinshard/hlo/pipeline_ticks.py) ==",
                res["ticks"].text()]
    out += ["", "== measured: collectives of the compiled train step (ledger) ==", res["ledger"].table(),
           "", "== model: twinshard.cost (what the manual twin does) ==", res["model"].table(),
           "", "== measured vs model, per (op, axes) ==", cost.compare_table(res["comparison"]), LEGEND]
    if res["tpu_comparison"] is not None:
        out += ["", "== measured vs model as the TPU compiler prints it (twinshard.hardware.topology.tpu_expected) ==",
                cost.compare_table(res["tpu_comparison"])]
    out += ["", "== memory per device: compiled.memory_analysis() beside the model ==", memory_table(res)]
    out += ["", *(f"NOTE: {n}" for n in res["notes"])] if res["notes"] else []
    return "\n".join(out)


LEGEND = ("Legend: bytes: the size of each collective's result on one device, summed over the step's "
          "runs; ring bytes: what a ring algorithm sends per device for them; "
          "records: distinct collective instructions in the HLO; collectives: the runs per step (a record "
          "inside the layer loop runs once per layer)")


def side_by_side(results: list[dict]) -> str:
    """One row per (op, axes): each twin's measured count and bytes, then the model's (the manual
    twin's plan); the last column marks a row where the twins differ, or a twin differs from the model."""
    from twinshard import cost

    model = results[0]["model"].summary()  # the same model for every twin of one run
    twins = [(res["impl"], res["ledger"].summary()) for res in results]
    keys = list(dict.fromkeys([*model, *(k for _, summary in twins for k in summary)]))
    zero = {"count": 0, "bytes": 0}

    def row(op, axes, cells, want) -> tuple:
        got = [(c["count"], c["bytes"]) for c in cells]
        off = [impl for (impl, _), g in zip(twins, got) if g != (want["count"], want["bytes"])]
        mark = "; ".join((["twins differ"] if len(set(got)) > 1 else [])
                         + ([f"{', '.join(off)} differ{'s' * (len(off) == 1)} from the model"] if off else []))
        return (op, ",".join(axes) or "-", *(x for c in cells for x in ("|", c["count"], cost.human(c["bytes"]))),
                "|", want["count"], cost.human(want["bytes"]), "|", mark)

    lines, totals = [], {}
    for op, axes in keys:
        cells = [summary.get((op, axes), zero) for _, summary in twins]
        want = model.get((op, axes), zero)
        lines.append(row(op, axes, cells, want))
        for i, c in enumerate([*cells, want]):
            acc = totals.setdefault(axes, [dict(zero) for _ in range(len(cells) + 1)])[i]
            acc["count"] += c["count"]
            acc["bytes"] += c["bytes"]
    lines += [row("TOTAL", axes, acc[:-1], acc[-1]) for axes, acc in totals.items()]
    head = ("op", "axes", *(x for impl, _ in twins for x in ("|", f"{impl} count", f"{impl} bytes")),
            "|", "model count", "model bytes", "|", "")
    return "\n".join(cost.format_table(head, lines))


def report_twins(results: list[dict]) -> str:
    """The twins of one strategy side by side, the legend, then each twin's notes."""
    compiled = ", ".join(f"{res['impl']} {res['compile_s']:.1f}s" for res in results)
    out = [f"{results[0]['strategy']} on {_where(results[0])}: twins side by side (compiled in {compiled})", "",
           "== measured per twin (ledger) beside the model, per (op, axes) ==", side_by_side(results), LEGEND,
           "(one twin alone, e.g. --impl=manual, prints its ledger, the model and memory per device)"]
    for res in results:
        if res["ticks"] is not None:
            out += ["", f"== {res['impl']}: the pipeline step read from the compiled program (twinshard/hlo/pipeline_ticks.py) ==",
                    res["ticks"].text()]
        out += ["", f"== {res['impl']} =="] + [f"NOTE: {n}" for n in res["notes"]] if res["notes"] else []
    return "\n".join(out)


def memory_table(res: dict) -> str:
    """Arguments by part (model / shard bytes / as stored), then memory_analysis() totals."""
    from twinshard.cost import human

    mem = res["memory"]
    args, ma, model = mem["arguments"], mem["analysis"], mem["model"]
    rows = [("params", human(model["params"])), ("optimizer (mu, nu)", human(model["optimizer"])),
            ("counters", "-"), ("batch", "-")]
    keys = ("params", "optimizer", "counters", "batch")
    w = [22, 12, 14, 14]

    def line(cells) -> str:
        return "".join(str(c).ljust(n) for c, n in zip(cells, w)).rstrip()

    out = [line(("argument", "model", "shard bytes", "as stored")), line(["-" * (n - 2) for n in w])]
    out += [line((name, m, human(args[k]["bytes"]), human(args[k]["padded"]))) for (name, m), k in zip(rows, keys)]
    out.append(line(("total", human(model["params"] + model["optimizer"]), human(args["total"]["bytes"]),
                     human(args["total"]["padded"]))))
    out.append(f"memory_analysis: arguments {human(ma['argument_size_in_bytes'])}, outputs "
               f"{human(ma['output_size_in_bytes'])} (aliased to arguments {human(ma['alias_size_in_bytes'])}), "
               f"temporaries {human(ma['temp_size_in_bytes'])}, code {human(ma['generated_code_size_in_bytes'])}")
    out.append(f"model: grads {human(model['grads'])} (live among the temporaries), activations "
               f"~{human(model['activations'])}"
               + (f", gathered weights ~{human(model['gathered_weights'])}" if model["gathered_weights"] else "")
               + f"; total ~{human(model['total'])}")
    if args["total"]["padded"] != args["total"]["bytes"]:
        out.append("'as stored' pads every array to its TPU layout tile (f32 (8,128), 1-D (128,)): "
                   "small shards take much more than their bytes")
    return "\n".join(out)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # jax logs each backend it cannot open at INFO
    from twinshard.hardware import topology

    topology.default_to_cpu()  # libtpu installed, no TPU here: do not probe it (it prints errors)
    if FLAGS.strategy not in common.PARALLEL:  # single (strategies.SINGLE) splits nothing
        raise ValueError(f"--strategy={FLAGS.strategy} has no collectives; choose one of {', '.join(common.PARALLEL)}.")
    cfg = common.config_from_flags(FLAGS)
    impls, pod = check_flags(FLAGS, cfg)
    devices = None
    if FLAGS.topology:
        devices = _topology_devices(FLAGS.topology, pod.slices)
    else:
        common.simulate_cpu_devices(FLAGS.devices)  # before jax initialises its backend
    results = []
    for impl in impls:
        res = collectives(FLAGS.strategy, impl, FLAGS.mesh, cfg, devices, dcn_spec=FLAGS.dcn_mesh)
        if pod is not None:
            res["prediction"] = predict_step(res, pod)
        results.append(res)
    print(report(results[0]) if len(results) == 1 else report_twins(results))  # one twin: its full detail
    for res in results if pod is not None else []:
        print(f"\n== predicted step of the {res['impl']} twin (twinshard.hlo.predict) ==\n" + res["prediction"].table())
    if FLAGS.hlo:
        with open(FLAGS.hlo, "w") as f:
            f.write("\n".join(res["hlo"] for res in results))
        print(f"wrote HLO to {FLAGS.hlo}")
    if FLAGS.timeline:
        with open(FLAGS.timeline, "w") as f:
            f.write(timeline(results, pod))
        print(f"wrote the timeline to {FLAGS.timeline}")
    if FLAGS.trace:
        from twinshard.hlo.trace import trace_events

        with open(FLAGS.trace, "w") as f:
            json.dump(trace_events([(res["impl"], res["prediction"]) for res in results], _title(pod, results)), f)
        print(f"wrote the trace to {FLAGS.trace} (ui.perfetto.dev: Open trace file; docs/schedule.md)")
    if FLAGS.json:
        docs = [_json_doc(res) for res in results]
        with open(FLAGS.json, "w") as f:
            json.dump(docs[0] if len(docs) == 1 else {"twins": docs}, f, indent=1)
        print(f"wrote JSON to {FLAGS.json}")
    return 0


def timeline(results: list[dict], pod) -> str:
    """The --timeline SVG: a pipeline step's picture (a lane per stage, read from the compiled program),
    then with a --topology each twin's predicted step on a time axis."""
    from twinshard.hlo import draw, draw_pipeline

    svgs = []
    if results[0]["ticks"] is not None:
        mesh = ",".join(f"{a}:{n}" for a, n in results[0]["mesh"].items())
        svgs.append(draw_pipeline.pipeline_svg([(res["impl"], res["ticks"]) for res in results],
                                               f"{FLAGS.strategy} --schedule={FLAGS.schedule} on mesh {mesh}: the "
                                               "compiled step's ticks"))
    if pod is not None:
        svgs.append(draw.timeline_svg([(res["impl"], res["prediction"]) for res in results], _title(pod, results)))
    return svgs[0] if len(svgs) == 1 else draw_pipeline.stack(svgs)


def _title(pod, results: list[dict]) -> str:
    mesh = ",".join(f"{a}:{n}" for a, n in results[0]["mesh"].items())
    return f"{FLAGS.strategy} on {pod.describe()}, preset {FLAGS.preset}, mesh {mesh}: one training step"


def _json_doc(res: dict) -> dict:
    doc = {k: v for k, v in res.items() if k not in ("ledger", "model", "hlo", "prediction", "ticks")}  # memory: plain data
    if res["ticks"] is not None:
        doc["ticks"] = {"grid": [[c.label() if c else None for c in row] for row in res["ticks"].grid],
                        "form": res["ticks"].form, "bubble": float(res["ticks"].bubble())}
    doc.update(preset=FLAGS.preset, ledger=res["ledger"].as_dict(), model=res["model"].as_dict())
    if "prediction" in res:
        doc["prediction"] = res["prediction"].as_dict()
    return doc


def check_flags(FLAGS, cfg):
    """(twins, the --topology's chips and links or None), every flag checked before anything compiles."""
    from twinshard.hardware import links, topology
    from twinshard.parallel import mesh as mesh_lib
    from twinshard.parallel import resolve, strategies

    impls = [i.strip() for i in FLAGS.impl.split(",")]
    if len(set(impls)) != len(impls) or not all(impls):
        raise ValueError(f"--impl={FLAGS.impl}: name each twin once, e.g. --impl=auto,manual.")
    for impl in impls:
        resolve.check_twin(strategies.get(FLAGS.strategy), impl, cfg)
    for flag in ("json", "hlo", "timeline", "trace"):
        common.check_output_path(getattr(FLAGS, flag), flag, FLAGS.force)
    pipeline = strategies.get(FLAGS.strategy).family == "pipeline"  # its picture needs no chip's timing
    for flag, what in (("timeline", "draws"), ("trace", "writes")):
        if getattr(FLAGS, flag) and not FLAGS.topology and not (flag == "timeline" and pipeline):
            raise ValueError(f"--{flag}={getattr(FLAGS, flag)} {what} the step on the chips of a --topology (e.g. "
                             "--topology=v5e:2x2); pass one.")
    if not FLAGS.topology:
        return impls, None
    topology.chips_per_host(FLAGS.topology)  # GENERATION:AxB[xC]
    pod = links.parse_topology(FLAGS.topology)
    if FLAGS.dcn_mesh:  # one --topology slice per DCN position: compiled for them all (libtpu's num_slices)
        pod = links.with_slices(pod, math.prod(mesh_lib.parse_dcn_mesh(FLAGS.dcn_mesh, FLAGS.strategy, FLAGS.mesh).values()))
        # Measured (libtpu 0.0.50.1): hsdp's GSPMD twin for 2 v5e:2x2 slices stops at a RET_CHECK in the compiler
        # (hlo_verifier.cc:673, `subgroup_size == 1 || shard_count == subgroup_size` on a reduce-scatter).
        if any(impl != "manual" for impl in impls):
            raise ValueError(f"--impl={FLAGS.impl} with --dcn_mesh={FLAGS.dcn_mesh} --topology={FLAGS.topology}: libtpu "
                             "does not compile the GSPMD twin across slices (a compiler check fails); pass "
                             "--impl=manual (docs/slices.md).")
    if not pod.chip.is_tpu:
        raise ValueError(f"--topology={FLAGS.topology}: compiling ahead of time is for TPU topologies (v4, v5e, "
                         "v5p, v6e); plan GPU clusters with launch.plan.")
    if FLAGS.mesh and not FLAGS.dcn_mesh:  # across slices: resolve_run checks the slices and the mesh
        asked = math.prod(mesh_lib.parse_mesh(FLAGS.mesh, FLAGS.strategy).values())
        if asked != pod.chips:
            raise ValueError(f"--mesh={FLAGS.mesh} has {asked} devices but --topology={FLAGS.topology} has "
                             f"{pod.chips} chips; pick a mesh of {pod.chips}.")
    return impls, pod


def predict_step(res: dict, pod):
    """The compiled step's predicted time on the pod's chips, each mesh axis on its links: an axis across
    slices on the data-center network (links.dcn_link), the others on one slice's ICI."""
    from twinshard.hardware import links, step_time

    inside = {a: n for a, n in res["mesh"].items() if a not in res["dcn"]}
    known = {**links.axis_links(pod, inside), **{a: links.dcn_link(pod) for a in res["dcn"]}}
    return step_time.predict_step(res["hlo"], pod.chip, res["mesh"], known)


if __name__ == "__main__":
    common.run(main, "launch.collectives")
