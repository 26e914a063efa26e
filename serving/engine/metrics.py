"""The engine's counters and timings (EngineMetrics), and the histogram type they use.

The HTTP server exports them in Prometheus' format (frontends/prometheus.py); benchmarks read them.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # pragma: no cover
    from sssd.serving.engine.requests import Request


class Histogram:
    """Cumulative Prometheus histogram."""

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def __init__(self, buckets=BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        running = 0
        for le, c in zip(self.buckets, self.counts):
            running += c
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class EngineMetrics:
    """Counters and timings of the engine (the server exports them)."""

    def __init__(self):
        self.steps = 0
        self.decode_tokens = 0  # tokens emitted by decode steps
        self.prefill_tokens = 0
        self.num_drafts = 0  # requests x steps with a draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: dict[int, int] = {}
        self.draft_time = Histogram()
        self.step_time = Histogram()
        self.accepted_by_source: dict[str, int] = {}
        self.prefill_seconds = 0.0  # passes that only wrote prompts (fused chunks are in the decode steps' time)
        self.prefill_passes = 0  # passes of their own
        self.prefill_fused = 0  # chunks written by a decode step's pass
        self.budgets: dict[int, int] = {}  # budget -> steps that used it
        self.finished_requests = 0
        self.finish_reasons: dict[str, int] = {}
        self.kv_moves = 0  # accepted paths that were not the first branch (moved in the cache)
        self.draft_seconds = 0.0  # totals, for the engine-overhead benchmark
        self.forward_seconds = 0.0
        #: per decode step, its phases' perf_counter marks (None: not recorded; a list records them)
        self.timeline: list[dict] | None = None

    def prefill(self, tokens: int, seconds: float, fused: bool = False) -> None:
        self.prefill_tokens += tokens
        self.prefill_seconds += seconds
        if fused:
            self.prefill_fused += 1
        else:
            self.prefill_passes += 1

    def decode_step(
        self,
        batch: int,
        tokens_in: int,
        budget: int,
        t_draft: float,
        t_forward: float,
        emitted: int,
        accepted: Iterable[int],
    ) -> None:
        self.steps += 1
        self.decode_tokens += emitted
        self.budgets[budget] = self.budgets.get(budget, 0) + 1
        if budget:
            self.num_drafts += batch
            self.num_draft_tokens += tokens_in - batch
        for a in accepted:
            self.num_accepted_tokens += a
            for pos in range(a):
                self.accepted_per_pos[pos] = self.accepted_per_pos.get(pos, 0) + 1
        self.draft_time.observe(t_draft)
        self.step_time.observe(t_draft + t_forward)
        self.draft_seconds += t_draft
        self.forward_seconds += t_forward

    def finished(self, req: Request) -> None:
        self.finished_requests += 1
        self.finish_reasons[req.finish_reason] = self.finish_reasons.get(req.finish_reason, 0) + 1


def timeline_entry(plan: Any, job: Any, emitted: int, accepted: int, now: float) -> dict:
    """A decode step's phases for the timeline: drafting (prepare), forward, acceptance and the
    rest of finish, the wait for the drafting thread, and that thread's own drafting."""
    t = plan.times
    out = {
        "batch": len(plan.requests),
        "budget": plan.budget,
        "mode": plan.mode,
        "emitted": emitted,
        "start": plan.started,
        "prepared": t.get("prepared", plan.started),
        "launched": t.get("launched"),
        "forward": t.get("forward"),
        "accepted_at": t.get("accepted"),
        "waited": t.get("waited"),
        "end": now,
        "accepted": int(accepted),
        "prefill_tokens": plan.prefill.tokens if getattr(plan, "prefill", None) is not None else 0,
    }
    if job is not None:
        out.update(draft_start=job.started, draft_end=job.ended)
    return out
