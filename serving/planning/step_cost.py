"""A step's seconds as a line in the tokens it verifies, fitted from measured steps: the cost model
where no forward profile is at hand (inside vLLM)."""

from __future__ import annotations

import numpy as np


class MeasuredStepCost:
    """Seconds of a step as a + b x (tokens it verifies), fitted from measured steps (exponentially
    forgotten least squares, shrunk toward a prior): the cost model where no forward profile is at
    hand, as inside vLLM, whose forward the proposer only sees as the time between its calls.

    A step that takes more than ``outlier`` times what the fit predicts, once it has seen
    ``settle`` steps, is left out: it did something besides verifying (a prompt's chunk the caller
    could not see, a pause). One such step at 40 tokens and 2.1 s among decode steps of 16 tokens
    and 0.11 s set the slope at 44 ms a token (the intercept at 0): the proposer then sent nothing,
    so every later step had 16 tokens and could not move the slope back. A run of ``settle`` such
    steps is taken as the machine having slowed: the fit starts over from the last of them.

    Args:
        per_token: the prior's b / a: what one more verified token costs in passes (1/64: on an
            accelerator a pass of 64 tokens costs about two of one).
        prior_steps: weight of the prior, in steps.
    """

    def __init__(
        self,
        per_token: float = 1 / 64,
        prior_steps: float = 4.0,
        decay: float = 0.98,
        outlier: float = 4.0,
        settle: int = 8,
    ):
        self.per_token, self.prior_steps, self.decay = float(per_token), float(prior_steps), float(decay)
        self.outlier, self.settle = float(outlier), int(settle)
        self.s = np.zeros(5)  # decayed sums: n, x, y, xx, xy
        self.steps = 0
        self.outliers = 0  # steps left out as outliers
        self._run = 0  # consecutive outliers

    def observe(self, tokens: int, seconds: float) -> bool:
        """Fits one step; False if it was left out (not a time, or an outlier)."""
        if not (seconds > 0 and np.isfinite(seconds)):
            return False
        x = float(tokens)
        if self.steps >= self.settle and seconds > self.outlier * float(self(x)):
            self._run += 1
            self.outliers += 1
            if self._run < self.settle:
                return False
            self.s[:] = 0.0  # the machine changed: start over from this step
            self.steps = 0
        self._run = 0
        self.s = self.decay * self.s + np.array([1.0, x, seconds, x * x, x * seconds])
        self.steps += 1
        return True

    def coefficients(self) -> tuple[float, float]:
        n, sx, sy, sxx, sxy = self.s
        if n <= 0:
            return 1.0, self.per_token  # relative units until a step is seen: only ratios matter
        mx, my = sx / n, sy / n
        a0 = my / (1.0 + self.per_token * mx)  # the prior through the mean step, with the prior's slope
        w = self.prior_steps
        # least squares of y = a + b x with w pseudo-steps of the prior half a spread either side of
        # the mean step (at least half a token): they leave the centroid where the steps put it and
        # weigh on the slope as w / 4 measured steps do. (At mx and mx + 64 their leverage outweighed
        # 100 steps of 5-36 tokens: inside vLLM the fit stayed near the prior's 0.2 per token where
        # the steps measured 0.07.)
        sd = max(float(np.sqrt(max(sxx / n - mx * mx, 0.0))), 1.0)
        xs = np.array([mx - 0.5 * sd, mx + 0.5 * sd])
        ys = a0 * (1.0 + self.per_token * xs)
        N = n + w
        Sx, Sy = sx + 0.5 * w * xs.sum(), sy + 0.5 * w * ys.sum()
        Sxx, Sxy = sxx + 0.5 * w * (xs**2).sum(), sxy + 0.5 * w * (xs * ys).sum()
        den = N * Sxx - Sx * Sx
        b = (N * Sxy - Sx * Sy) / den if den > 0 else a0 * self.per_token
        b = max(b, 0.0)
        a = max((Sy - b * Sx) / N, 1e-9)
        return a, b

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        a, b = self.coefficients()
        return a + b * np.asarray(tokens, dtype=np.float64)
