"""The calibration run behind ``sssd calibrate``.

1. Replay every setting of a staged grid (query parameters, then discounts)
   at every budget on the development split of ground-truth files.
2. With each budget's best setting, record every drafted node and fit
   isotonic calibration curves (raw source probability -> acceptance).
3. Replay each budget's best setting with the curves; keep them for the
   budgets where they raise MAT.
4. Write one parameter file (per-budget settings + curves + the fingerprint of
   the datastore, tokenizer and model; format in sssd/calibration_file.py) that
   ``sssd.DrafterConfig.load(path, budget)`` reads and the engine uses per step,
   and plots beside it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

import sssd
from sssd.calibration.fit import apply_calibration, fit_calibration, reliability
from sssd.calibration.grid import GridAxes, SearchResult, Trial, evaluate, staged_search
from sssd.calibration.replay import Example, replay
from sssd.calibration_file import Fingerprint
from sssd.config import CALIBRATION_FORMAT, CALIBRATION_VERSION, DrafterConfig


@dataclass
class CalibrationRun:
    """Everything a calibration run decided, ready to save."""

    budgets: list[int]
    default_budget: int
    search: SearchResult
    best: dict[int, Trial]
    calibrated: dict[int, Trial]
    baseline: dict[int, Trial]
    calibration: sssd.Calibration
    reliability_before: list = field(default_factory=list)
    reliability_after: list = field(default_factory=list)
    seconds: float = 0.0
    #: calibration key -> the discount fitted for another draft source (calibration/hybrid.py DiscountFit.to_dict)
    sources: dict[str, dict] = field(default_factory=dict)

    def config(self, budget: int) -> DrafterConfig:
        """The configuration the parameter file gives for `budget`."""
        return DrafterConfig.from_calibration(self.to_dict({}), budget)

    def to_dict(self, provenance: dict, fingerprint: Fingerprint | None = None) -> dict:
        """The parameter file's content; `fingerprint`: what it was calibrated for (None: not recorded)."""
        budgets = {}
        for b in self.budgets:
            use_cal = self.calibrated[b].mat > self.best[b].mat
            cfg = self.best[b].config.replace(budget=b, num_threads=0)
            cfg_dict = cfg.to_dict()
            cfg_dict["discounts"]["calibration"] = None
            budgets[str(b)] = {
                "config": cfg_dict,
                "calibrated": use_cal,
                "mat": round(max(self.best[b].mat, self.calibrated[b].mat), 4),
                "mat_uncalibrated": round(self.best[b].mat, 4),
                "mat_calibrated": round(self.calibrated[b].mat, 4),
                "mat_default_config": round(self.baseline[b].mat, 4),
                "draft_us_per_call": round(self.best[b].draft_us, 2),
            }
        return {
            "format": CALIBRATION_FORMAT,
            "version": CALIBRATION_VERSION,
            "created_unix": int(time.time()),
            "default_budget": self.default_budget,
            "budgets": budgets,
            "calibration": self.calibration.to_dict(),
            "fingerprint": fingerprint.to_dict() if fingerprint else None,
            **({"sources": self.sources} if self.sources else {}),
            **provenance,
            "grid": [t.row() for t in self.search.trials],
            "seconds": round(self.seconds, 1),
        }


def calibrate(
    examples: Sequence[Example],
    datastore: sssd.Datastore,
    budgets: Sequence[int],
    axes: GridAxes,
    default_budget: int | None = None,
    workers: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> CalibrationRun:
    """Runs steps 1-3 of the module docstring."""
    if not examples:
        raise ValueError("no examples to calibrate on (empty prompt set or split)")
    budgets = sorted(set(int(b) for b in budgets))
    if not budgets or budgets[0] < 1:
        raise ValueError(f"budgets must be >= 1, got {budgets}")
    default_budget = default_budget or (32 if 32 in budgets else budgets[-1])
    t0 = time.perf_counter()
    path = str(datastore.path)
    search = staged_search(examples, path, budgets, axes, workers=workers, progress=progress)
    best = {b: search.best(b) for b in budgets}

    # Curves from every budget's best setting (observations pooled).
    nodes: dict[str, list] = {}
    for i, b in enumerate(budgets):
        drafter = sssd.Drafter(datastore, best[b].config.replace(budget=b))
        res = replay(drafter, examples, b, record_nodes=True)
        for k, v in res.nodes.items():
            nodes.setdefault(k, []).append(v)
        if progress:
            progress("recording drafts for calibration", i + 1, len(budgets))
    pooled = {k: np.concatenate(v) for k, v in nodes.items()}
    cal = fit_calibration(pooled)
    before = reliability(pooled, "prob")
    after = reliability({**pooled, "prob": apply_calibration(cal, pooled)}, "prob")

    with_cal = [
        Trial(
            replace(best[b].config, discounts=replace(best[b].config.discounts, calibration=cal)), b, stage="calibrated"
        )
        for b in budgets
    ]
    baseline = [Trial(DrafterConfig(), b, stage="default config") for b in budgets]
    evaluate(
        with_cal + baseline,
        examples,
        path,
        workers,
        (lambda d, t: progress("calibrated and default replays", d, t)) if progress else None,
    )
    search.trials += with_cal + baseline
    return CalibrationRun(
        budgets,
        default_budget,
        search,
        best,
        {t.budget: t for t in with_cal},
        {t.budget: t for t in baseline},
        cal,
        before,
        after,
        time.perf_counter() - t0,
    )


def save(run: CalibrationRun, path: Path, provenance: dict, fingerprint: Fingerprint | None = None) -> list[Path]:
    """Writes the parameter file (with `fingerprint`) and its plots; returns the paths written."""
    from sssd.calibration.plots import mat_vs_budget_plot, reliability_plot

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(run.to_dict(provenance, fingerprint), indent=1) + "\n")
    tmp.replace(path)
    stem = path.with_suffix("")
    rel = reliability_plot(
        run.reliability_before,
        run.reliability_after,
        stem.with_name(stem.name + ".reliability.png"),
        "Source probability vs acceptance (replay of the development split)",
    )
    series = {
        "default config": {b: t.mat for b, t in run.baseline.items()},
        "grid best": {b: t.mat for b, t in run.best.items()},
        "grid best + calibration": {b: t.mat for b, t in run.calibrated.items()},
    }
    mvb = mat_vs_budget_plot(
        series, stem.with_name(stem.name + ".mat_vs_budget.png"), "MAT vs budget (development split)"
    )
    return [path, rel, mvb]
