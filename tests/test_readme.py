"""The README's commands: the test command is the one .ci/run runs; every ``rowcache``
command parses; the sizing walk-through runs from a fresh shell (venv paths only) and,
at a tiny size, end to end."""

from __future__ import annotations

import pathlib
import re
import shlex

from rowcache.cli.app import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def sizing_commands() -> list[list[str]]:
    """The command lines of the sizing walk-through's block, comments dropped."""
    block = next(b for b in bash_blocks() if "rowcache trace" in b)
    lines = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [shlex.split(ln, comments=True) for ln in lines]


def test_ci_runs_exactly_the_readme_test_command():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = next(ln for ln in lines if ln.startswith("python3 -m venv .venv"))
    assert ci in README, f"README does not show .ci/run's command: {ci}"


def test_every_readme_rowcache_command_parses():
    found = 0
    for block in bash_blocks():
        for line in block.splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if argv[:1] == [".venv/bin/rowcache"]:
                    build_parser().parse_args(argv[1:])  # raises on an unknown flag or value
                    found += 1
    assert found >= 5


def test_sizing_walkthrough_runs_in_a_fresh_shell():
    cmds = sizing_commands()
    assert [c[1] for c in cmds if c[0] == ".venv/bin/rowcache"] == [
        "trace",
        "profile",
        "bench-io",
        "tune",
    ]
    for c in cmds:
        # No bare `python`/`rowcache` (the venv is not active), no system paths.
        assert c[0].startswith(".venv/bin/"), c
        assert not any(a.startswith("/usr/") or "$(" in a for a in c), c
    trace = next(c for c in cmds if c[1:2] == ["trace"])
    assert "--stdlib" in trace and trace[trace.index("--tokenizer") + 1] == "deepseek"


def test_sizing_walkthrough_end_to_end_at_a_tiny_size(tmp_path, monkeypatch, capsys):
    """The same commands, in their order and with their relative paths, at a tiny size.

    Changes: trace reads 40 requests; profile samples at rate 1 (1% of a tiny trace keeps
    nothing, which profile refuses) and skips the plot when matplotlib is missing; bench-io
    measures one queue depth for 0.02 s.
    """
    monkeypatch.chdir(tmp_path)
    tiny = {
        "trace": ["--max-requests", "40", "-q"],
        "bench-io": ["--queue-depths", "1", "--seconds", "0.02", "-q"],
    }
    for c in sizing_commands():
        if c[0] != ".venv/bin/rowcache":
            continue
        argv = c[1:] + tiny.get(c[1], [])
        if c[1] == "profile":
            argv[argv.index("--rate") + 1] = "1"
            argv[argv.index("--policies") + 1] = "sieve"
            argv += ["--sizes", "64K,256K", "-q"]
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                i = argv.index("--png")
                del argv[i : i + 2]
        assert main(argv) == 0, (argv, capsys.readouterr().err)
        out = capsys.readouterr().out
        assert out.strip()
    assert "expected faults/token" in out and "µs" in out
    assert (tmp_path / "profile.json").is_file() and (tmp_path / "disk.json").is_file()


def test_readme_table_budgets_parse():
    rows = re.findall(r"^\| `(--[^`]+)`", README, flags=re.M)
    assert len(rows) >= 4
    for flags in rows:
        build_parser().parse_args(["tune", "profile.json", *shlex.split(flags)])


def test_readme_quickstart_runs(tmp_path, monkeypatch):
    """The README's Python quickstart (store -> cache -> embedding -> torch) runs as written,
    its store in a temporary folder."""
    import tempfile

    import pytest

    pytest.importorskip("torch")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (block,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    scope: dict = {"__name__": "__readme__"}
    exec(compile(block, "README.md", "exec"), scope)
    assert tuple(scope["x"].shape) == (1, 2, scope["dims"].hidden_size)
    assert scope["cache"].stats().misses > 0


# A child where `import torch` fails, as on an install without the torch extra.
NO_TORCH = "import sys\nsys.modules['torch'] = None\n"


def test_readme_quickstart_imports_torch_only_for_its_torch_lines(tmp_path):
    """Issue 51, item 12: the quickstart says torch is for its last lines; it imported it on
    line 2. In a child that cannot import torch, all but step 4 runs, and the whole block
    stops at step 4's own `import torch`."""
    import subprocess
    import sys

    (block,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    lines = block.splitlines()
    step4 = next(i for i, ln in enumerate(lines) if ln.startswith("# 4. The torch module"))
    assert not any("torch" in ln.split("#")[0] for ln in lines[:step4] if "import" in ln)
    before = "\n".join(lines[:step4]) + "\nprint('misses', cache.stats().misses)\n"
    for code, want_ok in ((before, True), (block, False)):
        p = subprocess.run(
            [sys.executable, "-c", NO_TORCH + code],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        if want_ok:
            assert p.returncode == 0, p.stderr[-3000:]
            assert int(p.stdout.split()[-1]) > 0
        else:
            assert p.returncode == 1 and "ModuleNotFoundError" in p.stderr, p.stderr[-3000:]
            at = re.findall(r'File "<string>", line (\d+)', p.stderr)
            assert at, p.stderr[-3000:]
            line = lines[int(at[-1]) - 1 - NO_TORCH.count("\n")]
            assert line == "import torch" and int(at[-1]) > step4, (line, p.stderr[-3000:])
