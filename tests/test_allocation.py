"""The step's verification budget shared across the batch by expected acceptance
(serving/planning/allocation.py): the selection against brute force, the acceptance model's fit,
and the engine with it: lossless, mixed greedy and sampled rows, requests that join and leave."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from test_planner import linear_profile
from tiny_models import tiny_model

import sssd
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.factory import build_allocator
from sssd.serving.engine.params import SamplingParams
from sssd.serving.planning.acceptance import CENTERS, AcceptanceModel, fit_gamma
from sssd.serving.planning.allocation import BatchAllocator, select, update_mean
from sssd.serving.planning.planner import BudgetPlanner
from sssd.tree import DraftBatch


def brute_force(values, cost, rows):
    """The best rate over every per-row prefix size."""
    best, arg = -1.0, None
    for counts in itertools.product(*[range(len(v) + 1) for v in values]):
        k = sum(counts)
        gain = sum(float(np.minimum.accumulate(v)[:c].sum()) for v, c in zip(values, counts))
        rate = (rows + gain) / float(cost(np.array([k]))[0])
        if rate > best + 1e-12:
            best, arg = rate, counts
    return best, arg


@pytest.mark.parametrize("seed", range(40))
def test_the_selection_is_the_best_of_every_per_row_prefix(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 4))
    values = [np.sort(rng.random(int(rng.integers(0, 5))))[::-1] ** rng.uniform(0.5, 3) for _ in range(B)]
    fixed, per, curve = rng.uniform(0.02, 0.1), rng.uniform(1e-4, 0.02), rng.uniform(1.0, 2.0)

    def cost(ks):
        return fixed + per * (B + np.asarray(ks, dtype=float)) ** curve

    counts, k = select(values, cost, B)
    best, _ = brute_force(values, cost, B)
    gain = sum(float(v[:c].sum()) for v, c in zip(values, counts))
    assert k == counts.sum() and all(0 <= c <= len(v) for c, v in zip(counts, values))
    assert (B + gain) / float(cost(np.array([k]))[0]) == pytest.approx(best, rel=1e-9)


def test_nothing_is_selected_where_nothing_pays_and_empty_trees_cost_nothing():
    steep = lambda ks: 0.05 * (1 + np.asarray(ks, dtype=float))  # noqa: E731 - every token costs a whole pass
    counts, k = select([np.array([0.9, 0.5]), np.array([0.3])], steep, 2)
    assert k == 0 and not counts.any()
    counts, k = select([np.zeros(0), np.zeros(0)], steep, 2)
    assert k == 0 and counts.tolist() == [0, 0]
    flat = lambda ks: np.full(np.shape(ks), 0.05)  # noqa: E731 - verifying is free: everything likely goes
    counts, k = select([np.array([0.9, 0.5]), np.array([0.3, 0.0])], flat, 2)
    assert counts.tolist() == [2, 1]


def test_a_non_increasing_row_is_cut_as_a_prefix_even_if_a_later_node_scores_higher():
    # a later node cannot be worth more than its predecessor: the cut stays a prefix
    counts, _ = select([np.array([0.2, 0.9, 0.9])], lambda ks: 0.05 + 0.0101 * np.asarray(ks, float), 1)
    assert counts.tolist() in ([0], [1], [2], [3])


@pytest.mark.parametrize("gamma", [0.4, 1.0, 2.5])
def test_gamma_is_recovered_from_bernoulli_outcomes(gamma):
    rng = np.random.default_rng(1)
    n = rng.integers(200, 2000, size=CENTERS.size).astype(float)
    a = rng.binomial(n.astype(int), CENTERS**gamma).astype(float)
    assert fit_gamma(n, a)[0] == pytest.approx(gamma, rel=0.1)


def test_a_request_that_copies_earns_budget_and_one_that_fails_loses_it():
    model = AcceptanceModel()
    rng = np.random.default_rng(0)
    for _ in range(30):
        s = rng.uniform(0.05, 0.9, size=12).astype(np.float32)
        model.observe([1, 2], np.array([True, True]), [s, s], [np.ones(12, bool), np.zeros(12, bool)])
    g = model.gammas([1, 2, 3], np.array([True, True, True]))
    assert g[0] < model.mode_gamma(True) < g[1] and g[2] == model.mode_gamma(True)
    alloc = BatchAllocator(linear_profile(0.05, 0.002).times, acceptance=model)
    scores = [np.linspace(0.9, 0.05, 16).astype(np.float32)] * 3
    counts = alloc.allocate([1, 2, 3], np.array([True] * 3), scores).counts
    assert counts[0] > counts[2] > counts[1] or (counts[0] > counts[1] and counts[1] == 0)
    model.forget(1)
    assert model.gammas([1], np.array([True]))[0] == model.mode_gamma(True)


def test_sampled_rows_are_scored_by_their_own_mode():
    model = AcceptanceModel()
    s = np.full(50, 0.5, dtype=np.float32)
    for _ in range(20):  # sampled rows accept half as often as greedy ones at the same scores
        model.observe([1, 2], np.array([True, False]), [s, s], [np.arange(50) < 25, np.arange(50) < 12])
    assert model.mode_gamma(False) > model.mode_gamma(True)
    assert model.gammas([9], np.array([False]))[0] == model.mode_gamma(False)


def test_the_candidate_budget_follows_what_verifying_costs():
    cheap = BatchAllocator(linear_profile(0.05, 0.00001).times, max_budget=64)
    # past some tokens a pass costs more than in proportion (a CPU's caches, attention): deep rows stop paying
    dear = BatchAllocator(lambda rows, t: 0.05 + 2e-5 * (rows * np.asarray(t, dtype=float)) ** 2, max_budget=64)
    assert cheap.candidate_budget(1) == 64 == cheap.candidate_budget(64)
    assert dear.candidate_budget(64) < dear.candidate_budget(4) <= 64


def test_a_row_is_drafted_as_deep_as_its_request_was_last_given():
    """A request the allocation gave nothing gets DEPTH_MIN candidates next step, one given k gets
    DEPTH_GROWTH x k (within the bucket's candidate budget), a new one the full budget; a row
    without a tree this step keeps its depth; a finished request's depth is forgotten."""
    alloc = BatchAllocator(lambda rows, t: 0.1 + 0.002 * rows * np.asarray(t, dtype=float), max_budget=64)
    ids, greedy = [1, 2, 3, 4], np.ones(4, dtype=bool)
    assert alloc.candidate_depths(ids, 4).tolist() == [64] * 4
    # at 4 rows and ~70 tokens a node pays if accepted with probability above ~0.6
    sure, likely, never = np.full(64, 0.99, np.float32), np.r_[np.full(3, 0.9), np.full(61, 0.1)], np.full(64, 0.05)
    counts = alloc.allocate(ids, greedy, [sure, likely, never, np.zeros(0, np.float32)]).counts
    assert counts.tolist() == [64, 3, 0, 0]
    assert alloc.candidate_depths(ids, 4).tolist() == [64, 12, alloc.DEPTH_MIN, 64]
    # the 8 candidates of request 3 all pay now: 4x as deep next step, then the budget
    alloc.allocate([3], greedy[:1], [np.full(8, 0.99, np.float32)])
    assert alloc.candidate_depths([3], 1).tolist() == [32]
    alloc.allocate([3], greedy[:1], [np.full(32, 0.99, np.float32)])
    assert alloc.candidate_depths([3], 1).tolist() == [64]
    alloc.forget(2)
    assert alloc.candidate_depths([2], 4).tolist() == [64] and 2 not in alloc._depth


def test_a_step_that_writes_a_prompt_chunk_chooses_as_the_same_step_without_it():
    """Verifying costs 20 ms a token and nothing else: a node worth less than a token never pays
    for it. A pass that also wrote 100 prompt tokens measured 2 s more; that chunk is paid whatever
    the step verifies, so it buys no node (priced into the choice, it diluted the step's rate and
    every node looked worth verifying) and does not deepen the rows; the step's predicted time
    carries it. Nodes that pay in a plain step are chosen alike with or without the chunk."""
    alloc = BatchAllocator(lambda rows, t: 0.02 * rows * np.asarray(t, dtype=float), max_budget=64)
    ids, greedy = [1, 2], np.array([True, True])
    weak = [np.array([0.5, 0.4]), np.array([0.5])]
    alloc.observe_prefill(2, 0, 0, 100, 0.04 + 2.0)  # the plain pass of 2 rows: 40 ms
    assert alloc.prefill_seconds(2, 100) == pytest.approx(2.0) and alloc.prefill_seconds(2, 0) == 0.0
    plain, chunk = alloc.allocate(ids, greedy, weak), alloc.allocate(ids, greedy, weak, prefill=100)
    assert plain.counts.tolist() == chunk.counts.tolist() == [0, 0]
    assert chunk.seconds == pytest.approx(plain.seconds + 2.0)
    cheap = BatchAllocator(lambda rows, t: 0.05 * rows + 0.002 * rows * (np.asarray(t, dtype=float) - 1))
    cheap.observe_prefill(2, 0, 0, 100, 0.1 + 2.0)
    strong = [np.array([0.9, 0.8, 0.02]), np.array([0.9])]
    a, b = cheap.allocate(ids, greedy, strong), cheap.allocate(ids, greedy, strong, prefill=100)
    assert a.counts.tolist() == b.counts.tolist() == [2, 1]


def test_measured_costs_correct_the_profile_and_predicted_rates_are_reported():
    alloc = BatchAllocator(linear_profile(0.05, 0.001).times)
    before = float(alloc.step_seconds(4, np.array([8]))[0])
    for _ in range(50):
        alloc.observe(
            4,
            8,
            forward_seconds=2 * before,
            step_seconds=2 * before + 0.01,
            tokens=10,
            predicted=50.0,
            expected=(12.0, 0.2),
        )
    after = float(alloc.step_seconds(4, np.array([8]))[0])
    assert after == pytest.approx(2 * before + 0.01, rel=0.02)
    rep = alloc.report()["buckets"][4]
    assert rep["forward_vs_profile"] == pytest.approx(2.0, rel=0.02) and rep["predicted_tokens_per_s"] == 50.0
    # where the prediction is off: 12 tokens expected against 10 emitted, 200 ms against what it took
    assert rep["step_tokens"] == [12.0, 10.0]
    assert rep["step_ms"] == [200.0, pytest.approx(1e3 * (2 * before + 0.01), abs=0.01)]


def test_the_measured_slope_replaces_the_profiles_and_cuts_the_nodes_bought():
    """The profile says a verified token costs 1 ms; the steps measure 8 ms (a long context). A
    ratio per batch size would fix the level at the steps' size but keep the profile's slope; the
    measured line predicts every size, and the allocation buys the nodes that pay under it."""
    true = lambda n: 0.05 + 0.008 * np.asarray(n, dtype=float)  # noqa: E731 - seconds of N verified tokens
    alloc = BatchAllocator(linear_profile(0.05, 0.001).times)
    scores = [np.geomspace(0.95, 0.2, 24).astype(np.float32)] * 4
    naive = int(alloc.allocate([1, 2, 3, 4], np.ones(4, bool), scores).counts.sum())
    rng = np.random.default_rng(0)
    for step in range(40):
        if step % 5 == 0:
            alloc.observe_plain(4, float(true(4)), float(true(4)))
            continue
        k = int(rng.integers(4, 40))
        alloc.observe(4, k, float(true(4 + k)), float(true(4 + k)) + 0.002, 4 + k // 2)
    for k in (0, 8, 32, 64):
        assert float(alloc.forward_seconds(4, np.array([k]))[0]) == pytest.approx(float(true(4 + k)), rel=0.05)
    fitted = int(alloc.allocate([1, 2, 3, 4], np.ones(4, bool), scores).counts.sum())
    # the best k under the true cost, by brute force over the batch's nodes
    values = np.sort(np.concatenate([np.minimum.accumulate(s.astype(float)) for s in scores]))[::-1]
    rates = (4 + np.concatenate([[0.0], np.cumsum(values)])) / (true(4 + np.arange(values.size + 1)) + 0.002)
    assert fitted < naive and rates[fitted] >= 0.99 * rates.max() > rates[naive] * 1.05
    assert alloc.report()["buckets"][4]["forward_fit_ms"][1] == pytest.approx(8.0, rel=0.05)


def test_selected_worth_is_corrected_by_what_the_steps_emitted():
    """The selected nodes turn out to give half the tokens their scores promise (the winner's
    curse): the bucket's correction goes to 1/2, the predicted tokens then match the emitted ones,
    and fewer nodes are bought."""
    alloc = BatchAllocator(linear_profile(0.05, 0.001).times)
    scores = [np.geomspace(0.9, 0.05, 32).astype(np.float32)] * 4
    ids, greedy = [1, 2, 3, 4], np.ones(4, bool)
    first = alloc.allocate(ids, greedy, scores)
    for _ in range(40):
        a = alloc.allocate(ids, greedy, scores)
        raw = sum(float(np.minimum.accumulate(scores[b].astype(float))[:c].sum()) for b, c in enumerate(a.counts))
        emitted = 4 + 0.5 * raw
        seconds = float(alloc.step_seconds(4, np.array([a.counts.sum()]))[0])
        alloc.observe(
            4,
            int(a.counts.sum()),
            seconds,
            seconds,
            int(round(emitted)),
            a.tokens_per_second,
            expected=(a.expected_tokens, a.seconds),
        )
    assert alloc.report()["buckets"][4]["worth_correction"] == pytest.approx(0.5, abs=0.05)
    last = alloc.allocate(ids, greedy, scores)
    raw = sum(float(np.minimum.accumulate(scores[b].astype(float))[:c].sum()) for b, c in enumerate(last.counts))
    assert last.expected_tokens - 4 == pytest.approx(0.5 * raw, rel=0.1)
    assert last.counts.sum() < first.counts.sum()


def test_a_batch_size_without_its_own_correction_borrows_the_nearest_buckets():
    alloc = BatchAllocator(linear_profile(0.05, 0.001).times)
    assert alloc.correction(16) == 1.0  # nothing learnt anywhere
    for batch, got in ((4, 0.5), (64, 0.75)):  # nodes worth 4 tokens by their scores gave 2, then 3
        for _ in range(alloc.RATIO_STEPS):  # (the step expected what the correction then in use said)
            alloc.observe(batch, 8, 0.0, 0.0, batch + int(4 * got), expected=(batch + 4 * alloc.correction(batch), 0.1))
    assert alloc.correction(4) == pytest.approx(0.5) and alloc.correction(64) == pytest.approx(0.75)
    assert alloc.correction(8) == pytest.approx(0.5) and alloc.correction(32) == pytest.approx(0.75)
    assert alloc.correction(16) == pytest.approx(0.5)  # as near to both: the fewer rows'
    scores = [np.full(8, 0.9, np.float32)] * 16
    a = alloc.allocate(list(range(16)), np.ones(16, bool), scores)
    assert a.correction == pytest.approx(0.5)
    assert alloc.report()["buckets"].get(16, {}).get("worth_correction") is None  # its own is still unlearnt


def test_a_prefix_of_a_draft_batch_keeps_each_rows_first_nodes():
    from test_engine_seams import random_drafts

    rng = np.random.default_rng(5)
    drafts = random_drafts(rng, 5, max_nodes=12)
    counts = np.array([0, 3, 100, 1, 2])
    cut = drafts.prefix(counts)
    assert isinstance(cut, DraftBatch)
    for b in range(5):
        n = min(counts[b], drafts.sizes[b])
        assert np.array_equal(cut[b].tokens, drafts[b].tokens[:n]) and np.array_equal(
            cut[b].parents, drafts[b].parents[:n]
        )


# -- the engine with the allocation ----------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("alloc") / "llama", "llama")


def engine(model, profile=None, datastore=None, **kw):
    """An engine planning its budget under `profile` (one where speculation pays: this machine's
    profile of a tiny model may not, and measuring it would take the test's time)."""
    if profile is None:
        return LLMEngine(model, datastore=datastore, config=EngineConfig(max_running=4, max_model_len=400, **kw))
    eng = LLMEngine(model, datastore=datastore, config=EngineConfig(max_running=4, max_model_len=400, budget=64))
    eng.config = dataclasses.replace(eng.config, budget=None)
    eng.planner = BudgetPlanner(None, {4: 1.7, 8: 1.9, 16: 2.05, 64: 2.3}, profile)
    eng.allocator = build_allocator(eng)
    eng.allocator.FIT_STEPS = 10**9  # priced by `profile` throughout, not by the tiny model's measured passes
    eng.allocator.PROBE_EVERY = eng.allocator.PROBE_MAX = 1  # nor gated by its measured steps against plain ones
    return eng


PROMPTS = [[5 + i, 9, 23, 7, 3, 40, 41, 42, 5 + i, 9, 23] for i in range(6)] + [[4] * 20, [7, 8, 9] * 5]


def test_greedy_output_is_plain_output_and_rows_get_different_budgets(llama):
    """Half the requests have their answers in the datastore (their drafts keep being right), the
    other half draft from their own text and the others' outputs (the tiny model's, mostly wrong):
    the outputs are plain decoding's, and the rows' budgets differ."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLMEngine(llama, datastore=None, config=EngineConfig(max_running=4, max_model_len=400, speculate=False))
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    known = [list(p) + list(w) + [int(sssd.SEPARATOR)] for p, w in zip(PROMPTS[::2], want[::2])]
    store = sssd.Datastore.from_tokens(np.array([t for d in known for t in d], dtype=np.uint32))
    spec = engine(llama, linear_profile(0.05, 0.0005), datastore=store)
    assert spec.allocator is not None and spec.config.budget is None
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    per_step = [b for o in outs for b in o.stats["budgets"]]
    assert spec.allocator.steps > 0 and spec.allocator.acceptance.rows == {}  # finished requests forgotten
    assert spec.allocator._depth == {}
    assert spec.metrics.accepted_by_source
    assert len(set(per_step)) > 2  # not one budget for everyone


def test_no_row_verifies_a_node_deeper_than_it_has_tokens_left(llama):
    """A row that may emit L more tokens (max_tokens) can use no node deeper than L - 1 (its bonus
    token is one of the L): the allocation never verifies one, and the output is plain's."""
    prompts = [[7, 8, 9, 10, 11, 12] * 12, [20, 21, 22] * 20, [5 + i for i in range(30)] * 2]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
    plain = LLMEngine(llama, datastore=None, config=EngineConfig(max_running=4, max_model_len=400, speculate=False))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    spec = engine(llama, linear_profile(0.05, 0.00001))  # verifying is nearly free: deep trees pay
    seen = []
    launch = spec.decode_step.launch

    def watch(plan):
        depth = np.where(plan.batch.valid, plan.batch.depths, 0).max(axis=1)
        seen.extend(zip(depth.tolist(), [r.tokens_left for r in plan.requests]))
        return launch(plan)

    spec.decode_step.launch = watch
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert max(d for d, _ in seen) >= 2  # deep nodes were verified where tokens were left for them
    assert all(d <= left - 1 for d, left in seen), seen


def test_mixed_greedy_and_sampled_rows_join_and_leave_mid_flight(llama):
    """Requests of every kind in one batch, some of one token, some greedy, some sampled with a seed:
    each is what it is alone without speculation."""
    kinds = [
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=25, ignore_eos=True, temperature=0.9, seed=3),
        SamplingParams(max_tokens=12, ignore_eos=True, speculate=False),
        SamplingParams(max_tokens=35, ignore_eos=True, temperature=0.7, top_p=0.9, seed=11),
    ]
    reqs = [(p, kinds[i % len(kinds)]) for i, p in enumerate(PROMPTS)]
    plain = LLMEngine(llama, datastore=None, config=EngineConfig(max_running=4, max_model_len=400, speculate=False))
    want = [plain.generate([p], k)[0].token_ids for p, k in reqs]
    spec = engine(llama, linear_profile(0.05, 0.0005))
    ids = [spec.add_request(p, k) for p, k in reqs[:3]]
    got: dict = {}
    pending = list(reqs[3:])
    while spec.has_unfinished() or pending:
        for o in spec.step():
            if o.finished:
                got[o.request_id] = o.token_ids
        if pending and spec.step_count % 3 == 0:  # join mid-flight
            p, k = pending.pop(0)
            ids.append(spec.add_request(p, k))
    assert [got[i] for i in ids] == want


def test_a_cost_where_nothing_pays_makes_plain_steps(llama):
    from sssd.serving.planning.profile import ForwardProfile

    rows, tokens = [1, 4, 16, 64], [1, 2, 5, 17, 65]
    steep = ForwardProfile(rows, tokens, [[0.001 + 0.05 * (r * t) ** 1.5 for t in tokens] for r in rows], context=256)
    spec = engine(llama, steep)  # a pass costs more than in proportion to its tokens: no draft token pays
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = spec.generate(PROMPTS[:3], params)
    assert all(len(o.token_ids) == 20 for o in outs)
    assert set(spec.metrics.budgets) == {0}
    assert spec.allocator.empty_steps == spec.allocator.steps  # any tree drafted was cut to nothing
    assert spec.allocator.plain_steps > 0 and spec.allocator.candidate_budget(3) == 0  # or none was drafted


def test_an_explicit_budget_is_that_budget(llama):
    spec = engine(llama, budget=6)
    assert spec.allocator is None and spec.planner.fixed == 6
    outs = spec.generate(PROMPTS[:2], SamplingParams(max_tokens=20, ignore_eos=True))
    assert set(spec.metrics.budgets) == {6}
    assert len(outs) == 2


def test_trials_are_the_nodes_whose_parent_was_accepted_at_their_conditional_probability():
    from sssd.serving.planning.acceptance import trials

    #        root
    #       /    \
    #      0(.8)  1(.1)
    #      |        \
    #      2(.6)     3(.05)
    #      |
    #      4(.3)
    scores = np.array([0.8, 0.1, 0.6, 0.05, 0.3])
    parents = np.array([-1, -1, 0, 1, 2])
    accepted = np.array([True, False, True, False, False])  # the path 0 -> 2, then 4 rejected
    c, y = trials(scores, parents, accepted)
    assert c.tolist() == pytest.approx([0.8, 0.1, 0.75, 0.5]) and y.tolist() == [True, False, True, False]
    # a rejected 50-node chain is one failed trial
    c, y = trials(np.linspace(0.9, 0.1, 50), np.arange(50) - 1, np.zeros(50, bool))
    assert c.size == 1 and not y[0]


def test_plain_steps_are_measured_and_drafting_stops_where_it_loses_to_them():
    alloc = BatchAllocator(linear_profile(0.05, 0.001).times)
    assert not alloc.drafts(4)  # the first step of a bucket measures plain decoding
    alloc.observe_plain(4, 0.05)
    assert alloc.drafts(4)
    scores = [np.full(8, 0.5, np.float32)] * 4
    # speculative steps turn out to cost 3x what the profile says: drafting loses to the plain step
    for _ in range(20):
        a = alloc.allocate([1, 2, 3, 4], np.ones(4, bool), scores)
        alloc.observe(4, int(a.counts.sum()) or 1, 0.15 * (1 + a.counts.sum() / 40), 0.16, 6, a.tokens_per_second)
    assert alloc.report()["buckets"][4]["gain_over_plain"] < 1.0
    turns = [alloc.drafts(4) for _ in range(4 * alloc.PROBE_MAX)]
    assert 0 < sum(turns) <= 4 * alloc.PROBE_MAX // alloc.PROBE_EVERY  # only probes draft


def test_one_slow_first_speculative_step_does_not_keep_the_gate_shut():
    """A bucket's first speculative step stalls (1 token in 240 ms beside 60 ms plain steps: a
    one-off), and every later one wins (2 tokens in 80 ms). Its means start as plain means, so two
    winning probes outweigh the stall and drafting resumes; a mean started at its first value needed
    five probes over 189 steps, as each loss doubled the interval."""
    alloc = BatchAllocator(linear_profile(0.05, 0.001).times)
    alloc.observe_plain(1, 0.06)
    scores = [np.full(8, 0.5, np.float32)]

    def step(tokens: int, seconds: float) -> None:
        a = alloc.allocate([1], np.ones(1, bool), scores)
        alloc.observe(1, int(a.counts.sum()) or 1, seconds - 0.002, seconds, tokens, a.tokens_per_second, (2.0, 0.08))

    step(1, 0.24)
    assert alloc.report()["buckets"][1]["gain_over_plain"] < 1.0
    turns = 0
    while alloc._losing(1) and turns < 400:
        turns += 1
        if alloc.drafts(1):
            step(2, 0.08)
    assert turns <= 40, turns
    rep = alloc.report()["buckets"][1]
    assert rep["step_ms"][1] < 2 * 80 and rep["measured_tokens_per_s"] > 10  # the stall no longer stands for the past


def test_update_mean_starts_as_the_plain_mean_and_decays_as_an_exponential_one():
    means, weights = {}, {}
    for x in (3.0, 1.0, 2.0):
        update_mean(means, weights, "k", x, 0.5)
    assert means["k"] == pytest.approx((0.25 * 3 + 0.5 * 1 + 2) / (0.25 + 0.5 + 1))
    update_mean(means, weights, "v", [1.0, 10.0], 0.9)
    update_mean(means, weights, "v", [3.0, 30.0], 0.9)
    assert means["v"] == pytest.approx([(0.9 + 3) / 1.9, (9 + 30) / 1.9])
    for _ in range(500):  # long after the start: the usual exponential mean's weight on the new value
        update_mean(means, weights, "k", 2.0, 0.5)
    assert update_mean(means, weights, "k", 4.0, 0.5) == pytest.approx(2.0) and means["k"] == pytest.approx(3.0)


def test_probes_that_keep_losing_come_less_often_and_one_that_wins_resets_them():
    alloc = BatchAllocator(linear_profile(0.05, 0.001).times)
    alloc.observe_plain(4, 0.05)  # plain: 80 tokens/s
    scores = [np.full(8, 0.5, np.float32)] * 4

    def probe(tokens: int) -> None:  # a drafted step of 0.1 s
        a = alloc.allocate([1, 2, 3, 4], np.ones(4, bool), scores)
        alloc.observe(4, int(a.counts.sum()) or 1, 0.09, 0.1, tokens, a.tokens_per_second)

    for _ in range(8):
        probe(5)  # 50 tokens/s: each probe loses
    assert alloc.report()["buckets"][4]["probe_every"] == alloc.PROBE_MAX
    turns = [alloc.drafts(4) for _ in range(4 * alloc.PROBE_MAX)]
    assert 1 <= sum(turns) <= 4  # one probe in PROBE_MAX steps
    for _ in range(6):
        probe(16)  # 160 tokens/s: drafting pays again
    assert alloc.report()["buckets"][4]["probe_every"] is None
    assert sum(alloc.drafts(4) for _ in range(64)) >= 64 - 64 // alloc.PLAIN_EVERY - 1
    # where speculative steps cost what the profile says, drafting goes on (and plain is re-measured)
    good = BatchAllocator(linear_profile(0.05, 0.001).times)
    good.observe_plain(4, 0.054)
    for _ in range(20):
        a = good.allocate([1, 2, 3, 4], np.ones(4, bool), [np.full(8, 0.9, np.float32)] * 4)
        good.observe(4, int(a.counts.sum()), float(good.forward_seconds(4, [a.counts.sum()])[0]), 0.06, 10, 1.0)
    turns = [good.drafts(4) for _ in range(64)]
    assert 64 - 64 // good.PLAIN_EVERY - 1 <= sum(turns) < 64


def test_drafted_steps_must_beat_plain_ones_by_the_margin_to_open_the_gate():
    """At 32 rows, steps that measure barely faster than plain ones (a run pays for speculation
    outside them too) keep the bucket losing, so that only probes draft; steps that clear the margin
    open it. At one row the same 1.02x opens it: the margin shrinks with the rows."""
    margin = BatchAllocator.GAIN_MARGIN
    for rows, gain, losing in ((32, 1.02, True), (32, 1.0 + 2 * margin, False), (1, 1.02, False)):
        alloc = BatchAllocator(linear_profile(0.05, 0.001).times)
        alloc.observe_plain(rows, rows / 80.0)  # plain: 80 tokens/s
        for _ in range(6):
            alloc.observe(rows, 8, 0.0, (rows + 1) / (gain * 80.0), rows + 1)
        assert alloc.report()["buckets"][rows]["gain_over_plain"] == pytest.approx(gain)
        assert alloc._losing(rows) is losing, (rows, gain)
        turns = sum(alloc.drafts(rows) for _ in range(64))
        assert turns <= 64 // alloc.PROBE_EVERY if losing else turns >= 64 - 64 // alloc.PLAIN_EVERY - 1


def test_a_drafted_step_is_measured_against_a_plain_step_of_its_own_rows():
    """A bucket of 17-32 rows whose plain steps ran full (32 rows) and a drafted step of 18 rows: it
    is compared with a plain step of 18 rows (the bucket's fitted forward plus a plain step's time
    beyond it), not with the plain steps' mean rows over their mean seconds, by which it would lose."""
    alloc = BatchAllocator(linear_profile(0.05, 0.001).times)

    def forward(tokens: float) -> float:
        return 0.032 + 0.0015 * tokens

    for rows in [32] * 10 + [18] * 2:
        alloc.observe_plain(rows, forward(rows) + 0.002, forward(rows))
    assert alloc.fitted(32)
    assert alloc.plain_rate(18, 0) == pytest.approx(18 / (forward(18) + 0.002), rel=0.02)
    mean_rate = alloc._plain_rows[32] / alloc._plain[32]
    seconds = forward(18 + 20) + 0.004
    tokens = 1.2 * alloc.plain_rate(18, 0) * seconds  # 20 draft nodes: 1.2x a plain step of 18 rows
    assert tokens / seconds < mean_rate  # against the plain steps' mean it would lose
    alloc.observe(18, 20, forward(18 + 20), seconds, tokens)
    assert alloc.report()["buckets"][32]["gain_over_plain"] == pytest.approx(1.2, rel=0.05)
    assert not alloc._losing(32)
