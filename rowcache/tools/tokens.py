"""Token streams for traces: requests read from token-id files or tokenized text.

Owns the input side of ``rowcache trace``: ``.npy`` token arrays (split into
requests at EOS), JSON lines of id lists (one request per line), and text files or
folders tokenized by an HF ``tokenizer.json`` (the ``tokenizers`` package) or by an
offline tokenizer (``words``: hashed words and punctuation; ``bytes``: UTF-8
bytes). Everything streams: one request at a time. Does not schedule requests.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from ..errors import ConfigError

TOKEN_SUFFIXES = (".npy", ".jsonl", ".ndjson")
OFFLINE_TOKENIZERS = ("words", "bytes")
_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)
_FIRST_ID = 3  # keep ids 0..2 (pad, bos, eos in most vocabularies) out of hashed words

Tokenizer = Callable[[str], np.ndarray]


def make_tokenizer(name: str, vocab_size: int) -> Tokenizer:
    """A text -> int64 token-id function.

    Parameters
    ----------
    name : str
        ``"words"`` (offline: each word or punctuation mark hashed into
        ``[3, vocab_size)``, Zipf-like like a real vocabulary), ``"bytes"`` (offline:
        UTF-8 bytes + 3), or the path of an HF ``tokenizer.json``.
    vocab_size : int
        Ids must stay below it.
    """
    if name == "bytes":
        if vocab_size < 259:
            raise ConfigError(f"tokenizer='bytes' needs vocab_size >= 259; got {vocab_size}")

        def by_bytes(text: str) -> np.ndarray:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + _FIRST_ID

        return by_bytes
    if name == "words":
        if vocab_size <= _FIRST_ID:
            raise ConfigError(f"tokenizer='words' needs vocab_size > 3; got {vocab_size}")
        from zlib import crc32

        span = vocab_size - _FIRST_ID
        memo: dict[str, int] = {}

        def by_words(text: str) -> np.ndarray:
            out = []
            for w in _WORD.findall(text):
                t = memo.get(w)
                if t is None:
                    t = _FIRST_ID + crc32(w.encode("utf-8")) % span
                    if len(memo) < 1 << 20:
                        memo[w] = t
                out.append(t)
            return np.asarray(out, dtype=np.int64)

        return by_words
    path = Path(name)
    if not path.is_file():
        raise ConfigError(
            f"tokenizer={name!r} is neither {' nor '.join(OFFLINE_TOKENIZERS)} nor a tokenizer.json file"
        )
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError(
            "a tokenizer.json needs the 'tokenizers' package (pip install tokenizers)"
        ) from e
    tok = HFTokenizer.from_file(str(path))

    def by_hf(text: str) -> np.ndarray:
        ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        if ids.size and int(ids.max()) >= vocab_size:
            raise ConfigError(
                f"tokenizer {name!r} produced id {int(ids.max())} >= vocab_size {vocab_size}"
            )
        return ids

    return by_hf


def _expand(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files.extend(sorted(f for f in path.rglob("*") if f.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"input {str(p)!r} does not exist")
    if not files:
        raise ConfigError(f"no input files in {[str(p) for p in paths]}")
    return files


def _cut(tokens: np.ndarray, max_tokens: int) -> Iterator[np.ndarray]:
    for start in range(0, tokens.size, max_tokens):
        yield tokens[start : start + max_tokens]


def _split_at_eos(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == eos) + 1
    return [p for p in np.split(tokens, ends) if p.size]


def iter_requests(
    paths: Sequence[str | os.PathLike[str]],
    *,
    vocab_size: int,
    eos_token_id: int,
    tokenizer: str = "words",
    max_request_tokens: int = 8192,
) -> Iterator[np.ndarray]:
    """Requests (int64 token arrays) from files and folders, one at a time.

    ``.npy``: a 1-D array split after each EOS (2-D: one request per row);
    ``.jsonl``/``.ndjson``: a JSON list of ids per line; any other file: UTF-8 text,
    one request per paragraph (blank-line separated), tokenized. Requests longer
    than ``max_request_tokens`` are cut.
    """
    if max_request_tokens < 1:
        raise ConfigError(f"max_request_tokens must be >= 1; got {max_request_tokens}")
    tok: Tokenizer | None = None
    for f in _expand(paths):
        suffix = f.suffix.lower()
        if suffix == ".npy":
            arr = np.load(f, mmap_mode="r")
            if arr.ndim not in (1, 2) or arr.dtype.kind not in "iu":
                raise ConfigError(
                    f"{f}: token arrays must be 1-D or 2-D ints; got {arr.dtype}{arr.shape}"
                )
            if arr.ndim == 2:
                for row in arr:
                    yield from _cut(np.asarray(row, dtype=np.int64), max_request_tokens)
                continue
            step = 1 << 22
            carry = np.zeros(0, dtype=np.int64)
            for start in range(0, arr.shape[0], step):
                block = np.concatenate(
                    (carry, np.asarray(arr[start : start + step], dtype=np.int64))
                )
                parts = _split_at_eos(block, eos_token_id)
                last_open = bool(parts) and parts[-1][-1] != eos_token_id
                carry = parts.pop() if last_open else np.zeros(0, dtype=np.int64)
                for p in parts:
                    yield from _cut(p, max_request_tokens)
            if carry.size:
                yield from _cut(carry, max_request_tokens)
        elif suffix in (".jsonl", ".ndjson"):
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    ids = json.loads(line)
                    if isinstance(ids, dict):
                        ids = ids.get("input_ids", ids.get("tokens"))
                    if not isinstance(ids, list):
                        raise ConfigError(f"{f}:{lineno}: expected a JSON list of token ids")
                    yield from _cut(np.asarray(ids, dtype=np.int64), max_request_tokens)
        else:
            if tok is None:
                tok = make_tokenizer(tokenizer, vocab_size)
            with open(f, encoding="utf-8", errors="replace") as fh:
                para: list[str] = []
                for line in fh:
                    if line.strip():
                        para.append(line)
                        continue
                    if para:
                        ids = tok("".join(para))
                        para = []
                        if ids.size:
                            yield from _cut(ids, max_request_tokens)
                if para:
                    ids = tok("".join(para))
                    if ids.size:
                        yield from _cut(ids, max_request_tokens)
