"""Engram's compressed vocabulary: token ids that decode to the same normalized text share one id.

Owns :class:`CompressedVocab` (docs/engram-spec.md section 1): built from a tokenizer
(a ``tokenizers.Tokenizer``, a transformers fast tokenizer or a ``tokenizer.json`` path) in a
few seconds, and kept in a small checksummed file keyed by the tokenizer's content, so a
server builds it once. The cached file is read defensively: a link, a FIFO, a short,
oversized or damaged file is ignored and rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from rowcache.embed.user_cache import cache_dir as user_cache_dir
from rowcache.errors import ConfigError

_MAGIC = b"RCEVOC1\0"  # the file's format; a change of the rule below changes _RULE
_RULE = b"nfkc,nfd,strip-accents,lower,ws-runs,strip;fffd->token;first-appearance"
_MAX_VOCAB = 1 << 24  # tokenizer ids a cached file may hold (DeepSeek-V3: 129,280)


class CompressedVocab:
    """A surjective map of token ids onto the compressed ids Engram hashes.

    ``lookup`` is int64 ``[V]`` (``V`` = the tokenizer's ids, added tokens included);
    ``len(vocab)`` is the number of compressed ids. Build it with :meth:`from_tokenizer`;
    ``CompressedVocab(lookup)`` takes a lookup computed elsewhere (checked: compressed ids
    are numbered in order of first appearance, as the rule numbers them).
    """

    def __init__(self, lookup: Any) -> None:
        arr = np.asarray(lookup)
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise ConfigError(
                f"lookup: give a non-empty 1-D integer array, got {arr.dtype} {arr.shape}"
            )
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        first = np.maximum.accumulate(arr)
        if arr[0] != 0 or (arr[1:] > first[:-1] + 1).any() or (arr < 0).any():
            raise ConfigError(
                "lookup: compressed ids must be numbered 0, 1, 2, ... in order of first "
                "appearance (docs/engram-spec.md section 1)"
            )
        arr.setflags(write=False)
        self.lookup = arr
        self._size = int(first[-1]) + 1

    def __len__(self) -> int:
        return self._size

    @property
    def tokenizer_size(self) -> int:
        """The tokenizer's ids ``V``: tokens the vocabulary maps."""
        return int(self.lookup.size)

    def __repr__(self) -> str:
        return f"CompressedVocab({self.tokenizer_size:,} token ids -> {len(self):,})"

    def compress(self, tokens: Any) -> np.ndarray:
        """``lookup[tokens]`` (int64, same shape); a token outside ``[0, V)`` is a
        ConfigError naming it."""
        t = np.asarray(tokens)
        if t.dtype.kind not in "iu":
            raise ConfigError(f"tokens: give integer token ids, got {t.dtype}")
        if t.size and (int(t.min()) < 0 or int(t.max()) >= self.lookup.size):
            bad = t[(t < 0) | (t >= self.lookup.size)].flat[0]
            raise ConfigError(
                f"tokens: {int(bad)} is outside the tokenizer's ids [0, {self.lookup.size})"
            )
        return self.lookup[t.astype(np.int64, copy=False)]

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, *, cache_dir: str | os.PathLike[str] | None = None
    ) -> CompressedVocab:
        """The compressed vocabulary of ``tokenizer``.

        Parameters
        ----------
        tokenizer : a ``tokenizers.Tokenizer``, a transformers fast tokenizer (its
            ``backend_tokenizer``), or the path of a ``tokenizer.json``.
        cache_dir : where the built map is kept (one small file per tokenizer content);
            default ``$ROWCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/rowcache``, else
            ``~/.cache/rowcache``. A file there that is not a valid map for this tokenizer
            is rebuilt; a directory that cannot be written only skips the keeping.
        """
        tok = _as_tokenizer(tokenizer)
        content = tok.to_str().encode()
        key = hashlib.sha256(_RULE + b"\0" + content).hexdigest()[:32]
        path = Path(cache_dir if cache_dir is not None else _default_cache_dir())
        path = path / "engram-vocab" / f"{key}.lookup"
        size = tok.get_vocab_size(with_added_tokens=True)
        cached = _read_cached(path, size)
        if cached is not None:
            return cls(cached)
        lookup = build_lookup(tok)
        _write_cached(path, lookup)
        return cls(lookup)


def build_lookup(tokenizer: Any) -> np.ndarray:
    """The rule of docs/engram-spec.md section 1 over every id of a ``tokenizers.Tokenizer``:
    decode each id alone (special tokens kept), key it by its normalized text (or, where the
    text holds U+FFFD, by the token's own string), number the keys in order of first
    appearance."""
    tokenizers = require_tokenizers()
    Regex, normalizers = tokenizers.Regex, tokenizers.normalizers

    sentinel = "\ue000"
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[t] for t in range(size)], skip_special_tokens=False)
    keys: dict[str, int] = {}
    lookup = np.empty(size, dtype=np.int64)
    for t, text in enumerate(texts):  # once per tokenizer (then cached): ~1 s for 129,280
        if "\ufffd" in text:
            key = tokenizer.id_to_token(t)
        else:
            key = norm.normalize_str(text) or text
        lookup[t] = keys.setdefault(key, len(keys))
    return lookup


def require_tokenizers() -> Any:
    """The ``tokenizers`` package; a one-line ``ConfigError`` naming the extra that installs
    it where it is missing (a serving-only install)."""
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(
            "Engram's compressed vocabulary is made from a tokenizer, which needs the "
            "'tokenizers' package, not installed here (a serving-only install): pip install "
            "'rowcache[tokenizers]'"
        ) from None
    return tokenizers


def _as_tokenizer(tokenizer: Any) -> Any:
    Tokenizer = require_tokenizers().Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    if isinstance(tokenizer, (str, os.PathLike)):
        p = Path(tokenizer)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ConfigError(f"tokenizer={str(tokenizer)!r}: no tokenizer.json there")
        try:
            return Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises its own Exception type for a bad file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"{p}: not an HF tokenizer.json ({first})") from None
    raise ConfigError(
        f"tokenizer: give a tokenizers.Tokenizer, a transformers fast tokenizer or a "
        f"tokenizer.json path, got {type(tokenizer).__name__}"
    )


def _default_cache_dir() -> str:
    return user_cache_dir()  # the one rule of rowcache.embed.user_cache: ROWCACHE_CACHE_DIR, ...


def _read_cached(path: Path, size: int) -> np.ndarray | None:
    """The map kept at ``path`` if it is a regular file holding a valid map of ``size`` ids
    (magic, count, values, SHA-256 of all before), else None. Never follows a link or waits
    on a FIFO."""
    want = len(_MAGIC) + 8 + 8 * size + 32
    if size > _MAX_VOCAB:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != want:
            return None
        data = bytearray()
        while len(data) < want:
            chunk = os.read(fd, want - len(data))
            if not chunk:
                return None
            data += chunk
    except OSError:
        return None
    finally:
        os.close(fd)
    body, digest = bytes(data[:-32]), bytes(data[-32:])
    if hashlib.sha256(body).digest() != digest or body[: len(_MAGIC)] != _MAGIC:
        return None
    (count,) = struct.unpack_from("<q", body, len(_MAGIC))
    if count != size:
        return None
    lookup = np.frombuffer(body, dtype="<i8", offset=len(_MAGIC) + 8).astype(np.int64)
    try:
        CompressedVocab(lookup)
    except ConfigError:
        return None
    return lookup


def _write_cached(path: Path, lookup: np.ndarray) -> None:
    """Keep ``lookup`` at ``path`` (a temporary file renamed over it); an unwritable cache
    directory only skips the keeping."""
    body = _MAGIC + struct.pack("<q", lookup.size) + lookup.astype("<i8").tobytes()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body + hashlib.sha256(body).digest())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
