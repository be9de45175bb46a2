"""Tokenize a corpus into token shards, streaming: `python -m launch.tokenize --input=corpus.txt.gz
--out=data/corpus --tokenizer=gpt2`, then `python -m launch.train --data=data/corpus --tokenizer=gpt2`.

For a corpus larger than memory: the text is read a few MiB at a time, cut only where
every tokenizer encodes the same as over the whole file (twinshard.train.data.TextStream),
and written as flat uint16 ids (uint32 for a vocab over 65536) in shards of --shard_tokens,
with shards.json last (its format: twinshard/train/shards.py). A glob in --input takes its
files in name order, each tokenized on its own. Prints progress every few seconds and a summary.
"""

from __future__ import annotations

import os
import time

from absl import flags

from launch import common

flags.DEFINE_string("input", None, "UTF-8 .txt or .txt.gz corpus, or a quoted glob of them (default: the embedded "
                    "Shakespeare).")
flags.DEFINE_string("out", None, "Directory for the shards and shards.json (created; must hold no shards yet).")
common.define(flags.DEFINE_string, "tokenizer", None, "A built-in tokenizer (bytes, gpt2, shakespeare4096) or a "
              "tiktoken ranks file; train with the same --tokenizer.")
flags.DEFINE_integer("shard_tokens", None, "Tokens per shard (default 100,000,000: 200 MB of uint16).")
FLAGS = flags.FLAGS

_PROGRESS_SECONDS = 5.0


def check_out(out: str | None) -> None:
    """--out is given, can be a directory here, and holds no shards (none would be overwritten)."""
    if not out:
        raise ValueError("--out is required: the directory to write the shards into, e.g. --out=data/corpus.")
    common.check_writable_dir(out, "out")
    from twinshard.train.shards import SHARDS_JSON

    if os.path.isdir(out) and (held := sorted(n for n in os.listdir(out) if n == SHARDS_JSON or n.endswith(".bin"))):
        raise ValueError(f"--out={out} already holds shards ({held[0]}, ...); pass a new or empty directory.")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def main(argv):
    del argv
    if FLAGS.tokenizer is None:
        raise ValueError("--tokenizer is required: bytes, gpt2, shakespeare4096 or a tiktoken ranks file; "
                         "train with the same one.")
    shard_tokens = FLAGS.shard_tokens
    if shard_tokens is not None and shard_tokens < 1:
        raise ValueError(f"--shard_tokens={shard_tokens} must be >= 1; drop it for 100,000,000.")
    check_out(FLAGS.out)
    common.tokenizer_vocab(FLAGS.tokenizer)  # a bad name or ranks file: its one-line error

    from twinshard.train import data, shards

    texts = data.find_texts(FLAGS.input or str(data.DEFAULT_CORPUS))
    last = [time.perf_counter()]

    def progress(stats: dict) -> None:
        if time.perf_counter() - last[0] >= _PROGRESS_SECONDS:
            last[0] = time.perf_counter()
            print(f"read {_mb(stats['bytes'])} | {stats['tokens']:,} tokens | {stats['shards']} shards done | "
                  f"{stats['bytes'] / 1e6 / stats['seconds']:.1f} MB/s", flush=True)

    stats = data.write_shards(texts, FLAGS.out, FLAGS.tokenizer, shard_tokens or data.DEFAULT_SHARD_TOKENS, progress)
    print(f"done: {stats['files']} file(s), {_mb(stats['bytes'])} in {stats['seconds']:.1f}s "
          f"({stats['bytes'] / 1e6 / stats['seconds']:.1f} MB/s): {stats['tokens']:,} tokens ({stats['dtype']}) in "
          f"{stats['shards']} shard(s) + {shards.SHARDS_JSON} in {FLAGS.out}; train with --data={FLAGS.out} "
          f"--tokenizer={FLAGS.tokenizer}")
    if stats["forced_cuts"]:
        print(f"{stats['forced_cuts']} forced cut(s): stretches of over {data._MAX_CARRY * data._READ_BYTES >> 20} "
              "MiB without a space or newline after a word were cut where they stood; a BPE token may differ "
              "from whole-file tokenization there (the byte tokenizer's never does).")


if __name__ == "__main__":
    common.run(main, "launch.tokenize")
