"""Corpus -> token ids -> random training windows.

Two sources of ids: a UTF-8 text corpus, tokenized whole once and cached as a uint16 memmap
(`tokenize_to_memmap`), or token shards written by `python -m launch.tokenize`, streamed
through the tokenizer (`write_shards`) and read as memmaps (`open_shards`), for a corpus
larger than memory. Both give an array-like that `split_tokens` and `get_batch` take.
"""

import contextlib
import copy
import dataclasses
import functools
import glob
import gzip
import hashlib
import json
import os
import pathlib
import re
import tempfile
import time
import zlib
from typing import Callable, Iterator

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
    (`is_token_files`), `TokenFiles.fingerprint`. Computed once per (path, size, mtime) in a
    process."""
    if is_token_files(path):
        return find_token_files(path, dtype).fingerprint()
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


# --- Token shards: a corpus larger than memory ---------------------------------------------
#
# A directory of flat token-id files (`.bin`: little-endian uint16, nanoGPT's format, or
# uint32) and `shards.json`: {"dtype": "uint16", "tokenizer": tokenizer.fingerprint(name),
# "vocab_size": N, "files": [{"name": "shard_000000.bin", "tokens": N}, ...]} (a name alone
# also does), as `python -m launch.tokenize` writes it. The tokens are the files' in that order,
# read as one sequence (ShardedTokens); split_tokens takes its last 5% as validation, the
# rule of a single file, so a corpus cut into shards trains exactly as the whole file would.

SHARDS_JSON = "shards.json"
TOKEN_DTYPES = ("uint16", "uint32")
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard
_SAMPLE_BLOCKS, _BLOCK_BYTES = 32, 4096  # what fingerprint and the id check read of each shard


def token_dtype(n_vocab: int) -> str:
    """The smaller of TOKEN_DTYPES that holds ids 0..n_vocab-1."""
    return "uint16" if n_vocab <= 1 << 16 else "uint32"


def _little_endian(dtype: str) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


class _ShardWriter:
    """Appends ids to shard_000000.bin, shard_000001.bin, ... of `limit` tokens each; a shard
    is written as a hidden temporary file and renamed when complete."""

    def __init__(self, out_dir: pathlib.Path, dtype: str, limit: int):
        self.out_dir, self.dtype, self.limit = out_dir, _little_endian(dtype), limit
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
    if os.path.isfile(spec) or not _is_glob(spec):
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
    dtype = token_dtype(enc.n_vocab)
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
        _write_atomically(out_dir / SHARDS_JSON, lambda f: f.write((json.dumps(meta, indent=1) + "\n").encode()))
    except BaseException:
        writer.discard()
        if created:
            with contextlib.suppress(OSError):  # not empty after all: leave it
                out_dir.rmdir()
        raise
    return {**stats, "bytes": bytes_done, "shards": len(files), "seconds": time.perf_counter() - start,
            "dtype": dtype}


def _is_glob(spec: str | os.PathLike) -> bool:
    return any(c in str(spec) for c in "*?[")


def is_token_files(spec: str | os.PathLike) -> bool:
    """Whether --data names token files (a directory, a glob, a .bin file), not a text corpus."""
    spec = str(spec)
    return os.path.isdir(spec) or spec.endswith(".bin") or (_is_glob(spec) and not os.path.isfile(spec))


_MAKE_SHARDS = "`python -m launch.tokenize --input=CORPUS --out=DIR --tokenizer=NAME`, then pass --data=DIR"


@dataclasses.dataclass
class TokenFiles:
    """The token files a --data value names, in order, each there and holding whole ids.

    meta: their shards.json (None for bare files, whose dtype came from --data_dtype)."""

    spec: str
    paths: list[pathlib.Path]
    sizes: list[int]
    dtype: str
    meta: dict | None
    flag: str = "--data"

    def fingerprint(self) -> str:
        """sha256 (16 hex digits) of the dtype, every file's size, in order, and _SAMPLE_BLOCKS
        blocks of _BLOCK_BYTES spread over each (all of a file up to 128 KiB): a content check,
        blind to names and paths, that reads ~128 KiB per shard rather than every byte (a full
        hash of 20 GB: 14 s of sha256 at 1.45 GB/s, measured, plus the reads, at each start).
        Another corpus, another tokenizer's ids or a shard cut short or replaced changes it; a
        same-size edit between the sampled blocks does not."""
        stats = [os.stat(p) for p in self.paths]
        files = tuple((str(p.resolve()), st.st_size, st.st_mtime_ns) for p, st in zip(self.paths, stats))
        return _sampled_digest(files, self.dtype)

    def check(self, tokenizer_name: str, vocab_size: int) -> None:
        """The run's tokenizer is the one shards.json names, and the sampled ids (fingerprint's
        blocks) are below vocab_size: ValueErrors naming the value and the fix."""
        where = f"{self.flag}={self.spec}"
        ours = tokenizer.fingerprint(tokenizer_name)
        if self.meta is not None and self.meta["tokenizer"] != ours:
            theirs = self.meta.get("tokenizer_name", self.meta["tokenizer"])
            named = lambda name, ident: name if name == ident else f"{name} ({ident})"  # noqa: E731
            raise ValueError(
                f"{where}: its shards were tokenized with {named(theirs, self.meta['tokenizer'])} ({SHARDS_JSON}), "
                f"this run uses --tokenizer={named(tokenizer_name, ours)}; pass --tokenizer={theirs}, or "
                f"tokenize the corpus again with --tokenizer={tokenizer_name}.")
        itemsize = np.dtype(self.dtype).itemsize
        for path, size in zip(self.paths, self.sizes):
            for offset, block in _samples(str(path), size):
                ids = np.frombuffer(block, _little_endian(self.dtype))
                if ids.size and ids.max() >= vocab_size:
                    at = int(np.argmax(ids >= vocab_size))
                    fix = ("the file is damaged or not this directory's: tokenize the corpus again" if self.meta
                           else "pass the --tokenizer and --data_dtype the files were written with")
                    raise ValueError(f"{where}: {path} holds token id {ids[at]} (token {offset // itemsize + at}), "
                                     f">= vocab_size {vocab_size} of --tokenizer={tokenizer_name}; {fix}.")


@functools.cache
def _sampled_digest(files: tuple[tuple[str, int, int], ...], dtype: str) -> str:
    """TokenFiles.fingerprint of (path, size, mtime) per file: computed once per process."""
    digest = hashlib.sha256(json.dumps({"dtype": dtype, "sizes": [size for _, size, _ in files]}).encode())
    for path, size, _ in files:
        for _, block in _samples(path, size):
            digest.update(block)
    return digest.hexdigest()[:16]


def _samples(path: str, size: int) -> list[tuple[int, bytes]]:
    """(offset, bytes) of all of a file up to _SAMPLE_BLOCKS x _BLOCK_BYTES, else of that many
    blocks spread from its start to its end; offsets and lengths hold whole uint16 or uint32 ids
    (multiples of 4, or of the dtype's size that the file's size is checked to be)."""
    if size <= _SAMPLE_BLOCKS * _BLOCK_BYTES:
        offsets, length = [0], size
    else:
        offsets = [i * (size - _BLOCK_BYTES) // (_SAMPLE_BLOCKS - 1) // 4 * 4 for i in range(_SAMPLE_BLOCKS)]
        offsets[-1], length = size - _BLOCK_BYTES, _BLOCK_BYTES
    fd = os.open(path, os.O_RDONLY)
    try:
        return [(offset, os.pread(fd, length, offset)) for offset in offsets]
    finally:
        os.close(fd)


def _read_meta(path: pathlib.Path, where: str) -> dict:
    """shards.json, checked: dtype, tokenizer, files (names, or {"name", "tokens"})."""
    form = ('{"dtype": "uint16", "tokenizer": "gpt2", "files": ["a.bin", ...]}, as launch.tokenize writes it; '
            "or remove it and pass --data_dtype")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: {path} is not readable JSON ({e}); write it as {form}.") from None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not (isinstance(files, list) and files and isinstance(meta.get("dtype"), str)
            and isinstance(meta.get("tokenizer"), str)):
        raise ValueError(f"{where}: {path} needs a \"dtype\", a \"tokenizer\" and a non-empty \"files\" list; "
                         f"write it as {form}.")
    entries = []
    for f in files:
        entry = {"name": f} if isinstance(f, str) else f
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("tokens", 0), int)):
            raise ValueError(f"{where}: {path} lists {f!r}, not a file name or {{\"name\": ..., \"tokens\": N}}; "
                             f"write it as {form}.")
        entries.append(entry)
    return {**meta, "files": entries}


def find_token_files(spec: str | os.PathLike, dtype: str | None = None, flag: str = "--data") -> TokenFiles:
    """The token files of a directory (its shards.json's files, or else its *.bin sorted), a
    glob of .bin files within one directory (sorted, or in its shards.json's order) or one .bin
    file. Their dtype is shards.json's where the directory has one (each file must be listed
    there), else `dtype` (--data_dtype): every problem is a ValueError naming it and the fix."""
    spec, where = str(spec), f"{flag}={spec}"
    chosen = None  # the files the glob or path named, None for a whole directory
    if os.path.isdir(spec):
        directory = pathlib.Path(spec)
    elif os.path.isfile(spec) or not _is_glob(spec):
        if not os.path.isfile(spec):
            raise ValueError(f"{where}: no such file; pass a .bin token file, a directory of them or a text corpus.")
        chosen = [pathlib.Path(spec)]
    else:
        chosen = sorted(pathlib.Path(p) for p in glob.glob(spec) if os.path.isfile(p))
        if not chosen:
            raise ValueError(f"{where} matches no file; pass a glob that matches .bin token files (quoted, so "
                             "the shell leaves it alone), or their directory.")
        dirs = sorted({str(p.parent) for p in chosen})
        if len(dirs) > 1:
            raise ValueError(f"{where} matches files in {len(dirs)} directories ({dirs[0]}, {dirs[1]}, ...); pass "
                             "one directory, or a glob within one.")
    if chosen is not None:
        directory = chosen[0].parent
        if text := next((p for p in chosen if p.suffix != ".bin"), None):
            raise ValueError(f"{where} names {text}, not a token file (.bin); tokenize text first: {_MAKE_SHARDS}.")
    meta_path = directory / SHARDS_JSON
    meta = _read_meta(meta_path, where) if meta_path.is_file() else None
    counts = {}
    if meta is not None:
        counts = {f["name"]: f.get("tokens") for f in meta["files"]}
        if chosen is not None and (unlisted := [p for p in chosen if p.name not in counts]):
            raise ValueError(f"{where}: {unlisted[0]} is not listed in {meta_path}; add it there, or pass only the "
                             "files it lists.")
        names = [n for n in counts if chosen is None or n in {p.name for p in chosen}]
        if dtype is not None and dtype != meta["dtype"]:
            raise ValueError(f"{where}: --data_dtype={dtype}, but {meta_path} says {meta['dtype']}; drop "
                             "--data_dtype (shards.json says what the files hold).")
        dtype = meta["dtype"]
    else:
        names = [p.name for p in (chosen or sorted(directory.glob("*.bin")))]
        if not names:
            raise ValueError(f"{where}: no {SHARDS_JSON} and no .bin token files in it; make them with {_MAKE_SHARDS}.")
        if dtype is None:
            raise ValueError(f"{where}: token files without {SHARDS_JSON} ({directory / names[0]}, ...): pass "
                             "--data_dtype=uint16 (nanoGPT's .bin) or --data_dtype=uint32, and the --tokenizer "
                             "that made them.")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} in {meta_path}; token files hold {' or '.join(TOKEN_DTYPES)}.")
    itemsize, paths, sizes = np.dtype(dtype).itemsize, [], []
    for name in names:
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{where}: {meta_path} lists {name}, which is missing; restore it, or tokenize the "
                             "corpus again.")
        size = path.stat().st_size
        if size % itemsize:
            raise ValueError(f"{where}: {path} has {size} bytes, not a whole number of {dtype} ids ({itemsize} bytes "
                             "each): it is cut short, or holds another dtype (--data_dtype, or shards.json's).")
        if counts.get(name) not in (None, size // itemsize):
            raise ValueError(f"{where}: {path} holds {size // itemsize} {dtype} ids, {meta_path} says {counts[name]}: "
                             "it was cut short or replaced (or the dtype there is wrong); restore it, or tokenize the "
                             "corpus again.")
        paths.append(path)
        sizes.append(size)
    if not sum(sizes):
        raise ValueError(f"{where}: its token files are empty; make them with {_MAKE_SHARDS}.")
    return TokenFiles(spec, paths, sizes, dtype, meta, flag)


class ShardedTokens:
    """Token files as one read-only sequence, never loaded whole: the tokens [lo, hi) of their
    concatenation, each file an np.memmap opened on first use (one file descriptor each).

    What split_tokens and get_batch use: len(), a slice (a view of the same files) and an
    integer-array index (a gather). Every gathered id is checked against vocab_size (a
    ValueError naming the file and offset), as the embedding would not."""

    def __init__(self, files: TokenFiles, vocab_size: int):
        nonempty = [(p, s) for p, s in zip(files.paths, files.sizes) if s]  # np.memmap refuses empty files
        self.dtype, self.vocab_size = _little_endian(files.dtype), vocab_size
        self._paths = [p for p, _ in nonempty]
        self._starts = np.cumsum([0] + [s // self.dtype.itemsize for _, s in nonempty])  # [files + 1]
        self._maps: dict[int, np.memmap] = {}  # shared by the views
        self._lo, self._hi = 0, int(self._starts[-1])

    def __len__(self) -> int:
        return self._hi - self._lo

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("ShardedTokens takes slices without a step")
            view = copy.copy(self)
            view._lo, view._hi = self._lo + start, self._lo + max(start, stop)
            return view
        index = np.asarray(key)
        if index.dtype.kind not in "iu":
            raise IndexError(f"ShardedTokens takes integer indices, not {index.dtype}")
        if index.size and not (index.min() >= 0 and index.max() < len(self)):
            raise IndexError(f"index out of range [0, {len(self)})")
        at = index.astype(np.int64) + self._lo
        if at.ndim == 2 and at.shape[1] and (np.diff(at, axis=1) == 1).all():
            # get_batch's windows: a row is a slice of one file or two (measured, 64 x 1025 ids
            # over 3 shards: 1.4 ms, 3.4 ms id by id; 0.2 ms from one memmap)
            out = np.stack([self._read(int(a), int(a) + at.shape[1]) for a in at[:, 0]])
        else:
            out = self._gather(at.ravel()).reshape(at.shape)
        if out.size and out.max() >= self.vocab_size:
            bad = np.unravel_index(np.argmax(out >= self.vocab_size), out.shape)
            s = int(np.searchsorted(self._starts, at[bad], side="right")) - 1
            raise ValueError(f"{self._paths[s]} holds token id {out[bad]} (token {at[bad] - self._starts[s]}), >= the "
                             f"model's vocab_size {self.vocab_size}: the file is damaged, or not from this tokenizer.")
        return out

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Ids [start, stop) of the whole concatenation, copied out of the files they span."""
        s, parts = int(np.searchsorted(self._starts, start, side="right")) - 1, []
        while start < stop:
            end = min(stop, int(self._starts[s + 1]))
            parts.append(self._map(s)[start - self._starts[s] : end - self._starts[s]])
            start, s = end, s + 1
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)

    def _gather(self, at: np.ndarray) -> np.ndarray:
        """Ids at the flat positions `at` of the whole concatenation, file by file."""
        shard = np.searchsorted(self._starts, at, side="right") - 1
        out = np.empty(at.shape, self.dtype)
        for s in np.unique(shard):
            here = shard == s
            out[here] = self._map(s)[at[here] - self._starts[s]]
        return out

    def _map(self, s: int) -> np.memmap:
        if s not in self._maps:
            self._maps[s] = np.memmap(self._paths[s], dtype=self.dtype, mode="r")
        return self._maps[s]

    def __array__(self, dtype=None, copy=None):
        """All of it, read (for small corpora: tests)."""
        return np.asarray(self[np.arange(len(self))[None]][0], dtype=dtype)


def open_shards(spec: str | os.PathLike, tokenizer_name: str, vocab_size: int, dtype: str | None = None,
                flag: str = "--data") -> ShardedTokens:
    """The token files `spec` names (find_token_files), checked against the run's tokenizer and
    vocab (TokenFiles.check), as one sequence."""
    files = find_token_files(spec, dtype, flag)
    files.check(tokenizer_name, vocab_size)
    return ShardedTokens(files, vocab_size)
