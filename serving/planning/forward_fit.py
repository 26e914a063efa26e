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
means the machine changed, and the fit starts over. A step longer (in tokens) than any fitted so far
is always fitted and never moves the level: its prediction was an extrapolation, and what it
measures is the slope, not the machine. The slopes are >= 0 (more tokens, more context or drafting
at all never cost less; ``nonnegative_solve``).
"""

from __future__ import annotations

import numpy as np

#: Features: tokens verified, cached positions (thousands), any draft verified (0/1).
FEATURES = ("tokens", "cached_k", "drafted")
#: A feature's spread is taken as at least this (its variance), so that a feature that never moved
#: keeps its prior slope instead of being fitted from nothing. For the tokens, eight either side:
#: plain passes of 3 and 4 rows (a batch-4 bucket) say nothing of what 260 tokens cost, and with a
#: floor of one token their noise alone set the slope to 0 (2026-11-30). For the context, half a thousand
#: positions: steps whose contexts span a few dozen (a batch-1 bucket in one request's answer) read
#: the machine's noise as a slope (257 ms per thousand cached positions at batch 1 on code edits,
#: 2026-11-30, where 0.01 was the floor).
MIN_VARIANCE = np.array([64.0, 0.25, 0.25])


def features(tokens, cached, drafted) -> np.ndarray:
    """[..., 3] feature rows for arrays (or scalars) of tokens, cached positions and draft nodes."""
    tokens = np.asarray(tokens, dtype=np.float64)
    cached = np.broadcast_to(np.asarray(cached, dtype=np.float64) / 1000.0, tokens.shape)
    drafted = np.broadcast_to(np.asarray(drafted, dtype=np.float64) > 0, tokens.shape).astype(np.float64)
    return np.stack([tokens, cached, drafted], axis=-1)


def nonnegative_solve(A: np.ndarray, r: np.ndarray) -> np.ndarray:
    """argmin over beta >= 0 of beta'A beta - 2 r'beta (A positive definite): more tokens, more
    context or drafting at all never cost less. Solved exactly by trying every set of free slopes
    (the others held at 0) and keeping the best that is feasible; the features are few.

    Clipping the unconstrained solution instead leaves the other slopes fitted beside a negative
    one: at batch 2 on code edits (2026-11-30) the unconstrained fit came out at -53 ms + 8.5 ms a
    token + 100 ms per thousand cached positions - 286 ms for drafting at all, and priced 28-token
    passes that took 150-220 ms at 3 ms, so the allocation took every node it was offered."""
    full = np.linalg.solve(A, r)
    if (full >= 0).all():  # the unconstrained optimum is feasible: it is the constrained one (one solve, not 7)
        return full
    d = len(r)
    best, best_value = np.zeros(d), 0.0  # nothing free: beta = 0, objective 0
    for mask in range(1, 1 << d):
        free = [i for i in range(d) if mask >> i & 1]
        sub = np.linalg.solve(A[np.ix_(free, free)], r[free])
        if (sub < 0).any():
            continue
        value = -float(r[free] @ sub)  # the objective at the subproblem's optimum
        if value < best_value:
            best_value, best = value, np.zeros(d)
            best[free] = sub
    return best


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
        self.max_tokens = 0  # the longest pass fitted
        self.level = 1.0
        self._coefficients: np.ndarray | None = None  # solved once per observed step, not per prediction

    def coefficients(self) -> np.ndarray:
        """[a, b, c, j]: intercept, per token, per thousand cached positions, for drafting at all.
        Solved once after each fitted step: the allocation prices several selections a step, and
        solving every time cost ~0.7 ms of a batch-32 step's ~3.5 ms of preparation."""
        if self._coefficients is None:
            self._coefficients = self._solve()
        return self._coefficients.copy()

    def _solve(self) -> np.ndarray:
        if self.n <= 0:
            return np.concatenate([[0.0], self.prior])
        m, my = self.sx / self.n, self.sy / self.n
        S = self.sxx / self.n - np.outer(m, m)  # the features' (decayed) covariance
        Sy = self.sxy / self.n - m * my
        # the prior as prior_steps pseudo-steps half a spread either side of the mean step, per feature
        # (as MeasuredStepCost's): they weigh on a slope as prior_steps / 4 measured steps do
        lam = 0.25 * self.prior_steps / self.n * np.maximum(np.diag(S), MIN_VARIANCE)
        beta = nonnegative_solve(S + np.diag(lam), Sy + lam * self.prior)
        return np.concatenate([[my - float(m @ beta)], beta])

    def known_tokens(self, spreads: float = 2.0) -> float:
        """The longest pass the fit can speak for: its passes' mean tokens plus `spreads` spreads, as
        weighted now (forgotten by ``decay``), at most the longest it ever fitted. Past it the slope
        is a guess: a batch size whose drafted passes came long ago, among hundreds of plain ones,
        keeps a slope from the plain passes alone (0 ms a token at 16 rows on GSM8K, SmolLM2, AMD
        EPYC: a 78-token pass priced at 112 ms took 241, 2026-12-01)."""
        if self.n <= 0:
            return 0.0
        mean = self.sx[0] / self.n
        var = max(self.sxx[0, 0] / self.n - mean * mean, 0.0)
        return float(min(self.max_tokens, mean + spreads * np.sqrt(var)))

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
        # a pass longer than any fitted so far is an extrapolation's test, not the machine's: it is
        # neither left out as an outlier nor taken as the machine's pace (at batch 4 on code edits,
        # 2026-11-30, a fit over plain passes priced the first 260-token pass at 130 ms; it took
        # 805 ms, and leaving such passes out as outliers kept the fit from ever learning better)
        if self.steps and tokens <= self.max_tokens:
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
        self._coefficients = None
        self.steps += 1
        self.max_tokens = max(self.max_tokens, int(tokens))
        return True
