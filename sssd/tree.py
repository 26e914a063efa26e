"""Draft trees as flat numpy arrays, and the helpers verifiers need.

A draft tree's root is the last token of the context; it is implicit. Nodes
``0..n-1`` are candidate tokens in insertion order (a parent precedes its
children). Helpers build the tree attention mask (each node sees exactly its
ancestors and itself) and position ids, for the root included or not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from sssd import _core
from sssd.config import SOURCE_NAMES


def ancestor_mask(parents: np.ndarray, include_root: bool = True) -> np.ndarray:
    """Boolean tree attention mask: ``mask[i, j]`` is True iff j is i or an ancestor of i.

    Args:
        parents: [n] int parent indices, -1 for children of the root; parents
            precede children.
        include_root: if True, row/column 0 is the root (seen by every node)
            and node i sits at index i + 1; the result is (n + 1, n + 1).
    """
    parents = np.asarray(parents, dtype=np.int64)
    n = parents.shape[0]
    if np.any(parents >= np.arange(n)) or np.any(parents < -1):
        raise ValueError("parents must be -1 or an earlier node index")
    # Shift so that index 0 is the root; pointer-jump up to the root: O(depth) numpy ops.
    par = np.concatenate([[0], parents + 1])
    idx = np.arange(n + 1)
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    cur = idx.copy()
    while True:
        mask[idx, cur] = True
        if not cur.any():
            break
        cur = par[cur]
    return mask if include_root else mask[1:, 1:]


@dataclass(frozen=True)
class DraftTree:
    """One request's draft. Arrays are read-only views; shapes are [n].

    Attributes:
        tokens: candidate token ids (int64).
        parents: parent node index, -1 for children of the root (int32).
        depths: 1 for children of the root (int32).
        scores: priority at insertion: the source probability, discounted or
            calibrated (float32). Scores steer tree building only; they are
            not a proposal distribution.
        probs: the inserting source's raw path probability (float32).
        match_lens: context tokens that source matched (uint8; 0 external).
        sources: 0 datastore, 1 input (prompt + output), 2 external (uint8).
        draft_probs: q(token | parent path) for nodes from a model source,
            NaN otherwise (float32).
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    scores: np.ndarray
    sources: np.ndarray
    draft_probs: np.ndarray
    probs: np.ndarray | None = None
    match_lens: np.ndarray | None = None
    tokenizer: Any = field(default=None, compare=False, repr=False)  # renders tokens as text when set

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def with_tokenizer(self, tokenizer: Any) -> DraftTree:
        """The same tree, rendering its tokens with `tokenizer` (anything with decode(ids) -> str)."""
        return dataclasses.replace(self, tokenizer=tokenizer)

    def token_texts(self) -> list[str]:
        """Each node's token as text (needs a tokenizer: see with_tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("this tree has no tokenizer to render its tokens (draft from a text, or with_tokenizer)")
        return [self.tokenizer.decode([int(t)]) for t in self.tokens]

    def text(self, node: int) -> str:
        """The text from the root down to `node`."""
        if self.tokenizer is None:
            raise ValueError("this tree has no tokenizer to render its tokens (draft from a text, or with_tokenizer)")
        return self.tokenizer.decode(self.path(node))

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if len(self) else 0

    def attention_mask(self, include_root: bool = True) -> np.ndarray:
        """Tree attention mask; see :func:`ancestor_mask`."""
        return ancestor_mask(self.parents, include_root)

    def position_ids(self, root_position: int, include_root: bool = True) -> np.ndarray:
        """Positions of the nodes: root_position + depth (the root at root_position)."""
        pos = root_position + self.depths.astype(np.int64)
        return np.concatenate([[root_position], pos]) if include_root else pos

    def best_chain(self) -> np.ndarray:
        """Node indices of the chain with the largest sum of scores, root side first.

        With calibrated scores this is the chain with the highest expected
        accepted length: the one to verify in engines that verify chains only.
        """
        _, nodes = _core.best_chains(
            np.array([0, len(self)], dtype=np.int64),
            np.ascontiguousarray(self.parents, dtype=np.int32),
            np.ascontiguousarray(self.scores, dtype=np.float32),
        )
        return nodes

    def chain_tokens(self) -> np.ndarray:
        """Token ids along :meth:`best_chain`."""
        return self.tokens[self.best_chain()]

    def path(self, node: int) -> list[int]:
        """Token ids from the root's first child down to ``node``."""
        out = []
        while node >= 0:
            out.append(int(self.tokens[node]))
            node = int(self.parents[node])
        return out[::-1]

    def leaves(self) -> np.ndarray:
        is_parent = np.zeros(len(self), dtype=bool)
        is_parent[self.parents[self.parents >= 0]] = True
        return np.flatnonzero(~is_parent)

    def source_counts(self) -> dict[str, int]:
        return {SOURCE_NAMES[s]: int((self.sources == s).sum()) for s in SOURCE_NAMES}

    def format(self, decode=None, max_paths: int = 20) -> str:
        """Human-readable branches, best first (decode: ids -> str; default: the tree's tokenizer if any)."""
        if decode is None and self.tokenizer is not None:
            decode = self.tokenizer.decode
        leaves = sorted(self.leaves(), key=lambda i: -float(self.scores[i]))
        lines = []
        for leaf in leaves[:max_paths]:
            toks = self.path(int(leaf))
            text = repr(decode(toks)) if decode else " ".join(map(str, toks))
            src = SOURCE_NAMES[int(self.sources[leaf])]
            lines.append(f"  [{float(self.scores[leaf]):.3f} {src:9s} d={len(toks):2d}] {text}")
        if len(leaves) > max_paths:
            lines.append(f"  ... {len(leaves) - max_paths} more branches")
        return "\n".join(lines)


@dataclass(frozen=True)
class DraftBatch:
    """The drafts of a batch, concatenated (CSR).

    Request ``b`` owns entries ``offsets[b]:offsets[b+1]`` of every array;
    its parent indices are local to its slice.
    """

    offsets: np.ndarray  # [B + 1] int64
    tokens: np.ndarray  # [N] int64
    parents: np.ndarray  # [N] int32
    depths: np.ndarray  # [N] int32
    scores: np.ndarray  # [N] float32
    sources: np.ndarray  # [N] uint8
    draft_probs: np.ndarray  # [N] float32
    probs: np.ndarray | None = None  # [N] float32 raw source probabilities
    match_lens: np.ndarray | None = None  # [N] uint8

    @classmethod
    def from_native(cls, d: dict) -> DraftBatch:
        return cls(**d)

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, b: int) -> DraftTree:
        if not -len(self) <= b < len(self):
            raise IndexError(f"request index {b} out of range for a batch of {len(self)}")
        b %= len(self)
        s = slice(int(self.offsets[b]), int(self.offsets[b + 1]))
        return DraftTree(
            self.tokens[s],
            self.parents[s],
            self.depths[s],
            self.scores[s],
            self.sources[s],
            self.draft_probs[s],
            None if self.probs is None else self.probs[s],
            None if self.match_lens is None else self.match_lens[s],
        )

    def __iter__(self) -> Iterator[DraftTree]:
        return (self[b] for b in range(len(self)))

    def best_chains(self) -> tuple[np.ndarray, np.ndarray]:
        """Per request, the best chain (see DraftTree.best_chain), as CSR (offsets, node indices)."""
        return _core.best_chains(self.offsets, self.parents, self.scores)

    def prefix(self, counts: np.ndarray) -> DraftBatch:
        """Each request's first counts[b] nodes (a parent precedes its children, so every prefix
        is a tree; the drafter emits nodes best first, so a prefix is the tree at a smaller budget)."""
        sizes = self.sizes
        counts = np.minimum(np.maximum(np.asarray(counts, dtype=np.int64), 0), sizes)
        local = np.arange(self.tokens.shape[0]) - np.repeat(self.offsets[:-1], sizes)
        keep = local < np.repeat(counts, sizes)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        opt = {k: (None if getattr(self, k) is None else getattr(self, k)[keep]) for k in ("probs", "match_lens")}
        return DraftBatch(
            offsets,
            self.tokens[keep],
            self.parents[keep],
            self.depths[keep],
            self.scores[keep],
            self.sources[keep],
            self.draft_probs[keep],
            **opt,
        )


def concat(trees: Sequence[DraftTree]) -> DraftBatch:
    """Concatenates single drafts into a batch."""
    sizes = [len(t) for t in trees]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def cat(name: str, dtype) -> np.ndarray:
        parts = [getattr(t, name) for t in trees]
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    return DraftBatch(
        offsets,
        cat("tokens", np.int64),
        cat("parents", np.int32),
        cat("depths", np.int32),
        cat("scores", np.float32),
        cat("sources", np.uint8),
        cat("draft_probs", np.float32),
    )
