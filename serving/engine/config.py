"""EngineConfig: how an engine is sized and how it decodes (checked at construction)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import sssd

#: Request ids are 63-bit non-negative ints everywhere (the API, the engine, the drafter).
MAX_REQUEST_ID = 2**63 - 1
#: What the engine drafts with unless told otherwise: retrieval (the datastore and the request's own
#: text) and the other requests' recent outputs (sssd.RecentOutputs), which raise the accepted tokens
#: per step on every evaluation set (benchmarks/RESULTS.md, "Across requests") for ~5 us a request-step.
DEFAULT_DRAFT = ("retrieval", "recent")
#: How drafting runs beside verification (EngineConfig.draft_mode).
DRAFT_MODES = ("serial", "async")
#: How an engine without a fixed budget shares verification (EngineConfig.allocation).
ALLOCATIONS = ("batch", "per-size")
#: When the machine's measurements are taken (EngineConfig.measure).
MEASURE_WHEN = ("background", "now")


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizing and behaviour.

    Attributes:
        max_running: KV slots: requests decoded concurrently (the batch size cap).
        max_model_len: tokens per slot: prompt + output + one draft tree.
        max_waiting: queued requests beyond which add_request refuses (back-pressure).
        prefill_chunk: prompt tokens written per step across prefilling requests.
        fuse_prefill: write a step's prompt chunk in its decode pass where the backend can (one
            pass a step instead of two: a request that joins alone pays no pass of its own).
        speculate: draft and verify (False: plain decoding, same engine).
        source_evidence: correct each request's draft sources by their measured acceptance on that
            request (sssd.source_evidence: a request that copies other requests' answers trusts the
            recent source more, the chat datastore less); False: the calibration's scores alone.
        budget: a fixed draft budget: every request drafts that many nodes with every listed
            source, whatever the cost models say. None lets the engine decide each step: with
            allocation "batch", one budget shared across the batch by expected acceptance
            (planning/allocation.py); with "per-size", one budget per batch size
            (planning/planner.py). Either spends nothing where nothing pays.
        allocation: "batch" (the default) or "per-size" (see budget).
        dtype / device / threads: how the model runs.
        reprofile: measure the planner's forward-time profile again instead of using the cached one.
        measure: when the machine's measurements that are not cached yet (the linear plan, the
            forward profile) are taken: "background" (the default; $SSSD_MEASURE overrides it):
            between requests, piece by piece, the engine serving from the start with torch's layers
            and a conservative cost model until they are in and trusted
            (planning/measurements.py); "now": before the engine's first request, as it starts.
        datastore_residency: how the datastores' pages are kept in memory (sssd.datastore.RESIDENCY):
            "warm" (read in at start, the default), "lock" (also pinned: never reclaimed) or "lazy".
        draft_mode: "serial" drafts each step before its forward pass; "async" grows the next
            step's trees on a drafting thread while the target verifies (serving.async_draft),
            where measured to pay (else those steps run serially).
        draft_threads: torch threads of the async drafting thread (a draft model's passes);
            None: as many as the verifier's.
    """

    max_running: int = 32
    max_model_len: int = 2048
    max_waiting: int = 1024
    prefill_chunk: int = 512
    fuse_prefill: bool = True
    speculate: bool = True
    source_evidence: bool = True
    budget: int | None = None
    allocation: str = "batch"
    dtype: str = "float32"
    device: str | None = None
    threads: int | None = None
    reprofile: bool = False
    measure: str = field(default_factory=lambda: os.environ.get("SSSD_MEASURE", "background"))
    datastore_residency: str = "warm"
    pipeline_stages: int = 1
    draft_mode: str = "serial"
    draft_threads: int | None = None

    def __post_init__(self):
        from sssd.datastore import RESIDENCY

        if self.datastore_residency not in RESIDENCY:
            raise ValueError(
                f"datastore_residency must be one of {', '.join(RESIDENCY)}, got {self.datastore_residency!r}"
            )
        if (
            isinstance(self.pipeline_stages, bool)
            or not isinstance(self.pipeline_stages, int)
            or self.pipeline_stages < 1
        ):
            raise ValueError(f"pipeline_stages must be an int >= 1, got {self.pipeline_stages!r}")
        if self.pipeline_stages > 1 and self.draft_mode != "serial":
            raise ValueError(
                f"draft_mode {self.draft_mode!r} does not apply with pipeline stages: their decode loop "
                f"(SpecPipe, serving/drafting/specpipe.py) drafts serially"
            )
        for name in ("max_running", "max_model_len", "max_waiting", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {', '.join(DRAFT_MODES)}, got {self.draft_mode!r}")
        if self.draft_threads is not None and self.draft_threads < 1:
            raise ValueError(f"draft_threads must be >= 1, got {self.draft_threads}")
        if self.device is not None:  # before any model is pulled or loaded: what this machine has instead
            from sssd.serving.backends.devices import resolve

            resolve(self.device)
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(
                f"threads must be an int >= 1, got {self.threads!r} (None: the cores this process may use)"
            )
        if self.measure not in MEASURE_WHEN:
            raise ValueError(f"measure must be one of {', '.join(MEASURE_WHEN)}, got {self.measure!r}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}")
        if self.budget is not None and not 0 <= self.budget <= int(sssd._core.MAX_BUDGET):
            raise ValueError(f"budget must be in [0, {int(sssd._core.MAX_BUDGET)}], got {self.budget}")
