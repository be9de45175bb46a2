"""Token shards: streaming tokenization (launch.tokenize), reading shards as one sequence, the
held-out split, the corpus's identity, bad inputs, and training + resuming from a shard directory."""

import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cli import ROOT
from test_train import metrics, run_train
from twinshard.train import data, shards, tokenizer

# Multi-byte characters (2, 3 and 4 bytes), \r\n, tabs, runs of spaces and a long line, so reads of
# a few hundred bytes split characters and lines.
TEXT = "".join(f"{i}: Ünïcödé — 你好 🙂 they're\tnaïve,  café.\r\n" + "to be or not to be " * (i % 7) + "\n"
               for i in range(300))


def write_corpus(path: pathlib.Path, text: str = TEXT) -> pathlib.Path:
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())
    return path


def shards_of(directory, name: str = "bytes") -> np.ndarray:
    return np.asarray(shards.open_shards(directory, name, tokenizer.get_encoding(name).n_vocab))


@pytest.mark.parametrize("name", tokenizer.TOKENIZERS)
def test_streamed_shards_equal_whole_file_tokenization(tmp_path, monkeypatch, name):
    """Reads of 301 bytes (characters and lines split between reads), shards of 700 tokens, two
    files (one gzipped): the shards hold exactly read_text + encode of each file, in order."""
    monkeypatch.setattr(data, "_READ_BYTES", 301)
    texts = [write_corpus(tmp_path / "a.txt"), write_corpus(tmp_path / "b.txt.gz", TEXT[::-1])]
    stats = data.write_shards(texts, tmp_path / "out", name, shard_tokens=700)
    whole = [t for path in texts for t in data.encode(data.read_text(path), name)]
    assert shards_of(tmp_path / "out", name).tolist() == whole
    meta = json.loads((tmp_path / "out" / shards.SHARDS_JSON).read_text())
    assert [f["tokens"] for f in meta["files"]] == [700] * (len(whole) // 700) + [len(whole) % 700]
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == name and stats["forced_cuts"] == 0
    assert stats["tokens"] == len(whole) and stats["bytes"] == 2 * len(TEXT.encode())
    assert sorted(os.listdir(tmp_path / "out")) == [f["name"] for f in meta["files"]] + [shards.SHARDS_JSON]


def test_byte_tokens_are_the_utf8_bytes_even_at_forced_cuts(tmp_path, monkeypatch):
    """A stretch with no safe cut (no space or newline after a non-space character) longer than
    _MAX_CARRY reads is cut where it stands and counted; the byte tokenizer's ids are the UTF-8
    bytes at any cut."""
    monkeypatch.setattr(data, "_READ_BYTES", 64)
    monkeypatch.setattr(data, "_MAX_CARRY", 2)
    text = "x" * 500 + " tail 你好🙂" * 3
    stats = data.write_shards([write_corpus(tmp_path / "a.txt", text)], tmp_path / "out", "bytes")
    assert stats["forced_cuts"] >= 2
    assert shards_of(tmp_path / "out").tolist() == list(text.encode()) == data.encode(text, "bytes")


def test_stream_errors_are_read_texts(tmp_path, monkeypatch):
    """A bad byte past the first read: the same message, offset in the whole file, as read_text."""
    monkeypatch.setattr(data, "_READ_BYTES", 100)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(TEXT[:250].encode() + b"\xff" + b"more")
    fake = tmp_path / "fake.txt.gz"
    fake.write_text("plain text, not gzip")
    cut = tmp_path / "cut.txt"
    cut.write_bytes("abc 你".encode()[:-1])  # ends inside a character
    for path in (bad, fake, cut):
        with pytest.raises(ValueError) as whole:
            data.read_text(path, "--input")
        with pytest.raises(ValueError) as streamed:
            data.write_shards([path], tmp_path / "out", "bytes")
        assert str(streamed.value) == str(whole.value)
        assert not (tmp_path / "out").exists()  # nothing left behind, not even the directory


# The child (a fresh Python): imports, one small encode (tiktoken's threads and their malloc arenas
# now exist), then RLIMIT_AS = its address space + HEADROOM; then launch.tokenize's main, or, as the
# control, the whole-file path. Thread stacks are 1 MiB: each is address space (8 MiB by default,
# mostly never touched), and a pool's threads may start before the last pool's have unmapped theirs.
_LIMITED = """
import resource, sys, threading
threading.stack_size(1 << 20)
from absl import flags
from launch import tokenize
from twinshard.train import data

mode, corpus, out, headroom = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
data._READ_BYTES = 1 << 14
data.encode("warm up", "bytes")
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + headroom, size + headroom))
if mode == "whole":
    data.encode(data.read_text(corpus), "bytes")
else:
    flags.FLAGS(["tokenize", f"--input={corpus}", f"--out={out}", "--tokenizer=bytes", "--shard_tokens=3000000"])
    tokenize.main([])
"""
HEADROOM, CORPUS_BYTES = 4 << 20, 8 << 20  # measured: the streaming child needs 1-2 MiB of it


def test_tokenize_streams_a_corpus_twice_its_memory_limit(tmp_path):
    """launch.tokenize writes the byte tokens of an 8 MiB corpus in a process whose address space may
    grow by only 4 MiB (RLIMIT_AS) once imported; under the same limit the whole-file path (read_text
    + encode) fails with MemoryError, so the limit binds and the corpus was never in memory whole."""
    block = TEXT.encode()
    corpus = tmp_path / "big.txt"
    corpus.write_bytes(block * (CORPUS_BYTES // len(block) + 1))
    child = lambda mode: subprocess.run(  # noqa: E731
        [sys.executable, "-c", _LIMITED, mode, str(corpus), str(tmp_path / "out"), str(HEADROOM)], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    whole = child("whole")
    assert whole.returncode != 0 and "MemoryError" in whole.stderr, whole.stderr[-2000:]
    streamed = child("stream")
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    assert f"{corpus.stat().st_size / 1e6:,.1f} MB" in streamed.stdout and "3 shard(s)" in streamed.stdout
    assert np.array_equal(shards_of(tmp_path / "out"), np.fromfile(corpus, np.uint8))


def test_sharded_tokens_read_as_their_concatenation(tmp_path):
    """Windows across shard boundaries, slices of slices, and get_batch / split_tokens: the same as
    over one array of all the ids (the single-file path's memmap), bit for bit."""
    ids = np.random.default_rng(0).integers(0, 257, 5000).astype(np.uint16)
    cuts = [0, 1, 700, 700, 2900, 5000]  # an empty shard and a one-token shard too
    names = [f"s{i}.bin" for i in range(len(cuts) - 1)]
    for name, lo, hi in zip(names, cuts, cuts[1:]):
        ids[lo:hi].tofile(tmp_path / name)
    (tmp_path / shards.SHARDS_JSON).write_text(json.dumps({"dtype": "uint16", "tokenizer": "bytes", "files": names}))
    tokens = shards.open_shards(tmp_path, "bytes", 257)
    assert len(tokens) == 5000 and np.array_equal(np.asarray(tokens), ids)
    assert np.array_equal(np.asarray(tokens[650:4000][40:60]), ids[690:710])
    scattered = np.random.default_rng(1).integers(0, 5000, (7, 9))  # not windows: gathered id by id
    assert np.array_equal(tokens[scattered], ids[scattered])
    for (a, b) in zip(data.split_tokens(tokens), data.split_tokens(ids)):
        assert len(a) == len(b) and np.array_equal(np.asarray(a), b)
        for step in range(3):
            for x, y in zip(data.get_batch(a, 16, 64, 0, step), data.get_batch(b, 16, 64, 0, step)):
                assert x.dtype == y.dtype == np.int32 and np.array_equal(x, y)


def test_an_id_past_the_vocab_in_a_window_names_the_file(tmp_path):
    """The load check reads samples; any window that gathers an id >= vocab_size is refused too."""
    ids = np.zeros(100_000, np.uint16)
    ids[50_001] = 300  # between the sampled blocks
    ids.tofile(tmp_path / "a.bin")
    tokens = shards.open_shards(tmp_path, "bytes", 257, dtype="uint16")
    for index in (np.arange(50_000, 50_010)[None], [3, 50_001]):  # a window, and ids one by one
        with pytest.raises(ValueError, match=r"a\.bin holds token id 300 \(token 50001\), >= the model's vocab_size"):
            tokens[index]


def test_fingerprint_is_the_content_not_the_path(tmp_path, monkeypatch):
    """The same shards elsewhere, under other names: the same identity; another byte in a sampled
    block, another size, another order or dtype: another. Sampled, not read whole (a counted read)."""
    write_corpus(tmp_path / "a.txt")
    data.write_shards([tmp_path / "a.txt"], tmp_path / "one", "bytes", shard_tokens=4000)
    ident = data.fingerprint(tmp_path / "one")
    moved = tmp_path / "two"
    shutil.copytree(tmp_path / "one", moved)
    meta = json.loads((moved / shards.SHARDS_JSON).read_text())
    for f in meta["files"]:
        os.rename(moved / f["name"], moved / ("renamed_" + f["name"]))
        f["name"] = "renamed_" + f["name"]
    (moved / shards.SHARDS_JSON).write_text(json.dumps(meta))
    assert data.fingerprint(moved) == ident and data.fingerprint(f"{moved}/*.bin") == ident
    assert data.fingerprint(tmp_path / "a.txt") != ident  # the text file's identity is its own hash

    def changed(edit) -> str:
        shutil.rmtree(moved)
        shutil.copytree(tmp_path / "one", moved)
        edit(moved / "shard_000000.bin")
        return data.fingerprint(moved)

    def flip_last_byte(p):
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 1
        p.write_bytes(raw)

    def reverse_the_files(_):
        meta = json.loads((moved / shards.SHARDS_JSON).read_text())
        meta["files"].reverse()
        (moved / shards.SHARDS_JSON).write_text(json.dumps(meta))

    def drop_the_last_token(p):
        p.write_bytes(p.read_bytes()[:-2])
        meta = json.loads((moved / shards.SHARDS_JSON).read_text())
        meta["files"] = [f["name"] for f in meta["files"]]  # names alone: no token counts to check
        (moved / shards.SHARDS_JSON).write_text(json.dumps(meta))

    assert changed(flip_last_byte) != ident
    assert changed(drop_the_last_token) != ident
    assert changed(reverse_the_files) != ident
    shutil.rmtree(moved)
    shutil.copytree(tmp_path / "one", moved)
    (moved / shards.SHARDS_JSON).unlink()
    assert data.fingerprint(moved, "uint16") == ident  # bare files: the same bytes, the same ids
    np.zeros(8, np.uint16).tofile(tmp_path / "zeros.bin")
    assert data.fingerprint(tmp_path / "zeros.bin", "uint16") != data.fingerprint(tmp_path / "zeros.bin", "uint32")

    big = np.zeros(10 << 20, np.uint16)  # 20 MB: read ~128 KiB of it
    big.tofile(tmp_path / "big.bin")
    read = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: read.append(n) or real(fd, n, at))
    data.fingerprint(tmp_path / "big.bin", "uint16")
    assert sum(read) == shards._SAMPLE_BLOCKS * shards._BLOCK_BYTES == 128 << 10


def bad_inputs(tmp_path: pathlib.Path) -> list:
    """(--data, --data_dtype, --tokenizer, the message's expected text) for each bad token input."""
    write_corpus(tmp_path / "a.txt")
    good = tmp_path / "good"
    data.write_shards([tmp_path / "a.txt"], good, "bytes", shard_tokens=4000)

    def variant(name, edit):
        d = tmp_path / name
        shutil.copytree(good, d)
        edit(d)
        return d

    def edit_meta(**changes):
        def edit(d):
            meta = json.loads((d / shards.SHARDS_JSON).read_text())
            (d / shards.SHARDS_JSON).write_text(json.dumps({**meta, **changes}))
        return edit

    missing = variant("missing", lambda d: (d / "shard_000001.bin").unlink())
    odd = variant("odd", lambda d: (d / "shard_000000.bin").write_bytes(b"\x01\x00\x02"))
    short = variant("short", lambda d: (d / "shard_000000.bin").write_bytes(b"\x01\x00"))
    broken = variant("broken", lambda d: (d / shards.SHARDS_JSON).write_text("{"))
    bare = variant("bare", lambda d: (d / shards.SHARDS_JSON).unlink())
    np.full(10, 1000, np.uint16).tofile(bare / "zz_wide.bin")
    return [
        (missing, None, "bytes", f"{missing / shards.SHARDS_JSON} lists shard_000001.bin, which is missing"),
        (odd, None, "bytes", "shard_000000.bin has 3 bytes, not a whole number of uint16 ids (2 bytes each)"),
        (short, None, "bytes", "shard_000000.bin holds 1 uint16 ids, " + f"{short / shards.SHARDS_JSON} says 4000"),
        (good, None, "gpt2", f"--data={good}: its shards were tokenized with bytes (shards.json), this run uses "
                             "--tokenizer=gpt2; pass --tokenizer=bytes, or tokenize the corpus again with "
                             "--tokenizer=gpt2."),
        (good, "uint32", "bytes", "--data_dtype=uint32, but"),
        (variant("wide", edit_meta(dtype="uint32")), None, "bytes", "holds 2000 uint32 ids"),
        (variant("int8", edit_meta(dtype="int8")), None, "bytes", "dtype 'int8' in"),
        (broken, None, "bytes", "shards.json is not readable JSON"),
        (variant("nofiles", edit_meta(files=[])), None, "bytes", 'needs a "dtype", a "tokenizer" and a non-empty'),
        (bare, None, "bytes", "token files without shards.json (" + f"{bare / 'shard_000000.bin'}, ...): pass "
                              "--data_dtype=uint16"),
        (bare, "uint16", "bytes", "zz_wide.bin holds token id 1000 (token 0), >= vocab_size 257 of --tokenizer=bytes;"
                                  " pass the --tokenizer and --data_dtype"),
        (f"{tmp_path}/nothing/*.bin", None, "bytes", f"--data={tmp_path}/nothing/*.bin matches no file"),
        (f"{tmp_path}/*/shard_000000.bin", None, "bytes", "matches files in"),
        (f"{tmp_path}/*.txt", None, "bytes", "a.txt, not a token file (.bin); tokenize text first"),
        (f"{tmp_path}/none.bin", None, "bytes", f"--data={tmp_path}/none.bin: no such file"),
    ]


def test_bad_token_inputs_are_one_line_errors(tmp_path):
    for spec, dtype, name, message in bad_inputs(tmp_path):
        with pytest.raises(ValueError) as e:
            shards.open_shards(spec, name, tokenizer.get_encoding(name).n_vocab, dtype)
        assert message in str(e.value) and "\n" not in str(e.value), (spec, str(e.value))


def test_train_from_shards_is_the_text_runs_and_resumes_exactly(tmp_path, tmp_path_factory):
    """The tiny preset on a corpus and on its shards (windows across their boundaries):
    the same losses, eval losses and gradient norms, bit for bit (same split, same batches); the
    shard run stopped at step 6 and resumed matches too. Resuming it with the text file is refused
    (another corpus identity)."""
    corpus = write_corpus(tmp_path / "corpus.txt", TEXT * 3)
    shard_dir = tmp_path / "shards"
    data.write_shards([corpus], shard_dir, "bytes", shard_tokens=20_000)
    assert len(os.listdir(shard_dir)) > 4
    text_run, shard_run = tmp_path / "text", tmp_path / "sharded"
    run_train(tmp_path_factory, f"--workdir={text_run}", f"--data={corpus}", "--steps=12")
    run_train(tmp_path_factory, f"--workdir={shard_run}", f"--data={shard_dir}", "--steps=12", "--stop_after=6")
    with pytest.raises(ValueError, match=f"--resume with another corpus: .* pass --data={shard_dir}"):
        run_train(tmp_path_factory, f"--workdir={shard_run}", f"--data={corpus}", "--steps=12", "--resume")
    run_train(tmp_path_factory, f"--workdir={shard_run}", f"--data={shard_dir}", "--steps=12", "--resume")
    a, b = metrics(text_run), metrics(shard_run)
    assert [r["step"] for r in b] == [2, 4, 6, 8, 10, 12]
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "lr", "grad_norm", "eval_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
