"""A draft model's token trees: the nodes it drafted, what they were fed, and how they are packed.

ModelDrafter (model_drafter.py) grows one Tree per request per step, level by level (SpecInfer's
expansion); a TreePass lays the new nodes of every row out for one pass of the draft model over
its own KV slots; `carried` keeps the subtree under an accepted node for the next step.
Self-speculation (self_drafter.py) drafts the same trees (chains) over a sparse view of the
target's cache. The measured acceptance rates both keep are per depth and child rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sssd.sources import Candidates, DraftDistributions

#: Pseudo-observations of a node's own q in its measured acceptance rate (its merge weight).
RATE_PRIOR = 8.0
#: Deepest level and highest child rank with a rate of their own (deeper ones share the last).
RATE_DEPTHS, RATE_RANKS = 16, 8


@dataclass
class Tree:
    """One request's tree while it grows: node i sits at slot position prefix + i."""

    prefix: int  # tokens in the slot (the root is the last)
    budget: int
    tokens: list
    parents: list
    depths: list
    probs: list
    ancestors: list  # per node: its tree ancestors and itself (node indices)
    dist_parents: list
    dist_q: list
    dist_draws: list

    ranks: list
    kids: dict  # parent node (-1: root) -> number of children so far
    hidden: dict = None  # fed node -> its hidden state (its K/V are in the slot at prefix + node)
    grown: bool = False  # grown under async drafting: its fed subtree below the next root is carried over

    def __post_init__(self):
        if self.hidden is None:
            self.hidden = {}

    def add(self, parent: int, token: int, prob: float) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.probs.append(prob)
        self.ancestors.append(([] if parent < 0 else self.ancestors[parent]) + [i])
        self.ranks.append(self.kids.get(parent, 0))
        self.kids[parent] = self.ranks[-1] + 1
        return i

    def candidates(self, rates: np.ndarray) -> Candidates | None:
        """The tree as Candidates, each weighted by its (depth, rank) acceptance rate [depth, rank]."""
        if not self.tokens:
            return None
        d = np.minimum(np.asarray(self.depths), RATE_DEPTHS) - 1
        r = np.minimum(np.asarray(self.ranks), RATE_RANKS - 1)
        seen, hit = rates[0][d, r], rates[1][d, r]
        q = np.clip(np.asarray(self.probs, np.float64), 0.0, 1.0)
        weights = ((hit + RATE_PRIOR * q) / (seen + RATE_PRIOR)).astype(np.float32)
        dists = None
        if self.dist_parents:
            k = max(len(d) for d in self.dist_draws)
            draws = np.full((len(self.dist_draws), k), -1, dtype=np.int64)
            for j, d in enumerate(self.dist_draws):
                draws[j, : len(d)] = d
            dists = DraftDistributions(np.asarray(self.dist_parents, np.int32), np.stack(self.dist_q), draws)
        return Candidates(
            np.asarray(self.tokens, np.int64), np.asarray(self.parents, np.int32), q.astype(np.float32), weights, dists
        )

    def observe(self, appended: np.ndarray, rates: np.ndarray) -> None:
        """Counts, down the path the target took (the tokens appended after this tree), which
        rank of each reached node's children held the target's token (if any)."""
        child = {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens))}
        node = -1
        for tok in np.asarray(appended).tolist():
            n = self.kids.get(node, 0)
            if not n:
                return
            depth = min(0 if node < 0 else self.depths[node], RATE_DEPTHS - 1)
            rates[0][depth, : min(n, RATE_RANKS)] += 1
            nxt = child.get((node, tok))
            if nxt is None:
                return
            rates[1][depth, min(self.ranks[nxt], RATE_RANKS - 1)] += 1
            node = nxt


def carried(tree: Tree, root: int, prefix: int) -> Tree:
    """The fed subtree of `tree` below node `root` as a tree of its own over `prefix` tokens:
    `origin` maps its nodes to the old ones (whose K/V the caller moves to prefix + new index).
    Unfed nodes (the last level: no K/V) are left out; a node whose children were left out
    becomes a leaf again, and its draws go with them (it is expanded afresh)."""
    keep = [i for i in range(len(tree.tokens)) if i in tree.hidden and i != root and root in tree.ancestors[i]]
    new = {root: -1, **{i: j for j, i in enumerate(keep)}}
    out = Tree(prefix, tree.budget, [], [], [], [], [], [], [], [], [], {})
    for i in keep:
        j = out.add(new[tree.parents[i]], tree.tokens[i], tree.probs[i])
        out.hidden[j] = tree.hidden[i]
    for p, q, d in zip(tree.dist_parents, tree.dist_q, tree.dist_draws):
        if p in new and out.kids.get(new[p]):  # draws whose children came along
            out.dist_parents.append(new[p])
            out.dist_q.append(q)
            out.dist_draws.append(d)
    out.origin = keep
    return out


@dataclass
class TreePass:
    """The new nodes of every row's tree, laid out for TorchBackend.hidden_states: each sees
    its row's prefix and its own ancestors, written at prefix + node index; padding queries
    write just past the tree and see only themselves."""

    tokens: np.ndarray  # [B, T]
    positions: np.ndarray  # [B, T] model positions: prefix - 1 + depth
    writes: np.ndarray  # [B, T] slot positions
    kv_length: int
    _visible: np.ndarray  # [B, T, S]
    _kv_positions: np.ndarray  # [B, S]

    def visible(self) -> np.ndarray:
        return self._visible

    def kv_positions(self) -> np.ndarray:
        return self._kv_positions

    @classmethod
    def of(cls, trees: list[Tree], new: list[list[int]]) -> TreePass:
        B = len(trees)
        T = max(1, max(len(n) for n in new))
        S = max(t.prefix + len(t.tokens) + T for t in trees)
        tokens = np.zeros((B, T), np.int64)
        positions = np.zeros((B, T), np.int64)
        writes = np.zeros((B, T), np.int64)
        visible = np.zeros((B, T, S), bool)
        kv_pos = np.broadcast_to(np.arange(S), (B, S)).copy()
        for b, (t, nodes) in enumerate(zip(trees, new)):
            n = len(t.tokens)
            kv_pos[b, t.prefix : t.prefix + n] = t.prefix - 1 + np.asarray(t.depths, np.int64)
            for j in range(T):
                if j < len(nodes):
                    i = nodes[j]
                    tokens[b, j] = t.tokens[i]
                    positions[b, j] = t.prefix - 1 + t.depths[i]
                    writes[b, j] = t.prefix + i
                    visible[b, j, : t.prefix] = True
                    visible[b, j, t.prefix + np.asarray(t.ancestors[i])] = True
                else:
                    writes[b, j] = positions[b, j] = t.prefix + n + j
                    visible[b, j, writes[b, j]] = True
        return cls(tokens, positions, writes, S, visible, kv_pos)
