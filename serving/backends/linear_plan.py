"""Linear layers that pick their matrix-product kernel by row count, as measured on this machine.

A decode step feeds a linear layer 1 row per request; a verification step a
handful (the tree's nodes). For so few rows, torch's CPU `F.linear(x, W)`
(x @ W.T, the rows as BLAS's M) can take a path several times slower than
the same product laid out the other way, `(W @ x.T).T` (the rows as N).
Measured on the 2-core AMD EPYC (MKL in torch 2.13), LM heads:

    SmolLM2  49152 x 576,  rows 1/2/3/4/8:   F.linear  9.9 / 23.0 / 35.2 / 17.4 / 17.6 ms
                                             (W @ x.T) 3.3 (one row doubled) / 3.3 / 4.8 / 4.3 / 7.2 ms

while for a small projection at 6-12 rows F.linear is the faster one by
20-30%, and at one row F.linear's matrix-vector path beats doubling the row
except on the largest weights. Which form wins depends on the weight's
shape, the row count, the BLAS and the CPU, so it is measured, not assumed:
once per distinct weight shape at a grid of row counts (ROW_GRID), the two
forms timed side by side (interleaved, best of rounds, so a busy neighbour
slows both alike), and cached per machine like the forward profile. The
transposed form is chosen only where it wins by WIN; elsewhere, and above
the grid, the layer is torch's own.

Timed alone, a small projection's matrix-vector product looks fast: called
back to back, MKL's threads stay awake. Inside a forward pass, between
attention and the other operations, they do not, and the per-shape choice
can lose to a uniform one: on the AMD EPYC, SmolLM2's 1-token forward took
50 ms with the per-shape choices, 31 ms with every layer transposed and
56 ms with torch's. So the plan is then refined where it is used
(`refine`): at each grid row count, whole forward passes of that many rows
are timed with the per-shape choices, every layer transposed and every
layer torch's (interleaved rounds, medians), and the fastest is kept.

Both forms compute the same products and sums; they may round differently
(different blocking of the same sums), as F.linear's own paths for
different row counts already do. A given row count always takes the same
path, so plain decoding and verification each stay deterministic.

`SSSD_LINEAR_PLAN=off` leaves every layer to torch (for side-by-side
benchmarks); GPUs keep torch's layers (cuBLAS picks its kernels itself).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sssd.paths import profiles_dir

#: Row counts at which the two forms are timed; a row count between two takes the lower one's choice.
ROW_GRID = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
#: The transposed form must be this much faster (F.linear time / its time) to be chosen.
WIN = 1.15
#: Seconds each timing of one form at one row count should at least last.
MIN_TIMING = 0.002
PLAN_VERSION = 2
#: Whole-forward modes at a grid row count (refine): per-shape choices, all transposed, all torch's.
MODES = ("shape", "T", "F")
ENV = "SSSD_LINEAR_PLAN"


@dataclass
class LinearPlan:
    """Per weight shape (out, in): the speed ratio F.linear / transposed at each ROW_GRID row count."""

    ratios: dict[tuple[int, int], list[float]]
    grid: tuple[int, ...] = ROW_GRID
    meta: dict = field(default_factory=dict)
    #: Per grid row count, the whole-forward mode `refine` chose ("T": every layer transposed, "F":
    #: every layer torch's); a row count without one follows the per-shape ratios.
    modes: dict[int, str] = field(default_factory=dict)

    def wins(self, shape: tuple[int, int]) -> list[bool]:
        """Whether each grid row count takes the transposed form for this shape (unmeasured: never)."""
        ratios = self.ratios.get(tuple(shape))
        if ratios is None:
            return [False] * len(self.grid)
        return [self.modes.get(m) == "T" or (self.modes.get(m) != "F" and r >= WIN) for m, r in zip(self.grid, ratios)]

    def table(self, shape: tuple[int, int]) -> tuple[bool, ...]:
        """Whether m rows take the transposed form, indexed by m (0..grid[-1]). A row count between two
        measured ones takes it only if both did (the BLAS's speed is not smooth in the row count:
        16 rows may suit a kernel that 17 do not); unmeasured shapes keep F.linear."""
        out = [False] * (self.grid[-1] + 1)
        if tuple(shape) not in self.ratios:
            return tuple(out)
        wins = self.wins(shape)
        for i, m in enumerate(self.grid):
            out[m] = wins[i]
            if i + 1 < len(self.grid):  # between two measured counts: only where both chose it
                for rows in range(m + 1, self.grid[i + 1]):
                    out[rows] = wins[i] and wins[i + 1]
        return tuple(out)

    def chosen(self) -> int:
        """How many (shape, grid row count) points take the transposed form."""
        return sum(sum(self.wins(s)) for s in self.ratios)

    def to_dict(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "grid": list(self.grid),
            "ratios": [[list(s), [round(r, 4) for r in rs]] for s, rs in sorted(self.ratios.items())],
            "modes": {str(m): mode for m, mode in sorted(self.modes.items())},
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict) -> LinearPlan:
        if d.get("version") != PLAN_VERSION or tuple(d["grid"]) != ROW_GRID:
            raise ValueError("another version of the linear plan")
        ratios = {(int(s[0]), int(s[1])): [float(r) for r in rs] for s, rs in d["ratios"]}
        if any(len(rs) != len(ROW_GRID) for rs in ratios.values()):
            raise ValueError("a linear plan entry of the wrong length")
        modes = {int(m): str(mode) for m, mode in d.get("modes", {}).items()}
        if any(m not in ROW_GRID or mode not in MODES[1:] for m, mode in modes.items()):
            raise ValueError("a linear plan mode outside the grid or unknown")
        return cls(ratios, ROW_GRID, dict(d.get("meta", {})), modes)


class PlannedLinear(torch.nn.Linear):
    """An nn.Linear whose product takes the form its plan chose for the row count (install() makes
    one of a loaded nn.Linear in place: same parameters, same state dict)."""

    _rows_table: tuple[bool, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if m >= len(self._rows_table) or not self._rows_table[m]:
            return F.linear(x, self.weight, self.bias)
        out = transposed(x.reshape(m, x.shape[-1]), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for x [m, in], computed as (weight @ x.T).T; a single row is doubled, so the
    BLAS runs a matrix-matrix product rather than its matrix-vector one. The result is made
    contiguous: the layers after a projection are slower on a transposed view than the copy costs."""
    if x.shape[0] == 1:
        return torch.mm(weight, torch.cat((x, x)).T)[:, :1].T.contiguous()
    return torch.mm(weight, x.T).T.contiguous()


def linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def install(model: torch.nn.Module, plan: LinearPlan | None) -> int:
    """Makes every nn.Linear of `model` follow `plan` (None: torch's own layers again). Returns how
    many layers take the transposed form at some row count."""
    n = 0
    for mod in linears(model):
        if plan is None:
            if isinstance(mod, PlannedLinear):
                mod.__class__ = torch.nn.Linear
                del mod._rows_table
            continue
        mod.__class__ = PlannedLinear
        mod._rows_table = plan.table(tuple(mod.weight.shape))
        n += any(mod._rows_table)
    return n


def _best_pair(linear_fn, transposed_fn, rounds: int) -> tuple[float, float]:
    """Best seconds per call of two functions, timed alternately."""
    linear_fn(), transposed_fn()  # warm-up: allocation, kernel selection
    t0 = time.perf_counter()
    linear_fn()
    once = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, min(1000, int(MIN_TIMING / once)))
    rounds = rounds if once < 0.005 else max(2, rounds - 1)  # the LM head: each call is long enough
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((linear_fn, transposed_fn)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls)
    return best[0], best[1]


def measure(model: torch.nn.Module, rounds: int = 3, log=None) -> LinearPlan:
    """measure_steps at once."""
    from sssd.serving.planning.profile import run_steps

    return run_steps(measure_steps(model, rounds, log))


def measure_steps(model: torch.nn.Module, rounds: int = 3, log=None):
    """A generator yielding after each (shape, row count) timing and returning the LinearPlan
    (so that an engine can take it between requests). Times F.linear against the transposed form for each distinct weight shape of `model`'s
    linear layers at each ROW_GRID row count. One timed call applies every layer of that shape in
    turn, with its real weights, as a forward pass does: a weight is then read from memory, not
    from a cache it would fit in alone (which favours F.linear's matrix-vector path)."""
    weights: dict[tuple[int, int], list[torch.Tensor]] = {}
    for mod in linears(model):
        ws = weights.setdefault(tuple(mod.weight.shape), [])
        if not any(w is mod.weight for w in ws):  # a tied weight once
            ws.append(mod.weight)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ratios: dict[tuple[int, int], list[float]] = {}
    for shape, ws in weights.items():
        row = []
        for m in ROW_GRID:
            with torch.inference_mode():
                x = torch.randn(m, shape[1], generator=gen).to(ws[0].dtype)
                a, b = _best_pair(lambda: [F.linear(x, w) for w in ws], lambda: [transposed(x, w) for w in ws], rounds)
            row.append(a / b)
            yield
        ratios[shape] = row
        if log:
            log(
                f"linear plan {shape[0]}x{shape[1]} ({len(ws)} layers): transposed at rows "
                f"{[m for m, r in zip(ROW_GRID, row) if r >= WIN] or 'none'}"
            )
    return LinearPlan(ratios)


def refine(model: torch.nn.Module, plan: LinearPlan, time_rows, rounds: int = 5, log=None) -> LinearPlan:
    """refine_steps at once."""
    from sssd.serving.planning.profile import run_steps

    return run_steps(refine_steps(model, plan, time_rows, rounds, log))


def refine_steps(model: torch.nn.Module, plan: LinearPlan, time_rows, rounds: int = 5, log=None):
    """A generator yielding after each grid row count (`model`'s layers then follow `plan` as it
    stands) and returning `plan`. Chooses, at each grid row count m, the fastest of the MODES for whole forward passes:
    `time_rows(m)` runs one pass that feeds every linear layer m rows (with the layers as
    installed) and returns its seconds, or None where m rows do not fit. The modes are timed in
    interleaved rounds (a busy neighbour slows all alike) and compared by their medians. Leaves
    `plan`'s choices installed in `model`; returns `plan`, its `modes` set."""
    shapes = list(plan.ratios)
    for m in plan.grid:
        candidates: dict[tuple, str] = {}  # the same decisions under two names are timed once
        for mode in MODES:
            plan.modes.pop(m, None)
            if mode != "shape":
                plan.modes[m] = mode
            candidates.setdefault(tuple(plan.wins(s)[plan.grid.index(m)] for s in shapes), mode)
        times: dict[str, list[float]] = {mode: [] for mode in candidates.values()}
        for r in range(rounds + 1):  # round 0 warms each mode up
            for mode in times:
                plan.modes.pop(m, None)
                if mode != "shape":
                    plan.modes[m] = mode
                install(model, plan)
                t = time_rows(m)
                if t is None:
                    break
                if r:
                    times[mode].append(t)
            plan.modes.pop(m, None)
            install(model, plan)
            yield  # a round of passes: a piece of a few hundred milliseconds at most
        if not all(times.values()):
            continue
        best = min(times, key=lambda mode: float(np.median(times[mode])))
        if best != "shape":
            plan.modes[m] = best
        if log and len(times) > 1:
            log(
                f"linear plan at {m} rows, whole forward (ms): "
                + ", ".join(f"{mode} {1e3 * float(np.median(ts)):.1f}" for mode, ts in times.items())
                + f" -> {best}"
            )
    install(model, plan)
    return plan


def enabled(device: torch.device) -> bool:
    """Whether layers are planned: on CPUs, unless SSSD_LINEAR_PLAN is off/0/false/no."""
    return device.type == "cpu" and os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def plan_path(model: torch.nn.Module, identity: dict) -> tuple[Path, dict]:
    """Where the plan of `model` on this machine is cached, and the identity its name hashes."""
    from sssd.serving.planning.profile import cpu_model

    shapes = sorted({tuple(m.weight.shape) for m in linears(model)})
    ident = dict(identity, shapes=shapes, machine=platform.machine(), cpu=cpu_model(), plan_version=PLAN_VERSION)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return profiles_dir() / f"linear-{key}.json", ident


def cached(model: torch.nn.Module, identity: dict, log=None, busy_ok: bool = False) -> LinearPlan | None:
    """The cached plan where it can be trusted (measured on a quiet machine, or `busy_ok`); None,
    with one log line saying why where there is a file, where there is none or it is not."""
    from sssd.serving.planning.profile import _noisy_share

    path, ident = plan_path(model, identity)
    if not path.is_file():
        return None
    try:
        plan = LinearPlan.from_dict(json.loads(path.read_text()))
        other = plan.meta.get("conditions", {}).get("other_processes_cpu_share")
        if set(plan.ratios) != set(ident["shapes"]):
            problem = "its shapes differ"
        elif busy_ok or other is None or other <= _noisy_share():
            return plan
        else:
            problem = f"other processes used {other:.0%} of the CPU while it was measured"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        problem = f"it cannot be read ({type(e).__name__}: {e})"
    if log:
        log(f"ignoring the cached linear plan {path.name}: {problem}")
    return None


def finish(model: torch.nn.Module, identity: dict, plan: LinearPlan, cond, busy_ok: bool = False) -> str | None:
    """Records how `plan` was measured and caches it where it can be trusted; returns why not
    (then it is neither cached nor to be used) or None."""
    from sssd.serving.planning.profile import _noisy_share, store

    path, ident = plan_path(model, identity)
    plan.meta = {"identity": ident, "conditions": cond.record}
    other = cond.record.get("other_processes_cpu_share")
    if not busy_ok and other is not None and other > _noisy_share():
        return f"other processes used {other:.0%} of the CPU while it was measured"
    store(path, plan.to_dict())
    return None


def load_or_measure(
    model: torch.nn.Module, identity: dict, log=None, force: bool = False, time_rows=None, busy_ok: bool = False
) -> LinearPlan | None:
    """The cached plan for this model and machine (`identity`: what its timings depend on), measured
    at once on first use and again when the cached one is unreadable or was measured beside a busy
    process (unless `busy_ok`: pipeline stages measure side by side, each beside the others). With
    `time_rows` (see refine), a new plan is refined in whole forward passes. A plan measured beside
    a busy process is not used (None: torch's layers) and not cached."""
    from sssd.serving.planning.profile import Conditions

    if not force:
        plan = cached(model, identity, log, busy_ok)
        if plan is not None:
            return plan
    with Conditions() as cond:
        plan = measure(model, log=log)
        if time_rows is not None:
            refine(model, plan, time_rows, log=log)
    problem = finish(model, identity, plan, cond, busy_ok)
    if problem is None:
        return plan
    install(model, None)
    import logging

    logging.getLogger("sssd.measure").warning(
        "the linear plan is not used (%s); torch's own layers until it is measured again", problem
    )
    return None


def plan_key(plan: LinearPlan | None) -> str | None:
    """A short hash of a plan's choices (what a forward profile measured with it depends on)."""
    if plan is None:
        return None
    choices = sorted((s, tuple(plan.wins(s))) for s in plan.ratios)
    return hashlib.sha256(repr(choices).encode()).hexdigest()[:12]
