"""Model drafters (serving.model_drafter) and multi-step speculative sampling (serving.acceptance).

Greedy: a model source, alone or beside retrieval, leaves outputs token-identical to
plain decoding, and a model drafting for itself is accepted at every node of its main
chain. Sampling: MSS over randomly drawn candidates is exact: chi-square against the
brute-force distribution on a small vocabulary (mixed parents and dropped draws
included), and against the model's own probabilities through the engine, on a tiny
model and on SmolLM2 at temperature 0.7 and 1.0. Bad drafters: another tokenizer is
refused at start, and one that fails while running costs only its drafts.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from sampling_checks import sequence_pvalue
from scipy import stats
from tiny_models import perturbed_model, tiny_model

from sssd.serving.drafting.model_drafter import ModelDrafter, parse_expansion
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.serving.verify.acceptance import Sampler, accept_sampled, mss_trials
from sssd.serving.verify.tree_batch import pack
from sssd.sources import Candidates, DraftDistributions, DraftSource
from sssd.tree import DraftBatch

SMOL = "smollm2-135m-instruct"
PROMPTS = [[5, 9, 23, 7, 3, 40, 41, 42, 3], [10, 11, 12, 13, 10, 11, 12], [4] * 20, [60], [7, 8, 9, 7, 8, 9, 7, 8]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("target") / "llama", "llama")


@pytest.fixture(scope="module")
def near_llama(llama, tmp_path_factory):
    """The target with its weights perturbed: a drafter close to it but not equal (q != p)."""
    return perturbed_model(llama, tmp_path_factory.mktemp("drafter") / "llama")


@pytest.fixture(scope="module")
def plain_outputs(llama):
    eng = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256))
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))]


def engine(model, draft, **cfg):
    cfg.setdefault("max_model_len", 256)
    return LLMEngine(model, datastore=None, draft=draft, config=EngineConfig(**cfg))


# -- multi-step speculative sampling against a brute-force reference --------------------------------------

V = 6  # a vocabulary small enough to enumerate every two-token continuation


def test_mss_draws_exactly_from_the_target_on_a_small_vocabulary():
    """Rows of random trees over V tokens: a model source's draws (3 at the root, 2 under each
    drawn child, from q != p), a deterministic child at the root (a mixed parent, sometimes
    holding a drawn token too), and the merge dropping some drawn nodes (their draws still
    take part, as bonus tokens). The first token must follow p(root) and the second
    p(. | first) wherever the walk went on: chi-square against the exact probabilities."""
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    p_logits = {(): rng.normal(0, 1.2, V)}
    q_rows = {(): _softmax(rng.normal(0, 1.2, V))}
    for t in range(V):
        p_logits[(t,)] = rng.normal(0, 1.2, V)
        q_rows[(t,)] = _softmax(rng.normal(0, 1.2, V))
    n = 12000
    offsets, toks, pars, proposals = [0], [], [], []
    for _ in range(n):
        m_tok, m_par, d_par, d_q, d_draws = [], [], [], [], []
        root_draws = rng.choice(V, 3, p=q_rows[()])
        d_par.append(-1), d_q.append(q_rows[()]), d_draws.append(root_draws)
        for x in dict.fromkeys(root_draws.tolist()):
            m_tok.append(x), m_par.append(-1)
            i = len(m_tok) - 1
            below = rng.choice(V, 2, p=q_rows[(x,)])
            d_par.append(i), d_q.append(q_rows[(x,)]), d_draws.append(below)
            for y in dict.fromkeys(below.tolist()):
                m_tok.append(y), m_par.append(i)
        # the merged tree: a deterministic root child, then the drawn nodes the merge kept
        merged_tok, merged_par, where = [int(rng.integers(V))], [-1], {}
        for i, (t, p) in enumerate(zip(m_tok, m_par)):
            if rng.random() < 0.25 or (p >= 0 and p not in where):
                continue  # dropped (and everything below it)
            up = -1 if p < 0 else where[p]
            same = [k for k, (t2, p2) in enumerate(zip(merged_tok, merged_par)) if t2 == t and p2 == up]
            if same:
                where[i] = same[0]
            else:
                where[i] = len(merged_tok)
                merged_tok.append(t), merged_par.append(up)
        toks += merged_tok
        pars += merged_par
        offsets.append(len(toks))
        draws = np.full((len(d_draws), 3), -1)
        for j, d in enumerate(d_draws):
            draws[j, : len(d)] = d
        dists = DraftDistributions(np.array(d_par), np.stack(d_q).astype(np.float32), draws)
        proposals.append([(2, Candidates(np.array(m_tok), np.array(m_par), dists=dists).check(V))])
    N = len(toks)
    tokens = np.array(toks, np.int64)
    parents = np.array(pars, np.int32)
    depths = np.where(parents < 0, 1, 2).astype(np.int32)
    drafts = DraftBatch(
        np.array(offsets, np.int64),
        tokens,
        parents,
        depths,
        np.ones(N, np.float32),
        np.zeros(N, np.uint8),
        np.full(N, np.nan, np.float32),
    )
    batch = pack(np.zeros(n, np.int64), np.zeros(n, np.int64), drafts)
    rows = np.arange(n)
    trials = mss_trials(drafts, proposals, rows)
    table = torch.tensor(np.stack([p_logits[()]] + [p_logits[(t,)] for t in range(V)]), dtype=torch.float32)

    def logits_at(r, idx):  # the target's logits at a packed node: by its path's first token
        first = np.where(
            idx == 0,
            -1,
            np.where(batch.parents[r, idx] > 0, batch.tokens[r, batch.parents[r, idx]], batch.tokens[r, idx]),
        )
        return table[torch.from_numpy(first + 1)]

    samplers = [Sampler(1.0, 0, 1.0, None) for _ in rows]
    acc, errors = accept_sampled(batch, rows, samplers, logits_at, gen, trials)
    assert not any(errors)
    path = acc.path_mask(batch)
    first = np.where(acc.count >= 1, batch.tokens[rows, np.argmax(path, axis=1)], acc.bonus)
    second_known = acc.count >= 1
    second = np.where(acc.count >= 2, batch.tokens[rows, acc.node], acc.bonus)
    assert (acc.count >= 1).mean() > 0.4, "most rows should accept a drafted token"

    p_root = _softmax(p_logits[()])
    obs1 = np.bincount(first, minlength=V)
    assert stats.chisquare(obs1, p_root * n).pvalue > 1e-3
    assert stats.chisquare(obs1, q_rows[()] * n).pvalue < 1e-3  # power: q is not p
    obs2 = np.zeros((V, V))
    np.add.at(obs2, (first[second_known], second[second_known]), 1)
    exp2 = obs2.sum(axis=1, keepdims=True) * np.stack([_softmax(p_logits[(t,)]) for t in range(V)])
    keep = exp2 > 5
    assert stats.chisquare(obs2[keep], exp2[keep] * obs2[keep].sum() / exp2[keep].sum()).pvalue > 1e-3


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_mss_trials_find_draws_by_path_in_the_merged_tree():
    """A drawn token the merge kept maps to its node, one it dropped to -1; an expanded node the
    merge dropped has no trials (the walk never gets there)."""
    q = np.full((3, 4), 0.25, np.float32)
    dists = DraftDistributions(np.array([-1, 0, 1]), q, np.array([[2, 2, 3], [1, -1, -1], [0, -1, -1]]))
    cands = Candidates(np.array([2, 1, 0, 3]), np.array([-1, 0, 1, -1]), dists=dists).check(4)
    # merged: root -> 3 (retrieval), root -> 2 (drawn); the merge dropped token 1 under 2
    drafts = DraftBatch(
        np.array([0, 2]),
        np.array([3, 2]),
        np.array([-1, -1], np.int32),
        np.array([1, 1], np.int32),
        np.ones(2, np.float32),
        np.zeros(2, np.uint8),
        np.full(2, np.nan, np.float32),
    )
    [t] = mss_trials(drafts, [[(2, cands)]], np.array([0]))
    assert set(t) == {0, 2}  # the root and token 2's node; token 1's draws are never reached
    ((_, draws, kids),) = t[0]
    assert draws.tolist() == [2, 2, 3] and kids.tolist() == [2, 2, 1]
    ((_, draws, kids),) = t[2]
    assert draws.tolist() == [1] and kids.tolist() == [-1]


# -- the engine with a model source -----------------------------------------------------------------


def test_parse_expansion():
    assert parse_expansion("1,1,3,1") == (1, 1, 3, 1) and parse_expansion([2, 1]) == (2, 1)
    for bad in ("", "0,1", "a", "1,-1"):
        with pytest.raises(ValueError, match="expansion"):
            parse_expansion(bad)


@pytest.mark.parametrize("retrieval", [False, True])
def test_greedy_is_token_identical_with_a_model_source(llama, near_llama, plain_outputs, retrieval):
    if retrieval:  # drafting always (a drafter as large as its target otherwise defers to retrieval)
        draft = ["retrieval", ModelDrafter(near_llama, target=llama, slots=3, capacity=256, complement=False)]
    else:
        draft = [f"model:{near_llama}"]  # the spec string, resolved by the engine
    eng = engine(llama, draft, budget=6, max_running=3)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert eng.metrics.accepted_by_source.get(f"model:{near_llama.name}", 0) > 0


def test_steps_a_deferring_model_drafts_in_measure_retrieval_alone_on_the_same_steps(llama, near_llama, plain_outputs):
    from sssd.serving.planning.deferral import ARMS
    from sssd.serving.planning.measured_choice import MeasuredChoice

    eng = engine(
        llama, ["retrieval", ModelDrafter(near_llama, target=llama, slots=3, capacity=256)], budget=6, max_running=3
    )
    gate = eng.drafting.deferral
    gate.policy = MeasuredChoice(ARMS, fixed="always")
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert gate.counterfactual_steps > 0 and gate.asked > 0
    rates = gate.policy.rates()
    assert all(set(r) == {"always", "never"} for r in rates.values())  # never measured without running


class Deferring(DraftSource):
    """A costly source expecting 2 accepted tokens at a given cost (in target passes)."""

    name, defers_to_retrieval = "deferring", True

    def __init__(self, cost):
        self.relative_cost, self.asked = cost, []

    def expected_accepted(self, budget):
        return 2.0

    def propose(self, requests):
        self.asked += [r.request_id for r in requests]
        return [Candidates(np.array([50]), np.array([-1])) for _ in requests]


def test_a_costly_source_drafts_only_where_retrieval_promises_too_little():
    """Request 1 continues a datastore phrase (retrieval promises about 3 tokens), request 2
    nothing: a cheap source drafts for both (one pass costs about the same), a dear one for
    neither; request 1 alone is not worth even a cheap one."""
    import sssd
    from sssd.serving.planning.deferral import Deferral
    from sssd.sources import DraftPipeline, DraftRequest, RetrievalSource

    ds = sssd.Datastore.from_tokens(np.array([5, 6, 7, 8, 9, 10, 11, 12, sssd.SEPARATOR] * 20, dtype=np.uint32))
    for cost, asked in ((0.3, [1, 2]), (5.0, []), (0.0, [1, 2])):
        src = Deferring(cost)
        pipe = DraftPipeline(
            [RetrievalSource(ds, sssd.DrafterConfig()), src], sssd.DrafterConfig(), vocab_size=93, deferral=Deferral()
        )
        pipe.open(1, np.array([4, 5, 6, 7]))
        pipe.open(2, np.array([80, 81]))
        batch, proposals = pipe.draft_with_proposals(
            [DraftRequest(1, np.array([4, 5, 6, 7]), 8), DraftRequest(2, np.array([80, 81]), 8)]
        )
        assert src.asked == asked, cost
        assert (batch.sizes[0] > 0) and ((batch.sizes[1] > 0) == (2 in asked))
        src.asked = []
        pipe.draft_with_proposals([DraftRequest(1, np.array([4, 5, 6, 7]), 8)])
        assert src.asked == [], cost  # retrieval alone promises more than the source could add


class Measured(Deferring):
    """A Deferring source whose drafting time was measured."""

    def __init__(self, cost, seconds):
        super().__init__(cost)
        self.seconds = seconds

    def measured_seconds(self, batch):
        return self.seconds


def _two_request_pipe(src):
    import sssd
    from sssd.serving.planning.deferral import Deferral
    from sssd.sources import DraftPipeline, DraftRequest, RetrievalSource

    ds = sssd.Datastore.from_tokens(np.array([5, 6, 7, 8, 9, 10, 11, 12, sssd.SEPARATOR] * 20, dtype=np.uint32))
    pipe = DraftPipeline(
        [RetrievalSource(ds, sssd.DrafterConfig()), src], sssd.DrafterConfig(), vocab_size=93, deferral=Deferral()
    )
    pipe.open(1, np.array([4, 5, 6, 7]))
    pipe.open(2, np.array([80, 81]))
    return pipe, [DraftRequest(1, np.array([4, 5, 6, 7]), 8), DraftRequest(2, np.array([80, 81]), 8)]


def test_the_deferral_uses_the_measured_cost_over_the_target_s_measured_forward_time():
    from sssd.serving.planning.deferral import Deferral

    # the prior says 5 target passes (never pays); measured: 0.01 s against a 0.1 s forward pass
    src = Measured(cost=5.0, seconds=0.01)
    pipe, reqs = _two_request_pipe(src)
    pipe.draft_with_proposals(reqs)
    assert src.asked == []  # no forward time measured yet: the prior decides
    pipe.deferral.observe_step(2, 0.1, {1: 0, 2: 0})
    assert pipe.deferral.cost(src, 2) == pytest.approx(0.1)
    pipe.draft_with_proposals(reqs)
    assert src.asked == [1, 2]
    # measured dear (10 forward passes): deferred again, though the prior (0.0) says free
    dear = Measured(cost=0.0, seconds=1.0)
    pipe, reqs = _two_request_pipe(dear)
    pipe.deferral.observe_step(2, 0.1, {})
    pipe.draft_with_proposals(reqs)
    assert dear.asked == [] and Deferral().cost(dear, 2) == 0.0


def test_retrieval_promises_are_corrected_by_what_they_got():
    """Request 1 continues a datastore phrase and retrieval promises several tokens for it; when its
    retrieval-only trees get nothing accepted, step after step, the promise shrinks until the source
    expecting 2 tokens pays for its cost (one forward pass)."""
    src = Measured(cost=0.0, seconds=0.1)
    pipe, reqs = _two_request_pipe(src)
    pipe.deferral.observe_step(1, 0.1, {})
    ratios = [pipe.deferral.promise_ratio]
    for _ in range(200):
        pipe.draft_with_proposals([reqs[0]])
        if src.asked:
            break
        assert pipe.deferral._pending  # retrieval's tree alone: its promise recorded
        pipe.deferral.observe_step(1, 0.1, {1: 0})
        ratios.append(pipe.deferral.promise_ratio)
    assert src.asked == [1] and len(ratios) > 2 and all(b < a for a, b in zip(ratios, ratios[1:]))
    pipe.deferral.observe_step(1, 0.1, {1: 0})  # the step the source drafted in teaches nothing
    assert pipe.deferral.promise_ratio == ratios[-1]
    pipe.deferral.observe_step(1, 0.1, {1: 3})  # nor does a step with nothing drafted
    assert pipe.deferral.promise_ratio == ratios[-1]


def test_a_source_that_never_pays_drafts_every_explore_every_steps():
    from sssd.serving.planning.deferral import EXPLORE_EVERY

    src = Measured(cost=0.0, seconds=100.0)
    pipe, reqs = _two_request_pipe(src)
    pipe.deferral.observe_step(2, 0.1, {})
    asked_at = []
    for step in range(2 * EXPLORE_EVERY):
        pipe.draft_with_proposals(reqs)
        if src.asked:
            asked_at.append(step)
            src.asked = []
    assert asked_at == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    assert pipe.deferral.asked == 2 and pipe.deferral.deferred == 2 * EXPLORE_EVERY - 2


def test_the_engine_s_measured_arm_overrides_the_rule_for_its_step():
    from sssd.serving.planning.measured_choice import MeasuredChoice

    src = Measured(cost=5.0, seconds=None)  # the rule: never
    pipe, reqs = _two_request_pipe(src)
    gate = pipe.deferral
    for arm, asked in (("rule", []), ("always", [1, 2]), ("never", [])):
        gate.policy = MeasuredChoice(("rule", "always", "never"), fixed=arm)
        assert gate.begin_step(2) == arm
        src.asked = []
        pipe.draft_with_proposals(reqs)
        assert src.asked == asked, arm
        gate.observe_step(2, 0.1, {1: 0, 2: 0}, seconds=0.2, tokens=2)
        assert gate.arm is None  # a step's arm ends with it: the pipeline alone follows the rule
    gate.policy = MeasuredChoice(("rule", "always", "never"), block=1)
    for arm, seconds in (("rule", 1.0), ("always", 0.5), ("never", 2.0)):
        assert gate.begin_step(2) == arm
        gate.observe_step(2, 0.1, {}, seconds=seconds, tokens=4)
    assert gate.begin_step(2) == "always"  # the fastest of the three, measured


def _longest_path_along(tokens, parents, verified):
    """Brute force: every node's root path, the longest that is a prefix of `verified`."""
    best = 0
    for node in range(len(tokens)):
        path, n = [], node
        while n >= 0:
            path.append(int(tokens[n]))
            n = int(parents[n])
        path.reverse()
        if path == list(verified[: len(path)]):
            best = max(best, len(path))
    return best


def test_accepted_along_is_the_longest_root_path_along_the_verified_tokens():
    from sssd.serving.planning.deferral import accepted_along

    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(0, 14))
        parents = np.array([int(rng.integers(-1, i)) for i in range(n)], dtype=np.int32)
        tokens = rng.integers(0, 3, n).astype(np.int64)
        verified = rng.integers(0, 3, int(rng.integers(1, 7))).tolist()
        assert accepted_along(tokens, parents, verified) == _longest_path_along(tokens, parents, verified)


class Slow(Deferring):
    """A deferring source that takes 50 ms to draft."""

    def propose(self, requests):
        time.sleep(0.05)
        return super().propose(requests)


def test_a_step_the_source_drafted_in_measures_never_on_the_same_step():
    """Retrieval's own trees are built anyway: against the verified tokens of a greedy step they
    say exactly what "never" would have got, in the step's time without the source's."""
    from sssd.serving.planning.deferral import ARMS
    from sssd.serving.planning.measured_choice import MeasuredChoice

    src = Slow(cost=0.0)
    pipe, reqs = _two_request_pipe(src)
    gate = pipe.deferral
    gate.policy = MeasuredChoice(ARMS, fixed="always")
    assert gate.begin_step(2) == "always"
    pipe.draft_with_proposals(reqs)
    assert src.asked == [1, 2]
    alone = dict(gate._alone)
    assert set(alone) == {1, 2} and len(alone[1][0]) > 0  # request 1 continues a datastore phrase
    path = [8, 9, 10, 77]  # the target's tokens: retrieval's phrase, then off it
    verified = {1: (path, None), 2: ([3, 4], None)}
    want = sum(1 + _longest_path_along(*alone[rid], toks) for rid, (toks, _) in verified.items())
    assert want >= 4  # retrieval would have had 8, 9, 10 accepted
    gate.observe_step(2, 0.1, {1: 0, 2: 0}, seconds=1.0, tokens=2, verified=verified)
    seconds, tokens = gate.policy._stats[2]["never"]
    assert tokens == want and 0.9 < seconds < 0.96  # the source's 50 ms taken out
    assert gate.policy._stats[2]["always"] == [1.0, 2.0] and gate.counterfactual_steps == 1
    # a request that finished emits no more than it did; a sampled request (not verified) or a step
    # where retrieval drafted alone measures nothing
    gate.begin_step(2)
    pipe.draft_with_proposals(reqs)
    gate.observe_step(2, 0.1, {1: 0, 2: 0}, seconds=1.0, tokens=2, verified={1: (path, 2), 2: ([3], None)})
    assert gate.policy._stats[2]["never"][1] == pytest.approx(0.9 * want + 2 + 1)
    for arm, verified in (("always", {1: (path, None)}), ("never", {1: (path, None), 2: ([3], None)})):
        gate.policy = MeasuredChoice(ARMS, fixed=arm)
        gate.begin_step(2)
        pipe.draft_with_proposals(reqs)
        gate.observe_step(2, 0.1, {1: 0, 2: 0}, seconds=1.0, tokens=2, verified=verified)
        assert "never" not in gate.policy._stats[2] or arm == "never"
    assert gate.counterfactual_steps == 2


def test_trees_grown_ahead_ask_a_deferring_source_only_within_its_lag():
    """A catch-up pass longer than the grown tree's budget would outlast the verifier: trees grown
    ahead (verified_next=False) leave that source out; the serial rule's steps still ask it."""
    src = Measured(cost=0.0, seconds=0.0)  # always pays
    pipe, reqs = _two_request_pipe(src)
    for lag, grown_asked in ((0, [1, 2]), (8, [1, 2]), (9, [])):
        src.lag = lambda rid, lag=lag: lag if rid == 2 else 0
        src.asked = []
        pipe.draft_with_proposals(reqs, verified_next=False)
        assert src.asked == grown_asked, lag
        src.asked = []
        pipe.draft_with_proposals(reqs)
        assert src.asked == [1, 2], lag


def test_a_model_drafting_for_itself_is_accepted_at_every_node_of_its_main_chain(llama, plain_outputs):
    eng = engine(
        llama, [ModelDrafter(llama, target=llama, slots=4, capacity=256, expansion=(2, 1, 1))], budget=8, max_running=4
    )
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    for o in outs:
        assert all(a == 3 for a in o.stats["accepted_per_step"][:-1]), o.stats["accepted_per_step"]
    src = eng.drafting.external[0]
    rates = src.acceptance_rates()
    assert (rates[:3, 0] == 1).all() and (rates[:1, 1] == 0).all()  # the argmax child, never the runner-up
    assert src.draft_seconds(4) > 0  # measured, for the planner
    assert src.measured_seconds(4) == src.draft_seconds(4)


def test_smollm2_drafting_for_itself_is_accepted_at_every_node_of_its_main_chain():
    """The issue's invariant, on the real model through the public API."""
    import sssd

    prompts = [[{"role": "user", "content": "Name three colours."}], "The capital of France is"]
    plain = sssd.LLM(SMOL, datastore=None, draft=[], max_running=2, max_model_len=256)
    ref = plain.generate(prompts, sssd.SamplingParams(max_tokens=17))
    llm = sssd.LLM(SMOL, datastore=None, draft=[f"model:{SMOL}"], budget=8, max_running=2, max_model_len=256)
    outs = llm.generate(prompts, sssd.SamplingParams(max_tokens=17))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    depth = len(llm.engine.drafting.external[0].expansion)
    for o in outs:
        steps = o.stats["accepted_per_step"]
        assert all(a == depth for a in steps[:-1]) and len(steps) < len(o.token_ids) / 2, steps


def test_seeded_sampling_with_a_model_source_is_reproducible(llama, near_llama):
    params = [
        SamplingParams(max_tokens=20, temperature=t, top_p=p, top_k=k, seed=s, ignore_eos=True)
        for s, (t, p, k) in enumerate([(0.7, 1.0, 0), (1.0, 0.9, 0), (1.3, 1.0, 20)])
    ]
    runs = [
        engine(
            llama,
            ["retrieval", ModelDrafter(near_llama, target=llama, slots=3, capacity=256, complement=False)],
            budget=6,
            max_running=3,
        ).generate(PROMPTS[:3], params)
        for _ in range(2)
    ]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert sum(o.stats["accepted"] for o in runs[0]) > 0


def two_token_probs(model, prompt, temperature, top1=6, top2=4):
    """p(t1) p(t2 | t1) for the likeliest pairs, from Hugging Face's own forward pass."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(ref(torch.tensor(prompt)[None]).logits[0, -1] / temperature, -1)
        out = {}
        for t1 in torch.topk(p1, top1).indices.tolist():
            p2 = torch.softmax(ref(torch.tensor(prompt + [t1])[None]).logits[0, -1] / temperature, -1)
            for t2 in torch.topk(p2, top2).indices.tolist():
                out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


def test_sampled_sequences_with_a_model_source_follow_the_models_distribution(llama, near_llama):
    """A drafter close to the target but not equal, beside retrieval: 2-token continuations
    against the target's exact p(t1) p(t2 | t1)."""
    temperature, prompt = 1.5, PROMPTS[1]
    joint = two_token_probs(llama, prompt, temperature)
    eng = engine(
        llama,
        [
            "retrieval",
            ModelDrafter(near_llama, target=llama, slots=64, capacity=256, expansion=(3, 2), complement=False),
        ],
        budget=8,
        max_running=64,
    )
    n = 3000
    outs = eng.generate(
        [prompt] * n, [SamplingParams(max_tokens=2, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    )
    assert sum(o.stats["accepted"] for o in outs) > n // 3, "many tokens should come from the tree"
    assert sequence_pvalue(outs, joint) > 1e-3
    assert sequence_pvalue(outs, two_token_probs(llama, prompt, temperature * 1.25)) < 1e-3  # the test has power


@pytest.mark.parametrize("temperature, draft_temperature", [(0.7, 1.0), (1.0, 0.7)])
def test_smollm2_sampling_with_mss_follows_its_distribution(temperature, draft_temperature):
    """SmolLM2 drafting for itself at another temperature (q != p): 2-token continuations
    against its exact probabilities (MSS at the root, then the target's own draw)."""
    from sssd.models import resolve_model

    path = resolve_model(SMOL, pull_missing=False)
    src = ModelDrafter(path, slots=64, capacity=32, expansion=(2,), temperature=draft_temperature)
    eng = engine(path, [src], budget=2, max_running=64, max_model_len=32)
    prompt = eng.encode("The weather")
    joint = two_token_probs(path, prompt, temperature, top1=5, top2=3)
    n = 384
    outs = eng.generate(
        [prompt] * n, [SamplingParams(max_tokens=2, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    )
    assert sum(o.stats["accepted"] for o in outs) > n // 3
    assert sequence_pvalue(outs, joint) > 1e-3


# -- bad drafters -------------------------------------------------------------------------------------


def test_a_drafter_with_another_tokenizer_is_refused_naming_both(llama):
    with pytest.raises(ValueError, match=rf"draft model .*{SMOL}.* does not speak the target .*{llama.name}"):
        engine(llama, [f"model:{SMOL}"])


def test_a_drafter_failing_at_run_time_costs_only_its_drafts(llama, near_llama, plain_outputs, caplog):
    src = ModelDrafter(near_llama, target=llama, slots=3, capacity=256, complement=False)
    real = src.backend.hidden_states
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] % 7 == 0:  # some steps fail, in the middle of a tree or catching up
            raise RuntimeError("the draft model fell over")
        return real(*args)

    src.backend.hidden_states = flaky
    eng = engine(llama, ["retrieval", src], budget=6, max_running=3)
    with caplog.at_level(logging.WARNING, logger="sssd.drafting"):
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert all(o.finish_reason == "length" for o in outs)
    assert "fell over" in caplog.text
    assert eng.metrics.accepted_by_source.get(src.name, 0) > 0  # it drafted again after failing


def test_a_step_kept_plain_drafts_its_counterfactual_without_the_draft_model(llama, near_llama, plain_outputs):
    """Under a gate that keeps every step plain, the counterfactual trees come from retrieval alone:
    a deferring draft model's pass is no price for a tree nobody verifies. Output: plain's."""
    eng = engine(llama, ["retrieval", f"model:{near_llama}"], max_running=3)
    assert eng.allocator is not None and eng.drafting.defers
    eng.allocator._losing = lambda key: True
    eng.allocator.PROBE_EVERY = eng.allocator.PROBE_MAX = eng.allocator.COUNTERFACTUAL_STEPS = 10**9
    model = next(s for s in eng.drafting.external if s.defers_to_retrieval)
    calls = []
    propose = model.propose
    model.propose = lambda asked: (calls.append(len(asked)), propose(asked))[1]
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert eng.allocator.counterfactual_steps > 0 and not calls
