"""CLI subcommands over the store: ``build``, ``inspect``, ``verify``.

Only parsing and rendering; the work is ``build_store``, ``RowStore.open`` and
``RowStore.verify``. Reports print a table by default and JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .builder import build_store
from .errors import ConfigError
from .sources import safetensors_header
from .store import RowStore


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def _parse_source(spec: str) -> tuple[str, Any]:
    """``NAME=PATH`` or ``PATH``; PATH is ``x.npy`` or ``x.safetensors:tensor``."""
    name, sep, src = spec.partition("=")
    if not sep:
        src, name = spec, ""
    if src.endswith(".safetensors"):
        raise ConfigError(
            f"--table {spec!r}: name the tensor, as FILE.safetensors:TENSOR "
            "(or use --safetensors to take the LongCat n-gram tables)"
        )
    if not name:
        name = os.path.splitext(os.path.basename(src.split(".safetensors:")[-1]))[0]
    return name, src


def _longcat_tables(path: str) -> dict[str, Any]:
    header = safetensors_header(path)
    prefix = "model.ngram_embeddings.embedders."
    found = sorted(
        (int(k[len(prefix) :].split(".")[0]), k)
        for k in header
        if k.startswith(prefix) and k.endswith(".weight")
    )
    if not found:
        raise ConfigError(f"--safetensors {path}: no tensors named {prefix}{{i}}.weight in it")
    return {f"ngram.{i}": (path, k) for i, k in found}


def _cmd_build(args: argparse.Namespace) -> int:
    tables: dict[str, Any] = {}
    for spec in args.table or []:
        name, src = _parse_source(spec)
        if name in tables:
            raise ConfigError(f"--table: the name {name!r} is given twice")
        tables[name] = src
    for st in args.safetensors or []:
        tables.update(_longcat_tables(st))
    if not tables:
        raise ConfigError("give at least one --table NAME=PATH or --safetensors FILE")
    store = build_store(
        args.path,
        tables,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        shard_bytes=int(args.shard_mib * (1 << 20)),
    )
    print(f"built {store.path}: {len(store.tables)} tables, {store.dtype}", file=sys.stderr)
    return _print_inspect(store, args.json)


def _inspect_dict(store: RowStore) -> dict[str, Any]:
    tables = []
    for info, recs in zip(store.tables, store.shards):
        tables.append(
            {
                "name": info.name,
                "rows": info.rows,
                "dim": info.dim,
                "dtype": info.dtype,
                "record_bytes": info.record_bytes,
                "rows_per_page": info.rows_per_page,
                "shards": info.shards,
                "bytes_on_disk": sum(r.length for r in recs),
                "shard_files": [
                    {
                        "file": r.file,
                        "first_row": r.first_row,
                        "rows": r.rows,
                        "bytes": r.length,
                        "crc32": f"{r.crc32:08x}",
                    }
                    for r in recs
                ],
            }
        )
    return {
        "path": store.path,
        "dtype": store.dtype,
        "version": store.meta["version"],
        "created": store.meta.get("created"),
        "tables": tables,
        "rows": sum(t["rows"] for t in tables),
        "bytes_on_disk": sum(t["bytes_on_disk"] for t in tables),
    }


def _print_inspect(store: RowStore, as_json: bool) -> int:
    rep = _inspect_dict(store)
    if as_json:
        print(json.dumps(rep, indent=2))
        return 0
    print(
        f"store {rep['path']}  (format v{rep['version']}, {rep['dtype']}, created {rep['created']})"
    )
    head = f"{'table':<24} {'rows':>12} {'dim':>6} {'record':>7} {'shards':>6} {'on disk':>12}"
    print(head)
    print("-" * len(head))
    for t in rep["tables"]:
        print(
            f"{t['name']:<24} {t['rows']:>12,} {t['dim']:>6} {t['record_bytes']:>6}B "
            f"{t['shards']:>6} {_human(t['bytes_on_disk']):>12}"
        )
    print(
        f"{'total':<24} {rep['rows']:>12,} {'':>6} {'':>7} {'':>6} {_human(rep['bytes_on_disk']):>12}"
    )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    with RowStore.open(args.path) as store:
        return _print_inspect(store, args.json)


def _cmd_verify(args: argparse.Namespace) -> int:
    with RowStore.open(args.path) as store:
        rep = store.verify(progress=not args.no_progress)
    if args.json:
        print(
            json.dumps(
                {
                    "path": rep.path,
                    "ok": rep.ok,
                    "shards_checked": rep.shards_checked,
                    "bytes_checked": rep.bytes_checked,
                    "problems": rep.problems,
                },
                indent=2,
            )
        )
    else:
        for p in rep.problems:
            print(f"problem: {p}")
        state = "ok" if rep.ok else f"FAILED ({len(rep.problems)} problems)"
        print(
            f"{rep.path}: {rep.shards_checked} shards, {_human(rep.bytes_checked)} checked: {state}"
        )
    return 0 if rep.ok else 1


def register(sub: Any) -> None:
    p = sub.add_parser("build", help="build a store from .npy / .safetensors tables")
    p.add_argument("path", help="store directory to create")
    p.add_argument(
        "--table",
        action="append",
        metavar="NAME=PATH",
        help="a table: PATH is FILE.npy or FILE.safetensors:TENSOR (repeatable)",
    )
    p.add_argument(
        "--safetensors",
        action="append",
        metavar="FILE",
        help="take every model.ngram_embeddings.embedders.{i}.weight of FILE",
    )
    p.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument("--shard-mib", type=float, default=1024.0, help="shard file size in MiB")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the inspect report as JSON")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("inspect", help="tables, sizes and shards of a store")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="check every shard's length and CRC32 (exit 1 on problems)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_verify)
