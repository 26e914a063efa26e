"""What drafting costs inside a serving step, by batch size: the proposer's own time against the step's.

A proposer that vLLM calls once per step (serving/vllm_proposer.py) records each call's duration
(``propose_s``) and, at the next call, the whole step the call belonged to: its drafting plus the
interval until the next call (vLLM scheduling, the forward that verifies the drafts, sampling).
A step whose next call finds no row it already held is left out of the step figures: the engine
may have sat idle before that call (between requests, or between bursts of a server), and the
interval would count the idle time. At batch 1 that leaves out each request's last step, which
also holds the next request's prefill.

Sums are kept per batch-size bucket (BUCKETS) and are plain JSON, so that another process can
read them from a file and take differences (``difference``) before and after a run.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

#: Batch-size buckets (first, last; None: no upper end) and their labels.
BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, None))
#: The sums kept per bucket.
FIELDS = ("calls", "propose_s", "steps", "step_s", "step_propose_s")


def bucket_label(first: int, last: int | None) -> str:
    if last == first:
        return str(first)
    return f"{first}-{last}" if last is not None else f"{first}+"


LABELS = tuple(bucket_label(*b) for b in BUCKETS)


def bucket_of(batch: int) -> str:
    """The label of the bucket a batch size falls in (a batch below 1 counts as 1)."""
    for (_first, last), label in zip(BUCKETS, LABELS):
        if last is None or batch <= last:
            return label
    raise AssertionError("unreachable: the last bucket has no upper end")


def empty_sums() -> dict[str, dict[str, float]]:
    return {label: dict.fromkeys(FIELDS, 0) for label in LABELS}


class StepTiming:
    """Per-bucket sums of propose and step times (thread-safe: a writer thread may read them)."""

    def __init__(self) -> None:
        self._sums = empty_sums()
        self._lock = threading.Lock()

    def call(self, batch: int, propose_s: float) -> None:
        """One propose call of ``batch`` rows that took ``propose_s`` seconds."""
        with self._lock:
            s = self._sums[bucket_of(batch)]
            s["calls"] += 1
            s["propose_s"] += propose_s

    def step(self, batch: int, propose_s: float, step_s: float) -> None:
        """One whole step of ``batch`` rows: ``step_s`` seconds from its propose call to the next,
        ``propose_s`` of them drafting."""
        with self._lock:
            s = self._sums[bucket_of(batch)]
            s["steps"] += 1
            s["step_s"] += step_s
            s["step_propose_s"] += propose_s

    def sums(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {label: dict(s) for label, s in self._sums.items()}


def summarize(sums: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per bucket with calls, and over all of them ("all"): calls, mean propose ms, steps, mean
    step ms, and drafting's share of the step time (over the steps measured whole)."""

    def figures(s: dict[str, float]) -> dict[str, Any]:
        return {
            "calls": int(s["calls"]),
            "propose_ms": round(1000 * s["propose_s"] / s["calls"], 3) if s["calls"] else None,
            "steps": int(s["steps"]),
            "step_ms": round(1000 * s["step_s"] / s["steps"], 3) if s["steps"] else None,
            "share": round(s["step_propose_s"] / s["step_s"], 4) if s["step_s"] > 0 else None,
        }

    out = {label: figures(s) for label, s in sums.items() if s["calls"]}
    total = {f: sum(s[f] for s in sums.values()) for f in FIELDS}
    out["all"] = figures(total)
    return out


def difference(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]] | None) -> dict:
    """The sums of what happened between two readings of the same process's sums."""
    if not before:
        return {label: dict(s) for label, s in after.items()}
    return {label: {f: s[f] - before.get(label, {}).get(f, 0) for f in FIELDS} for label, s in after.items()}


class TimingWriter:
    """Writes a StepTiming's sums and summary as JSON to ``path`` every ``interval`` seconds, from a
    daemon thread (atomically: a temporary file, then a rename). ``{pid}`` in the path is replaced
    by the process id (one file per worker process)."""

    def __init__(self, timing: StepTiming, path: str | os.PathLike, interval: float = 1.0):
        self.timing = timing
        self.path = Path(str(path).replace("{pid}", str(os.getpid())))
        self.interval = max(0.05, float(interval))
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sssd-vllm-timing", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval)
            try:
                self.write()
            except OSError:  # a full disk or a removed folder costs the timing file, never the engine
                pass

    def write(self) -> None:
        sums = self.timing.sums()
        doc = {"pid": os.getpid(), "written": time.time(), "sums": sums, "summary": summarize(sums)}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, self.path)


def read(path: str | os.PathLike, newer_than: float = 0.0, timeout: float = 10.0) -> dict | None:
    """A timing file's contents once it was written after ``newer_than`` (time.time()), waiting up to
    ``timeout`` seconds; None when it never was."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            doc = json.loads(Path(path).read_text())
            if doc.get("written", 0) > newer_than:
                return doc
        except (OSError, ValueError):  # not there yet
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
