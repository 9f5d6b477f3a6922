"""Helpers that several test modules share (not a test module: pytest collects nothing
here). Fixtures live in ``conftest.py``; what a test calls or subclasses lives here."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_judge(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m bench.<name> ARGS`` from the repository root, as the judges' docs say
    to run them (never with bench/ on ``sys.path``)."""
    return subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def package_copy(dest: pathlib.Path, *, native: bool) -> pathlib.Path:
    """A copy of the ``rowcache`` package under ``dest`` (returned: put it first on a child's
    ``PYTHONPATH``), as an install of it holds it: with its built native extensions, or
    (``native=False``) without them, as ``pip install .`` leaves a machine without a C
    compiler (``ROWCACHE_ALLOW_NO_NATIVE=1``)."""
    import shutil

    skip = ["__pycache__", "*.pyc"] + ([] if native else ["*.so", "*.pyd"])
    shutil.copytree(ROOT / "rowcache", dest / "rowcache", ignore=shutil.ignore_patterns(*skip))
    return dest
