"""Fitting a draft source's discount beside retrieval (``sssd calibrate --draft model:<name>``).

A draft model's candidates enter retrieval's priority queue with a discount
(sssd.config.SourceDiscount: scale and depth decay on top of the weights the
source gives them). Which discount ranks them right against retrieval's
candidates is a question for replay, like the rest of calibration; but a
draft model costs forward passes at every step, so a full replay per grid
point would multiply the run by the grid's size.

Instead every grid point is scored on the same trajectory. At each step of
the replay of the development split (greedy ground truth, as in replay.py),
the source proposes once, and one drafter per grid point (each holding that
point's discount in its merge's score table) merges the proposal with its
own retrieval tree; every tree is matched against the ground truth. The
trajectory advances by the accepted length of the reference drafter (the
source's current discount), so all points see the same contexts, and each
point's estimate is the mean over steps of (its accepted length + 1), capped
by the tokens left: the MAT it would have at those positions. Retrieval
alone is scored the same way, as the baseline.

The estimate differs from a full replay only in which positions are visited
(the reference's, not the point's own); it is exact for the reference, and a
fair comparison between points because they see identical inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from sssd.calibration.replay import Example, accepted_lengths, matched_nodes
from sssd.config import DrafterConfig, SourceDiscount

#: The grid: the discount's scale and depth decay (match damping does not apply to a model's nodes).
DEFAULT_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
DEFAULT_DECAYS = (0.8, 1.0)


@dataclass
class DiscountFit:
    """What fitting one source's discount measured.

    Attributes:
        source: the source's calibration key (e.g. "model:qwen2.5-coder-0.5b-instruct").
        budget: the budget every step drafted with.
        reference: the discount the trajectory followed (the source's own before the fit).
        grid: every discount tried and its MAT estimate (module docstring), in grid order.
        retrieval_mat: retrieval alone at the same positions.
        steps: decoding steps replayed (summed over the examples); tokens: output tokens covered.
    """

    source: str
    budget: int
    reference: SourceDiscount
    grid: list[tuple[SourceDiscount, float]] = field(default_factory=list)
    retrieval_mat: float = float("nan")
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def best(self) -> SourceDiscount:
        """The discount of the highest estimate; within 0.1% of it, the one closest to the reference
        (a tie changes nothing)."""
        top = max(m for _, m in self.grid)
        tied = [d for d, m in self.grid if m >= top * 0.999]
        return min(
            tied,
            key=lambda d: (
                abs(np.log(d.scale / self.reference.scale)),
                abs(d.depth_decay - self.reference.depth_decay),
            ),
        )

    @property
    def best_mat(self) -> float:
        return dict((d, m) for d, m in self.grid)[self.best]

    @property
    def reference_mat(self) -> float:
        return dict((d, m) for d, m in self.grid).get(self.reference, float("nan"))

    def to_dict(self) -> dict:
        """The calibration file's entry for the source (sssd.calibration_file reads "discount")."""
        return {
            "discount": _discount_dict(self.best),
            "budget": self.budget,
            "mat": round(self.best_mat, 4),
            "mat_reference": round(self.reference_mat, 4),
            "mat_retrieval_alone": round(self.retrieval_mat, 4),
            "steps": self.steps,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 1),
            "grid": [{**_discount_dict(d), "mat": round(m, 4)} for d, m in self.grid],
        }


def _discount_dict(d: SourceDiscount) -> dict:
    return {
        "scale": d.scale,
        "depth_decay": d.depth_decay,
        "match_damping": d.match_damping,
        "full_match": d.full_match,
    }


def discount_grid(
    reference: SourceDiscount, scales: Sequence[float] = DEFAULT_SCALES, decays: Sequence[float] = DEFAULT_DECAYS
) -> list[SourceDiscount]:
    """Every (scale, depth decay) pair, the reference first (kept once)."""
    out = [reference]
    for s in scales:
        for dd in decays:
            d = SourceDiscount(
                scale=float(s),
                depth_decay=float(dd),
                match_damping=reference.match_damping,
                full_match=reference.full_match,
            )
            if d not in out:
                out.append(d)
    return out


def fit_source_discount(
    examples: Sequence[Example],
    datastore,
    config: DrafterConfig,
    source,
    budget: int,
    grid: Sequence[SourceDiscount] | None = None,
    *,
    batch_size: int = 8,
    key: str | None = None,
    vocab_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DiscountFit:
    """Scores every discount of `grid` for `source` beside retrieval (module docstring).

    Args:
        examples: development-split prompts and the target's greedy outputs.
        datastore: retrieval's Datastore (None: the requests' own tokens only).
        config: retrieval's DrafterConfig at this budget (e.g. the calibration file's entry).
        source: a DraftSource (sssd.sources), e.g. a serving.model_drafter.ModelDrafter, with room
            for `batch_size` requests; its proposals are asked for at every step.
        budget: the draft budget of every step.
        grid: the discounts to try (default: discount_grid(source.discount)); the first is the reference.
        batch_size: examples replayed in lockstep.
        key: the source's calibration key (default: its name).
        vocab_size: candidates at or above it are refused (Candidates.check).
        progress: called with (output tokens covered, total output tokens).

    Raises:
        ValueError: no examples, or a budget below 1.
    """
    from sssd.drafter import Drafter
    from sssd.sources import DraftRequest, _concat_candidates

    if not examples:
        raise ValueError("no examples to fit the discount on")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    grid = list(grid) if grid is not None else discount_grid(source.discount)
    cfg = config.replace(budget=budget)
    drafters = [Drafter(datastore, cfg, external_sources=(d,)) for d in grid]
    alone = Drafter(datastore, cfg)
    fit = DiscountFit(key or source.name, budget, grid[0])
    gained = np.zeros(len(grid) + 1, np.int64)  # tokens each drafter's steps would have advanced (alone last)
    total = sum(len(e.output) for e in examples)
    t0 = time.perf_counter()
    todo = [i for i, e in enumerate(examples) if len(e.output)]
    for lo in range(0, len(todo), batch_size):
        chunk = todo[lo : lo + batch_size]
        pos = {i: 0 for i in chunk}
        for i in chunk:
            prompt = np.asarray(examples[i].prompt, dtype=np.int64)
            source.open(i, prompt)
            for d in (*drafters, alone):
                d.open(i, prompt)
        while pos:
            ids = np.fromiter(pos, dtype=np.int64, count=len(pos))
            at = np.fromiter(pos.values(), dtype=np.int64, count=len(pos))
            outputs = [np.asarray(examples[i].output, dtype=np.int64) for i in ids]
            history = [
                np.concatenate([np.asarray(examples[i].prompt, dtype=np.int64), o[:p]])
                for i, o, p in zip(ids.tolist(), outputs, at.tolist())
            ]
            proposals = source.propose([DraftRequest(int(i), h, budget) for i, h in zip(ids, history)])
            per_request = [[(2, c.check(vocab_size))] if c is not None else [] for c in proposals]
            external = _concat_candidates(per_request)
            left = np.fromiter((len(o) for o in outputs), dtype=np.int64, count=len(outputs)) - at
            advance = None
            for k, d in enumerate((*drafters, alone)):
                batch = d.draft(ids, budget, external if k < len(drafters) else None)
                got = np.minimum(accepted_lengths(batch, matched_nodes(batch, outputs, at)) + 1, left)
                gained[k] += int(got.sum())
                if k == 0:
                    advance = got  # the reference drives the trajectory
            fit.steps += len(ids)
            for i, o, p, a, r in zip(ids.tolist(), outputs, at.tolist(), advance.tolist(), left.tolist()):
                new = o[p : p + a]
                source.extend(i, new)
                for d in (*drafters, alone):
                    d.extend(i, new)
                if a >= r:
                    source.close(i)
                    for d in (*drafters, alone):
                        d.close(i)
                    del pos[i]
                else:
                    pos[i] = p + a
            fit.tokens = int(gained[0])
            if progress:
                progress(fit.tokens, total)
    fit.grid = [(d, float(gained[k] / fit.steps)) for k, d in enumerate(grid)]
    fit.retrieval_mat = float(gained[-1] / fit.steps)
    fit.seconds = time.perf_counter() - t0
    return fit
