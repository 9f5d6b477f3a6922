"""The native extensions can no longer be missing without a word (issue 51, item 8).

Each case runs in a child process: ``rowcache --version`` lists every extension, built or
fallback; an install without them (the package copied without its ``.so`` files, as
``pip install .`` leaves a machine without a C compiler under ``ROWCACHE_ALLOW_NO_NATIVE=1``)
warns once per extension at its first use and the demo's report says so; and the build
itself fails loudly without a compiler unless that variable allows the pure-Python install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import rowcache
from rowcache.kernels.extensions import EXTENSIONS
from tests.cli.support import run_cli
from tests.support import ROOT, package_copy

TINY_DEMO = ["demo", "--hidden", "48", "--ratio", "0.02", "--tokens", "1500", "--chunk", "128"]
TINY_DEMO += ["--tokenizer", "bytes", "--no-progress"]


def _version_lines(p: subprocess.CompletedProcess) -> dict[str, str]:
    assert p.returncode == 0 and p.stderr == "", p.stderr
    rows = [ln.split(None, 1) for ln in p.stdout.splitlines() if ln.startswith("  rowcache.")]
    return {name: state for name, state in rows}


def test_version_lists_each_native_extension_and_where_rowcache_is_from():
    p = run_cli("--version", timeout=60)
    first = p.stdout.splitlines()[0]
    here = os.path.dirname(os.path.abspath(rowcache.__file__))  # what these tests import
    assert first.startswith(f"rowcache {rowcache.__version__} from {here} "), first
    states = _version_lines(p)
    assert set(states) == set(EXTENSIONS)
    assert all(s == "built" for s in states.values()), p.stdout  # the test install builds them


@pytest.fixture(scope="module")
def no_native(tmp_path_factory):
    """``run_cli`` arguments for a rowcache install without its native extensions: its
    ``PYTHONPATH``, and a working directory outside the checkout (``python -c`` puts the
    working directory first on ``sys.path``)."""
    where = package_copy(tmp_path_factory.mktemp("pure"), native=False)
    return {"env": {"PYTHONPATH": str(where)}, "cwd": where}


def test_version_without_native_extensions_says_fallback_and_how_to_build(no_native):
    p = run_cli("--version", **no_native, timeout=60)
    assert f"from {no_native['cwd'] / 'rowcache'} " in p.stdout.splitlines()[0], p.stdout
    states = _version_lines(p)
    assert set(states) == set(EXTENSIONS)
    for state in states.values():
        assert state.startswith("fallback (not built:") and "Python path runs" in state, state
    assert "pip install -e ." in p.stdout and "ROWCACHE_ALLOW_NO_NATIVE" in p.stdout


def test_first_use_of_each_fallback_warns_once_and_the_demo_report_says_so(no_native):
    # fp8: the builder's quantize runs too, so every extension's Python path is used
    p = run_cli(*TINY_DEMO, "--dtype", "fp8", "--json", **no_native, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout)
    assert report["equal"] is True  # the Python paths give the same results
    assert report["native"] == dict.fromkeys(EXTENSIONS, "fallback")
    lines = p.stderr.splitlines()
    assert "Traceback" not in p.stderr and len(lines) == len(EXTENSIONS), p.stderr
    for name in EXTENSIONS:
        said = [ln for ln in lines if f"the native extension {name} is not built" in ln]
        assert len(said) == 1, (name, p.stderr)
        assert said[0].startswith("rowcache demo: warning: ") and "pip install -e ." in said[0]
    text = run_cli(*TINY_DEMO, "-q", **no_native, timeout=300)
    assert text.returncode == 0, text.stderr[-3000:]
    row = next(ln for ln in text.stdout.splitlines() if ln.startswith("native code"))
    assert "FALLBACK" in row and "rowcache.kernels._host" in row and "pip install -e ." in row
    # with the extensions: the same report says so, and nothing is warned
    built = run_cli(*TINY_DEMO, "--json", timeout=300)
    assert built.returncode == 0 and built.stderr == "", built.stderr[-3000:]
    assert json.loads(built.stdout)["native"] == dict.fromkeys(EXTENSIONS, "built")


def _build_ext(tmp_path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``setup.py build_ext`` into ``tmp_path`` with ``CC=false``: a compiler that fails."""
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--force"]
    cmd += ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if k != "ROWCACHE_ALLOW_NO_NATIVE"},
            "CC": "false",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_build_without_a_compiler_fails_loudly_unless_allowed(tmp_path):
    p = _build_ext(tmp_path / "strict", {})
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "did not build" in err[0] and "ROWCACHE_ALLOW_NO_NATIVE=1" in err[0], err[0]
    assert "C compiler" in err[0]
    assert not list((tmp_path / "strict").rglob("*.so"))
    p = _build_ext(tmp_path / "allowed", {"ROWCACHE_ALLOW_NO_NATIVE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    warned = [ln for ln in p.stderr.splitlines() if ln.startswith("warning: rowcache.")]
    assert [w.split()[1] for w in warned] == list(EXTENSIONS), p.stderr[-3000:]
