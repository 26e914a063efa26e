"""Batch-size-aware speculation budget (SSSD paper, section 3.2).

Speculating with budget b at batch size B costs one forward pass over
B x (b + 1) query tokens and yields B x MAT(b) tokens, where MAT(b) is the
drafter's mean accepted tokens per step (bonus included) at that budget.
Plain decoding (b = 0) costs a pass over B tokens and yields B. The planner
picks, for the current batch, the budget with the most expected tokens per
second, considering every budget from 0 to the largest:

    b* = argmax_b  B * MAT(b) / t(B, b + 1)

t(B, T) is the backend's forward-time profile (profile.py: measured on this
machine and cached, or roofline.py's model of named hardware); the planner
sees nothing else of the model. MAT(b) comes from the drafter's calibration
file (its per-budget development-set MAT, interpolated in log budget
between the calibrated budgets), or from built-in estimates when there is
none. On a CPU, verifying 2-4 tokens costs little more than one, while 17
cost several times as much: small budgets matter. Where no budget beats
plain decoding, it returns 0.

A draft model costs forward passes of its own every speculating step
(serving.model_drafter): the planner adds its estimate of that cost,
d(B) (the sources' `draft_seconds`: measured per batch size once the
drafter has run, before that its depth times the target's pass scaled by
the two models' sizes), to every budget above 0:

    b* = argmax_b  B * MAT(b) / (t(B, b + 1) + d(B) [b > 0])

That model is a prior. Real steps cost more than the profiled forward pass
(drafting, packing, acceptance), and the real acceptance differs from the
calibration set's, so the planner also measures. Per batch-size bucket
(powers of two) it tracks, for the prior's choice, its neighbours on a
ladder of budgets and plain decoding, the tokens each step emitted per row
and the step's wall time, with exponential forgetting (the workload
drifts). Its estimate of a budget's MAT is the observed mean shrunk toward
the calibrated MAT by a number of pseudo-steps, so that a few unlucky
steps (acceptance varies a lot from one step to the next) cannot switch a
good budget off; step times come from measurement alone. Each candidate is
tried for a few steps at first and again every `refresh` steps; otherwise
the bucket runs the budget with the best estimated tokens per second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from sssd.serving.planning.profile import ForwardProfile, load_or_measure, profile_problem  # noqa: F401  (re-exported)

#: MAT per budget without a calibration file: SSSD's default drafter replaying
#: held-out ShareGPT answers with SmolLM2's tokenizer (benchmarks/RESULTS.md).
DEFAULT_MAT = {0: 1.0, 4: 1.7, 8: 1.9, 16: 2.05, 32: 2.2, 64: 2.3}
#: The budgets the measuring planner explores around the model's choice.
LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def interpolate_mat(known: dict[int, float], max_budget: int) -> dict[int, float]:
    """MAT at every budget 0..max_budget from MAT at some: piecewise linear in log2(1 + b),
    through MAT(0) = 1, flat beyond the largest known budget, never decreasing."""
    pts = sorted({0: 1.0, **{int(b): float(m) for b, m in known.items() if b >= 0}}.items())
    xs = np.log2(1 + np.array([b for b, _ in pts], dtype=float))
    ys = np.maximum.accumulate(np.array([m for _, m in pts], dtype=float))
    budgets = np.arange(max_budget + 1)
    mats = np.interp(np.log2(1 + budgets), xs, ys)
    return {int(b): float(m) for b, m in zip(budgets, mats)}


class BudgetPlanner:
    """Chooses each decode step's draft budget (see the module docstring).

    Args:
        fixed: always this budget (no profile needed); None to plan.
        mat: MAT at some budgets (interpolated to every budget up to the largest).
        profile: forward-time profile (needed when planning).
        adaptive: correct the model by measured step rates (``observe``).
        explore_steps: steps each candidate budget is tried for before comparing.
        refresh: steps in a batch-size bucket after which the candidates are re-tried.
        prior_steps: pseudo-steps of the calibrated MAT in each budget's MAT estimate (8: a budget the
            calibration expects to pay survives a run of unlucky first steps; one that really loses
            is given up after a few dozen steps).
        draft_cost: (batch size, profile) -> seconds the draft sources' own forward passes add
            to a speculating step (draft models); None: drafting is free beside the target.
    """

    def __init__(
        self,
        fixed: int | None,
        mat: dict[int, float] | None = None,
        profile: ForwardProfile | None = None,
        adaptive: bool = True,
        explore_steps: int = 3,
        refresh: int = 128,
        prior_steps: float = 8.0,
        draft_cost: Callable[[int, ForwardProfile], float] | None = None,
    ):
        self.fixed = fixed
        self.draft_cost = draft_cost
        known = dict(mat or DEFAULT_MAT)
        self.mat = interpolate_mat(known, max(known))
        self.profile = profile
        self.adaptive = adaptive
        self.explore_steps = explore_steps
        self.refresh = refresh
        self.prior_steps = prior_steps
        self.choices: dict[int, int] = {}  # batch size -> budget the model chose (reported)
        self.buckets: dict[int, _Bucket] = {}
        if fixed is None and profile is None:
            raise ValueError("a planning budget planner needs a forward-time profile")

    @classmethod
    def create(
        cls,
        config,
        speculate: bool,
        calibration: Any,
        profile: Callable[[], ForwardProfile],
        draft_cost: Callable[[int, ForwardProfile], float] | None = None,
    ) -> BudgetPlanner:
        """The planner an engine runs with: no speculation, a fixed budget, or planned
        (the profile is asked for only then).

        Args:
            calibration: what the engine drafts with (a CalibrationFile: its entries' MAT;
                a DrafterConfig or None: the built-in estimates).
            draft_cost: what draft models add to a speculating step (see __init__).
        """
        if not speculate or not config.speculate:
            return cls(fixed=0)
        if config.budget is not None:
            return cls(fixed=config.budget)
        return cls(fixed=None, mat=mat_from_calibration(calibration), profile=profile(), draft_cost=draft_cost)

    def use_profile(self, profile: ForwardProfile) -> None:
        """Plans with `profile` from now on (a measured one replacing the prior): the model's choices
        are made again, and the measured rates, taken under the old plan, start afresh."""
        self.profile = profile
        self.choices.clear()
        self.buckets.clear()

    @property
    def max_budget(self) -> int:
        return self.fixed if self.fixed is not None else max(self.mat)

    def expected_rate(self, batch: int, budget: int) -> float:
        """Expected tokens per second at this batch size and budget (the model)."""
        seconds = self.profile.time(batch, budget + 1)
        if budget > 0 and self.draft_cost is not None:
            seconds += self.draft_cost(batch, self.profile)
        return batch * self.mat[budget] / seconds

    def model_budget(self, batch: int) -> int:
        """The budget the model (profile x calibrated MAT) expects to be fastest."""
        if batch not in self.choices:
            self.choices[batch] = max(sorted(self.mat), key=lambda b: self.expected_rate(batch, b))
        return self.choices[batch]

    def budget(self, batch: int) -> int:
        if self.fixed is not None:
            return self.fixed
        prior = self.model_budget(batch)
        if not self.adaptive:
            return prior
        return self._bucket(batch, prior).next()

    def observe(self, batch: int, budget: int, seconds: float, tokens: int) -> None:
        """A decode step's outcome: its wall time and the tokens it emitted over all rows."""
        if self.fixed is not None or not self.adaptive or seconds <= 0:
            return
        self._bucket(batch, self.model_budget(batch)).observe(budget, seconds, tokens / max(batch, 1))

    def _bucket(self, batch: int, prior: int) -> _Bucket:
        key = 1 << max(0, int(batch) - 1).bit_length()  # 1, 2, 4, 8, ...: the batch rounded up to a power of 2
        if key not in self.buckets:
            ladder = sorted({b for b in LADDER if b <= self.max_budget} | {prior})
            i = ladder.index(prior)
            near = {ladder[max(i - 1, 0)], ladder[min(i + 1, len(ladder) - 1)]}
            # a neighbour the model expects to be far slower is not worth trying (large batches)
            floor = 0.75 * self.expected_rate(key, prior)
            cands = {0, prior} | {b for b in near if self.expected_rate(key, b) >= floor}
            self.buckets[key] = _Bucket(
                sorted(cands),
                prior,
                {b: self.mat[b] for b in cands},
                self.explore_steps,
                self.refresh,
                self.prior_steps,
            )
        return self.buckets[key]

    def observed(self) -> dict[int, dict]:
        """Per batch-size bucket: measured tokens/s per candidate budget and the current choice."""
        return {
            k: {"rates": {b: round(r, 2) for b, r in v.rates().items()}, "choice": v.best()}
            for k, v in sorted(self.buckets.items())
        }

    def table(self, batches=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> list[dict]:
        """The planner's view: expected tokens/s per budget, and the choice, per batch size."""
        rows = []
        for B in batches:
            if self.fixed is not None:
                rows.append({"batch": B, "budget": self.fixed, "tokens_per_s": {}})
                continue
            rates = {b: round(self.expected_rate(B, b), 2) for b in sorted(self.mat)}
            rows.append({"batch": B, "budget": self.model_budget(B), "tokens_per_s": rates})
        return rows


class _Bucket:
    """Estimated tokens/s of a few candidate budgets at one batch-size bucket."""

    DECAY = 0.98  # weight of past observations per new one (an effective window of ~50 steps per budget)

    def __init__(
        self,
        candidates: list[int],
        prior: int,
        prior_mat: dict[int, float],
        explore_steps: int,
        refresh: int,
        prior_steps: float,
    ):
        self.candidates = candidates
        self.prior = prior
        self.prior_mat = prior_mat
        self.explore_steps = explore_steps
        self.refresh = refresh
        self.prior_steps = prior_steps
        self.n = {b: 0.0 for b in candidates}  # decayed step counts
        self.tokens = {b: 0.0 for b in candidates}  # decayed tokens per row
        self.seconds = {b: 0.0 for b in candidates}  # decayed step seconds
        self.fresh: dict[int, int] = {b: 0 for b in candidates}  # observations since the last refresh
        self.decisions = 0

    def next(self) -> int:
        self.decisions += 1
        if self.decisions % self.refresh == 0:
            self.fresh = {b: 0 for b in self.candidates}
        for b in self.candidates:  # try each candidate (again) before comparing
            if self.fresh[b] < self.explore_steps:
                return b
        return self.best()

    def observe(self, budget: int, seconds: float, tokens_per_row: float) -> None:
        if budget not in self.n:
            return
        self.n[budget] = self.DECAY * self.n[budget] + 1
        self.tokens[budget] = self.DECAY * self.tokens[budget] + tokens_per_row
        self.seconds[budget] = self.DECAY * self.seconds[budget] + seconds
        self.fresh[budget] += 1

    def mat(self, b: int) -> float:
        """Tokens per row per step: the observed mean shrunk toward the calibrated MAT."""
        return (self.prior_steps * self.prior_mat[b] + self.tokens[b]) / (self.prior_steps + self.n[b])

    def rates(self) -> dict[int, float]:
        """Estimated tokens per second per row, for the candidates measured so far."""
        return {b: self.mat(b) / (self.seconds[b] / self.n[b]) for b in self.candidates if self.n[b] > 0}

    def best(self) -> int:
        rates = self.rates()
        return max(rates, key=rates.get) if rates else self.prior


def mat_from_calibration(calibration: Any) -> dict[int, float]:
    """Per-budget MAT of what the engine drafts with: a CalibrationFile's entries (each
    budget's replayed MAT; the engine drafts budget b with the entry of the largest
    calibrated budget <= b, and `interpolate_mat` fills the budgets between), or the
    built-in estimates for a DrafterConfig, None, or a file whose entries record no MAT.

    Args:
        calibration: a CalibrationFile, a DrafterConfig, None, or the path of an
            `sssd calibrate` file (read here: ValueError if it is malformed).
    """
    from sssd.calibration_file import CalibrationFile

    if isinstance(calibration, (str, Path)):
        calibration = CalibrationFile.load(calibration)
    if isinstance(calibration, CalibrationFile) and calibration.mat.keys() == calibration.entries.keys():
        return dict(calibration.mat) | {0: 1.0}
    return dict(DEFAULT_MAT)


class SelfSpecCostModel:
    """MagicDec's cost model for self-speculation over a sparse KV (serving.self_drafter).

    A forward pass of the target over B rows of T tokens reading S cached positions each costs

        t(B, T, S) = c0 + c1 B T + c2 B S + c3 B T S

    (fixed cost, weights times tokens, reading the KV, attention's arithmetic). A draft pass reads
    S = kv_budget positions; the target's verification reads the whole context. A chain of gamma
    tokens accepted at per-depth rates a_1, a_2, ... yields 1 + sum_i prod_{j<=i} a_j tokens per
    step for gamma draft passes and one verification of gamma + 1 tokens, against one token per
    plain pass:

        speedup(gamma) = (1 + sum_i prod_{j<=i} a_j) t(B, 1, ctx)
                         / (gamma t(B, 1, kv_budget) + t(B, gamma + 1, ctx))

    The best gamma maximises it; where no gamma beats plain decoding by `margin` (short contexts,
    where the draft pass costs nearly what a full one does) the source does not draft: that is the
    critical context. The coefficients come from a roofline prior (the model's shape, a CPU's
    bandwidth and arithmetic rate) or from passes measured on this machine (`fit`:
    benchmarks/bench_magicdec.py writes them), and the draft passes a running source times
    (`observe_draft`) give its draft seconds per batch size.
    """

    def __init__(self, coef: Sequence[float], kv_budget: int, margin: float = 1.05, meta: dict | None = None):
        self.coef = np.maximum(np.asarray(coef, dtype=np.float64), 0.0)
        if self.coef.shape != (4,):
            raise ValueError(f"a self-speculation cost model has 4 coefficients, got {self.coef.shape}")
        self.kv_budget = int(kv_budget)
        self.margin = float(margin)
        self.meta = dict(meta or {})
        self._draft: dict[int, float] = {}  # batch bucket -> measured seconds per draft pass
        #: method -> KV budget -> measured per-depth acceptance rates (bench_magicdec --sweep)
        self.acceptance: dict[str, dict[int, list]] = {}

    @classmethod
    def prior(
        cls, shape: dict, kv_budget: int, bandwidth: float = 8e9, flops: float = 4e10, overhead: float = 2e-3
    ) -> SelfSpecCostModel:
        """The roofline prior for a model of `shape` (TorchBackend's info.shape) on a small CPU."""
        params = float(shape.get("params", 1e8))
        dtype = float(shape.get("dtype_bytes", 4))
        kv = 2.0 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * dtype  # bytes per position
        attn = 4.0 * shape["layers"] * shape["heads"] * shape["head_dim"]  # FLOPs per query-position pair
        return cls(
            [overhead + params * dtype / bandwidth, 2.0 * params / flops, kv / bandwidth, attn / flops],
            kv_budget,
            meta={"source": "roofline prior"},
        )

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, int, float]], kv_budget: int, **kw) -> SelfSpecCostModel:
        """Least squares (non-negative) over measured passes (B, T, S, seconds)."""
        pts = np.asarray(points, dtype=np.float64)
        if pts.ndim != 2 or pts.shape[1] != 4 or len(pts) < 4:
            raise ValueError("fitting the cost model needs at least 4 measured passes (B, T, S, seconds)")
        X = np.stack(
            [np.ones(len(pts)), pts[:, 0] * pts[:, 1], pts[:, 0] * pts[:, 2], pts[:, 0] * pts[:, 1] * pts[:, 2]], axis=1
        )
        # relative errors: divide every row by its time (short and long passes count alike)
        w = 1.0 / pts[:, 3]
        coef = _nnls(X * w[:, None], pts[:, 3] * w)
        return cls(coef, kv_budget, meta={"source": "measured", "points": len(pts)}, **kw)

    def to_dict(self) -> dict:
        return {
            "coef": self.coef.tolist(),
            "kv_budget": self.kv_budget,
            "margin": self.margin,
            "meta": self.meta,
            "acceptance": self.acceptance,
        }

    @classmethod
    def from_dict(cls, d: dict, kv_budget: int | None = None) -> SelfSpecCostModel:
        model = cls(d["coef"], d["kv_budget"] if kv_budget is None else kv_budget, d.get("margin", 1.05), d.get("meta"))
        model.acceptance = {m: {int(k): list(v) for k, v in t.items()} for m, t in (d.get("acceptance") or {}).items()}
        return model

    def time(self, batch: int, tokens: int, kv: int) -> float:
        """Seconds of one pass: `batch` rows of `tokens` tokens reading `kv` positions each."""
        B, T, S = float(batch), float(tokens), float(kv)
        return float(self.coef @ np.array([1.0, B * T, B * S, B * T * S]))

    def ratio(self, batch: int, context: int) -> float:
        """A draft pass's cost over a plain target pass at this batch and context."""
        context = max(int(context), 1)
        return self.time(batch, 1, min(self.kv_budget, context)) / self.time(batch, 1, context)

    def speedup(self, batch: int, context: int, rates: np.ndarray, gamma: int, kv_budget: int | None = None) -> float:
        """Expected tokens per second over plain decoding's, drafting chains of `gamma` (over a
        KV of `kv_budget` positions; default the model's)."""
        if gamma < 1:
            return 1.0
        accepted = 1.0 + float(np.cumprod(np.asarray(rates, dtype=np.float64)[:gamma]).sum())
        S = min(self.kv_budget if kv_budget is None else int(kv_budget), max(int(context), 1))
        step = gamma * self.time(batch, 1, S + gamma // 2) + self.time(batch, gamma + 1, context)
        return accepted * self.time(batch, 1, context) / step

    def best_gamma(self, batch: int, context: int, rates: np.ndarray, cap: int) -> int:
        """The chain length with the best expected speedup, up to `cap`; 0 if none beats plain
        decoding by the margin (below the critical context)."""
        best, gain = 0, self.margin
        for g in range(1, int(cap) + 1):
            s = self.speedup(batch, context, rates, g)
            if s > gain:
                best, gain = g, s
        return best

    def best_plan(self, batch: int, context: int, rates_by_budget: dict, cap: int = 8) -> tuple[int, int, float]:
        """(KV budget, gamma, expected speedup) with the best expected speedup at this batch and
        context, over the KV budgets whose per-depth acceptance rates were measured
        (`rates_by_budget`: budget -> [depth] rates, e.g. bench_magicdec --sweep's); gamma 0 and
        speedup 1 when none pays."""
        best = (0, 0, self.margin)
        for kb, rates in sorted((int(k), v) for k, v in rates_by_budget.items()):
            for g in range(1, int(cap) + 1):
                s = self.speedup(batch, context, np.asarray(rates, dtype=np.float64), g, kb)
                if s > best[2]:
                    best = (kb, g, s)
        return best if best[1] else (0, 0, 1.0)

    def critical_context(self, batch: int, rates: np.ndarray, cap: int, longest: int = 1 << 17) -> int | None:
        """The shortest context (a power of two times 256) at which drafting pays; None: none up to `longest`."""
        c = 256
        while c <= longest:
            if self.best_gamma(batch, c, rates, cap):
                return c
            c *= 2
        return None

    def observe_draft(self, batch: int, gamma: int, seconds: float) -> None:
        """A running source's measured chain: seconds for `gamma` passes over `batch` rows."""
        key = 1 << max(0, int(batch) - 1).bit_length()
        per = seconds / max(1, gamma)
        self._draft[key] = per if key not in self._draft else 0.8 * self._draft[key] + 0.2 * per

    def draft_seconds(self, batch: int, gamma: int = 4) -> float:
        """Seconds a chain of `gamma` draft passes adds to a step of `batch` rows (measured once seen)."""
        key = 1 << max(0, int(batch) - 1).bit_length()
        per = self._draft.get(key)
        if per is None:
            per = self.time(batch, 1, self.kv_budget)
        return gamma * per


def _nnls(A: np.ndarray, b: np.ndarray, iters: int = 500) -> np.ndarray:
    """Non-negative least squares by projected coordinate descent (small problems: 4 unknowns)."""
    x = np.maximum(np.linalg.lstsq(A, b, rcond=None)[0], 0.0)
    AtA, Atb = A.T @ A, A.T @ b
    for _ in range(iters):
        for i in range(len(x)):
            if AtA[i, i] > 0:
                x[i] = max(0.0, x[i] + (Atb[i] - AtA[i] @ x) / AtA[i, i])
    return x
