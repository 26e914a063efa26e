"""Brute-force pure-Python oracles for the C++ core.

Each function recomputes, naively and slowly, what a core component promises:
suffix order, occurrence counts, the datastore's sampled continuation tree,
the input trie's continuation trees, and the priority-queue merge; and the
numpy implementation of the recent-outputs source (RecentOutputsReference),
which the C++ RecentStore reproduces operation for operation.
"""

from __future__ import annotations

import heapq
import threading
from collections import defaultdict
from typing import Sequence

import numpy as np

from sssd.config import SourceDiscount
from sssd.draft_source import Candidates, DraftRequest, DraftSource
from sssd.recent_outputs import (
    DEFAULT_CAPACITY,
    DEPTH,
    DEPTH_PER_MATCH,
    MATCH_DAMPING,
    MAX_CHAIN,
    MAX_MATCH,
    MAX_MATCHES,
    MIN_DEPTH,
    MIN_MATCH,
)

SEP = 2**32 - 1


def suffix_key(tokens: list[int], i: int) -> tuple:
    """Sort key of suffix i: its tokens, the separator comparing above every
    token (and equal to itself: the comparison goes on past it); the stream's
    end compares below everything."""
    key = []
    for p in range(i, len(tokens)):
        key.append((1, tokens[p]))  # SEP is the largest id
    key.append((0,))
    return tuple(key)


def suffix_array(tokens: list[int]) -> list[int]:
    return sorted(range(len(tokens)), key=lambda i: suffix_key(tokens, i))


def occurrences(tokens: list[int], pattern: list[int]) -> list[int]:
    """Start positions where ``pattern`` (no separators) occurs."""
    L = len(pattern)
    return [i for i in range(len(tokens) - L + 1) if tokens[i : i + L] == pattern]


def continuation(tokens: list[int], start: int, branch_len: int, end_token: int = -1) -> list[int]:
    out = []
    for p in range(start, len(tokens)):
        if len(out) >= branch_len:
            break
        if tokens[p] == SEP:
            if end_token >= 0:
                out.append(end_token)
            break
        out.append(tokens[p])
    return out


def branch_for(match, branch_len, branch_per_match=0.0, max_branch_len=16):
    """Continuation length of an occurrence whose context matches ``match`` tokens."""
    if branch_per_match <= 0:
        return branch_len
    return min(max(branch_len, max_branch_len), max(branch_len, int(branch_per_match * match)))


def match_at(tokens, pos, length, longest, context):
    """How far back (length..longest) the context matches at an occurrence of its length-suffix at ``pos``."""
    m = length
    while m < longest and pos - (m - length + 1) >= 0:
        t = tokens[pos - (m - length + 1)]
        if t == SEP or t != context[len(context) - m - 1]:
            break
        m += 1
    return m


def datastore_query(
    tokens,
    sa,
    context,
    max_match,
    min_match,
    max_samples,
    min_occurrences,
    branch_len,
    end_token=-1,
    branch_per_match=0.0,
    max_branch_len=16,
    match_boost=1.0,
):
    """The datastore source's tree as {path tuple: weight}, plus (match_len, total), level by level:
    level L (the context's L-suffix) weighs match_boost^(L - the lowest level used) per sample, and a
    sample continues for branch_for(how far back the context matches there)."""
    longest = min(len(context), max_match)
    match_len = 0
    for L in range(longest, min_match - 1, -1):
        if occurrences(tokens, list(context[len(context) - L :])):
            match_len = L
            break
    tree: dict[tuple, float] = defaultdict(float)
    total = 0.0
    if match_len == 0:
        return {}, 0, 0.0
    levels = []
    for L in range(match_len, min_match - 1, -1):
        pat = list(context[len(context) - L :])
        # the suffix-array range of pat, in suffix order
        ranks = [r for r, i in enumerate(sa) if tokens[i : i + L] == pat]
        levels.append((L, ranks))
        if len(ranks) >= min_occurrences:
            break
    lowest = levels[-1][0]
    for L, ranks in levels:
        count = len(ranks)
        take = min(count, max_samples)
        weight = match_boost ** (L - lowest)
        for k in range(take):
            r = ranks[k] if take == count else ranks[0] + (2 * k + 1) * count // (2 * take)
            n = branch_for(match_at(tokens, sa[r], L, longest, context), branch_len, branch_per_match, max_branch_len)
            path = continuation(tokens, sa[r] + L, n, end_token)
            total += weight
            for d in range(1, len(path) + 1):
                tree[tuple(path[:d])] += weight
    return dict(tree), match_len, total


def trie_continuations(tokens: list[int], length: int, max_depth: int):
    """Input source tree for the last ``length`` tokens: ({path: count}, total)."""
    n = len(tokens)
    if length > n:
        return {}, 0.0
    pat = tokens[n - length :]
    tree: dict[tuple, float] = defaultdict(float)
    total = 0
    for j in occurrences(tokens, pat):
        start = j + length
        if start >= n:
            continue  # the occurrence at the very end has no next token
        total += 1
        cont = tokens[start : min(n, j + max_depth)]
        for d in range(1, len(cont) + 1):
            tree[tuple(cont[:d])] += 1
    return dict(tree), float(total)


def tree_to_paths(d: dict) -> dict[tuple, float]:
    """{path: weight} from the core's parent-pointer arrays."""
    paths: dict[tuple, float] = {}
    toks, pars, ws = list(d["tokens"]), list(d["parents"]), list(d["weights"])
    prefix: list[tuple] = []
    for t, p, w in zip(toks, pars, ws):
        path = (prefix[p] if p >= 0 else ()) + (int(t),)
        prefix.append(path)
        paths[path] = float(w)
    return paths


def merge(trees: list[dict], discount, budget: int):
    """Algorithm 1 with the core's tie-breaking.

    trees: dicts with 'paths' ({path: weight}), 'total', 'source', 'match_len',
    'max_depth'. discount(source, match_len, depth) -> float.
    Returns a list of (token, parent, depth, score, source) in insertion order.
    """
    heap = []

    def children(tree, path):
        n = len(path)
        return sorted(p for p in tree["paths"] if len(p) == n + 1 and p[:n] == path)

    def push(ti, path, parent, depth):
        t = trees[ti]
        disc = discount(t["source"], t["match_len"], depth)
        for child in children(t, path):
            w = t["paths"][child]
            if w > 0:
                prio = w / t["total"] * disc
                heapq.heappush(heap, (-prio, depth, ti, child[-1], parent, child))

    for ti, t in enumerate(trees):
        if t["total"] > 0 and t["max_depth"] >= 1:
            push(ti, (), -1, 1)
    out = []  # (token, parent, depth, score, source)
    kids: dict[int, dict[int, int]] = defaultdict(dict)
    while heap and len(out) < budget:
        negp, depth, ti, token, parent, path = heapq.heappop(heap)
        node = kids[parent].get(token)
        if node is None:
            node = len(out)
            out.append((token, parent, depth, -negp, trees[ti]["source"]))
            kids[parent][token] = node
        if depth < trees[ti]["max_depth"]:
            push(ti, path, node, depth + 1)
    return out


def ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


# -- sssd.RecentOutputs: the numpy store and drafting it replaced, verbatim ------------------------------------
# The store is a ring of `capacity` tokens shared by all requests; each token links to its request's
# previous and next token and is indexed under the hash of the two tokens that end at it, in zlib-style
# hash chains. Drafting walks the chain of the context's last two tokens (newest first, at most
# `max_chain` positions), keeps the occurrences with the longest match among other requests' tokens that
# have a continuation (at most `max_matches`, newest first), follows each up to `depth` tokens and merges
# the paths into a count-weighted trie. Array operations per chain step and per depth, for all requests
# at once.


class RecentOutputsReference(DraftSource):
    """The numpy implementation of sssd.RecentOutputs (its C++ port is sssd/_core's RecentStore),
    kept as it was: drafts from the other requests' recent tokens (one bounded store per engine).

    Args:
        capacity: tokens the store holds; the oldest are forgotten first.
        max_match / min_match: longest suffix matched, shortest that drafts (>= 2).
        max_matches: occurrences merged per draft; depth: tokens followed after each, at most (a request
            whose longest match is m tokens follows max(MIN_DEPTH, m * depth_per_match) of them).
        max_chain: hash-chain positions examined per request and step.
        discount: the source's weight in the merge.
    """

    name = "recent"
    discount = SourceDiscount(scale=1.0, depth_decay=0.95)

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        max_match: int = MAX_MATCH,
        min_match: int = MIN_MATCH,
        max_matches: int = MAX_MATCHES,
        depth: int = DEPTH,
        max_chain: int = MAX_CHAIN,
        discount: SourceDiscount | None = None,
        depth_per_match: float = DEPTH_PER_MATCH,
    ):
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2 tokens, got {capacity}")
        if not 2 <= min_match <= max_match:
            raise ValueError(f"need 2 <= min_match <= max_match, got {min_match} and {max_match}")
        if max_matches < 1 or depth < 1 or max_chain < 1:
            raise ValueError("max_matches, depth and max_chain must be >= 1")
        self.capacity = int(capacity)
        self.max_match, self.min_match = int(max_match), int(min_match)
        self.max_matches, self.depth, self.max_chain = int(max_matches), int(depth), int(max_chain)
        if depth_per_match < 0:
            raise ValueError(f"depth_per_match must be >= 0, got {depth_per_match}")
        self.depth_per_match = float(depth_per_match)
        if discount is not None:
            self.discount = discount
        n = self.capacity
        self._buckets = 1 << max(1, (n - 1).bit_length())
        # Positions are absolute write counts; links hold position + 1 (0: none). np.zeros maps
        # pages lazily, so a store costs memory as it fills.
        self.tokens = np.zeros(n, dtype=np.int64)
        self.owner = np.zeros(n, dtype=np.int64)  # request id that wrote each position
        self.prev = np.zeros(n, dtype=np.int64)  # the same request's previous token
        self.next = np.zeros(n, dtype=np.int64)  # the same request's next token
        self.chain = np.zeros(n, dtype=np.int64)  # the previous position in the same bucket
        self.head = np.zeros(self._buckets, dtype=np.int64)
        self.written = 0
        self._last: dict[int, int] = {}  # request id -> its last position + 1
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Tokens held."""
        return min(self.written, self.capacity)

    # -- following requests ----------------------------------------------------------------
    def open(self, request_id: int, prompt: np.ndarray) -> None:
        """Stores the prompt's last `max_match` tokens: the context its output will follow."""
        with self._lock:
            self._last.pop(int(request_id), None)
            self._append(int(request_id), np.asarray(prompt, dtype=np.int64)[-self.max_match :])

    def extend(self, request_id: int, tokens: np.ndarray) -> None:
        with self._lock:
            self._append(int(request_id), np.asarray(tokens, dtype=np.int64))

    def close(self, request_id: int) -> None:
        """The request's tokens stay in the store (for the others) until the ring overwrites them."""
        with self._lock:
            self._last.pop(int(request_id), None)

    def _append(self, rid: int, tokens: np.ndarray) -> None:
        n, mask = self.capacity, self._buckets - 1
        last = self._last.get(rid, 0)
        for t in tokens.tolist():
            a = self.written
            s = a % n
            self.tokens[s], self.owner[s], self.next[s] = t, rid, 0
            if self._alive(last):
                p = (last - 1) % n
                self.prev[s] = last
                self.next[p] = a + 1
                h = _bucket(int(self.tokens[p]), t) & mask
                self.chain[s] = self.head[h]
                self.head[h] = a + 1
            else:
                self.prev[s] = self.chain[s] = 0
            self.written = a + 1
            last = a + 1
        self._last[rid] = last

    def _alive(self, link):
        """Whether links (position + 1) name positions the ring still holds."""
        return (link > 0) & (link > self.written - self.capacity)

    # -- drafting ---------------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> list[Candidates | None]:
        """Every request's trie of continuations after its longest recent match, at once."""
        R = len(requests)
        if not R:
            return []
        K = self.max_match
        query = np.full((R, K), -1, dtype=np.int64)  # query[r, j]: the token j places before the last
        for r, req in enumerate(requests):
            tail = np.asarray(req.tokens[-K:], dtype=np.int64)[::-1]
            query[r, : tail.shape[0]] = tail
        ids = np.fromiter((r.request_id for r in requests), dtype=np.int64, count=R)
        budgets = np.fromiter((r.budget for r in requests), dtype=np.int64, count=R)
        depth = int(min(self.depth, budgets.max()))
        if depth <= 0:
            return [None] * R
        with self._lock:
            found = self._matches(query, ids)
            if found is None:
                return [None] * R
            rows, starts, lengths = found
            paths = self._follow(starts, depth)
        best = np.zeros(R, dtype=np.int64)
        np.maximum.at(best, rows, lengths)
        reach = np.minimum(budgets, np.clip((best * self.depth_per_match).astype(np.int64), MIN_DEPTH, self.depth))
        paths[np.arange(depth)[None, :] >= reach[rows][:, None]] = -1  # deeper than the match or budget warrants
        return _tries(rows, paths, lengths, R, self.max_match)

    def _matches(self, query: np.ndarray, ids: np.ndarray):
        """(request row, position + 1, match length) of each chosen occurrence, or None."""
        n = self.capacity
        R, K = query.shape
        asks = (query[:, 0] >= 0) & (query[:, 1] >= 0)
        if not asks.any() or self.written == 0:
            return None
        cur = np.where(asks, self.head[_bucket(query[:, 1], query[:, 0]) & (self._buckets - 1)], 0)
        cands = []
        for _ in range(self.max_chain):  # newest first, every request one chain step at a time
            live = self._alive(cur)
            if not live.any():
                break
            cands.append(np.where(live, cur, 0))
            cur = np.where(live, self.chain[(cur - 1) % n], 0)
        if not cands:
            return None
        start = np.stack(cands, axis=1)  # [R, C] position + 1
        slot = (start - 1) % n
        eligible = (start > 0) & (self.owner[slot] != ids[:, None]) & (self.next[slot] > 0)
        length = np.zeros(start.shape, dtype=np.int64)
        at, on = start.copy(), eligible.copy()
        for j in range(K):  # match backwards through each occurrence's own request
            on &= self._alive(at) & (self.tokens[(at - 1) % n] == query[:, j : j + 1])
            length += on
            at = np.where(on, self.prev[(at - 1) % n], 0)
        eligible &= length >= self.min_match
        best = np.where(eligible, length, 0).max(axis=1)
        chosen = eligible & (length == best[:, None])
        chosen &= np.cumsum(chosen, axis=1) <= self.max_matches
        rows, cols = np.nonzero(chosen)
        if not rows.size:
            return None
        return rows, start[rows, cols], length[rows, cols]

    def _follow(self, starts: np.ndarray, depth: int) -> np.ndarray:
        """[M, depth] the tokens after each occurrence (-1 past its request's last token)."""
        n = self.capacity
        paths = np.full((starts.shape[0], depth), -1, dtype=np.int64)
        at = self.next[(starts - 1) % n]
        for d in range(depth):  # forward links never outlive their targets: no age check
            has = at > 0
            if not has.any():
                break
            paths[has, d] = self.tokens[(at[has] - 1) % n]
            at = np.where(has, self.next[(at - 1) % n], 0)
        return paths


def _bucket(a, b):
    """The hash (before masking) of the token pair (a, b): ints or int64 arrays alike, with no
    overflow for token ids below 2**31."""
    x = a * 0x9E3779B1 + b
    return x ^ (x >> 29)


def _tries(rows: np.ndarray, paths: np.ndarray, lengths: np.ndarray, R: int, max_match: int) -> list[Candidates | None]:
    """One trie per request row from its occurrences' paths (built one depth at a time for all rows):
    a node's weight is the share of its parent's occurrences that continue with it."""
    M, D = paths.shape
    big = int(paths.max()) + 2
    node_req, node_parent, node_token, node_weight = [], [], [], []
    total = np.bincount(rows, minlength=R).astype(np.float64)
    best = np.zeros(R, dtype=np.int64)
    best[rows] = lengths
    damping = MATCH_DAMPING ** np.maximum(0, max_match - best)
    parent_of = rows.copy()  # per occurrence: its node at the previous depth (depth 0: its request)
    alive = np.ones(M, dtype=bool)
    base, prev_base, parent_req, parent_count = 0, 0, None, None
    for d in range(D):
        alive &= paths[:, d] >= 0
        if not alive.any():
            break
        keys, inverse, counts = np.unique(
            parent_of[alive] * big + paths[alive, d], return_inverse=True, return_counts=True
        )
        up = keys // big
        if d == 0:
            req, weight, parent = up, counts / total[up] * damping[up], np.full(keys.shape, -1)
        else:
            req, weight, parent = parent_req[up - prev_base], counts / parent_count[up - prev_base], up
        node_req.append(req)
        node_parent.append(parent)
        node_token.append(keys % big)
        node_weight.append(weight)
        parent_of = np.where(alive, 0, parent_of)
        parent_of[alive] = base + inverse.reshape(-1)
        prev_base, parent_req, parent_count = base, req, counts.astype(np.float64)
        base += keys.shape[0]
    if not node_req:
        return [None] * R
    req, parent, token, weight = (np.concatenate(x) for x in (node_req, node_parent, node_token, node_weight))
    order = np.argsort(req, kind="stable")  # node ids grow with depth: parents stay ahead of children
    local = np.empty_like(order)
    counts = np.bincount(req, minlength=R)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    local[order] = np.arange(order.shape[0]) - np.repeat(firsts, counts)
    out: list[Candidates | None] = []
    for r in range(R):
        ids = order[firsts[r] : firsts[r] + counts[r]]
        if not ids.size:
            out.append(None)
            continue
        par = parent[ids]
        out.append(
            Candidates(
                token[ids],
                np.where(par >= 0, local[np.maximum(par, 0)], -1),
                weights=np.clip(weight[ids], 0.0, 1.0).astype(np.float32),
            )
        )
    return out
