"""Corpus reading, the cached token memmap, the split, and batch sampling."""

import gzip
import os
import types

import numpy as np
import pytest

from twinshard.train import data, tokenizer

TEXT = "First Citizen:\nBefore we proceed, hear me speak.\r\n\nAll:\n\n\n  Speak, speak.\n" * 40


def test_read_text_txt_and_gz_byte_exact(tmp_path):
    (tmp_path / "a.txt").write_bytes(TEXT.encode())
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(TEXT.encode()))
    assert data.read_text(tmp_path / "a.txt") == TEXT
    assert data.read_text(tmp_path / "a.txt.gz") == TEXT


def test_read_text_missing_file_names_path_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.txt.*--data=PATH"):
        data.read_text(tmp_path / "nope.txt")


@pytest.mark.parametrize("name", tokenizer.TOKENIZERS)
def test_chunked_encode_equals_whole_text(monkeypatch, name):
    monkeypatch.setattr(data, "_CHUNK_CHARS", 50)
    assert len(data._chunks(TEXT)) > 10
    assert "".join(data._chunks(TEXT)) == TEXT
    assert data.encode(TEXT, name) == tokenizer.get_encoding(name).encode_ordinary(TEXT)


# Characters at the edges of the safe-cut rule: spaces Python and the Rust regex disagree on
# (U+001C-U+001F: space to Python only), Unicode spaces (NEL, NBSP, U+2028, U+3000), \r, tabs,
# apostrophes and contraction letters, digits, punctuation, CJK and an emoji.
_EDGES = list(" \n\n\r\t\x1c\x1f\x85\xa0\u2028\u3000'sStvemld019.,!-你🙂é") + [" ", "\n", "a", "b"] * 4


@pytest.mark.parametrize("name", tokenizer.TOKENIZERS)
def test_safe_cuts_leave_every_encoding_unchanged(monkeypatch, name):
    """Random text of _EDGES, cut at (nearly) every safe cut: the chunks encode as the whole."""
    monkeypatch.setattr(data, "_CHUNK_CHARS", 1)
    rng = np.random.default_rng(0)
    for _ in range(20):
        text = "".join(rng.choice(_EDGES, 400))
        assert len(data._chunks(text)) > 20 and "".join(data._chunks(text)) == text
        assert data.encode(text, name) == tokenizer.get_encoding(name).encode_ordinary(text), text


def test_memmap_written_once_and_atomically(tmp_path, monkeypatch):
    corpus, cache = tmp_path / "play.txt", tmp_path / "cache"
    corpus.write_text(TEXT)
    tokens = data.tokenize_to_memmap(corpus, "gpt2", cache)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert tokens.tolist() == tokenizer.get_encoding("gpt2").encode_ordinary(TEXT)
    (cached,) = os.listdir(cache)  # exactly one file: no temp file left behind
    assert (
        cached.startswith("play.gpt2.")
        and cached.endswith(".u16")
        and len(cached.split(".")[2]) == 16
    )

    monkeypatch.setattr(data, "encode", lambda *a: pytest.fail("re-tokenized a cached corpus"))
    mtime = os.stat(cache / cached).st_mtime_ns
    again = data.tokenize_to_memmap(corpus, "gpt2", cache)
    assert np.array_equal(again, tokens) and os.stat(cache / cached).st_mtime_ns == mtime


def test_memmap_cache_keyed_by_content_and_tokenizer(tmp_path):
    corpus = tmp_path / "play.txt"
    corpus.write_text(TEXT)
    data.tokenize_to_memmap(corpus, "gpt2", tmp_path / "c")
    data.tokenize_to_memmap(corpus, "shakespeare4096", tmp_path / "c")
    corpus.write_text(TEXT + "Exeunt.")
    data.tokenize_to_memmap(corpus, "gpt2", tmp_path / "c")
    assert len(os.listdir(tmp_path / "c")) == 3


def test_memmap_failed_write_leaves_nothing(tmp_path, monkeypatch):
    corpus, cache = tmp_path / "play.txt", tmp_path / "cache"
    corpus.write_text(TEXT)

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        data.tokenize_to_memmap(corpus, "gpt2", cache)
    assert os.listdir(cache) == []


def test_memmap_errors(tmp_path, monkeypatch):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no tokens"):
        data.tokenize_to_memmap(tmp_path / "empty.txt", "gpt2", tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        data.tokenize_to_memmap(tmp_path / "missing.txt", "gpt2", tmp_path)
    big = types.SimpleNamespace(n_vocab=70_000, name="big")
    monkeypatch.setattr(tokenizer, "get_encoding", lambda name: big)
    with pytest.raises(ValueError, match="70000 > 65536"):
        data.tokenize_to_memmap(tmp_path / "empty.txt", "big", tmp_path)


def test_split_tokens_tail_is_validation():
    train, val = data.split_tokens(np.arange(100), val_fraction=0.1)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match="empty split"):
        data.split_tokens(np.arange(5), val_fraction=0.01)


def test_get_batch_shapes_and_shift():
    tokens = (
        np.random.default_rng(0).permutation(1000).astype(np.uint16)
    )  # distinct: a value locates its start
    x, y = data.get_batch(tokens, batch_size=6, context_length=16, seed=1, step=2)
    assert x.shape == y.shape == (6, 16) and x.dtype == y.dtype == np.int32
    for row_x, row_y in zip(x, y):
        start = int(np.flatnonzero(tokens == row_x[0])[0])
        assert np.array_equal(row_x, tokens[start : start + 16])
        assert np.array_equal(row_y, tokens[start + 1 : start + 17])


def test_get_batch_deterministic_in_seed_and_step():
    tokens = np.arange(10_000)
    batch = lambda seed, step: data.get_batch(tokens, 8, 32, seed=seed, step=step)[0]
    assert np.array_equal(batch(0, 5), batch(0, 5))
    assert not np.array_equal(batch(0, 5), batch(0, 6))
    assert not np.array_equal(batch(0, 5), batch(1, 5))
    # runs with different seeds never share batches shifted in time (seed + step would)
    assert not np.array_equal(batch(0, 6), batch(1, 5))


def test_get_batch_reaches_every_start_uniformly():
    tokens = np.arange(12)  # context 4: starts 0..7, the last window ends at token 11
    firsts = np.concatenate(
        [data.get_batch(tokens, 16, 4, seed=0, step=s)[0][:, 0] for s in range(500)]
    )
    assert set(firsts.tolist()) == set(range(8))
    counts = np.bincount(firsts, minlength=8)
    expected = len(firsts) / 8
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 30, counts  # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4


def test_get_batch_on_memmap(tmp_path):
    corpus = tmp_path / "play.txt"
    corpus.write_text(TEXT)
    tokens = data.tokenize_to_memmap(corpus, "shakespeare4096", tmp_path)
    x, _ = data.get_batch(tokens, 2, 8, seed=0, step=0)
    assert x.dtype == np.int32 and type(x) is np.ndarray and x.max() < 4096


def test_get_batch_corpus_too_short():
    with pytest.raises(
        ValueError, match=r"4 tokens.*context_length \+ 1 = 5.*smaller --context_length"
    ):
        data.get_batch(np.arange(4), 1, 4, seed=0, step=0)
