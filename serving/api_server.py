"""OpenAI-compatible HTTP server over the SSSD engine (FastAPI).

Endpoints: POST /v1/completions and /v1/chat/completions (streaming as
server-sent events in OpenAI's chunk format, or one JSON response),
GET /v1/models, GET /health, GET /metrics (Prometheus text format, with
vLLM-compatible speculative-decoding counter names).

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}:
400 invalid request (bad parameters, oversize prompt, unsupported options),
401 missing or wrong API key, 404 unknown model, 429 queue full and 503
shutting down (both with Retry-After), 504 request timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from sssd.serving.async_engine import AsyncEngine, ShuttingDown
from sssd.serving.metrics import render_metrics
from sssd.serving.params import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers


def error_response(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


class _Common(BaseModel):
    # Fields OpenAI clients send that we accept and ignore (user, ...) are allowed;
    # options we cannot honour are refused explicitly below.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    ignore_eos: bool = False
    stream_options: dict | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, request_timeout: float = 600.0,
               max_tokens_default: int = 256) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown(grace=5.0)  # uvicorn already drained in-flight HTTP requests

    app = FastAPI(title="SSSD", version="1", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine = engine
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(APIError(400, f"invalid request: {loc}: {first.get('msg', 'malformed body')}", param=loc or None))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                               "authentication_error", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok", "running": engine.num_running, "waiting": engine.num_waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "sssd"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    def check_common(req: _Common, max_tokens: int | None) -> SamplingParams:
        if req.model not in (None, model_name):
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")
        if req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        if req.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if req.presence_penalty or req.frequency_penalty:
            raise APIError(400, "presence and frequency penalties are not supported", param="presence_penalty")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            return SamplingParams(max_tokens=max_tokens or max_tokens_default, temperature=req.temperature, top_p=req.top_p,
                                  top_k=max(req.top_k, 0), seed=req.seed, stop=stop, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def start(prompt, params: SamplingParams):
        try:
            return await engine.add(prompt, params)
        except OverflowError as e:
            raise APIError(429, f"{e}; retry later", "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        except ShuttingDown as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": "5"})
        except ValueError as e:
            code = "context_length_exceeded" if "serves at most" in str(e) else None
            raise APIError(400, str(e), param="prompt" if code else None, code=code)

    async def collect(rid: int, queue: asyncio.Queue, request: Request):
        """Waits for the whole output; aborts on client disconnect or timeout."""
        last = None

        async def consume():
            nonlocal last
            async for out in engine.stream(rid, queue):
                last = out

        task = asyncio.create_task(consume())
        deadline = time.monotonic() + request_timeout
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
            if time.monotonic() > deadline:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(504, f"the request timed out after {request_timeout:g} s", "timeout", code="timeout")
            await asyncio.wait({task}, timeout=0.1)
        task.result()
        return last

    def usage(out) -> dict:
        return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}

    def finish(out) -> str | None:
        return {"abort": "abort", "error": "error"}.get(out.finish_reason, out.finish_reason) if out.finished else None

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream_response(rid, queue, make_chunk, first_chunk=None, include_usage=False):
        async def events():
            last = None
            deadline = time.monotonic() + request_timeout
            try:
                if first_chunk is not None:
                    yield sse(first_chunk)
                async for out in engine.stream(rid, queue):
                    last = out
                    if out.new_text or out.finished:
                        yield sse(make_chunk(out))
                    if time.monotonic() > deadline:
                        yield sse({"error": {"message": f"the request timed out after {request_timeout:g} s",
                                             "type": "timeout", "param": None, "code": "timeout"}})
                        break
                if include_usage and last is not None:
                    chunk = make_chunk(last)
                    chunk["choices"], chunk["usage"] = [], usage(last)
                    yield sse(chunk)
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:  # client went away: engine.stream's cleanup aborts the request
                raise

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        params = check_common(req, req.max_tokens)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        rid, queue = await start(prompt, params)
        cid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(out):
            return {"id": cid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": 0, "text": out.new_text, "logprobs": None, "finish_reason": finish(out)}]}

        if req.stream:
            return stream_response(rid, queue, chunk, include_usage=bool((req.stream_options or {}).get("include_usage")))
        out = await collect(rid, queue, request)
        if out is None:
            return PlainTextResponse("", status_code=499)
        return {"id": cid, "object": "text_completion", "created": now, "model": model_name,
                "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": finish(out)}],
                "usage": usage(out), "sssd": out.stats}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        params = check_common(req, req.max_completion_tokens or req.max_tokens)
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # OpenAI content parts: text only
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            messages.append({"role": m.role, "content": content or ""})
        rid, queue = await start(messages, params)
        cid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(out):
            return {"id": cid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [{"index": 0, "delta": {"content": out.new_text} if out.new_text else {},
                                 "finish_reason": finish(out)}]}

        if req.stream:
            first = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            return stream_response(rid, queue, chunk, first,
                                   include_usage=bool((req.stream_options or {}).get("include_usage")))
        out = await collect(rid, queue, request)
        if out is None:
            return PlainTextResponse("", status_code=499)
        return {"id": cid, "object": "chat.completion", "created": now, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text}, "finish_reason": finish(out)}],
                "usage": usage(out), "sssd": out.stats}

    return app
