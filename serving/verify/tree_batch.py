"""A batch of draft trees packed for one forward pass, built with whole-batch array ops.

Row b of a step holds the request's root (its last token, not yet in the KV
cache) at packed index 0, followed by its draft nodes in tree order: node k
of the draft sits at packed index k + 1, and a parent always precedes its
children. Each query sees the request's cached context and its own
ancestors (SpecInfer's topology-aware mask); its model position is cached +
depth; its K/V are written at slot position cached + packed index, and
verification then moves the accepted path down to consecutive slots.

Nothing here loops over nodes in Python: the ancestor relation is built by
one vectorised pass per packed index (at most budget + 1 of them, each over
the whole batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sssd.tree import DraftBatch

NO_SOURCE = 255  # sources[] of roots and padding


@dataclass
class TreeBatch:
    """B rows of T query slots each (the root and up to T - 1 draft nodes)."""

    tokens: np.ndarray  # [B, T] int64 (padding: 0)
    parents: np.ndarray  # [B, T] int64 packed index of the parent; -1 for roots and padding
    depths: np.ndarray  # [B, T] int64 (0 for roots and padding)
    valid: np.ndarray  # [B, T] bool: a root or a draft node
    sizes: np.ndarray  # [B] int64 real query tokens per row (1 + draft nodes)
    cached: np.ndarray  # [B] int64 tokens already in the row's KV slot
    ancestors: np.ndarray  # [B, T, T] bool: ancestors[b, i, j] iff j is i or an ancestor of i
    sources: np.ndarray  # [B, T] uint8 (NO_SOURCE for roots and padding)

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    @property
    def positions(self) -> np.ndarray:
        """[B, T] model positions: cached + depth."""
        return self.cached[:, None] + self.depths

    @property
    def writes(self) -> np.ndarray:
        """[B, T] KV slot positions: cached + packed index."""
        return self.cached[:, None] + np.arange(self.tokens.shape[1])[None, :]

    @property
    def kv_length(self) -> int:
        """S: KV positions a forward pass over this batch reads."""
        return int((self.cached + self.tokens.shape[1]).max())

    def visible(self) -> np.ndarray:
        """[B, T, S] bool: each query sees its row's cached context and its ancestors
        (padding queries see only themselves, at positions past the real nodes)."""
        B, T = self.tokens.shape
        S = self.kv_length
        mask = np.zeros((B, T, S), dtype=bool)
        mask[:] = (np.arange(S)[None, :] < self.cached[:, None])[:, None, :] & self.valid[:, :, None]
        cols = self.cached[:, None] + np.arange(T)[None, :]  # [B, T]
        mask[np.arange(B)[:, None, None], np.arange(T)[None, :, None], cols[:, None, :]] = self.ancestors
        return mask

    def kv_positions(self) -> np.ndarray:
        """[B, S] the model position held at each KV slot position after the writes."""
        B, T = self.tokens.shape
        S = self.kv_length
        out = np.broadcast_to(np.arange(S), (B, S)).copy()
        out[np.arange(B)[:, None], self.writes] = self.positions
        return out


def pack(roots: np.ndarray, cached: np.ndarray, drafts: DraftBatch | None, use: np.ndarray | None = None) -> TreeBatch:
    """Packs each row's root and draft.

    Args:
        roots: [B] each row's last token.
        cached: [B] tokens already in each row's KV slot.
        drafts: one draft per row (None: roots only).
        use: [B] bool, rows whose draft is used (others: root only).
    """
    roots = np.asarray(roots, dtype=np.int64)
    cached = np.asarray(cached, dtype=np.int64)
    B = roots.shape[0]
    if drafts is None:
        sizes_d = np.zeros(B, dtype=np.int64)
    else:
        sizes_d = np.diff(drafts.offsets).astype(np.int64)
        if use is not None:
            sizes_d = np.where(use, sizes_d, 0)
    sizes = 1 + sizes_d
    T = int(sizes.max()) if B else 1
    tokens = np.zeros((B, T), dtype=np.int64)
    parents = np.full((B, T), -1, dtype=np.int64)
    depths = np.zeros((B, T), dtype=np.int64)
    sources = np.full((B, T), NO_SOURCE, dtype=np.uint8)
    tokens[:, 0] = roots
    valid = np.arange(T)[None, :] < sizes[:, None]
    if drafts is not None and sizes_d.any():
        rows = np.repeat(np.arange(B), sizes_d)
        starts = drafts.offsets[:-1].astype(np.int64)
        firsts = np.repeat(starts, sizes_d)  # first flat node of each node's row
        local = np.arange(rows.shape[0]) - np.repeat(np.cumsum(sizes_d) - sizes_d, sizes_d)
        flat = firsts + local  # the node's index in the DraftBatch
        cols = local + 1
        tokens[rows, cols] = drafts.tokens[flat]
        parents[rows, cols] = drafts.parents[flat].astype(np.int64) + 1
        depths[rows, cols] = drafts.depths[flat]
        sources[rows, cols] = drafts.sources[flat]
    ancestors = np.zeros((B, T, T), dtype=bool)
    ancestors[:, np.arange(T), np.arange(T)] = True
    for i in range(1, T):  # parents precede children: each row's ancestors are complete when read
        p = parents[:, i]
        has = np.flatnonzero(p >= 0)
        if has.size:
            ancestors[has, i] |= ancestors[has, p[has]]
    return TreeBatch(tokens, parents, depths, valid, sizes, cached, ancestors, sources)


def pack_chain(cached: np.ndarray, chunks: list[np.ndarray]) -> TreeBatch:
    """Prefill chunks as chains: row b feeds chunks[b] at positions cached[b] + i, causally."""
    B = len(chunks)
    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
    T = int(sizes.max())
    tokens = np.zeros((B, T), dtype=np.int64)
    for b, c in enumerate(chunks):
        tokens[b, : len(c)] = c
    idx = np.arange(T)
    valid = idx[None, :] < sizes[:, None]
    parents = np.where(valid, idx[None, :] - 1, -1)
    depths = np.broadcast_to(idx, (B, T)).copy()
    causal = np.tril(np.ones((T, T), dtype=bool))
    ancestors = np.where(valid[:, :, None], causal[None], np.eye(T, dtype=bool)[None])
    return TreeBatch(
        tokens,
        parents,
        depths,
        valid,
        sizes,
        np.asarray(cached, dtype=np.int64),
        ancestors,
        np.full((B, T), NO_SOURCE, dtype=np.uint8),
    )


def stack(top: TreeBatch, bottom: TreeBatch) -> TreeBatch:
    """One batch of `top`'s rows then `bottom`'s (a decode step's trees and prompt chunks written in
    the same pass), each padded to the wider of the two; padding stays padding (invalid, seeing
    only itself)."""
    T = max(top.shape[1], bottom.shape[1])

    def widen(x: TreeBatch) -> TreeBatch:
        B, t = x.shape
        if t == T:
            return x
        pad = T - t

        def cols(a: np.ndarray, fill) -> np.ndarray:
            return np.concatenate([a, np.full((B, pad), fill, dtype=a.dtype)], axis=1)

        ancestors = np.zeros((B, T, T), dtype=bool)
        ancestors[:, :t, :t] = x.ancestors
        ancestors[:, np.arange(t, T), np.arange(t, T)] = True
        return TreeBatch(
            cols(x.tokens, 0),
            cols(x.parents, -1),
            cols(x.depths, 0),
            cols(x.valid, False),
            x.sizes,
            x.cached,
            ancestors,
            cols(x.sources, NO_SOURCE),
        )

    a, b = widen(top), widen(bottom)
    return TreeBatch(
        *(np.concatenate([getattr(a, f), getattr(b, f)]) for f in ("tokens", "parents", "depths", "valid")),
        np.concatenate([a.sizes, b.sizes]),
        np.concatenate([a.cached, b.cached]),
        np.concatenate([a.ancestors, b.ancestors]),
        np.concatenate([a.sources, b.sources]),
    )
