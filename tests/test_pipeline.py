"""Pipeline stages (serving/backends/pipeline_backend.py) and SpecPipe's schedule (serving/drafting/specpipe.py).

Greedy: token-identical (float32) to plain decoding on one process, for plain
pipelined decoding, non-pipelined speculation over the stages and pipelined
trees (with drafts that are accepted, rejected, and accepted off the first
branch, so that pruning, flushes and KV moves all happen). Sampling:
2-token continuations against the model's exact probabilities (chi-square).
A stage that dies fails the step with an error naming it, and nothing hangs.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sssd.serving.backends.pipeline_backend import PipelineBackend, PipelineError, split_layers
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.sources import Candidates, DraftSource
from tests.sampling_checks import sequence_pvalue
from tests.tiny_models import tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 10, 11, 12, 10, 11], [3, 4, 5], [20, 21]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("pipe") / "llama", "llama", layers=4)


@pytest.fixture(scope="module")
def plain(llama):
    """Plain decoding on one process: what every pipelined run must reproduce."""
    eng = LLMEngine(llama, datastore=None, config=EngineConfig(max_running=4, max_model_len=128), draft=[])
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return {tuple(p): list(o.token_ids) for p, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def two_stages(llama):
    be = PipelineBackend(llama, 2, slots=32, capacity=128, arena=64)
    yield be
    be.close()


@pytest.fixture(scope="module")
def three_stages(llama):
    """Two slots for four prompts: requests finish and others arrive while trees are in flight."""
    be = PipelineBackend(llama, 3, slots=2, capacity=128, arena=48, timeout=20)
    yield be
    be.close()


class Oracle(DraftSource):
    """Knows each prompt's plain-decoding continuation. At every request it proposes a chain
    of the true next tokens with a wrong sibling ranked above the true one at every level
    (so the accepted node is never the first branch), and every `wrong_every`-th draft
    only wrong tokens (a flush)."""

    name = "oracle"

    def __init__(self, truth: dict, depth: int = 4, wrong_every: int = 5, vocab: int = 93):
        self.truth, self.depth, self.wrong_every, self.vocab = truth, depth, wrong_every, vocab
        self.calls = 0

    def propose(self, requests):
        out = []
        for r in requests:
            self.calls += 1
            h = [int(t) for t in r.tokens]
            seq = next((list(p) + o for p, o in self.truth.items() if (list(p) + o)[: len(h)] == h), None)
            if seq is None:
                out.append(None)
                continue
            nxt = list(seq[len(h) : len(h) + self.depth])
            tokens, parents, weights = [], [], []
            parent = -1
            for d, t in enumerate(nxt):
                wrong = (t + 1 + d) % self.vocab
                tokens += [wrong, t if self.calls % self.wrong_every else (t + 7) % self.vocab]
                parents += [parent, parent]
                weights += [0.9, 0.8]
                parent = len(tokens) - 1
            out.append(Candidates(np.array(tokens), np.array(parents), weights=np.array(weights)) if tokens else None)
        return out


def _engine(model, backend, stages, draft, budget=4, **kw):
    cfg = EngineConfig(max_running=backend.slots, max_model_len=128, budget=budget, pipeline_stages=stages, **kw)
    return LLMEngine(model, datastore=None, config=cfg, draft=draft, backend=backend)


def _run(eng, prompts=PROMPTS):
    outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs)}


def test_layers_split_evenly_and_bad_counts_are_refused():
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="cannot split 4 decoder layers into 5"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="pipeline_stages must be an int >= 1"):
        EngineConfig(pipeline_stages=0)
    with pytest.raises(ValueError, match="does not apply with pipeline stages"):
        EngineConfig(pipeline_stages=2, draft_mode="async")


def test_plain_pipelined_decoding_is_token_identical(llama, plain, two_stages):
    eng = _engine(llama, two_stages, 2, [])
    assert _run(eng) == plain
    st = eng.pipeline.stats
    assert st.flushes == st.verified == st.emitted  # one token per trip through the stages
    assert st.steps >= 2 * MAX_TOKENS  # a request's token takes two pipeline steps


def test_non_pipelined_speculation_over_the_stages_is_token_identical(llama, plain, two_stages):
    eng = _engine(llama, two_stages, 1, [Oracle(plain)])  # the engine's own loop, passes stage after stage
    assert _run(eng) == plain
    assert eng.metrics.num_accepted_tokens > MAX_TOKENS


@pytest.mark.parametrize("levels, width", [(1, 2), (1, 6), (3, 8)])
def test_pipelined_trees_are_token_identical(llama, plain, two_stages, levels, width):
    eng = _engine(llama, two_stages, 2, [Oracle(plain)], budget=width)
    eng.pipeline.levels = levels
    assert _run(eng) == plain
    st = eng.pipeline.stats
    assert st.flushes > 0, "some drafts are wrong: the pipeline refills"
    # every token but the flushes' bonus tokens (some cut off by max_tokens) was a tree node
    assert st.emitted - st.flushes <= eng.metrics.accepted_by_source["oracle"] < st.emitted
    assert st.emitted - st.flushes > st.emitted // 2, "most tokens come from accepted tree nodes"
    # more than one token per two steps (plain pipelined decoding's rate) once the tree is right
    assert st.emitted / st.steps > 0.6
    if levels > 1:
        assert eng.metrics.num_accepted_tokens > st.verified - st.flushes  # walks go deeper than one node


def test_pipelined_trees_drafted_by_a_model_are_token_identical(llama, plain, two_stages):
    """A draft model (the target itself, through the engine's DraftPipeline) feeds the tree:
    nearly every token is accepted, and the output is still plain decoding's."""
    from sssd.serving.drafting.model_drafter import ModelDrafter

    src = ModelDrafter(llama, target=llama, slots=two_stages.slots, capacity=128 + 64, expansion=(2, 1, 1))
    eng = _engine(llama, two_stages, 2, [src], budget=4)
    assert _run(eng) == plain
    st = eng.pipeline.stats
    assert st.flushes <= len(PROMPTS) + 2 and st.emitted / st.steps > 0.9  # about one token per step


def test_three_stages_with_requests_arriving_and_leaving(llama, plain, three_stages):
    for levels in (1, 2):
        eng = _engine(llama, three_stages, 3, [Oracle(plain, wrong_every=3)], budget=3)
        eng.pipeline.levels = levels
        assert _run(eng) == plain
        assert eng.pipeline.stats.emitted - eng.pipeline.stats.flushes > MAX_TOKENS


def _two_token_probs(model, prompt, temperature, top1=6, top2=4):
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


class Likely(DraftSource):
    """Proposes the likeliest first tokens and, under each, the likeliest second tokens."""

    name = "likely"

    def __init__(self, joint, prompt_len):
        self.joint, self.n = joint, prompt_len

    def propose(self, requests):
        out = []
        for r in requests:
            if len(r.tokens) != self.n:
                out.append(None)
                continue
            firsts = list(dict.fromkeys(t1 for t1, _ in self.joint))
            tokens, parents = [], []
            for t1 in firsts:
                tokens.append(t1)
                parents.append(-1)
                p = len(tokens) - 1
                for a, t2 in self.joint:
                    if a == t1:
                        tokens.append(t2)
                        parents.append(p)
            out.append(Candidates(np.array(tokens), np.array(parents)))
        return out


def test_sampled_pipelined_trees_follow_the_models_distribution(llama, two_stages):
    temperature, prompt = 1.5, PROMPTS[1]
    joint = _two_token_probs(llama, prompt, temperature)
    eng = _engine(llama, two_stages, 2, [Likely(joint, len(prompt))], budget=32)
    eng.pipeline.levels = 2
    n = 1500
    outs = eng.generate(
        [prompt] * n, [SamplingParams(max_tokens=2, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    )
    assert eng.metrics.num_accepted_tokens > n // 3, "many tokens come from the tree"
    assert sequence_pvalue(outs, joint) > 1e-3
    assert sequence_pvalue(outs, _two_token_probs(llama, prompt, temperature * 1.3)) < 1e-3  # the test has power


def test_a_dead_stage_fails_the_step_naming_it_and_stops_the_others(llama, plain, three_stages):
    """(Runs last: it kills the three-stage pipeline.)"""
    be = three_stages
    eng = _engine(llama, be, 3, [Oracle(plain)])
    for p in PROMPTS:
        eng.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for _ in range(4):
        eng.step()
    be.crash_stage(1)
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"pipeline stage 1 \(pid \d+, layers 2-2\) died"):
        for _ in range(50):
            eng.step()
    assert time.monotonic() - t0 < 15
    assert all(p.poll() is not None for p in be.procs), "the other stage was shut down"
    with pytest.raises(PipelineError, match="the pipeline is down"):
        eng.step()
    # what the server does with a failed step: every request in flight fails with the message
    for rid in list(eng.requests):
        eng.abort(rid, "error", error="the engine step failed")
    assert all(o.finished and o.finish_reason == "error" for o in eng.collect_outputs())
