"""What a draft node is worth: its probability of being accepted, fitted online per mode and request.

A node's calibrated score is its path's probability under the drafter's calibration. Its worth is

    p = score ** gamma

with gamma fitted online (AcceptanceModel): per decoding mode (greedy rows and sampled rows
accept differently), and per request, shrunk toward its mode's. The fit counts trials, not nodes:
a verified node whose parent was accepted is one trial of its conditional probability (its score
over its parent's), accepted or not. Since a path's score is the product of its conditional
probabilities, score ** gamma is the product of theirs ** gamma; and the nodes below a rejected
one, which fail with it, teach nothing twice (a rejected 50-node tree is one failed trial, not 50).
A request whose drafts keep failing gets gamma > 1 (its nodes are worth less) and stops taking
budget; one that copies its prompt gets gamma < 1 and takes more.

The engine's allocation (allocation.py) and the vLLM proposer spend verification by this worth.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: Score bins (log-spaced) in which verified nodes are counted.
EDGES = np.concatenate([[0.0], np.geomspace(1e-3, 1.0, 16)[:-1], [1.0 + 1e-6]])
CENTERS = np.sqrt(np.maximum(EDGES[:-1], 3e-4) * EDGES[1:]).clip(3e-4, 1.0)
GAMMA_RANGE = (1 / 16, 64.0)


def fit_gamma(n: np.ndarray, a: np.ndarray, iters: int = 30) -> np.ndarray:
    """gamma [R] with sum_k n[r, k] c_k ** gamma = sum_k a[r, k] (expected accepted nodes equal to the
    accepted ones) for counts n, accepted a [R, K] per score bin; bisection in log gamma, vectorised."""
    n, a = np.atleast_2d(n), np.atleast_2d(a)
    lo = np.full(n.shape[0], np.log(GAMMA_RANGE[0]))
    hi = np.full(n.shape[0], np.log(GAMMA_RANGE[1]))
    target = a.sum(axis=1)
    logc = np.log(CENTERS)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        expected = (n * np.exp(np.exp(mid)[:, None] * logc[None, :])).sum(axis=1)
        high = expected > target  # too many expected: gamma must grow
        lo = np.where(high, mid, lo)
        hi = np.where(high, hi, mid)
    return np.exp(0.5 * (lo + hi))


def binned(probabilities: np.ndarray, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Trials counted per score bin (EDGES): (trials [K], accepted [K])."""
    K = len(CENTERS)
    k = np.clip(np.searchsorted(EDGES, probabilities, side="right") - 1, 0, K - 1)
    return (
        np.bincount(k, minlength=K).astype(np.float64),
        np.bincount(k, weights=np.asarray(accepted, dtype=np.float64), minlength=K),
    )


def worth(scores: np.ndarray, gamma: float | np.ndarray) -> np.ndarray:
    """A node's probability of being accepted: its calibrated score ** gamma."""
    return np.power(np.clip(scores, 1e-6, 1.0), gamma)


def trials(scores: np.ndarray, parents: np.ndarray, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One verified tree's trials: (conditional probabilities, outcomes) of the nodes whose parent
    was accepted. `parents` are local indices (-1: a child of the root)."""
    scores = np.asarray(scores, dtype=np.float64)
    parents = np.asarray(parents, dtype=np.int64)
    accepted = np.asarray(accepted, dtype=bool)
    root = parents < 0
    up = np.where(root, 0, parents)
    tried = root | accepted[up]
    parent_score = np.where(root, 1.0, scores[up])
    cond = np.clip(scores / np.maximum(parent_score, 1e-12), 0.0, 1.0)
    return cond[tried], accepted[tried]


class AcceptanceModel:
    """P(a node is accepted) = score ** gamma, gamma per mode and per request (see the module
    docstring). Counts decay (the workload drifts); a request's own counts are shrunk toward its
    mode's by `prior_nodes` pseudo-nodes distributed as its mode's verified nodes are.

    Args:
        prior_nodes: pseudo-nodes of the mode's gamma in a request's fit.
        decay: weight of the mode's past counts per observed step.
    """

    MODES = ("greedy", "sampled")

    def __init__(self, prior_nodes: float = 16.0, decay: float = 0.995):
        self.prior_nodes, self.decay = float(prior_nodes), float(decay)
        K = len(CENTERS)
        # the modes start at gamma 1 (the calibration's scores taken at their word): 64 pseudo-nodes
        start = np.where(CENTERS >= 0.01, 1.0, 0.0)
        start *= 64.0 / start.sum()
        self.mode_n = {m: start.copy() for m in self.MODES}
        self.mode_a = {m: start * CENTERS for m in self.MODES}
        self.rows: dict[int, np.ndarray] = {}  # request id -> [2, K]: its verified nodes, accepted ones
        self._gamma = {m: 1.0 for m in self.MODES}
        self._row_gamma: dict[int, float] = {}
        self.K = K

    def mode_gamma(self, greedy: bool) -> float:
        return self._gamma["greedy" if greedy else "sampled"]

    def gammas(self, ids: Sequence[int], greedy: np.ndarray) -> np.ndarray:
        """[B] each request's gamma (its mode's until it has verified nodes of its own)."""
        return np.fromiter(
            (self._row_gamma.get(int(i), self.mode_gamma(bool(g))) for i, g in zip(ids, greedy)),
            dtype=np.float64,
            count=len(ids),
        )

    def worth(self, scores: np.ndarray, gamma: float | np.ndarray) -> np.ndarray:
        return worth(scores, gamma)

    def observe(self, ids: Sequence[int], greedy: np.ndarray, scores: list[np.ndarray], accepted: list[np.ndarray]):
        """One step's trials (see `trials`): per row, their conditional probabilities and whether
        each was accepted."""
        if not ids:
            return
        for m in self.MODES:
            self.mode_n[m] *= self.decay
            self.mode_a[m] *= self.decay
        fresh = []
        for rid, g, s, acc in zip(ids, greedy, scores, accepted):
            if s.size == 0:
                continue
            n, a = binned(s, acc)
            m = "greedy" if g else "sampled"
            self.mode_n[m] += n
            self.mode_a[m] += a
            row = self.rows.setdefault(int(rid), np.zeros((2, self.K)))
            row[0] += n
            row[1] += a
            fresh.append((int(rid), m))
        if not fresh:
            return
        for m in self.MODES:
            self._gamma[m] = float(fit_gamma(self.mode_n[m], self.mode_a[m])[0])
        # each request: its own counts plus prior_nodes pseudo-nodes spread as its mode's, at the mode's gamma
        n = np.stack([self.rows[r][0] for r, _ in fresh])
        a = np.stack([self.rows[r][1] for r, _ in fresh])
        for j, (_, m) in enumerate(fresh):
            share = self.mode_n[m] / max(self.mode_n[m].sum(), 1e-9) * self.prior_nodes
            n[j] += share
            a[j] += share * CENTERS ** self._gamma[m]
        for (rid, _), g in zip(fresh, fit_gamma(n, a)):
            self._row_gamma[rid] = float(g)

    def forget(self, rid: int) -> None:
        self.rows.pop(int(rid), None)
        self._row_gamma.pop(int(rid), None)
