"""Replayed steps for projecting the batch-wide allocation (serving/planning/projection.py's
`project`, which `sssd plan --groundtruth` prints).

Every few tokens of each recorded output, the drafter's tree at the largest budget is drafted
from the true prefix; for each prefix of the tree (the allocation cuts a row's tree to a prefix)
the tokens the target would accept are known from the recorded output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

import sssd
from sssd.tree import concat

from .replay import Example, matched_nodes


@dataclass
class ReplaySteps:
    """Per replayed step: the tree's node scores and parents (tree order), and the tokens accepted
    when only its first k nodes are verified, k = 0..n (the bonus token not counted)."""

    scores: list[np.ndarray] = field(default_factory=list)
    parents: list[np.ndarray] = field(default_factory=list)
    accepted: list[np.ndarray] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.scores)

    def extend(self, other: ReplaySteps) -> None:
        self.scores += other.scores
        self.parents += other.parents
        self.accepted += other.accepted


def replay_steps(
    drafter: sssd.Drafter, examples: Sequence[Example], budget: int = 64, stride: int | None = None
) -> ReplaySteps:
    """The steps of decoding each example's output with trees of `budget`: each step drafts from the
    true prefix and moves on by what the whole tree accepted, plus the bonus token, as decoding
    does. (Sampling positions evenly instead, `stride` tokens apart, over-weights long accepted runs,
    which decoding crosses in one step.)"""
    out = ReplaySteps()
    for ex in examples:
        prompt, output = np.asarray(ex.prompt, np.int64), np.asarray(ex.output, np.int64)
        t = 0
        while t < len(output) - 1:
            tree = drafter.draft_prefix(np.concatenate([prompt, output[:t]]).tolist(), budget=budget)
            batch = concat([tree])
            matched = matched_nodes(batch, [output], np.array([t]))
            depth_if_matched = np.where(matched, batch.depths, 0)
            accepted = np.concatenate([[0], np.maximum.accumulate(depth_if_matched)]).astype(np.int64)
            out.scores.append(np.asarray(batch.scores, np.float64))
            out.parents.append(np.asarray(batch.parents, np.int64))
            out.accepted.append(accepted)
            t += stride if stride else int(accepted[-1]) + 1
    return out


def replay_groundtruth(
    drafter: sssd.Drafter,
    paths: Sequence,
    limit: int,
    last: bool = False,
    max_tokens: int | None = None,
    budget: int = 64,
) -> ReplaySteps:
    """replay_steps over `sssd groundtruth` files: `limit` examples of each (the first ones, or the
    last ones with `last`: a set's evaluation end), each output cut at `max_tokens` where given (as
    a run that stopped there decoded it). Every path is checked before any replay starts."""
    from .ground_truth import load_groundtruth

    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    for path in paths:  # a mistyped path is named before minutes of replay
        if not Path(path).is_file():
            raise FileNotFoundError(f"ground truth {path}: no such file")
    steps = ReplaySteps()
    for path in paths:
        _, examples = load_groundtruth(str(path))
        chosen = examples[-limit:] if last else examples[:limit]
        if max_tokens is not None:
            chosen = [dataclasses.replace(e, output=e.output[:max_tokens]) for e in chosen]
        steps.extend(replay_steps(drafter, chosen, budget=budget))
    return steps
