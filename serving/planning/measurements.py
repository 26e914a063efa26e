"""The start-up measurements an engine takes between requests instead of before its first one.

A new engine on a CPU wants two measurements of its machine: the linear plan
(which matrix-product kernel each layer takes by row count,
backends/linear_plan.py) and the forward profile (what a pass of R rows x T
tokens costs, planning/profile.py). Taken before the first request they cost
half a minute on a quiet 2-core machine, and ten minutes beside one busy
process, whose measurements are garbage anyway. So an engine starts at once
with what it has (cached measurements it can trust; else torch's own layers
and the conservative prior cost model, profile.prior), and takes the
measurements here, a piece at a time (one timing, tens to hundreds of
milliseconds), whenever no request is in flight (`run`). Each piece is timed
with the machine's other load (profile.Conditions):

- other processes busy while it is measured: the attempt is dropped after a
  few pieces, and tried again after RETRY_AFTER seconds (then longer), never
  in a loop; after the last retry the engine keeps what it has and says so once;
- a finished measurement is checked (profile.profile_problem: no other
  process, times that grow with the work as work can) before it is cached
  and swapped in (`on_profile`; the linear plan by its backend), so a plan
  never comes from garbage.

The linear plan comes first: the forward profile is measured with the layers
the engine will run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from sssd.serving.planning import profile as profiles

#: Seconds before a dropped or untrusted measurement is tried again, one entry per retry: then
#: the engine keeps what it has (`sssd serve --reprofile` on a quiet machine measures it).
RETRY_AFTER = (30.0, 120.0, 600.0, 1800.0)
#: Seconds of measuring after which an attempt beside a busy process is dropped.
GIVE_UP_AFTER = 1.0


@dataclass
class Job:
    """One measurement: `steps()` makes its generator (yielding after each piece, returning the
    result); `adopt(result, conditions)` caches and uses a finished one, returning why it is not
    trusted (None: adopted)."""

    name: str
    steps: Callable[[], Generator[None, None, Any]]
    adopt: Callable[[Any, profiles.Conditions], str | None]
    keeping: str  # what the engine runs with while this is not measured
    #: () -> whether a trusted cached result turned up meanwhile (adopted by it); None: never looks
    cached: Callable[[], bool] | None = None
    attempts: int = 0
    not_before: float = 0.0


class BackgroundMeasurements:
    """The engine's pending start-up measurements, taken piece by piece while it is idle.

    Args:
        backend: the VerifierBackend (its linear plan, if it has one to measure, and its profile).
        want_profile: whether the engine plans with a forward profile (it speculates).
        on_profile: called with a trusted, freshly measured ForwardProfile.
        quiet: () -> whether the machine is quiet enough to measure now (the engine's contention
            monitor: no piece is taken while other processes hold a core); None: always.
        log: where one line per finished, dropped or abandoned measurement goes.
    """

    def __init__(
        self,
        backend,
        want_profile: bool,
        on_profile: Callable[[profiles.ForwardProfile], None],
        quiet: Callable[[], bool] | None = None,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.backend = backend
        self.on_profile = on_profile
        self.quiet = quiet or (lambda: True)
        self.log = log or (lambda msg: None)
        self.clock = clock
        self.jobs: list[Job] = []
        self.done: list[str] = []  # the jobs adopted, in order
        self.abandoned: list[str] = []
        self._running: tuple[Job, Generator, profiles.Conditions] | None = None
        self.seconds = 0.0  # spent measuring
        if getattr(backend, "linear_plan_pending", False):
            self.jobs.append(
                Job("linear plan", backend.linear_plan_steps, backend.adopt_linear_plan, "torch's own layers")
            )
        if want_profile:
            self.jobs.append(
                Job(
                    "forward profile",
                    lambda: profiles.measure_steps(backend),
                    self._adopt_profile,
                    "the conservative prior cost model",
                    self._cached_profile,
                )
            )

    @property
    def pending(self) -> bool:
        return bool(self.jobs)

    def due_in(self) -> float:
        """Seconds until a piece is due: 0 while one is under way or due now."""
        if self._running is not None or not self.jobs:
            return 0.0
        now = self.clock()
        return max(0.0, min(job.not_before - now for job in self._eligible()))

    def _eligible(self):
        """The jobs that may start, in order: none after a linear plan still to measure (the
        profile is measured with the layers the engine will run)."""
        for job in self.jobs:
            yield job
            if job.name == "linear plan":
                return

    def status(self) -> dict:
        """What is measured, done and given up (for /health and logs)."""
        return {
            "pending": [j.name for j in self.jobs],
            "done": list(self.done),
            "abandoned": list(self.abandoned),
            "seconds": round(self.seconds, 1),
        }

    def _cached_profile(self) -> bool:
        """A trusted cached profile for the backend as it now is (its linear plan adopted) is used
        as it is."""
        prof = profiles.cached(self.backend, self.log)
        if prof is not None:
            self.on_profile(prof)
        return prof is not None

    def _adopt_profile(self, prof: profiles.ForwardProfile, cond: profiles.Conditions) -> str | None:
        problem = profiles.finish(self.backend, prof, cond)
        if problem is None:
            self.on_profile(prof)
        return problem

    def run(self, seconds: float = 0.25) -> bool:
        """Takes pieces of the pending measurements for about `seconds` (at least one piece, unless
        none is due or the machine is busy). Call it only while no request is in flight. Returns
        whether any measurement is still pending."""
        end = self.clock() + seconds
        while self.jobs and self.clock() < end:
            if self._running is None and not self._start():
                break
            job, steps, cond = self._running
            t0 = time.perf_counter()
            try:
                with cond.piece():
                    next(steps)
                finished, result = False, None
            except StopIteration as stop:
                finished, result = True, stop.value
            except Exception as e:  # noqa: BLE001 - a failed measurement costs the measurement, never the engine
                self._drop(job, f"it failed ({type(e).__name__}: {e})")
                continue
            finally:
                self.seconds += time.perf_counter() - t0
            busy = cond.share is not None and cond.share > profiles._noisy_share()
            if busy and cond.elapsed >= GIVE_UP_AFTER and not finished:
                steps.close()
                self._drop(job, f"other processes used {cond.share:.0%} of the CPU while it was measured")
                continue
            if finished:
                problem = job.adopt(result, cond)
                self._running = None
                if problem is None:
                    self.jobs.remove(job)
                    self.done.append(job.name)
                    self.log(
                        f"measured the {job.name} between requests in {cond.elapsed:.1f} s of passes; "
                        f"using it from now on"
                    )
                else:
                    self._drop(job, problem)
        return bool(self.jobs)

    def _start(self) -> bool:
        """Starts the first job that is due, if the machine is quiet; whether one started."""
        now = self.clock()
        for job in self._eligible():
            if job.not_before <= now:
                if job.cached is not None and job.cached():
                    self.jobs.remove(job)
                    self.done.append(job.name)
                    self.log(f"using the cached {job.name} for the layers as they now are")
                    return bool(self.jobs) and self._start()
                if not self.quiet():
                    return False
                job.attempts += 1
                cond = profiles.Conditions()
                self._running = (job, job.steps(), cond)
                return True
        return False

    def _drop(self, job: Job, why: str) -> None:
        self._running = None
        if job.attempts > len(RETRY_AFTER):
            self.jobs.remove(job)
            self.abandoned.append(job.name)
            keeping = job.keeping
            self.log(
                f"WARNING: gave up measuring the {job.name} after {job.attempts} tries ({why}); keeping "
                f"{keeping}. Run `sssd serve --reprofile` on a quiet machine to measure it"
            )
            return
        wait = RETRY_AFTER[job.attempts - 1]
        job.not_before = self.clock() + wait
        self.log(f"dropped the {job.name} measured between requests ({why}); trying again in {wait:.0f} s")
