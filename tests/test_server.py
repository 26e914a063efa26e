"""The OpenAI-compatible server, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from tiny_models import WORDS, tiny_model

from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.serving.frontends.api_server import create_app
from sssd.serving.frontends.async_engine import AsyncEngine

PROMPT = " ".join(WORDS[i] for i in (5, 9, 23, 7, 3, 40, 41, 42))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, api_key=None, app_options=None, datastore=None, **cfg):
        cfg.setdefault("max_model_len", 256)
        self.engine = LLMEngine(model, datastore=datastore, config=EngineConfig(budget=4, **cfg))
        self.port = free_port()
        app = create_app(
            AsyncEngine(self.engine),
            "tiny",
            api_key=api_key,
            request_timeout=cfg.pop("timeout", 60),
            **(app_options or {}),
        )
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key="none"):
        c = openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)
        closing.append(c)
        return c

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


closing: list = []  # HTTP clients to close (open sockets would warn at exit)


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while closing:
        closing.pop().close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("srv") / "llama", "llama")


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, max_running=4, max_waiting=64)
    yield s
    s.stop()


def offline(model, prompt, **params):
    eng = LLMEngine(model, datastore=None, config=EngineConfig(speculate=False, max_model_len=256))
    return eng.generate([prompt], SamplingParams(**params))[0]


def test_completions_with_the_openai_client(server, model):
    want = offline(model, PROMPT, max_tokens=12, ignore_eos=True)
    c = server.client()
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(want.prompt_token_ids)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        if ch.choices
    )
    assert streamed == want.text
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_chat_with_the_openai_client(server, model):
    messages = [{"role": "user", "content": PROMPT}]
    want = offline(model, messages, max_tokens=10, ignore_eos=True)
    c = server.client()
    r = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_sampling_parameters_are_honoured(server, model):
    want = offline(model, PROMPT, max_tokens=15, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    r = server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=15, temperature=0.9, top_p=0.9, seed=7, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == want.text
    stop_word = want.text.split()[4]
    r = server.client().completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=15,
        temperature=0.9,
        top_p=0.9,
        seed=7,
        stop=[stop_word],
        extra_body={"ignore_eos": True},
    )
    assert stop_word not in r.choices[0].text and r.choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors(server):
    c = server.client()
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2)
    raw = httpx.Client(base_url=server.url)
    closing.append(raw)
    for body in (
        '{"prompt": "w1", "max_tokens": ',
        '{"prompt": 5}',
        '{"prompt": "w1", "max_tokens": "many"}',
        '{"prompt": "w1", "temperature": -3}',
        '{"prompt": "w1", "max_tokens": 0}',
        "[]",
    ):
        r = raw.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, body
        assert set(r.json()["error"]) >= {"message", "type", "code"}
    r = raw.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = raw.post("/v1/completions", json={"prompt": "w1 " * 400, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # an explicit max_tokens that cannot fit is refused (as OpenAI and vLLM do), saying what fits
    r = raw.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10**9, "ignore_eos": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "ask for at most" in r.json()["error"]["message"]
    # without one, the default is lowered to what fits
    r = raw.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    assert raw.get("/health").json()["status"] == "ok"  # still serving


def test_client_disconnect_cancels_the_request(server):
    before = server.engine.metrics.finish_reasons.get("abort", 0)
    with httpx.Client(base_url=server.url, timeout=30) as raw:
        with raw.stream(
            "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    for _ in range(100):
        if server.engine.metrics.finish_reasons.get("abort", 0) > before and server.engine.num_running == 0:
            break
        time.sleep(0.05)
    assert server.engine.metrics.finish_reasons.get("abort", 0) == before + 1
    assert server.engine.num_running == 0 and len(server.engine.drafting) == 0


def test_metrics_use_vllm_names(server):
    server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "sssd:draft_seconds_bucket",
        "sssd:step_seconds_count",
        "sssd:num_requests_running",
        "sssd:num_requests_waiting",
        "sssd:budget_steps_total",
    ):
        assert name in text, name
    drafts = [line for line in text.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total ")]
    assert int(drafts[0].split()[1]) > 0


def test_api_key_and_queue_limit(model):
    s = Server(model, api_key="sekret", max_running=1, max_waiting=1)
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        missing = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert missing.status_code == 401 and "message" in missing.json()["error"]
        assert httpx.get(s.url + "/health").status_code == 200  # health needs no key
        # one running + one waiting: a third concurrent request is refused with 429
        statuses = []

        def call():
            r = httpx.post(
                s.url + "/v1/completions",
                headers={"authorization": "Bearer sekret"},
                json={"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True},
                timeout=60,
            )
            statuses.append((r.status_code, r.headers.get("retry-after")))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert (429, "1") in statuses and any(code == 200 for code, _ in statuses)
    finally:
        s.stop()


def test_sssd_serve_cli_starts_and_shuts_down_gracefully(model, tmp_path):
    port = free_port()
    env = dict(os.environ, SSSD_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sssd.cli",
            "serve",
            "--model",
            str(model),
            "--datastore",
            "none",
            "--port",
            str(port),
            "--budget",
            "4",
            "--max-model-len",
            "256",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "serving" in err


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_load_32_streaming_clients_identical_to_plain_and_no_growth(model):
    """32 concurrent streaming clients, three rounds: no failures, greedy text equal to the
    non-speculative engine's, nothing left behind, memory flat after the first round."""
    s = Server(model, max_running=8, max_waiting=64)
    prompts = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + i % 9)) for i in range(32)]
    lengths = [8 + (i * 5) % 40 for i in range(32)]
    plain = LLMEngine(model, datastore=None, config=EngineConfig(speculate=False, max_model_len=256, max_running=8))
    want = [o.text for o in plain.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])]

    def stream(i, results, errors):
        try:
            with httpx.Client(base_url=s.url, timeout=120) as raw:
                with raw.stream(
                    "POST",
                    "/v1/completions",
                    json={
                        "prompt": prompts[i],
                        "max_tokens": lengths[i],
                        "temperature": 0,
                        "stream": True,
                        "ignore_eos": True,
                    },
                ) as r:
                    assert r.status_code == 200, r.status_code
                    text = []
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                    results[i] = "".join(text)
        except Exception as e:  # noqa: BLE001 - every failure is reported below
            errors.append(f"client {i}: {e!r}")

    try:
        rss = []
        for _ in range(3):
            results, errors = [None] * 32, []
            threads = [threading.Thread(target=stream, args=(i, results, errors)) for i in range(32)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            assert results == want
            assert s.engine.num_running == 0 and len(s.engine.drafting) == 0
            rss.append(_rss_mb())
        assert rss[2] - rss[0] < 64, f"RSS grew across rounds: {rss} MB"
        assert s.engine.metrics.finish_reasons.get("length", 0) >= 96
        assert s.engine.metrics.num_accepted_tokens > 0  # speculation ran, and changed nothing
    finally:
        s.stop()


def test_first_output_is_not_lost_when_the_engine_steps_before_the_stream_is_read(model):
    """The engine thread may step right after a request is added, before the request's
    coroutine resumes: that step's output (the first token) must still reach the stream."""
    import asyncio

    engine = LLMEngine(model, datastore=None, config=EngineConfig(budget=4, max_model_len=256))
    ae = AsyncEngine(engine)
    original = ae._call

    async def engine_wins_the_race(fn, *args):
        res = await original(fn, *args)
        with ae._lock:
            outs = engine.step()  # what the engine thread would do before we resume
        for out in outs:
            ae._deliver(out)
        return res

    ae._call = engine_wins_the_race
    want = offline(model, PROMPT, max_tokens=10, ignore_eos=True).text

    async def main():
        ae.start()
        try:
            return "".join(
                [o.new_text async for o in ae.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))]
            )
        finally:
            await ae.shutdown(grace=5)

    assert asyncio.run(main()) == want
