"""Every command the README and docs/*.md show runs as written (in their order, in one scratch directory).

The commands are read from the ```bash blocks of README.md, then of docs/*.md in name
order, so an edit is tested as edited; a command this file does not know fails
`test_every_readme_command_is_covered`.
What the test changes, and why (each variant only adds flags; absl keeps the last value):

- the `pip install uv && uv run [--locked] [--extra tpu]` prefix is the environment this
  test already runs in: the rest runs with this interpreter;
- the main job trains `--steps=2 --stop_after=1` instead of 200 steps (minutes on 2
  cores; a step of `small` is ~2 s of CPU here), and the resume after it `--steps=2` (a resume
  must keep the run's --steps);
  the bf16 example and the memory example train `--steps=4`; the bench runs
  `--strategies=single` instead of its four default strategies x both twins (each run compiles its
  own step; tests/test_bench.py runs the strategies), with a 512^3 peak matmul timed 3 times
  (twenty 2048^3 ones took 7 of its 27 s on a 2-core VM); the tp comparison runs `--steps=3`;
  the samplers write 20 tokens, not 200 (the small model's 200 took ~6 s: without a KV cache
  each token runs the whole 128-token window); the named mutant runs without the unmutated
  baseline pass (`--no-baseline`: its selection runs once, not twice; ~12 s);
- HOME is a scratch directory, so the token cache (~/.cache/twinshard) is too;
- `corpus.txt` (the BPE example's "any UTF-8 text") is the first 300 kB of the
  embedded Shakespeare corpus.

`tools/mutate.py` runs from the repository root (its path is made absolute).
Not run here: the test command (it is this suite), the Cloud TPU VM's gpt2_125m run and the multi-process command
(`--coordinator_address`, `--num_processes` or `--distributed`: tests/test_multiprocess.py).
"""

from __future__ import annotations

import gzip
import json
import re
import shlex

import pytest

from cli import ROOT, run
from twinshard.config import ModelConfig, preset
from twinshard.train.data import DEFAULT_CORPUS

UV_PREFIX = re.compile(r"^(pip install uv && )?uv run( --locked)?( --extra tpu)? ")

# README command -> flags this test adds (see the module docstring)
VARIANTS = {
    "pip install uv && uv run --locked python -m launch.train --preset=small --workdir=runs/small":
        ["--steps=2", "--stop_after=1"],
    'uv run python -m launch.sample --workdir=runs/small --prompt="ROMEO:"': ["--max_new_tokens=20"],
    "uv run python -m launch.train --preset=small --workdir=runs/small --resume": ["--steps=2"],
    "uv run python -m launch.train --preset=tiny --strategy=fsdp_tp --impl=manual --mesh=data:2,tensor:4 "
    "--workdir=runs/ftp": [],
    "uv run python -m launch.compare --preset=tiny --strategy=tp --devices=4 --steps=10 --plot=tp.png": ["--steps=3"],
    "uv run python -m launch.collectives --preset=tiny --strategy=fsdp --impl=manual": [],
    "uv run python -m launch.collectives --preset=tiny --strategy=pp --impl=manual --mesh=stage:2 --devices=2 "
    "--microbatches=4 --schedule=zb_h1": [],
    "uv run python -m launch.collectives --preset=tiny --strategy=tp_sp --impl=manual --mesh=tensor:4 --devices=4 "
    "--collective_matmul": [],
    "uv run python -m launch.collectives --preset=tiny --strategy=cp --impl=manual --mesh=context:4 --devices=4": [],
    "uv run python -m launch.collectives --preset=tiny --num_heads=8 --strategy=ulysses --impl=manual --mesh=context:4 "
    "--devices=4": [],
    "uv run python -m launch.collectives --preset=tiny --strategy=fsdp --impl=explicit": [],
    "uv run python -m launch.train --preset=tiny_moe --strategy=ep --impl=manual --mesh=data:2,expert:4 "
    "--workdir=runs/ep": [],
    "uv run python -m launch.collectives --preset=tiny_moe --strategy=ep --impl=manual --mesh=data:2,expert:4": [],
    "uv run python -m twinshard.train.bpe --input corpus.txt --vocab_size 512 --out corpus512.tiktoken": [],
    "uv run python -m launch.train --preset=tiny --data=corpus.txt --tokenizer=corpus512.tiktoken "
    "--workdir=runs/bpe": [],
    'uv run python -m launch.sample --workdir=runs/bpe --prompt="ROMEO:"': ["--max_new_tokens=20"],
    "uv run python -m launch.train --preset=tiny --dtype=bfloat16 --workdir=runs/bf16": ["--steps=4"],
    "uv run python -m launch.train --preset=tiny --strategy=fsdp --impl=manual --devices=4 --remat=full "
    "--grad_accum=2 --optimizer=adafactor --workdir=runs/scale": ["--steps=4"],
    "uv run python -m launch.bench --preset=tiny --steps=3 --json=bench.json --markdown=bench.md":
        ["--strategies=single", "--matmul_size=512", "--matmul_reps=3"],
    "uv run python tools/step_profile.py --preset=tiny": ["--steps=1"],
    "uv run python -m launch.plan --preset=llm_1b --topology=v5p:4x4x4": [],
    "uv run python -m launch.plan --preset=gpt2_350m --topology=h100:8x8 --dtype=bfloat16": [],
    "uv run --extra tpu python -m launch.collectives --preset=tiny --strategy=fsdp --impl=auto,manual "
    "--topology=v5e:2x2 --timeline=fsdp_tiny.svg --json=fsdp_tiny.json --trace=fsdp_tiny.trace.json": [],
    "uv run python tools/mutate.py --list": [],
    "uv run python tools/mutate.py --only adamw-betas-swapped": ["--no-baseline"],
}
NOT_RUN = {"pip install uv && uv run --locked --extra tpu pytest": "this test suite itself",
           **{c: "a subset of this test suite (tests/test_proofs.py checks the markers it selects)" for c in (
               'uv run pytest -m fsdp', 'uv run pytest -m "ulysses"',
               'uv run pytest -m "fsdp and not (fsdp_tp or fsdp_cp or fsdp_ulysses or pp_fsdp or fsdp_ep)"')},
           "pip install uv && uv run --locked --extra tpu python -m launch.train --preset=gpt2_125m "
           "--batch_size=16 --workdir=runs/g125": "the Cloud TPU VM example (a TPU's job)",
           **{c: "docs/schedule.md's prediction beside a profile measured on a v5e:2x2 (tests/test_timeline_cli.py "
                 "writes the trace of the tiny model and merges it with a measured one)" for c in (
               "uv run --extra tpu python -m launch.collectives --preset=gpt2_125m --dtype=bfloat16 --batch_size=16 "
               "--strategy=fsdp --impl=manual --topology=v5e:2x2 --trace=predicted.json",
               "uv run --extra tpu python -m launch.train --preset=gpt2_125m --dtype=bfloat16 --batch_size=16 "
               "--strategy=fsdp --impl=manual --steps=10 --profile_steps=5:1 --workdir=runs/g125_fsdp",
               "uv run python tools/trace_beside.py --predicted=predicted.json "
               "--measured='runs/g125_fsdp/plugins/profile/*/perfetto_trace.json.gz' --out=both.json.gz")},
           **{f"uv run --extra tpu python -m launch.collectives --preset=gpt2_350m --dtype=bfloat16 "
              f"--attention=recompute --batch_size=16 --topology=v5e:4x4 --strategy={s} --impl=auto,manual "
              f"--async_collectives=false --timeline=docs/schedule_{s}.svg": "docs/schedule.md's pictures: minutes of TPU compiles each "
              "(tests/test_timeline_cli.py draws the tiny model)" for s in ("fsdp", "tp", "ulysses")}}


def docs_text() -> str:
    """README.md, then the docs/ pages in name order: the order their commands run in."""
    return "\n".join(p.read_text() for p in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))))


def readme_commands() -> list[str]:
    """The command lines of the bash blocks of the README and docs/: continuations joined, comments dropped."""
    text = docs_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(shlex.split(line, comments=True, posix=False)) if line.strip() else ""
            if line:
                commands.append(line)
    return commands


README_MAX_LINES = 250  # the details live in docs/


def test_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def is_multi_process(command: str) -> bool:
    return any(flag in command for flag in ("--coordinator_address", "--num_processes", "--distributed"))


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert len(commands) == len(set(commands))
    assert {c for c in commands if not is_multi_process(c)} == set(VARIANTS) | set(NOT_RUN)
    assert any(is_multi_process(c) for c in commands)


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    """Run the README's commands in order in one scratch directory; command -> process."""
    cwd = tmp_path_factory.mktemp("readme")
    with gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        (cwd / "corpus.txt").write_text(f.read(300_000), encoding="utf-8")
    runs = {}
    for command in readme_commands():
        if command in VARIANTS:
            argv = shlex.split(UV_PREFIX.sub("", command))
            assert argv[0] == "python", command
            script = [str(ROOT / argv[1])] if argv[1].startswith("tools/") else [argv[1]]  # from the repo root
            # TMPDIR: tools/mutate.py keeps one scratch slot under the temp dir, and xdist may run
            # this fixture on both workers at once (measured: "slot0 is in use", exit 2)
            runs[command] = run(*script, *argv[2:], *VARIANTS[command], cwd=cwd, timeout=600,
                                HOME=str(cwd), TMPDIR=str(cwd))
    return cwd, runs


def test_readme_commands_run(readme_runs):
    _, runs = readme_runs
    assert set(runs) == set(VARIANTS)
    for command, proc in runs.items():
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr and "TPU_WORKER_HOSTNAMES" not in proc.stderr, proc.stderr


def out(readme_runs, start: str) -> str:
    return next(p.stdout for c, p in readme_runs[1].items() if start in c)


def test_main_job_samples_and_resumes(readme_runs):
    cwd, _ = readme_runs
    assert "done: step 1 of 2" in out(readme_runs, "--preset=small --workdir=runs/small")
    assert out(readme_runs, "launch.sample --workdir=runs/small").startswith("ROMEO:")
    resumed = out(readme_runs, "--workdir=runs/small --resume")
    assert "at step 1" in resumed and "done: step 2 of 2" in resumed
    steps = [json.loads(line)["step"] for line in (cwd / "runs/small/metrics.jsonl").read_text().splitlines()]
    assert steps == [2]  # small logs every 10 steps and at the last one; the stop at 1 is no log step


def test_strategy_compare_and_collectives_examples(readme_runs):
    cwd, _ = readme_runs
    assert "done: step 20 of 20" in out(readme_runs, "--strategy=fsdp_tp --impl=manual")
    compared = out(readme_runs, "launch.compare")
    # single vs auto vs manual vs explicit from one init on the same batches: the four losses of each step
    losses = [[float(v) for v in line.split()[1:]] for line in compared.splitlines()
              if re.match(r"^ +\d+( +\d+\.\d+){4}$", line)]
    assert len(losses) == 3, compared[:2000]  # --steps=3
    for single, *twins in losses:
        assert all(abs(twin - single) < 2e-5 for twin in twins), losses
    diffs = dict(re.findall(r"^(max_\w+): (\S+)$", compared, re.M))
    impls = ("auto", "manual", "explicit")
    assert set(diffs) == {f"max_{d}_diff_{i}_vs_single" for i in impls for d in ("grad", "param")} | {
        "max_param_diff_manual_vs_auto", "max_param_diff_explicit_vs_manual"}
    for key, value in diffs.items():  # measured: grads 4.5e-08, params 2.4e-07
        assert float(value) < (1e-6 if "grad" in key else 2e-5), (key, value)
    for twin in ("manual", "explicit"):  # tp: both ledgers equal the cost model
        vs_model = compared.split(f"{twin} ledger vs cost model:")[1].split("ledger vs cost model:")[0]
        rows = [line for line in vs_model.splitlines() if re.match(r"(all-reduce|TOTAL) ", line)]
        assert len(rows) == 2 and all(line.rstrip().endswith("ok") for line in rows), (twin, vs_model)
    assert "plot: tp.png" in compared
    png = cwd / "tp.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "fsdp/manual on cpu mesh data:8,tensor:1" in out(readme_runs, "launch.collectives")
    typed = out(readme_runs, "--strategy=fsdp --impl=explicit")  # docs/explicit.md
    assert "fsdp/explicit on cpu mesh data:8,tensor:1" in typed and "NOTE: The model describes the manual" in typed


def test_own_tokenizer_trains_and_samples(readme_runs):
    cwd, _ = readme_runs
    ranks = (cwd / "corpus512.tiktoken").read_text().splitlines()
    assert len(ranks) == 511  # 256 bytes + 255 merges; <|endoftext|> is id 511
    trained = out(readme_runs, "--tokenizer=corpus512.tiktoken")
    tiny = preset("tiny").model
    with_bpe = ModelConfig(512, tiny.context_length, tiny.d_model, tiny.num_layers, tiny.num_heads)
    assert f"params={with_bpe.num_params():,}" in trained and "done: step 20 of 20" in trained
    meta = json.loads((cwd / "runs/bpe/checkpoints/20/meta/metadata").read_text())
    assert meta["model"]["vocab_size"] == 512 and meta["train"]["tokenizer"] == str(cwd / "corpus512.tiktoken")
    assert out(readme_runs, "launch.sample --workdir=runs/bpe").startswith("ROMEO:")


def test_mutation_harness_examples(readme_runs):
    """--list lists the mutants and counts the stale ones (a stale mutant is the mutation
    harness's business, `tools/mutate.py --check`, not a failure of this suite); the named
    mutant is caught and the working tree is left as it was."""
    listed = out(readme_runs, "tools/mutate.py --list")
    assert re.search(r"^\d{3,} mutants, \d+ stale$", listed.rstrip().splitlines()[-1]), listed[-500:]
    ran = out(readme_runs, "tools/mutate.py --only")
    assert ran.count("| optim | caught |") == 1 and "working tree unchanged" in ran, ran[-2000:]


def test_pipeline_and_memory_examples(readme_runs):
    cwd, _ = readme_runs
    piped = out(readme_runs, "--strategy=pp")
    rows = [line for line in piped.splitlines() if re.match(r"(collective-permute|all-reduce|TOTAL) +stage +\d+/\d+", line)]
    assert len(rows) == 3 and all(line.rstrip().endswith("ok") for line in rows), piped[-3000:]  # ledger = model
    assert "done: step 4 of 4" in out(readme_runs, "--workdir=runs/scale")
    meta = json.loads((cwd / "runs/scale/checkpoints/4/meta/metadata").read_text())
    assert meta["model"]["remat"] == "full"
    assert (meta["train"]["grad_accum"], meta["train"]["optimizer"]) == (2, "adafactor")


def test_context_parallel_example(readme_runs):
    ringed = out(readme_runs, "--strategy=cp")
    rows = [line for line in ringed.splitlines() if re.match(r"(collective-permute|all-reduce|TOTAL) +context +\d+/\d+", line)]
    assert len(rows) == 3 and all(line.rstrip().endswith("ok") for line in rows), ringed[-3000:]  # ledger = model


def test_bf16_and_bench_examples(readme_runs):
    cwd, _ = readme_runs
    assert "done: step 4 of 4" in out(readme_runs, "--workdir=runs/bf16")
    meta = json.loads((cwd / "runs/bf16/checkpoints/4/meta/metadata").read_text())
    assert meta["model"]["dtype"] == "bfloat16"
    doc = json.loads((cwd / "bench.json").read_text())
    assert [r["strategy"] for r in doc["runs"]] == ["single"]
    assert (cwd / "bench.md").read_text().strip()
    profiled = out(readme_runs, "tools/step_profile.py")
    shares = [float(m) for m in re.findall(r"^\| [a-z/ -]+ \| [\d.]+ \| ([\d.]+)% \|$", profiled, re.M)]
    assert "| matmul |" in profiled and abs(sum(shares) - 100) < 0.5, profiled  # every op has a kind


def test_user_script_with_the_tpu_extra_is_quiet_on_cpu(tmp_path):
    """The README's advice for user scripts: JAX_PLATFORMS=cpu, and jax does not probe libtpu."""
    proc = run("-c", "import jax; print(jax.numpy.ones(3).sum(), jax.devices())", cwd=tmp_path)
    assert proc.returncode == 0 and "3.0 [CpuDevice(id=0)" in proc.stdout, proc.stderr
    assert "TPU_WORKER_HOSTNAMES" not in proc.stderr and "libtpu" not in proc.stderr
