"""Fitting calibration curves from replayed drafts.

Every drafted node is an observation: its source, depth, matched context
length and raw source probability, and whether its whole path matched the
target's output (so the target would have accepted it). For each source and
(match-length bin, depth bin) with enough observations, an isotonic fit maps
raw probability to observed acceptance; sparse cells fall back to the
source's (depth bin) curve, then to the source's overall curve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sssd.calibration.isotonic import isotonic_fit
from sssd.config import SOURCE_COPY, SOURCE_NAMES, Calibration

#: Lower edges of the bins (match lengths from 0, depths from 1).
MATCH_BINS = (0, 1, 2, 3, 4, 6, 9, 13)
DEPTH_BINS = (1, 2, 3, 4, 6, 9, 13)
#: Observations a cell needs before it gets its own curve.
MIN_CELL = 400


@dataclass
class Reliability:
    """Predicted vs observed acceptance in probability bins, per source (for plots)."""

    source: str
    predicted: np.ndarray  # mean predicted probability per bin
    observed: np.ndarray  # observed acceptance per bin
    count: np.ndarray  # observations per bin


def reliability(nodes: dict[str, np.ndarray], score_key: str = "prob", bins: int = 12) -> list[Reliability]:
    """Reliability diagram data: per source, predictions binned (quantiles) vs outcomes."""
    out = []
    for s, name in SOURCE_NAMES.items():
        sel = nodes["source"] == s
        if sel.sum() < 10:
            continue
        x = nodes[score_key][sel].astype(np.float64)
        y = nodes["accepted"][sel].astype(np.float64)
        edges = np.unique(np.quantile(x, np.linspace(0, 1, bins + 1)))
        idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, max(len(edges) - 2, 0))
        count = np.bincount(idx, minlength=len(edges) - 1)
        keep = count > 0
        pred = np.bincount(idx, weights=x, minlength=len(edges) - 1)[keep] / count[keep]
        obs = np.bincount(idx, weights=y, minlength=len(edges) - 1)[keep] / count[keep]
        out.append(Reliability(name, pred, obs, count[keep]))
    return out


def fit_calibration(nodes: dict[str, np.ndarray], min_cell: int = MIN_CELL, max_knots: int = 24) -> Calibration:
    """Isotonic curves per (source, match bin, depth bin), with fallbacks for sparse cells.

    Args:
        nodes: replay observations: source, depth, match_len, prob, accepted arrays.
        min_cell: observations below which a cell borrows a coarser curve.
    """
    if len(nodes.get("prob", ())) == 0:
        raise ValueError("no drafted nodes to calibrate on")
    src = nodes["source"].astype(np.int64)
    mbin = np.searchsorted(MATCH_BINS, nodes["match_len"].astype(np.int64), side="right") - 1
    dbin = np.searchsorted(DEPTH_BINS, nodes["depth"].astype(np.int64), side="right") - 1
    prob = nodes["prob"].astype(np.float64)
    acc = nodes["accepted"].astype(np.float64)
    curves = []
    for s in SOURCE_NAMES:
        if s == SOURCE_COPY:
            continue  # ranked by its own rate (the request's evidence), never by a curve
        in_src = src == s
        if in_src.sum() == 0:
            continue
        overall = isotonic_fit(prob[in_src], acc[in_src], max_knots=max_knots)
        for d in range(len(DEPTH_BINS)):
            in_d = in_src & (dbin == d)
            by_depth = isotonic_fit(prob[in_d], acc[in_d], max_knots=max_knots) if in_d.sum() >= min_cell else overall
            for m in range(len(MATCH_BINS)):
                cell = in_d & (mbin == m)
                knots, values = (
                    isotonic_fit(prob[cell], acc[cell], max_knots=max_knots) if cell.sum() >= min_cell else by_depth
                )
                curves.append((s, m, d, tuple(float(v) for v in knots), tuple(float(v) for v in values)))
    return Calibration(MATCH_BINS, DEPTH_BINS, tuple(curves))


def apply_calibration(cal: Calibration, nodes: dict[str, np.ndarray]) -> np.ndarray:
    """The calibrated probability of every observation (for reliability checks)."""
    table = {(s, m, d): (np.asarray(x), np.asarray(y)) for s, m, d, x, y in cal.curves}
    src = nodes["source"].astype(np.int64)
    mbin = np.searchsorted(cal.match_bins, nodes["match_len"].astype(np.int64), side="right") - 1
    dbin = np.searchsorted(cal.depth_bins, nodes["depth"].astype(np.int64), side="right") - 1
    out = nodes["prob"].astype(np.float64).copy()
    keys = (src * 1000 + mbin) * 1000 + dbin
    for key in np.unique(keys):
        s, rest = divmod(int(key), 1_000_000)
        m, d = divmod(rest, 1000)
        if (s, m, d) in table:
            x, y = table[(s, m, d)]
            sel = keys == key
            out[sel] = np.interp(out[sel], x, y)
    return out
