"""Projecting the batch allocation from replayed steps (`sssd plan --groundtruth`).

A batch of B is B replayed steps (calibration/allocation_replay.py: a tree's scores and parents,
and the tokens accepted when its first k nodes are verified) drawn at random; the allocation
decides each row's prefix under a forward-cost profile, and the step yields B bonus tokens plus
what those prefixes accept. Averaged over many draws: the allocation's speedup at batch B.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sssd.serving.planning.acceptance import CENTERS, binned, fit_gamma, trials, worth
from sssd.serving.planning.allocation import BatchAllocator, select


def fitted_gamma(steps) -> float:
    """The mode's gamma over every replayed node verified (each tree whole)."""
    n = np.zeros(len(CENTERS))
    a = np.zeros(len(CENTERS))
    for s, p, acc in zip(steps.scores, steps.parents, steps.accepted):
        if not s.size:
            continue
        on_path = _on_path(p, acc[-1], acc)
        c, y = trials(s, p, on_path)
        bn, ba = binned(c, y)
        n += bn
        a += ba
    return float(fit_gamma(n, a)[0]) if n.sum() else 1.0


def _on_path(parents: np.ndarray, deepest: int, accepted: np.ndarray) -> np.ndarray:
    """Which nodes are on the accepted path: the node where `accepted` first reaches `deepest`,
    and its ancestors."""
    on = np.zeros(parents.size, dtype=bool)
    if deepest <= 0:
        return on
    node = int(np.argmax(accepted[1:] == deepest))
    while node >= 0:
        on[node] = True
        node = int(parents[node])
    return on


#: Rounds of the projection's (damped) fixed point for the worth correction.
PROJECT_RATIO_ROUNDS = 8


def project(
    steps,
    profile,
    batches: Sequence[int],
    draws: int = 200,
    seed: int = 0,
    gamma: float | None = None,
) -> list[dict]:
    """Per batch size: the allocation's mean draft nodes per row, tokens per row and step, and
    speedup over plain decoding under `profile` (tokens per second over plain's), with the worth
    correction the engine would settle at (`worth_correction`: the selected nodes' emitted tokens
    over their expected ones); beside it, the best single budget for every row on the same steps
    (the per-size planner's choice)."""
    if not len(steps):
        raise ValueError("no replayed steps to project from (empty or one-token outputs)")
    g = fitted_gamma(steps) if gamma is None else float(gamma)
    rng = np.random.default_rng(seed)
    longest = max(len(a) for a in steps.accepted)
    # the same steps under one budget b for every row: mean accepted tokens at each b
    per_budget = np.mean([np.concatenate([a, np.full(longest - len(a), a[-1])]) for a in steps.accepted], axis=0)
    # every replayed tree's worth, and the sums of its prefixes as the selection takes them
    # (non-increasing): what a selection of c nodes of it expects
    values_of = [worth(s, g) for s in steps.scores]
    expects_of = [np.concatenate([[0.0], np.cumsum(np.minimum.accumulate(v))]) for v in values_of]
    rows = []
    for B in batches:
        plain = float(profile.times(B, np.array([1.0]))[0])
        b_all = np.arange(longest)
        uniform = (1.0 + per_budget) / (profile.times(B, 1.0 + b_all) / plain)
        b_best = int(np.argmax(uniform))

        def cost(ks, B=B):
            return profile.times(B, (B + np.asarray(ks, dtype=np.float64)) / B)

        n_draws = max(draws, 4096 // B)  # about as many rows at every batch size (accepted lengths are heavy-tailed)
        batches_of = [rng.integers(len(steps), size=B) for _ in range(n_draws)]
        # The engine's winner's-curse correction (BatchAllocator's worth ratio): the selected nodes'
        # worth is scaled by what such selections emitted over what they expected, a fixed point
        # found on these same draws.
        ratio = 1.0
        for round_ in range(PROJECT_RATIO_ROUNDS):
            tokens = seconds = nodes = expected = 0.0
            for idx in batches_of:
                counts, k = select([ratio * values_of[i] for i in idx], cost, B)
                emitted = sum(int(steps.accepted[i][c]) for i, c in zip(idx, counts))
                tokens += B + emitted
                seconds += float(cost(np.array([k]))[0])
                nodes += k
                expected += sum(float(expects_of[i][c]) for i, c in zip(idx, counts))
            if not expected:
                break  # nothing selected: the engine learns nothing new either, and keeps its ratio
            new = float(np.clip((tokens - B * n_draws) / expected, *BatchAllocator.RATIO_RANGE))
            if abs(new - ratio) < 0.01 or round_ == PROJECT_RATIO_ROUNDS - 1:
                break  # (the figures above are this ratio's)
            ratio = float(np.sqrt(ratio * new))  # damped, as the engine's decayed sums are
        rate = tokens / seconds
        rows.append(
            {
                "batch": B,
                "nodes_per_row": round(nodes / (n_draws * B), 2),
                "tokens_per_row_step": round(tokens / (n_draws * B), 3),
                "speedup": round(rate / (B / plain), 3),
                "gamma": round(g, 3),
                "worth_correction": round(ratio, 3),
                "per_size_budget": b_best,
                "per_size_speedup": round(float(uniform[b_best]), 3),
            }
        )
    return rows
