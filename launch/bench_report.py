"""launch.bench's report: the one-line summary of a run and the Markdown section of a whole benchmark
(BENCHMARKS.md's tables), from the JSON document launch.bench writes."""


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2 ** 20:,.1f}"


def summary_line(rec: dict) -> str:
    c = rec["collectives"]
    return (f"{rec['run']:<16} compile {rec['compile_s']:6.2f}s  init {rec['init']['wall_s']:6.2f}s  "
            f"step {1e3 * rec['step_s']['median']:8.1f} ms  {rec['tokens_per_s']:9,.0f} tok/s  "
            f"{_si(rec['model_flops_per_s'], 'FLOP/s'):>13}  {100 * rec['fraction_of_measured_peak']:5.1f}% of peak "
            "(causal attention counted half)"
            + (f"  ledger/model bytes {c['bytes_ratio']:.3f}" if c and c["bytes_ratio"] is not None else ""))


def markdown(doc: dict) -> str:
    """One Markdown section: the setup, the peaks, and one table row per run."""
    env, m = doc["environment"], doc["model"]
    where = env["backend"] if env["backend"] == "cpu" else env["device_kind"]
    accum = f" in {doc['grad_accum']} micro-batches" if doc.get("grad_accum", 1) > 1 else ""
    lines = [f"### {doc['preset']} on {where}: batch {doc['batch_size']}x{doc['seq_len']}{accum}, {doc['dtype']}",
             "",
             f"`{doc['command']}`" if doc["command"] else "",
             "",
             f"- model: d_model {m['d_model']}, {m['num_layers']} layers, {m['num_heads']} heads"
             + (f" ({m['num_kv_heads']} key/value)" if m.get("num_kv_heads") else "") + f", d_ff {m['d_ff']}, "
             f"vocab {m['vocab_size']}; {doc['steps']} timed steps after {doc['warmup']} warm-up",
             f"- machine: {env['backend']} ({env['device_kind']}), {env['device_count']} device(s), "
             f"{env['cpus_usable']} usable CPUs of {env['cpu_count']}, load avg "
             f"{_load(env['load_avg_before'])} before / {_load(env.get('load_avg_after'))} after; "
             f"jax {env['jax']}, flax {env['flax']}, commit {env['git_commit']}, {env['time_utc']} UTC"]
    lines += [f"- {line}" for line in doc.get("fast_path", ())]  # on a TPU: the options the run did not name
    for d, p in doc["peaks"].items():
        again = f"; {_si(p['flops_per_s_after'], 'FLOP/s')} after the runs" if "flops_per_s_after" in p else ""
        lines.append(f"- measured matmul peak {d} {p['n']}^3: {_si(p['flops_per_s'], 'FLOP/s')} "
                     f"(25th percentile time of {p['reps']}, before the runs: '% of peak' uses it{again})")
    if doc["chip"]:
        c = doc["chip"]
        lines.append(f"- nominal {c['name']}: bf16 {c['bf16']} TFLOP/s, tf32 {c['tf32']}, fp32 {c['fp32']} "
                     f"({c['source']})")
    head = ("run", "mesh", "lower s", "compile s", "compile / single", "init s (XLA compile)", "step ms (min-max)",
            "tokens/s", "step / single", "model FLOP/s (causal attention counted half)", "% of peak", "mem/dev MiB: XLA / model",
            "ledger/model bytes")
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["runs"]:
        vs, c, mem = r.get("vs_single"), r["collectives"], r["memory"]
        xla = mem["xla"]["peak_estimate"] if mem["xla"] else None
        pct = f"{100 * r['fraction_of_measured_peak']:.1f}" + (
            f" (MFU {100 * r['mfu_nominal']:.1f})" if r.get("mfu_nominal") is not None else "")
        cells = (r["run"], ",".join(f"{a}:{n}" for a, n in r["mesh"].items()) if r["mesh"] else "1 device",
                 f"{r['lower_s']:.2f}", f"{r['compile_s']:.2f}", f"{vs['compile_time']:.2f}" if vs else "-",
                 f"{r['init']['wall_s']:.2f} ({r['init']['compile_s']:.2f})",
                 f"{1e3 * r['step_s']['median']:.1f} ({1e3 * r['step_s']['min']:.1f}-{1e3 * r['step_s']['max']:.1f})",
                 f"{r['tokens_per_s']:,.0f}", f"{vs['step_time']:.2f}" if vs else "-",
                 _si(r["model_flops_per_s"], "FLOP/s"), pct,
                 f"{_mib(xla)} / {_mib(mem['model']['total'])}",
                 "-" if c is None else f"{c['bytes_ratio']:.3f}" + ("" if c["rows_match"] else " (rows differ)"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _load(avg) -> str:
    return "-" if avg is None else "/".join(f"{a:.2f}" for a in avg)
