"""Replay: what a drafter would achieve on recorded target outputs.

For greedy decoding this is exact: at every step the drafter sees the prompt
plus the output so far and drafts a tree; the target model would accept the
longest root-to-node path that equals the next output tokens, then emit its
own next token (the "bonus" token). So the step advances by accepted + 1 and
the numbers are the ones running the model would give, without running it.

Definitions (reported by every tool that replays):
  steps   decoding steps (target forward passes) to produce the outputs
  MAT     mean accepted tokens per step, bonus token included:
          output tokens / steps (1.0 = no speculation)

All sequences replay in lockstep, so each step is one batched draft call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

import sssd
from sssd.config import SOURCE_NAMES


@dataclass
class Example:
    """One recorded generation: the prompt and the target's output (token ids)."""

    prompt: np.ndarray
    output: np.ndarray


@dataclass
class ReplayResult:
    """What a replay measured. See the module docstring for the definitions."""

    budget: int
    steps: int = 0
    tokens: int = 0
    draft_seconds: float = 0.0
    update_seconds: float = 0.0
    draft_calls: int = 0
    drafted_per_depth: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    accepted_per_depth: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    per_example_mat: list[float] = field(default_factory=list)
    #: per drafted node, if requested: source, depth, match_len, prob, score, accepted
    nodes: dict[str, np.ndarray] | None = None

    @property
    def mat(self) -> float:
        return self.tokens / self.steps if self.steps else float("nan")

    @property
    def acceptance_per_depth(self) -> np.ndarray:
        """Fraction of the steps whose accepted path reached each depth (1, 2, ...)."""
        return self.accepted_per_depth / max(self.steps, 1)

    @property
    def draft_us_per_call(self) -> float:
        """Drafting time per request and step (µs), amortised over the batched calls."""
        return 1e6 * self.draft_seconds / max(self.steps, 1)

    @property
    def update_us_per_call(self) -> float:
        """Time per request and step (µs) to append the accepted tokens to the drafter's state
        (request tries, or a peer's per-request and global caches)."""
        return 1e6 * self.update_seconds / max(self.steps, 1)

    def source_shares(self) -> dict[str, float]:
        total = sum(self.accepted_by_source.values())
        return {k: v / total for k, v in self.accepted_by_source.items()} if total else {}

    def summary(self) -> dict:
        return {
            "budget": self.budget,
            "mat": round(self.mat, 4),
            "steps": self.steps,
            "tokens": self.tokens,
            "draft_us_per_call": round(self.draft_us_per_call, 2),
            "update_us_per_call": round(self.update_us_per_call, 2),
            "acceptance_per_depth": [round(float(x), 4) for x in self.acceptance_per_depth[1:9]],
            "source_shares": {k: round(v, 4) for k, v in self.source_shares().items()},
        }


def matched_nodes(batch: sssd.DraftBatch, targets: Sequence[np.ndarray], positions: np.ndarray) -> np.ndarray:
    """For every node of every tree: does its whole path equal the target's next tokens?

    Request b's node at depth d matches if its token is targets[b][positions[b] + d - 1]
    and its parent matches (vectorised over the batch, one numpy pass per depth).
    """
    n = batch.tokens.shape[0]
    matched = np.zeros(n, dtype=bool)
    if n == 0:
        return matched
    B = len(batch)
    req = np.repeat(np.arange(B), np.diff(batch.offsets))
    glob_parent = np.where(batch.parents >= 0, batch.parents + batch.offsets[req], -1)
    lens = np.fromiter((len(t) for t in targets), dtype=np.int64, count=B)
    starts = np.zeros(B, dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in targets]) if B else np.zeros(0, np.int64)
    want_idx = positions[req] + batch.depths - 1
    valid = want_idx < lens[req]
    want = np.where(valid, flat[np.minimum(starts[req] + want_idx, max(len(flat) - 1, 0))], -1)
    ok = valid & (batch.tokens == want)
    for d in range(1, int(batch.depths.max()) + 1):
        at = batch.depths == d
        parents = glob_parent[at]
        matched[at] = ok[at] & np.where(parents >= 0, matched[np.maximum(parents, 0)], True)
    return matched


def accepted_lengths(batch: sssd.DraftBatch, matched: np.ndarray) -> np.ndarray:
    """Per request, the depth of its deepest matched node (0 if none)."""
    acc = np.zeros(len(batch), dtype=np.int64)
    if matched.any():
        req = np.repeat(np.arange(len(batch)), np.diff(batch.offsets))
        np.maximum.at(acc, req[matched], batch.depths[matched])
    return acc


def replay(
    drafter: sssd.Drafter,
    examples: Sequence[Example],
    budget: int,
    *,
    batch_size: int = 256,
    record_nodes: bool = False,
    max_depth: int = 64,
) -> ReplayResult:
    """Replays greedy decoding of every example with ``drafter`` at ``budget``.

    Args:
        drafter: a Drafter with no open requests (request ids 0.. are used).
        examples: prompts and the target's outputs.
        budget: draft tree size per step.
        batch_size: sequences replayed in lockstep (one draft call per step).
        record_nodes: also return every drafted node's source, depth, match
            length, probability, score and whether it matched (calibration data).
    """
    if not examples:
        raise ValueError("no examples to replay")
    res = ReplayResult(budget=budget)
    drafted = np.zeros(max_depth + 2, np.int64)
    accepted = np.zeros(max_depth + 2, np.int64)
    by_source = np.zeros(max(SOURCE_NAMES) + 1, np.int64)
    rec: dict[str, list] = {k: [] for k in ("source", "depth", "match_len", "prob", "score", "accepted")}
    queue = list(range(len(examples)))[::-1]
    active: dict[int, int] = {}  # request id (= example index) -> position in its output
    steps_of = np.zeros(len(examples), np.int64)

    def admit():
        while queue and len(active) < batch_size:
            i = queue.pop()
            if len(examples[i].output) == 0:
                continue
            drafter.open(i, examples[i].prompt)
            active[i] = 0

    admit()
    while active:
        ids = np.fromiter(active.keys(), dtype=np.int64, count=len(active))
        pos = np.fromiter(active.values(), dtype=np.int64, count=len(active))
        outputs = [examples[i].output for i in ids]
        t0 = time.perf_counter()
        batch = drafter.draft(ids, budget)
        res.draft_seconds += time.perf_counter() - t0
        res.draft_calls += 1
        matched = matched_nodes(batch, outputs, pos)
        acc = accepted_lengths(batch, matched)
        remaining = np.fromiter((len(o) for o in outputs), dtype=np.int64, count=len(outputs)) - pos
        advance = np.minimum(acc + 1, remaining)
        # statistics
        np.add.at(drafted, np.minimum(batch.depths, max_depth + 1), 1)
        hits = np.minimum(acc, max_depth + 1)
        for d in range(1, int(hits.max()) + 1 if hits.size else 1):
            accepted[d] += int((hits >= d).sum())
        if matched.any():
            by_source += np.bincount(batch.sources[matched], minlength=by_source.size)[: by_source.size]
        if record_nodes:
            rec["source"].append(batch.sources)
            rec["depth"].append(batch.depths)
            rec["match_len"].append(batch.match_lens)
            rec["prob"].append(batch.probs)
            rec["score"].append(batch.scores)
            rec["accepted"].append(matched)
        res.steps += len(ids)
        res.tokens += int(advance.sum())
        steps_of[ids] += 1
        appended = [o[p : p + a] for o, p, a in zip(outputs, pos, advance)]
        t0 = time.perf_counter()
        drafter.extend_batch(ids, appended)
        res.update_seconds += time.perf_counter() - t0
        for i, p, a, r in zip(ids.tolist(), pos.tolist(), advance.tolist(), remaining.tolist()):
            if a >= r:
                drafter.close(i)
                del active[i]
            else:
                active[i] = p + a
        admit()
    res.drafted_per_depth = drafted
    res.accepted_per_depth = accepted
    res.accepted_by_source = {SOURCE_NAMES[s]: int(by_source[s]) for s in SOURCE_NAMES}
    res.per_example_mat = [len(e.output) / s for e, s in zip(examples, steps_of) if s]
    if record_nodes:
        res.nodes = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in rec.items()}
    return res
