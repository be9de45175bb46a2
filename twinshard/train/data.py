"""Corpus -> uint16 token memmap (tokenized once, cached) -> random training windows."""

import functools
import gzip
import os
import pathlib
import re
import tempfile
import zlib

import numpy as np

from twinshard.train import tokenizer

DEFAULT_CORPUS = tokenizer.ASSETS / "shakespeare.txt.gz"
_CHUNK_CHARS = 1 << 20
# Cutting the text right after a non-space character, before a space or a newline, leaves every
# tokenizer's encoding unchanged: GPT2_PATTERN's pre-tokens tile the text (each match starts
# where the last ended) and are encoded one by one; the one holding the non-space character
# ends there (letter, digit and punctuation runs hold no whitespace, whitespace runs nothing
# else), so the next starts at the cut with or without the text before it, and the pattern
# has no lookbehind. Space and newline are whitespace to Python and to tiktoken's Rust regex
# alike, and Python's \S is a subset of Rust's (Python also counts U+001C-U+001F as space).
_SAFE_CUT = re.compile(r"(?<=\S)(?=[ \n])")


def read_text(path: str | os.PathLike, flag: str = "--data") -> str:
    """Reads a UTF-8 .txt or .txt.gz file byte-exactly (no newline translation).

    Errors name the command-line `flag` that gave the path."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus {str(path)!r} not found: pass {flag}=PATH to a UTF-8 .txt or .txt.gz, "
            "or omit it for the default corpus"
        )
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
            raise ValueError(
                f"corpus {str(path)!r} ends in .gz but is not a complete gzip file ({e}); "
                f"pass {flag}=PATH to a gzip-compressed UTF-8 text, or to a plain .txt"
            ) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"corpus {str(path)!r} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}"
            + (" after gunzip" if path.suffix == ".gz" else "")
            + f"); pass {flag}=PATH to a UTF-8 .txt or .txt.gz (convert with `iconv -t UTF-8`)"
        ) from None


def _chunks(text: str) -> list[str]:
    """Cuts text at safe cuts about every _CHUNK_CHARS, so chunks encode in parallel."""
    pieces, start = [], 0
    while start < len(text):
        cut = _SAFE_CUT.search(text, start + _CHUNK_CHARS)
        end = cut.start() if cut else len(text)
        pieces.append(text[start:end])
        start = end
    return pieces


def fingerprint(path: str | os.PathLike) -> str:
    """`tokenizer.file_digest` of the corpus: its identity (its cache name,
    and what a checkpoint records so that --resume refuses another corpus). Computed once per
    (path, size, mtime) in a process."""
    stat = os.stat(path)
    return _digest(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _digest(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # part of the cache key only
    return tokenizer.file_digest(path)


def encode(text: str, tokenizer_name: str) -> list[int]:
    """Encodes ordinary text (special-token strings are plain text) with tiktoken's threads."""
    enc = tokenizer.get_encoding(tokenizer_name)
    batches = enc.encode_ordinary_batch(_chunks(text), num_threads=os.cpu_count() or 1)
    return [t for batch in batches for t in batch]


def tokenize_to_memmap(
    text_path: str | os.PathLike, tokenizer_name: str, cache_dir: str | os.PathLike
) -> np.memmap:
    """Returns the corpus as a read-only uint16 memmap, tokenizing only on a cache miss.

    A `cache_dir` that is a file, or below one, is a ValueError before any tokenizing.

    The cache name `<stem>.<tokenizer>.<sha256(file)[:16]>.u16` changes with the
    file's bytes, and the file appears only complete (temp file + os.replace).
    """
    text_path, cache_dir = pathlib.Path(text_path), pathlib.Path(cache_dir)
    blocker = next((p for p in (cache_dir, *cache_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(
            f"cache directory {str(cache_dir)!r} cannot be made: {str(blocker)!r} is a file; "
            "pass --cache_dir=DIR to a directory (created if missing)"
        )
    enc = tokenizer.get_encoding(tokenizer_name)
    if enc.n_vocab > 65536:
        raise ValueError(
            f"tokenizer {tokenizer_name!r} has n_vocab {enc.n_vocab} > 65536: ids do not fit uint16"
        )
    text = read_text(text_path)
    digest = fingerprint(text_path)
    stem = text_path.name.removesuffix(".gz").removesuffix(".txt")
    out = cache_dir / f"{stem}.{enc.name}.{digest}.u16"
    if not out.is_file():
        tokens = np.asarray(encode(text, tokenizer_name), dtype=np.uint16)
        if tokens.size == 0:
            raise ValueError(
                f"corpus {str(text_path)!r} has no tokens: pass --data=PATH to a non-empty text file"
            )
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{out.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(tokens.tobytes())
            os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
            os.replace(tmp, out)
        except BaseException:
            os.unlink(tmp)
            raise
    return np.memmap(out, dtype=np.uint16, mode="r")


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Splits off the tail as validation, so the two never share a window's text."""
    n_val = round(len(tokens) * val_fraction)
    if not 0 < n_val < len(tokens):
        raise ValueError(
            f"val_fraction {val_fraction} of {len(tokens)} tokens leaves an empty split"
        )
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def get_batch(
    tokens: np.ndarray, batch_size: int, context_length: int, seed: int, step: int
) -> tuple[np.ndarray, np.ndarray]:
    """Samples int32 windows x: [B, T] and next-token targets y: [B, T].

    Starts are uniform over all len(tokens) - T valid offsets, drawn from a
    generator seeded by (seed, step) alone, so a resumed run sees the same data.
    """
    n_starts = len(tokens) - context_length
    if n_starts < 1:
        raise ValueError(
            f"corpus has {len(tokens)} tokens, fewer than context_length + 1 = {context_length + 1}: "
            "use a smaller --context_length or a larger corpus"
        )
    starts = np.random.default_rng([seed, step]).integers(0, n_starts, size=batch_size)
    windows = np.asarray(tokens[starts[:, None] + np.arange(context_length + 1)], dtype=np.int32)
    return windows[:, :-1], windows[:, 1:]
