"""A request's own acceptance by source: how each source's drafts fare on this request.

The merge ranks every candidate by its source's calibrated score, fitted once
over many requests. Requests differ: on agent loops that restate their plans,
the other requests' outputs (the recent source) are accepted 1.7-2.7x as often
as their first-level scores say and the chat datastore's guesses a third to a
half as often; on chat answers the scores hold. So each request keeps, per source, what its
drafted candidates were expected to get and what they got, and the merge
corrects that source's priorities for that request
(``Drafter.draft(source_factors=...)``):

    priority * scale[source] * level[source] ** (depth - 1)

- ``scale``: observed / expected acceptances of the source's candidates at
  depth 1 (each expected to be accepted with its score);
- ``level``: the same for deeper candidates, each expected to follow its
  parent with its conditional odds (its score over its parent's), counted
  only where the parent was accepted and only for candidates the source
  rates at least ``level_floor`` (the ones a path is drafted deep along; a
  source's long tail of unlikely siblings says little about them).

Both start at 1 (the calibration) and move with the evidence: each ratio is
(observed + prior) / (expected + prior), ``prior`` expected acceptances of
weight, and evidence decays by half every ``half_life`` scored steps (a
request that changes what it does is re-learned within a few dozen steps).
They are clipped to ``scale_bounds`` / ``level_bounds``. Expected counts use
the scores without this request's correction, so the factors do not feed on
themselves.

Every drafted candidate counts whether or not the step verified it (an
allocation may verify part of a tree): the tokens the target emitted decide
it, a candidate at depth d being right iff its path equals the next d tokens;
candidates deeper than the emitted tokens, or under a wrong parent, are not
counted. It never changes what is accepted, only what is drafted (lossless
by construction). A tree is scored only by the tokens that directly follow
the context it was drafted for.

The bookkeeping is C++ (sssd._core.SourceEvidence,
cpp/include/sssd/source_evidence.h; tests/test_source_evidence.py checks it
node by node against a Python reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sssd import _core
from sssd._tokens import pack_tokens

#: Source tags (the merge's score-table rows: datastore, input, external 2.., copy).
MAX_SOURCES = int(_core.MAX_SOURCES)


@dataclass(frozen=True)
class EvidenceSettings:
    """How a request's evidence corrects its sources.

    Attributes:
        prior: the calibration's weight, in expected acceptances.
        half_life: scored steps after which a step's evidence weighs half.
        level_floor: deeper candidates count for ``level`` only at conditional odds >= this.
        scale_bounds / level_bounds: the corrections' range.
    """

    prior: float = 2.0
    half_life: float = 16.0
    level_floor: float = 0.3
    scale_bounds: tuple[float, float] = (0.25, 4.0)
    level_bounds: tuple[float, float] = (0.5, 1.5)

    def __post_init__(self):
        if not (0 < self.prior < np.inf):
            raise ValueError(f"prior must be > 0, got {self.prior}")
        if not (0 < self.half_life < np.inf):
            raise ValueError(f"half_life must be > 0, got {self.half_life}")
        if not (0 <= self.level_floor <= 1):
            raise ValueError(f"level_floor must be in [0, 1], got {self.level_floor}")
        for name, (lo, hi) in (("scale_bounds", self.scale_bounds), ("level_bounds", self.level_bounds)):
            if not (0 <= lo <= 1 <= hi < np.inf):
                raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= 1 <= hi, got {(lo, hi)}")


#: The settings a DraftPipeline corrects its requests' sources with unless told otherwise.
DEFAULT_EVIDENCE = EvidenceSettings()


class SourceEvidence:
    """Per open request: observed and expected acceptances by source, and the factors they give.

    The owner (sssd.sources.DraftPipeline) calls open / drafted / extended / close as
    requests go; ``factors`` gives the merge's corrections for a batch. Thread-safe.
    """

    def __init__(self, settings: EvidenceSettings | None = None):
        self.settings = s = settings or DEFAULT_EVIDENCE
        self._native = _core.SourceEvidence(s.prior, s.half_life, s.level_floor, s.scale_bounds, s.level_bounds)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._native

    def __len__(self) -> int:
        return len(self._native)

    def open(self, request_id: int, context_length: int) -> None:
        """Starts (or restarts) a request whose context is `context_length` tokens long."""
        self._native.open(int(request_id), int(context_length))

    def close(self, request_id: int) -> None:
        self._native.close(int(request_id))

    def counts(self, request_id: int) -> np.ndarray:
        """[4, MAX_SOURCES]: observed, expected at depth 1; observed, expected deeper."""
        return self._native.counts(int(request_id))

    def factors(self, request_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """[B, MAX_SOURCES, 2] float32: each request's (scale, level) per source tag (1 for ids not open)."""
        return self._native.factors(np.asarray(request_ids, dtype=np.int64))

    def drafted(
        self, request_ids: Sequence[int] | np.ndarray, lengths: Sequence[int], batch, factors: np.ndarray | None
    ) -> None:
        """Keeps `batch`'s trees (a DraftBatch drafted with `factors`, None: all 1) for requests whose
        contexts were `lengths` tokens long, until their next tokens come (``extended``)."""
        arrays = {
            "offsets": batch.offsets,
            "tokens": batch.tokens,
            "parents": batch.parents,
            "depths": batch.depths,
            "sources": batch.sources,
            "scores": batch.scores,
        }
        self._native.drafted(
            np.asarray(request_ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64), arrays, factors
        )

    def extended(self, request_ids: Sequence[int] | np.ndarray, tokens: Sequence[np.ndarray]) -> None:
        """The requests' next tokens: each kept tree drafted at this context is scored by them."""
        self.extended_packed(np.asarray(request_ids, dtype=np.int64), *pack_tokens(tokens))

    def extended_packed(self, request_ids: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> None:
        """`extended` with the tokens already packed (sssd._tokens.pack_tokens; request_ids int64)."""
        self._native.extended(request_ids, offsets, tokens)


__all__ = ["DEFAULT_EVIDENCE", "EvidenceSettings", "SourceEvidence", "MAX_SOURCES"]
