"""CI check: no module imports another module's private (``_name``) names.

Walks every module of the ``rowcache`` package (and, with ``--all``, tests/ and bench/) and
reports each ``from M import _x`` / ``import M._x`` / ``M._x`` attribute use where ``M`` is
another rowcache module. The one exception: a package's private native extension (``_host``,
``_rcio``, ``_quantize``) may be imported by a module of the same package (its wrapper) and by
the tests that check it was built.
Exit status 1 with one line per violation, 0 when clean.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(path: pathlib.Path) -> list[str]:
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("rowcache"):
                continue
            for alias in node.names:
                if not private(alias.name):
                    continue
                native = alias.name in ("_host", "_rcio", "_quantize")
                if native and (node.module == package or me.startswith("tests.")):
                    continue  # a native extension, imported by its package's wrapper or its test
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rowcache") and any(private(p) for p in alias.name.split(".")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}")
    return found


def main(argv: list[str]) -> int:
    folders = ["rowcache"] + (["tests", "bench", "examples"] if "--all" in argv else [])
    found = [v for f in folders for p in sorted((ROOT / f).rglob("*.py")) for v in violations(p)]
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} imports of another module's private names", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
