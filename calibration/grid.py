"""Grid search over drafter parameters, scored by replay MAT.

The search is staged so that its size stays sane: first the datastore query
parameters (M, backoff threshold, branch length, adaptive depth, match
boost) under the default discounts, then the discounts (input-source scale, damping by match length
and by depth, datastore match damping) under each budget's best query
parameters, then the copy source's knobs (its prior rate, shortest repeat,
exclusion of the other sources) under each budget's best so far. Every setting is replayed at every budget; replays run in
worker processes (the datastore is memory-mapped, so they share it).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from sssd.calibration.replay import Example, replay
from sssd.config import DiscountParams, DrafterConfig, SourceDiscount


@dataclass(frozen=True)
class GridAxes:
    """Values tried for each parameter (a CLI flag each, nargs="+")."""

    max_samples: tuple[int, ...] = (32, 100)
    min_occurrences: tuple[int, ...] = (5, 20, 50)
    datastore_branch_len: tuple[int, ...] = (8, 16)
    datastore_branch_per_match: tuple[float, ...] = (0.0, 4.0)
    match_boost: tuple[float, ...] = (1.0, 1.5)
    input_scale: tuple[float, ...] = (0.3, 0.6, 1.0)
    input_match_damping: tuple[float, ...] = (0.5, 0.8)
    input_depth_decay: tuple[float, ...] = (0.9, 1.0)
    datastore_match_damping: tuple[float, ...] = (0.7, 0.85, 1.0)
    copy_rate: tuple[float, ...] = (0.7, 0.9, 0.97)
    copy_min_match: tuple[int, ...] = (6, 8, 12)
    copy_exclusion: tuple[float, ...] = (0.5, 1.0)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not getattr(self, f.name):
                raise ValueError(f"grid axis {f.name} is empty")

    def query_points(self, base: DrafterConfig) -> list[DrafterConfig]:
        return [
            base.replace(
                max_samples=m, min_occurrences=t, datastore_branch_len=b, datastore_branch_per_match=g, match_boost=w
            )
            for m, t, b, g, w in itertools.product(
                self.max_samples,
                self.min_occurrences,
                self.datastore_branch_len,
                self.datastore_branch_per_match,
                self.match_boost,
            )
        ]

    def discount_points(self, base: DrafterConfig) -> list[DrafterConfig]:
        d = base.discounts
        out = []
        for scale, mdamp, ddecay, dsdamp in itertools.product(
            self.input_scale, self.input_match_damping, self.input_depth_decay, self.datastore_match_damping
        ):
            disc = DiscountParams(
                datastore=dataclasses.replace(d.datastore, match_damping=dsdamp),
                input=SourceDiscount(
                    scale=scale, depth_decay=ddecay, match_damping=mdamp, full_match=d.input.full_match
                ),
                external=d.external,
            )
            out.append(base.replace(discounts=disc))
        return out

    def copy_points(self, base: DrafterConfig) -> list[DrafterConfig]:
        return [
            base.replace(copy_rate=r, copy_min_match=m, copy_exclusion=x)
            for r, m, x in itertools.product(self.copy_rate, self.copy_min_match, self.copy_exclusion)
        ]

    def size(self) -> int:
        q = (
            len(self.max_samples)
            * len(self.min_occurrences)
            * len(self.datastore_branch_len)
            * len(self.datastore_branch_per_match)
            * len(self.match_boost)
        )
        d = (
            len(self.input_scale)
            * len(self.input_match_damping)
            * len(self.input_depth_decay)
            * len(self.datastore_match_damping)
        )
        c = len(self.copy_rate) * len(self.copy_min_match) * len(self.copy_exclusion)
        return q + d + c


@dataclass
class Trial:
    """One replay: a configuration at a budget, and what it scored."""

    config: DrafterConfig
    budget: int
    mat: float = float("nan")
    draft_us: float = float("nan")
    stage: str = ""

    def row(self) -> dict[str, Any]:
        c = self.config
        return {
            "stage": self.stage,
            "budget": self.budget,
            "mat": round(self.mat, 4),
            "draft_us": round(self.draft_us, 2),
            "max_samples": c.max_samples,
            "min_occurrences": c.min_occurrences,
            "datastore_branch_len": c.datastore_branch_len,
            "datastore_branch_per_match": c.datastore_branch_per_match,
            "match_boost": c.match_boost,
            "input_scale": c.discounts.input.scale,
            "input_match_damping": c.discounts.input.match_damping,
            "input_depth_decay": c.discounts.input.depth_decay,
            "datastore_match_damping": c.discounts.datastore.match_damping,
            "copy_rate": c.copy_rate,
            "copy_min_match": c.copy_min_match,
            "copy_exclusion": c.copy_exclusion,
            "calibrated": c.discounts.calibration is not None,
        }


# -- worker processes ----------------------------------------------------------------
_examples: Sequence[Example] = ()
_datastore = None


def _init(examples: Sequence[Example], datastore_path: str) -> None:
    global _examples, _datastore
    import sssd

    _examples = examples
    _datastore = sssd.Datastore.open(datastore_path)


def _run(task: tuple[DrafterConfig, int]) -> tuple[float, float]:
    import sssd

    config, budget = task
    drafter = sssd.Drafter(_datastore, config.replace(budget=budget, num_threads=1))
    res = replay(drafter, _examples, budget)
    return res.mat, res.draft_us_per_call


def evaluate(
    trials: list[Trial],
    examples: Sequence[Example],
    datastore_path: str | Path,
    workers: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> list[Trial]:
    """Replays every trial (in `workers` processes; 0: one per core) and fills in its MAT."""
    if not trials:
        raise ValueError("no grid points to evaluate")
    if not examples:
        raise ValueError("no examples to replay")
    workers = workers or os.cpu_count() or 1
    tasks = [(t.config, t.budget) for t in trials]
    if workers == 1:
        _init(examples, str(datastore_path))
        results = []
        for i, task in enumerate(tasks):
            results.append(_run(task))
            if progress:
                progress(i + 1, len(tasks))
    else:
        ctx = mp.get_context("spawn")  # fork after OpenMP has started threads can hang the child
        with ctx.Pool(workers, initializer=_init, initargs=(examples, str(datastore_path))) as pool:
            results = []
            for i, r in enumerate(pool.imap(_run, tasks)):
                results.append(r)
                if progress:
                    progress(i + 1, len(tasks))
    for t, (mat, us) in zip(trials, results):
        t.mat, t.draft_us = mat, us
    return trials


#: MATs closer than this (relative) to the best are ties, broken towards the base config.
TIE = 1e-3


def _leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            out.update(_leaves(getattr(obj, f.name), f"{prefix}{f.name}."))
        return out
    return {prefix: obj}


def changes_from(config: DrafterConfig, base: DrafterConfig) -> int:
    """How many parameters (nested ones included) of `config` differ from `base`."""
    a, b = _leaves(config), _leaves(base)
    return sum(a[k] != b.get(k) for k in a)


@dataclass
class SearchResult:
    trials: list[Trial] = field(default_factory=list)
    base: DrafterConfig = field(default_factory=DrafterConfig)

    def best(self, budget: int) -> Trial:
        """The trial with the highest MAT at `budget`; among those within TIE of it, the one
        that changes the fewest parameters of the base config: the development data has not
        shown the others to be better, so the defaults stand."""
        at = [t for t in self.trials if t.budget == budget]
        if not at:
            raise KeyError(f"no trials at budget {budget}")
        top = max(t.mat for t in at)
        tied = [t for t in at if t.mat >= top * (1 - TIE)]
        return min(tied, key=lambda t: (changes_from(t.config, self.base), -t.mat))


def staged_search(
    examples: Sequence[Example],
    datastore_path: str | Path,
    budgets: Sequence[int],
    axes: GridAxes,
    base: DrafterConfig | None = None,
    workers: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> SearchResult:
    """Query parameters first, then discounts, then the copy source; returns every trial."""
    if not budgets:
        raise ValueError("no budgets to calibrate for")
    base = base or DrafterConfig()
    result = SearchResult(base=base)
    stage1 = [Trial(c, b, stage="query") for b in budgets for c in axes.query_points(base)]
    evaluate(
        stage1,
        examples,
        datastore_path,
        workers,
        (lambda d, t: progress("query parameters", d, t)) if progress else None,
    )
    result.trials += stage1
    stage2 = []
    for b in budgets:
        best_query = result.best(b).config
        stage2 += [Trial(c, b, stage="discounts") for c in axes.discount_points(best_query)]
    evaluate(
        stage2, examples, datastore_path, workers, (lambda d, t: progress("discounts", d, t)) if progress else None
    )
    result.trials += stage2
    stage3 = []
    for b in budgets:
        stage3 += [Trial(c, b, stage="copy") for c in axes.copy_points(result.best(b).config)]
    evaluate(
        stage3, examples, datastore_path, workers, (lambda d, t: progress("copy source", d, t)) if progress else None
    )
    result.trials += stage3
    return result
