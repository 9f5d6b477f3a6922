"""A checkpoint named by a Hugging Face repo id, resolved to its local snapshot.

Owns :func:`resolve_checkpoint`: a local path is returned as it is; a repo id
(``"meituan-longcat/LongCat-Flash-Lite"``) is resolved through ``huggingface_hub``'s
``snapshot_download`` into the Hugging Face cache, as transformers' ``from_pretrained``
does, downloading only the JSON files and the shards that hold the tensors a loader reads
(not the whole model). Where the Hub cannot be reached (no network, ``HF_HUB_OFFLINE=1``)
the files already in the cache (``HF_HUB_CACHE``) are used, as transformers does; where
they are missing, a one-line ``ConfigError`` says so. Reads the index, never a tensor.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

from rowcache.errors import ConfigError

log = logging.getLogger(__name__)
INDEX_NAME = "model.safetensors.index.json"
# huggingface_hub's rule for a repo id: "name" or "namespace/name", letters, digits, - _ .
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(?:/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")


def is_repo_id(path: str) -> bool:
    """Whether ``path`` reads as a Hugging Face repo id (``name`` or ``namespace/name``)."""
    return bool(_REPO_ID.fullmatch(path)) and ".." not in path and not path.endswith(".")


def resolve_checkpoint(
    path: str | os.PathLike[str],
    wanted: Callable[[str], bool],
    *,
    revision: str | None = None,
) -> str:
    """The local checkpoint of ``path``: ``path`` itself where it exists on disk (or is not a
    repo id: the loader then says it is missing), else the local snapshot of the Hugging
    Face repo ``path``.

    Parameters
    ----------
    path : a local file or directory, or a repo id (``"namespace/name"``).
    wanted : which tensors (by name) the loader reads; of a sharded checkpoint only the
        shards holding them are downloaded (and the JSON files: config, index, tokenizer).
    revision : a branch, tag or commit of the repo (default: its default branch).

    Returns
    -------
    str : the snapshot directory (``$HF_HUB_CACHE/models--namespace--name/snapshots/<commit>``).
    """
    p = os.fspath(path)
    if os.path.lexists(p) or not is_repo_id(p):
        return p
    snapshot = _download(p, ["*.json"], revision)
    index = os.path.join(snapshot, INDEX_NAME)
    if os.path.isfile(index):
        files = sorted({f for name, f in _weight_map(index, p).items() if wanted(name)})
        patterns = ["*.json", *files]
    else:
        patterns = ["*.json", "*.safetensors"]
    local = _download(p, patterns, revision)
    log.info("checkpoint %s: the Hugging Face snapshot %s (files %s)", p, local, patterns)
    return local


def _weight_map(index: str, repo: str) -> dict[str, str]:
    try:
        with open(index, encoding="utf-8") as f:
            wm = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{repo}: its {INDEX_NAME} is not readable JSON ({e})") from None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise ConfigError(f"{repo}: its {INDEX_NAME} has no weight_map of tensor -> file")
    return wm


def _download(repo: str, patterns: list[str], revision: str | None) -> str:
    """``snapshot_download`` of ``patterns``; any failure a one-line ``ConfigError``."""
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ConfigError(
            f"checkpoint {repo!r} is not a local path; as a Hugging Face repo id it needs the "
            "huggingface_hub package (pip install 'rowcache[checkpoints]')"
        ) from None
    try:
        # snapshot_download itself falls back to the cache when the Hub cannot be reached
        out: Any = snapshot_download(repo, allow_patterns=patterns, revision=revision)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"checkpoint {repo!r} is not a local path, and as a Hugging Face repo id it could "
            f"not be fetched nor found in the cache {constants.HF_HUB_CACHE}{offline}: "
            f"{type(e).__name__}: {first}"
        ) from e
    return os.fspath(out)


__all__ = ["INDEX_NAME", "is_repo_id", "resolve_checkpoint"]
