"""BPE trainer: hand-worked merges, tie-break, specials, and tiktoken equivalence."""

import collections
import itertools
import random

import pytest
import regex
import tiktoken

from twinshard.train import bpe, data, tokenizer

EOT = "<|endoftext|>"


def naive_train(text: str, n_merges: int) -> list[tuple[bytes, bytes]]:
    """Reference trainer: recounts every pair before every merge."""
    words = collections.Counter(
        tuple(bytes([b]) for b in w.encode()) for w in regex.findall(tokenizer.GPT2_PATTERN, text)
    )
    merges = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        words = {_merge(word, best): count for word, count in words.items()}
    return merges


def _merge(word: tuple[bytes, ...], pair: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def encode_with_merges(text: str, merges: list[tuple[bytes, bytes]]) -> list[int]:
    """Reference encoder: applies each merge once, strictly in learned order."""
    order = {m: i for i, m in enumerate(merges)}
    ranks = bpe.ranks_from_merges(merges)
    ids = []
    for piece in regex.findall(tokenizer.GPT2_PATTERN, text):
        word, next_merge = tuple(bytes([b]) for b in piece.encode()), 0
        while found := [
            order[p] for p in itertools.pairwise(word) if order.get(p, -1) >= next_merge
        ]:
            next_merge = min(found)
            word = _merge(word, merges[next_merge])
            next_merge += 1
        ids += [ranks[t] for t in word]
    return ids


def random_text(rng: random.Random, n_words: int) -> str:
    alphabet = "aabbbcde é中'.!1 "
    return "".join(rng.choice(alphabet) for _ in range(n_words * 4)) + rng.choice(
        ["", "\n\n", "  \n "]
    )


def test_hand_worked_merges():
    # Pre-tokens: "low" 1, " low" 4, " lower" 2, " widest" 3, " newest" 6. Counts:
    # st=es=9 (tie -> (s,t) > (e,s)); e+st=9; lo=ow=7 (tie -> ow); l+ow=7; then
    # " l"... = " n" = ne = ew = w+est = 6, greatest first byte wins: w+est;
    # then (n,e) > (e,west) > (' ',n) > (' ',low); ne+west; " "+newest > " "+low.
    text = "low low low low low lower lower widest widest widest newest newest newest newest newest newest"
    vocab, merges = bpe.train_bpe(text, 256 + 9 + 1, [EOT])
    assert merges == [
        (b"s", b"t"), (b"e", b"st"), (b"o", b"w"), (b"l", b"ow"), (b"w", b"est"),
        (b"n", b"e"), (b"ne", b"west"), (b" ", b"newest"), (b" ", b"low"),
    ]  # fmt: skip
    assert vocab[256 + 8] == b" low" and vocab[265] == EOT.encode()
    assert len(vocab) == 266


def test_tie_break_compares_byte_tuples():
    # Every pair occurs once: (c,d) > (a,b) > (' ',c); then (a,b) > (' ',cd).
    _, merges = bpe.train_bpe("ab cd", 256 + 3, [])
    assert merges == [(b"c", b"d"), (b"a", b"b"), (b" ", b"cd")]


def test_stops_when_nothing_is_left_to_merge():
    vocab, merges = bpe.train_bpe("ab ab ab abc", 1000, [EOT])
    assert merges == [(b"a", b"b"), (b" ", b"ab"), (b" ab", b"c")]
    assert len(vocab) == 256 + 3 + 1


def test_special_tokens_split_text_and_are_never_merged():
    # Without the split, "<|", "endoftext" and "|>" would be pre-tokens to merge.
    vocab, merges = bpe.train_bpe(f"x{EOT}y{EOT}" * 50, 300, [EOT])
    assert merges == []
    assert vocab == {i: bytes([i]) for i in range(256)} | {256: EOT.encode()}


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="256 bytes"):
        bpe.train_bpe("abc", 256, [EOT])


@pytest.mark.parametrize("seed", range(5))
def test_incremental_counts_match_naive_recount(seed):
    text = random_text(random.Random(seed), 300)
    _, merges = bpe.train_bpe(text, 256 + 80, [])
    assert merges == naive_train(text, 80)


def test_ranks_from_merges_layout():
    ranks = bpe.ranks_from_merges([(b"a", b"b"), (b"ab", b"c")])
    assert list(ranks.items())[:3] == [(b"\x00", 0), (b"\x01", 1), (b"\x02", 2)]
    assert ranks[b"ab"] == 256 and ranks[b"abc"] == 257 and len(ranks) == 258
    with pytest.raises(ValueError, match="abc"):
        bpe.ranks_from_merges([(b"a", b"b"), (b"ab", b"c"), (b"a", b"bc")])


def _tiktoken_from(merges: list[tuple[bytes, bytes]]) -> tiktoken.Encoding:
    ranks = bpe.ranks_from_merges(merges)
    return tiktoken.Encoding(
        name="t", pat_str=tokenizer.GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )


@pytest.mark.parametrize("seed", range(3))
def test_tiktoken_equals_merges_in_order_random(seed):
    rng = random.Random(seed)
    _, merges = bpe.train_bpe(random_text(rng, 2000), 256 + 200, [])
    enc = _tiktoken_from(merges)
    for _ in range(50):
        text = random_text(rng, 40)
        assert enc.encode_ordinary(text) == encode_with_merges(text, merges)


def test_tiktoken_equals_merges_in_order_shakespeare():
    corpus = data.read_text(data.DEFAULT_CORPUS)
    _, merges = bpe.train_bpe(corpus[:200_000], 1024, [EOT])
    enc = _tiktoken_from(merges)
    held_out = corpus[-20_000:]
    assert enc.encode_ordinary(held_out) == encode_with_merges(held_out, merges)


def test_cli_writes_ranks(tmp_path, capsys):
    corpus, out = tmp_path / "c.txt", tmp_path / "r.tiktoken"
    corpus.write_text("low lower lowest " * 20)
    bpe.main(["--input", str(corpus), "--vocab_size", "262", "--out", str(out)])
    assert "trained 5 merges" in capsys.readouterr().out
    enc = tokenizer.get_encoding(str(out))
    assert enc.n_vocab == 262
    assert enc.decode(enc.encode_ordinary("lowest")) == "lowest"
