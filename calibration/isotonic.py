"""Isotonic regression (pool adjacent violators) for calibration curves."""

from __future__ import annotations

import numpy as np


def isotonic_fit(x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None, max_knots: int = 32):
    """Monotone non-decreasing least-squares fit of y on x.

    Args:
        x: predictions (e.g. source probabilities).
        y: outcomes in [0, 1] (e.g. accepted or not).
        w: weights (default 1).
        max_knots: the fitted step function's blocks are merged down to at
            most this many (by neighbouring x), keeping it small.

    Returns:
        (knots, values): increasing knots (block mean x) and non-decreasing
        values (block mean y), for linear interpolation between knots.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    w = np.ones_like(x) if w is None else np.asarray(w, dtype=np.float64)
    if x.size == 0:
        raise ValueError("isotonic_fit needs at least one point")
    # Aggregate equal predictions first (probabilities are count ratios, so
    # they repeat a lot): the pooling loop then runs over distinct values.
    x, inverse = np.unique(x, return_inverse=True)
    sw_all = np.bincount(inverse, weights=w)
    y = np.bincount(inverse, weights=w * y) / sw_all
    w = sw_all
    # Pool adjacent violators over blocks (sum_w, sum_wy, sum_wx).
    sw, swy, swx = [], [], []
    for xi, yi, wi in zip(x, y, w):
        sw.append(wi)
        swy.append(wi * yi)
        swx.append(wi * xi)
        while len(sw) > 1 and swy[-2] / sw[-2] > swy[-1] / sw[-1]:
            b_w, b_y, b_x = sw.pop(), swy.pop(), swx.pop()
            sw[-1] += b_w
            swy[-1] += b_y
            swx[-1] += b_x
    sw, swy, swx = np.array(sw), np.array(swy), np.array(swx)
    # Merge neighbouring blocks (monotonicity is preserved) down to max_knots.
    while len(sw) > max_knots:
        i = int(np.argmin(sw[:-1] + sw[1:]))
        sw[i] += sw[i + 1]
        swy[i] += swy[i + 1]
        swx[i] += swx[i + 1]
        sw, swy, swx = np.delete(sw, i + 1), np.delete(swy, i + 1), np.delete(swx, i + 1)
    knots = swx / sw
    values = swy / sw
    # Blocks can share a mean x after pooling ties: keep knots strictly increasing.
    keep = np.concatenate([[True], np.diff(knots) > 1e-12])
    knots, values = knots[keep], np.maximum.accumulate(values[keep])
    return knots, values
