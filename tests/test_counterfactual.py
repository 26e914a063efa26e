"""Counterfactual trees (serving/planning/counterfactual.py): what a plain step would have accepted,
read off the tokens its rows go on to emit, against the greedy verifier itself; the gate's probes
they call; and the engine with them: lossless, and learning while it keeps steps plain."""

from __future__ import annotations

import numpy as np
import pytest
from test_allocation import PROMPTS, engine
from test_allocation import llama as llama  # noqa: F401 - the module's fixture
from test_planner import linear_profile

from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.serving.planning.acceptance import trials
from sssd.serving.planning.allocation import BatchAllocator
from sssd.serving.planning.counterfactual import Counterfactuals, Resolved
from sssd.serving.verify.acceptance import accept_greedy
from sssd.serving.verify.tree_batch import pack
from sssd.tree import DraftBatch


def random_tree(rng, n: int, vocab: int = 4):
    """n nodes, parents before children, no two siblings with one token; scores fall along paths."""
    parents, tokens, seen = [], [], set()
    while len(tokens) < n:
        p = int(rng.integers(-1, len(tokens)))
        t = int(rng.integers(vocab))
        if (p, t) in seen:
            continue
        seen.add((p, t))
        parents.append(p)
        tokens.append(t)
    scores = np.empty(n)
    for i, p in enumerate(parents):
        scores[i] = (1.0 if p < 0 else scores[p]) * rng.uniform(0.3, 1.0)
    return np.array(tokens), np.array(parents), scores


def verified(tokens, parents, stream):
    """What accept_greedy accepts of the tree when the target's argmax follows `stream` (the tokens
    the request emits: after the root `stream[0]`, after a node on the stream's path the next one;
    elsewhere anything): (accepted draft tokens, the accepted node's ancestors, local)."""
    n = tokens.size
    depth = np.zeros(n, dtype=np.int32)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    d = DraftBatch(
        np.array([0, n]),
        tokens.astype(np.int64),
        parents.astype(np.int32),
        depth,
        np.ones(n, np.float32),
        np.zeros(n, np.uint8),
        np.ones(n, np.float32),
    )
    batch = pack(np.array([99]), np.array([10]), d, np.array([True]))
    argmax = np.full(batch.shape, 7777, dtype=np.int64)
    on = np.zeros(batch.shape[1], dtype=bool)
    on[0] = True
    argmax[0, 0] = stream[0]
    for i in range(1, batch.shape[1]):  # packed order: parents first
        p = batch.parents[0, i]
        k = batch.depths[0, i]
        if on[p] and batch.tokens[0, i] == stream[k - 1] and k < len(stream):
            on[i] = True
            argmax[0, i] = stream[k]
    acc = accept_greedy(batch, argmax)
    node = int(acc.node[0])
    return int(acc.count[0]), batch.ancestors[0, node, 1 : 1 + n]


@pytest.mark.parametrize("seed", range(60))
def test_a_row_resolves_to_what_the_greedy_verifier_would_have_accepted(seed):
    """Random trees; the emitted stream follows a random path of the tree some way, then leaves it
    (or the tree ends), delivered in random chunks (plain steps emit 1, drafting steps several):
    the counterfactual's accepted count and trials are accept_greedy's."""
    rng = np.random.default_rng(seed)
    tokens, parents, scores = random_tree(rng, int(rng.integers(1, 40)))
    node, path = int(rng.integers(tokens.size)), []
    while node >= 0:
        path.append(int(tokens[node]))
        node = int(parents[node])
    path = path[::-1][: int(rng.integers(0, len(path) + 1))]
    stream = path + [int(rng.integers(100, 110)) for _ in range(3)]  # then tokens the tree does not hold
    want_count, want_path = verified(tokens, parents, stream)
    cf = Counterfactuals()
    assert cf.add(1, 0.1, [(5, tokens, parents, scores)]) == []
    out, i = [], 0
    while i < len(stream) and not out:
        n = int(rng.integers(1, 4))
        out = cf.advance(5, stream[i : i + n])
        i += n
    rows = [o for o in out if isinstance(o, tuple)]
    steps = [o for o in out if isinstance(o, Resolved)]
    assert len(rows) == 1 and len(steps) == 1
    assert steps[0].tokens == 1 + want_count and steps[0].batch == 1 and steps[0].seconds == 0.1
    c, y = trials(scores, parents, want_path)
    np.testing.assert_allclose(rows[0][1], c)
    np.testing.assert_array_equal(rows[0][2], y)
    assert len(cf) == 0 and cf.advance(5, [1, 2]) == []


def test_a_step_resolves_when_all_its_rows_have_and_an_ended_request_as_it_stands():
    cf = Counterfactuals()
    chain = np.array([1, 2, 3, 4]), np.array([-1, 0, 1, 2]), np.array([0.9, 0.8, 0.7, 0.6])
    cf.add(3, 0.2, [(1, *chain), (2, *chain)])  # row 3 drafted nothing: its bonus token only
    assert cf.advance(1, [1, 2, 9]) != [] and len(cf) == 1  # row 1 left the tree after 2; row 2 open
    assert cf.advance(2, [1]) == []
    out = cf.close(2)  # request 2 ended after one matched token
    step = [o for o in out if isinstance(o, Resolved)][0]
    assert step.tokens == 3 + 2 + 1 and len(cf) == 0
    # a leaf ends a row at once; steps resolve in order; the oldest make room beyond max_steps
    cf = Counterfactuals(max_steps=2)
    cf.add(1, 0.1, [(7, *chain)])
    cf.add(1, 0.1, [(8, np.array([5]), np.array([-1]), np.array([0.5]))])
    out = cf.advance(8, [5])  # its row resolved, its step behind step 1
    assert len(out) == 1 and isinstance(out[0], tuple) and out[0][2].tolist() == [True]
    out = cf.add(1, 0.1, [(9, *chain)])  # step 1 resolves as it stands (nothing matched)
    assert [o.tokens for o in out if isinstance(o, Resolved)] == [1, 2] and len(cf) == 1
    assert cf.advance(7, [1, 2, 3, 4]) == []  # request 7's row was resolved to make room
    assert [o.tokens for o in cf.advance(9, [1, 2, 3, 4]) if isinstance(o, Resolved)] == [5]
    assert len(cf) == 0 and cf.steps == 0


def losing_allocator() -> BatchAllocator:
    """A bucket of 4 whose measured speculative steps lose to its plain ones."""
    alloc = BatchAllocator(linear_profile(0.05, 0.001).times)
    alloc.observe_plain(4, 0.05)  # plain: 80 tokens/s
    scores = [np.full(8, 0.5, np.float32)] * 4
    for _ in range(8):
        a = alloc.allocate([1, 2, 3, 4], np.ones(4, bool), scores)
        alloc.observe(4, int(a.counts.sum()) or 1, 0.09, 0.1, 5, a.tokens_per_second, expected=(6.0, 0.1))
    assert alloc.counterfactual(4) and alloc.report()["buckets"][4]["probe_every"] == alloc.PROBE_MAX
    return alloc


def test_counterfactual_steps_that_would_have_paid_call_a_probe_and_ones_that_would_not_do_not():
    alloc = losing_allocator()
    for _ in range(3 * alloc.PROBE_MAX):  # what plain steps would have given drafting: 4 tokens in 0.1 s
        alloc.observe_counterfactual(4, 4, 0.1)
        assert not alloc.drafts(4) or alloc._since[4] == 0
    assert alloc.called_probes == 0
    alloc = losing_allocator()
    turns = []
    for _ in range(3 * alloc.COUNTERFACTUAL_STEPS):  # a request started copying: 20 tokens in 0.1 s
        alloc.observe_counterfactual(4, 20, 0.1)
        turns.append(alloc.drafts(4))
    assert any(turns[: alloc.COUNTERFACTUAL_STEPS + 1]) and alloc.called_probes >= 1
    assert alloc.report()["counterfactual_steps"] == 3 * alloc.COUNTERFACTUAL_STEPS
    # the counterfactual's seconds are corrected as the bucket's speculative steps measured
    # against their predictions (here 0.1 s measured, 0.1 predicted: unchanged)
    assert alloc._parts[4][3] == pytest.approx(0.1) and alloc._parts[4][2] == pytest.approx(0.1)


def test_a_due_probe_is_skipped_where_the_counterfactual_steps_say_it_would_lose():
    """Enough counterfactual steps since the last probe, all losing: the probe that falls due is
    skipped as if it had lost (its interval doubles, nothing is verified); without that evidence
    probes come by the interval."""
    alloc = losing_allocator()
    alloc._probe[4] = alloc.PROBE_EVERY  # as after the first losing step
    for _ in range(alloc.COUNTERFACTUAL_STEPS):  # 4 tokens in 0.1 s: half a plain step's rate
        alloc.observe_counterfactual(4, 4, 0.1)
    turns = [alloc.drafts(4) for _ in range(alloc.PROBE_EVERY)]
    assert not any(turns) and alloc.skipped_probes == 1
    assert alloc._probe[4] == 2 * alloc.PROBE_EVERY  # counted as a probe that lost
    assert 4 not in alloc._counterfactual  # the evidence starts afresh
    # no evidence since: the next probe comes when it is due
    turns = [alloc.drafts(4) for _ in range(2 * alloc.PROBE_EVERY + 1)]
    assert sum(turns) == 1 and alloc.skipped_probes == 1
    # fewer resolved counterfactual steps than COUNTERFACTUAL_STEPS: not evidence enough to skip
    for _ in range(alloc.COUNTERFACTUAL_STEPS - 1):
        alloc.observe_counterfactual(4, 4, 0.1)
    turns = [alloc.drafts(4) for _ in range(alloc._probe[4] + 1)]  # (+1: a PLAIN_EVERY turn)
    assert sum(turns) == 1 and alloc.skipped_probes == 1


def test_counterfactual_steps_teach_the_worth_correction():
    """Resolved counterfactual steps that gave a third of the worth their selection promised bring
    the bucket's worth correction to a third, as verified steps would."""
    alloc = losing_allocator()
    assert alloc.report()["buckets"][4]["worth_correction"] != pytest.approx(1 / 3, abs=0.05)
    for _ in range(60):
        alloc.observe_counterfactual(4, 4 + 2, 0.1, worth=6.0)
    assert alloc.report()["buckets"][4]["worth_correction"] == pytest.approx(1 / 3, abs=0.02)
    # what the engine hands over: the selection's worth before the correction it was made with
    a = alloc.allocate([1, 2, 3, 4], np.ones(4, bool), [np.full(8, 0.9, np.float32)] * 4)
    raw = a.raw_worth
    assert a.correction == pytest.approx(1 / 3, abs=0.02)
    assert raw * a.correction == pytest.approx(a.expected_tokens - 4)
    cf = Counterfactuals()
    chain = np.array([1, 2]), np.array([-1, 0]), np.array([0.9, 0.8])
    cf.add(2, 0.1, [(1, *chain)], worth=1.5)
    done = cf.advance(1, [1, 2])
    assert [(d.tokens, d.worth) for d in done if isinstance(d, Resolved)] == [(4, 1.5)]


def test_counterfactual_cadence_follows_the_probe_interval():
    """Counterfactual drafting costs a drafting step's preparation: every gated step while probes
    come every PROBE_EVERY steps, one in 8 once losing probes stretched the interval to PROBE_MAX,
    and every step again once a probe wins; still enough to call a probe before one is due."""
    alloc = losing_allocator()  # its probes lost until the interval reached PROBE_MAX
    assert alloc.counterfactual_every(4) == alloc.PROBE_MAX // alloc.PROBE_EVERY == 8
    fired = [alloc.counterfactual(4) for _ in range(4 * alloc.PROBE_MAX)]
    at = np.flatnonzero(fired)  # (losing_allocator's check was the first gated step: it fired)
    assert len(at) == 4 * alloc.PROBE_MAX // 8 and set(np.diff(at)) == {8}
    assert alloc.report()["buckets"][4]["counterfactual_every"] == 8
    # COUNTERFACTUAL_STEPS of them come well within the interval
    assert alloc.COUNTERFACTUAL_STEPS * alloc.counterfactual_every(4) <= alloc.PROBE_MAX // 2
    alloc._probe[4] = 2 * alloc.PROBE_EVERY  # one losing probe: every other gated step
    assert sum(alloc.counterfactual(4) for _ in range(8)) == 4
    a = alloc.allocate([1, 2, 3, 4], np.ones(4, bool), [np.full(8, 0.9, np.float32)] * 4)
    alloc.observe(4, int(a.counts.sum()), 0.04, 0.04, 20, a.tokens_per_second, expected=(20.0, 0.04))
    alloc.observe(4, int(a.counts.sum()), 0.04, 0.04, 20, a.tokens_per_second, expected=(20.0, 0.04))
    assert not alloc.counterfactual(4)  # probes won: the bucket drafts, no counterfactual needed
    alloc._gain[4] = 0.5  # it loses again, its interval back at the start: every gated step
    assert all(alloc.counterfactual(4) for _ in range(8)) and alloc.counterfactual_every(4) == 1


def test_steps_kept_plain_learn_what_drafting_would_have_given_and_change_no_output(llama):  # noqa: F811
    """A gate that loses throughout (every speculative step measured slower than plain ones):
    the steps it keeps plain draft counterfactual trees, which resolve against the emitted tokens
    and teach the acceptance model, and the output is plain decoding's."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = LLMEngine(llama, datastore=None, config=EngineConfig(max_running=4, max_model_len=400, speculate=False))
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    spec = engine(llama, linear_profile(0.05, 0.0005))
    alloc = spec.allocator
    alloc.PROBE_EVERY = alloc.PROBE_MAX = 10**9  # no probe: every step but the counterfactual's is plain
    alloc.COUNTERFACTUAL_STEPS = 10**9
    alloc._losing = lambda key: True
    observed = []
    learn = alloc.acceptance.observe
    alloc.acceptance.observe = lambda ids, *a, **k: (observed.extend(ids), learn(ids, *a, **k))
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert set(spec.metrics.budgets) == {0}  # nothing verified
    assert alloc.counterfactual_steps > 0 and observed  # but drafted, resolved and learnt from
    assert len(spec.decode_step.counterfactuals) == 0 and alloc.acceptance.rows == {}  # nothing left behind
    # a sampled row in the batch: no counterfactual (its draws decide what it would have accepted)
    steps = alloc.counterfactual_steps
    mixed = [params, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=1)]
    spec.generate(PROMPTS[:2], mixed)
    assert alloc.counterfactual_steps == steps
