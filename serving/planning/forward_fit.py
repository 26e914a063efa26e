"""A batch size's forward-pass seconds, fitted online from the engine's own measured steps.

The allocation (planning/allocation.py) prices every candidate selection of draft nodes by the
forward pass it would take. A forward profile (planning/profile.py) is measured once, over chains
at a short context; the steps the engine then runs differ from it in three ways that a step's
measured time shows (SmolLM2-135M, mixed traffic, AMD EPYC 2 cores, 2026-11-28: the line in tokens
alone predicted speculative steps 4-8% short at batch 4 and 16):

- **the context**: each row's cached keys and values are read once a pass, whatever its tokens, so
  a batch of long prompts costs more per pass than one of short ones (at batch 16, rows of ~1,000
  cached positions: ~30 ms per thousand cached positions over the batch);
- **drafting at all**: a pass that verifies any draft builds tree masks and splits attention into
  ragged parts, a fixed cost a line through tokens alone spreads over its slope;
- **the machine's pace**, which drifts over minutes (other processes, frequency, caches).

So the fit is

    seconds = level x (a + b x N + c x C + j x D)

with N the tokens verified (rows + draft nodes), C the rows' cached positions in thousands, and D 1
when the pass verifies any draft. a, b, c, j: least squares over the bucket's steps, forgotten by
``decay`` a step, the slopes shrunk toward a prior (b the profile's per-token cost at this batch
size, c = j = 0) as ``prior_steps / 4`` measured steps would pull them, and the intercept left free (it takes
the steps' mean). ``level``: the measured over the fitted seconds of the last few steps (an
exponential mean by ``level_decay``), which follows the drift the slower fit would lag. Replayed on
the measured steps above: 0.97-1.00 predicted over measured, where the line had 0.92-0.94.

A step that takes more than ``outlier`` times the prediction, once ``settle`` steps are in, is left
out (it did something besides verifying: a pause, a neighbour's burst); a run of ``settle`` of them
means the machine changed, and the fit starts over.
"""

from __future__ import annotations

import numpy as np

#: Features: tokens verified, cached positions (thousands), any draft verified (0/1).
FEATURES = ("tokens", "cached_k", "drafted")
#: A feature's spread is taken as at least this (its variance), so that a feature that never moved
#: keeps its prior slope instead of being fitted from nothing.
MIN_VARIANCE = np.array([1.0, 0.01, 0.25])


def features(tokens, cached, drafted) -> np.ndarray:
    """[..., 3] feature rows for arrays (or scalars) of tokens, cached positions and draft nodes."""
    tokens = np.asarray(tokens, dtype=np.float64)
    cached = np.broadcast_to(np.asarray(cached, dtype=np.float64) / 1000.0, tokens.shape)
    drafted = np.broadcast_to(np.asarray(drafted, dtype=np.float64) > 0, tokens.shape).astype(np.float64)
    return np.stack([tokens, cached, drafted], axis=-1)


class ForwardFit:
    """Forward seconds of one batch-size bucket (see the module docstring).

    Args:
        per_token: the prior slope b (seconds per verified token; the profile's at this batch size).
        prior_steps: the prior's weight, in steps, on each slope.
        decay: weight of the past in the fit, per observed step.
        level_decay: weight of the past in the level, per observed step.
    """

    def __init__(
        self,
        per_token: float,
        prior_steps: float = 4.0,
        decay: float = 0.98,
        level_decay: float = 0.8,
        outlier: float = 4.0,
        settle: int = 8,
    ):
        self.prior = np.array([max(float(per_token), 0.0), 0.0, 0.0])
        self.prior_steps, self.decay, self.level_decay = float(prior_steps), float(decay), float(level_decay)
        self.outlier, self.settle = float(outlier), int(settle)
        self.steps = 0
        self.outliers = 0
        self.level = 1.0
        self._run = 0
        self._reset()

    def _reset(self) -> None:
        d = len(FEATURES)
        self.n = 0.0
        self.sx = np.zeros(d)
        self.sy = 0.0
        self.sxx = np.zeros((d, d))
        self.sxy = np.zeros(d)
        self.steps = 0
        self.level = 1.0

    def coefficients(self) -> np.ndarray:
        """[a, b, c, j]: intercept, per token, per thousand cached positions, for drafting at all."""
        if self.n <= 0:
            return np.concatenate([[0.0], self.prior])
        m, my = self.sx / self.n, self.sy / self.n
        S = self.sxx / self.n - np.outer(m, m)  # the features' (decayed) covariance
        Sy = self.sxy / self.n - m * my
        # the prior as prior_steps pseudo-steps half a spread either side of the mean step, per feature
        # (as MeasuredStepCost's): they weigh on a slope as prior_steps / 4 measured steps do
        lam = 0.25 * self.prior_steps / self.n * np.maximum(np.diag(S), MIN_VARIANCE)
        beta = np.linalg.solve(S + np.diag(lam), Sy + lam * self.prior)
        beta[:2] = np.maximum(beta[:2], 0.0)  # more tokens or more context never cost less
        return np.concatenate([[my - float(m @ beta)], beta])

    def fitted(self, x: np.ndarray) -> np.ndarray:
        """The fit's seconds at feature rows x, before the level."""
        c = self.coefficients()
        return np.maximum(c[0] + x @ c[1:], 1e-6)

    def __call__(self, tokens, cached=None, drafted=None) -> np.ndarray:
        """Predicted seconds. `cached` None: the recent steps' mean; `drafted` None: whether tokens
        holds any beyond the mean step's rows is not known, so 1 (a speculative step)."""
        if cached is None:
            cached = 1000.0 * self.sx[1] / self.n if self.n > 0 else 0.0
        if drafted is None:
            drafted = 1
        return self.level * self.fitted(features(tokens, cached, drafted))

    def observe(self, tokens: int, cached: int, drafted: int, seconds: float) -> bool:
        """Fits one measured forward pass; False if it was left out (not a time, or an outlier)."""
        if not (seconds > 0 and np.isfinite(seconds)):
            return False
        x = features(tokens, cached, drafted)
        if self.steps:
            predicted = float(self.level * self.fitted(x))
            if self.steps >= self.settle and seconds > self.outlier * predicted:
                self._run += 1
                self.outliers += 1
                if self._run < self.settle:
                    return False
                self._reset()  # the machine changed: start over from this step
            elif self.steps >= self.settle:
                ratio = float(np.clip(seconds / (predicted / self.level), 0.5, 2.0))
                self.level = self.level_decay * self.level + (1 - self.level_decay) * ratio
        self._run = 0
        d = self.decay
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + np.outer(x, x)
        self.sxy = d * self.sxy + x * seconds
        self.steps += 1
        return True
