"""The native extension is built by ``pip install -e .`` wherever a C compiler is."""

from __future__ import annotations

import shutil
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rowcache.io._rcio is Linux-only")
def test_native_extension_is_built_where_a_compiler_is():
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler: the Python reader runs instead")
    try:
        from rowcache.io import _rcio
    except ImportError as e:
        pytest.fail(f"rowcache.io._rcio was not built (pip install -e . prints why): {e}")
    assert _rcio.Reader(4, "threads").engine == "threads"
    import rowcache.io.native

    assert rowcache.io.native.NATIVE_BUILT
