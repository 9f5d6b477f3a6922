"""CLI subcommands over the store: ``build``, ``inspect``, ``verify``.

Only parsing, checking flags and input files (errors name the flag or the file) and
rendering; the work is ``build_store``, ``RowStore.open`` and ``RowStore.verify``.
Reports print a table by default and JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rowcache.cli.app import inform, positive_float
from rowcache.embed.checkpoint import INDEX_NAME, TABLE_NAME, Checkpoint
from rowcache.errors import ConfigError, FormatError
from rowcache.store.builder import build_store
from rowcache.store.handle import RowStore
from rowcache.store.sources import safetensors_header, safetensors_index, split_tensor_source

PAGE = 4096


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _check_source(flag: str, spec: str, src: str) -> None:
    """The file a --table names exists and is whole."""
    split = split_tensor_source(src)
    path = split[0] if split else src
    if not os.path.lexists(path):
        raise ConfigError(
            f"{flag} {spec}: file {path} does not exist; give NAME=PATH, PATH a FILE.npy, "
            "FILE.safetensors:TENSOR or INDEX.json:TENSOR"
        )
    if split and path.endswith(".json"):
        safetensors_index(path)
    elif path.endswith(".safetensors"):
        safetensors_header(path)  # checked: the header, and that the data it describes is there
    elif path.endswith(".npy"):
        import numpy as np

        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {spec}: {path} is not a regular file")
        try:
            np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise FormatError(f"{path}: not a readable .npy file ({e or 'empty'})") from e
    else:
        raise ConfigError(f"{flag} {spec}: give FILE.npy or FILE.safetensors:TENSOR")


def _parse_source(spec: str) -> tuple[str, Any]:
    """``NAME=PATH`` or ``PATH``; PATH is ``x.npy``, ``x.safetensors:tensor`` or
    ``model.safetensors.index.json:tensor``."""
    name, sep, src = spec.partition("=")
    if not sep:
        src, name = spec, ""
    if src.endswith((".safetensors", ".json")):
        raise ConfigError(
            f"--table {spec!r}: name the tensor, as FILE.safetensors:TENSOR or "
            "INDEX.json:TENSOR (or use --safetensors to take the LongCat n-gram tables)"
        )
    if not name:
        split = split_tensor_source(src)
        name = os.path.splitext(os.path.basename(split[1] if split else src))[0]
    return name, src


def _longcat_tables(path: str) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """The n-gram tables of a checkpoint (a ``.safetensors`` file, an index or a directory)
    as ``{ngram.i: (shard, tensor)}``, each checked in its shard; and its files without one."""
    if not os.path.lexists(path):
        raise ConfigError(
            f"--safetensors {path}: does not exist; give a .safetensors file, a sharded "
            f"checkpoint's {INDEX_NAME}, or the checkpoint's directory"
        )
    ckpt = Checkpoint(path)
    found = ckpt.ngram_tables()
    tables = {f"ngram.{i}": ckpt.source(TABLE_NAME.format(i=i)) for i in found}
    with_tables = set(found.values())
    return tables, [f for f in ckpt.shard_files() if f not in with_tables]


def _safetensors_tables(args: argparse.Namespace, tables: dict[str, Any]) -> None:
    """Add every --safetensors checkpoint's n-gram tables to ``tables``; files without one
    are skipped, and a line per file says which tables came from it."""
    origin: dict[str, str] = {}
    skipped: list[str] = []
    for path in args.safetensors or []:
        found, none = _longcat_tables(path)
        for name, (file, tensor) in found.items():
            if name in tables and origin.get(name) != file:
                where = origin.get(name, "a --table")
                raise ConfigError(
                    f"--safetensors: table {name} is in both {where} and {file}; give each "
                    "checkpoint (or shard) once"
                )
            tables[name], origin[name] = (file, tensor), file
        skipped += [f for f in none if f not in skipped]
    if args.safetensors and not origin:
        raise ConfigError(
            f"--safetensors {' '.join(args.safetensors)}: no n-gram tables (tensors named "
            f"{TABLE_NAME.format(i='{i}')}) in {plural(len(skipped), 'file')}"
            + (f": {', '.join(skipped[:4])}" if skipped else "")
        )
    by_file: dict[str, list[str]] = {}
    for name, file in origin.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        inform(args, f"{', '.join(names)} from {file}")
    if skipped:
        more = f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""
        inform(
            args,
            f"skipped {plural(len(skipped), 'file')} without n-gram tables: "
            f"{', '.join(skipped[:4])}{more}",
        )


def _cmd_build(args: argparse.Namespace) -> int:
    tables: dict[str, Any] = {}
    for spec in args.table or []:
        name, src = _parse_source(spec)
        if name in tables:
            raise ConfigError(f"--table: the name {name!r} is given twice")
        _check_source("--table", spec, src)
        tables[name] = src
    _safetensors_tables(args, tables)
    if not tables:
        raise ConfigError("give at least one --table NAME=PATH or --safetensors PATH")
    if os.path.exists(args.path) and not os.path.isdir(args.path):
        raise ConfigError(f"{args.path}: exists and is not a directory")
    if os.path.exists(args.path) and not args.overwrite:
        raise ConfigError(f"{args.path}: exists; pass --overwrite to replace it")
    shard_bytes = int(args.shard_mib * (1 << 20))
    if shard_bytes < PAGE:
        raise ConfigError(
            f"--shard-mib {args.shard_mib:g}: a shard holds at least one 4 KiB page "
            f"(--shard-mib {PAGE / (1 << 20)})"
        )
    store = build_store(
        args.path,
        tables,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        shard_bytes=shard_bytes,
    )
    inform(args, f"built {store.path}: {plural(len(store.tables), 'table')}, {store.dtype}")
    return _print_inspect(store, args.json)


def _inspect_dict(store: RowStore) -> dict[str, Any]:
    tables = []
    sources = store.meta.get("params", {}).get("sources") or []
    for t, (info, recs) in enumerate(zip(store.tables, store.shards)):
        tables.append(
            {
                "name": info.name,
                "rows": info.rows,
                "dim": info.dim,
                "dtype": info.dtype,
                "record_bytes": info.record_bytes,
                "rows_per_page": info.rows_per_page,
                "shards": info.shards,
                "source": sources[t] if t < len(sources) else None,
                "bytes_on_disk": sum(r.length for r in recs),
                "shard_files": [
                    {
                        "file": r.file,
                        "first_row": r.first_row,
                        "rows": r.rows,
                        "bytes": r.length,
                        # what the index holds: the CRC32C of the shard's page-CRC record
                        # (its pages' CRC32Cs as little-endian uint32), not of the file
                        "page_crcs_crc32c": f"{r.page_crc32c:08x}",
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
            f"{t['shards']:>6} {human_bytes(t['bytes_on_disk']):>12}"
        )
    print(
        f"{'total':<24} {rep['rows']:>12,} {'':>6} {'':>7} {'':>6} {human_bytes(rep['bytes_on_disk']):>12}"
    )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    with RowStore.open(args.path) as store:
        return _print_inspect(store, args.json)


def _cmd_verify(args: argparse.Namespace) -> int:
    # A missing or cut-short shard is what verify reports (exit 1), not a store that
    # cannot be opened (exit 2: only an unreadable index is that).
    with RowStore.open(args.path, check_shards=False) as store:
        rep = store.verify(progress=not args.no_progress)
    if args.json:
        print(
            json.dumps(
                {
                    "path": rep.path,
                    "ok": rep.ok,
                    "shards_checked": rep.shards_checked,
                    "bytes_checked": rep.bytes_checked,
                    "damaged_shards": rep.damaged_shards,
                    "problems": rep.problems,
                },
                indent=2,
            )
        )
    else:
        for p in rep.problems:
            print(f"problem: {p}")
        state = (
            "ok"
            if rep.ok
            else f"FAILED: {len(rep.damaged_shards)} of {plural(rep.shards_checked, 'shard')} "
            f"damaged ({', '.join(rep.damaged_shards)}; {plural(len(rep.problems), 'problem')})"
        )
        print(
            f"{rep.path}: {plural(rep.shards_checked, 'shard')}, "
            f"{human_bytes(rep.bytes_checked)} checked: {state}"
        )
    return 0 if rep.ok else 1


def register(sub: Any) -> None:
    p = sub.add_parser(
        "build",
        help="build a store from .npy / .safetensors tables",
        description="Stream tables from .npy files or .safetensors tensors into a new store "
        "(shard files of 4 KiB pages and an LMDB index), quantizing to FP8 on the way with "
        "--dtype fp8. Built in a temporary sibling directory and renamed into place when "
        "complete: a failed build leaves PATH as it was. Prints the inspect report.",
    )
    p.add_argument("path", help="store directory to create")
    p.add_argument(
        "--table",
        action="append",
        metavar="NAME=PATH",
        help="a table: PATH is FILE.npy, FILE.safetensors:TENSOR or INDEX.json:TENSOR (repeatable)",
    )
    p.add_argument(
        "--safetensors",
        action="append",
        metavar="PATH",
        help="take every model.ngram_embeddings.embedders.{i}.weight of PATH as table ngram.{i}: "
        f"a .safetensors file, a sharded checkpoint's {INDEX_NAME} or its directory (its "
        "weight_map followed; files without n-gram tables skipped) (repeatable)",
    )
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp8"],
        default="bf16",
        help="row format: bf16, or fp8 (E4M3 codes and a float32 scale per row)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument(
        "--shard-mib", type=positive_float, default=1024.0, help="shard file size in MiB"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the inspect report as JSON")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser(
        "inspect",
        help="tables, sizes and shards of a store",
        description="Print a store's format version, row format, and per table its rows, "
        "dim, record size, shard count and bytes on disk (records with FP8 scales, padded "
        "to 4 KiB pages).",
    )
    p.add_argument("path", help="store directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON (with shards)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="check every shard's length and page CRC32Cs (exit 1 on problems)",
        description="Read every shard file of a store and check its length and page CRC32Cs "
        "against the index. Exit 0 when all match, 1 when a problem is found (each damaged "
        "shard named: missing, cut short, not a regular file, or with bad pages), 2 when the "
        "store's index cannot be read.",
    )
    p.add_argument("path", help="store directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_verify)
