"""Recent outputs: the store's drafts against a brute-force reference (eviction included) and against
the numpy implementation the C++ store replaced (tests/reference.py), its bounds, bad input and
locking, and the engine drafting one request from another's output."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from reference import RecentOutputsReference
from tiny_models import tiny_model

import sssd
from sssd import _core
from sssd.recent_outputs import MATCH_DAMPING, RecentOutputs
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.sources import CandidateBatch, Candidates, DraftPipeline, DraftRequest, DraftSource, RetrievalSource


class Reference:
    """The store as a list of (request id, token, previous write of that request) in write order."""

    def __init__(self, capacity, max_match=8, min_match=2, max_matches=16, depth=64, min_depth=16, per_match=8.0):
        self.capacity, self.max_match, self.min_match = capacity, max_match, min_match
        self.max_matches, self.depth, self.min_depth, self.per_match = max_matches, depth, min_depth, per_match
        self.log: list[tuple[int, int, int]] = []
        self.last: dict[int, int] = {}
        self.floor = 0  # writes before it were forgotten (clear)

    def clear(self):
        self.floor, self.last = len(self.log), {}

    def append(self, rid, tokens, fresh=False):
        if fresh:
            self.last.pop(rid, None)
        for t in tokens:
            self.log.append((rid, int(t), self.last.get(rid, -1)))
            self.last[rid] = len(self.log) - 1

    def alive(self, a):
        return self.floor <= a and a >= len(self.log) - self.capacity

    def draft(self, rid, context, budget):
        """{path of tokens: weight} of the trie over the longest matches' continuations."""
        nxt = {prev: a for a, (_, _, prev) in enumerate(self.log) if prev >= 0}
        found = []
        for a in range(len(self.log) - 1, -1, -1):  # newest first
            if not self.alive(a) or self.log[a][0] == rid or not self.alive(self.log[a][2]) or a not in nxt:
                continue
            n, at = 0, a
            while n < self.max_match and n < len(context) and self.alive(at) and self.log[at][1] == context[-1 - n]:
                n, at = n + 1, self.log[at][2]
            if n >= self.min_match:
                found.append((n, a))
        if not found:
            return {}
        best = max(n for n, _ in found)
        chosen = [a for n, a in found if n == best][: self.max_matches]
        reach = min(self.depth, max(self.min_depth, int(best * self.per_match)))  # longer matches followed further
        counts: dict[tuple, int] = {}
        for a in chosen:
            path, at = (), nxt.get(a)
            while at is not None and len(path) < min(reach, budget):
                path += (self.log[at][1],)
                counts[path] = counts.get(path, 0) + 1
                at = nxt.get(at)
        out = {}
        for path, c in counts.items():
            above = counts[path[:-1]] if len(path) > 1 else len(chosen) / MATCH_DAMPING ** (self.max_match - best)
            out[path] = c / above
        return out


def as_paths(c):
    out, paths = {}, []
    for tok, par, w in zip(c.tokens.tolist(), c.parents.tolist(), c.weights.tolist()):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
        assert paths[-1] not in out, "siblings hold distinct tokens"
        out[paths[-1]] = w
    return out


@pytest.mark.parametrize("seed, capacity", [(0, 1000), (1, 60), (2, 25), (3, 200)])
def test_drafts_equal_the_brute_force_store(seed, capacity):
    """Requests with repetitive outputs write interleaved; the ring forgets the oldest (small capacities)."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 12, int(rng.integers(3, 9))).tolist() for _ in range(4)]
    src = RecentOutputs(capacity=capacity, max_chain=10**6)
    ref = Reference(capacity)
    contexts: dict[int, list[int]] = {}
    for step in range(40):
        rid = int(rng.integers(0, 5))
        if rid not in contexts or rng.random() < 0.1:
            prompt = rng.integers(0, 12, int(rng.integers(1, 12))).tolist()
            contexts[rid] = prompt
            src.open(rid, np.array(prompt))
            ref.append(rid, prompt[-8:], fresh=True)
        new = (
            phrases[int(rng.integers(0, 4))][: int(rng.integers(1, 6))]
            if rng.random() < 0.7
            else rng.integers(0, 12, int(rng.integers(1, 4))).tolist()
        )
        src.extend(rid, np.array(new))
        ref.append(rid, new)
        contexts[rid] += new
        requests = [DraftRequest(r, np.array(ctx), int(rng.integers(1, 80))) for r, ctx in contexts.items()]
        for req, c in zip(requests, src.propose(requests)):
            want = ref.draft(req.request_id, list(req.tokens), req.budget)
            assert (as_paths(c) if c is not None else {}) == pytest.approx(want), (
                f"step {step}, request {req.request_id}"
            )
            if c is not None:
                c.check(12)
    assert len(src) == min(capacity, len(ref.log))


class Batched(RecentOutputs):
    """The same store, asked from Python for one CandidateBatch (propose_batch), not by the merge itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recent_store = None


class PerRequest(Batched):
    """The same store, asked one Candidates a request (the path of sources without propose_batch)."""

    def propose(self, requests):
        return RecentOutputs.propose_batch(self, requests).split()

    def propose_batch(self, requests):
        return None


class Chain(DraftSource):
    """A per-request source: the request's last three tokens again, as a chain."""

    name = "chain"

    def propose(self, requests):
        return [Candidates(r.tokens[-3:].astype(np.int64), np.arange(-1, 2, dtype=np.int32)) for r in requests]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("beside", [None, "before", "after"])
def test_the_pipeline_merges_a_batch_of_proposals_as_one_a_request(seed, beside):
    """The merge asks RecentOutputs' store itself, in its own call (DraftSource.recent_store); the
    trees must be those of the store's proposals handed over from Python, as one CandidateBatch
    (propose_batch) or one Candidates a request, alone or beside a per-request source listed before
    or after it (the source tags' order), with requests at budget 0 in the batch."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 30, 12) for _ in range(3)]

    def pipeline(recent_kind):
        recent = recent_kind()
        sources = (
            [RetrievalSource(None), recent]
            if beside is None
            else (
                [RetrievalSource(None), Chain(), recent]
                if beside == "before"
                else [RetrievalSource(None), recent, Chain()]
            )
        )
        return DraftPipeline(sources, sssd.DrafterConfig(use_datastore=False), vocab_size=30)

    pipes = [pipeline(RecentOutputs), pipeline(Batched), pipeline(PerRequest)]
    contexts = {}
    for rid in range(6):
        prompt = rng.integers(0, 30, 5)
        contexts[rid] = prompt
        for p in pipes:
            p.open(rid, prompt)
    for step in range(12):
        ids = sorted(contexts)
        new = [phrases[int(rng.integers(0, 3))][: int(rng.integers(1, 6))] for _ in ids]
        for p in pipes:
            p.extend_batch(ids, new)
        for rid, t in zip(ids, new):
            contexts[rid] = np.concatenate([contexts[rid], t])
        budgets = rng.integers(0, 3, len(ids)) * 8  # some at 0: not asked
        requests = [DraftRequest(rid, contexts[rid], int(b)) for rid, b in zip(ids, budgets)]
        native, *from_python = (p.draft(requests) for p in pipes)
        for other in from_python:
            for field in ("offsets", "tokens", "parents", "depths", "scores", "sources"):
                np.testing.assert_array_equal(getattr(native, field), getattr(other, field), err_msg=f"step {step}")
        assert (native.sources == 2 + (beside == "before")).any() or step < 2, "the recent outputs drafted nothing"


def test_a_candidate_batch_splits_into_its_requests():
    batch = CandidateBatch(
        np.array([0, 2, 2, 3]),
        np.array([5, 6, 7]),
        np.array([-1, 0, -1], np.int32),
        np.array([1, 0.5, 0.25], np.float32),
    )
    parts = batch.split()
    assert len(batch) == 3 and parts[1] is None
    assert parts[0].tokens.tolist() == [5, 6] and parts[0].parents.tolist() == [-1, 0]
    assert parts[2].weights.tolist() == [0.25]


@pytest.mark.parametrize("seed", range(4))
def test_forgetting_the_history_empties_the_store(seed):
    """forget_history at random steps, open requests included: the store drafts as a brute-force store
    that forgot every earlier write (the ring wraps across the clears), and a cleared store drafts
    nothing until it is written again."""
    rng = np.random.default_rng(100 + seed)
    phrases = [rng.integers(0, 10, int(rng.integers(3, 9))).tolist() for _ in range(3)]
    src, ref = RecentOutputs(capacity=60, max_chain=10**6), Reference(60)
    contexts: dict[int, list[int]] = {}
    for step in range(60):
        if rng.random() < 0.1:
            src.forget_history()
            ref.clear()
            assert len(src) == 0 and all(src.history(r).size == 0 for r in contexts)
            reqs = [DraftRequest(r, np.array(ctx), 32) for r, ctx in contexts.items()]
            assert all(c is None for c in src.propose(reqs))
        rid = int(rng.integers(0, 4))
        if rid not in contexts:
            contexts[rid] = rng.integers(0, 10, int(rng.integers(1, 10))).tolist()
            src.open(rid, np.array(contexts[rid]))
            ref.append(rid, contexts[rid][-8:], fresh=True)
        new = phrases[int(rng.integers(0, 3))][: int(rng.integers(1, 6))]
        src.extend(rid, np.array(new))
        ref.append(rid, new)
        contexts[rid] += new
        requests = [DraftRequest(r, np.array(ctx), 40) for r, ctx in contexts.items()]
        for req, c in zip(requests, src.propose(requests)):
            want = ref.draft(req.request_id, list(req.tokens), req.budget)
            assert (as_paths(c) if c is not None else {}) == pytest.approx(want), f"step {step}"
    assert len(src) == min(60, len(ref.log) - ref.floor)


def test_a_request_never_drafts_from_its_own_tokens():
    src = RecentOutputs(capacity=100)
    src.open(1, np.array([1, 2, 3]))
    src.extend(1, np.array([1, 2, 3, 1, 2, 3]))
    assert src.propose([DraftRequest(1, np.array([1, 2, 3, 1, 2, 3, 1, 2]), 8)]) == [None]
    (c,) = src.propose([DraftRequest(2, np.array([7, 1, 2]), 8)])
    assert c.tokens[0] == 3 and c.parents[0] == -1
    src.close(1)  # its tokens stay for the others
    assert src.propose([DraftRequest(2, np.array([7, 1, 2]), 8)])[0] is not None


def test_the_first_level_is_damped_for_short_matches_and_weights_are_shares():
    src = RecentOutputs(capacity=100, max_match=4)
    src.open(1, np.array([0]))
    src.extend(1, np.array([5, 6, 7, 8, 5, 6, 9]))
    (c,) = src.propose([DraftRequest(2, np.array([3, 5, 6]), 8)])  # "5 6" twice: then 7 or 9
    assert as_paths(c) == pytest.approx(
        {(7,): 0.5 * 0.8**2, (7, 8): 1.0, (7, 8, 5): 1.0, (7, 8, 5, 6): 1.0, (7, 8, 5, 6, 9): 1.0, (9,): 0.5 * 0.8**2}
    )


def test_bad_parameters_are_refused():
    for kw in ({"capacity": 1}, {"min_match": 1}, {"min_match": 5, "max_match": 4}, {"depth": 0}):
        with pytest.raises(ValueError):
            RecentOutputs(**kw)
    assert sssd.RecentOutputs is RecentOutputs


def walk_back(ref: RecentOutputsReference, rid: int) -> list[int]:
    """The reference's tokens of a request, its links walked back from its last token while alive."""
    at, seen = ref._last.get(rid, 0), []
    while ref._alive(at):
        seen.append(int(ref.tokens[(at - 1) % ref.capacity]))
        at = int(ref.prev[(at - 1) % ref.capacity])
    return seen[::-1]


EQUIVALENCE = [  # seed, capacity, vocabulary, and the store's parameters
    (0, 50, 4, {}),
    (1, 37, 3, {"max_chain": 3, "max_matches": 2}),
    (2, 300, 6, {"max_chain": 1}),
    (3, 120, 5, {"min_match": 3, "max_match": 5, "max_matches": 1, "depth": 10}),
    (4, 2, 3, {"max_chain": 2}),  # too small to draft from: a match and its continuation are 3 tokens
    (5, 64, 8, {"max_match": 2, "depth": 5, "depth_per_match": 0.0}),
    (6, 1000, 5, {"max_chain": 10**6, "max_matches": 10**6, "depth_per_match": 100.0}),
    (7, 200, 4, {"min_match": 4, "max_match": 12, "depth_per_match": 1.5, "max_chain": 8}),
    (8, 17, 2, {"max_matches": 3, "depth": 1}),
    (9, 500, 12, {"depth_per_match": 0.37, "max_chain": 5}),
]


@pytest.mark.parametrize("seed, capacity, vocab, kw", EQUIVALENCE)
def test_the_store_drafts_exactly_as_the_numpy_implementation(seed, capacity, vocab, kw):
    """Many requests opening, writing, closing and reopening interleaved; small capacities (the ring
    wraps, requests' own links are overwritten), small vocabularies (repeats everywhere, long chains),
    token ids up to 2^31 - 1 (the hash as numpy computes it), budgets from 0 up."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**31, vocab)  # the vocabulary: a few large ids among small ones
    ids[: vocab // 2] = np.arange(vocab // 2)
    phrases = [rng.integers(0, vocab, int(rng.integers(2, 10))) for _ in range(5)]

    def some_tokens(n):
        if rng.random() < 0.6:
            p = phrases[int(rng.integers(len(phrases)))]
            return ids[p[int(rng.integers(len(p))) :][:n]]
        return ids[rng.integers(0, vocab, n)]

    src, ref = RecentOutputs(capacity=capacity, **kw), RecentOutputsReference(capacity=capacity, **kw)
    contexts: dict[int, np.ndarray] = {}
    compared = drafted = 0
    for step in range(250):
        rid = int(rng.integers(0, 9))
        roll = rng.random()
        if rid not in contexts or roll < 0.08:  # (re)open: a prompt of 0 to 14 tokens
            prompt = some_tokens(int(rng.integers(0, 15)))
            contexts[rid] = prompt
            src.open(rid, prompt)
            ref.open(rid, prompt)
        elif roll < 0.12:  # closed: its tokens stay, its next writes start unlinked
            src.close(rid)
            ref.close(rid)
        new = some_tokens(int(rng.integers(0, 7)))
        src.extend(rid, new)
        ref.extend(rid, new)
        contexts[rid] = np.concatenate([contexts[rid], new])
        chosen = rng.permutation(list(contexts))[: int(rng.integers(1, len(contexts) + 1))]
        budgets = rng.choice([0, 1, 2, 3, 7, 16, 40, 64, 200], size=chosen.shape[0])
        requests = [DraftRequest(int(r), contexts[int(r)], int(b)) for r, b in zip(chosen, budgets)]
        if rng.random() < 0.2:  # a context no request wrote (another engine's id, a fresh context)
            requests.append(DraftRequest(99, some_tokens(int(rng.integers(0, 10))), int(rng.integers(0, 30))))
        got, want = src.propose(requests), ref.propose(requests)
        for req, c, w in zip(requests, got, want):
            where = f"step {step}, request {req.request_id}, budget {req.budget}"
            assert (c is None) == (w is None), where
            if c is None:
                continue
            c.check(None)
            assert c.tokens.dtype == np.int64 and c.parents.dtype == np.int32 and c.weights.dtype == np.float32
            assert as_paths(c) == pytest.approx(as_paths(w), rel=0, abs=1e-6), where
            assert max(len(p) for p in as_paths(c)) <= req.budget, where
            drafted += 1
        compared += len(requests)
    assert len(src) == len(ref) and src.written == ref.written
    for rid in contexts:
        assert src.history(rid).tolist() == walk_back(ref, rid)
    assert capacity < 3 or drafted > compared // 10, "the load drafts often enough to compare"


def test_bad_input_is_refused_and_leaves_the_store_usable():
    src = RecentOutputs(capacity=64)
    src.open(1, np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="negative"):
        src.extend(1, np.array([4, -5]))
    with pytest.raises(ValueError, match="negative"):
        src.open(2, np.array([-1, 4]))
    with pytest.raises(ValueError, match="exceeds"):
        src.extend(1, np.array([2**32 - 1]))
    with pytest.raises(ValueError, match="request ids"):
        src.extend(-1, np.array([4]))
    with pytest.raises(TypeError, match="integers"):
        src.extend(1, np.array([1.5]))
    src.extend(1, np.array([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="budgets"):
        src.propose([DraftRequest(2, np.array([1, 2]), 8), DraftRequest(3, np.array([1, 2]), -1)])
    with pytest.raises(ValueError, match="token ids are >= 0"):
        src.propose([DraftRequest(2, np.array([1, -2, 2]), 8)])
    (c,) = src.propose([DraftRequest(2, np.array([1, 2]), 8)])  # nothing was written by the failures
    assert as_paths(c) == pytest.approx(
        {(3,): 0.8**6, (3, 4): 0.5, (3, 1): 0.5, (3, 1, 2): 1.0, (3, 1, 2, 3): 1.0, (3, 1, 2, 3, 4): 1.0}
    )
    assert src.written == 7 and src.history(1).tolist() == [1, 2, 3, 1, 2, 3, 4]
    for kw in (
        {"capacity": 0},
        {"capacity": -3},
        {"max_chain": 0},
        {"max_matches": 0},
        {"depth_per_match": -1.0},
        {"depth_per_match": float("nan")},
    ):
        with pytest.raises(ValueError):
            RecentOutputs(**kw)


def test_the_core_store_checks_its_arrays():
    store = _core.RecentStore(16, 4)
    store.extend(1, np.array([1, 2, 3]))
    ids, b = np.array([2]), np.array([4])
    assert store.propose(ids, [np.array([9, 1, 2, 3])], b)[1].tolist() == []  # 3 was the last token
    assert store.propose(ids, [np.array([5, 5, 9, 1, 2])], b)[1].tolist() == [3]  # the last 4 are read
    assert store.propose(ids, [[1, 2]], b)[1].tolist() == [3]  # any integer sequence
    assert store.propose(ids, [np.array([1, 2], dtype=np.uint8)], b)[1].tolist() == [3]
    assert store.propose(ids, [np.array([7, 1, 0, 2])[1::2]], b)[1].tolist() == [3]  # a strided view: 1 2
    with pytest.raises(ValueError, match="one per request"):
        store.propose(np.array([2, 3]), [np.array([1, 2])], np.array([4, 4]))
    with pytest.raises(ValueError, match="budgets"):
        store.propose(ids, [np.array([1, 2])], np.array([4, 4]))
    with pytest.raises(ValueError, match="budgets"):
        store.propose(ids, [np.array([1, 2])], np.array([-1]))
    with pytest.raises(TypeError, match="token ids"):
        store.propose(ids, [np.array([1.0, 2.0])], b)
    with pytest.raises(TypeError, match="token ids"):
        store.propose(ids, [np.zeros((2, 2), dtype=np.int64)], b)
    with pytest.raises(ValueError, match="token ids are >= 0"):
        store.propose(ids, [np.array([-3, 1, 2])], b)
    with pytest.raises(ValueError, match="token ids are >= 0"):
        store.propose(ids, [np.array([1, 2**32 - 1], dtype=np.uint64)], b)
    with pytest.raises(ValueError, match="token ids are >= 0"):
        store.propose(ids, [np.array([1, 2**63 + 5], dtype=np.uint64)], b)
    with pytest.raises(ValueError, match="request ids"):
        store.propose(np.array([-2]), [np.array([1, 2])], b)
    with pytest.raises(ValueError, match="match_damping"):
        _core.RecentStore(16, match_damping=1.5)
    empty = store.propose(np.zeros(0, dtype=np.int64), [], np.zeros(0, dtype=np.int64))
    assert [a.tolist() for a in empty] == [[0], [], [], []]
    assert store.memory_bytes() == 16 * 40 + 16 * 8 and len(store) == 3 and store.capacity == 16


def test_the_store_takes_a_batch_of_extends_whole_or_not_at_all():
    """extend_batch appends each request's tokens in order, as extend does one request at a time;
    bad offsets or tokens are refused before any request changes."""
    one, batch = _core.RecentStore(64, 4), _core.RecentStore(64, 4)
    for store in (one, batch):
        store.open(1, np.array([7, 8]))
    parts = {1: [1, 2, 3], 2: [], 3: [4, 5]}
    for rid, t in parts.items():
        one.extend(rid, np.array(t, dtype=np.int64))
    batch.extend_batch(np.array([1, 2, 3]), np.array([0, 3, 3, 5]), np.array([1, 2, 3, 4, 5]))
    for rid in parts:
        assert batch.history(rid).tolist() == one.history(rid).tolist()
    assert batch.written == one.written == 7
    for offsets, tokens, error in (
        (np.array([0, 2]), np.array([1, 2]), "entries"),  # one offset short
        (np.array([0, 2, 1, 3]), np.array([1, 2, 3]), "non-decreasing"),
        (np.array([0, 1, 2, 4]), np.array([1, 2, 3]), "end at the number of tokens"),
        (np.array([0, 1, 2, 3]), np.array([1, -2, 3]), "token ids"),
    ):
        with pytest.raises(ValueError, match=error):
            batch.extend_batch(np.array([1, 2, 3]), offsets, tokens)
    assert batch.written == 7 and batch.history(1).tolist() == [7, 8, 1, 2, 3]


def test_the_merge_refuses_a_bad_recent_query():
    """Drafter.draft's `recent` (the store asked in the merge's own call): a malformed one is refused
    with a clear error, and the drafter and store draft on afterwards."""
    d = sssd.Drafter(None, sssd.DrafterConfig(use_datastore=False))
    store = _core.RecentStore(64, 4)
    d.open(1, np.array([1, 2, 3]))
    store.open(2, np.array([1, 2]))
    store.extend(2, np.array([3, 9, 9]))
    ids, budgets = np.array([1]), np.array([8], np.int32)
    ok = d.draft(ids, budgets, recent=(store, 2, np.array([8])))
    assert 9 in ok.tokens.tolist() and (ok.sources == 2).any()  # ... 1 2 3 -> 9 9, from request 2
    for recent, error in (
        ((store, 2, np.array([8, 8])), "budgets for the recent outputs"),
        ((store, 1, np.array([8])), "source tag"),
        ((store, 15, np.array([8])), "source tag"),
        ((store, 2, np.array([-1])), "negative"),
    ):
        with pytest.raises(ValueError, match=error):
            d.draft(ids, budgets, recent=recent)
    chain = {"offsets": np.array([0, 1]), "tokens": np.array([4]), "parents": np.array([-1], np.int32)}
    with pytest.raises(ValueError, match="external source's too"):
        d.draft(ids, budgets, {**chain, "weights": np.array([1.0], np.float32)}, recent=(store, 2, np.array([8])))
    with pytest.raises(TypeError):
        d.draft(ids, budgets, recent=(store, 2))
    with pytest.raises(TypeError):
        d.draft(ids, budgets, recent=("not a store", 2, np.array([8])))
    again = d.draft(ids, budgets, recent=(store, 2, np.array([8])))
    np.testing.assert_array_equal(again.tokens, ok.tokens)


def test_the_core_store_damps_with_its_own_factor():
    store = _core.RecentStore(100, 4, match_damping=0.5)
    store.extend(1, np.array([0, 5, 6, 7, 8, 5, 6, 9]))
    offsets, tokens, parents, weights = store.propose(np.array([2]), [np.array([3, 5, 6])], np.array([8]))
    assert tokens[:2].tolist() == [7, 9] and parents[:2].tolist() == [-1, -1]
    assert weights[:2].tolist() == pytest.approx([0.5 * 0.5**2] * 2)


def test_concurrent_writers_and_readers_keep_each_request_in_order():
    src = RecentOutputs(capacity=1 << 12)
    errors = []

    def write(rid):
        try:
            src.open(rid, np.array([rid]))
            for i in range(200):
                src.extend(rid, np.array([rid, 1000 + i]))
                src.propose([DraftRequest(rid, np.array([rid, 1000 + i]), 8)])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(src) == 4 * 401
    for rid in range(4):  # each request's links walked back from its last token
        assert src.history(rid).tolist() == [rid] + [t for i in range(200) for t in (rid, 1000 + i)]


# -- the engine --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("recent") / "llama", "llama")


def test_a_request_drafts_from_an_earlier_requests_output(llama):
    """The same prompt twice, one after the other: the second is drafted from the first's output,
    and both are the plain output."""
    prompts = [[5, 9, 23, 7, 3, 40], [5, 9, 23, 7, 3, 40]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=128))
    want = [o.token_ids for o in plain.generate(prompts[:1], params)] * 2
    eng = LLMEngine(
        llama, datastore=None, draft=["recent"], config=EngineConfig(max_model_len=128, budget=8, max_running=1)
    )
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    by = [o.stats["accepted_by_source"].get("recent", 0) for o in outs]
    assert by[1] > 20 and by[1] > by[0]


def test_an_engine_that_forgot_its_history_does_not_draft_an_earlier_runs_answer(llama):
    """A benchmark's second run of the same prompt (the first unspeculated, on the same engine) is
    drafted from the first one's answer, unless the engine forgets its history in between; it
    refuses to while requests run."""
    prompt, params = [5, 9, 23, 7, 3, 40], SamplingParams(max_tokens=30, ignore_eos=True)
    eng = LLMEngine(
        llama, datastore=None, draft=["recent"], config=EngineConfig(max_model_len=128, budget=8, max_running=1)
    )
    want = eng.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True, speculate=False))[0].token_ids
    warm = eng.generate([prompt], params)[0]
    assert warm.token_ids == want and warm.stats["accepted_by_source"].get("recent", 0) > 20
    eng.forget_history()
    cold = eng.generate([prompt], params)[0]
    assert cold.token_ids == want and cold.stats["accepted_by_source"].get("recent", 0) == 0
    eng.add_request(prompt, params)
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.forget_history()


def test_the_library_llm_forgets_its_history_too(llama):
    llm = sssd.LLM(llama, datastore=None, draft=["recent"], budget=8, max_model_len=128)
    prompt, params = [5, 9, 23, 7, 3, 40], SamplingParams(max_tokens=24, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert llm.generate([prompt], params)[0].stats["accepted_by_source"].get("recent", 0) > 10
    llm.forget_history()
    again = llm.generate([prompt], params)[0]
    assert again.token_ids == first.token_ids and again.stats["accepted_by_source"].get("recent", 0) == 0
    llm.close()
