"""Offline tiktoken encodings built from vendored BPE ranks.

`tiktoken.get_encoding` downloads its ranks on first use and fails offline, so
every encoding here is built with `tiktoken.Encoding` from a ranks file in
`twinshard/assets/` (or any ranks file the caller names).
"""

import base64
import functools
import hashlib
import os
import pathlib
import tempfile

import tiktoken

# GPT-2 pre-tokenization (tiktoken r50k, CS336 `PAT`): contractions, letter
# runs, digit runs and punctuation runs each with one optional leading space,
# then whitespace (trailing whitespace leaves its last char for the next word).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

ENDOFTEXT = "<|endoftext|>"
ASSETS = pathlib.Path(__file__).resolve().parent.parent / "assets"  # twinshard/assets
_RANK_FILES = {
    "gpt2": ASSETS / "gpt2.tiktoken",
    "shakespeare4096": ASSETS / "shakespeare_bpe4096.tiktoken",
}
_N_VOCAB = {"bytes": 257, "gpt2": 50257, "shakespeare4096": 4096}
# "bytes": raw UTF-8 bytes (ids 0..255, no merges) + <|endoftext|> = 256: the
# tiny test preset's vocab, 257, pads to 384 so padded logits are always exercised.
TOKENIZERS: tuple[str, ...] = ("bytes", *_RANK_FILES)


def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Reads tiktoken's ranks format: one `base64(token_bytes) rank` per line."""
    ranks = {}
    for line in pathlib.Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def save_ranks(ranks: dict[bytes, int], path: str | os.PathLike) -> None:
    """Writes tiktoken's ranks format atomically, so readers never see half a file."""
    path = pathlib.Path(path)
    lines = [
        f"{base64.b64encode(t).decode()} {r}\n"
        for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(lines)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, first 16 hex digits: a corpus's or a ranks file's identity,
    whatever its path."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def fingerprint(name: str) -> str:
    """The tokenizer's identity: a built-in's name, or `file_digest` of its ranks file, so the
    same file under another path is the same tokenizer."""
    return name if name in TOKENIZERS else "sha256:" + file_digest(name)


@functools.cache
def get_encoding(name: str) -> tiktoken.Encoding:
    """Returns the encoding `name` (one of TOKENIZERS) or one built from a ranks file.

    A ranks file gets `<|endoftext|>` right after its last rank, so a file with
    4095 ranks gives n_vocab 4096; GPT-2 keeps its own id 50256 for it.
    """
    path = _RANK_FILES.get(name, pathlib.Path(name))
    if name == "bytes":
        ranks = {bytes([b]): b for b in range(256)}
    elif not path.is_file():
        raise ValueError(
            f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)} "
            "or a path to a tiktoken ranks file (`base64(token) rank` per line)"
        )
    else:
        ranks = load_ranks(path)
    if name in _N_VOCAB:
        label = name
    else:  # the content hash keeps same-named files apart in data caches
        label = f"{path.stem}-{hashlib.sha256(path.read_bytes()).hexdigest()[:8]}"
    enc = tiktoken.Encoding(
        name=label,
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: max(ranks.values()) + 1},
    )
    expected = _N_VOCAB.get(name, enc.n_vocab)
    if enc.n_vocab != expected:
        raise ValueError(
            f"tokenizer {name!r} from {path} has n_vocab {enc.n_vocab}, expected {expected}"
        )
    return enc
