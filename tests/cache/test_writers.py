"""Each piece of the row cache is the only writer of its state (docs/cache.md): no class of
``rowcache.cache`` (nor of ``rowcache.io``, its reader) assigns to, adds to, or mutates in
place another object's attributes or arrays. Checked on the source: every assignment and
augmented assignment inside a class whose target is an attribute (or an item of one) must
be rooted at ``self`` with one attribute (``self.x = ...``, ``self.x[i] = ...``), and no
mutating method (``append``, ``update``, ...) may be called on another object's attribute.
A write into another object goes through that object's method (``counters.count_read(...)``,
``lru.reserve(...)``, ``job.give_up(...)``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "rowcache"
PACKAGES = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists())
MUTATORS = {
    "append", "extend", "insert", "pop", "remove", "clear", "update", "add", "discard",
    "setdefault", "popitem", "sort", "reverse", "fill", "put", "resize",
}  # fmt: skip
# Writes allowed, with why: an object's thread-local storage is its own state; MissPlan.of
# fills the new MissPlan it constructs (its own class's value, before anyone holds it).
ALLOWED = {("io/pyengine.py", "self._local.buf"), ("cache/plan.py", "plan.__dict__")}


def _chain(node: ast.expr) -> tuple[str | None, list[str]]:
    """The root name and the attribute names of a target (subscripts skipped)."""
    names: list[str] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), names[::-1]


def _foreign(target: ast.expr) -> bool:
    """A write through ``target`` lands in another object's state."""
    root, names = _chain(target)
    if root in ("self", "cls"):
        return len(names) >= 2  # self.other.x = ..., self.other.x[i] = ...
    return bool(names)  # obj.x = ..., obj.x[i] = ... (locals and module names: fine)


def foreign_writes(source: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every write into another object's state inside a class."""
    found: list[tuple[int, str]] = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = list(node.targets)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
            ):
                targets = [node.func.value]
            flat: list[ast.expr] = []
            for t in targets:
                flat += t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
            for t in flat:
                if isinstance(t, (ast.Attribute, ast.Subscript)) and _foreign(t):
                    found.append((t.lineno, ast.unparse(t)))
    return sorted(set(found))


def test_the_scan_finds_foreign_writes():
    """The checker itself: it flags each kind of write into another object, and none of
    an object's writes into its own state."""
    src = """
class A:
    def f(self, other, job):
        self.x = 1
        self.a[3] = 2
        self.n += 1
        self.items.append(1)
        local = [0]
        local[0] = 1
        other.count += 1
        self.counters.hits += 2
        job.rows, job.slots = 1, 2
        self.b.arr[0:2] = 0
        job.taken.append(3)
        other.d.update(x=1)
"""
    got = [t for _, t in foreign_writes(src)]
    assert got == [
        "other.count", "self.counters.hits", "job.rows", "job.slots", "self.b.arr[0:2]",
        "job.taken", "other.d",
    ]  # fmt: skip


@pytest.mark.parametrize("package", PACKAGES)
def test_no_class_writes_another_objects_state(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = f"{package}/{path.relative_to(ROOT / package)}"
        for line, target in foreign_writes(path.read_text()):
            if (rel, target) not in ALLOWED:
                bad.append(f"{rel}:{line}: {target}")
    assert not bad, "writes into another object's state:\n" + "\n".join(bad)
