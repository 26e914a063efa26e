"""Recent outputs: the store's drafts against a brute-force reference (eviction included), its
bounds and locking, and the engine drafting one request from another's output."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tiny_models import tiny_model

import sssd
from sssd.recent_outputs import MATCH_DAMPING, RecentOutputs
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.sources import DraftRequest


class Reference:
    """The store as a list of (request id, token, previous write of that request) in write order."""

    def __init__(self, capacity, max_match=8, min_match=2, max_matches=16, depth=64, min_depth=16, per_match=8.0):
        self.capacity, self.max_match, self.min_match = capacity, max_match, min_match
        self.max_matches, self.depth, self.min_depth, self.per_match = max_matches, depth, min_depth, per_match
        self.log: list[tuple[int, int, int]] = []
        self.last: dict[int, int] = {}

    def append(self, rid, tokens, fresh=False):
        if fresh:
            self.last.pop(rid, None)
        for t in tokens:
            self.log.append((rid, int(t), self.last.get(rid, -1)))
            self.last[rid] = len(self.log) - 1

    def alive(self, a):
        return 0 <= a and a >= len(self.log) - self.capacity

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
    for rid in range(4):  # walk each request's links back from its last token
        at, seen = src._last[rid], []
        while at:
            seen.append(int(src.tokens[(at - 1) % src.capacity]))
            at = int(src.prev[(at - 1) % src.capacity])
        assert seen[::-1] == [rid] + [t for i in range(200) for t in (rid, 1000 + i)]


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
