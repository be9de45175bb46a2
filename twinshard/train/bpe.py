"""Byte-level BPE training (CS336 assignment 1 semantics), exported as tiktoken ranks.

The vendored `assets/shakespeare_bpe4096.tiktoken` (4095 ranks + `<|endoftext|>`
= 4096 ids) was made from the repository root with

    uv run python -m twinshard.train.bpe --input twinshard/assets/shakespeare.txt.gz \
        --vocab_size 4096 --out twinshard/assets/shakespeare_bpe4096.tiktoken

which trained 3839 merges on the 5 MB corpus in 7.0-10.1 s on a 2-core machine
(five runs; ~1.8 s of it GPT-2 pre-tokenization) and wrote 4095 ranks. Training
is deterministic: reruns give the same file (sha256 b9a87256...5d25bf).

tiktoken encodes by repeatedly merging the adjacent pair whose concatenation has
the lowest rank. Ranks here follow merge order, so that equals applying the
merges in the order they were learned (tests/test_bpe.py checks it).
"""

import argparse
import collections
import heapq
import itertools
import os
import time

import regex

from twinshard.train import data, tokenizer

_PRETOKEN = regex.compile(tokenizer.GPT2_PATTERN)

Pair = tuple[int, int]


def _pretoken_counts(text: str, special_tokens: list[str]) -> collections.Counter[str]:
    """Counts GPT-2 pre-tokens; special tokens cut the text so no merge crosses them."""
    chunks = [text]
    if special_tokens:
        by_length = sorted(special_tokens, key=len, reverse=True)  # longest match wins
        chunks = regex.split("|".join(map(regex.escape, by_length)), text)
    counts = collections.Counter()
    for chunk in chunks:
        counts.update(_PRETOKEN.findall(chunk))
    return counts


def _merge_word(word: tuple[int, ...], pair: Pair, new: int) -> tuple[int, ...]:
    """Replaces each occurrence of `pair`, scanning left to right, by `new`."""
    out, i = [], 0
    while i < len(word):
        if word[i] == pair[0] and i + 1 < len(word) and word[i + 1] == pair[1]:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _pop_best(
    heap: list[tuple[int, Pair]], counts: dict[Pair, int], vocab: dict[int, bytes]
) -> Pair | None:
    """Pops the most frequent pair; ties go to the greatest (bytes, bytes) tuple.

    The heap holds (-count, pair) entries, some stale (the count has changed
    since the push); an entry is live only while it matches `counts`.
    """
    while heap:
        neg, pair = heapq.heappop(heap)
        if counts.get(pair) == -neg:
            break
    else:
        return None
    tied = {pair}
    while heap and heap[0][0] == neg:
        _, other = heapq.heappop(heap)
        if counts.get(other) == -neg:
            tied.add(other)
    best = max(tied, key=lambda p: (vocab[p[0]], vocab[p[1]]))
    for other in tied - {best}:
        heapq.heappush(heap, (neg, other))
    return best


def train_bpe(
    text: str, vocab_size: int, special_tokens: list[str]
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Learns byte-level BPE merges until 256 bytes + merges + specials = vocab_size.

    Ids: 0..255 are the bytes, merges follow in order, special tokens come last
    (tiktoken's layout). Training stops early if no pair is left to merge.
    Pair counts are updated only for pre-tokens that contain the merged pair
    (found through a pair -> pre-token index), so a merge costs what it touches
    rather than a recount of the corpus.
    """
    n_merges = vocab_size - 256 - len(special_tokens)
    if n_merges < 0:
        raise ValueError(
            f"vocab_size {vocab_size} < 256 bytes + {len(special_tokens)} special tokens"
        )
    vocab = {i: bytes([i]) for i in range(256)}
    pretokens = _pretoken_counts(text, special_tokens)
    words = [tuple(w.encode("utf-8")) for w in pretokens]
    freqs = list(pretokens.values())
    counts: dict[Pair, int] = collections.defaultdict(int)
    where: dict[Pair, set[int]] = collections.defaultdict(set)
    for i, word in enumerate(words):
        for pair in itertools.pairwise(word):
            counts[pair] += freqs[i]
            where[pair].add(i)
    heap = [(-c, p) for p, c in counts.items()]
    heapq.heapify(heap)

    merges = []
    while len(merges) < n_merges and (pair := _pop_best(heap, counts, vocab)) is not None:
        new = len(vocab)
        vocab[new] = vocab[pair[0]] + vocab[pair[1]]
        merges.append((vocab[pair[0]], vocab[pair[1]]))
        touched = set()
        for i in where.pop(pair):
            old, word = words[i], _merge_word(words[i], pair, new)
            for p in itertools.pairwise(old):
                counts[p] -= freqs[i]
                touched.add(p)
            for p in itertools.pairwise(word):
                counts[p] += freqs[i]
                where[p].add(i)
                touched.add(p)
            words[i] = word
        for p in touched:
            if counts[p] > 0:
                heapq.heappush(heap, (-counts[p], p))
            else:
                del counts[p]
                where.pop(p, None)
    for special in special_tokens:
        vocab[len(vocab)] = special.encode("utf-8")
    return vocab, merges


def ranks_from_merges(merges: list[tuple[bytes, bytes]]) -> dict[bytes, int]:
    """tiktoken mergeable ranks: bytes 0..255 in byte order, then merges in order."""
    ranks = {bytes([i]): i for i in range(256)}
    for a, b in merges:
        if a + b in ranks:  # tiktoken keys ranks by bytes, so a repeat would be lost
            raise ValueError(
                f"merge {(a, b)} makes {a + b!r} again; tiktoken ranks need distinct tokens"
            )
        ranks[a + b] = len(ranks)
    return ranks


def main(argv: list[str] | None = None) -> None:
    """CLI (argparse, not absl: absl flags are global and would clash with launchers')."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input", default=str(data.DEFAULT_CORPUS), help="UTF-8 .txt or .txt.gz corpus"
    )
    parser.add_argument(
        "--vocab_size", type=int, required=True, help=f"total ids, counting {tokenizer.ENDOFTEXT}"
    )
    parser.add_argument("--out", required=True, help="tiktoken ranks file to write")
    parser.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        raise ValueError(f"--vocab_size={args.vocab_size} must be >= 257 (256 bytes + {tokenizer.ENDOFTEXT}).")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(out_dir):
        raise ValueError(f"--out={args.out}: " + ("is a directory" if os.path.isdir(args.out) else
                         f"directory {out_dir} does not exist") + "; pass a file path in an existing directory.")
    text = data.read_text(args.input, "--input")
    start = time.perf_counter()
    _, merges = train_bpe(text, args.vocab_size, [tokenizer.ENDOFTEXT])
    seconds = time.perf_counter() - start
    ranks = ranks_from_merges(merges)
    tokenizer.save_ranks(ranks, args.out)
    print(
        f"trained {len(merges)} merges on {len(text):,} chars in {seconds:.1f}s; wrote {len(ranks)} ranks to {args.out}"
    )


if __name__ == "__main__":
    import sys

    from twinshard.errors import guarded

    guarded(main, debug="--debug" in sys.argv[1:], name="twinshard.train.bpe")
