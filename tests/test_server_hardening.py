"""The server and engine under bad traffic: one bad request, file or id never takes down the others.

Everything here goes through public surfaces (HTTP, the `sssd serve` command line,
LLMEngine's API, files on disk), so that the engine's internals can change under it.
"""

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
import numpy as np
import pytest
from test_server import PROMPT, Server, closing, free_port, offline
from tiny_models import WORDS, tiny_model

import sssd
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("hard") / "llama", "llama")


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, max_running=4, max_waiting=64, app_options={"max_body_bytes": 1 << 20})
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while closing:
        closing.pop().close()


def raw(server, **kw) -> httpx.Client:
    c = httpx.Client(base_url=server.url, timeout=60, **kw)
    closing.append(c)
    return c


def post(server, path, body, **kw):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return raw(server).post(path, content=content, headers={"content-type": "application/json"}, **kw)


# -- sampling parameters --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_vanishing_temperature_decodes_greedily_instead_of_failing(server, model, temperature):
    """1/temperature overflowed to inf, the softmax gave NaN and multinomial failed inside the
    engine, which aborted every running request; below 1e-5 it is greedy (as in vLLM)."""
    want = offline(model, PROMPT, max_tokens=10, ignore_eos=True).text
    r = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": temperature, "ignore_eos": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want


BAD_BODIES = [
    ('{"prompt": "w1", "temperature": NaN}', "temperature"),
    ('{"prompt": "w1", "temperature": Infinity}', "temperature"),
    ('{"prompt": "w1", "top_p": NaN}', "top_p"),
    ('{"prompt": "w1", "top_p": 0}', "top_p"),
    ('{"prompt": "w1", "top_k": -2}', "top_k"),
    ('{"prompt": "w1", "temperature": 1e400}', "temperature"),
    ('{"prompt": "w1", "max_tokens": -5}', "max_tokens"),
    ('{"prompt": "w1", "seed": 100000000000000000000000}', None),
    ('{"prompt": "w1", "stop": ["w2", 7]}', "stop"),
    ('{"prompt": "w1", "stop": ' + json.dumps(["w"] * 100) + "}", None),
    ('{"prompt": [1, 2, 99999999999999999999]}', None),
    ('{"prompt": [-1, 2]}', None),
    ('{"prompt": {"a": 1}}', "prompt"),
    ('{"prompt": "w1", "stream": "yes please"}', "stream"),
    ('{"prompt": "w1", "max_tokens": 1.5}', "max_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_bad_values_get_a_400_in_openai_shape(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, (body, r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_malformed_json_says_so_without_a_bogus_param(server):
    for body in ("hello", '{"prompt": "w1",', "", "\x00\x01"):
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] is None and "JSON" in err["message"], err
    r = post(server, "/v1/completions", "[1, 2]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_unknown_fields_are_ignored(server, model):
    want = offline(model, PROMPT, max_tokens=5, ignore_eos=True).text
    r = post(
        server,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 5,
            "ignore_eos": True,
            "user": "x",
            "temperature": 0,
            "some_future_option": {"nested": [1, 2]},
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_a_huge_prompt_is_refused_quickly_and_the_others_keep_streaming(server, model):
    """A 10 MB prompt is judged on a prefix (not tokenized whole under the engine lock);
    a stream running meanwhile is unaffected."""
    want = offline(model, PROMPT, max_tokens=60, ignore_eos=True).text
    got = {}

    def stream():
        with raw(server).stream(
            "POST",
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 60, "stream": True, "ignore_eos": True, "temperature": 0},
        ) as r:
            got["text"] = "".join(
                json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines() if line.startswith("data: {")
            )

    t = threading.Thread(target=stream)
    t.start()
    huge = " ".join(WORDS[i % len(WORDS)] for i in range(10 * 2**20 // 4))  # ~10 MB of words
    r = post(server, "/v1/completions", {"prompt": huge, "max_tokens": 5})
    assert r.status_code == 413  # the test server caps bodies at 1 MiB
    big = " ".join(WORDS[i % len(WORDS)] for i in range(200_000))  # ~800 KB: under the cap, far over the context
    r = post(server, "/v1/completions", {"prompt": big, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": big}], "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    t.join(timeout=60)
    assert got["text"] == want


def test_body_limit_applies_to_announced_and_chunked_bodies(server):
    big = json.dumps({"prompt": "w1 " * 400_000})
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536].encode()

    r = raw(server).post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


# -- the HTTP surface -------------------------------------------------------------------------------


def test_errors_are_openai_json_with_the_right_status(server):
    c = raw(server)
    assert c.head("/health").status_code == 200
    r = c.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = c.get("/v1/completions")
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": PROMPT, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_api_key_guards_everything_but_health_and_is_a_choice_for_metrics(model):
    s = Server(model, api_key="sekret", max_running=2, app_options={"public_metrics": False})
    try:
        c = raw(s)
        for path in ("/metrics", "/openapi.json", "/v1/models"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert c.get("/health").status_code == 200
        assert c.get("/v1/models", headers={"authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/v1/models", headers={"authorization": "Bearer sekret2"}).status_code == 401
        assert c.get("/v1/models", headers={"authorization": "sekret"}).status_code == 401
    finally:
        s.stop()
    s = Server(model, api_key="sekret", max_running=2, app_options={"public_metrics": True})
    try:
        c = raw(s)
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 401
    finally:
        s.stop()


def test_a_non_streaming_request_is_aborted_when_its_client_disconnects(server):
    """The auth middleware used to hide disconnects: the request kept its batch slot to the end."""
    before = server.engine.metrics.finish_reasons.get("abort", 0)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 220, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        for _ in range(200):  # wait until it runs
            if server.engine.num_running:
                break
            time.sleep(0.01)
    for _ in range(300):
        if server.engine.metrics.finish_reasons.get("abort", 0) > before and server.engine.num_running == 0:
            break
        time.sleep(0.02)
    assert server.engine.metrics.finish_reasons.get("abort", 0) == before + 1
    assert server.engine.num_running == 0


# -- per-request isolation ---------------------------------------------------------------------------


def test_one_failing_request_fails_alone(model):
    """A fault in one request's own work (here: its output cannot be detokenized) finishes that
    request with an error (HTTP 500 in OpenAI's shape, or an error event when streaming);
    the requests beside it finish with the outputs they would have had alone."""
    s = Server(model, max_running=4)
    poison = WORDS[17]
    decode = s.engine.tokenizer.decode

    def faulty(ids, *a, **k):  # a real tokenizer that fails on one request's text
        text = decode(ids, *a, **k)
        if poison in text.split():
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
        return text

    s.engine.tokenizer.decode = faulty
    prompts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(6)) for i in range(6)]
    want = {p: offline(model, p, max_tokens=24, ignore_eos=True).text for p in prompts}
    bad = [p for p in prompts if poison in want[p].split()]
    good = [p for p in prompts if p not in bad]
    assert good, "no request would succeed: pick another poison word"
    try:
        results = {}

        def call(p):
            results[p] = httpx.post(
                s.url + "/v1/completions",
                json={"prompt": p, "max_tokens": 24, "ignore_eos": True, "temperature": 0},
                timeout=60,
            )

        threads = [threading.Thread(target=call, args=(p,)) for p in prompts + [PROMPT + " " + poison]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in good:
            assert results[p].status_code == 200 and results[p].json()["choices"][0]["text"] == want[p]
        poisoned = results[PROMPT + " " + poison]
        if poison in offline(model, PROMPT + " " + poison, max_tokens=24, ignore_eos=True).text.split():
            assert poisoned.status_code == 500 and poisoned.json()["error"]["type"] == "server_error"
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
    finally:
        s.stop()


def test_request_ids_are_one_well_defined_range(model):
    eng = LLMEngine(model, datastore=None, config=EngineConfig(budget=4, max_model_len=128))
    for rid in (2**63, -1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match="request_id"):
            eng.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id=rid)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id=2**63 - 1)
    assert eng.add_request([5, 6, 7], SamplingParams(max_tokens=2)) != 2**63 - 1
    outs = eng.generate([[8, 9]], SamplingParams(max_tokens=3))  # the explicit id runs beside it
    assert len(outs[0].token_ids) == 3


def test_a_datastore_from_another_vocabulary_is_refused_at_start(model, tmp_path):
    """Drafted ids were never checked against the model: IndexError on every step."""
    tokens = np.array([5, 6, 7, 500, 600, sssd.SEPARATOR, 5, 6, 7, 8], dtype=np.uint32)
    sssd.Datastore.build(tokens, tmp_path / "ds")
    with pytest.raises(ValueError, match="another tokenizer"):
        LLMEngine(model, datastore=str(tmp_path / "ds"), config=EngineConfig(budget=4, max_model_len=128))


# -- the command line and shutdown --------------------------------------------------------------------


def _serve(model, tmp_path, *args):
    env = dict(os.environ, SSSD_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run(
        [sys.executable, "-m", "sssd.cli", "serve", "--model", str(model), "--datastore", "none", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "99999"], "--port must be in 1-65535"),
        (["--max-running", "0"], "--max-running must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1, got 0 (leave it out to use the"),
        (["--budget", "100000"], "--budget must be in"),
        (["--request-timeout", "-1"], "--request-timeout"),
        (["--datastore", "/nonexistent/ds"], "no such datastore"),
        (["--drafter", "/nonexistent.json"], "no such file"),
        (["--host", "no-such-host.invalid"], "cannot resolve"),
        (["--api-key", ""], "--api-key is empty"),
        (["--draft", "retrieval,self:snapkv:x"], "malformed draft source 'self:snapkv:x'"),
        (["--draft", "retrieval,model:tiny"], "--draft model:tiny: unknown model"),
        (["--draft", "recycle:x"], "malformed draft source"),
    ],
)
def test_serve_refuses_bad_arguments_before_loading_anything(model, tmp_path, args, message):
    r = _serve(model, tmp_path, *args)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr and "loading" not in r.stderr, r.stderr


def test_serve_refuses_a_port_in_use_before_loading(model, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _serve(model, tmp_path, "--port", str(s.getsockname()[1]))
    assert r.returncode == 1 and "cannot listen on" in r.stderr and "loading" not in r.stderr


def test_serve_help_explains_every_option_and_states_each_default_once(model, tmp_path):
    r = subprocess.run([sys.executable, "-m", "sssd.cli", "serve", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for option in ("--port", "--dtype", "--log-level", "--drain-timeout", "--public-metrics", "--reprofile"):
        assert option in text
    assert text.count("(default: 127.0.0.1)") <= 1 and "(default: loopback only) (default" not in text
    for chunk in text.split("--")[1:]:
        assert chunk.count("default:") <= 1, chunk


def test_sigterm_drains_then_ends_open_streams_cleanly(model, tmp_path):
    """SIGTERM with a stream in flight: the stream ends with an error event and [DONE] once the
    drain timeout passes (no cut connection), new requests get 503, and the server exits 0 with
    one summary line and no traceback."""
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
            "--no-speculate",
            "--max-model-len",
            "512",
            "--drain-timeout",
            "0.3",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    events: list[str] = []
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with httpx.Client(timeout=60) as c:
            with c.stream(
                "POST",
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 480, "stream": True, "ignore_eos": True, "temperature": 0},
            ) as r:
                lines = r.iter_lines()
                events.append(next(lines))
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                try:
                    refused = httpx.post(
                        f"http://127.0.0.1:{port}/v1/completions", json={"prompt": PROMPT}, timeout=5
                    ).status_code
                except httpx.HTTPError:
                    refused = "closed"  # the listener may already be closed: also a refusal
                events.extend(lines)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert refused in (503, "closed")
    data = [e for e in events if e.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert "error" in json.loads(data[-2][6:]) and "shut down" in data[-2]
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "CancelledError" not in err, err[-2000:]
    assert "server stopped: 0 of 1 requests in flight finished, 1 cut off" in err


# -- the planner's profile ---------------------------------------------------------------------------


def test_a_noisy_cached_profile_is_measured_again_and_records_its_conditions(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SSSD_PROFILE_DIR", raising=False)  # the default place: <cache>/profiles
    monkeypatch.setenv("SSSD_PROFILE_NOISY_SHARE", "0.8")  # 0.9 is noisy; this machine's real load is not
    cfg = dict(max_model_len=160, max_running=2)
    LLMEngine(model, datastore=None, config=EngineConfig(**cfg))
    (path,) = (tmp_path / "profiles").glob("forward-*.json")
    first = json.loads(path.read_text())
    cond = first["meta"]["conditions"]
    assert {"cpu_model", "cores", "other_processes_cpu_share", "loadavg_1m_before", "measured_unix"} <= set(cond)
    # a profile measured beside a busy process is not trusted: measured again at the next start
    first["meta"]["conditions"]["other_processes_cpu_share"] = 0.9
    first["seconds"][0][0] = 123.0
    path.write_text(json.dumps(first))
    LLMEngine(model, datastore=None, config=EngineConfig(**cfg))
    second = json.loads(path.read_text())
    assert second["seconds"][0][0] != 123.0 and second["meta"]["conditions"]["other_processes_cpu_share"] != 0.9
    # a sound one is reused, unless re-measuring is asked for
    LLMEngine(model, datastore=None, config=EngineConfig(**cfg))
    assert json.loads(path.read_text()) == second
    second["meta"]["conditions"]["measured_unix"] = 0
    path.write_text(json.dumps(second))
    LLMEngine(model, datastore=None, config=EngineConfig(reprofile=True, **cfg))
    assert json.loads(path.read_text())["meta"]["conditions"]["measured_unix"] > 0


# -- API fuzz ------------------------------------------------------------------------------------------


def _fuzz_bodies():
    from hypothesis import strategies as st

    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
        st.sampled_from([0, 1, -1, 2**63, 1e-40, 1e308, "w1 w2", PROMPT]),
    )
    value = st.recursive(
        scalar,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
        max_leaves=8,
    )
    fields = st.sampled_from(
        [
            "prompt",
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop",
            "stream",
            "n",
            "logprobs",
            "ignore_eos",
            "model",
            "echo",
            "stream_options",
            "presence_penalty",
            "unknown_field",
        ]
    )
    body = st.dictionaries(fields, value, max_size=6)
    # mostly valid requests with one field made bad
    near = st.builds(
        lambda k, v: {
            "prompt": PROMPT,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 3,
            "temperature": 0,
            k: v,
        },
        fields,
        value,
    )
    return st.one_of(body, near)


def test_api_fuzz_never_breaks_the_server_or_other_clients(server, model):
    """Random bodies (wrong types, NaN, huge numbers, nested junk, unknown fields) on both
    endpoints: every answer is a success or a 4xx in OpenAI's shape, never a 5xx, while a
    well-behaved client streams beside them and gets exactly its usual output."""
    from hypothesis import HealthCheck, given, settings

    want = offline(model, PROMPT, max_tokens=150, ignore_eos=True).text
    got = {}

    def stream():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            with c.stream(
                "POST",
                "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 150, "stream": True, "ignore_eos": True, "temperature": 0},
            ) as r:
                got["text"] = "".join(
                    json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines() if line.startswith("data: {")
                )

    statuses: dict[int, int] = {}
    client = raw(server)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=_fuzz_bodies())
    def fuzz(body):
        for path in ("/v1/completions", "/v1/chat/completions"):
            if body.get("stream") is True:
                body = dict(body, stream=False)  # a streamed 200 would only be read to its end
            r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400, 404), (path, body, r.status_code, r.text[:300])
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    t = threading.Thread(target=stream)
    t.start()
    fuzz()
    t.join(timeout=120)
    assert got["text"] == want
    assert statuses.get(400, 0) > 50 and statuses.get(200, 0) > 0, statuses
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_p=float("nan")),
        dict(top_p=0.0),
        dict(top_k=-2),
        dict(top_k=1.5),
        dict(max_tokens=0),
        dict(max_tokens=True),
        dict(seed=2**64),
        dict(seed=1.0),
        dict(stop=("",)),
        dict(stop=("x",) * 65),
        dict(stop_token_ids=(-1,)),
    ],
)
def test_sampling_params_refuse_values_the_engine_cannot_honour(kw):
    with pytest.raises(ValueError, match="invalid sampling parameters"):
        SamplingParams(**kw)


def test_sampling_params_normalise_what_they_accept():
    assert SamplingParams(top_k=-1).top_k == 0  # -1: off, as in vLLM
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
