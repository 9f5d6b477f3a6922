"""The ``rowcache`` command line: argparse subcommands over library functions.

Each subcommand lives in its own module that defines ``register(subparsers)``; the
module adds its parser and sets ``func`` (``args -> int`` exit code) as a default.
This file only dispatches and turns rowcache errors into one line on stderr with
exit code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .errors import RowCacheError

# Modules that define register(subparsers); one line each.
COMMAND_MODULES = [
    "rowcache.commands_store",
    "rowcache.demo",
    "rowcache.commands_tools",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rowcache",
        description="Out-of-core embedding-row store, row cache, and fault-rate tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 check failed, 2 error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (RowCacheError, OSError, ValueError, KeyError) as e:
        msg = str(e) if not isinstance(e, KeyError) else str(e.args[0])
        print(f"rowcache {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rowcache {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
