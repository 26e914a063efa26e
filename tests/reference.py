"""Brute-force pure-Python oracles for the C++ core.

Each function recomputes, naively and slowly, what a core component promises:
suffix order, occurrence counts, the datastore's sampled continuation tree,
the input trie's continuation trees, and the priority-queue merge.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

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
