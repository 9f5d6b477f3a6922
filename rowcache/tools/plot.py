"""PNG plots of fault-rate curves (matplotlib, imported lazily: an optional extra).

Owns :func:`plot_profile`: per-table curves against rows, and total faults per
token against arena bytes for per-table arenas and one shared arena, plus the
policy comparison when present. Does not compute anything.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import ConfigError
from .profile import ProfileReport


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError("plots need matplotlib (pip install matplotlib), or omit --png") from e
    return plt


def plot_profile(report: ProfileReport, path: str | os.PathLike[str]) -> None:
    """Write ``report``'s curves to a PNG at ``path``."""
    plt = _pyplot()
    ncols = 3 if report.policies else 2
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5))
    ax = axes[0]
    for name, c in report.curves.items():
        if np.any(c.miss_ratio_std > 0):
            ax.errorbar(c.sizes, c.miss_ratio, yerr=c.miss_ratio_std, label=f"table {name}", lw=1)
        else:
            ax.plot(c.sizes, c.miss_ratio, label=f"table {name}", lw=1)
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
