"""Process pools for the offline tools that stop whole on Ctrl-C or on a worker's error.

Owns :func:`process_map`: a function over argument tuples in worker processes, results in
order. A terminal's Ctrl-C reaches the whole process group; the workers ignore it, so the
caller alone takes ``KeyboardInterrupt``, and leaving the pool (by an interrupt, or by an
error raised in a worker and re-raised here) terminates the workers that are still running:
one line from the CLI, no traceback per worker, no worker left computing. Does not know what
the workers compute (``rowcache.tools.profile``'s exact curves, ``rowcache.tools.parallel``'s
SHARDS samples).
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Sequence
from typing import Any


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _call(job: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
    fn, args = job
    return fn(*args)


def process_map(
    fn: Callable[..., Any],
    args: Sequence[tuple[Any, ...]],
    *,
    workers: int,
    on_result: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """``[fn(*a) for a in args]``, computed in ``workers`` processes.

    ``fn`` and the arguments must pickle (a module-level function). ``on_result(i, r)``
    is called in this process as each result arrives, in order (a progress bar's update).
    """
    out: list[Any] = []
    with multiprocessing.Pool(int(workers), initializer=_ignore_sigint) as pool:
        # Leaving the ``with`` block by any exception terminates the workers.
        for i, r in enumerate(pool.imap(_call, [(fn, tuple(a)) for a in args])):
            out.append(r)
            if on_result is not None:
                on_result(i, r)
    return out
