"""REST (He et al., NAACL 2024): a re-implementation of its retrieval over SSSD's datastore.

Read from FasterDecoding/REST (commit 50a5fc1 and its neighbours):
``DraftRetriever/src/lib.rs`` (``Reader::search``, ``cut_to_choices``,
``get_draft_choices``) and ``rest/model/utils.py``
(``generate_candidates_and_draft_buffer``, as used by
``llm_judge/gen_model_answer_rest.py``). What REST does at each step:

1. Query spans ``token_spans = [16, 15, ..., 2]``: the context's last ``span``
   tokens (the whole context if shorter), longest first; the first span with
   any occurrence in the datastore is used. No occurrence at all: one
   "random" draft token, id 100.
2. ``search(k=5000, choices, long=10)``: binary-search the suffix array for
   the suffixes starting with the query and take the first ``k`` of them *in
   suffix-array order* (REST does not sample); each gives the ``long`` tokens
   that follow the query (fewer at the end of the data).
3. Count every prefix of every continuation (a HashMap: trie node -> count)
   and keep the ``choices`` prefixes with the highest counts with a size-
   ``choices`` min-heap: a prefix replaces the heap's minimum only if its
   count is strictly larger; on a pop, among the minimum counts the
   lexicographically largest prefix goes (the heap orders ``(Reverse(count),
   prefix)``).
4. ``cut_to_choices``: sort those prefixes by their number of *distinct
   tokens* (descending, stable) and drop them from the front while the sum of
   those numbers exceeds ``choices``. The draft tree is the trie of what is
   left. This sum counts a node once per path through it, so it cuts deep:
   REST's trees are much smaller than ``choices`` (measured in RESULTS.md).

Here ``choices`` is the budget. Search, counting and selection are vectorised
with numpy on SSSD's datastore (``Datastore.find`` plus the zero-copy
``suffix_array`` and ``tokens`` views). Where this differs from REST:

* **Document separators.** REST's writer concatenates entries with no
  separator (``self.buffer.push(34999)`` is commented out); with Llama's
  tokenizer each entry starts with BOS, so continuations run on into
  "BOS + next entry". SSSD's stream has a separator between documents:
  queries never match across it (REST's could, rarely), and a continuation
  stops at it (REST's would continue with tokens the model does not emit,
  wasting nodes). Both differences can only help REST here.
* **Ties.** REST's prefix HashMap and the HashSet in step 3 iterate in Rust's
  randomly seeded order, so which of the prefixes tied at the threshold
  survive is random per process. The same heap procedure runs here over a
  seeded random permutation (``seed``), exactly, whenever ties decide.
* **Budget.** If the trie left by ``cut_to_choices`` still has more than
  ``choices`` nodes (possible only when a path repeats a token), REST raises
  "draft_choices was not cut enough"; here the deepest nodes are dropped.
* **Variant ``cut=False``** (not REST's code): the tree is the ``choices``
  most frequent prefixes, which always form a tree (a prefix is at least as
  frequent as its extensions). It shows what REST's retrieval gives when the
  whole budget is used; reported under its own name.
* Draft cost is this Python/numpy code's, not REST's Rust.
"""

from __future__ import annotations

import heapq

import numpy as np

import sssd

from ._base import EMPTY_TREE, PerRequestDrafter, chain, tree

#: REST's draft when no span matches (``random_index = 100`` in utils.py).
REST_FALLBACK_TOKEN = 100
#: Marks the positions after a continuation's end; above every token id, like
#: the separator in the suffix array's order.
END = np.int64(1) << 40


class RESTDrafter(PerRequestDrafter):
    """REST's retrieval on an SSSD datastore.

    Args:
        datastore: the corpus (its suffix array is REST's datastore).
        k: continuations retrieved (REST default 5000).
        long: continuation length, i.e. tree depth (REST default 10).
        max_token_span: longest query span (REST default 16; spans go down to 2).
        cut: apply REST's ``cut_to_choices`` (True = REST) or keep the
            ``choices`` most frequent prefixes (False, a budget-filling variant).
        seed: seeds the stand-in for Rust's random HashMap iteration order.
        fallback_token: drafted when nothing matches (REST: 100; None: nothing).
    """

    def __init__(
        self,
        datastore: sssd.Datastore,
        *,
        k: int = 5000,
        long: int = 10,
        max_token_span: int = 16,
        cut: bool = True,
        seed: int = 0,
        fallback_token: int | None = REST_FALLBACK_TOKEN,
    ):
        super().__init__()
        if k < 1 or long < 1 or max_token_span < 2:
            raise ValueError("need k >= 1, long >= 1, max_token_span >= 2")
        self.datastore = datastore
        self.k, self.long, self.max_token_span, self.cut = k, long, max_token_span, cut
        self.fallback_token = fallback_token
        self.name = "REST" if cut else "REST, uncut (variant)"
        self._tokens = datastore.tokens
        self._sa = datastore.suffix_array
        self._rng = np.random.default_rng(seed)

    def settings(self) -> dict:
        return {"k": self.k, "long": self.long, "max_token_span": self.max_token_span, "cut_to_choices": self.cut}

    # -- step 1 + 2: spans, binary search, the first k continuations --------
    def retrieve(self, context: np.ndarray) -> np.ndarray | None:
        """The continuations REST retrieves for ``context``: a (rows, long)
        int64 matrix in suffix-array order, ``END`` after a continuation's end
        (a separator or the end of the stream); None if no span occurs.

        Suffix-array order sorts the rows lexicographically (the separator is
        the largest symbol, as END is), except where a row runs off the end of
        a stream that does not end with a separator: then they are re-sorted.
        """
        n = context.shape[0]
        lo_len, hi_len = min(2, n), min(self.max_token_span, n)
        if lo_len == 0:
            return None
        find = self.datastore.find
        lo, hi = find(context[n - lo_len :])
        if hi <= lo:
            return None
        # REST tries spans longest first and stops at the first hit; a suffix
        # of a matching span matches too, so that span is the longest one that
        # matches, found here by binary search.
        best, best_range = lo_len, (lo, hi)
        a, b = lo_len + 1, hi_len
        while a <= b:
            mid = (a + b) // 2
            r = find(context[n - mid :])
            if r[1] > r[0]:
                best, best_range, a = mid, r, mid + 1
            else:
                b = mid - 1
        lo, hi = best_range
        rows = min(hi - lo, self.k)
        pos = self._sa[lo : lo + rows].astype(np.int64) + best
        idx = pos[:, None] + np.arange(self.long, dtype=np.int64)
        size = self._tokens.shape[0]
        off_end = idx >= size
        conts = self._tokens[np.minimum(idx, size - 1)].astype(np.int64)
        conts[np.logical_or.accumulate(off_end | (conts == sssd.SEPARATOR), axis=1)] = END
        if off_end.any():
            conts = conts[np.lexsort(conts.T[::-1])]
        return conts

    # -- step 3: prefix counts ------------------------------------------------
    @staticmethod
    def prefix_counts(conts: np.ndarray) -> dict[str, np.ndarray]:
        """Every prefix of every continuation with its count (the trie REST's
        HashMap holds), from rows sorted lexicographically (``retrieve``).

        Returns per node (level by level): token, depth, parent (node index,
        -1 at depth 1), count, first (first row that has the prefix) and rank
        (the prefix's rank in REST's slice order), plus ``rows`` = conts.
        """
        m, long = conts.shape
        # boundary[d, r]: row r starts a new prefix of length d + 1.
        boundary = np.ones((long, m), dtype=bool)
        if m > 1:
            boundary[:, 1:] = np.logical_or.accumulate(conts[1:] != conts[:-1], axis=1).T
        flat = np.flatnonzero(boundary)  # (depth, row) pairs, depth-major
        depth0, first = np.divmod(flat, m)
        size = np.empty(flat.shape[0], dtype=np.int64)
        size[:-1] = np.where(depth0[1:] == depth0[:-1], first[1:], m) - first[:-1]
        size[-1:] = m - first[-1:]
        # A prefix's parent is the group one level up that holds its first row.
        parent = np.where(depth0 > 0, np.searchsorted(flat, flat - m, side="right") - 1, -1)
        token = conts[first, depth0]
        valid = token != END
        new = np.cumsum(valid) - 1
        parent = np.where(parent >= 0, new[np.maximum(parent, 0)], -1)
        nodes = {
            "token": token[valid],
            "depth": depth0[valid] + 1,
            "parent": parent[valid],
            "count": size[valid],
            "first": first[valid],
            "rows": conts,
        }
        # Preorder of the trie with children by token = lexicographic order of
        # the prefixes: by first row, then shorter first.
        order = np.lexsort((nodes["depth"], nodes["first"]))
        rank = np.empty(order.shape[0], dtype=np.int64)
        rank[order] = np.arange(order.shape[0])
        nodes["rank"] = rank
        return nodes

    def top_choices(self, count: np.ndarray, rank: np.ndarray, choices: int) -> np.ndarray:
        """Indices of the prefixes REST's min-heap keeps (step 3), ties decided
        as the heap decides them over a random iteration order."""
        N = count.shape[0]
        if N <= choices:
            return np.arange(N)
        t = np.partition(count, N - choices)[N - choices]  # the choices-th largest count
        at_least = count >= t
        if int(at_least.sum()) == choices:  # no tie at the threshold: nothing depends on the order
            return np.flatnonzero(at_least)
        perm = self._rng.permutation(N)
        v = count[perm]
        key = -rank[perm]  # min-heap on (count, -rank) = Rust's max-heap on (Reverse(count), prefix)
        heap = list(zip(v[:choices].tolist(), key[:choices].tolist(), perm[:choices].tolist()))
        heapq.heapify(heap)
        later = choices + np.flatnonzero(v[choices:] > heap[0][0])
        for c, kk, i in zip(v[later].tolist(), key[later].tolist(), perm[later].tolist()):
            if c > heap[0][0]:
                heapq.heapreplace(heap, (c, kk, i))
        return np.array([h[2] for h in heap], dtype=np.int64)

    def cut_to_choices(self, nodes: dict[str, np.ndarray], kept: np.ndarray, choices: int) -> np.ndarray:
        """REST's ``cut_to_choices`` on the kept prefixes (step 4)."""
        if kept.size == 0:
            return kept
        kept = kept[self._rng.permutation(kept.shape[0])]  # the HashSet's iteration order
        depth = nodes["depth"][kept]
        rows = nodes["rows"][nodes["first"][kept], : int(depth.max())].copy()
        rows[np.arange(rows.shape[1])[None, :] >= depth[:, None]] = END
        srt = np.sort(rows, axis=1)
        new = np.ones(srt.shape, dtype=bool)
        new[:, 1:] = srt[:, 1:] != srt[:, :-1]
        distinct = ((srt != END) & new).sum(axis=1)
        order = np.argsort(-distinct, kind="stable")
        total = int(distinct.sum())
        removed = np.concatenate([[0], np.cumsum(distinct[order])])
        r = int(np.argmax(total - removed <= choices))  # removing all always qualifies
        return kept[order[r:]]

    def _draft_one(self, context: np.ndarray, budget: int):
        if budget <= 0:
            return EMPTY_TREE
        conts = self.retrieve(context)
        if conts is None:
            return EMPTY_TREE if self.fallback_token is None else chain(np.array([self.fallback_token]))
        nodes = self.prefix_counts(conts)
        count, rank, depth, parent = nodes["count"], nodes["rank"], nodes["depth"], nodes["parent"]
        if count.size == 0:
            return EMPTY_TREE
        if self.cut:
            keep = self.cut_to_choices(nodes, self.top_choices(count, rank, budget), budget)
            mark = np.zeros(count.shape[0], dtype=bool)
            mark[keep] = True
            for d in range(int(depth.max()), 1, -1):  # the trie of the kept paths: add ancestors
                mark[parent[mark & (depth == d)]] = True
            sel = np.flatnonzero(mark)
        else:
            sel = np.lexsort((rank, -count))[:budget]
        sel = sel[np.lexsort((rank[sel], depth[sel]))][:budget]  # parents first; beyond budget: deepest go
        new = np.full(count.shape[0], -1, dtype=np.int64)
        new[sel] = np.arange(sel.shape[0])
        par = np.where(parent[sel] >= 0, new[np.maximum(parent[sel], 0)], -1)
        return tree(nodes["token"][sel], par.astype(np.int32), count[sel] / conts.shape[0])
