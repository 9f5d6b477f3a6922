"""One import namespace: rowcache installs `rowcache` alone, beside transformers and
Hugging Face's `kernels` (which transformers >= 5.25 requires and imports)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_distribution_installs_one_top_level_name(tmp_path):
    """setuptools' own metadata (egg_info: no compile) names ``rowcache`` as the one
    top-level import package, and ships every subpackage and every ``.cu`` source."""
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    info = next(tmp_path.glob("*.egg-info"))
    assert (info / "top_level.txt").read_text().split() == ["rowcache"]
    shipped = (info / "SOURCES.txt").read_text().split()
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "rowcache").rglob("__init__.py")}
    for pkg in packages:
        assert f"{pkg}/__init__.py" in shipped, f"{pkg} would not ship"
    for cu in (ROOT / "rowcache").rglob("*.cu"):
        assert str(cu.relative_to(ROOT)) in shipped, f"{cu} would not ship"


def test_rowcache_beside_transformers_and_hf_kernels():
    """In one process: rowcache's packages, then transformers' Llama and LongCat modeling
    code, which import Hugging Face's ``kernels`` (``CUDAProperties`` among its names)."""
    pytest.importorskip("transformers")
    pytest.importorskip("kernels")
    code = (
        "import rowcache, rowcache.embed, rowcache.kernels\n"
        "import transformers.models.llama.modeling_llama\n"
        "import transformers.models.longcat_flash.modeling_longcat_flash\n"
        "import kernels\n"
        "from kernels import CUDAProperties\n"
        "import rowcache.embed.torch.module\n"
        "print(kernels.__file__)\n"
    )
    # run from a folder holding nothing importable, so only installed packages are found
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests" / "embed",
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "rowcache" not in pathlib.Path(proc.stdout.strip()).parts, proc.stdout


def test_every_module_imports_first():
    """Each module of the package imports as the first rowcache module of a process: no
    import cycle hides behind the order in which ``rowcache/__init__.py`` happens to import."""
    code = (
        "import importlib, pathlib, sys\n"
        "root, k, n = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])\n"
        "bad = []\n"
        "for p in sorted((root / 'rowcache').rglob('*.py'))[k::n]:\n"
        "    parts = list(p.relative_to(root).with_suffix('').parts)\n"
        "    if parts[-1] == '__init__': parts.pop()\n"
        "    if parts[-1] == '__main__' or 'torch' in parts: continue\n"
        "    for m in [m for m in sys.modules if m == 'rowcache' or m.startswith('rowcache.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module('.'.join(parts))\n"
        "    except Exception as e:\n"
        "        bad.append(f\"{'.'.join(parts)}: {e!r}\")\n"
        "print('\\n'.join(bad))\n"
    )
    # the modules split over a process per CPU (at most 4), run side by side
    n = max(1, min(4, os.cpu_count() or 1))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(ROOT), str(k), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(n)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert out.strip() == "", out
