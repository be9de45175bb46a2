"""Token shards: a corpus larger than memory, as token-id files read through memmaps.

A directory of flat token-id files (`.bin`: little-endian uint16, nanoGPT's format, or
uint32) and `shards.json`: {"dtype": "uint16", "tokenizer": tokenizer.fingerprint(name),
"vocab_size": N, "files": [{"name": "shard_000000.bin", "tokens": N}, ...]} (a name alone
also does), as `python -m launch.tokenize` writes it (`twinshard.train.data.write_shards`).
The tokens are the files' in that order, read as one sequence (ShardedTokens), never loaded
whole; data.split_tokens takes its last 5% as validation, the rule of a single file, so a
corpus cut into shards trains exactly as the whole file would. Bare .bin files (no
shards.json) are read too, in the dtype --data_dtype names.
"""

import copy
import dataclasses
import functools
import glob
import hashlib
import json
import os
import pathlib

import numpy as np

from twinshard.train import tokenizer

SHARDS_JSON = "shards.json"
TOKEN_DTYPES = ("uint16", "uint32")
_SAMPLE_BLOCKS, _BLOCK_BYTES = 32, 4096  # what fingerprint and the id check read of each shard


def token_dtype(n_vocab: int) -> str:
    """The smaller of TOKEN_DTYPES that holds ids 0..n_vocab-1."""
    return "uint16" if n_vocab <= 1 << 16 else "uint32"


def little_endian(dtype: str) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def is_glob(spec: str | os.PathLike) -> bool:
    return any(c in str(spec) for c in "*?[")


def is_token_files(spec: str | os.PathLike) -> bool:
    """Whether --data names token files (a directory, a glob, a .bin file), not a text corpus."""
    spec = str(spec)
    return os.path.isdir(spec) or spec.endswith(".bin") or (is_glob(spec) and not os.path.isfile(spec))


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
                ids = np.frombuffer(block, little_endian(self.dtype))
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
    elif os.path.isfile(spec) or not is_glob(spec):
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
        self.dtype, self.vocab_size = little_endian(files.dtype), vocab_size
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
