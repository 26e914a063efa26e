"""Self-speculation over a sparse KV (serving.self_drafter, MagicDec) and its cost model (planner).

The invariant: with a KV budget of at least the context the draft view is the whole cache,
the drafter is the target itself and greedy acceptance is total. With a smaller budget the
view is real gathered tensors (the verifier's K/V at the kept positions, checked entry by
entry; SnapKV's selection against Hugging Face's own eager attention probabilities), greedy
output stays token-identical to plain decoding, and sampled output follows the target's
distribution (chi-square). Bad input: malformed specs are refused, a budget beyond the
context is the full cache, prompts beyond the context are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_checks import sequence_pvalue
from test_model_drafter import two_token_probs
from tiny_models import tiny_model

from sssd.serving.drafting.self_drafter import MAX_GAMMA, SelfDrafter, parse_self_spec
from sssd.serving.engine import ContextLengthExceeded, EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.serving.planning.planner import SelfSpecCostModel
from sssd.sources import parse_specs

# long enough prompts that a small budget keeps only part of them
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, 93, n).tolist() for n in (60, 45, 80)] + [[5, 9, 23, 7, 3, 40, 41, 42, 3] * 6]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("self") / "llama", "llama")


@pytest.fixture(scope="module")
def plain_outputs(llama):
    eng = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256))
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))]


def engine(model, spec: str, gamma: int | None = 4, budget: int = 4, max_running: int = 4, **kw) -> LLMEngine:
    eng = LLMEngine(
        model,
        datastore=None,
        draft=[spec],
        config=EngineConfig(
            max_model_len=kw.pop("max_model_len", 256),
            budget=budget,
            max_running=max_running,
            prefill_chunk=kw.pop("prefill_chunk", 64),
        ),
    )
    src = eng.drafting.external[0]
    assert isinstance(src, SelfDrafter)
    src.gamma = gamma
    return eng


@pytest.mark.parametrize("method", ["streamingllm", "snapkv"])
def test_a_budget_of_the_whole_context_is_the_target_itself_accepted_every_time(llama, plain_outputs, method):
    """KV budget >= context: every draft token is the target's (greedy acceptance is total)."""
    eng = engine(llama, f"self:{method}:512")
    src = eng.drafting.external[0]
    assert src.kv_budget == 256  # beyond the verifier's slots: the full cache, not an error
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    for o in outs:
        assert o.stats["drafted"] > 0 and o.stats["accepted"] == o.stats["drafted"], o.stats
        assert o.stats["steps"] <= -(-40 // 5) + 1  # 1 + gamma tokens per step
    assert (src.acceptance_rates()[:4] == 1).all()


@pytest.mark.parametrize("method", ["streamingllm", "snapkv"])
def test_a_small_budget_stays_lossless_and_drafts_from_gathered_tensors(llama, plain_outputs, method):
    eng = engine(llama, f"self:{method}:16", max_running=2)
    src = eng.drafting.external[0]
    assert src.pool.kv.shape[4] == 16 + MAX_GAMMA + 1  # a compact pool, not a mask over the full one
    checked = []

    def check_views():
        # every kept entry holds the verifier's K/V at its position (head 0 for SnapKV's per-head picks)
        for r in eng.decoding():
            view = src._view.get(r.id)
            if view is None or r.id not in src._slot:
                continue
            s = src._slot[r.id]
            ring = np.flatnonzero(view.valid & (np.arange(16) >= view.fixed))
            mine = src.pool.kv[:, :, s][:, :, :, ring]
            theirs = eng.backend.pool.kv[:, :, r.slot][:, :, :, view.positions[ring]]
            assert torch.equal(mine, theirs)
            if view.picked is not None:  # SnapKV's picks, per layer and KV head
                for layer in range(mine.shape[0]):
                    for h in range(mine.shape[2]):
                        pos = view.picked[layer, h]
                        assert torch.equal(
                            src.pool.kv[layer, :, s, h, : view.fixed], eng.backend.pool.kv[layer, :, r.slot, h, pos]
                        )
            else:
                assert torch.equal(
                    src.pool.kv[:, :, s, :, : view.fixed], eng.backend.pool.kv[:, :, r.slot, :, : view.fixed]
                )
            assert view.valid.sum() <= 16
            checked.append(r.id)

    ids = [eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        check_views()
    outs = [done[i] for i in ids]
    assert [o.token_ids for o in outs] == plain_outputs
    assert checked and sum(o.stats["accepted"] for o in outs) > 0
    # the view is smaller than the context: not every token is the target's
    assert sum(o.stats["accepted"] for o in outs) < sum(o.stats["drafted"] for o in outs)


def test_snapkv_selects_what_the_observation_window_attends_to(llama):
    """The kept positions per layer and KV head: top-k of the window's attention probabilities
    (from Hugging Face's eager attention) summed over its queries and the head's query group,
    average-pooled over 7 neighbours."""
    from transformers import AutoModelForCausalLM

    eng = engine(llama, "self:snapkv:24", max_running=1)
    src = eng.drafting.external[0]
    prompt = PROMPTS[2]
    eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while not eng.decoding():
        eng.step()
    req = eng.decoding()[0]
    cached = req.cached
    ring = min(23, max(src.obs_window, 24 // 4))
    keep, horizon = 24 - ring, cached - ring
    got = src._snap_select(np.asarray(prompt), req.slot, cached, horizon, keep).cpu().numpy()

    ref = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        att = ref(torch.tensor(prompt[:cached])[None], output_attentions=True).attentions
    w = min(src.obs_window, cached)
    heads = ref.config.num_key_value_heads
    for layer, a in enumerate(att):
        votes = a[0, :, cached - w :, :horizon].sum(dim=1)  # [Hq, horizon]
        votes = votes.view(heads, -1, horizon).sum(dim=1)
        pooled = torch.nn.functional.avg_pool1d(votes[:, None], 7, 1, 3, count_include_pad=False)[:, 0]
        for h in range(heads):
            expect = set(torch.topk(pooled[h], keep).indices.tolist())
            assert set(got[layer, h].tolist()) == expect, (layer, h)


def test_sampled_output_follows_the_targets_distribution(llama):
    """A sparse view (q != p): 2-token continuations against the target's exact p(t1) p(t2 | t1)."""
    temperature, prompt = 1.5, PROMPTS[3][:30]
    joint = two_token_probs(llama, prompt, temperature)
    eng = engine(llama, "self:streamingllm:6", gamma=2, budget=2, max_running=128)
    n = 1600
    outs = eng.generate(
        [prompt] * n, [SamplingParams(max_tokens=2, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    )
    assert sum(o.stats["accepted"] for o in outs) > n // 4, "many tokens should come from the chain"
    assert sequence_pvalue(outs, joint) > 1e-3
    assert sequence_pvalue(outs, two_token_probs(llama, prompt, temperature * 1.25)) < 1e-3  # the test has power


def test_the_cost_model_drafts_only_past_the_critical_context_and_gains_with_batch(llama):
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(llama)
    shape = {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64, "params": 135e6, "dtype_bytes": 4}  # SmolLM2
    cost = SelfSpecCostModel.prior(shape, kv_budget=512)
    rates = np.full(16, 0.8)
    assert cost.best_gamma(1, 256, rates, 8) == 0  # the draft reads the whole context: no gain
    crit = cost.critical_context(16, rates, 8)
    assert crit is not None and crit > 512
    assert cost.best_gamma(16, 8192, rates, 8) > 0
    # MagicDec's signature: at a long context the gain grows with the batch
    gains = [cost.speedup(b, 8192, rates, 4) for b in (1, 4, 16)]
    assert gains[0] < gains[1] < gains[2], gains
    assert cost.ratio(16, 8192) < cost.ratio(1, 8192) < 1
    # fitting recovers coefficients from exact passes
    truth = SelfSpecCostModel([3e-3, 2e-4, 1e-7, 2e-9], 512)
    pts = [(b, t, s, truth.time(b, t, s)) for b in (1, 4, 16) for t in (1, 5) for s in (256, 1024, 8192)]
    fitted = SelfSpecCostModel.fit(pts, 512)
    assert np.allclose(fitted.coef, truth.coef, rtol=1e-3)
    assert c.max_position_embeddings == 512
    # the KV budget: the measured acceptance per budget against what a larger view costs
    rates_by_budget = {64: [0.3] * 8, 512: [0.8] * 8, 4096: [0.85] * 8}
    kb, g, s = cost.best_plan(16, 8192, rates_by_budget)
    assert kb == 512 and g >= 1 and s > 1  # 64 is accepted too rarely, 4096 costs too much
    assert cost.best_plan(1, 256, rates_by_budget) == (0, 0, 1.0)
    again = SelfSpecCostModel.from_dict(cost.to_dict() | {"acceptance": {"snapkv": rates_by_budget}})
    assert again.acceptance["snapkv"][512] == [0.8] * 8 and np.allclose(again.coef, cost.coef)


def test_bad_specs_and_prompts_are_refused_clearly(llama):
    assert parse_specs("retrieval,self:snapkv:512") == [("retrieval", ""), ("self", "snapkv:512")]
    assert parse_self_spec("streamingllm") == ("streamingllm", None)
    for bad in ("self:snapkv:x", "self:mystery", "self:snapkv:"):
        if bad.endswith(":"):
            assert parse_self_spec("snapkv:") == ("snapkv", None)
            continue
        with pytest.raises(ValueError, match="malformed"):
            parse_specs(bad)
    with pytest.raises(ValueError, match="positive number of KV positions"):
        LLMEngine(llama, datastore=None, draft=["self:snapkv:0"], config=EngineConfig(max_model_len=64))
    eng = engine(llama, "self:snapkv:8", max_model_len=64)
    with pytest.raises(ContextLengthExceeded, match="serves at most"):
        eng.add_request(list(range(3, 83)), SamplingParams(max_tokens=4))


@pytest.mark.parametrize("method", ["streamingllm", "snapkv"])
def test_a_one_position_budget_still_drafts_losslessly(llama, plain_outputs, method):
    eng = engine(llama, f"self:{method}:1", max_running=4)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert all(o.stats["drafted"] > 0 for o in outs)


def test_an_explicit_budget_drafts_below_the_critical_context_too(llama, plain_outputs):
    """budget=N means N: the sparse-KV cost model (which would draft nothing at these short
    contexts) does not override it."""
    eng = engine(llama, "self:streamingllm", gamma=None, budget=4)
    src = eng.drafting.external[0]
    assert src.fixed_budget and src.choose_gamma(1, 64, 4) == 4
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert sum(o.stats["drafted"] for o in outs) > 0
