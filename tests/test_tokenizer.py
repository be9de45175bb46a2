"""Offline tiktoken encodings: known GPT-2 ids, round trips, the pattern, errors."""

import hashlib
import os

import pytest
import regex
import tiktoken
from tiktoken_ext import openai_public

from twinshard.train import tokenizer

UNICODE_TEXT = (
    "Héllo wörld! 你好，世界 🙂  naïve café\n\n\tTo be, or not to be: 1234 they're   \r\n"
)


def test_known_names():
    assert tokenizer.TOKENIZERS == ("bytes", "gpt2", "shakespeare4096")


def test_gpt2_ids_match_openai():
    enc = tokenizer.get_encoding("gpt2")
    assert enc.n_vocab == 50257
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [50256]


def test_gpt2_ranks_are_the_vendored_r50k_file():
    digest = hashlib.sha256((tokenizer.ASSETS / "gpt2.tiktoken").read_bytes()).hexdigest()
    assert digest == "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


@pytest.mark.parametrize("name", tokenizer.TOKENIZERS)
def test_round_trip_unicode(name):
    enc = tokenizer.get_encoding(name)
    ids = enc.encode_ordinary(UNICODE_TEXT)
    assert enc.decode(ids) == UNICODE_TEXT
    assert max(ids) < enc.n_vocab


def test_shakespeare4096_vocab():
    enc = tokenizer.get_encoding("shakespeare4096")
    assert enc.n_vocab == 4096
    assert enc.encode("<|endoftext|>", allowed_special="all") == [4095]
    # Trained on Shakespeare, so common words are single tokens.
    assert len(enc.encode_ordinary(" the king")) == 2


def test_pattern_matches_tiktoken_r50k():
    """Training splits text with `regex`; tiktoken splits with Rust: they must agree."""
    ranks = tokenizer.load_ranks(tokenizer.ASSETS / "gpt2.tiktoken")
    ours = tokenizer.get_encoding("gpt2")
    theirs = tiktoken.Encoding(
        name="r50k", pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks, special_tokens={}
    )
    text = UNICODE_TEXT * 3 + " a  b   \n\n\n c'll 's 'S x\u00a0y \u2003z "
    pieces = regex.findall(tokenizer.GPT2_PATTERN, text)
    assert "".join(pieces) == text
    assert ours.encode_ordinary(text) == theirs.encode_ordinary(text)
    assert ours.encode_ordinary(text) == [t for p in pieces for t in ours.encode_ordinary(p)]


def test_ranks_file_round_trip_and_path_encoding(tmp_path):
    ranks = {bytes([i]): i for i in range(256)} | {b"ab": 256, b"abc": 257}
    path = tmp_path / "tiny.tiktoken"
    tokenizer.save_ranks(ranks, path)
    assert os.listdir(tmp_path) == ["tiny.tiktoken"]  # no temp file left behind
    assert tokenizer.load_ranks(path) == ranks
    enc = tokenizer.get_encoding(str(path))
    assert enc.n_vocab == 259
    assert enc.encode("abc<|endoftext|>", allowed_special="all") == [257, 258]


@pytest.mark.parametrize("name", ["gpt3", "/no/such/ranks.tiktoken"])
def test_unknown_name_lists_valid_ones(name):
    with pytest.raises(ValueError, match=regex.escape(repr(name)) + ".*gpt2, shakespeare4096"):
        tokenizer.get_encoding(name)


def test_bytes_tokenizer_is_raw_utf8():
    enc = tokenizer.get_encoding("bytes")
    text = "Hé, world! ☃"
    assert enc.encode_ordinary(text) == list(text.encode("utf-8"))
    assert enc.n_vocab == 257 and enc.encode("<|endoftext|>", allowed_special="all") == [256]
    assert enc.decode(enc.encode_ordinary(text)) == text
