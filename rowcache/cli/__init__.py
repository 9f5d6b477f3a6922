"""The ``rowcache`` command line: argparse subcommands over library functions.

``main`` (the parser, shared flag types, dispatch), ``store`` (build, inspect, verify),
``tools`` (trace, profile), ``tune`` (tune, bench-io), ``demo``. Only parsing, checking
flags and rendering live here; the work is in the library.
"""

from __future__ import annotations

from rowcache.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
