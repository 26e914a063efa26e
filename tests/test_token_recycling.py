"""Token Recycling: its template, its adjacency matrix and its drafts against brute-force references,
the backend's top-k, and the engine with every source against plain decoding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tiny_models import tiny_model

import sssd
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.sources import DraftRequest, parse_specs
from sssd.token_recycling import TokenRecycling, rank_prior, static_template

PROMPTS = [[5, 9, 23, 7, 3, 40, 41, 42, 3], [10, 11, 12, 13, 10, 11, 12], [4] * 20, [60], [7, 8, 9, 7, 8, 9, 7, 8]]


# -- the template ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("k, depth, nodes", [(3, 4, 20), (4, 3, 40), (8, 6, 80), (2, 8, 7)])
def test_template_is_the_best_nodes_by_path_weight(k, depth, nodes):
    rates = rank_prior(k)
    t = static_template(rates, nodes, depth)
    # brute force: every rank path up to `depth`, weighed by the product of its rates
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    weight = {p: float(np.prod(rates[list(p)])) for p in paths}
    got = []
    for i in range(len(t)):
        path, j = [], i
        while j >= 0:
            path.append(int(t.ranks[j]))
            j = int(t.parents[j])
        got.append(tuple(reversed(path)))
    assert len(got) == min(nodes, len(paths)) and len(set(got)) == len(got)
    assert all(t.parents[i] < i for i in range(len(t))), "a parent precedes its children"
    assert [len(p) for p in got] == t.depths.tolist()
    cutoff = sorted(weight.values(), reverse=True)[len(got) - 1]
    assert all(weight[p] >= cutoff - 1e-12 for p in got)
    assert [weight[p] for p in got] == sorted((weight[p] for p in got), reverse=True)


# -- the adjacency matrix and the drafts ---------------------------------------------------------------


def brute_draft(matrix: dict, template, root: int, budget: int):
    """The template walked node by node over a dict of rows: {path of tokens: rank}."""
    out = {}
    tokens = {}
    for i in range(min(budget, len(template))):
        p = int(template.parents[i])
        if p >= 0 and p not in tokens:
            continue
        above = root if p < 0 else tokens[p][-1]
        if above not in matrix:
            continue
        path = (() if p < 0 else tokens[p]) + (matrix[above][int(template.ranks[i])],)
        tokens[i] = path
        out[path] = int(template.ranks[i])
    return out


def as_paths(c):
    """{path of tokens from the root: weight} of a Candidates."""
    out, paths = {}, []
    for tok, par, w in zip(c.tokens.tolist(), c.parents.tolist(), c.weights.tolist()):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
        out[paths[-1]] = w
    return out


def test_observing_keeps_the_newest_topk_per_token_and_scores_the_old_rows():
    src = TokenRecycling(k=3, vocab_size=20)
    src.observe_verified(np.array([1, 1, 2]), np.array([5, 6, 5]), np.array([[1, 2, 3], [7, 8, 9], [4, 2, 3]]))
    assert src.seen[[5, 6]].all() and src.seen.sum() == 2
    assert src.matrix[5].tolist() == [4, 2, 3] and src.matrix[6].tolist() == [7, 8, 9]  # the later node wins
    assert src.trials == 0
    # the new argmax after 5 is 2: the old row's rank 1; after 6 it is 7: rank 0
    src.observe_verified(np.array([3, 3]), np.array([5, 6]), np.array([[2, 0, 1], [7, 1, 0]]))
    assert src.trials == 2 and src.hits.tolist() == [1, 1, 0]
    assert np.all(np.diff(rank_prior(3)) < 0) and np.all((src.rates() > 0) & (src.rates() < 1))
    with pytest.raises(ValueError):
        src.observe_verified(np.array([1]), np.array([5]), np.array([[1, 2]]))  # fewer than k columns


def test_the_template_follows_the_measured_rates():
    """Every new argmax is the old row's rank-2 token: once enough are checked, the rates and the
    rebuilt template put rank 2 first."""
    src = TokenRecycling(k=4, vocab_size=50, nodes=30, max_depth=4)
    first = src.template
    toks = np.arange(50)
    rows = np.stack([(toks + d) % 50 for d in range(1, 5)], axis=1)
    for _ in range(7):
        src.observe_verified(toks, toks, rows)
        rows = rows[:, [2, 0, 1, 3]]
    assert src.trials == 300 and src.hits.tolist() == [0, 0, 300, 0] and src.rates().argmax() == 2
    want = static_template(src.rates(), 30, 4)
    assert src.template is not first and src.template.ranks[0] == 2
    assert (src.template.ranks == want.ranks).all() and (src.template.parents == want.parents).all()


def test_a_matrix_without_a_vocabulary_grows():
    src = TokenRecycling(k=2)
    src.observe_verified(np.array([0]), np.array([1000]), np.array([[3, 2000]]))
    assert src.matrix.shape[0] > 2000 and src.matrix[1000].tolist() == [3, 2000]
    (c,) = src.propose([DraftRequest(0, np.array([1000]), 4)])
    assert c.tokens.tolist() == [3, 2000]


@pytest.mark.parametrize("seed", range(4))
def test_drafts_equal_the_node_by_node_walk(seed):
    rng = np.random.default_rng(seed)
    V, k = 30, 4
    src = TokenRecycling(k=k, vocab_size=V, nodes=40, max_depth=5)
    rows: dict[int, list[int]] = {}
    for _ in range(5):  # a few steps of observations, some rows overwritten
        n = int(rng.integers(1, 12))
        toks = rng.integers(0, V, n)
        top = np.stack([rng.choice(V, k, replace=False) for _ in range(n)])
        src.observe_verified(np.zeros(n, np.int64), toks, top)
        for t, row in zip(toks.tolist(), top.tolist()):
            rows[t] = row
    requests = [
        DraftRequest(i, np.array([1, int(r)]), int(b))
        for i, (r, b) in enumerate(zip(rng.integers(0, V, 12), rng.integers(0, 45, 12)))
    ]
    got = src.propose(requests)
    rates = src.rates()
    for req, c in zip(requests, got):
        want = brute_draft(rows, src.template, int(req.tokens[-1]), req.budget)
        if not want:
            assert c is None
            continue
        assert as_paths(c) == pytest.approx({p: float(np.float32(rates[r])) for p, r in want.items()})
        c.check(V)


def test_an_empty_matrix_proposes_nothing():
    src = TokenRecycling(k=4, vocab_size=10)
    assert src.propose([DraftRequest(0, np.array([3]), 8), DraftRequest(1, np.array([3]), 0)]) == [None, None]


def test_spec_strings():
    assert parse_specs("retrieval,recycle,recycle:4,recent") == [
        ("retrieval", ""),
        ("recycle", ""),
        ("recycle", "4"),
        ("recent", ""),
    ]
    for bad in ("recycle:0", "recycle:x", "recent:5"):
        with pytest.raises(ValueError, match="malformed"):
            parse_specs(bad)
    assert sssd.TokenRecycling is TokenRecycling and "recycle[:<k>]" in sssd.sources.SPEC_KINDS


# -- the backend's top-k, and the engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("recycle") / "llama", "llama")


@pytest.fixture(scope="module")
def plain_outputs(llama):
    eng = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256))
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))]


def test_the_backends_topk_comes_from_the_logits_of_every_node(llama):
    import torch

    from sssd.serving.backends.torch_backend import TorchBackend
    from sssd.serving.verify.tree_batch import pack, pack_chain
    from sssd.tree import DraftTree, concat

    be = TorchBackend(llama, slots=2, capacity=64)
    be.prefill(slice(0, 2), pack_chain(np.zeros(2), [np.array([5, 9, 23]), np.array([10, 11])]))
    tree = DraftTree(
        np.array([4, 7, 8]),
        np.array([-1, 0, -1], np.int32),
        np.array([1, 2, 1], np.int32),
        np.ones(3, np.float32),
        np.full(3, 2, np.uint8),
        np.full(3, np.nan, np.float32),
    )
    batch = pack(np.array([7, 12]), np.array([3, 2]), concat([tree, tree]))
    full = be.collect(be.launch(slice(0, 2), batch, np.zeros(2, bool)))  # every node's logits
    b, i = np.nonzero(batch.valid)
    want = torch.topk(full.logits[torch.from_numpy(full.logit_index[b, i])], 5).indices.numpy()
    for greedy in ([True, True], [True, False]):
        out = be.collect(be.launch(slice(0, 2), batch, np.array(greedy), topk=5))
        assert out.topk.shape == (2, 4, 5) and (out.topk[~batch.valid] == -1).all()
        assert (out.topk[b, i] == want).all()
        g = np.array(greedy)[b]
        assert (out.argmax[b[g], i[g]] == want[g, 0]).all()
    assert be.collect(be.launch(slice(0, 2), batch, np.ones(2, bool))).topk is None


def test_every_source_together_is_greedy_identical_and_recycling_is_accepted(llama, plain_outputs):
    eng = LLMEngine(
        llama,
        datastore=None,
        draft=["retrieval", "recycle", "recent"],
        config=EngineConfig(max_model_len=256, budget=8, max_running=3),
    )
    assert [s.name for s in eng.drafting.external] == ["recycle", "recent"] and eng.drafting.observe_topk == 8
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert eng.metrics.accepted_by_source.get("recycle", 0) > 0
    assert sum(o.stats["accepted_by_source"].get("recycle", 0) for o in outs) > 0
    assert eng.drafting.external[0].trials > 0


def test_recycling_alone_is_greedy_identical_and_speeds_up(llama, plain_outputs):
    eng = LLMEngine(llama, datastore=None, draft=["recycle:4"], config=EngineConfig(max_model_len=256, budget=16))
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert set(eng.metrics.accepted_by_source) == {"recycle"}
    assert sum(o.stats["steps"] for o in outs) < sum(len(o.token_ids) for o in outs)


def test_sampling_with_a_seed_is_identical_with_every_source(llama):
    params = [
        SamplingParams(max_tokens=25, temperature=t, top_p=p, seed=s, ignore_eos=True)
        for s, (t, p) in enumerate([(0.7, 1.0), (1.0, 0.9), (0.5, 1.0)])
    ]
    prompts = PROMPTS[: len(params)]
    plain = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256, max_running=3))
    spec = LLMEngine(
        llama,
        datastore=None,
        draft=["retrieval", "recycle", "recent"],
        config=EngineConfig(max_model_len=256, budget=8, max_running=3),
    )
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert spec.drafting.external[0].seen.any()  # sampled rows' top-k come from their logits
