"""Plots of a calibration run (PNG, beside the parameter file)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from sssd.calibration.fit import Reliability


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def reliability_plot(before: Sequence[Reliability], after: Sequence[Reliability], path: Path, title: str) -> Path:
    """Predicted vs observed acceptance per source, raw and calibrated."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for ax, rels, label in ((axes[0], before, "raw source probability"), (axes[1], after, "calibrated")):
        ax.plot([0, 1], [0, 1], color="0.7", linestyle="--", linewidth=1, label="perfect calibration")
        for r in rels:
            ax.plot(
                r.predicted, r.observed, marker="o", markersize=3, label=f"{r.source} ({int(r.count.sum()):,} nodes)"
            )
        ax.set_xlabel(f"predicted acceptance ({label})")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("observed acceptance")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def mat_vs_budget_plot(series: dict[str, dict[int, float]], path: Path, title: str) -> Path:
    """MAT against budget for several drafter settings."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({x for p in series.values() for x in p}))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("draft budget (tree nodes per step)")
    ax.set_ylabel("MAT (accepted tokens per step, bonus included)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
