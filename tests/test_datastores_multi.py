"""Several datastores: extra ones draft as sources of their own, and come and go while serving.

The primary datastore (retrieval's) holds unrelated text; the extra one holds
the model's own greedy continuations, so its drafts are the ones accepted.
Outputs stay token-identical to plain decoding whatever drafts.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest
from test_server import Server, free_port
from tiny_models import WORDS, tiny_model

import sssd
from sssd.datastore_source import DatastoreSource, add_datastore, conditional_weights
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.sources import DraftPipeline, DraftRequest, RetrievalSource

PROMPTS = [[5, 9, 23, 7, 3, 40, 41, 42, 3], [10, 11, 12, 13, 10, 11, 12], [60, 61, 30]]
N = 30
SEP = sssd.SEPARATOR


def text(ids) -> str:
    return " ".join(WORDS[t - 3] for t in ids)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("multi") / "llama", "llama")


@pytest.fixture(scope="module")
def plain(model):
    eng = LLMEngine(model, datastore=None, config=EngineConfig(speculate=False, max_model_len=256))
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True))]


@pytest.fixture(scope="module")
def stores(tmp_path_factory, plain):
    """Datastores on disk: 'unrelated' (random words), 'answers' (every prompt and its continuation),
    and a copy of 'answers' whose suffix array is cut short (corrupt)."""
    root = tmp_path_factory.mktemp("stores")
    rng = np.random.default_rng(7)
    noise = [t for _ in range(40) for t in rng.integers(3, 93, 12).tolist() + [SEP]]
    unrelated = sssd.Datastore.build(np.array(noise, dtype=np.uint32), root / "unrelated")
    answers_tokens = [t for p, o in zip(PROMPTS, plain) for t in p + o + [SEP]]
    answers = sssd.Datastore.build(np.array(answers_tokens, dtype=np.uint32), root / "answers")
    corrupt = sssd.Datastore.build(np.array(answers_tokens, dtype=np.uint32), root / "corrupt")
    sa = corrupt.path / "suffix_array.bin"
    del corrupt
    sa.write_bytes(sa.read_bytes()[:-8])
    big = sssd.Datastore.build(np.array([500, 501, SEP], dtype=np.uint32), root / "othervocab")
    return {"unrelated": unrelated.path, "answers": answers.path, "corrupt": sa.parent, "othervocab": big.path}


# -- the source and the pipeline, without a model -------------------------------------------------


def test_weights_are_conditional_and_multiply_to_the_path_probability(stores, plain):
    ds = sssd.Datastore.open(stores["answers"])
    src = DatastoreSource(ds, sssd.DrafterConfig(vocab_size=93))
    assert src.name == "answers" and src.info()["tokens"] == ds.size
    ctx = [np.array(p + o[:3], dtype=np.int64) for p, o in zip(PROMPTS, plain)]
    for rid, c in enumerate(ctx):
        src.open(rid, c)
    got = src.propose([DraftRequest(rid, c, 12) for rid, c in enumerate(ctx)])
    assert all(g is not None for g in got)
    for g, o in zip(got, plain):
        g.check(93)  # well-formed: a ranking weight per node, no draft probability q
        assert g.probs is None and np.all((g.weights >= 0) & (g.weights <= 1))
        # the best chain continues the model's own output
        assert g.tokens[0] == o[3]
    # weights times along a path give back the drafter's path probability (times the damping)
    batch = src._drafter.draft(np.arange(len(ctx)), np.full(len(ctx), 12, np.int32))
    w = conditional_weights(batch.offsets, batch.parents, batch.probs, batch.match_lens, *src.damping)
    damp = src.damping[0] ** np.maximum(0, src.damping[1] - batch.match_lens.astype(np.int64))
    for b in range(len(batch)):
        a = int(batch.offsets[b])
        for i in range(int(batch.offsets[b + 1]) - a):
            path, node = 1.0, i
            while node >= 0:
                path *= float(w[a + node])
                node = int(batch.parents[a + node])
            assert path == pytest.approx(float(batch.probs[a + i] * damp[a + i]), rel=1e-4)


def test_pipeline_adds_and_removes_a_source_for_running_requests(stores, plain):
    cfg = sssd.DrafterConfig()
    pipe = DraftPipeline([RetrievalSource(sssd.Datastore.open(stores["unrelated"]), cfg)], cfg, vocab_size=93)
    pipe.open(1, np.array(PROMPTS[0]))
    pipe.open(2, np.array(PROMPTS[1]))
    pipe.extend_batch([1], [np.array(plain[0][:2])])
    asks = [DraftRequest(1, np.array(PROMPTS[0] + plain[0][:2]), 16), DraftRequest(2, np.array(PROMPTS[1]), 16)]
    before = pipe.draft(asks)
    # a discount the merge's table lacks: the merge moves to a new drafter, the requests with it
    merge = pipe.drafter
    src = add_datastore(pipe, sssd.Datastore.open(stores["answers"]), discount=sssd.SourceDiscount(scale=0.5))
    assert pipe.drafter is not merge and pipe._discounts == (src.discount,)
    assert pipe.source_names == {0: "datastore", 1: "input", 2: "answers", 15: "copy"}
    assert sorted(pipe.drafter.request_ids()) == [1, 2] and len(src) == 2
    assert pipe.drafter.context(1).tolist() == PROMPTS[0] + plain[0][:2]
    assert src._drafter.context(1).tolist() == PROMPTS[0] + plain[0][:2]  # opened with its tokens so far
    batch = pipe.draft(asks[:1])
    assert 2 in batch.sources.tolist() and batch.tokens[batch.sources == 2][0] == plain[0][2]
    pipe.remove_source("answers")
    after = pipe.draft(asks)  # the reopened requests draft as before
    assert after.tokens.tolist() == before.tokens.tolist() and after.scores.tolist() == before.scores.tolist()
    src = add_datastore(pipe, sssd.Datastore.open(stores["answers"]), discount=sssd.SourceDiscount(scale=0.5))
    pipe.extend_batch([1, 2], [np.array([plain[0][2]]), np.array([plain[1][0]])])
    assert src._drafter.context(2).tolist() == PROMPTS[1] + plain[1][:1]
    second = add_datastore(pipe, sssd.Datastore.open(stores["answers"]))  # the same folder: a suffixed name
    assert second.name == "answers-2"
    with pytest.raises(ValueError, match="already"):
        add_datastore(pipe, sssd.Datastore.open(stores["answers"]), name="answers")
    with pytest.raises(ValueError, match="cannot be removed"):
        pipe.remove_source("datastore")
    with pytest.raises(KeyError):
        pipe.remove_source("nope")
    assert pipe.remove_source("answers") is src and len(src) == 0  # closed for every request
    assert pipe.source_names == {0: "datastore", 1: "input", 2: "answers-2", 15: "copy"}
    assert pipe.draft([DraftRequest(2, np.array(PROMPTS[1] + plain[1][:1]), 8)]).sources.max() <= 2
    pipe.close(1)
    assert len(second) == 1


# -- the engine ---------------------------------------------------------------------------------


def test_sssd_llm_takes_a_list_of_datastores(model, stores, plain):
    """sssd.LLM(model, datastore=[A, B]) looks for the packaged calibration by its primary
    datastore and drafts from both."""
    llm = sssd.LLM(model, datastore=[stores["unrelated"], stores["answers"]], budget=8, max_model_len=256)
    outs = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=N, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain[:1]
    assert llm.engine.metrics.accepted_by_source.get("answers", 0) > 0


def test_two_datastores_are_lossless_and_the_extra_one_drafts(model, stores, plain):
    eng = LLMEngine(
        model,
        datastore=[stores["unrelated"], stores["answers"]],
        config=EngineConfig(max_model_len=256, budget=8, max_running=2),
    )
    # the default sources (retrieval, recent), then the extra datastore
    assert [s.name for s in eng.drafting.external] == ["recent", "answers"]
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    by = eng.metrics.accepted_by_source
    assert by.get("answers", 0) > N, by  # most tokens came from the extra datastore's drafts
    assert sum(o.stats["steps"] for o in outs) < N * len(PROMPTS) / 2
    # sampled: the same tokens as plain decoding under the same seed
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    want = LLMEngine(model, datastore=None, config=EngineConfig(speculate=False, max_model_len=256)).generate(
        PROMPTS, params
    )
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == [o.token_ids for o in want]


def test_every_datastore_is_checked_against_the_model(model, stores):
    with pytest.raises(ValueError, match="othervocab.*beyond the model's vocabulary"):
        LLMEngine(model, datastore=[stores["unrelated"], stores["othervocab"]], config=EngineConfig(budget=4))
    with pytest.raises(sssd.DatastoreError, match="corrupt"):
        LLMEngine(model, datastore=[None, stores["corrupt"]], config=EngineConfig(budget=4))


# -- the server ---------------------------------------------------------------------------------


def admin_server(model, primary, api_key=None, admin=True) -> Server:
    """A server with the admin endpoints (or without, admin=False) over an engine with `primary`."""
    return Server(model, api_key=api_key, app_options={"admin": admin}, datastore=primary, max_running=4)


def test_hot_add_and_remove_while_a_stream_runs(model, stores, plain):
    long_prompt = PROMPTS[2]
    want = (
        LLMEngine(model, datastore=None, config=EngineConfig(speculate=False, max_model_len=256))
        .generate([long_prompt], SamplingParams(max_tokens=150, ignore_eos=True))[0]
        .text
    )
    s = admin_server(model, stores["unrelated"])
    steps = s.engine.step

    def slow_step():  # a stream long enough to add a datastore in its middle
        time.sleep(0.004)
        return steps()

    s.engine.step = slow_step
    c = httpx.Client(base_url=s.url, timeout=60)
    try:
        listed = c.get("/v1/admin/datastores").json()["data"]
        assert [(d["name"], d["primary"]) for d in listed] == [("datastore", True)]
        chunks, added_at = [], []

        def stream():
            with c.stream(
                "POST",
                "/v1/completions",
                json={
                    "prompt": text(long_prompt),
                    "max_tokens": 150,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                },
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append((time.monotonic(), json.loads(line[6:])["choices"][0]["text"]))

        t = threading.Thread(target=stream)
        t.start()
        while not chunks:
            time.sleep(0.005)
        r = c.post("/v1/admin/datastores", json={"path": str(stores["answers"])})
        added_at.append(time.monotonic())
        assert r.status_code == 201, r.text
        assert r.json()["name"] == "answers" and r.json()["tokens"] > 0
        t.join(60)
        assert "".join(ch for _, ch in chunks) == want
        assert any(ts > added_at[0] for ts, _ in chunks), "the datastore was added after the stream ended"
        # the next requests draft from it: its acceptances show under its name
        for p in PROMPTS[:2]:
            assert (
                c.post(
                    "/v1/completions", json={"prompt": text(p), "max_tokens": N, "temperature": 0, "ignore_eos": True}
                ).status_code
                == 200
            )
        listed = {d["name"]: d for d in c.get("/v1/admin/datastores").json()["data"]}
        assert listed["answers"]["accepted"] > 0 and listed["answers"]["path"] == str(stores["answers"])
        assert 'sssd:accepted_tokens_by_source_total{source="answers"}' in c.get("/metrics").text
        # a corrupt datastore is refused with the reason; the server goes on
        r = c.post("/v1/admin/datastores", json={"path": str(stores["corrupt"]), "name": "bad"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "path"
        assert "corrupt" in r.json()["error"]["message"] and str(stores["corrupt"]) in r.json()["error"]["message"]
        r = c.post("/v1/admin/datastores", json={"path": str(stores["othervocab"])})
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
        r = c.post("/v1/admin/datastores", json={"path": str(stores["answers"]), "name": "answers"})
        assert r.status_code == 409 and "exists" in r.json()["error"]["message"]
        r = c.post("/v1/admin/datastores", json={"path": str(stores["answers"]), "name": "../x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"
        assert c.get("/health").json()["status"] == "ok"
        assert [d["name"] for d in c.get("/v1/admin/datastores").json()["data"]] == ["datastore", "answers"]
        r = c.post(
            "/v1/completions", json={"prompt": text(PROMPTS[0]), "max_tokens": N, "temperature": 0, "ignore_eos": True}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text(plain[0])
        # removing: the primary stays, an added one goes, an unknown one is 404
        r = c.delete("/v1/admin/datastores/datastore")
        assert r.status_code == 409 and "primary" in r.json()["error"]["message"]
        r = c.delete("/v1/admin/datastores/answers")
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert c.delete("/v1/admin/datastores/answers").status_code == 404
        assert [d["name"] for d in c.get("/v1/admin/datastores").json()["data"]] == ["datastore"]
        r = c.post(
            "/v1/completions", json={"prompt": text(PROMPTS[0]), "max_tokens": N, "temperature": 0, "ignore_eos": True}
        )
        assert r.json()["choices"][0]["text"] == text(plain[0])
    finally:
        c.close()
        s.stop()


def test_admin_endpoints_need_the_key_and_the_flag(model, stores):
    s = admin_server(model, None, api_key="sekret")
    try:
        assert httpx.get(s.url + "/v1/admin/datastores").status_code == 401
        r = httpx.post(s.url + "/v1/admin/datastores", json={"path": str(stores["answers"])})
        assert r.status_code == 401 and [x.name for x in s.engine.drafting.external] == ["recent"]  # nothing added
        assert httpx.delete(s.url + "/v1/admin/datastores/x").status_code == 401
        key = {"authorization": "Bearer sekret"}
        assert httpx.get(s.url + "/v1/admin/datastores", headers=key).json()["data"] == []
        r = httpx.post(s.url + "/v1/admin/datastores", json={"path": str(stores["answers"]), "name": "a"}, headers=key)
        assert r.status_code == 201 and r.json()["name"] == "a"
    finally:
        s.stop()
    s = admin_server(model, None, admin=False)
    try:
        assert httpx.get(s.url + "/v1/admin/datastores").status_code == 404
        assert httpx.post(s.url + "/v1/admin/datastores", json={"path": str(stores["answers"])}).status_code == 404
    finally:
        s.stop()


# -- the command line -------------------------------------------------------------------------


def test_serve_takes_several_datastores(model, stores, monkeypatch):
    from sssd import cli
    from sssd.commands import serve  # (importing sssd.commands registers the subcommands)
    from sssd.serving import engine as engine_mod

    def parse(*argv):
        args = cli._parser().parse_args(["serve", "--model", str(model), "--port", str(free_port()), *argv])
        serve.validate(args)
        return args

    args = parse()
    assert args.datastore == "default" and args.extra_datastores == []
    args = parse("--datastore", str(stores["unrelated"]), "--datastore", str(stores["answers"]), "--enable-admin")
    assert args.datastore == str(stores["unrelated"]) and args.extra_datastores == [str(stores["answers"])]
    assert args.enable_admin
    with pytest.raises(ValueError, match="none can only be the first"):
        parse("--datastore", str(stores["unrelated"]), "--datastore", "none")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        parse("--datastore", str(stores["unrelated"]), "--datastore", "/nowhere")
    with pytest.raises(ValueError, match="twice"):
        parse("--datastore", str(stores["answers"]), "--datastore", str(stores["answers"]))
    with pytest.raises(ValueError, match="needs --api-key"):
        parse("--enable-admin", "--host", "0.0.0.0")

    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(model, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(engine_mod, "LLMEngine", fake_engine)
    args = parse("--datastore", str(stores["unrelated"]), "--datastore", str(stores["answers"]), "--drafter", "default")
    with pytest.raises(Stop):
        serve._serve(args)
    assert seen["datastore"] == [str(stores["unrelated"]), str(stores["answers"])]
    assert cli.main(["serve", "--model", str(model), "--datastore", "none", "--datastore", "x"]) == 1
