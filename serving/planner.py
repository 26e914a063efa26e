"""Batch-size-aware speculation budget (SSSD paper, section 3.2).

Speculating with budget b at batch size B costs one forward pass over
B x (b + 1) query tokens and yields B x MAT(b) tokens, where MAT(b) is the
drafter's mean accepted tokens per step (bonus included) at that budget.
Plain decoding (b = 0) costs a pass over B tokens and yields B. The planner
picks, for the current batch, the budget with the most expected tokens per
second:

    b* = argmax_b  B * MAT(b) / t(B, b + 1)

t(B, T) is the measured forward time on this machine (profiled once per
model, dtype, device and thread count, cached on disk with the conditions
it was measured under, and measured again when those were noisy); MAT(b) comes from
the drafter's calibration file (its per-budget development-set MAT), or
from built-in estimates when there is none. Where no budget beats plain
decoding, it returns 0: speculation is switched off for that step.

That model is a prior. Real steps cost more than the profiled forward pass
(drafting, packing, the walk, Python), and the real acceptance differs from
the calibration set's, so the planner also measures: per batch-size bucket
(powers of two) it keeps the observed tokens per second of the prior's
choice, its neighbouring budgets and plain decoding (each tried for a few
steps, and again every `refresh` steps in that bucket), and uses the best
observed one. On this 2-core CPU the prior alone chose budgets that ran
4-16% slower than plain decoding; measured, the planner falls back to
plain decoding where speculation does not pay (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sssd.paths import cache_dir

if TYPE_CHECKING:  # pragma: no cover
    from sssd.serving.engine import LLMEngine

#: Budgets the planner chooses among (0: no speculation).
BUDGETS = (0, 4, 8, 16, 32, 64)
#: MAT per budget without a calibration file: SSSD's default drafter replaying
#: held-out ShareGPT answers with SmolLM2's tokenizer (benchmarks/RESULTS.md).
DEFAULT_MAT = {0: 1.0, 4: 1.7, 8: 1.9, 16: 2.05, 32: 2.2, 64: 2.3}
#: Batch rows and tokens per row at which the forward time is profiled.
PROFILE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROFILE_TOKENS = (1, 5, 9, 17, 33, 65)
#: A step this many times dearer than a 1-token step cannot pay for itself (see measure).
STOP_RATIO = 4.0


@dataclass
class ForwardProfile:
    """Measured seconds per forward pass by (rows, tokens per row); interpolated in log space."""

    rows: list[int]
    tokens: list[int]
    seconds: list[list[float]]  # [rows][tokens]
    context: int
    meta: dict = field(default_factory=dict)

    def time(self, rows: int, tokens: int) -> float:
        r = np.log(np.clip(rows, self.rows[0], self.rows[-1]))
        t = np.log(np.clip(tokens, self.tokens[0], self.tokens[-1]))
        grid = np.log(np.asarray(self.seconds))
        lr, lt = np.log(self.rows), np.log(self.tokens)
        # bilinear interpolation over the (log rows, log tokens) grid
        per_row = np.array([np.interp(t, lt, g) for g in grid])
        return float(np.exp(np.interp(r, lr, per_row)))

    def to_dict(self) -> dict:
        return {"rows": self.rows, "tokens": self.tokens, "seconds": self.seconds, "context": self.context, "meta": self.meta}

    @classmethod
    def measure(cls, engine: LLMEngine, context: int = 256, repeats: int = 2, log=None) -> ForwardProfile:
        """Times dummy forward passes of the engine's model over its KV pool.

        Points where speculation cannot pay are not measured but extrapolated
        linearly: along a row, once a step of t tokens costs STOP_RATIO times a
        1-token step (no drafter accepts that many tokens per step on average);
        and the larger row counts, once even the 5-token step costs that much.
        On a CPU this cuts first-start profiling from minutes to seconds.
        """
        from sssd.serving.verify import pack_trees

        runner, pool = engine.runner, engine.pool
        context = max(1, min(context, engine.max_model_len - PROFILE_TOKENS[-1] - 2))  # fit short contexts
        cap = pool.shape.slots
        rows = [r for r in PROFILE_ROWS if r <= cap] or [cap]
        max_t = min(PROFILE_TOKENS[-1], engine.max_model_len - context - 1)
        tokens = [t for t in PROFILE_TOKENS if t <= max_t]
        rng = np.random.default_rng(0)
        seconds: list[list[float]] = []
        warm = pack_trees([0], [context], [_chain_tree(4)])
        for _ in range(2):  # the first passes pay one-off costs (allocation, kernel selection)
            runner.logits(runner.forward(pool, slice(0, 1), warm)[0])
        for r in rows:
            if seconds and len(tokens) > 1 and seconds[-1][1] > STOP_RATIO * seconds[-1][0]:
                break  # not even a 4-token draft pays at this batch size: extrapolate the rest
            row_times: list[float] = []
            for t in tokens:
                if row_times and row_times[-1] > STOP_RATIO * row_times[0]:
                    break
                chain = [_chain_tree(t - 1) for _ in range(r)]
                roots = rng.integers(0, runner.info.vocab_size, r).tolist()
                packed = pack_trees(roots, [context] * r, chain)
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    hidden = runner.forward(pool, slice(0, r), packed)
                    runner.logits(hidden[:, :t].reshape(-1, hidden.shape[-1]))
                    best = min(best, time.perf_counter() - t0)
                    if best > 0.5:
                        break  # long enough to time once
                row_times.append(best)
            measured = len(row_times)
            row_times += [row_times[-1] * t / tokens[measured - 1] for t in tokens[measured:]]
            seconds.append(row_times)
            if log:
                log(f"profiled {r} rows: " + ", ".join(f"{t} tok {s * 1e3:.1f} ms" for t, s in
                                                        zip(tokens[:measured], row_times)))
        last, base = rows[len(seconds) - 1], seconds[-1]
        seconds += [[s * r / last for s in base] for r in rows[len(seconds):]]
        return cls(rows, tokens, seconds, context)


def _chain_tree(n: int):
    import sssd

    if n <= 0:
        return None
    return sssd.DraftTree(np.zeros(n, np.int64), np.arange(-1, n - 1, dtype=np.int32), np.arange(1, n + 1, dtype=np.int32),
                          np.ones(n, np.float32), np.zeros(n, np.uint8), np.full(n, np.nan, np.float32))


class BudgetPlanner:
    """Chooses each decode step's draft budget (see the module docstring).

    Args:
        fixed: always this budget (no profiling); None to plan.
        mat: MAT per budget (must include 0 -> 1.0).
        profile: forward-time profile (needed when planning).
        adaptive: correct the model by measured step rates (``observe``).
        explore_steps: steps each candidate budget is tried for before comparing.
        refresh: steps in a batch-size bucket after which the candidates are re-tried.
    """

    def __init__(self, fixed: int | None, mat: dict[int, float] | None = None, profile: ForwardProfile | None = None,
                 adaptive: bool = True, explore_steps: int = 4, refresh: int = 256):
        self.fixed = fixed
        self.mat = dict(mat or DEFAULT_MAT)
        self.mat[0] = 1.0
        self.profile = profile
        self.adaptive = adaptive
        self.explore_steps = explore_steps
        self.refresh = refresh
        self.choices: dict[int, int] = {}  # batch size -> budget the model chose (reported)
        self.buckets: dict[int, _Bucket] = {}
        if fixed is None and profile is None:
            raise ValueError("a planning budget planner needs a forward-time profile")

    @property
    def max_budget(self) -> int:
        return self.fixed if self.fixed is not None else max(self.mat)

    def expected_rate(self, batch: int, budget: int) -> float:
        """Expected tokens per second at this batch size and budget (the model)."""
        return batch * self.mat[budget] / self.profile.time(batch, budget + 1)

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
        bucket = self._bucket(batch, prior)
        return bucket.next()

    def observe(self, batch: int, budget: int, seconds: float, tokens: int) -> None:
        """A decode step's outcome: its wall time and the tokens it emitted over all rows."""
        if self.fixed is not None or not self.adaptive or seconds <= 0:
            return
        self._bucket(batch, self.model_budget(batch)).observe(budget, seconds, tokens)

    def _bucket(self, batch: int, prior: int) -> _Bucket:
        key = 1 << max(0, int(batch) - 1).bit_length()  # 1, 2, 4, 8, ...: the batch rounded up to a power of 2
        if key not in self.buckets:
            budgets = sorted(self.mat)
            i = budgets.index(prior)
            near = {budgets[max(i - 1, 0)], budgets[min(i + 1, len(budgets) - 1)]}
            # a neighbour the model expects to be far slower is not worth trying (large batches)
            floor = 0.75 * self.expected_rate(key, prior)
            cands = {0, prior} | {b for b in near if self.expected_rate(key, b) >= floor}
            self.buckets[key] = _Bucket(sorted(cands), prior, self.explore_steps, self.refresh)
        return self.buckets[key]

    def observed(self) -> dict[int, dict]:
        """Per batch-size bucket: measured tokens/s per candidate budget and the current choice."""
        return {k: {"rates": {b: round(r, 2) for b, r in v.rates().items()}, "choice": v.best()}
                for k, v in sorted(self.buckets.items())}

    def table(self, batches=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> list[dict]:
        """The planner's view: expected tokens/s per budget, and the choice, per batch size."""
        rows = []
        for B in batches:
            rates = {b: round(self.expected_rate(B, b), 2) for b in sorted(self.mat)}
            rows.append({"batch": B, "budget": self.fixed if self.fixed is not None else self.model_budget(B),
                         "tokens_per_s": rates})
        return rows

    @classmethod
    def for_engine(cls, engine: LLMEngine, log=None) -> BudgetPlanner:
        cfg = engine.config
        if not cfg.speculate:
            return cls(fixed=0)
        if cfg.budget is not None:
            return cls(fixed=cfg.budget)
        mat = _mat_from_drafter(engine)
        return cls(fixed=None, mat=mat, profile=load_or_measure(engine, log=log, force=cfg.reprofile))


class _Bucket:
    """Measured tokens/s of a few candidate budgets at one batch-size bucket."""

    WINDOW = 16  # steps per budget the rate is measured over

    def __init__(self, candidates: list[int], prior: int, explore_steps: int, refresh: int):
        self.candidates = candidates
        self.prior = prior
        self.explore_steps = explore_steps
        self.refresh = refresh
        self.steps: dict[int, deque] = {b: deque(maxlen=self.WINDOW) for b in candidates}
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

    def observe(self, budget: int, seconds: float, tokens: int) -> None:
        if budget in self.steps:
            self.steps[budget].append((seconds, tokens))
            self.fresh[budget] += 1

    def rates(self) -> dict[int, float]:
        out = {}
        for b, obs in self.steps.items():
            secs = sum(s for s, _ in obs)
            if obs and secs > 0:
                out[b] = sum(t for _, t in obs) / secs
        return out

    def best(self) -> int:
        rates = self.rates()
        return max(rates, key=rates.get) if rates else self.prior


def _mat_from_drafter(engine: LLMEngine) -> dict[int, float]:
    """Per-budget MAT from the drafter's calibration file, when it came from one."""
    source = getattr(engine, "drafter_source", None)
    if source and Path(source).is_file():
        try:
            d = json.loads(Path(source).read_text())
            if d.get("format") == "sssd-calibration":
                mats = {int(b): float(e["mat"]) for b, e in d["budgets"].items()}
                return {b: m for b, m in mats.items() if b in BUDGETS or b > 0} | {0: 1.0}
        except (OSError, ValueError, KeyError):
            pass
    return dict(DEFAULT_MAT)


def _profile_key(engine: LLMEngine) -> str:
    import torch

    info = engine.runner.info
    ident = {
        "model": info.path, "mtime": os.path.getmtime(Path(info.path) / "config.json"), "dtype": str(engine.runner.dtype),
        "device": str(engine.runner.device), "threads": torch.get_num_threads(), "slots": engine.pool.shape.slots,
        "machine": platform.machine(), "cpu": platform.processor(), "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


#: Another process's share of the CPU during profiling above which the profile is not trusted
#: (SSSD_PROFILE_NOISY_SHARE overrides it; 1 trusts every profile).
NOISY_SHARE = 0.25
#: Times that fall by more than half (and by over 2 ms) as the work grows betray a hiccup.
_HICCUP = (0.5, 0.002)


def _cpu_busy_seconds() -> float | None:
    """CPU seconds spent busy by the whole machine (all cores) since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Conditions:
    """What else ran on the machine while the profile was measured."""

    def __enter__(self):
        self.t0, self.busy0, self.own0 = time.monotonic(), _cpu_busy_seconds(), _own_cpu_seconds()
        self.load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        return self

    def __exit__(self, *exc):
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        busy1, cores = _cpu_busy_seconds(), os.cpu_count() or 1
        other = None
        if self.busy0 is not None and busy1 is not None:
            other = max(0.0, (busy1 - self.busy0) - (_own_cpu_seconds() - self.own0)) / (elapsed * cores)
        self.record = {"measured_unix": int(time.time()), "seconds": round(elapsed, 2), "cpu_model": _cpu_model(),
                       "cores": cores, "loadavg_1m_before": self.load0,
                       "other_processes_cpu_share": None if other is None else round(other, 3)}
        return False


def _noisy_share() -> float:
    return float(os.environ.get("SSSD_PROFILE_NOISY_SHARE", NOISY_SHARE))


def profile_problem(prof: ForwardProfile) -> str | None:
    """Why a cached profile should not be trusted (None: it looks sound)."""
    other = (prof.meta.get("conditions") or {}).get("other_processes_cpu_share")
    if "conditions" not in prof.meta:
        return "it records no measuring conditions (measured by an older sssd)"
    if other is not None and other > _noisy_share():
        return f"other processes used {other:.0%} of the CPU while it was measured"
    def falls(a: float, b: float) -> bool:
        return b < _HICCUP[0] * a and a - b > _HICCUP[1]

    one = [row[0] for row in prof.seconds]
    if any(falls(a, b) for a, b in zip(one, one[1:])):
        return "its 1-token times fall as the batch grows (a measuring hiccup)"
    if any(falls(row[0], row[-1]) for row in prof.seconds):
        return "its times fall as the tokens per row grow (a measuring hiccup)"
    return None


def load_or_measure(engine: LLMEngine, log=None, force: bool = False) -> ForwardProfile:
    """The cached profile for this model and machine, measured on first use.

    It is measured again when asked (`force`), or when the cached one is not
    trustworthy (profile_problem: measured beside a busy process, or not
    monotone). The measuring conditions (other processes' CPU share, load,
    CPU model) are stored beside the times, and a noisy measurement says so.
    """
    path = cache_dir() / "profiles" / f"forward-{_profile_key(engine)}.json"
    if path.is_file() and not force:
        try:
            d = json.loads(path.read_text())
            prof = ForwardProfile(d["rows"], d["tokens"], d["seconds"], d["context"], d.get("meta", {}))
            problem = profile_problem(prof)
            if problem is None:
                return prof
            if log:
                log(f"re-measuring the cached forward profile {path.name}: {problem}")
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if log:
        log(f"profiling the forward pass of {engine.runner.info.path} (cached in {path.parent}; "
            f"`sssd serve --reprofile` measures it again)")
    with _Conditions() as cond:
        prof = ForwardProfile.measure(engine, log=log)
    prof.meta = {"model": engine.runner.info.path, "measured_unix": int(time.time()), "conditions": cond.record}
    other = cond.record["other_processes_cpu_share"]
    if log and other is not None and other > _noisy_share():
        log(f"WARNING: other processes used {other:.0%} of the CPU while profiling: the planner's costs may be "
            f"wrong. This profile will be measured again at the next start; run on a quiet machine.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(prof.to_dict()))
    tmp.replace(path)
    return prof
