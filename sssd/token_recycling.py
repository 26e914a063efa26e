"""Token Recycling: the target's own top-k predictions, recycled as drafts.

Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling" (ACL 2025). Every node the target
verifies yields its k likeliest next tokens; they are kept in an adjacency
matrix ``M[vocab, k]`` (row t: the tokens likeliest after token t, as last
predicted; a newer prediction overwrites the row). One matrix serves every
request of a model: it is the method's memory. A draft is a breadth-first
walk from the request's last token down a static tree template: template
node i takes column ``rank[i]`` of its parent's row. Rows never written
propose nothing (the ``seen`` mask), nor does anything below them.

The template is the static tree of the `nodes` best nodes under an
acceptance rate per child rank (a node's path weight is the product of its
path's rank rates): wide at depth 1, narrowing with depth. It starts from
assumed rates and is rebuilt from the measured ones (below) each time
their count of observations doubles from REBUILD_FIRST, so that its shape
follows the model. A request's draft is the template's first `budget`
nodes (a prefix of the template is a tree).

Candidates carry ranking weights, never draft probabilities: the weight of
a rank-r child is the measured rate at which the target's argmax after a
token equals that token's recycled rank-r prediction (counted at every
verified node before its row is overwritten, smoothed towards the prior).
Drafts are deterministic (q unset), as retrieval's are.

Training-free, it drafts where retrieval has nothing (novel text). This
module needs numpy only; propose indexes arrays per template depth, never
per node.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sssd.config import SourceDiscount
from sssd.draft_source import Candidates, DraftRequest, DraftSource

#: Top-k predictions kept per token (the paper's k).
DEFAULT_K = 8
#: Nodes of the static template (the paper's tree has about 80).
DEFAULT_NODES = 80
#: Deepest level of the template.
DEFAULT_DEPTH = 8
#: Assumed acceptance rate of a rank-r recycled child, before any measurement; it shapes the
#: first template and is the prior of the measured rates (ranks past its end decay
#: geometrically). Near what SmolLM2-135M measures on chat and maths prompts.
RANK_PRIOR = (0.25, 0.09, 0.055, 0.035, 0.028, 0.021, 0.017, 0.013)
#: Pseudo-observations of the prior in the measured rates.
PRIOR_WEIGHT = 64.0
#: Observations after which the template is first rebuilt from the measured rates (then at
#: every doubling).
REBUILD_FIRST = 256


@dataclass(frozen=True)
class Template:
    """A static draft tree over ranks, best nodes first (so any prefix is a tree).

    Attributes:
        parents: [n] template index of each node's parent, -1 under the root.
        ranks: [n] which column of the parent token's row a node takes.
        depths: [n] 1 under the root.
    """

    parents: np.ndarray
    ranks: np.ndarray
    depths: np.ndarray

    def __len__(self) -> int:
        return int(self.parents.shape[0])


def rank_prior(k: int) -> np.ndarray:
    """[k] the assumed acceptance rate per child rank (RANK_PRIOR, extended geometrically)."""
    prior = list(RANK_PRIOR[:k])
    while len(prior) < k:
        prior.append(prior[-1] * 0.75)
    return np.asarray(prior, dtype=np.float64)


def static_template(rates: np.ndarray, nodes: int = DEFAULT_NODES, max_depth: int = DEFAULT_DEPTH) -> Template:
    """The `nodes` nodes of greatest path weight (the product of their ranks' rates) up to
    `max_depth`, best first; ties go to the shallower, then the earlier node.

    Rates are at most 1, so a child never outweighs its parent: any prefix is a tree.
    """
    rates = np.asarray(rates, dtype=np.float64)
    k = rates.shape[0]
    parents, ranks, depths = [], [], []
    # (-path weight, depth, order, parent index, rank)
    heap = [(-rates[r], 1, r, -1, r) for r in range(k)]
    heapq.heapify(heap)
    order = k
    while heap and len(parents) < nodes:
        neg, depth, _, parent, rank = heapq.heappop(heap)
        me = len(parents)
        parents.append(parent)
        ranks.append(rank)
        depths.append(depth)
        if depth < max_depth:
            for r in range(k):
                heapq.heappush(heap, (neg * rates[r], depth + 1, order, me, r))
                order += 1
    return Template(np.asarray(parents, np.int64), np.asarray(ranks, np.int64), np.asarray(depths, np.int64))


class TokenRecycling(DraftSource):
    """Drafts from the target's recycled top-k predictions (one adjacency matrix per model).

    Args:
        k: predictions kept per token (the target's top-k at every verified node).
        vocab_size: rows of the matrix (None: grown as token ids arrive).
        nodes / max_depth: the static template's size and depth.
        discount: the source's weight in the merge.

    Thread-safe: observing and proposing take one lock.
    """

    name = "recycle"
    discount = SourceDiscount(scale=1.0)

    def __init__(
        self,
        k: int = DEFAULT_K,
        vocab_size: int | None = None,
        nodes: int = DEFAULT_NODES,
        max_depth: int = DEFAULT_DEPTH,
        discount: SourceDiscount | None = None,
    ):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if nodes < 1 or max_depth < 1:
            raise ValueError(f"the template needs nodes >= 1 and max_depth >= 1, got {nodes} and {max_depth}")
        self.k = int(k)
        self.observe_topk = self.k
        if discount is not None:
            self.discount = discount
        self.prior = rank_prior(self.k)
        self.nodes, self.max_depth = int(nodes), int(max_depth)
        self.template = static_template(self.prior, self.nodes, self.max_depth)
        self._rebuild_at = REBUILD_FIRST
        rows = int(vocab_size) if vocab_size else 0
        self.matrix = np.zeros((rows, self.k), dtype=np.int64)  # M: row t, the k likeliest tokens after t
        self.seen = np.zeros(rows, dtype=bool)  # rows ever written
        self.hits = np.zeros(self.k, dtype=np.int64)  # argmax == the row's rank-r prediction
        self.trials = 0  # predictions checked (per rank)
        self._fixed = vocab_size is not None
        self._lock = threading.Lock()

    def rates(self) -> np.ndarray:
        """[k] the measured acceptance rate per child rank, smoothed towards the prior."""
        return (self.hits + PRIOR_WEIGHT * self.prior) / (self.trials + PRIOR_WEIGHT)

    # -- the engine feeds it ----------------------------------------------------------------
    def observe_verified(self, request_ids: np.ndarray, tokens: np.ndarray, topk: np.ndarray) -> None:
        """Records the target's top-k after each verified node (the newest of equal tokens wins),
        first scoring the rows it overwrites against the new argmax."""
        tokens = np.asarray(tokens, dtype=np.int64)
        topk = np.asarray(topk, dtype=np.int64)
        if tokens.size == 0:
            return
        if topk.ndim != 2 or topk.shape[0] != tokens.shape[0] or topk.shape[1] < self.k:
            raise ValueError(f"topk must be [{tokens.shape[0]}, >= {self.k}], got {topk.shape}")
        topk = topk[:, : self.k]
        keep = (tokens >= 0) & (topk >= 0).all(axis=1)
        if self._fixed:
            keep &= (tokens < self.matrix.shape[0]) & (topk < self.matrix.shape[0]).all(axis=1)
        tokens, topk = tokens[keep], topk[keep]
        if tokens.size == 0:
            return
        # the last occurrence of each token is its newest prediction
        _, first_of_reversed = np.unique(tokens[::-1], return_index=True)
        last = tokens.shape[0] - 1 - first_of_reversed
        with self._lock:
            if not self._fixed:
                self._grow(int(max(tokens.max(), topk.max())) + 1)
            was = self.seen[tokens]
            if was.any():
                self.hits += (self.matrix[tokens[was]] == topk[was, :1]).sum(axis=0)
                self.trials += int(was.sum())
            self.matrix[tokens[last]] = topk[last]
            self.seen[tokens[last]] = True
            if self.trials >= self._rebuild_at:
                self.template = static_template(self.rates(), self.nodes, self.max_depth)
                self._rebuild_at = 2 * self.trials

    def _grow(self, rows: int) -> None:
        if rows <= self.matrix.shape[0]:
            return
        rows = max(rows, 2 * self.matrix.shape[0])
        matrix = np.zeros((rows, self.k), dtype=np.int64)
        seen = np.zeros(rows, dtype=bool)
        matrix[: self.matrix.shape[0]] = self.matrix
        seen[: self.seen.shape[0]] = self.seen
        self.matrix, self.seen = matrix, seen

    # -- drafting -------------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> list[Candidates | None]:
        """Every request's template walk from its last token, in one pass per template depth."""
        if not requests:
            return []
        budgets = np.fromiter((r.budget for r in requests), dtype=np.int64, count=len(requests))
        n = int(min(len(self.template), budgets.max()))
        if n <= 0:
            return [None] * len(requests)
        roots = np.fromiter(
            (int(r.tokens[-1]) if len(r.tokens) else -1 for r in requests), dtype=np.int64, count=len(requests)
        )
        R = roots.shape[0]
        with self._lock:
            t = self.template
            n = min(n, len(t))
            parents, ranks, depths = t.parents[:n], t.ranks[:n], t.depths[:n]
            rows = self.matrix.shape[0]
            tokens = np.zeros((R, n), dtype=np.int64)
            ok = np.zeros((R, n), dtype=bool)
            for d in range(1, int(depths.max()) + 1):
                at = np.flatnonzero(depths == d)
                if d == 1:
                    above, above_ok = np.repeat(roots[:, None], at.size, axis=1), np.ones((R, at.size), bool)
                else:
                    above, above_ok = tokens[:, parents[at]], ok[:, parents[at]]
                inside = (above >= 0) & (above < rows)
                safe = np.where(inside, above, 0)
                tokens[:, at] = self.matrix[safe, ranks[at]]
                ok[:, at] = above_ok & inside & self.seen[safe]
            weights = self.rates()[ranks].astype(np.float32)
        ok &= np.arange(n)[None, :] < budgets[:, None]
        local = np.cumsum(ok, axis=1) - 1  # each kept node's index in its request's proposal
        out: list[Candidates | None] = []
        for b in range(R):
            keep = np.flatnonzero(ok[b])
            if keep.size == 0:
                out.append(None)
                continue
            par = parents[keep]
            out.append(
                Candidates(tokens[b, keep], np.where(par >= 0, local[b, np.maximum(par, 0)], -1), weights=weights[keep])
            )
        return out


__all__ = ["Template", "TokenRecycling", "rank_prior", "static_template"]
