"""What a step that verified no drafts would have gained had it verified them: counterfactual trees.

A greedy request's output does not depend on what was drafted (speculation is lossless), so a
tree drafted on a step that verifies nothing can be checked afterwards against the tokens the
request goes on to emit: verifying it would have accepted the deepest node whose path those tokens
spell, exactly the node accept_greedy finds, and every node whose parent was on that path was a
trial of its conditional probability (acceptance.trials), accepted or not. So while the
allocation's gate keeps a batch size plain (its speculative steps measured slower than plain
ones), the engine keeps measuring at the price of drafting alone, not of verifying: the acceptance
model goes on learning each request's rate, and a run of counterfactual steps that would have paid
calls a probe at once instead of at the probe interval (an agent trace that starts to copy a tool's
output drafts again within a few tokens, not after up to 64 plain steps).

A row resolves when the emitted tokens leave its tree (or reach a leaf), or when its request ends;
a step resolves when all its rows have. Sampled rows have no such counterfactual (what a sampled
row would have accepted depends on the draws), so only all-greedy steps are kept.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from sssd.serving.planning.acceptance import trials


@dataclass
class _Row:
    rid: int
    tokens: np.ndarray  # the nodes the step would have verified (a prefix of its tree)
    parents: np.ndarray  # local indices, -1: a child of the root
    scores: np.ndarray
    children: dict = field(default_factory=dict)  # (parent, token) -> node
    inner: frozenset = frozenset()  # the nodes with children (-1: the root, if any)
    node: int = -1  # the deepest node the emitted tokens reached so far (-1: the root)
    matched: int = 0
    walked: bool = False  # any token walked (else it resolves with no trials: nothing was tried)
    done: bool = False


@dataclass
class _Step:
    batch: int  # rows of the step (rows without a tree count: they would have emitted their bonus token)
    seconds: float  # the step's predicted seconds, had it verified its selection
    rows: list
    open: int
    worth: float = 0.0  # its selection's worth beyond the bonus tokens, as the scores had it


@dataclass
class Resolved:
    """One counterfactual step, every row resolved: the tokens it would have emitted (its rows'
    accepted nodes plus one bonus token each) in the seconds it was predicted to take, and what its
    selection's worth promised beyond the bonus tokens."""

    batch: int
    tokens: int
    seconds: float
    worth: float = 0.0


class Counterfactuals:
    """Pending counterfactual trees of greedy rows (see the module docstring).

    Args:
        max_steps: the most unresolved steps kept (the oldest resolve as they stand beyond it).
    """

    def __init__(self, max_steps: int = 64):
        self.max_steps = int(max_steps)
        self._steps: deque[_Step] = deque()
        self._rows: dict[int, list[tuple[_Step, _Row]]] = {}  # request id -> its open rows

    def __len__(self) -> int:
        """Requests with open trees."""
        return len(self._rows)

    @property
    def steps(self) -> int:
        """Unresolved counterfactual steps."""
        return len(self._steps)

    def add(
        self, batch: int, seconds: float, rows: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], worth: float = 0.0
    ) -> list:
        """A step that verified nothing: its batch size, its predicted seconds had it verified
        `rows` ((request id, tokens, local parents, scores) of the nodes it would have verified per
        row; rows without nodes need not be listed) and their worth beyond the bonus tokens.
        Returns what resolved to make room, as `advance` does."""
        step = _Step(int(batch), float(seconds), [], 0, float(worth))
        for rid, tokens, parents, scores in rows:
            if not len(tokens):
                continue
            tokens = np.asarray(tokens, dtype=np.int64)
            parents = np.asarray(parents, dtype=np.int64)
            row = _Row(int(rid), tokens, parents, np.asarray(scores, dtype=np.float64))
            row.children = {(p, t): i for i, (p, t) in enumerate(zip(parents.tolist(), tokens.tolist()))}
            row.inner = frozenset(parents.tolist())
            step.rows.append(row)
            self._rows.setdefault(row.rid, []).append((step, row))
        step.open = len(step.rows)
        self._steps.append(step)
        out: list = []
        while len(self._steps) > self.max_steps:
            old = self._steps[0]
            for row in old.rows:
                out.extend(self._close(old, row))
            out.extend(self._pop_resolved())
        out.extend(self._pop_resolved())
        return out

    def advance(self, rid: int, tokens: list[int]) -> list:
        """The tokens request `rid` emitted this step: walks its open trees. Returns what resolved:
        per row, `(request id, conditional probabilities, accepted)` (its trials, for the
        acceptance model), and per step a `Resolved`."""
        open_rows = self._rows.get(int(rid))
        if not open_rows:
            return []
        out: list = []
        for step, row in list(open_rows):
            row.walked = row.walked or bool(len(tokens))
            for t in tokens:
                child = row.children.get((row.node, int(t)))
                if child is None:
                    out.extend(self._close(step, row))
                    break
                row.node, row.matched = child, row.matched + 1
            else:
                if row.node not in row.inner:  # a leaf: nothing deeper could have been accepted
                    out.extend(self._close(step, row))
        out.extend(self._pop_resolved())
        return out

    def close(self, rid: int) -> list:
        """Request `rid` ended: its open rows resolve as they stand (a verification could not
        have emitted past its end either)."""
        out: list = []
        for step, row in list(self._rows.get(int(rid), [])):
            out.extend(self._close(step, row))
        out.extend(self._pop_resolved())
        return out

    def clear(self) -> None:
        self._steps.clear()
        self._rows.clear()

    def _close(self, step: _Step, row: _Row) -> list:
        if row.done:
            return []
        row.done = True
        step.open -= 1
        held = [(s, r) for s, r in self._rows.get(row.rid, []) if r is not row]
        if held:
            self._rows[row.rid] = held
        else:
            self._rows.pop(row.rid, None)
        on_path = np.zeros(row.tokens.size, dtype=bool)
        node = row.node
        while node >= 0:
            on_path[node] = True
            node = int(row.parents[node])
        if not row.walked:
            return []
        cond, acc = trials(row.scores, row.parents, on_path)
        return [(row.rid, cond, acc)]

    def _pop_resolved(self) -> list:
        out = []
        while self._steps and self._steps[0].open <= 0:
            step = self._steps.popleft()
            out.append(Resolved(step.batch, step.batch + sum(r.matched for r in step.rows), step.seconds, step.worth))
        return out
