"""Goodness-of-fit checks for sampled output: is what an engine sampled distributed as the target
model says? Shared by every test of lossless sampling."""

from __future__ import annotations

from scipy import stats

#: Below this many expected draws a sequence joins the "anything else" cell: the chi-square
#: approximation needs about that many per cell (a sequence expected 0.1 times and drawn once
#: would alone give p < 1e-3, and fail a correct sampler about one run in a hundred).
MIN_EXPECTED = 5.0


def sequence_pvalue(outs, joint: dict, min_expected: float = MIN_EXPECTED) -> float:
    """Chi-square p-value of the outputs' token sequences against `joint` (sequence -> probability
    under the target; the sequences it leaves out, and those expected fewer than `min_expected`
    times, are pooled into one cell)."""
    n = len(outs)
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    keys = [k for k in joint if joint[k] * n >= min_expected]
    observed = [counts.get(k, 0) for k in keys] + [n - sum(counts.get(k, 0) for k in keys)]
    expected = [joint[k] * n for k in keys] + [(1 - sum(joint[k] for k in keys)) * n]
    return float(stats.chisquare(observed, expected).pvalue)
