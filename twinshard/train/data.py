"""Corpus -> token ids -> random training windows.

Two sources of ids: a UTF-8 text corpus, tokenized whole once and cached as a uint16 memmap
(`tokenize_to_memmap`), or token shards written by `python -m launch.tokenize`, streamed
through the tokenizer (`write_shards`) and read as memmaps (`shards.open_shards`,
twinshard/train/shards.py: the format and its reader), for a corpus larger than memory. Both
give an array-like that `split_tokens` and `get_batch` take.
"""

import contextlib
import functools
import glob
import gzip
import json
import os
import pathlib
import re
import tempfile
import time
import zlib
from typing import Callable, Iterator

import numpy as np

from twinshard.train import shards, tokenizer

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
_LAST_SAFE_CUT = re.compile(r"(?s:.*)" + _SAFE_CUT.pattern)  # greedy: its end is the last cut


def read_text(path: str | os.PathLike, flag: str = "--data") -> str:
    """Reads a UTF-8 .txt or .txt.gz file byte-exactly (no newline translation).

    Errors name the command-line `flag` that gave the path."""
    path = _existing(path, flag)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
            raise _not_gzip(path, e, flag) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, raw[e.start], e.start, flag) from None


def _existing(path: str | os.PathLike, flag: str) -> pathlib.Path:
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus {str(path)!r} not found: pass {flag}=PATH to a UTF-8 .txt or .txt.gz, "
            "or omit it for the default corpus"
        )
    return path


def _not_gzip(path: pathlib.Path, e: Exception, flag: str) -> ValueError:
    return ValueError(
        f"corpus {str(path)!r} ends in .gz but is not a complete gzip file ({e}); "
        f"pass {flag}=PATH to a gzip-compressed UTF-8 text, or to a plain .txt"
    )


def _not_utf8(path: pathlib.Path, byte: int, offset: int, flag: str) -> ValueError:
    return ValueError(
        f"corpus {str(path)!r} is not UTF-8 text (byte 0x{byte:02x} at offset {offset}"
        + (" after gunzip" if path.suffix == ".gz" else "")
        + f"); pass {flag}=PATH to a UTF-8 .txt or .txt.gz (convert with `iconv -t UTF-8`)"
    )


_READ_BYTES = 4 << 20  # what TextStream reads at a time (tests make it smaller)
_MAX_CARRY = 16  # x _READ_BYTES of text without a safe cut: then cut anyway (a forced cut)


class TextStream:
    """The text of a UTF-8 .txt or .txt.gz in pieces of about _READ_BYTES, each ending at a
    safe cut (_SAFE_CUT), so encoding the pieces one by one gives the whole file's tokens with
    every tokenizer, while at most a few pieces are in memory.

    A stretch of over _MAX_CARRY x _READ_BYTES characters without a safe cut (no space or
    newline after a non-space character) is cut where it stands: `forced_cuts` counts
    those (a BPE token may straddle one; the byte tokenizer's ids are the UTF-8 bytes, exact at
    any cut). `bytes_read`: the text's UTF-8 bytes so far (after gunzip). Errors are
    read_text's, with the byte offset in the whole file."""

    def __init__(self, path: str | os.PathLike, flag: str = "--input"):
        self.path, self.flag = _existing(path, flag), flag
        self.bytes_read = self.forced_cuts = 0

    def __iter__(self) -> Iterator[str]:
        opener = gzip.open if self.path.suffix == ".gz" else open
        carry = ""
        with opener(self.path, "rb") as f:
            for text in self._decoded(f):
                # the carry holds no cut (it follows the last one) but at its end, which needed
                # the text after it: the search starts there, linear in a long uncut stretch
                cut = _LAST_SAFE_CUT.match(text := carry + text, max(len(carry) - 1, 0))
                end = cut.end() if cut else 0
                if not end and len(text) > _MAX_CARRY * _READ_BYTES:
                    end = len(text)
                    self.forced_cuts += 1
                if end:
                    yield text[:end]
                carry = text[end:]
        if carry:
            yield carry

    def _decoded(self, f) -> Iterator[str]:
        """UTF-8 text of each read; a character split between reads waits for the next."""
        partial = b""
        while True:
            try:
                raw = f.read(_READ_BYTES)
            except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
                if self.path.suffix != ".gz":
                    raise
                raise _not_gzip(self.path, e, self.flag) from None
            data = partial + raw
            try:
                text, partial = data.decode("utf-8"), b""
            except UnicodeDecodeError as e:
                cut_short = raw and e.reason == "unexpected end of data"  # a character to complete
                if not cut_short:
                    offset = self.bytes_read + e.start
                    raise _not_utf8(self.path, data[e.start], offset, self.flag) from None
                text, partial = data[: e.start].decode("utf-8"), data[e.start :]
            self.bytes_read += len(data) - len(partial)
            if not raw:
                return
            yield text


def _chunks(text: str) -> list[str]:
    """Cuts text at safe cuts about every _CHUNK_CHARS, so chunks encode in parallel."""
    pieces, start = [], 0
    while start < len(text):
        cut = _SAFE_CUT.search(text, start + _CHUNK_CHARS)
        end = cut.start() if cut else len(text)
        pieces.append(text[start:end])
        start = end
    return pieces


def fingerprint(path: str | os.PathLike, dtype: str | None = None) -> str:
    """The corpus's identity (what a checkpoint records, so that --resume refuses another
    corpus): `tokenizer.file_digest` of a text file, also its cache name; for token files
    (`shards.is_token_files`), `shards.TokenFiles.fingerprint`. Computed once per (path, size, mtime) in a
    process."""
    if shards.is_token_files(path):
        return shards.find_token_files(path, dtype).fingerprint()
    stat = os.stat(path)
    return _digest(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _digest(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # part of the cache key only
    return tokenizer.file_digest(path)


def _encoded(text: str, tokenizer_name: str) -> list[list[int]]:
    """The ids of each of text's _chunks, encoded in parallel with tiktoken's threads."""
    enc = tokenizer.get_encoding(tokenizer_name)
    return enc.encode_ordinary_batch(_chunks(text), num_threads=os.cpu_count() or 1)


def encode(text: str, tokenizer_name: str) -> list[int]:
    """Encodes ordinary text (special-token strings are plain text) with tiktoken's threads."""
    return [t for batch in _encoded(text, tokenizer_name) for t in batch]


def _write_atomically(path: pathlib.Path, write: Callable) -> None:
    """write(file) into a temporary file beside `path`, then renamed to it: readers see the
    whole file or none; a failure leaves nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


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
        _write_atomically(out, lambda f: f.write(tokens.tobytes()))
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


# --- Writing token shards (twinshard/train/shards.py: their format, and reading them) --------

DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard


class _ShardWriter:
    """Appends ids to shard_000000.bin, shard_000001.bin, ... of `limit` tokens each; a shard
    is written as a hidden temporary file and renamed when complete."""

    def __init__(self, out_dir: pathlib.Path, dtype: str, limit: int):
        self.out_dir, self.dtype, self.limit = out_dir, shards.little_endian(dtype), limit
        self.files: list[dict] = []  # {"name", "tokens"} of the complete shards
        self._file, self._tokens = None, 0

    def _path(self, tmp: bool = False) -> pathlib.Path:
        name = f"shard_{len(self.files):06d}.bin"
        return self.out_dir / (f".{name}.tmp" if tmp else name)

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None:
                self._file, self._tokens = open(self._path(tmp=True), "wb"), 0
            take = min(self.limit - self._tokens, ids.size)
            self._file.write(ids[:take])
            self._tokens, ids = self._tokens + take, ids[take:]
            if self._tokens == self.limit:
                self._finish()

    def _finish(self) -> None:
        self._file.close()
        self._file = None
        os.replace(self._path(tmp=True), self._path())
        self.files.append({"name": self._path().name, "tokens": self._tokens})

    def close(self) -> list[dict]:
        if self._file is not None:
            self._finish()
        return self.files

    def discard(self) -> None:
        """Removes what this writer wrote: after a failure, no half-written corpus is left."""
        if self._file is not None:
            self._file.close()
            self._path(tmp=True).unlink(missing_ok=True)
        for f in self.files:
            (self.out_dir / f["name"]).unlink(missing_ok=True)


def find_texts(spec: str, flag: str = "--input") -> list[pathlib.Path]:
    """The text files a path or a glob names, sorted; none is a ValueError naming the fix."""
    if os.path.isfile(spec) or not shards.is_glob(spec):
        return [_existing(spec, flag)]
    paths = sorted(pathlib.Path(p) for p in glob.glob(spec) if os.path.isfile(p))
    if not paths:
        raise ValueError(f"{flag}={spec} matches no file; pass a UTF-8 .txt or .txt.gz, or a glob that "
                         "matches some (quoted, so the shell leaves it alone).")
    return paths


def write_shards(
    texts: list[pathlib.Path],
    out_dir: str | os.PathLike,
    tokenizer_name: str,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: Callable[[dict], None] | None = None,
    flag: str = "--input",
) -> dict:
    """Tokenizes `texts` (one after another, each on its own, as read_text + encode would, with
    nothing between them) into token shards + shards.json in `out_dir`, streaming: memory holds
    a few TextStream pieces, whatever the corpus's size. progress(stats) runs after each piece;
    the stats are returned at the end (bytes read, tokens, shards, seconds, forced cuts).
    A failure leaves no shard and no shards.json of this call behind."""
    out_dir = pathlib.Path(out_dir)
    enc = tokenizer.get_encoding(tokenizer_name)
    dtype = shards.token_dtype(enc.n_vocab)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out_dir, dtype, shard_tokens)
    stats = {"files": len(texts), "bytes": 0, "tokens": 0, "shards": 0, "forced_cuts": 0, "seconds": 0.0}
    start, bytes_done, forced_done = time.perf_counter(), 0, 0
    try:
        for path in texts:
            stream = TextStream(path, flag)
            for piece in stream:
                for ids in _encoded(piece, tokenizer_name):
                    writer.write(np.array(ids, dtype=writer.dtype))
                    stats["tokens"] += len(ids)
                stats.update(bytes=bytes_done + stream.bytes_read, forced_cuts=forced_done + stream.forced_cuts,
                             shards=len(writer.files), seconds=time.perf_counter() - start)
                if progress:
                    progress(stats)
            bytes_done, forced_done = bytes_done + stream.bytes_read, forced_done + stream.forced_cuts
        files = writer.close()
        if not stats["tokens"]:
            raise ValueError(f"{flag}: {', '.join(map(str, texts))} holds no text; pass {flag}=PATH to a "
                             "non-empty corpus.")
        meta = {"dtype": dtype, "tokenizer": tokenizer.fingerprint(tokenizer_name), "tokenizer_name": tokenizer_name,
                "vocab_size": enc.n_vocab, "tokens": stats["tokens"], "files": files,
                "sources": [str(p) for p in texts]}
        _write_atomically(out_dir / shards.SHARDS_JSON, lambda f: f.write((json.dumps(meta, indent=1) + "\n").encode()))
    except BaseException:
        writer.discard()
        if created:
            with contextlib.suppress(OSError):  # not empty after all: leave it
                out_dir.rmdir()
        raise
    return {**stats, "bytes": bytes_done, "shards": len(files), "seconds": time.perf_counter() - start,
            "dtype": dtype}
