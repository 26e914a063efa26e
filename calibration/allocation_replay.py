"""Replayed steps for projecting the batch-wide allocation (serving/planning/allocation.py's
`project`, which `sssd plan --groundtruth` prints).

Every few tokens of each recorded output, the drafter's tree at the largest budget is drafted
from the true prefix; for each prefix of the tree (the allocation cuts a row's tree to a prefix)
the tokens the target would accept are known from the recorded output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


def replay_steps(drafter: sssd.Drafter, examples: Sequence[Example], budget: int = 64, stride: int = 4) -> ReplaySteps:
    """Trees drafted every `stride` tokens of each example's output, from the true prefix."""
    out = ReplaySteps()
    for ex in examples:
        prompt, output = np.asarray(ex.prompt, np.int64), np.asarray(ex.output, np.int64)
        for t in range(0, len(output) - 1, stride):
            tree = drafter.draft_prefix(np.concatenate([prompt, output[:t]]).tolist(), budget=budget)
            batch = concat([tree])
            matched = matched_nodes(batch, [output], np.array([t]))
            depth_if_matched = np.where(matched, batch.depths, 0)
            out.scores.append(np.asarray(batch.scores, np.float64))
            out.parents.append(np.asarray(batch.parents, np.int64))
            out.accepted.append(np.concatenate([[0], np.maximum.accumulate(depth_if_matched)]).astype(np.int64))
    return out
