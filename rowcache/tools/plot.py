"""PNG plots of fault-rate curves (matplotlib, imported lazily: an optional extra).

Owns :func:`plot_profile`: per-table curves against rows, and total faults per
token against arena bytes for per-table arenas and one shared arena, plus the
policy comparison when present. Does not compute anything.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.tools.profile import ProfileReport


def require_matplotlib() -> None:
    """Raise :class:`ConfigError` now if a plot could not be drawn (matplotlib missing)."""
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError(
            "plots need matplotlib (pip install matplotlib, or the 'plot' extra)"
        ) from e
    return plt


def plot_profile(report: ProfileReport, path: str | os.PathLike[str]) -> None:
    """Write ``report``'s curves to a PNG at ``path``."""
    plt = _pyplot()
    ncols = 3 if report.policies else 2
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5))
    ax = axes[0]
    # One colour per n-gram order, a line style per table within it: 12 tables in one
    # palette would repeat colours (table 10 drawn like table 0).
    orders = list(report.table_orders) or [0] * len(report.curves)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    seen: dict[int, int] = {}
    for (name, c), order in zip(report.curves.items(), orders):
        k = seen.get(order, 0)
        seen[order] = k + 1
        style = {
            "color": palette[sorted(set(orders)).index(order) % len(palette)],
            "ls": styles[k % len(styles)],
            "lw": 1,
            "label": f"table {name}" + (f" ({order}-gram)" if order else ""),
        }
        if np.any(c.miss_ratio_std > 0):
            ax.errorbar(c.sizes, c.miss_ratio, yerr=c.miss_ratio_std, **style)
        else:
            ax.plot(c.sizes, c.miss_ratio, **style)
    ax.set_xscale("log")
    ax.set_xlabel("arena rows per table")
    ax.set_ylabel("fault rate (faults per access)")
    ax.set_title("per table")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)

    ax = axes[1]
    gib = report.arena_bytes() / 2**30
    ax.plot(gib, report.faults_per_token(), marker="o", ms=3, label="one arena per table")
    if report.shared is not None:
        ax.plot(
            gib,
            report.shared.misses / max(1, report.tokens),
            marker="s",
            ms=3,
            label="shared arena",
        )
    ax.set_xscale("log")
    ax.set_xlabel(f"arena GiB in all ({report.dtype}, {report.record_bytes} B rows)")
    ax.set_ylabel("faults per token (all tables)")
    ax.set_title(f"{report.tokens:,} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    if report.policies:
        ax = axes[2]
        for name, c in report.policies.items():
            ax.plot(c.sizes, c.miss_ratio, label=name, lw=1.2, ls="--" if name == "opt" else "-")
        ax.set_xscale("log")
        ax.set_xlabel(f"arena rows (table {report.policy_table})")
        ax.set_ylabel("fault rate (per access, SHARDS sample)")
        ax.set_title("policies")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)
