"""Forward-pass cost profiles: measured on this machine, cached, and checked.

A ForwardProfile holds seconds per forward pass by (rows, tokens per row),
interpolated in log space. `measure` times any VerifierBackend over
synthetic chains; `load_or_measure` caches the result per backend identity
(model, dtype, device, threads, slots, machine) with the conditions it was
measured under, and measures again when those were noisy (another process
held the CPU) or the times are not monotone. roofline.py builds the same
type from a hardware model instead.
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
    """Times forward passes of a backend over synthetic chains at each (rows, tokens).

    Points where speculation cannot pay are not measured but extrapolated
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
    seconds: list[list[float]] = []

    def run(r: int, t: int) -> float:
        drafts = _chains(r, t - 1)
        batch = pack(rng.integers(0, backend.info.vocab_size, r), np.full(r, context), drafts)
        t0 = time.perf_counter()
        backend.collect(backend.launch(slice(0, r), batch, np.ones(r, dtype=bool)))
        return time.perf_counter() - t0

    for _ in range(2):  # the first passes pay one-off costs (allocation, kernel selection)
        run(1, 5)
    for r in rows:
        if seconds and len(tokens) > 4 and seconds[-1][4] > STOP_RATIO * seconds[-1][0]:
            break  # not even a 4-token draft pays at this batch size: extrapolate the rest
        row_times: list[float] = []
        for t in tokens:
            if row_times and row_times[-1] > STOP_RATIO * row_times[0]:
                break
            best = float("inf")
            for _ in range(repeats):
                best = min(best, run(r, t))
                if best > 0.5:
                    break  # long enough to time once
            row_times.append(best)
        measured = len(row_times)
        row_times += [row_times[-1] * t / tokens[measured - 1] for t in tokens[measured:]]
        seconds.append(row_times)
        if log:
            log(
                f"profiled {r} rows: "
                + ", ".join(f"{t} tok {s * 1e3:.1f} ms" for t, s in zip(tokens[:measured], row_times))
            )
    last, base = rows[len(seconds) - 1], seconds[-1]
    seconds += [[s * r / last for s in base] for r in rows[len(seconds) :]]
    return ForwardProfile(rows, tokens, seconds, context)


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
    """What else ran on the machine while a profile was measured."""

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
        self.record = {
            "measured_unix": int(time.time()),
            "seconds": round(elapsed, 2),
            "cpu_model": cpu_model(),
            "cores": cores,
            "loadavg_1m_before": self.load0,
            "other_processes_cpu_share": None if other is None else round(other, 3),
        }
        return False


def _noisy_share() -> float:
    return float(os.environ.get("SSSD_PROFILE_NOISY_SHARE", NOISY_SHARE))


def profile_problem(prof: ForwardProfile) -> str | None:
    """Why a cached profile should not be trusted (None: it looks sound)."""
    if "conditions" not in prof.meta:
        return "it records no measuring conditions (measured by an older sssd)"
    other = prof.meta["conditions"].get("other_processes_cpu_share")
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


def load_or_measure(backend, log=None, force: bool = False) -> ForwardProfile:
    """The cached profile for this backend on this machine, measured on first use.

    It is measured again when asked (`force`), or when the cached one is not
    trustworthy (profile_problem: measured beside a busy process, not
    monotone, or from an older format). The measuring conditions (other
    processes' CPU share, load, CPU model) are stored beside the times, and a
    noisy measurement says so.
    """
    ident = dict(backend.identity(), machine=platform.machine(), cpu=cpu_model(), profile_version=PROFILE_VERSION)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = profiles_dir() / f"forward-{key}.json"
    if path.is_file() and not force:
        try:
            prof = ForwardProfile.from_dict(json.loads(path.read_text()))
            problem = profile_problem(prof)
            if problem is None:
                return prof
            if log:
                log(f"re-measuring the cached forward profile {path.name}: {problem}")
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if log:
        log(
            f"profiling the forward pass of {backend.info.path} (cached in {path.parent}; "
            f"`sssd serve --reprofile` measures it again)"
        )
    with Conditions() as cond:
        prof = measure(backend, log=log)
    prof.meta = {"model": backend.info.path, "identity": ident, "conditions": cond.record}
    other = cond.record["other_processes_cpu_share"]
    if log and other is not None and other > _noisy_share():
        log(
            f"WARNING: other processes used {other:.0%} of the CPU while profiling: the planner's costs may be "
            f"wrong. This profile will be measured again at the next start; run on a quiet machine."
        )
    store(path, prof.to_dict())
    return prof


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
