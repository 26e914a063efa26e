"""The peer drafters of benchmarks/peers: exact tiny cases, oracles, and replay.

PLD and the vLLM n-gram proposer are checked against their originals (HF's
PromptLookupCandidateGenerator when transformers is installed; vLLM's own
test cases and a line-by-line port of its numba KMP). REST is checked on a
hand-made corpus where the counts, REST's heap and its cut_to_choices give a
known tree. ADED and SuffixDecoding need their packages (.venv-peers) and are
skipped without them.
"""

from __future__ import annotations

import heapq
import sys
from pathlib import Path

import numpy as np
import pytest

import sssd
from sssd.calibration.replay import Example, replay

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from peers import aded, ngram_vllm, pld, rest, suffix_decoding  # noqa: E402
from peers._base import paths_tree  # noqa: E402

SEP = sssd.SEPARATOR


def chain_of(batch: sssd.DraftBatch, b: int = 0) -> list[int]:
    t = batch[b]
    assert np.array_equal(t.parents, np.arange(-1, len(t) - 1)), "not a chain"
    return t.tokens.tolist()


def paths_of(t: sssd.DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node path of a tree (the tree as a set of prefixes)."""
    return {tuple(t.path(i)) for i in range(len(t))}


def corpus(docs: list[list[int]]) -> np.ndarray:
    out: list[int] = []
    for d in docs:
        out += d + [SEP]
    return np.array(out, dtype=np.uint32)


# -- prompt lookup (HF) ----------------------------------------------------------
def test_pld_copies_the_continuation_of_a_repeated_ngram():
    ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert pld.prompt_lookup(np.array(ctx), 3, 5).tolist() == [4, 5, 9, 9, 1]
    # The continuation may run into the matched suffix itself, and stops at the context's end.
    assert pld.prompt_lookup(np.array(ctx), 3, 50).tolist() == [4, 5, 9, 9, 1, 2, 3]
    d = pld.PromptLookupDrafter(max_matching_ngram_size=3)
    d.open(0, ctx)
    assert chain_of(d.draft([0], 4)) == [4, 5, 9, 9]
    d.extend_batch([0], [[4]])  # now ... 2 3 4: the 3-gram 2 3 4 occurred at the start
    assert chain_of(d.draft([0], 2)) == [5, 9]


def test_pld_prefers_the_longest_ngram_then_the_leftmost_match():
    # Last token 7: its first occurrence is followed by 8, but the 2-gram (3, 7) occurs later, followed by 6.
    ctx = np.array([7, 8, 3, 7, 6, 0, 3, 7])
    assert pld.prompt_lookup(ctx, 2, 2).tolist() == [6, 0]
    assert pld.prompt_lookup(ctx, 1, 2).tolist() == [8, 3]
    # No earlier occurrence of the last token: no candidates.
    assert pld.prompt_lookup(np.array([1, 2, 3]), 3, 4).size == 0


def test_pld_matches_transformers_prompt_lookup():
    cg = pytest.importorskip("transformers.generation.candidate_generator")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for trial in range(200):
        ctx = rng.integers(0, 6, int(rng.integers(1, 40)))
        n, k = int(rng.integers(1, 5)), int(rng.integers(1, 12))
        gen = cg.PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=n, max_length=10**6)
        out, _ = gen.get_candidates(torch.as_tensor(ctx[None, :]))
        expected = out[0, len(ctx) :].numpy()
        np.testing.assert_array_equal(
            pld.prompt_lookup(ctx, n, k), expected, err_msg=f"trial {trial}: {ctx} n={n} k={k}"
        )


# -- vLLM n-gram -----------------------------------------------------------------------
@pytest.mark.parametrize("fn", [ngram_vllm.propose, ngram_vllm.propose_reference])
def test_ngram_vllm_own_test_cases(fn):
    # tests/v1/spec_decode/test_ngram.py in vLLM.
    def p(tokens, lo, hi, k):
        return fn(np.array(tokens), lo, hi, k).tolist()

    assert p([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2) == []
    assert p([1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]
    assert p([1, 2, 3, 4, 1, 2, 3], 2, 2, 2) == [4, 1]
    assert p([1, 2, 3, 4, 1, 2, 3], 1, 1, 3) == [4, 1, 2]
    assert p([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]
    assert p([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2) == [6, 2]  # the first match
    assert p([1, 2, 3, 4, 5], 2, 2, 2) == []
    assert p([1, 2, 3, 4, 1, 2, 3], 4, 4, 2) == []
    assert p([1, 2, 3, 4, 1, 2, 3], 3, 4, 2) == [4, 1]
    assert p([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2) == [1, 2]  # the 4-gram, not [5, 1]
    assert p([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2) == [1, 2]  # not [5, 2]
    assert p([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2) == [100, 1]


def test_ngram_vllm_equals_its_kmp_on_random_contexts():
    rng = np.random.default_rng(1)
    for _ in range(500):
        ctx = rng.integers(0, 4, int(rng.integers(1, 50)))
        lo = int(rng.integers(1, 5))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 8))
        np.testing.assert_array_equal(
            ngram_vllm.propose(ctx, lo, hi, k),
            ngram_vllm.propose_reference(ctx, lo, hi, k),
            err_msg=f"{ctx} {lo} {hi} {k}",
        )


def test_ngram_vllm_drafter_batches_chains():
    d = ngram_vllm.NgramVLLMDrafter(prompt_lookup_min=2, prompt_lookup_max=3)
    d.open(3, [1, 2, 3, 4, 1, 2])
    d.open(5, [9, 8, 7])
    batch = d.draft(np.array([3, 5]), 3)
    assert chain_of(batch, 0) == [3, 4, 1] and len(batch[1]) == 0
    d.close(3)
    d.close(5)
    assert len(d) == 0


# -- REST ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rest_store():
    # After the query (5, 6): 7 8 9 three times, 7 8 1 twice, 2 3 once.
    # The longer context (4, 5, 6) occurs once, followed by 2 3.
    docs = [[5, 6, 7, 8, 9]] * 3 + [[0, 5, 6, 7, 8, 1]] * 2 + [[4, 5, 6, 2, 3]] + [[10, 11, 12]]
    return sssd.Datastore.from_tokens(corpus(docs))


def test_rest_counts_every_prefix(rest_store):
    r = rest.RESTDrafter(rest_store, long=10)
    conts = r.retrieve(np.array([9, 9, 5, 6]))  # the longest span with a hit is (5, 6)
    nodes = r.prefix_counts(conts)
    got = {
        tuple(nodes["rows"][f, :d].tolist()): int(c) for f, d, c in zip(nodes["first"], nodes["depth"], nodes["count"])
    }
    assert got == {(7,): 5, (7, 8): 5, (7, 8, 9): 3, (7, 8, 1): 2, (2,): 1, (2, 3): 1}
    # Parents point at the prefix one token shorter; continuations stop at the separator.
    for i in range(len(nodes["token"])):
        path = tuple(nodes["rows"][nodes["first"][i], : nodes["depth"][i]].tolist())
        p = nodes["parent"][i]
        if p < 0:
            assert len(path) == 1
        else:
            assert tuple(nodes["rows"][nodes["first"][p], : nodes["depth"][p]].tolist()) == path[:-1]


def test_rest_uncut_keeps_the_most_frequent_prefixes(rest_store):
    r = rest.RESTDrafter(rest_store, cut=False)
    t = r.draft_prefix([9, 9, 5, 6], 4)
    assert paths_of(t) == {(7,), (7, 8), (7, 8, 9), (7, 8, 1)}
    np.testing.assert_allclose(sorted(t.scores.tolist()), sorted([5 / 6, 5 / 6, 3 / 6, 2 / 6]), rtol=1e-6)


def test_rest_cut_to_choices_cuts_deep(rest_store):
    # The 4 most frequent prefixes have 1 + 2 + 3 + 3 = 9 distinct tokens in all;
    # REST drops the 3-token paths until the sum is <= 4: the tree is 7 -> 8.
    for seed in range(5):
        r = rest.RESTDrafter(rest_store, cut=True, seed=seed)
        assert paths_of(r.draft_prefix([9, 9, 5, 6], 4)) == {(7,), (7, 8)}
    # With choices = 6 every prefix fits the heap; 1+2+3+3+1+2 = 12 > 6: both
    # 3-token paths go (12 - 6 = 6 <= 6), leaving 7 -> 8 and 2 -> 3.
    r = rest.RESTDrafter(rest_store, cut=True)
    assert paths_of(r.draft_prefix([9, 9, 5, 6], 6)) == {(7,), (7, 8), (2,), (2, 3)}


def test_rest_uses_the_longest_matching_span(rest_store):
    r = rest.RESTDrafter(rest_store, cut=False)
    assert paths_of(r.draft_prefix([4, 5, 6], 8)) == {(2,), (2, 3)}  # (4, 5, 6) occurs: only its continuation
    # Nothing matches: REST's "random" token 100.
    assert r.draft_prefix([77, 78], 8).tokens.tolist() == [rest.REST_FALLBACK_TOKEN]
    assert len(rest.RESTDrafter(rest_store, fallback_token=None).draft_prefix([77, 78], 8)) == 0


def test_rest_takes_the_first_k_continuations_in_suffix_order(rest_store):
    r = rest.RESTDrafter(rest_store, k=2, cut=False)
    # In suffix order (5, 6) is followed by 2 3 ..., then 7 8 1 ..., then 7 8 9: the first two are 2 3 and 7 8 1.
    assert paths_of(r.draft_prefix([5, 6], 10)) == {(2,), (2, 3), (7,), (7, 8), (7, 8, 1)}


def rust_heap(count, rank, choices, perm):
    """REST's heap loop over the HashMap's iteration order ``perm``, literally."""
    heap: list = []  # max-heap on (Reverse(count), prefix) = min-heap on (count, -rank)
    for i in perm:
        if len(heap) < choices:
            heapq.heappush(heap, (count[i], -rank[i], i))
        elif count[i] > heap[0][0]:
            heapq.heappop(heap)
            heapq.heappush(heap, (count[i], -rank[i], i))
    return sorted(h[2] for h in heap)


def test_rest_top_choices_breaks_ties_as_rusts_heap(rest_store):
    rng = np.random.default_rng(2)
    r = rest.RESTDrafter(rest_store)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        count = rng.integers(1, 5, n)
        rank = rng.permutation(n)
        choices = int(rng.integers(1, 20))
        seed = int(rng.integers(1 << 30))
        r._rng = np.random.default_rng(seed)
        got = sorted(r.top_choices(count, rank, choices).tolist())
        if n > choices and (count >= np.sort(count)[n - choices]).sum() > choices:
            perm = np.random.default_rng(seed).permutation(n)  # the order top_choices draws
        else:
            perm = np.arange(n)  # no tie at the threshold: any order gives the same set
        assert got == rust_heap(count, rank, choices, perm)


# -- trees from paths (REST/ADED's output format) ----------------------------------------
def test_paths_tree_unions_prefixes_and_cuts_breadth_first():
    t = paths_tree([[1, 2, 3], [1, 4, -2], [5, -2, -2]], budget=10)
    assert paths_of(t) == {(1,), (1, 2), (1, 2, 3), (1, 4), (5,)}
    t = paths_tree([[1, 2, 3], [1, 4, -2], [5, -2, -2]], budget=3)
    assert paths_of(t) == {(1,), (5,), (1, 2)}


# -- ADED (draftretriever 0.1.1) ---------------------------------------------------------
@pytest.mark.skipif(
    not aded.available(), reason="draftretriever==0.1.1 (ADED) not installed: bash benchmarks/peers/setup_arctic.sh"
)
def test_aded_drafts_from_the_last_two_tokens(tmp_path):
    index = aded.build_index(corpus([[1, 2, 3, 4, 5, 6], [7, 2, 3, 9]] * 3), tmp_path / "a.idx", vocab_size=20)
    d = aded.ADEDDrafter(index)
    d.open(0, [8, 8, 2, 3])
    t = d.draft([0], 8)[0]
    assert 0 < len(t) <= 8 and t.max_depth <= 4
    assert set(t.tokens[t.depths == 1].tolist()) <= {4, 9}  # what follows (2, 3) in the corpus
    d.close(0)


# -- SuffixDecoding (arctic-inference) -----------------------------------------------------
@pytest.mark.skipif(
    not suffix_decoding.available(), reason="arctic-inference not installed: bash benchmarks/peers/setup_arctic.sh"
)
def test_suffix_decoding_drafts_from_the_warmed_corpus():
    warm = suffix_decoding.WarmCache(corpus([[1, 2, 3, 4, 5, 6]] * 4 + [[1, 2, 3, 7]]), max_tree_depth=16)
    d = suffix_decoding.SuffixDecodingDrafter(warm, max_spec_factor=4.0, min_token_prob=0.0)
    d.open(0, [9, 1, 2, 3])
    t = d.draft([0], 4)[0]
    assert paths_of(t) >= {(4,), (4, 5)} and len(t) <= 4
    d.extend_batch([0], [[4, 5]])
    d.close(0)
    assert 0 not in warm.cache.cached_requests and len(d) == 0


# -- replay drives every peer --------------------------------------------------------------
def peer_factories(store, tmp_path):
    yield lambda: pld.PromptLookupDrafter(2)
    yield lambda: ngram_vllm.NgramVLLMDrafter(1, 3)
    yield lambda: rest.RESTDrafter(store)
    yield lambda: rest.RESTDrafter(store, cut=False)
    if aded.available():
        index = aded.build_index(store.tokens, tmp_path / "replay.idx", vocab_size=64)
        yield lambda: aded.ADEDDrafter(index)
    if suffix_decoding.available():
        warm = suffix_decoding.WarmCache(store.tokens, max_tree_depth=16)
        yield lambda: suffix_decoding.SuffixDecodingDrafter(warm, max_spec_factor=2.0, min_token_prob=0.0)


def test_replay_runs_every_peer(tmp_path):
    rng = np.random.default_rng(3)
    docs = [list(rng.integers(0, 40, 30)) for _ in range(20)]
    store = sssd.Datastore.from_tokens(corpus(docs))
    # Outputs copied from the corpus: every drafter that looks things up finds them.
    examples = [Example(np.array(d[:10]), np.array(d[10:30])) for d in docs[:4]]
    for make in peer_factories(store, tmp_path):
        drafter = make()
        res = replay(drafter, examples, budget=8, batch_size=3)
        assert res.tokens == sum(len(e.output) for e in examples)
        assert res.mat >= 1.0 and res.steps > 0
        assert len(drafter) == 0, f"{type(drafter).__name__} left requests open"
    # REST finds the outputs verbatim in the datastore: long accepted runs.
    assert replay(rest.RESTDrafter(store, cut=False), examples, budget=16).mat > 3
