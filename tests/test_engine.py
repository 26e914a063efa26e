"""The engine: speculative decoding must not change outputs.

Greedy: token-identical to Hugging Face's own greedy generate() and to the
same engine without speculation, for several architectures, prompts, batch
sizes and budgets. Sampling: identical to non-speculative decoding under the
same seed, and distributed as the model says (chi-square).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_checks import sequence_pvalue
from tiny_models import WORDS, tiny_model

import sssd
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams

ARCHS = ["llama", "qwen2", "gemma3"]
PROMPTS = [
    [5, 9, 23, 7, 3, 40, 41, 42, 3],
    [10, 11, 12, 13, 10, 11, 12],
    [4] * 20,  # longer than gemma3's sliding window of 8
    [60],
]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp(request.param) / request.param, request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("llama") / "llama", "llama")


@pytest.fixture(scope="module")
def reference(model):
    """Hugging Face's own greedy continuations (float32, no engine)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            g = ref.generate(
                torch.tensor(p)[None], max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            out.append(g[0, len(p) :].tolist())
    return out


def corpus_datastore(reference):
    """A datastore holding the reference continuations in pieces and with
    distractors, so that drafts are long, branchy and partly wrong."""
    rng = np.random.default_rng(0)
    docs = []
    for p, r in zip(PROMPTS, reference):
        full = p + r
        for _ in range(3):
            a = int(rng.integers(0, len(full) - 4))
            docs.append(full[a : a + int(rng.integers(4, 16))])
            wrong = list(full[a : a + 6])
            wrong[int(rng.integers(2, 6))] = int(rng.integers(3, 93))
            docs.append(wrong)
    stream = [t for d in docs for t in d + [sssd.SEPARATOR]]
    return sssd.Datastore.from_tokens(np.array(stream, dtype=np.uint32))


def engine(model, datastore=None, **cfg):
    cfg.setdefault("max_model_len", 256)
    return LLMEngine(model, datastore=datastore, config=EngineConfig(**cfg))


@pytest.mark.parametrize("budget, running", [(None, 4), (1, 1), (6, 2), (24, 4)])
def test_greedy_is_token_identical(model, reference, budget, running):
    spec = budget is not None
    eng = engine(
        model, corpus_datastore(reference) if spec else None, speculate=spec, budget=budget, max_running=running
    )
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference
    if spec:
        total = sum(o.stats["accepted"] for o in outs)
        assert total > 0, "the drafts should be right sometimes"
        if budget >= 6:
            assert eng.metrics.kv_moves > 0, "some accepted paths should not be the first branch"


def test_continuous_batching_admits_and_retires_mid_flight(llama):
    """Requests arriving while others decode get the same outputs as alone."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 3] for i in range(9)]
    alone = [
        engine(llama, speculate=False).generate([p], SamplingParams(max_tokens=12 + i, ignore_eos=True))[0].token_ids
        for i, p in enumerate(prompts)
    ]
    eng = engine(llama, None, speculate=True, budget=8, max_running=3, prefill_chunk=4)
    ids, done = {}, {}
    pending = list(enumerate(prompts))
    while pending or eng.has_unfinished():
        if pending and eng.step_count % 2 == 0:  # one new request every other step
            i, p = pending.pop(0)
            ids[eng.add_request(p, SamplingParams(max_tokens=12 + i, ignore_eos=True))] = i
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        assert eng.num_running <= 3
    assert [done[i] for i in range(len(prompts))] == alone


def test_limit_running_caps_the_requests_at_once_and_changes_no_output(llama):
    """One engine run at several batch sizes (what the benchmarks do): `limit_running(n)` admits at
    most n requests at once, whatever its slots; a replaced config does not (it sized the KV pool at
    construction, and admitting 4 under a 1 made benchmarks' batch-1 rows batch-4 rows)."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 3] for i in range(6)]
    eng = engine(llama, None, speculate=True, budget=4, max_running=4)
    outputs = {}
    for n in (1, 3, None, 2):
        eng.limit_running(n)
        ids = [eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
        most, done = 0, {}
        while eng.has_unfinished():
            most = max(most, eng.num_running)
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        assert most == (n or 4)
        outputs[n] = [done[i] for i in ids]
    assert outputs[1] == outputs[3] == outputs[None] == outputs[2]
    for bad in (0, 5, 1.0, True, "2"):
        with pytest.raises(ValueError, match="limit_running takes an int in 1..4"):
            eng.limit_running(bad)
    assert eng.scheduler.max_running == 2  # a refused limit changes nothing


def test_chunked_prefill_matches(llama):
    long_prompt = [(7 * i) % 90 + 3 for i in range(70)]
    want = engine(llama, speculate=False, prefill_chunk=512).generate([long_prompt], SamplingParams(max_tokens=10))[0]
    got = engine(llama, speculate=True, budget=4, prefill_chunk=5).generate(
        [long_prompt], SamplingParams(max_tokens=10)
    )[0]
    assert got.token_ids == want.token_ids


def test_prompt_chunks_written_in_the_decode_pass_change_nothing(model, reference):
    """A step's prompt chunk rides in its decode pass (after the decoding rows' trees): requests
    that join while others decode, prompts spread over several chunks, greedy and sampled rows,
    get what they get with chunks in passes of their own and what plain decoding gives, and the
    passes of their own are spared."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [(5 * i) % 80 + 3] * (i % 3) for i in range(8)]
    params = [
        SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(max_tokens=6 + 3 * i, temperature=0.9, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]

    def run(**cfg):
        eng = engine(model, max_running=3, prefill_chunk=5, **cfg)
        ids, done, pending = {}, {}, list(range(len(prompts)))
        while pending or eng.has_unfinished():
            if pending and eng.step_count % 2 == 0:  # one new request every other step
                i = pending.pop(0)
                ids[eng.add_request(prompts[i], params[i])] = i
            for out in eng.step():
                if out.finished:
                    done[ids[out.request_id]] = out.token_ids
        return [done[i] for i in range(len(prompts))], eng.metrics

    spec = dict(datastore=corpus_datastore(reference), budget=8)
    plain, _ = run(speculate=False, fuse_prefill=False)
    fused, m_fused = run(**spec)
    apart, m_apart = run(fuse_prefill=False, **spec)
    assert fused == plain and apart == plain
    assert m_fused.prefill_fused > 0 and m_apart.prefill_fused == 0
    assert m_fused.prefill_passes < m_apart.prefill_passes
    assert m_fused.prefill_tokens == m_apart.prefill_tokens
    assert plain == run(speculate=False)[0]


def test_each_requests_acceptance_by_source_changes_drafts_not_outputs(model, reference):
    """Each request's own measured acceptance by source (sssd.source_evidence) reweighs its sources
    from its first steps on: greedy rows stay token-identical to plain decoding and sampled rows
    identical under their seeds, with it and without it."""
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]

    def run(**cfg):
        eng = engine(model, max_running=4, **cfg)
        ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        done, counted = {}, 0.0
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            ev = eng.drafting.evidence if eng.drafting is not None else None
            if ev is not None:
                counted += sum(float(ev.counts(i)[1].sum()) for i in ids if i in ev)
        return [done[i] for i in ids], eng, counted

    spec = dict(datastore=corpus_datastore(reference), budget=8)
    plain, _, _ = run(speculate=False)
    on, eng_on, counted = run(**spec)
    off, eng_off, _ = run(source_evidence=False, **spec)
    assert on == plain and off == plain
    for o, r, sp in zip(on, reference, params):
        if sp.temperature == 0:
            assert o == r[:24]  # greedy rows: also Hugging Face's own
    assert eng_off.drafting.evidence is None
    assert counted > 0, "the requests' drafts should have been scored"
    assert len(eng_on.drafting.evidence) == 0, "finished requests leave nothing behind"


def test_stops_inside_an_accepted_run(model, reference):
    """A stop token, a stop string or max_tokens that fall inside a run of
    several accepted tokens end the output exactly where plain decoding does."""
    ds = corpus_datastore(reference)
    plain, spec = engine(model, speculate=False), engine(model, ds, budget=24)
    prompt, ref = PROMPTS[1], reference[1]
    cases = [
        SamplingParams(max_tokens=30, stop_token_ids=(ref[5],)),
        SamplingParams(max_tokens=7, ignore_eos=True),
        SamplingParams(max_tokens=30, ignore_eos=True, stop=(WORDS[ref[8] - 3],)),
    ]
    for params in cases:
        a = plain.generate([prompt], params)[0]
        b = spec.generate([prompt], params)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    cut = spec.generate([prompt], cases[0])[0]
    assert cut.token_ids == ref[: ref.index(ref[5]) + 1] and cut.finish_reason == "stop"
    assert len(spec.generate([prompt], cases[1])[0].token_ids) == 7
    assert WORDS[ref[8] - 3] not in spec.generate([prompt], cases[2])[0].text


def test_text_and_chat_prompts(llama):
    eng = engine(llama, speculate=True, budget=4)
    text = " ".join(WORDS[t - 3] for t in PROMPTS[0])
    by_text = eng.generate([text], SamplingParams(max_tokens=6))[0]
    by_ids = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=6))[0]
    assert by_text.token_ids == by_ids.token_ids and by_text.text == by_ids.text
    chat = eng.generate([[{"role": "user", "content": text}]], SamplingParams(max_tokens=6))[0]
    assert chat.prompt_token_ids[: len(PROMPTS[0])] == PROMPTS[0]


def test_abort_frees_the_slot_and_spares_the_others(llama):
    eng = engine(llama, speculate=True, budget=4, max_running=2)
    keep = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    gone = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.abort(gone) and not eng.abort(gone) and not eng.abort(12345)
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert outs[gone].finish_reason == "abort" and eng.num_running == 0
    alone = engine(llama, speculate=False).generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert outs[keep].token_ids == alone.token_ids
    assert eng.drafting is not None and len(eng.drafting) == 0  # drafter state freed too


def test_bad_requests_are_refused_and_the_engine_keeps_serving(llama, tmp_path):
    eng = engine(llama, speculate=True, budget=4, max_model_len=64, max_waiting=2)
    ok = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="at most"):
        eng.add_request([5] * 80, SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([5, 10_000], SamplingParams())
    with pytest.raises(ValueError, match="a prompt is"):
        eng.add_request([1.5, 2], SamplingParams())
    eng.add_request(PROMPTS[1], SamplingParams(max_tokens=5))
    with pytest.raises(OverflowError, match="queue is full"):
        eng.add_request(PROMPTS[2], SamplingParams(max_tokens=5))
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(seed="x")):
        with pytest.raises(ValueError, match="invalid sampling"):
            SamplingParams(**bad)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    assert {o.request_id for o in outs} >= {ok} and all(len(o.token_ids) <= 5 for o in outs)
    # a max_tokens beyond the slot is clipped to what fits
    long = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=10_000, ignore_eos=True))[0]
    assert len(PROMPTS[0]) + len(long.token_ids) + 5 <= 64


def test_not_a_causal_lm_is_refused(tmp_path):
    from transformers import BertConfig

    cfg = dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertConfig(architectures=["BertForMaskedLM"], **cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal language model"):
        LLMEngine(tmp_path, datastore=None)
    (tmp_path / "llm").mkdir()
    from transformers import LlamaConfig

    LlamaConfig(architectures=["LlamaForCausalLM"], **cfg).save_pretrained(tmp_path / "llm")  # config, no weights
    with pytest.raises(ValueError, match="cannot load"):
        LLMEngine(tmp_path / "llm", datastore=None)
    with pytest.raises(ValueError, match="not a local model folder"):
        LLMEngine(tmp_path / "nothing", datastore=None)


def test_sampling_with_a_seed_is_identical_with_and_without_speculation(model, reference):
    """Each emitted token is one draw from the target's distribution at its
    position, in the same order: the same seed gives the same text."""
    params = [
        SamplingParams(max_tokens=25, temperature=t, top_p=p, top_k=k, seed=s, ignore_eos=True)
        for s, (t, p, k) in enumerate([(0.7, 1.0, 0), (1.0, 0.9, 0), (1.3, 1.0, 20), (0.9, 0.8, 10)])
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    plain = engine(model, speculate=False, max_running=4).generate(prompts, params)
    spec = engine(model, corpus_datastore(reference), budget=16, max_running=4).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats["accepted"] for o in spec) > 0


def test_sampled_sequences_follow_the_models_distribution(llama):
    """Chi-square: 2-token continuations sampled with speculation (drafts that
    propose the likeliest tokens, so that most tokens are accepted from the
    tree) against the model's exact probabilities p(t1) p(t2 | t1)."""
    from transformers import AutoModelForCausalLM

    temperature, prompt = 2.0, PROMPTS[1]
    ref = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()

    def pair_probs(t: float, pairs=None) -> dict:
        with torch.no_grad():
            p1 = torch.softmax(ref(torch.tensor(prompt)[None]).logits[0, -1] / t, -1)
            out = {}
            for t1 in [a for a, _ in pairs] if pairs else torch.topk(p1, 6).indices.tolist():
                p2 = torch.softmax(ref(torch.tensor(prompt + [t1])[None]).logits[0, -1] / t, -1)
                for t2 in [b for a, b in pairs if a == t1] if pairs else torch.topk(p2, 4).indices.tolist():
                    out[(t1, t2)] = float(p1[t1] * p2[t2])
            return out

    joint = pair_probs(temperature)
    # the datastore proposes exactly the likely 2-token continuations
    stream = [t for (t1, t2) in joint for t in prompt[-3:] + [t1, t2, sssd.SEPARATOR]]
    ds = sssd.Datastore.from_tokens(np.array(stream, dtype=np.uint32))
    eng = engine(llama, ds, budget=24, max_running=64)
    n = 4000
    outs = eng.generate(
        [prompt] * n, [SamplingParams(max_tokens=2, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    )
    accepted = sum(o.stats["accepted"] for o in outs)
    assert accepted > n // 4, "many tokens should come from the tree"
    pvalue = sequence_pvalue(outs, joint)
    assert pvalue > 1e-3, pvalue
    # the test has power: a sampler whose temperature were off by a quarter would be caught
    assert sequence_pvalue(outs, pair_probs(temperature * 1.25, pairs=list(joint))) < 1e-3


def test_llm_api_shape(llama):
    llm = sssd.LLM(llama, datastore=None, budget=4, max_model_len=128)
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], sssd.SamplingParams(max_tokens=5))
    assert len(outs) == 2 and all(o.finished and len(o.token_ids) <= 5 for o in outs)
    assert set(outs[0].stats) >= {"steps", "accepted", "tokens_per_step", "accepted_per_step", "accepted_by_source"}
    plain = sssd.LLM(llama, speculate=False, max_model_len=128).generate(PROMPTS[0], sssd.SamplingParams(max_tokens=5))
    assert plain[0].token_ids == outs[0].token_ids


def test_streamed_text_survives_characters_split_across_byte_tokens():
    """A byte-level tokenizer splits '🌊' and '海' into several tokens; decoding a prefix
    ends in U+FFFD until the character completes. The streamed deltas must add up to the
    final text (before, the whole text was resent each time)."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from sssd.serving.engine.requests import stream_delta

    alphabet = ByteLevel.alphabet()  # one token per byte: every multi-byte character is split
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "Ocean 🌊 waves, 海の波 and café"
    ids = tok.encode(text).ids
    assert len(ids) > len(text)  # characters really are split
    req = SimpleNamespace(text="", sent_text="", finished=False)
    streamed = []
    for n in range(1, len(ids) + 1):
        req.text, req.finished = tok.decode(ids[:n]), n == len(ids)
        streamed.append(stream_delta(req))
    assert "".join(streamed) == text
    assert not any("\ufffd" in d for d in streamed)
