"""The ``rowcache`` command line: argparse subcommands over library functions.

Each subcommand lives in its own module that defines ``register(subparsers)``; the
module adds its parser and sets ``func`` (``args -> int`` exit code) as a default.
This file owns what every command shares: ``--version`` (with the native extensions in
use), ``-q``, help that shows defaults, progress bars only on a terminal, usage and rowcache
errors as one line on stderr with exit code 2 (no traceback, never on a progress bar's
line), warnings as one line each (``rowcache COMMAND: warning: ...``), and a quiet exit
when stdout is a closed pipe (``rowcache profile trace | head -n 1``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import platform
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from rowcache import __version__
from rowcache.errors import RowCacheError

# Modules that define register(subparsers); one line each.
COMMAND_MODULES = [
    "rowcache.cli.store",
    "rowcache.cli.demo",
    "rowcache.cli.tools",
    "rowcache.cli.tune",
]

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer killed by it


class UsageError(Exception):
    """A command line that argparse refused; ``prog`` is the (sub)command's name."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after each option's help, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        bounds = getattr(action.type, "bounds", None)
        if bounds is not None:  # an integer flag's range (int_in, int_list_in)
            text += f" [{bounds[0]:,}..{bounds[1]:,}]".replace("%", "%%")
        if d is None or d is False or d is argparse.SUPPRESS or "%(default)" in text:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text + " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises :class:`UsageError` instead of printing usage and exiting.

    A value that starts with ``-`` and a digit (``--arena -5GiB``) is a value, so that its
    flag's check refuses it by name instead of argparse reading it as an unknown option.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


def version_text() -> str:
    """What ``rowcache --version`` prints: the version, where the package was imported from
    (an installed copy or a checkout), and each native extension, ``built`` or ``fallback``
    (its Python path runs, slower; why, and how to build it)."""
    import rowcache
    from rowcache.kernels import extensions

    where = os.path.dirname(os.path.abspath(rowcache.__file__))
    lines = [
        f"rowcache {__version__} from {where} (Python {platform.python_version()})",
        "native extensions:",
    ]
    gone = extensions.missing()
    width = max(map(len, extensions.EXTENSIONS))
    for name, state in extensions.status().items():
        why = f" (not built: {gone[name]}; its Python path runs)" if name in gone else ""
        lines.append(f"  {name:<{width}}  {state}{why}")
    if gone:
        lines.append(f"the Python paths are 2-3x slower; {extensions.BUILD_HINT}")
    return "\n".join(lines)


class VersionAction(argparse.Action):
    """``--version``: prints :func:`version_text` and exits 0."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        print(version_text())
        parser.exit()


def add_quiet(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``-q/--quiet``: no progress bars and no informational lines on stderr."""
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="no progress bars or informational messages on stderr (errors still print)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="rowcache",
        description="Out-of-core embedding-row store, row cache, and fault-rate tools. "
        "`rowcache COMMAND --help` describes each command.",
    )
    parser.add_argument(
        "--version",
        action=VersionAction,
        help="print the version, where rowcache was imported from, and its native extensions",
    )
    add_quiet(parser, top=True)
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log what the library does on stderr (logger 'rowcache'): -v INFO, -vv DEBUG; "
        "before the command (rowcache -v build ...)",
    )
    # not required here: main() says a missing command after an unknown flag, which argparse
    # would hide behind "the following arguments are required: COMMAND" (rowcache --bogus)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for p in sub.choices.values():
        if not any("--quiet" in a.option_strings for a in p._actions):
            add_quiet(p)
    return parser


def _close_bars() -> None:
    """Finish any progress bar a failed command left open, so the error starts a new line."""
    tqdm_mod = sys.modules.get("tqdm")
    if tqdm_mod is None:
        return
    for bar in list(getattr(tqdm_mod.tqdm, "_instances", ())):
        try:
            bar.close()
        except Exception:  # a bar on a broken stream: the error line matters more
            pass
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush stays quiet."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


# A store's build, its replaced predecessor and a half-done switch live in hidden siblings
# (``.NAME.building-XXXX``: rowcache.store.replace), a trace's in ``.NAME.tmp-XXXX``
# (rowcache.tools.trace_build); an error names the store or trace the user gave.
_TEMP_SIBLING = re.compile(
    r"(^|[\s'\"(/])\.([^/\s'\"]+)\.(?:building|old|switch|tmp)-[A-Za-z0-9_]+"
)


def user_paths(text: str) -> str:
    """``text`` with every store-builder temporary directory named as the store it becomes."""
    return _TEMP_SIBLING.sub(r"\1\2", text)


def _error(prog: str, message: str) -> int:
    _close_bars()
    text = " ".join(user_paths(str(message)).split())  # one line, whatever the message held
    print(f"{prog}: error: {text}", file=sys.stderr)
    return EXIT_ERROR


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``argv`` parsed; an unknown flag is refused naming it and the (sub)command it was
    given to (``rowcache build: ... --bogus``), a missing command naming the commands."""
    args, extra = parser.parse_known_args(argv)
    command = getattr(args, "command", None)
    if extra:
        prog = f"rowcache {command}" if command else "rowcache"
        what = "argument" if len(extra) == 1 else "arguments"
        raise UsageError(prog, f"unrecognized {what}: {' '.join(extra)}")
    if command is None:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        raise UsageError("rowcache", f"give a COMMAND: one of {', '.join(sub.choices)}")
    return args


@contextmanager
def _warnings_as_lines(prog: str) -> Iterator[None]:
    """Warnings raised while a command runs (a native extension missing) print as one line
    on stderr, ``PROG: warning: MESSAGE``, not as Python's two-line form."""

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        line = f"{prog}: warning: " + " ".join(str(message).split())
        tqdm_mod = sys.modules.get("tqdm")
        if tqdm_mod is not None:  # above any progress bar, which goes on below it
            tqdm_mod.tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _interrupted(prog: str) -> int:
    _close_bars()
    print(f"{prog}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


_LOG_HANDLER: logging.Handler | None = None


def log_to_stderr(verbose: int) -> None:
    """``-v``: the ``rowcache`` logger's records at INFO (``-vv``: DEBUG) on stderr, one line
    each (``rowcache: INFO: rowcache.store.builder: built ...``); none without it. One handler,
    set again by every ``main`` call (tests call it many times in a process)."""
    global _LOG_HANDLER
    logger = logging.getLogger("rowcache")
    if _LOG_HANDLER is not None:
        logger.removeHandler(_LOG_HANDLER)
        _LOG_HANDLER = None
    if not verbose:
        logger.setLevel(logging.NOTSET)
        return
    handler = logging.StreamHandler()  # sys.stderr as it is now (a test's capture included)
    handler.setFormatter(logging.Formatter("rowcache: %(levelname)s: %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    _LOG_HANDLER = handler


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 check failed, 2 error, 130 Ctrl-C, 141
    closed pipe)."""
    prog = "rowcache"
    try:
        parser = build_parser()
        try:
            args = _parse(parser, argv)
        except UsageError as e:
            return _error(e.prog, f"{e} (see `{e.prog} --help`)")
        except SystemExit as e:  # --help, --version
            return int(e.code or 0)
        prog = f"rowcache {args.command}"
        log_to_stderr(args.verbose)
        # Bars only for a person watching a terminal; -q silences them and the info lines.
        if getattr(args, "quiet", False) or not _isatty(sys.stderr):
            if hasattr(args, "no_progress"):
                args.no_progress = True
        _take_deprecated(args, prog)
        with _warnings_as_lines(prog):
            code = int(args.func(args))
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:  # anywhere: the commands' workers stop before this is raised
        return _interrupted(prog)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except UsageError as e:
        return _error(e.prog, str(e))
    except RecursionError:  # a JSON input nested deeper than Python recurses (a backstop)
        return _error(prog, "an input is nested too deeply to read")
    except (RowCacheError, OSError, ValueError, KeyError) as e:
        msg = str(e) if not isinstance(e, KeyError) else str(e.args[0])
        return _error(prog, msg)


# --- deprecated spellings: hidden, still working, with a warning ------------------------------
def add_deprecated(parser: argparse.ArgumentParser, old: str, new: str, dest: str) -> None:
    """A hidden ``old`` spelling of the option ``new`` (whose ``dest`` is ``dest``)."""
    parser.add_argument(old, dest=f"{dest}__deprecated", default=None, help=argparse.SUPPRESS)
    have = parser.get_default("deprecated_options") or ()
    parser.set_defaults(deprecated_options=(*have, (old, new, dest)))


def _take_deprecated(args: argparse.Namespace, prog: str) -> None:
    for old, new, dest in getattr(args, "deprecated_options", None) or ():
        value = getattr(args, f"{dest}__deprecated")
        if value is None:
            continue
        if getattr(args, dest) is not None:
            raise UsageError(prog, f"give {new} only ({old} is its deprecated name)")
        setattr(args, dest, value)
        print(f"{prog}: warning: {old} is deprecated, use {new}", file=sys.stderr)


# --- argument types: argparse reports their errors as "argument --flag: message" -----------
def _number(text: str, kind: type) -> Any:
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'an integer' if kind is int else 'a number'}"
        ) from None
    if kind is float and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``. Every integer flag has one
    (a huge ``--batch`` grew a trace to the machine's memory; others ended in tracebacks):
    its bounds show in ``--help``, and a value outside them, or not an integer, is one line
    naming the flag, the value and the range (exit 2)."""

    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{_short(text)} is not an integer; give one from {low:,} to {high:,}"
            ) from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(
                f"{_short(text)}: give an integer from {low:,} to {high:,}"
            )
        return v

    parse.bounds = (low, high)  # type: ignore[attr-defined]
    parse.__name__ = f"integer {low}..{high}"
    return parse


def int_list_in(low: int, high: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each from ``low`` to ``high``
    (e.g. ``1,4,16``), at most :data:`MAX_LIST` of them."""

    def parse(text: str) -> list[int]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts or len(parts) > MAX_LIST:
            raise argparse.ArgumentTypeError(
                f"{_short(text)}: give 1 to {MAX_LIST} integers from {low:,} to {high:,}, "
                "comma separated, e.g. 1,4,16"
            )
        out = []
        for x in parts:
            where = "" if x == text.strip() else f" in {_short(text)}"
            try:
                v = int(x)
            except ValueError:
                v = None
            if v is None or not low <= v <= high:
                raise argparse.ArgumentTypeError(
                    f"{_short(x)}{where} is not an integer from {low:,} to {high:,} "
                    "(give e.g. 1,4,16)"
                )
            out.append(v)
        return out

    parse.bounds = (low, high)  # type: ignore[attr-defined]
    parse.__name__ = f"integers {low}..{high}"
    return parse


MAX_LIST = 64  # values of a list flag (--queue-depths)


def _short(text: str, limit: int = 40) -> str:
    """``repr(text)``, cut to ``limit`` characters (a flag's value can be megabytes)."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _number(text, float)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number > 0")
    return v


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    v = _number(text, float)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number in (0, 1]")
    return v


def byte_size(text: str) -> int:
    """Bytes >= 0: ``0``, ``4096``, ``20e9``, or binary units ``512K``, ``12G`` = ``12GiB``
    (2^30)."""
    from rowcache.errors import ConfigError
    from rowcache.units import parse_bytes

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a size >= 0, e.g. 0 or 70GiB")
    try:
        return parse_bytes(text, "size")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size: ")) from None


def positive_byte_size(text: str) -> int:
    """Bytes > 0, as :func:`byte_size` takes them."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a size > 0, e.g. 20GiB")
    v = byte_size(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size > 0, e.g. 20GiB")
    return v


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def inform(args: argparse.Namespace, message: str) -> None:
    """An informational line on stderr, unless ``-q``."""
    if not getattr(args, "quiet", False):
        print(message, file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
