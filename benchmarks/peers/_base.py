"""What the peer adapters share: per-request contexts and draft-tree builders.

Every peer is a drafter with the duck-typed interface that
``sssd.calibration.replay.replay`` drives (the same as ``sssd.Drafter``)::

    open(request_id, prompt_ids)
    draft(request_ids, budget) -> sssd.DraftBatch
    extend_batch(request_ids, token_lists)
    close(request_id)

Peers draft one request at a time, so ``draft`` loops over the batch and
concatenates the trees with ``sssd.tree.concat``. Nodes carry source 0,
``draft_probs`` NaN and, as score, the peer's own score (0 where it has none).
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import numpy as np

import sssd
from sssd.tree import DraftTree, concat

_EMPTY_I64 = np.zeros(0, dtype=np.int64)


class Context:
    """A request's tokens (prompt + accepted output) in a growable int64 buffer."""

    __slots__ = ("_buf", "_n")

    def __init__(self, tokens: Any):
        arr = np.asarray(tokens, dtype=np.int64).ravel()
        self._buf = np.empty(max(64, 2 * arr.shape[0]), dtype=np.int64)
        self._buf[: arr.shape[0]] = arr
        self._n = arr.shape[0]

    def extend(self, tokens: Any) -> None:
        arr = np.asarray(tokens, dtype=np.int64).ravel()
        need = self._n + arr.shape[0]
        if need > self._buf.shape[0]:
            buf = np.empty(2 * need, dtype=np.int64)
            buf[: self._n] = self._buf[: self._n]
            self._buf = buf
        self._buf[self._n : need] = arr
        self._n = need

    @property
    def tokens(self) -> np.ndarray:
        """A view of the tokens so far (valid until the next extend)."""
        return self._buf[: self._n]

    def __len__(self) -> int:
        return self._n


def tree(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray | None = None) -> DraftTree:
    """A DraftTree from parent-pointer arrays (parents precede children; -1 = root)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    parents = np.asarray(parents, dtype=np.int32)
    n = tokens.shape[0]
    depths = np.ones(n, dtype=np.int32)
    for i in range(n):  # parents precede children: one pass
        p = parents[i]
        if p >= 0:
            depths[i] = depths[p] + 1
    sc = np.zeros(n, dtype=np.float32) if scores is None else np.asarray(scores, dtype=np.float32)
    return DraftTree(tokens, parents, depths, sc, np.zeros(n, dtype=np.uint8), np.full(n, np.nan, dtype=np.float32))


def chain(tokens: np.ndarray, scores: np.ndarray | None = None) -> DraftTree:
    """A DraftTree that is a single chain (what n-gram proposers draft)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = tokens.shape[0]
    sc = np.zeros(n, dtype=np.float32) if scores is None else np.asarray(scores, dtype=np.float32)
    return DraftTree(
        tokens,
        np.arange(-1, n - 1, dtype=np.int32),
        np.arange(1, n + 1, dtype=np.int32),
        sc,
        np.zeros(n, dtype=np.uint8),
        np.full(n, np.nan, dtype=np.float32),
    )


EMPTY_TREE = chain(_EMPTY_I64)


def paths_tree(paths: Sequence[Sequence[int]], budget: int, pad: int = -2) -> DraftTree:
    """The trie of token paths (REST/ADED return leaf and inner paths padded
    with ``pad``), nodes in breadth-first order, cut to ``budget`` nodes.

    Breadth-first order keeps every parent before its children, so cutting the
    tail keeps a valid tree.
    """
    index: dict[tuple, int] = {}
    toks: list[int] = []
    pars: list[int] = []
    deps: list[int] = []
    for path in paths:
        prefix: tuple = ()
        parent = -1
        for d, t in enumerate(path):
            if t == pad:
                break
            prefix = prefix + (t,)
            node = index.get(prefix)
            if node is None:
                node = index[prefix] = len(toks)
                toks.append(int(t))
                pars.append(parent)
                deps.append(d + 1)
            parent = node
    if not toks:
        return EMPTY_TREE
    order = np.argsort(np.asarray(deps), kind="stable")[:budget]
    new_index = np.full(len(toks), -1, dtype=np.int64)
    new_index[order] = np.arange(order.shape[0])
    par = np.asarray(pars, dtype=np.int64)[order]
    par = np.where(par >= 0, new_index[np.maximum(par, 0)], -1)
    return tree(np.asarray(toks, dtype=np.int64)[order], par.astype(np.int32))


class PerRequestDrafter(abc.ABC):
    """Base of the peers that draft one request at a time from its own context.

    Subclasses implement ``_draft_one(context: np.ndarray, budget: int) -> DraftTree``.
    """

    #: Display name of the peer in tables and plots.
    name = "peer"

    def __init__(self) -> None:
        self._ctx: dict[int, Context] = {}

    def open(self, request_id: int, prompt: Any) -> None:
        if int(request_id) in self._ctx:
            raise ValueError(f"request {request_id} is already open")
        self._ctx[int(request_id)] = Context(prompt)

    def extend_batch(self, request_ids: Sequence[int] | np.ndarray, token_lists: Sequence[Any]) -> None:
        for rid, toks in zip(np.asarray(request_ids).tolist(), token_lists):
            self._ctx[rid].extend(toks)

    def extend(self, request_id: int, tokens: Any) -> None:
        self._ctx[int(request_id)].extend(tokens)

    def close(self, request_id: int) -> None:
        del self._ctx[int(request_id)]

    def draft(self, request_ids: Sequence[int] | np.ndarray, budget: int) -> sssd.DraftBatch:
        budget = int(budget)
        return concat([self._draft_one(self._ctx[rid].tokens, budget) for rid in np.asarray(request_ids).tolist()])

    def draft_prefix(self, prefix: Any, budget: int) -> DraftTree:
        """Drafts once for a token prefix without opening a request."""
        return self._draft_one(np.asarray(prefix, dtype=np.int64), int(budget))

    @abc.abstractmethod
    def _draft_one(self, context: np.ndarray, budget: int) -> DraftTree:
        """One request's draft from its tokens so far (each peer's own algorithm)."""

    def __len__(self) -> int:
        return len(self._ctx)


def suffix_match_lengths(context: np.ndarray, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the context's last tokens occur earlier, and how long each match is.

    Returns (ends, lengths): ``ends`` are the positions j <= len-2 (ascending)
    with ``context[j] == context[-1]``, and ``lengths[i]`` is the largest
    n <= max_n with ``context[j-n+1 : j+1] == context[-n:]`` (the n-gram ending
    at j equals the context's last n tokens). A match ending at j is followed
    by at least one token (j + 1 <= len - 1), as both PLD and vLLM require.
    """
    L = context.shape[0]
    if L < 2 or max_n < 1:
        return _EMPTY_I64, _EMPTY_I64
    ends = np.flatnonzero(context[: L - 1] == context[L - 1])
    if ends.size == 0 or max_n == 1:
        return ends, np.ones(ends.shape[0], dtype=np.int64)
    back = np.arange(min(max_n, L - 1))
    idx = ends[:, None] - back  # (matches, n): positions of the n-gram ending at j, backwards
    eq = context[np.maximum(idx, 0)] == context[L - 1 - back]
    eq &= idx >= 0
    return ends, np.logical_and.accumulate(eq, axis=1).sum(axis=1)


def chain_batch(chains: Sequence[np.ndarray]) -> sssd.DraftBatch:
    """A DraftBatch of chains (one token array per request), built in one go."""
    lens = np.fromiter((c.shape[0] for c in chains), dtype=np.int64, count=len(chains))
    offsets = np.zeros(len(chains) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    n = int(offsets[-1])
    tokens = np.concatenate(chains).astype(np.int64, copy=False) if n else _EMPTY_I64
    local = np.arange(n, dtype=np.int32) - np.repeat(offsets[:-1], lens).astype(np.int32)
    return sssd.DraftBatch(
        offsets,
        tokens,
        local - 1,
        local + 1,
        np.zeros(n, dtype=np.float32),
        np.zeros(n, dtype=np.uint8),
        np.full(n, np.nan, dtype=np.float32),
    )
