"""Forward-pass cost profiles: measured on this machine, cached, and checked.

A ForwardProfile holds seconds per forward pass by (rows, tokens per row),
interpolated in log space. `measure_steps` times any VerifierBackend over
synthetic chains, one point per step, so that an engine can take it between
requests (planning/measurements.py); `load_or_measure` takes it at once.
Either caches the result per backend identity (model, dtype, device, threads,
slots, machine) with the conditions it was measured under, and only when it
can be trusted (`profile_problem`: no other process held the CPU, the times
are monotone and consistent). `prior` is the conservative cost model an
engine plans with until then; roofline.py builds the same type from a GPU's
datasheet.
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

from sssd.cpus import competing_seconds, competing_ticks
from sssd.files import write_atomic
from sssd.paths import profiles_dir

#: Batch rows and tokens per row at which the forward time is profiled. Small token counts
#: are dense: on a CPU, verifying 2-4 tokens is nearly free while 17 is not.
PROFILE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROFILE_TOKENS = (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65)
#: A step this many times dearer than a 1-token step cannot pay for itself (see measure).
STOP_RATIO = 4.0
#: Another process's share of the CPU during profiling above which the profile is not trusted
#: (SSSD_PROFILE_NOISY_SHARE overrides it; 1 trusts every profile).
NOISY_SHARE = 0.25
#: Times that fall by more than half (and by over 2 ms) as the work grows betray a hiccup.
_HICCUP = (0.5, 0.002)
PROFILE_VERSION = 2
#: Rounds of timing again the points that break the timing checks before a profile is judged.
RETIME_ROUNDS = 3
#: A profile point's passes are repeated until they add up to this many seconds (at most 8).
SHORT_PASSES_SECONDS = 0.03


@dataclass
class ForwardProfile:
    """Seconds per forward pass by (rows, tokens per row); interpolated in log space."""

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

    def times(self, rows: int, tokens: np.ndarray) -> np.ndarray:
        """`time` at many tokens-per-row values (fractional: a ragged pass of N tokens over B rows
        costs about a uniform pass of N / B tokens per row), vectorised."""
        r = np.log(np.clip(rows, self.rows[0], self.rows[-1]))
        t = np.log(np.clip(np.asarray(tokens, dtype=np.float64), self.tokens[0], self.tokens[-1]))
        grid = np.log(np.asarray(self.seconds))
        lr, lt = np.log(self.rows), np.log(self.tokens)
        i = int(np.clip(np.searchsorted(lr, r) - 1, 0, max(len(lr) - 2, 0)))
        lo = np.interp(t, lt, grid[i])
        if len(lr) == 1:
            return np.exp(lo)
        hi = np.interp(t, lt, grid[i + 1])
        w = (r - lr[i]) / (lr[i + 1] - lr[i])
        return np.exp(lo + w * (hi - lo))

    def to_dict(self) -> dict:
        return {
            "version": PROFILE_VERSION,
            "rows": self.rows,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "context": self.context,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ForwardProfile:
        return cls(
            list(d["rows"]),
            list(d["tokens"]),
            [list(map(float, r)) for r in d["seconds"]],
            int(d["context"]),
            dict(d.get("meta", {})),
        )


def measure(backend, context: int = 256, repeats: int = 2, log=None) -> ForwardProfile:
    """Times forward passes of a backend over synthetic chains at each (rows, tokens) at once
    (measure_steps, run to its end)."""
    return run_steps(measure_steps(backend, context, repeats, log))


def run_steps(steps):
    """Runs a measurement generator (measure_steps, linear_plan.measure_steps) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def measure_steps(backend, context: int = 256, repeats: int = 2, log=None):
    """Times forward passes of a backend over synthetic chains at each (rows, tokens); a generator
    that yields after each point (so that an engine can take a profile between requests) and
    returns the ForwardProfile.

    The passes use the backend's first slots: run it only while no request holds one. Points
    where speculation cannot pay are not measured but extrapolated
    linearly: along a row, once a step of t tokens costs STOP_RATIO times a
    1-token step (no drafter accepts that many tokens per step on average);
    and the larger row counts, once even the 5-token step costs that much.
    On a CPU this cuts first-start profiling from minutes to seconds.
    """
    from sssd.serving.verify.tree_batch import pack

    context = max(1, min(context, backend.capacity - PROFILE_TOKENS[-1] - 2))
    cap = backend.slots
    rows = [r for r in PROFILE_ROWS if r <= cap] or [cap]
    max_t = min(PROFILE_TOKENS[-1], backend.capacity - context - 1)
    tokens = [t for t in PROFILE_TOKENS if t <= max_t]
    rng = np.random.default_rng(0)

    def run(r: int, t: int) -> float:
        drafts = _chains(r, t - 1)
        batch = pack(rng.integers(0, backend.info.vocab_size, r), np.full(r, context), drafts)
        t0 = time.perf_counter()
        backend.collect(backend.launch(slice(0, r), batch, np.ones(r, dtype=bool)))
        return time.perf_counter() - t0

    def timed(r: int, t: int) -> float:
        best, spent, n = float("inf"), 0.0, 0
        # best of `repeats`, and of more where passes are short (a scheduler hiccup of a few
        # ms is many of them): at least SHORT_PASSES_SECONDS of passes, up to 8
        while n < repeats or (spent < SHORT_PASSES_SECONDS and n < 8):
            took = run(r, t)
            best, spent, n = min(best, took), spent + took, n + 1
            if best > 0.5:
                break  # long enough to time once
        return best

    for _ in range(2):  # the first passes pay one-off costs (allocation, kernel selection)
        run(1, 5)
    yield
    measured: list[list[float]] = []  # per row, the times actually taken (a prefix of `tokens`)
    for r in rows:
        if measured and len(tokens) > 4 and _along(measured[-1], tokens)[4] > STOP_RATIO * measured[-1][0]:
            break  # not even a 4-token draft pays at this batch size: extrapolate the rest
        row_times: list[float] = []
        for t in tokens:
            if row_times and row_times[-1] > STOP_RATIO * row_times[0]:
                break
            took = timed(r, t)
            # the point before it in the row (or, for a row's first point, in the column)
            if row_times:
                prev, growth = row_times[-1], t / tokens[len(row_times) - 1]
            elif measured:
                prev, growth = measured[-1][0], r / rows[len(measured) - 1]
            else:
                prev, growth = None, 1.0
            # a time far out of line with it is most often a hiccup that outlasted the repeats:
            # time it again before the stopping rules read it
            for _ in range(RETIME_ROUNDS):
                if prev is None or not _outgrows(prev, took, growth):
                    break
                took = min(took, timed(r, t))
            row_times.append(took)
            yield
        measured.append(row_times)
        if log:
            log(f"profiled {r} rows: " + ", ".join(f"{t} tok {s * 1e3:.1f} ms" for t, s in zip(tokens, row_times)))
    # What is still out of line (a time that falls as the work grows: the smaller pass stalled):
    # time the points involved again, keeping the best.
    for _ in range(RETIME_ROUNDS):
        grid = _grid(measured, rows, tokens)
        cells = {(i, j) for _, pair in _timing_problems(rows, tokens, grid) for i, j in pair}
        cells = sorted((i, j) for i, j in cells if i < len(measured) and j < len(measured[i]))
        if not cells:
            break
        for i, j in cells:
            measured[i][j] = min(measured[i][j], timed(rows[i], tokens[j]))
            yield
    return ForwardProfile(rows, tokens, _grid(measured, rows, tokens), context)


def _grid(measured: list[list[float]], rows: list[int], tokens: list[int]) -> list[list[float]]:
    """The full (rows x tokens) grid from the measured prefix of each measured row: along a row,
    the last measured time grows linearly with the tokens; the rows past the measured ones grow
    linearly with the rows."""
    seconds = [_along(row, tokens) for row in measured]
    last, base = rows[len(seconds) - 1], seconds[-1]
    return seconds + [[s * r / last for s in base] for r in rows[len(seconds) :]]


def _along(row: list[float], tokens: list[int]) -> list[float]:
    """A row's measured prefix, extrapolated linearly in the tokens from its last measured time."""
    return row + [row[-1] * t / tokens[len(row) - 1] for t in tokens[len(row) :]]


#: The prior's cost of one more token in a pass, as a share of a one-token pass, per byte of a
#: weight: a CPU pass reads every weight once (memory-bound at one token) and does 2 flops per
#: weight per token, so one more token costs about bandwidth / (2 x flops per second) of the pass,
#: 0.15 for float32 on the 2-core AMD EPYC measured here (4-16 tokens; less beyond). The prior
#: takes a dearer token than measured (0.8 / bytes: 0.2 for float32), so that it speculates where
#: speculation clearly pays (small batches) and not where it might not.
PRIOR_TOKEN_SHARE = 0.8
#: A GPU's flops per byte are ~30x a CPU's: one more token is a far smaller share of a pass.
PRIOR_TOKEN_SHARE_GPU = 0.02
#: The prior's one-token pass: the weights read at this many bytes per second (a low CPU figure:
#: the allocation rescales it by the steps it measures).
PRIOR_BANDWIDTH = 10e9


def prior_token_share(device: str, dtype_bytes: int = 4) -> float:
    """The prior's cost of one more token in a pass, as a share of a one-token pass, on this kind of
    device ("cpu", "cuda", "cuda:1", ...) at this many bytes per weight."""
    if device.split(":")[0] in ("cuda", "hip", "xpu", "tpu"):
        return PRIOR_TOKEN_SHARE_GPU
    return PRIOR_TOKEN_SHARE / max(int(dtype_bytes), 1)


def prior(backend, context: int = 256) -> ForwardProfile:
    """A conservative forward-cost model from the model's size alone, for an engine to plan with
    until its profile is measured: a pass of N tokens in all costs (1 + s (N - 1)) times a
    one-token pass, s = PRIOR_TOKEN_SHARE / bytes per weight (see there); the one-token pass
    reads every weight at PRIOR_BANDWIDTH. Its meta says "prior"."""
    shape = backend.info.shape
    width = int(shape.get("dtype_bytes", 4)) or 4
    share = prior_token_share(str(getattr(backend, "device", "cpu")), width)
    base = max(float(shape.get("params", 1e8)) * width / PRIOR_BANDWIDTH, 1e-3)
    rows = [r for r in PROFILE_ROWS if r <= max(backend.slots, 1)] or [1]
    seconds = [[base * (1 + share * (r * t - 1)) for t in PROFILE_TOKENS] for r in rows]
    return ForwardProfile(rows, list(PROFILE_TOKENS), seconds, context, {"prior": True, "token_share": share})


def _chains(rows: int, n: int):
    """`rows` chain drafts of n nodes each (token 0), as a DraftBatch."""
    from sssd.tree import DraftBatch

    N = rows * n
    return DraftBatch(
        np.arange(rows + 1, dtype=np.int64) * n,
        np.zeros(N, np.int64),
        np.tile(np.arange(-1, n - 1, dtype=np.int32), rows),
        np.tile(np.arange(1, n + 1, dtype=np.int32), rows),
        np.ones(N, np.float32),
        np.zeros(N, np.uint8),
        np.full(N, np.nan, np.float32),
    )


# -- measuring conditions --------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Conditions:
    """What else ran on the machine while a measurement was taken: other processes' share of the
    CPU (sssd.cpus.competing_ticks: not this process or the ones it started, not niced below it),
    load, CPU model.

    Used as a context manager around one measurement, or around each of its pieces (`piece`)
    when it is taken in pieces between requests: only the time inside the pieces counts.
    """

    def __init__(self):
        self.elapsed = 0.0
        self.other = 0.0  # other processes' CPU seconds inside the pieces
        self.known = True
        self.load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self._open: tuple[float, float | None, float] | None = None

    def start(self) -> None:
        self._open = (time.monotonic(), competing_ticks())

    def stop(self) -> None:
        if self._open is None:
            return
        t0, before = self._open
        self._open = None
        self.elapsed += max(time.monotonic() - t0, 0.0)
        used = competing_seconds(before, competing_ticks())
        if used is None:
            self.known = False
            return
        self.other += used

    def piece(self) -> Conditions:
        """Context manager timing one piece of the measurement."""
        return self

    @property
    def share(self) -> float | None:
        """Other processes' share of the machine's CPU so far (None: unknown)."""
        if not self.known:
            return None
        return self.other / (max(self.elapsed, 1e-9) * (os.cpu_count() or 1))

    @property
    def record(self) -> dict:
        """The conditions as stored beside a measurement."""
        other = self.share
        return {
            "measured_unix": int(time.time()),
            "seconds": round(self.elapsed, 2),
            "cpu_model": cpu_model(),
            "cores": os.cpu_count() or 1,
            "loadavg_1m_before": self.load0,
            "other_processes_cpu_share": None if other is None else round(other, 3),
        }

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def _noisy_share() -> float:
    return float(os.environ.get("SSSD_PROFILE_NOISY_SHARE", NOISY_SHARE))


#: Doubling the rows (or the tokens) of a pass at most doubles its work; a time that grows by more
#: than this times the work's growth was taken while the pass waited for a core (a 2-row pass
#: measured at 14x a 1-row one beside a busy process).
GROWTH_SLACK = 2.0


def profile_problem(prof: ForwardProfile) -> str | None:
    """Why a profile should not be trusted (None: it looks sound): measured beside a busy process,
    or times that fall as the work grows, or grow far faster than it (a measurement that waited
    for the CPU)."""
    if prof.meta.get("prior"):
        return "it is the prior, not a measurement"
    if "conditions" not in prof.meta:
        return "it records no measuring conditions (measured by an older sssd)"
    other = prof.meta["conditions"].get("other_processes_cpu_share")
    if other is not None and other > _noisy_share():
        return f"other processes used {other:.0%} of the CPU while it was measured"

    for problem, _ in _timing_problems(prof.rows, prof.tokens, prof.seconds):
        return problem
    return None


def _falls(a: float, b: float) -> bool:
    """A time `b` for more work than `a`'s that is far below it: the pass timed at `a` stalled."""
    return b < _HICCUP[0] * a and a - b > _HICCUP[1]


def _outgrows(a: float, b: float, growth: float) -> bool:
    """A time `b` for `growth` times `a`'s work that grew far faster than it: `b` waited for the CPU."""
    return b > GROWTH_SLACK * growth * a and b - a > _HICCUP[1]


def _timing_problems(rows: list[int], tokens: list[int], seconds: list[list[float]]):
    """Yields (why, the two grid cells (row index, token index) it is about) for each pair of
    neighbouring times that betrays a hiccup: a time that falls as the work grows, or grows far
    faster than it (the pass waited for the CPU)."""

    for i in range(len(rows) - 1):
        a, b = seconds[i][0], seconds[i + 1][0]
        if _falls(a, b):
            yield "its 1-token times fall as the batch grows (a measuring hiccup)", ((i, 0), (i + 1, 0))
        elif _outgrows(a, b, rows[i + 1] / rows[i]):
            yield (
                f"a {rows[i + 1]}-row pass took {b / a:.1f}x a {rows[i]}-row one (it waited for the CPU)",
                ((i, 0), (i + 1, 0)),
            )
    for i, row in enumerate(seconds):
        last = len(tokens) - 1
        if _falls(row[0], row[last]):
            yield "its times fall as the tokens per row grow (a measuring hiccup)", ((i, 0), (i, last))
        for j in range(last):
            if _outgrows(row[j], row[j + 1], tokens[j + 1] / tokens[j]):
                yield (
                    f"at {rows[i]} rows, {tokens[j + 1]} tokens took {row[j + 1] / row[j]:.1f}x {tokens[j]} tokens "
                    "(it waited for the CPU)",
                    ((i, j), (i, j + 1)),
                )


def profile_path(backend) -> tuple[Path, dict]:
    """Where the backend's profile is cached, and the identity its name hashes (model, dtype,
    device, threads, slots, linear plan, machine, CPU model, torch)."""
    ident = dict(backend.identity(), machine=platform.machine(), cpu=cpu_model(), profile_version=PROFILE_VERSION)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return profiles_dir() / f"forward-{key}.json", ident


def cached(backend, log=None) -> ForwardProfile | None:
    """The backend's cached profile where it can be trusted; None (with one log line saying why
    when there is a file) where there is none, it cannot be read or it is not trusted."""
    path, _ = profile_path(backend)
    if not path.is_file():
        return None
    try:
        prof = ForwardProfile.from_dict(json.loads(path.read_text()))
        problem = profile_problem(prof)
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"it cannot be read ({type(e).__name__}: {e})"
    if problem is None:
        return prof
    if log:
        log(f"ignoring the cached forward profile {path.name}: {problem}")
    return None


def finish(backend, prof: ForwardProfile, cond: Conditions) -> str | None:
    """Records how `prof` was measured and caches it where it can be trusted; returns why not
    (then it is not cached) or None."""
    path, ident = profile_path(backend)
    prof.meta = {"model": backend.info.path, "identity": ident, "conditions": cond.record}
    problem = profile_problem(prof)
    if problem is None:
        store(path, prof.to_dict())
    return problem


def load_or_measure(backend, log=None, force: bool = False) -> ForwardProfile:
    """The cached profile for this backend on this machine, measured at once on first use.

    It is measured again when asked (`force`), or when the cached one is not
    trustworthy (profile_problem). A new measurement is cached only where it can be trusted; one
    taken beside a busy process is not used either: the engine plans with the last trusted one, or
    the prior (never with garbage), and says so.
    """
    if not force:
        prof = cached(backend, log)
        if prof is not None:
            return prof
    path, _ = profile_path(backend)
    if log:
        log(
            f"profiling the forward pass of {backend.info.path} (cached in {path.parent}; "
            f"`sssd serve --reprofile` measures it again)"
        )
    with Conditions() as cond:
        prof = measure(backend, log=log)
    problem = finish(backend, prof, cond)
    if problem is None:
        return prof
    import logging

    last = cached(backend)
    logging.getLogger("sssd.measure").warning(
        "the forward profile is not trusted (%s); planning with %s instead. Measure it on a quiet machine.",
        problem,
        "the last trusted one" if last is not None else "the conservative prior",
    )
    return last if last is not None else prior(backend)


def store(path, data: dict) -> None:
    """Writes a cached measurement (a forward profile, a linear plan) atomically, then drops the
    cached measurements of model folders that no longer exist (deleted models, temporary ones):
    no backend can ask for them again, and they would pile up."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data).encode())
    for f in path.parent.glob("*.json"):
        if not f.name.startswith(("forward-", "linear-")):
            continue
        try:
            meta = json.loads(f.read_text()).get("meta") or {}
            model = meta.get("model") or (meta.get("identity") or {}).get("model")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(model, str) and os.path.isabs(model) and not os.path.exists(model):
            f.unlink(missing_ok=True)
