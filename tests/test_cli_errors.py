"""Every launcher turns a user error into one short message on stderr and a non-zero exit.

Each case runs the command line in its own process (tests/cli.py) and checks: exit
status != 0, no traceback, at most 4 lines of stderr, the flag as typed, the value
and the fix in the message; and that nothing on disk was created or changed. Most
cases fail before jax is imported (about 1-2 s each).
"""

from __future__ import annotations

import gzip
import os

import pytest

from cli import assert_user_error, run


def train(*args: str, **env: str):
    return run("-m", "launch.train", "--preset=tiny", *args, **env)


@pytest.fixture
def files(tmp_path):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x01 not text" * 10)
    fake_gz = tmp_path / "fake.txt.gz"
    fake_gz.write_text("plain text, not gzip")
    latin1_gz = tmp_path / "latin1.txt.gz"
    latin1_gz.write_bytes(gzip.compress("café au lait ".encode("latin-1") * 20))
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    return {"binary": binary, "fake_gz": fake_gz, "latin1_gz": latin1_gz, "file": a_file,
            "cache": tmp_path / "cache"}


@pytest.mark.parametrize("flag, name, needles", [
    ("--data", "binary", ["--data=PATH", "binary.txt", "is not UTF-8 text (byte 0xff at offset 0)"]),
    ("--data", "fake_gz", ["--data=PATH", "fake.txt.gz", "ends in .gz but is not a complete gzip file"]),
    ("--data", "latin1_gz", ["latin1.txt.gz", "is not UTF-8 text (byte 0xe9 at offset 3 after gunzip)"]),
])
def test_unreadable_corpus(files, tmp_path, flag, name, needles):
    workdir = tmp_path / "never"
    proc = train(f"{flag}={files[name]}", f"--workdir={workdir}", f"--cache_dir={files['cache']}")
    assert_user_error(proc, *needles)
    assert not workdir.exists() and not files["cache"].exists()


def test_workdir_and_cache_dir_that_cannot_be_directories(files, tmp_path):
    f = files["file"]
    cases = [
        ([f"--workdir={f}"], [f"--workdir={f} is a file, not a directory"]),
        ([f"--workdir={f}/run"], [f"--workdir={f}/run: {f} is a file, so no directory can be made below it"]),
        ([f"--cache_dir={f}", f"--workdir={tmp_path / 'never'}"], [f"--cache_dir={f} is a file"]),
        ([f"--cache_dir={f}/c", f"--workdir={tmp_path / 'never'}"], [f"--cache_dir={f}/c: {f} is a file"]),
    ]
    for args, needles in cases:
        assert_user_error(train(*args), *needles)
    assert f.read_text() == "not a directory" and not (tmp_path / "never").exists()


def test_read_only_workdir(tmp_path):
    """Two real read-only places: a chmod 555 directory (only for a non-root user: root writes
    through it) and sysfs, where even root cannot mkdir (EPERM). Nothing is created in either."""
    places = []
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        places.append(locked)
    if os.path.isdir("/sys/kernel"):
        places.append("/sys/kernel")
    assert places, "no read-only place to test on this machine"
    for place in places:
        before = sorted(os.listdir(place))
        proc = train(f"--workdir={place}/run", f"--cache_dir={tmp_path / 'cache'}")
        assert_user_error(proc, f"--workdir={place}/run: {place} is not writable", "pass a --workdir")
        assert sorted(os.listdir(place)) == before


@pytest.mark.parametrize("flag, fix", [
    ("--steps=0", "--steps=0 must be >= 1"),
    ("--batch_size=-2", "--batch_size=-2 must be >= 1"),
    ("--context_length=0", "--context_length=0 must be >= 1"),
    ("--seed=-1", "--seed=-1 must be >= 0"),
    ("--lr=nan", "--lr=nan must be a positive number"),
    ("--lr=0", "--lr=0.0 must be a positive number"),
    ("--preset=huge", "--preset=huge: unknown preset 'huge'; choose one of tiny, small"),
    ("--tokenizer=/no/such.tiktoken", "--tokenizer=/no/such.tiktoken: no such file"),
])
def test_config_errors_name_the_flag(tmp_path, flag, fix):
    proc = train(flag, f"--workdir={tmp_path / 'never'}")
    err = assert_user_error(proc, fix)
    assert "TrainConfig" not in err and "ModelConfig" not in err
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("args, needles", [
    (["--quantization=int4"], ["--quantization=int4: value should be one of <none|int8|int8_dw>"]),
    (["--quantization=int8", "--strategy=tp"], ["--quantization=int8 with --strategy=tp: its `tensor` axis",
                                                "or --quantization=none"]),
    (["--quantization=int8", "--qkv_layout=heads"], ["--quantization=int8 quantizes the [tokens, D] projections",
                                                     "pass --qkv_layout=tokens"]),
])
def test_quantization_it_cannot_run_is_refused_in_one_line(tmp_path, args, needles):
    err = assert_user_error(train(*args, f"--workdir={tmp_path / 'never'}"), *needles)
    assert len(err.strip().splitlines()) <= 2 and not (tmp_path / "never").exists()


def test_a_step_too_big_for_the_device_is_refused_before_compiling(tmp_path):
    """tiny at T = 100000: attention's backward [T, T] alone is ~2.4 TB, far beyond any host; the
    cost model's estimate refuses it in one line naming what dominates, before anything compiles
    or is written (without the check: RESOURCE_EXHAUSTED after the compile, 24 lines)."""
    proc = train("--context_length=100000", f"--workdir={tmp_path / 'never'}")
    assert_user_error(proc, "per device by the cost model (one layer's backward working set", "[T, T] grows with T^2",
                      "--skip_memory_check")
    assert not (tmp_path / "never").exists()


def test_debug_shows_the_traceback(tmp_path):
    for proc in (train("--steps=0", "--debug"), train("--steps=0", TWINSHARD_DEBUG="1")):
        assert proc.returncode != 0 and "Traceback" in proc.stderr and "--steps=0 must be >= 1" in proc.stderr


def test_truncated_metrics_on_resume_names_the_file_and_line(tmp_path):
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "4").mkdir(parents=True)  # the resume check needs a step directory
    metrics = workdir / "metrics.jsonl"
    metrics.write_text('{"step": 2, "loss": 5.1}\n{"step": 4, "lo')
    before = metrics.read_bytes()
    proc = train(f"--workdir={workdir}", "--resume")
    assert_user_error(proc, f"--resume: {metrics} line 2 is not a metrics record", "Fix or remove that line")
    assert metrics.read_bytes() == before


def test_compare_checks_its_outputs_before_running(tmp_path):
    proc = run("-m", "launch.compare", "--preset=tiny", "--strategy=dp", "--plot=/missing/dir/x.png")
    assert_user_error(proc, "--plot=/missing/dir/x.png: directory /missing/dir does not exist")
    assert proc.stdout == ""  # no loss table: nothing ran


def test_mesh_advice_resolves_in_one_step():
    """tp on 8 devices cannot split tiny's 4 heads; the advice names --devices and --mesh
    (tests/test_mesh.py resolves every such advice; test_readme.py runs `--devices=4`)."""
    proc = run("-m", "launch.compare", "--preset=tiny", "--strategy=tp", "--steps=10")
    assert_user_error(proc, "heads=4 is not divisible by mesh axis tensor=8",
                      "run on 4: --devices=4 --mesh=data:1,tensor:4")
    proc = run("-m", "launch.collectives", "--preset=tiny", "--strategy=tp", "--mesh=data:1,tensor:4")
    assert_user_error(proc, "mesh data:1,tensor:4 has 4 devices but 8 are available",
                      "run on 4: --devices=4 --mesh=data:1,tensor:4")


def test_sample_and_bpe_errors(tmp_path, files):
    assert_user_error(run("-m", "launch.sample", f"--workdir={tmp_path / 'none'}"),
                      "no checkpoints in", "train first")
    assert_user_error(run("-m", "launch.sample", f"--workdir={tmp_path}", "--temperature=-1"),
                      "--temperature=-1.0 must be >= 0")
    out = tmp_path / "x.tiktoken"
    for args, needles in [
        ([f"--input={files['binary']}", "--vocab_size=300"], ["--input=PATH", "is not UTF-8 text"]),
        (["--vocab_size=100"], ["--vocab_size=100 must be >= 257"]),
        ([f"--input={files['fake_gz']}", "--vocab_size=300"], ["--input=PATH", "not a complete gzip"]),
    ]:
        assert_user_error(run("-m", "twinshard.train.bpe", *args, f"--out={out}"), *needles)
    assert_user_error(run("-m", "twinshard.train.bpe", "--vocab_size=300", "--out=/missing/dir/x.tiktoken"),
                      "--out=/missing/dir/x.tiktoken: directory /missing/dir does not exist")
    assert not out.exists()


@pytest.fixture
def shards(tmp_path):
    """A corpus as byte-tokenizer shards (tmp/shards) and broken copies of them."""
    from twinshard.train import data
    from twinshard.train.shards import SHARDS_JSON

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 200)
    data.write_shards([corpus], tmp_path / "shards", "bytes", shard_tokens=3000)
    missing = tmp_path / "missing"
    missing.mkdir()
    for name in ("shard_000000.bin", SHARDS_JSON):
        (missing / name).write_bytes((tmp_path / "shards" / name).read_bytes())
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "train.bin").write_bytes(b"\x01\x00\x02")  # 3 bytes: not whole uint16 ids
    return {"corpus": corpus, "shards": tmp_path / "shards", "missing": missing, "bare": bare}


@pytest.mark.parametrize("data, extra, needles", [
    ("missing", [], ["shards.json lists shard_000001.bin, which is missing; restore it"]),
    ("shards", ["--tokenizer=gpt2"], ["its shards were tokenized with bytes (shards.json), this run uses "
                                      "--tokenizer=gpt2; pass --tokenizer=bytes"]),
    ("bare", [], ["token files without shards.json", "pass --data_dtype=uint16 (nanoGPT's .bin)"]),
    ("bare", ["--data_dtype=uint16"], ["train.bin has 3 bytes, not a whole number of uint16 ids"]),
    ("nothing/*.bin", [], ["nothing/*.bin matches no file"]),
    ("corpus", ["--data_dtype=uint16"], ["--data_dtype=uint16 is for .bin token files; drop it"]),
])
def test_bad_token_shards_fail_before_anything_is_written(shards, tmp_path, data, extra, needles):
    spec = shards[data] if data in shards else f"{tmp_path}/{data}"
    workdir, cache = tmp_path / "never", tmp_path / "cache"
    proc = train(f"--data={spec}", *extra, f"--workdir={workdir}", f"--cache_dir={cache}")
    assert_user_error(proc, *([f"--data={spec}"] if data != "corpus" else []), *needles)
    assert not workdir.exists() and not cache.exists()


def test_tokenize_errors(shards, files, tmp_path):
    out = tmp_path / "out"
    cases = [
        ([f"--out={out}"], ["--tokenizer is required"]),
        (["--tokenizer=bytes"], ["--out is required"]),
        ([f"--out={out}", "--tokenizer=nope"], ["--tokenizer=nope: no such file and not a built-in tokenizer"]),
        ([f"--out={out}", "--tokenizer=bytes", "--shard_tokens=0"], ["--shard_tokens=0 must be >= 1"]),
        ([f"--out={shards['shards']}", "--tokenizer=bytes"], [f"--out={shards['shards']} already holds shards"]),
        ([f"--out={files['file']}/x", "--tokenizer=bytes"], [f"{files['file']} is a file"]),
        ([f"--input={tmp_path}/none/*.txt", f"--out={out}", "--tokenizer=bytes"], ["/none/*.txt matches no file"]),
        ([f"--input={files['binary']}", f"--out={out}", "--tokenizer=bytes"],
         ["--input=PATH", "is not UTF-8 text (byte 0xff at offset 0)"]),
        ([f"--input={files['fake_gz']}", f"--out={out}", "--tokenizer=bytes"], ["not a complete gzip file"]),
    ]
    for args, needles in cases:
        assert_user_error(run("-m", "launch.tokenize", *args), *needles)
        assert not out.exists(), args


def collectives(*args: str):
    return run("-m", "launch.collectives", "--preset=tiny", "--strategy=fsdp", *args)


def test_collectives_timeline_errors_come_before_any_compile(tmp_path):
    """launch.collectives --timeline / --trace / --topology / --impl: each bad value one line, nothing compiled
    or written."""
    svg, trace = tmp_path / "step.svg", tmp_path / "step.trace.json"
    cases = [
        (["--topology=v9z:2x2", f"--timeline={svg}"], ["--topology=v9z:2x2: unknown chip 'v9z'", "v5e"]),
        (["--topology=v5e:2x2", "--mesh=data:8,tensor:1", f"--timeline={svg}"],
         ["--mesh=data:8,tensor:1 has 8 devices but --topology=v5e:2x2 has 4 chips; pick a mesh of 4"]),
        (["--topology=v5e:20x20"], ["--topology=v5e:20x20: 20x20 does not fit in a v5e pod (16x16"]),
        (["--topology=h100:1x8"], ["--topology=h100:1x8: compiling ahead of time is for TPU topologies"]),
        (["--topology=v5e:2x2", "--impl=auto,bogus", f"--timeline={svg}"], ["--impl=bogus is not a twin"]),
        (["--topology=v5e:2x2", "--impl=auto,auto", f"--timeline={svg}"], ["--impl=auto,auto: name each twin once"]),
        ([f"--timeline={svg}"], [f"--timeline={svg} draws the step on the chips of a --topology"]),
        (["--topology=v5e:2x2", "--timeline=/no/such/dir/x.svg"],
         ["--timeline=/no/such/dir/x.svg: directory /no/such/dir does not exist"]),
        ([f"--trace={trace}"], [f"--trace={trace} writes the step on the chips of a --topology"]),
        (["--topology=v5e:2x2", f"--trace={tmp_path}"], [f"--trace={tmp_path} is a directory; pass a file path."]),
        (["--topology=v5e:2x2", f"--trace={svg}/x.json"], [f"--trace={svg}/x.json: directory {svg} does not exist"]),
    ]
    for args, needles in cases:
        assert_user_error(collectives(*args), *needles)
    assert_user_error(run("-m", "launch.collectives", "--preset=tiny", "--strategy=pp_fsdp", "--impl=auto,explicit",
                          "--topology=v5e:2x2", f"--timeline={svg}"),
                      "--impl=explicit runs", "not --strategy=pp_fsdp")
    assert not svg.exists() and not trace.exists()


def test_collectives_overwrites_nothing_without_force(tmp_path):
    for flag in ("timeline", "trace", "json", "hlo"):
        kept = tmp_path / f"kept.{flag}"
        kept.write_text("earlier run")
        extra = ["--topology=v5e:2x2"] if flag in ("timeline", "trace") else []
        proc = collectives(*extra, f"--{flag}={kept}")
        assert_user_error(proc, f"--{flag}={kept} exists; pass --force to overwrite it, or another path.")
        assert kept.read_text() == "earlier run" and proc.stdout == ""


def test_an_existing_output_is_refused_only_where_a_force_flag_could_allow_it(tmp_path):
    """common.check_output_path on a file that exists: a launcher with --force (launch.collectives) refuses it
    unless --force is given; one without (launch.bench's --json, launch.plan's: force=None, a record rewritten
    each run) writes over it. A directory is never a file path."""
    from launch import common

    out = tmp_path / "run.json"
    out.write_text("{}")
    with pytest.raises(ValueError, match=rf"^--json={out} exists; pass --force to overwrite it, or another path\.$"):
        common.check_output_path(str(out), "json", force=False)
    common.check_output_path(str(out), "json", force=True)
    common.check_output_path(str(out), "json")  # no --force flag at all
    with pytest.raises(ValueError, match=rf"^--json={tmp_path} is a directory; pass a file path\.$"):
        common.check_output_path(str(tmp_path), "json")
    assert out.read_text() == "{}"  # nothing written or removed by the checks
